// Checkpoints in the Hugging Face layout: config.json (LlamaConfig) and model.safetensors (Llama
// tensor names, F32), plus optimizer.safetensors and trainer_state.json for exact resume. Every
// file is staged as a fsynced temporary and renamed into place, under a commit record, only
// after all were written.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "chunkloss/model/config.h"
#include "chunkloss/model/model.h"
#include "chunkloss/model/optim.h"

namespace chunkloss::model {

/// File names inside a checkpoint directory.
inline constexpr const char* kConfigFile = "config.json";
inline constexpr const char* kModelFile = "model.safetensors";
inline constexpr const char* kOptimizerFile = "optimizer.safetensors";
inline constexpr const char* kTrainerStateFile = "trainer_state.json";

/// Whether save_checkpoint writes a file of this name into its directory: one of the four files
/// above, its temporary ("<file>.tmp"), or the save's commit record. Another program's file of
/// such a name in a checkpoint directory would be overwritten or removed by a save, or read as
/// part of the checkpoint.
bool is_checkpoint_file_name(std::string_view name);

/// Training-loop state saved with the optimizer (trainer_state.json).
struct TrainerState {
  std::int64_t global_step = 0;
  std::map<std::string, std::int64_t> counters;  ///< e.g. "epoch", "batch_in_epoch", "seed"
  std::map<std::string, double> scalars;         ///< finite values, e.g. "last_loss"
  std::map<std::string, std::string> strings;    ///< e.g. "loss": "dpo"
  /// The run's records up to global_step (Hugging Face's log_history), each the text of one
  /// JSON object: saved as an array, so the records travel with the checkpoint they lead to.
  /// None: not saved (a trainer that keeps no records, or a checkpoint saved without them).
  std::optional<std::vector<std::string>> log_history;
};

/// Saves into `dir` (created when missing):
/// - config.json: config_to_json(model.config()) plus "chunkloss_save_id";
/// - model.safetensors: every parameter under its HF name (lm_head.weight omitted when tied),
///   F32, metadata {"format": "pt", "chunkloss_save_id"};
/// - with `optimizer`: optimizer.safetensors holding "<name>.exp_avg" and "<name>.exp_avg_sq"
///   per parameter, metadata {"step", "chunkloss_save_id"};
/// - with `state`: trainer_state.json with global_step, the maps, the log history, the AdamW
///   options and the id.
/// All files are first written to "<file>.tmp" and fsynced. Then a commit record
/// (dir/.chunkloss-commit, written atomically) names them, they are renamed over the old files,
/// and the record is removed (the directory is fsynced after each step). A failure while
/// staging removes the temporaries and leaves the previous checkpoint untouched. A crash after
/// the record leaves the new checkpoint readable: while the record exists, the loaders read each
/// file it names from its temporary if that is still there, and the next save completes the
/// renames before staging its own. Optimizer or trainer-state files of an earlier save that this
/// save does not write are removed. Each save has a fresh random save id; the loaders reject
/// files whose ids differ (files copied or edited by hand from different saves).
/// Throws chunkloss::Error naming the file and the failing call, and before writing anything
/// when a parameter or moment is NaN or Inf or a second moment is negative (the loaders would
/// refuse the save: a diverged run).
void save_checkpoint(const std::string& dir, const LlamaModel& model,
                     const AdamW* optimizer = nullptr, const TrainerState* state = nullptr);

/// Throws chunkloss::Error naming the path for what in `dir` would make a save there fail, so a
/// trainer can refuse its --save before training: `dir` not a directory, a commit record that
/// cannot be read, or a checkpoint file, its temporary or the record not a regular file (a
/// directory of that name, say). A missing `dir` passes.
void check_save_target(const std::string& dir);

/// Parses dir/config.json (config_from_json).
LlamaConfig load_config(const std::string& dir);

/// A model built from dir/config.json with its weights from dir/model.safetensors. With
/// `save_id`, stores the files' save id there (empty for files without one), for
/// load_training_state to check that the directory was not saved again in between.
LlamaModel load_model(const std::string& dir, std::string* save_id = nullptr);

/// Reads a safetensors file into `model`. The file must hold exactly the model's tensors: every
/// problem is counted, and the first 20 listed, in one chunkloss::Error naming the file, e.g.
/// "missing tensor model.norm.weight", "unexpected tensor lm_head.weight (tie_word_embeddings is
/// true)", "tensor model.embed_tokens.weight has shape [259, 32], expected [259, 64]", "tensor X
/// has dtype BF16, expected F32"; plus every SafetensorsFile::read error; and a NaN or Inf value,
/// named by tensor and index (load_model and load_training_state refuse those too). The model
/// is unchanged when it throws.
void load_weights(const std::string& path, LlamaModel& model);

/// True when dir holds optimizer.safetensors and trainer_state.json.
bool has_training_state(const std::string& dir);

/// Restores the optimizer's m, v and step from dir/optimizer.safetensors (names and shapes
/// validated against `model` as in load_weights; NaN or Inf moments and negative second moments
/// refused, named by tensor and index) and returns dir/trainer_state.json. Throws
/// chunkloss::Error naming the file and the problem, or when the files' save ids differ from
/// each other or from config.json's, or from a non-empty `model_save_id` (load_model's: the
/// directory was saved again after the model was loaded). The optimizer is unchanged when it
/// throws.
TrainerState load_training_state(const std::string& dir, const LlamaModel& model, AdamW& optimizer,
                                 const std::string& model_save_id = {});

}  // namespace chunkloss::model
