// Probe kernels (not built with the library): the row statistics, the row rule and the gradient
// epilogue of a full-width fp32 tile in one pass, a cluster of blocks holding each row on chip
// and merging its slices' statistics through distributed shared memory. Variants: slices in
// registers (row_fused_kernel), in shared memory (row_fused_smem_kernel), brought by bulk copies
// (row_tma_kernel), with independent accumulators (row_ilp_kernel), a lean plain-rows path
// (row_plain_kernel) and persistent double-buffered clusters (row_stream_kernel). Timed by
// one-pass-probe.cu against the library's two kernels; see ../cuda-ce-2026-12-05-one-pass.md.
#include <cooperative_groups.h>
#include <cooperative_groups/memcpy_async.h>
#include <cuda/barrier>

#include <cub/block/block_reduce.cuh>

#include "one-pass-helpers.cuh"

namespace chunkloss::kern {
namespace {

namespace cg = cooperative_groups;

/// Logits each thread holds (a multiple of every kVec).
constexpr int kFloats = 64;
/// Portable cluster size; up to kMaxCluster with the non-portable attribute.
constexpr int kPortableCluster = 8;
constexpr int kMaxCluster = 16;

template <int kThreads>
constexpr std::int64_t kSlice = static_cast<std::int64_t>(kThreads) * kFloats;  // per block

// One cluster per row of the tile (rows r0 + blockIdx.x / cluster size), block `rank` holding
// columns [rank * kSlice, (rank + 1) * kSlice). With a narrowing gradient the row's gradient is
// stored over the first half of its own logits: every block of the cluster has read its slice
// (its statistics feed the cluster's merge) before any block stores.
template <typename TL, typename TG, bool kPlain, int kThreads>
__global__ void __launch_bounds__(kThreads)
    row_fused_kernel(TokenParams p, TL* tile, std::int64_t ld, std::int64_t r0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Reduce = cub::BlockReduce<RowAcc, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ RowAcc part;  // this block's statistics, read by the whole cluster
  __shared__ RowOut out;
  constexpr int V = kVec<TL>;
  constexpr int K = kFloats / V;
  constexpr std::int64_t kStep = static_cast<std::int64_t>(kThreads) * V;
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank(), blocks = cluster.num_blocks();
  const std::int64_t i = blockIdx.x / blocks, t = r0 + i, n = p.vocab;
  TL* row = tile + i * ld;
  const bool vec = aligned16(tile) && (ld % V) == 0;
  const std::int64_t y = valid_target(p, t);
  const float cap = p.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const bool want_sum = p.rule.eps != 0.0f || p.logit_sums;
  const std::int64_t j0 = rank * kSlice<kThreads> + static_cast<std::int64_t>(threadIdx.x) * V;

  float z[K][V];
#pragma unroll
  for (int u = 0; u < K; ++u)
    if (j0 + u * kStep < n) load_floats(row, j0 + u * kStep, n, vec, z[u]);
  RowAcc acc = RowAcc::empty();
#pragma unroll
  for (int u = 0; u < K; ++u)
    if (j0 + u * kStep < n)
      add_vector<kPlain>(acc, p, z[u], j0 + u * kStep, n, y, cap, inv_cap, want_sum);
  const RowAcc r = Reduce(tmp).Reduce(acc, MergeAcc());
  if (threadIdx.x == 0) part = r;
  cluster.sync();  // every slice read and reduced
  if (threadIdx.x == 0) {
    RowAcc m = *cluster.map_shared_rank(&part, 0);
    for (unsigned k = 1; k < blocks; ++k) m = MergeAcc()(m, *cluster.map_shared_rank(&part, k));
    out = rank == 0 ? apply_row_rule(p, t, y, m) : row_rule(p, t, y, m).out;
  }
  cluster.sync();  // `out` set; no block reads another's `part` after this
  const RowOut o = out;
  const bool zero = o.a == 0.0f && o.b == 0.0f && o.g == 0.0f;
  TG* grow = reinterpret_cast<TG*>(row);
#pragma unroll
  for (int u = 0; u < K; ++u) {
    const std::int64_t j = j0 + u * kStep;
    if (j >= n) break;
    float d[V];
    grad_vector<kPlain>(d, z[u], p, o, zero, j, n, y, 0, cap, inv_cap);
    store_floats<TG, V>(grow, j, n, vec, d);
  }
#endif
}

// The same with each block's slice of kCols columns staged in shared memory (cp.async), so a
// block holds few registers and several blocks share an SM.
template <typename TL, typename TG, bool kPlain, int kThreads, int kCols>
__global__ void __launch_bounds__(kThreads)
    row_fused_smem_kernel(TokenParams p, TL* tile, std::int64_t ld, std::int64_t r0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Reduce = cub::BlockReduce<RowAcc, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ RowAcc part;
  __shared__ RowOut out;
  extern __shared__ uint4 staged[];
  TL* sl = reinterpret_cast<TL*>(staged);
  constexpr int V = kVec<TL>;
  cg::cluster_group cluster = cg::this_cluster();
  cg::thread_block block = cg::this_thread_block();
  const unsigned rank = cluster.block_rank(), blocks = cluster.num_blocks();
  const std::int64_t i = blockIdx.x / blocks, t = r0 + i, n = p.vocab;
  TL* row = tile + i * ld;
  const bool vec = aligned16(tile) && (ld % V) == 0;
  const std::int64_t c0 = static_cast<std::int64_t>(rank) * kCols;
  const std::int64_t cn = n - c0 < kCols ? n - c0 : kCols;
  const std::int64_t head = vec ? cn / V * V : 0;  // columns copied as 16-byte chunks
  if (head > 0) cg::memcpy_async(block, sl, row + c0, cuda::aligned_size_t<16>(head * sizeof(TL)));
  for (std::int64_t j = head + threadIdx.x; j < cn; j += kThreads) sl[j] = row[c0 + j];
  cg::wait(block);
  const std::int64_t y = valid_target(p, t);
  const float cap = p.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const bool want_sum = p.rule.eps != 0.0f || p.logit_sums;
  constexpr std::int64_t kStep = static_cast<std::int64_t>(kThreads) * V;
  const std::int64_t lane = static_cast<std::int64_t>(threadIdx.x) * V;
  RowAcc acc = RowAcc::empty();
  for (std::int64_t j = lane; j < cn; j += kStep) {
    float z[V];
    load_floats(sl, j, cn, true, z);
    add_vector<kPlain>(acc, p, z, c0 + j, n, y, cap, inv_cap, want_sum);
  }
  const RowAcc r = Reduce(tmp).Reduce(acc, MergeAcc());
  if (threadIdx.x == 0) part = r;
  cluster.sync();
  if (threadIdx.x == 0) {
    RowAcc m = *cluster.map_shared_rank(&part, 0);
    for (unsigned k = 1; k < blocks; ++k) m = MergeAcc()(m, *cluster.map_shared_rank(&part, k));
    out = rank == 0 ? apply_row_rule(p, t, y, m) : row_rule(p, t, y, m).out;
  }
  cluster.sync();
  const RowOut o = out;
  const bool zero = o.a == 0.0f && o.b == 0.0f && o.g == 0.0f;
  TG* grow = reinterpret_cast<TG*>(row);
  for (std::int64_t j = lane; j < cn; j += kStep) {
    float z[V], d[V];
    load_floats(sl, j, cn, true, z);
    grad_vector<kPlain>(d, z, p, o, zero, c0 + j, n, y, 0, cap, inv_cap);
    store_floats<TG, V>(grow, c0 + j, n, vec, d);
  }
#endif
}

// Persistent clusters: cluster c takes rows c, c + clusters, ... Each block holds two slices
// of kCols columns in shared memory and copies the next row's slice (cp.async) while it works on
// the current one; one cluster barrier per row (the blocks' statistics double-buffered).
template <typename TL, typename TG, bool kPlain, int kThreads, int kCols>
__global__ void __launch_bounds__(kThreads)
    row_stream_kernel(TokenParams p, TL* tile, std::int64_t ld, std::int64_t r0,
                      std::int64_t rows) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Reduce = cub::BlockReduce<RowAcc, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ RowAcc part[2];
  __shared__ RowOut out;
  extern __shared__ uint4 staged[];
  constexpr int V = kVec<TL>;
  cg::cluster_group cluster = cg::this_cluster();
  cg::thread_block block = cg::this_thread_block();
  const unsigned rank = cluster.block_rank(), blocks = cluster.num_blocks();
  const std::int64_t clusters = gridDim.x / blocks, n = p.vocab;
  const bool vec = aligned16(tile) && (ld % V) == 0;
  const std::int64_t c0 = static_cast<std::int64_t>(rank) * kCols;
  const std::int64_t cn = n - c0 < kCols ? n - c0 : kCols;
  const std::int64_t head = vec ? cn / V * V : 0;  // columns copied as 16-byte chunks
  const auto copy = [&](std::int64_t i, TL* dst) {
    const TL* src = tile + i * ld + c0;
    if (head > 0) cg::memcpy_async(block, dst, src, cuda::aligned_size_t<16>(head * sizeof(TL)));
    for (std::int64_t j = head + threadIdx.x; j < cn; j += kThreads) dst[j] = src[j];
  };
  const float cap = p.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const bool want_sum = p.rule.eps != 0.0f || p.logit_sums;
  constexpr std::int64_t kStep = static_cast<std::int64_t>(kThreads) * V;
  const std::int64_t lane = static_cast<std::int64_t>(threadIdx.x) * V;
  std::int64_t i = blockIdx.x / blocks;
  if (i < rows) copy(i, reinterpret_cast<TL*>(staged));
  for (int k = 0; i < rows; i += clusters, ++k) {
    TL* sl = reinterpret_cast<TL*>(staged) + (k & 1) * kCols;
    const std::int64_t next = i + clusters;
    if (next < rows) copy(next, reinterpret_cast<TL*>(staged) + ((k + 1) & 1) * kCols);
    if (next < rows)
      cg::wait_prior<1>(block);
    else
      cg::wait(block);
    const std::int64_t t = r0 + i, y = valid_target(p, t);
    RowAcc acc = RowAcc::empty();
    for (std::int64_t j = lane; j < cn; j += kStep) {
      float z[V];
      load_floats(sl, j, cn, true, z);
      add_vector<kPlain>(acc, p, z, c0 + j, n, y, cap, inv_cap, want_sum);
    }
    const RowAcc r = Reduce(tmp).Reduce(acc, MergeAcc());
    if (threadIdx.x == 0) part[k & 1] = r;
    cluster.sync();  // every slice of row i read and reduced
    if (threadIdx.x == 0) {
      RowAcc m = *cluster.map_shared_rank(&part[k & 1], 0);
      for (unsigned b = 1; b < blocks; ++b)
        m = MergeAcc()(m, *cluster.map_shared_rank(&part[k & 1], b));
      out = rank == 0 ? apply_row_rule(p, t, y, m) : row_rule(p, t, y, m).out;
    }
    __syncthreads();
    const RowOut o = out;
    const bool zero = o.a == 0.0f && o.b == 0.0f && o.g == 0.0f;
    TG* grow = reinterpret_cast<TG*>(tile + i * ld);
    for (std::int64_t j = lane; j < cn; j += kStep) {
      float z[V], d[V];
      load_floats(sl, j, cn, true, z);
      grad_vector<kPlain>(d, z, p, o, zero, c0 + j, n, y, 0, cap, inv_cap);
      store_floats<TG, V>(grow, c0 + j, n, vec, d);
    }
    __syncthreads();  // `out` and this slice's buffer free for the next rows
  }
  cluster.sync();  // no block leaves while another may read its statistics
#endif
}

// row_fused_smem_kernel with the loops over the slice unrolled (K vectors per thread) and the
// statistics in kAcc independent accumulators, merged at the end, to break the chain of
// dependent adds.
template <typename TL, typename TG, bool kPlain, int kThreads, int kCols, int kAcc>
__global__ void __launch_bounds__(kThreads)
    row_ilp_kernel(TokenParams p, TL* tile, std::int64_t ld, std::int64_t r0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Reduce = cub::BlockReduce<RowAcc, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ RowAcc part;
  __shared__ RowOut out;
  extern __shared__ uint4 staged[];
  TL* sl = reinterpret_cast<TL*>(staged);
  constexpr int V = kVec<TL>;
  constexpr std::int64_t kStep = static_cast<std::int64_t>(kThreads) * V;
  constexpr int K = kCols / kStep;
  cg::cluster_group cluster = cg::this_cluster();
  cg::thread_block block = cg::this_thread_block();
  const unsigned rank = cluster.block_rank(), blocks = cluster.num_blocks();
  const std::int64_t i = blockIdx.x / blocks, t = r0 + i, n = p.vocab;
  TL* row = tile + i * ld;
  const bool vec = aligned16(tile) && (ld % V) == 0;
  const std::int64_t c0 = static_cast<std::int64_t>(rank) * kCols;
  const int cn = static_cast<int>(n - c0 < kCols ? n - c0 : kCols);
  const int head = vec ? cn / V * V : 0;
  if (head > 0) cg::memcpy_async(block, sl, row + c0, cuda::aligned_size_t<16>(head * sizeof(TL)));
  for (int j = head + threadIdx.x; j < cn; j += kThreads) sl[j] = row[c0 + j];
  cg::wait(block);
  const std::int64_t y = valid_target(p, t);
  const float cap = p.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const bool want_sum = p.rule.eps != 0.0f || p.logit_sums;
  const int lane = threadIdx.x * V;
  RowAcc acc[kAcc];
#pragma unroll
  for (int a = 0; a < kAcc; ++a) acc[a] = RowAcc::empty();
#pragma unroll
  for (int u = 0; u < K; ++u) {
    const int j = lane + u * static_cast<int>(kStep);
    if (j < cn) {
      float z[V];
      load_floats(sl, j, cn, true, z);
      add_vector<kPlain>(acc[u % kAcc], p, z, c0 + j, n, y, cap, inv_cap, want_sum);
    }
  }
#pragma unroll
  for (int a = 1; a < kAcc; ++a) acc[0] = MergeAcc()(acc[0], acc[a]);
  const RowAcc r = Reduce(tmp).Reduce(acc[0], MergeAcc());
  if (threadIdx.x == 0) part = r;
  cluster.sync();
  if (threadIdx.x == 0) {
    RowAcc m = *cluster.map_shared_rank(&part, 0);
    for (unsigned k = 1; k < blocks; ++k) m = MergeAcc()(m, *cluster.map_shared_rank(&part, k));
    out = rank == 0 ? apply_row_rule(p, t, y, m) : row_rule(p, t, y, m).out;
  }
  cluster.sync();
  const RowOut o = out;
  const bool zero = o.a == 0.0f && o.b == 0.0f && o.g == 0.0f;
  TG* grow = reinterpret_cast<TG*>(row);
#pragma unroll
  for (int u = 0; u < K; ++u) {
    const int j = lane + u * static_cast<int>(kStep);
    if (j < cn) {
      float z[V], d[V];
      load_floats(sl, j, cn, true, z);
      grad_vector<kPlain>(d, z, p, o, zero, c0 + j, n, y, 0, cap, inv_cap);
      store_floats<TG, V>(grow, c0 + j, n, vec, d);
    }
  }
#endif
}

// Plain rows (see plain_rows) with 32-bit slice indices and branch-light full vectors: the
// statistics of each vector are its max, a rescale when the max grows, and one exp per element;
// the gradient one exp and one multiply per element, the target handled once per row.
template <typename TL, typename TG, int kThreads, int kCols>
__global__ void __launch_bounds__(kThreads)
    row_plain_kernel(TokenParams p, TL* tile, std::int64_t ld, std::int64_t r0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Reduce = cub::BlockReduce<RowAcc, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ RowAcc part;
  __shared__ RowOut out;
  extern __shared__ uint4 staged[];
  TL* sl = reinterpret_cast<TL*>(staged);
  constexpr int V = kVec<TL>;
  constexpr int kStep = kThreads * V;
  constexpr int K = kCols / kStep;
  cg::cluster_group cluster = cg::this_cluster();
  cg::thread_block block = cg::this_thread_block();
  const unsigned rank = cluster.block_rank(), blocks = cluster.num_blocks();
  const std::int64_t i = blockIdx.x / blocks, t = r0 + i, n = p.vocab;
  const std::int64_t c0 = static_cast<std::int64_t>(rank) * kCols;
  TL* src = tile + i * ld + c0;
  const bool vec = aligned16(tile) && (ld % V) == 0;
  const int cn = static_cast<int>(n - c0 < kCols ? n - c0 : kCols);
  const int head = vec ? cn / V * V : 0;
  if (head > 0) cg::memcpy_async(block, sl, src, cuda::aligned_size_t<16>(head * sizeof(TL)));
  for (int j = head + threadIdx.x; j < cn; j += kThreads) sl[j] = src[j];
  cg::wait(block);
  const std::int64_t y = valid_target(p, t);
  const int yl = y >= c0 && y < c0 + cn ? static_cast<int>(y - c0) : -1;  // in this slice
  const int lane = threadIdx.x * V;
  RowAcc acc = RowAcc::empty();
  float sz = 0.0f;
#pragma unroll
  for (int u = 0; u < K; ++u) {
    const int j = lane + u * kStep;
    if (j >= cn) break;
    float z[V];
    load_floats(sl, j, cn, true, z);
    if (j + V > cn) {
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (j + k >= cn) z[k] = -INFINITY;
    }
    float vm = z[0];
#pragma unroll
    for (int k = 1; k < V; ++k) vm = fmaxf(vm, z[k]);
    if (vm > acc.m) {
      int vi = V - 1;
#pragma unroll
      for (int k = V - 1; k >= 0; --k)
        if (z[k] == vm) vi = k;
      acc.s *= __expf(acc.m - vm);
      acc.m = vm;
      acc.arg = static_cast<int>(c0) + j + vi;
    }
#pragma unroll
    for (int k = 0; k < V; ++k) acc.s += __expf(z[k] - acc.m);
    if (p.logit_sums) {
#pragma unroll
      for (int k = 0; k < V; ++k) sz += j + k < cn ? z[k] : 0.0f;
    }
  }
  acc.sz = sz;
  RowAcc r = Reduce(tmp).Reduce(acc, MergeAcc());
  if (threadIdx.x == 0) {
    if (yl >= 0) r.zy = to_float(sl[yl]);
    part = r;
  }
  cluster.sync();
  if (threadIdx.x == 0) {
    RowAcc m = *cluster.map_shared_rank(&part, 0);
    for (unsigned k = 1; k < blocks; ++k) m = MergeAcc()(m, *cluster.map_shared_rank(&part, k));
    out = rank == 0 ? apply_row_rule(p, t, y, m) : row_rule(p, t, y, m).out;
  }
  cluster.sync();
  const float lse = out.lse, a = out.a, b = out.b;
  TG* dst = reinterpret_cast<TG*>(tile + i * ld) + c0;
  const bool zero = a == 0.0f && b == 0.0f;
#pragma unroll
  for (int u = 0; u < K; ++u) {
    const int j = lane + u * kStep;
    if (j >= cn) break;
    float d[V];
    if (zero) {
#pragma unroll
      for (int k = 0; k < V; ++k) d[k] = 0.0f;
    } else {
      float z[V];
      load_floats(sl, j, cn, true, z);
#pragma unroll
      for (int k = 0; k < V; ++k) d[k] = a * __expf(z[k] - lse);
      if (static_cast<unsigned>(yl - j) < static_cast<unsigned>(V)) {
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (k == yl - j) d[k] -= b;
      }
    }
    store_floats<TG, V>(dst, j, cn, vec, d);
  }
#endif
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The single-shot shared-memory kernel with the slice brought in by kParts bulk copies (TMA),
// each completing on its own mbarrier so the statistics start on the first part while the rest
// arrives; the cluster's statistics merged by one warp (fixed tree); the block leaves the
// cluster barrier's wait to its end.
template <typename TL, typename TG, bool kPlain, int kThreads, int kCols>
__global__ void __launch_bounds__(kThreads)
    row_tma_kernel(TokenParams p, TL* tile, std::int64_t ld, std::int64_t r0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int V = kVec<TL>;
  constexpr int kParts = 4;
  constexpr std::int64_t kStep = static_cast<std::int64_t>(kThreads) * V;
  constexpr int K = kCols / kStep;  // vectors per thread
  static_assert(K % kParts == 0);
  using Reduce = cub::BlockReduce<RowAcc, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ RowAcc part;
  __shared__ RowOut out;
  __shared__ alignas(8) unsigned long long bar[kParts];
  extern __shared__ uint4 staged[];
  TL* sl = reinterpret_cast<TL*>(staged);
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank(), blocks = cluster.num_blocks();
  const std::int64_t i = blockIdx.x / blocks, t = r0 + i, n = p.vocab;
  TL* row = tile + i * ld;
  const bool vec = aligned16(tile) && (ld % V) == 0;
  const std::int64_t c0 = static_cast<std::int64_t>(rank) * kCols;
  const std::int64_t cn = n - c0 < kCols ? n - c0 : kCols;
  const std::int64_t head = vec ? cn / V * V : 0;  // columns brought by the bulk copies
  constexpr std::int64_t kPartCols = kCols / kParts;
  if (threadIdx.x == 0) {
    for (int q = 0; q < kParts; ++q)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bar[q])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int q = 0; q < kParts; ++q) {
      const std::int64_t a = q * kPartCols, b = head < a + kPartCols ? head : a + kPartCols;
      const unsigned bytes = b > a ? static_cast<unsigned>((b - a) * sizeof(TL)) : 0u;
      asm volatile(
          "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&bar[q])),
          "r"(bytes)
          : "memory");
      if (bytes)
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(smem_addr(sl + a)),
            "l"(row + c0 + a), "r"(bytes), "r"(smem_addr(&bar[q]))
            : "memory");
    }
  }
  for (std::int64_t j = head + threadIdx.x; j < cn; j += kThreads) sl[j] = row[c0 + j];
  __syncthreads();  // the barriers initialised, the tail stored
  const std::int64_t y = valid_target(p, t);
  const float cap = p.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const bool want_sum = p.rule.eps != 0.0f || p.logit_sums;
  const std::int64_t lane = static_cast<std::int64_t>(threadIdx.x) * V;
  RowAcc acc = RowAcc::empty();
#pragma unroll
  for (int u = 0; u < K; ++u) {
    if (u % (K / kParts) == 0)
      asm volatile(
          "{\n .reg .pred done;\n WAIT_%=:\n"
          " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
          " @!done bra WAIT_%=;\n}" ::"r"(smem_addr(&bar[u / (K / kParts)]))
          : "memory");
    const std::int64_t j = lane + u * kStep;
    if (j < cn) {
      float z[V];
      load_floats(sl, j, cn, true, z);
      add_vector<kPlain>(acc, p, z, c0 + j, n, y, cap, inv_cap, want_sum);
    }
  }
  const RowAcc r = Reduce(tmp).Reduce(acc, MergeAcc());
  if (threadIdx.x == 0) part = r;
  cluster.sync();  // every slice of the row read and reduced
  if (threadIdx.x < 32) {
    const unsigned l = threadIdx.x;
    RowAcc m = l < blocks ? *cluster.map_shared_rank(&part, l) : RowAcc::empty();
    for (unsigned off = 16; off > 0; off /= 2) {
      RowAcc o;
      o.m = __shfl_down_sync(0xffffffffu, m.m, off);
      o.s = __shfl_down_sync(0xffffffffu, m.s, off);
      o.sez = __shfl_down_sync(0xffffffffu, m.sez, off);
      o.sz = __shfl_down_sync(0xffffffffu, m.sz, off);
      o.swz = __shfl_down_sync(0xffffffffu, m.swz, off);
      o.zy = __shfl_down_sync(0xffffffffu, m.zy, off);
      o.arg = __shfl_down_sync(0xffffffffu, m.arg, off);
      if (l + off < 32) m = MergeAcc()(m, o);
    }
    if (l == 0) out = rank == 0 ? apply_row_rule(p, t, y, m) : row_rule(p, t, y, m).out;
  }
  __syncthreads();
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");  // done with `part`s
  const RowOut o = out;
  const bool zero = o.a == 0.0f && o.b == 0.0f && o.g == 0.0f;
  TG* grow = reinterpret_cast<TG*>(row);
#pragma unroll
  for (int u = 0; u < K; ++u) {
    const std::int64_t j = lane + u * kStep;
    if (j >= cn) break;
    float z[V], d[V];
    load_floats(sl, j, cn, true, z);
    grad_vector<kPlain>(d, z, p, o, zero, c0 + j, n, y, 0, cap, inv_cap);
    store_floats<TG, V>(grow, c0 + j, n, vec, d);
  }
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// Launches `kernel` with `blocks` per row, or returns false when this device cannot run such
// clusters (no sm_90 code, no cluster of that size fits).
template <typename TL>
bool launch_clusters(void (*kernel)(TokenParams, TL*, std::int64_t, std::int64_t), int threads,
                     std::size_t smem, const TokenParams& p, TL* tile, std::int64_t ld,
                     std::int64_t r0, std::int64_t rows, int blocks, cudaStream_t s,
                     cudaError_t* err) {
  cudaFuncAttributes fa{};
  const bool ok = cudaFuncGetAttributes(&fa, kernel) == cudaSuccess && fa.binaryVersion >= 90 &&
                  (blocks <= kPortableCluster ||
                   cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed,
                                        1) == cudaSuccess) &&
                  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)) == cudaSuccess;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(rows * blocks));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(blocks);
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  if (!ok || cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess ||
      clusters < 1) {
    cudaGetLastError();  // not an error of the call: the caller falls back
    return false;
  }
  *err = cudaLaunchKernelEx(&cfg, kernel, p, tile, ld, r0);
  return true;
}

int blocks_per_row(std::int64_t vocab, std::int64_t cols) {
  return static_cast<int>((vocab + cols - 1) / cols);
}

template <typename TL, typename TG, bool kPlain>
bool launch_fused(const TokenParams& p, void* tile, std::int64_t ld, std::int64_t r0,
                  std::int64_t rows, cudaStream_t s, cudaError_t* err) {
  TL* t = static_cast<TL*>(tile);
  // Blocks of 256 threads in portable clusters, then of 512, then larger clusters of 256.
  int b = blocks_per_row(p.vocab, kSlice<256>);
  if (b <= kMaxCluster)
    return launch_clusters<TL>(row_fused_kernel<TL, TG, kPlain, 256>, 256, 0, p, t, ld, r0, rows, b,
                               s, err);
  return false;
}

}  // namespace

int launch_row_fused(const TokenParams& p, void* tile, Elem logits_elem, Elem grad_elem,
                     std::int64_t ld, std::int64_t r0, std::int64_t rows, void* stream,
                     bool* launched) {
  *launched = false;
  if (p.partials || p.vocab != p.vocab_total ||
      (logits_elem == Elem::kBF16 && grad_elem == Elem::kF32))
    return 0;
  if (rows == 0) {
    *launched = true;
    return 0;
  }
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaSuccess;
  *launched = CHUNKLOSS_BOOL_SWITCH(plain_rows(p), kPlain, [&] {
    if (logits_elem == Elem::kF32)
      return grad_elem == Elem::kF32
                 ? launch_fused<float, float, kPlain>(p, tile, ld, r0, rows, s, &err)
                 : launch_fused<float, __nv_bfloat16, kPlain>(p, tile, ld, r0, rows, s, &err);
    return launch_fused<__nv_bfloat16, __nv_bfloat16, kPlain>(p, tile, ld, r0, rows, s, &err);
  });
  return static_cast<int>(err);
}

}  // namespace chunkloss::kern
