// The lm_head split by rows over the ranks of a group (vocabulary parallelism), as the loss
// objects take it.
#pragma once

#include <cstdint>

#include "chunkloss/dist/communicator.h"

namespace chunkloss {

/// Vocabulary parallelism: the lm_head is split by rows over the K ranks of `group`, rank r
/// holding weight rows [offset, offset + V_local) = [size r / K, size (r + 1) / K) of a
/// vocabulary of `size` (checked, so every rank plans the same chunks). Each chunk's row
/// statistics are all-gathered and merged in rank order and its dH rows all-reduced in fp32, so
/// every rank gets the same row results and dH, and the dW and db of its own shard. The calls
/// run in token-chunk order. Every rank must make the call.
struct VocabShard {
  dist::Communicator* group = nullptr;  ///< null: the weight is the whole vocabulary
  std::int64_t offset = 0;              ///< first vocabulary row of this rank's weight
  std::int64_t size = 0;                ///< the whole vocabulary

  /// The shard rank r of `group` holds of a vocabulary of `size`: rows [size r / K,
  /// size (r + 1) / K) (null group: the unset shard).
  static VocabShard of(dist::Communicator* group, std::int64_t size) {
    if (!group) return {};
    return {group, size * group->rank() / group->size(), size};
  }
  /// One past the last row of the shard rank r of the group holds: size (r + 1) / K (the unset
  /// shard: size).
  std::int64_t end() const { return group ? size * (group->rank() + 1) / group->size() : size; }
};

}  // namespace chunkloss
