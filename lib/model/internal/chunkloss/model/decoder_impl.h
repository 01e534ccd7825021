// Internal: the definitions of detail::Decoder<T> over Eigen row-major maps of the flat buffers,
// included once per scalar type (decoder.cpp: float for the library; the tests' float64 copy).
// Attention runs per (sequence, head) in the forward and per (sequence, kv head) in the
// backward, so each OpenMP iteration writes disjoint memory and results do not depend on
// scheduling.
#pragma once

#include "chunkloss/model/decoder.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "chunkloss/core/error.h"

namespace chunkloss::model::detail {
namespace impl {

template <typename T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using MapM = Eigen::Map<Mat<T>>;
template <typename T>
using CMapM = Eigen::Map<const Mat<T>>;
using Stride = Eigen::OuterStride<>;
template <typename T>
using SMap = Eigen::Map<Mat<T>, 0, Stride>;
template <typename T>
using CSMap = Eigen::Map<const Mat<T>, 0, Stride>;

struct Dims {
  std::int64_t v, h, i, layers, heads, kv_heads, d, rep;
  explicit Dims(const LlamaConfig& c)
      : v(c.vocab_size),
        h(c.hidden_size),
        i(c.intermediate_size),
        layers(c.num_hidden_layers),
        heads(c.num_attention_heads),
        kv_heads(c.num_key_value_heads),
        d(c.head_dim()),
        rep(c.num_attention_heads / c.num_key_value_heads) {}
};

// Offsets of one layer's tensors relative to the layer's start, in layout order.
struct LayerOffsets {
  std::size_t ln1, q, k, v, o, ln2, gate, up, down, size;
  explicit LayerOffsets(const Dims& m) {
    const auto sz = [](std::int64_t a, std::int64_t b) { return static_cast<std::size_t>(a * b); };
    ln1 = 0;
    q = ln1 + sz(m.h, 1);
    k = q + sz(m.heads * m.d, m.h);
    v = k + sz(m.kv_heads * m.d, m.h);
    o = v + sz(m.kv_heads * m.d, m.h);
    ln2 = o + sz(m.h, m.heads * m.d);
    gate = ln2 + sz(m.h, 1);
    up = gate + sz(m.i, m.h);
    down = up + sz(m.i, m.h);
    size = down + sz(m.h, m.i);
  }
};

template <typename T>
void grow(std::vector<T>& buf, std::int64_t n) {
  buf.resize(static_cast<std::size_t>(n));
}

template <typename T>
void rms_forward(const T* x, const T* g, T* inv, T* y, std::int64_t n, std::int64_t h, T eps) {
  for (std::int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * h;
    T ss = 0;
    for (std::int64_t j = 0; j < h; ++j) ss += xr[j] * xr[j];
    const T ir = T(1) / std::sqrt(ss / static_cast<T>(h) + eps);
    inv[r] = ir;
    T* yr = y + r * h;
    for (std::int64_t j = 0; j < h; ++j) yr[j] = g[j] * (xr[j] * ir);
  }
}

// dx += d(rmsnorm)/dx^T dy, dg += sum over rows of dy * x / rms.
template <typename T>
void rms_backward(const T* x, const T* inv, const T* g, const T* dy, T* dx, T* dg, std::int64_t n,
                  std::int64_t h) {
  for (std::int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * h;
    const T* dyr = dy + r * h;
    T* dxr = dx + r * h;
    const T ir = inv[r];
    T s = 0;
    for (std::int64_t j = 0; j < h; ++j) s += g[j] * dyr[j] * xr[j];
    const T c = ir * ir * ir * s / static_cast<T>(h);
    for (std::int64_t j = 0; j < h; ++j) {
      dxr[j] += ir * g[j] * dyr[j] - xr[j] * c;
      dg[j] += dyr[j] * xr[j] * ir;
    }
  }
}

// Rotates (or, with `inverse`, applies the transpose rotation to) every head of every row.
template <typename T>
void rope_apply(T* x, std::int64_t rows, std::int64_t length, std::int64_t heads, std::int64_t d,
                const T* cos_t, const T* sin_t, bool inverse) {
  const std::int64_t half = d / 2;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t t = r % length;
    const T* c = cos_t + t * half;
    const T* s = sin_t + t * half;
    for (std::int64_t hd = 0; hd < heads; ++hd) {
      T* p = x + (r * heads + hd) * d;
      for (std::int64_t i = 0; i < half; ++i) {
        const T a = p[i], b = p[i + half];
        if (!inverse) {
          p[i] = a * c[i] - b * s[i];
          p[i + half] = b * c[i] + a * s[i];
        } else {
          p[i] = a * c[i] + b * s[i];
          p[i + half] = b * c[i] - a * s[i];
        }
      }
    }
  }
}

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

}  // namespace impl

using namespace impl;

template <typename T>
void init_parameters(const LlamaConfig& config, const std::vector<ParameterInfo>& layout,
                     std::uint64_t seed, std::vector<T>& out) {
  std::mt19937_64 rng(seed);
  const auto uniform = [&] { return static_cast<double>(rng() >> 11) * 0x1.0p-53; };
  bool have_spare = false;
  double spare = 0;
  const auto normal = [&] {
    if (have_spare) {
      have_spare = false;
      return spare;
    }
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * 3.14159265358979323846 * u2;
    spare = radius * std::sin(angle);
    have_spare = true;
    return radius * std::cos(angle);
  };
  std::size_t total = 0;
  for (const ParameterInfo& p : layout) total += p.numel;
  out.assign(total, T(0));
  for (const ParameterInfo& p : layout) {
    for (std::size_t j = 0; j < p.numel; ++j) {
      out[p.offset + j] =
          p.decay ? static_cast<T>(normal() * config.initializer_range) : static_cast<T>(1);
    }
  }
}

template <typename T>
Decoder<T>::Decoder(const LlamaConfig& config)
    : config_(config), layout_(parameter_layout(config)) {
  const Dims m(config);
  const LayerOffsets lo(m);
  std::size_t total = 0;
  for (const ParameterInfo& p : layout_) total += p.numel;
  params_.assign(total, T(0));
  grads_.assign(total, T(0));
  layer_offset_ = static_cast<std::size_t>(m.v * m.h);
  layer_stride_ = lo.size;
  norm_offset_ = layer_offset_ + static_cast<std::size_t>(m.layers) * layer_stride_;
  lm_head_offset_ = config.tie_word_embeddings ? 0 : norm_offset_ + static_cast<std::size_t>(m.h);
}

template <typename T>
Decoder<T>::Decoder(const Decoder& other)
    : config_(other.config_),
      layout_(other.layout_),
      params_(other.params_),
      grads_(other.grads_),
      lm_head_offset_(other.lm_head_offset_),
      layer_offset_(other.layer_offset_),
      layer_stride_(other.layer_stride_),
      norm_offset_(other.norm_offset_) {}

template <typename T>
Decoder<T>& Decoder<T>::operator=(const Decoder& other) {
  if (this == &other) return *this;
  config_ = other.config_;
  layout_ = other.layout_;
  params_ = other.params_;
  grads_ = other.grads_;
  lm_head_offset_ = other.lm_head_offset_;
  layer_offset_ = other.layer_offset_;
  layer_stride_ = other.layer_stride_;
  norm_offset_ = other.norm_offset_;
  batch_ = length_ = rows_ = 0;
  tokens_.clear();
  layers_.clear();
  rope_len_ = 0;
  return *this;
}

template <typename T>
void Decoder<T>::ensure_rope(std::int64_t length) {
  if (length <= rope_len_) return;
  const std::int64_t d = config_.head_dim(), half = d / 2;
  grow(cos_, length * half);
  grow(sin_, length * half);
  const T theta = static_cast<T>(config_.rope_theta);
  for (std::int64_t i = 0; i < half; ++i) {
    const T inv_freq = T(1) / std::pow(theta, static_cast<T>(2 * i) / static_cast<T>(d));
    for (std::int64_t t = 0; t < length; ++t) {
      const T angle = static_cast<T>(t) * inv_freq;
      cos_[static_cast<std::size_t>(t * half + i)] = std::cos(angle);
      sin_[static_cast<std::size_t>(t * half + i)] = std::sin(angle);
    }
  }
  rope_len_ = length;
}

template <typename T>
const T* Decoder<T>::forward(const std::int32_t* tokens, std::int64_t batch, std::int64_t length) {
  const Dims m(config_);
  const LayerOffsets lo(m);
  CHUNKLOSS_CHECK(batch > 0 && length > 0, "LlamaModel::forward: tokens must be [B, T] with B, T ",
                  ">= 1, got [", batch, ", ", length, "]");
  CHUNKLOSS_CHECK(length <= config_.max_position_embeddings, "LlamaModel::forward: T=", length,
                  " exceeds max_position_embeddings=", config_.max_position_embeddings);
  const std::int64_t n = batch * length;
  for (std::int64_t r = 0; r < n; ++r) {
    CHUNKLOSS_CHECK(tokens[r] >= 0 && tokens[r] < m.v, "LlamaModel::forward: token id ", tokens[r],
                    " at [", r / length, ", ", r % length, "] outside [0, vocab_size=", m.v, ")");
  }
  batch_ = batch;
  length_ = length;
  rows_ = n;
  tokens_.assign(tokens, tokens + n);
  ensure_rope(length);
  layers_.resize(static_cast<std::size_t>(m.layers));
  grow(final_x_, n * m.h);
  grow(final_inv_, n);
  grow(hidden_, n * m.h);

  const T eps = static_cast<T>(config_.rms_norm_eps);
  const T scale = T(1) / std::sqrt(static_cast<T>(m.d));
  const std::int64_t qw = m.heads * m.d, kw = m.kv_heads * m.d;

  grow(layers_[0].x, n * m.h);
  for (std::int64_t r = 0; r < n; ++r) {
    std::copy_n(params_.data() + tokens[r] * m.h, m.h, layers_[0].x.data() + r * m.h);
  }

  for (std::int64_t l = 0; l < m.layers; ++l) {
    LayerCache<T>& c = layers_[static_cast<std::size_t>(l)];
    const T* w = params_.data() + layer_offset_ + static_cast<std::size_t>(l) * layer_stride_;
    grow(c.inv1, n);
    grow(c.xn1, n * m.h);
    grow(c.q, n * qw);
    grow(c.k, n * kw);
    grow(c.v, n * kw);
    grow(c.probs, batch * m.heads * length * length);
    grow(c.attn, n * qw);
    grow(c.mid, n * m.h);
    grow(c.inv2, n);
    grow(c.xn2, n * m.h);
    grow(c.gate, n * m.i);
    grow(c.up, n * m.i);
    grow(c.act, n * m.i);

    rms_forward(c.x.data(), w + lo.ln1, c.inv1.data(), c.xn1.data(), n, m.h, eps);
    const CMapM<T> xn1(c.xn1.data(), n, m.h);
    MapM<T>(c.q.data(), n, qw).noalias() = xn1 * CMapM<T>(w + lo.q, qw, m.h).transpose();
    MapM<T>(c.k.data(), n, kw).noalias() = xn1 * CMapM<T>(w + lo.k, kw, m.h).transpose();
    MapM<T>(c.v.data(), n, kw).noalias() = xn1 * CMapM<T>(w + lo.v, kw, m.h).transpose();
    rope_apply(c.q.data(), n, length, m.heads, m.d, cos_.data(), sin_.data(), false);
    rope_apply(c.k.data(), n, length, m.kv_heads, m.d, cos_.data(), sin_.data(), false);

    const std::int64_t units = batch * m.heads;
#pragma omp parallel for schedule(static)
    for (std::int64_t u = 0; u < units; ++u) {
      const std::int64_t b = u / m.heads, hd = u % m.heads, kv = hd / m.rep;
      const CSMap<T> q(c.q.data() + b * length * qw + hd * m.d, length, m.d, Stride(qw));
      const CSMap<T> k(c.k.data() + b * length * kw + kv * m.d, length, m.d, Stride(kw));
      const CSMap<T> v(c.v.data() + b * length * kw + kv * m.d, length, m.d, Stride(kw));
      MapM<T> p(c.probs.data() + u * length * length, length, length);
      p.noalias() = q * k.transpose();
      for (std::int64_t i = 0; i < length; ++i) {
        T mx = -std::numeric_limits<T>::infinity();
        for (std::int64_t j = 0; j <= i; ++j) mx = std::max(mx, p(i, j) * scale);
        T sum = 0;
        for (std::int64_t j = 0; j <= i; ++j) {
          p(i, j) = std::exp(p(i, j) * scale - mx);
          sum += p(i, j);
        }
        const T inv = T(1) / sum;
        for (std::int64_t j = 0; j <= i; ++j) p(i, j) *= inv;
        for (std::int64_t j = i + 1; j < length; ++j) p(i, j) = 0;
      }
      SMap<T>(c.attn.data() + b * length * qw + hd * m.d, length, m.d, Stride(qw)).noalias() =
          p * v;
    }

    MapM<T> mid(c.mid.data(), n, m.h);
    mid = CMapM<T>(c.x.data(), n, m.h);
    mid.noalias() += CMapM<T>(c.attn.data(), n, qw) * CMapM<T>(w + lo.o, m.h, qw).transpose();

    rms_forward(c.mid.data(), w + lo.ln2, c.inv2.data(), c.xn2.data(), n, m.h, eps);
    const CMapM<T> xn2(c.xn2.data(), n, m.h);
    MapM<T>(c.gate.data(), n, m.i).noalias() = xn2 * CMapM<T>(w + lo.gate, m.i, m.h).transpose();
    MapM<T>(c.up.data(), n, m.i).noalias() = xn2 * CMapM<T>(w + lo.up, m.i, m.h).transpose();
    for (std::size_t j = 0; j < c.act.size(); ++j) {
      const T g = c.gate[j];
      c.act[j] = g * sigmoid(g) * c.up[j];
    }
    T* out;
    if (l + 1 < m.layers) {
      LayerCache<T>& next = layers_[static_cast<std::size_t>(l + 1)];
      grow(next.x, n * m.h);
      out = next.x.data();
    } else {
      out = final_x_.data();
    }
    MapM<T> xo(out, n, m.h);
    xo = mid;
    xo.noalias() += CMapM<T>(c.act.data(), n, m.i) * CMapM<T>(w + lo.down, m.h, m.i).transpose();
  }

  rms_forward(final_x_.data(), params_.data() + norm_offset_, final_inv_.data(), hidden_.data(), n,
              m.h, eps);
  return hidden_.data();
}

template <typename T>
void Decoder<T>::backward(const T* grad_hidden, const T* grad_lm_head) {
  CHUNKLOSS_CHECK(rows_ > 0, "LlamaModel::backward: called before forward");
  const Dims m(config_);
  const LayerOffsets lo(m);
  const std::int64_t n = rows_, length = length_;
  const std::int64_t qw = m.heads * m.d, kw = m.kv_heads * m.d;
  const T scale = T(1) / std::sqrt(static_cast<T>(m.d));

  if (grad_lm_head) {
    T* g = grads_.data() + lm_head_offset_;
    const std::size_t count = static_cast<std::size_t>(m.v * m.h);
    for (std::size_t j = 0; j < count; ++j) g[j] += grad_lm_head[j];
  }

  grow(dx_, n * m.h);
  grow(dxn_, n * m.h);
  grow(dattn_, n * qw);
  grow(dq_, n * qw);
  grow(dk_, n * kw);
  grow(dv_, n * kw);
  grow(dact_, n * m.i);
  grow(dgate_, n * m.i);
  grow(dup_, n * m.i);

  std::fill(dx_.begin(), dx_.end(), T(0));
  rms_backward(final_x_.data(), final_inv_.data(), params_.data() + norm_offset_, grad_hidden,
               dx_.data(), grads_.data() + norm_offset_, n, m.h);

  MapM<T> dx(dx_.data(), n, m.h);
  for (std::int64_t l = m.layers - 1; l >= 0; --l) {
    const LayerCache<T>& c = layers_[static_cast<std::size_t>(l)];
    const std::size_t base = layer_offset_ + static_cast<std::size_t>(l) * layer_stride_;
    const T* w = params_.data() + base;
    T* gw = grads_.data() + base;

    // MLP: out = mid + act Wd^T, act = silu(gate) * up.
    MapM<T> dact(dact_.data(), n, m.i);
    dact.noalias() = dx * CMapM<T>(w + lo.down, m.h, m.i);
    MapM<T>(gw + lo.down, m.h, m.i).noalias() += dx.transpose() * CMapM<T>(c.act.data(), n, m.i);
    for (std::size_t j = 0; j < dact_.size(); ++j) {
      const T g = c.gate[j], s = sigmoid(g);
      dup_[j] = dact_[j] * g * s;
      dgate_[j] = dact_[j] * c.up[j] * s * (T(1) + g * (T(1) - s));
    }
    const CMapM<T> dgate(dgate_.data(), n, m.i), dup(dup_.data(), n, m.i);
    const CMapM<T> xn2(c.xn2.data(), n, m.h);
    MapM<T>(gw + lo.gate, m.i, m.h).noalias() += dgate.transpose() * xn2;
    MapM<T>(gw + lo.up, m.i, m.h).noalias() += dup.transpose() * xn2;
    MapM<T> dxn(dxn_.data(), n, m.h);
    dxn.noalias() = dgate * CMapM<T>(w + lo.gate, m.i, m.h);
    dxn.noalias() += dup * CMapM<T>(w + lo.up, m.i, m.h);
    rms_backward(c.mid.data(), c.inv2.data(), w + lo.ln2, dxn_.data(), dx_.data(), gw + lo.ln2, n,
                 m.h);

    // Attention: mid = x + attn Wo^T.
    MapM<T> dattn(dattn_.data(), n, qw);
    dattn.noalias() = dx * CMapM<T>(w + lo.o, m.h, qw);
    MapM<T>(gw + lo.o, m.h, qw).noalias() += dx.transpose() * CMapM<T>(c.attn.data(), n, qw);
    std::fill(dk_.begin(), dk_.end(), T(0));
    std::fill(dv_.begin(), dv_.end(), T(0));
    const std::int64_t units = batch_ * m.kv_heads;
#pragma omp parallel for schedule(static)
    for (std::int64_t u = 0; u < units; ++u) {
      const std::int64_t b = u / m.kv_heads, kv = u % m.kv_heads;
      const CSMap<T> k(c.k.data() + b * length * kw + kv * m.d, length, m.d, Stride(kw));
      const CSMap<T> v(c.v.data() + b * length * kw + kv * m.d, length, m.d, Stride(kw));
      SMap<T> dk(dk_.data() + b * length * kw + kv * m.d, length, m.d, Stride(kw));
      SMap<T> dv(dv_.data() + b * length * kw + kv * m.d, length, m.d, Stride(kw));
      Mat<T> ds(length, length);
      for (std::int64_t hd = kv * m.rep; hd < (kv + 1) * m.rep; ++hd) {
        const CSMap<T> q(c.q.data() + b * length * qw + hd * m.d, length, m.d, Stride(qw));
        const CSMap<T> dout(dattn_.data() + b * length * qw + hd * m.d, length, m.d, Stride(qw));
        const CMapM<T> p(c.probs.data() + (b * m.heads + hd) * length * length, length, length);
        dv.noalias() += p.transpose() * dout;
        ds.noalias() = dout * v.transpose();
        for (std::int64_t i = 0; i < length; ++i) {
          T s = 0;
          for (std::int64_t j = 0; j <= i; ++j) s += p(i, j) * ds(i, j);
          for (std::int64_t j = 0; j <= i; ++j) ds(i, j) = p(i, j) * (ds(i, j) - s) * scale;
          for (std::int64_t j = i + 1; j < length; ++j) ds(i, j) = 0;
        }
        SMap<T>(dq_.data() + b * length * qw + hd * m.d, length, m.d, Stride(qw)).noalias() =
            ds * k;
        dk.noalias() += ds.transpose() * q;
      }
    }
    rope_apply(dq_.data(), n, length, m.heads, m.d, cos_.data(), sin_.data(), true);
    rope_apply(dk_.data(), n, length, m.kv_heads, m.d, cos_.data(), sin_.data(), true);

    const CMapM<T> dq(dq_.data(), n, qw), dk(dk_.data(), n, kw), dv(dv_.data(), n, kw);
    const CMapM<T> xn1(c.xn1.data(), n, m.h);
    MapM<T>(gw + lo.q, qw, m.h).noalias() += dq.transpose() * xn1;
    MapM<T>(gw + lo.k, kw, m.h).noalias() += dk.transpose() * xn1;
    MapM<T>(gw + lo.v, kw, m.h).noalias() += dv.transpose() * xn1;
    dxn.noalias() = dq * CMapM<T>(w + lo.q, qw, m.h);
    dxn.noalias() += dk * CMapM<T>(w + lo.k, kw, m.h);
    dxn.noalias() += dv * CMapM<T>(w + lo.v, kw, m.h);
    rms_backward(c.x.data(), c.inv1.data(), w + lo.ln1, dxn_.data(), dx_.data(), gw + lo.ln1, n,
                 m.h);
  }

  T* gemb = grads_.data();
  for (std::int64_t r = 0; r < n; ++r) {
    T* row = gemb + tokens_[static_cast<std::size_t>(r)] * m.h;
    const T* src = dx_.data() + r * m.h;
    for (std::int64_t j = 0; j < m.h; ++j) row[j] += src[j];
  }
}

}  // namespace chunkloss::model::detail
