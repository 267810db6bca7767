"""Wire format between the connector and the R3 server module: one msgspec Struct per request and response.

Every call travels inside LMCache's own ``server_module_call`` envelope (method name + opaque bytes), encoded
with msgpack. A request addresses *chunks* the way LMCache addresses KV: the token sequence, a chunk-aligned
token range ``[start, end)``, the model name the KV is stored under, and the cache salt. The server hashes the
tokens with its own token hasher and chunk size, so an R3 object and the KV object of the same tokens share
one chunk hash.
"""

from __future__ import annotations

import msgspec

from lmcache_r3.artifacts import R3Profile

#: Method names registered by :mod:`lmcache_r3.mp.server_module`.
METHOD_STORE = "lmcache_r3.store"
METHOD_STORE_MANY = "lmcache_r3.store_many"
METHOD_LOOKUP = "lmcache_r3.lookup"
METHOD_FETCH = "lmcache_r3.fetch"
METHOD_FETCH_MANY = "lmcache_r3.fetch_many"
METHOD_DELETE = "lmcache_r3.delete"
METHOD_INFO = "lmcache_r3.info"
METHOD_CLEAR = "lmcache_r3.clear"


class ProfileSpec(msgspec.Struct, frozen=True):
    """The model shape R3 rows have; the server refuses objects of any other shape."""

    num_layers: int
    top_k: int
    num_experts: int

    def to_profile(self) -> R3Profile:
        return R3Profile(num_layers=self.num_layers, top_k=self.top_k, num_experts=self.num_experts)

    @classmethod
    def of(cls, profile: R3Profile) -> ProfileSpec:
        return cls(num_layers=profile.num_layers, top_k=profile.top_k, num_experts=profile.num_experts)


class ChunkRange(msgspec.Struct, frozen=True):
    """The chunks of ``token_ids[start:end]`` under ``model_name`` and ``cache_salt``.

    ``start`` is a multiple of the server's chunk size; chunks are the complete ones in ``[start, end)`` (a
    partial last chunk is never addressed, exactly as for KV).
    """

    model_name: str
    """The model name the KV of these tokens is stored under (the server adds the R3 namespace)."""
    token_ids: list[int]
    start: int
    end: int
    cache_salt: str = ""


class StoreRequest(msgspec.Struct, frozen=True):
    """Store one R3 object per chunk of ``range``; ``objects`` is their concatenation (``encode_run``)."""

    range: ChunkRange
    profile: ProfileSpec
    objects: bytes


class StoreItem(msgspec.Struct, frozen=True):
    """One request's part of a :class:`StoreManyRequest`: the R3 objects of the full chunks of ``range``."""

    range: ChunkRange
    objects: bytes


class StoreManyRequest(msgspec.Struct, frozen=True):
    """Several stores in one call: the connector publishes every request's newly complete chunks of a step at once.

    The server checks every item before storing any: one malformed item refuses the whole call.
    """

    profile: ProfileSpec
    items: list[StoreItem]


class StoreResponse(msgspec.Struct, frozen=True):
    num_chunks: int
    """Chunks the request addressed."""
    num_stored: int
    """Chunks newly written."""
    num_present: int
    """Chunks this call did not write: LMCache's L1 refused to reserve them, because they were already stored (first
    writer wins; the bytes are identical by construction), are being written by another call, or L1 had no room. The
    last is not told apart: a later lookup of such a chunk finds no R3 and its hit stops there (recomputed)."""


class StoreManyResponse(msgspec.Struct, frozen=True):
    results: list[StoreResponse]
    """One per item, in order (a chunk two items share is stored once and counted by the first)."""


class LookupRequest(msgspec.Struct, frozen=True):
    """How many leading chunks of ``range`` have a valid R3 object of ``profile``."""

    range: ChunkRange
    profile: ProfileSpec


class LookupResponse(msgspec.Struct, frozen=True):
    num_hit_chunks: int
    """Leading chunks present, counted from ``range.start``."""


class FetchRequest(msgspec.Struct, frozen=True):
    """Return the leading present chunks of ``range``."""

    range: ChunkRange
    profile: ProfileSpec


class FetchResponse(msgspec.Struct, frozen=True):
    num_hit_chunks: int
    """Leading chunks returned, counted from ``range.start``; each was verified by the server."""
    objects: bytes
    """Their R3 objects, concatenated in chunk order (``decode_run`` reads them)."""


class FetchManyRequest(msgspec.Struct, frozen=True):
    """Several fetches in one call: the connector fetches the R3 of every request it looked up in an engine step."""

    profile: ProfileSpec
    ranges: list[ChunkRange]


class FetchManyResponse(msgspec.Struct, frozen=True):
    results: list[FetchResponse]
    """One per range, in order."""


class DeleteRequest(msgspec.Struct, frozen=True):
    """Drop the R3 objects of ``range`` from L1 (KV objects of the same tokens are untouched)."""

    range: ChunkRange


class DeleteResponse(msgspec.Struct, frozen=True):
    num_deleted: int
    num_locked: int
    """Objects that were in use by a reader and therefore kept."""


class InfoResponse(msgspec.Struct, frozen=True):
    chunk_size: int
    namespace: str
    format_version: int


class TierCleared(msgspec.Struct, frozen=True):
    """What a clear did to one L2 tier of the server."""

    index: int
    """The tier's position among the server's L2 adapters (configuration order)."""
    type: str
    """The adapter's class, e.g. ``ShmL2Adapter``."""
    removed: int
    """Objects removed from the tier (by every server sharing it), -1 when it could not be cleared."""
    error: str = ""
    """Why the tier was not (or not wholly) cleared; empty when it was."""


class ClearResponse(msgspec.Struct, frozen=True):
    """The answer to a clear: L1 was cleared (every object not in use), then each tier, in order."""

    tiers: list[TierCleared]
    l1_kept: int = 0
    """L1 objects the clear left because they were in use (read-locked by a lookup or a retrieve, or still being
    written): they may be from before the clear."""

    @property
    def failures(self) -> list[TierCleared]:
        """The tiers that still may hold objects from before the clear."""
        return [tier for tier in self.tiers if tier.error]


def encode(message: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(message)


def decode(payload: bytes, kind: type[msgspec.Struct]):
    return msgspec.msgpack.decode(payload, type=kind)
