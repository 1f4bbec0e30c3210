// CPU handlers: a memcpy per row. Index lists are read on the host.

#include <cstring>

#include "copy_rows.h"
#include "nanobind/nanobind.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace ula_jax_ffi {
namespace {

ffi::Error CopyRowsCpu(const char* op, const char* src_name, const char* dst_name,
                       ffi::AnyBuffer src, ffi::Buffer<ffi::S32> src_idx, ffi::AnyBuffer dst,
                       ffi::Buffer<ffi::S32> dst_idx, ffi::Result<ffi::AnyBuffer> out) {
  CopyRowsPlan p;
  if (ffi::Error err = PlanCopyRows(op, src_name, dst_name, src, src_idx, dst, dst_idx, out, &p);
      err.failure()) {
    return err;
  }
  // Without aliasing the untouched rows must come from dst first.
  if (p.out != p.dst_in && p.dst_bytes > 0) std::memcpy(p.out, p.dst_in, p.dst_bytes);
  for (int64_t i = 0; i < p.num_rows; ++i) {
    const int64_t s = p.src_idx[i];
    const int64_t d = p.dst_idx[i];
    if (s < 0 || s >= p.src_rows || d < 0 || d >= p.dst_rows) continue;
    std::memcpy(p.out + d * p.row_bytes, p.src + s * p.row_bytes, p.row_bytes);
  }
  return ffi::Error::Success();
}

ffi::Error FetchRowsCpu(ffi::AnyBuffer host_pool, ffi::Buffer<ffi::S32> host_idx,
                        ffi::AnyBuffer dev_pool, ffi::Buffer<ffi::S32> dev_idx,
                        ffi::Result<ffi::AnyBuffer> out) {
  return CopyRowsCpu("ula_jax_fetch_rows", "host_pool", "dev_pool", host_pool, host_idx,
                     dev_pool, dev_idx, out);
}

ffi::Error EvictRowsCpu(ffi::AnyBuffer dev_pool, ffi::Buffer<ffi::S32> dev_idx,
                        ffi::AnyBuffer host_pool, ffi::Buffer<ffi::S32> host_idx,
                        ffi::Result<ffi::AnyBuffer> out) {
  return CopyRowsCpu("ula_jax_evict_rows", "dev_pool", "host_pool", dev_pool, dev_idx,
                     host_pool, host_idx, out);
}

XLA_FFI_DEFINE_HANDLER(kFetchRowsCpu, FetchRowsCpu,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()         // host_pool [Sh, W]
                           .Arg<ffi::Buffer<ffi::S32>>()  // host_idx [N]
                           .Arg<ffi::AnyBuffer>()         // dev_pool [Sd, W]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dev_idx [N]
                           .Ret<ffi::AnyBuffer>());       // dev_pool (aliased)

XLA_FFI_DEFINE_HANDLER(kEvictRowsCpu, EvictRowsCpu,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()         // dev_pool [Sd, W]
                           .Arg<ffi::Buffer<ffi::S32>>()  // dev_idx [N]
                           .Arg<ffi::AnyBuffer>()         // host_pool [Sh, W]
                           .Arg<ffi::Buffer<ffi::S32>>()  // host_idx [N]
                           .Ret<ffi::AnyBuffer>());       // host_pool (aliased)

}  // namespace
}  // namespace ula_jax_ffi

NB_MODULE(_cpu, m) {
  m.doc() = "CPU XLA FFI handlers of ula_jax_ffi";
  m.def("registrations", []() {
    nb::dict d;
    d["ula_jax_fetch_rows"] =
        nb::capsule(reinterpret_cast<void*>(ula_jax_ffi::kFetchRowsCpu));
    d["ula_jax_evict_rows"] =
        nb::capsule(reinterpret_cast<void*>(ula_jax_ffi::kEvictRowsCpu));
    return d;
  });
}
