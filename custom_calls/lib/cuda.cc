// CUDA handlers: validate on the host, then enqueue the row-copy kernel on XLA's stream.
// Index lists are device buffers; either pool may be pinned host memory.

#include <string>

#include <cuda_runtime.h>

#include "copy_rows.h"
#include "cuda_kernels.h"
#include "nanobind/nanobind.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace ula_jax_ffi {
namespace {

ffi::Error CopyRowsCuda(const char* op, const char* src_name, const char* dst_name,
                        cudaStream_t stream, ffi::AnyBuffer src,
                        ffi::Buffer<ffi::S32> src_idx, ffi::AnyBuffer dst,
                        ffi::Buffer<ffi::S32> dst_idx, ffi::Result<ffi::AnyBuffer> out) {
  CopyRowsPlan p;
  if (ffi::Error err = PlanCopyRows(op, src_name, dst_name, src, src_idx, dst, dst_idx, out, &p);
      err.failure()) {
    return err;
  }
  cudaError_t status = LaunchCopyRows(p, stream);
  if (status != cudaSuccess) {
    return ffi::Error::Internal(std::string(op) + ": CUDA error " + cudaGetErrorName(status) +
                                ": " + cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

ffi::Error FetchRowsCuda(cudaStream_t stream, ffi::AnyBuffer host_pool,
                         ffi::Buffer<ffi::S32> host_idx, ffi::AnyBuffer dev_pool,
                         ffi::Buffer<ffi::S32> dev_idx, ffi::Result<ffi::AnyBuffer> out) {
  return CopyRowsCuda("ula_jax_fetch_rows", "host_pool", "dev_pool", stream, host_pool,
                      host_idx, dev_pool, dev_idx, out);
}

ffi::Error EvictRowsCuda(cudaStream_t stream, ffi::AnyBuffer dev_pool,
                         ffi::Buffer<ffi::S32> dev_idx, ffi::AnyBuffer host_pool,
                         ffi::Buffer<ffi::S32> host_idx, ffi::Result<ffi::AnyBuffer> out) {
  return CopyRowsCuda("ula_jax_evict_rows", "dev_pool", "host_pool", stream, dev_pool,
                      dev_idx, host_pool, host_idx, out);
}

XLA_FFI_DEFINE_HANDLER(kFetchRowsCuda, FetchRowsCuda,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Arg<ffi::AnyBuffer>()         // host_pool [Sh, W]
                           .Arg<ffi::Buffer<ffi::S32>>()  // host_idx [N]
                           .Arg<ffi::AnyBuffer>()         // dev_pool [Sd, W]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dev_idx [N]
                           .Ret<ffi::AnyBuffer>());       // dev_pool (aliased)

XLA_FFI_DEFINE_HANDLER(kEvictRowsCuda, EvictRowsCuda,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Arg<ffi::AnyBuffer>()         // dev_pool [Sd, W]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dev_idx [N]
                           .Arg<ffi::AnyBuffer>()         // host_pool [Sh, W]
                           .Arg<ffi::Buffer<ffi::S32>>()  // host_idx [N]
                           .Ret<ffi::AnyBuffer>());       // host_pool (aliased)

}  // namespace
}  // namespace ula_jax_ffi

NB_MODULE(_cuda, m) {
  m.doc() = "CUDA XLA FFI handlers of ula_jax_ffi";
  m.def("registrations", []() {
    nb::dict d;
    d["ula_jax_fetch_rows"] =
        nb::capsule(reinterpret_cast<void*>(ula_jax_ffi::kFetchRowsCuda));
    d["ula_jax_evict_rows"] =
        nb::capsule(reinterpret_cast<void*>(ula_jax_ffi::kEvictRowsCuda));
    return d;
  });
}
