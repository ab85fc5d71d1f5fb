"""`make demo`, as a newcomer runs it: the script's own process, its output and its numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from demo import BLOCK, DOCUMENT, OTHER, QUESTION

HERE = Path(__file__).parent


def test_the_demo_shows_the_hit_from_metrics(tmp_path: Path) -> None:
    summary = tmp_path / "demo.json"
    run = subprocess.run(
        [sys.executable, str(HERE / "demo.py"), "--summary", str(summary)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    got = json.loads(summary.read_text())
    prompt = DOCUMENT + QUESTION
    # A computes all of its prompt and stores its whole blocks; so does the other traffic.
    assert got["a"]["vllm:prompt_tokens_total"] == prompt
    assert got["a"]["vllm:kvoffload_chunks_stored_total"] == prompt // BLOCK
    assert got["other"]["vllm:kvoffload_chunks_stored_total"] == OTHER // BLOCK
    # B: vLLM's own cache lost the document to the other traffic; kvoffload served its whole
    # blocks (62 of 32 tokens), and only the rest was computed.
    b = got["b"]
    assert b["vllm:prefix_cache_hits_total"] == 0
    assert b["vllm:kvoffload_hit_tokens_total"] == DOCUMENT // BLOCK * BLOCK == 1984
    assert b["vllm:external_prefix_cache_hits_total"] == 1984
    assert got["exit"] == 0
    assert "B's document came back from kvoffload: 1,984 of its 2,040 prompt tokens" in run.stdout
    assert "(62 blocks of 32 tokens)" in run.stdout
    assert "vllm serve " in run.stdout and '"kv_connector": "KVOffloadConnector"' in run.stdout
