"""The LMCache 0.5.6 / vLLM 0.32 internals lmcache_r3 relies on are where it expects them (fails on an upgrade)."""

import pytest

from lmcache_r3.mp.stock_adapter import (
    free_lookup_locks,
    frees_blocks_mid_request,
    group_windows,
    has_recurrent_group,
    report_unsubmitted_retrieve_failed,
)
from tests.support.harness import BLOCK_SIZE, SLIDING_WINDOW, lookup, wait_locks

pytestmark = pytest.mark.harness


@pytest.fixture
def own_server_factory(lmcache_server_factory, scheduler_harness_factory):
    """``() -> (server, harness)``: a server of the test's own (it counts every lock) and a dense harness on it."""

    def build():
        server = lmcache_server_factory(chunk_size=64)
        return server, scheduler_harness_factory(
            server=server, kind="dense", connector_module="lmcache_r3.mp.connector"
        )

    yield build


def test_a_refused_retrieve_is_reported_once_as_finished_and_failed(scheduler_harness_factory):
    harness = scheduler_harness_factory(kind="dense", connector_module="lmcache_r3.mp.connector")
    adapter = harness.worker.worker_adapter
    report_unsubmitted_retrieve_failed(adapter, "R", [5, 6])
    results = harness.worker.get_transfer_results(set())
    assert "R" in results.finished_recving
    assert harness.worker.get_block_ids_with_load_errors() == {5, 6}
    again = harness.worker.get_transfer_results(set())
    assert "R" not in again.finished_recving, "reported more than once"


def test_group_windows_follow_lmcache_registration(scheduler_harness_factory):
    hybrid = scheduler_harness_factory(kind="hybrid", connector_module="lmcache_r3.mp.connector")
    assert group_windows(hybrid.kv_cache_config) == [-1, BLOCK_SIZE]
    assert has_recurrent_group(hybrid.kv_cache_config)
    dense = scheduler_harness_factory(kind="dense", connector_module="lmcache_r3.mp.connector")
    assert group_windows(dense.kv_cache_config) == [-1]
    assert not has_recurrent_group(dense.kv_cache_config)
    sliding = scheduler_harness_factory(kind="sliding", connector_module="lmcache_r3.mp.connector")
    assert group_windows(sliding.kv_cache_config) == [-1, SLIDING_WINDOW]
    assert not has_recurrent_group(sliding.kv_cache_config)


def test_only_full_attention_models_keep_every_block_of_a_running_request(scheduler_harness_factory):
    """The flush before block reuse runs for every model whose groups vLLM frees in mid-request."""
    for kind, frees in (("dense", False), ("hybrid", True), ("sliding", True)):
        harness = scheduler_harness_factory(kind=kind, connector_module="lmcache_r3.mp.connector")
        assert frees_blocks_mid_request(harness.kv_cache_config) is frees, kind


def test_the_stock_connector_ends_a_finished_requests_session_through_the_deferred_hook(scheduler_harness_factory):
    """LMCache 0.5.6's ``request_finished`` ends the session via ``scheduler_adapter.end_session``: lmcache_r3's
    connector holds it until the worker reports the request's stores finished."""
    from vllm.v1.outputs import KVConnectorOutput

    harness = scheduler_harness_factory(kind="dense", connector_module="lmcache_r3.mp.connector")
    connector = harness.scheduler.connector
    delay_free, _ = connector.request_finished(harness.make_request("S", list(range(10, 50))), [])
    assert delay_free, "the stock connector frees a storing request's blocks only after its stores"
    assert connector.session_ends.pending() == 1, "the stock connector no longer ends sessions through the hook"
    connector.update_connector_output(KVConnectorOutput(finished_sending={"S"}))
    assert connector.session_ends.pending() == 0


def test_the_release_of_lookup_locks_hands_back_the_servers_answers(own_server_factory):
    """LMCache 0.5.6's release drops the server's answers; lmcache_r3's sends the same request and keeps them, so a
    finished request's session ends after its locks are released, not before."""
    server, harness = own_server_factory()
    tokens = [10 + (7 * i) % 900 for i in range(3 * 64 + 5)]
    harness.generate([("stored", tokens)], max_tokens=2)
    harness.reset_prefix_cache()
    connector = harness.scheduler.connector
    request = harness.make_request("looked-up", tokens)
    hit, _ = lookup(connector, request)
    assert hit == 3 * 64 and wait_locks(server, 3) == 3
    tracker = connector.request_trackers["looked-up"]
    answers = free_lookup_locks(connector.scheduler_adapter, tracker, 0, hit)
    assert len(answers) == 1 and answers[0].wait(5), "the server never answered the release"
    assert wait_locks(server, 0) == 0
    connector.scheduler_adapter.cleanup_lookup_result("looked-up")
