"""Routed-experts scenarios on a real vLLM engine (CPU) with lmcache_r3's connector and a real LMCache server.

Run as a child process by ``tests/routed/test_engine_routed.py`` (vLLM's engine needs a ``__main__`` guard and
owns process-global state), with vLLM's engine core in its own process as in production. Every request's tokens,
rows, cached-token count and token sources go into an ``.npz`` + JSON result that the tests compare with HF
transformers' router.

    python -m tests.support.engine_r3 --model DIR --host H --port P --http-url URL --out DIR --scenario main
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from lmcache_r3 import RoutedExpertsUnavailable, routed_experts
from lmcache_r3.artifacts import R3Profile
from lmcache_r3.mp.server_process import wait_for_stores
from lmcache_r3.output import SOURCES_KEY

CHUNK = 64


def words(length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(4, 1000, size=length)]


class Recorder:
    def __init__(self, llm: Any, http_url: str) -> None:
        self.llm = llm
        self.http_url = http_url
        self.arrays: dict[str, np.ndarray] = {}
        self.facts: dict[str, Any] = {}

    def run(self, named_prompts: dict[str, list[int]], **sampling: Any) -> list[Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(**({"temperature": 0.0, "max_tokens": 8, "ignore_eos": True} | sampling))
        started = time.monotonic()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in named_prompts.values()], params,
                                    use_tqdm=False)  # fmt: skip
        for name, output in zip(named_prompts, outputs, strict=True):
            for completion in output.outputs:
                key = name if len(output.outputs) == 1 else f"{name}.{completion.index}"
                self.arrays[f"{key}.tokens"] = np.asarray(list(output.prompt_token_ids) + list(completion.token_ids))
                try:
                    self.arrays[f"{key}.rows"] = routed_experts(output, completion.index)
                except RoutedExpertsUnavailable as error:
                    self.facts[f"{key}.error"] = str(error)
            self.facts[f"{name}.cached"] = int(output.num_cached_tokens or 0)
            self.facts[f"{name}.sources"] = (output.kv_transfer_params or {}).get(SOURCES_KEY)
            self.facts[f"{name}.seconds"] = time.monotonic() - started
        return outputs

    def reset(self) -> None:
        """vLLM's prefix cache reset once the LMCache server took the stores, so the next hit comes from LMCache."""
        wait_for_stores(self.http_url)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")


def scenario_main(rec: Recorder, server_url: str, model: Path) -> None:
    """Cold, LMCache hit, vLLM hit, shared prefixes, R3 deleted with KV kept, n > 1, a stop string."""
    from lmcache_r3.mp.r3_client import R3Client

    base = words(200, seed=1)
    rec.run({"cold": base})
    rec.reset()
    rec.run({"warm": base})
    rec.run({"local": base})

    rec.reset()
    rec.run({f"shared{cut}": base[:cut] + words(45, seed=cut) for cut in (37, 129, 200)})

    other = words(256 + 20, seed=7)
    rec.run({"r3cut.cold": other})
    rec.reset()
    config = json.loads((model / "config.json").read_text())
    profile = R3Profile(config["num_hidden_layers"], config["num_experts_per_tok"], config["num_local_experts"])
    with R3Client(server_url, str(model), profile) as client:  # LMCache's model name is the model path
        rec.facts["r3cut.deleted"] = client.delete(other, 2 * CHUNK, 4 * CHUNK).result().num_deleted
    rec.run({"r3cut.warm": other})

    # No per-request seed: vLLM's CPU runner cannot seed a request under chunked prefill.
    rec.run({"parallel": words(90, seed=11)}, n=2, temperature=1.0)
    greedy = rec.run({"stop.ref": words(70, seed=12)}, max_tokens=6)
    stop_word = greedy[0].outputs[0].text.split()[2]
    rec.facts["stop.word"] = stop_word
    rec.run({"stop": words(70, seed=12)}, max_tokens=6, stop=[stop_word])
    rec.facts["r3_metrics"] = r3_metrics(rec.llm)


def r3_metrics(llm: Any) -> dict[str, float]:
    """lmcache_r3's counters as vLLM's Prometheus registry holds them in the front end (``vllm:lmcache_r3_*``)."""
    return {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:lmcache_r3_")}


def scenario_preempt(rec: Recorder, server_url: str, model: Path) -> None:
    """Four concurrent requests in a KV pool too small for them: vLLM preempts and resumes."""
    rec.run({f"p{i}": words(150, seed=20 + i) for i in range(4)}, max_tokens=120)
    metrics = {m.name: getattr(m, "value", None) for m in rec.llm.get_metrics()}
    rec.facts["preemptions"] = metrics.get("vllm:num_preemptions")


def scenario_server_killed(rec: Recorder, server_url: str, model: Path) -> None:
    """The LMCache server dies between two runs of a prompt: the second recomputes, with exact rows, no hang."""
    base = words(200, seed=30)
    rec.run({"alive": base})
    rec.reset()
    pid = int(os.environ["LMCACHE_R3_SERVER_PID"])
    os.kill(pid, 9)
    rec.facts["killed_pid"] = pid
    rec.run({"dead": base})


SCENARIOS = {"main": scenario_main, "preempt": scenario_preempt, "server_killed": scenario_server_killed}
ENGINE = {
    "main": {"max_num_batched_tokens": 64, "disable_log_stats": False},
    "preempt": {
        "max_num_batched_tokens": 64,
        "num_gpu_blocks_override": 16,
        "max_model_len": 320,
        "disable_log_stats": False,
    },
    "server_killed": {"max_num_batched_tokens": 64},
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--http-url", required=True, help="the LMCache server's HTTP endpoint (/status)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--mq-timeout", type=float, default=30.0)
    args = parser.parse_args()
    from lmcache_r3.demo.run import make_llm, stop_llm

    server_url = f"tcp://{args.host}:{args.port}"
    extra = {
        "lmcache.mp.host": f"tcp://{args.host}",
        "lmcache.mp.port": args.port,
        "lmcache.mp.mq_timeout": args.mq_timeout,
        "lmcache_r3.r3_timeout_s": 2.0,
    }
    transfer = {"kv_connector": "LMCacheMPConnector", "kv_connector_module_path": "lmcache_r3.mp.connector",
                "kv_role": "kv_both", "kv_connector_extra_config": extra}  # fmt: skip
    llm = make_llm(args.model, transfer, **ENGINE[args.scenario])
    rec = Recorder(llm, args.http_url)
    try:
        SCENARIOS[args.scenario](rec, server_url, args.model)
    finally:
        args.out.mkdir(parents=True, exist_ok=True)
        np.savez(args.out / "arrays.npz", **rec.arrays)
        (args.out / "facts.json").write_text(json.dumps(rec.facts, indent=1, default=str))
        stop_llm(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
