"""Workloads: the requests a simulation replays, generated or read from a trace.

A request is token ids (prompt and output) plus when it may start: at `arrival` seconds, and for
a follow-up turn only once the request it follows (`after`) has finished, since its prompt
contains that request's answer. Token ids are random but seeded, so a run is reproducible and two
prompts share KV exactly where they share a prefix.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt

Tokens = npt.NDArray[np.int32]
_VOCAB = 50_000


@dataclass(frozen=True, eq=False)
class SimRequest:
    request_id: str
    prompt: Tokens
    output: Tokens
    """The tokens the request generates; the KV of all but the last one is computed."""
    arrival: float = 0.0
    after: str | None = None
    """The request whose answer this prompt contains: this one arrives once that one finished."""
    kv_transfer_params: Mapping[str, Any] | None = None

    @property
    def tokens(self) -> Tokens:
        return np.concatenate([self.prompt, self.output])

    @property
    def num_prompt(self) -> int:
        return len(self.prompt)

    @property
    def num_output(self) -> int:
        return len(self.output)

    def block_hashes(self, tokens_per_block: int) -> list[bytes]:
        return block_hashes(self.tokens, tokens_per_block)


class Request(Protocol):
    """What the engine reads of a request; a trace's requests make their tokens only when asked,
    so a replay holds the tokens of the live requests alone."""

    @property
    def request_id(self) -> str: ...
    @property
    def arrival(self) -> float: ...
    @property
    def after(self) -> str | None: ...
    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None: ...
    @property
    def num_prompt(self) -> int: ...
    @property
    def num_output(self) -> int: ...
    def block_hashes(self, tokens_per_block: int) -> list[bytes]: ...


def block_hashes(tokens: Tokens, tokens_per_block: int) -> list[bytes]:
    """Chained hashes of the full blocks, as vLLM's prefix cache keys them: block `i`'s hash
    fingerprints all tokens up to its end."""
    out: list[bytes] = []
    prev = b""
    raw, step = tokens.tobytes(), tokens_per_block * tokens.itemsize
    for i in range(0, (len(tokens) // tokens_per_block) * step, step):
        prev = hashlib.sha256(prev + raw[i : i + step]).digest()
        out.append(prev)
    return out


def segment_tokens(name: str, n: int) -> Tokens:
    """The first `n` tokens of the named segment: the same name always gives the same tokens."""
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(1, _VOCAB, n, dtype=np.int32)


class _Fresh:
    """Seeded random token ids: text no other request has seen."""

    def __init__(self, seed: int | Sequence[int]) -> None:
        self._rng = np.random.default_rng(seed)

    def __call__(self, n: int) -> Tokens:
        return self._rng.integers(1, _VOCAB, n, dtype=np.int32)


def _size(default: int, minimum: int, help: str) -> Any:
    """A workload size: a CLI flag (`--name-with-dashes`) with this default and lower bound."""
    return field(default=default, metadata={"min": minimum, "help": help})


def _conversations(
    fresh: _Fresh,
    conversations: int,
    turns: int,
    system_prompts: int,
    system_prompt_tokens: int,
    user_tokens: int,
    thinking_tokens: int,
    answer_tokens: int,
) -> list[SimRequest]:
    systems = [fresh(system_prompt_tokens) for _ in range(system_prompts)]
    history = [systems[c % system_prompts] for c in range(conversations)]
    out = []
    for turn in range(turns):
        # Turn-major order: every conversation's turn t comes before any turn t+1, so many
        # conversations are live at once and the caches really evict.
        for c in range(conversations):
            prompt = np.concatenate([history[c], fresh(user_tokens)])
            answer = fresh(answer_tokens)
            output = np.concatenate([fresh(thinking_tokens), answer])
            after = f"c{c}-t{turn - 1}" if turn else None
            out.append(SimRequest(f"c{c}-t{turn}", prompt, output, after=after))
            # The next prompt keeps the final answer only: the thinking is stripped.
            history[c] = np.concatenate([prompt, answer])
    return out


def _conversation_tokens(
    conversations: int,
    turns: int,
    system_prompts: int,
    system_prompt_tokens: int,
    user_tokens: int,
    thinking_tokens: int,
    answer_tokens: int,
) -> int:
    first = system_prompt_tokens + user_tokens + thinking_tokens + answer_tokens
    grow = user_tokens + answer_tokens
    return conversations * (turns * first + grow * turns * (turns - 1) // 2)


@dataclass(frozen=True)
class _Conversations:
    """What the two chat workloads share: conversations of turns over shared system prompts."""

    conversations: int = _size(32, 1, "conversations, interleaved turn by turn")
    turns: int = _size(4, 1, "turns per conversation")
    system_prompts: int = _size(4, 1, "distinct system prompts the conversations share")
    system_prompt_tokens: int = _size(2048, 1, "tokens per system prompt")
    user_tokens: int = _size(256, 1, "tokens per user message")

    def _sizes(self) -> dict[str, int]:
        return {"thinking_tokens": 0, **dataclasses.asdict(self)}

    def requests(self, seed: int) -> list[SimRequest]:
        return _conversations(_Fresh(seed), **self._sizes())

    def num_tokens(self) -> int:
        """Prompt and output tokens of all its requests together."""
        return _conversation_tokens(**self._sizes())


@dataclass(frozen=True)
class ReasoningChat(_Conversations):
    """Multi-turn chat with a reasoning model: each answer is thinking text then the final answer,
    and the next turn's prompt keeps only the final answer."""

    name: ClassVar[str] = "reasoning-chat"
    thinking_tokens: int = _size(1024, 0, "thinking tokens per answer (dropped from the history)")
    answer_tokens: int = _size(256, 1, "final-answer tokens per answer (kept in the history)")


@dataclass(frozen=True)
class Chat(_Conversations):
    """Multi-turn chat whose answers stay verbatim in the next turn's prompt (no thinking)."""

    name: ClassVar[str] = "chat"
    answer_tokens: int = _size(512, 1, "tokens per answer (kept in the history)")


@dataclass(frozen=True)
class SharedPrefix:
    """Many short questions, each over one of a few long system/RAG prefixes picked at random."""

    name: ClassVar[str] = "shared-prefix"
    prefixes: int = _size(8, 1, "distinct long prefixes")
    prefix_tokens: int = _size(8192, 1, "tokens per prefix")
    questions: int = _size(256, 1, "questions, all arriving at once")
    question_tokens: int = _size(64, 1, "tokens per question")
    answer_tokens: int = _size(128, 1, "tokens per answer")

    def requests(self, seed: int) -> list[SimRequest]:
        fresh = _Fresh(seed)
        prefixes = [fresh(self.prefix_tokens) for _ in range(self.prefixes)]
        pick = np.random.default_rng(seed + 1).integers(0, self.prefixes, self.questions)
        return [
            SimRequest(
                f"q{i}",
                np.concatenate([prefixes[p], fresh(self.question_tokens)]),
                fresh(self.answer_tokens),
            )
            for i, p in enumerate(pick.tolist())
        ]

    def num_tokens(self) -> int:
        per = self.prefix_tokens + self.question_tokens + self.answer_tokens
        return self.questions * per


@dataclass(frozen=True)
class Agentic:
    """Agents that each grow one context: every step's prompt is the previous prompt, the
    model's action and the tool's output."""

    name: ClassVar[str] = "agentic"
    agents: int = _size(16, 1, "agents, interleaved step by step")
    steps: int = _size(8, 1, "steps per agent")
    system_prompt_tokens: int = _size(4096, 1, "tokens of the system prompt all agents share")
    user_tokens: int = _size(256, 1, "tokens of each agent's task")
    action_tokens: int = _size(128, 1, "tokens the model writes per step (a tool call)")
    tool_output_tokens: int = _size(1024, 1, "tokens each tool call returns")

    def requests(self, seed: int) -> list[SimRequest]:
        fresh = _Fresh(seed)
        system = fresh(self.system_prompt_tokens)
        context = [np.concatenate([system, fresh(self.user_tokens)]) for _ in range(self.agents)]
        out = []
        for step in range(self.steps):
            for a in range(self.agents):
                action = fresh(self.action_tokens)
                after = f"a{a}-s{step - 1}" if step else None
                out.append(SimRequest(f"a{a}-s{step}", context[a], action, after=after))
                context[a] = np.concatenate([context[a], action, fresh(self.tool_output_tokens)])
        return out

    def num_tokens(self) -> int:
        grow = self.action_tokens + self.tool_output_tokens
        first = self.system_prompt_tokens + self.user_tokens + self.action_tokens
        return self.agents * (self.steps * first + grow * self.steps * (self.steps - 1) // 2)


Workload = ReasoningChat | Chat | SharedPrefix | Agentic
WORKLOADS: dict[str, type[Workload]] = {
    w.name: w for w in (ReasoningChat, Chat, SharedPrefix, Agentic)
}


def describe(workload: Workload) -> str:
    sizes = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in dataclasses.asdict(workload).items())
    return f"{workload.name} ({sizes})"
