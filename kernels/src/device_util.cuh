// Device helpers shared by the kernels: element loads/stores as fp32 for f32 and bf16 storage,
// 16-byte vector access of a row, and the target lookup.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "chunkloss/kernels/token_epilogue.h"

namespace chunkloss::kern {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

/// VEC elements of T per 16 bytes.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

/// 16-byte loads each thread of a row-walking kernel issues before using any: under the H200's
/// power cap (SM clock about 1.4 GHz) one load per thread left the row kernels at about half
/// of the DRAM bandwidth.
constexpr int kLoads = 4;

/// Loads VEC consecutive elements starting at p[j] as floats: one 16-byte load when `vec`
/// (row aligned and j + VEC <= n), else element by element with a bounds check.
template <typename T>
__device__ __forceinline__ void load_floats(const T* p, std::int64_t j, std::int64_t n, bool vec,
                                            float (&out)[kVec<T>]) {
  if (vec && j + kVec<T> <= n) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p + j);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < kVec<T>; ++k) out[k] = to_float(e[k]);
  } else {
#pragma unroll
    for (int k = 0; k < kVec<T>; ++k) out[k] = j + k < n ? to_float(p[j + k]) : 0.0f;
  }
}

/// Stores COUNT floats at p[j..] as T, vectorised when the address is aligned.
template <typename T, int COUNT>
__device__ __forceinline__ void store_floats(T* p, std::int64_t j, std::int64_t n, bool vec,
                                             const float (&in)[COUNT]) {
  constexpr int kBytes = COUNT * sizeof(T);
  if (vec && j + COUNT <= n && (kBytes == 16 || kBytes == 8)) {
    T e[COUNT];
#pragma unroll
    for (int k = 0; k < COUNT; ++k) e[k] = from_float<T>(in[k]);
    if constexpr (kBytes == 16) {
      *reinterpret_cast<uint4*>(p + j) = *reinterpret_cast<const uint4*>(e);
    } else if constexpr (kBytes == 8) {
      *reinterpret_cast<uint2*>(p + j) = *reinterpret_cast<const uint2*>(e);
    }
  } else {
#pragma unroll
    for (int k = 0; k < COUNT; ++k)
      if (j + k < n) p[j + k] = from_float<T>(in[k]);
  }
}

__device__ __forceinline__ std::int64_t target_at(const TokenParams& p, std::int64_t t) {
  return p.targets_i64 ? static_cast<const std::int64_t*>(p.targets)[t]
                       : static_cast<const std::int32_t*>(p.targets)[t];
}

/// Target of row t, or ignore_index for ignored or out-of-range targets.
__device__ __forceinline__ std::int64_t valid_target(const TokenParams& p, std::int64_t t) {
  const std::int64_t y = target_at(p, t);
  return (y >= 0 && y < p.vocab_total) ? y : p.ignore_index;
}

__device__ __forceinline__ bool is_valid(const TokenParams& p, std::int64_t y) {
  return y != p.ignore_index && y >= 0 && y < p.vocab_total;
}

/// The call's inputs hold values it refuses (targets outside [0, V) or bad class weights,
/// counted by launch_token_begin and summed over a data group before any row is computed): every
/// row's gradient coefficients are then 0 and no per-row output is written, so the call adds
/// nothing to the caller's gradient buffers before it throws. (check_finite's counts are read on
/// the host before any row, and a call with any throws there.)
__device__ __forceinline__ bool refused_call(const TokenParams& p) {
  return p.scalars[kBadTargets] + p.scalars[kBadClassWeights] != 0;
}

/// Class weight of column j of the call's weight (1 without class weights).
__device__ __forceinline__ float class_weight_at(const TokenParams& p, std::int64_t j) {
  return p.class_weights ? p.class_weights[p.vocab_offset + j] : 1.0f;
}

__device__ __forceinline__ float bias_at(const TokenParams& p, std::int64_t j) {
  if (!p.bias) return 0.0f;
  return p.bias_elem == Elem::kF32 ? static_cast<const float*>(p.bias)[j]
                                   : __bfloat162float(static_cast<const __nv_bfloat16*>(p.bias)[j]);
}

/// True when a call has none of bias, softcap, class weights and label smoothing: the kernels
/// then take a lean path (BOOL_SWITCH-style dispatch) whose results agree with the general
/// path's to rounding, not bitwise (its sums are rescaled once a vector). Entropy does not
/// leave it, so reporting it changes no other result.
inline bool plain_rows(const TokenParams& p) {
  return !p.bias && p.softcap == 0.0f && !p.class_weights && p.rule.eps == 0.0f;
}

/// Dispatches a runtime flag to a compile-time constant named by `name` inside the body.
#define CHUNKLOSS_BOOL_SWITCH(cond, name, ...) \
  [&] {                                        \
    if (cond) {                                \
      constexpr bool name = true;              \
      return __VA_ARGS__();                    \
    } else {                                   \
      constexpr bool name = false;             \
      return __VA_ARGS__();                    \
    }                                          \
  }()

__host__ __device__ inline bool aligned16(const void* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}

}  // namespace chunkloss::kern
