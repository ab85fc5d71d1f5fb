"""kvoffload's log lines beside vLLM's: vLLM configures only its own `vllm` logger, so without
this the start-up lines (the tier built, the pool's first piece ready) would not be printed."""

from __future__ import annotations

import logging


def log_beside_vllm() -> None:
    """Hands the `kvoffload` logger vLLM's handlers and level, unless logging is configured
    otherwise: the `kvoffload` logger has handlers of its own, or the root logger has some (its
    messages reach those already)."""
    ours, theirs = logging.getLogger("kvoffload"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
