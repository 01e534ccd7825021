// Row kernels of the token engine: the valid-row prepass, the row statistics epilogue (online
// max/sum-exp, target logit, logit sums, entropy, first argmax; one block per row, 16-byte loads,
// cub::BlockReduce with a fixed tree, fp32 math) and the final deterministic reduction.
#include <cub/block/block_reduce.cuh>
#include <type_traits>

#include "device_util.cuh"
#include "row_acc.cuh"

namespace chunkloss::kern {
namespace {

constexpr int kStatsThreads = 256;
constexpr int kFinishThreads = 1024;

// The mean's 1/D from the divisor D in scalars[kWeightSum]: 1/D = alpha * 2^e with alpha in
// [0.5, 1); the tile carries 2^e exactly, the GEMMs alpha. A divisor D <= 0 (valid rows whose
// class weights sum to 0; bad class weights, also NaN, refuse the call) makes the mean and its
// gradients 0, as on the CPU.
__device__ void set_divisor(const TokenParams& p) {
  const double d = p.scalars[kWeightSum];
  const double inv = d > 0 ? 1.0 / d : 0.0;
  p.scalars[kInvDenom] = inv;
  int e = 0;
  const double alpha = p.scale == Scale::kMean && inv > 0 ? frexp(inv, &e) : 1.0;
  p.scalars[kRowScale] = p.scale != Scale::kMean ? 1.0 : inv > 0 ? ldexp(1.0, e) : 0.0;
  reinterpret_cast<float*>(p.scalars + kGemmScalarsOffset)[kAlpha] = static_cast<float>(alpha);
}

__global__ void divisor_kernel(TokenParams p) { set_divisor(p); }

__global__ void token_begin_kernel(TokenParams p) {
  using Reduce = cub::BlockReduce<double, kFinishThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  double valid = 0, denom = 0, bad = 0;
  for (std::int64_t t = threadIdx.x; t < p.rows; t += kFinishThreads) {
    const std::int64_t y = target_at(p, t);
    if (y == p.ignore_index) continue;
    if (y < 0 || y >= p.vocab_total) {
      bad += 1;
      continue;
    }
    valid += 1;
    denom += p.class_weights ? static_cast<double>(p.class_weights[y]) : 1.0;
  }
  const double v = Reduce(tmp).Sum(valid);
  __syncthreads();
  const double d = Reduce(tmp).Sum(denom);
  __syncthreads();
  const double b = Reduce(tmp).Sum(bad);
  __syncthreads();
  double cw = 0, bad_cw = 0;
  if (p.class_weights)
    for (std::int64_t j = threadIdx.x; j < p.vocab_total; j += kFinishThreads) {
      const float w = p.class_weights[j];
      cw += w;
      bad_cw += isfinite(w) && w >= 0.0f ? 0.0 : 1.0;
    }
  const double cw_sum = Reduce(tmp).Sum(cw);
  __syncthreads();
  const double cw_bad = Reduce(tmp).Sum(bad_cw);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kNumScalars; ++i) p.scalars[i] = 0;
    p.scalars[kValidRows] = v;
    p.scalars[kWeightSum] = d;
    set_divisor(p);
    float* gemm = reinterpret_cast<float*>(p.scalars + kGemmScalarsOffset);
    gemm[kZero] = 0.0f;
    gemm[kOne] = 1.0f;
    p.scalars[kBadTargets] = b;
    p.scalars[kBadClassWeights] = cw_bad;
    p.scalars[kClassWeightSum] = p.class_weights ? cw_sum : static_cast<double>(p.vocab_total);
  }
}

// kPlain: no bias, softcap, class weights, smoothing or entropy; each 16-byte vector then
// rescales the running sum once (max of the vector first) instead of branching per element.
// kEntropy (plain path only; the general path always sums it): also the sum of exp(z - m) z,
// whose rescaling shares the sum's factors, so the sum, lse and gradients are the same bits with
// and without it.
template <typename TL, bool kPlain, bool kEntropy>
__global__ void __launch_bounds__(kStatsThreads)
    row_stats_kernel(TokenParams p, const TL* logits, std::int64_t ld, std::int64_t r0) {
  using Reduce = cub::BlockReduce<RowAcc, kStatsThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  constexpr int V = kVec<TL>;
  const std::int64_t i = blockIdx.x, t = r0 + i, n = p.vocab;
  const TL* row = logits + i * ld;
  const bool vec = aligned16(logits) && (ld % V) == 0;
  const std::int64_t y = valid_target(p, t), y_col = y - p.vocab_offset;  // its column here
  const float cap = p.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const bool want_sum = p.rule.eps != 0.0f || p.logit_sums;

  RowAcc acc = RowAcc::empty();
  // One vector of V logits starting at column j (< n).
  auto add = [&](float(&z)[V], std::int64_t j) {
    if constexpr (kPlain) {
      if (j + V > n) {  // the row's last, partial vector: its pads never win
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (j + k >= n) z[k] = -INFINITY;
      }
      float vm = z[0];
#pragma unroll
      for (int k = 1; k < V; ++k) vm = fmaxf(vm, z[k]);
      if (vm > acc.m) {  // a new running max, at its first column in this vector
        int vi = V - 1;
#pragma unroll
        for (int k = V - 1; k >= 0; --k)
          if (z[k] == vm) vi = k;
        const float rescale = __expf(acc.m - vm);
        acc.s *= rescale;
        if constexpr (kEntropy) acc.sez *= rescale;
        acc.m = vm;
        acc.arg = static_cast<int>(j) + vi;
      }
      if (acc.m == -INFINITY) {  // -inf (masked or overflowed) adds nothing, NaN makes s NaN
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (z[k] != -INFINITY) {
            const float e = __expf(z[k] - acc.m);
            acc.s += e;
            if constexpr (kEntropy) acc.sez += e * z[k];
          }
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float e = __expf(z[k] - acc.m);
          acc.s += e;
          if constexpr (kEntropy)
            if (z[k] != -INFINITY) acc.sez += e * z[k];  // (0 * -inf: a pad or an overflow)
        }
      }
      if (p.logit_sums) {
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (j + k < n) acc.sz += z[k];
      }
      // The target's place in this vector, if there (not a pad: another rank's column).
      const std::int64_t dy = y_col - j;
      if (dy >= 0 && dy < V && y_col < n) {
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (k == dy) acc.zy = z[k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const std::int64_t col = j + k;
        if (col >= n) break;
        accumulate_logit(acc, p, softcap_value(z[k] + bias_at(p, col), cap, inv_cap), col, y_col,
                         want_sum);
      }
    }
  };
  // kLoads vectors per thread are loaded before any is used, so enough bytes are in flight to
  // keep DRAM busy at the clocks of a power-capped GPU.
  constexpr std::int64_t kStep = static_cast<std::int64_t>(kStatsThreads) * V;
  for (std::int64_t j0 = static_cast<std::int64_t>(threadIdx.x) * V; j0 < n; j0 += kStep * kLoads) {
    float z[kLoads][V];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) load_floats(row, j0 + u * kStep, n, vec, z[u]);
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
      if (j0 + u * kStep < n) add(z[u], j0 + u * kStep);
  }
  RowAcc r = Reduce(tmp).Reduce(acc, MergeAcc());
  if (threadIdx.x != 0) return;
  // No column's z > m set arg where every column here is masked (-inf) or NaN: the first column,
  // as the CPU predicts for a masked row.
  if (r.m == -INFINITY) r.arg = 0;
  if (!p.partials) {
    apply_row_rule(p, t, y, r);
    return;
  }
  r.arg += static_cast<int>(p.vocab_offset);
  p.partials[i] = r;
}

__global__ void merge_row_stats_kernel(TokenParams p, const RowStats* stats, int ranks,
                                       std::int64_t r0, std::int64_t rows) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  RowStats r = stats[i];
  for (int k = 1; k < ranks; ++k) r = merge_stats(r, stats[k * rows + i]);
  apply_row_rule(p, r0 + i, valid_target(p, r0 + i), r);
}

struct Totals {
  double loss, zloss, correct, entropy;
};
struct SumTotals {
  __device__ Totals operator()(const Totals& a, const Totals& b) const {
    return {a.loss + b.loss, a.zloss + b.zloss, a.correct + b.correct, a.entropy + b.entropy};
  }
};

// The totals in scalars[kLoss, kEntropy] (sums over the rows) into the reported values.
__device__ void scale_totals(const TokenParams& p) {
  const double valid = p.scalars[kValidRows];
  // A mean over D <= 0 (1/D stored as 0) is 0 even where a row's loss is not finite, as on the
  // CPU.
  const double scale = p.scale == Scale::kMean ? p.scalars[kInvDenom] : 1.0;
  p.scalars[kLoss] = scale > 0 ? p.scalars[kLoss] * scale : 0.0;
  p.scalars[kZLoss] = scale > 0 ? p.scalars[kZLoss] * scale : 0.0;
  p.scalars[kAccuracy] = valid > 0 ? p.scalars[kAccuracy] / valid : 0.0;
  p.scalars[kEntropy] = valid > 0 ? p.scalars[kEntropy] / valid : 0.0;
}

__global__ void token_finish_kernel(TokenParams p, float* out_row_loss, float* out_lse,
                                    std::int32_t* out_pred, bool defer_scaling) {
  using Reduce = cub::BlockReduce<Totals, kFinishThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  Totals acc{0, 0, 0, 0};
  const bool write_rows = !refused_call(p);  // a refused call leaves the outputs as they were
  for (std::int64_t t = threadIdx.x; t < p.rows; t += kFinishThreads) {
    const std::int64_t y = valid_target(p, t);
    const bool valid = is_valid(p, y);
    if (valid) {
      acc.loss += p.row.loss[t];
      acc.zloss += p.row.zloss[t];
      acc.correct += p.row.argmax[t] == y ? 1.0 : 0.0;
      acc.entropy += p.row.entropy[t];
    }
    if (!write_rows) continue;
    if (out_row_loss) out_row_loss[t] = p.row.loss[t];
    if (out_lse) out_lse[t] = p.row.lse[t];
    if (out_pred) out_pred[t] = valid ? p.row.argmax[t] : -1;
  }
  const Totals r = Reduce(tmp).Reduce(acc, SumTotals());
  if (threadIdx.x != 0) return;
  p.scalars[kLoss] = r.loss;
  p.scalars[kZLoss] = r.zloss;
  p.scalars[kAccuracy] = r.correct;
  p.scalars[kEntropy] = r.entropy;
  if (!defer_scaling) scale_totals(p);
}

__global__ void scale_totals_kernel(TokenParams p) { scale_totals(p); }

__global__ void export_scalars_kernel(const double* s, float* out) {
  const double v[7] = {s[kLoss],
                       s[kZLoss],
                       s[kAccuracy],
                       s[kEntropy],
                       s[kValidRows],
                       s[kWeightSum],
                       s[kBadTargets] + s[kBadClassWeights] + s[kNonFinite]};
  for (int i = 0; i < 7; ++i) out[i] = static_cast<float>(v[i]);
}

}  // namespace

int launch_export_scalars(const double* scalars, float* out, void* stream) {
  export_scalars_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(scalars, out);
  return static_cast<int>(cudaGetLastError());
}

int launch_token_begin(const TokenParams& p, void* stream) {
  token_begin_kernel<<<1, kFinishThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

int launch_row_stats(const TokenParams& p, const void* logits, Elem logits_elem, std::int64_t ld,
                     std::int64_t r0, std::int64_t rows, void* stream) {
  if (rows == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  const auto grid = static_cast<unsigned>(rows);
  const auto launch = [&](auto plain, auto entropy) {
    constexpr bool kPlain = decltype(plain)::value, kEntropy = decltype(entropy)::value;
    if (logits_elem == Elem::kF32)
      row_stats_kernel<float, kPlain, kEntropy>
          <<<grid, kStatsThreads, 0, s>>>(p, static_cast<const float*>(logits), ld, r0);
    else
      row_stats_kernel<__nv_bfloat16, kPlain, kEntropy>
          <<<grid, kStatsThreads, 0, s>>>(p, static_cast<const __nv_bfloat16*>(logits), ld, r0);
  };
  if (!plain_rows(p))
    launch(std::false_type{}, std::false_type{});
  else if (p.entropy)
    launch(std::true_type{}, std::true_type{});
  else
    launch(std::true_type{}, std::false_type{});
  return static_cast<int>(cudaGetLastError());
}

int launch_merge_row_stats(const TokenParams& p, const RowStats* stats, int ranks, std::int64_t r0,
                           std::int64_t rows, void* stream) {
  if (rows == 0) return 0;
  constexpr int kThreads = 128;
  const auto grid = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
  merge_row_stats_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, stats, ranks,
                                                                                   r0, rows);
  return static_cast<int>(cudaGetLastError());
}

int launch_token_finish(const TokenParams& p, float* out_row_loss, float* out_lse,
                        std::int32_t* out_pred, bool defer_scaling, void* stream) {
  token_finish_kernel<<<1, kFinishThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      p, out_row_loss, out_lse, out_pred, defer_scaling);
  return static_cast<int>(cudaGetLastError());
}

int launch_scale_totals(const TokenParams& p, void* stream) {
  scale_totals_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

int launch_set_divisor(const TokenParams& p, void* stream) {
  divisor_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace chunkloss::kern
