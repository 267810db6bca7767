"""The few places where lmcache_r3 relies on internals of LMCache 0.5.6 and vLLM 0.32, each in one function.

Every function here names the version and the file it depends on; ``tests/connector/test_stock_adapter.py`` fails
loudly when an upgrade moves any of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lmcache_r3.mp.sessions import SessionEnds


def report_unsubmitted_retrieve_failed(worker_adapter: Any, request_id: str, block_ids: Iterable[int]) -> None:
    """Make the worker report a retrieve it decided not to submit as a failed load, exactly once.

    LMCache 0.5.6 has this path for retrieves dropped while the server is unhealthy
    (``vllm_multi_process_adapter.py``, ``submit_retrieve_request``): the request id goes to ``_dropped_retrieves``
    (so ``get_finished`` reports the receive as finished once and the request leaves WAITING_FOR_REMOTE_KVS) and to
    ``_failed_request_ids`` (request-level failure, what vLLM needs for several KV groups); ``error_block_ids``
    carries the block-level failure that vLLM uses for one KV group. vLLM then recomputes the request.
    """
    worker_adapter.error_block_ids.update(block_ids)
    worker_adapter._failed_request_ids.add(request_id)
    worker_adapter._dropped_retrieves.add(request_id)


def _group_spec(group: Any) -> Any:
    """A KV cache group's spec; for a group of layers of one type with different page sizes (vLLM 0.32's
    ``UniformTypeKVCacheSpecs``, which the worker's config keeps and the scheduler's replaces), its first layer's."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    return spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec


def group_kinds(kv_cache_config: Any) -> list[str]:
    """Per KV cache group, the name of its spec type (of its first layer's, for layers of one type)."""
    return [type(_group_spec(group)).__name__ for group in _groups(kv_cache_config)]


def _groups(kv_cache_config: Any) -> list[Any]:
    return list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())


def free_lookup_locks(scheduler_adapter: Any, tracker: Any, start: int, end: int) -> list[Any]:
    """Release the lookup locks of ``[start, end)`` of a request on every server; the servers' answers (futures).

    LMCache 0.5.6's ``SchedulerAdapter.free_lookup_locks`` (``vllm_multi_process_adapter.py``) sends the same
    requests and drops their futures; the session end of a finished request waits for them.
    """
    if not scheduler_adapter.is_healthy:
        return []
    key = scheduler_adapter._create_key(
        tracker.get_token_ids(),
        start=start,
        end=end,
        request_id=tracker.request_id,
        cache_salt=tracker.cache_salt,
        request_configs=tracker.request_configs,
    ).no_worker_id_version()
    return [
        scheduler_adapter.req_clients[url].free_lookup_locks(key, scheduler_adapter.tp_size)
        for url in scheduler_adapter._server_urls
    ]


def group_windows(kv_cache_config: Any) -> list[int]:
    """Per vLLM KV cache group, the cross-chunk window LMCache 0.5.6 registers for it, in tokens.

    The sliding window of a sliding-window group, the block size of an align-mode Mamba group (one recurrent
    checkpoint per block), ``-1`` for full attention (``integration/vllm/kv_cache_groups.py``,
    ``_resolve_per_layer_sw_sizes``).
    """
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    windows = []
    for group in _groups(kv_cache_config):
        spec = _group_spec(group)
        if isinstance(spec, SlidingWindowSpec):
            windows.append(int(spec.sliding_window))
        elif isinstance(spec, MambaSpec):
            windows.append(int(spec.block_size))
        else:
            windows.append(-1)
    return windows


def has_recurrent_group(kv_cache_config: Any) -> bool:
    """Whether any KV cache group holds recurrent (Mamba / linear-attention) state."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return any(isinstance(_group_spec(g), MambaSpec) for g in _groups(kv_cache_config))


def keeps_blocks_to_the_end(group: Any) -> bool:
    """Whether vLLM 0.32 keeps every block of a KV cache group until the request finishes (or is preempted).

    Only full attention does (``FullAttentionManager``: full, MLA, sink and hidden-state caches). vLLM frees the
    blocks a sliding or chunked-local window has passed, the gap of an R-SWA group and the retired checkpoints of an
    align-mode Mamba group as the request advances (``v1/core/single_type_kv_cache_manager.py``,
    ``remove_skipped_blocks``), in the step that schedules it, and can hand them out in that step. A spec type this
    does not know counts as freeing.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiddenStateCacheSpec,
        MLAAttentionSpec,
        SinkFullAttentionSpec,
    )

    keeps = (FullAttentionSpec, MLAAttentionSpec, SinkFullAttentionSpec, HiddenStateCacheSpec)
    return type(_group_spec(group)) in keeps


def frees_blocks_mid_request(kv_cache_config: Any) -> bool:
    """Whether vLLM may free a running request's blocks, and hand them out again, before it finishes."""
    return not all(keeps_blocks_to_the_end(group) for group in _groups(kv_cache_config))


def defer_session_ends(scheduler_adapter: Any) -> SessionEnds:
    """Route the stock connector's session ends through a :class:`SessionEnds`, which ends them later.

    LMCache 0.5.6's connector ends a request's server session with ``scheduler_adapter.end_session(request_id)``
    in ``request_finished`` (``integration/vllm/lmcache_mp_connector.py``), before the request's last store has
    reached the server; the adapter's own ``end_session`` is kept as the one that really ends it.
    """
    ends = SessionEnds(scheduler_adapter.end_session)
    scheduler_adapter.end_session = ends.finished
    return ends
