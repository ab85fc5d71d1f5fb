from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels (copy_path="kernel") run in its interpreter on CPU tensors; it
# must be on before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvoffload.transfer import TransferEngine

LAYOUTS = ("per_layer", "per_layer_hnd", "blocks_first", "cross_layer")
"""vLLM's per-layer [2, num_blocks, block_size, heads, head_size] (as a layer-name dict); the same
stored heads-first and permuted back (HND); per-layer [num_blocks, 2, ...] (block_dim=0); and one
cross-layer tensor [num_blocks, layers, 2, ...]."""


class KVCache:
    """A small KV cache filled with random non-zero bytes, and the bytes of each of its blocks."""

    def __init__(
        self,
        kind: str,
        num_blocks: int = 24,
        *,
        device: str = "cpu",
        num_layers: int = 3,
        block_size: int = 4,
        heads: int = 2,
        head_size: int = 8,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        self.kind = kind
        self.num_blocks = num_blocks
        self.gen = torch.Generator().manual_seed(seed)
        page = (block_size, heads, head_size)
        self.block_dim: int | None = None

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        if kind == "cross_layer":
            self.bases = [empty(num_blocks, num_layers, 2, *page)]
            self.views = self.bases
            self.kv_caches: object = self.bases[0]
        elif kind == "per_layer":
            self.bases = [empty(2, num_blocks, *page) for _ in range(num_layers)]
            self.views = self.bases
            self.kv_caches = {f"model.layers.{i}.attn": t for i, t in enumerate(self.bases)}
        elif kind == "per_layer_hnd":
            self.bases = [
                empty(2, num_blocks, heads, block_size, head_size) for _ in range(num_layers)
            ]
            self.views = [t.permute(0, 1, 3, 2, 4) for t in self.bases]
            self.kv_caches = self.views
        elif kind == "blocks_first":
            self.bases = [empty(num_blocks, 2, *page) for _ in range(num_layers)]
            self.views = self.bases
            self.kv_caches = self.bases
            self.block_dim = 0
        else:
            raise AssertionError(kind)
        self.randomize()

    def randomize(self) -> None:
        for t in self.bases:
            flat = t.view(torch.uint8).view(-1)
            fresh = torch.randint(1, 256, flat.shape, dtype=torch.uint8, generator=self.gen)
            flat.copy_(fresh.to(flat.device))

    def block(self, b: int) -> torch.Tensor:
        """The bytes of GPU block `b` over all layers, on the CPU."""
        first = self.kind in ("cross_layer", "blocks_first")
        parts = [v[b] if first else v[:, b] for v in self.views]
        return torch.cat([p.contiguous().view(torch.uint8).reshape(-1).cpu() for p in parts])

    def blocks(self, ids: list[int] | range) -> dict[int, torch.Tensor]:
        return {b: self.block(b) for b in ids}

    def engine(self, **kwargs: object) -> TransferEngine:
        return TransferEngine(self.kv_caches, block_dim=self.block_dim, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def make_cache():
    return KVCache


@pytest.fixture(params=LAYOUTS)
def kind(request):
    """Runs a test once per layout in LAYOUTS."""
    return request.param


@pytest.fixture
def fail_second_copy(monkeypatch):
    """Makes an engine's second job raise inside its copy, after the copies it queued."""

    def install(engine):
        real = engine._execute
        calls = []

        def copy_then_fail_second_job(plan, direction):
            calls.append(plan)
            real(plan, direction)
            if len(calls) == 2:
                raise RuntimeError("injected failure inside the copy")

        monkeypatch.setattr(engine, "_execute", copy_then_fail_second_job)

    return install
