// chunkloss-bench: times a loss's forward+backward against the bare GEMMs it cannot avoid and a
// naive materialised implementation in the same process, reports its extra memory and its error,
// and prints a table, the plan and the command that reproduces each case (DESIGN.md section 5).
#include <chunkloss/apps/cli.h>
#include <chunkloss/core/error.h>

#include <boost/program_options.hpp>
#include <cstdio>
#include <exception>
#include <iostream>
#include <thread>

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

DType parse_dtype(const std::string& s) {
  if (s == "f32") return DType::kF32;
  if (s == "bf16") return DType::kBF16;
  throw apps::UsageError("--dtype: '" + s + "' is not f32 or bf16");
}

LoopOrder parse_order(const std::string& s) {
  for (LoopOrder o : {LoopOrder::kAuto, LoopOrder::kTokenChunk, LoopOrder::kVocabBlock})
    if (s == loop_order_name(o)) return o;
  throw apps::UsageError("--order: '" + s + "' is not auto, token_chunk or vocab_block");
}

std::string fmt_g(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// Every option explicit, so the line reproduces this case alone on any machine.
std::string case_command(const std::string& prog, const CaseConfig& c) {
  std::vector<std::string> w = {prog,
                                "--loss",
                                c.loss,
                                "--device",
                                c.device,
                                "--rows",
                                std::to_string(c.rows),
                                "--hidden",
                                std::to_string(c.hidden),
                                "--vocab",
                                std::to_string(c.vocab),
                                "--dtype",
                                std::string(dtype_name(c.dtype)),
                                "--budget-mib",
                                fmt_g(c.budget_mib),
                                "--order",
                                std::string(loop_order_name(c.order)),
                                "--repeats",
                                std::to_string(c.repeats),
                                "--threads",
                                std::to_string(c.threads),
                                "--seed",
                                std::to_string(c.seed)};
  if (!c.naive) w.emplace_back("--no-naive");
  if (c.chunked_floor) w.emplace_back("--chunked-floor");
  if (c.fp32_weight_grad_accumulator) w.emplace_back("--fp32-dw-accum");
  if (c.exact) w.emplace_back("--exact");
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
    ("rows", po::value<std::string>()->default_value("4096"), "N, rows (tokens); list")
    ("hidden", po::value<std::string>()->default_value("1024"), "H, hidden size; list")
    ("vocab", po::value<std::string>()->default_value("32768"), "V, vocabulary size; list")
    ("dtype", po::value<std::string>()->default_value("f32"), "f32|bf16: the loss's hidden, weight and gradient buffers (the floor and the naive run in fp32 on the same values); list")
    ("budget-mib", po::value<std::string>()->default_value("256"), "the loss's workspace budget in MiB (> 0); list")
    ("order", po::value<std::string>()->default_value("auto"), "loop order: auto|token_chunk|vocab_block")
    ("repeats", po::value<int>()->default_value(3), "timed repeats after one warm-up run; the median is reported")
    ("threads", po::value<int>()->default_value(cores, std::to_string(cores) + " = all cores"), "threads for the loss, the floor GEMMs and the naive (0: all cores)")
    ("seed", po::value<std::uint64_t>()->default_value(1), "seed of the random inputs")
    ("json", po::value<std::string>()->default_value("", "none"), "write the cases as a JSON array to FILE (atomically: FILE.tmp, then rename)")
    ("no-naive", po::bool_switch()->default_value(false, "off"), "skip the naive materialised run (and the error check)")
    ("chunked-floor", po::bool_switch()->default_value(false, "off"), "also time the floor GEMMs at the plan's chunk rows (token_chunk order)")
    ("fp32-dw-accum", po::bool_switch()->default_value(false, "off"), "accumulate dW in an fp32 workspace buffer (V*H*4 bytes on top of the budget; matters for bf16)")
    ("exact", po::bool_switch()->default_value(false, "off"), "cuda: also compare the gradients with a float64 computation on the same input values");
  // clang-format on
  po::variables_map vm;
  po::store(po::command_line_parser(argc, argv).options(desc).positional({}).run(), vm);
  po::notify(vm);
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
  base.order = parse_order(vm["order"].as<std::string>());
  base.repeats = vm["repeats"].as<int>();
  if (base.repeats < 1 || base.repeats > 1000)
    throw apps::UsageError("--repeats: " + std::to_string(base.repeats) + " is not in [1, 1000]");
  base.threads = vm["threads"].as<int>();
  if (base.threads < 0 || base.threads > 4096)
    throw apps::UsageError("--threads: " + std::to_string(base.threads) + " is not in [0, 4096]");
  if (base.threads == 0) base.threads = cores;
  base.seed = vm["seed"].as<std::uint64_t>();
  base.naive = !vm["no-naive"].as<bool>();
  base.chunked_floor = vm["chunked-floor"].as<bool>();
  base.fp32_weight_grad_accumulator = vm["fp32-dw-accum"].as<bool>();
  base.exact = vm["exact"].as<bool>();
  cli.json = vm["json"].as<std::string>();

  constexpr std::int64_t kMaxDim = std::int64_t{1} << 31;
  const auto rows = apps::parse_int_list("rows", vm["rows"].as<std::string>(), 1, kMaxDim);
  const auto hidden = apps::parse_int_list("hidden", vm["hidden"].as<std::string>(), 1, kMaxDim);
  const auto vocab = apps::parse_int_list("vocab", vm["vocab"].as<std::string>(), 1, kMaxDim - 1);
  std::vector<DType> dtypes;
  for (const std::string& s : apps::split_list("dtype", vm["dtype"].as<std::string>()))
    dtypes.push_back(parse_dtype(s));
  const auto budgets =
      apps::parse_number_list("budget-mib", vm["budget-mib"].as<std::string>(), 1e-3, 1e9);
  for (auto n : rows)
    for (auto h : hidden)
      for (auto v : vocab)
        for (DType d : dtypes)
          for (double b : budgets) {
            CaseConfig c = base;
            c.rows = n;
            c.hidden = h;
            c.vocab = v;
            c.dtype = d;
            c.budget_mib = b;
            c.budget_bytes = static_cast<std::size_t>(b * 1048576.0 + 0.5);
            cli.cases.push_back(c);
          }
  return cli;
}

std::string one_line(std::string s) {
  for (char& ch : s)
    if (ch == '\n' || ch == '\r') ch = ' ';
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  Cli cli;
  try {
    cli = parse(argc, argv);
  } catch (const po::error& e) {
    std::fprintf(stderr, "%s: %s (see --help)\n", kProg, one_line(e.what()).c_str());
    return apps::kExitUsage;
  } catch (const apps::UsageError& e) {
    std::fprintf(stderr, "%s: %s (see --help)\n", kProg, one_line(e.what()).c_str());
    return apps::kExitUsage;
  }
  if (cli.help) return 0;
  try {
    const std::vector<std::string> words(argv, argv + argc);
    const std::string invoked = apps::shell_join(words);
    std::vector<CaseRecord> records;
    nlohmann::json all = nlohmann::json::array();
    std::cout << kProg << " " << apps::utc_now_iso() << "\n";
    for (std::size_t i = 0; i < cli.cases.size(); ++i) {
      const CaseConfig& c = cli.cases[i];
      std::fprintf(stderr, "%s: case %zu/%zu: %s %s N=%lld H=%lld V=%lld %s budget %g MiB\n", kProg,
                   i + 1, cli.cases.size(), c.loss.c_str(), c.device.c_str(),
                   static_cast<long long>(c.rows), static_cast<long long>(c.hidden),
                   static_cast<long long>(c.vocab), std::string(dtype_name(c.dtype)).c_str(),
                   c.budget_mib);
      std::unique_ptr<BenchDevice> dev = make_cpu_device(c.threads);
      CaseRecord rec{c, find_runner(c.loss, c.device)(c, *dev), case_command(argv[0], c),
                     apps::utc_now_iso()};
      std::cout << case_details(rec) << std::flush;
      all.push_back(case_json(rec, invoked));
      records.push_back(std::move(rec));
      if (!cli.json.empty()) apps::write_file_atomic(cli.json, all.dump(2) + "\n");
    }
    std::cout << "\n" << table_markdown(records) << "\ncommand: " << invoked << "\n";
    if (!cli.json.empty()) std::cout << "json: " << cli.json << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", kProg, one_line(e.what()).c_str());
    return apps::kExitFailure;
  }
  return 0;
}
