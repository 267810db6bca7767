"""The same-host object store: what it serves is byte-equal or a miss, never torn, never from an untrusted root."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_r3.tiers.holds import BuffersGone, CallerBuffers
from lmcache_r3.tiers.shm_store import (
    HEADER,
    MAX_KEY_BYTES,
    BufferTooSmallError,
    InvalidKeyError,
    ObjectTooLargeError,
    ShmObjectStore,
    UntrustedRootError,
    file_system_type,
    key_of_name,
    object_name,
    object_names,
    shard_of,
    unwritten,
)

MiB = 1 << 20


@pytest.fixture
def shm_dir():
    parent = tempfile.mkdtemp(dir="/dev/shm", prefix="test_shm_store-")
    yield Path(parent)
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def root(shm_dir):
    return shm_dir / "store"


def value_of(key: bytes, size: int = 4096) -> bytes:
    """The only value ever written for ``key``: deterministic, different for every key."""
    seed = key * (size // len(key) + 1)
    return bytes((b + i) % 251 for i, b in enumerate(seed[:size]))


def object_path(root: Path, key: bytes) -> Path:
    return root / shard_of(key) / object_name(key)


# -- round trip ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 3 * MiB + 7])
def test_put_then_get_returns_the_same_bytes(root, size):
    store = ShmObjectStore(root, capacity_bytes=64 * MiB)
    payload = os.urandom(size)
    assert store.put(b"k", payload) is True
    assert store.get(b"k") == payload
    buffer = bytearray(size + 10)
    assert store.get_into(b"k", buffer) == size
    assert bytes(buffer[:size]) == payload
    assert store.stats()["hits"] == 2 and store.stats()["bytes_read"] == 2 * size


def test_get_into_fills_a_numpy_array_in_place(root):
    np = pytest.importorskip("numpy")
    store = ShmObjectStore(root, capacity_bytes=MiB)
    payload = np.arange(1000, dtype=np.float32)
    store.put(b"tensor", payload)
    target = np.zeros(1000, dtype=np.float32)
    assert store.get_into(b"tensor", target) == payload.nbytes
    assert np.array_equal(target, payload)


@pytest.mark.parametrize("short", [99, 50, 0])
def test_get_into_a_short_buffer_names_the_size_needed_and_keeps_the_object(root, short):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"k", b"x" * 100)
    with pytest.raises(BufferTooSmallError, match="at least 100 bytes"):
        store.get_into(b"k", bytearray(short))
    assert store.get(b"k") == b"x" * 100


def test_a_truncated_object_read_into_a_short_buffer_is_corrupt_not_too_big(root):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"k", value_of(b"k", 4096))
    path = object_path(root, b"k")
    path.write_bytes(path.read_bytes()[: HEADER.size + 3000])  # its header still says 4096
    assert store.get_into(b"k", bytearray(2000)) is None
    assert not path.exists() and store.stats()["corrupt"] == 1


def test_first_writer_wins(root):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    assert store.put(b"k", b"first") is True
    assert store.put(b"k", b"second") is False
    assert store.get(b"k") == b"first"


def _renameat2_refusing_the_flag(*_args) -> int:
    """What renameat2 answers on a file system without RENAME_NOREPLACE."""
    ctypes.set_errno(errno.EINVAL)
    return -1


PUBLISHERS = {
    "renameat2": None,
    "renameat2 refuses the flag: link": _renameat2_refusing_the_flag,
    "no renameat2 in libc: link": False,
}


@pytest.mark.parametrize("publisher", PUBLISHERS.values(), ids=PUBLISHERS.keys())
def test_a_writer_losing_the_race_to_publish_keeps_the_first_object_and_leaves_no_temp(root, monkeypatch, publisher):
    """Another writer publishes the key between this put's check and its publication: the name is never replaced."""
    from lmcache_r3.tiers import shm_store

    if publisher is not None:
        monkeypatch.setattr(shm_store, "_renameat2", publisher or None)
    store = ShmObjectStore(root, capacity_bytes=MiB)
    other = ShmObjectStore(root, capacity_bytes=MiB)
    real_check = store._adopt_existing
    checks = []

    def other_writer_gets_there_first(key, path):
        checks.append(key)
        if len(checks) > 1:
            return real_check(key, path)
        other.put(key, b"first")
        return False

    monkeypatch.setattr(store, "_adopt_existing", other_writer_gets_there_first)
    assert store.put(b"k", b"second") is False
    assert store.get(b"k") == b"first" and other.get(b"k") == b"first"
    assert store.usage()[0] == HEADER.size + len(b"first")
    assert not [path for path in root.iterdir() if path.name.startswith(shm_store.TEMP_PREFIX)]
    assert store.put(b"other", b"published") is True and store.get(b"other") == b"published"


def test_an_object_written_into_an_old_free_file_ages_from_its_publication(root):
    """The TTL reads a file's mtime: a recycled file's old mtime is replaced by the put's write."""
    store = ShmObjectStore(root, capacity_bytes=MiB, ttl_seconds=60)
    store.put(b"a", value_of(b"a"))
    store.delete([b"a"])
    (free,) = (root / ".free").iterdir()
    os.utime(free, (time.time() - 3600,) * 2)
    assert store.put(b"b", value_of(b"b")) and store.stats()["recycled"] == 1
    assert store.sweep_expired() == 0 and store.get(b"b") == value_of(b"b")


def test_files_are_private_and_no_temp_file_is_left_behind(root):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"k", b"payload")
    path = object_path(root, b"k")
    assert path.stat().st_mode & 0o777 == 0o600
    assert root.stat().st_mode & 0o777 == 0o700
    assert (root / ".free").stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in root.iterdir()) == sorted([shard_of(b"k"), ".free"])
    assert list((root / ".free").iterdir()) == []


def test_missing_keys_are_misses_and_delete_never_raises(root):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"a", b"1")
    assert store.get(b"absent") is None
    assert store.get_into(b"absent", bytearray(8)) is None
    assert store.exists(b"a") and not store.exists(b"absent")
    assert store.delete([b"a", b"absent", b"", b"x" * 1000, "not-bytes"]) == 1
    assert not store.exists(b"a")
    assert store.usage() == (0, MiB)
    assert store.stats()["misses"] == 2


def test_keys_lists_every_published_key(root):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    keys = {bytes([i]) * (i + 1) for i in range(40)}
    for key in keys:
        store.put(key, value_of(key, 10))
    assert set(store.keys()) == keys


@pytest.mark.parametrize(
    "key, error",
    [
        (b"", "1..155 bytes, got 0"),
        (b"x" * (MAX_KEY_BYTES + 1), "got 156; hash a longer key"),
        ("text", "must be bytes, got str"),
    ],
)
def test_invalid_keys_are_refused_with_the_fix(root, key, error):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    with pytest.raises(InvalidKeyError, match=error):
        store.put(key, b"v")


def test_an_object_larger_than_the_capacity_is_refused(root):
    store = ShmObjectStore(root, capacity_bytes=1000)
    with pytest.raises(ObjectTooLargeError, match="raise capacity_bytes"):
        store.put(b"big", bytes(1000))


# -- checksums -------------------------------------------------------------------------------------------------------


def flip_payload_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def flip_header_byte(data: bytes) -> bytes:
    return data[:10] + bytes([data[10] ^ 0x01]) + data[11:]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(flip_payload_byte, id="payload byte flipped"),
        pytest.param(flip_header_byte, id="header length changed"),
        pytest.param(lambda data: data[:-1], id="truncated payload"),
        pytest.param(lambda data: data[: HEADER.size - 3], id="truncated header"),
        pytest.param(lambda data: data + b"\0", id="trailing byte"),
        pytest.param(lambda data: b"garbage!" * 4 + data[HEADER.size :], id="garbage header"),
        pytest.param(lambda data: b"", id="empty file"),
    ],
)
@pytest.mark.parametrize("read", ["get", "get_into an exact buffer", "get_into a longer buffer"])
def test_a_corrupt_object_is_a_counted_miss_and_is_removed(root, damage, read):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"k", value_of(b"k"))
    path = object_path(root, b"k")
    path.write_bytes(damage(path.read_bytes()))
    if read == "get":
        result = store.get(b"k")
    else:  # LMCache's buffers have exactly the object's size: a trailing byte is found by the one-byte probe
        result = store.get_into(b"k", bytearray(4096 if "exact" in read else 8192))
    assert result is None
    assert not path.exists()
    assert store.stats()["corrupt"] == 1 and store.stats()["misses"] == 1
    assert store.usage()[0] == 0
    assert store.put(b"k", value_of(b"k")) is True
    assert store.get(b"k") == value_of(b"k")


# -- recycling removed files ------------------------------------------------------------------------------------------


def inode(path: Path) -> int:
    return path.stat().st_ino


def test_a_put_rewrites_the_file_of_a_deleted_object_of_the_same_size(root):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"old", value_of(b"old", 5000))
    old_inode = inode(object_path(root, b"old"))
    assert store.delete([b"old"]) == 1
    assert store.get(b"old") is None and store.usage()[0] == 0
    assert store.pooled_bytes() == HEADER.size + 5000
    assert store.put(b"new", value_of(b"new", 5000)) is True
    assert inode(object_path(root, b"new")) == old_inode, "the deleted object's file was not reused"
    assert store.get(b"new") == value_of(b"new", 5000)
    assert store.stats()["recycled"] == 1 and store.pooled_bytes() == 0
    assert list((root / ".free").iterdir()) == [] and not any(p.name.startswith(".tmp-") for p in root.iterdir())


def test_a_file_rewritten_for_another_key_never_passes_as_the_old_key(root):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"a", value_of(b"a", 5000))
    store.delete([b"a"])
    store.put(b"b", value_of(b"b", 5000))  # rewrites a's old file
    # What a reader that still had a's file open would read: b's complete object. Put it under a's name.
    object_path(root, b"a").parent.mkdir(exist_ok=True)
    os.link(object_path(root, b"b"), object_path(root, b"a"))
    assert store.get(b"a") is None
    assert store.stats()["corrupt"] == 1
    assert store.get(b"b") == value_of(b"b", 5000)


@pytest.mark.parametrize("read", ["get", "get_into"])
def test_a_read_overtaken_by_a_removal_and_a_rewrite_is_a_miss_counted_as_raced(root, monkeypatch, read):
    import lmcache_r3.tiers.shm_store as shm_store

    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"a", value_of(b"a", 5000))
    # get reads the payload with _read_bytes after the header; get_into reads the whole file with one readv.
    owner, name = (shm_store, "_read_bytes") if read == "get" else (os, "readv")
    real_read = getattr(owner, name)

    def removed_while_reading(*args):
        monkeypatch.setattr(owner, name, real_read)
        other = ShmObjectStore(root, capacity_bytes=MiB)
        other.delete([b"a"])  # a's file goes to the free files ...
        other.put(b"b", value_of(b"b", 5000))  # ... and is rewritten for b under the reader's feet
        return real_read(*args)

    monkeypatch.setattr(owner, name, removed_while_reading)
    assert (store.get(b"a") if read == "get" else store.get_into(b"a", bytearray(5000))) is None
    assert store.stats()["raced"] == 1 and store.stats()["corrupt"] == 0
    assert store.get(b"b") == value_of(b"b", 5000)


def test_a_read_overtaken_by_a_rewrite_of_the_same_key_in_the_same_file_keeps_the_new_object(root, monkeypatch):
    """Between the header and the payload of a read, the file goes to the free files, is reused for a put of the
    same key (other bytes: routing is not deterministic) and is published again at the same path: the reader's miss
    must not remove the new object."""
    import lmcache_r3.tiers.shm_store as shm_store

    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"a", value_of(b"a", 5000))
    newer = value_of(b"z", 5000)
    real_read = shm_store._read_bytes
    inode = os.stat(object_path(root, b"a")).st_ino

    def rewritten_while_reading(*args):
        monkeypatch.setattr(shm_store, "_read_bytes", real_read)
        other = ShmObjectStore(root, capacity_bytes=MiB)
        other.delete([b"a"])
        other.put(b"a", newer)
        return real_read(*args)

    monkeypatch.setattr(shm_store, "_read_bytes", rewritten_while_reading)
    assert store.get(b"a") is None
    assert os.stat(object_path(root, b"a")).st_ino == inode, "the scenario needs the same file back at the path"
    assert store.stats()["raced"] == 1 and store.stats()["corrupt"] == 0
    assert store.usage()[0] == HEADER.size + 5000, "the object there is no longer counted"
    assert store.get(b"a") == newer


class _FailedTask(CallerBuffers):
    """The buffers of a task that was already failed: every hold is refused."""

    def hold(self) -> bool:
        return False


def test_a_refused_hold_reads_and_writes_nothing(root):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    with pytest.raises(BuffersGone):
        store.put(b"new", value_of(b"new"), _FailedTask())
    assert store.get(b"new") is None and store.usage()[0] == 0
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    store.put(b"k", value_of(b"k"))
    buffer = bytearray(b"\xee" * 4096)
    with pytest.raises(BuffersGone):
        store.get_into(b"k", buffer, _FailedTask())
    assert buffer == bytearray(b"\xee" * 4096)
    assert store.get(b"k") == value_of(b"k")


def test_get_into_a_longer_buffer_fills_its_start_and_returns_the_length(root):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"k", value_of(b"k", 1000))
    buffer = bytearray(b"\xee" * 1500)
    assert store.get_into(b"k", buffer) == 1000
    assert bytes(buffer[:1000]) == value_of(b"k", 1000) and bytes(buffer[1000:]) == b"\xee" * 500


def test_free_files_count_against_the_capacity_and_are_dropped_before_any_eviction(root):
    object_size = HEADER.size + 1000
    store = ShmObjectStore(root, capacity_bytes=3 * object_size)
    for key in (b"a", b"b", b"c"):
        store.put(key, value_of(key, 1000))
    store.delete([b"a"])
    assert store.usage()[0] + store.pooled_bytes() == 3 * object_size
    store.put(b"d", value_of(b"d", 999))  # another size: the free file cannot be rewritten, so it is dropped
    assert sorted(store.keys()) == [b"b", b"c", b"d"]
    assert store.stats()["evictions"] == 0 and store.pooled_bytes() == 0
    assert list((root / ".free").iterdir()) == []


def test_an_evicted_objects_file_is_rewritten_by_the_put_that_evicted_it(root):
    object_size = HEADER.size + 1000
    store = ShmObjectStore(root, capacity_bytes=2 * object_size)
    store.put(b"a", value_of(b"a", 1000))
    a_inode = inode(object_path(root, b"a"))
    store.put(b"b", value_of(b"b", 1000))
    store.put(b"c", value_of(b"c", 1000))
    assert sorted(store.keys()) == [b"b", b"c"]
    assert inode(object_path(root, b"c")) == a_inode
    assert store.stats()["evictions"] == 1 and store.stats()["recycled"] == 1
    assert store.get(b"c") == value_of(b"c", 1000)


def test_an_evicted_object_another_store_replaced_with_a_longer_one_is_rewritten_to_the_new_size(root):
    # Store a counts "a" at 1000 bytes; store b replaces it with 1500 bytes. When a evicts "a" for a 1000-byte
    # object it rewrites the longer file it finds there, which must end where the new object ends.
    object_size = HEADER.size + 1000
    first = ShmObjectStore(root, capacity_bytes=object_size)
    first.put(b"a", value_of(b"a", 1000))
    second = ShmObjectStore(root, capacity_bytes=1 << 20, recycle_bytes=0)
    second.delete([b"a"])
    second.put(b"a", value_of(b"a", 1500))
    first.put(b"c", value_of(b"c", 1000))
    assert first.stats()["evictions"] == 1 and first.stats()["recycled"] == 1
    assert os.stat(object_path(root, b"c")).st_size == object_size
    assert first.get(b"c") == value_of(b"c", 1000)


def test_a_put_racing_a_delete_for_the_free_file_leaves_no_file_the_store_does_not_count(root, monkeypatch):
    """A delete counts the removed file against the recycling budget before renaming it into .free; a put of the same
    size at that moment must not claim the name (it would find no file) and leave the renamed one uncounted."""
    from lmcache_r3.tiers import shm_store

    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"a", value_of(b"a"))
    real_rename = os.rename
    raced = []

    def rename(source, target):
        if not raced and os.path.dirname(str(target)) == str(root / ".free"):
            raced.append(store.put(b"b", value_of(b"b")))  # same size, between the delete's count and its rename
        real_rename(source, target)

    monkeypatch.setattr(shm_store.os, "rename", rename)
    assert store.delete([b"a"]) == 1
    monkeypatch.setattr(shm_store.os, "rename", real_rename)
    assert raced == [True] and store.get(b"b") == value_of(b"b")
    on_disk = sum(entry.stat().st_size for entry in (root / ".free").iterdir())
    assert on_disk == store.pooled_bytes() == HEADER.size + 4096, "a free file the store does not count"
    store.put(b"c", value_of(b"c"))
    assert store.stats()["recycled"] == 1 and list((root / ".free").iterdir()) == []


def test_concurrent_puts_make_room_for_each_other(root):
    """A put in progress already counts against the capacity: a second put meanwhile evicts to make room for both."""
    import threading

    from lmcache_r3.tiers.holds import CallerBuffers

    class SlowCopy(CallerBuffers):  # the first put's copy waits until the second put is done
        def __init__(self) -> None:
            self.copying, self.go = threading.Event(), threading.Event()

        def hold(self) -> bool:
            self.copying.set()
            self.go.wait(10)
            return True

    object_size = HEADER.size + 4096
    store = ShmObjectStore(root, capacity_bytes=2 * object_size, recycle_bytes=0)
    store.put(b"a", value_of(b"a"))
    slow = SlowCopy()
    first = threading.Thread(target=store.put, args=(b"b", value_of(b"b"), slow))
    first.start()
    assert slow.copying.wait(10)
    store.put(b"c", value_of(b"c"))  # "a" and the two puts do not fit: "a" goes
    slow.go.set()
    first.join(10)
    assert sorted(store.keys()) == [b"b", b"c"] and store.stats()["evictions"] == 1
    assert store.usage() == (2 * object_size, 2 * object_size)
    assert [store.get(key) for key in (b"b", b"c")] == [value_of(b"b"), value_of(b"c")]


def test_a_free_file_rewritten_by_a_put_is_not_taken_for_a_crashed_writers_leftover(root, monkeypatch):
    """A put rewrites a free file (maybe written long ago) under its temp name; a store opening the root meanwhile
    removes temp files older than STALE_TEMP_SECONDS and must not take this one for a crashed writer's."""
    from lmcache_r3.tiers import shm_store

    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"a", value_of(b"a"))
    store.delete([b"a"])
    (free,) = (root / ".free").iterdir()
    old = time.time() - 2 * shm_store.STALE_TEMP_SECONDS
    os.utime(free, (old, old))
    real_write_all = shm_store.write_all

    def write_all(fd, *parts):
        ShmObjectStore(root, capacity_bytes=MiB)  # another server starts on the root while this put writes
        real_write_all(fd, *parts)

    monkeypatch.setattr(shm_store, "write_all", write_all)
    assert store.put(b"b", value_of(b"b")) and store.stats()["recycled"] == 1
    assert store.get(b"b") == value_of(b"b")


def test_recycle_bytes_zero_unlinks_removed_objects(root):
    store = ShmObjectStore(root, capacity_bytes=MiB, recycle_bytes=0)
    store.put(b"a", value_of(b"a"))
    store.delete([b"a"])
    assert store.pooled_bytes() == 0 and list((root / ".free").iterdir()) == []
    store.put(b"b", value_of(b"b"))
    assert store.stats()["recycled"] == 0


def test_a_new_store_adopts_the_free_files_and_drops_malformed_ones(root):
    first = ShmObjectStore(root, capacity_bytes=MiB)
    first.put(b"a", value_of(b"a"))
    first.delete([b"a"])
    (root / ".free" / "junk").write_bytes(b"x")
    (root / ".free" / "99-1-2-3").write_bytes(b"size in the name is wrong")
    second = ShmObjectStore(root, capacity_bytes=MiB)
    assert second.pooled_bytes() == HEADER.size + 4096
    assert sorted(p.name for p in (root / ".free").iterdir()) == sorted(first._pool)
    second.put(b"b", value_of(b"b"))
    assert second.stats()["recycled"] == 1 and second.get(b"b") == value_of(b"b")


def test_a_new_store_with_a_smaller_capacity_keeps_only_the_free_files_that_fit(root):
    first = ShmObjectStore(root, capacity_bytes=MiB)
    for key in (b"a", b"b", b"c"):
        first.put(key, value_of(key, 1000))
    first.delete([b"a", b"b", b"c"])
    second = ShmObjectStore(root, capacity_bytes=2 * (HEADER.size + 1000))
    assert second.pooled_bytes() == 2 * (HEADER.size + 1000)
    assert len(list((root / ".free").iterdir())) == 2


# -- capacity, TTL, reopening ------------------------------------------------------------------------------------------


def test_capacity_evicts_the_least_recently_used(root):
    object_size = HEADER.size + 1000
    store = ShmObjectStore(root, capacity_bytes=3 * object_size)
    for key in (b"a", b"b", b"c"):
        store.put(key, value_of(key, 1000))
    assert store.get(b"a") is not None  # a is now more recent than b
    store.put(b"d", value_of(b"d", 1000))
    assert sorted(store.keys()) == [b"a", b"c", b"d"]
    assert store.usage() == (3 * object_size, 3 * object_size)
    assert store.stats()["evictions"] == 1


def test_ttl_sweep_removes_objects_published_longer_ago_than_the_ttl(root):
    store = ShmObjectStore(root, capacity_bytes=MiB, ttl_seconds=60)
    store.put(b"old", b"1")
    store.put(b"new", b"2")
    published = time.time()
    os.utime(object_path(root, b"old"), (published - 120, published - 120))
    assert store.sweep_expired(now=published) == 1
    assert list(store.keys()) == [b"new"]
    assert store.sweep_expired(now=published + 61) == 1
    assert store.stats()["expired"] == 2 and store.usage()[0] == 0


def test_without_a_ttl_nothing_expires(root):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    store.put(b"k", b"v")
    assert store.sweep_expired(now=time.time() + 1e9) == 0


def test_a_new_store_on_the_same_root_serves_what_is_there(root, monkeypatch):
    from lmcache_r3.tiers import shm_store

    first = ShmObjectStore(root, capacity_bytes=MiB)
    keys = [b"a", b"b", b"c"]
    for key in keys:
        first.put(key, value_of(key, 500))
    (root / ".tmp-1-2-dead").write_bytes(b"half-written")
    monkeypatch.setattr(shm_store, "STALE_TEMP_SECONDS", 0.0)  # a file's ctime cannot be set back
    time.sleep(0.01)

    second = ShmObjectStore(root, capacity_bytes=MiB)
    assert second.usage() == first.usage() == (3 * (HEADER.size + 500), MiB)
    assert all(second.get(key) == value_of(key, 500) for key in keys)
    assert not (root / ".tmp-1-2-dead").exists()


def test_reopening_with_a_smaller_capacity_evicts_the_oldest_first(root):
    first = ShmObjectStore(root, capacity_bytes=MiB)
    for age, key in enumerate([b"newest", b"middle", b"oldest"]):
        first.put(key, value_of(key, 1000))
        os.utime(object_path(root, key), (time.time() - 100 * age,) * 2)
    second = ShmObjectStore(root, capacity_bytes=3 * (HEADER.size + 1000))
    second.put(b"extra", value_of(b"extra", 1000))
    assert sorted(second.keys()) == [b"extra", b"middle", b"newest"]


# -- the trusted root ------------------------------------------------------------------------------------------------


def make_symlinked_root(shm_dir: Path) -> Path:
    real = shm_dir / "real"
    real.mkdir(mode=0o700)
    (shm_dir / "link").symlink_to(real)
    return shm_dir / "link"


def make_open_root(shm_dir: Path) -> Path:
    path = shm_dir / "open"
    path.mkdir()
    path.chmod(0o755)
    return path


def make_foreign_root(shm_dir: Path) -> Path:
    path = shm_dir / "foreign"
    path.mkdir(mode=0o700)
    if os.getuid() != 0:
        pytest.skip("simulating a foreign owner needs root to chown the directory to another uid")
    os.chown(path, 65534, -1)
    return path


def make_file_root(shm_dir: Path) -> Path:
    path = shm_dir / "file"
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize(
    "make_root, message",
    [
        (make_symlinked_root, r"is a symlink to .*/real; .*Use the real directory as the root"),
        (make_open_root, r"has mode 0o755, expected exactly 0o700 .*Run `chmod 700 .*/open`"),
        (make_foreign_root, r"is owned by uid 65534, not by this process \(uid 0\).*Run `chown 0 .*/foreign`"),
        (make_file_root, r"is not a directory; choose another root"),
    ],
)
def test_an_untrusted_root_is_refused_naming_the_path_and_the_fix(shm_dir, make_root, message):
    path = make_root(shm_dir)
    with pytest.raises(UntrustedRootError, match=message) as raised:
        ShmObjectStore(path, capacity_bytes=MiB)
    assert str(path) in str(raised.value)


def test_a_missing_root_is_created_private(shm_dir):
    old_umask = os.umask(0o022)
    try:
        store = ShmObjectStore(shm_dir / "a" / "b", capacity_bytes=MiB)
    finally:
        os.umask(old_umask)
    assert store.root.stat().st_mode & 0o777 == 0o700


# -- names -----------------------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.sets(st.binary(min_size=1, max_size=MAX_KEY_BYTES), min_size=2, max_size=20))
def test_distinct_keys_get_distinct_safe_names_that_decode_back(keys):
    names = {object_name(key) for key in keys}
    assert len(names) == len(keys)
    for key in keys:
        name = object_name(key)
        assert "/" not in name and "." not in name and "\0" not in name
        assert 0 < len(name) <= 248 < 255
        assert key_of_name(name) == key


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=MAX_KEY_BYTES), max_size=40))
def test_names_of_a_batch_equal_the_names_one_by_one(keys):
    keys += [key[:1] for key in keys]  # several keys of one length, and of many lengths, in one batch
    assert object_names(keys) == [object_name(key) for key in keys]


@pytest.mark.parametrize("key", ["text", b"", b"x" * (MAX_KEY_BYTES + 1)])
def test_preparing_an_invalid_key_is_refused_like_using_it(root, key):
    store = ShmObjectStore(root, capacity_bytes=MiB)
    with pytest.raises(InvalidKeyError):
        store.prepare([b"fine", key])
    with pytest.raises(InvalidKeyError):
        store.put(key, b"x")


def test_the_file_system_of_a_root_is_told(root, tmp_path):
    assert ShmObjectStore(root, capacity_bytes=MiB).on_tmpfs  # /dev/shm
    assert file_system_type("/proc") == "proc"
    assert file_system_type(tmp_path / "missing") is None


@pytest.mark.parametrize("name", [".tmp-1-2-3", "..", "MFRA", "mfrb", "mfr", "x/y", "", "a" * 300])
def test_names_that_are_not_canonical_objects_decode_to_nothing(name):
    assert key_of_name(name) is None


# -- two processes on one root ---------------------------------------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import random, sys, time
    from lmcache_r3.tiers.shm_store import ShmObjectStore

    def value_of(key, size):
        seed = key * (size // len(key) + 1)
        return bytes((b + i) % 251 for i in range(size) for b in [seed[i]])

    root, worker, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    keys = [b"key-%03d" % i for i in range(48)]
    # two sizes: removed files are rewritten by puts of other keys of the same size
    values = {key: value_of(key, 64 * 1024 + 17 * (i % 2)) for i, key in enumerate(keys)}
    store = ShmObjectStore(root, capacity_bytes=24 * 70 * 1024)
    rng = random.Random(worker)
    wrong = reads = hits = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        key = rng.choice(keys)
        if rng.random() < 0.5:
            store.put(key, values[key])
        else:
            got = store.get(key)
            reads += 1
            hits += got is not None
            wrong += got is not None and got != values[key]
        if rng.random() < 0.05:
            store.delete([rng.choice(keys)])
    stats = store.stats()
    print(wrong, reads, hits, stats["corrupt"], stats["evictions"], stats["recycled"])
    """
)


def test_two_processes_sharing_a_root_never_read_a_torn_or_wrong_object(root):
    ShmObjectStore(root, capacity_bytes=MiB)
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(root), str(worker), "4"], stdout=subprocess.PIPE, text=True, env=env
        )
        for worker in range(2)
    ]
    for worker in workers:
        out, _ = worker.communicate(timeout=20)
        assert worker.returncode == 0
        wrong, reads, hits, corrupt, evictions, recycled = map(int, out.split())
        assert wrong == 0 and corrupt == 0
        assert reads > 100 and hits > 0 and evictions > 0 and recycled > 0


@pytest.mark.parametrize(
    ("sizes", "written", "left"),
    [
        ([3, 4], 0, [3, 4]),
        ([3, 4], 2, [1, 4]),
        ([3, 4], 3, [4]),
        ([3, 4], 5, [2]),
        ([3, 4], 7, []),
        ([0, 3, 0, 4], 0, [3, 4]),
        ([0, 3, 0, 4], 3, [4]),
    ],
)
def test_unwritten_keeps_what_a_partial_write_left_in_order(sizes, written, left):
    data = bytes(range(sum(sizes)))
    views, offset = [], 0
    for size in sizes:
        views.append(memoryview(data)[offset : offset + size])
        offset += size
    rest = unwritten(views, written)
    assert [view.nbytes for view in rest] == left
    assert b"".join(bytes(view) for view in rest) == data[written:]


def test_a_temp_file_with_an_old_mtime_but_just_renamed_is_not_a_crashed_writers_leftover(root):
    """A free file claimed for a put is renamed to a temp name and keeps its old mtime until the put rewrites it."""
    from lmcache_r3.tiers import shm_store

    ShmObjectStore(root, capacity_bytes=MiB)
    temp = root / f"{shm_store.TEMP_PREFIX}claimed"
    temp.write_bytes(b"x" * 100)
    old = time.time() - 2 * shm_store.STALE_TEMP_SECONDS
    os.utime(temp, (old, old))
    ShmObjectStore(root, capacity_bytes=MiB).tidy()
    assert temp.exists()


def free_files_of_a_departed_process(root) -> list[Path]:
    """Rename every free file under ``root`` as if a store in a process that has exited had left it."""
    exited = subprocess.Popen(["true"])
    exited.wait()
    renamed = []
    for path in sorted((root / ".free").iterdir()):
        size, _, rest = path.name.partition("-")
        target = path.with_name(f"{size}-{exited.pid}-{rest.partition('-')[2]}")
        path.rename(target)
        renamed.append(target)
    return renamed


def test_tidy_clears_a_crashed_writers_temp_and_adopts_only_a_departed_stores_free_files(root, monkeypatch):
    from lmcache_r3.tiers import shm_store

    running = ShmObjectStore(root, capacity_bytes=MiB)
    other = ShmObjectStore(root, capacity_bytes=MiB)  # opened after: running knows nothing it frees
    other.put(b"a", value_of(b"a"))
    other.delete([b"a"])
    (root / f"{shm_store.TEMP_PREFIX}crashed").write_bytes(b"x" * 100)
    running.tidy()  # too young yet
    assert running.pooled_bytes() == 0 and (root / f"{shm_store.TEMP_PREFIX}crashed").exists()
    monkeypatch.setattr(shm_store, "STALE_TEMP_SECONDS", 0.0)
    time.sleep(0.01)
    running.tidy()
    assert not (root / f"{shm_store.TEMP_PREFIX}crashed").exists()
    assert running.pooled_bytes() == 0, "a free file of a running store (this process) was adopted"
    (free,) = free_files_of_a_departed_process(root)
    running.tidy()
    running.tidy()  # a file it knows is not adopted twice
    assert running.pooled_bytes() == os.stat(free).st_size
    assert running.put(b"b", value_of(b"b")) and running.stats()["recycled"] == 1
    assert running.get(b"b") == value_of(b"b")


def test_tidy_removes_no_free_file_it_has_no_room_for(root, monkeypatch):
    from lmcache_r3.tiers import shm_store

    running = ShmObjectStore(root, capacity_bytes=MiB, recycle_bytes=0)
    other = ShmObjectStore(root, capacity_bytes=MiB)
    other.put(b"a", value_of(b"a"))
    other.delete([b"a"])
    (free,) = free_files_of_a_departed_process(root)
    monkeypatch.setattr(shm_store, "STALE_TEMP_SECONDS", 0.0)
    time.sleep(0.01)
    running.tidy()
    assert running.pooled_bytes() == 0 and free.exists()  # another store may count it; one that opens decides
