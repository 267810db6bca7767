"""Runs: many chunks in one byte string, encoded like single chunks; decoding keeps the longest valid prefix."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_r3.artifacts import (
    HeaderChecksumError,
    PayloadChecksumError,
    PayloadLengthError,
    ProfileMismatchError,
    R3CodecError,
    R3Profile,
    TokenRangeError,
    TruncatedHeaderError,
    UnsupportedVersionError,
    decode_chunk,
    decode_run,
    encode_chunk,
    encode_run,
    encoded_nbytes,
)
from tests.unit.test_artifacts_codec import with_field

PROFILE = R3Profile(6, 4, 300)  # uint16 ids
CHUNK = 16
OBJECT = encoded_nbytes(PROFILE, CHUNK)


def request_rows(num_tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, PROFILE.num_experts, (num_tokens, *PROFILE.row_shape)).astype(PROFILE.dtype)


ROWS = request_rows(4 * CHUNK)
RUN = encode_run(PROFILE, 2 * CHUNK, ROWS, CHUNK)


def test_a_run_is_the_concatenation_of_single_chunk_objects():
    singles = [encode_chunk(PROFILE, 2 * CHUNK + i, ROWS[i : i + CHUNK]) for i in range(0, 4 * CHUNK, CHUNK)]

    assert RUN == b"".join(singles)
    assert len(RUN) == 4 * OBJECT


def test_every_chunk_of_a_run_decodes_to_its_rows_and_range():
    decoded = decode_run(RUN, PROFILE, 2 * CHUNK, CHUNK)

    assert decoded.error is None
    assert [(c.token_start, c.token_end) for c in decoded.chunks] == [(32, 48), (48, 64), (64, 80), (80, 96)]
    np.testing.assert_array_equal(np.concatenate([c.rows for c in decoded.chunks]), ROWS)
    assert decoded.token_end == 96


def test_an_empty_run_decodes_to_no_chunks_and_no_error():
    assert decode_run(b"", PROFILE, 0, CHUNK) == decode_run(bytearray(), PROFILE, 0, CHUNK)
    assert decode_run(b"", PROFILE, 0, CHUNK).chunks == []
    assert decode_run(b"", PROFILE, 0, CHUNK).token_end is None


def flipped(data: bytes, byte: int) -> bytes:
    edited = bytearray(data)
    edited[byte] ^= 0x04
    return bytes(edited)


@pytest.mark.parametrize(
    ("data", "kept", "error"),
    [
        (flipped(RUN, 2 * OBJECT + 500), 2, PayloadChecksumError),
        (flipped(RUN, 1 * OBJECT + 40), 1, HeaderChecksumError),
        (flipped(RUN, 1 * OBJECT + 66), 1, HeaderChecksumError),
        (flipped(RUN, 2 * OBJECT + 58), 2, HeaderChecksumError),
        (RUN[:OBJECT] + bytes(with_field(RUN[OBJECT : 2 * OBJECT], 21, "<B", 1)) + RUN[2 * OBJECT :], 1,
         UnsupportedVersionError),
        (flipped(RUN, 0 * OBJECT + 100), 0, PayloadChecksumError),
        (RUN[: 3 * OBJECT + 10], 3, TruncatedHeaderError),
        (RUN[:-1], 3, PayloadLengthError),
        (RUN + RUN[:OBJECT], 4, TokenRangeError),
        (RUN[OBJECT:], 0, TokenRangeError),
        (RUN[:OBJECT] + encode_run(R3Profile(6, 4, 301), 48, ROWS[:CHUNK], CHUNK), 1, ProfileMismatchError),
    ],
    ids=["payload-of-3rd", "header-of-2nd", "stored-header-checksum-of-2nd", "stored-payload-checksum-of-3rd",
         "reserved-bytes-of-2nd",
         "payload-of-1st", "cut-in-4th-header", "cut-in-last-payload",
         "extra-chunk-for-another-range", "first-chunk-missing", "other-profile-2nd"],
)  # fmt: skip
def test_a_bad_object_keeps_the_chunks_before_it_and_names_its_error(data, kept, error):
    decoded = decode_run(data, PROFILE, 2 * CHUNK, CHUNK)

    assert len(decoded.chunks) == kept
    assert isinstance(decoded.error, error)
    np.testing.assert_array_equal(
        np.concatenate([c.rows for c in decoded.chunks]) if kept else ROWS[:0], ROWS[: kept * CHUNK]
    )


@pytest.mark.parametrize(("num_rows", "chunk_size"), [(17, 16), (0, 16), (16, 0)])
def test_encode_run_refuses_rows_that_are_not_whole_chunks(num_rows, chunk_size):
    with pytest.raises(ValueError, match="chunk"):
        encode_run(PROFILE, 0, request_rows(num_rows), chunk_size)


@settings(max_examples=200, deadline=None)
@given(
    num_chunks=st.integers(1, 5),
    start_chunk=st.integers(0, 100),
    cut=st.integers(0, 5 * OBJECT),
    flips=st.lists(st.integers(0, 5 * OBJECT - 1), max_size=3),
)
def test_decode_run_agrees_with_decoding_each_object_alone(num_chunks, start_chunk, cut, flips):
    rows = request_rows(num_chunks * CHUNK, seed=num_chunks)
    data = bytearray(encode_run(PROFILE, start_chunk * CHUNK, rows, CHUNK))
    for byte in flips:
        if byte < len(data):
            data[byte] ^= 0x01
    data = bytes(data[:cut])

    decoded = decode_run(data, PROFILE, start_chunk * CHUNK, CHUNK)

    expected_kept = 0
    for index in range(num_chunks):
        obj = data[index * OBJECT : (index + 1) * OBJECT]
        start = (start_chunk + index) * CHUNK
        try:
            decode_chunk(obj, PROFILE, (start, start + CHUNK))
        except R3CodecError:
            break
        expected_kept += 1
    assert len(decoded.chunks) == expected_kept
    assert (decoded.error is None) == (expected_kept * OBJECT == len(data))
    for index, chunk in enumerate(decoded.chunks):
        np.testing.assert_array_equal(chunk.rows, rows[index * CHUNK : (index + 1) * CHUNK])
