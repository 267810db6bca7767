"""Every process a test session starts carries a run marker in its environment, so the session can prove at
the end that none of them is still running (children of children included), and can quote their logs when a
test fails."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lmcache_r3.launch import ManagedProcess

RUN_MARKER_VAR = "LMCACHE_R3_TEST_RUN"


def ensure_run_marker() -> str:
    """The marker of this test run; set in ``os.environ`` so every child inherits it."""
    if not os.environ.get(RUN_MARKER_VAR):
        os.environ[RUN_MARKER_VAR] = uuid.uuid4().hex
    return os.environ[RUN_MARKER_VAR]


def processes_with_marker(marker: str, exclude: set[int] | None = None, derived: bool = False) -> dict[int, str]:
    """Live (non-zombie) processes whose environment holds ``RUN_MARKER_VAR=marker``, as {pid: command line}; with
    ``derived``, those that hold a marker made from it instead (``marker-gw0``: a pytest-xdist worker's)."""
    needle = f"{RUN_MARKER_VAR}={marker}".encode()
    skip = {os.getpid()} | (exclude or set())
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            variables = (entry / "environ").read_bytes().split(b"\0")
            if not any(v.startswith(needle + b"-") if derived else v == needle for v in variables):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state in ("Z", "X"):
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        found[int(entry.name)] = cmdline.strip()
    return found


@contextmanager
def paused(pid: int, at_most_s: float = 15.0) -> Iterator[None]:
    """The process ``pid`` stopped (SIGSTOP) inside the block, so whatever it was asked stays unanswered there; it
    resumes at the end, or after ``at_most_s`` if the block takes longer, so a failing test never leaves it stopped."""
    os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(at_most_s, os.kill, (pid, signal.SIGCONT))
    resume.start()
    try:
        yield
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ProcessRegistry:
    """The managed processes started in this session, newest last, for failure reports."""

    def __init__(self) -> None:
        self.started: list[ManagedProcess] = []

    def add(self, process: ManagedProcess) -> ManagedProcess:
        self.started.append(process)
        return process

    def log_sections(self, since: int = 0, max_bytes: int = 3000) -> list[tuple[str, str]]:
        sections = []
        for process in self.started[since:]:
            state = "running" if process.alive() else f"exited {process.exit_code}"
            title = f"log of {process.name} (pid {process.pid}, {state}) {process.log_path}"
            sections.append((title, process.log_tail(max_bytes)))
        return sections


REGISTRY = ProcessRegistry()
