"""CPU-mode behaviour of the transfer engine: round trips, skips, failures, ordering, validation."""

import numpy as np
import pytest
import torch

from kvoffload.errors import InvalidStateError
from kvoffload.transfer import COPY_PATHS

# Source blocks mix runs (3,4,5 / 14,15) with jumps; slots mix a consecutive pair with jumps.
SRC = [3, 4, 5, 0, 14, 15, 9, 2, 21, 22, 23, 7]
DST = [10, 11, 12, 20, 1, 6, 8, 13, 16, 17, 18, 19]
SLOTS = {1: [6, 7, 2, 9, 11, 0, 1, 3, 10, 4, 5, 8], 3: [6, 7, 2, 9]}

# "batched" with a one-chunk staging buffer also covers jobs that need several batches.
PATHS = [
    ("auto", {}),
    ("direct", {}),
    ("batched", {"staging_bytes": 1}),
    ("per_block", {}),
    ("kernel", {}),  # the Triton kernel, interpreted on the CPU (conftest sets TRITON_INTERPRET)
]


def finished(engine, job_ids):
    engine.wait(job_ids)
    return engine.get_finished()


@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize(("path", "options"), PATHS, ids=[p for p, _ in PATHS])
def test_store_then_load_round_trips_bytes(make_cache, kind, bpc, path, options):
    cache = make_cache(kind)
    engine = cache.engine(num_slots=12, blocks_per_chunk=bpc, copy_path=path, **options)
    slots, src, dst = SLOTS[bpc], SRC, DST
    stored = cache.blocks(src)
    job_bytes = len(src) * cache.block(0).numel()

    engine.submit_store(1, np.array(src), slots)
    assert [(r.job_id, r.success, r.num_bytes) for r in finished(engine, [1])] == [
        (1, True, job_bytes)
    ]
    cache.randomize()
    others = cache.blocks(b for b in range(cache.num_blocks) if b not in dst)
    engine.submit_load(2, torch.tensor(slots), dst)
    assert [(r.job_id, r.success, r.num_bytes) for r in finished(engine, [2])] == [
        (2, True, job_bytes)
    ]

    for s, d in zip(src, dst, strict=True):
        assert torch.equal(cache.block(d), stored[s]), (s, d)
    for b, data in others.items():
        assert torch.equal(cache.block(b), data), b


@pytest.mark.parametrize("skip", [1, 2])
@pytest.mark.parametrize(("path", "options"), PATHS, ids=[p for p, _ in PATHS])
def test_load_skips_the_blocks_already_on_the_gpu(make_cache, kind, skip, path, options):
    cache = make_cache(kind)
    engine = cache.engine(num_slots=10, blocks_per_chunk=3, copy_path=path, **options)
    slots, src = [4, 5, 1], [0, 1, 2, 3, 4, 5, 9, 10, 11]
    stored = cache.blocks(src)
    engine.submit_store(1, src, slots)
    cache.randomize()
    # The request already has the first `skip` blocks of chunk 0 locally, in blocks 12.. .
    dst = [13, 12, 20, 21, 22, 6, 7, 8, 17][: 9 - skip]
    others = cache.blocks(b for b in range(cache.num_blocks) if b not in dst)

    engine.submit_load(2, slots, dst, skip_leading_blocks=skip)
    results = finished(engine, [1, 2])

    assert [(r.job_id, r.success, r.num_bytes) for r in results] == [
        (1, True, 9 * engine.layout.block_bytes),
        (2, True, (9 - skip) * engine.layout.block_bytes),
    ]
    for j, d in enumerate(dst):
        assert torch.equal(cache.block(d), stored[src[skip + j]]), (j, d)
    for b, data in others.items():
        assert torch.equal(cache.block(b), data), b


@pytest.mark.parametrize(("skip", "num_blocks"), [(0, 7), (2, 5), (1, 1), (0, 2)])
@pytest.mark.parametrize(("path", "options"), PATHS, ids=[p for p, _ in PATHS])
def test_partial_last_chunk_copies_only_its_leading_pages(
    make_cache, kind, skip, num_blocks, path, options
):
    """vLLM's partial tails: a job may end inside its last chunk (and start inside its first);
    the pages of those chunks that no block maps to stay as they were, both ways."""
    cache = make_cache(kind)
    engine = cache.engine(num_slots=6, blocks_per_chunk=3, copy_path=path, **options)
    num_slots = -(-(skip + num_blocks) // 3)
    slots = [5, 0, 3][:num_slots]
    full = [0, 1, 2, 3, 4, 5, 6, 7, 8][: 3 * num_slots]
    engine.submit_store(1, full, slots)
    old = cache.blocks(full)
    cache.randomize()
    src = [9, 10, 11, 12, 13, 14, 15, 16, 17][:num_blocks]
    new = cache.blocks(src)
    engine.submit_store(2, src, slots, skip_leading_blocks=skip)
    dst = [18, 19, 20, 21, 22, 23, 1, 2, 4][: 3 * num_slots]
    others = cache.blocks(b for b in range(cache.num_blocks) if b not in dst)
    engine.submit_load(3, slots, dst)
    results = finished(engine, [1, 2, 3])

    assert [(r.job_id, r.num_bytes) for r in results] == [
        (1, 3 * num_slots * engine.layout.block_bytes),
        (2, num_blocks * engine.layout.block_bytes),
        (3, 3 * num_slots * engine.layout.block_bytes),
    ]
    for j, d in enumerate(dst):
        written = skip <= j < skip + num_blocks
        want = new[src[j - skip]] if written else old[full[j]]
        assert torch.equal(cache.block(d), want), (j, d)
    for b, data in others.items():
        assert torch.equal(cache.block(b), data), b
    # A partial load writes only the blocks it lists.
    cache.randomize()
    keep = cache.blocks(range(cache.num_blocks))
    engine.submit_load(4, slots, dst[skip : skip + num_blocks], skip_leading_blocks=skip)
    assert [r.success for r in finished(engine, [4])] == [True]
    for j in range(3 * num_slots):
        d = dst[j]
        if skip <= j < skip + num_blocks:
            assert torch.equal(cache.block(d), new[src[j - skip]]), (j, d)
        else:
            assert torch.equal(cache.block(d), keep[d]), (j, d)


@pytest.mark.parametrize("path", COPY_PATHS)
def test_store_with_skip_leaves_the_leading_pages_of_the_slot(make_cache, path):
    cache = make_cache("per_layer")
    engine = cache.engine(num_slots=4, blocks_per_chunk=3, copy_path=path)
    first = cache.blocks([0, 1, 2])
    engine.submit_store(1, [0, 1, 2], [3])
    second = cache.blocks([5, 6])
    engine.submit_store(2, [5, 6], [3], skip_leading_blocks=1)
    engine.submit_load(3, [3], [10, 11, 12])

    assert [r.success for r in finished(engine, [1, 2, 3])] == [True, True, True]
    assert torch.equal(cache.block(10), first[0])
    assert torch.equal(cache.block(11), second[5])
    assert torch.equal(cache.block(12), second[6])


def test_cross_layer_slot_is_the_chunk_contiguous(make_cache):
    cache = make_cache("cross_layer")
    engine = cache.engine(num_slots=5, blocks_per_chunk=3)
    engine.submit_store(1, [7, 2, 3], [4])
    finished(engine, [1])
    expected = torch.cat([cache.block(b) for b in (7, 2, 3)])
    assert torch.equal(engine.pool.slot(4), expected)


def test_per_layer_slot_holds_each_segment_of_the_chunk_in_turn(make_cache):
    cache = make_cache("per_layer", num_layers=2)
    engine = cache.engine(num_slots=2, blocks_per_chunk=2)
    engine.submit_store(1, [5, 9], [1])
    finished(engine, [1])
    pages = [
        t[kv, b].contiguous().view(torch.uint8).reshape(-1)
        for t in cache.bases
        for kv in (0, 1)
        for b in (5, 9)
    ]
    assert torch.equal(engine.pool.slot(1), torch.cat(pages))


@pytest.mark.parametrize("path", COPY_PATHS)
def test_runs_of_slots_across_pool_pieces_round_trip(make_cache, path):
    cache = make_cache("cross_layer", num_blocks=16)
    chunk = cache.engine(num_slots=1, blocks_per_chunk=2).chunk_bytes
    engine = cache.engine(
        num_slots=7, blocks_per_chunk=2, copy_path=path, pin_piece_bytes=chunk * 3
    )
    assert engine.pool.num_pieces == 3
    stored = cache.blocks(range(12))
    engine.submit_store(1, range(12), [1, 2, 3, 4, 5, 6])
    cache.randomize()
    engine.submit_load(2, [1, 2, 3, 4, 5, 6], range(12))
    assert [r.success for r in finished(engine, [1, 2])] == [True, True]
    for b in range(12):
        assert torch.equal(cache.block(b), stored[b]), b


def test_failed_copy_reports_failure_and_other_jobs_complete(make_cache, fail_second_copy):
    cache = make_cache("per_layer")
    engine = cache.engine(num_slots=10, blocks_per_chunk=2)
    fail_second_copy(engine)
    stored = cache.blocks([0, 1, 4, 5])
    engine.submit_store(1, [0, 1], [0])
    engine.submit_store(2, [2, 3], [1])
    engine.submit_store(3, [4, 5], [2])
    assert [(r.job_id, r.success) for r in engine.get_finished()] == [
        (1, True),
        (2, False),
        (3, True),
    ]

    cache.randomize()
    engine.submit_load(4, [0, 2], [10, 11, 14, 15])
    assert [(r.job_id, r.success) for r in engine.get_finished()] == [(4, True)]
    for s, d in zip([0, 1, 4, 5], [10, 11, 14, 15], strict=True):
        assert torch.equal(cache.block(d), stored[s])


def test_copy_from_broken_cache_memory_fails_only_that_job(make_cache):
    cache = make_cache("per_layer")
    engine = cache.engine(num_slots=10, blocks_per_chunk=1, copy_path="direct")
    storage = cache.bases[1].untyped_storage()
    size = storage.nbytes()
    engine.submit_store(1, [0], [0])
    storage.resize_(0)  # bad data: layer 1's memory is gone, so torch raises inside the copy
    engine.submit_store(2, [1], [1])
    storage.resize_(size)
    cache.randomize()
    stored = cache.blocks([2])
    engine.submit_store(3, [2], [2])
    engine.submit_load(4, [2], [9])

    results = engine.get_finished()

    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, False), (3, True), (4, True)]
    assert torch.equal(cache.block(9), stored[2])


def test_results_come_in_submission_order_once_and_ids_are_reusable(make_cache):
    cache = make_cache("cross_layer")
    engine = cache.engine(num_slots=8, blocks_per_chunk=1)
    engine.submit_store(30, [0], [0])
    engine.submit_load(10, [0], [5])
    engine.submit_store(20, [1, 2], [1, 2])
    engine.submit_load(5, [], [])
    with pytest.raises(ValueError, match="job_id=20 is already in use"):
        engine.submit_load(20, [1], [6])

    results = engine.get_finished()

    block = engine.layout.block_bytes
    assert [(r.job_id, r.success, r.num_bytes) for r in results] == [
        (30, True, block),
        (10, True, block),
        (20, True, 2 * block),
        (5, True, 0),
    ]
    assert all(r.seconds >= 0 for r in results)
    assert engine.get_finished() == []
    engine.wait([30, 12345])  # reported and unknown ids: nothing to wait for
    engine.submit_load(20, [1], [6])
    assert [r.job_id for r in engine.get_finished()] == [20]


def test_close_refuses_new_jobs(make_cache):
    cache = make_cache("per_layer")
    with cache.engine(num_slots=2, blocks_per_chunk=1) as engine:
        engine.submit_store(1, [0], [0])
    assert [r.job_id for r in engine.get_finished()] == [1]
    with pytest.raises(InvalidStateError, match="closed"):
        engine.submit_store(2, [0], [0])
    engine.close()


# args: direction, job_id, gpu_block_ids, slots[, skip_leading_blocks]
@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("store", 1, [0, 1, 2], [10]), ValueError, r"slots\[0\]=10 is out of range.*0\.\.9"),
        (("store", 1, [0, 1, 24], [0]), ValueError, r"gpu_block_ids\[2\]=24 is out of range"),
        (("load", 1, [0, 1, 2], [-1]), ValueError, r"slots\[0\]=-1 is out of range"),
        (("store", 1, [], [0]), ValueError, r"len\(gpu_block_ids\)=0 .* = 3, or down to 1"),
        (("load", 1, [0, 1, 2], [0, 1]), ValueError, r"= 2 \* 3 - 0 = 6, or down to 4"),
        (("load", 1, [0], [0, 1], 2), ValueError, r"= 2 \* 3 - 2 = 4, or down to 2\b"),
        (("load", 1, [0, 1], [0, 1, 2], 3), ValueError, r"skip_leading_blocks=3 .* 0\.\.2"),
        (("load", 1, [0], [0, 1, 2, 3], -1), ValueError, r"skip_leading_blocks=-1"),
        (("load", 1, [0], [1, 2], True), ValueError, r"skip_leading_blocks=True"),
        (("load", 1, [0], [1, 2], 1.0), TypeError, r"skip_leading_blocks must be an int"),
        (("load", 1, [], [], 1), ValueError, r"0 when there are no slots"),
        (("store", 1, [0, 1, 2, 3, 4, 5], [1, 1]), ValueError, r"slots repeats \[1\]"),
        (("load", 1, [4, 5, 4, 6, 7, 8], [0, 1]), ValueError, r"gpu_block_ids repeats \[4\]"),
        (("store", 1, [0.0, 1.0, 2.0], [0]), TypeError, r"gpu_block_ids must hold ints"),
        (("store", 1, [0, 1, 2], [[0]]), ValueError, r"slots must be 1-D"),
        (("store", 1, [0, 1, 2], "0"), TypeError, r"slots must hold ints"),
        (("store", True, [0, 1, 2], [0]), TypeError, r"job_id must be an int"),
        (("store", "1", [0, 1, 2], [0]), TypeError, r"job_id must be an int"),
    ],
)
def test_invalid_job_raises_and_copies_nothing(make_cache, args, error, match):
    cache = make_cache("per_layer")
    engine = cache.engine(num_slots=10, blocks_per_chunk=3)
    engine.pool.buffer.fill_(0)
    before = cache.blocks(range(cache.num_blocks))
    direction, job_id, gpu, slots, *skip = args

    with pytest.raises(error, match=match):
        if direction == "store":
            engine.submit_store(job_id, gpu, slots, *skip)
        else:
            engine.submit_load(job_id, slots, gpu, *skip)

    assert engine.get_finished() == []
    assert not engine.pool.buffer.any()
    for b, data in before.items():
        assert torch.equal(cache.block(b), data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.uint8])
@pytest.mark.parametrize("skip", [0, 2])
def test_the_kernel_path_copies_every_layout_and_dtype_byte_for_byte(make_cache, kind, dtype, skip):
    cache = make_cache(kind, dtype=dtype)
    engine = cache.engine(num_slots=12, blocks_per_chunk=3, copy_path="kernel")
    stored = cache.blocks(SRC)
    slots = SLOTS[3]
    assert [r.success for r in finished(engine, [_store(engine, 1, SRC, slots)])] == [True]
    cache.randomize()
    others = cache.blocks(b for b in range(cache.num_blocks) if b not in DST[skip:])
    engine.submit_load(2, slots, DST[skip:], skip_leading_blocks=skip)
    assert [r.success for r in finished(engine, [2])] == [True]
    for j, d in enumerate(DST[skip:]):
        assert torch.equal(cache.block(d), stored[SRC[skip + j]]), (j, d)
    for b, data in others.items():
        assert torch.equal(cache.block(b), data), b
    engine.close()


def _store(engine, job_id, blocks, slots):
    engine.submit_store(job_id, blocks, slots)
    return job_id


def test_the_kernel_path_needs_cuda_or_the_interpreter(make_cache, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"copy_path='kernel' needs CUDA tensors"):
        make_cache("cross_layer").engine(num_slots=2, blocks_per_chunk=1, copy_path="kernel")
