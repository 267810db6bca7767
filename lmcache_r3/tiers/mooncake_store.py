"""A Mooncake distributed store as a remote object tier: self-checking objects, bounded calls, a master that may go.

An *object* is an opaque payload stored under a string key in a Mooncake store (``mooncake_master`` plus the
processes that mount memory segments). :class:`MooncakeObjectStore` wraps one ``MooncakeDistributedStore`` client
and offers batch calls that answer with one explicit integer *code* per key, never with an ambiguous empty value:

* ``exists`` -> 1 present, 0 absent, negative: an error;
* ``put`` -> 0 stored (also when the key was already there: Mooncake keeps the first writer's value);
* ``get_into`` -> the payload length when the object was read, checked and copied, else a negative code;
* ``remove`` -> 0 removed, negative otherwise.

Negative codes are Mooncake's own (``OBJECT_NOT_FOUND`` -704, ``RPC_FAIL`` -900, ...) or this module's, from
-10001 down (``UNAVAILABLE``, ``TIMEOUT``, ``EXCEPTION``, ``CORRUPT``, ``SIZE_MISMATCH``, ``CANCELLED``);
:func:`describe` names any of them. No batch call raises for a tier failure.

An object is the 32-byte header of :mod:`lmcache_r3.tiers.shm_store` (magic, version, payload length, XXH3-64
of the payload, XXH3-64 of the header) followed by the payload. Reads ask ``get_size`` first (a missing or
differently sized object costs no transfer), then ``batch_get_into`` into a registered staging buffer, then check
the header and checksum before the payload reaches the caller; a corrupt object is counted and removed. Writes copy
header and payload into a registered staging buffer and ``batch_put_from`` it. The client's own ``local_buffer_size``
bounds only ``put``/``get``, which are never used, so an object of any size round-trips. Staging buffers are this
module's, never the caller's: a call that is abandoned after its bound still writes only into memory it owns.

Bounds. Every Mooncake call runs on a small pool of daemon threads and is waited for at most
``call_timeout_seconds``; a late call is abandoned (its codes become ``TIMEOUT``) and the store turns *down*.
With the master SIGKILLed, Mooncake calls block ~4.3 s before returning -900, and ``setup`` against an absent
master blocks ~90 s, so a background thread probes the master's ``GET /health`` (metrics port) every
``probe_interval_seconds`` and calls ``setup`` only once it answers. States:

* ``connecting``: no client yet (the master was down at start); every call answers ``UNAVAILABLE`` at once.
* ``up``: calls go to Mooncake.
* ``down``: the master stopped answering ``/health``, a call timed out, or one returned ``RPC_FAIL``; calls answer
  ``UNAVAILABLE`` at once until ``/health`` answers again and ``retry_after_seconds`` passed. Mooncake's client
  reconnects by itself; objects do not survive a master restart, and ``recoveries`` counts the returns to ``up``.

Example::

    store = MooncakeObjectStore(settings_from_params(  # lmcache_r3.tiers.mooncake_config
        {"mooncake": {...}, "master_metrics_port": 9003}))
    store.put(["k1"], [memoryview(payload)])        # [0]
    store.get_into(["k1"], [memoryview(buffer)])    # [len(payload)], or e.g. [-704] (OBJECT_NOT_FOUND)
"""

from __future__ import annotations

import queue
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any

import numpy as np
import xxhash

from lmcache_r3.tiers.mooncake_config import MooncakeTierSettings
from lmcache_r3.tiers.shm_store import HEADER, decode_header, encode_header

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

_CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    -200: "NO_AVAILABLE_HANDLE (no space left in any segment)",
    -600: "INVALID_PARAMS",
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
    CANCELLED: "CANCELLED",
}
_BUFFER_ALIGN = 1 << 20


def describe(code: int) -> str:
    """A code's name, e.g. ``describe(-704) == "OBJECT_NOT_FOUND(-704)"``."""
    return f"{_CODE_NAMES.get(code, 'OK' if code >= 0 else 'MOONCAKE_ERROR')}({code})"


# -- threads and staging buffers ---------------------------------------------------------------------------------------
class _DaemonPool:
    """Threads for calls that may block in native code: daemons, so a stuck call never holds up the exit."""

    def __init__(self, size: int, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(size):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()
        self._size = size

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:
                    future.set_exception(err)

    def shutdown(self) -> None:
        for _ in range(self._size):
            self._jobs.put(None)


class _StagingBuffers:
    """Registered byte buffers, reused by size; keeps at most ``keep_bytes`` of idle ones."""

    def __init__(self, client: Any, keep_bytes: int) -> None:
        self._client = client
        self._keep_bytes = keep_bytes
        self._idle: list[np.ndarray] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> np.ndarray | None:
        with self._lock:
            fits = [i for i, buf in enumerate(self._idle) if buf.nbytes >= nbytes]
            if fits:
                return self._idle.pop(min(fits, key=lambda i: self._idle[i].nbytes))
        buf = np.empty(-(-max(nbytes, 1) // _BUFFER_ALIGN) * _BUFFER_ALIGN, dtype=np.uint8)
        return buf if self._client.register_buffer(buf.ctypes.data, buf.nbytes) == 0 else None

    def release(self, buf: np.ndarray) -> None:
        with self._lock:
            if sum(b.nbytes for b in self._idle) + buf.nbytes <= self._keep_bytes:
                self._idle.append(buf)
                return
        self._client.unregister_buffer(buf.ctypes.data)


# -- the store ---------------------------------------------------------------------------------------------------------
class MooncakeObjectStore:
    """Self-checking objects in Mooncake with bounded, batched calls (see the module). Thread-safe.

    Construction never blocks on the master: the client connects in the background once ``/health`` answers.
    """

    def __init__(self, settings: MooncakeTierSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._client: Any = None
        self._buffers: _StagingBuffers | None = None
        self._state = "connecting"
        self._reason = "waiting for the master's /health"
        self._down_until = 0.0
        self._last_fault = float("-inf")
        self._last_fault_reason = ""
        self._codes: Counter[int] = Counter()
        self._stats = dict.fromkeys(
            ("hits", "misses", "corrupt", "bytes_written", "bytes_read", "timeouts", "exceptions", "recoveries"), 0
        )
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never probe through a proxy
        self._io = _DaemonPool(settings.num_io_threads, "mooncake-io")
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch_master, name="mooncake-monitor", daemon=True)
        self._monitor.start()

    # -- batch calls ---------------------------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[int]:
        """Per key: 1 present, 0 absent, negative an error (only 1 means present)."""
        codes = self._call("exists", len(keys), lambda client: client.batch_is_exist(list(keys)))
        self._count(codes, absent=0)
        return codes

    def put(
        self, keys: Sequence[str], payloads: Sequence[memoryview], cancelled: Callable[[], bool] = lambda: False
    ) -> list[int]:
        """Store each payload under its key; per key 0 (stored, or already there) or a negative code.

        ``cancelled`` is asked before each payload is copied out of the caller's memory.
        """
        codes = [CANCELLED] * len(keys)
        for group, total in self._groups([HEADER.size + view.nbytes for view in payloads]):
            buf = self._acquire(total)
            if buf is None:
                for i in group:
                    codes[i] = UNAVAILABLE
                continue
            copied, ptrs, sizes, offset = [], [], [], 0
            for i in group:
                if cancelled():
                    break
                size = HEADER.size + payloads[i].nbytes
                view = memoryview(buf)[offset : offset + size]
                view[HEADER.size :] = payloads[i]
                view[: HEADER.size] = encode_header(payloads[i].nbytes, xxhash.xxh3_64_intdigest(view[HEADER.size :]))
                copied.append(i)
                ptrs.append(buf.ctypes.data + offset)
                sizes.append(size)
                offset += size
            batch = [keys[i] for i in copied]
            got = self._call("put", len(batch), partial(_write, keys=batch, ptrs=ptrs, sizes=sizes), buf)
            self._done_with(buf, got)
            for i, code, size in zip(copied, got, sizes, strict=True):
                codes[i] = OK if code in (OK, OBJECT_ALREADY_EXISTS) else code
                self._add("bytes_written", size if codes[i] == OK else 0)
        self._count(codes, absent=None)
        return codes

    def get_into(
        self, keys: Sequence[str], views: Sequence[memoryview], cancelled: Callable[[], bool] = lambda: False
    ) -> list[int]:
        """Read each object into its view, which must be exactly the payload's size.

        Per key the payload length when read, checked and copied; else a negative code. ``cancelled`` is asked
        before each copy into the caller's memory. Corrupt objects are removed.
        """
        codes = [CANCELLED] * len(keys)
        corrupt: list[str] = []
        for group, total in self._groups([HEADER.size + view.nbytes for view in views]):
            buf = self._acquire(total)
            if buf is None:
                for i in group:
                    codes[i] = UNAVAILABLE
                continue
            batch = [keys[i] for i in group]
            sizes = [HEADER.size + views[i].nbytes for i in group]
            offsets = [sum(sizes[:j]) for j in range(len(sizes))]
            got = self._call("get", len(group), partial(_read, keys=batch, buf=buf, offsets=offsets, sizes=sizes), buf)
            for i, code, offset, size in zip(group, got, offsets, sizes, strict=True):
                if code != size:
                    codes[i] = SIZE_MISMATCH if code >= 0 else code
                    continue
                payload = _open_object(memoryview(buf)[offset : offset + size])
                if payload is None:
                    codes[i] = CORRUPT
                    corrupt.append(keys[i])
                elif not cancelled():
                    views[i][:] = payload
                    codes[i] = payload.nbytes
                    self._add("bytes_read", size)
            self._done_with(buf, got)
        self._count(codes, absent=OBJECT_NOT_FOUND)
        if corrupt:
            self.remove(corrupt)
        return codes

    def remove(self, keys: Sequence[str]) -> list[int]:
        """Remove each key (forced past read leases); per key 0 or a negative code (-704: already gone)."""
        return self._call("remove", len(keys), lambda client: [client.remove(key, True) for key in keys])

    # -- state ---------------------------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``connecting``, ``up``, ``down`` or ``closed``."""
        return self._state

    def seconds_since_fault(self) -> float:
        """Seconds since the last timeout, exception or ``RPC_FAIL`` (infinite when none)."""
        return time.monotonic() - self._last_fault

    def stats(self) -> dict[str, Any]:
        with self._lock:
            stats = dict(self._stats)
            errors = {describe(code): n for code, n in sorted(self._codes.items()) if code != OBJECT_NOT_FOUND}
        stats.update(
            state=self._state,
            reason=self._reason,
            last_fault=self._last_fault_reason,
            errors=sum(errors.values()),
            errors_by_code=errors,
            master=self.settings.mooncake.master_server_address,
        )
        return stats

    def close(self) -> None:
        """Stop probing and close the client (bounded: a client stuck on a dead master is left to the exit)."""
        with self._lock:
            client, self._client, self._state = self._client, None, "closed"
        self._stop.set()
        if client is not None:
            try:
                self._io.submit(client.close).exception(timeout=self.settings.call_timeout_seconds)
            except FutureTimeout:
                pass
        self._io.shutdown()

    # -- internals -----------------------------------------------------------------------------------------------
    def _call(self, what: str, n: int, fn: Callable[[Any], Sequence[int]], buf: np.ndarray | None = None) -> list[int]:
        """``fn(client)`` on an io thread within the bound; its ``n`` codes, or ``n`` copies of a failure code.

        A late call keeps ``buf`` until it returns; the caller releases ``buf`` otherwise.
        """
        with self._lock:
            client = self._client if self._state == "up" else None
        if client is None or n == 0:
            return [UNAVAILABLE] * n
        future = self._io.submit(lambda: fn(client))
        try:
            codes = [int(code) for code in future.result(timeout=self.settings.call_timeout_seconds)]
        except FutureTimeout:
            if buf is not None:
                future.add_done_callback(lambda _: self._release(buf))
            self._fault("timeouts", f"{what} of {n} keys took over {self.settings.call_timeout_seconds} s", down=True)
            return [TIMEOUT] * n
        except Exception as err:
            self._fault("exceptions", f"{what} of {n} keys raised {err!r}", down=False)
            return [EXCEPTION] * n
        if len(codes) != n:
            self._fault("exceptions", f"{what} answered {len(codes)} codes for {n} keys", down=False)
            return [EXCEPTION] * n
        if RPC_FAIL in codes:
            self._fault(None, f"{what} got RPC_FAIL from the master", down=True)
        return codes

    def _groups(self, sizes: list[int]) -> list[tuple[list[int], int]]:
        """Consecutive index groups whose sizes sum to at most ``batch_bytes`` (an oversized one stands alone)."""
        groups: list[tuple[list[int], int]] = []
        members: list[int] = []
        total = 0
        for i, size in enumerate(sizes):
            if members and total + size > self.settings.batch_bytes:
                groups.append((members, total))
                members, total = [], 0
            members.append(i)
            total += size
        if members:
            groups.append((members, total))
        return groups

    def _acquire(self, nbytes: int) -> np.ndarray | None:
        buffers = self._buffers
        if buffers is None or self._state != "up":
            return None
        try:
            return buffers.acquire(nbytes)
        except Exception as err:
            self._fault("exceptions", f"registering a {nbytes}-byte staging buffer raised {err!r}", down=False)
            return None

    def _done_with(self, buf: np.ndarray, codes: list[int]) -> None:
        """Give ``buf`` back, unless its call is late (then the call gives it back when it returns)."""
        if not codes or codes[0] != TIMEOUT:
            self._release(buf)

    def _release(self, buf: np.ndarray) -> None:
        buffers = self._buffers
        if buffers is not None:
            try:
                buffers.release(buf)
            except Exception:
                pass  # the buffer is garbage-collected; unregistering is best effort

    def _fault(self, counter: str | None, reason: str, down: bool) -> None:
        with self._lock:
            self._last_fault = time.monotonic()
            self._last_fault_reason = reason
            if counter:
                self._stats[counter] += 1
            if down and self._state == "up":
                self._state, self._reason = "down", reason
                self._down_until = time.monotonic() + self.settings.retry_after_seconds

    def _count(self, codes: list[int], absent: int | None) -> None:
        """Count per-key outcomes: ``absent`` is a miss, other negative codes are errors, reads >= 0 are hits."""
        with self._lock:
            for code in codes:
                if code == absent:
                    self._stats["misses"] += 1
                elif code < 0:
                    self._codes[code] += 1
                    self._stats["corrupt"] += code == CORRUPT
                elif absent == OBJECT_NOT_FOUND:
                    self._stats["hits"] += 1

    def _add(self, name: str, n: int) -> None:
        with self._lock:
            self._stats[name] += n

    def _healthy(self) -> bool:
        try:
            with self._opener.open(self.settings.health_url, timeout=1.0) as response:
                return response.status == 200
        except Exception:
            return False

    def _watch_master(self) -> None:
        while not self._stop.is_set():
            healthy = self._healthy()
            with self._lock:
                if self._state == "closed":
                    return
                if not healthy and self._state == "up":
                    self._state, self._reason = "down", f"the master's {self.settings.health_url} does not answer"
                    self._down_until = time.monotonic() + self.settings.retry_after_seconds
                elif healthy and self._state == "down" and time.monotonic() >= self._down_until:
                    self._state, self._reason = "up", ""
                    self._stats["recoveries"] += 1
                connect = healthy and self._client is None
            if connect:
                self._connect()
            self._stop.wait(self.settings.probe_interval_seconds)

    def _connect(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        c = self.settings.mooncake
        client = MooncakeDistributedStore()
        code = client.setup(
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
        with self._lock:
            if code == 0 and self._state != "closed":
                self._client, self._state, self._reason = client, "up", ""
                self._buffers = _StagingBuffers(client, keep_bytes=2 * self.settings.batch_bytes)
                return
            self._reason = f"setup against {c.master_server_address} returned {code}" if code else self._reason
        client.close()


def _write(client: Any, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
    return client.batch_put_from(keys, ptrs, sizes) if keys else []


def _read(client: Any, keys: list[str], buf: np.ndarray, offsets: list[int], sizes: list[int]) -> list[int]:
    """``get_size`` each key, then ``batch_get_into`` those of the expected size; per key bytes read or a code."""
    codes = [int(client.get_size(key)) for key in keys]
    wanted = [i for i, (code, size) in enumerate(zip(codes, sizes, strict=True)) if code == size]
    for i, code in enumerate(codes):
        if code >= 0 and code != sizes[i]:
            codes[i] = SIZE_MISMATCH
    if wanted:
        read = client.batch_get_into(
            [keys[i] for i in wanted], [buf.ctypes.data + offsets[i] for i in wanted], [sizes[i] for i in wanted]
        )
        for i, code in zip(wanted, read, strict=True):
            codes[i] = int(code)
    return codes


def _open_object(data: memoryview) -> memoryview | None:
    """The payload of a stored object, or None when its header or checksum does not match."""
    header = decode_header(bytes(data[: HEADER.size]))
    if header is None or header[0] != data.nbytes - HEADER.size:
        return None
    payload = data[HEADER.size :]
    return payload if xxhash.xxh3_64_intdigest(payload) == header[1] else None
