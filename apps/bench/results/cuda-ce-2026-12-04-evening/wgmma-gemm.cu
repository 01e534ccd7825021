// A throwaway probe beside the 2026-12-04 evening results (not built; wgmma-gemm.txt): a
// hand-written Hopper GEMM (TMA, mbarriers, wgmma, warp-specialised, persistent) for the logits
// chunk, C[M, N] (fp32, row-major) = A[M, K] B[N, K]^T (bf16, K-major), against cublasGemmEx at
// the same shape: can a GEMM of our own, whose epilogue then computes the row statistics, run as
// fast as cuBLAS's? Variants: gemm_kernel (128 x 256 tiles, two consumer warpgroups on one tile)
// without and with the statistics in its epilogue; gemm_epi_kernel (the statistics from the stored
// tile by the producer warpgroup's other three warps); pp_kernel (each consumer warpgroup owns
// whole 128 x 128 tiles in turn), without and with the statistics; mc_kernel (pp_kernel in
// clusters of CM x CN CTAs sharing operand tiles by TMA multicast). The last run's main() times
// the ping-pong and cluster variants against cuBLASLt's first heuristic algorithm, the one the
// library's GEMMs run; the earlier runs' main() printed the lines of wgmma-gemm.txt's runs 1-4.
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o wgmma-gemm wgmma-gemm.cu -lcublas -lcublasLt
//   ./wgmma-gemm M N K [1: gemm_epi_kernel as "ours + stats epilogue"]
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <vector>
#define CK(x)                                                 \
  do {                                                        \
    auto e_ = (x);                                            \
    if ((int)e_) {                                            \
      printf("fail %s: %d line %d\n", #x, (int)e_, __LINE__); \
      exit(1);                                                \
    }                                                         \
  } while (0)
using bf16 = __nv_bfloat16;

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;

__device__ __forceinline__ std::uint32_t su32(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(std::uint64_t* b, std::uint32_t n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(su32(b)), "r"(n));
}
__device__ __forceinline__ void mbar_expect_tx(std::uint64_t* b, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(b)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(su32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(std::uint64_t* b, std::uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nW%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra W%=;\n}\n" ::"r"(su32(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, std::uint64_t* bar,
                                         int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, "
      "%4}], [%2];" ::"r"(su32(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(su32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
// K-major, 128-byte swizzle: 8-row groups 1024 bytes apart.
__device__ __forceinline__ std::uint64_t sdesc(const void* p) {
  std::uint64_t d = (su32(p) & 0x3FFFF) >> 4;
  d |= std::uint64_t{1} << 16;
  d |= std::uint64_t{1024 >> 4} << 32;
  d |= std::uint64_t{1} << 62;
  return d;
}
__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], std::uint64_t da,
                                                 std::uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, "
      "%63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, "
      "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, "
      "%99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, "
      "%114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, "
      "%129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_m64n128k16(float* d, std::uint64_t da, std::uint64_t db,
                                                 int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, "
      "%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

// Block: warpgroup 0 loads (one thread), warpgroups 1 and 2 each multiply 64 rows of the 128 x 256
// tile. Persistent over tiles, M fastest (the CTAs in flight share B's tile in L2).
struct Part {
  float m, s, zy;
  int arg;
};
template <bool STATS>
__global__ void __launch_bounds__(384, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                float* C, int M, int N, int K, const int* tgt, Part* part) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t{1023});
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem + STAGES * STAGE_BYTES);
  std::uint64_t* empty = full + STAGES;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int mt = M / BM, nt = N / BN, tiles = mt * nt, kb_n = K / BK;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (t != 0) return;
    int s = 0;
    std::uint32_t ph = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const int m0 = (tile % mt) * BM, n0 = (tile / mt) * BN;
      for (int kb = 0; kb < kb_n; ++kb) {
        mbar_wait(&empty[s], ph ^ 1);
        unsigned char* st = smem + s * STAGE_BYTES;
        mbar_expect_tx(&full[s], STAGE_BYTES);
        tma_load(st, &ta, &full[s], kb * BK, m0);
        tma_load(st + A_BYTES, &tb, &full[s], kb * BK, n0);
        if (++s == STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int c = wg - 1, warp = t / 32, lane = t % 32;
  float acc[128];
  int s = 0;
  std::uint32_t ph = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int m0 = (tile % mt) * BM, n0 = (tile / mt) * BN;
    int prev = -1;
    for (int kb = 0; kb < kb_n; ++kb) {
      mbar_wait(&full[s], ph);
      unsigned char* st = smem + s * STAGE_BYTES;
      const std::uint64_t da = sdesc(st + c * (A_BYTES / 2)), db = sdesc(st + A_BYTES);
      wg_fence();
#pragma unroll
      for (int k = 0; k < BK / 16; ++k)
        wgmma_m64n256k16(acc, da + 2 * k, db + 2 * k, (kb | k) != 0);
      wg_commit();
      wg_wait<1>();
      if (prev >= 0 && t == 0) mbar_arrive(&empty[prev]);
      prev = s;
      if (++s == STAGES) {
        s = 0;
        ph ^= 1;
      }
    }
    wg_wait<0>();
    if (t == 0) mbar_arrive(&empty[prev]);
    const int r = m0 + c * 64 + warp * 16 + lane / 4;
    if constexpr (STATS) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int y = tgt[r + 8 * h] - n0;
        float vm = -INFINITY, zy = 0;
        int arg = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < 32; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = 8 * j + 2 * (lane % 4) + e;
            const float z = acc[4 * j + 2 * h + e];
            if (z > vm) {
              vm = z;
              arg = n0 + col;
            }
            if (col == y) zy = z;
          }
        float sm = 0;
#pragma unroll
        for (int j = 0; j < 32; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) sm += __expf(acc[4 * j + 2 * h + e] - vm);
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
          const float m2 = __shfl_xor_sync(~0u, vm, o), s2 = __shfl_xor_sync(~0u, sm, o),
                      z2 = __shfl_xor_sync(~0u, zy, o);
          const int a2 = __shfl_xor_sync(~0u, arg, o);
          const float M2 = fmaxf(vm, m2);
          sm = sm * __expf(vm - M2) + s2 * __expf(m2 - M2);
          arg = vm > m2 ? arg : m2 > vm ? a2 : min(arg, a2);
          vm = M2;
          zy += z2;
        }
        if (lane % 4 == 0) part[(r + 8 * h) * (N / BN) + n0 / BN] = {vm, sm, zy, arg};
      }
    }
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = n0 + 8 * j + 2 * (lane % 4);
      *reinterpret_cast<float2*>(C + static_cast<std::int64_t>(r) * N + col) =
          make_float2(acc[4 * j], acc[4 * j + 1]);
      *reinterpret_cast<float2*>(C + static_cast<std::int64_t>(r + 8) * N + col) =
          make_float2(acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
}

// The same GEMM with a fourth warpgroup that computes each tile's row statistics from the fp32
// tile the consumers stored (read back from L2), while the consumers run the next tile.
__global__ void __launch_bounds__(384, 1)
    gemm_epi_kernel(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                    float* C, int M, int N, int K, const int* tgt, Part* part) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t{1023});
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem + STAGES * STAGE_BYTES);
  std::uint64_t* empty = full + STAGES;
  std::uint64_t* tile_full = empty + STAGES;  // [2]: a stored tile, for the statistics
  std::uint64_t* tile_free = tile_full + 2;   // [2]: its statistics done
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 2);
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(&tile_full[s], 256);
      mbar_init(&tile_free[s], 96);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int mt = M / BM, nt = N / BN, tiles = mt * nt, kb_n = K / BK;
  if (wg == 0) asm volatile("setmaxnreg.dec.sync.aligned.u32 72;\n" ::: "memory");
  if (wg == 0 && t < 32) {
    if (t != 0) return;
    int s = 0;
    std::uint32_t ph = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const int m0 = (tile % mt) * BM, n0 = (tile / mt) * BN;
      for (int kb = 0; kb < kb_n; ++kb) {
        mbar_wait(&empty[s], ph ^ 1);
        unsigned char* st = smem + s * STAGE_BYTES;
        mbar_expect_tx(&full[s], STAGE_BYTES);
        tma_load(st, &ta, &full[s], kb * BK, m0);
        tma_load(st + A_BYTES, &tb, &full[s], kb * BK, n0);
        if (++s == STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
    }
    return;
  }
  if (wg == 0) {
    const int w = t / 32 - 1, lane = t % 32;
    int i = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++i) {
      const int m0 = (tile % mt) * BM, n0 = (tile / mt) * BN;
      mbar_wait(&tile_full[i & 1], (i >> 1) & 1);
      // Rows w, w + 3, ... in batches of 4, their loads all issued first.
      for (int rb = w; rb < BM; rb += 12) {
        float z[4][8];
        int y[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const int rr = rb + 3 * b;
          if (rr < BM) {
            const float4* row =
                reinterpret_cast<const float4*>(C + static_cast<std::int64_t>(m0 + rr) * N + n0);
            const float4 v0 = row[lane], v1 = row[32 + lane];
            z[b][0] = v0.x;
            z[b][1] = v0.y;
            z[b][2] = v0.z;
            z[b][3] = v0.w;
            z[b][4] = v1.x;
            z[b][5] = v1.y;
            z[b][6] = v1.z;
            z[b][7] = v1.w;
            y[b] = tgt[m0 + rr] - n0;
          } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) z[b][k] = -INFINITY;
            y[b] = -1;
          }
        }
        float m[4], sm[4], zy[4];
        int arg[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          m[b] = z[b][0];
          arg[b] = 4 * lane;
          zy[b] = 0;
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            const int col = (k < 4 ? 4 * lane : 128 + 4 * lane) + (k & 3);
            if (z[b][k] > m[b]) {
              m[b] = z[b][k];
              arg[b] = col;
            }
            if (col == y[b]) zy[b] = z[b][k];
          }
          sm[b] = 0;
#pragma unroll
          for (int k = 0; k < 8; ++k) sm[b] += __expf(z[b][k] - m[b]);
        }
#pragma unroll
        for (int o = 1; o < 32; o <<= 1)
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const float m2 = __shfl_xor_sync(~0u, m[b], o), s2 = __shfl_xor_sync(~0u, sm[b], o),
                        z2 = __shfl_xor_sync(~0u, zy[b], o);
            const int a2 = __shfl_xor_sync(~0u, arg[b], o);
            const float M2 = fmaxf(m[b], m2);
            sm[b] = sm[b] * __expf(m[b] - M2) + s2 * __expf(m2 - M2);
            arg[b] = m[b] > m2 ? arg[b] : m2 > m[b] ? a2 : min(arg[b], a2);
            m[b] = M2;
            zy[b] += z2;
          }
        if (lane < 4) {
          const int b = lane;
          float mb = m[0], sb = sm[0], zb = zy[0];
          int ab = arg[0];
#pragma unroll
          for (int q = 1; q < 4; ++q)
            if (b == q) {
              mb = m[q];
              sb = sm[q];
              zb = zy[q];
              ab = arg[q];
            }
          const int rr = rb + 3 * b;
          if (rr < BM)
            part[static_cast<std::int64_t>(m0 + rr) * nt + n0 / BN] = {mb, sb, zb, n0 + ab};
        }
      }
      mbar_arrive(&tile_free[i & 1]);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 216;\n" ::: "memory");
  const int c = wg - 1, warp = t / 32, lane = t % 32;
  float acc[128];
  int s = 0;
  std::uint32_t ph = 0;
  int i = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++i) {
    const int m0 = (tile % mt) * BM, n0 = (tile / mt) * BN;
    int prev = -1;
    for (int kb = 0; kb < kb_n; ++kb) {
      mbar_wait(&full[s], ph);
      unsigned char* st = smem + s * STAGE_BYTES;
      const std::uint64_t da = sdesc(st + c * (A_BYTES / 2)), db = sdesc(st + A_BYTES);
      wg_fence();
#pragma unroll
      for (int k = 0; k < BK / 16; ++k)
        wgmma_m64n256k16(acc, da + 2 * k, db + 2 * k, (kb | k) != 0);
      wg_commit();
      wg_wait<1>();
      if (prev >= 0 && t == 0) mbar_arrive(&empty[prev]);
      prev = s;
      if (++s == STAGES) {
        s = 0;
        ph ^= 1;
      }
    }
    wg_wait<0>();
    if (t == 0) mbar_arrive(&empty[prev]);
    mbar_wait(&tile_free[i & 1], ((i >> 1) & 1) ^ 1);
    const int r = m0 + c * 64 + warp * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = n0 + 8 * j + 2 * (lane % 4);
      *reinterpret_cast<float2*>(C + static_cast<std::int64_t>(r) * N + col) =
          make_float2(acc[4 * j], acc[4 * j + 1]);
      *reinterpret_cast<float2*>(C + static_cast<std::int64_t>(r + 8) * N + col) =
          make_float2(acc[4 * j + 2], acc[4 * j + 3]);
    }
    mbar_arrive(&tile_full[i & 1]);
  }
}

// Cluster helpers: a multicast TMA load, a remote mbarrier arrive, the cluster barrier.
__device__ __forceinline__ void tma_load_mc(void* dst, const CUtensorMap* map, std::uint64_t* bar,
                                            int c0, int c1, std::uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::"
      "cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(su32(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(su32(bar)), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive_remote(std::uint64_t* b, unsigned rank) {
  asm volatile(
      "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(su32(b)),
      "r"(rank)
      : "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                   : "memory");
}

// Ping-pong: each consumer warpgroup owns whole 128 x 128 tiles, alternately, so one's epilogue
// (statistics and stores) runs while the other multiplies.
constexpr int PBN = 128, PSTAGES = 6, PB_BYTES = PBN * BK * 2, PSTAGE_BYTES = A_BYTES + PB_BYTES;
template <bool STATS>
__global__ void __launch_bounds__(384, 1)
    pp_kernel(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
              float* C, int M, int N, int K, const int* tgt, Part* part) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t{1023});
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem + PSTAGES * PSTAGE_BYTES);
  std::uint64_t* empty = full + PSTAGES;
  std::uint64_t* turn = empty + PSTAGES;  // [2]: whose mainloop is next
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < PSTAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 1);
    }
    mbar_init(&turn[0], 1);
    mbar_init(&turn[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int mt = M / BM, nt = N / PBN, tiles = mt * nt, kb_n = K / BK;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (t != 0) return;
    int s = 0;
    std::uint32_t ph = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const int m0 = (tile % mt) * BM, n0 = (tile / mt) * PBN;
      for (int kb = 0; kb < kb_n; ++kb) {
        mbar_wait(&empty[s], ph ^ 1);
        unsigned char* st = smem + s * PSTAGE_BYTES;
        mbar_expect_tx(&full[s], PSTAGE_BYTES);
        tma_load(st, &ta, &full[s], kb * BK, m0);
        tma_load(st + A_BYTES, &tb, &full[s], kb * BK, n0);
        if (++s == PSTAGES) {
          s = 0;
          ph ^= 1;
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int c = wg - 1, warp = t / 32, lane = t % 32;
  float acc[2][64];
  int j = 0;
  for (int tile = blockIdx.x + c * gridDim.x; tile < tiles; tile += 2 * gridDim.x, j += 2) {
    const int m0 = (tile % mt) * BM, n0 = (tile / mt) * PBN;
    const long base = static_cast<long>(j + c) * kb_n;
    // Mainloops alternate (a waiter on a stage must be within one phase of it).
    mbar_wait(&turn[c], static_cast<std::uint32_t>(((j >> 1) & 1) ^ (c == 0 ? 1 : 0)));
    int prev = -1;
    for (int kb = 0; kb < kb_n; ++kb) {
      const long pos = base + kb;
      const int s = static_cast<int>(pos % PSTAGES);
      mbar_wait(&full[s], static_cast<std::uint32_t>((pos / PSTAGES) & 1));
      unsigned char* st = smem + s * PSTAGE_BYTES;
      const std::uint64_t da = sdesc(st), db = sdesc(st + A_BYTES);
      wg_fence();
#pragma unroll
      for (int k = 0; k < BK / 16; ++k) {
        wgmma_m64n128k16(acc[0], da + 2 * k, db + 2 * k, (kb | k) != 0);
        wgmma_m64n128k16(acc[1], da + (A_BYTES / 2 >> 4) + 2 * k, db + 2 * k, (kb | k) != 0);
      }
      wg_commit();
      wg_wait<1>();
      if (prev >= 0 && t == 0) mbar_arrive(&empty[prev]);
      prev = s;
    }
    wg_wait<0>();
    if (t == 0) {
      mbar_arrive(&empty[prev]);
      mbar_arrive(&turn[c ^ 1]);
    }
#pragma unroll
    for (int mb = 0; mb < 2; ++mb) {
      const int r = m0 + mb * 64 + warp * 16 + lane / 4;
      if constexpr (STATS) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int y = tgt[r + 8 * h] - n0;
          float vm = -INFINITY, zy = 0;
          int arg = 0x7fffffff;
#pragma unroll
          for (int q = 0; q < 16; ++q)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = 8 * q + 2 * (lane % 4) + e;
              const float z = acc[mb][4 * q + 2 * h + e];
              if (z > vm) {
                vm = z;
                arg = n0 + col;
              }
              if (col == y) zy = z;
            }
#pragma unroll
          for (int o = 1; o <= 2; o <<= 1) {
            const float m2 = __shfl_xor_sync(~0u, vm, o), z2 = __shfl_xor_sync(~0u, zy, o);
            const int a2 = __shfl_xor_sync(~0u, arg, o);
            arg = vm > m2 ? arg : m2 > vm ? a2 : min(arg, a2);
            vm = fmaxf(vm, m2);
            zy += z2;
          }
          float sm = 0;
#pragma unroll
          for (int q = 0; q < 16; ++q)
#pragma unroll
            for (int e = 0; e < 2; ++e) sm += __expf(acc[mb][4 * q + 2 * h + e] - vm);
          sm += __shfl_xor_sync(~0u, sm, 1);
          sm += __shfl_xor_sync(~0u, sm, 2);
          if (lane % 4 == 0)
            part[static_cast<std::int64_t>(r + 8 * h) * nt + n0 / PBN] = {vm, sm, zy, arg};
        }
      }
#pragma unroll
      for (int q = 0; q < 16; ++q) {
        const int col = n0 + 8 * q + 2 * (lane % 4);
        *reinterpret_cast<float2*>(C + static_cast<std::int64_t>(r) * N + col) =
            make_float2(acc[mb][4 * q], acc[mb][4 * q + 1]);
        *reinterpret_cast<float2*>(C + static_cast<std::int64_t>(r + 8) * N + col) =
            make_float2(acc[mb][4 * q + 2], acc[mb][4 * q + 3]);
      }
    }
  }
}

// Ping-pong as pp_kernel, in clusters of CM x CN CTAs: CTA (cm, cn) of a cluster takes tile
// (CM SM + cm, CN SN + cn) of each super-tile (SM, SN); the CTAs of a cluster row share the X
// tile and those of a cluster column the W tile, each loading its part once for all of them
// (TMA multicast). A stage is free again when every CTA it was written into has released it.
template <int CM, int CN, bool STATS>
__global__ void __launch_bounds__(384, 1)
    mc_kernel(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
              float* C, int M, int N, int K, const int* tgt, Part* part) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t{1023});
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem + PSTAGES * PSTAGE_BYTES);
  std::uint64_t* empty = full + PSTAGES;
  std::uint64_t* turn = empty + PSTAGES;
  constexpr int CS = CM * CN;
  const unsigned rank = cluster_rank();
  const int cm = static_cast<int>(rank) % CM, cn = static_cast<int>(rank) / CM;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < PSTAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], CM + CN - 1);
    }
    mbar_init(&turn[0], 1);
    mbar_init(&turn[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();
  const int mt = M / BM, nt = N / PBN, kb_n = K / BK;
  const int smt = (mt + CM - 1) / CM, snt = (nt + CN - 1) / CN, supers = smt * snt;
  const int cluster = blockIdx.x / CS, clusters = gridDim.x / CS;
  // X rows [cn * 128 / CN, ...) go to the cluster row (cm, *), W rows [cm * 128 / CM, ...) to
  // the cluster column (*, cn).
  std::uint16_t xmask = 0, wmask = 0;
  for (int k = 0; k < CN; ++k) xmask |= std::uint16_t(1u << (k * CM + cm));
  for (int k = 0; k < CM; ++k) wmask |= std::uint16_t(1u << (cn * CM + k));
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (t == 0) {
      int s = 0;
      std::uint32_t ph = 0;
      for (int st_ = cluster; st_ < supers; st_ += clusters) {
        const int m0 = ((st_ % smt) * CM + cm) * BM, n0 = ((st_ / smt) * CN + cn) * PBN;
        for (int kb = 0; kb < kb_n; ++kb) {
          mbar_wait(&empty[s], ph ^ 1);
          unsigned char* stg = smem + s * PSTAGE_BYTES;
          mbar_expect_tx(&full[s], PSTAGE_BYTES);
          const int xr = cn * (BM / CN), wr = cm * (PBN / CM);
          if constexpr (CN > 1)
            tma_load_mc(stg + xr * 128, &ta, &full[s], kb * BK, m0 + xr, xmask);
          else
            tma_load(stg, &ta, &full[s], kb * BK, m0);
          if constexpr (CM > 1)
            tma_load_mc(stg + A_BYTES + wr * 128, &tb, &full[s], kb * BK, n0 + wr, wmask);
          else
            tma_load(stg + A_BYTES, &tb, &full[s], kb * BK, n0);
          if (++s == PSTAGES) {
            s = 0;
            ph ^= 1;
          }
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int c = wg - 1, warp = t / 32, lane = t % 32;
    // The stage's writers: this CTA's cluster row and column.
    auto release = [&](int s) {
      for (int k = 0; k < CN; ++k) mbar_arrive_remote(&empty[s], k * CM + cm);
      for (int k = 0; k < CM; ++k)
        if (k != cm) mbar_arrive_remote(&empty[s], cn * CM + k);
    };
    float acc[2][64];
    int j = c;
    for (int st_ = cluster + c * clusters; st_ < supers; st_ += 2 * clusters, j += 2) {
      const int m0 = ((st_ % smt) * CM + cm) * BM, n0 = ((st_ / smt) * CN + cn) * PBN;
      mbar_wait(&turn[c], static_cast<std::uint32_t>(((j >> 1) & 1) ^ (c == 0 ? 1 : 0)));
      int prev = -1;
      for (int kb = 0; kb < kb_n; ++kb) {
        const long pos = static_cast<long>(j) * kb_n + kb;
        const int s = static_cast<int>(pos % PSTAGES);
        mbar_wait(&full[s], static_cast<std::uint32_t>((pos / PSTAGES) & 1));
        unsigned char* stg = smem + s * PSTAGE_BYTES;
        const std::uint64_t da = sdesc(stg), db = sdesc(stg + A_BYTES);
        wg_fence();
#pragma unroll
        for (int k = 0; k < BK / 16; ++k) {
          wgmma_m64n128k16(acc[0], da + 2 * k, db + 2 * k, (kb | k) != 0);
          wgmma_m64n128k16(acc[1], da + (A_BYTES / 2 >> 4) + 2 * k, db + 2 * k, (kb | k) != 0);
        }
        wg_commit();
        wg_wait<1>();
        if (prev >= 0 && t == 0) release(prev);
        prev = s;
      }
      wg_wait<0>();
      if (t == 0) {
        release(prev);
        mbar_arrive(&turn[c ^ 1]);
      }
      const bool live = m0 < M && n0 < N;
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) {
        const int r = m0 + mb * 64 + warp * 16 + lane / 4;
        if constexpr (STATS) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int y = live ? tgt[r + 8 * h] - n0 : -1;
            float vm = -INFINITY, zy = 0;
#pragma unroll
            for (int q = 0; q < 16; ++q)
#pragma unroll
              for (int e = 0; e < 2; ++e) vm = fmaxf(vm, acc[mb][4 * q + 2 * h + e]);
            vm = fmaxf(vm, __shfl_xor_sync(~0u, vm, 1));
            vm = fmaxf(vm, __shfl_xor_sync(~0u, vm, 2));
            float sm = 0;
            int first = PBN;
#pragma unroll
            for (int q = 0; q < 16; ++q)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int col = 8 * q + 2 * (lane % 4) + e;
                const float z = acc[mb][4 * q + 2 * h + e];
                sm += __expf(z - vm);
                if (z == vm && col < first) first = col;
                if (col == y) zy = z;
              }
            sm += __shfl_xor_sync(~0u, sm, 1);
            sm += __shfl_xor_sync(~0u, sm, 2);
            zy += __shfl_xor_sync(~0u, zy, 1);
            zy += __shfl_xor_sync(~0u, zy, 2);
            first = min(first, __shfl_xor_sync(~0u, first, 1));
            first = min(first, __shfl_xor_sync(~0u, first, 2));
            if (live && lane % 4 == 0)
              part[static_cast<std::int64_t>(r + 8 * h) * nt + n0 / PBN] = {vm, sm, zy, n0 + first};
          }
        }
        if (live) {
#pragma unroll
          for (int q = 0; q < 16; ++q) {
            const int col = n0 + 8 * q + 2 * (lane % 4);
            *reinterpret_cast<float2*>(C + static_cast<std::int64_t>(r) * N + col) =
                make_float2(acc[mb][4 * q], acc[mb][4 * q + 1]);
            *reinterpret_cast<float2*>(C + static_cast<std::int64_t>(r + 8) * N + col) =
                make_float2(acc[mb][4 * q + 2], acc[mb][4 * q + 3]);
          }
        }
      }
    }
  }
  __syncwarp();
  cluster_sync();  // no CTA leaves while a peer may still write into it or arrive on it
}

__global__ void fill(bf16* p, size_t n, float sc, std::uint64_t key) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    std::uint64_t z = key + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    float u1 = ((z >> 40) + 0.5f) * 0x1p-24f, u2 = ((z >> 8) & 0xffffff) * 0x1p-24f;
    p[i] = __float2bfloat16_rn(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2) * sc);
  }
}
__global__ void diff(const float* a, const float* b, size_t n, float* out) {
  float m = 0, r = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    m = fmaxf(m, fabsf(a[i] - b[i]));
    r = fmaxf(r, fabsf(b[i]));
  }
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));
  atomicMax(reinterpret_cast<int*>(out + 1), __float_as_int(r));
}

using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                              const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                              const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
CUtensorMap make_map(EncodeFn enc, const bf16* p, int rows, int k, int box_rows) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k) * 2};
  const cuuint32_t box[2] = {BK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t es[2] = {1, 1};
  CK(enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16*>(p), dims, strides, box, es,
         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  return m;
}

int main(int argc, char** argv) {
  const int M = atoi(argv[1]), N = atoi(argv[2]), K = atoi(argv[3]);
  if (M % BM || N % BN || K % BK) {
    printf("shape must be multiples of %d x %d x %d\n", BM, BN, BK);
    return 1;
  }
  EncodeFn enc;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&enc),
                             cudaEnableDefault, &q));
  bf16 *A, *B;
  float *C, *R, *d;
  CK(cudaMalloc(&A, (size_t)M * K * 2));
  CK(cudaMalloc(&B, (size_t)N * K * 2));
  CK(cudaMalloc(&C, (size_t)M * N * 4));
  CK(cudaMalloc(&R, (size_t)M * N * 4));
  CK(cudaMalloc(&d, 8));
  fill<<<2048, 256>>>(A, (size_t)M * K, 1.f, 0x1234);
  fill<<<2048, 256>>>(B, (size_t)N * K, 2.f / sqrtf((float)K), 0x9876);
  const CUtensorMap ta = make_map(enc, A, M, K, BM), tb = make_map(enc, B, N, K, BN),
                    tb128 = make_map(enc, B, N, K, PBN);
  const int smem = STAGES * STAGE_BYTES + 1024 + 2 * STAGES * 8 + 32;
  CK(cudaFuncSetAttribute(gemm_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(gemm_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(gemm_epi_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int* tgt;
  Part* part;
  CK(cudaMalloc(&tgt, M * 4));
  CK(cudaMalloc(&part, (size_t)M * (N / PBN) * sizeof(Part)));
  const int psmem = PSTAGES * PSTAGE_BYTES + 1024 + 2 * PSTAGES * 8 + 16;
  CK(cudaFuncSetAttribute(pp_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, psmem));
  CK(cudaFuncSetAttribute(pp_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, psmem));
  {
    std::vector<int> ht(M);
    for (int i = 0; i < M; ++i) ht[i] = (int)((i * 2654435761ull) % N);
    CK(cudaMemcpy(tgt, ht.data(), M * 4, cudaMemcpyHostToDevice));
  }
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int tiles = (M / BM) * (N / BN), grid = std::min(tiles, sms);
  cublasHandle_t h;
  CK(cublasCreate(&h));
  void* ws;
  CK(cudaMalloc(&ws, 64 << 20));
  CK(cublasSetWorkspace(h, ws, 64 << 20));
  auto ours = [&] { gemm_kernel<false><<<grid, 384, smem>>>(ta, tb, C, M, N, K, tgt, part); };
  const bool epi = argc > 4 && atoi(argv[4]) == 1;
  const int ptiles = (M / BM) * (N / PBN), pgrid = std::min(ptiles, sms);
  auto pp = [&] { pp_kernel<false><<<pgrid, 384, psmem>>>(ta, tb128, C, M, N, K, tgt, part); };
  auto pp_stats = [&] { pp_kernel<true><<<pgrid, 384, psmem>>>(ta, tb128, C, M, N, K, tgt, part); };
  auto ours_stats = [&] {
    if (epi)
      gemm_epi_kernel<<<grid, 384, smem>>>(ta, tb, C, M, N, K, tgt, part);
    else
      gemm_kernel<true><<<grid, 384, smem>>>(ta, tb, C, M, N, K, tgt, part);
  };
  auto theirs = [&] {
    const float one = 1, zero = 0;
    CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, K, A, CUDA_R_16BF,
                    K, &zero, R, CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  ours();
  theirs();
  CK(cudaDeviceSynchronize());
  CK(cudaMemset(d, 0, 8));
  diff<<<1024, 256>>>(C, R, (size_t)M * N, d);
  float hd[2];
  CK(cudaMemcpy(hd, d, 8, cudaMemcpyDeviceToHost));
  printf("M %d N %d K %d: max |ours - cuBLAS| %.3g (max |C| %.3g)\n", M, N, K, hd[0], hd[1]);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto timeit = [&](auto&& f) {
    CK(cudaEventRecord(e0));
    f();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms;
  };
  // Ping-pong: correctness against cuBLAS, then the statistics' partials (checked below).
  CK(cudaMemset(C, 0, (size_t)M * N * 4));
  pp();
  CK(cudaDeviceSynchronize());
  CK(cudaMemset(d, 0, 8));
  diff<<<1024, 256>>>(C, R, (size_t)M * N, d);
  CK(cudaMemcpy(hd, d, 8, cudaMemcpyDeviceToHost));
  printf("  ping-pong: max |ours - cuBLAS| %.3g\n", hd[0]);
  // The library's cuBLAS path: cuBLASLt's first heuristic algorithm (what gpu::gemm runs).
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  cublasLtMatmulDesc_t op;
  CK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t tr = CUBLAS_OP_T, nn = CUBLAS_OP_N;
  CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof tr));
  CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn));
  cublasLtMatrixLayout_t la, lb, lc;
  CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K));
  CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K));
  CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, N, M, N));
  cublasLtMatmulPreference_t pref;
  CK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t wsb = 64 << 20;
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                          sizeof wsb));
  cublasLtMatmulHeuristicResult_t heur;
  int nres = 0;
  CK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heur, &nres));
  auto lt_gemm = [&] {
    const float one = 1, zero = 0;
    CK(cublasLtMatmul(lt, op, &one, B, la, A, lb, &zero, R, lc, R, lc, &heur.algo, ws, wsb, 0));
  };
  const CUtensorMap ta64 = make_map(enc, A, M, K, 64), tb64 = make_map(enc, B, N, K, 64);
  // A launcher per variant, its configuration (attributes, cluster count) set up once.
  int last_clusters = 0;
  auto make_mc = [&](auto kern, int cs, const CUtensorMap& ma, const CUtensorMap& mb) {
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, psmem));
    if (cs > 1) CK(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    auto at = std::make_shared<cudaLaunchAttribute>();
    at->id = cudaLaunchAttributeClusterDimension;
    at->val.clusterDim.x = cs;
    at->val.clusterDim.y = at->val.clusterDim.z = 1;
    auto cfg = std::make_shared<cudaLaunchConfig_t>();
    cfg->blockDim = dim3(384);
    cfg->dynamicSmemBytes = psmem;
    cfg->attrs = at.get();
    cfg->numAttrs = 1;
    cfg->gridDim = dim3(132 / cs * cs);
    int maxc = 0;
    CK(cudaOccupancyMaxActiveClusters(&maxc, kern, cfg.get()));
    cfg->gridDim = dim3(maxc * cs);
    return [=, &last_clusters] {
      CK(cudaLaunchKernelEx(cfg.get(), kern, ma, mb, C, M, N, K, tgt, part));
      (void)at;
      return last_clusters = maxc;
    };
  };
  auto mc21 = make_mc(mc_kernel<2, 1, true>, 2, ta, tb64);
  auto mc12 = make_mc(mc_kernel<1, 2, true>, 2, ta64, tb128);
  auto mc22 = make_mc(mc_kernel<2, 2, true>, 4, ta64, tb64);
  auto mc22p = make_mc(mc_kernel<2, 2, false>, 4, ta64, tb64);
  auto mc11 = make_mc(mc_kernel<1, 1, true>, 1, ta, tb128);
  struct Variant {
    const char* name;
    std::function<int()> run;
  };
  std::vector<Variant> vs = {
      {"cuBLASLt heuristic",
       [&] {
         lt_gemm();
         return 0;
       }},
      {"ping-pong + stats",
       [&] {
         pp_stats();
         return 0;
       }},
      {"2x1 (W shared) + stats", mc21},
      {"1x2 (X shared) + stats", mc12},
      {"2x2 + stats", mc22},
      {"2x2 plain", mc22p},
      {"1x1 (no sharing) + stats", mc11},
  };
  // Each variant's logits against cuBLAS's (R), and its statistics against the host's.
  CK(cudaDeviceSynchronize());
  theirs();
  for (size_t v = 2; v < vs.size(); ++v) {
    CK(cudaMemset(C, 0, (size_t)M * N * 4));
    const int clusters = vs[v].run();
    CK(cudaDeviceSynchronize());
    CK(cudaMemset(d, 0, 8));
    diff<<<1024, 256>>>(C, R, (size_t)M * N, d);
    CK(cudaMemcpy(hd, d, 8, cudaMemcpyDeviceToHost));
    std::vector<float> hr((size_t)N);
    std::vector<Part> hp((size_t)M * (N / PBN));
    CK(cudaMemcpy(hp.data(), part, hp.size() * sizeof(Part), cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int row : {0, 1, 7, 8, 63, 64, 100, M - 1}) {
      CK(cudaMemcpy(hr.data(), R + (size_t)row * N, (size_t)N * 4, cudaMemcpyDeviceToHost));
      double mx = -1e30, se = 0;
      for (float z : hr) mx = std::max(mx, (double)z);
      for (float z : hr) se += std::exp(z - mx);
      double pm = -1e30, ps = 0;
      for (int t = 0; t < N / PBN; ++t)
        pm = std::max(pm, (double)hp[(size_t)row * (N / PBN) + t].m);
      for (int t = 0; t < N / PBN; ++t) {
        const Part& q = hp[(size_t)row * (N / PBN) + t];
        ps += q.s * std::exp(q.m - pm);
      }
      worst = std::max(worst, std::abs(pm + std::log(ps) - mx - std::log(se)));
    }
    printf("  %-24s %d clusters: max |C - cuBLAS| %.3g, max |lse - host| %.3g\n", vs[v].name,
           clusters, hd[0], worst);
  }
  std::vector<std::vector<float>> tv(vs.size());
  for (int r = 0; r < 15; ++r)
    for (size_t v = 0; v < vs.size(); ++v) tv[v].push_back(timeit([&] { vs[v].run(); }));
  for (auto& x : tv) std::sort(x.begin(), x.end());
  for (size_t v = 0; v < vs.size(); ++v)
    printf("  %-24s %.3f ms (%.3f of cuBLASLt)\n", vs[v].name, tv[v][7], tv[v][7] / tv[0][7]);
  return 0;
}
