"""Self-checking objects in a Mooncake distributed store, in batches, with one explicit code per key.

An *object* is an opaque payload stored under a string key in Mooncake (``mooncake_master`` plus the processes that
mount memory segments). :class:`MooncakeObjectStore` answers every batch call with one integer code per key, never
with an ambiguous empty value, and never raises for a tier failure:

* ``exists`` -> 1 present, 0 absent, negative an error (only 1 means present);
* ``put`` -> 0 stored (also when the key was already there: Mooncake keeps the first writer's value);
* ``get_into`` -> the payload length when the object was read and checked into the caller's view, else a negative
  code;
* ``remove`` -> 0 removed, negative otherwise.

Negative codes are Mooncake's (``OBJECT_NOT_FOUND`` -704, ``RPC_FAIL`` -900, ...) or those of
:mod:`lmcache_r3.tiers.mooncake_client` (``UNAVAILABLE``, ``TIMEOUT``, ``EXCEPTION``, ``CORRUPT``, ``SIZE_MISMATCH``,
``CANCELLED``); ``describe`` names them. Every call is bounded and the master may come and go: see that module.

An object is the 32-byte header of :mod:`lmcache_r3.tiers.shm_store` (magic, version, payload length, XXH3-64 of the
payload seeded with the object's key, XXH3-64 of the header) followed by the payload; the seed makes a read that
finds another key's object of the same size (Mooncake reused its memory while the read ran) fail its check. Each
object moves one of two ways:

* *Staged* (objects under ``zero_copy_min_bytes``, or outside the registered region, or when none is registered).
  A write copies header and payload into a registered staging buffer and hands it to ``batch_put_from``. A read has
  ``batch_get_into`` put the object into a staging slot exactly the size it expects (a smaller object reads short
  and a bigger one is refused: either is ``SIZE_MISMATCH``, never data), checks header and checksum there, and only
  then copies the payload into the caller's view.
* *Direct* (objects of at least ``zero_copy_min_bytes`` whose memory lies in the region given to
  :meth:`MooncakeObjectStore.register_region`, LMCache's L1 arena): the payload moves straight between that memory
  and Mooncake, the header through a 32-byte staging slot. A write hashes the payload where it lies and puts the two
  parts with ``batch_put_from_multi_buffers``. Reads move direct with ``direct_reads`` (the default; a staged read
  of a directly written object is an ordinary read). A direct read is two calls: a
  *query* (``batch_get_session_start`` and the stored sizes from ``batch_get_replica_desc``: the only part that
  talks to the master), then, for the objects of exactly the expected size and only if the caller has not given
  up, a *transfer* in that session
  (``batch_get_into_multi_buffer_ranges``: header into staging, payload into the caller's memory; the master is not
  asked again). The checksum is checked on the caller's memory; a mismatch is ``CORRUPT``, and the caller must not
  use that memory (LMCache never uses the buffer of a failed load). Because a stalled master holds up only the
  query, and the transfer is never abandoned at ``call_timeout_seconds`` (it is waited for up to
  ``direct_read_max_seconds``; Mooncake's TCP transport fails a transfer that received nothing for
  ``MC_TCP_PROGRESS_TIMEOUT_SEC`` and writes nothing after that), a read does not write into the caller's memory
  after it returned. A transfer that outlives ``direct_read_max_seconds`` is abandoned and turns direct reads
  off. A write abandoned mid-call may read the caller's memory after the caller reused it: such an object carries
  the checksum of the bytes it was meant to hold, fails every read, and is removed.

Why both: a copy costs ~1.3 ms per 24 MiB KV object here and dominates its move, while for a 96 KiB R3 object one
transfer slice is cheaper than two (header and payload) and its copy costs a few microseconds.

A corrupt object is counted as ``CORRUPT`` and removed. So is an object a put stored after it was abandoned at its
bound (the call returned after all): the caller was told it was not stored, and a clear may have come in between;
:meth:`MooncakeObjectStore.remove_late` removes such objects (the adapter calls it on its maintenance thread).

Batches are split so one call moves at most ``batch_max_objects`` objects (Mooncake fails every transfer of a
client with more than ~2048 parts in flight) and at most ``batch_bytes`` (a bigger object goes alone; direct writes
``DIRECT_PUT_SHARE`` times that, one call at a time), and pipelined: while a call transfers, the batch before it is
checked and copied out (read) or the batch after it is staged or hashed (write). Objects of any size round-trip,
whatever the client's ``local_buffer_size`` (which only Mooncake's ``put``/``get`` use, and this store never calls
them).

Example::

    store = MooncakeObjectStore(settings_from_params({"mooncake": {...}, "master_metrics_port": 9003}))
    store.register_region(l1.ptr, l1.size)          # optional: objects in L1 then move unstaged
    store.put(["k1"], [memoryview(payload)])        # [0]
    store.get_into(["k1"], [memoryview(buffer)])    # [len(payload)], or e.g. [-704] (OBJECT_NOT_FOUND)
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import xxhash
from lmcache.logging import init_logger

from lmcache_r3.tiers.holds import UNHELD, CallerBuffers
from lmcache_r3.tiers.mooncake_client import (
    CANCELLED,
    CORRUPT,
    INVALID_PARAMS,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    OK,
    SIZE_MISMATCH,
    TIMEOUT,
    UNAVAILABLE,
    BoundedMooncakeClient,
    PendingCall,
    describe,
)
from lmcache_r3.tiers.mooncake_config import MooncakeTierSettings
from lmcache_r3.tiers.shm_store import HEADER, decode_header, encode_header, key_seed

logger = init_logger(__name__)

DIRECT_PUT_SHARE = 4
"""A direct write moves up to this many ``batch_bytes`` a call, one call at a time: it has nothing to stage while a
call runs, and concurrent writes over loopback slow each other down (two 48 MiB calls at once took longer than one
96 MiB call)."""


@dataclass
class _Call:
    """One call's share of a batch: the caller's indices it covers and where each object's bytes go."""

    group: list[int]
    """Indices into the caller's keys."""
    buf: np.ndarray
    """The staging buffer: each member's slot holds header + payload when staged, the header alone when direct."""
    offsets: list[int]
    """Each member's slot in ``buf``."""
    addresses: list[int | None]
    """Each member's payload address in the caller's memory when it moves direct, else None."""
    moved: list[int] = field(default_factory=list)
    """Positions in ``group`` the call moves (a direct read skips objects the query found missing or resized)."""
    holding: bool = False
    """Whether the call holds the caller's buffers (see :mod:`lmcache_r3.tiers.holds`) until it is done."""
    pending: PendingCall | None = None
    keys: list[str] = field(default_factory=list)
    """The keys of ``group``, as the call sent them."""


class MooncakeObjectStore:
    """Self-checking objects in Mooncake, in bounded batches (see the module). Thread-safe; never blocks on start."""

    def __init__(self, settings: MooncakeTierSettings) -> None:
        self.settings = settings
        self._client = BoundedMooncakeClient(settings)
        self._lock = threading.Lock()
        self._codes: Counter[int] = Counter()
        self._direct_reads_off = False
        self._stats = dict.fromkeys(
            ("hits", "misses", "corrupt", "bytes_written", "bytes_read", "direct_written", "direct_read")
            + ("late_puts", "late_puts_removed"),
            0,
        )
        self._late: list[str] = []
        """Keys a put abandoned at its bound stored when it returned after all, to remove (:meth:`remove_late`)."""

    @property
    def direct_reads(self) -> bool:
        """Whether reads of objects in the region move direct (configured, and no transfer outlived its bound)."""
        return self.settings.direct_reads and not self._direct_reads_off

    @property
    def region(self) -> tuple[int, int] | None:
        """``(ptr, size)`` of the registered L1 region, or None (not given, not yet registered, or refused)."""
        return self._client.region

    def register_region(self, ptr: int, size: int) -> None:
        """Let objects of at least ``zero_copy_min_bytes`` in ``[ptr, ptr + size)`` move direct (see the module).

        Registered with the Mooncake client once it is set up; until then, or if that fails, objects are staged.
        """
        self._client.register_region(ptr, size)

    def exists(self, keys: Sequence[str]) -> list[int]:
        """Per key: 1 present, 0 absent, negative an error."""
        codes = self._client.call("exists", len(keys), partial(_exists, keys=list(keys)))
        self._count(codes, absent=0)
        return codes

    def exists_then(self, keys: Sequence[str], done: Callable[[list[int]], None]) -> None:
        """:meth:`exists` answering ``done(codes)`` once, on the client's threads, instead of returning."""
        pending = self._client.submit("exists", len(keys), partial(_exists, keys=list(keys)))
        self._client.then(pending, lambda codes: self._answer(done, codes, absent=0))

    def put(self, keys: Sequence[str], payloads: Sequence[memoryview], buffers: CallerBuffers = UNHELD):
        """Store each payload under its key; per key 0 (stored, or already there) or a negative code.

        Each batch's payloads are hashed and staged under a hold of ``buffers``, kept until the call returns when
        it reads any of them direct; a refused hold ends the put (the rest ``CANCELLED``). Batches are pipelined:
        the next batch is staged while the previous ones transfer.
        """
        codes = [CANCELLED] * len(keys)
        addresses = self._direct_addresses(payloads)
        in_flight: deque[_Call] = deque()
        for group, _ in self._put_groups(payloads, addresses):
            direct = any(addresses[i] for i in group)
            while in_flight and (direct or len(in_flight) >= self._client.max_in_flight):
                self._put_done(in_flight.popleft(), payloads, codes, buffers)
            call, refused = self._start_put(group, keys, payloads, addresses, codes, buffers)
            if refused:
                break
            if call is not None:
                in_flight.append(call)
        while in_flight:
            self._put_done(in_flight.popleft(), payloads, codes, buffers)
        self._count(codes, absent=None)
        return codes

    def put_then(
        self,
        keys: Sequence[str],
        payloads: Sequence[memoryview],
        buffers: CallerBuffers,
        done: Callable[[list[int]], None],
    ) -> bool:
        """:meth:`put` answering ``done(codes)`` instead of returning, when the put is one staged call of at most
        ``inline_max_bytes``: it is staged now, on this thread, and ``done`` runs once, when the call returned or
        its bound passed (on the client's threads, see ``BoundedMooncakeClient.then``; at once when nothing could be
        started). False, and nothing done, for any other put: use :meth:`put`."""
        addresses = self._direct_addresses(payloads)
        groups = self._put_groups(payloads, addresses)
        if any(addresses) or len(groups) > 1 or sum(total for _, total in groups) > self.settings.inline_max_bytes:
            return False
        codes = [CANCELLED] * len(keys)
        call, _ = self._start_put(groups[0][0], keys, payloads, addresses, codes, buffers) if groups else (None, False)
        if call is None:
            self._answer(done, codes, absent=None)
            return True

        def answered(got: list[int]) -> None:
            try:
                self._put_answered(call, got, payloads, codes)
            finally:
                self._answer(done, codes, absent=None)

        self._client.then(call.pending, answered)
        return True

    def _put_groups(self, payloads: Sequence[memoryview], addresses: list[int | None]) -> list[tuple[list[int], int]]:
        """The put's calls: index groups of at most ``batch_max_objects`` and ``batch_bytes`` staged (a direct
        object weighs a ``DIRECT_PUT_SHARE`` of its bytes), each with its weight."""
        weights = [
            (HEADER.size + view.nbytes) // (1 if address is None else DIRECT_PUT_SHARE)
            for view, address in zip(payloads, addresses, strict=True)
        ]
        return batch_groups(self.settings.batch_bytes, weights, self.settings.batch_max_objects)

    def _start_put(
        self,
        group: list[int],
        keys: Sequence[str],
        payloads: Sequence[memoryview],
        addresses: list[int | None],
        codes: list[int],
        buffers: CallerBuffers,
    ) -> tuple[_Call | None, bool]:
        """Stage ``group`` and submit its write: ``(call, False)``; ``(None, False)`` when the client is not up (its
        codes ``UNAVAILABLE``); ``(None, True)`` when the hold on ``buffers`` was refused (the put ends)."""
        direct = any(addresses[i] for i in group)
        slots = [HEADER.size + (0 if addresses[i] else payloads[i].nbytes) for i in group]
        buf = self._client.acquire(sum(slots))
        if buf is None:
            codes[group[0] : group[-1] + 1] = [UNAVAILABLE] * len(group)
            return None, False
        if not buffers.hold():
            self._client.done_with(buf, [])
            return None, True
        call = _Call([], buf, [], [], holding=direct)
        try:
            ptrs, sizes = self._stage(call, group, slots, keys, payloads, addresses)
        except BaseException:
            buffers.release()
            self._client.done_with(buf, [])
            raise
        if not direct:  # staged: the caller's memory is not read again
            buffers.release()
        batch = call.keys = [keys[i] for i in call.group]
        if direct:
            write = partial(_write_parts, keys=batch, ptrs=ptrs, sizes=sizes)
        else:
            write = partial(_write, keys=batch, ptrs=[p[0] for p in ptrs], sizes=[s[0] for s in sizes])
        call.pending = self._client.submit("put", len(batch), write, buf)
        return call, False

    @staticmethod
    def _stage(
        call: _Call,
        group: list[int],
        slots: list[int],
        keys: Sequence[str],
        payloads: Sequence[memoryview],
        addresses: list[int | None],
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Seal each staged payload into its slot of ``call.buf`` and the header of each direct one; the parts'
        pointers and sizes."""
        staging, base, offset = memoryview(call.buf), call.buf.ctypes.data, 0
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        for i, slot in zip(group, slots, strict=True):
            payload, address = payloads[i], addresses[i]
            if address is None:
                seal_object(staging[offset : offset + slot], payload, keys[i])
                ptrs.append([base + offset])
                sizes.append([slot])
            else:
                digest = xxhash.xxh3_64_intdigest(payload, object_seed(keys[i]))
                staging[offset : offset + HEADER.size] = encode_header(payload.nbytes, digest)
                ptrs.append([base + offset, address])
                sizes.append([HEADER.size, payload.nbytes])
            call.group.append(i)
            call.offsets.append(offset)
            call.addresses.append(address)
            offset += slot
        return ptrs, sizes

    def _put_done(self, call: _Call, payloads: Sequence[memoryview], codes: list[int], buffers: CallerBuffers) -> None:
        got = self._client.wait(call.pending)
        if call.holding:  # a direct write read the caller's memory until now (an abandoned one stores a checksum
            buffers.release()  # of the bytes it was given, so a later change of them fails every read)
        self._put_answered(call, got, payloads, codes)

    def _put_answered(self, call: _Call, got: list[int], payloads: Sequence[memoryview], codes: list[int]) -> None:
        """Take a returned write's codes (and its staging buffer back)."""
        self._client.done_with(call.buf, got)
        if TIMEOUT in got and call.pending is not None and call.pending.future is not None:
            call.pending.future.add_done_callback(partial(self._landed_late, call.keys))
        for i, code, address in zip(call.group, got, call.addresses, strict=True):
            codes[i] = OK if code in (OK, OBJECT_ALREADY_EXISTS) else code
            self._add("bytes_written", HEADER.size + payloads[i].nbytes if codes[i] == OK else 0)
            self._add("direct_written", int(codes[i] == OK and address is not None))

    def get_into(self, keys: Sequence[str], views: Sequence[memoryview], buffers: CallerBuffers = UNHELD):
        """Read each object into its view, which must be exactly the payload's size.

        Per key the payload length when read and checked; else a negative code, and then the view holds no data
        the caller may use (a direct read may have written into it). The views are written and checksummed only
        under a hold of ``buffers``: a direct transfer holds from its start until it was checked, a staged batch
        while it is checked and copied out; a refused hold ends the read (the rest ``CANCELLED``). Corrupt objects
        are removed. Batches are pipelined: one batch is checked while the next ones transfer.
        """
        codes = [CANCELLED] * len(keys)
        corrupt: list[str] = []
        addresses = self._direct_addresses(views) if self.direct_reads else [None] * len(views)
        in_flight: deque[_Call] = deque()
        sizes = [HEADER.size + view.nbytes for view in views]
        for group, _ in batch_groups(self.settings.batch_bytes, sizes, self.settings.batch_max_objects):
            if len(in_flight) >= self._client.max_in_flight:
                self._get_done(in_flight.popleft(), keys, views, codes, corrupt, buffers)
            if buffers.cancelled():
                break
            slots = [HEADER.size + (0 if addresses[i] else views[i].nbytes) for i in group]
            buf = self._client.acquire(sum(slots))
            if buf is None:
                codes[group[0] : group[-1] + 1] = [UNAVAILABLE] * len(group)
                continue
            offsets = list(itertools.accumulate(slots[:-1], initial=0))
            call = _Call(group, buf, offsets, [addresses[i] for i in group])
            names = [keys[i] for i in group]
            if any(call.addresses):
                call.pending = self._start_direct_read(call, names, views, codes, buffers)
                if call.pending is None:
                    self._client.done_with(buf, [])
                    continue
            else:
                self._start_staged_read(call, names, slots)
            in_flight.append(call)
        while in_flight:
            self._get_done(in_flight.popleft(), keys, views, codes, corrupt, buffers)
        self._count(codes, absent=OBJECT_NOT_FOUND)
        if corrupt:
            self.remove(corrupt)
        return codes

    def get_then(
        self,
        keys: Sequence[str],
        views: Sequence[memoryview],
        buffers: CallerBuffers,
        done: Callable[[list[int]], None],
    ) -> bool:
        """:meth:`get_into` answering ``done(codes)`` instead of returning, when the read is one staged call of at
        most ``inline_max_bytes``: it is submitted now, and checked and copied into the views, under a hold of
        ``buffers``, when the call returns; ``done`` runs once after that (after corrupt objects were removed), on
        the client's threads (see ``BoundedMooncakeClient.then``; at once when nothing could be started). False,
        and nothing done, for any other read: use :meth:`get_into`."""
        sizes = [HEADER.size + view.nbytes for view in views]
        groups = batch_groups(self.settings.batch_bytes, sizes, self.settings.batch_max_objects)
        direct = self.direct_reads and any(self._direct_addresses(views))
        if direct or len(groups) > 1 or sum(sizes) > self.settings.inline_max_bytes:
            return False
        codes = [CANCELLED] * len(keys)
        buf = None if not keys or buffers.cancelled() else self._client.acquire(sum(sizes))
        if buf is None:
            if codes and not buffers.cancelled():
                codes = [UNAVAILABLE] * len(keys)
            self._answer(done, codes, absent=OBJECT_NOT_FOUND)
            return True
        call = _Call(list(range(len(keys))), buf, list(itertools.accumulate(sizes[:-1], initial=0)), [None] * len(keys))
        self._start_staged_read(call, list(keys), sizes)
        corrupt: list[str] = []

        def answered(got: list[int]) -> None:
            try:
                self._got(call, got, keys, views, codes, corrupt, buffers)
            finally:
                if corrupt:  # answered once they are gone, as get_into returns
                    removal = self._client.submit("remove", len(corrupt), partial(_remove, keys=corrupt))
                    self._client.then(removal, lambda _: self._answer(done, codes, absent=OBJECT_NOT_FOUND))
                else:
                    self._answer(done, codes, absent=OBJECT_NOT_FOUND)

        self._client.then(call.pending, answered)
        return True

    def _start_staged_read(self, call: _Call, names: list[str], slots: list[int]) -> None:
        """Submit the read of every member of ``call`` into its staging slot."""
        call.moved = list(range(len(call.group)))
        read = partial(_read, keys=names, buf=call.buf, offsets=call.offsets, sizes=slots)
        call.pending = self._client.submit("get", len(call.group), read, call.buf)

    def _answer(self, done: Callable[[list[int]], None], codes: list[int], absent: int | None) -> None:
        """Count a put's or a read's codes, then hand them to ``done``."""
        try:
            self._count(codes, absent=absent)
        finally:
            done(codes)

    def _start_direct_read(
        self,
        call: _Call,
        names: list[str],
        views: Sequence[memoryview],
        codes: list[int],
        buffers: CallerBuffers,
    ) -> PendingCall | None:
        """Query ``names`` (the master's part), then start the transfer of those of exactly the expected size, under
        a hold of ``buffers`` that :meth:`_get_done` releases.

        Sets the codes of the others; None when nothing is transferred.
        """
        query = self._client.submit("query", len(names), partial(_query, keys=names))
        stored = self._client.wait(query)
        if stored and stored[0] == TIMEOUT:  # the session it may still open must be closed when it returns
            self._client.when_done(query, "end session", partial(_end_session, keys=names))
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        src_offsets: list[list[int]] = []
        base = call.buf.ctypes.data
        for j, (i, size) in enumerate(zip(call.group, stored, strict=True)):
            expected = HEADER.size + views[i].nbytes
            if size != expected:
                codes[i] = SIZE_MISMATCH if size >= 0 else size
                continue
            call.moved.append(j)
            slot, address = base + call.offsets[j], call.addresses[j]
            if address is None:
                ptrs.append([slot])
                sizes.append([expected])
                src_offsets.append([0])
            else:
                ptrs.append([slot, address])
                sizes.append([HEADER.size, views[i].nbytes])
                src_offsets.append([0, HEADER.size])
        call.holding = bool(call.moved) and buffers.hold()
        if not call.holding:
            if stored and stored[0] != TIMEOUT:
                self._client.submit("end session", 1, partial(_end_session, keys=names))
            return None
        moved = [names[j] for j in call.moved]
        read = partial(_read_parts, keys=moved, ptrs=ptrs, sizes=sizes, src_offsets=src_offsets)
        # Never abandoned at the call bound: it may write into the caller's memory until it returns. The session is
        # ended by a call of its own afterwards, which nobody waits for: ending it asks the master, which may stall.
        pending = self._client.submit("get", len(moved), read, call.buf, bound_s=self.settings.direct_read_max_seconds)
        end = partial(_end_session, keys=names)
        if pending.future is None:
            self._client.submit("end session", 1, end)
        else:
            self._client.when_done(pending, "end session", end)
        return pending

    def _get_done(
        self,
        call: _Call,
        keys: Sequence[str],
        views: Sequence[memoryview],
        codes: list[int],
        corrupt: list[str],
        buffers: CallerBuffers,
    ) -> None:
        """Check the objects one call moved; copy the intact staged ones into the caller's views (under a hold: the
        direct call's own, else one taken now; without one, nothing is read)."""
        self._got(call, self._client.wait(call.pending), keys, views, codes, corrupt, buffers)

    def _got(
        self,
        call: _Call,
        got: list[int],
        keys: Sequence[str],
        views: Sequence[memoryview],
        codes: list[int],
        corrupt: list[str],
        buffers: CallerBuffers,
    ) -> None:
        """:meth:`_get_done` once the call answered ``got``."""
        if any(call.addresses) and got and got[0] == TIMEOUT and not self._direct_reads_off:
            self._direct_reads_off = True
            logger.error(
                "Mooncake tier: a direct read into L1 ran over direct_read_max_seconds (%.0f s) and was abandoned; "
                "it may still write into memory LMCache reuses. Every later read is staged; check the holders' "
                "network, and restart the server to read direct again",
                self.settings.direct_read_max_seconds,
            )
        held = call.holding or buffers.hold()
        try:
            if held:
                self._check_and_copy(call, got, keys, views, codes, corrupt)
        finally:
            if held:
                buffers.release()
            self._client.done_with(call.buf, got)

    def _check_and_copy(
        self,
        call: _Call,
        got: list[int],
        keys: Sequence[str],
        views: Sequence[memoryview],
        codes: list[int],
        corrupt: list[str],
    ) -> None:
        staging = memoryview(call.buf)
        for j, code in zip(call.moved, got, strict=True):
            i, offset = call.group[j], call.offsets[j]
            size = HEADER.size + views[i].nbytes
            if code != size:
                # the object had exactly the expected size: a smaller one reads short, a bigger one is refused
                codes[i] = SIZE_MISMATCH if code >= 0 or code == INVALID_PARAMS else code
                continue
            if call.addresses[j] is None:
                payload = open_object(staging[offset : offset + size], keys[i])
                intact = payload is not None
            else:
                payload = None
                intact = check_object(bytes(staging[offset : offset + HEADER.size]), views[i], keys[i])
            if not intact:
                codes[i] = CORRUPT
                corrupt.append(keys[i])
                continue
            if payload is not None:
                _copy(views[i], payload)
            codes[i] = views[i].nbytes
            self._add("bytes_read", size)
            self._add("direct_read", int(call.addresses[j] is not None))

    def remove(self, keys: Sequence[str]) -> list[int]:
        """Remove each key (forced past read leases); per key 0 or a negative code (-704: already gone)."""
        return self._client.call("remove", len(keys), partial(_remove, keys=list(keys)))

    def _landed_late(self, keys: list[str], future: Any) -> None:
        """A put abandoned at its bound returned: the objects it stored are to be removed, as the caller was told
        they were not stored (they are in no tier's accounting, and a clear may have come in between)."""
        if future.cancelled() or future.exception() is not None:
            return
        try:
            landed = [key for key, code in zip(keys, future.result(), strict=True) if int(code) == OK]
        except Exception:
            logger.exception("MooncakeObjectStore: a late put of %d keys answered unreadable codes", len(keys))
            return
        if landed:
            with self._lock:
                self._late.extend(landed)
                self._stats["late_puts"] += len(landed)
            logger.warning("MooncakeObjectStore: a put abandoned at its bound stored %d objects after all; they "
                           "will be removed", len(landed))  # fmt: skip

    def remove_late(self) -> int:
        """Remove the objects late puts stored (see :meth:`_landed_late`); the number removed. Those it could not
        remove yet (the client is down: ``UNAVAILABLE`` at once) are tried again at the next call."""
        with self._lock:
            keys, self._late = self._late, []
        if not keys:
            return 0
        codes = self.remove(keys)
        removed = sum(code in (OK, OBJECT_NOT_FOUND) for code in codes)
        with self._lock:
            self._late[:0] = [key for key, code in zip(keys, codes, strict=True) if code not in (OK, OBJECT_NOT_FOUND)]
            self._stats["late_puts_removed"] += removed
        return removed

    def remove_prefix(self, prefix: str) -> int:
        """Remove every object whose key starts with ``prefix`` (forced past read leases: a read in flight then fails
        its checksum or reads short, a miss), whoever stored it, in one master call; the number removed, or a
        negative code."""
        pattern = prefix_pattern(prefix)
        (code,) = self._client.call("remove_by_regex", 1, partial(_remove_matching, pattern=pattern))
        return code

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

    def _direct_addresses(self, views: Sequence[memoryview]) -> list[int | None]:
        """Per view, its address when it moves direct (big enough and inside the registered region), else None."""
        region = self._client.region
        if region is None:
            return [None] * len(views)
        low, high, smallest = region[0], region[0] + region[1], max(1, self.settings.zero_copy_min_bytes)
        addresses: list[int | None] = []
        for view in views:
            address = np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes >= smallest else None
            addresses.append(address if address is not None and low <= address <= high - view.nbytes else None)
        return addresses

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


def batch_groups(limit: int, sizes: Sequence[int], max_items: int) -> list[tuple[list[int], int]]:
    """Consecutive index groups with their total size, each of at most ``max_items`` items and at most ``limit``
    in size unless one item alone exceeds it.

    E.g. ``batch_groups(10, [4, 4, 4, 20, 1], 8) == [([0, 1], 8), ([2], 4), ([3], 20), ([4], 1)]``.
    """
    groups: list[tuple[list[int], int]] = []
    members: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if members and (total + size > limit or len(members) >= max_items):
            groups.append((members, total))
            members, total = [], 0
        members.append(i)
        total += size
    if members:
        groups.append((members, total))
    return groups


def object_seed(key: str) -> int:
    """The seed of the checksum of the object stored under ``key``: an object read under another key (Mooncake
    reused its memory for an object of the same size during the read) fails its check."""
    return key_seed(key.encode())


def seal_object(into: memoryview, payload: memoryview, key: str) -> None:
    """Write header + ``payload`` into ``into`` (exactly ``HEADER.size + payload.nbytes`` bytes), to be stored under
    ``key``."""
    stored = into[HEADER.size :]
    _copy(stored, payload)
    into[: HEADER.size] = encode_header(payload.nbytes, xxhash.xxh3_64_intdigest(stored, object_seed(key)))


def _copy(into: memoryview, data: memoryview) -> None:
    """``into[:] = data`` for equally long byte views, without holding the GIL for big ones."""
    if data.nbytes < 1 << 16:
        into[:] = data
    else:
        np.copyto(np.frombuffer(into, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8))


def check_object(header: bytes, payload: memoryview, key: str) -> bool:
    """Whether ``header`` (the first 32 bytes of the object read under ``key``) is valid and describes ``payload``:
    length, and checksum seeded with the key."""
    decoded = decode_header(header)
    return (
        decoded is not None
        and decoded[0] == payload.nbytes
        and xxhash.xxh3_64_intdigest(payload, object_seed(key)) == decoded[1]
    )


def open_object(data: memoryview, key: str) -> memoryview | None:
    """The payload of the object (header + payload) read under ``key``, or None when its header or checksum does not
    match."""
    payload = data[HEADER.size :]
    return payload if check_object(bytes(data[: HEADER.size]), payload, key) else None


def stored_sizes(native: Any, keys: list[str]) -> list[int]:
    """Each key's stored size (header included), or ``OBJECT_NOT_FOUND`` when it has no memory replica.

    Reads ``ReplicaDescriptor.get_memory_descriptor().buffer_descriptor.size`` from ``batch_get_replica_desc``
    (mooncake-transfer-engine 0.3.13; the direct-read tests fail loudly if that shape changes). A key Mooncake does
    not know is absent from the answer.
    """
    replicas = native.batch_get_replica_desc(keys)
    sizes = []
    for key in keys:
        memory = [replica for replica in replicas.get(key, ()) if replica.is_memory_replica()]
        sizes.append(int(memory[0].get_memory_descriptor().buffer_descriptor.size) if memory else OBJECT_NOT_FOUND)
    return sizes


# -- what runs on the io threads (bound by partial: an abandoned call must not see the caller's next values) --------
def _exists(native: Any, keys: list[str]) -> list[int]:
    return native.batch_is_exist(keys)


_REGEX_SYNTAX = frozenset("^$\\.*+?()[]{}|")
"""The characters with a meaning in an ECMAScript regular expression (the grammar of Mooncake's C++ regexes)."""


def prefix_pattern(prefix: str) -> str:
    """The regular expression (ECMAScript, as Mooncake's ``remove_by_regex`` reads it) of keys starting with
    ``prefix``: ``prefix_pattern("team.a/") == "^team\\.a/"``. Only syntax characters are escaped, as the grammar
    refuses escapes of others."""
    return "^" + "".join(f"\\{c}" if c in _REGEX_SYNTAX else c for c in prefix)


def _remove_matching(native: Any, pattern: str) -> list[int]:
    return [native.remove_by_regex(pattern, True)]


def _remove(native: Any, keys: list[str]) -> list[int]:
    """One master call for the whole batch (a remove per key costs a round trip each: 64 keys took 12 ms here,
    ``batch_remove`` 0.4 ms); per key 0 or a code (-704: already gone)."""
    return native.batch_remove(keys, True) if keys else []


def _write(native: Any, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
    return native.batch_put_from(keys, ptrs, sizes) if keys else []


def _write_parts(native: Any, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
    """Each object from its parts (a staged header, the payload where it lies); per key 0 or a code."""
    return native.batch_put_from_multi_buffers(keys, ptrs, sizes) if keys else []


def _read(native: Any, keys: list[str], buf: np.ndarray, offsets: list[int], sizes: list[int]) -> list[int]:
    """``batch_get_into`` each key into a slot of exactly its expected size; per key bytes read or a code."""
    return native.batch_get_into(keys, [buf.ctypes.data + offset for offset in offsets], sizes)


def _query(native: Any, keys: list[str]) -> list[int]:
    """Open a get session on ``keys`` (the master's part of a direct read); per key its stored size or a code."""
    started = native.batch_get_session_start(keys)
    try:
        sizes = stored_sizes(native, keys)
    except BaseException:
        native.batch_get_session_end(keys)
        raise
    return [size if code == OK else code for code, size in zip(started, sizes, strict=True)]


def _read_parts(
    native: Any, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], src_offsets: list[list[int]]
) -> list[int]:
    """Move each queried object's parts from the replicas its session holds (no master call)."""
    return native.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, src_offsets)


def _end_session(native: Any, keys: list[str]) -> list[int]:
    return [native.batch_get_session_end(keys)]
