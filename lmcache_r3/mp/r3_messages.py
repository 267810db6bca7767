"""What the connector's two roles tell each other about routed experts, once per step.

Scheduler -> worker, inside the connector metadata: ``r3_step``, the number of an engine step whose routing the
worker must capture (``None``: nothing to capture). Worker -> scheduler, in the connector's worker metadata: that
step's narrowed rows beside the KV slot of each token (:class:`R3WorkerMetadata`); the scheduler writes them into
its slot mirror and reads each request's rows through the request's block table. Only TP rank 0 sends rows: the
routing is replicated across TP ranks, so ``aggregate`` keeps the one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

__all__ = ["R3WorkerMetadata"]


@dataclass
class R3WorkerMetadata(LMCacheMPWorkerMetadata):
    """LMCache's worker metadata (lazy-offload store receipts) plus one step's routed experts."""

    completed_store_requests: dict[str, int] = field(default_factory=dict)
    step: int | None = None
    """The scheduler's number of the step these rows belong to (``r3_step`` of its connector metadata)."""
    slots: np.ndarray | None = None
    """int64 ``[n]``: the KV slot each computed token of the step wrote (TP rank 0 only; None on the others)."""
    rows: np.ndarray | None = None
    """``[n, num_layers, top_k]`` in the profile dtype: ``rows[i]`` is the routing of the token in ``slots[i]``."""
    capture_error: str | None = None
    """Why this step's routing could not be captured; the scheduler then returns no routing for its requests."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another TP rank's report of the same step: receipts as LMCache does, rows from whichever has them."""
        stock = super().aggregate(other) if isinstance(other, LMCacheMPWorkerMetadata) else self
        merged = R3WorkerMetadata(
            completed_store_requests=stock.completed_store_requests,
            failed_store_requests=stock.failed_store_requests,
            step=self.step,
            slots=self.slots,
            rows=self.rows,
            capture_error=self.capture_error,
        )
        if isinstance(other, R3WorkerMetadata):
            if merged.rows is None and other.rows is not None:
                merged.slots, merged.rows = other.slots, other.rows
            merged.step = other.step if merged.step is None else merged.step
            merged.capture_error = merged.capture_error or other.capture_error
        return merged

    def __reduce__(self) -> tuple:
        """Pickle the rows as two byte strings: vLLM pickles this every step from the worker process to the
        engine core, and numpy arrays pickle several times slower than bytes."""
        rows = None
        if self.rows is not None and self.slots is not None:
            rows = (self.slots.tobytes(), self.rows.tobytes(), self.rows.shape, self.rows.dtype.str)
        stock = (self.completed_store_requests, self.failed_store_requests)
        return _unpickle, (self.step, rows, self.capture_error, stock)


def _unpickle(step: int | None, rows: tuple | None, capture_error: str | None, stock: tuple) -> R3WorkerMetadata:
    meta = R3WorkerMetadata(completed_store_requests=stock[0], failed_store_requests=stock[1], step=step,
                            capture_error=capture_error)  # fmt: skip
    if rows is not None:
        slots, data, shape, dtype = rows
        meta.slots = np.frombuffer(slots, dtype=np.int64)
        meta.rows = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    return meta
