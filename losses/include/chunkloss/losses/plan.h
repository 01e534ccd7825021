// The chunking scheduler's plan: a plain value computed from the shapes, the dtypes and a
// memory budget in bytes, which the engine executes and tests and benchmarks can inspect.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "chunkloss/core/dtype.h"
#include "chunkloss/core/tensor.h"
#include "chunkloss/core/workspace.h"

namespace chunkloss {

/// How the engine walks the [N, V] logits.
/// - kTokenChunk: per chunk of C rows, logits -> stats -> gradient -> dH_c, dW += G^T X_c.
///   3 GEMMs per token; dW (V x H) is read and written once per chunk.
/// - kVocabBlock: pass 1 computes every row's lse chunk by chunk; pass 2 recomputes the
///   logits per block of vocabulary columns for all rows and writes that block of dW once.
///   4 GEMMs per token; dW written once, dH accumulated per block.
/// - kAuto: the scheduler's cost model picks one and says why in Plan::reason.
enum class LoopOrder : std::uint8_t { kAuto, kTokenChunk, kVocabBlock };

std::string_view loop_order_name(LoopOrder o);

/// How a sequence objective keeps logits between its two passes (pass 1: the per-sequence
/// statistics that decide each sequence's coefficient; pass 2: the gradient).
/// - kResident: per group of whole units (pairs or sequences), pass 1 leaves the group's logits
///   in the workspace and pass 2 turns them into the gradient: 3 GEMMs per token.
/// - kRecompute: pass 1 keeps row statistics only; pass 2 recomputes each chunk's logits (4
///   GEMMs per token), so memory does not depend on the sequence length.
/// - kDeferred: the first pair's gradient is written in pass 1, before its coefficient is
///   known (dH rows unscaled in an fp32 workspace block, dW unscaled in the caller's buffer), and
///   scaled by it once the pair's last chunk has its statistics: 3 GEMMs per token for that pair
///   with memory independent of T; the other pairs recompute. Needs a pair-antisymmetric
///   objective without an NLL term, dW overwritten (not accumulated) and no bias gradient
///   (SequenceLayout::deferrable).
/// - kAuto: the cost model picks; kNone: token objectives.
enum class Regime : std::uint8_t { kAuto, kResident, kRecompute, kDeferred, kNone };

std::string_view regime_name(Regime r);

/// What the scheduler needs to know about one call.
struct PlanRequest {
  std::int64_t rows = 0;    ///< N
  std::int64_t hidden = 0;  ///< H
  std::int64_t vocab = 0;   ///< V
  Device device = Device::kCpu;
  DType input_dtype = DType::kF32;            ///< hidden and weight
  DType logits_dtype = DType::kF32;           ///< dtype of the logits chunk (bf16: opt-in)
  DType grad_hidden_dtype = DType::kF32;      ///< dtype of the caller's dH buffer, if any
  DType grad_weight_dtype = DType::kF32;      ///< dtype of the caller's dW buffer, if any
  bool grad_hidden = false;                   ///< dH requested
  bool grad_weight = false;                   ///< dW requested
  bool grad_bias = false;                     ///< db requested
  bool fp32_weight_grad_accumulator = false;  ///< accumulate dW in fp32 workspace
  /// Per-row gradient coefficients kept out of a bf16 gradient tile (CUDA sequence objectives):
  /// the tile holds a power of two per row, and the mantissa scales the dH rows and a staged
  /// copy of the X rows, so a coefficient shared by many rows costs no correlated rounding.
  bool row_scales = false;
  /// Ranks of a vocabulary-parallel group (1: not split): token-chunk order, and staging for
  /// the exchanged row statistics and the chunk's fp32 dH rows before their sum over ranks.
  int vocab_ranks = 1;
  std::size_t budget_bytes = 0;  ///< bound on the workspace, less the optional fp32 dW accumulator
  LoopOrder order = LoopOrder::kAuto;
  /// The call skips runs of ignored rows, which only token-chunk order does: kAuto takes it.
  bool skip_ignored_rows = false;
  /// A token chunk may hold pieces of several row ranges (skip_ignored_rows; the sequence
  /// objectives' trimmed sequences), which the backend gathers side by side for one GEMM each:
  /// the staging holds C rows of X, and C fp32 rows for the dH GEMM where the device has no
  /// other room for them (on CUDA: an fp32 logits tile's free halves, see tile_staging.h).
  bool packed_pieces = false;
};

/// The layout of a sequence objective's rows, for the scheduler.
struct SequenceLayout {
  std::int64_t sequences = 0;       ///< S
  std::int64_t seq_len = 0;         ///< T (rows = S * T)
  std::int64_t unit_sequences = 1;  ///< 2 for pairs (i, i + S/2), 1 for single sequences
  /// The deferred regime applies: pairs of a pair-antisymmetric objective without an NLL term,
  /// dW (if requested) overwritten rather than accumulated, no bias gradient.
  bool deferrable = false;
  Regime regime = Regime::kAuto;
};

/// The scheduler's decision. Slices are offsets into the caller's workspace block.
struct Plan {
  LoopOrder order = LoopOrder::kTokenChunk;
  std::string reason;            ///< why this order and chunking, for logs and benchmarks
  std::int64_t chunk_rows = 0;   ///< C: rows per chunk (pass 1 in vocab-block order)
  std::int64_t num_chunks = 0;   ///< ceil(N / C)
  std::int64_t vocab_block = 0;  ///< columns per block in pass 2 (V in token-chunk order)
  std::int64_t num_vocab_blocks = 0;
  DType logits_dtype = DType::kF32;
  double predicted_token_cost_s = 0;  ///< cost model, token-chunk order
  double predicted_vocab_cost_s = 0;  ///< cost model, vocab-block order (0: not feasible)
  bool over_budget = false;           ///< the smallest possible chunk did not fit the budget
  Regime regime = Regime::kNone;      ///< sequence objectives: resident or recompute
  /// Resident: units (pairs or sequences) per group, by the shapes: whole sequences of T rows.
  /// The engine grows a group by the units after it while their computed rows (each sequence's
  /// from its first to its last valid target, and gaps under 64 rows between those) fit its
  /// logits, each range at most chunk_rows (and within the backend's gather staging, where the
  /// group's rows fit that), so with prompts or padding a call may run fewer, larger groups than
  /// num_groups.
  std::int64_t group_units = 0;
  std::int64_t num_groups = 0;  ///< resident: ceil(units / group_units)
  /// Token objectives (CrossEntropyOptions::skip_ignored_rows): the shortest run of ignored rows
  /// between valid ones worth leaving out, from the cost model. The chunks are cut from the
  /// computed rows, so a skip costs no rewrite of dW, only a GEMM split around it (about m_half
  /// rows of its efficiency); a multiple of 64, at least 64 (splitting a GEMM around fewer rows
  /// wastes about as many in its last tile). 64 with both devices' models.
  std::int64_t skip_gap_rows = 0;
  /// Token-chunk order with PlanRequest::packed_pieces: the staging holds C rows for a chunk's
  /// pieces side by side (X, and fp32 dH where the device needs it).
  bool packed_pieces = false;

  WorkspaceLayout layout;    ///< total() == workspace bytes
  WorkspaceSlice logits;     ///< [C, V] (token) or max([C, V], [N, Vb]) (vocab) logits buffer
  WorkspaceSlice row_stats;  ///< per-row statistics and coefficients, all N rows
  WorkspaceSlice dw_accum;   ///< [V, H] fp32 dW accumulator, when used
  WorkspaceSlice dh_accum;   ///< [N, H] fp32 dH accumulator (vocab order with non-fp32 dH;
                             ///< the deferred regime)
  WorkspaceSlice db_accum;   ///< [V] fp32 bias-gradient accumulator, when db is requested
  WorkspaceSlice staging;    ///< backend scratch (CPU: fp32 copies of bf16 operand tiles)
  WorkspaceSlice scalars;    ///< device-side scalar results (CUDA)

  std::size_t workspace_bytes() const { return layout.total(); }
  /// One line: "order=token_chunk C=2048 chunks=2 ... workspace=256.0 MiB (...)".
  std::string str() const;
};

/// The most rows a chunk gets on device `d` however large the budget (0: no such bound): the
/// depth panel of the device's GEMM, beyond which a longer chunk saves no rewrite of dW and only
/// takes memory. On the CPU 256 when Eigen is built without AVX2, none with it (the default
/// x86-64-v3 build, see CHUNKLOSS_CPU_LEVEL); none on CUDA.
std::int64_t max_chunk_rows(Device d);

/// The workspace budget of a call whose options give 0: 256 MiB on the CPU, 1 GiB on CUDA.
std::size_t default_memory_budget(Device d);

/// Computes the plan for a token objective: chunk rows are the largest multiple of 64 (or all
/// rows) that fit the budget, at most max_chunk_rows(device); the loop order comes from the cost
/// model unless requested. Throws chunkloss::Error on invalid requests.
Plan plan_token_objective(const PlanRequest& req);

/// Computes the plan for a sequence objective (req.rows == S * T): the regime and groups, then
/// the chunking. Resident chunks are one unit-range of a group (group_units * T rows); recompute
/// chunks follow plan_token_objective. Throws chunkloss::Error on invalid requests.
Plan plan_sequence_objective(const PlanRequest& req, const SequenceLayout& layout);

}  // namespace chunkloss
