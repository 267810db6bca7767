"""Self-checking objects in a Mooncake distributed store, in batches, with one explicit code per key.

An *object* is an opaque payload stored under a string key in Mooncake (``mooncake_master`` plus the processes that
mount memory segments). :class:`MooncakeObjectStore` answers every batch call with one integer code per key, never
with an ambiguous empty value, and never raises for a tier failure:

* ``exists`` -> 1 present, 0 absent, negative an error (only 1 means present);
* ``put`` -> 0 stored (also when the key was already there: Mooncake keeps the first writer's value);
* ``get_into`` -> the payload length when the object was read, checked and copied, else a negative code;
* ``remove`` -> 0 removed, negative otherwise.

Negative codes are Mooncake's (``OBJECT_NOT_FOUND`` -704, ``RPC_FAIL`` -900, ...) or those of
:mod:`lmcache_r3.tiers.mooncake_client` (``UNAVAILABLE``, ``TIMEOUT``, ``EXCEPTION``, ``CORRUPT``, ``SIZE_MISMATCH``,
``CANCELLED``); ``describe`` names them. Calls are bounded and the master may come and go: see that module.

An object is the 32-byte header of :mod:`lmcache_r3.tiers.shm_store` (magic, version, payload length, XXH3-64 of the
payload, XXH3-64 of the header) followed by the payload. A read has ``batch_get_into`` put each object into a
slot of a registered staging buffer exactly the size it expects (a smaller object reads short and a bigger one is
refused: either is ``SIZE_MISMATCH``, never data), then checks header and checksum before the payload reaches the
caller; a corrupt object is counted as ``CORRUPT`` and removed. A write copies header and payload into a staging
buffer and hands it to ``batch_put_from``. Batches are split so one call stages at most ``batch_bytes`` (a bigger
object goes alone, in a buffer of its size), and pipelined: while a call transfers, the batch before it is checked
and copied out (read) or the batch after it is staged (write). Objects of any size round-trip, whatever
the client's ``local_buffer_size`` (which only Mooncake's ``put``/``get`` use, and this store never calls them).

Example::

    store = MooncakeObjectStore(settings_from_params({"mooncake": {...}, "master_metrics_port": 9003}))
    store.put(["k1"], [memoryview(payload)])        # [0]
    store.get_into(["k1"], [memoryview(buffer)])    # [len(payload)], or e.g. [-704] (OBJECT_NOT_FOUND)
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import xxhash

from lmcache_r3.tiers.mooncake_client import (
    CANCELLED,
    CORRUPT,
    INVALID_PARAMS,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    OK,
    SIZE_MISMATCH,
    UNAVAILABLE,
    BoundedMooncakeClient,
    PendingCall,
    describe,
)
from lmcache_r3.tiers.mooncake_config import MooncakeTierSettings
from lmcache_r3.tiers.shm_store import HEADER, decode_header, encode_header


def _never() -> bool:
    return False


class MooncakeObjectStore:
    """Self-checking objects in Mooncake, in bounded batches (see the module). Thread-safe; never blocks on start."""

    def __init__(self, settings: MooncakeTierSettings) -> None:
        self.settings = settings
        self._client = BoundedMooncakeClient(settings)
        self._lock = threading.Lock()
        self._codes: Counter[int] = Counter()
        self._stats = dict.fromkeys(("hits", "misses", "corrupt", "bytes_written", "bytes_read"), 0)

    def exists(self, keys: Sequence[str]) -> list[int]:
        """Per key: 1 present, 0 absent, negative an error."""
        codes = self._client.call("exists", len(keys), partial(_exists, keys=list(keys)))
        self._count(codes, absent=0)
        return codes

    def put(self, keys: Sequence[str], payloads: Sequence[memoryview], cancelled: Callable[[], bool] = _never):
        """Store each payload under its key; per key 0 (stored, or already there) or a negative code.

        ``cancelled`` is asked before each payload is copied out of the caller's memory. Batches are pipelined: the
        next batch is staged while the previous ones transfer.
        """
        codes = [CANCELLED] * len(keys)
        in_flight: deque[tuple[PendingCall, np.ndarray, list[int], list[int]]] = deque()
        for group, total in batch_groups(self.settings.batch_bytes, [HEADER.size + view.nbytes for view in payloads]):
            if len(in_flight) >= self._client.max_in_flight:
                self._put_done(*in_flight.popleft(), codes)
            buf = self._client.acquire(total)
            if buf is None:
                codes[group[0] : group[-1] + 1] = [UNAVAILABLE] * len(group)
                continue
            copied, ptrs, sizes, offset = [], [], [], 0
            for i in group:
                if cancelled():
                    break
                size = HEADER.size + payloads[i].nbytes
                seal_object(memoryview(buf)[offset : offset + size], payloads[i])
                copied.append(i)
                ptrs.append(buf.ctypes.data + offset)
                sizes.append(size)
                offset += size
            batch = [keys[i] for i in copied]
            write = partial(_write, keys=batch, ptrs=ptrs, sizes=sizes)
            in_flight.append((self._client.submit("put", len(batch), write, buf), buf, copied, sizes))
            if len(copied) < len(group):
                break
        while in_flight:
            self._put_done(*in_flight.popleft(), codes)
        self._count(codes, absent=None)
        return codes

    def _put_done(
        self, pending: PendingCall, buf: np.ndarray, copied: list[int], sizes: list[int], codes: list[int]
    ) -> None:
        got = self._client.wait(pending)
        self._client.done_with(buf, got)
        for i, code, size in zip(copied, got, sizes, strict=True):
            codes[i] = OK if code in (OK, OBJECT_ALREADY_EXISTS) else code
            self._add("bytes_written", size if codes[i] == OK else 0)

    def get_into(self, keys: Sequence[str], views: Sequence[memoryview], cancelled: Callable[[], bool] = _never):
        """Read each object into its view, which must be exactly the payload's size.

        Per key the payload length when read, checked and copied; else a negative code. ``cancelled`` is asked
        before each batch is requested and before each copy into the caller's memory. Corrupt objects are removed.
        Batches are pipelined: one batch is checked and copied while the next ones transfer.
        """
        codes = [CANCELLED] * len(keys)
        corrupt: list[str] = []
        in_flight: deque[tuple[PendingCall, np.ndarray, list[int], list[int], list[int]]] = deque()
        for group, total in batch_groups(self.settings.batch_bytes, [HEADER.size + view.nbytes for view in views]):
            if len(in_flight) >= self._client.max_in_flight:
                self._get_done(*in_flight.popleft(), keys, views, codes, corrupt, cancelled)
            if cancelled():
                break
            buf = self._client.acquire(total)
            if buf is None:
                codes[group[0] : group[-1] + 1] = [UNAVAILABLE] * len(group)
                continue
            sizes = [HEADER.size + views[i].nbytes for i in group]
            offsets = [sum(sizes[:j]) for j in range(len(sizes))]
            read = partial(_read, keys=[keys[i] for i in group], buf=buf, offsets=offsets, sizes=sizes)
            in_flight.append((self._client.submit("get", len(group), read, buf), buf, group, offsets, sizes))
        while in_flight:
            self._get_done(*in_flight.popleft(), keys, views, codes, corrupt, cancelled)
        self._count(codes, absent=OBJECT_NOT_FOUND)
        if corrupt:
            self.remove(corrupt)
        return codes

    def _get_done(
        self,
        pending: PendingCall,
        buf: np.ndarray,
        group: list[int],
        offsets: list[int],
        sizes: list[int],
        keys: Sequence[str],
        views: Sequence[memoryview],
        codes: list[int],
        corrupt: list[str],
        cancelled: Callable[[], bool],
    ) -> None:
        """Check the objects one read staged and copy the intact ones into the caller's views."""
        got = self._client.wait(pending)
        for i, code, offset, size in zip(group, got, offsets, sizes, strict=True):
            if code != size:
                # the buffer had exactly the expected size: a smaller object reads short, a bigger one is refused
                codes[i] = SIZE_MISMATCH if code >= 0 or code == INVALID_PARAMS else code
                continue
            payload = open_object(memoryview(buf)[offset : offset + size])
            if payload is None:
                codes[i] = CORRUPT
                corrupt.append(keys[i])
            elif not cancelled():
                _copy(views[i], payload)
                codes[i] = payload.nbytes
                self._add("bytes_read", size)
        self._client.done_with(buf, got)

    def remove(self, keys: Sequence[str]) -> list[int]:
        """Remove each key (forced past read leases); per key 0 or a negative code (-704: already gone)."""
        return self._client.call("remove", len(keys), partial(_remove, keys=list(keys)))

    @property
    def state(self) -> str:
        """``connecting``, ``up``, ``down`` or ``closed`` (see :mod:`lmcache_r3.tiers.mooncake_client`)."""
        return self._client.state

    def seconds_since_fault(self) -> float:
        """Seconds since the last call timed out, raised or met ``RPC_FAIL`` (infinite when none)."""
        return self._client.seconds_since_fault()

    def stats(self) -> dict[str, Any]:
        """Counters (hits, misses, corrupt, bytes, errors by code) and the client's state, reason and faults."""
        with self._lock:
            stats = dict(self._stats)
            errors = {describe(code): n for code, n in sorted(self._codes.items())}
        stats.update(self._client.stats(), errors=sum(errors.values()), errors_by_code=errors)
        return stats

    def close(self) -> None:
        self._client.close()

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


def batch_groups(limit: int, sizes: Sequence[int]) -> list[tuple[list[int], int]]:
    """Consecutive index groups with their total size, each at most ``limit`` unless one item alone exceeds it.

    E.g. ``batch_groups(10, [4, 4, 4, 20, 1]) == [([0, 1], 8), ([2], 4), ([3], 20), ([4], 1)]``.
    """
    groups: list[tuple[list[int], int]] = []
    members: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if members and total + size > limit:
            groups.append((members, total))
            members, total = [], 0
        members.append(i)
        total += size
    if members:
        groups.append((members, total))
    return groups


def seal_object(into: memoryview, payload: memoryview) -> None:
    """Write header + ``payload`` into ``into`` (exactly ``HEADER.size + payload.nbytes`` bytes)."""
    stored = into[HEADER.size :]
    _copy(stored, payload)
    into[: HEADER.size] = encode_header(payload.nbytes, xxhash.xxh3_64_intdigest(stored))


def _copy(into: memoryview, data: memoryview) -> None:
    """``into[:] = data`` for equally long byte views, without holding the GIL for big ones."""
    if data.nbytes < 1 << 16:
        into[:] = data
    else:
        np.copyto(np.frombuffer(into, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8))


def open_object(data: memoryview) -> memoryview | None:
    """The payload of a stored object (header + payload), or None when its header or checksum does not match."""
    header = decode_header(bytes(data[: HEADER.size]))
    if header is None or header[0] != data.nbytes - HEADER.size:
        return None
    payload = data[HEADER.size :]
    return payload if xxhash.xxh3_64_intdigest(payload) == header[1] else None


# -- what runs on the io threads (bound by partial: an abandoned call must not see the caller's next values) --------
def _exists(native: Any, keys: list[str]) -> list[int]:
    return native.batch_is_exist(keys)


def _remove(native: Any, keys: list[str]) -> list[int]:
    return [native.remove(key, True) for key in keys]


def _write(native: Any, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
    return native.batch_put_from(keys, ptrs, sizes) if keys else []


def _read(native: Any, keys: list[str], buf: np.ndarray, offsets: list[int], sizes: list[int]) -> list[int]:
    """``batch_get_into`` each key into a slot of exactly its expected size; per key bytes read or a code."""
    return native.batch_get_into(keys, [buf.ctypes.data + offset for offset in offsets], sizes)
