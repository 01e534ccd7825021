// GemmSelection::kMeasured times each candidate on real calls of the shape: every timed call is
// the caller's GEMM itself, so measuring needs no scratch buffers and overwrites nothing.
#include "gemm_selector.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>

#include "chunkloss/gpu/check.h"

namespace chunkloss::gpu {
namespace {

constexpr int kHeuristics = 8;  // cuBLASLt candidates asked for
constexpr int kTimedCalls = 2;  // timed calls per candidate before the choice

int alignment(const void* p) {
  const auto v = reinterpret_cast<std::uintptr_t>(p);
  int a = 1;
  while (a < 256 && v % (2 * static_cast<std::uintptr_t>(a)) == 0) a *= 2;
  return a;
}

const char* type_name(cudaDataType_t t) { return t == CUDA_R_32F ? "f32" : "bf16"; }

template <typename T>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, T value) {
  CHUNKLOSS_GPU_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof value));
}

template <typename T>
void set_pref(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr, T value) {
  CHUNKLOSS_GPU_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attr, &value, sizeof value));
}

int algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  int value = 0;
  std::size_t written = 0;
  CHUNKLOSS_GPU_CHECK(
      cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof value, &written));
  return value;
}

}  // namespace

GemmSelector::GemmSelector(GemmSelection mode, cublasHandle_t cublas, cudaStream_t stream,
                           void* workspace, std::size_t workspace_bytes)
    : mode_(mode),
      cublas_(cublas),
      stream_(stream),
      workspace_(workspace),
      workspace_bytes_(workspace_bytes) {
  if (mode_ == GemmSelection::kMeasured) CHUNKLOSS_GPU_CHECK(cublasLtCreate(&lt_));
}

// The owning context has synchronised its stream: every recorded event has completed.
GemmSelector::~GemmSelector() {
  for (auto& [key, s] : shapes_) destroy(s);
  for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
  if (lt_) (void)cublasLtDestroy(lt_);
}

void GemmSelector::destroy(Shape& s) {
  for (const Timing& t : s.pending) {
    (void)cudaEventDestroy(t.start);
    (void)cudaEventDestroy(t.stop);
  }
  if (s.la) (void)cublasLtMatrixLayoutDestroy(s.la);
  if (s.lb) (void)cublasLtMatrixLayoutDestroy(s.lb);
  if (s.lc) (void)cublasLtMatrixLayoutDestroy(s.lc);
  if (s.desc) (void)cublasLtMatmulDescDestroy(s.desc);
}

void GemmSelector::run(const GemmCall& g) {
  if (mode_ == GemmSelection::kDefault) {
    run_gemm_ex(g);
    return;
  }
  const Key key = key_of(g);
  if (shapes_.size() >= kMaxShapes && !shapes_.count(key)) {
    ++unmeasured_calls_;
    run_gemm_ex(g);
    return;
  }
  Shape& s = shape_of(key, g);
  if (s.chosen < 0) {
    // A captured stream's events may be neither timed nor queried: cuBLAS's own choice, untimed.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CHUNKLOSS_GPU_CHECK(cudaStreamIsCapturing(stream_, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      run_gemm_ex(g);
      return;
    }
    collect(s);
  }
  if (s.chosen >= 0) {
    if (!launch(s, static_cast<std::size_t>(s.chosen), g)) run_gemm_ex(g);
    return;
  }
  // The candidate with the fewest timed and pending calls (cuBLAS's own choice first on ties).
  std::size_t next = 0;
  int fewest = -1;
  for (std::size_t i = 0; i < s.candidates.size(); ++i) {
    const Candidate& c = s.candidates[i];
    if (c.failed) continue;
    if (fewest < 0 || c.timed + c.in_flight < fewest) {
      next = i;
      fewest = c.timed + c.in_flight;
    }
  }
  Timing t{next, event(), nullptr};
  const auto release = [&] {
    for (cudaEvent_t e : {t.start, t.stop})
      if (e) free_events_.push_back(e);
  };
  bool launched = false;
  try {
    t.stop = event();
    CHUNKLOSS_GPU_CHECK(cudaEventRecord(t.start, stream_));
    launched = launch(s, next, g);
    if (launched) CHUNKLOSS_GPU_CHECK(cudaEventRecord(t.stop, stream_));
  } catch (...) {
    release();
    throw;
  }
  if (!launched) {
    s.candidates[next].failed = true;
    release();
    run_gemm_ex(g);
    return;
  }
  ++s.candidates[next].in_flight;
  s.pending.push_back(t);
}

int GemmSelector::shapes_measuring() const {
  return static_cast<int>(std::count_if(shapes_.begin(), shapes_.end(),
                                        [](const auto& e) { return e.second.chosen < 0; }));
}

std::string GemmSelector::report() const {
  std::ostringstream os;
  for (const auto& [k, s] : shapes_) {
    os << "C[" << k.m << ", " << k.n << "] = " << (k.trans_a ? "A^T" : "A") << " "
       << (k.trans_b ? "B^T" : "B") << ", K " << k.k << ", ld " << k.lda << "/" << k.ldb << "/"
       << k.ldc << ", " << type_name(k.ab_type) << " -> " << type_name(k.c_type) << ", "
       << (k.scalars == 3   ? "device scalars"
           : k.scalars == 0 ? "beta 0"
           : k.scalars == 1 ? "beta 1"
                            : "host beta")
       << " (column-major): ";
    if (s.chosen < 0) {
      os << "measuring\n";
      continue;
    }
    const Candidate& c = s.candidates[static_cast<std::size_t>(s.chosen)];
    os << c.what << " " << c.best_ms << " ms";
    if (s.chosen != 0) os << "; cuBLAS's own choice " << s.candidates[0].best_ms << " ms";
    os << " (" << s.candidates.size() << " candidates, "
       << std::count_if(s.candidates.begin(), s.candidates.end(),
                        [](const Candidate& x) { return x.failed; })
       << " failed to launch)\n";
  }
  if (unmeasured_calls_)
    os << unmeasured_calls_ << " calls of shapes past the first " << kMaxShapes
       << " ran cuBLAS's own choice, unmeasured\n";
  return os.str();
}

GemmSelector::Key GemmSelector::key_of(const GemmCall& g) {
  const int scalars = g.device_scalars ? 3 : *g.beta == 0.0f ? 0 : *g.beta == 1.0f ? 1 : 2;
  return {g.trans_a,      g.trans_b,     g.m,       g.n,      g.k,     g.lda,
          g.ldb,          g.ldc,         g.ab_type, g.c_type, scalars, alignment(g.a),
          alignment(g.b), alignment(g.c)};
}

GemmSelector::Shape& GemmSelector::shape_of(const Key& key, const GemmCall& g) {
  const auto found = shapes_.find(key);
  if (found != shapes_.end()) return found->second;
  Shape s;  // kept only once complete
  try {
    describe(s, key, g);
  } catch (...) {
    destroy(s);
    throw;
  }
  return shapes_.emplace(key, std::move(s)).first->second;
}

void GemmSelector::describe(Shape& s, const Key& key, const GemmCall& g) {
  CHUNKLOSS_GPU_CHECK(cublasLtMatmulDescCreate(&s.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_desc(s.desc, CUBLASLT_MATMUL_DESC_TRANSA, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_desc(s.desc, CUBLASLT_MATMUL_DESC_TRANSB, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_desc(s.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE,
           g.device_scalars ? CUBLASLT_POINTER_MODE_DEVICE : CUBLASLT_POINTER_MODE_HOST);
  CHUNKLOSS_GPU_CHECK(cublasLtMatrixLayoutCreate(&s.la, g.ab_type, g.trans_a ? g.k : g.m,
                                                 g.trans_a ? g.m : g.k, g.lda));
  CHUNKLOSS_GPU_CHECK(cublasLtMatrixLayoutCreate(&s.lb, g.ab_type, g.trans_b ? g.n : g.k,
                                                 g.trans_b ? g.k : g.n, g.ldb));
  CHUNKLOSS_GPU_CHECK(cublasLtMatrixLayoutCreate(&s.lc, g.c_type, g.m, g.n, g.ldc));
  cublasLtMatmulPreference_t raw = nullptr;
  CHUNKLOSS_GPU_CHECK(cublasLtMatmulPreferenceCreate(&raw));
  const std::unique_ptr<cublasLtMatmulPreferenceOpaque_t,
                        decltype(&cublasLtMatmulPreferenceDestroy)>
      pref(raw, &cublasLtMatmulPreferenceDestroy);
  set_pref(raw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
           static_cast<std::uint64_t>(workspace_bytes_));
  // Split-K partial sums in fp32 only (never added up in a bf16 output).
  set_pref(raw, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
           static_cast<std::uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
  set_pref(raw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
           static_cast<std::uint32_t>(key.align_a));
  set_pref(raw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
           static_cast<std::uint32_t>(key.align_b));
  set_pref(raw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
           static_cast<std::uint32_t>(key.align_c));
  set_pref(raw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
           static_cast<std::uint32_t>(key.align_c));
  cublasLtMatmulHeuristicResult_t found[kHeuristics];
  int count = 0;
  // No usable candidate is not an error: cuBLAS's own choice then serves alone.
  if (cublasLtMatmulAlgoGetHeuristic(lt_, s.desc, s.la, s.lb, s.lc, s.lc, raw, kHeuristics, found,
                                     &count) != CUBLAS_STATUS_SUCCESS)
    count = 0;
  s.candidates.push_back({.what = "cuBLAS's own choice (cublasGemmEx)"});
  for (int i = 0; i < count; ++i) {
    const cublasLtMatmulHeuristicResult_t& r = found[i];
    if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > workspace_bytes_) continue;
    std::ostringstream what;
    what << "cuBLASLt heuristic #" << i << " (algo " << algo_config(r.algo, CUBLASLT_ALGO_CONFIG_ID)
         << ", tile " << algo_config(r.algo, CUBLASLT_ALGO_CONFIG_TILE_ID) << ", stages "
         << algo_config(r.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID) << ", split-k "
         << algo_config(r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) << ")";
    s.candidates.push_back({.algo = r.algo, .what = what.str()});
  }
  if (s.candidates.size() == 1) s.chosen = 0;
}

void GemmSelector::collect(Shape& s) {
  while (!s.pending.empty()) {
    const Timing t = s.pending.front();
    const cudaError_t done = cudaEventQuery(t.stop);
    if (done == cudaErrorNotReady) {
      // Not an error: clear it if the runtime recorded it, and nothing else.
      if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
      break;
    }
    CHUNKLOSS_GPU_CHECK_AS(done,
                           "a GEMM timing's cudaEventQuery (an earlier launch on the stream)");
    float ms = 0;
    CHUNKLOSS_GPU_CHECK(cudaEventElapsedTime(&ms, t.start, t.stop));
    Candidate& c = s.candidates[t.candidate];
    c.best_ms = c.timed ? std::min(c.best_ms, ms) : ms;
    ++c.timed;
    --c.in_flight;
    free_events_.push_back(t.start);
    free_events_.push_back(t.stop);
    s.pending.pop_front();
  }
  int best = -1;
  for (std::size_t i = 0; i < s.candidates.size(); ++i) {
    const Candidate& c = s.candidates[i];
    if (c.failed) continue;
    if (c.timed < kTimedCalls) return;
    if (best < 0 || c.best_ms < s.candidates[static_cast<std::size_t>(best)].best_ms)
      best = static_cast<int>(i);
  }
  s.chosen = best;
}

bool GemmSelector::launch(const Shape& s, std::size_t candidate, const GemmCall& g) {
  if (candidate == 0) {
    run_gemm_ex(g);
    return true;
  }
  return cublasLtMatmul(lt_, s.desc, g.alpha, g.a, s.la, g.b, s.lb, g.beta, g.c, s.lc, g.c, s.lc,
                        &s.candidates[candidate].algo, workspace_, workspace_bytes_,
                        stream_) == CUBLAS_STATUS_SUCCESS;
}

void GemmSelector::run_gemm_ex(const GemmCall& g) const {
  CHUNKLOSS_GPU_CHECK(cublasSetPointerMode(
      cublas_, g.device_scalars ? CUBLAS_POINTER_MODE_DEVICE : CUBLAS_POINTER_MODE_HOST));
  const cublasStatus_t st = cublasGemmEx(
      cublas_, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.m,
      g.n, g.k, g.alpha, g.a, g.ab_type, g.lda, g.b, g.ab_type, g.ldb, g.beta, g.c, g.c_type, g.ldc,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  CHUNKLOSS_GPU_CHECK(cublasSetPointerMode(cublas_, CUBLAS_POINTER_MODE_HOST));
  CHUNKLOSS_GPU_CHECK_AS(st, "cublasGemmEx (", g.trans_a ? "T" : "N", g.trans_b ? "T" : "N",
                         " m=", g.m, " n=", g.n, " k=", g.k, " lda=", g.lda, " ldb=", g.ldb,
                         " ldc=", g.ldc, ")");
}

cudaEvent_t GemmSelector::event() {
  if (!free_events_.empty()) {
    cudaEvent_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  CHUNKLOSS_GPU_CHECK(cudaEventCreate(&e));
  return e;
}

}  // namespace chunkloss::gpu
