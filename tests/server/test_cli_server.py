"""`lmcache-r3 server` runs the LMCache MP server an LMCACHE_CONFIG_FILE describes; `inspect` reads it back."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from lmcache_r3.artifacts import R3Profile, encode_run
from lmcache_r3.launch import executable, free_port
from lmcache_r3.mp.r3_client import R3Client
from lmcache_r3.mp.server_process import start_written_config_server
from tests.support.processes import REGISTRY

pytestmark = pytest.mark.server

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lmcache_r3.yaml"


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([executable("lmcache-r3"), *args], capture_output=True, text=True, timeout=120, env=env)


def write_example_on_free_ports(tmp_path) -> Path:
    """The shipped example file, with free ports and the shm tier's root under a temp dir."""
    document = yaml.safe_load(EXAMPLE.read_text())
    document["server"].update(port=free_port(), http_port=free_port(), chunk_size=64, l1_size_gb=0.25)
    document["tiers"][0]["root"] = str(tmp_path / "l2")
    path = tmp_path / "lmcache_r3.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture
def example_on_free_ports(tmp_path) -> Path:
    return write_example_on_free_ports(tmp_path)


def test_print_command_shows_the_stock_server_with_our_module_and_tiers(example_on_free_ports):
    result = cli("server", "--config", str(example_on_free_ports), "--print-command")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("env LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 ")
    assert " server --host 127.0.0.1 " in result.stdout
    assert '"module_path":"lmcache_r3.mp.server_module"' in result.stdout
    assert '"module_path":"lmcache_r3.tiers.shm_adapter"' in result.stdout


def test_a_bad_config_file_stops_the_server_command_with_the_key_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  chunk_size: 64\n  evicton_policy: LRU\n")
    result = cli("server", "--config", str(bad))
    assert result.returncode == 2
    assert "server.evicton_policy: unknown key" in result.stderr


def test_the_example_file_starts_a_working_server_with_r3(tmp_path):
    example, server = start_written_config_server(
        lambda: write_example_on_free_ports(tmp_path), tmp_path / "server.log"
    )
    process = REGISTRY.add(server.process)
    try:
        profile = R3Profile(num_layers=2, top_k=2, num_experts=8)
        tokens = list(range(100, 100 + 128))
        rows = np.zeros((128, 2, 2), dtype=np.uint8)
        with R3Client(server.url, "m", profile) as r3:
            assert r3.info().result().chunk_size == 64
            assert r3.store(tokens, 0, encode_run(profile, 0, rows, 64)).result().num_stored == 2
        inspect = cli("inspect", "--config", str(example))
        assert inspect.returncode == 0, inspect.stderr
        summary = json.loads(inspect.stdout)
        assert summary["r3"]["stored_chunks"] == 2
        assert summary["r3"]["namespace"] == "##r3"
        assert summary["active_sessions"] == server.status()["active_sessions"] == 0
        assert [tier["type"] for tier in summary["tiers"]] == ["ShmL2Adapter"]

        cleared = cli("clear", "--config", str(example))  # e.g. after a policy update
        assert cleared.returncode == 0, cleared.stderr
        (tier,) = json.loads(cleared.stdout)["tiers"]
        assert tier["type"] == "ShmL2Adapter" and "error" not in tier
        with R3Client(server.url, "m", profile) as r3:
            assert r3.lookup(tokens).result().num_hit_chunks == 0, "served after the clear"
    finally:
        process.stop()
    assert not process.alive()


def test_inspect_says_clearly_when_no_server_answers():
    result = cli("inspect", "--url", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 1
    assert "no LMCache server answers" in result.stderr
