// Decoding: greedy equals repeated argmax of logits_at, EOS stops, sampling is seeded and
// top_k = 1 is greedy, the context limit stops generation, and bad options are errors.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/model/generate.h>

#include <algorithm>
#include <vector>

#include "data/expect_error.h"
#include "reference_decoder.h"

namespace chunkloss::test {
namespace {

using namespace chunkloss::model;

TEST_CASE("generate: greedy is the argmax of lm_head @ hidden at the last position") {
  const LlamaConfig c = tiny_config(true, false);
  LlamaModel m(c, 4);
  const std::vector<std::int32_t> prompt = {8, 1, 2};
  GenerateOptions o;
  o.max_new_tokens = 5;
  const GenerateResult r = generate(m, prompt, o);
  REQUIRE(r.tokens.size() == 5);
  CHECK(!r.stopped_at_eos);
  std::vector<std::int32_t> seq = prompt;
  for (std::int32_t tok : r.tokens) {
    const auto t = static_cast<std::int64_t>(seq.size());
    const float* h = m.forward(TensorView::of(seq.data(), {1, t})).data_as<const float>() +
                     (t - 1) * c.hidden_size;
    const float* w = m.lm_head_weight().data_as<const float>();
    std::vector<double> logits(static_cast<std::size_t>(c.vocab_size));
    for (std::int64_t v = 0; v < c.vocab_size; ++v) {
      for (std::int64_t j = 0; j < c.hidden_size; ++j)
        logits[v] += double(w[v * c.hidden_size + j]) * h[j];
    }
    CHECK(tok == std::max_element(logits.begin(), logits.end()) - logits.begin());
    seq.push_back(tok);
  }
  // Stopping at EOS: make the first greedy token the EOS id.
  o.eos_id = r.tokens[0];
  const GenerateResult stopped = generate(m, prompt, o);
  CHECK(stopped.stopped_at_eos);
  CHECK(stopped.tokens.empty());
}

TEST_CASE("generate: sampling is seeded, varies with the seed, top_k 1 is greedy") {
  LlamaConfig c = tiny_config(false, true);
  c.initializer_range = 0.05;  // flat logits, so samples vary
  LlamaModel m(c, 6);
  const std::vector<std::int32_t> prompt = {8, 3};
  GenerateOptions o;
  o.max_new_tokens = 12;
  o.temperature = 1.0;
  o.seed = 1;
  const auto a = generate(m, prompt, o).tokens;
  CHECK(a == generate(m, prompt, o).tokens);
  bool differs = false;
  for (std::uint64_t seed = 2; seed < 6 && !differs; ++seed) {
    o.seed = seed;
    differs = generate(m, prompt, o).tokens != a;
  }
  CHECK(differs);
  o.top_k = 1;
  GenerateOptions greedy;
  greedy.max_new_tokens = 12;
  CHECK(generate(m, prompt, o).tokens == generate(m, prompt, greedy).tokens);
}

TEST_CASE("generate: stops at the context limit, option errors") {
  const LlamaConfig c = tiny_config(false, false);  // max_position_embeddings 16
  LlamaModel m(c, 1);
  GenerateOptions o;
  o.max_new_tokens = 100;
  const std::vector<std::int32_t> prompt(10, 1);
  CHECK(generate(m, prompt, o).tokens.size() == 7);
  CHECK(contains(error_message([&] { generate(m, std::vector<std::int32_t>{}, o); }),
                 "empty prompt"));
  o.temperature = -1;
  CHECK(contains(error_message([&] { generate(m, prompt, o); }), "temperature=-1"));
  CHECK(contains(error_message([&] { logits_at(m, 99); }), "row 99"));
}

}  // namespace
}  // namespace chunkloss::test
