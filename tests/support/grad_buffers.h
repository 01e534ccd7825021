// Caller-owned gradient buffers of one dtype for the loss fixtures: hidden [N, H], weight
// [V, H] and bias [V], each present or not, viewed as the gradients struct of any loss.
#pragma once

#include <chunkloss/core/dtype.h>
#include <chunkloss/core/tensor.h>

#include <cstdint>
#include <vector>

namespace chunkloss::test {

class GradStorage {
 public:
  GradStorage(DType dtype, bool hidden, bool weight, bool bias, std::int64_t n, std::int64_t h,
              std::int64_t v, float fill);
  /// Fills the buffers with bf16-exact N(0, scale^2) values, one scale per buffer (hidden,
  /// weight, bias), for accumulate tests: scales near the gradients' own size keep the check
  /// sensitive to a missing or doubled contribution.
  void fill_random(std::uint64_t seed, double scale_h, double scale_w, double scale_b);
  /// Views of the present buffers in a gradients struct (hidden, weight, bias, accumulate).
  template <typename Grads>
  Grads views_as(bool accumulate) {
    Grads g;
    g.accumulate = accumulate;
    if (has_h_) g.hidden = hidden_view();
    if (has_w_) g.weight = weight_view();
    if (has_b_) g.bias = bias_view();
    return g;
  }
  std::vector<double> hidden() const;
  std::vector<double> weight() const;
  std::vector<double> bias() const;
  bool has_hidden() const { return has_h_; }
  bool has_weight() const { return has_w_; }
  bool has_bias() const { return has_b_; }
  /// Byte-exact equality of every buffer.
  bool bitwise_equal(const GradStorage& o) const;

 private:
  TensorView hidden_view();
  TensorView weight_view();
  TensorView bias_view();

  DType dtype_;
  bool has_h_, has_w_, has_b_;
  std::int64_t n_, h_, v_;
  std::vector<float> dh_, dw_, db_;
  std::vector<BFloat16> dh_bf_, dw_bf_, db_bf_;
};

}  // namespace chunkloss::test
