"""A hybrid model (sliding-window group 0, window 20 tokens; full-attention group 1) through both
seams on vLLM's real scheduler with its hybrid KV-cache manager on: 4-token blocks, 12-token
chunks. The rig checks, before every forward pass, the bytes each group's attention reads.

A sliding-window group stores only the chunks a later hit reads: with vLLM's default
`prefix_cache_retention_interval=0` the 5 blocks (window - 1 = 19 tokens) before the chunk
boundary below the prompt's last token. A 60-token prompt stores its 5 full-attention chunks and
sliding chunks 2 and 3 (blocks 7..11); a repeat of it hits 48 tokens (4 chunks: the hit stops one
token short of the prompt and on a chunk), loading 4 full-attention chunks and sliding chunks 2
and 3. Every scenario is also run through vLLM's own OffloadingConnector (CPU spec), which must
decide the same.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from rig import NoCopyWorker, Rig, make_rig, next_token, prompt
from vllm.v1.request import RequestStatus

SLIDING, FULL = 0, 1


def model_outputs(tokens: list[int], n: int) -> list[int]:
    """What the fake model generates after `tokens`: what every request must get."""
    tokens = list(tokens)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[-n:]


def per_group(keys: list[bytes]) -> dict[int, int]:
    return dict(sorted(Counter(int.from_bytes(k[-4:], "big") for k in keys).items()))


def hybrid_rig(model_dir: str, seam: str, is_async: bool, **kw: Any) -> Rig:
    kw.setdefault("geometry", "full+swa")
    return make_rig(
        model_dir,
        connector=seam,
        is_async=is_async,
        window=20,
        vllm_worker=NoCopyWorker,
        verify=seam != "vllm",
        **kw,
    )


def repeat(
    model_dir: str,
    seam: str,
    is_async: bool,
    params: dict[str, Any] | None = None,
    *,
    n: int = 60,
    output: int = 3,
    b_extra: int = 0,
    **kw: Any,
) -> Rig:
    """ "a" computes a prompt of `n` tokens; the GPU prefix cache is emptied; "b" asks for the same
    prompt (plus `b_extra` tokens)."""
    rig = hybrid_rig(model_dir, seam, is_async, **kw)
    rig.add("a", prompt(1, n), output, params)
    rig.run()
    assert rig.scheduler.reset_prefix_cache()
    for t in rig.kv_caches.values():
        t.zero_()
    rig.add("b", prompt(1, n) + prompt(2, b_extra), 2, params)
    rig.run()
    return rig


def outcome(rig: Rig) -> tuple[int, dict[int, int], dict[int, int]]:
    """Tokens b loaded, chunks stored per group, chunks b loaded per group."""
    return (
        rig.external_hits["b"],
        per_group(rig.stored_keys),
        per_group(rig.loaded_keys.get("b", [])),
    )


@pytest.mark.parametrize(
    ("params", "b_extra", "expected"),
    [
        (None, 0, (48, {SLIDING: 2, FULL: 5}, {SLIDING: 2, FULL: 4})),
        # b's longer prompt stores two more sliding chunks before its own boundary.
        (None, 30, (48, {SLIDING: 4, FULL: 7}, {SLIDING: 2, FULL: 4})),
        # A cap is local + max_load_tokens - 1, on a chunk: 48 leaves 36, where no window is.
        ({"max_load_tokens": 48}, 0, (0, {SLIDING: 2, FULL: 5}, {})),
        ({"max_load_tokens": 49}, 0, (48, {SLIDING: 2, FULL: 5}, {SLIDING: 2, FULL: 4})),
        ({"max_load_tokens": 13}, 0, (0, {SLIDING: 2, FULL: 5}, {})),
        ({"max_load_tokens": 0}, 0, (0, {SLIDING: 2, FULL: 5}, {})),
        ({"max_load_tokens": 1000}, 0, (48, {SLIDING: 2, FULL: 5}, {SLIDING: 2, FULL: 4})),
        # 24 tokens reach no sliding chunk a hit reads: nothing to load.
        ({"max_offload_tokens": 24}, 0, (0, {FULL: 2}, {})),
        ({"max_offload_tokens": 48}, 0, (48, {SLIDING: 2, FULL: 4}, {SLIDING: 2, FULL: 4})),
        ({"max_offload_tokens": 0}, 0, (0, {}, {})),
    ],
)
def test_seed_controls_on_a_hybrid_model(model_dir, is_async, any_seam, params, b_extra, expected):
    rig = repeat(model_dir, any_seam, is_async, params, b_extra=b_extra)
    assert outcome(rig) == expected
    assert rig.outputs["b"] == model_outputs(prompt(1, 60) + prompt(2, b_extra), 2)


@pytest.mark.parametrize(("prompt_only", "full_chunks"), [(True, 5), (False, 6)])
def test_offload_prompt_only_on_a_hybrid_model(
    model_dir, is_async, any_seam, prompt_only, full_chunks
):
    """20 output tokens: without prompt_only the full group stores chunk 5 too; the sliding
    group keeps its tail at the prompt's boundary either way."""
    rig = repeat(
        model_dir, any_seam, is_async, output=20, extra={"offload_prompt_only": prompt_only}
    )
    assert outcome(rig) == (48, {SLIDING: 2, FULL: full_chunks}, {SLIDING: 2, FULL: 4})


def test_chunked_prefill_stores_what_the_window_still_holds(model_dir, is_async, any_seam):
    """A 100-token prompt in 16-token steps: the sliding group frees blocks behind its window
    (vLLM hands them out again) while the prompt runs; its tail chunks 6 and 7 before the
    boundary at 96 are stored before that, and b loads 96 tokens whose bytes are checked."""
    rig = repeat(model_dir, any_seam, is_async, n=100, max_num_batched_tokens=16)
    assert outcome(rig) == (96, {SLIDING: 2, FULL: 8}, {SLIDING: 2, FULL: 8})


def test_reallocated_window_blocks_fence_the_stores_reading_them(model_dir, seam):
    """Every store still in flight when vLLM hands one of its sliding-window blocks to a request
    again is in that step's flush list (the worker waits for it before the forward pass)."""
    rig = hybrid_rig(model_dir, seam, False, max_num_batched_tokens=16, num_gpu_blocks=40)
    rig.add("a", prompt(1, 100), 3)
    rig.add("c", prompt(3, 90), 3)
    sliding_reads: dict[int, set[int]] = {}
    fenced = 0

    def watch(rig: Rig, so: Any) -> None:
        nonlocal fenced
        meta = so.kv_connector_metadata
        new = set()
        for req in so.scheduled_new_reqs:
            new.update(req.block_ids[SLIDING])
        cached = so.scheduled_cached_reqs
        for blocks in cached.new_block_ids:
            if blocks is not None:
                new.update(blocks[SLIDING])
        flush = rig.flushed_job_ids(meta)
        for job_id, blocks in sliding_reads.items():
            if blocks & new:
                assert job_id in flush, (rig.step, job_id, blocks & new)
                fenced += 1
        sliding_reads.clear()
        for job_id, blocks in _sliding_store_blocks(rig, meta).items():
            sliding_reads[job_id] = blocks

    rig.before_worker = watch
    rig.run()
    assert fenced > 0  # the scenario does reuse blocks under stores in flight
    assert rig.outputs["a"] and rig.outputs["c"]


def _sliding_store_blocks(rig: Rig, meta: Any) -> dict[int, set[int]]:
    """The sliding-window blocks each store job of `meta` reads, whichever seam."""
    out = {}
    if hasattr(meta, "stores"):
        for job in meta.stores:
            start = 0
            for part in job.parts:
                blocks = job.gpu_block_ids[start : start + part.num_blocks]
                start += part.num_blocks
                if part.group == SLIDING:
                    out[job.job_id] = {int(b) for b in blocks} - {0}
    else:
        for job_id, job in meta.store_jobs.items():
            size = job.src_spec.group_sizes[SLIDING]
            out[job_id] = {int(b) for b in job.src_spec.block_ids[:size]}
    return out


def test_a_tiny_tier_stores_nothing_and_serves_right(model_dir, is_async, any_seam):
    """3 slots: a 100-token prompt offers more chunks than fit (vLLM refuses the batch)."""
    rig = repeat(model_dir, any_seam, is_async, n=100, cpu_chunks=3)
    assert outcome(rig) == (0, {}, {})
    assert len(rig.outputs["b"]) == 2


def test_a_local_prefix_loads_only_the_rest(model_dir, is_async, any_seam):
    """After a GPU reset, "c" leaves a's first 16 tokens (4 blocks, one into chunk 1) in the GPU
    prefix cache: b hits them locally and loads the next 32 tokens, full-attention chunks 1..3
    less the local block (8 blocks) and sliding chunks 2 and 3 from block 7 (5 blocks)."""
    rig = hybrid_rig(model_dir, any_seam, is_async)
    rig.add("a", prompt(1, 60), 2)
    rig.run()
    assert rig.scheduler.reset_prefix_cache()
    for t in rig.kv_caches.values():
        t.zero_()
    rig.add("c", prompt(1, 18) + prompt(4, 4), 1, {"max_load_tokens": 0})
    rig.run()
    rig.add("b", prompt(1, 60) + prompt(5, 6), 2)
    rig.run()
    assert rig.external_hits["b"] == 32
    assert per_group(rig.loaded_keys["b"]) == {SLIDING: 2, FULL: 3}
    assert len(rig.load_of("b").gpu_block_ids) == 8 + 5
    assert next(s["b"] for s in rig.scheduled if "b" in s) == 66 - 48
    assert rig.outputs["b"] == model_outputs(prompt(1, 60) + prompt(5, 6), 2)


def test_preempted_requests_reload_and_stay_exact(model_dir, is_async, any_seam):
    """Two 80-token prompts in 64-token steps; after step 3 (outputs applied) a reset of the
    running requests preempts both and empties the GPU (its bytes zeroed): they reload what they
    had stored, every byte checked, and the fake model's outputs come out."""
    rig = hybrid_rig(model_dir, any_seam, is_async, max_num_batched_tokens=64)
    preempted: list[str] = []
    rig.before_worker = lambda rig, so: preempted.extend(so.preempted_req_ids or ())
    prompts = {f"r{i}": prompt(10 + i, 60) + prompt(20, 20) for i in range(2)}
    for rid, tokens in prompts.items():
        rig.add(rid, tokens, 4)
    for _ in range(3):
        so = rig.scheduler.schedule()
        rig._apply(so, rig._execute(so))
    assert rig.scheduler.reset_prefix_cache(reset_running_requests=True)
    for t in rig.kv_caches.values():
        t.zero_()
    rig.run()
    # vLLM admits r1 only once r0 is done. r0 had 82 tokens: it reloads 6 chunks (72 tokens,
    # the hit stopping short of its last token), its sliding tail among them, and computes 10.
    assert preempted == ["r0"]
    assert per_group(rig.loaded_keys["r0"]) == {SLIDING: 2, FULL: 6}
    assert next(s["r0"] for s in rig.scheduled[3:] if "r0" in s) == 10
    for rid, tokens in prompts.items():
        assert rig.outputs[rid] == model_outputs(tokens, 4)


def test_an_abort_with_a_store_in_flight_leaves_a_loadable_prefix(model_dir, is_async, seam):
    """ "a" is aborted right after the step that computed its prompt, its store planned but not
    yet submitted: its chunks still reach the tier intact, and b loads them."""
    rig = abort_then_repeat(hybrid_rig(model_dir, seam, is_async), 60)
    assert rig.external_hits["b"] == 48
    assert rig.checked_positions["b"] >= 59


def abort_then_repeat(rig: Rig, n: int) -> Rig:
    """ "a" (a prompt of `n` tokens, 10 to generate) is aborted once its prompt is computed; the
    GPU prefix cache is emptied; "b" asks for the same prompt."""
    request = rig.add("a", prompt(1, n), 10)
    while request.num_computed_tokens < n:
        assert rig.step_once()
    rig.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    rig.run()
    assert len(rig.outputs["a"]) < 10
    rig.reset_gpu_prefix_cache()
    rig.add("b", prompt(1, n), 2)
    rig.run()
    return rig


@pytest.mark.parametrize("seam_", ["spec", "vllm"])
def test_sync_loads_of_every_group_land_before_the_forward_pass(model_dir, is_async, seam_):
    """vLLM's `sync_load_budget_bytes` (its connector's option, so through KVOffloadSpec): b's
    load of both groups runs within its step, expedited, and the bytes it reads are checked."""
    rig = repeat(model_dir, seam_, is_async, extra={"sync_load_budget_bytes": 1 << 30})
    assert outcome(rig) == (48, {SLIDING: 2, FULL: 5}, {SLIDING: 2, FULL: 4})
    b_steps = [i for i, s in enumerate(rig.scheduled) if "b" in s]
    # A sync load is scheduled with the request: no step waits for it.
    assert rig.scheduled[b_steps[0]]["b"] == 60 - 48
    assert rig.metas[b_steps[0]].load_jobs


def test_eagle_groups_store_their_last_chunk_only_once_the_request_finished(
    model_dir, is_async, any_seam
):
    """With EAGLE draft layers (vLLM groups them with the full-attention layers: groups 1 and 2
    are EAGLE groups) a decoding request's last chunk is volatile: a rejected draft may rewrite
    its KV. With offload_prompt_only false and 30 output tokens, the EAGLE groups lag one chunk
    behind what is computed while "a" decodes, and store that chunk when it finishes (89 tokens:
    7 chunks)."""
    rig = hybrid_rig(
        model_dir,
        any_seam,
        is_async,
        geometry="full+swa+draft",
        num_gpu_blocks=96,
        extra={"offload_prompt_only": False},
    )
    request = rig.add("a", prompt(1, 60), 30)
    while request.num_computed_tokens < 86:
        assert rig.step_once()
    # 86 tokens: 7 whole chunks computed, the 7th (volatile) not stored yet.
    assert per_group(rig.stored_keys) == {SLIDING: 2, 1: 6, 2: 6}
    rig.run()
    assert per_group(rig.stored_keys) == {SLIDING: 2, 1: 7, 2: 7}
    assert rig.scheduler.reset_prefix_cache()
    for t in rig.kv_caches.values():
        t.zero_()
    rig.add("b", prompt(1, 60), 2)
    rig.run()
    assert rig.external_hits["b"] == 48
    assert per_group(rig.loaded_keys["b"]) == {SLIDING: 2, 1: 4, 2: 4}


def test_a_reset_while_a_window_freed_blocks_stores_none_of_them_again(model_dir, is_async):
    """ "a" decodes long after storing its window tail; its window has freed those blocks and
    vLLM gave them to "c". A connector reset (the GPU reset fails: a runs) restarts a's stores
    at chunk 0: the freed ids below its old frontier must not be stored again (they hold c's
    KV). b, a's prompt, then loads only KV that is a's (the rig checks every byte).

    vLLM's own connector zeroes stale ids only from the frontier on, so through KVOffloadSpec
    (vLLM's scheduler logic) this case stores c's KV under a's keys: not tested there."""
    rig = hybrid_rig(
        model_dir, "kvoffload", is_async, num_gpu_blocks=64, max_num_batched_tokens=256
    )
    rig.add("a", prompt(1, 60), 60)
    while len(rig.outputs["a"]) < 50:
        assert rig.step_once()
    rig.add("c", prompt(3, 60), 3)
    for _ in range(3):
        assert rig.step_once()
    assert not rig.scheduler.reset_prefix_cache(reset_connector=True)  # only the tier resets
    rig.run()
    rig.reset_gpu_prefix_cache()
    rig.add("b", prompt(1, 60), 2)
    rig.run()
    assert rig.outputs["b"] == model_outputs(prompt(1, 60), 2)
    assert rig.checked_positions["b"] >= 59


@pytest.mark.parametrize("geometry", ["full", "full+swa"])
def test_a_reset_right_after_a_request_finished_plans_no_store_from_its_freed_blocks(
    model_dir, seam, geometry
):
    """ "a" finishes with every chunk stored (its blocks are freed at once); the tier is reset
    before the next step, and "c" gets a's blocks in that step. a's final store must not be
    planned from chunk 0 over its old table: "b" (a's prompt; on the hybrid model after "d" stored
    its own window tail at 84) then loads only a's and d's KV (the rig checks every byte), or
    nothing (the reset emptied the tier of a's chunks)."""
    blocks, batch, c_len = (64, 256, 120) if geometry != "full" else (20, 64, 60)
    rig = hybrid_rig(
        model_dir,
        seam,
        False,
        geometry=geometry,
        num_gpu_blocks=blocks,
        max_num_batched_tokens=batch,
    )
    rig.add("a", prompt(1, 60), 3)
    while len(rig.outputs["a"]) < 3:
        assert rig.step_once()
    assert rig.scheduler.reset_prefix_cache(reset_connector=True)
    rig.add("c", prompt(3, c_len), 3)
    rig.run()
    rig.reset_gpu_prefix_cache()
    tokens = prompt(1, 60) + (prompt(5, 30) if geometry != "full" else [])
    if geometry != "full":
        rig.add("d", tokens, 2)
        rig.run()
        rig.reset_gpu_prefix_cache()
    rig.add("b", tokens, 2)
    rig.run()
    assert rig.outputs["b"] == model_outputs(tokens, 2)
    assert rig.external_hits["b"] == (84 if geometry != "full" else 0)
