"""What the connector's two roles tell each other about routed experts, once per step.

Scheduler -> worker, inside the connector metadata: for every request scheduled in the step, which logical
positions it computes and in which KV slots (:class:`StepRows`). Worker -> scheduler, in the connector's worker
metadata: the narrowed rows of those positions, with their slots (:class:`R3WorkerMetadata`). Only TP rank 0
sends rows: the routing is replicated across TP ranks, so ``aggregate`` keeps the one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from lmcache_r3.mp.step_rows import RequestStepRows, StepRows

__all__ = ["R3WorkerMetadata", "RequestStepRows", "StepRows"]


@dataclass
class R3WorkerMetadata(LMCacheMPWorkerMetadata):
    """LMCache's worker metadata (lazy-offload store receipts) plus this step's routed experts."""

    completed_store_requests: dict[str, int] = field(default_factory=dict)
    rows: dict[str, RequestStepRows] = field(default_factory=dict)
    """Per request id, the rows captured in this step (TP rank 0 only; empty on the other ranks)."""
    capture_error: str | None = None
    """Why this step's rows could not be mapped; the scheduler then returns no routing for those requests."""
    unmapped_requests: tuple[str, ...] = ()
    """Requests scheduled in this step whose rows could not be located (their routing is incomplete)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another TP rank's report of the same step: receipts as LMCache does, rows from whichever has them."""
        stock = super().aggregate(other) if isinstance(other, LMCacheMPWorkerMetadata) else self
        merged = R3WorkerMetadata(
            completed_store_requests=stock.completed_store_requests,
            failed_store_requests=stock.failed_store_requests,
            rows=dict(self.rows),
            capture_error=self.capture_error,
            unmapped_requests=self.unmapped_requests,
        )
        if isinstance(other, R3WorkerMetadata):
            for request_id, rows in other.rows.items():
                merged.rows.setdefault(request_id, rows)
            merged.capture_error = merged.capture_error or other.capture_error
            merged.unmapped_requests = tuple(sorted({*merged.unmapped_requests, *other.unmapped_requests}))
        return merged
