/*
 * jspec.h: the job spec, a JSON document with DeepSpeed-style keys.
 *
 *   {
 *     "name": "tiny", "seed": 1, "steps": 300,
 *     "model": {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 64, "vocab_size": 257},
 *     "data": {"train": "data/tiny_train_*.bin", "val": "data/tiny_val_*.bin"},
 *     "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
 *     "train_batch_size": 8, "gradient_clipping": 1.0,
 *     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
 *                   "eps": 1e-8, "weight_decay": 0.1}},
 *     "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0,
 *                   "warmup_max_lr": 1e-3, "warmup_num_steps": 20, "total_num_steps": 300}},
 *     "eval": {"every_steps": 50, "batches": 4},
 *     "zero_optimization": {"stage": 2},
 *     "elastic": {"min_workers": 2, "max_workers": 4},
 *     "checkpoint": {"dir": "ckpt", "every_steps": 50, "keep_last": 2, "keep_every": 0,
 *                    "load": "other/job_1/step_00000030-g1"},
 *     "rollback": {"enabled": true, ...}, "bf16": {"enabled": false},
 *     "comm": {"timeout_ms": 30000}
 *   }
 *
 * Every key is checked: an unknown key, a wrong type or a value out of
 * range is an error naming the full key path ("optimizer.params.betas").
 * train_batch_size is in samples and is the fixed global batch: with N
 * workers, accumulation = train_batch_size / (micro * N). When the spec
 * gives train_batch_size and gradient_accumulation_steps both, they must
 * agree for the world size they were written for (min_workers).
 */
#ifndef ZT_JSPEC_H
#define ZT_JSPEC_H

#include <stdint.h>

typedef struct {
  int n_layer, n_head, n_embd, seq_len, vocab_size;
} zt_jspec_model;

typedef struct {
  char name[128];
  uint64_t seed;
  int64_t steps;
  zt_jspec_model model;
  char train[512], val[512];
  int micro;
  int64_t global_batch; /* samples per step, all ranks together */
  double clip;          /* 0: no clipping */
  double lr, beta1, beta2, eps, weight_decay;
  double warmup_min_lr, warmup_max_lr;
  int64_t warmup_steps, decay_steps;
  int64_t eval_every;
  int eval_batches;
  int zero_stage;
  int min_workers, max_workers;
  char ckpt_dir[400];
  char ckpt_load[512]; /* an epoch directory to start from (another job's) */
  int64_t ckpt_every, keep_last, keep_every;
  int bf16;
  int64_t comm_timeout_ms;
  /* fault_injection (tests only): scale the LR for steps [from, to] of
   * the first run (before any rollback). */
  double fi_lr_scale;
  int64_t fi_from, fi_to;
} zt_jspec;

/* Parses and validates; -1 with a message naming the key on error. */
int zt_jspec_parse(const char *json, zt_jspec *out);
/* Accumulation steps for `world` ranks; -1 with a message if it does not
 * divide. */
int zt_jspec_accum(const zt_jspec *s, int world);
/* Learning rate of 1-based step s (linear warmup from warmup_min_lr to
 * warmup_max_lr, then cosine decay back to warmup_min_lr at decay_steps). */
double zt_jspec_lr(const zt_jspec *s, int64_t step);

#endif
