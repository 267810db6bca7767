"""Local service processes: start with telemetry off on loopback, wait for a real readiness probe, stop by pid.

A *managed process* is one child started by lmcache_r3 (an LMCache MP server, a Mooncake master, a vLLM engine
run). It gets its own process group, so stopping it by its pid also ends every process it started, and its
output goes to a log file that errors quote. Readiness is always a probe of the service itself (an RPC ping,
an HTTP health check), never a fixed sleep.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

#: Environment every process we start gets: no usage telemetry from LMCache or vLLM.
TELEMETRY_OFF: Mapping[str, str] = {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "VLLM_NO_USAGE_STATS": "1",
}

LOOPBACK = "127.0.0.1"


class ServiceStartError(RuntimeError):
    """A managed process exited or never became ready; the message ends with the tail of its log."""


class PortClashError(ServiceStartError):
    """A managed process exited because another process holds a port it was to listen on.

    Ports picked with :func:`free_port` are free when picked, not when the service binds them a moment later: any
    program on the host that binds port 0 in between (vLLM picks its ports that way) may get the same one. A caller
    that picked the ports starts again on new ones (:func:`start_on_fresh_ports`); one given fixed ports cannot.
    """

    def __init__(self, message: str, addresses: Sequence[tuple[str, int]]) -> None:
        super().__init__(message)
        self.addresses = tuple(addresses)
        """The ``(host, port)`` pairs found held by another process (all the service's own when none was found held
        but its log says its bind failed)."""


#: What ``strerror(EADDRINUSE)`` reads in a log: the bind of a service that exited failed.
ADDRESS_IN_USE = "Address already in use"

_Started = TypeVar("_Started")


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` so ``finally`` blocks run and the services this process started stop.

    Python's default SIGTERM action ends the process at once, which would leave its managed processes (each in
    a session of its own) running.
    """

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def service_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The current environment with telemetry off, plus ``extra``."""
    env = dict(os.environ)
    env.update(TELEMETRY_OFF)
    if extra:
        env.update(extra)
    return env


_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()

PORT_LANE_VAR = "LMCACHE_R3_PORT_LANE"
"""``"<index>/<count>"``: :func:`free_port` hands out only ports in lane ``index`` of ``count`` (:func:`in_lane`), so
processes that pick ports side by side on one host (one per lane: the test suite's parallel workers) never get one
another's."""


def port_lane(value: str | None) -> tuple[int, int]:
    """``(index, count)`` of a ``PORT_LANE_VAR`` value; ``(0, 1)`` (every port) when unset.

    Raises:
        ValueError: not ``<index>/<count>`` with ``0 <= index < count``.
    """
    if not value:
        return 0, 1
    index, _, count = value.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise ValueError(f"{PORT_LANE_VAR}={value!r}: expected <index>/<count> with 0 <= index < count, e.g. 0/2")
    return int(index), int(count)


def in_lane(port: int, index: int, count: int) -> bool:
    """Whether ``port`` is in lane ``index`` of ``count``: by ``port // 2``, as Linux hands ``bind`` to port 0 odd ports
    (it keeps even ones for ``connect``), so lanes by parity would leave all but one empty."""
    return (port // 2) % count == index


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it), never one handed out before here.

    A port is not handed out twice by one process: a client of a server that has gone (ZMQ reconnects forever) would
    otherwise talk to whatever server gets that port next, with requests meant for the old one. Processes given
    different lanes in ``LMCACHE_R3_PORT_LANE`` (see ``PORT_LANE_VAR``) never hand out the same port either.

    Raises:
        OSError: no such port after many tries (the ephemeral range is exhausted).
        ValueError: a malformed ``LMCACHE_R3_PORT_LANE``.
    """
    index, count = port_lane(os.environ.get(PORT_LANE_VAR))
    with _HANDED_OUT_LOCK:
        for _ in range(1000 * count):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((LOOPBACK, 0))
                port = sock.getsockname()[1]
            if in_lane(port, index, count) and port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    raise OSError(f"no free TCP port on {LOOPBACK} in lane {index}/{count} that this process has not handed out before")


def addresses_in_use(addresses: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """Those of ``addresses`` that a server could not listen on now: another socket listens there.

    The probe binds with ``SO_REUSEADDR``, as the servers we start do (ZMQ, asio, uvicorn), so an old connection's
    ``TIME_WAIT`` does not count; a listening socket does.
    """
    held = []
    for host, port in addresses:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                sock.listen(1)
            except OSError:
                held.append((host, port))
    return held


def start_on_fresh_ports(start: Callable[[], _Started], attempts: int = 3) -> _Started:
    """``start()``, called again while it fails with :class:`PortClashError`; it must pick new ports each call.

    Raises:
        PortClashError: every one of ``attempts`` calls clashed (the last one's error).
    """
    for _ in range(attempts - 1):
        try:
            return start()
        except PortClashError:
            pass
    return start()


def executable(name: str) -> str:
    """Path of a console script, preferring the one next to the running interpreter (the project venv).

    Raises:
        ServiceStartError: when the script is installed nowhere, naming the package that provides it.
    """
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        provider = _PROVIDERS.get(name, "the package that provides it")
        raise ServiceStartError(
            f"'{name}' is not installed in {Path(sys.executable).parent} or on PATH: it comes with {provider}; "
            "`make setup` installs it into .venv"
        )
    return found


_PROVIDERS = {
    "lmcache": "lmcache 0.5.6",
    "lmcache-r3": "lmcache_r3 itself (pip install -e .)",
    "mooncake_master": "mooncake-transfer-engine-non-cuda (the mooncake extra: EXTRAS=...,mooncake)",
    "mooncake_client": "mooncake-transfer-engine-non-cuda (the mooncake extra: EXTRAS=...,mooncake)",
}


class ManagedProcess:
    """One child process in its own process group, with its output in ``log_path``.

    Args:
        name: short name used in errors and log file names.
        argv: the command line.
        log_path: file that receives stdout and stderr.
        env: extra environment on top of :func:`service_env`.
        listens: the ``(host, port)`` pairs it is to listen on: when it exits before it is ready and another process
            holds one of them, readiness fails with :class:`PortClashError`.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        listens: Sequence[tuple[str, int]] = (),
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.listens = tuple(listens)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._stopped = False
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()  # the log may already hold what earlier tries of the service wrote
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=service_env(env),
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        """Whether the process runs (see :attr:`exit_code`, which leaves an exited process unreaped)."""
        return self.exit_code is None

    @property
    def exit_code(self) -> int | None:
        """The exit status as ``Popen.returncode`` gives it (``-N`` for signal N), or None while it runs.

        An exited process stays unreaped (a zombie) until :meth:`stop`: while it is, no new process can get its id,
        so :meth:`stop` can still signal its group without hitting someone else's.
        """
        if self.popen.returncode is not None:
            return self.popen.returncode
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped by a wait on ``self.popen`` elsewhere
            return self.popen.poll()
        if info is None:
            return None
        return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "<no log>"
        return data[-max_bytes:].decode(errors="replace")

    def own_output(self) -> str:
        """What this process wrote to its log (not what earlier processes wrote to the same file)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, probe: Callable[[], bool], timeout_s: float, what: str) -> float:
        """Poll ``probe`` until it returns True; returns the seconds it took.

        A probe that raises ``OSError`` or ``TimeoutError`` counts as "not yet".

        Raises:
            PortClashError: the process exited first, and another process holds a port it was to listen on.
            ServiceStartError: the process exited first, or ``timeout_s`` passed.
        """
        start = time.monotonic()
        delay = 0.02
        while True:
            if not self.alive():
                raise self._exit_error(what)
            try:
                if probe():
                    return time.monotonic() - start
            except (OSError, TimeoutError):
                pass
            if time.monotonic() - start > timeout_s:
                raise ServiceStartError(
                    f"{self.name} (pid {self.pid}) did not reach '{what}' within {timeout_s:.0f} s.\n"
                    f"command: {' '.join(self.argv)}\nlog {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def _exit_error(self, what: str) -> ServiceStartError:
        tail = self.log_tail()
        details = f"command: {' '.join(self.argv)}\nlog {self.log_path}:\n{tail}"
        exited = f"{self.name} (pid {self.pid}) exited with code {self.exit_code} before {what}"
        held = addresses_in_use(self.listens)
        if not held and not (self.listens and ADDRESS_IN_USE in self.own_output()):
            return ServiceStartError(f"{exited}.\n{details}")
        # its log may name the address when the holder let go of it before the probe
        clashed = held or self.listens
        named = ", ".join(f"{host}:{port}" for host, port in clashed)
        return PortClashError(
            f"{exited}: another process holds {named}, which it was to listen on; start it on other ports.\n{details}",
            clashed,
        )

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM the process, then SIGKILL its whole group if it does not exit in ``timeout_s``.

        Also ends any process the child left behind in its group, once: a later call must not signal a group that
        now bears the reused id. Returns the exit code.
        """
        if self._stopped:
            return self.popen.poll()
        self._stopped = True
        reaped_before = self.popen.returncode is not None
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout_s
            while self.alive() and time.monotonic() < deadline:  # waits without reaping (see alive)
                time.sleep(0.02)
        if not reaped_before:  # the leader, running or a zombie, still holds the group's id
            _kill_group(self.pid)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
