/*
 * trainer.h: one generation of data-parallel training, the engine's entry
 * point.
 *
 * The caller (the worker's runner, worker/runner.c, or zsolo,
 * tools/zsolo.c) has joined a generation: it knows its rank, the world size
 * and the job spec, and holds a connected communicator. zt_gen_train()
 * builds the model, lays out the ZeRO states (zero.h), initialises them or
 * loads the committed epoch the coordinator named (resharding it to this
 * world size), and runs steps until the job's last step, a stop request or
 * a failure.
 *
 * The engine knows nothing of gRPC or of the coordinator: it talks to its
 * caller through the callbacks below, in its own vocabulary
 * (zt_train_cmd_t), and the caller translates.
 */
#ifndef ZT_TRAINER_H
#define ZT_TRAINER_H

#include <stdint.h>

#include "balance.h"
#include "ckpt_io.h"
#include "comm.h"
#include "zt_common.h"

/* What the caller wants after a step (rank 0 asks it). */
typedef enum {
  ZT_CMD_CONTINUE = 0,
  ZT_CMD_CHECKPOINT_NOW, /* write an epoch at the next step on every rank */
  ZT_CMD_ROLLBACK,       /* this generation is over: a rollback re-forms the job */
  ZT_CMD_STOP,           /* this generation is over */
} zt_train_cmd_t;

/* Who is at fault when zt_gen_train fails. */
typedef enum {
  ZT_FAULT_PEER = 0,       /* the ring broke (a peer, the network): retry in a new generation */
  ZT_FAULT_JOB = 1,        /* the job itself (invalid spec): fail it */
  ZT_FAULT_CHECKPOINT = 2, /* the epoch to load is corrupt: fall back to an older one */
  ZT_FAULT_LOCAL = 3,      /* this rank's own error (data, device): may repeat */
  ZT_FAULT_MEMORY = 4,     /* this rank lacks the memory the job needs */
} zt_train_fault_t;

/* Who is at fault when loading an epoch failed with an error of `kind`:
 * the epoch (ZT_FAULT_CHECKPOINT: a file missing, short, over its size or
 * not matching its checksum or description, so it is retired) only when
 * its content is at fault; out of memory is ZT_FAULT_MEMORY, and anything
 * else (out of descriptors, an I/O error) ZT_FAULT_LOCAL, which says
 * nothing about the epoch and leaves it to be loaded again. */
zt_train_fault_t zt_train_load_fault(zt_errkind_t kind);

/* How zt_gen_train failed: who is at fault, and at which step (1-based: the
 * step being computed; the start step for a failure before the first). */
typedef struct {
  zt_train_fault_t fault;
  int64_t step;
} zt_train_failure_t;

/* A failed generation's model state, kept in a survivor's memory so that
 * the next generation of the job resumes at the step that was interrupted
 * instead of the last epoch (engine/live.h; docs/zero.md, "Recovery from
 * memory"). The worker holds it between generations and names it in its
 * rendezvous call. */
typedef struct zt_live zt_live_t;

/* 1 when l holds a state of job `job_id`: the step it is the state after,
 * the job's rollbacks when it was made (its trajectory), and the first step
 * whose report it keeps (step + 1: none); else 0. */
int zt_live_holds(const zt_live_t *l, uint64_t job_id, int64_t *step, uint32_t *rollbacks,
                  int64_t *reports_from);
void zt_live_free(zt_live_t *l);

/* One step's numbers, as rank 0 reports them. */
typedef struct zt_step_report {
  int64_t step; /* 1-based */
  double loss, grad_norm, lr, tokens_per_s, step_ms, val_loss;
  /* The load balance's new shares (each rank's micro-batches of the next
   * steps) when the plan changed with this step, else nshares 0; valid
   * during the call only. */
  const int *shares;
  int nshares;
  /* DiLoCo: outer steps refused (a pseudo-gradient that is not finite)
   * since the last report. */
  int outer_refused;
} zt_step_report_t;

/* Everything one generation's training needs. */
typedef struct zt_gen_ctx {
  uint64_t job_id, generation;
  int rank, world;
  const char *spec_json;
  int64_t start_step;          /* the step the epoch to load holds (0: check nothing) */
  int64_t comm_timeout_ms;     /* per collective; 0: ZT_COMM_TIMEOUT_MS_DEFAULT */
  zt_comm_t *comm;
  const char *workdir;         /* where zero_memory.json goes (NULL: nowhere) */
  /* The spec's data and checkpoint paths must lie under these (absolute)
   * roots; NULL: not confined (zsolo on the user's own files). */
  const char *data_root, *ckpt_root;
  int threads;                 /* CPU threads (0: default) */
  /* The worker's memory budget: RAM it may use and its GPU's memory (0:
   * not said; no check). A job that needs more fails with ZT_FAULT_MEMORY
   * before allocating. */
  uint64_t host_memory, device_memory;
  const char *device;          /* "cpu" (or NULL) or "cuda:N": where the model runs */
  const char *checkpoint_dir;  /* committed epoch to load ("" or NULL: fresh) */
  zt_ckpt_record_t checkpoint; /* its files as the coordinator recorded them */
  const zt_range_t *skips;     /* data skipped by rollbacks, sorted */
  int nskips;
  double lr_factor;            /* LR multiplier for steps <= lr_until */
  int64_t lr_until;
  int rollbacks;               /* rollbacks so far (fault injection's first run) */
  /* This worker's compute time per micro-batch, in ms, as the last
   * generation measured it (0: not yet): the load balance's first plan
   * (trainer.c). The trainer updates it at every plan; NULL: none kept. */
  double *micro_ms;
  /* DiLoCo: the round a group kept when a group was lost (diloco.h,
   * zt_diloco_stash_t), held by the worker across generations of a job;
   * NULL: none kept. */
  struct zt_diloco_stash **diloco_stash;
  /* The state this worker keeps across generations of a job (zt_live_t),
   * held by the worker; NULL: none kept. A generation that fails leaves
   * its state there when it can; live_step > 0 (the rendezvous' answer)
   * makes this generation start from it at that step, with no epoch read
   * (the whole generation agreed: every rank holds the same step), and
   * rank 0 reports again the kept steps after live_reported, the last the
   * coordinator stored. */
  zt_live_t **live;
  int64_t live_step, live_reported;
  /* 1 + the rank that sends its kept state to every other rank (the
   * ranks hold different steps, or some none); 0: every rank holds it. */
  uint32_t live_source;
  /* Polled between micro-steps: nonzero asks the trainer to return. */
  int (*should_stop)(void *user);
  /* Rank 0 only, after every step. */
  zt_train_cmd_t (*report_step)(void *user, const zt_step_report_t *r);
  /* Every rank, after every step: its wall time (may be NULL). */
  void (*step_done)(void *user, int64_t step, double ms);
  /* Every rank, after its files of an epoch are durable or its write
   * failed (writer thread). Returns 0 when the coordinator took the report.
   * May be NULL. */
  zt_ckpt_done_fn report_checkpoint;
  void *user;
} zt_gen_ctx_t;

/* Trains one generation. Returns 0 when the job's last step is done or a
 * stop was requested; -1 on failure, described in *f. */
int zt_gen_train(const zt_gen_ctx_t *g, zt_train_failure_t *f);

/* The most ranks whose shares a step report carries (the load balance's
 * limit). */
#define ZT_GEN_MAX_SHARES ZT_LB_MAX_RANKS

/* Frees a kept DiLoCo round (zt_gen_ctx_t.diloco_stash; NULL is none). */
void zt_gen_stash_free(struct zt_diloco_stash *st);

#endif
