"""The Mooncake tier (``lmcache_r3.tiers.mooncake_adapter.MooncakeL2Adapter``) as an L2 plugin of a real LMCache
server, against a real Mooncake master and a separate holder process: R3 and KV objects served byte-equal from
Mooncake after L1 is cleared, objects larger than the client's local buffer, a master that is absent at start, killed
and restarted, or stalled; and, driving the adapter's contract directly, a corrupted object, eviction under a lock,
and a Mooncake client that throws or stalls."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid

import numpy as np
import pytest

from lmcache_r3.artifacts import R3Profile, decode_run, encode_run
from lmcache_r3.launch import LOOPBACK, ManagedProcess, ServiceStartError
from lmcache_r3.mp.r3_client import R3Client
from tests.server.test_r3_server_module import CHUNK, MODEL, PROFILE, rows_for, store_rows, tokens_for
from tests.support.l2_tasks import CallerBuffer, completed, object_key
from tests.support.mooncake import MOONCAKE_ENV, start_mooncake
from tests.support.processes import REGISTRY

pytestmark = [pytest.mark.mooncake, pytest.mark.server]

LOCAL_BUFFER = 256 << 10
WIDE = R3Profile(num_layers=128, top_k=128, num_experts=256)
"""16 KiB of routing per token: one 64-token chunk is a 1 MiB object, 4x the client's local buffer."""


def mooncake_tier(cluster, **params) -> dict:
    return {
        "type": "plugin",
        "module_path": "lmcache_r3.tiers.mooncake_adapter",
        "class_name": "MooncakeL2Adapter",
        "adapter_params": {
            "mooncake": {
                "local_hostname": LOOPBACK,
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": cluster.master_address,
                "global_segment_size": 0,
                "local_buffer_size": LOCAL_BUFFER,
                "protocol": "tcp",
            },
            "master_metrics_port": cluster.metrics_port,
            "key_prefix": f"test-{uuid.uuid4().hex[:8]}/",
            "unhealthy_for_seconds": 1.0,
            **params,
        },
    }


def start(factory, cluster, **params):
    with pytest.MonkeyPatch.context() as env:  # the server's Mooncake client stays on loopback
        for name, value in MOONCAKE_ENV.items():
            env.setenv(name, value)
        return factory(l2_adapters=(mooncake_tier(cluster, **params),))


def tier_status(server) -> dict:
    adapters = server.status()["storage_manager"]["l2_adapters"]
    return next(a for a in adapters if a.get("type") == "MooncakeL2Adapter")


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.05)
    return value


def wait_for_stored(server, count: int, timeout_s: float = 10.0) -> None:
    wait_for(lambda: tier_status(server)["counters"]["stored_objects"] >= count, timeout_s, f"{count} objects stored")


def clear_l1(server) -> None:
    wait_for(lambda: tier_status(server)["pending_tasks"] == 0, 10, "the tier idle")  # stores pin L1 objects
    server.clear_l1()
    assert server.l1_counts()["total_object_count"] == 0


def fetch_rows(r3: R3Client, tokens, profile: R3Profile = PROFILE) -> tuple[int, np.ndarray | None]:
    fetched = r3.fetch(tokens).result()
    if not fetched.num_hit_chunks:
        return 0, None
    decoded = decode_run(fetched.objects, profile, 0, CHUNK)
    assert decoded.error is None
    return fetched.num_hit_chunks, np.concatenate([c.rows for c in decoded.chunks])


def timed(call):
    began = time.monotonic()
    result = call()
    return result, time.monotonic() - began


@pytest.fixture(scope="module")
def tier_server(r3_server_factory, mooncake_cluster):
    """An R3 server whose L2 tier is the session's Mooncake, with a 256 KiB client local buffer."""
    server = start(r3_server_factory, mooncake_cluster)
    wait_for(lambda: tier_status(server)["state"] == "up", 10, "connected to the master")
    yield server
    server.stop()


@pytest.fixture
def own_cluster(tmp_path):
    """A Mooncake master and holder for one test, which may kill and restart the master."""
    cluster = start_mooncake(tmp_path / "mooncake", segment="64MB")
    REGISTRY.add(cluster.master)
    REGISTRY.add(cluster.holder)
    yield cluster
    cluster.stop()


def restart_master(cluster) -> None:
    """Start the master again on the same ports and wait until the holder has mounted its segment again."""
    old = cluster.master
    cluster.master = ManagedProcess(old.name, old.argv, old.log_path, env=MOONCAKE_ENV, listens=old.listens)
    REGISTRY.add(cluster.master)
    cluster.master.wait_ready(cluster.healthy, 20, "answering /health")
    cluster.master.wait_ready(lambda: cluster.capacity_bytes() > 0, 20, "the holder's segment mounted again")


# -- served byte-equal from Mooncake --------------------------------------------------------------------------------
def test_r3_objects_come_back_byte_equal_from_mooncake_after_l1_is_cleared(tier_server):
    tokens, rows = tokens_for(301, 3 * CHUNK), rows_for(301, 3 * CHUNK)
    with R3Client(tier_server.url, MODEL, PROFILE) as r3:
        before = tier_status(tier_server)
        assert store_rows(r3, tokens, rows).num_stored == 3
        wait_for_stored(tier_server, before["counters"]["stored_objects"] + 3)
        clear_l1(tier_server)
        hits, fetched = fetch_rows(r3, tokens)
        assert hits == 3 and np.array_equal(fetched, rows)
    status = tier_status(tier_server)
    assert status["is_healthy"] and status["state"] == "up"
    assert status["hits"] >= before["hits"] + 3 and status["bytes"] > 0 and status["errors"] == 0
    assert status["bytes_read"] > before["bytes_read"] and status["corrupt"] == 0
    for counter in ("misses", "evictions", "bytes_written", "objects"):
        assert counter in status
    assert tier_server.l1_counts()["read_locked_count"] == 0


def test_an_object_four_times_the_client_local_buffer_round_trips(tier_server):
    tokens = tokens_for(302, 2 * CHUNK)
    rows = np.random.default_rng(302).integers(0, WIDE.num_experts, (2 * CHUNK, *WIDE.row_shape)).astype(WIDE.dtype)
    assert rows[:CHUNK].nbytes == 4 * LOCAL_BUFFER
    with R3Client(tier_server.url, MODEL, WIDE) as r3:
        before = tier_status(tier_server)
        stored = r3.store(tokens, 0, encode_run(WIDE, 0, rows, CHUNK), end=len(rows)).result()
        assert stored.num_stored == 2
        wait_for_stored(tier_server, before["counters"]["stored_objects"] + 2)
        clear_l1(tier_server)
        hits, fetched = fetch_rows(r3, tokens, WIDE)
        assert hits == 2 and np.array_equal(fetched, rows)
    status = tier_status(tier_server)
    assert status["bytes_read"] - before["bytes_read"] >= rows.nbytes and status["errors"] == 0


def round_trip_kv(server, harness, seed: int) -> tuple[dict, dict]:
    """Generate a prompt of 2 full chunks + a partial tail (its KV stored behind L1), clear L1 and vLLM's cache,
    generate again: the KV must come back byte-equal from the tier. The tier's status before and after."""
    from tests.support.harness import BLOCK_SIZE

    before = tier_status(server)
    tokens = [10 + (5 * i + seed) % 1000 for i in range(4 * BLOCK_SIZE + 10)]
    harness.generate([("A", tokens)])
    saved = harness.attention_bytes(harness.block_tables["A"][0][:4])
    in_l1 = server.l1_counts()["total_object_count"]
    assert in_l1 >= 2
    wait_for_stored(server, before["counters"]["stored_objects"] + in_l1)  # the tier writes behind L1
    clear_l1(server)

    harness.reset_prefix_cache()
    harness.zero_all_blocks_but_null()
    harness.generate([("B", tokens + [900, 901])])
    assert harness.attention_bytes(harness.block_tables["B"][0][:4]) == saved, "KV from Mooncake differs"
    assert server.l1_counts()["read_locked_count"] == 0
    return before, tier_status(server)


def test_kv_blocks_come_back_byte_equal_from_mooncake(tier_server, scheduler_harness_factory):
    harness = scheduler_harness_factory(server=tier_server, kind="dense")
    try:
        before, status = round_trip_kv(tier_server, harness, seed=11)
        assert status["hits"] - before["hits"] >= 2 and status["corrupt"] == 0 and status["is_healthy"]
    finally:  # before the server goes: a connector talking to a dead server waits out its timeout
        harness.shutdown()
        harness.shutdown = lambda: None


@pytest.mark.parametrize("direct_reads", [False, True], ids=["staged reads", "direct reads"])
def test_kv_blocks_written_straight_from_the_servers_l1_come_back_byte_equal(
    r3_server_factory, mooncake_cluster, scheduler_harness_factory, direct_reads
):
    server = start(r3_server_factory, mooncake_cluster, zero_copy_min_bytes=0, direct_reads=direct_reads)
    harness = None
    try:
        wait_for(lambda: tier_status(server)["state"] == "up", 10, "connected to the master")
        assert tier_status(server)["l1_region_bytes"] > 0, "the server's L1 arena was not registered"
        harness = scheduler_harness_factory(server=server, kind="dense")
        _, status = round_trip_kv(server, harness, seed=3)
        assert status["direct_written"] >= 2, "no KV object was written straight from L1"
        assert (status["direct_read"] >= 2) == direct_reads
        assert status["hits"] >= 2 and status["corrupt"] == 0 and status["errors"] == 0
    finally:  # the harness first: a connector talking to a dead server waits out its timeout
        if harness is not None:
            harness.shutdown()
            harness.shutdown = lambda: None
        server.stop()


# -- the master comes and goes --------------------------------------------------------------------------------------
def test_the_tier_starts_unhealthy_without_a_master_and_connects_when_it_comes_up(r3_server_factory, own_cluster):
    own_cluster.master.stop()
    server, took = timed(lambda: start(r3_server_factory, own_cluster))
    try:
        assert took < 30, f"a missing master held the server's start-up for {took:.0f} s"
        status = tier_status(server)
        assert not status["is_healthy"] and status["state"] == "connecting"
        tokens, rows = tokens_for(303, 2 * CHUNK), rows_for(303, 2 * CHUNK)
        with R3Client(server.url, MODEL, PROFILE) as r3:
            assert store_rows(r3, tokens, rows).num_stored == 2  # L1 serves meanwhile
            hits, fetched = fetch_rows(r3, tokens)
            assert hits == 2 and np.array_equal(fetched, rows)

            restart_master(own_cluster)
            wait_for(lambda: tier_status(server)["is_healthy"], 15, "healthy once the master is up")
            later, later_rows = tokens_for(304, 2 * CHUNK), rows_for(304, 2 * CHUNK)
            store_rows(r3, later, later_rows)
            wait_for_stored(server, 2)
            clear_l1(server)
            hits, fetched = fetch_rows(r3, later)
            assert hits == 2 and np.array_equal(fetched, later_rows)
    finally:
        server.stop()


def test_a_killed_master_costs_bounded_misses_and_the_tier_recovers_after_a_restart(r3_server_factory, own_cluster):
    server = start(r3_server_factory, own_cluster, call_timeout_seconds=1.0)
    try:
        wait_for(lambda: tier_status(server)["state"] == "up", 10, "connected to the master")
        with R3Client(server.url, MODEL, PROFILE, timeout_s=15) as r3:
            first, first_rows = tokens_for(305, 3 * CHUNK), rows_for(305, 3 * CHUNK)
            store_rows(r3, first, first_rows)
            wait_for_stored(server, 3)

            os.kill(own_cluster.master.pid, signal.SIGKILL)
            own_cluster.master.popen.wait()
            second, second_rows = tokens_for(306, 2 * CHUNK), rows_for(306, 2 * CHUNK)
            stored, took = timed(lambda: store_rows(r3, second, second_rows))
            assert stored.num_stored == 2 and took < 3, f"a store took {took:.1f} s with the master dead"
            looked, took = timed(lambda: r3.lookup(first).result())
            assert looked.num_hit_chunks == 3 and took < 3, f"an L1 hit took {took:.1f} s with the master dead"
            wait_for(lambda: tier_status(server)["errors"] > 0, 10, "errors counted")
            clear_l1(server)
            for _ in range(3):
                looked, took = timed(lambda: r3.lookup(first).result())
                assert looked.num_hit_chunks == 0 and took < 3, f"a miss took {took:.1f} s with the master dead"
            assert server.ping(timeout_s=2)
            status = tier_status(server)
            assert not status["is_healthy"] and status["state"] == "down"

            restart_master(own_cluster)
            wait_for(lambda: tier_status(server)["is_healthy"], 15, "healthy once the master is back")
            assert tier_status(server)["recoveries"] >= 1
            assert r3.lookup(first).result().num_hit_chunks == 0  # a restarted master starts empty
            third, third_rows = tokens_for(307, 3 * CHUNK), rows_for(307, 3 * CHUNK)
            stored_before = tier_status(server)["counters"]["stored_objects"]
            store_rows(r3, third, third_rows)
            wait_for_stored(server, stored_before + 3)
            clear_l1(server)
            hits, fetched = fetch_rows(r3, third)
            assert hits == 3 and np.array_equal(fetched, third_rows)
    finally:
        server.stop()


def test_objects_mooncake_evicts_on_its_own_leave_the_tiers_key_set_and_usage(own_cluster, monkeypatch):
    # With capacity_bytes 0 LMCache never evicts from the tier; Mooncake does, without telling it. The sweep of the
    # known keys keeps the tier's key set (and LMCache's usage and eviction view) to what Mooncake still holds.
    from lmcache_r3.tiers.mooncake_adapter import MooncakeL2Adapter, mooncake_key

    for name, value in MOONCAKE_ENV.items():
        monkeypatch.setenv(name, value)
    tier = MooncakeL2Adapter(mooncake_tier(own_cluster, known_sweep_seconds=0.2)["adapter_params"])
    try:
        wait_for(lambda: tier.report_status()["state"] == "up", 10, "connected to the master")
        size = 1 << 20
        stored = [i for i in range(160) if _store(tier, i, bytes([i]) * size)]  # 160 MiB into a 64 MB segment
        names = [mooncake_key(_key(i), tier._prefix) for i in stored]

        def still_there() -> int:
            return sum(code == 1 for code in tier._store.exists(names))

        assert still_there() < len(stored), "Mooncake evicted nothing: the test stores too little"
        wait_for(lambda: tier.report_status()["objects"] == still_there(), 10, "the known keys follow Mooncake's")
        assert tier.get_usage().total_bytes_used == still_there() * size
        assert tier.report_status()["counters"]["vanished_objects"] == len(stored) - still_there()
    finally:
        tier.close()


def test_a_key_stored_again_while_the_sweep_asks_mooncake_stays_known(adapter, mooncake_store, monkeypatch):
    from lmcache_r3.tiers.mooncake_adapter import mooncake_key

    monkeypatch.setattr(adapter, "_sweep_every", 0)  # this test runs the sweep's check itself
    payload = os.urandom(4096)
    assert _store(adapter, 9, payload)
    name = mooncake_key(_key(9), adapter._prefix)
    assert mooncake_store.remove(name, True) == 0  # Mooncake evicted it on its own
    asked = adapter._store.exists

    def exists_then_stored_again(names):
        codes = asked(names)
        assert _store(adapter, 9, payload)  # a store lands between the sweep's query and its use of the answer
        return codes

    monkeypatch.setattr(adapter._store, "exists", exists_then_stored_again)
    adapter._forget_gone([name])
    monkeypatch.setattr(adapter._store, "exists", asked)
    status = adapter.report_status()
    assert status["objects"] == 1 and status["counters"]["vanished_objects"] == 0, "a stored key was forgotten"
    into = CallerBuffer(bytes(len(payload)))
    assert _load(adapter, 9, into) == 1 and into.data == payload


def stored_in_the_tier_only(server, r3: R3Client, seed: int) -> tuple[list[int], np.ndarray]:
    """Once the server's tier is up, the tokens and rows of three R3 chunks stored through it, then cleared from L1."""
    wait_for(lambda: tier_status(server)["state"] == "up", 10, "connected to the master")
    tokens, rows = tokens_for(seed, 3 * CHUNK), rows_for(seed, 3 * CHUNK)
    store_rows(r3, tokens, rows)
    wait_for_stored(server, 3)
    clear_l1(server)
    return tokens, rows


def test_a_stalled_master_never_makes_a_lookup_hang_and_the_tier_serves_again_when_it_resumes(
    r3_server_factory, own_cluster
):
    server = start(r3_server_factory, own_cluster, call_timeout_seconds=1.0)
    try:
        with R3Client(server.url, MODEL, PROFILE, timeout_s=15) as r3:
            tokens, rows = stored_in_the_tier_only(server, r3, 308)
            os.kill(own_cluster.master.pid, signal.SIGSTOP)  # the master hangs: calls neither answer nor fail
            try:
                for _ in range(3):
                    looked, took = timed(lambda: r3.lookup(tokens).result())
                    assert looked.num_hit_chunks == 0 and took < 3, f"a lookup took {took:.1f} s on a hung master"
                assert server.ping(timeout_s=2)
                status = wait_for(lambda: (s := tier_status(server))["state"] == "down" and s, 5, "marked down")
                assert not status["is_healthy"] and status["errors"] > 0
            finally:
                os.kill(own_cluster.master.pid, signal.SIGCONT)
            wait_for(lambda: tier_status(server)["is_healthy"], 15, "healthy once the master resumes")
            hits, fetched = fetch_rows(r3, tokens)  # a master that only stalled kept its objects
            assert hits == 3 and np.array_equal(fetched, rows)
    finally:
        server.stop()


def test_lookups_abandoned_while_the_tier_stalls_share_one_release_thread_and_leave_no_lock(
    lmcache_server_factory, own_cluster
):
    # The R3 module waits tier_timeout_s for a prefetch, answers a miss, and leaves the prefetch to end on its own: the
    # read locks it then takes are released by one thread for every abandoned prefetch, not by a thread each.
    from lmcache_r3.mp.server_process import r3_server_module_spec

    def factory(**overrides):
        module = r3_server_module_spec("##r3", tier_timeout_s=0.5)
        return lmcache_server_factory(chunk_size=CHUNK, server_modules=(module,), **overrides)

    pools = {"num_store_workers": 2, "num_lookup_workers": 1, "num_load_workers": 2}
    abandoned = 12
    # The monitor never probes again, so the tier does not go down and answer misses at once: every lookup's
    # existence call goes to the hung master and waits there (4 on the io threads, the others queued behind them).
    timings = {"call_timeout_seconds": 30.0, "task_timeout_seconds": 30.0, "probe_interval_seconds": 3600}
    server = start(factory, own_cluster, **timings, **pools)
    try:
        with R3Client(server.url, MODEL, PROFILE, timeout_s=15) as r3:
            tokens, rows = stored_in_the_tier_only(server, r3, 309)
            threads = _threads(server.process.pid)
            os.kill(own_cluster.master.pid, signal.SIGSTOP)  # the master hangs: the tier's calls wait
            try:
                for _ in range(abandoned):
                    assert r3.lookup(tokens).result().num_hit_chunks == 0
                module = server.status()["lmcache_r3"]
                assert module["prefetch_timeouts"] == abandoned and module["abandoned_prefetches"] == abandoned
                # New threads: the release thread, and the tier's pools may start the workers they had not yet
                # (the tier's io threads run from its start); one thread per abandoned prefetch would be
                # `abandoned` more.
                added = _threads(server.process.pid) - threads
                bound = 1 + sum(pools.values())
                assert len(added) <= bound < abandoned, f"{len(added)} threads more for {abandoned} abandoned lookups"
            finally:
                os.kill(own_cluster.master.pid, signal.SIGCONT)
            wait_for(lambda: server.status()["lmcache_r3"]["abandoned_prefetches"] == 0, 20, "prefetches ended")
            wait_for(lambda: server.l1_counts()["read_locked_count"] == 0, 5, "their read locks released")
            hits, fetched = fetch_rows(r3, tokens)
            assert hits == 3 and np.array_equal(fetched, rows)
    finally:
        server.stop()


def _threads(pid: int) -> set[str]:
    """The ids of the threads of process ``pid``."""
    return set(os.listdir(f"/proc/{pid}/task"))


def test_a_server_with_a_missing_mooncake_setting_refuses_to_start_naming_the_key(
    lmcache_server_factory, mooncake_cluster
):
    tier = mooncake_tier(mooncake_cluster)
    del tier["adapter_params"]["mooncake"]["master_server_address"]
    with pytest.raises(ServiceStartError) as failure:
        lmcache_server_factory(chunk_size=CHUNK, l2_adapters=(tier,))
    message = str(failure.value)
    assert "adapter_params.mooncake.master_server_address is required" in message, message[-2000:]
    assert '"master_server_address": "10.0.0.1:50051"' in message, "the error shows no example of the fix"


# -- a Mooncake client that throws or stalls ------------------------------------------------------------------------
class _FaultyClient:
    """The real Mooncake client, except that the named methods raise, block until released, or take ``slow_s``
    longer."""

    def __init__(self, client, methods: tuple[str, ...], fault: str, slow_s: float = 0.0) -> None:
        self._client, self._methods, self._fault, self._slow_s = client, methods, fault, slow_s
        self.release = threading.Event()
        self.returned = threading.Event()
        """Set when a faulty method's real call returned."""

    def __getattr__(self, name):
        real = getattr(self._client, name)
        if name not in self._methods:
            return real

        def faulty(*args, **kwargs):
            if self._fault == "raise":
                raise RuntimeError(f"injected: {name} failed")
            if self._fault == "slow":
                time.sleep(self._slow_s)
            else:
                self.release.wait(30)
            try:
                return real(*args, **kwargs)
            finally:
                self.returned.set()

        return faulty


def _key(i: int):
    return object_key(i, MODEL)


@pytest.fixture
def adapter(mooncake_cluster, monkeypatch):
    from lmcache_r3.tiers.mooncake_adapter import MooncakeL2Adapter

    for name, value in MOONCAKE_ENV.items():
        monkeypatch.setenv(name, value)
    params = mooncake_tier(mooncake_cluster, call_timeout_seconds=1.0, retry_after_seconds=0.5)["adapter_params"]
    tier = MooncakeL2Adapter(params)
    wait_for(lambda: tier.report_status()["state"] == "up", 10, "connected to the master")
    yield tier
    tier.close()


def _store(adapter, i: int, payload: bytes) -> bool:
    task = adapter.submit_store_task([_key(i)], [CallerBuffer(payload)])
    return completed(
        adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks().get(task)
    ).is_successful()


def _lookup(adapter, i: int) -> int:
    task = adapter.submit_lookup_and_lock_task([_key(i)], {})
    hits = completed(adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(task))
    adapter.submit_unlock([_key(i)] if hits.popcount() else [])
    return hits.popcount()


def _load(adapter, i: int, into: CallerBuffer) -> int:
    task = adapter.submit_load_task([_key(i)], [into])
    return completed(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task)).popcount()


def test_a_corrupted_object_in_mooncake_is_a_counted_miss_and_is_removed(adapter, mooncake_store):
    from lmcache_r3.tiers.mooncake_adapter import mooncake_key

    payload = os.urandom(4096)
    assert _store(adapter, 4, payload)
    name = mooncake_key(_key(4), adapter._prefix)
    stored = bytearray(mooncake_store.get(name))
    assert len(stored) == len(payload) + 32 and stored[32:] == payload
    stored[-1] ^= 0x01  # one payload bit flips while the object sits in Mooncake
    assert mooncake_store.remove(name, True) == 0 and mooncake_store.put(name, bytes(stored)) == 0

    into = CallerBuffer(bytes(len(payload)))
    assert _load(adapter, 4, into) == 0 and into.data == bytes(len(payload)), "a corrupt object reached L1"
    status = adapter.report_status()
    assert status["corrupt"] == 1 and status["objects"] == 0
    assert mooncake_store.is_exist(name) == 0, "the corrupt object stayed in Mooncake"
    assert _lookup(adapter, 4) == 0


def test_another_keys_intact_object_in_a_keys_place_is_a_counted_miss_and_never_reaches_l1(adapter, mooncake_store):
    # What a read sees when Mooncake evicts its object mid-read and reuses the memory for another of the same size.
    from lmcache_r3.tiers.mooncake_adapter import mooncake_key

    payloads = [os.urandom(4096) for _ in range(2)]
    assert _store(adapter, 7, payloads[0]) and _store(adapter, 8, payloads[1])
    name, other = (mooncake_key(_key(i), adapter._prefix) for i in (7, 8))
    assert mooncake_store.remove(name, True) == 0 and mooncake_store.put(name, bytes(mooncake_store.get(other))) == 0

    into = CallerBuffer(bytes(len(payloads[0])))
    assert _load(adapter, 7, into) == 0 and into.data == bytes(len(payloads[0])), "another key's object reached L1"
    assert adapter.report_status()["corrupt"] == 1
    assert _load(adapter, 8, into) == 1 and into.data == payloads[1]


@pytest.mark.parametrize("delta", [-1, 1])
def test_an_object_of_another_size_is_a_miss_and_never_reaches_l1(adapter, mooncake_store, delta):
    from lmcache_r3.tiers.mooncake_adapter import mooncake_key

    payload = os.urandom(4096)
    assert _store(adapter, 6, payload)
    name = mooncake_key(_key(6), adapter._prefix)
    stored = bytes(mooncake_store.get(name))
    resized = stored + b"x" if delta > 0 else stored[:-1]  # a bigger object is refused, a smaller one reads short
    assert mooncake_store.remove(name, True) == 0 and mooncake_store.put(name, resized) == 0

    into = CallerBuffer(bytes(len(payload)))
    assert _load(adapter, 6, into) == 0 and into.data == bytes(len(payload)), "a resized object reached L1"
    errors = adapter.report_status()["errors_by_code"]
    assert any(code.startswith("SIZE_MISMATCH") for code in errors), errors
    mooncake_store.remove(name, True)


@pytest.mark.parametrize(
    ("prefix", "lookalike"),
    [("team.a/", "teamXa/"), ("a(b)[c]{d}|e+?/", "e/")],  # what the prefix would match unescaped
    ids=["dot", "every syntax character"],
)
def test_a_prefix_with_regex_syntax_clears_exactly_its_own_keys_in_mooncake(mooncake_store, prefix, lookalike):
    from lmcache_r3.tiers.mooncake_store import prefix_pattern

    tag = uuid.uuid4().hex[:8]
    ours, others = [f"{prefix}{tag}/{i}" for i in range(3)], [f"{lookalike}{tag}/0", f"x{prefix}{tag}/0"]
    for key in ours + others:
        assert mooncake_store.put(key, b"v" * 8) == 0
    assert mooncake_store.remove_by_regex(prefix_pattern(f"{prefix}{tag}/"), True) == 3
    assert [mooncake_store.is_exist(key) for key in ours] == [0, 0, 0]
    assert [mooncake_store.is_exist(key) for key in others] == [1, 1], "a clear removed another prefix's keys"
    mooncake_store.batch_remove(others, True)


def test_eviction_removes_an_object_from_mooncake_but_never_a_locked_one(adapter, mooncake_store):
    from lmcache_r3.tiers.mooncake_adapter import mooncake_key

    assert _store(adapter, 5, os.urandom(2048))
    name = mooncake_key(_key(5), adapter._prefix)
    task = adapter.submit_lookup_and_lock_task([_key(5)], {})
    assert completed(adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(task))
    adapter.delete([_key(5)])  # LMCache's eviction thread, while a lookup holds the key for a load
    assert mooncake_store.is_exist(name) == 1 and adapter.report_status()["locked_keys"] == 1
    adapter.submit_unlock([_key(5)])
    adapter.delete([_key(5)])
    assert mooncake_store.is_exist(name) == 0
    status = adapter.report_status()
    assert status["evictions"] == 1 and status["objects"] == 0 and status["bytes"] == 0 and status["locked_keys"] == 0


def test_a_batch_of_thousands_of_objects_stores_loads_byte_equal_and_is_evicted(adapter, mooncake_store):
    # Mooncake fails every transfer of a client with more than ~2048 objects in flight, so the tier splits a batch
    # by object count as well as by bytes; LMCache's eviction thread deletes in batches too, and a delete is one
    # Mooncake call bounded by call_timeout_seconds (1 s here), so it must not cost a master round trip per key.
    from lmcache_r3.tiers.mooncake_adapter import mooncake_key

    keys = [_key(i) for i in range(1000, 5000)]
    payloads = [os.urandom(64) for _ in keys]
    task = adapter.submit_store_task(keys, [CallerBuffer(payload) for payload in payloads])
    stored = completed(adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks().get(task))
    assert stored.is_successful()
    names = [mooncake_key(key, adapter._prefix) for key in keys]
    assert mooncake_store.batch_is_exist(names) == [1] * len(names)

    into = [CallerBuffer(bytes(64)) for _ in keys]
    task = adapter.submit_load_task(keys, into)
    loaded = completed(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task))
    # The test master's read lease is 200 ms: on a busy machine a call of 256 reads can outlast it, and Mooncake
    # then fails those reads (LEASE_EXPIRED), a miss LMCache recomputes. Such misses are loaded once more.
    missed = [i for i in range(len(keys)) if not loaded.test(i)]
    if missed:
        task = adapter.submit_load_task([keys[i] for i in missed], [into[i] for i in missed])
        again = completed(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task))
        assert again.popcount() == len(missed), f"{len(missed)} objects missed twice"
    assert [bytes(buffer.data) for buffer in into] == payloads

    removed_already = names[::2]  # gone by other means (Mooncake's own eviction) before LMCache evicts them
    assert all(code == 0 for code in mooncake_store.batch_remove(removed_already, True))
    adapter.delete(keys)
    assert mooncake_store.batch_is_exist(names) == [0] * len(names)
    status = adapter.report_status()
    assert status["call_timeouts"] == 0 and status["state"] == "up", status
    assert status["objects"] == 0 and status["bytes"] == 0 and status["evictions"] == len(keys), status


def test_a_throwing_mooncake_client_turns_every_task_into_a_prompt_miss(adapter):
    payload = os.urandom(4096)
    assert _store(adapter, 1, payload)
    client = adapter._store._client
    client._native = _FaultyClient(
        client._native, ("batch_is_exist", "batch_get_into", "batch_put_from", "batch_remove"), "raise"
    )

    (hits, took) = timed(lambda: _lookup(adapter, 1))
    assert hits == 0 and took < 1
    into = CallerBuffer(bytes(len(payload)))
    assert _load(adapter, 1, into) == 0 and into.data == bytes(len(payload)), "a failed load wrote into L1"
    assert not _store(adapter, 2, os.urandom(64))
    adapter.delete([_key(1)])  # must not raise: a raising delete kills LMCache's eviction thread
    status = adapter.report_status()
    assert not status["is_healthy"] and status["errors"] >= 3 and status["call_exceptions"] >= 3
    assert "injected" in status["reason"]

    client._native = client._native._client  # the fault goes away: the tier serves again, byte-equal
    wait_for(lambda: adapter.report_status()["is_healthy"], 5, "healthy again")
    assert _lookup(adapter, 1) == 1 and _load(adapter, 1, into) == 1 and into.data == payload


def test_a_stalled_mooncake_call_is_abandoned_within_its_bound_and_never_writes_late(adapter):
    payload = os.urandom(4096)
    assert _store(adapter, 3, payload)
    client = adapter._store._client
    faulty = _FaultyClient(client._native, ("batch_is_exist", "batch_get_into"), "stall")
    client._native = faulty
    into = CallerBuffer(bytes(len(payload)))
    try:
        (loaded, took) = timed(lambda: _load(adapter, 3, into))
        assert loaded == 0 and took < 2, f"a stalled load took {took:.1f} s"
        status = adapter.report_status()
        assert not status["is_healthy"] and status["call_timeouts"] == 1 and status["state"] == "down"
        wait_for(lambda: adapter.report_status()["state"] == "up", 5, "calls let through again")
        (hits, took) = timed(lambda: _lookup(adapter, 3))
        assert hits == 0 and took < 2, f"a stalled lookup took {took:.1f} s"
        assert not adapter.report_status()["is_healthy"]
    finally:
        faulty.release.set()
    time.sleep(0.5)  # the abandoned calls finish now, into the tier's own staging buffers
    assert into.data == bytes(len(payload)), "an abandoned read wrote into L1 memory"
    client._native = faulty._client
    wait_for(lambda: adapter.report_status()["is_healthy"], 5, "healthy again")
    assert _load(adapter, 3, into) == 1 and into.data == payload


def test_a_put_abandoned_at_its_bound_that_lands_after_a_clear_is_removed_from_mooncake(adapter, mooncake_store):
    """The tier reported the store failed (its put call outlived the call bound), a policy update's clear came, and
    then the put Mooncake was still running stored the object after all: the tier removes it, so nothing stored
    before the clear is served after it."""
    from lmcache_r3.tiers.mooncake_adapter import mooncake_key

    assert _store(adapter, 6, os.urandom(4096))
    client = adapter._store._client
    faulty = _FaultyClient(client._native, ("batch_put_from",), "stall")
    client._native = faulty
    try:
        (stored, took) = timed(lambda: _store(adapter, 7, os.urandom(4096)))
        assert not stored and took < 3, f"a stalled put took {took:.1f} s"
        client._native = faulty._client
        wait_for(lambda: adapter.report_status()["state"] == "up", 5, "calls let through again")
        assert adapter.clear_objects() == 1
    finally:
        faulty.release.set()  # the abandoned put reaches Mooncake now, after the clear
    assert faulty.returned.wait(5), "the abandoned put never returned"
    name = mooncake_key(_key(7), adapter._prefix)
    wait_for(lambda: mooncake_store.is_exist(name) == 0, 3, "the object stored before the clear gone from Mooncake")
    status = adapter.report_status()
    assert status["late_puts"] == 1 and status["late_puts_removed"] == 1, "the late put did not store: nothing tested"
    assert _lookup(adapter, 7) == 0 and adapter.report_status()["objects"] == 0


# -- small tasks completed on the client's call threads ---------------------------------------------------------------
def _answers(client, n: int, fn, bound_s: float | None = None) -> tuple[list, threading.Event]:
    """``client.then`` on a call of ``fn``: the list its callback appends ``(codes, thread name)`` to, and an event
    set on its first answer."""
    answers: list = []
    first = threading.Event()

    def callback(codes):
        answers.append((codes, threading.current_thread().name))
        first.set()

    client.then(client.submit("test call", n, fn, bound_s=bound_s), callback)
    return answers, first


def test_a_calls_callback_answers_once_with_its_codes_or_a_failure_code(adapter):
    from lmcache_r3.tiers.mooncake_client import EXCEPTION, OBJECT_NOT_FOUND

    client = adapter._store._client
    answers, first = _answers(client, 2, lambda native: [0, OBJECT_NOT_FOUND])
    assert first.wait(5) and answers == [([0, OBJECT_NOT_FOUND], answers[0][1])]
    assert answers[0][1].startswith("mooncake-io"), "the callback did not run on the thread that made the call"
    for fn in (lambda native: 1 / 0, lambda native: [0]):  # it raises; it answers one code for two keys
        answers, first = _answers(client, 2, fn)
        assert first.wait(5) and answers[0][0] == [EXCEPTION, EXCEPTION]
    time.sleep(0.1)
    assert client.stats()["exceptions"] == 2 and client.state == "up"


def test_a_stalled_calls_callback_answers_timeout_at_its_bound_and_never_again(adapter):
    from lmcache_r3.tiers.mooncake_client import TIMEOUT

    client = adapter._store._client
    release = threading.Event()
    began = time.monotonic()
    answers, first = _answers(client, 3, lambda native: release.wait(10) and [0, 0, 0], bound_s=0.3)
    assert first.wait(5)
    took = time.monotonic() - began
    assert 0.3 <= took < 1.0, f"a call bound to 0.3 s was answered after {took:.2f} s"
    assert answers == [([TIMEOUT] * 3, "mooncake-deadlines")]
    assert client.stats()["timeouts"] == 1 and client.state == "down"
    release.set()  # the call returns late: its callback was answered already
    time.sleep(0.2)
    assert len(answers) == 1


def test_callbacks_still_waiting_when_the_client_closes_are_answered_cancelled(mooncake_cluster, monkeypatch):
    from lmcache_r3.tiers.mooncake_client import CANCELLED, BoundedMooncakeClient
    from lmcache_r3.tiers.mooncake_config import settings_from_params

    for name, value in MOONCAKE_ENV.items():
        monkeypatch.setenv(name, value)
    client = BoundedMooncakeClient(settings_from_params(mooncake_tier(mooncake_cluster)["adapter_params"]))
    release = threading.Event()
    try:
        wait_for(lambda: client.state == "up", 10, "connected to the master")
        answers, first = _answers(client, 1, lambda native: release.wait(10) and [0], bound_s=60)
        client.close()
        assert first.wait(5) and answers[0][0] == [CANCELLED]
    finally:
        release.set()
        client.close()


@pytest.mark.parametrize("inline_max_bytes", [None, 0])
def test_small_tasks_complete_on_the_clients_call_thread_unless_inline_is_off(
    mooncake_cluster, monkeypatch, inline_max_bytes
):
    """An R3-sized store and load are staged on the submitting thread and completed by the thread that made the
    Mooncake call (no store or load worker between them); with ``inline_max_bytes: 0`` the workers run them. A
    lookup's existence query is always answered on the call thread. Either way the bytes come back equal.

    Every Mooncake call here waits until its task's submit returned: a submit that waited for its call would fail
    the test, and a call can never return before its completion is registered (a done future would run it at once
    on the submitting thread, hiding which thread completes a returning call)."""
    from lmcache_r3.tiers import mooncake_store as store_module
    from lmcache_r3.tiers.mooncake_adapter import MooncakeL2Adapter

    for name, value in MOONCAKE_ENV.items():
        monkeypatch.setenv(name, value)
    extra = {} if inline_max_bytes is None else {"inline_max_bytes": inline_max_bytes}
    tier = MooncakeL2Adapter(mooncake_tier(mooncake_cluster, **extra)["adapter_params"])
    signalled: dict[str, str] = {}
    signal_kind = tier._signal
    submitted = threading.Event()

    def recording(kind):
        signalled[kind] = threading.current_thread().name
        signal_kind(kind)

    def after_submit(call):
        def held(*args, **kwargs):
            assert submitted.wait(10), "the Mooncake call ran while its task's submit had not returned"
            return call(*args, **kwargs)

        return held

    def submit(original):
        def submitting(*args):
            submitted.clear()
            try:
                return original(*args)
            finally:
                submitted.set()

        return submitting

    monkeypatch.setattr(tier, "_signal", recording)
    for name in ("_write", "_exists", "_read"):
        monkeypatch.setattr(store_module, name, after_submit(getattr(store_module, name)))
    for name in ("submit_store_task", "submit_lookup_and_lock_task", "submit_load_task"):
        monkeypatch.setattr(tier, name, submit(getattr(tier, name)))
    try:
        wait_for(lambda: tier.report_status()["state"] == "up", 10, "connected to the master")
        payloads = [_r3_payload(40 + i) for i in range(4)]
        assert _store_objects(tier, 40, [CallerBuffer(p) for p in payloads])
        keys = [_key(40 + i) for i in range(4)]
        task = tier.submit_lookup_and_lock_task(keys, {})
        hits = completed(tier.get_lookup_and_lock_event_fd(), lambda: tier.query_lookup_and_lock_result(task))
        assert hits.popcount() == 4
        into = [CallerBuffer(bytes(len(p))) for p in payloads]
        assert _load_objects(tier, 40, into) == 4 and [b.data for b in into] == payloads
        tier.submit_unlock(keys)
        assert tier.report_status()["locked_keys"] == 0
    finally:
        tier.close()
    inline = inline_max_bytes is None
    assert signalled["lookup"].startswith("mooncake-io"), signalled
    assert signalled["store"].startswith("mooncake-io" if inline else "mooncake-l2-store"), signalled
    assert signalled["load"].startswith("mooncake-io" if inline else "mooncake-l2-load"), signalled


# -- objects that move straight between LMCache's L1 and Mooncake ---------------------------------------------------
ARENA_BYTES = 8 << 20


class ArenaBuffer:
    """An L1 memory object: ``byte_array`` is a slice of the arena the adapter registered."""

    def __init__(self, arena: np.ndarray, offset: int, nbytes: int) -> None:
        self.view = arena[offset : offset + nbytes]

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self.view)


@pytest.fixture
def l1_adapter(mooncake_cluster, monkeypatch):
    """An adapter given an ``l1_memory_desc``; every object in that arena moves direct (``zero_copy_min_bytes`` 0),
    and the client's staged calls raise, so an object that went through staging fails its task."""
    from lmcache.v1.distributed.internal_api import L1MemoryDesc

    from lmcache_r3.tiers.mooncake_adapter import MooncakeL2Adapter

    for name, value in MOONCAKE_ENV.items():
        monkeypatch.setenv(name, value)
    arena = np.zeros(ARENA_BYTES, dtype=np.uint8)
    params = mooncake_tier(
        mooncake_cluster, call_timeout_seconds=1.0, retry_after_seconds=0.5, zero_copy_min_bytes=0, direct_reads=True
    )
    desc = L1MemoryDesc(ptr=arena.ctypes.data, size=arena.nbytes, align_bytes=1)
    tier = MooncakeL2Adapter(params["adapter_params"], l1_memory_desc=desc)
    wait_for(lambda: tier.report_status()["state"] == "up", 10, "connected to the master")
    wait_for(lambda: tier._store._client.region is not None, 5, "the L1 arena registered")
    client = tier._store._client
    client._native = _FaultyClient(client._native, ("batch_put_from", "batch_get_into"), "raise")
    tier.arena = arena
    yield tier
    while isinstance(client._native, _FaultyClient):
        client._native = client._native._client
    tier.close()


def _store_objects(adapter, first: int, buffers) -> bool:
    keys = [_key(first + j) for j in range(len(buffers))]
    task = adapter.submit_store_task(keys, list(buffers))
    return completed(
        adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks().get(task)
    ).is_successful()


def _load_objects(adapter, first: int, buffers) -> int:
    keys = [_key(first + j) for j in range(len(buffers))]
    task = adapter.submit_load_task(keys, list(buffers))
    return completed(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task)).popcount()


def _r3_payload(seed: int) -> bytes:
    rows = np.random.default_rng(seed).integers(0, PROFILE.num_experts, (CHUNK, *PROFILE.row_shape))
    return encode_run(PROFILE, 0, rows.astype(PROFILE.dtype), CHUNK)


@pytest.mark.parametrize("kind", ["kv", "r3"])
def test_objects_in_the_l1_arena_round_trip_byte_equal_without_staging(l1_adapter, mooncake_store, kind):
    from lmcache_r3.tiers.mooncake_adapter import mooncake_key

    arena, first = l1_adapter.arena, 40 if kind == "kv" else 50
    payloads = [os.urandom(1 << 20) for _ in range(3)] if kind == "kv" else [_r3_payload(s) for s in range(4)]
    size = len(payloads[0])
    sources = [ArenaBuffer(arena, j * size, size) for j in range(len(payloads))]
    for source, payload in zip(sources, payloads, strict=True):
        source.view[:] = np.frombuffer(payload, dtype=np.uint8)
    assert _store_objects(l1_adapter, first, sources)
    stored = bytes(mooncake_store.get(mooncake_key(_key(first), l1_adapter._prefix)))
    assert len(stored) == size + 32 and stored[32:] == payloads[0]

    targets = [ArenaBuffer(arena, ARENA_BYTES // 2 + j * size, size) for j in range(len(payloads))]
    assert _load_objects(l1_adapter, first, targets) == len(payloads)
    assert [bytes(target.view) for target in targets] == payloads
    status = l1_adapter.report_status()
    assert status["errors"] == 0 and status["corrupt"] == 0 and status["bytes_read"] >= len(payloads) * size


def _stored_from_the_arena(adapter, mooncake_store, index: int, size: int) -> tuple[str, bytes]:
    """Store ``size`` random bytes from the start of the adapter's arena under key ``index``; the Mooncake key and
    the object as Mooncake holds it (header + payload)."""
    from lmcache_r3.tiers.mooncake_adapter import mooncake_key

    source = ArenaBuffer(adapter.arena, 0, size)
    source.view[:] = np.frombuffer(os.urandom(size), dtype=np.uint8)
    assert _store_objects(adapter, index, [source])
    name = mooncake_key(_key(index), adapter._prefix)
    return name, bytes(mooncake_store.get(name))


def test_a_corrupted_object_read_straight_into_l1_is_a_counted_miss_and_is_removed(l1_adapter, mooncake_store):
    size = 256 << 10
    name, stored = _stored_from_the_arena(l1_adapter, mooncake_store, 60, size)
    stored = bytearray(stored)
    stored[1000] ^= 0x01  # one payload bit flips while the object sits in Mooncake
    assert mooncake_store.remove(name, True) == 0 and mooncake_store.put(name, bytes(stored)) == 0

    target = ArenaBuffer(l1_adapter.arena, ARENA_BYTES // 2, size)
    assert _load_objects(l1_adapter, 60, [target]) == 0, "a corrupt object was reported loaded"
    status = l1_adapter.report_status()
    assert status["corrupt"] == 1 and status["objects"] == 0
    assert mooncake_store.is_exist(name) == 0, "the corrupt object stayed in Mooncake"


@pytest.mark.parametrize("delta", [-1, 1])
def test_an_object_of_another_size_is_never_read_into_l1(l1_adapter, mooncake_store, delta):
    size = 256 << 10
    name, stored = _stored_from_the_arena(l1_adapter, mooncake_store, 61, size)
    resized = stored + b"x" if delta > 0 else stored[:-1]  # header and checksum still describe the first bytes
    assert mooncake_store.remove(name, True) == 0 and mooncake_store.put(name, resized) == 0

    target = ArenaBuffer(l1_adapter.arena, ARENA_BYTES // 2, size)
    assert _load_objects(l1_adapter, 61, [target]) == 0
    assert not target.view.any(), "a resized object was written into L1"
    errors = l1_adapter.report_status()["errors_by_code"]
    assert any(code.startswith("SIZE_MISMATCH") for code in errors), errors
    mooncake_store.remove(name, True)


def test_objects_outside_the_l1_arena_are_staged_and_round_trip(l1_adapter):
    client = l1_adapter._store._client
    client._native = client._native._client  # the staged calls work again
    payload = os.urandom(300 << 10)
    assert _store(l1_adapter, 62, payload)
    into = CallerBuffer(bytes(len(payload)))
    assert _load(l1_adapter, 62, into) == 1 and into.data == payload
    inside = ArenaBuffer(l1_adapter.arena, 0, len(payload))
    assert _load_objects(l1_adapter, 62, [inside]) == 1 and bytes(inside.view) == payload  # and the other way


def _arena_object_and_target(adapter, index: int) -> tuple[bytes, ArenaBuffer]:
    """Store 256 KiB of random bytes from the adapter's arena under key ``index``; them, and an empty load target."""
    arena, payload = adapter.arena, os.urandom(256 << 10)
    source = ArenaBuffer(arena, 0, len(payload))
    source.view[:] = np.frombuffer(payload, dtype=np.uint8)
    assert _store_objects(adapter, index, [source])
    return payload, ArenaBuffer(arena, ARENA_BYTES // 2, len(payload))


@contextlib.contextmanager
def _stalling(adapter, method: str):
    """Within the block, the adapter's Mooncake ``method`` blocks until the block ends."""
    client = adapter._store._client
    faulty = _FaultyClient(client._native, (method,), "stall")
    client._native = faulty
    try:
        yield
    finally:
        faulty.release.set()
        client._native = faulty._client  # the fixture's client again, whose staged calls raise


def test_a_direct_read_abandoned_while_the_master_stalls_never_writes_into_l1_late(l1_adapter):
    payload, target = _arena_object_and_target(l1_adapter, 63)
    with _stalling(l1_adapter, "batch_get_session_start"):
        (loaded, took) = timed(lambda: _load_objects(l1_adapter, 63, [target]))
        assert loaded == 0 and took < 2, f"a stalled direct load took {took:.1f} s"
        assert l1_adapter.report_status()["call_timeouts"] == 1
    time.sleep(0.5)  # the abandoned query returns now; its transfer must never start
    assert not target.view.any(), "an abandoned direct read wrote into L1"
    wait_for(lambda: l1_adapter.report_status()["state"] == "up", 5, "calls let through again")
    assert _load_objects(l1_adapter, 63, [target]) == 1 and bytes(target.view) == payload


def test_with_direct_reads_off_writes_go_straight_from_l1_and_reads_are_staged(mooncake_cluster, monkeypatch):
    from lmcache.v1.distributed.internal_api import L1MemoryDesc

    from lmcache_r3.tiers.mooncake_adapter import MooncakeL2Adapter

    for name, value in MOONCAKE_ENV.items():
        monkeypatch.setenv(name, value)
    arena = np.zeros(ARENA_BYTES, dtype=np.uint8)
    params = mooncake_tier(mooncake_cluster, call_timeout_seconds=1.0, zero_copy_min_bytes=0, direct_reads=False)
    tier = MooncakeL2Adapter(
        params["adapter_params"], l1_memory_desc=L1MemoryDesc(ptr=arena.ctypes.data, size=arena.nbytes, align_bytes=1)
    )
    try:
        wait_for(lambda: tier.report_status()["state"] == "up", 10, "connected to the master")
        wait_for(lambda: tier._store._client.region is not None, 5, "the L1 arena registered")
        client = tier._store._client
        # a staged write or a direct read would now fail the task
        staged_write, direct_read = "batch_put_from", "batch_get_into_multi_buffer_ranges"
        client._native = _FaultyClient(client._native, (staged_write, direct_read), "raise")
        payloads = [os.urandom(1 << 20) for _ in range(2)]
        sources = [ArenaBuffer(arena, j << 20, 1 << 20) for j in range(2)]
        for source, payload in zip(sources, payloads, strict=True):
            source.view[:] = np.frombuffer(payload, dtype=np.uint8)
        assert _store_objects(tier, 70, sources)
        targets = [ArenaBuffer(arena, ARENA_BYTES // 2 + (j << 20), 1 << 20) for j in range(2)]
        assert _load_objects(tier, 70, targets) == 2
        assert [bytes(target.view) for target in targets] == payloads
    finally:
        while isinstance(tier._store._client._native, _FaultyClient):
            tier._store._client._native = tier._store._client._native._client
        tier.close()


@pytest.mark.parametrize("pause_s", [1.0, 6.0], ids=["pause under the progress timeout", "pause over it"])
def test_a_direct_read_through_a_paused_holder_is_waited_for_and_never_writes_into_l1_late(
    tmp_path, monkeypatch, pause_s
):
    from lmcache.v1.distributed.internal_api import L1MemoryDesc

    from lmcache_r3.tiers.mooncake_adapter import MooncakeL2Adapter

    size = 32 << 20
    cluster = start_mooncake(tmp_path / "mooncake", segment=f"{(size >> 20) + 128}MB", lease_ms=None)
    REGISTRY.add(cluster.master)
    REGISTRY.add(cluster.holder)
    for name, value in MOONCAKE_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "2")
    arena = np.zeros(2 * size, dtype=np.uint8)
    params = mooncake_tier(
        cluster, call_timeout_seconds=0.5, task_timeout_seconds=1.0, zero_copy_min_bytes=0, direct_reads=True
    )["adapter_params"]
    tier = MooncakeL2Adapter(params, L1MemoryDesc(ptr=arena.ctypes.data, size=arena.nbytes, align_bytes=1))
    resume = threading.Timer(pause_s, lambda: os.kill(cluster.holder.pid, signal.SIGCONT))
    try:
        wait_for(lambda: tier.report_status()["state"] == "up", 10, "connected to the master")
        wait_for(lambda: tier._store.region is not None, 5, "the L1 arena registered")
        source, target = ArenaBuffer(arena, 0, size), ArenaBuffer(arena, size, size)
        source.view[:] = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
        assert _store_objects(tier, 80, [source])

        os.kill(cluster.holder.pid, signal.SIGSTOP)  # the holder pauses: the transfer gets no byte until it resumes
        resume.start()
        loaded, took = timed(lambda: _load_objects(tier, 80, [target]))
        # Never abandoned at the call bound (0.5 s) nor by the watchdog (1 s) while it could write into L1.
        assert took > 0.9, f"the direct read returned after {took:.2f} s, before the paused holder could answer"
        if loaded:
            assert np.array_equal(target.view, source.view), "a direct read came back with other bytes"
        else:
            assert took < pause_s - 1, f"the failed read took {took:.1f} s: the transport did not bound it"
            target.view[:] = 0xA5  # LMCache reuses the memory of a failed load
            resume.join()
            time.sleep(1.5)
            assert (target.view == 0xA5).all(), "a failed direct read wrote into L1 after it returned"
        if pause_s < 2:
            assert loaded == 1, "a pause under the transport's progress timeout must not fail the read"
        else:
            assert loaded == 0, "the read outlasted the transport's progress timeout (MC_TCP_PROGRESS_TIMEOUT_SEC)"
    finally:
        resume.cancel()
        os.kill(cluster.holder.pid, signal.SIGCONT)
        tier.close()
        cluster.stop()


def test_a_direct_load_of_many_slow_batches_ends_at_the_task_timeout_and_never_writes_into_l1_late(
    mooncake_cluster, monkeypatch
):
    """Direct reads are pipelined (the next batch takes its hold on L1 before the last one lets go), so the watchdog,
    which waits for no hold, would never find the task idle: holds asked for past the task timeout are refused."""
    from lmcache.v1.distributed.internal_api import L1MemoryDesc

    from lmcache_r3.tiers.mooncake_adapter import MooncakeL2Adapter

    for name, value in MOONCAKE_ENV.items():
        monkeypatch.setenv(name, value)
    # Each read 0.15 s slower: within the tests' 200 ms read lease (a read started later fails LEASE_EXPIRED).
    count, size, slow_s, timeout_s = 32, 256 << 10, 0.15, 0.6
    arena = np.zeros(2 * count * size, dtype=np.uint8)
    params = mooncake_tier(mooncake_cluster, zero_copy_min_bytes=0, direct_reads=True, batch_bytes=size,
                           task_timeout_seconds=timeout_s)["adapter_params"]  # fmt: skip
    tier = MooncakeL2Adapter(params, L1MemoryDesc(ptr=arena.ctypes.data, size=arena.nbytes, align_bytes=1))
    client = tier._store._client
    try:
        wait_for(lambda: tier.report_status()["state"] == "up", 10, "connected to the master")
        wait_for(lambda: client.region is not None, 5, "the L1 arena registered")
        sources = [ArenaBuffer(arena, j * size, size) for j in range(count)]
        for j, source in enumerate(sources):
            source.view[:] = np.random.default_rng(j).integers(0, 256, size, dtype=np.uint8)
        assert _store_objects(tier, 90, sources)
        targets = [ArenaBuffer(arena, (count + j) * size, size) for j in range(count)]
        client._native = _FaultyClient(client._native, ("batch_get_into_multi_buffer_ranges",), "slow", slow_s)
        task = tier.submit_load_task([_key(90 + j) for j in range(count)], list(targets))
        loaded, took = timed(lambda: completed(tier.get_load_event_fd(), lambda: tier.query_load_result(task)))
        # Uncut, the 32 one-object batches take over 2.4 s (two in flight); cut, the timeout and the reads in progress.
        assert took < timeout_s + 2 * slow_s + 0.5, f"a load of slow batches ran {took:.1f} s (timeout {timeout_s} s)"
        assert 0 < loaded.popcount() < count, f"{loaded.popcount()} of {count} objects loaded"
        for j in loaded.get_indices_list():
            assert np.array_equal(targets[j].view, sources[j].view), f"object {j} came back different"
        assert tier.report_status()["counters"]["timeouts"] == 1
        assert not tier.report_status()["is_healthy"], "a task that ran over its timeout leaves the tier healthy"
        for target in targets:
            target.view[:] = 0xA5  # LMCache reuses the memory of a failed load
        time.sleep(2 * slow_s)
        assert all((target.view == 0xA5).all() for target in targets), "a read wrote into L1 after the load ended"
    finally:
        while isinstance(client._native, _FaultyClient):
            client._native = client._native._client
        tier.close()


def test_a_direct_read_is_served_at_once_while_ending_its_session_stalls_on_the_master(l1_adapter):
    payload, target = _arena_object_and_target(l1_adapter, 64)
    with _stalling(l1_adapter, "batch_get_session_end"):
        (loaded, took) = timed(lambda: _load_objects(l1_adapter, 64, [target]))
        assert loaded == 1 and bytes(target.view) == payload
        assert took < 1.0, f"the load waited {took:.1f} s for the master to end its session"
