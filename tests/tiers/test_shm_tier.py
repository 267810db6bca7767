"""The /dev/shm tier (``lmcache_r3.tiers.shm_adapter.ShmL2Adapter``) as an L2 plugin of a real LMCache server:
R3 and KV objects served byte-equal from the tier after L1 is cleared, served again after a server restart,
a damaged object never served, an untrusted root refused at start-up."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
import pytest

from lmcache_r3.artifacts import decode_run, read_header
from lmcache_r3.launch import ServiceStartError
from lmcache_r3.mp.r3_client import R3Client
from lmcache_r3.tiers.shm_store import HEADER
from tests.server.test_r3_server_module import CHUNK, MODEL, PROFILE, rows_for, store_rows, tokens_for, wait_for_hit
from tests.support.harness import wait_for
from tests.support.l2_tasks import CallerBuffer, completed, object_key
from tests.unit.test_shm_store import free_files_of_a_departed_process

pytestmark = pytest.mark.server

CAPACITY = 256 << 20


@pytest.fixture
def shm_root():
    root = tempfile.mkdtemp(prefix="r3-shm-tier-", dir="/dev/shm")  # mode 0700, ours
    yield root
    shutil.rmtree(root, ignore_errors=True)


def shm_tier(root: str, **params) -> dict:
    return {
        "type": "plugin",
        "module_path": "lmcache_r3.tiers.shm_adapter",
        "class_name": "ShmL2Adapter",
        "adapter_params": {"root": root, "capacity_bytes": CAPACITY, "ttl_seconds": 3600, **params},
    }


def start(factory, root: str):
    return factory(l2_adapters=(shm_tier(root),))


def tier_files(root: str) -> set[str]:
    """The tier's objects: every published file (not the writes in progress, not the free files)."""
    free = os.path.join(root, ".free")
    return {
        os.path.join(top, name)
        for top, _, names in os.walk(root)
        for name in names
        if not name.startswith(".tmp-") and top not in (root, free)
    }


def free_files(root: str) -> set[str]:
    """Removed objects' files the tier keeps for rewriting (they count against its capacity)."""
    free = os.path.join(root, ".free")
    return {os.path.join(free, name) for name in os.listdir(free)} if os.path.isdir(free) else set()


def wait_for_files(root: str, count: int, before: frozenset[str] = frozenset(), timeout_s: float = 10.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while len(new := tier_files(root) - before) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(new) >= count, f"expected the tier to hold {count} new objects, found {sorted(new)}"
    return new


def tier_status(server) -> dict:
    adapters = server.status()["storage_manager"]["l2_adapters"]
    return next(a for a in adapters if a.get("type") == "ShmL2Adapter")


def clear_l1(server, timeout_s: float = 10.0) -> None:
    """Empty L1; objects an in-flight tier store still reads stay until it finishes, so retry (bounded)."""
    deadline = time.monotonic() + timeout_s
    server.clear_l1()
    while (count := server.l1_counts()["total_object_count"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        server.clear_l1()
    assert count == 0, f"{count} objects stayed in L1"


def fetch_rows(r3: R3Client, tokens) -> tuple[int, np.ndarray | None]:
    fetched = r3.fetch(tokens).result()
    if not fetched.num_hit_chunks:
        return 0, None
    decoded = decode_run(fetched.objects, PROFILE, 0, CHUNK)
    assert decoded.error is None
    return fetched.num_hit_chunks, np.concatenate([c.rows for c in decoded.chunks])


def test_r3_objects_come_back_byte_equal_from_the_tier_and_again_after_a_restart(r3_server_factory, shm_root):
    tokens, rows = tokens_for(201, 3 * CHUNK), rows_for(201, 3 * CHUNK)
    server = start(r3_server_factory, shm_root)
    with R3Client(server.url, MODEL, PROFILE) as r3:
        assert store_rows(r3, tokens, rows).num_stored == 3
        wait_for_files(shm_root, 3)
        clear_l1(server)
        hits, fetched = fetch_rows(r3, tokens)
        assert hits == 3 and np.array_equal(fetched, rows)
    status = tier_status(server)
    assert status["is_healthy"] and server.status()["is_healthy"]
    assert status["hits"] >= 3 and status["bytes"] > 0 and status["errors"] == 0
    for counter in ("misses", "corrupt", "evictions"):
        assert counter in status
    server.stop()

    again = start(r3_server_factory, shm_root)  # a new server on the same root serves what is there
    try:
        status = tier_status(again)
        assert status["objects"] == 3 and status["bytes"] > 0
        assert again.l1_counts()["total_object_count"] == 0
        with R3Client(again.url, MODEL, PROFILE) as r3:
            assert r3.lookup(tokens).result().num_hit_chunks == 3
            hits, fetched = fetch_rows(r3, tokens)
            assert hits == 3 and np.array_equal(fetched, rows)
        assert tier_status(again)["hits"] >= 3
    finally:
        again.stop()


def test_r3_partly_in_l1_partly_in_the_tier_comes_back_whole_and_no_lock_is_left(r3_server_factory, shm_root):
    """A fetch asks L1 first when tiers are configured; when L1 holds only some of the chunks, the locks it took are
    released and one prefetch reads all of them from L1 and the tier."""
    tokens, rows = tokens_for(203, 3 * CHUNK), rows_for(203, 3 * CHUNK)
    server = start(r3_server_factory, shm_root)

    def read_locks() -> int:
        return server.l1_counts()["read_locked_count"]

    with R3Client(server.url, MODEL, PROFILE) as r3:
        assert store_rows(r3, tokens, rows).num_stored == 3
        wait_for_files(shm_root, 3)
        assert wait_for(read_locks, 0, 10.0) == 0  # the tier's stores are done with the L1 objects
        hits, fetched = fetch_rows(r3, tokens)  # all three in L1
        assert hits == 3 and np.array_equal(fetched, rows)
        assert read_locks() == 0
        clear_l1(server)
        assert store_rows(r3, tokens[:CHUNK], rows[:CHUNK]).num_stored == 1  # the first chunk in L1 again
        assert server.l1_counts()["total_object_count"] == 1

        hits, fetched = fetch_rows(r3, tokens)  # one chunk in L1, two only in the tier

        assert hits == 3 and np.array_equal(fetched, rows)
        assert read_locks() == 0


def test_a_damaged_object_in_the_tier_is_never_served_and_is_removed(r3_server_factory, shm_root):
    tokens, rows = tokens_for(202, 3 * CHUNK), rows_for(202, 3 * CHUNK)
    server = start(r3_server_factory, shm_root)
    try:
        with R3Client(server.url, MODEL, PROFILE) as r3:
            store_rows(r3, tokens, rows)
            files = wait_for_files(shm_root, 3)
            second = next(p for p in files if _token_start(p) == CHUNK)
            data = bytearray(open(second, "rb").read())
            data[-10] ^= 0xFF  # one payload byte of chunk 1 flips in /dev/shm
            with open(second, "r+b") as f:
                f.write(bytes(data))
            clear_l1(server)
            hits, fetched = fetch_rows(r3, tokens)
            assert hits == 1, "the damaged chunk must end the hit"
            assert np.array_equal(fetched, rows[:CHUNK])
            assert not os.path.exists(second), "the damaged object stays in the tier"
            assert tier_status(server)["corrupt"] >= 1
            assert wait_for_hit(r3, tokens, 1) == 1
    finally:
        server.stop()


def _token_start(path: str) -> int:
    data = open(path, "rb").read()
    return read_header(data[data.index(b"R3RX", HEADER.size) :]).token_start


def test_kv_blocks_come_back_byte_equal_from_the_tier(lmcache_server_factory, scheduler_harness_factory, shm_root):
    from tests.support.harness import BLOCK_SIZE

    server = lmcache_server_factory(chunk_size=CHUNK, l2_adapters=(shm_tier(shm_root),))
    harness = None
    try:
        harness = scheduler_harness_factory(server=server, kind="dense")
        tokens = [10 + (7 * i + 3) % 1000 for i in range(4 * BLOCK_SIZE + 10)]  # 2 full chunks + a partial tail
        harness.generate([("A", tokens)])
        saved = harness.attention_bytes(harness.block_tables["A"][0][:4])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the tier writes behind L1
            in_l1 = server.l1_counts()["total_object_count"]
            if in_l1 and len(tier_files(shm_root)) >= in_l1:
                break
            time.sleep(0.02)
        assert tier_files(shm_root), "no KV object reached the tier"
        clear_l1(server)

        harness.reset_prefix_cache()
        harness.zero_all_blocks_but_null()
        harness.generate([("B", tokens + [900, 901])])
        assert harness.attention_bytes(harness.block_tables["B"][0][:4]) == saved, "KV from the tier differs"
        status = tier_status(server)
        assert status["hits"] >= 1 and status["corrupt"] == 0 and status["is_healthy"]
        assert server.l1_counts()["read_locked_count"] == 0
    finally:
        if harness is not None:  # before the server goes: a connector talking to a dead server waits out its timeout
            harness.shutdown()
            harness.shutdown = lambda: None  # the fixture's teardown must not shut it down twice
        server.stop()


def test_a_symlinked_root_is_refused_at_start_up_with_the_reason(r3_server_factory, shm_root):
    link = shm_root + "-link"
    os.symlink(shm_root, link)
    try:
        with pytest.raises(ServiceStartError) as failure:
            start(r3_server_factory, link)
        assert "is a symlink" in str(failure.value), str(failure.value)[-2000:]
    finally:
        os.unlink(link)


# -- the adapter contract without a server: every task completes and signals, even when the store fails -----------
def _key(i: int):
    return object_key(i, "tiny-moe")


def _signalled(fd: int, timeout_s: float) -> bool:
    import select

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(timeout_s * 1000)))


@pytest.fixture
def adapter(shm_root):
    from lmcache_r3.tiers.shm_adapter import ShmL2Adapter

    tier = ShmL2Adapter({"root": shm_root, "capacity_bytes": 1 << 20, "task_timeout_seconds": 0.3})
    yield tier
    tier.close()


def test_a_throwing_store_still_completes_every_task_and_delete_never_raises(adapter, monkeypatch):
    def boom(*args, **kwargs):
        raise OSError("injected")

    for name in ("put", "get_into", "exists", "delete"):
        monkeypatch.setattr(adapter._store, name, boom)
    store = adapter.submit_store_task([_key(1)], [CallerBuffer(b"x" * 64)])
    assert _signalled(adapter.get_store_event_fd(), 2)
    assert not adapter.pop_completed_store_tasks()[store].is_successful()
    lookup = adapter.submit_lookup_and_lock_task([_key(1)], {})
    assert _signalled(adapter.get_lookup_and_lock_event_fd(), 2)
    assert adapter.query_lookup_and_lock_result(lookup).popcount() == 0
    load = adapter.submit_load_task([_key(1)], [CallerBuffer(bytes(64))])
    assert _signalled(adapter.get_load_event_fd(), 2)
    assert adapter.query_load_result(load).popcount() == 0
    adapter.delete([_key(1)])  # must not raise: a raising delete kills LMCache's eviction thread
    assert adapter.report_status()["errors"] >= 3


def test_a_stalled_store_is_failed_by_the_watchdog_and_reported_unhealthy(adapter, monkeypatch):
    import threading

    release = threading.Event()
    monkeypatch.setattr(adapter._store, "get_into", lambda key, buf, buffers: release.wait(5) and None)
    load = adapter.submit_load_task([_key(2)], [CallerBuffer(bytes(64))])
    assert _signalled(adapter.get_load_event_fd(), 3), "a stalled task was never completed"
    assert adapter.query_load_result(load).popcount() == 0
    status = adapter.report_status()
    assert not status["is_healthy"] and status["counters"]["timeouts"] == 1
    release.set()


def test_a_store_failed_by_the_watchdog_that_publishes_after_a_clear_leaves_no_file_on_the_root(shm_root, monkeypatch):
    """After a policy update's clear nothing stored before it may be served: a store that copied its object and then
    stalled before publishing it (the tier's file system stalls: ``publish`` is held here) past the task timeout is
    failed, so the clear does not wait for it; when it publishes after the clear, its file goes again."""
    import threading

    from lmcache_r3.tiers import shm_store
    from lmcache_r3.tiers.shm_adapter import ShmL2Adapter

    tier = ShmL2Adapter({"root": shm_root, "capacity_bytes": 1 << 20, "task_timeout_seconds": 1.0,
                         "inline_max_bytes": 0})  # fmt: skip
    release, published = threading.Event(), threading.Event()
    real_publish = shm_store.publish

    def stalled_publish(temp: str, path: str) -> None:
        release.wait(10)
        real_publish(temp, path)
        published.set()

    try:
        assert _store_one(tier, 1, b"o" * 4096)
        monkeypatch.setattr(shm_store, "publish", stalled_publish)
        assert not _store_one(tier, 2, b"n" * 4096), "the stalled store was not failed by the watchdog"
        assert tier.clear_objects() == 1 and tier_files(shm_root) == set()
        release.set()  # the stalled store publishes its file now
        assert published.wait(5), "the stalled store never published"
        assert wait_for(lambda: len(tier_files(shm_root)), 0, 3) == 0, "an object stored before the clear stayed"
        assert tier.report_status()["counters"]["voided_objects"] == 1
        lookup = tier.submit_lookup_and_lock_task([_key(2)], {})
        assert _signalled(tier.get_lookup_and_lock_event_fd(), 3)
        assert tier.query_lookup_and_lock_result(lookup).popcount() == 0
        status = tier.report_status()
        assert status["objects"] == 0 and tier.get_usage().total_bytes_used == 0
        monkeypatch.setattr(shm_store, "publish", real_publish)
        assert _store_one(tier, 2, b"n" * 4096) and len(tier_files(shm_root)) == 1, "a store after the clear stays"
    finally:
        release.set()
        tier.close()


def test_a_store_stuck_copying_from_l1_fails_the_clear_and_nothing_is_removed(shm_root, monkeypatch):
    """A store copying the caller's buffer holds it, so the watchdog must leave it alone; a clear waits for it at most
    the task timeout, then refuses, saying why, and removes nothing (half a clear would look done); once the copy
    ends the clear goes through."""
    import threading

    from lmcache_r3.tiers import shm_store
    from lmcache_r3.tiers.shm_adapter import ShmL2Adapter
    from lmcache_r3.tiers.task_adapter import TierClearError

    tier = ShmL2Adapter({"root": shm_root, "capacity_bytes": 1 << 20, "task_timeout_seconds": 1.0,
                         "inline_max_bytes": 0})  # fmt: skip
    release, copying = threading.Event(), threading.Event()
    real_write_all = shm_store.write_all

    def stuck_write_all(fd: int, *parts: memoryview) -> None:
        copying.set()
        release.wait(10)
        real_write_all(fd, *parts)

    try:
        assert _store_one(tier, 1, b"o" * 4096)
        monkeypatch.setattr(shm_store, "write_all", stuck_write_all)
        task = tier.submit_store_task([_key(2)], [CallerBuffer(b"n" * 4096)])
        assert copying.wait(5), "the store never began its copy"
        with pytest.raises(TierClearError, match=r"1 store task\(s\) still running after 1 s .*nothing was cleared"):
            tier.clear_objects()
        assert len(tier_files(shm_root)) == 1, "a refused clear removed objects"
        release.set()
        assert completed(tier.get_store_event_fd(), lambda: tier.pop_completed_store_tasks().get(task)).is_successful()
        assert tier.clear_objects() == 2 and tier_files(shm_root) == set()
    finally:
        release.set()
        tier.close()


def _store_one(tier, i: int, payload: bytes) -> bool:
    task = tier.submit_store_task([_key(i)], [CallerBuffer(payload)])
    return completed(tier.get_store_event_fd(), lambda: tier.pop_completed_store_tasks().get(task)).is_successful()


def test_a_big_task_copied_on_several_threads_comes_back_byte_equal_with_failures_isolated(shm_root, monkeypatch):
    from lmcache_r3.tiers.shm_adapter import ShmL2Adapter

    tier = ShmL2Adapter(
        {
            "root": shm_root,
            "capacity_bytes": 64 << 20,
            "io_threads": 3,
            "parallel_min_bytes": 1 << 20,
            "parallel_min_object_bytes": 1 << 18,
        }
    )
    try:
        keys = [_key(i) for i in range(10)]
        values = [bytes([i]) * (300_000 + i) for i in range(10)]  # 3 MB a task: several lanes
        real_put = tier._store.put
        lanes: set[str] = set()

        def put(name, data, buffers):
            import threading

            lanes.add(threading.current_thread().name)
            if name == tier._name(keys[4]):
                raise OSError("injected")
            return real_put(name, data, buffers)

        monkeypatch.setattr(tier._store, "put", put)
        store = tier.submit_store_task(keys, [CallerBuffer(v) for v in values])
        result = completed(tier.get_store_event_fd(), lambda: tier.pop_completed_store_tasks().get(store))
        assert not result.is_successful(), "a store with a failed object must fail"
        assert tier.report_status()["objects"] == 9
        assert len(lanes) >= 2, f"the task ran on {sorted(lanes)} only"
        assert tier.report_status()["counters"]["errors"] == 1

        buffers = [CallerBuffer(bytes(len(v))) for v in values]
        load = tier.submit_load_task(keys, buffers)
        loaded = completed(tier.get_load_event_fd(), lambda: tier.query_load_result(load))
        assert [loaded.test(i) for i in range(10)] == [i != 4 for i in range(10)]
        assert all(bytes(b.data) == v for i, (b, v) in enumerate(zip(buffers, values, strict=True)) if i != 4)
        assert bytes(buffers[4].data) == bytes(len(values[4])), "a missing object's buffer was written"
    finally:
        tier.close()


class SizedBuffer(CallerBuffer):
    """A caller buffer that tells its size, as LMCache's memory objects do (the tier decides where a task runs by the
    bytes it moves)."""

    def get_size(self) -> int:
        return len(self.data)


def _recording_threads(monkeypatch, tier, names=("put", "exists", "get_into")) -> list[str]:
    import threading

    threads: list[str] = []
    for name in names:
        real = getattr(tier._store, name)

        def recorded(*args, _real=real, **kwargs):
            threads.append(threading.current_thread().name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(tier._store, name, recorded)
    return threads


@pytest.mark.parametrize("count", [4, 32], ids=["4 objects", "inline_max_objects"])
def test_small_tasks_on_tmpfs_complete_on_the_callers_thread_before_submit_returns(shm_root, monkeypatch, count):
    import threading

    from lmcache_r3.tiers.shm_adapter import ShmL2Adapter

    tier = ShmL2Adapter({"root": shm_root, "capacity_bytes": 8 << 20})
    try:
        threads = _recording_threads(monkeypatch, tier)
        keys, values = [_key(i) for i in range(count)], [bytes([i]) * 50_000 for i in range(count)]
        store = tier.submit_store_task(keys, [SizedBuffer(v) for v in values])
        assert _signalled(tier.get_store_event_fd(), 0), "the event fd was not signalled when the submit returned"
        assert tier.pop_completed_store_tasks()[store].is_successful()
        lookup = tier.submit_lookup_and_lock_task(keys, {})
        assert _signalled(tier.get_lookup_and_lock_event_fd(), 0)
        assert tier.query_lookup_and_lock_result(lookup).popcount() == count
        buffers = [SizedBuffer(bytes(50_000)) for _ in values]
        load = tier.submit_load_task(keys, buffers)
        assert _signalled(tier.get_load_event_fd(), 0)
        assert tier.query_load_result(load).popcount() == count
        tier.submit_unlock(keys)
        assert [bytes(b.data) for b in buffers] == values
        assert set(threads) == {threading.current_thread().name}
        status = tier.report_status()
        assert status["locked_keys"] == 0 and status["pending_tasks"] == 0
        assert status["on_tmpfs"] and (status["inline_max_bytes"], status["inline_max_objects"]) == (4 << 20, 32)
    finally:
        tier.close()


@pytest.mark.parametrize(
    "params, count, size",
    [
        pytest.param({}, 1, 5 << 20, id="a task over inline_max_bytes"),
        pytest.param({}, 33, 1000, id="a task over inline_max_objects"),
        pytest.param({"inline_max_bytes": 0}, 1, 1000, id="inline_max_bytes 0"),
        pytest.param({"durable": True}, 1, 1000, id="a durable store"),
    ],
)
def test_other_tasks_run_on_the_tiers_workers(shm_root, monkeypatch, params, count, size):
    from lmcache_r3.tiers.shm_adapter import ShmL2Adapter

    tier = ShmL2Adapter({"root": shm_root, "capacity_bytes": 16 << 20, **params})
    try:
        threads = _recording_threads(monkeypatch, tier, ("put", "exists", "get_into"))
        keys = [_key(i) for i in range(count)]
        store = tier.submit_store_task(keys, [SizedBuffer(bytes([i]) * size) for i in range(count)])
        assert completed(tier.get_store_event_fd(), lambda: tier.pop_completed_store_tasks().get(store)).is_successful()
        lookup = tier.submit_lookup_and_lock_task(keys, {})
        found = completed(tier.get_lookup_and_lock_event_fd(), lambda: tier.query_lookup_and_lock_result(lookup))
        assert found.popcount() == count
        buffers = [SizedBuffer(bytes(size)) for _ in range(count)]
        load = tier.submit_load_task(keys, buffers)
        assert completed(tier.get_load_event_fd(), lambda: tier.query_load_result(load)).popcount() == count
        tier.submit_unlock(keys)
        assert [bytes(b.data) for b in buffers] == [bytes([i]) * size for i in range(count)]
        lookups = "shm-l2-lookup" if count > 32 or params else "MainThread"  # a one-key lookup of an inline tier
        assert {thread.split("_")[0] for thread in threads} == {"shm-l2-store", lookups, "shm-l2-load"}
        if params:  # what /status says of it
            assert tier.report_status()["inline_max_bytes"] == 0
    finally:
        tier.close()


def test_an_inline_task_that_fails_or_stalls_completes_as_failed_without_raising(shm_root, monkeypatch):
    import threading
    import time

    from lmcache_r3.tiers.shm_adapter import ShmL2Adapter

    tier = ShmL2Adapter({"root": shm_root, "capacity_bytes": 8 << 20, "task_timeout_seconds": 0.2})
    try:
        monkeypatch.setattr(tier._store, "put", lambda *args: (_ for _ in ()).throw(OSError("injected")))
        store = tier.submit_store_task([_key(1)], [SizedBuffer(b"x" * 1000)])
        assert _signalled(tier.get_store_event_fd(), 0)
        assert not tier.pop_completed_store_tasks()[store].is_successful()

        release = threading.Event()
        monkeypatch.setattr(tier._store, "get_into", lambda key, buf, buffers: (release.wait(1.0), None)[1])
        started = time.monotonic()
        load = tier.submit_load_task([_key(1)], [SizedBuffer(bytes(1000))])  # inline: the caller waits it out
        assert time.monotonic() - started >= 0.9
        assert tier.query_load_result(load).popcount() == 0
        status = tier.report_status()
        assert status["counters"]["timeouts"] == 1 and status["pending_tasks"] == 0 and not status["is_healthy"]
    finally:
        tier.close()


def test_an_eviction_during_a_lookup_skips_the_keys_it_already_found(shm_root, monkeypatch):
    from lmcache_r3.tiers.shm_adapter import ShmL2Adapter

    tier = ShmL2Adapter({"root": shm_root, "capacity_bytes": 8 << 20})
    try:
        keys = [_key(1), _key(2)]
        store = tier.submit_store_task(keys, [SizedBuffer(b"a" * 1000), SizedBuffer(b"b" * 1000)])
        assert completed(tier.get_store_event_fd(), lambda: tier.pop_completed_store_tasks().get(store)).is_successful()
        real_exists = tier._store.exists

        def evict_the_first_before_the_second(name):
            if name == tier._name(keys[1]):
                tier.delete([keys[0]])  # LMCache's eviction thread, between the two existence checks
            return real_exists(name)

        monkeypatch.setattr(tier._store, "exists", evict_the_first_before_the_second)
        lookup = tier.submit_lookup_and_lock_task(keys, {})
        found = completed(tier.get_lookup_and_lock_event_fd(), lambda: tier.query_lookup_and_lock_result(lookup))
        assert found.popcount() == 2
        assert tier.report_status()["counters"]["delete_skipped_locked"] == 1
        buffers = [SizedBuffer(bytes(1000)), SizedBuffer(bytes(1000))]
        load = tier.submit_load_task(keys, buffers)
        assert completed(tier.get_load_event_fd(), lambda: tier.query_load_result(load)).popcount() == 2
        tier.submit_unlock(keys)
        assert [bytes(b.data) for b in buffers] == [b"a" * 1000, b"b" * 1000]
    finally:
        tier.close()


def test_a_big_task_of_small_objects_is_copied_on_one_thread(shm_root, monkeypatch):
    from lmcache_r3.tiers.shm_adapter import ShmL2Adapter

    tier = ShmL2Adapter(
        {"root": shm_root, "capacity_bytes": 64 << 20, "io_threads": 2, "parallel_min_bytes": 1 << 20,
         "inline_max_bytes": 0}
    )  # fmt: skip
    try:
        threads = _recording_threads(monkeypatch, tier, ("put",))
        values = [bytes([i]) * 100_000 for i in range(30)]  # 3 MB in all, 100 KB each: below 1 MiB an object
        store = tier.submit_store_task([_key(i) for i in range(30)], [SizedBuffer(v) for v in values])
        assert completed(tier.get_store_event_fd(), lambda: tier.pop_completed_store_tasks().get(store)).is_successful()
        assert len(set(threads)) == 1 and len(threads) == 30
    finally:
        tier.close()


def _stored(tier, i: int, payload: bytes) -> bool:
    task = tier.submit_store_task([_key(i)], [SizedBuffer(payload)])
    return completed(tier.get_store_event_fd(), lambda: tier.pop_completed_store_tasks().get(task)).is_successful()


def _loaded(tier, i: int, size: int) -> bytes | None:
    buffer = SizedBuffer(bytes(size))
    task = tier.submit_load_task([_key(i)], [buffer])
    return (
        bytes(buffer.data)
        if completed(tier.get_load_event_fd(), lambda: tier.query_load_result(task)).popcount()
        else None
    )


@pytest.fixture
def quiet_tier(shm_root, monkeypatch):
    """A 1 MiB shm tier whose watchdog does no tier maintenance: the test runs each reconciliation itself."""
    from lmcache_r3.tiers.shm_adapter import ShmL2Adapter

    tier = ShmL2Adapter({"root": shm_root, "capacity_bytes": 1 << 20})
    monkeypatch.setattr(tier, "_maintain_tier", lambda: None)
    yield tier
    tier.close()


def test_an_eviction_between_a_keys_check_and_its_lock_leaves_the_key_locked_and_loadable(quiet_tier, monkeypatch):
    tier = quiet_tier
    assert _stored(tier, 1, b"k" * 1000)
    real_exists = tier._store.exists

    def evicted_right_after_the_check(name):
        found = real_exists(name)
        tier.delete([_key(1)])  # LMCache's eviction thread, after the check answered
        return found

    monkeypatch.setattr(tier._store, "exists", evicted_right_after_the_check)
    lookup = tier.submit_lookup_and_lock_task([_key(1)], {})
    assert completed(tier.get_lookup_and_lock_event_fd(), lambda: tier.query_lookup_and_lock_result(lookup)).popcount()
    monkeypatch.setattr(tier._store, "exists", real_exists)
    assert tier.report_status()["counters"]["delete_skipped_locked"] == 1
    assert _loaded(tier, 1, 1000) == b"k" * 1000, "a key the lookup reported locked was deleted under the lock"
    tier.submit_unlock([_key(1)])


def test_a_key_stored_again_while_the_reconciliation_asks_the_store_stays_known(quiet_tier, monkeypatch):
    tier = quiet_tier
    big = 400 << 10
    for i in (1, 2, 3):  # the third evicts the first (1 MiB)
        assert _stored(tier, i, bytes([i]) * big)
    evicted = tier._name(_key(1))
    assert not tier._store.exists(evicted)
    real_exists = tier._store.exists

    def checked_then_stored_again(name):
        found = real_exists(name)
        if name == evicted and not found:
            assert _stored(tier, 1, b"\x01" * big)  # a store lands between the check and its use
        return found

    monkeypatch.setattr(tier._store, "exists", checked_then_stored_again)
    tier._reconcile()
    monkeypatch.setattr(tier._store, "exists", real_exists)
    assert evicted in tier._known, "a key stored again was reported deleted to LMCache"
    assert _loaded(tier, 1, big) == b"\x01" * big


def test_an_eviction_is_reported_to_lmcache_although_a_reconciliation_ran_while_its_files_were_removed(
    quiet_tier, monkeypatch
):
    tier = quiet_tier
    big = 400 << 10
    assert _stored(tier, 1, b"\x01" * big) and _stored(tier, 2, b"\x02" * big)
    real_drop = tier._store._drop

    def reconciled_first(*args):
        tier._reconcile()  # the watchdog, after the store chose its victims and before it removed them
        return real_drop(*args)

    monkeypatch.setattr(tier._store, "_drop", reconciled_first)
    assert _stored(tier, 3, b"\x03" * big)  # evicts the first
    monkeypatch.setattr(tier._store, "_drop", real_drop)
    tier._reconcile()
    assert tier._name(_key(1)) not in tier._known, "LMCache still counts an object the tier evicted"
    assert tier.report_status()["counters"]["removed_by_store"] == 1


def test_the_watchdog_tidies_the_root_so_a_departed_servers_free_files_are_reused(shm_root, monkeypatch):
    from lmcache_r3.tiers import shm_store
    from lmcache_r3.tiers.shm_adapter import ShmL2Adapter

    tier = ShmL2Adapter({"root": shm_root, "capacity_bytes": 1 << 20})
    try:
        departed = shm_store.ShmObjectStore(tier._store.root, capacity_bytes=1 << 20)
        departed.put(b"gone", b"g" * 5000)
        departed.delete([b"gone"])
        free_files_of_a_departed_process(tier._store.root)
        monkeypatch.setattr(shm_store, "STALE_TEMP_SECONDS", 0.0)
        monkeypatch.setattr(tier, "_next_tidy", 0.0)
        deadline = time.monotonic() + 5
        while not tier._store.pooled_bytes() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tier._store.pooled_bytes(), "the watchdog never adopted the free file"
        assert _stored(tier, 7, b"n" * 5000) and tier._store.stats()["recycled"] == 1
        assert _loaded(tier, 7, 5000) == b"n" * 5000
    finally:
        tier.close()


def test_a_lookup_while_an_eviction_removes_the_key_is_a_miss_never_a_locked_hit(quiet_tier, monkeypatch):
    """LMCache's eviction thread chose the key (unlocked) and is removing it when a lookup locks and finds it."""
    tier = quiet_tier
    assert _stored(tier, 1, b"k" * 1000)
    real_remove = tier._remove
    answers = []

    def lookup_meanwhile(names):
        lookup = tier.submit_lookup_and_lock_task([_key(1)], {})
        answers.append(
            completed(tier.get_lookup_and_lock_event_fd(), lambda: tier.query_lookup_and_lock_result(lookup))
        )
        return real_remove(names)

    monkeypatch.setattr(tier, "_remove", lookup_meanwhile)
    tier.delete([_key(1)])
    assert answers[0].popcount() == 0, "the lookup reported a key locked that the eviction then removed"
    assert not tier._locks and not tier._deleting
    assert _loaded(tier, 1, 1000) is None
