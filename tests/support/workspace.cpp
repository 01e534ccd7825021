// Aligned workspace blocks for tests.
#include "support/workspace.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace chunkloss::test {

AlignedBuffer::AlignedBuffer(std::size_t bytes, unsigned char fill) : bytes_(bytes) {
  // aligned_alloc wants a size that is a multiple of the alignment, and a non-zero one.
  const std::size_t padded =
      (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
  data_ = std::aligned_alloc(kWorkspaceAlignment, padded ? padded : kWorkspaceAlignment);
  if (!data_) throw std::bad_alloc();
  std::memset(data_, fill, padded ? padded : kWorkspaceAlignment);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

CrossEntropyResult run_with_fresh_workspace(const LinearCrossEntropy& loss, Context& ctx,
                                            const CrossEntropyInputs& in,
                                            const CrossEntropyGrads& grads,
                                            const CrossEntropyOutputs& out) {
  AlignedBuffer ws(loss.workspace_bytes(in, grads));
  return loss.forward_backward(ctx, in, grads, out, ws.workspace());
}

}  // namespace chunkloss::test
