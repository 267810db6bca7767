"""The contract every tier inherits from ``TaskL2Adapter``, driven through a tier that keeps objects in a dict: real
LMCache memory objects and event fds; tasks that complete exactly once and signal even when the tier throws or
stalls; a watchdog that fails a stalled task, after which the task never writes into the caller's buffer or keeps a
lock; delete that skips locked keys and never raises; byte accounting, listing and listener replay."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator

from lmcache_r3.tiers.holds import BuffersGone
from lmcache_r3.tiers.task_adapter import COUNTERS, TaskL2Adapter, TierClearError, byte_view
from tests.support.l2_tasks import completed, object_key


class DictTier(TaskL2Adapter):
    """A tier over a dict. ``failing`` names operations that raise; while ``gate`` is clear, operations block; while
    ``copy_gate`` is clear, a copy into or out of the caller's buffer blocks halfway (under its hold); while
    ``publish_gate`` is clear, a put blocks between its copy and its publish (holding nothing)."""

    def __init__(self, task_timeout_s: float = 0.3, drain_s: float = 0.5) -> None:
        self.objects: dict[str, bytes] = {}
        self.failing: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.copy_gate = threading.Event()
        self.copy_gate.set()
        self.publish_gate = threading.Event()
        self.publish_gate.set()
        super().__init__(
            capacity_bytes=1 << 20,
            task_timeout_s=task_timeout_s,
            unhealthy_for_s=60.0,
            workers={"store": 1, "lookup": 1, "load": 1},
            thread_prefix="dict-l2",
            drain_s=drain_s,
        )
        self._start_watchdog()

    def _operation(self, name: str) -> None:
        if name in self.failing:
            raise RuntimeError(f"injected: {name} failed")
        self.gate.wait(10)

    def _name(self, key: ObjectKey) -> str:
        return f"{key.model_name}/{bytes(key.chunk_hash).hex()}"

    def _copy(self, into, data) -> None:
        half = len(data) // 2
        into[:half] = data[:half]
        self.copy_gate.wait(10)
        into[half:] = data[half:]

    def _put(self, task, keys, names, objects):
        buffers = self._buffers(task)
        for i, (name, obj) in enumerate(zip(names, objects, strict=True)):
            self._operation("put")
            view = byte_view(obj)
            data = bytearray(view.nbytes)
            try:
                with buffers.held():
                    self._copy(data, view)
            except BuffersGone:
                return
            self.publish_gate.wait(10)
            new = name not in self.objects
            self.objects[name] = bytes(data)
            yield i, view.nbytes, view.nbytes if new else 0

    def _find(self, task, keys, names):
        self._operation("find")
        return [i for i, name in enumerate(names) if name in self.objects]

    def _get(self, task, keys, names, objects):
        buffers = self._buffers(task)
        for i, (name, obj) in enumerate(zip(names, objects, strict=True)):
            self._operation("get")
            data = self.objects.get(name)
            if data is None:
                yield i, None
                continue
            view = byte_view(obj)
            if len(data) == view.nbytes:
                try:
                    with buffers.held():
                        self._copy(view, data)
                except BuffersGone:
                    return
                yield i, len(data)

    def _remove(self, names):
        self._operation("remove")
        for name in names:
            self.objects.pop(name, None)
        return names

    def _clear_tier(self):
        self._operation("clear")
        removed = len(self.objects)
        self.objects.clear()
        return removed


class CompletingDictTier(DictTier):
    """The same tier completing its operations itself, as the Mooncake tier does for small ones: each runs on a
    thread of the tier's own and hands its results to the adapter's completion, with no adapter worker involved."""

    def _later(self, done, operation, *args) -> bool:
        def results():
            yield from operation(*args)  # run on the tier's thread, inside the completion's own error handling

        threading.Thread(target=done, args=(results(),), name="dict-tier-own", daemon=True).start()
        return True

    def _put_then(self, task, keys, names, objects, done):
        return self._later(done, self._put, task, keys, names, objects)

    def _find_then(self, task, keys, names, done):
        return self._later(done, self._find, task, keys, names)

    def _get_then(self, task, keys, names, objects, done):
        return self._later(done, self._get, task, keys, names, objects)


def key(i: int) -> ObjectKey:
    return object_key(i, "tiny-moe")


@pytest.fixture
def memory():
    """``memory(payload)`` or ``memory(size=n)``: a real L1 memory object holding ``payload`` (or n zero bytes)."""
    allocator = TensorMemoryAllocator(torch.zeros(1 << 20, dtype=torch.uint8))
    allocated = []

    def allocate(payload: bytes | None = None, size: int = 0):
        obj = allocator.allocate(torch.Size([len(payload) if payload is not None else size]), torch.uint8)
        byte_view(obj)[:] = payload if payload is not None else bytes(size)
        allocated.append(obj)
        return obj

    yield allocate
    for obj in allocated:
        obj.ref_count_down()


@pytest.fixture(params=[DictTier, CompletingDictTier], ids=["on workers", "completed by the tier"])
def tier(request):
    """Every contract test runs twice: tasks on the adapter's workers, and tasks the tier completes itself."""
    adapter = request.param()
    yield adapter
    adapter.gate.set()
    adapter.close()
    if request.param is CompletingDictTier:
        assert not any(pool._threads for pool in adapter._pools.values()), "a task went to an adapter worker"


def store(tier, keys, objects):
    task = tier.submit_store_task(keys, objects)
    return completed(tier.get_store_event_fd(), lambda: tier.pop_completed_store_tasks().get(task))


def lookup(tier, keys):
    task = tier.submit_lookup_and_lock_task(keys, {})
    return completed(tier.get_lookup_and_lock_event_fd(), lambda: tier.query_lookup_and_lock_result(task))


def load(tier, keys, objects):
    task = tier.submit_load_task(keys, objects)
    return completed(tier.get_load_event_fd(), lambda: tier.query_load_result(task))


def test_store_lookup_and_load_serve_the_bytes_and_account_for_them(tier, memory):
    payloads = [os.urandom(64), os.urandom(128)]
    result = store(tier, [key(1), key(2)], [memory(p) for p in payloads])
    assert result.is_successful() and result.bytes_transferred() == 192
    assert tier.get_usage().total_bytes_used == 192
    assert lookup(tier, [key(1), key(3), key(2)]).popcount() == 2
    assert tier.report_status()["locked_keys"] == 2
    tier.submit_unlock([key(1), key(2)])
    into = [memory(size=64), memory(size=128)]
    assert load(tier, [key(1), key(2)], into).popcount() == 2
    assert [bytes(byte_view(obj)) for obj in into] == payloads
    status = tier.report_status()
    assert status["is_healthy"] and status["objects"] == 2 and status["locked_keys"] == 0
    assert status["pending_tasks"] == 0 and set(COUNTERS) <= set(status["counters"])
    counters = status["counters"]
    assert (counters["stored_objects"], counters["lookup_hits"], counters["lookup_misses"]) == (2, 2, 1)
    assert (counters["loaded_objects"], counters["load_failures"], counters["errors"]) == (2, 0, 0)


def test_when_a_lookup_answers_the_tier_holds_exactly_the_locks_it_reports(tier, memory, monkeypatch):
    """The misses' locks are gone before the answer is signalled: LMCache may read the answer and the tier's status
    (or evict) at once, and must never see a lock on a key the lookup reported missing."""
    assert store(tier, [key(1), key(2)], [memory(b"a" * 64), memory(b"b" * 64)]).is_successful()
    locked_when_signalled = []
    signal = tier._signal

    def watching(kind):
        if kind == "lookup":
            locked_when_signalled.append(tier.report_status()["locked_keys"])
        signal(kind)

    monkeypatch.setattr(tier, "_signal", watching)
    assert lookup(tier, [key(1), key(3), key(2), key(4)]).popcount() == 2
    assert locked_when_signalled == [2]
    tier.submit_unlock([key(1), key(2)])
    assert tier.report_status()["locked_keys"] == 0


def test_a_throwing_tier_still_completes_every_task_as_failed_and_nothing_raises(tier, memory):
    assert store(tier, [key(1)], [memory(b"x" * 64)]).is_successful()
    tier.failing |= {"put", "find", "get", "remove"}
    result = store(tier, [key(2)], [memory(b"y" * 64)])
    assert not result.is_successful()
    assert lookup(tier, [key(1)]).popcount() == 0
    into = memory(size=64)
    assert load(tier, [key(1)], [into]).popcount() == 0 and bytes(byte_view(into)) == bytes(64)
    tier.delete([key(1)])  # must not raise: a raising delete kills LMCache's eviction thread
    tier.submit_unlock([key(1), None])  # nor may an unlock, whatever it is given
    status = tier.report_status()
    assert status["counters"]["errors"] == 5 and status["locked_keys"] == 0
    assert status["counters"]["store_failures"] == 1 and status["counters"]["load_failures"] == 1
    assert status["objects"] == 1 and tier.get_usage().total_bytes_used == 64, "a failed delete changed the accounting"


def test_a_stalled_load_is_failed_by_the_watchdog_and_never_writes_into_the_buffer_later(tier, memory):
    payload = os.urandom(64)
    assert store(tier, [key(1)], [memory(payload)]).is_successful()
    tier.gate.clear()
    into = memory(size=64)
    began = time.monotonic()
    assert load(tier, [key(1)], [into]).popcount() == 0
    assert time.monotonic() - began < 2, "the watchdog let a stalled load run"
    status = tier.report_status()
    assert not status["is_healthy"] and status["counters"]["timeouts"] == 1 and status["pending_tasks"] == 0
    tier.gate.set()  # the stalled read returns now
    time.sleep(0.2)
    assert bytes(byte_view(into)) == bytes(64), "an abandoned load wrote into the caller's buffer"
    assert tier.query_load_result(1) is None, "an abandoned task completed twice"


def test_the_watchdog_never_fails_a_task_in_the_middle_of_a_copy_of_the_callers_buffer(tier, memory):
    """A failed task's buffers go back to LMCache, which may reuse them at once: so a copy into (or out of) them runs
    under a hold, and the watchdog fails the task only once no copy is under way, and then no further copy starts."""
    payload = os.urandom(64)
    assert store(tier, [key(1), key(2)], [memory(payload), memory(payload[::-1])]).is_successful()
    tier.copy_gate.clear()  # the load's first copy stops halfway, past the 0.3 s task timeout
    into = [memory(size=64), memory(size=64)]
    task = tier.submit_load_task([key(1), key(2)], into)
    time.sleep(1.0)
    status = tier.report_status()
    assert status["pending_tasks"] == 1 and status["counters"]["timeouts"] == 0, "a task failed mid-copy"
    tier.gate.clear()  # the next object's operation stalls: outside any copy, so the watchdog fails the task now
    tier.copy_gate.set()
    assert completed(tier.get_load_event_fd(), lambda: tier.query_load_result(task)).popcount() == 0
    assert tier.report_status()["counters"]["timeouts"] == 1
    assert bytes(byte_view(into[0])) == payload, "the copy under way when the task ran over was cut short"
    tier.gate.set()  # the stalled operation returns; the task was failed, so its second copy never starts
    time.sleep(0.2)
    assert bytes(byte_view(into[1])) == bytes(64), "a failed task copied into the caller's buffer"


def test_a_stalled_lookup_that_returns_late_keeps_no_lock(tier, memory):
    assert store(tier, [key(1)], [memory(b"z" * 32)]).is_successful()
    tier.gate.clear()
    assert lookup(tier, [key(1)]).popcount() == 0
    tier.gate.set()
    deadline = time.monotonic() + 2
    while tier.report_status()["counters"]["lookup_hits"] == 0:  # the late job finds the key, then lets it go
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert tier.report_status()["locked_keys"] == 0
    tier.delete([key(1)])
    assert key(1) not in [k for k, _ in tier._known.values()], "a key an abandoned lookup found stayed locked"


def test_delete_skips_a_locked_key_until_it_is_unlocked(tier, memory):
    assert store(tier, [key(1), key(2)], [memory(b"a" * 16), memory(b"b" * 16)]).is_successful()
    assert lookup(tier, [key(1)]).popcount() == 1
    tier.delete([key(1), key(2)])
    status = tier.report_status()
    assert status["counters"]["delete_skipped_locked"] == 1 and status["counters"]["deleted_objects"] == 1
    assert list(tier.objects) == [tier._name(key(1))] and tier.get_usage().total_bytes_used == 16
    tier.submit_unlock([key(1)])
    tier.delete([key(1)])
    assert not tier.objects and tier.get_usage().total_bytes_used == 0
    assert tier.report_status()["counters"]["deleted_objects"] == 2


def test_a_load_that_finds_a_known_object_gone_reports_it_deleted(tier, memory):
    assert store(tier, [key(1)], [memory(b"q" * 40)]).is_successful()
    tier.objects.clear()  # the tier lost it on its own
    assert load(tier, [key(1)], [memory(size=40)]).popcount() == 0
    status = tier.report_status()
    assert status["objects"] == 0 and status["counters"]["vanished_objects"] == 1
    assert tier.get_usage().total_bytes_used == 0


def test_keys_are_listed_in_pages_and_replayed_to_a_late_listener(tier, memory):
    keys = [key(i) for i in range(5)]
    assert store(tier, keys, [memory(bytes([i]) * (i + 1)) for i in range(5)]).is_successful()
    first = tier.list_l2_keys(page_size=3)
    assert len(first.entries) == 3 and first.next_page_token is not None
    rest = tier.list_l2_keys(page_size=3, cursor=first.next_page_token)
    assert len(rest.entries) == 2 and rest.next_page_token is None
    assert sum(entry.size_bytes for entry in first.entries + rest.entries) == 15

    class Recorder:
        def __init__(self) -> None:
            self.stored: list[tuple[ObjectKey, int]] = []

        def on_l2_keys_stored(self, keys, sizes) -> None:
            self.stored += list(zip(keys, sizes, strict=True))

    recorder = Recorder()
    tier.register_listener(recorder)
    assert sorted(recorder.stored, key=lambda pair: pair[1]) == [(keys[i], i + 1) for i in range(5)]


def test_close_fails_a_stuck_task_and_later_submits_complete_as_failed(memory):
    tier = DictTier(task_timeout_s=30.0, drain_s=0.2)
    tier.gate.clear()
    stuck = tier.submit_store_task([key(1)], [memory(b"s" * 8)])
    time.sleep(0.05)
    tier.close()
    assert not tier.pop_completed_store_tasks()[stuck].is_successful()
    late = tier.submit_load_task([key(1)], [memory(size=8)])
    assert tier.query_load_result(late).popcount() == 0
    assert not tier.report_status()["is_healthy"]
    tier.gate.set()


class AnsweringTwiceTier(DictTier):
    """A tier whose own completion hands over a lookup's results twice, or raises once it has locked the keys."""

    raise_after_start = False

    def _find_then(self, task, keys, names, done):
        if self.raise_after_start:
            raise RuntimeError("injected: the tier failed to start the lookup")
        found = list(self._find(task, keys, names))
        done(iter(found))
        done(iter(found))
        return True


@pytest.mark.parametrize("raise_after_start", [False, True], ids=["answered twice", "raised after locking"])
def test_a_tier_completing_a_lookup_itself_completes_it_once_and_keeps_only_the_reported_locks(
    memory, raise_after_start
):
    tier = AnsweringTwiceTier()
    try:
        assert store(tier, [key(1), key(2)], [memory(b"a" * 8), memory(b"b" * 8)]).is_successful()
        tier.raise_after_start = raise_after_start
        hits = lookup(tier, [key(1), key(3), key(2)])
        status = tier.report_status()
        if raise_after_start:
            assert hits.popcount() == 0 and status["locked_keys"] == 0 and status["counters"]["errors"] == 1
        else:
            assert hits.popcount() == 2 and status["locked_keys"] == 2
            assert (status["counters"]["lookup_hits"], status["counters"]["lookup_misses"]) == (2, 1)
            tier.submit_unlock([key(1), key(2)])
            assert tier.report_status()["locked_keys"] == 0
        assert status["pending_tasks"] == 0 and tier.query_lookup_and_lock_result(2) is None
    finally:
        tier.close()


# -- clear -----------------------------------------------------------------------------------------------------------
def test_a_clear_removes_every_object_forgets_every_key_and_reports_them_deleted(tier, memory):
    assert store(tier, [key(1), key(2)], [memory(b"a" * 40), memory(b"b" * 60)]).is_successful()
    tier.objects["elsewhere/00"] = b"stored by another server sharing the tier"
    reported: list = []

    class Listener:
        def on_l2_keys_stored(self, keys, sizes): ...

        def on_l2_keys_deleted(self, keys):
            reported.extend(keys)

        def on_l2_keys_accessed(self, keys): ...

    tier.register_listener(Listener())
    assert tier.clear_objects() == 3
    assert tier.objects == {} and sorted(k.chunk_hash for k in reported) == sorted(
        [key(1).chunk_hash, key(2).chunk_hash]
    )
    assert lookup(tier, [key(1), key(2)]).popcount() == 0
    status = tier.report_status()
    assert status["objects"] == 0 and status["counters"]["clears"] == 1 and status["counters"]["cleared_objects"] == 3
    assert tier.get_usage().total_bytes_used == 0


def test_a_store_stuck_in_a_copy_of_the_callers_buffer_fails_the_clear_and_nothing_is_removed(tier, memory):
    assert store(tier, [key(1)], [memory(b"k" * 64)]).is_successful()
    tier.copy_gate.clear()  # the next store's copy stops halfway: the watchdog leaves a task alone while it copies
    task = tier.submit_store_task([key(2)], [memory(b"s" * 64)])
    with pytest.raises(TierClearError, match=r"1 store task\(s\) still running after 0.3 s .*nothing was cleared"):
        tier.clear_objects()
    assert set(tier.objects) == {tier._name(key(1))}
    tier.copy_gate.set()
    assert completed(tier.get_store_event_fd(), lambda: tier.pop_completed_store_tasks().get(task)).is_successful()
    assert tier.clear_objects() == 2


def test_a_store_the_watchdog_failed_that_publishes_after_a_clear_removes_its_object_again(tier, memory):
    """A policy update's clear must leave nothing stored before it: a store that stalled past the task timeout
    (failed, so the clear does not wait for it) and publishes once the tier answers again is undone."""
    assert store(tier, [key(1)], [memory(b"o" * 32)]).is_successful()
    tier.publish_gate.clear()  # the next store copies its object, then stalls before publishing it
    assert not store(tier, [key(2)], [memory(b"n" * 32)]).is_successful()  # failed by the watchdog
    assert tier.report_status()["counters"]["timeouts"] == 1
    assert tier.clear_objects() == 1
    tier.publish_gate.set()  # the stalled store publishes now, after the clear
    deadline = time.monotonic() + 5
    while tier.report_status()["counters"]["voided_objects"] < 1:
        assert time.monotonic() < deadline, "the late store never reported back"
        time.sleep(0.01)
    assert tier.objects == {}, "an object stored before the clear is in the tier after it"
    assert lookup(tier, [key(2)]).popcount() == 0
    status = tier.report_status()
    assert status["objects"] == 0 and status["counters"]["stored_objects"] == 1
    assert tier.get_usage().total_bytes_used == 0
    assert store(tier, [key(2)], [memory(b"n" * 32)]).is_successful(), "a store after the clear is kept"
    assert set(tier.objects) == {tier._name(key(2))} and lookup(tier, [key(2)]).popcount() == 1


def test_a_tier_that_cannot_clear_says_so_and_keeps_its_keys(memory):
    class Plain(DictTier):
        _clear_tier = TaskL2Adapter._clear_tier

    plain = Plain()
    try:
        assert store(plain, [key(1)], [memory(b"p" * 8)]).is_successful()
        with pytest.raises(TierClearError, match="Plain cannot clear its objects"):
            plain.clear_objects()
        assert plain.report_status()["objects"] == 1 and lookup(plain, [key(1)]).popcount() == 1
    finally:
        plain.close()
