"""Per-step timers inside vLLM's engine processes, for ``bench_routed.py`` (active only when it sets the env var).

``bench_routed.py`` puts this directory on ``PYTHONPATH`` of the engines it starts and sets
``LMCACHE_R3_BENCH_PROBE_DIR``. Every process then wraps, as the modules are imported, ``EngineCore.step``,
``Scheduler.schedule`` / ``update_from_output``, ``GPUModelRunner.execute_model`` / ``_model_forward``, the
routers' capture call (lmcache_r3's capturer), both sides of lmcache_r3's connector and its routed-experts
bookkeeping with a timer, counts the tokens and idle steps ``schedule`` returns and the R3 calls the scheduler
sends, times each request's lookup from vLLM's first ask to the answer, and writes ``{name: [calls, total]}`` to
``<dir>/<role>-<on|off>-<pid>.json`` (at most twice a second, and at exit). ``on`` / ``off``: whether the
process's connector has routed experts on.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import time

PROBE_DIR = os.environ.get("LMCACHE_R3_BENCH_PROBE_DIR")
_totals: dict[str, list] = {}
_label: list[str] = []
_last_dump = [0.0]


def _dump(force: bool = False) -> None:
    now = time.monotonic()
    if not _label or (not force and now - _last_dump[0] < 0.5):
        return
    _last_dump[0] = now
    path = os.path.join(PROBE_DIR, f"{_label[0]}-{os.getpid()}.json")
    with open(path + ".tmp", "w") as out:
        json.dump(_totals, out)
    os.replace(path + ".tmp", path)


def _scheduler_label(core_or_scheduler) -> str:
    scheduler = getattr(core_or_scheduler, "scheduler", core_or_scheduler)
    connector = getattr(scheduler, "connector", None)
    return "core-" + ("on" if getattr(connector, "routed", None) is not None else "off")


def _worker_label(_runner) -> str:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return "worker-" + ("on" if getattr(get_kv_transfer_group(), "r3_capture", None) is not None else "off")


def _core_label(connector) -> str:
    return "core-" + ("on" if getattr(connector, "routed", None) is not None else "off")


def _routed(module) -> None:
    for method in ("on_schedule", "on_worker_output", "begin_lookup", "joint_hit_end"):
        _time(module.RoutedExpertsBook, method, f"routed.{method}", lambda _book: "core-on")


def _count(counter: str, calls: int, total: float) -> None:
    entry = _totals.setdefault(counter, [0, 0.0])
    entry[0] += calls
    entry[1] += total


def _time(cls, method: str, timer: str, label) -> None:
    original = getattr(cls, method)

    def timed(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            _count(timer, 1, time.perf_counter() - started)
            if not _label:
                _label.append(label(self))
            _dump()

    setattr(cls, method, timed)


def _engine_core(module) -> None:
    _time(module.EngineCore, "step", "engine_core.step", _scheduler_label)


def _count_scheduled(cls) -> None:
    """Count every ``schedule`` call's tokens (``scheduler.scheduled_tokens``: [steps, tokens]) and the steps that
    scheduled none (``scheduler.idle_steps``: [steps, steps]; requests waiting on LMCache lookups or loads)."""
    original = cls.schedule

    def counted(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        _count("scheduler.scheduled_tokens", 1, out.total_num_scheduled_tokens)
        if not out.total_num_scheduled_tokens:
            _count("scheduler.idle_steps", 1, 1.0)
        return out

    cls.schedule = counted


def _scheduler(module) -> None:
    _count_scheduled(module.Scheduler)
    _time(module.Scheduler, "schedule", "scheduler.schedule", _scheduler_label)
    _time(module.Scheduler, "update_from_output", "scheduler.update_from_output", _scheduler_label)


def _model_runner(module) -> None:
    _time(module.GPUModelRunner, "execute_model", "worker.execute_model", _worker_label)
    _time(module.GPUModelRunner, "_model_forward", "worker.model_forward", _worker_label)


def _connector(module) -> None:
    connector = module.LMCacheMPConnector
    original = connector.get_num_new_matched_tokens
    asked: dict[str, list] = {}  # per request looking up: [first ask, asks so far]

    def lookup(self, request, num_computed_tokens):
        """``lookup.seconds.chunked`` / ``.short``: [lookups, seconds from the first ask to the answer] of requests
        that span a full LMCache chunk past vLLM's own hit (only those fetch R3) and of the others;
        ``lookup.asks``: [lookups, asks] (vLLM asks every step until LMCache's asynchronous KV lookup has answered
        and, with routed experts on, the R3 fetch too); ``lookup.r3_late``: [asks, asks] at which LMCache's KV
        lookup had answered but the R3 fetch had not; ``lookup.phase.unacked`` / ``.status``: [asks, asks] made
        while the server had not acknowledged LMCache's LOOKUP yet / while LMCache's query of its result was out
        (read from LMCache 0.5.6's scheduler adapter). A request asked again after its lookup answered (vLLM could
        not allocate it) counts as a new lookup of one ask."""
        first = asked.setdefault(request.request_id, [time.perf_counter(), 0])
        first[1] += 1
        adapter = self.scheduler_adapter
        if request.request_id in getattr(adapter, "_unacked_lookups", ()):
            _count("lookup.phase.unacked", 1, 1)
        elif request.request_id in getattr(adapter, "_lookup_status", ()):
            _count("lookup.phase.status", 1, 1)
        result = original(self, request, num_computed_tokens)
        if request.request_id in getattr(self, "_awaiting_r3", ()):
            _count("lookup.r3_late", 1, 1)
        if result[0] is not None:
            del asked[request.request_id]
            _count("lookup.asks", 1, first[1])
            chunk = self.scheduler_adapter.lmcache_tokens_per_chunk
            spans = len(request.all_token_ids) // chunk > num_computed_tokens // chunk
            _count(f"lookup.seconds.{'chunked' if spans else 'short'}", 1, time.perf_counter() - first[0])
        return result

    connector.get_num_new_matched_tokens = lookup
    _time(connector, "get_num_new_matched_tokens", "connector.get_num_new_matched_tokens", _core_label)
    for method in ("build_connector_meta", "update_connector_output", "update_state_after_alloc", "request_finished"):
        _time(connector, method, f"connector.{method}", _core_label)
    for method in ("start_load_kv", "wait_for_save", "build_connector_worker_meta", "_collect_routed_experts"):
        _time(connector, method, f"connector.{method}", _worker_label)


def _r3_client(module) -> None:
    """``r3.store_many`` / ``r3.fetch_many``: [calls, requests in them] the scheduler sent to the LMCache server."""
    for method in ("store_many", "fetch_many"):
        original = getattr(module.R3Client, method)

        def counted(self, items, _original=original, _counter=f"r3.{method}"):
            _count(_counter, 1, len(items))
            return _original(self, items)

        setattr(module.R3Client, method, counted)


def _capture(module) -> None:
    build = module._capturer_class

    @functools.cache
    def build_timed():  # the capturer class is built on first use
        capturer = build()
        _time(capturer, "capture", "capturer.capture", _worker_label)
        return capturer

    module._capturer_class = build_timed


def _kv_transfer(module) -> None:
    """LMCache's KV copies on the CPU: synchronous on the worker, each with round trips to the LMCache server."""
    for method in ("submit_store", "submit_retrieve"):
        _time(module.EngineDrivenTransferContext, method, f"kv.{method}", _worker_label)


_PATCHES = {
    "lmcache.v1.multiprocess.transfer_context.worker_transfer": _kv_transfer,
    "lmcache_r3.mp.capture": _capture,
    "lmcache_r3.mp.connector": _connector,
    "lmcache_r3.mp.r3_client": _r3_client,
    "lmcache_r3.mp.routed": _routed,
    "vllm.v1.engine.core": _engine_core,
    "vllm.v1.core.sched.scheduler": _scheduler,
    "vllm.v1.worker.gpu_model_runner": _model_runner,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if PROBE_DIR:
    sys.meta_path.insert(0, _PatchOnImport())
    atexit.register(_dump, True)
