"""The /dev/shm tier as an LMCache 0.5.6 L2 adapter: KV and R3 objects alike live in a :class:`ShmObjectStore`.

Loaded by LMCache's stock plugin factory::

    lmcache server ... --l2-adapter '{"type": "plugin", "module_path": "lmcache_r3.tiers.shm_adapter",
        "class_name": "ShmL2Adapter",
        "adapter_params": {"root": "/dev/shm/lmcache_r3", "capacity_bytes": 8589934592, "ttl_seconds": 3600}}'

``adapter_params``:

* ``root`` (required): the store's root, owned by the server's user, mode 0700, not a symlink. A root that cannot be
  trusted fails the adapter's construction with :class:`UntrustedRootError` (so the server refuses to start and the
  message is in its log).
* ``capacity_bytes`` (required, > 0): the store's hard cap (LRU eviction inside the store), also passed to LMCache as
  ``max_capacity_bytes`` so an ``"eviction": {...}`` policy next to ``"type"`` can evict ahead of it.
* ``ttl_seconds`` (optional): objects older than this are swept every ``sweep_interval_seconds`` (default 10).
* ``task_timeout_seconds`` (default 30): the watchdog fails a task still running after this long.
* ``num_store_workers`` / ``num_lookup_workers`` / ``num_load_workers`` (default 2 / 1 / 2), ``durable`` (False).

Key encoding
------------
An ``ObjectKey`` becomes a store key of at most ``MAX_KEY_BYTES`` (155) bytes in one of two forms, told apart by the
first byte so they can never collide with each other:

* ``0x01`` + a length-prefixed, fixed-layout encoding of (chunk_hash, kv_rank, object_group_id, model_name,
  cache_salt). Injective and reversible, so a restarted server (or ``list_l2_keys``) recovers the ``ObjectKey`` from
  the file name. It fits whenever ``len(chunk_hash) + len(model_name) + len(cache_salt) <= 135`` bytes (UTF-8), i.e.
  every practical model name with a short salt.
* ``0x02`` + BLAKE2b-256 of an unbounded canonical encoding, for keys too long for the first form. Two distinct keys
  share a name only on a 256-bit hash collision (probability ~n^2 / 2^257: nil for any feasible n), and a collision
  could serve only an object that passes its checksum *and* has the exact buffer size. Such objects cannot be
  recovered after a restart (the name is one-way): they are still served on lookup, and the store's own LRU
  capacity and TTL bound them, but LMCache's eviction does not see them until a lookup touches them again.

Threading and completion
------------------------
Store, lookup-and-lock and load tasks each run on their own small thread pool, one job per task. Every submitted task
completes exactly once (success or failure) and signals its event fd: the job publishes its result in a ``finally``,
a submit that cannot schedule completes the task at once as failed, and a watchdog thread fails tasks that run longer
than ``task_timeout_seconds`` (marking the adapter unhealthy for a while). No submit, no ``delete`` and no ``unlock``
raises. A task the watchdog failed is *abandoned*: its job stops before touching the next object; an object it
published after the caller got the failure is removed again (the L1 buffer may have been reused); a stalled read
that finally returns cannot be undone, which is why the timeout is generous.

"Lock" is an in-process reference count per key that makes ``delete`` (LMCache's eviction) skip the key until it is
unlocked; the store's own hard-cap LRU and the TTL sweep may still remove a locked object, which turns its load into
a miss (loads may fail by contract).

Accounting
----------
The adapter keeps the keys it knows (stored here, found at start-up, or loaded from a sharing server) with their
payload sizes and reports them through ``_notify_keys_stored`` / ``_notify_keys_deleted`` so LMCache's ``get_usage``
and eviction policy see the tier. At start-up it adopts every decodable object under the root, and replays the
current set to every listener registered after construction, so eviction works after a restart. Objects the store
removes on its own (hard-cap eviction, TTL, corruption, a miss on a key we knew) are reported as deleted.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.platform import create_event_notifier

from lmcache_r3.tiers.shm_store import (
    HEADER,
    MAX_KEY_BYTES,
    ShmObjectStore,
    UntrustedRootError,
    object_name,
    shard_of,
)

logger = init_logger(__name__)

__all__ = ["ShmL2Adapter", "decode_object_key", "encode_object_key"]

_TAG_PLAIN = 0x01
_TAG_HASHED = 0x02
_PLAIN_HEAD = struct.Struct("<BBqQH")
"""tag, len(chunk_hash), kv_rank, object_group_id, len(model_name); then chunk_hash, model_name, cache_salt."""

_PARAMS = frozenset(
    {
        "root",
        "capacity_bytes",
        "ttl_seconds",
        "task_timeout_seconds",
        "sweep_interval_seconds",
        "unhealthy_for_seconds",
        "num_store_workers",
        "num_lookup_workers",
        "num_load_workers",
        "durable",
    }
)


# -- keys ------------------------------------------------------------------------------------------------------------
def encode_object_key(key: ObjectKey) -> bytes:
    """The store key of ``key`` (see the module): the reversible form when it fits, else a tagged 256-bit digest."""
    chunk_hash = bytes(key.chunk_hash)
    model = key.model_name.encode("utf-8")
    salt = key.cache_salt.encode("utf-8")
    if (
        len(chunk_hash) <= 0xFF
        and len(model) <= 0xFFFF
        and -(1 << 63) <= key.kv_rank < (1 << 63)
        and 0 <= key.object_group_id < (1 << 64)
    ):
        head = _PLAIN_HEAD.pack(_TAG_PLAIN, len(chunk_hash), key.kv_rank, key.object_group_id, len(model))
        plain = head + chunk_hash + model + salt
        if len(plain) <= MAX_KEY_BYTES:
            return plain
    canonical = b"".join(
        len(part).to_bytes(8, "little") + part
        for part in (chunk_hash, str(key.kv_rank).encode(), str(key.object_group_id).encode(), model, salt)
    )
    return bytes([_TAG_HASHED]) + hashlib.blake2b(canonical, digest_size=32).digest()


def decode_object_key(encoded: bytes) -> ObjectKey | None:
    """The ``ObjectKey`` of a reversible store key, or None (a hashed key, or bytes this adapter did not write)."""
    if len(encoded) < _PLAIN_HEAD.size or encoded[0] != _TAG_PLAIN:
        return None
    try:
        _tag, hash_len, kv_rank, group, model_len = _PLAIN_HEAD.unpack_from(encoded)
        body = encoded[_PLAIN_HEAD.size :]
        if len(body) < hash_len + model_len:
            return None
        key = ObjectKey(
            chunk_hash=bytes(body[:hash_len]),
            model_name=body[hash_len : hash_len + model_len].decode("utf-8"),
            kv_rank=kv_rank,
            object_group_id=group,
            cache_salt=body[hash_len + model_len :].decode("utf-8"),
        )
    except (ValueError, struct.error):
        return None
    return key if encode_object_key(key) == bytes(encoded) else None


# -- tasks -----------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Task:
    tid: int
    kind: str  # "store" | "lookup" | "load"
    size: int  # number of keys
    started: float = field(default_factory=time.monotonic)
    done: bool = False
    abandoned: bool = False
    """Failed by the watchdog: the job must stop touching the caller's buffers."""


def _view(obj: Any) -> memoryview:
    return memoryview(obj.byte_array).cast("B")


class ShmL2Adapter(L2AdapterInterface):
    """An ``L2AdapterInterface`` over :class:`ShmObjectStore` (see the module for the design)."""

    def __init__(self, adapter_params: dict[str, Any], l1_memory_desc: Any = None) -> None:
        params = dict(adapter_params or {})
        unknown = sorted(set(params) - _PARAMS)
        if unknown:
            raise ValueError(f"ShmL2Adapter: unknown adapter_params {unknown}; known: {sorted(_PARAMS)}")
        root = params.get("root")
        if not isinstance(root, str) or not root:
            raise ValueError("ShmL2Adapter: adapter_params.root is required (a 0700 directory, e.g. under /dev/shm)")
        capacity = params.get("capacity_bytes")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ValueError(f"ShmL2Adapter: adapter_params.capacity_bytes must be an int > 0, got {capacity!r}")
        ttl = params.get("ttl_seconds")
        super().__init__(max_capacity_bytes=capacity)
        try:
            self._store = ShmObjectStore(
                root, capacity_bytes=capacity, ttl_seconds=ttl, durable=bool(params.get("durable", False))
            )
        except UntrustedRootError as err:
            logger.error("ShmL2Adapter refuses its root: %s", err)
            raise
        self._timeout = float(params.get("task_timeout_seconds", 30.0))
        self._sweep_interval = float(params.get("sweep_interval_seconds", 10.0))
        self._unhealthy_for = float(params.get("unhealthy_for_seconds", 60.0))
        self._l1_memory_desc = l1_memory_desc

        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Task] = {}
        self._results: dict[str, dict[int, Any]] = {"store": {}, "lookup": {}, "load": {}}
        self._locks: dict[bytes, int] = {}
        self._known: dict[bytes, tuple[ObjectKey, int]] = {}
        self._counters = dict.fromkeys(
            (
                "errors",
                "timeouts",
                "store_tasks",
                "stored_objects",
                "lookup_tasks",
                "lookup_hits",
                "lookup_misses",
                "load_tasks",
                "loaded_objects",
                "load_failures",
                "deleted_objects",
                "delete_skipped_locked",
                "removed_by_store",
                "unrecoverable_keys_at_start",
            ),
            0,
        )
        self._last_stall = float("-inf")
        self._closed = False
        self._store_seen = self._store_removals()

        self._efds = {
            "store": create_event_notifier(),
            "lookup": create_event_notifier(),
            "load": create_event_notifier(),
        }
        self._pools = {
            "store": ThreadPoolExecutor(int(params.get("num_store_workers", 2)), thread_name_prefix="shm-l2-store"),
            "lookup": ThreadPoolExecutor(int(params.get("num_lookup_workers", 1)), thread_name_prefix="shm-l2-lookup"),
            "load": ThreadPoolExecutor(int(params.get("num_load_workers", 2)), thread_name_prefix="shm-l2-load"),
        }
        self._adopt_existing()
        self._stop = threading.Event()
        self._maintenance = threading.Thread(target=self._maintain, name="shm-l2-watchdog", daemon=True)
        self._maintenance.start()
        used, _ = self._store.usage()
        logger.info(
            "ShmL2Adapter on %s: capacity %d bytes, ttl %s s, %d objects (%d bytes) already there",
            self._store.root,
            capacity,
            ttl,
            len(self._known),
            used,
        )

    # -- start-up and listeners --------------------------------------------------------------------------------------
    def _adopt_existing(self) -> None:
        keys, sizes = [], []
        for encoded in self._store.keys():
            key = decode_object_key(encoded)
            if key is None:
                self._counters["unrecoverable_keys_at_start"] += 1
                continue
            try:
                size = os.stat(self._store.root / shard_of(encoded) / object_name(encoded)).st_size - HEADER.size
            except OSError:
                continue
            keys.append(key)
            sizes.append(max(size, 0))
        self._register(keys, sizes)

    def register_listener(self, listener: Any) -> None:
        """Register ``listener`` and replay the objects already resident, so its LRU can evict them."""
        super().register_listener(listener)
        with self._lock:
            snapshot = list(self._known.values())
        if snapshot:
            try:
                listener.on_l2_keys_stored([k for k, _ in snapshot], [s for _, s in snapshot])
            except Exception:
                logger.exception("ShmL2Adapter: replaying %d resident keys to a listener failed", len(snapshot))

    def _register(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        new_keys, new_sizes = [], []
        with self._lock:
            for key, size in zip(keys, sizes, strict=True):
                encoded = encode_object_key(key)
                if encoded not in self._known:
                    self._known[encoded] = (key, size)
                    new_keys.append(key)
                    new_sizes.append(size)
        if new_keys:
            self._notify_keys_stored(new_keys, new_sizes)

    def _unregister(self, encoded_keys: list[bytes]) -> int:
        gone = []
        with self._lock:
            for encoded in encoded_keys:
                entry = self._known.pop(encoded, None)
                if entry is not None:
                    gone.append(entry)
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [s for _, s in gone])
        return len(gone)

    # -- event fds ---------------------------------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._efds["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efds["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efds["load"].fileno()

    # -- task plumbing -----------------------------------------------------------------------------------------------
    def _submit(self, kind: str, size: int, job, *args) -> L2TaskId:
        """Register a task and schedule ``job(task, *args)``; never raises, every task completes."""
        task = _Task(tid=next(self._ids), kind=kind, size=size)
        with self._lock:
            self._pending[task.tid] = task
            self._counters[f"{kind}_tasks"] += 1
        try:
            if self._closed:
                raise RuntimeError("ShmL2Adapter is closed")
            self._pools[kind].submit(job, task, *args)
        except Exception as err:
            logger.warning("ShmL2Adapter: could not schedule a %s task: %s", kind, err)
            self._count("errors")
            self._finish(task, self._failure(task))
        return task.tid

    @staticmethod
    def _failure(task: _Task) -> Any:
        return L2StoreResult(False, 0) if task.kind == "store" else Bitmap(task.size)

    def _finish(self, task: _Task, result: Any) -> bool:
        """Publish ``result`` and signal, once per task; False when the task was already completed."""
        with self._lock:
            if task.done:
                return False
            task.done = True
            self._pending.pop(task.tid, None)
            self._results[task.kind][task.tid] = result
        try:
            self._efds[task.kind].notify()
        except Exception:
            logger.exception("ShmL2Adapter: signalling a %s completion failed", task.kind)
        return True

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    # -- store -------------------------------------------------------------------------------------------------------
    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        return self._submit("store", len(keys), self._run_store, list(keys), list(objects))

    def _run_store(self, task: _Task, keys: list[ObjectKey], objects: list[Any]) -> None:
        ok = len(keys) == len(objects)
        written = 0
        resident_keys: list[ObjectKey] = []
        resident_sizes: list[int] = []
        try:
            for key, obj in zip(keys, objects, strict=False):
                if task.abandoned:
                    ok = False
                    break
                encoded = b""
                try:
                    encoded = encode_object_key(key)
                    view = _view(obj)
                    published = self._store.put(encoded, view)
                    with self._lock:
                        abandoned = task.abandoned
                    if abandoned:
                        # The caller was told this task failed and may have reused the buffer meanwhile.
                        if published:
                            self._store.delete([encoded])
                        ok = False
                        break
                    if published:
                        written += view.nbytes
                    resident_keys.append(key)
                    resident_sizes.append(view.nbytes)
                except Exception as err:
                    ok = False
                    self._count("errors")
                    logger.warning("ShmL2Adapter: storing %s failed: %s", key, err)
        except BaseException:
            ok = False
            self._count("errors")
            logger.exception("ShmL2Adapter: store task %d failed", task.tid)
        finally:
            try:
                self._register(resident_keys, resident_sizes)
                self._count("stored_objects", len(resident_keys))
            except Exception:
                logger.exception("ShmL2Adapter: accounting a store failed")
            self._finish(task, L2StoreResult(ok, written))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._results["store"] = self._results["store"], {}
        return done

    # -- lookup and lock ---------------------------------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs: Any = None) -> L2TaskId:
        return self._submit("lookup", len(keys), self._run_lookup, list(keys))

    def _run_lookup(self, task: _Task, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        locked: list[bytes] = []
        hits = 0
        try:
            for i, key in enumerate(keys):
                if task.abandoned:
                    break
                try:
                    encoded = encode_object_key(key)
                    if not self._store.exists(encoded):
                        continue
                    with self._lock:
                        self._locks[encoded] = self._locks.get(encoded, 0) + 1
                    locked.append(encoded)
                    bitmap.set(i)
                    hits += 1
                except Exception as err:
                    self._count("errors")
                    logger.warning("ShmL2Adapter: looking up %s failed: %s", key, err)
        except BaseException:
            self._count("errors")
            logger.exception("ShmL2Adapter: lookup task %d failed", task.tid)
        finally:
            with self._lock:
                self._counters["lookup_hits"] += hits
                self._counters["lookup_misses"] += len(keys) - hits
            if not self._finish(task, bitmap):
                self._release(locked)  # the caller got an empty bitmap and will never unlock these

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._results["lookup"].pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        try:
            self._release([encode_object_key(key) for key in keys])
        except Exception:
            self._count("errors")
            logger.exception("ShmL2Adapter: unlock failed")

    def _release(self, encoded_keys: list[bytes]) -> None:
        with self._lock:
            for encoded in encoded_keys:
                count = self._locks.get(encoded, 0)
                if count <= 1:
                    self._locks.pop(encoded, None)
                else:
                    self._locks[encoded] = count - 1

    # -- load --------------------------------------------------------------------------------------------------------
    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        return self._submit("load", len(keys), self._run_load, list(keys), list(objects))

    def _run_load(self, task: _Task, keys: list[ObjectKey], objects: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        loaded_keys: list[ObjectKey] = []
        loaded_sizes: list[int] = []
        missing: list[bytes] = []
        failures = 0
        try:
            for i, (key, obj) in enumerate(zip(keys, objects, strict=False)):
                if task.abandoned:
                    break
                try:
                    encoded = encode_object_key(key)
                    view = _view(obj)
                    length = self._store.get_into(encoded, view)
                    if length is None:
                        missing.append(encoded)  # absent, expired, or corrupt (the store removed it)
                        failures += 1
                    elif length != view.nbytes:
                        failures += 1
                        logger.warning(
                            "ShmL2Adapter: %s holds %d bytes, the load buffer has %d; not served",
                            key,
                            length,
                            view.nbytes,
                        )
                    else:
                        bitmap.set(i)
                        loaded_keys.append(key)
                        loaded_sizes.append(length)
                except Exception as err:
                    failures += 1
                    self._count("errors")
                    logger.warning("ShmL2Adapter: loading %s failed: %s", key, err)
        except BaseException:
            self._count("errors")
            logger.exception("ShmL2Adapter: load task %d failed", task.tid)
        finally:
            try:
                removed = self._unregister(missing)
                self._count("removed_by_store", removed)
                self._count("load_failures", failures)
                if loaded_keys:
                    self._register(loaded_keys, loaded_sizes)  # objects another server stored
                    self._count("loaded_objects", len(loaded_keys))
                    self._notify_keys_accessed(loaded_keys)
            except Exception:
                logger.exception("ShmL2Adapter: accounting a load failed")
            self._finish(task, bitmap)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._results["load"].pop(task_id, None)

    # -- eviction, listing, usage ------------------------------------------------------------------------------------
    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove ``keys`` (LMCache's eviction thread, ``DELETE /cache/objects``); skips locked keys; never raises."""
        try:
            targets = []
            skipped = 0
            for key in keys:
                encoded = encode_object_key(key)
                with self._lock:
                    locked = self._locks.get(encoded, 0) > 0
                if locked:
                    skipped += 1
                    continue
                targets.append(encoded)
            self._store.delete(targets)
            self._unregister(targets)
            with self._lock:
                self._counters["deleted_objects"] += len(targets)
                self._counters["delete_skipped_locked"] += skipped
        except Exception:
            self._count("errors")
            logger.exception("ShmL2Adapter: delete of %d keys failed", len(keys))

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None):
        """The keys this adapter knows, ordered by store key; ``cursor`` is the hex store key of the last entry."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        try:
            after = bytes.fromhex(cursor) if cursor is not None else None
        except ValueError as err:
            raise ValueError(f"malformed cursor {cursor!r}") from err
        with self._lock:
            items = sorted(self._known.items())
        entries, last, more = [], None, False
        for encoded, (key, size) in items:
            if after is not None and encoded <= after:
                continue
            if model_name is not None and key.model_name != model_name:
                continue
            if len(entries) == page_size:
                more = True
                break
            entries.append(KeyEntry(key=key.to_encoded_object_key(), size_bytes=size))
            last = encoded
        return KeyListPage(entries=tuple(entries), next_page_token=last.hex() if more and last else None)

    # -- watchdog, TTL, reconciliation -------------------------------------------------------------------------------
    def _store_removals(self) -> int:
        stats = self._store.stats()
        return stats["evictions"] + stats["expired"]

    def _maintain(self) -> None:
        tick = max(0.05, min(0.5, self._timeout / 4))
        next_sweep = time.monotonic() + self._sweep_interval
        while not self._stop.wait(tick):
            try:
                self._fail_stalled()
                if self._store.ttl_seconds is not None and time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self._sweep_interval
                    self._store.sweep_expired()
                self._reconcile()
            except Exception:
                self._count("errors")
                logger.exception("ShmL2Adapter: maintenance failed")

    def _fail_stalled(self) -> None:
        now = time.monotonic()
        with self._lock:
            stalled = [t for t in self._pending.values() if now - t.started > self._timeout]
            for task in stalled:
                task.abandoned = True
        for task in stalled:
            if self._finish(task, self._failure(task)):
                with self._lock:
                    self._counters["timeouts"] += 1
                    self._last_stall = now
                logger.error(
                    "ShmL2Adapter: %s task %d (%d keys) ran over %.1f s; failed by the watchdog",
                    task.kind,
                    task.tid,
                    task.size,
                    self._timeout,
                )

    def _reconcile(self) -> None:
        """Report objects the store removed by itself (hard-cap LRU, TTL) as deleted, so LMCache's view stays true."""
        seen = self._store_removals()
        if seen == self._store_seen:
            return
        self._store_seen = seen
        with self._lock:
            known = list(self._known)
        gone = [encoded for encoded in known if not self._store.exists(encoded)]
        self._count("removed_by_store", self._unregister(gone))

    # -- status and shutdown -----------------------------------------------------------------------------------------
    def report_status(self) -> dict:
        try:
            store_stats = self._store.stats()
            used, capacity = self._store.usage()
            root_ok = os.access(self._store.root, os.W_OK | os.X_OK)
        except Exception as err:
            return {"is_healthy": False, "type": "ShmL2Adapter", "error": str(err)}
        now = time.monotonic()
        with self._lock:
            counters = dict(self._counters)
            pending = len(self._pending)
            oldest = max((now - t.started for t in self._pending.values()), default=0.0)
            recently_stalled = now - self._last_stall < self._unhealthy_for
            known = len(self._known)
            locked = len(self._locks)
        healthy = not self._closed and root_ok and not recently_stalled and self._maintenance.is_alive()
        return {
            "is_healthy": healthy,
            "type": "ShmL2Adapter",
            "root": str(self._store.root),
            "hits": store_stats["hits"],
            "misses": store_stats["misses"],
            "corrupt": store_stats["corrupt"],
            "bytes": used,
            "capacity_bytes": capacity,
            "evictions": store_stats["evictions"] + counters["deleted_objects"],
            "expired": store_stats["expired"],
            "errors": counters["errors"] + counters["timeouts"],
            "bytes_written": store_stats["bytes_written"],
            "bytes_read": store_stats["bytes_read"],
            "objects": known,
            "locked_keys": locked,
            "pending_tasks": pending,
            "oldest_pending_s": round(oldest, 3),
            "counters": counters,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._maintenance.join(timeout=2.0)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    break
            time.sleep(0.01)
        with self._lock:
            leftover = list(self._pending.values())
            for task in leftover:
                task.abandoned = True
        for task in leftover:  # cancelled or stuck: complete them as failed, like the watchdog would
            self._finish(task, self._failure(task))
        for efd in self._efds.values():
            try:
                efd.close()
            except Exception:
                pass
        logger.info("ShmL2Adapter on %s closed: %s", self._store.root, self.report_status())
