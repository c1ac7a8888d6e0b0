/*
 * sgemm.c: zt_bench_sgemm, the CPU's matmul throughput for bench/cpu-train.
 *
 *   zt_bench_sgemm [--threads N] [--iters I]
 *
 * Prints three figures in GFLOP/s (2*M*N*K flops per product):
 *
 *   peak    OpenBLAS sgemm with N threads on 2048 x 2048 x 2048, the
 *           practical peak of this machine's BLAS;
 *   own     the engine's matmul_forward, as for `kernel` below, on the
 *           same 2048^3 product: our zt_sgemm (kernels/cpu/gemm.c) where
 *           the CPU has AVX-512F, else OpenBLAS single-threaded per thread;
 *   kernel  the engine's matmul_forward (zt_kernels_cpu, N OpenMP threads,
 *           one zt_sgemm per thread) on the small example's MLP shape:
 *           [2048 tokens, 384] x [1536, 384]^T;
 *
 * and "sgemm <impl>", the implementation zt_sgemm uses (avx512 or blas).
 * One line per figure; each is the best of I timed repetitions after
 * repeating the product for at least 300 ms, so that the threads have
 * settled on their own cores (a shorter warm-up sometimes timed two threads
 * sharing one core).
 */
#include <cblas.h>
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

int main(int argc, char **argv) {
  int threads = 1, iters = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
  }
  if (threads < 1 || iters < 1) {
    fprintf(stderr, "usage: zt_bench_sgemm [--threads N] [--iters I]\n");
    return 2;
  }
  /* The kernel table pins OpenBLAS to one thread; set the peak run after. */
  zt_kernels_cpu_set_threads(threads);
  prob_t k = {2048, 1536, 384, filled(2048 * 384), filled(1536 * 384), filled(2048 * 1536)};
  double kern = best_gflops(2.0 * k.m * k.n * k.k, iters, run_kernel, &k);
  openblas_set_num_threads(threads);
  prob_t s = {2048, 2048, 2048, filled(2048 * 2048), filled(2048 * 2048), filled(2048 * 2048)};
  double peak = best_gflops(2.0 * s.m * s.n * s.k, iters, run_blas, &s);
  openblas_set_num_threads(1);
  double own = best_gflops(2.0 * s.m * s.n * s.k, iters, run_kernel, &s);
  printf("peak %.1f\nown %.1f\nkernel %.1f\nsgemm %s\n", peak, own, kern, zt_kernels_cpu_sgemm());
  free(k.a), free(k.b), free(k.c), free(s.a), free(s.b), free(s.c);
  return 0;
}
