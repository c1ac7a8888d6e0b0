/*
 * trainer.c: one generation of data-parallel training (see trainer.h).
 *
 * zt_gen_train() is four steps, each a function below:
 *
 *   set_up          parse the spec, pick the kernels for the device, build
 *                   the model, open the data, lay out the ZeRO states;
 *   load_or_init    start from the state kept in memory (live.c), load
 *                   the epoch the caller named, or initialise afresh;
 *   train_step      one optimizer step: micro-steps of forward + backward,
 *                   the gradient reduction, one small all-reduce of
 *                   [loss, grad sum of squares, non-finite flag,
 *                   checkpoint flag] so that every rank takes the same
 *                   decisions, clipping, AdamW, the parameter gather, and
 *                   an evaluation when one is due;
 *   checkpoint      the decision to write an epoch (on schedule, or when the
 *                   caller asked for one through rank 0), and the hand-over
 *                   to the writer thread (ckpt_writer.c).
 *
 * Load balance (spec.h load_balance, docs/engine.md "Work shared by
 * speed"). A step is K = global batch / micro batch micro-batches; rank r
 * computes share[r] of them. Equal shares (K / N each) take micro-batch
 * j * N + r as the rank's j-th; shares by speed give rank r the run of
 * micro-batches from first[r] on. Either way the step holds the same
 * samples, each micro-batch of the same mb samples, and the gradient sum
 * is fp64 (zero.h), so the losses do not depend on the shares. Each rank
 * measures its compute time per micro-batch (the wall time of its
 * micro-steps less what it waited for ZeRO's collectives); every
 * lb_every steps the step's control all-reduce carries every rank's
 * measure, and every rank computes the same new plan from the same
 * numbers (balance.h), adopted only when it shortens the step's
 * predicted compute time by ZT_LB_MIN_GAIN. Stages 2-3 reduce in every
 * micro-step, so a rank with fewer micro-batches than the most runs
 * ZeRO's hooks alone for the rest (zt_model_hook_pass): the same
 * collectives, zero gradients, no compute. The worker keeps its measure
 * across generations (zt_gen_ctx_t.micro_ms), so a new generation starts
 * from a plan by speed.
 *
 * The ZeRO sharding itself (which rank holds what, the hooks that gather
 * and reduce unit by unit, whether the communication thread runs) is
 * zero.h's, whose state the trainer reads only through its functions.
 */
#include "trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "balance.h"
#include "ckpt_io.h"
#include "data.h"
#include "diloco.h"
#include "memplan.h"
#include "device.h"
#include "model.h"
#include "optim.h"
#include "hfdir.h"
#include "live.h"
#include "lora.h"
#include "safetensors.h"
#include "spec.h"
#include "tokenizer.h"
#include "zero.h"
#include "zt_common.h"
#include "zt_kernels.h"

/* Load balance: the least gain in predicted step time that changes a plan. */
#define ZT_LB_MIN_GAIN 0.05

typedef struct {
  const zt_gen_ctx_t *g;
  zt_spec_t spec;
  zt_model_config_t cfg;
  zt_model_t *m;          /* computes: the model, or LoRA's base (lora.h) */
  zt_model_t *ad;         /* LoRA: the adapters, which ZeRO trains; else NULL */
  zt_lora_t *lora;
  uint64_t base_hash;     /* LoRA: XXH64 of the base's fp32 parameters ... */
  char base_sum[32];      /* ... as checkpoints write it ("xxh64:...") */
  char base_path[ZT_PATH_MAX];    /* ... and the base's real path (zt_ckpt_meta_t.lora_base) */
  const zt_kernels_t *k;
  zt_zero_t *z;           /* this rank's ZeRO state (NULL until set_up makes it) */
  zt_data_t *train, *val;
  char tok_record[ZT_PATH_MAX]; /* the training data's tokenizer record, or "" */
  int *inp, *tgt;
  zt_ckpt_writer_t *writer; /* started at the first checkpoint */
  zt_memplan_need_t need; /* what one rank needs (memplan.h) */
  int N, r, accum, mb, T;
  /* Load balance (above): each rank's micro-batches of a step, the first
   * one's index in the step, the most any rank has, whether the shares
   * differ, and this rank's compute time over its micro-batches since
   * the last plan. */
  int K, share[ZT_LB_MAX_RANKS], first[ZT_LB_MAX_RANKS], rounds, uneven, plan_new;
  double lb_ms;
  int64_t lb_n;
  int64_t tmo;
  /* DiLoCo (sync.mode "diloco", diloco.h): the outer state, and this
   * round's inner steps so far: each one's loss and gradient sum of
   * squares (rl[2i], rl[2i + 1]), LR and wall time. */
  zt_diloco_t dl;
  int have_dl, rn;
  /* sync.group_size S > 1: G groups of S ranks in a row; this rank is
   * place li of group gi. Its ZeRO state is the group's, over the view of
   * the group's ranks (intra); the outer all-reduce runs over the view of
   * the ranks at its place in every group (places). NULL with S = 1. */
  int S, G, gi, li;
  zt_comm_t *intra, *places;
  int64_t land_at; /* an overlapped round lands after this step (0: none) */
  double *rl, *rlr, *rms;
  /* Outer steps refused (a pseudo-gradient that is not finite) since
   * rank 0's last report, which carries the count to the coordinator. */
  int refused;
  /* The failure was another rank's (its validation batch), which says
   * why: reported as a peer's, so that the coordinator weighs that rank's
   * own (local) report, not this one. */
  int peer_fault;
  /* The generation's record (live.h), and the last step done whole (its
   * update held or queued: stage 0's is all or none, zero.h
   * zt_zero_full_get; its evaluation run and its report noted); 0: none,
   * or a step is between its update and its report. */
  zt_live_t *lv;
  int64_t live_at;
} trainer;

/* What one step produced. */
typedef struct {
  double loss, norm, lr, val_loss, ms;
  int nonfinite;
  int ckpt_requested; /* some rank's caller asked for a checkpoint (ctl[3]) */
  int ckpt_busy;      /* ranks whose previous epoch was still in flight (ctl[4]) */
  int64_t ckpt_prev;  /* this rank's epoch in flight at the vote, or 0 */
} step_result;

/* ---- set-up ------------------------------------------------------------------ */

/* The spec's paths under the worker's roots (when it has them): the data
 * patterns and the checkpoint directory, rewritten in place. */
static int confine(trainer *t) {
  const zt_gen_ctx_t *g = t->g;
  zt_spec_t *s = &t->spec;
  char tmp[ZT_PATH_MAX];
  struct {
    const char *root, *what;
    char *path;
  } paths[] = {{g->data_root, "data.train", s->train_glob},
               {g->data_root, "data.val", s->val_glob},
               {g->data_root, s->init_dir ? "init.from_pretrained" : "init.from_safetensors", s->init_from},
               {g->data_root, "init.lora_from", s->lora_from},
               {g->ckpt_root, "checkpoint.dir", s->ckpt.dir}};
  for (size_t i = 0; i < ZT_ARRAY_LEN(paths); i++) {
    if (!paths[i].root || !paths[i].path[0]) continue;
    if (zt_path_confine(paths[i].root, paths[i].path, paths[i].what, tmp, sizeof tmp) != 0)
      return -1;
    memcpy(paths[i].path, tmp, sizeof tmp);
  }
  return 0;
}

/* The tokenizer record zprep wrote beside the first training shard
 * (PREFIX_train_NNNNNN.bin -> PREFIX_tokenizer.json), if there is one: the
 * checkpoint manifest names it for export and sampling. */
static void tokenizer_record(trainer *t, const char *shard) {
  char rec[ZT_PATH_MAX], real[ZT_PATH_MAX];
  t->tok_record[0] = 0;
  if (zt_tok_record_for_shard(shard, rec, sizeof rec) != 0) return;
  if (access(rec, R_OK) == 0 && realpath(rec, real) && strlen(real) < sizeof t->tok_record)
    snprintf(t->tok_record, sizeof t->tok_record, "%s", real);
}

/* Opens the shards of a pattern; with a data root, every file must really
 * lie under it (no symbolic link out). */
static int open_shards(trainer *t, const char *pattern, const char *what, zt_data_t **out) {
  char **paths;
  int n;
  if (zt_data_glob(pattern, &paths, &n) != 0) return zt_err_wrap("%s", what);
  int rc = 0;
  for (int i = 0; i < n && rc == 0; i++)
    if (t->g->data_root && !zt_path_real_under(t->g->data_root, paths[i]))
      rc = zt_errk(ZT_E_INVALID, "%s: %s leads outside the data root %s", what, paths[i],
                   t->g->data_root);
  if (rc == 0) rc = zt_data_open(out, paths, n, t->T, t->cfg.vocab_size, t->spec.seed);
  if (rc == 0 && out == &t->train) tokenizer_record(t, paths[0]);
  zt_data_free_paths(paths, n);
  return rc;
}

static int open_data(trainer *t) {
  const zt_gen_ctx_t *g = t->g;
  if (open_shards(t, t->spec.train_glob, "data.train", &t->train) != 0) return -1;
  if (g->nskips && zt_data_set_skips(t->train, g->skips, g->nskips) != 0) return -1;
  if (t->spec.val_glob[0] && t->spec.eval_every &&
      open_shards(t, t->spec.val_glob, "data.val", &t->val) != 0)
    return -1;
  if (t->val && zt_data_num_samples(t->val) < (uint64_t)t->mb)
    return zt_err("data.val %s: %llu samples of %d tokens, fewer than one micro batch (%d)",
                  t->spec.val_glob, (unsigned long long)zt_data_num_samples(t->val), t->T,
                  t->mb);
  return 0;
}

/* The job's per-rank need (memplan.h) against the worker's budget: a job
 * that cannot fit fails here, naming both, instead of being killed by the
 * kernel half-way through allocating. */
static int check_memory(trainer *t) {
  const zt_gen_ctx_t *g = t->g;
  if (zt_memplan_need(&t->spec, t->N, &t->need) != 0) return zt_err_wrap("memory estimate");
  int gpu = t->k != zt_kernels_cpu();
  uint64_t device = gpu ? (g->device_memory ? g->device_memory : UINT64_MAX) : 0;
  if (zt_memplan_fits(&t->need, g->host_memory, device)) return 0;
  char need[32], have[32], dneed[32], dhave[32];
  if (gpu && device < t->need.device)
    return zt_errk(ZT_E_NO_MEMORY,
                   "out of memory: one rank of this job needs %s of GPU memory at world size %d "
                   "(ZeRO stage %d), the device has %s",
                   zt_memplan_text(t->need.device, dneed, sizeof dneed), t->N, t->spec.zero_stage,
                   zt_memplan_text(device, dhave, sizeof dhave));
  uint64_t want = gpu ? t->need.host_with_device : t->need.host;
  return zt_errk(ZT_E_NO_MEMORY,
                 "out of memory: one rank of this job needs %s of host memory at world size %d "
                 "(ZeRO stage %d; states %s), this worker may use %s (zworker --memory)",
                 zt_memplan_text(want, need, sizeof need), t->N, t->spec.zero_stage,
                 zt_memplan_text(t->need.states, dneed, sizeof dneed),
                 zt_memplan_text(g->host_memory, have, sizeof have));
}

/* ---- load balance (see the top of the file) -------------------------------------- */

/* The shares as they are: first[], the most, and whether they differ. */
static void set_shares(trainer *t, const int *share) {
  t->rounds = 0, t->uneven = 0;
  for (int i = 0, at = 0; i < t->N; i++) {
    t->share[i] = share[i], t->first[i] = at;
    at += share[i];
    t->rounds = ZT_MAX(t->rounds, share[i]);
    t->uneven |= share[i] != share[0];
  }
}

/* A new plan from v: each rank's compute ms (v[i]) over its micro-batches
 * (v[N + i]), as an all-reduce summed them (every rank wrote its own two).
 * Kept when it is not ZT_LB_MIN_GAIN faster, or when a rank measured
 * nothing. `when` says when for the log. */
static void replan(trainer *t, const double *v, const char *when) {
  int N = t->N, next[ZT_LB_MAX_RANKS];
  double speed[ZT_LB_MAX_RANKS];
  if (t->lb_n > 0 && t->g->micro_ms) *t->g->micro_ms = t->lb_ms / (double)t->lb_n;
  t->lb_ms = 0, t->lb_n = 0;
  for (int i = 0; i < N; i++) {
    if (!(v[N + i] >= 1) || !(v[i] > 0)) return;
    speed[i] = v[N + i] / v[i];
  }
  int lockstep = zt_zero_view(t->z)->stage >= 2;
  zt_balance_plan(t->K, N, speed, lockstep, next);
  double was = zt_balance_ms(N, t->share, speed, lockstep);
  double now = zt_balance_ms(N, next, speed, lockstep);
  if (now > was * (1.0 - ZT_LB_MIN_GAIN)) return;
  if (t->r == 0) {
    char a[256], b[256];
    size_t na = 0, nb = 0;
    for (int i = 0; i < N && na < sizeof a - 12 && nb < sizeof b - 12; i++) {
      na += (size_t)snprintf(a + na, sizeof a - na, "%s%d", i ? "," : "", next[i]);
      nb += (size_t)snprintf(b + nb, sizeof b - nb, "%s%d", i ? "," : "", t->share[i]);
    }
    ZT_INFO("load balance %s: micro-batches per rank %s (was %s): compute %.1f ms a step "
            "(was %.1f)", when, a, b, now, was);
  }
  set_shares(t, next);
  t->plan_new = 1; /* for the coordinator, with the next step report */
}

/* The step ends with a plan (its control all-reduce carries the measures). */
static int plan_due(const trainer *t, int64_t s) {
  return t->spec.lb_speed && t->N > 1 && s % t->spec.lb_every == 0;
}

/* The generation's first plan: equal shares, or by speed from what each
 * worker measured before (zt_gen_ctx_t.micro_ms; equal while one has not). */
static int first_plan(trainer *t) {
  int share[ZT_LB_MAX_RANKS];
  for (int i = 0; i < t->N; i++) share[i] = t->K / t->N + (i < t->K % t->N);
  set_shares(t, share);
  if (!t->spec.lb_speed || t->N == 1) return 0;
  double v[2 * ZT_LB_MAX_RANKS] = {0};
  double ms = t->g->micro_ms ? *t->g->micro_ms : 0;
  if (ms > 0) v[t->r] = ms, v[t->N + t->r] = 1;
  if (zt_zero_host_all_reduce(t->z, v, 2 * (size_t)t->N, ZT_DT_F64) != 0)
    return zt_err_wrap("load balance: the workers' speeds");
  replan(t, v, "at the generation's start");
  return 0;
}

/* Everything before the first step. *fault says who is to blame. */
/* DiLoCo's groups (sync.group_size S): rank r is place r % S of group
 * r / S; with S > 1, the views of its group's ranks and of its place's. */
static int set_up_groups(trainer *t) {
  t->S = (int)t->spec.group_size, t->G = t->N / t->S;
  t->gi = t->r / t->S, t->li = t->r % t->S;
  if (t->S == 1) return 0;
  int ranks[ZT_LB_MAX_RANKS];
  for (int i = 0; i < t->S; i++) ranks[i] = t->gi * t->S + i;
  if (zt_comm_view(t->g->comm, ranks, t->S, &t->intra) != 0)
    return zt_err_wrap("sync.group_size %d: group %d", t->S, t->gi);
  for (int i = 0; i < t->G; i++) ranks[i] = i * t->S + t->li;
  if (zt_comm_view(t->g->comm, ranks, t->G, &t->places) != 0)
    return zt_err_wrap("sync.group_size %d: the ranks at place %d of every group", t->S, t->li);
  if (t->r == 0)
    ZT_INFO("diloco: %d groups of %d ranks (ZeRO stage %d inside each); the outer all-reduce "
            "runs among the ranks at the same place in every group", t->G, t->S,
            t->spec.zero_stage);
  return 0;
}

/* The rank whose micro-batches this one computes: itself, or with DiLoCo
 * groups of S ranks place li of group gi takes the data rank li G + gi, so
 * a group computes exactly the micro-batches one worker of G groups would
 * (micro-batch j N + r of a step: data.c). */
static int data_rank(const trainer *t) {
  return t->intra ? t->li * t->G + t->gi : t->r;
}

/* An all-reduce of host values over every rank of the generation: z's
 * communicator, or the whole one when z's is a DiLoCo group's, once z's
 * own traffic is done (their sockets are partly the same). */
static int all_ranks_reduce(trainer *t, double *v, size_t n) {
  if (!t->intra) return zt_zero_host_all_reduce(t->z, v, n, ZT_DT_F64);
  if (zt_zero_settle(t->z) != 0) return -1;
  return zt_comm_all_reduce(t->g->comm, v, n, ZT_DT_F64, ZT_RED_SUM, t->tmo);
}

static int set_up(trainer *t, zt_train_fault_t *fault) {
  const zt_gen_ctx_t *g = t->g;
  *fault = ZT_FAULT_JOB;
  if (zt_spec_parse(&t->spec, g->spec_json, strlen(g->spec_json)) != 0)
    return zt_err_wrap("job spec");
  if (confine(t) != 0) return -1;
  t->cfg = t->spec.model;
  t->T = t->cfg.seq_len;
  t->mb = t->spec.micro_batch;
  if (zt_spec_accum_for_world(&t->spec, t->N, &t->accum) != 0) return -1;
  t->K = (int)(t->spec.global_batch / t->mb);
  if (t->N > ZT_LB_MAX_RANKS)
    return zt_err("%d workers: at most %d take part in one job", t->N, ZT_LB_MAX_RANKS);
  t->k = zt_device_kernels(g->device, t->spec.bf16);
  if (!t->k) { /* this worker's fault, not the job's */
    *fault = ZT_FAULT_LOCAL;
    return zt_err_wrap("device");
  }
  if (g->threads > 0) zt_kernels_cpu_set_threads(g->threads);
  *fault = ZT_FAULT_MEMORY;
  if (check_memory(t) != 0) return -1;
  *fault = ZT_FAULT_JOB;
  /* With LoRA the model computes with the base configuration, and a shell
   * of the adapters' is what ZeRO trains (lora.h). */
  zt_model_config_t base = zt_model_config_base(&t->cfg);
  if (zt_model_create(&t->m, &base, t->mb, t->T, t->k,
                      ZT_MODEL_NO_PARAMS | ZT_MODEL_NO_GRADS |
                          (t->spec.act_ckpt ? ZT_MODEL_RECOMPUTE : 0)) != 0 ||
      (t->cfg.lora_r && zt_model_create(&t->ad, &t->cfg, 1, t->T, t->k,
                                        ZT_MODEL_NO_PARAMS | ZT_MODEL_NO_GRADS |
                                            ZT_MODEL_SHELL) != 0)) {
    if (zt_err_kind() == ZT_E_NO_MEMORY) *fault = ZT_FAULT_MEMORY;
    return zt_err_wrap("model");
  }
  /* A shard this worker cannot read (a data root not mounted here, a
   * half-copied file, EMFILE, EIO) is its own failure, not the job's:
   * only a shard that is no shard, or a path out of the root, is the
   * job's (ZT_E_INVALID), since every rank would find the same. */
  if (open_data(t) != 0) {
    if (zt_err_kind() != ZT_E_INVALID) *fault = ZT_FAULT_LOCAL;
    return -1;
  }
  /* Test knob: CPU workers stage collectives as the device path does. */
  int dev = t->k != zt_kernels_cpu() || zt_knob(ZT_KNOB_STAGE_COLLECTIVES, 0) == 1;
  int overlap;
  if (zt_zero_agree_overlap(g->comm, t->N, t->spec.overlap_comm, dev, t->tmo, &overlap) != 0) {
    *fault = ZT_FAULT_PEER;
    return -1;
  }
  zt_zero_opts_t zo = {.rank = t->r, .world = t->N, .stage = t->spec.zero_stage, .dev = dev,
                       .timeout_ms = t->tmo,
                       .inv_k = (double)t->mb / (double)t->spec.global_batch,
                       .accum = t->spec.lb_speed && t->N > 1 ? 0 : t->accum,
                       .overlap = overlap,
                       .stream_overlap = t->spec.overlap_comm,
                       .compress = t->spec.diloco ? 0 : t->spec.compression};
  /* DiLoCo: a group (one rank, or S in a row with ZeRO among them)
   * averages its gradients over its own micro-batches (the data positions
   * follow group_rank()). */
  if (t->spec.diloco) {
    if (set_up_groups(t) != 0) return -1;
    zo.rank = t->li, zo.world = t->S, zo.stage = t->S > 1 ? t->spec.zero_stage : 0;
    zo.inv_k = 1.0 / ((double)t->S * t->accum);
  }
  if (zt_zero_create(&t->z, t->ad ? t->ad : t->m, t->k, t->intra ? t->intra : g->comm, &zo) !=
      0) {
    if (zt_err_kind() == ZT_E_NO_MEMORY) *fault = ZT_FAULT_MEMORY;
    return -1;
  }
  const zt_zero_view_t *zv = zt_zero_view(t->z);
  if (t->spec.diloco) {
    if (zt_diloco_create(&t->dl, t->z, t->places ? t->places : g->comm, t->G, t->gi, &t->spec,
                         t->tmo) != 0) {
      *fault = ZT_FAULT_MEMORY;
      return -1;
    }
    t->have_dl = 1;
    t->rl = zt_xcalloc(2 * (size_t)t->spec.inner_steps, sizeof(double));
    t->rlr = zt_xcalloc((size_t)t->spec.inner_steps, sizeof(double));
    t->rms = zt_xcalloc((size_t)t->spec.inner_steps, sizeof(double));
  }
  if (t->ad) {
    if (zt_lora_create(&t->lora, t->m, t->ad, t->z) != 0) {
      if (zt_err_kind() == ZT_E_NO_MEMORY) *fault = ZT_FAULT_MEMORY;
      return -1;
    }
    /* The frozen base counts with the model states (memplan.c). */
    zt_zero_count_params(t->z, zt_lora_bytes(t->lora));
  }
  if (zv->each && t->accum > 1 && t->r == 0)
    ZT_INFO("gradients: each of the %d micro-steps' fp32 gradients is reduce-scattered straight "
            "to its owners (stage %d, %d ranks)", t->accum, t->spec.zero_stage, t->N);
  /* The report's estimate: this rank's own figures (overlap thread, storage type). */
  zt_memplan_need_t est = t->need;
  if (g->workdir &&
      (zt_memplan_rank(&t->spec, t->N, zv->thread || zv->stream, t->k->xbytes, zv->dcomm,
                       &est.states, &est.activations) != 0 ||
       zt_zero_write_memory_report(t->z, g->workdir, zt_model_activation_bytes(t->m), &est) != 0))
    ZT_WARN("%s", zt_err_msg());
  t->inp = zt_xmalloc(sizeof(int) * (size_t)t->mb * (size_t)t->T);
  t->tgt = zt_xmalloc(sizeof(int) * (size_t)t->mb * (size_t)t->T);
  if (first_plan(t) != 0) {
    *fault = ZT_FAULT_PEER;
    return -1;
  }
  *fault = ZT_FAULT_LOCAL;
  return 0;
}

/* Reads the weights of init.from_safetensors or init.from_pretrained into
 * flat (the compute model's layout). */
static int read_init(trainer *t, float *flat) {
  return zt_hf_read_model(t->spec.init_from, t->spec.init_dir, &t->m->cfg, &t->m->lay, flat);
}

/* LoRA: the base model, at every start (fresh or from a checkpoint). */
static int init_base(trainer *t, zt_train_fault_t *fault) {
  const char *what = t->spec.init_dir ? "init.from_pretrained" : "init.from_safetensors";
  float *flat = zt_xmalloc(t->m->lay.num_params * sizeof(float));
  int rc = read_init(t, flat);
  if (rc == 0) rc = zt_lora_set_base(t->lora, flat, &t->base_hash);
  free(flat);
  if (rc != 0) {
    *fault = zt_err_kind() == ZT_E_INVALID ? ZT_FAULT_JOB : ZT_FAULT_LOCAL;
    return zt_err_wrap("%s (the base model of lora)", what);
  }
  /* Checkpoints name the base by its real path. */
  char real[ZT_PATH_MAX];
  const char *path = realpath(t->spec.init_from, real) ? real : t->spec.init_from;
  snprintf(t->base_path, sizeof t->base_path, "%.*s", (int)sizeof t->base_path - 1, path);
  zt_ckpt_checksum_text(t->base_sum, t->base_hash);
  ZT_INFO("lora: base model from %s (params %s)", t->base_path, t->base_sum);
  return 0;
}

/* LoRA's adapters at step 0: init.lora_from (a PEFT adapter file) or
 * PEFT's initialisation from the seed. */
static int init_adapters(trainer *t, zt_train_fault_t *fault) {
  if (!t->spec.lora_from[0]) {
    zt_zero_init_params(t->z, t->spec.seed);
    return 0;
  }
  float *flat = zt_xmalloc(t->ad->lay.num_params * sizeof(float));
  int rc = zt_st_read(t->spec.lora_from, &t->ad->lay, flat);
  if (rc == 0) zt_zero_set_params(t->z, flat);
  else *fault = zt_err_kind() == ZT_E_INVALID ? ZT_FAULT_JOB : ZT_FAULT_LOCAL;
  free(flat);
  return rc == 0 ? 0 : zt_err_wrap("init.lora_from");
}

/* Step 0's parameters: init.from_safetensors when the spec names a file
 * (every rank reads it and keeps what it holds), else the seeded random
 * initialisation; with LoRA, the adapters'. A file that does not fit the
 * model is the job's fault. */
static int init_params(trainer *t, zt_train_fault_t *fault) {
  const char *path = t->spec.init_from;
  if (t->lora) return init_adapters(t, fault);
  if (!path[0]) {
    zt_zero_init_params(t->z, t->spec.seed);
    return 0;
  }
  const char *what = t->spec.init_dir ? "init.from_pretrained" : "init.from_safetensors";
  if (t->g->data_root && access(path, F_OK) == 0 && !zt_path_real_under(t->g->data_root, path)) {
    *fault = ZT_FAULT_JOB;
    return zt_errk(ZT_E_INVALID, "%s: %s is not under the data root %s", what, path,
                   t->g->data_root);
  }
  float *flat = zt_xmalloc(t->m->lay.num_params * sizeof(float));
  int rc = read_init(t, flat);
  if (rc == 0) zt_zero_set_params(t->z, flat);
  else *fault = zt_err_kind() == ZT_E_INVALID ? ZT_FAULT_JOB : ZT_FAULT_LOCAL;
  free(flat);
  if (rc == 0) ZT_INFO("parameters from %s", path);
  return rc == 0 ? 0 : zt_err_wrap("%s", what);
}

/* LoRA: the epoch's adapters were trained on the base loaded now. */
static int same_base(trainer *t, const char *dir) {
  char path[ZT_PATH_MAX], sum[32];
  if (zt_ckpt_read_lora_base(dir, path, sizeof path, sum) != 0) return -1;
  if (strcmp(sum, t->base_sum))
    return zt_errk(ZT_E_INVALID, "not the same base model: checkpoint %s holds adapters of a base "
                   "whose parameters hash to %s (%s), but %s hashes to %s",
                   dir, sum, path, t->spec.init_from, t->base_sum);
  return 0;
}

/* The step to start from: the loaded epoch's, or 0 with fresh parameters. */
static int load_or_init(trainer *t, int64_t *step, zt_train_fault_t *fault) {
  const zt_gen_ctx_t *g = t->g;
  if (t->lora && init_base(t, fault) != 0) return -1;
  int live = zt_live_start(g, t->z, &t->lv, step, fault);
  if (live != 0) return live < 0 ? -1 : 0;
  if (!g->checkpoint_dir || !g->checkpoint_dir[0]) {
    *step = 0;
    if (init_params(t, fault) != 0) return -1;
    return t->have_dl ? zt_diloco_begin(&t->dl) : 0;
  }
  int64_t t0 = zt_now_ms(), loaded = 0;
  char dir[ZT_PATH_MAX];
  if (g->ckpt_root && (zt_path_confine(g->ckpt_root, g->checkpoint_dir, "checkpoint", dir,
                                       sizeof dir) != 0 ||
                       (access(dir, F_OK) == 0 && !zt_path_real_under(g->ckpt_root, dir)))) {
    *fault = ZT_FAULT_JOB;
    return zt_errk(ZT_E_INVALID, "the checkpoint to load, %s, is not under the checkpoint root %s",
                   g->checkpoint_dir, g->ckpt_root);
  }
  if ((t->have_dl ? zt_diloco_load(&t->dl, g->checkpoint_dir, &g->checkpoint, &loaded)
                  : zt_zero_load(t->z, g->checkpoint_dir, &g->checkpoint, &loaded)) != 0) {
    *fault = zt_comm_broken(g->comm) ? ZT_FAULT_PEER : zt_train_load_fault(zt_err_kind());
    return -1;
  }
  if (t->lora && same_base(t, g->checkpoint_dir) != 0) {
    *fault = ZT_FAULT_JOB;
    return -1;
  }
  if (g->start_step && loaded != g->start_step) { /* the epoch is not what was committed */
    *fault = ZT_FAULT_CHECKPOINT;
    return zt_err("checkpoint %s holds step %lld, expected %lld", g->checkpoint_dir,
                  (long long)loaded, (long long)g->start_step);
  }
  if (loaded >= t->spec.steps) { /* a checkpoint.load at or past the end */
    *fault = ZT_FAULT_JOB;
    return zt_errk(ZT_E_INVALID, "checkpoint %s holds step %lld and the job has %ld steps: "
                   "nothing left to train (raise steps)", g->checkpoint_dir, (long long)loaded,
                   t->spec.steps);
  }
  *step = loaded;
  ZT_INFO("loaded checkpoint step %lld into %d ranks, stage %d, in %lld ms: %s", (long long)loaded,
          t->N, t->spec.zero_stage, (long long)(zt_now_ms() - t0), g->checkpoint_dir);
  return 0;
}

/* ---- one step ------------------------------------------------------------------- */

/* The LR of step s (1-based): the schedule, the rollback cooldown factor,
 * and the test-only fault injection (a huge LR for a step range, in the
 * first run of those steps unless `repeat`). */
static double step_lr(trainer *t, int64_t s) {
  const zt_gen_ctx_t *g = t->g;
  const zt_spec_fault_t *fi = &t->spec.fault;
  float mult = 1.0f;
  if (s <= g->lr_until && g->lr_factor > 0) mult *= (float)g->lr_factor;
  if (fi->lr_scale > 0 && (g->rollbacks == 0 || fi->repeat) && s >= fi->from_step &&
      s <= fi->to_step)
    mult *= (float)fi->lr_scale;
  return zt_lr_at(&t->spec.sched, t->spec.opt.lr, (long)(s - 1), mult);
}

/* How many validation forwards this rank runs over nb batches: one for
 * each of its batches (b = r, r + N, ...), or at stage 3, where every
 * forward all-gathers each unit's parameters from all ranks, as many as
 * the rank with the most, ceil(nb / N): ranks that ran different numbers
 * of forwards would issue different collectives. */
static uint64_t eval_rounds(const trainer *t, uint64_t nb) {
  uint64_t N = (uint64_t)t->N, r = (uint64_t)t->r;
  if (zt_zero_view(t->z)->stage == 3) return (nb + N - 1) / N;
  return nb > r ? (nb - r + N - 1) / N : 0;
}

/* Mean loss over the validation batches, spread over the ranks: batch b
 * is samples [b mb, (b + 1) mb) of the validation shards in file order, for
 * b < min(eval.batches, n_samples / mb) (docs/engine.md; set_up refuses a
 * validation set smaller than one micro batch). A forward past the last
 * batch (stage 3, eval_rounds) runs batch 0 again and is not counted. The
 * losses are summed in fp64, which is exact for so few fp32 values, so the
 * mean does not depend on how the batches were spread over the ranks. */
static int eval_loss(trainer *t, double *out) {
  int mb = t->mb;
  /* The loss sum, the batches counted, and the ranks whose own batch
   * failed (a bad token in a validation shard): every rank still joins the
   * collectives (stage 3's forwards, the sum below), then every rank fails
   * with the reason, instead of leaving the others waiting in a
   * collective this rank never calls. */
  double acc[3] = {0, 0, 0};
  char why[400] = "";
  uint64_t nb = ZT_MIN((uint64_t)t->spec.eval_batches, zt_data_num_samples(t->val) / (uint64_t)mb);
  uint64_t rounds = eval_rounds(t, nb);
  *out = NAN;
  for (uint64_t i = 0; i < rounds; i++) {
    uint64_t b = (uint64_t)t->r + i * (uint64_t)t->N;
    float l = NAN;
    if (!why[0] &&
        zt_data_fill_seq(t->val, (b < nb ? b : 0) * (uint64_t)mb, mb, t->inp, t->tgt) != 0) {
      snprintf(why, sizeof why, "%s", zt_err_msg());
      acc[2] = 1;
    }
    if (why[0]) { /* failed: only the forwards that keep stage 3's collectives in step */
      if (t->spec.zero_stage < 3) break;
      memset(t->inp, 0, sizeof(int) * (size_t)mb * (size_t)t->T);
      memset(t->tgt, 0, sizeof(int) * (size_t)mb * (size_t)t->T);
    }
    if (zt_model_forward(t->m, t->inp, t->tgt, mb, t->T, &l) != 0) return -1;
    if (why[0] || b >= nb) continue; /* a forward only to keep the collectives in step */
    acc[0] += l;
    acc[1] += 1;
  }
  if (all_ranks_reduce(t, acc, 3) != 0) return -1;
  if (why[0]) return zt_err("validation: %s", why); /* a local fault, as set_up left it */
  if (acc[2] > 0) {
    t->peer_fault = 1;
    return zt_err("validation: a batch of another rank could not be read (that rank names it)");
  }
  *out = acc[1] > 0 ? (double)(float)(acc[0] / acc[1]) : NAN;
  return 0;
}

/* The first sample of this rank's j-th micro-batch of step `step`
 * (0-based): micro-batch j N + r of the step with equal shares (as
 * zt_data_pos has it), first[r] + j with shares by speed. */
static uint64_t micro_pos(const trainer *t, int64_t step, int j) {
  if (!t->uneven) return zt_data_pos((uint64_t)step, t->mb, t->K / t->N, t->N, data_rank(t), j);
  return (uint64_t)step * (uint64_t)t->K * (uint64_t)t->mb +
         (uint64_t)(t->first[t->r] + j) * (uint64_t)t->mb;
}

/* One micro-batch: forward and backward, its loss added to *loss_sum, its
 * compute time to the rank's measure (less the waits for collectives). */
static int micro_batch(trainer *t, int64_t step, int j, int last, double *loss_sum) {
  const zt_spec_fault_t *fi = &t->spec.fault;
  int64_t t0 = zt_now_us();
  double waited = zt_zero_waited_ms(t->z);
  float l = 0;
  if (zt_data_fill(t->train, micro_pos(t, step, j), t->mb, t->inp, t->tgt) != 0) return -1;
  zt_zero_micro_begin(t->z, last);
  /* Forward and backward, from CUDA graphs where the table and the hooks
   * allow (zt_model_step). A failed collective (zt_zero_failed) is
   * reported by zt_zero_micro_end. */
  if (zt_model_step(t->m, t->inp, t->tgt, t->mb, t->T, 1.0f, &l) != 0 && !zt_zero_failed(t->z))
    return -1;
  *loss_sum += l;
  if (fi->slow_micro_ms > 0 && t->r == fi->slow_rank) /* test knob: a slow machine */
    usleep((useconds_t)fi->slow_micro_ms * 1000);
  if (zt_zero_micro_end(t->z) != 0) return -1;
  waited = zt_zero_waited_ms(t->z) - waited;
  t->lb_ms += ZT_MAX(0.0, (double)(zt_now_us() - t0) / 1000.0 - waited);
  t->lb_n++;
  return 0;
}

/* Every micro-step of step `step` (0-based); *loss_sum receives the sum of
 * their losses. 1 when a stop was requested. At stages 2-3 a rank with
 * fewer micro-batches than the most runs the hooks alone for the rest. */
static int micro_steps(trainer *t, int64_t step, double *loss_sum) {
  const zt_gen_ctx_t *g = t->g;
  int mine = t->share[t->r], rounds = zt_zero_view(t->z)->stage >= 2 ? t->rounds : mine;
  *loss_sum = 0;
  for (int j = 0; j < rounds; j++) {
    if (g->should_stop(g->user)) return 1;
    if (j < mine) {
      if (micro_batch(t, step, j, j == rounds - 1, loss_sum) != 0) return -1;
      continue;
    }
    zt_zero_micro_begin(t->z, j == rounds - 1);
    if (zt_model_hook_pass(t->m) != 0 && !zt_zero_failed(t->z)) return -1;
    if (zt_zero_micro_end(t->z) != 0) return -1;
  }
  return 0;
}

/* 1 when step s ends with a periodic epoch (not the last step's, which is
 * always written); the same answer on every rank. */
static int periodic_due(const trainer *t, int64_t s) {
  const zt_spec_ckpt_t *c = &t->spec.ckpt;
  return c->dir[0] && c->every_steps && s % c->every_steps == 0 && s < t->spec.steps;
}

/* The gradient of step `step` + 1: every micro-step, then the reduction
 * (a DiLoCo group's is its own); *loss_sum as micro_steps. 1 when a stop
 * was requested. */
static int step_gradients(trainer *t, int64_t step, double *loss_sum) {
  int64_t s = step + 1;
  if (t->spec.fault.break_ring_at_step == s && t->r == t->N - 1) { /* test knob */
    zt_comm_abort(t->g->comm);
    zt_err("fault injection: ring broken at step %lld", (long long)s);
    return -1;
  }
  zt_zero_start_step(t->z);
  int rc = micro_steps(t, step, loss_sum);
  if (rc != 0) return rc;
  return zt_zero_reduce(t->z) != 0 ? -1 : 0;
}

/* Computes step `step` + 1. 1 when a stop was requested. */
static int train_step(trainer *t, int64_t step, int ckpt_flag, step_result *res) {
  int64_t t0 = zt_now_us(), s = step + 1;
  double loss_sum;
  int rc = step_gradients(t, step, &loss_sum);
  if (rc != 0) return rc;
  /* The vote on a periodic epoch at s (see checkpoint()): this rank is busy
   * while its previous epoch is still being copied or reported. Every rank
   * asks at the same steps (the schedule is the spec's), and only there,
   * since the question waits for the previous epoch's disk write. */
  res->ckpt_prev = periodic_due(t, s) && t->writer ? zt_ckpt_writer_reporting(t->writer) : 0;
  /* With a load balance plan due, every rank's measure rides along. */
  double ctl[5 + 2 * ZT_LB_MAX_RANKS] = {loss_sum, zt_zero_sumsq(t->z), 0, (double)ckpt_flag,
                                         res->ckpt_prev ? 1 : 0};
  size_t nctl = 5;
  if (plan_due(t, s)) {
    ctl[5 + t->r] = t->lb_ms, ctl[5 + t->N + t->r] = (double)t->lb_n;
    nctl += 2 * (size_t)t->N;
  }
  ctl[2] = isfinite(ctl[0]) && isfinite(ctl[1]) ? 0.0 : 1.0;
  if (zt_zero_host_all_reduce(t->z, ctl, nctl, ZT_DT_F64) != 0) return -1;
  if (nctl > 5) replan(t, ctl + 5, "after a step"); /* for the next step */
  res->loss = ctl[0] * zt_zero_view(t->z)->inv_k;
  res->norm = sqrt(ctl[1]);
  res->nonfinite = ctl[2] > 0 || !isfinite(res->loss) || !isfinite(res->norm);
  res->ckpt_requested = ctl[3] > 0;
  res->ckpt_busy = (int)ctl[4];
  res->lr = step_lr(t, s);
  if (t->spec.fault.break_ring_before_update_at_step == s && t->N > 1 && t->r == t->N - 1 &&
      t->g->generation == 1) { /* test knob: the update's collectives fail */
    ZT_WARN("fault injection: ring broken before the update of step %lld", (long long)s);
    zt_comm_abort(t->g->comm);
  }
  if (!res->nonfinite) {
    float gscale = zt_opt_clip_coef(ctl[1], t->spec.grad_clip, NULL);
    t->live_at = 0; /* until the step is reported whole (report()) */
    if (zt_zero_adamw(t->z, &t->spec.opt, (float)res->lr, gscale, s) != 0) return -1;
    if (zt_zero_gather(t->z) != 0) return -1;
  } else {
    ZT_WARN("step %lld: non-finite loss or gradient (loss %g, norm %g): update refused",
            (long long)s, res->loss, res->norm);
  }
  res->val_loss = NAN;
  if (t->val && t->spec.eval_every && s % t->spec.eval_every == 0) {
    if (eval_loss(t, &res->val_loss) != 0) return -1;
  }
  res->ms = (double)(zt_now_us() - t0) / 1000.0;
  if (t->spec.wall_clock_breakdown) {
    zt_zero_times_t tm;
    zt_zero_take_times(t->z, &tm);
    ZT_INFO("step %lld: %.1f ms; waited %.1f ms for gradient reductions, %.1f ms for gathers; "
            "communication thread %.1f ms busy, %.1f ms CPU",
            (long long)s, res->ms, tm.wait_reduce_ms, tm.wait_gather_ms, tm.comm_busy_ms,
            tm.comm_cpu_ms);
  }
  return 0;
}

/* ---- checkpoints ------------------------------------------------------------------ */

/* The writer's report of an epoch, to the caller; under fault injection
 * rank 0 reports late (after its peers and the copies they pushed). */
static int report_epoch(void *user, int64_t step, const char *dir, const zt_ckpt_file_t *files,
                        int nfiles, const char *error) {
  trainer *t = user;
  if (t->r == 0 && t->spec.fault.delay_checkpoint_report_ms > 0)
    zt_sleep_ms(t->spec.fault.delay_checkpoint_report_ms); /* the injected delay */
  if (!t->g->report_checkpoint) return 0; /* zsolo: nobody to tell */
  return t->g->report_checkpoint(t->g->user, step, dir, files, nfiles, error);
}

/* Snapshots this rank's state for `step` and hands it to the writer. */
static int save_state(trainer *t, int64_t step) {
  const zt_gen_ctx_t *g = t->g;
  if (!t->writer && zt_ckpt_writer_start(report_epoch, t, &t->writer) != 0)
    return -1;
  float *buf = zt_ckpt_writer_buffer(t->writer, t->have_dl ? zt_diloco_snapshot_floats(&t->dl)
                                                             : zt_zero_snapshot_floats(t->z));
  if (!buf) return -1;
  int nr = zt_zero_view(t->z)->U;
  zt_ckpt_range_t *rg = zt_xcalloc(3 * (size_t)nr, sizeof *rg);
  if ((t->have_dl ? zt_diloco_snapshot(&t->dl, buf, rg, &nr) : zt_zero_snapshot(t->z, buf, rg)) !=
      0) {
    free(rg);
    return zt_err_wrap("checkpoint of step %lld not written", (long long)step);
  }
  char dir[ZT_PATH_MAX];
  zt_ckpt_dirname(dir, sizeof dir, t->spec.ckpt.dir, g->job_id, step, g->generation);
  zt_ckpt_meta_t meta = {g->job_id, g->generation, step, t->r, t->N, t->spec.zero_stage, t->cfg,
                         t->spec.seed, t->spec.global_batch, g->skips, g->nskips, "", "", 0,
                         0, 0, 0, 0};
  snprintf(meta.tokenizer, sizeof meta.tokenizer, "%s", t->tok_record);
  if (t->lora) {
    snprintf(meta.lora_base, sizeof meta.lora_base, "%s", t->base_path);
    meta.lora_base_hash = t->base_hash;
  }
  if (t->have_dl)
    meta.diloco_groups = t->G, meta.diloco_units = zt_zero_view(t->z)->U, meta.diloco_inner_steps = t->dl.H,
    meta.diloco_ef = t->dl.ef != NULL;
  int rc = zt_ckpt_writer_submit(t->writer, dir, &meta, rg, nr);
  free(rg);
  return rc;
}

/* Writes an epoch when one is due: on schedule, when asked, and always
 * after the last step, so every completed job ends with its final model on
 * disk (the coordinator completes the job when that epoch commits).
 * Returns 1 when the generation ends here: a checkpoint-now epoch (drain,
 * scale-up) makes the coordinator re-form from exactly this step once it
 * commits, so no step is computed twice. */
static int checkpoint(trainer *t, int64_t step, const step_result *res) {
  const zt_spec_ckpt_t *c = &t->spec.ckpt;
  int last = step >= t->spec.steps;
  int want = c->dir[0] && !res->nonfinite &&
             ((c->every_steps && step % c->every_steps == 0) || res->ckpt_requested || last);
  if (!want) return 0;
  if (last) return save_state(t, step); /* waits for the previous epoch: nothing follows */
  /* A periodic epoch is skipped rather than stall the ring (and fail it
   * past the collective timeout) while some rank's previous one, safely on
   * disk, still waits for its copies or for the coordinator. The step's
   * control all-reduce took the vote, so either every rank writes the
   * epoch or none does: an epoch some rank lacks could never commit. A
   * checkpoint-now epoch is written whatever the vote. */
  if (res->ckpt_busy > 0 && !res->ckpt_requested) {
    if (res->ckpt_prev)
      ZT_WARN("checkpoint step %lld skipped: step %lld's epoch is still being copied or "
              "reported (%d of %d ranks busy)",
              (long long)step, (long long)res->ckpt_prev, res->ckpt_busy, t->N);
    else
      ZT_WARN("checkpoint step %lld skipped: %d of %d ranks still copy or report their "
              "previous epoch",
              (long long)step, res->ckpt_busy, t->N);
    return 0;
  }
  if (save_state(t, step) != 0) return -1;
  if (!res->ckpt_requested) return 0;
  ZT_INFO("step %lld: checkpoint-now epoch written; waiting for the next generation",
          (long long)step);
  return 1;
}

/* ---- DiLoCo (diloco.h) ----------------------------------------------------------------- */

/* Step s (1-based) ends a round: the groups meet. */
static int sync_due(const trainer *t, int64_t s) {
  return s % t->dl.H == 0 || s >= t->spec.steps;
}

/* Computes step `step` + 1 as an inner step: this group's micro-batches
 * of the step, its own gradient and AdamW, no communication. 1 when a
 * stop was requested. */
static int inner_step(trainer *t, int64_t step) {
  int64_t t0 = zt_now_us(), s = step + 1;
  double loss_sum;
  int rc = step_gradients(t, step, &loss_sum);
  if (rc != 0) return rc;
  double v[2] = {loss_sum, zt_zero_sumsq(t->z)};
  if (t->intra && zt_zero_host_all_reduce(t->z, v, 2, ZT_DT_F64) != 0) return -1; /* the group's */
  double sumsq = v[1], loss = v[0] * zt_zero_view(t->z)->inv_k, lr = step_lr(t, s);
  if (isfinite(loss) && isfinite(sumsq)) {
    float gscale = zt_opt_clip_coef(sumsq, t->spec.grad_clip, NULL);
    if (zt_zero_adamw(t->z, &t->spec.opt, (float)lr, gscale, s) != 0 ||
        zt_zero_gather(t->z) != 0) /* a group of several ranks at stages 1-2 */
      return -1;
  } else {
    ZT_WARN("step %lld: group %d: non-finite loss or gradient (loss %g, sum of squares %g): "
            "inner update refused", (long long)s, t->r, loss, sumsq);
  }
  t->dl.have_inner = 0;
  int i = t->rn++;
  t->rl[2 * i] = loss, t->rl[2 * i + 1] = sumsq, t->rlr[i] = lr;
  t->rms[i] = (double)(zt_now_us() - t0) / 1000.0;
  return 0;
}

/* Rank 0 reports the round that ends with step s: each step's loss and
 * gradient norm over the groups (ctl: the sums), the last one with the
 * sync's time and the evaluation. flags[0] is set when the caller asked
 * for an epoch now, flags[1] when the generation is over. */
static void report_round(trainer *t, int64_t s, const double *ctl, double val_loss,
                         double *flags) {
  const zt_gen_ctx_t *g = t->g;
  int n = t->rn;
  if (t->r != 0 || !g->report_step) return;
  for (int i = 0; i < n; i++) {
    double ms = t->rms[i] + (i == n - 1 ? t->dl.sync_ms : 0);
    zt_step_report_t rep = {s - n + 1 + i, ctl[2 * i] / t->G, sqrt(ctl[2 * i + 1] / t->G),
                            t->rlr[i], (double)t->spec.global_batch * t->T / (ms / 1000.0), ms,
                            i == n - 1 ? val_loss : NAN, NULL, 0, i == n - 1 ? t->refused : 0};
    if (i == n - 1) t->refused = 0;
    zt_train_cmd_t cmd = g->report_step(g->user, &rep);
    if (cmd == ZT_CMD_CHECKPOINT_NOW) flags[0] = 1;
    if (cmd == ZT_CMD_STOP || cmd == ZT_CMD_ROLLBACK) flags[1] = 1;
  }
}

/* The outcome rc of step s's outer step (waited for or landed): a
 * compressed block that failed its checks is another group's fault; a
 * refused step is logged. */
static int outer_done(trainer *t, int64_t s, int rc, int applied) {
  if (rc != 0) {
    if (zt_err_kind() == ZT_E_INVALID) t->peer_fault = 1;
    return -1;
  }
  if (!applied) {
    ZT_WARN("step %lld: the groups' pseudo-gradient is not finite: outer step refused, every "
            "group goes on from the last sync", (long long)s);
    t->refused++;
  }
  return 0;
}

/* Test knobs at the outer step of step s, on the last rank, in the first
 * generation only: its all-reduce fails; the encoded pseudo-gradient
 * arrives corrupt (int8, int4); a NaN joins the pseudo-gradient
 * (uncompressed), so every group refuses the outer step. */
static void break_before_outer(trainer *t, int64_t s) {
  const zt_spec_fault_t *fi = &t->spec.fault;
  if (t->N < 2 || t->r != t->N - 1 || t->g->generation != 1) return;
  if (fi->break_ring_before_update_at_step == s) {
    ZT_WARN("fault injection: ring broken before the outer step of step %lld", (long long)s);
    zt_comm_abort(t->g->comm);
  }
  if (fi->corrupt_compressed_at_step == s &&
      (t->dl.q == ZT_QUANT_INT8 || t->dl.q == ZT_QUANT_INT4)) {
    ZT_WARN("fault injection: the encoded pseudo-gradient of step %lld corrupted", (long long)s);
    t->dl.corrupt = 1;
  }
  if (fi->nan_pseudo_gradient_at_step == s && !t->dl.q) {
    ZT_WARN("fault injection: a NaN in the pseudo-gradient of step %lld", (long long)s);
    t->dl.poison = 1;
  }
}

/* The fragment whose round ends with step s (diloco.h): all of them at
 * the last step (-1), else the last one (the whole model without
 * fragments). */
static int round_fragment(const trainer *t, int64_t s) {
  return t->dl.F == 1 || s >= t->spec.steps ? -1 : t->dl.F - 1;
}

/* The outer step of fragment f after step s, waited for. */
static int outer_sync(trainer *t, int64_t s, int f) {
  int applied = 0;
  break_before_outer(t, s);
  int rc = zt_diloco_sync(&t->dl, f, &applied);
  return outer_done(t, s, rc, applied);
}

/* Starts fragment f's overlapped all-reduce after step s; it lands
 * sync.overlap_steps later. */
static int launch(trainer *t, int64_t s, int f) {
  break_before_outer(t, s);
  if (zt_diloco_launch(&t->dl, f) != 0) return -1;
  t->land_at = s + t->spec.overlap_steps;
  return 0;
}

/* Fragment f's sync in the middle of a round (sync.fragments): overlapped,
 * or waited for in step s's time. */
static int fragment_sync(trainer *t, int64_t s, int f) {
  if (t->spec.overlap_steps && !t->dl.dev) return launch(t, s, f);
  if (outer_sync(t, s, f) != 0) return -1;
  t->rms[t->rn - 1] += t->dl.sync_ms;
  return 0;
}

/* Lands an overlapped round after step s (diloco.h). */
static int land(trainer *t, int64_t s) {
  int applied = 0;
  t->land_at = 0;
  int rc = zt_diloco_land(&t->dl, &applied);
  return outer_done(t, s, rc, applied);
}

/* A sync of step s failed with its round still open (the outer step not
 * applied): when a peer is gone, the round is kept for the next
 * generation (diloco.h, a lost group dropped from its round). Not with
 * fragments: the others synced in the round, and the epoch it would
 * resume from holds their outer state from before. */
static void keep_round(trainer *t, int64_t s) {
  const zt_gen_ctx_t *g = t->g;
  if (!g->diloco_stash || t->dl.ef || t->dl.F > 1 || t->intra || !zt_comm_broken(g->comm) ||
      t->rn < 1)
    return;
  char why[512];
  snprintf(why, sizeof why, "%s", zt_err_msg());
  if (zt_diloco_stash_keep(&t->dl, g->diloco_stash, g->job_id, s - t->rn, s, t->rl, t->rlr,
                           t->rms) == 0)
    ZT_INFO("diloco: group %d keeps its round %lld..%lld for the next generation",
            t->r, (long long)(s - t->rn + 1), (long long)s);
  zt_err("%s", why); /* the failure stays the sync's */
}

/* The groups meet after step s: the round's losses summed over them, the
 * outer step, an evaluation when due, rank 0's reports, one all-reduce
 * that tells every group what rank 0's caller wants, and the checkpoint
 * (its vote rides with the losses). *end is set when the generation ends
 * here: a stop or rollback, or a checkpoint-now epoch. */
static int sync_round(trainer *t, int64_t s, int *end) {
  /* The last step may come before an overlapped round has landed. */
  if (t->dl.pending && land(t, s) != 0) return -1;
  int n = t->rn, rc = -1, open = 1; /* open: the outer step not yet applied */
  step_result res;
  memset(&res, 0, sizeof res);
  res.ckpt_prev = periodic_due(t, s) && t->writer ? zt_ckpt_writer_reporting(t->writer) : 0;
  size_t nc = 2 * (size_t)n + 1;
  double *ctl = zt_xcalloc(nc, sizeof *ctl), flags[2] = {0, 0};
  /* Each group's figures once: from the first rank of a group of several
   * (with two groups, the sum is then the same addition as without). */
  if (t->li == 0) memcpy(ctl, t->rl, 2 * (size_t)n * sizeof(double));
  ctl[2 * n] = res.ckpt_prev ? 1 : 0;
  /* In pieces of 1024 (8 KiB): the most a device communicator takes here. */
  for (size_t at = 0; at < nc; at += 1024)
    if (all_ranks_reduce(t, ctl + at, ZT_MIN((size_t)1024, nc - at)) != 0) goto out;
  /* Overlapped (sync.overlap_steps) unless what follows needs the synced
   * model here: a periodic epoch, the last step's, an evaluation. The
   * launch comes after the round's last collective on this thread (the
   * communicator is the all-reduce's until it lands), and an epoch asked
   * for now makes the round wait after all. */
  int eval = t->val && t->spec.eval_every && s % t->spec.eval_every == 0;
  int overlap = t->spec.overlap_steps && !t->dl.dev && !eval && !periodic_due(t, s) &&
                s < t->spec.steps;
  int f = round_fragment(t, s);
  if (!overlap && outer_sync(t, s, f) != 0) goto out;
  open = overlap;
  res.val_loss = NAN;
  if (eval && eval_loss(t, &res.val_loss) != 0) goto out;
  report_round(t, s, ctl, res.val_loss, flags);
  if (all_ranks_reduce(t, flags, 2) != 0) goto out;
  res.ckpt_requested = flags[0] > 0;
  res.ckpt_busy = (int)ctl[2 * n];
  t->rn = 0;
  if (overlap && res.ckpt_requested && outer_sync(t, s, f) != 0) goto out;
  if (overlap && !res.ckpt_requested && launch(t, s, f) != 0) goto out;
  open = 0;
  rc = checkpoint(t, s, &res);
  if (rc >= 0) *end = rc > 0 || flags[1] > 0;
  rc = rc < 0 ? -1 : 0;
out:
  if (rc != 0 && open) keep_round(t, s);
  free(ctl);
  return rc;
}

/* At the generation's start (step, the epoch's): when every group holds a
 * round kept from that step on, they take it back and meet at once
 * (diloco.h); the kept rounds are dropped either way. *end as
 * sync_round. */
static int take_rounds(trainer *t, int64_t *step, int *end) {
  const zt_gen_ctx_t *g = t->g;
  zt_diloco_stash_t *st = g->diloco_stash ? *g->diloco_stash : NULL;
  int64_t mine = zt_diloco_stash_end(st, g->job_id, *step);
  double v[2] = {mine > 0 ? 1.0 : 0.0, (double)mine};
  if (all_ranks_reduce(t, v, 2) != 0) return -1;
  int all = mine > 0 && v[0] == t->N && v[1] == (double)mine * t->N && mine <= t->spec.steps;
  if (all) zt_diloco_stash_take(&t->dl, st, t->rl, t->rlr, t->rms, &t->rn);
  else if (mine > 0)
    ZT_INFO("diloco: the round %lld..%lld kept here is dropped (%d of %d groups kept it)",
            (long long)*step + 1, (long long)mine, (int)v[0], t->N);
  if (g->diloco_stash) {
    zt_diloco_stash_free(st);
    *g->diloco_stash = NULL;
  }
  if (!all) return 0;
  *step = mine;
  return sync_round(t, mine, end);
}

/* One DiLoCo step (an inner step, and the round's end where due); as
 * train_step. *end as sync_round. */
static int diloco_step(trainer *t, int64_t step, int *end) {
  int rc = inner_step(t, step);
  if (rc != 0) return rc;
  if (t->dl.pending && step + 1 == t->land_at) { /* its wait counts in this step's time */
    if (land(t, step + 1) != 0) return -1;
    t->rms[t->rn - 1] += t->dl.sync_ms;
  }
  if (sync_due(t, step + 1)) {
    if (t->g->step_done) t->g->step_done(t->g->user, step + 1, t->rms[t->rn - 1]);
    return sync_round(t, step + 1, end);
  }
  int f = zt_diloco_fragment_due(&t->dl, step + 1);
  if (f >= 0 && fragment_sync(t, step + 1, f) != 0) return -1;
  if (t->g->step_done) t->g->step_done(t->g->user, step + 1, t->rms[t->rn - 1]);
  return 0;
}

/* ---- the generation ---------------------------------------------------------------- */

/* Every rank notes the step (live.h); rank 0 reports it. */
static zt_train_cmd_t report(trainer *t, int64_t step, const step_result *res) {
  const zt_gen_ctx_t *g = t->g;
  zt_step_report_t rep = {step,    res->loss,
                          res->norm, res->lr,
                          (double)t->spec.global_batch * t->T / (res->ms / 1000.0),
                          res->ms, res->val_loss, t->share, t->plan_new ? t->N : 0, 0};
  zt_live_note(t->lv, &rep);
  t->live_at = step; /* a step whose update was refused too */
  if (t->r != 0 || !g->report_step) return ZT_CMD_CONTINUE;
  t->plan_new = 0;
  return g->report_step(g->user, &rep);
}

static void tear_down(trainer *t) {
  /* A write in flight finishes (its epoch may still commit); then stop. */
  zt_ckpt_writer_stop(t->writer);
  free(t->inp);
  free(t->tgt);
  zt_data_close(t->train);
  zt_data_close(t->val);
  if (t->have_dl) zt_diloco_free(&t->dl);
  free(t->rl);
  free(t->rlr);
  free(t->rms);
  zt_zero_free(t->z);
  zt_comm_destroy(t->intra);
  zt_comm_destroy(t->places);
  zt_lora_free(t->lora);
  zt_model_free(t->m);
  zt_model_free(t->ad);
}

int zt_gen_train(const zt_gen_ctx_t *g, zt_train_failure_t *f) {
  trainer t;
  memset(&t, 0, sizeof t);
  t.g = g;
  t.N = g->world, t.r = g->rank;
  t.tmo = g->comm_timeout_ms > 0 ? g->comm_timeout_ms : ZT_COMM_TIMEOUT_MS_DEFAULT;
  int64_t step = 0;
  int ret = -1, ckpt_flag = 0;
  f->step = g->start_step;
  if (set_up(&t, &f->fault) != 0 || load_or_init(&t, &step, &f->fault) != 0) goto out;
  t.live_at = step;
  int told = g->live_step > 0 && zt_live_replay(t.lv, g, step); /* to stop */
  if (t.have_dl) { /* a failure here is the collectives' (found broken below) or local */
    int end = 0;
    if (take_rounds(&t, &step, &end) != 0) goto out;
    if (end) {
      ret = 0;
      goto out;
    }
  }
  while (!told && step < t.spec.steps) {
    step_result res;
    f->step = step + 1;
    if (t.have_dl) {
      int end = 0, rc = diloco_step(&t, step, &end);
      if (rc != 0) {
        ret = rc > 0 ? 0 : -1;
        goto out;
      }
      step++;
      if (end) break;
      continue;
    }
    int rc = train_step(&t, step, ckpt_flag, &res);
    if (rc != 0) {
      ret = rc > 0 ? 0 : -1;
      goto out;
    }
    step++;
    if (g->step_done) g->step_done(g->user, step, res.ms);
    zt_train_cmd_t cmd = report(&t, step, &res);
    rc = checkpoint(&t, step, &res);
    if (rc != 0) {
      ret = rc > 0 ? 0 : -1;
      goto out;
    }
    ckpt_flag = cmd == ZT_CMD_CHECKPOINT_NOW;
    if (cmd == ZT_CMD_STOP || cmd == ZT_CMD_ROLLBACK) break;
  }
  ret = 0;
out:
  /* A generation that ends well lets the last step's parameter gathers
   * (stages 1-2 with overlap) finish on every rank instead of aborting the
   * communicator under them; their result is not needed (the state is in
   * the checkpoint), so a failure here is only logged. */
  if (ret == 0 && t.z && zt_zero_settle(t.z) != 0)
    ZT_WARN("the last step's parameter gathers failed: %s", zt_err_msg());
  if (ret != 0 && t.peer_fault) f->fault = ZT_FAULT_PEER;
  if (ret != 0 && f->fault != ZT_FAULT_CHECKPOINT && zt_comm_broken(g->comm))
    f->fault = ZT_FAULT_PEER;
  zt_live_end(&t.lv, g, t.z, ret != 0 && !t.have_dl && t.spec.zero_stage == 0 ? t.live_at : 0);
  tear_down(&t);
  return ret;
}
