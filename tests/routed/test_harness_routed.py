"""Routed experts through the real vLLM scheduler and both connector roles, with a real LMCache server.

The model cannot run in a scheduler test: :class:`tests.support.harness.EmulatedRouter` stands in for the MoE
routers (a pure function of the token prefix), and the worker-side connector maps its rows exactly as it maps
a real capture buffer. Every test compares the returned rows with the router's rows for the same tokens.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lmcache_r3 import routed_experts
from lmcache_r3.mp.r3_client import R3TimeoutError
from lmcache_r3.output import (
    FINGERPRINT_KEY,
    ROUTED_EXPERTS_ERROR_KEY,
    ROUTED_EXPERTS_KEY,
    decode_routed_experts,
    token_fingerprint,
)
from tests.support.harness import BLOCK_SIZE, ask_until_answered, kv_lookup_answer, locks_stay, lookup, wait_locks
from tests.support.prompts import seeded_prompt

pytestmark = [pytest.mark.server, pytest.mark.harness]

CONNECTOR = "lmcache_r3.mp.connector"
CHUNK = 64


def returned_rows(harness, request_id: str) -> np.ndarray:
    params = harness.outputs[request_id]
    assert params is not None and ROUTED_EXPERTS_KEY in params, (
        f"{request_id} returned no routed experts: {params and params.get(ROUTED_EXPERTS_ERROR_KEY)}"
    )
    rows = decode_routed_experts(params[ROUTED_EXPERTS_KEY])
    assert params[FINGERPRINT_KEY].startswith(f"{rows.shape[0] + 1}:"), "rows and their token fingerprint disagree"
    return rows


def expected_rows(harness, request_id: str, tokens: list[int], num_outputs: int) -> np.ndarray:
    """What the request must return: the router's rows of its prompt and the ``num_outputs`` tokens it sampled
    (and, when it returned rows, they name exactly these tokens)."""
    sequence = harness.sequence(request_id, tokens, num_outputs)
    params = harness.outputs.get(request_id) or {}
    if ROUTED_EXPERTS_KEY in params:
        assert params.get(FINGERPRINT_KEY) == token_fingerprint(sequence), f"{request_id}: rows of other tokens"
    return harness.router.routed_experts(sequence, harness.scheduler.connector.r3_profile.dtype)


@pytest.fixture
def r3_harness(scheduler_harness_factory, r3_server):
    def build(**overrides):
        return scheduler_harness_factory(server=r3_server, connector_module=CONNECTOR, routed_experts=True, **overrides)

    return build


def cold_then_lmcache_hit_then_prefix_cache_hit(harness, seed: int) -> None:
    """A cold run, the same prompt from LMCache after vLLM's prefix cache was reset, then from vLLM's own prefix
    cache: the three return the router's rows (the scenario of this test and of the async-scheduling one). Each
    caller passes a ``seed`` of its own: the server is shared, and a prompt another test stored is no cold run."""
    book = harness.scheduler.connector.routed
    tokens = seeded_prompt(4 * CHUNK + 19, seed=seed)
    harness.generate([("cold", tokens)], max_tokens=4)
    cold = returned_rows(harness, "cold")
    np.testing.assert_array_equal(cold, expected_rows(harness, "cold", tokens, 4))
    assert cold.shape == (len(tokens) + 3, 2, 2)
    assert book.counters.values["chunks_published"] == 4
    harness.reset_prefix_cache()
    harness.generate([("warm", tokens)], max_tokens=4)
    np.testing.assert_array_equal(returned_rows(harness, "warm"), cold)
    assert book.counters.values["rows_from_lmcache"] == 4 * CHUNK

    harness.generate([("local", tokens)], max_tokens=4)  # vLLM's own prefix cache holds it now
    np.testing.assert_array_equal(returned_rows(harness, "local"), cold)
    assert book.counters.values["rows_from_prefix_cache"] >= 4 * CHUNK


def test_cold_then_lmcache_hit_then_prefix_cache_hit_return_the_same_rows(r3_harness):
    cold_then_lmcache_hit_then_prefix_cache_hit(r3_harness(), seed=1)


def test_prefixes_shared_by_different_suffixes_at_unaligned_lengths(r3_harness):
    harness = r3_harness()
    base = seeded_prompt(3 * CHUNK + 5, seed=2)
    harness.generate([("base", base)], max_tokens=3)
    harness.reset_prefix_cache()
    cases = {
        f"s{cut}": base[:cut] + seeded_prompt(40, seed=cut) for cut in (BLOCK_SIZE + 7, 2 * CHUNK + 1, 3 * CHUNK + 5)
    }
    harness.generate(cases.items(), max_tokens=3)
    for request_id, tokens in cases.items():
        np.testing.assert_array_equal(returned_rows(harness, request_id), expected_rows(harness, request_id, tokens, 3))


def test_routed_experts_reads_a_request_output(r3_harness):
    harness = r3_harness()
    tokens = seeded_prompt(70, seed=3)
    harness.generate([("r", tokens)], max_tokens=2)

    class Completion:
        index = 0
        stop_reason = None
        token_ids = harness.sequence("r", tokens, 2)[len(tokens) :]

    class Output:
        finished = True
        prompt_token_ids = tokens
        outputs = [Completion()]
        kv_transfer_params = harness.outputs["r"]

    np.testing.assert_array_equal(routed_experts(Output()), expected_rows(harness, "r", tokens, 2))


def chunked_prefill_of_concurrent_requests_then_lmcache_hits(harness) -> None:
    """Concurrent requests sharing prefixes of unaligned lengths, in steps that end inside blocks and chunks (the
    harness built with ``max_num_batched_tokens=48``), then the same prompts again from LMCache."""
    base = seeded_prompt(2 * CHUNK + 40, seed=4)
    requests = {f"c{i}": base[: 50 + 40 * i] + seeded_prompt(30, seed=40 + i) for i in range(4)}
    harness.generate(requests.items(), max_tokens=5)
    harness.reset_prefix_cache()
    again = {f"again{i}": tokens for i, tokens in enumerate(requests.values())}
    harness.generate(again.items(), max_tokens=5)
    for request_id, tokens in (requests | again).items():
        np.testing.assert_array_equal(returned_rows(harness, request_id), expected_rows(harness, request_id, tokens, 5))
    sources = [harness.outputs[f"again{i}"]["lmcache_r3_sources"] for i in range(4)]
    assert sum(s["lmcache_tokens"] for s in sources) > 0, sources


def test_chunked_prefill_of_concurrent_requests_then_lmcache_hits(r3_harness):
    chunked_prefill_of_concurrent_requests_then_lmcache_hits(r3_harness(max_num_batched_tokens=48))


def preempted_requests_return_exact_rows(harness) -> None:
    """Three requests admitted together into a pool too small for them (the harness built with ``num_blocks=14``,
    ``max_num_batched_tokens=64``: 13 usable blocks, 416 tokens): vLLM preempts, and every row is still exact."""
    requests = {f"p{i}": seeded_prompt(150, seed=50 + i) for i in range(3)}
    preempted: set[str] = set()
    for request_id, tokens in requests.items():
        harness.add_request(request_id, tokens, max_tokens=60)
    # Admit all three together: a request is admitted once both its KV lookup and its R3 fetch answered, and a
    # harness step takes microseconds, so one answered late (a busy machine) would start many steps after the others
    # and the first could finish before the last grows, with nothing preempted.
    answered = ask_until_answered(harness, list(requests))
    first_scheduled: dict[str, int] = {}
    while harness.busy():
        out = harness.step()
        preempted |= set(out.preempted_req_ids or ())
        for new in out.scheduled_new_reqs:
            first_scheduled.setdefault(new.req_id, harness.steps)
    assert preempted, (
        f"the pool was meant to force a preemption; lookups answered before admission: {answered}, first scheduled "
        f"at steps {first_scheduled}, {harness.steps} steps in all"
    )
    for request_id, tokens in requests.items():
        expected = expected_rows(harness, request_id, tokens, 60)
        np.testing.assert_array_equal(returned_rows(harness, request_id), expected)


def test_preempted_requests_return_exact_rows(r3_harness):
    preempted_requests_return_exact_rows(r3_harness(num_blocks=14, max_num_batched_tokens=64))


SPECULATIVE = {"num_speculative_tokens": 3, "extra_config": {"lmcache.mp.save_decode_cache": True}}
"""Three drafts a step; LMCache stores decode-phase KV (the second chunk of the scenario below) only with
``save_decode_cache``."""


def test_speculative_decoding_returns_and_publishes_only_the_rows_of_accepted_tokens(r3_harness):
    """vLLM schedules draft tokens (its ngram method; the harness proposes the drafts, one in three wrong); a
    step computes the rows of its drafts as the model sees them, and a rejected draft's row differs from the row
    of the token that replaces it. Every returned row, and every chunk served from LMCache afterwards, is the
    row of the accepted sequence."""
    speculative_drafts_return_and_publish_only_accepted_rows(r3_harness(**SPECULATIVE))


def speculative_drafts_return_and_publish_only_accepted_rows(harness) -> None:
    """One request decoding with drafts across two chunk boundaries: exact rows, two chunks published, and a later
    LMCache hit on the whole sequence returns exact rows."""
    book = harness.scheduler.connector.routed
    tokens = seeded_prompt(CHUNK + 30, seed=9)
    harness.generate([("spec", tokens)], max_tokens=70)  # decodes across the second and third chunk boundaries
    assert harness.drafts_rejected > 0 and harness.times_scheduled["spec"] < 70, "drafts were accepted and rejected"
    rows = returned_rows(harness, "spec")
    np.testing.assert_array_equal(rows, expected_rows(harness, "spec", tokens, 70))
    assert book.counters.values["chunks_published"] == 2
    harness.reset_prefix_cache()
    whole = harness.sequence("spec", tokens, 70)
    harness.generate([("again", whole)], max_tokens=3)
    assert harness.outputs["again"]["lmcache_r3_sources"]["lmcache_tokens"] == 2 * CHUNK
    np.testing.assert_array_equal(returned_rows(harness, "again"), expected_rows(harness, "again", whole, 3))


def test_a_hit_waiting_for_blocks_is_asked_again_every_step_and_one_r3_fetch_serves_it(r3_harness):
    """A request whose LMCache hit answered while the pool is full waits: vLLM asks ``get_num_new_matched_tokens``
    again every step until it can allocate. The R3 fetched for the lookup serves every ask (the server is not asked
    again), and the rows it returns once admitted are exact."""
    harness = r3_harness(num_blocks=14)  # 13 usable blocks of 32 tokens
    hit = seeded_prompt(4 * CHUNK + 44, seed=61)
    harness.generate([("warm", hit)], max_tokens=2)
    harness.reset_prefix_cache()
    connector = harness.scheduler.connector
    asks: dict[str, int] = {}
    original = connector.get_num_new_matched_tokens

    def counted(request, num_computed_tokens):
        result = original(request, num_computed_tokens)
        if result[0] is not None:
            asks[request.request_id] = asks.get(request.request_id, 0) + 1
        return result

    harness.add_request("running", seeded_prompt(300, seed=62), max_tokens=60)  # holds 10 blocks, then 12
    harness.step_until_scheduled("running")
    fetches = connector.routed.counters.values["fetches"]
    harness.add_request("waiting", hit, max_tokens=4)  # its 301 tokens need 10 blocks: it waits for the first
    assert ask_until_answered(harness, ["waiting"]) == {"waiting": 4 * CHUNK}  # answered while the first runs
    connector.get_num_new_matched_tokens = counted  # from here on, only vLLM's asks
    harness.run_until_idle()
    assert asks["waiting"] >= 3, f"the hit was meant to wait for blocks (answered asks: {asks['waiting']})"
    assert connector.routed.counters.values["fetches"] == fetches + 1
    assert harness.outputs["waiting"]["lmcache_r3_sources"]["lmcache_tokens"] == 4 * CHUNK
    np.testing.assert_array_equal(returned_rows(harness, "waiting"), expected_rows(harness, "waiting", hit, 4))


class HeldCall:
    """A real R3 call whose answer the scheduler only sees once ``release`` is set: fault injection standing in for
    an R3 read from a slow L2 tier below the server (the KV of the same lookup answers first)."""

    def __init__(self, call, release: threading.Event) -> None:
        self.call, self.release = call, release

    def pending(self) -> bool:
        return not self.release.is_set() or self.call.pending()

    def result(self, timeout: float | None = None):
        if not self.release.wait(timeout):
            raise R3TimeoutError("held back by the test")
        return self.call.result(timeout)


def test_while_a_lookups_r3_is_out_running_requests_keep_stepping_and_the_joint_hit_is_kept(r3_harness):
    """LMCache's KV lookup answered but the R3 fetch of the same lookup has not: the request is not admitted yet
    (vLLM asks again each step) and the scheduler does not wait for the R3 read, so a running request steps on;
    once the R3 answer comes, the whole joint hit is loaded and the rows are exact."""
    harness = r3_harness()
    hit = seeded_prompt(3 * CHUNK + 20, seed=71)
    harness.generate([("warm", hit)], max_tokens=2)
    book = harness.scheduler.connector.routed
    harness.reset_prefix_cache()
    harness.add_request("running", seeded_prompt(100, seed=72), max_tokens=200)
    harness.step_until_scheduled("running")
    release = threading.Event()
    fetch_many = book.client.fetch_many
    book.client.fetch_many = lambda items: HeldCall(fetch_many(items), release)
    harness.add_request("waiting", hit, max_tokens=4)
    harness.step()  # submits its lookup (and sends its R3 fetch, held)
    assert kv_lookup_answer(harness.scheduler.connector.scheduler_adapter, "waiting") == 3 * CHUNK
    ran = harness.times_scheduled["running"]
    for _ in range(5):
        harness.step()
    assert harness.times_scheduled["running"] == ran + 5, "a step waited for the R3 read instead of running"
    assert "waiting" not in harness.times_scheduled, "admitted before its R3 answer came"
    release.set()
    harness.run_until_idle()
    assert harness.outputs["waiting"]["lmcache_r3_sources"]["lmcache_tokens"] == 3 * CHUNK
    assert book.counters.values["fetch_failures"] == 0
    np.testing.assert_array_equal(returned_rows(harness, "waiting"), expected_rows(harness, "waiting", hit, 4))


def test_rows_complete_although_request_finished_runs_before_the_last_steps_rows(r3_harness):
    """vLLM calls request_finished inside update_from_output, before update_connector_output brings that step's
    rows; the params dict returned then must still carry every row when the output leaves the engine."""
    harness = r3_harness()
    connector = harness.scheduler.connector
    events: list[tuple[str, frozenset]] = []
    finished, update = connector.request_finished, connector.update_connector_output

    def request_finished(request, block_ids):
        events.append(("request_finished", frozenset({request.request_id})))
        return finished(request, block_ids)

    def update_connector_output(output):
        rows = getattr(output.kv_connector_worker_meta, "rows", None)
        events.append(("rows", frozenset() if rows is None else frozenset({rows.shape[0]})))
        return update(output)

    connector.request_finished, connector.update_connector_output = request_finished, update_connector_output
    tokens = seeded_prompt(90, seed=6)
    harness.generate([("order", tokens)], max_tokens=3)
    finished_at = events.index(("request_finished", frozenset({"order"})))
    assert events[finished_at + 1] == ("rows", frozenset({1})), events[-4:]  # the last step's one decode row
    np.testing.assert_array_equal(returned_rows(harness, "order"), expected_rows(harness, "order", tokens, 3))


def test_a_request_aborted_mid_prefill_publishes_only_complete_chunks(r3_harness, r3_server):
    from vllm.v1.request import RequestStatus

    from lmcache_r3.artifacts import decode_run
    from lmcache_r3.mp.r3_client import R3Client

    harness = r3_harness(max_num_batched_tokens=48)
    connector = harness.scheduler.connector
    tokens = seeded_prompt(4 * CHUNK, seed=7)
    harness.add_request("aborted", tokens, max_tokens=4)
    while harness.scheduler.requests["aborted"].num_computed_tokens < 96:  # rows up to 96: one whole chunk
        harness.step()
    harness.scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    harness.run_until_idle()
    harness.settle_stores()
    assert "aborted" not in harness.outputs or ROUTED_EXPERTS_KEY not in (harness.outputs["aborted"] or {})
    with R3Client(r3_server.url, connector.scheduler_adapter.model_name, connector.r3_profile) as client:
        fetched = client.fetch(tokens).result()
    assert fetched.num_hit_chunks <= 1
    decoded = decode_run(fetched.objects, connector.r3_profile, 0, CHUNK)
    expected = harness.router.rows(tokens, 0, CHUNK).astype(np.uint8)
    for chunk in decoded.chunks:
        np.testing.assert_array_equal(chunk.rows, expected)


def test_r3_deleted_with_kv_kept_shrinks_the_hit_and_rows_stay_exact(own_r3_server, scheduler_harness_factory):
    from lmcache_r3.mp.r3_client import R3Client

    r3_server = own_r3_server
    harness = scheduler_harness_factory(server=r3_server, connector_module=CONNECTOR, routed_experts=True)
    connector = harness.scheduler.connector
    tokens = seeded_prompt(4 * CHUNK + 9, seed=8)
    harness.generate([("first", tokens)], max_tokens=3)
    harness.settle_stores()
    with R3Client(r3_server.url, connector.scheduler_adapter.model_name, connector.r3_profile) as client:
        assert client.delete(tokens, CHUNK, 4 * CHUNK).result().num_deleted == 3
    harness.reset_prefix_cache()
    harness.generate([("second", tokens)], max_tokens=3)
    assert harness.outputs["second"]["lmcache_r3_sources"]["lmcache_tokens"] == CHUNK
    np.testing.assert_array_equal(returned_rows(harness, "second"), returned_rows(harness, "first"))
    assert connector.routed.counters.values["joint_hits_shrunk"] >= 1
    # The KV lookup locked 4 chunks; the 3 past the joint hit were released at once, the first after its retrieve.
    assert wait_locks(r3_server, 0) == 0


def requests_recompute_while_the_server_is_down(harness, server, tokens: list[int]) -> np.ndarray:
    """Run ``tokens`` ("before"), stop ``server``, run them again ("down"): no LMCache hit, no hang (steps that wait
    on the dead server schedule nothing), the same rows. Returns those rows."""
    harness.generate([("before", tokens)], max_tokens=3)
    harness.reset_prefix_cache()
    server.stop()
    harness.add_request("down", tokens, max_tokens=3)
    harness.run_until_idle(max_steps=100_000, timeout_s=60)
    assert harness.outputs["down"]["lmcache_r3_sources"]["lmcache_tokens"] == 0
    rows = returned_rows(harness, "before")
    np.testing.assert_array_equal(returned_rows(harness, "down"), rows)
    return rows


def test_server_killed_mid_run_requests_recompute_with_exact_rows(scheduler_harness_factory, r3_server_factory):
    doomed = r3_server_factory()
    harness = scheduler_harness_factory(
        server=doomed, connector_module=CONNECTOR, routed_experts=True, mq_timeout_s=2.0,
        extra_config={"lmcache_r3.r3_timeout_s": 1.0},
    )  # fmt: skip
    requests_recompute_while_the_server_is_down(harness, doomed, seeded_prompt(3 * CHUNK + 5, seed=9))


def test_a_server_restarted_on_its_port_serves_joint_hits_again_with_exact_rows(
    scheduler_harness_factory, r3_server_factory
):
    """The LMCache server dies and a new one comes up on the same port (a supervisor's restart) under a running
    engine: while none answers, requests recompute with exact rows; once LMCache's heartbeat has registered the KV
    caches with the new server, KV and R3 are stored there and served again, with exact rows."""
    first = r3_server_factory()
    harness = scheduler_harness_factory(
        server=first, connector_module=CONNECTOR, routed_experts=True, mq_timeout_s=2.0,
        extra_config={"lmcache_r3.r3_timeout_s": 1.0, "lmcache.mp.heartbeat_interval": 0.5},
    )  # fmt: skip
    book = harness.scheduler.connector.routed
    book.retry_after_s = 1.0  # how long R3 calls pause after one timed out (10 s by default)
    tokens = seeded_prompt(3 * CHUNK + 5, seed=83)
    expected = requests_recompute_while_the_server_is_down(harness, first, tokens)
    np.testing.assert_array_equal(expected, expected_rows(harness, "before", tokens, 3))

    harness.server = r3_server_factory(port=first.settings.port)
    adapters = (harness.worker.worker_adapter, harness.scheduler.connector.scheduler_adapter)
    deadline = time.monotonic() + 30
    while not all(adapter.is_healthy for adapter in adapters):  # the worker's heartbeat re-registers its caches
        assert time.monotonic() < deadline, "LMCache's heartbeats never found the restarted server"
        time.sleep(0.1)
    harness.reset_prefix_cache()
    harness.generate([("restarted", tokens)], max_tokens=3)  # the new server is empty: computed, then stored
    assert harness.outputs["restarted"]["lmcache_r3_sources"]["lmcache_tokens"] == 0
    harness.reset_prefix_cache()
    harness.generate([("hit", tokens)], max_tokens=3)
    assert harness.outputs["hit"]["lmcache_r3_sources"]["lmcache_tokens"] == 3 * CHUNK
    for request_id in ("restarted", "hit"):
        np.testing.assert_array_equal(returned_rows(harness, request_id), expected)


def test_two_tp_ranks_worker_metadata_carries_rank_zeros_rows_once(r3_harness):
    """Every TP rank captures the same routing; only rank 0 sends it, and vLLM's aggregator keeps it."""
    from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from lmcache_r3.mp.r3_messages import R3WorkerMetadata

    rows, slots = np.arange(8, dtype=np.uint8).reshape(2, 2, 2), np.array([32, 33])
    rank0 = R3WorkerMetadata(completed_store_requests={"a": 1}, step=5, slots=slots, rows=rows)
    rank1 = LMCacheMPWorkerMetadata(completed_store_requests={"a": 1})

    def output(meta):
        return ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0},
                                 kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=meta))  # fmt: skip

    merged = KVOutputAggregator(expected_finished_count=2).aggregate([output(rank0), output(rank1)])
    meta = merged.kv_connector_output.kv_connector_worker_meta
    assert isinstance(meta, R3WorkerMetadata)
    assert meta.completed_store_requests == {"a": 2} and meta.step == 5
    np.testing.assert_array_equal(meta.rows, rows)
    np.testing.assert_array_equal(meta.slots, slots)
    for merged in (rank0.aggregate(R3WorkerMetadata(step=5)), R3WorkerMetadata(step=5).aggregate(rank0)):
        assert merged.step == 5 and merged.rows is rows and merged.slots is slots


def test_a_model_without_moe_layers_serves_kv_with_routed_experts_off(
    scheduler_harness_factory, r3_server, tiny_dense_config, caplog
):
    caplog.set_level("INFO", logger="lmcache_r3.mp")
    harness = scheduler_harness_factory(
        server=r3_server, model_dir=tiny_dense_config, connector_module=CONNECTOR, routed_experts=True
    )
    assert harness.scheduler.connector.r3_profile is None and harness.scheduler.connector.routed is None
    tokens = seeded_prompt(3 * CHUNK + 2, seed=10)
    harness.generate([("dense", tokens)], max_tokens=2)
    harness.reset_prefix_cache()
    harness.generate([("dense-again", tokens)], max_tokens=2)
    assert harness.scheduler.connector.counters.values["retrieves"] == 1  # the KV path is unchanged
    assert not (harness.outputs["dense-again"] or {}).get(ROUTED_EXPERTS_KEY)
    assert sum("no MoE layers" in r.getMessage() for r in caplog.records) == 1  # said once, by the scheduler role


def test_lazy_offload_with_routed_experts_is_refused_naming_both_ways_out(scheduler_harness_factory, r3_server):
    """LMCache's lazy offload stores KV after the request finished, where no R3 store follows: a start-up error, not
    a deployment whose every LMCache hit is dropped for lack of routed experts."""
    with pytest.raises(ValueError, match=r'lmcache\.mp\.lazy_offload.*"lmcache_r3\.routed_experts": false'):
        scheduler_harness_factory(
            server=r3_server, connector_module=CONNECTOR, routed_experts=True,
            extra_config={"lmcache.mp.lazy_offload": True},
        )  # fmt: skip
    harness = scheduler_harness_factory(
        server=r3_server, connector_module=CONNECTOR, routed_experts=False,
        extra_config={"lmcache.mp.lazy_offload": True},
    )  # fmt: skip
    assert harness.scheduler.connector.routed is None  # KV-only lazy offload is LMCache's, unchanged


@pytest.fixture
def separate_groups_r3_server(r3_server_factory):
    server = r3_server_factory(extra_args=("--separate-object-groups",))
    yield server
    server.stop()


@pytest.fixture
def sliding_r3_harness(separate_groups_r3_server, scheduler_harness_factory):
    """A full-attention + sliding-window model (window 64) against its own R3 server with
    ``--separate-object-groups``, which a windowed group needs to load from LMCache (the server is set up first, so
    the harnesses are shut down before it stops)."""

    def build(**overrides):
        return scheduler_harness_factory(
            server=separate_groups_r3_server, connector_module=CONNECTOR, routed_experts=True, kind="sliding",
            extra_config={"lmcache_r3.separate_object_groups": True}, **overrides,
        )  # fmt: skip

    return build


def test_a_sliding_window_model_returns_exact_rows_from_every_source_and_while_its_window_blocks_are_reused(
    sliding_r3_harness,
):
    """vLLM frees the window group's blocks as the window passes them and hands them to other requests; the rows
    are kept in the full-attention group's slots, so a cold run, an LMCache hit, vLLM's own hit and requests that
    preempt each other in a small pool all return the router's rows."""
    cold_then_lmcache_hit_then_prefix_cache_hit(sliding_r3_harness(), seed=1002)
    preempted_requests_return_exact_rows(sliding_r3_harness(num_blocks=20, max_num_batched_tokens=64))


def test_routed_experts_on_a_model_without_a_full_attention_group_are_refused_naming_the_way_out(
    scheduler_harness_factory, r3_server
):
    """The rows are kept in the slots of a group vLLM never frees mid-request; a model with only windowed groups has
    none, so routed experts are a start-up error there, and KV reuse alone still runs."""
    with pytest.raises(ValueError, match=r'full-attention.*SlidingWindowSpec.*"lmcache_r3\.routed_experts": false'):
        scheduler_harness_factory(server=r3_server, connector_module=CONNECTOR, routed_experts=True, kind="windowed")
    harness = scheduler_harness_factory(
        server=r3_server, connector_module=CONNECTOR, routed_experts=False, kind="windowed"
    )
    assert harness.scheduler.connector.routed is None


def test_a_step_without_capture_gives_an_error_never_rows(r3_harness, caplog):
    """What the worker reports when the routers did not capture (e.g. torch.compile on CPU): no row is guessed."""
    from lmcache_r3.mp.capture import CaptureError

    harness = r3_harness()

    def no_capture():
        raise CaptureError("a step ran tokens through the model but no MoE router reported its routing")

    harness.worker.r3_step_source = no_capture
    harness.generate([("blind", seeded_prompt(80, seed=12))], max_tokens=2)
    params = harness.outputs["blind"]
    assert ROUTED_EXPERTS_KEY not in params
    assert "incomplete" in params[ROUTED_EXPERTS_ERROR_KEY]
    assert any("no MoE router reported" in r.getMessage() for r in caplog.records)


def test_a_server_without_the_r3_module_recomputes_and_says_how_to_fix_it(
    scheduler_harness_factory, lmcache_server, caplog
):
    harness = scheduler_harness_factory(server=lmcache_server, connector_module=CONNECTOR, routed_experts=True)
    tokens = seeded_prompt(2 * CHUNK + 10, seed=13)
    harness.generate([("one", tokens)], max_tokens=2)
    harness.reset_prefix_cache()
    harness.generate([("two", tokens)], max_tokens=2)
    assert harness.outputs["two"]["lmcache_r3_sources"]["lmcache_tokens"] == 0  # KV alone is never a hit
    np.testing.assert_array_equal(returned_rows(harness, "two"), expected_rows(harness, "two", tokens, 2))
    assert any("lmcache-r3 server" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")


def cut_hit_beside_a_holder(server, scheduler_harness_factory, seed: int):
    """A prompt whose KV LMCache holds for 4 chunks and R3 for 1 (a joint hit of one chunk), all 4 also locked by
    another reader (``holder``, a plain LMCache lookup). Returns ``(harness, tokens)``.

    ``read_locked_count`` counts locked objects, not locks: the holder keeps all 4 locked throughout, so the count
    drops only when a lock of the holder's is taken away, or stays up when a lock of the test's request is left."""
    from lmcache_r3.mp.r3_client import R3Client

    harness = scheduler_harness_factory(server=server, connector_module=CONNECTOR, routed_experts=True)
    connector = harness.scheduler.connector
    adapter = connector.scheduler_adapter
    tokens = seeded_prompt(4 * CHUNK + 9, seed=seed)
    harness.generate([("first", tokens)], max_tokens=3)
    harness.settle_stores()
    with R3Client(server.url, adapter.model_name, connector.r3_profile) as client:
        assert client.delete(tokens, CHUNK, 4 * CHUNK).result().num_deleted == 3
    adapter.maybe_submit_lookup_request("holder", token_ids=tokens)
    kv_lookup_answer(adapter, "holder")
    assert wait_locks(server, 4) == 4
    return harness, tokens


def release_the_holder(harness, tokens) -> None:
    adapter = harness.scheduler.connector.scheduler_adapter
    adapter.free_lookup_locks(tokens, 0, 4 * CHUNK, "holder")
    adapter.cleanup_lookup_result("holder")


def test_lookup_locks_are_released_once_when_vllm_asks_again_and_at_an_abort_before_admission(
    own_r3_server, scheduler_harness_factory
):
    """vLLM asks ``get_num_new_matched_tokens`` again when it could not allocate a request, and aborts requests that
    still wait: the tail past the joint hit is released once, the rest when the request ends unadmitted. Another
    reader's locks on the same chunks are never touched."""
    from vllm.v1.request import RequestStatus

    server = own_r3_server
    harness, tokens = cut_hit_beside_a_holder(server, scheduler_harness_factory, seed=12)
    connector = harness.scheduler.connector
    request = harness.make_request("waiting", tokens)
    fetches = connector.routed.counters.values["fetches"]
    assert lookup(connector, request)[0] == CHUNK  # KV for 4 chunks, R3 for 1: the joint hit; 3 chunks released
    assert lookup(connector, request)[0] == CHUNK  # vLLM could not allocate it and asks again
    assert locks_stay(server, 4) == 4, "the tail was released twice: the holder lost its locks"
    assert connector.routed.counters.values["fetches"] == fetches + 1, "the R3 fetch was sent again at the re-ask"

    request.status = RequestStatus.FINISHED_ABORTED  # aborted while it waits: never admitted
    harness.finish_by_hand(request, [])
    assert connector.counters.values["locks_released_at_finish_chunks"] == 1  # the 3 past the joint hit were gone
    release_the_holder(harness, tokens)
    assert wait_locks(server, 0) == 0, "the aborted, never admitted request kept its lock on the first chunk"


def test_a_cut_hit_asked_again_after_the_local_hit_grew_past_it_releases_its_tail_only_once(
    own_r3_server, scheduler_harness_factory
):
    """vLLM asks again for a request it could not allocate; meanwhile vLLM's own cache may have come to cover the whole
    KV hit (a sibling computed the prompt). LMCache then reports its full locked hit again, and the admission must not
    release the tail past the joint hit a second time: that would strip another reader's locks (``holder``)."""
    from vllm.v1.request import RequestStatus

    from tests.connector.test_admission import AllocatedBlocks

    server = own_r3_server
    harness, tokens = cut_hit_beside_a_holder(server, scheduler_harness_factory, seed=14)
    connector = harness.scheduler.connector
    request = harness.make_request("waiting", tokens)
    assert lookup(connector, request)[0] == CHUNK  # KV for 4 chunks, R3 for 1: 3 chunks released
    assert lookup(connector, request, 4 * CHUNK) == (0, False)  # vLLM's own cache now covers the whole KV hit
    connector.update_state_after_alloc(request, AllocatedBlocks([list(range(1, 6))]), 0)
    assert locks_stay(server, 4) == 4, "the tail was released twice: the holder lost its locks"
    release_the_holder(harness, tokens)
    assert wait_locks(server, 0) == 0, "a lock of the admitted request was left behind"
    request.status = RequestStatus.FINISHED_ABORTED
    harness.finish_by_hand(request, [])
