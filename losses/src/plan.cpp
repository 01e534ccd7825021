// The chunking scheduler: chunk rows from the memory budget, the loop order from a cost model
// of GEMM efficiency versus chunk rows and the bytes each order moves, and the workspace layout.
#include "chunkloss/losses/plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "chunkloss/core/error.h"

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

namespace {

constexpr std::int64_t kRowGranule = 64;
constexpr std::size_t kRowStatsFloats = 8;  // see RowStatsArrays in the backends
constexpr std::int64_t kCpuWeightTile = 256;
constexpr std::size_t kDeviceScalarBytes = 16 * sizeof(double);  // >= kern::kNumScalars + 3 floats

/// Device constants of the cost model: GEMM rate saturating with the rows of the GEMM
/// (rate = peak * m / (m + m_half)) and the bandwidth that read-modify-writes run at.
struct DeviceModel {
  double peak_flops;
  double m_half;
  double bandwidth;
};

DeviceModel device_model(Device d) {
  // CUDA: H200 cuBLAS bf16 (../shared/GPU.md: ~700 TFLOP/s at large C, ~450 at C=128, ~4 TB/s).
  // CPU: two AVX-512 cores through Eigen; a GEMM saturates at a few dozen rows.
  return d == Device::kCuda ? DeviceModel{7.0e14, 48.0, 3.5e12} : DeviceModel{1.0e11, 16.0, 1.0e10};
}

std::size_t default_budget(Device d) {
  return d == Device::kCuda ? (std::size_t{1} << 30) : (std::size_t{256} << 20);
}

std::string mib(std::size_t b) {
  char buf[32];
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

// CPU scratch per row of the GEMMs' row range: the fp32 X rows and, in token-chunk order, the
// fp32 dH rows (vocab-block order accumulates dH in the dh_accum slice instead).
std::size_t cpu_staging_per_row(const PlanRequest& q, bool vocab_order) {
  if (q.device != Device::kCpu) return 0;
  const auto row = static_cast<std::size_t>(q.hidden) * 4;
  std::size_t b = q.input_dtype == DType::kBF16 ? row : 0;
  if (!vocab_order && q.grad_hidden && q.grad_hidden_dtype == DType::kBF16) b += row;
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

}  // namespace

Plan plan_token_objective(const PlanRequest& q) {
  CHUNKLOSS_CHECK(q.rows > 0 && q.hidden > 0 && q.vocab > 0,
                  "plan: rows, hidden and vocab must be > 0, got N=", q.rows, " H=", q.hidden,
                  " V=", q.vocab);
  CHUNKLOSS_CHECK(q.device == Device::kCuda || q.logits_dtype == DType::kF32,
                  "plan: logits_dtype bf16 is only supported on CUDA");
  const std::size_t budget = q.budget_bytes ? q.budget_bytes : default_budget(q.device);
  const DeviceModel dm = device_model(q.device);
  const std::int64_t n = q.rows, h = q.hidden, v = q.vocab;
  const std::size_t lb = dtype_size(q.logits_dtype);
  const bool any_grad = q.grad_hidden || q.grad_weight || q.grad_bias;

  Plan p;
  p.logits_dtype = q.logits_dtype;

  // Chunk rows: the largest multiple of 64 (or all rows) whose chunk buffers fit the budget.
  // Alignment padding of up to 6 slices is counted in the fixed part.
  const std::size_t db_bytes = q.grad_bias ? static_cast<std::size_t>(v) * 4 : 0;
  // The optional fp32 dW accumulator (V*H*4) is on top of the budget, as the option documents.
  const std::size_t fixed =
      row_stats_bytes(q) + db_bytes + cpu_staging_fixed(q) + 6 * kWorkspaceAlignment;
  const std::size_t per_row = static_cast<std::size_t>(v) * lb + cpu_staging_per_row(q, false);
  std::int64_t c = 0;
  if (budget > fixed) c = static_cast<std::int64_t>((budget - fixed) / per_row);
  if (c >= n) {
    c = n;
  } else {
    c = c / kRowGranule * kRowGranule;
    if (c == 0) {
      c = std::min(n, kRowGranule);
      p.over_budget = true;
    }
  }
  p.chunk_rows = c;
  p.num_chunks = (n + c - 1) / c;

  // Cost of token-chunk order: GEMMs at the chunk's efficiency, plus dW re-read and re-written
  // once per chunk after the first, plus the epilogue's passes over the chunk.
  const double nhv = 2.0 * static_cast<double>(n) * static_cast<double>(h) * static_cast<double>(v);
  const double gemms = 1.0 + (q.grad_hidden ? 1.0 : 0.0) + (q.grad_weight ? 1.0 : 0.0);
  const double dw_bytes =
      static_cast<double>(v) * static_cast<double>(h) *
      static_cast<double>(q.fp32_weight_grad_accumulator ? 4 : dtype_size(q.grad_weight_dtype));
  const double epilogue = 3.0 * static_cast<double>(n) * static_cast<double>(v) *
                          static_cast<double>(lb) / dm.bandwidth;
  p.predicted_token_cost_s =
      gemm_time(dm, gemms * nhv, static_cast<double>(c)) + epilogue +
      (q.grad_weight ? 2.0 * dw_bytes * static_cast<double>(p.num_chunks - 1) / dm.bandwidth : 0.0);

  // Vocab-block order: pass 2 holds [N, Vb] logits for all rows (plus an fp32 dH accumulator
  // when dH is not fp32, and on the CPU fp32 copies of bf16 X for all rows).
  std::int64_t vb = 0;
  std::size_t dh_acc = 0;
  if (q.grad_hidden && q.grad_hidden_dtype != DType::kF32)
    dh_acc = static_cast<std::size_t>(n * h) * 4;
  const std::size_t vocab_fixed =
      fixed + dh_acc + static_cast<std::size_t>(n) * cpu_staging_per_row(q, true);
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
  } else if (q.order == LoopOrder::kTokenChunk) {
    p.order = LoopOrder::kTokenChunk;
    why << "token_chunk requested";
  } else if (q.order == LoopOrder::kVocabBlock) {
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
  if (p.over_budget) why << "; budget " << mib(budget) << " is below one " << c << "-row chunk";

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
  p.logits = p.layout.add(logits_bytes);
  p.row_stats = p.layout.add(row_stats_bytes(q));
  if (dw_accum_bytes(q)) p.dw_accum = p.layout.add(dw_accum_bytes(q));
  if (vocab_order && dh_acc) p.dh_accum = p.layout.add(dh_acc);
  if (db_bytes) p.db_accum = p.layout.add(db_bytes);
  const std::size_t staging = cpu_staging_fixed(q) + static_cast<std::size_t>(vocab_order ? n : c) *
                                                         cpu_staging_per_row(q, vocab_order);
  if (staging) p.staging = p.layout.add(staging);
  if (q.device == Device::kCuda) p.scalars = p.layout.add(kDeviceScalarBytes);
  p.reason = why.str();
  return p;
}

std::string Plan::str() const {
  std::ostringstream os;
  os << "order=" << loop_order_name(order) << " C=" << chunk_rows << " chunks=" << num_chunks;
  if (order == LoopOrder::kVocabBlock)
    os << " Vb=" << vocab_block << " blocks=" << num_vocab_blocks;
  os << " logits=" << dtype_name(logits_dtype) << " workspace=" << mib(workspace_bytes()) << " ("
     << reason << ")";
  return os.str();
}

}  // namespace chunkloss
