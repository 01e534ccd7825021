// The naive float64 reference forward: nested loops over vectors, one formula per line.
#include "reference_decoder.h"

#include <chunkloss/core/error.h>

#include <cmath>
#include <string>

namespace chunkloss::test {
namespace {

using Vec = std::vector<double>;
using Rows = std::vector<Vec>;

struct Params {
  const std::vector<model::ParameterInfo>& layout;
  const Vec& flat;
  const double* get(const std::string& name) const {
    for (const auto& p : layout) {
      if (p.name == name) return flat.data() + p.offset;
    }
    CHUNKLOSS_FAIL("reference: no tensor ", name);
  }
};

// y = W x for W [out, in] row-major.
Vec matvec(const double* w, const Vec& x, std::int64_t out) {
  const std::size_t in = x.size();
  Vec y(static_cast<std::size_t>(out), 0.0);
  for (std::int64_t o = 0; o < out; ++o) {
    for (std::size_t i = 0; i < in; ++i) y[static_cast<std::size_t>(o)] += w[o * in + i] * x[i];
  }
  return y;
}

Vec rmsnorm(const Vec& x, const double* g, double eps) {
  double ms = 0;
  for (double v : x) ms += v * v;
  ms /= static_cast<double>(x.size());
  Vec y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = g[i] * (x[i] / std::sqrt(ms + eps));
  return y;
}

// HF apply_rotary_pos_emb on one head vector at position t.
Vec rope(const Vec& x, std::int64_t t, double theta) {
  const std::size_t d = x.size(), half = d / 2;
  Vec rotated(d), out(d);
  for (std::size_t j = 0; j < d; ++j) rotated[j] = j < half ? -x[j + half] : x[j - half];
  for (std::size_t j = 0; j < d; ++j) {
    const double inv_freq = 1.0 / std::pow(theta, static_cast<double>(2 * (j % half)) / d);
    const double angle = static_cast<double>(t) * inv_freq;
    out[j] = x[j] * std::cos(angle) + rotated[j] * std::sin(angle);
  }
  return out;
}

}  // namespace

model::LlamaConfig tiny_config(bool gqa, bool tied) {
  model::LlamaConfig c;
  c.vocab_size = 11;
  c.hidden_size = 12;
  c.intermediate_size = 20;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = gqa ? 1 : 2;
  c.max_position_embeddings = 16;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.initializer_range = 0.5;  // large enough that attention and SiLU are far from linear
  c.tie_word_embeddings = tied;
  c.bos_token_id = 8;
  c.eos_token_id = 9;
  c.pad_token_id = 10;
  return c;
}

std::vector<double> reference_forward(const model::LlamaConfig& c,
                                      const std::vector<model::ParameterInfo>& layout,
                                      const std::vector<double>& flat,
                                      const std::vector<std::int32_t>& tokens, std::int64_t batch,
                                      std::int64_t length) {
  const Params p{layout, flat};
  const std::int64_t h = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  const std::int64_t d = h / nh, rep = nh / nkv;
  const std::size_t hd = static_cast<std::size_t>(d);
  Vec out;
  for (std::int64_t b = 0; b < batch; ++b) {
    Rows x(static_cast<std::size_t>(length));
    for (std::int64_t t = 0; t < length; ++t) {
      const double* e = p.get("model.embed_tokens.weight") + tokens[b * length + t] * h;
      x[t].assign(e, e + h);
    }
    for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const std::string pre = "model.layers." + std::to_string(l) + ".";
      Rows q(length), k(length), v(length);
      for (std::int64_t t = 0; t < length; ++t) {
        const Vec n1 = rmsnorm(x[t], p.get(pre + "input_layernorm.weight"), c.rms_norm_eps);
        q[t] = matvec(p.get(pre + "self_attn.q_proj.weight"), n1, nh * d);
        k[t] = matvec(p.get(pre + "self_attn.k_proj.weight"), n1, nkv * d);
        v[t] = matvec(p.get(pre + "self_attn.v_proj.weight"), n1, nkv * d);
      }
      Rows attn(length, Vec(static_cast<std::size_t>(nh * d), 0.0));
      for (std::int64_t head = 0; head < nh; ++head) {
        const std::int64_t kvh = head / rep;  // repeat_kv
        for (std::int64_t i = 0; i < length; ++i) {
          const Vec qi =
              rope(Vec(q[i].begin() + head * d, q[i].begin() + (head + 1) * d), i, c.rope_theta);
          Vec scores(static_cast<std::size_t>(length), -INFINITY);
          double mx = -INFINITY;
          for (std::int64_t j = 0; j <= i; ++j) {
            const Vec kj =
                rope(Vec(k[j].begin() + kvh * d, k[j].begin() + (kvh + 1) * d), j, c.rope_theta);
            double s = 0;
            for (std::size_t u = 0; u < hd; ++u) s += qi[u] * kj[u];
            scores[j] = s / std::sqrt(static_cast<double>(d));
            mx = std::max(mx, scores[j]);
          }
          double z = 0;
          for (std::int64_t j = 0; j <= i; ++j) z += std::exp(scores[j] - mx);
          for (std::int64_t j = 0; j <= i; ++j) {
            const double pj = std::exp(scores[j] - mx) / z;
            for (std::size_t u = 0; u < hd; ++u) {
              attn[i][head * d + u] += pj * v[j][kvh * d + u];
            }
          }
        }
      }
      for (std::int64_t t = 0; t < length; ++t) {
        const Vec o = matvec(p.get(pre + "self_attn.o_proj.weight"), attn[t], h);
        for (std::int64_t u = 0; u < h; ++u) x[t][u] += o[u];
        const Vec n2 =
            rmsnorm(x[t], p.get(pre + "post_attention_layernorm.weight"), c.rms_norm_eps);
        const Vec g = matvec(p.get(pre + "mlp.gate_proj.weight"), n2, c.intermediate_size);
        const Vec up = matvec(p.get(pre + "mlp.up_proj.weight"), n2, c.intermediate_size);
        Vec act(g.size());
        for (std::size_t u = 0; u < g.size(); ++u) act[u] = g[u] / (1 + std::exp(-g[u])) * up[u];
        const Vec m = matvec(p.get(pre + "mlp.down_proj.weight"), act, h);
        for (std::int64_t u = 0; u < h; ++u) x[t][u] += m[u];
      }
    }
    for (std::int64_t t = 0; t < length; ++t) {
      const Vec y = rmsnorm(x[t], p.get("model.norm.weight"), c.rms_norm_eps);
      out.insert(out.end(), y.begin(), y.end());
    }
  }
  return out;
}

}  // namespace chunkloss::test
