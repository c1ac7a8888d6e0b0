/*
 * test_gpu_kernels.c: every CUDA kernel against the serial CPU reference.
 *
 * Each test draws random inputs on the host, runs the reference function of
 * zt_kernels_ref() on host copies and the function of zt_kernels_cuda() on
 * device copies, brings the device result back and compares element by
 * element with |gpu - ref| <= atol + rtol * |ref|.
 *
 * Tolerances (fp32 math, ZT_CUDA_MATH_FP32):
 *   - elementwise kernels (encoder, residual, scale, AdamW): 1e-6 relative;
 *     GELU and softmax/cross-entropy 2e-6 (CUDA's expf/tanhf are within
 *     2 ulp of glibc's);
 *   - reductions and products (LayerNorm, matmul, attention, column sums):
 *     1e-5 relative plus 1e-5 x (terms summed) absolute, as for the fast CPU
 *     kernels: they differ from the serial loops only in summation order;
 *   - the token-embedding gradient is summed in the reference's order and
 *     must match bit for bit; so must two runs of every backward kernel.
 * bf16 storage (zt_kernels_cuda_bf16): see the tests at the end.
 * bf16 products (ZT_CUDA_MATH_BF16): inputs rounded to 8 mantissa bits,
 * fp32 accumulation: |err| <= 8e-3 x sqrt(K) for inputs in [-1, 1] (the
 * expected error is about 1e-3 x sqrt(K)); TF32 (10 bits): 2e-3 x sqrt(K).
 *
 * Without a CUDA device the test prints why and exits 77, which ctest
 * reports as skipped.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "zt_common.h"
#include "zt_kernels.h"
#include "zt_kernels_cuda.h"
#include "zt_test.h"
#include "zt_testdata.h"

#define G zt_kernels_cuda()
#define R zt_kernels_ref()

/* Device memory through the table (zeroed); the test cannot go on without. */
static void *dalloc(size_t bytes) {
  void *d = G->alloc(bytes);
  if (!d) {
    fprintf(stderr, "out of device memory (%zu bytes)\n", bytes);
    exit(1);
  }
  return d;
}

/* Device copy of n host floats (or ints). */
static void *dev(const void *host, size_t bytes) {
  void *d = dalloc(bytes);
  G->upload(d, host, bytes);
  return d;
}
#define DEVF(p, n) ((float *)dev((p), (n) * sizeof(float)))

/* Host copy of n device floats. */
static float *back(const float *d, size_t n) {
  float *h = malloc(n * sizeof(float) + 1);
  G->download(h, d, n * sizeof(float));
  return h;
}

/* Compares a device buffer with a host reference, then frees the copy. */
static void close_dev(const char *what, const float *d, const float *ref, size_t n, float atol,
                      float rtol) {
  float *h = back(d, n);
  zt_close_all(what, h, ref, n, atol, rtol);
  free(h);
}

static int same_dev(const float *a, const float *b, size_t n) {
  float *x = back(a, n), *y = back(b, n);
  int same = memcmp(x, y, n * sizeof(float)) == 0;
  free(x), free(y);
  return same;
}

ZT_TEST(table) {
  ZT_CHECK_STR(G->name, "cuda");
  fprintf(stderr, "  device: %s, %.1f GiB\n", zt_cuda_device_name(),
          zt_cuda_device_memory() / 1073741824.0);
  char err[256];
  ZT_CHECK(zt_kernels_cuda_init(zt_cuda_device_count(), err, sizeof err) == -1);
  ZT_CHECK(strstr(err, "does not exist") != NULL || strstr(err, "already") != NULL);
}

/* The profile: table calls and the products inside them are counted and
 * timed while it is on, and only then. */
ZT_TEST(profile) {
  int N = 24, IC = 32, OC = 48;
  float *hx = zt_rnd((size_t)N * IC, 1), *hw = zt_rnd((size_t)OC * IC, 1);
  float *x = DEVF(hx, (size_t)N * IC), *w = DEVF(hw, (size_t)OC * IC);
  float *o = dalloc((size_t)N * OC * 4);
  G->matmul_forward(o, x, w, NULL, N, IC, OC); /* before: not counted */
  zt_kernels_cuda_profile(1);
  G->matmul_forward(o, x, w, NULL, N, IC, OC);
  G->matmul_forward(o, x, w, NULL, N, IC, OC);
  G->gelu_forward(o, o, (size_t)N * OC);
  zt_kernels_cuda_profile(0);
  G->gelu_forward(o, o, (size_t)N * OC); /* after: not counted */
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  zt_kernels_cuda_profile_report(f);
  fclose(f);
  fprintf(stderr, "%s", buf);
  ZT_CHECK(strstr(buf, "2 x  matmul_forward\n") != NULL);
  ZT_CHECK(strstr(buf, "1 x  gelu_forward\n") != NULL);
  ZT_CHECK(strstr(buf, "2 x  TN m 48 n 24 k 32 fp32->fp32\n") != NULL);
  free(buf), free(hx), free(hw);
  G->release(x), G->release(w), G->release(o);
}

static void check_encoder(int B, int T, int C, int V) {
  size_t n = (size_t)B * T * C;
  int *inp = malloc(sizeof(int) * B * T);
  /* Skewed ids, so that some tokens repeat many times. */
  for (int i = 0; i < B * T; i++) {
    float u = (zt_frand() + 1.0f) * 0.5f;
    inp[i] = (int)(u * u * V) % V;
  }
  float *wte = zt_rnd((size_t)V * C, 1), *wpe = zt_rnd((size_t)T * C, 1), *o = zt_rnd(n, 1);
  int *dinp = dev(inp, sizeof(int) * B * T);
  float *dwte_ = DEVF(wte, (size_t)V * C), *dwpe_ = DEVF(wpe, (size_t)T * C), *dout_ = DEVF(o, n);
  G->encoder_forward(dout_, dinp, dwte_, dwpe_, B, T, C);
  R->encoder_forward(o, inp, wte, wpe, B, T, C);
  close_dev("encoder_forward", dout_, o, n, 0, 0);
  float *dout = zt_rnd(n, 1), *gwte = zt_rnd((size_t)V * C, 1), *gwpe = zt_rnd((size_t)T * C, 1);
  float *d_dout = DEVF(dout, n), *d_gwte = DEVF(gwte, (size_t)V * C);
  float *d_gwpe = DEVF(gwpe, (size_t)T * C);
  float *d_gwte2 = DEVF(gwte, (size_t)V * C), *d_gwpe2 = DEVF(gwpe, (size_t)T * C);
  G->encoder_backward(d_gwte, d_gwpe, d_dout, dinp, B, T, C);
  G->encoder_backward(d_gwte2, d_gwpe2, d_dout, dinp, B, T, C);
  R->encoder_backward(gwte, gwpe, dout, inp, B, T, C);
  /* Same summation order as the reference: exact. */
  close_dev("encoder_backward dwte", d_gwte, gwte, (size_t)V * C, 0, 0);
  close_dev("encoder_backward dwpe", d_gwpe, gwpe, (size_t)T * C, 0, 0);
  ZT_CHECK(same_dev(d_gwte, d_gwte2, (size_t)V * C));
  G->release(dinp), G->release(dwte_), G->release(dwpe_), G->release(dout_);
  G->release(d_dout), G->release(d_gwte), G->release(d_gwpe);
  G->release(d_gwte2), G->release(d_gwpe2);
  free(inp), free(wte), free(wpe), free(o), free(dout), free(gwte), free(gwpe);
}

ZT_TEST(encoder) {
  check_encoder(3, 17, 40, 29);
  check_encoder(2, 9, 12, 7); /* rows of 12: one element at a time */
  check_encoder(4, 256, 96, 257);
}

static void check_layernorm(int N, int C) {
  size_t NC = (size_t)N * C;
  float *x = zt_rnd(NC, 2), *w = zt_rnd(C, 1), *b = zt_rnd(C, 1), *o = malloc(NC * 4);
  float *m = malloc(N * 4), *r = malloc(N * 4);
  float *dx = DEVF(x, NC), *dw = DEVF(w, C), *db = DEVF(b, C);
  float *dO = dalloc(NC * 4), *dm = dalloc(N * 4), *dr = dalloc(N * 4);
  G->layernorm_forward(dO, dm, dr, dx, dw, db, N, C);
  R->layernorm_forward(o, m, r, x, w, b, N, C);
  close_dev("layernorm_forward out", dO, o, NC, 1e-5f, 1e-5f);
  close_dev("layernorm_forward mean", dm, m, N, 1e-6f, 1e-5f);
  close_dev("layernorm_forward rstd", dr, r, N, 1e-6f, 1e-5f);
  /* Backward from the reference statistics. */
  G->upload(dm, m, N * 4), G->upload(dr, r, N * 4);
  float *dout = zt_rnd(NC, 1), *gx = zt_rnd(NC, 1), *gw = zt_rnd(C, 1), *gb = zt_rnd(C, 1);
  float *d_dout = DEVF(dout, NC), *d_gx = DEVF(gx, NC), *d_gw = DEVF(gw, C), *d_gb = DEVF(gb, C);
  float *d_gx2 = DEVF(gx, NC), *d_gw2 = DEVF(gw, C), *d_gb2 = DEVF(gb, C);
  G->layernorm_backward(d_gx, d_gw, d_gb, d_dout, dx, dw, dm, dr, N, C);
  G->layernorm_backward(d_gx2, d_gw2, d_gb2, d_dout, dx, dw, dm, dr, N, C);
  R->layernorm_backward(gx, gw, gb, dout, x, w, m, r, N, C);
  close_dev("layernorm_backward dinp", d_gx, gx, NC, 1e-5f, 1e-5f);
  close_dev("layernorm_backward dw", d_gw, gw, C, 1e-5f * N, 1e-5f);
  close_dev("layernorm_backward db", d_gb, gb, C, 1e-5f * N, 1e-5f);
  ZT_CHECK(same_dev(d_gx, d_gx2, NC) && same_dev(d_gw, d_gw2, C) && same_dev(d_gb, d_gb2, C));
  void *ptrs[] = {dx, dw, db, dO, dm, dr, d_dout, d_gx, d_gw, d_gb, d_gx2, d_gw2, d_gb2};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(x), free(w), free(b), free(o), free(m), free(r), free(dout), free(gx), free(gw), free(gb);
}

ZT_TEST(layernorm) {
  check_layernorm(77, 52);
  check_layernorm(1000, 768);
  check_layernorm(64, 264); /* vectors, a last group of 8 of 256 */
}


/* Checks the matmul pair; tol_k scales the absolute tolerance by sqrt(K)
 * for reduced-precision products (0: fp32 rule). with_bias 2: the bias
 * one element past an aligned address (as inside a parameter buffer). */
static void check_matmul(int N, int IC, int OC, int with_bias, float tol_k) {
  size_t nx = (size_t)N * IC, nw = (size_t)OC * IC, no = (size_t)N * OC;
  float *x = zt_rnd(nx, 1), *w = zt_rnd(nw, 1), *bias = zt_rnd(OC, 1), *o = malloc(no * 4);
  float *dx = DEVF(x, nx), *dw = DEVF(w, nw), *dbias0 = dalloc((OC + 1) * 4);
  float *dbias = dbias0 + (with_bias == 2);
  G->upload(dbias, bias, OC * 4);
  float *dO = dalloc(no * 4);
  G->matmul_forward(dO, dx, dw, with_bias ? dbias : NULL, N, IC, OC);
  R->matmul_forward(o, x, w, with_bias ? bias : NULL, N, IC, OC);
#define TOL(K) (tol_k > 0 ? tol_k * sqrtf((float)(K)) : 1e-5f * (K))
  close_dev("matmul_forward", dO, o, no, TOL(IC), 1e-5f);
  float *dout = zt_rnd(no, 1), *gx = zt_rnd(nx, 1), *gw = zt_rnd(nw, 1), *gb = zt_rnd(OC, 1);
  float *d_dout = DEVF(dout, no), *d_gx = DEVF(gx, nx), *d_gw = DEVF(gw, nw), *d_gb = DEVF(gb, OC);
  G->matmul_backward(d_gx, d_gw, with_bias ? d_gb : NULL, d_dout, dx, dw, N, IC, OC);
  R->matmul_backward(gx, gw, with_bias ? gb : NULL, dout, x, w, N, IC, OC);
  close_dev("matmul_backward dinp", d_gx, gx, nx, TOL(OC), 1e-5f);
  close_dev("matmul_backward dw", d_gw, gw, nw, TOL(N), 1e-5f);
  close_dev("matmul_backward dbias", d_gb, gb, OC, 1e-5f * N, 1e-5f);
#undef TOL
  /* dinp NULL is allowed and leaves everything else the same. */
  G->matmul_backward(NULL, d_gw, NULL, d_dout, dx, dw, N, IC, OC);
  void *ptrs[] = {dx, dw, dbias0, dO, d_dout, d_gx, d_gw, d_gb};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(x), free(w), free(bias), free(o), free(dout), free(gx), free(gw), free(gb);
}

ZT_TEST(matmul) {
  zt_kernels_cuda_set_math(ZT_CUDA_MATH_FP32);
  check_matmul(37, 24, 72, 1, 0);
  check_matmul(5, 64, 200, 0, 0);
  check_matmul(130, 96, 33, 1, 0);
  check_matmul(130, 96, 33, 2, 0);
  check_matmul(512, 768, 2304, 1, 0);
}

ZT_TEST(matmul_reduced_precision) {
  zt_kernels_cuda_set_math(ZT_CUDA_MATH_TF32);
  check_matmul(130, 96, 33, 1, 2e-3f);
  check_matmul(512, 768, 3072, 1, 2e-3f);
  zt_kernels_cuda_set_math(ZT_CUDA_MATH_BF16);
  check_matmul(130, 96, 33, 1, 8e-3f);
  check_matmul(512, 768, 3072, 1, 8e-3f);
  zt_kernels_cuda_set_math(ZT_CUDA_MATH_FP32);
}

/* Attention through table K on NH query heads sharing KV K/V heads of size
 * HD: the multi-head entry points where KV = NH, the grouped ones else. */
static void att_fwd(const zt_kernels_t *K, float *o, float *l, const float *qkv, int B, int T,
                    int NH, int KV, int HD) {
  if (KV == NH)
    K->attention_forward(o, l, qkv, B, T, NH * HD, NH);
  else
    K->attention_forward_gqa(o, l, qkv, B, T, NH, KV, HD);
}

static void att_bwd(const zt_kernels_t *K, float *g, const float *dout, const float *qkv,
                    const float *o, const float *l, int B, int T, int NH, int KV, int HD) {
  if (KV == NH)
    K->attention_backward(g, dout, qkv, o, l, B, T, NH * HD, NH);
  else
    K->attention_backward_gqa(g, dout, qkv, o, l, B, T, NH, KV, HD);
}

/* Both entry points of the table against the reference (fp32 storage:
 * the cuBLASLt path). */
static void check_attention(int B, int T, int NH, int KV, int HD) {
  size_t nq = (size_t)B * T * (NH + 2 * KV) * HD, no = (size_t)B * T * NH * HD;
  size_t nl = (size_t)B * NH * T;
  float *qkv = zt_rnd(nq, 2), *o = malloc(no * 4), *l = malloc(nl * 4);
  float *d_qkv = DEVF(qkv, nq), *dO = dalloc(no * 4), *dL = dalloc(nl * 4);
  att_fwd(G, dO, dL, d_qkv, B, T, NH, KV, HD);
  R->attention_forward_gqa(o, l, qkv, B, T, NH, KV, HD);
  close_dev("attention_forward out", dO, o, no, 1e-5f, 1e-4f);
  close_dev("attention_forward lse", dL, l, nl, 1e-5f, 1e-5f);
  G->upload(dO, o, no * 4);
  G->upload(dL, l, nl * 4);
  float *dout = zt_rnd(no, 1), *g = malloc(nq * 4);
  float *d_dout = DEVF(dout, no), *d_g = dalloc(nq * 4), *d_g2 = dalloc(nq * 4);
  att_bwd(G, d_g, d_dout, d_qkv, dO, dL, B, T, NH, KV, HD);
  G->attention_backward_gqa(d_g2, d_dout, d_qkv, dO, dL, B, T, NH, KV, HD);
  R->attention_backward_gqa(g, dout, qkv, o, l, B, T, NH, KV, HD);
  close_dev("attention_backward", d_g, g, nq, 1e-5f * T * (NH / KV), 1e-4f);
  ZT_CHECK(same_dev(d_g, d_g2, nq));
  void *ptrs[] = {d_qkv, dO, dL, d_dout, d_g, d_g2};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(qkv), free(o), free(l), free(dout), free(g);
}

ZT_TEST(attention) {
  check_attention(2, 13, 3, 3, 8);
  check_attention(1, 64, 4, 4, 16);
  check_attention(3, 7, 1, 1, 16);
  check_attention(2, 128, 6, 6, 32);
  check_attention(2, 100, 2, 2, 64);
  check_attention(1, 45, 2, 2, 128);
}

/* Grouped-query attention: K/V heads read in place by their query heads,
 * their gradients summed over them; one K/V head for all (multi-query). */
ZT_TEST(attention_gqa) {
  check_attention(2, 37, 8, 2, 16);
  check_attention(1, 70, 6, 1, 32);
  check_attention(2, 45, 4, 2, 64);
  check_attention(1, 33, 4, 2, 128);
}

ZT_TEST(gelu_residual_scale) {
  size_t n = 100001;
  float *x = zt_rnd(n, 6), *o = malloc(n * 4);
  x[0] = 0.0f, x[1] = 20.0f, x[2] = -20.0f, x[3] = 1e-4f;
  float *dx = DEVF(x, n), *dO = dalloc(n * 4);
  G->gelu_forward(dO, dx, n - 1); /* 8 at a time */
  R->gelu_forward(o, x, n - 1);
  close_dev("gelu_forward (vectors)", dO, o, n - 1, 2e-6f, 2e-6f);
  G->gelu_forward(dO, dx, n);
  R->gelu_forward(o, x, n);
  close_dev("gelu_forward", dO, o, n, 2e-6f, 2e-6f);
  float *d = zt_rnd(n, 1), *gd = malloc(n * 4), *dd = DEVF(d, n), *dg = dalloc(n * 4);
  G->gelu_backward(dg, dx, dd, n - 1);
  R->gelu_backward(gd, x, d, n - 1);
  close_dev("gelu_backward (vectors)", dg, gd, n - 1, 2e-6f, 1e-5f);
  G->gelu_backward(dg, dx, dd, n);
  R->gelu_backward(gd, x, d, n);
  close_dev("gelu_backward", dg, gd, n, 2e-6f, 1e-5f);
  G->gelu_backward(dd, dx, dd, n); /* in place */
  close_dev("gelu_backward in place", dd, gd, n, 2e-6f, 1e-5f);
  float *b = zt_rnd(n, 1), *db = DEVF(b, n);
  G->residual_forward(dO, dx, db, n - 1); /* 8 at a time */
  R->residual_forward(o, x, b, n - 1);
  close_dev("residual_forward (vectors)", dO, o, n - 1, 0, 0);
  G->residual_forward(dO, dx, db, n);
  R->residual_forward(o, x, b, n);
  close_dev("residual_forward", dO, o, n, 0, 0);
  G->scale(dO, n, 0.5f);
  R->scale(o, n, 0.5f);
  close_dev("scale", dO, o, n, 0, 0);
  G->zero(dO, n);
  float *z = back(dO, n);
  size_t nonzero = 0;
  for (size_t i = 0; i < n; i++) nonzero += z[i] != 0.0f;
  ZT_CHECK(nonzero == 0);
  void *ptrs[] = {dx, dO, dd, dg, db};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(x), free(o), free(d), free(gd), free(b), free(z);
}

static void check_crossentropy(int N, int V, int Vp) {
  size_t n = (size_t)N * Vp;
  float *logits = zt_rnd(n, 5), *p = malloc(n * 4), *l = malloc(N * 4);
  int *targets = malloc(N * sizeof(int));
  for (int i = 0; i < N; i++) targets[i] = (i * 7919) % V;
  /* A -inf logit (probability 0), the first a thread of row 1 reads. */
  if (targets[1] != 0) logits[Vp] = -INFINITY;
  int *dt = dev(targets, N * sizeof(int));
  float *dlog = DEVF(logits, n), *dp = dalloc(n * 4), *dl = dalloc(N * 4);
  G->crossentropy_forward(dl, dp, dlog, dt, N, V, Vp);
  R->crossentropy_forward(l, p, logits, targets, N, V, Vp);
  close_dev("crossentropy_forward probs", dp, p, n, 1e-7f, 2e-6f);
  /* The losses are checked against fp64 ones: at V = 50257 the reference's
   * serial fp32 sum of exponentials is itself about 5e-6 relative off. */
  for (int t = 0; t < N; t++) {
    const float *x = logits + (size_t)t * Vp;
    double mx = x[0], s = 0;
    for (int j = 1; j < V; j++) mx = x[j] > mx ? x[j] : mx;
    for (int j = 0; j < V; j++) s += exp((double)x[j] - mx);
    l[t] = (float)(log(s) - ((double)x[targets[t]] - mx));
  }
  close_dev("crossentropy_forward losses", dl, l, N, 2e-6f, 2e-6f);
  /* In place, as the model uses it. */
  G->crossentropy_forward(dl, dlog, dlog, dt, N, V, Vp);
  close_dev("crossentropy_forward in place", dlog, p, n, 1e-7f, 2e-6f);
  close_dev("crossentropy_forward in place losses", dl, l, N, 2e-6f, 2e-6f);
  float *d = malloc(n * 4), *dd = dalloc(n * 4);
  G->upload(dp, p, n * 4);
  G->crossentropy_backward(dd, dp, dt, 0.25f, N, V, Vp);
  R->crossentropy_backward(d, p, targets, 0.25f, N, V, Vp);
  close_dev("crossentropy_backward", dd, d, n, 0, 0);
  G->crossentropy_backward(dp, dp, dt, 0.25f, N, V, Vp); /* in place */
  close_dev("crossentropy_backward in place", dp, d, n, 0, 0);
  /* The classifier without probabilities: losses and lse (the logits
   * untouched), then dlogits from the logits and lse, also in place. */
  float *dz = dalloc(N * 4), *z = malloc(N * 4);
  G->upload(dlog, logits, n * 4);
  G->crossentropy_lse_forward(dl, dz, dlog, dt, N, V, Vp);
  close_dev("crossentropy_lse_forward losses", dl, l, N, 2e-6f, 2e-6f);
  float *kept = back(dlog, n);
  ZT_CHECK(memcmp(kept, logits, n * 4) == 0); /* the logits stay */
  free(kept);
  for (int t = 0; t < N; t++) z[t] = l[t] + logits[(size_t)t * Vp + targets[t]];
  close_dev("crossentropy_lse_forward lse", dz, z, N, 2e-6f, 2e-6f);
  G->crossentropy_lse_backward(dd, dlog, dz, dt, 0.25f, N, V, Vp);
  close_dev("crossentropy_lse_backward", dd, d, n, 1e-8f, 1e-5f);
  G->crossentropy_lse_backward(dlog, dlog, dz, dt, 0.25f, N, V, Vp);
  close_dev("crossentropy_lse_backward in place", dlog, d, n, 1e-8f, 1e-5f);
  G->release(dz), free(z);
  void *ptrs[] = {dt, dlog, dp, dl, dd};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(logits), free(p), free(l), free(targets), free(d);
}

ZT_TEST(crossentropy) {
  check_crossentropy(23, 50, 64);
  check_crossentropy(9, 45, 45); /* rows of 45: one element at a time */
  check_crossentropy(64, 50257, 50304);
}

static void check_adamw(size_t n) {
  float *p = zt_rnd(n, 1), *g = zt_rnd(n, 1), *m = zt_rnd(n, 0.1f), *v = zt_rnd(n, 0.1f);
  for (size_t i = 0; i < n; i++) v[i] = fabsf(v[i]);
  float *dp = DEVF(p, n), *dg = DEVF(g, n), *dm = DEVF(m, n), *dv = DEVF(v, n);
  G->adamw(dp, dg, dm, dv, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.19f, 0.0975f);
  R->adamw(p, g, m, v, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.19f, 0.0975f);
  close_dev("adamw p", dp, p, n, 1e-7f, 1e-6f);
  close_dev("adamw m", dm, m, n, 1e-7f, 1e-6f);
  close_dev("adamw v", dv, v, n, 1e-7f, 1e-6f);
  if (n % 4) { /* once */
    double s1 = G->sumsq(dg, n), s2 = R->sumsq(g, n), s3 = G->sumsq(dg, n);
    ZT_CHECK_NEAR(s1, s2, 1e-12 * s2);
    ZT_CHECK(s1 == s3);
    ZT_CHECK(G->sumsq(dg, 0) == 0.0);
  }
  G->release(dp), G->release(dg), G->release(dm), G->release(dv);
  free(p), free(g), free(m), free(v);
}

ZT_TEST(optimizer_and_reductions) {
  check_adamw(1000003); /* one element at a time */
  check_adamw(1000000); /* four */
}

/* adamw_fused against the calls it stands for (narrow_f64, adamw on each
 * segment, narrow_x), on table K: the same bits in p, m, v and the working
 * copy, from an fp64 gradient sum (g32 0) or an fp32 gradient (1), with
 * segments of different weight decay and a padding segment at the end
 * that stays as it was. */
static void check_adamw_fused(const zt_kernels_t *K, int g32, size_t n) {
  size_t xb = (size_t)K->xbytes;
  const size_t ends[5] = {777, 50000, 50001, 99000, n};
  static const float wd[5] = {0.1f, 0.0f, 0.1f, 0.05f, 0.0f};
  zt_adamw_args_t a;
  memset(&a, 0, sizeof a);
  a.n = 5, a.skip = 1u << 4;
  for (int i = 0; i < 5; i++) a.end[i] = ends[i], a.wd[i] = wd[i];
  a.lr = 1e-3f, a.b1 = 0.9f, a.b2 = 0.95f, a.eps = 1e-8f, a.bc1 = 0.19f, a.bc2 = 0.0975f;
  float *p = zt_rnd(n, 1), *g = zt_rnd(n, 1), *m = zt_rnd(n, 0.1f), *v = zt_rnd(n, 0.1f);
  double *g64 = malloc(n * 8);
  for (size_t i = 0; i < n; i++) v[i] = fabsf(v[i]), g64[i] = (double)g[i] * 3.0 + 1e-9 * i;
  float *p1 = DEVF(p, n), *m1 = DEVF(m, n), *v1 = DEVF(v, n), *w1 = dalloc(n * 4);
  float *p2 = DEVF(p, n), *m2 = DEVF(m, n), *v2 = DEVF(v, n), *w2 = dalloc(n * 4);
  float *dg = DEVF(g, n), *gt = dalloc(n * 4);
  double *dg64 = dev(g64, n * 8);
  K->adamw_fused(p1, g32 ? dg : NULL, g32 ? NULL : dg64, 0.25, 0.5f, m1, v1, w1, &a);
  if (!g32) K->narrow_f64(gt, dg64, n, 0.25, 0.5f);
  const float *gs = g32 ? dg : gt;
  for (int i = 0; i < 4; i++) { /* segment 4 is the padding */
    size_t a0 = i ? ends[i - 1] : 0;
    K->adamw(p2 + a0, gs + a0, m2 + a0, v2 + a0, ends[i] - a0, a.lr, a.b1, a.b2, a.eps, wd[i],
             a.bc1, a.bc2);
  }
  K->narrow_x(w2, p2, n);
  ZT_CHECK(same_dev(p1, p2, n));
  ZT_CHECK(same_dev(m1, m2, n));
  ZT_CHECK(same_dev(v1, v2, n));
  unsigned char *h1 = malloc(n * xb), *h2 = malloc(n * xb);
  K->download(h1, w1, n * xb);
  K->download(h2, w2, n * xb);
  ZT_CHECK(memcmp(h1, h2, n * xb) == 0);
  float *hp = back(p1, n);
  ZT_CHECK(memcmp(hp + 99000, p + 99000, (n - 99000) * 4) == 0); /* the padding */
  ZT_CHECK(memcmp(hp, p, 777 * 4) != 0);                           /* and the rest moved */
  void *ptrs[] = {p1, m1, v1, w1, p2, m2, v2, w2, dg, gt, dg64};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(p), free(g), free(m), free(v), free(g64), free(h1), free(h2), free(hp);
}

ZT_TEST(optimizer_fused) {
  for (int g32 = 0; g32 < 2; g32++) {
    /* 100000: four elements at a time (segment ends inside a vector);
     * 100003: one at a time. */
    for (size_t n = 100000; n <= 100003; n += 3) {
      check_adamw_fused(G, g32, n);
      check_adamw_fused(zt_kernels_cuda_bf16(), g32, n);
    }
  }
}

/* The fp64 optimizer-state helpers and the memory functions of the table. */
ZT_TEST(state_helpers) {
  size_t n = 300007;
  float *x = zt_rnd(n, 3);
  double *a = malloc(n * 8), *y = malloc(n * 8);
  for (size_t i = 0; i < n; i++) a[i] = zt_frand() * 1e3, y[i] = zt_frand() * 7.5;
  double *da = dev(a, n * 8), *dy = dev(y, n * 8);
  float *dx = DEVF(x, n), *df = dalloc(n * 4);
  G->acc_f64(da, dx, n);
  R->acc_f64(a, x, n);
  G->add_f64(da, dy, n);
  R->add_f64(a, y, n);
  double *ha = malloc(n * 8);
  G->download(ha, da, n * 8);
  ZT_CHECK(memcmp(ha, a, n * 8) == 0); /* element-wise: exact */
  G->widen_f64(da, dx, n);
  G->download(ha, da, n * 8);
  for (size_t i = 0; i < n; i += 997) ZT_CHECK(ha[i] == (double)x[i]);
  float *f = malloc(n * 4);
  G->narrow_f64(df, dy, n, 0.25, 0.5f);
  R->narrow_f64(f, y, n, 0.25, 0.5f);
  close_dev("narrow_f64", df, f, n, 0, 0);
  double s1 = G->sumsq_f64(dy, n, 0.25), s2 = R->sumsq_f64(y, n, 0.25);
  ZT_CHECK_NEAR(s1, s2, 1e-12 * s2);
  ZT_CHECK(G->sumsq_f64(dy, n, 0.25) == s1);
  G->copy(df, dx, n * 4);
  ZT_CHECK(same_dev(df, dx, n));
  G->memzero(df, n * 4);
  float *z = back(df, n);
  ZT_CHECK(z[0] == 0.0f && z[n - 1] == 0.0f);
  void *p = G->alloc(1000);
  float *hp = back(p, 250);
  ZT_CHECK(p != NULL && hp[249] == 0.0f);
  G->release(p);
  G->release(da), G->release(dy), G->release(dx), G->release(df);
  free(x), free(a), free(y), free(ha), free(f), free(z), free(hp);
}

/* ---------------------------------------------------------------------------
 * bf16 storage (zt_kernels_cuda_bf16): every kernel that takes X tensors,
 * on bf16 copies of inputs whose values are already bf16 (rounded on the
 * host), against the reference on the same values in fp32. A bf16 kernel
 * computes in fp32 and rounds its X outputs once, so an X output is within
 * the fp32 test's tolerance plus 2^-8 relative (half a bf16 ulp, 3.9e-3)
 * of the reference; fp32 outputs (parameter gradients, statistics,
 * losses) keep the fp32 tolerances, and sums formed in the reference's
 * order stay exact. */
#define XB zt_kernels_cuda_bf16()
#define BF_RTOL 4e-3f

/* The rounding a bf16 store does, in place on a host buffer (the
 * reference's inputs and expected values; common/util.c's conversions). */
static float *round_bf(float *p, size_t n) {
  for (size_t i = 0; i < n; i++) p[i] = zt_bf16_to_f32(zt_f32_to_bf16(p[i]));
  return p;
}

/* n random floats in [-scale, scale] with bf16 values. */
static float *rnd_bf(size_t n, float scale) { return round_bf(zt_rnd(n, scale), n); }

/* A bf16 device copy of n host floats (bf16-valued, so exact). */
static float *devx(const float *host, size_t n) {
  uint16_t *h = malloc(n * 2 + 2);
  for (size_t i = 0; i < n; i++) h[i] = zt_f32_to_bf16(host[i]);
  float *d = dev(h, n * 2);
  free(h);
  return d;
}

static void close_x(const char *what, const float *d, const float *ref, size_t n, float atol) {
  uint16_t *h = malloc(n * 2 + 2);
  float *w = malloc(n * 4 + 4);
  XB->download(h, d, n * 2);
  for (size_t i = 0; i < n; i++) w[i] = zt_bf16_to_f32(h[i]);
  zt_close_all(what, w, ref, n, atol, BF_RTOL);
  free(h), free(w);
}

/* Table K's copy of n host floats (bf16-valued where K stores bf16). */
static float *dev_k(const zt_kernels_t *K, const float *host, size_t n) {
  return K->xbytes == 2 ? devx(host, n) : DEVF(host, n);
}

static int same_bytes(const void *a, const void *b, size_t bytes) {
  unsigned char *x = malloc(bytes + 1), *y = malloc(bytes + 1);
  G->download(x, a, bytes), G->download(y, b, bytes);
  int same = memcmp(x, y, bytes) == 0;
  free(x), free(y);
  return same;
}

/* residual_layernorm_forward on table K against its two calls, the same
 * bits (res, out, mean, rstd), in place over a as the model's residual
 * stream is not (res separate) and is (res == a); width C, the inputs
 * `off` elements past an aligned address (the rows then take the
 * one-at-a-time loads, and the sums must not change with them). */
static void check_residual_layernorm(const zt_kernels_t *K, int N, int C, int off) {
  size_t NC = (size_t)N * C, xb = (size_t)K->xbytes, n = NC + (size_t)off;
  float *a = zt_rnd(n, 2), *b = zt_rnd(n, 2), *w = zt_rnd(C, 1), *bias = zt_rnd(C, 1);
  if (xb == 2) round_bf(a, n), round_bf(b, n), round_bf(w, C), round_bf(bias, C);
  float *da = dev_k(K, a, n), *db = dev_k(K, b, n), *dw = dev_k(K, w, C);
  float *dbias = dev_k(K, bias, C);
  float *a0 = (float *)((char *)da + off * xb), *b0 = (float *)((char *)db + off * xb);
  float *r1 = dalloc(NC * xb), *o1 = dalloc(NC * xb), *m1 = dalloc(N * 4), *s1 = dalloc(N * 4);
  float *r2 = dalloc(NC * xb), *o2 = dalloc(NC * xb), *m2 = dalloc(N * 4), *s2 = dalloc(N * 4);
  K->residual_layernorm_forward(r1, o1, m1, s1, a0, b0, dw, dbias, N, C);
  K->residual_forward(r2, a0, b0, NC);
  K->layernorm_forward(o2, m2, s2, r2, dw, dbias, N, C);
  ZT_CHECK(same_bytes(r1, r2, NC * xb) && same_bytes(o1, o2, NC * xb));
  ZT_CHECK(same_dev(m1, m2, N) && same_dev(s1, s2, N));
  /* The aligned copy of the same rows gives the same bits. */
  float *ua = dalloc(NC * xb), *ub = dalloc(NC * xb);
  K->copy(ua, a0, NC * xb), K->copy(ub, b0, NC * xb);
  K->residual_layernorm_forward(ua, o1, m1, s1, ua, ub, dw, dbias, N, C); /* res == a */
  ZT_CHECK(same_bytes(ua, r2, NC * xb) && same_bytes(o1, o2, NC * xb));
  ZT_CHECK(same_dev(m1, m2, N) && same_dev(s1, s2, N));
  /* And the LayerNorm is the reference's (fp32: its bounds). */
  if (xb == 4) {
    float *res = malloc(NC * 4), *o = malloc(NC * 4), *m = malloc(N * 4), *r = malloc(N * 4);
    R->residual_forward(res, a + off, b + off, NC);
    R->layernorm_forward(o, m, r, res, w, bias, N, C);
    close_dev("residual_layernorm_forward out", o1, o, NC, 1e-5f, 1e-5f);
    close_dev("residual_layernorm_forward rstd", s1, r, N, 1e-6f, 1e-5f);
    free(res), free(o), free(m), free(r);
  }
  void *ptrs[] = {da, db, dw, dbias, r1, o1, m1, s1, r2, o2, m2, s2, ua, ub};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(a), free(b), free(w), free(bias);
}

ZT_TEST(residual_layernorm) {
  const zt_kernels_t *tables[2] = {G, zt_kernels_cuda_bf16()};
  for (int t = 0; t < 2; t++) {
    ZT_REQUIRE(tables[t]->residual_layernorm_forward != NULL);
    check_residual_layernorm(tables[t], 70, 52, 0);
    check_residual_layernorm(tables[t], 70, 768, 0);
    check_residual_layernorm(tables[t], 70, 768, 1);
    check_residual_layernorm(tables[t], 9, 1000, 3);
  }
}

/* narrow_x and widen_x over n elements (8 at a time where n allows). */
static void check_convert(size_t n) {
  float *x = zt_rnd(n, 100);
  x[0] = 1.0f + 1.0f / 256, x[1] = 1.0f + 3.0f / 256, x[2] = -0.0f, x[3] = 3.0e38f; /* ties; max */
  float *dx = DEVF(x, n), *db = dalloc(n * 2), *dw = dalloc(n * 4);
  XB->narrow_x(db, dx, n);
  uint16_t *h = malloc(n * 2);
  XB->download(h, db, n * 2);
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += h[i] != zt_f32_to_bf16(x[i]);
  ZT_CHECK(bad == 0);
  ZT_CHECK(h[0] == 0x3f80 && h[1] == 0x3f82); /* to nearest even */
  XB->widen_x(dw, db, n);
  float *w = back(dw, n);
  bad = 0;
  for (size_t i = 0; i < n; i++) bad += w[i] != zt_bf16_to_f32(h[i]);
  ZT_CHECK(bad == 0);
  G->narrow_x(dw, dx, n); /* fp32 storage: a copy */
  ZT_CHECK(same_dev(dw, dx, n));
  G->release(dx), G->release(db), G->release(dw);
  free(x), free(h), free(w);
}

ZT_TEST(bf16_convert) {
  ZT_CHECK_STR(XB->name, "cuda-bf16");
  ZT_CHECK(XB->xbytes == 2 && G->xbytes == 4 && R->xbytes == 4);
  check_convert(100003);
  check_convert(100000);
}

ZT_TEST(bf16_elementwise) {
  /* Encoder. */
  int B = 4, T = 64, C = 96, V = 257;
  size_t n = (size_t)B * T * C;
  int *inp = malloc(sizeof(int) * B * T);
  for (int i = 0; i < B * T; i++) inp[i] = (i * 7 + i / 5) % V;
  float *wte = rnd_bf((size_t)V * C, 1), *wpe = rnd_bf((size_t)T * C, 1), *o = malloc(n * 4);
  int *dinp = dev(inp, sizeof(int) * B * T);
  float *d_wte = devx(wte, (size_t)V * C), *d_wpe = devx(wpe, (size_t)T * C), *d_o = dalloc(n * 2);
  XB->encoder_forward(d_o, dinp, d_wte, d_wpe, B, T, C);
  R->encoder_forward(o, inp, wte, wpe, B, T, C);
  close_x("bf16 encoder_forward", d_o, o, n, 0);
  float *dout = rnd_bf(n, 1), *gwte = zt_rnd((size_t)V * C, 1), *gwpe = zt_rnd((size_t)T * C, 1);
  float *d_dout = devx(dout, n), *d_gwte = DEVF(gwte, (size_t)V * C);
  float *d_gwpe = DEVF(gwpe, (size_t)T * C);
  XB->encoder_backward(d_gwte, d_gwpe, d_dout, dinp, B, T, C);
  R->encoder_backward(gwte, gwpe, dout, inp, B, T, C);
  close_dev("bf16 encoder_backward dwte", d_gwte, gwte, (size_t)V * C, 0, 0); /* same order */
  close_dev("bf16 encoder_backward dwpe", d_gwpe, gwpe, (size_t)T * C, 0, 0);
  /* GELU and the residual. */
  float *x = rnd_bf(n, 6), *d_x = devx(x, n), *y = malloc(n * 4);
  XB->gelu_forward(d_o, d_x, n);
  R->gelu_forward(y, x, n);
  close_x("bf16 gelu_forward", d_o, y, n, 2e-6f);
  XB->gelu_backward(d_o, d_x, d_dout, n);
  R->gelu_backward(y, x, dout, n);
  close_x("bf16 gelu_backward", d_o, y, n, 2e-6f);
  XB->residual_forward(d_o, d_x, d_dout, n);
  R->residual_forward(y, x, dout, n);
  close_x("bf16 residual_forward", d_o, y, n, 0);
  void *ptrs[] = {dinp, d_wte, d_wpe, d_o, d_dout, d_gwte, d_gwpe, d_x};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(inp), free(wte), free(wpe), free(o), free(dout), free(gwte), free(gwpe), free(x), free(y);
}

ZT_TEST(bf16_norm_linear) {
  int N = 300, C = 96, OC = 200;
  size_t NC = (size_t)N * C, NO = (size_t)N * OC, W = (size_t)OC * C;
  float *x = rnd_bf(NC, 2), *w = rnd_bf(C, 1), *b = rnd_bf(C, 1), *o = malloc(NC * 4);
  float *m = malloc(N * 4), *r = malloc(N * 4);
  float *d_x = devx(x, NC), *d_w = devx(w, C), *d_b = devx(b, C), *d_o = dalloc(NC * 2);
  float *d_m = dalloc(N * 4), *d_r = dalloc(N * 4);
  XB->layernorm_forward(d_o, d_m, d_r, d_x, d_w, d_b, N, C);
  R->layernorm_forward(o, m, r, x, w, b, N, C);
  close_x("bf16 layernorm_forward out", d_o, o, NC, 1e-5f);
  close_dev("bf16 layernorm_forward mean", d_m, m, N, 1e-6f, 1e-5f);
  close_dev("bf16 layernorm_forward rstd", d_r, r, N, 1e-6f, 1e-5f);
  G->upload(d_m, m, N * 4), G->upload(d_r, r, N * 4);
  float *dout = rnd_bf(NC, 1), *gx = rnd_bf(NC, 1), *gw = zt_rnd(C, 1), *gb = zt_rnd(C, 1);
  float *d_dout = devx(dout, NC), *d_gx = devx(gx, NC), *d_gw = DEVF(gw, C), *d_gb = DEVF(gb, C);
  XB->layernorm_backward(d_gx, d_gw, d_gb, d_dout, d_x, d_w, d_m, d_r, N, C);
  R->layernorm_backward(gx, gw, gb, dout, x, w, m, r, N, C);
  close_x("bf16 layernorm_backward dinp", d_gx, gx, NC, 1e-5f);
  close_dev("bf16 layernorm_backward dw", d_gw, gw, C, 1e-5f * N, 1e-5f);
  close_dev("bf16 layernorm_backward db", d_gb, gb, C, 1e-5f * N, 1e-5f);
  /* A linear layer C -> OC on the LayerNorm's (rounded) output. */
  round_bf(o, NC);
  float *wm = rnd_bf(W, 1), *bias = rnd_bf(OC, 1), *y = malloc(NO * 4);
  float *d_wm = devx(wm, W), *d_y = dalloc(NO * 2);
  /* The bias at an aligned address, and one element past one (the epilogue
   * then takes it from aligned scratch: still one rounding). */
  float *bias1 = malloc((OC + 1) * 4);
  bias1[0] = 0.0f;
  memcpy(bias1 + 1, bias, OC * 4);
  float *d_bias = devx(bias, OC), *d_bias1 = devx(bias1, OC + 1);
  const float *d_bias_u = (const float *)((const uint16_t *)d_bias1 + 1);
  for (int with_bias = 0; with_bias < 3; with_bias++) {
    const float *db_ = with_bias == 0 ? NULL : with_bias == 1 ? d_bias : d_bias_u;
    XB->matmul_forward(d_y, d_o, d_wm, db_, N, C, OC);
    R->matmul_forward(y, o, wm, with_bias ? bias : NULL, N, C, OC);
    close_x(with_bias == 2 ? "bf16 matmul_forward (unaligned bias)" : "bf16 matmul_forward", d_y,
            y, NO, 1e-5f * C);
  }
  G->release(d_bias1);
  free(bias1);
  float *dy = rnd_bf(NO, 1), *gi = malloc(NC * 4), *gwm = zt_rnd(W, 1), *gbias = zt_rnd(OC, 1);
  float *d_dy = devx(dy, NO), *d_gi = dalloc(NC * 2), *d_gwm = DEVF(gwm, W);
  float *d_gbias = DEVF(gbias, OC);
  XB->matmul_backward(d_gi, d_gwm, d_gbias, d_dy, d_o, d_wm, N, C, OC);
  R->matmul_backward(gi, gwm, gbias, dy, o, wm, N, C, OC);
  close_x("bf16 matmul_backward dinp", d_gi, gi, NC, 1e-5f * OC);
  close_dev("bf16 matmul_backward dw", d_gwm, gwm, W, 1e-5f * N, 1e-5f);
  close_dev("bf16 matmul_backward dbias", d_gbias, gbias, OC, 1e-5f * N, 1e-5f);
  void *ptrs[] = {d_x, d_w, d_b, d_o, d_m, d_r, d_dout, d_gx, d_gw, d_gb,
                  d_wm, d_bias, d_y, d_dy, d_gi, d_gwm, d_gbias};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(x), free(w), free(b), free(o), free(m), free(r), free(dout), free(gx), free(gw), free(gb);
  free(wm), free(bias), free(y), free(dy), free(gi), free(gwm), free(gbias);
}

/* The MLP's products with GELU in cuBLASLt's epilogue (bf16 storage):
 * matmul_gelu_forward against the reference's product and GELU (pre within
 * the product's tolerance, out too: its GELU is of the unrounded sum), and
 * matmul_backward_dgelu against the reference's backward and GELU backward
 * at the stored (bf16) pre; the profile shows the epilogues ran. The two
 * calls they replace (gelu_epilogue 0) meet the same bounds against a
 * reference that rounds where they do (GELU of the rounded pre, GELU's
 * backward of the rounded product): one rounding more. */
ZT_TEST(bf16_matmul_gelu) {
  int N = 100, C = 64, F = 128, OC = 48;
  size_t NC = (size_t)N * C, NF = (size_t)N * F, NO = (size_t)N * OC;
  float *x = rnd_bf(NC, 1), *w1 = rnd_bf((size_t)F * C, 0.3f), *b1 = rnd_bf(F, 0.5f);
  float *w2 = rnd_bf((size_t)OC * F, 0.3f), *dy = rnd_bf(NO, 1);
  float *pre = malloc(NF * 4), *act = malloc(NF * 4), *gi = malloc(NF * 4);
  float *gw = zt_rnd((size_t)OC * F, 1), *gb = zt_rnd(OC, 1);
  R->matmul_forward(pre, x, w1, b1, N, C, F);
  R->gelu_forward(act, pre, NF);
  float *d_x = devx(x, NC), *d_w1 = devx(w1, (size_t)F * C), *d_b1 = devx(b1, F);
  float *d_w2 = devx(w2, (size_t)OC * F), *d_dy = devx(dy, NO);
  float *d_pre = dalloc(NF * 2), *d_act = dalloc(NF * 2), *d_gi = dalloc(NF * 2);
  for (int fused = 1; fused >= 0; fused--) {
    zt_kernels_cuda_set_gelu_epilogue(fused);
    const char *lt = getenv("ZT_SIM_LT_GELU");
    if (lt && !strcmp(lt, "0") && fused) { /* the two calls: compare as such */
      memcpy(act, pre, NF * 4);
      R->gelu_forward(act, round_bf(act, NF), NF);
    }
    zt_kernels_cuda_profile(1);
    XB->matmul_gelu_forward(d_act, d_pre, d_x, d_w1, d_b1, N, C, F);
    close_x("matmul_gelu_forward pre", d_pre, pre, NF, 1e-5f * C);
    if (!fused) {
      memcpy(act, pre, NF * 4);
      R->gelu_forward(act, round_bf(act, NF), NF);
    }
    close_x("matmul_gelu_forward out", d_act, act, NF, 1e-5f * C);
    /* The backward from the device's (bf16) pre and activations. */
    uint16_t *h = malloc(NF * 2);
    float *pre_b = malloc(NF * 4), *act_b = malloc(NF * 4);
    XB->download(h, d_pre, NF * 2);
    for (size_t i = 0; i < NF; i++) pre_b[i] = zt_bf16_to_f32(h[i]);
    XB->download(h, d_act, NF * 2);
    for (size_t i = 0; i < NF; i++) act_b[i] = zt_bf16_to_f32(h[i]);
    float *gw_r = malloc((size_t)OC * F * 4), *gb_r = malloc(OC * 4);
    memcpy(gw_r, gw, (size_t)OC * F * 4), memcpy(gb_r, gb, OC * 4);
    float *d_gw = DEVF(gw, (size_t)OC * F), *d_gb = DEVF(gb, OC);
    XB->matmul_backward_dgelu(d_gi, d_gw, d_gb, d_dy, d_act, d_w2, d_pre, N, F, OC);
    R->matmul_backward(gi, gw_r, gb_r, dy, act_b, w2, N, F, OC);
    if (!fused || (lt && !strcmp(lt, "0"))) round_bf(gi, NF);
    R->gelu_backward(gi, pre_b, gi, NF);
    close_x("matmul_backward_dgelu dinp", d_gi, gi, NF, 1e-5f * OC);
    close_dev("matmul_backward_dgelu dw", d_gw, gw_r, (size_t)OC * F, 1e-5f * N, 1e-5f);
    close_dev("matmul_backward_dgelu dbias", d_gb, gb_r, OC, 1e-5f * N, 1e-5f);
    zt_kernels_cuda_profile(0);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    zt_kernels_cuda_profile_report(f);
    fclose(f);
    /* ZT_SIM_LT_GELU=0: the stand-in's cuBLASLt has no GELU epilogues, and
     * the two calls must run in their place. */
    int epi = fused && !(lt && !strcmp(lt, "0"));
    ZT_CHECK((strstr(buf, "+bias gelu\n") != NULL) == epi);
    ZT_CHECK((strstr(buf, " dgelu\n") != NULL) == epi);
    ZT_CHECK((strstr(buf, "+bias\n") != NULL) == !epi); /* the product of the two calls */
    free(buf), free(h), free(pre_b), free(act_b), free(gw_r), free(gb_r);
    G->release(d_gw), G->release(d_gb);
  }
  zt_kernels_cuda_set_gelu_epilogue(1);
  void *ptrs[] = {d_x, d_w1, d_b1, d_w2, d_dy, d_pre, d_act, d_gi};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(x), free(w1), free(b1), free(w2), free(dy), free(pre), free(act), free(gi), free(gw), free(gb);
}

/* The largest |x| of n host floats. */
static float max_abs(const float *x, size_t n) {
  float m = 0;
  for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
  return m;
}

/* Flash attention 2 (bf16 storage, zt_kernels_cuda_set_attention_fa2) on
 * check_attention_bf16's inputs (bf16 qkv, dout and out on the device;
 * o32 and l the fp32 reference's out and lse) against the reference
 * (forward) and g, the fp32 table's backward on the same inputs.
 * Its second products take the probabilities (out, dv) and ds (dk, dq)
 * rounded to bf16, a relative error of at most u = 2^-8 each. out is a
 * sum of v rows with non-negative weights that add up to 1, so
 * |error| <= u max |v|, plus the bf16 rounding of the result (BF_RTOL).
 * The gradients are held to 2^-6 of the largest element of each of dq, dk
 * and dv: the roundings of p and ds and of the result, with room for the
 * cancellations in dp - D (the stand-in measured at most 0.5%). lse comes
 * from fp32 scores and keeps the fp32 tolerance; two runs of the backward
 * are bit-identical. o_lt and o_def are the forward's out on the cuBLASLt
 * path and under the default settings: flash attention 2 rounds the
 * probabilities, so its bits differ from the first (it ran), and it is
 * bf16's default path, so they are the second. */
static void check_attention_fa2(int B, int T, int NH, int KV, int HD, const float *qkv,
                                const float *o32, const float *l, const float *g, float *d_qkv,
                                float *d_dout, float *d_or, float *d_o, float *d_l,
                                const uint16_t *o_lt, const uint16_t *o_def) {
  int W = (NH + 2 * KV) * HD;
  size_t nq = (size_t)B * T * W, no = (size_t)B * T * NH * HD, nl = (size_t)B * NH * T;
  float *d_g = dalloc(nq * 2), *d_g2 = dalloc(nq * 2);
  fprintf(stderr, "  flash attention 2, B %d T %d NH %d KV %d HD %d\n", B, T, NH, KV, HD);
  zt_kernels_cuda_set_attention_fa2(1);
  att_fwd(XB, d_o, d_l, d_qkv, B, T, NH, KV, HD);
  close_x("fa2 attention_forward", d_o, o32, no, max_abs(qkv, nq) / 256 + 1e-5f);
  uint16_t *o1 = malloc(no * 2);
  XB->download(o1, d_o, no * 2);
  ZT_CHECK(memcmp(o1, o_lt, no * 2) != 0);
  ZT_CHECK(memcmp(o1, o_def, no * 2) == 0);
  free(o1);
  close_dev("fa2 attention_forward lse", d_l, l, nl, 1e-5f, 1e-5f);
  G->upload(d_l, l, nl * 4);
  att_bwd(XB, d_g, d_dout, d_qkv, d_or, d_l, B, T, NH, KV, HD);
  att_bwd(XB, d_g2, d_dout, d_qkv, d_or, d_l, B, T, NH, KV, HD);
  uint16_t *h = malloc(nq * 2), *h2 = malloc(nq * 2);
  float *w = malloc(nq * 4);
  XB->download(h, d_g, nq * 2);
  XB->download(h2, d_g2, nq * 2);
  ZT_CHECK(memcmp(h, h2, nq * 2) == 0);
  for (size_t i = 0; i < nq; i++) w[i] = zt_bf16_to_f32(h[i]);
  /* dq, dk, dv of each row lie side by side: compare each part on its own. */
  for (int part = 0, off = 0; part < 3; part++) {
    int C = (part ? KV : NH) * HD;
    size_t np = (size_t)B * T * C;
    float *gp = malloc(np * 4), *wp = malloc(np * 4);
    for (size_t r = 0; r < (size_t)B * T; r++) {
      memcpy(gp + r * C, g + r * W + off, (size_t)C * 4);
      memcpy(wp + r * C, w + r * W + off, (size_t)C * 4);
    }
    off += C;
    static const char *names[] = {"fa2 attention_backward dq", "fa2 attention_backward dk",
                                  "fa2 attention_backward dv"};
    float worst = 0, big = max_abs(gp, np);
    for (size_t i = 0; i < np; i++) worst = fmaxf(worst, fabsf(gp[i] - wp[i]));
    fprintf(stderr, "  %s: worst |error| %.3g of largest %.3g (%.2g)\n", names[part], worst, big,
            worst / big);
    zt_close_all(names[part], wp, gp, np, big / 64, BF_RTOL);
    free(gp), free(wp);
  }
  G->release(d_g), G->release(d_g2);
  free(h), free(h2), free(w);
}

/* bf16 attention on the cuBLASLt path, then (fa2) flash attention 2 on the
 * same inputs. The cuBLASLt backward is compared with the fp32 table's on
 * the same inputs rather than with the reference, as flash attention 2's
 * is: the backward forms D = rowsum(dout * out) from the stored out (as
 * flash attention does), so with out stored in bf16 its gradients move by
 * up to a few 1e-3 where dp - D cancels, which the reference (it
 * recomputes out) does not see. The fp32 kernels are held to the
 * reference by the fp32 tests above. */
static void check_attention_bf16(int B, int T, int NH, int KV, int HD, int fa2) {
  size_t nq = (size_t)B * T * (NH + 2 * KV) * HD, no = (size_t)B * T * NH * HD;
  size_t nl = (size_t)B * NH * T;
  float *qkv = rnd_bf(nq, 2), *o = malloc(no * 4), *l = malloc(nl * 4), *o32 = malloc(no * 4);
  float *dout = rnd_bf(no, 1);
  R->attention_forward_gqa(o, l, qkv, B, T, NH, KV, HD);
  memcpy(o32, o, no * 4);
  round_bf(o, no); /* backward's input, as the bf16 forward stores it */
  float *d_qkv = devx(qkv, nq), *d_o = dalloc(no * 2), *d_l = dalloc(nl * 4);
  float *d_dout = devx(dout, no), *d_g = dalloc(nq * 2), *d_or = devx(o, no);
  float *f_qkv = DEVF(qkv, nq), *f_dout = DEVF(dout, no), *f_o = DEVF(o, no);
  float *f_l = DEVF(l, nl), *f_g = dalloc(nq * 4);
  uint16_t *o_def = malloc(no * 2), *o_lt = malloc(no * 2);
  att_fwd(XB, d_o, d_l, d_qkv, B, T, NH, KV, HD); /* the default path */
  XB->download(o_def, d_o, no * 2);
  zt_kernels_cuda_set_attention_fa2(0);
  att_fwd(XB, d_o, d_l, d_qkv, B, T, NH, KV, HD);
  close_x("bf16 attention_forward", d_o, o32, no, 1e-5f);
  XB->download(o_lt, d_o, no * 2);
  close_dev("bf16 attention_forward lse", d_l, l, nl, 1e-5f, 1e-5f);
  G->upload(d_l, l, nl * 4);
  att_bwd(XB, d_g, d_dout, d_qkv, d_or, d_l, B, T, NH, KV, HD);
  att_bwd(G, f_g, f_dout, f_qkv, f_o, f_l, B, T, NH, KV, HD);
  float *g = back(f_g, nq);
  close_x("bf16 attention_backward", d_g, g, nq, 1e-5f * T * (NH / KV));
  if (fa2)
    check_attention_fa2(B, T, NH, KV, HD, qkv, o32, l, g, d_qkv, d_dout, d_or, d_o, d_l, o_lt,
                        o_def);
  zt_kernels_cuda_set_attention_fa2(1); /* the default */
  free(g);
  void *ptrs[] = {d_qkv, d_o, d_l, d_dout, d_g, d_or, f_qkv, f_dout, f_o, f_l, f_g};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(qkv), free(o), free(l), free(dout), free(o32), free(o_def), free(o_lt);
}

/* The cuBLASLt path again, then flash attention 2 on the same inputs, at
 * every head size it takes. */
ZT_TEST(bf16_attn_fa2) {
  check_attention_bf16(2, 100, 2, 2, 64, 1); /* head size 64 */
  check_attention_bf16(1, 70, 3, 3, 32, 1);  /* 32 */
  check_attention_bf16(2, 45, 1, 1, 48, 1);  /* 48, one block */
  check_attention_bf16(1, 130, 4, 4, 16, 1); /* 16 */
  check_attention_bf16(2, 75, 8, 2, 32, 1);  /* grouped: 4 query heads per K/V head */
  check_attention_bf16(1, 40, 3, 1, 64, 1);  /* one K/V head for all */
  check_attention_bf16(1, 70, 4, 2, 128, 1); /* 128, Llama's: dk and dv in two launches */
}

ZT_TEST(bf16_attn_xent) {
  check_attention_bf16(2, 13, 3, 3, 8, 0);
  check_attention_bf16(2, 100, 2, 2, 64, 0);
  int N = 37, V = 500, Vp = 512;
  size_t n = (size_t)N * Vp;
  float *logits = rnd_bf(n, 5), *p = malloc(n * 4), *l = malloc(N * 4), *d = malloc(n * 4);
  int *targets = malloc(N * sizeof(int));
  for (int i = 0; i < N; i++) targets[i] = (i * 7919) % V;
  int *dt = dev(targets, N * sizeof(int));
  float *d_log = devx(logits, n), *d_l = dalloc(N * 4), *d_d = dalloc(n * 2);
  R->crossentropy_forward(l, p, logits, targets, N, V, Vp);
  XB->crossentropy_forward(d_l, d_log, d_log, dt, N, V, Vp); /* in place, as the model does */
  close_x("bf16 crossentropy_forward probs", d_log, p, n, 1e-7f);
  close_dev("bf16 crossentropy_forward losses", d_l, l, N, 2e-6f, 2e-6f);
  round_bf(p, n); /* backward from the reference's probabilities */
  float *d_p = devx(p, n);
  R->crossentropy_backward(d, p, targets, 0.25f, N, V, Vp);
  XB->crossentropy_backward(d_d, d_p, dt, 0.25f, N, V, Vp);
  G->release(d_p);
  close_x("bf16 crossentropy_backward", d_d, d, n, 0);
  /* Without probabilities: dlogits from the bf16 logits and the lse,
   * rounded once (against the reference from unrounded probabilities). */
  float *d_z = dalloc(N * 4);
  float *d_log2 = devx(logits, n);
  XB->crossentropy_lse_forward(d_l, d_z, d_log2, dt, N, V, Vp);
  close_dev("bf16 crossentropy_lse_forward losses", d_l, l, N, 2e-6f, 2e-6f);
  R->crossentropy_forward(l, p, logits, targets, N, V, Vp);
  R->crossentropy_backward(d, p, targets, 0.25f, N, V, Vp);
  XB->crossentropy_lse_backward(d_log2, d_log2, d_z, dt, 0.25f, N, V, Vp);
  close_x("bf16 crossentropy_lse_backward", d_log2, d, n, 1e-8f);
  G->release(d_z), G->release(d_log2);
  G->release(dt), G->release(d_log), G->release(d_l), G->release(d_d);
  free(logits), free(p), free(l), free(d), free(targets);
}

int run_all(int argc, char **argv);

int main(int argc, char **argv) {
  char err[256];
  zt_test_seed(0x9e3779b97f4a7c15ull);
  int n = zt_cuda_device_count();
  if (n == 0 || zt_kernels_cuda_init(0, err, sizeof err) != 0) {
    printf("test_gpu_kernels: skipped: %s\n", n == 0 ? "no CUDA device" : err);
    return 77;
  }
  return run_all(argc, argv);
}

/* The Llama operations (kernels/cpu/llama.c is the reference): RMSNorm both
 * ways, the rotation at an offset and back on grouped heads (8 query heads
 * on 2), SwiGLU both ways. Grouped-query attention: ZT_TEST(attention_gqa). */
static void check_rmsnorm(int N, int C) {
  float *x = zt_rnd((size_t)N * C, 1), *w = zt_rnd(C, 1), *o = malloc((size_t)N * C * 4);
  float *rs = malloc((size_t)N * 4);
  float *dx = DEVF(x, (size_t)N * C), *dw = DEVF(w, C), *dO = dalloc((size_t)N * C * 4);
  float *drs = dalloc((size_t)N * 4);
  G->rmsnorm_forward(dO, drs, dx, dw, N, C, 1e-5f);
  R->rmsnorm_forward(o, rs, x, w, N, C, 1e-5f);
  close_dev("rmsnorm_forward", dO, o, (size_t)N * C, 1e-5f, 1e-5f);
  close_dev("rmsnorm rstd", drs, rs, N, 1e-5f, 1e-5f);
  float *dout = zt_rnd((size_t)N * C, 1), *gx = zt_rnd((size_t)N * C, 1), *gw = zt_rnd(C, 1);
  float *d_dout = DEVF(dout, (size_t)N * C), *d_gx = DEVF(gx, (size_t)N * C), *d_gw = DEVF(gw, C);
  G->rmsnorm_backward(d_gx, d_gw, d_dout, dx, dw, drs, N, C);
  R->rmsnorm_backward(gx, gw, dout, x, w, rs, N, C);
  close_dev("rmsnorm_backward dinp", d_gx, gx, (size_t)N * C, 1e-5f, 1e-5f);
  close_dev("rmsnorm_backward dw", d_gw, gw, C, 1e-4f, 1e-5f);
  G->rmsnorm_backward(d_gx, NULL, d_dout, dx, dw, drs, N, C); /* a frozen weight */
  R->rmsnorm_backward(gx, NULL, dout, x, w, rs, N, C);
  close_dev("rmsnorm_backward dinp (no dw)", d_gx, gx, (size_t)N * C, 2e-5f, 1e-5f);
  void *ptrs[] = {dx, dw, dO, drs, d_dout, d_gx, d_gw};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(x), free(w), free(o), free(rs), free(dout), free(gx), free(gw);
}

static void check_swiglu(int N, int F);

ZT_TEST(llama_ops) {
  const int B = 3, T = 17, NH = 8, KV = 2, HD = 6, F = 24, N = B * T;
  const int W = (NH + 2 * KV) * HD;
  check_rmsnorm(N, 40);  /* rows of 8-element vectors */
  check_rmsnorm(N, 304); /* vectors, more than one group of 256 per row */
  check_rmsnorm(N, 37);  /* one element at a time */
  /* RoPE at positions 5.., then back; Llama 3's scaled frequencies. */
  zt_rope_t rope = {10000.0f, 8.0f, 1.0f, 4.0f, 64.0f};
  float *q = zt_rnd((size_t)N * W, 1), *q0 = malloc((size_t)N * W * 4);
  memcpy(q0, q, (size_t)N * W * 4);
  float *dq = DEVF(q, (size_t)N * W);
  G->rope(dq, B, T, 5, NH, KV, HD, rope, 0);
  R->rope(q, B, T, 5, NH, KV, HD, rope, 0);
  close_dev("rope", dq, q, (size_t)N * W, 1e-5f, 1e-5f);
  G->rope(dq, B, T, 5, NH, KV, HD, rope, 1);
  close_dev("rope inverse", dq, q0, (size_t)N * W, 1e-5f, 1e-5f);
  G->release(dq), free(q), free(q0);
  check_swiglu(N, F);
  check_swiglu(N, 13); /* rows of 13: one element at a time */
}

static void check_swiglu(int N, int F) {
  float *g2 = zt_rnd((size_t)N * 2 * F, 1), *h = malloc((size_t)N * F * 4);
  float *dg2 = DEVF(g2, (size_t)N * 2 * F), *dh = dalloc((size_t)N * F * 4);
  G->swiglu_forward(dh, dg2, N, F);
  R->swiglu_forward(h, g2, N, F);
  close_dev("swiglu_forward", dh, h, (size_t)N * F, 1e-5f, 1e-5f);
  float *dhh = zt_rnd((size_t)N * F, 1), *dgg = malloc((size_t)N * 2 * F * 4);
  float *d_dhh = DEVF(dhh, (size_t)N * F), *d_dgg = dalloc((size_t)N * 2 * F * 4);
  G->swiglu_backward(d_dgg, d_dhh, dg2, N, F);
  R->swiglu_backward(dgg, dhh, g2, N, F);
  close_dev("swiglu_backward", d_dgg, dgg, (size_t)N * 2 * F, 1e-5f, 1e-5f);
  void *ptrs[] = {dg2, dh, d_dhh, d_dgg};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(g2), free(h), free(dhh), free(dgg);
}

/* LoRA's merge and gradients in fp32 and bf16 storage (the merge rounds
 * once, so bf16 is within one bf16 ulp of the rounded reference). */
ZT_TEST(lora) {
  const int O = 45, IN = 70, RK = 6;
  float *base = zt_rnd((size_t)O * IN, 1), *a = zt_rnd((size_t)RK * IN, 1);
  float *b = zt_rnd((size_t)O * RK, 1), *w = malloc((size_t)O * IN * 4);
  float *dbase = DEVF(base, (size_t)O * IN), *d_a = DEVF(a, (size_t)RK * IN);
  float *d_b = DEVF(b, (size_t)O * RK), *dw_ = dalloc((size_t)O * IN * 4);
  R->lora_merge(w, base, a, b, O, IN, RK, 0.5f);
  G->lora_merge(dw_, dbase, d_a, d_b, O, IN, RK, 0.5f);
  close_dev("lora_merge", dw_, w, (size_t)O * IN, 1e-5f, 1e-5f);
  float *g = zt_rnd((size_t)O * IN, 1), *da = zt_rnd((size_t)RK * IN, 1);
  float *db = zt_rnd((size_t)O * RK, 1);
  float *d_g = DEVF(g, (size_t)O * IN), *d_da = DEVF(da, (size_t)RK * IN);
  float *d_db = DEVF(db, (size_t)O * RK);
  R->lora_grad(da, db, g, a, b, O, IN, RK, 0.5f);
  G->lora_grad(d_da, d_db, d_g, d_a, d_b, O, IN, RK, 0.5f);
  close_dev("lora_grad da", d_da, da, (size_t)RK * IN, 1e-4f, 1e-5f);
  close_dev("lora_grad db", d_db, db, (size_t)O * RK, 1e-4f, 1e-5f);
  /* bf16 storage: inputs rounded, the merge rounded once. */
  round_bf(base, (size_t)O * IN), round_bf(a, (size_t)RK * IN), round_bf(b, (size_t)O * RK);
  float *xb = devx(base, (size_t)O * IN), *xa = devx(a, (size_t)RK * IN);
  float *xbb = devx(b, (size_t)O * RK), *xw = dalloc((size_t)O * IN * 2);
  R->lora_merge(w, base, a, b, O, IN, RK, 0.5f);
  round_bf(w, (size_t)O * IN);
  XB->lora_merge(xw, xb, xa, xbb, O, IN, RK, 0.5f);
  close_x("bf16 lora_merge", xw, w, (size_t)O * IN, 1e-5f);
  void *ptrs[] = {dbase, d_a, d_b, dw_, d_g, d_da, d_db, xb, xa, xbb, xw};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) G->release(ptrs[i]);
  free(base), free(a), free(b), free(w), free(g), free(da), free(db);
}

ZT_TEST_MAIN_NAMED(run_all, table, profile, llama_ops, lora, encoder, layernorm, residual_layernorm, matmul, matmul_reduced_precision,
                   attention, attention_gqa, gelu_residual_scale, crossentropy,
                   optimizer_and_reductions, optimizer_fused,
                   state_helpers, bf16_convert, bf16_elementwise,
                   bf16_norm_linear, bf16_matmul_gelu, bf16_attn_xent, bf16_attn_fa2)
