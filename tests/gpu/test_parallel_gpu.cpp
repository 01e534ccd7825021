// Vocabulary and data parallelism on CUDA: LinearCrossEntropy (and a focal TokenLoss) with the
// weight split by rows over a vocabulary group or the rows over a data group, against the unsplit
// call on the CPU and on CUDA with the same data (also with skip_ignored_rows). Ranks on one device
// through the in-process group (the CUDA backend's exchange path: statistics kernel, merge kernel,
// fp32 dH rows; the data group's divisor and totals), a single-rank NCCL communicator's
// collectives, and with two or more devices the vocabulary split through NCCL, including bitwise
// run-to-run equality; a call one rank rejects, or calls whose collectives differ, fail on every
// rank. Skips itself, with a message, without a device (or, for the NCCL split, a second one).
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/dist/communicator.h>
#include <chunkloss/dist/nccl.h>
#include <chunkloss/gpu/context.h>
#include <chunkloss/losses/cross_entropy.h>

#include <algorithm>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "reference/token_ref.h"
#include "skip.h"
#include "support/compare.h"
#include "support/threads.h"
#include "support/workspace.h"

namespace chunkloss::test {
namespace {

struct Case {
  std::int64_t n = 300, h = 96, v = 1003;
  DType dtype = DType::kF32;  // inputs and gradients
  bool options = false;       // bias, class and token weights, smoothing, z-loss, softcap, entropy
  Reduction reduction = Reduction::kMean;
  std::size_t budget = 0;
  bool accumulate = false;
  bool reduce_weight_grad = false;  // the option of that name (data groups)
  // skip_ignored_rows, with the first 100 rows, rows 150-229 and the last 50 rows ignored
  bool skip = false;
  // A TokenLoss of the focal objective with the options' engine options (mean or sum), instead
  // of LinearCrossEntropy; its logps come back as row_loss, lse and predictions are not written.
  bool focal = false;
};

// Host data as the library sees it (bf16-exact values when bf16).
struct Data {
  std::vector<float> x, w, b, cw, tw, up;
  std::vector<std::int64_t> y;
};

Data make_data(const Case& c, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  auto fill = [&](std::int64_t count, float scale) {
    std::vector<float> f(static_cast<std::size_t>(count));
    for (float& e : f) {
      e = nd(g) * scale;
      if (c.dtype == DType::kBF16) e = static_cast<float>(BFloat16(e));
    }
    return f;
  };
  Data d;
  d.x = fill(c.n * c.h, 1.0f);
  d.w = fill(c.v * c.h, 3.0f / std::sqrt(static_cast<float>(c.h)));
  if (c.options) d.b = fill(c.v, 0.5f);
  for (std::int64_t i = 0; i < c.n; ++i)
    d.y.push_back(u(g) < 1.0f / 7 || (c.skip && (i < 100 || (i >= 150 && i < 230) || i >= c.n - 50))
                      ? -100
                      : static_cast<std::int64_t>(g() % c.v));
  for (std::int64_t j = 0; c.options && j < c.v; ++j) d.cw.push_back(0.5f + u(g));
  for (std::int64_t i = 0; c.options && i < c.n; ++i) d.tw.push_back(2 * u(g));
  for (std::int64_t i = 0; i < c.n; ++i) d.up.push_back(u(g) - 0.3f);
  return d;
}

CrossEntropyOptions options_of(const Case& c) {
  CrossEntropyOptions o;
  o.reduction = c.reduction;
  o.memory_budget_bytes = c.budget;
  o.reduce_weight_grad_over_data_group = c.reduce_weight_grad;
  o.skip_ignored_rows = c.skip;
  if (c.options) {
    o.label_smoothing = 0.1f;
    o.z_loss = 1e-3f;
    o.softcap = 5.0f;
    o.compute_entropy = true;
  }
  return o;
}

struct Result {
  CrossEntropyResult r;
  std::vector<float> dx, dw, db, lse, row_loss;
  std::vector<std::int32_t> pred;
  std::string error;  ///< the call's chunkloss::Error, with Part::keep_error
};

// Memory for one view on the call's device (a host vector on the CPU), filled from floats in
// `t` or from raw bytes.
class Buffer {
 public:
  Buffer(Device dev, std::size_t bytes, const void* src) : dev_(dev), host_(bytes) {
    if (src && bytes) std::memcpy(host_.data(), src, bytes);
    if (dev == Device::kCuda && bytes) {
      mem_ = gpu::DeviceBuffer(bytes);
      gpu::copy_to_device(mem_.data(), host_.data(), bytes);
    }
  }
  static Buffer floats(Device dev, const float* f, std::size_t count, DType t) {
    std::vector<unsigned char> raw(count * dtype_size(t));
    for (std::size_t i = 0; i < count; ++i) {
      if (t == DType::kF32)
        std::memcpy(raw.data() + i * 4, &f[i], 4);
      else
        reinterpret_cast<BFloat16*>(raw.data())[i] = BFloat16(f[i]);
    }
    return Buffer(dev, raw.size(), raw.data());
  }
  void* ptr() { return dev_ == Device::kCuda ? mem_.data() : host_.data(); }
  std::vector<float> read(DType t) {
    if (dev_ == Device::kCuda && !host_.empty())
      gpu::copy_to_host(host_.data(), mem_.data(), host_.size());
    std::vector<float> f(host_.size() / dtype_size(t));
    for (std::size_t i = 0; i < f.size(); ++i)
      f[i] = t == DType::kF32
                 ? reinterpret_cast<const float*>(host_.data())[i]
                 : static_cast<float>(reinterpret_cast<const BFloat16*>(host_.data())[i]);
    return f;
  }

 private:
  Device dev_;
  std::vector<unsigned char> host_;
  gpu::DeviceBuffer mem_;
};

// Which part of the problem one rank computes: rows [r0, r1) and weight rows [v0, v1), in its
// vocabulary and data groups (null: not split that way), on the CPU (device < 0) or CUDA device
// `device`.
struct Part {
  std::int64_t r0, r1, v0, v1;
  dist::Communicator* vocab = nullptr;
  dist::Communicator* data = nullptr;
  int device = 0;
  /// Changes the rank's call before it is made (a bad call among good ones).
  std::function<void(CrossEntropyInputs&, CrossEntropyOptions&)> tweak = {};
  /// Every rank waits here once its buffers and workspace are allocated: over NCCL, a rank
  /// waiting for a collective while another is in cudaMalloc can deadlock in the driver.
  std::barrier<>* allocated = nullptr;
  /// Catch the call's chunkloss::Error into Result::error and read the buffers after it.
  bool keep_error = false;
};

constexpr float kUnwritten = -7.0f;

// One call; gradient buffers hold 0.25 before it with accumulate.
Result call(const Case& c, const Data& d, const Part& pt) {
  const Device dev = pt.device < 0 ? Device::kCpu : Device::kCuda;
  std::optional<gpu::Context> gctx;
  if (dev == Device::kCuda) gctx.emplace(pt.device);  // first: buffers go to its device
  const std::int64_t n = pt.r1 - pt.r0, h = c.h, vl = pt.v1 - pt.v0, off = pt.v0;
  const auto sz = [](std::int64_t k) { return static_cast<std::size_t>(k); };
  const DType t = c.dtype;
  Buffer x = Buffer::floats(dev, d.x.data() + pt.r0 * h, sz(n * h), t);
  Buffer w = Buffer::floats(dev, d.w.data() + off * h, sz(vl * h), t);
  Buffer b =
      Buffer::floats(dev, d.b.empty() ? nullptr : d.b.data() + off, d.b.empty() ? 0 : sz(vl), t);
  Buffer y(dev, sz(n) * 8, d.y.data() + pt.r0), cw(dev, d.cw.size() * 4, d.cw.data()),
      tw(dev, d.tw.empty() ? 0 : sz(n) * 4, d.tw.empty() ? nullptr : d.tw.data() + pt.r0),
      up(dev, sz(n) * 4, d.up.data() + pt.r0);
  const std::vector<float> fill_h(sz(n * h), 0.25f), fill_w(sz(vl * h), 0.25f),
      fill_b(sz(vl), 0.25f);
  Buffer gx = Buffer::floats(dev, fill_h.data(), fill_h.size(), t);
  Buffer gw = Buffer::floats(dev, fill_w.data(), fill_w.size(), t);
  Buffer gb = Buffer::floats(dev, fill_b.data(), d.b.empty() ? 0 : fill_b.size(), t);
  // The per-row outputs start as -7.0f (bits for the predictions) where the call may fail.
  const std::vector<float> fill_out(sz(n), pt.keep_error ? kUnwritten : 0.0f);
  Buffer lse(dev, sz(n) * 4, fill_out.data()), loss(dev, sz(n) * 4, fill_out.data()),
      pred(dev, sz(n) * 4, fill_out.data());

  CrossEntropyOptions o = options_of(c);
  const int index = std::max(pt.device, 0);
  CrossEntropyInputs in;
  in.hidden = TensorView(x.ptr(), t, {n, h}, dev, index);
  in.weight = TensorView(w.ptr(), t, {vl, h}, dev, index);
  if (c.options) {
    in.bias = TensorView(b.ptr(), t, {vl}, dev, index);
    in.class_weights = TensorView(cw.ptr(), DType::kF32, {c.v}, dev, index);
    in.token_weights = TensorView(tw.ptr(), DType::kF32, {n}, dev, index);
  }
  in.targets = TensorView(y.ptr(), DType::kI64, {n}, dev, index);
  if (c.reduction == Reduction::kNone)
    in.grad_output = TensorView(up.ptr(), DType::kF32, {n}, dev, index);
  if (pt.vocab) in.vocab_shard = {pt.vocab, off, c.v};
  in.data_group = pt.data;
  CrossEntropyGrads gr;
  gr.hidden = TensorView(gx.ptr(), t, {n, h}, dev, index);
  gr.weight = TensorView(gw.ptr(), t, {vl, h}, dev, index);
  if (c.options) gr.bias = TensorView(gb.ptr(), t, {vl}, dev, index);
  gr.accumulate = c.accumulate;
  CrossEntropyOutputs out;
  out.lse = TensorView(lse.ptr(), DType::kF32, {n}, dev, index);
  out.row_loss = TensorView(loss.ptr(), DType::kF32, {n}, dev, index);
  out.predictions = TensorView(pred.ptr(), DType::kI32, {n}, dev, index);

  if (pt.tweak) pt.tweak(in, o);
  const LinearCrossEntropy ce(o);
  const TokenLoss focal(std::make_shared<reference::FocalObjective>(2.0),
                        c.focal ? reference::engine_options(o) : TokenOptions{});
  const TokenInputs tin{in.hidden, in.weight, in.bias, in.targets, in.data_group, in.vocab_shard};
  // A tweaked rank's workspace_bytes() may throw: it still makes the call, as the others do.
  const std::size_t wsb = pt.tweak  ? std::size_t{16} << 20
                          : c.focal ? focal.workspace_bytes(tin, gr)
                                    : ce.workspace_bytes(in, gr);
  Result res;
  std::vector<double> logps;  // the token loss's, as row_loss (-logp; 0 for ignored rows)
  const auto kept = [&](Context& ctx, const Workspace& ws) {
    try {
      if (!c.focal) {
        res.r = ce.forward_backward(ctx, in, gr, out, ws);
        return;
      }
      const TokenResult tr = focal.forward_backward(ctx, tin, gr, ws);
      logps = tr.logps;
      res.r.loss = tr.loss;
      res.r.accuracy = tr.accuracy;
      res.r.valid_rows = tr.valid_rows;
    } catch (const Error& e) {
      if (!pt.keep_error) throw;
      res.error = e.what();
    }
  };
  if (gctx) {
    gpu::DeviceBuffer ws(wsb);
    if (pt.allocated) pt.allocated->arrive_and_wait();
    kept(*gctx, Workspace(ws.data(), wsb, Device::kCuda, index));
    gctx->synchronize();
  } else {
    CpuContext ctx(2);
    AlignedBuffer ws(wsb);
    if (pt.allocated) pt.allocated->arrive_and_wait();
    kept(ctx, ws.workspace());
  }
  res.dx = gx.read(t);
  res.dw = gw.read(t);
  res.db = gb.read(t);
  res.lse = lse.read(DType::kF32);
  res.row_loss = loss.read(DType::kF32);
  for (std::size_t i = 0; i < logps.size(); ++i)
    res.row_loss[i] = std::isnan(logps[i]) ? 0.0f : static_cast<float>(-logps[i]);
  const std::vector<float> p = pred.read(DType::kF32);
  res.pred.resize(p.size());
  std::memcpy(res.pred.data(), p.data(), p.size() * 4);
  return res;
}

Part whole(const Case& c, int device) { return {0, c.n, 0, c.v, nullptr, nullptr, device}; }

// Every part on its own thread, the calls made once every rank has allocated.
std::vector<Result> call_parts(const Case& c, const Data& d, std::vector<Part> parts) {
  std::barrier<> allocated(static_cast<std::ptrdiff_t>(parts.size()));
  for (Part& p : parts) p.allocated = &allocated;
  return on_threads(parts.size(), [&](std::size_t r) { return call(c, d, parts[r]); });
}

// The vocabulary split over `devices.size()` ranks of `comm` (rank r: [V r / K, V (r + 1) / K)).
std::vector<Part> vocab_parts(const Case& c, const std::function<dist::Communicator&(int)>& comm,
                              const std::vector<int>& devices) {
  const auto k = static_cast<std::int64_t>(devices.size());
  std::vector<Part> parts;
  for (std::int64_t r = 0; r < k; ++r)
    parts.push_back({0, c.n, c.v * r / k, c.v * (r + 1) / k, &comm(static_cast<int>(r)), nullptr,
                     devices[static_cast<std::size_t>(r)]});
  return parts;
}

// Rows [r0, r0 + got.size()) of a rank's lse against the unsplit call's `whole`, where either
// may skip ignored rows (check_lse_where_computed).
void check_lse(const Data& d, std::int64_t r0, const std::vector<float>& got,
               const std::vector<float>& whole) {
  const auto b = whole.begin() + r0;
  std::vector<bool> ignored;
  for (std::size_t i = 0; i < got.size(); ++i)
    ignored.push_back(d.y[static_cast<std::size_t>(r0) + i] == -100);
  check_lse_where_computed(got, std::vector<float>(b, b + static_cast<std::ptrdiff_t>(got.size())),
                           ignored, 2e-6);
}

// The split results against an unsplit reference (CPU or CUDA): every rank's loss, outputs and
// dH equal to rank 0's, and the concatenated dW and db shards.
void check_split(const Case& c, const Data& d, const std::vector<Result>& split,
                 const Result& whole, double grad_tol) {
  const Result& r0 = split.front();
  check_results(r0.r, whole.r, 2e-5);
  check_lse(d, 0, r0.lse, whole.lse);
  check_close("row_loss", r0.row_loss, whole.row_loss, 2e-5);
  CHECK(r0.pred == whole.pred);
  check_close("grad_hidden", r0.dx, whole.dx, grad_tol);
  std::vector<float> dw, db;
  for (const Result& r : split) {
    dw.insert(dw.end(), r.dw.begin(), r.dw.end());
    db.insert(db.end(), r.db.begin(), r.db.end());
    CHECK(r.r.loss == r0.r.loss);
    CHECK(bitwise_equal(r.lse, r0.lse));
    CHECK(r.pred == r0.pred);
    CHECK(r.dx == r0.dx);
  }
  check_close("grad_weight", dw, whole.dw, grad_tol);
  if (c.options) check_close("grad_bias", db, whole.db, grad_tol);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  Case plain;
  out.push_back(plain);
  Case all = plain;
  all.options = true;
  all.reduction = Reduction::kNone;
  out.push_back(all);
  Case chunks = plain;
  chunks.budget = 1 << 20;  // several chunks
  chunks.accumulate = true;
  chunks.reduction = Reduction::kSum;
  out.push_back(chunks);
  Case bf16 = plain;
  bf16.dtype = DType::kBF16;
  bf16.options = true;
  out.push_back(bf16);
  Case skip = bf16;  // prompt and padding rows skipped
  skip.skip = true;
  skip.budget = 1 << 19;  // 64-row chunks: rows 100-149 and 230-249 (if valid) in two
  out.push_back(skip);
  return out;
}

std::string describe(const Case& c) {
  return "dtype=" + std::string(dtype_name(c.dtype)) + " options=" + std::to_string(c.options) +
         " budget=" + std::to_string(c.budget) + " accumulate=" + std::to_string(c.accumulate) +
         " reduce_weight_grad=" + std::to_string(c.reduce_weight_grad) +
         " skip=" + std::to_string(c.skip) + " focal=" + std::to_string(c.focal);
}

double grad_tolerance(const Case& c) { return c.dtype == DType::kBF16 ? 4e-3 : 2e-5; }

}  // namespace

TEST_CASE(
    "vocab parallel on CUDA: two ranks on one device (in-process group) match the unsplit "
    "CPU and CUDA calls") {
  if (!have_gpu()) return;
  std::vector<Case> all = cases();
  for (Case c : cases()) {  // the focal token objective, where its reduction allows
    if (c.reduction == Reduction::kNone) continue;
    c.focal = true;
    all.push_back(c);
  }
  for (const Case& c : all) {
    INFO(describe(c));
    const Data d = make_data(c, 7);
    dist::InProcessGroup g(2);
    const std::vector<Result> split = call_parts(
        c, d, vocab_parts(c, [&](int r) -> dist::Communicator& { return g.comm(r); }, {0, 0}));
    check_split(c, d, split, call(c, d, whole(c, 0)), grad_tolerance(c));
    check_split(c, d, split, call(c, d, whole(c, -1)), c.dtype == DType::kBF16 ? 4e-3 : 1e-4);
  }
}

TEST_CASE(
    "vocab parallel on CUDA over NCCL: every device a rank, against the unsplit call, "
    "bitwise run to run") {
  if (!have_devices(2, "the NCCL test")) return;
  const int devices = gpu::device_count();
  std::vector<int> ids;  // V = 1003 does not divide by 2, 4 or 8: uneven shards
  for (int i = 0; i < devices; ++i) ids.push_back(i);
  auto comms = dist::NcclCommunicator::create_all(ids);
  for (int i = 0; i < devices; ++i) CHECK(comms[static_cast<std::size_t>(i)]->rank() == i);
  auto comm = [&](int r) -> dist::Communicator& { return *comms[static_cast<std::size_t>(r)]; };
  for (const Case& c : cases()) {
    INFO("ranks=", devices, " ", describe(c));
    const Data d = make_data(c, 8);
    const std::vector<Part> parts = vocab_parts(c, comm, ids);
    const std::vector<Result> split = call_parts(c, d, parts);
    check_split(c, d, split, call(c, d, whole(c, 0)), grad_tolerance(c));
    const std::vector<Result> again = call_parts(c, d, parts);
    for (std::size_t r = 0; r < split.size(); ++r) {
      CHECK(again[r].r.loss == split[r].r.loss);
      CHECK(again[r].dx == split[r].dx);
      CHECK(again[r].dw == split[r].dw);
      CHECK(bitwise_equal(again[r].lse, split[r].lse));
    }
  }
}

// Data-parallel parts (rows split at `rows`) against the unsplit call: the group's scalars on
// every rank, each rank's rows of the outputs and dH, and dW and db summed over the ranks.
void check_data_split(const Case& c, const Data& d, const std::vector<std::int64_t>& rows,
                      const std::vector<Result>& split, const Result& whole, double grad_tol) {
  std::vector<float> dw(whole.dw.size(), 0.0f), db(whole.db.size(), 0.0f);
  const float fill = c.accumulate ? 0.25f : 0.0f;
  for (std::size_t r = 0; r < split.size(); ++r) {
    const Result& p = split[r];
    const std::int64_t r0 = rows[r], r1 = r + 1 < rows.size() ? rows[r + 1] : c.n;
    const auto cut = [&](const auto& v, std::int64_t width) {
      using T = typename std::decay_t<decltype(v)>::value_type;
      return std::vector<T>(v.begin() + r0 * width, v.begin() + r1 * width);
    };
    check_results(p.r, whole.r, 2e-5);
    CHECK(p.r.loss == split.front().r.loss);
    check_lse(d, r0, p.lse, whole.lse);
    check_close("row_loss", p.row_loss, cut(whole.row_loss, 1), 2e-5);
    CHECK(p.pred == cut(whole.pred, 1));
    check_close("grad_hidden", p.dx, cut(whole.dx, c.h), grad_tol);
    if (c.reduce_weight_grad) {  // every rank holds the group's sums, bitwise alike: once
      CHECK(p.dw == split.front().dw);
      CHECK(p.db == split.front().db);
      if (r > 0) continue;
    }
    for (std::size_t i = 0; i < dw.size(); ++i) dw[i] += p.dw[i] - (r > 0 ? fill : 0.0f);
    for (std::size_t i = 0; i < db.size(); ++i) db[i] += p.db[i] - (r > 0 ? fill : 0.0f);
  }
  check_close("grad_weight", dw, whole.dw, grad_tol);
  if (c.options) check_close("grad_bias", db, whole.db, grad_tol);
}

TEST_CASE(
    "data parallel on CUDA: two ranks on one device (in-process group) match the unsplit "
    "mean over all rows") {
  if (!have_gpu()) return;
  const std::vector<std::int64_t> rows{0, 131};
  std::vector<Case> all = cases();
  for (const Case& c : cases()) {  // and dW, db summed over the group inside the call
    all.push_back(c);
    all.back().reduce_weight_grad = true;
  }
  for (Case c : cases()) {  // the focal token objective, where its reduction allows
    if (c.reduction == Reduction::kNone) continue;
    c.focal = true;
    all.push_back(c);
    c.reduce_weight_grad = true;
    all.push_back(c);
  }
  for (const Case& c : all) {
    INFO(describe(c));
    const Data d = make_data(c, 9);
    dist::InProcessGroup g(2);
    const std::vector<Result> split = call_parts(
        c, d,
        {{0, 131, 0, c.v, nullptr, &g.comm(0), 0}, {131, c.n, 0, c.v, nullptr, &g.comm(1), 0}});
    check_data_split(c, d, rows, split, call(c, d, whole(c, 0)), grad_tolerance(c));
  }
}

TEST_CASE(
    "vocab and data parallel on CUDA (in-process group): a call one rank rejects, or calls "
    "whose collectives differ, fail on every rank") {
  if (!have_gpu()) return;
  Case c;
  const Data d = make_data(c, 11);
  // Each rank's error ("" when it returned), with rank 1's call changed by `tweak`.
  const auto errors =
      [&](bool vocab, const std::function<void(CrossEntropyInputs&, CrossEntropyOptions&)>& tweak) {
        dist::InProcessGroup g(2);
        std::vector<Part> parts =
            vocab ? vocab_parts(c, [&](int r) -> dist::Communicator& { return g.comm(r); }, {0, 0})
                  : std::vector<Part>{{0, 131, 0, c.v, nullptr, &g.comm(0), 0},
                                      {131, c.n, 0, c.v, nullptr, &g.comm(1), 0}};
        parts[1].tweak = tweak;
        parts[0].tweak = [](CrossEntropyInputs&, CrossEntropyOptions&) {};
        return on_threads(2, [&](std::size_t r) {
          try {
            call(c, d, parts[r]);
          } catch (const Error& e) {
            return std::string(e.what());
          }
          return std::string();
        });
      };
  std::vector<std::string> e = errors(
      true, [](CrossEntropyInputs& in, CrossEntropyOptions&) { in.vocab_shard.offset += 3; });
  INFO(e[0], " | ", e[1]);
  CHECK(e[0].find("1 rank(s) of vocab_shard.group rejected their calls (rank 1: ") !=
        std::string::npos);
  CHECK(e[1].find("rank 1 of 2 must hold rows [501, 1003)") != std::string::npos);
  CHECK(e[0].find("rank 1 of 2 must hold rows [501, 1003)") != std::string::npos);
  e = errors(true, [](CrossEntropyInputs&, CrossEntropyOptions& o) {
    o.memory_budget_bytes = std::size_t{64} << 10;  // other chunks (1 MiB held them all)
  });
  for (const std::string& m : e)
    CHECK(m.find("vocab_shard.group make different kinds of calls") != std::string::npos);
  e = errors(false, [](CrossEntropyInputs& in, CrossEntropyOptions&) {
    in.targets =
        TensorView(in.targets.data(), in.targets.dtype(), {in.targets.size(0) - 1}, Device::kCuda);
  });
  CHECK(e[0].find("1 rank(s) of data_group rejected their calls") != std::string::npos);
  CHECK(e[1].find("targets") != std::string::npos);
  e = errors(false, [](CrossEntropyInputs&, CrossEntropyOptions& o) {
    o.reduce_weight_grad_over_data_group = true;
  });
  for (const std::string& m : e)
    CHECK(m.find("data_group make different kinds of calls") != std::string::npos);
  e = errors(true, [](CrossEntropyInputs&, CrossEntropyOptions&) {});
  CHECK(e[0].empty());
  CHECK(e[1].empty());

  // Bad values on one rank of a data group are checked on the device and counted over the group,
  // so both ranks throw (at the start with check_finite), instead of the others returning (and
  // going on to their next collective without the rank that threw).
  Case wc;
  wc.options = true;
  const Data wd = make_data(wc, 11);
  const auto both_throw =
      [&](const Data& data,
          const std::function<void(CrossEntropyInputs&, CrossEntropyOptions&)>& tweak,
          const std::string& expected, bool vocab = false) {
        dist::InProcessGroup g(2);
        std::vector<Part> parts =
            vocab ? vocab_parts(wc, [&](int r) -> dist::Communicator& { return g.comm(r); }, {0, 0})
                  : std::vector<Part>{{0, 131, 0, wc.v, nullptr, &g.comm(0), 0},
                                      {131, wc.n, 0, wc.v, nullptr, &g.comm(1), 0}};
        parts[0].tweak = [](CrossEntropyInputs&, CrossEntropyOptions& o) { o.check_finite = true; };
        parts[1].tweak = [&](CrossEntropyInputs& in, CrossEntropyOptions& o) {
          o.check_finite = true;
          if (tweak) tweak(in, o);
        };
        const std::vector<std::string> got = on_threads(2, [&](std::size_t r) {
          try {
            call(wc, data, parts[r]);
          } catch (const Error& x) {
            return std::string(x.what());
          }
          return std::string();
        });
        for (const std::string& m : got)
          CHECK_MESSAGE(m.find(expected) != std::string::npos, m, " (expected: ", expected, ")");
      };
  std::vector<float> bad = wd.cw;
  bad[5] = std::numeric_limits<float>::quiet_NaN();
  gpu::DeviceBuffer bad_cw(bad.size() * 4);
  gpu::copy_to_device(bad_cw.data(), bad.data(), bad.size() * 4);
  both_throw(
      wd,
      [&](CrossEntropyInputs& in, CrossEntropyOptions&) {
        in.class_weights = TensorView(bad_cw.data(), DType::kF32, {wc.v}, Device::kCuda);
      },
      "has 1 values that are negative or not finite, counted over the ranks of data_group");
  Data bad_target = wd;  // row 200 is rank 1's
  bad_target.y[200] = wc.v;
  both_throw(bad_target, {},
             "has 1 values outside [0, V=1003) that are not ignore_index (-100), counted over the "
             "ranks of data_group; checked on the device before anything was written");
  // Without check_finite the bad target is counted over the group before any row is computed,
  // so both ranks refuse the call as it runs, rank 0 (whose rows are all valid) included: they
  // throw at the end, having added nothing to their gradients (0.25 before the call; zero when
  // overwritten) and written no per-row output (kUnwritten before the call).
  for (const bool accumulate : {true, false}) {
    CAPTURE(accumulate);
    Case ac = wc;
    ac.accumulate = accumulate;
    dist::InProcessGroup g(2);
    std::vector<Part> parts{{0, 131, 0, ac.v, nullptr, &g.comm(0), 0},
                            {131, ac.n, 0, ac.v, nullptr, &g.comm(1), 0}};
    for (Part& p : parts) p.keep_error = true;
    const float before = accumulate ? 0.25f : 0.0f;
    for (const Result& r : call_parts(ac, bad_target, parts)) {
      CHECK_MESSAGE(r.error.find("counted over the ranks of data_group; checked on the device as "
                                 "the call ran, which added nothing to accumulated gradients") !=
                        std::string::npos,
                    r.error);
      for (const std::vector<float>* v : {&r.dx, &r.dw, &r.db, &r.lse, &r.row_loss}) {
        const float expected = v == &r.lse || v == &r.row_loss ? kUnwritten : before;
        CHECK(std::all_of(v->begin(), v->end(), [&](float f) { return f == expected; }));
      }
      CHECK(std::all_of(r.pred.begin(), r.pred.end(), [](std::int32_t k) {
        return k == std::bit_cast<std::int32_t>(kUnwritten);
      }));
    }
  }
  Data nan_hidden = wd;
  nan_hidden.x[static_cast<std::size_t>(200 * wc.h + 3)] = std::numeric_limits<float>::infinity();
  both_throw(nan_hidden, {},
             "check_finite found 1 non-finite values in hidden/weight/bias/token_weights/"
             "grad_output, counted over the ranks of data_group");
  // Over a vocabulary split a NaN in rank 1's own weight rows: rank 0 returned a NaN loss.
  Data nan_shard = wd;
  nan_shard.w[static_cast<std::size_t>((wc.v - 2) * wc.h + 5)] =
      std::numeric_limits<float>::quiet_NaN();
  both_throw(nan_shard, {},
             "check_finite found 1 non-finite values in hidden/weight/bias/token_weights/"
             "grad_output, summed over the ranks of vocab_shard.group",
             true);
  // Over a vocabulary split whose ranks break the rule of equal targets (rank 1's has one out of
  // range): with check_finite, whose counts each rank reads at its start, the counts are summed,
  // so both throw there, not rank 1 alone while rank 0 waits for it in the first collective.
  std::vector<std::int64_t> bad_y = wd.y;
  bad_y[200] = wc.v;
  gpu::DeviceBuffer bad_targets(bad_y.size() * 8);
  gpu::copy_to_device(bad_targets.data(), bad_y.data(), bad_y.size() * 8);
  both_throw(
      wd,
      [&](CrossEntropyInputs& in, CrossEntropyOptions&) {
        in.targets = TensorView(bad_targets.data(), DType::kI64, {wc.n}, Device::kCuda);
      },
      "has 1 values outside [0, V=1003) that are not ignore_index (-100), summed over the ranks "
      "of vocab_shard.group",
      true);
}

TEST_CASE(
    "NcclCommunicator on one device: its collectives, and the loss through a one-rank "
    "data group equals the call without it") {
  if (!have_gpu()) return;
  auto comms = dist::NcclCommunicator::create_all({0});
  dist::Communicator& comm = *comms[0];
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  gpu::Context ctx(0);
  const std::vector<float> f{1.5f, -2.0f, 3.25f};
  const std::vector<double> g{0.1, 1e300};
  const std::vector<int> send{7, 9};
  gpu::DeviceBuffer df(12), dd(16), ds(8), dr(8);
  gpu::copy_to_device(df.data(), f.data(), 12);
  gpu::copy_to_device(dd.data(), g.data(), 16);
  gpu::copy_to_device(ds.data(), send.data(), 8);
  comm.all_reduce_sum(ctx, df.as<float>(), 3);
  comm.all_reduce_sum(ctx, dd.as<double>(), 2);
  comm.all_gather(ctx, ds.data(), dr.data(), 8);
  ctx.synchronize();
  std::vector<float> f2(3);
  std::vector<double> g2(2);
  std::vector<int> recv(2);
  gpu::copy_to_host(f2.data(), df.data(), 12);
  gpu::copy_to_host(g2.data(), dd.data(), 16);
  gpu::copy_to_host(recv.data(), dr.data(), 8);
  CHECK(f2 == f);
  CHECK(g2 == g);
  CHECK(recv == send);
  Case c;
  c.options = true;
  const Data d = make_data(c, 10);
  Part p = whole(c, 0);
  p.data = &comm;
  const Result through = call(c, d, p), plain = call(c, d, whole(c, 0));
  CHECK(through.r.loss == plain.r.loss);
  CHECK(through.r.accuracy == plain.r.accuracy);
  CHECK(through.dx == plain.dx);
  CHECK(through.dw == plain.dw);
}

TEST_CASE(
    "LinearCrossEntropy on CUDA: a view or the workspace on another device index is an "
    "error") {
  if (!have_gpu()) return;
  gpu::Context ctx(0);
  const std::int64_t n = 8, h = 16, v = 32;
  gpu::DeviceBuffer x(n * h * 4), w(v * h * 4), y(n * 8);
  const std::vector<std::int64_t> targets(static_cast<std::size_t>(n), 1);
  gpu::copy_to_device(y.data(), targets.data(), targets.size() * 8);
  CrossEntropyInputs in;
  in.hidden = TensorView(x.data(), DType::kF32, {n, h}, Device::kCuda, 1);
  in.weight = TensorView(w.data(), DType::kF32, {v, h}, Device::kCuda, 0);
  in.targets = TensorView(y.data(), DType::kI64, {n}, Device::kCuda, 0);
  const LinearCrossEntropy ce;
  gpu::DeviceBuffer ws(ce.workspace_bytes(in));
  CHECK_THROWS_WITH_AS(
      ce.forward(ctx, in, {}, Workspace(ws.data(), ws.bytes(), Device::kCuda, 0)),
      doctest::Contains("hidden [8, 16] f32 cuda is on device index 1, the context on cuda:0"),
      Error);
  in.hidden = TensorView(x.data(), DType::kF32, {n, h}, Device::kCuda, 0);
  CHECK_THROWS_WITH_AS(ce.forward(ctx, in, {}, Workspace(ws.data(), ws.bytes(), Device::kCuda, 1)),
                       doctest::Contains("workspace is on cuda:1, the context on cuda:0"), Error);
  CHECK_NOTHROW(ce.forward(ctx, in, {}, Workspace(ws.data(), ws.bytes(), Device::kCuda, 0)));
}

TEST_CASE("NcclCommunicator: bad device lists and a context on another device") {
  if (!have_gpu()) return;
  CHECK_THROWS_WITH_AS(dist::NcclCommunicator::create_all({}), doctest::Contains("no devices"),
                       Error);
  CHECK_THROWS_WITH_AS(dist::NcclCommunicator::create_all({0, 0}),
                       doctest::Contains("device 0 is listed twice"), Error);
  CHECK_THROWS_WITH_AS(dist::NcclCommunicator::create_all({gpu::device_count()}),
                       doctest::Contains("does not exist"), Error);
  const dist::NcclCommunicator::UniqueId id = dist::NcclCommunicator::unique_id();
  CHECK_THROWS_WITH_AS(dist::NcclCommunicator(id, 1, 1, 0),
                       doctest::Contains("rank 1 is not in [0, size=1)"), Error);
  CHECK_THROWS_WITH_AS(dist::NcclCommunicator(id, 0, 1, gpu::device_count()),
                       doctest::Contains("does not exist"), Error);
  const dist::NcclCommunicator by_id(id, 0, 1, 0);  // one process per GPU, here one rank
  CHECK(by_id.rank() == 0);
  CHECK(by_id.size() == 1);
  CHECK(by_id.device() == 0);
  // A CPU context: the rank takes part with NaN values from the communicator's own buffer, so
  // that the others would not wait for it, then throws; the communicator stays usable.
  auto one = dist::NcclCommunicator::create_all({0});
  CpuContext cpu;
  float x = 1.0f;
  double y = 2.0;
  char bytes[3] = {1, 2, 3};
  CHECK_THROWS_WITH_AS(one[0]->all_reduce_sum(cpu, &x, 1),
                       doctest::Contains("the communicator is on cuda device 0, the context on cpu "
                                         "device 0; this rank took part with NaN values"),
                       Error);
  CHECK_THROWS_WITH_AS(one[0]->all_reduce_sum(cpu, &y, 1),
                       doctest::Contains("this rank took part with NaN values"), Error);
  CHECK_THROWS_WITH_AS(one[0]->all_gather(cpu, bytes, bytes, 3),
                       doctest::Contains("this rank took part with NaN values"), Error);
  CHECK(x == 1.0f);  // (the caller's buffers are not touched)
  CHECK(y == 2.0);
  // Beyond the own buffer it cannot take part, and says so.
  std::vector<double> big(dist::NcclCommunicator::kOwnBufferBytes / sizeof(double) + 1);
  CHECK_THROWS_WITH_AS(
      one[0]->all_reduce_sum(cpu, big.data(), static_cast<std::int64_t>(big.size())),
      doctest::Contains("this rank did not take part"), Error);
  gpu::Context ctx(0);
  gpu::DeviceBuffer buf(sizeof(float));
  gpu::copy_to_device(buf.data(), &x, sizeof x);
  one[0]->all_reduce_sum(ctx, buf.as<float>(), 1);
  ctx.synchronize();
  float back = 0.0f;
  gpu::copy_to_host(&back, buf.data(), sizeof back);
  CHECK(back == 1.0f);
  CHECK(one[0]->async_error().empty());
  // A loss call on the CPU with the communicator as its data group: its first exchange throws.
  Case c;
  const Data d = make_data(c, 10);
  Part p = whole(c, 0);
  p.device = -1;
  p.data = one[0].get();
  CHECK_THROWS_WITH_AS(call(c, d, p), doctest::Contains("took part with NaN values"), Error);
}

TEST_CASE(
    "NcclCommunicator::abort: later collectives throw, the communicator is not destroyed "
    "twice") {
  if (!have_gpu()) return;
  gpu::Context ctx(0);
  gpu::DeviceBuffer buf(sizeof(float));
  for (const bool by_id : {false, true}) {
    std::unique_ptr<dist::NcclCommunicator> comm;
    if (by_id)
      comm = std::make_unique<dist::NcclCommunicator>(dist::NcclCommunicator::unique_id(), 0, 1, 0);
    else
      comm = std::move(dist::NcclCommunicator::create_all({0})[0]);
    comm->all_reduce_sum(ctx, buf.as<float>(), 1);
    ctx.synchronize();
    CHECK_FALSE(comm->aborted());
    comm->abort();
    CHECK(comm->aborted());
    CHECK(comm->async_error().empty());
    CHECK_THROWS_WITH_AS(comm->all_reduce_sum(ctx, buf.as<float>(), 1),
                         doctest::Contains("NcclCommunicator::all_reduce_sum: the communicator "
                                           "(rank 0 of 1) was aborted"),
                         Error);
    CHECK_THROWS_WITH_AS(comm->all_gather(ctx, buf.data(), buf.data(), 4),
                         doctest::Contains("was aborted"), Error);
    comm->abort();  // again: nothing
    CHECK(comm->rank() == 0);
  }  // (the destructor frees its own buffer and stream, not the aborted communicator)
}

}  // namespace chunkloss::test
