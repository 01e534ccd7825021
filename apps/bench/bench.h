// chunkloss-bench cases: what one case asks for (loss, device, shape, dtype, budget) and what it
// measured (loss time vs the bare-GEMM floor, extra memory, a naive materialised baseline and
// the error against it). Each (loss, device) pair is one runner function in the registry.
#pragma once

#include <chunkloss/core/dtype.h>
#include <chunkloss/losses/plan.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "device.h"

namespace chunkloss::bench {

/// v as printf writes it with the one-value format `f` (for example "%g", "%.3g").
std::string fmt(const char* f, double v);

/// Whether `loss` is one of the preference losses (sequence objectives): dpo, orpo, simpo, cpo,
/// kto.
bool is_preference_loss(std::string_view loss);

/// One benchmark case.
struct CaseConfig {
  std::string loss = "ce";  ///< ce, or a preference loss: dpo, orpo, simpo, cpo, kto
  std::string device = "cpu";
  std::int64_t rows = 4096;    ///< N (preference losses: 2 * pairs * seq_len)
  std::int64_t hidden = 1024;  ///< H
  std::int64_t vocab = 32768;  ///< V
  DType dtype = DType::kF32;   ///< hidden, weight and the gradient buffers
  double budget_mib = 256;
  std::size_t budget_bytes = std::size_t{256} << 20;
  LoopOrder order = LoopOrder::kAuto;
  int repeats = 3;
  int threads = 0;  ///< resolved thread count (never 0 here)
  std::uint64_t seed = 1;
  bool naive = true;           ///< time and check against the materialised computation
  bool chunked_floor = false;  ///< also time the floor GEMMs at the plan's chunk rows
  /// cuda: also time the loss with some gradients only: ce with none, only dX and only dW; the
  /// preference losses forward only, against their logits GEMMs over the valid rows
  bool phases = false;
  bool fp32_weight_grad_accumulator = false;  ///< the CrossEntropyOptions field of that name
  DType logits_dtype = DType::kF32;  ///< the options' logits_dtype (bf16: opt-in, CUDA only)
  bool exact = false;                ///< also compare with a float64 computation
  /// cuda: weight ~ N(0, logit_std^2 / H) with hidden ~ N(0, 1), so the logits' standard deviation
  double logit_std = 2.0;
  /// cuda ce: the context's gpu::GemmSelection::kMeasured (floor and loss alike) instead of
  /// cuBLAS's own choice
  bool measured_gemms = false;
  /// cuda ce: the weight split by rows over the first vocab_ranks CUDA devices (NCCL, a thread
  /// per device); 1: one device
  int vocab_ranks = 1;
  /// ce: 0, one row in 7 ignored; T > 0, the rows are sequences of T rows whose first
  /// floor(prompt_frac T) targets are ignored (prompts)
  std::int64_t ce_seq_len = 0;
  bool skip_ignored_rows = false;  ///< the CrossEntropyOptions field of that name
  /// ce: "nll" times the mean cross-entropy written as a token objective on TokenLoss (its
  /// per-chunk host round trips), "none" LinearCrossEntropy
  std::string token_objective = "none";

  // Preference losses: S = 2P sequences of T rows (chosen [0, P), rejected [P, 2P); KTO: the
  // same S sequences, labels alternating desirable/undesirable).
  std::int64_t pairs = 0;     ///< P
  std::int64_t seq_len = 0;   ///< T
  double prompt_frac = 0.25;  ///< the first floor(prompt_frac * T) targets of each sequence ignored
  std::string dpo_loss = "sigmoid";  ///< DPO's loss_type (TRL name)
  double label_smoothing = 0;        ///< DPO (sigmoid, robust, exo_pair), SimPO, CPO
  std::string reference = "none";    ///< head | logps | none (resolved per loss)
  Regime regime = Regime::kAuto;     ///< SequenceOptions::regime

  bool preference() const { return is_preference_loss(loss); }
};

/// What one case measured. Times are medians in ms over `repeats` timed runs after a warm-up.
struct CaseResult {
  double time_ms = 0;   ///< the loss's forward + backward
  double floor_ms = 0;  ///< the bare GEMMs it cannot avoid, full size (median of per-run sums)
  double ratio = 0;     ///< time_ms / floor_ms
  std::vector<std::pair<std::string, double>> gemm_ms;  ///< each floor GEMM's median
  std::optional<double> chunked_floor_ms;               ///< floor GEMMs at the plan's chunk rows
  /// The floor at full size with dW beside dX on the context's side (CUDA, --chunked-floor).
  std::optional<double> side_floor_ms;
  /// measured_gemms (CUDA cross-entropy): the floor's GEMMs through the context's selection and
  /// through cuBLAS's own choice, in the same rounds; floor_ms is the faster of the two, so a
  /// selection that slows the full-size GEMMs does not flatter the ratio.
  std::optional<double> selected_floor_ms, default_floor_ms;
  /// `phases`: the loss's median time with only some gradients ("loss only", "dX only", ...).
  std::vector<std::pair<std::string, double>> phase_ms;
  /// `phases`: a phase's own floor, where the runner times one (preference losses: "forward
  /// only" against the logits GEMMs over the valid rows, the reference head's too).
  std::vector<std::pair<std::string, double>> phase_floor_ms;
  /// measured_gemms: warm-up rounds of every timed call until each GEMM shape had its
  /// algorithm, the shapes still measuring after them (0 when all were chosen), and the
  /// context's gpu::Context::gemm_report().
  std::optional<int> gemm_settle_rounds;
  int gemm_shapes_unsettled = 0;
  std::string gemm_choices;
  /// Preference losses: the same floor GEMMs over the valid rows only (the engine skips each
  /// sequence's prompt and padding), median of per-run sums.
  std::optional<double> valid_floor_ms;
  std::vector<double> times_ms, floor_times_ms, naive_times_ms;

  std::size_t workspace_bytes = 0;  ///< the loss's workspace: plan.workspace_bytes()
  /// The extra memory the table reports: measured growth of the loss's first call (its
  /// workspace included)
  PeakMemory extra_measured;
  std::optional<PeakMemory> floor_measured;  ///< measured growth of the floor GEMMs alone

  std::optional<double> naive_ms;
  std::optional<PeakMemory> naive_extra;  ///< measured growth of the naive's first run
  std::optional<std::size_t> naive_logits_bytes;
  std::optional<double> max_rel_err_vs_naive, err_loss, err_grad_hidden, err_grad_weight;
  std::optional<double> f64_err_grad_hidden, f64_err_grad_weight;  ///< vs float64 (exact)
  /// cuda ce, exact: the median, 99th percentile and largest relative error of a dX row (rows
  /// with a gradient), vs float64: the tail a norm over all rows hides
  std::optional<std::array<double, 3>> f64_row_err_grad_hidden;
  std::optional<double> bf16_storage_err;  ///< error of storing the naive's gradients in bf16
  std::optional<double> f64_err_loss;      ///< scalar_rel_err(loss, float64 loss) (exact)
  std::string reference;                   ///< how the naive computation was done, in words

  // What the inputs were, in words (JSON keys inputs, ignored_rows, reduction).
  std::string inputs, ignored_rows, reduction;
  std::int64_t valid_rows = 0;  ///< rows whose target is not ignore_index
  /// Preference losses: the loss's metrics (TRL names) from the first call.
  std::vector<std::pair<std::string, double>> metrics;

  /// cuda ce with vocab_ranks > 1: the unsplit call on device 0 on the same inputs, its median
  /// time, and the split call's relative errors against it (loss, dX, the dW shards together)
  std::optional<double> unsplit_ms;
  std::optional<double> unsplit_err_loss, unsplit_err_grad_hidden, unsplit_err_grad_weight;

  double loss_value = 0;
  std::optional<double> naive_loss_value;
  bool loss_repeatable = true;  ///< every call returned the bitwise same loss

  Plan plan;
  std::string floor_what;  ///< which GEMMs the floor is, in words
  std::string device_desc;
  std::string load_before, load_after;  ///< /proc/loadavg around the case (CPU)
};

/// |a - b| / |b|, or |a - b| when b is 0, as rel_norm_err does for a zero reference: a loss
/// that is exactly 0 (V = 1, where every log-prob is 0) is compared absolutely, not as 0 / 0.
inline double scalar_rel_err(double a, double b) {
  const double d = std::abs(a - b);
  return b == 0 ? d : d / std::abs(b);
}

/// The largest of some relative errors; NaN when any is (std::max would drop it).
inline double worst_error(std::initializer_list<double> errors) {
  double worst = 0;
  for (double e : errors) {
    if (std::isnan(e)) return e;
    worst = std::max(worst, e);
  }
  return worst;
}

/// Runs one case on `dev`. Throws chunkloss::Error or std::runtime_error on failure.
using CaseRunner = CaseResult (*)(const CaseConfig& config, BenchDevice& dev);

/// The runner for (loss, device), or nullptr when this build has none.
CaseRunner find_runner(std::string_view loss, std::string_view device);

/// The names accepted by --loss and --device in this build.
std::vector<std::string> known_losses();
std::vector<std::string> known_devices();

/// The cross-entropy cases' targets [config.rows] in [0, config.vocab), from a generator seeded
/// with config.seed: one row in 7 ignored (-100), or with config.ce_seq_len the prompts; sets
/// res's ignored_rows, reduction (mean) and valid_rows.
std::vector<std::int64_t> ce_targets(const CaseConfig& config, CaseResult& res);

/// Cross-entropy on the CPU (ce_cpu.cpp): the loss against the 3 bare Eigen GEMMs and a naive
/// materialised fp32 computation (float64 too with config.exact).
CaseResult run_ce_cpu(const CaseConfig& config, BenchDevice& dev);
/// Cross-entropy on CUDA device 0 (cuda_ce.cu; builds with CUDA only). Times with CUDA events,
/// measures memory with cudaMemGetInfo; the BenchDevice argument is not used.
CaseResult run_ce_cuda(const CaseConfig& config, BenchDevice& dev);
/// Cross-entropy with the weight split over config.vocab_ranks CUDA devices
/// (cuda_ce_vocab_parallel.cu): each round every device runs its shard's three floor GEMMs,
/// then the loss through NCCL; a round's time is the slowest device's.
CaseResult run_ce_cuda_vocab_parallel(const CaseConfig& config, BenchDevice& dev);
/// The preference losses (config.loss) on the CPU (preference_cpu.cpp): the loss against 4 bare
/// Eigen GEMMs with a reference head (policy logits, reference logits, dX, dW), 3 otherwise, and
/// a naive materialised fp32 computation (float64 too with config.exact).
CaseResult run_preference_cpu(const CaseConfig& config, BenchDevice& dev);
/// The preference losses on CUDA device 0 (cuda_preference.cu; builds with CUDA only): cuBLAS
/// floor GEMMs, a materialised fp32-logits computation, and float64 with config.exact.
CaseResult run_preference_cuda(const CaseConfig& config, BenchDevice& dev);
/// Throws chunkloss::Error unless `devices` CUDA devices are visible (cuda_util.cu; builds with
/// CUDA only): the runners' first check, and the bench's before its header line.
void require_cuda_devices(int devices);

}  // namespace chunkloss::bench
