// Encoding examples into causal-LM (input, target) sequences and collating them into padded
// [B, T] batches: SFT rows, preference batches of 2P rows (chosen first, then rejected) and
// unpaired rows with labels. Prompt positions get ignore_index targets.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "chunkloss/core/tensor.h"
#include "chunkloss/data/jsonl.h"
#include "chunkloss/data/tokenizer.h"

namespace chunkloss::data {

/// One encoded example: model inputs and next-token targets, same length L >= 1.
///
/// Layout. With p = the prompt's ids and c = the completion's ids, the full token sequence is
///   s = [BOS] p c [EOS]                      (length 1 + |p| + |c| + 1)
/// and the sequence is its standard causal shift:
///   tokens[t]  = s[t]                        t = 0 .. L-1,  L = |p| + |c| + 1
///   targets[t] = s[t+1]  if s[t+1] belongs to c or is the final EOS, else ignore_index.
/// So the first |p| targets (predicting prompt bytes) are ignored, the target at position |p|
/// (input: the last prompt byte, or BOS for an empty prompt) is the first completion byte, and
/// the last target is EOS. The number of trained targets is |c| + 1 before truncation.
struct Sequence {
  std::vector<std::int32_t> tokens;
  std::vector<std::int32_t> targets;
  /// Number of targets that are not ignore_index (the trained ones: the completion and EOS).
  std::int64_t count_targets(std::int32_t ignore_index = -100) const;
};

/// A paired preference example: both sequences share the prompt.
struct PreferenceSequences {
  Sequence chosen;
  Sequence rejected;
};

/// An unpaired example with its desirability label.
struct LabeledSequence {
  Sequence sequence;
  bool label = false;
};

/// Truncation and target options.
///
/// Truncation, applied in this order (TRL's DPO convention: keep the end of the prompt, cut
/// the end of the completion):
///  1. `max_prompt_length` > 0: a prompt longer than that keeps its last max_prompt_length
///     bytes (BOS stays in front).
///  2. `max_length` > 0 bounds L, the number of input positions: when |p| + |c| + 1 > max_length
///     the completion-plus-EOS part is cut at its end (EOS goes first, then trailing completion
///     bytes) to max_length - |p| targets; if that would leave no completion target, the prompt is
///     instead cut from its start to max_length - 1 bytes, leaving exactly one trained target
///     (the first completion byte). Every sequence therefore keeps >= 1 trained target.
/// Both limits 0: no truncation.
struct EncodeOptions {
  std::int64_t max_length = 0;
  std::int64_t max_prompt_length = 0;
  std::int32_t ignore_index = -100;
};

/// Encodes one prompt/completion pair. Throws chunkloss::Error when `completion` is empty or
/// an option is negative.
Sequence encode(const ByteTokenizer& tok, std::string_view prompt, std::string_view completion,
                const EncodeOptions& options = {});

std::vector<Sequence> encode_sft(const ByteTokenizer& tok, std::span<const SftExample> examples,
                                 const EncodeOptions& options = {});
std::vector<PreferenceSequences> encode_preference(const ByteTokenizer& tok,
                                                   std::span<const PreferenceExample> examples,
                                                   const EncodeOptions& options = {});
std::vector<LabeledSequence> encode_unpaired(const ByteTokenizer& tok,
                                             std::span<const UnpairedExample> examples,
                                             const EncodeOptions& options = {});

/// A padded batch of B rows of length T, row-major, padded on the right: position t >= lengths[b]
/// of row b holds PAD in `tokens` and ignore_index in `targets`. Right padding keeps every real
/// position's causal context free of padding, so no attention mask is needed.
struct Batch {
  std::int64_t rows = 0;              ///< B (2P for a preference batch)
  std::int64_t length = 0;            ///< T
  std::vector<std::int32_t> tokens;   ///< [B, T] input ids
  std::vector<std::int32_t> targets;  ///< [B, T] next-token targets or ignore_index
  std::vector<std::int32_t> lengths;  ///< [B] real (unpadded) positions per row
  /// Preference batches: P = pairs; row i (i < P) is pair i's chosen sequence and row i + P its
  /// rejected one. 0 for other batches.
  std::int64_t pairs = 0;
  /// Unpaired batches: [B] desirability labels (1 = desirable); empty for other batches.
  std::vector<std::uint8_t> labels;

  /// tokens as a [B, T] i32 view and targets as a [B * T] i32 view (the loss's N rows).
  TensorView tokens_view() const;
  TensorView targets_view() const;
  /// Number of targets that are not ignore_index.
  std::int64_t count_targets(std::int32_t ignore_index = -100) const;
};

/// Collation options. `length` 0 pads to the longest row of the batch; otherwise every row is
/// padded to exactly `length` (an error when a row is longer).
struct CollateOptions {
  std::int32_t pad_id = 258;
  std::int32_t ignore_index = -100;
  std::int64_t length = 0;
};

/// Rows `indices` of `sequences`, in that order. Throws chunkloss::Error for an index out of
/// range, an empty index list, or a row longer than options.length.
Batch collate_sft(std::span<const Sequence> sequences, std::span<const std::size_t> indices,
                  const CollateOptions& options = {});
/// Pairs `indices`: rows 0..P-1 are their chosen sequences, rows P..2P-1 their rejected ones
/// (same order), T the longest of all 2P.
Batch collate_preference(std::span<const PreferenceSequences> pairs,
                         std::span<const std::size_t> indices, const CollateOptions& options = {});
/// Rows `indices` of `sequences` with their labels.
Batch collate_unpaired(std::span<const LabeledSequence> sequences,
                       std::span<const std::size_t> indices, const CollateOptions& options = {});

}  // namespace chunkloss::data
