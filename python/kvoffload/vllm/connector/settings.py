"""The connector's settings from vLLM's configs, computed the same way in the scheduler and in
every worker so that both agree on the number of CPU-tier slots."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload.errors import ConfigError, NotSupportedError
from kvoffload.scheduler import KVGroup, OffloadConfig
from kvoffload.scheduler.trace_recorder import TraceRecording
from kvoffload.tiers import TierIdentity, TierSettings, parse_entries
from kvoffload.vllm.pinning import Pinning

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectorSettings:
    config: OffloadConfig
    world_size: int
    """Workers (tensor x pipeline parallel ranks); each copies its own shard of every chunk."""
    worker_block_bytes: int
    """Bytes of one GPU block on one worker, all layers."""
    num_slots: int
    enable_events: bool
    self_describing_events: bool = False
    """`self_describing_kv_events` with vLLM's KV events on: per vLLM block, with tokens and
    parent, for every tier (see the docs' Routers page)."""
    group_specs: tuple[tuple[str | None, int | None], ...] = ()
    """Per KV-cache group, vLLM's spec kind and sliding window as its KV events name them."""
    tiers: tuple[TierSettings, ...] = ()
    """The secondary tiers behind the CPU tier (`secondary_tiers`), in lookup order."""
    pinning: Pinning = field(default_factory=Pinning)
    """How each worker prepares its CPU pool (`pin_in_background` and its companions)."""
    groups: tuple[KVGroup, ...] = (KVGroup(),)
    """The model's KV-cache groups, in vLLM's group order (hybrid models have several)."""
    retention_interval: int | None = 0
    """vLLM's `prefix_cache_retention_interval`: where sliding-window groups keep a hit's KV."""
    group_layers: tuple[tuple[str, ...], ...] = ()
    """Each group's layer names (a worker copies a group's blocks only in its layers)."""
    tp_size: int = 1
    record_trace: TraceRecording | None = None
    """`record_trace` and its companions: the scheduler writes the traffic it served."""
    dp_index: int = 0
    dp_size: int = 1
    """This engine's data-parallel replica and their number (each records a file of its own)."""
    replicated: bool = False
    """Every TP rank of a pipeline stage holds the same KV bytes (MLA's one latent vector per
    token): in a secondary tier a chunk has one shard per stage, written by the stage's TP rank
    0 and read by all of its ranks."""

    @property
    def hybrid(self) -> bool:
        return self.groups != (KVGroup(),)

    @property
    def chunk_bytes(self) -> int:
        """One chunk on one worker: a CPU slot, and one shard in a secondary tier."""
        return self.worker_block_bytes * self.config.blocks_per_chunk

    @property
    def bytes_per_chunk(self) -> int:
        """One chunk over all workers: what `cpu_bytes_to_use` is divided by."""
        return self.worker_block_bytes * self.config.blocks_per_chunk * self.world_size

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> ConnectorSettings:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_sliding_window as sliding_window

        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # vLLM builds connectors only when it is set
        groups = kv_cache_config.kv_cache_groups
        kv_groups = kv_groups_of(kv_cache_config)
        spec = groups[0].kv_cache_spec
        extra = dict(transfer.kv_connector_extra_config or {})
        raw_tiers = extra.pop("secondary_tiers", None)
        self_describing = self_describing_events(extra, vllm_config.kv_events_config)
        extra.pop("self_describing_kv_events", None)
        entries = [] if raw_tiers is None else parse_entries(raw_tiers)
        if entries and len(kv_groups) > 1:
            raise NotSupportedError(
                f"secondary_tiers is not supported for hybrid models yet (this one has "
                f"{len(kv_groups)} KV-cache groups); remove it to offload to the CPU tier only"
            )
        pinning = Pinning.from_extra(extra)
        record_trace = TraceRecording.from_extra(extra)
        if "tokens_per_block" in extra:
            raise ConfigError(
                "tokens_per_block comes from vLLM's --block-size; remove it from "
                "kv_connector_extra_config"
            )
        config = OffloadConfig.from_dict({**extra, "tokens_per_block": spec.block_size})
        if kv_cache_config.kv_cache_tensors and kv_cache_config.num_blocks:
            # Every KVCacheTensor places its layers in the same backing allocation, whose whole
            # size each of them carries (vLLM's OffloadingConnector reads it the same way).
            block_bytes = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
        else:
            block_bytes = spec.page_size_bytes * len(groups[0].layer_names)
        world_size = vllm_config.parallel_config.world_size
        bytes_per_chunk = block_bytes * config.blocks_per_chunk * world_size
        events = vllm_config.kv_events_config
        enable_events = bool(events is not None and events.enable_kv_cache_events)
        replicated = False
        tiers: tuple[TierSettings, ...] = ()
        if entries:
            parallel = vllm_config.parallel_config
            cp = (parallel.prefill_context_parallel_size, parallel.decode_context_parallel_size)
            if cp != (1, 1):
                # Context-parallel ranks hold other tokens' KV under the same TP rank: their
                # shards would meet under one key.
                raise NotSupportedError(
                    "secondary_tiers is not supported with context parallelism "
                    f"(prefill_context_parallel_size={cp[0]}, "
                    f"decode_context_parallel_size={cp[1]}); allowed: 1 and 1"
                )
            # At TP 1 nothing is split: the layout (and so the digest) stays as it was.
            replicated = _replicated(spec) and parallel.tensor_parallel_size > 1
            layout = f"kvoffload-pool/{vllm_config.cache_config.kv_cache_layout or 'default'}"
            if replicated:
                # One shard per stage, not per rank: never met by a per-rank engine's keys.
                layout += "/replicated"
            tiers = tuple(
                TierSettings(
                    kind,
                    tier_config,
                    locality,
                    TierIdentity(
                        namespace=tier_config.namespace,
                        model=vllm_config.model_config.model,
                        kv_dtype=str(getattr(spec, "dtype", vllm_config.model_config.dtype)),
                        tokens_per_block=spec.block_size,
                        blocks_per_chunk=config.blocks_per_chunk,
                        layers=tuple(groups[0].layer_names),
                        tp_size=parallel.tensor_parallel_size,
                        pp_size=parallel.pipeline_parallel_size,
                        rank=0,
                        bytes_per_chunk=block_bytes * config.blocks_per_chunk,
                        # A slot holds, per segment (a layer's K or V, or a whole cross-layer
                        # block), the chunk's pages block after block: not vLLM's tiering region
                        # layout.
                        layout=layout,
                    ),
                )
                for kind, tier_config, locality in entries
            )
        settings = cls(
            config=config,
            world_size=world_size,
            worker_block_bytes=block_bytes,
            num_slots=config.num_slots(bytes_per_chunk),
            enable_events=enable_events,
            self_describing_events=enable_events and self_describing,
            group_specs=tuple(
                (get_kv_cache_spec_kind(g.kv_cache_spec).value, sliding_window(g.kv_cache_spec))
                for g in groups
            ),
            tiers=tiers,
            pinning=pinning,
            groups=kv_groups,
            retention_interval=vllm_config.cache_config.prefix_cache_retention_interval,
            group_layers=tuple(tuple(g.layer_names) for g in groups),
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            record_trace=record_trace,
            dp_index=vllm_config.parallel_config.data_parallel_index,
            dp_size=vllm_config.parallel_config.data_parallel_size,
            replicated=replicated,
        )
        for i, tier in enumerate(settings.tiers):
            why = tier.kind.check_shards(tier.config, settings.num_shards, settings.chunk_bytes)
            if why is not None:
                raise ConfigError(f"secondary_tiers[{i}] {why}")
        return settings

    @property
    def num_shards(self) -> int:
        """Shards of one chunk in a secondary tier: one per worker, or per stage if
        replicated."""
        return self.world_size // self.tp_size if self.replicated else self.world_size

    def shard_of(self, rank: int) -> int:
        """The shard worker `rank` reads (its pipeline stage's, if replicated)."""
        return rank // self.tp_size if self.replicated else rank

    def writes_shard(self, rank: int) -> bool:
        """Whether worker `rank` writes its shard (one TP rank per stage, if replicated)."""
        return not self.replicated or rank % self.tp_size == 0


def _replicated(spec: object) -> bool:
    """MLA keeps one latent vector per token, the same on every TP rank (vLLM's MLA spec)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return all(isinstance(s, MLAAttentionSpec) for s in spec.kv_cache_specs.values())
    return isinstance(spec, MLAAttentionSpec)


def kv_groups_of(kv_cache_config: KVCacheConfig) -> tuple[KVGroup, ...]:
    """vLLM's KV-cache groups as the scheduler plans them, or NotSupportedError naming the
    group that cannot be offloaded."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        RSWASpec,
        SinkFullAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise NotSupportedError("this model has no KV cache: there is nothing to offload")
    out: list[KVGroup] = []
    sizes = set()
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        sizes.add(spec.block_size)
        if not getattr(spec, "prefix_cacheable", True):
            raise NotSupportedError(
                f"KV-cache group {index} ({type(spec).__name__}) is not prefix-cacheable: "
                "KVOffloadConnector offloads only groups the GPU prefix cache can reuse"
            )
        eagle = bool(getattr(group, "is_eagle_group", False))
        kind = type(spec).__name__
        if isinstance(spec, SlidingWindowSpec):
            out.append(
                KVGroup("sliding", spec.sliding_window, spec.extra_retained_tokens, eagle=eagle)
            )
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            out.append(KVGroup("chunked_local", spec.attention_chunk_size, eagle=eagle))
        elif isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                raise NotSupportedError(
                    f"KV-cache group {index} (MambaSpec) has mamba_cache_mode="
                    f"{spec.mamba_cache_mode!r}: KVOffloadConnector offloads Mamba states only in "
                    "'align' mode (--enable-prefix-caching --mamba-cache-mode align)"
                )
            if eagle or spec.num_speculative_blocks:
                raise NotSupportedError(
                    f"KV-cache group {index} (MambaSpec) holds speculative-decoding states "
                    f"(num_speculative_blocks={spec.num_speculative_blocks}, EAGLE group: "
                    f"{eagle}): KVOffloadConnector does not offload them yet"
                )
            out.append(KVGroup("mamba"))
        elif isinstance(spec, FullAttentionSpec) and not isinstance(
            # RSWA frees gap blocks while a request runs, which only window groups may do here.
            spec,
            (SinkFullAttentionSpec, CrossAttentionSpec, RSWASpec),
        ):
            out.append(KVGroup(eagle=eagle))
        else:
            raise NotSupportedError(
                f"KV-cache group {index} ({kind}) cannot be offloaded by KVOffloadConnector; "
                "supported: full, sliding-window and chunked-local attention, and Mamba in "
                "'align' mode. Use vLLM's OffloadingConnector for this model"
            )
    if len(sizes) > 1:
        raise NotSupportedError(
            f"the KV-cache groups have block sizes {sorted(sizes)}: KVOffloadConnector needs "
            "one block size for all groups"
        )
    if all(g.kind == "mamba" for g in out):
        raise NotSupportedError(
            "this model has only Mamba groups: KVOffloadConnector offloads Mamba states beside "
            "attention layers; use vLLM's OffloadingConnector for it"
        )
    hash_size = getattr(kv_cache_config, "hash_block_size", None)
    if len(groups) > 1 and hash_size not in (None, *sizes):
        # A chunk's key is the hash of its last block: finer hashes would name other tokens.
        raise NotSupportedError(
            f"vLLM hashes prompts every {hash_size} tokens (prefix_match_unit), finer than the "
            f"{sizes.pop()}-token blocks: KVOffloadConnector needs one hash per block; unset "
            "prefix_match_unit"
        )
    return tuple(out)


def self_describing_events(extra: Mapping[str, Any], events: Any) -> bool:
    """`self_describing_kv_events` from `kv_connector_extra_config` (both seams read it), or a
    `ConfigError`. `events` (vLLM's `KVEventsConfig`, or its offloading config, which says the
    same): with vLLM's KV events off nothing is published, which is worth a warning."""
    value = extra.get("self_describing_kv_events", False)
    if type(value) is not bool:
        raise ConfigError(f"self_describing_kv_events={value!r} is invalid; allowed: true or false")
    if value and not (events is not None and events.enable_kv_cache_events):
        logger.warning(
            "kvoffload: self_describing_kv_events is on but vLLM's KV events are off "
            "(--kv-events-config '{\"enable_kv_cache_events\": true, ...}'): nothing is published"
        )
    return bool(value)
