"""GIL stalls: the worst pause a pure-Python thread sees while one thread runs long store calls
(prepare_store of 50,000 keys, which hold the store's lock for milliseconds) and another polls
the store (`stats`, `take_events`, the getters, `KeyList.extend_chunk_keys` on a shared list).
Every store call waits for the lock with the GIL released, so the poller must not freeze the
measuring thread; the baseline is the same run without the poller.

`make bench` prints both worst pauses (2 s each); `make test` runs 0.2 s each, untimed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from kvoffload import CpuStore, KeyList


def worst_pause(poll: Callable[[CpuStore, KeyList], object] | None, seconds: float) -> float:
    store = CpuStore(120_000, enable_events=True)
    keys = KeyList([os.urandom(36) for _ in range(50_000)])
    shared = KeyList()
    stop = threading.Event()

    def hog() -> None:
        while not stop.is_set():
            plan = store.prepare_store(keys)
            assert plan is not None
            store.complete_store(plan.keys, success=False)

    def poller() -> None:
        assert poll is not None
        while not stop.is_set():
            poll(store, shared)

    threads = [threading.Thread(target=hog)]
    if poll is not None:
        threads.append(threading.Thread(target=poller))
    for t in threads:
        t.start()
    worst = spin_worst_pause(seconds)
    stop.set()
    for t in threads:
        t.join()
    return worst


def spin_worst_pause(seconds: float) -> float:
    """Spins a pure-Python loop for `seconds`; the longest gap between two of its iterations is
    how long another thread kept it from running."""
    worst, last = 0.0, time.perf_counter()
    end = last + seconds
    while last < end:
        now = time.perf_counter()
        worst = max(worst, now - last)
        last = now
    return worst


def touch_store(store: CpuStore, shared: KeyList) -> object:
    store.stats()
    store.take_events()
    _ = store.num_slots, store.eviction_policy
    return shared.extend_chunk_keys([b"h" * 32] * 4, 2)


def test_polling_a_busy_store_does_not_stall_other_threads(benchmark):
    full = not benchmark.disabled
    seconds = 2.0 if full else 0.2
    pauses = benchmark.pedantic(
        lambda: (worst_pause(touch_store, seconds), worst_pause(None, seconds)), rounds=1
    )
    if full:
        polled, baseline = pauses
        print(
            f"\nworst pause: {polled * 1e3:.1f} ms polling the store, {baseline * 1e3:.1f} ms "
            f"without the poller (switch interval "
            f"{__import__('sys').getswitchinterval() * 1e3:.0f} ms)"
        )
