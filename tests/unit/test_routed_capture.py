"""Worker-side step rows and the connector's routed-experts switches (pure functions, real vLLM configs)."""

from __future__ import annotations

import base64
import io
import struct

import numpy as np
import pytest
import torch
import xxhash

from lmcache_r3.artifacts import GatherNarrowError, R3Profile
from lmcache_r3.mp.capture import CaptureError, StepRowsError, narrow_step, require_eager_on_cpu
from lmcache_r3.output import (
    FINGERPRINT_KEY,
    ROUTED_EXPERTS_ERROR_KEY,
    ROUTED_EXPERTS_KEY,
    SIBLING_FINGERPRINTS_KEY,
    SIBLINGS_KEY,
    RoutedExpertsUnavailable,
    decode_routed_experts,
    encode_routed_experts,
    routed_experts,
    routed_experts_from_params,
    token_fingerprint,
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


@pytest.mark.parametrize(
    ("setting", "value", "refusal"),
    [
        pytest.param("pipeline_parallel_size", 2, "2 pipeline stages.*pipeline_parallel_size 1", id="pipeline"),
        pytest.param("decode_context_parallel_size", 2, "decode_context_parallel_size is 2", id="decode-cp"),
        pytest.param("prefill_context_parallel_size", 2, "prefill_context_parallel_size is 2", id="prefill-cp"),
        pytest.param("enable_dbo", True, "micro-batches", id="dual-batch-overlap"),
        pytest.param("ubatch_size", 2, "micro-batches", id="micro-batches"),
    ],
)
def test_layouts_that_split_a_steps_capture_are_refused_while_routed_experts_are_on(vllm_config, setting, value,
                                                                                     refusal):  # fmt: skip
    # Each of these hands the connector rows that are not one whole row per token of the step: refused at start,
    # naming the setting, never rows partly zero or placed in the wrong slots.
    from lmcache_r3.mp.connector_config import routed_experts_profile

    setattr(vllm_config.parallel_config, setting, value)
    with pytest.raises(ValueError, match=f"{refusal}.*routed_experts.*false"):
        routed_experts_profile(vllm_config, enabled=True)
    assert routed_experts_profile(vllm_config, enabled=False) is None


def test_model_runner_v2_on_a_gpu_is_refused_naming_the_switch(vllm_config, monkeypatch):
    # (No GPU here: the platform says it is not a CPU.) V2 builds the connector's worker output after the forward
    # context is gone, so no captured row could be matched to its token.
    from vllm.platforms import current_platform

    from lmcache_r3.mp.connector_config import routed_experts_profile

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert routed_experts_profile(vllm_config, enabled=True) is not None  # on the CPU the V1 runner always runs
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        routed_experts_profile(vllm_config, enabled=True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert routed_experts_profile(vllm_config, enabled=True) is not None


def test_only_the_target_models_moe_runners_are_bound_not_a_drafters(vllm_config):
    # A speculative drafter (MTP) shares the compilation config, so its MoE runners sit in static_forward_context
    # too, numbered past the model's last layer (DeepSeek) or from 0 again (Qwen3-Next); binding them would crash the
    # drafter's forward pass or overwrite layer 0's rows. (Runners stand in for built ones: no model is built here.)
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    from lmcache_r3.mp.capture import find_moe_runners

    class Runner(MoERunner):
        def __init__(self, layer_name: str) -> None:  # no model to build one from: its layer id is read from the name
            self.layer_name = layer_name

    names = ["model.layers.1.mlp.experts", "model.layers.0.mlp.experts", "model.layers.2.mlp.experts",
             "mtp.layers.0.mlp.experts"]  # fmt: skip
    target, drafter = [Runner(name) for name in names[:2]], [Runner(name) for name in names[2:]]  # 2 model layers
    vllm_config.compilation_config.static_forward_context = {
        **{runner.layer_name: runner for runner in target},
        "model.layers.0.self_attn.attn": object(),
        **{runner.layer_name: runner for runner in drafter},
    }
    assert find_moe_runners(vllm_config) == [target[1], target[0]]


def test_narrow_step_never_keeps_a_view_of_the_slot_mapping():
    # vLLM rewrites its slot-mapping buffer every step; the scheduler may keep a step's slots queued for several.
    slot_mapping = np.array([8, 9, 10], dtype=np.int64)
    slots, _ = narrow_step(slot_mapping, captured_rows(3), PROFILE)
    slot_mapping[:] = [20, 21, 22]
    assert slots.tolist() == [8, 9, 10]


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


PROMPT = [5, 6, 7]
OUTPUTS = {0: [8, 9, 10], 1: [11, 12, 13]}
"""A request of a 3-token prompt sampled twice (n = 2), 3 output tokens each: 5 rows per completion."""


def _rows(index: int) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 300, size=(5, 3, 2)).astype(np.uint16)


def _params(*indices: int, sibling_prints: dict | None = None) -> dict:
    """The params the connector returns: the last index's rows, and every index's when there are several."""
    last = indices[-1]
    params = {ROUTED_EXPERTS_KEY: encode_routed_experts(_rows(last)),
              FINGERPRINT_KEY: token_fingerprint(PROMPT + OUTPUTS[last])}  # fmt: skip
    if len(indices) > 1:
        params[SIBLINGS_KEY] = {str(i): encode_routed_experts(_rows(i)) for i in indices}
        params[SIBLING_FINGERPRINTS_KEY] = sibling_prints or {
            str(i): token_fingerprint(PROMPT + OUTPUTS[i]) for i in indices
        }
    return params


class _Completion:
    def __init__(self, index=0, stop_reason=None):
        self.index, self.stop_reason, self.token_ids = index, stop_reason, OUTPUTS[index]


class _Output:
    """The fields of vLLM's RequestOutput that routed_experts reads."""

    def __init__(self, params, completions=None, finished=True, prompt=PROMPT):
        self.kv_transfer_params, self.outputs, self.finished = params, completions or [_Completion()], finished
        self.prompt_token_ids = prompt


def test_token_fingerprint_names_the_number_and_order_of_the_tokens():
    assert token_fingerprint([1, 2, 3]) == f"3:{xxhash.xxh3_64_hexdigest(struct.pack('<3q', 1, 2, 3))}"
    assert token_fingerprint([2**40, -1]) == f"2:{xxhash.xxh3_64_hexdigest(struct.pack('<2q', 2**40, -1))}"
    assert token_fingerprint([1, 2, 3]) == token_fingerprint(np.array([1, 2, 3], dtype=np.int32))
    assert len({token_fingerprint(t) for t in ([1, 2, 3], [3, 2, 1], [1, 2], [1, 2, 3, 0], [])}) == 5


def _np_save_base64(rows: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, rows, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


_GRID = np.arange(5 * 48 * 8).reshape(5, 48, 8)


@pytest.mark.parametrize(
    "rows",
    [
        pytest.param((_GRID % 128).astype(np.uint8), id="uint8"),
        pytest.param((_GRID * 7 % 512).astype(np.uint16), id="uint16"),
        pytest.param(np.zeros((0, 2, 2), np.uint8), id="no-rows"),
        pytest.param((_GRID % 128).astype(np.uint8)[::2, :, 1:7], id="not-contiguous"),
        pytest.param(np.full((3, 1, 1), 255, np.uint8), id="one-layer-top-1"),
    ],
)
def test_encoded_routed_experts_are_exactly_base64_of_np_save_bytes(rows):
    """The documented format, byte for byte: what any reader that does ``np.load(b64decode(...))`` expects."""
    encoded = encode_routed_experts(rows)
    assert encoded == _np_save_base64(rows)
    decoded = decode_routed_experts(encoded)
    assert decoded.dtype == rows.dtype
    np.testing.assert_array_equal(decoded, rows)


def test_object_rows_are_refused_when_encoding():
    with pytest.raises(ValueError, match="integer rows"):
        encode_routed_experts(np.array([[[1]]], dtype=object))


def test_routed_experts_round_trip_and_every_refusal_names_its_cause():
    rows = _rows(0)
    encoded = encode_routed_experts(rows)
    assert isinstance(encoded, str)
    np.testing.assert_array_equal(decode_routed_experts(encoded), rows)
    np.testing.assert_array_equal(routed_experts(_Output(_params(0))), rows)
    with pytest.raises(RoutedExpertsUnavailable, match="final output"):
        routed_experts(_Output(_params(0), finished=False))
    with pytest.raises(RoutedExpertsUnavailable, match="incomplete"):
        routed_experts(_Output({ROUTED_EXPERTS_ERROR_KEY: "routed experts of request x are incomplete"}))
    with pytest.raises(RoutedExpertsUnavailable, match="stop_token_ids"):
        routed_experts(_Output(None, [_Completion(stop_reason="END")]))
    with pytest.raises(RoutedExpertsUnavailable, match="LMCacheMPConnector"):
        routed_experts(_Output(None))
    with pytest.raises(RoutedExpertsUnavailable, match="another token sequence"):
        routed_experts(_Output(_params(0), prompt=[5, 6, 4]))  # rows of other tokens are never handed out
    with pytest.raises(RoutedExpertsUnavailable, match="another token sequence"):
        routed_experts(_Output({ROUTED_EXPERTS_KEY: encoded}))  # rows that name no tokens neither
    with pytest.raises(RoutedExpertsUnavailable, match="dict has no completions: pass the RequestOutput"):
        routed_experts(_params(0))  # the params instead of the output


def _damaged(how: str) -> dict:
    """The params of completion 0 with their rows damaged ``how``, the fingerprint intact."""
    params = _params(0)
    encoded = params[ROUTED_EXPERTS_KEY]
    if how == "a character not in base64":
        params[ROUTED_EXPERTS_KEY] = encoded[:40] + "!" + encoded[41:]
    elif how == "truncated":
        params[ROUTED_EXPERTS_KEY] = encoded[: len(encoded) // 2 // 4 * 4]
    elif how == "float rows":
        params[ROUTED_EXPERTS_KEY] = encode_routed_experts(_rows(0).astype(np.float32))
    elif how == "one row short":
        params[ROUTED_EXPERTS_KEY] = encode_routed_experts(_rows(0)[:-1])
    return params


@pytest.mark.parametrize(
    ("how", "refusal"),
    [
        ("a character not in base64", "do not decode"),
        ("truncated", "do not decode"),
        ("float rows", "uint8 / uint16"),
        ("one row short", "4 rows for 6 tokens"),
    ],
)
def test_damaged_routed_experts_are_refused_never_returned(how, refusal):
    """A response altered on its way (a proxy, a truncated log line) never yields rows for the tokens it names."""
    with pytest.raises(RoutedExpertsUnavailable, match=refusal):
        routed_experts(_Output(_damaged(how)))


def test_routed_experts_of_parallel_samples_are_each_completions_own():
    output = _Output(_params(0, 1), [_Completion(0), _Completion(1)])
    for index in (0, 1):
        np.testing.assert_array_equal(routed_experts(output, index), _rows(index))
    swapped = {"0": token_fingerprint(PROMPT + OUTPUTS[1]), "1": token_fingerprint(PROMPT + OUTPUTS[0])}
    with pytest.raises(RoutedExpertsUnavailable, match="another token sequence"):
        routed_experts(_Output(_params(0, 1, sibling_prints=swapped), [_Completion(0), _Completion(1)]), 1)


@pytest.mark.parametrize(
    ("params", "tokens", "index", "expected", "refusal"),
    [
        pytest.param(_params(0), PROMPT + OUTPUTS[0], None, 0, None, id="one-prompt"),
        pytest.param(_params(0, 1), PROMPT + OUTPUTS[1], 1, 1, None, id="n2-choice-1"),
        pytest.param(_params(0, 1), PROMPT + OUTPUTS[0], 0, 0, None, id="n2-choice-0"),
        pytest.param(_params(0, 1), PROMPT + OUTPUTS[0], 1, None, "another token sequence", id="n2-wrong-tokens"),
        pytest.param(_params(0, 1), PROMPT + OUTPUTS[0], 2, None, "no routed experts for choice 2", id="n2-no-choice"),
        pytest.param(_params(0), [9, 9, 9, 8, 9, 10], None, None, "send one prompt per request", id="other-prompt"),
        pytest.param(_params(0), PROMPT + OUTPUTS[0][:2], None, None, "another token sequence", id="fewer-tokens"),
        pytest.param(None, PROMPT, None, None, "stop string", id="no-params"),
        pytest.param({"lmcache_r3_sources": {}}, PROMPT, None, None, "connector", id="no-rows"),
        pytest.param(
            {ROUTED_EXPERTS_ERROR_KEY: "rows of x are incomplete"}, PROMPT, None, None, "incomplete", id="incomplete"
        ),  # fmt: skip
    ],
)
def test_routed_experts_from_a_servers_response(params, tokens, index, expected, refusal):
    """What a client of vLLM's OpenAI server reads: the response's kv_transfer_params and the choice's tokens."""
    if refusal is None:
        np.testing.assert_array_equal(routed_experts_from_params(params, tokens, index), _rows(expected))
    else:
        with pytest.raises(RoutedExpertsUnavailable, match=refusal):
            routed_experts_from_params(params, tokens, index)


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


class _Router(torch.nn.Module):
    """A MoE router as vLLM binds it (a ``RoutedExpertsCaptureSource``): its layer id and the capture hook."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.capture_fn = None


def test_a_step_where_a_moe_layer_reported_no_routing_is_an_error_never_stale_rows(vllm_config):
    from vllm.forward_context import set_forward_context

    from lmcache_r3.mp.capture import RouterCapture

    routers = [_Router(0), _Router(1)]
    capture = RouterCapture(vllm_config, routers)
    ids = torch.tensor([[1, 5], [7, 0]], dtype=torch.int32)
    slots = torch.tensor([3, 4])
    with set_forward_context(None, vllm_config):
        capture.begin_step()
        for router in routers:
            router.capture_fn(ids)
        mapping, rows = capture.step_rows(slots)
        assert mapping.tolist() == [3, 4] and rows[:2, 1].tolist() == ids.tolist()
        capture.begin_step()
        routers[0].capture_fn(ids)  # layer 1 skipped the hook: its column still holds the last step's ids
        with pytest.raises(CaptureError, match=r"MoE layers \[1\] reported no routing"):
            capture.step_rows(slots)
        capture.begin_step()
        with pytest.raises(CaptureError, match="no MoE router reported its routing"):
            capture.step_rows(slots)
