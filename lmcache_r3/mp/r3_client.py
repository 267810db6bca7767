"""Client of the R3 server module, for the connector (and tests, benchmarks, tools).

Every call is sent at once and returns an :class:`R3Call`; ``result()`` waits at most the client's bound
(``timeout_s``), so a dead or stuck server costs the caller a bounded wait and a clear error, never a hang.
Calls travel through LMCache's own ``RequestClient`` (``server_module_call``), on the server's request port.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Generic, Self, TypeVar

import msgspec

from lmcache_r3.artifacts import R3Profile
from lmcache_r3.mp import protocol

T = TypeVar("T", bound=msgspec.Struct)

StoreSpec = tuple[Sequence[int], int, bytes, int | None, str]
"""``(token_ids, start, objects, end, cache_salt)``: one store of :meth:`R3Client.store_many`."""
FetchSpec = tuple[Sequence[int], int, int | None, str]
"""``(token_ids, start, end, cache_salt)``: one fetch of :meth:`R3Client.fetch_many`."""


class R3ClientError(RuntimeError):
    """The server answered with an error (the message is the server's reason)."""


class R3TimeoutError(TimeoutError):
    """No answer within the client's bound; treat the call as failed (an R3 miss)."""


class R3Call(Generic[T]):
    """One call in flight; :meth:`result` returns the decoded response or raises.

    The response is decoded once: the requests of one ``fetch_many`` each read their result from the same call.
    """

    def __init__(self, method: str, future: Any, response_type: type[T], deadline: float) -> None:
        self.method = method
        self._future = future
        self._response_type = response_type
        self._deadline = deadline
        self._decoded: T | None = None

    def pending(self) -> bool:
        """Not answered yet, and its deadline not passed (then :meth:`result` would wait)."""
        return not self._future.query() and time.monotonic() < self._deadline

    def result(self, timeout: float | None = None) -> T:
        """Wait for the answer, at most until the call's deadline (and at most ``timeout`` if given).

        Raises:
            R3TimeoutError: no answer in time.
            R3ClientError: the server refused the request; the message says why.
        """
        if self._decoded is not None:
            return self._decoded
        remaining = max(0.0, self._deadline - time.monotonic())
        if timeout is not None:
            remaining = min(remaining, timeout)
        if not self._future.wait(remaining):
            raise R3TimeoutError(f"{self.method}: no answer from the LMCache server within the bound")
        try:
            response = self._future.result(0)
        except Exception as err:  # e.g. zmq.Again: the queue to a dead server is full
            raise R3ClientError(f"{self.method}: the request could not be sent to the LMCache server ({err})") from err
        if not response.success:
            raise R3ClientError(f"{self.method} refused by the server: {response.error}")
        self._decoded = protocol.decode(response.payload, self._response_type)
        return self._decoded


class ServerModuleClient:
    """Calls to lmcache_r3's server module on one LMCache MP server, each bounded by ``timeout_s``.

    Args:
        server_url: the server's request endpoint, e.g. ``tcp://127.0.0.1:5555``.
        timeout_s: bound on every call.
    """

    def __init__(self, server_url: str, timeout_s: float = 5.0) -> None:
        import zmq
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.server_url = server_url
        self.timeout_s = timeout_s
        self._context = zmq.Context()
        # Unsent requests to a dead server are dropped on close instead of blocking the context's termination.
        self._context.setsockopt(zmq.LINGER, 0)
        # LMCache sends every client's requests from one polling thread per process, its own KV traffic's too. A send
        # that found the queue to a dead server full (the high-water mark) would block that thread for good; this one
        # fails its call at once instead (an error the caller answers with recomputation).
        self._context.setsockopt(zmq.SNDTIMEO, 0)
        self._client = RequestClientFactory.create(server_url, context=self._context)

    def _call(
        self, method: str, message: msgspec.Struct | None, response_type: type[T], timeout_s: float | None = None
    ) -> R3Call[T]:
        from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest

        payload = protocol.encode(message) if message is not None else b""
        future = self._client.server_module_call(ServerModuleCallRequest(method=method, payload=payload))
        bound = self.timeout_s if timeout_s is None else timeout_s
        return R3Call(method, future, response_type, time.monotonic() + bound)

    def info(self, timeout_s: float | None = None) -> R3Call[protocol.InfoResponse]:
        return self._call(protocol.METHOD_INFO, None, protocol.InfoResponse, timeout_s)

    def clear(self, timeout_s: float = 60.0) -> R3Call[protocol.ClearResponse]:
        """Clear the server's L1, then every lmcache_r3 tier below it: all their objects, KV and R3 of every model,
        also those other servers sharing a tier stored (see ``R3ServerModule.clear``). Bounded by ``timeout_s``:
        a tier waits for the stores in flight when the clear began."""
        return self._call(protocol.METHOD_CLEAR, None, protocol.ClearResponse, timeout_s)

    def close(self) -> None:
        self._client.close()
        self._context.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class R3Client(ServerModuleClient):
    """R3 store / lookup / fetch / delete against one LMCache MP server with the R3 module loaded.

    Args:
        server_url: the server's request endpoint, e.g. ``tcp://127.0.0.1:5555``.
        model_name: the model name the KV of these requests is stored under.
        profile: the row profile of the model.
        timeout_s: bound on every call.
    """

    def __init__(self, server_url: str, model_name: str, profile: R3Profile, timeout_s: float = 5.0) -> None:
        super().__init__(server_url, timeout_s)
        self.model_name = model_name
        self.profile = profile
        self._profile_spec = protocol.ProfileSpec.of(profile)

    def _range(self, token_ids: Sequence[int], start: int, end: int | None, cache_salt: str) -> protocol.ChunkRange:
        tokens = token_ids if type(token_ids) is list else list(token_ids)  # msgspec encodes a list as it is
        return protocol.ChunkRange(
            model_name=self.model_name,
            token_ids=tokens,
            start=start,
            end=len(tokens) if end is None else end,
            cache_salt=cache_salt,
        )

    def store(
        self, token_ids: Sequence[int], start: int, objects: bytes, end: int | None = None, cache_salt: str = ""
    ) -> R3Call[protocol.StoreResponse]:
        """Store the R3 objects (an ``encode_run``) of the full chunks of ``token_ids[start:end]``."""
        request = protocol.StoreRequest(self._range(token_ids, start, end, cache_salt), self._profile_spec, objects)
        return self._call(protocol.METHOD_STORE, request, protocol.StoreResponse)

    def store_many(self, items: Sequence[StoreSpec]) -> R3Call[protocol.StoreManyResponse]:
        """Several :meth:`store` calls in one round trip (e.g. every request's new chunks of an engine step).

        Args:
            items: ``(token_ids, start, objects, end, cache_salt)`` per store, as :meth:`store` takes them.
        """
        request = protocol.StoreManyRequest(
            self._profile_spec,
            [
                protocol.StoreItem(self._range(tokens, start, end, salt), objects)
                for tokens, start, objects, end, salt in items
            ],
        )
        return self._call(protocol.METHOD_STORE_MANY, request, protocol.StoreManyResponse)

    def lookup(
        self, token_ids: Sequence[int], start: int = 0, end: int | None = None, cache_salt: str = ""
    ) -> R3Call[protocol.LookupResponse]:
        """How many leading chunks of ``token_ids[start:end]`` have a valid R3 object."""
        request = protocol.LookupRequest(self._range(token_ids, start, end, cache_salt), self._profile_spec)
        return self._call(protocol.METHOD_LOOKUP, request, protocol.LookupResponse)

    def fetch(
        self, token_ids: Sequence[int], start: int = 0, end: int | None = None, cache_salt: str = ""
    ) -> R3Call[protocol.FetchResponse]:
        """The verified R3 objects of the leading present chunks of ``token_ids[start:end]``."""
        request = protocol.FetchRequest(self._range(token_ids, start, end, cache_salt), self._profile_spec)
        return self._call(protocol.METHOD_FETCH, request, protocol.FetchResponse)

    def fetch_many(self, items: Sequence[FetchSpec]) -> R3Call[protocol.FetchManyResponse]:
        """Several :meth:`fetch` calls in one round trip; the response has one result per item, in order."""
        ranges = [self._range(tokens, start, end, salt) for tokens, start, end, salt in items]
        return self._call(protocol.METHOD_FETCH_MANY, protocol.FetchManyRequest(self._profile_spec, ranges),
                          protocol.FetchManyResponse)  # fmt: skip

    def delete(
        self, token_ids: Sequence[int], start: int = 0, end: int | None = None, cache_salt: str = ""
    ) -> R3Call[protocol.DeleteResponse]:
        """Drop the R3 objects of these chunks from L1; their KV objects stay."""
        request = protocol.DeleteRequest(self._range(token_ids, start, end, cache_salt))
        return self._call(protocol.METHOD_DELETE, request, protocol.DeleteResponse)


def joint_hit_tokens(kv_hit_tokens: int, r3_hit_chunks: int, chunk_size: int, start: int = 0) -> int:
    """Tokens for which both KV and R3 are present: the shorter of the two leading hits.

    Args:
        kv_hit_tokens: leading tokens whose KV LMCache holds (a multiple of ``chunk_size``).
        r3_hit_chunks: leading chunks with a valid R3 object, counted from ``start``.
        chunk_size: the server's chunk size.
        start: chunk-aligned token where the R3 count begins (chunks before it are known to be present).

    Returns:
        ``min(kv_hit_tokens, start + r3_hit_chunks * chunk_size)``, never negative. E.g. KV for 1024 tokens
        and R3 for 2 chunks of 256 from 0 give 512: only those tokens can be served with their routing.
    """
    return max(0, min(kv_hit_tokens, start + r3_hit_chunks * chunk_size))
