"""After a test session, no process it started is still running."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.processes import RUN_MARKER_VAR, processes_with_marker

REPO = Path(__file__).resolve().parents[2]


def test_marker_scan_finds_a_running_child_and_forgets_it_once_stopped():
    marker = uuid.uuid4().hex
    child = subprocess.Popen(["sleep", "60"], env={**os.environ, RUN_MARKER_VAR: marker})
    try:
        # Until the child has exec'd, /proc shows the forked parent's environment, without the marker.
        deadline = time.monotonic() + 5
        while child.pid not in processes_with_marker(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert child.pid in processes_with_marker(marker)
    finally:
        child.kill()
        child.wait()
    assert processes_with_marker(marker) == {}


@pytest.mark.server
@pytest.mark.mooncake
def test_a_session_using_every_service_fixture_leaves_nothing_running(tmp_path):
    marker = uuid.uuid4().hex
    env = {**os.environ, RUN_MARKER_VAR: marker}
    selection = [
        "tests/smoke/test_lmcache_server.py::test_server_listens_on_loopback_only_with_telemetry_off",
        "tests/smoke/test_mooncake.py::test_put_then_get_returns_the_same_mebibyte",
        "tests/smoke/test_harness.py::test_hybrid_config_puts_null_block_in_recurrent_block_tables",
    ]
    session = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert session.returncode == 0, session.stdout[-3000:] + session.stderr[-3000:]
    assert "3 passed" in session.stdout
    deadline = time.monotonic() + 5  # a killed process can take a moment to be reaped by init
    while (left := processes_with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == {}, f"processes left running after the session: {left}"


LEAKY_TESTS = """
import os, subprocess

def test_leaks_a_process():
    subprocess.Popen(["sleep", "300"])

def test_crashes_its_worker_after_starting_a_process():
    subprocess.Popen(["sleep", "301"])
    os._exit(1)

def test_starts_and_stops_a_process():
    subprocess.run(["true"], check=True)
"""


@pytest.mark.parametrize(
    ("selection", "fails"),
    [
        ("test_leaks_a_process", True),
        ("test_crashes_its_worker_after_starting_a_process", True),
        ("test_starts_and_stops_a_process", False),
    ],
)
def test_a_session_on_two_workers_fails_when_any_worker_leaves_a_process_running(tmp_path, selection, fails):
    """With pytest-xdist each worker marks what it starts with a marker of its own and reports what it left running
    to the controller, which fails the run; a worker that crashed reports nothing, and the controller finds its
    processes itself. Either way they are ended."""
    marker = uuid.uuid4().hex
    (tmp_path / "test_leaky.py").write_text(LEAKY_TESTS)
    session = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-n", "2",
         "-k", selection, str(tmp_path / "test_leaky.py")],
        cwd=REPO, env={**os.environ, RUN_MARKER_VAR: marker}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (session.returncode != 0) is fails, session.stdout[-3000:] + session.stderr[-3000:]
    assert ("process(es) started by this test session still run" in session.stdout + session.stderr) is fails
    assert processes_with_marker(marker, derived=True) == {}, "a worker's process outlived the session"
