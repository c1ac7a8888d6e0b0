/*
 * reports.c: what the ranks of a generation report, and what the job does
 * about it.
 *
 * Every report passes the fence (jobtable.c): it names the job's current
 * generation, or it is refused and the rank rejoins.
 *
 *   ReportStep (rank 0, every step): the step is stored with its metrics
 *   before the job moves to it (a refused write leaves memory as the
 *   database is, and the rank's retry stores it). Reports that queued up
 *   while the coordinator was out of reach come in one call (`later`),
 *   stored in one transaction and judged in order. The loss feeds the spike
 *   detector (a spike rolls back: rollback.c); the reply tells rank 0 to
 *   go on, to checkpoint now (a drain or scale-up asked for one), to roll
 *   back, or to stop: at the last step, when the job ends with it (without
 *   checkpoints) or awaits its final epoch (sched.c).
 *
 *   ReportFailure: a fatal error fails the job; a checkpoint that cannot be
 *   loaded is retired (the job fails when it is not one of its own). A
 *   rank's own error, running out of memory (the worker is then taken to
 *   have less memory than it said) and a broken ring are failures the
 *   restart policy judges (sched.c). A broken ring with probe results is
 *   first a question of who is cut off: the verdict (reach.h) waits for
 *   the other ranks' reports, or a short deadline, and keeps the ranks that
 *   are out of the next generation. The ranks a rank could not reach are
 *   also remembered for it (members.c): its next rendezvous lists their
 *   stores last among the holders of a copy it may have to fetch.
 *
 *   ReportCheckpoint, ReportReplica: a rank wrote its files of an epoch, or
 *   a worker holds a copy of one; ckpt.c tallies them, and says when the
 *   epoch commits. A commit may end a checkpointing pause, completes the
 *   job when it was the final epoch, and re-forms a generation that waited
 *   for it (a drain, a scale-up).
 *
 * A checkpoint write that fails (disk full) does not end the generation:
 * checkpointing is paused, the job goes on training with an alert in
 * /metrics, and pauses once more than checkpoint.max_uncommitted_steps
 * steps would be lost; the next epoch that commits ends the alert. A
 * checkpoint-now epoch that fails ends its generation without it, and the
 * job re-forms from the last one.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "ztrain.pb-c.h"

/* ---- steps ------------------------------------------------------------------- */

/* Checkpointing is paused and the steps a failure would lose exceed
 * checkpoint.max_uncommitted_steps: the job pauses (1). */
static int over_risk_budget(zt_coord_t *c, zt_job_t *j) {
  int64_t at_risk = j->row.step - j->safe_step;
  if (!j->ckpt_paused || !j->p.max_uncommitted || at_risk <= j->p.max_uncommitted ||
      j->row.step >= j->row.total_steps)
    return 0;
  int wait_s = zt_sched_storage_backoff(j, zt_now_ms());
  char then[160];
  if (wait_s)
    snprintf(then, sizeof then, "retried by itself in %d s (retry %d of %d), or fix the storage "
             "and zctl resume", wait_s, j->storage_retries + 1, ZT_STORAGE_RETRIES);
  else
    snprintf(then, sizeof then, "%d automatic retries failed: fix the storage, then zctl resume",
             ZT_STORAGE_RETRIES);
  zt_sched_finish(c, j, ZT_JOB_PAUSED, "job_paused",
                  ZT_STORAGE_PAUSE " %lld steps (checkpoint.max_uncommitted_steps %lld); "
                  "checkpoint writes fail: %.200s; %s; it continues from step %lld",
                  (long long)at_risk, (long long)j->p.max_uncommitted, j->ckpt_error, then,
                  (long long)j->safe_step);
  zt_sched_run(c);
  return 1;
}

/* Feeds the detector; 1 when the step triggered a rollback. A non-finite
 * loss marks the step poisoned (no epoch at or after it commits: ckpt.c). */
static int check_spike(zt_coord_t *c, zt_job_t *j, const Ztrain__StepMetrics *m) {
  if (!isfinite(m->loss) && (!j->poisoned_from || m->step < j->poisoned_from))
    j->poisoned_from = m->step;
  return zt_rollback_spike(c, j, m->step, m->loss, m->grad_norm);
}

/* The most steps one report carries (the head and its `later`). */
#define ZT_REPORT_MAX_STEPS 4097

/* A report's steps, the head first: in range and each after the one
 * before, or an error naming the first that is not, before anything of
 * the report is stored. The steps are written to ms (n_later + 1). */
static int report_steps(const zt_job_t *j, const Ztrain__ReportStepRequest *req,
                        Ztrain__StepMetrics *ms) {
  if (req->n_later >= ZT_REPORT_MAX_STEPS)
    return zt_errk(ZT_E_INVALID, "%zu later steps in one report (the limit is %d)", req->n_later,
                   ZT_REPORT_MAX_STEPS - 1);
  ztrain__step_metrics__init(&ms[0]);
  ms[0].step = req->step, ms[0].loss = req->loss, ms[0].grad_norm = req->grad_norm;
  ms[0].lr = req->lr, ms[0].tokens_per_s = req->tokens_per_s, ms[0].step_ms = req->step_ms;
  ms[0].val_loss = req->val_loss, ms[0].outer_refused = req->outer_refused;
  for (size_t i = 0; i <= req->n_later; i++) {
    if (i) ms[i] = *req->later[i - 1];
    if (ms[i].step < 1 || ms[i].step > j->row.total_steps)
      return zt_errk(ZT_E_INVALID, "step %lld out of range 1..%lld", (long long)ms[i].step,
                     (long long)j->row.total_steps);
    if (i && ms[i].step <= ms[i - 1].step)
      return zt_errk(ZT_E_INVALID, "later step %lld does not follow step %lld",
                     (long long)ms[i].step, (long long)ms[i - 1].step);
  }
  return 0;
}

/* Stores the n steps in one transaction and moves the job to the last, or
 * does neither (-1). */
static int store_steps(zt_coord_t *c, zt_job_t *j, uint64_t gen, const Ztrain__StepMetrics *ms,
                       size_t n) {
  zt_db_step_t s = {0};
  zt_db_job_t next = j->row;
  next.updated_ms = zt_wall_ms();
  if (zt_db_begin(c->db) != 0) goto err;
  for (size_t i = 0; i < n; i++) {
    s = (zt_db_step_t){ms[i].step, gen, ms[i].loss, ms[i].grad_norm, ms[i].lr,
                       ms[i].tokens_per_s, ms[i].val_loss, next.updated_ms};
    if (zt_db_step_put(c->db, j->row.id, &s) != 0) goto err;
  }
  next.step = s.step;
  if (zt_db_job_update(c->db, &next) != 0 || zt_db_commit(c->db) != 0) goto err;
  j->row = next;
  j->last = s;
  return 0;
err:
  zt_err_wrapk(ZT_E_UNAVAILABLE, "cannot store step %lld", (long long)ms[0].step);
  zt_db_rollback(c->db);
  return -1;
}

/* The last step is done: the job completes now without checkpoints, else
 * when its final epoch commits. */
static void last_step(zt_coord_t *c, zt_job_t *j, const Ztrain__StepMetrics *m) {
  if (j->p.ckpt_dir[0]) {
    zt_sched_await_final(c, j);
    return;
  }
  zt_sched_finish(c, j, ZT_JOB_COMPLETED, "job_completed", "completed %lld steps; final loss %.6g",
                  (long long)m->step, m->loss);
  zt_sched_run(c);
}

/* A step report's new load balance plan (shares): one count per rank, each
 * at least one, summing to the step's micro-batches; else an error naming
 * what is wrong, before anything of the report is stored. */
static int check_shares(const zt_job_t *j, const Ztrain__ReportStepRequest *req) {
  int64_t K = j->p.global_batch / j->p.micro, sum = 0;
  if (!req->n_shares) return 0;
  if (req->n_shares != (size_t)j->row.world)
    return zt_errk(ZT_E_INVALID, "shares: %zu of them for a generation of %d ranks",
                   req->n_shares, j->row.world);
  for (size_t i = 0; i < req->n_shares; i++) {
    if (req->shares[i] < 1)
      return zt_errk(ZT_E_INVALID, "shares: rank %zu has none (each computes at least one)", i);
    sum += req->shares[i];
  }
  if (sum != K)
    return zt_errk(ZT_E_INVALID, "shares: they sum to %lld, a step has %lld micro-batches",
                   (long long)sum, (long long)K);
  return 0;
}

/* DiLoCo's refused outer steps (a pseudo-gradient that is not finite),
 * counted for /metrics and in the logbook. */
static void log_refusals(zt_coord_t *c, zt_job_t *j, const Ztrain__StepMetrics *ms, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (!ms[i].outer_refused) continue;
    j->outer_refused += ms[i].outer_refused;
    zt_coord_event(c, j->row.id, "outer_step_refused", 0,
                   "%u DiLoCo outer step%s refused by step %lld: the groups' pseudo-gradient "
                   "is not finite, every group goes on from the last sync",
                   ms[i].outer_refused, ms[i].outer_refused == 1 ? "" : "s",
                   (long long)ms[i].step);
  }
}

/* The new plan in the logbook, by worker name. */
static void log_shares(zt_coord_t *c, zt_job_t *j, const Ztrain__ReportStepRequest *req) {
  char list[1024];
  size_t at = 0;
  for (size_t i = 0; i < req->n_shares && at < sizeof list - 80; i++) {
    zt_member_t *w = zt_members_get(c, j->workers[i]);
    at += (size_t)snprintf(list + at, sizeof list - at, "%s%s %u", i ? ", " : "",
                           w ? w->row.name : "?", req->shares[i]);
  }
  zt_coord_event(c, j->row.id, "load_balance", 0,
                 "from step %lld, micro-batches per worker (by measured speed): %s",
                 (long long)req->step + 1, list);
}

int zt_reports_step(zt_coord_t *c, const Ztrain__ReportStepRequest *req, int *command) {
  zt_job_t *j;
  zt_member_t *m;
  if (zt_jobtable_fence(c, req->worker_id, req->job_id, req->generation, &j, &m) != 0) return -1;
  if (m->rank != 0)
    return zt_errk(ZT_E_STATE, "only rank 0 reports steps (worker %s is rank %d)", m->row.name,
                   m->rank);
  Ztrain__StepMetrics *ms = zt_xcalloc(ZT_MIN(req->n_later, ZT_REPORT_MAX_STEPS) + 1, sizeof *ms);
  size_t n = req->n_later + 1;
  int rc = -1;
  if (report_steps(j, req, ms) != 0 || check_shares(j, req) != 0 ||
      store_steps(c, j, req->generation, ms, n) != 0)
    goto out;
  rc = 0;
  if (req->n_shares) log_shares(c, j, req);
  log_refusals(c, j, ms, n);
  *command = j->ckpt_request ? ZTRAIN__COMMAND__COMMAND_CHECKPOINT_NOW
                             : ZTRAIN__COMMAND__COMMAND_CONTINUE;
  if (ms[n - 1].step > j->start_step) zt_restarts_progress(&j->rs);
  if (over_risk_budget(c, j)) {
    *command = ZTRAIN__COMMAND__COMMAND_STOP;
    goto out;
  }
  /* In order, as if each step came alone: a rollback ends the judging (the
   * steps after it are dropped with the generation). */
  for (size_t i = 0; i < n; i++) {
    if (check_spike(c, j, &ms[i])) {
      *command = ZTRAIN__COMMAND__COMMAND_ROLLBACK;
      goto out;
    }
  }
  if (ms[n - 1].step == j->row.total_steps) {
    *command = ZTRAIN__COMMAND__COMMAND_STOP;
    last_step(c, j, &ms[n - 1]);
  }
out:
  free(ms);
  return rc;
}

/* ---- failures ---------------------------------------------------------------- */

/* The peer whose connection died is kept out of the next generation until
 * it shows it reaches the others (a report without probe results). */
static void quarantine_peer(zt_coord_t *c, zt_job_t *j, zt_member_t *m, int suspect_rank) {
  if (suspect_rank < 0 || suspect_rank >= j->row.world || suspect_rank == m->rank) return;
  zt_member_t *peer = zt_members_get(c, j->workers[suspect_rank]);
  if (!peer || peer->quarantine_ms) return;
  zt_members_quarantine(c, peer);
  zt_coord_event(c, j->row.id, "worker_suspected", peer->row.id,
                 "rank %d (%s) reported its connection to rank %d (%s) dead", m->rank,
                 m->row.name, suspect_rank, peer->row.name);
}

/* How long a verdict on who is cut off waits for the other ranks' reports
 * when the first ones were not decisive (reach.h). */
static int64_t reach_wait_ms(const zt_job_t *j) {
  return ZT_MAX(1000, ZT_MIN(j->p.comm_timeout_ms / 2, 5000));
}

/* A peer failure with probe results: decided now, or once the other ranks
 * reported (or reach_wait_ms passed: zt_sched_run). */
static void peer_failure(zt_coord_t *c, zt_job_t *j, zt_member_t *m,
                         const Ztrain__ReportFailureRequest *req, const char *why) {
  zt_reach_t *rc = &j->reach;
  if (rc->gen != j->row.generation) {
    zt_reach_reset(rc, j->row.generation, j->row.world);
    rc->step = req->step;
    snprintf(rc->why, sizeof rc->why, "%s", why);
  }
  zt_reach_gone(rc, m->rank, req->gone_ranks, req->n_gone_ranks);
  if (zt_reach_add(rc, m->rank, req->unreachable_ranks, req->n_unreachable_ranks)) {
    zt_sched_judge_reach(c, j);
    return;
  }
  if (rc->decide_at_ms) return;
  rc->decide_at_ms = zt_now_ms() + reach_wait_ms(j);
  char list[256], what[300] = "reaches every other rank";
  zt_reach_list(rc, m->rank, list, sizeof list);
  if (list[0]) snprintf(what, sizeof what, "reaches only a minority (not ranks [%s])", list);
  zt_coord_event(c, j->row.id, "reach_undecided", m->row.id,
                 "rank %d (%s) %s; waiting up to %lld ms for the other ranks' reports",
                 m->rank, m->row.name, what, (long long)reach_wait_ms(j));
}

/* A rank ran out of memory although its worker said it had enough: the
 * worker's memory is taken to be less than this rank needed (until it
 * registers again), so the scheduler does not give it such a rank again. */
static void learn_memory(zt_coord_t *c, zt_job_t *j, zt_member_t *m) {
  const zt_memplan_need_t *need = &j->p.need[j->row.world];
  zt_db_worker_t *w = &m->row;
  if (w->device_memory && w->device_memory >= need->device)
    w->host_memory = ZT_MIN(w->host_memory, need->host_with_device - 1);
  else if (w->device_memory)
    w->device_memory = need->device - 1;
  else
    w->host_memory = ZT_MIN(w->host_memory ? w->host_memory : UINT64_MAX, need->host - 1);
  char h[32];
  zt_coord_event(c, j->row.id, "out_of_memory", m->row.id,
                 "worker %s ran out of memory for one rank at world size %d (about %s); it is "
                 "not given ranks that large again until it registers anew",
                 m->row.name, j->row.world,
                 zt_memplan_text(w->device_memory ? need->device : need->host, h, sizeof h));
}

/* A checkpoint named in a failure report could not be loaded: it is
 * retired, or, when it is none of the job's own epochs, the job fails (1). */
static int bad_checkpoint(zt_coord_t *c, zt_job_t *j, const Ztrain__ReportFailureRequest *req,
                          const char *reason) {
  char bad[sizeof j->start_ckpt] = "";
  if (req->bad_checkpoint[0] && zt_path_confine(c->cfg.ckpt_root, req->bad_checkpoint,
                                                 "bad_checkpoint", bad, sizeof bad) != 0)
    snprintf(bad, sizeof bad, "%s", req->bad_checkpoint); /* matches no epoch: fails the job */
  if (!bad[0] || zt_registry_mark_bad(c, j, bad, reason) == 0) return 0;
  zt_sched_finish(c, j, ZT_JOB_FAILED, "job_failed", "cannot load checkpoint %s: %s",
                  req->bad_checkpoint, reason);
  zt_sched_run(c);
  return 1;
}

/* The ranks a probing rank could not reach, by worker id: the next
 * generation tells it to fetch copies from their stores last (copies.c),
 * whether or not they are kept out. */
static void remember_unreached(zt_coord_t *c, zt_job_t *j, zt_member_t *m,
                               const Ztrain__ReportFailureRequest *req) {
  uint64_t ids[ZT_MEMBER_UNREACH];
  int n = 0;
  for (size_t i = 0; i < req->n_unreachable_ranks && n < ZT_MEMBER_UNREACH; i++)
    if (req->unreachable_ranks[i] < (uint32_t)j->row.world)
      ids[n++] = j->workers[req->unreachable_ranks[i]];
  zt_members_unreach(c, m, ids, n);
}

static zt_fail_kind_t fail_kind(const Ztrain__ReportFailureRequest *req) {
  if (req->kind == ZTRAIN__FAILURE_KIND__FAILURE_LOCAL) return ZT_FAIL_LOCAL;
  if (req->kind == ZTRAIN__FAILURE_KIND__FAILURE_OUT_OF_MEMORY) return ZT_FAIL_MEMORY;
  return ZT_FAIL_PEER;
}

int zt_reports_failure(zt_coord_t *c, const Ztrain__ReportFailureRequest *req) {
  zt_job_t *j;
  zt_member_t *m = zt_members_get(c, req->worker_id);
  /* Already moved on: the worker belongs to a newer generation of the same
   * job (another rank reported first). Nothing to do; the reply carries the
   * new assignment. */
  if (m && m->job_id == req->job_id && m->gen > req->generation) return 0;
  if (zt_jobtable_fence(c, req->worker_id, req->job_id, req->generation, &j, &m) != 0) return -1;
  char reason[400];
  snprintf(reason, sizeof reason, "%.300s", req->reason);
  if (req->fatal) {
    zt_sched_finish(c, j, ZT_JOB_FAILED, "job_failed", "rank %d (%s): %s", m->rank, m->row.name,
                    reason);
    zt_sched_run(c);
    return 0;
  }
  zt_coord_event(c, j->row.id, "rank_failed", m->row.id, "generation %llu rank %d: %s",
                 (unsigned long long)req->generation, m->rank, reason);
  if (req->probed) remember_unreached(c, j, m, req);
  if (bad_checkpoint(c, j, req, reason)) return 0;
  char why[512];
  snprintf(why, sizeof why, "rank %d reported: %.300s", m->rank, reason);
  zt_fail_kind_t kind = fail_kind(req);
  if (kind == ZT_FAIL_PEER && req->probed) {
    peer_failure(c, j, m, req, why);
    return 0;
  }
  /* 1 + the rank, or 0; any int32 may arrive, so the range check comes
   * before the subtraction (INT32_MIN - 1 overflows). */
  quarantine_peer(c, j, m, req->suspect_rank > 0 ? req->suspect_rank - 1 : -1);
  if (kind == ZT_FAIL_MEMORY) learn_memory(c, j, m);
  zt_sched_fail_generation(c, j, kind, req->step, why, m);
  return 0;
}

/* ---- checkpoints ------------------------------------------------------------- */

/* An epoch's write failed: checkpointing is paused (the job trains on); a
 * checkpoint-now epoch (drain, scale-up) that was to end the generation
 * ends it without the epoch, and the job re-forms from the last one. */
static void checkpoint_failed(zt_coord_t *c, zt_job_t *j) {
  if (j->final_by_ms && j->ck->step >= j->row.total_steps) {
    char why[400];
    snprintf(why, sizeof why, "the final epoch's write failed: %.300s", j->ck->error);
    zt_sched_final_failed(c, j, why);
    return;
  }
  if (!j->ckpt_paused)
    zt_coord_event(c, j->row.id, "checkpointing_paused", 0,
                   "checkpoint writes fail; training goes on for at most %lld steps past step "
                   "%lld: %s",
                   (long long)j->p.max_uncommitted, (long long)j->safe_step, j->ck->error);
  j->ckpt_paused = 1;
  snprintf(j->ckpt_error, sizeof j->ckpt_error, "%s", j->ck->error);
  zt_jobtable_running_message(j);
  zt_jobtable_save(c, j);
  if (!j->ckpt_request) return;
  j->ckpt_request = 0;
  char reason[sizeof j->reform_reason + 256];
  snprintf(reason, sizeof reason, "%s: its checkpoint failed (%.200s)", j->reform_reason,
           j->ckpt_error);
  zt_sched_try_form(c, j, reason);
}

/* An epoch committed: counters, the end of a checkpointing pause,
 * retention, and then the scheduler's part (the final epoch, a re-form
 * that waited for it). */
static void epoch_committed(zt_coord_t *c, zt_job_t *j) {
  j->ckpt_commits++;
  j->safe_step = ZT_MAX(j->safe_step, j->ck->step);
  j->committed_step = ZT_MAX(j->committed_step, j->ck->step);
  j->committed_wall_ms = zt_wall_ms();
  j->storage_retries = 0; /* the storage works again */
  if (j->ckpt_paused) {
    j->ckpt_paused = 0;
    zt_coord_event(c, j->row.id, "checkpointing_resumed", 0, "step %lld committed",
                   (long long)j->ck->step);
    /* The job's message said checkpointing was paused: no longer true. */
    if (j->row.state == ZT_JOB_RUNNING) {
      zt_jobtable_running_message(j);
      zt_jobtable_save(c, j);
    }
  }
  zt_registry_gc(c, j);
  zt_sched_epoch_committed(c, j);
}

int zt_reports_checkpoint(zt_coord_t *c, const Ztrain__ReportCheckpointRequest *req,
                          int *committed) {
  zt_job_t *j;
  zt_member_t *m;
  zt_registry_outcome_t out;
  *committed = 0;
  if (zt_jobtable_fence(c, req->worker_id, req->job_id, req->generation, &j, &m) != 0) return -1;
  if (zt_registry_report(c, j, m, req, &out) != 0) return -1;
  if (out == ZT_REGISTRY_REPORT_FAILED) checkpoint_failed(c, j);
  if (out != ZT_REGISTRY_REPORT_COMMITTED) return 0;
  *committed = 1;
  epoch_committed(c, j);
  return 0;
}

/* The copied file a replica report names, and its epoch's directory
 * (resolved under the checkpoint root). */
static int copy_of(zt_coord_t *c, const Ztrain__ReportReplicaRequest *req, zt_db_ckpt_file_t *f,
                   char *dir, size_t dirlen) {
  const Ztrain__CheckpointFile *cf = req->file;
  if (!cf || strlen(cf->name) >= sizeof f->name || strlen(cf->checksum) >= sizeof f->checksum ||
      req->dir[0] == '/' ||
      zt_path_confine(c->cfg.ckpt_root, req->dir, "checkpoint dir", dir, dirlen) != 0)
    return zt_errk(ZT_E_INVALID, "a copy report names a relative epoch directory and a file");
  snprintf(f->name, sizeof f->name, "%s", cf->name);
  snprintf(f->checksum, sizeof f->checksum, "%s", cf->checksum);
  f->bytes = cf->bytes;
  return 0;
}

int zt_reports_replica(zt_coord_t *c, const Ztrain__ReportReplicaRequest *req, int *committed) {
  *committed = 0;
  zt_job_t *j = zt_jobtable_get(c, req->job_id);
  zt_member_t *m = zt_members_get(c, req->worker_id);
  if (!j) return zt_errk(ZT_E_NOT_FOUND, "unknown job %llu", (unsigned long long)req->job_id);
  if (!m) return zt_errk(ZT_E_NOT_FOUND, "unknown worker %llu", (unsigned long long)req->worker_id);
  zt_db_ckpt_file_t f;
  char dir[sizeof j->start_ckpt];
  if (copy_of(c, req, &f, dir, sizeof dir) != 0) return -1;
  zt_registry_outcome_t out;
  if (zt_registry_report_copy(c, j, m, dir, &f, &out) != 0) return -1;
  if (out != ZT_REGISTRY_REPORT_COMMITTED) return 0;
  *committed = 1;
  epoch_committed(c, j);
  return 0;
}
