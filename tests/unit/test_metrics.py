"""lmcache_r3's counters in vLLM's metrics: what the stats carry between the engine and the front end, how vLLM's
stat loggers add them up, and the Prometheus counters they feed (real prometheus_client, a private registry)."""

from __future__ import annotations

import functools
import types

import msgspec
import pytest
from lmcache.integration.vllm.lmcache_mp_metrics import LMCacheMPConnectorStats
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lmcache_r3.mp.connector import LMCacheMPConnector
from lmcache_r3.mp.metrics import R3_KEY, R3_METRICS, R3ConnectorStats, R3PromMetrics, counter_deltas


@pytest.mark.parametrize(
    ("now", "before", "moved"),
    [
        ({"rows_computed": 5}, {}, {"rows_computed": 5}),
        ({"rows_computed": 5, "fetches": 2}, {"rows_computed": 5, "fetches": 1}, {}),  # fetches is not a metric
        (
            {"rows_computed": 9, "joint_hits_shrunk": 1},
            {"rows_computed": 5},
            {"rows_computed": 4, "joint_hits_shrunk": 1},
        ),
        ({"rows_computed": 5}, {"rows_computed": 5}, {}),
        ({}, {}, {}),
    ],
)
def test_counter_deltas_report_only_the_metrics_that_moved(now, before, moved):
    assert counter_deltas(now, before) == moved


def stats(lookups: list[float], **counts: int) -> R3ConnectorStats:
    made = R3ConnectorStats()
    for seconds in lookups:
        made.record_lookup(seconds)
    made.count(counts)
    return made


def test_stats_add_up_over_an_interval_as_vllms_logging_stat_logger_adds_them():
    total = stats([0.001], rows_computed=10, rows_from_lmcache=256)
    for later in (stats([], rows_computed=3), stats([0.003], requests_completed=1), stats([], joint_hits_shrunk=2)):
        total = total.aggregate(later)
    assert total.counts == {"rows_computed": 13, "rows_from_lmcache": 256, "requests_completed": 1,
                            "joint_hits_shrunk": 2}  # fmt: skip
    assert total.reduce() == {
        "LMCache MP lookup count": 2,
        "LMCache MP lookup avg latency (ms)": 2.0,
        "R3 tokens computed": 13,
        "R3 tokens from LMCache": 256,
        "R3 hits shrunk": 2,
        "R3 requests completed": 1,
    }


def test_stock_lmcache_stats_aggregate_into_ours_with_their_latencies():
    stock = LMCacheMPConnectorStats()
    stock.record_lookup(0.004)
    total = stats([], rows_computed=1).aggregate(stock)
    assert total.reduce() == {"LMCache MP lookup count": 1, "LMCache MP lookup avg latency (ms)": 4.0,
                              "R3 tokens computed": 1}  # fmt: skip


@pytest.mark.parametrize(
    ("made", "empty"),
    [
        (stats([]), True),
        (stats([], rows_computed=0), True),
        (stats([], rows_computed=1), False),
        (stats([0.001]), False),
    ],
)
def test_stats_are_empty_only_without_latencies_and_counts(made, empty):
    assert made.is_empty() is empty


def test_clone_and_reset_hands_over_the_interval_and_starts_a_new_one():
    live = stats([0.002], chunks_published=4)
    taken = live.clone_and_reset()
    assert taken.counts == {"chunks_published": 4} and taken.reduce()["LMCache MP lookup count"] == 1
    assert live.is_empty()
    live.count({"chunks_published": 1})
    assert taken.counts == {"chunks_published": 4}, "the handed-over interval changed with the new one"


def test_the_payload_crosses_processes_and_rebuilds_into_the_same_stats():
    sent = stats([0.001, 0.002], rows_from_prefix_cache=64, store_failures=1)
    payload = msgspec.msgpack.decode(msgspec.msgpack.encode(sent.to_dict()))  # as the engine core ships it
    rebuilt = LMCacheMPConnector.build_kv_connector_stats(payload)
    assert isinstance(rebuilt, R3ConnectorStats)
    assert rebuilt.reduce() == sent.reduce()


def test_a_rebuilt_payload_is_not_changed_by_what_is_added_to_it():
    payload = stats([0.001], rows_computed=2).to_dict()
    first = LMCacheMPConnector.build_kv_connector_stats(payload)
    first.aggregate(stats([0.001], rows_computed=5))
    assert payload[R3_KEY] == {"rows_computed": 2} and len(payload["lookup_duration_seconds"]) == 1


def test_every_metric_has_a_log_label_and_a_prometheus_help_text():
    labels = [label for label, _help in R3_METRICS.values()]
    assert len(set(labels)) == len(labels)
    assert all(label and help_text for label, help_text in R3_METRICS.values())


def sample(registry: CollectorRegistry, name: str, engine: str) -> float | None:
    return registry.get_sample_value(f"vllm:lmcache_r3_{name}_total", {"engine": engine, "model_name": "m"})


def test_prometheus_counters_add_each_engines_counts():
    registry = CollectorRegistry()
    metric_types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    vllm_config = types.SimpleNamespace(kv_transfer_config=None)  # the base class only keeps this field
    prom = LMCacheMPConnector.build_prom_metrics(
        vllm_config, metric_types, ["engine", "model_name"], {0: ["0", "m"], 1: ["1", "m"]}
    )
    assert isinstance(prom, R3PromMetrics)
    prom.observe(stats([0.001], rows_from_lmcache=256, requests_completed=1).to_dict(), engine_idx=0)
    prom.observe(stats([], rows_from_lmcache=64).to_dict(), engine_idx=0)
    prom.observe(stats([], fetch_failures=1).to_dict(), engine_idx=1)
    assert sample(registry, "rows_from_lmcache", "0") == 320
    assert sample(registry, "requests_completed", "0") == 1
    assert sample(registry, "fetch_failures", "1") == 1
    assert sample(registry, "fetch_failures", "0") == 0
    assert sample(registry, "rows_from_lmcache", "1") == 0
    lookups = registry.get_sample_value(
        "vllm:lmcache_mp_lookup_duration_seconds_count", {"engine": "0", "model_name": "m"}
    )
    assert lookups == 1, "LMCache's own lookup histogram is still fed"
