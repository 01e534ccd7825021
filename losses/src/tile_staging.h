// Where the CUDA backend stages rows next to a full-width fp32 logits tile whose gradient is
// bf16: the gradient row overwrites the first half of its fp32 row, so the second half is free
// for that row's fp32 dH (before its row scale) and its scaled bf16 X row. Shared by the plan
// (which then reserves no staging for them) and the backend (which then uses it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "chunkloss/core/dtype.h"

namespace chunkloss::detail {

/// Byte offset, within an fp32 logits row of `vocab` columns, of the free second half (16-byte
/// aligned).
inline std::size_t tile_free_offset(std::int64_t vocab) {
  return (static_cast<std::size_t>(vocab) * 2 + 15) / 16 * 16;
}

/// Whether each row's free half holds H fp32 values and H bf16 values.
inline bool staging_fits_tile(std::int64_t vocab, std::int64_t hidden, DType logits, DType input) {
  return logits == DType::kF32 && input == DType::kBF16 &&
         static_cast<std::size_t>(vocab) * 4 >=
             tile_free_offset(vocab) + static_cast<std::size_t>(hidden) * 6;
}

/// Whether the backend stages in the tile: the staging fits and the vocabulary is not split
/// (every rank of a split must reserve the same staging, and its shards differ by a row).
inline bool stages_in_tile(std::int64_t vocab, std::int64_t hidden, DType logits, DType input,
                           int vocab_ranks) {
  return vocab_ranks == 1 && staging_fits_tile(vocab, hidden, logits, input);
}

/// Without row scales: whether a packed chunk's one dH GEMM writes its fp32 rows in staging
/// because the tile has no free halves for them (staging_fits_tile: fp32 inputs, a bf16 logits
/// chunk, or a vocabulary below about 3 H); a split vocabulary's chunks take their dH rows
/// through the exchange buffers instead.
inline bool packed_dh_in_staging(std::int64_t vocab, std::int64_t hidden, DType logits, DType input,
                                 int vocab_ranks) {
  return vocab_ranks == 1 && !staging_fits_tile(vocab, hidden, logits, input);
}

}  // namespace chunkloss::detail
