// The chunking scheduler's plan: chunk rows, loop order and its reason, the workspace layout
// against the budget, and LinearCrossEntropy::plan agreeing with plan_token_objective.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/losses/cross_entropy.h>
#include <chunkloss/losses/plan.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "ce_fixture.h"

namespace chunkloss::test {
namespace {

bool contains(const std::string& s, std::string_view needle) {
  return s.find(needle) != std::string::npos;
}

// A grid of requests: devices, shapes (odd, tiny, wide), dtypes, gradients, accumulator, order
// and budgets from far too small to plenty. Calls fn for every request whose plan succeeds.
void for_each_plan(const std::function<void(const PlanRequest&, const Plan&)>& fn,
                   std::initializer_list<LoopOrder> orders = {
                       LoopOrder::kAuto, LoopOrder::kTokenChunk, LoopOrder::kVocabBlock}) {
  int planned = 0;
  for (Device dev : {Device::kCpu, Device::kCuda})
    for (std::int64_t n : {1, 7, 64, 150, 300, 1000, 4096})
      for (std::int64_t h : {16, 123, 512})
        for (std::int64_t v : {1, 63, 507, 2000, 32000})
          for (DType in : {DType::kF32, DType::kBF16})
            for (DType gd : {DType::kF32, DType::kBF16})
              for (bool acc : {false, true})
                for (int grads : {0, 1, 2})  // none, dH + dW + db, dW only
                  for (LoopOrder order : orders)
                    for (std::size_t budget :
                         {std::size_t{1} << 12, std::size_t{1} << 16, std::size_t{1} << 20,
                          std::size_t{1} << 24, std::size_t{1} << 28}) {
                      PlanRequest q;
                      q.device = dev;
                      q.rows = n;
                      q.hidden = h;
                      q.vocab = v;
                      q.input_dtype = in;
                      q.grad_hidden_dtype = gd;
                      q.grad_weight_dtype = gd;
                      q.grad_hidden = grads == 1;
                      q.grad_weight = grads >= 1;
                      q.grad_bias = grads == 1;
                      q.fp32_weight_grad_accumulator = acc;
                      q.budget_bytes = budget;
                      q.order = order;
                      Plan p;
                      try {
                        p = plan_token_objective(q);
                      } catch (const Error& e) {
                        // Only an infeasible explicit vocab_block request may be refused.
                        CHECK_MESSAGE(order == LoopOrder::kVocabBlock, e.what());
                        continue;
                      }
                      ++planned;
                      fn(q, p);
                    }
  CHECK(planned > 1000);
}

std::string describe(const PlanRequest& q, const Plan& p) {
  return std::string(device_name(q.device)) + " N=" + std::to_string(q.rows) +
         " H=" + std::to_string(q.hidden) + " V=" + std::to_string(q.vocab) +
         " in=" + std::string(dtype_name(q.input_dtype)) +
         " grads=" + std::string(dtype_name(q.grad_weight_dtype)) + (q.grad_hidden ? " dH" : "") +
         (q.grad_weight ? " dW" : "") + (q.grad_bias ? " db" : "") +
         (q.fp32_weight_grad_accumulator ? " acc" : "") +
         " order=" + std::string(loop_order_name(q.order)) +
         " budget=" + std::to_string(q.budget_bytes) + " -> " + p.str() +
         " ws=" + std::to_string(p.workspace_bytes());
}

// The budget bounds the workspace less the optional fp32 dW accumulator, which the option
// documents as V*H*4 bytes on top of the budget.
std::size_t dw_accum_footprint(const Plan& p) {
  return (p.dw_accum.bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

bool within_budget(const PlanRequest& q, const Plan& p) {
  return p.workspace_bytes() <= q.budget_bytes + dw_accum_footprint(p);
}

TEST_CASE(
    "plan: chunk rows are a multiple of 64 or all rows, and the largest that fits up to the "
    "device's cap") {
  int failures = 0;
  for_each_plan([&](const PlanRequest& q, const Plan& p) {
    const std::int64_t c = p.chunk_rows;
    bool ok = c >= 1 && c <= q.rows && (c % 64 == 0 || c == q.rows) &&
              p.num_chunks == (q.rows + c - 1) / c;
    if (p.order == LoopOrder::kTokenChunk)
      ok = ok && p.vocab_block == q.vocab && p.num_vocab_blocks == 1;
    else
      ok = ok && p.vocab_block >= 1 && p.vocab_block <= q.vocab &&
           (p.vocab_block % 64 == 0 || p.vocab_block == q.vocab) &&
           p.num_vocab_blocks == (q.vocab + p.vocab_block - 1) / p.vocab_block;
    if (p.over_budget) ok = ok && c == std::min<std::int64_t>(q.rows, 64);
    const std::int64_t cap = max_chunk_rows(q.device);
    if (cap > 0) ok = ok && c <= std::max<std::int64_t>(cap, 64);
    // Largest: in token-chunk order, 64 more rows would not have fit: their logits, at most two
    // fp32 staging rows each (CPU bf16 operands), and the alignment padding of 6 slices.
    if (p.order == LoopOrder::kTokenChunk && !p.over_budget && c < q.rows && c != cap) {
      const std::size_t more_rows =
          static_cast<std::size_t>(
              64 * (q.vocab * static_cast<std::int64_t>(dtype_size(p.logits_dtype)) +
                    2 * q.hidden * 4)) +
          6 * kWorkspaceAlignment;
      ok = ok && p.workspace_bytes() - dw_accum_footprint(p) + more_rows > q.budget_bytes;
    }
    if (!ok && failures++ < 5) FAIL_CHECK(describe(q, p));
  });
  CHECK(failures == 0);
}

TEST_CASE("plan: token-chunk and auto plans fit the budget whenever one 64-row chunk does") {
  int failures = 0, checked = 0;
  for_each_plan(
      [&](const PlanRequest& q, const Plan& p) {
        if (p.over_budget || p.order != LoopOrder::kTokenChunk) return;
        ++checked;
        if (!within_budget(q, p) && failures++ < 5) FAIL_CHECK(describe(q, p));
      },
      {LoopOrder::kAuto, LoopOrder::kTokenChunk});
  CHECK(failures == 0);
  CHECK(checked > 1000);
}

// Vocab-block order once allowed its pass-1 chunk to exceed the room left by its fixed parts.
TEST_CASE("plan: vocab-block plans fit the budget whenever one 64-row chunk does") {
  int failures = 0, checked = 0;
  for_each_plan(
      [&](const PlanRequest& q, const Plan& p) {
        if (p.over_budget || p.order != LoopOrder::kVocabBlock) return;
        ++checked;
        if (!within_budget(q, p) && failures++ < 5) FAIL_CHECK(describe(q, p));
      },
      {LoopOrder::kAuto, LoopOrder::kVocabBlock});
  CHECK(failures == 0);
  CHECK(checked > 100);

  PlanRequest q;  // the example above
  q.rows = 150;
  q.hidden = 40;
  q.vocab = 300;
  q.input_dtype = q.grad_hidden_dtype = q.grad_weight_dtype = DType::kBF16;
  q.grad_hidden = q.grad_weight = true;
  q.order = LoopOrder::kVocabBlock;
  q.budget_bytes = 200000;
  // 64 pass-1 rows of V fp32 logits (76800 bytes) do not fit beside the order's fixed parts:
  // the explicit request is refused, and auto falls back to token-chunk order within budget.
  CHECK_THROWS_WITH_AS(plan_token_objective(q), doctest::Contains("vocab_block"), Error);
  q.order = LoopOrder::kAuto;
  const Plan p = plan_token_objective(q);
  CHECK(p.order == LoopOrder::kTokenChunk);
  CHECK_MESSAGE(p.workspace_bytes() <= q.budget_bytes, describe(q, p));
}

TEST_CASE("plan: a tiny budget sets over_budget, and the over-budget plan still computes") {
  for (std::size_t budget : {std::size_t{1}, std::size_t{4096}}) {
    PlanRequest q;
    q.rows = 150;
    q.hidden = 40;
    q.vocab = 300;
    q.grad_hidden = q.grad_weight = true;
    q.budget_bytes = budget;
    const Plan p = plan_token_objective(q);
    CHECK(p.over_budget);
    CHECK(p.chunk_rows == 64);
    CHECK(p.num_chunks == 3);
    CHECK(p.order == LoopOrder::kTokenChunk);
    CHECK(contains(p.reason, "budget"));
    q.rows = 20;
    CHECK(plan_token_objective(q).chunk_rows == 20);
    CHECK(plan_token_objective(q).over_budget);
  }
  PlanRequest roomy;
  roomy.rows = 150;
  roomy.hidden = 40;
  roomy.vocab = 300;
  CHECK(!plan_token_objective(roomy).over_budget);

  CeSpec s;
  s.n = 150;
  s.h = 40;
  s.v = 300;
  s.bias = true;
  CrossEntropyOptions o;
  o.memory_budget_bytes = 4096;
  const LibRun run = check_case(s, o, {});
  CHECK(run.plan.over_budget);
  CHECK(run.plan.num_chunks == 3);
  CHECK(run.plan.workspace_bytes() > 4096);
}

TEST_CASE("plan: the loop order is the requested one, or the cheaper one by the cost model") {
  int vocab_by_cost = 0, token_by_cost = 0;
  for_each_plan([&](const PlanRequest& q, const Plan& p) {
    INFO(describe(q, p));
    CHECK(!p.reason.empty());
    const bool grads = q.grad_hidden || q.grad_weight || q.grad_bias;
    if (!grads) {
      CHECK(p.order == LoopOrder::kTokenChunk);
      CHECK(contains(p.reason, "forward"));
    } else if (q.order == LoopOrder::kTokenChunk) {
      CHECK(p.order == LoopOrder::kTokenChunk);
      CHECK(contains(p.reason, "requested"));
    } else if (q.order == LoopOrder::kVocabBlock) {
      CHECK(p.order == LoopOrder::kVocabBlock);
      CHECK(contains(p.reason, "requested"));
    } else {
      CHECK(contains(p.reason, "cost model"));
      const bool vocab_cheaper =
          p.predicted_vocab_cost_s > 0 && p.predicted_vocab_cost_s < p.predicted_token_cost_s;
      CHECK((p.order == LoopOrder::kVocabBlock) == vocab_cheaper);
      if (!q.grad_weight) CHECK(p.order == LoopOrder::kTokenChunk);
      (p.order == LoopOrder::kVocabBlock ? vocab_by_cost : token_by_cost)++;
    }
    CHECK(p.predicted_token_cost_s > 0);
  });
  CHECK(vocab_by_cost > 0);  // the cost model does pick vocab_block somewhere in the grid
  CHECK(token_by_cost > 0);
}

TEST_CASE("plan: skip_ignored_rows takes token-chunk order under auto, and its gap length") {
  int cheaper_in_vocab_order = 0;
  for_each_plan(
      [&](const PlanRequest& q, const Plan& p) {
        INFO(describe(q, p));
        // 64 rows whatever the request: skipping a gap splits the logits and dH GEMMs around
        // it, which costs fewer rows than that (the chunks are cut from the computed rows).
        CHECK(p.skip_gap_rows == 64);
        PlanRequest s = q;
        s.skip_ignored_rows = s.packed_pieces = true;  // (as LinearCrossEntropy asks)
        PlanRequest t = s;
        t.order = LoopOrder::kTokenChunk;
        const Plan ps = plan_token_objective(s), pt = plan_token_objective(t);
        CHECK(ps.order == LoopOrder::kTokenChunk);  // the token-chunk plan, as if requested
        CHECK(ps.chunk_rows == pt.chunk_rows);
        CHECK(ps.workspace_bytes() == pt.workspace_bytes());
        cheaper_in_vocab_order += p.order == LoopOrder::kVocabBlock;
        if (q.grad_hidden || q.grad_weight || q.grad_bias)
          CHECK(contains(ps.reason, "skip_ignored_rows"));
      },
      {LoopOrder::kAuto});
  CHECK(cheaper_in_vocab_order > 0);  // cases where skipping changed the order
}

TEST_CASE("plan: skip_ignored_rows stages a chunk's X rows for its one dW GEMM") {
  // A chunk's pieces of several computed ranges share one logits, dH and dW GEMM each, over
  // their rows gathered side by side. The X rows take C rows of staging (on the CPU as fp32,
  // which bf16 X has already), and on the CPU fp32 dH does too (bf16 dH has its fp32 staging).
  // CUDA puts the dH GEMM's fp32 rows in the fp32 logits tile's free halves, or with fp32
  // inputs or a bf16 logits chunk (no free halves) in C fp32 rows of staging.
  PlanRequest q;
  q.rows = 16384;
  q.hidden = 4096;
  q.vocab = 128256;
  q.input_dtype = q.grad_hidden_dtype = q.grad_weight_dtype = DType::kBF16;
  q.grad_hidden = q.grad_weight = true;
  q.device = Device::kCuda;
  q.order = LoopOrder::kTokenChunk;
  q.budget_bytes = std::size_t{1} << 40;  // the chunk rows are the same with and without
  const auto extra = [](PlanRequest r) {
    const Plan plain = plan_token_objective(r);
    r.skip_ignored_rows = r.packed_pieces = true;
    const Plan skip = plan_token_objective(r);
    CHECK(skip.chunk_rows == plain.chunk_rows);
    return std::pair{skip.staging.bytes - plain.staging.bytes, skip.chunk_rows};
  };
  auto [bytes, rows] = extra(q);
  CHECK(bytes == static_cast<std::size_t>(rows * q.hidden) * 2);
  q.logits_dtype = DType::kBF16;  // X, and dH's fp32 rows
  std::tie(bytes, rows) = extra(q);
  CHECK(bytes == static_cast<std::size_t>(rows * q.hidden) * (2 + 4));
  q.grad_hidden = false;  // X only
  std::tie(bytes, rows) = extra(q);
  CHECK(bytes == static_cast<std::size_t>(rows * q.hidden) * 2);
  q.grad_hidden = true;
  q.logits_dtype = DType::kF32;
  q.input_dtype = DType::kF32;
  std::tie(bytes, rows) = extra(q);
  CHECK(bytes == static_cast<std::size_t>(rows * q.hidden) * (4 + 4));
  q.grad_hidden = q.grad_weight = false;  // forward only: the logits GEMM's X rows
  std::tie(bytes, rows) = extra(q);
  CHECK(bytes == static_cast<std::size_t>(rows * q.hidden) * 4);
  q.grad_hidden = q.grad_weight = true;
  q.vocab_ranks = 2;  // a split vocabulary's dH rows go through its exchange buffers
  std::tie(bytes, rows) = extra(q);
  CHECK(bytes == static_cast<std::size_t>(rows * q.hidden) * 4);
  q.vocab_ranks = 1;
  q.device = Device::kCpu;
  q.rows = 4096;
  q.hidden = 512;
  q.vocab = 16384;
  std::tie(bytes, rows) = extra(q);
  CHECK(bytes == static_cast<std::size_t>(rows * q.hidden) * 4);  // X (dH is bf16)
  q.grad_hidden_dtype = DType::kF32;
  std::tie(bytes, rows) = extra(q);
  CHECK(bytes == static_cast<std::size_t>(2 * rows * q.hidden) * 4);  // X and dH
  q.input_dtype = DType::kBF16;
  std::tie(bytes, rows) = extra(q);
  CHECK(bytes == static_cast<std::size_t>(rows * q.hidden) * 4);  // dH
  q.grad_hidden_dtype = DType::kBF16;
  CHECK(extra(q).first == 0);
  q.input_dtype = DType::kF32;
  q.grad_hidden = q.grad_weight = false;  // forward only: the logits GEMM's X rows
  std::tie(bytes, rows) = extra(q);
  CHECK(bytes == static_cast<std::size_t>(rows * q.hidden) * 4);
  // A bf16 sequence head on CUDA (row scales): the X rows too, beside its dH and scaled X rows
  // (in the fp32 tile's free halves where they fit, else in staging).
  q.device = Device::kCuda;
  q.input_dtype = DType::kBF16;
  q.grad_hidden = q.grad_weight = q.row_scales = true;
  q.rows = 4096;
  for (DType logits : {DType::kF32, DType::kBF16}) {
    INFO("logits dtype ", std::string(dtype_name(logits)));
    q.logits_dtype = logits;
    std::tie(bytes, rows) = extra(q);
    CHECK(bytes == static_cast<std::size_t>(rows * q.hidden) * 2);
  }
}

TEST_CASE("plan: a resident group of several sequences stages its X rows on CUDA") {
  // The group's spans share one logits GEMM (and its dW GEMM) over their X rows gathered side by
  // side: g T unit_sequences rows of X, whether or not the fp32 tile's free halves hold the row
  // scales' staging. A group of one sequence has nothing to gather, and the CPU gathers in its
  // own staging.
  PlanRequest q;
  q.hidden = 512;
  q.vocab = 8192;
  q.input_dtype = q.grad_hidden_dtype = q.grad_weight_dtype = DType::kBF16;
  q.grad_hidden = q.grad_weight = q.row_scales = true;
  q.device = Device::kCuda;
  q.budget_bytes = std::size_t{64} << 20;
  SequenceLayout pairs;
  pairs.sequences = 16;
  pairs.seq_len = 256;
  pairs.unit_sequences = 2;
  pairs.regime = Regime::kResident;
  q.rows = pairs.sequences * pairs.seq_len;
  // The staging beyond the per-row slices of one unit-range of rows (C rows).
  const auto group_x_bytes = [](const PlanRequest& r, const SequenceLayout& l) {
    const Plan p = plan_sequence_objective(r, l);
    REQUIRE(p.regime == Regime::kResident);
    REQUIRE(p.num_groups > 1);  // (one group of everything may be one chunk, staging none)
    PlanRequest token = r;
    token.rows = p.chunk_rows;
    token.budget_bytes = std::size_t{1} << 40;
    token.order = LoopOrder::kTokenChunk;
    return std::pair{p.staging.bytes - plan_token_objective(token).staging.bytes,
                     p.group_units * l.seq_len * l.unit_sequences};
  };
  for (DType logits : {DType::kF32, DType::kBF16}) {
    INFO("logits dtype ", std::string(dtype_name(logits)));
    q.logits_dtype = logits;
    const auto [bytes, rows] = group_x_bytes(q, pairs);
    CHECK(bytes == static_cast<std::size_t>(rows * q.hidden) * 2);
  }
  SequenceLayout single = pairs;
  single.unit_sequences = 1;
  q.logits_dtype = DType::kF32;
  q.budget_bytes = std::size_t{12} << 20;  // one sequence a group
  const Plan one = plan_sequence_objective(q, single);
  CHECK(one.group_units == 1);
  CHECK(group_x_bytes(q, single).first == 0);
}

TEST_CASE(
    "plan: the fp32 dW accumulator does not change the sequence regime the cost model picks") {
  // DPO's deferred regime at 2 and 4 GiB: its fit was judged with the accumulator (beyond the
  // budget) counted against the budget, so it lost to recompute whenever the accumulator was on.
  PlanRequest q;
  q.hidden = 4096;
  q.vocab = 128256;
  q.input_dtype = q.grad_hidden_dtype = q.grad_weight_dtype = DType::kBF16;
  q.grad_hidden = q.grad_weight = q.row_scales = true;
  q.device = Device::kCuda;
  SequenceLayout pair;
  pair.sequences = 2;
  pair.seq_len = 8192;
  pair.unit_sequences = 2;
  pair.deferrable = true;
  q.rows = pair.sequences * pair.seq_len;
  for (const std::size_t gib : {1, 2, 4}) {
    CAPTURE(gib);
    q.budget_bytes = gib << 30;
    q.fp32_weight_grad_accumulator = false;
    const Plan without = plan_sequence_objective(q, pair);
    q.fp32_weight_grad_accumulator = true;
    const Plan with = plan_sequence_objective(q, pair);
    CHECK(without.regime == Regime::kDeferred);
    CHECK(with.regime == without.regime);
    CHECK(with.chunk_rows == without.chunk_rows);
  }
}

TEST_CASE("plan: an infeasible vocab-block order refuses recompute, not the other regimes") {
  // loop_order is recompute's pass 2 order: a resident request, or the cost model with resident
  // in reach, plans resident; recompute asked for still names the order. Infeasible: no dW to
  // write block by block, or a budget below one block of all N rows (a unit's rows fit).
  PlanRequest q;
  q.hidden = 4096;
  q.vocab = 32000;
  q.input_dtype = q.grad_hidden_dtype = q.grad_weight_dtype = DType::kBF16;
  q.order = LoopOrder::kVocabBlock;
  SequenceLayout pairs;
  pairs.unit_sequences = 2;
  pairs.seq_len = 64;
  for (const bool dw : {false, true}) {
    CAPTURE(dw);
    q.grad_hidden = true;
    q.grad_weight = dw;
    pairs.sequences = dw ? 4000 : 1000;  // [N, 64] fp32 logits: 65.5 MB at N = 256000
    q.budget_bytes = (dw ? std::size_t{48} : std::size_t{256}) << 20;
    q.rows = pairs.sequences * pairs.seq_len;
    for (const Regime r : {Regime::kResident, Regime::kAuto}) {
      CAPTURE(regime_name(r));
      pairs.regime = r;
      const Plan p = plan_sequence_objective(q, pairs);
      CHECK(p.regime == Regime::kResident);
      if (r == Regime::kAuto) CHECK(contains(p.reason, "recompute refused (plan: loop_order"));
    }
    pairs.regime = Regime::kRecompute;
    CHECK_THROWS_WITH_AS(plan_sequence_objective(q, pairs), doctest::Contains("vocab_block"),
                         Error);
  }
}

TEST_CASE("plan: a forward-only sequence call gathers its pieces within the plain chunks' room") {
  // Its chunks' pieces share one logits GEMM over their X rows gathered side by side; the
  // staging comes out of the workspace the chunks would take without it, so the call needs no
  // more than before (here also no more than the same call with gradients, as at most shapes).
  // Without packed pieces, or where even the plain chunks exceed the budget, the plan is the
  // plain one.
  for (Device dev : {Device::kCpu, Device::kCuda}) {
    for (DType x : {DType::kF32, DType::kBF16}) {
      INFO(std::string(device_name(dev)), " x ", std::string(dtype_name(x)));
      PlanRequest q;
      q.hidden = 512;
      q.vocab = 8192;
      q.input_dtype = x;
      q.device = dev;
      q.packed_pieces = true;
      SequenceLayout pairs;
      pairs.sequences = 16;
      pairs.seq_len = 256;
      pairs.unit_sequences = 2;
      q.rows = pairs.sequences * pairs.seq_len;
      for (std::size_t budget : {std::size_t{8} << 20, std::size_t{1} << 30}) {
        INFO("budget ", budget);
        q.budget_bytes = budget;
        PlanRequest plain_q = q;
        plain_q.packed_pieces = false;
        const Plan plain = plan_token_objective(plain_q);
        const Plan f = plan_sequence_objective(q, pairs);
        CHECK(f.regime == Regime::kRecompute);
        CHECK(f.packed_pieces);
        CHECK(contains(f.reason, "gathered"));
        CHECK(f.workspace_bytes() <= plain.workspace_bytes());
        CHECK(f.chunk_rows <= plain.chunk_rows);
        CHECK(f.chunk_rows >= plain.chunk_rows * 9 / 10 - 64);
        // Room for the pieces' X rows (fp32 on the CPU, the input dtype on CUDA).
        const std::size_t x_row =
            static_cast<std::size_t>(q.hidden) * (dev == Device::kCpu ? 4 : dtype_size(x));
        CHECK(f.staging.bytes >= static_cast<std::size_t>(f.chunk_rows) * x_row);
        PlanRequest g = q;
        g.grad_hidden = g.grad_weight = true;
        for (Regime r : {Regime::kAuto, Regime::kRecompute, Regime::kResident}) {
          if (r == Regime::kResident && budget < std::size_t{1} << 30) continue;  // no unit fits
          SequenceLayout l = pairs;
          l.regime = r;
          CHECK(f.workspace_bytes() <= plan_sequence_objective(g, l).workspace_bytes());
        }
      }
      q.budget_bytes = 1 << 16;  // below one plain chunk: the plain plan, over budget
      const Plan tiny = plan_sequence_objective(q, pairs);
      CHECK(tiny.over_budget);
      CHECK_FALSE(tiny.packed_pieces);
      q.budget_bytes = 0;
      q.packed_pieces = false;
      CHECK_FALSE(plan_sequence_objective(q, pairs).packed_pieces);
    }
  }
}

TEST_CASE("plan: vocab_block needs dW, and an infeasible request names the order") {
  PlanRequest q;
  q.rows = 150;
  q.hidden = 40;
  q.vocab = 300;
  q.grad_hidden = true;
  q.order = LoopOrder::kVocabBlock;
  CHECK_THROWS_WITH_AS(plan_token_objective(q),
                       doctest::Contains("is for calls that ask for the weight gradient"), Error);
  q.order = LoopOrder::kAuto;
  const Plan p = plan_token_objective(q);
  CHECK(p.order == LoopOrder::kTokenChunk);
  CHECK(p.predicted_vocab_cost_s == 0);
  q.grad_weight = true;
  q.order = LoopOrder::kVocabBlock;
  q.budget_bytes = 100;
  try {
    plan_token_objective(q);
    FAIL_CHECK("no error for an infeasible vocab_block request");
  } catch (const Error& e) {
    CHECK(contains(e.what(), "vocab_block"));
    CHECK(contains(e.what(), "budget"));
  }
}

TEST_CASE("plan: str() and reason describe the plan") {
  PlanRequest q;
  q.rows = 300;
  q.hidden = 64;
  q.vocab = 2000;
  q.grad_hidden = q.grad_weight = true;
  q.budget_bytes = 1 << 20;
  q.order = LoopOrder::kTokenChunk;
  const Plan t = plan_token_objective(q);
  CHECK(!t.reason.empty());
  CHECK(contains(t.str(), "order=token_chunk"));
  CHECK(contains(t.str(), "C=" + std::to_string(t.chunk_rows)));
  CHECK(contains(t.str(), "chunks=" + std::to_string(t.num_chunks)));
  CHECK(contains(t.str(), "workspace="));
  CHECK(contains(t.str(), t.reason));
  CHECK(!contains(t.str(), "Vb="));
  q.order = LoopOrder::kVocabBlock;
  const Plan v = plan_token_objective(q);
  CHECK(contains(v.str(), "order=vocab_block"));
  CHECK(contains(v.str(), "Vb=" + std::to_string(v.vocab_block)));
  CHECK(contains(v.str(), "blocks=" + std::to_string(v.num_vocab_blocks)));
  CHECK(loop_order_name(LoopOrder::kAuto) == "auto");
  CHECK(loop_order_name(LoopOrder::kTokenChunk) == "token_chunk");
  CHECK(loop_order_name(LoopOrder::kVocabBlock) == "vocab_block");
}

TEST_CASE("plan: workspace slices are aligned, disjoint, inside the total and sized") {
  int failures = 0;
  for_each_plan([&](const PlanRequest& q, const Plan& p) {
    const std::size_t lb = dtype_size(p.logits_dtype);
    struct Named {
      const char* name;
      WorkspaceSlice s;
    };
    const Named slices[] = {{"logits", p.logits},     {"row_stats", p.row_stats},
                            {"dw_accum", p.dw_accum}, {"dh_accum", p.dh_accum},
                            {"db_accum", p.db_accum}, {"staging", p.staging}};
    std::string bad;
    for (const Named& a : slices) {
      if (!a.s.bytes) continue;
      if (a.s.offset % kWorkspaceAlignment) bad += std::string(a.name) + " misaligned; ";
      if (a.s.offset + a.s.bytes > p.workspace_bytes())
        bad += std::string(a.name) + " past the end; ";
      for (const Named& b : slices)
        if (&a < &b && b.s.bytes && a.s.offset < b.s.offset + b.s.bytes &&
            b.s.offset < a.s.offset + a.s.bytes)
          bad += std::string(a.name) + " overlaps " + b.name + "; ";
    }
    const auto cv = static_cast<std::size_t>(p.chunk_rows * q.vocab) * lb;
    if (p.logits.bytes < cv) bad += "logits smaller than [C, V]; ";
    if (p.order == LoopOrder::kVocabBlock &&
        p.logits.bytes < static_cast<std::size_t>(q.rows * p.vocab_block) * lb)
      bad += "logits smaller than [N, Vb]; ";
    if (p.row_stats.bytes < static_cast<std::size_t>(q.rows) * 4) bad += "row_stats too small; ";
    const bool want_dw = q.fp32_weight_grad_accumulator && q.grad_weight;
    if (want_dw != (p.dw_accum.bytes > 0) ||
        (want_dw && p.dw_accum.bytes < static_cast<std::size_t>(q.vocab * q.hidden) * 4))
      bad += "dw_accum; ";
    if (q.grad_bias != (p.db_accum.bytes > 0) ||
        (q.grad_bias && p.db_accum.bytes < static_cast<std::size_t>(q.vocab) * 4))
      bad += "db_accum; ";
    const bool want_dh =
        p.order == LoopOrder::kVocabBlock && q.grad_hidden && q.grad_hidden_dtype != DType::kF32;
    if (want_dh != (p.dh_accum.bytes > 0)) bad += "dh_accum; ";
    if (q.device == Device::kCpu && q.input_dtype == DType::kBF16 && p.staging.bytes == 0)
      bad += "no staging for bf16 operands on the CPU; ";
    if (!bad.empty() && failures++ < 5) FAIL_CHECK(bad << describe(q, p));
  });
  CHECK(failures == 0);
}

TEST_CASE("plan: more budget never gives fewer chunk rows") {
  for (Device dev : {Device::kCpu, Device::kCuda}) {
    for (DType in : {DType::kF32, DType::kBF16}) {
      PlanRequest q;
      q.device = dev;
      q.rows = 1000;
      q.hidden = 123;
      q.vocab = 507;
      q.input_dtype = in;
      q.grad_hidden = q.grad_weight = q.grad_bias = true;
      std::int64_t last = 0;
      for (std::size_t budget = 1 << 14; budget < (std::size_t{1} << 24); budget += 37 << 10) {
        q.budget_bytes = budget;
        const Plan p = plan_token_objective(q);
        CHECK(p.chunk_rows >= last);
        if (!p.over_budget) last = p.chunk_rows;
      }
      const std::int64_t cap = max_chunk_rows(dev);
      CHECK(last == (cap > 0 ? std::min<std::int64_t>(cap, 1000) : 1000));
    }
  }
}

TEST_CASE("plan: budget 0 means the device default (256 MiB CPU, 1 GiB CUDA)") {
#ifdef __AVX2__
  CHECK(max_chunk_rows(Device::kCpu) == 0);  // Eigen's AVX2 GEMMs gain from longer chunks
#else
  CHECK(max_chunk_rows(Device::kCpu) == 256);
#endif
  CHECK(max_chunk_rows(Device::kCuda) == 0);
  for (Device dev : {Device::kCpu, Device::kCuda}) {
    PlanRequest q;
    q.device = dev;
    q.rows = 16384;
    q.hidden = 512;
    q.vocab = 32000;
    q.grad_hidden = q.grad_weight = true;
    q.order = LoopOrder::kTokenChunk;
    const Plan def = plan_token_objective(q);
    q.budget_bytes = dev == Device::kCpu ? std::size_t{256} << 20 : std::size_t{1} << 30;
    const Plan explicit_budget = plan_token_objective(q);
    CHECK(def.chunk_rows == explicit_budget.chunk_rows);
    CHECK(def.workspace_bytes() == explicit_budget.workspace_bytes());
    CHECK(def.workspace_bytes() <= q.budget_bytes);
    CHECK(def.chunk_rows < q.rows);
    // CUDA fills the budget, as does the CPU when Eigen has AVX2; built for SSE2 alone, the CPU
    // stops at its GEMM panel and leaves the rest unused.
    if (dev == Device::kCuda) CHECK(def.chunk_rows >= 2048);
    if (dev == Device::kCpu && max_chunk_rows(dev) == 0) CHECK(def.chunk_rows >= 1024);
    if (dev == Device::kCpu && max_chunk_rows(dev) > 0) CHECK(def.chunk_rows == 256);
  }
}

TEST_CASE("plan: logits dtype bf16 is CUDA only and halves the logits buffer") {
  PlanRequest q;
  q.rows = 300;
  q.hidden = 64;
  q.vocab = 2000;
  q.grad_weight = true;
  q.logits_dtype = DType::kBF16;
  CHECK_THROWS_AS(plan_token_objective(q), Error);
  q.device = Device::kCuda;
  const Plan p = plan_token_objective(q);
  CHECK(p.logits_dtype == DType::kBF16);
  CHECK(p.logits.bytes >= static_cast<std::size_t>(p.chunk_rows * 2000) * 2);
  CHECK(contains(p.str(), "logits=bf16"));
}

TEST_CASE("plan: invalid requests throw") {
  for (int which = 0; which < 3; ++which) {
    PlanRequest q;
    q.rows = 10;
    q.hidden = 10;
    q.vocab = 10;
    (which == 0 ? q.rows : which == 1 ? q.hidden : q.vocab) = 0;
    CHECK_THROWS_AS(plan_token_objective(q), Error);
  }
}

TEST_CASE("plan: LinearCrossEntropy::plan is plan_token_objective of the call's request") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (LoopOrder order : {LoopOrder::kAuto, LoopOrder::kTokenChunk, LoopOrder::kVocabBlock}) {
      CeSpec s;
      s.n = 300;
      s.h = 48;
      s.v = 700;
      s.bias = true;
      s.dtype = dtype;
      const CeData d(s);
      CrossEntropyOptions o;
      o.loop_order = order;
      o.memory_budget_bytes = 1 << 19;
      o.fp32_weight_grad_accumulator = true;
      GradRequest g;
      g.dtype = dtype;
      GradBuffers buffers(d, g);
      const LinearCrossEntropy loss(o);
      const Plan a = loss.plan(d.inputs(o), buffers.views());
      PlanRequest q;
      q.rows = s.n;
      q.hidden = s.h;
      q.vocab = s.v;
      q.input_dtype = dtype;
      q.grad_hidden_dtype = q.grad_weight_dtype = dtype;
      q.grad_hidden = q.grad_weight = q.grad_bias = true;
      q.fp32_weight_grad_accumulator = true;
      q.budget_bytes = 1 << 19;
      q.order = order;
      const Plan b = plan_token_objective(q);
      CHECK(a.str() == b.str());
      CHECK(a.workspace_bytes() == b.workspace_bytes());
      CHECK(loss.workspace_bytes(d.inputs(o), buffers.views()) == b.workspace_bytes());
      CHECK(a.chunk_rows < s.n);  // the 512 KiB budget really splits the rows
      // Forward-only plans need no gradient slices, so their chunks are at least as large.
      const Plan f = loss.plan(d.inputs(o));
      CHECK(f.order == LoopOrder::kTokenChunk);
      CHECK(f.dw_accum.bytes == 0);
      CHECK(f.db_accum.bytes == 0);
      CHECK(f.dh_accum.bytes == 0);
      CHECK(f.chunk_rows >= a.chunk_rows);
      CHECK(f.workspace_bytes() <= o.memory_budget_bytes);
    }
  }
}

}  // namespace
}  // namespace chunkloss::test
