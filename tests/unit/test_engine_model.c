/*
 * test_engine_model.c: the GPT-2 model: layout, init, gradients, hooks.
 *
 * The gradient check runs a tiny model (L=2, C=16, NH=2, T=8, V=50, padded
 * to 64) on the reference kernels with randomly perturbed parameters, and
 * compares the analytic gradient of every parameter group (wte, wpe, and
 * for each block ln_1, c_attn, c_proj, ln_2, c_fc, mlp.c_proj weights and
 * biases, and ln_f) with central finite differences (h = 1e-2) on a sample
 * of elements. Everything is fp32, so a difference quotient carries an
 * error of roughly 1e-6 / h from rounding of the loss; the tolerance is
 * |analytic - numeric| <= 2e-4 + 2e-2 |numeric|, and the sampled gradients
 * are required to be non-trivial (so the check cannot pass vacuously).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "zt_common.h"
#include "zt_test.h"

static const zt_model_config_t tiny = {.n_layer = 2, .n_head = 2, .n_embd = 16, .seq_len = 8,
                                       .vocab_size = 50};

static uint64_t rs = 0x9E3779B97F4A7C15ull;
static float frand(void) {
  rs ^= rs << 13;
  rs ^= rs >> 7;
  rs ^= rs << 17;
  return (float)((rs >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

static void random_batch(int *inp, int *tgt, int n, int V) {
  for (int i = 0; i < n; i++) {
    frand();
    inp[i] = (int)(rs % (uint64_t)V);
    frand();
    tgt[i] = (int)(rs % (uint64_t)V);
  }
}

/* Moves parameters away from the init so every gradient is sizeable. */
static void perturb(zt_model_t *m) {
  for (int i = 0; i < m->lay.num_tensors; i++) {
    const zt_tensor_t *t = &m->lay.tensors[i];
    size_t n = t->kind == ZT_T_WTE || t->kind == ZT_T_HEADW
                   ? (size_t)m->cfg.vocab_size * m->cfg.n_embd
                   : t->n;
    for (size_t k = 0; k < n; k++) m->params[t->off + k] += 0.2f * frand();
  }
}

static float loss_of(zt_model_t *m, const int *inp, const int *tgt, int B, int T) {
  float l = 0.0f;
  ZT_CHECK(zt_model_forward(m, inp, tgt, B, T, &l) == 0);
  return l;
}

ZT_TEST(layout) {
  zt_model_t *m;
  ZT_REQUIRE(zt_model_create(&m, &tiny, 2, 8, zt_kernels_ref(), 0) == 0);
  ZT_CHECK(m->lay.num_units == 4);
  ZT_CHECK(m->lay.Vp == 64);
  size_t C = 16, total = 0;
  ZT_CHECK(m->lay.unit_size[0] == 64 * C + 8 * C);
  ZT_CHECK(m->lay.unit_size[1] == 12 * C * C + 13 * C);
  ZT_CHECK(m->lay.unit_size[3] == 2 * C);
  for (int u = 0; u < 4; u++) {
    ZT_CHECK(m->lay.unit_off[u] == total);
    ZT_CHECK(m->unit_params[u] == m->params + total);
    total += m->lay.unit_size[u];
  }
  ZT_CHECK(total == m->lay.num_params);
  ZT_CHECK(m->lay.num_params == zt_model_param_count(&tiny, 1));
  ZT_CHECK(zt_model_param_count(&tiny, 0) == zt_model_param_count(&tiny, 1) - 14 * C);
  const zt_tensor_t *t = zt_layout_find(&m->lay, "h.1.mlp.c_proj.weight");
  ZT_REQUIRE(t != NULL);
  ZT_CHECK(t->unit == 2 && t->layer == 1 && t->rows == 16 && t->cols == 64 && t->decay == 1);
  ZT_CHECK(t->off == m->lay.unit_off[2] + t->unit_off);
  t = zt_layout_find(&m->lay, "h.0.ln_1.bias");
  ZT_REQUIRE(t != NULL);
  ZT_CHECK(t->decay == 0 && t->unit_off == C);
  ZT_CHECK(zt_layout_find(&m->lay, "ln_f.weight")->decay == 0);
  ZT_CHECK(zt_layout_find(&m->lay, "wte")->decay == 1 && zt_layout_find(&m->lay, "wpe")->decay == 1);
  ZT_CHECK(zt_layout_find(&m->lay, "nope") == NULL);
  /* Tensors tile the flat buffer in order. */
  size_t off = 0;
  for (int i = 0; i < m->lay.num_tensors; i++) {
    ZT_CHECK(m->lay.tensors[i].off == off);
    off += m->lay.tensors[i].n;
  }
  ZT_CHECK(off == m->lay.num_params);
  ZT_CHECK(zt_model_activation_bytes(m) > 0);
  zt_model_free(m);
}

ZT_TEST(gpt2_small_param_count) {
  zt_model_config_t c = {.n_layer = 12, .n_head = 12, .n_embd = 768, .seq_len = 1024,
                         .vocab_size = 50257};
  ZT_CHECK(zt_model_param_count(&c, 0) == 124439808u);
  ZT_CHECK(zt_model_param_count(&c, 1) == 124439808u + 47u * 768u);
}

ZT_TEST(config_errors) {
  zt_model_config_t c = tiny;
  zt_model_t *m;
  c.n_embd = 15;
  ZT_CHECK(zt_model_create(&m, &c, 1, 8, zt_kernels_ref(), 0) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "divisible") != NULL);
  c = tiny;
  c.vocab_size = (1 << 20) + 1;
  ZT_CHECK(zt_model_config_check(&c) == -1);
  ZT_CHECK(zt_model_create(&m, &tiny, 1, 9, zt_kernels_ref(), 0) == -1);
  ZT_REQUIRE(zt_model_create(&m, &tiny, 1, 8, zt_kernels_ref(), 0) == 0);
  int inp[8] = {0}, tgt[8] = {0};
  float l;
  tgt[3] = 50;
  ZT_CHECK(zt_model_forward(m, inp, tgt, 1, 8, &l) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "out of range") != NULL);
  ZT_CHECK(zt_model_forward(m, inp, NULL, 2, 8, &l) == -1);
  ZT_CHECK(zt_model_backward(m, 1.0f) == -1); /* no forward with targets yet */
  zt_model_free(m);
}

ZT_TEST(init) {
  zt_model_t *m;
  ZT_REQUIRE(zt_model_create(&m, &tiny, 1, 8, zt_kernels_ref(), 0) == 0);
  zt_model_init(m, 42);
  size_t C = 16;
  const float *wte = m->params;
  for (size_t i = 50 * C; i < 64 * C; i++) ZT_CHECK(wte[i] == 0.0f);
  double s = 0;
  for (size_t i = 0; i < 50 * C; i++) s += (double)wte[i] * wte[i];
  ZT_CHECK_NEAR(sqrt(s / (50 * C)), 0.02, 0.003);
  const zt_tensor_t *ln = zt_layout_find(&m->lay, "h.1.ln_2.weight"), *b = zt_layout_find(&m->lay, "h.1.mlp.c_fc.bias");
  for (size_t i = 0; i < ln->n; i++) ZT_CHECK(m->params[ln->off + i] == 1.0f);
  for (size_t i = 0; i < b->n; i++) ZT_CHECK(m->params[b->off + i] == 0.0f);
  const zt_tensor_t *pj = zt_layout_find(&m->lay, "h.0.attn.c_proj.weight");
  s = 0;
  for (size_t i = 0; i < pj->n; i++) s += (double)m->params[pj->off + i] * m->params[pj->off + i];
  ZT_CHECK_NEAR(sqrt(s / pj->n), 0.01, 0.002); /* 0.02 / sqrt(2 * 2) */
  /* A unit's values depend only on (seed, unit). */
  float *u2 = malloc(m->lay.unit_size[2] * sizeof(float));
  zt_layout_init_unit(&m->lay, 42, 2, u2);
  ZT_CHECK(memcmp(u2, m->unit_params[2], m->lay.unit_size[2] * 4) == 0);
  zt_layout_init_unit(&m->lay, 43, 2, u2);
  ZT_CHECK(memcmp(u2, m->unit_params[2], m->lay.unit_size[2] * 4) != 0);
  /* Blocks differ from each other. */
  ZT_CHECK(memcmp(m->unit_params[1], m->unit_params[2], m->lay.unit_size[1] * 4) != 0);
  free(u2);
  zt_model_free(m);
}

/* Central differences against the analytic gradient, a few elements of
 * every tensor; every kind in [first, last] must show a sizeable gradient. */
static void grad_check(const zt_model_config_t *cfg, int first, int last) {
  const int B = 2, T = 8;
  zt_model_t *m;
  ZT_REQUIRE(zt_model_create(&m, cfg, B, T, zt_kernels_ref(), 0) == 0);
  zt_model_init(m, 7);
  perturb(m);
  int inp[16], tgt[16];
  random_batch(inp, tgt, B * T, cfg->vocab_size);
  zt_model_zero_grads(m);
  float l0 = loss_of(m, inp, tgt, B, T);
  ZT_CHECK(isfinite(l0));
  ZT_REQUIRE(zt_model_backward(m, 1.0f) == 0);

  int seen[ZT_T_NKINDS] = {0};
  const float h = 1e-2f;
  for (int i = 0; i < m->lay.num_tensors; i++) {
    const zt_tensor_t *t = &m->lay.tensors[i];
    size_t n = t->kind == ZT_T_WTE || t->kind == ZT_T_HEADW
                   ? (size_t)cfg->vocab_size * cfg->n_embd
                   : t->n;
    double maxg = 0.0;
    int bad = 0;
    for (int s = 0; s < 5; s++) {
      size_t k = t->off + (size_t)((s * 2654435761u + 17u * i) % n);
      float save = m->params[k];
      m->params[k] = save + h;
      float lp = loss_of(m, inp, tgt, B, T);
      m->params[k] = save - h;
      float lm = loss_of(m, inp, tgt, B, T);
      m->params[k] = save;
      double num = ((double)lp - lm) / (2.0 * h), ana = m->grads[k];
      if (fabs(num) > maxg) maxg = fabs(num);
      if (!(fabs(ana - num) <= 2e-4 + 2e-2 * fabs(num))) {
        fprintf(stderr, "  %s[%zu]: analytic %.6g numeric %.6g\n", t->name, k - t->off, ana, num);
        bad = 1;
      }
    }
    ZT_CHECK(!bad);
    if (maxg > 1e-3) seen[t->kind]++;
  }
  for (int kind = first; kind <= last; kind++) {
    if (!seen[kind]) fprintf(stderr, "  tensor kind %d: no sizeable gradient sampled\n", kind);
    ZT_CHECK(seen[kind] > 0);
  }
  /* Pad rows of the embedding never get gradient. */
  for (size_t i = (size_t)cfg->vocab_size * cfg->n_embd; i < (size_t)m->lay.Vp * cfg->n_embd; i++)
    ZT_CHECK(m->grads[i] == 0.0f);
  zt_model_free(m);
}

ZT_TEST(gradient_check) { grad_check(&tiny, ZT_T_WTE, ZT_T_LNFB); }

/* Llama: grouped K/V heads (4 query heads on 2), head_dim apart from
 * n_embd / n_head, q/k/v biases and an untied head, so every llama kind is
 * there; the embedding is kind WTE, as GPT-2's. */
static const zt_model_config_t tiny_llama = {
    .n_layer = 2, .n_head = 4, .n_embd = 16, .seq_len = 8, .vocab_size = 50,
    .arch = ZT_ARCH_LLAMA, .n_kv_head = 2, .head_dim = 6, .n_ff = 24, .rope_theta = 10000.0f,
    .norm_eps = 1e-5f, .tie_embed = 0, .qkv_bias = 1};

ZT_TEST(llama_gradient_check) {
  grad_check(&tiny_llama, ZT_T_RMS1W, ZT_T_HEADW);
  /* Tied, no biases, plain multi-head: the same checks. */
  zt_model_config_t c = tiny_llama;
  c.tie_embed = 0, c.qkv_bias = 0, c.n_kv_head = 4;
  grad_check(&c, ZT_T_RMS1W, ZT_T_VW);
  c.tie_embed = 1;
  grad_check(&c, ZT_T_OW, ZT_T_NORMW);
}

/* The fast kernels compute the same loss and gradients as the reference. */
ZT_TEST(fast_matches_reference) {
  zt_model_config_t c = {.n_layer = 2, .n_head = 4, .n_embd = 32, .seq_len = 16, .vocab_size = 70};
  const int B = 3, T = 16, n = B * T;
  zt_model_t *f, *r;
  ZT_REQUIRE(zt_model_create(&f, &c, B, T, zt_kernels_cpu(), 0) == 0);
  ZT_REQUIRE(zt_model_create(&r, &c, B, T, zt_kernels_ref(), 0) == 0);
  zt_model_init(f, 3);
  zt_model_init(r, 3);
  int inp[48], tgt[48];
  random_batch(inp, tgt, n, c.vocab_size);
  zt_model_zero_grads(f);
  zt_model_zero_grads(r);
  float lf = loss_of(f, inp, tgt, B, T), lr = loss_of(r, inp, tgt, B, T);
  ZT_CHECK_NEAR(lf, lr, 1e-5 * lr);
  ZT_REQUIRE(zt_model_backward(f, 1.0f) == 0 && zt_model_backward(r, 1.0f) == 0);
  for (int i = 0; i < f->lay.num_tensors; i++) {
    const zt_tensor_t *t = &f->lay.tensors[i];
    double maxr = 0, maxd = 0;
    for (size_t k = 0; k < t->n; k++) {
      maxr = fmax(maxr, fabs(r->grads[t->off + k]));
      maxd = fmax(maxd, fabs((double)f->grads[t->off + k] - r->grads[t->off + k]));
    }
    if (!(maxd <= 1e-4 * maxr + 1e-9))
      fprintf(stderr, "  %s: max diff %.3g, max grad %.3g\n", t->name, maxd, maxr);
    ZT_CHECK(maxd <= 1e-4 * maxr + 1e-9);
  }
  zt_model_free(f);
  zt_model_free(r);
}

/* Activation checkpointing: the same loss and bit-identical gradients
 * (the fast kernels, several layers, two steps so the recomputed slot is
 * reused), with the per-layer activations held once instead of L times. */
ZT_TEST(activation_checkpointing) {
  zt_model_config_t c = {.n_layer = 4, .n_head = 4, .n_embd = 32, .seq_len = 16, .vocab_size = 70};
  const int B = 3, T = 16, n = B * T;
  zt_model_t *plain, *rc;
  ZT_REQUIRE(zt_model_create(&plain, &c, B, T, zt_kernels_cpu(), 0) == 0);
  ZT_REQUIRE(zt_model_create(&rc, &c, B, T, zt_kernels_cpu(), ZT_MODEL_RECOMPUTE) == 0);
  zt_model_init(plain, 5);
  zt_model_init(rc, 5);
  int inp[48], tgt[48];
  zt_model_zero_grads(plain);
  zt_model_zero_grads(rc);
  for (int step = 0; step < 2; step++) {
    random_batch(inp, tgt, n, c.vocab_size);
    float lp = loss_of(plain, inp, tgt, B, T), lr = loss_of(rc, inp, tgt, B, T);
    ZT_CHECK(memcmp(&lp, &lr, sizeof lp) == 0);
    ZT_REQUIRE(zt_model_backward(plain, 1.0f) == 0 && zt_model_backward(rc, 1.0f) == 0);
    ZT_CHECK(memcmp(plain->grads, rc->grads, plain->lay.num_params * sizeof(float)) == 0);
  }
  /* Per layer: ln1, ln2 and atty, res2 (4 C), qkv (3 C), fch, fch_gelu
   * (8 C), 4 LayerNorm statistics and NH lse per position; recomputation
   * keeps one layer of these instead of L. */
  size_t per_layer = (size_t)B * T * (15 * (size_t)c.n_embd + 4 + (size_t)c.n_head) * 4;
  ZT_CHECK(zt_model_activation_bytes(plain) - zt_model_activation_bytes(rc) ==
           (size_t)(c.n_layer - 1) * per_layer);
  zt_model_free(plain);
  zt_model_free(rc);
}

/* Two half batches with grad_scale 1/2 accumulate to the full batch. */
ZT_TEST(accumulation) {
  const int T = 8;
  zt_model_t *m;
  ZT_REQUIRE(zt_model_create(&m, &tiny, 4, T, zt_kernels_ref(), 0) == 0);
  zt_model_init(m, 11);
  int inp[32], tgt[32];
  random_batch(inp, tgt, 32, tiny.vocab_size);
  zt_model_zero_grads(m);
  float full = loss_of(m, inp, tgt, 4, T);
  ZT_REQUIRE(zt_model_backward(m, 1.0f) == 0);
  float *g1 = malloc(m->lay.num_params * sizeof(float));
  memcpy(g1, m->grads, m->lay.num_params * sizeof(float));
  zt_model_zero_grads(m);
  float a = loss_of(m, inp, tgt, 2, T);
  ZT_REQUIRE(zt_model_backward(m, 0.5f) == 0);
  float b = loss_of(m, inp + 16, tgt + 16, 2, T);
  ZT_REQUIRE(zt_model_backward(m, 0.5f) == 0);
  ZT_CHECK_NEAR((a + b) / 2, full, 1e-6);
  double maxd = 0, maxg = 0;
  for (size_t i = 0; i < m->lay.num_params; i++) {
    maxd = fmax(maxd, fabs((double)g1[i] - m->grads[i]));
    maxg = fmax(maxg, fabs(g1[i]));
  }
  ZT_CHECK(maxd <= 1e-5 * maxg);
  free(g1);
  zt_model_free(m);
}

typedef struct {
  char log[512];
  float *gathered; /* a copy of unit 1 handed to the model */
  zt_model_t *m;
} hook_ctx;

static void hook_log(hook_ctx *c, const char *what, int u) {
  size_t l = strlen(c->log);
  snprintf(c->log + l, sizeof c->log - l, "%s%d ", what, u);
}
static int h_pf(void *ctx, int u) {
  hook_ctx *c = ctx;
  hook_log(c, "F", u);
  if (u == 1) c->m->unit_params[1] = c->gathered; /* as ZeRO-3 would */
  return 0;
}
static int h_qf(void *ctx, int u) {
  hook_log(ctx, "f", u);
  return 0;
}
static int h_pb(void *ctx, int u) {
  hook_log(ctx, "B", u);
  return 0;
}
static int h_qb(void *ctx, int u) {
  hook_log(ctx, "b", u);
  return u == 99 ? -1 : 0;
}
static int h_fail(void *ctx, int u) {
  (void)ctx;
  return u == 2 ? zt_err("gather failed") : 0;
}

ZT_TEST(hooks_and_repointing) {
  const int T = 8;
  zt_model_t *m;
  ZT_REQUIRE(zt_model_create(&m, &tiny, 1, T, zt_kernels_ref(), 0) == 0);
  zt_model_init(m, 5);
  int inp[8], tgt[8];
  random_batch(inp, tgt, 8, tiny.vocab_size);
  float base = loss_of(m, inp, tgt, 1, T);
  /* Gather unit 1 into a separate buffer and wipe the original: the loss
   * must come out the same, so the model reads only through the pointer. */
  hook_ctx c = {.m = m};
  size_t n1 = m->lay.unit_size[1];
  c.gathered = malloc(n1 * sizeof(float));
  memcpy(c.gathered, m->unit_params[1], n1 * sizeof(float));
  memset(m->params + m->lay.unit_off[1], 0, n1 * sizeof(float));
  zt_model_hooks_t h = {.ctx = &c, .pre_forward = h_pf, .post_forward = h_qf,
                        .pre_backward = h_pb, .post_backward = h_qb};
  zt_model_set_hooks(m, &h);
  float l = loss_of(m, inp, tgt, 1, T);
  ZT_CHECK(l == base);
  ZT_CHECK(zt_model_backward(m, 1.0f) == 0);
  ZT_CHECK_STR(c.log, "F0 F1 f1 F2 f2 F3 f3 f0 B0 B3 b3 B2 b2 B1 b1 b0 ");
  /* A failing hook aborts with its message. */
  h.pre_forward = h_fail;
  zt_model_set_hooks(m, &h);
  float l2;
  ZT_CHECK(zt_model_forward(m, inp, tgt, 1, T, &l2) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "gather failed") != NULL);
  zt_model_set_hooks(m, NULL);
  free(c.gathered);
  zt_model_free(m);
}

ZT_TEST_MAIN(layout, gpt2_small_param_count, config_errors, init, gradient_check,
             llama_gradient_check,
             fast_matches_reference, activation_checkpointing, accumulation,
             hooks_and_repointing)
