"""`--trace FILE.jsonl`: the operator's own traffic, one request per line.

    {"id": "r1", "arrival": 0.5, "prompt": [{"segment": "system-a", "tokens": 2048},
     {"segment": "question-1", "tokens": 40}], "output_tokens": 200,
     "kv_transfer_params": {"max_load_tokens": 1024}}

`prompt` is either token ids or segments: a segment's tokens depend only on its name, so prompts
that start with the same segments share that prefix (and a shorter use of a segment is a prefix
of a longer one). `arrival` (seconds, default 0) and `kv_transfer_params` are optional. Lines
are replayed in arrival order; blank lines and lines starting with `#` are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.scheduler.params import MAX_LOAD_TOKENS, MAX_OFFLOAD_TOKENS
from kvoffload.simulate.workloads import SimRequest, Tokens, _Fresh, segment_tokens

_FIELDS = {"id", "arrival", "prompt", "output_tokens", "kv_transfer_params"}
_PARAMS = (MAX_LOAD_TOKENS, MAX_OFFLOAD_TOKENS)
_MAX_TOKEN_ID = 2**31 - 1
_MAX_CAP = 2**63 - 1
_MAX_ARRIVAL = 1e9
MAX_REQUEST_TOKENS = 1 << 24
"""Prompt and output tokens of one request."""
_MAX_FILE_BYTES = 1 << 30

Bad = Callable[[str, str], Exception]


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, line and field."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"field {key!r} appears twice")
        out[key] = value
    return out


def load_trace(path: str | Path, seed: int = 0, max_tokens: int = 1 << 26) -> list[SimRequest]:
    """Reads and checks the whole trace before anything runs (at most `max_tokens` prompt and
    output tokens in all). Output tokens are seeded random."""
    p = Path(path)
    try:
        if not p.is_file():
            raise TraceError(f"--trace {path}: not a regular file")
        if p.stat().st_size > _MAX_FILE_BYTES:
            raise TraceError(f"--trace {path}: larger than {_MAX_FILE_BYTES >> 20} MiB")
        raw = p.read_bytes()
    except OSError as e:
        raise TraceError(f"--trace {path}: cannot read it: {e.strerror or e}") from None
    fresh = _Fresh(seed)
    requests: list[SimRequest] = []
    seen: dict[str, int] = {}
    total = 0
    for lineno, line_bytes in enumerate(raw.splitlines(), 1):

        def bad(field: str, problem: str, lineno: int = lineno) -> TraceError:
            return TraceError(f"--trace {path} line {lineno}: {field}: {problem}")

        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad("json", f"not UTF-8 (byte {e.start + 1})") from None
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            obj = json.loads(line, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as e:
            raise bad("json", f"not valid JSON ({e.msg} at column {e.colno})") from None
        except (ValueError, RecursionError) as e:  # huge numbers, deep nesting, duplicates
            raise bad("json", f"not accepted: {str(e)[:80]}") from None
        if not isinstance(obj, dict):
            raise bad("json", f"expected an object, got {type(obj).__name__}")
        request = _request(obj, bad, fresh, seen, lineno)
        total += len(request.prompt) + len(request.output)
        if total > max_tokens:
            raise bad("prompt", f"the trace holds more than {max_tokens:,} tokens in all")
        requests.append(request)
    if not requests:
        raise TraceError(f"--trace {path}: no requests in it")
    requests.sort(key=lambda r: r.arrival)  # stable: ties keep file order
    return requests


def _request(
    obj: dict[str, Any], bad: Bad, fresh: _Fresh, seen: dict[str, int], lineno: int
) -> SimRequest:
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise bad(unknown[0], f"unknown field; allowed: {', '.join(sorted(_FIELDS))}")
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        raise bad("id", f"expected a non-empty string, got {_short(rid)}")
    if rid in seen:
        raise bad("id", f"{rid!r} is already used on line {seen[rid]}")
    seen[rid] = lineno
    arrival = obj.get("arrival", 0)
    # int and float compare exactly at any size; NaN fails both bounds.
    if type(arrival) not in (int, float) or not 0 <= arrival <= _MAX_ARRIVAL:
        raise bad("arrival", f"expected seconds in 0..{_MAX_ARRIVAL:g}, got {_short(arrival)}")
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
    return SimRequest(rid, prompt, fresh(n_out), float(arrival), None, params)


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
