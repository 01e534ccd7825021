// JSONL readers: the three TRL shapes parse, blank lines and CRLF are handled, and every
// malformed line (bad JSON, missing field, wrong type, empty completion, label not bool, not an
// object, ambiguous SFT line, empty file, unreadable file, a device) is an Error naming file and
// line.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/data/jsonl.h>

#include <filesystem>
#include <string>

#include "expect_error.h"
#include "temp_dir.h"

namespace chunkloss::test {
namespace {

using namespace chunkloss::data;

TEST_CASE("jsonl: SFT prompt/completion and text lines") {
  const auto ex = parse_sft_jsonl(
      "{\"prompt\": \"1+2=\", \"completion\": \"3\"}\n"
      "\n"
      "   \n"
      "{\"text\": \"hello\", \"extra\": [1, 2]}\r\n"
      "{\"prompt\": \"\", \"completion\": \"x\\ny\\u00e9\"}",
      "mem");
  REQUIRE(ex.size() == 3);
  CHECK(ex[0].prompt == "1+2=");
  CHECK(ex[0].completion == "3");
  CHECK(ex[1].prompt.empty());
  CHECK(ex[1].completion == "hello");
  CHECK(ex[2].prompt.empty());
  CHECK(ex[2].completion == "x\ny\xc3\xa9");
  // Each example knows its line (blank lines count), as messages name it.
  CHECK(ex[0].line == 1);
  CHECK(ex[1].line == 4);
  CHECK(ex[2].line == 5);
}

TEST_CASE("jsonl: preference and unpaired lines") {
  const auto pref = parse_preference_jsonl(
      "{\"prompt\": \"p\", \"chosen\": \"good\", \"rejected\": \"bad\"}\n"
      "{\"rejected\": \"r\", \"chosen\": \"c\", \"prompt\": \"\"}\n",
      "mem");
  REQUIRE(pref.size() == 2);
  CHECK(pref[0].prompt == "p");
  CHECK(pref[0].chosen == "good");
  CHECK(pref[0].rejected == "bad");
  CHECK(pref[1].chosen == "c");
  const auto kto = parse_unpaired_jsonl(
      "{\"prompt\": \"p\", \"completion\": \"a\", \"label\": true}\n"
      "{\"prompt\": \"q\", \"completion\": \"b\", \"label\": false}\n",
      "mem");
  REQUIRE(kto.size() == 2);
  CHECK(kto[0].label);
  CHECK(!kto[1].label);
  CHECK(kto[1].completion == "b");
  CHECK(pref[1].line == 2);
  CHECK(kto[1].line == 2);
}

// The message of parsing `text` as `kind`, which must name "<source>:<line>:".
std::string sft_error(const std::string& text) {
  return error_message([&] { parse_sft_jsonl(text, "sft.jsonl"); });
}
std::string pref_error(const std::string& text) {
  return error_message([&] { parse_preference_jsonl(text, "pref.jsonl"); });
}
std::string kto_error(const std::string& text) {
  return error_message([&] { parse_unpaired_jsonl(text, "kto.jsonl"); });
}

const std::string kGoodSft = "{\"prompt\": \"a\", \"completion\": \"b\"}\n";

TEST_CASE("jsonl: malformed SFT lines name the file, the line and the problem") {
  std::string m = sft_error(kGoodSft + kGoodSft + "{\"prompt\": \"a\", \"completion\": }\n");
  CHECK(contains(m, "sft.jsonl:3: bad JSON"));
  // Blank lines still count.
  m = sft_error(kGoodSft + "\n\n{\"prompt\": \"a\"\n");
  CHECK(contains(m, "sft.jsonl:4: bad JSON"));
  m = sft_error(kGoodSft + "{\"prompt\": \"a\"}\n");
  CHECK(contains(m, "sft.jsonl:2: missing field \"completion\""));
  m = sft_error("{\"completion\": \"b\"}\n");
  CHECK(contains(m, "sft.jsonl:1: missing field \"prompt\""));
  m = sft_error("{\"prompt\": \"a\", \"completion\": 5}\n");
  CHECK(contains(m, "sft.jsonl:1: field \"completion\" must be a string, got number"));
  m = sft_error("{\"prompt\": [\"a\"], \"completion\": \"b\"}\n");
  CHECK(contains(m, "sft.jsonl:1: field \"prompt\" must be a string, got array"));
  m = sft_error("{\"prompt\": null, \"completion\": \"b\"}\n");
  CHECK(contains(m, "field \"prompt\" must be a string, got null"));
  m = sft_error(kGoodSft + "{\"prompt\": \"a\", \"completion\": \"\"}\n");
  CHECK(contains(m, "sft.jsonl:2: field \"completion\" is empty"));
  m = sft_error("{\"text\": \"\"}\n");
  CHECK(contains(m, "sft.jsonl:1: field \"text\" is empty"));
  m = sft_error("{\"text\": 1}\n");
  CHECK(contains(m, "field \"text\" must be a string"));
  m = sft_error("{\"text\": \"t\", \"completion\": \"c\"}\n");
  CHECK(contains(m, "sft.jsonl:1: ambiguous SFT line"));
  m = sft_error("[\"prompt\", \"completion\"]\n");
  CHECK(contains(m, "sft.jsonl:1: expected a JSON object, got array"));
  m = sft_error("{\"prompt\": \"a\", \"completion\": \"b\"} trailing\n");
  CHECK(contains(m, "sft.jsonl:1: bad JSON"));
  m = sft_error("{\"prompt\": \"\xff\", \"completion\": \"b\"}\n");
  CHECK(contains(m, "sft.jsonl:1: bad JSON"));
  // What nlohmann's parser accepted silently: a repeated key (it kept the last) and a NUL byte
  // (it ended the line there, so the garbage after it trained).
  m = sft_error(kGoodSft + "{\"prompt\": \"a\", \"completion\": \"b\", \"prompt\": \"c\"}\n");
  CHECK(contains(m, "sft.jsonl:2: bad JSON: key \"prompt\" appears twice in one object"));
  m = sft_error(std::string("{\"prompt\": \"a\", \"completion\": \"b\"}\0garbage\n", 43));
  CHECK(contains(m, "sft.jsonl:1: bad JSON: a NUL byte at offset 34"));
  // nlohmann's message quotes what it last read, here 50000 characters: the error is cut.
  m = sft_error("{\"prompt\": \"" + std::string(50000, 'a') + "\n");
  CHECK(contains(m, "sft.jsonl:1: bad JSON: [json.exception.parse_error.101]"));
  CHECK(contains(m, " bytes in all)"));
  CHECK(m.size() < 400);
  m = sft_error("");
  CHECK(contains(m, "sft.jsonl: no examples"));
  m = sft_error("\n  \n\r\n");
  CHECK(contains(m, "sft.jsonl: no examples"));
}

TEST_CASE("jsonl: malformed preference lines") {
  const std::string good = "{\"prompt\": \"p\", \"chosen\": \"c\", \"rejected\": \"r\"}\n";
  std::string m = pref_error(good + "{\"prompt\": \"p\", \"chosen\": \"c\"}\n");
  CHECK(contains(m, "pref.jsonl:2: missing field \"rejected\""));
  m = pref_error("{\"prompt\": \"p\", \"chosen\": \"\", \"rejected\": \"r\"}\n");
  CHECK(contains(m, "pref.jsonl:1: field \"chosen\" is empty"));
  m = pref_error("{\"prompt\": \"p\", \"chosen\": \"c\", \"rejected\": false}\n");
  CHECK(contains(m, "pref.jsonl:1: field \"rejected\" must be a string, got boolean"));
  m = pref_error(good + good + "{\"prompt\": \"p\", \"chosen\": \"c\", \"rejected\": \"r\"\n");
  CHECK(contains(m, "pref.jsonl:3: bad JSON"));
  m = pref_error("{\"chosen\": \"c\", \"rejected\": \"r\"}\n");
  CHECK(contains(m, "pref.jsonl:1: missing field \"prompt\""));
}

TEST_CASE("jsonl: malformed unpaired lines, including labels that are not booleans") {
  std::string m = kto_error("{\"prompt\": \"p\", \"completion\": \"c\"}\n");
  CHECK(contains(m, "kto.jsonl:1: missing field \"label\""));
  m = kto_error("{\"prompt\": \"p\", \"completion\": \"c\", \"label\": \"true\"}\n");
  CHECK(contains(m, "kto.jsonl:1: field \"label\" must be a boolean"));
  CHECK(contains(m, "got string"));
  m = kto_error(
      "{\"prompt\": \"p\", \"completion\": \"c\", \"label\": true}\n"
      "{\"prompt\": \"p\", \"completion\": \"c\", \"label\": 1}\n");
  CHECK(contains(m, "kto.jsonl:2: field \"label\" must be a boolean (true or false), got number"));
  m = kto_error("{\"prompt\": \"p\", \"completion\": \"c\", \"label\": null}\n");
  CHECK(contains(m, "field \"label\" must be a boolean"));
  m = kto_error("{\"prompt\": \"p\", \"completion\": \"\", \"label\": true}\n");
  CHECK(contains(m, "kto.jsonl:1: field \"completion\" is empty"));
}

TEST_CASE("jsonl: files are read from disk and errors name the path") {
  const TempDir dir;
  const std::string good = dir.write("good.jsonl", kGoodSft + kGoodSft);
  CHECK(read_sft_jsonl(good).size() == 2);
  const std::string bad =
      dir.write("bad.jsonl", kGoodSft + "{\"prompt\": 3, \"completion\": \"b\"}\n");
  const std::string m = error_message([&] { read_sft_jsonl(bad); });
  CHECK(contains(m, bad + ":2: field \"prompt\" must be a string"));
  const std::string missing = dir.file("missing.jsonl");
  CHECK(contains(error_message([&] { read_preference_jsonl(missing); }), missing));
  CHECK(contains(error_message([&] { read_sft_jsonl(dir.path()); }),
                 dir.path() + " is a directory, not a file"));
  // Paths the file system refuses are a chunkloss::Error naming them, not a filesystem_error.
  const std::string loop = dir.file("loop");
  std::filesystem::create_symlink(loop, loop);
  CHECK(contains(error_message([&] { read_sft_jsonl(loop); }), "cannot open " + loop));
  const std::string long_name = dir.file(std::string(300, 'a') + ".jsonl");
  CHECK(contains(error_message([&] { read_sft_jsonl(long_name); }), "cannot open " + long_name));
  // A device never ends: refused before reading (it was read until memory ran out).
  if (std::filesystem::exists("/dev/zero"))
    CHECK(contains(error_message([] { read_sft_jsonl("/dev/zero"); }),
                   "/dev/zero is a device, not a data file"));
  const std::string kto =
      dir.write("kto.jsonl", "{\"prompt\": \"p\", \"completion\": \"c\", \"label\": false}");
  const auto ex = read_unpaired_jsonl(kto);
  REQUIRE(ex.size() == 1);
  CHECK(!ex[0].label);
}

}  // namespace
}  // namespace chunkloss::test
