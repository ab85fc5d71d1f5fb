"""The engine on CUDA: round trips through the pinned pool, and ordering against the compute
stream. Run by benches/gpu_check.sh on a GPU host."""

import pytest
import torch

from kvoffload.transfer import COPY_PATHS, KVCacheLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# About half a second of GPU time: far longer than submitting a job takes, so a job that did not
# wait for the compute stream would copy before the kernel's writes.
SLEEP_CYCLES = 10**9


@pytest.mark.parametrize(("bpc", "skip"), [(1, 0), (3, 0), (3, 1), (3, 2)])
@pytest.mark.parametrize("path", COPY_PATHS)
def test_round_trip_on_cuda(make_cache, kind, bpc, skip, path):
    cache = make_cache(kind, device="cuda")
    engine = cache.engine(num_slots=12, blocks_per_chunk=bpc, copy_path=path, staging_bytes=1)
    assert engine.pool.pinned and engine.pool.buffer.is_pinned()
    slots = [6, 7, 2, 9, 11, 0, 1, 3, 10, 4, 5, 8][: 12 // bpc]
    src = [3, 4, 5, 0, 14, 15, 9, 2, 21, 22, 23, 7]
    dst = [10, 11, 12, 20, 1, 6, 8, 13, 16, 17, 18, 19][skip:]
    stored = cache.blocks(src)
    engine.submit_store(1, src, slots)
    engine.wait([1])
    cache.randomize()
    others = cache.blocks(b for b in range(cache.num_blocks) if b not in dst)

    engine.submit_load(2, slots, dst, skip_leading_blocks=skip)
    engine.wait([2])
    results = engine.get_finished()

    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True)]
    assert all(r.seconds >= 0 for r in results)
    for j, d in enumerate(dst):
        assert torch.equal(cache.block(d), stored[src[skip + j]]), (j, d)
    for b, data in others.items():
        assert torch.equal(cache.block(b), data), b


def fresh_copy(cache):
    new = [torch.randint_like(t.view(torch.uint8), 1, 256) for t in cache.bases]
    torch.cuda.synchronize()
    return new


@pytest.mark.parametrize("path", ["direct", "batched"])
def test_store_waits_for_the_kernels_writing_the_blocks(make_cache, path):
    cache = make_cache("per_layer", device="cuda")
    engine = cache.engine(num_slots=4, blocks_per_chunk=2, copy_path=path)
    new = fresh_copy(cache)

    torch.cuda._sleep(SLEEP_CYCLES)  # on the compute (current) stream
    for t, n in zip(cache.bases, new, strict=True):
        t.view(torch.uint8).copy_(n)
    engine.submit_store(1, [0, 1, 2, 3], [0, 1])
    assert engine.get_finished() == []  # polling never waits for the compute stream
    engine.wait([1])
    torch.cuda.synchronize()
    final = cache.blocks(range(4))
    engine.submit_load(2, [0, 1], [10, 11, 12, 13])
    engine.wait([2])

    assert [r.success for r in engine.get_finished()] == [True, True]
    for b in range(4):
        assert torch.equal(cache.block(10 + b), final[b]), b


@pytest.mark.parametrize("path", ["direct", "batched"])
def test_load_waits_for_the_kernels_reading_the_blocks(make_cache, path):
    cache = make_cache("per_layer", device="cuda")
    engine = cache.engine(num_slots=4, blocks_per_chunk=2, copy_path=path)
    engine.submit_store(1, [0, 1, 2, 3], [0, 1])
    engine.wait([1])
    stored = cache.blocks(range(4))
    before = cache.blocks(range(4, 8))

    torch.cuda._sleep(SLEEP_CYCLES)
    read = [t[:, 4:8].clone() for t in cache.bases]  # what the forward pass reads
    engine.submit_load(2, [0, 1], [4, 5, 6, 7])
    engine.wait([2])
    torch.cuda.synchronize()

    assert [r.success for r in engine.get_finished()] == [True, True]
    for i in range(4):
        seen = torch.cat([r[:, i].reshape(-1) for r in read]).view(torch.uint8).cpu()
        assert torch.equal(seen, before[4 + i]), i
        assert torch.equal(cache.block(4 + i), stored[i]), i


def test_store_waits_for_an_explicit_compute_stream(make_cache):
    cache = make_cache("cross_layer", device="cuda")
    compute = torch.cuda.Stream()
    engine = cache.engine(num_slots=4, blocks_per_chunk=1, compute_stream=compute)
    new = fresh_copy(cache)

    with torch.cuda.stream(compute):
        torch.cuda._sleep(SLEEP_CYCLES)
        cache.bases[0].view(torch.uint8).copy_(new[0])
    engine.submit_store(1, [5], [3])  # from the default stream, which is idle
    engine.wait([1])
    torch.cuda.synchronize()

    assert [r.success for r in engine.get_finished()] == [True]
    assert torch.equal(engine.pool.slot(3), cache.block(5))


def test_failed_job_is_reported_after_its_copies_and_others_succeed(make_cache, fail_second_copy):
    cache = make_cache("per_layer", device="cuda")
    engine = cache.engine(num_slots=8, blocks_per_chunk=2)
    fail_second_copy(engine)
    stored = cache.blocks([0, 1, 4, 5])
    for job, first in ((1, 0), (2, 2), (3, 4)):
        engine.submit_store(job, [first, first + 1], [job])
    engine.wait([1, 2, 3])
    assert [(r.job_id, r.success) for r in engine.get_finished()] == [
        (1, True),
        (2, False),
        (3, True),
    ]

    engine.submit_load(4, [1, 3], [10, 11, 14, 15])
    engine.wait([4])
    assert [(r.job_id, r.success) for r in engine.get_finished()] == [(4, True)]
    for s, d in zip([0, 1, 4, 5], [10, 11, 14, 15], strict=True):
        assert torch.equal(cache.block(d), stored[s])


def test_a_load_waits_for_a_delayed_compute_kernel(make_cache):
    cache = make_cache("cross_layer", device="cuda")
    engine = cache.engine(num_slots=4, blocks_per_chunk=1)
    engine.submit_store(1, [0], [0])
    engine.wait([1])
    stored = cache.block(0)
    engine.get_finished()

    torch.cuda._sleep(SLEEP_CYCLES)  # the forward pass still reading block 5
    engine.submit_load(2, [0], [5])
    assert engine.get_finished() == []  # cannot have finished before the kernel
    engine.wait([2])
    assert [r.success for r in engine.get_finished()] == [True]
    assert torch.equal(cache.block(5), stored)


def test_a_pool_pinned_in_several_pieces_round_trips(make_cache):
    cache = make_cache("per_layer", device="cuda")
    chunk = KVCacheLayout(cache.kv_caches, block_dim=cache.block_dim).chunk_bytes(2)
    engine = cache.engine(num_slots=8, blocks_per_chunk=2, pin_piece_bytes=3 * chunk)
    assert engine.pool.num_pieces == 3 and engine.pool.buffer.is_pinned()
    stored = cache.blocks(range(16))
    engine.submit_store(1, list(range(16)), [2, 3, 4, 5, 6, 7, 0, 1])  # across both piece ends
    engine.wait([1])
    cache.randomize()
    engine.submit_load(2, [2, 3, 4, 5, 6, 7, 0, 1], list(range(16)))
    engine.wait([2])
    assert [r.success for r in engine.get_finished()] == [True, True]
    for b in range(16):
        assert torch.equal(cache.block(b), stored[b]), b


@pytest.mark.parametrize("path", COPY_PATHS)
def test_fp8_caches_round_trip(make_cache, path):
    cache = make_cache("per_layer", device="cuda", dtype=torch.float8_e4m3fn)
    engine = cache.engine(num_slots=4, blocks_per_chunk=2, copy_path=path)
    stored = cache.blocks([0, 1, 2, 3])
    engine.submit_store(1, [0, 1, 2, 3], [3, 1])
    engine.wait([1])
    engine.submit_load(2, [3, 1], [8, 9, 10, 11])
    engine.wait([2])
    assert [r.success for r in engine.get_finished()] == [True, True]
    for s, d in zip([0, 1, 2, 3], [8, 9, 10, 11], strict=True):
        assert torch.equal(cache.block(d), stored[s])


def test_stores_and_loads_in_flight_at_once(make_cache):
    cache = make_cache("per_layer", device="cuda")
    engine = cache.engine(num_slots=8, blocks_per_chunk=2)
    engine.submit_store(1, [0, 1, 2, 3], [0, 1])
    engine.wait([1])
    first = cache.blocks([0, 1, 2, 3])
    second = cache.blocks([4, 5, 6, 7])
    # A store of blocks 4..7 and a load into 12..15 run on their two streams together.
    engine.submit_store(2, [4, 5, 6, 7], [2, 3])
    engine.submit_load(3, [0, 1], [12, 13, 14, 15])
    engine.wait([2, 3])
    engine.submit_load(4, [2, 3], [16, 17, 18, 19])
    engine.wait([4])
    assert [r.success for r in engine.get_finished()] == [True, True, True, True]
    for j in range(4):
        assert torch.equal(cache.block(12 + j), first[j])
        assert torch.equal(cache.block(16 + j), second[4 + j])
