/*
 * runner.h: the worker's job runner, between the control loop and training.
 *
 * The control loop (control.c) learns from heartbeat replies which job
 * generation this worker belongs to and passes it to zt_runner_assign().
 * The runner thread then leaves whatever it was doing (aborting its
 * collectives, so no step can block it), joins the new generation
 * (listening socket, Rendezvous long poll, ring set-up) and trains until
 * the job completes, the generation is superseded, or something fails, in
 * which case it tells the coordinator (ReportFailure) and waits for the
 * next assignment.
 *
 * The training itself is zt_gen_train() (dist.c): one generation's worth of
 * steps on a ready communicator.
 */
#ifndef ZT_RUNNER_H
#define ZT_RUNNER_H

#include <stdint.h>

#include "comm.h"
#include "control.h"
#include "data.h"

typedef struct zt_runner zt_runner_t;

typedef struct {
  const char *comm_host; /* address peers reach our ring socket on */
  const char *workdir;
  int threads; /* compute threads (0: default) */
  const char *device; /* "cpu" or "cuda:N" */
} zt_runner_opts;

int zt_runner_start(zt_ctl_t *ctl, const zt_runner_opts *o, zt_runner_t **out);
/* From the control thread: the generation to work on (job 0: none). */
void zt_runner_assign(zt_runner_t *r, uint64_t job_id, uint64_t generation);
/* Stops training, joins the thread, frees. */
void zt_runner_stop(zt_runner_t *r);

/* One step's numbers, as rank 0 reports them. */
typedef struct {
  int64_t step; /* 1-based */
  double loss, grad_norm, lr, tokens_per_s, step_ms, val_loss;
} zt_step_report;

/* Everything one generation's training needs. */
typedef struct {
  uint64_t job_id, generation;
  int rank, world;
  const char *spec_json;
  int64_t start_step;
  int accum_steps;
  int64_t comm_timeout_ms;
  zt_comm_t *comm;
  const char *workdir;
  int threads;
  const char *device; /* "cpu" (or NULL) or "cuda:N": where the model runs */
  const char *checkpoint_dir; /* committed epoch to load ("" or NULL: fresh) */
  const zt_range_t *skips;
  int nskips;
  double lr_factor; /* for steps <= lr_until */
  int64_t lr_until;
  int rollbacks;
  /* Polled between micro-steps: nonzero asks the trainer to return. */
  int (*should_stop)(void *user);
  /* Rank 0 only. Returns the coordinator's command (ztrain.proto Command):
   * CONTINUE, CHECKPOINT_NOW, ROLLBACK or STOP. */
  int (*report_step)(void *user, const zt_step_report *r);
  /* Every rank, after its files of an epoch are durable. Returns 0 when the
   * coordinator took the report. */
  int (*report_checkpoint)(void *user, int64_t step, const char *dir, const void *files,
                           int nfiles);
  void *user;
} zt_gen_ctx;

/* Trains one generation. Returns 0 when the job's last step is done or a
 * stop was requested; -1 on failure with *fatal = 1 when the job itself is
 * at fault (invalid spec, bad data), 2 when the checkpoint to load is
 * corrupt, 0 when the generation is (a peer). */
int zt_gen_train(const zt_gen_ctx *g, int *fatal);

#endif
