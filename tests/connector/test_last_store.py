"""A finished request keeps its blocks until every store of it has read them.

LMCache 0.5.6's worker remembers a request as done storing once *any* store of it completed, and reports it in
``finished_sending`` as soon as vLLM finishes it, although a later store of the same request may still be on its
way to the server. vLLM then frees the request's blocks and hands them to other requests, the server copies
whatever those blocks hold by the time it serves the store, under the first request's chunk keys, and the store
opens the request's server session again after it ended (it stays for the session TTL, 10 minutes).

Real vLLM scheduler and both connector roles, a real LMCache server (paused with SIGSTOP to keep one store in
flight). The harness has no model: it plays the requests vLLM would hand freed blocks to by writing other bytes
into every free block.
"""

import time

import pytest

from tests.support.harness import wait_sessions
from tests.support.processes import paused
from tests.support.prompts import seeded_prompt

pytestmark = [pytest.mark.harness, pytest.mark.server]

CHUNK = 64
CONNECTOR = "lmcache_r3.mp.connector"
OTHER_BYTES = 0xCD


def step_until(harness, done, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        harness.step()
        time.sleep(0.005)


def write_every_free_block(harness) -> int:
    """What the requests vLLM hands free blocks to would do: write their own KV there. The number of blocks."""
    free = harness.scheduler.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()
    for block in free:
        if block.block_id != harness.null_block_id:
            for page in harness.pages.distinct_pages(block.block_id):
                page.fill_(OTHER_BYTES)
    return len(free)


@pytest.mark.parametrize("routed_experts", [False, True], ids=["kv-only", "routed-experts"])
def test_a_request_finished_while_its_last_store_is_in_flight_keeps_its_blocks_until_the_store_read_them(
    own_r3_server, scheduler_harness_factory, routed_experts
):
    server = own_r3_server
    harness = scheduler_harness_factory(
        server=server, connector_module=CONNECTOR, routed_experts=routed_experts, max_num_batched_tokens=CHUNK
    )
    scheduler, adapter = harness.scheduler, harness.worker.worker_adapter
    tokens = seeded_prompt(2 * CHUNK + 5, seed=21)  # prefilled a chunk a step: two stores, then the last 5 tokens
    harness.add_request("r", tokens, max_tokens=1)
    request = scheduler.requests["r"]
    step_until(harness, lambda: request.num_computed_tokens >= CHUNK, "the first chunk's step")
    deadline = time.monotonic() + 20
    while "r" in adapter.store_futures:  # the first store completes and the worker takes note (as in a step)
        assert time.monotonic() < deadline, "the first store did not complete"
        harness.worker.get_transfer_results(set())
        time.sleep(0.005)
    with paused(server.pid):  # the second store stays in flight from here on
        harness.step()  # the second chunk, and its store
        assert request.num_computed_tokens == 2 * CHUNK
        blocks = scheduler.kv_cache_manager.get_block_ids("r")[0][2:4]
        computed = harness.attention_bytes(blocks)
        step_until(harness, request.is_finished, "the request's end")
        for _ in range(5):  # vLLM goes on stepping its other requests
            harness.step()
        freed_while_storing = "r" not in scheduler.requests
        write_every_free_block(harness)
    harness.run_until_idle()
    harness.settle_stores()
    assert not freed_while_storing, "vLLM freed the request's blocks while its last store was still in flight"
    assert wait_sessions(server, 0) == 0, "a store that reached the server after the session ended opened it again"

    harness.reset_prefix_cache()
    harness.zero_all_blocks_but_null()
    harness.add_request("again", tokens, max_tokens=1)
    harness.run_until_idle()
    assert harness.scheduler.connector.counters.values["retrieves"] >= 1
    again = harness.final_block_tables["again"][0][2:4]
    assert harness.attention_bytes(again) == computed, "the stored chunk is not the KV the request computed"
