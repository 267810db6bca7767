"""The R3 profile: what one token's routed experts look like in bytes.

An *R3 row* is the routing of one executed token: for every decoder layer, the ids of the ``top_k`` experts
the router chose, shape ``[num_layers, top_k]``. A *profile* fixes that shape and the element type, so two
processes that agree on the profile agree on every byte: ids are stored as uint8 when the model has at most
256 experts and as uint16 otherwise (the same rule vLLM uses for ``CompletionOutput.routed_experts``).

For example, a model with 48 layers, top-8 routing and 128 experts has rows of 48 x 8 uint8 = 384 bytes per
token, so a 256-token chunk carries 96 KiB of payload.

The *profile id* is a 64-bit digest of the canonical fields (format version, layers, top_k, experts, dtype).
It is written into every chunk header, so a chunk produced for another model shape is rejected on decode
instead of being reinterpreted.
"""

from __future__ import annotations

import hashlib
import struct
from functools import cached_property

import msgspec
import numpy as np

FORMAT_VERSION = 1
"""Version of the chunk format and of the profile-id derivation; bump both together."""

MAX_NUM_EXPERTS = 65536
"""Largest expert count whose ids fit uint16 (ids 0..65535)."""

MAX_NUM_LAYERS = 65535
MAX_TOP_K = 65535

UINT8_MAX_EXPERTS = 256
"""Models with at most this many experts store ids as uint8."""

_DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.uint16): 2}
_PROFILE_ID_DOMAIN = b"lmcache_r3.profile"


def _require_int(name: str, value: object, low: int, high: int) -> int:
    # bool is an int subclass; a True layer count is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be a Python int, got {type(value).__name__} {value!r}; "
            f"pass int({name}) when the value comes from a config object or numpy"
        )
    if not low <= value <= high:
        raise ValueError(f"{name}={value} is out of range: it must be between {low} and {high}")
    return value


class R3Profile(msgspec.Struct, frozen=True, dict=True):
    """Shape and element type of R3 rows for one model.

    Build it with the model's values; validation happens on construction and on msgspec decode.
    """

    num_layers: int
    """Decoder layers with a row entry (dense layers included: vLLM writes zero ids for them)."""
    top_k: int
    """Experts chosen per token and layer."""
    num_experts: int
    """Number of distinct expert ids the router can emit; ids are in [0, num_experts)."""

    def __post_init__(self) -> None:
        _require_int("num_layers", self.num_layers, 1, MAX_NUM_LAYERS)
        _require_int("num_experts", self.num_experts, 1, MAX_NUM_EXPERTS)
        _require_int("top_k", self.top_k, 1, MAX_TOP_K)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} is larger than num_experts={self.num_experts}: a router cannot "
                f"choose more distinct experts than exist; check the model config's experts-per-token "
                f"and expert-count fields"
            )

    @cached_property
    def dtype(self) -> np.dtype:
        """uint8 when num_experts <= 256, else uint16."""
        return np.dtype(np.uint8) if self.num_experts <= UINT8_MAX_EXPERTS else np.dtype(np.uint16)

    @cached_property
    def dtype_code(self) -> int:
        """The dtype as written in a chunk header: 1 = uint8, 2 = uint16."""
        return _DTYPE_CODES[self.dtype]

    @cached_property
    def row_shape(self) -> tuple[int, int]:
        """Shape of one token's row: ``(num_layers, top_k)``."""
        return (self.num_layers, self.top_k)

    @cached_property
    def bytes_per_token(self) -> int:
        """Payload bytes of one row."""
        return self.num_layers * self.top_k * self.dtype.itemsize

    @cached_property
    def profile_id(self) -> int:
        """Stable unsigned 64-bit id of the canonical fields; differs when any field or the dtype differs."""
        canonical = struct.pack(
            "<HIIIB", FORMAT_VERSION, self.num_layers, self.top_k, self.num_experts, self.dtype_code
        )
        digest = hashlib.blake2b(_PROFILE_ID_DOMAIN + canonical, digest_size=8).digest()
        return int.from_bytes(digest, "little")

    @cached_property
    def header_fields(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, top_k, num_experts, dtype_code, profile_id)`` as a chunk header stores them."""
        return (self.num_layers, self.top_k, self.num_experts, self.dtype_code, self.profile_id)

    @property
    def profile_key(self) -> str:
        """The profile id as 16 hex digits, for names and logs."""
        return f"{self.profile_id:016x}"

    def describe(self) -> str:
        """A one-line human description, e.g. ``48 layers x top-8 of 128 experts, uint8, 384 B/token``."""
        return (
            f"{self.num_layers} layers x top-{self.top_k} of {self.num_experts} experts, "
            f"{self.dtype.name}, {self.bytes_per_token} B/token"
        )


def dtype_for_num_experts(num_experts: int) -> np.dtype:
    """The element type R3 rows use for a model with ``num_experts`` experts.

    Args:
        num_experts: distinct expert ids the router can emit, 1..65536.

    Returns:
        ``uint8`` when ``num_experts <= 256``, else ``uint16``.

    Raises:
        TypeError, ValueError: ``num_experts`` is not an int in 1..65536.
    """
    _require_int("num_experts", num_experts, 1, MAX_NUM_EXPERTS)
    return np.dtype(np.uint8) if num_experts <= UINT8_MAX_EXPERTS else np.dtype(np.uint16)
