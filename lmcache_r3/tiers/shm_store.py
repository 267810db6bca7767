"""A same-host object store: a trusted directory of immutable, self-checking objects, normally under /dev/shm.

An *object* is an opaque byte string stored under an opaque byte *key*. Once published an object never changes: a
second ``put`` of the same key is a no-op that returns ``False`` (the first writer wins), and the only ways an object
goes away are ``delete``, LRU eviction, the TTL sweep, or a failed checksum. Several stores - in one process or in
several - may open the same root; they agree on what is stored because the directory *is* the store, and each keeps
only its own in-memory accounting (sizes and recency) on top of it.

Layout of a root (owned by the current user, mode 0700, not a symlink)::

    ROOT/.tmp-<pid>-<n>-<random>         a write in progress (unlinked after publish)
    ROOT/<shard>/<name>                  one object, mode 0600
    ROOT/.free/<size>-<pid>-<n>-<random> a removed object's file, kept to be rewritten by a later put

* ``name`` is the key in lowercase base32 without padding (alphabet ``a-z2-7``): it is injective, cannot contain
  ``/``, ``.`` or NUL, so it can neither collide nor escape the root. Keys are 1..``MAX_KEY_BYTES`` (155) bytes,
  so names stay at most 248 characters, under NAME_MAX (255).
* ``shard`` is two hex digits from XXH3-64 of the key (256 directories), so keys sharing a long prefix (the same
  model name, say) still spread evenly and no directory grows too large to scan.
* a file is a 32-byte header followed by the payload. The header holds a magic, a format version, the payload
  length, the XXH3-64 of the payload *seeded with the XXH3-64 of the key* (so a file can only ever pass as the
  object of its own key), and the XXH3-64 of the header fields before it. Every ``get`` checks all of them; any
  mismatch, short or long file is a *corrupt* object: counted, removed, and answered as a miss.

Publishing writes a temp file (``O_EXCL``, 0600) in the root and renames it to its final name with
``renameat2(RENAME_NOREPLACE)`` (where the kernel or file system lacks that flag: a hard link, then an unlink of the
temp name): it fails with ``EEXIST`` when another writer got there first, and a reader can only ever open a complete
file. There is no
``fsync`` by default: tmpfs has no disk to sync to, and this store survives server restarts, not host reboots (which
empty /dev/shm anyway); pass ``durable=True`` on a disk-backed root.

Recycling. On tmpfs, writing a new file costs the kernel a page allocation and a zeroing per 4 KiB before the copy
(about 2 GB/s here); rewriting pages a file already has is a plain copy (about 8 GB/s). So an object removed by
``delete`` or the TTL sweep is not unlinked but renamed into ``ROOT/.free`` (atomically: it leaves its name at
once), and a later ``put`` of an object of the same file size claims it by renaming it to its temp name, rewrites
it in place and publishes it as usual. A reader that opened the file before it was removed can see it rewritten under
it; the key-seeded checksum makes that a miss (counted as ``raced``), never another object's bytes. The free files
count against the capacity (``used + pooled <= capacity_bytes``), are bounded by ``recycle_bytes`` (default: the
capacity; 0 turns recycling off), and are the first thing dropped when a put needs room; a store adopts the free
files under its root when it opens.

Capacity is counted in file bytes (header included) and enforced by evicting the least recently used objects this
store knows of (recency is kept in memory and updated by ``put`` and ``get``). Opening a store scans the root, so a
new store serves what is there, with recency seeded from file mtimes. With several stores on one root each enforces
its capacity over its own view; an object another store evicted is simply a miss. The TTL is the age since
publication (file mtime), so every store on a root agrees on it: ``sweep_expired`` removes objects published more
than ``ttl_seconds`` ago.

Example::

    store = ShmObjectStore("/dev/shm/lmcache_r3", capacity_bytes=8 << 30, ttl_seconds=3600)
    store.put(b"chunk-1", payload)      # True: published
    store.put(b"chunk-1", payload)      # False: already present
    store.get(b"chunk-1") == payload    # True; None for a miss or a corrupt object
"""

from __future__ import annotations

import base64
import ctypes
import errno
import itertools
import logging
import os
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import xxhash

from lmcache_r3.tiers.holds import UNHELD, BuffersGone, CallerBuffers

logger = logging.getLogger(__name__)

MAX_KEY_BYTES = 155
"""Longest key accepted: its base32 name (248 characters) stays under NAME_MAX = 255."""

HEADER = struct.Struct("<4sHHQQQ")
"""magic, format version, reserved (0), payload length, XXH3-64 of the payload, XXH3-64 of the preceding 24 bytes."""

MAGIC = b"R3OB"
FORMAT_VERSION = 1
ROOT_MODE = 0o700
OBJECT_MODE = 0o600
TEMP_PREFIX = ".tmp-"
FREE_DIR = ".free"
STALE_TEMP_SECONDS = 600.0
"""A temp file untouched this long is left over from a crashed writer and removed (when a store opens, and by
:meth:`ShmObjectStore.tidy`); the free files of a process that is gone, free this long, are adopted by a tidying
store."""

_PID = [os.getpid()]
"""This process's id, for file names (``os.getpid`` is a system call each time); set again in a forked child."""
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))

_HEADER_BODY = struct.Struct("<4sHHQQ")
_SHARD_NAMES = frozenset(f"{shard:02x}" for shard in range(256))
_READ_CHUNK = 1 << 30


class ShmStoreError(Exception):
    """Base class of every error this store raises."""


class UntrustedRootError(ShmStoreError):
    """The root directory cannot be trusted (symlink, not a directory, foreign owner, wrong mode) or created."""


class InvalidKeyError(ShmStoreError, ValueError):
    """A key that is not bytes, is empty, or is longer than ``MAX_KEY_BYTES``."""


class ObjectTooLargeError(ShmStoreError, ValueError):
    """An object that cannot fit in the store's capacity even when everything else is evicted."""


class BufferTooSmallError(ShmStoreError, ValueError):
    """``get_into`` was given a buffer shorter than the stored payload."""


def object_name(key: bytes) -> str:
    """The file name of ``key``: lowercase base32 without padding, e.g. ``b"ab"`` -> ``"mfra"``.

    Raises:
        InvalidKeyError: ``key`` is not bytes, is empty, or is longer than ``MAX_KEY_BYTES``.
    """
    if not isinstance(key, bytes | bytearray):
        raise InvalidKeyError(f"object key must be bytes, got {type(key).__name__}; encode it first")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise InvalidKeyError(
            f"object key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}; hash a longer key down to fewer bytes"
        )
    return base64.b32encode(key).decode("ascii").rstrip("=").lower()


def key_of_name(name: str) -> bytes | None:
    """The key whose ``object_name`` is ``name``, or None when ``name`` is not one (a temp file, a stray file)."""
    if not name or len(name) > 255 or not name.isascii() or not name.isalnum() or name != name.lower():
        return None
    try:
        key = base64.b32decode(name.upper() + "=" * (-len(name) % 8))
    except ValueError:
        return None
    # base32 without padding lets trailing bits vary; only the canonical spelling names an object.
    if not 0 < len(key) <= MAX_KEY_BYTES or object_name(key) != name:
        return None
    return key


def shard_of(key: bytes) -> str:
    """The subdirectory holding ``key``: two hex digits of its XXH3-64, so similar keys still spread evenly."""
    return f"{xxhash.xxh3_64_intdigest(key) & 0xFF:02x}"


def encode_header(payload_length: int, payload_digest: int) -> bytes:
    """The 32-byte header of a payload of ``payload_length`` bytes whose XXH3-64 is ``payload_digest``."""
    body = _HEADER_BODY.pack(MAGIC, FORMAT_VERSION, 0, payload_length, payload_digest)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def key_seed(key: bytes) -> int:
    """The seed of ``key``'s payload checksum: its XXH3-64."""
    return xxhash.xxh3_64_intdigest(key)


def decode_header(header: bytes) -> tuple[int, int] | None:
    """``(payload_length, payload_digest)`` of a valid header, else None (wrong magic, version or checksum)."""
    if len(header) != HEADER.size:
        return None
    magic, version, reserved, length, digest, header_digest = HEADER.unpack(header)
    if magic != MAGIC or version != FORMAT_VERSION or reserved != 0:
        return None
    if xxhash.xxh3_64_intdigest(header[: _HEADER_BODY.size]) != header_digest:
        return None
    return length, digest


def open_trusted_root(root: str | os.PathLike[str]) -> Path:
    """Create ``root`` (mode 0700) if missing, then check it is a directory we own with mode exactly 0700.

    Raises:
        UntrustedRootError: naming the path, what is wrong and how to fix it.
    """
    path = Path(os.path.abspath(root))
    try:
        os.makedirs(path.parent, exist_ok=True)
        os.mkdir(path, ROOT_MODE)
        os.chmod(path, ROOT_MODE)  # mkdir's mode is reduced by the umask
    except FileExistsError:
        pass
    except OSError as err:
        raise UntrustedRootError(
            f"shm store root {path}: cannot create it ({err.strerror}); create it with "
            f"`mkdir -m 700 {path}` or choose a writable root"
        ) from err
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedRootError(
            f"shm store root {path} is a symlink to {os.readlink(path)}; a symlinked root is refused because whoever "
            f"controls the link controls where objects go. Use the real directory as the root, or choose another root"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedRootError(f"shm store root {path} exists but is not a directory; choose another root")
    if info.st_uid != os.getuid():
        raise UntrustedRootError(
            f"shm store root {path} is owned by uid {info.st_uid}, not by this process (uid {os.getuid()}); "
            f"another user could read or plant objects. Run `chown {os.getuid()} {path}` or choose another root"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode != ROOT_MODE:
        raise UntrustedRootError(
            f"shm store root {path} has mode {mode:#o}, expected exactly {ROOT_MODE:#o} so that no other user can "
            f"read or plant objects. Run `chmod 700 {path}` or choose another root"
        )
    return path


def file_system_type(path: str | os.PathLike[str]) -> str | None:
    """The type of the file system holding ``path`` (``"tmpfs"``, ``"ext4"``, ...) from /proc/self/mountinfo, or
    None when it cannot be told."""
    try:
        dev = os.stat(path).st_dev
        wanted = f"{os.major(dev)}:{os.minor(dev)}"
        found = None
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) > 3 and fields[2] == wanted and "-" in fields:
                    found = fields[fields.index("-") + 1]  # the last mount of the device is the one on top
        return found
    except (OSError, IndexError):
        return None


class ShmObjectStore:
    """Immutable objects as checksummed files under a trusted root, with LRU capacity and a TTL (see the module).

    Thread-safe: file operations need no lock (publication is atomic), the in-memory accounting has one.

    Args:
        root: the directory; created with mode 0700 if missing.
        capacity_bytes: most file bytes (headers included) this store keeps before evicting least recently used.
        ttl_seconds: ``sweep_expired`` removes objects published longer ago than this; None keeps them forever.
        durable: ``fsync`` each object before publishing it (useful only on a disk-backed root).
        recycle_bytes: most bytes of removed objects' files kept for rewriting (see "Recycling"); None: the
            capacity, 0: none.

    Raises:
        UntrustedRootError: the root is a symlink, not a directory, not ours, or not mode 0700.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        ttl_seconds: float | None = None,
        durable: bool = False,
        recycle_bytes: int | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}; give the tier a size in bytes")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0 or None (no expiry), got {ttl_seconds}")
        if recycle_bytes is not None and recycle_bytes < 0:
            raise ValueError(f"recycle_bytes must be >= 0 (0: none) or None (the capacity), got {recycle_bytes}")
        self.root = open_trusted_root(root)
        self.on_tmpfs = file_system_type(self.root) == "tmpfs"
        """Whether the root is in memory (tmpfs): its calls are memory copies and cannot stall on a device."""
        self.capacity_bytes = capacity_bytes
        self.ttl_seconds = ttl_seconds
        self.durable = durable
        self.recycle_bytes = capacity_bytes if recycle_bytes is None else min(recycle_bytes, capacity_bytes)
        self._lock = threading.Lock()
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        """File size of every object this store knows of, least recently used first."""
        self._used = 0
        self._root = str(self.root)
        self._free = os.path.join(self._root, FREE_DIR)
        self._pool: OrderedDict[str, int] = OrderedDict()
        """Size of every free file this store knows of under ``ROOT/.free``, oldest first."""
        self._pool_by_size: dict[int, dict[str, None]] = {}
        self._pooled = 0
        self._temp_ids = itertools.count()
        self._name_token = os.urandom(8).hex()
        self._stats = dict.fromkeys(
            (
                "hits",
                "misses",
                "corrupt",
                "raced",
                "bytes_written",
                "bytes_read",
                "evictions",
                "expired",
                "recycled",
            ),
            0,
        )
        self._remove_stale_temps()
        self.rescan()
        self._adopt_free_files()

    # -- objects ---------------------------------------------------------------------------------------------------

    def put(self, key: bytes, data: bytes | bytearray | memoryview, buffers: CallerBuffers = UNHELD) -> bool:
        """Publish ``data`` under ``key``; True if this call published it, False if the key was already present.

        ``data`` is read (checksummed and copied) under one hold of ``buffers``.

        Raises:
            BuffersGone: the hold was refused; nothing was read or published.
            InvalidKeyError: see ``object_name``.
            ObjectTooLargeError: the object alone exceeds ``capacity_bytes``.
            OSError: the root is full or unwritable.
        """
        key = _key_bytes(key)
        path = self._path(key)
        payload = memoryview(data).cast("B")
        file_size = HEADER.size + payload.nbytes
        if file_size > self.capacity_bytes:
            raise ObjectTooLargeError(
                f"object of {payload.nbytes} bytes (+{HEADER.size} header) exceeds the shm store capacity of "
                f"{self.capacity_bytes} bytes; raise capacity_bytes or store smaller chunks"
            )
        if self._adopt_existing(key, path):
            return False
        temp = f"{self._root}/{self._unique_name(TEMP_PREFIX)}"
        recycled = self._make_room(file_size, keep=key, claim_as=temp)  # reserves file_size, given back below
        reserved, published = True, False
        try:
            fd = _open_temp(temp, recycled)
            try:
                # An evicted object's file has the size this store counted for it, unless another store replaced the
                # object since with one of another size (and a free file could have been retired in such a race).
                if recycled and os.fstat(fd).st_size != file_size:
                    os.ftruncate(fd, file_size)
                if not buffers.hold():
                    raise BuffersGone("the task was failed; its buffers are no longer the tier's to read")
                try:
                    digest = xxhash.xxh3_64_intdigest(payload, key_seed(key))
                    write_all(fd, memoryview(encode_header(payload.nbytes, digest)), payload)
                finally:
                    buffers.release()
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                publish(temp, path)
            except FileExistsError:
                self._adopt_existing(key, path)
                return False
            published = True
            with self._lock:  # counted before the reservation goes: never under the capacity's view
                self._stats["bytes_written"] += payload.nbytes
                self._stats["recycled"] += recycled
                self._count_use(key, file_size)
                self._used -= file_size
                reserved = False
            return True
        finally:
            if reserved:
                with self._lock:
                    self._used -= file_size
            if not published:
                _unlink_quietly(temp)

    def get(self, key: bytes) -> bytes | None:
        """The payload stored under ``key``, or None for a miss (absent, evicted, expired or corrupt)."""
        return self._read_object(key, _read_payload)

    def get_into(self, key: bytes, buffer: bytearray | memoryview, buffers: CallerBuffers = UNHELD) -> int | None:
        """Read the payload of ``key`` into the start of ``buffer`` (no intermediate copy); its length, or None.

        One ``readv`` takes the header, the payload and one byte more (which must find the file's end). On None the
        first bytes of ``buffer`` may have been overwritten with data that failed its checks. ``buffer`` is written
        and checksummed under one hold of ``buffers``.

        Raises:
            BuffersGone: the hold was refused; ``buffer`` was not touched.
            BufferTooSmallError: ``buffer`` is shorter than the payload of an intact-sized object (``buffer`` was
                overwritten with its start; the object stays).
        """
        target = memoryview(buffer).cast("B")
        if target.readonly:
            raise TypeError("get_into needs a writable buffer (bytearray, writable memoryview, numpy array)")

        def read(fd: int, key: bytes) -> tuple[int, int]:
            header = bytearray(HEADER.size)
            if not buffers.hold():
                raise BuffersGone("the task was failed; its buffers are no longer the tier's to write")
            try:
                views = [memoryview(header), target, memoryview(bytearray(1))]
                count = os.readv(fd, views)
                if count != HEADER.size + _declared_length(header):  # a short read or a file of the wrong size
                    count += _read_fully(fd, unwritten(views, count))
                decoded = decode_header(header)
                if decoded is None:
                    raise _Corrupt
                length, digest = decoded
                if length > target.nbytes and os.fstat(fd).st_size == HEADER.size + length:
                    raise BufferTooSmallError(
                        f"object of {length} bytes does not fit the {target.nbytes}-byte buffer given to get_into; "
                        f"pass a buffer of at least {length} bytes"
                    )
                if count != HEADER.size + length:
                    raise _Corrupt  # the file is shorter or longer than its header says
                intact = xxhash.xxh3_64_intdigest(target[:length], key_seed(key)) == digest
            finally:
                buffers.release()
            if not intact:
                raise _Corrupt
            return length, length

        return self._read_object(key, read)

    def _read_object(self, key: bytes, read):
        """Open ``key``'s file and return what ``read(fd, key)`` gives as ``(payload_length, result)``, having
        verified the object (raising ``_Corrupt`` otherwise); None for a miss or a corrupt object (counted and
        removed)."""
        key = _key_bytes(key)
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return self._miss(key)
        try:
            length, result = read(fd, key)
            self._hit(key, length)
            return result
        except _Corrupt:
            return self._corrupt(key, path, fd)
        finally:
            os.close(fd)

    def prepare(self, keys: list[bytes]) -> None:
        """Work out the file names of ``keys`` at once, ahead of the calls that use them (much faster for a batch
        than one by one); optional. Raises InvalidKeyError for an invalid key."""
        missing = [key for key in map(_key_bytes, keys) if key not in _PATHS]
        if missing:
            for key, name in zip(missing, object_names(missing), strict=True):
                _remember(key, name)

    def exists(self, key: bytes) -> bool:
        """Whether an object is published under ``key`` (its checksum is checked only when it is read)."""
        return os.access(self._path(_key_bytes(key)), os.F_OK)

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove the objects of ``keys``; the number removed. Never raises: missing or invalid keys are skipped."""
        removed = 0
        for key in keys:
            try:
                key = _key_bytes(key)
                self._forget(key)  # first, so the file's bytes are free for the free files
                removed += self._retire(self._path(key))
            except (OSError, ShmStoreError):
                pass
        return removed

    def keys(self) -> Iterator[bytes]:
        """Every key published under the root, by any store, in directory order."""
        for shard, name in self._object_names():
            key = key_of_name(name)
            if key is not None and shard_of(key) == shard:
                yield key

    # -- capacity, expiry, reporting -------------------------------------------------------------------------------

    def usage(self) -> tuple[int, int]:
        """``(used_bytes, capacity_bytes)`` in file bytes, over the objects this store knows of."""
        with self._lock:
            return self._used, self.capacity_bytes

    def pooled_bytes(self) -> int:
        """Bytes of the free files this store keeps for rewriting (they count against the capacity)."""
        with self._lock:
            return self._pooled

    def stats(self) -> dict[str, int]:
        """Counters since open: hits, misses, corrupt, raced (a read overtaken by a removal: a miss), bytes_written,
        bytes_read (payload bytes), evictions, expired, recycled (puts that rewrote a free file)."""
        with self._lock:
            return dict(self._stats)

    def sweep_expired(self, now: float | None = None) -> int:
        """Remove objects published more than ``ttl_seconds`` before ``now`` (wall clock, default time.time()).

        Walks the whole root, so objects published by other stores expire too. Returns the number removed.
        """
        if self.ttl_seconds is None:
            return 0
        deadline = (time.time() if now is None else now) - self.ttl_seconds
        removed = 0
        for shard, name in self._object_names():
            key = key_of_name(name)
            if key is None:
                continue
            path = self.root / shard / name
            try:
                if os.stat(path).st_mtime >= deadline:
                    continue
                self._forget(key)
                removed += self._retire(path)
            except FileNotFoundError:
                self._forget(key)
        with self._lock:
            self._stats["expired"] += removed
        return removed

    def rescan(self) -> None:
        """Rebuild the accounting from the root: every object, by size, least recently modified first."""
        found = []
        for shard, name in self._object_names():
            key = key_of_name(name)
            if key is None or shard_of(key) != shard:
                continue
            try:
                info = os.stat(self.root / shard / name)
            except FileNotFoundError:
                continue
            found.append((info.st_mtime, key, info.st_size))
        found.sort()
        with self._lock:
            self._sizes = OrderedDict((key, size) for _, key, size in found)
            self._used = sum(self._sizes.values())

    # -- internals -------------------------------------------------------------------------------------------------

    def _path(self, key: bytes) -> str:
        """The file of ``key`` (bytes, already checked by ``_key_bytes``)."""
        return f"{self._root}/{_relative_path(key)}"

    def _object_names(self) -> Iterator[tuple[str, str]]:
        with os.scandir(self.root) as shards:
            shard_names = [entry.name for entry in shards if entry.name in _SHARD_NAMES]
        for shard in shard_names:
            try:
                with os.scandir(self.root / shard) as entries:
                    names = [entry.name for entry in entries]
            except FileNotFoundError:
                continue
            for name in names:
                yield shard, name

    def tidy(self) -> None:
        """Clear what crashed writers and departed stores left on the root while this store runs: temp files untouched
        for ``STALE_TEMP_SECONDS``, and the free files of stores whose process is gone, free that long (adopted within
        this store's recycling budget; the rest are left to a store that opens, which adopts or removes every one)."""
        self._remove_stale_temps()
        self._adopt_free_files(tidying=True)

    def _remove_stale_temps(self) -> None:
        # ctime, not mtime: a free file claimed for a put keeps its old mtime until the put rewrites it, while the
        # rename to its temp name sets its ctime.
        deadline = time.time() - STALE_TEMP_SECONDS
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.startswith(TEMP_PREFIX):
                    try:
                        if entry.stat(follow_symlinks=False).st_ctime < deadline:
                            os.unlink(entry.path)
                    except FileNotFoundError:
                        pass

    def _make_room(self, incoming: int, keep: bytes, claim_as: str) -> bool:
        """Make room for a file of ``incoming`` bytes and reserve them in ``_used`` until the put ends (concurrent puts
        then make room for each other); True when a file of that size now sits at ``claim_as``.

        The file comes from the free files if one has the size, else from an evicted object of that size. Room is
        made by dropping free files first (oldest first), then by evicting the least recently used objects.
        """
        claimed = self._claim_free(incoming, claim_as)
        free_files, victims = [], []
        with self._lock:
            while self._used + self._pooled + incoming > self.capacity_bytes and self._pool:
                name, size = self._pool.popitem(last=False)
                self._unpool(name, size)
                free_files.append(name)
            while self._used + incoming > self.capacity_bytes and self._sizes:
                key, size = self._sizes.popitem(last=False)
                if key == bytes(keep):
                    self._sizes[key] = size
                    if len(self._sizes) == 1:
                        break
                    continue
                self._used -= size
                victims.append((key, size))
            self._used += incoming
        try:
            return self._drop(free_files, victims, incoming, claim_as, claimed)
        except BaseException:
            with self._lock:
                self._used -= incoming
            raise
        finally:
            if victims:  # counted once their files are gone: a reconciliation that sees the count finds them gone
                with self._lock:
                    self._stats["evictions"] += len(victims)

    def _drop(self, free_files: list[str], victims: list[tuple[bytes, int]], incoming: int, claim_as: str,
              claimed: bool) -> bool:  # fmt: skip
        """Unlink ``free_files`` and the ``victims``' files, or rename one victim of ``incoming`` bytes to
        ``claim_as`` unless a file was ``claimed`` already; whether one sits there now."""
        for name in free_files:
            _unlink_quietly(os.path.join(self._free, name))
        for key, size in victims:
            path = self._path(key)
            if not claimed and size == incoming:
                try:
                    os.rename(path, claim_as)  # the victim's file becomes the new object's
                    claimed = True
                    continue
                except FileNotFoundError:
                    continue
            _unlink_quietly(path)
        return claimed

    # -- free files ------------------------------------------------------------------------------------------------

    def _claim_free(self, size: int, claim_as: str) -> bool:
        """Rename a free file of exactly ``size`` bytes to ``claim_as``; False when this store knows of none."""
        while True:
            with self._lock:
                names = self._pool_by_size.get(size)
                if not names:
                    return False
                name = next(iter(names))
                del self._pool[name]
                self._unpool(name, size)
            try:
                os.rename(os.path.join(self._free, name), claim_as)
                return True
            except FileNotFoundError:
                continue  # another store on this root claimed it first

    def _retire(self, path: str) -> int:
        """Take the object at ``path`` out of the store: into the free files if they have room, else unlinked.

        Returns 1 if this call removed it, 0 if it was already gone.
        """
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return 0
        with self._lock:
            keep = self._pool_has_room(size)
            if keep:
                # Counted before the rename, so concurrent retires stay in budget, but claimable only after it: a put
                # that claimed the name first would find no file and the rename would land one nobody counts.
                self._pooled += size
        if not keep:
            try:
                os.unlink(path)
                return 1
            except FileNotFoundError:
                return 0
        name = self._unique_name(f"{size}-")
        try:
            os.rename(path, os.path.join(self._free, name))
        except BaseException as err:
            with self._lock:
                self._pooled -= size
            if isinstance(err, FileNotFoundError):
                return 0
            raise
        with self._lock:
            self._pool_file(name, size, counted=True)
        return 1

    def _adopt_free_files(self, tidying: bool = False) -> None:
        """Know the free files under the root (left by this or another store), within the budget; drop the rest.

        ``tidying``: only files of stores whose process is gone (the pid in the name), free for ``STALE_TEMP_SECONDS``
        (their ctime) and unknown to this store; none is removed (another store may count it).
        """
        os.makedirs(self._free, mode=ROOT_MODE, exist_ok=True)
        deadline = time.time() - STALE_TEMP_SECONDS
        with os.scandir(self._free) as entries:
            found = []
            for entry in entries:
                size_text, _, rest = entry.name.partition("-")
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if tidying and (entry.name in self._pool or info.st_ctime >= deadline or _alive(rest)):
                    continue
                if stat.S_ISREG(info.st_mode) and size_text.isdigit() and int(size_text) == info.st_size:
                    found.append((info.st_mtime, entry.name, info.st_size))
                elif not tidying:
                    _unlink_quietly(entry.path)
        found.sort()
        dropped = []
        with self._lock:
            for _, name, size in found:
                if self._pool_has_room(size):
                    self._pool_file(name, size)
                elif not tidying:
                    dropped.append(name)
        for name in dropped:
            _unlink_quietly(os.path.join(self._free, name))

    def _pool_has_room(self, size: int) -> bool:
        """Whether a free file of ``size`` bytes fits the recycling budget and the capacity (the caller holds the
        lock)."""
        return self._pooled + size <= self.recycle_bytes and self._used + self._pooled + size <= self.capacity_bytes

    def _unique_name(self, prefix: str) -> str:
        """``<prefix><pid>-<n>-<random>``: unique among every store on the root (temp files and free files); the
        random part is the store's own, drawn once (the pid tells apart the stores of forked processes)."""
        return f"{prefix}{_PID[0]}-{next(self._temp_ids)}-{self._name_token}"

    def _pool_file(self, name: str, size: int, counted: bool = False) -> None:
        """Know a free file, claimable from now on; ``counted``: its bytes are in ``_pooled`` already (the caller
        holds the lock)."""
        self._pool[name] = size
        self._pool_by_size.setdefault(size, {})[name] = None
        if not counted:
            self._pooled += size

    def _unpool(self, name: str, size: int) -> None:
        """Stop counting a free file already popped from ``_pool`` (the caller holds the lock)."""
        names = self._pool_by_size[size]
        del names[name]
        if not names:
            del self._pool_by_size[size]
        self._pooled -= size

    def _adopt_existing(self, key: bytes, path: str) -> bool:
        if not os.access(path, os.F_OK):  # no exception for the usual answer: a miss
            return False
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return False
        self._touch(key, size)
        return True

    def _touch(self, key: bytes, size: int) -> None:
        with self._lock:
            self._count_use(key, size)

    def _count_use(self, key: bytes, size: int) -> None:
        """Count ``key`` at ``size`` file bytes as the most recently used object (the caller holds the lock)."""
        previous = self._sizes.pop(key, None)
        if previous is not None:
            self._used -= previous
        self._sizes[key] = size
        self._used += size

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._used -= size

    def _hit(self, key: bytes, length: int) -> None:
        with self._lock:
            self._stats["hits"] += 1
            self._stats["bytes_read"] += length
            self._count_use(key, HEADER.size + length)

    def _miss(self, key: bytes) -> None:
        with self._lock:
            self._stats["misses"] += 1
        self._forget(key)
        return None

    def _corrupt(self, key: bytes, path: str, fd: int) -> None:
        opened = os.fstat(fd)
        raced = present = False
        try:
            current = os.stat(path)
            if (current.st_dev, current.st_ino) != (opened.st_dev, opened.st_ino):
                raced = True
            else:
                raced = present = self._intact_now(key, path)
        except FileNotFoundError:
            raced = True
        # A file no longer at its path was removed (and maybe rewritten) while we read it: a miss, not damage. Another
        # store may also have replaced a corrupt file with a good one: remove only what we read. The same file can be
        # back at the path: removed into the free files, reused for a put of this key and published again while we
        # read it; then it reads intact now, and is kept.
        if not raced:
            _unlink_quietly(path)
        with self._lock:
            self._stats["raced" if raced else "corrupt"] += 1
            self._stats["misses"] += 1
        if not present:
            self._forget(key)
        return None

    @staticmethod
    def _intact_now(key: bytes, path: str) -> bool:
        """Whether the object at ``path`` reads intact now (or cannot be read at all: it is then not known to be
        damaged, and stays); only after a read of it failed."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return True
        try:
            _read_payload(fd, key)
            return True
        except _Corrupt:
            return False
        except OSError:
            return True
        finally:
            os.close(fd)


def _alive(name_rest: str) -> bool:
    """Whether the process named by a free or temp file name's ``<pid>-...`` still runs (in this pid namespace; a
    name without a pid counts as alive, so its file is left alone)."""
    pid_text = name_rest.partition("-")[0]
    if not pid_text.isdigit():
        return True
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _key_bytes(key: bytes) -> bytes:
    """``key`` as ``bytes``. Raises InvalidKeyError for a key of another type (its length is checked by its name)."""
    if type(key) is bytes:
        return key
    if isinstance(key, bytearray):
        return bytes(key)
    raise InvalidKeyError(f"object key must be bytes, got {type(key).__name__}; encode it first")


class _Corrupt(Exception):
    """Internal: the object just read failed a check."""


def _read_bytes(fd: int, length: int) -> bytes:
    """The next ``length`` bytes of ``fd``; a short file is corrupt."""
    chunks = []
    remaining = length
    while remaining:
        chunk = os.read(fd, min(remaining, _READ_CHUNK))
        if not chunk:
            raise _Corrupt
        chunks.append(chunk)
        remaining -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _declared_length(header: bytearray) -> int:
    """The payload length a header claims, unchecked."""
    return HEADER.unpack_from(header)[3]


def _read_payload(fd: int, key: bytes) -> tuple[int, bytes]:
    """``(length, payload)`` of the object open at ``fd``, its header and checksum verified (``_Corrupt`` if not)."""
    decoded = decode_header(os.read(fd, HEADER.size))
    if decoded is None or os.fstat(fd).st_size != HEADER.size + decoded[0]:
        raise _Corrupt
    length, digest = decoded
    payload = _read_bytes(fd, length)
    if xxhash.xxh3_64_intdigest(payload, key_seed(key)) != digest:
        raise _Corrupt
    return length, payload


def _read_fully(fd: int, views: list) -> int:
    """Fill ``views`` in order from ``fd`` with as few ``readv`` calls as the file allows (one, normally); the bytes
    read, fewer than the views hold only when the file ended first."""
    left = [memoryview(view).cast("B") for view in views]
    total = 0
    while left:
        count = os.readv(fd, left)
        if count == 0:
            break
        total += count
        left = unwritten(left, count)
    return total


_PATHS: dict[bytes, str] = {}
"""``<shard>/<name>`` of recently used keys (base32 is slow in Python, and a key is looked up many times)."""
_PATHS_MAX = 1 << 16
_B32_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz234567", dtype=np.uint8)
_B32_WEIGHTS = np.array([16, 8, 4, 2, 1], dtype=np.uint8)


def _relative_path(key: bytes) -> str:
    path = _PATHS.get(key)
    if path is None:
        path = _remember(key, object_name(key))
    return path


def _remember(key: bytes, name: str) -> str:
    if len(_PATHS) >= _PATHS_MAX:
        _PATHS.clear()  # atomic, unlike evicting one entry while other threads add theirs
    path = _PATHS[key] = f"{shard_of(key)}/{name}"
    return path


def object_names(keys: list[bytes]) -> list[str]:
    """``[object_name(key) for key in keys]``, computed for all keys of one length at once (numpy)."""
    by_length: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        if not isinstance(key, bytes | bytearray) or not 0 < len(key) <= MAX_KEY_BYTES:
            object_name(key)  # raises InvalidKeyError, saying what is wrong
        by_length.setdefault(len(key), []).append(i)
    names: list[str] = [""] * len(keys)
    for length, indices in by_length.items():
        rows = np.frombuffer(b"".join(keys[i] for i in indices), dtype=np.uint8).reshape(len(indices), length)
        bits = np.unpackbits(rows, axis=1)
        chars = -(-length * 8 // 5)
        if chars * 5 != length * 8:
            bits = np.pad(bits, ((0, 0), (0, chars * 5 - length * 8)))
        text = _B32_ALPHABET[bits.reshape(len(indices), chars, 5) @ _B32_WEIGHTS].tobytes().decode("ascii")
        for row, i in enumerate(indices):
            names[i] = text[row * chars : (row + 1) * chars]
    return names


def _open_temp(temp: str, recycled: bool) -> int:
    """Open the temp file a put writes: the free file renamed there (``recycled``), or a new file.

    A free file keeps its old mtime until the put's write sets it (the object's publication time, which the TTL
    reads); the rename that claimed it set its ctime, which is what tells a crashed writer's leftover temp file.
    """
    if recycled:
        return os.open(temp, os.O_WRONLY | os.O_CLOEXEC)
    return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, OBJECT_MODE)


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
"""glibc's ``renameat2`` (2.28 and later), or None; Python's ``os`` has no call for it."""
if _renameat2 is not None:
    _renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    _renameat2.restype = ctypes.c_int
_NOREPLACE_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.ENOTSUP)
"""What ``renameat2`` answers where the kernel, the file system or a seccomp filter does not offer
``RENAME_NOREPLACE``: publication then falls back to ``link`` + ``unlink``."""


def publish(temp: str, path: str) -> None:
    """Give the complete file at ``temp`` the name ``path`` unless that name exists (``FileExistsError``), creating the
    shard directory the first time it is needed. One ``renameat2(RENAME_NOREPLACE)``, else ``link`` then ``unlink`` of
    ``temp``: either way a reader finds the whole file at ``path`` or nothing, and the first writer wins."""
    try:
        _publish_once(temp, path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), mode=ROOT_MODE, exist_ok=True)
        _publish_once(temp, path)


def _publish_once(temp: str, path: str) -> None:
    global _renameat2
    rename = _renameat2
    if rename is not None:
        if rename(_AT_FDCWD, os.fsencode(temp), _AT_FDCWD, os.fsencode(path), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in _NOREPLACE_UNSUPPORTED:
            raise OSError(code, os.strerror(code), temp, None, path)  # EEXIST: FileExistsError, ENOENT: ...NotFound
        _renameat2 = None
        logger.info("shm store: renameat2(RENAME_NOREPLACE) unavailable (%s); publishing with link", os.strerror(code))
    os.link(temp, path)
    _unlink_quietly(temp)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_all(fd: int, *parts: memoryview) -> None:
    """Write every byte of ``parts``, in order, with as few ``writev`` calls as the kernel allows (one, normally)."""
    views = unwritten(list(parts), 0)
    while views:
        views = unwritten(views, os.writev(fd, views))


def unwritten(views: list[memoryview], written: int) -> list[memoryview]:
    """What is left of ``views`` after a write of ``written`` bytes took their start (empty views dropped)."""
    left = []
    for view in views:
        if written >= view.nbytes:
            written -= view.nbytes
            continue
        left.append(view[written:] if written else view)
        written = 0
    return left
