/*
 * rollback.c: rolling a job back to a committed epoch.
 *
 * A loss spike (spike.c, fed every step rank 0 reports: zt_rollback_spike)
 * or an operator (zctl rollback: zt_rollback_operator) rolls the job back to
 * a committed epoch: the data of the spike is skipped (a range of
 * sample-stream positions added to the job's skip list, which every rank
 * receives at rendezvous), the LR is lowered for rollback.cooldown_steps
 * (rollback.lr_factor), the epochs after the target are deleted, and a new
 * generation starts from it (sched.c).
 *
 * The target. The loss of step s is computed before update s, so a loss
 * first out at s may come from update s - 1 (a bad step whose gradient
 * looked normal): epoch s - 1 holds it, and the detector's target is the
 * newest epoch at or before s - 2 - rollback.margin_steps (the retention
 * of ckpt.c keeps one). An operator names the step. The epoch must be
 * loadable (every file on a machine with a live worker, copies.c): an
 * operator is refused while it is not; a spike pauses the job, to go on
 * from that epoch once a machine that holds it is back.
 *
 * Budget. Rollbacks the detector asks for are budgeted
 * (rollback.max_rollbacks per rollback.per_steps); beyond the budget the
 * job is PAUSED with the reason, and zctl resume goes on from the last good
 * epoch. An operator's rollback is not budgeted, and is stored before
 * anything changes (a refused write refuses it).
 */
#include <stdio.h>
#include <string.h>

#include "coord.h"

/* The next generation starts from the epoch dir at step (fresh: ""). */
static void force_start(zt_job_t *j, int64_t step, const char *dir) {
  j->rb_ckpt_step = step;
  snprintf(j->rb_ckpt_dir, sizeof j->rb_ckpt_dir, "%s", dir);
}

/* Rollbacks within the budget window ending at last_step. */
static int recent_rollbacks(const zt_job_t *j, int64_t last_step) {
  int recent = 0;
  for (int i = 0; i < j->row.n_rollback_steps; i++)
    recent += j->row.rollback_steps[i] > last_step - j->p.rb_per_steps;
  return recent;
}

static void remember_rollback(zt_db_job_t *r, int64_t step) {
  if (r->n_rollback_steps == ZT_MAX_ROLLBACK_STEPS) { /* keep the newest */
    memmove(r->rollback_steps, r->rollback_steps + 1,
            (ZT_MAX_ROLLBACK_STEPS - 1) * sizeof r->rollback_steps[0]);
    r->n_rollback_steps--;
  }
  r->rollback_steps[r->n_rollback_steps++] = step;
}

/* Adds the sample-stream positions of steps [first_step, last_step +
 * skip_steps], past the ranges already skipped, to the skip list sk (the
 * job's, in the row being made); [*lo, *hi) is the new range, empty when
 * those steps are none (an operator's rollback with nothing to skip). */
static int skip_data(zt_coord_t *c, zt_job_t *j, zt_range_list_t *sk, int64_t first_step,
                     int64_t last_step, int64_t skip_steps, uint64_t *lo, uint64_t *hi) {
  uint64_t gb = (uint64_t)j->p.global_batch;
  *lo = *hi = 0;
  if (last_step + skip_steps < first_step) return 0; /* the end below would wrap around */
  *lo = zt_range_map(sk->r, sk->n, (uint64_t)(first_step - 1) * gb);
  *hi = zt_range_map(sk->r, sk->n, (uint64_t)(last_step + skip_steps) * gb - 1) + 1;
  if (*hi > *lo && zt_range_list_add(sk, *lo, *hi) != 0) {
    zt_coord_event(c, j->row.id, "skip_range_refused", 0,
                   "cannot skip the data of steps %lld..%lld: %s", (long long)first_step,
                   (long long)(last_step + skip_steps), zt_err_msg());
    return -1;
  }
  return 0;
}

/* The rollback cannot go ahead: the job pauses, to go on from the epoch
 * at step `to` (dir; "" for initialization) on zctl resume, without the
 * epochs after it. */
static void pause_at(zt_coord_t *c, zt_job_t *j, int64_t to, const char *dir, const char *msg) {
  force_start(j, to, dir); /* where zctl resume continues */
  zt_registry_drop_after(c, j, to); /* ... and not from the epochs of the spike */
  zt_sched_finish(c, j, ZT_JOB_PAUSED, "job_paused", "%s", msg);
}

/* What the rollback did, in the logbook. */
static void log_rollback(zt_coord_t *c, zt_job_t *j, int64_t to, int have, const char *why,
                         int64_t first_step, int64_t last_step, int64_t skip_steps, uint64_t lo,
                         uint64_t hi, double old_factor) {
  zt_coord_event(c, j->row.id, "rollback", 0, "rollback %d: %s; restarting from %s (step %lld)",
                 j->row.rollbacks, why, have ? "checkpoint" : "initialization", (long long)to);
  if (hi > lo)
    zt_coord_event(c, j->row.id, "skip_range", 0,
                   "data of steps %lld..%lld skipped: sample stream positions [%llu, %llu)",
                   (long long)first_step, (long long)(last_step + skip_steps),
                   (unsigned long long)lo, (unsigned long long)hi);
  zt_coord_event(c, j->row.id, "lr_change", 0, "learning rate x%g (was x%g) until step %lld",
                 j->row.lr_factor, old_factor, (long long)j->row.lr_until);
}

/* The epoch to go back to exists but cannot be loaded now (its copies are
 * on machines without a live worker): nothing is deleted; an operator is
 * refused (-1), a spike pauses the job without the epochs after it. */
static int target_unloadable(zt_coord_t *c, zt_job_t *j, const zt_db_ckpt_t *ck, int budgeted,
                             const char *why) {
  if (!budgeted)
    return zt_errk(ZT_E_STATE, "cannot roll back now: the checkpoint at step %lld lacks a copy "
                   "on a machine with a live worker; nothing changed", (long long)ck->step);
  zt_registry_drop_after(c, j, ck->step);
  zt_sched_finish(c, j, ZT_JOB_PAUSED, "job_paused",
                  "paused: %s; the checkpoint to roll back to (step %lld) lacks a copy on a "
                  "machine with a live worker; zctl resume continues from it once one is back",
                  why, (long long)ck->step);
  return 0;
}

/* Rolls the job back to the newest committed epoch at or before
 * max_ckpt_step (or to initialization), skipping the data of steps
 * first_step..last_step + skip_steps and lowering the LR for the cooldown.
 * A budgeted rollback (the detector's) beyond rollback.max_rollbacks per
 * rollback.per_steps pauses the job instead. */
static int rollback(zt_coord_t *c, zt_job_t *j, int64_t first_step, int64_t last_step,
                    int64_t max_ckpt_step, int64_t skip_steps, int budgeted, const char *why) {
  zt_db_ckpt_t ck;
  int have = 0, any = 0;
  char msg[sizeof j->row.message];
  if (j->p.ckpt_dir[0] && zt_registry_newest(c, j, max_ckpt_step, 1, &ck, &have) != 0) return -1;
  if (j->p.ckpt_dir[0] && !have && zt_registry_newest(c, j, max_ckpt_step, 0, &ck, &any) != 0)
    return -1;
  if (any) return target_unloadable(c, j, &ck, budgeted, why);
  int64_t to = have ? ck.step : 0;
  const char *dir = have ? ck.dir : "";
  int recent = recent_rollbacks(j, last_step);
  if (budgeted && recent >= j->p.rb_max) {
    snprintf(msg, sizeof msg,
             "paused: %d rollbacks within %lld steps (max_rollbacks %lld) and another spike: %s; "
             "zctl resume continues from the last good checkpoint",
             recent, (long long)j->p.rb_per_steps, (long long)j->p.rb_max, why);
    pause_at(c, j, to, dir, msg);
    return 0;
  }
  /* The row the rollback leaves; an operator's is stored before anything
   * changes, so that a refused write refuses it. */
  zt_db_job_t next = j->row;
  uint64_t lo, hi;
  if (skip_data(c, j, &next.skips, first_step, last_step, skip_steps, &lo, &hi) != 0) {
    snprintf(msg, sizeof msg,
             "paused: the data of the spike cannot be skipped (%d skip ranges, the limit): %s; "
             "zctl rollback or resume continue",
             j->row.skips.n, why);
    pause_at(c, j, to, dir, msg);
    return 0;
  }
  next.rollbacks++;
  remember_rollback(&next, last_step);
  next.lr_factor = j->p.rb_lr_factor;
  next.lr_until = last_step + j->p.rb_cooldown;
  if (!budgeted && zt_jobtable_store_first(c, j, &next, "rollback") != 0) return -1;
  double old_factor = j->row.lr_factor > 0 ? j->row.lr_factor : 1.0;
  j->row = next;
  force_start(j, to, dir);
  if (budgeted) zt_jobtable_save(c, j);
  log_rollback(c, j, to, have, why, first_step, last_step, skip_steps, lo, hi, old_factor);
  zt_registry_drop_after(c, j, to);
  char reason[300];
  snprintf(reason, sizeof reason, "rollback to step %lld", (long long)to);
  zt_sched_try_form(c, j, reason);
  return 0;
}

int zt_rollback_spike(zt_coord_t *c, zt_job_t *j, int64_t step, double loss, double grad_norm) {
  if (!j->p.rb_enabled) return 0;
  zt_spike_verdict_t v;
  int spiked = zt_spike_feed(&j->det, step, loss, grad_norm, &v);
  ZT_DEBUG("job %llu step %lld: loss %.5g norm %.4g z(loss) %.2f z(norm) %.2f",
           (unsigned long long)j->row.id, (long long)step, loss, grad_norm, v.z_loss, v.z_gnorm);
  if (!spiked) return 0;
  zt_coord_event(c, j->row.id, "spike", 0, "%s", v.reason);
  /* The loss of step s is computed before update s, so a loss first out
   * at s may come from update s - 1 (a bad step whose gradient looked
   * normal): epoch s - 1 holds it, and the target is s - 2 or earlier. */
  rollback(c, j, v.first_step, step, v.first_step - 2 - j->p.rb_margin, j->p.rb_skip, 1,
           v.reason);
  return 1;
}

int zt_rollback_operator(zt_coord_t *c, zt_job_t *j, int64_t to_step, int64_t skip_steps,
                         char *msg, size_t msglen) {
  if (!zt_jobtable_active(j) && j->row.state != ZT_JOB_PAUSED)
    return zt_errk(ZT_E_STATE, "job %llu is %s", (unsigned long long)j->row.id,
                   zt_name_job_state(j->row.state));
  if (to_step < 0 || skip_steps < 0 || to_step > j->row.total_steps ||
      skip_steps > j->row.total_steps)
    return zt_errk(ZT_E_INVALID, "--to-step must be in 0..%lld and --skip in 0..%lld",
                   (long long)j->row.total_steps, (long long)j->row.total_steps);
  char why[128];
  snprintf(why, sizeof why, "operator rollback to step %lld", (long long)to_step);
  zt_coord_event(c, j->row.id, "rollback_requested", 0, "%s, skipping %lld batches", why,
                 (long long)skip_steps);
  /* A paused job comes back to life only when the rollback goes ahead: a
   * refusal leaves it paused (it could never be scheduled otherwise). */
  int was = j->row.state;
  zt_db_ckpt_t ck;
  int have = 0;
  if (j->row.state == ZT_JOB_PAUSED) j->row.state = ZT_JOB_RECONFIGURING;
  if (j->p.ckpt_dir[0] && zt_registry_newest(c, j, to_step, 1, &ck, &have) != 0) {
    j->row.state = was;
    return -1;
  }
  int64_t from = (have ? ck.step : 0) + 1;
  if (rollback(c, j, from, from - 1, to_step, skip_steps, 0, why) != 0) {
    j->row.state = was;
    return -1;
  }
  if (j->row.state == ZT_JOB_PAUSED) /* its data could not be skipped */
    snprintf(msg, msglen, "%s", j->row.message);
  else
    snprintf(msg, msglen, "job %llu rolling back to step %lld", (unsigned long long)j->row.id,
             (long long)(from - 1));
  return 0;
}
