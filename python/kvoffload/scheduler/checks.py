"""The scheduler's argument checks: each returns the value in the form the planners use, or
raises a ValueError naming the argument, the value and what is allowed."""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable, Sequence

import numpy as np

from kvoffload import _rust
from kvoffload._rust import BlockSet
from kvoffload.scheduler.jobs import IntArray, StateBlock

NO_BLOCKS: IntArray = np.empty(0, dtype=np.int64)
NO_BLOCKS.flags.writeable = False
_MAX_ID = np.iinfo(np.int64).max


def short(values: object, shown: int = 5) -> str:
    """`values` for an error message: a long sequence shows its first items and a count."""
    try:
        items = list(values)  # type: ignore[call-overload]
    except TypeError:
        return repr(values)
    if len(items) <= shown:
        return repr(values)
    head = ", ".join(repr(v) for v in items[:shown])
    return f"[{head}, ... and {len(items) - shown} more]"


def block_ids(name: str, values: Sequence[int] | IntArray) -> IntArray:
    """`values` as GPU block ids, or a ValueError naming `name`: every id an int >= 0."""
    if isinstance(values, (list, tuple)):
        if not values:
            return NO_BLOCKS  # most decode steps allocate nothing
        if _rust.are_block_ids(values):
            # C-speed conversion of a list of ints (vLLM's tables).
            return np.frombuffer(array("q", values), dtype=np.int64)
        if any(isinstance(v, bool) for v in values):  # numpy would take True for 1
            raise ValueError(
                f"{name}={short(values)} is invalid: expected a sequence of ints >= 0 "
                "(GPU block ids)"
            )
    ids = np.asarray(values)
    if ids.size == 0:
        return NO_BLOCKS
    if (
        ids.ndim != 1
        or ids.dtype.kind not in "iu"
        or int(ids.min()) < 0
        or int(ids.max()) > _MAX_ID  # a uint64 past int64
    ):
        raise ValueError(
            f"{name}={short(values)} is invalid: expected a sequence of ints >= 0 (GPU block ids)"
        )
    return ids.astype(np.int64, copy=False)


def realloc_set(values: Iterable[int]) -> BlockSet:
    """`values` as a `BlockSet`, or a ValueError naming `reallocated_block_ids`."""
    blocks = BlockSet()
    blocks.add(block_ids("reallocated_block_ids", list(values)).tolist())
    return blocks


def block_list(name: str, values: Sequence[int] | IntArray) -> list[int]:
    """`values` as a new list of GPU block ids, or a ValueError naming `name` (`block_ids`)."""
    if type(values) in (list, tuple) and _rust.are_block_ids(values):
        return list(values)  # vLLM's tables: a plain copy, not a round trip through numpy
    ids: list[int] = block_ids(name, values).tolist()
    return ids


def group_tables(
    name: str,
    values: Sequence[int] | Sequence[Sequence[int]],
    num_groups: int,
    *,
    empty_ok: bool = False,
) -> list[list[int]]:
    """One block table per KV-cache group (new lists), or a ValueError naming `name`."""
    if empty_ok and len(values) == 0:
        return []
    tables = _rust.block_tables(values, num_groups)
    if tables is not None:
        return tables  # vLLM's tables: checked and copied in one call
    allowed = f"expected {num_groups} sequences of GPU block ids, one per KV-cache group"
    if type(values) not in (list, tuple) and (
        not isinstance(values, Sequence) or isinstance(values, (str, bytes))
    ):
        raise ValueError(f"{name}={short(values)} is invalid: {allowed}")
    if len(values) != num_groups or any(isinstance(v, (int, np.integer)) for v in values):
        raise ValueError(f"{name}={short(values)} is invalid: {allowed}")
    tables = [block_list(f"{name}[{g}]", v) for g, v in enumerate(values)]  # type: ignore[arg-type]
    if len({len(t) for t in tables}) > 1:
        # Every group's table covers the request's tokens (vLLM's are of one length).
        raise ValueError(
            f"{name} has tables of lengths {[len(t) for t in tables]}: {allowed}, of one length"
        )
    return tables


def count(name: str, value: int) -> int:
    """`value` as a token count, or a ValueError naming `name`."""
    if type(value) is int and value >= 0:
        return value  # the usual answer, asked thousands of times a run
    if isinstance(value, bool) or not hasattr(value, "__index__") or operator.index(value) < 0:
        raise ValueError(f"{name}={value!r} is invalid: expected an int >= 0")
    return operator.index(value)


def state_block(b: StateBlock, state_groups: list[int]) -> tuple[int, int, int]:
    """A `StateBlock`'s `(group, block_id, num_tokens)`, or a ValueError naming the field;
    `state_groups` are the model's Mamba groups."""
    group = b.group
    if isinstance(group, bool) or not hasattr(group, "__index__") or group not in state_groups:
        allowed = ", ".join(map(str, state_groups)) or "this model has none"
        raise ValueError(
            f"StateBlock group={group!r} of request {b.request_id!r} is invalid; allowed: "
            f"the index of a mamba group ({allowed})"
        )
    (block,) = block_ids("StateBlock block_id", [b.block_id]).tolist()
    return operator.index(group), block, count("StateBlock num_tokens", b.num_tokens)
