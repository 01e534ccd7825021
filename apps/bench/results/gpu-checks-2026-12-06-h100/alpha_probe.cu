// Throwaway probe: does cuBLASLt's alpha-device-vector/beta-host pointer mode run the dW and dX
// GEMMs (bf16, fp32 accumulate, bf16 out) as fast as host scalars, unlike device scalars?
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <vector>
#define CK(x)                                                     \
  do {                                                            \
    auto e = (x);                                                 \
    if ((int)e) {                                                 \
      printf("%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)e); \
      exit(1);                                                    \
    }                                                             \
  } while (0)
__global__ void fill(__nv_bfloat16* p, size_t n, float s, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)(i * 2654435761u) ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995;
    h ^= h >> 15;
    p[i] = __float2bfloat16(s * ((h & 0xffff) / 32768.0f - 1.0f));
  }
}
__global__ void setv(float* p, int n, float v) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = v;
}
__global__ void diff(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n, float* out) {
  __shared__ float m;
  if (threadIdx.x == 0) m = 0;
  __syncthreads();
  float loc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    loc = fmaxf(loc, fabsf(x - y) / fmaxf(fabsf(y), 1e-3f));
  }
  atomicMax((int*)&m, __float_as_int(loc));
  __syncthreads();
  if (threadIdx.x == 0) atomicMax((int*)out, __float_as_int(m));
}
int main(int argc, char** argv) {
  const int V = argc > 1 ? atoi(argv[1]) : 128256, H = argc > 2 ? atoi(argv[2]) : 4096,
            C = argc > 3 ? atoi(argv[3]) : 2048;
  const int reps = 10;
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cublasHandle_t hb;
  CK(cublasCreate(&hb));
  CK(cublasSetStream(hb, st));
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  size_t wsb = 64 << 20;
  void* ws;
  CK(cudaMalloc(&ws, wsb));
  CK(cublasSetWorkspace(hb, ws, wsb));
  __nv_bfloat16 *G, *X, *W, *D0, *D1, *DX0, *DX1;
  // G: [C, V] row-major with ld 2V (the in-place gradient stride); X: [C, H]; W: [V, H]
  CK(cudaMalloc(&G, (size_t)C * 2 * V * 2));
  CK(cudaMalloc(&X, (size_t)C * H * 2));
  CK(cudaMalloc(&W, (size_t)V * H * 2));
  CK(cudaMalloc(&D0, (size_t)V * H * 2));
  CK(cudaMalloc(&D1, (size_t)V * H * 2));
  CK(cudaMalloc(&DX0, (size_t)C * H * 2));
  CK(cudaMalloc(&DX1, (size_t)C * H * 2));
  fill<<<1024, 256, 0, st>>>(G, (size_t)C * 2 * V, 1e-3f, 1);
  fill<<<1024, 256, 0, st>>>(X, (size_t)C * H, 1, 2);
  fill<<<1024, 256, 0, st>>>(W, (size_t)V * H, 0.03f, 3);
  float *dscal, *dvec, *dmax;
  CK(cudaMalloc(&dscal, 8));
  CK(cudaMalloc(&dvec, 4 * std::max(H, C)));
  CK(cudaMalloc(&dmax, 4));
  const float alpha_v = 1.0f / 7022.0f, one = 1.0f, zero = 0.0f;
  float hs[2] = {alpha_v, alpha_v};
  CK(cudaMemcpy(dscal, hs, 8, cudaMemcpyHostToDevice));
  setv<<<(std::max(H, C) + 255) / 256, 256, 0, st>>>(dvec, std::max(H, C), alpha_v);
  // Column-major forms. dW^T [H, V] = X^T [H, C] * G [C, V]: A = X (col-major [H, C], ld H, no
  // trans), B = G (col-major [V, C] ld 2V, trans). dX^T [H, C] = W^T [H, V] * G^T [V, C]: A = W
  // (col-major [H, V] ld H), B = G (col-major [V, C] ld 2V, no trans).
  struct Shape {
    const char* name;
    int m, n, k;
    const void* a;
    int lda;
    cublasOperation_t ta;
    const void* b;
    int ldb;
    cublasOperation_t tb;
    void* d0;
    void* d1;
    int ldd;
  };
  Shape shapes[2] = {{"dW", H, V, C, X, H, CUBLAS_OP_N, G, 2 * V, CUBLAS_OP_T, D0, D1, H},
                     {"dX", H, C, V, W, H, CUBLAS_OP_N, G, 2 * V, CUBLAS_OP_N, DX0, DX1, H}};
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const Shape& s : shapes) {
    // Lt descriptors for vector mode
    cublasLtMatmulDesc_t desc;
    CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &s.ta, sizeof s.ta));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &s.tb, sizeof s.tb));
    cublasLtMatmulDesc_t hdesc;
    CK(cublasLtMatmulDescCreate(&hdesc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CK(cublasLtMatmulDescSetAttribute(hdesc, CUBLASLT_MATMUL_DESC_TRANSA, &s.ta, sizeof s.ta));
    CK(cublasLtMatmulDescSetAttribute(hdesc, CUBLASLT_MATMUL_DESC_TRANSB, &s.tb, sizeof s.tb));
    int pm = CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_HOST;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof pm));
    cublasLtMatrixLayout_t la, lb, ld;
    CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.ta == CUBLAS_OP_N ? s.m : s.k,
                                  s.ta == CUBLAS_OP_N ? s.k : s.m, s.lda));
    CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.tb == CUBLAS_OP_N ? s.k : s.n,
                                  s.tb == CUBLAS_OP_N ? s.n : s.k, s.ldb));
    CK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, s.m, s.n, s.ldd));
    cublasLtMatmulPreference_t pref;
    CK(cublasLtMatmulPreferenceCreate(&pref));
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                            sizeof wsb));
    cublasLtMatmulHeuristicResult_t res[4];
    int nres = 0, hres_n = 0;
    cublasLtMatmulHeuristicResult_t hres[4];
    auto st1 = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 4, res, &nres);
    auto st2 = cublasLtMatmulAlgoGetHeuristic(lt, hdesc, la, lb, ld, ld, pref, 4, hres, &hres_n);
    printf(
        "%s m=%d n=%d k=%d: vector-mode heuristics status %d, %d results; host-mode Lt %d "
        "results\n",
        s.name, s.m, s.n, s.k, (int)st1, nres, hres_n);
    for (float beta_h : {0.0f, 1.0f}) {
      std::vector<float> t[5];
      for (int r = 0; r < reps + 1; ++r) {
        for (int mode = 0; mode < 5; ++mode) {
          void* d = mode == 0 ? s.d0 : s.d1;
          CK(cudaEventRecord(e0, st));
          if (mode == 0) {  // GemmEx host alpha 1
            CK(cublasSetPointerMode(hb, CUBLAS_POINTER_MODE_HOST));
            CK(cublasGemmEx(hb, s.ta, s.tb, s.m, s.n, s.k, &one, s.a, CUDA_R_16BF, s.lda, s.b,
                            CUDA_R_16BF, s.ldb, beta_h == 0 ? &zero : &one, d, CUDA_R_16BF, s.ldd,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
          } else if (mode == 1) {  // GemmEx device scalars
            CK(cublasSetPointerMode(hb, CUBLAS_POINTER_MODE_DEVICE));
            CK(cublasGemmEx(hb, s.ta, s.tb, s.m, s.n, s.k, dscal, s.a, CUDA_R_16BF, s.lda, s.b,
                            CUDA_R_16BF, s.ldb, dscal + 1, d, CUDA_R_16BF, s.ldd,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            CK(cublasSetPointerMode(hb, CUBLAS_POINTER_MODE_HOST));
          } else if (mode == 2) {  // Lt vector alpha, host beta
            if (!nres) continue;
            CK(cublasLtMatmul(lt, desc, dvec, s.a, la, s.b, lb, beta_h == 0 ? &zero : &one, d, ld,
                              d, ld, &res[0].algo, ws, wsb, st));
          } else if (mode == 3) {  // Lt host scalars alpha = value
            if (!hres_n) continue;
            CK(cublasLtMatmul(lt, hdesc, &alpha_v, s.a, la, s.b, lb, beta_h == 0 ? &zero : &one, d,
                              ld, d, ld, &hres[0].algo, ws, wsb, st));
          } else {  // GemmEx host alpha = value
            CK(cublasGemmEx(hb, s.ta, s.tb, s.m, s.n, s.k, &alpha_v, s.a, CUDA_R_16BF, s.lda, s.b,
                            CUDA_R_16BF, s.ldb, beta_h == 0 ? &zero : &one, d, CUDA_R_16BF, s.ldd,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
          }
          CK(cudaEventRecord(e1, st));
          CK(cudaEventSynchronize(e1));
          float ms;
          CK(cudaEventElapsedTime(&ms, e0, e1));
          if (r) t[mode].push_back(ms);
        }
      }
      const char* names[5] = {"GemmEx host a=1", "GemmEx device a,b", "Lt alpha vector, beta host",
                              "Lt host a=1/D", "GemmEx host a=1/D"};
      for (int mode = 0; mode < 5; ++mode) {
        if (t[mode].empty()) {
          printf("  %s beta=%g: n/a\n", s.name, beta_h);
          continue;
        }
        std::sort(t[mode].begin(), t[mode].end());
        const double fl = 2.0 * s.m * s.n * (double)s.k;
        printf("  %s beta=%g %-28s median %.3f ms (%.0f TFLOP/s) min %.3f\n", s.name, beta_h,
               names[mode], t[mode][reps / 2], fl / t[mode][reps / 2] / 1e9, t[mode][0]);
      }
    }
    // correctness: vector mode vs GemmEx device scalars with beta 0 (same alpha)
    CK(cublasSetPointerMode(hb, CUBLAS_POINTER_MODE_DEVICE));
    float hz[2] = {alpha_v, 0.0f};
    CK(cudaMemcpy(dscal, hz, 8, cudaMemcpyHostToDevice));
    CK(cublasGemmEx(hb, s.ta, s.tb, s.m, s.n, s.k, dscal, s.a, CUDA_R_16BF, s.lda, s.b, CUDA_R_16BF,
                    s.ldb, dscal + 1, s.d0, CUDA_R_16BF, s.ldd, CUBLAS_COMPUTE_32F,
                    CUBLAS_GEMM_DEFAULT));
    CK(cublasSetPointerMode(hb, CUBLAS_POINTER_MODE_HOST));
    if (nres) {
      CK(cublasLtMatmul(lt, desc, dvec, s.a, la, s.b, lb, &zero, s.d1, ld, s.d1, ld, &res[0].algo,
                        ws, wsb, st));
      CK(cudaMemsetAsync(dmax, 0, 4, st));
      diff<<<1024, 256, 0, st>>>((__nv_bfloat16*)s.d1, (__nv_bfloat16*)s.d0, (size_t)s.m * s.n,
                                 dmax);
      float mx;
      CK(cudaMemcpy(&mx, dmax, 4, cudaMemcpyDeviceToHost));
      printf("  %s: vector mode vs device scalars, largest relative difference %.3g\n", s.name, mx);
    }
    CK(cudaMemcpy(hs, hs, 0, cudaMemcpyHostToHost));
    float h2[2] = {alpha_v, alpha_v};
    CK(cudaMemcpy(dscal, h2, 8, cudaMemcpyHostToDevice));
  }
  CK(cudaStreamSynchronize(st));
  printf("done\n");
}
