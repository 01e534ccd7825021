// Test fixture for LinearCrossEntropy: seeded problem data in fp32 or bf16, gradient and output
// buffers in either dtype, one call through the library with a fresh workspace, and the full
// comparison of a call's results against the float64 oracle.
#pragma once

#include <chunkloss/core/context.h>
#include <chunkloss/core/error.h>
#include <chunkloss/dist/communicator.h>
#include <chunkloss/losses/cross_entropy.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "reference/cross_entropy_ref.h"
#include "support/compare.h"
#include "support/grad_buffers.h"

namespace chunkloss::test {

/// Shape and contents of a generated problem.
struct CeSpec {
  std::int64_t n = 7, h = 123, v = 507;
  DType dtype = DType::kF32;  ///< hidden, weight, bias
  bool bias = false;
  bool class_weights = false;
  bool token_weights = false;
  bool targets_i64 = false;
  double ignore_fraction = 0.2;
  std::int64_t ignored_prefix = 0;  ///< the first rows are ignored too (a prompt)
  /// Rows [first, second) are ignored too (the next sequence's prompt).
  std::pair<std::int64_t, std::int64_t> ignored_run{0, 0};
  std::int64_t ignore_index = -100;
  /// Set every third valid row's target to its argmax, so accuracy is neither 0 nor 1.
  bool hits = true;
  /// With a bias: -inf on every k-th column from 0 (a vocabulary mask), and targets moved off
  /// those columns. 0: no mask.
  std::int64_t masked_every = 0;
  /// With a bias: -inf on the last k columns too (with a vocabulary split, a whole shard), and
  /// targets moved off them.
  std::int64_t masked_tail = 0;
  /// Logits are about N(0, logit_scale^2): hidden ~ N(0, 1), weight ~ N(0, logit_scale^2 / H).
  float logit_scale = 1.0f;
  std::uint64_t seed = 1;
};

/// A generated problem. The float vectors hold the values the library sees (bf16-exact when
/// the dtype is bf16), so the oracle runs on exactly the same numbers.
struct CeData {
  explicit CeData(const CeSpec& s);

  CeSpec spec;
  std::vector<float> hidden, weight, bias;
  std::vector<BFloat16> hidden_bf, weight_bf, bias_bf;
  std::vector<std::int32_t> targets32;
  std::vector<std::int64_t> targets64;
  std::vector<float> class_weights, token_weights, grad_output;

  void set_target(std::int64_t row, std::int64_t y);
  /// Rounds the float values to bf16 (when bf16) and refreshes the bf16 copies after an edit.
  void sync();
  /// Views of the inputs; grad_output is included for reduction none.
  CrossEntropyInputs inputs(const CrossEntropyOptions& o) const;
  reference::CeProblem problem(const CrossEntropyOptions& o) const;
};

/// Which gradients a call asks for, in which dtype.
struct GradRequest {
  bool hidden = true;
  bool weight = true;
  bool bias = true;  ///< only when the problem has a bias
  DType dtype = DType::kF32;
};

/// Caller-owned gradient buffers of one dtype, viewed as CrossEntropyGrads.
class GradBuffers : public GradStorage {
 public:
  GradBuffers(const CeData& d, const GradRequest& r, float fill = 0.0f);
  CrossEntropyGrads views(bool accumulate = false) {
    return views_as<CrossEntropyGrads>(accumulate);
  }
};

/// Per-row output buffers, pre-filled with sentinels (row_loss NaN, lse and predictions 12345) to
/// catch unwritten rows (a skipped row's lse is written NaN).
struct OutBuffers {
  explicit OutBuffers(std::int64_t n);
  CrossEntropyOutputs views();
  std::vector<float> row_loss, lse;
  std::vector<std::int32_t> predictions;
};

/// One library call and everything it produced.
struct LibRun {
  CrossEntropyResult result;
  Plan plan;
  GradBuffers grads;
  OutBuffers out;
};

/// Runs forward_backward with a fresh workspace of exactly workspace_bytes(); `outputs` adds
/// the per-row outputs (always added for reduction none).
LibRun run_library(const CeData& d, const CrossEntropyOptions& o, const GradRequest& g,
                   bool outputs = true, int threads = 0);

/// Checks a run against the oracle: loss, z-loss, accuracy, entropy, valid rows, the mean's
/// divisor, row_loss/lse/predictions (when produced) and every requested gradient, with the
/// tolerance of the input dtype (values) and of the gradient dtype (gradients).
void check_against_oracle(const CeData& d, const CrossEntropyOptions& o, const GradRequest& g,
                          const LibRun& run, const reference::CeResult& ref, bool outputs = true);

/// Generates, runs and checks one case; returns the run for further checks.
LibRun check_case(const CeSpec& s, const CrossEntropyOptions& o, const GradRequest& g);

/// Budget that gives exactly `rows` rows per chunk (a multiple of 64) for this problem and
/// these gradients in token-chunk order; found by asking the planner, checked by the caller.
std::size_t budget_for_chunk_rows(const CeData& d, const CrossEntropyOptions& o,
                                  const GradRequest& g, std::int64_t rows);

/// [begin, end) of part i of `offsets` over [0, total).
inline std::pair<std::int64_t, std::int64_t> part(const std::vector<std::int64_t>& offsets,
                                                  std::size_t i, std::int64_t total) {
  return {offsets[i], i + 1 < offsets.size() ? offsets[i + 1] : total};
}

/// Views of rows [o, o + rows) of a [*, width] (width 0: [*]) buffer of the problem's dtype.
TensorView rows_of(const CeData& d, const std::vector<float>& f, const std::vector<BFloat16>& b,
                   std::int64_t o, std::int64_t rows, std::int64_t width);

/// The groups of a grid of `nr` row parts x `nv` vocabulary parts: a vocabulary group per row
/// part and a data group per vocabulary part (when split that way), the rank (ri, vi) their
/// vocab(ri, vi) and data(ri, vi) (null: not split that way).
struct Grid {
  Grid(std::size_t nr, std::size_t nv) {
    for (std::size_t i = 0; nv > 1 && i < nr; ++i)
      vocab_groups.push_back(std::make_unique<dist::InProcessGroup>(static_cast<int>(nv)));
    for (std::size_t i = 0; nr > 1 && i < nv; ++i)
      data_groups.push_back(std::make_unique<dist::InProcessGroup>(static_cast<int>(nr)));
  }
  dist::Communicator* vocab(std::size_t ri, std::size_t vi) const {
    return vocab_groups.empty() ? nullptr : &vocab_groups[ri]->comm(static_cast<int>(vi));
  }
  dist::Communicator* data(std::size_t ri, std::size_t vi) const {
    return data_groups.empty() ? nullptr : &data_groups[vi]->comm(static_cast<int>(ri));
  }
  std::vector<std::unique_ptr<dist::InProcessGroup>> vocab_groups, data_groups;
};

/// A one-line description of options, for INFO/CAPTURE.
std::string describe(const CeSpec& s, const CrossEntropyOptions& o, const GradRequest& g);

}  // namespace chunkloss::test
