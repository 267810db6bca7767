"""A port taken by another process between the pick and the bind: the real services fail with a clash that names the
address, a caller that picked the ports starts them again on new ones, and ``lmcache-r3 server`` names the key."""

import subprocess

import pytest
import yaml

from lmcache_r3.launch import LOOPBACK, ManagedProcess, PortClashError, executable, free_port
from lmcache_r3.mp.server_process import ServerSettings, start_loopback_server, start_server
from tests.support.mooncake import MOONCAKE_ENV
from tests.support.processes import REGISTRY

pytestmark = pytest.mark.server


@pytest.mark.parametrize("which", ["port", "http_port"])
def test_an_lmcache_server_on_a_held_port_fails_with_a_clash_naming_it(tmp_path, held_port, which):
    ports = {"port": free_port(), "http_port": free_port(), which: held_port}
    with pytest.raises(PortClashError) as err:
        server = start_server(ServerSettings(**ports), tmp_path / "server.log", ready_timeout_s=60)
        server.stop()  # reached only if it started after all
    assert err.value.addresses == ((LOOPBACK, held_port),)
    assert f"another process holds 127.0.0.1:{held_port}" in str(err.value)


def test_a_server_on_free_ports_starts_again_on_new_ones_when_its_port_was_taken(tmp_path, held_port, monkeypatch):
    """The first pick is a port another process took in the meantime; the server still comes up, on new ports."""
    from lmcache_r3.mp import server_process

    picks = iter([held_port])
    monkeypatch.setattr(server_process, "free_port", lambda: next(picks, None) or free_port())
    server = start_loopback_server(tmp_path, chunk_size=64)
    REGISTRY.add(server.process)
    try:
        assert held_port not in (server.settings.port, server.settings.http_port)
        assert server.ping() and server.status()["is_healthy"]
        assert "Address already in use" in (tmp_path / f"lmcache-server-{held_port}.log").read_text()  # first try
    finally:
        server.stop()


def test_lmcache_r3_server_names_the_config_key_of_a_held_port(tmp_path, held_port):
    config = tmp_path / "lmcache_r3.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": free_port(), "http_port": held_port}}))
    result = subprocess.run([executable("lmcache-r3"), "server", "--config", str(config)], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.returncode == 1
    assert f"127.0.0.1:{held_port} (server.http_port) is in use by another process" in result.stderr
    assert f"set another server.http_port in {config}" in result.stderr


@pytest.mark.mooncake
def test_a_mooncake_master_on_a_held_port_fails_with_a_clash_though_its_log_says_nothing(tmp_path, held_port):
    argv = [executable("mooncake_master"), f"--rpc_address={LOOPBACK}", f"--rpc_port={held_port}",
            f"--metrics_host={LOOPBACK}", f"--metrics_port={free_port()}", "--logtostderr=1"]  # fmt: skip
    master = ManagedProcess("mooncake_master", argv, tmp_path / "master.log", env=MOONCAKE_ENV,
                            listens=((LOOPBACK, held_port),))  # fmt: skip
    try:
        with pytest.raises(PortClashError) as err:
            master.wait_ready(lambda: False, 30, "answering /health")
    finally:
        master.stop()
    assert err.value.addresses == ((LOOPBACK, held_port),)
