"""Managed processes: telemetry off, clear errors quoting the log, stop by pid ends the whole group."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcache_r3.launch import (
    LOOPBACK,
    PORT_LANE_VAR,
    TELEMETRY_OFF,
    ManagedProcess,
    PortClashError,
    ServiceStartError,
    addresses_in_use,
    free_port,
    in_lane,
    port_lane,
    service_env,
    start_on_fresh_ports,
)
from tests.support.processes import RUN_MARKER_VAR, processes_with_marker


def test_service_env_switches_telemetry_off_whatever_the_caller_had(monkeypatch):
    monkeypatch.setenv("LMCACHE_TRACK_USAGE", "true")
    monkeypatch.delenv("DO_NOT_TRACK", raising=False)
    env = service_env({"EXTRA": "1"})
    for key, value in TELEMETRY_OFF.items():
        assert env[key] == value
    assert env["EXTRA"] == "1"


def test_free_port_can_be_bound_on_loopback():
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_free_port_never_hands_out_a_port_twice():
    """A client of a stopped server reconnects to its port for ever; the next server must not get that port (the OS
    alone repeats one among 500 picks almost surely: about 28k ephemeral ports)."""
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


@pytest.mark.parametrize("lane", ["0/2", "1/2", "2/3"])
def test_free_port_hands_out_only_ports_of_its_lane(monkeypatch, lane):
    """Two processes picking ports at once on one host, in different lanes, never get the same port."""
    monkeypatch.setenv(PORT_LANE_VAR, lane)
    index, count = (int(part) for part in lane.split("/"))
    ports = [free_port() for _ in range(50)]
    assert all(in_lane(port, index, count) for port in ports) and len(set(ports)) == len(ports)


@pytest.mark.parametrize(
    ("value", "lane"),
    [(None, (0, 1)), ("", (0, 1)), ("0/1", (0, 1)), ("3/4", (3, 4))],
    ids=["unset", "empty", "one", "4"],
)
def test_port_lane_reads_index_and_count(value, lane):
    assert port_lane(value) == lane


@pytest.mark.parametrize("value", ["2/2", "1", "a/2", "-1/2", "1/0", "1/2/3"])
def test_a_malformed_port_lane_is_refused_naming_the_variable_and_the_form(value):
    with pytest.raises(ValueError, match=f"{PORT_LANE_VAR}=.*<index>/<count>"):
        port_lane(value)


def listener(port: int) -> list[str]:
    """A service that listens on ``port`` on loopback (with SO_REUSEADDR, as servers do) and waits."""
    script = (
        "import socket, time\n"
        "s = socket.socket()\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('127.0.0.1', {port}))\n"
        "s.listen(1)\n"
        "print('listening', flush=True)\n"
        "time.sleep(60)\n"
    )
    return [sys.executable, "-c", script]


def start_listener(port: int, log_path: Path) -> ManagedProcess:
    proc = ManagedProcess("listener", listener(port), log_path, listens=((LOOPBACK, port),))
    try:
        proc.wait_ready(lambda: "listening" in proc.log_tail(), timeout_s=30, what="listening")
    except BaseException:
        proc.stop()
        raise
    return proc


def test_addresses_in_use_are_those_another_socket_listens_on(held_port):
    free = free_port()
    assert addresses_in_use([(LOOPBACK, held_port), (LOOPBACK, free)]) == [(LOOPBACK, held_port)]


def test_a_service_that_cannot_bind_a_held_port_fails_with_a_clash_naming_the_address(tmp_path, held_port):
    with pytest.raises(PortClashError) as err:
        start_listener(held_port, tmp_path / "l.log")
    assert err.value.addresses == ((LOOPBACK, held_port),)
    assert f"another process holds 127.0.0.1:{held_port}, which it was to listen on" in str(err.value)
    assert "Address already in use" in str(err.value)  # its log, quoted


def test_a_service_that_exits_for_another_reason_is_no_port_clash(tmp_path):
    proc = ManagedProcess("failing", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "f.log",
                          listens=((LOOPBACK, free_port()),))  # fmt: skip
    with pytest.raises(ServiceStartError) as err:
        proc.wait_ready(lambda: False, timeout_s=30, what="ready")
    assert not isinstance(err.value, PortClashError)
    assert "exited with code 3" in str(err.value)


def test_a_bind_failure_in_the_log_is_a_clash_even_when_the_port_is_free_again(tmp_path):
    """The process that took the port may have let go of it by the time the service has exited."""
    port = free_port()
    script = f"print('bind 127.0.0.1:{port}: [Errno 98] Address already in use'); raise SystemExit(1)"
    proc = ManagedProcess("loser", [sys.executable, "-c", script], tmp_path / "f.log", listens=((LOOPBACK, port),))
    with pytest.raises(PortClashError) as err:
        proc.wait_ready(lambda: False, timeout_s=30, what="ready")
    assert err.value.addresses == ((LOOPBACK, port),)


def test_a_bind_failure_an_earlier_try_logged_to_the_same_file_is_no_clash_of_this_one(tmp_path):
    log = tmp_path / "f.log"
    log.write_text("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:1')\n")  # the earlier try
    proc = ManagedProcess("failing", [sys.executable, "-c", "raise SystemExit(3)"], log,
                          listens=((LOOPBACK, free_port()),))  # fmt: skip
    with pytest.raises(ServiceStartError) as err:
        proc.wait_ready(lambda: False, timeout_s=30, what="ready")
    assert not isinstance(err.value, PortClashError)


def test_start_on_fresh_ports_starts_again_on_new_ports_after_a_clash(tmp_path, held_port):
    ports = iter([held_port, free_port()])
    tried = []

    def start():
        tried.append(next(ports))
        return start_listener(tried[-1], tmp_path / f"l-{len(tried)}.log")

    proc = start_on_fresh_ports(start)
    try:
        assert tried[0] == held_port and proc.listens == ((LOOPBACK, tried[1]),) and proc.alive()
    finally:
        proc.stop()


def test_start_on_fresh_ports_gives_up_after_its_attempts_with_the_clash(tmp_path, held_port):
    tried = []

    def start():
        tried.append(held_port)
        return start_listener(held_port, tmp_path / f"l-{len(tried)}.log")

    with pytest.raises(PortClashError):
        start_on_fresh_ports(start, attempts=2)
    assert len(tried) == 2


def test_start_on_fresh_ports_does_not_retry_other_start_errors(tmp_path):
    tried = []

    def start():
        tried.append(1)
        proc = ManagedProcess("failing", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "f.log")
        return proc.wait_ready(lambda: False, timeout_s=30, what="ready")

    with pytest.raises(ServiceStartError, match="exited with code 3"):
        start_on_fresh_ports(start)
    assert tried == [1]


def test_process_that_exits_early_fails_readiness_with_its_log(tmp_path):
    proc = ManagedProcess(
        "failing", [sys.executable, "-c", "print('bad flag --foo'); raise SystemExit(3)"], tmp_path / "f.log"
    )
    with pytest.raises(ServiceStartError) as err:
        proc.wait_ready(lambda: False, timeout_s=30, what="ready")
    message = str(err.value)
    assert "exited with code 3" in message
    assert "bad flag --foo" in message


def test_readiness_timeout_names_the_probe_and_stops_waiting(tmp_path):
    proc = ManagedProcess("sleeper", ["sleep", "30"], tmp_path / "s.log")
    try:
        started = time.monotonic()
        with pytest.raises(ServiceStartError, match="did not reach 'port open' within 1 s"):
            proc.wait_ready(lambda: False, timeout_s=1, what="port open")
        assert time.monotonic() - started < 10
    finally:
        proc.stop()


def test_stop_by_pid_also_ends_grandchildren_that_ignore_sigterm(tmp_path):
    marker = os.urandom(8).hex()
    script = (
        "import subprocess, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen(['sleep', '60'])\n"
        "time.sleep(60)\n"
    )
    proc = ManagedProcess("stubborn", [sys.executable, "-c", script], tmp_path / "p.log", env={RUN_MARKER_VAR: marker})
    proc.wait_ready(lambda: len(processes_with_marker(marker)) == 2, timeout_s=20, what="child started")
    proc.stop(timeout_s=1)
    assert not proc.alive()
    deadline = time.monotonic() + 5
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with_marker(marker) == {}


def test_a_second_stop_never_signals_the_group_again(tmp_path, monkeypatch):
    # Once the group is gone its id may be reused by an unrelated process group: only the first stop may signal it.
    from lmcache_r3 import launch

    proc = ManagedProcess("short", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "p.log")
    assert proc.stop(timeout_s=1) is not None and not proc.alive()
    signalled = []
    monkeypatch.setattr(launch.os, "killpg", lambda *args: signalled.append(args))
    monkeypatch.setattr(launch.os, "kill", lambda *args: signalled.append(args))
    proc.stop(timeout_s=1)
    assert signalled == [], "a stopped process's group was signalled again"


def test_sigterm_to_a_launcher_still_stops_the_services_it_started(tmp_path):
    marker = os.urandom(8).hex()
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from lmcache_r3.launch import ManagedProcess, exit_on_sigterm\n"
        "exit_on_sigterm()\n"
        f"proc = ManagedProcess('svc', ['sleep', '60'], Path({str(tmp_path)!r}) / 'svc.log')\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "finally:\n"
        "    proc.stop()\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, env={**os.environ, RUN_MARKER_VAR: marker}, text=True
    )
    try:
        assert launcher.stdout.readline().strip() == "ready"
        assert len(processes_with_marker(marker)) == 2  # the launcher and its service
        launcher.terminate()
        assert launcher.wait(timeout=30) == 128 + 15
    finally:
        launcher.kill()
    assert processes_with_marker(marker) == {}


def test_a_process_that_died_on_its_own_keeps_its_id_until_stop_signals_its_group(tmp_path):
    """A service that exits by itself is not reaped while a readiness check or a log section looks at it: its pid
    stays taken (a zombie), so stop() may still signal its group, which cannot yet be someone else's."""
    proc = ManagedProcess("short", [sys.executable, "-c", "raise SystemExit(7)"], tmp_path / "p.log")
    deadline = time.monotonic() + 30
    while proc.alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not proc.alive() and proc.exit_code == 7
    state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state == "Z", "the exited leader was reaped before stop(): its id could be handed to another process"
    assert proc.stop(timeout_s=5) == 7
    assert proc.popen.returncode == 7  # reaped now


def test_exit_code_names_the_signal_that_ended_the_process(tmp_path):
    proc = ManagedProcess("sleeper", ["sleep", "30"], tmp_path / "s.log")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(ServiceStartError, match=r"exited with code -9 before ready"):
            proc.wait_ready(lambda: False, timeout_s=30, what="ready")
    finally:
        assert proc.stop(timeout_s=5) == -9


@pytest.mark.parametrize(
    ("name", "provider"),
    [
        ("mooncake_master", "mooncake-transfer-engine-non-cuda (the mooncake extra"),
        ("lmcache-r3", "lmcache_r3 itself (pip install -e .)"),
        ("lmcache", "lmcache 0.5.6"),
    ],
)
def test_a_missing_program_is_named_with_the_package_that_provides_it(monkeypatch, tmp_path, name, provider):
    from lmcache_r3 import launch

    monkeypatch.setattr(launch.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(launch.shutil, "which", lambda _: None)
    expected = rf"'{name}' is not installed in .*: it comes with {re.escape(provider)}"
    with pytest.raises(ServiceStartError, match=expected):
        launch.executable(name)
