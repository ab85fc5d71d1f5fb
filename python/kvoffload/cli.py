"""The `kvoffload` command: `kvoffload simulate` runs the workload simulator."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from kvoffload.errors import KVOffloadError
from kvoffload.scheduler import OffloadConfig
from kvoffload.simulate import SimResult, Workload, simulate

# Llama-3-8B in bf16: 32 layers x K/V x 8 KV heads x 128 dims x 2 bytes per token.
LLAMA3_8B_KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvoffload", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "simulate",
        help="run multi-turn chat sessions through the scheduler and CPU-tier store (no GPU)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    w = Workload()
    s.add_argument("--sessions", type=int, default=w.sessions)
    s.add_argument("--turns", type=int, default=w.turns)
    s.add_argument("--system-prompts", type=int, default=w.system_prompts)
    s.add_argument("--system-prompt-tokens", type=int, default=w.system_prompt_tokens)
    s.add_argument("--user-tokens", type=int, default=w.user_tokens)
    s.add_argument("--answer-tokens", type=int, default=w.answer_tokens)
    s.add_argument("--seed", type=int, default=w.seed)
    s.add_argument("--tokens-per-block", type=int, default=16, help="GPU block size")
    s.add_argument("--blocks-per-chunk", type=int, default=1)
    s.add_argument("--cpu-gib", type=float, default=1.0, help="CPU tier size")
    s.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=LLAMA3_8B_KV_BYTES_PER_TOKEN,
        help="KV bytes per token over all layers (default: Llama-3-8B, bf16)",
    )
    s.add_argument("--eviction-policy", default="lru")
    s.add_argument(
        "--offload-decode",
        action="store_true",
        help="also store decode-phase KV (offload_prompt_only=false)",
    )
    s.add_argument("--max-load-tokens", type=int, default=None)
    s.add_argument("--max-offload-tokens", type=int, default=None)
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _report(r: SimResult) -> str:
    st, sc = r.store, r.scheduler
    rows = [
        ("requests", f"{r.requests}"),
        ("prompt tokens", f"{r.prompt_tokens}"),
        ("loaded from CPU tier", f"{r.loaded_tokens} ({r.hit_rate:.1%} of prompt tokens)"),
        ("prefill tokens computed", f"{r.computed_prompt_tokens}"),
        ("chunks stored / loaded", f"{sc['chunks_stored']} / {sc['chunks_loaded']}"),
        (
            "GiB stored / loaded",
            f"{sc['bytes_stored'] / 2**30:.2f} / {sc['bytes_loaded'] / 2**30:.2f}",
        ),
        ("CPU tier slots used", f"{st['used_slots']} of {st['num_slots']}"),
        ("evictions / store refusals", f"{st['evictions']} / {sc['store_refusals']}"),
        ("deferred lookups", f"{sc['deferred_lookups']}"),
        ("ignored request params", f"{sc['ignored_params'] or 'none'}"),
        (
            "scheduler time",
            f"{r.scheduler_seconds * 1e3:.1f} ms over {r.steps} steps "
            f"({r.scheduler_seconds / max(r.steps, 1) * 1e6:.1f} us/step)",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = OffloadConfig.from_dict(
            {
                "tokens_per_block": args.tokens_per_block,
                "blocks_per_chunk": args.blocks_per_chunk,
                "cpu_bytes_to_use": int(args.cpu_gib * 2**30),
                "offload_prompt_only": not args.offload_decode,
                "eviction_policy": args.eviction_policy,
            }
        )
        workload = Workload(
            sessions=args.sessions,
            turns=args.turns,
            system_prompts=args.system_prompts,
            system_prompt_tokens=args.system_prompt_tokens,
            user_tokens=args.user_tokens,
            answer_tokens=args.answer_tokens,
            seed=args.seed,
        )
        params: dict[str, Any] = {}
        if args.max_load_tokens is not None:
            params["max_load_tokens"] = args.max_load_tokens
        if args.max_offload_tokens is not None:
            params["max_offload_tokens"] = args.max_offload_tokens
        bytes_per_chunk = args.kv_bytes_per_token * config.tokens_per_chunk
        result = simulate(config, workload, bytes_per_chunk, params)
    except (KVOffloadError, ValueError) as e:
        print(f"kvoffload simulate: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(result), "hit_rate": result.hit_rate}, indent=2))
    else:
        print(_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
