"""A finished request's session on the LMCache server ends once its last store reached the server.

LMCache 0.5.6's own connector ends it when vLLM finishes the request; the worker's last store often arrives after
that and creates the session again, which the server then keeps for 10 minutes, and a later request under the same
id has its KV stored under the old tokens' chunk keys.
"""

import pytest

from tests.support.harness import kv_lookup_answer, wait_sessions
from tests.support.prompts import seeded_prompt

pytestmark = pytest.mark.harness

CHUNK = 64
CONNECTOR = "lmcache_r3.mp.connector"


def test_finished_requests_leave_no_session_on_the_server(own_r3_server, scheduler_harness_factory):
    harness = scheduler_harness_factory(server=own_r3_server, connector_module=CONNECTOR, routed_experts=True)
    base = seeded_prompt(3 * CHUNK + 5, seed=1)
    harness.generate([("base", base)], max_tokens=3)
    harness.reset_prefix_cache()
    shared = {f"s{cut}": base[:cut] + seeded_prompt(40, seed=cut) for cut in (CHUNK + 7, 2 * CHUNK + 1, 3 * CHUNK + 5)}
    harness.generate(shared.items(), max_tokens=3)
    harness.settle_stores()
    assert wait_sessions(own_r3_server, 0) == 0, "a finished request's session outlived it on the server"
    assert harness.scheduler.connector.session_ends.pending() == 0


def test_an_engine_reusing_a_finished_request_id_stores_its_kv_under_its_own_tokens(
    own_r3_server, scheduler_harness_factory
):
    """Two engines on one server, one after the other, each with a request "0" (vLLM's first id when its request-id
    randomization is off): the second engine's KV is stored under the second prompt's chunk keys."""
    tokens = {"first": seeded_prompt(3 * CHUNK + 20, seed=2), "second": seeded_prompt(3 * CHUNK + 20, seed=3)}
    for name in tokens:
        engine = scheduler_harness_factory(server=own_r3_server, connector_module=CONNECTOR, routed_experts=True)
        engine.generate([("0", tokens[name])], max_tokens=2)
        engine.settle_stores()
        assert wait_sessions(own_r3_server, 0) == 0, "request 0's session outlived it: the next engine's 0 gets it"
    adapter = engine.scheduler.connector.scheduler_adapter
    for name, prompt_tokens in tokens.items():
        adapter.maybe_submit_lookup_request(name, token_ids=prompt_tokens)
        assert kv_lookup_answer(adapter, name) == 3 * CHUNK, f"the {name} prompt's KV is not under its chunk keys"
        adapter.free_lookup_locks(prompt_tokens, 0, 3 * CHUNK, name)
        adapter.cleanup_lookup_result(name)


def test_a_consumer_engine_loading_from_lmcache_leaves_no_session(own_r3_server, scheduler_harness_factory):
    """A ``kv_consumer`` stores nothing and its worker never reports stores finished: its sessions end at the
    finish, as LMCache's own connector ends them."""
    tokens = seeded_prompt(3 * CHUNK + 20, seed=4)
    producer = scheduler_harness_factory(server=own_r3_server, connector_module=CONNECTOR, routed_experts=True)
    producer.generate([("p", tokens)], max_tokens=2)
    producer.settle_stores()
    consumer = scheduler_harness_factory(
        server=own_r3_server, connector_module=CONNECTOR, routed_experts=True, kv_role="kv_consumer"
    )
    consumer.generate([("c", tokens)], max_tokens=2)
    assert consumer.outputs["c"]["lmcache_r3_sources"]["lmcache_tokens"] == 3 * CHUNK  # it did use the server
    assert wait_sessions(own_r3_server, 0) == 0, "a consumer's finished request kept its session on the server"
