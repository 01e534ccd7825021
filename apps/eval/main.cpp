// chunkloss-eval: held-out metrics of one or more checkpoints on the bundled task: token loss and
// perplexity, preference accuracy (the model's own log-probs, and implicit rewards against a
// reference), and greedy exact-match accuracy. Prints a table (one row per model); --json FILE
// writes the same numbers for machines.
#include <chunkloss/apps/app_main.h>
#include <chunkloss/apps/cli.h>
#include <chunkloss/apps/tuning.h>
#include <chunkloss/core/error.h>
#include <chunkloss/data/jsonl.h>
#include <chunkloss/model/checkpoint.h>
#include <chunkloss/model/generate.h>
#include <chunkloss/model/safetensors.h>
#include <omp.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

namespace po = boost::program_options;
namespace apps = chunkloss::apps;
using namespace chunkloss;

namespace {

constexpr const char* kProg = "chunkloss-eval";

struct Settings {
  std::vector<std::string> models, names;
  std::string reference, sft_file, pref_file, json;
  std::string config_file;  ///< --config
  double beta = 0.1;
  std::int64_t batch_size = 64, max_new_tokens = 8, limit = 0;
  int threads = 1;
  std::string device = "cpu";
  std::size_t budget_bytes = 0;
};

std::optional<Settings> parse(int argc, char** argv) {
  po::options_description desc(std::string("Usage: ") + kProg +
                               " --model DIR [--model DIR ...] [options]\nEvaluates checkpoints "
                               "on held-out data and prints one table row per model.\nOptions");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help and exit")
    ("config", po::value<std::string>()->default_value("", "none"), "read options from this INI file (key = value, keys are the long option names; the command line wins)")
    ("model", po::value<std::vector<std::string>>()->default_value({}, "none, required"), "checkpoint directory to evaluate; repeat for several rows")
    ("name", po::value<std::vector<std::string>>()->default_value({}, "the directory names"), "row label for each --model, in order")
    ("reference", po::value<std::string>()->default_value("", "none"), "reference checkpoint for the implicit rewards beta * (logp - logp_ref) (e.g. the SFT model)")
    ("beta", po::value<double>()->default_value(0.1), "beta of the implicit rewards")
    ("sft-file", po::value<std::string>()->default_value(apps::bundled_data("sft_eval.jsonl")), "held-out {prompt, completion} JSONL: loss, perplexity, exact match")
    ("pref-file", po::value<std::string>()->default_value(apps::bundled_data("pref_eval.jsonl")), "held-out {prompt, chosen, rejected} JSONL: preference accuracy and margins")
    ("max-new-tokens", po::value<std::int64_t>()->default_value(8), "greedy decoding length limit, EOS included (stops at EOS): an answer of N bytes needs N + 1")
    ("limit", po::value<std::int64_t>()->default_value(0, "0 = all"), "evaluate only the first this many examples of each file")
    ("batch-size", po::value<std::int64_t>()->default_value(64), "examples per forward pass (of the preference file, pairs: twice as many sequences)")
    ("threads", po::value<int>()->default_value(1), "CPU threads (0: all cores)")
    ("device", po::value<std::string>()->default_value("cpu"), "where the loss passes run: cpu | cuda (CUDA device 0; the model runs on the CPU)")
    ("budget-mib", po::value<double>()->default_value(0, "0 = the library's default: 256 on the CPU, 1024 on CUDA"), "the losses' workspace budget in MiB")
    ("json", po::value<std::string>()->default_value("", "none"), "also write the results as a JSON array to this file (atomically)");
  // clang-format on
  po::variables_map vm;
  apps::store_command_line(argc, argv, desc, vm);
  if (vm.count("help")) {
    std::cout << desc << "\n";
    return std::nullopt;
  }
  const std::string config_file = apps::path_option(vm, "config");
  if (!config_file.empty()) apps::store_config_file(config_file, desc, vm);
  po::notify(vm);
  apps::check_utf8_options(vm);
  Settings s;
  s.config_file = config_file;
  s.models = vm["model"].as<std::vector<std::string>>();
  if (s.models.empty()) throw apps::UsageError("--model DIR is required");
  for (const std::string& dir : s.models) apps::check_checkpoint_dir("model", dir);
  s.names = vm["name"].as<std::vector<std::string>>();
  if (!s.names.empty() && s.names.size() != s.models.size())
    throw apps::UsageError("--name: " + std::to_string(s.names.size()) + " names for " +
                           std::to_string(s.models.size()) + " models");
  for (std::size_t i = s.names.size(); i < s.models.size(); ++i) {
    std::filesystem::path dir(s.models[i]);
    if (!dir.has_filename()) dir = dir.parent_path();  // "DIR/"
    s.names.push_back(dir.filename().string());
  }
  s.reference = apps::path_option(vm, "reference");
  if (!s.reference.empty()) apps::check_checkpoint_dir("reference", s.reference);
  s.beta = vm["beta"].as<double>();
  if (!(s.beta > 0 && s.beta < 1e6))
    throw apps::UsageError("--beta: " + apps::number(s.beta) + " is not in (0, 1e6)");
  s.sft_file = vm["sft-file"].as<std::string>();
  s.pref_file = vm["pref-file"].as<std::string>();
  for (const auto& [option, path] : {std::pair{"sft-file", s.sft_file}, {"pref-file", s.pref_file}})
    apps::check_input_file(option, path);
  s.max_new_tokens = apps::in_range<std::int64_t>(vm, "max-new-tokens", 1, 4096);
  s.limit = vm["limit"].as<std::int64_t>();
  if (s.limit < 0) throw apps::UsageError("--limit: " + std::to_string(s.limit) + " is not >= 0");
  s.batch_size = apps::in_range<std::int64_t>(vm, "batch-size", 1, 1 << 20);
  s.device = vm["device"].as<std::string>();
  if (const std::string bad = apps::LossDevice::usage_error(s.device); !bad.empty())
    throw apps::UsageError(bad);
  s.threads = apps::in_range<int>(vm, "threads", 0, 4096);
  s.budget_bytes = apps::budget_bytes(vm["budget-mib"].as<double>(), s.device);
  s.json = apps::path_option(vm, "json");
  return s;
}

template <typename T>
std::vector<T> first(std::vector<T> v, std::int64_t limit) {
  if (limit > 0 && static_cast<std::size_t>(limit) < v.size())
    v.resize(static_cast<std::size_t>(limit));
  return v;
}

// Index ranges [begin, end) of consecutive batches.
std::vector<std::vector<std::size_t>> batches(std::size_t n, std::int64_t size) {
  std::vector<std::vector<std::size_t>> out;
  for (std::size_t b = 0; b < n; b += static_cast<std::size_t>(size)) {
    out.emplace_back();
    for (std::size_t i = b; i < std::min(n, b + static_cast<std::size_t>(size)); ++i)
      out.back().push_back(i);
  }
  return out;
}

struct Data {
  std::vector<data::SftExample> sft;
  std::vector<data::Sequence> sft_seqs;
  std::vector<data::PreferenceSequences> pairs;
  apps::Longest longest_sft, longest_pair;

  // Throws when a sequence is longer than the positions of a model of `config`.
  // `model` names the checkpoint; a reference (`with_sft` false) runs on the pairs only.
  void check_fits(const model::LlamaConfig& config, const std::string& model, bool with_sft,
                  const Settings& s) const {
    const char* hint = "this app does not truncate: use shorter examples or --limit";
    if (with_sft) apps::check_fits(longest_sft, s.sft_file, config, model, hint);
    apps::check_fits(longest_pair, s.pref_file, config, model, hint);
  }
};

// Per-sequence log-probs of every pair: [pair] -> (chosen, rejected).
std::vector<std::pair<double, double>> pair_logps(apps::LossDevice& dev, model::LlamaModel& m,
                                                  const Data& d, const Settings& s) {
  std::vector<std::pair<double, double>> out;
  for (const auto& idx : batches(d.pairs.size(), s.batch_size)) {
    const data::Batch b = data::collate_preference(d.pairs, idx);
    const SequenceLogProbResult r = apps::sequence_logps(dev, m, b, s.budget_bytes);
    for (std::size_t i = 0; i < idx.size(); ++i)
      out.emplace_back(r.logps[i], r.logps[i + idx.size()]);
  }
  return out;
}

nlohmann::json evaluate(apps::LossDevice& dev, model::LlamaModel& m, const Data& d,
                        const Settings& s, const std::vector<std::pair<double, double>>* ref) {
  nlohmann::json r;
  double loss_sum = 0, acc_sum = 0, rows = 0;
  for (const auto& idx : batches(d.sft_seqs.size(), s.batch_size)) {
    const CrossEntropyResult ce =
        apps::batch_cross_entropy(dev, m, data::collate_sft(d.sft_seqs, idx), s.budget_bytes);
    const auto n = static_cast<double>(ce.valid_rows);
    loss_sum += ce.loss * n;
    acc_sum += ce.accuracy * n;
    rows += n;
  }
  r["eval_loss"] = loss_sum / rows;
  // (left out where it overflows a double, at a loss above about 709.78: JSON has no inf)
  if (const double ppl = std::exp(loss_sum / rows); std::isfinite(ppl)) r["perplexity"] = ppl;
  r["token_accuracy"] = acc_sum / rows;

  const auto lp = pair_logps(dev, m, d, s);
  double logp_acc = 0, logp_margin = 0, avg_acc = 0;
  for (std::size_t i = 0; i < lp.size(); ++i) {
    const auto [c, rj] = lp[i];
    logp_acc += c > rj ? 1 : 0;
    logp_margin += c - rj;
    // (log-probs per completion token)
    const double avg_c = c / static_cast<double>(d.pairs[i].chosen.count_targets());
    const double avg_r = rj / static_cast<double>(d.pairs[i].rejected.count_targets());
    avg_acc += avg_c > avg_r ? 1 : 0;
  }
  const auto np = static_cast<double>(lp.size());
  r["logps/accuracy"] = logp_acc / np;
  r["logps/margin"] = logp_margin / np;
  r["logps/avg_accuracy"] = avg_acc / np;
  if (ref) {
    double acc = 0, margin = 0, chosen = 0, rejected = 0;
    for (std::size_t i = 0; i < lp.size(); ++i) {
      const double rc = s.beta * (lp[i].first - (*ref)[i].first);
      const double rr = s.beta * (lp[i].second - (*ref)[i].second);
      acc += rc > rr ? 1 : 0;
      margin += rc - rr;
      chosen += rc;
      rejected += rr;
    }
    r["rewards/accuracies"] = acc / np;
    r["rewards/margins"] = margin / np;
    r["rewards/chosen"] = chosen / np;
    r["rewards/rejected"] = rejected / np;
  }

  const data::ByteTokenizer tok;
  model::GenerateOptions g;
  g.max_new_tokens = s.max_new_tokens;
  g.eos_id = tok.eos_id();
  double exact = 0;
  for (const data::SftExample& ex : d.sft) {
    const model::GenerateResult out = model::generate(m, apps::prompt_ids(tok, ex.prompt), g);
    exact += apps::exact_match(tok, out, ex.completion) ? 1 : 0;
  }
  r["exact_match"] = exact / static_cast<double>(d.sft.size());
  return r;
}

std::string cell(const nlohmann::json& r, const char* key, const char* fmt) {
  if (!r.contains(key)) return "-";
  const double v = r[key].get<double>();
  std::string out(static_cast<std::size_t>(std::snprintf(nullptr, 0, fmt, v)), '\0');
  std::snprintf(out.data(), out.size() + 1, fmt, v);
  return out;
}

// A row label as a table cell: control characters escaped (one_line), '|' written as "\|".
std::string label_cell(const std::string& name) {
  std::string out;
  for (const char ch : apps::one_line(name)) {
    if (ch == '|') out += '\\';
    out += ch;
  }
  return out;
}

void print_table(const std::vector<nlohmann::json>& rows, const Settings& s) {
  const std::vector<std::pair<const char*, const char*>> cols = {
      {"eval_loss", "%.4f"},          {"perplexity", "%#.4g"},    {"token_accuracy", "%.3f"},
      {"exact_match", "%.3f"},        {"logps/accuracy", "%.3f"}, {"logps/avg_accuracy", "%.3f"},
      {"rewards/accuracies", "%.3f"}, {"rewards/margins", "%.3f"}};
  const std::vector<std::string> heads = {"model",        "loss",        "ppl",
                                          "token acc",    "exact match", "pref acc",
                                          "avg pref acc", "reward acc",  "margin"};
  std::vector<std::vector<std::string>> table = {heads};
  for (const nlohmann::json& r : rows) {
    std::vector<std::string> line = {label_cell(r["name"].get<std::string>())};
    for (const auto& [k, f] : cols) line.push_back(cell(r, k, f));
    table.push_back(line);
  }
  std::vector<std::size_t> w(heads.size(), 0);
  for (const auto& line : table)
    for (std::size_t c = 0; c < line.size(); ++c) w[c] = std::max(w[c], line[c].size());
  for (std::size_t i = 0; i < table.size(); ++i) {
    std::string out = "|";
    for (std::size_t c = 0; c < table[i].size(); ++c) {
      const std::string& v = table[i][c];
      const std::string pad(w[c] - v.size(), ' ');
      out.append(" ").append(c == 0 ? v : pad).append(c == 0 ? pad : v).append(" |");
    }
    std::printf("%s\n", out.c_str());
    if (i == 0) {
      std::string sep = "|";
      for (std::size_t c = 0; c < w.size(); ++c) sep += std::string(w[c] + 2, '-') + "|";
      std::printf("%s\n", sep.c_str());
    }
  }
  std::printf(
      "\nloss/ppl/token acc: %s (completion tokens; ppl '-' where exp(loss) overflows); exact "
      "match: greedy decoding of its prompts; "
      "pref acc: logp(chosen) > logp(rejected) on %s (avg: per completion token, the "
      "ordering of ORPO's and SimPO's rewards); reward acc, margin: beta=%g implicit rewards "
      "against %s\n",
      s.sft_file.c_str(), s.pref_file.c_str(), s.beta,
      s.reference.empty() ? "(no --reference)" : s.reference.c_str());
}

int run(const Settings& s) {
  if (s.threads > 0) omp_set_num_threads(s.threads);
  const int threads = s.threads > 0 ? s.threads : omp_get_max_threads();
  apps::check_threads_start("--threads " + std::to_string(s.threads) +
                                (s.threads > 0 ? "" : " (" + std::to_string(threads) + " threads)"),
                            threads - 1);
  if (!s.json.empty()) {  // before any work: a file that overwrites no input
    std::vector<std::string> checkpoints = s.models;
    checkpoints.push_back(s.reference);
    apps::check_not_checkpoint_file("json", s.json, checkpoints);
    apps::prepare_output_file(
        "json", s.json,
        {{"--sft-file", s.sft_file}, {"--pref-file", s.pref_file}, {"--config", s.config_file}});
  }
  apps::LossDevice dev(s.device, s.threads);
  const data::ByteTokenizer tok;
  Data d;
  d.sft = first(data::read_sft_jsonl(s.sft_file), s.limit);
  d.sft_seqs = data::encode_sft(tok, d.sft);
  const std::vector<data::PreferenceExample> pref =
      first(data::read_preference_jsonl(s.pref_file), s.limit);
  d.pairs = data::encode_preference(tok, pref);
  for (std::size_t i = 0; i < d.sft_seqs.size(); ++i)
    d.longest_sft.take(d.sft_seqs[i], d.sft[i].line);
  for (std::size_t i = 0; i < d.pairs.size(); ++i) d.longest_pair.take(d.pairs[i], pref[i].line);

  // Every checkpoint read in full (config, weights, their save id and finite values), and its
  // vocabulary and positions checked against the data, before any pass runs: a bad later
  // --model fails the run before the earlier ones take their time. Each is read again when its
  // turn comes, so only one model is held at a time.
  for (const std::string& dir : s.models) {
    const model::LlamaConfig config = model::load_model(dir).config();
    apps::check_tokenizer(config, "--model " + dir);
    d.check_fits(config, "--model " + dir, true, s);
  }
  if (!s.reference.empty()) {
    const model::LlamaConfig config = model::load_config(s.reference);
    apps::check_tokenizer(config, "--reference " + s.reference);
    d.check_fits(config, "--reference " + s.reference, false, s);
  }

  // Exact match needs a completion's bytes and its EOS within --max-new-tokens (noted after the
  // checks, so that a refused run prints its error alone).
  std::size_t too_long = 0, longest = 0;
  for (std::size_t i = 0; i < d.sft_seqs.size(); ++i) {
    const std::int64_t need = d.sft_seqs[i].count_targets();
    if (need > s.max_new_tokens) ++too_long;
    if (need > d.sft_seqs[longest].count_targets()) longest = i;
  }
  if (too_long > 0)
    std::fprintf(stderr,
                 "%s: note: %zu of %zu completions in %s need more than --max-new-tokens %lld "
                 "(their bytes and EOS; line %lld needs %lld), so they cannot match exactly\n",
                 kProg, too_long, d.sft_seqs.size(), s.sft_file.c_str(),
                 static_cast<long long>(s.max_new_tokens),
                 static_cast<long long>(d.sft[longest].line),
                 static_cast<long long>(d.sft_seqs[longest].count_targets()));

  std::optional<std::vector<std::pair<double, double>>> ref;
  if (!s.reference.empty()) {
    model::LlamaModel r = model::load_model(s.reference);
    ref = pair_logps(dev, r, d, s);
    for (std::size_t i = 0; i < ref->size(); ++i)  // (else every --model's rewards would be)
      CHUNKLOSS_CHECK(std::isfinite((*ref)[i].first) && std::isfinite((*ref)[i].second),
                      "--reference ", s.reference, ": its log-probs of the pair of ", s.pref_file,
                      ":", pref[i].line, " are ", (*ref)[i].first, " (chosen) and ",
                      (*ref)[i].second,
                      " (rejected); the model's outputs are not finite: a diverged or damaged "
                      "checkpoint?");
  }
  std::vector<nlohmann::json> rows;
  for (std::size_t i = 0; i < s.models.size(); ++i) {
    model::LlamaModel m = model::load_model(s.models[i]);
    nlohmann::json r = evaluate(dev, m, d, s, ref ? &*ref : nullptr);
    for (const auto& [key, value] : r.items())  // (--json would record null)
      CHUNKLOSS_CHECK(std::isfinite(value.get<double>()), "--model ", s.models[i], ": its ", key,
                      " on the held-out data is ", value.get<double>(),
                      " (the model's outputs are not finite: a diverged or damaged checkpoint?)");
    r["name"] = s.names[i];
    r["model"] = s.models[i];
    if (!s.reference.empty()) r["reference"] = s.reference;
    rows.push_back(r);
  }
  print_table(rows, s);
  if (!s.json.empty()) model::write_file_atomically(s.json, nlohmann::json(rows).dump(2) + "\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return apps::guarded_main(
      kProg, [&] { return parse(argc, argv); }, [](const Settings& s) { return run(s); });
}
