// The CUDA context (device, stream, cuBLAS handle and workspace, and its side) and device buffers.
#include "chunkloss/gpu/context.h"

#include <sstream>

#include "chunkloss/gpu/check.h"
#include "gemm_selector.h"

namespace chunkloss::gpu {

namespace {
constexpr std::size_t kCublasWorkspace = std::size_t{32} << 20;  // Hopper guidance: 32 MiB
}

struct Context::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  bool owns_stream = false;
  cublasHandle_t cublas = nullptr;
  void* cublas_ws = nullptr;
  std::unique_ptr<GemmSelector> selector;
  // The side and the events that order it with the stream (none on the side itself).
  std::unique_ptr<Context> side;
  cudaEvent_t forked = nullptr, joined = nullptr;

  // Releases what was made so far, also when a constructor threw midway (the Impl is then
  // destroyed as a member, the Context's destructor not run).
  ~Impl() {
    if (!stream && !cublas && !cublas_ws && !side) return;  // refused before making anything
    (void)cudaSetDevice(device);
    if (side) (void)cudaStreamSynchronize(side->impl_->stream);
    if (forked) (void)cudaEventDestroy(forked);
    if (joined) (void)cudaEventDestroy(joined);
    side.reset();
    if (stream) (void)cudaStreamSynchronize(stream);
    selector.reset();
    if (cublas) (void)cublasDestroy(cublas);
    if (cublas_ws) (void)cudaFree(cublas_ws);
    if (owns_stream) (void)cudaStreamDestroy(stream);
  }
};

// The side is made once the stream's context is complete; a failure anywhere releases what was
// made (Impl's destructor).
Context::Context(int device, void* stream, GemmSelection gemm_selection)
    : Context(device, stream, gemm_selection, false) {
  impl_->side.reset(new Context(device, nullptr, gemm_selection, false));
  CHUNKLOSS_GPU_CHECK(cudaEventCreateWithFlags(&impl_->forked, cudaEventDisableTiming));
  CHUNKLOSS_GPU_CHECK(cudaEventCreateWithFlags(&impl_->joined, cudaEventDisableTiming));
}

Context::Context(int device, void* stream, GemmSelection gemm_selection, bool)
    : impl_(std::make_unique<Impl>()) {
  const int n = device_count();
  CHUNKLOSS_CHECK(device >= 0 && device < n, "gpu::Context: device ", device, " does not exist (",
                  n, " CUDA devices visible)");
  impl_->device = device;
  CHUNKLOSS_GPU_CHECK(cudaSetDevice(device));
  if (stream) {
    impl_->stream = static_cast<cudaStream_t>(stream);
  } else {
    CHUNKLOSS_GPU_CHECK(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking));
    impl_->owns_stream = true;
  }
  CHUNKLOSS_GPU_CHECK(cublasCreate(&impl_->cublas));
  CHUNKLOSS_GPU_CHECK(cublasSetStream(impl_->cublas, impl_->stream));
  CHUNKLOSS_GPU_CHECK(cudaMalloc(&impl_->cublas_ws, kCublasWorkspace));
  CHUNKLOSS_GPU_CHECK(cublasSetWorkspace(impl_->cublas, impl_->cublas_ws, kCublasWorkspace));
  impl_->selector = std::make_unique<GemmSelector>(gemm_selection, impl_->cublas, impl_->stream,
                                                   impl_->cublas_ws, kCublasWorkspace);
}

Context::~Context() = default;

int Context::device_index() const { return impl_->device; }
void* Context::stream() const { return impl_->stream; }
void* Context::cublas() const { return impl_->cublas; }
void Context::activate() const { CHUNKLOSS_GPU_CHECK(cudaSetDevice(impl_->device)); }
void Context::synchronize() const { CHUNKLOSS_GPU_CHECK(cudaStreamSynchronize(impl_->stream)); }
GemmSelection Context::gemm_selection() const { return impl_->selector->mode(); }
int Context::gemm_shapes_measuring() const {
  return impl_->selector->shapes_measuring() +
         (impl_->side ? impl_->side->gemm_shapes_measuring() : 0);
}
std::string Context::gemm_report() const {
  std::string r = impl_->selector->report();
  if (!impl_->side) return r;
  std::istringstream side(impl_->side->gemm_report());
  for (std::string line; std::getline(side, line);) r += "side: " + line + "\n";
  return r;
}
GemmSelector& Context::gemm_selector() const { return *impl_->selector; }

static_assert(Context::kScratchBytes <= kCublasWorkspace);
void* Context::scratch() const { return impl_->cublas_ws; }
const Context& Context::side() const { return impl_->side ? *impl_->side : *this; }

void Context::fork() const {
  if (!impl_->side) return;
  CHUNKLOSS_GPU_CHECK(cudaEventRecord(impl_->forked, impl_->stream));
  CHUNKLOSS_GPU_CHECK(cudaStreamWaitEvent(impl_->side->impl_->stream, impl_->forked));
}

void Context::join() const {
  if (!impl_->side) return;
  CHUNKLOSS_GPU_CHECK(cudaEventRecord(impl_->joined, impl_->side->impl_->stream));
  CHUNKLOSS_GPU_CHECK(cudaStreamWaitEvent(impl_->stream, impl_->joined));
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

DeviceBuffer::DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes) CHUNKLOSS_GPU_CHECK(cudaMalloc(&ptr_, bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) (void)cudaFree(ptr_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) (void)cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void copy_to_device(void* dst, const void* src, std::size_t bytes) {
  CHUNKLOSS_GPU_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  // From pageable memory cudaMemcpy returns once the data is staged; the DMA into `dst` finishes
  // later on the default stream, which the contexts' non-blocking streams do not wait for.
  CHUNKLOSS_GPU_CHECK(cudaStreamSynchronize(nullptr));
}

void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  CHUNKLOSS_GPU_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void memory_info(std::size_t* free_bytes, std::size_t* total_bytes) {
  CHUNKLOSS_GPU_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
}

}  // namespace chunkloss::gpu
