/*
 * test_gpt.c: the CPU GPT-2 model.
 *
 * Gradient check: for every named tensor of every unit, a sample of
 * analytic gradient elements is compared with central finite differences
 * of the mean loss, in fp32 with step 1e-3 on a tiny model (L=2, C=16,
 * NH=2, T=8, V=50). Tolerance: |a - n| <= 2e-2 * max(|a|, |n|) + 3e-4
 * (fp32 central differences are good to about 1e-4 here).
 * Also: the padded vocabulary never gets probability or gradient, init is
 * a pure function of (seed, unit), and runs are bit-identical.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpt.h"
#include "zt_common.h"
#include "zt_test.h"

typedef struct {
  zt_gpt_t *m;
  float *params, *grads;
  size_t total;
  int B, T;
  int *inp, *tgt;
} fixture;

static void setup(fixture *f, int B, int T) {
  zt_gpt_config c = {.n_layer = 2, .n_head = 2, .n_embd = 16, .seq_len = 8, .vocab_size = 50};
  if (zt_gpt_create(&c, B, T, &f->m) != 0) abort();
  f->total = zt_gpt_num_params_padded(&f->m->cfg);
  f->params = calloc(f->total, sizeof(float));
  f->grads = calloc(f->total, sizeof(float));
  size_t off = 0;
  for (int u = 0; u < f->m->n_units; u++) {
    f->m->unit_params[u] = f->params + off;
    f->m->unit_grads[u] = f->grads + off;
    zt_gpt_init_unit(&f->m->cfg, u, 42, f->params + off);
    off += f->m->unit_size[u];
  }
  /* Larger random weights than GPT-2 init, so every path carries signal. */
  uint64_t x = 7;
  for (size_t i = 0; i < f->total; i++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    f->params[i] += 0.1f * ((float)(x >> 40) / (float)(1 << 24) - 0.5f);
  }
  /* keep padded embedding rows zero */
  memset(f->params + (size_t)50 * 16, 0, (size_t)(64 - 50) * 16 * sizeof(float));
  f->B = B, f->T = T;
  f->inp = malloc(sizeof(int) * B * T);
  f->tgt = malloc(sizeof(int) * B * T);
  for (int i = 0; i < B * T; i++) f->inp[i] = (i * 7 + 3) % 50, f->tgt[i] = (i * 11 + 5) % 50;
}

static void teardown(fixture *f) {
  zt_gpt_free(f->m);
  free(f->params);
  free(f->grads);
  free(f->inp);
  free(f->tgt);
}

ZT_TEST(test_gradcheck_all_tensors) {
  fixture f;
  setup(&f, 2, 8);
  memset(f.grads, 0, f.total * sizeof(float));
  float loss = zt_gpt_forward(f.m, f.inp, f.tgt, f.B, f.T);
  ZT_CHECK(loss > 0 && isfinite(loss));
  zt_gpt_backward(f.m, 1.0f);
  static const char *names[] = {"wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw",
                                "attprojb", "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb",
                                "lnfw", "lnfb"};
  size_t unit_off = 0;
  int checked = 0, bad = 0;
  for (int u = 0; u < f.m->n_units; u++) {
    zt_gpt_view v[ZT_GPT_NTENSORS];
    int nv = zt_gpt_unit_views(&f.m->cfg, u, v);
    for (int t = 0; t < nv; t++) {
      size_t n = v[t].n;
      if (v[t].tensor == ZT_GPT_WTE) n = 50 * 16; /* real rows only */
      int local_bad = 0;
      for (int k = 0; k < 12; k++) {
        size_t i = unit_off + v[t].off + (size_t)(k * 2654435761u % n);
        float old = f.params[i], eps = 1e-3f;
        f.params[i] = old + eps;
        double lp = zt_gpt_forward(f.m, f.inp, f.tgt, f.B, f.T);
        f.params[i] = old - eps;
        double lm = zt_gpt_forward(f.m, f.inp, f.tgt, f.B, f.T);
        f.params[i] = old;
        double num = (lp - lm) / (2 * eps), ana = f.grads[i];
        double tol = 2e-2 * fmax(fabs(num), fabs(ana)) + 3e-4;
        checked++;
        if (fabs(num - ana) > tol) {
          if (!local_bad++)
            fprintf(stderr, "unit %d %s[%zu]: analytic %.6g numeric %.6g\n", u,
                    names[v[t].tensor], i - unit_off - v[t].off, ana, num);
          bad++;
        }
      }
    }
    unit_off += f.m->unit_size[u];
  }
  fprintf(stderr, "gradcheck: %d elements, %d outside tolerance\n", checked, bad);
  ZT_CHECK(bad == 0);
  /* Padded vocabulary rows get no gradient. */
  float pad = 0;
  for (size_t i = 50 * 16; i < 64 * 16; i++) pad += fabsf(f.grads[i]);
  ZT_CHECK(pad == 0);
  teardown(&f);
}

ZT_TEST(test_init_pure_and_loss_near_uniform) {
  zt_gpt_config c = {.n_layer = 3, .n_head = 4, .n_embd = 32, .seq_len = 16, .vocab_size = 300};
  ZT_REQUIRE(zt_gpt_config_check(&c) == 0);
  ZT_CHECK(c.padded_vocab == 320);
  size_t n = zt_gpt_unit_size(&c, 2);
  float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
  zt_gpt_init_unit(&c, 2, 5, a);
  zt_gpt_init_unit(&c, 2, 5, b);
  ZT_CHECK(memcmp(a, b, n * sizeof(float)) == 0);
  zt_gpt_init_unit(&c, 2, 6, b);
  ZT_CHECK(memcmp(a, b, n * sizeof(float)) != 0);
  free(a);
  free(b);
  /* GPT-2 parameter count formula. */
  size_t C = 32, L = 3, V = 300, T = 16;
  size_t expect = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C;
  ZT_CHECK(zt_gpt_num_params(&c) == expect);
  /* A freshly initialised model predicts nearly uniformly: loss ~ ln(V). */
  zt_gpt_t *m;
  ZT_REQUIRE(zt_gpt_create(&c, 2, 16, &m) == 0);
  float *p = malloc(zt_gpt_num_params_padded(&c) * sizeof(float));
  size_t off = 0;
  for (int u = 0; u < m->n_units; u++) {
    m->unit_params[u] = p + off;
    zt_gpt_init_unit(&c, u, 1, p + off);
    off += m->unit_size[u];
  }
  int inp[32], tgt[32];
  for (int i = 0; i < 32; i++) inp[i] = i * 13 % 300, tgt[i] = i * 17 % 300;
  float loss = zt_gpt_forward(m, inp, tgt, 2, 16);
  ZT_CHECK_NEAR(loss, logf(300), 0.1);
  float again = zt_gpt_forward(m, inp, tgt, 2, 16);
  ZT_CHECK(loss == again);
  zt_gpt_free(m);
  free(p);
}

ZT_TEST(test_bad_configs) {
  zt_gpt_config c = {.n_layer = 2, .n_head = 3, .n_embd = 16, .seq_len = 8, .vocab_size = 50};
  ZT_CHECK(zt_gpt_config_check(&c) != 0 && strstr(zt_err_msg(), "n_head"));
  c.n_head = 2, c.vocab_size = 1;
  ZT_CHECK(zt_gpt_config_check(&c) != 0 && strstr(zt_err_msg(), "vocab_size"));
  c.vocab_size = 50;
  zt_gpt_t *m;
  ZT_CHECK(zt_gpt_create(&c, 1, 9, &m) != 0); /* T > seq_len */
}

ZT_TEST_MAIN(test_gradcheck_all_tensors, test_init_pure_and_loss_near_uniform, test_bad_configs)
