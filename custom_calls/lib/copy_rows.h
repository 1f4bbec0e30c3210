// Shared by the CPU and CUDA handlers: validation of the operands of a row copy
//   out = dst;  out[dst_idx[i]] = src[src_idx[i]]  for every i whose indices are in range.
// fetch (host pool -> device pool) and evict (device pool -> host pool) are the same copy
// with the roles of the pools swapped; only the error messages name them differently.

#ifndef ULA_JAX_FFI_COPY_ROWS_H_
#define ULA_JAX_FFI_COPY_ROWS_H_

#include <cstdint>
#include <string>

#include "copy_rows_plan.h"
#include "xla/ffi/api/ffi.h"

namespace ula_jax_ffi {

namespace ffi = xla::ffi;

// `op` is the target name, `src_name`/`dst_name` say which pool is which.
inline ffi::Error PlanCopyRows(const std::string& op, const char* src_name,
                               const char* dst_name, ffi::AnyBuffer src,
                               ffi::Buffer<ffi::S32> src_idx, ffi::AnyBuffer dst,
                               ffi::Buffer<ffi::S32> dst_idx,
                               ffi::Result<ffi::AnyBuffer> out, CopyRowsPlan* plan) {
  auto shape = [](ffi::AnyBuffer::Dimensions d) {
    std::string s = "[";
    for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
    return s + "]";
  };
  auto src_dims = src.dimensions();
  auto dst_dims = dst.dimensions();
  if (src_dims.size() != 2) {
    return ffi::Error::InvalidArgument(op + ": " + src_name + " must be rank 2 [S, W], got " +
                                       shape(src_dims));
  }
  if (dst_dims.size() != 2) {
    return ffi::Error::InvalidArgument(op + ": " + dst_name + " must be rank 2 [S, W], got " +
                                       shape(dst_dims));
  }
  if (src.element_type() != dst.element_type()) {
    return ffi::Error::InvalidArgument(
        op + ": " + src_name + " and " + dst_name + " must have one dtype, got XLA types " +
        std::to_string(static_cast<int>(src.element_type())) + " and " +
        std::to_string(static_cast<int>(dst.element_type())));
  }
  const int64_t item = static_cast<int64_t>(ffi::ByteWidth(src.element_type()));
  if (item <= 0) {
    return ffi::Error::InvalidArgument(op + ": unsupported element type " +
                                       std::to_string(static_cast<int>(src.element_type())) +
                                       " (rows must be whole bytes)");
  }
  if (src_dims[1] != dst_dims[1]) {
    return ffi::Error::InvalidArgument(op + ": " + src_name + " " + shape(src_dims) + " and " +
                                       dst_name + " " + shape(dst_dims) +
                                       " must have the same row width W");
  }
  auto si = src_idx.dimensions();
  auto di = dst_idx.dimensions();
  if (si.size() != 1 || di.size() != 1 || si[0] != di[0]) {
    return ffi::Error::InvalidArgument(op + ": index lists must both be [N], got " + shape(si) +
                                       " and " + shape(di));
  }
  auto out_dims = out->dimensions();
  if (out_dims.size() != 2 || out_dims[0] != dst_dims[0] || out_dims[1] != dst_dims[1] ||
      out->element_type() != dst.element_type()) {
    return ffi::Error::InvalidArgument(op + ": result " + shape(out_dims) + " must match " +
                                       dst_name + " " + shape(dst_dims));
  }
  plan->src = static_cast<const char*>(src.untyped_data());
  plan->out = static_cast<char*>(out->untyped_data());
  plan->dst_in = static_cast<const char*>(dst.untyped_data());
  plan->src_idx = src_idx.typed_data();
  plan->dst_idx = dst_idx.typed_data();
  plan->num_rows = si[0];
  plan->src_rows = src_dims[0];
  plan->dst_rows = dst_dims[0];
  plan->row_bytes = src_dims[1] * item;
  plan->dst_bytes = dst_dims[0] * plan->row_bytes;
  return ffi::Error::Success();
}

}  // namespace ula_jax_ffi

#endif  // ULA_JAX_FFI_COPY_ROWS_H_
