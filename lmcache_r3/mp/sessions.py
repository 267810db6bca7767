"""When a finished request's session on the LMCache server ends.

The LMCache MP server keeps a *session* per request id: the request's tokens and their rolling chunk hashes, which
every store of the request uses to name the objects it writes, and the record of its lookup's locks. LMCache
0.5.6's connector ends the session in ``request_finished``. The worker's last store of the request is sent on the
worker's own connection and served by another server thread, and it often arrives after that end: it creates the
session again, which then lives for the server's session TTL (10 minutes). Until then the server holds the request's
tokens and hashes, and a later request under the same id (vLLM without its request-id randomization, a test
harness, a client that reuses ids) would have its KV stored under the *old* tokens' chunk keys: wrong KV under a
key another prompt looks up.

:class:`SessionEnds` ends a finished request's session only once nothing of the request can reach the server any
more: the worker reported its stores finished (vLLM's ``finished_sending``, reported for every finished request
of a connector that stores, whose blocks it keeps until then), and a lookup still in flight at the finish has
answered and been released, and the server has answered that release. (The server runs a release and a session
end on different threads of its pool: an end that ran first would make the release find no lookup record, and the
locks would wait for the read-lock TTL, the recreated session for the session TTL.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

RELEASE_WAIT_S = 10.0
"""How long a finished request's session end waits for the server to answer the release of its lookup's locks."""


class SessionEnds:
    """Finished requests whose server session waits for their stores (and in-flight lookups), then ends.

    Example: ``finished("a")`` when vLLM finishes ``a``; ``stores_finished({"a"}, held=lambda r: False)`` when the
    worker reports ``a``'s stores done ends its session then; with ``held`` true for ``a`` (its lookup still out),
    the session ends at ``lookup_released("a")`` instead.
    """

    def __init__(self, end_session: Callable[[str], None]) -> None:
        self._end_session = end_session
        self._awaiting_stores: set[str] = set()
        """Finished requests whose stores may still reach the server."""
        self._awaiting_lookup: set[str] = set()
        """Finished requests whose stores are done but whose lookup, still in flight at the finish, is not released."""
        self._releases: dict[str, tuple[Sequence[Any], float]] = {}
        """Per finished request whose lookup's locks were released: the server's answers to come (futures with
        ``query()``), and until when the session end waits for them."""
        self._awaiting_release: set[str] = set()
        """Finished requests done with the server except for the answer to their release."""

    def finished(self, request_id: str) -> None:
        """vLLM finished the request (where LMCache 0.5.6 would end its session): wait for its stores."""
        self._awaiting_stores.add(request_id)

    def stores_finished(self, request_ids: Iterable[str], held: Callable[[str], bool]) -> None:
        """The worker reported these requests' stores finished; ``held(request_id)``: its lookup is still out."""
        for request_id in request_ids:
            if request_id not in self._awaiting_stores:
                continue
            self._awaiting_stores.discard(request_id)
            if held(request_id):
                self._awaiting_lookup.add(request_id)
            else:
                self._end(request_id)

    def lookup_released(self, request_id: str) -> None:
        """The in-flight lookup of a finished request answered and its locks were released."""
        if request_id in self._awaiting_lookup:
            self._awaiting_lookup.discard(request_id)
            self._end(request_id)

    def release_sent(self, request_id: str, answers: Sequence[Any], wait_s: float = RELEASE_WAIT_S) -> None:
        """A finished request's lookup locks were released; its session ends once ``answers`` (futures with
        ``query()``) are all done, or after ``wait_s`` (a dead server never answers)."""
        if answers:
            self._releases[request_id] = (answers, time.monotonic() + wait_s)

    def poll(self) -> None:
        """End the sessions whose releases the server has answered since (the connector calls this every step)."""
        for request_id in list(self._awaiting_release):
            self._awaiting_release.discard(request_id)
            self._end(request_id)

    def _end(self, request_id: str) -> None:
        release = self._releases.get(request_id)
        if release is not None:
            answers, deadline = release
            if not all(answer.query() for answer in answers) and time.monotonic() < deadline:
                self._awaiting_release.add(request_id)
                return
            del self._releases[request_id]
        self._end_session(request_id)

    def awaiting_server(self) -> bool:
        """Whether a session end waits for the server's answer to a release, which only :meth:`poll` notices."""
        return bool(self._awaiting_release)

    def pending(self) -> int:
        """Finished requests whose session has not ended yet."""
        return len(self._awaiting_stores) + len(self._awaiting_lookup) + len(self._awaiting_release)
