"""Retrieves stop at what the scheduler admitted, and lookup locks past it are released at once.

Real vLLM scheduler-side connector and worker-side connector (lmcache_r3's), a real LMCache server; the
scheduler's admission is played directly (``update_state_after_alloc`` with the blocks an async load allocates),
as vLLM does when it admits fewer external tokens than the lookup hit.
"""

import time

import pytest

from tests.support.harness import BLOCK_SIZE, lookup, wait_locks
from tests.support.processes import paused

pytestmark = pytest.mark.harness

OURS = "lmcache_r3.mp.connector"
CHUNK = 64  # the shared server's chunk size: two 32-token blocks


class AllocatedBlocks:
    """What ``kv_cache_manager.get_blocks`` hands the connector: one block-id list per KV group."""

    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self, *args, **kwargs):
        return self.ids


def prompt(seed, length):
    return [10 + (seed * 131 + 7 * i) % 1000 for i in range(length)]


def run_retrieve(harness, metadata, request_id, timeout_s=30.0, error_blocks=None):
    """Hand the scheduler's metadata to the worker as one engine step would, wait for the load's outcome (the
    block ids the worker reports failed are added to ``error_blocks`` when given), and report it to the scheduler
    side as vLLM does (``update_connector_output``)."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.outputs import KVConnectorOutput

    with set_forward_context(None, harness.vllm_config):
        harness.worker.bind_connector_metadata(metadata)
        harness.worker.start_load_kv(None)
        harness.worker.clear_connector_metadata()
    finished, failed = set(), set()
    deadline = time.monotonic() + timeout_s
    while request_id not in finished and time.monotonic() < deadline:
        results = harness.worker.get_transfer_results(set())
        finished |= set(results.finished_recving)
        errors = harness.worker.get_block_ids_with_load_errors()
        failed |= set(results.failed_recving) | ({request_id} if errors else set())
        if error_blocks is not None:
            error_blocks |= set(errors)
        time.sleep(0.01)
    harness.scheduler.connector.update_connector_output(KVConnectorOutput(finished_recving=finished & {request_id}))
    return request_id in finished, request_id in failed


def empty_scheduler_output():
    """A step that schedules nothing: enough for the connector to plan pending loads."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[],
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def admit_and_load(harness, request, tables, admitted):
    """Admit ``admitted`` external tokens into ``tables`` (one block list per group), let the connector plan the
    step (``build_connector_meta``), and run it on the worker. Returns ``(metadata, done, failed)``."""
    connector = harness.scheduler.connector
    connector.update_state_after_alloc(request, AllocatedBlocks(tables), admitted)
    metadata = connector.build_connector_meta(empty_scheduler_output())
    done, failed = run_retrieve(harness, metadata, request.request_id)
    return metadata, done, failed


def reported(harness, name):
    """How much counter ``name`` has moved in the stats the connector reported to vLLM's metrics."""
    stats = harness.logged_connector_stats()
    return 0 if stats is None else stats.counts.get(name, 0)


def stored_prompt(harness, seed, num_chunks):
    tokens = prompt(seed, num_chunks * CHUNK + 8)
    harness.generate([(f"store-{seed}", tokens)])
    blocks = harness.block_tables[f"store-{seed}"][0][: num_chunks * CHUNK // BLOCK_SIZE]
    return tokens, harness.attention_bytes(blocks)


@pytest.mark.parametrize("transfer_mode", ["lmcache_driven", "engine_driven"])
@pytest.mark.parametrize("admitted", [64, 100, 128])
def test_partial_admission_retrieves_exactly_the_admitted_chunks_and_frees_the_rest_at_once(
    scheduler_harness_factory, lmcache_server, transfer_mode, admitted
):
    harness = scheduler_harness_factory(kind="dense", connector_module=OURS, transfer_mode=transfer_mode)
    tokens, saved = stored_prompt(harness, seed=10 + admitted + len(transfer_mode), num_chunks=4)
    connector = harness.scheduler.connector
    request = harness.make_request(f"C-{admitted}", tokens + [901, 902])
    hit, is_async = lookup(connector, request)
    assert (hit, is_async) == (4 * CHUNK, True)
    assert wait_locks(lmcache_server, 4) == 4  # the lookup locked the 4 hit chunks

    # An async load allocates blocks for the admitted tokens only.
    blocks = [[40 + i for i in range(-(-admitted // BLOCK_SIZE))]]
    connector.update_state_after_alloc(request, AllocatedBlocks(blocks), admitted)
    admitted_chunks = -(-admitted // CHUNK)
    assert wait_locks(lmcache_server, admitted_chunks) == admitted_chunks, "locks past the admitted end stay held"

    metadata = connector.build_connector_meta(empty_scheduler_output())
    (retrieve,) = [m for m in metadata.requests if m.direction == "RETRIEVE"]
    assert (retrieve.op.start, retrieve.op.end) == (0, admitted_chunks * CHUNK)
    done, failed = run_retrieve(harness, metadata, request.request_id)
    assert done and not failed
    loaded = harness.attention_bytes(blocks[0])
    for layer, data in loaded.items():
        assert data == saved[layer][: len(data)], f"{layer}: loaded KV differs from what was stored"
    assert wait_locks(lmcache_server, 0) == 0
    assert reported(harness, "partial_admissions") == connector.counters.values["partial_admissions"] == 1
    harness.finish_by_hand(request, blocks[0])


def test_admission_ending_inside_an_unallocated_chunk_fails_closed_with_no_lock_left(
    scheduler_harness_factory, lmcache_server
):
    harness = scheduler_harness_factory(kind="dense", connector_module=OURS)
    tokens, _ = stored_prompt(harness, seed=55, num_chunks=4)
    connector = harness.scheduler.connector
    request = harness.make_request("P", tokens + [901])
    assert lookup(connector, request)[0] == 4 * CHUNK
    # 32 admitted tokens get one 32-token block, but the chunk holding them spans two: the coverage guard refuses.
    metadata, done, failed = admit_and_load(harness, request, [[44]], 32)
    assert [m for m in metadata.requests if m.direction == "RETRIEVE"] == []
    assert done and failed, "the refused load must be reported as finished and failed, so vLLM recomputes"
    assert wait_locks(lmcache_server, 0) == 0
    assert connector.counters.values["retrieves_failed_closed"] == 1
    assert reported(harness, "retrieves_failed_closed") == 1, "vLLM's metrics missed the refused retrieve"
    harness.finish_by_hand(request, [44])


def test_a_refused_load_reports_only_the_blocks_it_was_to_fill_never_those_of_vllms_own_hit(
    scheduler_harness_factory, lmcache_server
):
    # vLLM recomputes what a failed load names, in every running request that holds those blocks: the block of its
    # own prefix hit (41 here, valid KV shared with other requests) must not be named with the ones the load was to
    # fill.
    harness = scheduler_harness_factory(kind="dense", connector_module=OURS)
    tokens, _ = stored_prompt(harness, seed=66, num_chunks=4)
    connector = harness.scheduler.connector
    request = harness.make_request("V", tokens + [902])
    assert lookup(connector, request, BLOCK_SIZE)[0] == 4 * CHUNK - BLOCK_SIZE
    # 64 admitted tokens past vLLM's 32 end inside the second chunk, whose second block is not allocated: refused.
    connector.update_state_after_alloc(request, AllocatedBlocks([[41, 44]]), 2 * BLOCK_SIZE)
    metadata = connector.build_connector_meta(empty_scheduler_output())
    assert [m for m in metadata.requests if m.direction == "RETRIEVE"] == []
    named: set[int] = set()
    done, failed = run_retrieve(harness, metadata, request.request_id, error_blocks=named)
    assert done and failed and connector.counters.values["retrieves_failed_closed"] == 1
    assert named == {44}, "vLLM's own prefix-hit block was named failed"
    assert wait_locks(lmcache_server, 0) == 0
    harness.finish_by_hand(request, [41, 44])


def test_zero_admission_retrieves_nothing_and_holds_no_lock(scheduler_harness_factory, lmcache_server):
    harness = scheduler_harness_factory(kind="dense", connector_module=OURS)
    tokens, _ = stored_prompt(harness, seed=77, num_chunks=3)
    connector = harness.scheduler.connector
    request = harness.make_request("Z", tokens + [5])
    assert lookup(connector, request)[0] == 3 * CHUNK
    connector.update_state_after_alloc(request, AllocatedBlocks([[41]]), 0)
    assert wait_locks(lmcache_server, 0) == 0
    metadata = connector.build_connector_meta(empty_scheduler_output())
    assert [m for m in metadata.requests if m.direction == "RETRIEVE"] == []
    assert connector.counters.values["zero_admissions"] == 1
    harness.finish_by_hand(request, [41])


def test_a_request_aborted_before_admission_releases_its_lookup_locks(scheduler_harness_factory, lmcache_server):
    """vLLM aborts a request that waits for blocks after its lookup answered: the lookup's locks are released
    (LMCache's own cleanup leaves them until its 300 s read-lock TTL, pinning the chunks in L1)."""
    from vllm.v1.request import RequestStatus

    harness = scheduler_harness_factory(kind="dense", connector_module=OURS)
    tokens, _ = stored_prompt(harness, seed=88, num_chunks=3)
    connector = harness.scheduler.connector
    request = harness.make_request("W", tokens + [3])
    assert lookup(connector, request)[0] == 3 * CHUNK
    assert wait_locks(lmcache_server, 3) == 3
    request.status = RequestStatus.FINISHED_ABORTED
    harness.finish_by_hand(request, [])
    assert wait_locks(lmcache_server, 0) == 0
    assert connector.counters.values["locks_released_at_finish_chunks"] == 3


def test_a_request_finished_while_its_lookup_is_in_flight_releases_the_locks_the_lookup_takes_later(
    scheduler_harness_factory, lmcache_server
):
    """vLLM aborts a waiting request whose lookup has not answered yet (an RL trainer aborting its batch before a
    weight update): the lookup still locks its hit on the server when it completes; the connector keeps polling it
    at the next engine steps and releases those locks (LMCache's own cleanup drops the lookup and leaves them to
    the 300 s read-lock TTL)."""
    from vllm.v1.request import RequestStatus

    harness = scheduler_harness_factory(kind="dense", connector_module=OURS)
    tokens, _ = stored_prompt(harness, seed=89, num_chunks=3)
    assert wait_locks(lmcache_server, 0) == 0
    connector = harness.scheduler.connector
    request = harness.make_request("in-flight", tokens + [3])
    with paused(lmcache_server.pid):  # the lookup is surely still out while the request looks up and finishes
        assert connector.get_num_new_matched_tokens(request, 0)[0] is None, "the lookup answered at once"
        request.status = RequestStatus.FINISHED_ABORTED
        harness.finish_by_hand(request, [])
    deadline = time.monotonic() + 10
    while not connector.counters.values.get("lookups_finished_after_request") and time.monotonic() < deadline:
        connector.build_connector_meta(empty_scheduler_output())  # the engine's later steps
        time.sleep(0.01)
    assert wait_locks(lmcache_server, 0) == 0, "the locks the lookup took after its request finished were kept"
    assert connector.counters.values["lookups_finished_after_request"] == 1
    assert connector.counters.values["locks_released_at_finish_chunks"] == 3, "the lookup's 3-chunk hit was released"
    assert "in-flight" not in connector.scheduler_adapter._pending_lookups, "the lookup state was dropped at last"
