"""Stopping the connector: a live LMCache server is unregistered from as before; one that is gone is not waited for.

LMCache 0.5.6's worker adapter waits up to ``mq_timeout`` for the answer to its UNREGISTER, and each adapter up to
5 s for a heartbeat ping still out; after the server died every engine stop paid that (measured here: worker 30 s,
scheduler 5 s with mq_timeout 30 s), and vLLM's multiprocess executor kills a worker still running 5 s after it
was told to stop. Real vLLM scheduler, both connector roles, real LMCache server.
"""

from __future__ import annotations

import time

import pytest

from tests.support.prompts import seeded_prompt

pytestmark = [pytest.mark.server, pytest.mark.harness]

CONNECTOR = "lmcache_r3.mp.connector"
MQ_TIMEOUT_S = 30.0
SHUTDOWN_BOUND_S = 10.0
"""Well under MQ_TIMEOUT_S: a bound on a hang (the connector's own waits are 1.5 s), not a speed goal."""


def registered_instances(server) -> set[int]:
    status = server.status()
    return {int(i) for i in status["registered_gpu_ids"]} | {int(i) for i in status["registered_non_cuda_instance_ids"]}


def timed(call) -> float:
    start = time.monotonic()
    call()
    return time.monotonic() - start


def stop_both_roles(harness) -> tuple[float, float]:
    """Shut the worker and the scheduler connector down (the harness's teardown then has nothing left to do)."""
    worker_s = timed(harness.worker.shutdown)
    scheduler_s = timed(harness.scheduler.connector.shutdown)
    harness.scheduler.connector = None
    harness.worker.shutdown = lambda: None
    return worker_s, scheduler_s


@pytest.mark.parametrize("routed", [False, True], ids=["kv-only", "routed-experts"])
def test_a_live_server_is_unregistered_from_and_gets_the_batched_r3_at_shutdown(
    scheduler_harness_factory, r3_server_factory, routed
):
    """A server that answers is waited for: the unregister is answered before the stop returns, and the R3 stores
    of a request still running, batched in the scheduler, reach the server."""
    server = r3_server_factory()
    try:
        harness = scheduler_harness_factory(
            server=server, connector_module=CONNECTOR, routed_experts=routed, mq_timeout_s=MQ_TIMEOUT_S
        )
        harness.add_request("r", seeded_prompt(4 * 64 + 5, seed=1), max_tokens=20)
        harness.step_until_scheduled("r")  # the prefill of 4 chunks and their KV stores
        for _ in range(3):  # decode steps: fewer than the 8 an R3 store batch waits for
            harness.step()
        instance = harness.worker.worker_adapter.instance_id
        assert instance in registered_instances(server)
        stop_both_roles(harness)
        assert instance not in registered_instances(server), "the worker's KV caches are still registered"
        stored = server.status()["lmcache_r3"]["stored_chunks"]
        assert stored == (4 if routed else 0), f"{stored} R3 chunks reached the server, the request computed 4"
    finally:
        server.stop()


@pytest.mark.parametrize("noticed", [False, True], ids=["just-died", "heartbeat-noticed"])
@pytest.mark.parametrize("routed", [False, True], ids=["kv-only", "routed-experts"])
def test_a_dead_server_does_not_hold_the_shutdown_for_mq_timeout(
    scheduler_harness_factory, r3_server_factory, routed, noticed
):
    """The server dies after the requests were served: both roles stop within seconds, whether or not LMCache's
    heartbeat has noticed (a worker that took longer than 5 s would be killed by vLLM's executor)."""
    doomed = r3_server_factory()
    harness = scheduler_harness_factory(
        server=doomed, connector_module=CONNECTOR, routed_experts=routed, mq_timeout_s=MQ_TIMEOUT_S,
        extra_config={"lmcache_r3.r3_timeout_s": 1.0, "lmcache.mp.heartbeat_interval": 0.5 if noticed else 10.0},
    )  # fmt: skip
    harness.generate([("r", seeded_prompt(2 * 64 + 5, seed=2))], max_tokens=2)
    harness.settle_stores()
    doomed.stop()
    adapters = (harness.worker.worker_adapter, harness.scheduler.connector.scheduler_adapter)
    if noticed:
        deadline = time.monotonic() + 10
        while any(adapter.is_healthy for adapter in adapters):
            assert time.monotonic() < deadline, "LMCache's heartbeats never noticed the dead server"
            time.sleep(0.05)
    else:
        assert all(adapter.is_healthy for adapter in adapters), "the heartbeat was meant not to have noticed yet"
    worker_s, scheduler_s = stop_both_roles(harness)
    assert worker_s < SHUTDOWN_BOUND_S, f"the worker's shutdown waited {worker_s:.1f} s on a dead server"
    assert scheduler_s < SHUTDOWN_BOUND_S, f"the scheduler's shutdown waited {scheduler_s:.1f} s on a dead server"
