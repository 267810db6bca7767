"""A request vLLM finishes (a client's abort) while its KV is still loading from LMCache.

vLLM keeps such a request's blocks until the load reports finished, and frees them then. LMCache 0.5.6's worker
reports the finished request as ``finished_sending`` at once: vLLM would free the blocks under the load and drop the
request, and the load's report that follows would fail ``assert req_id in self.requests`` in vLLM's scheduler and
stop the engine. Real vLLM scheduler and both connector roles, a real LMCache server.
"""

import numpy as np
import pytest

from lmcache_r3.mp.stock_adapter import retrieves_in_flight
from tests.support.harness import wait_locks, wait_sessions

pytestmark = [pytest.mark.harness, pytest.mark.server]

CHUNK = 64
CONNECTOR = "lmcache_r3.mp.connector"


def prompt(length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 900, size=length)]


@pytest.mark.parametrize("routed_experts", [False, True], ids=["kv-only", "routed-experts"])
def test_a_request_aborted_while_its_kv_loads_ends_cleanly_once_the_load_ends(
    own_r3_server, scheduler_harness_factory, routed_experts
):
    from vllm.v1.request import RequestStatus

    harness = scheduler_harness_factory(server=own_r3_server, connector_module=CONNECTOR, routed_experts=routed_experts)
    scheduler, adapter = harness.scheduler, harness.worker.worker_adapter
    free_blocks = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    tokens = prompt(4 * CHUNK + 19, seed=11)
    harness.generate([("cold", tokens)], max_tokens=2)
    aborted_mid_load = 0
    for attempt in range(5):  # the load must still run when the abort comes (it usually does: a few ms)
        harness.reset_prefix_cache()
        request_id = f"warm{attempt}"
        harness.add_request(request_id, tokens, 2)
        while request_id in scheduler.requests:
            harness.step()
            request = scheduler.requests.get(request_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                aborted_mid_load += request_id in retrieves_in_flight(adapter)
                scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)  # between steps, as vLLM does
                break
        harness.run_until_idle()  # vLLM's scheduler asserts here if the aborted request was freed before its load
        assert request_id not in scheduler.requests
        if aborted_mid_load:
            break
    assert aborted_mid_load, "the load always ended before the abort: the scenario never happened"
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_blocks, "blocks were not freed"
    harness.settle_stores()
    assert wait_sessions(own_r3_server, 0) == 0, "the aborted request's session outlived it on the server"
    assert scheduler.connector.session_ends.pending() == 0
    assert wait_locks(own_r3_server, 0) == 0
    harness.generate([("again", tokens)], max_tokens=2)  # the engine goes on
    assert "again" in harness.outputs and "again" not in scheduler.requests
