"""KV bytes per token of common models (bf16 KV, all layers, K and V)."""

from __future__ import annotations

# name: (layers, KV heads, head size)
_SHAPES = {
    "llama-3-8b": (32, 8, 128),
    "llama-3-70b": (80, 8, 128),
    "llama-3.1-405b": (126, 8, 128),
    "qwen3-8b": (36, 8, 128),
    "qwen3-32b": (64, 8, 128),
    "mistral-7b": (32, 8, 128),
}

MODELS: dict[str, int] = {
    name: layers * 2 * heads * head_size * 2 for name, (layers, heads, head_size) in _SHAPES.items()
}
DEFAULT_MODEL = "llama-3-8b"
