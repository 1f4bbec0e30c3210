// Paths other than the GPU's own loads for copying 656-byte rows at random between a
// pinned host pool and a device pool, each against a memcpy of the same bytes, timed in
// the same run (CUDA events, R copies back to back, best of --reps):
//
//   sm     the FFI custom call's kernel itself (custom_calls/lib/cuda_kernels.cu: 16-byte
//          units, threads across row boundaries, four loads in flight a thread)
//   tma    the Hopper bulk-copy unit (cp.async.bulk): each lane of a warp moves one row
//          host -> shared -> device (or the reverse) with one bulk read and one bulk
//          write of the whole row; indices read on the device, as in a step
//   batch  the copy engines, cudaMemcpyBatchAsync with one descriptor a row (CUDA >=
//          12.8); the descriptors are host arrays, so the rows must be known to the host
//          before the call: a ceiling study, not a path a step could take
//   u8 u16 the FFI kernel's form with 8 or 16 loads in flight a thread
//   l2_128 l2_256 nc256
//          the FFI kernel's form with an L2 prefetch-size qualifier on each 16-byte load
//          (ld.global.L2::128B / .L2::256B; nc256: ld.global.nc.L1::no_allocate.L2::256B):
//          whether the L2 then asks the host for larger pieces than 64 bytes
//   seq    control: the FFI kernel on rows 0..n-1 of both pools (one contiguous range,
//          the memcpy's bytes): what the GPU's loads reach without rows at random
//          (not checked; a control)
//
// Pools: "small" (--pool-rows rows, the same rows every copy, as `ula-jax bench fetch`'s
// judged form; with --small-thp 1 also "small_thp", the same on 2 MiB pages registered
// with cudaHostRegister, as memory.host_alloc's regions) and, with --big-gib G, a G GiB host pool made by cudaHostAlloc and one made
// by mmap + madvise(MADV_HUGEPAGE) + cudaHostRegister, each copy with its own rows
// (rows the GPU has not just touched, as a serving step's misses).
//
// Every path's result is checked row for row against the source after a poison fill.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icustom_calls/lib -o copy_paths \
//       benchmarks/probes/gpu_copy_paths.cu custom_calls/lib/cuda_kernels.cu
//   ./copy_paths [--rows 4096,16384,65536] [--copies 8] [--reps 5] [--big-gib 8]

#include <cuda_runtime.h>
#include <sys/mman.h>

#include "cuda_check.h"

#include "cuda_kernels.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>


constexpr int kRow = 656;

// --- sm: the FFI custom call's own kernel (custom_calls/lib/cuda_kernels.cu) -----------
cudaError_t LaunchSm(const void* src, void* dst, const int32_t* si, const int32_t* di, int n,
                     int64_t src_rows, int64_t dst_rows, cudaStream_t s) {
  ula_jax_ffi::CopyRowsPlan p;
  p.src = static_cast<const char*>(src);
  p.out = static_cast<char*>(dst);
  p.dst_in = p.out;  // in place, as XLA aliases them
  p.src_idx = si;
  p.dst_idx = di;
  p.num_rows = n;
  p.src_rows = src_rows;
  p.dst_rows = dst_rows;
  p.row_bytes = kRow;
  return ula_jax_ffi::LaunchCopyRows(p, s);
}

// --- u8 / u16 / l2_*: the FFI kernel's form with other loads --------------------------
template <int H>
__device__ __forceinline__ uint4 LoadUnit(const uint4* p) {
  uint4 v;
  if constexpr (H == 0) {
    v = *p;
  } else if constexpr (H == 1) {
    asm volatile("ld.global.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if constexpr (H == 2) {
    asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  }
  return v;
}

template <int U, int H>
__global__ void VariantCopy(const uint4* __restrict__ src, uint4* __restrict__ out,
                            const int32_t* __restrict__ si, const int32_t* __restrict__ di,
                            int64_t num_units, int64_t src_rows, int64_t dst_rows) {
  constexpr int64_t upr = kRow / 16;
  constexpr int kT = 256;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kT * U;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kT * U + threadIdx.x; base < num_units;
       base += stride) {
    uint4 v[U];
    int64_t to[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t u = base + static_cast<int64_t>(j) * kT;
      to[j] = -1;
      if (u < num_units) {
        const int64_t row = u / upr, col = u - row * upr;
        const int64_t s = si[row], d = di[row];
        if (s >= 0 && s < src_rows && d >= 0 && d < dst_rows) {
          v[j] = LoadUnit<H>(src + s * upr + col);
          to[j] = d * upr + col;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (to[j] >= 0) out[to[j]] = v[j];
    }
  }
}

template <int U, int H>
cudaError_t LaunchVariant(const void* src, void* dst, const int32_t* si, const int32_t* di,
                          int n, int64_t src_rows, int64_t dst_rows, cudaStream_t s) {
  const int64_t units = static_cast<int64_t>(n) * (kRow / 16);
  const int64_t per_block = 256LL * U;
  int64_t blocks = std::min<int64_t>((units + per_block - 1) / per_block, 65535LL * 16);
  VariantCopy<U, H><<<static_cast<unsigned>(blocks), 256, 0, s>>>(
      static_cast<const uint4*>(src), static_cast<uint4*>(dst), si, di, units, src_rows,
      dst_rows);
  return cudaGetLastError();
}

// Row i of out = rows[idx[i]] (device or mapped host rows; the check's reader).
__global__ void GatherRows(const char* __restrict__ rows, const int32_t* __restrict__ idx,
                           char* __restrict__ out, int64_t n) {
  const int64_t upr = kRow / 16;
  for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u < n * upr;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = u / upr, c = u - r * upr;
    reinterpret_cast<uint4*>(out)[u] =
        reinterpret_cast<const uint4*>(rows + static_cast<int64_t>(idx[r]) * kRow)[c];
  }
}

// --- tma: one bulk read and one bulk write a row ---------------------------------------
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__global__ void TmaCopy(const char* __restrict__ src, char* __restrict__ dst,
                        const int32_t* __restrict__ si, const int32_t* __restrict__ di, int n) {
  extern __shared__ __align__(128) unsigned char buf[];
  __shared__ __align__(8) uint64_t bar;
  const int lane = threadIdx.x;
  const uint32_t bar_a = SmemAddr(&bar);
  if (lane == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_a) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  const uint32_t s_a = SmemAddr(buf + lane * kRow);
  uint32_t phase = 0;
  for (int base = blockIdx.x * 32; base < n; base += gridDim.x * 32) {
    const int i = base + lane, cnt = min(32, n - base);
    if (lane == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                   ::"r"(bar_a), "r"(cnt * kRow) : "memory");
    }
    __syncwarp();
    if (i < n) {
      const char* g = src + static_cast<int64_t>(si[i]) * kRow;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
          ::"r"(s_a), "l"(g), "r"(kRow), "r"(bar_a) : "memory");
    }
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
          "selp.u32 %0, 1, 0, p; }"
          : "=r"(done) : "r"(bar_a), "r"(phase) : "memory");
    }
    phase ^= 1;
    if (i < n) {
      char* g = dst + static_cast<int64_t>(di[i]) * kRow;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(g), "r"(s_a), "r"(kRow) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
    __syncwarp();
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int g_tma_blocks_per_sm = 16;
int g_sms = 132;

void LaunchTma(const void* src, void* dst, const int32_t* si, const int32_t* di, int n,
               cudaStream_t s) {
  int blocks = std::min((n + 31) / 32, g_sms * g_tma_blocks_per_sm);
  TmaCopy<<<blocks, 32, 32 * kRow, s>>>(static_cast<const char*>(src),
                                         static_cast<char*>(dst), si, di, n);
}

// --- batch: the copy engines --------------------------------------------------------
struct Batch {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
};

Batch MakeBatch(const char* src, char* dst, const std::vector<int32_t>& si,
                const std::vector<int32_t>& di) {
  Batch b;
  for (size_t i = 0; i < si.size(); ++i) {
    b.srcs.push_back(src + static_cast<int64_t>(si[i]) * kRow);
    b.dsts.push_back(dst + static_cast<int64_t>(di[i]) * kRow);
    b.sizes.push_back(kRow);
  }
  return b;
}

cudaError_t RunBatch(Batch& b, bool h2d, cudaStream_t s) {
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.srcLocHint.type = h2d ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
  attr.srcLocHint.id = 0;
  attr.dstLocHint.type = h2d ? cudaMemLocationTypeDevice : cudaMemLocationTypeHost;
  attr.dstLocHint.id = 0;
  size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(b.dsts.data(), b.srcs.data(), b.sizes.data(), b.sizes.size(),
                              &attr, &attr_idx, 1, s);
#else
  size_t fail = 0;
  return cudaMemcpyBatchAsync(b.dsts.data(), const_cast<void**>(b.srcs.data()),
                              b.sizes.data(), b.sizes.size(), &attr, &attr_idx, 1, &fail, s);
#endif
#else
  return cudaErrorNotSupported;
#endif
}

// --- harness -------------------------------------------------------------------------
std::vector<int32_t> Distinct(int64_t pool, int64_t n, std::mt19937_64& rng) {
  // n distinct rows of [0, pool): a partial shuffle over a sampled range when pool is big.
  std::vector<int32_t> out;
  out.reserve(n);
  if (pool <= 4 * n) {
    std::vector<int32_t> all(pool);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    out.assign(all.begin(), all.begin() + n);
  } else {
    std::vector<int64_t> v;
    std::uniform_int_distribution<int64_t> d(0, pool - 1);
    while (static_cast<int64_t>(v.size()) < n) {
      for (int64_t k = v.size(); k < n + n / 8; ++k) v.push_back(d(rng));
      std::sort(v.begin(), v.end());
      v.erase(std::unique(v.begin(), v.end()), v.end());
    }
    std::shuffle(v.begin(), v.end(), rng);
    v.resize(n);
    for (int64_t x : v) out.push_back(static_cast<int32_t>(x));
  }
  return out;
}

void FillRows(char* p, int64_t rows, uint32_t salt) {
  // Row r holds its number and salt in every 4-byte word: cheap to check.
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t* w = reinterpret_cast<uint32_t*>(p + r * kRow);
    for (int k = 0; k < kRow / 4; ++k) w[k] = static_cast<uint32_t>(r) * 2654435761u + salt + k;
  }
}

struct Pool {
  char* p = nullptr;
  int64_t rows = 0;
  std::string kind;
};

// rows rows as anonymous memory on 2 MiB pages (the start on a 2 MiB boundary,
// madvise(MADV_HUGEPAGE)), filled, then registered: as memory.host_alloc's regions are.
// *adv: madvise's return value.
Pool ThpPool(int64_t rows, const char* kind, int* adv) {
  Pool t;
  t.rows = rows;
  t.kind = kind;
  const size_t len = ((rows * kRow + (4 << 20) - 1) >> 21) << 21;
  void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) { std::perror("mmap"); std::exit(1); }
  t.p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(m) + (2 << 20) - 1) &
                                ~static_cast<uintptr_t>((2 << 20) - 1));
  *adv = madvise(t.p, rows * kRow, MADV_HUGEPAGE);
  FillRows(t.p, rows, 11);
  CK(cudaHostRegister(t.p, rows * kRow, cudaHostRegisterDefault));
  return t;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  std::vector<int> counts = {4096, 16384, 65536};
  int copies = 8, reps = 5;
  int64_t pool_rows = 262144;
  int big_gib = 0;
  std::string only;  // --paths a,b: run only these (and memcpy)
  bool small_thp = false;  // --small-thp 1: the small pool again on 2 MiB pages
  for (int a = 1; a + 1 < argc; a += 2) {
    std::string k = argv[a], v = argv[a + 1];
    if (k == "--rows") {
      counts.clear();
      for (size_t pos = 0; pos < v.size();) {
        size_t e = v.find(',', pos);
        counts.push_back(std::stoi(v.substr(pos, e - pos)));
        pos = e == std::string::npos ? v.size() : e + 1;
      }
    } else if (k == "--copies") copies = std::stoi(v);
    else if (k == "--reps") reps = std::stoi(v);
    else if (k == "--pool-rows") pool_rows = std::stoll(v);
    else if (k == "--big-gib") big_gib = std::stoi(v);
    else if (k == "--tma-blocks-per-sm") g_tma_blocks_per_sm = std::stoi(v);
    else if (k == "--paths") only = "," + v + ",";
    else if (k == "--small-thp") small_thp = std::stoi(v) != 0;
    else { std::fprintf(stderr, "unknown argument %s\n", k.c_str()); return 2; }
  }
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  g_sms = prop.multiProcessorCount;
  std::printf("device %s, %d SMs, CUDA runtime %d\n", prop.name, g_sms, CUDART_VERSION);
  CK(cudaFuncSetAttribute(TmaCopy, cudaFuncAttributeMaxDynamicSharedMemorySize, 32 * kRow));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  const int max_n = *std::max_element(counts.begin(), counts.end());
  const int64_t dev_rows = std::max<int64_t>(pool_rows, 4LL * max_n * copies);
  char *dev_pool, *dev_contig, *host_contig;
  CK(cudaMalloc(&dev_pool, dev_rows * kRow));
  CK(cudaMalloc(&dev_contig, static_cast<int64_t>(max_n) * kRow));
  CK(cudaHostAlloc(&host_contig, static_cast<int64_t>(max_n) * kRow, cudaHostAllocDefault));
  {
    std::vector<char> tmp(dev_rows * kRow);
    FillRows(tmp.data(), dev_rows, 77);
    CK(cudaMemcpy(dev_pool, tmp.data(), tmp.size(), cudaMemcpyHostToDevice));
  }

  std::vector<Pool> pools;
  {
    Pool small;
    CK(cudaHostAlloc(&small.p, pool_rows * kRow, cudaHostAllocDefault));
    small.rows = pool_rows;
    small.kind = "small";
    FillRows(small.p, small.rows, 11);
    pools.push_back(small);
  }
  if (small_thp) {  // the same pool on 2 MiB pages
    int adv;
    pools.push_back(ThpPool(pool_rows, "small_thp", &adv));
  }
  if (big_gib > 0) {
    const int64_t bytes = static_cast<int64_t>(big_gib) << 30;
    Pool a;
    a.rows = bytes / kRow;
    a.kind = "big_hostalloc";
    auto t0 = std::chrono::steady_clock::now();
    CK(cudaHostAlloc(&a.p, a.rows * kRow, cudaHostAllocDefault));
    FillRows(a.p, a.rows, 11);
    pools.push_back(a);
    int adv;
    pools.push_back(ThpPool(bytes / kRow, "big_thp_registered", &adv));
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("big pools: 2 x %d GiB in %.1f s; madvise(MADV_HUGEPAGE) -> %d\n", big_gib,
                secs, adv);
    std::fflush(stdout);
    (void)system("grep -i -E 'AnonHugePages|HugePages_Total|Hugepagesize' /proc/meminfo; "
                 "cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null");
  }

  std::vector<char> check(static_cast<int64_t>(max_n) * copies * kRow);
  char* d_check;
  CK(cudaMalloc(&d_check, check.size()));
  std::printf("\n%-20s %-6s %6s %-6s %10s %10s %9s %9s %s\n", "pool", "dir", "rows", "path",
              "GB/s", "memcpy", "fraction", "median", "ok");
  std::mt19937_64 rng(1234);
  for (const Pool& pool : pools) {
    const bool fresh = pool.kind.rfind("small", 0) != 0;
    for (int n : counts) {
      const int lists = fresh ? copies : 1;
      // Host rows (distinct over all lists), device rows distinct over all lists.
      std::vector<int32_t> hi = Distinct(pool.rows, static_cast<int64_t>(n) * lists, rng);
      std::vector<int32_t> di = Distinct(dev_rows, static_cast<int64_t>(n) * lists, rng);
      int32_t *d_hi, *d_di, *d_seq;
      CK(cudaMalloc(&d_hi, hi.size() * 4));
      CK(cudaMalloc(&d_di, di.size() * 4));
      CK(cudaMalloc(&d_seq, static_cast<int64_t>(n) * 4));
      CK(cudaMemcpy(d_hi, hi.data(), hi.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_di, di.data(), di.size() * 4, cudaMemcpyHostToDevice));
      {
        std::vector<int32_t> seq(n);
        std::iota(seq.begin(), seq.end(), 0);
        CK(cudaMemcpy(d_seq, seq.data(), seq.size() * 4, cudaMemcpyHostToDevice));
      }
      const double bytes = static_cast<double>(n) * kRow;
      for (int dir = 0; dir < 2; ++dir) {  // 0 fetch (host -> device), 1 evict
        const bool h2d = dir == 0;
        std::vector<Batch> batches;
        for (int l = 0; l < lists; ++l) {
          std::vector<int32_t> a(hi.begin() + l * n, hi.begin() + (l + 1) * n);
          std::vector<int32_t> b(di.begin() + l * n, di.begin() + (l + 1) * n);
          batches.push_back(h2d ? MakeBatch(pool.p, dev_pool, a, b)
                                : MakeBatch(dev_pool, pool.p, b, a));
        }
        const char* paths[] = {"memcpy", "sm",     "tma",   "batch", "u8",
                               "u16",    "l2_128", "l2_256", "nc256", "seq"};
        constexpr int kPaths = 10;
        std::vector<std::vector<double>> times(kPaths);
        std::vector<std::string> ok(kPaths, "-");
        auto issue = [&](int path, int c) -> cudaError_t {
          const int l = fresh ? c : 0;
          const int32_t* shi = d_hi + static_cast<int64_t>(l) * n;
          const int32_t* sdi = d_di + static_cast<int64_t>(l) * n;
          switch (path) {
            case 0:
              return h2d ? cudaMemcpyAsync(dev_contig, host_contig, n * kRow,
                                           cudaMemcpyHostToDevice, s)
                         : cudaMemcpyAsync(host_contig, dev_contig, n * kRow,
                                           cudaMemcpyDeviceToHost, s);
            case 1:
              return h2d ? LaunchSm(pool.p, dev_pool, shi, sdi, n, pool.rows, dev_rows, s)
                         : LaunchSm(dev_pool, pool.p, sdi, shi, n, dev_rows, pool.rows, s);
            case 2:
              if (h2d) LaunchTma(pool.p, dev_pool, shi, sdi, n, s);
              else LaunchTma(dev_pool, pool.p, sdi, shi, n, s);
              return cudaGetLastError();
            case 3:
              return RunBatch(batches[l], h2d, s);
#define VARIANT(U, H)                                                                  \
  return h2d ? LaunchVariant<U, H>(pool.p, dev_pool, shi, sdi, n, pool.rows, dev_rows, s) \
             : LaunchVariant<U, H>(dev_pool, pool.p, sdi, shi, n, dev_rows, pool.rows, s)
            case 4: VARIANT(8, 0);
            case 5: VARIANT(16, 0);
            case 6: VARIANT(4, 1);
            case 7: VARIANT(4, 2);
            case 8: VARIANT(4, 3);
#undef VARIANT
            default:
              return h2d ? LaunchSm(pool.p, dev_pool, d_seq, d_seq, n, pool.rows, dev_rows, s)
                         : LaunchSm(dev_pool, pool.p, d_seq, d_seq, n, dev_rows, pool.rows, s);
          }
        };
        std::vector<bool> usable(kPaths, true);
        for (int path = 1; path < kPaths; ++path) {
          if (!only.empty() && only.find("," + std::string(paths[path]) + ",") == std::string::npos) {
            usable[path] = false;
            ok[path] = "skipped";
          }
        }
        std::vector<char> dev_copy;
        if (!h2d) {
          GatherRows<<<1024, 256, 0, s>>>(dev_pool, d_di, d_check, static_cast<int64_t>(di.size()));
          dev_copy.resize(di.size() * kRow);
          CK(cudaMemcpyAsync(dev_copy.data(), d_check, dev_copy.size(), cudaMemcpyDeviceToHost, s));
          CK(cudaStreamSynchronize(s));
        }
        // Check each path once: poison the destination rows, copy every list, compare.
        for (int path = 1; path < kPaths; ++path) {
          if (!usable[path] || std::string(paths[path]) == "seq") continue;  // seq: a control
          if (h2d) CK(cudaMemsetAsync(dev_pool, 0xAB, dev_rows * kRow, s));
          else
            for (int32_t h : hi) std::memset(pool.p + static_cast<int64_t>(h) * kRow, 0xAB, kRow);
          CK(cudaStreamSynchronize(s));
          cudaError_t err = cudaSuccess;
          for (int c = 0; c < lists && err == cudaSuccess; ++c) err = issue(path, c);
          if (err == cudaSuccess) err = cudaStreamSynchronize(s);
          if (err != cudaSuccess) {
            ok[path] = std::string("error: ") + cudaGetErrorString(err);
            usable[path] = false;
            (void)cudaGetLastError();
            continue;
          }
          // Gather the destination rows on the device, then one copy back to compare.
          GatherRows<<<1024, 256, 0, s>>>(h2d ? dev_pool : pool.p, h2d ? d_di : d_hi,
                                          d_check, static_cast<int64_t>(hi.size()));
          CK(cudaMemcpyAsync(check.data(), d_check, hi.size() * kRow, cudaMemcpyDeviceToHost, s));
          CK(cudaStreamSynchronize(s));
          int64_t bad = 0;
          for (size_t i = 0; i < hi.size(); ++i) {
            const char* want = h2d ? pool.p + static_cast<int64_t>(hi[i]) * kRow : nullptr;
            if (h2d) {
              bad += std::memcmp(check.data() + i * kRow, want, kRow) != 0;
            } else {
              // The host row must now hold the device row's bytes (the fill's pattern
              // of device row di[i], salt 77, or what a fetch check wrote there).
              bad += std::memcmp(check.data() + i * kRow, dev_copy.data() + i * kRow, kRow) != 0;
            }
          }
          ok[path] = bad == 0 ? "ok" : "BAD " + std::to_string(bad);
          // Restore the host rows an evict check overwrote (the fetch reads them next).
          if (!h2d) {
            for (int32_t h : hi) {
              uint32_t* w = reinterpret_cast<uint32_t*>(pool.p + static_cast<int64_t>(h) * kRow);
              for (int k = 0; k < kRow / 4; ++k) w[k] = static_cast<uint32_t>(h) * 2654435761u + 11 + k;
            }
          }
        }
        // Time: rounds of (every path in turn), each path `copies` copies back to back.
        for (int rep = 0; rep < reps + 1; ++rep) {
          for (int path = 0; path < kPaths; ++path) {
            if (!usable[path]) continue;
            CK(cudaStreamSynchronize(s));
            CK(cudaEventRecord(e0, s));
            for (int c = 0; c < copies; ++c) CK(issue(path, c));
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (rep > 0) times[path].push_back(ms * 1e-3 / copies);
          }
        }
        const double mem_best = *std::min_element(times[0].begin(), times[0].end());
        const double mem_med = Median(times[0]);
        for (int path = 0; path < kPaths; ++path) {
          if (!usable[path]) {
            if (ok[path] == "skipped") continue;
            std::printf("%-20s %-6s %6d %-6s %10s %10s %9s %9s %s\n", pool.kind.c_str(),
                        h2d ? "fetch" : "evict", n, paths[path], "-", "-", "-", "-", ok[path].c_str());
            continue;
          }
          const double best = *std::min_element(times[path].begin(), times[path].end());
          std::printf("%-20s %-6s %6d %-6s %10.2f %10.2f %9.3f %9.3f %s\n", pool.kind.c_str(),
                      h2d ? "fetch" : "evict", n, paths[path], bytes / best * 1e-9,
                      bytes / mem_best * 1e-9, mem_best / best, mem_med / Median(times[path]),
                      ok[path].c_str());
        }
        std::fflush(stdout);
      }
      CK(cudaFree(d_hi));
      CK(cudaFree(d_di));
      CK(cudaFree(d_seq));
    }
  }
  return 0;
}
