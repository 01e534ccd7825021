// Element types of tensor views, and the bf16 storage type with round-to-nearest-even
// conversion. bf16 is storage only: all arithmetic in the library happens in fp32 or wider.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace chunkloss {

/// Element type of a tensor view.
enum class DType : std::uint8_t { kF32, kBF16, kI32, kI64 };

/// Bytes per element.
constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kI64:
      return 8;
  }
  return 0;
}

/// Lower-case name ("f32", "bf16", "i32", "i64").
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
  }
  return "?";
}

constexpr bool is_floating(DType t) { return t == DType::kF32 || t == DType::kBF16; }

/// bfloat16 storage: the upper 16 bits of an IEEE float32, same layout as __nv_bfloat16.
struct BFloat16 {
  std::uint16_t bits = 0;

  BFloat16() = default;
  /// Round to nearest even; NaN stays NaN.
  explicit BFloat16(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<std::uint16_t>((u >> 16) | 0x40u);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = static_cast<std::uint16_t>(u >> 16);
    }
  }
  explicit operator float() const {
    std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static_assert(sizeof(BFloat16) == 2);

/// Rounds a float to the nearest bf16 value and back.
inline float round_to_bf16(float f) { return static_cast<float>(BFloat16(f)); }

}  // namespace chunkloss
