"""Worker side of routed experts: bind a capturer to the MoE routers and map each step's rows to requests.

vLLM registers every MoE layer's runner in ``compilation_config.static_forward_context``; vLLM's own
``bind_routed_experts_capturer`` hooks their routers, so the connector captures without the model object. The
capture buffer holds one int32 row per token of the step, in the runner's batch order, which is also the order
of the attention ``slot_mapping``; :func:`narrow_step` sends them to the scheduler as they are, beside their
slots, narrowed (CUDA kernel on GPU, numpy on CPU).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from vllm.forward_context import get_forward_context, is_forward_context_available

from lmcache_r3.mp.step_rows import StepRowsError, narrow_step

__all__ = ["CaptureError", "RouterCapture", "StepRowsError", "find_moe_runners", "narrow_step"]

logger = logging.getLogger(__name__)

StepSource = Callable[[], tuple[np.ndarray, Any]]
"""Returns this step's ``(slot_mapping [n], captured int32 [n, layers, top_k])``."""


class CaptureError(RuntimeError):
    """Routed experts cannot be captured as configured; the message says what to change."""


def find_moe_runners(vllm_config: Any) -> list[Any]:
    """The MoE runners of the served model, in layer order (empty for a dense model).

    vLLM registers every MoE runner in ``static_forward_context``, a speculative drafter's (MTP) too, since the drafter
    shares the compilation config. Only the target model's are bound: the first runner of each layer id below the
    model's layer count (a drafter's come later, numbered past the last layer or again from 0).
    """
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    num_layers = vllm_config.model_config.get_total_num_hidden_layers()
    context = vllm_config.compilation_config.static_forward_context
    runners: dict[int, Any] = {}
    skipped = 0
    for layer in context.values():
        if not isinstance(layer, MoERunner):
            continue
        if 0 <= layer.layer_id < num_layers and layer.layer_id not in runners:
            runners[layer.layer_id] = layer
        else:
            skipped += 1
    if skipped:
        logger.info("lmcache_r3: %d MoE runners outside the model's %d layers (a drafter's) are not captured",
                    skipped, num_layers)  # fmt: skip
    return [runners[layer_id] for layer_id in sorted(runners)]


def require_eager_on_cpu(vllm_config: Any) -> None:
    """On CPU, torch.compile traces the MoE forward before any capture hook exists, and capture silently stops.

    Raises:
        CaptureError: CPU without ``enforce_eager``.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not vllm_config.model_config.enforce_eager:
        raise CaptureError(
            "lmcache_r3 captures routed experts through the MoE routers, and on CPU torch.compile traces them "
            "without the capture hook (every row would be missing). Start vLLM with enforce_eager=True "
            "(--enforce-eager), or turn routed experts off with "
            '"lmcache_r3.routed_experts": false in kv_connector_extra_config.'
        )


@functools.cache
def _capturer_class() -> type:
    """vLLM's ``RoutedExpertsCapturer``, counting its capture calls, with a host fast path (built on first use:
    vLLM's MoE modules load with the model)."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

    class CountingCapturer(RoutedExpertsCapturer):
        """Counts capture calls per step. On the CPU without data parallelism (no per-rank slicing to do) a call is
        one numpy assignment into the capture buffer's memory instead of vLLM's torch indexing, which costs about
        twice as much (once per MoE layer and step, inside the forward pass); everything else is vLLM's
        ``capture``."""

        calls = 0
        host_buffer: np.ndarray | None = None
        layers_seen: set[int] = set()

        def capture(self, layer_id: int, topk_ids: Any) -> None:
            self.calls += 1
            self.layers_seen.add(layer_id)
            host = self.host_buffer
            if host is not None:
                host[: topk_ids.shape[0], layer_id] = topk_ids.numpy()
                return
            super().capture(layer_id, topk_ids)

    return CountingCapturer


class RouterCapture:
    """vLLM's ``RoutedExpertsCapturer`` bound to the model's MoE routers, counting capture calls per step."""

    def __init__(self, vllm_config: Any, runners: list[Any]) -> None:
        import torch
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        self.capturer = _capturer_class()(
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens, vllm_config=vllm_config
        )
        bind_routed_experts_capturer(torch.nn.ModuleList(runners), self.capturer)
        self.num_layers_bound = len(runners)
        self.layer_ids = frozenset(int(runner.layer_id) for runner in runners)
        """The MoE layers bound: each reports its routing in every step that runs tokens (unless a graph replays)."""
        buffer = self.capturer.device_buffer
        self._host_buffer = buffer.numpy() if buffer.device.type == "cpu" else None
        """On CPU, a numpy view of the capture buffer (same memory): read without a torch call per step."""
        if self._host_buffer is not None and vllm_config.parallel_config.data_parallel_size == 1:
            self.capturer.host_buffer = self._host_buffer

    def begin_step(self) -> None:
        self.capturer.calls = 0
        self.capturer.layers_seen = set()

    def step_rows(self, slot_mapping: Any) -> tuple[np.ndarray, Any]:
        """``(slot_mapping, capture buffer)`` of the step that just ran (row ``i`` of the buffer: token ``i``).

        Raises:
            CaptureError: tokens ran but no router reported its choice (capture is not hooked in), or some MoE layers
                reported none (their column would hold an earlier step's ids).
        """
        if len(self.capturer.layers_seen) < len(self.layer_ids) and not _graph_replayed():
            if self.capturer.calls == 0:
                raise CaptureError(
                    "a step ran tokens through the model but no MoE router reported its routing: capture is not "
                    "hooked into the forward pass (on CPU this happens under torch.compile; use --enforce-eager)"
                )
            missing = sorted(self.layer_ids - self.capturer.layers_seen)
            raise CaptureError(
                f"MoE layers {missing} reported no routing in a step where the other layers did: their rows would "
                "hold an earlier step's experts"
            )
        mapping = slot_mapping.cpu().numpy() if hasattr(slot_mapping, "cpu") else np.asarray(slot_mapping)
        if self._host_buffer is not None:
            return mapping, self._host_buffer
        return mapping, self.capturer.device_buffer  # the CUDA kernel reads it in place (__cuda_array_interface__)


def _graph_replayed() -> bool:
    """Whether this step replayed a CUDA graph: the capture writes recorded in it ran, but no Python call did."""
    from vllm.config import CUDAGraphMode

    return is_forward_context_available() and get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.NONE


def forward_slot_mapping(layer_name: str) -> Any | None:
    """The slot mapping of ``layer_name`` in the current forward context, or None outside one."""
    if not is_forward_context_available():
        return None
    context = get_forward_context()
    mapping = context.slot_mapping
    if isinstance(mapping, dict) and mapping.get(layer_name) is not None:
        return mapping[layer_name]
    metadata = context.attn_metadata
    if isinstance(metadata, dict) and layer_name in metadata:
        return getattr(metadata[layer_name], "slot_mapping", None)
    return None
