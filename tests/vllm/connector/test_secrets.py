"""The Redis password never reaches a log, an error or a metric: vLLM's own start-up logging of
every documented serve line (`log_non_default_args` on the parsed `vllm serve` arguments, and the
engine's config), and, through `KVOffloadConnector` on vLLM's real scheduler against a real
`redis-server` with a password, our logs, errors and exported metrics under the right password
(read from a file), a rotation (the file changes while the engines run: the next reconnect takes
the new one), a wrong password and a server down."""

from __future__ import annotations

import json
import logging
import re
import time

import pytest
from prom_recorder import Recorder
from rig import Rig, make_rig, prompt

from kvoffload import ConfigError
from kvoffload.vllm import KVOffloadConnector
from redis_server import redis_server
from test_docs_serve_lines import LINES

PROMPT = prompt(7, 60)
FIRST, SECOND = "canary-pw-4f1d9e", "canary-pw-rotated-77ab"
# A URL that carries credentials (user:password@), as vLLM would print it.
CREDENTIALS_IN_URL = re.compile(r"://[^/\s'\"@]*:[^/\s'\"@]+@")


@pytest.fixture
def vllm_parser(monkeypatch):
    """`vllm serve`'s argument parser. Its defaults build a DeviceConfig, which needs a device
    type: this machine has no GPU and runs vLLM without its CPU build, so the platform says
    "cpu" (nothing else of vLLM's is changed)."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if not current_platform.device_type:
        monkeypatch.setattr(type(current_platform), "device_type", "cpu")
    return make_arg_parser(FlexibleArgumentParser())


def logged_at_start(parser, raw: str, caplog) -> str:
    """What `vllm serve` logs of its non-default arguments for a serve line's config."""
    from vllm.entrypoints.common.startup import log_non_default_args

    args = parser.parse_args(["--model", "meta-llama/Llama-3.1-8B-Instruct"])
    args.kv_transfer_config = parser.parse_args(["--kv-transfer-config", raw]).kv_transfer_config
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm"):
        log_non_default_args(args)
    return caplog.text


def test_vllm_prints_a_password_written_in_the_url_and_we_say_so_once(vllm_parser, caplog):
    entry = {"type": "RedisTier", "url": f"redis://:{FIRST}@10.0.0.5:6379", "namespace": "m"}
    raw = json.dumps(
        {
            "kv_connector": "KVOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"secondary_tiers": [entry]},
        }
    )
    # The leak the file form avoids: vLLM logs the url as given.
    assert FIRST in logged_at_start(vllm_parser, raw, caplog)
    from kvoffload.tiers.entries import parse_entries

    caplog.clear()
    for _ in range(3):
        parse_entries([entry])
    said = [r.getMessage() for r in caplog.records if "holds a password" in r.getMessage()]
    assert len(said) == 1 and "password_file" in said[0] and FIRST not in said[0]


SERVE_LINES = [(page, line, raw) for page, line, raw in LINES if "RedisTier" in raw]


@pytest.mark.parametrize(
    ("page", "line", "raw"), SERVE_LINES, ids=[f"{p}:{n}" for p, n, _ in SERVE_LINES]
)
def test_every_documented_redis_serve_line_logs_no_password(vllm_parser, caplog, page, line, raw):
    text = logged_at_start(vllm_parser, raw, caplog)
    assert "kv_transfer_config" in text and "RedisTier" in text  # it is what vLLM printed
    assert not CREDENTIALS_IN_URL.search(text), text
    assert "password_file" in raw or "password_env" in raw


def engine(model_dir: str, entry: dict) -> Rig:
    return make_rig(model_dir, extra={"secondary_tiers": [entry]})


def serve(rig: Rig, rid: str, tokens: list[int]) -> int:
    rig.add(rid, tokens, 2)
    rig.run(max_steps=50_000)
    return rig.external_hits.get(rid, 0)


def exported(rig: Rig) -> str:
    """Every metric name and label value the engine's connector exported."""
    types = Recorder.reset()
    prom = KVOffloadConnector.build_prom_metrics(rig.vllm_config, types, ["engine"], {0: ["0"]})
    for data in rig.connector_stats:
        prom.observe(data)
    return repr({name: m.values for name, m in Recorder.made.items()})


def test_no_password_in_our_logs_errors_or_metrics_through_a_rotation(model_dir, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    secret = tmp_path / "redis-password"
    secret.write_text(FIRST + "\n")
    seen: list[str] = []
    with redis_server(password=FIRST) as server:
        entry = {
            "type": "RedisTier",
            "url": f"redis://127.0.0.1:{server.port}",
            "namespace": "tiny-llama@test",
            "password_file": str(secret),
        }
        one, two = engine(model_dir, entry), engine(model_dir, entry)
        # What the engine logs of its config at start, and our settings' repr.
        seen += [str(one.vllm_config), repr(one.connector._sched().settings)]
        assert "password_file" in seen[1]
        assert serve(one, "a", PROMPT) == 0
        assert serve(two, "b", PROMPT) == 60
        # The secret rotates while both engines run: the server takes the new password, the
        # mounted file changes, and the open connections are closed (a restart, a failover).
        server.command("CONFIG", "SET", "requirepass", SECOND)
        server.password = SECOND
        secret.write_text(SECOND + "\n")
        server.command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        # Engine 1 stores a new prompt and engine 2 loads it: both reconnected with the new
        # password (a job that met a closed connection fails first; the breaker then waits).
        other = prompt(8, 60)
        deadline = time.monotonic() + 30
        for i in range(1000):
            serve(one, f"c{i}", other)
            two.cpu_store().reset()
            two.reset_gpu_prefix_cache()
            if serve(two, f"d{i}", other) == 60:
                break
            assert time.monotonic() < deadline, "the engines never reconnected"
            time.sleep(0.2)
        assert two.checked_positions[f"d{i}"] >= 60
        # The old password was tried at a reconnect and refused (the server's log of refused
        # AUTHs) before the file was read again.
        assert server.command("ACL", "LOG")
        for rig in (one, two):
            seen.append(exported(rig))
        # A wrong password stops start-up, saying whose it was, never what it was.
        secret.write_text("a-wrong-one\n")
        with pytest.raises(ConfigError) as refused:
            engine(model_dir, entry)
        seen.append(str(refused.value))
        assert "password_file=" in str(refused.value) and "a-wrong-one" not in str(refused.value)
        secret.write_text(SECOND + "\n")
        server.stop()
        # The server down: the engine starts, says so, and serves from its CPU tier.
        down = engine(model_dir, entry)
        assert serve(down, "e", PROMPT) == 0
        seen.append(exported(down))
    seen.append(caplog.text)
    assert any("unreachable" in r.getMessage() for r in caplog.records)
    for text in seen:
        assert FIRST not in text and SECOND not in text


def test_a_password_env_is_read_by_every_process_that_connects(model_dir, monkeypatch):
    with redis_server(password=FIRST) as server:
        monkeypatch.setenv("KVO_REDIS_PASSWORD", FIRST)
        entry = {
            "type": "RedisTier",
            "url": f"redis://127.0.0.1:{server.port}",
            "namespace": "tiny-llama@test",
            "password_env": "KVO_REDIS_PASSWORD",
        }
        assert serve(engine(model_dir, entry), "a", PROMPT) == 0
        assert serve(engine(model_dir, entry), "b", PROMPT) == 60
        monkeypatch.delenv("KVO_REDIS_PASSWORD")
        with pytest.raises(ConfigError, match="password_env=KVO_REDIS_PASSWORD"):
            engine(model_dir, entry)
