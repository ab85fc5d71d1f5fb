"""Hash flooding: two sets of crafted keys against random keys, in the same run.

- "old seed": keys whose hashes share their top 12 bits under the seed kvoffload used before
  (fixed and public), so they pile into one run of index buckets under it;
- "seed-free": keys built to zero foldhash's folded multiply against its public shared seeds,
  which collide under any per-hasher seed (what a seed alone randomises).

The store hashes with random per-hasher and shared seeds, so both should cost what random keys
do (the target is within 2x). Per key: a store in batches of 64 (prepare + complete) into a
store of twice as many slots, then a prefix lookup of each batch.

`make bench` prints the three and their ratios (20,000 keys); `make test` runs 2,000 once,
untimed.
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
    magic = (0xC0AC29B7C97C50DD).to_bytes(8, "little") * 2
    sets = {
        "old seed": _rust._colliding_keys(n),
        "seed-free": [i.to_bytes(4, "little") + bytes(16) + magic for i in range(n)],
        "random": [os.urandom(36) for _ in range(n)],
    }
    assert all(len(set(keys)) == n for keys in sets.values())
    benchmark.pedantic(store_and_look_up, args=(sets["seed-free"],), rounds=3 if full else 1)
    if full:
        times = {
            name: min(timeit.repeat(lambda k=keys: store_and_look_up(k), number=1, repeat=7))
            for name, keys in sets.items()
        }
        base = times["random"]
        rows = [
            f"{name} {t / n * 1e9:.0f} ns ({t / base:.2f}x random)" for name, t in times.items()
        ]
        print(f"\nper key, {n:,} keys: " + ", ".join(rows))
