// chunkloss-bench: times a loss's forward+backward against the bare GEMMs it cannot avoid and a
// naive materialised implementation in the same process, reports its extra memory and its error,
// and prints a table, the plan and the command that reproduces each case (DESIGN.md section 5).
#include <chunkloss/apps/app_main.h>
#include <chunkloss/apps/cli.h>
#include <chunkloss/core/error.h>
#include <chunkloss/losses/preference.h>
#include <chunkloss/model/safetensors.h>

#include <boost/program_options.hpp>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <optional>
#include <thread>
#include <tuple>

#include "bench.h"
#include "report.h"

namespace po = boost::program_options;
namespace apps = chunkloss::apps;
using namespace chunkloss;
using namespace chunkloss::bench;

namespace {

constexpr const char* kProg = "chunkloss-bench";

struct Cli {
  std::vector<CaseConfig> cases;
  std::string json;
  bool help = false;
};

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : "|") + x;
  return s;
}

DType parse_dtype(const std::string& s, const char* option = "--dtype") {
  if (s == "f32") return DType::kF32;
  if (s == "bf16") return DType::kBF16;
  throw apps::UsageError(std::string(option) + ": '" + s + "' is not f32 or bf16");
}

LoopOrder parse_order(const std::string& s) {
  for (LoopOrder o : {LoopOrder::kAuto, LoopOrder::kTokenChunk, LoopOrder::kVocabBlock})
    if (s == loop_order_name(o)) return o;
  throw apps::UsageError("--order: '" + s + "' is not auto, token_chunk or vocab_block");
}

Regime parse_regime(const std::string& s) {
  for (Regime r : {Regime::kAuto, Regime::kResident, Regime::kRecompute, Regime::kDeferred})
    if (s == regime_name(r)) return r;
  throw apps::UsageError("--regime: '" + s + "' is not auto, resident, recompute or deferred");
}

// Every option explicit, so the line reproduces this case alone on any machine.
std::string case_command(const std::string& prog, const CaseConfig& c) {
  std::vector<std::string> w = {prog, "--loss", c.loss, "--device", c.device};
  if (c.preference()) {
    w.insert(w.end(), {"--pairs", std::to_string(c.pairs), "--seq-len", std::to_string(c.seq_len),
                       "--prompt-frac", apps::number(c.prompt_frac), "--reference", c.reference,
                       "--regime", std::string(regime_name(c.regime))});
    if (c.loss == "dpo") w.insert(w.end(), {"--dpo-loss-type", c.dpo_loss});
    if (c.label_smoothing != 0)
      w.insert(w.end(), {"--label-smoothing", apps::number(c.label_smoothing)});
  } else {
    w.insert(w.end(), {"--rows", std::to_string(c.rows)});
    if (c.ce_seq_len)
      w.insert(w.end(), {"--ce-seq-len", std::to_string(c.ce_seq_len), "--prompt-frac",
                         apps::number(c.prompt_frac)});
    if (c.skip_ignored_rows) w.emplace_back("--skip-ignored-rows");
    if (c.token_objective != "none") w.insert(w.end(), {"--token-objective", c.token_objective});
  }
  w.insert(w.end(), {"--hidden", std::to_string(c.hidden), "--vocab", std::to_string(c.vocab),
                     "--dtype", std::string(dtype_name(c.dtype)), "--logits-dtype",
                     std::string(dtype_name(c.logits_dtype)), "--budget-mib",
                     apps::number(c.budget_mib), "--order", std::string(loop_order_name(c.order)),
                     "--repeats", std::to_string(c.repeats), "--threads", std::to_string(c.threads),
                     "--seed", std::to_string(c.seed)});
  if (!c.naive) w.emplace_back("--no-naive");
  if (c.chunked_floor) w.emplace_back("--chunked-floor");
  if (c.phases) w.emplace_back("--phases");
  if (c.fp32_weight_grad_accumulator) w.emplace_back("--fp32-dw-accum");
  if (c.exact) w.emplace_back("--exact");
  if (c.measured_gemms) w.insert(w.end(), {"--gemm-selection", "measured"});
  if (c.vocab_ranks > 1) w.insert(w.end(), {"--vocab-parallel", std::to_string(c.vocab_ranks)});
  if (c.device == "cuda") w.insert(w.end(), {"--logit-std", apps::number(c.logit_std)});
  return apps::shell_join(w);
}

Cli parse(int argc, char** argv) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  po::options_description desc(
      std::string("Usage: ") + kProg +
      " [options]\nTimes a loss's forward+backward against the bare GEMMs it cannot avoid and a "
      "naive\nmaterialised implementation. List options take comma-separated values and run "
      "every\ncombination as one case each.\nOptions");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help and exit")
    ("loss", po::value<std::string>()->default_value("ce"), ("loss to time: " + join(known_losses())).c_str())
    ("device", po::value<std::string>()->default_value("cpu"), ("device: " + join(known_devices())).c_str())
    ("rows", po::value<std::string>()->default_value("4096"), "ce: N, rows (tokens); list")
    ("pairs", po::value<std::string>()->default_value("2"), "preference losses: P pairs, S = 2P sequences (kto: 2P sequences, labels alternating); list")
    ("seq-len", po::value<std::string>()->default_value("256"), "preference losses: T rows per sequence (N = 2 P T); list")
    ("prompt-frac", po::value<double>()->default_value(0.25), "preference losses, and ce with --ce-seq-len: the first floor(f T) targets of each sequence are ignore_index (prompt)")
    ("ce-seq-len", po::value<std::int64_t>()->default_value(0, "0 = one row in 7 ignored"), "ce: the rows are sequences of T rows, each with a prompt (--prompt-frac); also times the floor over the valid rows only")
    ("skip-ignored-rows", po::bool_switch()->default_value(false, "off"), "ce: CrossEntropyOptions::skip_ignored_rows (runs of ignored rows are not multiplied; see --ce-seq-len)")
    ("token-objective", po::value<std::string>()->default_value("none"), "ce: nll times the same mean cross-entropy written as a token objective on TokenLoss (the objective runs on the host for each chunk); none: LinearCrossEntropy")
    ("reference", po::value<std::string>()->default_value("", "head for dpo and kto, none otherwise"), "dpo, kto: head (a reference head with its own hidden and weight, run through pass 1 without gradients) | logps (its per-sequence log-probs precomputed, untimed) | none")
    ("dpo-loss-type", po::value<std::string>()->default_value("sigmoid"), "dpo: loss type (TRL names: sigmoid, hinge, ipo, robust, exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, discopop)")
    ("label-smoothing", po::value<double>()->default_value(0.0), "dpo (sigmoid, robust, exo_pair), simpo, cpo: label smoothing eps")
    ("regime", po::value<std::string>()->default_value("auto"), "preference losses: auto|resident|recompute|deferred; list")
    ("hidden", po::value<std::string>()->default_value("1024"), "H, hidden size; list")
    ("vocab", po::value<std::string>()->default_value("32768"), "V, vocabulary size; list")
    ("dtype", po::value<std::string>()->default_value("f32"), "f32|bf16: the loss's hidden, weight and gradient buffers (the floor and the naive run in fp32 on the same values); list")
    ("budget-mib", po::value<std::string>()->default_value("256"), "the loss's workspace budget in MiB (> 0); list")
    ("order", po::value<std::string>()->default_value("auto"), "loop order: auto|token_chunk|vocab_block")
    ("repeats", po::value<int>()->default_value(3), "timed repeats after one warm-up run; the median is reported")
    ("threads", po::value<int>()->default_value(cores, std::to_string(cores) + " = all cores"), "threads for the loss, the floor GEMMs and the naive (0: all cores)")
    ("seed", po::value<std::int64_t>()->default_value(1), "seed of the random inputs (>= 0)")
    ("json", po::value<std::string>()->default_value("", "none"), "write the cases as a JSON array to FILE (atomically: FILE.tmp, then rename)")
    ("no-naive", po::bool_switch()->default_value(false, "off"), "skip the naive materialised run (and the error check)")
    ("chunked-floor", po::bool_switch()->default_value(false, "off"), "also time the floor GEMMs at the plan's chunk rows (token_chunk order; cuda: the library's GEMMs, fp32 logits chunk and its in-place gradient operand, dW beside dX; and the full-size floor with dW beside dX)")
    ("phases", po::bool_switch()->default_value(false, "off"), "cuda: also time the loss with some gradients only: ce with none, with dX only and with dW only, in the same rounds (what each gradient adds); the preference losses forward only, against their logits GEMMs over the valid rows")
    ("logits-dtype", po::value<std::string>()->default_value("f32"), "f32|bf16: the loss's logits chunk (bf16: the opt-in speed/memory mode, cuda only)")
    ("logit-std", po::value<double>()->default_value(2.0), "cuda: the logits' standard deviation s (weight ~ N(0, s^2/H), hidden ~ N(0, 1)); trained models' confident rows have larger logits")
    ("fp32-dw-accum", po::bool_switch()->default_value(false, "off"), "accumulate dW in an fp32 workspace buffer (V*H*4 bytes on top of the budget; matters for bf16)")
    ("gemm-selection", po::value<std::string>()->default_value("default"), "cuda ce: default (cuBLAS's own algorithm per GEMM shape) | measured (gpu::GemmSelection::kMeasured: cuBLAS's and cuBLASLt's candidates timed on the first calls of each shape, the fastest kept; the floor and the loss alike, warmed up until every shape has its algorithm)")
    ("vocab-parallel", po::value<int>()->default_value(1), "cuda ce: split the weight by rows over the first K CUDA devices (NCCL, a thread per device); the floor is every device's three GEMMs on its shard at once, and the results are checked against the unsplit call on device 0, whose time is reported too")
    ("exact", po::bool_switch()->default_value(false, "off"), "also compare the loss and gradients with a float64 computation on the same input values");
  // clang-format on
  po::variables_map vm;
  apps::store_command_line(argc, argv, desc, vm);
  po::notify(vm);
  apps::check_utf8_options(vm);  // --json's name goes into its records
  Cli cli;
  if (vm.count("help")) {
    std::cout << desc << "\n";
    cli.help = true;
    return cli;
  }
  CaseConfig base;
  base.loss = vm["loss"].as<std::string>();
  base.device = vm["device"].as<std::string>();
  const auto losses = known_losses();
  const auto devices = known_devices();
  if (std::find(losses.begin(), losses.end(), base.loss) == losses.end())
    throw apps::UsageError("--loss: '" + base.loss + "' is not one of " + join(losses));
  if (std::find(devices.begin(), devices.end(), base.device) == devices.end())
    throw apps::UsageError("--device: '" + base.device + "' is not built into this bench (" +
                           join(devices) + ")");
  if (!find_runner(base.loss, base.device))
    throw apps::UsageError("--loss " + base.loss + " has no runner for --device " + base.device);
  const bool pref = is_preference_loss(base.loss);
  constexpr std::int64_t kMaxDim = std::int64_t{1} << 31;
  const auto given = [&](const char* o) { return vm.count(o) && !vm[o].defaulted(); };
  for (const char* o : {"pairs", "seq-len", "prompt-frac", "reference", "regime", "dpo-loss-type",
                        "label-smoothing"})
    if (!pref && given(o) && !(o == std::string("prompt-frac") && given("ce-seq-len")))
      throw apps::UsageError(
          "--" + std::string(o) + " is for the preference losses, not --loss " + base.loss +
          (o == std::string("prompt-frac") ? " (ce takes it with --ce-seq-len)" : ""));
  if (pref && given("rows"))
    throw apps::UsageError("--rows: --loss " + base.loss +
                           " takes --pairs and --seq-len (N = 2 * pairs * seq-len)");
  if (pref && vm["chunked-floor"].as<bool>())
    throw apps::UsageError("--chunked-floor is for --loss ce");
  if (vm["phases"].as<bool>() && vm["device"].as<std::string>() != "cuda")
    throw apps::UsageError("--phases is for --device cuda");
  const std::string selection = vm["gemm-selection"].as<std::string>();
  if (selection != "default" && selection != "measured")
    throw apps::UsageError("--gemm-selection: '" + selection + "' is not default or measured");
  base.measured_gemms = selection == "measured";
  if (base.measured_gemms && (pref || vm["device"].as<std::string>() != "cuda"))
    throw apps::UsageError("--gemm-selection measured is for --loss ce --device cuda");
  base.vocab_ranks = apps::in_range<int>(vm, "vocab-parallel", 1, 64);
  if (base.vocab_ranks > 1 && (pref || vm["device"].as<std::string>() != "cuda"))
    throw apps::UsageError("--vocab-parallel is for --loss ce --device cuda");
  if (base.vocab_ranks > 1 &&
      (base.measured_gemms || vm["phases"].as<bool>() || vm["chunked-floor"].as<bool>() ||
       vm["exact"].as<bool>() || vm["order"].as<std::string>() == "vocab_block"))
    throw apps::UsageError(
        "--vocab-parallel takes none of --gemm-selection measured, --phases, --chunked-floor, "
        "--exact and --order vocab_block");
  if (base.loss != "dpo" && given("dpo-loss-type"))
    throw apps::UsageError("--dpo-loss-type is for --loss dpo");
  base.prompt_frac = vm["prompt-frac"].as<double>();
  if (!(base.prompt_frac >= 0 && base.prompt_frac < 1))
    throw apps::UsageError("--prompt-frac: " + apps::number(base.prompt_frac) +
                           " is not in [0, 1)");
  base.ce_seq_len = apps::in_range<std::int64_t>(vm, "ce-seq-len", 0, kMaxDim);
  base.skip_ignored_rows = vm["skip-ignored-rows"].as<bool>();
  if (pref && (base.ce_seq_len || base.skip_ignored_rows))
    throw apps::UsageError("--ce-seq-len and --skip-ignored-rows are for --loss ce");
  base.token_objective = vm["token-objective"].as<std::string>();
  if (base.token_objective != "none" && base.token_objective != "nll")
    throw apps::UsageError("--token-objective: '" + base.token_objective + "' is not none or nll");
  if (base.token_objective != "none" && (pref || base.vocab_ranks > 1))
    throw apps::UsageError(
        "--token-objective is for --loss ce on one device (the bench's vocabulary-parallel run "
        "times LinearCrossEntropy only)");
  base.label_smoothing = vm["label-smoothing"].as<double>();
  base.dpo_loss = vm["dpo-loss-type"].as<std::string>();
  try {
    parse_dpo_loss(base.dpo_loss);
  } catch (const Error& e) {
    throw apps::UsageError(std::string("--dpo-loss-type: ") + e.what());
  }
  if (pref) {
    const std::string bad =
        apps::label_smoothing_error(base.loss, base.dpo_loss, base.label_smoothing);
    if (!bad.empty()) throw apps::UsageError(bad);
  }
  base.reference = vm["reference"].as<std::string>();
  if (base.reference.empty())
    base.reference = base.loss == "dpo" || base.loss == "kto" ? "head" : "none";
  if (base.reference != "head" && base.reference != "logps" && base.reference != "none")
    throw apps::UsageError("--reference: '" + base.reference + "' is not head, logps or none");
  if (pref && base.loss != "dpo" && base.loss != "kto" && base.reference != "none")
    throw apps::UsageError("--reference " + base.reference + ": --loss " + base.loss +
                           " is reference-free");
  base.order = parse_order(vm["order"].as<std::string>());
  base.repeats = apps::in_range<int>(vm, "repeats", 1, 1000);
  base.threads = apps::in_range<int>(vm, "threads", 0, 4096);
  if (base.threads == 0) base.threads = cores;
  const std::int64_t seed = vm["seed"].as<std::int64_t>();
  if (seed < 0) throw apps::UsageError("--seed: " + std::to_string(seed) + " is not >= 0");
  base.seed = static_cast<std::uint64_t>(seed);
  base.naive = !vm["no-naive"].as<bool>();
  base.chunked_floor = vm["chunked-floor"].as<bool>();
  base.phases = vm["phases"].as<bool>();
  base.fp32_weight_grad_accumulator = vm["fp32-dw-accum"].as<bool>();
  base.logits_dtype = parse_dtype(vm["logits-dtype"].as<std::string>(), "--logits-dtype");
  if (base.logits_dtype == DType::kBF16 && base.device != "cuda")
    throw apps::UsageError("--logits-dtype bf16 is for --device cuda (the " + base.device +
                           " loss keeps its logits chunk in f32)");
  base.exact = vm["exact"].as<bool>();
  base.logit_std = vm["logit-std"].as<double>();
  if (!(base.logit_std > 0 && base.logit_std <= 1000))
    throw apps::UsageError("--logit-std: " + apps::number(base.logit_std) + " is not in (0, 1000]");
  if (!vm["logit-std"].defaulted() && base.device != "cuda")
    throw apps::UsageError("--logit-std: only the cuda cases take it (--device " + base.device +
                           ")");
  cli.json = apps::path_option(vm, "json");

  const auto rows = apps::parse_int_list("rows", vm["rows"].as<std::string>(), 1, kMaxDim);
  const auto hidden = apps::parse_int_list("hidden", vm["hidden"].as<std::string>(), 1, kMaxDim);
  const auto vocab = apps::parse_int_list("vocab", vm["vocab"].as<std::string>(), 1, kMaxDim - 1);
  std::vector<DType> dtypes;
  for (const std::string& s : apps::split_list("dtype", vm["dtype"].as<std::string>()))
    dtypes.push_back(parse_dtype(s));
  const auto budgets =
      apps::parse_number_list("budget-mib", vm["budget-mib"].as<std::string>(), 1e-3, 1e9);
  // One shape per (rows) for ce, per (pairs, seq-len) for the preference losses.
  std::vector<CaseConfig> shapes;
  if (pref) {
    const auto pairs = apps::parse_int_list("pairs", vm["pairs"].as<std::string>(), 1, kMaxDim);
    const auto lens = apps::parse_int_list("seq-len", vm["seq-len"].as<std::string>(), 1, kMaxDim);
    std::vector<Regime> regimes;
    for (const std::string& r : apps::split_list("regime", vm["regime"].as<std::string>()))
      regimes.push_back(parse_regime(r));
    for (auto p : pairs)
      for (auto t : lens)
        for (Regime r : regimes) {
          if (p > kMaxDim / (2 * t))  // 2 P T > 2^31, without computing 2 P T
            throw apps::UsageError("--pairs " + std::to_string(p) + " --seq-len " +
                                   std::to_string(t) + ": N = 2 P T exceeds 2^31");
          CaseConfig c = base;
          c.pairs = p;
          c.seq_len = t;
          c.rows = 2 * p * t;
          c.regime = r;
          shapes.push_back(c);
        }
  } else {
    for (auto n : rows) {
      CaseConfig c = base;
      c.rows = n;
      shapes.push_back(c);
    }
  }
  // A case holds N x H, V x H and (the floor's and the naive run's fp32 logits) N x V values in
  // memory; past 2^40 values a buffer's byte count could wrap, so such a shape is refused here.
  constexpr std::int64_t kMaxValues = std::int64_t{1} << 40;
  for (const CaseConfig& shape : shapes) {
    const std::string n_opts = pref ? "--pairs " + std::to_string(shape.pairs) + " --seq-len " +
                                          std::to_string(shape.seq_len) +
                                          " (N = 2 P T = " + std::to_string(shape.rows) + ")"
                                    : "--rows " + std::to_string(shape.rows);
    for (auto h : hidden)
      for (auto v : vocab)
        for (const auto& [what, a, b] :
             {std::tuple{n_opts + " --hidden " + std::to_string(h), shape.rows, h},
              std::tuple{"--vocab " + std::to_string(v) + " --hidden " + std::to_string(h), v, h},
              std::tuple{n_opts + " --vocab " + std::to_string(v), shape.rows, v}})
          if (a > kMaxValues / b)
            throw apps::UsageError(what + ": a buffer of " + std::to_string(a) + " x " +
                                   std::to_string(b) + " values is more than 2^40");
  }
  for (const CaseConfig& shape : shapes)
    for (auto h : hidden)
      for (auto v : vocab)
        for (DType d : dtypes)
          for (double b : budgets) {
            CaseConfig c = shape;
            c.hidden = h;
            c.vocab = v;
            c.dtype = d;
            c.budget_mib = b;
            c.budget_bytes = static_cast<std::size_t>(b * 1048576.0 + 0.5);
            cli.cases.push_back(c);
          }
  return cli;
}

// Runs every case of the command line, printing each case's details as it finishes, then the
// table; with --json the records so far are rewritten after every case. Exit code 1 when a case
// failed its checks (failed_checks).
int run(const Cli& cli, int argc, char** argv) {
  const std::vector<std::string> words(argv, argv + argc);
  const std::string invoked = apps::shell_join(words);
  if (!cli.json.empty()) {  // before any case
    apps::check_not_checkpoint_file("json", cli.json, {});
    apps::prepare_output_file("json", cli.json);
  }
#if CHUNKLOSS_BENCH_CUDA
  for (const CaseConfig& c : cli.cases)  // before the header, so a refusal is the only output
    if (c.device == "cuda") require_cuda_devices(std::max(1, c.vocab_ranks));
#endif
  const CaseConfig& first = cli.cases.front();  // (every case's threads and vocabulary ranks)
  const bool ranks = first.vocab_ranks > 1;
  apps::check_threads_start(
      "--threads " + std::to_string(first.threads) +
          (ranks ? " with --vocab-parallel " + std::to_string(first.vocab_ranks) : ""),
      first.threads - 1, ranks ? first.vocab_ranks : 0);
  std::vector<CaseRecord> records;
  nlohmann::json all = nlohmann::json::array();
  std::cout << kProg << " " << apps::utc_now_iso() << "\n";
  for (std::size_t i = 0; i < cli.cases.size(); ++i) {
    const CaseConfig& c = cli.cases[i];
    const std::string shape =
        c.preference() ? std::to_string(c.pairs) + " pairs x T=" + std::to_string(c.seq_len) +
                             " (N=" + std::to_string(c.rows) + "), reference " + c.reference +
                             ", regime " + std::string(regime_name(c.regime))
                       : "N=" + std::to_string(c.rows);
    std::fprintf(stderr, "%s: case %zu/%zu: %s %s %s H=%lld V=%lld %s budget %g MiB\n", kProg,
                 i + 1, cli.cases.size(), c.loss.c_str(), c.device.c_str(), shape.c_str(),
                 static_cast<long long>(c.hidden), static_cast<long long>(c.vocab),
                 std::string(dtype_name(c.dtype)).c_str(), c.budget_mib);
    std::unique_ptr<BenchDevice> dev = make_cpu_device(c.threads);
    CaseRecord rec{c, find_runner(c.loss, c.device)(c, *dev), case_command(argv[0], c),
                   apps::utc_now_iso()};
    std::cout << case_details(rec) << std::flush;
    all.push_back(case_json(rec, invoked));
    records.push_back(std::move(rec));
    if (!cli.json.empty()) model::write_file_atomically(cli.json, all.dump(2) + "\n");
  }
  std::cout << "\n" << table_markdown(records) << "\ncommand: " << invoked << "\n";
  if (!cli.json.empty()) std::cout << "json: " << cli.json << "\n";
  std::size_t failed = 0;
  for (const CaseRecord& rec : records) failed += !failed_checks(rec).empty();
  if (failed == 0) return 0;
  std::fprintf(stderr, "%s: %zu of %zu cases failed their checks (CHECK FAILED above)\n", kProg,
               failed, records.size());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  return apps::guarded_main(
      kProg,
      [&]() -> std::optional<Cli> {
        Cli cli = parse(argc, argv);
        if (cli.help) return std::nullopt;
        return cli;
      },
      [&](const Cli& cli) { return run(cli, argc, argv); });
}
