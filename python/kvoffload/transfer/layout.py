"""GPU KV-cache layouts: which bytes of the cache make up one GPU block.

A layout is a list of *segments*. A segment holds one fixed-size page per GPU block (for vLLM's
per-layer `[2, num_blocks, ...]` tensors: the K or the V half of one layer; for a cross-layer
tensor: the whole block), so a GPU block is `num_segments` pages. Pages are moved as raw bytes in
memory order, which is what lets one engine serve any dtype and any stride order (e.g. vLLM's HND
layouts) as long as each page is one dense piece of memory.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeAlias

import torch

KVCaches: TypeAlias = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
"""One cross-layer tensor, or per-layer tensors (a list, or vLLM's layer-name -> tensor dict)."""

# Raw bytes are moved as the widest integer type every offset and size divides: index kernels and
# copies then touch 8x fewer elements than with bytes.
_UNITS = (torch.int64, torch.int32, torch.int16, torch.uint8)


class KVCacheLayout:
    """The segments of a GPU KV cache, each viewed as `[num_blocks, page_units]` raw units.

    `kv_caches` is either one cross-layer tensor (`block_dim` defaults to 0: its first dimension
    is `num_blocks` and one block is one contiguous page), or per-layer tensors of identical
    shape, dtype and device (`block_dim` defaults to 1, vLLM's
    `[2, num_blocks, block_size, num_kv_heads, head_size]`; pass 0 for `[num_blocks, ...]` layouts
    such as MLA or FlashInfer). Each index of the dimensions before `block_dim` is one segment;
    the dimensions after it form the page, which must be dense in memory (any dimension order).
    Tensors on `cpu` stand in for a GPU cache (CPU mode).

    Each segment remembers its tensor's name (`segment_names`): the key of a mapping, the index
    of a sequence as a str, "0" for one tensor; `segments_of` and `segments_of_tensors` find a
    part of the cache by it (e.g. one KV-cache group's layers, see `JobPart.segments`).
    """

    def __init__(self, kv_caches: KVCaches, *, block_dim: int | None = None) -> None:
        named = _named_tensors(kv_caches)
        if block_dim is None:
            block_dim = 0 if isinstance(kv_caches, torch.Tensor) else 1
        _, first_name, first = named[0]
        if type(block_dim) is not int or not 0 <= block_dim < first.dim():
            raise ValueError(
                f"block_dim={block_dim!r} is not a dimension of {first_name} "
                f"(shape {tuple(first.shape)}); allowed: 0..{first.dim() - 1}"
            )
        for _, name, t in named[1:]:
            if (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device} but "
                    f"{first_name} has shape {tuple(first.shape)}, dtype {first.dtype}, device "
                    f"{first.device}; all layers must match"
                )
        if first.device.type not in ("cuda", "cpu"):
            raise ValueError(
                f"kv_caches are on device {first.device}; allowed: cuda, or cpu for CPU mode"
            )
        self.device: torch.device = first.device
        self.num_blocks: int = int(first.shape[block_dim])
        elem = first.element_size()
        self.page_bytes: int = math.prod(first.shape[block_dim + 1 :]) * elem
        """Bytes of one block in one segment."""
        if self.num_blocks == 0 or self.page_bytes == 0:
            raise ValueError(
                f"{first_name} has shape {tuple(first.shape)}: with block_dim={block_dim} that is "
                f"{self.num_blocks} blocks of {self.page_bytes} bytes; both must be positive"
            )

        # (tensor, byte offset of block 0, bytes between consecutive blocks) per segment
        raw: list[tuple[torch.Tensor, int, int]] = []
        self.segment_names: list[str] = []
        """Per segment the name of its tensor (see the class docstring)."""
        self._segment_ptrs: list[int] = []
        for key, name, t in named:
            _check_dense_page(name, t, block_dim)
            block_stride = t.stride(block_dim) * elem
            if self.num_blocks > 1 and block_stride < self.page_bytes:
                raise ValueError(
                    f"{name} (shape {tuple(t.shape)}, strides {t.stride()}): the pages of "
                    f"consecutive blocks overlap"
                )
            outer = [range(n) for n in t.shape[:block_dim]]
            for index in itertools.product(*outer):
                offset = t.storage_offset() + sum(i * t.stride(d) for d, i in enumerate(index))
                raw.append((t, int(offset) * elem, block_stride))
                self.segment_names.append(key)
                self._segment_ptrs.append(t.data_ptr())

        align = math.gcd(
            self.page_bytes,
            *(off for _, off, _ in raw),
            *(t.untyped_storage().data_ptr() for t, _, _ in raw),
        )
        if self.num_blocks > 1:
            align = math.gcd(align, *(stride for _, _, stride in raw))
        self.unit: torch.dtype = next(u for u in _UNITS if align % u.itemsize == 0)
        self.unit_bytes: int = self.unit.itemsize
        self.page_units: int = self.page_bytes // self.unit_bytes
        self.segments: list[torch.Tensor] = []
        """Per segment a `[num_blocks, page_units]` view (rows strided, each row dense)."""
        for t, offset, stride in raw:
            view = torch.empty(0, dtype=self.unit, device=self.device)
            view.set_(
                t.untyped_storage(),
                offset // self.unit_bytes,
                (self.num_blocks, self.page_units),
                (stride // self.unit_bytes, 1),
            )
            self.segments.append(view)

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def block_bytes(self) -> int:
        """Bytes of one GPU block over all segments."""
        return self.num_segments * self.page_bytes

    def chunk_bytes(self, blocks_per_chunk: int) -> int:
        """Bytes of one chunk, i.e. of one slot of the CPU pool."""
        return blocks_per_chunk * self.block_bytes

    def segments_of(self, names: Iterable[str]) -> list[int]:
        """The indices of the segments of the named tensors (see `segment_names`), in layout
        order; raises `ValueError` naming a name that is not one of them."""
        if isinstance(names, str):
            raise TypeError(f"names must be an iterable of names, got the str {names!r}")
        wanted = set(names)
        unknown = wanted.difference(self.segment_names)
        if unknown:
            raise ValueError(
                f"{sorted(map(repr, unknown))[0]} is not a tensor of this layout; its tensors "
                f"are {', '.join(dict.fromkeys(self.segment_names))}"
            )
        return [i for i, name in enumerate(self.segment_names) if name in wanted]

    def segments_of_tensors(self, tensors: Iterable[torch.Tensor]) -> list[int]:
        """The indices of the segments of `tensors`, in layout order. A tensor is matched by the
        address of its first element (`data_ptr()`), not by identity: any view that starts where
        a tensor of the layout starts finds that tensor's segments, e.g. the tensor vLLM
        registers for a layer that shares the memory of another, registered one. Raises
        `ValueError` for a tensor that starts where none of the layout's does."""
        wanted = {t.data_ptr() for t in tensors}
        unknown = wanted.difference(self._segment_ptrs)
        if unknown:
            raise ValueError(
                f"a tensor starting at {min(unknown):#x} is not one of this layout's; they start "
                f"at {', '.join(f'{p:#x}' for p in dict.fromkeys(self._segment_ptrs))}"
            )
        return [i for i, ptr in enumerate(self._segment_ptrs) if ptr in wanted]

    def __repr__(self) -> str:
        return (
            f"KVCacheLayout(device={self.device}, num_blocks={self.num_blocks}, "
            f"segments={self.num_segments}, page_bytes={self.page_bytes}, unit={self.unit})"
        )


def _named_tensors(kv_caches: KVCaches) -> list[tuple[str, str, torch.Tensor]]:
    """(name, what errors call it, tensor) per tensor."""
    if isinstance(kv_caches, torch.Tensor):
        named = [("0", "kv_caches", kv_caches)]
    elif isinstance(kv_caches, Mapping):
        named = [(str(name), f"kv_caches[{name!r}]", t) for name, t in kv_caches.items()]
    elif isinstance(kv_caches, Sequence):
        named = [(str(i), f"kv_caches[{i}]", t) for i, t in enumerate(kv_caches)]
    else:
        raise TypeError(
            f"kv_caches is a {type(kv_caches).__name__}; allowed: a tensor, a sequence of "
            f"tensors or a mapping of layer name to tensor"
        )
    if not named:
        raise ValueError("kv_caches is empty; at least one tensor is needed")
    for _, name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} is a {type(t).__name__}, not a torch.Tensor")
    return named


def _check_dense_page(name: str, t: torch.Tensor, block_dim: int) -> None:
    """The dimensions after `block_dim` must tile one dense piece of memory, in some order."""
    dims = sorted(
        (t.stride(d), t.shape[d]) for d in range(block_dim + 1, t.dim()) if t.shape[d] != 1
    )
    expected = 1
    for stride, size in dims:
        if stride != expected:
            raise ValueError(
                f"{name} (shape {tuple(t.shape)}, strides {t.stride()}): the page of one block "
                f"(dimensions after block_dim={block_dim}) is not dense in memory"
            )
        expected *= size
