"""Runs: consecutive full chunks of one request, concatenated into one byte string.

Chunks travel in groups: a store sends every newly full chunk of a request in one message, a fetch returns every
chunk of a hit in one response. A *run* is that group: the chunk objects for ``[token_start + i*C, token_start +
(i+1)*C)``, ``i = 0..n-1``, back to back. Every object of a run has the same size, ``encoded_nbytes(profile, C)``,
so a reader splits a run without parsing it, and a storage server can treat each slice as an opaque object.

Each object is exactly what :func:`~lmcache_r3.artifacts.codec.encode_chunk` writes and
:func:`~lmcache_r3.artifacts.codec.decode_chunk` accepts; a run only batches the work. Encoding copies each payload
once (into the run). Decoding compares each object's header with the one its position requires and keeps the
longest valid *prefix*: a chunk after a damaged one is useless to a prefix cache, so the caller shrinks its hit to
that prefix instead of failing the request.
"""

from __future__ import annotations

import struct

import msgspec
import numpy as np

from lmcache_r3.artifacts.codec import (
    _CHECKED_NBYTES,
    _HEADER_CHECKSUM,
    HEADER_NBYTES,
    R3Chunk,
    R3CodecError,
    _checked_header,
    _checksum,
    _contiguous_rows,
    _header,
    decode_chunk,
    encoded_nbytes,
)
from lmcache_r3.artifacts.profile import R3Profile

_PAYLOAD_CHECKSUM_AT = _CHECKED_NBYTES - _HEADER_CHECKSUM.size
_CHECKSUMS = struct.Struct("<QQ")
"""The payload checksum (the last field of the checked header), then the header checksum (the header's end)."""
assert _PAYLOAD_CHECKSUM_AT + _CHECKSUMS.size == HEADER_NBYTES


class RunDecode(msgspec.Struct, frozen=True):
    """The valid prefix of a decoded run and, when it stopped early, why."""

    chunks: list[R3Chunk]
    """Decoded chunks in position order; their rows are views of the run's bytes."""
    error: R3CodecError | None
    """The first refused object's error, or None when every object decoded."""

    @property
    def token_end(self) -> int | None:
        """Position after the last decoded row; None when no chunk decoded."""
        return self.chunks[-1].token_end if self.chunks else None


def encode_run(profile: R3Profile, token_start: int, rows: np.ndarray, chunk_size: int) -> bytes:
    """Encode ``rows`` at ``token_start`` as a run of ``len(rows) // chunk_size`` chunk objects.

    Args:
        profile: the row profile; ``rows`` must be in its dtype.
        token_start: position of ``rows[0]``, normally a multiple of ``chunk_size``.
        rows: ``[n * chunk_size, num_layers, top_k]`` (e.g. a request's rows read from the slot mirror).
        chunk_size: tokens per chunk object.

    Returns:
        The concatenated objects; ``n * encoded_nbytes(profile, chunk_size)`` bytes.

    Raises:
        TypeError, ValueError: ``len(rows)`` is not a positive multiple of ``chunk_size``, or as
            :func:`~lmcache_r3.artifacts.codec.encode_chunk`.
    """
    if type(chunk_size) is not int or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    rows = _contiguous_rows(profile, token_start, rows)
    if rows.shape[0] % chunk_size:
        raise ValueError(
            f"a run holds whole chunks: got {rows.shape[0]} rows, not a multiple of chunk_size={chunk_size}"
        )
    parts: list[bytes | np.ndarray] = []
    for offset in range(0, rows.shape[0], chunk_size):
        chunk = rows[offset : offset + chunk_size]
        parts += (_header(profile, token_start + offset, chunk), chunk)
    return b"".join(parts)


def decode_run(
    data: bytes | bytearray | memoryview, profile: R3Profile, token_start: int, chunk_size: int
) -> RunDecode:
    """Decode a run of chunks that must cover ``[token_start, token_start + n * chunk_size)`` in order.

    Args:
        data: the concatenated objects (e.g. a fetch response); may be empty.
        profile: the profile the reader needs.
        token_start: position the first object must start at.
        chunk_size: tokens per chunk object.

    Returns:
        The chunks up to the first object that fails any check of
        :func:`~lmcache_r3.artifacts.codec.decode_chunk` (size, range, profile, checksums), and that error.
    """
    object_nbytes = encoded_nbytes(profile, chunk_size)
    view = memoryview(data).cast("B")
    num_whole = len(view) // object_nbytes
    if num_whole == 0:
        return _refuse_from(view, [], profile, token_start, chunk_size)
    rows = np.ndarray(
        (num_whole, chunk_size, *profile.row_shape), profile.dtype, view, HEADER_NBYTES,
        (object_nbytes, profile.bytes_per_token, profile.top_k * profile.dtype.itemsize, profile.dtype.itemsize),
    )  # fmt: skip
    chunks: list[R3Chunk] = []
    for index in range(num_whole):
        # An object is valid when its header is, byte for byte, the one this position and profile require (its
        # payload checksum as stored), both checksums match, and so does the payload's.
        offset = index * object_nbytes
        start = token_start + index * chunk_size
        payload_checksum, header_checksum = _CHECKSUMS.unpack_from(view, offset + _PAYLOAD_CHECKSUM_AT)
        expected = _checked_header(profile, start, chunk_size, payload_checksum)
        if not (
            view[offset : offset + _CHECKED_NBYTES].tobytes() == expected
            and _checksum(expected) == header_checksum
            and _checksum(view[offset + HEADER_NBYTES : offset + object_nbytes]) == payload_checksum
        ):
            break
        chunks.append(R3Chunk(start, start + chunk_size, rows[index]))
    return _refuse_from(view, chunks, profile, token_start, chunk_size)


def _refuse_from(
    view: memoryview, chunks: list[R3Chunk], profile: R3Profile, token_start: int, chunk_size: int
) -> RunDecode:
    """Result for the prefix ``chunks``; the object after it (if any) is named by the single-object decoder."""
    object_nbytes = encoded_nbytes(profile, chunk_size)
    offset = len(chunks) * object_nbytes
    if offset == len(view):
        return RunDecode(chunks, None)
    start = token_start + len(chunks) * chunk_size
    try:
        decode_chunk(view[offset : offset + object_nbytes], profile, (start, start + chunk_size))
    except R3CodecError as error:
        return RunDecode(chunks, error)
    raise AssertionError(f"decode_run refused the object at byte {offset} that decode_chunk accepts")
