"""A request vLLM finishes (a client's abort) while its KV is still loading from LMCache.

vLLM keeps such a request's blocks until the load reports finished (``finished_recving``), then frees them and drops
the request. LMCache 0.5.6's worker reports every finished request as ``finished_sending``, the loading one too:
before the load's report, vLLM would free the blocks under the running load; after it, vLLM's
``assert req_id in self.requests`` fails; either way the engine core stops. Real vLLM scheduler and both connector
roles, a real LMCache server.
"""

import time

import pytest

from tests.support.harness import wait_locks, wait_sessions
from tests.support.processes import paused
from tests.support.prompts import seeded_prompt

pytestmark = [pytest.mark.harness, pytest.mark.server]

CHUNK = 64
CONNECTOR = "lmcache_r3.mp.connector"


def abort_between_steps_while_the_load_runs(harness, server, request_id: str) -> bool:
    """Step until a step starts the request's load, hold the server from before the worker submits it until the
    request is aborted (vLLM between two steps), so the load is still running at the abort; whether it was."""
    from vllm.v1.request import RequestStatus

    scheduler = harness.scheduler
    while request_id in scheduler.requests:
        out = scheduler.schedule()
        request = scheduler.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            scheduler.update_from_output(out, harness.run_worker(out))
            time.sleep(0.005)  # the lookup answers asynchronously
            continue
        with paused(server.pid):
            scheduler.update_from_output(out, harness.run_worker(out))
            running = request_id in harness.worker.worker_adapter.retrieve_futures  # LMCache 0.5.6's pending loads
            scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        return running
    return False


def abort_after_the_load_reported_before_its_step_is_processed(harness, server, request_id: str) -> bool:
    """vLLM's engine core processes aborts once a step's output is in, before the scheduler processes it: abort the
    request in the step whose output reports its load finished; whether that happened."""
    from vllm.v1.request import RequestStatus

    scheduler = harness.scheduler
    while request_id in scheduler.requests:
        out = scheduler.schedule()
        runner_output = harness.run_worker(out)
        loaded = request_id in (runner_output.kv_connector_output.finished_recving or ())
        if loaded:
            scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        scheduler.update_from_output(out, runner_output)
        if loaded:
            return True
    return False


@pytest.mark.parametrize("routed_experts", [False, True], ids=["kv-only", "routed-experts"])
@pytest.mark.parametrize(
    "abort", [abort_between_steps_while_the_load_runs, abort_after_the_load_reported_before_its_step_is_processed]
)
def test_a_request_aborted_while_its_kv_loads_ends_cleanly_and_the_engine_goes_on(
    own_r3_server, scheduler_harness_factory, routed_experts, abort
):
    harness = scheduler_harness_factory(server=own_r3_server, connector_module=CONNECTOR, routed_experts=routed_experts)
    scheduler = harness.scheduler
    free_blocks = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    tokens = seeded_prompt(4 * CHUNK + 19, seed=11)
    harness.generate([("cold", tokens)], max_tokens=2)
    harness.reset_prefix_cache()
    harness.add_request("warm", tokens, 2)
    assert abort(harness, own_r3_server, "warm"), "the abort did not fall in the window under test"
    harness.run_until_idle()  # vLLM's scheduler asserts here if the aborted request was freed twice
    assert "warm" not in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_blocks, "blocks were not freed"
    harness.settle_stores()
    assert wait_sessions(own_r3_server, 0) == 0, "the aborted request's session outlived it on the server"
    assert scheduler.connector.session_ends.pending() == 0
    assert wait_locks(own_r3_server, 0) == 0
    harness.generate([("again", tokens)], max_tokens=2)  # the engine goes on
    assert "again" in harness.outputs and "again" not in scheduler.requests
