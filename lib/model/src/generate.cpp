// Greedy and temperature/top-k decoding on top of LlamaModel::forward.
#include "chunkloss/model/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "chunkloss/core/error.h"

namespace chunkloss::model {

std::vector<float> logits_at(const LlamaModel& model, std::int64_t row) {
  const TensorView hidden = model.hidden();
  CHUNKLOSS_CHECK(hidden.defined(), "logits_at: no forward() has run");
  CHUNKLOSS_CHECK(row >= 0 && row < hidden.size(0), "logits_at: row ", row, " outside [0, ",
                  hidden.size(0), ")");
  const std::int64_t v = model.config().vocab_size, h = model.config().hidden_size;
  const float* x = hidden.data_as<const float>() + row * h;
  const float* w = model.lm_head_weight().data_as<const float>();
  std::vector<float> out(static_cast<std::size_t>(v));
  for (std::int64_t i = 0; i < v; ++i) {
    float acc = 0;
    for (std::int64_t j = 0; j < h; ++j) acc += w[i * h + j] * x[j];
    out[static_cast<std::size_t>(i)] = acc;
  }
  return out;
}

namespace {

std::int32_t pick(const std::vector<float>& logits, const GenerateOptions& o,
                  std::mt19937_64& rng) {
  if (o.temperature == 0.0) {
    return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) -
                                     logits.begin());
  }
  std::vector<std::int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::size_t keep = ids.size();
  if (o.top_k > 0 && static_cast<std::size_t>(o.top_k) < keep) {
    keep = static_cast<std::size_t>(o.top_k);
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep), ids.end(),
                      [&](std::int32_t a, std::int32_t b) {
                        const float la = logits[static_cast<std::size_t>(a)];
                        const float lb = logits[static_cast<std::size_t>(b)];
                        return la > lb || (la == lb && a < b);
                      });
    ids.resize(keep);
    std::sort(ids.begin(), ids.end());
  }
  double mx = -INFINITY;
  for (std::int32_t id : ids)
    mx = std::max(mx, static_cast<double>(logits[static_cast<std::size_t>(id)]));
  std::vector<double> weights(ids.size());
  double total = 0;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    weights[k] = std::exp((logits[static_cast<std::size_t>(ids[k])] - mx) / o.temperature);
    total += weights[k];
  }
  const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * total;
  double acc = 0;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    acc += weights[k];
    if (u < acc) return ids[k];
  }
  return ids.back();
}

}  // namespace

GenerateResult generate(LlamaModel& model, std::span<const std::int32_t> prompt,
                        const GenerateOptions& options) {
  const std::int64_t max_pos = model.config().max_position_embeddings;
  CHUNKLOSS_CHECK(!prompt.empty(), "generate: empty prompt");
  CHUNKLOSS_CHECK(static_cast<std::int64_t>(prompt.size()) <= max_pos, "generate: prompt of ",
                  prompt.size(), " tokens exceeds max_position_embeddings=", max_pos);
  CHUNKLOSS_CHECK(options.temperature >= 0 && std::isfinite(options.temperature),
                  "generate: temperature=", options.temperature, " must be >= 0");
  CHUNKLOSS_CHECK(options.top_k >= 0, "generate: top_k=", options.top_k, " must be >= 0");
  CHUNKLOSS_CHECK(options.max_new_tokens >= 0, "generate: max_new_tokens=", options.max_new_tokens,
                  " must be >= 0");
  std::mt19937_64 rng(options.seed);
  std::vector<std::int32_t> seq(prompt.begin(), prompt.end());
  GenerateResult result;
  for (std::int64_t step = 0; step < options.max_new_tokens; ++step) {
    const std::int64_t t = static_cast<std::int64_t>(seq.size());
    if (t > max_pos) break;
    model.forward(TensorView::of(seq.data(), {1, t}));
    const std::int32_t next = pick(logits_at(model, t - 1), options, rng);
    if (options.eos_id >= 0 && next == options.eos_id) {
      result.stopped_at_eos = true;
      break;
    }
    result.tokens.push_back(next);
    seq.push_back(next);
  }
  return result;
}

}  // namespace chunkloss::model
