"""Engine-neutral R3 core: describe, validate, assemble and ship routed experts.

*R3* (rollout routing replay) is the list of expert ids the MoE router chose for every executed token of a
request, ``[num_tokens - 1, num_layers, top_k]``. This package knows nothing about vLLM or LMCache (it imports
numpy, msgspec and xxhash only), so every rule about R3 bytes lives here and is tested on its own:

* :mod:`.profile`  - row shape and dtype of one model, and its stable profile id;
* :mod:`.codec`    - one self-describing, checksummed chunk object per token range; strict decode;
* :mod:`.runs`     - consecutive chunks as one byte string (a store message, a fetch response);
* :mod:`.slots`    - rows beside each physical KV slot: where the scheduler keeps every request's rows;
* :mod:`.ranges`   - half-open token ranges;
* :mod:`.gather`   - capture buffer -> a request's narrowed rows (CUDA kernel on GPU, numpy on CPU).
"""

from lmcache_r3.artifacts.codec import (
    HEADER_NBYTES,
    BadMagicError,
    HeaderChecksumError,
    HeaderSizeError,
    PayloadChecksumError,
    PayloadLengthError,
    ProfileMismatchError,
    R3Chunk,
    R3ChunkHeader,
    R3CodecError,
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
from lmcache_r3.artifacts.gather import (
    GatherNarrowError,
    cuda_available,
    gather_narrow,
    gather_narrow_reference,
    narrow_rows,
)
from lmcache_r3.artifacts.profile import FORMAT_VERSION, R3Profile, dtype_for_num_experts
from lmcache_r3.artifacts.ranges import TokenRange
from lmcache_r3.artifacts.runs import RunDecode, decode_run, encode_run
from lmcache_r3.artifacts.slots import SlotMirror, SlotMirrorError

__all__ = [
    "FORMAT_VERSION",
    "HEADER_NBYTES",
    "BadMagicError",
    "GatherNarrowError",
    "HeaderChecksumError",
    "HeaderSizeError",
    "PayloadChecksumError",
    "PayloadLengthError",
    "ProfileMismatchError",
    "R3Chunk",
    "R3ChunkHeader",
    "R3CodecError",
    "R3Profile",
    "RunDecode",
    "SlotMirror",
    "SlotMirrorError",
    "TokenRange",
    "TokenRangeError",
    "TruncatedHeaderError",
    "UnsupportedVersionError",
    "cuda_available",
    "decode_chunk",
    "decode_run",
    "dtype_for_num_experts",
    "encode_chunk",
    "encode_chunk_into",
    "encode_header",
    "encode_run",
    "encoded_nbytes",
    "gather_narrow",
    "gather_narrow_reference",
    "narrow_rows",
    "read_header",
]
