"""Scheduler side of routed experts: every request's rows, from wherever its KV came from.

Per request, rows are assembled by logical position (:class:`~lmcache_r3.artifacts.RequestRows`) from three
sources, the same three its KV comes from:

* **vLLM's prefix cache**: rows of the blocks it hit are read from the slot mirror, which holds the rows of the
  computation that last wrote each KV slot. A block being computed in this very step (a sibling request's) is
  read once its rows arrive.
* **LMCache**: the R3 objects of the chunks it hit are fetched in parallel with the KV lookup; the external hit
  is the *joint* hit, ``min(KV, R3)``; the admitted rows are written into the assembly and into the mirror at
  the slots the KV is loaded into.
* **Computed**: each step's rows from the worker.

R3 chunks are stored under the KV chunk keys for every chunk whose KV the connector stores, once the chunk's rows
are complete. When a request finishes, its rows ``[0, num_tokens - 1)`` go into the ``kv_transfer_params`` dict
returned by ``request_finished``; vLLM calls that before the last step's rows arrive, so the dict is completed in
``update_connector_output`` of the same engine step, before the output leaves the engine. Rows are never guessed:
a request whose rows are incomplete carries ``routed_experts_error`` instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmcache_r3.artifacts import (
    R3AssemblyError,
    R3CodecError,
    R3Profile,
    RequestRows,
    SlotMirror,
    SlotMirrorError,
    TokenRange,
    decode_run,
    encode_run,
)
from lmcache_r3.counters import Counters
from lmcache_r3.mp.r3_client import R3Call, R3Client, R3TimeoutError
from lmcache_r3.mp.r3_messages import R3WorkerMetadata, StepRows
from lmcache_r3.output import (
    ROUTED_EXPERTS_ERROR_KEY,
    ROUTED_EXPERTS_KEY,
    SIBLINGS_KEY,
    SOURCES_KEY,
    encode_routed_experts,
)

logger = logging.getLogger(__name__)


R3_COUNTERS = (
    "fetches",
    "fetch_failures",
    "r3_hit_chunks",
    "joint_hits_shrunk",
    "rows_from_lmcache",
    "rows_from_prefix_cache",
    "rows_computed",
    "chunks_published",
    "store_failures",
    "requests_completed",
    "requests_incomplete",
)
"""What the routed-experts bookkeeping did (tests, logs, benchmarks)."""


@dataclass
class _PendingFetch:
    start: int
    call: R3Call | None


@dataclass
class _RequestState:
    request: Any
    rows: RequestRows
    fetch: _PendingFetch | None = None
    fetched: tuple[int, np.ndarray] | None = None
    """``(start, rows)`` of the R3 chunks LMCache returned for the current lookup."""
    admitted_external: int = 0
    local_pending: list[tuple[TokenRange, tuple[int, ...]]] = field(default_factory=list)
    """Prefix-cache ranges whose rows are not in the mirror yet (their blocks are computed in this step)."""
    blocks: list[int] = field(default_factory=list)
    """The request's blocks in the mirrored group."""
    served: tuple[int, int] = (0, 0)
    """Tokens of the latest (re)start served by vLLM's prefix cache and by LMCache, with their rows."""
    store_start: int | None = None
    kv_store_end: int = 0
    published_end: int = 0
    incomplete: str | None = None


@dataclass
class _Finishing:
    params: dict[str, Any]
    num_tokens: int


class RoutedExpertsBook:
    """Routed-experts state of the scheduler-side connector (see the module docstring)."""

    def __init__(
        self,
        profile: R3Profile,
        chunk_size: int,
        block_size: int,
        num_blocks: int,
        client: R3Client | None,
        fetch_timeout_s: float,
    ) -> None:
        self.profile = profile
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.mirror = SlotMirror(profile, num_blocks, block_size)
        self.client = client
        self.fetch_timeout_s = fetch_timeout_s
        self.counters = Counters(*R3_COUNTERS)
        self._requests: dict[str, _RequestState] = {}
        self._finishing: dict[str, _Finishing] = {}
        self._siblings: dict[str, dict[str, str]] = {}
        self._stores: list[tuple[str, R3Call]] = []
        self._dirty: set[str] = set()
        """Requests whose rows, pending reads or store window changed: the ones to resolve and publish."""
        self.retry_after_s = 10.0
        self._quiet_until = 0.0

    def probe_server(self, timeout_s: float) -> bool:
        """Ask the server for its R3 module once (at start); log how to fix a server without it."""
        if self.client is None:
            return False
        try:
            info = self.client.info().result(timeout=timeout_s)
        except Exception as error:
            logger.error(
                "lmcache_r3: the LMCache server at %s does not answer R3 calls (%s). Without the R3 chunk type every "
                "LMCache hit is recomputed: run the server with `lmcache-r3 server` (r3.enabled: true in "
                'LMCACHE_CONFIG_FILE), or turn routed experts off with "lmcache_r3.routed_experts": false',
                self.client.server_url,
                error,
            )
            return False
        if info.chunk_size != self.chunk_size:
            logger.error("lmcache_r3: the server's R3 chunk size is %d but the connector's is %d; no hit will match",
                         info.chunk_size, self.chunk_size)  # fmt: skip
        return True

    # -- lookup ----------------------------------------------------------------------------------------------
    def _state(self, request: Any) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            capacity = request.num_prompt_tokens + min(request.max_tokens or 0, 256)  # grows by doubling past it
            state = _RequestState(request, RequestRows(self.profile, self.chunk_size, capacity_tokens=capacity))
            self._requests[request.request_id] = state
        return state

    def begin_lookup(self, request: Any, num_computed_tokens: int) -> None:
        """Start fetching R3 of the chunks past the local hit, beside LMCache's KV lookup (once per lookup)."""
        state = self._state(request)
        if state.fetch is not None:
            return
        start = num_computed_tokens - num_computed_tokens % self.chunk_size
        tokens = request.all_token_ids
        end = len(tokens) - len(tokens) % self.chunk_size
        call = None
        if self._server_answers() and end > start:
            self.counters.add("fetches")
            call = self.client.fetch(list(tokens[:end]), start, end, cache_salt=request.cache_salt or "")
        state.fetch = _PendingFetch(start, call)
        state.fetched = None

    def joint_hit_end(self, request: Any, kv_hit_tokens: int) -> int:
        """Where the joint KV+R3 hit ends: ``kv_hit_tokens`` cut at the first chunk without valid R3.

        Waits for the fetch started by :meth:`begin_lookup` (normally already answered: it ran beside the KV
        lookup), at most the client's bound. A failed fetch is an R3 miss.
        """
        state = self._state(request)
        fetch, state.fetch = state.fetch, None
        if fetch is None or fetch.call is None:
            return min(kv_hit_tokens, fetch.start if fetch else 0)
        try:
            response = fetch.call.result(timeout=self.fetch_timeout_s)
            decoded = decode_run(response.objects, self.profile, fetch.start, self.chunk_size)
        except Exception as error:  # a dead or slow server, a refused call: recompute rather than guess
            self.counters.add("fetch_failures")
            if isinstance(error, R3TimeoutError):
                self._quiet_until = time.monotonic() + self.retry_after_s
            logger.warning("lmcache_r3: R3 fetch for %s failed (%s); its LMCache hit is dropped",
                           request.request_id, error)  # fmt: skip
            return min(kv_hit_tokens, fetch.start)
        if decoded.error is not None:
            logger.warning("lmcache_r3: R3 of %s ends at a damaged object: %s", request.request_id, decoded.error)
        chunks = decoded.chunks
        self.counters.add("r3_hit_chunks", len(chunks))
        if chunks:
            state.fetched = (fetch.start, np.concatenate([chunk.rows for chunk in chunks]))
        r3_end = fetch.start + len(chunks) * self.chunk_size
        if r3_end < kv_hit_tokens:
            self.counters.add("joint_hits_shrunk")
        return min(kv_hit_tokens, r3_end)

    def end_lookup(self, request: Any) -> None:
        """The lookup found nothing to load past the local hit: the R3 fetch's answer is not needed."""
        state = self._state(request)
        state.fetch = None
        state.fetched = None

    def admitted(self, request_id: str, num_external_tokens: int) -> None:
        """The scheduler admitted ``num_external_tokens`` from LMCache past the local hit."""
        state = self._requests.get(request_id)
        if state is not None:
            state.admitted_external = num_external_tokens

    # -- scheduling --------------------------------------------------------------------------------------------
    def on_schedule(self, scheduler_output: Any, group: int) -> dict[str, StepRows]:
        """Account for this step's allocations and return what the worker must capture, per request.

        Args:
            scheduler_output: the step's ``SchedulerOutput`` (built before vLLM advances ``num_computed_tokens``).
            group: the KV cache group whose blocks key the slot mirror.
        """
        fresh: list[int] = []
        starting: list[tuple[_RequestState, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.blocks = list(new.block_ids[group])
            fresh += state.blocks[self._hit_blocks(new.num_computed_tokens) :]
            starting.append((state, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            state = self._requests.get(request_id)
            new_ids = cached.new_block_ids[index]
            if state is None or not new_ids:
                continue
            if request_id in cached.resumed_req_ids:  # preempted and back: its whole block table is new
                computed = cached.num_computed_tokens[index]
                state.blocks = list(new_ids[group])
                fresh += state.blocks[self._hit_blocks(computed) :]
                starting.append((state, computed))
            else:
                fresh += new_ids[group]
                state.blocks += new_ids[group]
        if fresh:
            # A block handed out for computing holds no valid rows until its writer's rows arrive.
            self.mirror.forget_blocks(fresh)
        for state, computed in starting:
            self._restore_rows(state, computed)
        plans: dict[str, StepRows] = {}
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(request_id)
            if state is None:
                continue
            start = state.request.num_computed_tokens
            first = start // self.block_size
            last = (start + num_tokens - 1) // self.block_size + 1
            plans[request_id] = StepRows(start, num_tokens, first, tuple(state.blocks[first:last]))
        return plans

    def _hit_blocks(self, num_computed_tokens: int) -> int:
        """Blocks that hold already-computed tokens (a partly filled last block counts: its slots are written)."""
        return -(-num_computed_tokens // self.block_size)

    def _restore_rows(self, state: _RequestState, computed: int) -> None:
        """Rows of a (re)starting request's first ``computed`` tokens: prefix cache, then LMCache."""
        external = state.admitted_external if state.fetched is not None else 0
        state.admitted_external = 0
        local = TokenRange(0, computed - external)
        state.served = (local.end, external)
        blocks = tuple(state.blocks)
        state.local_pending = [(local, blocks)] if local.end > 0 else []
        if external:
            fetched_start, fetched = state.fetched
            ext = TokenRange(local.end, computed)
            rows = fetched[ext.start - fetched_start : ext.end - fetched_start]
            if ext.start < fetched_start or rows.shape[0] != ext.end - ext.start:
                state.incomplete = f"LMCache returned R3 for fewer tokens than the {ext} admitted"
            else:
                self._write(state, ext.start, rows)
                self.mirror.write(self.mirror.slots_for(blocks, ext.start, ext.end), rows)
                self.counters.add("rows_from_lmcache", rows.shape[0])
        state.fetched = None
        self._read_local(state)
        self._dirty.add(state.request.request_id)

    def _read_local(self, state: _RequestState) -> None:
        still = []
        for tokens, blocks in state.local_pending:
            try:
                rows = self.mirror.read(blocks, tokens.start, tokens.end)
            except SlotMirrorError:
                still.append((tokens, blocks))
                continue
            self._write(state, tokens.start, rows)
            self.counters.add("rows_from_prefix_cache", rows.shape[0])
        state.local_pending = still

    def _write(self, state: _RequestState, start: int, rows: np.ndarray) -> None:
        try:
            state.rows.write(start, rows)
        except R3AssemblyError as error:
            state.incomplete = str(error)

    def on_store(self, request_id: str, start: int, end: int) -> None:
        """The connector stores the KV of ``[start, end)``: its R3 follows once the rows are complete."""
        state = self._requests.get(request_id)
        if state is None:
            return
        if state.store_start is None or start < state.store_start:
            state.store_start = start - start % self.chunk_size
            state.published_end = max(state.published_end, state.store_start)
        state.kv_store_end = max(state.kv_store_end, end)
        self._dirty.add(request_id)

    # -- step results ------------------------------------------------------------------------------------------
    def on_worker_output(self, worker_meta: Any) -> None:
        """Write a step's rows, resolve prefix-cache reads, publish complete chunks, complete finished requests."""
        if isinstance(worker_meta, R3WorkerMetadata):
            if worker_meta.capture_error:
                logger.error("lmcache_r3: routed experts not captured: %s", worker_meta.capture_error)
            for request_id in worker_meta.unmapped_requests:
                state = self._requests.get(request_id)
                if state is not None:
                    state.incomplete = "the routing of a step could not be mapped to this request's positions"
            steps = list(worker_meta.rows.values())
            if steps:  # one mirror write for the whole step
                self.mirror.write(np.concatenate([step.slots for step in steps]),
                                  np.concatenate([step.rows for step in steps]))  # fmt: skip
            for request_id, step in worker_meta.rows.items():
                state = self._requests.get(request_id)
                if state is not None:
                    self._write(state, step.start, step.rows)
                    # vLLM has already taken back the tokens a speculative step rejected: rows of positions past
                    # num_computed_tokens ran on rejected drafts and are dropped, never published or returned.
                    if state.rows.present.end > state.request.num_computed_tokens:
                        state.rows.truncate(state.request.num_computed_tokens)
                    self._dirty.add(request_id)
            self.counters.add("rows_computed", sum(step.rows.shape[0] for step in steps))
        for request_id in list(self._dirty):
            state = self._requests.get(request_id)
            if state is not None:
                if state.local_pending:
                    self._read_local(state)
                self._publish(state)
        self._dirty = {request_id for request_id in self._dirty if self._needs_another_look(request_id)}
        self._finish()
        self._reap_stores()

    def _needs_another_look(self, request_id: str) -> bool:
        """Rows still to read from the mirror: look again after the next step's rows arrive."""
        state = self._requests.get(request_id)
        return state is not None and bool(state.local_pending)

    def _server_answers(self) -> bool:
        """False for ``retry_after_s`` after a call timed out: a dead server costs one bounded wait, not many."""
        return self.client is not None and time.monotonic() >= self._quiet_until

    def _publish(self, state: _RequestState) -> None:
        if not self._server_answers() or state.store_start is None or state.incomplete:
            return
        size = self.chunk_size
        present = state.rows.present
        if present.start > state.published_end:
            return
        end = min(present.end, state.kv_store_end)
        end -= end % size
        start = state.published_end
        if end <= start:
            return
        request = state.request
        objects = encode_run(self.profile, start, np.ascontiguousarray(state.rows.rows(start, end)), size)
        call = self.client.store(list(request.all_token_ids[:end]), start, objects, end, request.cache_salt or "")
        self._stores.append((request.request_id, call))
        state.published_end = end
        self.counters.add("chunks_published", (end - start) // size)

    def _reap_stores(self) -> None:
        waiting = []
        for request_id, call in self._stores:
            if not call.done():
                waiting.append((request_id, call))
                continue
            try:
                call.result(timeout=0)
            except Exception as error:
                self.counters.add("store_failures")
                if isinstance(error, R3TimeoutError):
                    self._quiet_until = time.monotonic() + self.retry_after_s
                logger.warning("lmcache_r3: R3 store for %s failed: %s", request_id, error)
        self._stores = waiting

    # -- finish ------------------------------------------------------------------------------------------------
    def request_finished(self, request: Any, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """The dict vLLM returns as ``kv_transfer_params``; its routed experts are filled in this engine step."""
        from vllm.v1.request import RequestStatus

        state = self._requests.get(request.request_id)
        if state is None:
            return params
        if request.status == RequestStatus.FINISHED_ABORTED:
            self._requests.pop(request.request_id, None)  # never published past what was complete; nothing to return
            return params
        params = {} if params is None else params
        self._finishing[request.request_id] = _Finishing(params, request.num_tokens)
        return params

    def _finish(self) -> None:
        for request_id, finishing in list(self._finishing.items()):
            state = self._requests.pop(request_id)
            del self._finishing[request_id]
            params = finishing.params
            vllm_cached, lmcache = state.served
            params[SOURCES_KEY] = {
                "vllm_cached_tokens": vllm_cached,
                "lmcache_tokens": lmcache,
                "computed_tokens": finishing.num_tokens - 1 - vllm_cached - lmcache,
            }
            try:
                if state.incomplete:
                    raise R3AssemblyError(state.incomplete)
                routed = state.rows.materialize(finishing.num_tokens)
            except (R3AssemblyError, R3CodecError) as error:
                self.counters.add("requests_incomplete")
                params[ROUTED_EXPERTS_ERROR_KEY] = f"routed experts of request {request_id} are incomplete: {error}"
                logger.error("lmcache_r3: %s", params[ROUTED_EXPERTS_ERROR_KEY])
                continue
            self.counters.add("requests_completed")
            encoded = encode_routed_experts(routed)
            params[ROUTED_EXPERTS_KEY] = encoded
            index, _, parent = request_id.partition("_")
            if index.isdigit() and parent:
                # The front end of parallel sampling keeps only the last child's params: every child carries the
                # routing of the siblings finished so far, in one dict they share.
                group = self._siblings.setdefault(parent, {})
                group[index] = encoded
                params[SIBLINGS_KEY] = group
                if not any(other.endswith(f"_{parent}") for other in self._requests):
                    del self._siblings[parent]  # the last child: the group lives on in the params only

    def forget(self, request_id: str) -> None:
        """Drop a request's state without output (aborted, or its lookup state reset)."""
        self._requests.pop(request_id, None)
        self._finishing.pop(request_id, None)

    def settle(self, timeout_s: float) -> None:
        """Wait (bounded) for R3 stores in flight; for shutdown and tests."""
        deadline = time.monotonic() + timeout_s
        while self._stores and time.monotonic() < deadline:
            self._reap_stores()
            time.sleep(0.005)
