"""The engine's parts: cache layouts, the CPU pool, and how jobs become copies."""

import contextlib
import logging
import mmap

import numpy as np
import pytest
import torch

from kvoffload.errors import KVOffloadError
from kvoffload.transfer import MAX_PIECE_BYTES, CpuPool, KVCacheLayout, TransferEngine
from kvoffload.transfer import pool as pool_module
from kvoffload.transfer.plan import Geometry, Run, plan_copies


def test_layouts_count_segments_and_bytes():
    per_layer = KVCacheLayout([torch.zeros(2, 10, 16, 8, 128, dtype=torch.bfloat16)] * 32)
    assert (per_layer.num_blocks, per_layer.num_segments) == (10, 64)
    assert per_layer.page_bytes == 32 << 10
    assert per_layer.chunk_bytes(3) == 3 * (2 << 20)
    assert per_layer.unit == torch.int64

    cross = KVCacheLayout(torch.zeros(10, 32, 2, 16, 8, 128, dtype=torch.bfloat16))
    assert (cross.num_blocks, cross.num_segments, cross.block_bytes) == (10, 1, 2 << 20)

    odd = KVCacheLayout({"a": torch.zeros(7, 3, dtype=torch.uint8)}, block_dim=0)
    assert (odd.num_blocks, odd.page_bytes, odd.unit) == (7, 3, torch.uint8)


@pytest.mark.parametrize(
    ("caches", "kwargs", "error", "match"),
    [
        ([], {}, ValueError, "kv_caches is empty"),
        (5, {}, TypeError, "kv_caches is a int"),
        ([torch.zeros(2, 4, 8), "x"], {}, TypeError, r"kv_caches\[1\] is a str"),
        (
            {"l0": torch.zeros(2, 4, 8), "l1": torch.zeros(2, 5, 8)},
            {},
            ValueError,
            r"kv_caches\['l1'\] has shape \(2, 5, 8\).*all layers must match",
        ),
        (
            [torch.zeros(2, 4, 8), torch.zeros(2, 4, 8, dtype=torch.float16)],
            {},
            ValueError,
            r"dtype torch.float16,.*all layers must match",
        ),
        ([torch.zeros(2, 4, 8)], {"block_dim": 3}, ValueError, r"block_dim=3 .* allowed: 0\.\.2"),
        ([torch.zeros(2, 4, 8)[:, :, ::2]], {}, ValueError, "not dense in memory"),
        ([torch.zeros(2, 0, 8)], {}, ValueError, "0 blocks"),
        ([torch.zeros(2, 4, 8, device="meta")], {}, ValueError, "device meta"),
        (torch.zeros(4, 8).expand(4, 4, 8), {}, ValueError, "consecutive blocks overlap"),
        (torch.zeros(4, 1, 8).expand(4, 3, 8), {}, ValueError, "not dense"),
    ],
)
def test_layout_rejects_inconsistent_caches(caches, kwargs, error, match):
    with pytest.raises(error, match=match):
        KVCacheLayout(caches, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"blocks_per_chunk": 0}, r"blocks_per_chunk=0 .* >= 1"),
        ({"num_slots": 0}, r"num_slots=0 .* >= 1"),
        ({"copy_path": "fast"}, r"copy_path='fast' .* auto, direct, batched, per_block"),
        ({"staging_bytes": 0}, r"staging_bytes=0"),
        ({"min_direct_copy_bytes": -1}, r"min_direct_copy_bytes=-1"),
        ({"pin_piece_bytes": MAX_PIECE_BYTES + 1}, r"piece_bytes=.* 1\.\.68719476736"),
        ({"compute_stream": object()}, "CPU mode"),
    ],
)
def test_engine_rejects_bad_options(kwargs, match):
    options = {"num_slots": 4, "blocks_per_chunk": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        TransferEngine([torch.zeros(2, 4, 8)], **options)


def test_pool_is_exactly_sized_page_aligned_pieces():
    page = mmap.PAGESIZE
    pool = CpuPool(10, 3000, piece_bytes=4 * 3000)
    assert (pool.slots_per_piece, pool.num_pieces, pool.pinned) == (4, 3, False)
    assert pool.buffer.data_ptr() % page == 0
    assert pool.piece_stride % page == 0
    assert 10 * 3000 <= pool.buffer.numel() < 10 * 3000 + pool.num_pieces * page
    offsets = pool.slot_offsets(np.arange(10)).tolist()
    assert offsets[:5] == [0, 3000, 6000, 9000, pool.piece_stride]
    assert offsets[-1] + 3000 <= pool.buffer.numel()
    pool.slot(9).fill_(7)
    assert pool.buffer[offsets[9] : offsets[9] + 3000].eq(7).all()
    with pytest.raises(ValueError, match=r"slot=10 is invalid; allowed: 0\.\.9"):
        pool.slot(10)
    with pytest.raises(ValueError, match=r"slot_bytes=68719476737 exceeds"):
        CpuPool(1, MAX_PIECE_BYTES + 1)
    pool.close()


def geometry(strides=(8,), bpc=2, slots_per_piece=100, staging_chunks=4, min_direct_run=0):
    page = 8
    slot = len(strides) * bpc * page
    return Geometry(
        bpc,
        64,
        100,
        page,
        strides,
        slots_per_piece,
        slots_per_piece * slot,
        staging_chunks,
        min_direct_run,
    )


def test_runs_contiguous_on_both_sides_merge_into_one_copy():
    g = geometry()
    plan = plan_copies(g, np.array([3, 4, 5]), np.arange(10, 16), 0, "direct")
    assert plan.runs == [Run(0, 80, 3 * 16, 6 * 8)]
    per_block = plan_copies(g, np.array([3, 4, 5]), np.arange(10, 16), 0, "per_block")
    assert len(per_block.runs) == 6


def test_runs_split_where_either_side_jumps_or_a_pool_piece_ends():
    g = geometry(slots_per_piece=4)
    gpu = np.array([10, 11, 12, 13, 20, 21, 22, 23])
    plan = plan_copies(g, np.array([2, 3, 4, 5]), gpu, 0, "direct")
    slot4 = g.piece_stride
    assert plan.runs == [Run(0, 80, 32, 32), Run(0, 160, slot4, 32)]


def test_per_layer_runs_merge_within_each_segment_of_a_slot():
    g = geometry(strides=(8, 8, 8))
    plan = plan_copies(g, np.array([3, 4]), np.array([7, 8, 9, 10]), 0, "direct")
    # A slot is [segment][block]: each segment's two pages are contiguous, slots are not.
    assert plan.runs == [
        Run(0, 56, 144, 16), Run(0, 72, 192, 16),
        Run(1, 56, 160, 16), Run(1, 72, 208, 16),
        Run(2, 56, 176, 16), Run(2, 72, 224, 16),
    ]  # fmt: skip


def test_segments_with_gaps_between_blocks_copy_block_by_block():
    g = geometry(strides=(16,))
    plan = plan_copies(g, np.array([0]), np.array([4, 5]), 0, "direct")
    assert plan.runs == [Run(0, 64, 0, 8), Run(0, 80, 8, 8)]


def test_auto_batches_small_copies_and_copies_large_runs_directly():
    slots, gpu = np.array([5, 1, 2, 3, 9, 7]), np.array([1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10])
    assert not plan_copies(geometry(min_direct_run=8), slots, gpu, 0, "auto").batches
    plan = plan_copies(geometry(min_direct_run=9), slots, gpu, 0, "auto")
    assert plan.runs == []
    assert plan.chunk_gpu_ids.tolist() == gpu.reshape(6, 2).tolist()
    # Staging holds 4 chunks; slots 1, 2, 3 are one copy of 3 slots.
    assert [(b.first, b.count, b.slot_runs) for b in plan.batches] == [
        (0, 4, [(0, 80, 1), (1, 16, 3)]),
        (4, 2, [(0, 144, 1), (1, 112, 1)]),
    ]


def test_batched_copies_a_partial_first_chunk_directly():
    g = geometry(strides=(8,), bpc=3)
    plan = plan_copies(g, np.array([4, 6]), np.array([20, 30, 31, 32]), 2, "batched")
    assert plan.runs == [Run(0, 160, 4 * 24 + 16, 8)]
    assert plan.chunk_gpu_ids.tolist() == [[30, 31, 32]]
    assert [(b.first, b.count, b.slot_runs) for b in plan.batches] == [(0, 1, [(0, 6 * 24, 1)])]


class FakeCudart:
    """Stands in for `torch.cuda.cudart()`, recording what would be pinned."""

    class cudaError:  # the name torch's binding uses
        success = 0

    def __init__(self, fail_at=None):
        self.registered, self.unregistered, self.fail_at = [], [], fail_at

    def cudaHostRegister(self, ptr, size, flags):
        if len(self.registered) == self.fail_at:
            return 2
        self.registered.append((ptr, size, flags))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, err):
        return "out of memory"


@pytest.fixture
def fake_cudart(monkeypatch):
    def install(**kwargs):
        fake = FakeCudart(**kwargs)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        return fake

    return install


def test_pool_pins_each_piece_once_and_unpins_on_close(fake_cudart, caplog):
    fake = fake_cudart()
    with caplog.at_level(logging.INFO, "kvoffload.transfer.pool"):
        pool = CpuPool(10, 3000, pin_device=torch.device("cuda", 0), piece_bytes=4 * 3000)
    base, stride = pool.buffer.data_ptr(), pool.piece_stride
    assert pool.pinned
    assert fake.registered == [
        (base, 12000, 0),
        (base + stride, 12000, 0),
        (base + 2 * stride, 6000, 0),
    ]
    assert "pinning 0.00 GiB of CPU memory in 3 pieces" in caplog.text
    pool.close()
    pool.close()
    assert fake.unregistered == [base, base + stride, base + 2 * stride]


def test_pool_pin_failure_unpins_the_pieces_already_pinned(fake_cudart, monkeypatch):
    cleared = []
    monkeypatch.setattr(pool_module, "_clear_last_cuda_error", lambda: cleared.append(1))
    fake = fake_cudart(fail_at=1)
    with pytest.raises(KVOffloadError, match=r"\(piece 1 of 3\) failed: out of memory"):
        CpuPool(10, 3000, pin_device=torch.device("cuda", 0), piece_bytes=4 * 3000)
    assert fake.unregistered == [fake.registered[0][0]]
    # The failed call's error is cleared, so no later kernel launch reports it as its own.
    assert cleared == [1]


def test_a_failed_unpin_is_logged_and_cleared(fake_cudart, monkeypatch, caplog):
    cleared = []
    monkeypatch.setattr(pool_module, "_clear_last_cuda_error", lambda: cleared.append(1))
    fake = fake_cudart()
    fake.cudaHostUnregister = lambda ptr: 1
    pool = CpuPool(2, 3000, pin_device=torch.device("cuda", 0))
    with caplog.at_level(logging.WARNING, "kvoffload.transfer.pool"):
        pool.close()
    assert "cudaHostUnregister of the CPU pool at 0x" in caplog.text
    assert cleared == [1]


def test_the_pool_tensor_starts_where_its_memory_does():
    # torch asks whether a tensor is pinned about its storage's base address: that must be
    # the registered range's start, not a page before it.
    pool = CpuPool(3, 5000)
    assert pool.buffer.untyped_storage().data_ptr() == pool.buffer.data_ptr()
    assert pool.buffer.data_ptr() % mmap.PAGESIZE == 0
    pool.close()


@pytest.mark.parametrize("made_in_inference_mode", [True, False])
def test_the_engine_works_inside_and_outside_inference_mode(make_cache, made_in_inference_mode):
    # vLLM's workers build their caches (and so the engine) under torch.inference_mode().
    outside, inside = contextlib.nullcontext(), torch.inference_mode()
    make_ctx, use_ctx = (inside, outside) if made_in_inference_mode else (outside, inside)
    with make_ctx:
        cache = make_cache("per_layer")
        engine = cache.engine(num_slots=4, blocks_per_chunk=2, copy_path="batched")
    stored = cache.blocks([0, 1, 2, 3])
    with use_ctx:
        engine.submit_store(1, [0, 1, 2, 3], [2, 0])
        engine.submit_load(2, [2, 0], [5, 6, 7, 8])
    assert [r.success for r in engine.get_finished()] == [True, True]
    for s, d in zip([0, 1, 2, 3], [5, 6, 7, 8], strict=True):
        assert torch.equal(cache.block(d), stored[s])
    engine.close()


@pytest.mark.parametrize("path", ["direct", "batched"])
def test_cpu_mode_makes_no_cuda_call(make_cache, monkeypatch, path):
    def no_cuda(*args, **kwargs):
        raise AssertionError("CUDA call in CPU mode")

    for name in ("Stream", "Event", "current_stream", "stream", "cudart", "device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    cache = make_cache("per_layer")
    stored = cache.blocks([0, 1, 2, 3])
    with cache.engine(num_slots=4, blocks_per_chunk=2, copy_path=path) as engine:
        engine.submit_store(1, [0, 1, 2, 3], [2, 0])
        engine.submit_load(2, [2, 0], [5, 6, 7, 8])
        engine.wait([1, 2])
        assert [r.success for r in engine.get_finished()] == [True, True]
    for s, d in zip([0, 1, 2, 3], [5, 6, 7, 8], strict=True):
        assert torch.equal(cache.block(d), stored[s])


def test_auto_copies_runs_directly_in_cpu_mode(make_cache, monkeypatch):
    # Gathering through a staging buffer only costs on the CPU (measured 0.6x the per-block loop
    # for 32 KiB pieces); on CUDA `auto` keeps choosing per job.
    from kvoffload.transfer import engine as engine_module

    paths = []
    plan = engine_module.plan_copies

    def spy(g, slots, gpu_ids, skip, path):
        paths.append(path)
        return plan(g, slots, gpu_ids, skip, path)

    monkeypatch.setattr(engine_module, "plan_copies", spy)
    cache = make_cache("per_layer")
    with cache.engine(num_slots=4, blocks_per_chunk=2) as engine:
        assert engine.copy_path == "auto"
        engine.submit_store(1, [0, 1, 2, 3], [2, 0])
    assert paths == ["direct"]
