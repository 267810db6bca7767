"""Worker-side row mapping and the connector's routed-experts switches (pure functions, real vLLM configs)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_r3.artifacts import R3Profile
from lmcache_r3.mp.capture import CaptureError, collect_step_rows, locate_rows, require_eager_on_cpu
from lmcache_r3.mp.r3_messages import StepRows
from lmcache_r3.output import (
    ROUTED_EXPERTS_ERROR_KEY,
    RoutedExpertsUnavailable,
    decode_routed_experts,
    encode_routed_experts,
    routed_experts,
)

BLOCK = 4


@pytest.mark.parametrize(
    ("slot_mapping", "plans", "found", "unmapped"),
    [
        pytest.param([8, 9, 10], {"a": StepRows(0, 3, 0, (2,))}, {"a": [0, 1, 2]}, [], id="one-request-in-order"),
        pytest.param(
            [21, 22, 8, 9],
            {"a": StepRows(0, 2, 0, (2,)), "b": StepRows(5, 2, 1, (5,))},
            {"a": [2, 3], "b": [0, 1]},
            [],
            id="batch-order-differs-from-plan-order",
        ),
        pytest.param(
            [14, 15, 4, 5], {"a": StepRows(2, 4, 0, (3, 1))}, {"a": [0, 1, 2, 3]}, [], id="positions-span-two-blocks"
        ),
        pytest.param([8, -1, 9], {"a": StepRows(0, 2, 0, (2,))}, {"a": [0, 2]}, [], id="padding-slots-skipped"),
        pytest.param([8], {"a": StepRows(0, 2, 0, (2,))}, {}, ["a"], id="a-position-without-a-row"),
        pytest.param([8, 8, 9], {"a": StepRows(0, 2, 0, (2,))}, {}, ["a"], id="a-slot-claimed-twice"),
        pytest.param([8], {"a": StepRows(0, 0, 0, ())}, {}, [], id="nothing-scheduled"),
    ],
)
def test_locate_rows_finds_each_position_by_its_slot(slot_mapping, plans, found, unmapped):
    located, missing = locate_rows(np.asarray(slot_mapping), plans, BLOCK)
    assert {rid: index.tolist() for rid, (index, _) in located.items()} == found
    assert missing == unmapped


def test_collect_step_rows_narrows_and_keeps_positions():
    profile = R3Profile(num_layers=2, top_k=2, num_experts=300)
    captured = np.arange(4 * 4, dtype=np.int32).reshape(4, 2, 2) * 10
    rows, unmapped = collect_step_rows(
        np.array([13, 12, 4, 5]), captured, {"a": StepRows(0, 2, 0, (1,)), "b": StepRows(4, 2, 1, (3,))}, BLOCK,
        profile,
    )  # fmt: skip
    assert unmapped == []
    assert rows["a"].start == 0 and rows["a"].rows.dtype == np.uint16
    np.testing.assert_array_equal(rows["a"].rows, captured[[2, 3]])
    np.testing.assert_array_equal(rows["b"].rows, captured[[1, 0]])
    np.testing.assert_array_equal(rows["b"].slots, [12, 13])


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


@given(
    requests=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 40)), min_size=1, max_size=12),
    drop=st.integers(-1, 30),
    seed=st.integers(0, 2**16),
)
def test_locate_rows_agrees_with_a_slot_dictionary(requests, drop, seed):
    rng = np.random.default_rng(seed)
    plans, next_block = {}, 1
    for i, (start, count) in enumerate(requests):
        first, last = start // BLOCK, max(start // BLOCK, (start + count - 1) // BLOCK + 1)
        plans[f"r{i}"] = StepRows(start, count, first, tuple(range(next_block, next_block + last - first)))
        next_block += last - first
    all_slots = [int(x) for plan in plans.values() for x in plan.slots(BLOCK)]
    if 0 <= drop < len(all_slots):
        del all_slots[drop]  # one position has no row
    mapping = np.array(all_slots + [-1], dtype=np.int64)[rng.permutation(len(all_slots) + 1)]
    row_of = {int(slot): row for row, slot in enumerate(mapping)}
    located, unmapped = locate_rows(mapping, plans, BLOCK)
    for request_id, plan in plans.items():
        wanted = [row_of.get(int(slot)) for slot in plan.slots(BLOCK)]
        if plan.num_tokens == 0:
            assert request_id not in located and request_id not in unmapped
        elif None in wanted:
            assert request_id in unmapped
        else:
            assert located[request_id][0].tolist() == wanted
