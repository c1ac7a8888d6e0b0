/*
 * common.cuh: what every file of the CUDA kernel table shares (private to
 * kernels/cuda/; the public interface is zt_kernels_cuda.h).
 *
 * The table (zt_kernels_cuda(), zt_kernels_cuda_bf16()) is built from one
 * file per operation family, each its own translation unit:
 *
 *   context.cu     the module's state: device, stream, cuBLASLt handle,
 *                  scratch buffers, the CUDA-graph capture, the profile
 *   table.cu       the two tables, initialisation, memory and graph calls,
 *                  the extern "C" interface of zt_kernels_cuda.h
 *   matmul.cu      cuBLASLt products (plans, epilogues), linear layers,
 *                  GELU in the products' epilogues
 *   reduce.cu      deterministic reductions: column sums, sum of squares
 *   encoder.cu     token + position embeddings, forward and backward
 *   norm.cu        LayerNorm (also after a residual sum), RMSNorm
 *   attention.cu   attention: the path choice and the cuBLASLt path
 *   fa2.cu         flash attention 2 on mma.sync (bf16 storage)
 *   elementwise.cu GELU, residual, SwiGLU, conversions, scale, zero
 *   rope.cu        rotary position embeddings
 *   lora.cu        LoRA merge and gradients
 *   xent.cu        softmax + cross-entropy (with and without probabilities)
 *   adamw.cu       AdamW (also fused over a unit), fp64 gradient sums
 *
 * Separate translation units, not one file that includes the others: each
 * family keeps its kernels and launchers static (file-local), and shows
 * the rest only a fill_<family><X>() that puts its entries into a table;
 * nvcc compiles the files in parallel, and a change recompiles one of
 * them. What crosses files is declared here: the shared state and its
 * services (defined in context.cu), the cuBLASLt product (matmul.cu), the
 * column sums (reduce.cu), GELU (elementwise.cu, the fallback of the
 * epilogue products), flash attention 2 (fa2.cu), and the device helpers
 * and macros, which are inline. The library is built with hidden
 * visibility: only the functions marked ZT_API (zt_kernels_cuda.h's) are
 * exported. The CPU stand-in (kernels/cuda/sim/) rewrites every file of
 * the set, this header included, and compiles each as host C++.
 *
 * The table computes what kernels/cpu/fast.c computes, with the same
 * contract (kernels/zt_kernels.h), on device pointers. The serial CPU
 * reference in kernels/cpu/ref.c defines the results; tests/gpu runs every
 * function against it. See zt_kernels_cuda.h for the execution model
 * (one stream, no atomics, checked calls).
 */
#ifndef ZT_CUDA_COMMON_CUH
#define ZT_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <initializer_list>

#include "zt_kernels_cuda.h"

/* The library's exported functions (the rest is hidden). */
#define ZT_API __attribute__((visibility("default")))

/* ---------------------------------------------------------------------------
 * Checked calls. A failed CUDA or cuBLAS call names itself and its place and
 * ends the process: the context is unusable after a device error and the
 * coordinator treats the worker's exit as a failed rank. */

/* An open graph capture (graph_begin .. graph_end, table.cu): on, and the
 * first thing that kept the capture from making a graph. */
struct capture_state {
  int on; /* read by other threads: atomically */
  pthread_t owner;
  char fail[200];
  /* Bumped when a recorded graph may no longer do what a call would: a
   * scratch buffer moved (the graph holds the old address) or a setting
   * (math, attention path, GELU epilogue) changed. */
  unsigned long epoch;
};
extern capture_state cap;

/* 1 when this thread has a capture open. */
int capturing_here(void);

/* The stream is the capture's while it is open: another thread's call
 * would land in the graph (or break it), so it ends the process. The
 * model records only when nothing else uses the table (engine/model.h,
 * fixed_units). */
void cap_same_thread(const char *what);

/* 1 (and the capture fails, naming `what`) when a capture is open: for
 * the calls that wait for the device or move host memory, which a graph
 * cannot hold. From another thread such a call ends the process
 * (cap_same_thread). */
int cap_refuse(const char *what);

/* During a capture, nothing runs: a failed call there (a capture the
 * driver invalidated) is the capture's failure, reported by graph_end;
 * the step then runs without a graph, where a real error ends the
 * process. */
void cuda_fail(const char *what, const char *msg, const char *file, int line);

#define ZT_CUDA_CHECK(call)                                                   \
  do {                                                                        \
    cudaError_t e_ = (call);                                                  \
    if (e_ != cudaSuccess) cuda_fail(#call, cudaGetErrorString(e_), __FILE__, __LINE__); \
  } while (0)

#define ZT_CUBLAS_CHECK(call)                                                 \
  do {                                                                        \
    cublasStatus_t s_ = (call);                                               \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                          \
      cuda_fail(#call, cublasLtGetStatusString(s_), __FILE__, __LINE__);  \
  } while (0)

#define ZT_CUDA_LAUNCHED() ZT_CUDA_CHECK(cudaGetLastError())

/* Scratch buffers, one per purpose, each grown on demand. */
enum { SCR_ATT, SCR_SORT, SCR_COLSUM, SCR_SUMSQ, SCR_BIAS, SCR_COUNT };

/* The module: one device, one stream, one cuBLASLt handle and workspace. */
struct module_state {
  int init;
  int device;
  cudaStream_t stream;
  cublasLtHandle_t lt;
  void *lt_ws;
  size_t lt_ws_size;
  zt_cuda_math_t math;
  char name[256];
  size_t mem;
  void *scr[SCR_COUNT];
  size_t scr_size[SCR_COUNT];
  int scr_in_graph[SCR_COUNT]; /* used by a call recorded into a graph */
  double *sumsq_host;
  size_t sumsq_host_n;
};
extern module_state g;

/* Waits for the stream: through the waiter (zt_kernels.h, set_waiter)
 * where one is set (set_stream_waiter; fn NULL: none). */
void stream_wait(void);
void set_stream_waiter(void (*fn)(void *ctx), void *ctx);

/* Scratch buffer `which`, at least `bytes` long (grown outside a capture;
 * the old one is freed once queued work is done with it). */
void *scratch(int which, size_t bytes);

/* Grid size for grid-stride loops over n elements. */
static inline unsigned grid_for(size_t n, unsigned block) {
  size_t b = (n + block - 1) / block;
  return (unsigned)(b > 65535u * 16u ? 65535u * 16u : b);
}

/* Launches a grid-stride kernel over n elements on the module's stream
 * (nothing for n == 0) and checks the launch. */
#define ZT_LAUNCH_1D(kernel, n, ...)                                           \
  do {                                                                         \
    if ((n) > 0) {                                                             \
      kernel<<<grid_for((n), 256), 256, 0, g.stream>>>(__VA_ARGS__);           \
      ZT_CUDA_LAUNCHED();                                                      \
    }                                                                          \
  } while (0)

/* The same for an elementwise kernel template kernel<X, VEC> that takes
 * VEC elements at a time (n / VEC vectors): VEC 8 where `fits` (vec_fits:
 * n and every pointer allow 8-element vectors), else 1. */
#define ZT_LAUNCH_X8(kernel, X, n, fits, ...)                                          \
  do {                                                                                 \
    if ((n) > 0) {                                                                     \
      if (fits)                                                                        \
        kernel<X, 8><<<grid_for((n) / 8, 256), 256, 0, g.stream>>>(__VA_ARGS__);       \
      else                                                                             \
        kernel<X, 1><<<grid_for((n), 256), 256, 0, g.stream>>>(__VA_ARGS__);           \
      ZT_CUDA_LAUNCHED();                                                              \
    }                                                                                  \
  } while (0)

#define ZT_GRID_STRIDE(i, n) \
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); \
       i += (size_t)gridDim.x * blockDim.x)

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/* Block-wide reductions over blockDim.x == ZT_RED_THREADS threads with a
 * fixed tree: the result is the same on every run. Every thread gets it. */
#define ZT_RED_THREADS 256

template <typename T, bool IS_MAX>
__device__ T block_reduce(T v, T *sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = ZT_RED_THREADS / 2; s > 0; s >>= 1) {
    if ((int)threadIdx.x < s) {
      T a = sh[threadIdx.x], b = sh[threadIdx.x + s];
      sh[threadIdx.x] = IS_MAX ? (a > b ? a : b) : a + b;
    }
    __syncthreads();
  }
  T r = sh[0];
  __syncthreads();
  return r;
}

/* Storage types. Two tables are built from the same kernels: "cuda" stores
 * activations and the parameters that forward and backward read as fp32,
 * "cuda-bf16" as bf16 (zt_kernels.h, xbytes). Kernels that touch those
 * tensors are templates over their storage type X: every load widens to
 * fp32 (ldx), every store rounds once to X (put, to nearest even), and the
 * arithmetic between is fp32, so a bf16 kernel computes what the fp32 one
 * computes from the same (bf16-valued) inputs, rounded once at the end.
 * Gradients of parameters, statistics (LayerNorm's mean and rstd,
 * attention's lse, the losses) and the optimizer's state stay fp32. */
typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float ldx(float v) { return v; }
__device__ __forceinline__ float ldx(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void put(float &d, float v) { d = v; }
__device__ __forceinline__ void put(bf16 &d, float v) { d = __float2bfloat16(v); }

static inline cudaDataType_t dtype_of(const float *) { return CUDA_R_32F; }
static inline cudaDataType_t dtype_of(const bf16 *) { return CUDA_R_16BF; }

/* Vector access. The memory-bound kernels (LayerNorm, RMSNorm, residual,
 * column sums, cross-entropy, AdamW, GELU, SwiGLU, the encoder's forward,
 * the conversions) move VEC consecutive
 * elements per load and store: 16-byte words where the row length and the
 * addresses allow it (one word holds 8 bf16 or 4 fp32), so that a warp's
 * access is 512 bytes, not 64 (bf16 one element at a time), and enough
 * bytes are in flight to reach the memory's bandwidth. VEC 1 is the plain
 * path for the rest (odd widths, unaligned views). Vectors never change
 * which elements are summed in which order across rows (column sums, the
 * optimizer); within a row they change the order of a row's sum, the
 * same way on every run. */
template <typename X, int VEC>
struct alignas(sizeof(X) * VEC < 16 ? sizeof(X) * VEC : 16) xvec {
  X v[VEC];
};

template <int VEC, typename X>
__device__ __forceinline__ void ldv(float *f, const X *p) {
  xvec<X, VEC> t = *(const xvec<X, VEC> *)p;
  for (int i = 0; i < VEC; i++) f[i] = ldx(t.v[i]);
}

template <int VEC, typename X>
__device__ __forceinline__ void stv(X *p, const float *f) {
  xvec<X, VEC> t;
  for (int i = 0; i < VEC; i++) put(t.v[i], f[i]);
  *(xvec<X, VEC> *)p = t;
}

/* Raw vectors of fp32 or fp64 (no conversion). */
template <int VEC, typename T>
__device__ __forceinline__ xvec<T, VEC> ldr(const T *p) {
  return *(const xvec<T, VEC> *)p;
}

template <int VEC, typename T>
__device__ __forceinline__ void str(T *p, const xvec<T, VEC> &t) {
  *(xvec<T, VEC> *)p = t;
}

/* Elements [i, i + 8) of a row of C: one vector where V8 (C a multiple of
 * 8, the row 16-byte aligned), else one at a time, those past C read as 0
 * and not written. The row kernels (LayerNorm, cross-entropy) give each
 * lane groups of 8 either way, so their sums are the same whether or not
 * the vectors fit. */
template <bool V8, typename X>
__device__ __forceinline__ void ld8(float *f, const X *row, int i, int C) {
  if (V8) {
    ldv<8>(f, row + i);
  } else {
    for (int k = 0; k < 8; k++) f[k] = i + k < C ? ldx(row[i + k]) : 0.0f;
  }
}

template <bool V8, typename X>
__device__ __forceinline__ void st8(X *row, const float *f, int i, int C) {
  if (V8) {
    stv<8>(row + i, f);
  } else {
    for (int k = 0; k < 8 && i + k < C; k++) put(row[i + k], f[k]);
  }
}

/* Whether VEC-element vectors fit: every pointer (NULL ones aside) aligned
 * to the vector's size in bytes (up to 16) and the length a multiple of
 * VEC. */
static inline bool vec_fits(int vec, size_t elem, size_t len,
                            std::initializer_list<const void *> ptrs) {
  if (len % (size_t)vec) return false;
  size_t al = elem * (size_t)vec < 16 ? elem * (size_t)vec : 16;
  for (const void *p : ptrs)
    if ((uintptr_t)p % al) return false;
  return true;
}

/* ---------------------------------------------------------------------------
 * The profile (zt_kernels_cuda_profile): while it is on, every table call
 * that queues device work and every cuBLASLt product inside one is
 * bracketed by two events on the stream, and zt_kernels_cuda_profile_report
 * sums the times by table function and by product shape. Off, a table call
 * costs one more branch. Events are pooled; calls past the pool's end are
 * counted, not timed. */
#define PROF_PAIRS 8192
#define PROF_LABELS 256

struct profile_state {
  int on, n, dropped, nlabels;
  cudaEvent_t ev[2 * PROF_PAIRS];
  short label[PROF_PAIRS];
  char kind[PROF_LABELS]; /* 'f' table function, 'g' cuBLASLt product */
  char labels[PROF_LABELS][96];
};
extern profile_state prof;

/* The pair's index, or -1 when the profile is off or the pool is spent. */
int prof_begin(char kind, const char *label);
void prof_end(int i);

/* The table's entries go through prof_fn<F, f>::call, which times f when
 * the profile is on. ZT_PROF_ENTRY(t, field, fn) sets t->field so. */
template <typename F, F f>
struct prof_fn;
template <typename R, typename... A, R (*f)(A...)>
struct prof_fn<R (*)(A...), f> {
  static const char *name;
  struct span {
    int i;
    ~span() { prof_end(i); }
  };
  static R call(A... a) {
    cap_same_thread(name);
    span s = {prof_begin('f', name)};
    return f(a...);
  }
};
template <typename R, typename... A, R (*f)(A...)>
const char *prof_fn<R (*)(A...), f>::name;

#define ZT_PROF_ENTRY(t, field, fn) \
  (prof_fn<decltype(&fn), &fn>::name = #field, (t)->field = prof_fn<decltype(&fn), &fn>::call)

/* ---------------------------------------------------------------------------
 * What the families share (see the list at the top). */

/* cuBLASLt products (matmul.cu). Column-major, as cuBLAS sees them:
 * D[m,n] = alpha op(A)[m,k] op(B)[k,n] + beta D, batched with strides,
 * optional bias (length m, D's type) fused as an epilogue, then epilogue
 * epi with the auxiliary matrix aux (D's type and layout, leading
 * dimension aux_ld): none, GELU whose input is kept (forward of the MLP's
 * first product), GELU's derivative at a kept input (backward of its
 * second). Returns -1, having queued nothing, where cuBLASLt has no
 * algorithm for the epilogue; a plain product or bias always runs.
 * Instantiated for A and D of the same storage type, and bf16 A with fp32
 * D (weight gradients). */
enum { EPI_NONE, EPI_GELU_AUX, EPI_DGELU };

/* The bias takes D's type (not deduced from it, so that NULL passes). */
template <typename T>
struct same_type {
  typedef T type;
};

template <typename XA, typename XD>
int lt_gemm_epi(int ta, int tb, int m, int n, int k, const XA *A, int lda, long long sA,
                const XA *Bm, int ldb, long long sB, XD *D, int ldd, long long sD, int batch,
                float alpha, float beta, const typename same_type<XD>::type *bias, int epi,
                const XD *aux, long long aux_ld);

template <typename XA, typename XD>
static inline void lt_gemm(int ta, int tb, int m, int n, int k, const XA *A, int lda,
                           long long sA, const XA *Bm, int ldb, long long sB, XD *D, int ldd,
                           long long sD, int batch, float alpha, float beta,
                           const typename same_type<XD>::type *bias) {
  (void)lt_gemm_epi(ta, tb, m, n, k, A, lda, sA, Bm, ldb, sB, D, ldd, sD, batch, alpha, beta,
                    bias, EPI_NONE, (const XD *)NULL, 0);
}

/* Column sums (reduce.cu): dsum[c] += sum_n dout[n,c] (unless dsum is
 * NULL); with inp/rstd also dnorm[c] += sum_n norm[n,c] * dout[n,c],
 * norm = (inp - mean) * rstd (mean 0 where NULL: RMSNorm's). */
template <typename X>
void colsums(float *dsum, float *dnorm, const X *dout, const X *inp, const float *mean,
             const float *rstd, int N, int C);

/* GELU's passes (elementwise.cu), for the epilogue products' fallback. */
template <typename X>
void gelu_forward_x(float *out, const float *inp, size_t n);
template <typename X>
void gelu_backward_x(float *dinp, const float *inp, const float *dout, size_t n);

/* Attention's layout (attention.cu, fa2.cu). A row of qkv holds NH query
 * heads, then KV key heads, then KV value heads, hs wide each. The row
 * width, and where query head h's K/V head starts in a row: */
__host__ __device__ __forceinline__ size_t att_rs(int NH, int KV, int hs) {
  return (size_t)(NH + 2 * KV) * hs;
}
__host__ __device__ __forceinline__ size_t att_koff(int h, int NH, int KV, int hs) {
  return (size_t)NH * hs + (size_t)(h / (NH / KV)) * hs;
}

/* Flash attention 2 (fa2.cu): bf16 storage, head sizes 16, 32, 48, 64 and
 * 128; the caller checks the rest (attention.cu, att_fa2). */
void fa2_forward(bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH, int KV, int hs);
void fa2_backward(bf16 *dqkv, const bf16 *dout, const bf16 *qkv, const bf16 *out,
                  const float *lse, int B, int T, int NH, int KV, int hs);

/* Each family's entries of a table of storage type X (float or bf16). */
template <typename X> void fill_matmul(zt_kernels_t *t);
template <typename X> void fill_reduce(zt_kernels_t *t);
template <typename X> void fill_encoder(zt_kernels_t *t);
template <typename X> void fill_norm(zt_kernels_t *t);
template <typename X> void fill_attention(zt_kernels_t *t);
template <typename X> void fill_elementwise(zt_kernels_t *t);
template <typename X> void fill_rope(zt_kernels_t *t);
template <typename X> void fill_lora(zt_kernels_t *t);
template <typename X> void fill_xent(zt_kernels_t *t);
template <typename X> void fill_adamw(zt_kernels_t *t);

#endif
