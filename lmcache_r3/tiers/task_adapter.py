"""What the lmcache_r3 tiers share as LMCache 0.5.6 L2 adapters: :class:`TaskL2Adapter`.

A tier subclasses it and provides only its own operations (tier keys, put, find, get, remove; optionally maintenance,
status fields and shutdown: see "what a tier provides" in the class); this module owns the rest of the interface.

Tasks and completion
--------------------
Store, lookup-and-lock and load tasks each run on their own small thread pool, one job per task, except those the tier
runs on the caller's thread (:meth:`TaskL2Adapter._inline`: short work that cannot stall, for which the two thread
wake-ups of a hand-off are a large part of the time; LMCache's controllers submit from their poll loops, record the
task before they next drain results, and act on every signalled event fd, so a task completed before its submit
returns is seen like any other. The watchdog fails such a task on time, but the caller's thread waits for it to
end). Every submitted task completes exactly once (success or failure) and signals its event fd: the job publishes
its result in a ``finally`` whatever the tier raised, a submit that cannot schedule completes the task at once as
failed, and a watchdog thread fails tasks that run longer than the task timeout (marking the adapter unhealthy for
``unhealthy_for_s``). No submit, no ``delete`` and no ``unlock`` raises. A task the watchdog failed is *abandoned*,
and whatever the job finds afterwards is dropped (the keys a late lookup locked are released again). ``close`` fails
the tasks still pending after a grace period.

A tier touches the caller's buffers (LMCache's L1 memory) only under a hold from :meth:`TaskL2Adapter._buffers`
(see :mod:`lmcache_r3.tiers.holds`): a hold is refused once the task was abandoned, and the watchdog does not fail a
task while it holds one, so no byte is copied into or out of memory LMCache reused after a failure, and an object a
store task publishes after it failed still holds the bytes it was given. A hold asked for after the task timeout is
refused too, so a task whose copies overlap (Mooncake's pipelined direct reads: the next batch holds before the
last one lets go) still ends within the timeout plus the copies in progress; it counts as a timeout.

Locks and accounting
--------------------
"Lock" is an in-process reference count per key: a lookup-and-lock hit takes one, ``submit_unlock`` releases it, and
``delete`` (LMCache's eviction, ``DELETE /cache/objects``) skips the key while it is held. The tier's own eviction may
still remove a locked object, which turns its load into a miss (loads may fail by contract).

The adapter keeps the keys it knows (stored here, loaded from a tier another server shares, or found by the tier at
start-up) with their payload sizes and reports them through ``_notify_keys_stored`` / ``_notify_keys_deleted``, so
LMCache's ``get_usage`` and eviction policy see the tier; a listener registered after construction gets the current
set replayed. Known objects a load finds gone, or the tier removed on its own (:meth:`~TaskL2Adapter._unregister`),
are reported deleted.

Clears
------
:meth:`~TaskL2Adapter.clear_objects` waits for the store tasks running when it began, then starts a new *clear
epoch* and has the tier remove everything. A store task carries the epoch it was submitted in: one that publishes
objects in a later epoch (the watchdog failed it while the tier stalled, or it was submitted while the clear waited)
removes them again and is not registered, so nothing stored before a clear is there after it (counted as
``voided_objects``). The check comes after the publish, so an object the clear's listing missed is still removed;
between the two, a lookup on another server may find it.
"""

from __future__ import annotations

import itertools
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.platform import create_event_notifier

from lmcache_r3.tiers.holds import CallerBuffers

logger = init_logger(__name__)

__all__ = ["COUNTERS", "KINDS", "Task", "TaskBuffers", "TaskL2Adapter", "TierClearError", "byte_view"]

KINDS = ("store", "lookup", "load")
"""Task kinds: each has its own thread pool, event fd and result registry."""

COUNTERS = tuple(
    "errors timeouts store_tasks stored_objects store_failures lookup_tasks lookup_hits lookup_misses load_tasks "
    "loaded_objects load_failures deleted_objects delete_skipped_locked clears cleared_objects voided_objects".split()
)
"""The counters every tier reports under ``report_status()["counters"]``."""

Completion = Callable[[Iterable], None]
"""How a tier that completes an operation itself (``_put_then`` and the like) hands over its results."""


class TierClearError(RuntimeError):
    """A tier could not be cleared (wholly); the message says why and what to do."""


@dataclass(eq=False)
class Task:
    tid: int
    kind: str  # one of KINDS
    size: int  # number of keys
    started: float = field(default_factory=time.monotonic)
    done: bool = False
    abandoned: bool = False
    """Failed by the watchdog (or by close): the job must stop touching the caller's buffers."""
    holds: int = 0
    """Holds taken on the caller's buffers (see :class:`TaskBuffers`): while any is, the watchdog leaves the task
    alone, as failing it would hand memory back to LMCache while it is read or written."""
    expired: bool = False
    """It asked for a hold after the task timeout: refused, as is every later one, so a task whose copies keep
    overlapping (one hold taken before the last is released) still ends; it completes as a timeout."""
    epoch: int = 0
    """The clear epoch it was submitted in (see "Clears" in the module)."""


class TaskBuffers(CallerBuffers):
    """The caller's buffers of one task: a hold is refused once the task was abandoned or ran past ``timeout_s``,
    and while one is taken the watchdog (which abandons tasks under ``lock``) leaves the task alone."""

    def __init__(self, lock: threading.Lock, task: Task, timeout_s: float) -> None:
        self._lock = lock
        self._task = task
        self._timeout = timeout_s

    def _refused(self) -> bool:
        """Whether holds are refused now, marking the task expired once it is past its timeout (the lock is held)."""
        task = self._task
        if not (task.abandoned or task.expired) and time.monotonic() - task.started > self._timeout:
            task.expired = True
        return task.abandoned or task.expired

    def cancelled(self) -> bool:
        with self._lock:
            return self._refused()

    def hold(self) -> bool:
        with self._lock:
            if self._refused():
                return False
            self._task.holds += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._task.holds -= 1


def byte_view(obj: Any) -> memoryview:
    """The bytes of an L1 memory object, as a flat writable view of the caller's memory."""
    return memoryview(obj.byte_array).cast("B")


class TaskL2Adapter(L2AdapterInterface):
    """``L2AdapterInterface`` over a tier's operations (see the module). Subclasses call :meth:`_start_watchdog`."""

    VANISHED = "vanished_objects"
    """The counter of known objects the tier no longer has (a load missed them, or the tier removed them)."""

    def __init__(
        self,
        *,
        capacity_bytes: int,
        task_timeout_s: float,
        unhealthy_for_s: float,
        workers: dict[str, int],
        thread_prefix: str,
        extra_counters: tuple[str, ...] = (),
        drain_s: float = 2.0,
    ) -> None:
        super().__init__(max_capacity_bytes=capacity_bytes)
        self._timeout = float(task_timeout_s)
        self._unhealthy_for = float(unhealthy_for_s)
        self._drain_s = float(drain_s)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a task completes
        self._ids = itertools.count(1)
        self._pending: dict[int, Task] = {}
        self._results: dict[str, dict[int, Any]] = {kind: {} for kind in KINDS}
        self._locks: dict[Hashable, int] = {}
        self._deleting: dict[Hashable, int] = {}
        """Names a delete chose (unlocked) and is removing: a lookup meanwhile takes them for misses."""
        self._known: dict[Hashable, tuple[ObjectKey, int]] = {}
        self._epoch = 0
        """Clears begun (see "Clears" in the module)."""
        self._counters = dict.fromkeys((*COUNTERS, self.VANISHED, *extra_counters), 0)
        self._last_stall = float("-inf")
        self._closed = False
        self._efds = {kind: create_event_notifier() for kind in KINDS}
        self._pools = {
            kind: ThreadPoolExecutor(workers[kind], thread_name_prefix=f"{thread_prefix}-{kind}") for kind in KINDS
        }
        self._stop = threading.Event()
        self._maintenance = threading.Thread(target=self._maintain, name=f"{thread_prefix}-watchdog", daemon=True)

    def _start_watchdog(self) -> None:
        """Start the watchdog (and the tier's maintenance); the subclass calls this once it is ready."""
        self._maintenance.start()

    # -- what a tier provides ----------------------------------------------------------------------------------------
    @abstractmethod
    def _name(self, key: ObjectKey) -> Hashable:
        """The tier's key for ``key``: injective, orderable, and cheap."""

    @abstractmethod
    def _put(
        self, task: Task, keys: list[ObjectKey], names: list[Hashable], objects: list[Any]
    ) -> Iterable[tuple[int, int, int]]:
        """Write ``objects[i]`` under ``names[i]``; yield ``(i, size, written)`` for each object the tier now holds.

        ``written`` is the bytes this call wrote (0 when the object was there already). An index not yielded fails
        the task. Read ``objects`` only under a hold of ``self._buffers(task)``; stop when one is refused.
        """

    @abstractmethod
    def _find(self, task: Task, keys: list[ObjectKey], names: list[Hashable]) -> Iterable[int]:
        """Yield the index of each name the tier holds (every name is locked before it is asked for)."""

    @abstractmethod
    def _get(
        self, task: Task, keys: list[ObjectKey], names: list[Hashable], objects: list[Any]
    ) -> Iterable[tuple[int, int | None]]:
        """Read ``names[i]`` into ``objects[i]``; yield ``(i, size)`` when the whole buffer was filled, ``(i, None)``
        when the tier no longer has the object. An index not yielded is a miss. Write (and checksum) ``objects`` only
        under a hold of ``self._buffers(task)``; stop when one is refused."""

    @abstractmethod
    def _remove(self, names: list[Hashable]) -> Iterable[Hashable]:
        """Remove ``names`` from the tier; the names it no longer holds."""

    def _clear_tier(self) -> int:
        """Remove every object of the tier, those other servers sharing it stored too; the number removed. Raises
        :class:`TierClearError` (or anything else) when the tier cannot be cleared."""
        raise TierClearError(f"{type(self).__name__} cannot clear its objects")

    def _maintain_tier(self) -> None:
        """Periodic tier work on the watchdog thread (sweeps, reconciliation); exceptions are counted as errors."""

    def _tier_status(self, counters: dict[str, int]) -> tuple[bool, dict[str, Any]]:
        """Whether the tier is healthy, and its status fields (``counters`` is a snapshot); may raise."""
        return True, {}

    def _close_tier(self) -> None:
        """Release the tier, after every task completed."""

    def _inline(self, kind: str, count: int, objects: list[Any] | None) -> bool:
        """Whether to run a task of ``count`` keys on the caller's thread rather than hand it to a worker
        (``objects``: the L1 buffers of a store or load, None for a lookup). Only for short work that cannot stall
        (the caller's thread waits for it to end, even after the watchdog failed it); by default never."""
        return False

    def _put_then(
        self, task: Task, keys: list[ObjectKey], names: list[Hashable], objects: list[Any], done: Completion
    ) -> bool:
        """Start a put that the tier completes without a worker: ``done(results)`` (``results`` as :meth:`_put`
        yields them) runs once, on any thread, when it ended. False, and nothing started: the put runs as
        :meth:`_put` on a worker. Runs on the caller's thread: only short work that cannot stall. By default False."""
        return False

    def _find_then(self, task: Task, keys: list[ObjectKey], names: list[Hashable], done: Completion) -> bool:
        """:meth:`_find` as :meth:`_put_then` is :meth:`_put` (the names are locked already). By default False."""
        return False

    def _get_then(
        self, task: Task, keys: list[ObjectKey], names: list[Hashable], objects: list[Any], done: Completion
    ) -> bool:
        """:meth:`_get` as :meth:`_put_then` is :meth:`_put`. By default False."""
        return False

    def _cursor(self, name: Hashable) -> str:
        """The ``list_l2_keys`` cursor of ``name``."""
        return str(name)

    def _after(self, cursor: str) -> Hashable:
        """The name a ``list_l2_keys`` cursor stands for; ValueError when malformed."""
        return cursor

    # -- event fds ---------------------------------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._efds["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efds["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efds["load"].fileno()

    # -- task plumbing -----------------------------------------------------------------------------------------------
    def _submit(self, kind: str, size: int, start, *args) -> L2TaskId:
        """Register a task and ``start(task, *args)`` it on the caller's thread, which hands it to the tier's own
        completion, runs it there, or schedules it on a worker (see :meth:`_launch`); never raises, every task
        completes."""
        task = Task(tid=next(self._ids), kind=kind, size=size)
        with self._lock:
            task.epoch = self._epoch
            self._pending[task.tid] = task
            self._counters[f"{kind}_tasks"] += 1
        try:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            start(task, *args)
        except Exception as err:
            logger.warning("%s: could not start a %s task: %s", type(self).__name__, kind, err)
            self._count("errors")
            self._finish(task, self._failure(task))
        return task.tid

    def _launch(self, task: Task, inline: bool, job, *args) -> None:
        """Run ``job(task, *args)`` now, on the caller's thread (``inline``), or on a worker of the task's kind."""
        if inline:
            job(task, *args)  # completes the task (its event fd is signalled before the caller waits on it)
        else:
            self._pools[task.kind].submit(job, task, *args)

    @staticmethod
    def _failure(task: Task) -> Any:
        return L2StoreResult(False, 0) if task.kind == "store" else Bitmap(task.size)

    def _finish(self, task: Task, result: Any) -> bool:
        """Publish ``result`` and signal, once per task; False when the task was already completed.

        A task that ended because a hold was refused past its timeout counts as a timeout, as if the watchdog had
        failed it (its result is whatever it completed before).
        """
        with self._lock:
            if not self._complete(task, result):
                return False
            expired = task.expired and not task.abandoned
            if expired:
                self._counters["timeouts"] += 1
                self._last_stall = time.monotonic()
        self._signal(task.kind)
        if expired:
            logger.error("%s: %s task %d (%d keys) ran over %.1f s; stopped at its next hold on LMCache's memory",
                         type(self).__name__, task.kind, task.tid, task.size, self._timeout)  # fmt: skip
        return True

    def _complete(self, task: Task, result: Any) -> bool:
        """Publish ``result`` unless the task was completed already (the lock is held)."""
        if task.done:
            return False
        task.done = True
        self._pending.pop(task.tid, None)
        self._results[task.kind][task.tid] = result
        self._idle.notify_all()
        return True

    def _signal(self, kind: str) -> None:
        try:
            self._efds[kind].notify()
        except Exception:
            logger.exception("%s: signalling a %s completion failed", type(self).__name__, kind)

    def _buffers(self, task: Task) -> TaskBuffers:
        """The holds on ``task``'s buffers (see :mod:`lmcache_r3.tiers.holds`)."""
        return TaskBuffers(self._lock, task, self._timeout)

    def _crashed(self, task: Task) -> None:
        """The tier raised out of a task's operation: count and log it (the job still completes the task)."""
        self._count("errors")
        logger.exception("%s: %s task %d failed", type(self).__name__, task.kind, task.tid)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    # -- store -------------------------------------------------------------------------------------------------------
    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        return self._submit("store", len(keys), self._start_store, list(keys), list(objects))

    def _start_store(self, task: Task, keys: list[ObjectKey], objects: list[Any]) -> None:
        if len(objects) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(objects)} objects")
        names = [self._name(key) for key in keys]
        done = _once(partial(self._stored, task, keys, names))
        if not self._put_then(task, keys, names, objects, done):
            self._launch(task, self._inline("store", len(keys), objects), self._run_store, keys, names, objects, done)

    def _run_store(self, task: Task, keys: list[ObjectKey], names: list[Hashable], objects: list[Any], done) -> None:
        done(_lazily(self._put, task, keys, names, objects))

    def _stored(self, task: Task, keys: list[ObjectKey], names: list[Hashable], results: Iterable) -> None:
        """Account for a put's ``results`` (as :meth:`_put` yields them) and complete its task."""
        ok = True
        written = 0
        stored_keys: list[ObjectKey] = []
        stored_names: list[Hashable] = []
        stored_sizes: list[int] = []
        try:
            for i, size, new_bytes in results:
                stored_keys.append(keys[i])
                stored_names.append(names[i])
                stored_sizes.append(size)
                written += new_bytes
        except BaseException:
            ok = False
            self._crashed(task)
        finally:
            ok = ok and len(stored_keys) == len(keys)
            try:
                if stored_names and not self._register(stored_keys, stored_sizes, stored_names, epoch=task.epoch):
                    ok, stored_keys = False, []
                    self._void(task, stored_names)
                with self._lock:
                    self._counters["stored_objects"] += len(stored_keys)
                    self._counters["store_failures"] += len(keys) - len(stored_keys)
            except Exception:
                logger.exception("%s: accounting a store failed", type(self).__name__)
            self._finish(task, L2StoreResult(ok, written))

    def _void(self, task: Task, names: list[Hashable]) -> None:
        """Remove what a store task published after a clear that began once it was submitted."""
        with self._removing(names):
            gone = list(self._remove(names))
        self._count("voided_objects", len(names))
        logger.warning("%s: store task %d published %d objects after a clear; removed %d of them again",
                       type(self).__name__, task.tid, len(names), len(gone))  # fmt: skip

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._results["store"] = self._results["store"], {}
        return done

    # -- lookup and lock ---------------------------------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs: Any = None) -> L2TaskId:
        return self._submit("lookup", len(keys), self._start_lookup, list(keys))

    def _start_lookup(self, task: Task, keys: list[ObjectKey]) -> None:
        names = [self._name(key) for key in keys]
        # Locked before the tier is asked: a delete (LMCache's eviction) between a key's check and its lock would
        # remove a key this lookup reports locked. The keys the tier lacks are released when it answers.
        doomed = self._acquire(names)
        done = _once(partial(self._found, task, names, doomed))
        try:
            if not self._find_then(task, keys, names, done):
                self._launch(task, self._inline("lookup", len(keys), None), self._run_lookup, keys, names, done)
        except BaseException:
            done(())  # releases the locks (unless the tier answered already)
            raise

    def _run_lookup(self, task: Task, keys: list[ObjectKey], names: list[Hashable], done) -> None:
        done(_lazily(self._find, task, keys, names))

    def _found(self, task: Task, names: list[Hashable], doomed: set[int], results: Iterable[int]) -> None:
        """Take a lookup's ``results`` (as :meth:`_find` yields them), release the misses' locks, complete it."""
        bitmap = Bitmap(len(names))
        found: set[int] = set()
        try:
            for i in results:
                if i not in doomed:
                    found.add(i)
                    bitmap.set(i)
        except BaseException:
            self._crashed(task)
        finally:
            with self._lock:
                self._counters["lookup_hits"] += len(found)
                self._counters["lookup_misses"] += len(names) - len(found)
            # The misses are released before the answer is out: once LMCache reads it, the tier holds the locks it
            # reports and no other.
            self._release([name for i, name in enumerate(names) if i not in found])
            if not self._finish(task, bitmap):  # the caller got an empty bitmap and will never unlock any
                self._release([name for i, name in enumerate(names) if i in found])

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._results["lookup"].pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        try:
            self._release([self._name(key) for key in keys])
        except Exception:
            self._count("errors")
            logger.exception("%s: unlock failed", type(self).__name__)

    def _acquire(self, names: list[Hashable]) -> set[int]:
        """Lock ``names``; the indexes of those a delete is removing now (locked too, but to be taken for misses)."""
        with self._lock:
            for name in names:
                self._locks[name] = self._locks.get(name, 0) + 1
            return {i for i, name in enumerate(names) if name in self._deleting} if self._deleting else set()

    def _release(self, names: list[Hashable]) -> None:
        with self._lock:
            for name in names:
                count = self._locks.get(name, 0)
                if count <= 1:
                    self._locks.pop(name, None)
                else:
                    self._locks[name] = count - 1

    # -- load --------------------------------------------------------------------------------------------------------
    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        return self._submit("load", len(keys), self._start_load, list(keys), list(objects))

    def _start_load(self, task: Task, keys: list[ObjectKey], objects: list[Any]) -> None:
        if len(objects) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(objects)} objects")
        names = [self._name(key) for key in keys]
        with self._lock:  # a key stored again while it is read has a new entry, and stays known
            seen = {name: self._known.get(name) for name in names}
        done = _once(partial(self._loaded, task, keys, names, seen))
        if not self._get_then(task, keys, names, objects, done):
            self._launch(task, self._inline("load", len(keys), objects), self._run_load, keys, names, objects, done)

    def _run_load(self, task: Task, keys: list[ObjectKey], names: list[Hashable], objects: list[Any], done) -> None:
        done(_lazily(self._get, task, keys, names, objects))

    def _loaded(
        self,
        task: Task,
        keys: list[ObjectKey],
        names: list[Hashable],
        seen: dict[Hashable, Any],
        results: Iterable[tuple[int, int | None]],
    ) -> None:
        """Take a load's ``results`` (as :meth:`_get` yields them), account for them, complete the task."""
        bitmap = Bitmap(len(keys))
        loaded_keys: list[ObjectKey] = []
        loaded_names: list[Hashable] = []
        loaded_sizes: list[int] = []
        vanished: list[Hashable] = []
        try:
            for i, size in results:
                if size is None:
                    vanished.append(names[i])
                else:
                    bitmap.set(i)
                    loaded_keys.append(keys[i])
                    loaded_names.append(names[i])
                    loaded_sizes.append(size)
        except BaseException:
            self._crashed(task)
        finally:
            try:
                with self._lock:
                    self._counters["load_failures"] += len(keys) - len(loaded_keys)
                    self._counters["loaded_objects"] += len(loaded_keys)
                self._count(self.VANISHED, self._unregister(vanished, seen))
                if loaded_keys:
                    self._register(loaded_keys, loaded_sizes, loaded_names)  # objects another server stored
                    self._notify_keys_accessed(loaded_keys)
            except Exception:
                logger.exception("%s: accounting a load failed", type(self).__name__)
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
            with self._removing(targets):
                gone = list(self._remove(targets))
            self._count("deleted_objects", self._unregister(gone))
        except Exception:
            self._count("errors")
            logger.exception("%s: delete of %d keys failed", type(self).__name__, len(keys))

    @contextmanager
    def _removing(self, names: list[Hashable]) -> Iterator[None]:
        """Inside the block (the tier removing ``names``), a lookup takes them for misses."""
        with self._lock:
            for name in names:
                self._deleting[name] = self._deleting.get(name, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                for name in names:
                    count = self._deleting.pop(name)
                    if count > 1:
                        self._deleting[name] = count - 1

    def clear_objects(self) -> int:
        """Remove every object of the tier (what a policy update needs: see docs/tiers.md); the number removed.

        The store tasks running when it is called finish first (at most the task timeout), and a store task that
        publishes after the clear began (one the watchdog failed) removes its objects again (see "Clears" in the
        module), so nothing stored before the clear is there after it. The tier removes everything it holds, every
        server's objects on a shared root or Mooncake prefix, and the adapter forgets (and reports deleted) every
        key it knew. Objects a lookup locked are removed too: their loads miss, as loads may. Raises
        :class:`TierClearError` when the stores in flight did not finish in time or the tier could not be cleared.
        """
        with self._idle:
            stores = {tid for tid, task in self._pending.items() if task.kind == "store"}
            finished = self._idle.wait_for(lambda: stores.isdisjoint(self._pending), timeout=self._timeout)
            running = len(stores.intersection(self._pending))
        if not finished:
            raise TierClearError(
                f"{running} store task(s) still running after {self._timeout:g} s (task_timeout_seconds): "
                "nothing was cleared; clear again once the tier answers"
            )
        with self._lock:
            self._epoch += 1
        removed = self._clear_tier()
        with self._lock:
            gone = list(self._known.values())
            self._known.clear()
            self._counters["clears"] += 1
            self._counters["cleared_objects"] += removed
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [s for _, s in gone])
        logger.info("%s: cleared %d objects (%d known here)", type(self).__name__, removed, len(gone))
        return removed

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None):
        """The keys this adapter knows, ordered by tier key; ``cursor`` stands for the tier key of the last entry."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        after = self._after(cursor) if cursor is not None else None
        with self._lock:
            items = sorted(self._known.items())
        entries, last, more = [], None, False
        for name, (key, size) in items:
            if after is not None and name <= after:
                continue
            if model_name is not None and key.model_name != model_name:
                continue
            if len(entries) == page_size:
                more = True
                break
            entries.append(KeyEntry(key=key.to_encoded_object_key(), size_bytes=size))
            last = name
        return KeyListPage(entries=tuple(entries), next_page_token=self._cursor(last) if more else None)

    # -- accounting --------------------------------------------------------------------------------------------------
    def register_listener(self, listener: Any) -> None:
        """Register ``listener`` and replay the objects already known, so its LRU can evict them."""
        super().register_listener(listener)
        with self._lock:
            snapshot = list(self._known.values())
        if snapshot:
            try:
                listener.on_l2_keys_stored([k for k, _ in snapshot], [s for _, s in snapshot])
            except Exception:
                logger.exception("%s: replaying %d known keys to a listener failed", type(self).__name__, len(snapshot))

    def _register(
        self, keys: list[ObjectKey], sizes: list[int], names: list[Hashable] | None = None, epoch: int | None = None
    ) -> bool:
        """Know ``keys`` (tier keys ``names``, worked out when not given) with their payload sizes; the ones not
        known yet are reported stored. With ``epoch``, only while that clear epoch lasts: False, and nothing known,
        once a later clear began."""
        if names is None:
            names = [self._name(key) for key in keys]
        new_keys, new_sizes = [], []
        with self._lock:
            if epoch is not None and epoch != self._epoch:
                return False
            for key, size, name in zip(keys, sizes, names, strict=True):
                known = name in self._known
                self._known[name] = (key, size)  # a new entry each time: see _unregister's ``seen``
                if not known:
                    new_keys.append(key)
                    new_sizes.append(size)
        if new_keys:
            self._notify_keys_stored(new_keys, new_sizes)
        return True

    def _unregister(self, names: Iterable[Hashable], seen: dict[Hashable, Any] | None = None) -> int:
        """Forget ``names``; the ones known are reported deleted. The number forgotten.

        ``seen``: the entries of ``_known`` when the caller found the names gone from the tier; a name stored (or
        loaded) again since has a new entry and is kept.
        """
        gone = []
        with self._lock:
            for name in names:
                entry = self._known.get(name)
                if entry is None or (seen is not None and entry is not seen.get(name)):
                    continue
                del self._known[name]
                gone.append(entry)
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [s for _, s in gone])
        return len(gone)

    # -- watchdog ----------------------------------------------------------------------------------------------------
    def _maintain(self) -> None:
        tick = max(0.05, min(0.5, self._timeout / 4))
        while not self._stop.wait(tick):
            try:
                self._fail_stalled()
                self._maintain_tier()
            except Exception:
                self._count("errors")
                logger.exception("%s: maintenance failed", type(self).__name__)

    def _fail_stalled(self) -> None:
        now = time.monotonic()
        stalled = lambda t: now - t.started > self._timeout and not t.holds  # noqa: E731
        for task in self._abandon(stalled, stalled_at=now):
            logger.error(
                "%s: %s task %d (%d keys) ran over %.1f s; failed by the watchdog",
                type(self).__name__,
                task.kind,
                task.tid,
                task.size,
                self._timeout,
            )

    def _abandon(self, which, stalled_at: float | None = None) -> list[Task]:
        """Abandon the pending tasks ``which(task)`` selects and complete them as failed, counting them as timeouts
        when ``stalled_at`` is given (before the caller can see the failure); the tasks abandoned."""
        with self._lock:
            tasks = [t for t in self._pending.values() if which(t)]
            for task in tasks:
                task.abandoned = True
                self._complete(task, self._failure(task))
            if stalled_at is not None and tasks:
                self._counters["timeouts"] += len(tasks)
                self._last_stall = stalled_at
        for kind in {task.kind for task in tasks}:
            self._signal(kind)
        return tasks

    # -- status and shutdown -----------------------------------------------------------------------------------------
    def report_status(self) -> dict:
        now = time.monotonic()
        with self._lock:
            counters = dict(self._counters)
            pending = len(self._pending)
            oldest = max((now - t.started for t in self._pending.values()), default=0.0)
            recently_stalled = now - self._last_stall < self._unhealthy_for
            known = len(self._known)
            locked = len(self._locks)
        try:
            tier_healthy, fields = self._tier_status(counters)
        except Exception as err:
            return {"is_healthy": False, "type": type(self).__name__, "error": str(err)}
        healthy = tier_healthy and not self._closed and not recently_stalled and self._maintenance.is_alive()
        return {
            "is_healthy": healthy,
            "type": type(self).__name__,
            **fields,
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
        if self._maintenance.is_alive():
            self._maintenance.join(timeout=2.0)
        with self._idle:
            self._idle.wait_for(lambda: not self._pending, timeout=self._drain_s)
        self._abandon(lambda task: True)  # cancelled or stuck: complete them as failed, like the watchdog would
        try:
            self._close_tier()
        except Exception:
            logger.exception("%s: closing the tier failed", type(self).__name__)
        for efd in self._efds.values():
            try:
                efd.close()
            except Exception:
                pass
        logger.info("%s closed: %s", type(self).__name__, self.report_status())


def _once(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn``, run by the first call only (a task's results are taken once, whichever thread brings them first)."""
    claim = threading.Lock().acquire

    def once(*args: Any) -> None:
        if claim(blocking=False):
            fn(*args)

    return once


def _lazily(operation: Callable[..., Iterable], *args: Any) -> Iterator:
    """``operation(*args)``'s items, called on the first ``next``: the taker's ``try`` covers all of it."""
    yield from operation(*args)
