"""`--trace FILE`: recorded traffic, one request per line, in either of two formats.

`kvoffload` (ours):

    {"id": "r1", "arrival": 0.5, "prompt": [{"segment": "system-a", "tokens": 2048},
     {"segment": "question-1", "tokens": 40}], "output_tokens": 200,
     "kv_transfer_params": {"max_load_tokens": 1024}}

`prompt` is either token ids or segments: a segment's tokens depend only on its name, so prompts
that start with the same segments share that prefix (and a shorter use of a segment is a prefix
of a longer one). `arrival` (seconds, default 0) and `kv_transfer_params` are optional.

`hash-ids` (Mooncake's FAST'25 traces and the tools that copy them):

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`timestamp` is in ms; the prompt is one block of `--hash-block-tokens` per id, the last one
partial. A block's tokens are those of the segment named by its id, so the same requests written
in either format replay alike.

Lines are replayed in arrival order; blank lines and lines starting with `#` are skipped. The
file is checked whole before anything runs, then streamed: a replay holds the tokens of the
requests that are live, not of the whole trace.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.scheduler.params import MAX_LOAD_TOKENS, MAX_OFFLOAD_TOKENS
from kvoffload.scheduler.trace_recorder import HEADER
from kvoffload.simulate.workloads import (
    Request,
    SimRequest,
    Tokens,
    _Fresh,
    block_hashes,
    segment_tokens,
)

FORMATS = ("kvoffload", "hash-ids")
_FIELDS = {"id", "arrival", "prompt", "output_tokens", "kv_transfer_params"}
_HASH_FIELDS = {"timestamp", "input_length", "output_length", "hash_ids"}
_PARAMS = (MAX_LOAD_TOKENS, MAX_OFFLOAD_TOKENS)
_MAX_TOKEN_ID = 2**31 - 1
_MAX_BLOCK_ID = 2**63 - 1
_MAX_CAP = 2**63 - 1
_MAX_ARRIVAL = 1e9
MAX_REQUEST_TOKENS = 1 << 24
"""Prompt and output tokens of one request."""
_MAX_FILE_BYTES = 1 << 30
MAX_TRACE_REQUESTS = 1 << 21
"""The check keeps a few numbers per request: 2M lines is 80x the largest published hash-ids
trace."""

Bad = Callable[[str, str], Exception]
_RECORDED = re.compile(re.escape(HEADER).replace(re.escape("{}"), r"(\d{1,7})"))
_OFFSETS = np.dtype([("arrival", "f8"), ("line", "i8"), ("offset", "i8")])


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, line and field."""


@dataclass(frozen=True)
class TraceOptions:
    format: str | None = None
    """One of `FORMATS`; None: the first request line decides."""
    hash_block_tokens: int = 512
    time_scale: float = 1.0
    """Arrivals are multiplied by it (0.5 replays the trace twice as fast)."""
    start: float = 0.0
    """Seconds of the trace's own clock to skip; arrivals count from there."""
    limit: int | None = None
    """Replay at most this many requests (the first by arrival)."""
    seed: int = 0
    """Seeds the output tokens."""
    max_tokens: int = 1 << 32
    """Prompt and output tokens of the requests replayed, all together (streamed: 30x the
    Mooncake conversation trace)."""


@dataclass(frozen=True, eq=False)
class HashIdsRequest:
    """A hash-ids line: its tokens are made when the engine asks for its block hashes."""

    request_id: str
    block_ids: tuple[int, ...]
    num_prompt: int
    num_output: int
    block_tokens: int
    output_seed: tuple[int, int]
    arrival: float = 0.0
    kv_transfer_params: Mapping[str, Any] | None = None
    after: None = None

    @property
    def prompt(self) -> Tokens:
        last = self.num_prompt - self.block_tokens * (len(self.block_ids) - 1)
        sizes = [self.block_tokens] * (len(self.block_ids) - 1) + [last]
        return np.concatenate(
            [_block(b, self.block_tokens)[:n] for b, n in zip(self.block_ids, sizes, strict=True)]
        )

    @property
    def output(self) -> Tokens:
        return _Fresh(self.output_seed)(self.num_output)

    def block_hashes(self, tokens_per_block: int) -> list[bytes]:
        return block_hashes(np.concatenate([self.prompt, self.output]), tokens_per_block)


@functools.lru_cache(maxsize=8192)
def _block(block_id: int, n: int) -> Tokens:
    # A conversation's history recurs in each of its turns: make its blocks once (8,192 blocks
    # of 512 tokens are 16 MiB).
    return segment_tokens(str(block_id), n)


@dataclass(frozen=True)
class Trace:
    """A checked trace: its size, and its requests streamed from the file in arrival order
    (each iteration reads the file again)."""

    path: str
    format: str
    options: TraceOptions
    offsets: np.ndarray
    """(arrival, line number, byte offset) of each request replayed, in arrival order: a
    structured array (`_OFFSETS`), 24 bytes a request."""
    largest: tuple[int, str]
    """The most tokens (prompt and output) of one request, and which request that is."""
    params: Mapping[str, int] | None = None
    """kv_transfer_params for every request (a line's own values win)."""

    def __len__(self) -> int:
        return len(self.offsets)

    def with_params(self, params: Mapping[str, int]) -> Trace:
        return dataclasses.replace(self, params=params) if params else self

    def __iter__(self) -> Iterator[Request]:
        """Raises `TraceError` if the file went or changed after `load_trace` checked it."""
        changed = f"--trace {self.path}: changed after it was checked"
        try:
            f = open(self.path, "rb")
        except OSError as e:
            raise TraceError(f"{changed}: cannot read it: {e.strerror or e}") from None
        with f:
            for row in self.offsets:
                arrival, lineno, offset = float(row[0]), int(row[1]), int(row[2])
                f.seek(offset)
                try:
                    request, _ = _parse(self, f.readline(), lineno, arrival)
                except TraceError as e:
                    raise TraceError(f"{changed} ({e})") from None
                if request is None:
                    raise TraceError(f"{changed}: line {lineno} holds no request now")
                yield request


def recorded_block_tokens(path: str | Path) -> int | None:
    """The block size a file written by `record_trace` names on its first line (its hash ids are
    vLLM's blocks, not Mooncake's 512 tokens); None for any other file, or one not readable
    (`load_trace` says why)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(200).decode("utf-8", "replace")
    except OSError:
        return None
    found = _RECORDED.match(first)
    return int(found[1]) if found and 0 < int(found[1]) <= 1 << 20 else None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"field {key!r} appears twice")
        out[key] = value
    return out


def load_trace(path: str | Path, options: TraceOptions | None = None) -> Trace:
    """Reads and checks every line before anything runs; keeps only where each request is."""
    opts = options or TraceOptions()
    p = Path(path)
    try:
        if not p.is_file():
            raise TraceError(f"--trace {path}: not a regular file")
        if p.stat().st_size > _MAX_FILE_BYTES:
            raise TraceError(f"--trace {path}: larger than {_MAX_FILE_BYTES >> 20} MiB")
        f = open(p, "rb")
    except OSError as e:
        raise TraceError(f"--trace {path}: cannot read it: {e.strerror or e}") from None
    trace = Trace(str(path), opts.format or "", opts, np.empty(0, _OFFSETS), (0, ""))
    # Per request: arrival, line, byte offset and all tokens, kept compact (a million
    # lines take 40 MB, not the 400 of tuples); the largest request's id is read back at the end.
    arrivals = array.array("d")
    lines, offsets, totals = (array.array("q") for _ in range(3))
    seen: dict[str, int] = {}
    with f:
        offset = 0
        for lineno, line in enumerate(f, 1):
            if lineno > 1 and line[:1] == b"#" and _RECORDED.match(line.decode("utf-8", "replace")):
                # Their ids and clocks both start at 0: joined, they would share blocks that
                # nothing shared.
                raise TraceError(
                    f"--trace {path} line {lineno}: another record_trace file starts here; each "
                    "file of record_trace stands alone: replay them one at a time"
                )
            request, kind = _parse(trace, line, lineno, None, seen)
            if kind and not trace.format:
                trace = dataclasses.replace(trace, format=kind)
            if request is not None:
                if len(lines) == MAX_TRACE_REQUESTS:
                    raise TraceError(
                        f"--trace {path} line {lineno}: more than {MAX_TRACE_REQUESTS:,} requests"
                    )
                arrivals.append(request.arrival)
                lines.append(lineno)
                offsets.append(offset)
                totals.append(request.num_prompt + request.num_output)
            offset += len(line)
        if not lines:
            raise TraceError(f"--trace {path}: no requests in it")
        at = np.frombuffer(arrivals, dtype=np.float64)
        order = np.argsort(at, kind="stable")  # ties keep file order
        order = order[at[order] >= opts.start][: opts.limit]
        if not len(order):
            raise TraceError(
                f"--trace {path}: no request arrives at or after --start {opts.start:g}"
            )
        total = int(np.frombuffer(totals, dtype=np.int64)[order].sum())
        if total > opts.max_tokens:
            raise TraceError(
                f"--trace {path}: the requests replayed hold {total:,} tokens; at most "
                f"{opts.max_tokens:,}: replay a part with --limit or --start"
            )
        big = int(order[np.argmax(np.frombuffer(totals, dtype=np.int64)[order])])
        f.seek(offsets[big])
        big_request, _ = _parse(trace, f.readline(), lines[big], None)
        assert big_request is not None  # parsed a moment ago
    chosen = np.empty(len(order), _OFFSETS)
    chosen["arrival"] = (at[order] - opts.start) * opts.time_scale
    chosen["line"] = np.frombuffer(lines, dtype=np.int64)[order]
    chosen["offset"] = np.frombuffer(offsets, dtype=np.int64)[order]
    return dataclasses.replace(
        trace,
        offsets=chosen,
        largest=(totals[big], big_request.request_id),
    )


def _parse(
    trace: Trace,
    line_bytes: bytes,
    lineno: int,
    arrival: float | None,
    seen: dict[str, int] | None = None,
) -> tuple[Request | None, str]:
    """The line's request (None for a blank or comment line) and its format. `arrival` replaces
    the line's own when the trace replays it; `seen` collects ids while the file is checked."""

    def bad(field: str, problem: str) -> TraceError:
        return TraceError(f"--trace {trace.path} line {lineno}: {field}: {problem}")

    try:
        line = line_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad("json", f"not UTF-8 (byte {e.start + 1})") from None
    if not line.strip() or line.lstrip().startswith("#"):
        return None, ""
    try:
        obj = json.loads(line, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise bad("json", f"not valid JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # huge numbers, deep nesting, duplicates
        raise bad("json", f"not accepted: {str(e)[:80]}") from None
    if not isinstance(obj, dict):
        raise bad("json", f"expected an object, got {type(obj).__name__}")
    # Any hash-ids field decides, so a hash-ids line missing one is told which.
    kind = trace.format or ("hash-ids" if _HASH_FIELDS & obj.keys() else "kvoffload")
    out_seed = (trace.options.seed, lineno)
    if kind == "hash-ids":
        request: Request = _hash_ids_request(obj, bad, lineno, trace.options, out_seed)
    else:
        request = _request(obj, bad, out_seed)
    if seen is not None and kind == "kvoffload":  # hash-ids ids are line numbers: unique
        if request.request_id in seen:
            raise bad(
                "id", f"{request.request_id!r} is already used on line {seen[request.request_id]}"
            )
        seen[request.request_id] = lineno
    params = {**(trace.params or {}), **(request.kv_transfer_params or {})} or None
    if arrival is not None or params is not None:
        new = {"arrival": request.arrival if arrival is None else arrival}
        request = _replace(request, **new, kv_transfer_params=params)
    return request, kind


def _replace(request: Request, **changes: Any) -> Request:
    assert isinstance(request, (SimRequest, HashIdsRequest))
    return dataclasses.replace(request, **changes)


def _arrival(value: object, field: str, scale: float, bad: Bad) -> float:
    # int and float compare exactly at any size; NaN fails both bounds.
    if type(value) not in (int, float) or not 0 <= value <= _MAX_ARRIVAL * scale:  # type: ignore[operator]
        unit = "ms" if scale == 1000 else "seconds"
        raise bad(field, f"expected {unit} in 0..{_MAX_ARRIVAL * scale:g}, got {_short(value)}")
    return float(value) / scale  # type: ignore[arg-type]


def _count(obj: Mapping[str, Any], field: str, hi: int, bad: Bad) -> int:
    n = obj.get(field)
    if type(n) is not int or not 1 <= n <= hi:
        raise bad(field, f"expected an int in 1..{hi}, got {_short(n)}")
    return n


def _hash_ids_request(
    obj: dict[str, Any], bad: Bad, lineno: int, opts: TraceOptions, out_seed: tuple[int, int]
) -> HashIdsRequest:
    unknown = sorted(set(obj) - _HASH_FIELDS)
    if unknown:
        allowed = ", ".join(sorted(_HASH_FIELDS))
        raise bad(unknown[0], f"unknown field of the hash-ids format; allowed: {allowed}")
    if "timestamp" not in obj:
        raise bad("timestamp", "missing (ms since the trace's start)")
    arrival = _arrival(obj["timestamp"], "timestamp", 1000, bad)
    n_out = _count(obj, "output_length", MAX_REQUEST_TOKENS - 1, bad)  # leaves 1 for input
    n_in = _count(obj, "input_length", MAX_REQUEST_TOKENS - n_out, bad)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise bad("hash_ids", f"expected a non-empty list of block ids, got {_short(ids)}")
    if not all(type(b) is int and 0 <= b <= _MAX_BLOCK_ID for b in ids):
        raise bad("hash_ids", f"block ids must be ints in 0..{_MAX_BLOCK_ID}")
    bt = opts.hash_block_tokens
    if not (len(ids) - 1) * bt < n_in <= len(ids) * bt:
        raise bad(
            "hash_ids",
            f"{len(ids)} blocks of --hash-block-tokens {bt} cannot hold input_length {n_in} "
            f"(it needs {-(-n_in // bt)})",
        )
    return HashIdsRequest(f"line-{lineno}", tuple(ids), n_in, n_out, bt, out_seed, arrival)


def _request(obj: dict[str, Any], bad: Bad, out_seed: tuple[int, int]) -> SimRequest:
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise bad(unknown[0], f"unknown field; allowed: {', '.join(sorted(_FIELDS))}")
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        raise bad("id", f"expected a non-empty string, got {_short(rid)}")
    arrival = _arrival(obj.get("arrival", 0), "arrival", 1, bad)
    n_out = obj.get("output_tokens")
    if type(n_out) is not int or not 1 <= n_out <= MAX_REQUEST_TOKENS:
        raise bad(
            "output_tokens", f"expected an int in 1..{MAX_REQUEST_TOKENS}, got {_short(n_out)}"
        )
    prompt = _prompt(obj.get("prompt"), bad, MAX_REQUEST_TOKENS - n_out)
    params = obj.get("kv_transfer_params")
    if params is not None:
        if not isinstance(params, dict):
            raise bad("kv_transfer_params", f"expected an object, got {_short(params)}")
        for key in params:
            if key not in _PARAMS:
                raise bad(f"kv_transfer_params.{key}", f"unknown; allowed: {', '.join(_PARAMS)}")
            v = params[key]
            if type(v) is not int or not 0 <= v <= _MAX_CAP:
                raise bad(f"kv_transfer_params.{key}", f"expected an int >= 0, got {_short(v)}")
    return SimRequest(rid, prompt, _Fresh(out_seed)(n_out), arrival, None, params)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _prompt(raw: object, bad: Bad, max_tokens: int) -> Tokens:
    if not isinstance(raw, list) or not raw:
        raise bad("prompt", "expected a non-empty list of token ids or of segments")
    if all(type(t) is int for t in raw):
        if not all(0 <= t <= _MAX_TOKEN_ID for t in raw):
            raise bad("prompt", f"token ids must be ints in 0..{_MAX_TOKEN_ID}")
        if len(raw) > max_tokens:
            raise bad("prompt", f"more than {MAX_REQUEST_TOKENS:,} tokens with the output")
        return np.asarray(raw, dtype=np.int32)
    sizes = []
    for i, seg in enumerate(raw):
        where = f"prompt[{i}]"
        if not isinstance(seg, dict) or set(seg) != {"segment", "tokens"}:
            raise bad(where, f'expected {{"segment": name, "tokens": n}}, got {_short(seg)}')
        name, n = seg["segment"], seg["tokens"]
        if not isinstance(name, str) or not name:
            raise bad(f"{where}.segment", f"expected a non-empty string, got {_short(name)}")
        if type(n) is not int or n < 1:
            raise bad(f"{where}.tokens", f"expected an int >= 1, got {_short(n)}")
        sizes.append((name, n))
    if sum(n for _, n in sizes) > max_tokens:
        raise bad("prompt", f"more than {MAX_REQUEST_TOKENS:,} tokens with the output")
    return np.concatenate([segment_tokens(name, n) for name, n in sizes])
