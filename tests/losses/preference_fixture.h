// Test fixture for the preference losses: seeded [S, T] problems (prompt, completion and
// padding per sequence through ignore_index) in fp32 or bf16 with an optional reference head or
// precomputed reference sums, KTO labels and KL batch; gradient buffers in either dtype; one
// library call with a fresh NaN-filled workspace; and the comparison against the float64 oracle.
#pragma once

#include <chunkloss/core/context.h>
#include <chunkloss/core/error.h>
#include <chunkloss/losses/preference.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "reference/preference_ref.h"
#include "support/grad_buffers.h"

namespace chunkloss::test {

enum class RefMode { kNone, kHead, kLogps };

/// Shape and contents of a generated problem.
struct PrefSpec {
  std::int64_t s = 6, t = 13, h = 37, v = 101;  ///< S sequences (2P for pairs) of T tokens
  DType dtype = DType::kF32;                    ///< policy and reference heads
  bool bias = false;                            ///< both heads get a bias
  RefMode ref = RefMode::kNone;
  bool labels = false;  ///< KTO labels (alternating with a seeded shuffle, both present)
  std::optional<double> kl;
  /// KTO: a mismatched batch of kl_s sequences of kl_t tokens (the policy's greedy tokens), with
  /// a reference of kind kl_ref (the batch's heads share the weights and biases).
  bool kl_batch = false;
  std::int64_t kl_s = 5, kl_t = 9;
  RefMode kl_ref = RefMode::kHead;
  bool targets_i64 = false;
  std::int64_t ignore_index = -100;
  /// Per sequence: a prompt of up to max_prompt_frac * T ignored tokens, then 1..rest valid
  /// completion tokens, then ignored padding. full: every token valid.
  bool full = false;
  double max_prompt_frac = 0.4;
  /// Logits are about N(0, logit_scale^2); the reference head is the policy head plus noise
  /// of ref_noise relative size, so policy-minus-reference log-probs are O(1).
  float logit_scale = 1.5f;
  float ref_noise = 0.3f;
  std::uint64_t seed = 1;
};

/// A generated problem. The float vectors hold the values the library sees (bf16-exact when the
/// dtype is bf16), so the oracle runs on exactly the same numbers.
struct PrefData {
  explicit PrefData(const PrefSpec& s);

  PrefSpec spec;
  std::vector<float> hidden, weight, bias;              // policy
  std::vector<float> ref_hidden, ref_weight, ref_bias;  // reference head (modes head/logps)
  std::vector<BFloat16> hidden_bf, weight_bf, bias_bf, ref_hidden_bf, ref_weight_bf, ref_bias_bf;
  std::vector<std::int64_t> targets64;
  std::vector<std::int32_t> targets32;
  std::vector<float> ref_logps;  ///< [S] the reference head's sums, rounded to f32
  std::vector<std::int32_t> labels;
  // KL batch.
  std::vector<float> kl_hidden, kl_ref_hidden, kl_ref_logps;
  std::vector<BFloat16> kl_hidden_bf, kl_ref_hidden_bf;
  std::vector<std::int64_t> kl_targets64;
  std::vector<std::int32_t> kl_targets32;

  std::int64_t rows() const { return spec.s * spec.t; }
  void set_target(std::int64_t row, std::int64_t y);
  /// Rounds to bf16 (when bf16), refreshes the bf16 copies and the derived reference sums.
  void sync();
  PreferenceInputs inputs() const;
  reference::PrefProblem problem() const;
  Head policy_head() const;
  TensorView targets_view() const;
};

/// The part of `d` that one rank of a data group holds: units [u0, u1) (pairs: chosen and
/// rejected sequences of those pairs, chosen first) and KL-batch sequences [k0, k1).
PrefData data_part(const PrefData& d, std::int64_t u0, std::int64_t u1, std::int64_t k0,
                   std::int64_t k1);

/// A problem split over the ranks of a data group: unit boundaries {0, c1, ..., units} and
/// KL-batch boundaries {0, ..., S'} (empty without a KL batch).
struct DataSplit {
  std::vector<std::int64_t> units, kl;
  std::size_t ranks() const { return units.size() - 1; }
  PrefData part(const PrefData& d, std::size_t r) const {
    return data_part(d, units[r], units[r + 1], kl.empty() ? 0 : kl[r], kl.empty() ? 0 : kl[r + 1]);
  }
  /// Rank r's entries of a per-sequence vector of the unsplit call, or of its [S*T, H] rows
  /// with `width` = T * H (pairs: chosen then rejected sequences of its units).
  template <typename T>
  std::vector<T> rows(const std::vector<T>& v, std::size_t r, bool pairs,
                      std::int64_t width = 1) const {
    const std::int64_t n = units.back();
    std::vector<T> out;
    for (std::int64_t k = 0; k < (pairs ? 2 : 1); ++k)
      out.insert(out.end(), v.begin() + (k * n + units[r]) * width,
                 v.begin() + (k * n + units[r + 1]) * width);
    return out;
  }
};

/// Which gradients a call asks for, in which dtype.
struct PrefGradRequest {
  bool hidden = true;
  bool weight = true;
  bool bias = true;  ///< only when the problem has a bias
  DType dtype = DType::kF32;
  static PrefGradRequest none() { return {false, false, false, DType::kF32}; }
};

/// Caller-owned gradient buffers of one dtype, viewed as PreferenceGrads.
class PrefGradBuffers : public GradStorage {
 public:
  PrefGradBuffers(const PrefData& d, const PrefGradRequest& r, float fill = 0.0f);
  /// bf16-exact N(0, scale^2) contents, for accumulate tests.
  void fill_random(std::uint64_t seed, double scale) {
    GradStorage::fill_random(seed, scale, scale, scale);
  }
  PreferenceGrads views(bool accumulate = false) { return views_as<PreferenceGrads>(accumulate); }
};

/// One library call and everything it produced.
struct PrefRun {
  PreferenceResult result;
  Plan plan;
  PrefGradBuffers grads;
};

/// Runs forward_backward (forward() when no gradient is requested) into NaN-filled gradient
/// buffers with a fresh NaN-filled workspace of exactly workspace_bytes(), followed by a guard
/// region that must stay untouched.
/// One thread by default: the problems are tiny, and CI runs two suites on two cores.
/// `data_group`: the call is this rank's of the group (PreferenceInputs::data_group).
PrefRun run_library(const PrefData& d, const SequenceLoss& loss, const PrefGradRequest& g,
                    int threads = 1, dist::Communicator* data_group = nullptr);

/// Tolerances of one comparison: values by the input dtype, gradients by the gradient dtype.
struct PrefTol {
  double loss, vec, grad;
  static PrefTol of(DType input, DType grad);
};

/// Checks a run against the oracle: loss, every metric (and that the metric names are the
/// oracle's), the per-sequence vectors, the KL point and every requested gradient.
void check_against_oracle(const PrefRun& run, const reference::PrefResult& ref, const PrefTol& tol,
                          bool paired);

/// sum[i] += x[i] (sum grows to x's size, with zeros).
void add_to(std::vector<double>& sum, const std::vector<double>& x);

/// One rank's shard of a problem's heads over a vocabulary split: the policy's and the
/// reference's weight and bias rows [v0, v1) (the KL batch's heads share them), gradient buffers
/// of the shard's size, and the call's results.
struct ShardRun {
  ShardRun(const PrefData& d, std::int64_t first, std::int64_t end, const PrefGradRequest& g);
  /// The problem's inputs with this shard's weights (vocab_shard left for the caller).
  PreferenceInputs inputs(const PrefData& d) const;

  std::int64_t v0, v1;
  std::vector<float> w, b, rw, rb;
  std::vector<BFloat16> wb, bb, rwb, rbb;
  GradStorage grads;
  PreferenceResult result;
};

/// Tolerances of a split against the unsplit call: the loss, metrics and per-sequence values,
/// and the gradients.
struct SplitTol {
  double values, grad;
};

/// Every rank's run of a split (`runs`) against the unsplit run of `d`: the group's loss,
/// metrics and KL point; the rank's per-sequence vectors and dH rows; dW and db summed over the
/// ranks, or each rank's when the call summed them (`reduced`).
void check_split_runs(const PrefData& d, const PrefRun& full, const std::vector<PrefRun>& runs,
                      const DataSplit& s, const SplitTol& tol, bool reduced);

/// The columns masked_columns_data masks.
inline constexpr std::int64_t kMaskedColumns[] = {0, 7};

/// A problem of `s` with a bias (both heads) whose kMaskedColumns entries are `bias` (-inf: a
/// vocabulary mask), and targets moved off those columns.
PrefData masked_columns_data(PrefSpec s, float bias);

/// A run of masked_columns_data (-inf) gave kMaskedColumns exactly no weight or bias gradient.
void check_masked_columns_untouched(const PrefRun& run, std::int64_t h);

/// Two runs of one problem agree to `tol` (relative): loss, per-sequence vectors, gradients.
void check_runs_close(const PrefRun& a, const PrefRun& b, double tol);

/// Two runs are bitwise identical: loss, metrics, vectors and gradient bytes.
bool runs_bitwise_equal(const PrefRun& a, const PrefRun& b);

std::string describe(const PrefSpec& s);

/// Whether the options' objective may run in Regime::kDeferred: pair-antisymmetric (DPO's loss
/// types written through the margin, SimPO, CPO) and without an NLL term.
inline bool deferrable(const DpoOptions& o) {
  constexpr DpoLoss kMargin[] = {DpoLoss::kSigmoid, DpoLoss::kHinge,   DpoLoss::kIpo,
                                 DpoLoss::kRobust,  DpoLoss::kExoPair, DpoLoss::kDiscoPop};
  return !o.nll &&
         std::find(std::begin(kMargin), std::end(kMargin), o.loss_type) != std::end(kMargin);
}
inline bool deferrable(const SimpoOptions& o) { return o.nll_alpha == 0.0f; }
inline bool deferrable(const CpoOptions& o) { return o.alpha == 0.0f; }
inline bool deferrable(const OrpoOptions&) { return false; }
inline bool deferrable(const KtoOptions&) { return false; }

/// The regimes a test runs `o` in on problem `s`: resident, recompute, and deferred when the
/// objective and the request allow it (no bias gradient, no accumulation).
template <typename Options>
std::vector<Regime> regimes_for(const Options& o, const PrefSpec& s, bool accumulate = false) {
  std::vector<Regime> r = {Regime::kResident, Regime::kRecompute};
  if (deferrable(o) && !s.bias && !accumulate) r.push_back(Regime::kDeferred);
  return r;
}

}  // namespace chunkloss::test
