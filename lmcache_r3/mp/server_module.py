"""The R3 chunk type inside a stock LMCache MP server, loaded with ``--server-module``.

An *R3 object* is one codec chunk object (:mod:`lmcache_r3.artifacts.codec`) holding the routed experts of one
LMCache chunk of tokens. It is stored through the server's storage manager under the **same chunk hash and
cache salt** as the KV object of those tokens — hashed by the server's own token hasher with its own chunk
size — so L1 eviction and every L2 tier treat it like any object. Three things keep it apart from the KV:

* its model name is the KV model name plus a namespace suffix (``"##r3"``), so KV lookups and KV events,
  which match on the model name, never see it;
* its kv rank is the world-size-1 rank, so one copy serves every tensor-parallel rank;
* the server decodes every object it is given before storing it, and every object it serves before returning
  it: a malformed store is refused whole with the reason, and a damaged stored object is a miss (and is
  dropped) rather than wrong routing.

Lookup and fetch answer for the *leading* chunks of a range, as prefix caches do: a missing or damaged chunk
ends the hit.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
from lmcache.v1.multiprocess.ext_server_module import ExtServerModuleBuildContext, server_module_handler

from lmcache_r3.artifacts import (
    FORMAT_VERSION,
    ProfileMismatchError,
    R3Profile,
    UnsupportedVersionError,
    decode_run,
    encoded_nbytes,
)
from lmcache_r3.config import is_positive_seconds
from lmcache_r3.counters import Counters
from lmcache_r3.mp import protocol
from lmcache_r3.tiers.task_adapter import TaskL2Adapter

logger = init_logger(__name__)

#: One copy of an R3 object serves every tensor-parallel rank: it is stored under the world-size-1 rank.
R3_KV_RANK = ObjectKey.ComputeKVRank(1, 0, 1, 0)
R3_OBJECT_GROUP = 0


class R3RequestError(ValueError):
    """A request the module refuses; the message says what is wrong and nothing was stored."""


def build_server_modules(ctx: ExtServerModuleBuildContext) -> R3ServerModule:
    """Factory named by ``--server-module '{"module_path": "lmcache_r3.mp.server_module", ...}'``."""
    return R3ServerModule(ctx.server_context, ctx.config or {})


CLEAR_WRITES_WAIT_S = 10.0
"""How long a clear waits for L1 writes in flight to commit before it clears (a KV chunk's commit takes
milliseconds; the clear's caller waits up to a minute)."""

SERVER_COUNTERS = (
    "store_calls",
    "stored_chunks",
    "store_skipped_chunks",
    "refused_requests",
    "lookup_calls",
    "lookup_hit_chunks",
    "fetch_calls",
    "fetched_chunks",
    "damaged_objects",
    "deleted_chunks",
    "clears",
    "prefetch_timeouts",
    "store_handler_us",
    "read_handler_us",
)
"""Monotonic counters the R3 module reports in ``/status``; updated from the server's worker threads.
``store_skipped_chunks`` counts the chunks a store did not write (already stored, being written by another call, or
no room in L1: see ``StoreResponse.num_present``). ``prefetch_timeouts`` counts lookups and fetches that stopped
waiting for the L2 tiers (``abandoned_prefetches``, beside the counters, is how many of those prefetches have not
ended yet). The ``*_handler_us`` ones add up the microseconds the module's store and lookup/fetch handlers ran: the
server time routed experts take."""


def _timed(counter: str) -> Callable[[Callable[..., bytes]], Callable[..., bytes]]:
    """Add a handler's run time, in microseconds, to ``counter`` (whether it answers or refuses)."""

    def decorate(handler: Callable[..., bytes]) -> Callable[..., bytes]:
        @functools.wraps(handler)
        def timed(self: R3ServerModule, payload: bytes) -> bytes:
            started = time.perf_counter()
            try:
                return handler(self, payload)
            finally:
                self.counters.add(counter, int(1e6 * (time.perf_counter() - started)))

        return timed

    return decorate


class R3ServerModule:
    """Store, look up, fetch and delete R3 objects; see the module docstring."""

    def __init__(self, server_context: Any, config: dict[str, Any]) -> None:
        unknown = set(config) - {"namespace", "tier_timeout_s"}
        if unknown:
            raise ValueError(f"lmcache_r3 server module: unknown config keys {sorted(unknown)}")
        self._ctx = server_context
        self.namespace = str(config.get("namespace", "##r3"))
        self.prefetch_timeout_s = config.get("tier_timeout_s", 4.0)
        if not is_positive_seconds(self.prefetch_timeout_s):
            raise ValueError(
                "lmcache_r3 server module: tier_timeout_s must be a number of seconds > 0 (below the connector's "
                f"r3_timeout_s), got {self.prefetch_timeout_s!r}"
            )
        if not self.namespace or "@" in self.namespace:
            raise ValueError(f"lmcache_r3 server module: namespace {self.namespace!r} must be non-empty, without '@'")
        self.counters = Counters(*SERVER_COUNTERS)
        self._abandoned = _AbandonedPrefetches()
        logger.info("lmcache_r3 R3 chunk type loaded: namespace=%r chunk_size=%d", self.namespace, self._ctx.chunk_size)

    # -- EngineModule ---------------------------------------------------------------------------------------
    @property
    def context(self) -> Any:
        return self._ctx

    def report_status(self) -> dict:
        return {
            "lmcache_r3": {
                "namespace": self.namespace,
                "chunk_size": self.chunk_size,
                "format_version": FORMAT_VERSION,
                **self.counters.snapshot(),
                "abandoned_prefetches": self._abandoned.pending(),
            }
        }

    def close(self) -> None:
        self._abandoned.close()

    @property
    def chunk_size(self) -> int:
        return int(self._ctx.chunk_size)

    # -- handlers -------------------------------------------------------------------------------------------
    @server_module_handler(protocol.METHOD_INFO)
    def info(self, payload: bytes) -> bytes:
        return protocol.encode(
            protocol.InfoResponse(chunk_size=self.chunk_size, namespace=self.namespace, format_version=FORMAT_VERSION)
        )

    @server_module_handler(protocol.METHOD_STORE)
    @_timed("store_handler_us")
    def store(self, payload: bytes) -> bytes:
        request = self._decode(payload, protocol.StoreRequest)
        item = protocol.StoreItem(range=request.range, objects=request.objects)
        (result,) = self._store_items(self._profile(request.profile), [item])
        return protocol.encode(result)

    @server_module_handler(protocol.METHOD_STORE_MANY)
    @_timed("store_handler_us")
    def store_many(self, payload: bytes) -> bytes:
        request = self._decode(payload, protocol.StoreManyRequest)
        results = self._store_items(self._profile(request.profile), request.items)
        return protocol.encode(protocol.StoreManyResponse(results=results))

    def _store_items(self, profile: R3Profile, items: list[protocol.StoreItem]) -> list[protocol.StoreResponse]:
        """Check every item, then write all their new objects with one reservation of the storage manager."""
        object_nbytes = encoded_nbytes(profile, self.chunk_size)
        item_keys = [
            self._checked_store(profile, item, object_nbytes, index, len(items)) for index, item in enumerate(items)
        ]
        sources: dict[ObjectKey, int] = {}  # the address of each new key's object in its item's payload
        for item, keys in zip(items, item_keys, strict=True):
            base = _address(item.objects)
            for index, key in enumerate(keys):
                sources.setdefault(key, base + index * object_nbytes)
        storage = self._ctx.storage_manager
        reserved = storage.reserve_write(list(sources), _layout(object_nbytes)) if sources else {}
        if reserved:
            for key, obj in reserved.items():  # the payloads (in ``items``) outlive these copies
                ctypes.memmove(obj.data_ptr, sources[key], object_nbytes)
            storage.finish_write_by_owner(storage.prepare_write_completion(reserved))
        results, counted = [], set()
        for keys in item_keys:
            stored = sum(1 for key in keys if key in reserved and key not in counted)
            counted.update(keys)
            results.append(
                protocol.StoreResponse(num_chunks=len(keys), num_stored=stored, num_present=len(keys) - stored)
            )
        self.counters.update(
            store_calls=1, stored_chunks=len(reserved), store_skipped_chunks=len(sources) - len(reserved)
        )
        return results

    def _checked_store(
        self, profile: R3Profile, item: protocol.StoreItem, object_nbytes: int, index: int, count: int
    ) -> list[ObjectKey]:
        """The keys of one store item, after checking that its objects are exactly its chunks' valid R3 objects."""
        where = f" (item {index + 1} of {count})" if count > 1 else ""
        keys = self._keys(item.range)
        expected = object_nbytes * len(keys)
        if len(item.objects) != expected:
            self._refuse(
                f"store of tokens [{item.range.start}, {item.range.end}){where} covers {len(keys)} full chunks of "
                f"{self.chunk_size} tokens = {expected} bytes of R3 objects for {profile.describe()}, but "
                f"{len(item.objects)} bytes were sent (partial chunks are never stored)"
            )
        decoded = decode_run(item.objects, profile, item.range.start, self.chunk_size)
        if decoded.error is not None:
            self._refuse(
                f"store refused, nothing stored: R3 object {len(decoded.chunks)} of {len(keys)}{where} is invalid: "
                f"{decoded.error}"
            )
        return keys

    @server_module_handler(protocol.METHOD_LOOKUP)
    @_timed("read_handler_us")
    def lookup(self, payload: bytes) -> bytes:
        request = self._decode(payload, protocol.LookupRequest)
        ((hit, _),) = self._read_ranges([request.range], self._profile(request.profile), keep_bytes=False)
        self.counters.update(lookup_calls=1, lookup_hit_chunks=hit)
        return protocol.encode(protocol.LookupResponse(num_hit_chunks=hit))

    @server_module_handler(protocol.METHOD_FETCH)
    @_timed("read_handler_us")
    def fetch(self, payload: bytes) -> bytes:
        request = self._decode(payload, protocol.FetchRequest)
        ((hit, objects),) = self._read_ranges([request.range], self._profile(request.profile), keep_bytes=True)
        self.counters.update(fetch_calls=1, fetched_chunks=hit)
        return protocol.encode(protocol.FetchResponse(num_hit_chunks=hit, objects=objects))

    @server_module_handler(protocol.METHOD_FETCH_MANY)
    @_timed("read_handler_us")
    def fetch_many(self, payload: bytes) -> bytes:
        request = self._decode(payload, protocol.FetchManyRequest)
        reads = self._read_ranges(request.ranges, self._profile(request.profile), keep_bytes=True)
        results = [protocol.FetchResponse(num_hit_chunks=hit, objects=objects) for hit, objects in reads]
        self.counters.update(fetch_calls=1, fetched_chunks=sum(r.num_hit_chunks for r in results))
        return protocol.encode(protocol.FetchManyResponse(results=results))

    @server_module_handler(protocol.METHOD_DELETE)
    def delete(self, payload: bytes) -> bytes:
        request = self._decode(payload, protocol.DeleteRequest)
        keys = self._keys(request.range)
        deleted, locked = self._ctx.storage_manager.delete_l1_keys(keys) if keys else (0, 0)
        self.counters.update(deleted_chunks=deleted)
        return protocol.encode(protocol.DeleteResponse(num_deleted=deleted, num_locked=locked))

    @server_module_handler(protocol.METHOD_CLEAR)
    def clear(self, payload: bytes) -> bytes:
        """Clear L1 (every object not in use, as LMCache's own clear does), then each lmcache_r3 tier below it.

        LMCache's clear (``POST /cache/clear``, vLLM's ``reset_prefix_cache(reset_connector=True)``) leaves the L2
        tiers as they are, so after a policy update a server would serve the old policy's KV and routing from them.
        A tier lmcache_r3 cannot clear (LMCache's own) is answered with an error naming it: its objects stay.

        L1 writes in flight (stores LMCache answered before they committed) are waited for, up to
        :data:`CLEAR_WRITES_WAIT_S`, so that they are cleared too instead of landing after the clear; what L1 keeps
        because it is in use (read-locked, or still being written) is counted in the answer (``l1_kept``).
        """
        storage = self._ctx.storage_manager
        deadline = time.monotonic() + CLEAR_WRITES_WAIT_S
        while _l1_counts(storage)[1] and time.monotonic() < deadline:
            time.sleep(0.005)
        storage.clear(force=False)
        l1_kept = _l1_counts(storage)[0]
        if l1_kept:
            logger.warning("lmcache_r3: the clear kept %d L1 objects in use (read-locked or being written)", l1_kept)
        tiers = []
        for index, (_, adapter) in enumerate(storage.l2_adapters()):
            kind = type(adapter).__name__
            if not isinstance(adapter, TaskL2Adapter):
                error = (f"{kind} is not an lmcache_r3 tier and cannot be cleared: its objects stay and are served "
                         "again; give each policy version its own cache_salt, or use lmcache_r3's tiers")  # fmt: skip
                tiers.append(protocol.TierCleared(index=index, type=kind, removed=-1, error=error))
                continue
            try:
                tiers.append(protocol.TierCleared(index=index, type=kind, removed=adapter.clear_objects()))
            except Exception as err:  # the tier said why; the others are still cleared
                logger.warning("lmcache_r3: clearing L2 tier %d (%s) failed: %s", index, kind, err)
                tiers.append(protocol.TierCleared(index=index, type=kind, removed=-1, error=str(err)))
        self.counters.update(clears=1)
        logger.info("lmcache_r3: cleared L1 and %d L2 tier(s): %s", len(tiers), tiers)
        return protocol.encode(protocol.ClearResponse(tiers=tiers, l1_kept=l1_kept))

    # -- helpers --------------------------------------------------------------------------------------------
    def _refuse(self, message: str) -> None:
        self.counters.update(refused_requests=1)
        raise R3RequestError(message)

    def _decode(self, payload: bytes, kind: type[msgspec.Struct]):
        try:
            return protocol.decode(payload, kind)
        except msgspec.DecodeError as err:
            self._refuse(f"malformed {kind.__name__}: {err}")

    def _profile(self, spec: protocol.ProfileSpec) -> R3Profile:
        try:
            return spec.to_profile()
        except (TypeError, ValueError) as err:
            self._refuse(f"invalid R3 profile {spec}: {err}")

    def _keys(self, chunk_range: protocol.ChunkRange) -> list[ObjectKey]:
        size = self.chunk_size
        start, end = chunk_range.start, chunk_range.end
        if start < 0 or start % size or end < start or end > len(chunk_range.token_ids):
            self._refuse(
                f"token range [{start}, {end}) of {len(chunk_range.token_ids)} tokens is invalid: start must be a "
                f"non-negative multiple of the chunk size {size} and end must lie in [start, len(token_ids)]"
            )
        if not chunk_range.model_name or "@" in chunk_range.model_name:
            self._refuse(f"model_name {chunk_range.model_name!r} must be non-empty and without '@'")
        hashes = self._ctx.token_hasher.compute_chunk_hashes(chunk_range.token_ids, start=start, end=end)
        model_name = chunk_range.model_name + self.namespace
        try:
            return [
                ObjectKey(
                    chunk_hash=chunk_hash,
                    model_name=model_name,
                    kv_rank=R3_KV_RANK,
                    object_group_id=R3_OBJECT_GROUP,
                    cache_salt=chunk_range.cache_salt,
                )
                for chunk_hash in hashes
            ]
        except (TypeError, ValueError) as err:
            self._refuse(f"invalid R3 key: {err}")

    def _read_ranges(
        self, ranges: list[protocol.ChunkRange], profile: R3Profile, keep_bytes: bool
    ) -> list[tuple[int, bytes]]:
        """Per range, bring its leading present objects into L1 (from L2 if needed), verify them, release the locks.

        Returns, per range, the number of leading valid chunks and, with ``keep_bytes``, their concatenated bytes.
        Every range is checked before anything is read (a refused call takes no lock), and all ranges are read with
        one prefetch of their distinct keys: its per-task cost, not the reading, is most of the work per range. A
        damaged object ends its range's hit and is dropped so it is not found again.
        """
        range_keys = [self._keys(chunk_range) for chunk_range in ranges]
        unique = list(dict.fromkeys(key for keys in range_keys for key in keys))
        if not unique:
            return [(0, b"") for _ in ranges]
        object_nbytes = encoded_nbytes(profile, self.chunk_size)
        storage = self._ctx.storage_manager
        result = self._lock_present(unique, object_nbytes)
        if result is None:
            return [(0, b"") for _ in ranges]
        locked = [unique[i] for i in result.hit_cells[0].get_indices_list()]  # one read lock each, until released
        runs: list[bytes] = []
        try:
            found_keys, objects = storage.unsafe_read(locked, l1_owners=result.l1_owners) if locked else ([], [])
            found = dict(zip(found_keys, objects, strict=True))
            for keys in range_keys:
                views = []
                for key in keys:
                    obj = found.get(key)
                    if obj is None or obj.get_size() != object_nbytes:
                        # absent, vanished in between, or an object of another profile (another engine's, under the
                        # same model name): the range's hit ends before it, and the object stays
                        break
                    views.append(_read_object(obj, object_nbytes))  # a copy: the object may go once unlocked
                runs.append(b"".join(views))
        finally:
            if locked:  # (the prefetch already touched its hits for LRU)
                storage.finish_read_prefetched(locked, read_locks=1, l1_owners=result.l1_owners)
        return [
            self._verified(run, keys, chunk_range, profile, object_nbytes, keep_bytes)
            for run, keys, chunk_range in zip(runs, range_keys, ranges, strict=True)
        ]

    def _lock_present(self, keys: list[ObjectKey], object_nbytes: int) -> Any:
        """One read lock on each of ``keys`` present in L1 or in an L2 tier (brought into L1); the prefetch result
        naming them, or None when the tiers did not answer in time.

        Without L2 tiers LMCache serves the prefetch from L1 on this thread. With L2 tiers, L1 is asked first, on
        this thread: when it holds every key (hot R3), no task goes through LMCache's prefetch thread and the tiers
        are not asked. Otherwise its locks are released and one prefetch asks L1 and the tiers together.
        """
        storage = self._ctx.storage_manager
        spec = PrefetchTaskSpec(
            key_groups=[
                GroupedObjectKeys(keys=keys, object_group_id=R3_OBJECT_GROUP, layout_desc=_layout(object_nbytes))
            ],
            num_kv_readers=1,
            fetching_policy="full",  # ranges follow each other in one group: a miss ends only its own range's hit
        )
        if storage.l2_adapters():
            handle = storage.submit_prefetch_task(spec, external_request_id="lmcache_r3", skip_l2=True)
            in_l1 = storage.query_prefetch_status(handle)  # answered before submit returned (L1 only)
            if in_l1 is not None:
                locked = in_l1.hit_cells[0].get_indices_list()
                if len(locked) == len(keys):
                    return in_l1
                if locked:
                    storage.finish_read_prefetched([keys[i] for i in locked], read_locks=1, l1_owners=in_l1.l1_owners)
        handle = storage.submit_prefetch_task(spec, external_request_id="lmcache_r3")
        return self._wait_prefetch(handle, keys)

    def _verified(
        self, run: bytes, keys: list[ObjectKey], chunk_range: protocol.ChunkRange, profile: R3Profile,
        object_nbytes: int, keep_bytes: bool,
    ) -> tuple[int, bytes]:  # fmt: skip
        """``(leading valid chunks, their bytes)`` of the objects read for one range; drops the first damaged one."""
        if not run:
            return 0, b""
        decoded = decode_run(run, profile, chunk_range.start, self.chunk_size)
        valid = len(decoded.chunks)
        if isinstance(decoded.error, _NOT_DAMAGE):
            logger.warning(
                "lmcache_r3: the R3 object for tokens [%d, %d) is not readable by this request (%s); a miss, kept",
                chunk_range.start + valid * self.chunk_size,
                chunk_range.start + (valid + 1) * self.chunk_size,
                decoded.error,
            )
        elif decoded.error is not None and valid < len(run) // object_nbytes:
            logger.warning(
                "lmcache_r3: dropping damaged R3 object for tokens [%d, %d): %s",
                chunk_range.start + valid * self.chunk_size,
                chunk_range.start + (valid + 1) * self.chunk_size,
                decoded.error,
            )
            self._drop_damaged(keys[valid])
        if not keep_bytes:
            return valid, b""
        return valid, (run if valid * object_nbytes == len(run) else run[: valid * object_nbytes])

    def _drop_damaged(self, key: ObjectKey) -> None:
        """Remove a damaged object from L1 and from every L2 tier, so no later lookup finds it."""
        storage = self._ctx.storage_manager
        self.counters.update(damaged_objects=1)
        storage.delete_l1_keys([key])
        for descriptor, adapter in storage.l2_adapters():
            try:
                adapter.delete([key])
            except Exception as err:  # a tier that cannot delete keeps the object; lookups keep refusing it
                logger.warning("lmcache_r3: L2 tier %s could not delete a damaged R3 object: %s", descriptor, err)

    def _wait_prefetch(self, handle: Any, keys: list[ObjectKey]):
        storage = self._ctx.storage_manager
        deadline = time.monotonic() + self.prefetch_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.counters.update(prefetch_timeouts=1)
                self._abandoned.add(storage, handle, keys)
                logger.warning("lmcache_r3: prefetch of %d R3 objects timed out; answering a miss", len(keys))
                return None
            storage.wait_prefetch_status(handle, remaining)
            result = storage.query_prefetch_status(handle)
            if result is not None:
                return result


def _l1_counts(storage: Any) -> tuple[int, int]:
    """``(objects, objects being written)`` over the server's L1 managers (staging objects included)."""
    managers = storage.report_status()["l1_managers"].values()
    return (sum(int(m["total_object_count"]) for m in managers), sum(int(m["write_locked_count"]) for m in managers))


_NOT_DAMAGE = (UnsupportedVersionError, ProfileMismatchError)
"""Refusals of an intact object written for another format version or profile: a miss, never a reason to delete it
(servers of two versions sharing a tier would delete each other's objects)."""


def _layout(object_nbytes: int) -> MemoryLayoutDesc:
    return MemoryLayoutDesc(shapes=[torch.Size([object_nbytes])], dtypes=[torch.uint8])


def _address(payload: bytes) -> int:
    """The address of the bytes of ``payload`` (valid while it lives), for ``memmove`` into L1 memory objects.

    Copies by address: building tensor or array views of each small R3 object cost most of a store of many.
    """
    return ctypes.cast(ctypes.c_char_p(payload), ctypes.c_void_p).value


def _read_object(obj: Any, object_nbytes: int) -> bytes:
    """A copy of the first ``object_nbytes`` bytes of a read-locked L1 memory object (host memory)."""
    return ctypes.string_at(obj.data_ptr, object_nbytes)


class _AbandonedPrefetches:
    """Prefetches a handler stopped waiting for: each still takes read locks on the objects it brings into L1 when
    it ends, which one thread releases then. One thread for all of them: a stalled tier abandons one prefetch per
    lookup or fetch, for as long as it stalls."""

    POLL_S = 0.5
    GIVE_UP_S = 3600.0
    """However long the tiers take, within reason; past it the locks stay until LMCache's read-lock TTL."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, Any, list[ObjectKey], float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, storage: Any, handle: Any, keys: list[ObjectKey]) -> None:
        with self._lock:
            self._pending.append((storage, handle, keys, time.monotonic()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lmcache_r3-prefetch-release", daemon=True)
                self._thread.start()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        """Poll the abandoned prefetches until none is left, then end (the next one abandoned starts a thread)."""
        while not self._stop.wait(self.POLL_S):
            with self._lock:
                pending, self._pending = self._pending, []
            left = [item for item in pending if not self._ended(*item)]
            with self._lock:
                self._pending = left + self._pending
                if not self._pending:
                    self._thread = None
                    return

    def _ended(self, storage: Any, handle: Any, keys: list[ObjectKey], since: float) -> bool:
        """Release the locks of one abandoned prefetch if it ended; whether it is done with."""
        try:
            result = storage.query_prefetch_status(handle)
            if result is None:
                if time.monotonic() - since < self.GIVE_UP_S:
                    return False
                logger.error("lmcache_r3: an abandoned R3 prefetch of %d objects did not end within an hour; the "
                             "read locks it may take stay until LMCache's read-lock TTL (check the L2 tiers)",
                             len(keys))  # fmt: skip
                return True
            hits = [keys[i] for i in result.hit_cells[0].get_indices_list()] if result.hit_cells else []
            if hits:
                storage.finish_read_prefetched(hits, read_locks=1, l1_owners=result.l1_owners)
        except Exception:
            logger.exception("lmcache_r3: releasing the locks of an abandoned R3 prefetch failed; they stay")
        return True
