// Seeded shuffling: permutations, run-to-run and epoch determinism, no modulo bias, and the
// BatchSampler's coverage, drop_last and ordering rules.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/data/sampler.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "expect_error.h"

namespace chunkloss::test {
namespace {

using data::BatchSampler;
using data::shuffled_indices;

bool is_permutation_of_iota(std::vector<std::size_t> v) {
  std::sort(v.begin(), v.end());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (v[i] != i) return false;
  }
  return true;
}

TEST_CASE("shuffle: a deterministic permutation per seed") {
  for (std::size_t n : {0u, 1u, 2u, 7u, 100u}) {
    const auto a = shuffled_indices(n, 42);
    CHECK(a.size() == n);
    CHECK(is_permutation_of_iota(a));
    CHECK(a == shuffled_indices(n, 42));
  }
  CHECK(shuffled_indices(100, 1) != shuffled_indices(100, 2));
  std::vector<std::size_t> identity(100);
  std::iota(identity.begin(), identity.end(), std::size_t{0});
  CHECK(shuffled_indices(100, 3) != identity);
  // Pins the algorithm: the expected permutation was computed by an independent Python
  // implementation of std::mt19937_64 and the documented rejection-sampled Fisher-Yates.
  CHECK(shuffled_indices(10, 7) == std::vector<std::size_t>{0, 7, 4, 9, 3, 1, 2, 8, 6, 5});
}

TEST_CASE("shuffle: each element lands in each position about equally often") {
  constexpr std::size_t n = 5, trials = 20000;
  std::vector<std::size_t> counts(n * n, 0);
  for (std::size_t s = 0; s < trials; ++s) {
    const auto p = shuffled_indices(n, s);
    for (std::size_t pos = 0; pos < n; ++pos) ++counts[p[pos] * n + pos];
  }
  const double expected = static_cast<double>(trials) / n;
  for (std::size_t c : counts) {
    CHECK(std::abs(static_cast<double>(c) - expected) < 0.06 * expected);
  }
}

TEST_CASE("BatchSampler: every index once per epoch, epochs differ, reruns agree") {
  const BatchSampler s(23, 5, 99);
  CHECK(s.batches_per_epoch() == 5);
  const auto e0 = s.epoch(0), e1 = s.epoch(1);
  REQUIRE(e0.size() == 5);
  CHECK(e0.back().size() == 3);
  std::vector<std::size_t> all;
  for (const auto& b : e0) all.insert(all.end(), b.begin(), b.end());
  CHECK(all.size() == 23);
  CHECK(is_permutation_of_iota(all));
  CHECK(e0 != e1);
  CHECK(e0 == BatchSampler(23, 5, 99).epoch(0));
  CHECK(e1 == s.epoch(1));
  CHECK(e0 != BatchSampler(23, 5, 100).epoch(0));
}

TEST_CASE("BatchSampler: drop_last, no shuffle, and argument errors") {
  const BatchSampler dl(23, 5, 1, true, true);
  CHECK(dl.batches_per_epoch() == 4);
  for (const auto& b : dl.epoch(3)) CHECK(b.size() == 5);
  const BatchSampler ordered(7, 3, 1, false);
  const auto e = ordered.epoch(5);
  REQUIRE(e.size() == 3);
  CHECK(e[0] == std::vector<std::size_t>{0, 1, 2});
  CHECK(e[2] == std::vector<std::size_t>{6});
  // A batch size near the largest size_t is one batch of all the examples.
  const BatchSampler huge(3, std::numeric_limits<std::size_t>::max(), 1, false);
  REQUIRE(huge.batches_per_epoch() == 1);
  CHECK(huge.epoch(0) == std::vector<std::vector<std::size_t>>{{0, 1, 2}});
  CHECK(contains(error_message([] { BatchSampler(0, 1, 0); }), "no examples"));
  CHECK(contains(error_message([] { BatchSampler(3, 0, 0); }), "batch_size"));
  CHECK(contains(error_message([] { BatchSampler(3, 4, 0, true, true); }), "leaves no batch"));
}

}  // namespace
}  // namespace chunkloss::test
