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
* ``recycle_bytes`` (default: the capacity; 0 turns it off): removed objects' files kept to be rewritten by later
  puts (see :mod:`lmcache_r3.tiers.shm_store`, "Recycling").
* ``io_threads`` (default 2): a task of several objects totalling at least ``parallel_min_bytes`` (default 8 MiB),
  of ``parallel_min_object_bytes`` (default 1 MiB) each on average, copies them on this many threads at once (one
  tmpfs copy stream does not saturate memory bandwidth). Smaller objects are copied on one thread: the Python work
  around each one holds the interpreter lock, and threads taking turns at it are slower than one thread alone.
* ``inline_max_bytes`` (default 4 MiB on a tmpfs root without ``durable``, else 0) and ``inline_max_objects``
  (default 32): a store or load task of at most that many bytes and objects, and a lookup of at most that many keys,
  runs on the caller's thread (LMCache's store or prefetch controller) instead of a worker. On tmpfs such a task is
  memory copies and file system calls (a 16-object R3 batch takes about 0.5 ms to 1.5 ms on a 2-core VM), and a
  hand-off to a worker and back adds two thread wake-ups (about 50 us each there). The caller waits for an inline
  task, past the watchdog: where tmpfs can stall (swapped out, or memory reclaim in a tight cgroup), set 0 to hand
  every task to a worker, where the watchdog bounds it.

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

Tasks, locks and accounting
---------------------------
Task completion, the watchdog, "locks" and byte accounting are :mod:`lmcache_r3.tiers.task_adapter`'s: every
submitted task completes exactly once and signals its event fd, even when the store throws; a task still running after
``task_timeout_seconds`` is failed and marks the adapter unhealthy for ``unhealthy_for_seconds`` (60); no submit, no
``delete`` and no ``unlock`` raises. Each object is copied between L1 and its file, and checksummed, under a hold
on the task's buffers (:mod:`lmcache_r3.tiers.holds`): the watchdog fails a task only between two objects, and a task
it failed touches no further object, so no L1 buffer LMCache reused is ever read or written, and an object a failed
store task published holds the bytes it was given. The store's own hard-cap LRU and the TTL sweep
may still remove a locked object, which turns its load into a miss (loads may fail by contract).

At start-up the adapter adopts every decodable object under the root and replays the set to every listener registered
after construction, so eviction works after a restart. Objects the store removes on its own (hard-cap eviction, TTL,
corruption, a miss on a key we knew) are reported as deleted and counted as ``removed_by_store``.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.logging import init_logger
from lmcache.v1.distributed.api import ObjectKey

from lmcache_r3.tiers.holds import BuffersGone
from lmcache_r3.tiers.shm_store import (
    HEADER,
    MAX_KEY_BYTES,
    ShmObjectStore,
    UntrustedRootError,
    object_name,
    shard_of,
)
from lmcache_r3.tiers.task_adapter import Task, TaskL2Adapter, byte_view

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
        "recycle_bytes",
        "io_threads",
        "parallel_min_bytes",
        "parallel_min_object_bytes",
        "inline_max_bytes",
        "inline_max_objects",
    }
)
_WORKERS = {"store": 2, "lookup": 1, "load": 2}
TIDY_SECONDS = 60.0
"""How often the watchdog clears what crashed writers and departed servers left on the root
(:meth:`ShmObjectStore.tidy`)."""
_NAMES_MAX = 1 << 16
"""Store keys of this many recent ``ObjectKey`` s are remembered (a key is named by every task that touches it)."""


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


# -- the adapter -----------------------------------------------------------------------------------------------------
class ShmL2Adapter(TaskL2Adapter):
    """An ``L2AdapterInterface`` over :class:`ShmObjectStore` (see the module for the design)."""

    VANISHED = "removed_by_store"

    def __init__(self, adapter_params: dict[str, Any], l1_memory_desc: Any = None) -> None:
        params = dict(adapter_params or {})
        self._names: dict[ObjectKey, bytes] = {}
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
        try:
            self._store = ShmObjectStore(
                root,
                capacity_bytes=capacity,
                ttl_seconds=ttl,
                durable=bool(params.get("durable", False)),
                recycle_bytes=params.get("recycle_bytes"),
            )
        except UntrustedRootError as err:
            logger.error("ShmL2Adapter refuses its root: %s", err)
            raise
        super().__init__(
            capacity_bytes=capacity,
            task_timeout_s=float(params.get("task_timeout_seconds", 30.0)),
            unhealthy_for_s=float(params.get("unhealthy_for_seconds", 60.0)),
            workers={kind: int(params.get(f"num_{kind}_workers", n)) for kind, n in _WORKERS.items()},
            thread_prefix="shm-l2",
            extra_counters=("unrecoverable_keys_at_start",),
        )
        self._sweep_interval = float(params.get("sweep_interval_seconds", 10.0))
        io_threads = int(params.get("io_threads", 2))
        if io_threads < 1:
            raise ValueError(f"ShmL2Adapter: adapter_params.io_threads must be >= 1, got {io_threads}")
        self._parallel_min_bytes = int(params.get("parallel_min_bytes", 8 << 20))
        self._parallel_min_object_bytes = int(params.get("parallel_min_object_bytes", 1 << 20))
        in_memory = self._store.on_tmpfs and not self._store.durable
        self._inline_max_bytes = int(params.get("inline_max_bytes", 4 << 20 if in_memory else 0))
        self._inline_max_objects = int(params.get("inline_max_objects", 32))
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="shm-l2-io") if io_threads > 1 else None
        self._io_threads = io_threads
        self._l1_memory_desc = l1_memory_desc
        self._store_seen = self._store_removals()
        self._adopt_existing()
        self._next_sweep = time.monotonic() + self._sweep_interval
        self._next_tidy = time.monotonic() + TIDY_SECONDS
        self._start_watchdog()
        used, _ = self._store.usage()
        logger.info(
            "ShmL2Adapter on %s: capacity %d bytes, ttl %s s, %d objects (%d bytes) already there",
            self._store.root,
            capacity,
            ttl,
            len(self._known),
            used,
        )

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

    # -- the store's operations --------------------------------------------------------------------------------------
    def _name(self, key: ObjectKey) -> bytes:
        try:
            name = self._names.get(key)
        except TypeError:  # a key with an unhashable field (a bytearray chunk hash, say)
            return encode_object_key(key)
        if name is None:
            if len(self._names) >= _NAMES_MAX:
                self._names.clear()  # atomic, unlike evicting one entry while other threads add theirs
            name = self._names[key] = encode_object_key(key)
        return name

    def _each(
        self, task: Task, keys: list[ObjectKey], names: list[bytes], objects: list[Any], doing: str, operation
    ) -> Iterator[tuple[int, memoryview, Any]]:
        """``(i, view, operation(names[i], view, buffers))`` per object, in order, until a hold on the task's buffers
        is refused (the task was failed); a raise is counted, logged and skips the object. A big task of big objects
        runs on ``io_threads`` threads, each taking every n-th."""
        buffers = self._buffers(task)
        count = min(len(keys), len(names), len(objects))
        self._prepare(names[:count])
        views: list[memoryview | None] = []
        for i in range(count):
            try:
                views.append(byte_view(objects[i]))
            except Exception as err:
                views.append(None)
                self._count("errors")
                logger.warning("ShmL2Adapter: %s %s failed: its buffer cannot be read: %s", doing, keys[i], err)
        lanes = [range(count)]
        if self._io is not None and count > 1:
            total = sum(view.nbytes for view in views if view is not None)
            if total >= self._parallel_min_bytes and total >= count * self._parallel_min_object_bytes:
                n = min(self._io_threads, count)
                lanes = [range(lane, count, n) for lane in range(n)]

        def run(indices: range) -> list[tuple[int, memoryview, Any]]:
            done = []
            for i in indices:
                view = views[i]
                if view is None:
                    continue
                try:
                    done.append((i, view, operation(names[i], view, buffers)))
                except BuffersGone:
                    break
                except Exception as err:
                    self._count("errors")
                    logger.warning("ShmL2Adapter: %s %s failed: %s", doing, keys[i], err)
            return done

        if len(lanes) == 1:
            yield from run(lanes[0])
            return
        futures = [self._io.submit(run, lane) for lane in lanes[1:]]
        results = run(lanes[0])
        for future in futures:
            results += future.result()  # run() never raises
        yield from sorted(results, key=lambda item: item[0])

    def _inline(self, kind: str, count: int, objects: list[Any] | None) -> bool:
        if self._inline_max_bytes <= 0 or count > self._inline_max_objects:
            return False
        if objects is None:
            return True  # a lookup: one access() per key
        try:
            return sum(obj.get_size() for obj in objects) <= self._inline_max_bytes
        except Exception:
            return False  # a buffer it cannot size: the task fails on a worker, like any other

    def _put(
        self, task: Task, keys: list[ObjectKey], names: list[bytes], objects: list[Any]
    ) -> Iterator[tuple[int, int, int]]:
        # An object published after the task failed still holds the bytes it was given (they were read under a hold).
        for i, view, published in self._each(task, keys, names, objects, "storing", self._store.put):
            yield i, view.nbytes, view.nbytes if published else 0

    def _prepare(self, names: list[bytes]) -> None:
        """Work out the file names of a task's objects at once (an invalid one fails its own object later)."""
        try:
            self._store.prepare(names)
        except Exception:
            pass

    def _find(self, task: Task, keys: list[ObjectKey], names: list[bytes]) -> Iterator[int]:
        self._prepare(names)
        for i, (key, name) in enumerate(zip(keys, names, strict=True)):
            if task.abandoned:
                return
            try:
                found = self._store.exists(name)
            except Exception as err:
                self._count("errors")
                logger.warning("ShmL2Adapter: looking up %s failed: %s", key, err)
                continue
            if found:
                yield i

    def _get(
        self, task: Task, keys: list[ObjectKey], names: list[bytes], objects: list[Any]
    ) -> Iterator[tuple[int, int | None]]:
        for i, view, length in self._each(task, keys, names, objects, "loading", self._store.get_into):
            if length is None:
                yield i, None  # absent, expired, or corrupt (the store removed it)
            elif length != view.nbytes:
                logger.warning(
                    "ShmL2Adapter: %s holds %d bytes, the load buffer has %d; not served", keys[i], length, view.nbytes
                )
            else:
                yield i, length

    def _clear_tier(self) -> int:
        return self._store.delete(list(self._store.keys()))  # every object on the root, whoever published it

    def _remove(self, names: list[bytes]) -> Iterable[bytes]:
        self._store.delete(names)  # never raises; a name already gone is gone
        return names

    def _cursor(self, name: bytes) -> str:
        return name.hex()

    def _after(self, cursor: str) -> bytes:
        try:
            return bytes.fromhex(cursor)
        except ValueError as err:
            raise ValueError(f"malformed cursor {cursor!r}") from err

    # -- TTL and reconciliation --------------------------------------------------------------------------------------
    def _store_removals(self) -> int:
        stats = self._store.stats()
        return stats["evictions"] + stats["expired"]

    def _maintain_tier(self) -> None:
        if self._store.ttl_seconds is not None and time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + self._sweep_interval
            self._store.sweep_expired()
        if time.monotonic() >= self._next_tidy:
            self._next_tidy = time.monotonic() + TIDY_SECONDS
            self._store.tidy()
        self._reconcile()

    def _reconcile(self) -> None:
        """Report objects the store removed by itself (hard-cap LRU, TTL) as deleted, so LMCache's view stays true."""
        seen = self._store_removals()
        if seen == self._store_seen:
            return
        self._store_seen = seen
        with self._lock:  # a key stored again while the store is asked has a new entry, and stays known
            known = dict(self._known)
        gone = [encoded for encoded in known if not self._store.exists(encoded)]
        self._count(self.VANISHED, self._unregister(gone, known))

    # -- status ------------------------------------------------------------------------------------------------------
    def _tier_status(self, counters: dict[str, int]) -> tuple[bool, dict[str, Any]]:
        store_stats = self._store.stats()
        used, capacity = self._store.usage()
        root_ok = os.access(self._store.root, os.W_OK | os.X_OK)
        return root_ok, {
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
            "raced": store_stats["raced"],
            "recycled": store_stats["recycled"],
            "pooled_bytes": self._store.pooled_bytes(),
            "on_tmpfs": self._store.on_tmpfs,
            "inline_max_bytes": self._inline_max_bytes,
            "inline_max_objects": self._inline_max_objects,
        }

    def _close_tier(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
