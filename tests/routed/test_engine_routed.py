"""Routed experts from a real vLLM engine (CPU, fp32, tiny Qwen3-MoE) through lmcache_r3's connector and a real
LMCache server, compared with HF transformers' router on the same tokens.

Row order: row ``i`` is token ``i`` (prompt, then output tokens); within a row, layer by decoder layer index, and
each layer's experts in the router's top-k order (descending routing weight), which is ``torch.topk``'s order in
HF transformers; the comparison is exact, order included.

Each scenario runs once per module in a child process (``tests/support/engine_r3.py``): the engine spawns
processes of its own and needs a ``__main__`` guard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.harness import wait_sessions

pytestmark = pytest.mark.engine

CHUNK = 64


def run_scenario(name: str, model: Path, server, out: Path, *extra: str) -> tuple[dict, dict]:
    env = dict(os.environ, LMCACHE_R3_SERVER_PID=str(server.pid))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.engine_r3", "--model", str(model), "--host", server.settings.host,
         "--port", str(server.settings.port), "--http-url", server.http_url, "--out", str(out), "--scenario", name,
         *extra],
        capture_output=True, text=True, timeout=540, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, f"scenario {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    arrays = np.load(out / "arrays.npz")
    facts = json.loads((out / "facts.json").read_text())
    facts["engine_log"] = proc.stdout + proc.stderr
    return {key: arrays[key] for key in arrays.files}, facts


@pytest.fixture(scope="module")
def main_run(tiny_moe, r3_server, tmp_path_factory):
    """The main scenario's arrays and facts; ``facts["sessions_left"]``: server sessions it opened and left."""
    sessions_before = r3_server.status()["active_sessions"]
    arrays, facts = run_scenario("main", tiny_moe, r3_server, tmp_path_factory.mktemp("engine-main"))
    facts["sessions_left"] = wait_sessions(r3_server, sessions_before) - sessions_before
    return arrays, facts


def assert_rows_match_hf(arrays, hf_router, key):
    rows, tokens = arrays[f"{key}.rows"], arrays[f"{key}.tokens"]
    assert rows.dtype == np.uint8 and rows.shape == (len(tokens) - 1, 2, 2)
    np.testing.assert_array_equal(rows, hf_router(tokens), err_msg=f"{key}: rows differ from HF's router")


def test_cold_request_rows_equal_hf_router_for_prompt_and_output_tokens(main_run, hf_router):
    arrays, facts = main_run
    assert facts["cold.sources"] == {"vllm_cached_tokens": 0, "lmcache_tokens": 0, "computed_tokens": 207}
    assert_rows_match_hf(arrays, hf_router, "cold")


def test_lmcache_hit_after_prefix_cache_reset_returns_the_cold_rows_and_tokens(main_run):
    arrays, facts = main_run
    assert facts["warm.sources"]["lmcache_tokens"] == 192 and facts["warm.cached"] == 192
    np.testing.assert_array_equal(arrays["warm.tokens"], arrays["cold.tokens"])
    np.testing.assert_array_equal(arrays["warm.rows"], arrays["cold.rows"])


def test_vllm_prefix_cache_hit_returns_the_cold_rows(main_run):
    arrays, facts = main_run
    assert facts["local.sources"]["vllm_cached_tokens"] == 192
    np.testing.assert_array_equal(arrays["local.rows"], arrays["cold.rows"])


@pytest.mark.parametrize("cut", [37, 129, 200])
def test_concurrent_requests_sharing_unaligned_prefixes(main_run, hf_router, cut):
    arrays, facts = main_run
    assert_rows_match_hf(arrays, hf_router, f"shared{cut}")
    if cut > CHUNK:  # the shared prefix came back from LMCache or the sibling's fresh blocks
        sources = facts[f"shared{cut}.sources"]
        assert sources["lmcache_tokens"] + sources["vllm_cached_tokens"] >= cut - cut % CHUNK - CHUNK


def test_r3_removed_while_kv_stays_shrinks_the_joint_hit_and_rows_stay_exact(main_run, hf_router):
    arrays, facts = main_run
    assert facts["r3cut.deleted"] == 2
    # KV for 4 chunks is in LMCache, R3 for the first 2 only: the hit is the joint one.
    assert facts["r3cut.warm.sources"]["lmcache_tokens"] == 2 * CHUNK
    np.testing.assert_array_equal(arrays["r3cut.warm.rows"], arrays["r3cut.cold.rows"])
    assert_rows_match_hf(arrays, hf_router, "r3cut.warm")


def test_parallel_sampling_returns_each_completions_own_rows(main_run, hf_router):
    arrays, _ = main_run
    assert_rows_match_hf(arrays, hf_router, "parallel.0")
    assert_rows_match_hf(arrays, hf_router, "parallel.1")


def test_a_stop_string_gives_a_clear_error_instead_of_rows(main_run):
    _, facts = main_run
    assert "stop.rows" not in facts
    message = facts["stop.error"]
    assert f"stop string '{facts['stop.word']}'" in message and "stop_token_ids" in message


def test_the_engines_finished_requests_leave_no_session_on_the_server(main_run):
    """In a real engine every finished request (an aborted stop-string one among them) reaches the deferred end of
    its LMCache session: the worker reports each one's stores finished. (The late store that recreated a session
    ended too early is rarer in the engine; tests/connector/test_sessions.py pins it on the harness.)"""
    _, facts = main_run
    assert facts["sessions_left"] == 0


def test_preempted_requests_return_exact_rows(tiny_moe, r3_server, hf_router, tmp_path):
    arrays, facts = run_scenario("preempt", tiny_moe, r3_server, tmp_path)
    assert facts["preemptions"] and facts["preemptions"] > 0, "the KV pool was meant to force preemption"
    for i in range(4):
        assert_rows_match_hf(arrays, hf_router, f"p{i}")


def test_lmcache_server_killed_mid_run_requests_recompute_with_exact_rows(
    tiny_moe, r3_server_factory, hf_router, tmp_path
):
    """Also: the engine stops without vLLM killing its worker, although LMCache would wait ``mq_timeout`` (10 s
    here) for the dead server to answer the worker's unregister (lmcache_r3/mp/shutdown_bound.py). vLLM's executor
    sends SIGTERM to a worker still running 5 s after it was told to stop, SIGKILL 4 s later; on a loaded machine
    the worker's own teardown can take past the first, so only the second is checked."""
    doomed = r3_server_factory()
    arrays, facts = run_scenario("server_killed", tiny_moe, doomed, tmp_path, "--mq-timeout", "10")
    assert facts["killed_pid"] == doomed.pid and not doomed.process.alive()
    stop_lines = "\n".join(line for line in facts["engine_log"].splitlines() if "shutdown" in line)
    assert "sending SIGKILL" not in stop_lines, f"vLLM had to kill its worker:\n{stop_lines}"
    assert facts["dead.sources"] == {"vllm_cached_tokens": 0, "lmcache_tokens": 0, "computed_tokens": 207}
    np.testing.assert_array_equal(arrays["dead.rows"], arrays["alive.rows"])
    assert_rows_match_hf(arrays, hf_router, "dead")


def test_vllms_own_metrics_count_the_routing_each_source_served(main_run):
    """vLLM's Prometheus registry in the front end (``LLM.get_metrics``) holds lmcache_r3's counters, shipped from
    the engine core with the scheduler's stats: they agree with what the requests themselves returned."""
    arrays, facts = main_run
    metrics = facts["r3_metrics"]
    returned = [key for key in arrays if key.endswith(".rows")]
    assert metrics["vllm:lmcache_r3_requests_completed"] == len(returned)
    served = sum(sources["lmcache_tokens"] for key, sources in facts.items() if key.endswith(".sources") and sources)
    assert served > 0 and metrics["vllm:lmcache_r3_rows_from_lmcache"] == served
    assert metrics["vllm:lmcache_r3_joint_hits_shrunk"] == 1, "the hit cut where R3 was deleted and its KV kept"
    assert metrics["vllm:lmcache_r3_rows_computed"] > 0 and metrics["vllm:lmcache_r3_chunks_published"] > 0
    for never in ("fetch_failures", "store_failures", "requests_incomplete"):
        assert metrics[f"vllm:lmcache_r3_{never}"] == 0, never
