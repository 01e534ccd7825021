// The gradient epilogue (dL/dz written in place over the logits tile, in the gradient dtype)
// and the bias gradient. One block per row walks the row in tiles of 16-byte vectors; when
// the gradient element is narrower than the logits element each tile is fully read before any
// thread stores, so a row's bf16 gradient can overwrite the first half of its own fp32 row.
#include "device_util.cuh"

namespace chunkloss::kern {
namespace {

constexpr int kGradThreads = 256;
constexpr int kSumThreads = 256;

// kPlain (see plain_rows): dL/dz = a exp(z - lse) - b onehot, one exp per element.
template <typename TL, typename TG, bool kPlain>
__global__ void __launch_bounds__(kGradThreads)
    grad_epilogue_kernel(TokenParams p, TL* tile, std::int64_t ld, std::int64_t r0, std::int64_t v0,
                         std::int64_t cols) {
  constexpr int V = kVec<TL>;
  constexpr bool kNarrowing = sizeof(TG) < sizeof(TL);
  const std::int64_t i = blockIdx.x, t = r0 + i;
  TL* row = tile + i * ld;
  TG* grow = reinterpret_cast<TG*>(row);
  const bool vec = aligned16(tile) && (ld % V) == 0;
  const float lse = p.row.lse[t], a = p.row.a[t], b = p.row.b[t], g = p.row.g[t];
  const bool zero = a == 0.0f && b == 0.0f && g == 0.0f;
  const std::int64_t y = valid_target(p, t) - p.vocab_offset - v0;
  const float cap = p.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  // kLoads vectors per thread are loaded before any is used (more bytes in flight at the clocks
  // of a power-capped GPU); with narrowing the whole span is read before any thread stores.
  constexpr std::int64_t kStep = static_cast<std::int64_t>(kGradThreads) * V;
  const std::int64_t lane = static_cast<std::int64_t>(threadIdx.x) * V;
  for (std::int64_t base = 0; base < cols; base += kStep * kLoads) {
    float z[kLoads][V];
    if (!zero) {
#pragma unroll
      for (int u = 0; u < kLoads; ++u) load_floats(row, base + u * kStep + lane, cols, vec, z[u]);
    }
    if constexpr (kNarrowing) __syncthreads();
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const std::int64_t j = base + u * kStep + lane;
      if (j >= cols) break;
      // Per vector: the columns in the row (`live`) and the target's place (`hit`, -1: none).
      const int live = zero ? 0 : cols - j < V ? static_cast<int>(cols - j) : V;
      const std::int64_t dy = y - j;
      const int hit = dy >= 0 && dy < V ? static_cast<int>(dy) : -1;
      float d[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if (k >= live) {
          d[k] = 0.0f;
        } else if constexpr (kPlain) {
          d[k] = a * __expf(z[u][k] - lse) - (k == hit ? b : 0.0f);
        } else {
          const std::int64_t col = j + k;
          const float w = class_weight_at(p, v0 + col);
          d[k] =
              grad_element(z[u][k] + bias_at(p, v0 + col), k == hit, lse, a, b, g, w, cap, inv_cap);
        }
      }
      store_floats<TG, V>(grow, j, cols, vec, d);
    }
  }
}

// Bias gradient from the logits before the gradient epilogue overwrites them, so the column
// sums see fp32 gradient values whatever the gradient dtype. One thread per column walks the
// rows in order: coalesced across the warp, deterministic, no atomics.
template <typename TL>
__global__ void bias_grad_kernel(TokenParams p, const TL* tile, std::int64_t ld, std::int64_t r0,
                                 std::int64_t rows, std::int64_t v0, std::int64_t cols, float* db) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kSumThreads + threadIdx.x;
  if (j >= cols) return;
  const float cap = p.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const float bj = bias_at(p, v0 + j);
  const float u = class_weight_at(p, v0 + j);
  float s = 0.0f;
  for (std::int64_t i = 0; i < rows; ++i) {
    const std::int64_t t = r0 + i;
    const float a = p.row.a[t], b = p.row.b[t], g = p.row.g[t];
    if (a == 0.0f && b == 0.0f && g == 0.0f) continue;
    const float e =
        grad_element(to_float(tile[i * ld + j]) + bj, valid_target(p, t) - p.vocab_offset - v0 == j,
                     p.row.lse[t], a, b, g, u, cap, inv_cap);
    s += p.row_scales ? e * p.row.scale[t] : e;
  }
  db[j] += s * reinterpret_cast<const float*>(p.scalars + kGemmScalarsOffset)[kAlpha];
}

template <typename TL>
int grad_dispatch(const TokenParams& p, void* tile, Elem grad_elem, std::int64_t ld,
                  std::int64_t r0, std::int64_t rows, std::int64_t v0, std::int64_t cols,
                  cudaStream_t s) {
  const auto grid = static_cast<unsigned>(rows);
  TL* t = static_cast<TL*>(tile);
  CHUNKLOSS_BOOL_SWITCH(plain_rows(p), kPlain, [&] {
    if (grad_elem == Elem::kF32)
      grad_epilogue_kernel<TL, float, kPlain><<<grid, kGradThreads, 0, s>>>(p, t, ld, r0, v0, cols);
    else
      grad_epilogue_kernel<TL, __nv_bfloat16, kPlain>
          <<<grid, kGradThreads, 0, s>>>(p, t, ld, r0, v0, cols);
  });
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_grad_epilogue(const TokenParams& p, void* tile, Elem logits_elem, Elem grad_elem,
                         std::int64_t ld, std::int64_t r0, std::int64_t rows, std::int64_t v0,
                         std::int64_t cols, void* stream) {
  if (rows == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  if (logits_elem == Elem::kF32)
    return grad_dispatch<float>(p, tile, grad_elem, ld, r0, rows, v0, cols, s);
  if (grad_elem == Elem::kF32)
    return static_cast<int>(cudaErrorInvalidValue);  // bf16 tile cannot hold fp32
  return grad_dispatch<__nv_bfloat16>(p, tile, grad_elem, ld, r0, rows, v0, cols, s);
}

int launch_bias_grad(const TokenParams& p, const void* tile, Elem logits_elem, std::int64_t ld,
                     std::int64_t r0, std::int64_t rows, std::int64_t v0, std::int64_t cols,
                     float* db, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const auto grid = static_cast<unsigned>((cols + kSumThreads - 1) / kSumThreads);
  if (logits_elem == Elem::kF32)
    bias_grad_kernel<<<grid, kSumThreads, 0, s>>>(p, static_cast<const float*>(tile), ld, r0, rows,
                                                  v0, cols, db);
  else
    bias_grad_kernel<<<grid, kSumThreads, 0, s>>>(p, static_cast<const __nv_bfloat16*>(tile), ld,
                                                  r0, rows, v0, cols, db);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace chunkloss::kern
