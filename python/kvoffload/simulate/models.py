"""Common models: their KV bytes per token (bf16 KV, all layers, K and V) and the engine speeds
`--model` sets, scaled from the calibrated Llama-3-8B on one H200 (`EngineConfig`'s defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """From each model's config.json (layers, KV heads, head size, query heads) and its model
    card (parameters, all active: none of these is a mixture of experts)."""

    layers: int
    kv_heads: int
    head_size: int
    query_heads: int
    params: float

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_size * 2

    @property
    def attention_width(self) -> int:
        """Query heads x head size: what an attention FLOP per token of context scales with."""
        return self.query_heads * self.head_size


_SHAPES = {
    "llama-3-8b": Shape(32, 8, 128, 32, 8.03e9),
    "llama-3-70b": Shape(80, 8, 128, 64, 70.6e9),
    "llama-3.1-405b": Shape(126, 8, 128, 128, 405.9e9),
    "qwen3-8b": Shape(36, 8, 128, 32, 8.19e9),
    "qwen3-32b": Shape(64, 8, 128, 64, 32.8e9),
    "mistral-7b": Shape(32, 8, 128, 32, 7.24e9),
}

MODELS: dict[str, int] = {name: s.kv_bytes_per_token for name, s in _SHAPES.items()}
DEFAULT_MODEL = "llama-3-8b"

SPEED_FLAGS = ("prefill_tokens_per_s", "prefill_attention_tokens", "decode_step_ms")
"""The engine settings `--model` sets (each flag of the same name overrides it)."""


def model_speeds(name: str, reference: dict[str, float]) -> dict[str, float]:
    """`SPEED_FLAGS` for model `name`, on the GPU whose Llama-3-8B speeds are `reference`
    (the defaults: one H200). One GPU runs the whole model: the simulator models no tensor
    parallelism, so a model that needs several GPUs comes out as slow as one GPU would be.

    - Prefill is compute-bound: 2 FLOP per parameter per token, so tokens/s scale with
      1 / parameters.
    - Attention adds 4 x layers x attention width x context FLOP per token; it matches the
      weights' 2 x parameters at a context of parameters / (2 x layers x width), so the
      8B's 30,000 scales by that ratio.
    - A decode step is memory-bound: it reads every weight once (bf16), so its time scales
      with the parameters (the 8B's 6 ms: 16 GB at 4.8 TB/s plus a real step's overheads,
      which grow with the layers much as the weights do).
    The KV each step reads is charged apart, from the model's own KV bytes (`hbm_gbps`)."""
    s, base = _SHAPES[name], _SHAPES[DEFAULT_MODEL]
    size = s.params / base.params

    def context(shape: Shape) -> float:
        return shape.params / (shape.layers * shape.attention_width)

    return {
        "prefill_tokens_per_s": _round(reference["prefill_tokens_per_s"] / size),
        "prefill_attention_tokens": _round(
            reference["prefill_attention_tokens"] * context(s) / context(base)
        ),
        "decode_step_ms": _round(reference["decode_step_ms"] * size),
    }


def _round(x: float) -> float:
    """3 significant figures: the scaling is an estimate, and the header prints it."""
    return float(f"{x:.3g}")
