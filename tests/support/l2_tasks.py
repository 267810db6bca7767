"""Waiting for an L2 adapter's task the way LMCache's controllers do: on the task kind's event fd."""

from __future__ import annotations

import os
import select
import time


def completed(fd: int, query, timeout_s: float = 5.0):
    """Wait on a task's event fd (draining it, as LMCache's controllers do) until ``query()`` has its result."""
    deadline = time.monotonic() + timeout_s
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while (result := query()) is None:
        remaining = deadline - time.monotonic()
        assert remaining > 0, "a task never completed"
        if poller.poll(int(remaining * 1000)):
            os.read(fd, 8)
    return result
