"""The main job, end to end on one machine: an LMCache MP server, vLLM (CPU) with the LMCache MP connector on a
tiny MoE model, and two requests with the same prompt and vLLM's own prefix cache reset between them.

The second request's prefix must come from LMCache (vLLM's cache was just emptied), and its greedy tokens must
equal the first request's. Run it with ``make demo`` or ``lmcache-r3 demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmcache_r3.demo.model import FIRST_WORD_ID, SHAPES, build_tiny_moe
from lmcache_r3.launch import TELEMETRY_OFF, exit_on_sigterm
from lmcache_r3.mp.server_process import LMCacheServer, loopback_settings, start_server

BLOCK_SIZE = 32
CHUNK_SIZE = 64
CONNECTOR_MODULES = {
    "lmcache_r3": "lmcache_r3.mp.connector",
    "stock": "lmcache.integration.vllm.lmcache_mp_connector",
}


@dataclass
class RequestResult:
    name: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: list[int]
    seconds: float


@dataclass
class DemoResult:
    first: RequestResult
    second: RequestResult
    lmcache_objects: int
    engine_start_s: float
    connector: str
    baseline_tokens: list[int] | None = None
    """Greedy tokens of the same prompt from an engine without any KV connector, when asked for."""

    @property
    def prefix_from_lmcache(self) -> bool:
        return self.first.cached_tokens == 0 and self.second.cached_tokens > 0

    @property
    def tokens_equal(self) -> bool:
        return self.first.output_tokens == self.second.output_tokens

    @property
    def matches_baseline(self) -> bool | None:
        return None if self.baseline_tokens is None else self.baseline_tokens == self.first.output_tokens

    @property
    def ok(self) -> bool:
        return self.prefix_from_lmcache and self.tokens_equal and self.matches_baseline is not False


def demo_prompt(num_tokens: int) -> list[int]:
    """A deterministic prompt of word tokens (no special ids)."""
    return [FIRST_WORD_ID + (17 * i + 5) % 1000 for i in range(num_tokens)]


def make_llm(model_dir: Path, kv_transfer_config: dict | None, **overrides: Any):
    """vLLM on CPU for the tiny model: fp32, eager (routed-experts capture needs it on CPU), prefix caching on."""
    from vllm import LLM

    settings: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "float32",
        "max_model_len": 1024,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 512,
        "enable_prefix_caching": True,
        "enforce_eager": True,
        "seed": 0,
        "kv_transfer_config": kv_transfer_config,
    }
    return LLM(**(settings | overrides))


def greedy_tokens_without_connector(model_dir: Path, prompt_tokens: int, max_tokens: int) -> list[int]:
    """The reference: the same prompt on an engine with no KV connector at all."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(model_dir, None)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=demo_prompt(prompt_tokens))], greedy, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)
    finally:
        llm.llm_engine.engine_core.shutdown()


def run_demo(
    server: LMCacheServer,
    model_dir: Path,
    connector: str = "lmcache_r3",
    prompt_tokens: int = 200,
    max_tokens: int = 16,
) -> DemoResult:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.monotonic()
    llm = make_llm(
        model_dir,
        {
            "kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": CONNECTOR_MODULES[connector],
            "kv_role": "kv_both",
            "kv_connector_extra_config": server.connector_extra_config(),
        },
    )
    engine_start_s = time.monotonic() - started
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=demo_prompt(prompt_tokens))

    def generate(name: str) -> RequestResult:
        t0 = time.monotonic()
        out = llm.generate([prompt], greedy, use_tqdm=False)[0]
        return RequestResult(
            name=name,
            prompt_tokens=len(out.prompt_token_ids),
            cached_tokens=int(out.num_cached_tokens or 0),
            output_tokens=list(out.outputs[0].token_ids),
            seconds=time.monotonic() - t0,
        )

    try:
        first = generate("first")
        # vLLM's prefix cache is emptied, so any cached token of the second request came from LMCache.
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (a request is still running)")
        objects = _wait_for_objects(server, expected=prompt_tokens // CHUNK_SIZE)
        second = generate("second (vLLM prefix cache reset)")
    finally:
        # Stop the engine while the server still answers, so the connector unregisters cleanly.
        llm.llm_engine.engine_core.shutdown()
    return DemoResult(
        first=first, second=second, lmcache_objects=objects, engine_start_s=engine_start_s, connector=connector
    )


def _wait_for_objects(server: LMCacheServer, expected: int, timeout_s: float = 30.0) -> int:
    """LMCache commits stores asynchronously; wait until the first request's chunks are visible."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = server.l1_counts()["total_object_count"]
        if count >= expected or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


def print_report(result: DemoResult) -> None:
    for req in (result.first, result.second):
        print(
            f"  {req.name:<34} prompt {req.prompt_tokens} tokens, cached {req.cached_tokens:>3}, "
            f"{req.seconds:.2f} s, tokens {req.output_tokens}"
        )
    print(f"  LMCache server holds {result.lmcache_objects} KV objects (chunk size {CHUNK_SIZE})")
    verdict = "yes" if result.prefix_from_lmcache else "NO"
    print(f"  second request's prefix served by LMCache: {verdict} ({result.second.cached_tokens} tokens)")
    print(f"  greedy tokens identical: {'yes' if result.tokens_equal else 'NO'}")
    if result.baseline_tokens is not None:
        same = "yes" if result.matches_baseline else "NO"
        print(f"  identical to an engine without any KV connector: {same}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-r3 demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None, help="logs go here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result as JSON here")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small", help="which tiny MoE model to run")
    parser.add_argument("--model-cache", type=Path, default=None, help="where tiny models are built and kept")
    parser.add_argument("--connector", choices=sorted(CONNECTOR_MODULES), default="lmcache_r3")
    parser.add_argument(
        "--compare-without-connector",
        action="store_true",
        help="also run the prompt on an engine without any connector",
    )
    args = parser.parse_args(argv)

    exit_on_sigterm()
    for key, value in TELEMETRY_OFF.items():
        os.environ[key] = value
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lmcache_r3-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)

    shape = SHAPES[args.shape]
    print(
        f"[1/3] tiny MoE model {shape.name}: {shape.num_layers} layers, {shape.num_experts} experts, top-{shape.top_k}"
    )
    model_dir = build_tiny_moe(shape, args.model_cache)
    print(f"      {model_dir}")
    settings = loopback_settings(chunk_size=CHUNK_SIZE)
    print(f"[2/3] LMCache MP server on {settings.host}:{settings.port} (log {workdir / 'lmcache-server.log'})")
    server = start_server(settings, workdir / "lmcache-server.log")
    try:
        print(f"      ready, pid {server.pid}")
        print(
            f"[3/3] vLLM (CPU) with the {args.connector} LMCache MP connector: one prompt twice, "
            "vLLM's prefix cache reset between"
        )
        result = run_demo(server, model_dir, connector=args.connector)
    finally:
        server.stop()
    if args.compare_without_connector:
        result.baseline_tokens = greedy_tokens_without_connector(model_dir, result.first.prompt_tokens, 16)
    print(f"      engine started in {result.engine_start_s:.1f} s")
    print_report(result)
    if args.json:
        payload = asdict(result) | {
            "prefix_from_lmcache": result.prefix_from_lmcache,
            "tokens_equal": result.tokens_equal,
            "matches_baseline": result.matches_baseline,
            "ok": result.ok,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    print("DEMO OK" if result.ok else "DEMO FAILED")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
