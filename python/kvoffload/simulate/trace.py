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
import math
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.scheduler.params import MAX_LOAD_TOKENS, MAX_OFFLOAD_TOKENS
from kvoffload.simulate.workloads import SimRequest, Tokens, _Fresh, segment_tokens

_FIELDS = {"id", "arrival", "prompt", "output_tokens", "kv_transfer_params"}
_MAX_TOKEN_ID = 2**31 - 1
_MAX_SEGMENT_TOKENS = 1 << 24


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the file, line and field."""


def load_trace(path: str | Path, seed: int = 0) -> list[SimRequest]:
    """Reads and checks the whole trace before anything runs. Output tokens are seeded random."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"--trace {path}: cannot read it: {e}") from None
    fresh = _Fresh(seed)
    requests: list[SimRequest] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue

        def bad(field: str, problem: str, lineno: int = lineno) -> TraceError:
            return TraceError(f"--trace {path} line {lineno}: {field}: {problem}")

        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise bad("json", f"not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise bad("json", f"expected an object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - _FIELDS)
        if unknown:
            raise bad(unknown[0], f"unknown field; allowed: {', '.join(sorted(_FIELDS))}")
        rid = obj.get("id")
        if not isinstance(rid, str) or not rid:
            raise bad("id", f"expected a non-empty string, got {rid!r}")
        if rid in seen:
            raise bad("id", f"{rid!r} is already used on line {seen[rid]}")
        seen[rid] = lineno
        arrival = obj.get("arrival", 0)
        if (
            isinstance(arrival, bool)
            or not isinstance(arrival, (int, float))
            or not math.isfinite(arrival)
            or arrival < 0
        ):
            raise bad("arrival", f"expected a finite number of seconds >= 0, got {arrival!r}")
        prompt = _prompt(obj.get("prompt"), bad)
        n_out = obj.get("output_tokens")
        if type(n_out) is not int or n_out < 1:
            raise bad("output_tokens", f"expected an int >= 1, got {n_out!r}")
        params = obj.get("kv_transfer_params")
        if params is not None:
            if not isinstance(params, dict):
                raise bad("kv_transfer_params", f"expected an object, got {params!r}")
            for key in (MAX_LOAD_TOKENS, MAX_OFFLOAD_TOKENS):
                v = params.get(key)
                if v is not None and (type(v) is not int or v < 0):
                    raise bad(f"kv_transfer_params.{key}", f"expected an int >= 0, got {v!r}")
        requests.append(SimRequest(rid, prompt, fresh(n_out), float(arrival), None, params))
    if not requests:
        raise TraceError(f"--trace {path}: no requests in it")
    requests.sort(key=lambda r: r.arrival)  # stable: ties keep file order
    return requests


def _prompt(raw: object, bad: Any) -> Tokens:
    if not isinstance(raw, list) or not raw:
        raise bad("prompt", "expected a non-empty list of token ids or of segments")
    if all(type(t) is int for t in raw):
        if not all(0 <= t <= _MAX_TOKEN_ID for t in raw):
            raise bad("prompt", f"token ids must be ints in 0..{_MAX_TOKEN_ID}")
        return np.asarray(raw, dtype=np.int32)
    parts = []
    for i, seg in enumerate(raw):
        where = f"prompt[{i}]"
        if not isinstance(seg, dict) or set(seg) != {"segment", "tokens"}:
            raise bad(where, f'expected {{"segment": name, "tokens": n}}, got {seg!r}')
        name, n = seg["segment"], seg["tokens"]
        if not isinstance(name, str) or not name:
            raise bad(f"{where}.segment", f"expected a non-empty string, got {name!r}")
        if type(n) is not int or not 1 <= n <= _MAX_SEGMENT_TOKENS:
            raise bad(f"{where}.tokens", f"expected an int in 1..{_MAX_SEGMENT_TOKENS}, got {n!r}")
        parts.append(segment_tokens(name, n))
    return np.concatenate(parts)
