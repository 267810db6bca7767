"""One step's routed experts, mapped from the capture buffer to requests' logical positions.

Engine-free (numpy, and CuPy on a GPU): the worker side of the connector calls these with the step's slot
mapping and capture buffer; they can run and be tested without vLLM or LMCache.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmcache_r3.artifacts import R3Profile, gather_narrow


@dataclass(frozen=True)
class StepRows:
    """Positions ``[start, start + num_tokens)`` of one request, computed in this step.

    ``block_ids`` are the request's blocks (in the group whose slots the capture is mapped with) from block
    index ``first_block`` on, enough to cover the positions.
    """

    start: int
    num_tokens: int
    first_block: int
    block_ids: tuple[int, ...]

    def slots(self, block_size: int) -> np.ndarray:
        """The KV slot of each position, in position order."""
        positions = np.arange(self.start, self.start + self.num_tokens, dtype=np.int64)
        blocks = np.asarray(self.block_ids, dtype=np.int64)[positions // block_size - self.first_block]
        return blocks * block_size + positions % block_size


@dataclass(frozen=True)
class RequestStepRows:
    """One request's rows of one step: ``rows[i]`` is the routing of position ``start + i``, held in ``slots[i]``."""

    start: int
    rows: np.ndarray
    slots: np.ndarray


def locate_rows(
    slot_mapping: np.ndarray, plans: Mapping[str, StepRows], block_size: int
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], list[str]]:
    """Find, for every planned request, the capture row of each of its positions.

    Args:
        slot_mapping: ``[n]`` slot of each captured row (batch order); negative entries are padding.
        plans: per request, the positions computed in this step and their blocks.
        block_size: tokens per block of the group ``slot_mapping`` belongs to.

    Returns:
        ``(found, unmapped)``: per request whose every position was found exactly once, ``(row_index, slots)``
        in position order; and the requests for which some position has no row (their routing is incomplete
        and must not be guessed).
    """
    active = [(request_id, plan) for request_id, plan in plans.items() if plan.num_tokens > 0]
    if not active:
        return {}, []
    slots = _all_slots([plan for _, plan in active], block_size)
    counts = np.fromiter((plan.num_tokens for _, plan in active), dtype=np.int64, count=len(active))
    mapping = np.asarray(slot_mapping, dtype=np.int64)
    order = np.argsort(mapping, kind="stable")
    sorted_slots = mapping[order]
    left = np.searchsorted(sorted_slots, slots, side="left")
    right = np.searchsorted(sorted_slots, slots, side="right")
    # A position is found when exactly one row holds its slot (none: missing; two: not this request's rows).
    bad_per_request = np.add.reduceat((right - left != 1).astype(np.int64), np.cumsum(counts) - counts)
    row_index = order[np.minimum(left, len(order) - 1)] if len(order) else left
    found: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    unmapped: list[str] = []
    offset = 0
    for (request_id, _), count, bad in zip(active, counts.tolist(), bad_per_request.tolist(), strict=True):
        if bad:
            unmapped.append(request_id)
        else:
            found[request_id] = (row_index[offset : offset + count], slots[offset : offset + count])
        offset += count
    return found, unmapped


def _all_slots(plans: list[StepRows], block_size: int) -> np.ndarray:
    """The slots of every plan's positions, concatenated in plan order (vectorized over all requests)."""
    counts = np.array([plan.num_tokens for plan in plans], dtype=np.int64)
    table = np.fromiter((b for plan in plans for b in plan.block_ids), dtype=np.int64)
    table_offsets = np.cumsum([0] + [len(plan.block_ids) for plan in plans[:-1]])
    request = np.repeat(np.arange(len(plans)), counts)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.array([plan.start for plan in plans], dtype=np.int64)[request] + within
    firsts = np.array([plan.first_block for plan in plans], dtype=np.int64)[request]
    blocks = table[table_offsets[request] + positions // block_size - firsts]
    return blocks * block_size + positions % block_size


def collect_step_rows(
    slot_mapping: np.ndarray, captured: Any, plans: Mapping[str, StepRows], block_size: int, profile: R3Profile
) -> tuple[dict[str, RequestStepRows], list[str]]:
    """This step's rows per request, narrowed to ``profile.dtype`` (``captured`` on CPU or GPU)."""
    located, unmapped = locate_rows(slot_mapping, plans, block_size)
    if not located:
        return {}, unmapped
    index = np.concatenate([row_index for row_index, _ in located.values()])
    gathered = gather_narrow(captured, index, profile)
    if not isinstance(gathered, np.ndarray):
        gathered = gathered.get()  # CuPy -> host, one copy for the whole step
    out: dict[str, RequestStepRows] = {}
    offset = 0
    for request_id, (row_index, slots) in located.items():
        count = row_index.shape[0]
        out[request_id] = RequestStepRows(plans[request_id].start, gathered[offset : offset + count], slots)
        offset += count
    return out, unmapped
