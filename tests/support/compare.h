// Comparisons for tests: relative norm error ||a - b|| / ||b||, and doctest checks that on
// failure name what was compared, the error, the tolerance, and the worst index with both values.
#pragma once

#include <chunkloss/core/dtype.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace chunkloss::test {

/// An index or size as a vector's size_t.
inline std::size_t sz(std::int64_t x) { return static_cast<std::size_t>(x); }

/// max(worst, d) that keeps a NaN: once either is NaN the result is NaN, so a later
/// `worst <= tol` fails (std::max(worst, NaN) returns worst, which would hide a NaN result).
inline double max_or_nan(double worst, double d) {
  return std::isnan(worst) || std::isnan(d) ? std::numeric_limits<double>::quiet_NaN()
                                            : std::max(worst, d);
}

inline double as_double(double x) { return x; }
inline double as_double(float x) { return x; }
inline double as_double(BFloat16 x) { return static_cast<float>(x); }
inline double as_double(std::int32_t x) { return static_cast<double>(x); }
inline double as_double(std::int64_t x) { return static_cast<double>(x); }

template <typename T>
std::vector<double> to_double(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = as_double(v[i]);
  return out;
}

/// ||got - want||_2 / ||want||_2; ||got - want||_2 when `want` is all zero. NaN if either holds
/// a NaN; +inf when the sizes differ.
double rel_norm_error(const std::vector<double>& got, const std::vector<double>& want);

/// Index of the largest |got - want| (a NaN difference counts as the largest); -1 when empty.
std::int64_t worst_index(const std::vector<double>& got, const std::vector<double>& want);

/// CHECKs rel_norm_error(got, want) <= tol. On failure the message names `what`, the error, the
/// tolerance, the sizes and the worst index with both values. Returns the error.
double check_close(std::string_view what, const std::vector<double>& got,
                   const std::vector<double>& want, double tol);

template <typename T, typename U>
double check_close(std::string_view what, const std::vector<T>& got, const std::vector<U>& want,
                   double tol) {
  return check_close(what, to_double(got), to_double(want), tol);
}

/// CHECKs ||got - want||_2 <= tol * scale: for values that are small differences of larger
/// terms (scale = the norm of those terms), whose rounding is relative to the terms. Reports
/// like check_close. Returns ||got - want||_2 / scale.
double check_close_scaled(std::string_view what, const std::vector<double>& got,
                          const std::vector<double>& want, double scale, double tol);

/// CHECKs |got - want| <= tol * max(|want|, 1): relative for large values, absolute near zero;
/// equal infinities pass.
void check_scalar(std::string_view what, double got, double want, double tol);

/// CHECKs every element equals `value` exactly (e.g. zero gradients); reports the first offender.
void check_all_equal(std::string_view what, const std::vector<double>& got, double value);

/// A split call's lse (a rank's rows) against the unsplit call's same rows: with
/// skip_ignored_rows either side may skip (NaN) rows the other computes, as a rank skips its own
/// leading and trailing ignored rows, but only ignored ones (ignored[i]); the rows both computed
/// agree to `tol` (check_close).
void check_lse_where_computed(const std::vector<float>& got, const std::vector<float>& want,
                              const std::vector<bool>& ignored, double tol);

/// True when two buffers have the same size and identical bytes (memcmp).
template <typename T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

}  // namespace chunkloss::test
