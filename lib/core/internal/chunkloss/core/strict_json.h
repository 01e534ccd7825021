// Internal (lib/model and lib/data, which use nlohmann::json privately): JSON parsing that
// refuses what nlohmann's parser accepts silently, a key repeated in one object (it keeps the
// last) and a NUL byte (it ends the text there, whatever follows).
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "chunkloss/core/error.h"

namespace chunkloss::detail {

/// Parses JSON `text` as nlohmann::json::parse does. Throws chunkloss::Error "WHAT: MESSAGE"
/// (e.g. WHAT "data.jsonl:3: bad JSON") naming the first NUL byte's offset, the first key that
/// appears twice in one object, or the syntax error (nlohmann's message, which quotes the text
/// it last read: cut to its first 200 bytes, at a UTF-8 character's start, so that a long line
/// gives a short error).
inline nlohmann::json parse_strict_json(std::string_view text, std::string_view what) {
  using Json = nlohmann::json;
  if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos)
    CHUNKLOSS_FAIL(what, ": a NUL byte at offset ", nul, " (JSON text holds none)");
  std::vector<std::set<std::string>> keys;  // of each object open
  try {
    return Json::parse(text.begin(), text.end(), [&](int, Json::parse_event_t event, Json& value) {
      if (event == Json::parse_event_t::object_start) {
        keys.emplace_back();
      } else if (event == Json::parse_event_t::object_end) {
        keys.pop_back();
      } else if (event == Json::parse_event_t::key) {
        CHUNKLOSS_CHECK(keys.back().insert(value.get<std::string>()).second, what, ": key \"",
                        value.get<std::string>(),
                        "\" appears twice in one object (a reader would take the last)");
      }
      return true;
    });
  } catch (const Json::exception& e) {
    const std::string_view m = e.what();
    std::size_t shown = 200;
    if (m.size() <= shown) CHUNKLOSS_FAIL(what, ": ", m);
    while (shown > 0 && (static_cast<unsigned char>(m[shown]) & 0xC0) == 0x80) --shown;  // (UTF-8)
    CHUNKLOSS_FAIL(what, ": ", m.substr(0, shown), "... (", m.size(), " bytes in all)");
  }
}

}  // namespace chunkloss::detail
