"""Fuzz the chunk decoder: random, truncated, bit-flipped, spliced and foreign objects never crash it and never
decode to rows other than the ones written."""

from __future__ import annotations

import collections

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_r3.artifacts import HEADER_NBYTES, R3CodecError, R3Profile, decode_chunk, encode_chunk

FUZZ_CASES = 12_000
PROFILES = [R3Profile(3, 2, 16), R3Profile(5, 4, 256), R3Profile(2, 3, 300), R3Profile(4, 2, 65536)]


def _originals(rng: np.random.Generator) -> list[tuple[R3Profile, int, np.ndarray, bytes]]:
    originals = []
    for profile in PROFILES:
        for num_tokens in (1, 2, 7, 16, 64):
            start = int(rng.integers(0, 10_000))
            rows = rng.integers(0, profile.num_experts, (num_tokens, *profile.row_shape)).astype(profile.dtype)
            originals.append((profile, start, rows, encode_chunk(profile, start, rows)))
    return originals


def _mutate(rng: np.random.Generator, obj: bytes, donor: bytes) -> tuple[str, bytes]:
    kind = int(rng.integers(0, 9))
    data = bytearray(obj)
    if kind == 0:
        return "truncate", bytes(data[: int(rng.integers(0, len(data)))])
    if kind == 1:
        for _ in range(int(rng.integers(1, 5))):
            bit = int(rng.integers(0, len(data) * 8))
            data[bit // 8] ^= 1 << (bit % 8)
        return "flip_anywhere", bytes(data)
    if kind == 2:
        bit = int(rng.integers(0, HEADER_NBYTES * 8))
        data[bit // 8] ^= 1 << (bit % 8)
        return "flip_header", bytes(data)
    if kind == 3:
        at = int(rng.integers(0, len(data)))
        length = int(rng.integers(1, 32))
        data[at : at + length] = rng.bytes(min(length, len(data) - at))
        return "overwrite_slice", bytes(data)
    if kind == 4:
        return "append", bytes(data) + rng.bytes(int(rng.integers(1, 17)))
    if kind == 5:
        return "random_bytes", rng.bytes(int(rng.integers(0, 400)))
    if kind == 6:
        return "valid_prefix_random_rest", bytes(data[:8]) + rng.bytes(int(rng.integers(0, 400)))
    if kind == 7:
        return "splice_header_and_other_payload", bytes(data[:HEADER_NBYTES]) + donor[HEADER_NBYTES:]
    return "unchanged", bytes(data)


def test_fuzzed_objects_raise_only_codec_errors_and_never_decode_to_other_rows():
    rng = np.random.default_rng(20261129)
    originals = _originals(rng)
    outcomes: collections.Counter[str] = collections.Counter()

    for _ in range(FUZZ_CASES):
        profile, start, rows, obj = originals[int(rng.integers(0, len(originals)))]
        _, _, _, donor = originals[int(rng.integers(0, len(originals)))]
        kind, mutated = _mutate(rng, obj, donor)
        reader_profile = profile if rng.random() < 0.9 else PROFILES[int(rng.integers(0, len(PROFILES)))]
        expected_range = (start, start + len(rows)) if rng.random() < 0.5 else None
        try:
            chunk = decode_chunk(mutated, reader_profile, expected_range=expected_range)
        except R3CodecError as error:
            outcomes[type(error).__name__] += 1
            continue
        # Success is only allowed for the exact bytes that were written, read as the profile they were written for.
        assert mutated == obj, f"{kind}: a changed object decoded"
        assert reader_profile == profile
        assert (chunk.token_start, chunk.token_end) == (start, start + len(rows))
        np.testing.assert_array_equal(chunk.rows, rows)
        outcomes["decoded_unchanged"] += 1

    assert sum(outcomes.values()) == FUZZ_CASES
    every_error = {
        "TruncatedHeaderError", "BadMagicError", "UnsupportedVersionError", "HeaderSizeError",
        "HeaderChecksumError", "ProfileMismatchError", "PayloadLengthError", "PayloadChecksumError",
    }  # fmt: skip
    assert every_error <= set(outcomes), f"fuzz did not reach every check: {outcomes}"
    assert outcomes["decoded_unchanged"] > 0


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=600))
def test_arbitrary_bytes_never_crash_the_decoder(data):
    try:
        decode_chunk(data, PROFILES[0])
    except R3CodecError:
        pass
