/*
 * spike.h: the loss-spike detector (pure logic, no I/O).
 *
 * Fed with every step's all-reduced loss and gradient norm, in step order.
 * A non-finite loss or gradient norm triggers at once. Otherwise each value
 * is compared with the trailing window of accepted steps through a robust
 * z-score, (x - median) / (1.4826 * MAD), with the MAD floored at 1% of the
 * median so a very flat curve does not make noise look like a spike. A
 * step whose loss z-score exceeds `threshold`, or whose grad-norm z-score
 * exceeds twice the threshold while the loss is above its median, is
 * suspicious (gradient norms are heavy-tailed);
 * `patience` suspicious steps in a row trigger. Suspicious steps are kept
 * out of the window, so a spike cannot raise its own baseline.
 */
#ifndef ZT_SPIKE_H
#define ZT_SPIKE_H

#include <stdint.h>

#define ZT_SPIKE_MAX_WINDOW 1024

typedef struct {
  int window;       /* trailing steps in the baseline (default 100) */
  double threshold; /* robust z-score that counts as a spike (default 6) */
  int patience;     /* consecutive spiking steps that trigger (default 3) */
  int min_history;  /* steps needed before z-scores are trusted (default 20) */
} zt_spike_cfg_t;

typedef struct {
  zt_spike_cfg_t cfg;
  double loss[ZT_SPIKE_MAX_WINDOW], gnorm[ZT_SPIKE_MAX_WINDOW];
  int n, head; /* ring buffer of accepted steps */
  int run;     /* consecutive suspicious steps */
  int64_t run_start;
} zt_spike_t;

typedef struct {
  int triggered;
  int64_t first_step; /* first step of the spike window */
  double z_loss, z_gnorm, median_loss;
  char reason[160];
} zt_spike_verdict_t;

void zt_spike_init(zt_spike_t *s, const zt_spike_cfg_t *cfg);
/* Feeds one step; returns 1 and fills *v when the detector triggers. */
int zt_spike_feed(zt_spike_t *s, int64_t step, double loss, double grad_norm, zt_spike_verdict_t *v);
/* Forgets everything after a rollback (the baseline restarts). */
void zt_spike_reset(zt_spike_t *s);

#endif
