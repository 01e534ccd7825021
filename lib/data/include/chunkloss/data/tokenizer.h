// The byte-level tokenizer: every UTF-8 byte is its own token (ids 0-255), plus three special
// ids for BOS, EOS and PAD. Lossless for any byte string, no vocabulary file, no merges.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace chunkloss::data {

/// Special ids and vocabulary size. The defaults give V = 259: bytes 0-255, BOS 256, EOS 257,
/// PAD 258. A larger vocab_size leaves unused ids (e.g. to round V up for the GEMMs).
struct TokenizerConfig {
  std::int32_t bos_id = 256;
  std::int32_t eos_id = 257;
  std::int32_t pad_id = 258;
  std::int32_t vocab_size = 259;
};

/// Maps bytes to ids and back. Immutable after construction; cheap to copy.
class ByteTokenizer {
 public:
  /// Throws chunkloss::Error when a special id is below 256, not below vocab_size, or two
  /// special ids are equal.
  explicit ByteTokenizer(const TokenizerConfig& config = {});

  const TokenizerConfig& config() const { return config_; }
  std::int32_t bos_id() const { return config_.bos_id; }
  std::int32_t eos_id() const { return config_.eos_id; }
  std::int32_t pad_id() const { return config_.pad_id; }
  std::int32_t vocab_size() const { return config_.vocab_size; }
  bool is_special(std::int32_t id) const {
    return id == config_.bos_id || id == config_.eos_id || id == config_.pad_id;
  }

  /// The bytes of `text` as ids in [0, 256); no special tokens are added.
  std::vector<std::int32_t> encode(std::string_view text) const;

  /// The bytes of the ids in [0, 256). Special ids are dropped when `skip_special` (the
  /// default), otherwise rendered as "<bos>", "<eos>", "<pad>". Throws chunkloss::Error for an
  /// id outside [0, vocab_size) or an unused id >= 256 that is not special.
  std::string decode(std::span<const std::int32_t> ids, bool skip_special = true) const;

 private:
  TokenizerConfig config_;
};

}  // namespace chunkloss::data
