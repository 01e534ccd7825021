// JSONL readers: split into lines, parse each with nlohmann::json, pull typed fields out with
// errors that name the source, the line and the field.
#include "chunkloss/data/jsonl.h"

#include <filesystem>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <system_error>
#include <vector>

#include "chunkloss/core/error.h"
#include "chunkloss/core/strict_json.h"

namespace chunkloss::data {
namespace {

using nlohmann::json;

struct Line {
  std::string_view source;
  std::size_t number;
};

const json& field(const json& obj, const Line& at, const char* name) {
  const auto it = obj.find(name);
  CHUNKLOSS_CHECK(it != obj.end(), at.source, ":", at.number, ": missing field \"", name, "\"");
  return *it;
}

std::string string_field(const json& obj, const Line& at, const char* name, bool allow_empty) {
  const json& v = field(obj, at, name);
  CHUNKLOSS_CHECK(v.is_string(), at.source, ":", at.number, ": field \"", name,
                  "\" must be a string, got ", v.type_name());
  std::string s = v.get<std::string>();
  CHUNKLOSS_CHECK(allow_empty || !s.empty(), at.source, ":", at.number, ": field \"", name,
                  "\" is empty");
  return s;
}

bool bool_field(const json& obj, const Line& at, const char* name) {
  const json& v = field(obj, at, name);
  CHUNKLOSS_CHECK(v.is_boolean(), at.source, ":", at.number, ": field \"", name,
                  "\" must be a boolean (true or false), got ", v.type_name(), " ",
                  v.is_primitive() ? v.dump() : std::string("..."));
  return v.get<bool>();
}

bool blank(std::string_view s) {
  for (char c : s) {
    if (c != ' ' && c != '\t' && c != '\r' && c != '\f' && c != '\v') return false;
  }
  return true;
}

// Calls `per_line(object, line)` for every non-blank line; returns how many there were.
template <typename F>
std::size_t for_each_object(std::string_view text, std::string_view source, F&& per_line) {
  std::size_t count = 0, number = 0, start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    start = end + 1;
    ++number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (blank(line)) continue;
    const Line at{source, number};
    const json obj = detail::parse_strict_json(
        line, std::string(source) + ":" + std::to_string(number) + ": bad JSON");
    CHUNKLOSS_CHECK(obj.is_object(), source, ":", number, ": expected a JSON object, got ",
                    obj.type_name());
    per_line(obj, at);
    ++count;
  }
  CHUNKLOSS_CHECK(count > 0, source, ": no examples (the file is empty or blank)");
  return count;
}

}  // namespace

std::string read_text_file(const std::string& path) {
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  CHUNKLOSS_CHECK(!ec || ec == std::errc::no_such_file_or_directory, "cannot open ", path,
                  " for reading: ", ec.message());
  CHUNKLOSS_CHECK(!std::filesystem::is_directory(st), path, " is a directory, not a file");
  // A pipe is read to its end; a device such as /dev/zero never ends.
  CHUNKLOSS_CHECK(!std::filesystem::is_character_file(st) && !std::filesystem::is_block_file(st),
                  path, " is a device, not a data file (pipes are read)");
  std::ifstream in(path, std::ios::binary);
  CHUNKLOSS_CHECK(in.good(), "cannot open ", path, " for reading");
  // (not `os << in.rdbuf()`: it catches an allocation failure and stops, a file cut short)
  std::string text;
  std::vector<char> buf(std::size_t{1} << 16);
  try {
    do {
      in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
      text.append(buf.data(), static_cast<std::size_t>(in.gcount()));
    } while (in);
  } catch (const std::bad_alloc&) {
    CHUNKLOSS_FAIL(path, ": out of memory after reading ", text.size(),
                   " bytes (the file is read into memory whole)");
  }
  CHUNKLOSS_CHECK(!in.bad(), "error while reading ", path);
  return text;
}

std::vector<SftExample> parse_sft_jsonl(std::string_view text, std::string_view source) {
  std::vector<SftExample> out;
  for_each_object(text, source, [&](const json& obj, const Line& at) {
    const bool has_text = obj.contains("text");
    const bool has_pc = obj.contains("prompt") || obj.contains("completion");
    CHUNKLOSS_CHECK(!(has_text && has_pc), at.source, ":", at.number,
                    ": ambiguous SFT line: both \"text\" and \"prompt\"/\"completion\" present");
    SftExample ex;
    ex.line = at.number;
    if (has_text) {
      ex.completion = string_field(obj, at, "text", false);
    } else {
      CHUNKLOSS_CHECK(has_pc, at.source, ":", at.number,
                      ": missing field \"completion\" (an SFT line needs \"prompt\" and "
                      "\"completion\", or \"text\")");
      ex.prompt = string_field(obj, at, "prompt", true);
      ex.completion = string_field(obj, at, "completion", false);
    }
    out.push_back(std::move(ex));
  });
  return out;
}

std::vector<PreferenceExample> parse_preference_jsonl(std::string_view text,
                                                      std::string_view source) {
  std::vector<PreferenceExample> out;
  for_each_object(text, source, [&](const json& obj, const Line& at) {
    PreferenceExample ex;
    ex.line = at.number;
    ex.prompt = string_field(obj, at, "prompt", true);
    ex.chosen = string_field(obj, at, "chosen", false);
    ex.rejected = string_field(obj, at, "rejected", false);
    out.push_back(std::move(ex));
  });
  return out;
}

std::vector<UnpairedExample> parse_unpaired_jsonl(std::string_view text, std::string_view source) {
  std::vector<UnpairedExample> out;
  for_each_object(text, source, [&](const json& obj, const Line& at) {
    UnpairedExample ex;
    ex.line = at.number;
    ex.prompt = string_field(obj, at, "prompt", true);
    ex.completion = string_field(obj, at, "completion", false);
    ex.label = bool_field(obj, at, "label");
    out.push_back(std::move(ex));
  });
  return out;
}

std::vector<SftExample> read_sft_jsonl(const std::string& path) {
  return parse_sft_jsonl(read_text_file(path), path);
}
std::vector<PreferenceExample> read_preference_jsonl(const std::string& path) {
  return parse_preference_jsonl(read_text_file(path), path);
}
std::vector<UnpairedExample> read_unpaired_jsonl(const std::string& path) {
  return parse_unpaired_jsonl(read_text_file(path), path);
}

}  // namespace chunkloss::data
