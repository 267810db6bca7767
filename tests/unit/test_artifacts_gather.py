"""Gather + narrow: the numpy reference defines the result; the CUDA kernel must match it (on a GPU through CuPy,
and everywhere through a CPU build of the same source that emulates the launch grid)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_r3.artifacts import GatherNarrowError, R3Profile, cuda_available, gather_narrow, narrow_rows
from lmcache_r3.artifacts.gather import gather_narrow_reference
from lmcache_r3.kernels import GATHER_NARROW, kernel_source

KERNEL_PATH = Path(__file__).resolve().parents[2] / "lmcache_r3" / "kernels" / GATHER_NARROW
KERNELS = ("r3_gather_narrow_u8", "r3_gather_narrow_u16", "r3_gather_narrow_u8_vec4", "r3_gather_narrow_u16_vec4")


def captured_rows(profile: R3Profile, num_rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, profile.num_experts, (num_rows, *profile.row_shape), dtype=np.int32)


# -- numpy reference ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_experts", [8, 256, 257, 65536])
def test_reference_gathers_rows_in_request_order_and_narrows_to_the_profile_dtype(num_experts):
    profile = R3Profile(5, 2, num_experts)
    captured = captured_rows(profile, 9, seed=1)
    captured[0, 0, 0] = num_experts - 1  # the largest id must survive narrowing
    order = np.array([4, 0, 8, 8, 1])

    out = gather_narrow(captured, order, profile)

    assert out.dtype == profile.dtype
    np.testing.assert_array_equal(out.astype(np.int64), captured[order])


@pytest.mark.parametrize(
    ("bad_value", "message_part"),
    [(128, "128] but the profile has 128 experts (ids 0..127)"), (-1, "span [-1,")],
)
def test_reference_refuses_an_expert_id_that_does_not_fit_instead_of_wrapping(bad_value, message_part):
    profile = R3Profile(2, 2, 128)
    captured = captured_rows(profile, 3, seed=2)
    captured[1, 1, 1] = bad_value

    with pytest.raises(GatherNarrowError) as caught:
        gather_narrow(captured, np.array([1]), profile)

    assert message_part in str(caught.value)
    assert "set num_experts" in str(caught.value)


@pytest.mark.parametrize("order", [[3], [-1], [0, 7]])
def test_reference_refuses_row_indices_outside_the_capture_buffer(order):
    profile = R3Profile(2, 2, 16)

    with pytest.raises(GatherNarrowError, match="capture buffer has 3 rows"):
        gather_narrow(captured_rows(profile, 3, seed=3), np.array(order), profile)


@pytest.mark.parametrize(("dtype", "num_experts", "bad"), [(np.uint8, 100, 200), (np.uint16, 300, 65535)])
def test_narrow_rows_refuses_an_id_past_the_experts_in_rows_already_in_the_profile_dtype(dtype, num_experts, bad):
    profile = R3Profile(2, 2, num_experts)
    rows = np.zeros((3, 2, 2), dtype)
    assert narrow_rows(rows, profile) is rows  # already narrow and in range: no copy
    rows[2, 1, 0] = bad
    with pytest.raises(GatherNarrowError, match=f"{bad}] but the profile has {num_experts} experts"):
        narrow_rows(rows, profile)


def test_narrow_rows_refuses_the_wrong_row_shape():
    with pytest.raises(GatherNarrowError, match=r"shape \[n, 2, 2\]"):
        narrow_rows(np.zeros((1, 2, 3), np.int32), R3Profile(2, 2, 16))


# -- the CUDA source -----------------------------------------------------------------------------------------------
def test_the_kernel_source_is_found_through_the_installed_package():
    source = kernel_source()

    for name in KERNELS:
        assert f'extern "C" __global__ void {name}(' in source


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_kernel_source_compiles_with_nvcc(tmp_path):
    ptx = tmp_path / "gather_narrow.ptx"

    result = subprocess.run(
        ["nvcc", "--ptx", "-arch=sm_80", "-o", str(ptx), str(KERNEL_PATH)], capture_output=True, text=True
    )

    assert result.returncode == 0, result.stderr
    entries = ptx.read_text()
    for name in KERNELS:
        assert f".entry {name}(" in entries


# The same source built for the CPU: each CUDA builtin gets a host definition and the grid runs block by block,
# thread by thread, so the kernels' index arithmetic, vector paths and error flags are checked without a GPU.
CPU_EMULATION = r"""
struct r3_dim3 { unsigned int x, y, z; };
static r3_dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
static inline int atomicOr(int* address, int value) { int old = *address; *address |= value; return old; }
#include "gather_narrow.cu"

extern "C" void r3_emulate(int kernel, unsigned grid, unsigned block, const int* captured, long long num_captured,
                           const long long* row_index, long long num_out, long long row_elems, int num_experts,
                           void* out, int* flags) {
  gridDim.x = grid;
  blockDim.x = block;
  for (blockIdx.x = 0; blockIdx.x < grid; ++blockIdx.x) {
    for (threadIdx.x = 0; threadIdx.x < block; ++threadIdx.x) {
      switch (kernel) {
        case 0: r3_gather_narrow_u8(captured, num_captured, row_index, num_out, row_elems, num_experts,
                                    (unsigned char*)out, flags); break;
        case 1: r3_gather_narrow_u16(captured, num_captured, row_index, num_out, row_elems, num_experts,
                                     (unsigned short*)out, flags); break;
        case 2: r3_gather_narrow_u8_vec4(captured, num_captured, row_index, num_out, row_elems, num_experts,
                                         (unsigned char*)out, flags); break;
        case 3: r3_gather_narrow_u16_vec4(captured, num_captured, row_index, num_out, row_elems, num_experts,
                                          (unsigned short*)out, flags); break;
      }
    }
  }
}
"""


@pytest.fixture(scope="module")
def cpu_kernels(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the CPU emulation of the kernel")
    build = tmp_path_factory.mktemp("kernel_cpu")
    (build / "emulate.cpp").write_text(CPU_EMULATION)
    library = build / "libr3emulate.so"
    subprocess.run(
        [compiler, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{KERNEL_PATH.parent}", "-o", str(library),
         str(build / "emulate.cpp")],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    lib = ctypes.CDLL(str(library))
    lib.r3_emulate.restype = None
    return lib


def run_emulated(lib, kernel: int, captured: np.ndarray, row_index: np.ndarray, profile: R3Profile,
                 grid: int, block: int) -> tuple[np.ndarray, int]:  # fmt: skip
    captured = np.ascontiguousarray(captured, dtype=np.int32)
    row_index = np.ascontiguousarray(row_index, dtype=np.int64)
    out = np.full((row_index.shape[0], *profile.row_shape), 0xAB, dtype=profile.dtype)
    flags = np.zeros(1, dtype=np.int32)
    lib.r3_emulate(
        ctypes.c_int(kernel), ctypes.c_uint(grid), ctypes.c_uint(block),
        captured.ctypes.data_as(ctypes.c_void_p), ctypes.c_longlong(captured.shape[0]),
        row_index.ctypes.data_as(ctypes.c_void_p), ctypes.c_longlong(row_index.shape[0]),
        ctypes.c_longlong(profile.num_layers * profile.top_k), ctypes.c_int(profile.num_experts),
        out.ctypes.data_as(ctypes.c_void_p), flags.ctypes.data_as(ctypes.c_void_p),
    )  # fmt: skip
    return out, int(flags[0])


@settings(max_examples=60, deadline=None)
@given(
    num_layers=st.integers(1, 6),
    top_k=st.sampled_from([1, 2, 4, 8]),
    num_experts=st.sampled_from([8, 256, 257, 4096]),
    num_captured=st.integers(1, 12),
    data=st.data(),
    grid=st.integers(1, 3),
    block=st.integers(1, 9),
)
def test_kernel_matches_the_numpy_reference_for_any_grid(
    cpu_kernels, num_layers, top_k, num_experts, num_captured, data, grid, block
):
    profile = R3Profile(num_layers, min(top_k, num_experts), num_experts)
    captured = captured_rows(profile, num_captured, seed=num_captured)
    order = np.asarray(data.draw(st.lists(st.integers(0, num_captured - 1), max_size=10)), dtype=np.int64)
    expected = gather_narrow_reference(captured, order, profile)
    wide = profile.dtype == np.uint16
    kernels = [int(wide)] + ([2 + int(wide)] if (num_layers * top_k) % 4 == 0 else [])

    for kernel in kernels:
        out, flags = run_emulated(cpu_kernels, kernel, captured, order, profile, grid, block)
        assert flags == 0
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("kernel", [0, 2])
def test_kernel_flags_a_bad_row_index_and_writes_zeros_there(cpu_kernels, kernel):
    profile = R3Profile(2, 2, 16)
    captured = captured_rows(profile, 4, seed=5)

    out, flags = run_emulated(cpu_kernels, kernel, captured, np.array([1, 4, -1]), profile, grid=2, block=3)

    assert flags == 1
    np.testing.assert_array_equal(out[0], captured[1])
    assert not out[1:].any()


@pytest.mark.parametrize("kernel", [1, 3])
def test_kernel_flags_an_expert_id_that_does_not_fit(cpu_kernels, kernel):
    profile = R3Profile(2, 2, 300)
    captured = captured_rows(profile, 2, seed=6)
    captured[1, 0, 1] = 300

    out, flags = run_emulated(cpu_kernels, kernel, captured, np.array([0, 1]), profile, grid=1, block=4)

    assert flags == 2
    assert out[1, 0, 1] == 0
    np.testing.assert_array_equal(out[0], captured[0])


# -- the real GPU path ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not cuda_available(), reason="no CUDA device visible to CuPy")
@pytest.mark.parametrize("num_experts", [128, 384])
@pytest.mark.parametrize("top_k", [8, 3])
def test_gpu_kernel_matches_the_numpy_reference(num_experts, top_k):
    import cupy

    profile = R3Profile(48, top_k, num_experts)
    captured = captured_rows(profile, 2048, seed=7)
    order = np.random.default_rng(8).integers(0, 2048, 1500)

    out = gather_narrow(cupy.asarray(captured), cupy.asarray(order), profile)

    np.testing.assert_array_equal(cupy.asnumpy(out), gather_narrow_reference(captured, order, profile))


@pytest.mark.skipif(not cuda_available(), reason="no CUDA device visible to CuPy")
def test_gpu_kernel_refuses_an_expert_id_that_does_not_fit():
    import cupy

    profile = R3Profile(4, 2, 64)
    captured = captured_rows(profile, 8, seed=9)
    captured[3, 1, 0] = 64

    with pytest.raises(GatherNarrowError, match="outside"):
        gather_narrow(cupy.asarray(captured), cupy.asarray(np.arange(8)), profile)
