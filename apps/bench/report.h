// chunkloss-bench output: the per-case details, the markdown table (one row per case) and the
// JSON object of a case.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.h"

namespace chunkloss::bench {

/// A finished case with the command line that reproduces it alone.
struct CaseRecord {
  CaseConfig config;
  CaseResult result;
  std::string command;  ///< every option explicit
  std::string date;     ///< UTC, when the case finished
};

/// Several lines: plan, floor GEMMs, memory, naive, errors, machine load.
std::string case_details(const CaseRecord& r);

/// A markdown table, one row per case.
std::string table_markdown(const std::vector<CaseRecord>& records);

/// The case's correctness checks that failed, one line each (empty: all passed). The loss and
/// gradients must agree with the naive computation, with float64 (--exact) and with the unsplit
/// call (vocabulary split) within a tolerance meant to catch wrong results, not to grade
/// rounding: 1e-4 in fp32, 2e-2 with bf16 inputs, 1e-1 with bf16 logits; NaN fails. The loss
/// must be bitwise the same in every call unless measured GEMM selection was still choosing.
std::vector<std::string> failed_checks(const CaseRecord& r);

/// The case as a JSON object (the documented keys and more); `argv` is the invocation.
nlohmann::json case_json(const CaseRecord& r, const std::string& argv);

}  // namespace chunkloss::bench
