// The CUDA execution context: one device, one stream and a cuBLAS handle with its workspace (and a
// side stream with its own), owned explicitly by the caller (no hidden globals). No CUDA header is
// included here.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "chunkloss/core/context.h"

namespace chunkloss::gpu {

/// How a context picks the cuBLAS algorithm of each GEMM shape it runs.
enum class GemmSelection {
  /// cuBLAS's own choice (cublasGemmEx): the same algorithm, and so the same bits, in every run
  /// and process.
  kDefault,
  /// Measured: the first calls of each shape (operand layouts, leading dimensions, alignments,
  /// dtypes, scalar mode) run cuBLAS's own choice and up to 8 cuBLASLt heuristic candidates in
  /// turn, two timed calls each (CUDA events, read later without waiting); from then on the
  /// fastest serves that shape for the context's life. Every call computes the full GEMM with
  /// fp32 accumulation (split-K only with fp32 partial sums), so results stay exact, but their
  /// bits may differ between calls made while a shape is still being measured, and between
  /// processes. The opt-in speed mode, in the spirit of cudnn.benchmark. While the stream is
  /// being captured into a CUDA graph, unmeasured shapes run cuBLAS's own choice, untimed. At
  /// most 256 shapes a stream are measured (and kept); further shapes run cuBLAS's own choice.
  kMeasured,
};

class GemmSelector;  // internal (lib/gpu/src/gemm_selector.h)

/// A CUDA context. Streams are passed as void* (a cudaStream_t); with `stream == nullptr` the
/// context creates and owns a non-blocking stream. Work is enqueued on the stream (and on the
/// side, see side(), joined back into the stream before a loss call returns); calls of the loss
/// objects synchronise the stream once at the end to copy the scalar results to the host.
/// Throws chunkloss::Error when the device does not exist or CUDA/cuBLAS fail.
class Context final : public chunkloss::Context {
 public:
  explicit Context(int device = 0, void* stream = nullptr,
                   GemmSelection gemm_selection = GemmSelection::kDefault);
  ~Context() override;
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  Device device() const override { return Device::kCuda; }
  int device_index() const override;
  /// The cudaStream_t all work runs on.
  void* stream() const;
  /// The cublasHandle_t bound to the stream.
  void* cublas() const;
  /// Makes this context's device current on the calling thread.
  void activate() const;
  /// Waits for all work on the stream.
  void synchronize() const;

  GemmSelection gemm_selection() const;
  /// GemmSelection::kMeasured: the number of GEMM shapes seen whose algorithm is not chosen yet
  /// (a shape is decided at its next call once its timed calls have finished); 0 otherwise. The
  /// side's shapes included.
  int gemm_shapes_measuring() const;
  /// One line per GEMM shape seen under kMeasured: the shape, the algorithm serving it and the
  /// measured times (empty under kDefault); the stream's shapes, then the side's ("side: ").
  std::string gemm_report() const;
  /// The selector gpu::gemm runs its calls through (internal).
  GemmSelector& gemm_selector() const;
  /// Bytes of scratch().
  static constexpr std::size_t kScratchBytes = std::size_t{1} << 20;
  /// kScratchBytes of device memory in the stream's order, through which the loss objects sum
  /// host values over a group of ranks (internal): the start of the stream's cuBLAS workspace,
  /// which a GEMM uses only while it runs on the stream.
  void* scratch() const;

  /// The side: a second non-blocking stream on the same device, with a cuBLAS handle, workspace
  /// (32 MiB) and GEMM selection of its own, made with this context. Its work runs beside the
  /// stream's: the loss objects run each chunk's weight-gradient GEMM there, beside the chunk's
  /// hidden-gradient GEMM, between a fork() and a join(). Under kMeasured the side's GEMMs are
  /// timed while the stream's run beside them. The side's own side() is itself, and its fork()
  /// and join() do nothing.
  const Context& side() const;
  /// Work enqueued on the side from now on waits for the work enqueued on the stream so far.
  void fork() const;
  /// Work enqueued on the stream from now on waits for the work enqueued on the side so far.
  void join() const;

 private:
  // The stream, handle, workspace and selector, without a side (the bool tells it apart).
  Context(int device, void* stream, GemmSelection gemm_selection, bool);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Number of CUDA devices (0 when the driver or the device is missing; never throws).
int device_count();

/// Owning device allocation (cudaMalloc/cudaFree) for tests, benchmarks and trainers.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Synchronous copies between host and device memory: copy_to_device returns once `dst` holds
/// the data (work on any stream may read it), copy_to_host once `dst` does. copy_to_host does not
/// wait for work still running on a context's stream: synchronise that first.
void copy_to_device(void* dst, const void* src, std::size_t bytes);
void copy_to_host(void* dst, const void* src, std::size_t bytes);
/// Free and total device memory in bytes (cudaMemGetInfo) of the current device.
void memory_info(std::size_t* free_bytes, std::size_t* total_bytes);

}  // namespace chunkloss::gpu
