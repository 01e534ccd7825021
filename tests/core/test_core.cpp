// Tests of lib/core: Error and the check macros, BFloat16 rounding, TensorView, the workspace
// layout and its checks, and the CPU context.
#include <chunkloss/core/context.h>
#include <chunkloss/core/dtype.h>
#include <chunkloss/core/error.h>
#include <chunkloss/core/tensor.h>
#include <chunkloss/core/workspace.h>
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <type_traits>

#include "support/bf16.h"
#include "support/workspace.h"

namespace chunkloss {
namespace {

using test::float_bits;
using test::float_from_bits;

std::string what_of(const auto& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no exception>";
}

bool contains(const std::string& s, std::string_view needle) {
  return s.find(needle) != std::string::npos;
}

std::uint16_t bf16_bits(float f) { return BFloat16(f).bits; }

// Independent round-to-nearest-even to bf16 for finite floats: compare the distances to the two
// neighbouring bf16 values in double, break ties toward the even mantissa.
std::uint16_t reference_bf16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = u & 0x80000000u, mag = u & 0x7fffffffu;
  const std::uint32_t lo = mag & 0xffff0000u, hi = lo + 0x10000u;
  const double x = std::abs(static_cast<double>(f));
  const double dlo = x - static_cast<double>(float_from_bits(lo));
  // hi may be the bit pattern of +inf: treat it as 2^128, the next value of the exponent ladder.
  const double hv = hi == 0x7f800000u ? std::ldexp(1.0, 128) : float_from_bits(hi);
  const double dhi = hv - x;
  std::uint32_t pick = dlo < dhi ? lo : dhi < dlo ? hi : (((lo >> 16) & 1u) ? hi : lo);
  return static_cast<std::uint16_t>((sign | pick) >> 16);
}

TEST_CASE("Error is a runtime_error and CHUNKLOSS_CHECK streams its arguments") {
  static_assert(std::is_base_of_v<std::runtime_error, Error>);
  const std::string w = what_of([] { CHUNKLOSS_CHECK(1 + 1 == 3, "hidden ", 4, " vs ", 2.5); });
  CHECK(w.rfind("hidden 4 vs 2.5", 0) == 0);
  CHECK(contains(w, "test_core.cpp:"));
  CHECK_THROWS_AS(CHUNKLOSS_FAIL("x"), Error);
  CHECK(contains(what_of([] { CHUNKLOSS_FAIL("weight ", "[3, 4]"); }), "weight [3, 4]"));
  CHECK_THROWS_AS(CHUNKLOSS_CHECK(false, "x"), std::runtime_error);
}

TEST_CASE("CHUNKLOSS_CHECK does not throw or evaluate its message when the condition holds") {
  int evaluated = 0;
  auto side_effect = [&] { return ++evaluated; };
  CHECK_NOTHROW(CHUNKLOSS_CHECK(true, "never ", side_effect()));
  CHECK(evaluated == 0);
  CHECK_THROWS_AS(CHUNKLOSS_CHECK(false, "once ", side_effect()), Error);
  CHECK(evaluated == 1);
}

TEST_CASE("dtype sizes and names") {
  CHECK(dtype_size(DType::kF32) == 4);
  CHECK(dtype_size(DType::kBF16) == 2);
  CHECK(dtype_size(DType::kI32) == 4);
  CHECK(dtype_size(DType::kI64) == 8);
  CHECK(dtype_name(DType::kF32) == "f32");
  CHECK(dtype_name(DType::kBF16) == "bf16");
  CHECK(dtype_name(DType::kI32) == "i32");
  CHECK(dtype_name(DType::kI64) == "i64");
  CHECK(is_floating(DType::kBF16));
  CHECK(!is_floating(DType::kI64));
}

TEST_CASE("BFloat16 exact values and widening") {
  CHECK(bf16_bits(1.0f) == 0x3f80);
  CHECK(bf16_bits(-2.0f) == 0xc000);
  CHECK(bf16_bits(0.0f) == 0x0000);
  CHECK(bf16_bits(-0.0f) == 0x8000);
  CHECK(static_cast<float>(BFloat16(3.0f)) == 3.0f);
  CHECK(BFloat16().bits == 0);
  // Every non-NaN bf16 value survives float -> bf16 exactly.
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    BFloat16 x;
    x.bits = static_cast<std::uint16_t>(b);
    const float f = static_cast<float>(x);
    CHECK(float_bits(f) == (b << 16));
    if (!std::isnan(f) && BFloat16(f).bits != b) {
      FAIL_CHECK("bf16 pattern " << b << " does not round-trip");
      break;
    }
  }
}

TEST_CASE("BFloat16 rounds to nearest, ties to even") {
  CHECK(bf16_bits(float_from_bits(0x3f807fffu)) == 0x3f80);  // below half: down
  CHECK(bf16_bits(float_from_bits(0x3f808000u)) == 0x3f80);  // tie, even below: down
  CHECK(bf16_bits(float_from_bits(0x3f808001u)) == 0x3f81);  // above half: up
  CHECK(bf16_bits(float_from_bits(0x3f818000u)) == 0x3f82);  // tie, odd below: up to even
  CHECK(bf16_bits(float_from_bits(0xbf818000u)) == 0xbf82);  // same for negatives
  CHECK(bf16_bits(float_from_bits(0x3fffffffu)) == 0x4000);  // carries into the exponent
  CHECK(bf16_bits(float_from_bits(0x00008000u)) == 0x0000);  // denormal tie to even (zero)
  CHECK(bf16_bits(float_from_bits(0x00018000u)) == 0x0002);  // denormal tie to even (up)
  CHECK(bf16_bits(float_from_bits(0x00000001u)) == 0x0000);  // smallest denormal: down
  CHECK(bf16_bits(1.00390625f) == 0x3f80);  // 1 + 2^-8: exact tie between 1 and 1 + 2^-7
  CHECK(round_to_bf16(1.0f + 3.0f / 256.0f) == 1.015625f);  // tie to even, upward

  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits(0, 0xffffffffu);
  int mismatches = 0;
  for (int i = 0; i < 200000; ++i) {
    const float f = float_from_bits(bits(rng));
    if (!std::isfinite(f)) continue;
    if (bf16_bits(f) != reference_bf16_bits(f) && mismatches++ < 5)
      FAIL_CHECK("bf16(" << f << ", bits " << float_bits(f) << ") = " << bf16_bits(f) << ", want "
                         << reference_bf16_bits(f));
  }
  CHECK(mismatches == 0);
}

TEST_CASE("BFloat16 NaN and infinity") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(bf16_bits(inf) == 0x7f80);
  CHECK(bf16_bits(-inf) == 0xff80);
  CHECK(std::isinf(static_cast<float>(BFloat16(inf))));
  // Overflow of the largest floats rounds to infinity; the largest bf16 stays finite.
  CHECK(bf16_bits(std::numeric_limits<float>::max()) == 0x7f80);
  CHECK(bf16_bits(float_from_bits(0x7f7f0000u)) == 0x7f7f);
  CHECK(bf16_bits(float_from_bits(0x7f7f7fffu)) == 0x7f7f);
  // NaNs stay NaN, keep their sign, and never turn into infinity (payload only in low bits).
  for (std::uint32_t u :
       {0x7fc00000u, 0x7f800001u, 0x7fffffffu, 0xff800001u, 0xffc00000u, 0x7f80ffffu}) {
    CAPTURE(u);
    const float back = static_cast<float>(BFloat16(float_from_bits(u)));
    CHECK(std::isnan(back));
    CHECK((BFloat16(float_from_bits(u)).bits & 0x8000) == ((u >> 16) & 0x8000));
  }
  CHECK(std::isnan(round_to_bf16(std::numeric_limits<float>::quiet_NaN())));
}

TEST_CASE("TensorView shape, numel, defined and str") {
  float data[24] = {};
  const TensorView absent;
  CHECK(!absent.defined());
  CHECK(absent.str() == "absent");
  CHECK(absent.ndim() == 0);

  const TensorView v = TensorView::of(data, {4, 6});
  CHECK(v.defined());
  CHECK(v.ndim() == 2);
  CHECK(v.size(0) == 4);
  CHECK(v.size(1) == 6);
  CHECK(v.numel() == 24);
  CHECK(v.nbytes() == 96);
  CHECK(v.dtype() == DType::kF32);
  CHECK(v.device() == Device::kCpu);
  CHECK(v.data() == static_cast<void*>(data));
  CHECK(v.data_as<float>() == data);
  CHECK(v.str() == "[4, 6] f32 cpu");

  const BFloat16 b[7] = {};
  CHECK(TensorView::of(b, {1, 7}).str() == "[1, 7] bf16 cpu");
  CHECK(TensorView::of(b, {7}).nbytes() == 14);
  const std::int32_t i32[3] = {};
  const std::int64_t i64[3] = {};
  CHECK(TensorView::of(i32, {3}).dtype() == DType::kI32);
  CHECK(TensorView::of(i64, {3}).dtype() == DType::kI64);
  CHECK(TensorView::of(i64, {3}).nbytes() == 24);
  CHECK(TensorView(data, DType::kF32, {2, 3}, Device::kCuda, 1).str() == "[2, 3] f32 cuda");
  CHECK(TensorView(data, DType::kF32, {2, 3}, Device::kCuda, 1).device_index() == 1);
  CHECK(TensorView::of(data, {1, 2, 3, 4}).numel() == 24);

  // Zero-sized views need no data but are still defined (a present, empty argument).
  const TensorView empty(nullptr, DType::kF32, {0, 5});
  CHECK(empty.defined());
  CHECK(empty.numel() == 0);
  CHECK(empty.str() == "[0, 5] f32 cpu");
}

TEST_CASE("TensorView rejects bad shapes and null data") {
  float data[4] = {};
  CHECK_THROWS_AS(TensorView::of(data, {1, 1, 1, 1, 1}), Error);
  CHECK(contains(what_of([&] { TensorView::of(data, {1, 1, 1, 1, 1}); }), "dimensions"));
  CHECK_THROWS_AS(TensorView::of(data, {2, -1}), Error);
  CHECK(contains(what_of([&] { TensorView::of(data, {2, -1}); }), "negative"));
  CHECK_THROWS_AS(TensorView(nullptr, DType::kF32, {3}), Error);
  CHECK(contains(what_of([] { TensorView(nullptr, DType::kF32, {3}); }), "null"));
}

TEST_CASE("WorkspaceLayout aligns every slice") {
  WorkspaceLayout l;
  CHECK(l.total() == 0);
  const WorkspaceSlice a = l.add(1);
  const WorkspaceSlice b = l.add(256);
  const WorkspaceSlice c = l.add(0);
  const WorkspaceSlice d = l.add(1000);
  CHECK(a.offset == 0);
  CHECK(a.bytes == 1);
  CHECK(b.offset == 256);
  CHECK(b.bytes == 256);
  CHECK(c.offset == 512);
  CHECK(c.bytes == 0);
  CHECK(d.offset == 512);
  CHECK(d.bytes == 1000);
  CHECK(l.total() == 512 + 1024);
  for (const WorkspaceSlice& s : {a, b, c, d}) CHECK(s.offset % kWorkspaceAlignment == 0);
  CHECK(l.total() % kWorkspaceAlignment == 0);
}

TEST_CASE("Workspace checks alignment, size and carves slices") {
  test::AlignedBuffer buf(1024, 0);
  CHECK(reinterpret_cast<std::uintptr_t>(buf.data()) % kWorkspaceAlignment == 0);
  auto* base = static_cast<unsigned char*>(buf.data());

  CHECK_THROWS_AS(Workspace(base + 16, 512), Error);
  CHECK(contains(what_of([&] { Workspace(base + 16, 512); }), "aligned"));
  CHECK_THROWS_AS(Workspace(nullptr, 64), Error);
  CHECK_NOTHROW(Workspace(nullptr, 0));

  WorkspaceLayout l;
  l.add(100);
  const WorkspaceSlice s = l.add(300);
  CHECK(l.total() == 768);
  const Workspace exact(base, 768);
  CHECK_NOTHROW(exact.require(l, "MyLoss"));
  CHECK(exact.at<float>(s) == reinterpret_cast<float*>(base + 256));
  CHECK(exact.bytes() == 768);
  CHECK(exact.device() == Device::kCpu);

  const Workspace small(base, 767);
  CHECK_THROWS_AS(small.require(l, "MyLoss"), Error);
  const std::string w = what_of([&] { small.require(l, "MyLoss"); });
  CHECK(contains(w, "MyLoss"));
  CHECK(contains(w, "workspace"));
  CHECK(contains(w, "767"));
  CHECK(contains(w, "768"));
  CHECK_THROWS_AS(Workspace().require(l, "MyLoss"), Error);
  CHECK_NOTHROW(Workspace().require(WorkspaceLayout(), "MyLoss"));
}

TEST_CASE("AlignedBuffer (test support) gives aligned, filled, possibly empty blocks") {
  test::AlignedBuffer zero(0);
  CHECK(zero.data() != nullptr);
  CHECK(zero.bytes() == 0);
  CHECK_NOTHROW(zero.workspace());
  test::AlignedBuffer b(300, 0xab);
  CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % kWorkspaceAlignment == 0);
  CHECK(static_cast<unsigned char*>(b.data())[299] == 0xab);
  CHECK(b.workspace().bytes() == 300);
}

TEST_CASE("CpuContext") {
  const CpuContext all;
  CHECK(all.threads() >= 1);
  CHECK(all.device() == Device::kCpu);
  CHECK(all.device_index() == 0);
  const CpuContext three(3);
  CHECK(three.threads() == 3);
  const Context& base = three;
  CHECK(base.device() == Device::kCpu);
  CHECK_THROWS_AS(CpuContext(-1), Error);
  CHECK(contains(what_of([] { CpuContext(-2); }), "threads"));
  // (a count OpenMP cannot start: 100000 crashed the first call)
  CHECK(CpuContext(CpuContext::kMaxThreads).threads() == CpuContext::kMaxThreads);
  CHECK(contains(what_of([] { CpuContext(CpuContext::kMaxThreads + 1); }), "threads must be in"));
  CHECK(device_name(Device::kCpu) == "cpu");
  CHECK(device_name(Device::kCuda) == "cuda");
}

}  // namespace
}  // namespace chunkloss
