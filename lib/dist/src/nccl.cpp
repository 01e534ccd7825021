// The NCCL communicator: ncclAllReduce (fp32 sum) and ncclAllGather (bytes) on the context's
// stream.
#include "chunkloss/dist/nccl.h"

#include <nccl.h>

#include <cstring>

#include "chunkloss/gpu/check.h"
#include "chunkloss/gpu/context.h"

namespace chunkloss::gpu::detail {
inline const char* status_string(ncclResult_t r) { return ncclGetErrorString(r); }
inline bool status_ok(ncclResult_t r) { return r == ncclSuccess; }
}  // namespace chunkloss::gpu::detail

namespace chunkloss::dist {

namespace {

ncclComm_t as_comm(void* c) { return static_cast<ncclComm_t>(c); }

static_assert(sizeof(ncclUniqueId) == sizeof(NcclCommunicator::UniqueId));

// ncclCommInitRank on `device`, after checking the arguments.
void* init_rank(const NcclCommunicator::UniqueId& id, int rank, int size, int device) {
  CHUNKLOSS_CHECK(size >= 1 && rank >= 0 && rank < size, "NcclCommunicator: rank ", rank,
                  " is not in [0, size=", size, ")");
  const int n = gpu::device_count();
  CHUNKLOSS_CHECK(device >= 0 && device < n, "NcclCommunicator: device ", device,
                  " does not exist (", n, " CUDA devices visible)");
  struct Restore {  // the caller's device stays current, after an error's message names `device`
    int previous = -1;
    ~Restore() {
      if (previous >= 0) (void)cudaSetDevice(previous);
    }
  } restore;
  CHUNKLOSS_GPU_CHECK(cudaGetDevice(&restore.previous));
  CHUNKLOSS_GPU_CHECK(cudaSetDevice(device));
  ncclUniqueId uid;
  std::memcpy(&uid, id.data(), sizeof uid);
  ncclComm_t comm = nullptr;
  CHUNKLOSS_GPU_CHECK(ncclCommInitRank(&comm, size, uid, rank));
  return comm;
}

// The context's stream, after checking that the context is on the communicator's device.
cudaStream_t stream_of(const Context& ctx, int device, const char* what) {
  CHUNKLOSS_CHECK(ctx.device() == Device::kCuda && ctx.device_index() == device,
                  "NcclCommunicator::", what, ": the communicator is on cuda device ", device,
                  ", the context on ", device_name(ctx.device()), " device ", ctx.device_index());
  const auto& g = static_cast<const gpu::Context&>(ctx);
  g.activate();
  return static_cast<cudaStream_t>(g.stream());
}

}  // namespace

std::vector<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create_all(
    const std::vector<int>& devices) {
  CHUNKLOSS_CHECK(!devices.empty(), "NcclCommunicator::create_all: no devices");
  const int n = gpu::device_count();
  for (std::size_t i = 0; i < devices.size(); ++i) {
    CHUNKLOSS_CHECK(devices[i] >= 0 && devices[i] < n, "NcclCommunicator::create_all: device ",
                    devices[i], " does not exist (", n, " CUDA devices visible)");
    for (std::size_t j = 0; j < i; ++j)
      CHUNKLOSS_CHECK(devices[i] != devices[j], "NcclCommunicator::create_all: device ", devices[i],
                      " is listed twice");
  }
  std::vector<ncclComm_t> comms(devices.size());
  CHUNKLOSS_GPU_CHECK(
      ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()));
  std::vector<std::unique_ptr<NcclCommunicator>> out;
  std::size_t i = 0;
  try {
    out.reserve(comms.size());
    for (; i < comms.size(); ++i) {  // owning only once it is in `out`
      out.emplace_back(new NcclCommunicator(comms[i], false));
      out.back()->owned_ = true;
    }
  } catch (...) {  // the communicators no object owns yet
    for (std::size_t j = i; j < comms.size(); ++j) (void)ncclCommDestroy(comms[j]);
    throw;
  }
  return out;
}

NcclCommunicator::UniqueId NcclCommunicator::unique_id() {
  ncclUniqueId uid;
  CHUNKLOSS_GPU_CHECK(ncclGetUniqueId(&uid));
  UniqueId id;
  std::memcpy(id.data(), &uid, sizeof uid);
  return id;
}

NcclCommunicator::NcclCommunicator(const UniqueId& id, int rank, int size, int device)
    : NcclCommunicator(init_rank(id, rank, size, device), true) {}

NcclCommunicator::NcclCommunicator(void* nccl_comm) : NcclCommunicator(nccl_comm, false) {}

NcclCommunicator::NcclCommunicator(void* nccl_comm, bool owned) : comm_(nccl_comm), owned_(owned) {
  CHUNKLOSS_CHECK(comm_ != nullptr, "NcclCommunicator: null ncclComm_t");
  try {
    CHUNKLOSS_GPU_CHECK(ncclCommUserRank(as_comm(comm_), &rank_));
    CHUNKLOSS_GPU_CHECK(ncclCommCount(as_comm(comm_), &size_));
    CHUNKLOSS_GPU_CHECK(ncclCommCuDevice(as_comm(comm_), &device_));
  } catch (...) {  // the destructor will not run: an owned communicator is destroyed here
    if (owned_) (void)ncclCommDestroy(as_comm(comm_));
    throw;
  }
}

NcclCommunicator::~NcclCommunicator() {
  if (owned_) (void)ncclCommDestroy(as_comm(comm_));
}

void NcclCommunicator::all_reduce_sum(const Context& ctx, float* data, std::int64_t n) {
  const cudaStream_t s = stream_of(ctx, device_, "all_reduce_sum");
  CHUNKLOSS_GPU_CHECK(ncclAllReduce(data, data, static_cast<std::size_t>(n), ncclFloat, ncclSum,
                                    as_comm(comm_), s));
}

void NcclCommunicator::all_reduce_sum(const Context& ctx, double* data, std::int64_t n) {
  const cudaStream_t s = stream_of(ctx, device_, "all_reduce_sum");
  CHUNKLOSS_GPU_CHECK(ncclAllReduce(data, data, static_cast<std::size_t>(n), ncclDouble, ncclSum,
                                    as_comm(comm_), s));
}

void NcclCommunicator::all_gather(const Context& ctx, const void* send, void* recv,
                                  std::size_t bytes) {
  const cudaStream_t s = stream_of(ctx, device_, "all_gather");
  CHUNKLOSS_GPU_CHECK(ncclAllGather(send, recv, bytes, ncclUint8, as_comm(comm_), s));
}

}  // namespace chunkloss::dist
