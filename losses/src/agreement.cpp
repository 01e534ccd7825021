// The first exchange of a call with groups (agreement.h).
#include "agreement.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "chunkloss/core/error.h"
#include "engine.h"

namespace chunkloss::detail {
namespace {

// One exchange over the group of `sum`: the ranks flagging `failed`, whether every rank sent the
// same `kind` (each value's sum and sum of squares are the ranks' count times its own and its
// square), and `sums` summed in place. Returns {failed ranks, same kind}. The kind's values
// (counts, sizes, flags, digests: integers >= 0) are compared modulo a prime below 2^20, so that
// the sums of squares stay exact in double over up to 8192 ranks.
std::pair<double, bool> exchange(const GroupSum& sum, bool failed, std::span<const double> kind,
                                 std::span<double> sums) {
  constexpr double kPrime = 1048573;  // the largest prime below 2^20
  const double ranks = sum.group ? sum.group->size() : 1;
  std::vector<double> reduced(kind.size());
  std::transform(kind.begin(), kind.end(), reduced.begin(),
                 [](double x) { return std::fmod(x, kPrime); });
  std::vector<double> v = {failed ? 1.0 : 0.0};
  for (double x : reduced) v.insert(v.end(), {x, x * x});
  v.insert(v.end(), sums.begin(), sums.end());
  sum(v.data(), v.size());
  bool same = true;
  for (std::size_t i = 0; i < reduced.size(); ++i) {
    const double x = reduced[i];
    same = same && v[1 + 2 * i] == ranks * x && v[2 + 2 * i] == ranks * x * x;
  }
  std::copy(v.end() - static_cast<std::ptrdiff_t>(sums.size()), v.end(), sums.begin());
  return {v[0], same};
}

// What went wrong with `count` failed ranks of `group` (count > 0), or with NaN: a rank took
// part with NaN values (an NcclCommunicator whose context is on another device).
std::string failed_ranks(double count, const char* group) {
  std::ostringstream os;
  if (std::isnan(count))
    os << "a rank of " << group
       << " could not take part (its context is not on its communicator's device)";
  else
    os << count << " rank(s) of " << group << " rejected their calls";
  return os.str();
}

}  // namespace

double kind_digest(std::span<const std::uint8_t> bytes) {
  constexpr std::uint64_t kPrime = 1048573;  // the largest prime below 2^20
  std::uint64_t h = 0;
  for (const std::uint8_t b : bytes) h = (h * 257 + b + 1) % kPrime;
  return static_cast<double>(h);
}

double kind_digest(std::span<const double> values) {
  return kind_digest({reinterpret_cast<const std::uint8_t*>(values.data()), values.size_bytes()});
}

void GroupSum::operator()(double* values, std::size_t n) const {
  if (group) all_reduce_host(ctx, *group, values, static_cast<std::int64_t>(n));
}

void agree_on_call(Context& ctx, const char* who, dist::Communicator* vocab_group,
                   dist::Communicator* data_group, std::exception_ptr rejected,
                   const FirstExchange& x) {
  if (!vocab_group && !data_group) {
    if (rejected) std::rethrow_exception(rejected);
    return;
  }
  // Whether the rank has a data group is part of its vocabulary kind: in a grid the data groups'
  // verdict goes back over the vocabulary group, a collective that every rank of it must make.
  std::vector<double> vocab_kind(x.vocab_kind.begin(), x.vocab_kind.end());
  vocab_kind.push_back(data_group ? 1.0 : 0.0);
  // A collective of this rank's that throws after taking part with NaN values (an
  // NcclCommunicator whose context is on another device) counts as a failed exchange whose
  // kinds differ, as its peers see it, and the rank goes on to the exchanges they make too.
  std::exception_ptr own;
  const auto guarded = [&](auto&& exchange_fn) -> std::pair<double, bool> {
    try {
      return exchange_fn();
    } catch (const Error&) {
      if (!own) own = std::current_exception();
      return {std::numeric_limits<double>::quiet_NaN(), false};
    }
  };
  double vocab_failed = 0;
  bool vocab_same = true;
  if (vocab_group)
    std::tie(vocab_failed, vocab_same) = guarded([&] {
      return exchange(GroupSum{ctx, vocab_group}, rejected != nullptr, vocab_kind, {});
    });
  double data_failed = 0;
  bool data_same = true;
  if (data_group)
    std::tie(data_failed, data_same) = guarded([&] {
      return exchange(GroupSum{ctx, data_group}, rejected || own || vocab_failed > 0 || !vocab_same,
                      x.data_kind, x.data_sums);
    });
  // (vocab_same, the same on every rank of the vocabulary group, says they all have one)
  double grid_failed = data_failed > 0 || !data_same ? 1 : 0;
  if (vocab_group && data_group && vocab_same)
    (void)guarded([&] {
      GroupSum{ctx, vocab_group}(&grid_failed, 1);
      return std::pair{0.0, true};
    });
  if (rejected) std::rethrow_exception(rejected);
  if (own) std::rethrow_exception(own);
  CHUNKLOSS_CHECK(vocab_failed == 0, who, ": ", failed_ranks(vocab_failed, "vocab_shard.group"),
                  "; this rank's call was valid, and nothing was written");
  // (a call without data_kind, SequenceLogProbs, never takes a data group)
  CHUNKLOSS_CHECK(vocab_same, who,
                  ": the ranks of vocab_shard.group make different kinds of calls (",
                  x.vocab_differs, x.data_kind.empty() ? "" : ", or whether they pass a data_group",
                  ", differ); nothing was written");
  CHUNKLOSS_CHECK(data_failed == 0, who, ": ", failed_ranks(data_failed, "data_group"),
                  "; this rank's call was valid, and nothing was written");
  CHUNKLOSS_CHECK(data_same, who, ": the ranks of data_group make different kinds of calls (",
                  x.data_differs, " differ); nothing was written");
  CHUNKLOSS_CHECK(grid_failed == 0, who,
                  ": a data group of another rank of vocab_shard.group rejected its calls; "
                  "nothing was written");
}

}  // namespace chunkloss::detail
