// The engine's loops. Token-chunk order finishes each chunk of rows in one visit; vocab-block
// order computes every row's lse first, then writes each block of dW exactly once.
#include "engine.h"

#include <algorithm>
#include <cstring>

#include "agreement.h"
#include "chunkloss/core/error.h"

namespace chunkloss::detail {

std::unique_ptr<TokenBackend> make_token_backend(Context& ctx, const TokenCall& call,
                                                 const Plan& plan, const Workspace& ws) {
  if (ctx.device() == Device::kCpu) return make_cpu_token_backend(ctx, call, plan, ws);
#if CHUNKLOSS_HAVE_CUDA
  return make_cuda_token_backend(ctx, call, plan, ws);
#else
  CHUNKLOSS_FAIL("context: this build of chunkloss has no CUDA support (CHUNKLOSS_WITH_CUDA=OFF)");
#endif
}

void read_to_host(Context& ctx, const TensorView& t, void* dst) {
  if (t.device() == Device::kCpu) {
    std::memcpy(dst, t.data(), t.nbytes());
    return;
  }
#if CHUNKLOSS_HAVE_CUDA
  cuda_read_to_host(ctx, t, dst);
#else
  (void)ctx;
  CHUNKLOSS_FAIL("read_to_host: ", t.str(), " is device memory and this build has no CUDA support");
#endif
}

dist::Communicator* vocab_split_group(const VocabShard& shard) {
  return shard.group && shard.group->size() > 1 ? shard.group : nullptr;
}

void split_vocabulary(const VocabShard& shard, std::int64_t v_total, TokenCall& k) {
  k.vocab_group = vocab_split_group(shard);
  if (!k.vocab_group) return;
  k.vocab_offset = shard.offset;
  k.vocab_total = v_total;
}

void split_vocabulary(const VocabShard& shard, std::int64_t v_total, PlanRequest& q) {
  if (!vocab_split_group(shard)) return;
  q.vocab_ranks = shard.group->size();
  q.vocab = (v_total + q.vocab_ranks - 1) / q.vocab_ranks;
}

double rule_digest(const TokenCall& k) {
  const double v[] = {static_cast<double>(k.total_vocab()),
                      static_cast<double>(k.ignore_index),
                      k.rule.one_minus_ls,
                      k.rule.eps,
                      k.rule.z_loss,
                      k.rule.cw_sum,
                      k.softcap,
                      k.entropy ? 1.0 : 0.0,
                      static_cast<double>(k.scale)};
  return kind_digest(v);
}

void reserve_workspace(Plan& p, std::size_t bytes) {
  if (bytes > p.workspace_bytes()) p.layout.add(bytes - p.workspace_bytes());
}

void all_reduce_host(Context& ctx, dist::Communicator& group, double* values, std::int64_t n) {
  if (ctx.device() == Device::kCpu) {
    group.all_reduce_sum(ctx, values, n);
    return;
  }
#if CHUNKLOSS_HAVE_CUDA
  cuda_all_reduce_host(ctx, group, values, n);
#else
  CHUNKLOSS_FAIL("all_reduce_host: this build of chunkloss has no CUDA support");
#endif
}

void vocab_block_pass(TokenBackend& b, std::int64_t n, std::int64_t v, std::int64_t block) {
  b.select_tile(0);
  for (std::int64_t v0 = 0; v0 < v; v0 += block) {
    const std::int64_t v1 = std::min(v, v0 + block);
    b.logits(0, n, v0, v1);
    b.grad_epilogue(0, n, v0, v1);
    b.grad_w(0, n, v0, v1, true);
    b.grad_x(0, n, v0, v1, v0 == 0);
  }
}

std::vector<RowRange> rows_to_compute(const std::vector<std::uint8_t>& valid,
                                      std::int64_t min_gap) {
  std::vector<RowRange> ranges;
  const auto n = static_cast<std::int64_t>(valid.size());
  for (std::int64_t t = 0; t < n; ++t) {
    if (!valid[static_cast<std::size_t>(t)]) continue;
    if (!ranges.empty() && t - ranges.back().r1 < min_gap)
      ranges.back().r1 = t + 1;
    else
      ranges.push_back({t, t + 1});
  }
  return ranges;
}

std::vector<RowRange> computed_rows(const TokenCall& call) {
  return call.row_ranges ? *call.row_ranges : std::vector<RowRange>{{0, call.rows}};
}

std::vector<std::vector<RowRange>> pack_chunks(const std::vector<RowRange>& ranges,
                                               std::int64_t chunk) {
  std::vector<std::vector<RowRange>> chunks;
  std::int64_t room = 0;  // rows the last chunk can still take
  for (const RowRange& range : ranges) {
    for (std::int64_t r0 = range.r0; r0 < range.r1;) {
      if (room == 0) {
        chunks.emplace_back();
        room = chunk;
      }
      const std::int64_t r1 = std::min(range.r1, r0 + room);
      chunks.back().push_back({r0, r1});
      room -= r1 - r0;
      r0 = r1;
    }
  }
  return chunks;
}

std::vector<std::vector<RowRange>> token_chunks(const TokenCall& call, const Plan& plan) {
  return pack_chunks(computed_rows(call), plan.chunk_rows);
}

namespace {

// The coefficients of a chunk's `pieces`, whose statistics are complete: one copy of their
// span's row losses to the host, one call of `coefficients` over the span (rows between the
// pieces are skipped ignored rows), the coefficients back per piece.
void set_piece_coefficients(TokenBackend& b, const std::vector<RowRange>& pieces,
                            const RowCoefficients& coefficients, bool grads) {
  const std::int64_t lo = pieces.front().r0, hi = pieces.back().r1;
  std::vector<float> loss(static_cast<std::size_t>(hi - lo)), coef(loss.size());
  b.fetch_rows(lo, hi, loss.data(), nullptr);
  coefficients(lo, hi, loss.data(), coef.data());
  if (grads)
    for (const RowRange& r : pieces)
      b.set_coefficients(r.r0, r.r1, coef.data() + static_cast<std::size_t>(r.r0 - lo));
}

}  // namespace

TokenTotals run_token_objective(Context& ctx, const TokenCall& call, const Plan& plan,
                                const Workspace& ws, const RowCoefficients& coefficients) {
  auto backend = make_token_backend(ctx, call, plan, ws);
  backend->begin();
  const std::int64_t n = call.rows, v = call.vocab;
  const bool grads = call.any_grad();
  const bool token_order = plan.order == LoopOrder::kTokenChunk || !grads;

  std::int64_t done = 0;  // rows before it are computed or skipped
  bool first = true;
  for (const std::vector<RowRange>& pieces : token_chunks(call, plan)) {
    for (const RowRange& r : pieces) {
      if (r.r0 > done) backend->skip_rows(done, r.r0);
      done = r.r1;
    }
    backend->logits_ranges(pieces);
    backend->for_ranges(pieces, [&](const RowRange& r) {
      backend->row_stats(r.r0, r.r1);
      if (grads && token_order && !coefficients) backend->grad_epilogue(r.r0, r.r1, 0, v);
    });
    if (coefficients) {
      set_piece_coefficients(*backend, pieces, coefficients, grads);
      if (grads && token_order)
        backend->for_ranges(pieces,
                            [&](const RowRange& r) { backend->grad_epilogue(r.r0, r.r1, 0, v); });
    }
    if (grads && token_order) {
      backend->grad_x_ranges(pieces);
      backend->grad_w_ranges(pieces, first);
      first = false;
    }
  }
  if (done < n) backend->skip_rows(done, n);
  if (grads && token_order && first) backend->clear_grad_w();  // no row computed
  if (grads && !token_order) vocab_block_pass(*backend, n, v, plan.vocab_block);
  return backend->finish();
}

}  // namespace chunkloss::detail
