"""A workload simulator: multi-turn chat sessions driven through the real scheduler and CPU-tier
store, with no GPU and no vLLM. It shows how many prefill tokens the CPU tier saves and what the
scheduler-side bookkeeping costs.

The engine model is deliberately simple: requests run one at a time, prefill in one step, then
decode one token per step; the GPU prefix cache is assumed cold (every hit comes from the CPU tier),
and each transfer completes one step after it was handed out.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from kvoffload.scheduler import OffloadConfig, OffloadScheduler, RequestUpdate


@dataclass(frozen=True)
class Workload:
    sessions: int = 24
    turns: int = 4
    system_prompts: int = 3
    """Distinct system prompts the sessions share."""
    system_prompt_tokens: int = 1024
    user_tokens: int = 96
    answer_tokens: int = 48
    seed: int = 0


@dataclass
class SimResult:
    requests: int = 0
    prompt_tokens: int = 0
    loaded_tokens: int = 0
    computed_prompt_tokens: int = 0
    scheduler_seconds: float = 0.0
    steps: int = 0
    store: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.loaded_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _block_hashes(tokens: list[int], tokens_per_block: int) -> list[bytes]:
    out: list[bytes] = []
    prev = b""
    for i in range(len(tokens) // tokens_per_block):
        chunk = tokens[i * tokens_per_block : (i + 1) * tokens_per_block]
        prev = hashlib.sha256(prev + repr(chunk).encode()).digest()
        out.append(prev)
    return out


def _requests(w: Workload) -> Iterator[tuple[str, list[int], int]]:
    """`(request_id, tokens, num_prompt_tokens)` in arrival order: sessions interleave by turn."""
    rng = random.Random(w.seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1, 50_000) for _ in range(n)]

    systems = [fresh(w.system_prompt_tokens) for _ in range(w.system_prompts)]
    history = [list(systems[s % w.system_prompts]) for s in range(w.sessions)]
    for turn in range(w.turns):
        for s in range(w.sessions):
            prompt = history[s] + fresh(w.user_tokens)
            answer = fresh(w.answer_tokens)
            yield f"s{s}-t{turn}", prompt + answer, len(prompt)
            history[s] = prompt + answer


def simulate(
    config: OffloadConfig, workload: Workload, bytes_per_chunk: int, kv_params: dict[str, Any]
) -> SimResult:
    sched = OffloadScheduler.create(config, bytes_per_chunk)
    tpb = config.tokens_per_block
    res = SimResult()
    in_flight: list[int] = []
    next_block = 0

    def timed(fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        res.scheduler_seconds += time.perf_counter() - t0
        return out

    def step(plan_jobs: list[int]) -> None:
        # Jobs complete one step after they were handed out.
        nonlocal in_flight
        for job_id in in_flight:
            timed(sched.complete_job, job_id, True)
        in_flight = plan_jobs
        res.steps += 1

    for rid, tokens, n_prompt in _requests(workload):
        res.requests += 1
        res.prompt_tokens += n_prompt
        timed(sched.add_request, rid, n_prompt, kv_params)
        all_hashes = _block_hashes(tokens, tpb)
        hashes = all_hashes[: n_prompt // tpb]
        hit = None
        while hit is None:  # a chunk still being stored: retry next step
            hit = timed(sched.lookup, rid, 0, n_prompt, hashes)
            if hit is None:
                step([])
        table = list(range(next_block, next_block + -(-n_prompt // tpb)))
        next_block += len(table)
        load = timed(sched.on_allocated, rid, table, hit)
        res.loaded_tokens += hit
        res.computed_prompt_tokens += n_prompt - hit
        step([] if load is None else [load.job_id])
        new_blocks: list[int] = []
        computed, num_tokens = n_prompt, n_prompt + 1
        while True:
            hashes = all_hashes[: num_tokens // tpb]
            update = RequestUpdate(rid, computed, num_tokens, new_blocks, hashes)
            plan = timed(sched.plan_step, [update])
            step([j.job_id for j in plan.store_jobs])
            if num_tokens >= len(tokens):
                break
            computed, num_tokens, new_blocks = computed + 1, num_tokens + 1, []
            if -(-computed // tpb) > len(table):
                new_blocks = [next_block]
                table.append(next_block)
                next_block += 1
        fin = timed(sched.finish_request, rid, None)
        in_flight += [j.job_id for j in fin.store_jobs]
    step([])
    step([])
    res.store = asdict(sched.store.stats())
    res.scheduler = asdict(sched.stats())
    return res
