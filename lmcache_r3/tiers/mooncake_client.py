"""A Mooncake client that no caller ever waits on for more than a bound, over a master that may come and go.

:class:`BoundedMooncakeClient` owns one ``MooncakeDistributedStore``. Every call runs on a small pool of daemon
threads and is waited for at most ``call_timeout_seconds``; a call still running then is *abandoned*: the caller gets
``TIMEOUT`` codes at once, and any staging buffer the call writes into stays the call's until it returns
(:meth:`~BoundedMooncakeClient.submit` starts a call and :meth:`~BoundedMooncakeClient.wait` waits for it, so a caller
can work while its call runs; the bound runs from the submit; :meth:`~BoundedMooncakeClient.then` answers a callback
instead, so that no thread waits at all). Calls
answer one integer code per key; a failed call answers ``n`` copies of ``UNAVAILABLE``, ``TIMEOUT`` or ``EXCEPTION``,
never raises. :func:`describe` names Mooncake's codes and these.

Why the bounds: with the master SIGKILLed, Mooncake calls block ~4.3 s before returning ``RPC_FAIL`` (-900); with it
stopped they hang; and ``setup`` against an absent master blocks ~90 s. So a monitor thread probes the master's
``GET /health`` (its metrics port) every ``probe_interval_seconds`` and calls ``setup`` only after it answered.
States:

* ``connecting``: no client yet (the master was down at start, or ``setup`` failed); calls answer ``UNAVAILABLE``.
* ``up``: calls go to Mooncake.
* ``down``: ``/health`` stopped answering, a call timed out, or one returned ``RPC_FAIL``. Calls answer
  ``UNAVAILABLE`` at once until ``/health`` answers again and ``retry_after_seconds`` passed. Mooncake's client
  reconnects by itself; a restarted master is empty. ``recoveries`` counts the returns to ``up``.
* ``closed``.

Staging buffers (:meth:`acquire`) are numpy buffers registered with the client and reused by size, so that
``put_from``/``get_into`` never need the client's ``local_buffer_size``. One caller memory region (LMCache's L1
arena) may be registered as well (:meth:`register_region`): it is registered once the client is set up, and
:attr:`region` says whether it is, so objects in it can move without staging.
"""

from __future__ import annotations

import heapq
import itertools
import os
import queue
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np
from lmcache.logging import init_logger

from lmcache_r3.tiers.mooncake_config import MooncakeTierSettings

logger = init_logger(__name__)

OK = 0
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
RPC_FAIL = -900
UNAVAILABLE = -10001
TIMEOUT = -10002
EXCEPTION = -10003
CORRUPT = -10004
SIZE_MISMATCH = -10005
CANCELLED = -10006
INVALID_PARAMS = -600

_CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    -200: "NO_AVAILABLE_HANDLE (no space left in any segment)",
    INVALID_PARAMS: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    UNAVAILABLE: "UNAVAILABLE (master down or not connected yet)",
    TIMEOUT: "TIMEOUT (call abandoned after its bound)",
    EXCEPTION: "EXCEPTION (the client raised)",
    CORRUPT: "CORRUPT (header or checksum mismatch; removed)",
    SIZE_MISMATCH: "SIZE_MISMATCH (stored size differs from the buffer)",
    CANCELLED: "CANCELLED (the caller gave up)",
}
_BUFFER_ALIGN = 1 << 20


def describe(code: int) -> str:
    """A code's name, e.g. ``describe(-704) == "OBJECT_NOT_FOUND(-704)"``."""
    return f"{_CODE_NAMES.get(code, 'OK' if code >= 0 else 'MOONCAKE_ERROR')}({code})"


PROGRESS_TIMEOUT_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"
"""Mooncake's TCP transport fails a transfer that received nothing for this many seconds (default 30), and writes
nothing into its destination after that: the bound on a transfer this client never abandons."""


@dataclass
class PendingCall:
    """A call :meth:`BoundedMooncakeClient.submit` started (``future`` None: it answers ``UNAVAILABLE``)."""

    what: str
    n: int
    future: Future | None
    deadline: float
    buf: np.ndarray | None


class _DaemonPool:
    """Threads for calls that may block in native code: daemons, so a stuck call never holds up the exit.

    A job goes to the thread that went idle last, so sequential calls keep running on one warm thread (Mooncake
    transfers from a thread that has not transferred lately are markedly slower); the others take concurrent jobs.
    """

    def __init__(self, size: int, name: str) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # a stack: the last thread to go idle is on top
        self._backlog: deque[tuple[Callable[[], Any], Future]] = deque()
        self._closed = False
        for i in range(size):
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            self._idle.insert(0, jobs)
            threading.Thread(target=self._work, args=(jobs,), name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            worker = self._idle.pop() if self._idle and not self._closed else None
            if worker is None:
                self._backlog.append((fn, future))
                return future
        worker.put((fn, future))
        return future

    def _work(self, jobs: queue.SimpleQueue) -> None:
        job = jobs.get()
        while job is not None:
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:
                    future.set_exception(err)
            with self._lock:
                if self._closed:
                    return
                if self._backlog:
                    job = self._backlog.popleft()
                    continue
                self._idle.append(jobs)
            job = jobs.get()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for jobs in idle:
            jobs.put(None)


class _Deadlines:
    """One daemon thread that runs ``action(False)`` at its time, and ``action(True)`` for those left at close.

    Actions run late by up to ``slack_s`` (due ones run together), and a call that registers a deadline wakes the
    thread only when it would otherwise sleep past it: an idle thread sleeps ``idle_s`` at a time, so the deadlines
    of a steady stream of calls (each ``call_timeout_seconds`` ahead) never wake it. Actions must be short; one that
    raises is logged.
    """

    def __init__(self, name: str, slack_s: float = 0.02, idle_s: float = 1.0) -> None:
        self._slack, self._idle = slack_s, idle_s
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[bool], None]]] = []
        self._order = itertools.count()
        self._wake_at = float("inf")
        self._closed = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def add(self, when: float, action: Callable[[bool], None]) -> None:
        with self._cond:
            if self._closed:
                closed = True
            else:
                closed = False
                heapq.heappush(self._heap, (when, next(self._order), action))
                if when < self._wake_at:
                    self._cond.notify()
        if closed:
            _run_callback(action, True)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            left, self._heap = self._heap, []
            self._cond.notify()
        for _, _, action in sorted(left):
            _run_callback(action, True)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
                if due:
                    self._cond.release()
                    try:
                        for action in due:
                            _run_callback(action, False)
                    finally:
                        self._cond.acquire()
                    continue
                sleep = max(self._slack, min(self._heap[0][0] - now if self._heap else self._idle, self._idle))
                self._wake_at = now + sleep
                self._cond.wait(sleep)
                self._wake_at = float("inf")


def _run_callback(callback: Callable[[Any], None], argument: Any) -> None:
    try:
        callback(argument)
    except Exception:
        logger.exception("Mooncake tier: a completion callback raised")


class _StagingBuffers:
    """Registered byte buffers, reused by size; keeps at most ``keep_bytes`` of idle ones."""

    def __init__(self, native: Any, keep_bytes: int) -> None:
        self._native = native
        self._keep_bytes = keep_bytes
        self._idle: list[np.ndarray] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, buf in enumerate(self._idle) if buf.nbytes >= nbytes]
            if fits:
                return self._idle.pop(min(fits, key=lambda i: self._idle[i].nbytes))
        buf = np.empty(-(-max(nbytes, 1) // _BUFFER_ALIGN) * _BUFFER_ALIGN, dtype=np.uint8)
        code = self._native.register_buffer(buf.ctypes.data, buf.nbytes)
        if code != 0:
            raise RuntimeError(f"register_buffer of {buf.nbytes} bytes returned {describe(code)}")
        return buf

    def release(self, buf: np.ndarray) -> None:
        with self._lock:
            if sum(b.nbytes for b in self._idle) + buf.nbytes <= self._keep_bytes:
                self._idle.append(buf)
                return
        self._native.unregister_buffer(buf.ctypes.data)


class BoundedMooncakeClient:
    """One Mooncake client behind bounded calls and a master monitor (see the module). Thread-safe.

    Construction never blocks on the master: the client is set up in the background once ``/health`` answers.
    """

    def __init__(self, settings: MooncakeTierSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._native: Any = None
        self._buffers: _StagingBuffers | None = None
        self._wanted_region: tuple[int, int] | None = None
        self._region: tuple[int, int] | None = None
        self._state = "connecting"
        self._reason = "waiting for the master's /health"
        self._down_until = 0.0
        self._last_fault = float("-inf")
        self._last_fault_reason = ""
        self._stats = dict.fromkeys(("timeouts", "exceptions", "recoveries"), 0)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never probe through a proxy
        self._io = _DaemonPool(settings.num_io_threads, "mooncake-io")
        self._deadlines = _Deadlines("mooncake-deadlines")
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch_master, name="mooncake-monitor", daemon=True)
        self._monitor.start()

    @property
    def state(self) -> str:
        """``connecting``, ``up``, ``down`` or ``closed``."""
        return self._state

    def seconds_since_fault(self) -> float:
        """Seconds since the last timeout, exception or ``RPC_FAIL`` (infinite when none)."""
        return time.monotonic() - self._last_fault

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(
                self._stats,
                state=self._state,
                reason=self._reason,
                last_fault=self._last_fault_reason,
                master=self.settings.mooncake.master_server_address,
            )

    def call(self, what: str, n: int, fn: Callable[[Any], Sequence[int]], buf: np.ndarray | None = None) -> list[int]:
        """``fn(native_client)`` on an io thread within the bound: its ``n`` codes, or ``n`` copies of a failure code.

        ``fn`` must not read variables the caller rebinds (bind them with ``functools.partial``): an abandoned call
        runs on after the caller moved on. It keeps ``buf`` until it returns; see :meth:`done_with`.
        """
        return self.wait(self.submit(what, n, fn, buf))

    def submit(
        self,
        what: str,
        n: int,
        fn: Callable[[Any], Sequence[int]],
        buf: np.ndarray | None = None,
        bound_s: float | None = None,
    ) -> PendingCall:
        """Start ``fn(native_client)`` on an io thread (as :meth:`call` does) without waiting; :meth:`wait` answers.

        The bound runs from here: :meth:`wait` abandons the call ``bound_s`` (default ``call_timeout_seconds``)
        after it was submitted.
        """
        with self._lock:
            native = self._native if self._state == "up" else None
        if native is None or n == 0:
            return PendingCall(what, n, None, 0.0, buf)
        deadline = time.monotonic() + (self.settings.call_timeout_seconds if bound_s is None else bound_s)
        return PendingCall(what, n, self._io.submit(lambda: fn(native)), deadline, buf)

    def wait(self, pending: PendingCall) -> list[int]:
        """The ``n`` codes of a submitted call, or ``n`` copies of a failure code, by its deadline."""
        future = pending.future
        if future is None:
            return [UNAVAILABLE] * pending.n
        try:
            result = future.result(timeout=max(0.0, pending.deadline - time.monotonic()))
        except FutureTimeout:
            return self._abandon(pending)
        except Exception as err:
            return self._raised(pending, err)
        return self._checked(pending, result)

    def then(self, pending: PendingCall, callback: Callable[[list[int]], None]) -> None:
        """Call ``callback(codes)`` exactly once with what :meth:`wait` would answer, without a thread waiting.

        It runs on the io thread when the call returns (on the thread calling this, at once, when it returned
        already), on the client's deadline thread when the call's bound passes first (``TIMEOUT``, counted and
        marking the client down, as :meth:`wait` does), at once for a call that never started, and with
        ``CANCELLED`` when the client closes first. The callback must be short and must not wait for another call
        of this client; an exception it raises is logged.
        """
        future = pending.future
        if future is None:
            _run_callback(callback, [UNAVAILABLE] * pending.n)
            return
        claim = threading.Lock().acquire  # the first of the call's return, its deadline or close to claim it answers

        def returned(_: Future) -> None:
            if claim(blocking=False):
                if future.cancelled():  # by close
                    codes = [CANCELLED] * pending.n
                elif (error := future.exception()) is not None:
                    codes = self._raised(pending, error)
                else:
                    codes = self._checked(pending, future.result())
                _run_callback(callback, codes)

        def expired(closing: bool) -> None:
            if claim(blocking=False):
                if closing:
                    future.cancel()
                    codes = [CANCELLED] * pending.n
                else:
                    codes = self._abandon(pending)
                _run_callback(callback, codes)

        self._deadlines.add(pending.deadline, expired)
        future.add_done_callback(returned)

    def _abandon(self, pending: PendingCall) -> list[int]:
        """A call past its bound: it never runs if still queued behind stuck calls (a late transfer must not touch
        what the caller reused), keeps its staging buffer until it returns, and marks the client down."""
        pending.future.cancel()
        if pending.buf is not None:
            buf = pending.buf
            pending.future.add_done_callback(lambda _: self._release(buf))
        bound = self.settings.call_timeout_seconds
        self._fault("timeouts", f"{pending.what} of {pending.n} keys took over {bound} s", down=True)
        return [TIMEOUT] * pending.n

    def _raised(self, pending: PendingCall, err: BaseException) -> list[int]:
        self._fault("exceptions", f"{pending.what} of {pending.n} keys raised {err!r}", down=False)
        return [EXCEPTION] * pending.n

    def _checked(self, pending: PendingCall, result: Sequence[int]) -> list[int]:
        """A returned call's codes, one per key, as the caller gets them."""
        what, n = pending.what, pending.n
        try:
            codes = [int(code) for code in result]
        except Exception as err:
            return self._raised(pending, err)
        if len(codes) != n:
            self._fault("exceptions", f"{what} answered {len(codes)} codes for {n} keys", down=False)
            return [EXCEPTION] * n
        if RPC_FAIL in codes:
            self._fault(None, f"{what} got RPC_FAIL from the master", down=True)
        return codes

    def when_done(self, pending: PendingCall, what: str, fn: Callable[[Any], Sequence[int]]) -> None:
        """Run ``fn(native_client)`` on an io thread once ``pending`` returned (whether or not anyone still waits for
        it); nobody waits for ``fn``."""
        if pending.future is not None:
            pending.future.add_done_callback(lambda _: self.submit(what, 1, fn))

    def register_region(self, ptr: int, size: int) -> None:
        """Register ``[ptr, ptr + size)`` with the client once it is set up (now, when it is already)."""
        with self._lock:
            self._wanted_region = (ptr, size)
            native = self._native
        if native is not None:
            self._register_region(native)

    @property
    def region(self) -> tuple[int, int] | None:
        """``(ptr, size)`` of the caller region registered with the client, or None."""
        return self._region

    @property
    def max_in_flight(self) -> int:
        """How many calls one caller may keep submitted but not yet waited for (each on its own io thread)."""
        return max(1, min(2, self.settings.num_io_threads))

    def acquire(self, nbytes: int) -> np.ndarray | None:
        """A registered staging buffer of at least ``nbytes``, or None while not ``up``."""
        buffers = self._buffers
        if buffers is None or self._state != "up":
            return None
        try:
            return buffers.acquire(nbytes)
        except Exception as err:
            self._fault("exceptions", f"registering a {nbytes}-byte staging buffer raised {err!r}", down=False)
            return None

    def done_with(self, buf: np.ndarray, codes: list[int]) -> None:
        """Give ``buf`` back after a :meth:`call` with it, unless the call was abandoned (it gives it back later)."""
        if not codes or codes[0] != TIMEOUT:
            self._release(buf)

    def close(self) -> None:
        """Stop probing and close the client (bounded: a client stuck on a dead master is left to the exit)."""
        with self._lock:
            native, self._native, self._state = self._native, None, "closed"
        self._stop.set()
        if native is not None:
            try:
                self._io.submit(native.close).exception(timeout=self.settings.call_timeout_seconds)
            except FutureTimeout:
                pass
        self._deadlines.close()
        self._io.shutdown()

    # -- internals -----------------------------------------------------------------------------------------------
    def _register_region(self, native: Any) -> None:
        wanted = self._wanted_region
        if wanted is None or self._region == wanted:
            return
        try:
            code = native.register_buffer(*wanted)
            outcome = f"returned {describe(code)}"
        except Exception as err:
            code, outcome = None, f"raised {err!r}"
        if code == 0:
            self._region = wanted
            logger.info("Mooncake tier: registered the L1 region (%d bytes); its objects move unstaged", wanted[1])
        else:
            logger.warning("Mooncake tier: register_buffer of the L1 region (%d bytes) %s; staging", wanted[1], outcome)

    def _release(self, buf: np.ndarray) -> None:
        buffers = self._buffers
        if buffers is not None:
            try:
                buffers.release(buf)
            except Exception:
                pass  # the buffer is garbage-collected; unregistering it is best effort

    def _fault(self, counter: str | None, reason: str, down: bool) -> None:
        with self._lock:
            self._last_fault = time.monotonic()
            self._last_fault_reason = reason
            if counter:
                self._stats[counter] += 1
            if down and self._state == "up":
                self._state, self._reason = "down", reason
                self._down_until = time.monotonic() + self.settings.retry_after_seconds
        if down:
            logger.warning("Mooncake tier down: %s", reason)

    def _healthy(self) -> bool:
        try:
            with self._opener.open(self.settings.health_url, timeout=1.0) as response:
                return response.status == 200
        except Exception:
            return False

    def _watch_master(self) -> None:
        while not self._stop.is_set():
            try:
                self._probe_once()
            except Exception:  # the monitor must outlive any surprise, or the tier never comes back
                logger.exception("Mooncake tier: probing the master failed")
            self._stop.wait(self.settings.probe_interval_seconds)

    def _probe_once(self) -> None:
        healthy = self._healthy()
        with self._lock:
            if self._state == "closed":
                return
            before = self._state
            if not healthy and self._state == "up":
                self._state, self._reason = "down", f"the master's {self.settings.health_url} does not answer"
                self._down_until = time.monotonic() + self.settings.retry_after_seconds
            elif healthy and self._state == "down" and time.monotonic() >= self._down_until:
                self._state, self._reason = "up", ""
                self._stats["recoveries"] += 1
            after, reason = self._state, self._reason
            connect = healthy and self._native is None
        if after != before:
            logger.warning("Mooncake tier %s -> %s %s", before, after, reason)
        if connect:
            self._connect()

    def _connect(self) -> None:
        """``setup`` a client (the master just answered ``/health``; without it ``setup`` blocks ~90 s)."""
        from mooncake.store import MooncakeDistributedStore

        c = self.settings.mooncake
        wanted = str(self.settings.transfer_progress_timeout_seconds)
        if (found := os.environ.setdefault(PROGRESS_TIMEOUT_ENV, wanted)) != wanted:
            logger.info("Mooncake tier: %s=%s (from the environment)", PROGRESS_TIMEOUT_ENV, found)
        native = MooncakeDistributedStore()
        try:
            code = native.setup(
                c.local_hostname,
                c.metadata_server,
                c.global_segment_size,
                c.local_buffer_size,
                c.protocol,
                c.device_name or "",
                c.master_server_address,
                enable_ssd_offload=c.enable_ssd_offload,
                ssd_offload_path=c.ssd_offload_path,
                tenant_id=c.tenant_id,
                enable_client_http_server=c.enable_client_http_server,
                client_http_port=c.client_http_port,
            )
            error = f"returned {code}"
        except Exception as err:
            code, error = None, f"raised {err!r}"
        with self._lock:
            if code == 0 and self._state != "closed":
                self._native, self._state, self._reason = native, "up", ""
                self._buffers = _StagingBuffers(native, keep_bytes=2 * self.settings.batch_bytes)
                self._register_region(native)
                logger.info("Mooncake tier connected to the master at %s", c.master_server_address)
                return
            if self._state != "closed":
                self._reason = f"setup against {c.master_server_address} {error}; retrying"
                logger.error("Mooncake tier: %s", self._reason)
        native.close()
