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
