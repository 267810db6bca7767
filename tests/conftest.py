"""Fixtures that start the real services lmcache_r3 runs with: an LMCache MP server, a Mooncake master + holder,
tiny MoE models, and the vLLM scheduler harness. Each listens on 127.0.0.1 with free ports, has telemetry off,
is ready when a real probe answers, is stopped by pid, and has its log quoted when a test fails.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lmcache_r3.launch import LOOPBACK, PORT_LANE_VAR, TELEMETRY_OFF, port_lane
from tests.support.processes import (
    REGISTRY,
    RUN_MARKER_VAR,
    ensure_run_marker,
    kill_pids,
    processes_with_marker,
)

# Telemetry off for this process and, by inheritance, for everything it starts.
os.environ.update(TELEMETRY_OFF)
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
RUN_MARKER = ensure_run_marker()
VLLM_PORT_BASE = 20000
"""vLLM's ports in this run start here (``VLLM_PORT``), under Linux's default ephemeral range (32768-60999)."""
VLLM_PORTS_PER_LANE = 1000


# -- order -----------------------------------------------------------------------------------------------------
def pytest_collection_modifyitems(config, items):
    """Test files that start vLLM engines first (each takes minutes): with pytest-xdist they then run side by side
    from the start, and the short files fill the time around them instead of one engine file running last."""
    engine_files = {item.path for item in items if item.get_closest_marker("engine")}
    items.sort(key=lambda item: item.path not in engine_files)  # stable: the order within each group is kept


# -- failure reports and leftover processes ---------------------------------------------------------------------
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for title, text in REGISTRY.log_sections():
            report.sections.append((title, text))


def pytest_configure(config):
    """A pytest-xdist worker marks what it starts with a marker of its own: it checks its own processes at its end,
    while the other workers' still run."""
    global RUN_MARKER
    workerinput = getattr(config, "workerinput", {})
    worker = workerinput.get("workerid")
    if worker:
        RUN_MARKER = f"{RUN_MARKER}-{worker}"
        os.environ[RUN_MARKER_VAR] = RUN_MARKER
        # Each worker (and what it starts) picks ports of its own lane: a client still reconnecting to a server one
        # worker stopped never reaches a server another worker started on the same port.
        os.environ[PORT_LANE_VAR] = f"{int(worker.removeprefix('gw'))}/{workerinput['workercount']}"
    # vLLM picks the ports its engines listen on (torch.distributed's store) by a bind to port 0 it lets go of before
    # it binds again: in the range free_port picks from, so either could take the other's port in between. From
    # VLLM_PORT up, vLLM probes ports below that range instead (and above Mooncake's 15000-17000), a block per lane.
    lane, _ = port_lane(os.environ.get(PORT_LANE_VAR))
    os.environ.setdefault("VLLM_PORT", str(VLLM_PORT_BASE + VLLM_PORTS_PER_LANE * lane))


_WORKER_LEFTOVERS: list[str] = []
"""With pytest-xdist, on the controller: what each worker reported still running at its end."""


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _WORKER_LEFTOVERS.extend(getattr(node, "workeroutput", {}).get("lmcache_r3_leftovers", ()))


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if any process started by this session outlived it (after every fixture was torn down)."""
    if os.environ.get(RUN_MARKER_VAR) != RUN_MARKER:
        return
    workeroutput = getattr(session.config, "workeroutput", None)
    # A pytest-xdist controller starts nothing. Its workers checked theirs; a worker that crashed reported nothing, so
    # what any worker started (its marker extends this one) is looked for once more, now that all have ended.
    controller = workeroutput is None and session.config.pluginmanager.has_plugin("dsession")
    found = processes_with_marker(RUN_MARKER, derived=controller)
    kill_pids(list(found))
    leftovers = (_WORKER_LEFTOVERS if controller else []) + [
        f"pid {pid}: {cmd[:200]}" for pid, cmd in sorted(found.items())
    ]
    if workeroutput is not None:  # a worker: its controller fails the run
        workeroutput["lmcache_r3_leftovers"] = leftovers
    if leftovers:
        lines = "\n".join(f"  {line}" for line in leftovers)
        sys.stderr.write(f"\nERROR: {len(leftovers)} process(es) started by this test session still run:\n{lines}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- ports -----------------------------------------------------------------------------------------------------
@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port this process listens on: for a service given it, another process holds it (as vLLM's store or
    any program that bound it in the moment between free_port's pick and the service's bind might)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        sock.listen(1)
        yield sock.getsockname()[1]


# -- LMCache MP server -----------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def lmcache_server_factory(tmp_path_factory) -> Iterator[Callable[..., object]]:
    """Start ``lmcache server`` processes: ``factory(chunk_size=..., server_modules=(...), l2_adapters=(...),
    extra_args=("--separate-object-groups",), transfer_mode="auto")``. All are stopped at session end;
    a test may stop one earlier with ``server.stop()``."""
    from lmcache_r3.mp.server_process import start_loopback_server

    started = []
    logs = tmp_path_factory.mktemp("lmcache-server")

    def factory(**overrides):
        server = start_loopback_server(logs, **overrides)
        REGISTRY.add(server.process)
        started.append(server)
        return server

    yield factory
    with ThreadPoolExecutor(max_workers=8) as pool:  # each takes a few seconds to shut down; together, not in turn
        list(pool.map(lambda server: server.stop(), started))


@pytest.fixture(scope="session")
def lmcache_server(lmcache_server_factory):
    """One shared server: chunk size 64 (two 32-token blocks), 0.5 GiB L1."""
    return lmcache_server_factory(chunk_size=64)


@pytest.fixture(scope="session")
def r3_server_factory(lmcache_server_factory):
    """Start servers with the R3 chunk type loaded (namespace ``##r3``), chunk size 64: ``factory(**overrides)``
    takes what ``lmcache_server_factory`` does (``l2_adapters=...``, ``port=...``)."""
    from lmcache_r3.mp.server_process import r3_server_module_spec

    def factory(**overrides):
        return lmcache_server_factory(chunk_size=64, server_modules=(r3_server_module_spec("##r3"),), **overrides)

    return factory


@pytest.fixture(scope="session")
def r3_server(r3_server_factory):
    """A server with the R3 chunk type loaded (namespace ``##r3``), chunk size 64, no L2 tier."""
    return r3_server_factory()


@pytest.fixture
def own_r3_server(r3_server_factory):
    """Like ``r3_server``, for one test: a test that asserts every lock is released counts only its own."""
    server = r3_server_factory()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def r3_server_with_fs_tier(r3_server_factory, tmp_path_factory):
    """Like ``r3_server``, with a stock LMCache fs L2 tier below L1."""
    l2 = tmp_path_factory.mktemp("fs-l2")
    return r3_server_factory(l2_adapters=({"type": "fs", "base_path": str(l2)},))


# -- Mooncake -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def mooncake_cluster(tmp_path_factory):
    """A Mooncake master and a separate holder process (256 MB segment) on loopback."""
    from tests.support.mooncake import start_mooncake

    cluster = start_mooncake(tmp_path_factory.mktemp("mooncake"))
    REGISTRY.add(cluster.master)
    REGISTRY.add(cluster.holder)
    yield cluster
    cluster.stop()


@pytest.fixture
def mooncake_store(mooncake_cluster):
    """A store client that holds no memory itself, set up after the master answers /health."""
    store = mooncake_cluster.client()
    yield store
    store.close()


# -- tiny MoE models -------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_moe(model_cache_dir) -> Path:
    """Qwen3-MoE, 2 layers, 8 experts, top-2, head_dim 32 (uint8 routing)."""
    from lmcache_r3.demo.model import SMALL, build_tiny_moe

    return build_tiny_moe(SMALL, model_cache_dir)


@pytest.fixture(scope="session")
def tiny_dense_config(tiny_moe, model_cache_dir) -> Path:
    """The config and tokenizer of a dense Qwen3 (no MoE layers), for scheduler-side tests (no weights)."""
    import json
    import shutil

    out = model_cache_dir / "tiny-dense-config"
    if not out.exists():
        shutil.copytree(tiny_moe, out, ignore=shutil.ignore_patterns("*.safetensors"))
        config = json.loads((out / "config.json").read_text())
        for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "router_aux_loss_coef",
                    "output_router_logits"):  # fmt: skip
            config.pop(key, None)
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
        (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def tiny_moe_wide(model_cache_dir) -> Path:
    """Qwen3-MoE, 4 layers, 300 experts, top-3 (uint16 routing), so nothing is tuned to one shape."""
    from lmcache_r3.demo.model import WIDE, build_tiny_moe

    return build_tiny_moe(WIDE, model_cache_dir)


# -- vLLM scheduler harness ------------------------------------------------------------------------------------
@pytest.fixture
def scheduler_harness_factory(tiny_moe, lmcache_server):
    """Build :class:`tests.support.harness.SchedulerHarness` instances against ``lmcache_server`` (or another
    server passed as ``server=``); each is shut down after the test."""
    from tests.support.harness import HarnessConfig, SchedulerHarness

    built = []

    def factory(server=None, model_dir=None, **overrides):
        server = server or lmcache_server
        harness = SchedulerHarness(model_dir or tiny_moe, server, HarnessConfig(**overrides))
        built.append(harness)
        return harness

    yield factory
    for harness in built:
        harness.shutdown()
