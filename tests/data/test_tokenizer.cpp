// ByteTokenizer: lossless round trips over every byte, special-id handling and validation.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/data/tokenizer.h>

#include <string>
#include <vector>

#include "expect_error.h"

namespace chunkloss::test {
namespace {

using data::ByteTokenizer;
using data::TokenizerConfig;

TEST_CASE("tokenizer: every byte round-trips and maps to its value") {
  const ByteTokenizer tok;
  std::string all;
  for (int c = 0; c < 256; ++c) all.push_back(static_cast<char>(c));
  const std::vector<std::int32_t> ids = tok.encode(all);
  REQUIRE(ids.size() == 256);
  for (int c = 0; c < 256; ++c) CHECK(ids[static_cast<std::size_t>(c)] == c);
  CHECK(tok.decode(ids) == all);
  const std::string utf8 = "12+34=46 \xc3\xa9\xe2\x82\xac";  // e-acute, euro sign
  CHECK(tok.decode(tok.encode(utf8)) == utf8);
  CHECK(tok.encode("").empty());
}

TEST_CASE("tokenizer: default special ids, vocab 259, and decoding of specials") {
  const ByteTokenizer tok;
  CHECK(tok.bos_id() == 256);
  CHECK(tok.eos_id() == 257);
  CHECK(tok.pad_id() == 258);
  CHECK(tok.vocab_size() == 259);
  const std::vector<std::int32_t> ids = {256, 'h', 'i', 257, 258, 258};
  CHECK(tok.decode(ids) == "hi");
  CHECK(tok.decode(ids, false) == "<bos>hi<eos><pad><pad>");
}

TEST_CASE("tokenizer: ids outside the vocabulary or unused ids are errors") {
  const ByteTokenizer tok(TokenizerConfig{256, 257, 258, 300});
  const std::vector<std::int32_t> unused = {'a', 299};
  CHECK(contains(error_message([&] { tok.decode(unused); }), "id 299 at position 1"));
  const std::vector<std::int32_t> negative = {-1};
  CHECK_THROWS_AS(tok.decode(negative), Error);
  const std::vector<std::int32_t> too_big = {300};
  CHECK_THROWS_AS(tok.decode(too_big), Error);
}

std::string construct_error(std::int32_t bos, std::int32_t eos, std::int32_t pad, std::int32_t v) {
  return error_message([&] { ByteTokenizer tok(TokenizerConfig{bos, eos, pad, v}); });
}

TEST_CASE("tokenizer: special ids are validated") {
  CHECK(contains(construct_error(10, 257, 258, 259), "bos_id=10"));
  CHECK(contains(construct_error(256, 257, 259, 259), "pad_id=259"));
  CHECK(contains(construct_error(256, 256, 258, 259), "must differ"));
  CHECK(construct_error(256, 257, 258, 259).empty());
  const ByteTokenizer custom(TokenizerConfig{300, 301, 302, 320});
  CHECK(custom.decode(std::vector<std::int32_t>{300, 'x', 301}) == "x");
}

}  // namespace
}  // namespace chunkloss::test
