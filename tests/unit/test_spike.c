/*
 * test_spike.c: the loss-spike detector on synthetic curves: a clean noisy
 * decaying curve never triggers; a sustained jump triggers after exactly
 * `patience` steps and names the first spiking step; a single outlier does
 * not; NaN and Inf trigger at once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "spike.h"
#include "zt_test.h"

/* A decaying loss with multiplicative noise, deterministic. */
static double curve(int64_t t, uint64_t *rng) {
  *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
  double u = (double)(*rng >> 11) / 9007199254740992.0 - 0.5;
  return (2.0 + 3.5 * exp(-t / 150.0)) * (1.0 + 0.04 * u);
}

ZT_TEST(test_clean_curve_no_trigger) {
  zt_spike_t s;
  zt_spike_cfg_t cfg = {0};
  zt_spike_init(&s, &cfg);
  uint64_t rng = 1;
  zt_spike_verdict_t v;
  int triggers = 0;
  for (int64_t t = 1; t <= 5000; t++) triggers += zt_spike_feed(&s, t, curve(t, &rng), 1.0 + 0.2 * curve(t, &rng), &v);
  ZT_CHECK(triggers == 0);
}

ZT_TEST(test_sustained_spike_triggers_after_patience) {
  zt_spike_t s;
  zt_spike_cfg_t cfg = {.window = 50, .threshold = 6, .patience = 3};
  zt_spike_init(&s, &cfg);
  uint64_t rng = 2;
  zt_spike_verdict_t v;
  for (int64_t t = 1; t <= 300; t++) ZT_REQUIRE(!zt_spike_feed(&s, t, curve(t, &rng), 1.0, &v));
  ZT_CHECK(!zt_spike_feed(&s, 301, 9.0, 1.0, &v));
  ZT_CHECK(!zt_spike_feed(&s, 302, 9.5, 1.0, &v));
  ZT_CHECK(zt_spike_feed(&s, 303, 9.2, 1.0, &v));
  ZT_CHECK(v.triggered && v.first_step == 301);
  ZT_CHECK(v.z_loss > 6);
}

ZT_TEST(test_single_outlier_ignored) {
  zt_spike_t s;
  zt_spike_cfg_t cfg = {.window = 50, .threshold = 6, .patience = 3};
  zt_spike_init(&s, &cfg);
  uint64_t rng = 3;
  zt_spike_verdict_t v;
  int triggers = 0;
  for (int64_t t = 1; t <= 400; t++) {
    double l = curve(t, &rng);
    if (t % 97 == 0) l *= 3; /* isolated outliers */
    triggers += zt_spike_feed(&s, t, l, 1.0, &v);
  }
  ZT_CHECK(triggers == 0);
}

ZT_TEST(test_grad_norm_spike) {
  zt_spike_t s;
  zt_spike_cfg_t cfg = {.window = 30, .threshold = 6, .patience = 2};
  zt_spike_init(&s, &cfg);
  uint64_t rng = 4;
  zt_spike_verdict_t v;
  for (int64_t t = 1; t <= 100; t++)
    ZT_REQUIRE(!zt_spike_feed(&s, t, curve(t, &rng), curve(t, &rng), &v));
  /* A norm spike with the loss below its median is not a spike... */
  ZT_CHECK(!zt_spike_feed(&s, 101, 1.0, 50.0, &v));
  ZT_CHECK(!zt_spike_feed(&s, 102, 1.0, 60.0, &v));
  /* ...with the loss up a little, it is. */
  ZT_CHECK(!zt_spike_feed(&s, 103, 6.0, 50.0, &v));
  ZT_CHECK(zt_spike_feed(&s, 104, 6.0, 60.0, &v) && v.first_step == 103 && v.z_gnorm > 12);
}

ZT_TEST(test_nonfinite_immediate) {
  zt_spike_t s;
  zt_spike_cfg_t cfg = {0};
  zt_spike_init(&s, &cfg);
  zt_spike_verdict_t v;
  ZT_CHECK(zt_spike_feed(&s, 1, NAN, 1.0, &v) && v.first_step == 1);
  ZT_CHECK(zt_spike_feed(&s, 2, 1.0, INFINITY, &v) && v.first_step == 2);
  zt_spike_reset(&s);
  ZT_CHECK(s.n == 0 && s.run == 0);
}

ZT_TEST_MAIN(test_clean_curve_no_trigger, test_sustained_spike_triggers_after_patience,
             test_single_outlier_ignored, test_grad_norm_spike, test_nonfinite_immediate)
