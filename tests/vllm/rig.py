"""vLLM 0.33's real `Scheduler` / `AsyncScheduler` with a connector, driven offline on the CPU.

The scheduler half is built by vLLM's scheduler, the worker half by vLLM's connector factory over
CPU tensors standing in for the GPU KV cache. A fake model runner calls the worker hooks in the
model runner's per-step order, and its forward pass writes into every layer, for each computed
position, values derived from that position's token prefix. Before each forward pass it checks,
byte for byte, every position the request claims to have (local prefix, loaded or computed
earlier): a wrong or missing load fails the step.

GPU block size 4 tokens, 12-token chunks (3 blocks), 2 layers; block ids are vLLM's own.

`geometry="full+swa"` builds a hybrid model the way vLLM plans one with its hybrid KV-cache
manager on: 4 layers, 0 and 2 sliding-window (group 0), 1 and 3 full attention (group 1), each
layer of one group sharing its memory with one of the other. `"full+swa+draft"` adds two EAGLE
draft layers, which vLLM groups with the full-attention ones (groups 1 and 2, both EAGLE
groups). The fake forward pass then checks, per group, what that group's attention reads: every
earlier position for full attention, the last `window - 1` for a sliding window, those of the
current attention chunk for chunked-local attention (`geometry="full+local"`). With
`geometry="full+mamba"` layers 0 and 2 are Mamba layers ("align" mode, group 0, a 768-byte state
padded to the attention page): the fake runner keeps each request's state in one block as vLLM's
does (`_run_states`) and checks the state each step reads.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_config_from_groups,
)
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.vllm.connector import worker_side
from vllm import SamplingParams

TPB = 4  # tokens per GPU block
BPC = 3  # GPU blocks per chunk
TPC = TPB * BPC
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 32
EOS = 999
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
# One GPU block, all layers: K and V, 4 tokens, 2 heads of 32 fp16 values.
BLOCK_BYTES = 2 * TPB * NUM_KV_HEADS * HEAD_SIZE * 2 * NUM_LAYERS

init_none_hash(sha256)


def write_model_dir(path: str) -> str:
    """A model directory holding only a tiny Llama config.json (no weights, no tokenizer)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": NUM_KV_HEADS * HEAD_SIZE,
        "intermediate_size": 32,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_KV_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "vocab_size": 1000,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": EOS,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def next_token(prefix: list[int]) -> int:
    """The fake model's greedy choice: a function of the prefix, so equal prefixes continue
    equally."""
    return (prefix[-1] * 7 + len(prefix) * 13) % 900 + 10


def kv_value(prefix_hash: int, layer: int) -> int:
    return (prefix_hash + layer * 7919) % 30011


def prefix_hashes(tokens: list[int]) -> list[int]:
    out, h = [], 17
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
        out.append(h)
    return out


@dataclass
class StoreRecord:
    step: int
    request_id: str
    job_id: int
    block_offsets: list[int]
    """Positions of the job's GPU blocks in the request's block table."""


@dataclass
class LoadRecord:
    """A load job, whichever seam issued it."""

    request_id: str
    gpu_block_ids: list[int]
    first_chunk: int
    skip_leading_blocks: int
    num_tokens: int
    """Tokens the load writes (its GPU blocks)."""


@dataclass
class Rig:
    scheduler: Scheduler
    worker: Any
    kv_caches: dict[str, torch.Tensor]
    vllm_config: VllmConfig
    is_async: bool
    tpb: int = TPB
    verify: bool = True
    """Write and check KV for every position (off only in benchmarks, where it dominates)."""
    spec_decode_order: bool = False
    """Collect the worker's results before `wait_for_save`, as vLLM's runners do with
    speculative decoding (they finalize after the drafter)."""
    tokens: dict[str, list[int]] = field(default_factory=dict)
    step: int = 0
    bpc: int = BPC
    stores: list[StoreRecord] = field(default_factory=list)
    loads: list[LoadRecord] = field(default_factory=list)
    metas: list[Any] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    external_hits: dict[str, int] = field(default_factory=dict)
    """Tokens vLLM reports as loaded by the connector, per request (its prefill stats)."""
    local_hits: dict[str, int] = field(default_factory=dict)
    """Tokens vLLM reports found in its GPU prefix cache, per request."""
    finished_sending: list[tuple[int, set[str]]] = field(default_factory=list)
    connector_stats: list[dict[str, Any]] = field(default_factory=list)
    """The connector's stats in each step's scheduler stats (workers' and scheduler's, merged by
    vLLM), as its stat loggers and Prometheus receive them."""
    scheduled: list[dict[str, int]] = field(default_factory=list)
    checked_positions: dict[str, int] = field(default_factory=dict)
    before_worker: Callable[[Rig, SchedulerOutput], None] | None = None
    layer_groups: list[list[int]] = field(default_factory=lambda: [list(range(NUM_LAYERS))])
    """Per KV-cache group, the indices (into `kv_caches`) of its layers."""
    attends: list[tuple[str, int]] = field(default_factory=lambda: [("full", 0)])
    """Per group, what its attention reads: ("full", 0), ("sliding", window),
    ("chunked_local", attention chunk) or ("mamba", 0) (one state)."""
    _state_block: dict[str, int] = field(default_factory=dict)
    """Per request, the block index its Mamba state was left in (the runner's
    `mamba_state_idx`)."""
    stored_keys: list[bytes] = field(default_factory=list)
    """Every key a store job wrote, in job order, whichever seam."""
    loaded_keys: dict[str, list[bytes]] = field(default_factory=dict)
    _pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    _tables: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    ranks: list[tuple[Any, dict[str, torch.Tensor], int]] = field(default_factory=list)
    """With tensor parallelism (`make_rig(tp=...)`): per TP rank, its worker, its KV caches and
    the salt of its values (0 on every rank where the KV is replicated, as with MLA)."""
    _aggregator: KVOutputAggregator | None = None

    def __post_init__(self) -> None:
        if not self.ranks:
            self.ranks = [(self.worker, self.kv_caches, 0)]
        if len(self.ranks) > 1:
            self._aggregator = KVOutputAggregator(len(self.ranks))

    @property
    def mamba_groups(self) -> list[int]:
        return [g for g, (kind, _) in enumerate(self.attends) if kind == "mamba"]

    # --- requests -------------------------------------------------------------------------------

    def add(
        self, rid: str, prompt: list[int], max_tokens: int, params: Any = None, **sp: Any
    ) -> Request:
        extra = None if params is None else {"kv_transfer_params": params}
        sampling = SamplingParams(max_tokens=max_tokens, extra_args=extra, ignore_eos=True, **sp)
        sampling.update_from_generation_config({}, EOS)
        request = Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=sampling,
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.tpb, sha256),
        )
        self.tokens[rid] = list(prompt)
        self.outputs[rid] = []
        self.scheduler.add_request(request)
        return request

    def run(self, max_steps: int = 200) -> None:
        """Steps until nothing is left to do (async: one step's output applied late)."""
        for _ in range(max_steps):
            if not self.step_once():
                return
        raise AssertionError(f"still running after {max_steps} steps")

    def step_once(self) -> bool:
        """One engine step; False when nothing was left to do."""
        if not self.scheduler.has_requests():
            if self._pending is None:
                return False
            self._apply(*self._pending)
            self._pending = None
            return True
        so = self.scheduler.schedule()
        mro = self._execute(so)
        if self.is_async:
            if self._pending is not None:
                self._apply(*self._pending)
            self._pending = (so, mro)
        else:
            self._apply(so, mro)
        return True

    def reset_gpu_prefix_cache(self) -> None:
        assert self.scheduler.reset_prefix_cache()
        for _, caches, _ in self.ranks:
            for t in caches.values():
                t.zero_()

    def offsets_stored(self, rid: str) -> set[int]:
        return {o for s in self.stores if s.request_id == rid for o in s.block_offsets}

    def load_of(self, rid: str) -> LoadRecord | None:
        loads = [job for job in self.loads if job.request_id == rid]
        assert len(loads) <= 1, loads
        return loads[0] if loads else None

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def flushed_job_ids(self, meta: Any) -> set[int]:
        """The jobs a step's metadata tells the workers to wait for, whichever seam."""
        if hasattr(meta, "flush_job_ids"):
            return set(meta.flush_job_ids)
        return set(meta.jobs_to_flush or ())

    def cpu_store(self) -> Any:
        """Our `CpuStore` behind either seam."""
        c = self.connector
        if hasattr(c, "connector_scheduler"):
            return c.connector_scheduler.manager.store
        return c._sched().scheduler.store

    def engine(self) -> Any:
        """Our worker's `TransferEngine` behind either seam."""
        w = self.worker
        if hasattr(w, "connector_worker"):
            return w.connector_worker.worker.engine
        return w._worker().engine

    # --- one engine step -----------------------------------------------------------------------

    def _apply(self, so: SchedulerOutput, mro: ModelRunnerOutput) -> None:
        out = self.scheduler.update_from_output(so, mro)
        for eco in out.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.connector_stats.append(stats.kv_connector_stats)
            for o in eco.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.prefill_stats is not None:
                    self.external_hits[o.request_id] = o.prefill_stats.num_external_cached_tokens
                    self.local_hits[o.request_id] = o.prefill_stats.num_local_cached_tokens

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.step += 1
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        self._record(so, meta)
        if self.before_worker is not None:
            self.before_worker(self, so)
        workers = [w for w, _, _ in self.ranks]
        for w in workers:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                w.start_load_kv(None)
        req_ids, sampled = self._forward(so)
        outputs = [self._worker_output(w, so, req_ids, sampled) for w in workers]
        if self._aggregator is None:
            mro = outputs[0]
        else:  # vLLM's own merge of its workers' outputs
            mro = self._aggregator.aggregate(outputs)
        kv_out = mro.kv_connector_output
        if kv_out is not None and kv_out.finished_sending:
            self.finished_sending.append((self.step, set(kv_out.finished_sending)))
        return mro

    def _worker_output(
        self, w: Any, so: SchedulerOutput, req_ids: list[str], sampled: list[list[int]]
    ) -> ModelRunnerOutput:
        """One worker's half of a step after the forward pass, in the model runner's order."""
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        if not self.spec_decode_order:
            w.wait_for_save()
        results = w.get_transfer_results(so.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        if self.spec_decode_order:
            w.wait_for_save()
        w.clear_connector_metadata()
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def _record(self, so: SchedulerOutput, meta: Any) -> None:
        self.scheduled.append(dict(so.num_scheduled_tokens))
        if hasattr(meta, "stores"):  # KVOffloadConnector
            stores = [(j.request_id, j.job_id, j.gpu_block_ids) for j in meta.stores]
            self.stored_keys.extend(k for j in meta.stores for k in j.keys)
            for job in meta.loads:
                self.loaded_keys.setdefault(job.request_id, []).extend(job.keys)
                self.loads.append(
                    LoadRecord(
                        job.request_id,
                        [int(b) for b in job.gpu_block_ids],
                        job.first_chunk,
                        job.skip_leading_blocks,
                        job.num_tokens,
                    )
                )
        else:  # vLLM's OffloadingConnector
            stores = [(j.req_id, i, j.src_spec.block_ids) for i, j in meta.store_jobs.items()]
            jobs = self.connector.connector_scheduler._jobs
            self.stored_keys.extend(k for i in meta.store_jobs for k in sorted(jobs[i].keys))
            for i, job in meta.load_jobs.items():
                self.loaded_keys.setdefault(job.req_id, []).extend(sorted(jobs[i].keys))
                first = job.dst_spec.block_indices[-1]
                ids = [int(b) for b in job.dst_spec.block_ids]
                self.loads.append(
                    LoadRecord(
                        job.req_id, ids, first // self.bpc, first % self.bpc, len(ids) * self.tpb
                    )
                )
        if len(self.layer_groups) > 1:
            return  # block offsets are recorded for one-group models only
        for rid, job_id, blocks in stores:
            (table,) = self._tables_of(rid)
            self.stores.append(
                StoreRecord(self.step, rid, job_id, [table.index(int(b)) for b in blocks])
            )

    def _tables_of(self, rid: str) -> tuple[list[int], ...]:
        """The request's block tables, one per group; for a finished request (vLLM may still
        hold its blocks for a store), the last ones it had."""
        tables = tuple(map(list, self.scheduler.kv_cache_manager.get_block_ids(rid)))
        if any(tables):
            self._tables[rid] = tables
        return self._tables[rid]

    def _table(self, rid: str) -> list[int]:
        return self._tables_of(rid)[0]

    def _forward(self, so: SchedulerOutput) -> tuple[list[str], list[list[int]]]:
        req_ids, sampled = [], []
        if self.mamba_groups:
            # The runner forgets where these requests' states were (`cleanup_mamba_state_idx`).
            for rid in (
                *so.finished_req_ids,
                *(so.preempted_req_ids or ()),
                *so.scheduled_cached_reqs.resumed_req_ids,
            ):
                self._state_block.pop(rid, None)
        for rid, n in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            # The scheduler has already advanced num_computed_tokens by this step's tokens.
            start = request.num_computed_tokens - n
            tokens = self.tokens[rid]
            if self.verify:
                tables = self._tables_of(rid)
                hashes = prefix_hashes(tokens)
                self._check(rid, tables, hashes, start)
                for pos in range(start, start + n):
                    self._write(tables, pos, hashes[pos])
                if self.mamba_groups:
                    self._run_states(rid, tables, hashes, start, start + n)
            req_ids.append(rid)
            if start + n >= len(tokens):
                tok = next_token(tokens)
                tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return req_ids, sampled

    def _slot(self, t: torch.Tensor, table: list[int], pos: int) -> torch.Tensor:
        return t[table[pos // self.tpb], :, pos % self.tpb].view(torch.int16)

    def _run_states(
        self, rid: str, tables: tuple[list[int], ...], hashes: list[int], start: int, end: int
    ) -> None:
        """A Mamba group as vLLM's runner keeps it in "align" mode (`preprocess_mamba`): the
        state after `start` tokens is read from the block it was left in (for a new or resumed
        request, block `(start - 1) // block_size`: a prefix hit's), copied to block
        `cdiv(end, block_size) - 1`, and the step leaves the state after `end` tokens there."""
        layers = list(self.kv_caches.values())
        tpb = self.tpb
        prev = self._state_block.get(rid, (start - 1) // tpb)
        curr = -(-end // tpb) - 1
        self._state_block[rid] = curr
        for g in self.mamba_groups:
            table = tables[g]
            assert table[curr] != 0, (
                f"request {rid}: the state after {end} tokens is in the null block"
            )
            for layer in self.layer_groups[g]:
                state = layers[layer]
                if start:
                    got = state[table[prev]].view(torch.int16)
                    want = kv_value(hashes[start - 1], layer)
                    if table[prev] == 0 or not bool((got == want).all()):
                        raise AssertionError(
                            f"step {self.step}: request {rid} reads the state after {start} "
                            f"tokens from block {table[prev]} (index {prev}, group {g}), layer "
                            f"{layer}: it holds another"
                        )
                state[table[curr]].view(torch.int16).fill_(kv_value(hashes[end - 1], layer))

    def _write(self, tables: tuple[list[int], ...], pos: int, h: int) -> None:
        for _, caches, salt in self.ranks:
            layers = list(caches.values())
            for g, (table, members) in enumerate(zip(tables, self.layer_groups, strict=True)):
                if g in self.mamba_groups:
                    continue
                assert table[pos // self.tpb] != 0, f"position {pos} computed into the null block"
                for layer in members:
                    self._slot(layers[layer], table, pos).fill_(kv_value(h, layer + salt))

    def _check(self, rid: str, tables: tuple[list[int], ...], hashes: list[int], upto: int) -> None:
        """What each group's attention reads before computing position `upto`: every earlier
        position, or a sliding window's last `window - 1`."""
        for rank, (_, caches, salt) in enumerate(self.ranks):
            layers = list(caches.values())
            for g, (table, members) in enumerate(zip(tables, self.layer_groups, strict=True)):
                kind, size = self.attends[g]
                if kind == "mamba":
                    continue  # `_run_states`
                first = 0
                if kind == "sliding":
                    first = max(0, upto - (size - 1))
                elif kind == "chunked_local":
                    first = upto // size * size
                for pos in range(first, upto):
                    for layer in members:
                        got = self._slot(layers[layer], table, pos)
                        want = kv_value(hashes[pos], layer + salt)
                        if not bool((got == want).all()):
                            raise AssertionError(
                                f"step {self.step}: request {rid} position {pos} (group {g}, "
                                f"block {table[pos // self.tpb]}) layer {layer} of TP rank "
                                f"{rank} holds wrong KV"
                            )
        self.checked_positions[rid] = max(self.checked_positions.get(rid, 0), upto)


def make_rig(
    model_dir: str,
    *,
    is_async: bool = False,
    extra: dict[str, Any] | None = None,
    cpu_chunks: int = 64,
    num_gpu_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    connector: str = "kvoffload",
    enable_events: bool = False,
    kv_events: KVEventsConfig | None = None,
    tokens_per_block: int = TPB,
    chunk_tokens: int = TPC,
    verify: bool = True,
    vllm_worker: Callable[..., Any] | None = None,
    max_model_len: int = 2048,
    geometry: str = "full",
    window: int = 20,
    retention_interval: int | None = 0,
    tp: int = 1,
    mla: bool = False,
) -> Rig:
    """A scheduler and one worker with `connector`: "kvoffload" (ours), "spec" (vLLM's
    OffloadingConnector with our KVOffloadSpec: our manager and copy worker), or "vllm" (vLLM's
    OffloadingConnector with its CPU spec; `vllm_worker(canonical_kv_caches, spec)` stands in
    for its CUDA-only copy worker).

    `tp`: that many workers (our connector only), one per TP rank, each with KV caches of its
    own holding values of its own; vLLM's `KVOutputAggregator` merges their outputs. `mla`: the
    group is vLLM's `MLAAttentionSpec` (one 128-wide latent vector per token: the same bytes per
    block as the 2 x 2 x 32 K/V layout, which the tensors keep), and every rank holds the same
    values, as MLA's replicated latent cache does."""
    tpb = tokens_per_block
    page_bytes = 2 * tpb * NUM_KV_HEADS * HEAD_SIZE * 2
    # One block of each group shares its memory with the other groups' (vLLM's hybrid layout).
    chunk_bytes = page_bytes * NUM_LAYERS * (chunk_tokens // tpb)
    extra_config: dict[str, Any] = {
        "cpu_bytes_to_use": cpu_chunks * chunk_bytes,
        "block_size": chunk_tokens,
    }
    extra_config.update(extra or {})
    if connector == "kvoffload":
        transfer = KVTransferConfig(
            kv_connector="KVOffloadConnector",
            kv_connector_module_path="kvoffload.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra_config,
            kv_load_failure_policy="recompute",
        )
    else:
        if connector == "spec":
            extra_config.update(spec_name="KVOffloadSpec", spec_module_path="kvoffload.vllm")
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra_config,
            kv_load_failure_policy="recompute",
        )
    model = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        dtype="float16",
        seed=0,
        max_model_len=max_model_len,
    )
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=model.max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=is_async,
        ),
        cache_config=CacheConfig(
            block_size=tpb,
            enable_prefix_caching=True,
            prefix_cache_retention_interval=retention_interval,
        ),
        kv_transfer_config=transfer,
        kv_events_config=kv_events
        or (
            KVEventsConfig(enable_kv_cache_events=True, publisher="null") if enable_events else None
        ),
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.scheduler_config.async_scheduling = is_async
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    if geometry != "full":
        return _hybrid_rig(
            vllm_config, geometry, window, num_gpu_blocks, connector, vllm_worker, is_async, verify
        )
    if tp > 1:
        assert connector == "kvoffload", "one worker per TP rank is built for our connector"
        vllm_config.parallel_config.tensor_parallel_size = tp
        vllm_config.parallel_config.world_size = tp
    spec: FullAttentionSpec = FullAttentionSpec(
        block_size=tpb, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float16
    )
    if mla:
        spec = MLAAttentionSpec(
            block_size=tpb,
            num_kv_heads=1,
            head_size=2 * NUM_KV_HEADS * HEAD_SIZE,
            dtype=torch.float16,
        )
    assert spec.page_size_bytes == page_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=num_gpu_blocks,
        # One backing allocation, layer after layer, as vLLM describes it.
        kv_cache_tensors=[
            KVCacheTensor(
                size=page_bytes * num_gpu_blocks * NUM_LAYERS,
                layers=list(LAYERS),
                layer_stride=page_bytes * num_gpu_blocks,
                block_stride=page_bytes,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )
    ranks = []
    for rank in range(tp):
        kv_caches = {
            name: torch.zeros(
                (num_gpu_blocks, 2, tpb, NUM_KV_HEADS, HEAD_SIZE), dtype=torch.float16
            )
            for name in LAYERS
        }
        with _as_rank(rank):
            worker = _worker(vllm_config, kv_cache_config, kv_caches, connector, vllm_worker)
        ranks.append((worker, kv_caches, 0 if mla else 100 * rank))
    scheduler = _scheduler(vllm_config, kv_cache_config, is_async, [w for w, _, _ in ranks])
    bpc = chunk_tokens // tpb
    worker, kv_caches, _ = ranks[0]
    return Rig(
        scheduler,
        worker,
        kv_caches,
        vllm_config,
        is_async,
        tpb=tpb,
        verify=verify,
        bpc=bpc,
        ranks=ranks,
    )


@contextlib.contextmanager
def _as_rank(rank: int) -> Iterator[None]:
    """Builds a worker that says it is TP rank `rank`: vLLM's parallel state, where a real
    worker reads it, needs torch.distributed."""
    saved = worker_side.worker_rank
    worker_side.worker_rank = lambda: rank
    try:
        yield
    finally:
        worker_side.worker_rank = saved


def _scheduler(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, is_async: bool, workers: list[Any]
) -> Any:
    """Built after the workers have registered their KV caches, then given their handshake
    metadata before the first step, as vLLM's EngineCore does."""
    cls = AsyncScheduler if is_async else Scheduler
    scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        log_stats=True,
    )
    # EngineCore._set_kv_connector_handshake_metadata: keyed by (pp_rank, tp_rank).
    metadata = {(0, tp): w.get_handshake_metadata() for tp, w in enumerate(workers)}
    if all(m is not None for m in metadata.values()):
        scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware(metadata)
    return scheduler


def _worker(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    kv_caches: dict[str, torch.Tensor],
    connector: str,
    vllm_worker: Callable[..., Any] | None,
) -> Any:
    """The worker half built by vLLM's connector factory, with `kv_caches` registered."""
    worker = KVConnectorFactory.create_connector(
        config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
    )
    if connector == "vllm":
        assert vllm_worker is not None, "vLLM's own copy worker needs CUDA: pass vllm_worker"
        spec = worker.connector_worker.spec
        spec.get_worker = lambda canonical: vllm_worker(canonical, spec)
    with set_current_vllm_config(vllm_config):
        worker.register_kv_caches(kv_caches)
    return worker


def _hybrid_specs(geometry: str, tpb: int, window: int) -> dict[str, KVCacheSpec]:
    args = {"block_size": tpb, "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE}
    specs: dict[str, KVCacheSpec] = {}
    for i in range(NUM_LAYERS * 2):
        name = f"model.layers.{i}.self_attn.attn"
        if i % 2:
            specs[name] = FullAttentionSpec(**args, dtype=torch.float16)
        elif geometry == "full+mamba":
            specs[f"model.layers.{i}.mixer"] = _mamba_spec(tpb)
        elif geometry == "full+local":
            specs[name] = ChunkedLocalAttentionSpec(
                **args, dtype=torch.float16, attention_chunk_size=window
            )
        else:
            specs[name] = SlidingWindowSpec(**args, dtype=torch.float16, sliding_window=window)
    if geometry == "full+swa+draft":
        for i in range(NUM_LAYERS):
            specs[f"drafter.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                **args, dtype=torch.float16, is_draft=True
            )
    elif geometry not in ("full+swa", "full+local", "full+mamba"):
        raise ValueError(
            f"geometry={geometry!r}; allowed: full, full+swa, full+swa+draft, full+local, "
            "full+mamba"
        )
    return specs


MAMBA_SHAPES = ((4, 32), (8, 32))
"""A Mamba layer's per-block state (conv, ssm), fp16: 768 bytes, padded to an attention page."""
MAMBA_STATE_BYTES = sum(a * b for a, b in MAMBA_SHAPES) * 2


def _mamba_spec(tpb: int) -> MambaSpec:
    page = 2 * tpb * NUM_KV_HEADS * HEAD_SIZE * 2
    return MambaSpec(
        block_size=tpb,
        shapes=MAMBA_SHAPES,
        dtypes=(torch.float16, torch.float16),
        page_size_padded=page,
        mamba_cache_mode="align",
    )


def _hybrid_rig(
    vllm_config: VllmConfig,
    geometry: str,
    window: int,
    num_gpu_blocks: int,
    connector: str,
    vllm_worker: Callable[..., Any] | None,
    is_async: bool,
    verify: bool,
) -> Rig:
    """The hybrid KV-cache manager on (as `VllmConfig` sets it on a GPU), vLLM's own planner
    grouping the layers and placing them in one allocation, and per-layer views of it."""
    tpb = vllm_config.cache_config.block_size
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    if geometry == "full+mamba":
        vllm_config.cache_config.mamba_cache_mode = "align"
    specs = _hybrid_specs(geometry, tpb, window)
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    for group in groups:
        # What vLLM's planner marks when EAGLE drops its volatile block (speculative decoding).
        group.is_eagle_group = any(specs[name].is_draft for name in group.layer_names)
    page = next(iter(specs.values())).page_size_bytes
    per_block = page * max(len(g.layer_names) for g in groups)
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, groups, per_block * num_gpu_blocks
    )
    assert kv_cache_config.num_blocks == num_gpu_blocks, kv_cache_config
    raw = torch.zeros(kv_cache_config.kv_cache_tensors[0].size, dtype=torch.uint8)
    views: dict[str, torch.Tensor] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        assert tensor.block_stride == page
        for i, name in enumerate(tensor.layers):
            start = tensor.offset + i * tensor.layer_stride
            region = raw[start : start + num_gpu_blocks * page]
            if isinstance(specs[name], MambaSpec):
                views[name] = _mamba_view(region, num_gpu_blocks, page)
            else:
                views[name] = region.view(torch.float16).view(
                    num_gpu_blocks, 2, tpb, NUM_KV_HEADS, HEAD_SIZE
                )
    kv_caches = {name: views[name] for name in specs}
    names = list(specs)
    layer_groups = [
        [names.index(n) for n in g.layer_names] for g in kv_cache_config.kv_cache_groups
    ]
    attends = [_attended(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
    worker = _worker(vllm_config, kv_cache_config, kv_caches, connector, vllm_worker)
    scheduler = _scheduler(vllm_config, kv_cache_config, is_async, [worker])
    bpc = vllm_config.kv_transfer_config.kv_connector_extra_config["block_size"] // tpb
    return Rig(
        scheduler,
        worker,
        kv_caches,
        vllm_config,
        is_async,
        tpb=tpb,
        verify=verify,
        bpc=bpc,
        layer_groups=layer_groups,
        attends=attends,
    )


def _mamba_view(region: torch.Tensor, num_blocks: int, page: int) -> torch.Tensor:
    """A Mamba layer's cache as vLLM's runner views it: `[num_blocks, 1, 1, state bytes]`, the
    page (padded to an attention page) as its block stride."""
    state = MAMBA_STATE_BYTES
    return region.as_strided((num_blocks, 1, 1, state), (page, state, state, 1))


def _attended(spec: KVCacheSpec) -> tuple[str, int]:
    if isinstance(spec, MambaSpec):
        return ("mamba", 0)
    if isinstance(spec, SlidingWindowSpec):
        return ("sliding", spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ("chunked_local", spec.attention_chunk_size)
    return ("full", 0)


class NoCopyWorker(OffloadingWorker):
    """Stands in for vLLM's CUDA-only CPU offloading worker: completes each job at once."""

    def __init__(self, canonical: Any, spec: Any) -> None:
        self._done: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._done.append(TransferResult(job_id, True, 0, 0.0))
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        self._done.append(TransferResult(job_id, True, 0, 0.0))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return


def stored_chunks(rig: Rig) -> int:
    """Chunks the scheduler side sent to be stored, whichever connector."""
    total = 0
    for meta in rig.metas:
        if hasattr(meta, "stores"):
            total += sum(len(job.slots) for job in meta.stores)
        else:
            total += sum(len(job.dst_spec.block_ids) for job in meta.store_jobs.values())
    return total


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 17) % 800 + 100 for i in range(n)]


def expected_outputs(tokens: list[int], n: int) -> list[int]:
    tokens = list(tokens)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[-n:]


class Stall:
    """Holds back the worker engine's finished results while `on` (the copies themselves are
    synchronous on the CPU): jobs stay in flight as long as a test needs."""

    def __init__(self, rig) -> None:
        self.on = True
        engine = rig.engine()
        self._get_finished = engine.get_finished
        self._held = []
        engine.get_finished = self

    def __call__(self):
        self._held.extend(self._get_finished())
        if self.on:
            return []
        out, self._held = self._held, []
        return out
