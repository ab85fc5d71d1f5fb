"""How the CPU pool is prepared, for both seams: the `pin_in_background`, `pin_piece_bytes` and
`numa_node` options, the GPU's NUMA node, and a `TransferEngine` built with them."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvoffload.errors import ConfigError
from kvoffload.sizes import size_value
from kvoffload.transfer import TransferEngine
from kvoffload.transfer.pool import MAX_PIECE_BYTES, NumaBindError

logger = logging.getLogger(__name__)

KEYS = ("pin_in_background", "pin_piece_bytes", "numa_node")

FIRST_PIECE_WAIT_S = 1.0
"""How long a worker's `register_kv_caches` waits for the first piece of a pool prepared in the
background: the tier is then not empty at the first step (whole, for a pool of one piece), and
start-up still does not grow with the pool."""


@dataclass(frozen=True)
class Pinning:
    in_background: bool = True
    """Serve at once and grow the CPU tier as its pool is pinned, piece by piece."""
    piece_bytes: int = 1 << 30
    numa_node: int | str | None = "auto"
    """The node the pool is placed on; "auto": the GPU's (when sysfs tells it); None: any."""

    @classmethod
    def from_extra(cls, extra: dict[str, Any], *, background_default: bool = True) -> Pinning:
        """Takes the options out of `kv_connector_extra_config` (a copy), each checked."""
        in_background = extra.pop("pin_in_background", background_default)
        if type(in_background) is not bool:
            raise ConfigError(
                f"pin_in_background={in_background!r} ({type(in_background).__name__}) is "
                "invalid: expected true or false"
            )
        piece_bytes = size_value("pin_piece_bytes", extra.pop("pin_piece_bytes", 1 << 30))
        if type(piece_bytes) is not int or not 0 < piece_bytes <= MAX_PIECE_BYTES:
            raise ConfigError(
                f"pin_piece_bytes={piece_bytes!r} ({type(piece_bytes).__name__}) is invalid: "
                f"expected an int in 1..{MAX_PIECE_BYTES}"
            )
        numa_node = extra.pop("numa_node", "auto")
        if numa_node in ("none", None):
            numa_node = None
        elif numa_node != "auto" and (type(numa_node) is not int or not 0 <= numa_node < 1024):
            raise ConfigError(
                f"numa_node={numa_node!r} ({type(numa_node).__name__}) is invalid: expected an "
                'int in 0..1023, "auto" (the GPU\'s node) or "none"'
            )
        return cls(in_background, piece_bytes, numa_node)

    def engine(self, device: torch.device, build: Callable[..., TransferEngine]) -> TransferEngine:
        """`build(pin_piece_bytes=..., pin_in_background=..., numa_node=...)`, with the node
        resolved; the GPU's node ("auto") is dropped with one warning if the kernel refuses it,
        a configured one stops start-up."""
        node, auto = self._node(device)
        options = {"pin_piece_bytes": self.piece_bytes, "pin_in_background": self.in_background}
        try:
            engine = build(**options, numa_node=node)
        except NumaBindError as exc:
            if not auto:
                raise ConfigError(str(exc)) from exc
            # The GPU's node was only a preference: a pool placed anywhere still serves.
            logger.warning(
                "kvoffload: the CPU pool is not placed on the GPU's NUMA node %s (%s)", node, exc
            )
            engine = build(**options, numa_node=None)
        if self.in_background:
            _wait_first_piece(engine)
        return engine

    def _node(self, device: torch.device) -> tuple[int | None, bool]:
        node = self.numa_node
        auto = node == "auto"
        if auto:
            node = gpu_numa_node(device)
            how = "the GPU's node" if node is not None else "none: the GPU's node is not known"
        elif node is None:
            how = "configured: none"
        else:
            how = "configured"
            if not os.path.isdir(f"/sys/devices/system/node/node{node}"):
                raise ConfigError(
                    f"numa_node={node} is invalid: this machine has no such node; allowed: one of "
                    '/sys/devices/system/node, "auto" (the GPU\'s node) or "none"'
                )
        logger.info("kvoffload: CPU pool NUMA binding: %s (%s)", node, how)
        assert node is None or isinstance(node, int)
        return node, auto


def _wait_first_piece(engine: TransferEngine) -> None:
    pool = engine.pool
    if pool.wait_first_piece(FIRST_PIECE_WAIT_S):
        logger.info(
            "kvoffload: the CPU pool's first piece (%d of %d slots) was ready after %.2f s",
            pool.usable_slots,
            pool.num_slots,
            pool.first_piece_s or 0.0,
        )
    elif pool.first_piece_pending:  # else it failed, and the pool said so
        logger.warning(
            "kvoffload: the CPU pool's first piece is not ready after %.1f s: the CPU tier starts "
            "empty (the engine serves from the GPU alone) and grows as its pieces are ready",
            FIRST_PIECE_WAIT_S,
        )


def gpu_numa_node(device: torch.device) -> int | None:
    """The NUMA node of a CUDA device as sysfs tells it, or None (CPU mode, no sysfs entry, or
    -1: a machine without NUMA)."""
    if device.type != "cuda":
        return None
    props: Any = torch.cuda.get_device_properties(device)  # its stub lacks the PCI fields
    bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    try:
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None
