// Per-row arrays of the engine, carved from the plan's row_stats slice (9 x N x 4 bytes):
// lse, the scaled gradient coefficients a, b, g, the row loss and its z-loss part, the entropy,
// the logit sum (sequence objectives' metrics) and the first argmax.
#pragma once

#include <cstdint>

namespace chunkloss::detail {

struct RowArrays {
  float *lse, *a, *b, *g, *loss, *zloss, *entropy, *zsum;
  std::int32_t* argmax;

  static RowArrays carve(float* base, std::int64_t n) {
    RowArrays r{};
    float** slots[] = {&r.lse, &r.a, &r.b, &r.g, &r.loss, &r.zloss, &r.entropy, &r.zsum};
    std::int64_t i = 0;
    for (float** s : slots) *s = base + n * i++;
    r.argmax = reinterpret_cast<std::int32_t*>(base + n * i);
    return r;
  }
};

}  // namespace chunkloss::detail
