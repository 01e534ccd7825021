// Gradient buffers shared by the loss fixtures.
#include "support/grad_buffers.h"

#include <initializer_list>

#include "support/bf16.h"
#include "support/compare.h"
#include "support/random.h"

namespace chunkloss::test {

GradStorage::GradStorage(DType dtype, bool hidden, bool weight, bool bias, std::int64_t n,
                         std::int64_t h, std::int64_t v, float fill)
    : dtype_(dtype), has_h_(hidden), has_w_(weight), has_b_(bias), n_(n), h_(h), v_(v) {
  if (dtype_ == DType::kBF16) {
    if (has_h_) dh_bf_.assign(sz(n * h), BFloat16(fill));
    if (has_w_) dw_bf_.assign(sz(v * h), BFloat16(fill));
    if (has_b_) db_bf_.assign(sz(v), BFloat16(fill));
  } else {
    if (has_h_) dh_.assign(sz(n * h), fill);
    if (has_w_) dw_.assign(sz(v * h), fill);
    if (has_b_) db_.assign(sz(v), fill);
  }
}

void GradStorage::fill_random(std::uint64_t seed, double scale_h, double scale_w, double scale_b) {
  auto fill = [&](std::vector<float>& f, std::vector<BFloat16>& b, std::uint64_t s, double sc) {
    const std::size_t n = dtype_ == DType::kBF16 ? b.size() : f.size();
    std::vector<float> r = normal_floats(n, static_cast<float>(sc), s);
    round_to_bf16_inplace(r);
    if (dtype_ == DType::kBF16)
      b = to_bf16(r);
    else
      f = r;
  };
  fill(dh_, dh_bf_, seed + 1, scale_h);
  fill(dw_, dw_bf_, seed + 2, scale_w);
  fill(db_, db_bf_, seed + 3, scale_b);
}

namespace {

TensorView view(DType dtype, std::vector<float>& f, std::vector<BFloat16>& b,
                std::initializer_list<std::int64_t> shape) {
  return dtype == DType::kBF16 ? TensorView::of(b.data(), shape) : TensorView::of(f.data(), shape);
}

}  // namespace

TensorView GradStorage::hidden_view() { return view(dtype_, dh_, dh_bf_, {n_, h_}); }
TensorView GradStorage::weight_view() { return view(dtype_, dw_, dw_bf_, {v_, h_}); }
TensorView GradStorage::bias_view() { return view(dtype_, db_, db_bf_, {v_}); }

std::vector<double> GradStorage::hidden() const {
  return dtype_ == DType::kBF16 ? to_double(dh_bf_) : to_double(dh_);
}
std::vector<double> GradStorage::weight() const {
  return dtype_ == DType::kBF16 ? to_double(dw_bf_) : to_double(dw_);
}
std::vector<double> GradStorage::bias() const {
  return dtype_ == DType::kBF16 ? to_double(db_bf_) : to_double(db_);
}

bool GradStorage::bitwise_equal(const GradStorage& o) const {
  using test::bitwise_equal;
  return bitwise_equal(dh_, o.dh_) && bitwise_equal(dw_, o.dw_) && bitwise_equal(db_, o.db_) &&
         bitwise_equal(dh_bf_, o.dh_bf_) && bitwise_equal(dw_bf_, o.dw_bf_) &&
         bitwise_equal(db_bf_, o.db_bf_);
}

}  // namespace chunkloss::test
