// Vocabulary parallelism on the CPU: LinearCrossEntropy with the weight split by rows over the
// ranks of an in-process group (threads) against the unsplit call on the same data, for every
// option, fp32 and bf16, several chunks, accumulation and uneven shards; the ranks agree
// bitwise; bad shards and calls are rejected before anything is written.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/dist/communicator.h>

#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ce_fixture.h"
#include "support/compare.h"
#include "support/workspace.h"

namespace chunkloss::test {
namespace {

// One rank's call and what it produced.
struct RankRun {
  CrossEntropyResult result;
  GradStorage grads;
  OutBuffers out;
};

struct Split {
  std::vector<std::int64_t> offsets;  // first row of each rank's shard; the last ends at V
  GradRequest grads;
  bool accumulate = false;
  float fill = 0.0f;  // the gradient buffers' contents before the call
};

// Views of rows [o, o + rows) of a [V, H] (or [V]) buffer of the problem's dtype.
TensorView rows_of(const CeData& d, const std::vector<float>& f, const std::vector<BFloat16>& b,
                   std::int64_t o, std::int64_t rows, std::int64_t width) {
  if (d.spec.dtype == DType::kBF16)
    return width ? TensorView::of(b.data() + o * width, {rows, width})
                 : TensorView::of(b.data() + o, {rows});
  return width ? TensorView::of(f.data() + o * width, {rows, width})
               : TensorView::of(f.data() + o, {rows});
}

// Rank r of `group` (null: the unsplit call, one rank) calls with its shard of the weight.
RankRun call_rank(const CeData& d, const CrossEntropyOptions& o, const Split& s, int r,
                  dist::Communicator* group) {
  const std::int64_t v = d.spec.v, h = d.spec.h;
  const auto i = static_cast<std::size_t>(r);
  const std::int64_t off = group ? s.offsets[i] : 0;
  const std::int64_t end = group && i + 1 < s.offsets.size() ? s.offsets[i + 1] : v;
  CrossEntropyInputs in = d.inputs(o);
  in.weight = rows_of(d, d.weight, d.weight_bf, off, end - off, h);
  if (d.spec.bias) in.bias = rows_of(d, d.bias, d.bias_bf, off, end - off, 0);
  if (group) in.vocab_shard = {group, off, v};
  RankRun run{{},
              GradStorage(s.grads.dtype, s.grads.hidden, s.grads.weight,
                          s.grads.bias && d.spec.bias, d.spec.n, h, end - off, s.fill),
              OutBuffers(d.spec.n)};
  CpuContext ctx(1);
  run.result = run_with_fresh_workspace(LinearCrossEntropy(o), ctx, in,
                                        run.grads.views_as<CrossEntropyGrads>(s.accumulate),
                                        run.out.views());
  return run;
}

// Every rank of an in-process group on its own thread; rethrows the first rank's error.
std::vector<RankRun> call_split(const CeData& d, const CrossEntropyOptions& o, const Split& s) {
  const int ranks = static_cast<int>(s.offsets.size());
  dist::InProcessGroup group(ranks);
  std::vector<std::optional<RankRun>> runs(s.offsets.size());
  std::vector<std::exception_ptr> errors(s.offsets.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        runs[static_cast<std::size_t>(r)].emplace(call_rank(d, o, s, r, &group.comm(r)));
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
  std::vector<RankRun> out;
  for (auto& r : runs) out.push_back(std::move(*r));
  return out;
}

// The split call against the unsplit one: scalars, per-row outputs, dH on every rank, and the
// concatenated dW and db shards; every rank's loss, outputs and dH bitwise equal to rank 0's.
void check_split(const CeSpec& spec, const CrossEntropyOptions& o, const Split& s) {
  const CeData d(spec);
  INFO(describe(spec, o, s.grads), " ranks=", s.offsets.size(), " accumulate=", s.accumulate);
  const RankRun whole = call_rank(d, o, s, 0, nullptr);
  const std::vector<RankRun> split = call_split(d, o, s);
  const bool bf16 = s.grads.dtype == DType::kBF16;
  const double tol = bf16 ? 4e-3 : 2e-5;
  const RankRun& r0 = split.front();
  check_scalar("loss", r0.result.loss, whole.result.loss, 1e-5);
  check_scalar("z_loss", r0.result.z_loss, whole.result.z_loss, 1e-5);
  check_scalar("accuracy", r0.result.accuracy, whole.result.accuracy, 0);
  check_scalar("entropy", r0.result.entropy, whole.result.entropy, 1e-5);
  CHECK(r0.result.valid_rows == whole.result.valid_rows);
  check_scalar("weight_sum", r0.result.weight_sum, whole.result.weight_sum, 1e-6);
  check_close("lse", r0.out.lse, whole.out.lse, 1e-6);
  check_close("row_loss", r0.out.row_loss, whole.out.row_loss, 1e-5);
  CHECK(r0.out.predictions == whole.out.predictions);
  if (s.grads.hidden) check_close("grad_hidden", r0.grads.hidden(), whole.grads.hidden(), tol);
  std::vector<double> dw, db;
  for (const RankRun& r : split) {
    const std::vector<double> w = r.grads.weight(), b = r.grads.bias();
    dw.insert(dw.end(), w.begin(), w.end());
    db.insert(db.end(), b.begin(), b.end());
    CHECK(r.result.loss == r0.result.loss);
    CHECK(r.result.accuracy == r0.result.accuracy);
    CHECK(r.out.lse == r0.out.lse);
    CHECK(r.out.predictions == r0.out.predictions);
    CHECK(r.grads.hidden() == r0.grads.hidden());
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

}  // namespace

TEST_CASE("vocab parallel: 2 and 3 uneven shards match the unsplit call, plain and every option") {
  for (const std::vector<std::int64_t>& offsets :
       {std::vector<std::int64_t>{0, 300}, std::vector<std::int64_t>{0, 170, 171}}) {
    for (int variant = 0; variant < 3; ++variant) {
      CeSpec spec = spec_of(DType::kF32, 11 + static_cast<std::uint64_t>(variant));
      CrossEntropyOptions o;
      o.compute_entropy = true;
      if (variant >= 1) {
        spec.bias = spec.class_weights = spec.token_weights = true;
        o.label_smoothing = 0.1f;
        o.z_loss = 1e-3f;
      }
      if (variant == 2) {
        o.softcap = 4.0f;
        o.reduction = Reduction::kNone;
      }
      check_split(spec, o, {offsets, {}});
    }
  }
}

TEST_CASE("vocab parallel: several chunks, sum reduction, accumulation") {
  const CeSpec spec = spec_of(DType::kF32, 21);
  CrossEntropyOptions o;
  o.reduction = Reduction::kSum;
  o.memory_budget_bytes = 96 << 10;  // a few 64-row chunks
  Split s{{0, 250}, {}};
  s.accumulate = true;
  s.fill = 0.25f;
  check_split(spec, o, s);
  const CeData d(spec);
  CrossEntropyInputs in = d.inputs(o);
  in.weight = TensorView::of(d.weight.data(), {250, spec.h});
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
  Split s{{0, 256}, {}};
  s.grads.dtype = DType::kBF16;
  check_split(spec, o, s);
  o.fp32_weight_grad_accumulator = true;
  check_split(spec, o, s);
}

TEST_CASE("vocab parallel: one rank is the unsplit call; forward only") {
  const CeSpec spec = spec_of(DType::kF32, 41);
  check_split(spec, {}, {{0}, {}});
  Split fwd{{0, 200}, {}};
  fwd.grads.hidden = fwd.grads.weight = fwd.grads.bias = false;
  check_split(spec, {}, fwd);
}

TEST_CASE("bad input: vocab shards") {
  const CeSpec spec = spec_of(DType::kF32, 51);
  const CeData d(spec);
  dist::InProcessGroup g(1);
  const LinearCrossEntropy loss;
  CrossEntropyInputs in = d.inputs({});
  in.weight = TensorView::of(d.weight.data(), {300, spec.h});
  auto fails = [&](const CrossEntropyInputs& bad, const CrossEntropyOptions& o,
                   const char* needle) {
    CHECK_THROWS_WITH_AS(LinearCrossEntropy(o).plan(bad), doctest::Contains(needle), Error);
  };
  CrossEntropyInputs alone = in;
  alone.vocab_shard = {&g.comm(0), 0, spec.v};  // one rank must hold all 507 rows
  fails(alone, {}, "on a group of one rank");
  dist::InProcessGroup g2(2);
  in.vocab_shard.group = &g2.comm(0);
  CrossEntropyInputs past = in;
  past.vocab_shard = {&g2.comm(0), 300, spec.v};  // rows [300, 600) of 507
  fails(past, {}, "are not inside the vocabulary of size 507");
  CrossEntropyInputs negative = in;
  negative.vocab_shard = {&g2.comm(0), -1, spec.v};
  fails(negative, {}, "vocab_shard rows [-1, 299)");
  CrossEntropyInputs orphan = in;
  orphan.vocab_shard = {nullptr, 10, spec.v};
  fails(orphan, {}, "are set without a group");
  CrossEntropyInputs ok = in;
  ok.vocab_shard = {&g2.comm(0), 0, spec.v};
  CrossEntropyOptions vb;
  vb.loop_order = LoopOrder::kVocabBlock;
  fails(ok, vb, "loop_order vocab_block is not available with vocab_shard");
  std::vector<float> cw_shard(300, 1.0f);
  CrossEntropyInputs cw = ok;
  cw.class_weights = TensorView::of(cw_shard.data(), {300});
  fails(cw, {}, "class_weights");
  // Targets are checked against the whole vocabulary, before any collective: 506 is valid
  // (one rank holding it all), 507 is not (rank 0 of two alone: no other rank is waited for).
  CeData edited(spec);
  edited.set_target(0, spec.v - 1);
  CrossEntropyInputs last = edited.inputs({});
  last.vocab_shard = {&g.comm(0), 0, spec.v};
  CpuContext ctx(1);
  AlignedBuffer ws(loss.workspace_bytes(last));
  CHECK_NOTHROW(loss.forward(ctx, last, {}, ws.workspace()));
  edited.set_target(0, spec.v);
  CrossEntropyInputs out_of_range = edited.inputs({});
  out_of_range.weight = in.weight;
  out_of_range.vocab_shard = ok.vocab_shard;
  CHECK_THROWS_WITH_AS(loss.forward(ctx, out_of_range, {}, ws.workspace()),
                       doctest::Contains("is outside [0, V=507)"), Error);
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
      float one = 1.0f;
      try {
        c.all_reduce_sum(ctx, &one, r == 2 ? 0 : 1);
      } catch (const Error& e) {
        errors[i] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    const auto i = static_cast<std::size_t>(r);
    CHECK(data[i] == std::vector<float>{111, 222});
    CHECK(gathered[i] == std::vector<int>{0, 7, 14});
    CHECK(errors[i].find("InProcessGroup::all_reduce_sum: rank ") != std::string::npos);
  }
}

}  // namespace chunkloss::test
