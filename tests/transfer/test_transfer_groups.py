"""Jobs made of parts (vLLM's hybrid models: one part per KV-cache group, each in its own
segments), on every copy path: bytes in the pool and on the GPU, validation across parts."""

import numpy as np
import pytest
import torch

from kvoffload.transfer import JobPart, KVCacheLayout, TransferEngine
from kvoffload.transfer.plan import Batch, Geometry, staging_copies

LAYERS = [f"model.layers.{i}.attn" for i in range(3)]
SENTINEL = 0xA5

# "auto" batches on CUDA only (on the CPU it copies runs directly); "batched" with a one-chunk
# staging buffer needs several batches per part, with the default one batch per part.
PATHS = [
    ("direct", {}),
    ("per_block", {}),
    ("auto", {"staging_bytes": 1, "min_direct_copy_bytes": 1 << 30}),
    ("batched", {"staging_bytes": 1}),
    ("batched", {}),
    ("kernel", {}),  # interpreted on the CPU (conftest sets TRITON_INTERPRET)
]
PATH_IDS = ["direct", "per_block", "auto", "batched_1", "batched", "kernel"]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]

# Group A (all 3 layers): 4 chunks, skipping 1 block and ending 1 block early. Group B (2
# layers): 3 chunks, skipping 2 blocks, its last chunk full; its last two slots are consecutive.
A_SLOTS, B_SLOTS = [4, 5, 6, 7], [8, 2, 3]
A_SRC, A_DST = [2, 3, 4, 10, 11, 12, 20, 21, 22, 23], [0, 1, 15, 16, 17, 18, 19, 9, 8, 7]
B_SRC, B_DST = [5, 6, 7, 8, 9, 13, 14], [2, 3, 4, 10, 11, 12, 13]


def pages(engine: TransferEngine) -> torch.Tensor:
    """The cache as `[segment, block, page bytes]`, on the CPU."""
    return torch.stack([seg.view(torch.uint8).cpu() for seg in engine.layout.segments])


def slots(engine: TransferEngine) -> torch.Tensor:
    """The pool as `[slot, segment, block in chunk, page bytes]`."""
    layout, bpc = engine.layout, engine.blocks_per_chunk
    shape = (layout.num_segments, bpc, layout.page_bytes)
    return torch.stack([engine.pool.slot(s).view(shape) for s in range(engine.pool.num_slots)])


def placed(engine: TransferEngine, parts: list[JobPart]):
    """(slot, segment, block in chunk, GPU block) of every page the parts copy."""
    bpc, every = engine.blocks_per_chunk, range(engine.layout.num_segments)
    for part in parts:
        for j, block in enumerate(part.gpu_block_ids):
            chunk, index = divmod(part.skip_leading_blocks + j, bpc)
            for k in every if part.segments is None else part.segments:
                yield part.slots[chunk], k, index, block


def finished(engine, job_ids):
    engine.wait(job_ids)
    return [(r.job_id, r.success, r.num_bytes) for r in engine.get_finished()]


@pytest.mark.parametrize("b_layers", [[0, 1], [0, 2]], ids=["b_leading", "b_gap"])
@pytest.mark.parametrize(("path", "options"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_parts_round_trip_each_group_in_its_own_segments(
    make_cache, device, path, options, b_layers
):
    cache = make_cache("per_layer", device=device)
    engine = cache.engine(num_slots=10, blocks_per_chunk=3, copy_path=path, **options)
    layout = engine.layout
    seg_a = layout.segments_of(LAYERS)  # all segments: planned as None
    seg_b = layout.segments_of(LAYERS[i] for i in b_layers)
    assert (seg_a, len(seg_b)) == ([0, 1, 2, 3, 4, 5], 4)
    engine.pool.buffer.fill_(SENTINEL)
    store = [
        JobPart(A_SLOTS, A_SRC, 1, seg_a),
        JobPart([], [], 0, seg_b),  # vLLM sends empty groups too
        JobPart(B_SLOTS, B_SRC, 2, seg_b),
    ]
    gpu = pages(engine)
    pool = slots(engine).clone()
    for slot, k, index, block in placed(engine, store):
        pool[slot, k, index] = gpu[k, block]
    job_bytes = (10 * 6 + 7 * 4) * layout.page_bytes

    engine.submit_store_parts(1, store)
    assert finished(engine, [1]) == [(1, True, job_bytes)]
    assert torch.equal(slots(engine), pool)

    for t in cache.bases:
        t.zero_()
    load = [
        JobPart(B_SLOTS, B_DST, 2, seg_b),
        JobPart(A_SLOTS, A_DST, 1, None),
    ]
    engine.submit_load_parts(2, load)
    assert finished(engine, [2]) == [(2, True, job_bytes)]

    want = torch.zeros_like(gpu)
    for slot, k, index, block in placed(engine, load):
        want[k, block] = pool[slot, k, index]
    assert torch.equal(pages(engine), want)
    # The chain above ends where it started: each loaded page is the page stored.
    moved = dict(zip(A_SRC + B_SRC, A_DST + B_DST, strict=True))
    for src, dst in moved.items():
        segs = seg_a if src in A_SRC else seg_b
        assert torch.equal(want[segs, dst], gpu[segs, src]), (src, dst)
    engine.close()


@pytest.mark.parametrize(("path", "options"), PATHS, ids=PATH_IDS)
def test_parts_may_load_disjoint_segments_of_one_block(make_cache, path, options):
    cache = make_cache("per_layer")
    engine = cache.engine(num_slots=4, blocks_per_chunk=3, copy_path=path, **options)
    gpu = pages(engine)
    engine.submit_store(1, [0, 1, 2, 3, 4, 5], [1, 2])
    first, rest = engine.layout.segments_of(LAYERS[:1]), engine.layout.segments_of(LAYERS[1:])
    engine.submit_load_parts(
        2, [JobPart([1], [7, 8, 9], 0, first), JobPart([2], [7, 8, 9], 0, rest)]
    )
    assert finished(engine, [1, 2]) == [
        (1, True, 6 * engine.layout.block_bytes),
        (2, True, 3 * engine.layout.block_bytes),  # three blocks, each page once
    ]
    after = pages(engine)
    assert torch.equal(after[first, 7:10], gpu[first, 0:3])
    assert torch.equal(after[rest, 7:10], gpu[rest, 3:6])
    others = [b for b in range(cache.num_blocks) if b not in (7, 8, 9)]
    assert torch.equal(after[:, others], gpu[:, others])


# segments: 0..5 (K and V of 3 layers); 10 slots of 3 blocks
@pytest.mark.parametrize(
    ("store", "parts", "error", "match"),
    [
        (True, [], ValueError, r"parts is empty"),
        (
            True,
            [JobPart([1], [0, 1, 2]), JobPart([1], [3, 4, 5], 0, [0, 1])],
            ValueError,
            r"slot 1 is in parts\[0\]\.slots and parts\[1\]\.slots: a job may write each slot",
        ),
        (
            False,
            [JobPart([1], [0, 1, 2], 0, [0, 1]), JobPart([2], [5, 2, 6], 0, [1, 2])],
            ValueError,
            r"GPU block 2 is in parts\[0\]\.gpu_block_ids and parts\[1\]\.gpu_block_ids, both "
            r"writing its segment 1",
        ),
        (
            False,
            [JobPart([1], [0, 1, 2]), JobPart([2], [5, 2, 6], 0, [4])],
            ValueError,
            r"GPU block 2 .* segment 4",
        ),
        (
            True,
            [JobPart([1], [0, 1, 2]), JobPart([2], [3, 4, 5], 0, [0, 6])],
            ValueError,
            r"parts\[1\]\.segments\[1\]=6 is out of range: there are 6 segments \(allowed 0\.\.5\)",
        ),
        (
            False,
            [JobPart([1], [0, 1, 2], 0, [1, 0, 1])],
            ValueError,
            r"parts\[0\]\.segments repeats \[1\]; allowed: None \(all\) or distinct indices",
        ),
        (True, [JobPart([1], [0, 1, 2], 0, [])], ValueError, r"parts\[0\]\.segments is empty"),
        (True, [JobPart([1], [0, 1, 2], 0, [0.5])], TypeError, r"parts\[0\]\.segments must hold"),
        (True, [JobPart([1, 1], [0, 1, 2, 3])], ValueError, r"parts\[0\]\.slots repeats \[1\]"),
        (
            False,
            [JobPart([1], [0, 1, 2]), JobPart([2], [3, 4], 2)],
            ValueError,
            r"len\(parts\[1\]\.gpu_block_ids\)=2 does not match len\(parts\[1\]\.slots\)=1",
        ),
        (
            False,
            [JobPart([1], [0, 1, 2]), JobPart([10], [3, 4, 5])],
            ValueError,
            r"parts\[1\]\.slots\[0\]=10 is out of range",
        ),
        (True, [JobPart([1], [0, 1, 2], 3)], ValueError, r"parts\[0\]\.skip_leading_blocks=3"),
        (True, [JobPart([1], [0, 1, 2]), 5], TypeError, r"parts\[1\] is a int, not a JobPart"),
    ],
)
def test_invalid_parts_raise_and_copy_nothing(make_cache, store, parts, error, match):
    cache = make_cache("per_layer")
    engine = cache.engine(num_slots=10, blocks_per_chunk=3)
    engine.pool.buffer.fill_(SENTINEL)
    before = pages(engine)

    with pytest.raises(error, match=match):
        if store:
            engine.submit_store_parts(1, parts)
        else:
            engine.submit_load_parts(1, parts)

    assert engine.get_finished() == []
    assert engine.pool.buffer.eq(SENTINEL).all()
    assert torch.equal(pages(engine), before)


def test_a_job_id_in_use_is_refused_before_its_parts_are_copied(make_cache):
    cache = make_cache("per_layer")
    engine = cache.engine(num_slots=10, blocks_per_chunk=3)
    engine.submit_store(7, [0, 1, 2], [1])
    pool, gpu = engine.pool.buffer.clone(), pages(engine)
    with pytest.raises(ValueError, match="job_id=7 is already in use"):
        engine.submit_load_parts(7, [JobPart([1], [3, 4, 5], 0, [0, 1])])
    assert torch.equal(engine.pool.buffer, pool)
    assert torch.equal(pages(engine), gpu)
    assert [r.job_id for r in engine.get_finished()] == [7]


def test_layout_finds_segments_by_tensor_name_or_memory():
    a, b = torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)
    named = KVCacheLayout({"x": a, "y": b})
    assert named.segment_names == ["x", "x", "y", "y"]
    assert named.segments_of(["y"]) == [2, 3]
    assert named.segments_of(["y", "x", "y"]) == [0, 1, 2, 3]
    # Another name for y's memory (vLLM's layers sharing one tensor) finds it by its address.
    assert named.segments_of_tensors([b.view(2, 4, 2, 4)]) == [2, 3]
    listed = KVCacheLayout([a, b])
    assert (listed.segment_names, listed.segments_of(["1"])) == (["0", "0", "1", "1"], [2, 3])
    assert KVCacheLayout(torch.zeros(4, 8)).segments_of(["0"]) == [0]
    with pytest.raises(
        ValueError, match=r"'z' is not a tensor of this layout; its tensors are x, y"
    ):
        named.segments_of(["x", "z"])
    with pytest.raises(TypeError, match=r"an iterable of names, got the str 'x'"):
        named.segments_of("x")
    with pytest.raises(ValueError, match=r"a tensor starting at 0x[0-9a-f]+ is not one of this"):
        named.segments_of_tensors([a[1]])


def test_staging_copies_move_only_the_selected_segments_of_each_slot():
    # 3 segments, 2 blocks of 8 units per chunk: a slot is 48 units, a segment's part 16.
    g = Geometry(2, 64, 100, 8, (8, 8, 8), 100, 4800, 4, 0)
    runs = [(0, 144, 2), (2, 480, 1)]  # slots 3, 4 and 10
    assert staging_copies(g, Batch(0, 3, runs)) == [(0, 144, 96), (96, 480, 48)]
    assert staging_copies(g, Batch(0, 3, runs, (0, 1))) == [
        (0, 144, 32),
        (48, 192, 32),
        (96, 480, 32),
    ]
    assert staging_copies(g, Batch(0, 3, runs, (0, 2))) == [
        (0, 144, 16), (32, 176, 16),
        (48, 192, 16), (80, 224, 16),
        (96, 480, 16), (128, 512, 16),
    ]  # fmt: skip
    assert np.array_equal(g.select((0, 2)).selected, [0, 2])
