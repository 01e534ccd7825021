// JSONL readers for the three dataset shapes of TRL-style trainers: SFT (prompt/completion or
// plain text), paired preference (prompt/chosen/rejected) and unpaired (prompt/completion/label).
// One JSON object per line; a malformed line is an error naming the file and the line number.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace chunkloss::data {

/// One SFT example. A {"text": ...} line becomes an empty prompt and the whole text as the
/// completion (every token is trained on).
struct SftExample {
  std::string prompt;
  std::string completion;
  std::size_t line = 0;  ///< its 1-based line in the source (what messages name it by)
};

/// One paired preference example (DPO, ORPO, SimPO, CPO).
struct PreferenceExample {
  std::string prompt;
  std::string chosen;
  std::string rejected;
  std::size_t line = 0;  ///< its 1-based line in the source (what messages name it by)
};

/// One unpaired example (KTO): `label` true marks a desirable completion.
struct UnpairedExample {
  std::string prompt;
  std::string completion;
  bool label = false;
  std::size_t line = 0;  ///< its 1-based line in the source (what messages name it by)
};

/// Rules shared by the readers:
/// - a line is one JSON object; lines that are empty or only whitespace are skipped, and a
///   trailing '\r' (CRLF files) is dropped;
/// - the fields named below must be present and be JSON strings ("label": a JSON boolean);
///   other fields are ignored;
/// - "prompt" may be the empty string; "completion", "text", "chosen" and "rejected" may not;
/// - a file with no examples is an error;
/// - a key repeated in one object, or a NUL byte in a line, is bad JSON (a lenient parser would
///   take the last value, or end the line at the NUL).
/// Every error is a chunkloss::Error whose message starts with "<source>:<line>: " and names
/// the field, e.g. `sft.jsonl:7: field "completion" must be a string, got number`.
///
/// SFT lines are either {"prompt", "completion"} or {"text"}; a line with "text" and also
/// "prompt" or "completion" is ambiguous and an error.
std::vector<SftExample> read_sft_jsonl(const std::string& path);
std::vector<PreferenceExample> read_preference_jsonl(const std::string& path);
std::vector<UnpairedExample> read_unpaired_jsonl(const std::string& path);

/// The same readers over text already in memory; `source` names it in error messages
/// (a file name, "<stdin>", "<fuzz>"). Throws chunkloss::Error, never anything else.
std::vector<SftExample> parse_sft_jsonl(std::string_view text, std::string_view source);
std::vector<PreferenceExample> parse_preference_jsonl(std::string_view text,
                                                      std::string_view source);
std::vector<UnpairedExample> parse_unpaired_jsonl(std::string_view text, std::string_view source);

/// The whole file (or pipe) as bytes. Throws chunkloss::Error naming the path when it cannot be
/// read, is a directory or a device (such as /dev/zero, which never ends), or does not fit in
/// memory.
std::string read_text_file(const std::string& path);

}  // namespace chunkloss::data
