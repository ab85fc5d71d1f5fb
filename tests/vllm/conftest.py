"""The vLLM-driven tests. They need vLLM 0.33 (`make test` installs it); without it they skip,
except under CI=true, where a missing vLLM is an error."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

try:
    import vllm.config  # noqa: F401
except ImportError:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise
    collect_ignore_glob = ["test_*.py", "*/test_*.py"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from rig import write_model_dir

    return write_model_dir(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def is_async(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture(params=["kvoffload", "spec"])
def seam(request: pytest.FixtureRequest) -> str:
    """Our connector end to end, or our manager and worker inside vLLM's OffloadingConnector."""
    return str(request.param)


@pytest.fixture(params=["kvoffload", "spec", "vllm"])
def any_seam(request: pytest.FixtureRequest) -> str:
    """Ours (both seams), and vLLM's own connector as the reference."""
    return str(request.param)


@pytest.fixture
def kv_router() -> Iterator[Any]:
    """A router subscribed to nothing yet (`kv_router.KVRouter`), hashing as the rig does."""
    from rig import TPB, TPC
    from router_rig import HASHER

    from kv_router import router

    with router(TPB, TPC, HASHER) as kv:
        yield kv
