// libFuzzer target: the three JSONL readers and the encoders behind them on arbitrary bytes.
// The contract under test: any input either parses or throws chunkloss::Error, nothing else,
// and every example that parses encodes into a sequence with at least one trained target.
#include <chunkloss/core/error.h>
#include <chunkloss/data/batch.h>
#include <chunkloss/data/jsonl.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

namespace {

using namespace chunkloss;

void require(bool ok) {
  if (!ok) std::abort();
}

std::int64_t trained(const data::Sequence& s) {
  std::int64_t n = 0;
  for (std::int32_t t : s.targets) n += t != -100;
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* bytes, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(bytes), size);
  const data::ByteTokenizer tok;
  // The first byte picks a truncation length so the encoders' cut paths are reached too.
  data::EncodeOptions opt;
  opt.max_length = size > 0 ? bytes[0] % 16 : 0;
  opt.max_prompt_length = size > 1 ? bytes[1] % 8 : 0;
  try {
    for (const data::Sequence& s :
         data::encode_sft(tok, data::parse_sft_jsonl(text, "<fuzz>"), opt))
      require(trained(s) >= 1 && s.tokens.size() == s.targets.size());
  } catch (const Error&) {
  }
  try {
    for (const auto& p :
         data::encode_preference(tok, data::parse_preference_jsonl(text, "<fuzz>"), opt))
      require(trained(p.chosen) >= 1 && trained(p.rejected) >= 1);
  } catch (const Error&) {
  }
  try {
    for (const auto& l :
         data::encode_unpaired(tok, data::parse_unpaired_jsonl(text, "<fuzz>"), opt))
      require(trained(l.sequence) >= 1);
  } catch (const Error&) {
  }
  return 0;
}
