/*
 * spec.h: the job spec, a JSON document in DeepSpeed's style.
 *
 * The spec says everything about a training job: model shape, data, batch,
 * optimizer, schedule, evaluation, and the settings of later subsystems
 * (ZeRO stage, elastic range, checkpoints, rollback, bf16, comm timeout,
 * fault injection). zt_spec_parse validates all of it at once: unknown keys
 * anywhere are an error naming the full key path ("optimizer.params.betaz:
 * unknown key"), and so are wrong types and out-of-range values ("steps:
 * expected an integer >= 1"). docs/engine.md lists every key with its
 * default.
 *
 * Batch sizes. train_micro_batch_size_per_gpu (micro) is required. The
 * global batch, in samples per optimizer step, is train_batch_size when
 * given, else micro * gradient_accumulation_steps (accum defaults to 1). It
 * stays fixed whatever the number of workers N: zt_spec_accum_for_world
 * recomputes accum = global / (micro * N) and fails when N does not divide.
 * When all three keys are given, train_batch_size must be micro * accum *
 * some integer world size.
 *
 * Paths. data.train and data.val are glob patterns, checkpoint.dir and
 * checkpoint.load directories. Each process confines them to its roots
 * (zcoord --data-root/--checkpoint-root at submit, zworker's at run time;
 * default: the working directory): a relative path is taken under the root,
 * an absolute one must lie under it, ".." is refused (zt_path_confine).
 */
#ifndef ZT_SPEC_H
#define ZT_SPEC_H

#include <stddef.h>
#include <stdint.h>

#include "layout.h"
#include "optim.h"

typedef struct zt_spec_ckpt {
  char dir[ZT_PATH_MAX]; /* empty: no checkpoints */
  long every_steps;           /* 0: only on demand */
  int keep_last;
  long keep_every;            /* 0: none kept forever */
  char load[ZT_PATH_MAX]; /* a committed epoch to start from (another job's); "" none */
  /* The risk budget while checkpoints fail (disk full): training goes on
   * until this many steps lie past the last committed epoch, then the job
   * pauses. Default 10 * every_steps (0 with every_steps 0: no limit). */
  long max_uncommitted_steps;
  /* Copies of every checkpoint file, on distinct hosts (at most as many as
   * the generation spans): the epoch commits only when they exist. 1: no
   * copies beyond the file itself (one host, or a shared directory). */
  int replicas;
  /* Every worker's checkpoint root is one shared directory (NFS, Lustre,
   * a cluster's parallel file system): no copies are made or tracked, an
   * epoch is loadable once committed, and every rank reads its files
   * where they were written. replicas is then 1. */
  int shared;
} zt_spec_ckpt_t;

/* elastic{...}'s restart policy (the coordinator's, sched.c): a generation
 * that fails is re-formed at once, then with exponential backoff from
 * backoff_ms up to max_backoff_ms while generations keep failing before any
 * step; after max_failed_generations such generations in a row, or
 * max_restarts failure re-forms within restart_window_s, the job pauses. */
typedef struct zt_spec_restart {
  int max_failed_generations;
  long backoff_ms, max_backoff_ms;
  int max_restarts;
  long restart_window_s;
} zt_spec_restart_t;

typedef struct zt_spec_rollback {
  int enabled;
  int window;
  double threshold;
  int patience;
  long margin_steps, skip_steps;
  double lr_factor;
  long cooldown_steps;
  int max_rollbacks;
  long per_steps;
} zt_spec_rollback_t;

/* fault_injection{...}: test-only; the LR of steps [from_step, to_step] is
 * multiplied by lr_scale (when > 0), in the first run of those steps only
 * (before any rollback) unless repeat is true; break_ring_at_step below. */
typedef struct zt_spec_fault {
  int present; /* the spec has a fault_injection object */
  double lr_scale;
  long from_step, to_step;
  int repeat;
  /* The last rank aborts its ring during this step, in every generation
   * (0: never): a transient failure that repeats. */
  long break_ring_at_step;
  /* The last rank aborts its ring in this step of the first generation,
   * after the gradients are reduced and before the optimizer step (0:
   * never): with stage 0's overlap the queued gathers of the scaled
   * gradient then fail with the updates still due, just before the
   * step's checkpoint snapshot. */
  long break_ring_before_update_at_step;
  /* Rank 0 reports each checkpoint epoch this much later (0: at once): its
   * peers' reports and pushed copies come first. */
  long delay_checkpoint_report_ms;
  /* The rank slow_rank spends slow_micro_ms more on each micro-batch it
   * computes (a slow machine, for load_balance's tests). */
  int slow_rank;
  long slow_micro_ms;
  /* DiLoCo with compression: the last rank corrupts its encoded
   * pseudo-gradient of this step (a value of -128, or int4's -8) before
   * it sends it, in the first generation only. */
  long corrupt_compressed_at_step;
  /* DiLoCo without compression: the last rank puts a NaN into its
   * pseudo-gradient of this step, in the first generation only, so the
   * outer step is refused everywhere. */
  long nan_pseudo_gradient_at_step;
} zt_spec_fault_t;

typedef struct zt_spec {
  char name[128];
  uint64_t seed;
  long steps;

  int micro_batch;  /* train_micro_batch_size_per_gpu */
  int accum;        /* gradient_accumulation_steps as given (1 if absent) */
  long global_batch; /* train_batch_size, or micro * accum */
  int have_train_batch;
  float grad_clip;  /* gradient_clipping; 0: off */

  zt_model_config_t model;
  zt_opt_config_t opt;
  zt_lr_sched_t sched;

  char train_glob[ZT_PATH_MAX];
  char val_glob[ZT_PATH_MAX]; /* empty: no validation */
  int eval_every;   /* steps between evaluations; 0: never */
  int eval_batches; /* micro batches per evaluation */

  /* init.from_safetensors: start from these weights (a Hugging Face GPT-2
   * safetensors file, engine/safetensors.h) instead of a random
   * initialisation; "" none. A checkpoint to resume from wins. */
  char init_from[ZT_PATH_MAX];
  /* init.from_pretrained instead: init_from is a Hugging Face model
   * directory (config.json, which must agree with model, and
   * model.safetensors or a sharded model.safetensors.index.json;
   * engine/hfdir.h). */
  int init_dir;
  /* init.lora_from: the adapters to start from (a PEFT
   * adapter_model.safetensors) instead of PEFT's initialisation; "" none.
   * The lora section itself is in model (lora_r, lora_alpha,
   * lora_targets). */
  char lora_from[ZT_PATH_MAX];

  int zero_stage;
  /* zero_optimization.overlap_comm (default true): stages 0-2 reduce each
   * unit's gradient on a communication thread as soon as backward has
   * finished it (engine/zero.h). */
  int overlap_comm;
  int min_workers, max_workers;
  zt_spec_restart_t restart; /* elastic{...} */
  zt_spec_ckpt_t ckpt;
  zt_spec_rollback_t rollback;
  int bf16;
  /* activation_checkpointing: true keeps only each layer's input and
   * recomputes the layer in backward (engine/model.h, ZT_MODEL_RECOMPUTE). */
  int act_ckpt;
  /* wall_clock_breakdown (DeepSpeed's key): each worker logs, per step,
   * how long it waited for communication (engine/zero.h, zt_zero_times_t). */
  int wall_clock_breakdown;
  long comm_timeout_ms;
  /* load_balance: a step's micro-batches (global batch / micro batch) in
   * equal shares (mode "equal", the default), or in shares that follow
   * each rank's measured speed (mode "speed": lb_speed 1), planned at the
   * generation's start from what each worker measured before and again
   * every lb_every steps (trainer.c). The shares change who computes which
   * micro-batch, never which samples a step holds: the losses are the
   * same either way. */
  int lb_speed;
  long lb_every;
  /* sync: how the workers' models meet. mode "sync" (the default,
   * diloco 0): every step reduces the gradients. mode "diloco" (diloco
   * 1): each worker is a group of its own that runs inner_steps AdamW
   * steps on its share of each step's batch, then the groups average the
   * change of their parameters since the last sync (the pseudo-gradient)
   * and apply the outer optimizer, SGD with (Nesterov) momentum
   * (trainer.c, docs/engine.md "Sync modes"). */
  int diloco;
  long inner_steps;
  double outer_lr, outer_momentum;
  int outer_nesterov;
  /* sync.compression: how DiLoCo's pseudo-gradient, or the gradient of
   * synchronous training at ZeRO stages 0-1, crosses the network: 0 as
   * it is, 1 bf16, 2 int8 with a scale per block, 3 int4 with a scale
   * per block and error feedback (DiLoCo only) (quant.h's zt_quant_t;
   * zero.h, diloco.h). */
  int compression;
  /* sync.overlap_steps (DiLoCo): the all-reduce of a round's
   * pseudo-gradient runs while the group trains on, landing this many
   * steps later (0: the groups wait for it; diloco.h). */
  long overlap_steps;
  /* sync.fragments F (DiLoCo; Streaming DiLoCo): the model's units in F
   * fragments of about equal size, each syncing on its own schedule,
   * inner_steps / F steps apart, so the network carries 1/F of the model
   * at a time (1: the whole model at each sync; diloco.h). */
  long fragments;
  /* sync.group_size S (DiLoCo): the workers of a group, S ranks in a row
   * (rank r is in group r / S), which train one model under ZeRO (the
   * spec's stage) over their own connections and meet the other groups
   * every inner_steps steps; a world size must be a multiple of S. 1: each
   * worker is a group of its own (stage 0). */
  long group_size;
  zt_spec_fault_t fault; /* fault_injection (tests only) */
} zt_spec_t;

struct cJSON;

/* Hugging Face's rope_scaling object of a llama config, as a job spec's
 * model.rope_scaling, a checkpoint manifest and config.json hold it:
 * absent or null (none), or {"rope_type": "llama3" (or "type"), "factor",
 * "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
 * into c's rope_* fields. Errors name `where` and the field; any other
 * rope_type is refused by name. */
ZT_MUST_CHECK int zt_spec_rope_parse(const struct cJSON *o, const char *where,
                                        zt_model_config_t *c);
/* The same object from c (a JSON null without scaling). */
struct cJSON *zt_spec_rope_json(const zt_model_config_t *c);
/* 1 when a and b have the same rope_scaling. */
int zt_spec_rope_same(const zt_model_config_t *a, const zt_model_config_t *b);
/* LoRA's target_modules (ZT_LORA_* bits) as PEFT lists them: a JSON array
 * of names, in a block's order (a manifest's lora, adapter_config.json). */
struct cJSON *zt_lora_targets_json(unsigned targets);

/* Parses and validates a spec from a string of len bytes. A spec holds no
 * allocated memory: it is a plain value. */
ZT_MUST_CHECK int zt_spec_parse(zt_spec_t *s, const char *json, size_t len);
/* Reads and parses a spec file; errors are prefixed with the path. */
ZT_MUST_CHECK int zt_spec_load(zt_spec_t *s, const char *path);

/* Accumulation steps for `world` workers: global / (micro * world), an error
 * when that is not an integer or more than ZT_SPEC_MAX_ACCUM. With shares by
 * speed (load_balance.mode "speed") any world of at most global / micro
 * workers will do, and *accum is the most micro-batches of one worker
 * under equal shares (rounded up). */
#define ZT_SPEC_MAX_ACCUM (1 << 20)
ZT_MUST_CHECK int zt_spec_accum_for_world(const zt_spec_t *s, int world, int *accum);

#endif
