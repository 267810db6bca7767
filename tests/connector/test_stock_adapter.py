"""The LMCache 0.5.6 / vLLM 0.32 internals lmcache_r3 relies on are where it expects them (fails on an upgrade)."""

import pytest

from lmcache_r3.mp.stock_adapter import (
    frees_blocks_mid_request,
    group_windows,
    has_recurrent_group,
    report_unsubmitted_retrieve_failed,
)
from tests.support.harness import BLOCK_SIZE, SLIDING_WINDOW

pytestmark = pytest.mark.harness


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
