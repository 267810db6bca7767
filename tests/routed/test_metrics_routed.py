"""lmcache_r3's counters reach vLLM's metrics: the real vLLM scheduler ships the connector's stats every step, as
it ships them to its stat loggers, and they add up to where every token's routing came from (real LMCache server,
the emulated router of :mod:`tests.support.harness`)."""

from __future__ import annotations

import pytest

from lmcache_r3.mp.metrics import R3_METRICS
from tests.routed.test_harness_routed import (
    CHUNK,
    CONNECTOR,
    cold_then_lmcache_hit_then_prefix_cache_hit,
    returned_rows,
)
from tests.support.prompts import seeded_prompt

pytestmark = [pytest.mark.server, pytest.mark.harness]


def logged(harness):
    total = harness.logged_connector_stats()
    assert total is not None, "the scheduler shipped no connector stats"
    return total


def test_vllm_metrics_count_where_every_tokens_routing_came_from(scheduler_harness_factory, r3_server):
    harness = scheduler_harness_factory(server=r3_server, connector_module=CONNECTOR, routed_experts=True)
    cold_then_lmcache_hit_then_prefix_cache_hit(harness, seed=1001)  # asserts the three return the same, exact rows
    rows = {name: returned_rows(harness, name) for name in ("cold", "warm", "local")}

    total = logged(harness)
    book = harness.scheduler.connector.routed.counters.snapshot()
    assert total.counts == {name: book[name] for name in R3_METRICS if book.get(name)}, "a count was lost or doubled"
    reduced = total.reduce()
    assert reduced["R3 tokens from LMCache"] == 4 * CHUNK
    assert reduced["R3 tokens from vLLM prefix cache"] >= 4 * CHUNK
    sources = ("R3 tokens computed", "R3 tokens from LMCache", "R3 tokens from vLLM prefix cache")
    assert sum(reduced[label] for label in sources) == sum(len(r) for r in rows.values())
    assert reduced["R3 requests completed"] == 3
    assert reduced["R3 chunks stored"] == 4
    assert "R3 requests incomplete" not in reduced and "R3 fetch failures" not in reduced
    assert reduced["LMCache MP lookup count"] >= 1


def test_kv_only_connector_reports_its_lookups_and_no_routing(scheduler_harness_factory, r3_server):
    harness = scheduler_harness_factory(server=r3_server, connector_module=CONNECTOR, routed_experts=False)
    tokens = seeded_prompt(2 * CHUNK + 3, seed=12)
    harness.generate([("cold", tokens)], max_tokens=2)
    harness.reset_prefix_cache()
    harness.generate([("warm", tokens)], max_tokens=2)
    reduced = logged(harness).reduce()
    assert reduced["LMCache MP lookup count"] >= 2
    assert not [label for label in reduced if label.startswith("R3 ")]
