"""`record_trace` through vLLM 0.33's real scheduler: the trace the connector writes replays in
`kvoffload simulate` with the same prefix-reuse bound as the requests that made it."""

from __future__ import annotations

import json

import numpy as np
from rig import make_rig, prompt

from kvoffload.simulate.reuse import prefix_reuse_bound
from kvoffload.simulate.trace import TraceOptions, load_trace
from kvoffload.simulate.workloads import SimRequest

TPB = 4


def workload() -> list[tuple[str, list[int], int]]:
    """Three system prompts, each under several questions, one prompt sent twice, and one that
    shares nothing; prompts are never another request's output, which the format cannot say."""
    systems = [prompt(s, n) for s, n in ((1, 24), (2, 37), (3, 12))]
    out = []
    for i in range(9):
        system = systems[i % 3]
        out.append((f"q{i}", system + prompt(10 + i, 5 + 3 * i), 3 + i % 4))
    out.append(("again", out[4][1], 2))
    out.append(("alone", prompt(99, 29), 5))
    return out


def test_a_recorded_trace_replays_with_the_prefix_reuse_bound_of_its_requests(
    model_dir, is_async, tmp_path
):
    path = tmp_path / "served.jsonl"
    # Shipped defaults but the option itself (rotation at 256 MiB never happens here).
    rig = make_rig(model_dir, is_async=is_async, extra={"record_trace": str(path)})
    sent = workload()
    arrivals = {}
    for i, (rid, tokens, max_tokens) in enumerate(sent):
        arrivals[rid] = rig.add(rid, tokens, max_tokens).arrival_time
        if i % 3 == 2:  # arrivals spread over the run, not all at once
            rig.step_once()
    rig.run()
    rig.connector.shutdown()  # as vLLM's engine does: the writer drains and closes the file

    raw = [json.loads(x) for x in open(path) if not x.startswith("#")]
    assert len(raw) == len(sent)
    # No token ids, no text: small integers, one per block of vLLM's block size.
    assert {k for r in raw for k in r} == {"timestamp", "input_length", "output_length", "hash_ids"}
    trace = load_trace(path, TraceOptions(hash_block_tokens=TPB))
    replayed = list(trace)

    # The requests that made it, in arrival order, with what they really generated.
    order = sorted(sent, key=lambda s: arrivals[s[0]])
    originals = [
        SimRequest(rid, np.asarray(tokens, np.int32), np.asarray(rig.outputs[rid], np.int32))
        for rid, tokens, _ in order
    ]
    assert [(r.num_prompt, r.num_output) for r in replayed] == [
        (r.num_prompt, r.num_output) for r in originals
    ]
    t0 = min(arrivals.values())
    assert [r.arrival for r in replayed] == [
        round((arrivals[rid] - t0) * 1000, 3) / 1000 for rid, _, _ in order
    ]
    bound = prefix_reuse_bound(originals, TPB)
    assert bound == prefix_reuse_bound(replayed, TPB)
    # Two repeats of each system prompt in whole blocks (24, 36 of 37, and 12 tokens), and
    # "again": q4's 54-token prompt but its last block (vLLM computes the last token).
    assert bound == 2 * 24 + 2 * 36 + 2 * 12 + 52
