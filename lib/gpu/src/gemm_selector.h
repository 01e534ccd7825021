// The per-shape GEMM algorithm choice of a gpu::Context (GemmSelection): cuBLAS's own choice, or
// cuBLAS's and cuBLASLt's heuristic candidates timed on the first real calls of a shape.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <compare>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "chunkloss/gpu/context.h"

namespace chunkloss::gpu {

/// One column-major GEMM C = alpha op(A) op(B) + beta C with fp32 accumulation; alpha and beta
/// point to host or device memory (`device_scalars`).
struct GemmCall {
  bool trans_a, trans_b;
  int m, n, k;
  const void* a;
  int lda;
  const void* b;
  int ldb;
  cudaDataType_t ab_type;
  void* c;
  int ldc;
  cudaDataType_t c_type;
  const float* alpha;
  const float* beta;
  bool device_scalars;
};

class GemmSelector {
 public:
  GemmSelector(GemmSelection mode, cublasHandle_t cublas, cudaStream_t stream, void* workspace,
               std::size_t workspace_bytes);
  ~GemmSelector();
  GemmSelector(const GemmSelector&) = delete;
  GemmSelector& operator=(const GemmSelector&) = delete;

  /// Shapes measured at most: a caller whose shapes keep changing (rows that vary every step)
  /// runs the shapes past these with cuBLAS's own choice, unmeasured and unstored, so the table
  /// and the host work per call stay bounded.
  static constexpr std::size_t kMaxShapes = 256;

  /// Enqueues `g` on the stream with the algorithm its shape has (or is measuring).
  void run(const GemmCall& g);
  GemmSelection mode() const { return mode_; }
  int shapes_measuring() const;
  std::string report() const;

 private:
  // What the algorithm choice may depend on; pointer alignments (bytes, up to 256) included.
  struct Key {
    bool trans_a, trans_b;
    int m, n, k, lda, ldb, ldc;
    cudaDataType_t ab_type, c_type;
    int scalars;  // 0: host beta 0, 1: host beta 1, 2: other host beta, 3: device scalars
    int align_a, align_b, align_c;
    auto operator<=>(const Key&) const = default;
  };
  // Candidate 0 is cublasGemmEx's own choice; the others cuBLASLt heuristic results.
  struct Candidate {
    cublasLtMatmulAlgo_t algo{};
    std::string what;
    float best_ms = 0;  // fastest timed call
    int timed = 0, in_flight = 0;
    bool failed = false;
  };
  struct Timing {
    std::size_t candidate;
    cudaEvent_t start, stop;
  };
  struct Shape {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    std::vector<Candidate> candidates;
    std::deque<Timing> pending;
    int chosen = -1;
  };

  static Key key_of(const GemmCall& g);
  Shape& shape_of(const Key& key, const GemmCall& g);
  // Fills s's descriptors and candidates (cuBLASLt's heuristic for the shape).
  void describe(Shape& s, const Key& key, const GemmCall& g);
  static void destroy(Shape& s);  // its descriptors and pending events
  // Reads the finished timings; chooses once every candidate has its timed calls.
  void collect(Shape& s);
  bool launch(const Shape& s, std::size_t candidate, const GemmCall& g);
  void run_gemm_ex(const GemmCall& g) const;
  cudaEvent_t event();

  GemmSelection mode_;
  cublasHandle_t cublas_;
  cudaStream_t stream_;
  void* workspace_;
  std::size_t workspace_bytes_;
  cublasLtHandle_t lt_ = nullptr;
  std::map<Key, Shape> shapes_;
  std::int64_t unmeasured_calls_ = 0;  // calls of shapes past kMaxShapes
  std::vector<cudaEvent_t> free_events_;
};

}  // namespace chunkloss::gpu
