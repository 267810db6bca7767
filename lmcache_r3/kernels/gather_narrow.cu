// Gather captured R3 rows into request order and narrow expert ids to uint8 / uint16, in one pass.
//
// The router capture buffer holds one int32 row per token of a step, in batch order:
//   captured    int32 [num_captured_rows, row_elems]   row_elems = num_layers * top_k, C order
// A request's rows are a list of those rows, in logical position order:
//   row_index   int64 [num_out_rows]                   captured row of each output row
//   out         uint8 or uint16 [num_out_rows, row_elems]
//   error_flags int32 [1], zero on entry
// Nothing is ever narrowed silently: a row index outside [0, num_captured_rows) sets R3_BAD_ROW_INDEX, an expert id
// outside [0, num_experts) sets R3_BAD_EXPERT_ID; the element is written as 0 and the host refuses the whole result.
//
// Kernels (extern "C", launched with a 1-D grid-stride loop of any size):
//   r3_gather_narrow_u8, r3_gather_narrow_u16            one element per step
//   r3_gather_narrow_u8_vec4, r3_gather_narrow_u16_vec4  four elements per step (16-byte loads); needs
//       row_elems % 4 == 0, `captured` 16-byte aligned and `out` aligned to 4 elements
// The numpy reference is lmcache_r3.artifacts.gather.gather_narrow_reference.

#define R3_BAD_ROW_INDEX 1
#define R3_BAD_EXPERT_ID 2

// Plain aligned structs instead of CUDA's int4/uchar4/ushort4, so the source needs no header under NVRTC, nvcc or a
// host compiler; the alignment is what lets the compiler emit one vector load/store per group.
struct alignas(16) r3_i32x4 { int x, y, z, w; };
struct alignas(4) r3_u8x4 { unsigned char x, y, z, w; };
struct alignas(8) r3_u16x4 { unsigned short x, y, z, w; };

template <typename OutT>
__device__ __forceinline__ OutT r3_narrow(int expert_id, int num_experts, int* error_flags) {
  if (expert_id < 0 || expert_id >= num_experts) {
    atomicOr(error_flags, R3_BAD_EXPERT_ID);
    return 0;
  }
  return static_cast<OutT>(expert_id);
}

template <typename OutT>
__device__ __forceinline__ void r3_gather_narrow(const int* __restrict__ captured, long long num_captured_rows,
                                                 const long long* __restrict__ row_index, long long num_out_rows,
                                                 long long row_elems, int num_experts, OutT* __restrict__ out,
                                                 int* __restrict__ error_flags) {
  const long long total = num_out_rows * row_elems;
  const long long stride = static_cast<long long>(blockDim.x) * gridDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const long long out_row = i / row_elems;
    const long long src_row = row_index[out_row];
    if (src_row < 0 || src_row >= num_captured_rows) {
      atomicOr(error_flags, R3_BAD_ROW_INDEX);
      out[i] = 0;
      continue;
    }
    out[i] = r3_narrow<OutT>(captured[src_row * row_elems + (i - out_row * row_elems)], num_experts, error_flags);
  }
}

template <typename OutT, typename OutVec>
__device__ __forceinline__ void r3_gather_narrow_vec4(const int* __restrict__ captured, long long num_captured_rows,
                                                      const long long* __restrict__ row_index,
                                                      long long num_out_rows, long long row_elems, int num_experts,
                                                      OutT* __restrict__ out, int* __restrict__ error_flags) {
  const long long groups_per_row = row_elems / 4;
  const long long total = num_out_rows * groups_per_row;
  const long long stride = static_cast<long long>(blockDim.x) * gridDim.x;
  OutVec* out_vec = reinterpret_cast<OutVec*>(out);
  for (long long g = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; g < total; g += stride) {
    const long long out_row = g / groups_per_row;
    const long long src_row = row_index[out_row];
    OutVec packed;
    if (src_row < 0 || src_row >= num_captured_rows) {
      atomicOr(error_flags, R3_BAD_ROW_INDEX);
      packed.x = packed.y = packed.z = packed.w = 0;
    } else {
      const int* src = captured + src_row * row_elems + (g - out_row * groups_per_row) * 4;
      const r3_i32x4 ids = *reinterpret_cast<const r3_i32x4*>(src);
      packed.x = r3_narrow<OutT>(ids.x, num_experts, error_flags);
      packed.y = r3_narrow<OutT>(ids.y, num_experts, error_flags);
      packed.z = r3_narrow<OutT>(ids.z, num_experts, error_flags);
      packed.w = r3_narrow<OutT>(ids.w, num_experts, error_flags);
    }
    out_vec[g] = packed;
  }
}

#define R3_ARGS                                                                                              \
  const int *__restrict__ captured, long long num_captured_rows, const long long *__restrict__ row_index,   \
      long long num_out_rows, long long row_elems, int num_experts
#define R3_CALL captured, num_captured_rows, row_index, num_out_rows, row_elems, num_experts

extern "C" __global__ void r3_gather_narrow_u8(R3_ARGS, unsigned char* __restrict__ out,
                                               int* __restrict__ error_flags) {
  r3_gather_narrow<unsigned char>(R3_CALL, out, error_flags);
}

extern "C" __global__ void r3_gather_narrow_u16(R3_ARGS, unsigned short* __restrict__ out,
                                                int* __restrict__ error_flags) {
  r3_gather_narrow<unsigned short>(R3_CALL, out, error_flags);
}

extern "C" __global__ void r3_gather_narrow_u8_vec4(R3_ARGS, unsigned char* __restrict__ out,
                                                    int* __restrict__ error_flags) {
  r3_gather_narrow_vec4<unsigned char, r3_u8x4>(R3_CALL, out, error_flags);
}

extern "C" __global__ void r3_gather_narrow_u16_vec4(R3_ARGS, unsigned short* __restrict__ out,
                                                     int* __restrict__ error_flags) {
  r3_gather_narrow_vec4<unsigned short, r3_u16x4>(R3_CALL, out, error_flags);
}
