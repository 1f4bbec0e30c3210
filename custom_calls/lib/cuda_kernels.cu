// The row copy on the GPU. The copy is flattened into units (16, 8, 4 or 1 bytes, the
// widest that the row size and both base pointers allow) and thread t of a block handles
// units base + t + j * blockDim.x for j < kUnroll: a warp's accesses stay contiguous
// across row boundaries, so rows whose size is not a multiple of 512 B (656 B FP8
// entries) still keep every lane busy. Each thread issues all of its loads before its
// stores so several PCIe round trips are in flight per thread.

#include <cstdint>

#include "cuda_kernels.h"

namespace ula_jax_ffi {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename Unit>
__global__ void CopyRowsKernel(const Unit* __restrict__ src, Unit* __restrict__ out,
                               const int32_t* __restrict__ src_idx,
                               const int32_t* __restrict__ dst_idx, int64_t num_units,
                               int64_t units_per_row, int64_t src_rows, int64_t dst_rows) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads * kUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x;
       base < num_units; base += stride) {
    Unit v[kUnroll];
    int64_t to[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t u = base + static_cast<int64_t>(j) * kThreads;
      to[j] = -1;
      if (u < num_units) {
        const int64_t row = u / units_per_row;
        const int64_t col = u - row * units_per_row;
        const int64_t s = src_idx[row];
        const int64_t d = dst_idx[row];
        if (s >= 0 && s < src_rows && d >= 0 && d < dst_rows) {
          v[j] = src[s * units_per_row + col];
          to[j] = d * units_per_row + col;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (to[j] >= 0) out[to[j]] = v[j];
    }
  }
}

template <typename Unit>
cudaError_t Launch(const CopyRowsPlan& p, cudaStream_t stream) {
  const int64_t units_per_row = p.row_bytes / static_cast<int64_t>(sizeof(Unit));
  const int64_t num_units = p.num_rows * units_per_row;
  const int64_t per_block = static_cast<int64_t>(kThreads) * kUnroll;
  int64_t blocks = (num_units + per_block - 1) / per_block;
  if (blocks > 65535 * 16) blocks = 65535 * 16;  // the loop strides over the rest
  CopyRowsKernel<Unit><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const Unit*>(p.src), reinterpret_cast<Unit*>(p.out), p.src_idx,
      p.dst_idx, num_units, units_per_row, p.src_rows, p.dst_rows);
  return cudaGetLastError();
}

bool Aligned(const void* ptr, int64_t n) {
  return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(n) == 0;
}

}  // namespace

cudaError_t LaunchCopyRows(const CopyRowsPlan& p, cudaStream_t stream) {
  if (p.out != p.dst_in && p.dst_bytes > 0) {
    // Not aliased: the rows that are not written come from dst.
    cudaError_t err =
        cudaMemcpyAsync(p.out, p.dst_in, p.dst_bytes, cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
  }
  if (p.num_rows == 0 || p.row_bytes == 0 || p.src_rows == 0 || p.dst_rows == 0) {
    return cudaSuccess;
  }
  auto fits = [&](int64_t n) {
    return p.row_bytes % n == 0 && Aligned(p.src, n) && Aligned(p.out, n);
  };
  if (fits(16)) return Launch<uint4>(p, stream);
  if (fits(8)) return Launch<uint2>(p, stream);
  if (fits(4)) return Launch<uint32_t>(p, stream);
  return Launch<uint8_t>(p, stream);
}

}  // namespace ula_jax_ffi
