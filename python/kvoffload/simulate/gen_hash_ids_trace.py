"""A generated hash-ids trace the size and shape of Mooncake's FAST'25 conversation trace, for
when the real file is not at hand: 12,031 requests arriving evenly over an hour, prompts of
about 11,800 tokens on average (142 M in all; the published trace: 145 M) and outputs of about
344, whose reuse is multi-turn: three in four requests are the next turn of one of the 64 most
recent conversations and re-send its history (the same ids, but a new one for the block that
was partial) plus 1-3 new blocks.

    python -m kvoffload.simulate.gen_hash_ids_trace conversation_like.jsonl
    kvoffload simulate --trace conversation_like.jsonl ...

`benches/bench_simulate_scale.py` replays the same trace.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from kvoffload.simulate.flags import int_in

REQUESTS = 12_031
SECONDS = 3_600
BLOCK_TOKENS = 512
MEAN_OUTPUT = 343
_LIVE = 64
"""Conversations a new turn may continue: the most recently started."""
_MAX_BLOCKS = 60
"""A conversation ends after a turn of more blocks than this: a prompt has at most 63 blocks
(32,256 tokens)."""


def conversation_lines(requests: int = REQUESTS, seed: int = 0) -> list[str]:
    """The trace's lines, in arrival order: a fresh conversation starts with an exponential
    number of blocks (mean 24, at most 40); a follow-up turn re-sends its conversation's ids and
    appends 1-3 blocks. The previous turn's last block, partial there, comes back full under a
    new id, as in Mooncake's traces (an id hashes a block's tokens, so a partial block's id is
    not the full block's)."""
    rng = random.Random(seed)
    next_id = 0
    live: list[list[int]] = []
    """Each conversation's ids as its next turn re-sends them."""
    lines = []
    for i in range(requests):
        if live and rng.random() < 0.75:
            conv = live[rng.randrange(len(live))]
            new = rng.randint(1, 3)
        else:
            conv = []
            new = min(40, 1 + int(rng.expovariate(1 / 24)))
            live.append(conv)
            live[:] = live[-_LIVE:]
        ids = conv + list(range(next_id, next_id + new))
        next_id += new
        last = rng.randint(1, BLOCK_TOKENS)
        record = {
            "timestamp": int(i * SECONDS * 1000 / requests),
            "input_length": BLOCK_TOKENS * (len(ids) - 1) + last,
            "output_length": max(1, int(rng.expovariate(1 / MEAN_OUTPUT))),
            "hash_ids": ids,
        }
        lines.append(json.dumps(record))
        if last < BLOCK_TOKENS:
            ids = [*ids[:-1], next_id]
            next_id += 1
        conv[:] = ids
        if len(ids) > _MAX_BLOCKS:
            live.remove(conv)
    return lines


def write_trace(path: str | Path, requests: int = REQUESTS, seed: int = 0) -> None:
    """Writes the trace atomically: a replay never reads half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text("\n".join(conversation_lines(requests, seed)) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvoffload.simulate.gen_hash_ids_trace",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("out", metavar="OUT.jsonl", help="the file to write (replaced if it exists)")
    p.add_argument(
        "--requests",
        type=int_in(1, 1 << 21),
        default=REQUESTS,
        metavar="N",
        help=f"default: {REQUESTS:,}, the published trace's count",
    )
    p.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="default: 0")
    args = p.parse_args(argv)
    try:
        write_trace(args.out, args.requests, args.seed)
    except OSError as e:
        sys.stderr.write(f"{p.prog}: {args.out}: cannot write it: {e.strerror or e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
