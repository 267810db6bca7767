"""The main job, end to end on one machine: RL-style rollouts of a tiny MoE with KV reuse and routed experts.

``lmcache-r3 server`` starts the LMCache MP server from an ``LMCACHE_CONFIG_FILE`` (``demo/demo.yaml`` with free
ports and lmcache_r3's shm tier below L1); vLLM (CPU) serves a tiny Qwen3-MoE with lmcache_r3's
``LMCacheMPConnector``, configured from the same file. A batch of multi-turn conversations shares a system prompt;
each turn extends the previous turn's prompt and answer, and vLLM's prefix cache is reset between turns, so the
shared prefixes come back from LMCache. Every request's routed experts are then checked against a cold run of the
same tokens, after the reset an RL trainer makes after a weight update (``reset_prefix_cache(reset_connector=True)``:
vLLM's prefix cache, LMCache's L1 and the tier). Run it with ``make demo`` or ``lmcache-r3 demo``; it exits
non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmcache_r3.demo.model import FIRST_WORD_ID, SHAPES, build_tiny_moe
from lmcache_r3.launch import TELEMETRY_OFF, exit_on_sigterm, free_port
from lmcache_r3.mp.server_process import LMCacheServer, start_written_config_server
from lmcache_r3.output import SOURCES_KEY, RoutedExpertsUnavailable, routed_experts

BLOCK_SIZE = 32
SHM_BYTES = 256 << 20
"""Capacity of the demo's shm tier."""
EXAMPLE_CONFIG = Path(__file__).with_name("demo.yaml")
DEMO_CONFIG_NAME = "lmcache_r3.yaml"
"""The demo's config file in its work folder: the example with free ports."""
CONNECTOR = {
    "kv_connector": "LMCacheMPConnector",
    "kv_connector_module_path": "lmcache_r3.mp.connector",
    "kv_role": "kv_both",
}


@dataclass
class RequestResult:
    name: str
    prompt_tokens: int
    output_tokens: list[int]
    vllm_cached_tokens: int
    lmcache_tokens: int
    computed_tokens: int
    r3_shape: tuple[int, ...] | None
    r3_equals_cold: bool | None = None
    tokens_equal_cold: bool | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.r3_equals_cold) and bool(self.tokens_equal_cold)


@dataclass
class DemoResult:
    requests: list[RequestResult]
    engine_start_s: float
    seconds: float
    baseline_tokens_equal: bool | None = None
    problems: list[str] = field(default_factory=list)
    tier_counters: dict[str, int] = field(default_factory=dict)
    """The shm tier's counters at the end (``stored_objects``, ``cleared_objects``, ...)."""

    @property
    def lmcache_tokens(self) -> int:
        return sum(r.lmcache_tokens for r in self.requests)

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.ok for r in self.requests) and self.baseline_tokens_equal is not False


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


ENGINE_STOP_S = 30.0
"""How long an engine's processes get to exit before vLLM kills them. vLLM's default grace (5 s) is about what the CPU
engine's own teardown takes on 2 cores (4.6 s seen); a killed engine core leaves its shared-memory message queues
(about 400 MB) in /dev/shm."""


def stop_llm(llm: Any) -> None:
    """Stop an engine :func:`make_llm` started, its processes given :data:`ENGINE_STOP_S` to exit on their own."""
    llm.llm_engine.engine_core.shutdown(timeout=ENGINE_STOP_S)


def words(length: int, seed: int) -> list[int]:
    """Deterministic word tokens (no special ids)."""
    return [FIRST_WORD_ID + int(t) for t in np.random.default_rng(seed).integers(0, 1000, size=length)]


def write_demo_config(workdir: Path, shm_root: Path | None = None) -> Path:
    """``demo.yaml`` with two free loopback ports, in ``workdir``; with ``shm_root``, lmcache_r3's shm tier there
    below L1."""
    text = EXAMPLE_CONFIG.read_text()
    text = text.replace("port: 5555", f"port: {free_port()}").replace("http_port: 8080", f"http_port: {free_port()}")
    if shm_root is not None:
        text += f"\ntiers:\n  - type: shm\n    root: {json.dumps(str(shm_root))}\n    capacity_bytes: {SHM_BYTES}\n"
    path = workdir / DEMO_CONFIG_NAME
    path.write_text(text)
    return path


def demo_shm_root() -> Path:
    """A new directory (mode 0700) for the demo's shm tier: under /dev/shm where there is one."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="lmcache_r3-demo-shm-", dir=shm if shm.is_dir() else None))


class Rollouts:
    """The engine and the bookkeeping of one demo run."""

    def __init__(self, llm: Any, server: LMCacheServer, max_tokens: int) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.server = server
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def generate(self, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], Any, dict, np.ndarray | str]]:
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts.values()], self.params,
                                    use_tqdm=False)  # fmt: skip
        results = {}
        for name, output in zip(prompts, outputs, strict=True):
            try:
                rows: np.ndarray | str = routed_experts(output)
            except RoutedExpertsUnavailable as error:
                rows = str(error)
            sources = (output.kv_transfer_params or {}).get(SOURCES_KEY) or {}
            results[name] = (list(output.outputs[0].token_ids), output, sources, rows)
        return results

    def reset_caches(self, lmcache_too: bool) -> int:
        """Reset vLLM's prefix cache after LMCache's stores settled; with ``lmcache_too`` as after a weight update
        (``reset_prefix_cache(reset_connector=True)``: LMCache's L1 and lmcache_r3's tiers too). Returns the objects
        LMCache's L1 still holds (0 unless ``lmcache_too``)."""
        self.server.wait_for_stores()
        if not self.llm.reset_prefix_cache(reset_connector=lmcache_too):
            raise RuntimeError("the cache reset failed: a request is still running, or an LMCache tier could not be "
                               "cleared (the engine's log says which)")  # fmt: skip
        return self._clear_lmcache() if lmcache_too else 0

    def _clear_lmcache(self, timeout_s: float = 10.0) -> int:
        """Empty LMCache's L1; returns the objects left. A clear keeps locked objects (a lookup's read locks are
        released a moment after its request ends, a store's write locks once it commits), so it waits for the locks
        to go, and clears again while objects are left. Whatever stays is reported by the cold run that could be
        served from it."""
        deadline = time.monotonic() + timeout_s
        while True:
            counts = self.server.l1_counts()
            if not counts["read_locked_count"] and not counts["write_locked_count"]:
                self.server.clear_l1()
                counts = self.server.l1_counts()
            if not counts["total_object_count"] or time.monotonic() > deadline:
                return counts["total_object_count"]
            time.sleep(0.05)


def run_rollouts(llm: Any, server: LMCacheServer, conversations: int, turns: int, max_tokens: int) -> DemoResult:
    rollouts = Rollouts(llm, server, max_tokens)
    system = words(96, seed=0)
    history = {f"conv{c}": system + words(24 + 7 * c, seed=100 + c) for c in range(conversations)}
    requests: list[RequestResult] = []
    prompts_of: dict[str, list[int]] = {}
    rows_of: dict[str, np.ndarray] = {}
    problems: list[str] = []
    started = time.monotonic()
    for turn in range(1, turns + 1):
        batch = {f"{conv}/turn{turn}": tokens for conv, tokens in history.items()}
        for name, (tokens, _, sources, rows) in rollouts.generate(batch).items():
            conv = name.split("/")[0]
            prompts_of[name] = batch[name]
            requests.append(RequestResult(
                name=name, prompt_tokens=len(batch[name]), output_tokens=tokens,
                vllm_cached_tokens=sources.get("vllm_cached_tokens", 0),
                lmcache_tokens=sources.get("lmcache_tokens", 0), computed_tokens=sources.get("computed_tokens", 0),
                r3_shape=tuple(rows.shape) if isinstance(rows, np.ndarray) else None,
                error=None if isinstance(rows, np.ndarray) else rows,
            ))  # fmt: skip
            if isinstance(rows, np.ndarray):
                rows_of[name] = rows
            problems += accounting_problems(name, len(batch[name]) + len(tokens), sources, rows)
            # The next turn: this turn's prompt and answer, then the user's next message.
            history[conv] = batch[name] + tokens + words(16, seed=1000 * turn + len(history[conv]))
        rollouts.reset_caches(lmcache_too=False)  # the next turn's shared prefixes must come from LMCache
    # The reference: every request again, cold (vLLM's prefix cache, LMCache's L1 and its tier emptied before each).
    for result in requests:
        left = rollouts.reset_caches(lmcache_too=True)
        tokens, _, sources, rows = rollouts.generate({result.name: prompts_of[result.name]})[result.name]
        result.tokens_equal_cold = tokens == result.output_tokens
        result.r3_equals_cold = (
            isinstance(rows, np.ndarray) and result.name in rows_of and np.array_equal(rows, rows_of[result.name])
        )
        name, num_tokens = f"{result.name} (cold)", len(prompts_of[result.name]) + len(tokens)
        problems += cold_problems(name, sources, left) + accounting_problems(name, num_tokens, sources, rows)
    demo = DemoResult(requests=requests, engine_start_s=0.0, seconds=time.monotonic() - started, problems=problems)
    if demo.lmcache_tokens == 0:
        demo.problems.append("no request was served from LMCache: the demo did not exercise KV + R3 reuse")
    return demo


def accounting_problems(name: str, num_tokens: int, sources: dict, rows: np.ndarray | str) -> list[str]:
    """A request's rows must cover every token but the last, and its sources must add up to them."""
    problems = []
    if isinstance(rows, np.ndarray) and rows.shape[0] != num_tokens - 1:
        problems.append(f"{name}: {rows.shape[0]} rows of routed experts for {num_tokens} tokens (expected tokens - 1)")
    counted = sum(int(sources.get(key, 0)) for key in ("vllm_cached_tokens", "lmcache_tokens", "computed_tokens"))
    if counted != num_tokens - 1:
        problems.append(f"{name}: its sources count {counted} tokens, expected {num_tokens - 1} (tokens - 1)")
    return problems


def cold_problems(name: str, sources: dict, objects_left: int) -> list[str]:
    """Why a reference run is not a cold computation of every token (then comparing with it proves nothing)."""
    served = {key: int(sources.get(key, 0)) for key in ("lmcache_tokens", "vllm_cached_tokens")}
    if not any(served.values()):
        return []
    why = f" (LMCache held {objects_left} locked objects after its L1 was cleared)" if objects_left else ""
    return [f"{name}: served {served['lmcache_tokens']} tokens from LMCache and {served['vllm_cached_tokens']} from "
            f"vLLM's cache{why}; a reference must compute every token"]  # fmt: skip


def print_report(result: DemoResult) -> None:
    print(f"  {'request':<14} {'prompt':>6} {'vLLM cache':>10} {'LMCache':>8} {'computed':>9}  {'R3 shape':<15} "
          f"{'R3 = cold':<9} {'tokens = cold'}")  # fmt: skip
    for r in result.requests:
        shape = "x".join(map(str, r.r3_shape)) if r.r3_shape else "-"
        print(f"  {r.name:<14} {r.prompt_tokens:>6} {r.vllm_cached_tokens:>10} {r.lmcache_tokens:>8} "
              f"{r.computed_tokens:>9}  {shape:<15} {_yes(r.r3_equals_cold):<9} "
              f"{_yes(r.tokens_equal_cold)}")  # fmt: skip
        if r.error:
            print(f"    error: {r.error}")
    print(f"  tokens served by LMCache (KV + routed experts): {result.lmcache_tokens}")
    if result.baseline_tokens_equal is not None:
        print(f"  cold tokens identical to an engine without any KV connector: {_yes(result.baseline_tokens_equal)}")
    for problem in result.problems:
        print(f"  PROBLEM: {problem}")


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def baseline_tokens_equal(model_dir: Path, result: DemoResult, max_tokens: int) -> bool:
    """The first turn's prompts on an engine with no KV connector give the same greedy tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    first_turn = [r for r in result.requests if r.name.endswith("/turn1")]
    llm = make_llm(model_dir, None)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        # The prompts are rebuilt the same way run_rollouts builds turn 1.
        system = words(96, seed=0)
        prompts = [system + words(24 + 7 * c, seed=100 + c) for c in range(len(first_turn))]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return all(list(o.outputs[0].token_ids) == r.output_tokens for o, r in zip(outputs, first_turn, strict=True))
    finally:
        stop_llm(llm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-r3 demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None, help="config and logs go here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result as JSON here")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small", help="which tiny MoE model to run")
    parser.add_argument("--model-cache", type=Path, default=None, help="where tiny models are built and kept")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--compare-without-connector", action="store_true",
                        help="also run turn 1 on an engine without any connector")  # fmt: skip
    args = parser.parse_args(argv)

    exit_on_sigterm()
    os.environ.update(TELEMETRY_OFF)
    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_LOGGING_LEVEL", "ERROR"),
                       ("LMCACHE_LOG_LEVEL", "ERROR"), ("LMCACHE_DISABLE_BANNER", "1")):  # fmt: skip
        os.environ.setdefault(key, value)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lmcache_r3-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)

    shape = SHAPES[args.shape]
    print(f"[1/4] tiny MoE model {shape.name}: {shape.num_layers} layers, {shape.num_experts} experts, "
          f"top-{shape.top_k}")  # fmt: skip
    model_dir = build_tiny_moe(shape, args.model_cache)
    print(f"[2/4] lmcache-r3 server --config {workdir / DEMO_CONFIG_NAME} (log {workdir / 'lmcache-server.log'})")
    shm_root = demo_shm_root()
    try:
        config_file, server = start_written_config_server(
            lambda: write_demo_config(workdir, shm_root), workdir / "lmcache-server.log"
        )
    except BaseException:
        shutil.rmtree(shm_root, ignore_errors=True)
        raise
    os.environ["LMCACHE_CONFIG_FILE"] = str(config_file)
    try:
        print(f"      ready, pid {server.pid}, {server.url}; L2: lmcache_r3's shm tier at {shm_root}")
        print("[3/4] vLLM (CPU) with lmcache_r3's LMCacheMPConnector (configured from LMCACHE_CONFIG_FILE)")
        started = time.monotonic()
        llm = make_llm(model_dir, CONNECTOR)
        engine_start_s = time.monotonic() - started
        print(f"      engine started in {engine_start_s:.1f} s")
        print(f"[4/4] {args.conversations} conversations x {args.turns} turns, vLLM's prefix cache reset between "
              "turns; then each request again, cold")  # fmt: skip
        try:
            result = run_rollouts(llm, server, args.conversations, args.turns, args.max_tokens)
        finally:
            stop_llm(llm)  # while the server still answers
        result.engine_start_s = engine_start_s
        (tier,) = server.status()["storage_manager"]["l2_adapters"]
        result.tier_counters = tier["counters"]
    finally:
        server.process.stop()
        shutil.rmtree(shm_root, ignore_errors=True)
    if args.compare_without_connector:
        result.baseline_tokens_equal = baseline_tokens_equal(model_dir, result, args.max_tokens)
    print_report(result)
    if args.json:
        payload = asdict(result) | {"ok": result.ok, "lmcache_tokens": result.lmcache_tokens}
        args.json.write_text(json.dumps(payload, indent=2))
    print("DEMO OK" if result.ok else "DEMO FAILED")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
