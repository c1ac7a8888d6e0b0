/*
 * zt_testdata.h: random test data and element-wise comparison for the
 * kernel tests (tests/unit/test_engine_kernels.c, tests/gpu/). Include
 * after zt_test.h: a failed comparison marks the current test failed.
 */
#ifndef ZT_TESTDATA_H
#define ZT_TESTDATA_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static uint64_t zt__rng_state = 88172645463325252ull;

/* Uniform in [-1, 1) from a xorshift generator: the same sequence on every
 * run for a given seed. */
static inline float zt_frand(void) {
  zt__rng_state ^= zt__rng_state << 13;
  zt__rng_state ^= zt__rng_state >> 7;
  zt__rng_state ^= zt__rng_state << 17;
  return (float)((zt__rng_state >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

static inline void zt_test_seed(uint64_t s) { zt__rng_state = s ? s : 1; }

/* n random floats in [-scale, scale) (malloc'ed). */
static inline float *zt_rnd(size_t n, float scale) {
  float *p = malloc(n * sizeof(float) + 1);
  for (size_t i = 0; i < n; i++) p[i] = zt_frand() * scale;
  return p;
}

/* |got - ref| <= atol + rtol |ref| for every element; reports the count
 * and the worst element and marks the test failed otherwise. */
static inline int zt_close_all(const char *what, const float *got, const float *ref, size_t n,
                               float atol, float rtol) {
  size_t bad = 0, worst = 0;
  double worst_excess = -1e300;
  for (size_t i = 0; i < n; i++) {
    double err = fabs((double)got[i] - ref[i]), lim = atol + rtol * fabs((double)ref[i]);
    if (!(err <= lim)) bad++;
    if (err - lim > worst_excess) {
      worst_excess = err - lim;
      worst = i;
    }
  }
  if (bad) {
    fprintf(stderr, "  %s: %zu of %zu elements differ; worst [%zu] got %.9g ref %.9g\n", what,
            bad, n, worst, got[worst], ref[worst]);
    zt__test_failed = 1;
  }
  return bad == 0;
}

#endif
