"""lmcache_r3's counters in vLLM's own metrics: the periodic "KV Transfer metrics" log line and Prometheus.

vLLM asks the scheduler's connector for its stats after every engine step (``get_kv_connector_stats``), ships them
to the front end with the scheduler's stats, and there rebuilds them with the connector class's
``build_kv_connector_stats``: the logging stat logger adds them up over its interval and logs ``reduce()``, the
Prometheus stat logger feeds each one to ``build_prom_metrics``' ``observe``. :class:`R3ConnectorStats` carries
LMCache's lookup latencies unchanged plus what lmcache_r3 counted since the last step (only counters that moved),
so an operator sees, per engine, where requests' routing came from and every way a hit was cut short or a
request's routing was lost: in the log line as ``R3 tokens from LMCache=576`` and the like (the labels of
:data:`R3_METRICS`, for the counts that moved), and in Prometheus as ``vllm:lmcache_r3_rows_from_lmcache_total``
and the like (a counter per name of :data:`R3_METRICS`, labelled like vLLM's own metrics).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcache.integration.vllm.lmcache_mp_metrics import LMCacheMPConnectorStats, LMCacheMPPromMetrics

__all__ = ["R3_METRICS", "R3ConnectorStats", "R3PromMetrics", "counter_deltas"]

R3_KEY = "lmcache_r3"
"""The key of lmcache_r3's counts in the stats' ``data`` (beside LMCache's own)."""

R3_METRICS: dict[str, tuple[str, str]] = {
    # routed experts (R3 on)
    "rows_computed": ("R3 tokens computed", "Tokens whose routed experts this engine computed"),
    "rows_from_prefix_cache": (
        "R3 tokens from vLLM prefix cache",
        "Tokens whose routed experts came with a hit in vLLM's own prefix cache",
    ),
    "rows_from_lmcache": ("R3 tokens from LMCache", "Tokens whose routed experts came from LMCache with their KV"),
    "r3_hit_chunks": ("R3 chunks fetched", "R3 chunks fetched from LMCache for admitted hits"),
    "joint_hits_shrunk": (
        "R3 hits shrunk",
        "LMCache hits cut short where the KV was present but the routed experts were not (recomputed instead)",
    ),
    "fetch_failures": (
        "R3 fetch failures",
        "R3 fetches that failed or timed out; their LMCache hits were dropped and recomputed",
    ),
    "chunks_published": ("R3 chunks stored", "R3 chunks stored to LMCache beside their KV"),
    "store_failures": ("R3 store failures", "R3 store calls that failed; those chunks' hits will be recomputed"),
    "requests_completed": ("R3 requests completed", "Finished requests returned with their routed experts"),
    "requests_incomplete": (
        "R3 requests incomplete",
        "Finished requests returned with routed_experts_error instead of rows",
    ),
    "requests_local_only": (
        "R3 requests local only",
        "Requests that neither fetch nor store routed experts in LMCache (multimodal inputs)",
    ),
    # the connector fork's fixes (R3 on or off)
    "partial_admissions": ("LMCache hits admitted partly", "LMCache hits the scheduler admitted only in part"),
    "retrieves_failed_closed": (
        "LMCache retrieves refused",
        "LMCache retrieves refused before they started (recomputed instead)",
    ),
    "stores_trimmed_at_null_block": (
        "LMCache stores trimmed at null block",
        "KV stores cut at the first chunk that would have read vLLM's null block",
    ),
}
"""Counter name -> (label in the log line, Prometheus help text)."""


def counter_deltas(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """What moved from ``before`` to ``now`` among the counters of :data:`R3_METRICS` (only those that moved)."""
    return {name: now[name] - before.get(name, 0) for name in R3_METRICS if now.get(name, 0) != before.get(name, 0)}


@dataclass
class R3ConnectorStats(LMCacheMPConnectorStats):
    """LMCache's lookup latencies plus lmcache_r3's counts (``data["lmcache_r3"]``: name -> count)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.data.setdefault(R3_KEY, {})

    @classmethod
    def from_payload(cls, data: Mapping[str, Any] | None) -> R3ConnectorStats:
        """Stats rebuilt in the front end from a shipped payload, on copies of its containers: vLLM's loggers add
        later payloads into the first one of an interval, and one payload is shared by every logger."""
        return cls(data={key: list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
                         for key, v in (data or {}).items()})  # fmt: skip

    @property
    def counts(self) -> dict[str, int]:
        return self.data[R3_KEY]

    def count(self, deltas: Mapping[str, int]) -> None:
        counts = self.counts
        for name, value in deltas.items():
            if value:
                counts[name] = counts.get(name, 0) + value

    def clone_and_reset(self) -> R3ConnectorStats:
        counts = self.counts
        stock = super().clone_and_reset()  # resets this object, its counts too
        return R3ConnectorStats(data={**stock.data, R3_KEY: counts})

    def reset(self) -> None:
        super().reset()
        self.data[R3_KEY] = {}

    def aggregate(self, other: Any) -> R3ConnectorStats:
        super().aggregate(other)  # LMCache's latencies (a TypeError for stats that are not LMCache MP's)
        if isinstance(other, R3ConnectorStats):
            self.count(other.counts)
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced = super().reduce()
        for name, (label, _help) in R3_METRICS.items():
            if self.counts.get(name):
                reduced[label] = self.counts[name]
        return reduced

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.counts.values())


class R3PromMetrics(LMCacheMPPromMetrics):
    """LMCache's lookup-latency histogram plus a counter per name of :data:`R3_METRICS`,
    ``vllm:lmcache_r3_<name>`` (``_total`` in the exposition), per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, (_label, documentation) in R3_METRICS.items():
            counter = self._counter_cls(
                name=f"vllm:lmcache_r3_{name}", documentation=documentation, labelnames=labelnames
            )
            self._counters[name] = {
                engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for name, value in (transfer_stats_data.get(R3_KEY) or {}).items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value > 0:
                per_engine[engine_idx].inc(value)
