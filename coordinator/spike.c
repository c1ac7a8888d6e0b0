/*
 * spike.c: robust z-score loss-spike detector (see spike.h).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spike.h"

void zt_spike_init(zt_spike_t *s, const zt_spike_cfg_t *cfg) {
  memset(s, 0, sizeof *s);
  s->cfg = *cfg;
  if (s->cfg.window <= 0) s->cfg.window = 100;
  if (s->cfg.window > ZT_SPIKE_MAX_WINDOW) s->cfg.window = ZT_SPIKE_MAX_WINDOW;
  if (s->cfg.threshold <= 0) s->cfg.threshold = 6.0;
  if (s->cfg.patience <= 0) s->cfg.patience = 3;
  if (s->cfg.min_history <= 0) s->cfg.min_history = 20;
  if (s->cfg.min_history > s->cfg.window) s->cfg.min_history = s->cfg.window;
}

void zt_spike_reset(zt_spike_t *s) {
  zt_spike_cfg_t cfg = s->cfg;
  zt_spike_init(s, &cfg);
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Robust z-score of x against the n values of buf. */
static double robust_z(const double *buf, int n, double x, double *med_out) {
  double tmp[ZT_SPIKE_MAX_WINDOW];
  memcpy(tmp, buf, (size_t)n * sizeof *tmp);
  double med = median(tmp, n);
  for (int i = 0; i < n; i++) tmp[i] = fabs(tmp[i] - med);
  double mad = median(tmp, n);
  double scale = 1.4826 * fmax(mad, 0.01 * fabs(med) + 1e-12);
  if (med_out) *med_out = med;
  return (x - med) / scale;
}

int zt_spike_feed(zt_spike_t *s, int64_t step, double loss, double gn, zt_spike_verdict_t *v) {
  memset(v, 0, sizeof *v);
  if (!isfinite(loss) || !isfinite(gn)) {
    v->triggered = 1;
    v->first_step = step;
    snprintf(v->reason, sizeof v->reason, "non-finite %s at step %lld (loss %g, grad norm %g)",
             !isfinite(loss) ? "loss" : "gradient norm", (long long)step, loss, gn);
    return 1;
  }
  int n = s->n < s->cfg.window ? s->n : s->cfg.window;
  int suspicious = 0;
  if (n >= s->cfg.min_history) {
    double zl = robust_z(s->loss, n, loss, &v->median_loss);
    double zg = robust_z(s->gnorm, n, gn, NULL);
    v->z_loss = zl, v->z_gnorm = zg;
    /* Gradient norms are heavy-tailed: a norm spike alone counts only at
     * twice the threshold and when the loss is above its median too. */
    suspicious = zl > s->cfg.threshold || (zg > 2 * s->cfg.threshold && zl > 0);
  }
  if (suspicious) {
    if (s->run++ == 0) s->run_start = step;
    if (s->run >= s->cfg.patience) {
      v->triggered = 1;
      v->first_step = s->run_start;
      snprintf(v->reason, sizeof v->reason,
               "%d spiking steps from step %lld: loss %.4g (median %.4g, z %.1f), grad norm z %.1f",
               s->run, (long long)s->run_start, loss, v->median_loss, v->z_loss, v->z_gnorm);
      return 1;
    }
    return 0;
  }
  s->run = 0;
  s->loss[s->head] = loss;
  s->gnorm[s->head] = gn;
  s->head = (s->head + 1) % s->cfg.window;
  if (s->n < s->cfg.window) s->n++;
  return 0;
}
