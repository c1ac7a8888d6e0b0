/*
 * restarts.h: the restart policy (pure logic, no I/O).
 *
 * When a generation fails (a rank reports an error, a member is lost or
 * restarts), the scheduler (sched.c) asks this policy what to do:
 *
 *   - A rank's own error (FAIL_LOCAL, FAIL_MEMORY: bad data, a device, no
 *     memory) that comes back with the same shape (zt_text_shape: numbers
 *     blanked) at the same step as the job's previous one is deterministic:
 *     retrying cannot help. From the same worker, the worker is at fault
 *     (EXCLUDE: the scheduler goes on without it if it can, else pauses);
 *     from another one, the job is (its data, its spec), and it is PAUSED
 *     with the reason.
 *   - Everything else is transient (a peer died, the network): the first
 *     failure after a generation that made progress re-forms at once; each
 *     further one in a row, while no generation completes a step, waits
 *     backoff_ms, doubling up to max_backoff_ms. After
 *     max_failed_generations such failures in a row, or more than
 *     max_restarts failures within restart_window_s (fixed windows), the
 *     job is PAUSED with the last reason.
 *
 * An operator's resume starts the policy afresh. The state lives in memory
 * only: a restarted coordinator gives a job a fresh budget.
 */
#ifndef ZT_RESTARTS_H
#define ZT_RESTARTS_H

#include <stddef.h>
#include <stdint.h>

#include "spec.h"

typedef enum {
  ZT_FAIL_PEER,   /* the ring broke */
  ZT_FAIL_LOCAL,  /* a rank's own error */
  ZT_FAIL_MEMORY, /* a rank ran out of memory */
  ZT_FAIL_LOST,   /* a member was lost or restarted */
} zt_fail_kind_t;

typedef enum {
  ZT_RESTART_NOW,   /* re-form at once */
  ZT_RESTART_LATER, /* re-form after *delay_ms */
  ZT_RESTART_PAUSE, /* pause the job; why says why */
  /* The same local error twice at one step from one worker: keep that
   * worker out of the job and re-form without it, or pause (why says why)
   * when the job cannot form without it. */
  ZT_RESTART_EXCLUDE,
} zt_restart_verdict_t;

typedef struct {
  int streak;               /* failed generations in a row, no step completed since */
  int64_t window_start_ms;  /* the current budget window, and its failures */
  int in_window;
  int have_local;           /* the job's previous local failure: shape, step, worker */
  char local_shape[256];
  int64_t local_step;
  uint64_t local_worker;
} zt_restarts_t;

/* Decides what a failure of kind `kind` at `step` (reason: the rank's
 * message; worker: the reporting worker's id, 0 when none) leads to, at
 * monotonic time now_ms; why receives the sentence for the job's message
 * and the logbook. */
zt_restart_verdict_t zt_restarts_decide(zt_restarts_t *r, const zt_spec_restart_t *pol,
                                        zt_fail_kind_t kind, int64_t step, const char *reason,
                                        uint64_t worker, int64_t now_ms, int64_t *delay_ms,
                                        char *why, size_t whylen);
/* A generation completed a step: the streak (and its backoff) ends. */
void zt_restarts_progress(zt_restarts_t *r);
/* Everything forgotten (an operator resumed the job). */
void zt_restarts_reset(zt_restarts_t *r);

#endif
