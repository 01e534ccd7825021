// The chunking scheduler: chunk rows from the memory budget, the loop order from a cost model
// of GEMM efficiency versus chunk rows and the bytes each order moves, and the workspace layout.
#include "chunkloss/losses/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <sstream>

#include "chunkloss/core/error.h"
#include "engine.h"
#include "tile_staging.h"
#include "vocab_parallel.h"

namespace chunkloss {

std::string_view loop_order_name(LoopOrder o) {
  switch (o) {
    case LoopOrder::kAuto:
      return "auto";
    case LoopOrder::kTokenChunk:
      return "token_chunk";
    case LoopOrder::kVocabBlock:
      return "vocab_block";
  }
  return "?";
}

std::string_view regime_name(Regime r) {
  switch (r) {
    case Regime::kAuto:
      return "auto";
    case Regime::kResident:
      return "resident";
    case Regime::kRecompute:
      return "recompute";
    case Regime::kDeferred:
      return "deferred";
    case Regime::kNone:
      return "none";
  }
  return "?";
}

namespace {

constexpr std::int64_t kRowGranule = 64;
constexpr std::size_t kRowStatsFloats = 10;  // see losses/src/row_arrays.h
constexpr std::int64_t kCpuWeightTile = 256;

/// Device constants of the cost model: GEMM rate saturating with the rows of the GEMM
/// (rate = peak * m / (m + m_half)), the bandwidth that read-modify-writes run at, and the depth
/// panel of the device's GEMM (0: none), the rows of the reduction after which the GEMM itself
/// re-reads and re-writes its output: a chunk longer than that saves no rewrite of dW, so the
/// plan takes no more rows than that and leaves the rest of the budget unused.
struct DeviceModel {
  double peak_flops;
  double m_half;
  double bandwidth;
  std::int64_t panel_rows;
};

DeviceModel device_model(Device d) {
  // CUDA: H200 cuBLAS bf16 (../shared/GPU.md: ~700 TFLOP/s at large C, ~450 at C=128, ~4 TB/s);
  // its GEMMs hold the output tile across the whole reduction.
  // CPU: two cores through Eigen; a GEMM saturates at a few dozen rows. Built for SSE2 alone,
  // Eigen's blocking walks the reduction in panels of a few hundred rows (kc = 520 for fp32 at
  // 512 KiB of L2), rewriting the output once per panel, and the model takes 256 rows, at most
  // one such panel: at 4096 x 1024 x 32768 fp32 on 2 cores, 192-row chunks ran at 0.92x the
  // full-size GEMMs and 1984-row chunks at 1.04x. Built with AVX2 (CHUNKLOSS_CPU_LEVEL v3 or
  // native), longer chunks keep gaining (2026-12-05, the same shape: the loss at 1.23x the
  // full-size GEMMs with 256-row chunks, 1.11x with 512, 1.08x with 1024, 1.02x with 2048), so
  // there the budget alone bounds a chunk.
#ifdef __AVX2__
  constexpr std::int64_t kCpuPanelRows = 0;
#else
  constexpr std::int64_t kCpuPanelRows = 256;
#endif
  return d == Device::kCuda ? DeviceModel{7.0e14, 48.0, 3.5e12, 0}
                            : DeviceModel{1.0e11, 16.0, 1.0e10, kCpuPanelRows};
}

// Bytes for plans' lines: "512 B", "6.3 KiB", "256.0 MiB".
std::string size_str(std::size_t b) {
  char buf[32];
  if (b < 1024)
    std::snprintf(buf, sizeof buf, "%zu B", b);
  else if (b < (std::size_t{1} << 20))
    std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(b) / 1024);
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  return buf;
}

// CPU scratch: fp32 copies of bf16 operands. Fixed part: a tile of W rows and a dW tile.
std::size_t cpu_staging_fixed(const PlanRequest& q) {
  if (q.device != Device::kCpu) return 0;
  const auto tile = static_cast<std::size_t>(kCpuWeightTile * q.hidden) * 4;
  std::size_t b = q.input_dtype == DType::kBF16 ? tile : 0;
  if (q.grad_weight && q.grad_weight_dtype == DType::kBF16 && !q.fp32_weight_grad_accumulator)
    b += tile;
  return b;
}

// Vocabulary parallelism's staging per chunk row (vocab_parallel_staging in engine.h).
std::size_t vocab_parallel_per_row(const PlanRequest& q) {
  if (q.vocab_ranks <= 1) return 0;
  return detail::vocab_parallel_staging(1, q.hidden, q.vocab_ranks, q.grad_hidden);
}

// Backend scratch per row of the GEMMs' row range. CPU: the fp32 X rows and, in token-chunk
// order, the fp32 dH rows (vocab-block order accumulates dH in the dh_accum slice instead);
// with packed pieces these also hold a chunk's pieces side by side for its GEMMs, so fp32 X
// and dH get such rows too. CUDA: with packed pieces, a chunk's pieces' X rows side by side
// for its logits and dW GEMMs, and without row scales the fp32 rows of its one dH GEMM before
// they are rounded into each piece's dH rows, unless those fit the fp32 tile's free halves
// (tile_staging.h); with per-row scales the fp32 dH rows before scaling (token-chunk order)
// and the scaled X rows for the dW GEMM, unless those fit the free halves. Both: a
// vocabulary-parallel chunk's exchange buffers, first.
std::size_t staging_per_row(const PlanRequest& q, bool vocab_order) {
  const auto row = static_cast<std::size_t>(q.hidden) * 4;
  const std::size_t vp = vocab_order ? 0 : vocab_parallel_per_row(q);
  const bool pieces = q.packed_pieces && !vocab_order;
  if (q.device != Device::kCpu) {
    // A packed chunk's X rows, gathered side by side for its one logits (and dW) GEMM.
    const std::size_t gathered =
        vp + (pieces ? static_cast<std::size_t>(q.hidden) * dtype_size(q.input_dtype) : 0);
    if (!q.row_scales)
      return gathered + (pieces && q.grad_hidden &&
                                 detail::packed_dh_in_staging(q.vocab, q.hidden, q.logits_dtype,
                                                              q.input_dtype, q.vocab_ranks)
                             ? row
                             : 0);
    // Token-chunk rows stage in the logits tile's free halves when they fit (tile_staging.h).
    if (!vocab_order &&
        detail::stages_in_tile(q.vocab, q.hidden, q.logits_dtype, q.input_dtype, q.vocab_ranks))
      return gathered;
    std::size_t b = gathered + (!vocab_order && q.grad_hidden ? row : 0);
    if (q.grad_weight) b += static_cast<std::size_t>(q.hidden) * dtype_size(q.input_dtype);
    return b;
  }
  std::size_t b = vp + (q.input_dtype == DType::kBF16 || pieces ? row : 0);
  // (a vocabulary-parallel chunk's dH rows are in its exchange buffers)
  if (!vocab_order && q.grad_hidden && (q.grad_hidden_dtype == DType::kBF16 || pieces) && !vp)
    b += row;
  return b;
}

std::size_t row_stats_bytes(const PlanRequest& q) {
  return static_cast<std::size_t>(q.rows) * kRowStatsFloats * 4;
}

std::size_t dw_accum_bytes(const PlanRequest& q) {
  return q.fp32_weight_grad_accumulator && q.grad_weight
             ? static_cast<std::size_t>(q.vocab * q.hidden) * 4
             : 0;
}

double gemm_time(const DeviceModel& m, double flops, double rows) {
  return flops / (m.peak_flops * rows / (rows + m.m_half));
}

std::size_t db_accum_bytes(const PlanRequest& q) {
  return q.grad_bias ? static_cast<std::size_t>(q.vocab) * 4 : 0;
}

// Workspace parts that do not depend on the chunking; alignment padding of up to 6 slices.
std::size_t fixed_bytes(const PlanRequest& q) {
  return row_stats_bytes(q) + db_accum_bytes(q) + cpu_staging_fixed(q) + 6 * kWorkspaceAlignment;
}

std::size_t budget_of(const PlanRequest& q) {
  return q.budget_bytes ? q.budget_bytes : default_memory_budget(q.device);
}

double nhv_flops(const PlanRequest& q) {
  return 2.0 * static_cast<double>(q.rows) * static_cast<double>(q.hidden) *
         static_cast<double>(q.vocab);
}

double gemm_count(const PlanRequest& q) {
  return 1.0 + (q.grad_hidden ? 1.0 : 0.0) + (q.grad_weight ? 1.0 : 0.0);
}

// One pass of the epilogue over all [N, V] logits (read or write).
double epilogue_pass_time(const PlanRequest& q, const DeviceModel& m) {
  return static_cast<double>(q.rows) * static_cast<double>(q.vocab) *
         static_cast<double>(dtype_size(q.logits_dtype)) / m.bandwidth;
}

double dw_bytes(const PlanRequest& q) {
  return static_cast<double>(q.vocab) * static_cast<double>(q.hidden) *
         static_cast<double>(q.fp32_weight_grad_accumulator ? 4 : dtype_size(q.grad_weight_dtype));
}

// Time of the dW (V x H) read-modify-writes that `dw_gemms` GEMMs over the N rows add beyond
// those one GEMM over all rows does itself (once per depth panel).
double dw_rewrite_time(const PlanRequest& q, const DeviceModel& m, std::int64_t dw_gemms) {
  if (!q.grad_weight) return 0.0;
  const std::int64_t own = m.panel_rows > 0 ? (q.rows + m.panel_rows - 1) / m.panel_rows : 1;
  return 2.0 * dw_bytes(q) * static_cast<double>(std::max<std::int64_t>(0, dw_gemms - own)) /
         m.bandwidth;
}

// Slices of the plan's workspace once the order and chunking are known: a logits buffer of
// `logits_bytes`, the row statistics, the accumulators and the backend's staging for
// `staging_rows` rows of the GEMMs' row range plus `extra_staging` bytes.
void lay_out(Plan& p, const PlanRequest& q, std::size_t logits_bytes, std::size_t dh_acc,
             std::int64_t staging_rows, std::size_t extra_staging = 0) {
  const bool vocab_order = p.order == LoopOrder::kVocabBlock;
  p.logits = p.layout.add(logits_bytes);
  p.row_stats = p.layout.add(row_stats_bytes(q));
  if (dw_accum_bytes(q)) p.dw_accum = p.layout.add(dw_accum_bytes(q));
  if (dh_acc) p.dh_accum = p.layout.add(dh_acc);
  if (db_accum_bytes(q)) p.db_accum = p.layout.add(db_accum_bytes(q));
  const std::size_t staging =
      cpu_staging_fixed(q) +
      static_cast<std::size_t>(staging_rows) * staging_per_row(q, vocab_order) + extra_staging;
  if (staging) p.staging = p.layout.add(staging);
  if (q.device == Device::kCuda) p.scalars = p.layout.add(detail::kDeviceScalarBytes);
}

// Token-chunk rows: the largest multiple of 64 (or all N rows) whose `per_row` bytes fit `room`,
// at most the device's GEMM panel; when not even 64 rows fit, 64 rows and p.over_budget.
std::int64_t token_chunk_rows(const PlanRequest& q, std::size_t room, std::size_t per_row,
                              Plan& p) {
  std::int64_t c = static_cast<std::int64_t>(room / per_row);
  if (const std::int64_t cap = max_chunk_rows(q.device)) c = std::min(c, cap);
  if (c >= q.rows) return q.rows;
  c = c / kRowGranule * kRowGranule;
  if (c > 0) return c;
  p.over_budget = true;
  return std::min(q.rows, kRowGranule);
}

// The deferred regime's plan (see Regime::kDeferred): token chunks from the budget left after an
// fp32 [N, H] dH block (the first pair's unscaled rows, and the other pairs' recomputed ones);
// the first pair at 3 GEMMs per token, the rest at 4.
Plan deferred_plan(const PlanRequest& q, const SequenceLayout& L) {
  const DeviceModel dm = device_model(q.device);
  const std::size_t budget = budget_of(q), lb = dtype_size(q.logits_dtype);
  const std::int64_t n = q.rows, v = q.vocab, pair = 2 * L.seq_len;
  const std::size_t dh = q.grad_hidden ? static_cast<std::size_t>(n * q.hidden) * 4 : 0;
  const std::size_t fixed = fixed_bytes(q) + dh;
  const std::size_t per_row = static_cast<std::size_t>(v) * lb + staging_per_row(q, false);
  Plan p;
  p.regime = Regime::kDeferred;
  p.order = LoopOrder::kTokenChunk;
  p.logits_dtype = q.logits_dtype;
  const std::int64_t c = token_chunk_rows(q, budget - std::min(budget, fixed), per_row, p);
  const auto chunks = [c](std::int64_t rows) { return (rows + c - 1) / c; };
  p.chunk_rows = c;
  p.num_chunks = chunks(pair) + chunks(n - pair);
  p.vocab_block = v;
  p.num_vocab_blocks = 1;
  const double frac = static_cast<double>(pair) / static_cast<double>(n);
  const double gemms = gemm_count(q), nhv = nhv_flops(q), pass = epilogue_pass_time(q, dm);
  p.predicted_token_cost_s =
      gemm_time(dm, (gemms * frac + (gemms + 1.0) * (1.0 - frac)) * nhv, static_cast<double>(c)) +
      (3.0 * frac + 4.0 * (1.0 - frac)) * pass + dw_rewrite_time(q, dm, p.num_chunks);
  std::ostringstream why;
  why << "the first pair (" << pair << " rows) scaled when its statistics are complete";
  if (n > pair) why << ", the other " << n - pair << " rows recomputed";
  if (p.over_budget)
    why << "; budget " << size_str(budget) << " is below one " << c << "-row chunk";
  p.reason = why.str();
  lay_out(p, q, static_cast<std::size_t>(c * v) * lb, dh, c);
  return p;
}

}  // namespace

std::int64_t max_chunk_rows(Device d) { return device_model(d).panel_rows; }

std::size_t default_memory_budget(Device d) {
  return d == Device::kCuda ? (std::size_t{1} << 30) : (std::size_t{256} << 20);
}

Plan plan_token_objective(const PlanRequest& q) {
  CHUNKLOSS_CHECK(q.rows > 0 && q.hidden > 0 && q.vocab > 0,
                  "plan: rows, hidden and vocab must be > 0, got N=", q.rows, " H=", q.hidden,
                  " V=", q.vocab);
  CHUNKLOSS_CHECK(q.device == Device::kCuda || q.logits_dtype == DType::kF32,
                  "plan: logits_dtype bf16 is only supported on CUDA");
  const std::size_t budget = budget_of(q);
  const DeviceModel dm = device_model(q.device);
  const std::int64_t n = q.rows, h = q.hidden, v = q.vocab;
  const std::size_t lb = dtype_size(q.logits_dtype);
  const bool any_grad = q.grad_hidden || q.grad_weight || q.grad_bias;
  CHUNKLOSS_CHECK(q.vocab_ranks >= 1, "plan: vocab_ranks must be >= 1, got ", q.vocab_ranks);
  CHUNKLOSS_CHECK(q.vocab_ranks == 1 || q.order != LoopOrder::kVocabBlock,
                  "plan: loop_order vocab_block is not available with the vocabulary split over ",
                  q.vocab_ranks,
                  " ranks (each chunk's statistics are exchanged in token-chunk "
                  "order)");

  Plan p;
  p.logits_dtype = q.logits_dtype;

  // Chunk rows: the largest multiple of 64 (or all rows) whose chunk buffers fit the budget, at
  // most the device's GEMM panel. The optional fp32 dW accumulator (V*H*4) is on top of the
  // budget, as the option documents.
  const std::size_t fixed = fixed_bytes(q);
  const std::size_t per_row = static_cast<std::size_t>(v) * lb + staging_per_row(q, false);
  std::int64_t c = token_chunk_rows(q, budget - std::min(budget, fixed), per_row, p);
  p.chunk_rows = c;
  p.num_chunks = (n + c - 1) / c;

  // Cost of token-chunk order: GEMMs at the chunk's efficiency, plus dW re-read and re-written
  // once per chunk after the first, plus the epilogue's passes over the chunk.
  const double nhv = nhv_flops(q);
  const double gemms = gemm_count(q);
  const double epilogue = 3.0 * epilogue_pass_time(q, dm);
  p.predicted_token_cost_s = gemm_time(dm, gemms * nhv, static_cast<double>(c)) + epilogue +
                             dw_rewrite_time(q, dm, p.num_chunks);
  // The shortest gap of ignored rows worth skipping: its rows' GEMMs take at least what
  // splitting the logits and dH GEMMs around it costs (about m_half rows each in the model).
  // The chunks are cut from the computed rows alone, so a gap costs no rewrite of dW.
  const double split_rows = dm.m_half * (q.grad_hidden ? 2.0 : 1.0) / gemms;
  p.skip_gap_rows =
      std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(split_rows / kRowGranule))) *
      kRowGranule;

  // Vocab-block order: pass 2 holds [N, Vb] logits for all rows (plus an fp32 dH accumulator
  // when dH is not fp32, and on the CPU fp32 copies of bf16 X for all rows).
  std::int64_t vb = 0;
  std::size_t dh_acc = 0;
  if (q.grad_hidden && (q.grad_hidden_dtype != DType::kF32 || q.row_scales))
    dh_acc = static_cast<std::size_t>(n * h) * 4;
  const std::size_t vocab_fixed =
      fixed + dh_acc + static_cast<std::size_t>(n) * staging_per_row(q, true);
  std::int64_t cv = 0;  // pass-1 chunk rows of vocab-block order
  if (q.grad_weight && budget > vocab_fixed) {
    // One logits buffer serves both passes, [Cv, V] in pass 1 and [N, Vb] in pass 2, and both
    // must fit beside the order's fixed parts.
    const std::size_t room = budget - vocab_fixed;
    cv = static_cast<std::int64_t>(room / (static_cast<std::size_t>(v) * lb));
    cv = std::min(c, cv >= n ? n : cv / kRowGranule * kRowGranule);
    vb = static_cast<std::int64_t>(room / (static_cast<std::size_t>(n) * lb));
    vb = vb >= v ? v : vb / kRowGranule * kRowGranule;
    if (cv == 0) vb = 0;
  }
  if (vb > 0) {
    const std::int64_t blocks = (v + vb - 1) / vb;
    p.predicted_vocab_cost_s = gemm_time(dm, nhv, static_cast<double>(cv)) +
                               gemm_time(dm, gemms * nhv, static_cast<double>(n)) + 2.0 * epilogue +
                               (q.grad_hidden ? 2.0 * static_cast<double>(n * h) * 4.0 *
                                                    static_cast<double>(blocks - 1) / dm.bandwidth
                                              : 0.0);
  }

  std::ostringstream why;
  if (!any_grad) {
    p.order = LoopOrder::kTokenChunk;
    why << "forward only: one pass of token chunks";
  } else if (q.vocab_ranks > 1) {
    p.order = LoopOrder::kTokenChunk;
    why << "vocabulary split over " << q.vocab_ranks << " ranks: token_chunk";
  } else if (q.order == LoopOrder::kTokenChunk) {
    p.order = LoopOrder::kTokenChunk;
    why << "token_chunk requested";
  } else if (q.order == LoopOrder::kAuto && q.skip_ignored_rows) {
    p.order = LoopOrder::kTokenChunk;
    why << "skip_ignored_rows: token_chunk, the order that skips";
  } else if (q.order == LoopOrder::kVocabBlock) {
    CHUNKLOSS_CHECK(q.grad_weight,
                    "plan: loop_order vocab_block is for calls that ask for the weight gradient "
                    "(it writes each block of dW once); without it use token_chunk or auto");
    CHUNKLOSS_CHECK(vb > 0,
                    "plan: loop_order vocab_block needs [64, V] and [N, 64] logits and its "
                    "accumulators within the budget: N=",
                    n, " H=", h, " V=", v, " budget=", budget, " bytes");
    p.order = LoopOrder::kVocabBlock;
    why << "vocab_block requested";
  } else if (vb > 0 && p.predicted_vocab_cost_s < p.predicted_token_cost_s) {
    p.order = LoopOrder::kVocabBlock;
    why << "cost model: vocab_block " << p.predicted_vocab_cost_s * 1e3 << " ms < token_chunk "
        << p.predicted_token_cost_s * 1e3 << " ms (dW rewritten " << p.num_chunks << "x)";
  } else {
    p.order = LoopOrder::kTokenChunk;
    why << "cost model: token_chunk " << p.predicted_token_cost_s * 1e3 << " ms";
    if (vb > 0)
      why << " <= vocab_block " << p.predicted_vocab_cost_s * 1e3 << " ms";
    else if (q.grad_weight)
      why << " (vocab_block does not fit the budget)";
  }
  if (p.over_budget)
    why << "; budget " << size_str(budget) << " is below one " << c << "-row chunk";

  // Workspace layout.
  const bool vocab_order = p.order == LoopOrder::kVocabBlock;
  p.vocab_block = vocab_order ? vb : v;
  p.num_vocab_blocks = (v + p.vocab_block - 1) / p.vocab_block;
  if (vocab_order) {
    c = cv;
    p.chunk_rows = c;
    p.num_chunks = (n + c - 1) / c;
  }
  std::size_t logits_bytes = static_cast<std::size_t>(c) * v * lb;
  if (vocab_order) logits_bytes = std::max(logits_bytes, static_cast<std::size_t>(n * vb) * lb);
  lay_out(p, q, logits_bytes, vocab_order ? dh_acc : 0, vocab_order ? n : c);
  p.packed_pieces = q.packed_pieces && !vocab_order;
  p.reason = why.str();
  return p;
}

namespace {

// A forward-only sequence call: token chunks of its trimmed pieces, gathered side by side for one
// logits GEMM per chunk when that staging fits in the workspace of `plain`, the chunks without
// it, so gathering costs the call no workspace. The chunks shrink by the X rows staged: a few
// percent at a large vocabulary, or a 64-row step where `plain` takes all the rows.
Plan forward_plan(const PlanRequest& q, Plan plain) {
  plain.regime = Regime::kRecompute;
  plain.reason = "forward only: pass 1 in token chunks";
  if (!q.packed_pieces || plain.over_budget) return plain;
  PlanRequest g = q;
  g.budget_bytes = plain.workspace_bytes();
  Plan p = plan_token_objective(g);
  if (p.over_budget || p.workspace_bytes() > plain.workspace_bytes()) return plain;
  p.regime = Regime::kRecompute;
  p.reason = "forward only: pass 1 in token chunks, each chunk's pieces gathered for one GEMM";
  return p;
}

}  // namespace

Plan plan_sequence_objective(const PlanRequest& q, const SequenceLayout& L) {
  CHUNKLOSS_CHECK(L.sequences > 0 && L.seq_len > 0 && L.sequences * L.seq_len == q.rows &&
                      (L.unit_sequences == 1 || L.unit_sequences == 2) &&
                      L.sequences % L.unit_sequences == 0,
                  "plan: sequence layout S=", L.sequences, " T=", L.seq_len,
                  " sequences per unit=", L.unit_sequences, " does not match N=", q.rows);
  CHUNKLOSS_CHECK(L.regime != Regime::kNone, "plan: regime none is for token objectives");
  const bool any_grad = q.grad_hidden || q.grad_weight || q.grad_bias;
  const DeviceModel dm = device_model(q.device);
  const std::size_t budget = budget_of(q);
  const std::size_t lb = dtype_size(q.logits_dtype);
  const std::int64_t t = L.seq_len, v = q.vocab, units = L.sequences / L.unit_sequences;

  // Recompute: the token objective's chunking; pass 1 adds a logits GEMM and a stats pass in
  // token-chunk order (vocab-block order has its own pass 1 already). Only this regime's
  // gradient pass packs pieces into token chunks with staging for them: the resident and
  // deferred plans reserve none (rq); a forward-only call's takes it within the workspace of
  // its chunks without it (forward_plan).
  PlanRequest rq = q;
  rq.packed_pieces = false;
  if (!any_grad) return forward_plan(q, plan_token_objective(rq));
  // An explicit vocab-block order is recompute's pass 2; where its blocks cannot fit, another
  // regime may still serve the call (the refusal stands if recompute is asked for or picked).
  Plan rec;
  std::exception_ptr rec_refused;
  std::string refusal;
  try {
    rec = plan_token_objective(q);
  } catch (const Error& e) {
    if (L.regime == Regime::kRecompute || q.order != LoopOrder::kVocabBlock) throw;
    rec_refused = std::current_exception();
    refusal = e.what();
    PlanRequest token = q;  // its sizes, for the comparison below
    token.order = LoopOrder::kTokenChunk;
    try {
      rec = plan_token_objective(token);
    } catch (const Error&) {
      std::rethrow_exception(rec_refused);
    }
  }
  rec.regime = Regime::kRecompute;
  const double nhv = nhv_flops(q);
  const double pass1 =
      gemm_time(dm, nhv, static_cast<double>(rec.chunk_rows)) + epilogue_pass_time(q, dm);
  const double rec_token = rec.predicted_token_cost_s + pass1;
  const double rec_vocab = rec.predicted_vocab_cost_s;  // 0: not feasible
  if (q.order == LoopOrder::kAuto && rec_vocab > 0 && q.vocab_ranks == 1) {
    PlanRequest forced = q;
    forced.order = rec_vocab < rec_token ? LoopOrder::kVocabBlock : LoopOrder::kTokenChunk;
    rec = plan_token_objective(forced);
    rec.regime = Regime::kRecompute;
    std::ostringstream os;
    os << "pass 2 in " << loop_order_name(forced.order) << ": token_chunk " << rec_token * 1e3
       << " ms (pass 1 included), vocab_block " << rec_vocab * 1e3 << " ms";
    rec.reason = os.str();
  }
  const double rec_cost = rec_refused ? std::numeric_limits<double>::infinity()
                          : rec.order == LoopOrder::kVocabBlock ? rec_vocab
                                                                : rec_token;

  // Resident: the most whole units whose group's logits (and staging for one unit-range of
  // rows) fit the budget. On CUDA a group of several sequences has its X rows staged side by
  // side for its one logits GEMM and its dW GEMM (see the CUDA backend's logits_ranges and
  // grad_w_ranges).
  const auto x_stage = [&](std::int64_t g) -> std::size_t {
    const bool stage = q.device == Device::kCuda && g * L.unit_sequences > 1;
    // (with row scales the staged rows may also be scaled; one range uses the per-row staging)
    return stage ? static_cast<std::size_t>(g * t * L.unit_sequences * q.hidden) *
                       dtype_size(q.input_dtype)
                 : 0;
  };
  // On the CPU a group's trimmed spans are gathered for its pass-1 logits GEMM and its dW GEMM
  // when they fit the X staging of one unit-range of rows, which fp32 X gets for that (bf16 X
  // has its fp32 staging already).
  const std::size_t gather_per_row =
      q.device == Device::kCpu && q.input_dtype == DType::kF32 && q.packed_pieces
          ? static_cast<std::size_t>(q.hidden) * 4
          : 0;
  const auto group_bytes = [&](std::int64_t g) {
    const auto range_rows = static_cast<std::size_t>(g * t);
    return fixed_bytes(q) + range_rows * L.unit_sequences * v * lb +
           range_rows * (staging_per_row(rq, false) + gather_per_row) + x_stage(g);
  };
  std::int64_t g = 0;
  for (std::int64_t lo = 1, hi = units; lo <= hi;) {  // group_bytes grows with g
    const std::int64_t mid = (lo + hi) / 2;
    if (group_bytes(mid) <= budget)
      g = mid, lo = mid + 1;
    else
      hi = mid - 1;
  }
  double res_cost = 0;
  std::int64_t groups = 0;
  if (g > 0) {
    groups = (units + g - 1) / g;
    constexpr double kCudaSyncS = 3e-5;  // two host round trips per group
    res_cost = gemm_time(dm, gemm_count(q) * nhv, static_cast<double>(g * t)) +
               3.0 * epilogue_pass_time(q, dm) +
               dw_rewrite_time(q, dm, groups) +  // a dW GEMM per group
               (q.device == Device::kCuda ? kCudaSyncS * static_cast<double>(groups) : 0.0);
  }

  Plan def;
  if (L.deferrable && L.unit_sequences == 2) def = deferred_plan(rq, L);
  const double def_cost = def.predicted_token_cost_s;  // 0: not applicable

  std::ostringstream why;
  Regime pick = Regime::kRecompute;
  if (L.regime == Regime::kResident) {
    CHUNKLOSS_CHECK(g > 0, "plan: regime resident needs ", group_bytes(1),
                    " bytes for one unit (its logits, ", L.unit_sequences * t, " rows x V=", v,
                    ", with the row statistics, staging and alignment) within the budget of ",
                    budget, " bytes");
    pick = Regime::kResident;
    why << "resident requested";
  } else if (L.regime == Regime::kRecompute) {
    why << "recompute requested";
  } else if (L.regime == Regime::kDeferred) {
    CHUNKLOSS_CHECK(def_cost > 0,
                    "plan: regime deferred needs pairs of a pair-antisymmetric objective without "
                    "an NLL term, dW overwritten rather than accumulated, and no bias gradient");
    pick = Regime::kDeferred;
    why << "deferred requested";
  } else {
    double best = rec_cost;
    why << "cost model: ";
    if (g > 0 && res_cost <= best) pick = Regime::kResident, best = res_cost;
    // The deferred plan's fixed dH block may not fit a budget that recompute's chunks fit.
    // (Both workspaces hold the fp32 dW accumulator beyond the budget, when asked for.)
    const bool def_fits = !def.over_budget || def.workspace_bytes() <= rec.workspace_bytes();
    if (def_cost > 0 && def_fits && def_cost < best) pick = Regime::kDeferred, best = def_cost;
    why << regime_name(pick) << " " << best * 1e3 << " ms; recompute ";
    if (rec_refused)
      why << "refused (" << refusal << ")";
    else
      why << rec_cost * 1e3 << " ms";
    if (g > 0)
      why << ", resident " << res_cost * 1e3 << " ms";
    else
      why << ", resident does not fit (one unit's logits exceed the budget)";
    if (def_cost > 0 && def_fits)
      why << ", deferred " << def_cost * 1e3 << " ms";
    else if (def_cost > 0)
      why << ", deferred does not fit (its fp32 dH block exceeds the budget)";
  }
  if (pick == Regime::kDeferred) {
    def.reason = why.str() + "; " + def.reason;
    return def;
  }
  if (pick == Regime::kRecompute) {
    if (rec_refused) std::rethrow_exception(rec_refused);
    rec.reason = why.str() + "; " + rec.reason;
    return rec;
  }
  Plan p;
  p.regime = Regime::kResident;
  p.order = LoopOrder::kTokenChunk;
  p.logits_dtype = q.logits_dtype;
  p.group_units = g;
  p.num_groups = groups;
  // Chunks are a group's unit-ranges; one group of every unit is a single range of all rows,
  // one chunk when its staging fits too.
  const bool one_chunk =
      groups == 1 && group_bytes(g) + static_cast<std::size_t>(q.rows - g * t) *
                                          (staging_per_row(rq, false) + gather_per_row) <=
                         budget;
  p.chunk_rows = one_chunk ? q.rows : g * t;
  p.num_chunks = one_chunk ? 1 : groups * L.unit_sequences;
  p.vocab_block = v;
  p.num_vocab_blocks = 1;
  p.predicted_token_cost_s = res_cost;
  why << " (" << g << " of " << units << " units per group)";
  p.reason = why.str();
  lay_out(p, rq, static_cast<std::size_t>(g * t * L.unit_sequences * v) * lb, 0, p.chunk_rows,
          static_cast<std::size_t>(p.chunk_rows) * gather_per_row + (one_chunk ? 0 : x_stage(g)));
  return p;
}

std::string Plan::str() const {
  std::ostringstream os;
  os << "order=" << loop_order_name(order) << " C=" << chunk_rows << " chunks=" << num_chunks;
  if (order == LoopOrder::kVocabBlock)
    os << " Vb=" << vocab_block << " blocks=" << num_vocab_blocks;
  if (regime != Regime::kNone) os << " regime=" << regime_name(regime);
  if (regime == Regime::kResident) os << " groups=" << num_groups << " units/group=" << group_units;
  os << " logits=" << dtype_name(logits_dtype) << " workspace=" << size_str(workspace_bytes())
     << " (" << reason << ")";
  return os.str();
}

}  // namespace chunkloss
