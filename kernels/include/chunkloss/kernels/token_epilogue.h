// Host launchers of the token engine's CUDA steps: the valid-row prepass, the row statistics
// epilogue, the in-place gradient epilogue, the bias gradient, the final reduction and dtype
// conversions. Raw pointers and a stream (as void*), so no CUDA header is needed to include it.
// Every launcher returns the launch's cudaError_t as an int (0: success) for the caller to check.
#pragma once

#include <cstdint>

#include "chunkloss/kernels/row_math.h"

namespace chunkloss::kern {

/// Element types the launchers dispatch on.
enum class Elem : std::uint8_t { kF32, kBF16 };

/// Slots of the device scalar block (doubles) shared by the kernels of one call.
enum Scalar : int {
  kLoss = 0,
  kZLoss,
  kAccuracy,
  kEntropy,
  kValidRows,  ///< kValidRows .. kNonFinite are summed over a data group (kInvDenom then reset)
  kWeightSum,
  kBadClassWeights,  ///< class weights that are negative or not finite
  kInvDenom,
  kBadTargets,
  /// An unsigned 64-bit count in the double's bytes while launch_count_nonfinite adds to it, a
  /// double once launch_nonfinite_as_double has run (a token call's begin, before its sums).
  kNonFinite,
  kClassWeightSum,
  kRowScale,  ///< power of two applied to the gradient tile (the mean's 1/D = alpha * kRowScale)
  kNumScalars
};

/// The gradient GEMMs' alpha, 0 and 1 as fp32 values in device memory, stored after the doubles
/// (cuBLAS device pointer mode): the gradient tile holds dL/dz / alpha, where alpha is the
/// mantissa of the mean's 1/D, so a uniform coefficient costs no bf16 rounding in the tile.
inline constexpr int kGemmScalarsOffset = kNumScalars + 1;  // in doubles
/// Set from the host: kFactor, the deferred regime's pair coefficient (beta of its last dW GEMM,
/// the scale of its dH rows); kWeightAlpha, the alpha of a gradient GEMM other than 1 known on
/// the host (a coefficient mantissa, times that factor).
enum GemmScalar : int { kAlpha = 0, kZero, kOne, kFactor, kWeightAlpha, kNumGemmScalars };

/// How a row's coefficient c_t is formed from its token weight tw_t.
enum class Scale : std::uint8_t { kMean, kSum, kUpstream };

/// Per-row arrays in device memory (see losses/src/row_arrays.h): N floats each, argmax ints.
struct RowPtrs {
  float *lse, *a, *b, *g, *loss, *zloss, *entropy, *zsum, *scale;
  std::int32_t* argmax;
};

/// What every per-row kernel needs to know about the call.
struct TokenParams {
  std::int64_t rows = 0;   ///< N
  std::int64_t vocab = 0;  ///< V: the columns of this call's weight
  /// Vocabulary parallelism: the weight holds columns [vocab_offset, vocab_offset + V) of a
  /// vocabulary of vocab_total (targets and class weights index it); unsplit: 0 and V.
  std::int64_t vocab_offset = 0;
  std::int64_t vocab_total = 0;
  const void* targets = nullptr;
  bool targets_i64 = false;
  std::int64_t ignore_index = -100;
  const void* bias = nullptr;  ///< [V] in the input dtype, or null
  Elem bias_elem = Elem::kF32;
  const float* class_weights = nullptr;  ///< [vocab_total] or null
  const float* token_weights = nullptr;  ///< [N] or null
  const float* upstream = nullptr;       ///< [N] (Scale::kUpstream)
  RowRule rule;
  float softcap = 0.0f;  ///< 0: none
  bool entropy = false;
  bool logit_sums = false;  ///< store each row's logit sum in row.zsum
  bool row_scales = false;  ///< the tile's gradient rows are to be multiplied by row.scale
  Scale scale = Scale::kMean;
  RowPtrs row;
  double* scalars = nullptr;  ///< kNumScalars doubles
  /// Set: launch_row_stats stores each row's statistics of the V columns here (one per row of
  /// the launch) for the group to exchange, and launch_merge_row_stats applies the row rule.
  RowStats* partials = nullptr;
};

/// Zeroes the scalars, counts valid rows, the mean's divisor D (sum of class weights of valid
/// targets), 1/D, the class-weight sum, targets outside [0, V) and bad class weights. While
/// either count is nonzero (after a data group's sum), the row rule gives every row zero
/// gradient coefficients and launch_token_finish writes no per-row output, so a call that will
/// throw adds nothing to the caller's gradients.
int launch_token_begin(const TokenParams& p, void* stream);

/// Row statistics of rows [r0, r0 + rows) whose full-width logits are `logits` (leading
/// dimension `ld`), then the row rule: per-row lse, a, b, g, loss, z-loss, entropy, argmax.
/// One block per row; deterministic block reductions.
int launch_row_stats(const TokenParams& p, const void* logits, Elem logits_elem, std::int64_t ld,
                     std::int64_t r0, std::int64_t rows, void* stream);

/// Row rule of rows [r0, r0 + rows) from the statistics of `ranks` column sets, set k at
/// stats[k * rows + i] for row r0 + i, merged in k order (a vocabulary-parallel group's
/// all-gathered partials; equal on every rank).
int launch_merge_row_stats(const TokenParams& p, const RowStats* stats, int ranks, std::int64_t r0,
                           std::int64_t rows, void* stream);

/// Overwrites the tile of rows [r0, r0 + rows) x columns [v0, v0 + cols) (leading dimension
/// `ld` in logits elements) with dL/dz in `grad_elem`. When the gradient element is smaller
/// than the logits element the gradient row is stored over the first bytes of its own row, so
/// its leading dimension in gradient elements is ld * sizeof(logits) / sizeof(grad).
int launch_grad_epilogue(const TokenParams& p, void* tile, Elem logits_elem, Elem grad_elem,
                         std::int64_t ld, std::int64_t r0, std::int64_t rows, std::int64_t v0,
                         std::int64_t cols, void* stream);

/// db[j] += sum over rows [r0, r0 + rows) of dL/dz[r, v0 + j], computed in fp32 from the logits
/// tile (leading dimension `ld`) before launch_grad_epilogue overwrites it. No atomics.
int launch_bias_grad(const TokenParams& p, const void* tile, Elem logits_elem, std::int64_t ld,
                     std::int64_t r0, std::int64_t rows, std::int64_t v0, std::int64_t cols,
                     float* db, void* stream);

/// Reduces the per-row arrays into the scalar block and writes the optional per-row outputs
/// (row_loss, lse: float; predictions: int32, -1 for ignored rows; none when the call holds
/// refused values, see launch_token_begin). With `defer_scaling` the
/// block's kLoss, kZLoss, kAccuracy and kEntropy are left as sums over the rows (loss, z-loss,
/// correct rows, entropy) for a data-parallel group to add up, and launch_scale_totals follows.
int launch_token_finish(const TokenParams& p, float* out_row_loss, float* out_lse,
                        std::int32_t* out_pred, bool defer_scaling, void* stream);

/// The sums launch_token_finish left (defer_scaling) into the reported values: the mean's or
/// none's scaling of the loss and z-loss, accuracy and entropy per valid row.
int launch_scale_totals(const TokenParams& p, void* stream);

/// Recomputes the mean's 1/D and the GEMMs' alpha from the divisor in kWeightSum (after a
/// data-parallel group has summed kValidRows and kWeightSum over its ranks).
int launch_set_divisor(const TokenParams& p, void* stream);

/// out[0..7) = loss, z_loss, accuracy, entropy, valid rows, weight sum, invalid inputs (bad
/// targets + non-finite values) as floats, from the scalar block, on the device.
int launch_export_scalars(const double* scalars, float* out, void* stream);

/// dst[r, j] = (add ? dst[r, j] : 0) + scale[r * scale_stride] * src[r, j] for `rows` rows of
/// `cols`, with leading dimensions dst_ld and src_ld (elements); src in `src_elem` (f32 or bf16),
/// dst in `dst_elem`; fp32 math, one rounding. scale_stride 0: one scale for every row.
int launch_scale_rows(void* dst, Elem dst_elem, std::int64_t dst_ld, const void* src, Elem src_elem,
                      std::int64_t src_ld, const float* scale, std::int64_t rows, std::int64_t cols,
                      bool add, void* stream, std::int64_t scale_stride = 1);

/// dst = (add ? dst : 0) + src for `n` elements, dst in `dst_elem`.
int launch_store_f32(void* dst, Elem dst_elem, const float* src, std::int64_t n, bool add,
                     void* stream);

/// Adds the number of non-finite elements of `x` to the count in scalars[kNonFinite]; call after
/// launch_token_begin, which zeroes it.
int launch_count_nonfinite(const void* x, Elem elem, std::int64_t n, double* scalars, void* stream);

/// Turns the count launch_count_nonfinite left in scalars[kNonFinite] into a double, which a data
/// group can sum and launch_export_scalars and the host read.
int launch_nonfinite_as_double(double* scalars, void* stream);

/// Fills `n` floats with zero.
int launch_zero(float* x, std::int64_t n, void* stream);

}  // namespace chunkloss::kern
