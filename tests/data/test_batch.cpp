// Encoding and collation: BOS/EOS placement and the causal shift, ignore_index on prompt
// targets, both truncation rules, right padding, the [2P, T] preference layout and labels.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/data/batch.h>

#include <vector>

#include "expect_error.h"

namespace chunkloss::test {
namespace {

using namespace chunkloss::data;
using Ids = std::vector<std::int32_t>;

constexpr std::int32_t kBos = 256, kEos = 257, kPad = 258, kIgn = -100;

TEST_CASE("encode: BOS first, EOS as the last target, prompt targets ignored") {
  const ByteTokenizer tok;
  const Sequence s = encode(tok, "ab", "cd");
  CHECK(s.tokens == Ids{kBos, 'a', 'b', 'c', 'd'});
  CHECK(s.targets == Ids{kIgn, kIgn, 'c', 'd', kEos});
  // Every trained target is the next input token (the causal shift).
  for (std::size_t t = 0; t + 1 < s.tokens.size(); ++t) {
    if (s.targets[t] != kIgn) CHECK(s.targets[t] == s.tokens[t + 1]);
  }
  const Sequence empty_prompt = encode(tok, "", "x");
  CHECK(empty_prompt.tokens == Ids{kBos, 'x'});
  CHECK(empty_prompt.targets == Ids{'x', kEos});
  EncodeOptions o;
  o.ignore_index = -1;
  CHECK(encode(tok, "p", "c", o).targets == Ids{-1, 'c', kEos});
  CHECK(contains(error_message([&] { encode(tok, "p", ""); }), "completion is empty"));
}

TEST_CASE("encode: truncation keeps the prompt and cuts the completion end, EOS first") {
  const ByteTokenizer tok;
  EncodeOptions o;
  o.max_length = 5;  // fits exactly: |p| + |c| + 1 = 5
  Sequence s = encode(tok, "ab", "cd", o);
  CHECK(s.targets == Ids{kIgn, kIgn, 'c', 'd', kEos});
  o.max_length = 4;  // EOS dropped
  s = encode(tok, "ab", "cd", o);
  CHECK(s.tokens == Ids{kBos, 'a', 'b', 'c'});
  CHECK(s.targets == Ids{kIgn, kIgn, 'c', 'd'});
  o.max_length = 3;  // one completion target left
  s = encode(tok, "ab", "cd", o);
  CHECK(s.tokens == Ids{kBos, 'a', 'b'});
  CHECK(s.targets == Ids{kIgn, kIgn, 'c'});
}

TEST_CASE("encode: a prompt too long for max_length keeps its end and one target") {
  const ByteTokenizer tok;
  EncodeOptions o;
  o.max_length = 3;
  Sequence s = encode(tok, "abcdef", "xy", o);
  CHECK(s.tokens == Ids{kBos, 'e', 'f'});
  CHECK(s.targets == Ids{kIgn, kIgn, 'x'});
  o.max_length = 1;
  s = encode(tok, "abc", "xy", o);
  CHECK(s.tokens == Ids{kBos});
  CHECK(s.targets == Ids{'x'});
  o = EncodeOptions{};
  o.max_prompt_length = 2;
  s = encode(tok, "abcd", "x", o);
  CHECK(s.tokens == Ids{kBos, 'c', 'd', 'x'});
  CHECK(s.targets == Ids{kIgn, kIgn, 'x', kEos});
  o.max_length = -1;
  CHECK(contains(error_message([&] { encode(tok, "a", "b", o); }), "max_length=-1"));
}

TEST_CASE("collate_sft: right padding with PAD and ignore_index, lengths and target count") {
  const ByteTokenizer tok;
  const std::vector<Sequence> seqs = {encode(tok, "ab", "c"), encode(tok, "", "xyz"),
                                      encode(tok, "q", "r")};
  const std::vector<std::size_t> idx = {1, 2};
  const Batch b = collate_sft(seqs, idx);
  CHECK(b.rows == 2);
  CHECK(b.length == 4);
  CHECK(b.tokens == Ids{kBos, 'x', 'y', 'z', kBos, 'q', 'r', kPad});
  CHECK(b.targets == Ids{'x', 'y', 'z', kEos, kIgn, 'r', kEos, kIgn});
  CHECK(b.lengths == Ids{4, 3});
  CHECK(b.pairs == 0);
  CHECK(b.labels.empty());
  CHECK(b.count_targets() == 6);
  const TensorView tv = b.tokens_view();
  CHECK(tv.ndim() == 2);
  CHECK(tv.size(0) == 2);
  CHECK(tv.size(1) == 4);
  CHECK(tv.dtype() == DType::kI32);
  CHECK(b.targets_view().ndim() == 1);
  CHECK(b.targets_view().size(0) == 8);

  CollateOptions fixed;
  fixed.length = 6;
  const Batch f = collate_sft(seqs, idx, fixed);
  CHECK(f.length == 6);
  CHECK(f.tokens[4] == kPad);
  CHECK(f.tokens[5] == kPad);
  CHECK(f.targets[3] == kEos);
  CHECK(f.targets[4] == kIgn);
  CHECK(f.targets[5] == kIgn);
  CHECK(f.tokens[6] == kBos);
  fixed.length = 3;
  CHECK(contains(error_message([&] { collate_sft(seqs, idx, fixed); }), "length 4"));
  const std::vector<std::size_t> out_of_range = {0, 3};
  CHECK(contains(error_message([&] { collate_sft(seqs, out_of_range); }), "index 3"));
  CHECK(contains(error_message([&] { collate_sft(seqs, {}); }), "no rows"));
}

TEST_CASE("collate_preference: [2P, T] with chosen rows first, pair i is rows (i, i + P)") {
  const ByteTokenizer tok;
  std::vector<PreferenceExample> ex = {
      {"1+1=", "2", "3"}, {"10+5=", "15", "25"}, {"9+9=", "18", "108"}};
  const auto pairs = encode_preference(tok, ex);
  const std::vector<std::size_t> idx = {2, 0};
  const Batch b = collate_preference(pairs, idx);
  REQUIRE(b.pairs == 2);
  REQUIRE(b.rows == 4);
  CHECK(b.length == 8);  // "9+9=" + "108" + 1
  const auto row_text = [&](std::int64_t r) {
    std::vector<std::int32_t> ids(b.tokens.begin() + r * b.length,
                                  b.tokens.begin() + r * b.length + b.lengths[r]);
    return tok.decode(ids);
  };
  CHECK(row_text(0) == "9+9=18");
  CHECK(row_text(1) == "1+1=2");
  CHECK(row_text(2) == "9+9=108");
  CHECK(row_text(3) == "1+1=3");
  // The prompt part of a pair's two rows is identical and ignored in both.
  for (std::int64_t i = 0; i < b.pairs; ++i) {
    for (std::int64_t t = 0; t < 4; ++t) {
      CHECK(b.tokens[i * b.length + t] == b.tokens[(i + b.pairs) * b.length + t]);
    }
  }
  const std::int64_t w = b.length;
  CHECK(b.targets[0 * w + 3] == kIgn);
  CHECK(b.targets[0 * w + 4] == '1');  // '=' predicts the first answer byte
  CHECK(b.targets[0 * w + 6] == kEos);
  CHECK(b.targets[0 * w + 7] == kIgn);  // padding
  CHECK(b.targets[2 * w + 4] == '1');
  CHECK(b.targets[2 * w + 6] == '8');
  CHECK(b.targets[2 * w + 7] == kEos);
  CHECK(b.tokens[1 * w + 6] == kPad);
  CHECK(b.lengths == Ids{7, 6, 8, 6});
}

TEST_CASE("collate_unpaired: labels follow the rows") {
  const ByteTokenizer tok;
  const std::vector<UnpairedExample> ex = {{"a", "b", true}, {"c", "d", false}, {"e", "f", true}};
  const auto seqs = encode_unpaired(tok, ex);
  const std::vector<std::size_t> idx = {1, 0, 2};
  const Batch b = collate_unpaired(seqs, idx);
  CHECK(b.rows == 3);
  CHECK(b.labels == std::vector<std::uint8_t>{0, 1, 1});
  CHECK(b.tokens[1] == 'c');
}

}  // namespace
}  // namespace chunkloss::test
