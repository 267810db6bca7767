"""Worker-side step rows and the connector's routed-experts switches (pure functions, real vLLM configs)."""

from __future__ import annotations

import numpy as np
import pytest

from lmcache_r3.artifacts import GatherNarrowError, R3Profile
from lmcache_r3.mp.capture import CaptureError, StepRowsError, narrow_step, require_eager_on_cpu
from lmcache_r3.output import (
    ROUTED_EXPERTS_ERROR_KEY,
    RoutedExpertsUnavailable,
    decode_routed_experts,
    encode_routed_experts,
    routed_experts,
)

PROFILE = R3Profile(num_layers=2, top_k=2, num_experts=8)


def captured_rows(num_rows: int, num_experts: int = 8) -> np.ndarray:
    """A capture buffer as the router fills it: int32, one row per token, distinct ids per token."""
    return (np.arange(num_rows * 4, dtype=np.int32).reshape(num_rows, 2, 2) * 3 + 1) % num_experts


@pytest.mark.parametrize(
    ("slot_mapping", "num_captured", "kept"),
    [
        pytest.param([40, 9, 10], 3, [0, 1, 2], id="every-token-in-batch-order"),
        pytest.param([8, -1, 9, -1], 4, [0, 2], id="padding-tokens-dropped"),
        pytest.param([8, 9], 16, [0, 1], id="buffer-longer-than-the-step"),
        pytest.param([], 4, [], id="nothing-computed"),
        pytest.param([-1, -1], 2, [], id="only-padding"),
    ],
)
def test_narrow_step_keeps_each_real_tokens_row_beside_its_slot(slot_mapping, num_captured, kept):
    captured = captured_rows(num_captured)
    slots, rows = narrow_step(np.asarray(slot_mapping, dtype=np.int32), captured, PROFILE)
    assert slots.dtype == np.int64 and rows.dtype == np.uint8
    assert slots.tolist() == [slot_mapping[i] for i in kept]
    np.testing.assert_array_equal(rows, captured[kept])


def test_narrow_step_narrows_to_uint16_and_never_aliases_the_capture_buffer():
    profile = R3Profile(num_layers=2, top_k=2, num_experts=300)
    captured = captured_rows(3, num_experts=300) * 90 % 300
    slots, rows = narrow_step(np.array([5, 6, 7]), captured, profile)
    assert rows.dtype == np.uint16
    np.testing.assert_array_equal(rows, captured)
    already_narrow = captured.astype(np.uint16)
    _, rows = narrow_step(np.array([5, 6, 7]), already_narrow, profile)
    already_narrow[:] = 0  # the runner overwrites its buffer in the next step
    np.testing.assert_array_equal(rows, captured)


def test_narrow_step_refuses_ids_outside_the_profile_and_a_short_buffer():
    captured = captured_rows(2)
    captured[1, 0, 1] = 8  # 8 experts: ids 0..7
    with pytest.raises(GatherNarrowError, match="expert ids span"):
        narrow_step(np.array([3, 4]), captured, PROFILE)
    with pytest.raises(StepRowsError, match="holds 2 rows but the step computed 3 tokens"):
        narrow_step(np.array([3, 4, 5]), captured_rows(2), PROFILE)


@pytest.fixture
def vllm_config(tiny_moe):
    from tests.support.harness import HarnessConfig, make_vllm_config

    return make_vllm_config(tiny_moe, "tcp://127.0.0.1", 1, HarnessConfig())


def test_profile_of_a_moe_model_and_refusal_next_to_vllms_own_routed_experts(vllm_config):
    from lmcache_r3.mp.connector_config import routed_experts_profile

    assert routed_experts_profile(vllm_config, enabled=True) == R3Profile(num_layers=2, top_k=2, num_experts=8)
    assert routed_experts_profile(vllm_config, enabled=False) is None
    vllm_config.aux_output_config.enable_return_routed_experts = True
    with pytest.raises(ValueError, match="enable-return-routed-experts"):
        routed_experts_profile(vllm_config, enabled=True)


def test_cpu_without_enforce_eager_is_refused_with_the_fix(vllm_config):
    vllm_config.model_config.enforce_eager = False
    with pytest.raises(CaptureError, match="--enforce-eager"):
        require_eager_on_cpu(vllm_config)
    vllm_config.model_config.enforce_eager = True
    require_eager_on_cpu(vllm_config)


@pytest.mark.parametrize("dtype", ["int64", "int32"], ids=["int64-ids", "int32-ids"])
def test_the_cpu_capture_fast_path_writes_what_vllms_capture_writes(vllm_config, dtype):
    import torch
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

    from lmcache_r3.mp.capture import _capturer_class

    ours = _capturer_class()(max_num_batched_tokens=16, vllm_config=vllm_config)
    ours.host_buffer = ours.device_buffer.numpy()
    theirs = RoutedExpertsCapturer(max_num_batched_tokens=16, vllm_config=vllm_config)
    for buffer in (ours.device_buffer, theirs.device_buffer):
        buffer.fill_(-1)  # what the previous step left: rows past this step's tokens must stay as they are
    steps = [(0, torch.tensor([[1, 5], [7, 0], [3, 3]])), (1, torch.tensor([[6, 2], [4, 1], [0, 7]]))]
    with set_forward_context(None, vllm_config):
        for layer, ids in steps:
            ours.capture(layer, ids.to(getattr(torch, dtype)))
            theirs.capture(layer, ids.to(getattr(torch, dtype)))
        with pytest.raises(IndexError):
            ours.capture(2, steps[0][1])  # the tiny model has 2 MoE layers
    assert ours.calls == 3
    assert torch.equal(ours.device_buffer, theirs.device_buffer)
    assert ours.device_buffer[:3, 1].tolist() == steps[1][1].tolist()


class _Completion:
    def __init__(self, index=0, stop_reason=None):
        self.index, self.stop_reason = index, stop_reason


class _Output:
    """The two fields of vLLM's RequestOutput that routed_experts reads."""

    def __init__(self, params, completions=None, finished=True):
        self.kv_transfer_params, self.outputs, self.finished = params, completions or [_Completion()], finished


def test_routed_experts_round_trip_and_every_refusal_names_its_cause():
    rows = np.random.default_rng(0).integers(0, 300, size=(5, 3, 2)).astype(np.uint16)
    encoded = encode_routed_experts(rows)
    assert isinstance(encoded, str)
    np.testing.assert_array_equal(decode_routed_experts(encoded), rows)
    np.testing.assert_array_equal(routed_experts(_Output({"routed_experts": encoded})), rows)
    with pytest.raises(RoutedExpertsUnavailable, match="final output"):
        routed_experts(_Output({"routed_experts": encoded}, finished=False))
    with pytest.raises(RoutedExpertsUnavailable, match="incomplete"):
        routed_experts(_Output({ROUTED_EXPERTS_ERROR_KEY: "routed experts of request x are incomplete"}))
    with pytest.raises(RoutedExpertsUnavailable, match="stop_token_ids"):
        routed_experts(_Output(None, [_Completion(stop_reason="END")]))
    with pytest.raises(RoutedExpertsUnavailable, match="LMCacheMPConnector"):
        routed_experts(_Output(None))


def test_worker_metadata_crosses_the_process_boundary_with_its_rows_and_receipts():
    """vLLM pickles the worker's metadata every step (worker process -> engine core); the rows travel as bytes."""
    import pickle

    from lmcache_r3.mp.r3_messages import R3WorkerMetadata

    rows = captured_rows(3).astype(np.uint8)
    sent = R3WorkerMetadata(completed_store_requests={"a": 1}, failed_store_requests={"b"}, step=7,
                            slots=np.array([9, 4, 33]), rows=rows)  # fmt: skip
    got = pickle.loads(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
    assert (got.step, got.completed_store_requests, got.failed_store_requests) == (7, {"a": 1}, {"b"})
    assert got.slots.tolist() == [9, 4, 33] and got.rows.dtype == np.uint8
    np.testing.assert_array_equal(got.rows, rows)
    failed = pickle.loads(pickle.dumps(R3WorkerMetadata(step=8, capture_error="no capture")))
    assert (failed.step, failed.rows, failed.slots, failed.capture_error) == (8, None, None, "no capture")
