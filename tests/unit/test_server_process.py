"""The stock `lmcache server` command line built from typed settings."""

import json

import pytest

from lmcache_r3.mp.server_process import ServerSettings, server_argv


def flag_value(argv, flag):
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            ServerSettings(port=5555, http_port=8080),
            {"--port": "5555", "--chunk-size": "256", "--host": "127.0.0.1"},
        ),
        (
            ServerSettings(port=1, http_port=2, chunk_size=64, l1_size_gb=2, eviction_policy="ARC"),
            {
                "--chunk-size": "64",
                "--l1-size-gb": "2.0",
                "--eviction-policy": "ARC",
                "--http-host": "127.0.0.1",
            },
        ),
        (
            ServerSettings(port=1, http_port=2, transfer_mode="lmcache_driven"),
            {"--supported-transfer-mode": "lmcache_driven"},
        ),
        (
            # engines on other hosts reach the request port; the unauthenticated HTTP API stays on loopback
            ServerSettings(port=1, http_port=2, host="10.0.0.5"),
            {"--host": "10.0.0.5", "--http-host": "127.0.0.1"},
        ),
        (ServerSettings(port=1, http_port=2, http_host="10.0.0.6"), {"--host": "127.0.0.1", "--http-host": "10.0.0.6"}),
    ],
)
def test_settings_become_flags(settings, expected):
    argv = server_argv(settings, program="lmcache")
    assert argv[:2] == ["lmcache", "server"]
    for flag, value in expected.items():
        assert flag_value(argv, flag) == value


def test_plugins_are_passed_as_compact_json_in_order():
    modules = ({"module_path": "a.b", "config": {"x": 1}},)
    adapters = ({"type": "fs", "base_path": "/tmp/l2"}, {"type": "plugin", "module_path": "c"})
    argv = server_argv(
        ServerSettings(
            port=1,
            http_port=2,
            server_modules=modules,
            l2_adapters=adapters,
            extra_args=("--separate-object-groups",),
        ),
        program="lmcache",
    )
    module_args = [argv[i + 1] for i, a in enumerate(argv) if a == "--server-module"]
    adapter_args = [argv[i + 1] for i, a in enumerate(argv) if a == "--l2-adapter"]
    assert [json.loads(a) for a in module_args] == list(modules)
    assert [json.loads(a) for a in adapter_args] == list(adapters)
    assert argv[-1] == "--separate-object-groups"


def test_connector_extra_config_points_at_the_server():
    from lmcache_r3.mp.server_process import LMCacheServer

    server = LMCacheServer(ServerSettings(port=5999, http_port=2), process=None)
    extra = server.connector_extra_config(mq_timeout_s=12)
    assert extra == {
        "lmcache.mp.host": "tcp://127.0.0.1",
        "lmcache.mp.port": 5999,
        "lmcache.mp.mq_timeout": 12,
    }


def test_the_r3_module_gets_the_files_bound_on_the_tiers():
    from lmcache_r3.config import parse_config
    from lmcache_r3.mp.server_process import settings_from_config

    config = parse_config({"r3": {"tier_timeout_s": 1.5}, "connector": {"r3_timeout_s": 3}}, "deploy.yaml")
    (module,) = settings_from_config(config).server_modules
    assert module["config"] == {"namespace": "##r3", "tier_timeout_s": 1.5}
    # Unset, it stays below the connector's bound, whatever that is: 0.8 x it.
    config = parse_config({"connector": {"r3_timeout_s": 2}}, "deploy.yaml")
    (module,) = settings_from_config(config).server_modules
    assert module["config"] == {"namespace": "##r3", "tier_timeout_s": 1.6}


def counts(objects: int, write_locked: int = 0) -> dict[str, int]:
    return {"total_object_count": objects, "write_locked_count": write_locked}


@pytest.mark.parametrize(
    ("readings", "settled_at"),
    [
        # (time, objects, write-locked) readings, settle_s 0.3; the index of the first reading that says settled
        ([(0.0, 4, 0), (0.1, 4, 0), (0.3, 4, 0)], 2),
        ([(0.0, 4, 0), (0.2, 5, 0), (0.4, 5, 0), (0.5, 5, 0)], 3),  # a store landed: the wait starts again
        ([(0.0, 4, 1), (0.3, 4, 1), (0.4, 4, 0), (0.6, 4, 0), (0.8, 4, 0)], 4),  # settled only once the copy is in
        ([(0.0, 0, 0), (0.1, 0, 0), (0.2, 0, 0)], None),  # not yet settle_s
        ([(0.0, 4, 0), (0.4, 4, 2), (0.5, 4, 0), (0.7, 4, 0)], None),  # a lock resets what held still before it
    ],
)
def test_stores_settle_once_nothing_is_write_locked_and_the_count_held_still(readings, settled_at):
    from lmcache_r3.mp.server_process import StoreSettling

    watch = StoreSettling(settle_s=0.3)
    answers = [watch.settled(counts(objects, locked), now) for now, objects, locked in readings]
    assert (answers.index(True) if True in answers else None) == settled_at, answers


@pytest.mark.parametrize(
    ("document", "cpu_workers"),
    [
        ({}, "4"),  # 2 for LMCache's lookups, 2 more for R3 calls
        ({"server": {"max_workers": 6}, "r3": {"workers": 3}}, "9"),
        ({"r3": {"workers": 0}}, "2"),
        ({"r3": {"enabled": False}}, None),  # no R3 module: LMCache's own sizing (max_workers)
    ],
)
def test_r3_calls_get_threads_of_their_own_in_the_servers_cpu_pool(document, cpu_workers):
    """R3 calls run on the pool that serves KV lookups: without threads of their own, an R3 store and fetch in
    flight would hold every thread and the KV lookups of every engine would wait behind them."""
    from lmcache_r3.config import parse_config
    from lmcache_r3.mp.server_process import settings_from_config

    argv = server_argv(settings_from_config(parse_config(document, "deploy.yaml")), program="lmcache")
    assert flag_value(argv, "--max-workers") == str(parse_config(document, "deploy.yaml").server.max_workers)
    if cpu_workers is None:
        assert "--max-cpu-workers" not in argv
    else:
        assert flag_value(argv, "--max-cpu-workers") == cpu_workers
