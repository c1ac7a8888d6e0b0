/*
 * jobs.c: jobs, generations and rendezvous: the coordinator's scheduler.
 *
 * A job is a submitted spec plus a state machine:
 *
 *   PENDING --(>= min_workers idle)--> RECONFIGURING(gen g) --(all ranks
 *   rendezvoused)--> RUNNING(g) --(member lost/left/failed)--> RECONFIGURING
 *   (g+1) ... --> COMPLETED | FAILED | CANCELED
 *
 * A generation is a fixed set of workers with ranks 0..N-1. Forming one
 * writes the generation, its members and the job row in one transaction,
 * then tells each member through its next heartbeat reply (RECONFIGURE with
 * the job and generation). Each member then calls Rendezvous with the
 * address of its collective socket; those calls are held here (a long poll)
 * until every rank has called, then all are answered at once with the peer
 * list, so every rank starts its ring with the same view.
 *
 * Fencing. Every worker-facing call names a job and a generation. A call
 * for any generation other than the job's current one is refused with
 * FAILED_PRECONDITION; a heartbeat from a worker that still believes in an
 * old assignment is answered RECONFIGURE (new assignment) or STOP (none).
 * A paused or partitioned worker therefore can never report into a newer
 * generation.
 *
 * World size. The global batch (train_batch_size samples) is fixed for the
 * life of the job; a generation of N ranks runs accum = global / (micro * N)
 * micro-steps per step, so N must divide global / micro. The scheduler picks
 * the largest such N between min_workers and max_workers that the alive
 * workers allow.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "spec.h"
#include "data.h"
#include "ztrain.pb-c.h"

/* ---- spec essentials ------------------------------------------------------- */

/* The numbers that shape scheduling, from the trainer's own parser
 * (worker/spec.c), so the coordinator and the workers can never read a
 * spec differently. */
int zt_job_params_parse(const char *json, zt_job_params *p, char *err, size_t errlen) {
  memset(p, 0, sizeof *p);
  zt_spec_t s;
  if (zt_spec_parse(&s, json, strlen(json)) != 0) {
    snprintf(err, errlen, "%s", zt_err_msg());
    zt_spec_free(&s);
    return -1;
  }
  snprintf(p->name, sizeof p->name, "%s", s.name);
  p->steps = s.steps;
  p->micro = s.micro_batch;
  p->global_batch = s.global_batch;
  p->seq_len = s.model.seq_len;
  p->min_workers = s.min_workers;
  p->max_workers = s.max_workers;
  p->comm_timeout_ms = s.comm_timeout_ms;
  if (strlen(s.ckpt.dir) >= sizeof p->ckpt_dir || strlen(s.ckpt.load) >= sizeof p->ckpt_load) {
    snprintf(err, errlen, "checkpoint.dir or checkpoint.load: path too long (max %zu)",
             sizeof p->ckpt_dir - 1);
    zt_spec_free(&s);
    return -1;
  }
  snprintf(p->ckpt_dir, sizeof p->ckpt_dir, "%.399s", s.ckpt.dir);
  snprintf(p->ckpt_load, sizeof p->ckpt_load, "%.511s", s.ckpt.load);
  p->ckpt_every = s.ckpt.every_steps;
  p->keep_last = s.ckpt.keep_last > 0 ? s.ckpt.keep_last : 2;
  p->keep_every = s.ckpt.keep_every;
  p->rb_enabled = s.rollback.enabled;
  p->rb_window = s.rollback.window;
  p->rb_threshold = s.rollback.threshold;
  p->rb_patience = s.rollback.patience;
  p->rb_margin = s.rollback.margin_steps;
  p->rb_skip = s.rollback.skip_steps;
  p->rb_lr_factor = s.rollback.lr_factor;
  p->rb_cooldown = s.rollback.cooldown_steps;
  p->rb_max = s.rollback.max_rollbacks;
  p->rb_per_steps = s.rollback.per_steps;
  zt_spec_free(&s);
  if (p->max_workers > ZT_MAX_WORLD) {
    snprintf(err, errlen, "elastic.max_workers %d exceeds %d", p->max_workers, ZT_MAX_WORLD);
    return -1;
  }
  /* Some N in [min, max] must divide the number of micro-batches per step. */
  int any = 0;
  for (int n = p->min_workers; n <= p->max_workers; n++)
    any |= (p->global_batch / p->micro) % n == 0;
  if (!any) {
    snprintf(err, errlen,
             "no world size in %d..%d divides train_batch_size / micro batch = %lld; the global "
             "batch must stay fixed when workers come and go",
             p->min_workers, p->max_workers, (long long)(p->global_batch / p->micro));
    return -1;
  }
  return 0;
}

/* ---- bookkeeping ------------------------------------------------------------- */

zt_job *zt_jobs_get(zt_coord *c, uint64_t id) {
  for (zt_job *j = c->jobs; j; j = j->next)
    if (j->row.id == id) return j;
  return NULL;
}

static int job_active(const zt_job *j) {
  return j->row.state == ZT_JOB_PENDING || j->row.state == ZT_JOB_RUNNING ||
         j->row.state == ZT_JOB_RECONFIGURING;
}

static int save_job(zt_coord *c, zt_job *j) {
  j->row.updated_ms = zt_wall_ms();
  if (zt_db_job_update(c->db, &j->row) != 0) {
    ZT_ERROR("job %llu: %s", (unsigned long long)j->row.id, zt_err_msg());
    return -1;
  }
  return 0;
}

/* Answers every held Rendezvous call of the job with an error. */
static void release_rendezvous(zt_job *j, int status, const char *why) {
  for (int r = 0; r < ZT_MAX_WORLD; r++) {
    if (j->rdv[r]) zt_rpc_reply(j->rdv[r], status, why, NULL, 0);
    j->rdv[r] = NULL;
    j->comm_addr[r][0] = 0;
  }
  j->arrived = 0;
}

/* Detaches every member of the job's current generation. */
static void release_members(zt_coord *c, zt_job *j) {
  for (int r = 0; r < j->row.world; r++) {
    zt_member *m = zt_members_get(c, j->workers[r]);
    if (m && m->job_id == j->row.id) m->job_id = m->gen = 0, m->rank = -1;
  }
}

static void finish(zt_coord *c, zt_job *j, int state, const char *kind, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void finish(zt_coord *c, zt_job *j, int state, const char *kind, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(j->row.message, sizeof j->row.message, fmt, ap);
  va_end(ap);
  release_rendezvous(j, ZT_RPC_ABORTED, "job ended");
  release_members(c, j);
  j->row.state = state;
  save_job(c, j);
  zt_coord_event(c, j->row.id, kind, 0, "%s", j->row.message);
}

typedef struct {
  int64_t max_step;
  zt_db_ckpt best;
  int found;
} pick_ctx;

static int pick_before(const zt_db_ckpt *k, void *user) {
  pick_ctx *p = user;
  if (k->state == ZT_CKPT_COMMITTED && k->step <= p->max_step &&
      (!p->found || k->step >= p->best.step))
    p->best = *k, p->found = 1;
  return 0;
}

/* ---- scheduling ---------------------------------------------------------------- */

static int member_usable(const zt_member *m) {
  return m && m->row.state == ZT_WORKER_ALIVE && !m->draining && !m->quarantine_ms;
}

/* ---- data skip ranges (stream positions) -------------------------------------- */

typedef struct {
  uint64_t start, end;
} skip_range;

static int parse_skips(const char *s, skip_range *out, int max) {
  int n = 0;
  while (s && *s && n < max) {
    unsigned long long a, b;
    if (sscanf(s, "%llu-%llu", &a, &b) != 2) break;
    out[n].start = a, out[n].end = b, n++;
    s = strchr(s, ',');
    if (s) s++;
  }
  return n;
}

static void add_skip(zt_job *j, uint64_t start, uint64_t end) {
  skip_range r[64];
  int n = parse_skips(j->row.skips, r, 63);
  int at = n;
  for (int i = 0; i < n; i++)
    if (r[i].start > start) {
      at = i;
      break;
    }
  memmove(&r[at + 1], &r[at], (size_t)(n - at) * sizeof *r);
  r[at].start = start, r[at].end = end;
  n++;
  char buf[sizeof j->row.skips] = "";
  for (int i = 0; i < n; i++) {
    size_t l = strlen(buf);
    snprintf(buf + l, sizeof buf - l, "%s%llu-%llu", i ? "," : "", (unsigned long long)r[i].start,
             (unsigned long long)r[i].end);
  }
  snprintf(j->row.skips, sizeof j->row.skips, "%s", buf);
}

/* Forms the next generation if enough workers are available. */
static void try_form(zt_coord *c, zt_job *j, const char *reason) {
  uint64_t pick[ZT_MAX_WORLD];
  int n = 0;
  /* Survivors of the current generation first, in rank order... */
  if (j->row.state != ZT_JOB_PENDING)
    for (int r = 0; r < j->row.world && n < j->p.max_workers; r++) {
      zt_member *m = zt_members_get(c, j->workers[r]);
      if (member_usable(m) && m->job_id == j->row.id) pick[n++] = m->row.id;
    }
  /* ...then idle workers by id. */
  for (size_t i = 0; i < c->by_id_cap && n < j->p.max_workers; i++) {
    zt_member *m = c->by_id[i];
    if (member_usable(m) && m->job_id == 0) pick[n++] = m->row.id;
  }
  int64_t micro_batches = j->p.global_batch / j->p.micro;
  while (n >= j->p.min_workers && micro_batches % n != 0) n--;
  if (n < j->p.min_workers) {
    if (j->row.state != ZT_JOB_PENDING) {
      release_rendezvous(j, ZT_RPC_ABORTED, "not enough workers; job pending");
      release_members(c, j);
      j->row.state = ZT_JOB_PENDING;
      snprintf(j->row.message, sizeof j->row.message, "waiting for %d workers (%s)",
               j->p.min_workers, reason);
      save_job(c, j);
      zt_coord_event(c, j->row.id, "job_pending", 0, "%s", j->row.message);
    }
    return;
  }
  release_rendezvous(j, ZT_RPC_ABORTED, "generation superseded");
  release_members(c, j);
  uint64_t gen = j->row.generation + 1;
  /* A new generation resumes from the newest committed checkpoint. */
  int64_t start_step = 0;
  zt_db_ckpt ck;
  int have_ck = 0;
  if (j->rb_ckpt_step >= 0) { /* a rollback chose the epoch (or a fresh start) */
    have_ck = j->rb_ckpt_dir[0] != 0;
    ck.step = j->rb_ckpt_step;
    snprintf(ck.dir, sizeof ck.dir, "%s", j->rb_ckpt_dir);
    start_step = j->rb_ckpt_step;
  } else if (j->p.ckpt_dir[0] && zt_ckpt_latest(c, j, &ck, &have_ck) == 0 && have_ck) {
    start_step = ck.step;
  } else if (j->p.ckpt_load[0]) { /* the worker reads the step from its manifest */
    have_ck = 1;
    snprintf(ck.dir, sizeof ck.dir, "%s", j->p.ckpt_load);
  }
  zt_db_job next = j->row;
  next.generation = gen;
  next.world = n;
  next.step = start_step;
  next.state = ZT_JOB_RECONFIGURING;
  next.restarts = j->row.generation ? j->row.restarts + 1 : 0;
  next.updated_ms = zt_wall_ms();
  snprintf(next.message, sizeof next.message, "generation %llu forming with %d workers",
           (unsigned long long)gen, n);
  if (zt_db_begin(c->db) != 0) goto dberr;
  if (zt_db_generation_add(c->db, j->row.id, gen, n, start_step, reason, pick) != 0 ||
      zt_db_job_update(c->db, &next) != 0 || zt_db_commit(c->db) != 0) {
    zt_db_rollback(c->db);
    goto dberr;
  }
  j->row = next;
  j->rb_ckpt_step = -1;
  j->rb_ckpt_dir[0] = 0;
  j->ckpt_request = 0;
  j->poisoned_from = 0;
  /* The baseline survives a new generation (replayed steps rejoin it); only
   * a run of suspicious steps in progress is forgotten. */
  j->det.run = 0;
  memcpy(j->workers, pick, (size_t)n * sizeof *pick);
  j->formed_ms = zt_now_ms();
  j->start_step = start_step;
  snprintf(j->start_ckpt, sizeof j->start_ckpt, "%s", have_ck ? ck.dir : "");
  for (int r = 0; r < n; r++) {
    zt_member *m = zt_members_get(c, pick[r]);
    m->job_id = j->row.id, m->gen = gen, m->rank = r;
  }
  char names[512] = "";
  for (int r = 0; r < n; r++) {
    size_t l = strlen(names);
    snprintf(names + l, sizeof names - l, "%s%s", r ? "," : "", zt_members_get(c, pick[r])->row.name);
  }
  zt_coord_event(c, j->row.id, "generation_started", 0,
                 "generation %llu: world %d, accum %lld, start step %lld, workers [%s]; reason: %s",
                 (unsigned long long)gen, n, (long long)(micro_batches / n), (long long)start_step,
                 names, reason);
  zt_ckpt_gc(c, j); /* pending epochs of the old generation can never commit */
  return;
dberr:
  ZT_ERROR("job %llu: cannot form generation: %s", (unsigned long long)j->row.id, zt_err_msg());
}

/* Number of idle usable workers. */
static int idle_workers(zt_coord *c) {
  int n = 0;
  for (size_t i = 0; i < c->by_id_cap; i++) n += member_usable(c->by_id[i]) && !c->by_id[i]->job_id;
  return n;
}

void zt_jobs_schedule(zt_coord *c) {
  for (zt_job *j = c->jobs; j; j = j->next) {
    if (j->row.state == ZT_JOB_PENDING) {
      try_form(c, j, "enough workers");
    } else if (j->row.state == ZT_JOB_RUNNING && j->p.ckpt_dir[0] && !j->ckpt_request &&
               j->row.world < j->p.max_workers) {
      /* Scale up at a checkpoint boundary: ask for one now if a larger
       * valid world is available. */
      int avail = j->row.world + idle_workers(c), n = ZT_MIN(avail, j->p.max_workers);
      while (n > j->row.world && (j->p.global_batch / j->p.micro) % n != 0) n--;
      if (n > j->row.world) {
        j->ckpt_request = 1;
        snprintf(j->reform_reason, sizeof j->reform_reason, "scale-up from %d to %d workers",
                 j->row.world, n);
        zt_coord_event(c, j->row.id, "checkpoint_requested", 0, "%s", j->reform_reason);
      }
    }
  }
}

void zt_jobs_checkpoint_committed(zt_coord *c, zt_job *j) {
  if (!j->ckpt_request) return;
  j->ckpt_request = 0;
  char reason[300];
  snprintf(reason, sizeof reason, "%s after checkpoint step %lld", j->reform_reason,
           (long long)j->ck_step);
  try_form(c, j, reason);
  /* Drained workers are out now; they are told STOP and stay idle. */
  for (size_t i = 0; i < c->by_id_cap; i++) {
    zt_member *m = c->by_id[i];
    if (m && m->draining && m->job_id != j->row.id)
      zt_coord_event(c, j->row.id, "drained", m->row.id, "worker %s left the job at step %lld",
                     m->row.name, (long long)j->ck_step);
  }
}

int zt_jobs_drain(zt_coord *c, zt_member *m, char *msg, size_t msglen) {
  zt_job *j = m->job_id ? zt_jobs_get(c, m->job_id) : NULL;
  m->draining = 1;
  if (!j || !job_active(j)) {
    snprintf(msg, msglen, "worker %s is idle; it will not be scheduled", m->row.name);
    return ZT_RPC_OK;
  }
  if (!j->p.ckpt_dir[0]) {
    snprintf(msg, msglen, "job %llu has no checkpoints: worker %s leaves now",
             (unsigned long long)j->row.id, m->row.name);
    zt_jobs_member_gone(c, m, "drained");
    return ZT_RPC_OK;
  }
  j->ckpt_request = 1;
  snprintf(j->reform_reason, sizeof j->reform_reason, "drain of worker %s", m->row.name);
  zt_coord_event(c, j->row.id, "checkpoint_requested", m->row.id, "%s", j->reform_reason);
  snprintf(msg, msglen, "worker %s leaves job %llu after the next checkpoint", m->row.name,
           (unsigned long long)j->row.id);
  return ZT_RPC_OK;
}

int zt_jobs_leave_drains(zt_coord *c, zt_member *m) {
  zt_job *j = m->job_id ? zt_jobs_get(c, m->job_id) : NULL;
  if (!j || !job_active(j) || !j->p.ckpt_dir[0] || j->row.state != ZT_JOB_RUNNING) return 0;
  char msg[256];
  zt_jobs_drain(c, m, msg, sizeof msg);
  return 1;
}

int zt_jobs_action(zt_coord *c, uint64_t id, const char *action, int64_t to_step,
                   int64_t skip_steps, char *msg, size_t msglen) {
  zt_job *j = zt_jobs_get(c, id);
  if (!j) {
    snprintf(msg, msglen, "unknown job %llu", (unsigned long long)id);
    return ZT_RPC_NOT_FOUND;
  }
  if (!strcmp(action, "pause") || !strcmp(action, "cancel")) {
    if (!job_active(j)) {
      snprintf(msg, msglen, "job %llu is %s", (unsigned long long)id,
               zt_job_state_name(j->row.state));
      return ZT_RPC_FAILED_PRECONDITION;
    }
    int pause = action[0] == 'p';
    finish(c, j, pause ? ZT_JOB_PAUSED : ZT_JOB_CANCELED, pause ? "job_paused" : "job_canceled",
           "%s by operator at step %lld", pause ? "paused" : "canceled", (long long)j->row.step);
    snprintf(msg, msglen, "%s", j->row.message);
    zt_jobs_schedule(c);
    return ZT_RPC_OK;
  }
  if (!strcmp(action, "resume")) {
    if (j->row.state != ZT_JOB_PAUSED) {
      snprintf(msg, msglen, "job %llu is %s, not paused", (unsigned long long)id,
               zt_job_state_name(j->row.state));
      return ZT_RPC_FAILED_PRECONDITION;
    }
    j->row.state = ZT_JOB_PENDING;
    snprintf(j->row.message, sizeof j->row.message, "resumed by operator");
    /* The rollback budget starts afresh. */
    j->row.rollback_steps[0] = 0;
    save_job(c, j);
    zt_coord_event(c, j->row.id, "job_resumed", 0, "resumed at step %lld", (long long)j->row.step);
    snprintf(msg, msglen, "job %llu resumed", (unsigned long long)id);
    zt_jobs_schedule(c);
    return ZT_RPC_OK;
  }
  if (!strcmp(action, "rollback")) {
    if (!job_active(j) && j->row.state != ZT_JOB_PAUSED) {
      snprintf(msg, msglen, "job %llu is %s", (unsigned long long)id,
               zt_job_state_name(j->row.state));
      return ZT_RPC_FAILED_PRECONDITION;
    }
    if (to_step < 0 || skip_steps < 0) {
      snprintf(msg, msglen, "--to-step and --skip must be >= 0");
      return ZT_RPC_INVALID_ARGUMENT;
    }
    char why[128];
    snprintf(why, sizeof why, "operator rollback to step %lld", (long long)to_step);
    if (j->row.state == ZT_JOB_PAUSED) j->row.state = ZT_JOB_RECONFIGURING;
    zt_coord_event(c, j->row.id, "rollback_requested", 0, "%s, skipping %lld batches", why,
                   (long long)skip_steps);
    /* The skip covers skip_steps batches right after the chosen epoch. */
    pick_ctx pc = {to_step, {0}, 0};
    if (j->p.ckpt_dir[0]) zt_db_ckpts_each(c->db, j->row.id, pick_before, &pc);
    int64_t from = (pc.found ? pc.best.step : 0) + 1;
    int64_t saved_max = j->p.rb_max;
    j->p.rb_max = 1 << 30; /* an operator's rollback is not budgeted */
    zt_jobs_rollback(c, j, from, from - 1, to_step, skip_steps, why);
    j->p.rb_max = saved_max;
    snprintf(msg, msglen, "job %llu rolling back to step %lld", (unsigned long long)id,
             (long long)(pc.found ? pc.best.step : 0));
    return ZT_RPC_OK;
  }
  snprintf(msg, msglen, "unknown action \"%.32s\" (pause, resume, cancel, rollback)", action);
  return ZT_RPC_INVALID_ARGUMENT;
}

void zt_jobs_member_gone(zt_coord *c, zt_member *m, const char *why) {
  zt_job *j = m->job_id ? zt_jobs_get(c, m->job_id) : NULL;
  if (!j || !job_active(j)) return;
  char reason[256];
  snprintf(reason, sizeof reason, "worker %s (rank %d) %s", m->row.name, m->rank, why);
  m->job_id = m->gen = 0, m->rank = -1;
  try_form(c, j, reason);
}

/* ---- load at start --------------------------------------------------------------- */

static int load_job(const zt_db_job *row, void *user) {
  zt_coord *c = user;
  zt_job *j = calloc(1, sizeof *j);
  if (!j) abort();
  j->row = *row;
  j->spec = strdup(row->spec);
  j->row.spec = j->spec;
  char err[256];
  if (zt_job_params_parse(j->spec, &j->p, err, sizeof err) != 0)
    ZT_WARN("job %llu: stored spec no longer valid: %s", (unsigned long long)row->id, err);
  j->rb_ckpt_step = -1;
  zt_spike_cfg sc = {(int)j->p.rb_window, j->p.rb_threshold, (int)j->p.rb_patience, 0};
  zt_spike_init(&j->det, &sc);
  int n = 0;
  if (j->row.generation &&
      zt_db_generation_members(c->db, j->row.id, j->row.generation, j->workers, ZT_MAX_WORLD,
                               &n) == 0 &&
      job_active(j) && j->row.state != ZT_JOB_PENDING) {
    for (int r = 0; r < n; r++) {
      zt_member *m = zt_members_get(c, j->workers[r]);
      if (m) m->job_id = j->row.id, m->gen = j->row.generation, m->rank = r;
    }
  }
  j->formed_ms = zt_now_ms();
  /* The current generation resumed from the newest committed epoch that
   * precedes it; after a restart that is still the newest one at or
   * below the generation's start step. */
  zt_db_ckpt ck;
  int have = 0;
  if (j->p.ckpt_dir[0] && zt_ckpt_latest(c, j, &ck, &have) == 0 && have) {
    snprintf(j->start_ckpt, sizeof j->start_ckpt, "%s", ck.dir);
    j->start_step = ck.step;
  }
  zt_job **tail = &c->jobs;
  while (*tail) tail = &(*tail)->next;
  *tail = j;
  return 0;
}

int zt_jobs_load(zt_coord *c) { return zt_db_jobs_each(c->db, load_job, c); }

void zt_jobs_release_calls(zt_coord *c) {
  for (zt_job *j = c->jobs; j; j = j->next)
    release_rendezvous(j, ZT_RPC_UNAVAILABLE, "coordinator stopping; call again");
}

void zt_jobs_free(zt_coord *c) {
  while (c->jobs) {
    zt_job *j = c->jobs;
    c->jobs = j->next;
    free(j->spec);
    free(j);
  }
}

/* ---- operations from the services -------------------------------------------------- */

int zt_jobs_submit(zt_coord *c, const char *spec, uint64_t *id, char *msg, size_t msglen) {
  zt_job_params p;
  if (zt_job_params_parse(spec, &p, msg, msglen) != 0) return ZT_RPC_INVALID_ARGUMENT;
  zt_job *j = calloc(1, sizeof *j);
  if (!j) abort();
  j->p = p;
  j->rb_ckpt_step = -1;
  j->row.lr_factor = 1.0;
  zt_spike_cfg sc = {(int)p.rb_window, p.rb_threshold, (int)p.rb_patience, 0};
  zt_spike_init(&j->det, &sc);
  j->spec = strdup(spec);
  snprintf(j->row.name, sizeof j->row.name, "%s", p.name);
  j->row.spec = j->spec;
  j->row.state = ZT_JOB_PENDING;
  j->row.total_steps = p.steps;
  j->row.min_workers = p.min_workers;
  j->row.max_workers = p.max_workers;
  j->row.created_ms = j->row.updated_ms = zt_wall_ms();
  snprintf(j->row.message, sizeof j->row.message, "waiting for %d workers", p.min_workers);
  if (zt_db_begin(c->db) != 0 || zt_db_job_insert(c->db, &j->row) != 0 ||
      zt_db_event_add(c->db, 0, "job_submitted", 0, "", NULL) != 0 || zt_db_commit(c->db) != 0) {
    zt_db_rollback(c->db);
    snprintf(msg, msglen, "cannot store job: %s", zt_err_msg());
    free(j->spec);
    free(j);
    return ZT_RPC_UNAVAILABLE;
  }
  zt_job **tail = &c->jobs;
  while (*tail) tail = &(*tail)->next;
  *tail = j;
  *id = j->row.id;
  zt_coord_event(c, j->row.id, "job_accepted", 0,
                 "\"%s\": %lld steps, global batch %lld (micro %lld), workers %d..%d", p.name,
                 (long long)p.steps, (long long)p.global_batch, (long long)p.micro, p.min_workers,
                 p.max_workers);
  zt_jobs_schedule(c);
  return ZT_RPC_OK;
}

/* Checks that a worker-facing call names the current generation. */
static int fence(zt_coord *c, uint64_t wid, uint64_t job_id, uint64_t gen, zt_job **jout,
                 zt_member **mout, char *msg, size_t msglen) {
  zt_member *m = zt_members_get(c, wid);
  zt_job *j = zt_jobs_get(c, job_id);
  if (!m) {
    snprintf(msg, msglen, "unknown worker id %llu: register first", (unsigned long long)wid);
    return ZT_RPC_NOT_FOUND;
  }
  if (!j) {
    snprintf(msg, msglen, "unknown job %llu", (unsigned long long)job_id);
    return ZT_RPC_NOT_FOUND;
  }
  if (!job_active(j) || gen != j->row.generation || m->job_id != job_id || m->gen != gen) {
    snprintf(msg, msglen,
             "stale generation: worker %s is not in generation %llu of job %llu (job is %s at "
             "generation %llu); rejoin",
             m->row.name, (unsigned long long)gen, (unsigned long long)job_id,
             zt_job_state_name(j->row.state), (unsigned long long)j->row.generation);
    return ZT_RPC_FAILED_PRECONDITION;
  }
  *jout = j;
  *mout = m;
  return ZT_RPC_OK;
}

static void reply_rendezvous(zt_coord *c, zt_job *j) {
  char *peers[ZT_MAX_WORLD];
  for (int r = 0; r < j->row.world; r++) peers[r] = j->comm_addr[r];
  for (int r = 0; r < j->row.world; r++) {
    Ztrain__RendezvousReply rep = ZTRAIN__RENDEZVOUS_REPLY__INIT;
    rep.job_id = j->row.id;
    rep.generation = j->row.generation;
    rep.rank = (uint32_t)r;
    rep.world = (uint32_t)j->row.world;
    rep.n_peers = (size_t)j->row.world;
    rep.peers = peers;
    rep.spec_json = j->spec;
    rep.start_step = j->start_step;
    rep.accum_steps = (uint32_t)(j->p.global_batch / j->p.micro / j->row.world);
    rep.comm_timeout_ms = j->p.comm_timeout_ms;
    rep.checkpoint_dir = j->start_ckpt;
    skip_range sk[64];
    int nsk = parse_skips(j->row.skips, sk, 64);
    Ztrain__SkipRange sr[64], *srp[64];
    for (int i = 0; i < nsk; i++) {
      ztrain__skip_range__init(&sr[i]);
      sr[i].start = sk[i].start, sr[i].end = sk[i].end;
      srp[i] = &sr[i];
    }
    rep.n_skips = (size_t)nsk;
    rep.skips = srp;
    rep.lr_factor = j->row.lr_factor > 0 ? j->row.lr_factor : 1.0;
    rep.lr_factor_until = j->row.lr_until;
    rep.rollbacks = (uint32_t)j->row.rollbacks;
    size_t n = ztrain__rendezvous_reply__get_packed_size(&rep);
    uint8_t *buf = malloc(n);
    if (!buf) abort();
    ztrain__rendezvous_reply__pack(&rep, buf);
    zt_rpc_reply(j->rdv[r], ZT_RPC_OK, NULL, buf, n);
    free(buf);
    j->rdv[r] = NULL;
  }
  j->arrived = 0;
  j->row.state = ZT_JOB_RUNNING;
  snprintf(j->row.message, sizeof j->row.message, "running generation %llu on %d workers",
           (unsigned long long)j->row.generation, j->row.world);
  save_job(c, j);
  zt_coord_event(c, j->row.id, "rendezvous_complete", 0,
                 "generation %llu: %d ranks connected %lld ms after forming",
                 (unsigned long long)j->row.generation, j->row.world,
                 (long long)(zt_now_ms() - j->formed_ms));
}

void zt_jobs_rendezvous(zt_coord *c, zt_rpc_call_t *call, const Ztrain__RendezvousRequest *req) {
  char msg[512];
  zt_job *j;
  zt_member *m;
  int st = fence(c, req->worker_id, req->job_id, req->generation, &j, &m, msg, sizeof msg);
  if (st == ZT_RPC_OK) {
    char host[128];
    int port;
    if (strlen(req->comm_addr) >= sizeof j->comm_addr[0] ||
        zt_parse_hostport(req->comm_addr, host, sizeof host, &port) != 0) {
      snprintf(msg, sizeof msg, "comm_addr \"%.64s\" is not HOST:PORT", req->comm_addr);
      st = ZT_RPC_INVALID_ARGUMENT;
    }
  }
  if (st != ZT_RPC_OK) {
    zt_rpc_reply(call, st, msg, NULL, 0);
    return;
  }
  int r = m->rank;
  if (j->rdv[r]) { /* a retry replaces the earlier call */
    zt_rpc_reply(j->rdv[r], ZT_RPC_ABORTED, "replaced by a newer rendezvous call", NULL, 0);
    j->arrived--;
  }
  j->rdv[r] = call;
  snprintf(j->comm_addr[r], sizeof j->comm_addr[r], "%s", req->comm_addr);
  if (++j->arrived == j->row.world) reply_rendezvous(c, j);
}

/* ---- rollback --------------------------------------------------------------- */

int zt_jobs_rollback(zt_coord *c, zt_job *j, int64_t first_step, int64_t last_step,
                     int64_t max_ckpt_step, int64_t skip_steps, const char *why) {
  pick_ctx pc = {max_ckpt_step, {0}, 0};
  if (j->p.ckpt_dir[0]) zt_db_ckpts_each(c->db, j->row.id, pick_before, &pc);
  int64_t to = pc.found ? pc.best.step : 0;
  /* Rollback budget: at most rb_max within any rb_per_steps steps. */
  int recent = 0;
  for (const char *p = j->row.rollback_steps; p && *p;) {
    long long st = atoll(p);
    if (st > last_step - j->p.rb_per_steps) recent++;
    p = strchr(p, ',');
    if (p) p++;
  }
  if (recent >= j->p.rb_max) {
    char msg[512];
    snprintf(msg, sizeof msg,
             "paused: %d rollbacks within %lld steps (max_rollbacks %lld) and another spike: %s; "
             "zctl resume continues from the last good checkpoint",
             recent, (long long)j->p.rb_per_steps, (long long)j->p.rb_max, why);
    j->rb_ckpt_step = to;
    snprintf(j->rb_ckpt_dir, sizeof j->rb_ckpt_dir, "%s", pc.found ? pc.best.dir : "");
    finish(c, j, ZT_JOB_PAUSED, "job_paused", "%s", msg);
    return 0;
  }
  /* Skip the data of the spike window plus skip_steps batches. */
  skip_range sk[64];
  int nsk = parse_skips(j->row.skips, sk, 64);
  uint64_t gb = (uint64_t)j->p.global_batch;
  zt_range_t zs[64];
  for (int i = 0; i < nsk; i++) zs[i].start = sk[i].start, zs[i].end = sk[i].end;
  uint64_t lo = zt_data_map_pos(zs, nsk, (uint64_t)(first_step - 1) * gb);
  uint64_t hi = zt_data_map_pos(zs, nsk, (uint64_t)(last_step + skip_steps) * gb - 1) + 1;
  if (hi > lo && nsk < 63) add_skip(j, lo, hi);
  j->row.rollbacks++;
  size_t l = strlen(j->row.rollback_steps);
  snprintf(j->row.rollback_steps + l, sizeof j->row.rollback_steps - l, "%s%lld", l ? "," : "",
           (long long)last_step);
  double old_factor = j->row.lr_factor > 0 ? j->row.lr_factor : 1.0;
  j->row.lr_factor = j->p.rb_lr_factor;
  j->row.lr_until = last_step + j->p.rb_cooldown;
  j->rb_ckpt_step = to;
  snprintf(j->rb_ckpt_dir, sizeof j->rb_ckpt_dir, "%s", pc.found ? pc.best.dir : "");
  save_job(c, j);
  zt_coord_event(c, j->row.id, "rollback", 0,
                 "rollback %d: %s; restarting from %s (step %lld)", j->row.rollbacks, why,
                 pc.found ? "checkpoint" : "initialization", (long long)to);
  zt_coord_event(c, j->row.id, "skip_range", 0,
                 "data of steps %lld..%lld skipped: sample stream positions [%llu, %llu)",
                 (long long)first_step, (long long)(last_step + skip_steps),
                 (unsigned long long)lo, (unsigned long long)hi);
  zt_coord_event(c, j->row.id, "lr_change", 0, "learning rate x%g (was x%g) until step %lld",
                 j->row.lr_factor, old_factor, (long long)j->row.lr_until);
  zt_ckpt_drop_after(c, j, to);
  char reason[300];
  snprintf(reason, sizeof reason, "rollback to step %lld", (long long)to);
  try_form(c, j, reason);
  return 0;
}

int zt_jobs_report_step(zt_coord *c, const Ztrain__ReportStepRequest *req, int *command,
                        char *msg, size_t msglen) {
  zt_job *j;
  zt_member *m;
  int st = fence(c, req->worker_id, req->job_id, req->generation, &j, &m, msg, msglen);
  if (st != ZT_RPC_OK) return st;
  if (m->rank != 0) {
    snprintf(msg, msglen, "only rank 0 reports steps (worker %s is rank %d)", m->row.name, m->rank);
    return ZT_RPC_FAILED_PRECONDITION;
  }
  if (req->step < 1 || req->step > j->row.total_steps) {
    snprintf(msg, msglen, "step %lld out of range 1..%lld", (long long)req->step,
             (long long)j->row.total_steps);
    return ZT_RPC_INVALID_ARGUMENT;
  }
  zt_db_step s = {req->step, req->generation, req->loss, req->grad_norm, req->lr,
                  req->tokens_per_s, req->val_loss, zt_wall_ms()};
  j->row.step = req->step;
  j->last = s;
  if (zt_db_begin(c->db) != 0 || zt_db_step_put(c->db, j->row.id, &s) != 0 ||
      (j->row.updated_ms = zt_wall_ms(), zt_db_job_update(c->db, &j->row)) != 0 ||
      zt_db_commit(c->db) != 0) {
    zt_db_rollback(c->db);
    snprintf(msg, msglen, "cannot store step: %s", zt_err_msg());
    return ZT_RPC_UNAVAILABLE;
  }
  *command = j->ckpt_request ? ZTRAIN__COMMAND__COMMAND_CHECKPOINT_NOW
                             : ZTRAIN__COMMAND__COMMAND_CONTINUE;
  if (!isfinite(req->loss) && (!j->poisoned_from || req->step < j->poisoned_from))
    j->poisoned_from = req->step;
  zt_spike_verdict v;
  int spiked = j->p.rb_enabled && zt_spike_feed(&j->det, req->step, req->loss, req->grad_norm, &v);
  if (j->p.rb_enabled)
    ZT_DEBUG("job %llu step %lld: loss %.5g norm %.4g z(loss) %.2f z(norm) %.2f",
             (unsigned long long)j->row.id, (long long)req->step, req->loss, req->grad_norm,
             v.z_loss, v.z_gnorm);
  if (spiked) {
    zt_coord_event(c, j->row.id, "spike", 0, "%s", v.reason);
    zt_jobs_rollback(c, j, v.first_step, req->step, v.first_step - 1 - j->p.rb_margin,
                     j->p.rb_skip, v.reason);
    *command = ZTRAIN__COMMAND__COMMAND_ROLLBACK;
    return ZT_RPC_OK;
  }
  if (req->step == j->row.total_steps) {
    finish(c, j, ZT_JOB_COMPLETED, "job_completed", "completed %lld steps; final loss %.6g",
           (long long)req->step, req->loss);
    *command = ZTRAIN__COMMAND__COMMAND_STOP;
    zt_jobs_schedule(c);
  }
  return ZT_RPC_OK;
}

int zt_jobs_report_failure(zt_coord *c, const Ztrain__ReportFailureRequest *req, char *msg,
                           size_t msglen) {
  zt_job *j;
  zt_member *m = zt_members_get(c, req->worker_id);
  /* Already moved on: the worker belongs to a newer generation of the same
   * job (another rank reported first). Nothing to do; the reply carries the
   * new assignment. */
  if (m && m->job_id == req->job_id && m->gen > req->generation) return ZT_RPC_OK;
  int st = fence(c, req->worker_id, req->job_id, req->generation, &j, &m, msg, msglen);
  if (st != ZT_RPC_OK) return st;
  char reason[400];
  snprintf(reason, sizeof reason, "%.300s", req->reason);
  if (req->fatal) {
    finish(c, j, ZT_JOB_FAILED, "job_failed", "rank %d (%s): %s", m->rank, m->row.name, reason);
    zt_jobs_schedule(c);
    return ZT_RPC_OK;
  }
  zt_coord_event(c, j->row.id, "rank_failed", m->row.id, "generation %llu rank %d: %s",
                 (unsigned long long)req->generation, m->rank, reason);
  if (req->bad_checkpoint[0] && zt_ckpt_mark_bad(c, j, req->bad_checkpoint, reason) != 0) {
    finish(c, j, ZT_JOB_FAILED, "job_failed", "cannot load checkpoint %s: %s",
           req->bad_checkpoint, reason);
    zt_jobs_schedule(c);
    return ZT_RPC_OK;
  }
  /* The peer whose connection died is kept out of the next generation
   * until it proves alive (a later heartbeat) or is declared lost. */
  int sr = req->suspect_rank - 1;
  if (sr >= 0 && sr < j->row.world && sr != m->rank) {
    zt_member *peer = zt_members_get(c, j->workers[sr]);
    if (peer && !peer->quarantine_ms) {
      peer->quarantine_ms = zt_now_ms();
      zt_coord_event(c, j->row.id, "worker_suspected", peer->row.id,
                     "rank %d (%s) reported its connection to rank %d (%s) dead", m->rank,
                     m->row.name, sr, peer->row.name);
    }
  }
  char why[512];
  snprintf(why, sizeof why, "rank %d reported: %.300s", m->rank, reason);
  try_form(c, j, why);
  return ZT_RPC_OK;
}

int zt_jobs_report_checkpoint(zt_coord *c, const Ztrain__ReportCheckpointRequest *req,
                              int *committed, char *msg, size_t msglen) {
  zt_job *j;
  zt_member *m;
  int st = fence(c, req->worker_id, req->job_id, req->generation, &j, &m, msg, msglen);
  if (st != ZT_RPC_OK) return st;
  return zt_ckpt_report(c, j, m, req, committed, msg, msglen);
}

int zt_jobs_heartbeat_command(zt_coord *c, zt_member *m, uint64_t job_id, uint64_t gen,
                              uint64_t *out_job, uint64_t *out_gen) {
  (void)c;
  *out_job = m->job_id;
  *out_gen = m->gen;
  if (m->job_id && (job_id != m->job_id || gen != m->gen)) return ZTRAIN__COMMAND__COMMAND_RECONFIGURE;
  if (!m->job_id && job_id) return ZTRAIN__COMMAND__COMMAND_STOP;
  return ZTRAIN__COMMAND__COMMAND_CONTINUE;
}
