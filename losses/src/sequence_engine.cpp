// The sequence engine's passes over the token backend. Resident groups keep each chunk's logits
// at its own offset in the logits slice between the passes; the recompute regime reuses one
// chunk buffer and recomputes the logits in pass 2 (token-chunk or vocab-block order); the
// deferred regime forms the first pair's gradient in pass 1 and scales it once the pair's
// coefficient is known, then recomputes the other pairs.
#include "sequence_engine.h"

#include <algorithm>
#include <cmath>

#include "chunkloss/core/error.h"

namespace chunkloss::detail {
namespace {

// The contiguous row ranges holding units [u0, u1): one per sequence position in the unit,
// merged when they touch and the merged range is still one chunk (a group of all the units
// is then the single chunk [0, N)). Every range is at most `chunk` rows.
std::vector<RowRange> unit_ranges(const SequenceCall& c, std::int64_t u0, std::int64_t u1,
                                  std::int64_t chunk) {
  const std::int64_t t = c.seq_len, units = c.sequences / c.unit_sequences;
  std::vector<RowRange> r;
  for (std::int64_t k = 0; k < c.unit_sequences; ++k) {
    const RowRange next{(k * units + u0) * t, (k * units + u1) * t};
    if (!r.empty() && r.back().r1 == next.r0 && next.r1 - r.back().r0 <= chunk)
      r.back().r1 = next.r1;
    else
      r.push_back(next);
  }
  return r;
}

// Calls fn(r0, r1, tile_offset) for the plan's chunks of `ranges`; resident chunks get
// successive tile offsets, others offset 0.
template <typename Fn>
void for_chunks(const std::vector<RowRange>& ranges, std::int64_t chunk, bool resident, Fn&& fn) {
  std::int64_t offset = 0;
  for (const RowRange& r : ranges)
    for (std::int64_t a = r.r0; a < r.r1; a += chunk) {
      const std::int64_t b = std::min(r.r1, a + chunk);
      fn(a, b, resident ? offset : 0);
      offset += b - a;
    }
}

// Logits and row statistics of rows [r0, r1) (the current tile), their log-probs (and logit
// sums when `logit_sum` is given) added into the per-sequence sums.
void chunk_sums(TokenBackend& b, const SequenceCall& c, std::int64_t r0, std::int64_t r1,
                std::vector<float>& loss, std::vector<float>& zsum, std::vector<double>& logp,
                std::vector<double>* logit_sum) {
  b.logits(r0, r1, 0, c.policy.vocab);
  b.row_stats(r0, r1);
  b.fetch_rows(r0, r1, loss.data(), zsum.data());
  for (std::int64_t t = r0; t < r1; ++t) {
    if (!c.valid[static_cast<std::size_t>(t)]) continue;
    const auto s = static_cast<std::size_t>(t / c.seq_len);
    logp[s] -= loss[static_cast<std::size_t>(t - r0)];
    if (logit_sum) (*logit_sum)[s] += zsum[static_cast<std::size_t>(t - r0)];
  }
}

// Pass 1 over `ranges`: chunk_sums per chunk, resident chunks at successive tile offsets.
void pass_one(TokenBackend& b, const SequenceCall& c, const std::vector<RowRange>& ranges,
              const Plan& plan, bool resident, std::vector<double>& logp,
              std::vector<double>* logit_sum) {
  std::vector<float> loss(static_cast<std::size_t>(plan.chunk_rows)),
      zsum(static_cast<std::size_t>(plan.chunk_rows));
  for_chunks(ranges, plan.chunk_rows, resident,
             [&](std::int64_t r0, std::int64_t r1, std::int64_t offset) {
               b.select_tile(offset);
               chunk_sums(b, c, r0, r1, loss, zsum, logp, logit_sum);
             });
}

// Row coefficients of `ranges` from the per-sequence ones, uploaded to the backend.
void upload_coefficients(TokenBackend& b, const SequenceCall& c,
                         const std::vector<RowRange>& ranges, const std::vector<double>& coef) {
  std::vector<float> rows;
  for (const RowRange& r : ranges) {
    rows.resize(static_cast<std::size_t>(r.r1 - r.r0));
    for (std::int64_t t = r.r0; t < r.r1; ++t)
      rows[static_cast<std::size_t>(t - r.r0)] =
          c.valid[static_cast<std::size_t>(t)]
              ? static_cast<float>(coef[static_cast<std::size_t>(t / c.seq_len)])
              : 0.0f;
    b.set_coefficients(r.r0, r.r1, rows.data());
  }
}

// The pair's coefficient gamma with coef[s] = gamma * kappa[s] for its two sequences, checked
// against the objective's pair_antisymmetric() declaration.
float pair_coefficient(const SequenceCall& c, const std::vector<double>& coef, std::size_t chosen,
                       std::size_t rejected) {
  const double gamma = coef[chosen] / c.kappa[chosen];
  const double expect = gamma * c.kappa[rejected];
  CHUNKLOSS_CHECK(
      std::abs(coef[rejected] - expect) <= 1e-9 * std::abs(expect) + 1e-300, c.objective,
      " declares pair_antisymmetric() but its derivatives for the deferred pair are "
      "not equal and opposite (coefficients ",
      coef[chosen], " and ", coef[rejected], "); the gradient buffers hold unspecified values");
  return static_cast<float>(gamma);
}

// The deferred regime's first pair: each chunk's gradient is formed with the sequences' shares
// kappa and goes through both GEMMs at once; the last chunk completes the pair's statistics,
// so the objective gives gamma, which that chunk's dW GEMM and the dH rows' scaling apply.
void deferred_pair(TokenBackend& b, const SequenceCall& c, const Plan& plan, SequenceSums& sums,
                   const UnitsFn& on_units, std::vector<double>& coef) {
  const std::vector<RowRange> ranges = unit_ranges(c, 0, 1, plan.chunk_rows);
  std::vector<RowRange> chunks;
  for_chunks(ranges, plan.chunk_rows, false, [&](std::int64_t r0, std::int64_t r1, std::int64_t) {
    chunks.push_back({r0, r1});
  });
  std::vector<float> loss(static_cast<std::size_t>(plan.chunk_rows)),
      zsum(static_cast<std::size_t>(plan.chunk_rows));
  const std::int64_t v = c.policy.vocab;
  const auto rejected = static_cast<std::size_t>(c.sequences / 2);
  float gamma = 0;
  b.select_tile(0);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const auto [r0, r1] = chunks[i];
    chunk_sums(b, c, r0, r1, loss, zsum, sums.logp, &sums.logit_sum);
    upload_coefficients(b, c, {{r0, r1}}, c.kappa);
    const bool last = i + 1 == chunks.size();
    if (last) {
      on_units(0, 1, sums, coef);
      gamma = pair_coefficient(c, coef, 0, rejected);
    }
    b.grad_epilogue(r0, r1, 0, v);
    b.grad_x(r0, r1, 0, v, true);
    if (last)
      b.grad_w_rescaled(r0, r1, i == 0, gamma);
    else
      b.grad_w(r0, r1, 0, v, i == 0);
  }
  for (const RowRange& r : ranges) b.scale_grad_x_rows(r.r0, r.r1, gamma);
}

}  // namespace

std::vector<double> sequence_log_probs(Context& ctx, const TokenCall& head, const Plan& plan,
                                       const Workspace& ws, std::int64_t seq_len,
                                       const std::vector<std::uint8_t>& valid) {
  SequenceCall c;
  c.policy = head;
  c.sequences = head.rows / seq_len;
  c.seq_len = seq_len;
  c.valid = valid;
  std::vector<double> logp(static_cast<std::size_t>(c.sequences), 0.0);
  auto b = make_token_backend(ctx, head, plan, ws);
  b->begin();
  pass_one(*b, c, {{0, head.rows}}, plan, false, logp, nullptr);
  b->finish();
  return logp;
}

SequenceSums run_sequence_objective(Context& ctx, const SequenceCall& c, const Plan& plan,
                                    const Workspace& ws, const UnitsFn& on_units) {
  const auto s = static_cast<std::size_t>(c.sequences);
  SequenceSums sums;
  sums.logp.assign(s, 0.0);
  sums.logit_sum.assign(s, 0.0);
  sums.ref_logp = c.reference ? sequence_log_probs(ctx, *c.reference, plan, ws, c.seq_len, c.valid)
                  : c.ref_logps.empty() ? std::vector<double>(s, 0.0)
                                        : c.ref_logps;

  const TokenCall& k = c.policy;
  const std::int64_t n = k.rows, v = k.vocab, units = c.sequences / c.unit_sequences;
  auto b = make_token_backend(ctx, k, plan, ws);
  b->begin();
  std::vector<double> coef(s, 0.0);
  const bool grads = k.any_grad();

  if (plan.regime == Regime::kResident && grads) {
    bool first = true;
    for (std::int64_t u0 = 0; u0 < units; u0 += plan.group_units) {
      const std::int64_t u1 = std::min(units, u0 + plan.group_units);
      const std::vector<RowRange> ranges = unit_ranges(c, u0, u1, plan.chunk_rows);
      pass_one(*b, c, ranges, plan, true, sums.logp, &sums.logit_sum);
      on_units(u0, u1, sums, coef);
      upload_coefficients(*b, c, ranges, coef);
      for_chunks(ranges, plan.chunk_rows, true,
                 [&](std::int64_t r0, std::int64_t r1, std::int64_t offset) {
                   b->select_tile(offset);
                   b->grad_epilogue(r0, r1, 0, v);
                   b->grad_x(r0, r1, 0, v, true);
                 });
      b->grad_w_ranges(ranges, first);
      first = false;
    }
    b->finish();
    return sums;
  }

  // Recompute (all units, or after the deferred first pair the others).
  const bool deferred = plan.regime == Regime::kDeferred && grads;
  if (deferred) deferred_pair(*b, c, plan, sums, on_units, coef);
  const std::int64_t u0 = deferred ? 1 : 0;
  if (u0 == units) {
    b->finish();
    return sums;
  }
  const std::vector<RowRange> all =
      deferred ? unit_ranges(c, u0, units, n) : std::vector<RowRange>{{0, n}};
  pass_one(*b, c, all, plan, false, sums.logp, &sums.logit_sum);
  on_units(u0, units, sums, coef);
  if (grads) {
    upload_coefficients(*b, c, all, coef);
    b->select_tile(0);
    if (plan.order == LoopOrder::kVocabBlock) {
      for (std::int64_t v0 = 0; v0 < v; v0 += plan.vocab_block) {
        const std::int64_t v1 = std::min(v, v0 + plan.vocab_block);
        b->logits(0, n, v0, v1);
        b->grad_epilogue(0, n, v0, v1);
        b->grad_w(0, n, v0, v1, true);
        b->grad_x(0, n, v0, v1, v0 == 0);
      }
    } else {
      bool first = !deferred;
      for_chunks(all, plan.chunk_rows, false, [&](std::int64_t r0, std::int64_t r1, std::int64_t) {
        b->logits(r0, r1, 0, v);
        b->grad_epilogue(r0, r1, 0, v);
        b->grad_x(r0, r1, 0, v, true);
        b->grad_w(r0, r1, 0, v, first);
        first = false;
      });
    }
  }
  b->finish();
  return sums;
}

}  // namespace chunkloss::detail
