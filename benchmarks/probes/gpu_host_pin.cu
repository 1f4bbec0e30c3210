// How long pinning a large host region takes, by the ways a process can pin one: what a
// `pinned_host` pool of jax's costs before any byte is written is its allocator's pinning
// of the region (a new region per process, the next power of two of the request).
//
//   hostalloc       cudaHostAlloc (the driver maps and pins fresh pages)
//   register_4k     posix_memalign + cudaHostRegister (pages faulted in by the register)
//   touch_register  the same, pages first written by T threads (zeroed in parallel)
//   thp_register    mmap + madvise(MADV_HUGEPAGE), written by T threads, then registered
//
// Each region is checked (a device kernel writes and reads back a word per MiB) and
// freed before the next; every method times the whole path to a usable pinned region.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o host_pin benchmarks/probes/gpu_host_pin.cu -lpthread
//   ./host_pin --gib 32 [--threads 16] [--methods hostalloc,register_4k,...]

#include <cuda_runtime.h>
#include <sys/mman.h>

#include "cuda_check.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>


__global__ void Touch(uint64_t* p, int64_t words_per_mib, int64_t mibs, uint64_t salt) {
  for (int64_t m = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; m < mibs;
       m += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[m * words_per_mib] = salt ^ static_cast<uint64_t>(m);
}

void ParallelZero(char* p, size_t bytes, int threads) {
  std::vector<std::thread> ts;
  const size_t per = (bytes / threads + 4095) & ~size_t(4095);
  for (int t = 0; t < threads; ++t) {
    const size_t a = t * per;
    if (a >= bytes) break;
    const size_t n = std::min(per, bytes - a);
    ts.emplace_back([=] { std::memset(p + a, 0, n); });
  }
  for (auto& t : ts) t.join();
}

bool Check(char* host, size_t bytes) {
  uint64_t* dev_view = nullptr;
  CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_view), host, 0));
  const int64_t mibs = static_cast<int64_t>(bytes >> 20);
  Touch<<<256, 256>>>(dev_view, (1 << 20) / 8, mibs, 0x5eedULL);
  CK(cudaDeviceSynchronize());
  const uint64_t* w = reinterpret_cast<const uint64_t*>(host);
  for (int64_t m = 0; m < mibs; ++m)
    if (w[m * ((1 << 20) / 8)] != (0x5eedULL ^ static_cast<uint64_t>(m))) return false;
  return true;
}

int main(int argc, char** argv) {
  int gib = 32, threads = 16;
  std::string methods = "hostalloc,register_4k,touch_register,thp_register";
  for (int a = 1; a + 1 < argc; a += 2) {
    std::string k = argv[a], v = argv[a + 1];
    if (k == "--gib") gib = std::stoi(v);
    else if (k == "--threads") threads = std::stoi(v);
    else if (k == "--methods") methods = v;
    else { std::fprintf(stderr, "unknown argument %s\n", k.c_str()); return 2; }
  }
  CK(cudaSetDevice(0));
  CK(cudaFree(nullptr));  // the context first: not timed
  const size_t bytes = static_cast<size_t>(gib) << 30;
  std::printf("%-16s %6s %9s %8s %s\n", "method", "GiB", "seconds", "GB/s", "check");
  size_t pos = 0;
  while (pos < methods.size()) {
    size_t e = methods.find(',', pos);
    std::string m = methods.substr(pos, e - pos);
    pos = e == std::string::npos ? methods.size() : e + 1;
    char* p = nullptr;
    void* raw = nullptr;
    auto t0 = std::chrono::steady_clock::now();
    if (m == "hostalloc") {
      CK(cudaHostAlloc(reinterpret_cast<void**>(&p), bytes, cudaHostAllocPortable));
    } else if (m == "register_4k" || m == "touch_register") {
      if (posix_memalign(&raw, 4096, bytes) != 0) { std::perror("posix_memalign"); return 1; }
      p = static_cast<char*>(raw);
      if (m == "touch_register") ParallelZero(p, bytes, threads);
      CK(cudaHostRegister(p, bytes, cudaHostRegisterPortable));
    } else if (m == "thp_register") {
      raw = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (raw == MAP_FAILED) { std::perror("mmap"); return 1; }
      madvise(raw, bytes, MADV_HUGEPAGE);
      p = static_cast<char*>(raw);
      ParallelZero(p, bytes, threads);
      CK(cudaHostRegister(p, bytes, cudaHostRegisterPortable));
    } else {
      std::fprintf(stderr, "unknown method %s\n", m.c_str());
      return 2;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const bool ok = Check(p, bytes);
    std::printf("%-16s %6d %9.2f %8.2f %s\n", m.c_str(), gib, s, bytes / s * 1e-9,
                ok ? "ok" : "BAD");
    std::fflush(stdout);
    if (m == "hostalloc") CK(cudaFreeHost(p));
    else {
      CK(cudaHostUnregister(p));
      if (m == "thp_register") munmap(raw, bytes);
      else std::free(raw);
    }
  }
  return 0;
}
