// The staging of a vocabulary-parallel chunk, shared by the plan (which sizes it) and the
// backends (which carve it first from their staging slice): each row's statistics of the rank's
// columns, every rank's after the exchange, and the chunk's fp32 dH rows before their sum over
// the ranks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "chunkloss/kernels/row_math.h"

namespace chunkloss::detail {

struct VocabParallelStaging {
  kern::RowStats* own = nullptr;  ///< [rows]
  kern::RowStats* all = nullptr;  ///< [ranks, rows]
  float* dh = nullptr;            ///< [rows, hidden] when dH is requested
};

/// Bytes for `rows` rows.
inline std::size_t vocab_parallel_staging(std::int64_t rows, std::int64_t hidden, int ranks,
                                          bool grad_hidden) {
  const auto r = static_cast<std::size_t>(rows);
  return r * static_cast<std::size_t>(1 + ranks) * sizeof(kern::RowStats) +
         (grad_hidden ? r * static_cast<std::size_t>(hidden) * sizeof(float) : 0);
}

/// Carves the buffers for `rows` rows from `s` (16-byte aligned) and advances it past them.
inline VocabParallelStaging carve_vocab_parallel(unsigned char*& s, std::int64_t rows,
                                                 std::int64_t hidden, int ranks, bool grad_hidden) {
  VocabParallelStaging v;
  const auto r = static_cast<std::size_t>(rows);
  v.own = reinterpret_cast<kern::RowStats*>(s);
  v.all = v.own + r;
  s += vocab_parallel_staging(rows, hidden, ranks, false);
  if (grad_hidden) {
    v.dh = reinterpret_cast<float*>(s);
    s += r * static_cast<std::size_t>(hidden) * sizeof(float);
  }
  return v;
}

}  // namespace chunkloss::detail
