// bf16 helpers for tests: round float data to bf16-representable values, convert between float
// and BFloat16 storage, and read bit patterns.
#pragma once

#include <chunkloss/core/dtype.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace chunkloss::test {

/// Rounds every element to the nearest bf16 value (round to nearest even), in place.
inline void round_to_bf16_inplace(std::vector<float>& v) {
  for (float& x : v) x = round_to_bf16(x);
}

inline std::vector<BFloat16> to_bf16(const std::vector<float>& v) {
  std::vector<BFloat16> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = BFloat16(v[i]);
  return out;
}

inline std::vector<float> from_bf16(const std::vector<BFloat16>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(v[i]);
  return out;
}

inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace chunkloss::test
