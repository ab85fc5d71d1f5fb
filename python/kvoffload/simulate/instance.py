"""One simulated instance (a vLLM engine): continuous batching around the real `OffloadScheduler`
and store.

Per step: finished transfers are reported; arrived requests are admitted in order while fewer
than `max_running` compute and the GPU has blocks for their whole prompt and output (reserved
at admission, so nothing is preempted); then every running request computes one token (decode)
or the next piece of its prompt within `max_batched_tokens` (chunked prefill). A step takes
`decode_step_ms`, plus its prompt tokens over `prefill_tokens_per_s` with an attention term that
grows with their context, plus reading the decoding requests' KV at `hbm_gbps`. A request whose
prefix the CPU tier holds first waits for its load, holding its blocks but not a `max_running`
place (vLLM's WAITING_FOR_REMOTE_KVS). Transfers run one at a time per direction at `pcie_gbps`,
from the step that submits them; their bytes move (with `--verify-data`) when they end.

`fleet.py` runs one or more of these instances behind a router, with `shared_tier.py`'s shared
tier behind them if asked: a request whose prefix continues there waits for it to be copied into
the CPU tier (as for a chunk being stored), then loads it as a CPU hit.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvoffload import _rust
from kvoffload.scheduler import OffloadConfig, OffloadScheduler, RequestUpdate
from kvoffload.scheduler.jobs import LoadJob, StoreJob
from kvoffload.simulate.gpu_cache import GpuPrefixCache
from kvoffload.simulate.report import SimResult
from kvoffload.simulate.shared_tier import SharedTierLink
from kvoffload.simulate.workloads import Request
from kvoffload.store import KeyList, Keys

MIN_HBM_GBPS = 1.0
"""The slowest GPU memory `hbm_gbps` takes (an H200 reads 4,800 GB/s): 0 turns it off."""


@dataclass(frozen=True)
class EngineConfig:
    gpu_blocks: int = 4096
    """GPU KV-cache blocks (prefix cache and running requests together)."""
    max_running: int = 16
    pcie_gbps: float = 25.0
    """GB/s per direction (PCIe 4.0 x16 moves about 25; an H200's PCIe 5.0 x16 about 50)."""
    prefill_tokens_per_s: float = 30_000.0
    """Prompt tokens per second at short context (Llama-3-8B on one H200; the Simulator page of
    the docs derives it, and `models.py` scales it to other models)."""
    prefill_attention_tokens: float = 30_000.0
    """The context length at which a prompt token's attention costs as much as the rest of its
    compute, so a token at context `c` takes `(1 + c / this) / prefill_tokens_per_s`; 0: none."""
    decode_step_ms: float = 6.0
    """The time of a step that computes no prompt tokens, before reading the KV."""
    hbm_gbps: float = 4_800.0
    """GPU memory bandwidth: each step reads the KV of every decoding request; 0: free."""
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
                f"max_running={self.max_running}: every running request decodes one token a "
                "step (vLLM refuses this too)"
            )
        for name in ("pcie_gbps", "prefill_tokens_per_s", "decode_step_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r} is invalid: expected a finite number > 0")
        for name, least in (("prefill_attention_tokens", 1.0), ("hbm_gbps", MIN_HBM_GBPS)):
            value = getattr(self, name)
            # A tiny positive value would make a step take forever (an overflow to inf).
            if not isinstance(value, (int, float)) or not (value == 0 or least <= value < math.inf):
                raise ValueError(
                    f"{name}={value!r} is invalid: expected 0 (off) or a finite number >= {least:g}"
                )

    def prefill_seconds(self, context: int, n: int) -> float:
        """Computing prompt tokens `context .. context + n`: their mean context sets the
        attention share."""
        per_token = 1.0
        if self.prefill_attention_tokens:
            per_token += (context + (n - 1) / 2) / self.prefill_attention_tokens
        return n * per_token / self.prefill_tokens_per_s

    def blocks_needed(self, request: Request, tokens_per_block: int) -> int:
        """GPU blocks the request holds at its end: KV exists for all but its last token."""
        return -(-(request.num_prompt + request.num_output - 1) // tokens_per_block)

    def largest(self, requests: Iterable[Request], tokens_per_block: int) -> tuple[int, str]:
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

    def close(self) -> None: ...


@dataclass(eq=False)
class Run:
    req: Request
    seq: int
    """Its place in the workload: ties of arrival keep this order."""
    blocks_needed: int
    hashes: list[bytes] = field(default_factory=list)
    hashed: bool = False
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
    promoted: dict[int, str] = field(default_factory=dict)
    """Chunks copied for it from a tier behind the CPU tier (chunk -> "disk" or "remote"): their
    loaded tokens are that tier's hits."""


class Instance:
    """One engine: its GPU prefix cache, its scheduler and CPU tier, its clock. `on_finish`
    hears of every finished request (the fleet releases the turns that follow it); `disk` is
    its link to its own disk tier and `remote` to the fleet's shared tier, if any (looked up in
    that order past the CPU tier, each written every chunk the CPU tier stores)."""

    def __init__(
        self,
        engine: EngineConfig,
        config: OffloadConfig,
        bytes_per_chunk: int,
        data: DataCheck | None,
        on_finish: Callable[[Run, float], None],
        remote: SharedTierLink | None = None,
        disk: SharedTierLink | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.tpb = config.tokens_per_block
        self.sched = OffloadScheduler.create(config, bytes_per_chunk)
        self.bytes_per_chunk = bytes_per_chunk
        self.kv_bytes_per_token = bytes_per_chunk / config.tokens_per_chunk
        self.gpu = GpuPrefixCache(engine.gpu_blocks)
        self.data = data or DataCheck()
        self.verify = data is not None
        self.on_finish = on_finish
        self.live: dict[str, Run] = {}
        self.arrivals: list[tuple[float, int, Run]] = []
        self.computing = 0
        """Running requests not waiting for a load: what `max_running` bounds."""
        self.waiting: deque[Run] = deque()
        self.running: list[Run] = []
        self.reserved = 0
        self.link_free = {"store": 0.0, "load": 0.0}
        self.transfers: list[tuple[float, int, StoreJob | LoadJob, float]] = []
        self.by_job: dict[int, Run] = {}
        self.tiers = [(name, link) for name, link in (("disk", disk), ("remote", remote)) if link]
        self.promotions: list[tuple[float, int, KeyList]] = []
        """Copies from a tier behind the CPU tier in flight: when they land, a tie-break, their
        keys."""
        self.promotion_seq = 0
        self.now = 0.0
        self.res = SimResult()
        self.ttfts: list[float] = []
        self.cpu_hit_prefill_seconds = 0.0

    def submit(self, run: Run, arrival: float) -> None:
        """The request arrives here at `arrival` (not before this engine's clock)."""
        self.live[run.req.request_id] = run
        self.res.requests += 1
        self.res.prompt_tokens += run.req.num_prompt
        heapq.heappush(self.arrivals, (arrival, run.seq, run))

    @property
    def load(self) -> int:
        """Requests here and not finished: what `least-loaded` compares."""
        return len(self.live)

    def next_event(self) -> float:
        """When this engine next has something to do."""
        if self.live:
            return self.now
        return self.transfers[0][0] if self.transfers else math.inf

    def gpu_prefix_blocks(self, full: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its full-block hashes) this engine's GPU cache
        holds: what a router learns from vLLM's KV events of the GPU cache."""
        return len(self.gpu.longest_hit(full, len(full)))

    def tier_runs(self, keys: KeyList, first: int, now: float) -> list[tuple[str, int]]:
        """From chunk `first` of a prompt's chunk `keys` on, the runs of chunks the tiers behind
        the GPU hold at `now`, as admission finds them: the CPU tier's run, else the disk's,
        else the shared tier's, again from the chunk after it, until a chunk none holds;
        `(tier, chunks)` with tier "cpu", "disk" or "shared". Nothing is used (no tier's
        recency moves): a router reads an index of the tiers' KV events, not the tiers."""
        runs: list[tuple[str, int]] = []
        while first < len(keys):
            tier, n = self._first_holder(keys.view(first, len(keys)), now)
            if not n:
                break
            runs.append((tier, n))
            first += n
        return runs

    def _first_holder(self, keys: Keys, now: float) -> tuple[str, int]:
        """The first tier behind the GPU that holds `keys[0]`, and how many leading keys it
        holds; ("", 0) when none does."""
        n = self.sched.store.lookup_prefix(keys).hits
        if n:
            return "cpu", n
        for name, link in self.tiers:
            n = link.tier.peek_prefix(keys, now)
            if n:
                return "shared" if name == "remote" else name, n
        return "", 0

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.res.scheduler_seconds += time.perf_counter() - t0

    # --- the loop -----------------------------------------------------------------------------

    def tick(self, horizon: float) -> None:
        """One engine iteration; idles no later than `horizon` (the fleet's next arrival)."""
        if not self.live:  # only stores still finishing
            self.now = max(self.now, self.transfers[0][0])
            self._complete_transfers()
            return
        self._complete_transfers()
        self._complete_promotions()
        self._arrive()
        self._admit()
        if not self._step():
            self._idle(horizon)

    def _idle(self, horizon: float) -> None:
        """Nothing to compute: jump to the next transfer end or arrival."""
        times = [t[0] for t in self.transfers[:1]] + [t[0] for t in self.arrivals[:1]]
        times += [t[0] for t in self.promotions[:1]]
        times += [horizon] if horizon < math.inf else []
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
                run.req.num_prompt,
                run.req.kv_transfer_params,
            )
            self.waiting.append(run)

    def _admit(self) -> None:
        tpb, blocked = self.tpb, []
        while self.waiting and self.computing < self.engine.max_running:
            run = self.waiting.popleft()
            if not run.hashed:  # only now: a long queue holds no hashes
                run.hashes, run.hashed = run.req.block_hashes(tpb), True
            n_prompt = run.req.num_prompt
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
            # A chunk it needs is in flight, or now comes from a tier behind the CPU tier: try
            # again next step.
            if ext is None or (self.tiers and self._promote(run, num_local)):
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
            disk = self._promoted_tokens(run, num_local, ext, "disk") if run.promoted else 0
            remote = self._promoted_tokens(run, num_local, ext, "remote") if run.promoted else 0
            self.res.cpu_hit_tokens += ext - disk - remote
            self.res.disk_hit_tokens += disk
            self.res.remote_hit_tokens += remote
            # What computing them would have cost at their context, as `_step` charges it.
            self.cpu_hit_prefill_seconds += self.engine.prefill_seconds(num_local, ext)
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

    def _promote(self, run: Run, num_local: int) -> bool:
        """Starts copying into the CPU tier the chunks that continue its hit there from the
        first tier behind it that has them (the disk, then the shared tier); True if it did.
        The window is the load's without `max_load_tokens`: the scheduler's lookup caps what is
        loaded, not what is copied."""
        n_prompt, tpc, store = run.req.num_prompt, self.config.tokens_per_chunk, self.sched.store
        keys = KeyList()
        keys.extend_chunk_keys(run.hashes[: n_prompt // self.tpb], self.config.blocks_per_chunk)
        window = _rust.load_window(n_prompt, num_local, None, len(keys), tpc)
        if window is None:
            return False
        first, end, _ = window
        hits, pending = store.lookup_prefix(keys.view(first, end))
        if pending:  # beyond a cap; the chunk is on its way here anyway
            return False
        start = first + hits
        for name, link in self.tiers:
            n = link.tier.lookup_prefix(keys.view(start, end), self.now)
            if not n:
                continue
            # The CPU hits before them first become the most recent, so that making room for
            # the copy does not evict them; the copy's slots are pending, as a store's: not
            # evictable, not loadable until it lands.
            store.touch(keys.view(first, start), reuse=False)
            plan = store.prepare_store(keys.view(start, start + n))
            if plan is None or not plan.keys:  # no room now: it loads what the CPU tier has
                return False
            assert isinstance(plan.keys, KeyList)
            lands = link.read(plan.keys, self.now)
            heapq.heappush(self.promotions, (lands, self.promotion_seq, plan.keys))
            self.promotion_seq += 1
            run.promoted.update((start + int(i), name) for i in plan.indices)
            return True
        return False

    def _promoted_tokens(self, run: Run, num_local: int, ext: int, tier: str) -> int:
        """The loaded tokens `num_local .. num_local + ext` in chunks copied for it from
        `tier`."""
        tpc, end = self.config.tokens_per_chunk, num_local + ext
        return sum(
            max(0, min((j + 1) * tpc, end) - max(j * tpc, num_local))
            for j, name in run.promoted.items()
            if name == tier
        )

    def _complete_promotions(self) -> None:
        while self.promotions and self.promotions[0][0] <= self.now:
            self.sched.store.complete_store(heapq.heappop(self.promotions)[2])

    def _step(self) -> bool:
        """Runs one forward pass over the running requests; False when there is none. Decodes
        go first; prompts are computed in pieces within `max_batched_tokens` (chunked
        prefill)."""
        decodes = [r for r in self.running if r.state == "decode"]
        budget = self.engine.max_batched_tokens - len(decodes)
        batch, updates = [], []
        seconds = self.engine.decode_step_ms / 1e3
        kv_read = 0
        for run in decodes + [r for r in self.running if r.state == "prefill"]:
            n_prompt = run.req.num_prompt
            before = run.computed
            if run.state == "decode":
                kv_read += run.computed
                run.computed += 1
            elif budget <= 0:
                continue
            else:
                # A prompt loaded whole still computes its last token (vLLM does so).
                n = min(max(n_prompt - run.computed, 1), budget)
                budget -= n
                seconds += self.engine.prefill_seconds(min(run.computed, n_prompt - 1), n)
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
        if self.engine.hbm_gbps:
            seconds += kv_read * self.kv_bytes_per_token / (self.engine.hbm_gbps * 1e9)
        self.now += seconds
        self.res.steps += 1
        finished = []
        for run in batch:
            self._cache_computed(run)
            if run.computed < run.req.num_prompt:
                continue  # more of its prompt next step
            if run.state == "prefill":
                run.state = "decode"
                self.ttfts.append(self.now - run.eligible_at)
            run.generated += 1
            if run.generated == run.req.num_output:
                finished.append(run)
        self._submit_stores(plan.store_jobs)
        if finished:
            self._finish(finished)
        return True

    def _cache_computed(self, run: Run, *, loaded: bool = False) -> None:
        full = run.computed // self.tpb
        if full > run.cached:
            blocks = run.blocks[run.cached : full]
            hashes = run.hashes[run.cached : full]
            if not loaded:
                self.data.write(blocks, hashes)
            self.gpu.cache(blocks, hashes)
            run.cached = full

    def _finish(self, finished: list[Run]) -> None:
        ids = [r.req.request_id for r in finished]
        plans = self._timed(self.sched.finish_requests, [(rid, None) for rid in ids])
        for run, plan in zip(finished, plans, strict=True):
            run.state = "done"
            self.running.remove(run)
            self.computing -= 1
            self.reserved -= run.reserved
            self._submit_stores(plan.store_jobs)
            del self.live[run.req.request_id]
            if not plan.hold_blocks:
                self._release(run)
            self.on_finish(run, self.now)

    def _release(self, run: Run) -> None:
        if not run.released:
            run.released = True
            self.gpu.release(run.blocks)

    # --- transfers ----------------------------------------------------------------------------

    def _submit_stores(self, jobs: Sequence[StoreJob]) -> None:
        tpc = self.config.tokens_per_chunk
        for job in jobs:
            n_prompt = self.live[job.request_id].req.num_prompt
            self.res.decode_chunks_written += int(((job.chunk_indices + 1) * tpc > n_prompt).sum())
            self._submit("store", job)

    def _submit(self, kind: Literal["store", "load"], job: StoreJob | LoadJob) -> None:
        seconds = len(job.slots) * self.bytes_per_chunk / (self.engine.pcie_gbps * 1e9)
        end = max(self.now, self.link_free[kind]) + seconds
        self.link_free[kind] = end
        heapq.heappush(self.transfers, (end, job.job_id, job, self.now))
        self.by_job[job.job_id] = self.live[job.request_id]

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
                for _, link in self.tiers:
                    link.write(job.keys, self.now)
            result = self._timed(self.sched.complete_job, job_id, True)
            if isinstance(job, LoadJob):
                run.state = "prefill"
                self.computing += 1
                self._cache_computed(run, loaded=True)
            if result.request_released:
                self._release(run)

    def result(self) -> SimResult:
        res = self.res
        st, sc = self.sched.store.stats(), self.sched.stats()
        res.chunks_written, res.bytes_written = sc.chunks_stored, sc.bytes_stored
        res.chunks_read, res.bytes_read = sc.chunks_loaded, sc.bytes_loaded
        res.evictions, res.store_refusals = st.evictions, sc.store_refusals
        res.ignored_params = dict(sc.ignored_params)
        for name, link in self.tiers:
            setattr(res, f"{name}_bytes_read", link.bytes_read)
            setattr(res, f"{name}_bytes_written", link.bytes_written)
            setattr(res, f"{name}_evictions", link.evictions)
        res.prefill_seconds_saved = self.cpu_hit_prefill_seconds - res.load_stall_seconds
        res.simulated_seconds = self.now
        res.ttft_mean_s, res.ttft_p90_s, res.ttft_p99_s = ttft_stats(self.ttfts)
        return res


def ttft_stats(ttfts: list[float]) -> tuple[float, float, float]:
    """Mean, p90 and p99 (nearest rank)."""
    if not ttfts:
        return 0.0, 0.0, 0.0
    ordered = sorted(ttfts)

    def rank(q: float) -> float:
        return ordered[math.ceil(q * len(ordered)) - 1]

    return sum(ordered) / len(ordered), rank(0.9), rank(0.99)
