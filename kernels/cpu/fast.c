/*
 * fast.c: the fast CPU kernels, zt_kernels_cpu().
 *
 * The same functions as the reference table (ref.c), organised for speed on a
 * multi-core CPU:
 *
 *   - Threads. One OpenMP thread team does all the parallel work, and every
 *     matrix product is a single-threaded zt_sgemm (gemm.c) called from
 *     inside an OpenMP region on a thread's own slice of the problem (rows
 *     of the output, or rows of the weight gradient). zt_sgemm is our own
 *     AVX-512 product where the CPU has AVX-512F and OpenBLAS's sgemm
 *     otherwise; OpenBLAS is pinned to one thread, so two thread pools
 *     (OpenMP and OpenBLAS's pthreads) never compete for the cores.
 *   - Matmuls. Linear layers are sgemm calls on contiguous row blocks.
 *     Attention runs one (batch, head) pair per loop iteration, each with
 *     four or five small sgemm calls over strided views of qkv (the leading
 *     dimension is 3C), so no head is ever copied out.
 *   - Elementwise loops are `omp simd` loops; exp and tanh use a polynomial
 *     exp (zt_expf below, Cephes' single-precision coefficients, about 1 ulp)
 *     that vectorizes, where libm's expf would not.
 *
 * Determinism: every loop uses a static schedule and every reduction has a
 * fixed order that does not depend on the number of threads (LayerNorm
 * weight gradients are summed over fixed chunks of rows, sumsq over fixed
 * chunks of ZT_KERNELS_SUMSQ_CHUNK elements, bias gradients per column). The
 * kernels themselves are therefore bitwise reproducible for any thread count.
 * Our AVX-512 sgemm gives the same bits for any split of its rows, so with
 * it whole steps are too; OpenBLAS's sgemm is reproducible only for a fixed
 * problem split, which the thread count determines, so where it runs
 * end-to-end results are guaranteed bit-identical only for a fixed thread
 * count.
 */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"
#include "zt_common.h"
#include "zt_kernels.h"

#define ZT_LN_CHUNK_ROWS 32              /* rows per partial sum in layernorm_backward */
#define ZT_MIN_SZ(a, b) ((a) < (b) ? (a) : (b))

/* ---- utilities ---------------------------------------------------------- */

/* Splits [0, n) into nt near-equal contiguous parts; part tid is [*lo, *hi). */
static void zt_split(size_t n, int tid, int nt, size_t *lo, size_t *hi) {
  size_t base = n / (size_t)nt, rem = n % (size_t)nt;
  size_t t = (size_t)tid;
  *lo = t * base + (t < rem ? t : rem);
  *hi = *lo + base + (t < rem ? 1 : 0);
}

/* Like zt_split but part boundaries are multiples of `align` (except n). */
static void zt_split_aligned(size_t n, size_t align, int tid, int nt, size_t *lo, size_t *hi) {
  size_t blocks = (n + align - 1) / align;
  zt_split(blocks, tid, nt, lo, hi);
  *lo = ZT_MIN_SZ(*lo * align, n);
  *hi = ZT_MIN_SZ(*hi * align, n);
}

/* A float's bits. A named type: clang rejects an anonymous union declared
 * inside a function marked `omp declare simd`. */
typedef union {
  int32_t i;
  float f;
} zt_f32bits;

/* exp(x) for float, vectorizable. Cephes expf: x = n ln2 + r, |r| <= ln2/2,
 * a degree-6 polynomial for e^r, then scale by 2^n built in the exponent
 * bits. Inputs are clamped to the finite range, so it never overflows. */
#pragma omp declare simd notinbranch
static inline float zt_expf(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.3f ? 88.3f : x;
  float fx = floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - fx * 0.693359375f;
  r = r + fx * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  zt_f32bits p;
  p.i = ((int32_t)fx + 127) << 23;
  return y * p.f;
}

/* tanh(x) = (e^2x - 1) / (e^2x + 1); |x| >= 9 rounds to +-1 in float. */
#pragma omp declare simd notinbranch
static inline float zt_tanhf(float x) {
  x = x < -9.0f ? -9.0f : x;
  x = x > 9.0f ? 9.0f : x;
  float e = zt_expf(2.0f * x);
  return (e - 1.0f) / (e + 1.0f);
}

static int zt_kernels_initialized;

/* OpenBLAS runs single-threaded: all parallelism comes from OpenMP. */
static void zt_kernels_init(void) {
  if (zt_kernels_initialized) return;
  openblas_set_num_threads(1);
  zt_kernels_initialized = 1;
}

/* ---- encoder ------------------------------------------------------------ */

static void fast_encoder_forward(float *out, const int *inp, const float *wte, const float *wpe,
                                 int B, int T, int C) {
  int BT = B * T;
#pragma omp parallel for schedule(static)
  for (int bt = 0; bt < BT; bt++) {
    int t = bt % T;
    float *o = out + (size_t)bt * C;
    const float *we = wte + (size_t)inp[bt] * C;
    const float *pe = wpe + (size_t)t * C;
#pragma omp simd
    for (int i = 0; i < C; i++) o[i] = we[i] + pe[i];
  }
}

/* Each thread owns a slice of the C channels of every row, and walks all
 * tokens in order: no two threads touch the same gradient element, and the
 * summation order is the reference's. */
static void fast_encoder_backward(float *dwte, float *dwpe, const float *dout, const int *inp,
                                  int B, int T, int C) {
  int BT = B * T;
#pragma omp parallel
  {
    size_t lo, hi;
    zt_split_aligned((size_t)C, 16, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
    for (int bt = 0; bt < BT && lo < hi; bt++) {
      const float *d = dout + (size_t)bt * C;
      float *dwe = dwte + (size_t)inp[bt] * C;
      float *dpe = dwpe + (size_t)(bt % T) * C;
#pragma omp simd
      for (size_t i = lo; i < hi; i++) {
        dwe[i] += d[i];
        dpe[i] += d[i];
      }
    }
  }
}

/* ---- layernorm ------------------------------------------------------------ */

static void fast_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                   const float *w, const float *b, int N, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const float *x = inp + (size_t)n * C;
    float *o = out + (size_t)n * C;
    float m = 0.0f;
#pragma omp simd reduction(+ : m)
    for (int i = 0; i < C; i++) m += x[i];
    m /= C;
    float v = 0.0f;
#pragma omp simd reduction(+ : v)
    for (int i = 0; i < C; i++) v += (x[i] - m) * (x[i] - m);
    v /= C;
    float s = 1.0f / sqrtf(v + ZT_LN_EPS);
#pragma omp simd
    for (int i = 0; i < C; i++) o[i] = (x[i] - m) * s * w[i] + b[i];
    mean[n] = m;
    rstd[n] = s;
  }
}

/* One row of the LayerNorm backward; dw/db are accumulated into pdw/pdb. */
static void ln_backward_row(float *dx, float *pdw, float *pdb, const float *d, const float *x,
                            const float *w, float m, float s, int C) {
  float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
  for (int i = 0; i < C; i++) {
    float norm = (x[i] - m) * s;
    float dnorm = w[i] * d[i];
    dnorm_mean += dnorm;
    dnorm_norm_mean += dnorm * norm;
  }
  dnorm_mean /= C;
  dnorm_norm_mean /= C;
#pragma omp simd
  for (int i = 0; i < C; i++) {
    float norm = (x[i] - m) * s;
    float dnorm = w[i] * d[i];
    pdb[i] += d[i];
    pdw[i] += norm * d[i];
    dx[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
  }
}

/* Rows are processed in fixed chunks of ZT_LN_CHUNK_ROWS, each with its own
 * partial dw/db; the partials are then added in chunk order, one column
 * range per thread. The result does not depend on the thread count. */
static void fast_layernorm_backward(float *dinp, float *dw, float *db, const float *dout,
                                    const float *inp, const float *w, const float *mean,
                                    const float *rstd, int N, int C) {
  int nchunks = (N + ZT_LN_CHUNK_ROWS - 1) / ZT_LN_CHUNK_ROWS;
  float *part = zt_xcalloc((size_t)nchunks * 2 * C, sizeof(float));
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int c = 0; c < nchunks; c++) {
      float *pdw = part + (size_t)c * 2 * C, *pdb = pdw + C;
      int end = ZT_MIN_SZ((c + 1) * ZT_LN_CHUNK_ROWS, N);
      for (int n = c * ZT_LN_CHUNK_ROWS; n < end; n++) {
        ln_backward_row(dinp + (size_t)n * C, pdw, pdb, dout + (size_t)n * C,
                        inp + (size_t)n * C, w, mean[n], rstd[n], C);
      }
    }
#pragma omp for schedule(static)
    for (int i = 0; i < C; i++) {
      float sw = 0.0f, sb = 0.0f;
      for (int c = 0; c < nchunks; c++) {
        sw += part[(size_t)c * 2 * C + i];
        sb += part[(size_t)c * 2 * C + C + i];
      }
      dw[i] += sw;
      db[i] += sb;
    }
  }
  free(part);
}

/* ---- matmul --------------------------------------------------------------- */

static void fast_matmul_forward(float *out, const float *inp, const float *w, const float *bias,
                                int N, int IC, int OC) {
#pragma omp parallel
  {
    size_t lo, hi;
    zt_split((size_t)N, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
    if (hi > lo) {
      float beta = 0.0f;
      if (bias) {
        for (size_t n = lo; n < hi; n++) memcpy(out + n * OC, bias, sizeof(float) * OC);
        beta = 1.0f;
      }
      zt_sgemm(0, 1, (int)(hi - lo), OC, IC, 1.0f,
               inp + lo * IC, IC, w, IC, beta, out + lo * OC, OC);
    }
  }
}

static void fast_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                                 const float *inp, const float *w, int N, int IC, int OC) {
#pragma omp parallel
  {
    int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    size_t lo, hi;
    /* dinp[N, IC] = dout[N, OC] @ w[OC, IC], split by rows of dinp. */
    if (dinp) {
      zt_split((size_t)N, tid, nt, &lo, &hi);
      if (hi > lo)
        zt_sgemm(0, 0, (int)(hi - lo), IC, OC, 1.0f,
                 dout + lo * OC, OC, w, IC, 0.0f, dinp + lo * IC, IC);
    }
    /* dw[OC, IC] += dout^T @ inp, split by rows of dw; dbias by the same
     * columns of dout, each column summed over all rows in order. */
    zt_split_aligned((size_t)OC, 16, tid, nt, &lo, &hi);
    if (hi > lo && dw) {
      zt_sgemm(1, 0, (int)(hi - lo), IC, N, 1.0f, dout + lo,
               OC, inp, IC, 1.0f, dw + lo * IC, IC);
      if (dbias) {
        float acc[16];
        for (size_t o0 = lo; o0 < hi; o0 += 16) {
          size_t cnt = ZT_MIN_SZ(16, hi - o0);
          memset(acc, 0, sizeof acc);
          for (int n = 0; n < N; n++) {
            const float *d = dout + (size_t)n * OC + o0;
            for (size_t i = 0; i < cnt; i++) acc[i] += d[i];
          }
          for (size_t i = 0; i < cnt; i++) dbias[o0 + i] += acc[i];
        }
      }
    }
  }
}

/* ---- attention ------------------------------------------------------------ */

/* Tiled causal attention (flash attention's algorithm on the CPU). Queries
 * and keys go in blocks of ZT_ATT_BLK rows; a query block meets only the key
 * blocks at or before it (the masked half is never computed), and no T x T
 * matrix exists: forward keeps a running maximum m, sum l and output
 * accumulator per query row (online softmax) and leaves lse = m + log l;
 * backward recomputes each block's probabilities P = exp(S scale - lse) and
 * uses D = rowsum(dO * O) for the softmax's sum(P * dP). Each block's
 * products are sgemm calls on strided views of qkv. */
#define ZT_ATT_BLK 64

/* One query head of one sequence. Grouped-query attention reads each K/V
 * head where it is, for the NH / NKV query heads that share it: row stride
 * W = (NH + 2 NKV) hs; out rows are A = NH hs wide. */
typedef struct {
  int b, h, hs, T, C, NH; /* C: out's row width A */
  int W;                  /* qkv's row width */
  float scale;
  const float *q, *k, *v; /* this head's columns of qkv (row stride W) */
} att_head;

static att_head att_head_at(const float *qkv, int bh, int T, int NH, int NKV, int HD) {
  int W = (NH + 2 * NKV) * HD;
  att_head a = {bh / NH, bh % NH, HD, T, NH * HD, NH, W, 1.0f / sqrtf((float)HD),
                NULL, NULL, NULL};
  const float *row = qkv + (size_t)a.b * T * W;
  int g = a.h / (NH / NKV);
  a.q = row + (size_t)a.h * HD;
  a.k = row + (size_t)NH * HD + (size_t)g * HD;
  a.v = a.k + (size_t)NKV * HD;
  return a;
}

/* Keys of block j0 that query row i sees (0 when none). */
static inline int att_visible(int i, int j0, int nk) {
  return i < j0 ? 0 : ZT_MIN_SZ(nk, i - j0 + 1);
}

/* One query block [i0, i0 + nq) of one head: out rows and lse. s is nq x
 * ZT_ATT_BLK scratch, acc nq x hs, m and l nq. */
static void att_fwd_block(const att_head *a, int i0, int nq, float *out, float *lse, float *s,
                          float *acc, float *m, float *l) {
  int hs = a->hs, C3 = a->W;
  for (int r = 0; r < nq; r++) m[r] = -INFINITY, l[r] = 0.0f;
  memset(acc, 0, sizeof(float) * (size_t)nq * hs);
  for (int j0 = 0; j0 < i0 + nq; j0 += ZT_ATT_BLK) {
    int nk = ZT_MIN_SZ(ZT_ATT_BLK, i0 + nq - j0);
    zt_sgemm(0, 1, nq, nk, hs, a->scale,
             a->q + (size_t)i0 * C3, C3, a->k + (size_t)j0 * C3, C3, 0.0f, s, ZT_ATT_BLK);
    for (int r = 0; r < nq; r++) {
      float *row = s + (size_t)r * ZT_ATT_BLK;
      int vis = att_visible(i0 + r, j0, nk);
      float mx = m[r];
      for (int c = 0; c < vis; c++) mx = row[c] > mx ? row[c] : mx;
      float corr = vis ? zt_expf(m[r] - mx) : 1.0f, sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int c = 0; c < vis; c++) {
        float e = zt_expf(row[c] - mx);
        row[c] = e;
        sum += e;
      }
      for (int c = vis; c < nk; c++) row[c] = 0.0f;
      if (vis) m[r] = mx;
      l[r] = l[r] * corr + sum;
      if (corr != 1.0f)
        for (int x = 0; x < hs; x++) acc[(size_t)r * hs + x] *= corr;
    }
    zt_sgemm(0, 0, nq, hs, nk, 1.0f, s, ZT_ATT_BLK,
             a->v + (size_t)j0 * C3, C3, 1.0f, acc, hs);
  }
  for (int r = 0; r < nq; r++) {
    float inv = 1.0f / l[r], *o = out + ((size_t)a->b * a->T + i0 + r) * a->C + (size_t)a->h * hs;
    for (int x = 0; x < hs; x++) o[x] = acc[(size_t)r * hs + x] * inv;
    lse[((size_t)a->b * a->NH + a->h) * a->T + i0 + r] = m[r] + logf(l[r]);
  }
}

static void fast_attention_forward_gqa(float *out, float *lse, const float *qkv, int B, int T,
                                       int NH, int NKV, int hs) {
  int nblk = (T + ZT_ATT_BLK - 1) / ZT_ATT_BLK;
#pragma omp parallel
  {
    float *s = zt_xmalloc(sizeof(float) * ZT_ATT_BLK * (ZT_ATT_BLK + hs + 2));
    float *acc = s + ZT_ATT_BLK * ZT_ATT_BLK, *m = acc + ZT_ATT_BLK * hs, *l = m + ZT_ATT_BLK;
    /* Later query blocks cost more: hand them out first, dynamically. */
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < B * NH * nblk; task++) {
      int blk = nblk - 1 - task / (B * NH);
      att_head a = att_head_at(qkv, task % (B * NH), T, NH, NKV, hs);
      int i0 = blk * ZT_ATT_BLK;
      att_fwd_block(&a, i0, ZT_MIN_SZ(ZT_ATT_BLK, T - i0), out, lse, s, acc, m, l);
    }
    free(s);
  }
}

static void fast_attention_forward(float *out, float *lse, const float *qkv, int B, int T, int C,
                                   int NH) {
  fast_attention_forward_gqa(out, lse, qkv, B, T, NH, NH, C / NH);
}

/* Scratch of one backward thread: p and ds are ZT_ATT_BLK x ZT_ATT_BLK,
 * dd (D of the head's rows) T. */
typedef struct {
  float *p, *ds, *dd;
} att_bwd_scratch;

/* The gradient contributions of query block i0 against key block j0. */
static void att_bwd_pair(const att_head *a, int i0, int nq, int j0, int nk, const float *dout,
                         const float *lse, float *dq, float *dk, float *dv,
                         const att_bwd_scratch *w) {
  int hs = a->hs, C3 = a->W, C = a->C;
  const float *d = dout + ((size_t)a->b * a->T + i0) * C + (size_t)a->h * hs;
  const float *ls = lse + ((size_t)a->b * a->NH + a->h) * a->T + i0;
  zt_sgemm(0, 1, nq, nk, hs, a->scale,
           a->q + (size_t)i0 * C3, C3, a->k + (size_t)j0 * C3, C3, 0.0f, w->p, ZT_ATT_BLK);
  zt_sgemm(0, 1, nq, nk, hs, 1.0f, d, C,
           a->v + (size_t)j0 * C3, C3, 0.0f, w->ds, ZT_ATT_BLK);
  for (int r = 0; r < nq; r++) {
    float *pr = w->p + (size_t)r * ZT_ATT_BLK, *dr = w->ds + (size_t)r * ZT_ATT_BLK;
    int vis = att_visible(i0 + r, j0, nk);
    float l = ls[r], dd = w->dd[i0 + r];
#pragma omp simd
    for (int c = 0; c < vis; c++) {
      float pv = zt_expf(pr[c] - l);
      pr[c] = pv;
      dr[c] = pv * (dr[c] - dd) * a->scale;
    }
    for (int c = vis; c < nk; c++) pr[c] = 0.0f, dr[c] = 0.0f;
  }
  zt_sgemm(0, 0, nq, hs, nk, 1.0f, w->ds, ZT_ATT_BLK,
           a->k + (size_t)j0 * C3, C3, 1.0f, dq + (size_t)i0 * C3, C3);
  zt_sgemm(1, 0, nk, hs, nq, 1.0f, w->ds, ZT_ATT_BLK,
           a->q + (size_t)i0 * C3, C3, 1.0f, dk + (size_t)j0 * C3, C3);
  zt_sgemm(1, 0, nk, hs, nq, 1.0f, w->p, ZT_ATT_BLK, d, C,
           1.0f, dv + (size_t)j0 * C3, C3);
}

/* One task per K/V head of a sequence: its gradient starts at 0 and sums
 * over the query heads that share it, which the same task takes one after
 * the other (no two threads write one K/V head). */
static void fast_attention_backward_gqa(float *dqkv, const float *dout, const float *qkv,
                                        const float *out, const float *lse, int B, int T, int NH,
                                        int NKV, int hs) {
  int G = NH / NKV, W = (NH + 2 * NKV) * hs, A = NH * hs;
#pragma omp parallel
  {
    att_bwd_scratch w;
    w.p = zt_xmalloc(sizeof(float) * ((size_t)2 * ZT_ATT_BLK * ZT_ATT_BLK + (size_t)T));
    w.ds = w.p + ZT_ATT_BLK * ZT_ATT_BLK, w.dd = w.ds + ZT_ATT_BLK * ZT_ATT_BLK;
#pragma omp for schedule(static)
    for (int bg = 0; bg < B * NKV; bg++) {
      int b = bg / NKV, g = bg % NKV;
      float *dk = dqkv + (size_t)b * T * W + (size_t)NH * hs + (size_t)g * hs;
      float *dv = dk + (size_t)NKV * hs;
      for (int t = 0; t < T; t++) {
        memset(dk + (size_t)t * W, 0, sizeof(float) * (size_t)hs);
        memset(dv + (size_t)t * W, 0, sizeof(float) * (size_t)hs);
      }
      for (int h = g * G; h < (g + 1) * G; h++) {
        att_head a = att_head_at(qkv, b * NH + h, T, NH, NKV, hs);
        float *dq = dqkv + (size_t)b * T * W + (size_t)h * hs;
        for (int t = 0; t < T; t++) { /* D = rowsum(dO * O); dq starts at 0 */
          const float *d = dout + ((size_t)b * T + t) * A + (size_t)h * hs;
          const float *o = out + ((size_t)b * T + t) * A + (size_t)h * hs;
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int x = 0; x < hs; x++) sum += d[x] * o[x];
          w.dd[t] = sum;
          memset(dq + (size_t)t * W, 0, sizeof(float) * (size_t)hs);
        }
        for (int i0 = 0; i0 < T; i0 += ZT_ATT_BLK)
          for (int j0 = 0; j0 <= i0; j0 += ZT_ATT_BLK)
            att_bwd_pair(&a, i0, ZT_MIN_SZ(ZT_ATT_BLK, T - i0), j0,
                         ZT_MIN_SZ(ZT_ATT_BLK, ZT_MIN_SZ(T, i0 + ZT_ATT_BLK) - j0), dout, lse, dq,
                         dk, dv, &w);
      }
    }
    free(w.p);
  }
}

static void fast_attention_backward(float *dqkv, const float *dout, const float *qkv,
                                    const float *out, const float *lse, int B, int T, int C,
                                    int NH) {
  fast_attention_backward_gqa(dqkv, dout, qkv, out, lse, B, T, NH, NH, C / NH);
}

/* ---- elementwise ---------------------------------------------------------- */

static void fast_gelu_forward(float *out, const float *inp, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) {
    float x = inp[i];
    float th = zt_tanhf(ZT_GELU_SCALE * (x + ZT_GELU_CUBE * x * x * x));
    out[i] = 0.5f * x * (1.0f + th);
  }
}

static void fast_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) {
    float x = inp[i];
    float th = zt_tanhf(ZT_GELU_SCALE * (x + ZT_GELU_CUBE * x * x * x));
    float sech2 = 1.0f - th * th;
    float grad = 0.5f * (1.0f + th) +
                 x * 0.5f * sech2 * ZT_GELU_SCALE * (1.0f + 3.0f * ZT_GELU_CUBE * x * x);
    dinp[i] = grad * dout[i];
  }
}

static void fast_residual_forward(float *out, const float *a, const float *b, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

/* ---- loss ----------------------------------------------------------------- */

static void fast_crossentropy_forward(float *losses, float *probs, const float *logits,
                                      const int *targets, int N, int V, int Vp) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const float *l = logits + (size_t)n * Vp;
    float *p = probs + (size_t)n * Vp;
    float maxv = -INFINITY;
    for (int i = 0; i < V; i++) maxv = l[i] > maxv ? l[i] : maxv;
    float lt = l[targets[n]]; /* read before probs (which may alias) is written */
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < V; i++) {
      float e = zt_expf(l[i] - maxv);
      p[i] = e;
      sum += e;
    }
    float inv = 1.0f / sum;
#pragma omp simd
    for (int i = 0; i < V; i++) p[i] *= inv;
    for (int i = V; i < Vp; i++) p[i] = 0.0f;
    losses[n] = logf(sum) - (lt - maxv);
  }
}

static void fast_crossentropy_backward(float *dlogits, const float *probs, const int *targets,
                                       float dloss, int N, int V, int Vp) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const float *p = probs + (size_t)n * Vp;
    float *d = dlogits + (size_t)n * Vp;
#pragma omp simd
    for (int i = 0; i < V; i++) d[i] = p[i] * dloss;
    d[targets[n]] -= dloss;
    for (int i = V; i < Vp; i++) d[i] = 0.0f;
  }
}

/* ---- optimizer and reductions --------------------------------------------- */

static void fast_adamw(float *p, const float *g, float *m, float *v, size_t n, float lr, float b1,
                       float b2, float eps, float wd, float bc1, float bc2) {
  float ib1 = 1.0f / bc1, ib2 = 1.0f / bc2;
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) {
    float gi = g[i];
    float mi = b1 * m[i] + (1.0f - b1) * gi;
    float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    float pi = p[i] - lr * wd * p[i];
    p[i] = pi - lr * (mi * ib1) / (sqrtf(vi * ib2) + eps);
  }
}

static double sumsq_chunk(const float *x, size_t n) {
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
  return s;
}

static double fast_sumsq(const float *x, size_t n) {
  size_t nchunks = (n + ZT_KERNELS_SUMSQ_CHUNK - 1) / ZT_KERNELS_SUMSQ_CHUNK;
  if (nchunks <= 1) return sumsq_chunk(x, n);
  double *part = zt_xmalloc(sizeof(double) * nchunks);
#pragma omp parallel for schedule(static)
  for (size_t c = 0; c < nchunks; c++) {
    size_t lo = c * ZT_KERNELS_SUMSQ_CHUNK;
    part[c] = sumsq_chunk(x + lo, ZT_MIN_SZ(ZT_KERNELS_SUMSQ_CHUNK, n - lo));
  }
  double total = 0.0;
  for (size_t c = 0; c < nchunks; c++) total += part[c];
  free(part);
  return total;
}

static void fast_scale(float *x, size_t n, float s) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) x[i] *= s;
}

static void fast_zero(float *x, size_t n) {
#pragma omp parallel
  {
    size_t lo, hi;
    zt_split(n, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
    if (hi > lo) memset(x + lo, 0, sizeof(float) * (hi - lo));
  }
}

/* Optimizer-state helpers: element-wise (any split gives the same result),
 * except sumsq_f64, which adds in element order like the reference. */
static void fast_acc_f64(double *acc, const float *x, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) acc[i] += x[i];
}

static void fast_add_f64(double *acc, const double *y, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) acc[i] += y[i];
}

static void fast_widen_f64(double *dst, const float *x, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) dst[i] = x[i];
}

static void fast_narrow_f64(float *dst, const double *x, size_t n, double s, float t) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) dst[i] = (float)(x[i] * s) * t;
}

/* ---- LoRA ------------------------------------------------------------------ */

/* w = base + s * b @ a, split by rows of w. */
static void fast_lora_merge(float *w, const float *base, const float *a, const float *b, int O,
                            int IN, int R, float s) {
#pragma omp parallel
  {
    size_t lo, hi;
    zt_split((size_t)O, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
    if (hi > lo) {
      if (w != base) memcpy(w + lo * IN, base + lo * IN, (hi - lo) * (size_t)IN * sizeof(float));
      zt_sgemm(0, 0, (int)(hi - lo), IN, R, s, b + lo * R, R, a, IN, 1.0f, w + lo * IN, IN);
    }
  }
}

/* da += s * b^T @ dw, split by columns of da; db += s * dw @ a^T, by its
 * rows. */
static void fast_lora_grad(float *da, float *db, const float *dw, const float *a, const float *b,
                           int O, int IN, int R, float s) {
#pragma omp parallel
  {
    int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    size_t lo, hi;
    zt_split_aligned((size_t)IN, 16, tid, nt, &lo, &hi);
    if (hi > lo) zt_sgemm(1, 0, R, (int)(hi - lo), O, s, b, R, dw + lo, IN, 1.0f, da + lo, IN);
    zt_split((size_t)O, tid, nt, &lo, &hi);
    if (hi > lo) zt_sgemm(0, 1, (int)(hi - lo), R, IN, s, dw + lo * IN, IN, a, IN, 1.0f, db + lo * R, R);
  }
}

static const zt_kernels_t zt_cpu_table = {
    .name = "cpu",
    ZT_KERNELS_ENTRIES(fast),
    .sumsq_f64 = zt_kernels_host_sumsq_f64, /* serial: element order */
    ZT_KERNELS_HOST_MEMORY,
    ZT_KERNELS_HOST_LLAMA,
    .attention_forward_gqa = fast_attention_forward_gqa,
    .attention_backward_gqa = fast_attention_backward_gqa,
    .lora_merge = fast_lora_merge,
    .lora_grad = fast_lora_grad,
};

const zt_kernels_t *zt_kernels_cpu(void) {
  zt_kernels_init();
  return &zt_cpu_table;
}

int zt_kernels_cpu_set_threads(int n) {
  zt_kernels_init();
  if (n > 0) omp_set_num_threads(n);
  return omp_get_max_threads();
}

const char *zt_kernels_cpu_sgemm(void) { return zt_sgemm_impl(); }
