// A naive float64 forward of the Llama decoder written straight from the Hugging Face formulas
// (rotate_half, repeat_kv, masked softmax), looking tensors up by name: an oracle independent of
// the library's flat layout, Eigen maps and pairwise RoPE.
#pragma once

#include <chunkloss/model/model.h>

#include <cstdint>
#include <vector>

namespace chunkloss::test {

/// hidden [B * T, H] for tokens [B, T] given the flat parameters in `layout` order.
std::vector<double> reference_forward(const model::LlamaConfig& config,
                                      const std::vector<model::ParameterInfo>& layout,
                                      const std::vector<double>& params,
                                      const std::vector<std::int32_t>& tokens, std::int64_t batch,
                                      std::int64_t length);

/// Small configs used across the suite: odd sizes, two layers.
model::LlamaConfig tiny_config(bool gqa, bool tied);

}  // namespace chunkloss::test
