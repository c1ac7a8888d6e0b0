/*
 * optim.h: AdamW over a range of the flat parameter buffer, global gradient
 * norm clipping, and the learning-rate schedule.
 *
 * AdamW. One zt_opt_t updates the elements [off, off + n) of the model's
 * flat buffer (model.h), holding the first and second moments m and v for
 * exactly that range. A single process uses the whole buffer; a ZeRO rank
 * uses one zt_opt_t per shard it owns. Weight decay is decoupled (PyTorch's
 * AdamW: p -= lr * wd * p before the Adam step) and, as in GPT-2 and
 * nanoGPT practice, applies only to 2-D weights: the four matmul weights of
 * each block and the two embedding tables (wte, wpe). Biases and LayerNorm
 * parameters are not decayed. The range is split at create time into
 * segments of constant decay, derived from the model's named views.
 *
 * Clipping. The caller supplies the GLOBAL sum of squares of the gradient
 * (a single process: kernels->sumsq over its buffer; ZeRO: an all-reduce of
 * each rank's shard sum), and zt_opt_clip_coef turns it into the norm and
 * the factor that scales the gradient to at most max_norm.
 *
 * Schedule (DeepSpeed's WarmupDecayLR parameters): for step s (0-based,
 * the step being computed),
 *
 *   s < W:          lr = min + (max - min) * (s + 1) / W         linear warmup
 *   W <= s < S:     lr = min + (max - min) * (1 + cos(pi p)) / 2,
 *                   p = (s - W) / (S - W)                         cosine decay
 *   s >= S:         lr = min
 *
 * with W = warmup_num_steps, S = total_num_steps. DeepSpeed decays linearly;
 * ztrain decays with a cosine (nanoGPT, llm.c), which trains small GPTs
 * better. Only "warmup_type": "linear" is accepted. The result is multiplied
 * by an lr multiplier supplied per step (rollback cooldowns).
 */
#ifndef ZT_OPTIM_H
#define ZT_OPTIM_H

#include <stddef.h>

#include "model.h"
#include "zt_kernels.h"

typedef struct zt_opt_config {
  float lr; /* used when there is no schedule */
  float beta1, beta2, eps, weight_decay;
} zt_opt_config_t;

typedef struct zt_opt_segment {
  size_t start, n; /* relative to the optimizer's range */
  int decay;
} zt_opt_segment_t;

typedef struct zt_opt {
  zt_opt_config_t cfg;
  size_t off, n;        /* range of the flat buffer */
  float *m, *v;         /* [n] moments */
  long t;               /* number of updates done (bias correction) */
  zt_opt_segment_t *segs;
  int nsegs;
} zt_opt_t;

typedef struct zt_lr_sched {
  int enabled;          /* 0: constant lr (the optimizer's) */
  float min_lr, max_lr;
  long warmup_steps, total_steps;
} zt_lr_sched_t;

/* Creates the optimizer state for [off, off + n) of the model's flat
 * buffer (moments zeroed, t = 0). */
int zt_opt_create(zt_opt_t *o, const zt_opt_config_t *cfg, const zt_model_t *m, size_t off,
                  size_t n);
void zt_opt_free(zt_opt_t *o);

/* One AdamW update. params and grads point at element `off` of the flat
 * buffers (i.e. at the range itself). */
void zt_opt_step(zt_opt_t *o, const zt_kernels_t *k, float *params, const float *grads, float lr);

/* From the global sum of squares: *norm = sqrt(sumsq); returns the factor
 * to multiply the gradient by: min(1, max_norm / (norm + 1e-6)), or 1 when
 * max_norm <= 0 (no clipping). A non-finite norm returns 1 (the caller sees
 * the norm and decides). */
float zt_opt_clip_coef(double sumsq, float max_norm, float *norm);

/* The learning rate of step s (0-based), times mult. */
float zt_lr_at(const zt_lr_sched_t *s, float base_lr, long step, float mult);

#endif
