// Token objectives on the shared engine: losses whose per-token coefficient c_t is known from the
// row alone, written as a function of the token's log-probability (focal loss, unlikelihood,
// PPO/GRPO-style clipped ratios, per-token KL penalties, and user-written ones). Each chunk is
// finished in one visit: logits, row statistics, the objective on the host for the chunk's rows,
// then the gradient epilogue and the two gradient GEMMs (3 GEMMs per token, as cross-entropy).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chunkloss/core/context.h"
#include "chunkloss/core/tensor.h"
#include "chunkloss/core/workspace.h"
#include "chunkloss/dist/communicator.h"
#include "chunkloss/losses/cross_entropy.h"
#include "chunkloss/losses/plan.h"
#include "chunkloss/losses/vocab_shard.h"

namespace chunkloss {

/// What a token objective sees of one valid row (target != ignore_index) after its statistics.
struct TokenStats {
  std::int64_t row = 0;     ///< the row's index in [0, N): the key to the caller's per-row data
  std::int64_t target = 0;  ///< y_t in [0, V)
  double logp = 0;          ///< log softmax(z_t)[y_t], computed in fp32
};

/// An objective's verdict on one row.
struct TokenValue {
  double loss = 0;   ///< the row's loss
  double dlogp = 0;  ///< d loss / d logp of the row
};

/// The extension point: a per-token loss that depends on the logits only through the target's
/// log-probability, loss_t = f_t(logp_t). Its gradient is dL/dz_t = -f_t'(logp_t) (p_t -
/// onehot_t), which the engine forms from `dlogp`; the engine owns everything else (chunking,
/// loop order, gradients, accuracy). The batch loss is the mean (or sum, see TokenOptions) of
/// the valid rows' losses. f_t may depend on the row through TokenStats::row (advantages, old
/// log-probs, a reference's log-probs held by the objective). Implementations must be pure
/// functions of their arguments and immutable after construction: rows come chunk by chunk, in
/// an order that depends on the plan.
class TokenObjective {
 public:
  virtual ~TokenObjective() = default;
  /// Name used in error messages ("Focal", "MyLoss").
  virtual std::string_view name() const = 0;
  /// Loss and d loss / d logp of one valid row. `extras` has one slot per name of
  /// extra_metrics(), zero on entry; values are averaged over the valid rows.
  virtual TokenValue evaluate(const TokenStats& row, std::span<double> extras) const = 0;
  /// Names of the extra metrics written into `extras`.
  virtual std::vector<std::string> extra_metrics() const { return {}; }
  /// The number of rows its per-row data covers: TokenLoss refuses a call whose hidden has
  /// another N before anything is written. nullopt (the default): any N.
  virtual std::optional<std::int64_t> rows() const { return std::nullopt; }
};

/// Options of a token loss; the engine's options of CrossEntropyOptions, same meaning.
struct TokenOptions {
  std::int64_t ignore_index = -100;  ///< rows with this target contribute nothing
  /// kMean: the loss and the gradients are divided by the number of valid rows (0 with none);
  /// kSum: not divided. kNone is refused (an objective weighs its rows itself).
  Reduction reduction = Reduction::kMean;
  std::size_t memory_budget_bytes = 0;  ///< 0: 256 MiB on the CPU, 1 GiB on CUDA
  LoopOrder loop_order = LoopOrder::kAuto;
  DType logits_dtype = DType::kF32;  ///< bf16 is an opt-in speed mode (bf16 inputs)
  bool fp32_weight_grad_accumulator = false;
  bool check_finite = false;  ///< hidden, weight and bias checked for NaN/Inf first
  bool skip_ignored_rows = false;
  /// With TokenInputs::data_group: sum dW and db over the group inside the call (in fp32,
  /// through the fp32 dW accumulator this turns on, rounded once).
  bool reduce_weight_grad_over_data_group = false;
};

/// Inputs: hidden [N, H], weight [V, H] (same float dtype), bias [V] optional, targets [N] i32 or
/// i64 in [0, V) or ignore_index, in host memory (CPU) or on the context's device (CUDA). As for
/// LinearCrossEntropy, ignored rows' hidden must be finite unless skip_ignored_rows skips them.
struct TokenInputs {
  TensorView hidden;
  TensorView weight;
  TensorView bias;
  TensorView targets;
  /// Data parallelism: the ranks of this group each call with their own rows (the same weight,
  /// objective and options). The mean divides by the group's valid rows, so each rank's
  /// gradients are its rows' share of the gradient of the group's mean: sum dW and db over the
  /// group afterwards, or set TokenOptions::reduce_weight_grad_over_data_group. The loss,
  /// accuracy, valid_rows and metrics are the group's; logps and TokenStats::row are this
  /// rank's rows. Every rank must make the call: one that any rank rejects (shapes, workspace,
  /// targets, check_finite's findings, another kind of call) makes every rank throw before
  /// anything is written, and an objective that fails on any rank makes every rank throw at the
  /// end of the call, the gradient buffers then holding unspecified values. With vocab_shard too,
  /// the data group holds the ranks at one vocabulary position, one from each vocabulary group.
  /// null: these rows alone.
  dist::Communicator* data_group = nullptr;
  /// Vocabulary parallelism (see VocabShard): every rank passes the same hidden, targets (ids in
  /// [0, size)), objective and options, and its own weight (and bias) shard. Each chunk's row
  /// statistics are merged over the ranks before the objective runs, so every rank evaluates the
  /// objective on the same rows with the same logp (each rank calls its own objective: it must
  /// give the same values on every rank; the ranks compare a digest of the coefficients and of
  /// the loss and metric sums at the end, and all throw if they differ), and gets the same loss,
  /// metrics, logps and dH; dW and db are the shard's. It runs in token-chunk order
  /// (loop_order vocab_block is refused). The ranks first agree whether any rank rejected its call
  /// or makes a call whose collectives or objective differ (rows, H, chunks and the rows
  /// skip_ignored_rows computes, dH asked for, check_finite, a data_group passed or not, the
  /// vocabulary's size, ignore_index, the reduction, the objective's name and metrics), and then
  /// all throw. An objective that fails on any rank makes every rank throw at the end of the call.
  /// Unset: not split.
  VocabShard vocab_shard = {};
};

/// Results of one call, on the host.
struct TokenResult {
  double loss = 0;              ///< mean (or sum) over valid rows of the objective's losses
  double accuracy = 0;          ///< fraction of valid rows whose first argmax is the target
  std::int64_t valid_rows = 0;  ///< rows whose target is not ignore_index
  /// The objective's extra metrics, each the mean over the valid rows (0 without any).
  std::vector<std::pair<std::string, double>> metrics;
  /// [N] each row's logp as the objective saw it (NaN for ignored rows): a policy's "old
  /// log-probs" for the next step of a clipped-ratio objective.
  std::vector<double> logps;
};

/// A token loss: an objective on the shared engine. Immutable; thread-compatible.
/// Memory: the workspace (workspace_bytes()) bounded by the budget; nothing else on the device.
/// The targets are read on the host once at the start (so an out-of-range target throws before
/// anything is written), and each chunk's row log-probs come to the host, where the objective
/// runs in double precision, and their coefficients go back: on CUDA the host waits for the
/// stream at every chunk (for the log-probs; the copy back from pageable memory may wait too), so
/// such a call cannot be captured into a CUDA graph. Data parallel over a group, the vocabulary
/// split over another, or both (see TokenInputs::data_group and vocab_shard).
class TokenLoss {
 public:
  explicit TokenLoss(std::shared_ptr<const TokenObjective> objective,
                     const TokenOptions& options = {});

  const TokenObjective& objective() const { return *objective_; }
  const TokenOptions& options() const { return options_; }

  /// The plan for a call (chunking, loop order, workspace layout); checks shapes only.
  Plan plan(const TokenInputs& in, const CrossEntropyGrads& grads = {}) const;
  std::size_t workspace_bytes(const TokenInputs& in, const CrossEntropyGrads& grads = {}) const;

  /// Loss, metrics and the requested gradients (CrossEntropyGrads: overwritten, or accumulated
  /// into). `workspace` holds workspace_bytes() on the inputs' device. Throws chunkloss::Error
  /// naming the argument before writing anything on invalid input (shapes, dtypes, targets,
  /// check_finite's findings). An objective that throws or returns a non-finite value makes the
  /// call throw chunkloss::Error (with the objective's message and its exception nested); the
  /// gradient buffers then hold unspecified values when chunks before the failing row were
  /// finished (the message says so).
  TokenResult forward_backward(Context& ctx, const TokenInputs& in, const CrossEntropyGrads& grads,
                               const Workspace& workspace) const;
  /// Evaluation: no gradient work.
  TokenResult forward(Context& ctx, const TokenInputs& in, const Workspace& workspace) const {
    return forward_backward(ctx, in, {}, workspace);
  }

 private:
  std::shared_ptr<const TokenObjective> objective_;
  TokenOptions options_;
};

}  // namespace chunkloss
