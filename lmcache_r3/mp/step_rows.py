"""One step's routed experts as the worker sends them: every computed token's row, beside the KV slot it wrote.

The model runner computes a step's tokens in batch order; the attention ``slot_mapping`` gives the KV slot each
token writes, and the router capture buffer holds each token's row in the same order. That pair *is* what the
scheduler needs: the slot mirror keeps, for every KV slot, the row of the computation that last wrote it, and a
request's rows are read through its block table. So the worker does not map rows to requests at all; it drops
padding tokens (negative slots) and narrows the int32 ids to the profile dtype (CUDA kernel on a GPU, numpy on
the CPU). Per step that is a few array operations, whatever the number of requests.

Engine-free (numpy, and CuPy on a GPU): testable without vLLM or LMCache.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmcache_r3.artifacts import R3Profile, gather_narrow, narrow_rows


class StepRowsError(ValueError):
    """The slot mapping and the capture buffer of a step do not describe the same tokens."""


def narrow_step(slot_mapping: Any, captured: Any, profile: R3Profile) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a step's real tokens and their KV slots, on the host, in the profile dtype.

    Args:
        slot_mapping: ``[n]`` KV slot of each token of the step in batch order (numpy, or anything with
            ``__array__``); negative entries are padding (vLLM's ``PAD_SLOT_ID``).
        captured: int32 ``[>= n, num_layers, top_k]``, the capture buffer (numpy on the CPU, a CUDA array on a
            GPU); row ``i`` belongs to token ``i``.
        profile: the row profile.

    Returns:
        ``(slots, rows)``: int64 ``[m]`` and ``[m, num_layers, top_k]`` in ``profile.dtype`` (numpy), for the
        ``m`` real tokens, in batch order.

    Raises:
        StepRowsError: fewer captured rows than tokens.
        GatherNarrowError: an expert id outside the profile.
    """
    # A copy: on the CPU the slot mapping is a view of a buffer vLLM rewrites next step, and the scheduler may keep
    # these slots queued (un-copied) across steps when it runs in this process.
    slots = np.array(slot_mapping, dtype=np.int64, copy=True)
    if slots.ndim != 1:
        raise StepRowsError(f"slot_mapping must be 1-D, got shape {slots.shape}")
    num_tokens = slots.shape[0]
    if captured.shape[0] < num_tokens:
        raise StepRowsError(
            f"the capture buffer holds {captured.shape[0]} rows but the step computed {num_tokens} tokens"
        )
    padded = bool(num_tokens) and slots.min() < 0
    real = slots >= 0 if padded else None
    if hasattr(captured, "__cuda_array_interface__"):
        index = np.flatnonzero(real) if padded else np.arange(num_tokens)
        rows = gather_narrow(captured, index, profile).get()  # one device -> host copy of the narrowed rows
    else:
        step = np.asarray(captured)[:num_tokens]
        selected = step[real] if padded else step
        rows = narrow_rows(selected, profile)
        if rows is selected and not padded:
            rows = rows.copy()  # already narrow: never hand out a view of the capture buffer, reused next step
    return (slots[real] if padded else slots), rows
