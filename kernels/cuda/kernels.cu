/*
 * kernels.cu: the CUDA kernel table, zt_kernels_cuda().
 *
 * The GPU twin of kernels/cpu/fast.c: the same functions with the same
 * contract (kernels/zt_kernels.h), on device pointers. The serial CPU
 * reference in kernels/cpu/ref.c defines the results; tests/gpu runs every
 * function here against it. See zt_kernels_cuda.h for the execution model
 * (one stream, no atomics, checked calls).
 *
 * Layout of this file: error macros and module state; small device helpers
 * (warp and block reductions); scratch buffers; the cuBLASLt product
 * helper; then the kernels in the order of the table, each next to its
 * host-side launcher.
 */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include <initializer_list>

#include "zt_kernels_cuda.h"

/* ---------------------------------------------------------------------------
 * Checked calls. A failed CUDA or cuBLAS call names itself and its place and
 * ends the process: the context is unusable after a device error and the
 * coordinator treats the worker's exit as a failed rank. */

/* An open graph capture (graph_begin .. graph_end, "CUDA graphs" below):
 * on, and the first thing that kept the capture from making a graph. */
static struct {
  int on; /* read by other threads: atomically */
  pthread_t owner;
  char fail[200];
  /* Bumped when a recorded graph may no longer do what a call would: a
   * scratch buffer moved (the graph holds the old address) or a setting
   * (math, attention path, GELU epilogue) changed. */
  unsigned long epoch;
} cap;

/* 1 when this thread has a capture open. */
static int capturing_here(void) {
  return __atomic_load_n(&cap.on, __ATOMIC_ACQUIRE) && pthread_equal(cap.owner, pthread_self());
}

/* The stream is the capture's while it is open: another thread's call
 * would land in the graph (or break it), so it ends the process. The
 * model records only when nothing else uses the table (engine/model.h,
 * fixed_units). */
static void cap_same_thread(const char *what) {
  if (__atomic_load_n(&cap.on, __ATOMIC_ACQUIRE) && !pthread_equal(cap.owner, pthread_self())) {
    fprintf(stderr, "zt cuda: %s called from another thread while a CUDA graph is being "
            "recorded\n", what);
    fflush(stderr);
    exit(EXIT_FAILURE);
  }
}

/* During a capture, nothing runs: a failed call there (a capture the
 * driver invalidated) is the capture's failure, reported by graph_end;
 * the step then runs without a graph, where a real error ends the
 * process as below. */
static void cuda_fail(const char *what, const char *msg, const char *file, int line) {
  if (capturing_here()) {
    if (!cap.fail[0]) snprintf(cap.fail, sizeof cap.fail, "%s: %s", what, msg);
    return;
  }
  fprintf(stderr, "zt cuda: %s failed at %s:%d: %s\n", what, file, line, msg);
  fflush(stderr);
  exit(EXIT_FAILURE);
}

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

static struct {
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
} g;

/* 1 (and the capture fails, naming `what`) when a capture is open: for
 * the calls that wait for the device or move host memory, which a graph
 * cannot hold. From another thread such a call ends the process
 * (cap_same_thread). */
static int cap_refuse(const char *what) {
  cap_same_thread(what);
  if (!cap.on) return 0;
  if (!cap.fail[0]) snprintf(cap.fail, sizeof cap.fail, "%s inside the captured calls", what);
  return 1;
}

/* The waiter (zt_kernels.h, set_waiter) and the wait that calls it. */
static struct {
  void (*fn)(void *ctx);
  void *ctx;
} waiter;

static void stream_wait(void) {
  if (!waiter.fn) {
    ZT_CUDA_CHECK(cudaStreamSynchronize(g.stream));
    return;
  }
  for (int polls = 0;; polls++) {
    cudaError_t e = cudaStreamQuery(g.stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) ZT_CUDA_CHECK(e);
    (void)cudaGetLastError(); /* not ready is no failure of the next launch */
    waiter.fn(waiter.ctx);
    if (polls > 200) usleep(50);
  }
}

static void *scratch(int which, size_t bytes) {
  if (bytes <= g.scr_size[which]) {
    if (capturing_here()) g.scr_in_graph[which] = 1;
    return g.scr[which];
  }
  /* The buffer a graph's calls would use is the one they were recorded
   * with: it cannot grow inside a capture (a step run without a graph
   * first sizes it). */
  if (cap_refuse("a scratch buffer to grow")) return g.scr[which];
  if (g.scr_in_graph[which]) { /* a recorded graph holds the old address */
    cap.epoch++;
    g.scr_in_graph[which] = 0;
  }
  /* Earlier work queued on the stream may still use the old buffer. */
  stream_wait();
  if (g.scr[which]) ZT_CUDA_CHECK(cudaFree(g.scr[which]));
  size_t sz = bytes + bytes / 4;
  ZT_CUDA_CHECK(cudaMalloc(&g.scr[which], sz));
  g.scr_size[which] = sz;
  return g.scr[which];
}

/* Grid size for grid-stride loops over n elements. */
static unsigned grid_for(size_t n, unsigned block) {
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

static cudaDataType_t dtype_of(const float *) { return CUDA_R_32F; }
static cudaDataType_t dtype_of(const bf16 *) { return CUDA_R_16BF; }

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
static bool vec_fits(int vec, size_t elem, size_t len, std::initializer_list<const void *> ptrs) {
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

static struct {
  int on, n, dropped, nlabels;
  cudaEvent_t ev[2 * PROF_PAIRS];
  short label[PROF_PAIRS];
  char kind[PROF_LABELS]; /* 'f' table function, 'g' cuBLASLt product */
  char labels[PROF_LABELS][96];
} prof;

static int prof_label(char kind, const char *s) {
  for (int i = 0; i < prof.nlabels; i++)
    if (prof.kind[i] == kind && !strcmp(prof.labels[i], s)) return i;
  if (prof.nlabels == PROF_LABELS) return PROF_LABELS - 1; /* the last one takes the rest */
  int i = prof.nlabels++;
  prof.kind[i] = kind;
  snprintf(prof.labels[i], sizeof prof.labels[i], "%s", s);
  return i;
}

/* The pair's index, or -1 when the profile is off or the pool is spent. */
static int prof_begin(char kind, const char *label) {
  if (!prof.on || cap.on) return -1;
  if (prof.n == PROF_PAIRS) {
    prof.dropped++;
    return -1;
  }
  int i = prof.n++;
  prof.label[i] = (short)prof_label(kind, label);
  ZT_CUDA_CHECK(cudaEventRecord(prof.ev[2 * i], g.stream));
  return i;
}

static void prof_end(int i) {
  if (i >= 0) ZT_CUDA_CHECK(cudaEventRecord(prof.ev[2 * i + 1], g.stream));
}

/* ---------------------------------------------------------------------------
 * cuBLASLt products. Column-major, as cuBLAS sees them: D[m,n] = alpha *
 * op(A)[m,k] op(B)[k,n] + beta * D, batched with strides, optional bias
 * (length m) fused as an epilogue. Row-major callers swap roles (see each
 * use). */

static cublasComputeType_t compute_type(void) {
  switch (g.math) {
    case ZT_CUDA_MATH_TF32: return CUBLAS_COMPUTE_32F_FAST_TF32;
    case ZT_CUDA_MATH_BF16: return CUBLAS_COMPUTE_32F_FAST_16BF;
    default: return CUBLAS_COMPUTE_32F;
  }
}

/* The alignment cuBLASLt may assume for a matrix: the largest power of two
 * up to 16 (what its kernels' vector loads need) dividing its address and,
 * when batched, its batch stride in bytes. Model views start at offsets of
 * a flat buffer; capped at 16, a view's alignment, and so the algorithm
 * chosen for it, does not change with where ZeRO's padding (which keeps
 * units 16-byte aligned, engine/memplan.h) puts the unit. */
static uint32_t align_of(const void *p, long long stride, int batch, size_t esz) {
  uint64_t a = (uint64_t)(uintptr_t)p | 16u;
  if (batch > 1) a |= (uint64_t)stride * esz;
  return (uint32_t)(a & (~a + 1));
}

/* Epilogues beyond the bias: none, GELU whose input is kept (forward of
 * the MLP's first product), GELU's derivative at a kept input (backward of
 * its second). */
enum { EPI_NONE, EPI_GELU_AUX, EPI_DGELU };

/* The operation descriptor: compute type, transposes, optional bias (of
 * type bias_type, D's), epilogue epi with its auxiliary matrix (aux, leading
 * dimension aux_ld, D's type). */
static cublasLtMatmulDesc_t make_op(cublasComputeType_t ct, int ta, int tb, const void *bias,
                                    cudaDataType_t bias_type, int epi, const void *aux,
                                    long long aux_ld) {
  cublasLtMatmulDesc_t op = NULL;
  cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  ZT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, ct, CUDA_R_32F));
  ZT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
  ZT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
  cublasLtEpilogue_t e = epi == EPI_GELU_AUX ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                         : epi == EPI_DGELU  ? CUBLASLT_EPILOGUE_DGELU
                         : bias              ? CUBLASLT_EPILOGUE_BIAS
                                             : CUBLASLT_EPILOGUE_DEFAULT;
  if (e != CUBLASLT_EPILOGUE_DEFAULT)
    ZT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e));
  if (bias) {
    ZT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                   sizeof bias));
    ZT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                   &bias_type, sizeof bias_type));
  }
  if (epi != EPI_NONE) {
    int64_t ld = aux_ld;
    ZT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                   &aux, sizeof aux));
    ZT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld,
                                                   sizeof ld));
  }
  return op;
}

/* A planned product: descriptors and the chosen algorithm for one shape,
 * kept so that the heuristic query and the descriptor set-up (tens of
 * microseconds) happen once per shape, not once per call. The key holds
 * everything the plan depends on except the pointers (the bias pointer is
 * set on each call; the alignments are part of the key). */
typedef struct {
  int ta, tb, m, n, k, lda, ldb, ldd, batch, has_bias;
  int tab, td; /* cudaDataType_t of A and B, of C and D (and the bias) */
  long long sA, sB, sD;
  uint32_t al[3];
  zt_cuda_math_t math;
  int epi;             /* EPI_* */
  uint32_t al_aux;     /* the auxiliary matrix's alignment */
  long long aux_ld;
} lt_key;

typedef struct {
  int used;
  int ok; /* 0: cuBLASLt has no algorithm for this epilogue (the caller does without) */
  lt_key key;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatmulAlgo_t algo;
} lt_plan;

#define ZT_LT_PLANS 256
static lt_plan g_plans[ZT_LT_PLANS];
static int g_plan_next; /* round-robin eviction */

static void plan_destroy(lt_plan *p) {
  if (!p->used) return;
  cublasLtMatrixLayoutDestroy(p->la);
  cublasLtMatrixLayoutDestroy(p->lb);
  cublasLtMatrixLayoutDestroy(p->ld);
  cublasLtMatmulDescDestroy(p->op);
  p->used = 0;
}

/* The heuristic's first algorithm for plan p: 1 found, 0 none. With an
 * epilogue, a library that does not support it (a status, not an empty
 * answer) counts as none: the caller does without. */
static int heuristic(lt_plan *p, cublasLtMatmulPreference_t pref, int epi,
                     cublasLtMatmulHeuristicResult_t *res) {
  int found = 0;
  cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(g.lt, p->op, p->la, p->lb, p->ld, p->ld, pref, 1, res, &found);
  if (st != CUBLAS_STATUS_SUCCESS && epi != EPI_NONE) return 0;
  if (st != CUBLAS_STATUS_SUCCESS)
    cuda_fail("cublasLtMatmulAlgoGetHeuristic", cublasLtGetStatusString(st), __FILE__, __LINE__);
  return found;
}

static void plan_build(lt_plan *p, const lt_key *kk) {
  const void *fake_bias = kk->has_bias ? g.lt_ws : NULL;
  /* The auxiliary pointer's value tells the heuristic its alignment. */
  const void *fake_aux = kk->epi != EPI_NONE ? (const char *)g.lt_ws + kk->al_aux : NULL;
  cudaDataType_t tab = (cudaDataType_t)kk->tab, td = (cudaDataType_t)kk->td;
  /* bf16 data: the products are exact in fp32 and accumulate in fp32. */
  cublasComputeType_t ct = tab == CUDA_R_16BF ? CUBLAS_COMPUTE_32F : compute_type();
  p->key = *kk;
  p->op = make_op(ct, kk->ta, kk->tb, fake_bias, td, kk->epi, fake_aux, kk->aux_ld);
  ZT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, tab, kk->ta ? kk->k : kk->m,
                                             kk->ta ? kk->m : kk->k, kk->lda));
  ZT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, tab, kk->tb ? kk->n : kk->k,
                                             kk->tb ? kk->k : kk->n, kk->ldb));
  ZT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->ld, td, kk->m, kk->n, kk->ldd));
  if (kk->batch > 1) {
    cublasLtMatrixLayout_t ls[3] = {p->la, p->lb, p->ld};
    long long strides[3] = {kk->sA, kk->sB, kk->sD};
    for (int i = 0; i < 3; i++) {
      int32_t bc = kk->batch;
      int64_t st = strides[i];
      ZT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                       &bc, sizeof bc));
      ZT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
          ls[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &st, sizeof st));
    }
  }
  cublasLtMatmulPreference_t pref = NULL;
  ZT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = g.lt_ws_size;
  ZT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  uint32_t al[4] = {kk->al[0], kk->al[1], kk->al[2], kk->al[2]};
  const cublasLtMatmulPreferenceAttributes_t which[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; i++)
    ZT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, which[i], &al[i], sizeof al[i]));
  cublasLtMatmulHeuristicResult_t res;
  int found = heuristic(p, pref, kk->epi, &res);
  if (found == 0 && ct != CUBLAS_COMPUTE_32F) {
    /* No reduced-precision kernel for this shape or alignment: plain fp32. */
    cublasLtMatmulDescDestroy(p->op);
    p->op = make_op(CUBLAS_COMPUTE_32F, kk->ta, kk->tb, fake_bias, td, kk->epi, fake_aux,
                    kk->aux_ld);
    found = heuristic(p, pref, kk->epi, &res);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (found == 0 && kk->epi == EPI_NONE)
    cuda_fail("cublasLtMatmulAlgoGetHeuristic", "no algorithm for this product", __FILE__,
                  __LINE__);
  p->ok = found != 0;
  if (p->ok) p->algo = res.algo;
  p->used = 1;
}

static lt_plan *plan_get(const lt_key *kk) {
  for (int i = 0; i < ZT_LT_PLANS; i++)
    if (g_plans[i].used && !memcmp(&g_plans[i].key, kk, sizeof *kk)) return &g_plans[i];
  lt_plan *p = &g_plans[g_plan_next];
  g_plan_next = (g_plan_next + 1) % ZT_LT_PLANS;
  /* The evicted plan's descriptors may belong to queued work: cuBLASLt
   * reads them at enqueue time only, so destroying them now is safe. */
  plan_destroy(p);
  plan_build(p, kk);
  return p;
}

/* A and B of one storage type, D (and the bias) of another, or the same;
 * the bias takes D's type (not deduced from it, so that NULL passes). */
template <typename T>
struct same_type {
  typedef T type;
};

/* D = alpha op(A) op(B) + beta D (+ bias), then epilogue epi with the
 * auxiliary matrix aux (D's type and layout, leading dimension aux_ld).
 * Returns -1, having queued nothing, where cuBLASLt has no algorithm for
 * the epilogue; a plain product or bias always runs. */
template <typename XA, typename XD>
static int lt_gemm_epi(int ta, int tb, int m, int n, int k, const XA *A, int lda, long long sA,
                       const XA *Bm, int ldb, long long sB, XD *D, int ldd, long long sD,
                       int batch, float alpha, float beta,
                       const typename same_type<XD>::type *bias, int epi, const XD *aux,
                       long long aux_ld) {
  lt_key kk;
  memset(&kk, 0, sizeof kk); /* the key is compared bytewise, padding included */
  kk.ta = ta, kk.tb = tb, kk.m = m, kk.n = n, kk.k = k, kk.lda = lda, kk.ldb = ldb, kk.ldd = ldd;
  kk.batch = batch, kk.has_bias = bias != NULL;
  kk.tab = dtype_of(A), kk.td = dtype_of(D);
  kk.sA = batch > 1 ? sA : 0, kk.sB = batch > 1 ? sB : 0, kk.sD = batch > 1 ? sD : 0;
  kk.al[0] = align_of(A, sA, batch, sizeof(XA)), kk.al[1] = align_of(Bm, sB, batch, sizeof(XA));
  kk.al[2] = align_of(D, sD, batch, sizeof(XD));
  kk.math = g.math;
  kk.epi = epi;
  if (epi != EPI_NONE) kk.al_aux = align_of(aux, 0, 1, sizeof(XD)), kk.aux_ld = aux_ld;
  lt_plan *p = plan_get(&kk);
  if (!p->ok) return -1;
  int span = -1;
  if (prof.on) {
    char lab[96];
    snprintf(lab, sizeof lab, "%c%c m %d n %d k %d %s->%s%s", ta ? 'T' : 'N', tb ? 'T' : 'N', m,
             n, k, sizeof(XA) == 2 ? "bf16" : "fp32", sizeof(XD) == 2 ? "bf16" : "fp32",
             beta != 0.0f ? " +=" : bias ? " +bias" : "");
    if (epi != EPI_NONE)
      snprintf(lab + strlen(lab), sizeof lab - strlen(lab), epi == EPI_GELU_AUX ? " gelu" : " dgelu");
    if (batch > 1) snprintf(lab + strlen(lab), sizeof lab - strlen(lab), " x%d", batch);
    span = prof_begin('g', lab);
  }
  if (bias)
    ZT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                   sizeof bias));
  if (epi != EPI_NONE)
    ZT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
  cublasStatus_t st = cublasLtMatmul(g.lt, p->op, &alpha, A, p->la, Bm, p->lb, &beta, D, p->ld,
                                     D, p->ld, &p->algo, g.lt_ws, g.lt_ws_size, g.stream);
  prof_end(span);
  if (st != CUBLAS_STATUS_SUCCESS && capturing_here()) {
    /* A product that fails inside a capture (one the driver invalidated)
     * fails the capture (cuda_fail returns then); nothing about the plan
     * is learnt from it. */
    cuda_fail("cublasLtMatmul", cublasLtGetStatusString(st), __FILE__, __LINE__);
    return 0;
  }
  if (st != CUBLAS_STATUS_SUCCESS && epi != EPI_NONE) {
    /* An epilogue the library turns down at run time: remembered, and the
     * caller does without, as when the heuristic found nothing. */
    p->ok = 0;
    return -1;
  }
  if (st != CUBLAS_STATUS_SUCCESS)
    cuda_fail("cublasLtMatmul", cublasLtGetStatusString(st), __FILE__, __LINE__);
  return 0;
}

template <typename XA, typename XD>
static void lt_gemm(int ta, int tb, int m, int n, int k, const XA *A, int lda, long long sA,
                    const XA *Bm, int ldb, long long sB, XD *D, int ldd, long long sD,
                    int batch, float alpha, float beta, const typename same_type<XD>::type *bias) {
  (void)lt_gemm_epi(ta, tb, m, n, k, A, lda, sA, Bm, ldb, sB, D, ldd, sD, batch, alpha, beta,
                    bias, EPI_NONE, (const XD *)NULL, 0);
}

/* ---------------------------------------------------------------------------
 * Column sums: dst[c] += sum over N rows of src[n, c] (optionally of
 * src * norm, for the LayerNorm weight gradient). Stage 1: a block takes 32
 * lanes' worth of columns (VEC each) and a chunk of ZT_COLSUM_ROWS rows;
 * warp w adds rows w, w + 8, ... of the chunk, and the 8 warps' sums are
 * added in warp order. Stage 2 adds the chunks' sums the same way (chunk
 * k to the k % 8'th partial, then the 8 partials in order). Every
 * column's order of addition depends on N alone: not on VEC, not on the
 * run. */
#define ZT_COLSUM_ROWS 64
#define ZT_COLSUM_WARPS 8

template <typename X, int VEC>
__global__ void k_colsum_chunks(float *part_a, float *part_b, const X *dout, const X *inp,
                                const float *mean, const float *rstd, int N, int C, int rows) {
  __shared__ float sh[2][ZT_COLSUM_WARPS][32 * VEC];
  int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  int c0 = blockIdx.x * 32 * VEC, c = c0 + lane * VEC, chunk = blockIdx.y;
  int r0 = chunk * rows, r1 = min(N, r0 + rows);
  float sa[VEC], sb[VEC], d[VEC], x[VEC];
  for (int k = 0; k < VEC; k++) sa[k] = sb[k] = 0.0f;
  if (c < C)
    for (int r = r0 + w; r < r1; r += ZT_COLSUM_WARPS) {
      ldv<VEC>(d, dout + (size_t)r * C + c);
      if (part_a)
        for (int k = 0; k < VEC; k++) sa[k] += d[k];
      if (part_b) {
        ldv<VEC>(x, inp + (size_t)r * C + c);
        float mr = mean ? mean[r] : 0.0f;
        for (int k = 0; k < VEC; k++) sb[k] += (x[k] - mr) * rstd[r] * d[k];
      }
    }
  for (int k = 0; k < VEC; k++) sh[0][w][lane * VEC + k] = sa[k], sh[1][w][lane * VEC + k] = sb[k];
  __syncthreads();
  for (int j = threadIdx.x; j < 32 * VEC && c0 + j < C; j += blockDim.x) {
    float a = 0.0f, b = 0.0f;
    for (int q = 0; q < ZT_COLSUM_WARPS; q++) a += sh[0][q][j], b += sh[1][q][j];
    if (part_a) part_a[(size_t)chunk * C + c0 + j] = a;
    if (part_b) part_b[(size_t)chunk * C + c0 + j] = b;
  }
}

__global__ void k_colsum_finish(float *dst_a, float *dst_b, const float *part_a,
                                const float *part_b, int nchunks, int C) {
  __shared__ float sh[2][ZT_COLSUM_WARPS][32];
  int lane = threadIdx.x % 32, w = threadIdx.x / 32, c = blockIdx.x * 32 + lane;
  float a = 0.0f, b = 0.0f;
  if (c < C)
    for (int k = w; k < nchunks; k += ZT_COLSUM_WARPS) {
      if (part_a) a += part_a[(size_t)k * C + c];
      if (part_b) b += part_b[(size_t)k * C + c];
    }
  sh[0][w][lane] = a, sh[1][w][lane] = b;
  __syncthreads();
  if (w || c >= C) return;
  a = b = 0.0f;
  for (int q = 0; q < ZT_COLSUM_WARPS; q++) a += sh[0][q][lane], b += sh[1][q][lane];
  if (dst_a) dst_a[c] += a;
  if (part_b) dst_b[c] += b;
}

/* dsum[c] += sum_n dout[n,c] (unless dsum is NULL); with inp/rstd also
 * dnorm[c] += sum_n norm[n,c] * dout[n,c], norm = (inp - mean) * rstd
 * (mean 0 where NULL: RMSNorm's). */
template <typename X>
static void colsums(float *dsum, float *dnorm, const X *dout, const X *inp, const float *mean,
                    const float *rstd, int N, int C) {
  if (N <= 0 || C <= 0) return;
  /* Chunks of ZT_COLSUM_ROWS rows, more for very tall inputs (grid y <= 65535). */
  int rows = ZT_COLSUM_ROWS;
  while ((N + rows - 1) / rows > 65535) rows *= 2;
  int nchunks = (N + rows - 1) / rows;
  size_t per = (size_t)nchunks * C, parts = (dsum ? 1 : 0) + (dnorm ? 1 : 0);
  if (!parts) return;
  /* Only the sums asked for are formed (RMSNorm's weight gradient has no
   * bias: dsum NULL). */
  float *part = (float *)scratch(SCR_COLSUM, per * parts * sizeof(float));
  float *part_a = dsum ? part : NULL, *part_b = dnorm ? part + (dsum ? per : 0) : NULL;
  unsigned threads = 32 * ZT_COLSUM_WARPS;
  if (vec_fits(8, sizeof(X), (size_t)C, {dout, inp}))
    k_colsum_chunks<X, 8><<<dim3((C + 255) / 256, nchunks), threads, 0, g.stream>>>(
        part_a, part_b, dout, inp, mean, rstd, N, C, rows);
  else
    k_colsum_chunks<X, 1><<<dim3((C + 31) / 32, nchunks), threads, 0, g.stream>>>(
        part_a, part_b, dout, inp, mean, rstd, N, C, rows);
  ZT_CUDA_LAUNCHED();
  k_colsum_finish<<<(C + 31) / 32, threads, 0, g.stream>>>(dsum, dnorm, part_a, part_b, nchunks,
                                                            C);
  ZT_CUDA_LAUNCHED();
}

/* ---------------------------------------------------------------------------
 * Encoder. */

template <typename X, int VEC>
__global__ void k_encoder_fwd(X *out, const int *inp, const X *wte, const X *wpe, int T, int C,
                              size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t i = j * VEC, bt = i / C;
    int c = (int)(i % C), t = (int)(bt % T);
    float a[VEC], b[VEC];
    ldv<VEC>(a, wte + (size_t)inp[bt] * C + c), ldv<VEC>(b, wpe + (size_t)t * C + c);
    for (int k = 0; k < VEC; k++) a[k] += b[k];
    stv<VEC>(out + i, a);
  }
}

template <typename X>
static void cu_encoder_forward(float *out, const int *inp, const float *wte, const float *wpe,
                               int B, int T, int C) {
  size_t n = (size_t)B * T * C;
  ZT_LAUNCH_X8(k_encoder_fwd, X, n, vec_fits(8, sizeof(X), (size_t)C, {out, wte, wpe}), (X *)out,
               inp, (const X *)wte, (const X *)wpe, T, C, n);
}

/* dwpe[t,c] += sum over b in order. */
template <typename X>
__global__ void k_encoder_bwd_wpe(float *dwpe, const X *dout, int B, int T, int C) {
  size_t n = (size_t)T * C;
  ZT_GRID_STRIDE(i, n) {
    int t = (int)(i / C), c = (int)(i % C);
    float acc = dwpe[i];
    for (int b = 0; b < B; b++) acc += ldx(dout[((size_t)b * T + t) * C + c]);
    dwpe[i] = acc;
  }
}

__global__ void k_iota_keys(unsigned *keys, int *vals, const int *inp, int n) {
  ZT_GRID_STRIDE(i, (size_t)n) {
    keys[i] = (unsigned)inp[i];
    vals[i] = (int)i;
  }
}

/* One block per sorted position; the first position of each token's run
 * adds that token's rows, in position order, into its dwte row. */
template <typename X>
__global__ void k_encoder_bwd_wte(float *dwte, const X *dout, const unsigned *keys,
                                  const int *pos, int n, int C) {
  int j = blockIdx.x;
  unsigned key = keys[j];
  if (j > 0 && keys[j - 1] == key) return;
  int end = j + 1;
  while (end < n && keys[end] == key) end++;
  float *row = dwte + (size_t)key * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = row[c];
    for (int r = j; r < end; r++) acc += ldx(dout[(size_t)pos[r] * C + c]);
    row[c] = acc;
  }
}

template <typename X>
static void cu_encoder_backward(float *dwte, float *dwpe, const float *dout_, const int *inp,
                                int B, int T, int C) {
  const X *dout = (const X *)dout_;
  int n = B * T;
  if (n <= 0 || C <= 0) return;
  size_t tc = (size_t)T * C;
  ZT_LAUNCH_1D(k_encoder_bwd_wpe<X>, tc, dwpe, dout, B, T, C);
  size_t temp = 0;
  ZT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(NULL, temp, (const unsigned *)NULL,
                                                (unsigned *)NULL, (const int *)NULL, (int *)NULL,
                                                n, 0, 32, g.stream));
  size_t arr = ((size_t)n * sizeof(int) + 255) & ~(size_t)255;
  char *s = (char *)scratch(SCR_SORT, 4 * arr + temp);
  unsigned *keys_in = (unsigned *)s, *keys_out = (unsigned *)(s + arr);
  int *vals_in = (int *)(s + 2 * arr), *vals_out = (int *)(s + 3 * arr);
  ZT_LAUNCH_1D(k_iota_keys, (size_t)n, keys_in, vals_in, inp, n);
  ZT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(s + 4 * arr, temp, keys_in, keys_out, vals_in,
                                                vals_out, n, 0, 32, g.stream));
  k_encoder_bwd_wte<X><<<n, 128, 0, g.stream>>>(dwte, dout, keys_out, vals_out, n, C);
  ZT_CUDA_LAUNCHED();
}

/* ---------------------------------------------------------------------------
 * LayerNorm: one warp per row, each lane VEC elements at a time (lane l
 * takes elements [VEC l + 32 VEC k, VEC l + 32 VEC k + VEC)). With a second
 * input the row is first the residual sum x = inp + inp2, rounded to X and
 * stored in res (residual_forward's result, bit for bit), and the
 * LayerNorm is of that stored row: residual_layernorm_forward is the two
 * calls in one pass. */

template <typename X, bool V8>
__global__ void k_layernorm_fwd(X *out, float *mean, float *rstd, X *res, const X *inp,
                                const X *inp2, const X *w, const X *b, int N, int C) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const X *x = inp + (size_t)row * C;
  float s = 0.0f, f[8], g[8];
  if (inp2) {
    X *r = res + (size_t)row * C;
    for (int i = lane * 8; i < C; i += 256) {
      ld8<V8>(f, x, i, C), ld8<V8>(g, inp2 + (size_t)row * C, i, C);
      for (int k = 0; k < 8; k++) {
        X t;
        put(t, f[k] + g[k]);
        f[k] = ldx(t);
        s += f[k];
      }
      st8<V8>(r, f, i, C);
    }
    x = r;
  } else {
    for (int i = lane * 8; i < C; i += 256) {
      ld8<V8>(f, x, i, C);
      for (int k = 0; k < 8; k++) s += f[k];
    }
  }
  float m = warp_sum(s) / C;
  float v = 0.0f;
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(f, x, i, C);
    for (int k = 0; k < 8; k++)
      if (V8 || i + k < C) v += (f[k] - m) * (f[k] - m);
  }
  float r = 1.0f / sqrtf(warp_sum(v) / C + ZT_LN_EPS);
  X *o = out + (size_t)row * C;
  for (int i = lane * 8; i < C; i += 256) {
    float wv[8], bv[8];
    ld8<V8>(f, x, i, C), ld8<V8>(wv, w, i, C), ld8<V8>(bv, b, i, C);
    for (int k = 0; k < 8; k++) f[k] = (f[k] - m) * r * wv[k] + bv[k];
    st8<V8>(o, f, i, C);
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

template <typename X>
static void layernorm_fwd(X *out, float *mean, float *rstd, X *res, const X *inp, const X *inp2,
                          const X *w, const X *b, int N, int C) {
  if (N <= 0) return;
  unsigned grid = (unsigned)((N + 7) / 8);
  if (vec_fits(8, sizeof(X), (size_t)C, {out, res, inp, inp2, w, b}))
    k_layernorm_fwd<X, true><<<grid, 256, 0, g.stream>>>(out, mean, rstd, res, inp, inp2, w, b,
                                                         N, C);
  else
    k_layernorm_fwd<X, false><<<grid, 256, 0, g.stream>>>(out, mean, rstd, res, inp, inp2, w, b,
                                                          N, C);
  ZT_CUDA_LAUNCHED();
}

template <typename X>
static void cu_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                 const float *w, const float *b, int N, int C) {
  layernorm_fwd((X *)out, mean, rstd, (X *)NULL, (const X *)inp, (const X *)NULL, (const X *)w,
                (const X *)b, N, C);
}

template <typename X>
static void cu_residual_layernorm_forward(float *res, float *out, float *mean, float *rstd,
                                          const float *a, const float *b2, const float *w,
                                          const float *b, int N, int C) {
  layernorm_fwd((X *)out, mean, rstd, (X *)res, (const X *)a, (const X *)b2, (const X *)w,
                (const X *)b, N, C);
}

template <typename X, bool V8>
__global__ void k_layernorm_bwd_inp(X *dinp, const X *dout, const X *inp, const X *w,
                                    const float *mean, const float *rstd, int N, int C) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const X *d = dout + (size_t)row * C, *x = inp + (size_t)row * C;
  X *dx = dinp + (size_t)row * C;
  float m = mean[row], s = rstd[row];
  float a = 0.0f, bsum = 0.0f, xv[8], wv[8], dv[8], gv[8];
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(xv, x, i, C), ld8<V8>(wv, w, i, C), ld8<V8>(dv, d, i, C);
    for (int k = 0; k < 8; k++) {
      float norm = (xv[k] - m) * s, dnorm = wv[k] * dv[k];
      a += dnorm; /* 0 past C */
      bsum += dnorm * norm;
    }
  }
  float dnorm_mean = warp_sum(a) / C, dnorm_norm_mean = warp_sum(bsum) / C;
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(xv, x, i, C), ld8<V8>(wv, w, i, C), ld8<V8>(dv, d, i, C), ld8<V8>(gv, dx, i, C);
    for (int k = 0; k < 8; k++) {
      float norm = (xv[k] - m) * s, dnorm = wv[k] * dv[k];
      gv[k] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
    st8<V8>(dx, gv, i, C);
  }
}

template <typename X>
static void cu_layernorm_backward(float *dinp_, float *dw, float *db, const float *dout_,
                                  const float *inp_, const float *w_, const float *mean,
                                  const float *rstd, int N, int C) {
  if (N <= 0) return;
  X *dinp = (X *)dinp_;
  const X *dout = (const X *)dout_, *inp = (const X *)inp_, *w = (const X *)w_;
  unsigned grid = (unsigned)((N + 7) / 8);
  if (vec_fits(8, sizeof(X), (size_t)C, {dinp, dout, inp, w}))
    k_layernorm_bwd_inp<X, true><<<grid, 256, 0, g.stream>>>(dinp, dout, inp, w, mean, rstd, N,
                                                             C);
  else
    k_layernorm_bwd_inp<X, false><<<grid, 256, 0, g.stream>>>(dinp, dout, inp, w, mean, rstd, N,
                                                              C);
  ZT_CUDA_LAUNCHED();
  colsums(db, dw, dout, inp, mean, rstd, N, C);
}

/* ---------------------------------------------------------------------------
 * Linear layers. Row-major X[N,IC] is column-major X'[IC,N] (ld IC); W[OC,IC]
 * is W'[IC,OC] (ld IC); out[N,OC] is out'[OC,N] (ld OC). */

/* The bias as the epilogue takes it: the epilogue wants it 16-byte
 * aligned; a bias inside a flat parameter buffer often is not, and is
 * copied into aligned scratch. */
template <typename X>
static const X *epilogue_bias(const X *bias, int OC) {
  if (!bias || (uintptr_t)bias % 16 == 0) return bias;
  X *b = (X *)scratch(SCR_BIAS, (size_t)OC * sizeof(X));
  ZT_CUDA_CHECK(cudaMemcpyAsync(b, bias, (size_t)OC * sizeof(X), cudaMemcpyDeviceToDevice,
                                g.stream));
  return b;
}

/* out' = W'^T X' + bias per row of out', the bias (epilogue_bias's) always
 * fused as the epilogue: one rounding of the sum, the same whatever the
 * bias's address. */
template <typename X>
static void matmul_forward_x(X *out, const X *inp, const X *w, const X *bias, int N, int IC,
                             int OC) {
  lt_gemm(1, 0, OC, N, IC, w, IC, 0, inp, IC, 0, out, OC, 0, 1, 1.0f, 0.0f, bias);
}

template <typename X>
static void cu_matmul_forward(float *out, const float *inp, const float *w, const float *bias,
                              int N, int IC, int OC) {
  if (N <= 0 || OC <= 0) return;
  matmul_forward_x((X *)out, (const X *)inp, (const X *)w, epilogue_bias((const X *)bias, OC), N,
                   IC, OC);
}

/* The weight and bias gradients of a linear layer: dw' [IC,OC] += X' [IC,N]
 * dout'^T [N,OC] (fp32, a parameter gradient, whatever X is), dbias the
 * column sums of dout. */
template <typename X>
static void matmul_backward_wb(float *dw, float *dbias, const X *dout, const X *inp, int N, int IC,
                               int OC) {
  if (dw) lt_gemm(0, 1, IC, OC, N, inp, IC, 0, dout, OC, 0, dw, IC, 0, 1, 1.0f, 1.0f, NULL);
  if (dbias) colsums(dbias, NULL, dout, (const X *)NULL, NULL, NULL, N, OC);
}

template <typename X>
static void cu_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout_,
                               const float *inp_, const float *w_, int N, int IC, int OC) {
  if (N <= 0 || OC <= 0) return;
  const X *dout = (const X *)dout_, *inp = (const X *)inp_, *w = (const X *)w_;
  /* dinp' [IC,N] = W' [IC,OC] dout' [OC,N]. */
  if (dinp)
    lt_gemm(0, 0, IC, N, OC, w, IC, 0, dout, OC, 0, (X *)dinp, IC, 0, 1, 1.0f, 0.0f, NULL);
  matmul_backward_wb(dw, dbias, dout, inp, N, IC, OC);
}

/* ---------------------------------------------------------------------------
 * Attention, multi-head and grouped-query alike. A row of qkv holds NH
 * query heads, then KV key heads, then KV value heads, hs wide each
 * ((NH + 2 KV) hs; GPT-2: KV = NH); query head h reads K/V head
 * h / (NH / KV), on either path: no K/V head is copied per query head. out
 * and dout rows are NH hs wide, lse is [B,NH,T]. Two paths: flash
 * attention 2 where it applies (bf16 storage, head sizes 16, 32, 48, 64
 * and 128, 16-byte aligned rows; below), by default; cuBLASLt with the
 * T x T scores in scratch for everything else.
 *
 * Attention through cuBLASLt: qkv is permuted into q [B,NH,T,hs] and k, v
 * [B,KV,T,hs]. The G = NH / KV query heads of a group lie one after the
 * other in q, so for each (b, K/V head) (a batch of B*KV) one product
 * takes the group's G*T query rows against the head's T keys: the K/V
 * head is read once, and the backward's products over the G*T rows sum dk
 * and dv over the group by themselves. The products run through cuBLASLt
 * on the full T x T per query head, the causal mask is applied by the
 * softmax kernels (entries above the diagonal become 0). Row-major q
 * [T,hs] is column-major Q' [hs,T] (ld hs); a row-major [T,T] matrix A is
 * column-major A' with A'(t2,t) = A[t][t2]. The backward recomputes the
 * probabilities from the scores and lse. The T x T matrices live in the
 * call's scratch, not in the activations. */

/* The offset in [B,T,width] rows (at column coff) of element idx of a
 * [B,NH,T,hs] head-major tensor. */
__device__ __forceinline__ size_t head_to_row(size_t idx, int T, int NH, int hs, int width,
                                              int coff) {
  int i = (int)(idx % hs);
  size_t r = idx / hs;
  int t = (int)(r % T);
  r /= T;
  int h = (int)(r % NH), b = (int)(r / NH);
  return ((size_t)b * T + t) * width + coff + (size_t)h * hs + i;
}

/* The row width of qkv, and where query head h's K/V head starts in a row. */
__host__ __device__ __forceinline__ size_t att_rs(int NH, int KV, int hs) {
  return (size_t)(NH + 2 * KV) * hs;
}
__host__ __device__ __forceinline__ size_t att_koff(int h, int NH, int KV, int hs) {
  return (size_t)NH * hs + (size_t)(h / (NH / KV)) * hs;
}

/* [B,NH,T,hs] <-> [B,T,C] at column offset `coff` of rows of width `width`.
 * dir 0: dst (rows) = src (heads); dir 1: dst (heads) = src (rows). The
 * heads are fp32 scratch, the rows of either storage type. */
template <typename D, typename S>
__global__ void k_heads_rows(D *dst, const S *src, int B, int T, int NH, int hs, int width,
                             int coff, int dir) {
  size_t n = (size_t)B * NH * T * hs;
  ZT_GRID_STRIDE(idx, n) {
    size_t row = head_to_row(idx, T, NH, hs, width, coff);
    if (dir == 0)
      put(dst[row], ldx(src[idx]));
    else
      put(dst[idx], ldx(src[row]));
  }
}

/* Causal softmax in place, one warp per row of T: entries t2 <= t are
 * already scaled scores; entries above the diagonal become 0. */
__global__ void k_causal_softmax(float *att, float *lse, int rows, int T) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  int t = row % T;
  float *a = att + (size_t)row * T;
  float mx = -INFINITY;
  for (int j = lane; j <= t; j += 32) mx = fmaxf(mx, a[j]);
  mx = warp_max(mx);
  float s = 0.0f;
  for (int j = lane; j <= t; j += 32) {
    float e = expf(a[j] - mx);
    a[j] = e;
    s += e;
  }
  s = warp_sum(s);
  for (int j = lane; j < T; j += 32) a[j] = j <= t ? a[j] / s : 0.0f;
  if (lane == 0) lse[row] = mx + logf(s);
}

/* Scaled scores (in place) -> probabilities exp(s - lse) below the
 * diagonal, 0 above: the forward's softmax, recomputed. */
__global__ void k_causal_probs(float *att, const float *lse, int rows, int T) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  int t = row % T;
  float *a = att + (size_t)row * T, l = lse[row];
  for (int j = lane; j < T; j += 32) a[j] = j <= t ? expf(a[j] - l) : 0.0f;
}

/* datt (in place) -> dpreatt = att * (datt - sum(att * datt)) * scale below
 * the diagonal, 0 above. */
__global__ void k_causal_softmax_bwd(float *datt, const float *att, int rows, int T,
                                     float scale) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  int t = row % T;
  float *d = datt + (size_t)row * T;
  const float *a = att + (size_t)row * T;
  float s = 0.0f;
  for (int j = lane; j <= t; j += 32) s += a[j] * d[j];
  s = warp_sum(s);
  for (int j = lane; j < T; j += 32) d[j] = j <= t ? a[j] * (d[j] - s) * scale : 0.0f;
}

/* Bytes of scratch the cuBLASLt backward takes (the forward, less): q,
 * dvacc, dq [B,NH,T,hs], k, v, dk, dv [B,KV,T,hs] and two [B,NH,T,T]
 * matrices. */
static size_t att_cublas_scratch(int B, int T, int NH, int KV, int hs) {
  size_t nq = (size_t)B * T * NH * hs, nkv = (size_t)B * T * KV * hs;
  size_t tt = (size_t)B * NH * T * T;
  return (3 * nq + 4 * nkv + 2 * tt) * sizeof(float);
}

/* ---------------------------------------------------------------------------
 * Flash attention 2 (Dao, 2023), the attention path of bf16 storage
 * wherever it applies (att_fa2 below: head sizes 16, 32, 48, 64 and 128,
 * Llama's; 16-byte aligned rows). Causal, grouped K/V heads read in place;
 * no T x T matrix is formed, not even in scratch.
 * q, k, v are read where they lie in qkv [B,T,(NH+2KV)hs] and out is
 * written in [B,T,NH hs], so no permutation kernels run either.
 *
 * The products run on the tensor cores' own instructions, mma.sync.m16n8k16
 * and ldmatrix, whose register layouts PTX defines
 * (kernels/cuda/sim/include/zt_sim_ptx.h spells them out), and so
 * everything of a warp's 16 rows stays in registers:
 *
 *   - forward: a block of FA2_WARPS warps takes FA2_BM query rows, q held
 *     as A fragments; K and V tiles of FA2_BN keys stream through shared
 *     memory; the scores' accumulators are scaled, masked and
 *     exponentiated where they are (one pass of online softmax, row maxima
 *     and sums over the 4 lanes that share a row), rescale the output
 *     accumulators, and become the A fragments of p v without leaving the
 *     registers (the accumulators of two 8-key tiles are an A fragment's
 *     layout). Tiles past the diagonal are never loaded.
 *   - backward: two kernels so that no two blocks add into one gradient
 *     (no atomics: the same bits on every run): dk and dv of a block of
 *     keys (their K and V held as A fragments, query tiles and dout
 *     streaming by, s^T and dp^T recomputed), and dq of a block of queries
 *     (q and dout held, K and V streaming by), each recomputing
 *     p = exp(s - lse) and ds = p (dp - D) with D = rowsum(dout * out)
 *     formed first per row.
 *
 * Probabilities and ds are rounded to bf16 once, as operands of the second
 * product, as flash attention does; exponentials are exp2f of scores
 * prescaled by log2(e). lse is written in natural units, as the cuBLASLt
 * path does, so either backward takes either forward's lse.
 */

#ifdef __CUDACC__
/* d += a b: one 16 x 8 x 16 tile, bf16 operands, fp32 accumulators. */
__device__ __forceinline__ void zt_ptx_mma(float d[4], const unsigned a[4], const unsigned b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
/* Four 8 x 8 b16 matrices from shared memory, this lane's row address p. */
__device__ __forceinline__ void zt_ptx_ldsm4(unsigned r[4], const void *p) {
  unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void zt_ptx_ldsm4t(unsigned r[4], const void *p) {
  unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
#else
#include "zt_sim_ptx.h" /* the stand-in's versions, same names */
#endif

/* Loops over the register arrays are unrolled so that the arrays stay in
 * registers (nvcc; the CPU stand-in compiles this file with g++). */
#ifdef __CUDACC__
#define ZT_UNROLL _Pragma("unroll")
#else
#define ZT_UNROLL
#endif

#define FA2_WARPS 4
#define FA2_BM (16 * FA2_WARPS) /* query rows of a block, keys of a backward block */
#define FA2_BN 64               /* rows of a streamed tile */
#define FA2_NT (FA2_BN / 8)     /* 8-column accumulator tiles across a streamed tile */
#define FA2_LOG2E 1.4426950408889634f
#define FA2_LN2 0.6931471805599453f
#define FA2_FULL 0xffffffffu

/* Two floats as one register of two bf16, the first in the lower half. */
__device__ __forceinline__ unsigned fa2_pack(float lo, float hi) {
  bf16 a = __float2bfloat16(lo), b = __float2bfloat16(hi);
  unsigned short ua, ub;
  memcpy(&ua, &a, 2);
  memcpy(&ub, &b, 2);
  return (unsigned)ua | (unsigned)ub << 16;
}

/* 16 bytes: one vector access, and the element of the shared tiles (which
 * ldmatrix wants 16-byte aligned). */
struct alignas(16) fa2_v16 {
  unsigned x[4];
};

/* Rows [t0, t0 + n) of a [T, hs] bf16 slice (row stride rs) into dst (row
 * stride ld), 16 bytes at a time; rows at or past T read as 0. */
__device__ __forceinline__ void rows_load(bf16 *dst, int ld, const bf16 *src, size_t rs, int t0,
                                          int n, int T, int hs) {
  int per = hs / 8;
  for (int e = threadIdx.x; e < n * per; e += blockDim.x) {
    int r = e / per, c = (e % per) * 8;
    fa2_v16 v = {{0, 0, 0, 0}};
    if (t0 + r < T) v = *(const fa2_v16 *)(src + (size_t)(t0 + r) * rs + c);
    *(fa2_v16 *)(dst + r * ld + c) = v;
  }
}

/* rows_load into a tile of row stride HS + 8, so that ldmatrix's 8 rows
 * fall in different banks. */
template <int HS>
__device__ __forceinline__ void fa2_load(bf16 *dst, const bf16 *src, size_t rs, int t0, int n,
                                         int T) {
  rows_load(dst, HS + 8, src, rs, t0, n, T, HS);
}

/* The A fragments (16 rows x HS) of rows [0, 16) of a shared tile. Lanes
 * 8i .. 8i+7 address rows 0-7 (i even) or 8-15 (i odd) at column 0 (i < 2)
 * or 8: the registers a[0..3] of mma's A layout. */
template <int HS>
__device__ __forceinline__ void fa2_rows(unsigned (&a)[HS / 16][4], const bf16 *tile, int lane) {
  constexpr int LD = HS + 8;
  ZT_UNROLL
  for (int kk = 0; kk < HS / 16; kk++)
    zt_ptx_ldsm4(a[kk], tile + ((lane & 8) + (lane & 7)) * LD + (lane & 16) / 2 + 16 * kk);
}

/* s (16 x FA2_BN fp32 accumulators) = a (16 x HS) times the transpose of
 * tile (FA2_BN x HS, shared). The B operand of an 8-column tile is 8 of the
 * tile's rows, k along them: ldmatrix without .trans, two 8-row tiles a
 * call (b[0..1] for rows n, b[2..3] for rows n + 8). */
template <int HS>
__device__ __forceinline__ void fa2_scores(float (&s)[FA2_NT][4], const unsigned (&a)[HS / 16][4],
                                           const bf16 *tile, int lane) {
  constexpr int LD = HS + 8;
  ZT_UNROLL
  for (int j = 0; j < FA2_NT; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
  const bf16 *t = tile + ((lane & 16) / 2 + (lane & 7)) * LD + (lane & 8);
  ZT_UNROLL
  for (int kk = 0; kk < HS / 16; kk++) {
    ZT_UNROLL
    for (int jp = 0; jp < FA2_NT / 2; jp++) {
      unsigned b[4];
      zt_ptx_ldsm4(b, t + 16 * jp * LD + 16 * kk);
      zt_ptx_mma(s[2 * jp], a[kk], b);
      zt_ptx_mma(s[2 * jp + 1], a[kk], b + 2);
    }
  }
}

/* acc (16 x HS) += p (16 x FA2_BN, accumulators rounded to bf16) times tile
 * (FA2_BN x HS, shared). p's accumulators for columns 16kk .. 16kk+15 are
 * the A fragment of step kk as they lie; the B operand, k down the tile's
 * rows, comes through ldmatrix.trans. */
template <int HS>
__device__ __forceinline__ void fa2_accum(float (&acc)[HS / 8][4], const float (&p)[FA2_NT][4],
                                          const bf16 *tile, int lane) {
  constexpr int LD = HS + 8;
  const bf16 *t = tile + ((lane & 8) + (lane & 7)) * LD + (lane & 16) / 2;
  ZT_UNROLL
  for (int kk = 0; kk < FA2_NT / 2; kk++) {
    unsigned a[4] = {fa2_pack(p[2 * kk][0], p[2 * kk][1]), fa2_pack(p[2 * kk][2], p[2 * kk][3]),
                     fa2_pack(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                     fa2_pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
    ZT_UNROLL
    for (int dp = 0; dp < HS / 16; dp++) {
      unsigned b[4];
      zt_ptx_ldsm4t(b, t + 16 * kk * LD + 16 * dp);
      zt_ptx_mma(acc[2 * dp], a, b);
      zt_ptx_mma(acc[2 * dp + 1], a, b + 2);
    }
  }
}

/* Rows r and r + 8 (this lane's, g = lane / 4) of acc * scale into the rows
 * of a bf16 array (row stride rs) that lie below T, two columns a store. */
template <int HS>
__device__ __forceinline__ void fa2_store(bf16 *base, size_t rs, int r, int T,
                                          const float (&acc)[HS / 8][4], float s0, float s1,
                                          int lane) {
  int c = 2 * (lane % 4);
  ZT_UNROLL
  for (int hh = 0; hh < 2; hh++) {
    if (r + 8 * hh >= T) continue;
    unsigned *o = (unsigned *)(base + (size_t)(r + 8 * hh) * rs + c);
    float sc = hh ? s1 : s0;
    ZT_UNROLL
    for (int d = 0; d < HS / 8; d++)
      o[4 * d] = fa2_pack(acc[d][2 * hh] * sc, acc[d][2 * hh + 1] * sc);
  }
}

template <int HS>
__device__ __forceinline__ void fa2_zero(float (&acc)[HS / 8][4]) {
  ZT_UNROLL
  for (int d = 0; d < HS / 8; d++) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.0f;
}

template <int HS>
__global__ void __launch_bounds__(FA2_WARPS * 32)
    k_fa2_fwd(bf16 *out, float *lse, const bf16 *qkv, int T, int NH, int KV, float sl2) {
  constexpr int LD = HS + 8;
  __shared__ fa2_v16 ks_[FA2_BN * LD / 8];
  __shared__ fa2_v16 vs_[FA2_BN * LD / 8];
  bf16 *ks = (bf16 *)ks_, *vs = (bf16 *)vs_;
  int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  int q0 = (gridDim.x - 1 - blockIdx.x) * FA2_BM; /* the longest blocks first */
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  int r0 = q0 + warp * 16;
  size_t rs = att_rs(NH, KV, HS);
  const bf16 *base = qkv + (size_t)b * T * rs, *kb = base + att_koff(h, NH, KV, HS);
  const bf16 *vb = kb + (size_t)KV * HS;
  fa2_load<HS>(ks, base + (size_t)h * HS, rs, q0, FA2_BM, T); /* q passes through ks */
  __syncthreads();
  unsigned qf[HS / 16][4];
  fa2_rows<HS>(qf, ks + warp * 16 * LD, lane);
  float o[HS / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  fa2_zero<HS>(o);
  int kend = min(T, q0 + FA2_BM);
  for (int k0 = 0; k0 < kend; k0 += FA2_BN) {
    __syncthreads(); /* q, or the previous tile, is no longer read */
    fa2_load<HS>(ks, kb, rs, k0, FA2_BN, T);
    fa2_load<HS>(vs, vb, rs, k0, FA2_BN, T);
    __syncthreads();
    float s[FA2_NT][4];
    fa2_scores<HS>(s, qf, ks, lane);
    /* Key k0 lies at or before every row of the block, so each row's
     * maximum is finite from the first tile on. */
    bool edge = k0 + FA2_BN - 1 > r0 || k0 + FA2_BN > T;
    float mx[2] = {-INFINITY, -INFINITY};
    ZT_UNROLL
    for (int j = 0; j < FA2_NT; j++)
      ZT_UNROLL
      for (int e = 0; e < 4; e++) {
        int key = k0 + 8 * j + 2 * c + (e & 1), row = r0 + g + 8 * (e >> 1);
        float x = s[j][e] * sl2;
        if (edge && (key > row || key >= T)) x = -INFINITY;
        s[j][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float corr[2];
    ZT_UNROLL
    for (int hh = 0; hh < 2; hh++) {
      mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(FA2_FULL, mx[hh], 1));
      mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(FA2_FULL, mx[hh], 2));
      float mn = fmaxf(m[hh], mx[hh]);
      corr[hh] = exp2f(m[hh] - mn);
      m[hh] = mn;
      l[hh] *= corr[hh];
    }
    ZT_UNROLL
    for (int j = 0; j < FA2_NT; j++)
      ZT_UNROLL
      for (int e = 0; e < 4; e++) {
        s[j][e] = exp2f(s[j][e] - m[e >> 1]);
        l[e >> 1] += s[j][e];
      }
    ZT_UNROLL
    for (int d = 0; d < HS / 8; d++) {
      o[d][0] *= corr[0], o[d][1] *= corr[0];
      o[d][2] *= corr[1], o[d][3] *= corr[1];
    }
    fa2_accum<HS>(o, s, vs, lane);
  }
  ZT_UNROLL
  for (int hh = 0; hh < 2; hh++) {
    l[hh] += __shfl_xor_sync(FA2_FULL, l[hh], 1);
    l[hh] += __shfl_xor_sync(FA2_FULL, l[hh], 2);
  }
  fa2_store<HS>(out + (size_t)b * T * NH * HS + (size_t)h * HS, (size_t)NH * HS, r0 + g, T, o,
                1.0f / l[0], 1.0f / l[1], lane);
  ZT_UNROLL
  for (int hh = 0; hh < 2; hh++) {
    int row = r0 + g + 8 * hh;
    if (c == 0 && row < T) lse[(size_t)bh * T + row] = (m[hh] + log2f(l[hh])) * FA2_LN2;
  }
}

/* D [B,NH,T] = rowsum(dout * out) per head, one warp per row. */
__global__ void k_fa2_row_d(float *D, const bf16 *dout, const bf16 *out, int B, int T, int C,
                            int NH) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= B * NH * T) return;
  int hs = C / NH, bh = row / T, i = row % T, b = bh / NH, h = bh % NH;
  size_t off = ((size_t)b * T + i) * C + (size_t)h * hs;
  float s = 0.0f;
  for (int d = lane; d < hs; d += 32) s += ldx(dout[off + d]) * ldx(out[off + d]);
  s = warp_sum(s);
  if (lane == 0) D[row] = s;
}

/* lse (times lscale) and D of rows [t0, t0 + n) of head bh into ls and
 * dsh (0 past T), by the block's first n threads. */
__device__ __forceinline__ void fa2_row_stats(float *ls, float *dsh, const float *lse,
                                              const float *D, int bh, int T, int t0, int n,
                                              float lscale) {
  if ((int)threadIdx.x < n) {
    int i = t0 + threadIdx.x;
    ls[threadIdx.x] = i < T ? lse[(size_t)bh * T + i] * lscale : 0.0f;
    dsh[threadIdx.x] = i < T ? D[(size_t)bh * T + i] : 0.0f;
  }
}

/* dq of FA2_BM query rows: q and dout held as A fragments, the K and V
 * tiles at and before them streaming by. */
template <int HS>
__global__ void __launch_bounds__(FA2_WARPS * 32)
    k_fa2_bwd_q(bf16 *dqkv, const bf16 *qkv, const bf16 *dout, const float *lse, const float *D,
                int T, int NH, int KV, float scale, float sl2) {
  constexpr int LD = HS + 8;
  __shared__ fa2_v16 ks_[FA2_BN * LD / 8];
  __shared__ fa2_v16 vs_[FA2_BN * LD / 8];
  bf16 *ks = (bf16 *)ks_, *vs = (bf16 *)vs_;
  int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  int q0 = (gridDim.x - 1 - blockIdx.x) * FA2_BM;
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  int r0 = q0 + warp * 16;
  size_t rs = att_rs(NH, KV, HS);
  const bf16 *base = qkv + (size_t)b * T * rs, *kb = base + att_koff(h, NH, KV, HS);
  const bf16 *vb = kb + (size_t)KV * HS;
  fa2_load<HS>(ks, base + (size_t)h * HS, rs, q0, FA2_BM, T);
  fa2_load<HS>(vs, dout + (size_t)b * T * NH * HS + (size_t)h * HS, (size_t)NH * HS, q0, FA2_BM,
               T);
  __syncthreads();
  unsigned qf[HS / 16][4], gf[HS / 16][4];
  fa2_rows<HS>(qf, ks + warp * 16 * LD, lane);
  fa2_rows<HS>(gf, vs + warp * 16 * LD, lane);
  float lr[2], dr[2];
  ZT_UNROLL
  for (int hh = 0; hh < 2; hh++) {
    int row = r0 + g + 8 * hh;
    lr[hh] = row < T ? lse[(size_t)bh * T + row] * FA2_LOG2E : 0.0f;
    dr[hh] = row < T ? D[(size_t)bh * T + row] : 0.0f;
  }
  float dq[HS / 8][4];
  fa2_zero<HS>(dq);
  int kend = min(T, q0 + FA2_BM);
  for (int k0 = 0; k0 < kend; k0 += FA2_BN) {
    __syncthreads();
    fa2_load<HS>(ks, kb, rs, k0, FA2_BN, T);
    fa2_load<HS>(vs, vb, rs, k0, FA2_BN, T);
    __syncthreads();
    float p[FA2_NT][4], dp[FA2_NT][4];
    fa2_scores<HS>(p, qf, ks, lane);
    fa2_scores<HS>(dp, gf, vs, lane);
    bool edge = k0 + FA2_BN - 1 > r0 || k0 + FA2_BN > T;
    ZT_UNROLL
    for (int j = 0; j < FA2_NT; j++)
      ZT_UNROLL
      for (int e = 0; e < 4; e++) {
        int key = k0 + 8 * j + 2 * c + (e & 1), row = r0 + g + 8 * (e >> 1);
        float pe = edge && (key > row || key >= T) ? 0.0f : exp2f(p[j][e] * sl2 - lr[e >> 1]);
        p[j][e] = pe * (dp[j][e] - dr[e >> 1]); /* ds */
      }
    fa2_accum<HS>(dq, p, ks, lane);
  }
  fa2_store<HS>(dqkv + (size_t)b * T * rs + (size_t)h * HS, rs, r0 + g, T, dq, scale, scale,
                lane);
}

/* dk and dv of FA2_BM keys of one K/V head: their K and V held as A
 * fragments, the query tiles at and after them (q, dout, lse and D)
 * streaming by, for each query head of the group in turn. PART 0 computes
 * both; at head size 128 both do not fit a thread's 255 registers, so two
 * launches split them, PART 1 dv (no V fragments, no dp) and PART 2 dk,
 * each recomputing the scores (a quarter more of the backward's products,
 * no spills). */
template <int HS, int PART>
__global__ void __launch_bounds__(FA2_WARPS * 32)
    k_fa2_bwd_kv(bf16 *dqkv, const bf16 *qkv, const bf16 *dout, const float *lse,
                 const float *D, int T, int NH, int KV, float scale, float sl2) {
  constexpr int LD = HS + 8;
  constexpr bool want_dk = PART != 1, want_dv = PART != 2;
  __shared__ fa2_v16 qs_[FA2_BN * LD / 8];
  __shared__ fa2_v16 gs_[FA2_BN * LD / 8];
  __shared__ float ls[FA2_BN];
  __shared__ float dsh[FA2_BN];
  bf16 *qs = (bf16 *)qs_, *gs = (bf16 *)gs_;
  int bk = blockIdx.y, b = bk / KV, kvh = bk % KV, grp = NH / KV;
  int k0 = blockIdx.x * FA2_BM, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int g = lane / 4, c = lane % 4, j0 = k0 + warp * 16;
  size_t rs = att_rs(NH, KV, HS), koff = att_koff(kvh * grp, NH, KV, HS);
  const bf16 *base = qkv + (size_t)b * T * rs;
  fa2_load<HS>(qs, base + koff, rs, k0, FA2_BM, T); /* K and V pass through qs and gs */
  if (want_dk) fa2_load<HS>(gs, base + koff + (size_t)KV * HS, rs, k0, FA2_BM, T);
  __syncthreads();
  unsigned kf[HS / 16][4], vf[HS / 16][4];
  fa2_rows<HS>(kf, qs + warp * 16 * LD, lane);
  if (want_dk) fa2_rows<HS>(vf, gs + warp * 16 * LD, lane);
  float dk[HS / 8][4], dv[HS / 8][4];
  if (want_dk) fa2_zero<HS>(dk);
  if (want_dv) fa2_zero<HS>(dv);
  for (int it = 0, nt = (T - k0 + FA2_BN - 1) / FA2_BN; it < grp * nt; it++) {
    int h = kvh * grp + it / nt, t0 = k0 + (it % nt) * FA2_BN, bh = b * NH + h;
    __syncthreads();
    fa2_load<HS>(qs, base + (size_t)h * HS, rs, t0, FA2_BN, T);
    fa2_load<HS>(gs, dout + (size_t)b * T * NH * HS + (size_t)h * HS, (size_t)NH * HS, t0,
                 FA2_BN, T);
    fa2_row_stats(ls, dsh, lse, D, bh, T, t0, FA2_BN, FA2_LOG2E);
    __syncthreads();
    /* s^T and dp^T: this warp's keys down, the tile's queries across. */
    float p[FA2_NT][4], dp[FA2_NT][4];
    fa2_scores<HS>(p, kf, qs, lane);
    if (want_dk) fa2_scores<HS>(dp, vf, gs, lane);
    bool edge = t0 < j0 + 15 || t0 + FA2_BN > T;
    ZT_UNROLL
    for (int j = 0; j < FA2_NT; j++)
      ZT_UNROLL
      for (int e = 0; e < 4; e++) {
        int qi = 8 * j + 2 * c + (e & 1), key = j0 + g + 8 * (e >> 1);
        p[j][e] = edge && (t0 + qi < key || t0 + qi >= T) ? 0.0f
                                                           : exp2f(p[j][e] * sl2 - ls[qi]);
        if (want_dk) dp[j][e] = p[j][e] * (dp[j][e] - dsh[qi]); /* ds^T */
      }
    if (want_dv) fa2_accum<HS>(dv, p, gs, lane);
    if (want_dk) fa2_accum<HS>(dk, dp, qs, lane);
  }
  bf16 *o = dqkv + (size_t)b * T * rs + koff;
  if (want_dk) fa2_store<HS>(o, rs, j0 + g, T, dk, scale, scale, lane);
  if (want_dv) fa2_store<HS>(o + (size_t)KV * HS, rs, j0 + g, T, dv, 1.0f, 1.0f, lane);
}

/* D = rowsum(dout * out) per head and row, in the attention scratch: the
 * backward's first launch. */
static float *fa2_row_d(const bf16 *dout, const bf16 *out, int B, int T, int C, int NH) {
  int rows = B * NH * T;
  float *D = (float *)scratch(SCR_ATT, (size_t)rows * sizeof(float));
  k_fa2_row_d<<<(rows + 7) / 8, 256, 0, g.stream>>>(D, dout, out, B, T, C, NH);
  ZT_CUDA_LAUNCHED();
  return D;
}

template <int HS>
static void fa2_forward_hs(bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH, int KV) {
  dim3 grid((unsigned)((T + FA2_BM - 1) / FA2_BM), (unsigned)(B * NH));
  k_fa2_fwd<HS><<<grid, FA2_WARPS * 32, 0, g.stream>>>(out, lse, qkv, T, NH, KV,
                                                       FA2_LOG2E / sqrtf((float)HS));
  ZT_CUDA_LAUNCHED();
}

/* One launch of k_fa2_bwd_kv: part PART of dk and dv. */
template <int HS, int PART>
static void fa2_bwd_kv(bf16 *dqkv, const bf16 *dout, const bf16 *qkv, const float *lse,
                       const float *D, int B, int T, int NH, int KV, float scale) {
  dim3 grid((unsigned)((T + FA2_BM - 1) / FA2_BM), (unsigned)(B * KV));
  k_fa2_bwd_kv<HS, PART><<<grid, FA2_WARPS * 32, 0, g.stream>>>(dqkv, qkv, dout, lse, D, T, NH,
                                                                KV, scale, scale * FA2_LOG2E);
  ZT_CUDA_LAUNCHED();
}

template <int HS>
static void fa2_backward_hs(bf16 *dqkv, const bf16 *dout, const bf16 *qkv, const float *lse,
                            const float *D, int B, int T, int NH, int KV) {
  float scale = 1.0f / sqrtf((float)HS);
  unsigned tiles = (unsigned)((T + FA2_BM - 1) / FA2_BM);
  if constexpr (HS <= 64) {
    fa2_bwd_kv<HS, 0>(dqkv, dout, qkv, lse, D, B, T, NH, KV, scale);
  } else { /* dv, then dk (see k_fa2_bwd_kv) */
    fa2_bwd_kv<HS, 1>(dqkv, dout, qkv, lse, D, B, T, NH, KV, scale);
    fa2_bwd_kv<HS, 2>(dqkv, dout, qkv, lse, D, B, T, NH, KV, scale);
  }
  k_fa2_bwd_q<HS><<<dim3(tiles, (unsigned)(B * NH)), FA2_WARPS * 32, 0, g.stream>>>(
      dqkv, qkv, dout, lse, D, T, NH, KV, scale, scale * FA2_LOG2E);
  ZT_CUDA_LAUNCHED();
}

static void fa2_forward(bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH, int KV,
                        int hs) {
  switch (hs) {
    case 16: return fa2_forward_hs<16>(out, lse, qkv, B, T, NH, KV);
    case 32: return fa2_forward_hs<32>(out, lse, qkv, B, T, NH, KV);
    case 48: return fa2_forward_hs<48>(out, lse, qkv, B, T, NH, KV);
    case 64: return fa2_forward_hs<64>(out, lse, qkv, B, T, NH, KV);
    default: return fa2_forward_hs<128>(out, lse, qkv, B, T, NH, KV);
  }
}

static void fa2_backward(bf16 *dqkv, const bf16 *dout, const bf16 *qkv, const bf16 *out,
                         const float *lse, int B, int T, int NH, int KV, int hs) {
  const float *D = fa2_row_d(dout, out, B, T, NH * hs, NH);
  switch (hs) {
    case 16: return fa2_backward_hs<16>(dqkv, dout, qkv, lse, D, B, T, NH, KV);
    case 32: return fa2_backward_hs<32>(dqkv, dout, qkv, lse, D, B, T, NH, KV);
    case 48: return fa2_backward_hs<48>(dqkv, dout, qkv, lse, D, B, T, NH, KV);
    case 64: return fa2_backward_hs<64>(dqkv, dout, qkv, lse, D, B, T, NH, KV);
    default: return fa2_backward_hs<128>(dqkv, dout, qkv, lse, D, B, T, NH, KV);
  }
}

/* ---------------------------------------------------------------------------
 * The path. 1 (the default): flash attention 2 wherever it applies; 0:
 * cuBLASLt for every call (zt_kernels_cuda_set_attention_fa2). */
static int att_fa2_on = 1;

/* Flash attention 2 takes bf16 storage (the callers check sizeof(X)), head
 * sizes 16, 32, 48, 64 and 128 (Llama's), 16-byte aligned q, k, v, dout
 * and gradient rows (C a multiple of 8, as head sizes of 16 make it), and
 * at most 65535 (b, head) pairs (gridDim.y). */
static int att_fa2(int B, int NH, int hs, const void *a, const void *b, const void *c) {
  return att_fa2_on && (hs == 16 || hs == 32 || hs == 48 || hs == 64 || hs == 128) &&
         B * NH <= 65535 && ((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) % 16 == 0;
}

/* The three parts of qkv's rows (q, k, v: NH, KV and KV heads) as fp32
 * heads [B,heads,T,hs] (dir 1: h[i] = the rows' part i), or heads back into
 * the rows (dir 0: the rows' part i = h[i]). */
template <typename D, typename S>
static void att_heads(D *const dst[3], const S *const src[3], int B, int T, int NH, int KV,
                      int hs, int dir) {
  int rs = (int)att_rs(NH, KV, hs), heads[3] = {NH, KV, KV}, coff[3] = {0, NH * hs, (NH + KV) * hs};
  for (int i = 0; i < 3; i++) {
    size_t n = (size_t)B * T * heads[i] * hs;
    k_heads_rows<D, S><<<grid_for(n, 256), 256, 0, g.stream>>>(dst[i], src[i], B, T, heads[i],
                                                               hs, rs, coff[i], dir);
    ZT_CUDA_LAUNCHED();
  }
}

template <typename X>
static void cu_attention_forward_gqa(float *out_, float *lse, const float *qkv_, int B, int T,
                                     int NH, int KV, int hs) {
  if (B <= 0 || T <= 0) return;
  X *out = (X *)out_;
  const X *qkv = (const X *)qkv_;
  if (sizeof(X) == 2 && att_fa2(B, NH, hs, qkv, out, out))
    return fa2_forward((bf16 *)out, lse, (const bf16 *)qkv, B, T, NH, KV, hs);
  int grp = NH / KV, batch = B * KV;
  size_t nq = (size_t)B * T * NH * hs, nkv = (size_t)B * T * KV * hs, tt = (size_t)B * NH * T * T;
  float *q = (float *)scratch(SCR_ATT, (2 * nq + 2 * nkv + tt) * sizeof(float)), *k = q + nq,
        *v = k + nkv, *vacc = v + nkv, *att = vacc + nq;
  float *const heads[3] = {q, k, v};
  const X *const rows[3] = {qkv, qkv, qkv};
  att_heads<float, X>(heads, rows, B, T, NH, KV, hs, 1);
  long long sk = (long long)T * hs, sq = sk * grp, st = (long long)grp * T * T;
  /* att'(t2, (g,t)) = K'^T Q' * scale, the group's G*T query rows at once. */
  lt_gemm(1, 0, T, grp * T, hs, k, hs, sk, q, hs, sq, att, T, st, batch,
          1.0f / sqrtf((float)hs), 0.0f, NULL);
  int nrows = B * NH * T;
  k_causal_softmax<<<(nrows + 7) / 8, 256, 0, g.stream>>>(att, lse, nrows, T);
  ZT_CUDA_LAUNCHED();
  /* vacc' [hs,G*T] = V' [hs,T] att' [T,G*T]. */
  lt_gemm(0, 0, hs, grp * T, T, v, hs, sk, att, T, st, vacc, hs, sq, batch, 1.0f, 0.0f, NULL);
  k_heads_rows<X, float><<<grid_for(nq, 256), 256, 0, g.stream>>>(out, vacc, B, T, NH, hs,
                                                                  NH * hs, 0, 0);
  ZT_CUDA_LAUNCHED();
}

template <typename X>
static void cu_attention_backward_gqa(float *dqkv_, const float *dout_, const float *qkv_,
                                      const float *out_, const float *lse, int B, int T, int NH,
                                      int KV, int hs) {
  if (B <= 0 || T <= 0) return;
  X *dqkv = (X *)dqkv_;
  const X *dout = (const X *)dout_, *qkv = (const X *)qkv_, *out = (const X *)out_;
  if (sizeof(X) == 2 && att_fa2(B, NH, hs, qkv, dout, dqkv))
    return fa2_backward((bf16 *)dqkv, (const bf16 *)dout, (const bf16 *)qkv, (const bf16 *)out,
                        lse, B, T, NH, KV, hs);
  int grp = NH / KV, batch = B * KV;
  size_t nq = (size_t)B * T * NH * hs, nkv = (size_t)B * T * KV * hs, tt = (size_t)B * NH * T * T;
  float *q = (float *)scratch(SCR_ATT, att_cublas_scratch(B, T, NH, KV, hs)), *k = q + nq,
        *v = k + nkv, *dvacc = v + nkv, *dq = dvacc + nq, *dk = dq + nq, *dv = dk + nkv,
        *datt = dv + nkv, *att = datt + tt;
  float *const heads[3] = {q, k, v};
  const X *const rows[3] = {qkv, qkv, qkv};
  att_heads<float, X>(heads, rows, B, T, NH, KV, hs, 1);
  long long sk = (long long)T * hs, sq = sk * grp, st = (long long)grp * T * T;
  float scale = 1.0f / sqrtf((float)hs);
  lt_gemm(1, 0, T, grp * T, hs, k, hs, sk, q, hs, sq, att, T, st, batch, scale, 0.0f, NULL);
  int nrows = B * NH * T;
  k_causal_probs<<<(nrows + 7) / 8, 256, 0, g.stream>>>(att, lse, nrows, T);
  ZT_CUDA_LAUNCHED();
  k_heads_rows<float, X><<<grid_for(nq, 256), 256, 0, g.stream>>>(dvacc, dout, B, T, NH, hs,
                                                                  NH * hs, 0, 1);
  ZT_CUDA_LAUNCHED();
  /* datt'(t2, (g,t)) = V'^T dVacc'. */
  lt_gemm(1, 0, T, grp * T, hs, v, hs, sk, dvacc, hs, sq, datt, T, st, batch, 1.0f, 0.0f, NULL);
  /* dv' [hs,T] = dVacc' [hs,G*T] att'^T: summed over the group's heads. */
  lt_gemm(0, 1, hs, T, grp * T, dvacc, hs, sq, att, T, st, dv, hs, sk, batch, 1.0f, 0.0f, NULL);
  k_causal_softmax_bwd<<<(nrows + 7) / 8, 256, 0, g.stream>>>(datt, att, nrows, T, scale);
  ZT_CUDA_LAUNCHED();
  /* dq' = K' dpre'; dk' = Q' dpre'^T (summed over the group's heads). */
  lt_gemm(0, 0, hs, grp * T, T, k, hs, sk, datt, T, st, dq, hs, sq, batch, 1.0f, 0.0f, NULL);
  lt_gemm(0, 1, hs, T, grp * T, q, hs, sq, datt, T, st, dk, hs, sk, batch, 1.0f, 0.0f, NULL);
  X *const drows[3] = {dqkv, dqkv, dqkv};
  const float *const dheads[3] = {dq, dk, dv};
  att_heads<X, float>(drows, dheads, B, T, NH, KV, hs, 0);
}

/* Multi-head attention is the grouped kind with one query head per group. */
template <typename X>
static void cu_attention_forward(float *out, float *lse, const float *qkv, int B, int T, int C,
                                 int NH) {
  cu_attention_forward_gqa<X>(out, lse, qkv, B, T, NH, NH, C / NH);
}

template <typename X>
static void cu_attention_backward(float *dqkv, const float *dout, const float *qkv,
                                  const float *out, const float *lse, int B, int T, int C,
                                  int NH) {
  cu_attention_backward_gqa<X>(dqkv, dout, qkv, out, lse, B, T, NH, NH, C / NH);
}

/* ---------------------------------------------------------------------------
 * Elementwise kernels. */

/* GELU's forward and backward of one element. */
__device__ __forceinline__ float gelu_of(float x) {
  float cube = ZT_GELU_CUBE * x * x * x;
  return 0.5f * x * (1.0f + tanhf(ZT_GELU_SCALE * (x + cube)));
}

__device__ __forceinline__ float gelu_grad(float x) {
  float cube = ZT_GELU_CUBE * x * x * x;
  float arg = ZT_GELU_SCALE * (x + cube);
  float th = tanhf(arg), ch = coshf(arg);
  float sech2 = 1.0f / (ch * ch);
  return 0.5f * (1.0f + th) +
         x * 0.5f * sech2 * ZT_GELU_SCALE * (1.0f + 3.0f * ZT_GELU_CUBE * x * x);
}

template <typename X, int VEC>
__global__ void k_gelu_fwd(X *out, const X *inp, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    float f[VEC];
    ldv<VEC>(f, inp + j * VEC);
    for (int k = 0; k < VEC; k++) f[k] = gelu_of(f[k]);
    stv<VEC>(out + j * VEC, f);
  }
}

template <typename X, int VEC>
__global__ void k_gelu_bwd(X *dinp, const X *inp, const X *dout, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    float f[VEC], d[VEC];
    ldv<VEC>(f, inp + j * VEC), ldv<VEC>(d, dout + j * VEC);
    for (int k = 0; k < VEC; k++) f[k] = gelu_grad(f[k]) * d[k];
    stv<VEC>(dinp + j * VEC, f);
  }
}

/* out = a + b over n / VEC vectors. */
template <typename X, int VEC>
__global__ void k_residual(X *out, const X *a, const X *b, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    float f[VEC], g[VEC];
    ldv<VEC>(f, a + j * VEC), ldv<VEC>(g, b + j * VEC);
    for (int k = 0; k < VEC; k++) f[k] += g[k];
    stv<VEC>(out + j * VEC, f);
  }
}

/* Between fp32 and the storage type: dst = src rounded (narrow), or
 * widened (widen, exact). */
template <typename X, int VEC>
__global__ void k_narrow_x(X *dst, const float *src, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    float f[VEC];
    ldv<VEC>(f, src + j * VEC);
    stv<VEC>(dst + j * VEC, f);
  }
}

template <typename X, int VEC>
__global__ void k_widen_x(float *dst, const X *src, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    float f[VEC];
    ldv<VEC>(f, src + j * VEC);
    stv<VEC>(dst + j * VEC, f);
  }
}

__global__ void k_scale(float *x, size_t n, float s) {
  ZT_GRID_STRIDE(i, n) x[i] *= s;
}

template <typename X>
static void cu_gelu_forward(float *out, const float *inp, size_t n) {
  ZT_LAUNCH_X8(k_gelu_fwd, X, n, vec_fits(8, sizeof(X), n, {out, inp}), (X *)out,
               (const X *)inp, n);
}

template <typename X>
static void cu_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n) {
  ZT_LAUNCH_X8(k_gelu_bwd, X, n, vec_fits(8, sizeof(X), n, {dinp, inp, dout}), (X *)dinp,
               (const X *)inp, (const X *)dout, n);
}

/* GELU in the products' epilogues (zt_kernels.h, matmul_gelu_forward and
 * matmul_backward_dgelu): cuBLASLt's GELU_AUX_BIAS keeps the product plus
 * bias (GELU's input) in pre and stores its GELU in out, and DGELU
 * multiplies the input gradient's product by GELU's derivative at pre, so
 * neither GELU pass reads or writes the N x OC activations on its own.
 * The GELU is taken of the unrounded sum, and its derivative multiplies
 * the unrounded product: in bf16, one rounding fewer than the two calls
 * (docs/gpu.md). Where cuBLASLt has no such kernel for the shape or type
 * (or gelu_epilogue is 0), the two calls run instead. */
static int gelu_epilogue = 1;

template <typename X>
static void cu_matmul_gelu_forward(float *out_, float *pre_, const float *inp_, const float *w_,
                                   const float *bias_, int N, int IC, int OC) {
  if (N <= 0 || OC <= 0) return;
  const X *inp = (const X *)inp_, *w = (const X *)w_;
  const X *bias = epilogue_bias((const X *)bias_, OC);
  if (gelu_epilogue && bias && OC % 8 == 0 &&
      lt_gemm_epi(1, 0, OC, N, IC, w, IC, 0, inp, IC, 0, (X *)out_, OC, 0, 1, 1.0f, 0.0f, bias,
                  EPI_GELU_AUX, (const X *)pre_, OC) == 0)
    return;
  matmul_forward_x((X *)pre_, inp, w, bias, N, IC, OC);
  cu_gelu_forward<X>(out_, pre_, (size_t)N * OC);
}

template <typename X>
static void cu_matmul_backward_dgelu(float *dinp, float *dw, float *dbias, const float *dout_,
                                     const float *inp_, const float *w_, const float *pre_, int N,
                                     int IC, int OC) {
  if (N <= 0 || OC <= 0) return;
  const X *dout = (const X *)dout_, *inp = (const X *)inp_, *w = (const X *)w_;
  if (gelu_epilogue && dinp && IC % 8 == 0 &&
      lt_gemm_epi(0, 0, IC, N, OC, w, IC, 0, dout, OC, 0, (X *)dinp, IC, 0, 1, 1.0f, 0.0f,
                  (const X *)NULL, EPI_DGELU, (const X *)pre_, IC) == 0) {
    matmul_backward_wb(dw, dbias, dout, inp, N, IC, OC);
    return;
  }
  cu_matmul_backward<X>(dinp, dw, dbias, dout_, inp_, w_, N, IC, OC);
  if (dinp) cu_gelu_backward<X>(dinp, pre_, dinp, (size_t)N * IC);
}

template <typename X>
static void cu_residual_forward(float *out, const float *a, const float *b, size_t n) {
  ZT_LAUNCH_X8(k_residual, X, n, vec_fits(8, sizeof(X), n, {out, a, b}), (X *)out, (const X *)a,
               (const X *)b, n);
}

/* ---------------------------------------------------------------------------
 * The Llama operations (zt_kernels.h; the CPU twins are kernels/cpu/llama.c).
 * Deterministic: RMSNorm a warp per row, the rest a thread per element or
 * row; the one reduction across rows (RMSNorm's weight gradient) is the
 * column sums'. */

/* RMSNorm as LayerNorm above: a warp per row, groups of 8 per lane; the
 * weight gradient is the column sums' dnorm with a mean of 0. */
template <typename X, bool V8>
__global__ void k_rmsnorm_fwd(X *out, float *rstd, const X *inp, const X *w, int N, int C,
                              float eps) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const X *x = inp + (size_t)row * C;
  float ss = 0.0f, f[8], wv[8];
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(f, x, i, C);
    for (int k = 0; k < 8; k++) ss += f[k] * f[k];
  }
  float s = 1.0f / sqrtf(warp_sum(ss) / C + eps);
  X *o = out + (size_t)row * C;
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(f, x, i, C), ld8<V8>(wv, w, i, C);
    for (int k = 0; k < 8; k++) f[k] = f[k] * s * wv[k];
    st8<V8>(o, f, i, C);
  }
  if (lane == 0) rstd[row] = s;
}

template <typename X, bool V8>
__global__ void k_rmsnorm_bwd_dx(X *dinp, const X *dout, const X *inp, const X *w,
                                 const float *rstd, int N, int C) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const X *x = inp + (size_t)row * C, *d = dout + (size_t)row * C;
  X *dx = dinp + (size_t)row * C;
  float s = rstd[row], gx = 0.0f, xv[8], wv[8], dv[8], gv[8];
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(xv, x, i, C), ld8<V8>(wv, w, i, C), ld8<V8>(dv, d, i, C);
    for (int k = 0; k < 8; k++) gx += wv[k] * dv[k] * xv[k];
  }
  float kk = warp_sum(gx) / C * s * s * s;
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(xv, x, i, C), ld8<V8>(wv, w, i, C), ld8<V8>(dv, d, i, C), ld8<V8>(gv, dx, i, C);
    for (int k = 0; k < 8; k++) gv[k] += s * wv[k] * dv[k] - xv[k] * kk;
    st8<V8>(dx, gv, i, C);
  }
}

template <typename X>
static void cu_rmsnorm_forward(float *out_, float *rstd, const float *inp_, const float *w_, int N,
                               int C, float eps) {
  if (N <= 0) return;
  X *out = (X *)out_;
  const X *inp = (const X *)inp_, *w = (const X *)w_;
  unsigned grid = (unsigned)((N + 7) / 8);
  if (vec_fits(8, sizeof(X), (size_t)C, {out, inp, w}))
    k_rmsnorm_fwd<X, true><<<grid, 256, 0, g.stream>>>(out, rstd, inp, w, N, C, eps);
  else
    k_rmsnorm_fwd<X, false><<<grid, 256, 0, g.stream>>>(out, rstd, inp, w, N, C, eps);
  ZT_CUDA_LAUNCHED();
}

template <typename X>
static void cu_rmsnorm_backward(float *dinp_, float *dw, const float *dout_, const float *inp_,
                                const float *w_, const float *rstd, int N, int C) {
  if (N <= 0) return;
  X *dinp = (X *)dinp_;
  const X *dout = (const X *)dout_, *inp = (const X *)inp_, *w = (const X *)w_;
  unsigned grid = (unsigned)((N + 7) / 8);
  if (vec_fits(8, sizeof(X), (size_t)C, {dinp, dout, inp, w}))
    k_rmsnorm_bwd_dx<X, true><<<grid, 256, 0, g.stream>>>(dinp, dout, inp, w, rstd, N, C);
  else
    k_rmsnorm_bwd_dx<X, false><<<grid, 256, 0, g.stream>>>(dinp, dout, inp, w, rstd, N, C);
  ZT_CUDA_LAUNCHED();
  if (dw) colsums((float *)NULL, dw, dout, inp, (const float *)NULL, rstd, N, C);
}

/* LoRA (zt_kernels.h). Merge: one thread per weight, its R products summed
 * in fp32 in order. */
template <typename X>
__global__ void k_lora_merge(X *w, const X *base, const X *a, const X *b, int O, int IN, int R,
                             float s) {
  ZT_GRID_STRIDE(j, (size_t)O * IN) {
    size_t o = j / IN, i = j % IN;
    float acc = 0.0f;
    for (int r = 0; r < R; r++) acc += ldx(b[o * R + r]) * ldx(a[(size_t)r * IN + i]);
    put(w[j], ldx(base[j]) + s * acc);
  }
}

/* da[r,i] += s * sum over o of b[o,r] dw[o,i]: one thread per element of da
 * (neighbours read neighbouring columns of dw). */
template <typename X>
__global__ void k_lora_grad_a(float *da, const float *dw, const X *b, int O, int IN, int R,
                              float s) {
  ZT_GRID_STRIDE(j, (size_t)R * IN) {
    size_t r = j / IN, i = j % IN;
    float acc = 0.0f;
    for (int o = 0; o < O; o++) acc += ldx(b[(size_t)o * R + r]) * dw[(size_t)o * IN + i];
    da[j] += s * acc;
  }
}

/* db[o,r] += s * sum over i of dw[o,i] a[r,i]: one warp per element, its
 * lanes striding over i, then warp_sum (a fixed order). */
template <typename X>
__global__ void k_lora_grad_b(float *db, const float *dw, const X *a, int O, int IN, int R,
                              float s) {
  size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  int lane = threadIdx.x % 32;
  if (warp >= (size_t)O * R) return;
  size_t o = warp / R, r = warp % R;
  float acc = 0.0f;
  for (int i = lane; i < IN; i += 32) acc += dw[o * IN + i] * ldx(a[r * IN + i]);
  acc = warp_sum(acc);
  if (lane == 0) db[warp] += s * acc;
}

template <typename X>
static void cu_lora_merge(float *w, const float *base, const float *a, const float *b, int O,
                          int IN, int R, float s) {
  ZT_LAUNCH_1D(k_lora_merge<X>, (size_t)O * IN, (X *)w, (const X *)base, (const X *)a,
               (const X *)b, O, IN, R, s);
}

template <typename X>
static void cu_lora_grad(float *da, float *db, const float *dw, const float *a, const float *b,
                         int O, int IN, int R, float s) {
  ZT_LAUNCH_1D(k_lora_grad_a<X>, (size_t)R * IN, da, dw, (const X *)b, O, IN, R, s);
  size_t threads = (size_t)O * R * 32;
  if (!threads) return;
  k_lora_grad_b<X><<<(unsigned)((threads + 255) / 256), 256, 0, g.stream>>>(db, dw, (const X *)a,
                                                                           O, IN, R, s);
  ZT_CUDA_LAUNCHED();
}

/* One thread per (row, q or k head, pair). */
template <typename X>
__global__ void k_rope(X *qkv, int T, int pos0, int NH, int NKV, int HD, zt_rope_t rope,
                       int inverse, size_t n) {
  int half = HD / 2, heads = NH + NKV, W = (NH + 2 * NKV) * HD;
  ZT_GRID_STRIDE(j, n) {
    int i = (int)(j % half);
    size_t rh = j / half;
    int h = (int)(rh % heads);
    size_t bt = rh / heads;
    float t = (float)(pos0 + (int)(bt % T));
    float inv = zt_rope_inv_freq(rope, i, HD);
    float ang = t * inv, c = cosf(ang), sn = inverse ? -sinf(ang) : sinf(ang);
    X *x = qkv + bt * W + (size_t)h * HD;
    float a = ldx(x[i]), b = ldx(x[i + half]);
    put(x[i], a * c - b * sn);
    put(x[i + half], b * c + a * sn);
  }
}

template <typename X>
static void cu_rope(float *qkv, int B, int T, int pos0, int NH, int NKV, int HD, zt_rope_t rope,
                    int inverse) {
  size_t n = (size_t)B * T * (NH + NKV) * (HD / 2);
  ZT_LAUNCH_1D(k_rope<X>, n, (X *)qkv, T, pos0, NH, NKV, HD, rope, inverse, n);
}

/* SwiGLU over rows of F: VEC consecutive columns of a row at a time (F a
 * multiple of VEC). */
template <typename X, int VEC>
__global__ void k_swiglu_fwd(X *out, const X *inp, int F, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t e = j * VEC, r = e / F;
    const X *in = inp + r * 2 * F + e % F;
    float g[VEC], u[VEC];
    ldv<VEC>(g, in), ldv<VEC>(u, in + F);
    for (int k = 0; k < VEC; k++) g[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    stv<VEC>(out + e, g);
  }
}

template <typename X, int VEC>
__global__ void k_swiglu_bwd(X *dinp, const X *dout, const X *inp, int F, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t e = j * VEC, r = e / F, o = r * 2 * F + e % F;
    float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC];
    ldv<VEC>(g, inp + o), ldv<VEC>(u, inp + o + F), ldv<VEC>(d, dout + e);
    for (int k = 0; k < VEC; k++) {
      float s = 1.0f / (1.0f + expf(-g[k]));
      du[k] = d[k] * g[k] * s;
      dg[k] = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
    }
    stv<VEC>(dinp + o, dg), stv<VEC>(dinp + o + F, du);
  }
}

template <typename X>
static void cu_swiglu_forward(float *out, const float *inp, int N, int F) {
  size_t n = (size_t)N * F;
  ZT_LAUNCH_X8(k_swiglu_fwd, X, n, vec_fits(8, sizeof(X), (size_t)F, {out, inp}), (X *)out,
               (const X *)inp, F, n);
}

template <typename X>
static void cu_swiglu_backward(float *dinp, const float *dout, const float *inp, int N, int F) {
  size_t n = (size_t)N * F;
  ZT_LAUNCH_X8(k_swiglu_bwd, X, n, vec_fits(8, sizeof(X), (size_t)F, {dinp, dout, inp}),
               (X *)dinp, (const X *)dout, (const X *)inp, F, n);
}

template <typename X>
static void cu_narrow_x(void *dst, const float *src, size_t n) {
  ZT_LAUNCH_X8(k_narrow_x, X, n, vec_fits(8, sizeof(X), n, {dst}) && vec_fits(8, 4, n, {src}),
               (X *)dst, src, n);
}

template <typename X>
static void cu_widen_x(float *dst, const void *src, size_t n) {
  ZT_LAUNCH_X8(k_widen_x, X, n, vec_fits(8, sizeof(X), n, {src}) && vec_fits(8, 4, n, {dst}),
               dst, (const X *)src, n);
}

static void cu_scale(float *x, size_t n, float s) {
  ZT_LAUNCH_1D(k_scale, n, x, n, s);
}

static void cu_zero(float *x, size_t n) {
  if (!n) return;
  ZT_CUDA_CHECK(cudaMemsetAsync(x, 0, n * sizeof(float), g.stream));
}

/* ---------------------------------------------------------------------------
 * Softmax + cross-entropy: one block per row. probs may alias logits: every
 * read of the row (maximum, sum, the target's logit) happens before the
 * barrier that precedes the first write. */

/* A row's maximum and sum of exponentials over its first V columns, in
 * one read: each thread keeps a running maximum and rescales its sum when
 * the maximum grows, then the threads' pairs are combined. Every thread
 * gets both. */
template <bool V8, typename X>
__device__ void row_max_sum(const X *l, int V, int Vp, float *sh, float *mx_out, float *s_out) {
  float mx = -INFINITY, s = 0.0f, f[8];
  for (int i = threadIdx.x * 8; i < V; i += blockDim.x * 8) {
    ld8<V8>(f, l, i, Vp);
    for (int k = 0; k < 8 && i + k < V; k++) {
      if (f[k] == -INFINITY) continue; /* exp 0; and -inf - -inf would be NaN */
      if (f[k] > mx) s *= expf(mx - f[k]), mx = f[k];
      s += expf(f[k] - mx);
    }
  }
  float gmx = block_reduce<float, true>(mx, sh);
  *s_out = block_reduce<float, false>(mx == -INFINITY ? 0.0f : s * expf(mx - gmx), sh);
  *mx_out = gmx;
}

/* The forward reads the row once for its maximum and sum (row_max_sum)
 * and once more to write the probabilities. */
template <typename X, bool V8>
__global__ void k_crossentropy_fwd(float *losses, X *probs, const X *logits, const int *targets,
                                   int V, int Vp) {
  __shared__ float sh[ZT_RED_THREADS];
  size_t n = blockIdx.x;
  const X *l = logits + n * Vp;
  X *p = probs + n * Vp;
  float mx, s, f[8];
  row_max_sum<V8>(l, V, Vp, sh, &mx, &s);
  float lt = ldx(l[targets[n]]);
  __syncthreads();
  for (int i = threadIdx.x * 8; i < Vp; i += blockDim.x * 8) {
    ld8<V8>(f, l, i, Vp);
    for (int k = 0; k < 8; k++) f[k] = i + k < V ? expf(f[k] - mx) / s : 0.0f;
    st8<V8>(p, f, i, Vp);
  }
  if (threadIdx.x == 0) losses[n] = -logf(expf(lt - mx) / s);
}

/* The classifier without probabilities (crossentropy_lse_forward and
 * _backward): the forward reads each row once and writes only its loss
 * and lse; the backward forms each probability, exp(l - lse), in the one
 * pass that writes dlogits. */
template <typename X, bool V8>
__global__ void k_xent_lse_fwd(float *losses, float *lse, const X *logits, const int *targets,
                               int V, int Vp) {
  __shared__ float sh[ZT_RED_THREADS];
  size_t n = blockIdx.x;
  const X *l = logits + n * Vp;
  float mx, s;
  row_max_sum<V8>(l, V, Vp, sh, &mx, &s);
  if (threadIdx.x == 0) {
    float z = mx + logf(s);
    lse[n] = z;
    losses[n] = z - ldx(l[targets[n]]);
  }
}

template <typename X, int VEC>
__global__ void k_xent_lse_bwd(X *dlogits, const X *logits, const float *lse, const int *targets,
                               float dloss, int V, int Vp, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t i = j * VEC, row = i / Vp;
    int c = (int)(i % Vp), t = targets[row];
    float z = lse[row], f[VEC];
    ldv<VEC>(f, logits + i);
    for (int k = 0; k < VEC; k++)
      f[k] = c + k < V ? (expf(f[k] - z) - (c + k == t ? 1.0f : 0.0f)) * dloss : 0.0f;
    stv<VEC>(dlogits + i, f);
  }
}

template <typename X>
static void cu_crossentropy_lse_forward(float *losses, float *lse, const float *logits,
                                        const int *targets, int N, int V, int Vp) {
  if (N <= 0) return;
  if (vec_fits(8, sizeof(X), (size_t)Vp, {logits}))
    k_xent_lse_fwd<X, true><<<N, ZT_RED_THREADS, 0, g.stream>>>(losses, lse, (const X *)logits,
                                                                targets, V, Vp);
  else
    k_xent_lse_fwd<X, false><<<N, ZT_RED_THREADS, 0, g.stream>>>(losses, lse, (const X *)logits,
                                                                 targets, V, Vp);
  ZT_CUDA_LAUNCHED();
}

template <typename X>
static void cu_crossentropy_lse_backward(float *dlogits, const float *logits, const float *lse,
                                         const int *targets, float dloss, int N, int V, int Vp) {
  size_t n = (size_t)N * Vp;
  ZT_LAUNCH_X8(k_xent_lse_bwd, X, n, vec_fits(8, sizeof(X), (size_t)Vp, {dlogits, logits}),
               (X *)dlogits, (const X *)logits, lse, targets, dloss, V, Vp, n);
}

template <typename X, int VEC>
__global__ void k_crossentropy_bwd(X *dlogits, const X *probs, const int *targets, float dloss,
                                   int V, int Vp, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t i = j * VEC, row = i / Vp;
    int c = (int)(i % Vp), t = targets[row];
    float f[VEC];
    ldv<VEC>(f, probs + i);
    for (int k = 0; k < VEC; k++)
      f[k] = c + k < V ? (f[k] - (c + k == t ? 1.0f : 0.0f)) * dloss : 0.0f;
    stv<VEC>(dlogits + i, f);
  }
}

template <typename X>
static void cu_crossentropy_forward(float *losses, float *probs, const float *logits,
                                    const int *targets, int N, int V, int Vp) {
  if (N <= 0) return;
  if (vec_fits(8, sizeof(X), (size_t)Vp, {probs, logits}))
    k_crossentropy_fwd<X, true><<<N, ZT_RED_THREADS, 0, g.stream>>>(
        losses, (X *)probs, (const X *)logits, targets, V, Vp);
  else
    k_crossentropy_fwd<X, false><<<N, ZT_RED_THREADS, 0, g.stream>>>(
        losses, (X *)probs, (const X *)logits, targets, V, Vp);
  ZT_CUDA_LAUNCHED();
}

template <typename X>
static void cu_crossentropy_backward(float *dlogits, const float *probs, const int *targets,
                                     float dloss, int N, int V, int Vp) {
  size_t n = (size_t)N * Vp;
  ZT_LAUNCH_X8(k_crossentropy_bwd, X, n, vec_fits(8, sizeof(X), (size_t)Vp, {dlogits, probs}),
               (X *)dlogits, (const X *)probs, targets, dloss, V, Vp, n);
}

/* ---------------------------------------------------------------------------
 * AdamW and norms. */

/* One element's update: the one expression both kernels below compile, so
 * that the fused one gives adamw's bits. */
__device__ __forceinline__ float adamw_elem(float pi, float gi, float *m, float *v, float lr,
                                            float b1, float b2, float eps, float wd, float bc1,
                                            float bc2) {
  float mi = b1 * *m + (1.0f - b1) * gi;
  float vi = b2 * *v + (1.0f - b2) * gi * gi;
  *m = mi;
  *v = vi;
  float mhat = mi / bc1, vhat = vi / bc2;
  pi -= lr * wd * pi;
  pi -= lr * mhat / (sqrtf(vhat) + eps);
  return pi;
}

/* Both AdamW kernels take VEC consecutive elements per thread (4: 16-byte
 * words of p, g, m and v), or 1 where the range's length or a pointer does
 * not allow it; each element's update is adamw_elem either way. */
template <int VEC>
__global__ void k_adamw(float *p, const float *gr, float *m, float *v, size_t n, float lr,
                        float b1, float b2, float eps, float wd, float bc1, float bc2) {
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t i = j * VEC;
    xvec<float, VEC> P = ldr<VEC>(p + i), G = ldr<VEC>(gr + i), M = ldr<VEC>(m + i),
                     S = ldr<VEC>(v + i);
    for (int k = 0; k < VEC; k++)
      P.v[k] = adamw_elem(P.v[k], G.v[k], &M.v[k], &S.v[k], lr, b1, b2, eps, wd, bc1, bc2);
    str<VEC>(p + i, P), str<VEC>(m + i, M), str<VEC>(v + i, S);
  }
}

/* adamw_fused (zt_kernels.h): the gradient narrowed as k_narrow_f64 does,
 * the update of adamw_elem with the element's segment's weight decay, the
 * result rounded into w as k_narrow_x does. The segments come by value
 * (the launch's parameters); a thread finds its element's by a scan that
 * starts from the segment of its previous element. Elements of a skipped
 * segment are written back as they were read. */
template <typename X, int VEC>
__global__ void k_adamw_fused(float *p, const float *g, const double *g64, double s, float t,
                              float *m, float *v, X *w, zt_adamw_args_t a) {
  size_t n = a.end[a.n - 1];
  int seg = 0;
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t i = j * VEC;
    xvec<float, VEC> P = ldr<VEC>(p + i), M = ldr<VEC>(m + i), S = ldr<VEC>(v + i);
    float gv[VEC];
    if (g) {
      xvec<float, VEC> G = ldr<VEC>(g + i);
      for (int k = 0; k < VEC; k++) gv[k] = G.v[k];
    } else {
      xvec<double, VEC> G = ldr<VEC>(g64 + i);
      for (int k = 0; k < VEC; k++) gv[k] = (float)(G.v[k] * s) * t;
    }
    for (int k = 0; k < VEC; k++) {
      while (i + k >= a.end[seg]) seg++;
      if (!(a.skip >> seg & 1u))
        P.v[k] = adamw_elem(P.v[k], gv[k], &M.v[k], &S.v[k], a.lr, a.b1, a.b2, a.eps, a.wd[seg],
                            a.bc1, a.bc2);
    }
    str<VEC>(p + i, P), str<VEC>(m + i, M), str<VEC>(v + i, S);
    if (w) stv<VEC>(w + i, P.v);
  }
}

template <typename X>
static void cu_adamw_fused(float *p, const float *gr, const double *g64, double s, float t,
                           float *m, float *v, void *w, const zt_adamw_args_t *a) {
  if (a->n < 1 || a->n > ZT_ADAMW_SEGS)
    cuda_fail("adamw_fused", "segment count out of range", __FILE__, __LINE__);
  size_t n = a->end[a->n - 1];
  if (!n) return;
  if (vec_fits(4, 4, n, {p, gr, m, v}) && vec_fits(4, 8, n, {g64}) &&
      vec_fits(4, sizeof(X), n, {w}))
    k_adamw_fused<X, 4><<<grid_for(n / 4, 256), 256, 0, g.stream>>>(p, gr, g64, s, t, m, v,
                                                                    (X *)w, *a);
  else
    k_adamw_fused<X, 1><<<grid_for(n, 256), 256, 0, g.stream>>>(p, gr, g64, s, t, m, v, (X *)w,
                                                                *a);
  ZT_CUDA_LAUNCHED();
}

static void cu_adamw(float *p, const float *gr, float *m, float *v, size_t n, float lr, float b1,
                     float b2, float eps, float wd, float bc1, float bc2) {
  if (!n) return;
  if (vec_fits(4, 4, n, {p, gr, m, v}))
    k_adamw<4><<<grid_for(n / 4, 256), 256, 0, g.stream>>>(p, gr, m, v, n, lr, b1, b2, eps, wd,
                                                           bc1, bc2);
  else
    k_adamw<1><<<grid_for(n, 256), 256, 0, g.stream>>>(p, gr, m, v, n, lr, b1, b2, eps, wd, bc1,
                                                       bc2);
  ZT_CUDA_LAUNCHED();
}

/* One block per ZT_KERNELS_SUMSQ_CHUNK elements, summed in double with a fixed
 * tree; the host adds the chunk sums in order (sum_chunks). The value
 * squared is x for fp32 input (sumsq) and (float)(x * s) for fp64 input
 * (sumsq_f64). */
__device__ __forceinline__ double sq_value(float x, double) { return x; }
__device__ __forceinline__ double sq_value(double x, double s) { return (float)(x * s); }

template <typename T>
__global__ void k_sumsq_chunks(double *part, const T *x, size_t n, double s) {
  __shared__ double sh[ZT_RED_THREADS];
  size_t c0 = (size_t)blockIdx.x * ZT_KERNELS_SUMSQ_CHUNK;
  size_t c1 = c0 + ZT_KERNELS_SUMSQ_CHUNK < n ? c0 + ZT_KERNELS_SUMSQ_CHUNK : n;
  double acc = 0.0;
  for (size_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
    double v = sq_value(x[i], s);
    acc += v * v;
  }
  acc = block_reduce<double, false>(acc, sh);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

/* Adds the chunk sums of `part` on the host, in order. */
static double sum_chunks(const double *part, size_t chunks) {
  if (cap_refuse("a sum read back to the host")) return 0.0;
  if (g.sumsq_host_n < chunks) {
    free(g.sumsq_host);
    g.sumsq_host = (double *)malloc(chunks * sizeof(double));
    if (!g.sumsq_host) cuda_fail("malloc", "out of host memory", __FILE__, __LINE__);
    g.sumsq_host_n = chunks;
  }
  ZT_CUDA_CHECK(cudaMemcpyAsync(g.sumsq_host, part, chunks * sizeof(double),
                                cudaMemcpyDeviceToHost, g.stream));
  stream_wait();
  double total = 0.0;
  for (size_t i = 0; i < chunks; i++) total += g.sumsq_host[i];
  return total;
}

template <typename T>
static double sumsq_chunked(const T *x, size_t n, double s) {
  if (!n) return 0.0;
  size_t chunks = (n + ZT_KERNELS_SUMSQ_CHUNK - 1) / ZT_KERNELS_SUMSQ_CHUNK;
  double *part = (double *)scratch(SCR_SUMSQ, chunks * sizeof(double));
  k_sumsq_chunks<T><<<(unsigned)chunks, ZT_RED_THREADS, 0, g.stream>>>(part, x, n, s);
  ZT_CUDA_LAUNCHED();
  return sum_chunks(part, chunks);
}

static double cu_sumsq(const float *x, size_t n) { return sumsq_chunked(x, n, 1.0); }



/* ---------------------------------------------------------------------------
 * Optimizer-state helpers (fp64 gradient sums). */

__global__ void k_acc_f64(double *acc, const float *x, size_t n) {
  ZT_GRID_STRIDE(i, n) acc[i] += x[i];
}

__global__ void k_add_f64(double *acc, const double *y, size_t n) {
  ZT_GRID_STRIDE(i, n) acc[i] += y[i];
}

__global__ void k_widen_f64(double *dst, const float *x, size_t n) {
  ZT_GRID_STRIDE(i, n) dst[i] = x[i];
}

__global__ void k_narrow_f64(float *dst, const double *x, size_t n, double s, float t) {
  ZT_GRID_STRIDE(i, n) dst[i] = (float)(x[i] * s) * t;
}

static void cu_acc_f64(double *acc, const float *x, size_t n) {
  ZT_LAUNCH_1D(k_acc_f64, n, acc, x, n);
}

static void cu_add_f64(double *acc, const double *y, size_t n) {
  ZT_LAUNCH_1D(k_add_f64, n, acc, y, n);
}

static void cu_widen_f64(double *dst, const float *x, size_t n) {
  ZT_LAUNCH_1D(k_widen_f64, n, dst, x, n);
}

static void cu_narrow_f64(float *dst, const double *x, size_t n, double s, float t) {
  ZT_LAUNCH_1D(k_narrow_f64, n, dst, x, n, s, t);
}

static double cu_sumsq_f64(const double *x, size_t n, double s) {
  return sumsq_chunked(x, n, s);
}

/* ---------------------------------------------------------------------------
 * The table, initialisation and device helpers. */

/* Table memory: device memory. Allocation failure returns NULL (the
 * caller reports it); the copies are complete when they return. */
static void *cu_alloc(size_t bytes) {
  void *p = NULL;
  if (cap_refuse("alloc")) return NULL;
  if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
    (void)cudaGetLastError();
    return NULL;
  }
  ZT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes ? bytes : 1, g.stream));
  return p;
}

static void cu_sync(void) {
  if (cap_refuse("sync")) return;
  stream_wait();
}

static void *cu_stream(void) { return (void *)g.stream; }

static void cu_set_waiter(void (*fn)(void *ctx), void *ctx) {
  waiter.fn = fn;
  waiter.ctx = ctx;
}

static void cu_release(void *p) {
  if (!p || cap_refuse("release")) return;
  stream_wait();
  ZT_CUDA_CHECK(cudaFree(p));
}

static void cu_upload(void *dst, const void *src, size_t bytes) {
  if (!bytes || cap_refuse("upload")) return;
  ZT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g.stream));
  /* The source is pageable host memory the caller may reuse at once. */
  stream_wait();
}

static void cu_download(void *dst, const void *src, size_t bytes) {
  if (!bytes || cap_refuse("download")) return;
  ZT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, g.stream));
  stream_wait();
}

static void cu_copy(void *dst, const void *src, size_t bytes) {
  if (!bytes) return;
  ZT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g.stream));
}

static void cu_memzero(void *p, size_t bytes) {
  if (!bytes) return;
  ZT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, g.stream));
}

/* ---------------------------------------------------------------------------
 * CUDA graphs (zt_kernels.h: graph_begin .. graph_free; docs/gpu.md, "CUDA
 * graphs"). The table's calls between graph_begin and graph_end are
 * captured from the module's stream (thread-local mode: other threads are
 * not restricted) into one executable graph; graph_launch enqueues it on
 * the same stream, one launch for the whole sequence. A call that cannot be
 * in a graph (cap_refuse above) or a capture the driver invalidates makes
 * graph_end return NULL with the reason, and nothing recorded ever runs. */

static int cu_graph_begin(char *why, size_t n) {
  if (cap.on) {
    snprintf(why, n, "a capture is open already");
    return -1;
  }
  if (prof.on) {
    snprintf(why, n, "the profile is on (it times each call with events of its own)");
    return -1;
  }
  cudaError_t e = cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(why, n, "cudaStreamBeginCapture: %s", cudaGetErrorString(e));
    return -1;
  }
  cap.owner = pthread_self();
  cap.fail[0] = 0;
  __atomic_store_n(&cap.on, 1, __ATOMIC_RELEASE);
  return 0;
}

/* What graph_end returns: the executable graph (NULL for a capture with
 * no work, as between two hooks in a row: nothing to launch) and the
 * epoch it was recorded in. */
typedef struct {
  cudaGraphExec_t x;
  unsigned long epoch;
} cu_graph;

static void *cu_graph_end(char *why, size_t n) {
  cap_same_thread("graph_end");
  if (!cap.on) {
    snprintf(why, n, "no capture is open");
    return NULL;
  }
  cudaGraph_t gr = NULL;
  cudaGraphExec_t x = NULL;
  size_t nodes = 0;
  cudaError_t e = cudaStreamEndCapture(g.stream, &gr);
  __atomic_store_n(&cap.on, 0, __ATOMIC_RELEASE);
  const char *call = "cudaStreamEndCapture";
  if (e == cudaSuccess && !cap.fail[0]) {
    call = "cudaGraphGetNodes";
    e = cudaGraphGetNodes(gr, NULL, &nodes);
  }
  if (e == cudaSuccess && !cap.fail[0] && nodes) {
    call = "cudaGraphInstantiate";
    e = cudaGraphInstantiate(&x, gr, 0);
  }
  if (gr) ZT_CUDA_CHECK(cudaGraphDestroy(gr));
  if (!cap.fail[0] && e == cudaSuccess) {
    cu_graph *r = (cu_graph *)malloc(sizeof *r);
    if (!r) cuda_fail("malloc", "out of host memory", __FILE__, __LINE__);
    r->x = x;
    r->epoch = cap.epoch;
    return r;
  }
  if (cap.fail[0]) snprintf(why, n, "%s", cap.fail);
  else snprintf(why, n, "%s: %s", call, cudaGetErrorString(e));
  (void)cudaGetLastError();
  if (x) ZT_CUDA_CHECK(cudaGraphExecDestroy(x));
  return NULL;
}

static int cu_graph_launch(void *p) {
  cap_same_thread("graph_launch");
  const cu_graph *r = (const cu_graph *)p;
  if (r->epoch != cap.epoch) return -1; /* stale: nothing enqueued */
  if (r->x) ZT_CUDA_CHECK(cudaGraphLaunch(r->x, g.stream));
  return 0;
}

static void cu_graph_free(void *p) {
  cap_same_thread("graph_free");
  cu_graph *r = (cu_graph *)p;
  if (!r) return;
  if (r->x) {
    stream_wait(); /* a launch may still run */
    ZT_CUDA_CHECK(cudaGraphExecDestroy(r->x));
  }
  free(r);
}

/* The table's entries go through prof_fn<F, f>::call, which times f when
 * the profile is on (see "The profile" above). */
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

/* The two tables, filled at init: fp32 storage ("cuda") and bf16 storage
 * ("cuda-bf16"); everything but the storage-typed kernels is shared. */
static zt_kernels_t zt_cuda_table, zt_cuda_table_bf16;

template <typename X>
static void fill_table(zt_kernels_t *t, const char *name) {
  t->name = name;
  t->xbytes = (int)sizeof(X);
  ZT_PROF_ENTRY(t, encoder_forward, cu_encoder_forward<X>);
  ZT_PROF_ENTRY(t, encoder_backward, cu_encoder_backward<X>);
  ZT_PROF_ENTRY(t, layernorm_forward, cu_layernorm_forward<X>);
  ZT_PROF_ENTRY(t, layernorm_backward, cu_layernorm_backward<X>);
  ZT_PROF_ENTRY(t, residual_layernorm_forward, cu_residual_layernorm_forward<X>);
  ZT_PROF_ENTRY(t, matmul_forward, cu_matmul_forward<X>);
  ZT_PROF_ENTRY(t, matmul_backward, cu_matmul_backward<X>);
  ZT_PROF_ENTRY(t, attention_forward, cu_attention_forward<X>);
  ZT_PROF_ENTRY(t, attention_backward, cu_attention_backward<X>);
  ZT_PROF_ENTRY(t, attention_forward_gqa, cu_attention_forward_gqa<X>);
  ZT_PROF_ENTRY(t, attention_backward_gqa, cu_attention_backward_gqa<X>);
  ZT_PROF_ENTRY(t, gelu_forward, cu_gelu_forward<X>);
  ZT_PROF_ENTRY(t, gelu_backward, cu_gelu_backward<X>);
  ZT_PROF_ENTRY(t, matmul_gelu_forward, cu_matmul_gelu_forward<X>);
  ZT_PROF_ENTRY(t, matmul_backward_dgelu, cu_matmul_backward_dgelu<X>);
  ZT_PROF_ENTRY(t, residual_forward, cu_residual_forward<X>);
  ZT_PROF_ENTRY(t, crossentropy_forward, cu_crossentropy_forward<X>);
  ZT_PROF_ENTRY(t, crossentropy_backward, cu_crossentropy_backward<X>);
  ZT_PROF_ENTRY(t, crossentropy_lse_forward, cu_crossentropy_lse_forward<X>);
  ZT_PROF_ENTRY(t, crossentropy_lse_backward, cu_crossentropy_lse_backward<X>);
  ZT_PROF_ENTRY(t, rmsnorm_forward, cu_rmsnorm_forward<X>);
  ZT_PROF_ENTRY(t, rmsnorm_backward, cu_rmsnorm_backward<X>);
  ZT_PROF_ENTRY(t, rope, cu_rope<X>);
  ZT_PROF_ENTRY(t, swiglu_forward, cu_swiglu_forward<X>);
  ZT_PROF_ENTRY(t, swiglu_backward, cu_swiglu_backward<X>);
  ZT_PROF_ENTRY(t, lora_merge, cu_lora_merge<X>);
  ZT_PROF_ENTRY(t, lora_grad, cu_lora_grad<X>);
  ZT_PROF_ENTRY(t, narrow_x, cu_narrow_x<X>);
  ZT_PROF_ENTRY(t, widen_x, cu_widen_x<X>);
  ZT_PROF_ENTRY(t, adamw, cu_adamw);
  ZT_PROF_ENTRY(t, adamw_fused, cu_adamw_fused<X>);
  ZT_PROF_ENTRY(t, sumsq, cu_sumsq);
  ZT_PROF_ENTRY(t, scale, cu_scale);
  ZT_PROF_ENTRY(t, zero, cu_zero);
  ZT_PROF_ENTRY(t, acc_f64, cu_acc_f64);
  ZT_PROF_ENTRY(t, add_f64, cu_add_f64);
  ZT_PROF_ENTRY(t, widen_f64, cu_widen_f64);
  ZT_PROF_ENTRY(t, narrow_f64, cu_narrow_f64);
  ZT_PROF_ENTRY(t, sumsq_f64, cu_sumsq_f64);
  ZT_PROF_ENTRY(t, copy, cu_copy);
  ZT_PROF_ENTRY(t, memzero, cu_memzero);
  t->alloc = cu_alloc;
  t->release = cu_release;
  t->sync = cu_sync;
  t->stream = cu_stream;
  t->set_waiter = cu_set_waiter;
  ZT_PROF_ENTRY(t, upload, cu_upload);
  ZT_PROF_ENTRY(t, download, cu_download);
  t->graph_begin = cu_graph_begin;
  t->graph_end = cu_graph_end;
  t->graph_launch = cu_graph_launch;
  t->graph_free = cu_graph_free;
}
extern "C" int zt_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

extern "C" int zt_kernels_cuda_init(int device, char *err, size_t errlen) {
  if (g.init) {
    /* The current device is per thread: a later call from another thread
     * (zworker's trainer thread) makes it current there too. */
    if (device == g.device) {
      ZT_CUDA_CHECK(cudaSetDevice(device));
      return 0;
    }
    snprintf(err, errlen, "CUDA kernels already initialised on device %d, not %d", g.device,
             device);
    return -1;
  }
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    snprintf(err, errlen, "no CUDA device: %s",
             e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount returned 0");
    (void)cudaGetLastError();
    return -1;
  }
  if (device < 0 || device >= n) {
    snprintf(err, errlen, "CUDA device %d does not exist (this machine has %d)", device, n);
    return -1;
  }
  ZT_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop;
  ZT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  snprintf(g.name, sizeof g.name, "%s", prop.name);
  g.mem = prop.totalGlobalMem;
  ZT_CUDA_CHECK(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
  ZT_CUBLAS_CHECK(cublasLtCreate(&g.lt));
  g.lt_ws_size = 32u << 20;
  ZT_CUDA_CHECK(cudaMalloc(&g.lt_ws, g.lt_ws_size));
  g.device = device;
  g.math = ZT_CUDA_MATH_FP32;
  fill_table<float>(&zt_cuda_table, "cuda");
  fill_table<bf16>(&zt_cuda_table_bf16, "cuda-bf16");
  g.init = 1;
  return 0;
}

extern "C" const zt_kernels_t *zt_kernels_cuda(void) { return g.init ? &zt_cuda_table : NULL; }
extern "C" const zt_kernels_t *zt_kernels_cuda_bf16(void) {
  return g.init ? &zt_cuda_table_bf16 : NULL;
}
/* The settings change what the calls do: recorded graphs are stale. */
extern "C" void zt_kernels_cuda_set_math(zt_cuda_math_t math) {
  g.math = math;
  cap.epoch++;
}
extern "C" zt_cuda_math_t zt_kernels_cuda_math(void) { return g.math; }
extern "C" void zt_kernels_cuda_set_attention_fa2(int on) {
  att_fa2_on = on;
  cap.epoch++;
}
extern "C" void zt_kernels_cuda_set_gelu_epilogue(int on) {
  gelu_epilogue = on;
  cap.epoch++;
}

extern "C" void zt_kernels_cuda_profile(int on) {
  if (on && !prof.ev[0])
    for (int i = 0; i < 2 * PROF_PAIRS; i++) ZT_CUDA_CHECK(cudaEventCreate(&prof.ev[i]));
  if (on) prof.n = prof.dropped = 0;
  prof.on = on;
}

typedef struct {
  int label, calls;
  double ms;
} prof_row;

static int prof_row_cmp(const void *a, const void *b) {
  double x = ((const prof_row *)a)->ms, y = ((const prof_row *)b)->ms;
  return x < y ? 1 : x > y ? -1 : 0;
}

extern "C" void zt_kernels_cuda_profile_report(FILE *f) {
  stream_wait();
  prof_row rows[PROF_LABELS];
  for (int i = 0; i < PROF_LABELS; i++) rows[i].label = i, rows[i].calls = 0, rows[i].ms = 0.0;
  double total[2] = {0, 0};
  for (int i = 0; i < prof.n; i++) {
    float ms = 0;
    ZT_CUDA_CHECK(cudaEventElapsedTime(&ms, prof.ev[2 * i], prof.ev[2 * i + 1]));
    rows[prof.label[i]].calls++;
    rows[prof.label[i]].ms += ms;
    total[prof.kind[prof.label[i]] == 'g'] += ms;
  }
  qsort(rows, PROF_LABELS, sizeof rows[0], prof_row_cmp);
  for (int k = 0; k < 2; k++) {
    char kind = k ? 'g' : 'f';
    fprintf(f, "%s: %.2f ms in all%s\n",
            k ? "cuBLASLt products inside them, by shape (column-major m x n x k)"
              : "kernel table calls, by function",
            total[k], k || !prof.dropped ? "" : " (some calls not timed: the pool was spent)");
    for (int i = 0; i < PROF_LABELS; i++)
      if (rows[i].calls && prof.kind[rows[i].label] == kind)
        fprintf(f, "  %8.3f ms %5.1f%% %6d x  %s\n", rows[i].ms,
                total[k] > 0 ? 100.0 * rows[i].ms / total[k] : 0.0, rows[i].calls,
                prof.labels[rows[i].label]);
  }
}

extern "C" size_t zt_cuda_device_memory_used(void) {
  size_t free_b = 0, total_b = 0;
  ZT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return total_b - free_b;
}
extern "C" const char *zt_cuda_device_name(void) { return g.name; }
extern "C" size_t zt_cuda_device_memory(void) { return g.mem; }

extern "C" void zt_cuda_sync(void) {
  if (cap_refuse("zt_cuda_sync")) return;
  stream_wait();
}
