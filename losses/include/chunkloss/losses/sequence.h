// Sequence objectives on the shared engine: losses whose per-token coefficient c_t needs the
// whole sequence (DPO, ORPO, SimPO, CPO, KTO, and user-written ones). The engine runs pass 1 (row
// statistics, per-sequence sums of token log-probs), hands the tiny per-sequence vectors to the
// objective, then pass 2 (the gradient epilogue with c_t and the two gradient GEMMs).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chunkloss/core/context.h"
#include "chunkloss/core/error.h"
#include "chunkloss/core/tensor.h"
#include "chunkloss/core/workspace.h"
#include "chunkloss/dist/communicator.h"
#include "chunkloss/losses/plan.h"
#include "chunkloss/losses/vocab_shard.h"

namespace chunkloss {

/// A linear head: logits = hidden @ weight^T + bias. hidden [N, H] (or [S, T, H]), weight
/// [V, H], bias [V] optional, all of one float dtype on one device. The hidden rows of ignored
/// targets (prompts, padding) must be finite too: a computed row's zero gradient still meets
/// them in dW (0 * NaN is NaN), and which ignored rows a call computes depends on its plan.
struct Head {
  TensorView hidden;
  TensorView weight;
  TensorView bias;
};

/// What the objective sees of one sequence after pass 1 (double precision sums).
struct SequenceStats {
  double logp = 0;          ///< sum of log softmax(z_t)[y_t] over the valid tokens (policy)
  double ref_logp = 0;      ///< the reference's sum; 0 when the call has no reference
  std::int64_t tokens = 0;  ///< valid tokens (>= 1: empty sequences are rejected)
  double logit_sum = 0;     ///< sum of the policy logits over the valid tokens and the vocab
  int label = 1;            ///< pairs: 1 chosen, 0 rejected; unpaired: 1 desirable, 0 undesirable
};

/// Constants of a batch that an objective may use (computed before pass 1, detached).
struct BatchConstants {
  double kl = 0;  ///< KTO's reference point z0 (0 unless the loss computes or is given one)
};

/// An objective's verdict on one unit (a pair, or a single sequence).
struct UnitResult {
  double loss = 0;                 ///< the unit's loss; the batch loss is the mean over units
  std::array<double, 2> dlogp{};   ///< d loss / d logp of each sequence of the unit (sums)
  std::array<double, 2> reward{};  ///< the implicit rewards, for the reward metrics
};

/// How sequences form the units an objective is evaluated on.
enum class Unit : std::uint8_t {
  kPair,      ///< sequences i and i + P of a [2P, T] batch (chosen first)
  kSequence,  ///< each sequence alone, with a label (KTO)
};

/// The extension point: the math of a sequence-level loss on per-sequence statistics. The engine
/// owns everything else (chunking, regimes, both passes, gradients, metrics). The batch loss is
///   L = mean over units u of evaluate(u).loss + nll_weight() * NLL(chosen tokens)
/// where NLL is the mean token cross-entropy over the valid tokens of the chosen (or desirable)
/// sequences. Implementations must be pure functions of their arguments (the engine may evaluate
/// groups of units in any order) and immutable after construction.
class SequenceObjective {
 public:
  virtual ~SequenceObjective() = default;
  /// Name used in error messages ("Dpo", "MyLoss").
  virtual std::string_view name() const = 0;
  virtual Unit unit() const = 0;
  /// Loss and d loss / d logp (w.r.t. the sums in SequenceStats) of one unit: `seqs` holds
  /// (chosen, rejected) for pairs, one sequence for Unit::kSequence. `extras` has one slot per
  /// name of extra_metrics(); values are averaged over units.
  virtual UnitResult evaluate(std::span<const SequenceStats> seqs, const BatchConstants& batch,
                              std::span<double> extras) const = 0;
  /// Weight of the NLL term over chosen tokens; 0: none.
  virtual double nll_weight() const { return 0; }
  /// Whether the objective works on length-averaged log-probs: the logps/* metrics, and the
  /// values pair_antisymmetric() speaks of (the deferred regime builds its gradient from them).
  /// evaluate() receives sums either way.
  virtual bool averages_log_probs() const { return false; }
  /// Pairs only: whether the loss sees a pair only through value(chosen) - value(rejected), with
  /// value the log-prob sum (or, with averages_log_probs(), the length average), so that its
  /// derivatives in the two values are equal and opposite. This enables Regime::kDeferred, which
  /// checks it on the pair it defers.
  virtual bool pair_antisymmetric() const { return false; }
  /// Whether a reference (head or precomputed log-probs) is allowed. It is not required: a
  /// call without one gives ref_logp = 0.
  virtual bool uses_reference() const { return false; }
  /// Whether the objective uses BatchConstants::kl (KTO); enables the KL inputs.
  virtual bool uses_kl() const { return false; }
  /// Names of the extra metrics written into `extras`.
  virtual std::vector<std::string> extra_metrics() const { return {}; }
};

/// Options of the engine shared by every sequence loss.
struct SequenceOptions {
  std::int64_t ignore_index = -100;  ///< targets with this value (prompt, padding) are skipped
  /// Bound on the workspace in bytes. 0 picks the device's default: 256 MiB CPU, 1 GiB CUDA.
  /// Chunks are multiples of 64 rows (or all rows), resident groups whole units. A budget below
  /// the smallest chunk gives that chunk's workspace instead (Plan::over_budget), except that
  /// Regime::kResident, when asked for, throws.
  std::size_t memory_budget_bytes = 0;
  Regime regime = Regime::kAuto;              ///< resident, recompute, or the cost model's choice
  LoopOrder loop_order = LoopOrder::kAuto;    ///< pass 2 order in the recompute regime
  DType logits_dtype = DType::kF32;           ///< bf16 is an opt-in speed mode (CUDA)
  bool fp32_weight_grad_accumulator = false;  ///< see CrossEntropyOptions
  /// With PreferenceInputs::data_group: sum dW and db over the group inside the call, in fp32
  /// through the fp32 dW accumulator this turns on, rounded once (see CrossEntropyOptions).
  bool reduce_weight_grad_over_data_group = false;
  /// Check every head's hidden/weight/bias for NaN/Inf before computing (on CUDA: on the
  /// device, one read of each and a synchronisation per tensor).
  bool check_finite = false;
};

/// A batch of sequences laid out as [S, T] rows (row s*T + t is token t of sequence s).
/// Paired losses: S = 2P, sequences [0, P) chosen and [P, 2P) rejected, pair i = (i, i + P).
struct PreferenceInputs {
  Head policy;         ///< gradients flow into this head; hidden has S*T rows
  TensorView targets;  ///< [S, T] i32 or i64: next-token ids, ignore_index for prompt/padding
  /// Optional reference head (no gradients), same targets and layout. Exclusive with
  /// reference_logps.
  Head reference;
  /// Optional [S] f32: per-sequence sums of the reference's token log-probs (host or device).
  TensorView reference_logps;
  /// Unpaired losses (KTO): [S] i32, 1 desirable, 0 undesirable (host or device).
  TensorView labels;
  /// KTO's KL reference point: given here, or computed from `kl_batch`, else 0.
  std::optional<double> kl;
  /// KTO: a batch of mismatched (prompt, completion) sequences whose mean policy-minus-reference
  /// log-prob, clamped at 0, is the KL reference point (computed without gradients). As in the
  /// main batch, every sequence needs a valid target and reference_logps must be finite.
  struct KlBatch {
    Head policy;                 ///< the policy head on the mismatched sequences
    TensorView targets;          ///< [S', T'] targets of the mismatched sequences
    Head reference;              ///< the reference head on them, or
    TensorView reference_logps;  ///< [S'] their reference log-prob sums
  } kl_batch;
  /// Vocabulary parallelism (see VocabShard): every head's weight (and bias) is this rank's
  /// shard, at the same rows for the policy, the reference and the KL batch; every rank passes
  /// the same hidden rows, targets (ids in [0, size)), labels, reference_logps and kl, and the
  /// same options. Every rank gets the same loss, metrics, per-sequence vectors and dH, and the dW
  /// and db of its shard. Not in the deferred regime nor in vocab-block order. Every rank must
  /// make the same kind of call (a reference head, a KL batch, dH asked for, the same plan, the
  /// vocabulary's size, and the same reference_logps, labels and kl: checked); a call any rank
  /// rejects makes every rank throw before anything is written, and an objective that fails on
  /// any rank (say its options differ, which the library cannot see) makes every rank throw at
  /// the end of the call, the gradient buffers then holding unspecified values.
  VocabShard vocab_shard;
  /// Data parallelism: the ranks of this group each call with their own sequences (S and T may
  /// differ; the heads' H, V, dtype, the options and the gradients asked for must not). The
  /// call then computes the group's loss: the mean over every rank's units, plus nll_weight
  /// times the NLL over every rank's chosen tokens; KTO's KL point from kl_batch is the mean
  /// over every rank's KL batch. Each rank's gradients are its rows' share of that loss's
  /// gradient: sum (do not average) dW and db over the group afterwards, or set
  /// SequenceOptions::reduce_weight_grad_over_data_group. The loss, the metrics and kl are the
  /// group's, equal on every rank; the per-sequence vectors (logps, rewards, unit_losses, ...)
  /// are this rank's. Every rank must make the call, of the same kind (a KL batch or not, dW and
  /// db summed or not, the same objective): this is checked. A call that any rank rejects
  /// (shapes, workspace, values such as targets, labels, reference_logps, a sequence without
  /// valid tokens, check_finite's findings) makes every rank throw before anything is written,
  /// and an objective that fails (throws, or returns a non-finite value) on any rank makes every
  /// rank throw at the end of the call (on CUDA the ranks' sums pass through the context's own
  /// scratch memory, not the workspace). plan() and workspace_bytes() must see the same
  /// data_group; they check what the call does but cannot reach the other ranks, so a rank
  /// where they throw must still make the call (with any workspace), or the others wait in its
  /// first exchange. With vocab_shard too, the data group holds
  /// the ranks at one vocabulary position. null: this call's sequences alone.
  dist::Communicator* data_group = nullptr;
};

/// Gradient buffers owned by the caller (absent: not computed; all absent: forward only). On CUDA
/// with f32 heads they are f32 (cuBLAS has no GEMM from f32 operands to a bf16 result).
struct PreferenceGrads {
  TensorView hidden;  ///< [S*T, H] f32 or bf16
  TensorView weight;  ///< [V, H] f32 or bf16
  TensorView bias;    ///< [V] f32 or bf16 (needs policy.bias)
  bool accumulate = false;
  bool any() const { return hidden.defined() || weight.defined() || bias.defined(); }
};

/// Results of one call, on the host.
struct PreferenceResult {
  double loss = 0;  ///< mean over units of the objective's loss, plus the NLL term
  /// Metrics with TRL's names: rewards/chosen, rewards/rejected, rewards/accuracies (pairs),
  /// rewards/margins, logps/chosen, logps/rejected, logits/chosen, logits/rejected, nll_loss
  /// (when the NLL term is on), the objective's extras; unpaired losses also count/chosen,
  /// count/rejected (sequences per label) and, with uses_kl(), kl. An unpaired batch (the data
  /// group's) without sequences of one label has none of that label's metrics, nor margins.
  std::vector<std::pair<std::string, double>> metrics;
  std::vector<double> logps;         ///< [S] policy log-prob sums
  std::vector<double> ref_logps;     ///< [S] reference log-prob sums (0 without a reference)
  std::vector<std::int64_t> tokens;  ///< [S] valid tokens
  std::vector<double> rewards;       ///< [S] the objective's implicit rewards
  std::vector<double> unit_losses;   ///< [units] per pair (or per sequence) losses
  double kl = 0;                     ///< the KL reference point used (KTO)

  /// The metric called `name`; throws chunkloss::Error if there is none.
  double metric(std::string_view name) const;
};

/// A sequence loss: an objective on the shared engine. Immutable; thread-compatible.
/// Memory: the workspace (workspace_bytes()) bounded by the budget; nothing else on the device.
/// A call synchronises with the device twice per group of units (the per-sequence statistics
/// come to the host, where the objective runs in double precision, and the coefficients go back).
class SequenceLoss {
 public:
  explicit SequenceLoss(std::shared_ptr<const SequenceObjective> objective,
                        const SequenceOptions& options = {});

  const SequenceObjective& objective() const { return *objective_; }
  const SequenceOptions& options() const { return options_; }

  /// The plan for a call (regime, groups, chunking, workspace layout); checks shapes only. With
  /// a data group and the dW sum, the layout holds an fp32 dW accumulator.
  Plan plan(const PreferenceInputs& in, const PreferenceGrads& grads = {}) const;
  std::size_t workspace_bytes(const PreferenceInputs& in, const PreferenceGrads& grads = {}) const;

  /// Loss, metrics and the requested gradients. `workspace` holds workspace_bytes() on the
  /// inputs' device. Throws chunkloss::Error naming the argument before writing anything on
  /// invalid input (odd S for pairs, shape or dtype mismatch, out-of-range targets, a sequence
  /// without valid tokens, missing or unexpected reference or labels, check_finite's findings).
  /// An objective that throws or returns a non-finite value makes the call throw
  /// chunkloss::Error (with the objective's message; the objective's own exception is nested in
  /// it, for std::rethrow_if_nested); in the resident regime with several
  /// groups the objective runs group by group, so if that happens after the first group the
  /// gradient buffers hold unspecified values (the message says so), as they do after any such
  /// failure in the deferred regime, which writes its first pair's gradients before the
  /// objective sees that pair. A reference head's non-finite log-prob fails the call before
  /// anything is written. With a data group or a vocabulary split, see
  /// PreferenceInputs::data_group and vocab_shard.
  PreferenceResult forward_backward(Context& ctx, const PreferenceInputs& in,
                                    const PreferenceGrads& grads, const Workspace& workspace) const;
  /// Evaluation: pass 1 only, no gradient work.
  PreferenceResult forward(Context& ctx, const PreferenceInputs& in,
                           const Workspace& workspace) const {
    return forward_backward(ctx, in, {}, workspace);
  }

 private:
  std::shared_ptr<const SequenceObjective> objective_;
  SequenceOptions options_;
};

/// Per-sequence log-probs of a head on [S, T] targets (sum over valid tokens, and the count):
/// pass 1 only, bounded memory. For reference passes and evaluation.
struct SequenceLogProbResult {
  std::vector<double> logps;
  std::vector<std::int64_t> tokens;
};

class SequenceLogProbs {
 public:
  explicit SequenceLogProbs(const SequenceOptions& options = {});
  /// `shard`: the head's weight (and bias) is this rank's rows of a vocabulary split, as in
  /// PreferenceInputs::vocab_shard; every rank of the group makes the call with the same hidden
  /// rows and targets (ids in [0, V)) and gets every sequence's log-prob. Any rank's rejected
  /// call (shapes, shard, targets, check_finite, a different plan or rows) makes every rank
  /// throw (a workspace that is too small or on another device included: on CUDA the ranks
  /// exchange through the context's own scratch memory). plan() and workspace_bytes() must see
  /// the same shard.
  Plan plan(const Head& head, const TensorView& targets, const VocabShard& shard = {}) const;
  std::size_t workspace_bytes(const Head& head, const TensorView& targets,
                              const VocabShard& shard = {}) const;
  /// Sequences without valid tokens get logp 0 and tokens 0.
  SequenceLogProbResult compute(Context& ctx, const Head& head, const TensorView& targets,
                                const Workspace& workspace, const VocabShard& shard = {}) const;

 private:
  SequenceOptions options_;
};

}  // namespace chunkloss
