/*
 * matmul.cu: the products, all through cuBLASLt. lt_gemm_epi (common.cuh)
 * is the one entry every family's products take (the linear layers here,
 * attention's cuBLASLt path): a plan per shape (descriptors and the
 * heuristic's algorithm, cached), alignments in the key, epilogues for the
 * bias and GELU. Then the table's linear layers (matmul_forward,
 * matmul_backward) and the MLP's products with GELU in their epilogues
 * (matmul_gelu_forward, matmul_backward_dgelu), which fall back on the
 * GELU kernels of elementwise.cu where cuBLASLt has no such epilogue.
 */
#include "common.cuh"

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

/* D = alpha op(A) op(B) + beta D (+ bias), then epilogue epi with the
 * auxiliary matrix aux (D's type and layout, leading dimension aux_ld).
 * Returns -1, having queued nothing, where cuBLASLt has no algorithm for
 * the epilogue; a plain product or bias always runs. */
template <typename XA, typename XD>
int lt_gemm_epi(int ta, int tb, int m, int n, int k, const XA *A, int lda, long long sA,
                const XA *Bm, int ldb, long long sB, XD *D, int ldd, long long sD, int batch,
                float alpha, float beta, const typename same_type<XD>::type *bias, int epi,
                const XD *aux, long long aux_ld) {
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

/* A and B of one storage type, D of the same or (bf16 A and B) fp32. */
template int lt_gemm_epi<float, float>(int, int, int, int, int, const float *, int, long long,
                                       const float *, int, long long, float *, int, long long,
                                       int, float, float, const float *, int, const float *,
                                       long long);
template int lt_gemm_epi<bf16, bf16>(int, int, int, int, int, const bf16 *, int, long long,
                                     const bf16 *, int, long long, bf16 *, int, long long, int,
                                     float, float, const bf16 *, int, const bf16 *, long long);
template int lt_gemm_epi<bf16, float>(int, int, int, int, int, const bf16 *, int, long long,
                                      const bf16 *, int, long long, float *, int, long long, int,
                                      float, float, const float *, int, const float *,
                                      long long);

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
 * GELU in the products' epilogues (zt_kernels.h, matmul_gelu_forward and
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
  gelu_forward_x<X>(out_, pre_, (size_t)N * OC);
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
  if (dinp) gelu_backward_x<X>(dinp, pre_, dinp, (size_t)N * IC);
}

extern "C" ZT_API void zt_kernels_cuda_set_gelu_epilogue(int on) {
  gelu_epilogue = on;
  cap.epoch++; /* recorded graphs are stale */
}

template <typename X>
void fill_matmul(zt_kernels_t *t) {
  ZT_PROF_ENTRY(t, matmul_forward, cu_matmul_forward<X>);
  ZT_PROF_ENTRY(t, matmul_backward, cu_matmul_backward<X>);
  ZT_PROF_ENTRY(t, matmul_gelu_forward, cu_matmul_gelu_forward<X>);
  ZT_PROF_ENTRY(t, matmul_backward_dgelu, cu_matmul_backward_dgelu<X>);
}
template void fill_matmul<float>(zt_kernels_t *);
template void fill_matmul<bf16>(zt_kernels_t *);
