"""vLLM's null block (id 0) is never read or written by the connector, on hybrid (attention + Mamba) models.

Block 0 of every KV page holds a sentinel; the real vLLM scheduler, both roles of lmcache_r3's connector and a
real LMCache server (with an fs L2 tier we can scan) run requests that store and resume from LMCache.
"""

import time

import pytest

from tests.connector.conftest import CHUNK, files_holding_the_null_page, tier_files
from tests.connector.test_admission import (
    AllocatedBlocks,
    admit_and_load,
    empty_scheduler_output,
    lookup,
    reported,
    run_retrieve,
    wait_locks,
)
from tests.support.harness import BLOCK_SIZE

pytestmark = pytest.mark.harness

OURS = "lmcache_r3.mp.connector"


def hybrid_harness(factory, hybrid_server, **overrides):
    server, separate, _ = hybrid_server
    # Prefill one block per step, so align-mode Mamba keeps a checkpoint in every block and chunks can be stored.
    settings = {"max_num_batched_tokens": BLOCK_SIZE, **overrides}
    return factory(
        server=server,
        kind="hybrid",
        connector_module=OURS,
        extra_config={"lmcache_r3.separate_object_groups": separate},
        **settings,
    )


def wait_for_tier_files(l2, minimum, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        files = tier_files(l2)
        if len(files) >= minimum or time.monotonic() > deadline:
            return files
        time.sleep(0.05)


def test_resumed_hybrid_request_restores_attention_and_its_checkpoint_and_never_touches_block_0(
    scheduler_harness_factory, hybrid_server
):
    server, separate, l2 = hybrid_server
    harness = hybrid_harness(scheduler_harness_factory, hybrid_server)
    tokens = [10 + (13 * i + 3) % 1000 for i in range(4 * CHUNK + 10)]
    harness.generate([("A", tokens)])
    attention_a = harness.final_block_tables["A"][0]
    checkpoints_a = harness.real_blocks["A"][1]
    assert set(range(8)) <= set(checkpoints_a), f"a checkpoint per block expected, got {checkpoints_a}"
    saved_attention = harness.attention_bytes(attention_a[:8])
    saved_checkpoint = harness.recurrent_bytes([checkpoints_a[7]])  # state after token 256, the end of chunk 3

    harness.reset_prefix_cache()
    harness.zero_all_blocks_but_null()
    harness.generate([("B", tokens + [900, 901, 902])])
    attention_b = harness.final_block_tables["B"][0]
    checkpoints_b = harness.real_blocks["B"][1]

    assert harness.null_block_changed_bytes() == 0, "block 0 was written"
    assert wait_for_tier_files(l2, 1), "nothing reached the tier"
    assert files_holding_the_null_page(l2) == [], "stored objects hold null-block bytes"
    counters = harness.scheduler.connector.counters.values
    if separate:
        assert counters["retrieves"] == 1, counters
        assert harness.attention_bytes(attention_b[:8]) == saved_attention
        assert harness.recurrent_bytes([checkpoints_b[7]]) == saved_checkpoint
    else:
        # Without --separate-object-groups one object holds every group of a chunk, and LMCache 0.5.6 would write
        # the recurrent part of every chunk, into the null block: the connector refuses and vLLM recomputes.
        assert counters["retrieves_failed_closed"] == 1, counters
        assert counters["retrieves"] == 0
    assert reported(harness, "retrieves_failed_closed") == counters["retrieves_failed_closed"]
    assert harness.scheduler.requests == {}
    assert wait_locks(server, 0) == 0


def test_store_stops_before_the_first_chunk_holding_the_null_block(scheduler_harness_factory, hybrid_server):
    server, _, l2 = hybrid_server
    before = set(wait_for_tier_files(l2, 0, timeout_s=0))
    # Whole-prompt prefill in one step: align mode keeps only the last recurrent block; chunk 0 holds the null block.
    harness = hybrid_harness(scheduler_harness_factory, hybrid_server, max_num_batched_tokens=512)
    tokens = [10 + (17 * i + 5) % 1000 for i in range(3 * CHUNK + 4)]
    harness.generate([("S", tokens)])
    _, recurrent = harness.final_block_tables["S"]
    assert recurrent[0] == harness.null_block_id
    assert harness.scheduler.connector.counters.values["stores_trimmed_at_null_block"] == 1
    assert reported(harness, "stores_trimmed_at_null_block") == 1, "vLLM's metrics missed the trimmed store"
    time.sleep(0.3)  # a store would have reached the fs tier by now; there must be none
    assert set(wait_for_tier_files(l2, 0, timeout_s=0)) == before, "objects were stored past a null chunk"
    assert harness.null_block_changed_bytes() == 0


def test_a_null_block_after_a_real_one_fails_the_retrieve_closed(scheduler_harness_factory, hybrid_server):
    server, _, _ = hybrid_server
    harness = hybrid_harness(scheduler_harness_factory, hybrid_server)
    tokens = [10 + (19 * i + 7) % 1000 for i in range(4 * CHUNK + 6)]
    harness.generate([("I", tokens)])
    connector = harness.scheduler.connector
    request = harness.make_request("J", tokens + [7])
    hit, _ = lookup(connector, request)
    assert hit == 4 * CHUNK
    blocks = 4 * CHUNK // BLOCK_SIZE
    attention = [30 + i for i in range(blocks)]
    recurrent = [20, 21, harness.null_block_id] + [22 + i for i in range(blocks - 3)]  # null after real blocks
    metadata, done, failed = admit_and_load(harness, request, [attention, recurrent], hit)
    assert [m for m in metadata.requests if m.direction == "RETRIEVE"] == []
    assert done and failed, "an interior null block must end in recomputation"
    assert connector.counters.values["retrieves_failed_closed"] == 1
    assert wait_locks(server, 0) == 0
    assert harness.null_block_changed_bytes() == 0
    harness.finish_by_hand(request, attention)


def test_hybrid_model_with_engine_driven_transfer_is_refused_naming_the_mode_that_works(
    scheduler_harness_factory, lmcache_server
):
    with pytest.raises(ValueError, match='"lmcache.mp.mp_transfer_mode": "lmcache_driven"'):
        scheduler_harness_factory(kind="hybrid", connector_module=OURS, transfer_mode="engine_driven")


def test_hybrid_partial_admission_recomputes_and_frees_every_lock(scheduler_harness_factory, hybrid_server):
    """A recurrent group restores the state at a chunk's end; when the scheduler admits less than the hit, no stock
    RETRIEVE can restore the state at the admitted end, so the request recomputes, with no lock left behind."""
    server, _, _ = hybrid_server
    harness = hybrid_harness(scheduler_harness_factory, hybrid_server)
    tokens = [10 + (23 * i + 11) % 1000 for i in range(4 * CHUNK + 6)]
    harness.generate([("H", tokens)])
    connector = harness.scheduler.connector
    request = harness.make_request("K", tokens + [3])
    hit, _ = lookup(connector, request)
    assert hit == 4 * CHUNK
    admitted = 2 * CHUNK
    attention = [30 + i for i in range(admitted // BLOCK_SIZE)]
    recurrent = [0] * (admitted // BLOCK_SIZE - 1) + [40]
    connector.update_state_after_alloc(request, AllocatedBlocks([attention, recurrent]), admitted)
    assert wait_locks(server, 2) == 2, "locks past the admitted end are freed at admission"
    metadata = connector.build_connector_meta(empty_scheduler_output())
    assert [m for m in metadata.requests if m.direction == "RETRIEVE"] == []
    done, failed = run_retrieve(harness, metadata, "K")
    assert done and failed
    assert wait_locks(server, 0) == 0
    assert harness.null_block_changed_bytes() == 0
    harness.finish_by_hand(request, attention)
