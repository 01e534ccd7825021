// The fused row epilogue of the token-chunk order: one thread-block cluster per row. Each block
// copies a slice of the row's logits into shared memory (cp.async, all of it in flight at once)
// and sums the slice's statistics; the blocks merge their partial statistics through distributed
// shared memory (every block in the same fixed order, so they agree bit for bit), and each writes
// dL/dz over its slice. The logits are read from DRAM once, where row_stats_kernel and
// grad_epilogue_kernel read them twice.
#include <cooperative_groups.h>

#include <cstdlib>
#include <cub/block/block_reduce.cuh>

#include "device_util.cuh"
#include "row_acc.cuh"

namespace chunkloss::kern {
namespace {

namespace cg = cooperative_groups;

constexpr int kFusedThreads = 256;
/// Clusters above 8 blocks are non-portable; Hopper runs 16.
constexpr int kMaxCluster = 16;

/// A block's slice of a row of `vocab` logits split over `blocks`, rounded up to whole 16-byte
/// vectors of fp32 and bf16 alike (8 elements).
std::int64_t slice_elems(std::int64_t vocab, int blocks) {
  const std::int64_t s = (vocab + blocks - 1) / blocks;
  return (s + 7) / 8 * 8;
}

/// The smallest cluster whose blocks hold a row in 32 KiB of fp32 each (seven blocks to an SM),
/// else in 64 KiB (three); 0 when none does.
int cluster_blocks(std::int64_t vocab) {
  const char* e = getenv("CHUNKLOSS_SLICE_FLOATS");
  const std::int64_t first = e ? atoll(e) : 8192;
  for (std::int64_t cap : {first, std::int64_t{16384}})
    for (int c = 1; c <= kMaxCluster; c *= 2)
      if (slice_elems(vocab, c) <= cap) return c;
  return 0;
}

template <typename TL, typename TG, bool kPlain>
__global__ void __launch_bounds__(kFusedThreads)
    row_fused_kernel(TokenParams p, TL* tile, std::int64_t ld, std::int64_t r0,
                     std::int64_t slice) {
  using Reduce = cub::BlockReduce<RowAcc, kFusedThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ RowAcc part;  // this block's statistics, read by the whole cluster
  __shared__ RowOut out;
  extern __shared__ float4 held_raw[];
  float* held = reinterpret_cast<float*>(held_raw);  // columns [c0, c0 + count) as fp32
  constexpr int V = kVec<TL>;
  static_assert(V % 4 == 0, "a vector is whole float4s of shared memory");
  constexpr std::int64_t kStep = static_cast<std::int64_t>(kFusedThreads) * V;

  const cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank(), blocks = cluster.num_blocks();
  const std::int64_t i = blockIdx.x / blocks, t = r0 + i, n = p.vocab;
  TL* row = tile + i * ld;
  const bool vec = aligned16(tile) && (ld % V) == 0;
  const std::int64_t c0 = rank * slice;
  const std::int64_t c1 = c0 + slice < n ? c0 + slice : n;
  const std::int64_t y = valid_target(p, t);
  const float cap = p.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const bool want_sum = p.rule.eps != 0.0f || p.logit_sums;
  const std::int64_t lane = static_cast<std::int64_t>(threadIdx.x) * V;

  // The slice into shared memory (kLoads vectors in flight per thread) and its statistics.
  RowAcc acc = RowAcc::empty();
  for (std::int64_t base = c0 + lane; base < c1; base += kStep * kLoads) {
    float z[kLoads][V];
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
      if (base + u * kStep < c1) load_floats(row, base + u * kStep, n, vec, z[u]);
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const std::int64_t j = base + u * kStep;
      if (j >= c1) break;
      float4* dst = reinterpret_cast<float4*>(held + (j - c0));
#pragma unroll
      for (int q = 0; q < V / 4; ++q)
        dst[q] = make_float4(z[u][4 * q], z[u][4 * q + 1], z[u][4 * q + 2], z[u][4 * q + 3]);
      accumulate_vector<V, kPlain>(acc, p, z[u], j, n, y, cap, inv_cap, want_sum);
    }
  }
  const RowAcc r = Reduce(tmp).Reduce(acc, MergeAcc());
  if (threadIdx.x == 0) part = r;
  // Every block has read its slice (so the stores below cannot overwrite logits another block
  // has yet to read) and has published its statistics.
  cluster.sync();
  if (threadIdx.x == 0) {
    RowAcc m = *cluster.map_shared_rank(&part, 0);
    for (unsigned b = 1; b < blocks; ++b) m = MergeAcc()(m, *cluster.map_shared_rank(&part, b));
    out = apply_row_rule(p, t, y, m, rank == 0);
  }
  __syncthreads();
  cluster.barrier_arrive();  // done with the other blocks' `part`; waited for before exiting
  const RowOut o = out;
  TG* grow = reinterpret_cast<TG*>(row);
  for (std::int64_t j = c0 + lane; j < c1; j += kStep) {
    float z[V], d[V];
    const float4* src = reinterpret_cast<const float4*>(held + (j - c0));
#pragma unroll
    for (int q = 0; q < V / 4; ++q) {
      const float4 f = src[q];
      z[4 * q] = f.x;
      z[4 * q + 1] = f.y;
      z[4 * q + 2] = f.z;
      z[4 * q + 3] = f.w;
    }
    grad_vector<V, kPlain>(d, z, p, o, j, n, 0, y, cap, inv_cap);
    store_floats<TG, V>(grow, j, n, vec, d);
  }
  cluster.barrier_wait();
}

template <typename TL, typename TG>
int fused_launch(const TokenParams& p, TL* tile, std::int64_t ld, std::int64_t r0,
                 std::int64_t rows, cudaStream_t s) {
  const int blocks = cluster_blocks(p.vocab);
  const std::int64_t slice = slice_elems(p.vocab, blocks);
  return CHUNKLOSS_BOOL_SWITCH(plain_rows(p), kPlain, [&] {
    auto* kernel = row_fused_kernel<TL, TG, kPlain>;
    const auto smem = static_cast<std::size_t>(slice) * sizeof(float);
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    if (e == cudaSuccess && blocks > 8)
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) return static_cast<int>(e);
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(rows * blocks));
    cfg.blockDim = dim3(kFusedThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = static_cast<unsigned>(blocks);
    cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
    cfg.attrs = &cluster;
    cfg.numAttrs = 1;
    return static_cast<int>(cudaLaunchKernelEx(&cfg, kernel, p, tile, ld, r0, slice));
  });
}

}  // namespace

bool row_fused_fits(std::int64_t vocab) {
  int device = 0, clusters = 0;
  if (cluster_blocks(vocab) == 0 || cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&clusters, cudaDevAttrClusterLaunch, device) != cudaSuccess)
    return false;
  return clusters != 0;
}

int launch_row_fused(const TokenParams& p, void* tile, Elem logits_elem, Elem grad_elem,
                     std::int64_t ld, std::int64_t r0, std::int64_t rows, void* stream) {
  if (rows == 0) return 0;
  if (!row_fused_fits(p.vocab) || (logits_elem == Elem::kBF16 && grad_elem == Elem::kF32))
    return static_cast<int>(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  if (logits_elem == Elem::kBF16)
    return fused_launch<__nv_bfloat16, __nv_bfloat16>(p, static_cast<__nv_bfloat16*>(tile), ld, r0,
                                                      rows, s);
  if (grad_elem == Elem::kF32)
    return fused_launch<float, float>(p, static_cast<float*>(tile), ld, r0, rows, s);
  return fused_launch<float, __nv_bfloat16>(p, static_cast<float*>(tile), ld, r0, rows, s);
}

}  // namespace chunkloss::kern
