/*
 * sgemm.c: zt_bench_sgemm, the CPU's matmul throughput for bench/cpu-train.
 *
 *   zt_bench_sgemm [--threads N] [--iters I] [--rows LIST]
 *
 * Prints, one line each, figures in GFLOP/s (2*M*N*K flops per product)
 * for the rows LIST names (comma-separated; default all of them):
 *
 *   peak    OpenBLAS sgemm with N threads on 2048 x 2048 x 2048, the
 *           practical peak of this machine's BLAS;
 *   blis    BLIS's sgemm (Debian's libblis, loaded with dlopen so that its
 *           BLAS symbols never stand in for OpenBLAS's) with N threads on
 *           the same product; absent when libblis.so.4 is not installed
 *           (deploy/install-deps.sh --bench installs it);
 *   own     the engine's matmul_forward, as for `kernel` below, on the
 *           same 2048^3 product: our zt_sgemm (kernels/cpu/gemm.c) where
 *           the CPU has AVX-512F, else OpenBLAS single-threaded per thread;
 *   kernel  the engine's matmul_forward (zt_kernels_cpu, N OpenMP threads,
 *           one zt_sgemm per thread) on the small example's MLP shape:
 *           [2048 tokens, 384] x [1536, 384]^T;
 *
 * then "sgemm <impl>", the implementation zt_sgemm uses (avx512 or blas),
 * "openblas_core <name>", the kernel family OpenBLAS picked for this CPU
 * in this process (OPENBLAS_CORETYPE in the environment overrides its own
 * choice, which is why bench/cpu-train runs the references without it),
 * and with the blis row "blis_arch <name>", the sub-configuration BLIS
 * picked. Each figure is the best of I timed repetitions after repeating
 * the product for at least 300 ms, so that the threads have settled on
 * their own cores (a shorter warm-up sometimes timed two threads sharing
 * one core).
 */
#include <cblas.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zt_common.h"
#include "zt_kernels.h"

static float *filled(size_t n) {
  float *p = malloc(n * sizeof(float));
  if (!p) exit(1);
  for (size_t i = 0; i < n; i++) p[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
  return p;
}

static double best_gflops(double flops, int iters, void (*fn)(void *), void *arg) {
  double best = 0.0;
  int64_t warm = zt_now_us();
  do fn(arg);
  while (zt_now_us() - warm < 300000);
  for (int i = 0; i < iters; i++) {
    int64_t t0 = zt_now_us();
    fn(arg);
    double s = (double)(zt_now_us() - t0) / 1e6;
    if (s > 0 && flops / s / 1e9 > best) best = flops / s / 1e9;
  }
  return best;
}

typedef struct {
  int m, n, k;
  float *a, *b, *c;
} prob_t;

static void run_blas(void *arg) {
  prob_t *p = arg;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p->m, p->n, p->k, 1.0f, p->a, p->k, p->b,
              p->k, 0.0f, p->c, p->n);
}

static void run_kernel(void *arg) {
  prob_t *p = arg;
  zt_kernels_cpu()->matmul_forward(p->c, p->a, p->b, NULL, p->m, p->k, p->n);
}

/* BLIS's native sgemm: C = alpha op(A) op(B) + beta C with explicit row
 * and column strides (dim_t and inc_t are 64-bit in Debian's build). The
 * transposed B of the other rows is B read with swapped strides. */
typedef void (*blis_sgemm_fn)(int transa, int transb, int64_t m, int64_t n, int64_t k,
                              const float *alpha, const float *a, int64_t rsa, int64_t csa,
                              const float *b, int64_t rsb, int64_t csb, const float *beta,
                              float *c, int64_t rsc, int64_t csc);
static blis_sgemm_fn blis_sgemm;

static void run_blis(void *arg) {
  prob_t *p = arg;
  const float one = 1.0f, zero = 0.0f;
  blis_sgemm(0, 0, p->m, p->n, p->k, &one, p->a, p->k, 1, p->b, 1, p->k, &zero, p->c, p->n, 1);
}

/* Loads libblis.so.4 with N threads; returns its arch name, or NULL. */
static const char *blis_load(int threads) {
  void *h = dlopen("libblis.so.4", RTLD_NOW | RTLD_LOCAL);
  if (!h) return NULL;
  void (*set_threads)(int64_t) = (void (*)(int64_t))dlsym(h, "bli_thread_set_num_threads");
  int (*arch_id)(void) = (int (*)(void))dlsym(h, "bli_arch_query_id");
  const char *(*arch_name)(int) = (const char *(*)(int))dlsym(h, "bli_arch_string");
  blis_sgemm = (blis_sgemm_fn)dlsym(h, "bli_sgemm");
  if (!set_threads || !arch_id || !arch_name || !blis_sgemm) return NULL;
  set_threads(threads);
  return arch_name(arch_id());
}

static int want(const char *rows, const char *row) {
  size_t n = strlen(row);
  for (const char *p = rows; (p = strstr(p, row)) != NULL; p += n)
    if ((p == rows || p[-1] == ',') && (p[n] == ',' || p[n] == 0)) return 1;
  return 0;
}

int main(int argc, char **argv) {
  int threads = 1, iters = 5;
  const char *rows = "peak,blis,own,kernel";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--rows")) rows = argv[i + 1];
  }
  if (threads < 1 || iters < 1) {
    fprintf(stderr, "usage: zt_bench_sgemm [--threads N] [--iters I] [--rows peak,blis,own,kernel]\n");
    return 2;
  }
  /* The kernel table pins OpenBLAS to one thread; set the peak run after. */
  zt_kernels_cpu_set_threads(threads);
  prob_t k = {2048, 1536, 384, filled(2048 * 384), filled(1536 * 384), filled(2048 * 1536)};
  prob_t s = {2048, 2048, 2048, filled(2048 * 2048), filled(2048 * 2048), filled(2048 * 2048)};
  const double big = 2.0 * s.m * s.n * s.k;
  if (want(rows, "kernel"))
    printf("kernel %.1f\n", best_gflops(2.0 * k.m * k.n * k.k, iters, run_kernel, &k));
  if (want(rows, "peak")) {
    openblas_set_num_threads(threads);
    printf("peak %.1f\n", best_gflops(big, iters, run_blas, &s));
    openblas_set_num_threads(1);
  }
  if (want(rows, "blis")) {
    const char *arch = blis_load(threads);
    if (arch) printf("blis %.1f\nblis_arch %s\n", best_gflops(big, iters, run_blis, &s), arch);
  }
  if (want(rows, "own")) printf("own %.1f\n", best_gflops(big, iters, run_kernel, &s));
  printf("sgemm %s\nopenblas_core %s\n", zt_kernels_cpu_sgemm(), openblas_get_corename());
  free(k.a), free(k.b), free(k.c), free(s.a), free(s.b), free(s.c);
  return 0;
}
