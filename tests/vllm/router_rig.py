"""The rig's engines publishing vLLM's KV events on ZMQ, and a router (`kv_router.KVRouter`)
that predicts each request's hit before it runs: `Fleet.replay` asserts the prediction equals
what vLLM then reports (its GPU prefix cache's tokens plus the connector's)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rig import TPB, Rig, prompt
from vllm.config import KVEventsConfig
from vllm.utils.hashing import sha256

from kv_router import Instance, KVRouter, PromptHasher

HASHER = PromptHasher(TPB, sha256)
"""The rig's block hashes, as a router computes them from a prompt."""


def publishing(where: Path, name: str) -> tuple[KVEventsConfig, Instance]:
    """vLLM's ZMQ publisher on ipc sockets under `where`, and how a router reaches it."""
    endpoint, replay = f"ipc://{where}/{name}.pub", f"ipc://{where}/{name}.replay"
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, replay_endpoint=replay
    )
    return config, Instance(name, endpoint, replay)


def published(rig: Rig) -> int:
    """The newest batch the engine's publisher has sent."""
    publisher = rig.scheduler.kv_event_publisher
    publisher._event_queue.join()
    return publisher._buffer[-1][0] if publisher._buffer else -1


class Fleet:
    def __init__(self, kv: KVRouter, engines: dict[str, Rig]) -> None:
        self.kv, self.engines = kv, engines
        self.served: list[tuple[str, int, int]] = []
        """(engine, predicted, reported) per request."""

    def catch_up(self) -> None:
        for name, rig in self.engines.items():
            self.kv.catch_up(name, published(rig))

    def serve(self, name: str, rid: str, tokens: list[int]) -> tuple[int, int]:
        rig = self.engines[name]
        self.catch_up()
        predicted = self.kv.predict(name, HASHER.prompt(tokens), len(tokens))
        rig.add(rid, tokens, 2)
        rig.run(max_steps=50_000)
        reported = rig.local_hits.get(rid, 0) + rig.external_hits.get(rid, 0)
        assert rig.checked_positions[rid] >= reported  # what it loaded was checked
        self.served.append((name, predicted, reported))
        return predicted, reported

    def replay(self, requests: list[tuple[str, list[int]]], tag: str) -> None:
        for i, (name, tokens) in enumerate(requests):
            predicted, reported = self.serve(name, f"{tag}{i}", tokens)
            assert predicted == reported, (tag, i, name, predicted, reported)

    def events(self, name: str, kind: str, medium: str) -> list[dict[str, Any]]:
        self.catch_up()
        return [
            e
            for n, e in self.kv.events
            if n == name and e["type"] == kind and e.get("medium") == medium
        ]


def workload(seed: int, names: list[str], n: int) -> list[tuple[str, list[int]]]:
    """`n` requests over 14 prompts of 5 families (a 24-token head, 12 to 36 tokens after it:
    38 chunks in all), each sent to one of `names`."""
    heads = [prompt(500 + f, 24) for f in range(5)]
    prompts = [heads[i % 5] + prompt(600 + i, 12 * (1 + i % 3)) for i in range(14)]
    rng = random.Random(seed)
    return [(rng.choice(names), rng.choice(prompts)) for _ in range(n)]
