"""One real-engine scenario, in a process of its own: `python scenario.py SPEC.json OUT.json`.

It starts vLLM's `LLM` (the CPU build) as the spec says, runs the prompts greedily once per pass
(resetting the device prefix cache between passes, so a later pass can only hit kvoffload's
tiers), and writes what each pass produced: token ids, vLLM's counters, and, in an in-process
engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), the bytes of every KV block a load wrote beside the
bytes the first pass computed for the same block hash.

A process per scenario: an engine leaves process-wide state behind (its distributed group, the
connector's worker threads), and the multiprocess engine spawns its core, which needs the
`__main__` guard below.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any


def _counters(llm: Any) -> dict[str, float]:
    """vLLM's Prometheus counters and gauges, summed over their label sets."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            out[metric.name] = out.get(metric.name, 0.0) + float(value)
    return out


class KVProbe:
    """Watches an in-process engine: which device blocks each load wrote (from the connector
    calls vLLM's scheduler makes), and the bytes of blocks by their prefix-cache hash."""

    def __init__(self, llm: Any) -> None:
        core = llm.llm_engine.engine_core.engine_core
        self.scheduler = core.scheduler
        runner = core.model_executor.driver_worker.worker.model_runner
        self.block_size = self.scheduler.block_size
        config = runner.kv_cache_config
        self.num_blocks = config.num_blocks
        context = runner.compilation_config.static_forward_context
        self.group_tensors: list[list[Any]] = []
        for group in config.kv_cache_groups:
            tensors = []
            for name in group.layer_names:
                kv = context[name].kv_cache
                tensors.append(kv[0] if isinstance(kv, list) else kv)
            self.group_tensors.append(tensors)
        self.loaded: list[tuple[int, bytes, int]] = []  # (group, block hash, device block id)
        self._asked: dict[str, tuple[int, int]] = {}
        connector = self.scheduler.connector
        matched = connector.get_num_new_matched_tokens
        after_alloc = connector.update_state_after_alloc

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
            result = matched(request, num_computed_tokens)
            if result[0]:
                self._asked[request.request_id] = (num_computed_tokens, result[0])
            return result

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            if num_external_tokens:
                local, external = self._asked.pop(request.request_id)
                assert external == num_external_tokens, (external, num_external_tokens)
                first = local // self.block_size
                last = (local + external) // self.block_size
                for group, ids in enumerate(blocks.get_block_ids()):
                    for index in range(first, last):
                        if ids[index] != 0:  # the null block: outside a sliding window
                            self.loaded.append((group, request.block_hashes[index], ids[index]))
            return after_alloc(request, blocks, num_external_tokens)

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens
        connector.update_state_after_alloc = update_state_after_alloc

    def block_bytes(self, group: int, block_id: int) -> bytes:
        parts = []
        for tensor in self.group_tensors[group]:
            dim = list(tensor.shape).index(self.num_blocks)
            parts.append(tensor.select(dim, block_id).contiguous().cpu().numpy().tobytes())
        return b"".join(parts)

    def cached(self) -> dict[tuple[int, bytes], tuple[int, bytes]]:
        """The device block id and bytes of every block the prefix cache holds now, by (group,
        hash)."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        pool = self.scheduler.kv_cache_manager.block_pool
        out = {}
        for key, blocks in pool.cached_block_hash_to_block._cache.items():
            block = next(iter(blocks.values())) if isinstance(blocks, dict) else blocks
            group = get_group_id(key)
            out[(group, bytes(get_block_hash(key)))] = (
                block.block_id,
                self.block_bytes(group, block.block_id),
            )
        return out


def settle(llm: Any, multiprocess: bool) -> None:
    """Lets the connector report its last jobs before the counters are read. `LLM.generate`
    returns once no request is unfinished, but a finished request's last stores are reported in
    later steps: vLLM's engine core keeps stepping for them in a process of its own, and they
    are driven here in an in-process one."""
    if multiprocess:
        time.sleep(1.0)
        return
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    for _ in range(10_000):
        if not scheduler.has_requests():
            break
        llm.llm_engine.step()
        time.sleep(0.001)
    llm.llm_engine.step()  # the stats of the last step that did work


def reset_prefix_cache(llm: Any) -> None:
    """Resets the device prefix cache once the connector has released every block: a request
    that finished with stores in flight keeps its blocks until they are reported, and
    `LLM.generate` returns before the steps that report them (vLLM's engine core keeps stepping
    for them, a server does). A reset that did not take would leave the second pass hitting the
    device cache, not kvoffload."""
    for _ in range(10_000):
        if llm.reset_prefix_cache():
            return
        llm.llm_engine.step()
        time.sleep(0.001)
    raise RuntimeError("the prefix cache could not be reset: blocks stay held")


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    engine = dict(spec["engine"])
    if "kv_events_config" in engine:
        from vllm.config import KVEventsConfig

        engine["kv_events_config"] = KVEventsConfig(**engine["kv_events_config"])
    llm = LLM(model=spec["model"], **engine)
    probe = KVProbe(llm) if spec.get("compare_kv") else None
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    if spec.get("routed"):
        from routed import run_routed

        return {"routed": run_routed(llm, spec, params, settle)}
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    passes = []
    # The bytes each block hash had when computed: from the engine that stored them (another
    # process, `kv_reference`), or else this engine's first pass.
    reference_kv: dict[tuple[int, bytes], tuple[int, bytes]] = {}
    if spec.get("kv_reference"):
        reference_kv = pickle.loads(Path(spec["kv_reference"]).read_bytes())
    for number in range(spec.get("passes", 2)):
        if number:
            reset_prefix_cache(llm)
        before = _counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        took = time.perf_counter() - start
        settle(llm, spec.get("multiprocess", False))
        after = _counters(llm)
        passes.append(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "cached": [o.num_cached_tokens for o in outputs],
                "counters": {k: v - before.get(k, 0.0) for k, v in after.items()},
                "seconds": took,
            }
        )
        if probe is not None and number == 0:
            if spec.get("dump_kv"):
                Path(spec["dump_kv"]).write_bytes(pickle.dumps(probe.cached()))
            if not reference_kv:
                reference_kv = probe.cached()
                probe.loaded.clear()  # a load in the first pass is compared with itself
    result: dict[str, Any] = {"passes": passes}
    if probe is not None:
        compared = mismatched = missing = same_block = 0
        for group, block_hash, block_id in probe.loaded:
            computed = reference_kv.get((group, bytes(block_hash)))
            if computed is None:
                missing += 1
                continue
            computed_id, expected = computed
            # A load into the very block that computed these bytes would show them whether it
            # wrote or not; in the same engine that comparison proves nothing.
            if not spec.get("kv_reference") and block_id == computed_id:
                same_block += 1
                continue
            compared += 1
            mismatched += probe.block_bytes(group, block_id) != expected
        result["kv"] = {
            "compared": compared,
            "mismatched": mismatched,
            "missing": missing,
            "same_block": same_block,
        }
    del llm
    return result


if __name__ == "__main__":
    spec_path, out_path = sys.argv[1:3]
    spec = json.loads(Path(spec_path).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
    Path(out_path).write_text(json.dumps(run(spec)))
