"""``LMCacheMPConnector`` for vLLM 0.32: LMCache 0.5.6's multiprocess connector with routed experts and the
hybrid-model fixes.

Use it with ``--kv-transfer-config '{"kv_connector": "LMCacheMPConnector", "kv_connector_module_path":
"lmcache_r3.mp.connector", "kv_role": "kv_both"}'``. It subclasses LMCache's connector and changes four things,
each decided by a pure function of :mod:`lmcache_r3.mp.planning` (docs/connector.md explains them):

1. **Admitted range.** ``update_state_after_alloc`` records how many external tokens the scheduler admitted; the
   retrieve stops at the chunk holding the last admitted token and the lookup locks past it are freed at once
   (zero admitted: no retrieve, every lock freed); a request finished before it was admitted frees its lookup's
   locks, and a lookup vLLM asks for again never frees the same chunks twice.
2. **Null-block projection.** A retrieve is projected onto the request's block tables per KV group: vLLM's null
   block is never a destination; a group's leading null chunks are not restored; a null block after a real one,
   a group without any real destination, or a retrieve the LMCache 0.5.6 server cannot carry out without
   writing the null block *fails closed*: nothing is retrieved, the locks are freed and vLLM recomputes.
3. **Store window.** A store ends before the first chunk whose block in any group is the null block, and nothing
   of that request is stored after it.
4. **Coverage guard.** No retrieve into a range some group has no blocks for.

**Routed experts** (MoE models, on unless ``"lmcache_r3.routed_experts": false``): the worker captures each step's
routing (:mod:`lmcache_r3.mp.capture`), the scheduler assembles every request's rows from vLLM's prefix cache,
LMCache and computation, makes every LMCache hit a joint KV+R3 hit, stores R3 under the KV chunk keys, and returns
the rows in ``kv_transfer_params["routed_experts"]`` (:mod:`lmcache_r3.mp.routed`; docs/r3.md).

The worker side refuses, whatever the scheduler sent, to use the null block as the source or destination of a
copy. A finished request's server session ends once its last store reached the server, not before
(:mod:`lmcache_r3.mp.sessions`). Everything else (lookups, the transfer itself) is LMCache's. The connector reads
``LMCACHE_CONFIG_FILE`` (or the file named by ``kv_connector_extra_config["lmcache_r3.config_file"]``) for the
server address and timeouts; explicit ``lmcache.mp.*`` entries win.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector as StockLMCacheMPConnector
from lmcache.integration.vllm.lmcache_mp_metadata import (
    LMCacheMPConnectorMetadata,
    LMCacheMPRequestMetadata,
    LMCacheMPRequestState,
)
from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from lmcache_r3.artifacts import GatherNarrowError, TokenRange
from lmcache_r3.counters import Counters
from lmcache_r3.mp import capture, planning, shutdown_bound, stock_fit
from lmcache_r3.mp.clearing import clear_servers
from lmcache_r3.mp.connector_config import (
    R3_STORE_BATCH_KEY,
    R3_TIMEOUT_KEY,
    ROUTED_EXPERTS_KEY,
    SEPARATE_GROUPS_KEY,
    first_server_url,
    mirrored_group,
    refuse_lazy_offload,
    refuse_r3_without_full_attention,
    resolve_extra_config,
    routed_experts_profile,
)
from lmcache_r3.mp.metrics import R3ConnectorStats, R3PromMetrics, counter_deltas
from lmcache_r3.mp.r3_client import R3Client
from lmcache_r3.mp.r3_messages import R3WorkerMetadata
from lmcache_r3.mp.routed import RoutedExpertsBook
from lmcache_r3.mp.sessions import SessionEnds
from lmcache_r3.mp.stock_adapter import (
    defer_session_ends,
    free_lookup_locks,
    frees_blocks_mid_request,
    group_windows,
    has_recurrent_group,
    report_unsubmitted_retrieve_failed,
)
from lmcache_r3.mp.stores_in_flight import StoresInFlight

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = planning.VLLM_NULL_BLOCK_ID
LOOKUP_LOCK_TTL_S = 300.0
"""LMCache 0.5.6's read-lock TTL: a lock taken by a lookup is gone by then, whoever releases it."""
RESET_LOOKUP_WAIT_S = 10.0
"""How long vLLM's cache reset waits for the lookups of finished requests (and the release of their locks) before it
clears: a live server answers in milliseconds."""


CONNECTOR_COUNTERS = (
    "partial_admissions",
    "zero_admissions",
    "locks_released_early_chunks",
    "locks_released_at_finish_chunks",
    "lookups_finished_after_request",
    "retrieves",
    "retrieves_failed_closed",
    "stores_trimmed_at_null_block",
    "null_block_ops_refused",
    "store_flushes_before_block_reuse",
)
"""What the fixes did, for logs and tests (scheduler and worker roles each keep their own)."""


class LMCacheMPConnector(StockLMCacheMPConnector):
    """LMCache's MP connector with the admitted-range, null-block, store-window and coverage rules."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        transfer_config = vllm_config.kv_transfer_config
        extra = transfer_config.kv_connector_extra_config
        merged = resolve_extra_config(dict(extra), kv_cache_config)
        extra.clear()
        extra.update(merged)
        if transfer_config.kv_load_failure_policy != "recompute":
            # A retrieve this connector refuses (fail closed) must end in recomputation, not a failed request.
            logger.info("lmcache_r3: kv_load_failure_policy set to 'recompute' (was %r)",
                        transfer_config.kv_load_failure_policy)  # fmt: skip
            transfer_config.kv_load_failure_policy = "recompute"
        # Routed experts (R3), and what lmcache_r3 refuses, before LMCache's connector opens its sockets and threads.
        self.r3_profile = routed_experts_profile(
            vllm_config, bool(merged[ROUTED_EXPERTS_KEY]), say_why=role == KVConnectorRole.SCHEDULER
        )
        refuse_lazy_offload(merged, kv_cache_config, self.r3_profile is not None)
        refuse_r3_without_full_attention(kv_cache_config, self.r3_profile is not None)
        super().__init__(vllm_config, role, kv_cache_config)
        self._kv_cache_config_for_r3 = kv_cache_config
        self.counters = Counters(*CONNECTOR_COUNTERS)
        self._group_windows = group_windows(kv_cache_config) or [-1] * len(self._group_tokens_per_block)
        self._recurrent = has_recurrent_group(kv_cache_config)
        self._frees_blocks_mid_request = frees_blocks_mid_request(kv_cache_config)
        self._separate_object_groups = bool(merged[SEPARATE_GROUPS_KEY])
        # Scheduler-side state, keyed by request id.
        self._admissions: dict[str, planning.AdmittedRange] = {}
        self._computed_at_lookup: dict[str, int] = {}
        self._locks_held_to: dict[str, int] = {}
        """Per request whose lookup hit more KV than R3: the locks past this token were already released."""
        self._awaiting_r3: dict[str, tuple[int, tuple[int, bool]]] = {}
        """Per request whose KV lookup answered before its R3 fetch: the local hit it was for, and the answer."""
        self._store_stopped: set[str] = set()
        self._recompute_only: set[str] = set()
        self._orphaned_lookups: dict[str, tuple[Any, float]] = {}
        """Per request that finished while its lookup was in flight: its tracker, and when to stop waiting."""
        self._failed_retrieves: list[tuple[str, list[int]]] = []
        self._unflushed_store_blocks: set[int] = set()
        self._loading: set[str] = set()
        """Requests whose load is out: a retrieve (or a refused one) sent to the worker, its finished_recving unseen."""
        self._finished_while_loading: set[str] = set()
        """Requests finished while their load was out, whose finished_sending vLLM must never see (see
        update_connector_output)."""
        # Routed experts (R3).
        self._r3_group = mirrored_group(kv_cache_config) or 0  # None only without R3 (refused above)
        self._r3_block_size = self._group_tokens_per_block[self._r3_group] if self._group_tokens_per_block else 0
        self.routed: RoutedExpertsBook | None = None
        self.r3_capture: capture.RouterCapture | None = None
        self.r3_step_source: capture.StepSource | None = None
        """Where the worker reads a step's ``(slot_mapping, captured rows)``; None: the bound MoE routers."""
        self._r3_layer: str | None = None
        self._r3_out: R3WorkerMetadata | None = None
        self._r3_collected = True
        self.r3_seconds = 0.0
        """Time this role spent on routed experts (capture mapping on a worker, bookkeeping on the scheduler)."""
        self.r3_steps = 0
        self._r3_sends_rows = False
        self._stats_reported: dict[str, int] = {}
        """The counters as last handed to vLLM's metrics (:meth:`get_kv_connector_stats` reports what moved)."""
        self.session_ends: SessionEnds | None = None
        self._stores: StoresInFlight | None = None
        """Worker side: every store not yet answered, per request (LMCache's lazy offload frees blocks itself)."""
        if role == KVConnectorRole.WORKER and not self.lazy_offload:
            self._stores = StoresInFlight()
        if role == KVConnectorRole.SCHEDULER:
            # LMCache drops a finished request's lookup state; one still in flight is kept until it answers.
            self._drop_lookup_state = self.scheduler_adapter.cleanup_lookup_result
            self.scheduler_adapter.cleanup_lookup_result = self._cleanup_lookup_result
            # A consumer stores nothing, so nothing can outlive its session's end; lazy offload ends sessions
            # itself once its deferred stores are done.
            if transfer_config.is_kv_producer and not self.lazy_offload:
                self.session_ends = defer_session_ends(self.scheduler_adapter)
        if self.r3_profile is not None and role == KVConnectorRole.SCHEDULER:
            self._init_routed_experts_book(vllm_config, kv_cache_config, merged)

    def _init_routed_experts_book(self, vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any]) -> None:
        timeout_s = float(extra[R3_TIMEOUT_KEY])
        client = R3Client(first_server_url(extra), self.scheduler_adapter.model_name, self.r3_profile, timeout_s)
        self.routed = RoutedExpertsBook(
            self.r3_profile,
            chunk_size=self.scheduler_adapter.lmcache_tokens_per_chunk,
            block_size=self._r3_block_size,
            num_blocks=kv_cache_config.num_blocks,
            client=client,
            fetch_timeout_s=timeout_s,
            store_batch_steps=extra[R3_STORE_BATCH_KEY],
        )
        self.routed.probe_server(min(timeout_s, 2.0))

    # ==============================================================================================
    # Scheduler side, in call order
    # ==============================================================================================
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """LMCache's lookup; the unrounded local hit is kept, since admitted tokens follow it.

        A request whose retrieve failed closed is not looked up again: it recomputes. LMCache 0.5.6 bypasses a failed
        load with a tracker state, but drops a preempted request's tracker at every call here, so a preempted request
        would look up, be refused and be reset again at every step, and never run.
        """
        if self.routed is not None:
            self.routed.lookup_asked(request.request_id)
        if request.request_id in self._recompute_only or request.skip_reading_prefix_cache:
            # skip_reading_prefix_cache (prompt logprobs): vLLM admits the request for local computation whatever this
            # answers, even "lookup still out", so a lookup sent now would lock its hit on the server until the TTL.
            tracker = self._get_or_create_request_tracker(request)
            if tracker.state != LMCacheMPRequestState.BYPASS_LMCACHE:  # as LMCache's own bypass of a failed load
                self.scheduler_adapter.cleanup_lookup_result(request.request_id)
                tracker.allocated_block_ids.clear()
                tracker.num_stored_tokens = tracker.num_vllm_hit_tokens = tracker.num_lmcache_hit_tokens = 0
                tracker.state = LMCacheMPRequestState.BYPASS_LMCACHE
            if self.routed is not None:
                self.routed.end_lookup(request)  # its rows are all computed here (or vLLM's own hit's)
            return 0, False
        started = time.perf_counter()
        if self.routed is not None:
            self.routed.begin_lookup(request, num_computed_tokens)
        self.r3_seconds += time.perf_counter() - started
        kept = self._awaiting_r3.pop(request.request_id, None)
        if kept is not None and kept[0] == num_computed_tokens:
            result = kept[1]  # LMCache's KV answer, kept while the R3 fetch was still out
        else:
            result = super().get_num_new_matched_tokens(request, num_computed_tokens)
            if result[0] is None:
                return result
        self._computed_at_lookup[request.request_id] = num_computed_tokens
        if self.routed is not None:
            started = time.perf_counter()
            joint = self._joint_hit(request, num_computed_tokens, result)
            self.r3_seconds += time.perf_counter() - started
            if joint is None:
                self._awaiting_r3[request.request_id] = (num_computed_tokens, result)
                return None, True
            result = joint
        return result

    def _joint_hit(self, request: Any, num_computed_tokens: int, result: tuple[int, bool]) -> tuple[int, bool] | None:
        """Cut LMCache's KV hit at the first chunk without valid R3: every hit is a joint KV+R3 hit.

        None while the R3 fetch is still out (within its bound): vLLM asks again at its next step, and schedules the
        other requests meanwhile instead of waiting here for an R3 read from a slow tier.
        """
        tracker = self._get_request_tracker(request.request_id)
        kv_hit = tracker.num_lmcache_hit_tokens if result[0] else 0
        # vLLM asks again when it could not allocate the request: LMCache reports the same locked hit, whose tail
        # past an earlier cut is already released (releasing it twice would strip other requests' locks).
        held_to = self._locks_held_to.get(request.request_id)
        if kv_hit <= num_computed_tokens:
            self.routed.end_lookup(request)
            if held_to is not None and tracker.num_lmcache_hit_tokens > held_to:  # vLLM's own cache grew past it
                tracker.num_lmcache_hit_tokens = tracker.num_stored_tokens = held_to
            return result
        if self.routed.fetch_pending(request):
            return None
        held_to = kv_hit if held_to is None else held_to
        joint = min(self.routed.joint_hit_end(request, kv_hit), held_to)
        if joint >= kv_hit:
            return result
        self._free_locks(tracker, TokenRange(joint, held_to))
        self._locks_held_to[request.request_id] = joint
        tracker.num_lmcache_hit_tokens = tracker.num_stored_tokens = joint
        need = max(0, joint - num_computed_tokens)
        if joint == len(request.all_token_ids):
            need = max(0, need - 1)  # the last token is always computed, as LMCache does for a full hit
        return need, need > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Record the admission: bound the retrieve by it and free every lookup lock no retrieve will consume."""
        request_id = request.request_id
        tracker = self._get_request_tracker(request_id)
        if tracker.state != LMCacheMPRequestState.PREFETCHING:
            # A later call (blocks for the rest of the prompt) or a bypassed request: block bookkeeping only.
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            return
        self._track_new_blocks(tracker, blocks)
        self.scheduler_adapter.cleanup_lookup_result(request_id)
        self._locks_held_to.pop(request_id, None)
        computed = max(self._computed_at_lookup.pop(request_id, 0), tracker.num_vllm_hit_tokens)
        admitted = num_external_tokens if tracker.needs_retrieve() else 0
        admission = planning.admitted_range(
            chunk_size=self.scheduler_adapter.lmcache_tokens_per_chunk,
            num_vllm_hit_tokens=tracker.num_vllm_hit_tokens,
            num_lookup_hit_tokens=tracker.num_lmcache_hit_tokens,
            num_admitted_external_tokens=admitted,
            num_computed_tokens=computed,
        )
        for locked in admission.release_now:
            self._free_locks(tracker, locked)
        if admission.retrieve is None:
            if tracker.num_lmcache_hit_tokens > tracker.num_vllm_hit_tokens:
                self.counters.add("zero_admissions")
            tracker.state = LMCacheMPRequestState.READY
            return
        if admission.retrieve.end < tracker.num_lmcache_hit_tokens:
            self.counters.add("partial_admissions")
            chunk = self.scheduler_adapter.lmcache_tokens_per_chunk
            self.counters.add(
                "locks_released_early_chunks", (tracker.num_lmcache_hit_tokens - admission.retrieve.end) // chunk
            )
        tracker.state = LMCacheMPRequestState.WAITING_FOR_LOAD
        self._admissions[request_id] = admission
        if self.routed is not None:
            self.routed.admitted(request_id, computed, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheMPConnectorMetadata:
        metadata = super().build_connector_meta(scheduler_output)
        # Retrieves refused on the scheduler side travel to the worker, which reports them as failed loads.
        metadata.failed_retrieves = self._failed_retrieves
        self._failed_retrieves = []
        if self._frees_blocks_mid_request:
            self._flush_before_block_reuse(scheduler_output, metadata)
        if self._orphaned_lookups:
            self._release_orphaned_lookups()
        if self.session_ends is not None:
            self.session_ends.poll()  # no work unless a session end waits for the answer to a release
        metadata.r3_step = None
        if self.routed is not None:
            started = time.perf_counter()
            for entry in metadata.requests:
                if entry.direction == "STORE":
                    self.routed.on_store(entry.request_id, entry.op.start, entry.op.end)
            metadata.r3_step = self.routed.on_schedule(scheduler_output, self._r3_group)
            self.r3_seconds += time.perf_counter() - started
        return metadata

    def update_connector_output(self, connector_output: Any) -> None:
        """LMCache's update, without a finished_sending for a request vLLM finished while its load was out.

        vLLM keeps the blocks of a request finished in WAITING_FOR_REMOTE_KVS until its load reports finished
        (finished_recving), then frees them and drops the request. LMCache 0.5.6's worker reports every finished
        request as finished_sending (after its stores), the loading one too, before, with or after the load's report.
        vLLM would free the blocks under the running load and drop the request, and the report that came second would
        fail its ``assert req_id in self.requests`` and stop the engine core. vLLM reads the finished sets after this
        call, so such a request is taken out of finished_sending here, in whichever output it comes.
        """
        if connector_output.finished_recving:
            self._loading.difference_update(connector_output.finished_recving)
        sending = connector_output.finished_sending
        if sending and self._finished_while_loading:
            held = self._finished_while_loading.intersection(sending)
            if held:
                self._finished_while_loading -= held
                connector_output.finished_sending = set(sending) - held
        super().update_connector_output(connector_output)
        if self.session_ends is not None and (connector_output.finished_sending or connector_output.finished_recving):
            # A request finished while its KV loaded is done with the server when its load reports finished.
            done = set(connector_output.finished_sending or ()) | set(connector_output.finished_recving or ())
            self.session_ends.stores_finished(done, self._orphaned_lookups.__contains__)
        if self.routed is not None:
            started = time.perf_counter()
            self.routed.on_worker_output(connector_output.kv_connector_worker_meta)
            self.r3_seconds += time.perf_counter() - started
            self.r3_steps += 1

    def _flush_before_block_reuse(self, scheduler_output: Any, metadata: LMCacheMPConnectorMetadata) -> None:
        """Have the worker wait for in-flight stores before this step writes a block one of them still reads.

        The server copies a stored block after the forward pass that produced it, and the engine does not wait for
        the copy. LMCache 0.5.6 flushes in-flight stores before the next forward pass only when a request was
        preempted; but vLLM also frees blocks in mid-request (align-mode Mamba retires a recurrent checkpoint two
        steps after writing it) and hands them to any request, whose forward pass or retrieve then overwrites them
        while the server may still be reading them: the stored object would hold some other position's bytes.
        """
        handed_out: set[int] = set()
        for new in scheduler_output.scheduled_new_reqs:
            handed_out.update(b for ids in new.block_ids for b in ids)
        for new_ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            handed_out.update(b for ids in new_ids or () for b in ids)
        for entry in metadata.requests:
            if entry.direction == "RETRIEVE":
                handed_out.update(_flat_block_ids(entry.op))
        if not metadata.need_flush_before_forward and self._unflushed_store_blocks & handed_out:
            metadata.need_flush_before_forward = True
            self.counters.add("store_flushes_before_block_reuse")
        if metadata.need_flush_before_forward:
            self._unflushed_store_blocks.clear()
        for entry in metadata.requests:
            if entry.direction == "STORE":  # submitted after this step's forward pass: a later step's flush waits
                self._unflushed_store_blocks.update(_flat_block_ids(entry.op))
        self._unflushed_store_blocks -= {NULL_BLOCK_ID, planning.SKIPPED_BLOCK_ID}

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        if self.routed is not None:
            self.routed.on_new_request(request.request_id)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """LMCache's cleanup; the returned params get the request's routed experts in this engine step.

        A request that finishes (is aborted) after its lookup answered but before vLLM admitted it still holds
        the lookup's locks: they are released here (LMCache's own cleanup leaves them to the read-lock TTL). The
        request's server session ends once its stores are done (:mod:`lmcache_r3.mp.sessions`).
        """
        self._release_unadmitted_lookup(request.request_id)
        self._forget(request.request_id)
        self._recompute_only.discard(request.request_id)
        delay_free, params = super().request_finished(request, block_ids)
        if delay_free and request.request_id in self._loading:
            self._finished_while_loading.add(request.request_id)
        if self.routed is not None:
            params = self.routed.request_finished(request, params)
        return delay_free, params

    # -- retrieve planning --------------------------------------------------------------------------------------
    def _process_retrieve_requests(self, metadata: LMCacheMPConnectorMetadata) -> None:
        for tracker in list(self.request_trackers.values()):
            if tracker.state != LMCacheMPRequestState.WAITING_FOR_LOAD:
                continue
            tracker.state = LMCacheMPRequestState.READY
            self._loading.add(tracker.request_id)  # a refused retrieve is reported finished (failed) as well
            request_metadata = self._plan_retrieve(tracker)
            if request_metadata is not None:
                metadata.add_request_metadata(request_metadata)

    def _plan_retrieve(self, tracker: Any) -> LMCacheMPRequestMetadata | None:
        request_id = tracker.request_id
        chunk = self.scheduler_adapter.lmcache_tokens_per_chunk
        admission = self._admissions.pop(request_id, None) or planning.admitted_range(
            chunk_size=chunk,
            num_vllm_hit_tokens=tracker.num_vllm_hit_tokens,
            num_lookup_hit_tokens=tracker.num_lmcache_hit_tokens,
            num_admitted_external_tokens=planning.NEVER_ADMITTED,
        )
        if admission.retrieve is None:
            return None
        allocated = [tracker.allocated_block_ids.get(g, []) for g in range(len(self._group_tokens_per_block))]
        plan = planning.plan_retrieve(
            admission.retrieve,
            allocated,
            self._group_tokens_per_block,
            chunk,
            skip_first_n_tokens=admission.skip_first_n_tokens,
        )
        if plan.kind != "retrieve":
            return self._fail_closed(tracker, admission, allocated, plan.reason)
        if self._recurrent and (admission.exact_admitted_end or 0) < admission.retrieve.end:
            return self._fail_closed(
                tracker,
                admission,
                allocated,
                f"the scheduler admitted tokens up to {admission.exact_admitted_end}, inside the chunk ending at "
                f"{admission.retrieve.end}; restoring that chunk would give the recurrent state of a later position",
            )
        fit = stock_fit.fit_stock_retrieve(
            plan,
            group_sw_size_tokens=self._group_windows,
            separate_object_groups=self._separate_object_groups,
            num_lookup_hit_tokens=tracker.num_lmcache_hit_tokens,
        )
        if not fit.ok:
            return self._fail_closed(tracker, admission, allocated, fit.reason)
        self.counters.add("retrieves")
        op = LoadStoreOp(
            token_ids=tracker.get_token_ids(),
            block_ids=[list(ids) for ids in fit.block_ids],
            start=admission.retrieve.start,
            end=admission.retrieve.end,
            skip_first_n_tokens=admission.skip_first_n_tokens,
        )
        return LMCacheMPRequestMetadata(
            request_id=request_id,
            direction="RETRIEVE",
            op=op,
            cache_salt=tracker.cache_salt,
            request_configs=tracker.request_configs,
        )

    def _fail_closed(self, tracker: Any, admission: Any, allocated: list[list[int]], reason: str) -> None:
        self.counters.add("retrieves_failed_closed")
        self._recompute_only.add(tracker.request_id)
        logger.warning("lmcache_r3: request %s recomputes instead of retrieving %s: %s",
                       tracker.request_id, admission.retrieve, reason)  # fmt: skip
        self._free_locks(tracker, admission.retrieve)
        # The blocks the load was to fill; those of vLLM's own hit (the skipped head) hold valid KV and stay.
        fill = TokenRange(admission.retrieve.start + admission.skip_first_n_tokens, admission.retrieve.end)
        flat = _destination_blocks(allocated, self._group_tokens_per_block, fill)
        self._failed_retrieves.append((tracker.request_id, flat))
        return None

    # -- store window ------------------------------------------------------------------------------------------
    def _process_new_requests(self, scheduler_output: Any, metadata: LMCacheMPConnectorMetadata) -> None:
        staged = LMCacheMPConnectorMetadata()
        super()._process_new_requests(scheduler_output, staged)
        self._admit_stores(staged, metadata)

    def _process_cached_requests(self, scheduler_output: Any, metadata: LMCacheMPConnectorMetadata) -> None:
        staged = LMCacheMPConnectorMetadata()
        super()._process_cached_requests(scheduler_output, staged)
        self._admit_stores(staged, metadata)

    def _admit_stores(self, staged: LMCacheMPConnectorMetadata, metadata: LMCacheMPConnectorMetadata) -> None:
        """Trim each store LMCache planned to its window; nothing of a request is stored past a null chunk."""
        for entry in staged.requests:
            if entry.direction != "STORE":
                metadata.add_request_metadata(entry)
                continue
            request_id = entry.request_id
            if request_id in self._store_stopped:
                continue
            tracker = self._get_request_tracker(request_id)
            allocated = [tracker.allocated_block_ids.get(g, []) for g in range(len(self._group_tokens_per_block))]
            window = planning.store_window(
                TokenRange(entry.op.start, entry.op.end),
                allocated,
                self._group_tokens_per_block,
                self.scheduler_adapter.lmcache_tokens_per_chunk,
            )
            if window.stop:
                self._store_stopped.add(request_id)
                self.counters.add("stores_trimmed_at_null_block")
            if window.tokens.end == window.tokens.start:
                continue
            entry.op.end = window.tokens.end
            entry.op.block_ids = [list(ids) for ids in window.block_ids]
            metadata.add_request_metadata(entry)

    # -- helpers -----------------------------------------------------------------------------------------------
    def _track_new_blocks(self, tracker: Any, blocks: Any) -> None:
        """Append the blocks beyond those already tracked, per group (the first call tracks them all)."""
        block_ids = blocks.get_block_ids() or ()
        tracked = tracker.num_allocated_blocks()
        new = [list(ids[tracked.get(group, 0) :]) for group, ids in enumerate(block_ids)]
        if any(new):
            tracker.append_block_ids(tuple(new), self._mamba_relocation_window)

    def _free_locks(self, tracker: Any, locked: TokenRange) -> list[Any]:
        """Release the lookup locks of ``locked``; the servers' answers to come."""
        if locked.end <= locked.start:
            return []
        return free_lookup_locks(self.scheduler_adapter, tracker, locked.start, locked.end)

    def _release_unadmitted_lookup(self, request_id: str) -> None:
        """Release the locks of a finishing request's lookup that no retrieve will consume.

        A lookup still in flight takes its locks when it completes on the server: it is polled every step from then
        on (:meth:`_release_orphaned_lookups`), since LMCache's own cleanup would drop it and leave those locks to
        the server's read-lock TTL, pinning the chunks in L1 (RL trainers abort a whole batch at a weight update).
        """
        tracker = self.request_trackers.get(request_id)
        if tracker is None or tracker.state != LMCacheMPRequestState.PREFETCHING:
            return  # admitted (its retrieve or the admission released the locks), bypassed, or never looked up
        hit = self.scheduler_adapter.check_lookup_result(request_id)
        if hit is None:
            self._orphaned_lookups[request_id] = (tracker, time.monotonic() + LOOKUP_LOCK_TTL_S)
            return
        held = min(hit, self._locks_held_to.get(request_id, hit))  # the tail past a joint cut is gone
        self._release_finished_lookup(tracker, held)

    def _release_finished_lookup(self, tracker: Any, held: int) -> list[Any]:
        """Release the locks of a finished request's lookup up to ``held``; the servers' answers to come."""
        if not held:
            return []
        answers = self._free_locks(tracker, TokenRange(0, held))
        if self.session_ends is not None:  # its session ends after the server answered the release
            self.session_ends.release_sent(tracker.request_id, answers)
        self.counters.add("locks_released_at_finish_chunks", held // self.scheduler_adapter.lmcache_tokens_per_chunk)
        return answers

    def _release_orphaned_lookups(self) -> list[Any]:
        """Poll the lookups of finished requests (once a step); release the locks of those that answered. The
        servers' answers to the releases."""
        answers = []
        for request_id, (tracker, deadline) in list(self._orphaned_lookups.items()):
            hit = self.scheduler_adapter.check_lookup_result(request_id)
            if hit is None and time.monotonic() < deadline:
                continue
            del self._orphaned_lookups[request_id]
            self._drop_lookup_state(request_id)
            self.counters.add("lookups_finished_after_request")
            answers += self._release_finished_lookup(tracker, hit or 0)  # past the deadline the TTL released them
            if self.session_ends is not None:
                self.session_ends.lookup_released(request_id)
        return answers

    def _settle_finished_lookups(self, timeout_s: float) -> bool:
        """Wait (bounded) until every finished request's lookup answered and its locks' release was answered, so
        that a clear finds none of their objects locked; whether that happened."""
        deadline = time.monotonic() + timeout_s
        answers: list[Any] = []
        while True:
            answers += self._release_orphaned_lookups()
            answers = [answer for answer in answers if not answer.query()]
            if not (self._orphaned_lookups or answers):
                return True
            if time.monotonic() > deadline:
                logger.warning("lmcache_r3: %d lookups of finished requests, %d releases of their locks still out "
                               "after %.0f s", len(self._orphaned_lookups), len(answers), timeout_s)  # fmt: skip
                return False
            time.sleep(0.005)

    def has_pending_push_work(self) -> bool:
        """Whether vLLM must keep stepping an engine that has nothing to run: LMCache's (lazy offload), and while
        a finished request's lookup is still to be released or its session end waits for the server's answer to a
        release. Both are noticed once a step (:meth:`build_connector_meta`), and an idle engine does not step: the
        locks of a batch aborted while its lookups were out (as at a weight update) would pin their chunks in L1,
        and keep them through the cache reset that follows, until the next request came. Not while the server is
        unhealthy: nothing will answer then (the lookups' locks expire with the server's read-lock TTL)."""
        if super().has_pending_push_work():
            return True
        if self.role != KVConnectorRole.SCHEDULER or not self.scheduler_adapter.is_healthy:
            return False
        return bool(self._orphaned_lookups) or (self.session_ends is not None and self.session_ends.awaiting_server())

    def _cleanup_lookup_result(self, request_id: str) -> None:
        """LMCache's cleanup of a request's lookup state, except for a lookup still polled after its request."""
        if request_id not in self._orphaned_lookups:
            self._drop_lookup_state(request_id)

    def _forget(self, request_id: str) -> None:
        self._admissions.pop(request_id, None)
        self._awaiting_r3.pop(request_id, None)
        self._computed_at_lookup.pop(request_id, None)
        self._locks_held_to.pop(request_id, None)
        self._store_stopped.discard(request_id)

    def _get_or_create_request_tracker(self, request: Any) -> Any:
        before = self.request_trackers.get(request.request_id)
        tracker = super()._get_or_create_request_tracker(request)
        if before is not None and tracker is not before:
            self._forget(request.request_id)  # a preempted request starts over with a fresh tracker
        return tracker

    # -- vLLM's cache reset -------------------------------------------------------------------------------------
    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, as after a weight update: LMCache's clear of L1 on
        every server, then lmcache_r3's of L1 and the lmcache_r3 tiers below it (LMCache's own clear leaves every L2
        tier as it was, and the next rollout would be served the old policy's KV and routing from there). R3 stores
        still batched or in flight land first, so none arrives after the clear. False, with the reason logged, when
        anything may still hold objects from before (a server that does not answer costs LMCache's ``mq_timeout_s``,
        once)."""
        if self.role != KVConnectorRole.SCHEDULER:
            return None
        if self.routed is not None:
            self.routed.settle(self.routed.fetch_timeout_s)
        # The lookups of requests aborted while they were out (a trainer aborts its batch at a weight update) lock
        # their hits when they complete: L1 keeps locked objects through a clear.
        self._settle_finished_lookups(RESET_LOOKUP_WAIT_S)
        if not super().reset_cache():  # a server did not answer LMCache's own clear within mq_timeout_s
            logger.error("lmcache_r3: reset_cache: LMCache's clear failed (see above); the L2 tiers were not cleared")
            return False
        cleared = True
        for answer in clear_servers(list(self.scheduler_adapter._server_urls)):
            for problem in answer.problems:
                cleared = False
                logger.error("lmcache_r3: reset_cache: %s", problem)
            if answer.no_module and self.routed is None:
                logger.warning("lmcache_r3: reset_cache: %s has no lmcache_r3 server module (a stock lmcache server?): "
                               "only its L1 was cleared, not its L2 tiers", answer.url)  # fmt: skip
            elif answer.no_module:  # routed experts need the module: its silence is a fault, not a stock server
                cleared = False
                logger.error("lmcache_r3: reset_cache: %s did not answer lmcache_r3's info; its tiers were not "
                             "cleared", answer.url)  # fmt: skip
        return cleared

    # -- vLLM's metrics ----------------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> R3ConnectorStats | None:
        """LMCache's lookup latencies, and on the scheduler what lmcache_r3 counted since the last call (vLLM asks
        after every engine step; see :mod:`lmcache_r3.mp.metrics`)."""
        stock = super().get_kv_connector_stats()  # wrapped on both roles: vLLM adds the scheduler's into the worker's
        stats = R3ConnectorStats(data=stock.data if stock is not None else {})
        if self.role == KVConnectorRole.SCHEDULER:
            now = self.counters.snapshot()
            if self.routed is not None:
                now.update(self.routed.counters.snapshot())
            stats.count(counter_deltas(now, self._stats_reported))
            self._stats_reported = now
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> R3ConnectorStats:
        return R3ConnectorStats.from_payload(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> R3PromMetrics:  # fmt: skip
        return R3PromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.r3_profile is not None and self.r3_steps:
            logger.info("lmcache_r3: routed experts took %.3f s of the %s role over %d steps (%.3f ms a step)",
                        self.r3_seconds, self.role.name.lower(), self.r3_steps,
                        1e3 * self.r3_seconds / self.r3_steps)  # fmt: skip
        adapter = getattr(self, "worker_adapter", None) or getattr(self, "scheduler_adapter", None)
        answers = shutdown_bound.server_answers(adapter)  # a server that is gone is not waited for
        if self.routed is not None:
            if answers:
                self.routed.settle(2.0)  # R3 stores still batched or in flight reach the server before it goes
            if self.routed.client is not None:
                try:
                    self.routed.client.close()
                except Exception:
                    logger.exception("lmcache_r3: closing the routed-experts client failed")
        shutdown_bound.run_shutdown(super().shutdown, answers, self.role.name.lower())

    # ==============================================================================================
    # Worker side
    # ==============================================================================================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """LMCache's registration; then bind routed-experts capture to the MoE routers (TP rank 0 sends rows)."""
        super().register_kv_caches(kv_caches)
        if self.r3_profile is None:
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._r3_sends_rows = get_tensor_model_parallel_rank() == 0
        groups = getattr(self._kv_cache_config_for_r3, "kv_cache_groups", None) or ()
        self._r3_layer = groups[self._r3_group].layer_names[0] if groups else next(iter(kv_caches))
        runners = capture.find_moe_runners(self._vllm_config)
        if runners:
            capture.require_eager_on_cpu(self._vllm_config)
            self.r3_capture = capture.RouterCapture(self._vllm_config, runners)
            logger.info("lmcache_r3: capturing routed experts of %d MoE layers (%s)",
                        len(runners), self.r3_profile.describe())  # fmt: skip

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Called before the forward pass, whatever the order of load and forward: a new capture step starts."""
        super().bind_connector_metadata(connector_metadata)
        if self.r3_capture is not None:
            self.r3_capture.begin_step()
        self._r3_collected = False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Report refused retrieves as failed loads, refuse any that would write the null block, then load."""
        metadata = self._get_connector_metadata()
        for request_id, block_ids in getattr(metadata, "failed_retrieves", ()):
            report_unsubmitted_retrieve_failed(self.worker_adapter, request_id, block_ids)
        self._refuse_null_block_ops(metadata, "RETRIEVE")
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_save(self) -> None:
        """Refuse any store that would read the null block, then store (each store's answer is kept, see
        :meth:`get_finished`); then collect this step's routed experts."""
        metadata = self._get_connector_metadata()
        self._refuse_null_block_ops(metadata, "STORE")
        if self._stores is None:
            super().wait_for_save()
        else:
            futures = self.worker_adapter.store_futures  # LMCache 0.5.6: the latest store future per request
            before = {entry.request_id: futures.get(entry.request_id) for entry in metadata.requests
                      if entry.direction == "STORE"}  # fmt: skip
            super().wait_for_save()
            for request_id, earlier in before.items():
                future = futures.get(request_id)
                if future is not None and future is not earlier:
                    self._stores.submitted(request_id, future)
        self._collect_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """LMCache's finished transfers, except a finished request with a store still out: it is reported once every
        store of it has answered, so vLLM never frees blocks a store has yet to read (:mod:`.stores_in_flight`)."""
        sending, recving = super().get_finished(finished_req_ids)
        if self._stores is None:
            return sending, recving
        return self._stores.finished_sending(sending or (), self.worker_adapter.is_healthy), recving

    def _collect_step(self) -> None:
        """This step's rows, once, after its forward pass (wait_for_save, or worker metadata when it comes first)."""
        if self._r3_collected or not self.has_connector_metadata():
            return
        self._r3_collected = True
        step = getattr(self._get_connector_metadata(), "r3_step", None)
        if self.r3_profile is not None and step is not None and self._r3_sends_rows:
            started = time.perf_counter()
            self._r3_out = self._collect_routed_experts(step)
            self.r3_seconds += time.perf_counter() - started
            self.r3_steps += 1

    def _collect_routed_experts(self, step: int) -> R3WorkerMetadata:
        """The step's rows beside their KV slots; any failure becomes the step's ``capture_error``, never rows."""
        out = R3WorkerMetadata(step=step)
        try:
            if self.r3_step_source is not None:
                slot_mapping, captured = self.r3_step_source()
            elif self.r3_capture is not None:
                mapping = capture.forward_slot_mapping(self._r3_layer)
                if mapping is None:
                    raise capture.CaptureError(f"no slot mapping for layer {self._r3_layer} in the forward context")
                slot_mapping, captured = self.r3_capture.step_rows(mapping)
            else:
                raise capture.CaptureError(
                    "the model config names MoE experts but vLLM registered no MoE layer to capture from; "
                    'set "lmcache_r3.routed_experts": false to serve it without routed experts'
                )
            out.slots, out.rows = capture.narrow_step(slot_mapping, captured, self.r3_profile)
        except (capture.CaptureError, capture.StepRowsError, GatherNarrowError) as error:
            out.capture_error = str(error)
        except Exception as error:  # a bug must cost this step's routing, never the engine
            logger.exception("lmcache_r3: mapping the routed experts of step %d failed", step)
            out.capture_error = f"{type(error).__name__}: {error}"
        return out

    def build_connector_worker_meta(self) -> Any:
        self._collect_step()
        stock = super().build_connector_worker_meta()
        out, self._r3_out = self._r3_out, None
        if out is None:
            return stock
        if stock is not None:
            out.completed_store_requests = stock.completed_store_requests
            out.failed_store_requests = stock.failed_store_requests
        return out

    def _refuse_null_block_ops(self, metadata: Any, direction: str) -> None:
        kept = []
        for entry in metadata.requests:
            if entry.direction == direction and _touches_null_block(entry.op):
                self.counters.add("null_block_ops_refused")
                logger.error("lmcache_r3: refusing a %s of request %s that names the null block: %s",
                             direction, entry.request_id, entry.op.block_ids)  # fmt: skip
                if direction == "RETRIEVE":
                    flat = [b for ids in entry.op.block_ids for b in ids if b not in (NULL_BLOCK_ID, -1)]
                    report_unsubmitted_retrieve_failed(self.worker_adapter, entry.request_id, flat)
                continue
            kept.append(entry)
        metadata.requests[:] = kept


def _destination_blocks(allocated: list[list[int]], tokens_per_block: list[int], tokens: TokenRange) -> list[int]:
    """The real (non-null) blocks the request holds for ``tokens``, in every group; what vLLM must recompute."""
    blocks: set[int] = set()
    for block_ids, group_tokens_per_block in zip(allocated, tokens_per_block, strict=True):
        if group_tokens_per_block:
            indices = planning.block_index_range(tokens, group_tokens_per_block)
            blocks.update(b for b in block_ids[indices.start : indices.stop] if b != NULL_BLOCK_ID)
    return sorted(blocks)


def _flat_block_ids(op: LoadStoreOp) -> list[int]:
    """Every block id of an operation, whether it holds one list (one group) or one list per group."""
    block_ids = op.block_ids
    groups = [block_ids] if block_ids and isinstance(block_ids[0], int) else block_ids
    return [b for ids in groups for b in ids]


def _touches_null_block(op: LoadStoreOp) -> bool:
    return any(b in (NULL_BLOCK_ID, planning.SKIPPED_BLOCK_ID) for b in _flat_block_ids(op))
