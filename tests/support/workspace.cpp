// Aligned workspace blocks for tests, and the check of a call's scalar results.
#include "support/workspace.h"

#include <doctest/doctest.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "support/compare.h"

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

void check_results(const CrossEntropyResult& got, const CrossEntropyResult& want, double tol) {
  check_scalar("loss", got.loss, want.loss, tol);
  check_scalar("z_loss", got.z_loss, want.z_loss, tol);
  check_scalar("accuracy", got.accuracy, want.accuracy, 1e-12);
  check_scalar("entropy", got.entropy, want.entropy, tol);
  CHECK(got.valid_rows == want.valid_rows);
  check_scalar("weight_sum", got.weight_sum, want.weight_sum, 1e-6);
}

}  // namespace chunkloss::test
