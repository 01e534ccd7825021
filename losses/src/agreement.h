// The first exchange of a call with groups of ranks: before any of the call's collectives, its
// ranks agree whether any of them rejected its call and whether they all make the same kind of
// call, so that every rank throws instead of the others waiting for one that threw.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <utility>

#include "chunkloss/core/context.h"
#include "chunkloss/dist/communicator.h"

namespace chunkloss::detail {

/// What the ranks compare and sum in their first exchange.
struct FirstExchange {
  std::span<const double> vocab_kind;  ///< must be equal on every rank of the vocabulary group
  std::span<const double> data_kind;   ///< must be equal on every rank of the data group
  std::span<double> data_sums;         ///< summed in place over the data group
  const char* vocab_differs = "";      ///< for the message: what the vocab kind holds
  const char* data_differs = "";       ///< ... and the data kind
};

/// A digest of bytes for a kind (below 2^40, as the exchange compares kinds) ...
double kind_digest(std::span<const std::uint8_t> bytes);
/// ... and of values' bytes.
double kind_digest(std::span<const double> values);

/// Sums host values over a group's ranks (a null group: unchanged); on CUDA through the
/// context's scratch memory.
struct GroupSum {
  Context& ctx;
  dist::Communicator* group;
  void operator()(double* values, std::size_t n) const;
};

/// One exchange over `sum`'s group: the number of ranks flagging `failed`, whether every rank
/// sent the same `kind` (integers >= 0 below 2^40: counts, sizes, flags, digests), and `sums`
/// summed in place. Returns {failed ranks, same kind}.
std::pair<double, bool> exchange(const GroupSum& sum, bool failed, std::span<const double> kind,
                                 std::span<double> sums);

/// The ranks of `vocab_group`, then of `data_group` (either may be null; both: a grid, whose
/// data groups each hold one rank of every vocabulary group), exchange whether they `rejected`
/// their call and their kinds (the vocabulary group's kind also holds whether the rank passes a
/// data group); in a grid the data group's verdict then goes back over the vocabulary group. On
/// CUDA the values pass through the context's scratch memory, not the workspace, so a rank whose
/// workspace is wrong takes part too. Then rethrows `rejected`, or throws when any rank of the
/// groups rejected its call (naming the group, and the first such rank of it with its message,
/// which two more exchanges share; in a grid a rank whose data group agreed quotes, the same
/// way, what a failed one found) or the kinds differ, naming the group; else returns with
/// x.data_sums summed over the data group. Without groups it only rethrows `rejected`.
/// The groups' collectives must either complete on every rank or, on a rank where one throws,
/// have taken part with NaN values (as NcclCommunicator does for a context on another device):
/// a rank whose collective throws after taking part with valid values (its device failing
/// between the sum and the copy back) leaves the others waiting in the message exchanges.
void agree_on_call(Context& ctx, const char* who, dist::Communicator* vocab_group,
                   dist::Communicator* data_group, std::exception_ptr rejected,
                   const FirstExchange& x);

}  // namespace chunkloss::detail
