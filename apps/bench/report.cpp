// chunkloss-bench output: details, markdown table and JSON of the cases (see report.h).
#include "report.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace chunkloss::bench {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

namespace {

std::string mib(std::size_t b) {
  const double m = static_cast<double>(b) / (1 << 20);
  return fmt(m < 10 ? "%.2f" : "%.1f", m);
}

template <typename T>
nlohmann::json opt(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

// The naive computation's measured extra memory over the loss's (none when the loss's
// measured nothing: on a device its small allocations may come from memory already reserved).
std::optional<double> naive_over_extra(const CaseResult& r) {
  if (!r.naive_extra || r.extra_measured.bytes == 0) return std::nullopt;
  return static_cast<double>(r.naive_extra->bytes) / static_cast<double>(r.extra_measured.bytes);
}

// What failed_checks() compared in this case, in words.
std::string checks_made(const CaseResult& r) {
  std::string s;
  if (r.err_loss) s += "naive, ";
  if (r.f64_err_loss || r.f64_err_grad_hidden) s += "float64, ";
  if (r.unsplit_err_loss) s += "unsplit call, ";
  return s +
         (r.gemm_shapes_unsettled == 0 ? "repeatable loss" : "no repeatability (GEMMs unsettled)");
}

}  // namespace

std::vector<std::string> failed_checks(const CaseRecord& rec) {
  const CaseConfig& c = rec.config;
  const CaseResult& r = rec.result;
  const bool bf16_logits = c.logits_dtype == DType::kBF16;
  const double tol = bf16_logits ? 1e-1 : c.dtype == DType::kBF16 ? 2e-2 : 1e-4;
  // The loss is reduced in double from fp32 statistics of the same inputs: with an fp32 logits
  // chunk it is off by at most 9e-5 in the results so far (a DPO sum over 16384 tokens), far
  // below the gradients' bf16 rounding.
  const double loss_tol = bf16_logits ? 1e-1 : 1e-3;
  std::vector<std::string> failed;
  const auto check = [&](const char* what, const std::optional<double>& err, double within) {
    if (err && !(*err <= within))
      failed.push_back(std::string(what) + " relative error " + fmt("%.3g", *err) +
                       " is not within " + fmt("%g", within));
  };
  check("loss vs naive", r.err_loss, std::min(tol, loss_tol));
  check("dX vs naive", r.err_grad_hidden, tol);
  check("dW vs naive", r.err_grad_weight, tol);
  check("loss vs float64", r.f64_err_loss, std::min(tol, loss_tol));
  check("dX vs float64", r.f64_err_grad_hidden, tol);
  check("dW vs float64", r.f64_err_grad_weight, tol);
  check("loss vs the unsplit call", r.unsplit_err_loss, std::min(tol, loss_tol));
  check("dX vs the unsplit call", r.unsplit_err_grad_hidden, tol);
  check("dW vs the unsplit call", r.unsplit_err_grad_weight, tol);
  if (!r.loss_repeatable && r.gemm_shapes_unsettled == 0)
    failed.push_back("the loss was not bitwise the same in every call");
  return failed;
}

std::string case_details(const CaseRecord& rec) {
  const CaseConfig& c = rec.config;
  const CaseResult& r = rec.result;
  std::ostringstream os;
  os << "case: " << rec.command << "\n";
  os << "  date: " << rec.date << "\n";
  os << "  plan: " << r.plan.str() << "\n";
  if (c.token_objective != "none")
    os << "  loss object: TokenLoss with the " << c.token_objective
       << " token objective (the same mean cross-entropy)\n";
  if (c.preference()) {
    os << "  batch: " << c.pairs << " pairs x T=" << c.seq_len << " (N=" << c.rows << ", "
       << r.valid_rows << " valid rows), reference " << c.reference;
    if (c.loss == "dpo") os << ", loss type " << c.dpo_loss;
    os << "; regime requested " << regime_name(c.regime) << ", chosen "
       << regime_name(r.plan.regime);
    if (r.plan.regime == Regime::kResident)
      os << " (" << r.plan.num_groups << " groups of " << r.plan.group_units << " units)";
    os << "\n  metrics:";
    for (const auto& [name, value] : r.metrics) os << " " << name << "=" << fmt("%.6g", value);
    os << "\n";
  }
  os << "  loss fwd+bwd: " << fmt("%.2f", r.time_ms) << " ms (median of " << c.repeats << ":";
  for (double t : r.times_ms) os << " " << fmt("%.2f", t);
  os << "), loss " << fmt("%.9g", r.loss_value)
     << (r.loss_repeatable ? ", bitwise repeatable" : ", NOT bitwise repeatable") << "\n";
  // Each floor GEMM's time (of the selected GEMMs when both floors were timed).
  const auto gemm_parts = [&] {
    for (std::size_t i = 0; i < r.gemm_ms.size(); ++i)
      os << (i ? " +" : "") << " " << r.gemm_ms[i].first << " " << fmt("%.2f", r.gemm_ms[i].second);
  };
  const bool two_floors = r.selected_floor_ms && r.default_floor_ms;
  os << "  floor: " << fmt("%.2f", r.floor_ms) << " ms";
  if (!two_floors) {
    os << " =";
    gemm_parts();
  }
  os << " (" << r.floor_what << ")\n";
  if (two_floors) {
    os << "  floor's GEMMs through the measured selection " << fmt("%.2f", *r.selected_floor_ms)
       << " ms =";
    gemm_parts();
    os << "; through cuBLAS's own choice " << fmt("%.2f", *r.default_floor_ms) << " ms\n";
  }
  if (r.valid_floor_ms)
    os << "  floor over the " << r.valid_rows
       << " valid rows only: " << fmt("%.2f", *r.valid_floor_ms) << " ms (ratio "
       << fmt("%.3f", r.time_ms / *r.valid_floor_ms) << " of the loss over it)\n";
  if (r.chunked_floor_ms)
    os << "  floor at the plan's " << r.plan.chunk_rows
       << "-row chunks: " << fmt("%.2f", *r.chunked_floor_ms) << " ms (ratio "
       << fmt("%.3f", r.time_ms / *r.chunked_floor_ms) << " of the loss over it)\n";
  if (r.side_floor_ms)
    os << "  floor with dW beside dX (the context's side): " << fmt("%.2f", *r.side_floor_ms)
       << " ms (ratio " << fmt("%.3f", r.time_ms / *r.side_floor_ms) << " of the loss over it)\n";
  if (r.gemm_settle_rounds) {
    os << "  GEMM algorithms measured (gpu::GemmSelection::kMeasured): " << *r.gemm_settle_rounds
       << " warm-up rounds of every timed call";
    if (r.gemm_shapes_unsettled)
      os << "; " << r.gemm_shapes_unsettled << " shapes still measuring after them";
    os << "\n";
    std::istringstream lines(r.gemm_choices);
    for (std::string line; std::getline(lines, line);) os << "    " << line << "\n";
  }
  if (!r.phase_ms.empty()) {
    os << "  the loss with some gradients:";
    for (const auto& [name, ms] : r.phase_ms) {
      os << " " << name << " " << fmt("%.2f", ms) << " ms";
      for (const auto& [floor_name, floor] : r.phase_floor_ms)
        if (floor_name == name)
          os << " (" << fmt("%.3f", ms / floor) << " of its floor " << fmt("%.2f", floor) << " ms)";
      os << ";";
    }
    os << " all " << fmt("%.2f", r.time_ms) << " ms\n";
  }
  os << "  extra memory: measured over the first call " << mib(r.extra_measured.bytes) << " MiB ("
     << r.extra_measured.method << "); the plan's workspace " << mib(r.workspace_bytes) << " MiB";
  if (r.floor_measured)
    os << "; the floor GEMMs' own temporaries, measured alike: " << mib(r.floor_measured->bytes)
       << " MiB";
  os << "\n";
  if (r.naive_ms) {
    os << "  naive: " << fmt("%.2f", *r.naive_ms) << " ms, [N, V] logits "
       << mib(*r.naive_logits_bytes) << " MiB, measured " << mib(r.naive_extra->bytes) << " MiB ("
       << r.naive_extra->method << "), loss " << fmt("%.9g", *r.naive_loss_value) << "\n";
    os << "  error vs naive (relative norm): loss " << fmt("%.3g", *r.err_loss) << ", dX "
       << fmt("%.3g", *r.err_grad_hidden) << ", dW " << fmt("%.3g", *r.err_grad_weight);
    if (r.bf16_storage_err)
      os << " (bf16 storage of the naive's gradients alone: " << fmt("%.3g", *r.bf16_storage_err)
         << ")";
    os << "\n  reference: " << r.reference << "\n";
  }
  if (r.f64_err_grad_hidden) {
    os << "  error vs float64 (relative norm):";
    if (r.f64_err_loss) os << " loss " << fmt("%.3g", *r.f64_err_loss) << ",";
    os << " dX " << fmt("%.3g", *r.f64_err_grad_hidden) << ", dW "
       << fmt("%.3g", *r.f64_err_grad_weight) << "\n";
  }
  if (r.unsplit_ms)
    os << "  vocabulary split over " << c.vocab_ranks
       << " devices; the unsplit call on device 0: " << fmt("%.2f", *r.unsplit_ms) << " ms ("
       << fmt("%.2f", *r.unsplit_ms / r.time_ms)
       << "x the split call's time); split vs unsplit (relative norm): loss "
       << fmt("%.3g", *r.unsplit_err_loss) << ", dX " << fmt("%.3g", *r.unsplit_err_grad_hidden)
       << ", dW " << fmt("%.3g", *r.unsplit_err_grad_weight) << "\n";
  if (const auto& q = r.f64_row_err_grad_hidden)
    os << "  dX rows vs float64 (relative norm of each row): median " << fmt("%.3g", (*q)[0])
       << ", p99 " << fmt("%.3g", (*q)[1]) << ", max " << fmt("%.3g", (*q)[2]) << "\n";
  os << "  device: " << r.device_desc << "\n";
  if (!r.load_before.empty())  // recorded by the CPU cases
    os << "  loadavg before: " << r.load_before << ", after: " << r.load_after << "\n";
  const std::vector<std::string> failed = failed_checks(rec);
  if (failed.empty()) os << "  checks: passed (" << checks_made(r) << ")\n";
  for (const std::string& f : failed) os << "  CHECK FAILED: " << f << "\n";
  return os.str();
}

std::string table_markdown(const std::vector<CaseRecord>& records) {
  // Preference cases add their batch shape and the plan's regime after N.
  bool pref = false;
  for (const CaseRecord& rec : records) pref = pref || rec.config.preference();
  std::ostringstream os;
  os << "| loss | device | N | " << (pref ? "P x T | regime | " : "")
     << "H | V | dtype | budget MiB | time ms | floor ms | ratio | extra MiB measured "
        "| naive ms | naive extra MiB | naive/extra | max rel err |\n";
  os << "|---|---|---|" << (pref ? "---|---|" : "")
     << "---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const CaseRecord& rec : records) {
    const CaseConfig& c = rec.config;
    const CaseResult& r = rec.result;
    os << "| " << c.loss
       << (c.token_objective != "none" ? " (token " + c.token_objective + ")" : "") << " | "
       << c.device << " | " << c.rows << " | ";
    if (pref && c.preference()) {
      os << c.pairs << " x " << c.seq_len << " | " << regime_name(r.plan.regime);
      if (r.plan.regime == Regime::kResident)
        os << " " << r.plan.num_groups << "x" << r.plan.group_units;
      os << " | ";
    } else if (pref) {
      os << "- | - | ";
    }
    os << c.hidden << " | " << c.vocab << " | " << dtype_name(c.dtype) << " | "
       << fmt("%g", c.budget_mib) << " | " << fmt("%.1f", r.time_ms) << " | "
       << fmt("%.1f", r.floor_ms) << " | " << fmt("%.3f", r.ratio) << " | "
       << mib(r.extra_measured.bytes) << " | ";
    if (r.naive_ms)
      os << fmt("%.1f", *r.naive_ms) << " | " << mib(r.naive_extra->bytes) << " | "
         << (naive_over_extra(r) ? fmt("%.1fx", *naive_over_extra(r)) : "-") << " | "
         << fmt("%.2e", *r.max_rel_err_vs_naive) << " |\n";
    else
      os << "- | - | - | - |\n";
  }
  return os.str();
}

nlohmann::json case_json(const CaseRecord& rec, const std::string& argv) {
  const CaseConfig& c = rec.config;
  const CaseResult& r = rec.result;
  const Plan& p = r.plan;
  nlohmann::json j;
  j["loss"] = c.loss;
  j["device"] = c.device;
  j["rows"] = c.rows;
  j["hidden"] = c.hidden;
  j["vocab"] = c.vocab;
  j["dtype"] = std::string(dtype_name(c.dtype));
  j["budget_bytes"] = c.budget_bytes;
  j["time_ms"] = r.time_ms;
  j["floor_ms"] = r.floor_ms;
  j["ratio"] = r.ratio;
  j["extra_bytes"] = r.extra_measured.bytes;
  j["naive_ms"] = opt(r.naive_ms);
  j["naive_extra_bytes"] = r.naive_extra ? nlohmann::json(r.naive_extra->bytes) : nullptr;
  j["max_rel_err_vs_naive"] = opt(r.max_rel_err_vs_naive);
  j["vocab_ranks"] = c.vocab_ranks;
  j["unsplit_ms"] = opt(r.unsplit_ms);
  j["unsplit_err_loss"] = opt(r.unsplit_err_loss);
  j["unsplit_err_grad_hidden"] = opt(r.unsplit_err_grad_hidden);
  j["unsplit_err_grad_weight"] = opt(r.unsplit_err_grad_weight);

  j["date"] = rec.date;
  j["command"] = rec.command;
  j["argv"] = argv;
  j["repeats"] = c.repeats;
  j["threads"] = c.threads;
  j["seed"] = c.seed;
  j["reduction"] = r.reduction;
  j["ignore_index"] = -100;
  j["ignored_rows"] = r.ignored_rows;
  j["valid_rows"] = r.valid_rows;
  j["inputs"] = r.inputs;
  if (!c.preference()) {
    j["ce_seq_len"] = c.ce_seq_len;
    j["skip_ignored_rows"] = c.skip_ignored_rows;
    j["token_objective"] = c.token_objective;
    if (c.ce_seq_len) j["prompt_frac"] = c.prompt_frac;
  }
  if (c.preference()) {
    j["pairs"] = c.pairs;
    j["seq_len"] = c.seq_len;
    j["sequences"] = 2 * c.pairs;
    j["prompt_frac"] = c.prompt_frac;
    j["reference_input"] = c.reference;
    if (c.loss == "dpo") j["dpo_loss"] = c.dpo_loss;
    j["label_smoothing"] = c.label_smoothing;
    j["regime"] = std::string(regime_name(p.regime));
    j["requested_regime"] = std::string(regime_name(c.regime));
    j["groups"] = p.num_groups;
    j["group_units"] = p.group_units;
    nlohmann::json m = nlohmann::json::object();
    for (const auto& [name, value] : r.metrics) m[name] = value;
    j["metrics"] = m;
  }
  j["times_ms"] = r.times_ms;
  j["floor"] = r.floor_what;
  j["floor_times_ms"] = r.floor_times_ms;
  for (const auto& [name, ms] : r.gemm_ms) j["gemm_" + name + "_ms"] = ms;
  j["chunked_floor_ms"] = opt(r.chunked_floor_ms);
  j["side_floor_ms"] = opt(r.side_floor_ms);
  j["selected_floor_ms"] = opt(r.selected_floor_ms);
  j["default_floor_ms"] = opt(r.default_floor_ms);
  for (const auto& [name, ms] : r.phase_ms) j["phase_" + name + "_ms"] = ms;
  for (const auto& [name, ms] : r.phase_floor_ms) j["phase_" + name + "_floor_ms"] = ms;
  j["gemm_selection"] = r.gemm_settle_rounds ? "measured" : "default";
  j["gemm_settle_rounds"] = opt(r.gemm_settle_rounds);
  j["gemm_shapes_unsettled"] = r.gemm_shapes_unsettled;
  j["gemm_choices"] = r.gemm_choices;
  j["valid_floor_ms"] = opt(r.valid_floor_ms);
  j["ratio_valid"] = r.valid_floor_ms ? nlohmann::json(r.time_ms / *r.valid_floor_ms) : nullptr;
  j["extra_measured_bytes"] = r.extra_measured.bytes;
  j["extra_measured_method"] = r.extra_measured.method;
  j["floor_measured_bytes"] = r.floor_measured ? nlohmann::json(r.floor_measured->bytes) : nullptr;
  j["naive_times_ms"] = r.naive_times_ms;
  j["naive_extra_method"] = r.naive_extra ? nlohmann::json(r.naive_extra->method) : nullptr;
  j["naive_logits_bytes"] = opt(r.naive_logits_bytes);
  j["naive_extra_over_extra"] = opt(naive_over_extra(r));
  j["err_loss"] = opt(r.err_loss);
  j["err_grad_hidden"] = opt(r.err_grad_hidden);
  j["err_grad_weight"] = opt(r.err_grad_weight);
  j["bf16_storage_err"] = opt(r.bf16_storage_err);
  j["f64_err_loss"] = opt(r.f64_err_loss);
  j["f64_err_grad_hidden"] = opt(r.f64_err_grad_hidden);
  j["f64_err_grad_weight"] = opt(r.f64_err_grad_weight);
  j["f64_row_err_grad_hidden"] = r.f64_row_err_grad_hidden
                                     ? nlohmann::json{{"median", (*r.f64_row_err_grad_hidden)[0]},
                                                      {"p99", (*r.f64_row_err_grad_hidden)[1]},
                                                      {"max", (*r.f64_row_err_grad_hidden)[2]}}
                                     : nullptr;
  j["reference"] = r.reference;
  j["loss_value"] = r.loss_value;
  j["naive_loss_value"] = opt(r.naive_loss_value);
  j["loss_bitwise_repeatable"] = r.loss_repeatable;
  j["plan"] = p.str();
  j["plan_order"] = std::string(loop_order_name(p.order));
  j["requested_order"] = std::string(loop_order_name(c.order));
  j["chunk_rows"] = p.chunk_rows;
  j["num_chunks"] = p.num_chunks;
  j["vocab_block"] = p.vocab_block;
  j["num_vocab_blocks"] = p.num_vocab_blocks;
  j["plan_reason"] = p.reason;
  j["plan_over_budget"] = p.over_budget;
  j["fp32_weight_grad_accumulator"] = c.fp32_weight_grad_accumulator;
  j["logits_dtype"] = std::string(dtype_name(p.logits_dtype));
  j["workspace_bytes"] = r.workspace_bytes;
  j["failed_checks"] = failed_checks(rec);
  j["device_desc"] = r.device_desc;
  if (!r.load_before.empty()) {
    j["loadavg_before"] = r.load_before;
    j["loadavg_after"] = r.load_after;
  }
  j["compiler"] = __VERSION__;
  return j;
}

}  // namespace chunkloss::bench
