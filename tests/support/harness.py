"""The real vLLM scheduler and both roles of a KV connector in one process, with fake CPU KV tensors.

No model runs: the worker-side connector transfers real bytes between the KV tensors and a real LMCache MP
server, and the harness plays the model runner (one sampled token per request once its prompt is computed).
The KV tensors are allocated by vLLM's own ``get_kv_cache_config_from_groups`` + ``allocate_kv_cache``, so a
*hybrid* config (FullAttention + ``MambaSpec(mamba_cache_mode="align")``) overlays both groups on the same
bytes, as in a real engine, and its recurrent block tables contain the null block; so do the window group's tables
of a *sliding* config (FullAttention + ``SlidingWindowSpec``, window :data:`SLIDING_WINDOW`), whose blocks vLLM frees
as the window passes them.

Block pages are addressed as bytes: page ``(layer, block)`` starts at ``offset + l * layer_stride + b *
block_stride`` of the allocation the connector actually registered (LMCache's CPU lmcache_driven path moves
the attention tensors into POSIX shared memory at registration; the harness follows them there).

The only fake here is the model: a GPU and real weights cannot run in a scheduler test.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

BLOCK_SIZE = 32
STOCK_CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"
NULL_SENTINEL = 0xAB
"""Byte written into every page of block 0 (vLLM's null block) so that any write to it is visible."""
SLIDING_WINDOW = 2 * BLOCK_SIZE
"""The window of the *sliding* config's window group, in tokens."""


@dataclass(frozen=True)
class HarnessConfig:
    kind: Literal["dense", "hybrid", "sliding", "windowed"] = "dense"
    """dense: one full-attention group; hybrid: + align-mode Mamba; sliding: + a sliding window; windowed: one
    sliding-window group only."""
    connector_module: str = STOCK_CONNECTOR_MODULE
    connector_name: str = "LMCacheMPConnector"
    transfer_mode: Literal["lmcache_driven", "engine_driven"] = "lmcache_driven"
    num_attention_layers: int = 2
    num_blocks: int = 48
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 8
    mq_timeout_s: float = 30.0
    routed_experts: bool = False
    """Run lmcache_r3's routed-experts path, with :class:`EmulatedRouter` standing in for the MoE routers."""
    num_speculative_tokens: int = 0
    """Speculative decoding with this many draft tokens a step (no draft model: the harness proposes the drafts
    itself, see :meth:`SchedulerHarness.drafts`). Synchronous scheduling uses vLLM's ngram method, whose drafts the
    engine hands to the scheduler; under async scheduling (an EAGLE/MTP-style drafter on the GPU) the scheduler
    schedules placeholders and the model runner fills in the drafts and corrects positions itself."""
    async_scheduling: bool = False
    """vLLM's async scheduling, its default on GPU (the CPU platform turns it off): ``AsyncScheduler``, stepped as
    ``EngineCore.step_with_batch_queue`` steps it, so step N+1 is scheduled before step N's output is processed."""
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] = "kv_both"
    extra_config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Computes:
    """What the emulated model runner computes for one request in one step."""

    start: int
    """The first position it computes."""
    end: int
    """The position after the last one."""
    drafts: tuple[int, ...]
    """The draft tokens it computes (at its last ``len(drafts)`` positions), as the runner filled them in."""
    output_index: int
    """The index (from 0) of the first output token it samples: the one after position ``end - len(drafts) - 1``."""
    samples: bool
    """Whether it samples at all (only once the prompt and every earlier output are computed)."""


class EmulatedRouter:
    """The routing a MoE model would choose, as a pure function of the token prefix (the model cannot run here).

    Like a real router, a position's experts depend on every token up to it, so a row served for the wrong
    tokens or the wrong position shows. Expert ids use the whole range ``[0, num_experts)``.
    """

    def __init__(self, num_layers: int, top_k: int, num_experts: int) -> None:
        self.shape = (num_layers, top_k)
        self.num_experts = num_experts

    def rows(self, token_ids: Sequence[int], start: int, end: int) -> np.ndarray:
        """int32 ``[end - start, num_layers, top_k]``: the routing of positions ``[start, end)``."""
        prefix = 0
        out = np.empty((end - start, *self.shape), dtype=np.int32)
        layers, top_k = self.shape
        salts = np.arange(layers * top_k, dtype=np.uint64).reshape(layers, top_k) * np.uint64(0x9E3779B97F4A7C15)
        for position in range(end):
            prefix = (prefix * 1_000_003 + int(token_ids[position]) + 1) % (1 << 61)
            if position >= start:
                mixed = (np.uint64(prefix) ^ salts) * np.uint64(0xBF58476D1CE4E5B9)
                out[position - start] = (mixed >> np.uint64(29)) % np.uint64(self.num_experts)
        return out

    def routed_experts(self, token_ids: Sequence[int], dtype: Any) -> np.ndarray:
        """What a request over ``token_ids`` must return: rows of positions ``[0, len - 1)``."""
        return self.rows(token_ids, 0, len(token_ids) - 1).astype(dtype)


def attention_spec():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    # 2 heads x 32 tokens x (32 + 32) x 4 B = 16 KiB per page
    return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32)


def mamba_spec():
    from vllm.v1.kv_cache_interface import MambaSpec

    # (4*256 + 3*1024) x 4 B = 16 KiB per page, equal to the attention page, as hybrid models require
    return MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((4, 256), (3, 1024)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
    )


def sliding_window_spec():
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=SLIDING_WINDOW
    )


def make_vllm_config(model_dir: Path, server_url_host: str, server_port: int, config: HarnessConfig):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    extra = {
        "lmcache.mp.host": server_url_host,
        "lmcache.mp.port": server_port,
        "lmcache.mp.mq_timeout": config.mq_timeout_s,
        "lmcache.mp.mp_transfer_mode": config.transfer_mode,
        "lmcache_r3.routed_experts": config.routed_experts,
        **config.extra_config,
    }
    model_config = ModelConfig(model=str(model_dir), dtype="float32", seed=42)
    parallel_config = ParallelConfig()
    speculative = {}
    if config.num_speculative_tokens:
        # vLLM refuses async scheduling with the ngram method (its drafter runs on the host, after the step); the
        # scheduler itself only sees the number of drafts. Under async scheduling the harness plays a drafter that
        # runs inside the model runner, as EAGLE, MTP and ngram_gpu do on a GPU.
        speculative["speculative_config"] = SpeculativeConfig(
            method="ngram", num_speculative_tokens=config.num_speculative_tokens, prompt_lookup_min=1,
            prompt_lookup_max=3, target_model_config=model_config, target_parallel_config=parallel_config,
        )  # fmt: skip
    vllm_config = VllmConfig(
        model_config=model_config,
        parallel_config=parallel_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector=config.connector_name,
            kv_connector_module_path=config.connector_module,
            kv_role=config.kv_role,
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
        **speculative,
    )
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    if config.async_scheduling:
        # As on GPU: two batches in flight, and vLLM defers freeing the blocks an in-flight step may still write.
        vllm_config.scheduler_config.async_scheduling = True
    if config.kind == "hybrid":
        vllm_config.cache_config.mamba_cache_mode = "align"
    return vllm_config


def make_groups(config: HarnessConfig):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    n = config.num_attention_layers
    if config.kind in ("dense", "windowed"):
        names = [f"model.layers.{i}.self_attn.attn" for i in range(n)]
        return [KVCacheGroupSpec(names, attention_spec() if config.kind == "dense" else sliding_window_spec())]
    attention = [f"model.layers.{2 * i}.self_attn.attn" for i in range(n)]
    if config.kind == "sliding":
        windowed = [f"model.layers.{2 * i + 1}.self_attn.attn" for i in range(n)]
        return [KVCacheGroupSpec(attention, attention_spec()), KVCacheGroupSpec(windowed, sliding_window_spec())]
    recurrent = [f"model.layers.{2 * i + 1}.linear_attn" for i in range(n)]
    return [KVCacheGroupSpec(attention, attention_spec()), KVCacheGroupSpec(recurrent, mamba_spec())]


def _ensure_distributed(vllm_config) -> None:
    """vLLM's process group is process-global: initialise it once (world size 1, gloo)."""
    from vllm.distributed import parallel_state

    if parallel_state._WORLD is None:  # vLLM 0.32: module-global group, None until initialised
        rendezvous = tempfile.mkdtemp(prefix="lmcache_r3-dist-")
        atexit.register(shutil.rmtree, rendezvous, ignore_errors=True)  # gloo's file store, kept until exit
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{rendezvous}/store",
            backend="gloo",
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.ensure_model_parallel_initialized(1, 1)


class PageView:
    """Byte pages ``(layer, block)`` of the KV allocation, by vLLM's ``KVCacheTensor`` placement."""

    def __init__(self, kv_cache_config, storage: torch.UntypedStorage) -> None:
        self.raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.regions: dict[str, tuple[int, int, int]] = {}
        for tensor in kv_cache_config.kv_cache_tensors:
            group = next(g for g in kv_cache_config.kv_cache_groups if tensor.layers[0] in g.layer_names)
            page = group.kv_cache_spec.page_size_bytes
            for index, name in enumerate(tensor.layers):
                self.regions[name] = (tensor.offset + index * tensor.layer_stride, tensor.block_stride, page)

    def page(self, layer: str, block: int) -> torch.Tensor:
        start, block_stride, page = self.regions[layer]
        offset = start + block * block_stride
        return self.raw[offset : offset + page]

    def distinct_pages(self, block: int) -> list[torch.Tensor]:
        """The pages of ``block`` with aliases (groups sharing bytes) counted once."""
        seen: dict[tuple[int, int], torch.Tensor] = {}
        for layer, (start, block_stride, page) in self.regions.items():
            key = (start + block * block_stride, page)
            seen.setdefault(key, self.page(layer, block))
        return list(seen.values())


class SchedulerHarness:
    """Real ``Scheduler`` (scheduler-role connector inside) + a worker-role connector, stepping together."""

    def __init__(self, model_dir: Path, server: Any, config: HarnessConfig) -> None:
        """``server``: the LMCache server (``lmcache_r3.mp.server_process``'s handle) the connector talks to."""
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        self.config = config
        self.server = server
        self.vllm_config = make_vllm_config(model_dir, f"tcp://{server.settings.host}", server.settings.port, config)
        self._config_context = set_current_vllm_config(self.vllm_config)
        self._config_context.__enter__()
        self.sampled_token = 7
        """The token every step samples, except a request's stop token (:meth:`add_request` ``stop_after``)."""
        self.stop_token = 5
        self._stop_after: dict[str, int] = {}
        self.wrong_draft = 11
        """What :meth:`drafts` proposes for every output index ``i`` with ``i % 3 == 1``: the model samples
        ``sampled_token`` there, so that draft and the ones after it are rejected."""
        self.drafts_rejected = 0
        self.positions_corrected = 0
        """Async scheduling with drafts: requests the runner computed at positions behind the scheduler's, which
        still counted drafts of a step in flight that the runner had already rejected."""
        self.steps = 0
        try:
            _ensure_distributed(self.vllm_config)
            init_none_hash(sha256)
            groups = make_groups(config)
            page = groups[0].kv_cache_spec.page_size_bytes
            per_block = page * len(groups[0].layer_names)
            self.kv_cache_config = get_kv_cache_config_from_groups(
                self.vllm_config, groups, available_memory=per_block * config.num_blocks
            )
            self.vllm_config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
            layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
            self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout)
            self._fill_random_with_null_sentinel()
            connector_cls = KVConnectorFactory.get_connector_class(self.vllm_config.kv_transfer_config)
            self.worker = connector_cls(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            self.worker.register_kv_caches(self.kv_caches)
            first_attention = self.kv_cache_config.kv_cache_groups[0].layer_names[0]
            self.pages = PageView(self.kv_cache_config, self.kv_caches[first_attention].untyped_storage())
            scheduler_class = AsyncScheduler if config.async_scheduling else Scheduler
            self.scheduler = scheduler_class(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=BLOCK_SIZE,
                log_stats=True,
            )
        except BaseException:
            self._config_context.__exit__(None, None, None)
            raise
        self.block_tables: dict[str, tuple[list[int], ...]] = {}
        """Per request, its block tables when it was first scheduled."""
        self.final_block_tables: dict[str, tuple[list[int], ...]] = {}
        """Per request, its block tables after the last step that held them."""
        self.real_blocks: dict[str, list[dict[int, int]]] = {}
        """Per request and group, block index -> the last non-null block id it ever had (align-mode Mamba
        replaces a request's older checkpoints by the null block as it advances)."""
        self.times_scheduled: Counter[str] = Counter()
        """Per request, the steps that ran it."""
        self.outputs: dict[str, Any] = {}
        """Per finished request, its ``kv_transfer_params`` as the engine returned them."""
        self.connector_stats: list[dict[str, Any]] = []
        """The connector's stats payload of every step that had one, as vLLM ships them to its stat loggers."""
        self.router: EmulatedRouter | None = None
        self._computing: dict[str, _Computes] = {}
        """Per request of the step the worker runs, what it computes (:meth:`_plan`)."""
        self._rejections_in_flight: dict[int, dict[str, int]] = {}
        """Async scheduling with drafts: per step run but not yet processed (by ``id`` of its ``SchedulerOutput``),
        the drafts it rejected per request. The scheduler has advanced those requests as if every draft was
        accepted; the model runner knows better and computes at the true positions, as vLLM's GPU runner does."""
        self._batch_queue: deque[tuple[Any, Any]] = deque()
        """Async scheduling: the steps scheduled and run whose output the scheduler has not processed yet."""
        if config.routed_experts:
            model = self.vllm_config.model_config
            self.router = EmulatedRouter(
                model.get_total_num_hidden_layers(), model.get_num_experts_per_tok(), model.get_num_experts()
            )
            self.worker.r3_step_source = self._captured_rows
        self.forward_hook: Callable[[Any], None] | None = None
        """Called with each step's ``SchedulerOutput`` between the connector's load and its save, where a model's
        forward pass reads and writes the KV (a test that emulates the model sets it; ``None``: no model)."""

    # -- KV bytes --------------------------------------------------------------------------------------------
    def _fill_random_with_null_sentinel(self) -> None:
        storage = next(iter(self.kv_caches.values())).untyped_storage()
        pages = PageView(self.kv_cache_config, storage)
        generator = torch.Generator().manual_seed(1234)
        pages.raw.copy_(torch.randint(0, 256, pages.raw.shape, dtype=torch.uint8, generator=generator))
        for page in pages.distinct_pages(self.null_block_id):
            page.fill_(NULL_SENTINEL)

    @property
    def null_block_id(self) -> int:
        return 0  # vLLM's BlockPool reserves id 0 as the null block (asserted in the smoke test)

    def null_block_changed_bytes(self) -> int:
        return sum(int((page != NULL_SENTINEL).sum()) for page in self.pages.distinct_pages(self.null_block_id))

    def zero_all_blocks_but_null(self) -> None:
        for block in range(1, self.kv_cache_config.num_blocks):
            for page in self.pages.distinct_pages(block):
                page.zero_()

    def attention_layers(self) -> list[str]:
        return list(self.kv_cache_config.kv_cache_groups[0].layer_names)

    def recurrent_layers(self) -> list[str]:
        groups = self.kv_cache_config.kv_cache_groups
        return list(groups[1].layer_names) if len(groups) > 1 else []

    def recurrent_bytes(self, blocks: Sequence[int]) -> dict[str, bytes]:
        return self._layer_bytes(self.recurrent_layers(), blocks)

    def group_bytes(self, group: int, blocks: Sequence[int]) -> dict[str, bytes]:
        """Per layer of KV cache group ``group``, the bytes of ``blocks``' pages, concatenated in order."""
        return self._layer_bytes(self.kv_cache_config.kv_cache_groups[group].layer_names, blocks)

    def attention_bytes(self, blocks: Sequence[int]) -> dict[str, bytes]:
        return self._layer_bytes(self.attention_layers(), blocks)

    def _layer_bytes(self, layers: Sequence[str], blocks: Sequence[int]) -> dict[str, bytes]:
        """Per layer, the bytes of ``blocks``' pages, concatenated in order."""
        return {layer: b"".join(bytes(self.pages.page(layer, b).numpy()) for b in blocks) for layer in layers}

    # -- requests --------------------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: Sequence[int], max_tokens: int = 4, stop_after: int | None = None):
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        stop = {} if stop_after is None else {"stop_token_ids": [self.stop_token]}
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **stop)
        params.update_from_generation_config({}, 2)
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )

    def add_request(
        self, request_id: str, prompt: Sequence[int], max_tokens: int = 4, stop_after: int | None = None
    ) -> None:
        """Queue a request; with ``stop_after``, its output token of that index (from 0) is its stop token, so it
        finishes there as on an EOS, a finish the scheduler cannot foresee (async scheduling has already scheduled
        the request's next step)."""
        if stop_after is not None:
            self._stop_after[request_id] = stop_after
        self.scheduler.add_request(self.make_request(request_id, prompt, max_tokens, stop_after))

    def sampled(self, request_id: str, index: int) -> int:
        """The token the request's output token ``index`` (from 0) is sampled as."""
        return self.stop_token if self._stop_after.get(request_id) == index else self.sampled_token

    def sequence(self, request_id: str, prompt: Sequence[int], num_outputs: int) -> list[int]:
        """The prompt and the first ``num_outputs`` tokens the request samples."""
        return list(prompt) + [self.sampled(request_id, i) for i in range(num_outputs)]

    def step(self):
        """One engine step: schedule, run the worker connector as the model runner would, feed outputs back.

        With async scheduling, as ``EngineCore.step_with_batch_queue``: a step is scheduled and run while the one
        before it is still unprocessed, and the oldest step's output is processed once two are in flight (or
        nothing more can be scheduled). The worker runs each step as it is scheduled, as a GPU would, in order.
        Returns the ``SchedulerOutput`` scheduled in this call (when none was: the one whose output it processed).
        """
        if not self.config.async_scheduling:
            out = self.scheduler.schedule()
            self._process(out, self.run_worker(out))
            return out
        out = None
        if self.scheduler.has_requests() or not self._batch_queue:  # the latter: requests only LMCache holds
            out = self.scheduler.schedule()
            self._batch_queue.appendleft((out, self.run_worker(out)))
            if len(self._batch_queue) < 2 and self.scheduler.has_requests():
                return out
        oldest, model_runner_output = self._batch_queue.pop()
        self._process(oldest, model_runner_output)
        return oldest if out is None else out

    def _process(self, out, model_runner_output) -> None:
        self._rejections_in_flight.pop(id(out), None)  # the scheduler rolls them back now
        engine_outputs = self.scheduler.update_from_output(out, model_runner_output)
        for client_outputs in engine_outputs.values():
            stats = client_outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:
                self.connector_stats.append(stats.kv_connector_stats)
            for output in client_outputs.outputs:
                if output.finish_reason is not None:
                    self.outputs[output.request_id] = output.kv_transfer_params
        self.steps += 1
        if self.config.num_speculative_tokens and not self.config.async_scheduling:
            self._propose_drafts(out)  # under async scheduling the runner drafts itself (see _plan)

    def drafts(self, request_id: str, index: int) -> list[int]:
        """The draft tokens proposed for a request's output tokens ``index, index + 1, ...``: what the model
        samples, except ``wrong_draft`` for every index ``i`` with ``i % 3 == 1``."""
        return [
            self.wrong_draft if i % 3 == 1 else self.sampled(request_id, i)
            for i in range(index, index + self.config.num_speculative_tokens)
        ]

    def _propose_drafts(self, out) -> None:
        """As vLLM's engine does after each step: drafts for the requests that step decoded."""
        from vllm.v1.outputs import DraftTokenIds

        decoding = [
            request
            for request_id in out.num_scheduled_tokens
            if (request := self.scheduler.requests.get(request_id)) is not None
            and not request.is_finished()
            and request.num_computed_tokens >= request.num_tokens - 1
        ]
        ids = [request.request_id for request in decoding]
        proposals = [self.drafts(request.request_id, request.num_output_tokens) for request in decoding]
        self.scheduler.update_draft_token_ids(DraftTokenIds(ids, proposals))

    def run_worker(self, out):
        """The model runner's part of a step: the worker connector around a forward pass; its ``ModelRunnerOutput``."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self._computing = self._plan(out)
        meta = out.kv_connector_metadata
        with set_forward_context(None, self.vllm_config):
            self.worker.handle_preemptions(meta)
            self.worker.bind_connector_metadata(meta)
            self.worker.start_load_kv(None)
            if self.forward_hook is not None:
                self.forward_hook(out)
            self.worker.wait_for_save()
            results = self.worker.get_transfer_results(out.finished_req_ids)
            connector_output = KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
            )
            self.worker.clear_connector_metadata()
        for new in out.scheduled_new_reqs:
            self.block_tables[new.req_id] = tuple(list(ids) for ids in new.block_ids)
        scheduled = list(out.num_scheduled_tokens)
        self.times_scheduled.update(scheduled)
        for request_id in scheduled:
            tables = self.scheduler.kv_cache_manager.get_block_ids(request_id)
            self.final_block_tables[request_id] = tuple(list(ids) for ids in tables)
            seen = self.real_blocks.setdefault(request_id, [{} for _ in tables])
            for group, ids in enumerate(tables):
                seen[group].update({i: b for i, b in enumerate(ids) if b != self.null_block_id})
        sampled, rejected = [], {}
        for request_id in scheduled:
            work = self._computing[request_id]
            # Each draft the model would have sampled too is accepted, and the model's own token follows the last
            # accepted one.
            tokens = [self.sampled(request_id, work.output_index + j) for j in range(len(work.drafts) + 1)]
            accepted = next((j for j, draft in enumerate(work.drafts) if draft != tokens[j]), len(work.drafts))
            if work.drafts:
                rejected[request_id] = len(work.drafts) - accepted
                self.drafts_rejected += rejected[request_id]
            sampled.append(tokens[: accepted + 1] if work.samples else [])
        if self.config.async_scheduling and any(rejected.values()):
            self._rejections_in_flight[id(out)] = rejected
        return ModelRunnerOutput(
            req_ids=scheduled,
            req_id_to_index={rid: i for i, rid in enumerate(scheduled)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=connector_output,
        )

    def _plan(self, out) -> dict[str, _Computes]:
        """Per request scheduled in ``out``, what the model runner computes, from the scheduler's view corrected for
        the drafts of steps in flight that the runner knows were rejected (the scheduler does not yet)."""
        restarted = [new.req_id for new in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.resumed_req_ids)
        for request_id in restarted:  # its positions start afresh: earlier steps' rejections no longer apply
            for rejections in self._rejections_in_flight.values():
                rejections.pop(request_id, None)
        plan = {}
        for request_id, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            scheduled_drafts = out.scheduled_spec_decode_tokens.get(request_id, [])
            # The scheduler has already advanced num_computed_tokens past this step.
            end = request.num_computed_tokens - sum(
                rejections.get(request_id, 0) for rejections in self._rejections_in_flight.values()
            )
            output_index = end - len(scheduled_drafts) - request.num_prompt_tokens
            if self.config.async_scheduling and scheduled_drafts:
                assert set(scheduled_drafts) == {-1}, f"async scheduling schedules placeholders: {scheduled_drafts}"
                drafts = tuple(self.drafts(request_id, output_index)[: len(scheduled_drafts)])
            else:
                drafts = tuple(scheduled_drafts)
            # A token is sampled only once the whole prompt (and every earlier output) has been computed.
            samples = end - len(drafts) >= request.num_tokens
            if end != request.num_computed_tokens:
                self.positions_corrected += 1
            plan[request_id] = _Computes(end - count, end, drafts, output_index, samples)
        return plan

    def _captured_rows(self) -> tuple[Any, Any]:
        """What the model runner's capture buffer and slot mapping would hold after this step's forward pass.

        Requests are laid out in reverse id order, so the connector cannot rely on the scheduler's order.
        """
        slots, rows = [], []
        for request_id, work in sorted(self._computing.items(), reverse=True):
            request = self.scheduler.requests[request_id]
            blocks = np.asarray(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0], dtype=np.int64)
            positions = np.arange(work.start, work.end)
            slots.append(blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE)
            # Async scheduling runs a step before the tokens sampled in the step before it are appended (a GPU
            # feeds them forward itself). A speculative step computes its drafts, as the model sees them.
            tokens = self.sequence(request_id, request.prompt_token_ids, max(0, work.output_index)) + list(work.drafts)
            rows.append(self.router.rows(tokens, work.start, work.end))
        if not slots:
            return np.zeros(0, dtype=np.int64), np.zeros((0, *self.router.shape), dtype=np.int32)
        return np.concatenate(slots), np.concatenate(rows)

    def step_until_scheduled(self, request_id: str, timeout_s: float = 30.0) -> None:
        """Step until ``request_id`` was scheduled (its LMCache lookup answers first, asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while request_id not in self.block_tables:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{request_id} was not scheduled within {timeout_s:.0f} s")
            self.step()
            time.sleep(0.005)

    def busy(self) -> bool:
        """Requests still waiting or running, or (async scheduling) steps whose output is not processed yet."""
        return bool(self.scheduler.has_requests() or self.scheduler.requests or self._batch_queue)

    def run_until_idle(self, max_steps: int = 400, timeout_s: float = 60.0) -> int:
        """Step until every request finished and the connector has released them (stores drained)."""
        deadline = time.monotonic() + timeout_s
        steps = 0
        while self.busy():
            if steps >= max_steps or time.monotonic() > deadline:
                raise TimeoutError(
                    f"scheduler still has {len(self.scheduler.requests)} requests after {steps} steps "
                    f"({sorted(self.scheduler.requests)})"
                )
            out = self.step()
            steps += 1
            if not out.num_scheduled_tokens:
                time.sleep(0.005)  # waiting on an async load or store; let the server progress
        return steps

    def generate(self, requests: Iterable[tuple[str, Sequence[int]]], max_tokens: int = 4) -> int:
        for request_id, prompt in requests:
            self.add_request(request_id, prompt, max_tokens)
        return self.run_until_idle()

    def finish_by_hand(self, request: Any, block_ids: list[int], timeout_s: float = 10.0) -> dict | None:
        """End a request a test drove by hand (outside :meth:`step`) as vLLM ends it; returns its params.

        ``request_finished``; when the connector keeps the blocks, the worker is told the request finished, and its
        report that the request's transfers are done (``finished_sending``) is fed back to the scheduler side, which
        ends the request's server session then. A test that skipped the report would leave the session on the
        shared server, and a later request under the same id would use it.
        """
        from vllm.v1.outputs import KVConnectorOutput

        connector = self.scheduler.connector
        delay_free, params = connector.request_finished(request, block_ids)
        if delay_free:
            request_id = request.request_id
            told = {request_id}  # vLLM passes a finished request to the worker once, in the next step's output
            deadline = time.monotonic() + timeout_s
            while request_id not in set(self.worker.get_transfer_results(told).finished_sending or ()):
                told = set()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the worker did not report {request_id!r} finished within {timeout_s:.0f} s")
                time.sleep(0.01)
            connector.update_connector_output(KVConnectorOutput(finished_sending={request_id}))
        return params

    def settle_stores(self, timeout_s: float = 10.0) -> None:
        """Wait (bounded) until what finished requests stored is visible to lookups.

        LMCache answers a KV store before it commits the objects (they stay write-locked until its copy completes),
        and the connector publishes R3 in the background: a lookup right after a request finished can miss both.
        """
        deadline = time.monotonic() + timeout_s
        connector = self.scheduler.connector
        if connector is not None and getattr(connector, "routed", None) is not None:
            connector.routed.settle(timeout_s)
        while (pending := self.server.l1_counts()["write_locked_count"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        if pending:
            raise TimeoutError(f"{pending} KV objects still write-locked on the server after {timeout_s:.0f} s")

    def logged_connector_stats(self) -> Any:
        """The connector stats of every step, shipped as vLLM ships them (msgpack) and added up as its logging stat
        logger adds them (``KVConnectorLogging.observe``); first what the connector counted since the last step is
        collected as one more step's, for steps a test played by hand. ``None`` if nothing was ever reported."""
        import msgspec

        connector = self.scheduler.connector
        since = connector.get_kv_connector_stats()
        if since is not None:
            self.connector_stats.append(since.data)
        total = None
        for payload in self.connector_stats:
            stats = type(connector).build_kv_connector_stats(msgspec.msgpack.decode(msgspec.msgpack.encode(payload)))
            total = stats if total is None else total.aggregate(stats)
        return total

    def reset_prefix_cache(self) -> None:
        """vLLM's prefix cache reset, once every store is visible, so the next request's hit comes from LMCache."""
        self.settle_stores()
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache: requests still hold blocks")

    # -- teardown --------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        try:
            self.worker.shutdown()
        finally:
            try:
                if self.scheduler.connector is not None:
                    self.scheduler.connector.shutdown()
            finally:
                self._config_context.__exit__(None, None, None)


# -- lookups and locks, as vLLM's scheduler drives the connector -----------------------------------------------------
def lookup(connector, request, num_computed_tokens: int = 0, timeout_s: float = 20.0) -> tuple[int, bool]:
    """``get_num_new_matched_tokens(request, num_computed_tokens)`` (vLLM's own hit) until the LMCache lookup answers
    (vLLM asks every step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        hit, is_async = connector.get_num_new_matched_tokens(request, num_computed_tokens)
        if hit is not None:
            return hit, is_async
        assert time.monotonic() < deadline, f"the lookup of {request.request_id} did not answer within {timeout_s} s"
        time.sleep(0.01)


def kv_lookup_answer(adapter, request_id: str, timeout_s: float = 20.0) -> int:
    """The tokens LMCache's KV lookup of ``request_id`` hit, once it answered (polled as vLLM's steps poll it)."""
    deadline = time.monotonic() + timeout_s
    while (hit := adapter.check_lookup_result(request_id)) is None:
        assert time.monotonic() < deadline, f"the KV lookup of {request_id} did not answer"
        time.sleep(0.005)
    return hit


def ask_until_answered(harness, request_ids: Sequence[str], timeout_s: float = 30.0) -> dict[str, int]:
    """The joint KV+R3 hits of waiting requests, asked as vLLM's scheduler asks (``get_num_new_matched_tokens``,
    with no local hit) until both LMCache's KV lookup and the R3 fetch of each answered.

    vLLM admits a request only when both did, and a harness step takes microseconds: a test that needs requests
    admitted at a given point (together, or while another still runs) asks here first, or a slow answer on a busy
    machine lets the others run to their end. Asking submits a lookup vLLM has not sent yet (a step whose token
    budget the first request used up visits no other), so an answer here is never the adapter's 0 for a lookup it
    does not know; vLLM's next ask is answered from the same lookup and fetch.
    """
    connector = harness.scheduler.connector
    return {r: lookup(connector, harness.scheduler.requests[r], 0, timeout_s)[0] for r in request_ids}


def wait_for(read: Callable[[], int], expected: int, timeout_s: float) -> int:
    """``read()`` once it returns ``expected`` (or whatever it returns after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def wait_locks(server, expected: int, timeout_s: float = 10.0) -> int:
    """The server's read-locked object count once it is ``expected`` (or whatever it is after ``timeout_s``).

    It counts locked objects, not locks: two lookups locking the same chunk count once.
    """
    return wait_for(lambda: server.l1_counts()["read_locked_count"], expected, timeout_s)


def wait_sessions(server, expected: int, timeout_s: float = 5.0) -> int:
    """The server's session count (``active_sessions``) once it is ``expected`` (or whatever it is after
    ``timeout_s``)."""
    return wait_for(lambda: server.status()["active_sessions"], expected, timeout_s)


def locks_stay(server, expected: int, seconds: float = 1.0) -> int:
    """The first read-locked object count other than ``expected`` seen within ``seconds``, else ``expected``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (count := server.l1_counts()["read_locked_count"]) != expected:
            return count
        time.sleep(0.02)
    return expected
