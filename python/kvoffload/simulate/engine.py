"""The engine model: vLLM-like continuous batching around the real `OffloadScheduler` and store.

Per step: finished transfers are reported; arrived requests are admitted in order while fewer
than `max_running` compute and the GPU has blocks for their whole prompt and output (reserved
at admission, so nothing is preempted); then every running request computes one token (decode)
or the next piece of its prompt within `max_batched_tokens` (chunked prefill), and the step takes
`decode_step_ms` plus its prompt tokens over `prefill_tokens_per_s`. A request whose prefix the
CPU tier holds first waits for its load, holding its blocks but not a `max_running` place (vLLM's
WAITING_FOR_REMOTE_KVS). Transfers run one at a time per direction at `pcie_gbps`, from the step
that submits them; their bytes move (with `--verify-data`) when they end.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvoffload.scheduler import OffloadConfig, OffloadScheduler, RequestUpdate
from kvoffload.scheduler.jobs import LoadJob, StoreJob
from kvoffload.simulate.gpu_cache import GpuPrefixCache
from kvoffload.simulate.report import SimResult
from kvoffload.simulate.workloads import SimRequest, block_hashes


@dataclass(frozen=True)
class EngineConfig:
    gpu_blocks: int = 4096
    """GPU KV-cache blocks (prefix cache and running requests together)."""
    max_running: int = 16
    pcie_gbps: float = 25.0
    """GB/s per direction (PCIe 4.0 x16 moves about 25)."""
    prefill_tokens_per_s: float = 20_000.0
    decode_step_ms: float = 15.0
    """The time of a step that computes no prompt tokens."""
    max_batched_tokens: int = 8192
    """Tokens one step computes at most (vLLM's `max_num_batched_tokens`)."""

    def __post_init__(self) -> None:
        for name in ("gpu_blocks", "max_running", "max_batched_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an int >= 1")
        if self.max_batched_tokens < self.max_running:
            # vLLM refuses this too: every running request must be able to decode each step.
            raise ValueError(
                f"max_batched_tokens={self.max_batched_tokens} is less than "
                f"max_running={self.max_running}: every running request decodes a token a step"
            )
        for name in ("pcie_gbps", "prefill_tokens_per_s", "decode_step_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r} is invalid: expected a finite number > 0")

    def blocks_needed(self, request: SimRequest, tokens_per_block: int) -> int:
        """GPU blocks the request holds at its end: KV exists for all but its last token."""
        return -(-(len(request.prompt) + len(request.output) - 1) // tokens_per_block)

    def largest(self, requests: Sequence[SimRequest], tokens_per_block: int) -> tuple[int, str]:
        """The most GPU blocks one of `requests` needs, and which request that is."""
        req = max(requests, key=lambda r: self.blocks_needed(r, tokens_per_block))
        return self.blocks_needed(req, tokens_per_block), req.request_id


class DataCheck:
    """What `--verify-data` plugs in (see `verify.py`); this base moves nothing."""

    def write(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> None: ...
    def store(self, job: StoreJob) -> None: ...
    def load(self, job: LoadJob) -> None: ...
    def check_load(self, job: LoadJob, hashes: Sequence[bytes]) -> int:
        """Submits nothing; returns how many of the load's blocks hold wrong bytes."""
        return 0


@dataclass(eq=False)
class _Run:
    req: SimRequest
    hashes: list[bytes]
    blocks_needed: int
    state: Literal["waiting", "loading", "prefill", "decode", "done"] = "waiting"
    blocks: list[int] = field(default_factory=list)
    reserved: int = 0
    computed: int = 0
    """Tokens whose KV exists."""
    cached: int = 0
    """Full blocks registered in the GPU prefix cache."""
    generated: int = 0
    eligible_at: float = 0.0
    released: bool = False


class _Sim:
    def __init__(
        self,
        requests: Sequence[SimRequest],
        engine: EngineConfig,
        config: OffloadConfig,
        bytes_per_chunk: int,
        data: DataCheck | None,
        on_finish: Callable[[], None],
    ) -> None:
        self.engine = engine
        self.config = config
        self.tpb = config.tokens_per_block
        self.sched = OffloadScheduler.create(config, bytes_per_chunk)
        self.bytes_per_chunk = bytes_per_chunk
        self.gpu = GpuPrefixCache(engine.gpu_blocks)
        self.data = data or DataCheck()
        self.verify = data is not None
        self.on_finish = on_finish
        self.runs = {r.request_id: self._run(r) for r in requests}
        self.children: dict[str, list[_Run]] = {}
        self.arrivals: list[tuple[float, int, _Run]] = []
        for i, run in enumerate(self.runs.values()):
            if run.req.after is None:
                self.arrivals.append((run.req.arrival, i, run))
            else:
                self.children.setdefault(run.req.after, []).append(run)
        heapq.heapify(self.arrivals)
        self.order = {rid: i for i, rid in enumerate(self.runs)}
        if len(self.order) != len(requests):
            raise ValueError("requests repeat a request_id")
        unknown = sorted(set(self.children) - set(self.runs))
        if unknown:
            raise ValueError(f"requests follow unknown request ids: {unknown[:3]}")
        self.computing = 0
        """Running requests not waiting for a load: what `max_running` bounds."""
        self.waiting: deque[_Run] = deque()
        self.running: list[_Run] = []
        self.reserved = 0
        self.link_free = {"store": 0.0, "load": 0.0}
        self.transfers: list[tuple[float, int, StoreJob | LoadJob, float]] = []
        self.by_job: dict[int, _Run] = {}
        self.now = 0.0
        self.res = SimResult(requests=len(requests))
        self.ttfts: list[float] = []
        self.unfinished = len(requests)

    def _run(self, req: SimRequest) -> _Run:
        hashes = block_hashes(req.tokens, self.tpb)
        return _Run(req, hashes, self.engine.blocks_needed(req, self.tpb))

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.res.scheduler_seconds += time.perf_counter() - t0

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> SimResult:
        while self.unfinished:
            self._complete_transfers()
            self._arrive()
            self._admit()
            if not self._step():
                self._idle()
        while self.transfers:  # the last stores
            self.now = max(self.now, self.transfers[0][0])
            self._complete_transfers()
        return self._result()

    def _idle(self) -> None:
        """Nothing to compute: jump to the next transfer end or arrival."""
        times = [t[0] for t in self.transfers[:1]] + [t[0] for t in self.arrivals[:1]]
        if not times:
            stuck = [r.req.request_id for r in self.waiting][:3]
            raise RuntimeError(f"the simulation stalled with {stuck} waiting and nothing to do")
        then = max(self.now, min(times))
        if any(r.state == "loading" for r in self.running):
            self.res.load_stall_seconds += then - self.now
        self.now = then

    def _arrive(self) -> None:
        while self.arrivals and self.arrivals[0][0] <= self.now:
            arrival, _, run = heapq.heappop(self.arrivals)
            run.eligible_at = arrival  # TTFT counts from here, not from when a step noticed it
            self._timed(
                self.sched.add_request,
                run.req.request_id,
                len(run.req.prompt),
                run.req.kv_transfer_params,
            )
            self.waiting.append(run)

    def _admit(self) -> None:
        tpb, blocked = self.tpb, []
        while self.waiting and self.computing < self.engine.max_running:
            run = self.waiting.popleft()
            n_prompt = len(run.req.prompt)
            # vLLM computes at least the prompt's last token.
            hit = self.gpu.longest_hit(run.hashes, (n_prompt - 1) // tpb)
            num_local = len(hit) * tpb
            ext = self._timed(
                self.sched.lookup,
                run.req.request_id,
                num_local,
                n_prompt,
                run.hashes[: n_prompt // tpb],
            )
            if ext is None:  # a chunk it needs is in flight: try again next step
                blocked.append(run)
                continue
            new_blocks = run.blocks_needed - len(hit)
            if self.gpu.num_free - self.gpu.num_idle(hit) - self.reserved < new_blocks:
                blocked.append(run)
                break  # first come, first served: no one overtakes it
            self.gpu.touch(hit)
            prompt_blocks = -(-n_prompt // tpb) - len(hit)
            run.blocks = hit + self.gpu.allocate(prompt_blocks)
            run.reserved = new_blocks - prompt_blocks
            self.reserved += run.reserved
            run.computed, run.cached = num_local + ext, len(hit)
            self.res.gpu_hit_tokens += num_local
            self.res.cpu_hit_tokens += ext
            self.res.recomputed_tokens += n_prompt - num_local - ext
            self.running.append(run)
            load = self._timed(self.sched.on_allocated, run.req.request_id, run.blocks, ext)
            if load is None:
                run.state = "prefill"
                self.computing += 1
            else:
                run.state = "loading"
                self._submit("load", load)
        self.waiting.extendleft(reversed(blocked))

    def _step(self) -> bool:
        """Runs one forward pass over the running requests; False when there is none. Decodes
        go first; prompts are computed in pieces within `max_batched_tokens` (chunked
        prefill)."""
        decodes = [r for r in self.running if r.state == "decode"]
        budget = self.engine.max_batched_tokens - len(decodes)
        batch, prefill_tokens, updates = [], 0, []
        for run in decodes + [r for r in self.running if r.state == "prefill"]:
            n_prompt = len(run.req.prompt)
            before = run.computed
            if run.state == "decode":
                run.computed += 1
            elif budget <= 0:
                continue
            else:
                # A prompt loaded whole still computes its last token (vLLM does so).
                n = min(max(n_prompt - run.computed, 1), budget)
                budget -= n
                prefill_tokens += n
                run.computed = min(run.computed + n, n_prompt)
            batch.append(run)
            new_blocks = []
            if -(-run.computed // self.tpb) > len(run.blocks):
                new_blocks = self.gpu.allocate(1)
                run.blocks += new_blocks
                run.reserved -= 1
                self.reserved -= 1
            hashes = None
            if run.computed // self.tpb > before // self.tpb:
                hashes = run.hashes[: run.computed // self.tpb]
            updates.append(
                RequestUpdate(run.req.request_id, run.computed, run.computed, new_blocks, hashes)
            )
        if not batch:
            return False
        plan = self._timed(self.sched.plan_step, updates)
        self.now += self.engine.decode_step_ms / 1e3 + prefill_tokens / (
            self.engine.prefill_tokens_per_s
        )
        self.res.steps += 1
        finished = []
        for run in batch:
            self._cache_computed(run)
            if run.computed < len(run.req.prompt):
                continue  # more of its prompt next step
            if run.state == "prefill":
                run.state = "decode"
                self.ttfts.append(self.now - run.eligible_at)
            run.generated += 1
            if run.generated == len(run.req.output):
                finished.append(run)
        self._submit_stores(plan.store_jobs)
        if finished:
            self._finish(finished)
        return True

    def _cache_computed(self, run: _Run, *, loaded: bool = False) -> None:
        full = run.computed // self.tpb
        if full > run.cached:
            blocks = run.blocks[run.cached : full]
            hashes = run.hashes[run.cached : full]
            if not loaded:
                self.data.write(blocks, hashes)
            self.gpu.cache(blocks, hashes)
            run.cached = full

    def _finish(self, finished: list[_Run]) -> None:
        ids = [r.req.request_id for r in finished]
        plans = self._timed(self.sched.finish_requests, [(rid, None) for rid in ids])
        for run, plan in zip(finished, plans, strict=True):
            run.state = "done"
            self.running.remove(run)
            self.computing -= 1
            self.reserved -= run.reserved
            self._submit_stores(plan.store_jobs)
            if not plan.hold_blocks:
                self._release(run)
            self.unfinished -= 1
            self.on_finish()
            for child in self.children.pop(run.req.request_id, ()):
                arrival = max(child.req.arrival, self.now)
                heapq.heappush(self.arrivals, (arrival, self.order[child.req.request_id], child))

    def _release(self, run: _Run) -> None:
        if not run.released:
            run.released = True
            self.gpu.release(run.blocks)

    # --- transfers ----------------------------------------------------------------------------

    def _submit_stores(self, jobs: Sequence[StoreJob]) -> None:
        tpc = self.config.tokens_per_chunk
        for job in jobs:
            n_prompt = len(self.runs[job.request_id].req.prompt)
            self.res.decode_chunks_written += int(((job.chunk_indices + 1) * tpc > n_prompt).sum())
            self._submit("store", job)

    def _submit(self, kind: Literal["store", "load"], job: StoreJob | LoadJob) -> None:
        seconds = len(job.slots) * self.bytes_per_chunk / (self.engine.pcie_gbps * 1e9)
        end = max(self.now, self.link_free[kind]) + seconds
        self.link_free[kind] = end
        heapq.heappush(self.transfers, (end, job.job_id, job, self.now))
        self.by_job[job.job_id] = self.runs[job.request_id]

    def _complete_transfers(self) -> None:
        while self.transfers and self.transfers[0][0] <= self.now:
            _, job_id, job, submitted = heapq.heappop(self.transfers)
            run = self.by_job.pop(job_id)
            # The bytes move as the transfer ends, so a block reused before then shows up.
            if isinstance(job, LoadJob):
                self.data.load(job)
                self.res.load_wait_seconds += self.now - submitted
                if self.verify:
                    self.res.mismatched_blocks += self.data.check_load(job, run.hashes)
                    self.res.verified_chunks += len(job.slots)
            else:
                self.data.store(job)
            result = self._timed(self.sched.complete_job, job_id, True)
            if isinstance(job, LoadJob):
                run.state = "prefill"
                self.computing += 1
                self._cache_computed(run, loaded=True)
            if result.request_released:
                self._release(run)

    def _result(self) -> SimResult:
        res = self.res
        st, sc = self.sched.store.stats(), self.sched.stats()
        res.prompt_tokens = sum(len(r.req.prompt) for r in self.runs.values())
        res.chunks_written, res.bytes_written = sc.chunks_stored, sc.bytes_stored
        res.chunks_read, res.bytes_read = sc.chunks_loaded, sc.bytes_loaded
        res.evictions, res.store_refusals = st.evictions, sc.store_refusals
        res.ignored_params = dict(sc.ignored_params)
        res.prefill_seconds_saved = (
            res.cpu_hit_tokens / self.engine.prefill_tokens_per_s - res.load_stall_seconds
        )
        res.simulated_seconds = self.now
        if self.ttfts:
            ttfts = sorted(self.ttfts)
            res.ttft_mean_s = sum(ttfts) / len(ttfts)
            res.ttft_p90_s = ttfts[math.ceil(0.9 * len(ttfts)) - 1]  # nearest rank
        return res


def simulate(
    requests: Sequence[SimRequest],
    engine: EngineConfig,
    config: OffloadConfig,
    bytes_per_chunk: int,
    *,
    data: DataCheck | None = None,
    on_finish: Callable[[], None] = lambda: None,
) -> SimResult:
    """Replays `requests` through the engine model with a fresh scheduler and CPU tier of
    `config.cpu_bytes_to_use` bytes in chunks of `bytes_per_chunk` (see `OffloadConfig`)."""
    if requests:
        need, rid = engine.largest(requests, config.tokens_per_block)
        if need > engine.gpu_blocks:
            raise ValueError(
                f"gpu_blocks={engine.gpu_blocks} is too small: request {rid!r} needs {need} "
                f"blocks of {config.tokens_per_block} tokens"
            )
    return _Sim(requests, engine, config, bytes_per_chunk, data, on_finish).run()
