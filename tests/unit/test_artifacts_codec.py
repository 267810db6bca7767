"""Chunk codec: rows round-trip bit-exact; every kind of bad object gets its own error and never other rows."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_r3.artifacts import (
    HEADER_NBYTES,
    BadMagicError,
    HeaderChecksumError,
    HeaderSizeError,
    PayloadChecksumError,
    PayloadLengthError,
    ProfileMismatchError,
    R3CodecError,
    R3Profile,
    TokenRangeError,
    TruncatedHeaderError,
    UnsupportedVersionError,
    decode_chunk,
    encode_chunk,
    encode_chunk_into,
    encode_header,
    encoded_nbytes,
    read_header,
)

PROFILE = R3Profile(48, 8, 128)
WIDE = R3Profile(4, 2, 300)  # uint16 ids


def random_rows(profile: R3Profile, num_tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, profile.num_experts, (num_tokens, *profile.row_shape)).astype(profile.dtype)


def reseal(obj: bytes | bytearray) -> bytearray:
    """Recompute the header checksum after editing header fields, to reach the checks behind it."""
    edited = bytearray(obj)
    edited[64:72] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(edited[:64])))
    return edited


def with_field(obj: bytes, offset: int, fmt: str, value: int) -> bytearray:
    edited = bytearray(obj)
    struct.pack_into(fmt, edited, offset, value)
    return reseal(edited)


profiles = st.builds(
    R3Profile,
    num_layers=st.integers(1, 6),
    top_k=st.integers(1, 4),
    num_experts=st.sampled_from([4, 64, 256, 257, 1000, 65536]),
)


@settings(max_examples=150, deadline=None)
@given(profile=profiles, start=st.integers(0, 2**40), num_tokens=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_rows_round_trip_bit_exact_for_any_profile_and_range(profile, start, num_tokens, seed):
    rows = random_rows(profile, num_tokens, seed)

    obj = encode_chunk(profile, start, rows)
    chunk = decode_chunk(obj, profile, expected_range=(start, start + num_tokens))

    assert len(obj) == encoded_nbytes(profile, num_tokens)
    assert (chunk.token_start, chunk.token_end) == (start, start + num_tokens)
    assert chunk.rows.dtype == profile.dtype
    np.testing.assert_array_equal(chunk.rows, rows)


def test_all_encoders_produce_the_same_bytes():
    rows = random_rows(PROFILE, 256)
    obj = encode_chunk(PROFILE, 512, rows)
    into = np.empty(encoded_nbytes(PROFILE, 256), dtype=np.uint8)

    written = encode_chunk_into(into, PROFILE, 512, rows)

    assert written == len(obj) == HEADER_NBYTES + 256 * 384
    assert into.tobytes() == obj
    assert encode_header(PROFILE, 512, rows) + rows.tobytes() == obj


def test_non_contiguous_rows_encode_like_their_contiguous_copy():
    rows = random_rows(PROFILE, 64)[::2]

    assert encode_chunk(PROFILE, 0, rows) == encode_chunk(PROFILE, 0, np.ascontiguousarray(rows))
    with pytest.raises(ValueError, match="C-contiguous"):
        encode_header(PROFILE, 0, rows)


@pytest.mark.parametrize("buffer_type", [bytes, bytearray, memoryview, lambda b: np.frombuffer(b, np.uint8)])
def test_decode_accepts_any_contiguous_byte_buffer(buffer_type):
    rows = random_rows(WIDE, 10)

    chunk = decode_chunk(buffer_type(encode_chunk(WIDE, 7, rows)), WIDE)

    np.testing.assert_array_equal(chunk.rows, rows)


def test_decoded_rows_are_a_read_only_view_of_a_bytes_object():
    chunk = decode_chunk(encode_chunk(PROFILE, 0, random_rows(PROFILE, 4)), PROFILE)

    assert not chunk.rows.flags.writeable


def test_read_header_reports_the_fields_written():
    header = read_header(encode_chunk(WIDE, 1024, random_rows(WIDE, 16)))

    assert header.profile == WIDE
    assert (header.token_start, header.token_end, header.num_tokens) == (1024, 1040, 16)
    assert header.payload_nbytes == 16 * WIDE.bytes_per_token


GOOD = encode_chunk(PROFILE, 256, random_rows(PROFILE, 256))
OTHER_PROFILE_OBJECT = encode_chunk(R3Profile(48, 8, 64), 256, random_rows(R3Profile(48, 8, 64), 256))
PAYLOAD_FLIP = bytearray(GOOD)
PAYLOAD_FLIP[HEADER_NBYTES + 1000] ^= 0x10
HEADER_FLIP = bytearray(GOOD)
HEADER_FLIP[33] ^= 0x01  # token_start


@pytest.mark.parametrize(
    ("obj", "error", "message_part"),
    [
        (GOOD[: HEADER_NBYTES - 1], TruncatedHeaderError, "71 bytes"),
        (b"", TruncatedHeaderError, "0 bytes"),
        (b"PK\x03\x04" + GOOD[4:], BadMagicError, "magic b'PK"),
        (with_field(GOOD, 4, "<H", 2), UnsupportedVersionError, "version 2"),
        (with_field(GOOD, 6, "<H", 4096), HeaderSizeError, "declares 4096 bytes"),
        (with_field(GOOD, 6, "<H", 64), HeaderSizeError, "declares 64 bytes"),
        (with_field(GOOD, 21, "<B", 1), UnsupportedVersionError, "non-zero reserved bytes 010000"),
        (HEADER_FLIP, HeaderChecksumError, "header is damaged"),
        (OTHER_PROFILE_OBJECT, ProfileMismatchError, "written for 48 layers x top-8 of 64 experts"),
        (with_field(GOOD, 24, "<Q", 12345), ProfileMismatchError, "inconsistent"),
        (with_field(GOOD, 20, "<B", 2), ProfileMismatchError, "inconsistent"),
        (with_field(GOOD, 40, "<Q", 256), TokenRangeError, "empty or inverted token range [256, 256)"),
        (with_field(GOOD, 40, "<Q", 100), TokenRangeError, "[256, 100)"),
        (GOOD[:-1], PayloadLengthError, "98303 are present"),
        (GOOD + b"\x00", PayloadLengthError, "98305 are present"),
        (with_field(GOOD, 48, "<Q", 98303), PayloadLengthError, "declares 98303"),
        (with_field(GOOD, 40, "<Q", 513), PayloadLengthError, "needs 98688 payload bytes"),
        (PAYLOAD_FLIP, PayloadChecksumError, "rows are damaged"),
        (with_field(GOOD, 56, "<Q", 0), PayloadChecksumError, "stored 0000000000000000"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_bad_object_is_refused_with_its_specific_error(obj, error, message_part):
    with pytest.raises(error) as caught:
        decode_chunk(bytes(obj), PROFILE)

    assert isinstance(caught.value, R3CodecError)
    assert isinstance(caught.value, ValueError)
    assert message_part in str(caught.value)


def test_object_for_another_range_is_refused_when_the_reader_names_its_range():
    with pytest.raises(TokenRangeError, match=r"covers tokens \[256, 512\) but the reader asked for \[0, 256\)"):
        decode_chunk(GOOD, PROFILE, expected_range=(0, 256))


def test_object_from_a_model_with_more_experts_is_refused_not_reinterpreted():
    # Same byte size per row (4 x 2 x uint16 == 8 x 2 x uint8): only the profile check tells them apart.
    wide = R3Profile(4, 2, 300)
    narrow = R3Profile(8, 2, 16)
    assert wide.bytes_per_token == narrow.bytes_per_token

    with pytest.raises(ProfileMismatchError, match="uint16"):
        decode_chunk(encode_chunk(wide, 0, random_rows(wide, 8)), narrow)


@pytest.mark.parametrize(
    ("rows", "start", "error", "message_part"),
    [
        (np.zeros((4, 48, 8), np.int32), 0, TypeError, "narrow_rows"),
        (np.zeros((4, 48, 4), np.uint8), 0, ValueError, "expected [num_tokens, 48, 8]"),
        (np.zeros((0, 48, 8), np.uint8), 0, ValueError, "at least one token"),
        (np.zeros((4, 48, 8), np.uint8), -1, ValueError, "non-negative"),
        (np.zeros((4, 48, 8), np.uint8), 2**63, ValueError, "non-negative"),
        ([[[0] * 8] * 48], 0, TypeError, "numpy array"),
    ],
)
def test_encode_refuses_rows_that_do_not_match_the_profile(rows, start, error, message_part):
    with pytest.raises(error) as caught:
        encode_chunk(PROFILE, start, rows)

    assert message_part in str(caught.value)


def test_encode_into_refuses_a_buffer_of_the_wrong_size():
    with pytest.raises(ValueError, match="exactly 456 bytes"):
        encode_chunk_into(bytearray(455), PROFILE, 0, random_rows(PROFILE, 1))
