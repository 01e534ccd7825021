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

// The two largest primes below 2^20. The kinds' values (counts, sizes, flags, digests: integers
// >= 0) are compared by their residues modulo each, so that two different values pass only when
// they agree modulo the product (about 2^40), and the sums of squares stay exact in double over
// up to 8192 ranks.
constexpr std::uint64_t kPrimes[] = {1048573, 1048571};

// An exception's message.
std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
  }
  return "an exception that is not a std::exception";
}

constexpr std::size_t kMaxShared = 1000;  // bytes of a message first_failure shares

// Once an exchange over `sum`'s group has counted failed ranks (so every rank of the group
// makes these two collectives): the lowest failed rank and its message, as flags summed over the
// group, then the message's bytes as values that the other ranks add zeros to (exact sums).
std::string first_failure(const GroupSum& sum, const std::string* mine) {
  const auto ranks = static_cast<std::size_t>(sum.group->size());
  std::vector<double> flags(ranks);
  flags[static_cast<std::size_t>(sum.group->rank())] = mine ? 1.0 : 0.0;
  sum(flags.data(), flags.size());
  const auto first = static_cast<std::size_t>(
      std::find_if(flags.begin(), flags.end(), [](double f) { return f > 0; }) - flags.begin());
  std::vector<double> bytes(kMaxShared + 1);  // the length, then the bytes
  if (mine && first == static_cast<std::size_t>(sum.group->rank())) {
    const std::string cut =
        mine->size() > kMaxShared ? mine->substr(0, kMaxShared - 3) + "..." : *mine;
    bytes[0] = static_cast<double>(cut.size());
    for (std::size_t i = 0; i < cut.size(); ++i) bytes[i + 1] = static_cast<unsigned char>(cut[i]);
  }
  sum(bytes.data(), bytes.size());
  // (NaN values, from a rank that took part with them, read as an empty message or '?')
  const double length = bytes[0] >= 0 && bytes[0] <= kMaxShared ? bytes[0] : 0;
  std::string m(static_cast<std::size_t>(length), '?');
  for (std::size_t i = 0; i < m.size(); ++i)
    if (bytes[i + 1] >= 1 && bytes[i + 1] <= 255)
      m[i] = static_cast<char>(static_cast<unsigned char>(bytes[i + 1]));
  return first < ranks ? "rank " + std::to_string(first) + ": " + m : m;
}

// What went wrong with `count` failed ranks of `group` (count > 0; `first`: the first one's
// message), or with NaN: a rank took part with NaN values (an NcclCommunicator whose context is
// on another device).
std::string failed_ranks(double count, const char* group, const std::string& first) {
  std::ostringstream os;
  if (std::isnan(count))
    os << "a rank of " << group
       << " could not take part (its context is not on its communicator's device)";
  else
    os << count << " rank(s) of " << group << " rejected their calls (" << first << ")";
  return os.str();
}

}  // namespace

double kind_digest(std::span<const std::uint8_t> bytes) {
  // A polynomial hash modulo the product of the primes (below 2^40, so exact in double, and
  // told apart by its two residues).
  constexpr std::uint64_t kModulus = kPrimes[0] * kPrimes[1];
  std::uint64_t h = 0;
  for (const std::uint8_t b : bytes) h = (h * 257 + b + 1) % kModulus;  // (h * 257 < 2^49)
  return static_cast<double>(h);
}

double kind_digest(std::span<const double> values) {
  return kind_digest({reinterpret_cast<const std::uint8_t*>(values.data()), values.size_bytes()});
}

// Each residue's sum and sum of squares over the group are the ranks' count times its own and
// its square when every rank sent the same kind.
std::pair<double, bool> exchange(const GroupSum& sum, bool failed, std::span<const double> kind,
                                 std::span<double> sums) {
  const double ranks = sum.group ? sum.group->size() : 1;
  std::vector<double> residues;
  for (const double x : kind)
    for (const std::uint64_t p : kPrimes) residues.push_back(std::fmod(x, static_cast<double>(p)));
  std::vector<double> v = {failed ? 1.0 : 0.0};
  for (const double x : residues) v.insert(v.end(), {x, x * x});
  v.insert(v.end(), sums.begin(), sums.end());
  sum(v.data(), v.size());
  bool same = true;
  for (std::size_t i = 0; i < residues.size(); ++i) {
    const double x = residues[i];
    same = same && v[1 + 2 * i] == ranks * x && v[2 + 2 * i] == ranks * x * x;
  }
  std::copy(v.end() - static_cast<std::ptrdiff_t>(sums.size()), v.end(), sums.begin());
  return {v[0], same};
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
  // Each failed exchange then shares its first failed rank's message (a failed count that is
  // not NaN is the same on every rank of the group).
  const std::string mine = rejected ? message_of(rejected) : std::string();
  const auto share = [&](dist::Communicator* group, const std::string* failure) {
    std::string first;
    (void)guarded([&] {
      first = first_failure(GroupSum{ctx, group}, failure);
      return std::pair{0.0, true};
    });
    return first;
  };
  double vocab_failed = 0;
  bool vocab_same = true;
  std::string vocab_first;
  if (vocab_group) {
    std::tie(vocab_failed, vocab_same) = guarded([&] {
      return exchange(GroupSum{ctx, vocab_group}, rejected != nullptr, vocab_kind, {});
    });
    if (vocab_failed > 0) vocab_first = share(vocab_group, rejected ? &mine : nullptr);
  }
  double data_failed = 0;
  bool data_same = true;
  std::string data_first;
  if (data_group) {
    const bool failed = rejected || own || vocab_failed > 0 || !vocab_same;
    std::tie(data_failed, data_same) = guarded([&] {
      return exchange(GroupSum{ctx, data_group}, failed, x.data_kind, x.data_sums);
    });
    if (data_failed > 0) {
      // (a rank that failed for its vocabulary group's sake shares what its group found)
      const std::string why = rejected ? mine
                              : own    ? message_of(own)
                              : vocab_failed != 0
                                  ? "in its vocab_shard.group, " +
                                        failed_ranks(vocab_failed, "vocab_shard.group", vocab_first)
                                  : "its vocab_shard.group's ranks make different kinds of calls";
      data_first = share(data_group, failed ? &why : nullptr);
    }
  }
  // (vocab_same, the same on every rank of the vocabulary group, says they all have one)
  const bool data_failed_here = data_failed > 0 || !data_same;
  double grid_failed = data_failed_here ? 1 : 0;
  std::string grid_first;
  if (vocab_group && data_group && vocab_same) {
    (void)guarded([&] {
      GroupSum{ctx, vocab_group}(&grid_failed, 1);
      return std::pair{0.0, true};
    });
    if (grid_failed > 0) {
      // what this rank's data group found, for the ranks whose own data group found nothing
      const std::string found = data_failed != 0
                                    ? failed_ranks(data_failed, "data_group", data_first)
                                    : "the ranks of its data_group make different kinds of calls";
      grid_first = share(vocab_group, data_failed_here ? &found : nullptr);
    }
  }
  if (rejected) std::rethrow_exception(rejected);
  if (own) std::rethrow_exception(own);
  CHUNKLOSS_CHECK(vocab_failed == 0, who, ": ",
                  failed_ranks(vocab_failed, "vocab_shard.group", vocab_first),
                  "; this rank's call was valid, and nothing was written");
  // (a call without data_kind, SequenceLogProbs, never takes a data group)
  CHUNKLOSS_CHECK(vocab_same, who,
                  ": the ranks of vocab_shard.group make different kinds of calls (",
                  x.vocab_differs, x.data_kind.empty() ? "" : ", or whether they pass a data_group",
                  ", differ); nothing was written");
  CHUNKLOSS_CHECK(data_failed == 0, who, ": ", failed_ranks(data_failed, "data_group", data_first),
                  "; this rank's call was valid, and nothing was written");
  CHUNKLOSS_CHECK(data_same, who, ": the ranks of data_group make different kinds of calls (",
                  x.data_differs, " differ); nothing was written");
  CHUNKLOSS_CHECK(grid_failed == 0, who,
                  ": the data group of another rank of vocab_shard.group failed (", grid_first,
                  "); nothing was written");
}

}  // namespace chunkloss::detail
