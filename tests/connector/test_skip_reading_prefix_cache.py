"""A request that must not read cached KV (vLLM's ``skip_reading_prefix_cache``, set for prompt logprobs).

vLLM admits such a request for local computation whatever the connector answers, "lookup still out" included, so
a lookup sent for it would lock its hit on the LMCache server until the read-lock TTL. Real vLLM scheduler and both
connector roles, a real LMCache server.
"""

import numpy as np
import pytest

from tests.routed.test_harness_routed import expected_rows, returned_rows
from tests.support.harness import wait_locks
from tests.support.prompts import seeded_prompt

pytestmark = [pytest.mark.harness, pytest.mark.server]

CHUNK = 64
CONNECTOR = "lmcache_r3.mp.connector"


@pytest.mark.parametrize("routed_experts", [False, True], ids=["kv-only", "routed-experts"])
def test_a_request_that_skips_reading_the_prefix_cache_locks_nothing_and_computes_every_row(
    own_r3_server, scheduler_harness_factory, routed_experts
):
    harness = scheduler_harness_factory(server=own_r3_server, connector_module=CONNECTOR, routed_experts=routed_experts)
    tokens = seeded_prompt(4 * CHUNK + 19, seed=21)
    harness.generate([("cold", tokens)], max_tokens=2)
    harness.reset_prefix_cache()  # LMCache holds the prompt's KV (and R3) now
    request = harness.make_request("logprobs", tokens, 2)
    request.skip_reading_prefix_cache = True  # what prompt_logprobs sets
    harness.scheduler.add_request(request)
    harness.run_until_idle()
    assert "logprobs" in harness.outputs and "logprobs" not in harness.scheduler.requests
    assert wait_locks(own_r3_server, 0, timeout_s=5) == 0, "a lookup nobody loads from left its locks"
    if routed_experts:
        np.testing.assert_array_equal(returned_rows(harness, "logprobs"), expected_rows(harness, "logprobs", tokens, 2))
        sources = harness.outputs["logprobs"]["lmcache_r3_sources"]
        assert sources["lmcache_tokens"] == sources["vllm_cached_tokens"] == 0, sources
