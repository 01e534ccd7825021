// Checkpoint save (stage every file, then rename) and load (validate the whole tensor set
// against the model before copying anything).
#include "chunkloss/model/checkpoint.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#include "atomic_file.h"
#include "chunkloss/core/error.h"
#include "chunkloss/core/strict_json.h"
#include "chunkloss/model/decoder.h"
#include "chunkloss/model/safetensors.h"

namespace chunkloss::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kSaveIdKey = "chunkloss_save_id";
// A checkpoint's JSON files are read whole: a larger one is refused before it is read, and the
// save refuses to write one. (The trainer state's log history of a long run is the largest: a
// step's record is 0.3-0.5 KB, so about 2 million steps fit.)
constexpr std::uint64_t kMaxJsonBytes = std::uint64_t{1} << 30;

std::string in_dir(const std::string& dir, const char* file) {
  return (fs::path(dir) / file).string();
}

std::string new_save_id() {
  std::random_device rd;
  const std::uint64_t hi = rd(), lo = rd();
  const std::uint64_t id = (hi << 32) ^ lo;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(id));
  return buf;
}

std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

TensorView view_of(const float* p, const std::vector<std::int64_t>& shape) {
  if (shape.size() == 1) return TensorView::of(p, {shape[0]});
  return TensorView::of(p, {shape[0], shape[1]});
}

// Stages files as fsynced temporaries, removed on destruction unless keep() was called: once
// the save's commit record names them (see Commit), they are the save.
class Staging {
 public:
  void add(const std::string& path, std::string_view bytes) {
    temps_.push_back(detail::temp_path(path));
    detail::write_temp_file(temps_.back(), bytes);
  }
  void keep() { kept_ = true; }
  ~Staging() {
    for (const std::string& t : temps_)
      if (!kept_) detail::remove_file_quietly(t);
  }

 private:
  std::vector<std::string> temps_;
  bool kept_ = false;
};

struct Wanted {
  std::string name;
  std::vector<std::int64_t> shape;
};

// Throws one error listing every difference between the file's tensors and `want` (with
// `expected_by`, the config file they come from, named at its end).
void check_tensor_set(const SafetensorsFile& f, const std::vector<Wanted>& want,
                      const LlamaConfig& config, const std::string& expected_by = "") {
  std::vector<std::string> problems;
  std::set<std::string> wanted;
  for (const Wanted& w : want) {
    wanted.insert(w.name);
    const SafetensorsEntry* e = f.find(w.name);
    if (!e) {
      problems.push_back("missing tensor " + w.name);
      continue;
    }
    if (e->dtype != "F32") {
      problems.push_back("tensor " + w.name + " has dtype " + e->dtype + ", expected F32");
    }
    if (e->shape != w.shape) {
      problems.push_back("tensor " + w.name + " has shape " + shape_str(e->shape) + ", expected " +
                         shape_str(w.shape));
    }
  }
  for (const SafetensorsEntry& e : f.tensors()) {
    if (wanted.count(e.name)) continue;
    std::string p = "unexpected tensor " + e.name;
    if (e.name.rfind("lm_head.weight", 0) == 0 && config.tie_word_embeddings) {
      p += " (tie_word_embeddings is true)";
    } else if (e.name.rfind("model.layers.", 0) == 0) {
      p += " (the config has " + std::to_string(config.num_hidden_layers) + " layers)";
    }
    problems.push_back(std::move(p));
  }
  if (problems.empty()) return;
  std::ostringstream os;
  os << f.source() << ": " << problems.size()
     << (problems.size() == 1 ? " problem: " : " problems: ");
  constexpr std::size_t kListed = 20;  // (a hostile file may hold a million tensors)
  for (std::size_t i = 0; i < std::min(problems.size(), kListed); ++i)
    os << (i ? "; " : "") << problems[i];
  if (problems.size() > kListed) os << "; and " << problems.size() - kListed << " more";
  if (!expected_by.empty()) os << " (the tensors of " << expected_by << ")";
  CHUNKLOSS_FAIL(os.str());
}

std::vector<Wanted> model_tensors(const std::vector<ParameterInfo>& layout) {
  std::vector<Wanted> out;
  for (const ParameterInfo& p : layout) out.push_back({p.name, p.shape});
  return out;
}

// The index of the first value of `v` that is NaN or Inf, or with `non_negative` (AdamW's second
// moments) below 0; v.size() when there is none.
std::size_t first_unsaveable(std::span<const float> v, bool non_negative) {
  const auto bad = std::find_if(
      v.begin(), v.end(), [&](float x) { return !std::isfinite(x) || (non_negative && x < 0.0f); });
  return static_cast<std::size_t>(bad - v.begin());
}

// The values of the model's parameters, each from tensor "<name><suffix>" of `f` (whose tensor set
// was checked), in the model's layout. Throws naming the file and the tensor when a value is NaN
// or Inf (a diverged run's save, which no training or evaluation can use), or with
// `non_negative` below 0.
std::vector<float> read_parameters(const SafetensorsFile& f, const LlamaModel& model,
                                   const char* suffix, bool non_negative = false) {
  std::vector<float> values(model.params().size());
  for (const ParameterInfo& p : model.parameters()) {
    const std::span<float> dst = std::span<float>(values).subspan(p.offset, p.numel);
    f.copy_f32(*f.find(p.name + suffix), dst);
    const std::size_t bad = first_unsaveable(dst, non_negative);
    CHUNKLOSS_CHECK(bad == dst.size(), f.source(), ": tensor ", p.name, suffix, " holds ", dst[bad],
                    " at flat index ", bad,
                    std::isfinite(dst[bad])
                        ? " (a second moment is never negative: a damaged or hand-made file?)"
                        : " (a diverged run's save?)");
  }
  return values;
}

// Throws naming `what` and the parameter when `values` (laid out as the model's parameters) holds
// NaN or Inf, or with `non_negative` a negative value: the loaders refuse such a save, so it is
// never written.
void check_saveable(std::span<const float> values, const LlamaModel& model, const char* what,
                    bool non_negative = false) {
  for (const ParameterInfo& p : model.parameters()) {
    const std::span<const float> v = values.subspan(p.offset, p.numel);
    const std::size_t bad = first_unsaveable(v, non_negative);
    CHUNKLOSS_CHECK(bad == v.size(), "save_checkpoint: ", what, " of ", p.name, " holds ", v[bad],
                    " at flat index ", bad,
                    ": not saved (the loaders would refuse it; a diverged run?)");
  }
}

// Checks the tensor set of `f` against `model` and copies its values in (all or none).
void copy_parameters(const SafetensorsFile& f, LlamaModel& model) {
  check_tensor_set(f, model_tensors(model.parameters()), model.config());
  const std::vector<float> values = read_parameters(f, model, "");
  std::copy(values.begin(), values.end(), model.params().begin());
}

// A checkpoint's JSON file (config, trainer state, commit record), at most kMaxJsonBytes.
std::string read_text(const std::string& path) {
  return detail::read_regular_file(path, 0, [&](std::string_view, std::uint64_t size) {
    CHUNKLOSS_CHECK(size <= kMaxJsonBytes, path, ": ", size, " bytes, more than the ",
                    kMaxJsonBytes, "-byte limit of a checkpoint's JSON file");
  });
}

json parse_json_file(const std::string& path) {
  return chunkloss::detail::parse_strict_json(read_text(path), path + ": bad JSON");
}

// The save id in a safetensors file's metadata, or "" when absent.
std::string meta_save_id(const SafetensorsFile& f) {
  const auto it = f.metadata().find(kSaveIdKey);
  return it != f.metadata().end() ? it->second : std::string();
}

void check_same_save(const std::string& a_name, const std::string& a, const std::string& b_name,
                     const std::string& b) {
  CHUNKLOSS_CHECK(a.empty() || b.empty() || a == b, a_name, " (save id ", a, ") and ", b_name,
                  " (save id ", b, ") come from different saves: an interrupted save?");
}

[[noreturn]] void fail_field(const std::string& path, const char* field, const char* want) {
  CHUNKLOSS_FAIL(path, ": field \"", field, "\" must be ", want);
}

// The save id of JSON file `path` (j), empty when it has none (a file another program wrote).
std::string json_save_id(const json& j, const std::string& path) {
  const auto it = j.find(kSaveIdKey);
  if (it == j.end()) return {};
  if (!it->is_string()) fail_field(path, kSaveIdKey, "a string");
  return it->get<std::string>();
}

// The commit record of a save (dir/.chunkloss-commit): written atomically once every file of
// the save is staged, removed once they are all renamed into place. While it exists, each file
// it names is read from its temporary if that is still there, and each file it removes counts
// as absent; the next save completes it first. So a crash at any point of a save leaves either
// the previous checkpoint or the new one readable, never a mix.
constexpr const char* kCommitFile = ".chunkloss-commit";
const std::set<std::string> kCheckpointFiles = {kConfigFile, kModelFile, kOptimizerFile,
                                                kTrainerStateFile};

struct Commit {
  std::set<std::string> renamed;  ///< files whose temporaries become the files
  std::set<std::string> removed;  ///< files of an earlier save that this one does not write
};

std::optional<Commit> read_commit(const std::string& dir) {
  const std::string path = in_dir(dir, kCommitFile);
  if (detail::file_type_of(path) == fs::file_type::not_found) return std::nullopt;
  const json j = parse_json_file(path);
  Commit c;
  for (auto [field, out] : {std::pair{"renamed", &c.renamed}, std::pair{"removed", &c.removed}}) {
    const auto it = j.is_object() ? j.find(field) : j.end();
    if (it == j.end() || !it->is_array())
      fail_field(path, field, "an array of checkpoint file names");
    for (const json& name : *it) {
      if (!name.is_string() || !kCheckpointFiles.count(name.get<std::string>()))
        fail_field(path, field, "an array of checkpoint file names");
      out->insert(name.get<std::string>());
    }
  }
  return c;
}

// Where a checkpoint's files are read from: dir/<file>, or its temporary under a commit record.
class CheckpointFiles {
 public:
  explicit CheckpointFiles(std::string dir) : dir_(std::move(dir)), commit_(read_commit(dir_)) {}
  std::string path(const char* file) const {
    const std::string final_path = in_dir(dir_, file);
    if (commit_ && commit_->renamed.count(file)) {
      const std::string tmp = detail::temp_path(final_path);
      if (detail::file_type_of(tmp) != fs::file_type::not_found) return tmp;
    }
    return final_path;
  }
  bool present(const char* file) const {
    return !(commit_ && commit_->removed.count(file)) &&
           detail::file_type_of(path(file)) == fs::file_type::regular;
  }
  // path(file) for reading it: a file missing beside its temporary (a save that stopped before
  // its commit record, as one killed during its first save into the directory) is named so.
  std::string read_path(const char* file) const {
    const std::string p = path(file), tmp = detail::temp_path(p);
    std::error_code ec, tmp_ec;  // (other troubles are the reader's to name)
    const fs::file_type t = fs::symlink_status(tmp, tmp_ec).type();
    if (fs::status(p, ec).type() == fs::file_type::not_found && t != fs::file_type::not_found &&
        t != fs::file_type::none)
      CHUNKLOSS_FAIL(dir_, ": no ", file, ", only ", tmp,
                     ": a save into it stopped before it was complete, so it holds no checkpoint");
    return p;
  }

 private:
  std::string dir_;
  std::optional<Commit> commit_;
};

// Completes the save a commit record in `dir` describes: the save that wrote it, or one a crash
// interrupted after it was written.
void finish_commit(const std::string& dir) {
  const std::optional<Commit> c = read_commit(dir);
  if (!c) return;
  for (const std::string& f : c->renamed) {
    const std::string tmp = detail::temp_path(in_dir(dir, f.c_str()));
    if (detail::file_type_of(tmp) != fs::file_type::not_found)
      detail::rename_file(tmp, in_dir(dir, f.c_str()));
  }
  for (const std::string& f : c->removed) detail::remove_file_quietly(in_dir(dir, f.c_str()));
  detail::sync_parent_dir(in_dir(dir, kCommitFile));
  detail::remove_file_quietly(in_dir(dir, kCommitFile));
  detail::sync_parent_dir(in_dir(dir, kCommitFile));
}

// save_checkpoint's files, written into existing directory `dir`.
void write_checkpoint(const std::string& dir, const LlamaModel& model, const AdamW* optimizer,
                      const TrainerState* state) {
  const std::string id = new_save_id();
  const json id_field = {{kSaveIdKey, id}};

  std::vector<NamedTensor> weights;
  for (const ParameterInfo& p : model.parameters()) {
    weights.push_back({p.name, view_of(model.params().data() + p.offset, p.shape)});
  }
  std::string optimizer_bytes;
  if (optimizer) {
    CHUNKLOSS_CHECK(optimizer->size() == model.params().size(), "save_checkpoint: the optimizer ",
                    "holds ", optimizer->size(), " values for a model of ", model.params().size());
    std::vector<NamedTensor> moments;
    for (const ParameterInfo& p : model.parameters()) {
      moments.push_back(
          {p.name + ".exp_avg", view_of(optimizer->exp_avg().data() + p.offset, p.shape)});
      moments.push_back(
          {p.name + ".exp_avg_sq", view_of(optimizer->exp_avg_sq().data() + p.offset, p.shape)});
    }
    optimizer_bytes = serialize_safetensors(
        moments, {{"step", std::to_string(optimizer->step_count())}, {kSaveIdKey, id}});
  }
  std::string state_text;
  if (state) {
    json j;
    j["global_step"] = state->global_step;
    j[kSaveIdKey] = id;
    if (optimizer) {
      const AdamWOptions& o = optimizer->options();
      j["optimizer"] = {{"type", "AdamW"},  {"step", optimizer->step_count()},
                        {"beta1", o.beta1}, {"beta2", o.beta2},
                        {"eps", o.eps},     {"weight_decay", o.weight_decay}};
    }
    j["counters"] = state->counters;
    for (const auto& [k, v] : state->scalars) {
      CHUNKLOSS_CHECK(std::isfinite(v), "save_checkpoint: trainer state scalar \"", k, "\" = ", v,
                      " is not finite");
    }
    j["scalars"] = state->scalars;
    j["strings"] = state->strings;
    state_text = j.dump(2);
    if (state->log_history) {  // last, compact, one record a line: "log_history": [{..}, ..]
      std::string records;
      for (const std::string& record : *state->log_history) {
        const json r = json::parse(record, nullptr, false);
        CHUNKLOSS_CHECK(
            r.is_object(),
            "save_checkpoint: a log_history record is not a JSON object: ", record.substr(0, 80));
        records += (records.empty() ? "\n    " : ",\n    ") + r.dump();
      }
      state_text.insert(state_text.size() - 2,
                        ",\n  \"log_history\": [" + records + (records.empty() ? "]" : "\n  ]"));
    }
    state_text += "\n";
    CHUNKLOSS_CHECK(state_text.size() <= kMaxJsonBytes, "save_checkpoint: the trainer state is ",
                    state_text.size(), " bytes, more than the ", kMaxJsonBytes,
                    "-byte limit of a checkpoint's JSON file (its log_history: ",
                    state->log_history ? state->log_history->size() : 0, " records)");
  }

  const std::string config_path = in_dir(dir, kConfigFile);
  const std::string model_path = in_dir(dir, kModelFile);
  const std::string optimizer_path = in_dir(dir, kOptimizerFile);
  const std::string state_path = in_dir(dir, kTrainerStateFile);
  finish_commit(dir);
  Staging staging;
  staging.add(model_path, serialize_safetensors(weights, {{"format", "pt"}, {kSaveIdKey, id}}));
  if (optimizer) staging.add(optimizer_path, optimizer_bytes);
  if (state) staging.add(state_path, state_text);
  staging.add(config_path, config_to_json(model.config(), id_field.dump()));
  // A crash earlier may have left temporaries of files this save does not write.
  if (!optimizer) detail::remove_file_quietly(detail::temp_path(optimizer_path));
  if (!state) detail::remove_file_quietly(detail::temp_path(state_path));
  detail::sync_parent_dir(model_path);  // the temporaries' entries before the record's
  json record = {{"renamed", {kModelFile, kConfigFile}}, {"removed", json::array()}};
  record[optimizer ? "renamed" : "removed"].push_back(kOptimizerFile);
  record[state ? "renamed" : "removed"].push_back(kTrainerStateFile);
  const std::string record_path = in_dir(dir, kCommitFile);
  try {
    write_file_atomically(record_path, record.dump() + "\n");
  } catch (...) {
    std::error_code ec;  // (no second error here: the first one is thrown)
    if (fs::exists(record_path, ec)) staging.keep();  // it failed after the rename: it is in force
    throw;
  }
  staging.keep();
  finish_commit(dir);  // the renames and removals the record names, then the record's removal
}

}  // namespace

bool is_checkpoint_file_name(std::string_view name) {
  if (name == kCommitFile || name == detail::temp_path(kCommitFile)) return true;
  for (const std::string& f : kCheckpointFiles)
    if (name == f || name == detail::temp_path(f)) return true;
  return false;
}

void save_checkpoint(const std::string& dir, const LlamaModel& model, const AdamW* optimizer,
                     const TrainerState* state) {
  check_saveable(model.params(), model, "the parameter");
  if (optimizer && optimizer->size() == model.params().size()) {
    check_saveable(optimizer->exp_avg(), model, "the optimizer's exp_avg");
    check_saveable(optimizer->exp_avg_sq(), model, "the optimizer's exp_avg_sq", true);
  }
  bool created = false;
  try {
    created = fs::create_directories(dir);
  } catch (const fs::filesystem_error& e) {
    CHUNKLOSS_FAIL("cannot create checkpoint directory ", dir, ": ", e.what());
  }
  try {
    if (created) {  // its entry in the parent made durable, as the files' renames are
      fs::path d = fs::path(dir).lexically_normal();
      if (!d.has_filename()) d = d.parent_path();  // "DIR/"
      detail::sync_parent_dir(d.string());
    }
    write_checkpoint(dir, model, optimizer, state);
  } catch (...) {
    // A failed save into a directory it made (a full disk at --save-every's checkpoint-N)
    // leaves no empty directory behind; remove() takes only an empty one.
    std::error_code ec;
    if (created) fs::remove(dir, ec);
    throw;
  }
}

void check_save_target(const std::string& dir) {
  const fs::file_type t = detail::file_type_of(dir);
  if (t == fs::file_type::not_found) return;
  CHUNKLOSS_CHECK(t == fs::file_type::directory, dir, " is not a directory");
  std::vector<const char*> files = {kCommitFile};
  for (const std::string& f : kCheckpointFiles) files.push_back(f.c_str());
  for (const char* f : files) {
    const std::string p = in_dir(dir, f), tmp = detail::temp_path(p);
    for (const std::string& q : {p, tmp}) {
      const fs::file_type ft = detail::file_type_of(q);
      CHUNKLOSS_CHECK(ft == fs::file_type::not_found || ft == fs::file_type::regular, q,
                      " is not a regular file: a checkpoint saved into ", dir, " would fail on it");
    }
    // (a save writes its temporaries with O_NOFOLLOW: never through a link, even a dangling one)
    std::error_code ec;
    CHUNKLOSS_CHECK(!fs::is_symlink(fs::symlink_status(tmp, ec)), tmp,
                    " is a symbolic link: a checkpoint saved into ", dir, " would fail on it");
  }
  read_commit(dir);  // (a save completes it first)
}

LlamaConfig load_config(const std::string& dir) {
  const std::string path = CheckpointFiles(dir).read_path(kConfigFile);
  return config_from_json(read_text(path), path);
}

void load_weights(const std::string& path, LlamaModel& model) {
  const SafetensorsFile f = SafetensorsFile::read(path);
  copy_parameters(f, model);
}

LlamaModel load_model(const std::string& dir, std::string* save_id) {
  const CheckpointFiles files(dir);
  const std::string config_path = files.read_path(kConfigFile);
  const std::string config_text = read_text(config_path);
  const LlamaConfig config = config_from_json(config_text, config_path);
  const std::string model_path = files.read_path(kModelFile);
  const SafetensorsFile f = SafetensorsFile::read(model_path);
  const std::string id = meta_save_id(f);
  check_same_save(config_path, json_save_id(json::parse(config_text), config_path), model_path, id);
  // The tensors against the config's layout before a model of its size is allocated: a
  // config.json of another model (or a hostile one) fails in one line, not out of memory.
  check_tensor_set(f, model_tensors(detail::parameter_layout(config)), config, config_path);
  LlamaModel model(config);
  copy_parameters(f, model);
  if (save_id) *save_id = id;
  return model;
}

bool has_training_state(const std::string& dir) {
  const CheckpointFiles files(dir);
  return files.present(kOptimizerFile) && files.present(kTrainerStateFile);
}

TrainerState load_training_state(const std::string& dir, const LlamaModel& model, AdamW& optimizer,
                                 const std::string& model_save_id) {
  CHUNKLOSS_CHECK(optimizer.size() == model.params().size(), "load_training_state: the optimizer ",
                  "holds ", optimizer.size(), " values for a model of ", model.params().size());
  const CheckpointFiles files(dir);
  CHUNKLOSS_CHECK(files.present(kOptimizerFile) && files.present(kTrainerStateFile), dir,
                  ": the checkpoint has no optimizer or trainer state (it was saved without them)");
  const std::string opt_path = files.path(kOptimizerFile);
  const std::string state_path = files.path(kTrainerStateFile);
  const std::string config_path = files.path(kConfigFile);

  const SafetensorsFile f = SafetensorsFile::read(opt_path);
  std::vector<Wanted> want;
  for (const ParameterInfo& p : model.parameters()) {
    want.push_back({p.name + ".exp_avg", p.shape});
    want.push_back({p.name + ".exp_avg_sq", p.shape});
  }
  check_tensor_set(f, want, model.config());
  const auto step_it = f.metadata().find("step");
  CHUNKLOSS_CHECK(step_it != f.metadata().end(), opt_path, ": metadata has no \"step\"");
  std::int64_t step = -1;
  const std::string& s = step_it->second;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), step);
  CHUNKLOSS_CHECK(ec == std::errc() && ptr == s.data() + s.size() && step >= 0, opt_path,
                  ": metadata \"step\" = \"", s, "\" is not a non-negative integer");

  const json j = parse_json_file(state_path);
  CHUNKLOSS_CHECK(j.is_object(), state_path, ": expected a JSON object, got ", j.type_name());
  const std::string state_id = json_save_id(j, state_path);
  // Both written by every save since save ids exist, so one without an id is from another save.
  const std::string opt_id = meta_save_id(f);
  CHUNKLOSS_CHECK(opt_id == state_id, opt_path, " (save id ", opt_id.empty() ? "none" : opt_id,
                  ") and ", state_path, " (save id ", state_id.empty() ? "none" : state_id,
                  ") come from different saves: an interrupted save?");
  CHUNKLOSS_CHECK(model_save_id.empty() || state_id == model_save_id, state_path, " (save id ",
                  state_id, ") is not from the save the model was loaded from ", "(save id ",
                  model_save_id, "): ", dir, " was saved again in between; load the model again");
  if (detail::file_type_of(config_path) == fs::file_type::regular) {
    check_same_save(config_path, json_save_id(parse_json_file(config_path), config_path),
                    state_path, state_id);
  }
  TrainerState st;
  // (nlohmann takes 2^64 - 1 as an integer, which int64 reads as -1.)
  const auto int64 = [](const json& v) {
    return v.is_number_integer() &&
           !(v.is_number_unsigned() &&
             v.get<std::uint64_t>() >
                 static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()));
  };
  const auto gs = j.find("global_step");
  if (gs == j.end() || !int64(*gs))
    fail_field(state_path, "global_step", "an integer in [-2^63, 2^63 - 1]");
  st.global_step = gs->get<std::int64_t>();
  const auto read_map = [&](const char* field, auto& out, auto is_ok, const char* want_desc) {
    const auto it = j.find(field);
    if (it == j.end()) return;
    if (!it->is_object()) fail_field(state_path, field, "an object");
    for (auto e = it->begin(); e != it->end(); ++e) {
      if (!is_ok(e.value())) fail_field(state_path, field, want_desc);
      using V = typename std::decay_t<decltype(out)>::mapped_type;
      out[e.key()] = e.value().template get<V>();
    }
  };
  read_map("counters", st.counters, int64, "an object of integers in [-2^63, 2^63 - 1]");
  read_map(
      "scalars", st.scalars, [](const json& v) { return v.is_number(); }, "an object of numbers");
  read_map(
      "strings", st.strings, [](const json& v) { return v.is_string(); }, "an object of strings");
  if (const auto lh = j.find("log_history"); lh != j.end()) {
    if (!lh->is_array()) fail_field(state_path, "log_history", "an array of objects");
    st.log_history.emplace();
    for (const json& r : *lh) {
      if (!r.is_object()) fail_field(state_path, "log_history", "an array of objects");
      st.log_history->push_back(r.dump());
    }
  }

  optimizer.load_state(read_parameters(f, model, ".exp_avg"),
                       read_parameters(f, model, ".exp_avg_sq", true), step);
  return st;
}

}  // namespace chunkloss::model
