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
  (0.5), ``retry_after_seconds`` (2), ``batch_bytes`` (64 MiB), ``batch_max_objects`` (256), ``num_io_threads`` (4);
  ``2 * num_io_threads * batch_max_objects`` may be at most 2048 (Mooncake fails every transfer of a client with
  more parts than that in flight).
* ``key_prefix`` (``"lmcache_r3/"``): namespaces this tier's keys in a shared Mooncake.
* ``capacity_bytes`` (0): passed to LMCache as ``max_capacity_bytes`` so an ``"eviction"`` policy can evict ahead of
  Mooncake's own eviction (0: leave eviction to Mooncake).
* ``known_sweep_seconds`` (1): how often the adapter asks Mooncake whether the next 4096 keys it knows are still
  there and reports the ones Mooncake evicted on its own as deleted (0: never), so its key set, its usage and
  LMCache's view of the tier follow Mooncake's eviction instead of growing with every key ever stored.
* ``task_timeout_seconds`` (10): the watchdog fails a task still running after this long.
* ``unhealthy_for_seconds`` (5): status stays unhealthy this long after a timeout, an exception or a failed task.
* ``num_store_workers`` / ``num_lookup_workers`` / ``num_load_workers`` (2 / 1 / 2).
* ``zero_copy_min_bytes`` (512 KiB): objects at least this big are written straight from L1 to Mooncake.
* ``inline_max_bytes`` (4 MiB): a store or load of at most this many bytes that is one staged call (R3 chunks) is
  staged on the submitting thread and completed on the Mooncake client's call thread, with no store or load worker
  in between; lookups always complete there. 0: every store and load runs on a worker.
* ``direct_reads`` (true), ``direct_read_max_seconds`` (60), ``transfer_progress_timeout_seconds`` (2): read such
  objects straight into L1 as well; a transfer into L1 is never abandoned while it may still write there (see
  :mod:`lmcache_r3.tiers.mooncake_store`).

When LMCache passes ``l1_memory_desc`` (its L1 arena), the arena is registered with the Mooncake client once, and
objects of at least ``zero_copy_min_bytes`` in it are written from (and, with ``direct_reads``, read into) L1
without staging copies (see
:mod:`lmcache_r3.tiers.mooncake_store`); other objects, or all of them without a descriptor, are staged.

An ``ObjectKey`` becomes the Mooncake key ``<key_prefix><model_name>@<object_group_id>@<kv_rank>@<cache_salt>@<hex
chunk hash>``: injective, because neither the model name nor the salt may contain ``@``.

The master may be down at start (the adapter starts unhealthy and connects when ``/health`` answers), die, or come
back empty; meanwhile every task still completes, as misses or failures, within the store's call bound, so LMCache
keeps serving from L1. After each recovery the adapter asks Mooncake which of the keys it knows are still there and
reports the others as deleted.

Task completion, the watchdog, "locks" and byte accounting are :mod:`lmcache_r3.tiers.task_adapter`'s: every submitted
task completes exactly once and signals its event fd, even when the client throws; no submit, ``delete`` or
``unlock`` raises. The store touches the caller's memory only under holds of the task's buffers
(:mod:`lmcache_r3.tiers.holds`): the watchdog cannot fail a task while a batch is staged from or copied into L1, or
while a direct transfer into L1 is in flight (up to ``direct_read_max_seconds``), and a task it failed touches L1 no
more; a direct read whose query was abandoned while the master stalled never writes into L1 afterwards. A load that
fails leaves its bit 0, and LMCache does not use that buffer, so a direct read that fails its checksum is only a
miss. Mooncake's own eviction may still drop a locked key, which makes its load a miss; known keys a load finds gone
are counted as ``vanished_objects``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from lmcache.logging import init_logger
from lmcache.v1.distributed.api import ObjectKey

from lmcache_r3.tiers.mooncake_client import CORRUPT, OBJECT_NOT_FOUND, describe
from lmcache_r3.tiers.mooncake_config import STORE_PARAMS, MooncakeTierConfigError, settings_from_params
from lmcache_r3.tiers.mooncake_store import MooncakeObjectStore
from lmcache_r3.tiers.task_adapter import Task, TaskL2Adapter, TierClearError, byte_view

logger = init_logger(__name__)

__all__ = ["MooncakeL2Adapter", "l1_region", "mooncake_key"]

_ADAPTER_PARAMS = frozenset(
    "key_prefix capacity_bytes task_timeout_seconds unhealthy_for_seconds num_store_workers num_lookup_workers "
    "num_load_workers known_sweep_seconds".split()
)
_WORKERS = {"store": 2, "lookup": 1, "load": 2}
_PAGE = 4096
"""Keys per existence query of the reconciliation and the sweep (about 2 ms a query on loopback)."""


def mooncake_key(key: ObjectKey, prefix: str = "lmcache_r3/") -> str:
    """The Mooncake key of ``key``, e.g. ``lmcache_r3/tiny-moe@0@0@@00ff...``."""
    return (
        f"{prefix}{key.model_name}@{key.object_group_id}@{key.kv_rank}@{key.cache_salt}@{bytes(key.chunk_hash).hex()}"
    )


def l1_region(l1_memory_desc: Any) -> tuple[int, int] | None:
    """``(ptr, size)`` of LMCache's L1 arena from its ``L1MemoryDesc``, or None when there is none to register.

    The whole arena (``size``) is registered, as LMCache's own Mooncake adapter does: over TCP Mooncake needs no
    pinned pages, and a transport that cannot register the arena makes the store stage every object instead.
    """
    if l1_memory_desc is None:
        return None
    ptr, size = int(l1_memory_desc.ptr), int(l1_memory_desc.size)
    if ptr <= 0 or size <= 0:
        logger.warning("MooncakeL2Adapter: l1_memory_desc ptr=%#x size=%d describes no memory; staging", ptr, size)
        return None
    return ptr, size


def _number(params: dict[str, Any], key: str, default: float, integer: bool = False) -> Any:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float) or value < 0:
        kind = "an int" if integer else "a number"
        raise MooncakeTierConfigError(f"adapter_params.{key} must be {kind} >= 0, got {value!r}")
    return value


def _stored(views: list[memoryview], codes: list[int]) -> Iterator[tuple[int, int, int]]:
    """A put's codes as ``TaskL2Adapter._put`` yields them: every object stored (or there already) counts whole."""
    for i, (view, code) in enumerate(zip(views, codes, strict=True)):
        if code == 0:
            yield i, view.nbytes, view.nbytes


def _present(codes: list[int]) -> Iterator[int]:
    """The keys an existence query found: 0 is absent, negative an error, neither a hit."""
    return (i for i, code in enumerate(codes) if code == 1)


def _loaded(views: list[memoryview], codes: list[int]) -> Iterator[tuple[int, int | None]]:
    """A read's codes as ``TaskL2Adapter._get`` yields them."""
    for i, (view, code) in enumerate(zip(views, codes, strict=True)):
        if code == view.nbytes:
            yield i, code
        elif code in (OBJECT_NOT_FOUND, CORRUPT):  # gone, or removed by the store
            yield i, None


class MooncakeL2Adapter(TaskL2Adapter):
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
        timeout = float(_number(params, "task_timeout_seconds", 10.0))
        unhealthy_for = float(_number(params, "unhealthy_for_seconds", 5.0))
        self._sweep_every = float(_number(params, "known_sweep_seconds", 1.0))
        self._sweep_at = 0.0
        self._sweep_names: list[str] = []
        """Known keys still to check in the current pass of the sweep."""
        workers = {
            kind: max(1, _number(params, f"num_{kind}_workers", n, integer=True)) for kind, n in _WORKERS.items()
        }
        self._store = MooncakeObjectStore(settings)
        region = l1_region(l1_memory_desc)
        if region is not None:
            self._store.register_region(*region)
        super().__init__(
            capacity_bytes=capacity,
            task_timeout_s=timeout,
            unhealthy_for_s=unhealthy_for,
            workers=workers,
            thread_prefix="mooncake-l2",
            drain_s=2.0 * settings.call_timeout_seconds,
        )
        self._seen_recoveries = 0
        self._start_watchdog()
        logger.info(
            "MooncakeL2Adapter: master %s (health %s), call bound %.1f s, capacity %d bytes, L1 region %s; "
            "connecting in background",
            settings.mooncake.master_server_address,
            settings.health_url,
            settings.call_timeout_seconds,
            capacity,
            f"{region[1]} bytes" if region else "none",
        )

    # -- Mooncake's operations ---------------------------------------------------------------------------------------
    def _name(self, key: ObjectKey) -> str:
        return mooncake_key(key, self._prefix)

    def _put(
        self, task: Task, keys: list[ObjectKey], names: list[str], objects: list[Any]
    ) -> Iterator[tuple[int, int, int]]:
        views = [byte_view(obj) for obj in objects]
        # Read under holds of the task's buffers: an object stored after the task failed holds the bytes it was given.
        yield from _stored(views, self._store.put(names, views, buffers=self._buffers(task)))

    def _put_then(self, task: Task, keys: list[ObjectKey], names: list[str], objects: list[Any], done) -> bool:
        # Small staged puts (R3): staged here, completed on the client's call thread; no worker in between.
        views = [byte_view(obj) for obj in objects]
        return self._store.put_then(names, views, self._buffers(task), lambda codes: done(_stored(views, codes)))

    def _find(self, task: Task, keys: list[ObjectKey], names: list[str]) -> Iterator[int]:
        yield from _present(self._store.exists(names))

    def _find_then(self, task: Task, keys: list[ObjectKey], names: list[str], done) -> bool:
        self._store.exists_then(names, lambda codes: done(_present(codes)))
        return True

    def _get(
        self, task: Task, keys: list[ObjectKey], names: list[str], objects: list[Any]
    ) -> Iterator[tuple[int, int | None]]:
        views = [byte_view(obj) for obj in objects]
        # A direct transfer into L1 holds the task's buffers until it returned (or outlived its own bound).
        yield from _loaded(views, self._store.get_into(names, views, buffers=self._buffers(task)))

    def _get_then(self, task: Task, keys: list[ObjectKey], names: list[str], objects: list[Any], done) -> bool:
        views = [byte_view(obj) for obj in objects]
        return self._store.get_then(names, views, self._buffers(task), lambda codes: done(_loaded(views, codes)))

    def _clear_tier(self) -> int:
        if not self._prefix:
            raise TierClearError(
                "key_prefix is empty: clearing would remove every object of this Mooncake, other users' too; "
                "give the tier a key_prefix (the default is 'lmcache_r3/')"
            )
        removed = self._store.remove_prefix(self._prefix)
        if removed < 0:
            raise TierClearError(
                f"Mooncake did not remove the objects under {self._prefix!r}: {describe(removed)} (its client is "
                f"{self._store.state}); nothing was cleared there, clear again once the master answers"
            )
        return removed

    def _remove(self, names: list[str]) -> Iterable[str]:
        codes = self._store.remove(names)
        return [name for name, code in zip(names, codes, strict=True) if code in (0, OBJECT_NOT_FOUND)]

    # -- reconciliation ----------------------------------------------------------------------------------------------
    def _maintain_tier(self) -> None:
        self._store.remove_late()
        recoveries = self._store.stats()["recoveries"]
        if recoveries != self._seen_recoveries:
            self._seen_recoveries = recoveries
            self._reconcile()
        now = time.monotonic()
        if self._sweep_every and now >= self._sweep_at and self._store.state == "up":
            self._sweep_at = now + self._sweep_every
            self._sweep_known()

    def _reconcile(self) -> None:
        """After the master came back (perhaps empty), report the known keys Mooncake no longer has as deleted."""
        with self._lock:
            names = list(self._known)
        vanished = self._forget_gone(names)
        logger.info("MooncakeL2Adapter: master back; %d of %d known objects are gone", vanished, len(names))

    def _sweep_known(self) -> None:
        """Check the next page of the known keys (a pass over all of them, page by page, then a new pass)."""
        if not self._sweep_names:
            with self._lock:
                self._sweep_names = list(self._known)
        page, self._sweep_names = self._sweep_names[:_PAGE], self._sweep_names[_PAGE:]
        if page:
            self._forget_gone(page)

    def _forget_gone(self, names: list[str]) -> int:
        """Report the ``names`` Mooncake says it no longer has as deleted (an error is not an answer); how many.

        A name stored again while Mooncake was asked is kept (its entry is a new one).
        """
        with self._lock:
            seen = {name: self._known.get(name) for name in names}
        gone = []
        for start in range(0, len(names), _PAGE):
            batch = names[start : start + _PAGE]
            gone += [name for name, code in zip(batch, self._store.exists(batch), strict=True) if code == 0]
        vanished = self._unregister(gone, seen)
        self._count(self.VANISHED, vanished)
        return vanished

    # -- status and shutdown -----------------------------------------------------------------------------------------
    def _tier_status(self, counters: dict[str, int]) -> tuple[bool, dict[str, Any]]:
        store = self._store.stats()
        healthy = store["state"] == "up" and self._store.seconds_since_fault() >= self._unhealthy_for
        return healthy, {
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
            "l1_region_bytes": region[1] if (region := self._store.region) else 0,
            "direct_written": store["direct_written"],
            "direct_read": store["direct_read"],
            "late_puts": store["late_puts"],
            "late_puts_removed": store["late_puts_removed"],
        }

    def _close_tier(self) -> None:
        self._store.close()
