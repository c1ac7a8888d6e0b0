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
 * Checks beyond the arithmetic: attribute sizes; layouts that agree with
 * op(A) [m,k], op(B) [k,n], C and D [m,n] and ld >= rows; equal batch
 * counts; every matrix (all its batches), the bias and the workspace inside
 * device allocations; a matmul's pointers aligned as the preference the
 * algorithm was chosen under said (up to 16 bytes, what vector loads need);
 * the algorithm chosen for the same compute type.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
  if (op->epilogue != CUBLASLT_EPILOGUE_DEFAULT && op->epilogue != CUBLASLT_EPILOGUE_BIAS)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (op->epilogue == CUBLASLT_EPILOGUE_BIAS && op->bias_type != CUDA_R_32F)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if ((op->ta != CUBLAS_OP_N && op->ta != CUBLAS_OP_T) ||
      (op->tb != CUBLAS_OP_N && op->tb != CUBLAS_OP_T))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  const zt_sim_lt_layout *ls[4] = {a, b, c, d};
  for (auto *l : ls) {
    if (l->type != CUDA_R_32F || l->order != CUBLASLT_ORDER_COL) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (l->rows == 0 || l->cols == 0 || l->rows > 0x7fffffff || l->cols > 0x7fffffff ||
        l->ld < (int64_t)l->rows || l->batch < 1 || l->stride < 0)
      return CUBLAS_STATUS_INVALID_VALUE;
    if (l->ld > 0x7fffffff) return CUBLAS_STATUS_NOT_SUPPORTED; /* sgemm takes int */
  }
  uint64_t am = op->ta ? a->cols : a->rows, ak = op->ta ? a->rows : a->cols;
  uint64_t bk = op->tb ? b->cols : b->rows, bn = op->tb ? b->rows : b->cols;
  if (am != d->rows || bn != d->cols || ak != bk || c->rows != d->rows || c->cols != d->cols)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (a->batch != d->batch || b->batch != d->batch || c->batch != d->batch)
    return CUBLAS_STATUS_INVALID_VALUE;
  s->m = (int)d->rows, s->n = (int)d->cols, s->k = (int)ak, s->batch = d->batch;
  return CUBLAS_STATUS_SUCCESS;
}

size_t extent_bytes(const zt_sim_lt_layout *l) {
  uint64_t last = (uint64_t)(l->batch - 1) * (uint64_t)l->stride +
                  (l->cols - 1) * (uint64_t)l->ld + l->rows;
  return (size_t)last * sizeof(float);
}

uint64_t alignment(const void *p, const zt_sim_lt_layout *l) {
  uint64_t x = (uint64_t)(uintptr_t)p | 4096;
  if (l->batch > 1) x |= (uint64_t)l->stride * sizeof(float);
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
  d->bias_type = CUDA_R_32F;
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
  bool bias = op->epilogue == CUBLASLT_EPILOGUE_BIAS;
  if (bias && !op->bias) return CUBLAS_STATUS_INVALID_VALUE;
  const void *ptrs[4] = {A, B, C, D};
  const zt_sim_lt_layout *ls[4] = {ad, bd, cd, dd};
  if (algo && (st = check_algo(algo, op, ptrs, ls)) != CUBLAS_STATUS_SUCCESS) return st;
  for (int i = 0; i < 4; i++) {
    char what[40];
    snprintf(what, sizeof what, "cublasLtMatmul: matrix %c", "ABCD"[i]);
    zt_sim::require_device_memory(ptrs[i], extent_bytes(ls[i]), what);
  }
  if (bias) zt_sim::require_device_memory(op->bias, s.m * sizeof(float), "cublasLtMatmul: bias");
  if (workspace_size)
    zt_sim::require_device_memory(workspace, workspace_size, "cublasLtMatmul: workspace");

  /* alpha and beta are host pointers (CUBLASLT_POINTER_MODE_HOST): read
   * before device memory opens, so a device pointer faults here. */
  float al = *(const float *)alpha, be = *(const float *)beta;
  zt_sim::device_access access("cublasLtMatmul");
  std::vector<float> ra, rb;
  for (int bi = 0; bi < s.batch; bi++) {
    const float *a = (const float *)A + (size_t)bi * ad->stride;
    const float *b = (const float *)B + (size_t)bi * bd->stride;
    const float *c = (const float *)C + (size_t)bi * cd->stride;
    float *d = (float *)D + (size_t)bi * dd->stride;
    for (int j = 0; j < s.n; j++) {
      float *dcol = d + (size_t)j * dd->ld;
      if (be == 0.0f)
        memset(dcol, 0, s.m * sizeof(float)); /* C is not read when beta is 0 */
      else if (c != d || cd->ld != dd->ld)
        memmove(dcol, c + (size_t)j * cd->ld, s.m * sizeof(float));
    }
    int64_t lda = ad->ld, ldb = bd->ld;
    if (reduced(op->compute)) {
      round_into(ra, a, ad->rows, ad->cols, ad->ld, op->compute);
      round_into(rb, b, bd->rows, bd->cols, bd->ld, op->compute);
      a = ra.data(), b = rb.data(), lda = (int64_t)ad->rows, ldb = (int64_t)bd->rows;
    }
    cblas_sgemm(CblasColMajor, op->ta ? CblasTrans : CblasNoTrans,
                op->tb ? CblasTrans : CblasNoTrans, s.m, s.n, s.k, al, a, (int)lda, b, (int)ldb,
                be, d, (int)dd->ld);
    if (bias) {
      const float *bv = (const float *)op->bias;
      for (int j = 0; j < s.n; j++)
        for (int i = 0; i < s.m; i++) d[(size_t)j * dd->ld + i] += bv[i];
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
