"""LMCACHE_CONFIG_FILE: every kind of bad file gives its own message naming the key and what is allowed."""

from pathlib import Path

import pytest

from lmcache_r3.config import Config, ConfigError, load_config, parse_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lmcache_r3.yaml"


def test_example_file_loads_with_every_section():
    config = load_config(EXAMPLE)
    assert config.server.port == 5555
    assert config.server.chunk_size == 256
    assert config.tiers == [{"type": "shm", "root": "/dev/shm/lmcache_r3", "capacity_bytes": 4 << 30}]
    assert config.r3.enabled and config.r3.namespace == "##r3"
    assert config.server_url == "tcp://127.0.0.1:5555"


def test_no_file_anywhere_means_defaults(monkeypatch):
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    assert load_config() == Config()


def test_path_comes_from_the_environment_variable(monkeypatch, tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("server: {port: 6000, http_port: 6001}\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(file))
    assert load_config().server.port == 6000


@pytest.mark.parametrize(
    ("document", "message"),
    [
        pytest.param(
            {"server": {"chunk_sze": 64}}, "server.chunk_sze: unknown key; allowed here: host, port", id="typo"
        ),
        pytest.param({"srever": {}}, "srever: unknown key; allowed here: server, tiers, r3, connector", id="section"),
        pytest.param({"server": {"port": "high"}}, "server.port: expected an integer, got `str`", id="type"),
        pytest.param({"server": {"port": 70000}}, "server.port: expected an integer <= 65535", id="range"),
        pytest.param({"server": {"chunk_size": 0}}, "server.chunk_size: expected an integer >= 32", id="chunk"),
        pytest.param({"server": {"port": 9000, "http_port": 9000}}, "port and http_port are both 9000", id="ports"),
        pytest.param(
            {"server": {"eviction_policy": "FIFO"}}, "server.eviction_policy: Invalid enum value 'FIFO'", id="enum"
        ),
        pytest.param({"r3": {"enabled": "yes"}}, "r3.enabled: expected true or false", id="bool"),
        pytest.param({"r3": {"namespace": "a/b"}}, "namespace 'a/b' must be non-empty", id="namespace"),
        pytest.param({"tiers": [{"base_path": "/x"}]}, "tiers[0] has no 'type'", id="tier-type"),
        pytest.param({"connector": {"server_url": "localhost"}}, "must look like tcp://127.0.0.1:5555", id="url"),
        pytest.param({"connector": {"server_url": "tcp://h:99999"}}, "(a port in 1..65535)", id="url-port"),
        pytest.param({"connector": {"server_url": "tcp://h:0"}}, "(a port in 1..65535)", id="url-port-0"),
        pytest.param({"server": {"host": "::1"}}, "host '::1' is an IPv6 address", id="ipv6-host"),
        pytest.param({"server": {"l1_size_gb": float("inf")}}, "l1_size_gb must be a finite size", id="infinite-l1"),
        pytest.param({"connector": {"r3_timeout_s": 0}}, "connector.r3_timeout_s: expected a number > 0", id="timeout"),
        pytest.param({"r3": {"tier_timeout_s": -1}}, "r3.tier_timeout_s: expected a number > 0", id="tier-timeout"),
        pytest.param(
            {"connector": {"mq_timeout_s": float("inf")}},
            "connector.mq_timeout_s: expected a number <= 86400",
            id="infinite-timeout",
        ),
        pytest.param(
            {"r3": {"tier_timeout_s": 6}, "connector": {"r3_timeout_s": 5}},
            "r3.tier_timeout_s (6.0) must be below connector.r3_timeout_s (5.0)",
            id="tier-timeout-past-the-connectors",
        ),
        pytest.param([1, 2], "the top level must be a mapping, got list", id="top-level"),
        pytest.param({"server": {"http_host": "::"}}, "http_host '::' is an IPv6 address", id="ipv6-http-host"),
        pytest.param({"server": {"http_host": ""}}, "http_host is empty", id="empty-http-host"),
        pytest.param(
            {"server": {"extra_args": ["--port", "6000"]}},
            "extra_args: '--port' sets what the port key sets; use the key",
            id="extra-port",
        ),
        pytest.param(
            {"server": {"extra_args": ["--chunk-size=128"]}},
            "'--chunk-size=128' sets what the chunk_size key sets",
            id="extra-flag-equals-value",
        ),
        pytest.param(
            {"server": {"extra_args": ["--chunk", "128"]}}, "'--chunk' sets what the chunk_size key sets", id="abbrev"
        ),
        pytest.param(
            {"server": {"extra_args": ["--transport", "grpc"]}},
            "'--transport' sets what the connector.server_url (only tcp:// is served) key sets",
            id="extra-transport",
        ),
        pytest.param(
            {"server": {"extra_args": ["--http-host", "0.0.0.0"]}}, "what the http_host key sets", id="extra-http-host"
        ),
        pytest.param(
            {"server": {"extra_args": ["--max-cpu-workers", "8"]}},
            "'--max-cpu-workers' sets what the max_workers and r3.workers key sets",
            id="extra-cpu-workers",
        ),
        pytest.param({"r3": {"workers": -1}}, "r3.workers", id="negative-r3-workers"),
        pytest.param(
            {"server": {"extra_args": ["--separate-object-groups=true"]}},
            "'--separate-object-groups=true': --separate-object-groups takes no value",
            id="separate-groups-with-a-value",
        ),
        pytest.param(
            {"server": {"extra_args": ["--separate"]}},
            "'--separate' abbreviates --separate-object-groups; spell the flag out",
            id="abbreviated-separate-groups",
        ),
    ],
)
def test_bad_documents_are_refused_with_the_key_and_the_rule(document, message):
    with pytest.raises(ConfigError) as err:
        parse_config(document, "deploy.yaml")
    assert "lmcache_r3 config deploy.yaml: " in str(err.value)
    assert message in str(err.value)


def test_unreadable_file_names_the_variable_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it .* set LMCACHE_CONFIG_FILE or --config"):
        load_config(tmp_path / "missing.yaml")


def test_invalid_yaml_is_reported_as_yaml(tmp_path):
    file = tmp_path / "bad.yaml"
    file.write_text("server: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid yaml"):
        load_config(file)


def test_connector_reads_the_file_named_in_its_extra_config_before_the_environment(monkeypatch, tmp_path):
    from lmcache_r3.config import load_connector_config

    engine_file = tmp_path / "engine.yaml"
    engine_file.write_text("server: {port: 7000, http_port: 7001}\n")
    env_file = tmp_path / "env.yaml"
    env_file.write_text("server: {port: 8000, http_port: 8001}\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(env_file))
    assert load_connector_config({"lmcache_r3.config_file": str(engine_file)}).server.port == 7000
    assert load_connector_config({}).server.port == 8000


def test_stock_connector_entries_come_from_the_file_and_explicit_entries_win():
    from lmcache_r3.config import stock_connector_extra_config

    config = parse_config(
        {"server": {"port": 6100, "http_port": 6101}, "connector": {"mq_timeout_s": 12, "save_decode_cache": True}}
    )
    assert stock_connector_extra_config(config) == {
        "lmcache.mp.host": "tcp://127.0.0.1",
        "lmcache.mp.port": 6100,
        "lmcache.mp.mq_timeout": 12.0,
        "lmcache.mp.save_decode_cache": True,
    }
    remote = parse_config({"connector": {"server_url": "tcp://10.1.2.3:6200"}})
    entries = stock_connector_extra_config(remote, {"lmcache.mp.mq_timeout": 3})
    assert entries["lmcache.mp.host"] == "tcp://10.1.2.3" and entries["lmcache.mp.port"] == 6200
    assert entries["lmcache.mp.mq_timeout"] == 3


@pytest.mark.parametrize(
    ("extra_args", "separate"),
    [
        ([], False),
        (["--separate-object-groups"], True),
        (["--no-separate-object-groups"], False),
        (["--separate-object-groups", "--no-separate-object-groups"], False),  # argparse keeps the last
        (["--no-separate-object-groups", "--session-ttl-seconds", "60", "--separate-object-groups"], True),
    ],
)
def test_the_connector_reads_separate_object_groups_as_the_server_parses_it(extra_args, separate):
    config = parse_config({"server": {"extra_args": extra_args}}, "deploy.yaml")
    assert config.server.separate_groups is separate


def test_flags_the_keys_do_not_set_pass_through():
    args = [
        "--session-ttl-seconds",
        "60",
        "--hash-algorithm",
        "blake3",
        "--enable",
        "--null-block-id=0",
        "--server-module",
        '{"module_path": "my.module"}',
    ]  # another module next to R3's
    assert parse_config({"server": {"extra_args": args}}).server.extra_args == args
