"""Driving an L2 adapter's tasks in a test: caller-owned buffers, object keys, and waiting the way LMCache's
controllers do (on the task kind's event fd)."""

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


class CallerBuffer:
    """A stand-in for an L1 MemoryObj: ``byte_array`` is a view of caller-owned memory."""

    def __init__(self, data: bytes | bytearray) -> None:
        self.data = bytearray(data)

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self.data)


def object_key(i: int, model_name: str):
    """LMCache's ObjectKey for test object ``i`` (its chunk hash: ``i`` as 32 big-endian bytes, distinct for every
    ``i`` >= 0)."""
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=i.to_bytes(32, "big"), model_name=model_name, kv_rank=0, object_group_id=0)
