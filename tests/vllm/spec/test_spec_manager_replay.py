"""KVOffloadManager answers as vLLM 0.33's CPUOffloadingManager does: one random trace (lookups,
loads, stores completed out of order and sometimes failed, touches, finishes, resets) goes through
both, and every return value, chunk id and event must be the same, step by step (`lru`). Under
`arc` the two policies are different algorithms: the trace checks our manager's own consistency."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvoffload.vllm import KVOffloadManager

TPC = 16  # tokens per chunk: key positions are chunk ends


@dataclass
class Req:
    rid: str
    keys: list[bytes]
    positions: list[int]
    ctxs: tuple[ReqContext, ReqContext]
    stored_upto: int = 0
    loads: list[list[bytes]] = field(default_factory=list)


def docs(rng: random.Random, n: int) -> list[tuple[list[bytes], list[int]]]:
    """Key sequences over a prefix tree (requests share heads and differ in tails), with their
    positions. A third of the requests are of a hybrid model: each chunk has a key per KV group
    (group 0 and 1) at the same position, as vLLM keys them."""
    trunks = [[rng.randbytes(8) for _ in range(rng.randint(2, 12))] for _ in range(4)]
    out = []
    for _ in range(n):
        hashes = rng.choice(trunks)[: rng.randint(1, 12)] + [
            rng.randbytes(8) for _ in range(rng.randint(0, 10))
        ]
        groups = (0, 1) if rng.random() < 0.33 else (0,)
        keys = [make_offload_key(h, g) for h in hashes for g in groups]
        positions = [(i + 1) * TPC for i in range(len(hashes)) for _ in groups]
        out.append((keys, positions))
    return out


def new_req(rid: str, keys: list[bytes], positions: list[int], unpositioned: bool) -> Req:
    """With `unpositioned`, the last key's position is set only when the request finishes (or
    never)."""
    ctxs = (ReqContext(rid), ReqContext(rid))
    for ctx in ctxs:
        for i, (key, p) in enumerate(zip(keys, positions, strict=True)):
            if not (unpositioned and i == len(keys) - 1):
                ctx.set_offload_key_position(key, p)
    return Req(rid, keys, positions, ctxs)


def spec_ids(spec) -> list[int]:
    return [int(b) for b in spec.block_ids]


def same_store(a, b) -> None:
    if a is None or b is None:
        assert a is b
        return
    assert list(a.keys_to_store) == list(b.keys_to_store)
    assert spec_ids(a.store_spec) == spec_ids(b.store_spec)
    assert list(a.evicted_keys) == list(b.evicted_keys)


def events(manager) -> list[tuple]:
    return [(tuple(e.keys), e.removed, e.metadata_only) for e in manager.take_events()]


def replay(seed: int, policy: str, num_chunks: int, steps: int) -> dict[str, int]:
    rng = random.Random(seed)
    theirs = CPUOffloadingManager(num_chunks, cache_policy=policy, enable_events=True)
    ours = KVOffloadManager(num_chunks, policy, enable_events=True, num_kv_groups=2)
    managers = (theirs, ours)
    exact = policy == "lru"
    active: list[Req] = []
    stores: list[tuple[Req, list[bytes]]] = []
    counts = dict.fromkeys(["hits", "stored", "evicted", "failed", "resets", "finished"], 0)
    all_keys: set[bytes] = set()
    for n, (keys, positions) in enumerate(docs(rng, steps)):
        all_keys.update(keys)
        req = new_req(f"r{n}", keys, positions, unpositioned=rng.random() < 0.1)
        for m, ctx in zip(managers, req.ctxs, strict=True):
            m.on_new_request(ctx)
        active.append(req)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            req = rng.choice(active)
            if op < 0.3:  # lookup the request's keys, then load the leading hits
                answers = [
                    [m.lookup(k, c) for k in req.keys]
                    for m, c in zip(managers, req.ctxs, strict=True)
                ]
                if exact:
                    assert answers[0] == answers[1]
                ours_hits = answers[1]
                start = rng.randrange(len(req.keys))
                run = []
                for k, a in zip(req.keys[start:], ours_hits[start:], strict=True):
                    if a is not LookupResult.HIT or not all(
                        m.lookup(k, c) is LookupResult.HIT
                        for m, c in zip(managers, req.ctxs, strict=True)
                    ):
                        break
                    run.append(k)
                if run:
                    specs = [
                        m.prepare_load(run, c) for m, c in zip(managers, req.ctxs, strict=True)
                    ]
                    if exact:
                        assert spec_ids(specs[0]) == spec_ids(specs[1])
                    req.loads.append(run)
                    counts["hits"] += len(run)
            elif op < 0.65:  # offer the next chunks (some already offered) for storing
                lo = max(0, req.stored_upto - rng.randint(0, 2))
                hi = min(len(req.keys), req.stored_upto + rng.randint(1, 5))
                offer = req.keys[lo:hi]
                if not offer:
                    continue
                outs = [m.prepare_store(offer, c) for m, c in zip(managers, req.ctxs, strict=True)]
                if exact:
                    same_store(*outs)
                if outs[1] is not None:
                    req.stored_upto = hi
                    if outs[1].keys_to_store:
                        stores.append((req, list(outs[1].keys_to_store)))
                    counts["evicted"] += len(outs[1].evicted_keys)
            elif op < 0.85 and stores:  # complete a store, in any order; 1 in 8 fails
                req, keys = stores.pop(rng.randrange(len(stores)))
                ok = rng.random() > 0.125
                for m, c in zip(managers, req.ctxs, strict=True):
                    m.complete_store(keys, c, success=ok)
                counts["stored" if ok else "failed"] += len(keys)
            elif op < 0.9 and req.loads:
                keys = req.loads.pop(0)
                for m, c in zip(managers, req.ctxs, strict=True):
                    m.complete_load(keys, c)
            elif op < 0.93:
                part = req.keys[: rng.randint(1, len(req.keys))]
                for m, c in zip(managers, req.ctxs, strict=True):
                    m.touch([k for k in part if m.lookup(k, c) is not LookupResult.MISS], c)
            elif op < 0.99 and not req.loads:
                late = rng.random() < 0.5
                for m, c in zip(managers, req.ctxs, strict=True):
                    if late:
                        c.set_offload_key_position(req.keys[-1], req.positions[-1])
                    m.on_request_finished(c)
                active.remove(req)
                counts["finished"] += 1
                if not active:
                    break
            elif op >= 0.99:
                ready = {k for k in all_keys if ours.lookup(k, None) is LookupResult.HIT}
                # vLLM completes no job from before a reset: drop them here too.
                for m in managers:
                    m.reset_cache()
                stores.clear()
                for r in active:
                    r.loads.clear()
                counts["resets"] += 1
                # One difference: ours withdraws what was ready (for routers; vLLM's manager
                # leaves that to the GPU cache's AllBlocksCleared, which routers read as the
                # GPU's alone).
                withdrawn = events(ours)
                assert {k for keys, removed, _ in withdrawn for k in keys} == ready
                assert all(removed for _, removed, _ in withdrawn)
                assert events(theirs) == []
            if exact:
                assert events(theirs) == events(ours)
                assert theirs.get_stats().data == ours.get_stats().data
            else:
                events(theirs), events(ours)
            ours.store.check_invariants()
            statuses = ours.store.lookup(list(all_keys))
            mirror = [
                {LookupResult.MISS: 0, LookupResult.HIT_PENDING: 1, LookupResult.HIT: 2}[
                    ours.lookup(k, None)  # type: ignore[arg-type]
                ]
                for k in all_keys
            ]
            assert statuses.tolist() == mirror
    return counts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_chunks", [6, 40])
def test_lru_replay_matches_vllm_step_by_step(seed, num_chunks):
    counts = replay(seed, "lru", num_chunks, steps=200)
    # The trace exercises what it claims to: hits, evictions, failures.
    assert counts["hits"] > 0
    assert counts["evicted"] > 0
    assert counts["failed"] > 0
    assert counts["finished"] > 0


@pytest.mark.parametrize("seed", range(3))
def test_arc_replay_stays_consistent(seed):
    counts = replay(seed, "arc", 12, steps=200)
    assert counts["hits"] > 0 and counts["evicted"] > 0


def test_positions_set_after_a_keys_first_use_count_at_the_finish():
    """A key stored before its position is known: vLLM orders the finished request by the
    positions it reads then (c is the tail), not by first use (c first)."""

    def evicted_after(manager) -> list[bytes]:
        r = ReqContext("r")
        a, b, c = (make_offload_key(h, 0) for h in (b"a", b"b", b"c"))
        manager.on_new_request(r)
        manager.complete_store(manager.prepare_store([c], r).keys_to_store, r)
        for key, position in ((c, 48), (a, 16), (b, 32)):
            r.set_offload_key_position(key, position)
        manager.complete_store(manager.prepare_store([a, b], r).keys_to_store, r)
        manager.on_request_finished(r)
        s = ReqContext("s")
        manager.on_new_request(s)
        return list(manager.prepare_store([make_offload_key(b"d", 0)], s).evicted_keys)

    theirs = evicted_after(CPUOffloadingManager(3, cache_policy="lru"))
    assert theirs == [make_offload_key(b"c", 0)]
    assert evicted_after(KVOffloadManager(3, "lru")) == theirs


def test_a_key_completed_twice_in_one_call_completes_once():
    ctx = ReqContext("r")
    key = make_offload_key(b"k", 0)
    for manager in (
        CPUOffloadingManager(2, enable_events=True),
        KVOffloadManager(2, enable_events=True),
    ):
        manager.on_new_request(ctx)
        manager.prepare_store([key], ctx)
        manager.complete_store([key, key], ctx)
        assert manager.lookup(key, ctx) is LookupResult.HIT
        assert events(manager) == [((key,), False, False)]
