// Launchers of the CUDA row-copy kernel (compiled by nvcc, called by the FFI handlers).

#ifndef ULA_JAX_FFI_CUDA_KERNELS_H_
#define ULA_JAX_FFI_CUDA_KERNELS_H_

#include <cuda_runtime.h>

#include "copy_rows_plan.h"

namespace ula_jax_ffi {

// Enqueues `out[dst_idx[i]] = src[src_idx[i]]` for every in-range pair on `stream`.
// Either pool may be pinned host memory: device threads read/write it directly.
// Returns the launch status (cudaSuccess when nothing had to be copied).
cudaError_t LaunchCopyRows(const CopyRowsPlan& plan, cudaStream_t stream);

}  // namespace ula_jax_ffi

#endif  // ULA_JAX_FFI_CUDA_KERNELS_H_
