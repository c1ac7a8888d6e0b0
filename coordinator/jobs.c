/*
 * jobs.c: jobs: submit, load at start, and what operators do to them.
 *
 * A job is a submitted spec plus a state machine (sched.c draws it): it
 * waits PENDING for workers, runs as a series of generations (fixed sets
 * of workers with ranks 0..N-1, re-formed whenever a member comes or goes
 * or fails), and ends COMPLETED, FAILED or CANCELED, or stays PAUSED until
 * an operator resumes it. The coordinator's part is split by concern
 * (jobs.c, reports.c, rollback.c, sched.c, rendezvous.c, jobtable.c,
 * params.c), each file calling only the files below it in the stack that
 * docs/architecture.md draws ("The coordinator, a stack of files";
 * tools/check-layers keeps it true). This one is at the top of them.
 *
 * Submit. A spec is read with the engine's parser and checked against the
 * coordinator's roots (params.c); a job no worker the coordinator has seen
 * could hold one rank of is refused, and so is a checkpoint.load that is
 * not an epoch this coordinator committed. The job is stored PENDING and
 * the scheduler runs at once.
 *
 * Load at start. Every stored job comes back with its current generation
 * (its members get their ranks back, so workers that reconnect in time go
 * on training in it: sched.c's zt_sched_reload) and the epoch it started
 * from. A job whose stored spec fails this coordinator's checks (a test
 * knob without --allow-test-knobs, a path outside a new root) fails,
 * saying why.
 *
 * Operator actions. Drain (a worker leaves its job after the next
 * checkpoint, or now without one), pause, resume (the restart and rollback
 * budgets and the excluded workers start afresh), cancel, and rollback
 * (rollback.c). Pause, resume, cancel and rollback store the job's row
 * before they change anything, so a refused write refuses the action and
 * leaves the job as it was.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "hfconfig.h"

/* ---- submit ------------------------------------------------------------------ */

static zt_job_t *job_new(const zt_db_job_t *row) {
  zt_job_t *j = zt_xcalloc(1, sizeof *j);
  j->row = *row;
  j->spec = zt_xstrdup(row->spec);
  j->row.spec = j->spec;
  j->rb_ckpt_step = -1;
  return j;
}

static void job_append(zt_coord_t *c, zt_job_t *j) {
  zt_spike_cfg_t sc = {(int)j->p.rb_window, j->p.rb_threshold, (int)j->p.rb_patience, 0};
  zt_spike_init(&j->det, &sc);
  zt_job_t **tail = &c->jobs;
  while (*tail) tail = &(*tail)->next;
  *tail = j;
}

/* A job no worker the coordinator has ever seen could hold one rank of,
 * at its most favourable world size, is refused at submit. With no worker
 * known yet it is accepted (and waits, saying what it needs). */
static int check_admissible(zt_coord_t *c, const zt_job_params_t *p) {
  int best = p->max_workers;
  while (best > p->min_workers && !zt_params_world_ok(p, best)) best--;
  const zt_memplan_need_t *need = &p->need[best];
  uint64_t host = 0, dev = 0;
  int known = 0;
  for (size_t i = 0; i < c->by_id_cap; i++) {
    zt_member_t *m = c->by_id[i];
    if (!m) continue;
    if (zt_memplan_fits(need, m->row.host_memory, m->row.device_memory)) return 0;
    known = 1;
    host = ZT_MAX(host, m->row.host_memory);
    dev = ZT_MAX(dev, m->row.device_memory);
  }
  if (!known) return 0;
  char h[32], d[32], hh[32], dd[32];
  return zt_errk(ZT_E_INVALID,
                 "no worker could hold one rank of this job: at world size %d (ZeRO stage %d) "
                 "a rank needs %s of RAM on a CPU worker or %s of GPU memory on a GPU worker; "
                 "the largest workers have %s of RAM and %s of GPU memory (raise "
                 "elastic.max_workers, the ZeRO stage, or lower the micro batch)",
                 best, p->zero_stage, zt_memplan_text(need->host, h, sizeof h),
                 zt_memplan_text(need->device, d, sizeof d), zt_memplan_text(host, hh, sizeof hh),
                 zt_memplan_text(dev, dd, sizeof dd));
}

/* checkpoint.load names an epoch this coordinator committed, with its
 * checksums. */
static int check_load(zt_coord_t *c, const zt_job_params_t *p) {
  if (!p->ckpt_load[0]) return 0;
  zt_db_ckpt_file_t *files;
  int n;
  if (zt_registry_record(c, p->ckpt_load, &files, &n) != 0)
    return zt_err_wrapk(zt_err_kind() == ZT_E_NOT_FOUND ? ZT_E_INVALID : zt_err_kind(),
                        "checkpoint.load");
  free(files);
  return 0;
}

/* Stores the new job's row (PENDING) and the submit event in one
 * transaction; row->id is then set. */
static int insert_row(zt_coord_t *c, const zt_job_params_t *p, const char *spec,
                      zt_db_job_t *row) {
  snprintf(row->name, sizeof row->name, "%s", p->name);
  row->spec = spec;
  row->state = ZT_JOB_PENDING;
  row->total_steps = p->steps;
  row->min_workers = p->min_workers;
  row->max_workers = p->max_workers;
  row->lr_factor = 1.0;
  row->created_ms = row->updated_ms = zt_wall_ms();
  snprintf(row->message, sizeof row->message, "waiting for %d workers", p->min_workers);
  if (zt_db_begin(c->db) != 0 || zt_db_job_insert(c->db, row) != 0 ||
      zt_coord_event_tx(c, 0, "job_submitted", 0, "") != 0 || zt_db_commit(c->db) != 0) {
    zt_err_wrapk(ZT_E_UNAVAILABLE, "cannot store job");
    zt_db_rollback(c->db);
    return -1;
  }
  return 0;
}

int zt_jobs_submit(zt_coord_t *c, const char *spec, uint64_t *id) {
  zt_job_params_t p;
  char *resolved = NULL; /* the spec with a pretrained model's section filled in */
  if (zt_hfconfig_resolve(spec, strlen(spec), c->cfg.data_root, &resolved) != 0)
    return zt_err_wrapk(ZT_E_INVALID, "job spec");
  if (resolved) spec = resolved;
  zt_db_job_t *row = NULL;
  if (zt_params_parse(spec, &c->cfg, &p) != 0 || check_admissible(c, &p) != 0 ||
      check_load(c, &p) != 0)
    goto err;
  row = zt_xcalloc(1, sizeof *row);
  if (insert_row(c, &p, spec, row) != 0) goto err;
  zt_job_t *j = job_new(row); /* copies the spec */
  free(row);
  free(resolved);
  j->p = p;
  job_append(c, j);
  *id = j->row.id;
  zt_coord_event(c, j->row.id, "job_accepted", 0,
                 "\"%s\": %lld steps, global batch %lld (micro %lld), workers %d..%d", p.name,
                 (long long)p.steps, (long long)p.global_batch, (long long)p.micro, p.min_workers,
                 p.max_workers);
  zt_sched_run(c);
  return 0;
err:
  free(row);
  free(resolved);
  return -1;
}

/* ---- load at start ----------------------------------------------------------- */

static int load_job(const zt_db_job_t *row, void *user) {
  zt_coord_t *c = user;
  zt_job_t *j = job_new(row);
  if (zt_params_parse(j->spec, &c->cfg, &j->p) != 0) {
    snprintf(j->spec_error, sizeof j->spec_error, "%s", zt_err_msg());
    ZT_WARN("job %llu: stored spec no longer valid: %s", (unsigned long long)row->id,
            j->spec_error);
  }
  zt_sched_reload(c, j);
  job_append(c, j);
  return 0;
}

/* A job whose stored spec fails this coordinator's checks (submitted with
 * fault_injection under --allow-test-knobs, restarted without it; a data
 * path outside a new --data-root) has no scheduling parameters: it fails,
 * saying why, in memory and in the database, unless it has ended already.
 * Done once every row is read: no job row is written while they are. */
static void fail_invalid_specs(zt_coord_t *c) {
  for (zt_job_t *j = c->jobs; j; j = j->next)
    if (j->spec_error[0] && (zt_jobtable_active(j) || j->row.state == ZT_JOB_PAUSED))
      zt_sched_finish(c, j, ZT_JOB_FAILED, "job_failed", "stored spec invalid: %s",
                      j->spec_error);
}

int zt_jobs_load(zt_coord_t *c) {
  if (zt_db_jobs_each(c->db, load_job, c) != 0) return -1;
  fail_invalid_specs(c);
  return 0;
}

void zt_jobs_free(zt_coord_t *c) {
  while (c->jobs) {
    zt_job_t *j = c->jobs;
    c->jobs = j->next;
    free(j->spec);
    free(j->start_files);
    zt_registry_forget(j);
    free(j);
  }
}

/* ---- drains ------------------------------------------------------------------ */

int zt_jobs_drain(zt_coord_t *c, zt_member_t *m, char *msg, size_t msglen) {
  zt_job_t *j = m->job_id ? zt_jobtable_get(c, m->job_id) : NULL;
  m->draining = 1;
  if (!j || !zt_jobtable_active(j)) {
    snprintf(msg, msglen, "worker %s is idle; it will not be scheduled", m->row.name);
    return 0;
  }
  if (!j->p.ckpt_dir[0] || j->ckpt_paused) {
    snprintf(msg, msglen, "job %llu %s: worker %s leaves now", (unsigned long long)j->row.id,
             j->ckpt_paused ? "cannot write checkpoints now" : "has no checkpoints", m->row.name);
    zt_sched_member_gone(c, m, "drained", 0);
    return 0;
  }
  j->ckpt_request = 1;
  j->reform_scale_up = 0;
  snprintf(j->reform_reason, sizeof j->reform_reason, "drain of worker %s", m->row.name);
  zt_coord_event(c, j->row.id, "checkpoint_requested", m->row.id, "%s", j->reform_reason);
  snprintf(msg, msglen, "worker %s leaves job %llu after the next checkpoint", m->row.name,
           (unsigned long long)j->row.id);
  return 0;
}

int zt_jobs_leave_drains(zt_coord_t *c, zt_member_t *m) {
  zt_job_t *j = m->job_id ? zt_jobtable_get(c, m->job_id) : NULL;
  if (!j || !zt_jobtable_active(j) || !j->p.ckpt_dir[0] || j->row.state != ZT_JOB_RUNNING)
    return 0;
  char msg[256];
  zt_jobs_drain(c, m, msg, sizeof msg);
  return 1;
}

/* ---- operator actions -------------------------------------------------------- */

static const char *const k_action_names[] = {
    [ZT_ACT_PAUSE] = "pause", [ZT_ACT_RESUME] = "resume", [ZT_ACT_CANCEL] = "cancel",
    [ZT_ACT_ROLLBACK] = "rollback"};

int zt_jobs_action_parse(const char *name, zt_job_action_t *out) {
  for (size_t i = 0; i < ZT_ARRAY_LEN(k_action_names); i++)
    if (!strcmp(name, k_action_names[i])) {
      *out = (zt_job_action_t)i;
      return 0;
    }
  return zt_errk(ZT_E_INVALID, "unknown action \"%.32s\" (pause, resume, cancel, rollback)", name);
}

static int act_pause_cancel(zt_coord_t *c, zt_job_t *j, zt_job_action_t a, char *msg,
                            size_t msglen) {
  int pause = a == ZT_ACT_PAUSE;
  /* A paused job can be canceled (it is kept until then, to be resumed). */
  if (!zt_jobtable_active(j) && (pause || j->row.state != ZT_JOB_PAUSED))
    return zt_errk(ZT_E_STATE, "job %llu is %s", (unsigned long long)j->row.id,
                   zt_name_job_state(j->row.state));
  zt_db_job_t next = j->row;
  next.state = pause ? ZT_JOB_PAUSED : ZT_JOB_CANCELED;
  snprintf(next.message, sizeof next.message, "%s by operator at step %lld",
           pause ? "paused" : "canceled", (long long)j->row.step);
  if (zt_jobtable_store_first(c, j, &next, pause ? "pause" : "cancellation") != 0) return -1;
  zt_sched_finish(c, j, next.state, pause ? "job_paused" : "job_canceled", "%s", next.message);
  snprintf(msg, msglen, "%s", j->row.message);
  zt_sched_run(c);
  return 0;
}

static int act_resume(zt_coord_t *c, zt_job_t *j, char *msg, size_t msglen) {
  if (j->spec_error[0])
    return zt_errk(ZT_E_STATE, "job %llu cannot be resumed: stored spec invalid: %s",
                   (unsigned long long)j->row.id, j->spec_error);
  if (j->row.state != ZT_JOB_PAUSED)
    return zt_errk(ZT_E_STATE, "job %llu is %s, not paused", (unsigned long long)j->row.id,
                   zt_name_job_state(j->row.state));
  zt_db_job_t next = j->row;
  next.state = ZT_JOB_PENDING;
  snprintf(next.message, sizeof next.message, "resumed by operator");
  next.n_rollback_steps = 0; /* the rollback and restart budgets start afresh */
  if (zt_jobtable_store_first(c, j, &next, "resumption") != 0) return -1;
  j->row = next;
  zt_restarts_reset(&j->rs);
  j->n_excluded = 0; /* the operator fixed the cause */
  j->ckpt_paused = 0;
  zt_coord_event(c, j->row.id, "job_resumed", 0, "resumed at step %lld", (long long)j->row.step);
  snprintf(msg, msglen, "job %llu resumed", (unsigned long long)j->row.id);
  zt_sched_run(c);
  return 0;
}

int zt_jobs_action(zt_coord_t *c, uint64_t id, zt_job_action_t action, int64_t to_step,
                   int64_t skip_steps, char *msg, size_t msglen) {
  zt_job_t *j = zt_jobtable_get(c, id);
  if (!j) return zt_errk(ZT_E_NOT_FOUND, "unknown job %llu", (unsigned long long)id);
  switch (action) {
    case ZT_ACT_PAUSE:
    case ZT_ACT_CANCEL: return act_pause_cancel(c, j, action, msg, msglen);
    case ZT_ACT_RESUME: return act_resume(c, j, msg, msglen);
    case ZT_ACT_ROLLBACK: return zt_rollback_operator(c, j, to_step, skip_steps, msg, msglen);
  }
  return zt_errk(ZT_E_INVALID, "unknown action %d", (int)action);
}
