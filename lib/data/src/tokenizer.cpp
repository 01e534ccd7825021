// ByteTokenizer: validation of the special ids, byte encoding and decoding.
#include "chunkloss/data/tokenizer.h"

#include "chunkloss/core/error.h"

namespace chunkloss::data {

ByteTokenizer::ByteTokenizer(const TokenizerConfig& config) : config_(config) {
  const auto check_special = [&](const char* name, std::int32_t id) {
    CHUNKLOSS_CHECK(id >= 256 && id < config.vocab_size, "ByteTokenizer: ", name, "=", id,
                    " must lie in [256, vocab_size=", config.vocab_size, ")");
  };
  check_special("bos_id", config.bos_id);
  check_special("eos_id", config.eos_id);
  check_special("pad_id", config.pad_id);
  CHUNKLOSS_CHECK(config.bos_id != config.eos_id && config.bos_id != config.pad_id &&
                      config.eos_id != config.pad_id,
                  "ByteTokenizer: special ids must differ, got bos_id=", config.bos_id,
                  " eos_id=", config.eos_id, " pad_id=", config.pad_id);
}

std::vector<std::int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<std::int32_t> ids;
  ids.reserve(text.size());
  for (char c : text) ids.push_back(static_cast<std::int32_t>(static_cast<unsigned char>(c)));
  return ids;
}

std::string ByteTokenizer::decode(std::span<const std::int32_t> ids, bool skip_special) const {
  std::string out;
  out.reserve(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int32_t id = ids[i];
    if (id >= 0 && id < 256) {
      out.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    } else if (is_special(id)) {
      if (!skip_special) {
        out += id == config_.bos_id ? "<bos>" : id == config_.eos_id ? "<eos>" : "<pad>";
      }
    } else {
      CHUNKLOSS_FAIL("ByteTokenizer::decode: id ", id, " at position ", i,
                     " is neither a byte nor a special id (vocab_size=", config_.vocab_size, ")");
    }
  }
  return out;
}

}  // namespace chunkloss::data
