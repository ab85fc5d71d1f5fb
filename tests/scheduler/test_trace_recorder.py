"""`record_trace`'s writer on the real filesystem: the lines, the ids, rotation, a stalled or
missing file, and the settings' errors."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import pytest

from kvoffload import ConfigError
from kvoffload.scheduler import trace_recorder
from kvoffload.scheduler.trace_recorder import TraceRecorder, TraceRecording
from kvoffload.simulate.trace import TraceOptions, load_trace, recorded_block_tokens

BT = 16  # tokens per block


def h(*blocks: int) -> list[bytes]:
    """Chained block hashes, as vLLM's are: block i's stands for blocks 0..i."""
    return [hashlib.sha256(repr(blocks[: i + 1]).encode()).digest() for i in range(len(blocks))]


def lines(path) -> list[dict]:
    return [json.loads(x) for x in open(path) if not x.startswith("#")]


def comments(path) -> list[str]:
    return [x for x in open(path) if x.startswith("#")]


def test_a_line_per_request_with_shared_prefixes_sharing_ids(tmp_path):
    path = tmp_path / "trace.jsonl"
    rec = TraceRecorder(TraceRecording(str(path)), BT)
    rec.record(100.0, 100.0, 40, 7, h(1, 2))  # 2 full blocks and 8 tokens
    rec.record(100.25, 100.0, 48, 0, h(1, 2, 3))  # aborted before its first token
    rec.record(101.5, 100.0, 32, 3, h(9, 2))  # another first block: nothing shared
    rec.close()
    assert lines(path) == [
        {"timestamp": 0.0, "input_length": 40, "output_length": 7, "hash_ids": [0, 1, 2]},
        {"timestamp": 250.0, "input_length": 48, "output_length": 1, "hash_ids": [0, 1, 3]},
        {"timestamp": 1500.0, "input_length": 32, "output_length": 3, "hash_ids": [4, 5]},
    ]
    (header,) = comments(path)
    assert header.endswith("kvoffload simulate --trace trace.jsonl\n")
    assert recorded_block_tokens(path) == BT  # the simulator's default for this file
    assert rec.dropped == 0
    # What the simulator replays: the same blocks shared, 250 ms apart.
    trace = load_trace(path, TraceOptions(hash_block_tokens=BT))
    replayed = list(trace)
    assert [r.arrival for r in replayed] == [0.0, 0.25, 1.5]
    first, second, third = (r.block_hashes(BT) for r in replayed)
    assert first[:2] == second[:2] and third[0] != first[0]


def test_a_file_rotates_by_size_and_each_file_stands_alone(tmp_path):
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(TraceRecording(str(path), rotate_bytes=4096, keep=2), BT)
    # About 80 bytes a line: 50 lines a file; 170 lines make 4 files, of which 3 are kept.
    for i in range(170):
        rec.record(10.0 + i, 10.0 + i, 64, 5, h(1, 2, 3, 4))
    rec.close()
    assert sorted(os.listdir(tmp_path)) == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    counts = []
    for name in ("t.jsonl.2", "t.jsonl.1", "t.jsonl"):
        file = tmp_path / name
        assert file.stat().st_size <= 4096
        got = lines(file)
        counts.append(len(got))
        # Ids and clock start afresh in every file.
        assert got[0]["hash_ids"] == [0, 1, 2, 3] and got[0]["timestamp"] == 0.0
        assert len(load_trace(file, TraceOptions(hash_block_tokens=BT))) == len(got)
    assert counts == [50, 50, 20]
    assert lines(tmp_path / "t.jsonl")[-1]["timestamp"] == (counts[2] - 1) * 1000.0


def test_a_file_left_by_an_earlier_engine_is_rotated_not_appended_to(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"old": 1}\n')
    rec = TraceRecorder(TraceRecording(str(path)), BT)
    rec.record(5.0, 5.0, 16, 1, h(1))
    rec.close()
    assert (tmp_path / "t.jsonl.1").read_text() == '{"old": 1}\n'
    assert lines(path) == [
        {"timestamp": 0.0, "input_length": 16, "output_length": 1, "hash_ids": [0]}
    ]


def test_a_stalled_writer_drops_lines_and_counts_them(tmp_path):
    # A FIFO nobody reads: opening it for writing blocks, as a stalled disk would.
    path = tmp_path / "t.jsonl"
    os.mkfifo(path)
    rec = TraceRecorder(TraceRecording(str(path), buffer_lines=4), BT)
    rec.record(1.0, 1.0, 16, 1, h(1))
    deadline = time.monotonic() + 10
    while not rec._queue.empty():  # the writer took it and is stuck in open()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for i in range(9):
        rec.record(2.0 + i, 1.0, 16, 1, h(1))  # 4 fit in the buffer, 5 do not
    assert (rec.dropped, rec.take_dropped(), rec.take_dropped()) == (5, 5, 0)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(open(path)))
    reader.start()
    rec.close()
    reader.join(10)
    records = [json.loads(x) for x in got if not x.startswith("#")]
    assert [r["timestamp"] for r in records] == [0.0, 1000.0, 2000.0, 3000.0, 4000.0]
    assert got[-1] == "# 5 requests were not recorded since the engine started\n"


def test_a_missing_directory_costs_lines_not_steps_and_recording_resumes(tmp_path, caplog):
    where = tmp_path / "later"
    rec = TraceRecorder(TraceRecording(str(where / "t.jsonl")), BT)
    assert "does not exist or is not writable" in caplog.text
    rec.record(1.0, 1.0, 16, 1, h(1))
    rec.record(2.0, 1.0, 16, 1, h(1))
    deadline = time.monotonic() + 10
    while rec.dropped < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "cannot be written" in caplog.text
    where.mkdir()
    rec.record(3.0, 3.0, 16, 1, h(1))
    rec.close()
    assert lines(where / "t.jsonl") == [
        {"timestamp": 0.0, "input_length": 16, "output_length": 1, "hash_ids": [0]}
    ]
    assert rec.dropped == 2


def test_a_file_also_rotates_once_it_names_max_ids_blocks(tmp_path, monkeypatch):
    # The id map is the recorder's memory: bounded per file, whatever the file's size.
    monkeypatch.setattr(trace_recorder, "MAX_IDS", 10)
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(TraceRecording(str(path)), BT)
    for i in range(5):
        rec.record(float(i), 0.0, 64, 1, h(i, 1, 2, 3))  # 4 new blocks each
    rec.close()
    # 8 ids fit; the third request would make 12, so it starts the next file, and so on.
    assert [len(lines(tmp_path / n)) for n in ("t.jsonl.2", "t.jsonl.1", "t.jsonl")] == [2, 2, 1]
    assert lines(path)[0]["hash_ids"] == [0, 1, 2, 3]


def test_the_writer_survives_a_line_it_cannot_make(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(TraceRecording(str(path)), BT)
    rec.record("soon", 0.0, 16, 1, h(1))  # type: ignore[arg-type]  # not a time
    rec.record(2.0, 1.0, 16, 1, h(1))
    rec.close()
    assert rec.dropped == 1 and "cannot be written" in caplog.text
    # The file opened for the first line keeps its clock (started at 0.0).
    assert lines(path) == [
        {"timestamp": 2000.0, "input_length": 16, "output_length": 1, "hash_ids": [0]}
    ]


def test_a_truncated_file_gets_the_next_line_at_its_start(tmp_path):
    # logrotate's copytruncate: without appending, the next line would follow a run of NULs.
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(TraceRecording(str(path)), BT)
    rec.record(1.0, 1.0, 16, 1, h(1))
    deadline = time.monotonic() + 10
    while not (path.exists() and lines(path)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.truncate(path, 0)
    rec.record(2.0, 1.0, 16, 1, h(1))
    rec.close()
    assert path.read_text().startswith('{"timestamp":1000.0,')


def test_each_data_parallel_replica_writes_its_own_file():
    recording = TraceRecording("/logs/served.jsonl")
    assert recording.for_replica(0, 1) is recording
    assert recording.for_replica(1, 2).path == "/logs/served.dp1.jsonl"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"record_trace": 7}, "record_trace=7 is invalid: expected the path"),
        ({"record_trace": " "}, "record_trace=' ' is invalid"),
        ({"record_trace": "t", "record_trace_rotate_bytes": "1KiB"}, "at least 4096 bytes"),
        ({"record_trace": "t", "record_trace_rotate_bytes": "lots"}, "'lots' is invalid"),
        ({"record_trace": "t", "record_trace_keep": -1}, "record_trace_keep=-1 is invalid"),
        ({"record_trace": "t", "record_trace_keep": True}, "record_trace_keep=True is invalid"),
        ({"record_trace_keep": 2}, "record_trace_keep is set but record_trace is not"),
        ({"record_trace": "/tmp"}, "record_trace='/tmp' is a directory: expected the path of a"),
    ],
)
def test_bad_settings_name_the_key_and_what_is_allowed(extra, message):
    with pytest.raises(ConfigError, match="record_trace") as e:
        TraceRecording.from_extra(dict(extra))
    assert message in str(e.value)


def test_settings_take_sizes_and_default_to_off(tmp_path):
    extra = {"record_trace": "~/t.jsonl", "record_trace_rotate_bytes": "64MiB", "other": 1}
    got = TraceRecording.from_extra(extra)
    assert got == TraceRecording(os.path.expanduser("~/t.jsonl"), 64 << 20, 4)
    assert extra == {"other": 1}  # its keys are taken out
    assert TraceRecording.from_extra({}) is None


def test_a_full_disk_leaves_whole_lines_and_counts_the_rest(tmp_path):
    from mounts import tmpfs

    with tmpfs(tmp_path / "small", "16k") as where:
        path = where / "t.jsonl"
        rec = TraceRecorder(TraceRecording(str(path)), BT)
        n = 200
        for i in range(n):
            rec.record(float(i), 0.0, 64 * BT, 1, h(i, *range(63)))  # about 330 bytes a line
        rec.close()
        written = lines(path)  # every line parses: none was torn by the full disk
        assert 10 < len(written) < n
        assert len(written) + rec.dropped == n
        assert len(load_trace(path, TraceOptions(hash_block_tokens=BT))) == len(written)
        assert sorted(os.listdir(where)) == ["t.jsonl"]  # a failed line rotates nothing
