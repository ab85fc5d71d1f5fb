"""`CpuPool(background=True)`: the pool's pieces are prepared on a thread, in slot order, and
`usable_slots` grows piece by piece; CPU mode first-touches each piece (the GPU path pins it, in
`test_transfer_gpu.py` when a GPU is lent). Every piece waits on a gate the test opens."""

from __future__ import annotations

import functools
import logging
import threading

import numpy as np
import pytest
import torch

from kvoffload.transfer import CpuPool, TransferEngine
from pool_gate import Gate, until


def test_the_pool_grows_piece_by_piece_in_slot_order():
    gate = Gate()
    pool = CpuPool(10, 3000, piece_bytes=4 * 3000, background=True, before_piece=gate)
    assert (pool.num_pieces, pool.usable_slots, pool.first_piece_s) == (3, 0, None)
    gate.open(0)
    until(lambda: pool.usable_slots == 4, "the first piece never became usable")
    assert pool.first_piece_s is not None and pool.all_pieces_s is None and pool.growing
    gate.open(1)
    until(lambda: pool.usable_slots == 8, "the second piece")
    gate.open(2)
    pool.wait_ready(30)
    assert pool.usable_slots == 10  # the last piece holds the last 2 slots
    assert pool.all_pieces_s is not None and pool.all_pieces_s >= pool.first_piece_s
    assert not pool.growing
    # First touch wrote zeros over every page: the memory is there and reads back.
    assert int(pool.buffer.sum()) == 0
    pool.close()


def test_a_piece_that_fails_ends_the_growth_with_one_warning(caplog):
    gate = Gate(fail=frozenset({1}))
    gate.open(5)
    with caplog.at_level(logging.WARNING, logger="kvoffload.transfer.pool"):
        pool = CpuPool(12, 1000, piece_bytes=4 * 1000, background=True, before_piece=gate)
        pool.wait_ready(30)
    assert pool.usable_slots == 4 and pool.all_pieces_s is None
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "stops growing" in message and "piece 1 of 3" in message and "injected" in message
    pool.close()


def test_waiting_for_the_first_piece_returns_once_it_is_ready_not_the_whole_pool():
    gate = Gate()
    pool = CpuPool(8, 1000, piece_bytes=2 * 1000, background=True, before_piece=gate)
    assert pool.wait_first_piece(0.01) is False  # held back: the wait is bounded
    assert pool.first_piece_pending
    opener = threading.Timer(0.05, gate.open, args=(0,))
    opener.start()
    assert pool.wait_first_piece(30) is True
    assert pool.usable_slots == 2 and pool.growing  # pieces 1..3 still wait on the gate
    gate.open(3)
    pool.wait_ready(30)
    assert pool.wait_first_piece(0) is True
    pool.close()


def test_a_first_piece_that_fails_ends_the_wait_at_once():
    gate = Gate(fail=frozenset({0}))
    gate.open(3)
    pool = CpuPool(8, 1000, piece_bytes=2 * 1000, background=True, before_piece=gate)
    pool.wait_ready(30)
    assert not pool.first_piece_pending  # a wait for it returns at once, not after its timeout
    assert pool.wait_first_piece(30) is False
    assert pool.usable_slots == 0 and not pool.growing
    pool.close()


def test_a_pool_prepared_up_front_has_its_first_piece_at_once():
    pool = CpuPool(8, 1000, piece_bytes=2 * 1000)
    assert pool.wait_first_piece(0) is True and pool.usable_slots == 8
    pool.close()


def test_close_stops_a_growing_pool():
    gate = Gate()
    pool = CpuPool(8, 1000, piece_bytes=2 * 1000, background=True, before_piece=gate)
    closer = threading.Thread(target=pool.close)
    closer.start()
    gate.open(0)  # the piece in progress finishes; the rest are never started
    closer.join(30)
    assert not closer.is_alive() and pool.usable_slots <= 2


def test_the_engine_copies_only_to_slots_that_are_ready(monkeypatch):
    from kvoffload.transfer import engine as engine_module

    gate = Gate()
    monkeypatch.setattr(engine_module, "CpuPool", functools.partial(CpuPool, before_piece=gate))
    caches = {f"l{i}": torch.randn(2, 16, 4, 2, 8) for i in range(2)}
    # pin_piece_bytes below a chunk: one slot per piece.
    engine = TransferEngine(
        caches, num_slots=8, blocks_per_chunk=2, pin_piece_bytes=1, pin_in_background=True
    )
    with pytest.raises(ValueError, match=r"reach past the 0 slots ready so far \(of 8\)"):
        engine.submit_store(1, np.array([0, 1]), np.array([0]))
    gate.open(1)
    until(lambda: engine.pool.usable_slots == 2, "two pieces")
    with pytest.raises(ValueError, match="allowed: slots below 2"):
        engine.submit_store(2, np.array([4, 5]), np.array([2]))
    # A ready slot works as ever: blocks 4, 5 out to slot 1 and back into blocks 6, 7.
    engine.submit_store(3, np.array([4, 5]), np.array([1]))
    engine.submit_load(4, np.array([1]), np.array([6, 7]))
    assert [r.success for r in engine.get_finished()] == [True, True]
    for t in caches.values():
        assert torch.equal(t[:, 4:6], t[:, 6:8])
    gate.open(10)
    engine.pool.wait_ready(30)
    assert engine.pool.usable_slots == 8
    engine.close()


def test_the_pool_binds_to_a_numa_node_before_touching_it():
    pool = CpuPool(4, 4096, numa_node=0, background=True)
    pool.wait_ready(30)
    assert (pool.numa_node, pool.usable_slots) == (0, 4)
    pool.close()
    with pytest.raises(ValueError, match="numa_node=1000 is invalid: mbind refused it"):
        CpuPool(4, 4096, numa_node=1000)
    with pytest.raises(ValueError, match="numa_node=-1 is invalid"):
        CpuPool(4, 4096, numa_node=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_background_pool_is_pinned_piece_by_piece_on_cuda():
    gate = Gate()
    device = torch.device("cuda", 0)
    pool = CpuPool(
        8, 1 << 20, pin_device=device, piece_bytes=2 << 20, background=True, before_piece=gate
    )
    assert pool.usable_slots == 0
    gate.open(0)
    until(lambda: pool.usable_slots == 2, "the first piece")
    first = pool.buffer[: 2 << 20]
    assert first.is_pinned()
    gpu = torch.full((2 << 20,), 7, dtype=torch.uint8, device=device)
    first.copy_(gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert int(first[-1]) == 7
    gate.open(10)
    pool.wait_ready(60)
    assert pool.usable_slots == 8 and pool.all_pieces_s is not None
    pool.close()


def test_pool_progress_is_shared_by_name_and_counts_what_every_rank_has():
    from kvoffload.transfer.progress import PoolProgress

    workers = [PoolProgress("engine/x y", 2) for _ in range(2)]
    manager = PoolProgress("engine/x y", 2)
    assert manager.usable() == 0 and "/" not in manager.path.rsplit("kvoffload-", 1)[1]
    assert manager.missing_ranks() == [0, 1]
    workers[0].publish(0, 48)
    assert manager.usable() == 0 and manager.missing_ranks() == [1]  # rank 1 has nothing yet
    workers[1].publish(1, 0)
    assert manager.usable() == 0 and manager.missing_ranks() == []  # published, none ready
    workers[1].publish(1, 16)
    assert manager.usable() == 16
    workers[1].publish(1, 64)
    assert manager.usable() == 48
    other = PoolProgress("another-engine", 2)
    assert other.usable() == 0  # engines never see each other's files
    for p in (*workers, other):
        p.close(unlink=True)
    manager.close()
    manager.close()  # twice is harmless
    with pytest.raises(ValueError, match="world_size=0"):
        PoolProgress("x", 0)
