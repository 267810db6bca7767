"""Tiers named in LMCACHE_CONFIG_FILE: ``{type: shm, ...}`` becomes the plugin adapter of a real server started by
``lmcache-r3 server``, and the tier's capacity and TTL act under that server."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from lmcache_r3.artifacts import encoded_nbytes
from lmcache_r3.config import ConfigError, parse_config
from lmcache_r3.launch import executable, free_port
from lmcache_r3.mp.r3_client import R3Client
from lmcache_r3.mp.server_process import LMCacheServer, start_written_config_server
from lmcache_r3.tiers.plugins import l2_adapter_spec
from lmcache_r3.tiers.shm_store import HEADER
from tests.server.test_r3_server_module import CHUNK, MODEL, PROFILE, rows_for, store_rows, tokens_for
from tests.support.processes import REGISTRY
from tests.tiers.test_shm_tier import (
    clear_l1,
    fetch_rows,
    free_files,
    shm_root,
    tier_files,
    tier_status,
    wait_for_files,
)

__all__ = ["shm_root"]  # the fixture, shared with the shm tier tests

pytestmark = pytest.mark.server


@pytest.mark.parametrize(
    ("tier", "spec"),
    [
        pytest.param(
            {"type": "shm", "root": "/dev/shm/x", "capacity_bytes": 1 << 30, "ttl_seconds": 60},
            {"type": "plugin", "module_path": "lmcache_r3.tiers.shm_adapter", "class_name": "ShmL2Adapter",
             "adapter_params": {"root": "/dev/shm/x", "capacity_bytes": 1 << 30, "ttl_seconds": 60}},
            id="shm-becomes-the-plugin",
        ),
        pytest.param(
            {"type": "shm", "root": "/r", "capacity_bytes": 1, "eviction": {"eviction_policy": "LRU"}},
            {"type": "plugin", "module_path": "lmcache_r3.tiers.shm_adapter", "class_name": "ShmL2Adapter",
             "eviction": {"eviction_policy": "LRU"}, "adapter_params": {"root": "/r", "capacity_bytes": 1}},
            id="eviction-stays-beside-type",
        ),
        pytest.param(
            {"type": "mooncake", "mooncake": {"master_server_address": "10.0.0.1:50051"}, "master_metrics_port": 9003},
            {"type": "plugin", "module_path": "lmcache_r3.tiers.mooncake_adapter", "class_name": "MooncakeL2Adapter",
             "adapter_params": {"mooncake": {"master_server_address": "10.0.0.1:50051"}, "master_metrics_port": 9003}},
            id="mooncake-becomes-the-plugin",
        ),
        pytest.param({"type": "fs", "base_path": "/d"}, {"type": "fs", "base_path": "/d"}, id="stock-passes-through"),
    ],
)  # fmt: skip
def test_tier_entries_become_l2_adapter_specs(tier, spec):
    assert l2_adapter_spec(tier) == spec


def test_the_keys_lmcache_reads_for_every_adapter_reach_it_beside_the_plugin_parameters():
    """LMCache's own --l2-adapter parser sees affinity_tag, shared and persist_enabled of a shm tier; the adapter's
    parameters hold only its own keys (the adapter refuses keys it does not know)."""
    import argparse
    import json

    from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config

    tier = {"type": "shm", "root": "/dev/shm/x", "capacity_bytes": 1 << 20, "shared": True,
            "affinity_tag": "r3-host", "persist_enabled": False}  # fmt: skip
    args = add_l2_adapters_args(argparse.ArgumentParser()).parse_args(
        ["--l2-adapter", json.dumps(l2_adapter_spec(tier))]
    )
    (adapter,) = parse_args_to_l2_adapters_config(args).adapters
    assert adapter.shared is True and adapter.affinity_tag == "r3-host"
    assert adapter.persist_config.persist_enabled is False
    assert adapter.adapter_params == {"root": "/dev/shm/x", "capacity_bytes": 1 << 20}


@pytest.mark.parametrize("missing", ["root", "capacity_bytes"])
def test_a_shm_tier_without_a_required_key_is_refused_with_its_name(missing):
    tier = {"type": "shm", "root": "/dev/shm/x", "capacity_bytes": 1 << 30}
    del tier[missing]
    with pytest.raises(ConfigError, match=rf"tiers\[0\]\.{missing}: required for a tier of type shm"):
        parse_config({"tiers": [tier]}, "deploy.yaml")


def start_from_config(tmp_path, tier: dict) -> LMCacheServer:
    """``lmcache-r3 server`` on a config file with ``tier`` below L1 (written again on new ports after a clash)."""

    def write_config() -> Path:
        document = {"server": {"port": free_port(), "http_port": free_port(), "chunk_size": CHUNK, "l1_size_gb": 0.25},
                    "tiers": [tier]}  # fmt: skip
        config = tmp_path / "lmcache_r3.yaml"
        config.write_text(yaml.safe_dump(document))
        return config

    _, server = start_written_config_server(write_config, tmp_path / "server.log")
    REGISTRY.add(server.process)
    return server


def test_a_shm_tier_from_the_config_file_serves_r3_after_l1_is_cleared(tmp_path, shm_root):
    server = start_from_config(tmp_path, {"type": "shm", "root": shm_root, "capacity_bytes": 64 << 20})
    try:
        tokens, rows = tokens_for(301, 3 * CHUNK), rows_for(301, 3 * CHUNK)
        with R3Client(server.url, MODEL, PROFILE) as r3:
            assert store_rows(r3, tokens, rows).num_stored == 3
            wait_for_files(shm_root, 3)
            clear_l1(server)
            hits, fetched = fetch_rows(r3, tokens)
        assert hits == 3 and np.array_equal(fetched, rows)
        inspect = subprocess.run([executable("lmcache-r3"), "inspect", "--url", server.http_url], capture_output=True,
                                 text=True, timeout=60)  # fmt: skip
        assert inspect.returncode == 0, inspect.stderr
        (tier,) = json.loads(inspect.stdout)["tiers"]
        assert tier["type"] == "ShmL2Adapter" and tier["healthy"] is True
        assert tier["hits"] >= 3 and tier["bytes"] > 0 and tier["errors"] == 0 and tier["corrupt"] == 0
        assert {"raced", "recycled", "pooled_bytes"} <= tier.keys(), "inspect lost the recycling counters"
        assert tier["raced"] == 0
    finally:
        server.process.stop()


def test_capacity_bounds_the_tier_and_ttl_sweeps_it_under_a_real_server(tmp_path, shm_root):
    object_bytes = encoded_nbytes(PROFILE, CHUNK) + HEADER.size  # a file: the store's header + the R3 object
    tier = {"type": "shm", "root": shm_root, "capacity_bytes": 4 * object_bytes + object_bytes // 2, "ttl_seconds": 2,
            "sweep_interval_seconds": 0.5}  # fmt: skip
    server = start_from_config(tmp_path, tier)
    try:
        with R3Client(server.url, MODEL, PROFILE) as r3:
            prompts = [(tokens_for(seed, 3 * CHUNK), rows_for(seed, 3 * CHUNK)) for seed in (302, 303)]
            store_rows(r3, *prompts[0])
            wait_for_files(shm_root, 3)
            store_rows(r3, *prompts[1])
            deadline = time.monotonic() + 10
            while len(tier_files(shm_root)) > 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(tier_files(shm_root)) <= 4, "the tier holds more than its capacity"
            assert len(tier_files(shm_root) | free_files(shm_root)) <= 4, "objects + free files exceed the capacity"
            # Which objects go is the store's LRU (tests/unit/test_shm_store.py); LMCache may also skip or evict ahead
            # of the store, as the tier reports its capacity to LMCache.
            clear_l1(server)
            served = 0
            for tokens, rows in prompts:  # evicted objects are misses, never wrong bytes
                hits, fetched = fetch_rows(r3, tokens)
                served += hits
                assert hits == 0 or np.array_equal(fetched, rows[: hits * CHUNK])
            assert served <= 4
            deadline = time.monotonic() + 10
            while tier_files(shm_root) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not tier_files(shm_root), "objects older than ttl_seconds were meant to be swept"
            assert len(free_files(shm_root)) <= 4, "the swept objects' files exceed the capacity"
            assert tier_status(server)["expired"] >= 1
            assert all(fetch_rows(r3, tokens)[0] == 0 for tokens, _ in prompts)
    finally:
        server.process.stop()
