"""The scheduler harness drives the real vLLM scheduler and stock LMCache connector against a real server."""

import pytest

from tests.support.harness import BLOCK_SIZE

pytestmark = pytest.mark.harness


def prompt(seed: int, length: int) -> list[int]:
    return [10 + (seed * 131 + 7 * i) % 1000 for i in range(length)]


def test_stock_connector_round_trips_kv_bytes_after_prefix_cache_reset(scheduler_harness_factory, lmcache_server):
    harness = scheduler_harness_factory(kind="dense")
    tokens = prompt(1, 4 * BLOCK_SIZE + 10)  # 2 full 64-token chunks + a partial tail
    harness.generate([("A", tokens)])
    blocks_a = harness.block_tables["A"][0][:4]
    saved = harness.attention_bytes(blocks_a)

    harness.reset_prefix_cache()
    harness.zero_all_blocks_but_null()
    harness.generate([("B", tokens + [900, 901])])

    blocks_b = harness.block_tables["B"][0][:4]
    assert harness.scheduler.requests == {}
    assert harness.attention_bytes(blocks_b) == saved, "KV loaded from LMCache differs from what was stored"
    assert lmcache_server.l1_counts()["read_locked_count"] == 0


def test_hybrid_config_puts_null_block_in_recurrent_block_tables(scheduler_harness_factory):
    harness = scheduler_harness_factory(kind="hybrid")
    assert type(harness.scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert harness.scheduler.kv_cache_manager.block_pool.null_block.block_id == harness.null_block_id
    harness.generate([("H", prompt(2, 3 * BLOCK_SIZE + 5))])
    attention_blocks, recurrent_blocks = harness.block_tables["H"]
    assert harness.null_block_id not in attention_blocks
    assert harness.null_block_id in recurrent_blocks, recurrent_blocks
