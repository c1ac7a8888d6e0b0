/*
 * rng.h: small, portable, seedable random numbers for the engine.
 *
 * Everything random in training must be a pure function of the job's seed so
 * that any process can recompute it: the initial weights of a unit (model.c)
 * and the sample order of an epoch (data.c). The generator is xoshiro256**
 * seeded through splitmix64 (both by Blackman and Vigna), defined here in
 * full so that the sequence never depends on the C library. A generator is
 * identified by (seed, stream): different streams give independent
 * sequences, e.g. one per model unit or one per data epoch.
 */
#ifndef ZT_RNG_H
#define ZT_RNG_H

#include <math.h>
#include <stdint.h>

typedef struct zt_rng {
  uint64_t s[4];
} zt_rng_t;

static inline uint64_t zt_splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Seeds the generator for (seed, stream). */
static inline void zt_rng_seed(zt_rng_t *r, uint64_t seed, uint64_t stream) {
  uint64_t x = seed;
  uint64_t mix = zt_splitmix64(&x) ^ (stream * 0xD1B54A32D192ED03ull);
  for (int i = 0; i < 4; i++) r->s[i] = zt_splitmix64(&mix);
}

static inline uint64_t zt_rng_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline uint64_t zt_rng_next(zt_rng_t *r) {
  uint64_t *s = r->s;
  uint64_t result = zt_rng_rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = zt_rng_rotl(s[3], 45);
  return result;
}

/* Uniform in (0, 1), never exactly 0 or 1. */
static inline double zt_rng_uniform(zt_rng_t *r) {
  return ((double)(zt_rng_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

/* Uniform integer in [0, n) without modulo bias (Lemire's method with
 * rejection), for n >= 1. */
static inline uint64_t zt_rng_below(zt_rng_t *r, uint64_t n) {
  uint64_t threshold = (0 - n) % n;
  for (;;) {
    uint64_t x = zt_rng_next(r);
    unsigned __int128 m = (unsigned __int128)x * n;
    if ((uint64_t)m >= threshold) return (uint64_t)(m >> 64);
  }
}

/* Standard normal by Box-Muller (one value per call, the pair's second
 * value is discarded so that the sequence is a simple function of the
 * stream position). */
static inline double zt_rng_normal(zt_rng_t *r) {
  double u1 = zt_rng_uniform(r), u2 = zt_rng_uniform(r);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

#endif
