"""R3Profile: dtype rule, bytes per token, stable profile id, validation that names the fix."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_r3.artifacts import R3Profile, dtype_for_num_experts


@pytest.mark.parametrize(
    ("num_layers", "top_k", "num_experts", "dtype", "bytes_per_token"),
    [
        (48, 8, 128, np.uint8, 384),
        (48, 8, 256, np.uint8, 384),
        (48, 8, 257, np.uint16, 768),
        (61, 8, 384, np.uint16, 976),
        (1, 1, 1, np.uint8, 1),
        (94, 8, 65536, np.uint16, 1504),
    ],
)
def test_profile_uses_uint8_up_to_256_experts_and_uint16_above(num_layers, top_k, num_experts, dtype, bytes_per_token):
    profile = R3Profile(num_layers, top_k, num_experts)

    assert profile.dtype == np.dtype(dtype)
    assert dtype_for_num_experts(num_experts) == np.dtype(dtype)
    assert profile.bytes_per_token == bytes_per_token
    assert profile.row_shape == (num_layers, top_k)


@pytest.mark.parametrize(
    ("kwargs", "error", "message_part"),
    [
        ({"num_layers": 0, "top_k": 8, "num_experts": 128}, ValueError, "num_layers=0"),
        ({"num_layers": -3, "top_k": 8, "num_experts": 128}, ValueError, "num_layers=-3"),
        ({"num_layers": 48, "top_k": 0, "num_experts": 128}, ValueError, "top_k=0"),
        ({"num_layers": 48, "top_k": 8, "num_experts": 0}, ValueError, "num_experts=0"),
        ({"num_layers": 48, "top_k": 8, "num_experts": 65537}, ValueError, "num_experts=65537"),
        ({"num_layers": 48, "top_k": 9, "num_experts": 8}, ValueError, "top_k=9 is larger than num_experts=8"),
        ({"num_layers": 48.0, "top_k": 8, "num_experts": 128}, TypeError, "int(num_layers)"),
        ({"num_layers": True, "top_k": 8, "num_experts": 128}, TypeError, "num_layers"),
        ({"num_layers": np.int64(48), "top_k": 8, "num_experts": 128}, TypeError, "int(num_layers)"),
    ],
)
def test_invalid_profile_is_rejected_with_the_value_and_the_fix(kwargs, error, message_part):
    with pytest.raises(error, match=r".*") as caught:
        R3Profile(**kwargs)

    assert message_part in str(caught.value)


def test_profile_id_of_a_known_profile_is_pinned_so_stored_objects_stay_readable():
    # Changing the derivation silently would make every stored chunk unreadable; bump FORMAT_VERSION instead.
    assert R3Profile(48, 8, 128).profile_key == "16d7a9eb7fda07a9"
    assert R3Profile(48, 8, 384).profile_key == "442fad0fe1b10df4"


def test_profile_id_is_the_same_in_a_fresh_process():
    code = "from lmcache_r3.artifacts import R3Profile; print(R3Profile(30, 4, 200).profile_key)"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

    assert other.stdout.strip() == R3Profile(30, 4, 200).profile_key


fields = st.tuples(st.integers(1, 200), st.integers(1, 16), st.integers(16, 70000).filter(lambda e: e <= 65536))


@given(a=fields, b=fields)
def test_profile_id_differs_exactly_when_a_field_differs(a, b):
    assert (R3Profile(*a).profile_id == R3Profile(*b).profile_id) == (a == b)


def test_profile_survives_msgspec_round_trip_and_is_validated_on_decode():
    profile = R3Profile(48, 8, 128)

    assert msgspec.msgpack.decode(msgspec.msgpack.encode(profile), type=R3Profile) == profile
    with pytest.raises(msgspec.ValidationError, match="top_k=300 is larger than num_experts=256"):
        msgspec.json.decode(b'{"num_layers": 2, "top_k": 300, "num_experts": 256}', type=R3Profile)


def test_profile_describes_itself_for_error_messages():
    assert R3Profile(48, 8, 128).describe() == "48 layers x top-8 of 128 experts, uint8, 384 B/token"
