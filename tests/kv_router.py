"""A KV-aware router's view of a fleet, fed by vLLM's own ZMQ event publisher: what llm-d's
precise prefix-cache scorer and Dynamo's KV router build, written from the wire format alone.

Each engine publishes `(topic, seq, msgpack batch)` on a PUB socket and keeps its last batches for
replay on a ROUTER socket. The subscriber decodes the batches untyped (as a router in another
language does: a batch is `[ts, events, dp_rank]`, an event a map tagged by `type`), checks that
a self-describing store's tokens hash to its block hashes, and indexes `block hash -> count` per
instance and medium (a block announced twice counts twice, as vLLM asks). A `REMOTE` tier is
pooled by its `ownership`: every instance that reaches it may load what any of them wrote; its
writers announce each write and any replica withdraws a chunk it finds gone, so a block of it is
there or not (a set, not a count).

`predict` is the hit a request would get: the GPU blocks it finds (at most `num_tokens - 1`
tokens, vLLM's rule), or the longest run of blocks the instance's offload tiers hold between
them, rounded down to whole chunks, if that adds at least one chunk (the engine loads no less).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class Instance:
    name: str
    endpoint: str
    replay_endpoint: str
    reaches: frozenset[str] = frozenset()
    """The shared tiers (their ownership) this instance reads, as the fleet is configured."""
    gpu: Counter[Any] = field(default_factory=Counter)
    local: dict[tuple[str, str | None], Counter[Any]] = field(default_factory=dict)
    """(medium, ownership) -> blocks of a tier of its own."""
    next_seq: int = 0
    sub: Any = None
    replay: Any = None


class KVRouter:
    def __init__(
        self,
        block_size: int,
        chunk_tokens: int,
        hash_tokens: Callable[[Any, Sequence[int]], Any],
        strict: bool = True,
    ) -> None:
        """`hash_tokens(parent, tokens)` is the engines' block hash (as a router configures it).
        `strict`: a withdrawal of a block the tier never announced fails (a router ignores it)."""
        self.strict = strict
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self.hash_tokens = hash_tokens
        self.instances: dict[str, Instance] = {}
        self.shared: dict[str, Counter[Any]] = {}
        self.events: list[tuple[str, dict[str, Any]]] = []
        """Every event applied, with its instance, in order (for the tests' own checks)."""
        self._ctx = zmq.Context.instance()

    def connect(self, instance: Instance) -> None:
        instance.sub = self._ctx.socket(zmq.SUB)
        instance.sub.setsockopt(zmq.SUBSCRIBE, b"")
        instance.sub.connect(instance.endpoint)
        instance.replay = self._ctx.socket(zmq.DEALER)
        instance.replay.connect(instance.replay_endpoint)
        self.instances[instance.name] = instance

    def close(self) -> None:
        for instance in self.instances.values():
            instance.sub.close(linger=0)
            instance.replay.close(linger=0)

    # --- the wire ---------------------------------------------------------------------------

    def catch_up(self, name: str, last_seq: int) -> None:
        """Applies every batch up to `last_seq` (the publisher's newest), asking the replay
        socket for what the PUB socket did not deliver (a subscriber that joined late)."""
        instance = self.instances[name]
        while instance.next_seq <= last_seq:
            if instance.sub.poll(200):
                _, seq_bytes, payload = instance.sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq == instance.next_seq:
                    self._apply(instance, payload)
                elif seq > instance.next_seq:
                    self._replay(instance)
            else:
                self._replay(instance)

    def _replay(self, instance: Instance) -> None:
        instance.replay.send_multipart((b"", instance.next_seq.to_bytes(8, "big")))
        while True:
            assert instance.replay.poll(5000), f"{instance.name}: no answer from the replay socket"
            _, _, seq_bytes, payload = instance.replay.recv_multipart()
            if seq_bytes == END_SEQ:
                return
            if int.from_bytes(seq_bytes, "big") == instance.next_seq:
                self._apply(instance, payload)

    def _apply(self, instance: Instance, payload: bytes) -> None:
        _, events, *_ = msgspec.msgpack.decode(payload)
        instance.next_seq += 1
        for event in events:
            self.events.append((instance.name, event))
            kind = event["type"]
            if kind == "AllBlocksCleared":
                instance.gpu.clear()  # vLLM's GPU prefix cache reset; the tiers say their own
                continue
            hashes = event["block_hashes"]
            index = self._index(instance, event)
            shared = event.get("locality") == "REMOTE"
            if kind == "BlockStored":
                self._check_tokens(event)
                if shared:  # a block of a shared tier is there or not, whoever announced it
                    index.update({h: 1 for h in hashes if h not in index})
                else:
                    index.update(hashes)
            elif shared:
                assert kind == "BlockRemoved", event
                for h in hashes:
                    index.pop(h, None)
            else:
                assert kind == "BlockRemoved", event
                # A tier whose every removal its engine sees (the CPU tier, a node's disk)
                # withdraws only what it announced, as it announced it.
                strict = (
                    self.strict and index is not instance.gpu and event.get("locality") != "REMOTE"
                )
                for h in hashes:
                    assert not strict or index[h] > 0, f"{instance.name}: never announced: {event}"
                    if index[h] > 1:
                        index[h] -= 1
                    else:
                        index.pop(h, None)

    def _index(self, instance: Instance, event: dict[str, Any]) -> Counter[Any]:
        medium = event.get("medium") or "GPU"
        if medium == "GPU":
            return instance.gpu
        if event.get("locality") == "REMOTE":
            return self.shared.setdefault(event["ownership"], Counter())
        return instance.local.setdefault((medium, event.get("ownership")), Counter())

    def _check_tokens(self, event: dict[str, Any]) -> None:
        """A self-describing store's tokens hash to its blocks (what a router that hashes
        prompts itself, as llm-d's does, relies on)."""
        if event.get("medium") in (None, "GPU") or event["block_size"] == 0:
            return
        size, tokens = event["block_size"], event["token_ids"]
        assert len(tokens) == size * len(event["block_hashes"]), event
        parent = event["parent_block_hash"]
        for i, h in enumerate(event["block_hashes"]):
            parent = self.hash_tokens(parent, tokens[i * size : (i + 1) * size])
            assert parent == h, f"block {i} of {event}: its tokens hash to {parent!r}"

    # --- routing ----------------------------------------------------------------------------

    def predict(self, name: str, hashes: Sequence[Any], num_tokens: int) -> int:
        """Tokens the request's prefix finds on instance `name` (see the module)."""
        instance = self.instances[name]
        gpu = _run(hashes, [instance.gpu])
        gpu = min(gpu, (num_tokens - 1) // self.block_size)
        tiers = list(instance.local.values())
        tiers += [c for o, c in self.shared.items() if o in instance.reaches]
        offload = _run(hashes, tiers) // self.blocks_per_chunk * self.blocks_per_chunk
        # The engine loads at least a whole chunk past what its GPU holds, or nothing.
        if offload - gpu >= self.blocks_per_chunk:
            return offload * self.block_size
        return gpu * self.block_size

    def medium_blocks(self, name: str, medium: str, ownership: str | None = None) -> int:
        """Distinct blocks the instance holds in one of its own tiers."""
        counter = self.instances[name].local.get((medium, ownership), Counter())
        return len(counter)


class PromptHasher:
    """vLLM's block hashes of a prompt, as its events carry them: what a router computes from a
    request's tokens (`hash_fn`: the engine's `--prefix-caching-hash-algo`)."""

    def __init__(self, block_size: int, hash_fn: Callable[[Any], bytes]) -> None:
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

        self.block_size = block_size
        self._hash_fn = hash_fn
        self._hash_block, self._convert = hash_block_tokens, maybe_convert_block_hash
        self._known: dict[Any, bytes] = {}
        """Event-form hash -> vLLM's hash bytes, for every block hashed here."""

    def __call__(self, parent: Any, tokens: Sequence[int]) -> Any:
        """The block hash of `tokens` after `parent` (both as the events carry them)."""
        h = self._hash_block(self._hash_fn, None if parent is None else self._known[parent], tokens)
        self._known[self._convert(h)] = h
        return self._convert(h)

    def prompt(self, tokens: Sequence[int]) -> list[Any]:
        out, parent, size = [], None, self.block_size
        for i in range(len(tokens) // size):
            parent = self(parent, tokens[i * size : (i + 1) * size])
            out.append(parent)
        return out


def _run(hashes: Sequence[Any], indexes: list[Counter[Any]]) -> int:
    n = 0
    for h in hashes:
        if not any(h in index for index in indexes):
            break
        n += 1
    return n


@contextlib.contextmanager
def router(
    block_size: int, chunk_tokens: int, hash_tokens: Callable[[Any, Sequence[int]], Any]
) -> Iterator[KVRouter]:
    r = KVRouter(block_size, chunk_tokens, hash_tokens)
    try:
        yield r
    finally:
        r.close()
