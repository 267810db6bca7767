"""The Mooncake tier as an LMCache 0.5.6 L2 adapter: KV and R3 objects alike live in a :class:`MooncakeObjectStore`.

Loaded by LMCache's stock plugin factory::

    lmcache server ... --l2-adapter '{"type": "plugin", "module_path": "lmcache_r3.tiers.mooncake_adapter",
        "class_name": "MooncakeL2Adapter",
        "adapter_params": {"mooncake": {"local_hostname": "10.0.0.2", "metadata_server": "P2PHANDSHAKE",
                                        "master_server_address": "10.0.0.1:50051"},
                           "master_metrics_port": 9003}}'

``adapter_params`` (see :mod:`lmcache_r3.tiers.mooncake_config` for the Mooncake and timing keys):

* ``mooncake``: the Mooncake client config; without it ``MOONCAKE_CONFIG_PATH`` is read. A missing or bad setting
  fails the adapter's construction with :class:`MooncakeTierConfigError` (the server refuses to start and says why).
* ``master_metrics_port`` (9003) or ``master_health_url``; ``call_timeout_seconds`` (2), ``probe_interval_seconds``
  (0.5), ``retry_after_seconds`` (2), ``batch_bytes`` (64 MiB), ``num_io_threads`` (4).
* ``key_prefix`` (``"lmcache_r3/"``): namespaces this tier's keys in a shared Mooncake.
* ``capacity_bytes`` (0): passed to LMCache as ``max_capacity_bytes`` so an ``"eviction"`` policy can evict ahead of
  Mooncake's own eviction (0: leave eviction to Mooncake).
* ``task_timeout_seconds`` (10): the watchdog fails a task still running after this long.
* ``unhealthy_for_seconds`` (5): status stays unhealthy this long after a timeout, an exception or a failed task.
* ``num_store_workers`` / ``num_lookup_workers`` / ``num_load_workers`` (2 / 1 / 2).

An ``ObjectKey`` becomes the Mooncake key ``<key_prefix><model_name>@<object_group_id>@<kv_rank>@<cache_salt>@<hex
chunk hash>``: injective, because neither the model name nor the salt may contain ``@``.

The master may be down at start (the adapter starts unhealthy and connects when ``/health`` answers), die, or come
back empty; meanwhile every task still completes, as misses or failures, within the store's call bound, so LMCache
keeps serving from L1. After each recovery the adapter asks Mooncake which of the keys it knows are still there and
reports the others as deleted.

Task completion, the watchdog, "locks" (an in-process count that makes ``delete`` skip a key; Mooncake's own
eviction may still drop it, which makes its load a miss) and byte accounting follow
:mod:`lmcache_r3.tiers.shm_adapter`: every submitted task completes exactly once and signals its event fd, no submit,
``delete`` or ``unlock`` raises, and a task the watchdog failed stops before touching the caller's next buffer.
"""

from __future__ import annotations

import itertools
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

from lmcache_r3.tiers.mooncake_client import CORRUPT, OBJECT_NOT_FOUND
from lmcache_r3.tiers.mooncake_config import STORE_PARAMS, MooncakeTierConfigError, settings_from_params
from lmcache_r3.tiers.mooncake_store import MooncakeObjectStore

logger = init_logger(__name__)

__all__ = ["MooncakeL2Adapter", "mooncake_key"]

_ADAPTER_PARAMS = frozenset(
    "key_prefix capacity_bytes task_timeout_seconds unhealthy_for_seconds num_store_workers num_lookup_workers "
    "num_load_workers".split()
)
_WORKERS = {"store": 2, "lookup": 1, "load": 2}


def mooncake_key(key: ObjectKey, prefix: str = "lmcache_r3/") -> str:
    """The Mooncake key of ``key``, e.g. ``lmcache_r3/tiny-moe@0@0@@00ff...``."""
    return (
        f"{prefix}{key.model_name}@{key.object_group_id}@{key.kv_rank}@{key.cache_salt}@{bytes(key.chunk_hash).hex()}"
    )


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


def _number(params: dict[str, Any], key: str, default: float, integer: bool = False) -> Any:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float) or value < 0:
        kind = "an int" if integer else "a number"
        raise MooncakeTierConfigError(f"adapter_params.{key} must be {kind} >= 0, got {value!r}")
    return value


class MooncakeL2Adapter(L2AdapterInterface):
    """An ``L2AdapterInterface`` over :class:`MooncakeObjectStore` (see the module for the design)."""

    def __init__(self, adapter_params: dict[str, Any], l1_memory_desc: Any = None) -> None:
        params = dict(adapter_params or {})
        unknown = sorted(set(params) - _ADAPTER_PARAMS - STORE_PARAMS)
        if unknown:
            raise MooncakeTierConfigError(
                f"MooncakeL2Adapter: unknown adapter_params {unknown}; known: {sorted(_ADAPTER_PARAMS | STORE_PARAMS)}"
            )
        settings = settings_from_params(params)
        self._prefix = params.get("key_prefix", "lmcache_r3/")
        if not isinstance(self._prefix, str):
            raise MooncakeTierConfigError(f"adapter_params.key_prefix must be a string, got {self._prefix!r}")
        capacity = _number(params, "capacity_bytes", 0, integer=True)
        self._timeout = float(_number(params, "task_timeout_seconds", 10.0))
        self._unhealthy_for = float(_number(params, "unhealthy_for_seconds", 5.0))
        workers = {kind: _number(params, f"num_{kind}_workers", n, integer=True) for kind, n in _WORKERS.items()}
        super().__init__(max_capacity_bytes=capacity)
        self._store = MooncakeObjectStore(settings)

        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Task] = {}
        self._results: dict[str, dict[int, Any]] = {"store": {}, "lookup": {}, "load": {}}
        self._locks: dict[str, int] = {}
        self._known: dict[str, tuple[ObjectKey, int]] = {}
        self._counters = dict.fromkeys(
            "errors timeouts store_tasks stored_objects store_failures lookup_tasks lookup_hits lookup_misses "
            "load_tasks loaded_objects load_failures deleted_objects delete_skipped_locked vanished_objects".split(),
            0,
        )
        self._last_stall = float("-inf")
        self._seen_recoveries = 0
        self._closed = False
        self._efds = {kind: create_event_notifier() for kind in ("store", "lookup", "load")}
        self._pools = {
            kind: ThreadPoolExecutor(max(1, n), thread_name_prefix=f"mooncake-l2-{kind}") for kind, n in workers.items()
        }
        self._stop = threading.Event()
        self._maintenance = threading.Thread(target=self._maintain, name="mooncake-l2-watchdog", daemon=True)
        self._maintenance.start()
        logger.info(
            "MooncakeL2Adapter: master %s (health %s), call bound %.1f s, capacity %d bytes; connecting in background",
            settings.mooncake.master_server_address,
            settings.health_url,
            settings.call_timeout_seconds,
            capacity,
        )

    # -- accounting ------------------------------------------------------------------------------------------------
    def _register(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        new_keys, new_sizes = [], []
        with self._lock:
            for key, size in zip(keys, sizes, strict=True):
                name = self._name(key)
                if name not in self._known:
                    self._known[name] = (key, size)
                    new_keys.append(key)
                    new_sizes.append(size)
        if new_keys:
            self._notify_keys_stored(new_keys, new_sizes)

    def _unregister(self, names: list[str]) -> int:
        gone = []
        with self._lock:
            for name in names:
                entry = self._known.pop(name, None)
                if entry is not None:
                    gone.append(entry)
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [s for _, s in gone])
        return len(gone)

    def _name(self, key: ObjectKey) -> str:
        return mooncake_key(key, self._prefix)

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
                raise RuntimeError("MooncakeL2Adapter is closed")
            self._pools[kind].submit(job, task, *args)
        except Exception as err:
            logger.warning("MooncakeL2Adapter: could not schedule a %s task: %s", kind, err)
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
            logger.exception("MooncakeL2Adapter: signalling a %s completion failed", task.kind)
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
        stored_keys: list[ObjectKey] = []
        stored_sizes: list[int] = []
        try:
            names = [self._name(key) for key in keys]
            views = [_view(obj) for obj in objects]
            codes = self._store.put(names, views, cancelled=lambda: task.abandoned)
            with self._lock:
                abandoned = task.abandoned
            if abandoned:
                # The caller was told this task failed and may have reused a buffer while it was copied.
                self._store.remove([name for name, code in zip(names, codes, strict=True) if code == 0])
                ok = False
            else:
                for key, view, code in zip(keys, views, codes, strict=True):
                    if code == 0:
                        stored_keys.append(key)
                        stored_sizes.append(view.nbytes)
                        written += view.nbytes
                    else:
                        ok = False
        except BaseException:
            ok = False
            self._count("errors")
            logger.exception("MooncakeL2Adapter: store task %d failed", task.tid)
        finally:
            try:
                self._register(stored_keys, stored_sizes)
                with self._lock:
                    self._counters["stored_objects"] += len(stored_keys)
                    self._counters["store_failures"] += len(keys) - len(stored_keys)
            except Exception:
                logger.exception("MooncakeL2Adapter: accounting a store failed")
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
        locked: list[str] = []
        try:
            names = [self._name(key) for key in keys]
            for i, (name, code) in enumerate(zip(names, self._store.exists(names), strict=True)):
                if code == 1:  # 0 is absent, negative an error: neither is a hit
                    with self._lock:
                        self._locks[name] = self._locks.get(name, 0) + 1
                    locked.append(name)
                    bitmap.set(i)
        except BaseException:
            self._count("errors")
            logger.exception("MooncakeL2Adapter: lookup task %d failed", task.tid)
        finally:
            with self._lock:
                self._counters["lookup_hits"] += len(locked)
                self._counters["lookup_misses"] += len(keys) - len(locked)
            if not self._finish(task, bitmap):
                self._release(locked)  # the caller got an empty bitmap and will never unlock these

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._results["lookup"].pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        try:
            self._release([self._name(key) for key in keys])
        except Exception:
            self._count("errors")
            logger.exception("MooncakeL2Adapter: unlock failed")

    def _release(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                count = self._locks.get(name, 0)
                if count <= 1:
                    self._locks.pop(name, None)
                else:
                    self._locks[name] = count - 1

    # -- load --------------------------------------------------------------------------------------------------------
    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        return self._submit("load", len(keys), self._run_load, list(keys), list(objects))

    def _run_load(self, task: _Task, keys: list[ObjectKey], objects: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        loaded_keys: list[ObjectKey] = []
        loaded_sizes: list[int] = []
        vanished: list[str] = []
        try:
            names = [self._name(key) for key in keys]
            views = [_view(obj) for obj in objects]
            codes = self._store.get_into(names, views, cancelled=lambda: task.abandoned)
            for i, (key, name, view, code) in enumerate(zip(keys, names, views, codes, strict=True)):
                if code == view.nbytes:
                    bitmap.set(i)
                    loaded_keys.append(key)
                    loaded_sizes.append(code)
                elif code in (OBJECT_NOT_FOUND, CORRUPT):  # gone, or removed by the store
                    vanished.append(name)
        except BaseException:
            self._count("errors")
            logger.exception("MooncakeL2Adapter: load task %d failed", task.tid)
        finally:
            try:
                with self._lock:
                    self._counters["load_failures"] += len(keys) - len(loaded_keys)
                    self._counters["loaded_objects"] += len(loaded_keys)
                self._count("vanished_objects", self._unregister(vanished))
                if loaded_keys:
                    self._register(loaded_keys, loaded_sizes)  # objects another server stored
                    self._notify_keys_accessed(loaded_keys)
            except Exception:
                logger.exception("MooncakeL2Adapter: accounting a load failed")
            self._finish(task, bitmap)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._results["load"].pop(task_id, None)

    # -- eviction and listing ----------------------------------------------------------------------------------------
    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove ``keys`` (LMCache's eviction thread, ``DELETE /cache/objects``); skips locked keys; never raises."""
        try:
            names = [self._name(key) for key in keys]
            with self._lock:
                targets = [name for name in names if self._locks.get(name, 0) <= 0]
                self._counters["delete_skipped_locked"] += len(names) - len(targets)
            codes = self._store.remove(targets)
            gone = [name for name, code in zip(targets, codes, strict=True) if code in (0, OBJECT_NOT_FOUND)]
            self._count("deleted_objects", self._unregister(gone))
        except Exception:
            self._count("errors")
            logger.exception("MooncakeL2Adapter: delete of %d keys failed", len(keys))

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None):
        """The keys this adapter knows, ordered by Mooncake key; ``cursor`` is the Mooncake key of the last entry."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        with self._lock:
            items = sorted(self._known.items())
        entries, last, more = [], None, False
        for name, (key, size) in items:
            if cursor is not None and name <= cursor:
                continue
            if model_name is not None and key.model_name != model_name:
                continue
            if len(entries) == page_size:
                more = True
                break
            entries.append(KeyEntry(key=key.to_encoded_object_key(), size_bytes=size))
            last = name
        return KeyListPage(entries=tuple(entries), next_page_token=last if more else None)

    # -- watchdog and reconciliation ---------------------------------------------------------------------------------
    def _maintain(self) -> None:
        tick = max(0.05, min(0.5, self._timeout / 4))
        while not self._stop.wait(tick):
            try:
                self._fail_stalled()
                recoveries = self._store.stats()["recoveries"]
                if recoveries != self._seen_recoveries:
                    self._seen_recoveries = recoveries
                    self._reconcile()
            except Exception:
                self._count("errors")
                logger.exception("MooncakeL2Adapter: maintenance failed")

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
                    "MooncakeL2Adapter: %s task %d (%d keys) ran over %.1f s; failed by the watchdog",
                    task.kind,
                    task.tid,
                    task.size,
                    self._timeout,
                )

    def _reconcile(self) -> None:
        """After the master came back (perhaps empty), report the known keys Mooncake no longer has as deleted."""
        with self._lock:
            names = list(self._known)
        vanished = []
        for start in range(0, len(names), 4096):
            batch = names[start : start + 4096]
            vanished += [name for name, code in zip(batch, self._store.exists(batch), strict=True) if code == 0]
        self._count("vanished_objects", self._unregister(vanished))
        logger.info("MooncakeL2Adapter: master back; %d of %d known objects are gone", len(vanished), len(names))

    # -- status and shutdown -----------------------------------------------------------------------------------------
    def report_status(self) -> dict:
        try:
            store = self._store.stats()
            since_fault = self._store.seconds_since_fault()
        except Exception as err:
            return {"is_healthy": False, "type": "MooncakeL2Adapter", "error": str(err)}
        now = time.monotonic()
        with self._lock:
            counters = dict(self._counters)
            pending = len(self._pending)
            oldest = max((now - t.started for t in self._pending.values()), default=0.0)
            recently_stalled = min(now - self._last_stall, since_fault) < self._unhealthy_for
            known = len(self._known)
            locked = len(self._locks)
        healthy = not self._closed and store["state"] == "up" and not recently_stalled and self._maintenance.is_alive()
        return {
            "is_healthy": healthy,
            "type": "MooncakeL2Adapter",
            "state": store["state"],
            "reason": store["reason"] or store["last_fault"],
            "master": store["master"],
            "hits": store["hits"],
            "misses": store["misses"],
            "corrupt": store["corrupt"],
            "bytes": self.get_usage().total_bytes_used,
            "capacity_bytes": self._max_capacity_bytes,
            "evictions": counters["deleted_objects"] + counters["vanished_objects"],
            "errors": store["errors"] + counters["errors"] + counters["timeouts"],
            "errors_by_code": store["errors_by_code"],
            "call_timeouts": store["timeouts"],
            "call_exceptions": store["exceptions"],
            "recoveries": store["recoveries"],
            "bytes_written": store["bytes_written"],
            "bytes_read": store["bytes_read"],
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
        deadline = time.monotonic() + 2.0 * self._store.settings.call_timeout_seconds
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
        self._store.close()
        for efd in self._efds.values():
            try:
                efd.close()
            except Exception:
                pass
        logger.info("MooncakeL2Adapter closed: %s", self.report_status())
