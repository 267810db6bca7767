"""Gather and narrow: from the router's capture buffer to a request's compact rows.

vLLM's router capture keeps one int32 row ``[num_layers, top_k]`` per token of the current step, in batch
order. A request needs *its* rows, in logical position order, in the profile dtype (uint8 or uint16).
``row_index`` says which captured row each output row is; gathering and narrowing happen in one pass, on the
GPU through the CUDA kernel in ``lmcache_r3/kernels/gather_narrow.cu`` (loaded with CuPy's RawModule), or on
the CPU with the numpy reference below, which defines the result.

Narrowing is checked: an expert id outside ``[0, num_experts)`` or a row index outside the capture buffer is
an error, never a silently wrapped value.

CuPy is imported only when a GPU array is passed or the GPU is probed: importing this module needs no GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from lmcache_r3.artifacts.profile import R3Profile

_UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_BAD_ROW_INDEX = 1
_BAD_EXPERT_ID = 2
_THREADS_PER_BLOCK = 256


class GatherNarrowError(ValueError):
    """Captured rows that cannot be narrowed exactly, or row indices outside the capture buffer."""


def narrow_rows(rows: np.ndarray, profile: R3Profile) -> np.ndarray:
    """Convert integer expert ids ``[n, num_layers, top_k]`` to the profile dtype, refusing ids out of range.

    Args:
        rows: integer array of the profile's row shape (e.g. int32 from the capture buffer).
        profile: the row profile.

    Returns:
        A new array in ``profile.dtype``; the input itself (checked) when it is already in that dtype.

    Raises:
        GatherNarrowError: wrong shape, non-integer dtype, or an id outside ``[0, num_experts)``.
    """
    if rows.ndim != 3 or rows.shape[1:] != profile.row_shape or rows.dtype.kind not in "iu":
        raise GatherNarrowError(
            f"rows must be integers of shape [n, {profile.num_layers}, {profile.top_k}], got {rows.dtype} {rows.shape}"
        )
    # One pass checks both bounds: a negative id read as unsigned is larger than any expert count. Rows already in
    # the profile dtype are checked too (uint8 holds ids up to 255 whatever the expert count).
    unsigned = rows.view(_UNSIGNED[rows.dtype.itemsize]) if rows.dtype.kind == "i" else rows
    if rows.size and int(unsigned.max()) >= profile.num_experts:
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= profile.num_experts:
            raise GatherNarrowError(
                f"expert ids span [{low}, {high}] but the profile has {profile.num_experts} experts (ids "
                f"0..{profile.num_experts - 1}); set num_experts to the router's id range (physical experts "
                f"when EPLB redundant experts are captured)"
            )
    return rows if rows.dtype == profile.dtype else rows.astype(profile.dtype)


def _check_index(row_index: np.ndarray, num_captured_rows: int) -> None:
    if row_index.ndim != 1 or row_index.dtype.kind not in "iu":
        raise GatherNarrowError(f"row_index must be a 1-D integer array, got {row_index.dtype} {row_index.shape}")
    if row_index.size and (int(row_index.min()) < 0 or int(row_index.max()) >= num_captured_rows):
        raise GatherNarrowError(
            f"row_index spans [{int(row_index.min())}, {int(row_index.max())}] but the capture buffer has "
            f"{num_captured_rows} rows; the step's token-to-row mapping is wrong"
        )


def gather_narrow_reference(captured: np.ndarray, row_index: np.ndarray, profile: R3Profile) -> np.ndarray:
    """CPU reference: ``narrow_rows(captured[row_index], profile)``.

    Args:
        captured: int32 ``[num_captured_rows, num_layers, top_k]``, the step's capture buffer (host copy).
        row_index: ``[n]`` captured row of each output row, in logical position order.
        profile: the row profile.

    Returns:
        ``[n, num_layers, top_k]`` in ``profile.dtype``.

    Raises:
        GatherNarrowError: an index outside the buffer or an id that does not fit.
    """
    row_index = np.asarray(row_index)
    if captured.ndim != 3 or captured.shape[1:] != profile.row_shape:
        raise GatherNarrowError(f"captured must be [rows, {profile.num_layers}, {profile.top_k}], got {captured.shape}")
    _check_index(row_index, captured.shape[0])
    return narrow_rows(captured[row_index], profile)


@functools.cache
def cuda_available() -> bool:
    """Whether CuPy is importable and sees at least one CUDA device (False without a driver or GPU)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, driver too old: all mean "use the CPU reference"
        return False


class CudaGatherNarrow:
    """The CUDA kernel, compiled once per process through CuPy's RawModule."""

    def __init__(self) -> None:
        import cupy

        from lmcache_r3.kernels import kernel_source

        self._cupy = cupy
        module = cupy.RawModule(code=kernel_source(), options=("--std=c++17",))
        self._kernels = {
            (np.dtype(dtype), vec4): module.get_function(f"r3_gather_narrow_{suffix}{'_vec4' if vec4 else ''}")
            for dtype, suffix in ((np.uint8, "u8"), (np.uint16, "u16"))
            for vec4 in (False, True)
        }
        self._num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]

    def __call__(self, captured: Any, row_index: Any, profile: R3Profile, check: bool = True) -> Any:
        """Gather and narrow on the current device.

        Args:
            captured: device int32 ``[num_captured_rows, num_layers, top_k]`` (CuPy array or any object with
                ``__cuda_array_interface__``, e.g. a torch CUDA tensor).
            row_index: device or host integer ``[n]``.
            profile: the row profile.
            check: synchronize and raise on a bad index or id; pass False to read the flags yourself later.

        Returns:
            CuPy ``[n, num_layers, top_k]`` in ``profile.dtype``; ``(out, error_flags)`` if not ``check``.

        Raises:
            GatherNarrowError: as :func:`gather_narrow_reference`.
        """
        cp = self._cupy
        captured = cp.ascontiguousarray(cp.asarray(captured))
        if captured.dtype != cp.int32 or captured.ndim != 3 or captured.shape[1:] != profile.row_shape:
            raise GatherNarrowError(
                f"captured must be int32 [rows, {profile.num_layers}, {profile.top_k}], got "
                f"{captured.dtype} {captured.shape}"
            )
        index = cp.ascontiguousarray(cp.asarray(row_index, dtype=cp.int64))
        num_out_rows, row_elems = int(index.shape[0]), profile.num_layers * profile.top_k
        out = cp.empty((num_out_rows, *profile.row_shape), dtype=profile.dtype)
        flags = cp.zeros(1, dtype=cp.int32)
        vec4 = row_elems % 4 == 0 and captured.data.ptr % 16 == 0 and out.data.ptr % (4 * out.itemsize) == 0
        work = num_out_rows * row_elems // (4 if vec4 else 1)
        if work:
            blocks = max(1, min(-(-work // _THREADS_PER_BLOCK), self._num_sms * 32))
            self._kernels[(profile.dtype, vec4)](
                (blocks,),
                (_THREADS_PER_BLOCK,),
                (
                    captured,
                    np.int64(captured.shape[0]),
                    index,
                    np.int64(num_out_rows),
                    np.int64(row_elems),
                    np.int32(profile.num_experts),
                    out,
                    flags,
                ),
            )
        if not check:
            return out, flags
        raise_for_flags(int(flags.get()[0]), num_captured_rows=int(captured.shape[0]), profile=profile)
        return out


def raise_for_flags(error_flags: int, num_captured_rows: int, profile: R3Profile) -> None:
    """Turn the kernel's error bits into :class:`GatherNarrowError` (no-op for 0)."""
    if error_flags & _BAD_ROW_INDEX:
        raise GatherNarrowError(
            f"row_index points outside the capture buffer of {num_captured_rows} rows; "
            f"the step's token-to-row mapping is wrong"
        )
    if error_flags & _BAD_EXPERT_ID:
        raise GatherNarrowError(
            f"an expert id is outside [0, {profile.num_experts}); set num_experts to the router's id range"
        )


@functools.cache
def _cuda_kernel() -> CudaGatherNarrow:
    return CudaGatherNarrow()


def gather_narrow(captured: Any, row_index: Any, profile: R3Profile) -> Any:
    """Gather ``captured[row_index]`` and narrow to ``profile.dtype``, on the device that holds ``captured``.

    Args:
        captured: int32 ``[num_captured_rows, num_layers, top_k]``: a numpy array (CPU reference) or a CUDA
            array (``__cuda_array_interface__``: CuPy, torch CUDA tensor) for the kernel.
        row_index: ``[n]`` integer indices in logical position order.
        profile: the row profile.

    Returns:
        ``[n, num_layers, top_k]`` in ``profile.dtype``: numpy for numpy input, CuPy for CUDA input.

    Raises:
        GatherNarrowError: an index outside the buffer or an id that does not fit.
    """
    if hasattr(captured, "__cuda_array_interface__"):
        return _cuda_kernel()(captured, row_index, profile)
    return gather_narrow_reference(np.asarray(captured), row_index, profile)
