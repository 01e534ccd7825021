// Boundary checks shared by the loss objects: each throws chunkloss::Error naming the argument,
// the expected shape and dtype, and what it got.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chunkloss/core/context.h"
#include "chunkloss/core/tensor.h"
#include "chunkloss/core/workspace.h"
#include "chunkloss/losses/plan.h"
#include "chunkloss/losses/vocab_shard.h"

namespace chunkloss::detail {

/// `t` must be defined, on `dev`, with exactly `shape` and one of `dtypes`.
void check_view(const char* who, const char* name, const TensorView& t, Device dev,
                std::initializer_list<std::int64_t> shape, std::initializer_list<DType> dtypes);
/// As check_view when `t` is defined; absent is allowed.
void check_optional(const char* who, const char* name, const TensorView& t, Device dev,
                    std::initializer_list<std::int64_t> shape, std::initializer_list<DType> dtypes);
/// (name, view) pairs of a call's arguments.
using NamedViews = std::initializer_list<std::pair<const char*, const TensorView*>>;
/// The memory of a call: the workspace and every defined device view are on the context's device
/// index (on CUDA, memory of another GPU is an error, not a peer access; host views, which some
/// small inputs may be, are the caller's check_view's business), and no defined view shares a
/// byte with the workspace, nor an output with an input or another output (the call would read
/// what it writes).
void check_memory(const char* who, const Context& ctx, const Workspace& ws, NamedViews inputs,
                  NamedViews outputs);
/// On CUDA, fp32 inputs need fp32 gradient buffers: cuBLAS has no GEMM from fp32 operands to a
/// bf16 result (the CPU rounds its fp32 gradients to bf16 instead).
void check_grad_dtypes(const char* who, Device dev, const TensorView& hidden, NamedViews grads);
/// Every element of a float view is finite (host memory only).
void check_finite(const char* who, const char* name, const TensorView& t);
/// The same for a view in host memory or on the context's device: a device view is counted
/// there in `scalars` (a CUDA plan's scalars slice), which synchronises the stream.
void check_finite(Context& ctx, double* scalars, const char* who, const char* name,
                  const TensorView& t);
/// The whole vocabulary of a call whose weight has `v` rows, split by `shard`: rank r of K must
/// hold rows [size r / K, size (r + 1) / K), and loop_order vocab_block is refused; without a
/// group, offset and size must be 0 (the vocabulary is `v`).
std::int64_t check_vocab_shard(const char* who, const VocabShard& shard, std::int64_t v,
                               const TensorView& weight, LoopOrder order);
/// Targets in [0, V) or equal to ignore_index (host memory only).
void check_targets(const char* who, const TensorView& targets, std::int64_t vocab,
                   std::int64_t ignore_index);
/// A LoopOrder that is one of its enumerators.
void check_loop_order(std::string_view who, LoopOrder order);
/// Class weights finite and >= 0 (host memory only; absent: nothing to check).
void check_class_weights(const char* who, const TensorView& class_weights);
/// The targets (of [N] or [S, T], i32 or i64, in host memory or on the context's device, whose
/// stream is then synchronised) as host values; each must be in [0, V) or ignore_index, else the
/// error names `name` and the element.
std::vector<std::int64_t> read_target_ids(Context& ctx, const char* who, const char* name,
                                          const TensorView& targets, std::int64_t vocab,
                                          std::int64_t ignore_index);
/// Whether each target of read_target_ids() is valid, that is not ignore_index.
std::vector<std::uint8_t> read_valid_targets(Context& ctx, const char* who, const char* name,
                                             const TensorView& targets, std::int64_t vocab,
                                             std::int64_t ignore_index);

}  // namespace chunkloss::detail
