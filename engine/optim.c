/*
 * optim.c: AdamW on a range of a unit, clipping, LR schedule (see optim.h
 * for the formulas).
 */
#include "optim.h"

#include <math.h>
#include <string.h>

#include "zt_common.h"

void zt_opt_adamw_unit(const zt_kernels_t *k, const zt_layout_t *l, const zt_opt_config_t *o,
                       int u, size_t lo, size_t n, float *p, const float *g, float *m, float *v,
                       float lr, int64_t t) {
  if (!n) return;
  float bc1 = 1.0f - powf(o->beta1, (float)t), bc2 = 1.0f - powf(o->beta2, (float)t);
  for (int i = 0; i < l->num_tensors; i++) {
    const zt_tensor_t *tn = &l->tensors[i];
    if (tn->unit != u) continue;
    size_t a = ZT_MAX(tn->unit_off, lo), b = ZT_MIN(tn->unit_off + tn->n, lo + n);
    if (a >= b) continue;
    k->adamw(p + (a - lo), g + (a - lo), m + (a - lo), v + (a - lo), b - a, lr, o->beta1,
             o->beta2, o->eps, tn->decay ? o->weight_decay : 0.0f, bc1, bc2);
  }
}

/* Appends segment [.., end) (relative to the range's start) to a; -1 when
 * a is full. */
static int add_seg(zt_adamw_args_t *a, size_t end, float wd, int skip) {
  if (a->n == ZT_ADAMW_SEGS) return -1;
  a->end[a->n] = end;
  a->wd[a->n] = wd;
  if (skip) a->skip |= 1u << a->n;
  a->n++;
  return 0;
}

int zt_opt_adamw_args(const zt_layout_t *l, const zt_opt_config_t *o, int u, size_t lo, size_t n,
                      float lr, int64_t t, zt_adamw_args_t *a) {
  memset(a, 0, sizeof *a);
  a->lr = lr, a->b1 = o->beta1, a->b2 = o->beta2, a->eps = o->eps;
  a->bc1 = 1.0f - powf(o->beta1, (float)t), a->bc2 = 1.0f - powf(o->beta2, (float)t);
  size_t pos = lo;
  for (int i = 0; i < l->num_tensors; i++) {
    const zt_tensor_t *tn = &l->tensors[i];
    if (tn->unit != u) continue;
    size_t b0 = ZT_MAX(tn->unit_off, lo), b1 = ZT_MIN(tn->unit_off + tn->n, lo + n);
    if (b0 >= b1) continue;
    if (b0 < pos) return -1; /* not in order: the caller takes the unfused path */
    if (b0 > pos && add_seg(a, b0 - lo, 0.0f, 1) != 0) return -1;
    if (add_seg(a, b1 - lo, tn->decay ? o->weight_decay : 0.0f, 0) != 0) return -1;
    pos = b1;
  }
  if (pos < lo + n && add_seg(a, n, 0.0f, 1) != 0) return -1;
  return a->n > 0 ? 0 : -1;
}

float zt_opt_clip_coef(double sumsq, float max_norm, float *norm) {
  double nrm = sqrt(sumsq);
  if (norm) *norm = (float)nrm;
  if (max_norm <= 0.0f || !isfinite(nrm) || nrm <= max_norm) return 1.0f;
  return (float)(max_norm / (nrm + 1e-6));
}

float zt_lr_at(const zt_lr_sched_t *s, float base_lr, long step, float mult) {
  if (!s || !s->enabled) return base_lr * mult;
  double lo = s->min_lr, hi = s->max_lr, lr;
  if (step < s->warmup_steps) {
    lr = lo + (hi - lo) * (double)(step + 1) / (double)s->warmup_steps;
  } else if (step < s->total_steps) {
    double p = (double)(step - s->warmup_steps) / (double)(s->total_steps - s->warmup_steps);
    lr = lo + (hi - lo) * 0.5 * (1.0 + cos(M_PI * p));
  } else {
    lr = lo;
  }
  return (float)(lr * mult);
}
