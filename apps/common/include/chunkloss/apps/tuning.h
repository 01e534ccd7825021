// Glue shared by chunkloss-train and chunkloss-eval: the bundled data files, and the model + loss
// passes both apps run (token cross-entropy of a batch, per-sequence log-probs) on a LossDevice.
#pragma once

#include <chunkloss/apps/loss_device.h>
#include <chunkloss/data/batch.h>
#include <chunkloss/data/tokenizer.h>
#include <chunkloss/losses/cross_entropy.h>
#include <chunkloss/losses/sequence.h>
#include <chunkloss/model/generate.h>
#include <chunkloss/model/model.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace chunkloss::apps {

/// A file of the bundled data set (apps/data in the source tree), e.g. "sft_train.jsonl".
std::string bundled_data(const std::string& name);

/// The longest encoded example of a data file, found before training or evaluating so that a
/// sequence longer than the model's positions is reported up front.
struct Longest {
  std::size_t line = 0;  ///< the example's line in its file (0: a sequence of several lines)
  std::string what;      ///< "the example", its "chosen sequence", or a derived sequence
  std::int64_t positions = 0;
  /// Keeps `s` (from line `at_line`, described by `description`) when it is longer than the
  /// longest so far.
  void take(const data::Sequence& s, std::size_t at_line,
            const std::string& description = "the example");
  void take(const data::PreferenceSequences& pair, std::size_t at_line) {
    take(pair.chosen, at_line, "the pair's chosen sequence");
    take(pair.rejected, at_line, "the pair's rejected sequence");
  }
};

/// Checks checkpoint directory `path` of option `option` (e.g. "resume") at option parsing:
/// throws UsageError naming both when the file system refuses the path (input_status: a symlink
/// loop, a name too long, ...) or it is not a directory. A missing one is left to the loader,
/// whose message names the file it lacks.
void check_checkpoint_dir(std::string_view option, const std::string& path);

/// Throws chunkloss::Error naming `what` (the checkpoint, e.g. "--init runs/sft") when a model
/// of `config` was not made for the apps' byte tokenizer (data::ByteTokenizer): a vocab_size
/// below its 259 (the bytes, BOS, EOS and PAD), or a bos_token_id or eos_token_id in its
/// config.json other than the tokenizer's BOS 256 and EOS 257. Found when the checkpoint is
/// loaded rather than at the first padded batch or the first generation.
void check_tokenizer(const model::LlamaConfig& config, const std::string& what);

/// Throws chunkloss::Error naming `file` and the example's line ("file:7: the example encodes
/// to ...", as the JSONL readers name lines), both lengths and `model` (the checkpoint, e.g.
/// "--model runs/sft") when `longest` has more positions than a model of `config` takes; `hint`
/// says how to shorten it.
void check_fits(const Longest& longest, const std::string& file, const model::LlamaConfig& config,
                const std::string& model, const std::string& hint);

/// The mean token cross-entropy of `model` over the batch's trained targets (forward only; long
/// runs of prompt and padding rows skipped), with the number of those targets and the token
/// accuracy.
CrossEntropyResult batch_cross_entropy(LossDevice& device, model::LlamaModel& model,
                                       const data::Batch& batch, std::size_t budget_bytes);

/// A prompt as generation takes it: BOS, then its bytes.
std::vector<std::int32_t> prompt_ids(const data::ByteTokenizer& tok, std::string_view prompt);

/// Whether a generation is exactly `completion`: it stopped at EOS, and its ids are bytes that
/// spell it (an id that is no byte, such as BOS or an id above the tokenizer's, is a miss).
bool exact_match(const data::ByteTokenizer& tok, const model::GenerateResult& out,
                 std::string_view completion);

/// The [S, T] target view of a batch, as the sequence losses take it.
TensorView sequence_targets(const data::Batch& batch);

/// The rows of an lm_head weight [V, H] (or of its gradient) that a rank of a vocabulary split
/// holds: [shard.offset, shard.end()) (see VocabShard::of); the whole view without a split.
TensorView lm_head_rows(const TensorView& weight, const VocabShard& shard);

/// Per-sequence sums of the token log-probs of `model` on the batch's trained targets (forward
/// only), from the library's SequenceLogProbs on the final hidden states and the lm_head (with
/// `shard`, this rank's rows of it; every rank of the split gets every sum).
SequenceLogProbResult sequence_logps(LossDevice& device, model::LlamaModel& model,
                                     const data::Batch& batch, std::size_t budget_bytes,
                                     const VocabShard& shard = {});

}  // namespace chunkloss::apps
