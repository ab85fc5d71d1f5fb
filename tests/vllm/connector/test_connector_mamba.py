"""A Mamba model ("align" mode: Mamba group 0, full-attention group 1) through both seams on
vLLM's real scheduler with its hybrid KV-cache manager on: 4-token blocks, 12-token chunks,
24-token steps. The rig runs the Mamba states as vLLM's runner does (one state block per
request, moved on every step) and checks, before every forward pass, the state the step reads
and every cached position of the full-attention group.

vLLM hands a Mamba state over where it keeps one: under its default
`prefix_cache_retention_interval=0` only at the prompt's replay boundary (`num_prompt_tokens - 1`
on a block), densely (`None`) wherever a step ends on a block. A state is stored when that is a
chunk boundary, under that chunk's key. A 61-token prompt stores the state after 60 tokens and 5
full-attention chunks; a repeat of it hits 60 tokens (the hit stops one token short of the
prompt and on a chunk). Every scenario is also run through vLLM's own OffloadingConnector (CPU
spec), which must decide the same.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rig import Rig, prompt
from test_connector_hybrid import (
    abort_then_repeat,
    hybrid_rig,
    model_outputs,
    outcome,
    per_group,
    repeat,
)

from kvoffload.errors import ConfigError
from kvoffload.scheduler import KVGroup
from kvoffload.vllm.connector.worker_side import WorkerSide

MAMBA, FULL = 0, 1
N = 61


def mamba_rig(model_dir: str, seam: str, is_async: bool, **kw: Any) -> Rig:
    kw.setdefault("max_num_batched_tokens", 24)
    return hybrid_rig(model_dir, seam, is_async, geometry="full+mamba", **kw)


def mamba_repeat(model_dir: str, seam: str, is_async: bool, *args: Any, **kw: Any) -> Rig:
    kw.setdefault("max_num_batched_tokens", 24)
    kw.setdefault("n", N)
    return repeat(model_dir, seam, is_async, *args, geometry="full+mamba", **kw)


@pytest.mark.parametrize(
    ("params", "b_extra", "expected"),
    [
        (None, 0, (60, {MAMBA: 1, FULL: 5}, {MAMBA: 1, FULL: 5})),
        # 97 tokens: b hits a's state and stores its own, after 96, and 3 more chunks.
        (None, 36, (60, {MAMBA: 2, FULL: 8}, {MAMBA: 1, FULL: 5})),
        # A cap of 60 ends at 59, on chunk 3 (48): no state is stored there.
        ({"max_load_tokens": 60}, 0, (0, {MAMBA: 1, FULL: 5}, {})),
        # local + cap - 1 ends exactly on chunk 4's boundary, where the state is.
        ({"max_load_tokens": 61}, 0, (60, {MAMBA: 1, FULL: 5}, {MAMBA: 1, FULL: 5})),
        ({"max_load_tokens": 13}, 0, (0, {MAMBA: 1, FULL: 5}, {})),
        ({"max_load_tokens": 0}, 0, (0, {MAMBA: 1, FULL: 5}, {})),
        ({"max_load_tokens": 1000}, 0, (60, {MAMBA: 1, FULL: 5}, {MAMBA: 1, FULL: 5})),
        # The state after 60 is past the cap: 2 full-attention chunks and nothing to hit.
        ({"max_offload_tokens": 24}, 0, (0, {FULL: 2}, {})),
        ({"max_offload_tokens": 60}, 0, (60, {MAMBA: 1, FULL: 5}, {MAMBA: 1, FULL: 5})),
        ({"max_offload_tokens": 0}, 0, (0, {}, {})),
    ],
)
def test_seed_controls_on_a_mamba_model(model_dir, is_async, any_seam, params, b_extra, expected):
    rig = mamba_repeat(model_dir, any_seam, is_async, params, b_extra=b_extra)
    assert outcome(rig) == expected
    assert rig.outputs["b"] == model_outputs(prompt(1, N) + prompt(2, b_extra), 2)


@pytest.mark.parametrize("retention", [None, 24])
def test_retained_states_serve_shorter_hits(model_dir, is_async, any_seam, retention):
    """Densely (or every 24 tokens) the states after 24, 48 and 60 are kept and stored: a cap of
    60 (hit limit 59) then finds the one after 48."""
    rig = mamba_repeat(
        model_dir, any_seam, is_async, {"max_load_tokens": 60}, retention_interval=retention
    )
    assert outcome(rig) == (48, {MAMBA: 3, FULL: 5}, {MAMBA: 1, FULL: 4})
    assert rig.outputs["b"] == model_outputs(prompt(1, N), 2)


@pytest.mark.parametrize(("prompt_only", "full_chunks"), [(True, 5), (False, 6)])
def test_offload_prompt_only_on_a_mamba_model(
    model_dir, is_async, any_seam, prompt_only, full_chunks
):
    """20 output tokens: without prompt_only the full-attention group stores chunk 5 too; the
    state is kept only at the prompt's replay boundary either way."""
    rig = mamba_repeat(
        model_dir, any_seam, is_async, output=20, extra={"offload_prompt_only": prompt_only}
    )
    assert outcome(rig) == (60, {MAMBA: 1, FULL: full_chunks}, {MAMBA: 1, FULL: 5})


def test_chunked_prefill_stores_the_state_at_the_replay_boundary(model_dir, is_async, any_seam):
    """A 100-token prompt in 16-token steps: vLLM keeps the state after 96 (the replay boundary
    99 on a block); b loads 96 tokens and reads that state."""
    rig = mamba_repeat(model_dir, any_seam, is_async, n=100, max_num_batched_tokens=16)
    assert outcome(rig) == (96, {MAMBA: 1, FULL: 8}, {MAMBA: 1, FULL: 8})


def test_a_tiny_tier_evicts_and_serves_right(model_dir, is_async, any_seam):
    """2 slots (16 KiB: vLLM rounds its 6 KiB chunks up to 8 KiB) for a 61-token prompt's 6
    chunks (5 full-attention, 1 state): what is stored evicts the prefix's head, so b hits
    nothing. Synchronously the state's store finds the slot of chunk 1 free to evict (chunks
    complete a step earlier); asynchronously the tail chunks take both slots first."""
    rig = mamba_repeat(model_dir, any_seam, is_async, extra={"cpu_bytes_to_use": 16 << 10})
    stored = {FULL: 5} if is_async else {MAMBA: 2, FULL: 3}
    assert outcome(rig) == (0, stored, {})
    assert rig.outputs["b"] == model_outputs(prompt(1, N), 2)


def test_a_local_prefix_loads_only_the_rest(model_dir, is_async, any_seam):
    """After a GPU reset, "c" leaves a's first 24 tokens and the state after them in the GPU
    prefix cache: b hits them locally and loads the next 36 tokens, full-attention chunks 2..4
    (9 blocks) and the state after 60 (1 block)."""
    rig = mamba_rig(model_dir, any_seam, is_async)
    rig.add("a", prompt(1, N), 2)
    rig.run()
    rig.reset_gpu_prefix_cache()
    rig.add("c", prompt(1, 24) + prompt(4, 4), 1, {"max_load_tokens": 0})
    rig.run()
    rig.add("b", prompt(1, N) + prompt(5, 6), 2)
    rig.run()
    assert rig.external_hits["b"] == 36
    assert per_group(rig.loaded_keys["b"]) == {MAMBA: 1, FULL: 3}
    assert len(rig.load_of("b").gpu_block_ids) == 1 + 9
    # vLLM computes up to the block of the replay boundary (66) first, to keep its state.
    assert next(s["b"] for s in rig.scheduled if "b" in s) == 64 - 60
    assert rig.outputs["b"] == model_outputs(prompt(1, N) + prompt(5, 6), 2)


def test_preempted_requests_reload_and_stay_exact(model_dir, is_async, any_seam):
    """Two 73-token prompts in 24-token steps; after step 5 (r0 decoding, r1 20 tokens in) a reset
    of the running requests preempts both and empties the GPU (its bytes zeroed). r0 reloads the
    state after 72 (its replay boundary) and 6 chunks and computes its 3 tokens past them; r1
    had stored no state, so it recomputes. Every byte is checked and the fake model's outputs
    come out."""
    rig = mamba_rig(model_dir, any_seam, is_async)
    preempted: set[str] = set()
    rig.before_worker = lambda rig, so: preempted.update(so.preempted_req_ids or ())
    prompts = {f"r{i}": prompt(10 + i, 61) + prompt(20, 12) for i in range(2)}
    for rid, tokens in prompts.items():
        rig.add(rid, tokens, 4)
    for _ in range(5):
        so = rig.scheduler.schedule()
        rig._apply(so, rig._execute(so))
    assert rig.scheduler.reset_prefix_cache(reset_running_requests=True)
    for t in rig.kv_caches.values():
        t.zero_()
    rig.run()
    assert preempted == {"r0", "r1"}
    assert {r: per_group(k) for r, k in rig.loaded_keys.items()} == {"r0": {MAMBA: 1, FULL: 6}}
    assert next(s["r0"] for s in rig.scheduled[5:] if "r0" in s) == 75 - 72
    for rid, tokens in prompts.items():
        assert rig.outputs[rid] == model_outputs(tokens, 4)


def test_an_abort_with_a_store_in_flight_leaves_a_loadable_prefix(model_dir, is_async, seam):
    """ "a" is aborted right after the step that computed its prompt, the state's store planned
    but not yet submitted: it still reaches the tier intact, and b loads it."""
    rig = abort_then_repeat(mamba_rig(model_dir, seam, is_async), N)
    assert rig.external_hits["b"] == 60
    assert rig.checked_positions["b"] >= 60


@pytest.mark.parametrize("seam_", ["spec", "vllm"])
def test_sync_loads_of_a_mamba_model(model_dir, is_async, seam_):
    """vLLM's `sync_load_budget_bytes` (its connector's option, so through KVOffloadSpec): b's
    load runs within its step, the state included, and the bytes it reads are checked."""
    rig = mamba_repeat(model_dir, seam_, is_async, extra={"sync_load_budget_bytes": 1 << 30})
    assert outcome(rig) == (60, {MAMBA: 1, FULL: 5}, {MAMBA: 1, FULL: 5})
    b_steps = [i for i, s in enumerate(rig.scheduled) if "b" in s]
    assert rig.scheduled[b_steps[0]]["b"] == N - 60


def test_the_rig_checks_the_state_a_step_reads(model_dir):
    """The check has teeth: b's loaded state spoiled before its first step fails that step."""
    rig = mamba_rig(model_dir, "kvoffload", False)
    rig.add("a", prompt(1, N), 2)
    rig.run()
    assert rig.scheduler.reset_prefix_cache()

    def spoil(rig: Rig, so: Any) -> None:
        if "b" in so.num_scheduled_tokens:
            state = list(rig.kv_caches.values())[rig.layer_groups[MAMBA][0]]
            state[rig._tables_of("b")[MAMBA][(60 - 1) // rig.tpb]].zero_()

    rig.before_worker = spoil
    rig.add("b", prompt(1, N), 2)
    with pytest.raises(AssertionError, match="reads the state after 60 tokens"):
        rig.run()


def test_a_mamba_layer_alone_in_its_memory_is_copied_as_a_whole_page():
    """With more Mamba layers than attention layers, vLLM's layout leaves a Mamba layer alone in
    its memory: the worker views its pages as an attention layer's (vLLM pads both to one page),
    and copies a layer that shares its memory only once, through the attention view."""
    blocks, page = 8, 1024
    raw = torch.zeros(2 * blocks * page, dtype=torch.uint8)
    shared, alone = raw[: blocks * page], raw[blocks * page :]
    attention = shared.view(torch.float16).view(blocks, 2, 4, 2, 32)

    def state(region: torch.Tensor) -> torch.Tensor:
        return region.as_strided((blocks, 1, 1, 768), (page, 768, 768, 1))

    side = WorkerSide(
        SimpleNamespace(groups=(KVGroup("mamba"), KVGroup()), group_layers=(("m0", "m1"), ("a0",)))
    )
    pages = side._unique_pages({"m0": state(shared), "a0": attention, "m1": state(alone)})
    assert list(pages) == ["a0", "m1"]
    assert pages["a0"] is attention
    m1 = pages["m1"]
    assert (m1.shape, m1.stride(), m1.dtype) == (attention.shape, attention.stride(), torch.float16)
    assert m1.data_ptr() == alone.data_ptr()
    m1[3].fill_(7)
    assert bool((alone[3 * page : 4 * page].view(torch.float16) == 7).all())
    assert not alone[: 3 * page].any()

    squeezed = alone.as_strided((blocks, 1, 1, 768), (768, 768, 768, 1))
    with pytest.raises(ConfigError, match="Mamba layer m1 has 8 blocks 768 bytes apart"):
        side._unique_pages({"a0": attention, "m1": squeezed})
