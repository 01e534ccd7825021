// LinearCrossEntropy: cross-entropy over logits = hidden @ weight^T + bias, computed chunk by
// chunk by the shared engine without ever holding the [N, V] logits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "chunkloss/core/context.h"
#include "chunkloss/core/error.h"
#include "chunkloss/core/tensor.h"
#include "chunkloss/core/workspace.h"
#include "chunkloss/dist/communicator.h"
#include "chunkloss/losses/plan.h"
#include "chunkloss/losses/vocab_shard.h"

namespace chunkloss {

/// How per-row losses are combined.
enum class Reduction : std::uint8_t {
  kMean,  ///< sum over valid rows / (number of valid rows, or the sum of their class weights);
          ///< with no valid row, or class weights summing to 0 over the valid rows, the loss
          ///< and the gradients are 0 (PyTorch gives NaN). A call of no rows (N = 0) is refused.
  kSum,   ///< sum over valid rows
  kNone,  ///< per-row losses; the backward takes a per-row upstream gradient
};

std::string_view reduction_name(Reduction r);

/// Options of LinearCrossEntropy. Defaults follow PyTorch's cross_entropy. The loss of a valid
/// row with target y is (1 - ls)(lse - z_y) + (ls / V) sum_j (lse - z_j) (class-weighted as in
/// PyTorch), plus z_loss * lse^2 (times cw_y with class weights, as the cross-entropy term: the
/// mean divides by their sum, so scaling every class weight changes nothing, and a class of weight
/// 0 adds no z-loss either); ignored rows contribute nothing.
struct CrossEntropyOptions {
  std::int64_t ignore_index = -100;  ///< rows with this target contribute nothing
  Reduction reduction = Reduction::kMean;
  float label_smoothing = 0.0f;  ///< ls in [0, 1]; eps = ls / V spread over all classes
  float z_loss = 0.0f;           ///< adds z_loss * lse^2 per valid row (>= 0; x cw_y, see above)
  std::optional<float> softcap;  ///< logits z -> c * tanh(z / c), c > 0
  /// Also report the mean softmax entropy over valid rows (the other results are bitwise those
  /// of a call without it).
  bool compute_entropy = false;
  /// Bound on the workspace in bytes (logits chunk, row statistics, scratch). 0 picks the
  /// device's default: 256 MiB on the CPU, 1 GiB on CUDA. A budget below the smallest token
  /// chunk (64 rows, or all rows when fewer) gives that chunk's workspace instead, and
  /// Plan::over_budget says so; a requested loop_order vocab_block whose smallest block (64
  /// columns) does not fit is refused.
  std::size_t memory_budget_bytes = 0;
  LoopOrder loop_order = LoopOrder::kAuto;
  DType logits_dtype = DType::kF32;  ///< fp32 logits chunk; bf16 is an opt-in speed mode
  /// Accumulate dW across chunks in an fp32 buffer in the workspace (V*H*4 bytes, on top of
  /// the budget), rounding once into the caller's dW. Only matters for a bf16 dW: accumulated in
  /// the caller's buffer, it is rounded once per chunk, so its error grows with the number of
  /// chunks (against float64: about 1.7e-3 in one chunk, 3.4e-3 in 8, 5.4e-3 in 32). An fp32
  /// grads.weight (allowed with bf16 inputs) accumulates in fp32 without this buffer.
  bool fp32_weight_grad_accumulator = false;
  /// With inputs.data_group: sum dW and db over the group inside the call, so every rank ends
  /// with the gradient of the group's mean (else each rank has its rows' share). The sums are
  /// taken in fp32, through the fp32 dW accumulator this turns on, and rounded once.
  bool reduce_weight_grad_over_data_group = false;
  /// Check hidden, weight, bias, token_weights and grad_output for NaN/Inf before computing (one
  /// extra read of each). (class_weights are always checked: finite and >= 0.) On CUDA this
  /// also reads the device's value checks before anything is written, at the cost of one wait
  /// for the stream (see LinearCrossEntropy), so such a call cannot be captured into a CUDA
  /// graph. The ranks of a group must agree on it (checked).
  bool check_finite = false;
  /// Skip runs of ignored rows (prompts, padding): the ignored rows before the first valid
  /// target and after the last, and each run of ignored rows between valid ones at least
  /// Plan::skip_gap_rows long, are not multiplied at all, so their GEMM work is saved. Their dH
  /// rows are written as zero (left as they were with grads.accumulate), outputs.row_loss gets 0
  /// and outputs.lse NaN there. The chunks are cut from the rows computed alone, so pieces of
  /// several completions share a chunk, whose logits, dH and dW GEMMs each run once over their
  /// rows gathered side by side. The plan counts that staging: C rows of X, and C fp32 rows
  /// for the dH GEMM (none on CUDA where an fp32 logits tile with a bf16 gradient has room for
  /// them in its free halves). A skipped run can split a GEMM around it, so shorter
  /// runs (64 rows from the cost model) are computed with the rows around them. With no valid
  /// row every row is skipped and the gradients are zero (kept with grads.accumulate).
  /// Everything else is unchanged: the results agree with a call that does not skip, to
  /// rounding. The targets are read on the host to find the runs: on CUDA that is one more wait
  /// for the stream, at the start of the call (so such a call cannot be captured into a CUDA
  /// graph), and out-of-range targets are then thrown before anything is written. Only
  /// token-chunk order skips, so with loop_order kAuto the plan takes it; an explicit
  /// kVocabBlock, whose second pass multiplies all rows at once, skips nothing.
  bool skip_ignored_rows = false;
  /// Copy the scalar results to the host at the end of the call (the call's one host
  /// synchronisation on CUDA, with a second one up front when the call has groups or skips rows).
  /// false: no synchronisation at all without groups, skip_ignored_rows and check_finite; the
  /// CrossEntropyResult fields are NaN and the results are read from outputs.scalars, which is
  /// then required.
  bool copy_results_to_host = true;
};

/// Inputs. Shapes: hidden [N, H], weight [V, H] (same float dtype), bias [V] optional (same
/// dtype; a -inf entry masks its column: probability 0, no gradient unless a valid row targets
/// it (that row's loss is then +inf, as in PyTorch), check_finite refuses it,
/// label smoothing then makes the loss infinite as in PyTorch, and a row whose columns are all
/// masked is NaN; with softcap a -inf logit is capped to -softcap, so it masks nothing), targets
/// [N] i32 or i64 in [0, V) or ignore_index, class_weights [V] f32 optional (finite and >= 0; the
/// mean's divisor sums them), token_weights [N] f32 optional (scale each row's loss; not part of
/// the mean's divisor), grad_output [N] f32: the upstream gradient, required with Reduction::kNone
/// when any gradient is requested, not allowed otherwise. Ignored rows' hidden must be finite
/// too (as in PyTorch, their zero gradient still meets them in dW: 0 * NaN is NaN), unless
/// skip_ignored_rows skips them.
struct CrossEntropyInputs {
  TensorView hidden;
  TensorView weight;
  TensorView bias;
  TensorView targets;
  TensorView class_weights;
  TensorView token_weights;
  TensorView grad_output;
  /// Vocabulary parallelism (Megatron-style vocab-parallel cross-entropy, see VocabShard): every
  /// rank passes the same hidden, targets (ids in [0, size)), class weights ([size], whole),
  /// token weights and options, and its own weight (and bias) shard. Every rank gets the same
  /// loss, lse, predictions and dH; dW and db are the shard's. With groups, the ranks first agree
  /// whether any rank rejected its call (shapes, shard, plan, workspace; on the CPU also targets,
  /// class weights and check_finite's values) or makes a call whose collectives differ (rows, H,
  /// chunks and the rows skip_ignored_rows computes, dH asked for, a data_group passed or not, the
  /// vocabulary's size, the options of the rows' terms and check_finite; over data_group, H, V,
  /// dW and db summed or not, and check_finite), and then all throw (a valid rank's message names
  /// the first rank that rejected its call and quotes its message). That agreement is inside the
  /// call: a rank whose workspace_bytes() or plan() throws must still make it (with any workspace),
  /// or the others wait in the exchange. On CUDA that exchange passes through the context's own
  /// scratch memory (gpu::Context::scratch(), not the workspace) and waits for the stream once per
  /// group (once more in a grid; two more per group that found a failure). On CUDA,
  /// out-of-range targets, bad class weights and check_finite's findings are counted on the
  /// device: with check_finite all summed over the vocabulary group (each rank's weight and bias
  /// shard are its own) and read at the start, where every rank throws; else per rank (the ranks
  /// pass the same targets and class weights; outputs.scalars[6]), so every rank refuses the call
  /// (see LinearCrossEntropy). Unset: not split.
  VocabShard vocab_shard;
  /// Data parallelism: the ranks of this group each call with their own rows (same weight);
  /// the mean's divisor (valid rows, or their class weights) is summed over the group, so each
  /// rank's gradients are its rows' share of the gradient of the group's mean, and the results
  /// (loss, z-loss, accuracy, entropy, valid rows, weight sum, outputs.scalars) are the group's.
  /// Sum (do not average) dW and db over the group afterwards, as data parallelism does for the
  /// other parameters. Every rank must make the call (as for vocab_shard). With vocab_shard too,
  /// the data group holds the ranks at one vocabulary position, one from each vocabulary group.
  /// On CUDA outputs.scalars[6], the invalid inputs found, is counted over the group too, before
  /// any row is computed, so every rank refuses the call when one rank's inputs are bad (see
  /// LinearCrossEntropy). null: this call's rows alone.
  dist::Communicator* data_group = nullptr;
};

/// Gradient buffers owned by the caller; absent views are not computed. grad_hidden [N, H]
/// and grad_weight [V, H] f32 or bf16, grad_bias [V] f32 or bf16 (on CUDA f32 with f32 hidden,
/// as cuBLAS has no GEMM from f32 operands to a bf16 result). With `accumulate` the
/// gradients are added to the buffers' contents, otherwise the buffers are overwritten.
/// All absent: a forward-only evaluation that does no gradient work.
struct CrossEntropyGrads {
  TensorView hidden;
  TensorView weight;
  TensorView bias;
  bool accumulate = false;
};

/// Optional outputs: row_loss [N] f32 (required with Reduction::kNone; ignored rows
/// get 0), lse [N] f32 (ignored rows get their lse too, rows skip_ignored_rows skipped NaN),
/// predictions [N] i32 (argmax: the first column of the row's largest logit, NaN logits left
/// out, 0 when every column is masked or NaN; -1 for ignored rows).
/// scalars [7] f32 on the inputs' device receives loss, z_loss, accuracy, entropy, valid_rows,
/// weight_sum and the number of invalid inputs found on the device (out-of-range targets and
/// negative or non-finite class weights: nonzero means the call was refused, and the other
/// values are unspecified; with check_finite such a call throws at its start instead).
struct CrossEntropyOutputs {
  TensorView row_loss;
  TensorView lse;
  TensorView predictions;
  TensorView scalars;
};

/// Scalar results, copied to the host once at the end of the call.
struct CrossEntropyResult {
  double loss = 0;      ///< reduced loss (z-loss included); sum of row losses for kNone
  double z_loss = 0;    ///< the z-loss part of `loss`
  double accuracy = 0;  ///< fraction of valid rows whose first argmax equals the target
  double entropy = 0;   ///< mean softmax entropy over valid rows (when asked for)
  std::int64_t valid_rows = 0;
  double weight_sum = 0;  ///< the mean's divisor: valid rows, or the sum of their class weights
};

/// Fused linear cross-entropy (PyTorch: F.cross_entropy(hidden @ weight.T + bias, targets,
/// weight=class_weights, ignore_index, reduction, label_smoothing), plus z-loss and softcap).
///
/// Dense equivalent, for a valid row t with z = softcap(W h_t + b), lse = logsumexp(z):
///   loss_t = tw_t * [(1 - ls) cw_y (lse - z_y) + (ls / V) sum_j cw_j (lse - z_j) + zl lse^2]
/// and the mean divides sum_t loss_t by D = sum over valid t of cw_{y_t} (N_valid without class
/// weights). Gradients: dz_t = c_t [((1-ls) cw_y + (ls/V) sum cw + 2 zl lse) p - (1-ls) cw_y
/// onehot_y - (ls/V) cw] times softcap's chain factor, with c_t = tw_t / D (mean), tw_t (sum) or
/// tw_t * grad_output_t (none); dH = dZ W, dW = dZ^T H, db = colsum(dZ).
///
/// Memory: the workspace (workspace_bytes()) bounded by the options' budget; nothing else is
/// allocated on the device during a call (skip_ignored_rows reads the targets into host memory).
/// Determinism: results are bitwise identical run to run on the same
/// device, thread count and plan; different budgets agree to rounding.
/// Throws chunkloss::Error naming the argument and the shapes on any invalid input, before any
/// output is written. On CUDA alone, the values (targets outside [0, V) and class weights) are
/// checked on the device as the call runs, to need no extra synchronisation (with
/// skip_ignored_rows the targets are checked on the host first). The device counts them before
/// it computes any row (over a data group, the group's count), and a call with any is refused:
/// every row's gradient is zero and no per-row output is written, so for finite inputs the
/// gradient buffers keep their values when accumulated into (x + 0; a -0.0 may read +0.0 after)
/// and hold zeros when overwritten. The call throws at its end, or with copy_results_to_host =
/// false throws nothing and outputs.scalars[6] counts them. With check_finite (whose NaN/Inf
/// would reach the gradients through the GEMMs whatever the rows' coefficients) the call
/// instead waits for the stream once after counting, at its start, and throws before anything
/// is written, on every rank of its groups (whatever copy_results_to_host says).
class LinearCrossEntropy {
 public:
  explicit LinearCrossEntropy(const CrossEntropyOptions& options = {});

  const CrossEntropyOptions& options() const { return options_; }

  /// The plan for a call with these inputs and gradients (same validation as the call).
  Plan plan(const CrossEntropyInputs& in, const CrossEntropyGrads& grads = {}) const;
  /// Workspace bytes a call with these inputs and gradients needs.
  std::size_t workspace_bytes(const CrossEntropyInputs& in,
                              const CrossEntropyGrads& grads = {}) const;

  /// Loss and, for each present buffer in `grads`, the gradient. `workspace` must hold at
  /// least workspace_bytes() on the inputs' device.
  CrossEntropyResult forward_backward(Context& ctx, const CrossEntropyInputs& in,
                                      const CrossEntropyGrads& grads,
                                      const CrossEntropyOutputs& out,
                                      const Workspace& workspace) const;

  /// Forward only (evaluation): no gradient work.
  CrossEntropyResult forward(Context& ctx, const CrossEntropyInputs& in,
                             const CrossEntropyOutputs& out, const Workspace& workspace) const {
    return forward_backward(ctx, in, {}, out, workspace);
  }

 private:
  CrossEntropyOptions options_;
};

}  // namespace chunkloss
