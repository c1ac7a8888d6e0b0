/*
 * test_kernels_gemm.c: zt_sgemm (kernels/cpu/gemm.c), the matrix product
 * under the fast CPU kernels.
 *
 * Both implementations (our AVX-512 product where the CPU has AVX-512F, and
 * OpenBLAS) are checked against a double-precision product on shapes around
 * every block edge of ours (the 14 x 32 register tile, KC = 256 deep
 * slices, MC = 168 row blocks, NC = 1024 column panels), in all four
 * transpositions, with leading dimensions wider than the matrices, for
 * alpha != 1 and beta in {0, 1, -0.5}. The bound per element is the
 * classical one for a sum of K products in fp32,
 *     |got - ref| <= (K + 2) u sum_k |alpha a_ik b_kj| + 2 u |beta c_ij|,
 * u = 2^-24, which any summation order meets. Also: beta = 0 never reads
 * C (it is NaN there), columns of C past N are never written, our product
 * gives the same bits for any split of its rows (what makes a training step
 * independent of the thread count), and ZT_SGEMM=blas selects OpenBLAS.
 * Where the CPU has no AVX-512F, the checks of our product say so and only
 * OpenBLAS is checked.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/gemm.h"
#include "zt_kernels.h"
#include "zt_test.h"
#include "zt_testdata.h"

#define U (1.0 / 16777216.0)

typedef struct {
  int ta, tb, M, N, K, lda, ldb, ldc;
  float alpha, beta;
  float *A, *B, *C0; /* C0: C before the product */
} prob;

static prob make(int ta, int tb, int M, int N, int K, int pad, float alpha, float beta) {
  prob p = {ta, tb, M, N, K, (ta ? M : K) + pad, (tb ? K : N) + pad, N + pad, alpha, beta,
            NULL, NULL, NULL};
  p.A = zt_rnd((size_t)(ta ? K : M) * p.lda, 1);
  p.B = zt_rnd((size_t)(tb ? N : K) * p.ldb, 1);
  p.C0 = zt_rnd((size_t)M * p.ldc, 1);
  if (beta == 0.0f)
    for (size_t i = 0; i < (size_t)M * p.ldc; i++) p.C0[i] = NAN;
  return p;
}

static void unmake(prob *p) { free(p->A), free(p->B), free(p->C0); }

static double at(const float *X, int t, int ld, int r, int c) {
  return t ? X[(size_t)c * ld + r] : X[(size_t)r * ld + c];
}

/* Runs the product with the implementation now selected and checks it
 * against the double reference; returns C (malloc'ed) for further checks. */
static float *run_check(const char *impl, const prob *p) {
  size_t nc = (size_t)p->M * p->ldc;
  float *C = malloc(nc * sizeof(float));
  memcpy(C, p->C0, nc * sizeof(float));
  zt_sgemm(p->ta, p->tb, p->M, p->N, p->K, p->alpha, p->A, p->lda, p->B, p->ldb, p->beta, C,
           p->ldc);
  int bad = 0;
  for (int i = 0; i < p->M && bad < 3; i++) {
    for (int j = 0; j < p->ldc && bad < 3; j++) {
      size_t ix = (size_t)i * p->ldc + j;
      if (j >= p->N) { /* padding: untouched (NaN compares unequal: use bits) */
        if (memcmp(&C[ix], &p->C0[ix], sizeof(float)) != 0) bad++;
        continue;
      }
      double ref = 0, mag = 0;
      for (int k = 0; k < p->K; k++) {
        double t = at(p->A, p->ta, p->lda, i, k) * at(p->B, p->tb, p->ldb, k, j) * p->alpha;
        ref += t, mag += fabs(t);
      }
      double cold = p->beta == 0.0f ? 0.0 : (double)p->C0[ix] * p->beta;
      ref += cold;
      double lim = (p->K + 2) * U * mag + 2 * U * fabs(cold) + 1e-30;
      if (!(fabs(C[ix] - ref) <= lim)) {
        fprintf(stderr, "  %s ta%d tb%d %dx%dx%d alpha %g beta %g: C[%d][%d] = %.9g, ref %.9g\n",
                impl, p->ta, p->tb, p->M, p->N, p->K, p->alpha, p->beta, i, j, C[ix], ref);
        bad++;
      }
    }
  }
  ZT_CHECK(bad == 0);
  return C;
}

/* Shapes around each block edge: (M, N, K). */
static const int shapes[][3] = {
    {1, 1, 1},      {13, 31, 7},    {14, 32, 256}, {15, 33, 257},  {29, 17, 255},
    {168, 64, 40},  {169, 65, 300}, {3, 1030, 20}, {200, 5, 513},  {1, 300, 600},
    {40, 1100, 90}, {6, 16, 64},
};

static void check_all(const char *impl) {
  static const float betas[] = {0.0f, 1.0f, -0.5f};
  int n = 0;
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
    for (int t = 0; t < 4; t++) {
      float beta = betas[(s + t) % 3], alpha = (s + t) % 2 ? 0.37f : 1.0f;
      prob p = make(t >> 1, t & 1, shapes[s][0], shapes[s][1], shapes[s][2], (int)(s % 3) * 3,
                    alpha, beta);
      free(run_check(impl, &p));
      unmake(&p);
      n++;
    }
  /* Random small shapes, transpositions and paddings. */
  zt_test_seed(12345);
  for (int r = 0; r < 150; r++) {
    int M = 1 + (int)((zt_frand() + 1) * 30), N = 1 + (int)((zt_frand() + 1) * 45);
    int K = 1 + (int)((zt_frand() + 1) * 150), t = (int)((zt_frand() + 1) * 2) & 3;
    prob p = make(t >> 1, t & 1, M, N, K, r % 4, r % 5 ? 1.0f : -2.0f, (float)(r % 3) * 0.5f);
    free(run_check(impl, &p));
    unmake(&p);
    n++;
  }
  printf("  %s: %d products within the fp32 bound\n", impl, n);
}

/* Selects our AVX-512 product; 0 (and says so) where the CPU has none. */
static int select_own(void) {
  if (!strcmp(zt_sgemm_force(1), "avx512")) return 1;
  printf("  skipped: this CPU has no AVX-512F (zt_sgemm is OpenBLAS here)\n");
  zt_sgemm_force(-1);
  return 0;
}

ZT_TEST(blas_against_reference) {
  ZT_CHECK_STR(zt_sgemm_force(0), "blas");
  check_all("blas");
  zt_sgemm_force(-1);
}

ZT_TEST(own_against_reference) {
  if (!select_own()) return;
  check_all("avx512");
  zt_sgemm_force(-1);
}

/* Rows [0, M) in one call and in three calls give the same bits, in every
 * transposition: each element's sum does not depend on where it sits. */
ZT_TEST(own_row_split_is_bit_identical) {
  if (!select_own()) return;
  for (int t = 0; t < 4; t++) {
    int ta = t >> 1, tb = t & 1, M = 203, N = 77, K = 530;
    prob p = make(ta, tb, M, N, K, 1, 0.5f, 1.0f);
    float *whole = run_check("avx512", &p), *parts = malloc((size_t)M * p.ldc * sizeof(float));
    memcpy(parts, p.C0, (size_t)M * p.ldc * sizeof(float));
    const int cut[] = {0, 5, 150, M};
    for (int c = 0; c < 3; c++) {
      int r0 = cut[c], rows = cut[c + 1] - cut[c];
      const float *A = ta ? p.A + r0 : p.A + (size_t)r0 * p.lda;
      zt_sgemm(ta, tb, rows, N, K, p.alpha, A, p.lda, p.B, p.ldb, p.beta,
               parts + (size_t)r0 * p.ldc, p.ldc);
    }
    ZT_CHECK(memcmp(whole, parts, (size_t)M * p.ldc * sizeof(float)) == 0);
    free(whole), free(parts);
    unmake(&p);
  }
  zt_sgemm_force(-1);
}

/* Through the kernel table: the linear layer forward and backward give the
 * same bits at 1 and 3 threads (3 splits the rows unevenly). */
ZT_TEST(own_matmul_thread_count_independent) {
  if (!select_own()) return;
  const zt_kernels_t *F = zt_kernels_cpu();
  int N = 301, IC = 96, OC = 280;
  float *x = zt_rnd((size_t)N * IC, 1), *w = zt_rnd((size_t)OC * IC, 1), *b = zt_rnd(OC, 1);
  float *dout = zt_rnd((size_t)N * OC, 1);
  float *o[2], *dx[2], *dw[2];
  for (int r = 0; r < 2; r++) {
    zt_kernels_cpu_set_threads(r ? 3 : 1);
    o[r] = malloc((size_t)N * OC * 4), dx[r] = malloc((size_t)N * IC * 4);
    dw[r] = calloc((size_t)OC * IC, 4);
    F->matmul_forward(o[r], x, w, b, N, IC, OC);
    F->matmul_backward(dx[r], dw[r], NULL, dout, x, w, N, IC, OC);
  }
  zt_kernels_cpu_set_threads(2);
  ZT_CHECK(memcmp(o[0], o[1], (size_t)N * OC * 4) == 0);
  ZT_CHECK(memcmp(dx[0], dx[1], (size_t)N * IC * 4) == 0);
  ZT_CHECK(memcmp(dw[0], dw[1], (size_t)OC * IC * 4) == 0);
  for (int r = 0; r < 2; r++) free(o[r]), free(dx[r]), free(dw[r]);
  free(x), free(w), free(b), free(dout);
  zt_sgemm_force(-1);
}

ZT_TEST(environment_selects_blas) {
  setenv("ZT_SGEMM", "blas", 1);
  ZT_CHECK_STR(zt_sgemm_force(-1), "blas");
  unsetenv("ZT_SGEMM");
  const char *impl = zt_sgemm_force(-1);
  ZT_CHECK(!strcmp(impl, "avx512") || !strcmp(impl, "blas"));
  printf("  this CPU: %s\n", impl);
  /* A value it does not know leaves the choice to the CPU (with a warning). */
  setenv("ZT_SGEMM", "BLAS", 1);
  ZT_CHECK_STR(zt_sgemm_force(-1), impl);
  unsetenv("ZT_SGEMM");
  zt_sgemm_force(-1);
}

ZT_TEST_MAIN(blas_against_reference, own_against_reference, own_row_split_is_bit_identical,
             own_matmul_thread_count_independent, environment_selects_blas)
