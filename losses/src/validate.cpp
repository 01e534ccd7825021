// Boundary checks shared by the loss objects.
#include "validate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>

#include "chunkloss/core/error.h"
#include "engine.h"

namespace chunkloss::detail {
namespace {

std::string shape_str(std::initializer_list<std::int64_t> shape) {
  std::ostringstream os;
  os << '[';
  bool first = true;
  for (auto s : shape) {
    os << (first ? "" : ", ") << s;
    first = false;
  }
  os << ']';
  return os.str();
}

std::string dtypes_str(std::initializer_list<DType> dtypes) {
  std::string s;
  for (DType d : dtypes) s += (s.empty() ? "" : " or ") + std::string(dtype_name(d));
  return s;
}

}  // namespace

void check_view(const char* who, const char* name, const TensorView& t, Device dev,
                std::initializer_list<std::int64_t> shape, std::initializer_list<DType> dtypes) {
  CHUNKLOSS_CHECK(t.defined(), who, ": ", name, " is required, expected ", shape_str(shape), " ",
                  dtypes_str(dtypes));
  bool same = t.ndim() == static_cast<int>(shape.size());
  int d = 0;
  for (auto s : shape) same = same && t.size(d++) == s;
  CHUNKLOSS_CHECK(same, who, ": ", name, " has shape ", t.str(), ", expected ", shape_str(shape));
  bool ok = false;
  for (DType x : dtypes) ok = ok || t.dtype() == x;
  CHUNKLOSS_CHECK(ok, who, ": ", name, " ", t.str(), " must be ", dtypes_str(dtypes));
  CHUNKLOSS_CHECK(t.device() == dev, who, ": ", name, " ", t.str(),
                  " is not on the context's device (", device_name(dev), ")");
}

void check_optional(const char* who, const char* name, const TensorView& t, Device dev,
                    std::initializer_list<std::int64_t> shape,
                    std::initializer_list<DType> dtypes) {
  if (t.defined()) check_view(who, name, t, dev, shape, dtypes);
}

void check_memory(const char* who, const Context& ctx, const Workspace& ws, NamedViews inputs,
                  NamedViews outputs) {
  if (ctx.device() == Device::kCuda) {
    const int d = ctx.device_index();
    CHUNKLOSS_CHECK(ws.device_index() == d, who, ": workspace is on ", device_name(ws.device()),
                    ":", ws.device_index(), ", the context on ", device_name(ctx.device()), ":", d);
    for (NamedViews list : {inputs, outputs})
      for (const auto& [name, t] : list)
        CHUNKLOSS_CHECK(!t->defined() || t->device() != Device::kCuda || t->device_index() == d,
                        who, ": ", name, " ", t->str(), " is on device index ", t->device_index(),
                        ", the context on ", device_name(ctx.device()), ":", d);
  }
  // Byte ranges [begin, end) as integers (one address space: the host's, or the devices' unified
  // one).
  const auto range = [](const void* p, std::size_t bytes) {
    const auto b = reinterpret_cast<std::uintptr_t>(p);
    return std::pair{b, b + bytes};
  };
  const auto overlap = [](std::pair<std::uintptr_t, std::uintptr_t> a,
                          std::pair<std::uintptr_t, std::uintptr_t> b) {
    return a.first < a.second && b.first < b.second && a.first < b.second && b.first < a.second;
  };
  // The call overwrites the workspace while it reads the inputs and writes the outputs.
  const auto workspace = range(ws.base(), ws.bytes());
  for (NamedViews list : {inputs, outputs})
    for (const auto& [name, t] : list)
      CHUNKLOSS_CHECK(!t->defined() || !overlap(range(t->data(), t->nbytes()), workspace), who,
                      ": ", name, " ", t->str(), " shares memory with the workspace");
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    const TensorView& o = *out->second;
    if (!o.defined()) continue;
    const auto mine = range(o.data(), o.nbytes());
    for (NamedViews list : {inputs, outputs})
      for (const auto& [name, t] : list) {
        if (t == out->second || !t->defined()) continue;
        CHUNKLOSS_CHECK(!overlap(mine, range(t->data(), t->nbytes())), who, ": ", out->first, " ",
                        o.str(), " shares memory with ", name, " ", t->str(),
                        " (an output may not alias an input or another output)");
      }
  }
}

void check_grad_dtypes(const char* who, Device dev, const TensorView& hidden, NamedViews grads) {
  if (dev != Device::kCuda || hidden.dtype() != DType::kF32) return;
  for (const auto& [name, g] : grads)
    CHUNKLOSS_CHECK(!g->defined() || g->dtype() == DType::kF32, who, ": ", name, " ", g->str(),
                    " must be f32 with f32 hidden ", hidden.str(),
                    " on CUDA (cuBLAS has no GEMM from f32 operands to a bf16 result)");
}

void check_finite(const char* who, const char* name, const TensorView& t) {
  if (!t.defined()) return;
  const std::int64_t n = t.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = t.dtype() == DType::kF32 ? t.data_as<const float>()[i]
                                             : static_cast<float>(t.data_as<const BFloat16>()[i]);
    CHUNKLOSS_CHECK(std::isfinite(v), who, ": ", name, " ", t.str(), " has a non-finite value ", v,
                    " at flat index ", i);
  }
}

void check_finite(Context& ctx, double* scalars, const char* who, const char* name,
                  const TensorView& t) {
  if (!t.defined() || t.device() == Device::kCpu) {
    check_finite(who, name, t);
    return;
  }
#if CHUNKLOSS_HAVE_CUDA
  const std::uint64_t n = cuda_count_nonfinite(ctx, t, scalars);
  CHUNKLOSS_CHECK(n == 0, who, ": ", name, " ", t.str(), " has ", n, " non-finite values");
#else
  (void)ctx;
  (void)scalars;
  CHUNKLOSS_FAIL(who, ": ", name, " ", t.str(), " is device memory and this build has no CUDA");
#endif
}

std::int64_t check_vocab_shard(const char* who, const VocabShard& shard, std::int64_t v,
                               const TensorView& weight, LoopOrder order) {
  if (!shard.group) {
    CHUNKLOSS_CHECK(shard.offset == 0 && shard.size == 0, who, ": vocab_shard offset ",
                    shard.offset, " and size ", shard.size, " are set without a group");
    return v;
  }
  // Rank r of K holds rows [V r / K, V (r + 1) / K): every rank can check its own shard, the
  // shards tile the vocabulary, and every rank plans the same chunks (from ceil(V / K)).
  const std::int64_t k = shard.group->size(), r = shard.group->rank();
  CHUNKLOSS_CHECK(shard.size >= k, who, ": vocab_shard: a vocabulary of size ", shard.size,
                  " cannot be split over ", k, " ranks");
  const VocabShard own = VocabShard::of(shard.group, shard.size);
  const std::int64_t first = own.offset, end = own.end();
  CHUNKLOSS_CHECK(shard.offset == first && v == end - first, who, ": vocab_shard: rank ", r, " of ",
                  k, " must hold rows [", first, ", ", end, ") of the vocabulary of size ",
                  shard.size, " (rank r: [V r / K, V (r + 1) / K)), got weight ", weight.str(),
                  " at offset ", shard.offset);
  CHUNKLOSS_CHECK(order != LoopOrder::kVocabBlock, who,
                  ": loop_order vocab_block is not available with vocab_shard");
  return shard.size;
}

void check_targets(const char* who, const TensorView& targets, std::int64_t vocab,
                   std::int64_t ignore_index) {
  const std::int64_t n = targets.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t y = targets.dtype() == DType::kI32
                               ? targets.data_as<const std::int32_t>()[i]
                               : targets.data_as<const std::int64_t>()[i];
    CHUNKLOSS_CHECK(y == ignore_index || (y >= 0 && y < vocab), who, ": targets[", i, "] = ", y,
                    " is outside [0, V=", vocab, ") and is not ignore_index (", ignore_index, ")");
  }
}

void check_loop_order(std::string_view who, LoopOrder order) {
  CHUNKLOSS_CHECK(loop_order_name(order) != "?", who,
                  ": loop_order must be auto, token_chunk or vocab_block, got the value ",
                  static_cast<int>(order));
}

void check_class_weights(const char* who, const TensorView& class_weights) {
  if (!class_weights.defined()) return;
  const auto* w = class_weights.data_as<const float>();
  for (std::int64_t j = 0; j < class_weights.numel(); ++j)
    CHUNKLOSS_CHECK(std::isfinite(w[j]) && w[j] >= 0.0f, who, ": class_weights ",
                    class_weights.str(), " has ", w[j], " at index ", j,
                    "; class weights must be finite and >= 0");
}

std::vector<std::int64_t> read_target_ids(Context& ctx, const char* who, const char* name,
                                          const TensorView& targets, std::int64_t vocab,
                                          std::int64_t ignore_index) {
  const std::int64_t n = targets.numel();
  const std::int64_t t = targets.ndim() == 2 ? targets.size(1) : 0;  // [S, T]: two indices
  std::vector<std::int64_t> y(static_cast<std::size_t>(n));
  if (targets.dtype() == DType::kI64) {
    read_to_host(ctx, targets, y.data());
  } else {
    std::vector<std::int32_t> y32(static_cast<std::size_t>(n));
    read_to_host(ctx, targets, y32.data());
    std::copy(y32.begin(), y32.end(), y.begin());
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t yi = y[static_cast<std::size_t>(i)];
    if (yi == ignore_index) continue;
    if (yi < 0 || yi >= vocab) {
      std::ostringstream at;
      if (t)
        at << i / t << ", " << i % t;
      else
        at << i;
      CHUNKLOSS_FAIL(who, ": ", name, "[", at.str(), "] = ", yi, " is outside [0, V=", vocab,
                     ") and is not ignore_index (", ignore_index, ")");
    }
  }
  return y;
}

std::vector<std::uint8_t> read_valid_targets(Context& ctx, const char* who, const char* name,
                                             const TensorView& targets, std::int64_t vocab,
                                             std::int64_t ignore_index) {
  const std::vector<std::int64_t> y = read_target_ids(ctx, who, name, targets, vocab, ignore_index);
  std::vector<std::uint8_t> valid(y.size());
  for (std::size_t i = 0; i < y.size(); ++i) valid[i] = y[i] != ignore_index;
  return valid;
}

}  // namespace chunkloss::detail
