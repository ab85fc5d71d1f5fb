"""The supported vLLM versions, checked once at import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvoffload.errors import NotSupportedError
from kvoffload.vllm.compat import SUPPORTED, check_version


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.33.1.dev12+g1234abc", "0.32.3rc1"])
def test_supported_versions_pass(version: str) -> None:
    check_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0", "dev"])
def test_other_versions_stop_with_the_range(version: str) -> None:
    with pytest.raises(NotSupportedError) as err:
        check_version(version)
    assert str(err.value) == (
        f"kvoffload supports vLLM >=0.32,<0.34; this environment has vLLM {version}"
    )


def test_import_stops_on_another_version() -> None:
    """What vLLM's connector loading shows: one line naming the range, before any adapter
    imports a name that version lacks."""
    code = "import vllm; vllm.__version__ = '0.35.0'; import kvoffload.vllm"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "kvoffload.errors.NotSupportedError: kvoffload supports vLLM "
        f"{SUPPORTED}; this environment has vLLM 0.35.0"
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from rig import write_model_dir

    return write_model_dir(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.mark.parametrize("is_async", [False, True])
def test_request_blocks_reads_a_step_as_vllm_033_does(model_dir: str, is_async: bool) -> None:
    """On vLLM 0.33, whose `yield_req_data` already means "whole table", ours yields the same
    triples in every step: new requests, running ones, and "b" preempted (16 usable GPU blocks,
    two requests that outgrow them) and handed its whole table again. The 0.32 side is the
    real-engine suite's (tests/e2e)."""
    from rig import make_rig, prompt
    from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

    from kvoffload.vllm.compat import request_blocks

    rig = make_rig(model_dir, is_async=is_async, num_gpu_blocks=17)
    steps = 0
    whole_tables: list[str] = []
    preempted: set[str] = set()

    def compare(rig, so):
        nonlocal steps
        ours = list(request_blocks(so))
        assert ours == list(yield_req_data(so))
        steps += 1
        whole_tables.extend(rid for rid, _, whole in ours if whole)
        preempted.update(so.preempted_req_ids or ())

    rig.before_worker = compare
    rig.add("a", prompt(1, 24), 40)
    rig.add("b", prompt(2, 24), 40)
    rig.run()
    assert preempted == {"b"}
    assert whole_tables == ["a", "b", "b"]
    assert steps > 40


def test_the_spec_fills_vllm_033s_cpu_info_labels(model_dir: str) -> None:
    """vLLM 0.33 publishes `vllm:kv_offload_config_info` from the manager's `config_info()`:
    KVOffloadSpec's manager fills the CPU tier's labels as vLLM's CPU spec does (on 0.32 there is
    no such metric and both helpers give nothing)."""
    from rig import BLOCK_BYTES, BPC, make_rig
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo

    from kvoffload.vllm.compat import cpu_config_info_keys

    rig = make_rig(model_dir, connector="spec", cpu_chunks=64)
    (info,) = rig.scheduler.connector.connector_scheduler.manager.config_info()
    assert cpu_config_info_keys() == CPUOffloadingInfo.config_info_keys()
    assert tuple(info) == cpu_config_info_keys()
    assert (info["cpu_num_chunks"], info["cpu_blocks_per_chunk"]) == (64, BPC)
    assert info["cpu_kv_cache_size_bytes"] == 64 * BPC * BLOCK_BYTES
