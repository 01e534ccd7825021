// The model under LinearCrossEntropy on bundled SFT data: one AdamW step lowers the loss on a
// fixed batch, the loss's dW accumulated into the model's lm_head slot equals passing it to
// backward(), and a short overfit makes greedy decoding produce the trained answers.
#include <doctest/doctest.h>

#include <chunkloss/core/context.h>
#include <chunkloss/core/workspace.h>
#include <chunkloss/data/batch.h>
#include <chunkloss/data/jsonl.h>
#include <chunkloss/losses/cross_entropy.h>
#include <chunkloss/model/generate.h>
#include <chunkloss/model/model.h>
#include <chunkloss/model/optim.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "support/compare.h"

namespace chunkloss::test {
namespace {

using namespace chunkloss::model;

// An aligned host block for the loss's workspace.
class HostBlock {
 public:
  explicit HostBlock(std::size_t bytes) : storage_(new std::byte[bytes + kWorkspaceAlignment]) {
    void* p = storage_.get();
    std::size_t space = bytes + kWorkspaceAlignment;
    base_ = std::align(kWorkspaceAlignment, bytes, p, space);
    bytes_ = bytes;
  }
  Workspace workspace() const { return Workspace(base_, bytes_); }

 private:
  std::unique_ptr<std::byte[]> storage_;
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
};

LlamaConfig small_config() {
  LlamaConfig c;
  c.vocab_size = 259;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 16;
  c.tie_word_embeddings = true;
  return c;
}

data::Batch bundled_batch(std::size_t rows) {
  const auto ex =
      data::read_sft_jsonl(std::string(CHUNKLOSS_BUNDLED_DATA_DIR) + "/sft_train.jsonl");
  const data::ByteTokenizer tok;
  const auto seqs = data::encode_sft(tok, ex);
  std::vector<std::size_t> idx(rows);
  for (std::size_t i = 0; i < rows; ++i) idx[i] = i;
  return data::collate_sft(seqs, idx);
}

// Forward, CE forward_backward (dW accumulated into the model's lm_head slot), backward.
double loss_and_grads(LlamaModel& m, const LinearCrossEntropy& ce, const data::Batch& b,
                      bool with_grads) {
  CpuContext ctx;
  const TensorView h = m.forward(b.tokens_view());
  CrossEntropyInputs in;
  in.hidden = h;
  in.weight = m.lm_head_weight();
  in.targets = b.targets_view();
  std::vector<float> gh(static_cast<std::size_t>(h.numel()), 0.0f);
  CrossEntropyGrads g;
  if (with_grads) {
    g.hidden = TensorView::of(gh.data(), {h.size(0), h.size(1)});
    g.weight = m.lm_head_weight_grad();
    g.accumulate = true;
  }
  const HostBlock block(ce.workspace_bytes(in, g));
  const double loss = ce.forward_backward(ctx, in, g, {}, block.workspace()).loss;
  if (with_grads) m.backward(g.hidden);
  return loss;
}

TEST_CASE("training: one SFT step with LinearCrossEntropy lowers the loss on a fixed batch") {
  LlamaModel m(small_config(), 42);
  const LinearCrossEntropy ce;
  const data::Batch b = bundled_batch(16);
  AdamW opt(m.params().size());
  m.zero_grad();
  const double before = loss_and_grads(m, ce, b, true);
  CHECK(before == doctest::Approx(std::log(259.0)).epsilon(0.05));  // near-uniform at init
  CHECK(grad_norm(m.grads()) > 0);
  opt.step(m, 3e-3);
  const double after = loss_and_grads(m, ce, b, false);
  CHECK(after < before - 0.01);
}

TEST_CASE("training: dW into lm_head_weight_grad() equals handing it to backward()") {
  const LlamaConfig c = small_config();
  LlamaModel a(c, 1), b = a;
  const LinearCrossEntropy ce;
  const data::Batch batch = bundled_batch(4);
  a.zero_grad();
  loss_and_grads(a, ce, batch, true);

  b.zero_grad();
  CpuContext ctx;
  const TensorView h = b.forward(batch.tokens_view());
  CrossEntropyInputs in;
  in.hidden = h;
  in.weight = b.lm_head_weight();
  in.targets = batch.targets_view();
  std::vector<float> gh(static_cast<std::size_t>(h.numel())), gw(c.vocab_size * c.hidden_size);
  CrossEntropyGrads g;
  g.hidden = TensorView::of(gh.data(), {h.size(0), h.size(1)});
  g.weight = TensorView::of(gw.data(), {c.vocab_size, c.hidden_size});
  const HostBlock block(ce.workspace_bytes(in, g));
  ce.forward_backward(ctx, in, g, {}, block.workspace());
  b.backward(g.hidden, g.weight);
  double worst = 0, scale = 0;
  for (std::size_t j = 0; j < a.grads().size(); ++j) {
    worst = max_or_nan(worst, static_cast<double>(std::abs(a.grads()[j] - b.grads()[j])));
    scale = std::max(scale, static_cast<double>(std::abs(a.grads()[j])));
  }
  CHECK(scale > 0);
  CHECK(worst <= 1e-5 * scale);
}

TEST_CASE("training: overfitting four examples makes greedy decoding produce their answers") {
  LlamaModel m(small_config(), 7);
  const LinearCrossEntropy ce;
  const data::Batch b = bundled_batch(4);
  AdamW opt(m.params().size());
  LrSchedule s;
  s.lr = 1e-2;
  s.warmup_steps = 5;
  s.total_steps = 150;
  double first = 0, last = 0;
  for (std::int64_t step = 0; step < s.total_steps; ++step) {
    m.zero_grad();
    last = loss_and_grads(m, ce, b, true);
    if (step == 0) first = last;
    clip_grad_norm(m.grads(), 1.0);
    opt.step(m, learning_rate(s, step));
  }
  CHECK(last < 0.1 * first);
  const data::ByteTokenizer tok;
  const auto ex =
      data::read_sft_jsonl(std::string(CHUNKLOSS_BUNDLED_DATA_DIR) + "/sft_train.jsonl");
  for (std::size_t i = 0; i < 4; ++i) {
    std::vector<std::int32_t> prompt = {tok.bos_id()};
    for (std::int32_t id : tok.encode(ex[i].prompt)) prompt.push_back(id);
    GenerateOptions o;
    o.max_new_tokens = 6;
    o.eos_id = tok.eos_id();
    const GenerateResult r = generate(m, prompt, o);
    CAPTURE(ex[i].prompt);
    CHECK(tok.decode(r.tokens) == ex[i].completion);
    CHECK(r.stopped_at_eos);
  }
}

}  // namespace
}  // namespace chunkloss::test
