// The shared chunked engine for token objectives: a validated call, the backend steps it
// drives, and the two loop orders of the plan. Written once above the CPU and CUDA backends.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "chunkloss/core/context.h"
#include "chunkloss/core/tensor.h"
#include "chunkloss/core/workspace.h"
#include "chunkloss/dist/communicator.h"
#include "chunkloss/kernels/row_math.h"
#include "chunkloss/losses/plan.h"
#include "chunkloss/losses/vocab_shard.h"

namespace chunkloss::detail {

/// A CUDA plan's device scalar block: the kernels' Scalar doubles, then the GEMMs' fp32 scalars
/// (kernels/token_epilogue.h; cuda_backend.cpp checks that they fit).
inline constexpr std::size_t kDeviceScalarBytes = 16 * sizeof(double);

/// How the per-row coefficient c_t is scaled.
enum class RowScale : std::uint8_t { kMean, kSum, kUpstream };

/// Rows [r0, r1).
struct RowRange {
  std::int64_t r0, r1;
  bool operator==(const RowRange&) const = default;
};

/// The rows of all `ranges`.
inline std::int64_t row_count(const std::vector<RowRange>& ranges) {
  std::int64_t n = 0;
  for (const RowRange& r : ranges) n += r.r1 - r.r0;
  return n;
}

/// A validated token-objective call: views checked for shapes, dtypes and devices.
struct TokenCall {
  /// The loss, for the CUDA backend's messages (value checks and check_finite on the device,
  /// which the sequence losses do before their calls).
  const char* who = "LinearCrossEntropy";
  std::int64_t rows = 0, hidden = 0, vocab = 0;
  /// Vocabulary parallelism: w holds columns [vocab_offset, vocab_offset + vocab) of a
  /// vocabulary of vocab_total (0: vocab) split over vocab_group's ranks (null: not split).
  dist::Communicator* vocab_group = nullptr;
  std::int64_t vocab_offset = 0, vocab_total = 0;
  /// Data parallelism: the mean's divisor and the scalar totals are summed over this group's
  /// ranks, each holding other rows (null: this call's rows alone).
  dist::Communicator* data_group = nullptr;
  /// Sums the fp32 dW and db accumulators over this group's ranks before they are stored
  /// (null: this rank's own).
  dist::Communicator* weight_grad_group = nullptr;
  TensorView x, w, bias, targets, class_weights, token_weights, upstream;
  TensorView grad_x, grad_w, grad_bias;
  bool accumulate = false;
  TensorView out_row_loss, out_lse, out_pred, out_scalars;
  bool copy_results = true;  ///< false: the backend leaves the totals on the device only
  std::int64_t ignore_index = -100;
  kern::RowRule rule;
  float softcap = 0.0f;  ///< 0: none
  bool entropy = false;
  bool logit_sums = false;  ///< store each row's sum of logits (sequence objectives' metrics)
  bool row_scales = false;  ///< see PlanRequest::row_scales (CUDA)
  RowScale scale = RowScale::kMean;
  bool check_finite = false;  ///< device backends check hidden/weight/bias on the device
  /// run_token_objective drives the call: in token-chunk order the chunks come in row order,
  /// each with one dW GEMM over the full vocabulary.
  bool chunks_in_order = false;
  /// run_token_objective in token-chunk order (set only then): the rows it computes, in order
  /// (see rows_to_compute; none when no row is valid); the others are skipped (skip_rows).
  /// Unset: all rows.
  std::optional<std::vector<RowRange>> row_ranges;

  bool any_grad() const { return grad_x.defined() || grad_w.defined() || grad_bias.defined(); }
  std::int64_t total_vocab() const { return vocab_total ? vocab_total : vocab; }
};

/// Scalar totals of a call, reduced deterministically by the backend.
struct TokenTotals {
  double loss = 0, z_loss = 0, correct = 0, entropy = 0;
  std::int64_t valid_rows = 0;
  double weight_sum = 0;
};

/// The steps the engine drives. Row ranges are [r0, r1), column ranges [v0, v1); the logits
/// buffer holds the current tile densely as [r1 - r0, v1 - v0].
class TokenBackend {
 public:
  virtual ~TokenBackend() = default;
  /// Valid-row count and the mean's divisor; must precede `row_stats`.
  virtual void begin() = 0;
  /// tile = x[r0:r1] w[v0:v1]^T (+ bias[v0:v1]).
  virtual void logits(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1) = 0;
  /// Row statistics of a full-width tile (v0 = 0, v1 = V), the row rule, per-row outputs.
  virtual void row_stats(std::int64_t r0, std::int64_t r1) = 0;
  /// Overwrites the tile with dL/dz using the stored per-row lse and coefficients.
  virtual void grad_epilogue(std::int64_t r0, std::int64_t r1, std::int64_t v0,
                             std::int64_t v1) = 0;
  /// dx[r0:r1] (+)= tile w[v0:v1]; `first` means this is the first contribution to these rows.
  virtual void grad_x(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1,
                      bool first) = 0;
  /// dw[v0:v1] (+)= tile^T x[r0:r1]; db[v0:v1] (+)= colsum(tile).
  virtual void grad_w(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1,
                      bool first) = 0;
  /// The ranges' tiles (full width) one after another from the start of the logits slice, as
  /// logits() makes them. The default runs logits per range; a backend may gather the ranges' X
  /// rows and run one GEMM.
  virtual void logits_ranges(const std::vector<RowRange>& ranges) {
    for_ranges(ranges, [&](const RowRange& r) { logits(r.r0, r.r1, 0, call_vocab()); });
  }
  /// grad_x(r0, r1, 0, V, true) for each of `ranges`, whose gradient tiles lie one after another
  /// from the start of the logits slice; a backend may run one GEMM and scatter its rows.
  virtual void grad_x_ranges(const std::vector<RowRange>& ranges) {
    for_ranges(ranges, [&](const RowRange& r) { grad_x(r.r0, r.r1, 0, call_vocab(), true); });
  }
  /// dw (+)= tile^T x over the rows of `ranges`, whose tiles lie one after another from the
  /// start of the logits slice (a resident group, a packed chunk); db (+)= their column sums.
  /// The default runs grad_w per range; a backend may do it in one GEMM.
  virtual void grad_w_ranges(const std::vector<RowRange>& ranges, bool first) {
    for_ranges(ranges, [&](const RowRange& r) {
      grad_w(r.r0, r.r1, 0, call_vocab(), first);
      first = false;
    });
  }
  /// Calls fn(range) for each of `ranges` with the tile selected at its offset: the rows of the
  /// ranges before it.
  template <typename Fn>
  void for_ranges(const std::vector<RowRange>& ranges, Fn&& fn) {
    std::int64_t offset = 0;
    for (const RowRange& r : ranges) {
      select_tile(offset);
      fn(r);
      offset += r.r1 - r.r0;
    }
  }
  /// The deferred regime's last chunk: dw = factor (dw + tile^T x[r0:r1]) over the full
  /// vocabulary (dw = factor tile^T x[r0:r1] when `first`), in one GEMM (alpha = beta = factor).
  virtual void grad_w_rescaled(std::int64_t r0, std::int64_t r1, bool first, float factor) = 0;
  /// Sets dH to zero for every row before a sequence objective that skips some rows: the
  /// caller's dH (kept when accumulating), or the fp32 dH accumulator and the rows' scales.
  virtual void clear_grad_x() = 0;
  /// Sets dW to zero when no row is computed: its fp32 accumulator, or the caller's dW (kept
  /// when accumulating).
  virtual void clear_grad_w() = 0;
  /// The deferred regime: multiplies rows [r0, r1) of the fp32 dH accumulator by `factor`.
  virtual void scale_grad_x_rows(std::int64_t r0, std::int64_t r1, float factor) = 0;
  /// Points the logits tile `row_offset` rows (of V columns) into the logits slice, so a
  /// resident group keeps several chunks' logits between the passes.
  virtual void select_tile(std::int64_t row_offset) = 0;
  /// The most rows whose X rows the *_ranges steps gather side by side for one GEMM (0: none).
  virtual std::int64_t gather_rows() const = 0;
  /// Copies rows [r0, r1) of the row loss (-log p(y_t) under the plain rule, 0 for ignored
  /// rows) and of the logit sums (unless `logit_sum` is null) to host memory; waits for them.
  virtual void fetch_rows(std::int64_t r0, std::int64_t r1, float* loss, float* logit_sum) = 0;
  /// Sets the gradient coefficients of rows [r0, r1) from host values: dL/dz_t = c_t (p_t -
  /// onehot_t) under the plain rule.
  virtual void set_coefficients(std::int64_t r0, std::int64_t r1, const float* c) = 0;
  /// Rows [r0, r1), all ignored, are not computed: their row loss is 0, their lse NaN, and
  /// their dH rows zero (left as they were when accumulating). Token-chunk order only, whose dH
  /// goes to the caller's buffer (no fp32 dH accumulator).
  virtual void skip_rows(std::int64_t r0, std::int64_t r1) = 0;
  /// Flushes accumulators into the caller's buffers and reduces the scalar totals (into
  /// out_scalars when given; to the host unless copy_results is false).
  virtual TokenTotals finish() = 0;

 protected:
  virtual std::int64_t call_vocab() const = 0;
};

/// The backend for the context's device (throws when CUDA support is not built in).
std::unique_ptr<TokenBackend> make_token_backend(Context& ctx, const TokenCall& call,
                                                 const Plan& plan, const Workspace& ws);
std::unique_ptr<TokenBackend> make_cpu_token_backend(Context& ctx, const TokenCall& call,
                                                     const Plan& plan, const Workspace& ws);
#if CHUNKLOSS_HAVE_CUDA
std::unique_ptr<TokenBackend> make_cuda_token_backend(Context& ctx, const TokenCall& call,
                                                      const Plan& plan, const Workspace& ws);
#endif

/// The group of a shard that splits the vocabulary (more than one rank), else null.
dist::Communicator* vocab_split_group(const VocabShard& shard);
/// A call on the rank's shard of a vocabulary of `v_total` (see VocabShard): the token call's
/// group, offset and whole vocabulary (unchanged without a split) ...
void split_vocabulary(const VocabShard& shard, std::int64_t v_total, TokenCall& k);
/// ... and its plan request: every rank plans from the largest shard, ceil(V / K) rows, so that
/// all of them plan the same chunks.
void split_vocabulary(const VocabShard& shard, std::int64_t v_total, PlanRequest& q);

/// A digest of what a call's rows compute from the whole vocabulary: its size, ignore_index, the
/// rule, softcap, entropy and the rows' scale (the ranks of a vocabulary split compare it).
double rule_digest(const TokenCall& k);

/// Extends a plan's layout so that its workspace is at least `bytes`.
void reserve_workspace(Plan& p, std::size_t bytes);

/// Copies a view's elements to host memory `dst` (nbytes()); device views are read on the
/// context's stream, which is synchronised.
void read_to_host(Context& ctx, const TensorView& t, void* dst);
/// Sums host values[0, n) over the group's ranks: directly on the CPU; on CUDA through the
/// context's scratch() (the stream is synchronised).
void all_reduce_host(Context& ctx, dist::Communicator& group, double* values, std::int64_t n);
#if CHUNKLOSS_HAVE_CUDA
void cuda_read_to_host(Context& ctx, const TensorView& t, void* dst);
void cuda_all_reduce_host(Context& ctx, dist::Communicator& group, double* values, std::int64_t n);
/// The number of non-finite elements of a float device view, counted in `scalars` (a CUDA
/// plan's scalars slice); synchronises the stream.
std::uint64_t cuda_count_nonfinite(const Context& ctx, const TensorView& t, double* scalars);
#endif

/// Pass 2 in vocab-block order over all n rows, whose lse and coefficients are set: each block
/// of `block` columns' logits, gradient, dW rows (written once) and dH contribution.
void vocab_block_pass(TokenBackend& b, std::int64_t n, std::int64_t v, std::int64_t block);

/// The ranges of rows [0, valid.size()) to compute when runs of at least `min_gap` rows with
/// valid[t] = 0 are skipped (shorter runs are computed with the rows around them); empty when
/// no row is valid.
std::vector<RowRange> rows_to_compute(const std::vector<std::uint8_t>& valid, std::int64_t min_gap);
/// The rows run_token_objective computes: call.row_ranges, or all rows when it is unset.
std::vector<RowRange> computed_rows(const TokenCall& call);
/// `ranges` packed into chunks of `chunk` rows: their rows in order, cut every `chunk` rows;
/// each chunk's pieces (the parts of ranges in it) lie one after another in the logits tile and
/// share one logits, dH and dW GEMM (the *_ranges steps). The token and sequence engines' chunks.
std::vector<std::vector<RowRange>> pack_chunks(const std::vector<RowRange>& ranges,
                                               std::int64_t chunk);
/// The chunks run_token_objective runs: pack_chunks of the computed rows.
std::vector<std::vector<RowRange>> token_chunks(const TokenCall& call, const Plan& plan);

/// A token objective's coefficients, called once per chunk in row order: given the row losses
/// -log p(y_t) of the chunk's rows [r0, r1) (host values; for ignored rows 0 or, between the
/// pieces of a chunk that skips rows, unspecified), writes each row's c_t into coef[0, r1 - r0)
/// (dL/dz_t = c_t (p_t - onehot_t); unused in a call without gradients).
using RowCoefficients =
    std::function<void(std::int64_t r0, std::int64_t r1, const float* row_loss, float* coef)>;

/// Runs the plan's loop order over the call. With `coefficients` (the plain rule), each chunk's
/// row losses come to the host after its statistics and its rows' coefficients go back before
/// its gradient.
TokenTotals run_token_objective(Context& ctx, const TokenCall& call, const Plan& plan,
                                const Workspace& ws, const RowCoefficients& coefficients = {});

}  // namespace chunkloss::detail
