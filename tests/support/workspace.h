// Aligned host memory for workspaces (RAII), and a helper that runs a LinearCrossEntropy call
// with a fresh workspace of exactly workspace_bytes(), pre-filled with NaN bytes so a read of
// workspace memory the library never wrote shows up in the results; and the check of one call's
// scalar results against another's.
#pragma once

#include <chunkloss/core/workspace.h>
#include <chunkloss/losses/cross_entropy.h>

#include <cstddef>

namespace chunkloss::test {

/// A block from std::aligned_alloc, kWorkspaceAlignment-aligned, freed on destruction.
/// `bytes` may be 0 (still a valid, aligned, non-null pointer). Every byte is set to `fill`.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(std::size_t bytes, unsigned char fill = 0xff);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  /// A host Workspace over the first `bytes()` bytes.
  Workspace workspace() const { return Workspace(data_, bytes_); }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Runs loss.forward_backward with a fresh NaN-filled workspace of exactly
/// loss.workspace_bytes(in, grads) bytes.
CrossEntropyResult run_with_fresh_workspace(const LinearCrossEntropy& loss, Context& ctx,
                                            const CrossEntropyInputs& in,
                                            const CrossEntropyGrads& grads,
                                            const CrossEntropyOutputs& out);

/// CHECKs one call's scalar results against another's: loss, z-loss and entropy to `tol`
/// (check_scalar), accuracy to 1e-12, the valid rows exactly, the mean's divisor to 1e-6.
void check_results(const CrossEntropyResult& got, const CrossEntropyResult& want, double tol);

}  // namespace chunkloss::test
