"""A connector shutdown that does not wait on an LMCache server that is gone.

LMCache 0.5.6's adapters wait on their server at shutdown: the worker for the answer to its UNREGISTER (up to
``mq_timeout``: 30 s in lmcache_r3's config, 300 s by LMCache's own default), each adapter up to 5 s for a heartbeat
ping still out. After the server died, every engine stop paid that, and vLLM's multiprocess executor kills a worker
that has not exited 5 s after it was told to (its shared-memory queues then stay in ``/dev/shm``).

So the connector first asks the server for a ping (:func:`server_answers`, at most :data:`PROBE_S`). A server that
answers is waited for as before. Otherwise LMCache's shutdown runs in a daemon thread that the caller waits for
at most :data:`DETACHED_JOIN_S` (:func:`run_shutdown`): it closes what it can at once, finishes by itself once its
own bounded waits end, or ends with the process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

PROBE_S = 1.0
"""How long a shutting-down connector waits for its LMCache server to answer a ping."""

DETACHED_JOIN_S = 0.5
"""How long the caller waits for LMCache's shutdown once the server did not answer (the rest runs detached)."""


def _pings(adapter: Any) -> list[Any]:
    """One ping future per server ``adapter`` talks to: a worker adapter's one server, asked with its instance id;
    each of a scheduler adapter's servers, untracked."""
    clients = getattr(adapter, "req_clients", None)
    if clients is not None:
        return [client.ping(None) for client in clients.values()]
    return [adapter.req_client.ping(adapter.instance_id)]


def server_answers(adapter: Any, timeout_s: float = PROBE_S) -> bool:
    """Whether every server behind the LMCache adapter ``adapter`` answers a ping within ``timeout_s`` (all asked at
    once); False at once when LMCache's heartbeat already found one unhealthy. Never raises."""
    if adapter is None or not adapter.is_healthy:
        return False
    try:
        pings = _pings(adapter)
        deadline = time.monotonic() + timeout_s
        return all(future.result(timeout=max(0.0, deadline - time.monotonic())) for future in pings)
    except TimeoutError:
        return False
    except Exception:
        logger.info("lmcache_r3: the shutdown ping failed", exc_info=True)
        return False


def run_shutdown(shutdown: Callable[[], None], server_answered: bool, what: str) -> None:
    """Run LMCache's ``shutdown`` of ``what`` (a role name, for the log): inline when the server answered; otherwise
    in a daemon thread waited for at most :data:`DETACHED_JOIN_S`."""
    if server_answered:
        shutdown()
        return

    def detached() -> None:
        try:
            shutdown()
        except Exception:
            logger.exception("lmcache_r3: LMCache's %s shutdown failed", what)

    thread = threading.Thread(target=detached, name=f"lmcache_r3-{what}-shutdown", daemon=True)
    thread.start()
    thread.join(DETACHED_JOIN_S)
    if thread.is_alive():
        logger.warning(
            "lmcache_r3: the LMCache server did not answer at %s shutdown; not waiting for it (LMCache's "
            "unregister and heartbeat waits go on in the background until their own bounds)",
            what,
        )
