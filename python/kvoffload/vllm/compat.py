"""What differs between the vLLM versions kvoffload supports (0.32 and 0.33), in one place.

Each difference is settled by what the code can see (a field, a name), never by comparing version
strings; the one version check is `check_version`, at import, which turns away versions never
tried with a line naming the supported range. So this module imports nothing from vLLM at the top
but its version: names other versions may lack are imported where they are used.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import vllm
from kvoffload.errors import NotSupportedError

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_offload.base import OffloadingEvent, OffloadKey
    from vllm.v1.kv_offload.config import OffloadingConfig

SUPPORTED = ">=0.32,<0.34"
_SUPPORTED_MINORS = ((0, 32), (0, 33))

# vLLM 0.33 names the label of its per-tier series; 0.32 spells it out.
TIER_LABEL = "tier"

# The labels of one `vllm:kv_offload_config_info` series (vLLM 0.33; 0.32 has no such metric).
ConfigInfoMapping = Mapping[str, "str | int | float | bool"]


def check_version(version: str | None = None) -> None:
    """Stops start-up, with one line, on a vLLM that kvoffload was never run with."""
    version = vllm.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) not in _SUPPORTED_MINORS:
        raise NotSupportedError(
            f"kvoffload supports vLLM {SUPPORTED}; this environment has vLLM {version}"
        )


def request_blocks(
    scheduler_output: SchedulerOutput,
) -> Iterator[tuple[str, Any, bool]]:
    """(request id, block ids per group, whether that is the request's whole table) for every
    request scheduled in a step.

    A new request, and one resumed after preemption, is handed its whole table; a running one
    only the blocks added in this step. vLLM's own `yield_req_data` yields the same pairs, but
    its third value means "preempted" in 0.32 and "whole table" in 0.33: read either way on the
    other version, a new request's table is appended to itself. So it is derived here from the
    fields both versions fill alike.
    """
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, new.block_ids, True
    cached = scheduler_output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    for rid, groups in zip(cached.req_ids, cached.new_block_ids, strict=True):
        yield rid, groups, rid in resumed


def failed_store_event(keys: list[OffloadKey]) -> OffloadingEvent | None:
    """The event a store that failed leaves: on 0.33 a metadata-only release, on 0.32 none (as
    vLLM's own CPU manager there)."""
    from vllm.v1.kv_offload.base import Medium, OffloadingEvent

    if "metadata_only" not in {f.name for f in fields(OffloadingEvent)}:
        return None
    return OffloadingEvent(keys, Medium.CPU, removed=True, metadata_only=True)


def _cpu_info() -> Any:
    """vLLM 0.33's `CPUOffloadingInfo`, or None on 0.32 (which has no info metric)."""
    try:
        from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
    except ImportError:
        return None
    return CPUOffloadingInfo


def cpu_config_info_keys() -> tuple[str, ...]:
    """The labels vLLM 0.33's CPU tier publishes on its info metric (none on 0.32)."""
    info = _cpu_info()
    return () if info is None else tuple(info.config_info_keys())


def cpu_config_info(
    config: OffloadingConfig, num_chunks: int, bytes_per_chunk: int
) -> ConfigInfoMapping:
    """Those labels' values, as vLLM 0.33's CPU spec fills them."""
    info = _cpu_info()
    if info is None:
        return {}
    mapping: ConfigInfoMapping = info.from_config(
        config, num_chunks, bytes_per_chunk
    ).as_config_info()
    return mapping
