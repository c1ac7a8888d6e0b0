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
 * The training itself is the engine's zt_gen_train() (engine/trainer.c):
 * one generation's worth of steps on a ready communicator. The runner
 * translates between the engine's vocabulary (zt_train_cmd_t, step
 * reports) and the coordinator's protocol.
 */
#ifndef ZT_RUNNER_H
#define ZT_RUNNER_H

#include <stdint.h>

#include "control.h"

typedef struct zt_runner zt_runner_t;

typedef struct {
  const char *comm_host; /* address peers reach our ring socket on */
  const char *workdir;
  int threads; /* compute threads (0: default) */
  const char *device; /* "cpu" or "cuda:N" */
  const char *data_root, *ckpt_root; /* job paths must lie under these (absolute) */
  uint64_t host_memory, device_memory; /* the budget a job must fit (0: unchecked) */
} zt_runner_opts_t;

int zt_runner_start(zt_ctl_t *ctl, const zt_runner_opts_t *o, zt_runner_t **out);
/* From the control thread: the generation to work on (job 0: none), and
 * whether this worker makes its NCCL unique id (its rank 0, all GPUs). */
void zt_runner_assign(zt_runner_t *r, uint64_t job_id, uint64_t generation, int nccl_root);
/* Stops training, joins the thread, frees. */
void zt_runner_stop(zt_runner_t *r);
/* The training counters the heartbeat reports (control.h). */
void zt_runner_timing(zt_runner_t *r, zt_ctl_timing_t *t);

#endif
