// The bundled apps/data files: every file parses with the library's readers, every answer is
// checked by recomputing the sum, and no held-out prompt occurs in a training file.
#include <doctest/doctest.h>

#include <chunkloss/data/batch.h>
#include <chunkloss/data/jsonl.h>

#include <set>
#include <string>

namespace chunkloss::test {
namespace {

using namespace chunkloss::data;

const std::string kDir = CHUNKLOSS_BUNDLED_DATA_DIR;

// "A+B=" -> A + B, or -1 when the prompt has another shape.
int answer_of(const std::string& prompt) {
  const auto plus = prompt.find('+');
  if (plus == std::string::npos || prompt.empty() || prompt.back() != '=') return -1;
  return std::stoi(prompt.substr(0, plus)) + std::stoi(prompt.substr(plus + 1));
}

TEST_CASE("bundled data: SFT answers are right, eval prompts are held out") {
  const auto train = read_sft_jsonl(kDir + "/sft_train.jsonl");
  const auto eval = read_sft_jsonl(kDir + "/sft_eval.jsonl");
  CHECK(train.size() >= 500);
  CHECK(train.size() <= 5000);
  CHECK(eval.size() >= 100);
  std::set<std::string> train_prompts;
  for (const auto& e : train) {
    CHECK(e.completion == std::to_string(answer_of(e.prompt)));
    train_prompts.insert(e.prompt);
  }
  for (const auto& e : eval) {
    CHECK(e.completion == std::to_string(answer_of(e.prompt)));
    CHECK(train_prompts.count(e.prompt) == 0);
  }
  // Fits a small context: BOS + "99+99=" + "198" + EOS.
  const ByteTokenizer tok;
  for (const Sequence& s : encode_sft(tok, train)) CHECK(s.tokens.size() <= 10);
}

TEST_CASE("bundled data: preference pairs have the right answer chosen and a wrong one rejected") {
  std::set<std::string> train_prompts;
  for (const char* name : {"/pref_train.jsonl", "/pref_eval.jsonl"}) {
    const bool is_eval = std::string(name).find("eval") != std::string::npos;
    const auto ex = read_preference_jsonl(kDir + name);
    CHECK(ex.size() >= 100);
    for (const auto& e : ex) {
      const int right = answer_of(e.prompt);
      CHECK(e.chosen == std::to_string(right));
      CHECK(e.rejected != e.chosen);
      CHECK(std::stoi(e.rejected) >= 0);
      if (is_eval) {
        CHECK(train_prompts.count(e.prompt) == 0);
      } else {
        train_prompts.insert(e.prompt);
      }
    }
  }
}

TEST_CASE("bundled data: unpaired labels say whether the completion is right") {
  for (const char* name : {"/kto_train.jsonl", "/kto_eval.jsonl"}) {
    const auto ex = read_unpaired_jsonl(kDir + name);
    CHECK(ex.size() >= 100);
    std::size_t desirable = 0;
    for (const auto& e : ex) {
      CHECK(e.label == (e.completion == std::to_string(answer_of(e.prompt))));
      desirable += e.label ? 1 : 0;
    }
    CHECK(desirable * 2 == ex.size());
  }
}

}  // namespace
}  // namespace chunkloss::test
