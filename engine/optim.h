/*
 * optim.h: AdamW over a range of a unit, global gradient norm clipping, and
 * the learning-rate schedule.
 *
 * AdamW. The update itself is the kernel table's adamw; zt_opt_adamw_unit
 * applies it to the elements [lo, lo + n) of one unit (a ZeRO rank's shard,
 * or the whole unit), one call per named tensor the range touches, so that
 * weight decay follows the tensor: as in GPT-2 and nanoGPT practice it
 * applies only to 2-D weights (the four matmul weights of each block and
 * the two embedding tables wte, wpe), never to biases or LayerNorm
 * parameters. Decay is decoupled (PyTorch's AdamW: p -= lr * wd * p before
 * the Adam step).
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
#include <stdint.h>

#include "layout.h"
#include "zt_kernels.h"

typedef struct zt_opt_config {
  float lr; /* used when there is no schedule */
  float beta1, beta2, eps, weight_decay;
} zt_opt_config_t;

typedef struct zt_lr_sched {
  int enabled;          /* 0: constant lr (the optimizer's) */
  float min_lr, max_lr;
  long warmup_steps, total_steps;
} zt_lr_sched_t;

/* One AdamW update (step t, 1-based, for the bias correction) of the
 * elements [lo, lo + n) of unit u. p, g, m and v point at element lo of the
 * unit's parameters, fp32 gradient and moments, all in the kernel table's
 * memory. */
void zt_opt_adamw_unit(const zt_kernels_t *k, const zt_layout_t *l, const zt_opt_config_t *o,
                       int u, size_t lo, size_t n, float *p, const float *g, float *m, float *v,
                       float lr, int64_t t);

/* The segments and settings of an adamw_fused call (zt_kernels.h) that
 * does what zt_opt_adamw_unit does on [lo, lo + n) of unit u, where the
 * range lies in at most ZT_ADAMW_SEGS segments (its tensors' parts and the
 * padding between or after them). -1 when it does not (the caller makes
 * the unfused calls). */
int zt_opt_adamw_args(const zt_layout_t *l, const zt_opt_config_t *o, int u, size_t lo, size_t n,
                      float lr, int64_t t, zt_adamw_args_t *a);

/* From the global sum of squares: *norm = sqrt(sumsq); returns the factor
 * to multiply the gradient by: min(1, max_norm / (norm + 1e-6)), or 1 when
 * max_norm <= 0 (no clipping). A non-finite norm returns 1 (the caller sees
 * the norm and decides). */
float zt_opt_clip_coef(double sumsq, float max_norm, float *norm);

/* The learning rate of step s (0-based), times mult. */
float zt_lr_at(const zt_lr_sched_t *s, float base_lr, long step, float mult);

#endif
