// Communicators for the losses' distributed modes: the interface the engine calls, and an
// in-process group whose ranks are threads of one process (tests, and trainers that drive
// several devices from one process without NCCL). The NCCL communicator is in
// chunkloss/dist/nccl.h (CUDA builds).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "chunkloss/core/context.h"

namespace chunkloss::dist {

/// A group of ranks that make the same sequence of collective calls with the same sizes. Buffers
/// live on the device of the context passed in. On CUDA the calls are enqueued on the context's
/// stream (NCCL) or complete before they return (the in-process group); on the CPU they complete
/// before they return.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// data[0, n) = the sum over the ranks of each rank's data[0, n), equal on every rank.
  virtual void all_reduce_sum(const Context& ctx, float* data, std::int64_t n) = 0;
  virtual void all_reduce_sum(const Context& ctx, double* data, std::int64_t n) = 0;
  /// recv[r * bytes, (r + 1) * bytes) = rank r's send[0, bytes), on every rank.
  virtual void all_gather(const Context& ctx, const void* send, void* recv, std::size_t bytes) = 0;
};

/// `size` ranks in one process, rank r driven by its own thread through comm(r). Sums are taken
/// in rank order in double and rounded once, so they are deterministic and equal on every rank.
/// Device buffers are staged through host memory (the context's stream is synchronised). A rank
/// that stops calling leaves the others waiting: every rank must make every call. A collective
/// that fails on one rank before that rank's buffer is shared (a negative count, a failed copy
/// from its device) aborts the group (see abort()), so the others throw instead of waiting.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int size() const;
  Communicator& comm(int rank);
  /// Ends the group: every rank waiting in a collective, and every later collective, throws
  /// chunkloss::Error. For a driver one of whose ranks failed outside the collectives, which the
  /// others would otherwise wait for forever.
  void abort();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace chunkloss::dist
