"""Helpers of the simulator tests."""

from __future__ import annotations

import json
from pathlib import Path


def write_trace(path: Path, lines: list[dict | str]) -> str:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def seg(name: str, tokens: int) -> dict:
    return {"segment": name, "tokens": tokens}


# 16-token blocks and chunks of 16 x 1 KiB: 1 MiB of CPU tier holds 64 chunks.
TINY = ["--kv-bytes-per-token", "1024", "--cpu-gib", str(1 / 1024)]


def ids_line(ms: float, ids: list[int], n_in: int, n_out: int = 1) -> dict:
    """A hash-ids trace line."""
    return {"timestamp": ms, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


# A (ids 1, 2: 64 tokens with 32-token ids), then B, C, D 10 s apart, each A's ids plus one of
# its own (96 tokens): one at a time, so nothing queues.
FOUR = [ids_line(10_000 * i, [1, 2, 10 + i][: 2 + (i > 0)], 64 + 32 * (i > 0)) for i in range(4)]
