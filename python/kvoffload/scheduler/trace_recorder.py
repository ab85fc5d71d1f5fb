"""`record_trace`: the traffic an engine served, written as the hash-ids trace that
`kvoffload simulate --trace` replays, so operators size a fleet with their own requests.

One line per finished request (its output length is known only then; its arrival is the one vLLM
stamped when it came in): `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
[...]}`. A hash id stands for one block of the prompt and the whole prefix before it (vLLM's block
hashes are chained), mapped to small integers in the order first seen: no token ids, no text, no
hash an outsider could test a guess against. The prompt's partial last block gets an id of its
own, used once. The map costs the scheduler 110 bytes a distinct block, so a file also ends once
it names `MAX_IDS` of them.

The engine's thread only queues a line (a bounded queue: when the writer falls behind, a line is
dropped and counted, never waited for). A thread writes them, starts a new file when one would pass
`rotate_bytes` and keeps `keep` older ones (`trace.jsonl.1` is the newest). Each file stands alone:
its ids and its clock start afresh (its clock at the earliest arrival among the requests the
scheduler then holds), so any one of them replays. A file that cannot be written (no directory, a
full or read-only disk) costs lines, counted as dropped, never a step.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvoffload._docs import docs_url
from kvoffload.errors import ConfigError
from kvoffload.sizes import size_value

logger = logging.getLogger(__name__)

_MAX_KEEP = 1000
MAX_IDS = 1 << 21
"""Distinct blocks a file names before the next one starts (32M distinct tokens in 16-token
blocks); the map to small ints then holds about 230 MB (110 bytes an id)."""
HEADER = "# kvoffload record_trace, hash-ids format, blocks of {} tokens"
"""A recorded file's first line; `kvoffload simulate --trace` reads its block size from it."""


@dataclass(frozen=True)
class TraceRecording:
    """Where and how `record_trace` writes (the keys of `kv_connector_extra_config`)."""

    path: str
    rotate_bytes: int = 256 << 20
    """A file is closed and a new one started before it would pass this size."""
    keep: int = 4
    """Rotated files kept beside the current one (the oldest is deleted)."""
    buffer_lines: int = 4096
    """Lines queued for the writer; more are dropped and counted."""

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> TraceRecording | None:
        """Takes the `record_trace*` keys out of `extra`; None when `record_trace` is unset."""
        path = extra.pop("record_trace", None)
        companions = [k for k in ("record_trace_rotate_bytes", "record_trace_keep") if k in extra]
        rotate = size_value(
            "record_trace_rotate_bytes", extra.pop("record_trace_rotate_bytes", cls.rotate_bytes)
        )
        keep = extra.pop("record_trace_keep", cls.keep)
        if type(rotate) is not int or rotate < 4096:
            raise ConfigError(
                f"record_trace_rotate_bytes={rotate!r} is invalid: expected at least 4096 bytes "
                "(an int or a size such as '256MiB')"
            )
        if type(keep) is not int or not 0 <= keep <= _MAX_KEEP:
            raise ConfigError(
                f"record_trace_keep={keep!r} is invalid: expected an int in 0..{_MAX_KEEP}"
            )
        if path is None:
            if companions:
                raise ConfigError(
                    f"{companions[0]} is set but record_trace is not: set record_trace to the "
                    "file to write, or remove it"
                )
            return None
        if not isinstance(path, str) or not path.strip() or "\0" in path:
            raise ConfigError(
                f"record_trace={path!r} is invalid: expected the path of the file to write "
                f"(see {docs_url('replay')})"
            )
        full = os.path.abspath(os.path.expanduser(path))
        if os.path.isdir(full):
            # Rotation would rename the directory away.
            raise ConfigError(
                f"record_trace={path!r} is a directory: expected the path of a file in it, "
                f"such as {os.path.join(path, 'served.jsonl')!r}"
            )
        return cls(full, rotate, keep)

    def for_replica(self, index: int, replicas: int) -> TraceRecording:
        """The path of one data-parallel replica's scheduler (`served.dp1.jsonl`): each writes
        and rotates its own file, or they would rotate each other's."""
        if replicas <= 1:
            return self
        stem, ext = os.path.splitext(self.path)
        return dataclasses.replace(self, path=f"{stem}.dp{index}{ext}")


_STOP = None


class TraceRecorder:
    """Queues finished requests from the engine's thread; a daemon thread writes them."""

    def __init__(self, recording: TraceRecording, block_tokens: int) -> None:
        self.recording = recording
        self.block_tokens = block_tokens
        self._queue: queue.Queue[tuple[float, float, int, int, Sequence[bytes]] | None] = (
            queue.Queue(recording.buffer_lines)
        )
        self._dropped = 0
        self._dropped_reported = 0
        self._lock = threading.Lock()
        self._file: _TraceFile | None = None
        self._said_fault = False
        directory = Path(recording.path).parent
        if not (directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)):
            logger.warning(
                "kvoffload: record_trace=%s: the directory %s does not exist or is not "
                "writable; requests are counted as dropped until it is",
                recording.path,
                directory,
            )
        self._thread = threading.Thread(target=self._run, name="kvoffload-trace", daemon=True)
        self._thread.start()

    def record(
        self,
        arrival: float,
        oldest_arrival: float,
        num_prompt: int,
        num_output: int,
        block_hashes: Sequence[bytes],
    ) -> None:
        """One finished request: `arrival` (seconds, vLLM's clock), that of the oldest request
        the scheduler holds, its prompt and output lengths, and its prompt's full blocks' hashes
        (a sequence the caller no longer changes)."""
        try:
            self._queue.put_nowait((arrival, oldest_arrival, num_prompt, num_output, block_hashes))
        except queue.Full:
            self._lost(1)

    def take_dropped(self) -> int:
        """Lines dropped since the last call (buffer full or a file that could not be
        written)."""
        with self._lock:
            new = self._dropped - self._dropped_reported
            self._dropped_reported = self._dropped
        return new

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._dropped

    def close(self, timeout: float = 10.0) -> None:
        """Writes what is queued and closes the file, waiting at most `timeout` seconds in all
        (a stalled disk must not hold the engine's shutdown)."""
        deadline = time.monotonic() + timeout
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(_STOP, timeout=timeout)
            self._thread.join(max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        if self._thread.is_alive():
            logger.warning("kvoffload: record_trace: the writer did not finish in %gs", timeout)

    def _lost(self, n: int) -> None:
        with self._lock:
            self._dropped += n

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            try:
                self._write(*item)
            except Exception as e:
                # Any failure costs this line, never the thread (a dead writer would leave the
                # queue full and every later request uncounted), nor the file: reopening would
                # rotate it, and on a full disk each line would push a good file out.
                self._lost(1)
                if not self._said_fault:
                    self._said_fault = True
                    logger.warning(
                        "kvoffload: record_trace=%s cannot be written (%s): requests are counted "
                        "as dropped (vllm:kvoffload_trace_lines_dropped_total) until it can",
                        self.recording.path,
                        e.strerror if isinstance(e, OSError) and e.strerror else repr(e),
                        exc_info=not isinstance(e, OSError),
                    )
            else:
                self._said_fault = False
        self._close_file()

    def _write(
        self,
        arrival: float,
        oldest: float,
        num_prompt: int,
        num_output: int,
        hashes: Sequence[bytes],
    ) -> None:
        if self._file is None:
            self._file = _TraceFile.open(self.recording, self.block_tokens, oldest)
        line = self._file.line(arrival, num_prompt, num_output, hashes)
        full = self._file.size + len(line) > self.recording.rotate_bytes
        if (full or len(self._file.ids) > MAX_IDS) and self._file.lines:
            self._close_file()
            self._file = _TraceFile.open(self.recording, self.block_tokens, oldest)
            line = self._file.line(arrival, num_prompt, num_output, hashes)
        self._file.write(line)

    def _close_file(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close(self.dropped)
            except OSError:
                pass  # what it held was written line by line; the note on drops is lost


class _TraceFile:
    """One file of the trace: its own ids and clock."""

    def __init__(self, f: IO[bytes], block_tokens: int, start: float) -> None:
        self.f = f
        self.block_tokens = block_tokens
        self.start = start
        self.ids: dict[int, int] = {}
        self.next_id = 0
        self.lines = 0
        self.size = 0

    @classmethod
    def open(cls, recording: TraceRecording, block_tokens: int, start: float) -> _TraceFile:
        """A new file at `recording.path`; one left there (by an earlier engine, or full) is
        rotated, never appended to: its clock and ids are not this file's."""
        path = recording.path
        if os.path.isdir(path):  # made since start-up: rotating would move it away
            raise IsADirectoryError(errno.EISDIR, "a directory", path)
        if os.path.isfile(path) and os.path.getsize(path) > 0:
            _shift(path, recording.keep)
        # Appending: a file truncated under it (logrotate's copytruncate) gets the next line at
        # its start, not after a run of NUL bytes. Unbuffered: a line is one write, undone
        # whole if the disk takes only part of it.
        f = open(path, "ab", buffering=0)
        out = cls(f, block_tokens, start)
        out.write(
            f"{HEADER.format(block_tokens)}: kvoffload simulate --trace {os.path.basename(path)}\n",
            counts=False,
        )
        return out

    def line(
        self, arrival: float, num_prompt: int, num_output: int, hashes: Sequence[bytes]
    ) -> str:
        full = min(len(hashes), num_prompt // self.block_tokens)
        ids = [self._id(h) for h in hashes[:full]]
        # The simulator wants one id per block, the partial last one included (never shared:
        # vLLM caches whole blocks only).
        ids += [self._fresh() for _ in range(-(-num_prompt // self.block_tokens) - full)]
        ms = max(0.0, arrival - self.start) * 1000.0
        return (
            json.dumps(
                {
                    "timestamp": round(ms, 3),
                    "input_length": num_prompt,
                    # The format counts at least one output token (an aborted request has none).
                    "output_length": max(1, num_output),
                    "hash_ids": ids,
                },
                separators=(",", ":"),
            )
            + "\n"
        )

    def _id(self, block_hash: bytes) -> int:
        # 8 bytes of a SHA-256 chain name a block as well as 32 (as the simulator's bound does)
        # and take a third of the memory as a key.
        key = int.from_bytes(block_hash[:8], "little")
        found = self.ids.get(key)
        if found is None:
            found = self.ids[key] = self._fresh()
        return found

    def _fresh(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def write(self, text: str, *, counts: bool = True) -> None:
        data = text.encode()
        try:
            if self.f.write(data) != len(data):
                raise OSError(errno.ENOSPC, "the disk took part of a line")
        except OSError:
            # A torn line would stop the whole file's replay at it.
            try:
                os.ftruncate(self.f.fileno(), self.size)
            except OSError:
                pass
            raise
        self.size += len(data)
        self.lines += counts

    def close(self, dropped: int) -> None:
        try:
            if dropped:
                self.write(f"# {dropped} requests were not recorded since the engine started\n")
        finally:
            self.f.close()


def _shift(path: str, keep: int) -> None:
    """`path` becomes `path.1`, `path.1` becomes `path.2`, ...; beyond `keep` is deleted."""
    if keep == 0:
        os.remove(path)
        return
    oldest = f"{path}.{keep}"
    if os.path.exists(oldest):
        os.remove(oldest)
    for i in range(keep - 1, 0, -1):
        if os.path.exists(f"{path}.{i}"):
            os.replace(f"{path}.{i}", f"{path}.{i + 1}")
    os.replace(path, f"{path}.1")
