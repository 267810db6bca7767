"""Routed experts through the real vLLM scheduler and both connector roles, with a real LMCache server.

The model cannot run in a scheduler test: :class:`tests.support.harness.EmulatedRouter` stands in for the MoE
routers (a pure function of the token prefix), and the worker-side connector maps its rows exactly as it maps
a real capture buffer. Every test compares the returned rows with the router's rows for the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from lmcache_r3 import routed_experts
from lmcache_r3.output import ROUTED_EXPERTS_ERROR_KEY, ROUTED_EXPERTS_KEY, decode_routed_experts
from tests.support.harness import BLOCK_SIZE

pytestmark = [pytest.mark.server, pytest.mark.harness]

CONNECTOR = "lmcache_r3.mp.connector"
CHUNK = 64


def prompt(length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 900, size=length)]


def returned_rows(harness, request_id: str) -> np.ndarray:
    params = harness.outputs[request_id]
    assert params is not None and ROUTED_EXPERTS_KEY in params, (
        f"{request_id} returned no routed experts: {params and params.get(ROUTED_EXPERTS_ERROR_KEY)}"
    )
    return decode_routed_experts(params[ROUTED_EXPERTS_KEY])


def expected_rows(harness, request_id: str, tokens: list[int], max_tokens: int) -> np.ndarray:
    all_tokens = tokens + [harness.sampled_token] * max_tokens
    return harness.router.routed_experts(all_tokens, harness.scheduler.connector.r3_profile.dtype)


@pytest.fixture
def r3_harness(scheduler_harness_factory, r3_server):
    def build(**overrides):
        return scheduler_harness_factory(server=r3_server, connector_module=CONNECTOR, routed_experts=True, **overrides)

    return build


def test_cold_then_lmcache_hit_then_prefix_cache_hit_return_the_same_rows(r3_harness):
    harness = r3_harness()
    book = harness.scheduler.connector.routed
    tokens = prompt(4 * CHUNK + 19, seed=1)
    harness.generate([("cold", tokens)], max_tokens=4)
    cold = returned_rows(harness, "cold")
    np.testing.assert_array_equal(cold, expected_rows(harness, "cold", tokens, 4))
    assert cold.shape == (len(tokens) + 3, 2, 2)
    assert book.counters.values["chunks_published"] == 4
    book.settle(10)

    harness.reset_prefix_cache()
    harness.generate([("warm", tokens)], max_tokens=4)
    np.testing.assert_array_equal(returned_rows(harness, "warm"), cold)
    assert book.counters.values["rows_from_lmcache"] == 4 * CHUNK

    harness.generate([("local", tokens)], max_tokens=4)  # vLLM's own prefix cache holds it now
    np.testing.assert_array_equal(returned_rows(harness, "local"), cold)
    assert book.counters.values["rows_from_prefix_cache"] >= 4 * CHUNK


def test_prefixes_shared_by_different_suffixes_at_unaligned_lengths(r3_harness):
    harness = r3_harness()
    base = prompt(3 * CHUNK + 5, seed=2)
    harness.generate([("base", base)], max_tokens=3)
    harness.scheduler.connector.routed.settle(10)
    harness.reset_prefix_cache()
    cases = {f"s{cut}": base[:cut] + prompt(40, seed=cut) for cut in (BLOCK_SIZE + 7, 2 * CHUNK + 1, 3 * CHUNK + 5)}
    harness.generate(cases.items(), max_tokens=3)
    for request_id, tokens in cases.items():
        np.testing.assert_array_equal(returned_rows(harness, request_id), expected_rows(harness, request_id, tokens, 3))


def test_routed_experts_reads_a_request_output(r3_harness):
    harness = r3_harness()
    tokens = prompt(70, seed=3)
    harness.generate([("r", tokens)], max_tokens=2)

    class Completion:
        index = 0
        stop_reason = None

    class Output:
        finished = True
        outputs = [Completion()]
        kv_transfer_params = harness.outputs["r"]

    np.testing.assert_array_equal(routed_experts(Output()), expected_rows(harness, "r", tokens, 2))
