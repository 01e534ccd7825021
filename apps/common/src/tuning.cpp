// Glue shared by the training and evaluation apps (see tuning.h).
#include "chunkloss/apps/tuning.h"

#include <chunkloss/core/error.h>
#include <chunkloss/data/tokenizer.h>
#include <chunkloss/model/checkpoint.h>

#include <algorithm>
#include <filesystem>
#include <tuple>

#include "chunkloss/apps/cli.h"

namespace chunkloss::apps {

std::string bundled_data(const std::string& name) {
  return std::string(CHUNKLOSS_BUNDLED_DATA_DIR) + "/" + name;
}

void check_checkpoint_dir(std::string_view option, const std::string& path) {
  const std::filesystem::file_status st = input_status(option, path);
  if (std::filesystem::exists(st) && !std::filesystem::is_directory(st))
    throw UsageError("--" + std::string(option) + ": " + path + " is not a directory");
}

std::vector<std::int32_t> prompt_ids(const data::ByteTokenizer& tok, std::string_view prompt) {
  std::vector<std::int32_t> ids = {tok.bos_id()};
  for (const std::int32_t id : tok.encode(prompt)) ids.push_back(id);
  return ids;
}

bool exact_match(const data::ByteTokenizer& tok, const model::GenerateResult& out,
                 std::string_view completion) {
  const bool bytes = std::all_of(out.tokens.begin(), out.tokens.end(),
                                 [](std::int32_t id) { return id >= 0 && id < 256; });
  return out.stopped_at_eos && bytes && tok.decode(out.tokens) == completion;
}

void Longest::take(const data::Sequence& s, std::size_t at_line, const std::string& description) {
  const auto n = static_cast<std::int64_t>(s.tokens.size());
  if (n <= positions) return;
  positions = n;
  line = at_line;
  what = description;
}

void check_tokenizer(const model::LlamaConfig& config, const std::string& what) {
  const data::ByteTokenizer tok;
  CHUNKLOSS_CHECK(config.vocab_size >= tok.vocab_size(), what, ": the checkpoint's vocab_size ",
                  config.vocab_size, " is smaller than the byte tokenizer's ", tok.vocab_size(),
                  " (ids 0-255 bytes, ", tok.bos_id(), " BOS, ", tok.eos_id(), " EOS, ",
                  tok.pad_id(), " PAD): it was not trained with this data layer");
  for (const auto& [field, id, want, name] :
       {std::tuple{"bos_token_id", config.bos_token_id, tok.bos_id(), "BOS"},
        {"eos_token_id", config.eos_token_id, tok.eos_id(), "EOS"}})
    CHUNKLOSS_CHECK(id == want, what, ": its ", model::kConfigFile, " has ", field, " ", id,
                    ", not the byte tokenizer's ", name, " id ", want,
                    ": it was not trained with this data layer");
}

void check_fits(const Longest& longest, const std::string& file, const model::LlamaConfig& config,
                const std::string& model, const std::string& hint) {
  CHUNKLOSS_CHECK(longest.positions <= config.max_position_embeddings, file,
                  longest.line ? ":" + std::to_string(longest.line) : std::string(), ": ",
                  longest.what, " encodes to ", longest.positions,
                  " positions, more than the max_position_embeddings = ",
                  config.max_position_embeddings, " of ", model, " (", hint, ")");
}

CrossEntropyResult batch_cross_entropy(LossDevice& device, model::LlamaModel& model,
                                       const data::Batch& batch, std::size_t budget_bytes) {
  CrossEntropyOptions o;
  o.memory_budget_bytes = budget_bytes;
  o.skip_ignored_rows = true;  // prompts and padding: only the loss and accuracy are read
  const LinearCrossEntropy ce(o);
  const TensorView hidden = model.forward(batch.tokens_view());
  device.begin();
  CrossEntropyInputs in;
  in.hidden = device.in(hidden);
  in.weight = device.in(model.lm_head_weight());
  in.targets = device.in(batch.targets_view());
  const CrossEntropyResult r =
      ce.forward(device.context(), in, {}, device.workspace(ce.workspace_bytes(in)));
  device.end();
  return r;
}

TensorView sequence_targets(const data::Batch& batch) {
  return TensorView::of(batch.targets.data(), {batch.rows, batch.length});
}

TensorView lm_head_rows(const TensorView& weight, const VocabShard& shard) {
  if (!shard.group || shard.group->size() == 1) return weight;
  const std::int64_t h = weight.size(1), v0 = shard.offset, v1 = shard.end();
  return TensorView(static_cast<char*>(weight.data()) +
                        static_cast<std::size_t>(v0 * h) * dtype_size(weight.dtype()),
                    weight.dtype(), {v1 - v0, h}, weight.device(), weight.device_index());
}

SequenceLogProbResult sequence_logps(LossDevice& device, model::LlamaModel& model,
                                     const data::Batch& batch, std::size_t budget_bytes,
                                     const VocabShard& shard) {
  SequenceOptions o;
  o.memory_budget_bytes = budget_bytes;
  const SequenceLogProbs utility(o);
  const TensorView hidden = model.forward(batch.tokens_view());
  device.begin();
  const Head head{device.in(hidden), device.in(lm_head_rows(model.lm_head_weight(), shard)), {}};
  const TensorView targets = device.in(sequence_targets(batch));
  const SequenceLogProbResult r =
      utility.compute(device.context(), head, targets,
                      device.workspace(utility.workspace_bytes(head, targets, shard)), shard);
  device.end();
  return r;
}

}  // namespace chunkloss::apps
