// Relative norm errors and failure reports with the worst index.
#include "support/compare.h"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <sstream>

namespace chunkloss::test {

double rel_norm_error(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    ref += want[i] * want[i];
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

std::int64_t worst_index(const std::vector<double>& got, const std::vector<double>& want) {
  std::int64_t worst = -1;
  double worst_d = -1;
  for (std::size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    double d = std::abs(got[i] - want[i]);
    if (std::isnan(d)) d = std::numeric_limits<double>::infinity();
    if (d > worst_d) {
      worst_d = d;
      worst = static_cast<std::int64_t>(i);
    }
  }
  return worst;
}

double check_close(std::string_view what, const std::vector<double>& got,
                   const std::vector<double>& want, double tol) {
  const double err = rel_norm_error(got, want);
  const bool ok = err <= tol;  // false for NaN
  if (!ok) {
    std::ostringstream os;
    os.precision(9);
    os << what << ": relative norm error " << err << " > tolerance " << tol << " (sizes "
       << got.size() << " vs " << want.size() << ")";
    const std::int64_t w = worst_index(got, want);
    if (w >= 0) {
      const auto i = static_cast<std::size_t>(w);
      os << "; worst index " << w << ": got " << got[i] << ", want " << want[i];
    }
    FAIL_CHECK(os.str());
  } else {
    CHECK(ok);
  }
  return err;
}

double check_close_scaled(std::string_view what, const std::vector<double>& got,
                          const std::vector<double>& want, double scale, double tol) {
  double diff = std::numeric_limits<double>::infinity();
  if (got.size() == want.size()) {
    diff = 0;
    for (std::size_t i = 0; i < got.size(); ++i) diff += (got[i] - want[i]) * (got[i] - want[i]);
    diff = std::sqrt(diff);
  }
  const double err = scale > 0 ? diff / scale : diff;
  const bool ok = err <= tol;  // false for NaN
  if (!ok) {
    std::ostringstream os;
    os.precision(9);
    os << what << ": error norm " << diff << " / scale " << scale << " = " << err << " > tolerance "
       << tol << " (sizes " << got.size() << " vs " << want.size() << ")";
    const std::int64_t w = worst_index(got, want);
    if (w >= 0) {
      const auto i = static_cast<std::size_t>(w);
      os << "; worst index " << w << ": got " << got[i] << ", want " << want[i];
    }
    FAIL_CHECK(os.str());
  } else {
    CHECK(ok);
  }
  return err;
}

void check_scalar(std::string_view what, double got, double want, double tol) {
  const double bound = tol * std::max(std::abs(want), 1.0);
  const bool ok = got == want || std::abs(got - want) <= bound;  // (infinities of one sign)
  if (!ok) {
    std::ostringstream os;
    os.precision(12);
    os << what << ": got " << got << ", want " << want << " (|diff| " << std::abs(got - want)
       << " > " << bound << ")";
    FAIL_CHECK(os.str());
  } else {
    CHECK(ok);
  }
}

void check_all_equal(std::string_view what, const std::vector<double>& got, double value) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!(got[i] == value)) {
      std::ostringstream os;
      os << what << ": element " << i << " is " << got[i] << ", want exactly " << value << " ("
         << got.size() << " elements)";
      FAIL_CHECK(os.str());
      return;
    }
  }
  CHECK(true);
}

void check_lse_where_computed(const std::vector<float>& got, const std::vector<float>& want,
                              const std::vector<bool>& ignored, double tol) {
  REQUIRE(got.size() == want.size());
  REQUIRE(ignored.size() == want.size());
  std::vector<double> a, b;
  std::int64_t skipped_valid = -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isnan(got[i]) && !std::isnan(want[i])) {
      a.push_back(got[i]);
      b.push_back(want[i]);
    } else if (!ignored[i] && skipped_valid < 0) {
      skipped_valid = static_cast<std::int64_t>(i);
    }
  }
  if (skipped_valid >= 0) FAIL_CHECK("lse: row " << skipped_valid << " is valid but NaN");
  check_close("lse (rows both computed)", a, b, tol);
}

}  // namespace chunkloss::test
