// chunkloss-train: trains the shared-model layer's Llama-style decoder on the CPU with one of the
// library's losses, run on the CPU or a CUDA device: SFT with cross-entropy, or preference tuning
// (DPO, ORPO, SimPO, CPO, KTO) or online GRPO from an SFT checkpoint. Options from the command line
// and/or an INI file; progress on stderr; metrics appended to a JSONL file; an SVG chart of the
// curves at the end; exact resume.
#include <chunkloss/apps/app_main.h>
#include <chunkloss/apps/chart.h>
#include <chunkloss/apps/cli.h>
#include <chunkloss/apps/progress.h>
#include <chunkloss/apps/tuning.h>
#include <chunkloss/core/error.h>
#include <chunkloss/data/jsonl.h>
#include <chunkloss/data/sampler.h>
#include <chunkloss/dist/communicator.h>
#include <chunkloss/losses/preference.h>
#include <chunkloss/model/checkpoint.h>
#include <chunkloss/model/optim.h>
#include <chunkloss/model/safetensors.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>
#include <span>
#include <system_error>
#include <thread>
#include <vector>

#include "trainers.h"

namespace po = boost::program_options;
namespace apps = chunkloss::apps;
using namespace chunkloss;
using namespace chunkloss::train;

namespace {

constexpr const char* kProg = "chunkloss-train";
const std::vector<std::string> kLosses = {"ce", "dpo", "orpo", "simpo", "cpo", "kto", "grpo"};
// The loss options and the losses that take each (--budget-mib is every loss's); giving one to
// another loss is a usage error rather than silently ignored.
const std::vector<std::pair<std::string, std::vector<std::string>>> kLossOptions = {
    {"beta", {"dpo", "orpo", "simpo", "cpo", "kto", "grpo"}},
    {"label-smoothing", {"ce", "dpo", "simpo", "cpo"}},
    {"z-loss", {"ce"}},
    {"skip-ignored-rows", {"ce"}},
    {"dpo-loss-type", {"dpo"}},
    {"discopop-tau", {"dpo"}},
    {"rpo-alpha", {"dpo"}},
    {"gamma", {"simpo"}},
    {"simpo-alpha", {"simpo"}},
    {"cpo-alpha", {"cpo"}},
    {"desirable-weight", {"kto"}},
    {"undesirable-weight", {"kto"}},
    {"num-generations", {"grpo"}},
    {"temperature", {"grpo"}},
    {"max-completion-length", {"grpo"}},
    {"grpo-loss-type", {"grpo"}},
    {"scale-rewards", {"grpo"}},
    {"mask-truncated-completions", {"grpo"}},
    {"num-iterations", {"grpo"}},
    {"epsilon", {"grpo"}},
    {"epsilon-high", {"grpo"}},
    {"delta", {"grpo"}},
    {"importance-sampling-level", {"grpo"}}};
// The model options and their LlamaConfig fields (with --init or --resume, the checkpoint's).
const std::vector<std::pair<std::string, std::int64_t (*)(const model::LlamaConfig&)>>
    kArchitecture = {
        {"hidden-size", [](const model::LlamaConfig& c) { return c.hidden_size; }},
        {"intermediate-size", [](const model::LlamaConfig& c) { return c.intermediate_size; }},
        {"layers", [](const model::LlamaConfig& c) { return c.num_hidden_layers; }},
        {"heads", [](const model::LlamaConfig& c) { return c.num_attention_heads; }},
        {"kv-heads", [](const model::LlamaConfig& c) { return c.num_key_value_heads; }},
        {"max-positions", [](const model::LlamaConfig& c) { return c.max_position_embeddings; }},
        {"tie-embeddings",
         [](const model::LlamaConfig& c) { return std::int64_t{c.tie_word_embeddings}; }}};

struct Settings {
  DataSettings data;
  LossSettings loss;
  model::LlamaConfig config;
  std::vector<std::string> architecture_given;  ///< model options set with --init or --resume
  std::uint64_t seed = 0;
  std::string device = "cpu";
  bool measured_gemms = false;
  int threads = 1;
  int data_parallel = 1;
  int vocab_parallel = 1;
  std::string init, resume, save, metrics, chart;
  bool resume_inexact = false;  ///< --resume may change the options that only round differently
  std::string config_file;      ///< --config (an input no output may overwrite)
  std::int64_t steps = 0, batch_size = 0, grad_accum = 1, log_every = 0, save_every = 0;
  model::LrSchedule schedule;
  model::AdamWOptions adam;
  double max_grad_norm = 1.0;
};

// Whether the run has a frozen reference model: DPO's and KTO's, and GRPO's for its KL term.
bool uses_reference(const LossSettings& l) {
  return l.loss == "dpo" || l.loss == "kto" || (l.loss == "grpo" && l.beta > 0);
}

std::string default_train_file(const std::string& loss) {
  if (loss == "ce" || loss == "grpo") return apps::bundled_data("sft_train.jsonl");
  if (loss == "kto") return apps::bundled_data("kto_train.jsonl");
  return apps::bundled_data("pref_train.jsonl");
}

// Parses the command line (and --config FILE); nullopt after --help.
std::optional<Settings> parse(int argc, char** argv) {
  po::options_description general("General");
  // clang-format off
  general.add_options()
    ("help,h", "print this help and exit")
    ("config", po::value<std::string>()->default_value("", "none"), "read options from this INI file (key = value, keys are the long option names; the command line wins)")
    ("loss", po::value<std::string>()->default_value("ce"), "ce (SFT) | dpo | orpo | simpo | cpo | kto | grpo (online: completions sampled from the policy, rewarded by exact match)")
    ("device", po::value<std::string>()->default_value("cpu"), "where the loss runs: cpu | cuda (CUDA device 0; each step's hidden states and lm_head are copied there and the gradients back; the model layer runs on the CPU)")
    ("gemm-selection", po::value<std::string>()->default_value("default"), "with --device cuda: default (cuBLAS's own algorithm for each GEMM shape, the same bits in every run) | measured (cuBLAS's and cuBLASLt's candidates timed on each shape's first calls, the fastest kept: faster on large heads, exact, but bits may differ between runs)")
    ("threads", po::value<int>()->default_value(1), "CPU threads for the model and the loss (0: all cores; the bundled model is too small to gain from more than 1); the results differ by rounding between thread counts, so --resume asks for the same (see --resume-inexact)")
    ("data-parallel", po::value<int>()->default_value(1), "ranks of a data group, threads of this process: each holds a model replica and takes its part of every micro-batch; their loss calls share the library's data group (the loss, metrics and gradients of the whole micro-batch) and the gradients are summed over them before each optimizer step; --threads is split between them; an epoch's last short micro-batch is dropped; with --device cuda every rank's loss runs on device 0")
    ("vocab-parallel", po::value<int>()->default_value(1), "ranks of a vocabulary split, threads of this process: each holds a model replica, steps on the same examples and passes its rows [V r / K, V (r + 1) / K) of the lm_head to the loss calls, which share the library's vocabulary split (vocab_shard); rank 0 runs the model's backward, the others add their rows' lm_head gradient; with --data-parallel D the D x K ranks form a grid; with --device cuda every rank's loss runs on device 0")
    ("seed", po::value<std::int64_t>()->default_value(0), "seed of the model init and the data order (>= 0)");
  po::options_description data_opts("Data");
  data_opts.add_options()
    ("train-file", po::value<std::string>()->default_value("", "the bundled file for --loss"), "training JSONL: {prompt, completion} (ce; grpo: the completion is the answer a sample must match), {prompt, chosen, rejected} (dpo, orpo, simpo, cpo), {prompt, completion, label} (kto)")
    ("max-length", po::value<std::int64_t>()->default_value(64), "truncate sequences to this many positions (0: no limit)")
    ("max-prompt-length", po::value<std::int64_t>()->default_value(0, "0 = no limit"), "keep the last this many prompt bytes")
    ("batch-size", po::value<std::int64_t>()->default_value(32), "examples per micro-batch (pairs for the paired losses)");
  po::options_description model_opts("Model (a new model; with --init or --resume the checkpoint's config.json decides)");
  model_opts.add_options()
    ("hidden-size", po::value<std::int64_t>()->default_value(64), "hidden size H")
    ("intermediate-size", po::value<std::int64_t>()->default_value(176), "SwiGLU intermediate size")
    ("layers", po::value<std::int64_t>()->default_value(2), "decoder layers")
    ("heads", po::value<std::int64_t>()->default_value(4), "attention heads")
    ("kv-heads", po::value<std::int64_t>()->default_value(4), "key/value heads (< heads: grouped-query attention)")
    ("max-positions", po::value<std::int64_t>()->default_value(64), "max_position_embeddings")
    ("tie-embeddings", po::value<std::string>()->default_value("0"), "tie lm_head to the token embedding")
    ("init", po::value<std::string>()->default_value("", "none"), "start from this checkpoint directory (the SFT model): the policy, and for dpo/kto (grpo with --beta) also the frozen reference (not with --resume, which takes the --init its run was saved with)")
    ("resume", po::value<std::string>()->default_value("", "none"), "continue the run saved in this directory (model, optimizer, step) exactly")
    ("resume-inexact", po::value<std::string>()->default_value("0"), "with --resume: let the options that change only the rounding (--threads, --device, --gemm-selection, --budget-mib, --vocab-parallel) differ from the saved run's, as on another machine; the run continues the same optimisation, its numbers then differ from an uninterrupted run's by rounding, and a warning names each change");
  po::options_description optim("Optimiser");
  optim.add_options()
    ("steps", po::value<std::int64_t>()->default_value(300), "optimizer steps in total")
    ("lr", po::value<double>()->default_value(3e-3), "peak learning rate")
    ("warmup-steps", po::value<std::int64_t>()->default_value(20), "linear warmup steps (left at its default: at most --steps)")
    ("min-lr-ratio", po::value<double>()->default_value(0.1), "cosine decay floor as a fraction of --lr")
    ("weight-decay", po::value<double>()->default_value(0.0), "AdamW decoupled weight decay (not on RMSNorm weights)")
    ("beta1", po::value<double>()->default_value(0.9), "AdamW beta1")
    ("beta2", po::value<double>()->default_value(0.999), "AdamW beta2")
    ("adam-eps", po::value<double>()->default_value(1e-8), "AdamW epsilon")
    ("max-grad-norm", po::value<double>()->default_value(1.0), "clip the global gradient norm (0: off)")
    ("grad-accum", po::value<std::int64_t>()->default_value(1), "micro-batches per optimizer step (ce: the step is the mean over all their tokens; the preference losses' micro-batch means count equally, as in TRL)");
  po::options_description loss_opts("Loss (the formulas are in chunkloss/losses/preference.h; an option another --loss takes is refused)");
  loss_opts.add_options()
    ("beta", po::value<double>()->default_value(0, "0 = the loss's default: 0.1, simpo 2.0, grpo 0"), "beta of dpo, orpo, simpo, cpo, kto; grpo: weight of the k3 KL to the --init model (0: no KL term, no reference)")
    ("label-smoothing", po::value<double>()->default_value(0), "ce: label smoothing; dpo, simpo, cpo: the conservative eps")
    ("z-loss", po::value<double>()->default_value(0, "0 = off"), "ce: weight of the z-loss, z_loss * lse^2 per valid token, added to the loss (reported as z_loss)")
    ("skip-ignored-rows", po::value<std::string>()->default_value("1"), "ce: leave the rows of long runs of ignored targets (prompts, padding) out of the loss's GEMMs (CrossEntropyOptions::skip_ignored_rows); the results agree to rounding")
    ("dpo-loss-type", po::value<std::string>()->default_value("sigmoid"), "dpo: sigmoid, hinge, ipo, robust, exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, discopop")
    ("discopop-tau", po::value<double>()->default_value(0.05, "0.05"), "dpo --dpo-loss-type discopop: its temperature tau (> 0)")
    ("rpo-alpha", po::value<double>()->default_value(0, "0 = off"), "dpo: weight of the NLL term on chosen tokens (RPO)")
    ("gamma", po::value<double>()->default_value(0.5), "simpo: target margin in reward units")
    ("simpo-alpha", po::value<double>()->default_value(0, "0 = off"), "simpo: weight of the NLL term on chosen tokens")
    ("cpo-alpha", po::value<double>()->default_value(1.0), "cpo: weight of the NLL term")
    ("desirable-weight", po::value<double>()->default_value(1.0), "kto: weight of desirable examples")
    ("undesirable-weight", po::value<double>()->default_value(1.0), "kto: weight of undesirable examples")
    ("num-generations", po::value<std::int64_t>()->default_value(8), "grpo: completions sampled per prompt, a group (>= 2)")
    ("temperature", po::value<double>()->default_value(1.0), "grpo: sampling temperature (> 0); the loss's log-probs (and the reference's) are those of the logits divided by it, as TRL's")
    ("max-completion-length", po::value<std::int64_t>()->default_value(16), "grpo: new tokens a completion may have, EOS included (>= 1)")
    ("grpo-loss-type", po::value<std::string>()->default_value("grpo"), "grpo: grpo (each completion's token mean, then the mean), bnpo (the token mean), dr_grpo (the token sum over completions x --max-completion-length)")
    ("scale-rewards", po::value<std::string>()->default_value("group"), "grpo: group (advantages divided by the group's reward standard deviation) | batch (by the micro-batch's, over --data-parallel ranks too; TRL's is over the step's micro-batches, the same with --grad-accum 1) | none (Dr. GRPO)")
    ("mask-truncated-completions", po::value<std::string>()->default_value("0"), "grpo: leave the completions cut at --max-completion-length (no EOS) out of the loss; their rewards still count in the advantages")
    ("num-iterations", po::value<std::int64_t>()->default_value(1), "grpo: optimizer steps on each batch of rollouts (TRL's num_iterations; the steps of one batch take the same micro-batches, and --save-every must be a multiple)")
    ("epsilon", po::value<double>()->default_value(0.2), "grpo: ratios below 1 - epsilon are clipped (acts from the second of --num-iterations on)")
    ("epsilon-high", po::value<double>()->default_value(0, "0 = --epsilon"), "grpo: ratios above 1 + epsilon-high are clipped (DAPO: 0.28)")
    ("delta", po::value<double>()->default_value(0, "0 = off"), "grpo: cap of the unclipped ratio (two-sided clipping; > 1 + epsilon-high)")
    ("importance-sampling-level", po::value<std::string>()->default_value("token"), "grpo: token (each token's ratio) | sequence (GSPO: the completion's length-normalised ratio)")
    ("budget-mib", po::value<double>()->default_value(0, "0 = the library's default: 256 on the CPU, 1024 on CUDA"), "the loss's workspace budget in MiB");
  po::options_description output("Output");
  output.add_options()
    ("save", po::value<std::string>()->default_value("", "none"), "save the checkpoint (HF layout + optimizer state) into this directory at the end")
    ("save-every", po::value<std::int64_t>()->default_value(0, "0 = only at the end"), "also save every this many steps, into SAVE/checkpoint-STEP")
    ("metrics", po::value<std::string>()->default_value("", "SAVE/metrics.jsonl"), "one JSON object per step in this file, replaced atomically at the end (a new run starts it afresh; --resume starts from the records saved in the checkpoint it resumes, and appends); during the run the records go to FILE.partial, and each checkpoint saves those up to its step (trainer_state.json's log_history)")
    ("chart", po::value<std::string>()->default_value("", "SAVE/training.svg"), "write the SVG chart of loss and accuracy here at the end (drawn from --metrics, so it needs --metrics or --save)")
    ("log-every", po::value<std::int64_t>()->default_value(25), "plain progress line every this many steps when stderr is not a terminal");
  // clang-format on
  po::options_description all(std::string("Usage: ") + kProg +
                              " [options]\nTrains a small Llama-style model (on the CPU) with a "
                              "chunkloss loss (on the CPU or CUDA).\nOptions");
  all.add(general).add(data_opts).add(model_opts).add(optim).add(loss_opts).add(output);

  po::variables_map vm;
  apps::store_command_line(argc, argv, all, vm);
  if (vm.count("help")) {
    std::cout << all << "\n";
    return std::nullopt;
  }
  const std::string config_file = apps::path_option(vm, "config");
  if (!config_file.empty()) apps::store_config_file(config_file, all, vm);
  po::notify(vm);
  apps::check_utf8_options(vm);

  Settings s;
  s.config_file = config_file;
  s.loss.loss = vm["loss"].as<std::string>();
  if (std::find(kLosses.begin(), kLosses.end(), s.loss.loss) == kLosses.end())
    throw apps::UsageError("--loss: '" + s.loss.loss +
                           "' is not ce, dpo, orpo, simpo, cpo, kto or grpo");
  s.device = vm["device"].as<std::string>();
  if (const std::string bad = LossDevice::usage_error(s.device); !bad.empty())
    throw apps::UsageError(bad);
  const std::string selection = vm["gemm-selection"].as<std::string>();
  if (selection != "default" && selection != "measured")
    throw apps::UsageError("--gemm-selection: '" + selection + "' is not default or measured");
  s.measured_gemms = selection == "measured";
  if (s.measured_gemms && s.device != "cuda")
    throw apps::UsageError("--gemm-selection measured is for --device cuda");
  s.threads = apps::in_range<int>(vm, "threads", 0, 4096);
  s.data_parallel = apps::in_range<int>(vm, "data-parallel", 1, 256);
  s.vocab_parallel = apps::in_range<int>(vm, "vocab-parallel", 1, 256);
  if (s.data_parallel * s.vocab_parallel > 256)  // threads, each with a model replica
    throw apps::UsageError("--data-parallel " + std::to_string(s.data_parallel) +
                           " x --vocab-parallel " + std::to_string(s.vocab_parallel) +
                           " is more than 256 ranks");
  s.seed = static_cast<std::uint64_t>(
      apps::in_range<std::int64_t>(vm, "seed", 0, std::numeric_limits<std::int64_t>::max()));

  s.data.file = apps::path_option(vm, "train-file");
  if (s.data.file.empty()) s.data.file = default_train_file(s.loss.loss);
  apps::check_input_file("train-file", s.data.file);
  s.data.encode.max_length = apps::in_range<std::int64_t>(vm, "max-length", 0, 1 << 20);
  s.data.encode.max_prompt_length =
      apps::in_range<std::int64_t>(vm, "max-prompt-length", 0, 1 << 20);
  s.batch_size =
      apps::in_range<std::int64_t>(vm, "batch-size", s.loss.loss == "kto" ? 2 : 1, 1 << 20);
  if (s.batch_size < s.data_parallel)  // every rank needs an example
    throw apps::UsageError("--batch-size " + std::to_string(s.batch_size) +
                           " gives no example to some of the " + std::to_string(s.data_parallel) +
                           " ranks of --data-parallel");

  s.init = apps::path_option(vm, "init");
  s.resume = apps::path_option(vm, "resume");
  if (!s.init.empty() && !s.resume.empty())
    throw apps::UsageError("--init " + s.init + " with --resume " + s.resume +
                           ": a resumed run starts from its own checkpoint and the --init it "
                           "was saved with; give only --resume");
  if (!s.init.empty()) apps::check_checkpoint_dir("init", s.init);
  if (!s.resume.empty()) apps::check_checkpoint_dir("resume", s.resume);
  s.resume_inexact = apps::parse_bool("resume-inexact", vm["resume-inexact"].as<std::string>());
  if (s.resume_inexact && s.resume.empty())
    throw apps::UsageError(
        "--resume-inexact is for --resume, which it lets change the options "
        "that only round differently");
  if (!s.init.empty() || !s.resume.empty()) {
    for (const auto& [name, field] : kArchitecture)
      if (!vm[name].defaulted()) s.architecture_given.push_back(name);
  }
  s.config.hidden_size = apps::in_range<std::int64_t>(vm, "hidden-size", 2, 1 << 16);
  s.config.intermediate_size = apps::in_range<std::int64_t>(vm, "intermediate-size", 1, 1 << 18);
  s.config.num_hidden_layers = apps::in_range<std::int64_t>(vm, "layers", 1, 256);
  s.config.num_attention_heads = apps::in_range<std::int64_t>(vm, "heads", 1, 1024);
  s.config.num_key_value_heads = apps::in_range<std::int64_t>(vm, "kv-heads", 1, 1024);
  s.config.max_position_embeddings = apps::in_range<std::int64_t>(vm, "max-positions", 2, 1 << 20);
  s.config.tie_word_embeddings =
      apps::parse_bool("tie-embeddings", vm["tie-embeddings"].as<std::string>());
  if (s.init.empty() && s.resume.empty()) {
    try {
      model::validate(s.config);
    } catch (const Error& e) {
      throw apps::UsageError(std::string("model options: ") + e.what());
    }
  }

  s.steps = apps::in_range<std::int64_t>(vm, "steps", 1, std::int64_t{1} << 40);
  s.schedule.lr = apps::in_range<double>(vm, "lr", 0, 10);
  s.schedule.warmup_steps = vm["warmup-steps"].defaulted()
                                ? std::min(vm["warmup-steps"].as<std::int64_t>(), s.steps)
                                : apps::in_range<std::int64_t>(vm, "warmup-steps", 0, s.steps);
  s.schedule.min_lr_ratio = apps::in_range<double>(vm, "min-lr-ratio", 0, 1);
  s.schedule.total_steps = s.steps;
  s.adam.weight_decay = apps::in_range<double>(vm, "weight-decay", 0, 10);
  s.adam.beta1 = apps::in_range<double>(vm, "beta1", 0, 0.999999);
  s.adam.beta2 = apps::in_range<double>(vm, "beta2", 0, 0.999999999);
  s.adam.eps = apps::in_range<double>(vm, "adam-eps", 1e-30, 1);
  s.max_grad_norm = apps::in_range<double>(vm, "max-grad-norm", 0, 1e9);
  s.grad_accum = apps::in_range<std::int64_t>(vm, "grad-accum", 1, 1 << 20);

  for (const auto& [option, losses] : kLossOptions) {
    if (vm[option].defaulted() ||
        std::find(losses.begin(), losses.end(), s.loss.loss) != losses.end())
      continue;
    std::string takers;
    for (const std::string& l : losses) takers += (takers.empty() ? "" : ", ") + l;
    throw apps::UsageError("--" + option + ": --loss " + s.loss.loss +
                           " does not take it (it is for " + takers + ")");
  }
  s.loss.beta = apps::in_range<double>(vm, "beta", 0, 1e6);
  s.loss.label_smoothing = apps::in_range<double>(vm, "label-smoothing", 0, 1);
  s.loss.z_loss = apps::in_range<double>(vm, "z-loss", 0, 1e6);
  s.loss.skip_ignored_rows =
      apps::parse_bool("skip-ignored-rows", vm["skip-ignored-rows"].as<std::string>());
  s.loss.dpo_loss_type = vm["dpo-loss-type"].as<std::string>();
  try {
    parse_dpo_loss(s.loss.dpo_loss_type);
  } catch (const Error& e) {
    throw apps::UsageError(std::string("--dpo-loss-type: ") + e.what());
  }
  s.loss.discopop_tau = apps::in_range<double>(vm, "discopop-tau", 0, 1e6);
  if (!vm["discopop-tau"].defaulted() && s.loss.dpo_loss_type != "discopop")
    throw apps::UsageError("--discopop-tau: --dpo-loss-type " + s.loss.dpo_loss_type +
                           " does not take it (it is for discopop)");
  s.loss.rpo_alpha = apps::in_range<double>(vm, "rpo-alpha", 0, 1e6);
  s.loss.gamma = apps::in_range<double>(vm, "gamma", 0, 1e6);
  s.loss.simpo_alpha = apps::in_range<double>(vm, "simpo-alpha", 0, 1e6);
  s.loss.cpo_alpha = apps::in_range<double>(vm, "cpo-alpha", 0, 1e6);
  s.loss.desirable_weight = apps::in_range<double>(vm, "desirable-weight", 0, 1e6);
  s.loss.undesirable_weight = apps::in_range<double>(vm, "undesirable-weight", 0, 1e6);
  s.loss.num_generations = apps::in_range<std::int64_t>(vm, "num-generations", 2, 1 << 16);
  s.loss.temperature = apps::in_range<double>(vm, "temperature", 1e-6, 1e6);
  s.loss.max_completion_length =
      apps::in_range<std::int64_t>(vm, "max-completion-length", 1, 1 << 20);
  s.loss.grpo_loss_type = vm["grpo-loss-type"].as<std::string>();
  s.loss.scale_rewards = vm["scale-rewards"].as<std::string>();
  if (s.loss.scale_rewards != "group" && s.loss.scale_rewards != "batch" &&
      s.loss.scale_rewards != "none")
    throw apps::UsageError("--scale-rewards: '" + s.loss.scale_rewards +
                           "' is not group, batch or none");
  s.loss.mask_truncated_completions = apps::parse_bool(
      "mask-truncated-completions", vm["mask-truncated-completions"].as<std::string>());
  s.loss.num_iterations = apps::in_range<std::int64_t>(vm, "num-iterations", 1, 1 << 20);
  s.loss.epsilon_low = apps::in_range<double>(vm, "epsilon", 0, 0.999999);
  s.loss.epsilon_high = apps::in_range<double>(vm, "epsilon-high", 0, 1e6);
  if (s.loss.epsilon_high == 0) s.loss.epsilon_high = -1;  // (--epsilon's value)
  s.loss.delta = apps::in_range<double>(vm, "delta", 0, 1e6);
  s.loss.importance_sampling_level = vm["importance-sampling-level"].as<std::string>();
  s.loss.budget_bytes = apps::budget_bytes(vm["budget-mib"].as<double>(), s.device);
  if (const std::string bad =
          apps::label_smoothing_error(s.loss.loss, s.loss.dpo_loss_type, s.loss.label_smoothing);
      !bad.empty())
    throw apps::UsageError(bad);
  try {  // whatever else the loss object refuses, refused here too
    check_loss_settings(s.loss);
  } catch (const Error& e) {
    throw apps::UsageError("--loss " + s.loss.loss + " options: " + e.what());
  }

  s.save = apps::path_option(vm, "save");
  s.save_every = apps::in_range<std::int64_t>(vm, "save-every", 0, std::int64_t{1} << 40);
  if (s.save_every > 0 && s.save.empty()) throw apps::UsageError("--save-every needs --save DIR");
  if (s.save_every % s.loss.num_iterations != 0)  // (a resume starts a batch of rollouts)
    throw apps::UsageError("--save-every " + std::to_string(s.save_every) +
                           " is not a multiple of --num-iterations " +
                           std::to_string(s.loss.num_iterations) +
                           ": a run resumes where a batch of rollouts is sampled");
  s.metrics = apps::path_option(vm, "metrics");
  s.chart = apps::path_option(vm, "chart");
  if (!s.save.empty()) {
    if (s.metrics.empty()) s.metrics = (std::filesystem::path(s.save) / "metrics.jsonl").string();
    if (s.chart.empty()) s.chart = (std::filesystem::path(s.save) / "training.svg").string();
  }
  if (!s.chart.empty() && s.metrics.empty())
    throw apps::UsageError("--chart " + s.chart +
                           " needs --metrics FILE or --save DIR (it is drawn from the metrics)");
  s.log_every = apps::in_range<std::int64_t>(vm, "log-every", 1, std::int64_t{1} << 40);
  return s;
}

// A path as saved and compared on resume: absolute, without "." and "..".
std::string absolute_path(const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
  return ec ? std::filesystem::absolute(path).lexically_normal().string() : p.string();
}

// A model option given with --init or --resume must be the checkpoint's.
void check_architecture(const Settings& s, const model::LlamaConfig& checkpoint) {
  for (const auto& [name, field] : kArchitecture) {
    if (std::find(s.architecture_given.begin(), s.architecture_given.end(), name) ==
            s.architecture_given.end() ||
        field(s.config) == field(checkpoint))
      continue;
    throw apps::UsageError("--" + name + " " + std::to_string(field(s.config)) +
                           ": the checkpoint of " + (s.resume.empty() ? "--init " : "--resume ") +
                           (s.resume.empty() ? s.init : s.resume) + " has " +
                           std::to_string(field(checkpoint)) + " (the architecture comes from it)");
  }
}

// A step's metrics from its micro-batches' own (stats[i], of weight weights[i]: see
// Trainer::step_weight), each the value of the one micro-batch that reports it, or else:
// - an unpaired loss's (KTO's: it reports count/chosen and count/rejected) per-label means
//   weighted by the micro-batch's sequences of that label, the counts summed, and the margin the
//   difference of the step's reward means, as TRL's KTO logs them;
// - any other metric's weighted mean over the micro-batches that report it.
std::map<std::string, double> step_metrics(const std::vector<MicroStats>& stats,
                                           const std::vector<double>& weights) {
  std::map<std::string, std::vector<std::pair<double, double>>> parts;  // (value, weight)
  for (std::size_t i = 0; i < stats.size(); ++i) {
    const auto& m = stats[i].metrics;
    const auto count = [&](const std::string& label) {
      const auto it = std::find_if(m.begin(), m.end(),
                                   [&](const auto& kv) { return kv.first == "count/" + label; });
      return it == m.end() ? std::optional<double>() : it->second;
    };
    const bool unpaired = count("chosen").has_value();
    for (const auto& [k, v] : m) {
      const bool chosen = k.ends_with("/chosen"), rejected = k.ends_with("/rejected");
      const bool per_label = unpaired && (chosen || rejected) && !k.starts_with("count/");
      const double w = per_label ? *count(chosen ? "chosen" : "rejected") : weights[i];
      parts[k].emplace_back(v, w);
    }
  }
  std::map<std::string, double> out;
  for (const auto& [k, p] : parts) {
    double sum = 0, weighted = 0, weight = 0;
    for (const auto& [v, w] : p) {
      sum += v;
      weighted += w * v;
      weight += w;
    }
    out[k] = p.size() == 1             ? p[0].first
             : k.starts_with("count/") ? sum
             : weight > 0              ? weighted / weight
                                       : 0.0;
  }
  const bool unpaired = out.contains("count/chosen");
  if (unpaired && stats.size() > 1) {
    out.erase("rewards/margins");
    if (out.contains("rewards/chosen") && out.contains("rewards/rejected"))
      out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"];
  }
  return out;
}

// FNV-1a, 64 bits, in hex: the identity of a file's or a model's bytes.
std::string digest(std::string_view bytes) {
  std::uint64_t x = 0xcbf29ce484222325ull;
  for (const unsigned char b : bytes) x = (x ^ b) * 0x100000001b3ull;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

// Everything that decides a run's numbers, saved in trainer_state.json; --resume asks for the
// same. The data and a DPO or KTO run's reference count by their contents, not their paths.
// Only the loss's own options count, and beta 0 is the loss's default. The thread count counts
// (0 as the cores it gives): the model's Eigen GEMMs block their sums by it and the loss is
// bitwise the same only on the same count. (The outputs and the progress lines do not change the
// numbers.)
std::map<std::string, std::string> run_options(const Settings& s, const std::string& train_text,
                                               const std::optional<model::LlamaModel>& reference) {
  const auto num = [](double v) {
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);  // the shortest exact form
    return std::string(buf, r.ptr);
  };
  const auto integer = [](std::int64_t v) { return std::to_string(v); };
  const LossSettings& l = s.loss;
  std::map<std::string, std::string> o = {
      {"loss", l.loss},
      {"train_file_digest", digest(train_text)},
      {"seed", std::to_string(s.seed)},
      {"batch_size", integer(s.batch_size)},
      {"grad_accum", integer(s.grad_accum)},
      {"threads", integer(s.threads > 0 ? s.threads : omp_get_max_threads())},
      {"steps", integer(s.steps)},
      {"device", s.device},
      {"gemm_selection", s.measured_gemms ? "measured" : "default"},
      {"data_parallel", integer(s.data_parallel)},
      {"vocab_parallel", integer(s.vocab_parallel)},
      {"max_length", integer(s.data.encode.max_length)},
      {"max_prompt_length", integer(s.data.encode.max_prompt_length)},
      {"lr", num(s.schedule.lr)},
      {"warmup_steps", integer(s.schedule.warmup_steps)},
      {"min_lr_ratio", num(s.schedule.min_lr_ratio)},
      {"weight_decay", num(s.adam.weight_decay)},
      {"beta1", num(s.adam.beta1)},
      {"beta2", num(s.adam.beta2)},
      {"adam_eps", num(s.adam.eps)},
      {"max_grad_norm", num(s.max_grad_norm)},
      {"budget_bytes", std::to_string(l.budget_bytes)}};
  if (reference) {
    const std::span<const float> p = reference->params();
    o["reference_digest"] =
        digest({reinterpret_cast<const char*>(p.data()), p.size() * sizeof(float)});
  }
  const double beta = l.beta > 0          ? l.beta
                      : l.loss == "simpo" ? SimpoOptions{}.beta
                      : l.loss == "grpo"  ? 0.0
                                          : 0.1;
  const std::map<std::string, std::map<std::string, std::string>> by_loss = {
      {"ce",
       {{"label_smoothing", num(l.label_smoothing)},
        {"z_loss", num(l.z_loss)},
        {"skip_ignored_rows", l.skip_ignored_rows ? "true" : "false"}}},
      {"dpo",
       {{"beta", num(beta)},
        {"label_smoothing", num(l.label_smoothing)},
        {"dpo_loss_type", l.dpo_loss_type},
        {"discopop_tau", num(l.discopop_tau)},
        {"rpo_alpha", num(l.rpo_alpha)}}},
      {"orpo", {{"beta", num(beta)}}},
      {"simpo",
       {{"beta", num(beta)},
        {"gamma", num(l.gamma)},
        {"label_smoothing", num(l.label_smoothing)},
        {"simpo_alpha", num(l.simpo_alpha)}}},
      {"cpo",
       {{"beta", num(beta)},
        {"cpo_alpha", num(l.cpo_alpha)},
        {"label_smoothing", num(l.label_smoothing)}}},
      {"kto",
       {{"beta", num(beta)},
        {"desirable_weight", num(l.desirable_weight)},
        {"undesirable_weight", num(l.undesirable_weight)}}},
      {"grpo",
       {{"beta", num(beta)},
        {"num_generations", integer(l.num_generations)},
        {"temperature", num(l.temperature)},
        {"max_completion_length", integer(l.max_completion_length)},
        {"grpo_loss_type", l.grpo_loss_type},
        {"scale_rewards", l.scale_rewards},
        {"mask_truncated_completions", l.mask_truncated_completions ? "true" : "false"},
        {"num_iterations", integer(l.num_iterations)},
        {"epsilon", num(l.epsilon_low)},
        {"epsilon_high", num(l.epsilon_high < 0 ? l.epsilon_low : l.epsilon_high)},
        {"delta", num(l.delta)},
        {"importance_sampling_level", l.importance_sampling_level}}}};
  o.merge(std::map(by_loss.at(l.loss)));
  // How the micro-batches of a step weigh (Trainer::step_weight): a build before this key
  // weighed cross-entropy's equally.
  if (l.loss == "ce" && s.grad_accum > 1) o["grad_accum_weights"] = "valid_targets";
  return o;
}

// Refuses to resume `st` (saved in `dir`) with other options than it was saved with, or from a
// step the run cannot continue from. A value the save lacks (other than those every build
// records) was not recorded by the build that saved it: those below were implied (builds before
// skip_ignored_rows computed every row, before grad_accum_weights weighed micro-batches equally,
// before z_loss and discopop_tau had options used their defaults, and GRPO before its
// mask_truncated_completions option trained on every completion), the rest cannot be compared.
// Builds before 2026-12-05 saved the default budget as 0: it is the saved device's default. With
// --resume-inexact the options that change only the rounding (the same optimisation on another
// machine) may differ: returns those changes, "" if none.
std::string check_resume(const Settings& s, const std::string& dir, const model::TrainerState& st,
                         const std::map<std::string, std::string>& now,
                         std::int64_t optimizer_step) {
  static const std::set<std::string> kRoundingOnly = {"threads", "device", "gemm_selection",
                                                      "budget_bytes", "vocab_parallel"};
  static const std::map<std::string, std::string> kImplied = {
      {"device", "cpu"},
      {"data_parallel", "1"},
      {"vocab_parallel", "1"},
      {"skip_ignored_rows", "false"},
      {"grad_accum_weights", "equal"},
      {"z_loss", "0"},
      {"discopop_tau", "0.05"},
      {"mask_truncated_completions", "false"}};
  const auto saved_value = [&](const std::string& key) -> std::optional<std::string> {
    if (const auto it = st.strings.find(key); it != st.strings.end()) return it->second;
    if (const auto it = kImplied.find(key); it != kImplied.end()) return it->second;
    return std::nullopt;
  };
  // Recorded by every build: a state without them was not saved by chunkloss-train.
  for (const char* key : {"loss", "seed", "batch_size", "grad_accum", "steps"})
    CHUNKLOSS_CHECK(st.strings.count(key), "--resume ", dir, ": trainer_state.json records no ",
                    key, ", which every save of chunkloss-train holds");
  std::string rounding_only;
  for (const std::string& key : kRoundingOnly)
    rounding_only += (rounding_only.empty() ? "" : ", ") + key;
  std::string changes;
  for (const auto& [key, value] : now) {
    std::optional<std::string> saved = saved_value(key);
    if (!saved) continue;
    if (key == "budget_bytes" && *saved == "0")
      saved = std::to_string(apps::budget_bytes(0, *saved_value("device")));
    if (*saved == value) continue;
    CHUNKLOSS_CHECK(
        s.resume_inexact && kRoundingOnly.count(key), "--resume ", dir, ": the run was saved with ",
        key, " = ", *saved, ", this one has ", value,
        !kRoundingOnly.count(key)
            ? (s.resume_inexact ? " (--resume-inexact lets only " + rounding_only + " differ)"
                                : std::string(" (exact resume needs the same)"))
            : " (exact resume needs the same; --resume-inexact allows it)");
    changes += (changes.empty() ? "" : ", ") + key + " " + *saved + " -> " + value;
  }
  CHUNKLOSS_CHECK(st.global_step == optimizer_step, "--resume ", dir,
                  ": trainer_state.json's global_step ", st.global_step,
                  " differs from the optimizer's step ", optimizer_step);
  CHUNKLOSS_CHECK(st.global_step >= 0 && st.global_step < s.steps, "--resume ", dir,
                  ": the run saved there is at step ", st.global_step, " of --steps ", s.steps,
                  st.global_step == s.steps ? " (it has finished)" : "");
  return changes;
}

// Where the run's first weights come from: "--resume DIR", "--init DIR" or "the new model".
std::string weights_origin(const Settings& s) {
  if (!s.resume.empty()) return "--resume " + s.resume;
  return s.init.empty() ? "the new model" : "--init " + s.init;
}

// Throws naming the step and the parameter when the optimizer step left a parameter NaN or Inf
// (the loss and the gradients were finite: the optimizer's state or --lr is to blame), so that a
// diverged model is never saved nor the run reported done.
void check_finite_parameters(const model::LlamaModel& m, std::int64_t step, bool resumed) {
  const std::span<const float> p = m.params();
  const auto bad = std::find_if(p.begin(), p.end(), [](float x) { return !std::isfinite(x); });
  if (bad == p.end()) return;
  const auto at = static_cast<std::size_t>(bad - p.begin());
  std::string name = "?";
  for (const model::ParameterInfo& info : m.parameters())
    if (at >= info.offset && at < info.offset + info.numel) name = info.name;
  CHUNKLOSS_FAIL("step ", step, ": the optimizer step made parameter ", name, " ", *bad,
                 " (the loss and the gradient norm were finite), so the run stops without saving "
                 "it; ",
                 resumed ? "the --resume checkpoint's optimizer state may be damaged, or " : "",
                 "try a lower --lr");
}

std::unique_ptr<Trainer> make_trainer(const Settings& s, const DataSettings& data,
                                      LossDevice& device,
                                      std::optional<model::LlamaModel> reference) {
  if (s.loss.loss == "ce") return make_ce_trainer(data, s.loss, device);
  if (s.loss.loss == "kto") return make_kto_trainer(data, s.loss, device, std::move(*reference));
  if (s.loss.loss == "grpo")
    return make_grpo_trainer(data, s.loss, device, s.seed, std::move(reference));
  return make_pair_trainer(data, s.loss, device, std::move(reference));
}

// The metrics file of a run, which follows the atomic rule of every output: the records go to
// PATH.partial as they come (where a run can be watched), and PATH is replaced by all of them
// atomically at the end, so a run that fails leaves the previous PATH as it was. Each checkpoint
// saves the records up to its step in its trainer state (log_history); a resumed run starts
// from those of the checkpoint it resumes (from a checkpoint saved without them, from PATH's
// records up to the step it resumes at), a new run from none.
class MetricsLog {
 public:
  MetricsLog() = default;
  MetricsLog(std::string path, const std::optional<model::TrainerState>& resumed)
      : path_(std::move(path)), partial_(path_ + ".partial") {
    if (resumed && resumed->log_history) {
      records_ = *resumed->log_history;
    } else if (resumed) {
      std::ifstream old(path_);
      for (std::string line; std::getline(old, line);) {
        const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
        if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
            j["step"].get<std::int64_t>() <= resumed->global_step)
          records_.push_back(line);
      }
    }
    out_.open(partial_, std::ios::trunc | std::ios::binary);
    for (const std::string& r : records_) out_ << r << "\n";
    out_.flush();
    CHUNKLOSS_CHECK(out_.good(), "--metrics: cannot write ", partial_);
  }
  bool enabled() const { return !path_.empty(); }
  /// The records so far, one JSON object text each.
  const std::vector<std::string>& records() const { return records_; }

  void append(const nlohmann::json& record) {
    if (!enabled()) return;
    records_.push_back(record.dump());
    out_ << records_.back() << "\n";
    out_.flush();
    CHUNKLOSS_CHECK(out_.good(), "--metrics: cannot write ", partial_);
  }
  /// PATH becomes the records (write, fsync, rename), and the in-progress file is removed.
  void finish() {
    if (!enabled()) return;
    std::string text;
    for (const std::string& r : records_) text += r + "\n";
    model::write_file_atomically(path_, text);
    out_.close();
    std::error_code ec;
    std::filesystem::remove(partial_, ec);
  }

 private:
  std::string path_, partial_;
  std::ofstream out_;
  std::vector<std::string> records_;
};

// The chart's curves from every line of the metrics file (the last record of each step wins,
// so a resumed run's file gives one curve).
void write_chart(const std::string& metrics, const std::string& chart, const std::string& title,
                 const std::string& accuracy_key, const std::string& accuracy_label) {
  std::ifstream in(metrics);
  std::map<double, std::pair<double, double>> by_step;
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("step") || !j.contains("loss")) continue;
    const auto get = [&](const std::string& k) {
      return j.contains(k) && j[k].is_number() ? j[k].get<double>() : NAN;
    };
    by_step[get("step")] = {get("loss"), get(accuracy_key)};
  }
  apps::ChartPanel loss{"loss", {}}, acc{accuracy_label, {}};
  for (const auto& [step, v] : by_step) {
    loss.points.emplace_back(step, v.first);
    acc.points.emplace_back(step, v.second);
  }
  model::write_file_atomically(chart, apps::svg_chart(title, "optimizer step", {loss, acc}));
}

// The ranks of --data-parallel D x --vocab-parallel K, threads of this process: rank i holds data
// part i / K and vocabulary position i % K, in the vocabulary group of its part and the data
// group of its position (each only when split that way).
class Ranks {
 public:
  Ranks(int data, int vocab) : size_(data * vocab), vocab_(vocab) {
    for (int d = 0; vocab > 1 && d < data; ++d)
      vocab_groups_.push_back(std::make_unique<dist::InProcessGroup>(vocab));
    for (int v = 0; data > 1 && v < vocab; ++v)
      data_groups_.push_back(std::make_unique<dist::InProcessGroup>(data));
  }
  int size() const { return size_; }
  dist::Communicator* vocab_group(int i) {
    return vocab_groups_.empty()
               ? nullptr
               : &vocab_groups_[static_cast<std::size_t>(i / vocab_)]->comm(i % vocab_);
  }
  dist::Communicator* data_group(int i) {
    return data_groups_.empty()
               ? nullptr
               : &data_groups_[static_cast<std::size_t>(i % vocab_)]->comm(i / vocab_);
  }
  /// Whether rank i is rank 0 of its vocabulary group (the one that counts its part's tokens).
  bool first_of_vocab_group(int i) const { return i % vocab_ == 0; }

  /// fn(i) for each rank, each on its own thread (one rank: on this one). A rank that fails
  /// aborts every group, so that the others do not wait for it in a collective, and the first
  /// rank to fail has its error rethrown once every thread has ended. A thread the system
  /// cannot start (a process limit) fails the call the same way, naming the rank.
  template <typename Fn>
  void run(Fn&& fn) {
    if (size_ == 1) {
      fn(0);
      return;
    }
    std::mutex mutex;
    std::exception_ptr first;
    const auto fail = [&](std::exception_ptr e) {
      {
        const std::lock_guard lock(mutex);
        if (!first) first = e;
      }
      for (auto& g : vocab_groups_) g->abort();
      for (auto& g : data_groups_) g->abort();
    };
    std::vector<std::thread> threads;
    for (int i = 0; i < size_; ++i) {
      try {
        threads.emplace_back([&, i] {
          try {
            fn(i);
          } catch (...) {
            fail(std::current_exception());
          }
        });
      } catch (const std::system_error& e) {
        fail(std::make_exception_ptr(Error("cannot start the thread of rank " + std::to_string(i) +
                                           " of " + std::to_string(size_) + ": " + e.what())));
        break;
      }
    }
    for (std::thread& t : threads) t.join();
    if (first) std::rethrow_exception(first);
  }

 private:
  int size_, vocab_;
  std::vector<std::unique_ptr<dist::InProcessGroup>> vocab_groups_, data_groups_;
};

// The checkpoint directories this run will save into that exist already (SAVE, and the
// SAVE/checkpoint-N of --save-every after step `start`), checked before the first step: a save
// that fails on what is there would lose the run's work. A new run (start 0) warns of the
// SAVE/checkpoint-N it will not replace, an earlier run's, which would sit beside its own.
void check_save_targets(const Settings& s, std::int64_t start) {
  model::check_save_target(s.save);
  constexpr std::string_view kPrefix = "checkpoint-";
  std::vector<std::int64_t> kept;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(s.save, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::int64_t n = 0;
    if (!name.starts_with(kPrefix) ||
        std::from_chars(name.data() + kPrefix.size(), name.data() + name.size(), n).ec !=
            std::errc() ||
        name != std::string(kPrefix) + std::to_string(n))
      continue;
    if (s.save_every > 0 && n > start && n < s.steps && n % s.save_every == 0)
      model::check_save_target(it->path().string());
    else if (start == 0)
      kept.push_back(n);
  }
  if (kept.empty()) return;
  std::sort(kept.begin(), kept.end());
  std::string names;
  for (std::size_t i = 0; i < kept.size() && i < 5; ++i)
    names += (i ? ", " : "") + std::string(kPrefix) + std::to_string(kept[i]);
  if (kept.size() > 5) names += " and " + std::to_string(kept.size() - 5) + " more";
  std::fprintf(stderr,
               "%s: warning: --save %s holds %s of an earlier run, which this run does not "
               "replace\n",
               kProg, apps::one_line(s.save).c_str(), names.c_str());
}

// Checks every output before any work (and makes their directories): --save, --metrics and
// --chart must be writable, files where files go, and must not overwrite an input (the training
// data, the --config file, the --init checkpoint `init`: --init's, or the one a resumed run
// records) or a file of a checkpoint the run reads or writes (--resume, --init, --save and its
// checkpoint-N).
void prepare_outputs(const Settings& s, const std::string& init, std::int64_t start) {
  if (!s.save.empty() && !init.empty()) {
    const bool holds = apps::path_within(init, s.save), inside = apps::path_within(s.save, init);
    const char* relation = holds && inside ? "it is" : holds ? "it holds" : "it lies inside";
    if (holds || inside)
      throw apps::UsageError(
          "--save " + s.save + ": " + relation + " the --init checkpoint " + init +
          (s.init.empty() ? " that the run of --resume " + s.resume + " started from" : "") +
          ", which this run starts from and its saves (SAVE and SAVE/checkpoint-N) must stay "
          "apart from: save elsewhere");
  }
  if (!s.save.empty()) {
    apps::prepare_output_dir("save", s.save);
    if (const std::string w = apps::lock_directory("save", s.save); !w.empty())
      std::fprintf(stderr, "%s: warning: %s\n", kProg, apps::one_line(w).c_str());
    check_save_targets(s, start);
  }
  const std::vector<std::string> checkpoints = {s.resume, s.init, s.save};
  std::vector<std::pair<std::string, std::string>> inputs = {{"--train-file", s.data.file},
                                                             {"--config", s.config_file}};
  for (const auto& [option, path] : inputs)  // (a save would replace them)
    if (!path.empty()) apps::check_not_checkpoint_file(option.substr(2), path, {s.save}, s.save);
  if (!s.metrics.empty()) {
    apps::check_not_checkpoint_file("metrics", s.metrics, checkpoints, s.save);
    apps::prepare_output_file("metrics", s.metrics, inputs, {".tmp", ".partial"});
    // The chart is drawn from the metrics.
    for (const char* suffix : {"", ".tmp", ".partial"})
      inputs.emplace_back(*suffix ? "the metrics' file" : "--metrics", s.metrics + suffix);
  }
  if (!s.chart.empty()) {
    apps::check_not_checkpoint_file("chart", s.chart, checkpoints, s.save);
    apps::prepare_output_file("chart", s.chart, inputs);
  }
}

// The frozen reference of a DPO or KTO run from checkpoint `init`: --init, or for a resumed run
// the --init its trainer state records, named so when it cannot be read.
model::LlamaModel load_reference(const std::string& init, const Settings& s) {
  if (!s.init.empty()) return model::load_model(init);
  try {
    return model::load_model(init);
  } catch (const Error& e) {
    throw Error("--resume " + s.resume +
                ": the --init checkpoint its run started from: " + e.what());
  }
}

// The memory this process may use: the machine's, or its cgroup's limit when lower (cgroup v2's
// memory.max, v1's memory.limit_in_bytes); 0 when unknown.
double usable_memory() {
  double bytes = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                 static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  for (const char* f :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(f);
    double limit = 0;
    if (in >> limit && limit > 0 && (bytes <= 0 || limit < bytes)) bytes = limit;  // ("max": none)
  }
  return bytes;
}

// Refuses a model whose host buffers exceed the memory this process may use before they are
// allocated (their zeros would be written page by page, until the kernel killed the process
// without a word): 4 bytes a parameter for each of the policy's weights, gradients and AdamW's
// two moments, the reference (DPO's, KTO's, GRPO's with a KL term: weights and gradients), and
// each further rank's replica.
void check_host_memory(const Settings& s, const model::LlamaConfig& c, const std::string& what) {
  const double params = model::parameter_count(c);
  const double per_param =
      4.0 * (4 + (uses_reference(s.loss) ? 2 : 0) + 2.0 * (s.data_parallel * s.vocab_parallel - 1));
  const double usable = usable_memory();
  const auto gib = [](double bytes) {
    char b[32];
    std::snprintf(b, sizeof b, "%.1f GiB", bytes / (1024.0 * 1024 * 1024));
    return std::string(b);
  };
  CHUNKLOSS_CHECK(usable <= 0 || params * per_param <= usable, what, ": ",
                  static_cast<long long>(params), " parameters need ", gib(params * per_param),
                  " of host memory for the weights, gradients and optimizer state of this run, "
                  "more than the ",
                  gib(usable),
                  " this process may use (the machine's memory or its cgroup's limit)");
}

// The OpenMP threads of the whole process and of each rank: --threads split between the ranks of
// the grid (one rank: --threads itself, 0 for all cores).
struct ThreadCounts {
  int all, per_rank;
};
ThreadCounts thread_counts(const Settings& s) {
  const int ranks = s.data_parallel * s.vocab_parallel;
  const int all = s.threads > 0 ? s.threads : omp_get_max_threads();
  return {all, ranks == 1 ? s.threads : std::max(1, all / ranks)};
}

// Whether the system lets the run start its threads (apps::check_threads_start): this thread's
// OpenMP team, or with ranks, each rank's thread (a std::thread) and its team (this thread then
// only waits).
void check_run_threads(const Settings& s) {
  const int ranks = s.data_parallel * s.vocab_parallel;
  const ThreadCounts t = thread_counts(s);
  std::string what = "--threads " + std::to_string(s.threads);
  if (s.threads == 0) what += " (" + std::to_string(t.all) + " threads)";
  if (s.data_parallel > 1) what += " with --data-parallel " + std::to_string(s.data_parallel);
  if (s.vocab_parallel > 1)
    what += (s.data_parallel > 1 ? " and" : " with") + std::string(" --vocab-parallel ") +
            std::to_string(s.vocab_parallel);
  if (ranks == 1)
    apps::check_threads_start(what, t.all - 1);
  else
    apps::check_threads_start(what, ranks * (t.per_rank - 1), ranks);
}

int run(const Settings& s, const std::string& invocation) {
  if (s.threads > 0) omp_set_num_threads(s.threads);
  check_run_threads(s);
  // The paths the checkpoints record, made absolute (the working directory or a symlink's target
  // may take them out of UTF-8).
  const std::string train_file = absolute_path(s.data.file);
  apps::check_utf8("--train-file " + s.data.file + " (made absolute)", train_file);
  if (!s.init.empty())
    apps::check_utf8("--init " + s.init + " (made absolute)", absolute_path(s.init));
  // The policy: resumed, initialised from a checkpoint, or new.
  std::optional<model::LlamaModel> policy;
  std::string init = s.init;
  model::AdamW* opt_ptr = nullptr;
  std::optional<model::AdamW> opt;
  std::int64_t start = 0;
  std::optional<model::TrainerState> resumed;
  if (!s.resume.empty())
    check_host_memory(s, model::load_config(s.resume), "--resume " + s.resume);
  else if (!s.init.empty())
    check_host_memory(s, model::load_config(s.init), "--init " + s.init);
  else
    check_host_memory(s, s.config, "the model options");
  if (!s.resume.empty()) {
    std::string save_id;  // (the state must come from the same save as the weights)
    policy.emplace(model::load_model(s.resume, &save_id));
    opt.emplace(policy->params().size(), s.adam);
    resumed = model::load_training_state(s.resume, *policy, *opt, save_id);
    if (init.empty() && resumed->strings.count("init")) init = resumed->strings.at("init");
    start = resumed->global_step;
  }
  prepare_outputs(s, init, start);  // (a resumed run's --init is known now)
  if (!policy)
    policy.emplace(init.empty() ? model::LlamaModel(s.config, s.seed) : model::load_model(init));
  check_architecture(s, policy->config());
  if (!s.resume.empty() || !init.empty())
    apps::check_tokenizer(policy->config(),
                          s.resume.empty() ? "--init " + init : "--resume " + s.resume);
  if (!opt) opt.emplace(policy->params().size(), s.adam);
  opt_ptr = &*opt;
  // The frozen reference (DPO's, KTO's, GRPO's with a KL term): the --init model, or a new one
  // like the policy's start.
  std::optional<model::LlamaModel> reference;
  if (uses_reference(s.loss)) {
    reference.emplace(init.empty() ? model::LlamaModel(policy->config(), s.seed)
                                   : load_reference(init, s));
    if (!init.empty()) apps::check_tokenizer(reference->config(), "the reference " + init);
  }
  // The training file, read once: parsed by every rank's trainer and digested for --resume.
  DataSettings data = s.data;
  data.text = data::read_text_file(s.data.file);
  const std::map<std::string, std::string> options = run_options(s, data.text, reference);
  const std::string inexact =
      resumed ? check_resume(s, s.resume, *resumed, options, opt->step_count()) : "";

  // Per rank of the grid (one rank: no groups): a loss device, a trainer and a model replica
  // (rank 0's is the policy; the others copy its parameters after each optimizer step).
  Ranks grid(s.data_parallel, s.vocab_parallel);
  const int ranks = grid.size();
  const int rank_threads = thread_counts(s).per_rank;
  std::vector<std::unique_ptr<LossDevice>> devices;
  std::vector<std::unique_ptr<Trainer>> trainers;
  std::vector<model::LlamaModel> replicas;
  for (int r = 0; r < ranks; ++r) {
    devices.push_back(std::make_unique<LossDevice>(s.device, rank_threads, s.measured_gemms));
    trainers.push_back(
        make_trainer(s, data, *devices.back(), r + 1 < ranks ? reference : std::move(reference)));
    trainers.back()->set_data_group(grid.data_group(r));
    trainers.back()->set_vocab_group(grid.vocab_group(r));
    if (r > 0) replicas.push_back(*policy);
  }
  const auto model_of = [&](int r) -> model::LlamaModel& {
    return r == 0 ? *policy : replicas[static_cast<std::size_t>(r - 1)];
  };
  const std::unique_ptr<Trainer>& trainer = trainers.front();
  const std::int64_t max_positions = policy->config().max_position_embeddings;
  apps::check_fits(trainer->longest(), s.data.file, policy->config(), weights_origin(s),
                   "shorten the examples or pass --max-length " + std::to_string(max_positions));
  // Over a data group every rank needs an example; KTO's KL estimate needs two per micro-batch.
  const bool drop_last =
      s.data_parallel > 1 || (s.loss.loss == "kto" && trainer->size() % s.batch_size == 1);
  CHUNKLOSS_CHECK(!drop_last || trainer->size() >= static_cast<std::size_t>(s.batch_size),
                  s.data.file, ": ", trainer->size(),
                  trainer->size() == 1 ? " example" : " examples", ", fewer than --batch-size ",
                  s.batch_size, ", and ",
                  s.data_parallel > 1
                      ? "with --data-parallel " + std::to_string(s.data_parallel) +
                            " an epoch's last short micro-batch is dropped (every rank needs "
                            "examples): use a smaller --batch-size (>= --data-parallel) or more "
                            "examples"
                      : std::string("kto drops a micro-batch of one example (its KL estimate "
                                    "needs two): give at least two examples"));
  const data::BatchSampler sampler(trainer->size(), static_cast<std::size_t>(s.batch_size), s.seed,
                                   true, drop_last);
  const std::int64_t per_epoch = static_cast<std::int64_t>(sampler.batches_per_epoch());
  MetricsLog metrics;
  if (!s.metrics.empty()) metrics = MetricsLog(s.metrics, resumed);

  // Everything a run can be refused for before its first step has been checked: a refused run
  // prints its error line alone.
  if (!inexact.empty())
    std::fprintf(stderr,
                 "%s: warning: --resume-inexact: %s; the run continues the same optimisation, "
                 "its numbers differing from an uninterrupted run's by rounding\n",
                 kProg, inexact.c_str());
  if (const std::string w = trainer->warning(); !w.empty())
    std::fprintf(stderr, "%s: warning: %s\n", kProg, w.c_str());
  std::fprintf(stderr, "%s: %s\n", kProg, policy->summary().c_str());
  std::fprintf(
      stderr,
      "%s: --loss %s (on %s) on %s: %zu examples, %lld micro-batches per epoch, steps %lld..%lld\n",
      kProg, s.loss.loss.c_str(), s.device.c_str(), s.data.file.c_str(), trainer->size(),
      static_cast<long long>(per_epoch), static_cast<long long>(start),
      static_cast<long long>(s.steps));

  model::TrainerState state;
  state.strings = options;
  state.strings["command"] = invocation;  // for the record, with the paths below
  state.strings["train_file"] = train_file;
  if (!init.empty()) state.strings["init"] = absolute_path(init);
  const auto save = [&](std::int64_t step, const std::string& dir) {
    state.global_step = step;
    if (metrics.enabled()) state.log_history = metrics.records();
    model::save_checkpoint(dir, *policy, opt_ptr, &state);
  };

  const auto [acc_key, acc_label] = trainer->accuracy_metric();
  apps::Progress progress(start, s.steps, s.log_every, apps::Progress::is_terminal(stderr));
  std::int64_t cached_epoch = -1;
  std::vector<std::vector<std::size_t>> epoch_batches;
  double last_loss = NAN;
  for (std::int64_t step = start; step < s.steps; ++step) {
    // (GRPO's --num-iterations steps on one batch of rollouts take the same micro-batches)
    const std::int64_t data_step = step / s.loss.num_iterations;
    std::vector<std::vector<std::size_t>> micro_batches;
    for (std::int64_t micro = 0; micro < s.grad_accum; ++micro) {
      const std::int64_t m = data_step * s.grad_accum + micro;
      if (m / per_epoch != cached_epoch) {
        cached_epoch = m / per_epoch;
        epoch_batches = sampler.epoch(static_cast<std::uint64_t>(cached_epoch));
      }
      micro_batches.push_back(epoch_batches[static_cast<std::size_t>(m % per_epoch)]);
    }
    // Each micro-batch's weight relative to an equal share (1 but for a token-mean loss over
    // several micro-batches: its share of the step's valid targets, times their number; the
    // step's gradient is scaled by 1 / --grad-accum below).
    std::vector<double> weights;
    for (const std::vector<std::size_t>& b : micro_batches)
      weights.push_back(trainer->step_weight(b));
    const double weight_sum = std::accumulate(weights.begin(), weights.end(), 0.0);
    for (double& w : weights)
      w = s.grad_accum == 1 ? 1.0 : w * static_cast<double>(s.grad_accum) / weight_sum;
    // Each rank steps on its part of every micro-batch; the ranks' gradients are summed over
    // the grid before the optimizer step (each is its share of the whole's).
    std::vector<std::vector<MicroStats>> stats(static_cast<std::size_t>(ranks));
    grid.run([&](int r) {
      if (ranks > 1) omp_set_num_threads(rank_threads);
      model::LlamaModel& m = model_of(r);
      m.zero_grad();
      trainers[static_cast<std::size_t>(r)]->set_step(step);
      for (std::size_t i = 0; i < micro_batches.size(); ++i)
        stats[static_cast<std::size_t>(r)].push_back(
            trainers[static_cast<std::size_t>(r)]->step(m, micro_batches[i], weights[i]));
      for (dist::Communicator* g : {grid.data_group(r), grid.vocab_group(r)})
        if (g)
          g->all_reduce_sum(CpuContext(rank_threads), m.grads().data(),
                            static_cast<std::int64_t>(m.grads().size()));
    });
    MicroStats sum;
    const std::map<std::string, double> step_metric = step_metrics(stats[0], weights);
    for (std::size_t i = 0; i < micro_batches.size(); ++i) {
      sum.loss += weights[i] * stats[0][i].loss;  // the group's, on every rank
      for (int r = 0; r < ranks; ++r)             // each part's tokens once
        if (grid.first_of_vocab_group(r))
          sum.tokens += stats[static_cast<std::size_t>(r)][i].tokens;
    }
    const double inv = 1.0 / static_cast<double>(s.grad_accum);
    if (s.grad_accum > 1) policy->scale_grads(static_cast<float>(inv));
    const double norm = model::clip_grad_norm(policy->grads(), s.max_grad_norm);
    // At the run's first step no update has run: the weights are the checkpoint's (or new).
    CHUNKLOSS_CHECK(std::isfinite(norm) && std::isfinite(sum.loss), "step ", step + 1,
                    ": the loss or the gradient norm is not finite (loss ", sum.loss * inv,
                    ", grad norm ", norm, "); ",
                    step == start
                        ? "no update has run yet, so the weights of " + weights_origin(s) +
                              " give non-finite outputs (a damaged checkpoint?)"
                        : std::string("try a lower --lr"));
    const double lr = model::learning_rate(s.schedule, step);
    opt->step(*policy, lr);
    check_finite_parameters(*policy, step + 1, !s.resume.empty());
    for (model::LlamaModel& m : replicas)
      std::copy(policy->params().begin(), policy->params().end(), m.params().begin());
    last_loss = sum.loss * inv;

    nlohmann::json rec = {{"step", step + 1},
                          {"epoch", static_cast<double>((step + 1) * s.grad_accum) /
                                        static_cast<double>(per_epoch * s.loss.num_iterations)},
                          {"loss", last_loss},
                          {"lr", lr},
                          {"grad_norm", norm},
                          {"tokens", sum.tokens}};
    for (const auto& [k, v] : step_metric) rec[k] = v;
    metrics.append(rec);
    const auto acc = step_metric.find(acc_key);
    progress.update(
        {step + 1, last_loss, acc == step_metric.end() ? NAN : acc->second, acc_label, sum.tokens});
    if (s.save_every > 0 && (step + 1) % s.save_every == 0 && step + 1 < s.steps)
      save(step + 1,
           (std::filesystem::path(s.save) / ("checkpoint-" + std::to_string(step + 1))).string());
  }
  progress.finish();
  state.scalars["last_loss"] = std::isfinite(last_loss) ? last_loss : 0.0;
  if (!s.save.empty()) {
    save(s.steps, s.save);
    std::fprintf(stderr, "%s: saved %s\n", kProg, s.save.c_str());
  }
  if (metrics.enabled()) {
    metrics.finish();
    if (!s.chart.empty()) {
      write_chart(s.metrics, s.chart, std::string(kProg) + " --loss " + s.loss.loss, acc_key,
                  acc_label);
      std::fprintf(stderr, "%s: metrics in %s, chart in %s\n", kProg, s.metrics.c_str(),
                   s.chart.c_str());
    }
  }
  std::fprintf(stderr, "%s: done: step %lld, loss %.4f, %.1f s\n", kProg,
               static_cast<long long>(s.steps), last_loss, progress.elapsed_seconds());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return apps::guarded_main(
      kProg, [&] { return parse(argc, argv); },
      [&](const Settings& s) {
        return run(s, apps::shell_join(std::vector<std::string>(argv, argv + argc)));
      });
}
