"""After a policy update nothing from before is served: a clear empties L1 and the lmcache_r3 tiers below it, which
LMCache's own clear (``POST /cache/clear``, vLLM's ``reset_prefix_cache(reset_connector=True)``) leaves as they were.

Real LMCache servers with the shm tier stacked above the Mooncake tier (a real Mooncake master + holder), the real
vLLM scheduler with lmcache_r3's connector (the harness's emulated router, no model), and ``lmcache-r3 clear``.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from lmcache_r3 import cli
from lmcache_r3.launch import free_port
from lmcache_r3.mp.clearing import clear_servers
from lmcache_r3.mp.r3_client import R3Client
from lmcache_r3.tiers.mooncake_store import prefix_pattern
from tests.routed.test_harness_routed import CONNECTOR, expected_rows, returned_rows
from tests.server.test_r3_server_module import CHUNK, MODEL, PROFILE, rows_for, store_rows, tokens_for
from tests.support.l2_tasks import CallerBuffer, completed, object_key
from tests.support.mooncake import MOONCAKE_ENV
from tests.support.prompts import seeded_prompt
from tests.tiers import test_mooncake_tier as mooncake
from tests.tiers.test_shm_tier import fetch_rows, shm_root, shm_tier, tier_files, wait_for_files
from tests.tiers.test_shm_tier import tier_status as shm_status

__all__ = ["shm_root"]  # the fixture, shared with the shm tier tests

pytestmark = pytest.mark.server


def stacked_server(factory, cluster, root: str):
    """A server with the shm tier on ``root`` above the Mooncake tier of ``cluster``; and the tier's key prefix."""
    tier = mooncake.mooncake_tier(cluster)
    with pytest.MonkeyPatch.context() as env:  # the server's Mooncake client stays on loopback
        for name, value in MOONCAKE_ENV.items():
            env.setenv(name, value)
        server = factory(l2_adapters=(shm_tier(root), tier))
    mooncake.wait_for(lambda: mooncake.tier_status(server)["state"] == "up", 10, "connected to the master")
    return server, tier["adapter_params"]["key_prefix"]


def left_in_mooncake(cluster, prefix: str) -> int:
    """How many objects under ``prefix`` Mooncake still holds (a raw client removes and counts them)."""
    raw = cluster.client()
    try:
        return raw.remove_by_regex(prefix_pattern(prefix), True)
    finally:
        raw.close()


@pytest.mark.mooncake
@pytest.mark.harness
def test_a_connector_reset_after_a_weight_update_serves_nothing_from_before_from_l1_or_either_tier(
    r3_server_factory, mooncake_cluster, shm_root, scheduler_harness_factory
):
    server, prefix = stacked_server(r3_server_factory, mooncake_cluster, shm_root)
    try:
        harness = scheduler_harness_factory(server=server, connector_module=CONNECTOR, routed_experts=True)
        tokens = seeded_prompt(3 * CHUNK + 9, seed=31)
        harness.generate([("before", tokens)], max_tokens=3)
        harness.settle_stores()
        wait_for_files(shm_root, 6)  # 3 chunks: their KV and their R3
        mooncake.wait_for_stored(server, 6)

        assert harness.scheduler.reset_prefix_cache(reset_connector=True) is True
        assert tier_files(shm_root) == set(), "objects from before the reset stayed in the shm tier"
        assert left_in_mooncake(mooncake_cluster, prefix) == 0, "objects from before the reset stayed in Mooncake"
        assert server.l1_counts()["total_object_count"] == 0
        assert shm_status(server)["objects"] == 0 and mooncake.tier_status(server)["objects"] == 0
        assert shm_status(server)["counters"]["cleared_objects"] >= 6
        assert mooncake.tier_status(server)["counters"]["cleared_objects"] >= 6

        harness.generate([("after", tokens)], max_tokens=3)  # the same prompt, as the next rollout sends it
        assert harness.outputs["after"]["lmcache_r3_sources"]["lmcache_tokens"] == 0, "served from before the reset"
        np.testing.assert_array_equal(returned_rows(harness, "after"), expected_rows(harness, "after", tokens, 3))
    finally:
        server.stop()


@pytest.mark.mooncake
def test_lmcache_r3_clear_reports_what_each_tier_removed_and_every_servers_objects_on_a_shared_tier_go(
    r3_server_factory, mooncake_cluster, shm_root, capsys
):
    server, prefix = stacked_server(r3_server_factory, mooncake_cluster, shm_root)
    neighbour = r3_server_factory(l2_adapters=(shm_tier(shm_root),))  # another server of the host, same root
    try:
        with R3Client(server.url, MODEL, PROFILE) as r3, R3Client(neighbour.url, MODEL, PROFILE) as other:
            assert store_rows(r3, tokens_for(601, 2 * CHUNK), rows_for(601, 2 * CHUNK)).num_stored == 2
            assert store_rows(other, tokens_for(602, 3 * CHUNK), rows_for(602, 3 * CHUNK)).num_stored == 3
            wait_for_files(shm_root, 5)
            mooncake.wait_for_stored(server, 2)

            assert cli.main(["clear", "--url", server.url]) == 0
            report = capsys.readouterr().out
            assert '"type": "ShmL2Adapter"' in report and '"removed": 5' in report, report
            assert '"type": "MooncakeL2Adapter"' in report and '"removed": 2' in report, report
            assert tier_files(shm_root) == set() and left_in_mooncake(mooncake_cluster, prefix) == 0
            assert fetch_rows(r3, tokens_for(601, 2 * CHUNK))[0] == 0
            # The neighbour's L1 still has its own objects (a clear is per server); its tier copies are gone.
            neighbour.clear_l1()
            assert fetch_rows(other, tokens_for(602, 3 * CHUNK))[0] == 0
            assert server.status()["lmcache_r3"]["clears"] == 1
    finally:
        server.stop()
        neighbour.stop()


def test_a_tier_lmcache_r3_cannot_clear_fails_the_clear_and_the_reset_naming_it(
    r3_server_with_fs_tier, scheduler_harness_factory, capsys
):
    (answer,) = clear_servers([r3_server_with_fs_tier.url])
    (problem,) = answer.problems
    assert "FSL2Adapter is not an lmcache_r3 tier" in problem and "cache_salt" in problem, problem
    assert cli.main(["clear", "--url", r3_server_with_fs_tier.url]) == 1
    assert "not cleared" in capsys.readouterr().err
    harness = scheduler_harness_factory(server=r3_server_with_fs_tier, connector_module=CONNECTOR)
    assert harness.scheduler.reset_prefix_cache(reset_connector=True) is False


def test_an_unreachable_mooncake_master_fails_its_tiers_clear_while_the_shm_tier_is_cleared(
    r3_server_factory, shm_root
):
    nowhere = SimpleNamespace(master_address=f"127.0.0.1:{free_port()}", metrics_port=free_port())
    with pytest.MonkeyPatch.context() as env:
        for name, value in MOONCAKE_ENV.items():
            env.setenv(name, value)
        server = r3_server_factory(l2_adapters=(shm_tier(shm_root), mooncake.mooncake_tier(nowhere)))
    try:
        with R3Client(server.url, MODEL, PROFILE) as r3:
            assert store_rows(r3, tokens_for(611, 2 * CHUNK), rows_for(611, 2 * CHUNK)).num_stored == 2
        wait_for_files(shm_root, 2)
        began = time.monotonic()
        (answer,) = clear_servers([server.url])
        assert time.monotonic() - began < 10, "a clear waited on the absent master"
        shm, moon = answer.response.tiers
        assert (shm.type, shm.removed, shm.error) == ("ShmL2Adapter", 2, "")
        assert moon.type == "MooncakeL2Adapter" and moon.removed == -1 and "UNAVAILABLE" in moon.error, moon
        assert answer.problems == [f"{server.url}: L2 tier 1 (MooncakeL2Adapter): {moon.error}"]
        assert tier_files(shm_root) == set()
    finally:
        server.stop()


def test_a_server_that_does_not_answer_is_reported_within_the_bound(capsys):
    url = f"tcp://127.0.0.1:{free_port()}"
    began = time.monotonic()
    assert cli.main(["clear", "--url", url, "--timeout", "1"]) == 1
    assert time.monotonic() - began < 5
    assert f"{url} did not answer lmcache_r3's info: no server there" in capsys.readouterr().err


def test_a_clear_waits_for_the_stores_in_flight_so_none_of_their_objects_survives(shm_root, monkeypatch):
    from lmcache_r3.tiers.shm_adapter import ShmL2Adapter

    tier = ShmL2Adapter({"root": shm_root, "capacity_bytes": 1 << 20, "inline_max_bytes": 0})
    other = ShmL2Adapter({"root": shm_root, "capacity_bytes": 1 << 20})  # another server on the same root
    try:
        task = other.submit_store_task([object_key(1, "m")], [CallerBuffer(b"o" * 700)])
        assert completed(other.get_store_event_fd(), lambda: other.pop_completed_store_tasks().get(task))
        put, writing = tier._store.put, threading.Event()

        def slow_put(*args, **kwargs):
            writing.set()
            time.sleep(0.3)
            return put(*args, **kwargs)

        monkeypatch.setattr(tier._store, "put", slow_put)
        task = tier.submit_store_task([object_key(2, "m")], [CallerBuffer(b"s" * 900)])
        assert writing.wait(2)
        assert tier.clear_objects() == 2  # the store in flight landed first, then both objects went
        assert completed(tier.get_store_event_fd(), lambda: tier.pop_completed_store_tasks().get(task)).is_successful()
        assert tier_files(shm_root) == set()
        status = tier.report_status()
        assert status["objects"] == 0 and status["counters"]["clears"] == 1
        assert tier.get_usage().total_bytes_used == 0
    finally:
        tier.close()
        other.close()


@pytest.mark.harness
def test_a_reset_with_the_server_gone_answers_false_within_the_connectors_bound(
    r3_server_factory, shm_root, scheduler_harness_factory
):
    server = r3_server_factory(l2_adapters=(shm_tier(shm_root),))
    harness = scheduler_harness_factory(server=server, connector_module=CONNECTOR, mq_timeout_s=2.0)
    harness.generate([("before", seeded_prompt(2 * CHUNK + 3, seed=33))], max_tokens=2)
    harness.settle_stores()
    server.stop()
    began = time.monotonic()
    assert harness.scheduler.reset_prefix_cache(reset_connector=True) is False
    assert time.monotonic() - began < 10, "the reset waited past LMCache's mq_timeout_s for a dead server"


@pytest.mark.harness
@pytest.mark.parametrize(
    "routed_experts, reset", [(False, True), (True, False)], ids=["kv-only keeps LMCache's reset", "routed fails it"]
)
def test_a_stock_server_without_the_module_keeps_lmcaches_own_reset_and_the_cli_says_what_is_missing(
    lmcache_server, scheduler_harness_factory, capsys, routed_experts, reset
):
    """A KV-only connector's reset clears the stock server's L1, as LMCache's does; one with routed experts (which
    need the module) reports the reset failed. Neither waits out the tier clear's bound."""
    (answer,) = clear_servers([lmcache_server.url])
    assert answer.no_module and answer.problems == [] and answer.response is None
    assert cli.main(["clear", "--url", lmcache_server.url]) == 1
    assert "one without the lmcache_r3 server module" in capsys.readouterr().err
    harness = scheduler_harness_factory(connector_module=CONNECTOR, routed_experts=routed_experts)  # lmcache_server
    began = time.monotonic()
    assert harness.scheduler.reset_prefix_cache(reset_connector=True) is reset
    assert time.monotonic() - began < 10, "the reset waited out the tier clear's bound on a server without the module"


def stored_then_aborted_while_its_lookup_is_out(factory, server, seed: int):
    """A prompt stored (3 chunks), vLLM's prefix cache reset, then the same prompt asked for and aborted before its
    lookup answered (a trainer aborting its batch at a weight update): the lookup still locks its hit on the server
    when it completes. The harness, with no engine step after the abort."""
    from vllm.v1.request import RequestStatus

    from tests.support.processes import paused

    harness = factory(server=server, connector_module=CONNECTOR, routed_experts=True)
    tokens = seeded_prompt(3 * CHUNK + 9, seed=seed)
    harness.generate([("before", tokens)], max_tokens=2)
    harness.settle_stores()
    harness.reset_prefix_cache()
    harness.add_request("aborted", tokens, max_tokens=2)
    with paused(server.pid):
        harness.step()  # vLLM's ask: the lookup goes out and waits for the paused server
        harness.scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    return harness, tokens


@pytest.mark.harness
def test_an_abort_while_the_lookup_is_out_then_a_reset_at_once_clears_what_the_lookup_locked(
    own_r3_server, scheduler_harness_factory
):
    server = own_r3_server
    harness, tokens = stored_then_aborted_while_its_lookup_is_out(scheduler_harness_factory, server, seed=37)

    assert harness.scheduler.reset_prefix_cache(reset_connector=True) is True  # no engine step in between
    assert server.l1_counts()["total_object_count"] == 0, "the aborted request's lookup kept objects through the clear"
    harness.generate([("after", tokens)], max_tokens=2)
    assert harness.outputs["after"]["lmcache_r3_sources"]["lmcache_tokens"] == 0, "served from before the reset"


@pytest.mark.harness
def test_an_idle_engine_steps_until_an_aborted_requests_lookup_released_its_locks(
    own_r3_server, scheduler_harness_factory
):
    server = own_r3_server
    harness, _ = stored_then_aborted_while_its_lookup_is_out(scheduler_harness_factory, server, seed=38)

    harness.run_until_idle(max_steps=100_000)  # as vLLM steps while the scheduler reports work
    assert server.l1_counts()["read_locked_count"] == 0, "an idle engine left the aborted lookup's locks held"
    assert harness.scheduler.connector.counters.values["lookups_finished_after_request"] == 1
    assert not harness.scheduler.has_requests(), "the engine went on stepping after the locks were released"


@pytest.mark.harness
def test_a_clear_that_must_keep_objects_in_use_says_so_and_the_reset_fails(own_r3_server, scheduler_harness_factory):
    from tests.support.harness import lookup, wait_locks

    server = own_r3_server
    harness = scheduler_harness_factory(server=server, connector_module=CONNECTOR)
    tokens = seeded_prompt(3 * CHUNK + 9, seed=39)
    harness.generate([("before", tokens)], max_tokens=2)
    harness.settle_stores()
    waiting = harness.make_request("waiting", tokens + [3])
    assert lookup(harness.scheduler.connector, waiting)[0] == 3 * CHUNK  # its hit stays locked until admitted
    assert wait_locks(server, 3) == 3

    (answer,) = clear_servers([server.url])
    (problem,) = answer.problems
    assert "L1 kept 3 objects in use" in problem and "clear again" in problem, problem
    assert answer.response.l1_kept == 3
    assert harness.scheduler.connector.reset_cache() is False
