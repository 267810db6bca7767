"""The worker's step mapping on a GPU: the capture buffer stays on the device, only the narrowed rows come back.

Runs where CuPy sees a CUDA device (``make gpu-check`` hosts); skipped elsewhere. The CPU path is covered by
tests/unit/test_routed_capture.py with the same functions.
"""

from __future__ import annotations

import numpy as np
import pytest

from lmcache_r3.artifacts import R3Profile, cuda_available
from lmcache_r3.mp.step_rows import StepRows, collect_step_rows

pytestmark = pytest.mark.skipif(not cuda_available(), reason="no CUDA device visible to CuPy")

BLOCK = 16


def step(num_requests: int, profile: R3Profile, seed: int):
    """A batch of requests at random positions, laid out in a shuffled batch order, like a runner's step."""
    rng = np.random.default_rng(seed)
    plans, slots = {}, []
    next_block = 1
    for i in range(num_requests):
        start, count = int(rng.integers(0, 300)), int(rng.integers(1, 40))
        first, last = start // BLOCK, (start + count - 1) // BLOCK + 1
        blocks = tuple(range(next_block, next_block + last - first))
        next_block += len(blocks)
        plans[f"r{i}"] = StepRows(start, count, first, blocks)
        slots.append(plans[f"r{i}"].slots(BLOCK))
    mapping = np.concatenate(slots)
    order = rng.permutation(mapping.shape[0])
    captured = rng.integers(0, profile.num_experts, (mapping.shape[0], *profile.row_shape), dtype=np.int32)
    return mapping[order], captured[order], plans


@pytest.mark.parametrize("num_experts", [128, 384])
def test_device_capture_gives_the_rows_of_the_cpu_path(num_experts):
    import cupy

    profile = R3Profile(num_layers=48, top_k=8, num_experts=num_experts)
    mapping, captured, plans = step(64, profile, seed=num_experts)
    cpu, cpu_unmapped = collect_step_rows(mapping, captured, plans, BLOCK, profile)
    gpu, gpu_unmapped = collect_step_rows(mapping, cupy.asarray(captured), plans, BLOCK, profile)
    assert cpu_unmapped == gpu_unmapped == []
    for request_id in plans:
        assert isinstance(gpu[request_id].rows, np.ndarray) and gpu[request_id].rows.dtype == profile.dtype
        np.testing.assert_array_equal(gpu[request_id].rows, cpu[request_id].rows)


def test_a_torch_cuda_capture_buffer_is_read_in_place():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    profile = R3Profile(num_layers=48, top_k=8, num_experts=128)
    mapping, captured, plans = step(32, profile, seed=1)
    cpu, _ = collect_step_rows(mapping, captured, plans, BLOCK, profile)
    gpu, _ = collect_step_rows(mapping, torch.from_numpy(captured).cuda(), plans, BLOCK, profile)
    for request_id in plans:
        np.testing.assert_array_equal(gpu[request_id].rows, cpu[request_id].rows)
