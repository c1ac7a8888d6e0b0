/*
 * test_engine_kernels.c: every fast CPU kernel against the reference kernel.
 *
 * Each test draws random inputs, runs the function of zt_kernels_cpu() and
 * the one of zt_kernels_ref() on copies, and compares outputs element by
 * element with |fast - ref| <= atol + rtol * |ref|. Tolerances: 1e-5
 * relative (plus a small absolute term scaled to the sums involved) for
 * matmuls and reductions, which differ only in summation order and FMA
 * contraction; 2e-6 for exp/tanh-based kernels, whose fast versions use a
 * polynomial exp accurate to about 1 ulp. Shapes are deliberately odd (not
 * multiples of vector widths or of the thread count). The fast kernels are
 * also run twice with 1 and 3 threads and must give bit-identical results
 * where the kernel promises thread-count independence.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "zt_kernels.h"
#include "zt_test.h"
#include "zt_testdata.h"

static float *fdup(const float *p, size_t n) {
  float *q = malloc(n * sizeof(float));
  memcpy(q, p, n * sizeof(float));
  return q;
}

#define F zt_kernels_cpu()
#define R zt_kernels_ref()

ZT_TEST(encoder) {
  int B = 3, T = 17, C = 40, V = 29;
  int *inp = malloc(sizeof(int) * B * T);
  for (int i = 0; i < B * T; i++) inp[i] = (int)((zt_frand() + 1.0f) * 0.5f * V) % V;
  float *wte = zt_rnd((size_t)V * C, 1), *wpe = zt_rnd((size_t)T * C, 1);
  float *o1 = zt_rnd((size_t)B * T * C, 1), *o2 = fdup(o1, (size_t)B * T * C);
  F->encoder_forward(o1, inp, wte, wpe, B, T, C);
  R->encoder_forward(o2, inp, wte, wpe, B, T, C);
  zt_close_all("encoder_forward", o1, o2, (size_t)B * T * C, 0, 0);
  float *dout = zt_rnd((size_t)B * T * C, 1);
  float *dwte1 = zt_rnd((size_t)V * C, 1), *dwte2 = fdup(dwte1, (size_t)V * C);
  float *dwpe1 = zt_rnd((size_t)T * C, 1), *dwpe2 = fdup(dwpe1, (size_t)T * C);
  F->encoder_backward(dwte1, dwpe1, dout, inp, B, T, C);
  R->encoder_backward(dwte2, dwpe2, dout, inp, B, T, C);
  zt_close_all("encoder_backward dwte", dwte1, dwte2, (size_t)V * C, 1e-6f, 1e-6f);
  zt_close_all("encoder_backward dwpe", dwpe1, dwpe2, (size_t)T * C, 1e-6f, 1e-6f);
  free(inp), free(wte), free(wpe), free(o1), free(o2), free(dout);
  free(dwte1), free(dwte2), free(dwpe1), free(dwpe2);
}

ZT_TEST(layernorm) {
  int N = 77, C = 52;
  size_t NC = (size_t)N * C;
  float *x = zt_rnd(NC, 2), *w = zt_rnd(C, 1), *b = zt_rnd(C, 1);
  float *o1 = malloc(NC * 4), *o2 = malloc(NC * 4);
  float m1[77], m2[77], r1[77], r2[77];
  F->layernorm_forward(o1, m1, r1, x, w, b, N, C);
  R->layernorm_forward(o2, m2, r2, x, w, b, N, C);
  zt_close_all("layernorm_forward out", o1, o2, NC, 1e-5f, 1e-5f);
  zt_close_all("layernorm_forward mean", m1, m2, N, 1e-6f, 1e-5f);
  zt_close_all("layernorm_forward rstd", r1, r2, N, 1e-6f, 1e-5f);
  float *dout = zt_rnd(NC, 1), *dx1 = zt_rnd(NC, 1), *dx2 = fdup(dx1, NC);
  float *dw1 = zt_rnd(C, 1), *dw2 = fdup(dw1, C), *db1 = zt_rnd(C, 1), *db2 = fdup(db1, C);
  F->layernorm_backward(dx1, dw1, db1, dout, x, w, m2, r2, N, C);
  R->layernorm_backward(dx2, dw2, db2, dout, x, w, m2, r2, N, C);
  zt_close_all("layernorm_backward dinp", dx1, dx2, NC, 1e-5f, 1e-5f);
  zt_close_all("layernorm_backward dw", dw1, dw2, C, 1e-5f, 1e-5f);
  zt_close_all("layernorm_backward db", db1, db2, C, 1e-5f, 1e-5f);
  /* Thread-count independence of the chunked dw/db sums. */
  float *dx3 = fdup(dx1, NC), *dw3 = fdup(dw1, C), *db3 = fdup(db1, C);
  float *dx4 = fdup(dx1, NC), *dw4 = fdup(dw1, C), *db4 = fdup(db1, C);
  zt_kernels_cpu_set_threads(1);
  F->layernorm_backward(dx3, dw3, db3, dout, x, w, m2, r2, N, C);
  zt_kernels_cpu_set_threads(3);
  F->layernorm_backward(dx4, dw4, db4, dout, x, w, m2, r2, N, C);
  zt_kernels_cpu_set_threads(2);
  ZT_CHECK(memcmp(dw3, dw4, C * 4) == 0 && memcmp(db3, db4, C * 4) == 0);
  ZT_CHECK(memcmp(dx3, dx4, NC * 4) == 0);
  free(x), free(w), free(b), free(o1), free(o2), free(dout), free(dx1), free(dx2);
  free(dw1), free(dw2), free(db1), free(db2), free(dx3), free(dw3), free(db3);
  free(dx4), free(dw4), free(db4);
}

static void check_matmul(int N, int IC, int OC, int with_bias) {
  float *x = zt_rnd((size_t)N * IC, 1), *w = zt_rnd((size_t)OC * IC, 1);
  float *bias = with_bias ? zt_rnd(OC, 1) : NULL;
  size_t no = (size_t)N * OC;
  float *o1 = malloc(no * 4), *o2 = malloc(no * 4);
  F->matmul_forward(o1, x, w, bias, N, IC, OC);
  R->matmul_forward(o2, x, w, bias, N, IC, OC);
  float atol = 1e-5f * IC;
  zt_close_all("matmul_forward", o1, o2, no, atol, 1e-5f);
  float *dout = zt_rnd(no, 1);
  float *dx1 = zt_rnd((size_t)N * IC, 1), *dx2 = fdup(dx1, (size_t)N * IC);
  float *dw1 = zt_rnd((size_t)OC * IC, 1), *dw2 = fdup(dw1, (size_t)OC * IC);
  float *db1 = zt_rnd(OC, 1), *db2 = fdup(db1, OC);
  F->matmul_backward(dx1, dw1, with_bias ? db1 : NULL, dout, x, w, N, IC, OC);
  R->matmul_backward(dx2, dw2, with_bias ? db2 : NULL, dout, x, w, N, IC, OC);
  zt_close_all("matmul_backward dinp", dx1, dx2, (size_t)N * IC, 1e-5f * OC, 1e-5f);
  zt_close_all("matmul_backward dw", dw1, dw2, (size_t)OC * IC, 1e-5f * N, 1e-5f);
  zt_close_all("matmul_backward dbias", db1, db2, OC, 1e-5f * N, 1e-5f);
  /* dinp NULL is allowed. */
  F->matmul_backward(NULL, dw1, NULL, dout, x, w, N, IC, OC);
  free(x), free(w), free(bias), free(o1), free(o2), free(dout);
  free(dx1), free(dx2), free(dw1), free(dw2), free(db1), free(db2);
}

ZT_TEST(matmul) {
  check_matmul(37, 24, 72, 1);
  check_matmul(5, 64, 200, 0);
  check_matmul(130, 96, 33, 1);
}

/* The tiled kernel against the reference (the full T x T algorithm):
 * outputs and lse within 1e-5, gradients within 1e-5 absolute + 1e-4
 * relative; T not a multiple of the tile and T over several tiles. */
static void check_attention(int B, int T, int C, int NH) {
  size_t nq = (size_t)B * T * 3 * C, no = (size_t)B * T * C, nl = (size_t)B * NH * T;
  float *qkv = zt_rnd(nq, 2);
  float *o1 = malloc(no * 4), *o2 = malloc(no * 4), *l1 = malloc(nl * 4), *l2 = malloc(nl * 4);
  F->attention_forward(o1, l1, qkv, B, T, C, NH);
  R->attention_forward(o2, l2, qkv, B, T, C, NH);
  zt_close_all("attention_forward out", o1, o2, no, 1e-5f, 1e-4f);
  zt_close_all("attention_forward lse", l1, l2, nl, 1e-5f, 1e-5f);
  float *dout = zt_rnd(no, 1), *d1 = zt_rnd(nq, 1), *d2 = zt_rnd(nq, 1);
  F->attention_backward(d1, dout, qkv, o2, l2, B, T, C, NH);
  R->attention_backward(d2, dout, qkv, o2, l2, B, T, C, NH);
  zt_close_all("attention_backward", d1, d2, nq, 1e-5f, 1e-4f);
  free(qkv), free(o1), free(o2), free(l1), free(l2), free(dout), free(d1), free(d2);
}

ZT_TEST(attention) {
  check_attention(2, 13, 24, 3);
  check_attention(1, 64, 64, 4);
  check_attention(3, 7, 16, 1);
  check_attention(2, 200, 48, 2);  /* 4 tiles, the last partial */
  check_attention(1, 129, 32, 1);  /* one row past two full tiles */
}

/* Grouped-query attention read in place, both tables: against the
 * multi-head reference on q, k, v with each K/V head repeated for its
 * query heads (gqa_expand), whose gradient summed back per K/V head
 * (gqa_reduce) is the K/V heads' gradient. */
static void check_attention_gqa(int B, int T, int NH, int NKV, int HD) {
  int W = (NH + 2 * NKV) * HD, A = NH * HD, BT = B * T;
  size_t nq = (size_t)BT * W, nf = (size_t)BT * 3 * A, no = (size_t)BT * A;
  size_t nl = (size_t)B * NH * T;
  float *qkv = zt_rnd(nq, 2), *full = malloc(nf * 4);
  zt_kernels_host_gqa_expand(full, qkv, BT, NH, NKV, HD);
  float *o0 = malloc(no * 4), *l0 = malloc(nl * 4), *dfull = malloc(nf * 4);
  float *want = malloc(nq * 4), *dout = zt_rnd(no, 1);
  R->attention_forward(o0, l0, full, B, T, A, NH);
  R->attention_backward(dfull, dout, full, o0, l0, B, T, A, NH);
  zt_kernels_host_gqa_reduce(want, dfull, BT, NH, NKV, HD);
  const zt_kernels_t *tables[2] = {R, F};
  for (int i = 0; i < 2; i++) {
    const zt_kernels_t *K = tables[i];
    float *o = malloc(no * 4), *l = malloc(nl * 4), *d = zt_rnd(nq, 1);
    K->attention_forward_gqa(o, l, qkv, B, T, NH, NKV, HD);
    zt_close_all(i ? "fast gqa forward out" : "ref gqa forward out", o, o0, no, 1e-5f, 1e-4f);
    zt_close_all(i ? "fast gqa forward lse" : "ref gqa forward lse", l, l0, nl, 1e-5f, 1e-5f);
    K->attention_backward_gqa(d, dout, qkv, o0, l0, B, T, NH, NKV, HD);
    zt_close_all(i ? "fast gqa backward" : "ref gqa backward", d, want, nq, 1e-5f, 1e-4f);
    free(o), free(l), free(d);
  }
  free(qkv), free(full), free(o0), free(l0), free(dfull), free(want), free(dout);
}

ZT_TEST(attention_gqa) {
  check_attention_gqa(2, 13, 4, 2, 8);
  check_attention_gqa(1, 130, 6, 2, 16); /* three tiles; 3 query heads a K/V head */
  check_attention_gqa(2, 70, 4, 1, 8);   /* one K/V head for all */
  check_attention_gqa(1, 9, 3, 3, 8);    /* no grouping */
}

ZT_TEST(gelu_residual) {
  size_t n = 1001;
  float *x = zt_rnd(n, 6), *o1 = malloc(n * 4), *o2 = malloc(n * 4);
  x[0] = 0.0f, x[1] = 20.0f, x[2] = -20.0f, x[3] = 1e-4f;
  F->gelu_forward(o1, x, n);
  R->gelu_forward(o2, x, n);
  zt_close_all("gelu_forward", o1, o2, n, 2e-6f, 2e-6f);
  float *d = zt_rnd(n, 1), *d1 = malloc(n * 4), *d2 = malloc(n * 4);
  F->gelu_backward(d1, x, d, n);
  R->gelu_backward(d2, x, d, n);
  zt_close_all("gelu_backward", d1, d2, n, 2e-6f, 1e-5f);
  /* In place. */
  float *d3 = fdup(d, n);
  F->gelu_backward(d3, x, d3, n);
  zt_close_all("gelu_backward in place", d3, d1, n, 0, 0);
  float *b = zt_rnd(n, 1);
  F->residual_forward(o1, x, b, n);
  R->residual_forward(o2, x, b, n);
  zt_close_all("residual_forward", o1, o2, n, 0, 0);
  free(x), free(o1), free(o2), free(d), free(d1), free(d2), free(d3), free(b);
}

ZT_TEST(crossentropy) {
  int N = 23, V = 50, Vp = 64;
  size_t n = (size_t)N * Vp;
  float *logits = zt_rnd(n, 5);
  int targets[23];
  for (int i = 0; i < N; i++) targets[i] = (i * 7) % V;
  float *p1 = malloc(n * 4), *p2 = malloc(n * 4), l1[23], l2[23];
  F->crossentropy_forward(l1, p1, logits, targets, N, V, Vp);
  R->crossentropy_forward(l2, p2, logits, targets, N, V, Vp);
  zt_close_all("crossentropy_forward probs", p1, p2, n, 1e-7f, 2e-6f);
  zt_close_all("crossentropy_forward losses", l1, l2, N, 2e-6f, 2e-6f);
  for (int i = 0; i < N; i++)
    for (int j = V; j < Vp; j++) ZT_CHECK(p1[(size_t)i * Vp + j] == 0.0f);
  /* In place, as the model uses it. */
  float *p3 = fdup(logits, n), l3[23];
  F->crossentropy_forward(l3, p3, p3, targets, N, V, Vp);
  zt_close_all("crossentropy_forward in place", p3, p1, n, 0, 0);
  zt_close_all("crossentropy_forward in place losses", l3, l1, N, 0, 0);
  float *d1 = malloc(n * 4), *d2 = malloc(n * 4);
  F->crossentropy_backward(d1, p2, targets, 0.25f, N, V, Vp);
  R->crossentropy_backward(d2, p2, targets, 0.25f, N, V, Vp);
  zt_close_all("crossentropy_backward", d1, d2, n, 1e-7f, 1e-6f);
  free(logits), free(p1), free(p2), free(p3), free(d1), free(d2);
}

ZT_TEST(optimizer_and_reductions) {
  size_t n = 70001;
  float *p1 = zt_rnd(n, 1), *p2 = fdup(p1, n), *g = zt_rnd(n, 1);
  float *m1 = zt_rnd(n, 0.1f), *m2 = fdup(m1, n), *v1 = zt_rnd(n, 0.1f), *v2;
  for (size_t i = 0; i < n; i++) v1[i] = fabsf(v1[i]);
  v2 = fdup(v1, n);
  F->adamw(p1, g, m1, v1, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.19f, 0.0975f);
  R->adamw(p2, g, m2, v2, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.19f, 0.0975f);
  zt_close_all("adamw p", p1, p2, n, 1e-7f, 1e-6f);
  zt_close_all("adamw m", m1, m2, n, 1e-7f, 1e-6f);
  zt_close_all("adamw v", v1, v2, n, 1e-7f, 1e-6f);
  double s1 = F->sumsq(g, n), s2 = R->sumsq(g, n);
  ZT_CHECK_NEAR(s1, s2, 1e-12 * s2);
  zt_kernels_cpu_set_threads(1);
  double s3 = F->sumsq(g, n);
  zt_kernels_cpu_set_threads(3);
  double s4 = F->sumsq(g, n);
  zt_kernels_cpu_set_threads(2);
  ZT_CHECK(s3 == s4 && s3 == s1);
  F->scale(p1, n, 0.5f);
  R->scale(p2, n, 0.5f);
  zt_close_all("scale", p1, p2, n, 1e-7f, 1e-6f);
  F->zero(p1, n);
  for (size_t i = 0; i < n; i++) ZT_CHECK(p1[i] == 0.0f);
  free(p1), free(p2), free(g), free(m1), free(m2), free(v1), free(v2);
}

/* The fp64 optimizer-state helpers: element-wise ones exact, sumsq_f64 in
 * element order (so exact too), memory functions on host memory. */
ZT_TEST(state_helpers) {
  size_t n = 10007;
  float *x = zt_rnd(n, 3);
  double *a1 = malloc(n * 8), *a2 = malloc(n * 8), *y = malloc(n * 8);
  for (size_t i = 0; i < n; i++) a1[i] = a2[i] = zt_frand() * 1e3, y[i] = zt_frand() * 7.5;
  F->acc_f64(a1, x, n);
  R->acc_f64(a2, x, n);
  ZT_CHECK(memcmp(a1, a2, n * 8) == 0);
  F->add_f64(a1, y, n);
  R->add_f64(a2, y, n);
  ZT_CHECK(memcmp(a1, a2, n * 8) == 0);
  for (size_t i = 0; i < n; i++) ZT_CHECK(a1[i] == a2[i]);
  F->widen_f64(a1, x, n);
  for (size_t i = 0; i < n; i++) ZT_CHECK(a1[i] == (double)x[i]);
  float *f1 = malloc(n * 4), *f2 = malloc(n * 4);
  F->narrow_f64(f1, y, n, 0.25, 0.5f);
  R->narrow_f64(f2, y, n, 0.25, 0.5f);
  ZT_CHECK(memcmp(f1, f2, n * 4) == 0);
  ZT_CHECK(f1[7] == (float)(y[7] * 0.25) * 0.5f);
  double s1 = F->sumsq_f64(y, n, 0.25), s2 = R->sumsq_f64(y, n, 0.25), s3 = 0;
  for (size_t i = 0; i < n; i++) s3 += (double)f1[i] * 2 * ((double)f1[i] * 2);
  ZT_CHECK(s1 == s2);
  ZT_CHECK_NEAR(s1, s3, 1e-12 * s3);
  void *p = F->alloc(100);
  ZT_CHECK(p != NULL && ((char *)p)[99] == 0);
  F->copy(p, x, 100);
  ZT_CHECK(memcmp(p, x, 100) == 0);
  F->memzero(p, 100);
  ZT_CHECK(((char *)p)[50] == 0);
  F->release(p);
  free(x), free(a1), free(a2), free(y), free(f1), free(f2);
}

ZT_TEST(tables) {
  zt_kernels_cpu_set_threads(2);
  ZT_CHECK_STR(F->name, "cpu");
  ZT_CHECK_STR(R->name, "cpu-ref");
  ZT_CHECK(zt_kernels_cpu_set_threads(0) == 2);
}

/* LoRA's merge and the adapters' gradients (with dw NULL, the frozen
 * matmul and RMSNorm skip theirs), for ranks 1 and 5 on odd shapes. */
static void check_lora(int O, int IN, int R_) {
  float *base = zt_rnd((size_t)O * IN, 1), *a = zt_rnd((size_t)R_ * IN, 1);
  float *b = zt_rnd((size_t)O * R_, 1), *w1 = malloc((size_t)O * IN * 4);
  float *w2 = fdup(base, (size_t)O * IN);
  F->lora_merge(w1, base, a, b, O, IN, R_, 0.7f);
  R->lora_merge(w2, w2, a, b, O, IN, R_, 0.7f); /* in place, as lora.c merges */
  zt_close_all("lora_merge", w1, w2, (size_t)O * IN, 1e-5f * R_, 1e-5f);
  float *dw = zt_rnd((size_t)O * IN, 1);
  float *da1 = zt_rnd((size_t)R_ * IN, 1), *da2 = fdup(da1, (size_t)R_ * IN);
  float *db1 = zt_rnd((size_t)O * R_, 1), *db2 = fdup(db1, (size_t)O * R_);
  F->lora_grad(da1, db1, dw, a, b, O, IN, R_, 0.7f);
  R->lora_grad(da2, db2, dw, a, b, O, IN, R_, 0.7f);
  zt_close_all("lora_grad da", da1, da2, (size_t)R_ * IN, 1e-5f * O, 1e-5f);
  zt_close_all("lora_grad db", db1, db2, (size_t)O * R_, 1e-5f * IN, 1e-5f);
  /* One element of each against a double-precision sum, so that the two
   * tables cannot agree on a wrong formula. */
  double sa = 0, sb = 0;
  for (int o = 0; o < O; o++) sa += (double)b[(size_t)o * R_ + R_ - 1] * dw[(size_t)o * IN + 2];
  for (int i = 0; i < IN; i++) sb += (double)dw[(size_t)(O - 1) * IN + i] * a[i];
  float *da0 = zt_rnd((size_t)R_ * IN, 0), *db0 = zt_rnd((size_t)O * R_, 0);
  memset(da0, 0, (size_t)R_ * IN * 4), memset(db0, 0, (size_t)O * R_ * 4);
  F->lora_grad(da0, db0, dw, a, b, O, IN, R_, 0.7f);
  ZT_CHECK(fabs(da0[(size_t)(R_ - 1) * IN + 2] - 0.7 * sa) < 1e-4 * (1 + fabs(sa)));
  ZT_CHECK(fabs(db0[(size_t)(O - 1) * R_] - 0.7 * sb) < 1e-4 * (1 + fabs(sb)));
  /* Frozen weights: dw NULL leaves everything else as with a dw. */
  int N = 7;
  float *x = zt_rnd((size_t)N * IN, 1), *dout = zt_rnd((size_t)N * O, 1);
  float *dx1 = malloc((size_t)N * IN * 4), *dx2 = malloc((size_t)N * IN * 4);
  float *g = zt_rnd((size_t)O * IN, 1);
  F->matmul_backward(dx1, NULL, NULL, dout, x, base, N, IN, O);
  R->matmul_backward(dx2, g, NULL, dout, x, base, N, IN, O);
  zt_close_all("matmul_backward, dw NULL", dx1, dx2, (size_t)N * IN, 1e-5f * O, 1e-5f);
  R->matmul_backward(dx2, NULL, NULL, dout, x, base, N, IN, O);
  zt_close_all("matmul_backward ref, dw NULL", dx1, dx2, (size_t)N * IN, 1e-5f * O, 1e-5f);
  free(base), free(a), free(b), free(w1), free(w2), free(dw), free(da1), free(da2), free(db1);
  free(db2), free(da0), free(db0), free(x), free(dout), free(dx1), free(dx2), free(g);
}

ZT_TEST(lora) {
  check_lora(37, 53, 5);
  check_lora(64, 24, 1);
}

ZT_TEST_MAIN(tables, encoder, layernorm, matmul, lora, attention, attention_gqa, gelu_residual,
             crossentropy,
             optimizer_and_reductions, state_helpers)
