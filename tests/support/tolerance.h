// The one tolerance table, per dtype. Values are relative norm errors ||a - b|| / ||b|| against
// the float64 oracle. `loss`/`rows` apply by the input dtype (hidden, weight), `grad` by the
// dtype of the gradient buffer being compared: on the CPU bf16 inputs are widened exactly to
// fp32, so only bf16 storage of a gradient (rounded once, or once per chunk) loses precision.
#pragma once

#include <chunkloss/core/dtype.h>

namespace chunkloss::test {

struct Tolerance {
  double
      loss;  ///< scalar loss, z-loss part, entropy (relative, with `loss` also as absolute floor)
  double rows;  ///< per-row outputs: row_loss, lse
  double grad;  ///< dH, dW, db
  /// Two plans of one call (other chunk rows, vocab blocks or thread counts) agree to this:
  /// only the order of fp32 sums differs (plus the final rounding of a bf16 buffer).
  double chunking;
};

inline Tolerance tolerance(DType t) {
  switch (t) {
    case DType::kBF16:
      return {1e-5, 1e-5, 1e-2, 4e-3};
    default:
      return {1e-5, 1e-5, 1e-5, 1e-6};
  }
}

/// Finite differences of the library's fp32 loss (step 1e-2 on O(1) values, so fp32 rounding of
/// the loss and the O(step^2) truncation stay near 1e-5): |fd - analytic| <= kFdAbs + kFdRel *
/// |analytic|. Observed errors pass at a fifth of these bounds.
inline constexpr double kFdAbs = 5e-4;
inline constexpr double kFdRel = 5e-3;

}  // namespace chunkloss::test
