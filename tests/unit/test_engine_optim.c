/*
 * test_engine_optim.c: AdamW, weight-decay mask, clipping, LR schedule.
 *
 * AdamW is checked against the textbook formula computed in double for
 * three steps, over a range that starts and ends inside tensors (as a ZeRO
 * shard does), so both decayed and undecayed tensors are exercised.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"
#include "optim.h"
#include "zt_test.h"

static const zt_model_config_t tiny = {.n_layer = 1, .n_head = 2, .n_embd = 8, .seq_len = 4,
                                       .vocab_size = 10};

/* A range that starts inside ln_1.bias (not decayed) and runs into
 * c_attn.weight (decayed), as a ZeRO shard of unit 1 can: three steps of
 * both CPU tables' AdamW against the textbook formula in double. */
ZT_TEST(adamw_formula) {
  zt_layout_t lay;
  ZT_REQUIRE(zt_layout_build(&lay, &tiny) == 0);
  const zt_tensor_t *w = zt_layout_find(&lay, "h.0.attn.c_attn.weight");
  size_t lo = w->unit_off - 5, n = 40;
  zt_opt_config_t cfg = {0, 0.9f, 0.99f, 1e-6f, 0.5f};
  const zt_kernels_t *kernels[2] = {zt_kernels_ref(), zt_kernels_cpu()};
  for (int ki = 0; ki < 2; ki++) {
    double p[40], mm[40] = {0}, vv[40] = {0};
    float params[40], g[40], m[40] = {0}, v[40] = {0};
    for (size_t i = 0; i < n; i++) p[i] = params[i] = 0.1f * (float)i - 1.0f;
    for (int step = 1; step <= 3; step++) {
      float lr = 0.01f * step;
      for (size_t i = 0; i < n; i++) g[i] = (float)sin((double)i + step);
      zt_opt_adamw_unit(kernels[ki], &lay, &cfg, w->unit, lo, n, params, g, m, v, lr, step);
      for (size_t i = 0; i < n; i++) {
        double wd = i >= 5 ? 0.5 : 0.0; /* the first 5 are ln_1.bias: no decay */
        mm[i] = 0.9 * mm[i] + 0.1 * g[i];
        vv[i] = 0.99 * vv[i] + 0.01 * (double)g[i] * g[i];
        double mh = mm[i] / (1 - pow(0.9, step)), vh = vv[i] / (1 - pow(0.99, step));
        p[i] = p[i] - (double)lr * wd * p[i];
        p[i] = p[i] - lr * mh / (sqrt(vh) + 1e-6);
      }
    }
    for (size_t i = 0; i < n; i++) ZT_CHECK_NEAR(params[i], p[i], 2e-6);
  }
  /* Decay follows the tensor: a range inside one bias is never decayed,
   * whatever weight_decay says. */
  const zt_tensor_t *b = zt_layout_find(&lay, "h.0.attn.c_attn.bias");
  float pb[4] = {1, 1, 1, 1}, gb[4] = {0}, mb[4] = {0}, vb[4] = {0};
  zt_opt_adamw_unit(zt_kernels_ref(), &lay, &cfg, b->unit, b->unit_off + 1, 4, pb, gb, mb, vb,
                    0.1f, 1);
  for (int i = 0; i < 4; i++) ZT_CHECK(pb[i] == 1.0f);
  zt_layout_free(&lay);
}

ZT_TEST(clipping) {
  float norm;
  ZT_CHECK(zt_opt_clip_coef(4.0, 1.0f, &norm) < 0.5f + 1e-6f);
  ZT_CHECK_NEAR(norm, 2.0, 1e-7);
  ZT_CHECK_NEAR(zt_opt_clip_coef(4.0, 1.0f, NULL), 1.0 / (2.0 + 1e-6), 1e-7);
  ZT_CHECK(zt_opt_clip_coef(0.25, 1.0f, &norm) == 1.0f);
  ZT_CHECK_NEAR(norm, 0.5, 1e-7);
  ZT_CHECK(zt_opt_clip_coef(100.0, 0.0f, &norm) == 1.0f); /* disabled */
  ZT_CHECK(zt_opt_clip_coef(INFINITY, 1.0f, &norm) == 1.0f);
  ZT_CHECK(isinf(norm));
}

ZT_TEST(schedule) {
  zt_lr_sched_t s = {1, 1e-4f, 1e-3f, 10, 110};
  ZT_CHECK_NEAR(zt_lr_at(&s, 0, 0, 1), 1e-4 + 9e-4 * 0.1, 1e-9);
  ZT_CHECK_NEAR(zt_lr_at(&s, 0, 4, 1), 1e-4 + 9e-4 * 0.5, 1e-9);
  ZT_CHECK_NEAR(zt_lr_at(&s, 0, 9, 1), 1e-3, 1e-9);
  ZT_CHECK_NEAR(zt_lr_at(&s, 0, 10, 1), 1e-3, 1e-9);   /* decay starts at the peak */
  ZT_CHECK_NEAR(zt_lr_at(&s, 0, 60, 1), 5.5e-4, 1e-9); /* half way: cos = 0 */
  ZT_CHECK_NEAR(zt_lr_at(&s, 0, 85, 1), 1e-4 + 9e-4 * 0.5 * (1 + cos(M_PI * 0.75)), 1e-9);
  ZT_CHECK_NEAR(zt_lr_at(&s, 0, 110, 1), 1e-4, 1e-9);
  ZT_CHECK_NEAR(zt_lr_at(&s, 0, 1000, 1), 1e-4, 1e-9);
  ZT_CHECK_NEAR(zt_lr_at(&s, 0, 60, 0.5f), 2.75e-4, 1e-9); /* multiplier */
  /* Monotone: up during warmup, down after. */
  for (long i = 1; i < 10; i++) ZT_CHECK(zt_lr_at(&s, 0, i, 1) > zt_lr_at(&s, 0, i - 1, 1));
  for (long i = 11; i < 110; i++) ZT_CHECK(zt_lr_at(&s, 0, i, 1) < zt_lr_at(&s, 0, i - 1, 1));
  zt_lr_sched_t off = {0};
  ZT_CHECK_NEAR(zt_lr_at(&off, 3e-4f, 50, 1), 3e-4, 1e-10);
  ZT_CHECK_NEAR(zt_lr_at(NULL, 3e-4f, 50, 0.1f), 3e-5, 1e-11);
  zt_lr_sched_t nowarm = {1, 0, 1e-3f, 0, 100};
  ZT_CHECK_NEAR(zt_lr_at(&nowarm, 0, 0, 1), 1e-3, 1e-9);
}

ZT_TEST_MAIN(adamw_formula, clipping, schedule)
