"""Start-up and the plumbing around the steps: configuration errors, tensor-parallel result
counting, stats and Prometheus counters."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from prom_recorder import Recorder
from rig import make_rig, prompt
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput

from kvoffload import ConfigError, NotSupportedError
from kvoffload.scheduler import KVGroup
from kvoffload.tiers.redis import KIND as REDIS
from kvoffload.vllm import KVOffloadConnector, KVOffloadStats
from kvoffload.vllm.connector.metadata import KVOffloadWorkerMetadata
from kvoffload.vllm.connector.settings import ConnectorSettings
from kvoffload.vllm.connector.worker_side import block_dim_of

NODES = REDIS.report.key


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"cpu_bytes_to_use": None}, "cpu_bytes_to_use is required"),
        ({"cpu_bytes_to_use": -5}, r"cpu_bytes_to_use=-5 \(int\) is invalid"),
        ({"block_size": 10}, "block_size=10 is invalid: expected a multiple of the GPU block"),
        ({"eviction_policy": "fifo"}, "eviction_policy='fifo' is invalid: expected one of lru"),
        ({"offload_prompt_only": "yes"}, "offload_prompt_only='yes'"),
        ({"tokens_per_block": 16}, "tokens_per_block comes from vLLM's --block-size"),
        ({"cpu_bytes_to_use": 100}, "cpu_bytes_to_use=100 holds no chunk"),
        ({"cpu_bytes_to_use": 2**62}, "cpu_bytes_to_use=4611686018427387904 makes .* chunks"),
        (
            {"self_describing_kv_events": "true"},
            "self_describing_kv_events='true' is invalid; allowed: true or false",
        ),
    ],
)
def test_bad_config_stops_start_up_naming_the_key(model_dir, extra, match):
    with pytest.raises(ConfigError, match=match):
        make_rig(model_dir, extra=extra)


def _groups(*specs: object) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],  # type: ignore[arg-type]
    )


_FULL = {"num_kv_heads": 2, "head_size": 32, "dtype": torch.float16}


def _mamba(**kw: object) -> MambaSpec:
    return MambaSpec(block_size=4, shapes=((4, 8),), dtypes=(torch.float16,), **kw)  # type: ignore[arg-type]


def test_hybrid_groups_are_planned_as_vllm_plans_them(model_dir):
    rig = make_rig(model_dir)
    config = _groups(
        SlidingWindowSpec(block_size=4, sliding_window=20, **_FULL),
        FullAttentionSpec(block_size=4, **_FULL),
        ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=32, **_FULL),
        _mamba(mamba_cache_mode="align"),
    )
    settings = ConnectorSettings.from_vllm(rig.vllm_config, config)
    assert settings.groups == (
        KVGroup("sliding", 20),
        KVGroup("full"),
        KVGroup("chunked_local", 32),
        KVGroup("mamba"),
    )
    assert settings.group_layers == (("l0",), ("l1",), ("l2",), ("l3",))


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        (
            (FullAttentionSpec(block_size=4, **_FULL), _mamba()),
            r"group 1 \(MambaSpec\) has mamba_cache_mode='none'.* only in 'align' mode",
        ),
        (
            (FullAttentionSpec(block_size=4, **_FULL), _mamba(mamba_cache_mode="all")),
            r"group 1 \(MambaSpec\) has mamba_cache_mode='all'",
        ),
        (
            (
                _mamba(mamba_cache_mode="align", num_speculative_blocks=2),
                FullAttentionSpec(block_size=4, **_FULL),
            ),
            r"group 0 \(MambaSpec\) holds speculative-decoding states "
            r"\(num_speculative_blocks=2",
        ),
        (
            (_mamba(mamba_cache_mode="align"), _mamba(mamba_cache_mode="align")),
            "only Mamba groups",
        ),
        (
            (FullAttentionSpec(block_size=4, **_FULL), FullAttentionSpec(block_size=8, **_FULL)),
            r"block sizes \[4, 8\]",
        ),
    ],
)
def test_a_hybrid_model_we_cannot_offload_is_refused_naming_its_group(model_dir, specs, match):
    rig = make_rig(model_dir)
    with pytest.raises(NotSupportedError, match=match):
        ConnectorSettings.from_vllm(rig.vllm_config, _groups(*specs))


def test_hashes_finer_than_a_block_are_refused_for_a_hybrid_model(model_dir):
    """vLLM's `prefix_match_unit` can hash a hybrid model's prompts every few tokens: a chunk's
    key would then name the tokens of a smaller prefix than its blocks hold."""
    rig = make_rig(model_dir)
    config = _groups(
        FullAttentionSpec(block_size=4, **_FULL),
        SlidingWindowSpec(block_size=4, sliding_window=20, **_FULL),
    )
    config.hash_block_size = 2
    with pytest.raises(NotSupportedError, match=r"hashes prompts every 2 tokens.*4-token blocks"):
        ConnectorSettings.from_vllm(rig.vllm_config, config)
    config.hash_block_size = 4
    assert len(ConnectorSettings.from_vllm(rig.vllm_config, config).groups) == 2


def test_a_shared_tier_is_refused_for_a_hybrid_model(model_dir):
    rig = make_rig(model_dir)
    tier = {"type": "RedisTier", "url": "redis://127.0.0.1:1/0", "namespace": "m@1"}
    rig.vllm_config.kv_transfer_config.kv_connector_extra_config["secondary_tiers"] = [tier]
    config = _groups(
        SlidingWindowSpec(block_size=4, sliding_window=20, **_FULL),
        FullAttentionSpec(block_size=4, **_FULL),
    )
    with pytest.raises(NotSupportedError, match="secondary_tiers is not supported for hybrid"):
        ConnectorSettings.from_vllm(rig.vllm_config, config)


def test_tier_is_split_over_workers(model_dir):
    rig = make_rig(model_dir, cpu_chunks=40)
    settings = rig.connector._sched().settings
    assert settings.num_slots == 40
    rig.vllm_config.parallel_config.tensor_parallel_size = 2
    rig.vllm_config.parallel_config.world_size = 2
    tp2 = ConnectorSettings.from_vllm(rig.vllm_config, rig.scheduler.kv_cache_config)
    # Each worker copies its shard; cpu_bytes_to_use is the total, so half the chunks fit.
    assert (tp2.world_size, tp2.num_slots) == (2, 20)


def test_a_job_completes_once_every_worker_reported_it(model_dir):
    rig = make_rig(model_dir)
    side = rig.connector._sched()
    rig.add("a", prompt(1, 24), 1)
    so = rig.scheduler.schedule()
    (job,) = so.kv_connector_metadata.stores
    side.settings = type(side.settings)(**{**side.settings.__dict__, "world_size": 2})
    one = KVOffloadWorkerMetadata({job.job_id: (1, True)})
    side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=one))
    assert side.scheduler.jobs_in_flight == [job.job_id]
    other = KVOffloadWorkerMetadata({job.job_id: (1, False)})
    both = one.aggregate(other)
    assert both.results == {job.job_id: (2, False)}
    side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=other))
    assert side.scheduler.jobs_in_flight == []
    assert side.scheduler.stats().store_failures == 1  # one worker failed: the chunks are dropped


def test_block_dim_of_vllm_layouts():
    assert block_dim_of(torch.empty(64, 2, 4, 2, 8), 64) == 0
    assert block_dim_of(torch.empty(2, 64, 4, 2, 8), 64) == 1
    with pytest.raises(ValueError, match=r"shape \(2, 3, 64\) has no dimension of num_blocks=64"):
        block_dim_of(torch.empty(2, 3, 64), 64)


def test_stats_aggregate_and_rebuild():
    a = KVOffloadStats(data={"hit_tokens": 24, "chunks_loaded": 2})
    b = KVOffloadConnector.build_kv_connector_stats({"hit_tokens": 12, "store_refusals": 1})
    assert isinstance(b, KVOffloadStats)
    assert a.aggregate(b).reduce() == {"hit_tokens": 36, "chunks_loaded": 2, "store_refusals": 1}
    assert KVOffloadStats(data={"hit_tokens": 0}).is_empty()


def test_prometheus_counters(model_dir):
    rig = make_rig(model_dir)
    types = Recorder.reset()
    prom = KVOffloadConnector.build_prom_metrics(
        rig.vllm_config, types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    prom.observe({"hit_tokens": 48, "bytes_loaded": 1024, "lookups": 0})
    prom.observe({"hit_tokens": 12})
    assert Recorder.made["vllm:kvoffload_hit_tokens"].values == {("tiny", "0"): 60}
    assert Recorder.made["vllm:kvoffload_bytes_loaded"].values == {("tiny", "0"): 1024}
    assert Recorder.made["vllm:kvoffload_lookups"].values == {}
    # Gauges hold the latest value: the CPU tier's usable bytes as its pool is pinned.
    prom.observe({"cpu_tier_usable_bytes": 1 << 20, "cpu_tier_ready_ratio": 0.25})
    prom.observe({"cpu_tier_usable_bytes": 4 << 20, "cpu_tier_ready_ratio": 1.0})
    assert Recorder.made["vllm:kvoffload_cpu_tier_usable_bytes"].values == {("tiny", "0"): 4 << 20}
    assert Recorder.made["vllm:kvoffload_cpu_tier_ready_ratio"].values == {("tiny", "0"): 1.0}


def test_worker_reports_of_the_shared_tier_aggregate_per_key_and_by_sum():
    one = KVOffloadWorkerMetadata(
        promoted={7: (1, bytes([1, 0, 1]))}, cascaded={3: (1, 4, bytes([1, 1, 1, 1]))}
    )
    other = KVOffloadWorkerMetadata(
        promoted={7: (1, bytes([1, 1, 0]))}, cascaded={3: (1, 2, bytes([0, 1, 1, 0]))}
    )
    both = one.aggregate(other)
    assert both.promoted == {7: (2, bytes([1, 0, 0]))}  # filled only where both filled it
    # Shards written add up; a chunk is in the tier only where every writer put its shard.
    assert both.cascaded == {3: (2, 6, bytes([0, 1, 1, 0]))}
    alone = KVOffloadWorkerMetadata(cascaded={5: (1, 1, bytes([1]))})
    assert one.aggregate(alone).cascaded == {3: (1, 4, bytes([1, 1, 1, 1])), 5: (1, 1, b"\x01")}


def test_per_node_reports_of_several_workers_merge_by_sum_and_largest_resting():
    one = KVOffloadStats(data={NODES: {"h:1": {"bytes_read": 10, "failures": 0, "resting": 1}}})
    other = KVOffloadStats(
        data={
            NODES: {
                "h:1": {"bytes_read": 5, "failures": 2, "resting": 0},
                "h:2": {"bytes_read": 7, "failures": 0, "resting": 0},
            }
        }
    )
    merged = one.aggregate(other)
    assert merged.data[NODES] == {
        "h:1": {"bytes_read": 15, "failures": 2, "resting": 1},
        "h:2": {"bytes_read": 7, "failures": 0, "resting": 0},
    }
    assert NODES not in merged.reduce()  # the log line keeps the engine's totals


@pytest.mark.parametrize(
    ("replicated", "shards", "shard_of", "writers"),
    [
        (False, 4, [0, 1, 2, 3], [0, 1, 2, 3]),
        # MLA at TP 2 x PP 2: ranks are pp * 2 + tp; each stage's TP rank 0 writes its shard.
        (True, 2, [0, 0, 1, 1], [0, 2]),
    ],
)
def test_shards_of_a_tp2_pp2_engine(model_dir, replicated, shards, shard_of, writers):
    base = make_rig(model_dir).connector._sched().settings
    settings = dataclasses.replace(base, world_size=4, tp_size=2, replicated=replicated)
    assert settings.num_shards == shards
    assert [settings.shard_of(r) for r in range(4)] == shard_of
    assert [r for r in range(4) if settings.writes_shard(r)] == writers
