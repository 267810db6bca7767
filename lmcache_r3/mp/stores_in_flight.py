"""When a finished request's blocks may be freed: once every store of it has read them.

LMCache 0.5.6's worker adapter (``vllm_multi_process_adapter.py``, ``get_finished``) keeps one store future per
request, a later store replacing an earlier one's, and remembers a request as done storing once *any* store of it
completed (its ``finished_stores`` keeps the request when another store of it is submitted). A request that
finishes while its last store is still on its way to the server is then reported in ``finished_sending`` at once:
vLLM frees its blocks and hands them to other requests, and the server copies whatever those blocks hold by the
time it serves the store, under the finished request's chunk keys; the store also opens the request's server
session again after it ended.

:class:`StoresInFlight` keeps every store future of every request the worker submitted and holds back a request
LMCache reports as finished sending until each of its stores has answered (or the server is unhealthy: LMCache has
failed its stores then; or ``hold_max_s`` passed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)

HOLD_MAX_S = 60.0
"""Longest a finished request is held back for its stores: LMCache's own ``get_finished`` waits as long for a
store's result."""


class StoresInFlight:
    """Per request, the stores not yet answered; which finished requests are done with their blocks.

    Example: ``submitted("a", f1)``, ``submitted("a", f2)``; while ``f2`` is out, ``finished_sending({"a"}, True)``
    is empty and ``a`` is held; once ``f2.query()`` is true, ``finished_sending(set(), True) == {"a"}``.
    """

    def __init__(self, hold_max_s: float = HOLD_MAX_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_max_s = hold_max_s
        self._clock = clock
        self._futures: dict[str, list[Any]] = {}
        """Per request, its store futures (``query()`` true once answered) not yet seen answered."""
        self._held: dict[str, float] = {}
        """Requests reported finished sending while a store of theirs was out, with when they were first held."""

    def submitted(self, request_id: str, future: Any) -> None:
        """The worker submitted a store of ``request_id``, answered through ``future``."""
        self._futures.setdefault(request_id, []).append(future)

    def finished_sending(self, reported: Iterable[str], healthy: bool) -> set[str]:
        """The requests done with their blocks: of ``reported`` (LMCache's ``finished_sending`` of this poll) and
        those held back before, each whose stores have all answered; the others are held back. With ``healthy``
        false (LMCache has failed every store in flight), or once a request was held ``hold_max_s``, it goes too."""
        self._forget_answered()
        now = self._clock()
        done: set[str] = set()
        for request_id in set(reported) | set(self._held):
            since = self._held.setdefault(request_id, now)
            out = len(self._futures.get(request_id, ()))
            if out and healthy and now - since < self.hold_max_s:
                continue
            if out:
                logger.warning(
                    "lmcache_r3: request %s finished with %d store(s) unanswered after %.1f s%s; its blocks are "
                    "freed now", request_id, out, now - since, "" if healthy else " (the LMCache server is unhealthy)",
                )  # fmt: skip
            del self._held[request_id]
            self._futures.pop(request_id, None)
            done.add(request_id)
        return done

    def held(self) -> set[str]:
        """Finished requests waiting for their stores."""
        return set(self._held)

    def storing(self) -> set[str]:
        """Requests with a store not seen answered (as of the last :meth:`finished_sending`)."""
        return set(self._futures)

    def _forget_answered(self) -> None:
        for request_id, futures in list(self._futures.items()):
            left = [future for future in futures if not future.query()]
            if left:
                self._futures[request_id] = left
            else:
                del self._futures[request_id]
