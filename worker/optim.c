/*
 * optim.c: AdamW on a range of the flat buffer, clipping, LR schedule.
 *
 * See optim.h for the formulas. The update itself is the kernel table's
 * adamw, called once per constant-decay segment of the range.
 */
#include "optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "zt_common.h"

/* Appends [start, start + n) with the given decay, merging with the
 * previous segment when the decay is the same. */
static void add_segment(zt_opt_t *o, size_t start, size_t n, int decay) {
  if (n == 0) return;
  if (o->nsegs > 0) {
    zt_opt_segment_t *last = &o->segs[o->nsegs - 1];
    if (last->decay == decay && last->start + last->n == start) {
      last->n += n;
      return;
    }
  }
  o->segs[o->nsegs++] = (zt_opt_segment_t){start, n, decay};
}

int zt_opt_create(zt_opt_t *o, const zt_opt_config_t *cfg, const zt_model_t *m, size_t off,
                  size_t n) {
  memset(o, 0, sizeof *o);
  if (off + n > m->num_params)
    return zt_err("optimizer range [%zu, %zu) exceeds the %zu parameters", off, off + n,
                  m->num_params);
  o->cfg = *cfg;
  o->off = off;
  o->n = n;
  o->m = calloc(n ? n : 1, sizeof(float));
  o->v = calloc(n ? n : 1, sizeof(float));
  o->segs = calloc((size_t)m->num_tensors, sizeof(zt_opt_segment_t));
  if (!o->m || !o->v || !o->segs) {
    zt_opt_free(o);
    return zt_err("out of memory for optimizer state (%zu elements)", n);
  }
  /* Tensors tile the flat buffer in order: intersect each with the range. */
  for (int i = 0; i < m->num_tensors; i++) {
    const zt_tensor_t *t = &m->tensors[i];
    size_t lo = ZT_MAX(t->off, off), hi = ZT_MIN(t->off + t->n, off + n);
    if (lo < hi) add_segment(o, lo - off, hi - lo, t->decay);
  }
  return 0;
}

void zt_opt_free(zt_opt_t *o) {
  free(o->m);
  free(o->v);
  free(o->segs);
  memset(o, 0, sizeof *o);
}

void zt_opt_step(zt_opt_t *o, const zt_kernels_t *k, float *params, const float *grads,
                 float lr) {
  o->t++;
  float b1 = o->cfg.beta1, b2 = o->cfg.beta2;
  float bc1 = 1.0f - powf(b1, (float)o->t), bc2 = 1.0f - powf(b2, (float)o->t);
  for (int i = 0; i < o->nsegs; i++) {
    const zt_opt_segment_t *s = &o->segs[i];
    float wd = s->decay ? o->cfg.weight_decay : 0.0f;
    k->adamw(params + s->start, grads + s->start, o->m + s->start, o->v + s->start, s->n, lr, b1,
             b2, o->cfg.eps, wd, bc1, bc2);
  }
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
