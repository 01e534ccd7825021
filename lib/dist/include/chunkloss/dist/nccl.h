// The NCCL communicator (CUDA builds): collectives enqueued on the calling context's stream,
// no host synchronisation. No NCCL or CUDA header is included here.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "chunkloss/dist/communicator.h"

namespace chunkloss::dist {

class NcclCommunicator final : public Communicator {
 public:
  /// One communicator per device of `devices` (distinct CUDA device indices), for one process
  /// that drives them all, each from its own thread (ncclCommInitAll). Rank i is devices[i].
  static std::vector<std::unique_ptr<NcclCommunicator>> create_all(const std::vector<int>& devices);
  /// The bytes of an ncclUniqueId. For one process per GPU: one process makes it, sends it to
  /// every rank (over MPI, a file, a socket: your launcher's way) and each rank then constructs
  /// NcclCommunicator(id, rank, size, device).
  using UniqueId = std::array<char, 128>;
  static UniqueId unique_id();
  /// Rank `rank` of `size` on CUDA device `device` (ncclCommInitRank; it waits for every rank).
  NcclCommunicator(const UniqueId& id, int rank, int size, int device);
  /// Wraps a trainer's ncclComm_t (passed as void*), which it keeps owning.
  explicit NcclCommunicator(void* nccl_comm);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  /// The CUDA device the communicator was created on.
  int device() const { return device_; }
  /// The ncclComm_t.
  void* handle() const { return comm_; }

  /// The collectives, enqueued on the context's stream. A context that is not on the
  /// communicator's device (or a CPU context) is an error; the rank still takes part in the
  /// collective first, with every byte 0xFF (NaN) from a buffer of the communicator's own, so
  /// the other ranks get NaN sums instead of waiting for it (the loss objects' first exchange
  /// then throws on every rank). That needs the collective's result to fit kOwnBufferBytes.
  void all_reduce_sum(const Context& ctx, float* data, std::int64_t n) override;
  void all_reduce_sum(const Context& ctx, double* data, std::int64_t n) override;
  void all_gather(const Context& ctx, const void* send, void* recv, std::size_t bytes) override;

  /// Bytes of the buffer on the communicator's device through which a rank with a context on
  /// another device takes part in a collective (above).
  static constexpr std::size_t kOwnBufferBytes = std::size_t{64} << 10;

  /// NCCL's asynchronous error on the communicator (ncclCommGetAsyncError), as a message naming
  /// the rank; empty while there is none, and after abort(). For a watchdog thread, which may
  /// call it while the rank's own thread waits in a collective (and calls abort() itself).
  std::string async_error() const;
  /// Aborts the communicator (ncclCommAbort): the rank's NCCL work in flight ends without
  /// completing, so its streams stop waiting for a peer that failed or left, and every later
  /// collective on this object throws chunkloss::Error. For a watchdog thread, while the rank's
  /// own thread waits on its stream (a synchronisation or an event query: where a rank waiting
  /// for a peer waits, the collectives themselves only enqueue). Not while that thread is inside
  /// one of this object's calls: NCCL's calls on one communicator must not overlap. The data its
  /// collectives were writing is unspecified. An owned communicator is freed by the abort; a
  /// wrapped ncclComm_t is aborted too, and its owner must neither use nor destroy it
  /// afterwards. Calling it again does nothing.
  void abort();
  bool aborted() const { return aborted_.load(); }

 private:
  NcclCommunicator(void* nccl_comm, bool owned);
  // Throws when aborted.
  void check_live(const char* what) const;
  // Frees the own buffer and stream, on device_ (made current for it).
  void free_own() noexcept;
  // all_reduce_sum of n values of elem_bytes, of ncclDataType_t nccl_type.
  void sum(const Context& ctx, void* data, std::int64_t n, std::size_t elem_bytes, int nccl_type);
  // Takes part in a collective whose result has `bytes` with the own buffer filled with 0xFF
  // (the caller's context is on another device), then throws naming it.
  template <typename Enqueue>
  [[noreturn]] void take_part_and_throw(const Context& ctx, const char* what, std::size_t bytes,
                                        Enqueue enqueue);
  void* comm_;
  bool owned_;
  int rank_ = 0, size_ = 1, device_ = 0;
  void* own_stream_ = nullptr;  // a cudaStream_t on device_
  void* own_buffer_ = nullptr;  // kOwnBufferBytes on device_, stream-ordered on own_stream_
  std::atomic<bool> aborted_{false};
};

}  // namespace chunkloss::dist
