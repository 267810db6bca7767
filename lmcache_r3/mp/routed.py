"""Scheduler side of routed experts: every request's rows, from wherever its KV came from.

The scheduler keeps one R3 row per physical KV slot (:class:`~lmcache_r3.artifacts.SlotMirror`): the row of the
computation that last wrote the slot's KV or, for KV loaded from LMCache, the row LMCache returned with it. A
request's rows are read through its block table, and only while it holds those blocks (vLLM never reuses a held
block), so they are the routing of exactly the KV the request attends to, whichever of three sources it came from:

* **computed**: every step, the worker sends the step's rows beside the KV slots its tokens wrote
  (:class:`~lmcache_r3.mp.r3_messages.R3WorkerMetadata`): one mirror write a step, whatever the batch;
* **vLLM's prefix cache**: the slots of the blocks it hit hold the rows of the request that computed them (one
  computing them in the same step writes them before anything reads them);
* **LMCache**: the R3 objects of the chunks it hit are fetched in parallel with the KV lookup; the external hit is
  the *joint* hit, ``min(KV, R3)``; the admitted rows are written at the slots the KV is loaded into.

Every block handed out for computing or loading is marked unwritten first, so a slot read before its row came is
an error, never another request's row. Rows are read only when needed. R3 chunks are stored under the KV chunk
keys once the step that computes the last token of a stored KV range has reported its rows. When a request
finishes, its rows ``[0, num_tokens - 1)`` go into the ``kv_transfer_params`` dict returned by ``request_finished``;
vLLM calls that before the last step's rows arrive, so the dict is completed in ``update_connector_output`` of the
same engine step, before the output leaves the engine (the blocks were freed in between, but nothing is allocated
before the next schedule). Rows are never guessed: a request whose rows are incomplete carries
``routed_experts_error`` instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmcache_r3.artifacts import (
    R3Profile,
    SlotMirror,
    SlotMirrorError,
    decode_run,
    encode_run,
)
from lmcache_r3.counters import Counters
from lmcache_r3.mp.r3_client import FetchSpec, R3Call, R3Client, R3TimeoutError, StoreSpec
from lmcache_r3.mp.r3_messages import R3WorkerMetadata
from lmcache_r3.mp.unsent_stores import UnsentStores
from lmcache_r3.output import (
    FINGERPRINT_KEY,
    ROUTED_EXPERTS_ERROR_KEY,
    ROUTED_EXPERTS_KEY,
    SIBLING_ERRORS_KEY,
    SIBLING_FINGERPRINTS_KEY,
    SIBLINGS_KEY,
    SOURCES_KEY,
    encode_routed_experts,
    token_fingerprint,
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
    "requests_local_only",
)
"""What the routed-experts bookkeeping did (tests, logs, benchmarks)."""


@dataclass
class _PendingFetch:
    start: int
    spec: FetchSpec | None = None
    """What to fetch, until the fetch is sent (with the other fetches of the engine step, in one call)."""
    call: R3Call | None = None
    """The call it was sent in, and its place there."""
    index: int = 0
    end: int | None = None
    """Where its R3 hit ends, once it answered: vLLM asks again when it could not allocate the request, and the
    same answer serves (R3 objects never change)."""


@dataclass
class _RequestState:
    request: Any
    fetch: _PendingFetch | None = None
    fetched: tuple[int, np.ndarray] | None = None
    """``(start, rows)`` of the R3 chunks LMCache returned for the current lookup."""
    admitted: tuple[int, int] = (0, 0)
    """``(local hit, external tokens)`` of the latest admission from LMCache, until the request (re)starts."""
    blocks: list[int] = field(default_factory=list)
    """The request's block table in the mirrored group: where its rows are read."""
    served: tuple[int, int] = (0, 0)
    """Tokens of the latest (re)start served by vLLM's prefix cache and by LMCache, with their rows."""
    store_start: int | None = None
    kv_store_end: int = 0
    published_end: int = 0
    incomplete: str | None = None
    """Why this request's rows cannot be complete (sticky: its output then carries the reason, never rows)."""
    local_only: bool = False
    """Its chunks have no R3 key: LMCache keys the KV of multimodal inputs by the inputs' hashes, which the token ids
    (all an R3 key holds) do not carry. Such a request neither fetches nor publishes R3: its LMCache hit is
    recomputed, its rows (computed, or from vLLM's own prefix cache) are exact."""


@dataclass
class _Siblings:
    """The children of one parallel-sampling request (vLLM's front end keeps only the last child's params)."""

    rows: dict[str, str] = field(default_factory=dict)
    """Per child index, its encoded rows: the dicts every child's params share."""
    fingerprints: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    """Per child index whose rows are incomplete, why."""
    live: set[str] = field(default_factory=set)
    """The indices of the children that have not ended yet."""
    idle_since: float | None = None
    """When its last live child ended (a later child may still be on its way: vLLM's async front end adds the
    children one call each)."""


def _child_of(request_id: str) -> tuple[str, str] | None:
    """``(index, parent)`` of a parallel-sampling child's id (``"<index>_<parent>"``), else None."""
    index, _, parent = request_id.partition("_")
    return (index, parent) if index.isdigit() and parent else None


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
        store_batch_steps: int = 0,
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
        self._siblings: dict[str, _Siblings] = {}
        """Parallel sampling: per parent request, its children's rows and fingerprints, and those still to end."""
        self._stores: list[tuple[tuple[str, ...], R3Call]] = []
        self._fetch_queue: list[tuple[str, _PendingFetch]] = []
        self._next_step = 0
        self._copies: dict[int, list[tuple[int, int]]] = {}
        """Per step, the ``(src, dst)`` blocks vLLM copies on write before it (a hit ending inside a block): applied to
        the mirror once the earlier steps' rows are in, before the step's own."""
        self._in_flight: dict[int, Any] = {}
        """Per step sent to the worker for capture, its ``num_scheduled_tokens`` (the requests it computes)."""
        self._reported = -1
        """The latest step whose rows the worker reported: rows of every earlier step are in the mirror too."""
        self._publish_due: dict[str, int] = {}
        """Per request with KV stored past its published R3, the step after whose report the rows are there."""
        self._unsent = UnsentStores(store_batch_steps)
        """R3 read from the mirror, to go out in one store call with later ones (see :mod:`.unsent_stores`)."""
        self.retry_after_s = 10.0
        self.sibling_grace_s = 30.0
        """How long a parallel-sampling group whose children all ended waits for one more (see ``_child_ended``)."""
        self._quiet_until = 0.0

    @property
    def store_batch_steps(self) -> int:
        """Reported steps the R3 of prompt tokens may wait to go out in one store call with later ones."""
        return self._unsent.batch_steps

    def probe_server(self, timeout_s: float) -> bool:
        """Ask the server for its R3 module once (at start); log how to fix a server without it.

        A server that does not answer is not sent R3 calls for ``retry_after_s``, as after a call that timed out:
        the first lookups recompute at once instead of each waiting out the bound.
        """
        if self.client is None:
            return False
        try:
            info = self.client.info().result(timeout=timeout_s)
        except Exception as error:
            self._quiet_until = time.monotonic() + self.retry_after_s
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
    def on_new_request(self, request_id: str) -> None:
        """vLLM added a request (the children of a parallel-sampling request arrive within moments of each other)."""
        child = _child_of(request_id)
        if child is not None:
            group = self._siblings.setdefault(child[1], _Siblings())
            group.live.add(child[0])
            group.idle_since = None

    def _state(self, request: Any) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
        return state

    def begin_lookup(self, request: Any, num_computed_tokens: int) -> None:
        """Start fetching R3 of the chunks past the local hit, beside LMCache's KV lookup.

        Once per lookup: vLLM asks again every step while LMCache's KV lookup is pending, and again after it
        answered when it could not allocate the request; the pending fetch, then its answer, serves unless the local
        hit shrank below where it starts (a waiting request's cached blocks were evicted).
        """
        state = self._state(request)
        start = num_computed_tokens - num_computed_tokens % self.chunk_size
        if state.fetch is not None and state.fetch.start <= start:
            return
        tokens = request.all_token_ids
        end = len(tokens) - len(tokens) % self.chunk_size
        state.fetch = _PendingFetch(start)
        state.fetched = None
        if request.mm_features and not state.local_only:
            state.local_only = True
            self.counters.add("requests_local_only")
        if self._server_answers() and end > start and not state.local_only:
            self.counters.add("fetches")
            state.fetch.spec = (list(tokens[:end]), start, end, request.cache_salt or "")
            self._fetch_queue.append((request.request_id, state.fetch))

    def send_fetches(self) -> None:
        """Send the R3 fetches queued since the last call as one call (once per engine step, and whenever a KV
        lookup answers before its fetch was sent)."""
        queued, self._fetch_queue = self._fetch_queue, []
        live = [
            fetch for request_id, fetch in queued if getattr(self._requests.get(request_id), "fetch", None) is fetch
        ]
        if live:
            call = self.client.fetch_many([fetch.spec for fetch in live])
            for index, fetch in enumerate(live):
                fetch.call, fetch.index, fetch.spec = call, index, None

    def fetch_pending(self, request: Any) -> bool:
        """Whether the R3 fetch of this request's lookup is still out and within its bound (sent now if it was still
        queued): :meth:`joint_hit_end` would wait for it."""
        state = self._requests.get(request.request_id)
        fetch = state.fetch if state is not None else None
        if fetch is None or fetch.end is not None:
            return False
        if fetch.spec is not None:
            self.send_fetches()  # the KV lookup answered before this step's fetches went out
        return fetch.call is not None and fetch.call.pending()

    def joint_hit_end(self, request: Any, kv_hit_tokens: int) -> int:
        """Where the joint KV+R3 hit ends: ``kv_hit_tokens`` cut at the first chunk without valid R3.

        Waits for the fetch started by :meth:`begin_lookup` (normally already answered: it ran beside the KV
        lookup), at most the client's bound. A failed fetch is an R3 miss.
        """
        state = self._state(request)
        fetch = state.fetch
        if fetch is None:
            return 0
        if fetch.end is None:  # its first answer; an ask again reuses it
            fetch.end = self._fetched_end(state, fetch, request)
            if fetch.end < kv_hit_tokens:
                self.counters.add("joint_hits_shrunk")
        return min(kv_hit_tokens, fetch.end)

    def _fetched_end(self, state: _RequestState, fetch: _PendingFetch, request: Any) -> int:
        """Where the R3 hit of ``fetch`` ends (its start when it failed); keeps the rows it returned."""
        if fetch.spec is not None:
            self.send_fetches()  # the KV lookup answered before this step's fetches went out
        if fetch.call is None:
            return fetch.start
        try:
            response = fetch.call.result(timeout=self.fetch_timeout_s).results[fetch.index]
            decoded = decode_run(response.objects, self.profile, fetch.start, self.chunk_size)
        except Exception as error:  # a dead or slow server, a refused call: recompute rather than guess
            self.counters.add("fetch_failures")
            if isinstance(error, R3TimeoutError):
                self._quiet_until = time.monotonic() + self.retry_after_s
            logger.warning("lmcache_r3: R3 fetch for %s failed (%s); its LMCache hit is dropped",
                           request.request_id, error)  # fmt: skip
            return fetch.start
        if decoded.error is not None:
            logger.warning("lmcache_r3: R3 of %s ends at a damaged object: %s", request.request_id, decoded.error)
        chunks = decoded.chunks
        self.counters.add("r3_hit_chunks", len(chunks))
        if chunks:
            state.fetched = (fetch.start, np.concatenate([chunk.rows for chunk in chunks]))
        return fetch.start + len(chunks) * self.chunk_size

    def lookup_asked(self, request_id: str) -> None:
        """vLLM looks the request up (it computed nothing yet: new, preempted, or back from a load that failed
        before its first valid block): an admission from an earlier lookup no longer describes how it starts."""
        state = self._requests.get(request_id)
        if state is not None:
            state.admitted = (0, 0)

    def end_lookup(self, request: Any) -> None:
        """The lookup found nothing to load past the local hit: the R3 fetch's answer is not needed."""
        state = self._state(request)
        state.fetch = None
        state.fetched = None

    def admitted(self, request_id: str, num_local_tokens: int, num_external_tokens: int) -> None:
        """The scheduler admitted ``num_external_tokens`` from LMCache past a local hit of ``num_local_tokens``."""
        state = self._requests.get(request_id)
        if state is not None:
            state.admitted = (num_local_tokens, num_external_tokens)

    # -- scheduling --------------------------------------------------------------------------------------------
    def on_schedule(self, scheduler_output: Any, group: int) -> int | None:
        """Account for this step's block allocations; the step number the worker captures, or None.

        Args:
            scheduler_output: the step's ``SchedulerOutput`` (built before vLLM advances ``num_computed_tokens``).
            group: the KV cache group whose blocks key the slot mirror.

        Returns:
            The step's number, for ``r3_step`` in the connector metadata; None when no request with routed experts
            computes anything in it.
        """
        if self._fetch_queue:
            self.send_fetches()  # the lookups of this engine step are done: one call fetches all their R3
        for request_id in scheduler_output.preempted_req_ids or ():
            self._preempted(request_id)
        step = self._next_step
        self._next_step += 1
        copies = [(copy.src_block_id, copy.dst_block_id) for copy in scheduler_output.kv_cache_block_copies or ()]
        if copies:
            self._copies[step] = copies
        fresh: list[int] = []
        starting: list[tuple[_RequestState, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.blocks = list(new.block_ids[group])
                starting.append((state, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for index, new_ids in enumerate(cached.new_block_ids):
            if not new_ids:  # most steps: no request got a block
                continue
            request_id = cached.req_ids[index]
            state = self._requests.get(request_id)
            if state is None:
                continue
            if request_id in cached.resumed_req_ids:  # preempted and back: its whole block table is new
                state.blocks = list(new_ids[group])
                starting.append((state, cached.num_computed_tokens[index]))
            else:
                fresh += new_ids[group]
                state.blocks += new_ids[group]
        restarts = [(state, computed, self._local_hit(state, computed)) for state, computed in starting]
        for state, _, local_end in restarts:
            # Blocks past vLLM's own hit are computed or loaded from LMCache: none holds a valid row yet.
            fresh += state.blocks[self._hit_blocks(local_end) :]
        if fresh:
            self.mirror.forget_blocks(fresh)
        for state, computed, local_end in restarts:
            self._restore_rows(state, computed, local_end)
        if not scheduler_output.num_scheduled_tokens or not self._requests:
            return None  # its copies are applied with the next step's rows
        self._in_flight[step] = scheduler_output.num_scheduled_tokens
        return step

    def _preempted(self, request_id: str) -> None:
        """vLLM freed the request's blocks: no row is read through them again, as another request may compute into
        them before this one is scheduled again with a new block table. R3 still to publish waits for that table (an
        LMCache hit can set ``num_computed_tokens`` while the request waits unscheduled): a store of the new run
        makes it due again, and it is read from the rows of the new run."""
        state = self._requests.get(request_id)
        if state is not None:
            state.blocks = []
            self._publish_due.pop(request_id, None)
            self._unsent.flush_for(request_id)  # its own next lookup may hit the KV of the tokens it generated

    def _apply_copies(self, through: int) -> None:
        """Apply the block copies of every step up to ``through``, in step order."""
        for step in sorted(step for step in self._copies if step <= through):
            self.mirror.copy_blocks(self._copies.pop(step))

    def _hit_blocks(self, num_hit_tokens: int) -> int:
        """Blocks holding tokens of vLLM's own hit (a partly filled last block counts: its slots are written)."""
        return -(-num_hit_tokens // self.block_size)

    @staticmethod
    def _local_hit(state: _RequestState, computed: int) -> int:
        """Where vLLM's own hit ends for a request (re)starting with ``computed`` tokens; LMCache's follow it.

        A load that failed (in part) restarts the request with fewer computed tokens than admitted.
        """
        local, external = state.admitted
        return min(local, computed) if external else computed

    def _restore_rows(self, state: _RequestState, computed: int, local_end: int) -> None:
        """A (re)starting request's first ``computed`` tokens: vLLM's hit, then LMCache's rows into the mirror."""
        admitted_external = state.admitted[1]
        state.admitted = (0, 0)
        fetched, state.fetched, state.fetch = state.fetched, None, None
        external = computed - local_end
        state.served = (local_end, external)
        self.counters.add("rows_from_prefix_cache", local_end)
        if not external:
            return
        rows = None
        if fetched is not None and external <= admitted_external and local_end >= fetched[0]:
            rows = fetched[1][local_end - fetched[0] : computed - fetched[0]]
        if rows is None or rows.shape[0] != external:
            # Never read these slots as if vLLM had computed them: their blocks were forgotten above.
            state.incomplete = f"LMCache served the KV of [{local_end}, {computed}) without the R3 of those tokens"
            return
        self.mirror.write(self.mirror.slots_for(state.blocks, local_end, computed), rows)
        self.counters.add("rows_from_lmcache", external)

    def on_store(self, request_id: str, start: int, end: int) -> None:
        """The connector stores the KV of ``[start, end)`` in the step being built: its R3 follows once the step's
        rows are in."""
        state = self._requests.get(request_id)
        if state is None:
            return
        if state.store_start is None or start < state.store_start:
            state.store_start = start - start % self.chunk_size
            state.published_end = max(state.published_end, state.store_start)
        state.kv_store_end = max(state.kv_store_end, end)
        self._publish_due[request_id] = self._next_step

    # -- step results ------------------------------------------------------------------------------------------
    def on_worker_output(self, worker_meta: Any) -> None:
        """Write a step's rows into the mirror, publish the R3 chunks now complete, complete finished requests."""
        if isinstance(worker_meta, R3WorkerMetadata) and worker_meta.step is not None:
            self._take_step(worker_meta)
        if self._publish_due:
            self._publish_due_chunks()
        if self._unsent.due(self._reported):  # see lmcache_r3.mp.unsent_stores
            self._send_stores()
        if self._finishing:
            self._finish()
        if self._stores:
            self._reap_stores()

    def _take_step(self, meta: R3WorkerMetadata) -> None:
        step = meta.step
        if self._copies:
            self._apply_copies(step)
        if meta.capture_error:
            logger.error("lmcache_r3: routed experts not captured: %s", meta.capture_error)
            self._refuse_step(step, f"the routing of engine step {step} was not captured")
        elif meta.rows is not None and meta.rows.shape[0]:
            try:
                self.mirror.queue(meta.slots, meta.rows)  # applied before anything reads or forgets a slot
            except SlotMirrorError as error:  # slots this mirror does not have: never guess where the rows go
                logger.error("lmcache_r3: the routed experts of engine step %s were refused: %s", step, error)
                self._refuse_step(step, f"the routing of engine step {step} was refused: {error}")
            else:
                self._in_flight.pop(step, None)
                self.counters.add("rows_computed", meta.rows.shape[0])
        else:
            self._in_flight.pop(step, None)
        if self._in_flight and min(self._in_flight) < step:  # steps still unreported are lost (they come in order)
            for lost in [earlier for earlier in self._in_flight if earlier < step]:
                self._refuse_step(lost, f"the routing of engine step {lost} never arrived from the worker")
        self._reported = max(self._reported, step)

    def _refuse_step(self, step: int, reason: str) -> None:
        """A step's rows are missing: its requests' routing is incomplete, and so is that of their blocks."""
        scheduled = self._in_flight.pop(step, None) or {}
        blocks: set[int] = set()
        for request_id in scheduled:
            state = self._requests.get(request_id)
            if state is not None:
                state.incomplete = reason
                blocks.update(state.blocks)
        if blocks:
            # Their KV was (re)computed without a row: no later prefix hit may read an older row there.
            self.mirror.forget_blocks(sorted(blocks))

    def _server_answers(self) -> bool:
        """False for ``retry_after_s`` after a call timed out: a dead server costs one bounded wait, not many."""
        return self.client is not None and time.monotonic() >= self._quiet_until

    def _publish_due_chunks(self) -> None:
        """Read the R3 of every request whose stored KV range the reported steps completed, for the next store call.

        The rows are read now, while the requests hold their blocks; :meth:`_send_stores` sends them.
        """
        for request_id, due in list(self._publish_due.items()):
            if due > self._reported:
                continue
            del self._publish_due[request_id]
            state = self._requests.get(request_id)
            item = self._publishable(state) if state is not None else None
            if item is not None:
                prompt_chunks = item[1] + self.chunk_size <= state.request.num_prompt_tokens
                self._unsent.add(request_id, item, prompt_chunks, self._reported)

    def _send_stores(self) -> None:
        """Send every unsent R3 store in one call."""
        if self._unsent:
            items, publishers = self._unsent.take()
            self._stores.append((publishers, self.client.store_many(items)))

    def _publishable(self, state: _RequestState) -> StoreSpec | None:
        """The store of the R3 chunks whose KV is stored and whose rows are in: ``[published_end, end)``."""
        if not self._server_answers() or state.store_start is None or state.incomplete or state.local_only:
            return None
        size = self.chunk_size
        request = state.request
        # Tokens past num_computed_tokens ran on speculative drafts vLLM rejected: never published. Tokens of steps
        # still in flight (async scheduling) have no rows yet: after a preemption their blocks may be new ones.
        end = min(state.kv_store_end, request.num_computed_tokens - request.num_in_flight_tokens)
        end -= end % size
        start = state.published_end
        item = None
        if end > start:
            try:
                rows = self.mirror.read(state.blocks, start, end)
            except SlotMirrorError as error:
                state.incomplete = str(error)
                return None
            objects = encode_run(self.profile, start, rows, size)
            item = (list(request.all_token_ids[:end]), start, objects, end, request.cache_salt or "")
            state.published_end = end
            self.counters.add("chunks_published", (end - start) // size)
        if state.published_end + size <= state.kv_store_end:
            self._publish_due[request.request_id] = self._reported + 1  # rows still to come (rejected drafts)
        return item

    def _reap_stores(self) -> None:
        """Count the store calls answered or past their bound; a timeout pauses R3 stores and fetches (see
        :meth:`_server_answers`), so a dead server does not pile up calls."""
        waiting = []
        for request_ids, call in self._stores:
            if call.pending():
                waiting.append((request_ids, call))
                continue
            try:
                call.result(timeout=0)
            except Exception as error:
                self.counters.add("store_failures")
                if isinstance(error, R3TimeoutError):
                    self._quiet_until = time.monotonic() + self.retry_after_s
                logger.warning("lmcache_r3: R3 store for %s failed: %s", ", ".join(request_ids), error)
        self._stores = waiting

    # -- finish ------------------------------------------------------------------------------------------------
    def request_finished(self, request: Any, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """The dict vLLM returns as ``kv_transfer_params``; its routed experts are filled in this engine step."""
        from vllm.v1.request import RequestStatus

        state = self._requests.get(request.request_id)
        if state is None or request.status == RequestStatus.FINISHED_ABORTED:
            self._child_ended(request.request_id)
        if state is None:
            return params
        self._unsent.flush_for(request.request_id)
        if request.status == RequestStatus.FINISHED_ABORTED:
            self._requests.pop(request.request_id, None)  # never published past what was complete; nothing to return
            if self._unsent.due(self._reported):  # its complete chunks already read: sent now, a step or not
                self._send_stores()
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
                    raise SlotMirrorError(state.incomplete)
                routed = self.mirror.read(state.blocks, 0, finishing.num_tokens - 1)
            except SlotMirrorError as error:
                self.counters.add("requests_incomplete")
                params[ROUTED_EXPERTS_ERROR_KEY] = f"routed experts of request {request_id} are incomplete: {error}"
                logger.error("lmcache_r3: %s", params[ROUTED_EXPERTS_ERROR_KEY])
                self._join_siblings(request_id, params, None, None, params[ROUTED_EXPERTS_ERROR_KEY])
                continue
            self.counters.add("requests_completed")
            encoded = encode_routed_experts(routed)
            fingerprint = token_fingerprint(state.request.all_token_ids[: finishing.num_tokens])
            params[ROUTED_EXPERTS_KEY], params[FINGERPRINT_KEY] = encoded, fingerprint
            self._join_siblings(request_id, params, encoded, fingerprint, None)

    def _join_siblings(
        self, request_id: str, params: dict[str, Any], encoded: str | None, fingerprint: str | None, error: str | None
    ) -> None:
        """A parallel-sampling child's rows (or why it has none) join its group's: vLLM's front end keeps only the
        last child's params, so every child carries the dicts of its whole group, which they share."""
        child = _child_of(request_id)
        if child is None:
            return
        index, parent = child
        group = self._siblings.setdefault(parent, _Siblings())
        if error is None:
            group.rows[index], group.fingerprints[index] = encoded, fingerprint
        else:
            group.errors[index] = error
        params[SIBLINGS_KEY], params[SIBLING_FINGERPRINTS_KEY] = group.rows, group.fingerprints
        params[SIBLING_ERRORS_KEY] = group.errors
        self._child_ended(request_id)

    def _child_ended(self, request_id: str) -> None:
        """A parallel-sampling child ended (finished or aborted). A group with no live child is let go (it lives on
        in the params only) once ``sibling_grace_s`` passed without a new child: vLLM's front end adds the children
        of one request within moments, but one call each, so a short child may end before the next one arrives."""
        child = _child_of(request_id)
        if child is None:
            return
        now = time.monotonic()
        group = self._siblings.get(child[1])
        if group is not None:
            group.live.discard(child[0])
            if not group.live:
                group.idle_since = now
        grace = self.sibling_grace_s
        idle = [parent for parent, group in self._siblings.items()
                if not group.live and group.idle_since is not None and now - group.idle_since >= grace]  # fmt: skip
        for parent in idle:
            del self._siblings[parent]

    def forget(self, request_id: str) -> None:
        """Drop a request's state without output (aborted, or its lookup state reset)."""
        self._requests.pop(request_id, None)
        self._finishing.pop(request_id, None)
        self._publish_due.pop(request_id, None)
        self._unsent.flush_for(request_id)

    def settle(self, timeout_s: float) -> None:
        """Send the unsent R3 stores and wait (bounded) for those in flight; for shutdown and tests."""
        self._send_stores()
        deadline = time.monotonic() + timeout_s
        while self._stores and time.monotonic() < deadline:
            self._reap_stores()
            time.sleep(0.005)
