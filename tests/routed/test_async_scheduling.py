"""Routed experts under vLLM's async scheduling, its default on GPU (the CPU platform turns it off, so the engine tests
cannot run it): the real ``AsyncScheduler`` and both connector roles, stepped as ``EngineCore.step_with_batch_queue``
steps them, with a real LMCache server.

Async scheduling changes three orders the routed-experts bookkeeping depends on: step N+1 is scheduled (blocks handed
out, LMCache rows written, vLLM prefix hits taken) before step N's rows arrive; a request that stops on a token keeps
running one more step, which computes that last token (a row no output carries); and a block freed while a step in
flight still writes it goes back to the pool only once that step's output is processed.
Each test compares every returned row with :class:`tests.support.harness.EmulatedRouter`'s rows for the same tokens,
as the synchronous tests do.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.routed.test_harness_routed import (
    chunked_prefill_of_concurrent_requests_then_lmcache_hits,
    cold_then_lmcache_hit_then_prefix_cache_hit,
    expected_rows,
    preempted_requests_return_exact_rows,
    prompt,
    returned_rows,
)
from tests.support.harness import wait_locks

pytestmark = [pytest.mark.server, pytest.mark.harness]

CONNECTOR = "lmcache_r3.mp.connector"
CHUNK = 64


@pytest.fixture
def async_harness(own_r3_server, scheduler_harness_factory):  # the server outlives the harnesses
    def build(**overrides):
        return scheduler_harness_factory(
            server=own_r3_server, connector_module=CONNECTOR, routed_experts=True, async_scheduling=True, **overrides
        )

    return build


def test_the_harness_runs_vllms_async_scheduler_with_two_steps_in_flight(async_harness):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    harness = async_harness()
    assert isinstance(harness.scheduler, AsyncScheduler)
    assert harness.scheduler.defer_block_free, "vLLM defers freeing blocks an in-flight step may write"
    harness.add_request("r", prompt(40, seed=1), max_tokens=3)
    harness.step()
    assert harness.outputs == {} and harness.steps == 0, "the first step's output waits for the second step"
    harness.run_until_idle()
    np.testing.assert_array_equal(returned_rows(harness, "r"), expected_rows(harness, "r", prompt(40, seed=1), 3))


def test_cold_then_lmcache_hit_then_prefix_cache_hit_return_the_same_rows(async_harness, own_r3_server):
    harness = async_harness()
    cold_then_lmcache_hit_then_prefix_cache_hit(harness)
    assert harness.scheduler.connector.routed.counters.values["requests_incomplete"] == 0
    assert wait_locks(own_r3_server, 0) == 0


def test_chunked_prefill_of_concurrent_requests_sharing_prefixes_then_lmcache_hits(async_harness, own_r3_server):
    chunked_prefill_of_concurrent_requests_then_lmcache_hits(async_harness(max_num_batched_tokens=48))
    assert wait_locks(own_r3_server, 0) == 0


def test_blocks_freed_under_a_step_in_flight_and_handed_out_again_carry_only_their_new_rows(
    async_harness, own_r3_server
):
    """Requests that end on a stop token (a finish the scheduler cannot foresee, so the step after it is already
    running and writes a KV slot and a row for the request) in a small pool: their blocks are handed out again, to
    requests computing them and to requests loading their first chunk from LMCache into them. Every row of every
    request is still its own (vLLM returns a block to the pool only once the steps that write it are processed;
    this test does not isolate that: with vLLM's deferral turned off it passes too)."""
    harness = async_harness(num_blocks=14, max_num_batched_tokens=64)  # 13 usable blocks: 416 tokens
    shared = prompt(CHUNK, seed=60)
    first = {f"a{i}": shared + prompt(40 + 9 * i, seed=61 + i) for i in range(3)}
    stops = {request_id: 3 + i for i, request_id in enumerate(first)}
    for request_id, tokens in first.items():
        harness.add_request(request_id, tokens, max_tokens=30, stop_after=stops[request_id])
    harness.run_until_idle()
    harness.scheduler.connector.routed.settle(10)
    harness.reset_prefix_cache()
    # The same prompts again (LMCache hits into reused blocks), interleaved with new ones computing into them.
    second = {f"b{i}": tokens for i, tokens in enumerate(first.values())}
    second |= {f"n{i}": prompt(90 + 13 * i, seed=70 + i) for i in range(4)}
    stops |= {request_id: 2 + i % 4 for i, request_id in enumerate(second)}
    for request_id, tokens in second.items():
        harness.add_request(request_id, tokens, max_tokens=30, stop_after=stops[request_id])
    harness.run_until_idle()
    handed_out = [b for tables in harness.block_tables.values() for b in tables[0]]
    assert len(set(handed_out)) <= 13 < len(handed_out), "blocks were meant to be handed out again"
    for request_id, tokens in (first | second).items():
        expected = expected_rows(harness, request_id, tokens, stops[request_id] + 1)
        np.testing.assert_array_equal(returned_rows(harness, request_id), expected)
    lmcache = sum(harness.outputs[f"b{i}"]["lmcache_r3_sources"]["lmcache_tokens"] for i in range(3))
    assert lmcache >= 3 * CHUNK, "the repeated prompts were meant to load their first chunk from LMCache"
    assert wait_locks(own_r3_server, 0) == 0


def test_preempted_requests_return_exact_rows(async_harness, own_r3_server):
    harness = async_harness(num_blocks=14, max_num_batched_tokens=64)
    preempted_requests_return_exact_rows(harness)
    assert harness.scheduler.connector.routed.counters.values["requests_incomplete"] == 0
    assert wait_locks(own_r3_server, 0) == 0


def test_a_request_running_one_step_past_its_stop_token_returns_its_rows_and_its_chunks_serve_exactly(async_harness):
    """The step after a request's stop token is already scheduled when vLLM finishes the request, and it computes the
    KV and the row of that token, here the last position of a chunk: the output carries exactly ``num_tokens - 1``
    rows, and a request that then hits the whole sequence in LMCache gets exact rows."""
    harness = async_harness()
    tokens = prompt(2 * CHUNK - 4, seed=8)  # with its 4 output tokens: 2 chunks, the extra step computes the last one
    harness.add_request("r", tokens, max_tokens=30, stop_after=3)
    harness.run_until_idle()
    rows = returned_rows(harness, "r")
    assert harness.times_scheduled["r"] == 1 + 4, "the prefill, 3 decode steps and the step after the stop token"
    assert rows.shape[0] == 2 * CHUNK - 1
    np.testing.assert_array_equal(rows, expected_rows(harness, "r", tokens, 4))
    harness.scheduler.connector.routed.settle(10)
    harness.reset_prefix_cache()
    whole = harness.sequence("r", tokens, 4)
    harness.generate([("again", whole)], max_tokens=2)
    np.testing.assert_array_equal(returned_rows(harness, "again"), expected_rows(harness, "again", whole, 2))
    assert harness.outputs["again"]["lmcache_r3_sources"]["lmcache_tokens"] >= CHUNK
