// Encoding (BOS/EOS placement, causal shift, prompt masking, truncation) and right-padded
// collation into [B, T] batches.
#include "chunkloss/data/batch.h"

#include <algorithm>

#include "chunkloss/core/error.h"

namespace chunkloss::data {

Sequence encode(const ByteTokenizer& tok, std::string_view prompt, std::string_view completion,
                const EncodeOptions& options) {
  CHUNKLOSS_CHECK(!completion.empty(), "encode: the completion is empty");
  CHUNKLOSS_CHECK(options.max_length >= 0, "encode: max_length=", options.max_length,
                  " must be >= 0");
  CHUNKLOSS_CHECK(options.max_prompt_length >= 0,
                  "encode: max_prompt_length=", options.max_prompt_length, " must be >= 0");
  std::vector<std::int32_t> p = tok.encode(prompt);
  std::vector<std::int32_t> c = tok.encode(completion);
  c.push_back(tok.eos_id());
  const auto keep_prompt_end = [&](std::int64_t keep) {
    if (static_cast<std::int64_t>(p.size()) > keep) {
      p.erase(p.begin(), p.end() - keep);
    }
  };
  if (options.max_prompt_length > 0) keep_prompt_end(options.max_prompt_length);
  const std::int64_t np = static_cast<std::int64_t>(p.size());
  const std::int64_t nc = static_cast<std::int64_t>(c.size());
  if (options.max_length > 0 && np + nc > options.max_length) {
    const std::int64_t keep_c = options.max_length - np;
    if (keep_c >= 1) {
      c.resize(static_cast<std::size_t>(keep_c));
    } else {
      keep_prompt_end(options.max_length - 1);
      c.resize(1);
    }
  }
  Sequence s;
  s.tokens.reserve(p.size() + c.size());
  s.tokens.push_back(tok.bos_id());
  s.tokens.insert(s.tokens.end(), p.begin(), p.end());
  s.tokens.insert(s.tokens.end(), c.begin(), c.end() - 1);
  s.targets.assign(p.size(), options.ignore_index);
  s.targets.insert(s.targets.end(), c.begin(), c.end());
  return s;
}

std::vector<Sequence> encode_sft(const ByteTokenizer& tok, std::span<const SftExample> examples,
                                 const EncodeOptions& options) {
  std::vector<Sequence> out;
  out.reserve(examples.size());
  for (const SftExample& e : examples) out.push_back(encode(tok, e.prompt, e.completion, options));
  return out;
}

std::vector<PreferenceSequences> encode_preference(const ByteTokenizer& tok,
                                                   std::span<const PreferenceExample> examples,
                                                   const EncodeOptions& options) {
  std::vector<PreferenceSequences> out;
  out.reserve(examples.size());
  for (const PreferenceExample& e : examples) {
    out.push_back(
        {encode(tok, e.prompt, e.chosen, options), encode(tok, e.prompt, e.rejected, options)});
  }
  return out;
}

std::vector<LabeledSequence> encode_unpaired(const ByteTokenizer& tok,
                                             std::span<const UnpairedExample> examples,
                                             const EncodeOptions& options) {
  std::vector<LabeledSequence> out;
  out.reserve(examples.size());
  for (const UnpairedExample& e : examples) {
    out.push_back({encode(tok, e.prompt, e.completion, options), e.label});
  }
  return out;
}

TensorView Batch::tokens_view() const { return TensorView::of(tokens.data(), {rows, length}); }

TensorView Batch::targets_view() const { return TensorView::of(targets.data(), {rows * length}); }

namespace {

std::int64_t count_not(const std::vector<std::int32_t>& targets, std::int32_t ignore_index) {
  return static_cast<std::int64_t>(std::count_if(
      targets.begin(), targets.end(), [&](std::int32_t t) { return t != ignore_index; }));
}

}  // namespace

std::int64_t Sequence::count_targets(std::int32_t ignore_index) const {
  return count_not(targets, ignore_index);
}

std::int64_t Batch::count_targets(std::int32_t ignore_index) const {
  return count_not(targets, ignore_index);
}

namespace {

// Pads `rows` (pointers into the caller's sequences) into a batch.
Batch pad(std::span<const Sequence* const> rows, const CollateOptions& options, const char* who) {
  CHUNKLOSS_CHECK(!rows.empty(), who, ": no rows to collate");
  std::int64_t longest = 0;
  for (const Sequence* s : rows) {
    CHUNKLOSS_CHECK(!s->tokens.empty() && s->tokens.size() == s->targets.size(), who,
                    ": a sequence has ", s->tokens.size(), " tokens and ", s->targets.size(),
                    " targets (need the same number, >= 1)");
    longest = std::max(longest, static_cast<std::int64_t>(s->tokens.size()));
  }
  CHUNKLOSS_CHECK(options.length >= 0, who, ": length=", options.length, " must be >= 0");
  CHUNKLOSS_CHECK(options.length == 0 || longest <= options.length, who, ": a row of length ",
                  longest, " does not fit the fixed length ", options.length);
  Batch b;
  b.rows = static_cast<std::int64_t>(rows.size());
  b.length = options.length > 0 ? options.length : longest;
  const std::size_t total = static_cast<std::size_t>(b.rows * b.length);
  b.tokens.assign(total, options.pad_id);
  b.targets.assign(total, options.ignore_index);
  b.lengths.reserve(rows.size());
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const Sequence& s = *rows[r];
    const std::size_t at = r * static_cast<std::size_t>(b.length);
    std::copy(s.tokens.begin(), s.tokens.end(), b.tokens.begin() + static_cast<std::ptrdiff_t>(at));
    std::copy(s.targets.begin(), s.targets.end(),
              b.targets.begin() + static_cast<std::ptrdiff_t>(at));
    b.lengths.push_back(static_cast<std::int32_t>(s.tokens.size()));
  }
  return b;
}

void check_index(std::size_t i, std::size_t n, const char* who) {
  CHUNKLOSS_CHECK(i < n, who, ": index ", i, " out of range for ", n, " examples");
}

}  // namespace

Batch collate_sft(std::span<const Sequence> sequences, std::span<const std::size_t> indices,
                  const CollateOptions& options) {
  std::vector<const Sequence*> rows;
  for (std::size_t i : indices) {
    check_index(i, sequences.size(), "collate_sft");
    rows.push_back(&sequences[i]);
  }
  return pad(rows, options, "collate_sft");
}

Batch collate_preference(std::span<const PreferenceSequences> pairs,
                         std::span<const std::size_t> indices, const CollateOptions& options) {
  std::vector<const Sequence*> rows;
  for (std::size_t i : indices) {
    check_index(i, pairs.size(), "collate_preference");
    rows.push_back(&pairs[i].chosen);
  }
  for (std::size_t i : indices) rows.push_back(&pairs[i].rejected);
  Batch b = pad(rows, options, "collate_preference");
  b.pairs = static_cast<std::int64_t>(indices.size());
  return b;
}

Batch collate_unpaired(std::span<const LabeledSequence> sequences,
                       std::span<const std::size_t> indices, const CollateOptions& options) {
  std::vector<const Sequence*> rows;
  std::vector<std::uint8_t> labels;
  for (std::size_t i : indices) {
    check_index(i, sequences.size(), "collate_unpaired");
    rows.push_back(&sequences[i].sequence);
    labels.push_back(sequences[i].label ? 1 : 0);
  }
  Batch b = pad(rows, options, "collate_unpaired");
  b.labels = std::move(labels);
  return b;
}

}  // namespace chunkloss::data
