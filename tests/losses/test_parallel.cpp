// Vocabulary and data parallelism on the CPU: LinearCrossEntropy with the weight split by rows
// over the ranks of a vocabulary group and/or the rows split over a data group (in-process groups,
// a thread per rank), against the unsplit call on the same data: every option, fp32 and bf16,
// several chunks, accumulation, uneven shards, a 2 x 2 grid of both; the ranks agree bitwise;
// bad shards and calls are rejected before anything is written, and a call one rank rejects, or
// calls whose collectives would not match, fail on every rank.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/dist/communicator.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ce_fixture.h"
#include "support/compare.h"
#include "support/threads.h"
#include "support/workspace.h"

namespace chunkloss::test {
namespace {

// One rank's call and what it produced.
struct RankRun {
  CrossEntropyResult result;
  GradStorage grads;
  OutBuffers out;
};

// How the call is split: the weight's rows at `vocab` offsets over a vocabulary group, the
// problem's rows at `rows` offsets over a data group (one offset: not split that way).
struct Split {
  std::vector<std::int64_t> vocab = {0};
  std::vector<std::int64_t> rows = {0};
  GradRequest grads{};
  bool accumulate = false;
  float fill = 0.0f;  // the gradient buffers' contents before the call
};

// The rank holding row part `ri` and vocabulary part `vi` calls with its rows and weight rows
// (both parts whole and no groups: the unsplit call).
RankRun call_rank(const CeData& d, const CrossEntropyOptions& o, const Split& s, std::size_t ri,
                  std::size_t vi, dist::Communicator* vocab, dist::Communicator* data) {
  const std::int64_t h = d.spec.h;
  const auto [r0, r1] = data ? part(s.rows, ri, d.spec.n) : std::pair{std::int64_t{0}, d.spec.n};
  const auto [v0, v1] = vocab ? part(s.vocab, vi, d.spec.v) : std::pair{std::int64_t{0}, d.spec.v};
  const std::int64_t n = r1 - r0;
  CrossEntropyInputs in = d.inputs(o);
  in.hidden = rows_of(d, d.hidden, d.hidden_bf, r0, n, h);
  in.targets = d.spec.targets_i64 ? TensorView::of(d.targets64.data() + r0, {n})
                                  : TensorView::of(d.targets32.data() + r0, {n});
  if (d.spec.token_weights) in.token_weights = TensorView::of(d.token_weights.data() + r0, {n});
  if (in.grad_output.defined()) in.grad_output = TensorView::of(d.grad_output.data() + r0, {n});
  in.weight = rows_of(d, d.weight, d.weight_bf, v0, v1 - v0, h);
  if (d.spec.bias) in.bias = rows_of(d, d.bias, d.bias_bf, v0, v1 - v0, 0);
  if (vocab) in.vocab_shard = {vocab, v0, d.spec.v};
  in.data_group = data;
  RankRun run{{},
              GradStorage(s.grads.dtype, s.grads.hidden, s.grads.weight,
                          s.grads.bias && d.spec.bias, n, h, v1 - v0, s.fill),
              OutBuffers(n)};
  CpuContext ctx(1);
  run.result = run_with_fresh_workspace(LinearCrossEntropy(o), ctx, in,
                                        run.grads.views_as<CrossEntropyGrads>(s.accumulate),
                                        run.out.views());
  return run;
}

// Every rank on its own thread, rank (ri, vi) at [ri * vocab parts + vi], in a vocabulary group
// per row part and a data group per vocabulary part (when split that way).
std::vector<RankRun> call_split(const CeData& d, const CrossEntropyOptions& o, const Split& s) {
  const std::size_t nv = s.vocab.size(), nr = s.rows.size();
  const Grid grid(nr, nv);
  return on_threads(nv * nr, [&](std::size_t k) {
    const std::size_t ri = k / nv, vi = k % nv;
    return call_rank(d, o, s, ri, vi, grid.vocab(ri, vi), grid.data(ri, vi));
  });
}

// Elements [b * width, e * width) of `v`.
template <typename T>
std::vector<T> slice(const std::vector<T>& v, std::int64_t b, std::int64_t e, std::int64_t width) {
  return {v.begin() + b * width, v.begin() + e * width};
}

// Whether rows [r0, r1) are ignored.
std::vector<bool> ignored_rows(const CeData& d, std::int64_t r0, std::int64_t r1) {
  std::vector<bool> out;
  for (std::int64_t t = r0; t < r1; ++t) out.push_back(d.targets64[sz(t)] == d.spec.ignore_index);
  return out;
}

// The split call against the unsplit one: every rank's scalars; each rank's per-row outputs and
// dH against its rows; dW and db summed over the row parts and joined over the vocabulary
// parts; and every rank's scalars, and its row part's outputs and dH, bitwise equal to the
// first rank of that row part.
void check_split(const CeSpec& spec, const CrossEntropyOptions& o, const Split& s) {
  const CeData d(spec);
  INFO(describe(spec, o, s.grads), " vocab parts=", s.vocab.size(), " row parts=", s.rows.size(),
       " accumulate=", s.accumulate);
  const RankRun whole = call_rank(d, o, s, 0, 0, nullptr, nullptr);
  const std::vector<RankRun> split = call_split(d, o, s);
  const double tol = s.grads.dtype == DType::kBF16 ? 4e-3 : 2e-5;
  const std::size_t nv = s.vocab.size(), nr = s.rows.size();
  const bool reduced = o.reduce_weight_grad_over_data_group && nr > 1;
  const std::int64_t h = spec.h;
  std::vector<double> dw, db;
  for (std::size_t vi = 0; vi < nv; ++vi) {
    std::vector<double> w, b;
    for (std::size_t ri = 0; ri < nr; ++ri) {
      const RankRun& r = split[ri * nv + vi];
      const RankRun& first = split[ri * nv];
      const RankRun& r0 = split.front();
      check_results(r.result, whole.result, 1e-5);
      CHECK(r.result.loss == r0.result.loss);
      CHECK(r.result.accuracy == r0.result.accuracy);
      const auto [r0b, r1b] =
          nr > 1 ? part(s.rows, ri, spec.n) : std::pair{std::int64_t{0}, spec.n};
      check_lse_where_computed(r.out.lse, slice(whole.out.lse, r0b, r1b, 1),
                               ignored_rows(d, r0b, r1b), 1e-6);
      check_close("row_loss", r.out.row_loss, slice(whole.out.row_loss, r0b, r1b, 1), 1e-5);
      CHECK(r.out.predictions == slice(whole.out.predictions, r0b, r1b, 1));
      if (s.grads.hidden)
        check_close("grad_hidden", r.grads.hidden(), slice(whole.grads.hidden(), r0b, r1b, h), tol);
      CHECK(bitwise_equal(r.out.lse, first.out.lse));
      CHECK(r.grads.hidden() == first.grads.hidden());
      const std::vector<double> rw = r.grads.weight(), rb = r.grads.bias();
      w.resize(rw.size());
      b.resize(rb.size());
      if (reduced) {  // every row part holds the group's sums, bitwise alike: counted once
        CHECK(rw == split[vi].grads.weight());
        CHECK(rb == split[vi].grads.bias());
        if (ri > 0) continue;
      }
      // With accumulation each row part adds to its own prefilled buffer: the fill once.
      for (std::size_t i = 0; i < rw.size(); ++i) w[i] += rw[i] - (ri > 0 ? s.fill : 0.0);
      for (std::size_t i = 0; i < rb.size(); ++i) b[i] += rb[i] - (ri > 0 ? s.fill : 0.0);
    }
    dw.insert(dw.end(), w.begin(), w.end());
    db.insert(db.end(), b.begin(), b.end());
  }
  if (s.grads.weight) check_close("grad_weight", dw, whole.grads.weight(), tol);
  if (s.grads.bias && spec.bias) check_close("grad_bias", db, whole.grads.bias(), tol);
}

CeSpec spec_of(DType t, std::uint64_t seed) {
  CeSpec s;
  s.n = 150;
  s.h = 64;
  s.v = 507;
  s.dtype = t;
  s.logit_scale = 3.0f;
  s.seed = seed;
  return s;
}

// Variant 0: plain, with entropy; 1: bias, class and token weights (the mean's divisor is the
// valid rows' class weights), label smoothing, z-loss; 2: also softcap, sum; 3: softcap, none.
constexpr int kVariants = 4;
std::pair<CeSpec, CrossEntropyOptions> variant_of(int variant, std::uint64_t seed) {
  CeSpec spec = spec_of(DType::kF32, seed + static_cast<std::uint64_t>(variant));
  CrossEntropyOptions o;
  o.compute_entropy = true;
  if (variant >= 1) {
    spec.bias = spec.class_weights = spec.token_weights = true;
    o.label_smoothing = 0.1f;
    o.z_loss = 1e-3f;
  }
  if (variant >= 2) o.softcap = 4.0f;
  if (variant == 2) o.reduction = Reduction::kSum;
  if (variant == 3) o.reduction = Reduction::kNone;
  return {spec, o};
}

}  // namespace

TEST_CASE("vocab parallel: VocabShard::of gives each rank its rows, the unset shard none") {
  dist::InProcessGroup g(3);
  for (int r = 0; r < 3; ++r) {
    const VocabShard sh = VocabShard::of(&g.comm(r), 1003);
    CHECK(sh.offset == 1003 * r / 3);
    CHECK(sh.end() == 1003 * (r + 1) / 3);
  }
  const VocabShard unset = VocabShard::of(nullptr, 1003);  // (its end() dereferenced null)
  CHECK(unset.group == nullptr);
  CHECK(unset.end() == unset.size);
}

TEST_CASE("vocab parallel: 2 and 4 uneven shards match the unsplit call, plain and every option") {
  for (const std::vector<std::int64_t>& offsets :
       {std::vector<std::int64_t>{0, 253}, std::vector<std::int64_t>{0, 126, 253, 380}})
    for (int variant = 0; variant < kVariants; ++variant) {
      const auto [spec, o] = variant_of(variant, 11);
      check_split(spec, o, {offsets});
    }
}

TEST_CASE("vocab parallel: several chunks, sum reduction, accumulation") {
  const CeSpec spec = spec_of(DType::kF32, 21);
  CrossEntropyOptions o;
  o.reduction = Reduction::kSum;
  o.memory_budget_bytes = 96 << 10;  // a few 64-row chunks
  Split s{{0, 253}};
  s.accumulate = true;
  s.fill = 0.25f;
  check_split(spec, o, s);
  const CeData d(spec);
  CrossEntropyInputs in = d.inputs(o);
  in.weight = TensorView::of(d.weight.data(), {253, spec.h});
  in.vocab_shard = {nullptr, 0, 0};
  dist::InProcessGroup g(2);
  in.vocab_shard.group = &g.comm(0);
  in.vocab_shard.size = spec.v;
  CHECK(LinearCrossEntropy(o).plan(in).num_chunks > 1);
}

TEST_CASE("vocab parallel: bf16 inputs and gradients, and the fp32 dW accumulator") {
  CeSpec spec = spec_of(DType::kBF16, 31);
  spec.bias = true;
  CrossEntropyOptions o;
  Split s{{0, 253}};
  s.grads.dtype = DType::kBF16;
  check_split(spec, o, s);
  o.fp32_weight_grad_accumulator = true;
  check_split(spec, o, s);
}

TEST_CASE("vocab parallel: forward only") {
  Split fwd{{0, 253}};
  fwd.grads.hidden = fwd.grads.weight = fwd.grads.bias = false;
  check_split(spec_of(DType::kF32, 41), {}, fwd);
}

TEST_CASE("data parallel: 2 and 3 uneven row parts match the unsplit mean over all rows") {
  for (const std::vector<std::int64_t>& rows :
       {std::vector<std::int64_t>{0, 40}, std::vector<std::int64_t>{0, 64, 65}})
    for (int variant = 0; variant < kVariants; ++variant) {
      const auto [spec, o] = variant_of(variant, 61);
      Split s;
      s.rows = rows;
      check_split(spec, o, s);
    }
}

TEST_CASE("data parallel: bf16, several chunks and accumulation") {
  CeSpec spec = spec_of(DType::kBF16, 71);
  spec.bias = true;
  CrossEntropyOptions o;
  o.memory_budget_bytes = 96 << 10;
  Split s;
  s.rows = {0, 90};
  s.grads.dtype = DType::kBF16;
  check_split(spec, o, s);
  s.grads.dtype = DType::kF32;
  s.accumulate = true;
  s.fill = 0.25f;
  check_split(spec_of(DType::kF32, 72), o, s);
}

TEST_CASE("data parallel: dW and db summed over the group inside the call") {
  const auto [spec, o0] = variant_of(1, 75);
  CrossEntropyOptions o = o0;
  o.reduce_weight_grad_over_data_group = true;
  Split s;
  s.rows = {0, 64, 65};
  check_split(spec, o, s);
  s.grads.dtype = DType::kBF16;  // through the fp32 accumulator the option turns on
  s.accumulate = true;
  s.fill = 0.25f;
  check_split(spec, o, s);
}

TEST_CASE("vocab x data parallel: a 2 x 2 grid of ranks") {
  CeSpec spec = spec_of(DType::kF32, 81);
  spec.bias = spec.class_weights = true;
  CrossEntropyOptions o;
  o.label_smoothing = 0.05f;
  o.compute_entropy = true;
  o.memory_budget_bytes = 96 << 10;
  Split s;
  s.vocab = {0, 253};
  s.rows = {0, 70};
  check_split(spec, o, s);
  o.reduce_weight_grad_over_data_group = true;
  check_split(spec, o, s);
}

TEST_CASE("vocab and data parallel: skip_ignored_rows skips the rows the unsplit call skips") {
  CeSpec spec = spec_of(DType::kBF16, 85);
  spec.bias = true;
  spec.n = 200;
  spec.ignored_prefix = 40;
  spec.ignored_run = {110, 180};  // skipped: a 64-row chunk holds rows from both sides of it
  CrossEntropyOptions o;
  o.skip_ignored_rows = true;
  o.memory_budget_bytes = 96 << 10;
  const CeData d(spec);
  Split s;
  s.grads.dtype = DType::kBF16;
  const RankRun whole = call_rank(d, o, s, 0, 0, nullptr, nullptr);
  CHECK(std::count_if(whole.out.lse.begin(), whole.out.lse.end(),
                      [](float x) { return std::isnan(x); }) >= 110);
  // Also row parts that end and start on ignored rows, which their ranks skip while the unsplit
  // call computes them (within a short gap before the long run): b - 1 and b are ignored.
  std::int64_t b = 0;
  for (std::int64_t t = 42; t < 110 && b == 0; ++t)
    if (d.targets64[sz(t - 1)] == spec.ignore_index && d.targets64[sz(t)] == spec.ignore_index)
      b = t;
  REQUIRE(b > 0);
  for (const Split& split :
       {Split{{0, 253}}, Split{{0}, {0, 90}}, Split{{0, 253}, {0, 70}}, Split{{0}, {0, b}}}) {
    s.vocab = split.vocab;
    s.rows = split.rows;
    check_split(spec, o, s);
  }
}

TEST_CASE("vocab parallel: a shard whose columns are all masked (-inf bias)") {
  // The second shard's statistics are those of no column at all: they must merge as nothing
  // (exp(z - m) of an all -inf row would be NaN), as the unsplit call sees them.
  CeSpec spec = spec_of(DType::kF32, 83);
  spec.bias = true;
  spec.masked_every = 5;
  spec.masked_tail = 254;  // the whole of shard [253, 507)
  CrossEntropyOptions o;
  o.compute_entropy = true;
  Split s;
  s.vocab = {0, 253};
  check_split(spec, o, s);
}

TEST_CASE("bad input: vocab shards") {
  const CeSpec spec = spec_of(DType::kF32, 51);
  const CeData d(spec);
  dist::InProcessGroup g(1), g2(2);
  const LinearCrossEntropy loss;
  CrossEntropyInputs in = d.inputs({});
  in.weight = TensorView::of(d.weight.data(), {253, spec.h});  // rank 0 of 2: rows [0, 253)
  auto fails = [&](const CrossEntropyInputs& bad, const CrossEntropyOptions& o,
                   const char* needle) {
    CHECK_THROWS_WITH_AS(LinearCrossEntropy(o).plan(bad), doctest::Contains(needle), Error);
  };
  CrossEntropyInputs alone = in;
  alone.vocab_shard = {&g.comm(0), 0, spec.v};  // one rank must hold all 507 rows
  fails(alone, {}, "rank 0 of 1 must hold rows [0, 507) of the vocabulary of size 507");
  CrossEntropyInputs moved = in;
  moved.vocab_shard = {&g2.comm(0), 254, spec.v};
  fails(moved, {}, "rank 0 of 2 must hold rows [0, 253)");
  CrossEntropyInputs other = in;  // rank 1's rows are [253, 507): 254 of them
  other.vocab_shard = {&g2.comm(1), 253, spec.v};
  fails(other, {}, "rank 1 of 2 must hold rows [253, 507)");
  CrossEntropyInputs orphan = in;
  orphan.vocab_shard = {nullptr, 10, spec.v};
  fails(orphan, {}, "are set without a group");
  CrossEntropyInputs ok = in;
  ok.vocab_shard = {&g2.comm(0), 0, spec.v};
  CHECK_NOTHROW(loss.plan(ok));
  CrossEntropyOptions vb;
  vb.loop_order = LoopOrder::kVocabBlock;
  fails(ok, vb, "loop_order vocab_block is not available with vocab_shard");
  std::vector<float> cw_shard(253, 1.0f);
  CrossEntropyInputs cw = ok;
  cw.class_weights = TensorView::of(cw_shard.data(), {253});
  fails(cw, {}, "class_weights");
  // Targets are checked against the whole vocabulary: 506 is valid (one rank holding it all).
  CeData edited(spec);
  edited.set_target(0, spec.v - 1);
  CrossEntropyInputs last = edited.inputs({});
  last.vocab_shard = {&g.comm(0), 0, spec.v};
  CpuContext ctx(1);
  AlignedBuffer ws(loss.workspace_bytes(last));
  CHECK_NOTHROW(loss.forward(ctx, last, {}, ws.workspace()));
  // 507 on both ranks of a group of two: each throws it, after they agree.
  edited.set_target(0, spec.v);
  const std::vector<std::string> errors = on_threads(2, [&](std::size_t r) -> std::string {
    CrossEntropyInputs out_of_range = edited.inputs({});
    const std::int64_t first = r == 0 ? 0 : 253, rows = r == 0 ? 253 : 254;
    out_of_range.weight = TensorView::of(d.weight.data() + first * spec.h, {rows, spec.h});
    out_of_range.vocab_shard = {&g2.comm(static_cast<int>(r)), first, spec.v};
    CpuContext rctx(1);
    AlignedBuffer rws(loss.workspace_bytes(out_of_range));
    try {
      loss.forward(rctx, out_of_range, {}, rws.workspace());
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  });
  for (const std::string& e : errors) CHECK(e.find("is outside [0, V=507)") != std::string::npos);
}

TEST_CASE("vocab parallel: every rank plans the same chunks, however the vocabulary divides") {
  // 50257 over 4 ranks: shards of 12564 and 12565 rows. Planned from each shard's own rows, the
  // CUDA plan at 1 GiB gave 16064-row chunks on three ranks and 16000 on the fourth. The plan
  // reads no data, so views over a host byte stand in for the tensors. The CPU plans sweep
  // budgets across the multiples of 64 rows.
  const std::int64_t n = 16384, h = 4096, v = 50257;
  const int k = 4;
  dist::InProcessGroup g(k);
  unsigned char byte = 0;
  auto plans = [&](Device dev, DType dtype, std::size_t budget) {
    CrossEntropyOptions o;
    o.memory_budget_bytes = budget;
    std::vector<Plan> out;
    for (int r = 0; r < k; ++r) {
      const std::int64_t first = v * r / k, rows = v * (r + 1) / k - first;
      CrossEntropyInputs in;
      in.hidden = TensorView(&byte, dtype, {n, h}, dev);
      in.weight = TensorView(&byte, dtype, {rows, h}, dev);
      in.targets = TensorView(&byte, DType::kI64, {n}, dev);
      in.vocab_shard = {&g.comm(r), first, v};
      CrossEntropyGrads gr;
      gr.hidden = TensorView(&byte, dtype, {n, h}, dev);
      gr.weight = TensorView(&byte, dtype, {rows, h}, dev);
      out.push_back(LinearCrossEntropy(o).plan(in, gr));
    }
    return out;
  };
  std::vector<std::vector<Plan>> cases = {plans(Device::kCuda, DType::kBF16, std::size_t{1} << 30)};
  for (std::size_t mib4 = 8; mib4 <= 64; ++mib4)  // 2 to 16 MiB in quarter MiB steps
    cases.push_back(plans(Device::kCpu, DType::kF32, mib4 << 18));
  for (const std::vector<Plan>& ps : cases)
    for (const Plan& p : ps) {
      INFO(p.str(), " against ", ps[0].str());
      CHECK(p.chunk_rows == ps[0].chunk_rows);
      CHECK(p.workspace_bytes() == ps[0].workspace_bytes());
    }
  CHECK(cases[0][0].workspace_bytes() <= std::size_t{1} << 30);
}

TEST_CASE("bad values on one rank: every rank of the groups throws") {
  // Rank 1 of a data group holds an out-of-range target; rank 1 of a vocabulary group a NaN in
  // its weight shard (check_finite). Neither may leave the other ranks waiting.
  for (const bool vocab : {false, true}) {
    CeSpec spec = spec_of(DType::kF32, 91);
    spec.ignore_fraction = 0.0;
    CeData d(spec);
    CrossEntropyOptions o;
    o.check_finite = vocab;
    Split s;
    if (vocab) {
      s.vocab = {0, 253};
      d.weight[static_cast<std::size_t>(300 * spec.h + 5)] = NAN;  // in rank 1's rows
    } else {
      s.rows = {0, 75};
      d.set_target(100, spec.v);  // in rank 1's rows
    }
    s.fill = 0.5f;
    CAPTURE(vocab);
    const std::size_t nv = s.vocab.size(), nr = s.rows.size();
    dist::InProcessGroup group(2);
    const std::vector<std::string> errors = on_threads(2, [&](std::size_t i) -> std::string {
      dist::Communicator* c = &group.comm(static_cast<int>(i));
      try {
        const RankRun r = call_rank(d, o, s, nr > 1 ? i : 0, nv > 1 ? i : 0, vocab ? c : nullptr,
                                    vocab ? nullptr : c);
        FAIL("rank ", i, " did not throw");
      } catch (const Error& e) {
        return e.what();
      }
      return {};
    });
    CHECK(errors[0].find(vocab ? "1 rank(s) of vocab_shard.group rejected their calls"
                               : "1 rank(s) of data_group rejected their calls") !=
          std::string::npos);
    CHECK(errors[1].find(vocab ? "non-finite" : "is outside [0, V=507)") != std::string::npos);
    // Rank 0 names rank 1 and its reason.
    INFO(errors[0]);
    CHECK(errors[0].find(std::string("rejected their calls (rank 1: LinearCrossEntropy: ") +
                         (vocab ? "weight" : "targets")) != std::string::npos);
  }
}

// The ranks of a grid of `nr` row parts x `nv` vocabulary parts (1 or 2 each) of spec_of(f32,
// 91), rank k = ri * nv + vi in a vocabulary group per row part and a data group per vocabulary
// part (when split that way), each making its call after `tweak(k, inputs, grads, options)`, as
// README shows: with a workspace of workspace_bytes(), or an empty one where that throws (the rank
// still calls, so that every rank throws); each rank's error ("" when it returned), after
// checking that a rank that threw wrote nothing.
using Tweak =
    std::function<void(std::size_t, CrossEntropyInputs&, CrossEntropyGrads&, CrossEntropyOptions&)>;
std::vector<std::string> grid_errors(std::size_t nr, std::size_t nv, const Tweak& tweak) {
  const CeSpec spec = spec_of(DType::kF32, 91);
  const CeData d(spec);
  const Grid grid(nr, nv);
  return on_threads(nr * nv, [&](std::size_t k) {
    const auto ri = static_cast<std::int64_t>(k / nv), vi = static_cast<std::int64_t>(k % nv);
    const std::int64_t v0 = nv > 1 ? 253 * vi : 0, v = nv > 1 ? 253 + vi : spec.v;
    const std::int64_t n0 = nr > 1 ? 75 * ri : 0, n = nr > 1 ? 75 : 150;
    CrossEntropyInputs in = d.inputs({});
    in.hidden = TensorView::of(d.hidden.data() + n0 * spec.h, {n, spec.h});
    in.targets = TensorView::of(d.targets32.data() + n0, {n});
    in.weight = TensorView::of(d.weight.data() + v0 * spec.h, {v, spec.h});
    const auto rk = static_cast<std::size_t>(ri), vk = static_cast<std::size_t>(vi);
    if (nv > 1) in.vocab_shard = {grid.vocab(rk, vk), v0, spec.v};
    in.data_group = grid.data(rk, vk);
    GradStorage buffers(DType::kF32, true, true, false, n, spec.h, v, NAN);
    CrossEntropyGrads grads = buffers.views_as<CrossEntropyGrads>(false);
    CrossEntropyOptions o;
    tweak(k, in, grads, o);
    CpuContext ctx(1);
    const LinearCrossEntropy ce(o);
    std::size_t bytes = 0;
    try {
      bytes = ce.workspace_bytes(in, grads);
    } catch (const Error&) {
    }
    const AlignedBuffer ws(bytes);
    try {
      ce.forward_backward(ctx, in, grads, {}, ws.workspace());
    } catch (const Error& e) {
      for (double x : buffers.hidden()) CHECK(std::isnan(x));
      for (double x : buffers.weight()) CHECK(std::isnan(x));
      return std::string(e.what());
    }
    return std::string();
  });
}

// The two ranks of a vocabulary split (`vocab`) or of a data group (see grid_errors).
std::vector<std::string> pair_errors(bool vocab, const Tweak& tweak) {
  return vocab ? grid_errors(1, 2, tweak) : grid_errors(2, 1, tweak);
}

TEST_CASE("a call one rank rejects, or calls whose collectives differ, fail on every rank") {
  // A rank whose shard is not its own.
  std::vector<std::string> e = pair_errors(
      true, [](std::size_t r, CrossEntropyInputs& in, CrossEntropyGrads&, CrossEntropyOptions&) {
        if (r == 1) in.vocab_shard.offset = 250;
      });
  INFO(e[0], " | ", e[1]);
  CHECK(e[0].find("1 rank(s) of vocab_shard.group rejected their calls") != std::string::npos);
  CHECK(e[1].find("rank 1 of 2 must hold rows [253, 507)") != std::string::npos);
  CHECK(e[0].find("(rank 1: ") != std::string::npos);
  CHECK(e[0].find("rank 1 of 2 must hold rows [253, 507)") != std::string::npos);
  // Budgets that give the ranks of a split different chunks; dH asked for on one rank only.
  e = pair_errors(
      true, [](std::size_t r, CrossEntropyInputs&, CrossEntropyGrads&, CrossEntropyOptions& o) {
        if (r == 1) o.memory_budget_bytes = std::size_t{64} << 10;
      });
  for (const std::string& m : e)
    CHECK(m.find("vocab_shard.group make different kinds of calls") != std::string::npos);
  e = pair_errors(
      true, [](std::size_t r, CrossEntropyInputs&, CrossEntropyGrads& g, CrossEntropyOptions&) {
        if (r == 0) g.hidden = {};
      });
  for (const std::string& m : e)
    CHECK(m.find("vocab_shard.group make different kinds of calls") != std::string::npos);
  // Rank 0's shard [0, 253) is its own for V = 506 as for V = 507, but the ranks' vocabularies
  // differ (its targets 506 made 0, so that it accepts them); label smoothing on one rank only
  // (the ranks' terms would differ).
  e = pair_errors(
      true, [](std::size_t r, CrossEntropyInputs& in, CrossEntropyGrads&, CrossEntropyOptions&) {
        static std::vector<std::int32_t> y;
        if (r != 0) return;
        in.vocab_shard.size = 506;
        const auto* t = in.targets.data_as<const std::int32_t>();
        y.assign(t, t + in.targets.numel());
        std::replace(y.begin(), y.end(), 506, 0);
        in.targets = TensorView::of(y.data(), {in.targets.numel()});
      });
  for (const std::string& m : e)
    CHECK(m.find("vocab_shard.group make different kinds of calls") != std::string::npos);
  e = pair_errors(
      true, [](std::size_t r, CrossEntropyInputs&, CrossEntropyGrads&, CrossEntropyOptions& o) {
        if (r == 1) o.label_smoothing = 0.1f;
      });
  for (const std::string& m : e)
    CHECK(m.find("vocab_shard.group make different kinds of calls") != std::string::npos);
  // check_finite on one rank only (on CUDA its count is summed over the split).
  e = pair_errors(
      true, [](std::size_t r, CrossEntropyInputs&, CrossEntropyGrads&, CrossEntropyOptions& o) {
        if (r == 1) o.check_finite = true;
      });
  for (const std::string& m : e)
    CHECK(m.find("vocab_shard.group make different kinds of calls") != std::string::npos);
  // Targets whose skipped rows differ on one rank (its chunks would differ).
  e = pair_errors(
      true, [](std::size_t r, CrossEntropyInputs& in, CrossEntropyGrads&, CrossEntropyOptions& o) {
        o.skip_ignored_rows = true;
        static std::vector<std::int32_t> prompt;
        if (r != 1) return;
        const auto* y = in.targets.data_as<const std::int32_t>();
        prompt.assign(y, y + in.targets.numel());
        std::fill_n(prompt.begin(), 20, o.ignore_index);
        in.targets = TensorView::of(prompt.data(), {in.targets.numel()});
      });
  for (const std::string& m : e)
    CHECK(m.find("vocab_shard.group make different kinds of calls") != std::string::npos);
  // One rank with H one smaller (its dH sums would have another size), in either group.
  const auto narrower = [](std::size_t r, CrossEntropyInputs& in, CrossEntropyGrads& g,
                           CrossEntropyOptions&) {
    if (r != 1) return;
    const auto less = [](const TensorView& t) {
      return TensorView(t.data(), t.dtype(), {t.size(0), t.size(1) - 1});
    };
    in.hidden = less(in.hidden);
    in.weight = less(in.weight);
    g.hidden = less(g.hidden);
    g.weight = less(g.weight);
  };
  for (const bool vocab : {true, false})
    for (const std::string& m : pair_errors(vocab, narrower))
      CHECK(m.find(vocab ? "vocab_shard.group make different kinds of calls"
                         : "data_group make different kinds of calls") != std::string::npos);
  // H = 3 on one rank and 3 + 1048573 (the largest prime below 2^20) on the other: kinds equal
  // modulo one prime of the exchange but not the other. Forward only, one row and V = 2, so that
  // the wide rank's buffers stay small.
  e = pair_errors(
      false, [](std::size_t r, CrossEntropyInputs& in, CrossEntropyGrads& g, CrossEntropyOptions&) {
        static std::vector<float> x[2], w[2];
        static std::vector<std::int32_t> y = {1};
        const std::int64_t h = r == 0 ? 3 : 3 + 1048573;
        x[r].assign(static_cast<std::size_t>(h), 0.5f);
        w[r].assign(static_cast<std::size_t>(2 * h), 0.25f);
        in.hidden = TensorView::of(x[r].data(), {1, h});
        in.weight = TensorView::of(w[r].data(), {2, h});
        in.targets = TensorView::of(y.data(), {1});
        g = {};
      });
  for (const std::string& m : e)
    CHECK(m.find("data_group make different kinds of calls") != std::string::npos);
  // A data group's rank with a gradient buffer of the wrong shape.
  e = pair_errors(
      false, [](std::size_t r, CrossEntropyInputs&, CrossEntropyGrads& g, CrossEntropyOptions&) {
        if (r == 1)
          g.hidden = TensorView(g.hidden.data(), g.hidden.dtype(), {74, g.hidden.size(1)});
      });
  CHECK(e[0].find("1 rank(s) of data_group rejected their calls") != std::string::npos);
  CHECK(e[1].find("grad_hidden") != std::string::npos);
  // dW summed in the call on one rank only.
  e = pair_errors(
      false, [](std::size_t r, CrossEntropyInputs&, CrossEntropyGrads&, CrossEntropyOptions& o) {
        o.reduce_weight_grad_over_data_group = r == 0;
      });
  for (const std::string& m : e)
    CHECK(m.find("data_group make different kinds of calls") != std::string::npos);
  // check_finite on one rank only (on CUDA its ranks read the group's counts at the start).
  e = pair_errors(false, [](std::size_t r, CrossEntropyInputs&, CrossEntropyGrads&,
                            CrossEntropyOptions& o) { o.check_finite = r == 0; });
  for (const std::string& m : e)
    CHECK(m.find("data_group make different kinds of calls") != std::string::npos);
  // The same calls, agreed: both return.
  for (const bool vocab : {true, false}) {
    e = pair_errors(
        vocab, [](std::size_t, CrossEntropyInputs&, CrossEntropyGrads&, CrossEntropyOptions&) {});
    CHECK(e[0].empty());
    CHECK(e[1].empty());
  }
}

// Rank 0 of 2 whose peer took part with NaN values, as an NcclCommunicator whose context is on
// another device does: every sum is NaN, every gathered byte 0xFF.
class NanPeer final : public dist::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  void all_reduce_sum(const Context&, float* data, std::int64_t n) override {
    std::fill_n(data, n, std::numeric_limits<float>::quiet_NaN());
  }
  void all_reduce_sum(const Context&, double* data, std::int64_t n) override {
    std::fill_n(data, n, std::numeric_limits<double>::quiet_NaN());
  }
  void all_gather(const Context&, const void*, void* recv, std::size_t bytes) override {
    std::memset(recv, 0xFF, 2 * bytes);
  }
};

TEST_CASE("a rank that took part with NaN values (its context elsewhere) fails the others") {
  const CeData d(spec_of(DType::kF32, 5));
  Split s;
  s.vocab = {0, 253};
  s.rows = {0, 75};
  s.grads = {true, true, false, DType::kF32};
  s.fill = 7.0f;
  for (const bool vocab : {true, false}) {
    NanPeer peer;
    std::string message;
    try {
      (void)call_rank(d, {}, s, 0, 0, vocab ? &peer : nullptr, vocab ? nullptr : &peer);
    } catch (const Error& e) {
      message = e.what();
    }
    INFO(message);
    CHECK(message.find(vocab ? "a rank of vocab_shard.group could not take part (its context is "
                               "not on its communicator's device); this rank's call was valid, "
                               "and nothing was written"
                             : "a rank of data_group could not take part") != std::string::npos);
  }
}

// A rank's group whose collectives take part with NaN values through the real group `inner`
// and then throw, as an NcclCommunicator's do when the rank's context is on another device.
class TakesPartWithNan final : public dist::Communicator {
 public:
  dist::Communicator* inner = nullptr;
  int rank() const override { return inner->rank(); }
  int size() const override { return inner->size(); }
  void all_reduce_sum(const Context& ctx, float*, std::int64_t n) override {
    std::vector<float> nan(static_cast<std::size_t>(n), std::numeric_limits<float>::quiet_NaN());
    inner->all_reduce_sum(ctx, nan.data(), n);
    fail();
  }
  void all_reduce_sum(const Context& ctx, double*, std::int64_t n) override {
    std::vector<double> nan(static_cast<std::size_t>(n), std::numeric_limits<double>::quiet_NaN());
    inner->all_reduce_sum(ctx, nan.data(), n);
    fail();
  }
  void all_gather(const Context& ctx, const void*, void*, std::size_t bytes) override {
    std::vector<unsigned char> send(bytes, 0xFF), recv(bytes * static_cast<std::size_t>(size()));
    inner->all_gather(ctx, send.data(), recv.data(), bytes);
    fail();
  }

 private:
  [[noreturn]] static void fail() {
    CHUNKLOSS_FAIL("test group: the context is elsewhere; this rank took part with NaN values");
  }
};

TEST_CASE("a rank whose collectives take part with NaN values and throw: every rank throws") {
  // Rank 0's groups take part with NaN values, then throw. In a 2 x 2 grid its vocabulary peer
  // (rank 1) sees NaN and flags its data exchange, its data peer (rank 2) sees NaN, and the
  // grid's exchange goes over rank 2's and 3's vocabulary group only: no rank waits for
  // another (before the fix rank 2 waited in the data exchange), and each names what it saw.
  for (const auto& [nr, nv] : {std::pair<std::size_t, std::size_t>{2, 2}, {1, 2}, {2, 1}}) {
    INFO(nr, " x ", nv);
    TakesPartWithNan vocab, data;
    const std::vector<std::string> e = grid_errors(
        nr, nv,
        [&](std::size_t k, CrossEntropyInputs& in, CrossEntropyGrads&, CrossEntropyOptions&) {
          if (k != 0) return;
          if (in.vocab_shard.group) {
            vocab.inner = in.vocab_shard.group;
            in.vocab_shard.group = &vocab;
          }
          if (in.data_group) {
            data.inner = in.data_group;
            in.data_group = &data;
          }
        });
    CHECK(e[0].find("this rank took part with NaN values") != std::string::npos);
    if (nv > 1)  // rank 1: rank 0's vocabulary peer
      CHECK(e[1].find("a rank of vocab_shard.group could not take part") != std::string::npos);
    if (nr > 1)  // rank nv: rank 0's data peer
      CHECK(e[nv].find("a rank of data_group could not take part") != std::string::npos);
    if (nr > 1 && nv > 1) {  // rank 3: its data peer, rank 1, flagged its call as failed
      CHECK(e[3].find("1 rank(s) of data_group rejected their calls") != std::string::npos);
      CHECK(e[3].find("(rank 0: in its vocab_shard.group, a rank of vocab_shard.group could not "
                      "take part") != std::string::npos);
    }
    for (const std::string& m : e) CHECK_FALSE(m.empty());
  }
}

TEST_CASE("a grid whose data groups are passed by some ranks only fails on every rank") {
  // Only vocabulary part 0 passes its data group. Its ranks would go back over their vocabulary
  // groups with the data group's verdict while the others went on to the passes (over NCCL a
  // hang); the vocabulary kind holds whether a rank has a data group, so all four throw.
  const std::vector<std::string> e = grid_errors(
      2, 2, [](std::size_t k, CrossEntropyInputs& in, CrossEntropyGrads&, CrossEntropyOptions&) {
        if (k % 2 == 1) in.data_group = nullptr;
      });
  for (const std::string& m : e)
    CHECK_MESSAGE(
        m.find(
            "vocab_shard.group make different kinds of calls (their rows, plans, rows computed, H, "
            "grad_hidden asked for, vocab_shard.size, or the options of the rows' terms "
            "(ignore_index, label_smoothing, z_loss, softcap, compute_entropy, reduction, "
            "class_weights), or whether they pass a data_group, differ)") != std::string::npos,
        m);
  // Passed by every rank, the same grid returns on every rank.
  for (const std::string& m : grid_errors(
           2, 2, [](std::size_t, CrossEntropyInputs&, CrossEntropyGrads&, CrossEntropyOptions&) {}))
    CHECK(m.empty());
}

TEST_CASE("in-process group: sums in rank order, gathers, and rejects mismatched sizes") {
  dist::InProcessGroup g(3);
  CHECK(g.size() == 3);
  CHECK_THROWS_AS(g.comm(3), Error);
  CHECK_THROWS_AS(dist::InProcessGroup(0), Error);
  std::vector<std::vector<float>> data = {{1, 2}, {10, 20}, {100, 200}};
  std::vector<std::vector<int>> gathered(3, std::vector<int>(3));
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      CpuContext ctx(1);
      auto& c = g.comm(r);
      const auto i = static_cast<std::size_t>(r);
      c.all_reduce_sum(ctx, data[i].data(), 2);
      const int mine = 7 * r;
      c.all_gather(ctx, &mine, gathered[i].data(), sizeof(int));
      float one[2] = {1.0f, 2.0f};
      try {
        c.all_reduce_sum(ctx, one, r == 2 ? 0 : 1);
      } catch (const Error& e) {
        errors[i] = e.what();
      }
      // Of equal size, but another element type, or another collective.
      double two = 2.0;
      try {
        if (r == 1)
          c.all_reduce_sum(ctx, &two, 1);
        else
          c.all_reduce_sum(ctx, one, 2);
      } catch (const Error& e) {
        errors[i] += std::string(" | ") + e.what();
      }
      try {
        if (r == 0)
          c.all_gather(ctx, one, one, sizeof(float));
        else
          c.all_reduce_sum(ctx, one, 1);
      } catch (const Error& e) {
        errors[i] += std::string(" | ") + e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    const auto i = static_cast<std::size_t>(r);
    INFO(errors[i]);
    CHECK(data[i] == std::vector<float>{111, 222});
    CHECK(gathered[i] == std::vector<int>{0, 7, 14});
    CHECK(errors[i].find("calls all_reduce_sum of floats with 0 bytes") != std::string::npos);
    CHECK(errors[i].find("calls all_reduce_sum of doubles with 8 bytes") != std::string::npos);
    CHECK(errors[i].find("calls all_gather of bytes with 4 bytes") != std::string::npos);
  }
}

TEST_CASE(
    "in-process group: abort wakes the ranks waiting in a collective, and later calls throw") {
  dist::InProcessGroup g(3);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)  // rank 2 never calls: ranks 0 and 1 wait until the abort
    threads.emplace_back([&, r] {
      CpuContext ctx(1);
      double x = 1;
      try {
        g.comm(r).all_reduce_sum(ctx, &x, 1);
      } catch (const Error& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  g.abort();
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) CHECK(e.find("aborted") != std::string::npos);
  CpuContext ctx(1);
  double x = 1;
  CHECK_THROWS_WITH_AS(g.comm(2).all_reduce_sum(ctx, &x, 1), doctest::Contains("aborted"), Error);
}

TEST_CASE(
    "in-process group: a collective that fails on one rank before it shares its buffer aborts the "
    "group, so the others throw instead of waiting") {
  for (const bool gather : {false, true}) {
    CAPTURE(gather);
    dist::InProcessGroup g(3);
    std::vector<std::string> errors(3);
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r)
      threads.emplace_back([&, r] {
        CpuContext ctx(1);
        float x[2] = {1, 2};
        float all[6];
        try {
          if (gather)  // rank 1's staging buffer cannot be had (past the vector's max_size)
            g.comm(r).all_gather(ctx, x, all,
                                 r == 1 ? std::numeric_limits<std::size_t>::max() : sizeof x);
          else
            g.comm(r).all_reduce_sum(ctx, x, r == 1 ? -1 : 2);
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    INFO(errors[0], " | ", errors[1], " | ", errors[2]);
    CHECK((gather || errors[1].find("n=-1 < 0") != std::string::npos));
    CHECK(!errors[1].empty());
    CHECK(errors[0].find("aborted") != std::string::npos);
    CHECK(errors[2].find("aborted") != std::string::npos);
  }
}

}  // namespace chunkloss::test
