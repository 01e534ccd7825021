// The NCCL communicator: ncclAllReduce (fp32 and fp64 sums) and ncclAllGather (bytes) on the
// context's stream; its own buffer and stream for a rank whose context is elsewhere; abort.
#include "chunkloss/dist/nccl.h"

#include <nccl.h>

#include <cstring>
#include <string>

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

// Makes `device` current for its scope, then restores the caller's device (also after an
// error, whose message names `device`).
class OnDevice {
 public:
  explicit OnDevice(int device) {
    CHUNKLOSS_GPU_CHECK(cudaGetDevice(&previous_));
    CHUNKLOSS_GPU_CHECK(cudaSetDevice(device));
  }
  ~OnDevice() { (void)cudaSetDevice(previous_); }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  int previous_ = 0;
};

// ncclCommInitRank on `device`, after checking the arguments.
void* init_rank(const NcclCommunicator::UniqueId& id, int rank, int size, int device) {
  CHUNKLOSS_CHECK(size >= 1 && rank >= 0 && rank < size, "NcclCommunicator: rank ", rank,
                  " is not in [0, size=", size, ")");
  const int n = gpu::device_count();
  CHUNKLOSS_CHECK(device >= 0 && device < n, "NcclCommunicator: device ", device,
                  " does not exist (", n, " CUDA devices visible)");
  const OnDevice on(device);
  ncclUniqueId uid;
  std::memcpy(&uid, id.data(), sizeof uid);
  ncclComm_t comm = nullptr;
  CHUNKLOSS_GPU_CHECK(ncclCommInitRank(&comm, size, uid, rank));
  return comm;
}

// Whether the context is on the communicator's device.
bool on_device(const Context& ctx, int device) {
  return ctx.device() == Device::kCuda && ctx.device_index() == device;
}

// The context's stream (the context made current).
cudaStream_t stream_of(const Context& ctx) {
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
    // (stream-ordered, so that neither this nor the destructor's free waits for the device,
    // where NCCL work of other communicators may be running)
    const OnDevice on(device_);
    cudaStream_t s = nullptr;
    CHUNKLOSS_GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    own_stream_ = s;
    CHUNKLOSS_GPU_CHECK(cudaMallocAsync(&own_buffer_, kOwnBufferBytes, s));
  } catch (...) {  // the destructor will not run: what was made is freed here
    free_own();
    if (owned_) (void)ncclCommDestroy(as_comm(comm_));
    throw;
  }
}

NcclCommunicator::~NcclCommunicator() {
  free_own();
  if (owned_ && !aborted_.load()) (void)ncclCommDestroy(as_comm(comm_));
}

void NcclCommunicator::free_own() noexcept {
  if (!own_stream_) return;
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device_) != cudaSuccess) return;
  const auto s = static_cast<cudaStream_t>(own_stream_);
  if (own_buffer_) (void)cudaFreeAsync(own_buffer_, s);
  (void)cudaStreamDestroy(s);
  (void)cudaSetDevice(previous);
}

std::string NcclCommunicator::async_error() const {
  if (aborted_.load()) return {};
  ncclResult_t r = ncclSuccess;
  const ncclResult_t q = ncclCommGetAsyncError(as_comm(comm_), &r);
  if (q != ncclSuccess) r = q;
  if (r == ncclSuccess || r == ncclInProgress) return {};
  return "NcclCommunicator (rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
         ", cuda device " + std::to_string(device_) + "): " + ncclGetErrorString(r);
}

void NcclCommunicator::abort() {
  if (aborted_.exchange(true)) return;
  (void)ncclCommAbort(as_comm(comm_));
}

void NcclCommunicator::check_live(const char* what) const {
  CHUNKLOSS_CHECK(!aborted_.load(), "NcclCommunicator::", what, ": the communicator (rank ", rank_,
                  " of ", size_, ") was aborted");
}

template <typename Enqueue>
void NcclCommunicator::take_part_and_throw(const Context& ctx, const char* what, std::size_t bytes,
                                           Enqueue enqueue) {
  bool took_part = false;
  std::string trouble;  // what failed on the way, if anything
  if (bytes <= kOwnBufferBytes) {
    try {
      const OnDevice on(device_);
      const auto s = static_cast<cudaStream_t>(own_stream_);
      CHUNKLOSS_GPU_CHECK(cudaMemsetAsync(own_buffer_, 0xFF, bytes, s));
      CHUNKLOSS_GPU_CHECK(enqueue(static_cast<unsigned char*>(own_buffer_), s));
      took_part = true;
      CHUNKLOSS_GPU_CHECK(cudaStreamSynchronize(s));
    } catch (const Error& e) {
      trouble = std::string(" (") + e.what() + ")";
    }
  }
  CHUNKLOSS_FAIL("NcclCommunicator::", what, ": the communicator is on cuda device ", device_,
                 ", the context on ", device_name(ctx.device()), " device ", ctx.device_index(),
                 took_part ? "; this rank took part with NaN values, which the other ranks receive"
                           : "; this rank did not take part, and the other ranks wait for it",
                 trouble);
}

void NcclCommunicator::sum(const Context& ctx, void* data, std::int64_t n, std::size_t elem_bytes,
                           int nccl_type) {
  check_live("all_reduce_sum");
  CHUNKLOSS_CHECK(n >= 0, "NcclCommunicator::all_reduce_sum: n=", n, " < 0");
  const auto count = static_cast<std::size_t>(n);
  const auto enqueue = [&](void* buf, cudaStream_t s) {
    return ncclAllReduce(buf, buf, count, static_cast<ncclDataType_t>(nccl_type), ncclSum,
                         as_comm(comm_), s);
  };
  if (!on_device(ctx, device_))
    take_part_and_throw(ctx, "all_reduce_sum", count * elem_bytes, enqueue);
  CHUNKLOSS_GPU_CHECK(enqueue(data, stream_of(ctx)));
}

void NcclCommunicator::all_reduce_sum(const Context& ctx, float* data, std::int64_t n) {
  sum(ctx, data, n, sizeof(float), ncclFloat);
}

void NcclCommunicator::all_reduce_sum(const Context& ctx, double* data, std::int64_t n) {
  sum(ctx, data, n, sizeof(double), ncclDouble);
}

void NcclCommunicator::all_gather(const Context& ctx, const void* send, void* recv,
                                  std::size_t bytes) {
  check_live("all_gather");
  const auto enqueue = [&](const void* from, void* to, cudaStream_t s) {
    return ncclAllGather(from, to, bytes, ncclUint8, as_comm(comm_), s);
  };
  if (!on_device(ctx, device_))  // (in place: this rank's part of the result is its send)
    take_part_and_throw(ctx, "all_gather", bytes * static_cast<std::size_t>(size_),
                        [&](unsigned char* b, cudaStream_t s) {
                          return enqueue(b + bytes * static_cast<std::size_t>(rank_), b, s);
                        });
  CHUNKLOSS_GPU_CHECK(enqueue(send, recv, stream_of(ctx)));
}

}  // namespace chunkloss::dist
