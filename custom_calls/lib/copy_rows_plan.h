// The operands of one row copy, resolved to raw pointers (no XLA headers: the CUDA
// kernels include this from nvcc).

#ifndef ULA_JAX_FFI_COPY_ROWS_PLAN_H_
#define ULA_JAX_FFI_COPY_ROWS_PLAN_H_

#include <cstdint>

namespace ula_jax_ffi {

struct CopyRowsPlan {
  const char* src = nullptr;
  char* out = nullptr;
  const char* dst_in = nullptr;  // equal to `out` when XLA aliased them
  const int32_t* src_idx = nullptr;
  const int32_t* dst_idx = nullptr;
  int64_t num_rows = 0;  // N: index pairs
  int64_t src_rows = 0;
  int64_t dst_rows = 0;
  int64_t row_bytes = 0;
  int64_t dst_bytes = 0;
};

}  // namespace ula_jax_ffi

#endif  // ULA_JAX_FFI_COPY_ROWS_PLAN_H_
