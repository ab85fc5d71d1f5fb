"""A fleet: one or more engines (`engine.Instance`), each with its own GPU cache and CPU tier,
behind a router that places each request when it arrives. Every engine keeps its own clock and
the earliest one moves next, so the router sees each engine as it is at the arrival. Follow-up
turns are held back until the turn they follow has finished, on whichever engine ran it. A
shared tier (`shared_tier.py`), if any, sits behind every engine's CPU tier.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvoffload.scheduler import OffloadConfig
from kvoffload.simulate.instance import DataCheck, EngineConfig, Instance, Run, ttft_stats
from kvoffload.simulate.report import SimResult
from kvoffload.simulate.routers import ROUTERS, TierWeights, tier_aware_score
from kvoffload.simulate.shared_tier import SharedTierConfig, SharedTierLink, SimulatedSharedTier
from kvoffload.simulate.workloads import Request
from kvoffload.store import KeyList


@dataclass
class FleetResult:
    fleet: SimResult
    """The instances together: counts summed, TTFT over every request, the longest clock."""
    instances: list[SimResult]


class _Fleet:
    """Routes each request when it arrives and moves the engine whose clock is earliest."""

    def __init__(
        self,
        requests: Iterable[Request],
        make_instance: Callable[[Callable[[Run, float], None]], Instance],
        instances: int,
        router: str,
        engine: EngineConfig,
        on_finish: Callable[[], None],
        weights: TierWeights,
    ) -> None:
        self.sims = [make_instance(self._finished) for _ in range(instances)]
        self.router, self.engine, self.weights = router, engine, weights
        self.tpb = self.sims[0].tpb
        self.on_finish = on_finish
        self.source: Iterator[Request] = iter(requests)
        self.peeked: Run | None = None
        self.seq = 0
        self.routed = 0
        self.pending: list[tuple[float, int, Run]] = []
        """Follow-up turns whose turn has finished, by when they may start."""
        self.children: dict[str, list[Run]] = {}
        self.parents: set[str] = set()
        self.finished_at: dict[str, float] = {}
        if isinstance(requests, Sequence):
            ids = [r.request_id for r in requests]
            if len(set(ids)) != len(ids):
                raise ValueError("requests repeat a request_id")
            self.parents = {r.after for r in requests if r.after is not None}
            unknown = sorted(self.parents - set(ids))
            if unknown:
                raise ValueError(f"requests follow unknown request ids: {unknown[:3]}")

    def _finished(self, run: Run, now: float) -> None:
        rid = run.req.request_id
        if rid in self.parents:
            self.finished_at[rid] = now
        for child in self.children.pop(rid, ()):
            heapq.heappush(self.pending, (max(child.req.arrival, now), child.seq, child))
        self.on_finish()

    def _pull(self) -> Run | None:
        """The next request of the workload that arrives on its own (follow-ups are parked
        until the turn they follow finishes)."""
        while self.peeked is None:
            req = next(self.source, None)
            if req is None:
                return None
            need = self.engine.blocks_needed(req, self.tpb)
            if need > self.engine.gpu_blocks:
                raise ValueError(
                    f"gpu_blocks={self.engine.gpu_blocks} is too small: request "
                    f"{req.request_id!r} needs {need} blocks of {self.tpb} tokens"
                )
            run = Run(req, self.seq, need)
            self.seq += 1
            if req.after is None:
                self.peeked = run
            elif req.after in self.finished_at:
                at = max(req.arrival, self.finished_at[req.after])
                heapq.heappush(self.pending, (at, run.seq, run))
            else:
                if req.after not in self.parents:  # a stream lists no follow-ups
                    raise ValueError(
                        f"request {req.request_id!r} follows {req.after!r}, not in the list"
                    )
                self.children.setdefault(req.after, []).append(run)
        return self.peeked

    def _next_arrival(self) -> tuple[float, int, Run] | None:
        root = self._pull()
        first = (root.req.arrival, root.seq, root) if root is not None else None
        if self.pending and (first is None or self.pending[0][:2] < first[:2]):
            return self.pending[0]
        return first

    def run(self) -> FleetResult:
        while True:
            nxt = self._next_arrival()
            t, i = min((s.next_event(), i) for i, s in enumerate(self.sims))
            sim = self.sims[i]
            if nxt is not None and nxt[0] <= t:
                if self.pending and self.pending[0] is nxt:
                    heapq.heappop(self.pending)
                else:
                    self.peeked = None
                self._route(nxt[2], nxt[0])
            elif t < math.inf:
                sim.tick(nxt[0] if nxt is not None else math.inf)
            else:
                break
        # Every engine is idle for good: a request not finished by now never will be.
        left = [r.req.request_id for s in self.sims for r in s.live.values()]
        left += [nxt[2].req.request_id] if nxt is not None else []
        left += sorted(self.children)
        if left:
            raise RuntimeError(
                f"the simulation stopped with {len(left)} requests unfinished ({left[:3]}), "
                f"at simulated second {max(s.now for s in self.sims):g}"
            )
        results = [sim.result() for sim in self.sims]
        return FleetResult(_together(results, [sim.ttfts for sim in self.sims]), results)

    def _route(self, run: Run, arrival: float) -> None:
        sims, n = self.sims, len(self.sims)
        rank: list[tuple[float, int]] = [(0, 0)] * n  # round-robin: all tie
        if self.router == "least-loaded":
            rank = [(0, s.load) for s in sims]
        elif self.router in ("prefix-affinity", "tier-aware"):
            # The best-held prefix wins, then the least loaded. The hashes are not kept on the
            # run (admission makes them again): a long queue holds none.
            full = run.req.block_hashes(self.tpb)[: run.req.num_prompt // self.tpb]
            held = [s.gpu_prefix_blocks(full) for s in sims]
            if self.router == "tier-aware":
                bpc = sims[0].config.blocks_per_chunk
                keys = KeyList()
                keys.extend_chunk_keys(full, bpc)
                scores = [
                    tier_aware_score(g, s.tier_runs(keys, g // bpc, arrival), bpc, self.weights)
                    for g, s in zip(held, sims, strict=True)
                ]
                rank = [(-score, s.load) for score, s in zip(scores, sims, strict=True)]
            else:
                rank = [(-g, s.load) for g, s in zip(held, sims, strict=True)]
        # Ties go to the first tied instance from `routed % n` on, cyclically: light load
        # spreads as under round-robin instead of piling on instance 0.
        best = min(range(n), key=lambda i: (rank[i], (i - self.routed) % n))
        self.routed += 1
        sims[best].submit(run, arrival)


_TTFT_FIELDS = ("ttft_mean_s", "ttft_p90_s", "ttft_p99_s")


def _together(results: list[SimResult], ttfts: list[list[float]]) -> SimResult:
    if len(results) == 1:
        return results[0]
    out = SimResult()
    for f in dataclasses.fields(SimResult):
        if f.name in (*_TTFT_FIELDS, "ignored_params", "load_max_over_mean"):
            continue
        values = [getattr(r, f.name) for r in results]
        setattr(out, f.name, max(values) if f.name == "simulated_seconds" else sum(values))
    for r in results:
        for k, v in r.ignored_params.items():
            out.ignored_params[k] = out.ignored_params.get(k, 0) + v
    out.ttft_mean_s, out.ttft_p90_s, out.ttft_p99_s = ttft_stats([t for ts in ttfts for t in ts])
    if out.requests:
        out.load_max_over_mean = max(r.requests for r in results) * len(results) / out.requests
    return out


def simulate_fleet(
    requests: Iterable[Request],
    engine: EngineConfig,
    config: OffloadConfig,
    bytes_per_chunk: int,
    *,
    instances: int = 1,
    router: str = "round-robin",
    data: Callable[[], DataCheck | None] = lambda: None,
    on_finish: Callable[[], None] = lambda: None,
    remote: SharedTierConfig | None = None,
    disk: SharedTierConfig | None = None,
    tier_weights: TierWeights | None = None,
) -> FleetResult:
    """Replays `requests` (a list, or a stream in arrival order without follow-ups) on
    `instances` engines, each with a fresh scheduler and a CPU tier of `config.cpu_bytes_to_use`
    bytes in chunks of `bytes_per_chunk` (see `OffloadConfig`), behind `router`; `data` makes
    each engine's `--verify-data` check; `remote` is a shared tier behind them all, and `disk`
    each engine's own disk tier (between its CPU tier and the shared tier); `tier_weights` are
    the `tier-aware` router's (default: `TierWeights()`)."""
    if type(instances) is not int or instances < 1:
        raise ValueError(f"instances={instances!r} is invalid: expected an int >= 1")
    if router not in ROUTERS:
        raise ValueError(f"router={router!r} is invalid; allowed: {', '.join(ROUTERS)}")

    tier = SimulatedSharedTier(remote) if remote is not None else None

    def make_instance(finished: Callable[[Run, float], None]) -> Instance:
        link = SharedTierLink(tier, bytes_per_chunk) if tier is not None else None
        own = None if disk is None else SharedTierLink(SimulatedSharedTier(disk), bytes_per_chunk)
        return Instance(engine, config, bytes_per_chunk, data(), finished, link, own)

    weights = TierWeights() if tier_weights is None else tier_weights
    return _Fleet(requests, make_instance, instances, router, engine, on_finish, weights).run()


def simulate(
    requests: Iterable[Request],
    engine: EngineConfig,
    config: OffloadConfig,
    bytes_per_chunk: int,
    *,
    data: DataCheck | None = None,
    on_finish: Callable[[], None] = lambda: None,
) -> SimResult:
    """One engine: `simulate_fleet` with one instance."""
    return simulate_fleet(
        requests, engine, config, bytes_per_chunk, data=lambda: data, on_finish=on_finish
    ).fleet
