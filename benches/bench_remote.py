"""The shared tier's data path against a real `redis-server` the bench starts itself.

Store and load GB/s of `RedisClient` (Rust, writev from and recv into the caller's buffer)
against `redis-benchmark` (C, the server's own tool) and redis-py + hiredis, at the same value
size (2 MiB) in the same run; p50/p99 of 1-, 8- and 64-chunk jobs; a 1,000-key lookup; Redis
`used_memory` per stored chunk over its payload; the scheduler thread's time per submit call, and
the worst pause a pure-Python thread sees while jobs run (the GIL is released during I/O).

`make bench` prints the table; `make test` runs it once on a few chunks, untimed, and checks
the bytes.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_gil import spin_worst_pause
from kvoffload.tiers import OK
from kvoffload.tiers.redis import RedisClient, RedisLookups, RedisTierConfig
from redis_server import redis_cluster, redis_server

MiB = 1 << 20
CHUNK = 2 * MiB


def finish(c: RedisClient, job: int) -> bytes:
    while True:
        for done, statuses in c.wait(5.0):
            if done == job:
                return statuses


def make_client(url: str, chunk: int = CHUNK, **options: object) -> RedisClient:
    config = RedisTierConfig.from_dict(
        {"url": url, "namespace": "bench", "job_timeout_s": 30.0, **options}
    )
    return RedisClient(config, b"\x01" * 16, chunk)


def keys(n: int, salt: str) -> list[bytes]:
    return [f"{salt}-{i:08d}".encode().ljust(36, b".") for i in range(n)]


def ours(url: str, pool: np.ndarray, rounds: int, **options: object) -> tuple[float, float]:
    c = make_client(url, **options)
    n = pool.shape[0]
    offsets = [i * CHUNK for i in range(n)]
    dst = np.zeros_like(pool)
    store_s = load_s = 0.0
    for r in range(rounds):
        ks = keys(n, f"ours{r}")
        t = time.perf_counter()
        assert finish(c, c.store(ks, pool, offsets)) == bytes([OK]) * n
        store_s += time.perf_counter() - t
        t = time.perf_counter()
        assert finish(c, c.load(ks, dst, offsets)) == bytes([OK]) * n
        load_s += time.perf_counter() - t
        assert np.array_equal(dst, pool)
    c.close()
    total = rounds * n * CHUNK
    return total / store_s / 1e9, total / load_s / 1e9


def redis_py(port: int, pool: np.ndarray, rounds: int) -> tuple[float, float]:
    import redis

    r = redis.Redis(port=port)
    n = pool.shape[0]
    values = [pool[i].tobytes() for i in range(n)]
    store_s = load_s = 0.0
    for rnd in range(rounds):
        ks = keys(n, f"py{rnd}")
        t = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for k, v in zip(ks, values, strict=True):
            pipe.set(k, v, nx=True)
        pipe.execute()
        store_s += time.perf_counter() - t
        t = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for k in ks:
            pipe.get(k)
        got = pipe.execute()
        load_s += time.perf_counter() - t
        assert got[0] == values[0]
    r.close()
    total = rounds * n * CHUNK
    return total / store_s / 1e9, total / load_s / 1e9


def redis_benchmark(port: int, n: int, tls: tuple[str, ...] = ()) -> tuple[float, float]:
    """`-c 1`: one connection (per node with `--cluster`), as ours has per worker."""
    out = subprocess.run(
        [
            "redis-benchmark",
            *tls,
            "-p",
            str(port),
            "-t",
            "set,get",
            "-d",
            str(CHUNK),
            "-n",
            str(n),
            "-P",
            "16",
            "-c",
            "1",
            "-q",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    rates = dict(re.findall(r"(SET|GET): ([\d.]+) requests per second", out))
    return float(rates["SET"]) * CHUNK / 1e9, float(rates["GET"]) * CHUNK / 1e9


def latencies(
    url: str, pool: np.ndarray, sizes: tuple[int, ...], reps: int, **options: object
) -> dict[int, tuple]:
    c = make_client(url, **options)
    out = {}
    for n in sizes:
        offsets = [i * CHUNK for i in range(n)]
        ks = keys(n, f"lat{n}")
        finish(c, c.store(ks, pool, offsets))
        samples = []
        for _ in range(reps):
            t = time.perf_counter()
            finish(c, c.load(ks, pool, offsets))
            samples.append(time.perf_counter() - t)
        out[n] = (np.percentile(samples, 50), np.percentile(samples, 99))
    c.close()
    return out


def lookup_and_submit(url: str, n_keys: int, reps: int) -> tuple[float, float, float]:
    """1,000-key lookup latency, and the submit call's own time (what the scheduler thread
    pays) per call for 1 key and per key for `n_keys`."""
    c = make_client(url, chunk=4096)
    pool = np.zeros((n_keys, 4096), np.uint8)
    ks = keys(n_keys, "look")
    finish(c, c.store(ks, pool, [i * 4096 for i in range(n_keys)]))
    total, submit_one, submit_many = [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        job = c.lookup(ks)
        submit_many.append(time.perf_counter() - t)
        assert finish(c, job) == bytes([OK]) * n_keys
        total.append(time.perf_counter() - t)
        t = time.perf_counter()
        job = c.lookup(ks[:1])
        submit_one.append(time.perf_counter() - t)
        finish(c, job)
    c.close()
    return float(np.median(total)), float(np.median(submit_one)), float(np.median(submit_many))


def scheduler_thread(url: str, n_keys: int, reps: int) -> tuple[float, float, float]:
    """What a scheduler step pays on its own thread with RedisTier's lookups: `lookup` per key
    (vLLM asks key by key; a dict, no I/O), the step's `flush` (one Rust submit for all new keys)
    and a poll that applies the answers."""
    c = make_client(url, chunk=4096)
    lookups = RedisLookups(c)
    per_key, flush, poll = [], [], []
    for rep in range(reps):
        ks = keys(n_keys, f"sched{rep}")
        t = time.perf_counter()
        for k in ks:
            lookups.lookup(k, "req")
        per_key.append((time.perf_counter() - t) / n_keys)
        t = time.perf_counter()
        lookups.flush()
        flush.append(time.perf_counter() - t)
        while lookups.in_flight():
            time.sleep(0.0005)
            t = time.perf_counter()
            lookups.lookup(ks[0], "req")  # the first lookup of a step polls the answers
            poll.append(time.perf_counter() - t)
            lookups.flush()
        assert lookups.lookup(ks[-1], "req") is False
        lookups.cleanup("req")
    c.close()
    return float(np.median(per_key)), float(np.median(flush)), float(np.median(poll))


def faults(server: object, pool: np.ndarray) -> tuple[float, float, float]:
    """A frozen server (SIGSTOP): seconds until a 1-chunk load fails, and that job's deadline
    (`job_timeout_s` + bytes / `min_bandwidth_mb_s`, defaults); then a dead server, down until
    the breaker opens, restarted on the same port: seconds from its first PING to the first
    store that succeeds again (defaults: breaker cool-down 2 s, reconnect backoff up to 1 s)."""
    c = RedisClient(
        RedisTierConfig.from_dict({"url": server.url, "namespace": "faults"}),  # type: ignore[attr-defined]
        b"\x02" * 16,
        CHUNK,
    )
    finish(c, c.store(keys(1, "f"), pool, [0]))
    deadline = c.config.job_timeout_s + CHUNK / (c.config.min_bandwidth_mb_s * 1e6)
    server.freeze()  # type: ignore[attr-defined]
    t = time.perf_counter()
    assert finish(c, c.load(keys(1, "f"), pool, [0])) != bytes([OK])
    detected = time.perf_counter() - t
    server.thaw()  # type: ignore[attr-defined]
    server.stop()  # type: ignore[attr-defined]
    while c.state != "down":  # down long enough for the breaker to open
        finish(c, c.store(keys(1, "while-down"), pool, [0]))
    server.start()  # type: ignore[attr-defined]
    t = time.perf_counter()
    i = 0
    while finish(c, c.store(keys(1, f"back{i}"), pool, [0])) != bytes([OK]):
        i += 1
        time.sleep(0.01)
    recovered = time.perf_counter() - t
    c.close()
    return detected, deadline, recovered


def memory_ratio(server: object, n: int) -> float:
    c = make_client(server.url)  # type: ignore[attr-defined]
    pool = np.random.default_rng(0).integers(0, 256, (n, CHUNK), dtype=np.uint8)
    server.command("FLUSHALL")  # type: ignore[attr-defined]
    before = server.used_memory()  # type: ignore[attr-defined]
    finish(c, c.store(keys(n, "mem"), pool, [i * CHUNK for i in range(n)]))
    # After the connections close: each holds a query buffer (about one value) while open, a
    # per-connection cost, not a per-chunk one.
    c.close()
    time.sleep(0.2)
    after = server.used_memory()  # type: ignore[attr-defined]
    return (after - before) / (n * CHUNK)


def worst_python_pause(url: str, pool: np.ndarray, seconds: float) -> float:
    c = make_client(url)
    n = pool.shape[0]
    offsets = [i * CHUNK for i in range(n)]
    ks = keys(n, "gil")
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            finish(c, c.store(ks, pool, offsets))
            finish(c, c.load(ks, pool, offsets))

    t = threading.Thread(target=traffic)
    t.start()
    worst = spin_worst_pause(seconds)
    stop.set()
    t.join()
    c.close()
    return worst


def test_remote_data_path(benchmark):
    full = not benchmark.disabled
    n, rounds = (64, 5) if full else (4, 1)
    pool = np.random.default_rng(1).integers(0, 256, (n, CHUNK), dtype=np.uint8)
    with redis_server() as server:

        def run() -> dict:
            res = {"ours": ours(server.url, pool, rounds)}
            server.command("FLUSHALL")
            res["redis-py"] = redis_py(server.port, pool, rounds)
            server.command("FLUSHALL")
            res["redis-benchmark"] = redis_benchmark(server.port, n * rounds)
            server.command("FLUSHALL")
            res["lat"] = latencies(
                server.url, pool, tuple(sorted({1, min(8, n), n})), 20 if full else 2
            )
            res["lookup"] = lookup_and_submit(server.url, 1000, 20 if full else 2)
            res["sched"] = scheduler_thread(server.url, 1000, 20 if full else 2)
            res["mem"] = memory_ratio(server, 32 if full else 2)
            res["faults"] = faults(server, pool)
            res["pause"] = worst_python_pause(server.url, pool, 2.0 if full else 0.2)
            return res

        res = benchmark.pedantic(run, rounds=1)
    if not full:
        return
    (os_, ol), (ps, pl), (bs, bl) = res["ours"], res["redis-py"], res["redis-benchmark"]
    print(f"\n2 MiB values, {n} per job, {rounds} rounds, loopback")
    print("| client | store GB/s | load GB/s | store vs ours | load vs ours |")
    print("|---|---|---|---|---|")
    print(f"| kvoffload RedisClient | {os_:.2f} | {ol:.2f} | 1.00x | 1.00x |")
    print(f"| redis-benchmark -P 16 | {bs:.2f} | {bl:.2f} | {bs / os_:.2f}x | {bl / ol:.2f}x |")
    print(f"| redis-py + hiredis | {ps:.2f} | {pl:.2f} | {ps / os_:.2f}x | {pl / ol:.2f}x |")
    print(
        f"ours / redis-benchmark: store {os_ / bs:.2f}x, load {ol / bl:.2f}x; "
        f"ours / redis-py: store {os_ / ps:.2f}x, load {ol / pl:.2f}x"
    )
    for size, (p50, p99) in res["lat"].items():
        print(f"load of {size} chunk(s): p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")
    total, one, many = res["lookup"]
    print(
        f"1,000-key lookup: {total * 1e3:.2f} ms; submit call {one * 1e6:.1f} us for 1 key, "
        f"{many * 1e6 / 1000:.2f} us per key for 1,000"
    )
    per_key, flush, poll = res["sched"]
    print(
        f"scheduler thread, 1,000-key step: lookup {per_key * 1e6:.2f} us per key, flush "
        f"{flush * 1e6:.1f} us, poll {poll * 1e6:.1f} us"
    )
    detected, deadline, recovered = res["faults"]
    print(
        f"frozen server: a 1-chunk load failed after {detected:.2f} s (its deadline "
        f"{deadline:.2f} s); a dead server restarted with the breaker open: the first store "
        f"succeeded {recovered:.2f} s after the server answered PING"
    )
    print(f"Redis used_memory per chunk / payload: {res['mem']:.4f}")
    print(f"worst pause of a Python thread during 2 s of jobs: {res['pause'] * 1e3:.1f} ms")


def test_remote_tls_cost(benchmark):
    """What TLS costs on one server: ours over `rediss://` against ours over plain TCP to the
    same server (its TLS port and its plain port), and `redis-benchmark --tls` against
    `redis-benchmark`, in the same run."""
    full = not benchmark.disabled
    n, rounds = (64, 5) if full else (4, 1)
    pool = np.random.default_rng(2).integers(0, 256, (n, CHUNK), dtype=np.uint8)
    with redis_server(tls=True) as server:
        ca = {"tls_ca_file": server.cert("ca.crt")}
        tls_args = ("--tls", "--cacert", server.cert("ca.crt"))

        def run() -> dict:
            res = {}
            for name, url, opts in [
                ("plain", server.url, {}),
                ("tls", server.tls_url, ca),
            ]:
                server.command("FLUSHALL")
                res[name] = ours(url, pool, rounds, **opts)
                server.command("FLUSHALL")
                res[name + "-lat"] = latencies(url, pool, (1,), 20 if full else 2, **opts)[1]
            server.command("FLUSHALL")
            res["rb-plain"] = redis_benchmark(server.port, n * rounds)
            server.command("FLUSHALL")
            assert server.tls_port is not None
            res["rb-tls"] = redis_benchmark(server.tls_port, n * rounds, tls_args)
            return res

        res = benchmark.pedantic(run, rounds=1)
    if not full:
        return
    print(f"\nTLS against plain TCP, one server, 2 MiB values, {n} per job, {rounds} rounds")
    print("| client | plain store / load GB/s | TLS store / load GB/s | TLS / plain |")
    print("|---|---|---|---|")
    for label, p, t in [
        ("kvoffload RedisClient", res["plain"], res["tls"]),
        ("redis-benchmark -P 16", res["rb-plain"], res["rb-tls"]),
    ]:
        print(
            f"| {label} | {p[0]:.2f} / {p[1]:.2f} | {t[0]:.2f} / {t[1]:.2f} | "
            f"{t[0] / p[0]:.2f}x / {t[1] / p[1]:.2f}x |"
        )
    (ts, tl), (bs, bl) = res["tls"], res["rb-tls"]
    print(f"ours / redis-benchmark over TLS: store {ts / bs:.2f}x, load {tl / bl:.2f}x")
    for name in ("plain", "tls"):
        p50, p99 = res[name + "-lat"]
        print(f"{name}: load of 1 chunk p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")


def test_remote_cluster(benchmark):
    """A local cluster of 3 primaries (and 3 replicas), in the same run: ours against
    `redis-benchmark --cluster` (same value size and pipeline depth), and a 1,000-key lookup
    spread over the 3 primaries against the same lookup on one plain server."""
    full = not benchmark.disabled
    n, rounds = (64, 5) if full else (4, 1)
    pool = np.random.default_rng(3).integers(0, 256, (n, CHUNK), dtype=np.uint8)
    reps = 20 if full else 2
    with redis_cluster() as cluster, redis_server() as single:

        def run() -> dict:
            res = {"ours": ours(cluster.url, pool, rounds)}
            for p in cluster.primaries():
                p.command("FLUSHALL")
            # Fewer requests than its clients' pipelines (3 nodes x 16) make it abort.
            res["rb"] = redis_benchmark(cluster.nodes[0].port, max(n * rounds, 64), ("--cluster",))
            res["lookup-cluster"] = lookup_and_submit(cluster.url, 1000, reps)[0]
            res["lookup-single"] = lookup_and_submit(single.url, 1000, reps)[0]
            return res

        res = benchmark.pedantic(run, rounds=1)
    if not full:
        return
    (os_, ol), (bs, bl) = res["ours"], res["rb"]
    print(f"\nRedis Cluster, 3 primaries, 2 MiB values, {n} per job, {rounds} rounds")
    print("| client | store GB/s | load GB/s |")
    print("|---|---|---|")
    print(f"| kvoffload RedisClient | {os_:.2f} | {ol:.2f} |")
    print(f"| redis-benchmark --cluster -P 16 -c 1 | {bs:.2f} | {bl:.2f} |")
    print(f"ours / redis-benchmark: store {os_ / bs:.2f}x, load {ol / bl:.2f}x")
    lc, ls = res["lookup-cluster"], res["lookup-single"]
    print(
        f"1,000-key lookup: {lc * 1e3:.2f} ms over 3 primaries, {ls * 1e3:.2f} ms on one "
        f"server ({lc / ls:.2f}x)"
    )
