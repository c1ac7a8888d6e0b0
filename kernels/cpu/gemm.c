/*
 * gemm.c: zt_sgemm, the matrix product under the fast CPU kernels.
 *
 * Every linear layer and every attention block of zt_kernels_cpu() is a
 * single-threaded sgemm called by one OpenMP thread on its own slice of the
 * problem (fast.c). OpenBLAS does that well on the CPUs it has kernels for,
 * but the version Debian 12 ships (0.3.21) runs its 256-bit Haswell kernels
 * on CPUs with AVX-512, whose 512-bit FMA units then do half the work they
 * could. On a CPU with AVX-512F this file therefore has its own product, in
 * the usual shape of a BLIS-style GEMM:
 *
 *   for each NC-wide column panel of C
 *     for each KC-deep slice of the sum      pack op(B)[KC, NC] (NR-wide strips)
 *       for each MC-high row block of C      pack op(A)[MC, KC] (MR-high strips)
 *         for each NR strip, each MR strip   micro-kernel: C[MR, NR] += A B
 *
 * The micro-kernel keeps a 14 x 32 tile of C in 28 zmm registers and, per k,
 * loads 32 floats of B (two registers) and broadcasts 14 of A into 28 FMAs.
 * Packing turns every transposition into the same layout, so one kernel
 * serves all four (ta, tb) cases; strips are zero-padded, and the kernel
 * stores only the rows and columns that exist (masked stores).
 *
 * Determinism: element C[i][j] is the sum over k in order, one FMA at a time
 * in one register lane, with the KC slices added to C in order; nothing
 * depends on i, j, M or N. A product split into row blocks (as fast.c splits
 * it across threads) therefore gives the same bits for any split, which
 * OpenBLAS does not promise.
 *
 * Elsewhere (no AVX-512F, another architecture, or ZT_SGEMM=blas in the
 * environment) zt_sgemm is cblas_sgemm. The unit tests check our product
 * against a double-precision reference and against OpenBLAS on every shape
 * class the kernels use; bench/cpu-train prints which one ran.
 */
#include "gemm.h"

#include <cblas.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "zt_common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define ZT_GEMM_HAVE_AVX512 1
#include <immintrin.h>
#else
#define ZT_GEMM_HAVE_AVX512 0
#endif

static void blas_sgemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                       const float *B, int ldb, float beta, float *C, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
              K, alpha, A, lda, B, ldb, beta, C, ldc);
}

#if ZT_GEMM_HAVE_AVX512

#define ZT_GEMM_MR 14
#define ZT_GEMM_NR 32
#ifndef ZT_GEMM_KC
#define ZT_GEMM_KC 256
#endif
#ifndef ZT_GEMM_MC
#define ZT_GEMM_MC (ZT_GEMM_MR * 12)
#endif
#ifndef ZT_GEMM_NC
#define ZT_GEMM_NC (ZT_GEMM_NR * 32)
#endif
#define ZT_AVX512 __attribute__((target("avx512f")))

static int imin(int a, int b) { return a < b ? a : b; }

/* Each thread packs into its own buffer, kept from one call to the next
 * (at most (KC NC + KC MC) floats, 1.2 MiB) and freed when the thread ends.
 * Allocating it per call would map and unmap fresh pages every product,
 * which costs a multi-threaded process page faults and TLB shootdowns: two
 * threads ran at a third of their speed that way. */
static pthread_key_t zt_gemm_key;
static pthread_once_t zt_gemm_once = PTHREAD_ONCE_INIT;

typedef struct {
  size_t cap; /* floats */
  char *mem;  /* cap floats from a 64-byte line, so strips of B load aligned */
} pack_buf;

static void pack_buf_free(void *p) {
  pack_buf *b = p;
  free(b->mem);
  free(b);
}

static int zt_gemm_key_ok;

static void pack_key_make(void) {
  zt_gemm_key_ok = pthread_key_create(&zt_gemm_key, pack_buf_free) == 0;
}

/* The calling thread's buffer of at least `floats`, or NULL when the thread
 * cannot have one (no key left: the caller then uses OpenBLAS). */
static float *pack_buffer(size_t floats) {
  pthread_once(&zt_gemm_once, pack_key_make);
  if (!zt_gemm_key_ok) return NULL;
  pack_buf *b = pthread_getspecific(zt_gemm_key);
  if (!b) {
    b = zt_xcalloc(1, sizeof *b);
    if (pthread_setspecific(zt_gemm_key, b) != 0) {
      free(b);
      return NULL;
    }
  }
  if (b->cap < floats) {
    free(b->mem);
    b->mem = zt_xmalloc(sizeof(float) * floats + 64);
    b->cap = floats;
  }
  return (float *)(b->mem + (64 - (uintptr_t)b->mem % 64));
}

/* Mask of the first n (0..16) lanes. */
static inline __mmask16 lanes(int n) {
  return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n < 0 ? 0 : n)) - 1);
}

/* Transposes the 16 x 16 block in r (r[i] is row i) in registers:
 * afterwards r[c] holds column c. Four rounds of shuffles: pairs of rows
 * within 128-bit lanes, then quads, then the 128-bit lanes themselves. */
ZT_AVX512 static inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int j = 0; j < 8; j++) {
    t[2 * j] = _mm512_unpacklo_ps(r[2 * j], r[2 * j + 1]);
    t[2 * j + 1] = _mm512_unpackhi_ps(r[2 * j], r[2 * j + 1]);
  }
  for (int j = 0; j < 4; j++) { /* u[4j + m], lane L: column 4L + m of rows 4j..4j+3 */
    u[4 * j] = _mm512_shuffle_ps(t[4 * j], t[4 * j + 2], 0x44);
    u[4 * j + 1] = _mm512_shuffle_ps(t[4 * j], t[4 * j + 2], 0xEE);
    u[4 * j + 2] = _mm512_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0x44);
    u[4 * j + 3] = _mm512_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0xEE);
  }
  for (int m = 0; m < 4; m++) {
    __m512 v0 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44);
    __m512 v1 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
    __m512 v2 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44);
    __m512 v3 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + m] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[8 + m] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}

/* Reads `rows` (<= 16) rows of a row-major matrix, kc elements each from
 * src (row stride ld), and writes them transposed: element (row i, k) goes
 * to dst[k * dstride + i], for i < 16 (rows past `rows` as zeros) under
 * mask `keep` (the lanes the destination has). 16 k at a time through
 * transpose16. */
ZT_AVX512 static void pack_transposed(const float *src, size_t ld, int rows, int kc, float *dst,
                                      int dstride, __mmask16 keep) {
  __m512 r[16];
  for (int k = 0; k < kc; k += 16) {
    __mmask16 km = lanes(kc - k);
    for (int i = 0; i < 16; i++)
      r[i] = i < rows ? _mm512_maskz_loadu_ps(km, src + (size_t)i * ld + k) : _mm512_setzero_ps();
    transpose16(r);
    int n = kc - k < 16 ? kc - k : 16;
    for (int kk = 0; kk < n; kk++)
      _mm512_mask_storeu_ps(dst + (size_t)(k + kk) * dstride, keep, r[kk]);
  }
}

/* Packs op(B)[pc:pc+kc, jc:jc+nc] into NR-wide strips, k-major inside a
 * strip, columns past nc zero. */
ZT_AVX512 static void pack_b(int tb, const float *B, int ldb, int pc, int jc, int kc, int nc,
                             float *bp) {
  for (int s = 0; s < nc; s += ZT_GEMM_NR, bp += (size_t)kc * ZT_GEMM_NR) {
    int nr = imin(ZT_GEMM_NR, nc - s);
    if (!tb) {
      __mmask16 m0 = lanes(nr), m1 = lanes(nr - 16);
      for (int k = 0; k < kc; k++) {
        const float *src = B + (size_t)(pc + k) * ldb + jc + s;
        float *dst = bp + (size_t)k * ZT_GEMM_NR;
        _mm512_store_ps(dst, _mm512_maskz_loadu_ps(m0, src));
        _mm512_store_ps(dst + 16, _mm512_maskz_loadu_ps(m1, src + 16));
      }
    } else {
      for (int h = 0; h < ZT_GEMM_NR; h += 16)
        pack_transposed(B + (size_t)(jc + s + h) * ldb + pc, (size_t)ldb, nr - h, kc, bp + h,
                        ZT_GEMM_NR, 0xFFFF);
    }
  }
}

/* Packs op(A)[ic:ic+mc, pc:pc+kc] into MR-high strips, k-major inside a
 * strip, rows past mc zero. */
ZT_AVX512 static void pack_a(int ta, const float *A, int lda, int ic, int pc, int mc, int kc,
                             float *ap) {
  const __mmask16 strip = lanes(ZT_GEMM_MR);
  for (int s = 0; s < mc; s += ZT_GEMM_MR, ap += (size_t)kc * ZT_GEMM_MR) {
    int mr = imin(ZT_GEMM_MR, mc - s);
    if (ta) {
      __mmask16 m = lanes(mr);
      for (int k = 0; k < kc; k++)
        _mm512_mask_storeu_ps(ap + (size_t)k * ZT_GEMM_MR, strip,
                              _mm512_maskz_loadu_ps(m, A + (size_t)(pc + k) * lda + ic + s));
    } else {
      pack_transposed(A + (size_t)(ic + s) * lda + pc, (size_t)lda, mr, kc, ap, ZT_GEMM_MR,
                      strip);
    }
  }
}

/* C[mr, nr] = alpha * (a b) + beta * C for one tile; a is an MR strip and b
 * an NR strip, both kc deep. With beta == 0, C is not read. */
ZT_AVX512 static void kernel_14x32(int kc, const float *a, const float *b, float *c, int ldc,
                                    int mr, int nr, float alpha, float beta) {
  __m512 acc[ZT_GEMM_MR][2];
#pragma GCC unroll 14
  for (int i = 0; i < ZT_GEMM_MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int k = 0; k < kc; k++, a += ZT_GEMM_MR, b += ZT_GEMM_NR) {
    __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
#pragma GCC unroll 14
    for (int i = 0; i < ZT_GEMM_MR; i++) {
      __m512 av = _mm512_set1_ps(a[i]);
      acc[i][0] = _mm512_fmadd_ps(av, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(av, b1, acc[i][1]);
    }
  }
  __mmask16 m0 = lanes(nr), m1 = lanes(nr - 16);
  __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 14
  for (int i = 0; i < ZT_GEMM_MR; i++) {
    if (i >= mr) break;
    float *ci = c + (size_t)i * ldc;
    __m512 r0 = _mm512_mul_ps(va, acc[i][0]), r1 = _mm512_mul_ps(va, acc[i][1]);
    if (beta != 0.0f) {
      r0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, ci), r0);
      r1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, ci + 16), r1);
    }
    _mm512_mask_storeu_ps(ci, m0, r0);
    _mm512_mask_storeu_ps(ci + 16, m1, r1);
  }
}

ZT_AVX512 static int own_sgemm(int ta, int tb, int M, int N, int K, float alpha, const float *A,
                                int lda, const float *B, int ldb, float beta, float *C, int ldc) {
  int ncap = imin(ZT_GEMM_NC, (N + ZT_GEMM_NR - 1) / ZT_GEMM_NR * ZT_GEMM_NR);
  int mcap = imin(ZT_GEMM_MC, (M + ZT_GEMM_MR - 1) / ZT_GEMM_MR * ZT_GEMM_MR);
  int kcap = imin(ZT_GEMM_KC, K);
  size_t bsz = (size_t)kcap * ncap, asz = (size_t)kcap * mcap;
  float *bp = pack_buffer(bsz + asz);
  if (!bp) return -1;
  float *ap = bp + bsz;
  for (int jc = 0; jc < N; jc += ZT_GEMM_NC) {
    int nc = imin(ZT_GEMM_NC, N - jc);
    for (int pc = 0; pc < K; pc += ZT_GEMM_KC) {
      int kc = imin(ZT_GEMM_KC, K - pc);
      float bk = pc == 0 ? beta : 1.0f;
      pack_b(tb, B, ldb, pc, jc, kc, nc, bp);
      for (int ic = 0; ic < M; ic += ZT_GEMM_MC) {
        int mc = imin(ZT_GEMM_MC, M - ic);
        pack_a(ta, A, lda, ic, pc, mc, kc, ap);
        for (int jr = 0; jr < nc; jr += ZT_GEMM_NR) {
          const float *bs = bp + (size_t)jr * kc;
          for (int ir = 0; ir < mc; ir += ZT_GEMM_MR)
            kernel_14x32(kc, ap + (size_t)ir * kc, bs, C + (size_t)(ic + ir) * ldc + jc + jr, ldc,
                         imin(ZT_GEMM_MR, mc - ir), imin(ZT_GEMM_NR, nc - jr), alpha, bk);
        }
      }
    }
  }
  return 0;
}

static int cpu_has_avx512(void) { return __builtin_cpu_supports("avx512f"); }

#else
static int cpu_has_avx512(void) { return 0; }
#endif

/* -1 until the first call decides; then 1 (ours) or 0 (OpenBLAS). */
static atomic_int zt_gemm_own = -1;

static atomic_flag zt_gemm_warned = ATOMIC_FLAG_INIT;

/* ZT_SGEMM=blas forces OpenBLAS; unset, empty or "avx512" leaves the choice
 * to the CPU; anything else is a mistake said once, and ignored. */
static int gemm_choose(void) {
  const char *env = zt_env(ZT_ENV_SGEMM);
  if (env && !strcmp(env, "blas")) return 0;
  if (env && env[0] && strcmp(env, "avx512") != 0 && !atomic_flag_test_and_set(&zt_gemm_warned))
    ZT_WARN("ZT_SGEMM=%s: unknown (blas or avx512); the CPU chooses (%s)", env,
            cpu_has_avx512() ? "avx512" : "blas");
  return cpu_has_avx512();
}

const char *zt_sgemm_impl(void) {
  if (zt_gemm_own < 0) zt_gemm_own = gemm_choose();
  return zt_gemm_own ? "avx512" : "blas";
}

const char *zt_sgemm_force(int own) {
  zt_gemm_own = own < 0 ? gemm_choose() : own && cpu_has_avx512();
  return zt_sgemm_impl();
}

void zt_sgemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
              const float *B, int ldb, float beta, float *C, int ldc) {
  if (M <= 0 || N <= 0) return;
  if (zt_gemm_own < 0) zt_gemm_own = gemm_choose();
#if ZT_GEMM_HAVE_AVX512
  if (zt_gemm_own && K > 0 &&
      own_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc) == 0)
    return;
#endif
  blas_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
