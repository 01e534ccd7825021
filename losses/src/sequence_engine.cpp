// The sequence engine's passes over the token backend, on each sequence's rows from its first
// to its last valid target (prompt and padding skipped, their dH zero). Resident groups keep
// each chunk's logits at its own offset in the logits slice between the passes; the recompute
// regime reuses one chunk buffer, packs short sequences into its chunks and recomputes the
// logits in pass 2 (token-chunk or vocab-block order, the latter over all rows); the deferred
// regime forms the first pair's gradient in pass 1 and scales it once the pair's coefficient
// is known, then recomputes the other pairs.
#include "sequence_engine.h"

#include <algorithm>
#include <cmath>

#include "chunkloss/core/error.h"

namespace chunkloss::detail {
namespace {

// A sequence's leading and trailing ignored rows are skipped; a run of fewer ignored rows than
// this between two sequences' valid rows is computed (with zero gradient) instead, since
// splitting a GEMM around it would waste about as many rows of its last tile.
constexpr std::int64_t kSkipRows = 64;

// Sequence s's rows from its first to its last valid target (empty when it has none); all T
// rows when not trimming.
RowRange sequence_span(const SequenceCall& c, std::int64_t s, bool trim) {
  const std::int64_t t = c.seq_len, base = s * t;
  std::int64_t a = 0, b = t;
  const auto valid = [&](std::int64_t i) { return c.valid[static_cast<std::size_t>(base + i)]; };
  while (trim && a < t && !valid(a)) ++a;
  while (trim && b > a && !valid(b - 1)) --b;
  return {base + a, base + b};
}

// Whether rows [r0, r1) are all ignored (they may then join a range: zero gradient, no sums).
bool ignored(const SequenceCall& c, std::int64_t r0, std::int64_t r1) {
  const auto first = c.valid.begin();
  return std::find(first + r0, first + r1, 1) == first + r1;
}

// The row ranges that units [u0, u1) compute: each sequence's span (trimmed of its leading and
// trailing ignored rows), merged with the previous range across fewer than kSkipRows rows when
// both belong to one sequence position (chosen or rejected) or the merged range is still one
// chunk. Sequence-position order keeps a position's units in one range (a group of all the
// units without ignored rows is then the single chunk [0, N)); unit order lists a pair's two
// sequences one after the other.
std::vector<RowRange> unit_ranges(const SequenceCall& c, std::int64_t u0, std::int64_t u1,
                                  std::int64_t chunk, bool trim, bool unit_order = false) {
  const std::int64_t units = c.sequences / c.unit_sequences, per = c.unit_sequences;
  std::vector<RowRange> r;
  std::int64_t last_k = -1;
  for (std::int64_t i = 0; i < (u1 - u0) * per; ++i) {
    const std::int64_t k = unit_order ? i % per : i / (u1 - u0);
    const std::int64_t u = u0 + (unit_order ? i / per : i % (u1 - u0));
    const RowRange span = sequence_span(c, k * units + u, trim);
    if (span.r0 == span.r1) continue;
    const bool merge = !r.empty() && span.r0 >= r.back().r1 && span.r0 - r.back().r1 < kSkipRows &&
                       ignored(c, r.back().r1, span.r0) &&
                       (k == last_k || span.r1 - r.back().r0 <= chunk);
    if (merge)
      r.back().r1 = span.r1;
    else
      r.push_back(span);
    last_k = k;
  }
  return r;
}

// A resident group [u0, u1) of the plan's size, with its `ranges`, grown by the units after it
// while their computed rows still fit the group's logits (group_units units of T rows each): with
// trimmed prompts a group then takes more units, and the call fewer groups, each a dW GEMM and a
// host round trip. A group whose X rows the backend gathers for one GEMM (`gather` rows) grows
// only as far as they still fit there: one GEMM per range instead would cost more than a group.
// Each range stays within a chunk's rows, as in a group of the plan's size (the backends stage a
// range that they do not gather in a chunk's rows).
void grow_group(const SequenceCall& c, const Plan& plan, std::int64_t gather, std::int64_t u0,
                std::int64_t& u1, std::vector<RowRange>& ranges) {
  const std::int64_t units = c.sequences / c.unit_sequences;
  std::int64_t capacity = plan.group_units * c.seq_len * c.unit_sequences;
  if (row_count(ranges) <= gather) capacity = std::min(capacity, gather);
  while (u1 < units) {
    std::vector<RowRange> more = unit_ranges(c, u0, u1 + 1, plan.chunk_rows, true);
    const bool ranges_fit = std::all_of(more.begin(), more.end(), [&](const RowRange& r) {
      return r.r1 - r.r0 <= plan.chunk_rows;
    });
    if (!ranges_fit || row_count(more) > capacity) return;
    ranges = std::move(more);
    ++u1;
  }
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

// Logits and row statistics of rows [r0, r1) into the current tile.
void chunk_stats(TokenBackend& b, const SequenceCall& c, std::int64_t r0, std::int64_t r1) {
  b.logits(r0, r1, 0, c.policy.vocab);
  b.row_stats(r0, r1);
}

// Adds the valid rows' log-probs (and logit sums when `logit_sum` is given) of `ranges`, whose
// statistics are complete, into the per-sequence sums; one copy of their rows' span.
void add_sums(TokenBackend& b, const SequenceCall& c, const std::vector<RowRange>& ranges,
              std::vector<double>& logp, std::vector<double>* logit_sum) {
  if (ranges.empty()) return;
  std::int64_t lo = ranges.front().r0, hi = ranges.front().r1;
  for (const RowRange& r : ranges) lo = std::min(lo, r.r0), hi = std::max(hi, r.r1);
  std::vector<float> loss(static_cast<std::size_t>(hi - lo)), zsum(loss.size());
  b.fetch_rows(lo, hi, loss.data(), zsum.data());
  for (const RowRange& r : ranges)
    for (std::int64_t t = r.r0; t < r.r1; ++t) {
      if (!c.valid[static_cast<std::size_t>(t)]) continue;
      const auto s = static_cast<std::size_t>(t / c.seq_len);
      logp[s] -= loss[static_cast<std::size_t>(t - lo)];
      if (logit_sum) (*logit_sum)[s] += zsum[static_cast<std::size_t>(t - lo)];
    }
}

// Pass 1 over `ranges`: logits and row statistics of their pieces, all at successive tile
// offsets (resident) or packed into chunks (one logits GEMM each where the backend gathers
// them), then the sums.
void pass_one(TokenBackend& b, const SequenceCall& c, const std::vector<RowRange>& ranges,
              const Plan& plan, bool resident, std::vector<double>& logp,
              std::vector<double>* logit_sum) {
  std::vector<std::vector<RowRange>> chunks;
  if (resident) {
    chunks.emplace_back();
    for_chunks(ranges, plan.chunk_rows, false, [&](std::int64_t r0, std::int64_t r1, std::int64_t) {
      chunks.back().push_back({r0, r1});
    });
  } else {
    chunks = pack_chunks(ranges, plan.chunk_rows);
  }
  for (const std::vector<RowRange>& pieces : chunks) {
    b.logits_ranges(pieces);
    b.for_ranges(pieces, [&](const RowRange& r) { b.row_stats(r.r0, r.r1); });
  }
  add_sums(b, c, ranges, logp, logit_sum);
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

// The pair's coefficient gamma with coef[s] = gamma * kappa[s] for its two sequences (the
// caller checked the objective's pair_antisymmetric() declaration on them).
float pair_coefficient(const SequenceCall& c, const std::vector<double>& coef) {
  return static_cast<float>(coef[0] / c.kappa[0]);
}

// The deferred regime's first pair: each chunk's gradient is formed with the sequences' shares
// kappa and goes through both GEMMs at once; the last chunk completes the pair's statistics,
// so the objective gives gamma, which that chunk's dW GEMM and the dH rows' scaling apply.
void deferred_pair(TokenBackend& b, const SequenceCall& c, const Plan& plan, SequenceSums& sums,
                   const UnitsFn& on_units, std::vector<double>& coef) {
  const std::vector<RowRange> ranges = unit_ranges(c, 0, 1, plan.chunk_rows, true);
  std::vector<RowRange> chunks;
  for_chunks(ranges, plan.chunk_rows, false, [&](std::int64_t r0, std::int64_t r1, std::int64_t) {
    chunks.push_back({r0, r1});
  });
  const std::int64_t v = c.policy.vocab;
  float gamma = 0;
  b.select_tile(0);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const auto [r0, r1] = chunks[i];
    chunk_stats(b, c, r0, r1);
    upload_coefficients(b, c, {{r0, r1}}, c.kappa);
    const bool last = i + 1 == chunks.size();
    if (last) {
      add_sums(b, c, ranges, sums.logp, &sums.logit_sum);
      on_units(0, 1, sums, coef);
      gamma = pair_coefficient(c, coef);
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

// Pass 2 of the recompute regime in token-chunk order over units [u0, units): their ranges in
// unit order (a pair's two sequences together) packed into chunks, each chunk's pieces at
// successive tile offsets with their coefficients set just before, so the chunk's one dW GEMM
// sees only its own rows' coefficients.
void recompute_token_chunks(TokenBackend& b, const SequenceCall& c, const Plan& plan,
                            std::int64_t u0, const std::vector<double>& coef, bool first) {
  const std::int64_t v = c.policy.vocab, units = c.sequences / c.unit_sequences;
  const std::vector<RowRange> ranges = unit_ranges(c, u0, units, plan.chunk_rows, true, true);
  for (const std::vector<RowRange>& pieces : pack_chunks(ranges, plan.chunk_rows)) {
    upload_coefficients(b, c, pieces, coef);
    b.logits_ranges(pieces);
    b.for_ranges(pieces, [&](const RowRange& r) { b.grad_epilogue(r.r0, r.r1, 0, v); });
    b.grad_x_ranges(pieces);
    b.grad_w_ranges(pieces, first);
    first = false;
  }
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
  pass_one(*b, c, unit_ranges(c, 0, c.sequences, head.rows, true), plan, false, logp, nullptr);
  b->finish();
  return logp;
}

SequenceSums run_sequence_objective(Context& ctx, const SequenceCall& c, const Plan& plan,
                                    const Workspace& ws, const UnitsFn& on_units) {
  const auto s = static_cast<std::size_t>(c.sequences);
  SequenceSums sums;
  sums.logp.assign(s, 0.0);
  sums.logit_sum.assign(s, 0.0);
  sums.ref_logp = c.ref_logps.empty() ? std::vector<double>(s, 0.0) : c.ref_logps;

  const TokenCall& k = c.policy;
  const std::int64_t n = k.rows, v = k.vocab, units = c.sequences / c.unit_sequences;
  auto b = make_token_backend(ctx, k, plan, ws);
  b->begin();
  std::vector<double> coef(s, 0.0);
  const bool grads = k.any_grad();
  // Rows outside every sequence's span are skipped, except by vocab-block order, whose pass 2
  // multiplies all rows at once; their dH is zero, set just before the first gradient is
  // written (an objective that fails before then leaves the buffers untouched).
  const bool trim = plan.order != LoopOrder::kVocabBlock;
  bool cleared = !grads || !trim || std::find(c.valid.begin(), c.valid.end(), 0) == c.valid.end();
  const auto clear_once = [&] {
    if (!cleared) b->clear_grad_x();
    cleared = true;
  };

  if (plan.regime == Regime::kResident && grads) {
    bool first = true;
    for (std::int64_t u0 = 0, u1 = 0; u0 < units; u0 = u1) {
      u1 = std::min(units, u0 + plan.group_units);
      std::vector<RowRange> ranges = unit_ranges(c, u0, u1, plan.chunk_rows, true);
      // (not over a vocabulary split: its ranks' gather staging may differ with their shards'
      // sizes, and their groups, each with its collectives, must not)
      if (!k.vocab_group) grow_group(c, plan, b->gather_rows(), u0, u1, ranges);
      pass_one(*b, c, ranges, plan, true, sums.logp, &sums.logit_sum);
      on_units(u0, u1, sums, coef);
      clear_once();
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
  if (deferred) {
    clear_once();
    deferred_pair(*b, c, plan, sums, on_units, coef);
  }
  const std::int64_t u0 = deferred ? 1 : 0;
  if (u0 == units) {
    b->finish();
    return sums;
  }
  pass_one(*b, c, unit_ranges(c, u0, units, n, trim), plan, false, sums.logp, &sums.logit_sum);
  on_units(u0, units, sums, coef);
  if (grads && plan.order == LoopOrder::kVocabBlock) {
    upload_coefficients(*b, c, {{0, n}}, coef);
    vocab_block_pass(*b, n, v, plan.vocab_block);
  } else if (grads) {
    clear_once();
    recompute_token_chunks(*b, c, plan, u0, coef, !deferred);
  }
  b->finish();
  return sums;
}

}  // namespace chunkloss::detail
