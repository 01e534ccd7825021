// Autoregressive decoding for evaluation: greedy (argmax) or temperature / top-k sampling from
// a seeded generator. Re-runs the full forward per new token (no KV cache: the models are tiny).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "chunkloss/model/model.h"

namespace chunkloss::model {

struct GenerateOptions {
  std::int64_t max_new_tokens = 16;
  /// 0: greedy (the first argmax). > 0: sample from softmax(logits / temperature).
  double temperature = 0.0;
  /// With sampling, keep only the top_k largest logits (0: all; ties keep the lower id).
  std::int64_t top_k = 0;
  std::uint64_t seed = 0;  ///< std::mt19937_64 seed for sampling
  /// Stop after producing this id (not included in the result); -1: never stop early.
  std::int32_t eos_id = -1;
};

struct GenerateResult {
  std::vector<std::int32_t> tokens;  ///< new tokens only, without the stopping EOS
  bool stopped_at_eos = false;
};

/// The last position's logits [V] = lm_head @ hidden[row], from the latest forward().
std::vector<float> logits_at(const LlamaModel& model, std::int64_t row);

/// Continues `prompt` (ids, non-empty, usually starting with BOS) for up to max_new_tokens,
/// stopping early at eos_id or after the token predicted from a context of
/// max_position_embeddings (so prompt and output may hold one more, never fed back). Overwrites the
/// model's activation cache. Deterministic for a given seed. Throws chunkloss::Error for an
/// empty or too long prompt, a negative temperature or top_k.
GenerateResult generate(LlamaModel& model, std::span<const std::int32_t> prompt,
                        const GenerateOptions& options = {});

}  // namespace chunkloss::model
