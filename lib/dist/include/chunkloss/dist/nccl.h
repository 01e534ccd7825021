// The NCCL communicator (CUDA builds): collectives enqueued on the calling context's stream,
// no host synchronisation. No NCCL or CUDA header is included here.
#pragma once

#include <array>
#include <memory>
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

  void all_reduce_sum(const Context& ctx, float* data, std::int64_t n) override;
  void all_reduce_sum(const Context& ctx, double* data, std::int64_t n) override;
  void all_gather(const Context& ctx, const void* send, void* recv, std::size_t bytes) override;

 private:
  NcclCommunicator(void* nccl_comm, bool owned);
  void* comm_;
  bool owned_;
  int rank_ = 0, size_ = 1, device_ = 0;
};

}  // namespace chunkloss::dist
