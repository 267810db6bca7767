"""Routed experts under vLLM's async scheduling, its default on GPU (the CPU platform turns it off, so the engine tests
cannot run it): the real ``AsyncScheduler`` and both connector roles, stepped as ``EngineCore.step_with_batch_queue``
steps them, with a real LMCache server.

Async scheduling changes three orders the routed-experts bookkeeping depends on: step N+1 is scheduled (blocks handed
out, LMCache rows written, vLLM prefix hits taken) before step N's rows arrive; a request that stops on a token keeps
running one more step, which computes that last token (a row no output carries); and a block freed while a step in
flight still writes it goes back to the pool only once that step's output is processed.
Speculative decoding under async scheduling (EAGLE, MTP, ngram_gpu on a GPU) adds a fourth: the scheduler schedules
placeholder drafts and counts them as computed until it processes their step, while the model runner, which fills the
drafts in, already knows which were rejected and computes the next step at the corrected positions, in slots the
scheduler still counts as holding drafts.
Each test compares every returned row with :class:`tests.support.harness.EmulatedRouter`'s rows for the same tokens,
as the synchronous tests do.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.routed.test_harness_routed import (
    CHUNK,
    CONNECTOR,
    SPECULATIVE,
    chunked_prefill_of_concurrent_requests_then_lmcache_hits,
    cold_then_lmcache_hit_then_prefix_cache_hit,
    expected_rows,
    preempted_requests_return_exact_rows,
    returned_rows,
    speculative_drafts_return_and_publish_only_accepted_rows,
)
from tests.support.harness import wait_locks
from tests.support.prompts import seeded_prompt

pytestmark = [pytest.mark.server, pytest.mark.harness]


@pytest.fixture(scope="module")
def async_server(r3_server_factory):
    """One R3 server for this module (the sync tests share another, so the same scenarios start cold here too).
    Every test here leaves no lock behind, so a test that asserts zero locks at its end counts only its own."""
    server = r3_server_factory()
    yield server
    server.stop()


@pytest.fixture
def async_harness(async_server, scheduler_harness_factory):
    def build(**overrides):
        return scheduler_harness_factory(
            server=async_server, connector_module=CONNECTOR, routed_experts=True, async_scheduling=True, **overrides
        )

    return build


def test_the_harness_runs_vllms_async_scheduler_with_two_steps_in_flight(async_harness):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    harness = async_harness()
    assert isinstance(harness.scheduler, AsyncScheduler)
    assert harness.scheduler.defer_block_free, "vLLM defers freeing blocks an in-flight step may write"
    harness.add_request("r", seeded_prompt(40, seed=1), max_tokens=3)
    harness.step()
    assert harness.outputs == {} and harness.steps == 0, "the first step's output waits for the second step"
    harness.run_until_idle()
    np.testing.assert_array_equal(
        returned_rows(harness, "r"), expected_rows(harness, "r", seeded_prompt(40, seed=1), 3)
    )


def test_cold_then_lmcache_hit_then_prefix_cache_hit_return_the_same_rows(async_harness, async_server):
    harness = async_harness()
    cold_then_lmcache_hit_then_prefix_cache_hit(harness, seed=1003)
    assert harness.scheduler.connector.routed.counters.values["requests_incomplete"] == 0
    assert wait_locks(async_server, 0) == 0


def test_chunked_prefill_of_concurrent_requests_sharing_prefixes_then_lmcache_hits(async_harness, async_server):
    chunked_prefill_of_concurrent_requests_then_lmcache_hits(async_harness(max_num_batched_tokens=48))
    assert wait_locks(async_server, 0) == 0


def test_blocks_freed_under_a_step_in_flight_and_handed_out_again_carry_only_their_new_rows(
    async_harness, async_server
):
    """Requests that end on a stop token (a finish the scheduler cannot foresee, so the step after it is already
    running and writes a KV slot and a row for the request) in a small pool: their blocks are handed out again, to
    requests computing them and to requests loading their first chunk from LMCache into them. Every row of every
    request is still its own (vLLM returns a block to the pool only once the steps that write it are processed;
    this test does not isolate that: with vLLM's deferral turned off it passes too)."""
    harness = async_harness(num_blocks=14, max_num_batched_tokens=64)  # 13 usable blocks: 416 tokens
    shared = seeded_prompt(CHUNK, seed=60)
    first = {f"a{i}": shared + seeded_prompt(40 + 9 * i, seed=61 + i) for i in range(3)}
    stops = {request_id: 3 + i for i, request_id in enumerate(first)}
    for request_id, tokens in first.items():
        harness.add_request(request_id, tokens, max_tokens=30, stop_after=stops[request_id])
    harness.run_until_idle()
    harness.reset_prefix_cache()
    # The same prompts again (LMCache hits into reused blocks), interleaved with new ones computing into them.
    second = {f"b{i}": tokens for i, tokens in enumerate(first.values())}
    second |= {f"n{i}": seeded_prompt(90 + 13 * i, seed=70 + i) for i in range(4)}
    stops |= {request_id: 2 + i % 4 for i, request_id in enumerate(second)}
    for request_id, tokens in second.items():
        harness.add_request(request_id, tokens, max_tokens=30, stop_after=stops[request_id])
    harness.run_until_idle()
    handed_out = [b for tables in harness.block_tables.values() for b in tables[0]]
    assert len(set(handed_out)) <= 13 < len(handed_out), "blocks were meant to be handed out again"
    for request_id, tokens in (first | second).items():
        expected = expected_rows(harness, request_id, tokens, stops[request_id] + 1)
        np.testing.assert_array_equal(returned_rows(harness, request_id), expected)
    # Each repeated prompt's first chunk comes from LMCache, or from vLLM's own cache where another one's load from
    # LMCache completed before this one's lookup answered (a busy machine); it is never computed again.
    sources = {f"b{i}": harness.outputs[f"b{i}"]["lmcache_r3_sources"] for i in range(3)}
    connector = harness.scheduler.connector
    why = (sources, connector.counters.values, connector.routed.counters.values)  # which path a failure took
    for request_id, source in sources.items():
        assert source["lmcache_tokens"] + source["vllm_cached_tokens"] >= CHUNK, (request_id, why)
    assert sum(s["lmcache_tokens"] for s in sources.values()) >= CHUNK, ("nothing loaded from LMCache", why)
    assert wait_locks(async_server, 0) == 0


def test_preempted_requests_return_exact_rows(async_harness, async_server):
    harness = async_harness(num_blocks=14, max_num_batched_tokens=64)
    preempted_requests_return_exact_rows(harness)
    assert harness.scheduler.connector.routed.counters.values["requests_incomplete"] == 0
    assert wait_locks(async_server, 0) == 0


def test_a_request_running_one_step_past_its_stop_token_returns_its_rows_and_its_chunks_serve_exactly(async_harness):
    """The step after a request's stop token is already scheduled when vLLM finishes the request, and it computes the
    KV and the row of that token, here the last position of a chunk: the output carries exactly ``num_tokens - 1``
    rows, and a request that then hits the whole sequence in LMCache gets exact rows."""
    harness = async_harness()
    # with its 4 output tokens: 2 chunks, the extra step computes the last one
    tokens = seeded_prompt(2 * CHUNK - 4, seed=8)
    harness.add_request("r", tokens, max_tokens=30, stop_after=3)
    harness.run_until_idle()
    rows = returned_rows(harness, "r")
    assert harness.times_scheduled["r"] == 1 + 4, "the prefill, 3 decode steps and the step after the stop token"
    assert rows.shape[0] == 2 * CHUNK - 1
    np.testing.assert_array_equal(rows, expected_rows(harness, "r", tokens, 4))
    harness.reset_prefix_cache()
    whole = harness.sequence("r", tokens, 4)
    harness.generate([("after-stop", whole)], max_tokens=2)
    np.testing.assert_array_equal(returned_rows(harness, "after-stop"), expected_rows(harness, "after-stop", whole, 2))
    assert harness.outputs["after-stop"]["lmcache_r3_sources"]["lmcache_tokens"] >= CHUNK


def test_speculative_drafts_under_async_scheduling_return_and_publish_only_accepted_rows(async_harness, async_server):
    """The runner fills in the placeholder drafts (one in three wrong) and computes each step at positions corrected
    for the drafts it rejected in the step before; every returned row and every chunk served from LMCache later is
    the accepted sequence's."""
    harness = async_harness(**SPECULATIVE)
    speculative_drafts_return_and_publish_only_accepted_rows(harness)
    assert harness.positions_corrected > 0, "steps ran at positions the scheduler had not rolled back yet"
    assert harness.scheduler.connector.routed.counters.values["requests_incomplete"] == 0
    assert wait_locks(async_server, 0) == 0


def test_concurrent_speculative_requests_under_async_scheduling_sharing_a_prefix_and_one_stop_token(async_harness):
    """Three requests decode with drafts in the same steps, two of them over a shared prompt prefix (vLLM's prefix
    hit for the later one), one ending on a stop token the scheduler cannot foresee: each returns exactly its own
    rows, and a later LMCache hit on a whole sequence returns exact rows."""
    harness = async_harness(**SPECULATIVE)
    shared = seeded_prompt(CHUNK + 10, seed=21)
    prompts = {
        "a": shared + seeded_prompt(7, seed=22),
        "b": shared + seeded_prompt(19, seed=23),
        "c": seeded_prompt(50, seed=24),
    }
    outputs = {"a": 40, "b": 18, "c": 25}
    harness.add_request("a", prompts["a"], max_tokens=40)
    harness.step_until_scheduled("a")  # it computes the shared prefix before "b" arrives
    harness.add_request("b", prompts["b"], max_tokens=40, stop_after=17)
    harness.add_request("c", prompts["c"], max_tokens=25)
    harness.run_until_idle()
    assert harness.drafts_rejected > 0 and harness.positions_corrected > 0
    assert harness.outputs["b"]["lmcache_r3_sources"]["vllm_cached_tokens"] >= CHUNK
    for request_id, tokens in prompts.items():
        rows = returned_rows(harness, request_id)
        np.testing.assert_array_equal(rows, expected_rows(harness, request_id, tokens, outputs[request_id]))
    harness.reset_prefix_cache()
    whole = harness.sequence("a", prompts["a"], outputs["a"])
    harness.generate([("a-again", whole)], max_tokens=2)
    assert harness.outputs["a-again"]["lmcache_r3_sources"]["lmcache_tokens"] >= CHUNK
    np.testing.assert_array_equal(returned_rows(harness, "a-again"), expected_rows(harness, "a-again", whole, 2))
