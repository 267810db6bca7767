"""The LMCache MP server fixture: loopback only, telemetry off, ready on a real probe, stopped by pid."""

import os
from pathlib import Path

import pytest

from tests.support.processes import processes_with_marker

pytestmark = pytest.mark.server


def listening_addresses(pid: int) -> set[str]:
    """Local addresses of the TCP sockets ``pid`` listens on (from /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A = LISTEN
                addresses.add(local.split(":")[0])
    return addresses


def test_server_listens_on_loopback_only_with_telemetry_off(lmcache_server):
    environ = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{lmcache_server.pid}/environ").read_text().split("\0")
        if "=" in item
    )
    assert environ["LMCACHE_TRACK_USAGE"] == "false"
    assert environ["DO_NOT_TRACK"] == "1"
    assert environ["VLLM_NO_USAGE_STATS"] == "1"
    addresses = listening_addresses(lmcache_server.pid)
    assert addresses, "server listens on nothing"
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc writes them
    assert addresses <= loopback, f"server listens beyond loopback: {addresses}"


def test_stopping_a_server_by_pid_ends_it_and_frees_its_ports(lmcache_server_factory):
    from tests.support.processes import RUN_MARKER_VAR

    server = lmcache_server_factory(chunk_size=32)
    assert server.ping()
    pid = server.pid
    server.stop()
    assert pid not in processes_with_marker(os.environ[RUN_MARKER_VAR])
    with pytest.raises(OSError):
        server.status(timeout_s=1.0)
