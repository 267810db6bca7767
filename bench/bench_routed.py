"""What returning routed experts costs, measured in the same run against the same connector with R3 off.

1. **End to end (vLLM on CPU)**: the demo's multi-turn rollout workload (per model of ``--models``: the demo's
   tiny Qwen3-MoE, whose steps are mostly vLLM's own per-step work, and a bigger one; LMCache MP server from
   a config, vLLM's prefix cache reset between turns) on two engines that differ only in
   ``"lmcache_r3.routed_experts"``: on (capture, joint KV+R3 hits, R3 stored with the KV, rows in every output)
   and off (the same connector, KV only). LMCache's L1 is cleared before every round. Ratio: on / off wall time.
2. **Scheduler bookkeeping (harness, no model)**: the real vLLM scheduler and both connector roles with many
   concurrent requests; the time spent in the scheduler-side R3 bookkeeping per step, as a fraction of the
   scheduler's step (schedule + update_from_output) with R3 on.

    python bench/bench_routed.py [--rounds 3] [--concurrent 256] [--models small,medium] [--conversations 4]
        [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchdocs import write_section

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Routed experts end to end"
PROBE = ROOT / "bench" / "probe"
"""Timers inside the engine processes (``probe/sitecustomize.py``), on their ``PYTHONPATH``."""
TIMERS = (
    ("engine_core.step", "engine core step (schedule + model + update)"),
    ("scheduler.schedule", "scheduler: `schedule`"),
    ("scheduler.update_from_output", "scheduler: `update_from_output`"),
    ("connector.get_num_new_matched_tokens", "scheduler: connector `get_num_new_matched_tokens` (a lookup's ask)"),
    ("routed.begin_lookup", "scheduler: of which R3 `begin_lookup`"),
    ("routed.joint_hit_end", "scheduler: of which R3 `joint_hit_end`"),
    ("connector.update_state_after_alloc", "scheduler: connector `update_state_after_alloc`"),
    ("connector.build_connector_meta", "scheduler: connector `build_connector_meta` (inside `schedule`)"),
    ("routed.on_schedule", "scheduler: of which R3 `on_schedule`"),
    ("connector.update_connector_output", "scheduler: connector `update_connector_output`"),
    ("routed.on_worker_output", "scheduler: of which R3 `on_worker_output`"),
    ("connector.request_finished", "scheduler: connector `request_finished`"),
    ("worker.execute_model", "worker: `execute_model`"),
    ("worker.model_forward", "worker: the model's forward pass (inside `execute_model`)"),
    ("capturer.capture", "worker: one router's capture call (inside the forward pass; one per MoE layer a step)"),
    ("connector.start_load_kv", "worker: connector `start_load_kv` (inside `execute_model`)"),
    ("kv.submit_retrieve", "worker: of which one KV chunk loaded (synchronous on CPU: LMCache server round trips)"),
    ("connector.wait_for_save", "worker: connector `wait_for_save`, R3 rows collected in it"),
    ("kv.submit_store", "worker: of which one KV chunk stored (synchronous on CPU: LMCache server round trips)"),
    ("connector._collect_routed_experts", "worker: of which collecting the step's R3 rows"),
    ("connector.build_connector_worker_meta", "worker: connector `build_connector_worker_meta`"),
)
ROLES = ("front end", "engine core", "worker", "LMCache server")
"""The processes whose CPU time a round adds up, by role (the engines' processes by vLLM's process titles)."""
NUM_CPUS = os.cpu_count() or 1
WORKER_CORES = "nobind" if NUM_CPUS < 2 else (f"1-{NUM_CPUS - 1}" if NUM_CPUS > 2 else "1")
"""The vLLM workers run on cores 1.., the engine cores, the front end and the LMCache server on core 0 (vLLM's CPU
backend otherwise spreads the model's threads over every core, and on a 2-core host the serving processes then
preempt them at random: rounds vary 2x)."""


def engine_rounds(rounds: int, workdir: Path, shape: str, conversations: int) -> dict:
    """Wall and CPU seconds of each round of the demo workload with routed experts off and on, and step timers.

    Two sessions of ``rounds // 2`` rounds each (at least one): the first starts the R3-off engine first, the second
    the R3-on engine first. The engine started second runs measurably slower here (its worker's steps take about
    0.1 ms longer, whatever it computes), so a single order would count that as R3's cost or hide it.
    """
    half = max(1, rounds // 2)
    sessions = [engine_session(half, workdir, shape, conversations, on_first) for on_first in (False, True)]
    result: dict = {
        (kind, routed): [value for session in sessions for value in session[(kind, routed)]]
        for kind in ("wall", "cpu")
        for routed in (False, True)
    }
    for routed in (False, True):
        result[("cached", routed)] = sorted({hits for session in sessions for hits in session[("cached", routed)]})
        rounds_run = sum(session["rounds"] for session in sessions)
        result[("cpu_roles", routed)] = {  # CPU seconds per round, by role
            name: sum(session["cpu_roles"][routed][name] for session in sessions) / rounds_run for name in ROLES
        }
    result["r3_server_s"] = sum(s["r3_server_s"] for s in sessions) / sum(s["rounds_with_warmup"] for s in sessions)
    result["probe"] = step_timers([session["probe_dir"] for session in sessions])
    return result


def run_session(script: Path, env: dict[str, str], log: Path, timeout_s: float = 1800.0) -> None:
    """Run an engine session's script in a process group of its own; however this ends (done, failed, timed out,
    or this benchmark stopped), nothing it started outlives it: it is asked to stop (its engines and server shut
    down), then its group is killed (vLLM's engine core and worker processes are in it)."""
    with log.open("wb") as output:
        process = subprocess.Popen([sys.executable, str(script)], env=env, cwd=ROOT, stdout=output,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            code = process.wait(timeout=timeout_s)
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(process.pid, signal.SIGKILL)  # whatever of the group is left (none after a clean stop)
            except ProcessLookupError:
                pass
    if code:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"engine session {script.name} exited with {code}; the end of {log}:\n{tail}")


def engine_session(rounds: int, workdir: Path, shape: str, conversations: int, on_first: bool) -> dict:
    """One session: both engines stay alive and take turns round by round (off-on, on-off, ...), so a slow minute
    of a shared machine weighs on both settings alike; a pause before every round lets the other engine's worker
    leave its busy-wait (vLLM's message queue spins for 1 s after its last message). Each engine's first round is
    dropped as warm-up. Runs in a child process (vLLM needs a ``__main__`` guard).
    """
    name = f"{shape}-{conversations}-{on_first}"
    out = workdir / f"rounds-{name}.json"
    code = f"""
import json, os, time
from pathlib import Path
import psutil
def role(process, me):
    if process.pid == me:
        return "front end"
    name = process.name()
    return "engine core" if "EngineCore" in name else "worker" if "Worker" in name else "LMCache server"
def cpu_seconds():  # this process and every process below it by role: both engines, their workers, the server
    me = os.getpid()
    spent = dict.fromkeys({ROLES!r}, 0.0)
    for process in [psutil.Process()] + psutil.Process().children(recursive=True):
        try:
            times = process.cpu_times()
            spent[role(process, me)] += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return spent
def main():
    from lmcache_r3.launch import exit_on_sigterm
    exit_on_sigterm()  # a stopped benchmark shuts its engines and server down (the finally below)
    if {WORKER_CORES!r} != "nobind":
        os.sched_setaffinity(0, {{0}})  # the front end, the engine cores and the server: core 0 (the workers: the rest)
    from lmcache_r3.demo import run as demo
    from lmcache_r3.demo.model import SHAPES, build_tiny_moe
    from lmcache_r3.mp.server_process import start_written_config_server
    workdir = Path({str(workdir)!r}) / {name!r}
    workdir.mkdir()
    config, server = start_written_config_server(lambda: demo.write_demo_config(workdir), workdir / "server.log")
    os.environ["LMCACHE_CONFIG_FILE"] = str(config)
    model = build_tiny_moe(SHAPES[{shape!r}], None)
    times = {{False: [], True: []}}
    cpu = {{False: [], True: []}}
    cpu_roles = {{False: dict.fromkeys({ROLES!r}, 0.0), True: dict.fromkeys({ROLES!r}, 0.0)}}
    cached = {{False: set(), True: set()}}
    engines = {{}}
    try:
        for routed in {(True, False) if on_first else (False, True)!r}:  # the creation order of this session
            transfer = dict(demo.CONNECTOR, kv_connector_extra_config={{"lmcache_r3.routed_experts": routed}})
            # Two engines side by side: each must not ask for most of the host's memory (CPU backend check).
            engines[routed] = demo.make_llm(model, transfer, gpu_memory_utilization=0.4,
                                            max_num_seqs=max(4, {conversations}),  # the whole batch at once
                                            max_num_batched_tokens=max(512, 64 * {conversations}))  # fmt: skip
        for round_index in range({rounds} + 1):
            for routed in ((False, True) if round_index % 2 == 0 else (True, False)):
                llm = engines[routed]
                server.clear_l1()
                llm.reset_prefix_cache()
                time.sleep(1.2)  # the other engine's worker stops busy-waiting
                rollouts = demo.Rollouts(llm, server, 64)
                system = demo.words(96, seed=0)
                history = {{c: system + demo.words(24 + 7 * (c % 8), seed=100 + c) for c in range({conversations})}}
                spent = 0.0
                spent_cpu = dict.fromkeys({ROLES!r}, 0.0)
                for turn in range(3):
                    started, cpu_started = time.perf_counter(), cpu_seconds()
                    results = rollouts.generate({{str(c): h for c, h in history.items()}})
                    spent += time.perf_counter() - started
                    for name, seconds in cpu_seconds().items():
                        spent_cpu[name] += seconds - cpu_started[name]
                    hits = sum(int(r[1].num_cached_tokens or 0) for r in results.values())
                    if round_index:
                        cached[routed].add(hits)
                    for c in history:
                        history[c] = history[c] + results[str(c)][0] + demo.words(16, seed=1000 * turn + c)
                    rollouts.reset_caches(lmcache_too=False)  # waits for the stores; not in the times
                if round_index:
                    times[routed].append(spent)
                    cpu[routed].append(sum(spent_cpu.values()))
                    for name, seconds in spent_cpu.items():
                        cpu_roles[routed][name] += seconds
        r3_module = server.status().get("lmcache_r3", {{}})  # R3 handlers' server time, every round (warm-up too)
        r3_server_s = 1e-6 * (r3_module.get("store_handler_us", 0) + r3_module.get("read_handler_us", 0))
    finally:
        for llm in engines.values():
            demo.stop_llm(llm)
        server.process.stop()
    Path({str(out)!r}).write_text(json.dumps({{"wall": {{str(k): v for k, v in times.items()}},
                                               "cpu": {{str(k): v for k, v in cpu.items()}},
                                               "cpu_roles": {{str(k): v for k, v in cpu_roles.items()}},
                                               "cached": {{str(k): sorted(v) for k, v in cached.items()}},
                                               "r3_server_s": r3_server_s, "rounds_with_warmup": {rounds} + 1}}))
if __name__ == "__main__":
    main()
"""
    script = workdir / f"engines-{name}.py"
    script.write_text(code)
    probe_dir = workdir / f"probe-{name}"
    probe_dir.mkdir()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="ERROR", LMCACHE_LOG_LEVEL="ERROR",
               VLLM_CPU_OMP_THREADS_BIND=WORKER_CORES, LMCACHE_R3_BENCH_PROBE_DIR=str(probe_dir),
               PYTHONPATH=os.pathsep.join(filter(None, [str(PROBE), os.environ.get("PYTHONPATH")])))  # fmt: skip
    run_session(script, env, workdir / f"engines-{name}.log")
    measured = json.loads(out.read_text())
    result: dict = {
        (kind, routed): measured[kind][str(routed)] for kind in ("wall", "cpu", "cached") for routed in (False, True)
    }
    result["cpu_roles"] = {routed: measured["cpu_roles"][str(routed)] for routed in (False, True)}
    result["rounds"] = len(measured["wall"]["False"])
    result["r3_server_s"] = measured["r3_server_s"]
    result["rounds_with_warmup"] = measured["rounds_with_warmup"]
    result["probe_dir"] = probe_dir
    return result


def step_timers(probe_dirs: list[Path]) -> dict[tuple[str, bool], tuple[int, float]]:
    """``(calls, total)`` of each timer and counter of ``probe/sitecustomize.py``, per setting (R3 on / off)."""
    totals: dict[tuple[str, bool], tuple[int, float]] = {}
    for path in (path for probe_dir in probe_dirs for path in probe_dir.glob("*.json")):
        routed = path.name.split("-")[1] == "on"
        for timer, (calls, total) in json.loads(path.read_text()).items():
            seen_calls, seen_total = totals.get((timer, routed), (0, 0.0))
            totals[(timer, routed)] = (seen_calls + calls, seen_total + total)
    for routed in (False, True):  # every lookup: the two kinds the probe counts apart
        parts = [totals.get((f"lookup.seconds.{kind}", routed), (0, 0.0)) for kind in ("chunked", "short")]
        totals[("lookup.seconds", routed)] = (sum(calls for calls, _ in parts), sum(total for _, total in parts))
    return totals


def bookkeeping(concurrent: int, workdir: Path) -> dict[str, float]:
    """Per-step scheduler time with R3 on, and the part of it spent in the R3 bookkeeping."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from lmcache_r3.demo.model import SMALL, build_tiny_moe
    from lmcache_r3.mp.server_process import r3_server_module_spec, start_loopback_server
    from tests.support.harness import HarnessConfig, SchedulerHarness

    server = start_loopback_server(
        workdir, chunk_size=64, l1_size_gb=2.0, server_modules=(r3_server_module_spec("##r3"),)
    )
    try:
        config = HarnessConfig(connector_module="lmcache_r3.mp.connector", routed_experts=True,
                               num_blocks=concurrent * 8 + 8, max_num_seqs=concurrent,
                               max_num_batched_tokens=8192)  # fmt: skip
        harness = SchedulerHarness(build_tiny_moe(SMALL, None), server, config)
        try:
            book = harness.scheduler.connector.routed
            spent = [0.0]
            for name in ("on_schedule", "on_worker_output", "request_finished", "begin_lookup", "joint_hit_end",
                         "on_store", "admitted", "end_lookup"):  # fmt: skip
                original = getattr(book, name)

                def timed(*args, _original=original, **kwargs):
                    started = time.perf_counter()
                    try:
                        return _original(*args, **kwargs)
                    finally:
                        spent[0] += time.perf_counter() - started

                setattr(book, name, timed)
            server_calls = {"store_many": [0, 0], "fetch_many": [0, 0]}  # calls, requests in them
            for name, counts in server_calls.items():
                original = getattr(book.client, name)

                def counted(items, _original=original, _counts=counts):
                    _counts[0] += 1
                    _counts[1] += len(items)
                    return _original(items)

                setattr(book.client, name, counted)
            rng = np.random.default_rng(0)
            for i in range(concurrent):
                harness.add_request(f"r{i}", [int(t) for t in rng.integers(10, 900, size=200)], max_tokens=32)
            step_times, r3_times = [], []
            while harness.scheduler.has_requests() or harness.scheduler.requests:
                spent[0] = 0.0
                started = time.perf_counter()
                out = harness.scheduler.schedule()
                scheduled = time.perf_counter() - started
                runner_output = harness.run_worker(out)  # the worker's part is not the scheduler's step
                started = time.perf_counter()
                harness.scheduler.update_from_output(out, runner_output)
                step_times.append(scheduled + time.perf_counter() - started)
                r3_times.append(spent[0])
                if not out.num_scheduled_tokens:
                    time.sleep(0.002)
            busy = [i for i, t in enumerate(step_times) if r3_times[i] > 0]
            return {
                "steps": len(busy),
                "step_ms": statistics.median(step_times[i] for i in busy) * 1e3,
                "r3_ms": statistics.median(r3_times[i] for i in busy) * 1e3,
                "fraction": sum(r3_times[i] for i in busy) / sum(step_times[i] for i in busy),
                "server_calls": server_calls,
                "store_batch_steps": book.store_batch_steps,
            }
        finally:
            harness.shutdown()
    finally:
        server.stop()


def describe(shape_name: str) -> str:
    from lmcache_r3.demo.model import SHAPES

    shape = SHAPES[shape_name]
    return (
        f"`{shape_name}`: {shape.num_layers} layers, {shape.num_experts} experts, top-{shape.top_k}, hidden "
        f"{shape.hidden_size}"
    )


def _per_call(calls: int, total: float) -> float:
    return total / calls


def _ms_per_call(calls: int, total: float) -> float:
    return 1e3 * total / calls


def _total(calls: int, total: float) -> float:
    return total


def _calls(calls: int, total: float) -> float:
    return calls


COUNTERS = (
    ("scheduler.scheduled_tokens", "tokens scheduled per engine step", "{:.1f}", _per_call),
    ("scheduler.idle_steps", "engine steps that scheduled nothing", "{:.0f}", _total),
    ("lookup.seconds", "a request's lookup, vLLM's first ask to the answer (ms)", "{:.1f}", _ms_per_call),
    ("lookup.seconds.chunked",
     "the same, requests spanning a full chunk past vLLM's own hit (R3 on: they fetch R3) (ms)", "{:.1f}",
     _ms_per_call),
    ("lookup.seconds.short", "the same, requests that do not (ms)", "{:.1f}", _ms_per_call),
    ("lookup.asks", "vLLM's asks per lookup (one per engine step until it answers)", "{:.2f}", _per_call),
    ("lookup.r3_late", "asks answered by LMCache's KV lookup but not yet by the R3 fetch (one more step each)",
     "{:.0f}", _total),
    ("lookup.phase.unacked", "of all asks: the server had not yet acknowledged LMCache's KV LOOKUP", "{:.0f}", _total),
    ("lookup.phase.status", "of all asks: LMCache's query of the KV lookup's result was still out", "{:.0f}", _total),
    ("r3.store_many", "R3 store calls to the LMCache server", "{:.0f}", _calls),
    ("r3.store_many", "requests per R3 store call", "{:.1f}", _per_call),
    ("r3.fetch_many", "R3 fetch calls to the LMCache server", "{:.0f}", _calls),
    ("r3.fetch_many", "requests per R3 fetch call", "{:.1f}", _per_call),
)  # fmt: skip
"""Counters of ``probe/sitecustomize.py``: name, label, format, value from ``(calls, total)``."""


def probe_rows(probe: dict[tuple[str, bool], tuple[int, float]]) -> list[str]:
    """The timers' rows: mean milliseconds per call, off and on."""
    rows = []
    for timer, label in TIMERS:
        off, on = (probe.get((timer, routed)) for routed in (False, True))
        if on is None or not on[0]:
            continue
        on_ms = _ms_per_call(*on)
        if off is None or not off[0]:  # R3's own work: nothing to compare with
            rows.append(f"| {label} | - | {on_ms:.3f} | {on_ms:+.3f} |")
        else:
            off_ms = _ms_per_call(*off)
            rows.append(f"| {label} | {off_ms:.3f} | {on_ms:.3f} | {on_ms - off_ms:+.3f} |")
    return rows


def counter_rows(probe: dict[tuple[str, bool], tuple[int, float]]) -> list[str]:
    """The counters' rows, off and on (every step of every round, warm-up included)."""
    rows = []
    for name, label, fmt, value in COUNTERS:
        off, on = (probe.get((name, routed)) for routed in (False, True))
        if on is None or not on[0]:
            continue
        shown_off = fmt.format(value(*off)) if off is not None and off[0] else "-"  # e.g. R3's own waits
        rows.append(f"| {label} | {shown_off} | {fmt.format(value(*on))} |")
    steps = [probe.get(("engine_core.step", routed), (0, 0.0))[0] for routed in (False, True)]
    if all(steps):
        rows.append(f"| engine steps | {steps[0]} | {steps[1]} |")
    return rows


def lookup_wait_lines(probe: dict[tuple[str, bool], tuple[int, float]]) -> list[str]:
    """Where the extra asks of R3-on lookups went: R3 fetches answering late, or LMCache's own KV lookup."""
    asks = {routed: probe.get(("lookup.asks", routed), (0, 0.0))[1] for routed in (False, True)}
    late = probe.get(("lookup.r3_late", True), (0, 0.0))[1]
    kv = {
        routed: sum(probe.get((f"lookup.phase.{phase}", routed), (0, 0.0))[1] for phase in ("unacked", "status"))
        for routed in (False, True)
    }
    if not all(asks.values()):
        return []
    return [
        f"vLLM asked {asks[False]:.0f} times in all for the lookups of the R3-off engine and {asks[True]:.0f} times "
        f"for those of the R3-on engine. {late:.0f} of the R3-on asks found LMCache's KV answer in but the R3 fetch "
        f"still out; the asks made while LMCache's own KV lookup was still out (before the server acknowledged its "
        f"LOOKUP, then while the query of its result was out) went from {kv[False]:.0f} to {kv[True]:.0f}"
        + (
            ": with R3 on, the KV lookups themselves answer later (the LMCache server, the engine core and the R3 "
            "calls share core 0 here)."
            if kv[True] > kv[False]
            else "."
        ),
        "",
    ]


def end_to_end(shape_name: str, conversations: int, rounds_of: dict) -> list[str]:
    """The tables of one model's rounds at one batch size."""
    off, on = rounds_of[("wall", False)], rounds_of[("wall", True)]
    cpu_off, cpu_on = rounds_of[("cpu", False)], rounds_of[("cpu", True)]
    cpu_ratio = statistics.median(cpu_on) / statistics.median(cpu_off)
    ratio = statistics.median(on) / statistics.median(off)
    pairs = sorted(a / b for a, b in zip(on, off, strict=True))  # round i of each engine ran back to back
    quartiles = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
    return [
        f"### Model {describe(shape_name)}; {conversations} conversations",
        "",
        "| routed experts | rounds (s) | median (s) | on / off |",
        "| --- | --- | --- | --- |",
        f"| off (KV only) | {', '.join(f'{t:.2f}' for t in off)} | {statistics.median(off):.2f} | 1.00x |",
        f"| on | {', '.join(f'{t:.2f}' for t in on)} | {statistics.median(on):.2f} | **{ratio:.3f}x** |",
        "",
        f"Round i of one engine ran right after round i of the other: the median of the {len(pairs)} paired ratios "
        f"on / off is **{statistics.median(pairs):.3f}x** (quartiles {quartiles[0]:.3f}x - {quartiles[2]:.3f}x). "
        f"Spread of the rounds (slowest / fastest): off {max(off) / min(off):.2f}x, on {max(on) / min(on):.2f}x. "
        f"Goal on / off <= 1.05: **{'met' if ratio <= 1.05 else 'not met'}**.",
        "",
        f"Cached tokens (vLLM's `num_cached_tokens`, summed over a turn's {conversations} requests), every value "
        "seen: off "
        f"{rounds_of[('cached', False)]}, on {rounds_of[('cached', True)]}: "
        + (
            "the same with R3 on and off, so the difference is the cost of capturing, moving and storing routed "
            "experts, not fewer cache hits."
            if rounds_of[("cached", False)] == rounds_of[("cached", True)]
            else "they differ between R3 on and off, so part of the difference is cache hits, not R3's own cost."
        ),
        "",
        "Per call, inside the engine processes (every step of every round, warm-up included; timers wrapped around "
        "vLLM's methods by `bench/probe/sitecustomize.py`):",
        "",
        "| mean per call | off (ms) | on (ms) | on - off (ms) |",
        "| --- | --- | --- | --- |",
        *probe_rows(rounds_of["probe"]),
        "",
        "How the scheduler batched the same work (counted the same way; the same tokens spread over more steps, or "
        "requests waiting longer for their lookups, cost time without showing in any one call above):",
        "",
        "| per engine | off | on |",
        "| --- | --- | --- |",
        *counter_rows(rounds_of["probe"]),
        "",
        *lookup_wait_lines(rounds_of["probe"]),
        "CPU time of the same generate calls (every process: both engines, their workers, the LMCache server):",
        "",
        "| routed experts | CPU seconds per round | median | on / off |",
        "| --- | --- | --- | --- |",
        f"| off (KV only) | {', '.join(f'{t:.2f}' for t in cpu_off)} | {statistics.median(cpu_off):.2f} | 1.00x |",
        f"| on | {', '.join(f'{t:.2f}' for t in cpu_on)} | {statistics.median(cpu_on):.2f} | **{cpu_ratio:.3f}x** |",
        "",
        "The same CPU time by process (mean per round; the front end is the process calling `generate`):",
        "",
        "| process | off (s) | on (s) | on - off (s) |",
        "| --- | --- | --- | --- |",
        *(
            f"| {name} | {rounds_of[('cpu_roles', False)][name]:.3f} | {rounds_of[('cpu_roles', True)][name]:.3f} | "
            f"{rounds_of[('cpu_roles', True)][name] - rounds_of[('cpu_roles', False)][name]:+.3f} |"
            for name in ROLES
        ),
        "",
        f"Of the LMCache server's time, its R3 handlers (store, lookup and fetch of R3 objects; `*_handler_us` in "
        f"`/status`) ran {1e3 * rounds_of['r3_server_s']:.1f} ms per R3-on round (wall time on its worker threads, "
        f"warm-up rounds included).",
        "",
    ]


def report(rounds: int, concurrent: int, models: list[str], batches: list[int]) -> str:
    workdir = Path(tempfile.mkdtemp(prefix="bench-routed-"))
    try:
        measured = {
            (name, conversations): engine_rounds(rounds, workdir, name, conversations)
            for conversations in batches
            for name in models
        }
        book = bookkeeping(concurrent, workdir)
    except BaseException:
        print(f"bench_routed stopped; the logs of its engines and servers are in {workdir}", file=sys.stderr)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    lines = [
        SECTION,
        "",
        f"`python bench/bench_routed.py --rounds {rounds} --concurrent {concurrent} --models {','.join(models)} "
        f"--conversations {','.join(map(str, batches))} --write` on nproc {os.cpu_count()} "
        f"({platform.processor() or platform.machine()}), Python "
        f"{platform.python_version()}, {datetime.date.today()}.",
        "",
        "End to end, vLLM on CPU (random-weight Qwen3-MoE models built locally: "
        + "; ".join(describe(name) for name in models)
        + "): the demo's multi-turn workload, "
        + " and ".join(f"{n} conversations" for n in batches)
        + " (sharing a 96-token system prompt) x 3 turns "
        "(64 output tokens each, all conversations of a turn in one `generate` call, each engine scheduling the "
        "whole batch at once: `max_num_seqs` = the conversations, at least 4) with vLLM's prefix cache reset between "
        "turns; the LMCache server runs the demo's config (`lmcache_r3/demo/demo.yaml`: 64-token chunks, a 0.5 GB L1, "
        "no L2 tier); LMCache L1 cleared before each round; "
        "two engines with the same connector, routed experts on and off, alive side by side and taking turns round "
        "by round (off-on, on-off, ...), a 1.2 s pause before every round so the idle engine's worker stops "
        f"busy-waiting; the workers on cores {WORKER_CORES} (`VLLM_CPU_OMP_THREADS_BIND`), the front end, the engine "
        "cores and the LMCache server on core 0; each engine's first round dropped; median of the rounds. Timed: the "
        "three generate calls of "
        "a round (not the wait for LMCache's stores to land before each prefix-cache reset). Each model's engines "
        "run on their own, one model after the other, in two sessions of half the rounds each: the first starts the "
        "R3-off engine first, the second the R3-on engine (the engine started second runs slower here, whatever it "
        "computes: about 0.1 ms more per worker step). Goal: on / off <= 1.05.",
        "",
    ]
    for (name, conversations), rounds_of in measured.items():
        lines += end_to_end(name, conversations, rounds_of)
    lines += [
        "### Scheduler-side bookkeeping",
        "",
        f"Scheduler-side R3 bookkeeping with {concurrent} concurrent requests (200-token prompts, 32 output tokens; "
        "real vLLM scheduler and both connector roles, no model): median per step over "
        f"{book['steps']} steps.",
        "",
        "| scheduler step (schedule + update_from_output), median | R3 bookkeeping inside it, median | R3 share of all "
        "scheduler time |",
        "| --- | --- | --- |",
        f"| {book['step_ms']:.2f} ms | {book['r3_ms']:.2f} ms | **{100 * book['fraction']:.1f}%** |",
        "",
        "R3 calls to the LMCache server in that run (each engine step sends one fetch call at most, whatever the "
        f"number of requests in it, and R3 stores of prompt chunks wait up to `r3_store_batch_steps`, "
        f"{book['store_batch_steps']} steps, those of chunks holding generated tokens until their request ends, to "
        "go out in one call with later ones): "
        + ", ".join(
            f"`{name}` {calls} calls for {items} requests" for name, (calls, items) in book["server_calls"].items()
        )
        + ".",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=256)
    parser.add_argument(
        "--models", default="small,medium", help="comma-separated model shapes to run end to end (default small,medium)"
    )
    parser.add_argument(
        "--conversations",
        default="4",
        help="comma-separated batch sizes: conversations rolled out together (default 4, the demo's)",
    )
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    from lmcache_r3.demo.model import SHAPES

    models = [name for name in args.models.split(",") if name]
    if not models or any(name not in SHAPES for name in models):
        parser.error(f"--models takes names among {sorted(SHAPES)}, got {args.models!r}")
    from lmcache_r3.launch import TELEMETRY_OFF, exit_on_sigterm

    exit_on_sigterm()
    os.environ.update(TELEMETRY_OFF)
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    try:
        batches = [int(n) for n in args.conversations.split(",") if n]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        parser.error(f"--conversations takes positive integers, got {args.conversations!r}")
    text = report(args.rounds, args.concurrent, models, batches)
    print(text)
    if args.write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
