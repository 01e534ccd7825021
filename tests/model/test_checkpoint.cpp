// Checkpoints: bitwise round trips (tied/untied) in the HF layout, bitwise resume of training,
// every bad-file case (truncated, bad header, offsets, dtype, shape, missing/unexpected tensor,
// bad config/optimizer/trainer state, mixed saves) and interrupted saves, before and after the
// save's commit record.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/model/checkpoint.h>
#include <chunkloss/model/safetensors.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#include <sys/stat.h>

#include "data/expect_error.h"
#include "data/temp_dir.h"
#include "reference_decoder.h"

namespace chunkloss::test {
namespace {

using namespace chunkloss::model;
namespace fs = std::filesystem;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

bool same_params(const LlamaModel& a, const LlamaModel& b) {
  return a.params().size() == b.params().size() &&
         std::memcmp(a.params().data(), b.params().data(), a.params().size() * 4) == 0;
}

// One deterministic training step on a quadratic loss: L = 0.5 |hidden - Y|^2 + 0.5e-3 |W_lm|^2,
// with the batch drawn from the step index (as a seeded sampler would).
void train_step(LlamaModel& m, AdamW& opt, std::int64_t step) {
  const LlamaConfig& c = m.config();
  std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(step));
  const std::int64_t b = 2, t = 6;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(b * t));
  for (auto& x : tokens)
    x = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.vocab_size));
  m.zero_grad();
  const TensorView h = m.forward(TensorView::of(tokens.data(), {b, t}));
  std::vector<float> gh(static_cast<std::size_t>(h.numel()));
  for (std::size_t j = 0; j < gh.size(); ++j) {
    gh[j] = h.data_as<const float>()[j] - static_cast<float>(j % 3) * 0.5f;
  }
  const TensorView w = m.lm_head_weight();
  std::vector<float> gw(static_cast<std::size_t>(w.numel()));
  for (std::size_t j = 0; j < gw.size(); ++j) gw[j] = 1e-3f * w.data_as<const float>()[j];
  m.backward(TensorView::of(gh.data(), {h.size(0), h.size(1)}),
             TensorView::of(gw.data(), {w.size(0), w.size(1)}));
  clip_grad_norm(m.grads(), 1.0);
  LrSchedule s;
  s.lr = 1e-2;
  s.warmup_steps = 2;
  s.total_steps = 8;
  opt.step(m, learning_rate(s, step));
}

// A model, its optimizer and its trainer state, one training step in (global_step 1).
struct Trained {
  explicit Trained(const LlamaConfig& c) : m(c, 1), opt(m.params().size()) {
    train_step(m, opt, 0);
    st.global_step = 1;
  }
  void step() { train_step(m, opt, st.global_step++); }
  void save(const std::string& dir) const { save_checkpoint(dir, m, &opt, &st); }
  LlamaModel m;
  AdamW opt;
  TrainerState st;
};

AdamWOptions adamw_options() {
  AdamWOptions o;
  o.weight_decay = 0.01;
  return o;
}

TEST_CASE("checkpoint: bitwise round trip in the HF layout, tied and untied") {
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    const TempDir dir;
    const LlamaConfig c = tiny_config(true, tied);
    const LlamaModel m(c, 77);
    save_checkpoint(dir.path(), m);
    CHECK(fs::is_regular_file(dir.file("config.json")));
    CHECK(fs::is_regular_file(dir.file("model.safetensors")));
    CHECK(!fs::exists(dir.file("optimizer.safetensors")));
    CHECK(!fs::exists(dir.file("model.safetensors.tmp")));
    const LlamaModel back = load_model(dir.path());
    CHECK(same_params(m, back));
    CHECK(back.config().num_key_value_heads == 1);
    CHECK(back.config().tie_word_embeddings == tied);
    CHECK(back.config().rms_norm_eps == c.rms_norm_eps);
    CHECK(back.config().pad_token_id == c.pad_token_id);

    const std::string cfg = slurp(dir.file("config.json"));
    for (const char* field :
         {"\"architectures\"", "\"LlamaForCausalLM\"", "\"model_type\": \"llama\"",
          "\"hidden_size\": 12", "\"intermediate_size\": 20", "\"num_attention_heads\": 2",
          "\"num_key_value_heads\": 1", "\"num_hidden_layers\": 2", "\"vocab_size\": 11",
          "\"rms_norm_eps\"", "\"rope_theta\"", "\"max_position_embeddings\": 16",
          "\"tie_word_embeddings\"", "\"hidden_act\": \"silu\""}) {
      CAPTURE(field);
      CHECK(contains(cfg, field));
    }
    // The safetensors file: 8-byte LE header length, JSON header, F32 tensors under HF names.
    const std::string raw = slurp(dir.file("model.safetensors"));
    std::uint64_t len = 0;
    std::memcpy(&len, raw.data(), 8);
    CHECK(len % 8 == 0);
    CHECK(raw[8] == '{');
    const SafetensorsFile f = SafetensorsFile::read(dir.file("model.safetensors"));
    std::set<std::string> names;
    for (const auto& e : f.tensors()) {
      names.insert(e.name);
      CHECK(e.dtype == "F32");
    }
    std::set<std::string> want = {"model.embed_tokens.weight", "model.norm.weight"};
    for (int l = 0; l < 2; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      for (const char* s :
           {"input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}) {
        want.insert(p + s);
      }
    }
    if (!tied) want.insert("lm_head.weight");
    CHECK(names == want);
    CHECK(f.find("model.layers.1.self_attn.k_proj.weight")->shape ==
          std::vector<std::int64_t>{6, 12});
    CHECK(f.metadata().at("format") == "pt");
    // A second save over the first replaces it.
    const LlamaModel m2(c, 78);
    save_checkpoint(dir.path(), m2);
    CHECK(same_params(m2, load_model(dir.path())));
  }
}

TEST_CASE("checkpoint: k steps == j steps, save, load, k - j steps (bitwise)") {
  const LlamaConfig c = tiny_config(true, false);
  const std::int64_t k = 7, j = 3;
  LlamaModel straight(c, 5);
  AdamW straight_opt(straight.params().size(), adamw_options());
  for (std::int64_t s = 0; s < k; ++s) train_step(straight, straight_opt, s);

  const TempDir dir;
  {
    LlamaModel first(c, 5);
    AdamW opt(first.params().size(), adamw_options());
    for (std::int64_t s = 0; s < j; ++s) train_step(first, opt, s);
    TrainerState st;
    st.global_step = j;
    st.counters["epoch"] = 0;
    st.counters["seed"] = 5;
    st.scalars["last_loss"] = 0.25;
    st.strings["loss"] = "quadratic";
    st.log_history = std::vector<std::string>{R"({"loss":0.5,"step":1})",
                                              R"({"loss":0.25,"note":"x","step":2})"};
    save_checkpoint(dir.path(), first, &opt, &st);
  }
  CHECK(has_training_state(dir.path()));
  LlamaModel resumed = load_model(dir.path());
  AdamW opt(resumed.params().size(), adamw_options());
  const TrainerState st = load_training_state(dir.path(), resumed, opt);
  CHECK(st.global_step == j);
  CHECK(opt.step_count() == j);
  CHECK(st.counters.at("seed") == 5);
  CHECK(st.scalars.at("last_loss") == 0.25);
  CHECK(st.strings.at("loss") == "quadratic");
  CHECK(st.log_history == std::vector<std::string>{R"({"loss":0.5,"step":1})",
                                                   R"({"loss":0.25,"note":"x","step":2})"});
  // Compact records, one a line; a state without them loads without them.
  CHECK(contains(slurp(dir.file("trainer_state.json")),
                 "\"log_history\": [\n    {\"loss\":0.5,\"step\":1},\n    {\"loss\":0.25,"));
  {
    const TempDir other;
    TrainerState none;
    none.global_step = j;
    save_checkpoint(other.path(), resumed, &opt, &none);
    AdamW o(resumed.params().size());
    CHECK(!load_training_state(other.path(), resumed, o).log_history);
  }
  for (std::int64_t s = st.global_step; s < k; ++s) train_step(resumed, opt, s);

  CHECK(same_params(straight, resumed));
  CHECK(std::memcmp(straight_opt.exp_avg().data(), opt.exp_avg().data(), opt.size() * 4) == 0);
  CHECK(std::memcmp(straight_opt.exp_avg_sq().data(), opt.exp_avg_sq().data(), opt.size() * 4) ==
        0);
  CHECK(opt.step_count() == k);
  // And training did change the parameters.
  CHECK(!same_params(straight, LlamaModel(c, 5)));
}

// A checkpoint directory with a model to corrupt.
struct Saved {
  TempDir dir;
  LlamaConfig config = tiny_config(false, false);
  LlamaModel model{config, 3};
  Saved() { save_checkpoint(dir.path(), model); }
  std::string model_path() const { return dir.file("model.safetensors"); }
  std::string load_error() const {
    return error_message([&] { load_model(dir.path()); });
  }
};

TEST_CASE("checkpoint errors: truncated files") {
  Saved s;
  const std::string raw = slurp(s.model_path());
  spit(s.model_path(), raw.substr(0, 5));
  std::string m = s.load_error();
  CHECK(contains(m, s.model_path()));
  CHECK(contains(m, "truncated file: 5 bytes"));
  spit(s.model_path(), raw.substr(0, 40));
  m = s.load_error();
  CHECK(contains(m, "truncated file: the header length says"));
  spit(s.model_path(), raw.substr(0, raw.size() - 100));
  m = s.load_error();
  CHECK(contains(m, "out of range"));
  CHECK(contains(m, "truncated file?"));
  spit(s.model_path(), "");
  CHECK(contains(s.load_error(), "truncated file: 0 bytes"));
  fs::remove(s.model_path());
  CHECK(contains(s.load_error(), "cannot open " + s.model_path()));
}

TEST_CASE("checkpoint errors: a file that is not regular or too large is refused unread") {
  // Each would be read whole before: /dev/zero and a pipe without a writer never end, and the
  // sparse files' bytes (zeros) would be read before the first check.
  Saved s;
  const std::string good = slurp(s.model_path());
  fs::remove(s.model_path());
  fs::create_symlink("/dev/zero", s.model_path());
  CHECK(contains(s.load_error(), s.model_path() + " is not a regular file"));
  fs::remove(s.model_path());
  REQUIRE(::mkfifo(s.model_path().c_str(), 0600) == 0);
  CHECK(contains(s.load_error(), s.model_path() + " is not a regular file"));
  fs::remove(s.model_path());
  // A header length of 2^40 at the start of 4 GiB (sparse): refused by its first bytes.
  const std::uint64_t huge = std::uint64_t{1} << 40;
  spit(s.model_path(), std::string(reinterpret_cast<const char*>(&huge), 8));
  fs::resize_file(s.model_path(), std::uint64_t{4} << 30);
  CHECK(contains(s.load_error(), "header length 1099511627776 exceeds the 100 MB limit"));
  spit(s.model_path(), good);
  CHECK(s.load_error().empty());
  // A config.json of more than 1 GiB (sparse): refused by its size.
  const std::string config = s.dir.file("config.json");
  fs::resize_file(config, (std::uint64_t{1} << 30) + 1);
  CHECK(contains(s.load_error(), config + ": 1073741825 bytes, more than the 1073741824-byte "
                                          "limit of a checkpoint's JSON file"));
}

TEST_CASE("checkpoint: check_save_target refuses what a save would fail on, before it") {
  const TempDir dir;
  const std::string d = dir.file("ck");
  CHECK(error_message([&] { check_save_target(d); }).empty());  // (missing: made by the save)
  const LlamaModel m(tiny_config(false, false), 3);
  save_checkpoint(d, m);
  CHECK(error_message([&] { check_save_target(d); }).empty());
  const std::string a_file = dir.write("a_file", "x");
  CHECK(
      contains(error_message([&] { check_save_target(a_file); }), a_file + " is not a directory"));
  for (const char* name : {"model.safetensors.tmp", "trainer_state.json", ".chunkloss-commit"}) {
    const std::string p = (fs::path(d) / name).string();
    fs::remove(p);
    fs::create_directory(p);
    CHECK(
        contains(error_message([&] { check_save_target(d); }),
                 p + " is not a regular file: a checkpoint saved into " + d + " would fail on it"));
    fs::remove(p);
  }
  const std::string commit = (fs::path(d) / ".chunkloss-commit").string();
  spit(commit, "junk");
  CHECK(contains(error_message([&] { check_save_target(d); }), commit + ": bad JSON"));
  fs::remove(commit);
  CHECK(error_message([&] { check_save_target(d); }).empty());
  save_checkpoint(d, m);  // (and the directory is still a checkpoint a save can replace)
}

TEST_CASE("checkpoint errors: symbolic-link loops are chunkloss::Error naming the path") {
  // A loop where the loader looks for a file: the commit record, the config, a save's
  // temporaries; std::filesystem would throw its own error there.
  Saved s;
  const auto loop_at = [](const std::string& path) {
    fs::remove(path);
    fs::create_symlink(fs::path(path).filename(), path);
  };
  const std::string commit = s.dir.file(".chunkloss-commit");
  loop_at(commit);
  std::string m = s.load_error();
  CHECK(contains(m, "cannot read " + commit + ": Too many levels of symbolic links"));
  fs::remove(commit);
  CHECK(s.load_error().empty());
  const std::string config = s.dir.file("config.json");
  const std::string good = slurp(config);
  loop_at(config);
  CHECK(contains(s.load_error(), "cannot open " + config + ": Too many levels of symbolic links"));
  fs::remove(config);
  spit(config, good);
  CHECK(s.load_error().empty());
  // A commit record that names the model's temporary, which is a loop.
  spit(commit, R"({"renamed": ["model.safetensors"], "removed": []})");
  const std::string tmp = s.model_path() + ".tmp";
  loop_at(tmp);
  CHECK(contains(s.load_error(), "cannot read " + tmp));
}

TEST_CASE("checkpoint errors: bad header JSON and header length") {
  Saved s;
  std::string raw = slurp(s.model_path());
  std::string bad = raw;
  bad[9] = '#';  // the first key's opening quote
  spit(s.model_path(), bad);
  CHECK(contains(s.load_error(), "bad header JSON"));
  bad = raw;
  bad[8] = '[';
  spit(s.model_path(), bad);
  CHECK(contains(s.load_error(), "bad header JSON"));
  bad = raw;
  const std::uint64_t huge = std::uint64_t{1} << 40;
  std::memcpy(bad.data(), &huge, 8);
  spit(s.model_path(), bad);
  CHECK(contains(s.load_error(), "exceeds the 100 MB limit"));
}

// A file from a hand-written header and `data_bytes` zero bytes of data.
std::string raw_file(const std::string& header, std::size_t data_bytes) {
  std::string h = header;
  const std::uint64_t len = h.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &len, 8);
  return out + h + std::string(data_bytes, '\0');
}

TEST_CASE("checkpoint errors: offsets, dtypes and shapes inside the header") {
  const auto err = [](const std::string& header, std::size_t data) {
    return error_message([&] { SafetensorsFile::parse(raw_file(header, data), "t.safetensors"); });
  };
  CHECK(contains(err(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8),
                 "t.safetensors: tensor \"a\": data_offsets [0, 16] out of range"));
  CHECK(contains(err(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                 "span 8 bytes but F32 [3] needs 12"));
  CHECK(contains(err(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                     12),
                 "overlap"));
  CHECK(contains(err(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                 "leave a hole"));
  // A tensor named twice (nlohmann kept the last, whose range hid the first's overlap), and a NUL
  // byte (nlohmann ended the header there).
  CHECK(contains(err(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                     R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                     R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                     8),
                 "t.safetensors: bad header JSON: key \"a\" appears twice in one object"));
  CHECK(contains(err(std::string(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})") +
                         std::string("\0 x", 3),
                     4),
                 "t.safetensors: bad header JSON: a NUL byte at offset 54"));
  CHECK(contains(err(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8),
                 "trailing bytes"));
  CHECK(contains(err(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})", 4),
                 "unknown dtype \"Q4\""));
  CHECK(contains(err(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
                 "shape must hold non-negative integers"));
  CHECK(contains(err(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4),
                 "end before begin"));
  CHECK(contains(err(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4), "\"dtype\""));
  CHECK(contains(err(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4), "\"shape\""));
  CHECK(contains(err(R"({"a":{"dtype":"F32","shape":[1]}})", 4), "\"data_offsets\""));
  CHECK(contains(err(R"({"a":[1,2]})", 0), "entry must be an object"));
  CHECK(contains(err(R"({"__metadata__":{"k":1}})", 0), "\"__metadata__\" value of \"k\""));
  CHECK(contains(err(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],)"
                     R"("data_offsets":[0,4]}})",
                     4),
                 "too large"));
  // A valid hand-written file parses, with mixed dtypes and metadata.
  const SafetensorsFile ok = SafetensorsFile::parse(
      raw_file(R"({"__metadata__":{"k":"v"},"b":{"dtype":"I64","shape":[1],"data_offsets":[4,12]},)"
               R"("a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})",
               12),
      "ok");
  REQUIRE(ok.tensors().size() == 2);
  CHECK(ok.tensors()[0].name == "a");
  CHECK(ok.metadata().at("k") == "v");
  // An empty F32 tensor parses and copies out (found by fuzz_safetensors: no memcpy from null).
  const SafetensorsFile empty = SafetensorsFile::parse(
      raw_file(R"({"z":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]}})", 0), "empty");
  REQUIRE(empty.tensors().size() == 1);
  std::vector<float> none;
  empty.copy_f32(empty.tensors()[0], none);
  CHECK(empty.tensors()[0].shape == std::vector<std::int64_t>{0, 4});
}

TEST_CASE("checkpoint errors: missing, unexpected, wrong-shape and wrong-dtype tensors") {
  Saved s;
  const auto rewrite = [&](const std::string& skip, const std::vector<NamedTensor>& extra) {
    std::vector<NamedTensor> t;
    for (const auto& p : s.model.parameters()) {
      if (p.name == skip) continue;
      const float* d = s.model.params().data() + p.offset;
      t.push_back({p.name, p.shape.size() == 1 ? TensorView::of(d, {p.shape[0]})
                                               : TensorView::of(d, {p.shape[0], p.shape[1]})});
    }
    t.insert(t.end(), extra.begin(), extra.end());
    write_safetensors(s.model_path(), t, {{"format", "pt"}});
  };
  rewrite("model.norm.weight", {});
  std::string m = s.load_error();
  CHECK(contains(m, s.model_path() + ": 1 problem: missing tensor model.norm.weight"));
  const std::vector<float> junk(12 * 12, 0.5f);
  rewrite("", {{"model.layers.2.mlp.up_proj.weight", TensorView::of(junk.data(), {12, 12})}});
  m = s.load_error();
  CHECK(
      contains(m, "unexpected tensor model.layers.2.mlp.up_proj.weight (the config has 2 layers)"));
  rewrite("model.norm.weight", {{"model.norm.weight", TensorView::of(junk.data(), {2, 6})},
                                {"extra", TensorView::of(junk.data(), {3})}});
  m = s.load_error();
  CHECK(contains(m, "2 problems"));
  CHECK(contains(m, "tensor model.norm.weight has shape [2, 6], expected [12]"));
  CHECK(contains(m, "unexpected tensor extra"));
  // Many problems: the first 20 listed, the rest counted (300k made an 8 MB line).
  std::vector<NamedTensor> many;
  std::vector<std::string> names;
  for (int i = 0; i < 30; ++i) names.push_back("extra." + std::to_string(i));
  for (const std::string& n : names) many.push_back({n, TensorView::of(junk.data(), {3})});
  rewrite("", many);
  m = s.load_error();
  CHECK(contains(m, "30 problems: unexpected tensor extra."));
  CHECK(contains(m, "; and 10 more"));
  std::vector<BFloat16> half(12);
  rewrite("model.norm.weight", {{"model.norm.weight", TensorView::of(half.data(), {12})}});
  CHECK(contains(s.load_error(), "tensor model.norm.weight has dtype BF16, expected F32"));

  // A checkpoint of a model with another hidden size.
  LlamaConfig wide = s.config;
  wide.hidden_size = 16;
  const TempDir other;
  save_checkpoint(other.path(), LlamaModel(wide, 1));
  LlamaModel narrow(s.config, 1);
  m = error_message([&] { load_weights(other.file("model.safetensors"), narrow); });
  CHECK(contains(m, "tensor model.embed_tokens.weight has shape [11, 16], expected [11, 12]"));
  CHECK(contains(m, "tensor model.norm.weight has shape [16], expected [12]"));
  // Copied beside another save's config.json, the save ids disagree first.
  fs::copy_file(other.file("model.safetensors"), s.model_path(),
                fs::copy_options::overwrite_existing);
  CHECK(contains(s.load_error(), "come from different saves"));

  // An untied checkpoint loaded with tie_word_embeddings true, through load_weights.
  LlamaConfig tied = s.config;
  tied.tie_word_embeddings = true;
  LlamaModel target(tied, 1);
  const std::vector<float> before(target.params().begin(), target.params().end());
  const TempDir untied;
  save_checkpoint(untied.path(), LlamaModel(s.config, 2));
  m = error_message([&] { load_weights(untied.file("model.safetensors"), target); });
  CHECK(contains(m, "unexpected tensor lm_head.weight (tie_word_embeddings is true)"));
  CHECK(std::equal(before.begin(), before.end(), target.params().begin()));  // unchanged
}

TEST_CASE("checkpoint errors: config.json") {
  Saved s;
  const std::string path = s.dir.file("config.json");
  const std::string good = slurp(path);
  spit(path, "{\"hidden_size\": 12,");
  CHECK(contains(s.load_error(), path + ": bad JSON"));
  spit(path, "[]");
  CHECK(contains(s.load_error(), "expected a JSON object"));
  const auto with = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    const auto at = t.find(from);
    REQUIRE(at != std::string::npos);
    t.replace(at, from.size(), to);
    spit(path, t);
    return s.load_error();
  };
  CHECK(contains(with("\"hidden_size\": 12,", ""), path + ": missing field \"hidden_size\""));
  CHECK(contains(with("\"hidden_size\": 12", "\"hidden_size\": \"12\""),
                 "field \"hidden_size\" must be an integer, got string"));
  // A save id that is not a string would have skipped the check against the weights' id.
  const std::size_t id_at = good.find("\"chunkloss_save_id\": \"");
  REQUIRE(id_at != std::string::npos);
  const std::size_t id_end = good.find('"', id_at + 22) + 1;  // (after the id's closing quote)
  CHECK(contains(with(good.substr(id_at, id_end - id_at), "\"chunkloss_save_id\": 5"),
                 path + ": field \"chunkloss_save_id\" must be a string"));
  CHECK(contains(with("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\""),
                 "field \"hidden_act\" is \"gelu\""));
  CHECK(contains(with("\"model_type\": \"llama\"", "\"model_type\": \"gpt2\""), "model_type"));
  CHECK(contains(with("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
                 "num_key_value_heads=3"));
  CHECK(contains(with("\"rope_scaling\": null", "\"rope_scaling\": {\"type\": \"linear\"}"),
                 "rope_scaling"));
  // transformers 5's rope_parameters: other RoPE types are refused, a disagreeing theta too.
  CHECK(contains(with("\"rope_scaling\": null",
                      "\"rope_parameters\": {\"rope_type\": \"llama3\", \"rope_theta\": 500}"),
                 path + ": rope_parameters: field \"rope_type\" is \"llama3\""));
  CHECK(contains(with("\"rope_scaling\": null", "\"rope_parameters\": {\"rope_theta\": 500}"),
                 "rope_theta 500 differs from the top-level rope_theta"));
  CHECK(contains(with("\"rope_scaling\": null", "\"rope_parameters\": 5"),
                 "rope_parameters must be an object"));
  CHECK(contains(with("\"tie_word_embeddings\": false", "\"tie_word_embeddings\": 0"),
                 "field \"tie_word_embeddings\" must be a boolean"));
  // transformers' list of eos ids: the first is the one kept, and every item must be an id.
  for (const auto& [list, item] :
       {std::pair{"[9, \"x\"]", "item 1 is \"x\""},
        {"[9, 11]", "item 1 is 11, not a token id in [0, vocab_size=11)"},
        {"[9, -1]", "item 1 is -1"},
        {"[9.0]", "item 0 is 9.0"}})
    CHECK(contains(with("\"eos_token_id\": 9", std::string("\"eos_token_id\": ") + list),
                   path + ": field \"eos_token_id\" " + item));
  CHECK(contains(with("\"eos_token_id\": 9", "\"eos_token_id\": []"),
                 "field \"eos_token_id\" must be an integer or a non-empty list of integers"));
  CHECK(config_from_json(config_to_json(s.config, R"({"eos_token_id": [9, 2]})"), "list")
            .eos_token_id == 9);
  // Sizes whose products would overflow are refused before anything is allocated.
  const std::string i_field =
      "\"intermediate_size\": " + std::to_string(s.config.intermediate_size);
  CHECK(contains(with(i_field, "\"intermediate_size\": 9223372036854775807"),
                 path + ": LlamaConfig: intermediate_size=9223372036854775807 is not in [1, "
                        "2^31 - 1]"));
  CHECK(contains(with(i_field, "\"intermediate_size\": 2147483647"),
                 "parameters, more than this CPU model layer holds (2^36)"));
  // Nor does a small hostile config.json exhaust memory: too many layers, or tensors other than
  // model.safetensors holds, are refused before the model is allocated.
  const std::string l_field =
      "\"num_hidden_layers\": " + std::to_string(s.config.num_hidden_layers);
  CHECK(contains(with(l_field, "\"num_hidden_layers\": 100000000"),
                 path + ": LlamaConfig: num_hidden_layers=100000000 is more than"));
  const std::string v_field = "\"vocab_size\": " + std::to_string(s.config.vocab_size);
  for (const char* vocab : {"1000000", "2147483647"}) {
    const std::string m = with(v_field, std::string("\"vocab_size\": ") + vocab);
    CHECK(contains(m, s.model_path() + ": 2 problems: tensor model.embed_tokens.weight has shape"));
    CHECK(contains(m, std::string("expected [") + vocab + ", 12]"));
    CHECK(contains(m, "(the tensors of " + path + ")"));
  }
  CHECK(contains(with("\"rope_theta\": 10000.0", "\"rope_theta\": 1e-300"),
                 path + ": LlamaConfig: rope_theta=1e-300 must be positive and finite in float"));
  // A minimal HF config: missing optional fields take transformers' defaults.
  const LlamaConfig minimal = config_from_json(
      R"({"vocab_size": 11, "hidden_size": 12, "intermediate_size": 20, "num_hidden_layers": 1,
          "num_attention_heads": 2})",
      "mini.json");
  CHECK(minimal.num_key_value_heads == 2);
  CHECK(minimal.max_position_embeddings == 2048);
  CHECK(minimal.rms_norm_eps == 1e-6);
  CHECK(!minimal.tie_word_embeddings);
  CHECK(!minimal.pad_token_id.has_value());
  CHECK(minimal.rope_theta == 10000.0);
  // As transformers 5 writes it: the theta only inside rope_parameters.
  const LlamaConfig v5 = config_from_json(
      R"({"vocab_size": 11, "hidden_size": 12, "intermediate_size": 20, "num_hidden_layers": 1,
          "num_attention_heads": 2, "rope_parameters": {"rope_type": "default",
          "rope_theta": 500.0}})",
      "v5.json");
  CHECK(v5.rope_theta == 500.0);
  const LlamaConfig back = config_from_json(config_to_json(s.config), "round");
  CHECK(back.hidden_size == s.config.hidden_size);
  CHECK(back.rope_theta == s.config.rope_theta);
  CHECK(back.initializer_range == s.config.initializer_range);
}

TEST_CASE("checkpoint errors: NaN or Inf weights and moments") {
  Saved s;
  const SafetensorsFile f = SafetensorsFile::read(s.model_path());
  const auto with_value = [&](const std::string& path, const SafetensorsFile& src,
                              const std::string& tensor, float x) {
    std::vector<NamedTensor> t;
    std::vector<std::vector<float>> keep;
    for (const auto& e : src.tensors()) {
      keep.emplace_back((e.end - e.begin) / 4);
      src.copy_f32(e, keep.back());
      if (e.name == tensor) keep.back()[3] = x;
      t.push_back({e.name, e.shape.size() == 1
                               ? TensorView::of(keep.back().data(), {e.shape[0]})
                               : TensorView::of(keep.back().data(), {e.shape[0], e.shape[1]})});
    }
    write_safetensors(path, t, src.metadata());
  };
  with_value(s.model_path(), f, "model.norm.weight", NAN);
  CHECK(contains(s.load_error(), s.model_path() + ": tensor model.norm.weight holds nan at flat "
                                                  "index 3"));
  LlamaModel other(s.config, 9);
  const LlamaModel before = other;
  CHECK(contains(error_message([&] { load_weights(s.model_path(), other); }), "holds nan"));
  CHECK(same_params(other, before));  // all or nothing

  const TempDir dir;
  const Trained t(s.config);
  t.save(dir.path());
  const std::string opt_path = dir.file("optimizer.safetensors");
  with_value(opt_path, SafetensorsFile::read(opt_path), "lm_head.weight.exp_avg_sq", INFINITY);
  AdamW fresh(t.m.params().size());
  CHECK(contains(error_message([&] { load_training_state(dir.path(), t.m, fresh); }),
                 "tensor lm_head.weight.exp_avg_sq holds inf at flat index 3"));
  CHECK(fresh.step_count() == 0);
  // A negative second moment is finite but makes the next update sqrt(-x) = NaN.
  t.save(dir.path());
  with_value(opt_path, SafetensorsFile::read(opt_path), "model.norm.weight.exp_avg_sq", -1.0f);
  CHECK(contains(error_message([&] { load_training_state(dir.path(), t.m, fresh); }),
                 opt_path + ": tensor model.norm.weight.exp_avg_sq holds -1 at flat index 3"));
  CHECK(fresh.step_count() == 0);
}

TEST_CASE("checkpoint: a model holding NaN or Inf is not saved") {
  const TempDir dir;
  Trained t(tiny_config(false, false));
  t.save(dir.path());
  const std::string before = slurp(dir.file("model.safetensors"));
  const std::size_t norm = t.m.parameters().back().offset;  // (some parameter's first value)
  t.m.params()[norm + 1] = NAN;
  std::string m = error_message([&] { t.save(dir.path()); });
  CHECK(contains(m, "save_checkpoint: the parameter of " + t.m.parameters().back().name +
                        " holds nan at flat index 1: not saved"));
  CHECK(slurp(dir.file("model.safetensors")) == before);  // the previous save is untouched
  CHECK(!fs::exists(dir.file("model.safetensors.tmp")));
  // A NaN moment makes the next run's first update NaN: not saved either.
  t.m.params()[norm + 1] = 0.5f;
  const TempDir other;
  std::vector<float> g(t.m.params().size(), 0.0f);
  g[7] = NAN;
  t.opt.step(t.m.params(), g, 1e-3);
  m = error_message([&] { t.save(other.path()); });
  CHECK(contains(m, "save_checkpoint: the parameter of "));  // the NaN reached the parameter
  CHECK(!fs::exists(other.file("model.safetensors")));
}

TEST_CASE("checkpoint errors: optimizer state, trainer state and mixed saves") {
  const TempDir dir;
  Trained trained(tiny_config(false, true));
  trained.st.log_history.emplace();  // (an empty history, saved as [])
  trained.save(dir.path());
  const LlamaModel& m = trained.m;
  const AdamW& opt = trained.opt;
  const TrainerState& st = trained.st;
  const std::string opt_path = dir.file("optimizer.safetensors");
  const std::string state_path = dir.file("trainer_state.json");
  const std::string good_opt = slurp(opt_path), good_state = slurp(state_path);
  AdamW fresh(m.params().size());
  const auto err = [&] {
    return error_message([&] { load_training_state(dir.path(), m, fresh); });
  };
  CHECK(err().empty());
  CHECK(fresh.step_count() == 1);

  // A missing moment tensor.
  const SafetensorsFile f = SafetensorsFile::read(opt_path);
  std::vector<NamedTensor> t;
  std::vector<std::vector<float>> keep;
  for (const auto& e : f.tensors()) {
    if (e.name == "model.norm.weight.exp_avg_sq") continue;
    keep.emplace_back((e.end - e.begin) / 4);
    f.copy_f32(e, keep.back());
    t.push_back({e.name, e.shape.size() == 1
                             ? TensorView::of(keep.back().data(), {e.shape[0]})
                             : TensorView::of(keep.back().data(), {e.shape[0], e.shape[1]})});
  }
  write_safetensors(opt_path, t, f.metadata());
  CHECK(contains(err(), opt_path + ": 1 problem: missing tensor model.norm.weight.exp_avg_sq"));
  write_safetensors(opt_path, {}, f.metadata());
  CHECK(contains(err(), "missing tensor model.embed_tokens.weight.exp_avg"));
  spit(opt_path, good_opt);

  spit(state_path, "{\"global_step\": \"one\"");
  CHECK(contains(err(), state_path + ": bad JSON"));
  std::string state = good_state;
  state.replace(state.find("\"global_step\": 1"), 16, "\"global_step\": 1.5");
  spit(state_path, state);
  CHECK(contains(err(), state_path + ": field \"global_step\" must be an integer"));
  state.replace(state.find("1.5"), 3, "18446744073709551615");  // (it read as -1)
  spit(state_path, state);
  CHECK(contains(err(), state_path + ": field \"global_step\" must be an integer in [-2^63"));
  state = good_state;
  state.replace(state.find("\"global_step\": 1"), 16, "\"global_step\": 0, \"global_step\": 1");
  spit(state_path, state);
  CHECK(contains(err(), state_path + ": bad JSON: key \"global_step\" appears twice"));
  state = good_state;
  state.replace(state.find("\"log_history\": []"), 17, "\"log_history\": [1]");
  spit(state_path, state);
  CHECK(contains(err(), state_path + ": field \"log_history\" must be an array of objects"));
  spit(state_path, good_state);
  CHECK(err().empty());
  TrainerState bad_log = st;
  bad_log.log_history = std::vector<std::string>{"[1]"};
  CHECK(contains(error_message([&] { save_checkpoint(dir.path(), m, &opt, &bad_log); }),
                 "save_checkpoint: a log_history record is not a JSON object: [1]"));
  CHECK(slurp(state_path) == good_state);  // (nothing written)

  // Files from two different saves are rejected.
  save_checkpoint(dir.path(), m, &opt, &st);
  spit(opt_path, good_opt);
  CHECK(contains(err(), "come from different saves"));
  const std::string model_a = slurp(dir.file("model.safetensors"));
  save_checkpoint(dir.path(), m);
  CHECK(!fs::exists(opt_path));  // a save without optimizer removes the stale one
  CHECK(!has_training_state(dir.path()));
  spit(dir.file("model.safetensors"), model_a);
  CHECK(contains(error_message([&] { load_model(dir.path()); }), "come from different saves"));

  // The optimizer and the trainer state are written by every save together, with its id: one
  // without the id is not the other's (it was accepted).
  save_checkpoint(dir.path(), m, &opt, &st);
  std::string no_id = slurp(state_path);
  const std::size_t key = no_id.find("\"chunkloss_save_id\"");
  REQUIRE(key != std::string::npos);
  no_id.replace(key, 19, "\"another_save_field\"");
  spit(state_path, no_id);
  CHECK(contains(err(), "(save id none) come from different saves"));

  // A save between load_model and load_training_state: each call's files agree, but the state
  // is not the loaded weights' unless load_training_state is given load_model's save id.
  save_checkpoint(dir.path(), m, &opt, &st);
  std::string id;
  (void)load_model(dir.path(), &id);
  CHECK(id.size() == 16);
  AdamW same(m.params().size());
  CHECK(error_message([&] { load_training_state(dir.path(), m, same, id); }).empty());
  CHECK(same.step_count() == 1);
  save_checkpoint(dir.path(), m, &opt, &st);
  AdamW later(m.params().size());
  const std::string e = error_message([&] { load_training_state(dir.path(), m, later, id); });
  CHECK(contains(e, "(save id " + id + "): " + dir.path() + " was saved again in between"));
  CHECK(later.step_count() == 0);  // (unchanged)
  CHECK(error_message([&] { load_training_state(dir.path(), m, later); }).empty());
}

TEST_CASE("checkpoint: an interrupted save leaves the previous checkpoint loadable") {
  const LlamaConfig c = tiny_config(true, false);
  // Each staged file in turn cannot be written: a directory sits at its temporary path.
  for (const char* blocked : {"model.safetensors.tmp", "optimizer.safetensors.tmp",
                              "trainer_state.json.tmp", "config.json.tmp"}) {
    CAPTURE(blocked);
    const TempDir dir;
    Trained t(c);
    t.save(dir.path());
    const LlamaModel saved = t.m;
    const std::vector<float> saved_m(t.opt.exp_avg().begin(), t.opt.exp_avg().end());

    t.step();
    fs::create_directories(fs::path(dir.file(blocked)) / "occupied");
    const std::string msg = error_message([&] { t.save(dir.path()); });
    CHECK(contains(msg, "cannot create " + dir.file(blocked)));

    const LlamaModel back = load_model(dir.path());
    CHECK(same_params(back, saved));
    AdamW opt_back(back.params().size());
    const TrainerState st_back = load_training_state(dir.path(), back, opt_back);
    CHECK(st_back.global_step == 1);
    CHECK(std::memcmp(opt_back.exp_avg().data(), saved_m.data(), saved_m.size() * 4) == 0);
    for (const char* f : {"model.safetensors.tmp", "optimizer.safetensors.tmp",
                          "trainer_state.json.tmp", "config.json.tmp"}) {
      if (std::string(f) != blocked) CHECK(!fs::exists(dir.file(f)));
    }
    fs::remove_all(dir.file(blocked));
    t.save(dir.path());  // and a retry succeeds
    CHECK(same_params(load_model(dir.path()), t.m));
  }
}

TEST_CASE("checkpoint errors: a first save that stopped before its commit record is named so") {
  // The directory holds only the temporaries (a run killed during its first save there).
  const LlamaConfig c = tiny_config(false, false);
  const TempDir saved, killed;
  Trained t(c);
  t.save(saved.path());
  for (const char* f : {"model.safetensors", "config.json"})
    fs::copy_file(saved.file(f), killed.file(std::string(f) + ".tmp"));
  for (const auto& load : std::vector<std::function<void()>>{
           [&] { (void)load_model(killed.path()); }, [&] { (void)load_config(killed.path()); }})
    CHECK(contains(error_message(load), killed.path() + ": no config.json, only " +
                                            killed.file("config.json.tmp") +
                                            ": a save into it stopped before it was complete"));
  fs::copy_file(saved.file("config.json"), killed.file("config.json"));  // the weights' alone
  CHECK(contains(error_message([&] { (void)load_model(killed.path()); }),
                 ": no model.safetensors, only " + killed.file("model.safetensors.tmp")));
}

TEST_CASE("checkpoint: a save does not write through a symbolic link at a temporary's path") {
  const LlamaConfig c = tiny_config(true, false);
  const TempDir dir, elsewhere;
  Trained t(c);
  t.save(dir.path());
  const std::string target = elsewhere.file("precious.txt");
  spit(target, "keep me");
  fs::create_symlink(target, dir.file("config.json.tmp"));
  t.step();
  CHECK(contains(error_message([&] { t.save(dir.path()); }),
                 "cannot create " + dir.file("config.json.tmp")));
  CHECK(slurp(target) == "keep me");
}

TEST_CASE("checkpoint: a save interrupted after its commit record is read whole and completed") {
  const LlamaConfig c = tiny_config(false, false);
  const char* files[] = {"model.safetensors", "optimizer.safetensors", "trainer_state.json",
                         "config.json"};
  const TempDir dir, next;
  Trained t(c);
  t.save(dir.path());
  const LlamaModel first = t.m;
  // The next save, staged in `dir` by hand: its temporaries, its commit record and one of its
  // renames, as a crash after the record would leave them.
  t.step();
  t.save(next.path());
  const LlamaModel& m = t.m;
  const AdamW& opt = t.opt;
  CHECK(!fs::exists(next.file(".chunkloss-commit")));
  for (const char* f : files) fs::copy_file(next.file(f), dir.file(std::string(f) + ".tmp"));

  // Temporaries without a record: the crash came while staging; the first save is read.
  CHECK(same_params(load_model(dir.path()), first));

  dir.write(".chunkloss-commit",
            R"({"renamed": ["model.safetensors", "config.json", "optimizer.safetensors",)"
            R"( "trainer_state.json"], "removed": []})");
  fs::rename(dir.file("model.safetensors.tmp"), dir.file("model.safetensors"));
  const auto second_loads = [&](const std::string& where) {
    const LlamaModel back = load_model(where);
    CHECK(same_params(back, m));
    AdamW opt_back(back.params().size());
    CHECK(load_training_state(where, back, opt_back).global_step == 2);
    CHECK(std::memcmp(opt_back.exp_avg().data(), opt.exp_avg().data(), opt.size() * 4) == 0);
  };
  second_loads(dir.path());

  // The next save completes the interrupted one before staging its own.
  save_checkpoint(dir.path(), m);
  for (const char* f : files) CHECK(!fs::exists(dir.file(std::string(f) + ".tmp")));
  CHECK(!fs::exists(dir.file(".chunkloss-commit")));
  CHECK(!has_training_state(dir.path()));
  CHECK(same_params(load_model(dir.path()), m));
  // A temporary a crash left of a file the next save does not write goes too.
  dir.write("optimizer.safetensors.tmp", "partial");
  save_checkpoint(dir.path(), m);
  CHECK(!fs::exists(dir.file("optimizer.safetensors.tmp")));

  // A record that removes the optimizer state hides it even while its old files remain.
  t.save(dir.path());
  dir.write(".chunkloss-commit", R"({"renamed": [], "removed": ["optimizer.safetensors"]})");
  CHECK(!has_training_state(dir.path()));
  AdamW unused(m.params().size());
  CHECK(contains(error_message([&] { load_training_state(dir.path(), m, unused); }),
                 "has no optimizer or trainer state"));

  // A record naming anything but the checkpoint's files is refused.
  dir.write(".chunkloss-commit", R"({"renamed": ["../model.safetensors"], "removed": []})");
  CHECK(contains(error_message([&] { load_model(dir.path()); }),
                 dir.file(".chunkloss-commit") +
                     ": field \"renamed\" must be an array of checkpoint file names"));
  fs::remove(dir.file(".chunkloss-commit"));
  second_loads(dir.path());
}

}  // namespace
}  // namespace chunkloss::test
