"""Hash flooding: keys crafted to pile into one run of index buckets under the hash seed that
kvoffload used before (fixed and public), against random keys, in the same run. The store hashes
with a random per-process seed, so crafted keys should cost what random ones do (the target is
within 2x). Per key: a store in batches of 64 (prepare + complete) into a store of twice as many
slots, then a prefix lookup of each batch.

`make bench` prints both and the ratio (20,000 keys); `make test` runs 2,000 once, untimed.
"""

from __future__ import annotations

import os
import timeit

from kvoffload import CpuStore, _rust


def store_and_look_up(keys: list[bytes]) -> None:
    store = CpuStore(2 * len(keys))
    batches = [keys[i : i + 64] for i in range(0, len(keys), 64)]
    for batch in batches:
        plan = store.prepare_store(batch)
        assert plan is not None
        store.complete_store(plan.keys)
    for batch in batches:
        assert store.lookup_prefix(batch).hits == len(batch)


def test_crafted_keys_cost_what_random_keys_do(benchmark):
    full = not benchmark.disabled
    n = 20_000 if full else 2_000
    crafted = _rust._colliding_keys(n)
    random_keys = [os.urandom(36) for _ in range(n)]
    assert len(set(crafted)) == n
    benchmark.pedantic(store_and_look_up, args=(crafted,), rounds=3 if full else 1)
    if full:
        times = {
            name: min(timeit.repeat(lambda k=keys: store_and_look_up(k), number=1, repeat=7))
            for name, keys in (("crafted", crafted), ("random", random_keys))
        }
        print(
            f"\nper key, {n:,} keys: crafted {times['crafted'] / n * 1e9:.0f} ns, random "
            f"{times['random'] / n * 1e9:.0f} ns, crafted / random = "
            f"{times['crafted'] / times['random']:.2f}x"
        )
