/*
 * sim_cublaslt.cpp: cuBLASLt of the CPU stand-in (tests only; see
 * include/cublasLt.h and docs/gpu.md, "The CPU stand-in").
 *
 * D = alpha * op(A) op(B) + beta * C (+ bias per row of D), per batch,
 * column order, with the products done by OpenBLAS's sgemm (fp32
 * accumulation). For CUBLAS_COMPUTE_32F_FAST_TF32 / _FAST_16BF the
 * elements of A and B are first rounded to TF32 (10 mantissa bits, to
 * nearest, ties away) or bf16 (7 bits, to nearest even), as tensor cores
 * take them; C, bias and the sums stay fp32.
 *
 * Data types: A and B both fp32 or both bf16 (CUDA_R_16BF; then compute
 * 32F only), C and D both fp32 or both bf16 (bf16 D only from bf16 A and
 * B), the bias of D's type (the default, -1, says so, as in cuBLASLt).
 * bf16 elements widen exactly; a bf16 D is formed in fp32 (C, products,
 * bias) and rounded once, to nearest even, as the tensor cores' epilogue
 * does.
 *
 * Checks beyond the arithmetic: attribute sizes; layouts that agree with
 * op(A) [m,k], op(B) [k,n], C and D [m,n] and ld >= rows; equal batch
 * counts; every matrix (all its batches), the bias and the workspace inside
 * device allocations; a matmul's pointers aligned as the preference the
 * algorithm was chosen under said (up to 16 bytes, what vector loads need);
 * the algorithm chosen for the same compute type.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <memory>
#include <vector>

#include <cblas.h>

#include "cublasLt.h"
#include "zt_sim.h"

struct zt_sim_lt_handle {
  int magic;
};

struct zt_sim_lt_desc {
  int32_t compute, scale, pointer_mode, ta, tb, tc;
  uint32_t epilogue;
  const void *bias;
  int32_t bias_type;
  const void *aux; /* GELU_AUX_BIAS: written (the GELU's input); DGELU: read */
  int64_t aux_ld;
  int32_t aux_type;
};

struct zt_sim_lt_layout {
  uint32_t type;
  int32_t order;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch;
  int64_t stride;
};

struct zt_sim_lt_pref {
  uint32_t search_mode;
  uint64_t max_workspace;
  uint32_t align[4];
};

namespace {

const int kHandleMagic = 0x5a54534d;
const uint64_t kAlgoMagic = 0x7a7453494d4c54ull; /* "ztSIMLT" */

template <typename T>
cublasStatus_t set_field(T *field, const void *buf, size_t size) {
  if (!buf || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  memcpy(field, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

bool reduced(int32_t compute) {
  return compute == CUBLAS_COMPUTE_32F_FAST_TF32 || compute == CUBLAS_COMPUTE_32F_FAST_16BF;
}

struct shape {
  int m, n, k, batch;
};

/* The checks shared by the heuristic and the matmul. */
cublasStatus_t validate(const zt_sim_lt_desc *op, const zt_sim_lt_layout *a,
                        const zt_sim_lt_layout *b, const zt_sim_lt_layout *c,
                        const zt_sim_lt_layout *d, shape *s) {
  if (!op || !a || !b || !c || !d) return CUBLAS_STATUS_INVALID_VALUE;
  if (op->compute != CUBLAS_COMPUTE_32F && op->compute != CUBLAS_COMPUTE_32F_PEDANTIC &&
      !reduced(op->compute))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (op->scale != CUDA_R_32F || op->pointer_mode != 0 || op->tc != CUBLAS_OP_N)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  uint32_t e = op->epilogue;
  if (e != CUBLASLT_EPILOGUE_DEFAULT && e != CUBLASLT_EPILOGUE_BIAS &&
      e != CUBLASLT_EPILOGUE_GELU_AUX_BIAS && e != CUBLASLT_EPILOGUE_DGELU)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if ((e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) &&
      op->bias_type != -1 && op->bias_type != (int32_t)d->type)
    return CUBLAS_STATUS_NOT_SUPPORTED; /* the bias is of D's type */
  if (e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU) {
    /* ZT_SIM_LT_GELU=0: a library without these epilogues (the callers'
     * fallback is tested so). */
    const char *on = getenv("ZT_SIM_LT_GELU");
    if (on && !strcmp(on, "0")) return CUBLAS_STATUS_NOT_SUPPORTED;
    /* The GELU input matrix: D's type, a leading dimension divisible by 8
     * and no less than D's rows, unbatched here. */
    if ((op->aux_type != -1 && op->aux_type != (int32_t)d->type) || op->aux_ld % 8 != 0 ||
        op->aux_ld < (int64_t)d->rows || d->batch > 1)
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if ((op->ta != CUBLAS_OP_N && op->ta != CUBLAS_OP_T) ||
      (op->tb != CUBLAS_OP_N && op->tb != CUBLAS_OP_T))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  const zt_sim_lt_layout *ls[4] = {a, b, c, d};
  for (auto *l : ls) {
    if ((l->type != CUDA_R_32F && l->type != CUDA_R_16BF) || l->order != CUBLASLT_ORDER_COL)
      return CUBLAS_STATUS_NOT_SUPPORTED;
    if (l->rows == 0 || l->cols == 0 || l->rows > 0x7fffffff || l->cols > 0x7fffffff ||
        l->ld < (int64_t)l->rows || l->batch < 1 || l->stride < 0)
      return CUBLAS_STATUS_INVALID_VALUE;
    if (l->ld > 0x7fffffff) return CUBLAS_STATUS_NOT_SUPPORTED; /* sgemm takes int */
  }
  if (a->type != b->type || c->type != d->type ||
      (d->type == CUDA_R_16BF && a->type != CUDA_R_16BF) ||
      (a->type == CUDA_R_16BF && op->compute != CUBLAS_COMPUTE_32F))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  uint64_t am = op->ta ? a->cols : a->rows, ak = op->ta ? a->rows : a->cols;
  uint64_t bk = op->tb ? b->cols : b->rows, bn = op->tb ? b->rows : b->cols;
  if (am != d->rows || bn != d->cols || ak != bk || c->rows != d->rows || c->cols != d->cols)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (a->batch != d->batch || b->batch != d->batch || c->batch != d->batch)
    return CUBLAS_STATUS_INVALID_VALUE;
  s->m = (int)d->rows, s->n = (int)d->cols, s->k = (int)ak, s->batch = d->batch;
  return CUBLAS_STATUS_SUCCESS;
}

size_t elem_bytes(uint32_t type) { return type == CUDA_R_16BF ? 2 : 4; }

size_t extent_bytes(const zt_sim_lt_layout *l) {
  uint64_t last = (uint64_t)(l->batch - 1) * (uint64_t)l->stride +
                  (l->cols - 1) * (uint64_t)l->ld + l->rows;
  return (size_t)last * elem_bytes(l->type);
}

uint64_t alignment(const void *p, const zt_sim_lt_layout *l) {
  uint64_t x = (uint64_t)(uintptr_t)p | 4096;
  if (l->batch > 1) x |= (uint64_t)l->stride * elem_bytes(l->type);
  return x & (~x + 1);
}

float round_tf32(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) { /* not inf or NaN */
    u += 0x1000u;                         /* half of the 13 bits dropped: ties away */
    u &= 0xffffe000u;
  }
  memcpy(&f, &u, 4);
  return f;
}

float round_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) {
    u += 0x7fffu + ((u >> 16) & 1u); /* to nearest, ties to even */
    u &= 0xffff0000u;
  } else if (u & 0x007fffffu) {
    u |= 0x00400000u; /* NaN stays NaN */
    u &= 0xffff0000u;
  }
  memcpy(&f, &u, 4);
  return f;
}

/* A rows x cols column-order matrix (ld) rounded into a packed copy. */
void round_into(std::vector<float> &dst, const float *src, uint64_t rows, uint64_t cols,
                int64_t ld, int32_t compute) {
  dst.resize(rows * cols);
  bool bf = compute == CUBLAS_COMPUTE_32F_FAST_16BF;
  for (uint64_t j = 0; j < cols; j++)
    for (uint64_t i = 0; i < rows; i++) {
      float v = src[j * ld + i];
      dst[j * rows + i] = bf ? round_bf16(v) : round_tf32(v);
    }
}

/* Element i of a bf16 array, widened (exact). */
/* GELU, tanh form (GPT-2's, and cuBLASLt's epilogue), and its derivative. */
float gelu_tanh(float x) {
  const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
  return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}
float gelu_tanh_grad(float x) {
  const float k = 0.7978845608028654f;
  float arg = k * (x + 0.044715f * x * x * x), th = tanhf(arg), ch = coshf(arg);
  return 0.5f * (1.0f + th) + x * 0.5f / (ch * ch) * k * (1.0f + 3.0f * 0.044715f * x * x);
}

float bf16_value(const void *p, size_t i) {
  uint16_t h;
  memcpy(&h, (const char *)p + 2 * i, 2);
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Element i of a bf16 array = f rounded to nearest even. */
void store_bf16(void *p, size_t i, float f) {
  float r = round_bf16(f);
  uint32_t u;
  memcpy(&u, &r, 4);
  uint16_t h = (uint16_t)(u >> 16);
  memcpy((char *)p + 2 * i, &h, 2);
}

/* A rows x cols column-order bf16 matrix (ld) widened into a packed copy. */
void widen_into(std::vector<float> &dst, const void *src, uint64_t rows, uint64_t cols,
                int64_t ld) {
  dst.resize(rows * cols);
  for (uint64_t j = 0; j < cols; j++)
    for (uint64_t i = 0; i < rows; i++) dst[j * rows + i] = bf16_value(src, j * ld + i);
}

/* The fp32 room for a bf16 D of s.m x s.n (packed), holding beta's C. */
float *fp32_d(std::vector<float> &rd, const void *c, const zt_sim_lt_layout *cd, float beta,
              const shape &s) {
  rd.assign((size_t)s.m * s.n, 0.0f);
  if (beta != 0.0f)
    for (int j = 0; j < s.n; j++)
      for (int i = 0; i < s.m; i++) rd[(size_t)j * s.m + i] = bf16_value(c, j * cd->ld + i);
  return rd.data();
}

/* The checks of an algorithm from cublasLtMatmulAlgoGetHeuristic against
 * the matmul it is used for: the same compute type, and pointers A, B, C, D
 * (with their batch strides) as aligned as the preference said (up to 16
 * bytes). */
cublasStatus_t check_algo(const cublasLtMatmulAlgo_t *algo, const zt_sim_lt_desc *op,
                          const void *const ptrs[4], const zt_sim_lt_layout *const ls[4]) {
  if (algo->data[0] != kAlgoMagic) return CUBLAS_STATUS_INVALID_VALUE;
  if (algo->data[5] != (uint64_t)(uint32_t)op->compute) {
    fprintf(stderr, "zt-sim: cublasLtMatmul: the algorithm was chosen for compute type %d, "
                    "the descriptor has %d\n",
            (int)algo->data[5], op->compute);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  for (int i = 0; i < 4; i++) {
    uint64_t want = algo->data[1 + i] < 16 ? algo->data[1 + i] : 16;
    if (alignment(ptrs[i], ls[i]) >= want) continue;
    fprintf(stderr, "zt-sim: cublasLtMatmul: matrix %c at %p (batch stride %lld) is "
                    "less aligned than the %llu bytes its algorithm was chosen for\n",
            "ABCD"[i], ptrs[i], (long long)ls[i]->stride, (unsigned long long)algo->data[1 + i]);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

const char *cublasLtGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    default: return "unknown error";
  }
}

const char *cublasLtGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

cublasStatus_t cublasLtCreate(cublasLtHandle_t *handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  *handle = new zt_sim_lt_handle{kHandleMagic};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  if (!handle || handle->magic != kHandleMagic) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->magic = 0;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *desc, cublasComputeType_t compute,
                                        cudaDataType_t scale_type) {
  if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
  zt_sim_lt_desc *d = new zt_sim_lt_desc();
  d->compute = compute;
  d->scale = scale_type;
  d->ta = d->tb = d->tc = CUBLAS_OP_N;
  d->epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  d->bias_type = -1; /* D's type */
  d->aux_type = -1;
  *desc = d;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size) {
  if (!d) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: return set_field(&d->compute, buf, size);
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: return set_field(&d->scale, buf, size);
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: return set_field(&d->pointer_mode, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSA: return set_field(&d->ta, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSB: return set_field(&d->tb, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSC: return set_field(&d->tc, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return set_field(&d->epilogue, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return set_field(&d->bias, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return set_field(&d->bias_type, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return set_field(&d->aux, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return set_field(&d->aux_ld, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE: return set_field(&d->aux_type, buf, size);
  }
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *layout, cudaDataType_t type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  if (!layout) return CUBLAS_STATUS_INVALID_VALUE;
  zt_sim_lt_layout *l = new zt_sim_lt_layout();
  l->type = type;
  l->order = CUBLASLT_ORDER_COL;
  l->rows = rows, l->cols = cols, l->ld = ld;
  l->batch = 1;
  l->stride = 0;
  *layout = l;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                cublasLtMatrixLayoutAttribute_t attr,
                                                const void *buf, size_t size) {
  if (!l) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_TYPE: return set_field(&l->type, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_ORDER: return set_field(&l->order, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_ROWS: return set_field(&l->rows, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_COLS: return set_field(&l->cols, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_LD: return set_field(&l->ld, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: return set_field(&l->batch, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET: return set_field(&l->stride, buf, size);
  }
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref) {
  if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
  zt_sim_lt_pref *p = new zt_sim_lt_pref();
  for (int i = 0; i < 4; i++) p->align[i] = 256;
  *pref = p;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void *buf, size_t size) {
  if (!p) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_SEARCH_MODE: return set_field(&p->search_mode, buf, size);
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return set_field(&p->max_workspace, buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: return set_field(&p->align[0], buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: return set_field(&p->align[1], buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: return set_field(&p->align[2], buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: return set_field(&p->align[3], buf, size);
  }
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t handle, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
    cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t *results,
    int *returned) {
  if (!handle || handle->magic != kHandleMagic) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!pref || requested < 1 || !results || !returned) return CUBLAS_STATUS_INVALID_VALUE;
  shape s;
  *returned = 0;
  cublasStatus_t st = validate(op, a, b, c, d, &s);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  memset(&results[0], 0, sizeof results[0]);
  cublasLtMatmulAlgo_t &al = results[0].algo;
  al.data[0] = kAlgoMagic;
  for (int i = 0; i < 4; i++) al.data[1 + i] = pref->align[i];
  al.data[5] = (uint64_t)(uint32_t)op->compute;
  results[0].workspaceSize = 0;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t op, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t ad, const void *B,
                              cublasLtMatrixLayout_t bd, const void *beta, const void *C,
                              cublasLtMatrixLayout_t cd, void *D, cublasLtMatrixLayout_t dd,
                              const cublasLtMatmulAlgo_t *algo, void *workspace,
                              size_t workspace_size, cudaStream_t stream) {
  if (!handle || handle->magic != kHandleMagic) return CUBLAS_STATUS_NOT_INITIALIZED;
  shape s;
  cublasStatus_t st = validate(op, ad, bd, cd, dd, &s);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (!alpha || !beta || !A || !B || !C || !D || !zt_sim::valid_stream(stream))
    return CUBLAS_STATUS_INVALID_VALUE;
  bool gelu = op->epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  bool dgelu = op->epilogue == CUBLASLT_EPILOGUE_DGELU;
  bool bias = op->epilogue == CUBLASLT_EPILOGUE_BIAS || gelu;
  if (bias && !op->bias) return CUBLAS_STATUS_INVALID_VALUE;
  if ((gelu || dgelu) && !op->aux) return CUBLAS_STATUS_INVALID_VALUE;
  const void *ptrs[4] = {A, B, C, D};
  const zt_sim_lt_layout *ls[4] = {ad, bd, cd, dd};
  if (algo && (st = check_algo(algo, op, ptrs, ls)) != CUBLAS_STATUS_SUCCESS) return st;
  if (zt_sim::capturing(stream)) {
    /* Into the graph: the descriptors, the algorithm and the scalars by
     * value (alpha and beta are host values, read now). */
    struct held {
      zt_sim_lt_handle h;
      zt_sim_lt_desc op;
      zt_sim_lt_layout ad, bd, cd, dd;
      cublasLtMatmulAlgo_t algo;
      bool has_algo;
      float al, be;
    };
    auto k = std::make_shared<held>(held{*handle, *op, *ad, *bd, *cd, *dd, {}, algo != NULL,
                                         *(const float *)alpha, *(const float *)beta});
    if (algo) k->algo = *algo;
    cudaError_t e = zt_sim::capture(stream, "cublasLtMatmul", [=](cudaStream_t s) {
      cublasStatus_t r = cublasLtMatmul(&k->h, &k->op, &k->al, A, &k->ad, B, &k->bd, &k->be, C,
                                        &k->cd, D, &k->dd, k->has_algo ? &k->algo : NULL,
                                        workspace, workspace_size, s);
      if (r != CUBLAS_STATUS_SUCCESS)
        zt_sim::fatal("graph launch: cublasLtMatmul failed: %s", cublasLtGetStatusString(r));
    });
    return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
  }
  zt_sim::stream_work(stream);
  for (int i = 0; i < 4; i++) {
    char what[40];
    snprintf(what, sizeof what, "cublasLtMatmul: matrix %c", "ABCD"[i]);
    zt_sim::require_device_memory(ptrs[i], extent_bytes(ls[i]), what);
  }
  if (bias)
    zt_sim::require_device_memory(op->bias, s.m * elem_bytes(dd->type),
                                  "cublasLtMatmul: bias");
  if (gelu || dgelu)
    zt_sim::require_device_memory(op->aux, ((size_t)op->aux_ld * (s.n - 1) + s.m) * elem_bytes(dd->type),
                                  "cublasLtMatmul: GELU input matrix (aux)");
  if (workspace_size)
    zt_sim::require_device_memory(workspace, workspace_size, "cublasLtMatmul: workspace");

  /* alpha and beta are host pointers (CUBLASLT_POINTER_MODE_HOST): read
   * before device memory opens, so a device pointer faults here. */
  float al = *(const float *)alpha, be = *(const float *)beta;
  zt_sim::device_access access("cublasLtMatmul");
  std::vector<float> ra, rb, rd, rbias;
  size_t ea = elem_bytes(ad->type), ed = elem_bytes(dd->type);
  if (bias && dd->type == CUDA_R_16BF) {
    rbias.resize(s.m);
    for (int i = 0; i < s.m; i++) rbias[i] = bf16_value(op->bias, i);
  }
  const float *bv = rbias.empty() ? (const float *)op->bias : rbias.data();
  for (int bi = 0; bi < s.batch; bi++) {
    const char *a = (const char *)A + (size_t)bi * ad->stride * ea;
    const char *b = (const char *)B + (size_t)bi * bd->stride * ea;
    const char *c = (const char *)C + (size_t)bi * cd->stride * ed;
    char *draw = (char *)D + (size_t)bi * dd->stride * ed;
    /* The product is formed in fp32: in D itself, or in rd for a bf16 D. */
    float *d = dd->type == CUDA_R_16BF ? fp32_d(rd, c, cd, be, s) : (float *)draw;
    int64_t ldd = dd->type == CUDA_R_16BF ? s.m : dd->ld;
    if (dd->type != CUDA_R_16BF)
      for (int j = 0; j < s.n; j++) {
        float *dcol = d + (size_t)j * ldd;
        if (be == 0.0f)
          memset(dcol, 0, s.m * sizeof(float)); /* C is not read when beta is 0 */
        else if (c != draw || cd->ld != dd->ld)
          memmove(dcol, (const float *)c + (size_t)j * cd->ld, s.m * sizeof(float));
      }
    int64_t lda = ad->ld, ldb = bd->ld;
    const float *fa = (const float *)a, *fb = (const float *)b;
    if (ad->type == CUDA_R_16BF) {
      widen_into(ra, a, ad->rows, ad->cols, ad->ld);
      widen_into(rb, b, bd->rows, bd->cols, bd->ld);
      fa = ra.data(), fb = rb.data(), lda = (int64_t)ad->rows, ldb = (int64_t)bd->rows;
    } else if (reduced(op->compute)) {
      round_into(ra, fa, ad->rows, ad->cols, ad->ld, op->compute);
      round_into(rb, fb, bd->rows, bd->cols, bd->ld, op->compute);
      fa = ra.data(), fb = rb.data(), lda = (int64_t)ad->rows, ldb = (int64_t)bd->rows;
    }
    cblas_sgemm(CblasColMajor, op->ta ? CblasTrans : CblasNoTrans,
                op->tb ? CblasTrans : CblasNoTrans, s.m, s.n, s.k, al, fa, (int)lda, fb, (int)ldb,
                be, d, (int)ldd);
    if (bias)
      for (int j = 0; j < s.n; j++)
        for (int i = 0; i < s.m; i++) d[(size_t)j * ldd + i] += bv[i];
    /* GELU_AUX_BIAS keeps the GELU's input (rounded to D's type) in aux and
     * stores the GELU of the unrounded value; DGELU multiplies by the
     * derivative at aux's value. */
    for (int j = 0; (gelu || dgelu) && j < s.n; j++)
      for (int i = 0; i < s.m; i++) {
        size_t ai = (size_t)j * op->aux_ld + i;
        float &x = d[(size_t)j * ldd + i];
        if (gelu) {
          if (dd->type == CUDA_R_16BF) store_bf16((void *)op->aux, ai, x);
          else ((float *)op->aux)[ai] = x;
          x = gelu_tanh(x);
        } else {
          float a = dd->type == CUDA_R_16BF ? bf16_value(op->aux, ai) : ((const float *)op->aux)[ai];
          x *= gelu_tanh_grad(a);
        }
      }
    if (dd->type == CUDA_R_16BF)
      for (int j = 0; j < s.n; j++)
        for (int i = 0; i < s.m; i++)
          store_bf16(draw, (size_t)j * dd->ld + i, d[(size_t)j * ldd + i]);
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
