"""Put/get throughput of the storage tiers, with their baselines measured in the same run.

Two object kinds, each a batch of ``--objects`` objects: a 256-token KV chunk (48 layers x (K, V) x 4 KV heads x
head 128, bf16: 24 MiB, the shape of Qwen3-30B-A3B) and the 256-token R3 chunk of the same model (48 layers x top-8
of 128 experts, uint8: 96 KiB + a 72-byte header, built with ``encode_run``). Each batch goes through:

1. ``ShmL2Adapter`` (lmcache_r3's /dev/shm tier), root in a fresh 0700 directory under /dev/shm;
2. LMCache's stock fs L2 adapter with its base path under /dev/shm (the peer of 1);
3. ``MooncakeL2Adapter`` (lmcache_r3's Mooncake tier) against a Mooncake master and a separate holder process
   started here on loopback (as the tests start them, but with Mooncake's default 10 s read lease);
4. raw ``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into`` of the same bytes on the same cluster, the
   whole batch in one call, from and into registered buffers (the peer of 3);
5. a single-thread memcpy (``numpy.copyto`` object by object into preallocated, already touched buffers): the limit;
6. the same memcpy plus an XXH3-64 of every object (put: hash, then copy; get: copy, then hash the copy): the floor
   of any tier that checksums what it stores and verifies every load, as both lmcache_r3 tiers do;
7. the file system calls of a file-per-object tier with atomic first-writer-wins publication, and nothing else, on
   /dev/shm from one thread (put: rewrite a file of the object's size, rename it to the object's name unless that
   exists; get: ``stat`` each object, as a lookup must, then open, read, close): the floor of the shm tier's
   design, without its checksums, accounting, tasks and threads;
8. raw Mooncake plus what an L2 tier over it cannot leave out: an existence query of the batch before the get (LMCache
   looks up and locks before it loads) and an XXH3-64 of every object (before the put, after the get): the floor of
   the Mooncake tier's design.

R3 is measured twice: a batch of ``--objects`` chunks, and the 128 chunks of one 32k-token request
(``--r3-request-objects``), the batch the connector stores and fetches for such a request.

The adapters are driven in-process through ``L2AdapterInterface`` as LMCache's storage controllers drive them: put =
``submit_store_task`` (keys + LMCache ``TensorMemoryObj`` views of caller memory) until its event fd signals and
``pop_completed_store_tasks`` has the task; get = ``submit_lookup_and_lock_task`` until the bitmap comes, then
``submit_load_task`` into other memory objects until its bitmap comes, then ``submit_unlock``. Every get is checked
byte for byte against what was put; a mismatch, a miss or a failed store stops the run.

For the R3 batches the report also splits the two lmcache_r3 tiers' time: what a put and a get spent inside the
tier's underlying calls (the shm tier's ``ShmObjectStore`` methods, the Mooncake tier's native client calls, timed
by wrapping them), in the Mooncake tier's staging, and the rest, the tier's own work around them; raw Mooncake runs
in the same rounds, so the tier's native calls are compared with the same calls made under the same conditions.

Each repeat runs every path once (the paths interleaved in a rotating order, fresh keys every time, objects deleted
again untimed); one untimed warm-up repeat comes first. Figures are medians over ``--repeats``; ratios are ratios of
medians.

    python bench/bench_tiers.py [--objects 16] [--r3-request-objects 128] [--repeats 5] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import logging
import os
import platform
import select
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
import xxhash
from benchdocs import DOCS, write_section
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform.event_notifier import consume_fd

from lmcache_r3.artifacts import R3Profile, encode_run, encoded_nbytes
from lmcache_r3.launch import LOOPBACK, TELEMETRY_OFF, exit_on_sigterm
from lmcache_r3.tiers import mooncake_store
from lmcache_r3.tiers.mooncake_adapter import MooncakeL2Adapter
from lmcache_r3.tiers.mooncake_config import settings_from_params
from lmcache_r3.tiers.shm_adapter import ShmL2Adapter
from lmcache_r3.tiers.shm_store import publish, write_all

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for the tests' Mooncake helpers
from tests.support.mooncake import MOONCAKE_ENV, MooncakeCluster, start_mooncake  # noqa: E402

SECTION = "## Storage tiers"
CHUNK = 256
MODEL = "bench-model"
KV_LAYERS, KV_HEADS, HEAD_DIM = 48, 4, 128
PROFILE = R3Profile(num_layers=48, top_k=8, num_experts=128)
TASK_TIMEOUT_S = 120.0
SHM_IO_THREADS, SHM_PARALLEL_MIN_BYTES, SHM_PARALLEL_MIN_OBJECT_BYTES = 2, 8 << 20, 1 << 20
SHM_INLINE_MAX_BYTES, SHM_INLINE_MAX_OBJECTS = 4 << 20, 32
"""The shm tier's thread settings, set here so the report can say which batches split and which run inline."""
R3_REPEATS = 5
"""R3 batches run this many times the repeats: a call of a few milliseconds over loopback varies 2x run to run."""
PATHS = (
    "shm",
    "shm_fresh",
    "fs",
    "mooncake",
    "mooncake_staged",
    "raw_mooncake",
    "memcpy",
    "verified_copy",
    "file_floor",
    "mooncake_floor",
)
LOOKUP_PATHS = ("shm", "shm_fresh", "fs", "mooncake", "mooncake_staged", "file_floor", "mooncake_floor")
"""The paths whose get starts with a lookup (its time is reported on its own)."""
LABELS = {
    "shm": "lmcache_r3 shm tier (`ShmL2Adapter`, /dev/shm)",
    "shm_fresh": "lmcache_r3 shm tier, recycling off (`recycle_bytes: 0`: every put writes new pages)",
    "fs": "LMCache fs tier (`FSL2Adapter`, base path on /dev/shm)",
    "mooncake": "lmcache_r3 Mooncake tier (`MooncakeL2Adapter`)",
    "mooncake_staged": "lmcache_r3 Mooncake tier, `direct_reads: false` (every read through staging)",
    "raw_mooncake": "raw Mooncake `batch_put_from` / `batch_get_into`",
    "memcpy": "memcpy, one thread (`numpy.copyto` per object)",
    "verified_copy": "memcpy + XXH3-64 of each object, one thread (the floor of a checksummed tier)",
    "file_floor": "file system calls alone, one thread (the floor of a file-per-object tier with atomic publication)",
    "mooncake_floor": "raw Mooncake + an existence query before the get + XXH3-64 of each object (the floor of a "
    "checksummed L2 tier over Mooncake)",
}


class BenchFailure(RuntimeError):
    """A path lost, changed or failed to store bytes: the run is worthless and stops."""


# -- the objects ------------------------------------------------------------------------------------------------------
@dataclass
class Kind:
    """One object kind: ``count`` objects of ``nbytes`` each, laid out back to back in ``source``."""

    name: str
    describe: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat
    model_name: str
    source: np.ndarray
    count: int

    @property
    def total(self) -> int:
        return self.count * self.nbytes

    def views(self, buffer: np.ndarray) -> list[np.ndarray]:
        return [buffer[i * self.nbytes : (i + 1) * self.nbytes] for i in range(self.count)]

    def memory_objects(self, buffer: np.ndarray) -> list[TensorMemoryObj]:
        """LMCache memory objects over ``buffer`` (an L1 allocation's flat uint8 tensor and its logical shape)."""
        return [
            TensorMemoryObj(
                raw_data=torch.from_numpy(view),
                metadata=MemoryObjMetadata(
                    shape=torch.Size(self.shape),
                    dtype=self.dtype,
                    address=i * self.nbytes,
                    phy_size=self.nbytes,
                    ref_count=1,
                    fmt=self.fmt,
                ),
                parent_allocator=None,
            )
            for i, view in enumerate(self.views(buffer))
        ]

    def keys(self, path: str, repeat: int) -> list[ObjectKey]:
        """Fresh keys for one put of this kind on one path (a tier may skip a key it already holds)."""
        return [
            ObjectKey(
                chunk_hash=hashlib.blake2b(f"{self.name}/{path}/{repeat}/{i}".encode(), digest_size=32).digest(),
                model_name=self.model_name,
                kv_rank=0,
                object_group_id=0,
            )
            for i in range(self.count)
        ]


def kv_kind(count: int) -> Kind:
    shape = (2, KV_LAYERS, CHUNK, KV_HEADS * HEAD_DIM)
    nbytes = int(np.prod(shape)) * 2
    source = np.random.default_rng(0).integers(0, 256, count * nbytes, dtype=np.uint8)
    return Kind(
        "KV",
        f"256-token KV chunk, {KV_LAYERS} layers x (K, V) x {KV_HEADS} KV heads x {HEAD_DIM}, bf16",
        nbytes,
        shape,
        torch.bfloat16,
        MemoryFormat.KV_2LTD,
        MODEL,
        source,
        count,
    )


def r3_kind(count: int, name: str = "R3") -> Kind:
    rows = np.random.default_rng(1).integers(0, PROFILE.num_experts, (count * CHUNK, *PROFILE.row_shape))
    source = np.frombuffer(encode_run(PROFILE, 0, rows.astype(PROFILE.dtype), CHUNK), dtype=np.uint8).copy()
    nbytes = encoded_nbytes(PROFILE, CHUNK)
    return Kind(
        name,
        f"256-token R3 chunk, {PROFILE.describe()}, + header",
        nbytes,
        (nbytes,),
        torch.uint8,
        MemoryFormat.BINARY_BUFFER,
        MODEL + "##r3",
        source,
        count,
    )


# -- the paths ------------------------------------------------------------------------------------------------------
def wait_for(fd: int, query: Callable[[], object], what: str) -> object:
    """Wait on a task's event fd, draining it as LMCache's controllers do, until ``query()`` has the result."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + TASK_TIMEOUT_S
    while (result := query()) is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BenchFailure(f"{what} did not complete within {TASK_TIMEOUT_S:.0f} s")
        if poller.poll(int(remaining * 1000) + 1):
            consume_fd(fd)
    return result


class AdapterPath:
    """An L2 adapter driven through ``L2AdapterInterface`` as LMCache's store and prefetch controllers drive it."""

    def __init__(self, name: str, adapter) -> None:
        self.name, self.adapter = name, adapter
        self._stored: dict[int, object] = {}

    def _store_result(self, task_id: int):
        self._stored.update(self.adapter.pop_completed_store_tasks())
        return self._stored.pop(task_id, None)

    def put(self, kind: Kind, keys: list[ObjectKey], objects: list) -> None:
        task_id = self.adapter.submit_store_task(keys, objects)
        result = wait_for(self.adapter.get_store_event_fd(), lambda: self._store_result(task_id), f"{self.name} store")
        if not result.is_successful() or result.bytes_transferred() != kind.total:
            raise BenchFailure(f"{self.name}: store of {kind.count} {kind.name} objects returned {result}")

    def get(self, kind: Kind, keys: list[ObjectKey], objects: list) -> float:
        """Lookup-and-lock, load, unlock; returns the seconds the lookup took."""
        adapter = self.adapter
        started = time.perf_counter()
        task_id = adapter.submit_lookup_and_lock_task(keys, {})
        hits = wait_for(
            adapter.get_lookup_and_lock_event_fd(),
            lambda: adapter.query_lookup_and_lock_result(task_id),
            f"{self.name} lookup",
        )
        lookup_s = time.perf_counter() - started
        try:
            if hits.popcount() != len(keys):
                raise BenchFailure(f"{self.name}: lookup found {hits.popcount()} of {len(keys)} {kind.name} objects")
            task_id = adapter.submit_load_task(keys, objects)
            loaded = wait_for(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task_id), "load")
            if loaded.popcount() != len(keys):
                raise BenchFailure(f"{self.name}: loaded {loaded.popcount()} of {len(keys)} {kind.name} objects")
        finally:
            adapter.submit_unlock(keys)
        return lookup_s

    def remove(self, keys: list[ObjectKey]) -> None:
        self.adapter.delete(keys)

    def close(self) -> None:
        self.adapter.close()


class RawMooncakePath:
    """``batch_put_from`` / ``batch_get_into`` of the whole batch between registered buffers and the holder."""

    name = "raw_mooncake"

    def __init__(self, cluster: MooncakeCluster) -> None:
        self.store = cluster.client()
        self._registered: list[int] = []

    def register(self, *buffers: np.ndarray) -> None:
        for buffer in buffers:
            code = self.store.register_buffer(buffer.ctypes.data, buffer.nbytes)
            if code != 0:
                raise BenchFailure(f"raw Mooncake: register_buffer of {buffer.nbytes} bytes returned {code}")
            self._registered.append(buffer.ctypes.data)

    def unregister(self) -> None:
        while self._registered:
            self.store.unregister_buffer(self._registered.pop())

    @staticmethod
    def _names(keys: list[ObjectKey]) -> list[str]:
        return [f"bench-raw/{key.model_name}@{key.chunk_hash.hex()}" for key in keys]

    def put(self, kind: Kind, keys: list[ObjectKey], buffer: np.ndarray) -> None:
        ptrs = [buffer.ctypes.data + i * kind.nbytes for i in range(kind.count)]
        codes = self.store.batch_put_from(self._names(keys), ptrs, [kind.nbytes] * kind.count)
        if any(code != 0 for code in codes):
            raise BenchFailure(f"raw Mooncake: batch_put_from returned {codes}")

    def get(self, kind: Kind, keys: list[ObjectKey], buffer: np.ndarray) -> float:
        ptrs = [buffer.ctypes.data + i * kind.nbytes for i in range(kind.count)]
        codes = self.store.batch_get_into(self._names(keys), ptrs, [kind.nbytes] * kind.count)
        if any(code != kind.nbytes for code in codes):
            raise BenchFailure(f"raw Mooncake: batch_get_into returned {codes}")
        return 0.0

    def remove(self, keys: list[ObjectKey]) -> None:
        self.store.batch_remove(self._names(keys), True)

    def close(self) -> None:
        self.unregister()
        self.store.close()


class MemcpyPath:
    """One thread copying each object into a preallocated, already touched buffer, and back out of it."""

    name = "memcpy"

    def __init__(self, kind: Kind) -> None:
        self.held = np.zeros_like(kind.source)

    def put(self, kind: Kind, keys: list[ObjectKey], buffer: np.ndarray) -> None:
        for target, source in zip(kind.views(self.held), kind.views(buffer), strict=True):
            np.copyto(target, source)

    def get(self, kind: Kind, keys: list[ObjectKey], buffer: np.ndarray) -> float:
        for target, source in zip(kind.views(buffer), kind.views(self.held), strict=True):
            np.copyto(target, source)
        return 0.0

    def remove(self, keys: list[ObjectKey]) -> None:
        self.held[:] = 0

    def close(self) -> None:
        self.held = None


class VerifiedCopyPath(MemcpyPath):
    """memcpy plus one XXH3-64 per object: hashed before it is copied in, and after it is copied out."""

    name = "verified_copy"

    def __init__(self, kind: Kind) -> None:
        super().__init__(kind)
        self.digests: list[int] = []

    def put(self, kind: Kind, keys: list[ObjectKey], buffer: np.ndarray) -> None:
        self.digests = []
        for target, source in zip(kind.views(self.held), kind.views(buffer), strict=True):
            self.digests.append(xxhash.xxh3_64_intdigest(source))
            np.copyto(target, source)

    def get(self, kind: Kind, keys: list[ObjectKey], buffer: np.ndarray) -> float:
        for target, source, digest in zip(kind.views(buffer), kind.views(self.held), self.digests, strict=True):
            np.copyto(target, source)
            if xxhash.xxh3_64_intdigest(target) != digest:
                raise BenchFailure("verified copy: a copied object does not match its digest")
        return 0.0


class FileFloorPath:
    """Only the file system calls of a file-per-object tier that publishes atomically, first writer wins.

    put, per object: open a file of the object's size (its pages already there, as the shm tier rewrites the file of
    an object removed earlier), write the object, close, rename it to the object's name unless that exists (the shm
    tier's own ``publish``: one ``renameat2(RENAME_NOREPLACE)``). get: ``stat`` every object (the lookup), then per
    object open, read into the target, close. No header, checksum, accounting, task or thread: one Python thread on
    /dev/shm.
    """

    name = "file_floor"

    def __init__(self, kind: Kind) -> None:
        self.root = tempfile.mkdtemp(prefix=f"r3-bench-floor-{kind.name}-", dir="/dev/shm")
        self.free = [os.path.join(self.root, f"free-{i}") for i in range(kind.count)]
        for path in self.free:  # sized, without pages: the untimed warm-up repeat's put gives them their pages
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, kind.nbytes)
            finally:
                os.close(fd)

    def _path(self, key: ObjectKey) -> str:
        return os.path.join(self.root, key.chunk_hash.hex())

    def put(self, kind: Kind, keys: list[ObjectKey], buffer: np.ndarray) -> None:
        for temp, key, view in zip(self.free, keys, kind.views(buffer), strict=True):
            fd = os.open(temp, os.O_WRONLY | os.O_CLOEXEC)
            try:
                write_all(fd, memoryview(view))
            finally:
                os.close(fd)
            publish(temp, self._path(key))

    def get(self, kind: Kind, keys: list[ObjectKey], buffer: np.ndarray) -> float:
        started = time.perf_counter()
        paths = [self._path(key) for key in keys]
        for path in paths:
            os.stat(path)
        lookup_s = time.perf_counter() - started
        for path, view in zip(paths, kind.views(buffer), strict=True):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if os.readv(fd, [view]) != kind.nbytes:
                    raise BenchFailure(f"file floor: {path} read short")
            finally:
                os.close(fd)
        return lookup_s

    def remove(self, keys: list[ObjectKey]) -> None:
        for temp, key in zip(self.free, keys, strict=True):
            os.rename(self._path(key), temp)  # back to the free files (untimed), as the shm tier recycles

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class MooncakeFloorPath(RawMooncakePath):
    """Raw Mooncake plus the existence query of the batch before its get and an XXH3-64 of every object (before the
    put, after the get): what an L2 tier over Mooncake that verifies every load cannot leave out."""

    name = "mooncake_floor"

    def __init__(self, cluster: MooncakeCluster) -> None:
        super().__init__(cluster)
        self.digests: list[int] = []

    @staticmethod
    def _names(keys: list[ObjectKey]) -> list[str]:
        return [f"bench-floor/{key.model_name}@{key.chunk_hash.hex()}" for key in keys]

    def put(self, kind: Kind, keys: list[ObjectKey], buffer: np.ndarray) -> None:
        self.digests = [xxhash.xxh3_64_intdigest(view) for view in kind.views(buffer)]
        super().put(kind, keys, buffer)

    def get(self, kind: Kind, keys: list[ObjectKey], buffer: np.ndarray) -> float:
        started = time.perf_counter()
        found = self.store.batch_is_exist(self._names(keys))
        lookup_s = time.perf_counter() - started
        if any(code != 1 for code in found):
            raise BenchFailure(f"Mooncake floor: batch_is_exist returned {found}")
        super().get(kind, keys, buffer)
        for view, digest in zip(kind.views(buffer), self.digests, strict=True):
            if xxhash.xxh3_64_intdigest(view) != digest:
                raise BenchFailure("Mooncake floor: an object read back does not match its digest")
        return lookup_s


# -- measuring ------------------------------------------------------------------------------------------------------
@dataclass
class Sample:
    put_s: float
    get_s: float
    lookup_s: float
    inner: dict[str, float]
    """Seconds inside the tier's underlying calls (see :class:`InnerCalls`), by operation: put, lookup, load."""


class InnerCalls:
    """Seconds spent inside a tier's underlying calls, summed per operation: the shm tier's ``ShmObjectStore``
    methods (file system calls and checksums) and the Mooncake tier's native client calls (what raw Mooncake makes
    too). One path runs at a time, so one accumulator serves every path. The timers wrap the calls only while
    :meth:`installed` (they cost about a microsecond a call, which the timed rounds must not pay)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._targets: list[tuple[object, str, str]] = []

    def wrap(self, owner, name: str, operation: str) -> None:
        """Time ``owner.name`` as part of ``operation`` whenever the timers are installed."""
        self._targets.append((owner, name, operation))

    def forget(self, owner) -> None:
        self._targets = [target for target in self._targets if target[0] is not owner]

    @contextmanager
    def installed(self):
        originals = [(owner, name, inspect.getattr_static(owner, name)) for owner, name, _ in self._targets]
        for (owner, name, original), (_, _, operation) in zip(originals, self._targets, strict=True):
            if isinstance(original, staticmethod):
                setattr(owner, name, staticmethod(self._timed(original.__func__, operation)))
            else:
                setattr(owner, name, self._timed(getattr(owner, name), operation))
        try:
            yield
        finally:
            for owner, name, original in reversed(originals):
                setattr(owner, name, original)

    def _timed(self, original, operation: str):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[operation] = self.seconds.get(operation, 0.0) + time.perf_counter() - started

        return timed

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return taken


INNER = InnerCalls()
INNER_PATHS = ("shm", "mooncake", "raw_mooncake")
"""The paths of the instrumented rounds, after the timed ones: the two tiers, whose underlying calls are timed, and
raw Mooncake, whose put and get are the native calls the Mooncake tier makes, measured in the same rounds."""
MOONCAKE_PATHS = frozenset({"mooncake", "mooncake_staged", "raw_mooncake", "mooncake_floor"})
"""The paths over Mooncake: they take turns among themselves, and the others among themselves, in every repeat."""
GROUP_PAUSE_S = 0.2
"""The pause before each group of paths."""
MOONCAKE_NATIVE = {"_write": "put", "_write_parts": "put", "_exists": "lookup", "_read": "load", "_query": "load",
                   "_read_parts": "load"}  # fmt: skip
"""The Mooncake tier's native calls (module functions of ``mooncake_store``), by the operation that makes them."""
MOONCAKE_STAGING = "staging"
"""The operation of ``MooncakeObjectStore._stage``: a put's copy of each batch into staging and its checksums."""


def one_round(path, kind: Kind, repeat: int, sources, targets, target: np.ndarray) -> Sample:
    """Put the batch, get it back into ``target`` (through ``targets``), check every byte, delete it (untimed)."""
    keys = kind.keys(path.name, repeat)
    INNER.take()
    started = time.perf_counter()
    path.put(kind, keys, sources)
    put_s = time.perf_counter() - started
    inner = INNER.take()
    started = time.perf_counter()
    lookup_s = path.get(kind, keys, targets)
    get_s = time.perf_counter() - started
    inner = {**inner, **INNER.take()}  # the put's operations (put, staging), then the get's (lookup, load)
    if not np.array_equal(target, kind.source):
        bad = [
            i
            for i, (a, b) in enumerate(zip(kind.views(target), kind.views(kind.source), strict=True))
            if (a != b).any()
        ]
        raise BenchFailure(f"{path.name}: {len(bad)} of {kind.count} {kind.name} objects came back different: {bad}")
    target[:] = 0
    path.remove(keys)
    return Sample(put_s, get_s, lookup_s, inner)


def measure(
    kind: Kind, cluster: MooncakeCluster, repeats: int
) -> tuple[dict[str, list[Sample]], dict[str, list[Sample]], int]:
    """Every path's samples, the tiers' samples from the instrumented rounds (see :class:`InnerCalls`), and the
    Mooncake tier's ``batch_bytes``."""
    arena = np.zeros(2 * kind.source.nbytes, dtype=np.uint8)  # one L1 arena holds both sides, as LMCache's L1 does
    arena[: kind.source.nbytes] = kind.source
    kind.source, target = arena[: kind.source.nbytes], arena[kind.source.nbytes :]  # target: touched, like a warm L1
    sources, targets = kind.memory_objects(kind.source), kind.memory_objects(target)
    shm_root = tempfile.mkdtemp(prefix=f"r3-bench-shm-{kind.name}-", dir="/dev/shm")  # mode 0700, ours
    fs_root = tempfile.mkdtemp(prefix=f"r3-bench-fs-{kind.name}-", dir="/dev/shm")
    paths: list = []
    shm_tier = None
    try:
        shm = {
            "capacity_bytes": 4 * kind.total,
            "io_threads": SHM_IO_THREADS,
            "parallel_min_bytes": SHM_PARALLEL_MIN_BYTES,
            "parallel_min_object_bytes": SHM_PARALLEL_MIN_OBJECT_BYTES,
            "inline_max_bytes": SHM_INLINE_MAX_BYTES,
            "inline_max_objects": SHM_INLINE_MAX_OBJECTS,
        }
        shm_tier = ShmL2Adapter(dict(shm, root=shm_root))
        for name, operation in (("put", "put"), ("exists", "lookup"), ("get_into", "load")):
            INNER.wrap(shm_tier._store, name, operation)
        paths.append(AdapterPath("shm", shm_tier))
        fresh_root = os.path.join(shm_root, "fresh")  # its own root: the recycling tier's free files are not its
        paths.append(AdapterPath("shm_fresh", ShmL2Adapter(dict(shm, root=fresh_root, recycle_bytes=0))))
        paths.append(AdapterPath("fs", FSL2Adapter(FSL2AdapterConfig(base_path=fs_root))))
        params = {
            "mooncake": {
                "local_hostname": LOOPBACK,
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": cluster.master_address,
                "global_segment_size": 0,
                "protocol": "tcp",
            },
            "master_metrics_port": cluster.metrics_port,
            "key_prefix": f"bench-tier-{kind.name}/",
        }
        l1 = L1MemoryDesc(ptr=arena.ctypes.data, size=arena.nbytes, align_bytes=1)
        staged = dict(params, direct_reads=False, key_prefix=f"bench-tier-staged-{kind.name}/")
        for name, adapter_params in (("mooncake", params), ("mooncake_staged", staged)):
            mooncake = MooncakeL2Adapter(adapter_params, l1)
            paths.append(AdapterPath(name, mooncake))
            deadline = time.monotonic() + 30
            while mooncake.report_status()["state"] != "up":
                if time.monotonic() > deadline:
                    raise BenchFailure(f"the Mooncake tier did not connect: {mooncake.report_status()}")
                time.sleep(0.05)
        for raw in (RawMooncakePath(cluster), MooncakeFloorPath(cluster)):
            paths.append(raw)
            raw.register(kind.source, target)
        paths.append(MemcpyPath(kind))
        paths.append(VerifiedCopyPath(kind))
        paths.append(FileFloorPath(kind))

        def rounds(chosen: list, first: int) -> dict[str, list[Sample]]:
            """``repeats`` rounds of ``chosen`` after one warm-up round (repeat ``first``, not counted): in every
            round the paths over Mooncake take turns among themselves and the others among themselves, each group
            after a pause, in a new order every round."""
            samples: dict[str, list[Sample]] = {path.name: [] for path in chosen}
            groups = [
                group
                for over_mooncake in (False, True)
                if (group := [path for path in chosen if (path.name in MOONCAKE_PATHS) == over_mooncake])
            ]
            for repeat in range(first, first + repeats + 1):
                for group in groups:
                    time.sleep(GROUP_PAUSE_S)
                    for path in group[repeat % len(group) :] + group[: repeat % len(group)]:
                        if isinstance(path, AdapterPath):
                            sample = one_round(path, kind, repeat, sources, targets, target)
                        else:
                            sample = one_round(path, kind, repeat, kind.source, target, target)
                        if repeat > first:
                            samples[path.name].append(sample)
            return samples

        samples = rounds(paths, 0)
        with INNER.installed():  # the same rounds again, of the tiers and raw Mooncake, with the timers in
            instrumented = rounds([path for path in paths if path.name in INNER_PATHS], repeats + 1)
        return samples, instrumented, settings_from_params(params).batch_bytes
    finally:
        if shm_tier is not None:
            INNER.forget(shm_tier._store)
        for path in paths:
            path.close()
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(fs_root, ignore_errors=True)


def shm_inline(kind: Kind) -> bool:
    """Whether the shm tier runs a batch of ``kind`` on the thread that submits it."""
    return kind.total <= SHM_INLINE_MAX_BYTES and kind.count <= SHM_INLINE_MAX_OBJECTS


def shm_parallel(kind: Kind) -> bool:
    """Whether the shm tier copies a batch of ``kind`` on several threads."""
    return kind.total >= SHM_PARALLEL_MIN_BYTES and kind.nbytes >= SHM_PARALLEL_MIN_OBJECT_BYTES


# -- reporting ------------------------------------------------------------------------------------------------------
@dataclass
class Figures:
    put_gbps: float
    get_gbps: float
    put_ms: float
    get_ms: float
    lookup_ms: float
    inner_ms: dict[str, float]
    """Median milliseconds inside the tier's underlying calls, by operation, and of the whole put and get, in the
    instrumented rounds (empty for the other paths)."""


def figures(kind: Kind, samples: list[Sample], instrumented: list[Sample]) -> Figures:
    put_s = statistics.median(s.put_s for s in samples)
    get_s = statistics.median(s.get_s for s in samples)
    lookup_s = statistics.median(s.lookup_s for s in samples)
    inner = {}
    if instrumented:
        operations = sorted({operation for s in instrumented for operation in s.inner})
        inner = {op: statistics.median(s.inner.get(op, 0.0) for s in instrumented) * 1e3 for op in operations}
        inner["whole put"] = statistics.median(s.put_s for s in instrumented) * 1e3
        inner["whole get"] = statistics.median(s.get_s for s in instrumented) * 1e3
    return Figures(kind.total / put_s / 1e9, kind.total / get_s / 1e9, put_s * 1e3, get_s * 1e3, lookup_s * 1e3, inner)


GOALS = (
    ("shm tier / fs tier", "shm", "fs", 1.5),
    ("shm tier / memcpy", "shm", "memcpy", 0.3),
    ("Mooncake tier / raw Mooncake", "mooncake", "raw_mooncake", 0.8),
)


CONTEXT_RATIOS = (
    ("verified copy / memcpy (the most a checksummed tier can reach)", "verified_copy", "memcpy"),
    ("shm tier / verified copy", "shm", "verified_copy"),
    ("file system calls alone / memcpy (the most a file-per-object tier can reach)", "file_floor", "memcpy"),
    ("shm tier / file system calls alone", "shm", "file_floor"),
    ("Mooncake floor / raw Mooncake (the most a checksummed L2 tier over Mooncake can reach)", "mooncake_floor",
     "raw_mooncake"),
    ("Mooncake tier / Mooncake floor", "mooncake", "mooncake_floor"),
)  # fmt: skip
"""Ratios reported beside the goals, for context."""


def machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    return f"nproc {os.cpu_count()} ({model})"


def report(command: str, args, kinds: list[Kind], results: dict[str, dict[str, Figures]], batch_bytes: int) -> str:
    def ms(value: float) -> str:
        return f"{value:.1f} ms" if value >= 1 else f"{value:.2f} ms"

    out = [
        SECTION,
        "",
        f"`{command}` on {machine()}, {datetime.date.today().isoformat()}; Python {platform.python_version()}, "
        f"lmcache {version('lmcache')}, mooncake-transfer-engine-non-cuda "
        f"{version('mooncake-transfer-engine-non-cuda')}, numpy {np.__version__}.",
        "",
        f"A batch of {args.objects} objects of each kind, and R3 once more as the {args.r3_request_objects} chunks of "
        f"one {args.r3_request_objects * CHUNK // 1024}k-token request; medians of {args.repeats} repeats (R3 x "
        f"{args.objects}: {args.repeats * R3_REPEATS}, as its few-millisecond calls vary more) after one warm-up, all "
        "paths run in every repeat, in two groups (the paths over Mooncake, and the others) that each take turns "
        f"in a rotating order, after a {GROUP_PAUSE_S:.1f} s pause, so each goal's ratio compares paths measured "
        "side by side; GB/s is 10^9 bytes of payload per second. Objects:",
        "",
    ]
    out += [
        f"- {kind.name}: {kind.describe}, {kind.nbytes:,} bytes ({kind.total / 2**20:.1f} MiB a batch)."
        for kind in kinds
    ]
    out += [
        "",
        "Paths: the three tiers are driven in-process through `L2AdapterInterface` as LMCache's storage controllers "
        "drive them (store task until its event fd signals; get = lookup-and-lock, then load into LMCache "
        "`TensorMemoryObj`s, then unlock), not through a server. The Mooncake master and a separate holder process "
        "(which owns the memory segment) run on loopback TCP, started by the benchmark; raw Mooncake moves the same "
        "bytes between registered buffers and that holder, the whole batch in one call each way, and its get has "
        "no lookup. The Mooncake tier gets an `l1_memory_desc` of the one arena holding the put and get buffers, so "
        "objects of at least its `zero_copy_min_bytes` (512 KiB: the KV ones) are written from and read into that "
        "memory unstaged (a direct read first asks the master for the objects' sizes), while smaller ones (R3) go "
        "through its staging buffers; the `direct_reads: false` row stages every read. It splits a batch into "
        f"calls of at most its `batch_bytes`, {batch_bytes >> 20} MiB. The master keeps Mooncake's default 10 s "
        "read lease. memcpy "
        "copies each object into a preallocated, already touched buffer (put) and back (get); the verified copy "
        "adds an XXH3-64 of each object (before the put's copy, after the get's), the least a tier does that "
        "checksums every object and verifies every load. Every get is compared byte for byte with what was put. "
        "The two floors: the file system calls alone of a file-per-object tier that publishes atomically, "
        "from one thread on /dev/shm (put: rewrite a file of the object's size, rename it to the object's name "
        "unless that exists, as the shm tier publishes; get: `stat` every object, then open, read, close), and a "
        "second raw Mooncake client that also queries the batch's existence before the get and hashes every "
        "object with XXH3-64 (before the put, after the get).",
        "",
        "The shm tier rewrites the files of objects removed earlier: each repeat's objects are deleted after it "
        "(untimed), so the next repeat's puts find free files of their size, as every put does in a full tier, "
        "where each one follows an eviction. `recycle_bytes: 0` shows a put into new tmpfs pages (a tier still "
        "filling up). The shm tier runs a task of at most its `inline_max_bytes` (4 MiB on tmpfs) and "
        f"`inline_max_objects` ({SHM_INLINE_MAX_OBJECTS}) on the thread that submits it, lookups included, and "
        "bigger ones on its workers: "
        + ", ".join(f"{k.name} {'inline' if shm_inline(k) else 'on workers'}" for k in kinds)
        + f". It copies a batch of at least its `parallel_min_bytes` ({SHM_PARALLEL_MIN_BYTES >> 20} MiB) of "
        f"objects of at least `parallel_min_object_bytes` ({SHM_PARALLEL_MIN_OBJECT_BYTES >> 20} MiB) each on its "
        f"{SHM_IO_THREADS} `io_threads`: "
        + ", ".join(f"{k.name} on {SHM_IO_THREADS if shm_parallel(k) else 1}" for k in kinds)
        + ".",
        "",
        "| path | " + " | ".join(f"{k.name} put | {k.name} get | {k.name} get: lookup" for k in kinds) + " |",
        "| --- |" + " --- | --- | --- |" * len(kinds),
    ]
    for name in PATHS:
        cells = []
        for kind in kinds:
            f = results[kind.name][name]
            lookup = ms(f.lookup_ms) if name in LOOKUP_PATHS else "-"
            cells += [f"{f.put_gbps:.2f} GB/s ({ms(f.put_ms)})", f"{f.get_gbps:.2f} GB/s ({ms(f.get_ms)})", lookup]
        out.append(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
    out += [
        "",
        "Ratios (of the medians above; put and get each) and the goals of the issue:",
        "",
        "| ratio | " + " | ".join(f"{k.name} put | {k.name} get" for k in kinds) + " | goal | status |",
        "| --- |" + " --- | --- |" * len(kinds) + " --- | --- |",
    ]

    def ratios(num: str, den: str) -> list[tuple[str, float]]:
        return [
            (
                f"{k.name} {op}",
                getattr(results[k.name][num], f"{op}_gbps") / getattr(results[k.name][den], f"{op}_gbps"),
            )
            for k in kinds
            for op in ("put", "get")
        ]

    for label, num, den, goal in (*GOALS, *((label, num, den, None) for label, num, den in CONTEXT_RATIOS)):
        measured = ratios(num, den)
        cells = " | ".join(f"{ratio:.2f}x" for _, ratio in measured)
        if goal is None:
            out.append(f"| {label} | {cells} | - | - |")
            continue
        missed = [where for where, ratio in measured if ratio < goal]
        status = "**met**" if not missed else f"**not met** ({', '.join(missed)})"
        out.append(f"| {label} | {cells} | >= {goal}x | {status} |")
    r3 = next((kind for kind in kinds if kind.name == "R3"), None)
    if r3 is not None:
        copy_ms, verified, shm = results["R3"]["memcpy"], results["R3"]["verified_copy"], results["R3"]["shm"]
        files = results["R3"]["file_floor"]
        within = files.put_gbps >= 0.3 * copy_ms.put_gbps and files.get_gbps >= 0.3 * copy_ms.get_gbps
        out += [
            "",
            f"R3 against memcpy: a batch of {r3.count} R3 objects ({r3.total / 2**20:.1f} MiB) is copied in "
            f"{ms(copy_ms.put_ms)} / {ms(copy_ms.get_ms)} (put / get) from cache, so 0.3x memcpy leaves "
            f"{ms(copy_ms.put_ms / 0.3)} / {ms(copy_ms.get_ms / 0.3)} for a whole tier operation; hashing each "
            "object once as well already takes "
            f"{ms(verified.put_ms)} / {ms(verified.get_ms)}. The file system calls of a file-per-object tier that "
            f"publishes atomically, alone and from one thread, take {ms(files.put_ms)} / {ms(files.get_ms)} (the "
            f"get's `stat` of each object {ms(files.lookup_ms)}): {files.put_gbps / copy_ms.put_gbps:.2f}x / "
            f"{files.get_gbps / copy_ms.get_gbps:.2f}x memcpy, "
            + ("within" if within else "short of")
            + " the goal before any checksum, accounting, task or thread. The shm tier takes "
            f"{ms(shm.put_ms)} / {ms(shm.get_ms)}; its lookup alone (one existence check per object, on the calling "
            "thread) "
            f"takes {ms(shm.lookup_ms)}, and a get is a lookup task plus a load task. For objects this small the "
            "tier's cost is per object, not per byte: the file system calls and the checksum of each.",
        ]
        raw, tier, staged, floor = (
            results["R3"][name] for name in ("raw_mooncake", "mooncake", "mooncake_staged", "mooncake_floor")
        )
        out += [
            "",
            f"R3 against raw Mooncake: raw moves the batch in {ms(raw.put_ms)} / {ms(raw.get_ms)} (put / get) in "
            "one call each way. With what a verified L2 tier cannot leave out, an existence query before the get "
            f"({ms(floor.lookup_ms)}) and a checksum of every object, a second raw client takes {ms(floor.put_ms)} / "
            f"{ms(floor.get_ms)}: {floor.put_gbps / raw.put_gbps:.2f}x / {floor.get_gbps / raw.get_gbps:.2f}x raw"
            + (
                " (more than 1x: the same native call's time differs that much between two clients in one process "
                "in this sequence; alone, in a tight loop, they match)"
                if max(floor.put_gbps / raw.put_gbps, floor.get_gbps / raw.get_gbps) > 1
                else ""
            )
            + ". The tier adds to that a copy into staging and the hand-off of each Mooncake call to the client's "
            "call thread, which bounds how long anything waits (a task of at most the tier's `inline_max_bytes`, "
            "4 MiB, such as this batch, is staged on the thread that submits it and completes on that call thread, "
            "with no worker in between; the x128 batch goes through a worker). The two tier rows "
            f"run the same code for these objects (both stage them): {ms(tier.put_ms)} and {ms(staged.put_ms)} "
            "for the put, which shows how much the same call varies between two clients in one process on this "
            "machine.",
        ]
    r3_kinds = [kind for kind in kinds if kind.name.startswith("R3")]
    if r3_kinds:
        out += [
            "",
            "Inside the tiers, R3 again: as many rounds again, after the timed ones, of the two tiers and raw "
            "Mooncake, with the same pauses and turns, and a timer around each of the tiers' underlying calls "
            "(the timed rounds above run without them: they cost about a microsecond a call). The underlying calls "
            "are the shm tier's `ShmObjectStore` methods (its file system calls and checksums) and the Mooncake "
            "tier's native client calls, the ones raw Mooncake makes (raw Mooncake's put and get are nothing but "
            "those calls, so its row compares the same call made in the same rounds); staging is the Mooncake "
            "tier's copy of each batch into its registered buffers with the checksum of each object; the rest is "
            "the tier's own work around them (the L2 tasks, the hand-offs between threads, accounting and event "
            "fds). Medians per batch, summed over the threads that make the calls (the shm tier splits a batch of "
            "at least its `parallel_min_bytes` over its `io_threads`, so there they can add up to more than the "
            "wall time).",
            "",
            "| path, batch | put | of which underlying calls | of which staging | rest of the put | get "
            "| of which lookup calls | of which load calls | rest of the get |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for kind in r3_kinds:
            for name in INNER_PATHS:
                inner = results[kind.name][name].inner_ms
                put, get = inner.get("whole put", 0.0), inner.get("whole get", 0.0)
                if name == "raw_mooncake":  # its put and get are the native calls themselves: nothing else
                    cells = [put, put, None, None, get, None, get, None]
                else:
                    calls, lookup, load = (inner.get(k, 0.0) for k in ("put", "lookup", "load"))
                    staging = inner.get(MOONCAKE_STAGING) if name == "mooncake" else None
                    cells = [
                        put,
                        calls,
                        staging,
                        put - calls - (staging or 0.0),
                        get,
                        lookup,
                        load,
                        get - lookup - load,
                    ]
                label = LABELS[name].split(" (")[0].split(" `")[0]
                out.append(f"| {label}, {kind.name} | " + " | ".join("-" if c is None else ms(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=16, help="objects per batch, of each kind (default 16)")
    parser.add_argument(
        "--r3-request-objects",
        type=int,
        default=128,
        help="R3 objects of the second R3 batch (default 128: one 32k-token request)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="measured repeats per path (default 5)")
    parser.add_argument("--write", action="store_true", help=f"replace the '{SECTION}' section of {DOCS.name}")
    args = parser.parse_args()
    if min(args.objects, args.r3_request_objects, args.repeats) < 1:
        parser.error("--objects, --r3-request-objects and --repeats must be at least 1")
    exit_on_sigterm()
    os.environ.update(TELEMETRY_OFF)
    os.environ.update(MOONCAKE_ENV)  # this process's Mooncake clients stay on loopback too
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).setLevel(logging.WARNING)
    command = " ".join(["python bench/bench_tiers.py", *sys.argv[1:]])
    for name, operation in MOONCAKE_NATIVE.items():
        INNER.wrap(mooncake_store, name, operation)
    INNER.wrap(mooncake_store.MooncakeObjectStore, "_stage", MOONCAKE_STAGING)

    kv_bytes = args.objects * 2 * KV_LAYERS * CHUNK * KV_HEADS * HEAD_DIM * 2
    segment_mb = max(256, 3 * kv_bytes // 2**20 + 64)  # one tier batch + one raw batch + room below eviction
    workdir = Path(tempfile.mkdtemp(prefix="lmcache_r3-bench-tiers-"))
    # Mooncake's default read lease: under the tests' 200 ms, a batch_get_into of a few tens of MiB can outlive its
    # lease on this machine and answer LEASE_EXPIRED.
    cluster = start_mooncake(workdir, segment=f"{segment_mb}MB", lease_ms=None)
    results: dict[str, dict[str, Figures]] = {}
    kinds: list[Kind] = []
    try:
        makers = (
            lambda: kv_kind(args.objects),
            lambda: r3_kind(args.objects),
            lambda: r3_kind(args.r3_request_objects, f"R3 x{args.r3_request_objects}"),
        )
        for make in makers:
            kind = make()
            samples, instrumented, batch_bytes = measure(
                kind, cluster, args.repeats * (R3_REPEATS if kind.name == "R3" else 1)
            )
            results[kind.name] = {name: figures(kind, samples[name], instrumented.get(name, [])) for name in PATHS}
            kind.source = kind.source[:0]  # the report needs only the sizes
            kinds.append(kind)
    except BenchFailure as failure:
        print(f"FAILED: {failure}\nMooncake logs: {workdir}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    shutil.rmtree(workdir, ignore_errors=True)

    text = report(command, args, kinds, results, batch_bytes)
    print(text)
    if args.write:
        write_section(SECTION, text)
        print(f"updated {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
