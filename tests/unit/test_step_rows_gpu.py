"""The worker's step rows on a GPU: the capture buffer stays on the device, only the narrowed rows come back.

Runs where CuPy sees a CUDA device (``make gpu-check`` hosts); skipped elsewhere. The CPU path is covered by
tests/unit/test_routed_capture.py with the same function.
"""

from __future__ import annotations

import numpy as np
import pytest

from lmcache_r3.artifacts import R3Profile, cuda_available
from lmcache_r3.mp.step_rows import narrow_step

pytestmark = pytest.mark.skipif(not cuda_available(), reason="no CUDA device visible to CuPy")


def step(num_tokens: int, num_padding: int, profile: R3Profile, seed: int):
    """A step's slot mapping (shuffled slots, padding slots last as under CUDA graphs) and its capture buffer."""
    rng = np.random.default_rng(seed)
    slots = rng.permutation(8 * num_tokens)[:num_tokens].astype(np.int64)
    mapping = np.concatenate([slots, np.full(num_padding, -1, dtype=np.int64)])
    captured = rng.integers(0, profile.num_experts, (num_tokens + num_padding + 7, *profile.row_shape), dtype=np.int32)
    return mapping, captured


@pytest.mark.parametrize("num_experts", [128, 384])
@pytest.mark.parametrize("num_padding", [0, 13])
def test_device_capture_gives_the_rows_of_the_cpu_path(num_experts, num_padding):
    import cupy

    profile = R3Profile(num_layers=48, top_k=8, num_experts=num_experts)
    mapping, captured = step(2048, num_padding, profile, seed=num_experts + num_padding)
    cpu_slots, cpu_rows = narrow_step(mapping, captured, profile)
    gpu_slots, gpu_rows = narrow_step(mapping, cupy.asarray(captured), profile)
    assert isinstance(gpu_rows, np.ndarray) and gpu_rows.dtype == profile.dtype
    assert cpu_rows.shape[0] == 2048
    np.testing.assert_array_equal(gpu_slots, cpu_slots)
    np.testing.assert_array_equal(gpu_rows, cpu_rows)


def test_a_torch_cuda_capture_buffer_is_read_in_place():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    profile = R3Profile(num_layers=48, top_k=8, num_experts=128)
    mapping, captured = step(512, 5, profile, seed=1)
    _, cpu_rows = narrow_step(mapping, captured, profile)
    _, gpu_rows = narrow_step(mapping, torch.from_numpy(captured).cuda(), profile)
    np.testing.assert_array_equal(gpu_rows, cpu_rows)
