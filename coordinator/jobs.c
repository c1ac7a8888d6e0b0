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
 *
 * Failures. A generation that fails (a rank's report, a member lost or
 * restarted) is re-formed as the restart policy (restarts.h) says: at once,
 * after a backoff (the liveness timer's zt_jobs_schedule forms it when
 * due), or not at all: a deterministic error or a spent budget pauses the
 * job with the reason. A checkpoint write that fails (disk full) does not
 * end the generation: checkpointing is paused, the job goes on training
 * with an alert in /metrics, and pauses once more than
 * checkpoint.max_uncommitted_steps steps would be lost; the next epoch that
 * commits ends the alert.
 *
 * Rollback. A loss spike (spike.c) or an operator rolls the job back to a
 * committed epoch: the data of the spike is skipped (a range of sample-stream
 * positions added to the job's skip list), the LR is lowered for a while,
 * and a new generation starts from the epoch. Rollbacks the detector asks
 * for are budgeted (rollback.max_rollbacks per rollback.per_steps); beyond
 * the budget the job is PAUSED with the reason.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "spec.h"
#include "ztrain.pb-c.h"

/* ---- spec essentials ------------------------------------------------------- */

/* The numbers that shape scheduling, from the trainer's own parser
 * (engine/spec.c), so the coordinator and the workers can never read a
 * spec differently. */
/* The epochs under checkpoint.dir (resolved: dir) must have names that the
 * replica stores take and the holdings scan lists (zt_epoch_parse: no
 * hidden component, at most ZT_EPOCH_MAX_DEPTH deep under the root), or
 * their copies would be refused at every checkpoint: refused at submit
 * instead. */
static int check_epoch_names(const zt_coord_config_t *cfg, const char *spec_dir,
                             const char *dir) {
  const char *rel = dir[0] ? zt_path_under(cfg->ckpt_root, dir) : NULL;
  if (!rel || !rel[0]) return 0;
  char name[ZT_EPOCH_NAME_MAX], probe[1200];
  zt_epoch_t e;
  zt_epoch_name(name, sizeof name, 1, 1, 1);
  snprintf(probe, sizeof probe, "%s/%s", rel, name);
  if (zt_epoch_parse(probe, &e) != 0)
    return zt_err_wrapk(ZT_E_INVALID, "checkpoint.dir \"%.200s\": its epochs cannot be named "
                        "for the replica stores (at most %d directories under the checkpoint "
                        "root, none hidden)", spec_dir, ZT_EPOCH_MAX_DEPTH - 2);
  return 0;
}

/* The spec's paths must lie under the coordinator's roots; the checkpoint
 * directories are kept resolved (the coordinator deletes what is under
 * them). */
static int confine_paths(const zt_spec_t *s, const zt_coord_config_t *cfg, zt_job_params_t *p) {
  char tmp[1100];
  if (zt_path_confine(cfg->data_root, s->train_glob, "data.train", tmp, sizeof tmp) != 0 ||
      (s->val_glob[0] &&
       zt_path_confine(cfg->data_root, s->val_glob, "data.val", tmp, sizeof tmp) != 0) ||
      (s->init_from[0] && zt_path_confine(cfg->data_root, s->init_from, "init.from_safetensors",
                                          tmp, sizeof tmp) != 0) ||
      (s->ckpt.dir[0] && zt_path_confine(cfg->ckpt_root, s->ckpt.dir, "checkpoint.dir",
                                         p->ckpt_dir, sizeof p->ckpt_dir) != 0) ||
      (s->ckpt.load[0] && zt_path_confine(cfg->ckpt_root, s->ckpt.load, "checkpoint.load",
                                          p->ckpt_load, sizeof p->ckpt_load) != 0))
    return -1;
  return check_epoch_names(cfg, s->ckpt.dir, p->ckpt_dir);
}

int zt_job_params_parse(const char *json, const zt_coord_config_t *cfg, zt_job_params_t *p) {
  memset(p, 0, sizeof *p);
  zt_spec_t s;
  if (zt_spec_parse(&s, json, strlen(json)) != 0) return zt_err_wrapk(ZT_E_INVALID, "job spec");
  if (s.fault.present && !cfg->allow_test_knobs)
    return zt_errk(ZT_E_INVALID, "fault_injection: a test-only setting, refused (zcoord "
                                 "--allow-test-knobs accepts it)");
  if (confine_paths(&s, cfg, p) != 0) return -1;
  snprintf(p->name, sizeof p->name, "%s", s.name);
  p->steps = s.steps;
  p->micro = s.micro_batch;
  p->global_batch = s.global_batch;
  p->seq_len = s.model.seq_len;
  p->min_workers = s.min_workers;
  p->max_workers = s.max_workers;
  p->comm_timeout_ms = s.comm_timeout_ms;
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
  p->restart = s.restart;
  p->max_uncommitted = s.ckpt.max_uncommitted_steps;
  p->replicas = s.ckpt.replicas;
  p->zero_stage = s.zero_stage;
  if (p->max_workers > ZT_MAX_WORLD)
    return zt_errk(ZT_E_INVALID, "elastic.max_workers %d exceeds %d", p->max_workers,
                   ZT_MAX_WORLD);
  /* Some N in [min, max] must divide the number of micro-batches per step. */
  int any = 0;
  for (int n = p->min_workers; n <= p->max_workers; n++) {
    int accum;
    if ((p->global_batch / p->micro) % n != 0 || zt_spec_accum_for_world(&s, n, &accum) != 0)
      continue;
    any = 1;
    if (zt_memplan_need(&s, n, &p->need[n]) != 0) return zt_err_wrapk(ZT_E_INVALID, "model");
  }
  if (!any)
    return zt_errk(ZT_E_INVALID,
                   "no world size in %d..%d divides train_batch_size / micro batch = %lld; the "
                   "global batch must stay fixed when workers come and go",
                   p->min_workers, p->max_workers, (long long)(p->global_batch / p->micro));
  return 0;
}

/* ---- bookkeeping ------------------------------------------------------------- */

zt_job_t *zt_jobs_get(zt_coord_t *c, uint64_t id) {
  for (zt_job_t *j = c->jobs; j; j = j->next)
    if (j->row.id == id) return j;
  return NULL;
}

static int job_active(const zt_job_t *j) {
  return j->row.state == ZT_JOB_PENDING || j->row.state == ZT_JOB_RUNNING ||
         j->row.state == ZT_JOB_RECONFIGURING;
}

/* Writes the job row. A failure is logged and returned; the in-memory
 * state stays ahead of the database until the next successful save, made
 * at the latest by zt_jobs_flush a few seconds later. Operator actions
 * store their row before they change anything (store_first), so that a
 * refused write refuses the action. */
static int save_job(zt_coord_t *c, zt_job_t *j) {
  j->row.updated_ms = zt_wall_ms();
  if (zt_db_job_update(c->db, &j->row) != 0) {
    j->save_failures++;
    ZT_ERROR("job %llu: %s (%lld failed writes of the job's state; retried every few seconds)",
             (unsigned long long)j->row.id, zt_err_msg(), (long long)j->save_failures);
    return -1;
  }
  if (j->save_failures)
    ZT_INFO("job %llu: state stored after %lld failed writes", (unsigned long long)j->row.id,
            (long long)j->save_failures);
  j->save_failures = 0;
  return 0;
}

void zt_jobs_flush(zt_coord_t *c) {
  for (zt_job_t *j = c->jobs; j; j = j->next) {
    if (j->save_failures) (void)save_job(c, j);
    if (job_active(j)) zt_ckpt_retry_drops(c, j);
  }
}

/* Stores row, the job's row as an operator's action would leave it, before
 * the action changes anything; UNAVAILABLE when the write fails. */
static int store_first(zt_coord_t *c, zt_job_t *j, zt_db_job_t *row, const char *action) {
  row->updated_ms = zt_wall_ms();
  if (zt_db_job_update(c->db, row) != 0)
    return zt_err_wrapk(ZT_E_UNAVAILABLE, "job %llu: cannot store the %s, nothing changed",
                        (unsigned long long)j->row.id, action);
  return 0;
}

/* Answers every held Rendezvous call of the job with an error. */
static void release_rendezvous(zt_job_t *j, int status, const char *why) {
  for (int r = 0; r < ZT_MAX_WORLD; r++) {
    if (j->rdv[r]) zt_rpc_reply(j->rdv[r], status, why, NULL, 0);
    j->rdv[r] = NULL;
    j->comm_addr[r][0] = 0;
  }
  j->arrived = 0;
}

/* Detaches every member of the job's current generation. */
static void release_members(zt_coord_t *c, zt_job_t *j) {
  for (int r = 0; r < j->row.world; r++) {
    zt_member_t *m = zt_members_get(c, j->workers[r]);
    if (m && m->job_id == j->row.id) m->job_id = m->gen = 0, m->rank = -1;
  }
}

static void finish(zt_coord_t *c, zt_job_t *j, int state, const char *kind, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void finish(zt_coord_t *c, zt_job_t *j, int state, const char *kind, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(j->row.message, sizeof j->row.message, fmt, ap);
  va_end(ap);
  release_rendezvous(j, ZT_RPC_ABORTED, "job ended");
  release_members(c, j);
  j->retry_at_ms = 0;
  j->row.state = state;
  save_job(c, j);
  zt_coord_event(c, j->row.id, kind, 0, "%s", j->row.message);
  if (state == ZT_JOB_COMPLETED || state == ZT_JOB_FAILED || state == ZT_JOB_CANCELED)
    zt_ckpt_forget(j);
}

/* ---- forming generations ---------------------------------------------------------- */

static int member_usable(const zt_member_t *m) {
  return m && m->row.state == ZT_WORKER_ALIVE && !m->draining && !m->quarantine_ms;
}

/* Kept out of job j (a repeated local error), in the session it had then. */
static int excluded_from(const zt_job_t *j, const zt_member_t *m) {
  for (int i = 0; i < j->n_excluded; i++)
    if (j->excluded[i].id == m->row.id && !strcmp(j->excluded[i].session, m->row.session)) return 1;
  return 0;
}

static int member_fits(const zt_member_t *m, const zt_memplan_need_t *need) {
  return zt_memplan_fits(need, m->row.host_memory, m->row.device_memory);
}

/* The candidates for a generation of n ranks: usable workers that can hold
 * one rank at that size; survivors of the current generation first, in
 * rank order, then idle workers by id. Returns how many (at most n). */
static int candidates(zt_coord_t *c, zt_job_t *j, int n, uint64_t pick[ZT_MAX_WORLD]) {
  const zt_memplan_need_t *need = &j->p.need[n];
  int k = 0;
  if (j->row.state != ZT_JOB_PENDING)
    for (int r = 0; r < j->row.world && k < n; r++) {
      zt_member_t *m = zt_members_get(c, j->workers[r]);
      if (member_usable(m) && m->job_id == j->row.id && member_fits(m, need) &&
          !excluded_from(j, m))
        pick[k++] = m->row.id;
    }
  for (size_t i = 0; i < c->by_id_cap && k < n; i++) {
    zt_member_t *m = c->by_id[i];
    if (member_usable(m) && m->job_id == 0 && member_fits(m, need) && !excluded_from(j, m))
      pick[k++] = m->row.id;
  }
  return k;
}

/* Chooses the members of the next generation into pick: the largest world
 * size that divides the micro-batches per step and has that many
 * candidates. Returns it, or 0 with what is missing in why. */
static int pick_members(zt_coord_t *c, zt_job_t *j, uint64_t pick[ZT_MAX_WORLD], char *why,
                        size_t whylen) {
  int64_t micro_batches = j->p.global_batch / j->p.micro;
  int best = -1, have = 0;
  for (int n = j->p.max_workers; n >= j->p.min_workers; n--) {
    if (micro_batches % n != 0) continue;
    int k = candidates(c, j, n, pick);
    if (k == n) return n;
    if (best < 0) best = n, have = k; /* the largest size: the smallest need */
  }
  const zt_memplan_need_t *need = &j->p.need[best];
  char h[32], d[32];
  snprintf(why, whylen,
           "waiting for %d workers that can each hold one rank (%s of RAM on CPU workers, %s "
           "of GPU memory on GPU workers, at world size %d, ZeRO stage %d); %d available",
           best, zt_memplan_text(need->host, h, sizeof h),
           zt_memplan_text(need->device, d, sizeof d), best, j->p.zero_stage, have);
  return 0;
}

/* Where the next generation starts: the epoch a rollback chose (or a
 * fresh start), else the newest loadable committed epoch, else
 * checkpoint.load. dir "" means fresh parameters. -1 when the job has
 * committed epochs but none can be loaded now (their copies are on
 * machines that are gone): it must not quietly start over. */
static int start_point(zt_coord_t *c, zt_job_t *j, int64_t *step, char *dir, size_t dirlen) {
  zt_db_ckpt_t ck;
  int have = 0, any = 0;
  *step = 0;
  dir[0] = 0;
  if (j->rb_ckpt_step >= 0) {
    *step = j->rb_ckpt_step;
    snprintf(dir, dirlen, "%s", j->rb_ckpt_dir);
  } else if (j->p.ckpt_dir[0] && zt_ckpt_newest(c, j, INT64_MAX, 1, &ck, &have) == 0 && have) {
    *step = ck.step;
    snprintf(dir, dirlen, "%s", ck.dir);
  } else if (j->p.ckpt_dir[0] && zt_ckpt_newest(c, j, INT64_MAX, 0, &ck, &any) == 0 && any) {
    return zt_errk(ZT_E_UNAVAILABLE, "no committed checkpoint can be loaded: the newest (step "
                   "%lld) and every older one lack a copy on a machine with a live worker",
                   (long long)ck.step);
  } else if (j->p.ckpt_load[0]) { /* the worker reads the step from its manifest */
    snprintf(dir, dirlen, "%s", j->p.ckpt_load);
  }
  return 0;
}

/* The epoch the current generation loads, with its recorded files (the
 * workers verify every byte against them). */
static void set_start(zt_coord_t *c, zt_job_t *j, const char *dir) {
  snprintf(j->start_ckpt, sizeof j->start_ckpt, "%s", dir);
  free(j->start_files);
  j->start_files = NULL;
  j->n_start_files = 0;
  if (dir[0] && zt_ckpt_record(c, dir, &j->start_files, &j->n_start_files) != 0)
    ZT_WARN("job %llu: %s", (unsigned long long)j->row.id, zt_err_msg());
}

/* No generation can be formed: back to PENDING, saying what is missing
 * (the message changes as workers come and go). */
static void to_pending(zt_coord_t *c, zt_job_t *j, const char *missing, const char *reason) {
  char msg[sizeof j->row.message];
  snprintf(msg, sizeof msg, "%s (%s)", missing, reason);
  if (j->row.state == ZT_JOB_PENDING) {
    if (strncmp(j->row.message, missing, strlen(missing)) != 0) {
      snprintf(j->row.message, sizeof j->row.message, "%s", missing);
      save_job(c, j);
    }
    return;
  }
  release_rendezvous(j, ZT_RPC_ABORTED, "not enough workers; job pending");
  release_members(c, j);
  j->row.state = ZT_JOB_PENDING;
  snprintf(j->row.message, sizeof j->row.message, "%s", msg);
  save_job(c, j);
  zt_coord_event(c, j->row.id, "job_pending", 0, "%s", j->row.message);
}

/* Records generation gen with the members pick[0..n) in one transaction
 * and makes it the job's current one. */
static int commit_generation(zt_coord_t *c, zt_job_t *j, const uint64_t *pick, int n,
                             int64_t start_step, const char *reason) {
  uint64_t gen = j->row.generation + 1;
  zt_db_job_t next = j->row;
  next.generation = gen;
  next.world = n;
  next.step = start_step;
  next.state = ZT_JOB_RECONFIGURING;
  next.restarts = j->row.generation ? j->row.restarts + 1 : 0;
  next.updated_ms = zt_wall_ms();
  snprintf(next.message, sizeof next.message, "generation %llu forming with %d workers",
           (unsigned long long)gen, n);
  if (zt_db_begin(c->db) != 0) return -1;
  if (zt_db_generation_add(c->db, j->row.id, gen, n, start_step, reason, pick) != 0 ||
      zt_db_job_update(c->db, &next) != 0 || zt_db_commit(c->db) != 0) {
    zt_db_rollback(c->db);
    return -1;
  }
  j->row = next;
  return 0;
}

/* Numbers the machines of the generation's members (host_of, n_hosts):
 * copies of a checkpoint file count once per machine. */
static const char *host_of_worker(zt_coord_t *c, uint64_t id) {
  zt_member_t *m = zt_members_get(c, id);
  return m ? m->row.host : "";
}

static void index_hosts(zt_coord_t *c, zt_job_t *j) {
  j->n_hosts = 0;
  for (int r = 0; r < j->row.world && r < ZT_MAX_WORLD; r++) {
    const char *host = host_of_worker(c, j->workers[r]);
    int h = 0;
    while (h < r && strcmp(host_of_worker(c, j->workers[h]), host) != 0) h++;
    j->host_of[r] = h < r ? j->host_of[h] : (uint8_t)j->n_hosts++;
  }
}

/* Which collectives the generation uses: NCCL when it has two ranks or
 * more and each has a GPU of its own (a "cuda:N" device that no other rank
 * on its machine names: NCCL refuses two ranks on one GPU) and NCCL
 * libraries that load, the TCP ring otherwise (CPU workers, mixed
 * generations, ranks sharing a GPU, a worker without NCCL). */
static void choose_comm(zt_coord_t *c, zt_job_t *j) {
  j->nccl = j->row.world >= 2;
  j->nccl_id[0] = 0;
  for (int r = 0; r < j->row.world && j->nccl; r++) {
    zt_member_t *m = zt_members_get(c, j->workers[r]);
    if (!m || !m->nccl || strncmp(m->row.device, "cuda:", 5) != 0) j->nccl = 0;
    for (int q = 0; q < r && j->nccl; q++)
      if (j->host_of[q] == j->host_of[r] &&
          !strcmp(zt_members_get(c, j->workers[q])->row.device, m->row.device))
        j->nccl = 0;
  }
}

int zt_jobs_nccl_root(zt_coord_t *c, const zt_member_t *m) {
  zt_job_t *j = m && m->job_id ? zt_jobs_get(c, m->job_id) : NULL;
  return j && j->nccl && m->rank == 0 && m->gen == j->row.generation;
}

/* Forms the next generation if enough workers are available. */
/* ---- the end of a job ----------------------------------------------------------- */

/* How long a job whose last step is done waits for its final epoch to
 * commit before it completes without it (writes and copies of the final
 * epoch take what any epoch takes; a worker lost meanwhile re-forms the
 * job, which computes the last steps again). */
#define ZT_FINAL_CKPT_WAIT_MS 120000

/* The last step is done: the workers write the final epoch (trainer.c) and
 * the job completes when it commits (final_committed), when its write
 * fails, or after ZT_FINAL_CKPT_WAIT_MS. */
static void await_final(zt_coord_t *c, zt_job_t *j) {
  if (j->final_by_ms) return;
  j->final_by_ms = zt_now_ms() + ZT_FINAL_CKPT_WAIT_MS;
  snprintf(j->row.message, sizeof j->row.message,
           "step %lld of %lld done; committing the final checkpoint",
           (long long)j->row.step, (long long)j->row.total_steps);
  save_job(c, j);
}

static void complete(zt_coord_t *c, zt_job_t *j, const char *ckpt_note) {
  finish(c, j, ZT_JOB_COMPLETED, "job_completed", "completed %lld steps; final loss %.6g; %s",
         (long long)j->row.total_steps, j->last.loss, ckpt_note);
  zt_jobs_schedule(c);
}

/* Called on every commit: 1 when it was the final epoch and the job is now
 * complete. */
static int final_committed(zt_coord_t *c, zt_job_t *j, int64_t step) {
  if (step < j->row.total_steps || !job_active(j)) return 0;
  char note[96];
  snprintf(note, sizeof note, "final checkpoint step %lld committed", (long long)step);
  complete(c, j, note);
  return 1;
}

/* The final epoch failed to write, or did not commit in time. */
static void final_failed(zt_coord_t *c, zt_job_t *j, const char *why) {
  zt_coord_event(c, j->row.id, "final_checkpoint_failed", 0, "%s", why);
  char note[400];
  snprintf(note, sizeof note, "no final checkpoint (%.300s)", why);
  complete(c, j, note);
}

static void hold(zt_coord_t *c, zt_job_t *j, int64_t delay_ms, const char *reason,
                 const char *why);

/* The next generation could not be stored (the database refused the
 * write) after the members of the last one were let go: the job waits and
 * tries again, as after a failed generation, instead of staying without
 * one. */
static void form_failed(zt_coord_t *c, zt_job_t *j, const char *reason) {
  char again[sizeof j->retry_reason], why[sizeof j->row.message];
  int64_t delay = ZT_MAX(1000, j->p.restart.backoff_ms);
  snprintf(again, sizeof again, "%s", reason); /* reason may be j->retry_reason */
  snprintf(why, sizeof why, "cannot store generation %llu: %.300s; re-forming in %lld ms",
           (unsigned long long)(j->row.generation + 1), zt_err_msg(), (long long)delay);
  ZT_ERROR("job %llu: %s", (unsigned long long)j->row.id, why);
  hold(c, j, delay, again, why);
}

static void try_form(zt_coord_t *c, zt_job_t *j, const char *reason) {
  uint64_t pick[ZT_MAX_WORLD];
  char missing[300];
  /* The final epoch committed before this coordinator restarted, or before
   * a worker was lost: nothing is left to train. */
  if (j->rb_ckpt_step < 0 && j->committed_step >= j->row.total_steps &&
      final_committed(c, j, j->committed_step))
    return;
  int n = pick_members(c, j, pick, missing, sizeof missing);
  if (!n) {
    to_pending(c, j, missing, reason);
    return;
  }
  release_rendezvous(j, ZT_RPC_ABORTED, "generation superseded");
  release_members(c, j);
  int64_t start_step;
  char dir[sizeof j->start_ckpt];
  if (start_point(c, j, &start_step, dir, sizeof dir) != 0) {
    finish(c, j, ZT_JOB_PAUSED, "job_paused",
           "paused: %s; bring back a machine that holds copies (the logbook's "
           "checkpoint_unavailable events name the files), then zctl resume",
           zt_err_msg());
    zt_jobs_schedule(c);
    return;
  }
  if (commit_generation(c, j, pick, n, start_step, reason) != 0) {
    form_failed(c, j, reason);
    return;
  }
  j->rb_ckpt_step = -1;
  j->rb_ckpt_dir[0] = 0;
  j->final_by_ms = 0;
  zt_reach_reset(&j->reach, 0, 0);
  j->ckpt_request = 0;
  j->poisoned_from = 0;
  j->retry_at_ms = 0;
  j->safe_step = start_step;
  /* The baseline survives a new generation (replayed steps rejoin it); only
   * a run of suspicious steps in progress is forgotten. */
  j->det.run = 0;
  memcpy(j->workers, pick, (size_t)n * sizeof *pick);
  index_hosts(c, j);
  choose_comm(c, j);
  j->formed_ms = zt_now_ms();
  j->start_step = start_step;
  set_start(c, j, dir);
  char names[512] = "";
  for (int r = 0; r < n; r++) {
    zt_member_t *m = zt_members_get(c, pick[r]);
    m->job_id = j->row.id, m->gen = j->row.generation, m->rank = r;
    size_t l = strlen(names);
    snprintf(names + l, sizeof names - l, "%s%s", r ? "," : "", m->row.name);
  }
  zt_coord_event(c, j->row.id, "generation_started", 0,
                 "generation %llu: world %d, accum %lld, start step %lld, workers [%s]; reason: %s",
                 (unsigned long long)j->row.generation, n,
                 (long long)(j->p.global_batch / j->p.micro / n), (long long)start_step, names,
                 reason);
  zt_ckpt_gc(c, j); /* pending epochs of the old generation can never commit */
}

/* Number of idle usable workers. */
static int idle_workers(zt_coord_t *c) {
  int n = 0;
  for (size_t i = 0; i < c->by_id_cap; i++) n += member_usable(c->by_id[i]) && !c->by_id[i]->job_id;
  return n;
}

/* Scale up at a checkpoint boundary: asks for a checkpoint now when a
 * larger valid world has enough workers that can hold a rank. */
static void maybe_scale_up(zt_coord_t *c, zt_job_t *j) {
  uint64_t pick[ZT_MAX_WORLD];
  int n = ZT_MIN(j->p.max_workers, j->row.world + idle_workers(c));
  for (; n > j->row.world; n--)
    if ((j->p.global_batch / j->p.micro) % n == 0 && candidates(c, j, n, pick) == n) break;
  if (n <= j->row.world) return;
  j->ckpt_request = 1;
  snprintf(j->reform_reason, sizeof j->reform_reason, "scale-up from %d to %d workers",
           j->row.world, n);
  zt_coord_event(c, j->row.id, "checkpoint_requested", 0, "%s", j->reform_reason);
}

static void judge_reach(zt_coord_t *c, zt_job_t *j);

void zt_jobs_schedule(zt_coord_t *c) {
  int64_t now = zt_now_ms();
  for (zt_job_t *j = c->jobs; j; j = j->next) {
    if (job_active(j) && j->rb_ckpt_step < 0 && j->committed_step >= j->row.total_steps &&
        j->row.total_steps > 0)
      final_committed(c, j, j->committed_step);
    else if (j->reach.decide_at_ms && now >= j->reach.decide_at_ms &&
        j->reach.gen == j->row.generation &&
        (j->row.state == ZT_JOB_RUNNING || j->row.state == ZT_JOB_RECONFIGURING))
      judge_reach(c, j);
    else if (j->row.state == ZT_JOB_PENDING)
      try_form(c, j, "enough workers");
    else if (j->retry_at_ms && now >= j->retry_at_ms)
      try_form(c, j, j->retry_reason);
    else if (j->final_by_ms && now >= j->final_by_ms && job_active(j))
      final_failed(c, j, "the final epoch did not commit in time");
    else if (j->final_by_ms)
      continue; /* no scale-up: nothing is left to train */
    else if (j->row.state == ZT_JOB_RUNNING && j->p.ckpt_dir[0] && !j->ckpt_request &&
             !j->ckpt_paused && j->row.world < j->p.max_workers)
      maybe_scale_up(c, j);
  }
}

/* ---- failures ------------------------------------------------------------------- */

/* A backed-off re-form: the generation's members are let go (they idle
 * until it is due) and the job says when it retries and why. */
static void hold(zt_coord_t *c, zt_job_t *j, int64_t delay_ms, const char *reason,
                 const char *why) {
  release_rendezvous(j, ZT_RPC_ABORTED, "generation failed; re-forming later");
  release_members(c, j);
  j->row.state = ZT_JOB_RECONFIGURING;
  snprintf(j->row.message, sizeof j->row.message, "%s", why);
  save_job(c, j);
  j->retry_at_ms = zt_now_ms() + delay_ms;
  snprintf(j->retry_reason, sizeof j->retry_reason, "%s", reason);
  zt_coord_event(c, j->row.id, "restart_backoff", 0, "%s", why);
}

/* Keeps worker m out of job j for its repeated local error, if the job can
 * form a generation without it: 1 then (the event says so), else 0 and
 * nothing changed. */
static int exclude(zt_coord_t *c, zt_job_t *j, zt_member_t *m, int64_t step, const char *reason) {
  if (j->n_excluded == ZT_MAX_EXCLUDED) return 0;
  j->excluded[j->n_excluded].id = m->row.id;
  snprintf(j->excluded[j->n_excluded].session, sizeof j->excluded[0].session, "%s", m->row.session);
  j->n_excluded++;
  uint64_t pick[ZT_MAX_WORLD];
  char missing[400];
  if (pick_members(c, j, pick, missing, sizeof missing) == 0) {
    j->n_excluded--;
    return 0;
  }
  zt_coord_event(c, j->row.id, "worker_excluded", m->row.id,
                 "worker %s is kept out of the job: the same error twice at step %lld, so it "
                 "cannot go on there (%.300s); it is let back when it registers again or on "
                 "zctl resume",
                 m->row.name, (long long)step, reason);
  return 1;
}

/* The current generation failed (who: the worker whose report it was, or
 * NULL): re-form, now or later, or pause, as the restart policy says. */
static void fail_generation(zt_coord_t *c, zt_job_t *j, zt_fail_kind_t kind, int64_t step,
                            const char *reason, zt_member_t *who) {
  int64_t delay;
  char why[sizeof j->row.message];
  zt_restart_verdict_t v =
      zt_restarts_decide(&j->rs, &j->p.restart, kind, step, reason, who ? who->row.id : 0,
                         zt_now_ms(), &delay, why, sizeof why);
  if (v == ZT_RESTART_EXCLUDE) /* go on without that worker, or pause when the job cannot */
    v = who && exclude(c, j, who, step, reason) ? ZT_RESTART_NOW : ZT_RESTART_PAUSE;
  switch (v) {
    case ZT_RESTART_EXCLUDE: /* decided above */
    case ZT_RESTART_PAUSE:
      finish(c, j, ZT_JOB_PAUSED, "job_paused", "%s", why);
      zt_jobs_schedule(c);
      return;
    case ZT_RESTART_LATER: hold(c, j, delay, reason, why); return;
    case ZT_RESTART_NOW: try_form(c, j, reason); return;
  }
}

/* An epoch was committed: a requested re-form (drain, scale-up) happens now. */
static void checkpoint_committed(zt_coord_t *c, zt_job_t *j) {
  if (!j->ckpt_request) return;
  j->ckpt_request = 0;
  char reason[300];
  snprintf(reason, sizeof reason, "%s after checkpoint step %lld", j->reform_reason,
           (long long)j->ck->step);
  try_form(c, j, reason);
  /* Drained workers are out now; they are told STOP and stay idle. */
  for (size_t i = 0; i < c->by_id_cap; i++) {
    zt_member_t *m = c->by_id[i];
    if (m && m->draining && m->job_id != j->row.id)
      zt_coord_event(c, j->row.id, "drained", m->row.id, "worker %s left the job at step %lld",
                     m->row.name, (long long)j->ck->step);
  }
}

void zt_jobs_member_gone(zt_coord_t *c, zt_member_t *m, const char *why, int failure) {
  zt_job_t *j = m->job_id ? zt_jobs_get(c, m->job_id) : NULL;
  if (!j || !job_active(j)) return;
  char reason[256];
  snprintf(reason, sizeof reason, "worker %s (rank %d) %s", m->row.name, m->rank, why);
  m->job_id = m->gen = 0, m->rank = -1;
  if (failure)
    fail_generation(c, j, ZT_FAIL_LOST, j->row.step, reason, NULL);
  else
    try_form(c, j, reason);
}

/* ---- drains and operator actions --------------------------------------------------- */

int zt_jobs_drain(zt_coord_t *c, zt_member_t *m, char *msg, size_t msglen) {
  zt_job_t *j = m->job_id ? zt_jobs_get(c, m->job_id) : NULL;
  m->draining = 1;
  if (!j || !job_active(j)) {
    snprintf(msg, msglen, "worker %s is idle; it will not be scheduled", m->row.name);
    return 0;
  }
  if (!j->p.ckpt_dir[0] || j->ckpt_paused) {
    snprintf(msg, msglen, "job %llu %s: worker %s leaves now", (unsigned long long)j->row.id,
             j->ckpt_paused ? "cannot write checkpoints now" : "has no checkpoints", m->row.name);
    zt_jobs_member_gone(c, m, "drained", 0);
    return 0;
  }
  j->ckpt_request = 1;
  snprintf(j->reform_reason, sizeof j->reform_reason, "drain of worker %s", m->row.name);
  zt_coord_event(c, j->row.id, "checkpoint_requested", m->row.id, "%s", j->reform_reason);
  snprintf(msg, msglen, "worker %s leaves job %llu after the next checkpoint", m->row.name,
           (unsigned long long)j->row.id);
  return 0;
}

int zt_jobs_leave_drains(zt_coord_t *c, zt_member_t *m) {
  zt_job_t *j = m->job_id ? zt_jobs_get(c, m->job_id) : NULL;
  if (!j || !job_active(j) || !j->p.ckpt_dir[0] || j->row.state != ZT_JOB_RUNNING) return 0;
  char msg[256];
  zt_jobs_drain(c, m, msg, sizeof msg);
  return 1;
}

static const char *const k_action_names[] = {
    [ZT_ACT_PAUSE] = "pause", [ZT_ACT_RESUME] = "resume", [ZT_ACT_CANCEL] = "cancel",
    [ZT_ACT_ROLLBACK] = "rollback"};

int zt_job_action_parse(const char *name, zt_job_action_t *out) {
  for (size_t i = 0; i < ZT_ARRAY_LEN(k_action_names); i++)
    if (!strcmp(name, k_action_names[i])) {
      *out = (zt_job_action_t)i;
      return 0;
    }
  return zt_errk(ZT_E_INVALID, "unknown action \"%.32s\" (pause, resume, cancel, rollback)", name);
}

static int rollback(zt_coord_t *c, zt_job_t *j, int64_t first_step, int64_t last_step,
                    int64_t max_ckpt_step, int64_t skip_steps, int budgeted, const char *why);

static int act_pause_cancel(zt_coord_t *c, zt_job_t *j, zt_job_action_t a, char *msg,
                            size_t msglen) {
  int pause = a == ZT_ACT_PAUSE;
  /* A paused job can be canceled (it is kept until then, to be resumed). */
  if (!job_active(j) && (pause || j->row.state != ZT_JOB_PAUSED))
    return zt_errk(ZT_E_STATE, "job %llu is %s", (unsigned long long)j->row.id,
                   zt_job_state_name(j->row.state));
  zt_db_job_t next = j->row;
  next.state = pause ? ZT_JOB_PAUSED : ZT_JOB_CANCELED;
  snprintf(next.message, sizeof next.message, "%s by operator at step %lld",
           pause ? "paused" : "canceled", (long long)j->row.step);
  if (store_first(c, j, &next, pause ? "pause" : "cancellation") != 0) return -1;
  finish(c, j, next.state, pause ? "job_paused" : "job_canceled", "%s", next.message);
  snprintf(msg, msglen, "%s", j->row.message);
  zt_jobs_schedule(c);
  return 0;
}

static int act_resume(zt_coord_t *c, zt_job_t *j, char *msg, size_t msglen) {
  if (j->spec_error[0])
    return zt_errk(ZT_E_STATE, "job %llu cannot be resumed: stored spec invalid: %s",
                   (unsigned long long)j->row.id, j->spec_error);
  if (j->row.state != ZT_JOB_PAUSED)
    return zt_errk(ZT_E_STATE, "job %llu is %s, not paused", (unsigned long long)j->row.id,
                   zt_job_state_name(j->row.state));
  zt_db_job_t next = j->row;
  next.state = ZT_JOB_PENDING;
  snprintf(next.message, sizeof next.message, "resumed by operator");
  next.n_rollback_steps = 0; /* the rollback and restart budgets start afresh */
  if (store_first(c, j, &next, "resumption") != 0) return -1;
  j->row = next;
  zt_restarts_reset(&j->rs);
  j->n_excluded = 0; /* the operator fixed the cause */
  j->ckpt_paused = 0;
  zt_coord_event(c, j->row.id, "job_resumed", 0, "resumed at step %lld", (long long)j->row.step);
  snprintf(msg, msglen, "job %llu resumed", (unsigned long long)j->row.id);
  zt_jobs_schedule(c);
  return 0;
}

/* An operator's rollback to the newest epoch at or before to_step,
 * skipping skip_steps batches after it; not budgeted. */
static int act_rollback(zt_coord_t *c, zt_job_t *j, int64_t to_step, int64_t skip_steps, char *msg,
                        size_t msglen) {
  if (!job_active(j) && j->row.state != ZT_JOB_PAUSED)
    return zt_errk(ZT_E_STATE, "job %llu is %s", (unsigned long long)j->row.id,
                   zt_job_state_name(j->row.state));
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
  int64_t from;
  if (j->row.state == ZT_JOB_PAUSED) j->row.state = ZT_JOB_RECONFIGURING;
  if (j->p.ckpt_dir[0] && zt_ckpt_newest(c, j, to_step, 1, &ck, &have) != 0) goto err;
  from = (have ? ck.step : 0) + 1;
  if (rollback(c, j, from, from - 1, to_step, skip_steps, 0, why) != 0) goto err;
  if (j->row.state == ZT_JOB_PAUSED) /* its data could not be skipped */
    snprintf(msg, msglen, "%s", j->row.message);
  else
    snprintf(msg, msglen, "job %llu rolling back to step %lld", (unsigned long long)j->row.id,
             (long long)(from - 1));
  return 0;
err:
  j->row.state = was;
  return -1;
}

int zt_jobs_action(zt_coord_t *c, uint64_t id, zt_job_action_t action, int64_t to_step,
                   int64_t skip_steps, char *msg, size_t msglen) {
  zt_job_t *j = zt_jobs_get(c, id);
  if (!j) return zt_errk(ZT_E_NOT_FOUND, "unknown job %llu", (unsigned long long)id);
  switch (action) {
    case ZT_ACT_PAUSE:
    case ZT_ACT_CANCEL: return act_pause_cancel(c, j, action, msg, msglen);
    case ZT_ACT_RESUME: return act_resume(c, j, msg, msglen);
    case ZT_ACT_ROLLBACK: return act_rollback(c, j, to_step, skip_steps, msg, msglen);
  }
  return zt_errk(ZT_E_INVALID, "unknown action %d", (int)action);
}

/* ---- load at start --------------------------------------------------------------- */

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

static int load_job(const zt_db_job_t *row, void *user) {
  zt_coord_t *c = user;
  zt_job_t *j = job_new(row);
  if (zt_job_params_parse(j->spec, &c->cfg, &j->p) != 0) {
    snprintf(j->spec_error, sizeof j->spec_error, "%s", zt_err_msg());
    ZT_WARN("job %llu: stored spec no longer valid: %s", (unsigned long long)row->id,
            j->spec_error);
  }
  int n = 0;
  if (j->row.generation && !j->spec_error[0] &&
      zt_db_generation_members(c->db, j->row.id, j->row.generation, j->workers, ZT_MAX_WORLD,
                               &n) == 0 &&
      job_active(j) && j->row.state != ZT_JOB_PENDING) {
    for (int r = 0; r < n; r++) {
      zt_member_t *m = zt_members_get(c, j->workers[r]);
      if (m) m->job_id = j->row.id, m->gen = j->row.generation, m->rank = r;
    }
    index_hosts(c, j);
    choose_comm(c, j);
  }
  j->formed_ms = zt_now_ms();
  /* The current generation resumed from the newest committed epoch that
   * precedes it; after a restart that is still the newest one at or
   * below the generation's start step. */
  zt_db_ckpt_t ck;
  int have = 0;
  if (j->p.ckpt_dir[0] && zt_ckpt_newest(c, j, INT64_MAX, 0, &ck, &have) == 0 && have) {
    set_start(c, j, ck.dir);
    j->start_step = j->safe_step = j->committed_step = ck.step;
  }
  /* Stopped while its final epoch was awaited: the wait starts again. */
  if (job_active(j) && j->p.ckpt_dir[0] && j->row.step >= j->row.total_steps)
    j->final_by_ms = zt_now_ms() + ZT_FINAL_CKPT_WAIT_MS;
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
    if (j->spec_error[0] && (job_active(j) || j->row.state == ZT_JOB_PAUSED))
      finish(c, j, ZT_JOB_FAILED, "job_failed", "stored spec invalid: %s", j->spec_error);
}

int zt_jobs_load(zt_coord_t *c) {
  if (zt_db_jobs_each(c->db, load_job, c) != 0) return -1;
  fail_invalid_specs(c);
  return 0;
}

void zt_jobs_release_calls(zt_coord_t *c) {
  for (zt_job_t *j = c->jobs; j; j = j->next)
    release_rendezvous(j, ZT_RPC_UNAVAILABLE, "coordinator stopping; call again");
}

void zt_jobs_free(zt_coord_t *c) {
  while (c->jobs) {
    zt_job_t *j = c->jobs;
    c->jobs = j->next;
    free(j->spec);
    free(j->start_files);
    zt_ckpt_forget(j);
    free(j);
  }
}

/* ---- operations from the services -------------------------------------------------- */

/* A job no worker the coordinator has ever seen could hold one rank of,
 * at its most favourable world size, is refused at submit. With no worker
 * known yet it is accepted (and waits, saying what it needs). */
static int check_admissible(zt_coord_t *c, const zt_job_params_t *p) {
  int best = p->max_workers;
  while (best > p->min_workers && (p->global_batch / p->micro) % best != 0) best--;
  const zt_memplan_need_t *need = &p->need[best];
  uint64_t host = 0, dev = 0;
  int known = 0;
  for (size_t i = 0; i < c->by_id_cap; i++) {
    zt_member_t *m = c->by_id[i];
    if (!m) continue;
    if (member_fits(m, need)) return 0;
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

int zt_jobs_submit(zt_coord_t *c, const char *spec, uint64_t *id) {
  zt_job_params_t p;
  if (zt_job_params_parse(spec, &c->cfg, &p) != 0) return -1;
  if (check_admissible(c, &p) != 0) return -1;
  if (p.ckpt_load[0]) { /* only what this coordinator committed, with its checksums */
    zt_db_ckpt_file_t *files;
    int n;
    if (zt_ckpt_record(c, p.ckpt_load, &files, &n) != 0)
      return zt_err_wrapk(zt_err_kind() == ZT_E_NOT_FOUND ? ZT_E_INVALID : zt_err_kind(),
                          "checkpoint.load");
    free(files);
  }
  zt_db_job_t *row = zt_xcalloc(1, sizeof *row);
  snprintf(row->name, sizeof row->name, "%s", p.name);
  row->spec = spec;
  row->state = ZT_JOB_PENDING;
  row->total_steps = p.steps;
  row->min_workers = p.min_workers;
  row->max_workers = p.max_workers;
  row->lr_factor = 1.0;
  row->created_ms = row->updated_ms = zt_wall_ms();
  snprintf(row->message, sizeof row->message, "waiting for %d workers", p.min_workers);
  if (zt_db_begin(c->db) != 0 || zt_db_job_insert(c->db, row) != 0 ||
      zt_db_event_add(c->db, 0, "job_submitted", 0, "", NULL) != 0 || zt_db_commit(c->db) != 0) {
    zt_err_wrapk(ZT_E_UNAVAILABLE, "cannot store job");
    zt_db_rollback(c->db);
    free(row);
    return -1;
  }
  zt_job_t *j = job_new(row);
  free(row);
  j->p = p;
  job_append(c, j);
  *id = j->row.id;
  zt_coord_event(c, j->row.id, "job_accepted", 0,
                 "\"%s\": %lld steps, global batch %lld (micro %lld), workers %d..%d", p.name,
                 (long long)p.steps, (long long)p.global_batch, (long long)p.micro, p.min_workers,
                 p.max_workers);
  zt_jobs_schedule(c);
  return 0;
}

/* Checks that a worker-facing call names the current generation. */
static int fence(zt_coord_t *c, uint64_t wid, uint64_t job_id, uint64_t gen, zt_job_t **jout,
                 zt_member_t **mout) {
  zt_member_t *m = zt_members_get(c, wid);
  zt_job_t *j = zt_jobs_get(c, job_id);
  if (!m) return zt_errk(ZT_E_NOT_FOUND, "unknown worker id %llu: register first", (unsigned long long)wid);
  if (!j) return zt_errk(ZT_E_NOT_FOUND, "unknown job %llu", (unsigned long long)job_id);
  if (!job_active(j) || gen != j->row.generation || m->job_id != job_id || m->gen != gen)
    return zt_errk(ZT_E_STATE,
                   "stale generation: worker %s is not in generation %llu of job %llu (job is %s "
                   "at generation %llu); rejoin",
                   m->row.name, (unsigned long long)gen, (unsigned long long)job_id,
                   zt_job_state_name(j->row.state), (unsigned long long)j->row.generation);
  *jout = j;
  *mout = m;
  return 0;
}

/* ---- rendezvous ---------------------------------------------------------------------- */

/* Where rank r pushes copies of its files: the ranks after it, one per
 * machine other than its own, each with a ticket for its store. */
static int replica_targets(zt_coord_t *c, zt_job_t *j, int r, Ztrain__ReplicaTarget *t,
                           Ztrain__ReplicaTarget **tp, char (*tickets)[ZT_TICKET_MAX]) {
  uint8_t used[ZT_MAX_WORLD / 8] = {0};
  used[j->host_of[r] / 8] |= (uint8_t)(1u << (j->host_of[r] % 8));
  int n = 0;
  for (int d = 1; d < j->row.world; d++) {
    int q = (r + d) % j->row.world, h = j->host_of[q];
    zt_member_t *m = zt_members_get(c, j->workers[q]);
    if ((used[h / 8] >> (h % 8)) & 1 || !m || !m->row.store_addr[0]) continue;
    zt_ticket_t tk = {.op = "put", .job = j->row.id, .gen = j->row.generation,
                      .requester = j->workers[r], .expiry_ms = 0 /* ends with the generation */};
    snprintf(tk.scope, sizeof tk.scope, "r%d", r);
    if (zt_ticket_make(m->row.session, &tk, tickets[n], ZT_TICKET_MAX) != 0) continue;
    ztrain__replica_target__init(&t[n]);
    t[n].worker_id = m->row.id;
    t[n].addr = m->row.store_addr;
    t[n].host = m->row.host;
    t[n].ticket = tickets[n];
    tp[n] = &t[n];
    used[h / 8] |= (uint8_t)(1u << (h % 8));
    n++;
  }
  return n;
}

/* The holders of every file of the start epoch, with tickets for rank r. */
static void start_copies(zt_coord_t *c, zt_job_t *j, int r, zt_copies_pool_t *pool) {
  zt_db_ckpt_t k;
  uint64_t kjob;
  int found = 0;
  if (!j->start_ckpt[0] || !j->n_start_files ||
      zt_db_ckpt_find_dir(c->db, j->start_ckpt, &kjob, &k, &found) != 0 || !found)
    return;
  if (zt_copies_holders(c, j, kjob, &k, j->start_files, j->n_start_files, j->workers[r], pool) !=
      0)
    ZT_WARN("job %llu: copies of %s: %s", (unsigned long long)j->row.id, j->start_ckpt,
            zt_err_msg());
}

/* The reply rank r receives, packed (malloc'd). */
static uint8_t *pack_rendezvous(zt_coord_t *c, zt_job_t *j, int r, size_t *len) {
  char *peers[ZT_MAX_WORLD], *stores[ZT_MAX_WORLD];
  for (int i = 0; i < j->row.world; i++) {
    zt_member_t *m = zt_members_get(c, j->workers[i]);
    peers[i] = j->comm_addr[i];
    stores[i] = m ? m->row.store_addr : "";
  }
  Ztrain__RendezvousReply rep = ZTRAIN__RENDEZVOUS_REPLY__INIT;
  rep.job_id = j->row.id;
  rep.generation = j->row.generation;
  rep.rank = (uint32_t)r;
  rep.world = (uint32_t)j->row.world;
  rep.n_peers = (size_t)j->row.world;
  rep.peers = peers;
  rep.n_peer_stores = (size_t)j->row.world;
  rep.peer_stores = stores;
  rep.spec_json = j->spec;
  rep.start_step = j->start_step;
  rep.accum_steps = (uint32_t)(j->p.global_batch / j->p.micro / j->row.world);
  rep.comm_timeout_ms = j->p.comm_timeout_ms;
  rep.nccl_id = j->nccl ? j->nccl_id : "";
  rep.comm_key = j->comm_key;
  /* Paths cross the wire relative to the checkpoint root: each host
   * resolves them under its own. */
  const char *rel = zt_path_under(c->cfg.ckpt_root, j->start_ckpt);
  rep.checkpoint_dir = (char *)(rel ? rel : j->start_ckpt);
  const zt_range_list_t *sk = &j->row.skips;
  Ztrain__SkipRange sr[ZT_MAX_SKIP_RANGES], *srp[ZT_MAX_SKIP_RANGES];
  for (int i = 0; i < sk->n; i++) {
    ztrain__skip_range__init(&sr[i]);
    sr[i].start = sk->r[i].start, sr[i].end = sk->r[i].end;
    srp[i] = &sr[i];
  }
  rep.n_skips = (size_t)sk->n;
  rep.skips = srp;
  rep.lr_factor = j->row.lr_factor > 0 ? j->row.lr_factor : 1.0;
  rep.lr_factor_until = j->row.lr_until;
  rep.rollbacks = (uint32_t)j->row.rollbacks;
  Ztrain__CheckpointFile *cf = zt_xcalloc((size_t)j->n_start_files + 1, sizeof *cf);
  Ztrain__CheckpointFile **cfp = zt_xcalloc((size_t)j->n_start_files + 1, sizeof *cfp);
  for (int i = 0; i < j->n_start_files; i++) {
    ztrain__checkpoint_file__init(&cf[i]);
    cf[i].name = j->start_files[i].name;
    cf[i].bytes = j->start_files[i].bytes;
    cf[i].checksum = j->start_files[i].checksum;
    cfp[i] = &cf[i];
  }
  rep.n_checkpoint_files = (size_t)j->n_start_files;
  rep.checkpoint_files = cfp;
  /* Copies: where to push ours, where to fetch the start epoch's. */
  rep.replicas = (uint32_t)ZT_MAX(1, ZT_MIN(j->p.replicas, j->n_hosts));
  Ztrain__ReplicaTarget *t = zt_xcalloc((size_t)j->row.world, sizeof *t);
  Ztrain__ReplicaTarget **tp = zt_xcalloc((size_t)j->row.world, sizeof *tp);
  char(*tickets)[ZT_TICKET_MAX] = zt_xcalloc((size_t)j->row.world, ZT_TICKET_MAX);
  rep.n_replica_targets = (size_t)replica_targets(c, j, r, t, tp, tickets);
  rep.replica_targets = tp;
  zt_copies_pool_t pool = {0};
  start_copies(c, j, r, &pool);
  rep.n_checkpoint_copies = (size_t)pool.n;
  rep.checkpoint_copies = pool.fcp;
  *len = ztrain__rendezvous_reply__get_packed_size(&rep);
  uint8_t *buf = zt_xmalloc(*len);
  ztrain__rendezvous_reply__pack(&rep, buf);
  zt_copies_pool_free(&pool);
  free(tickets);
  free(tp);
  free(t);
  free(cfp);
  free(cf);
  return buf;
}

static void reply_rendezvous(zt_coord_t *c, zt_job_t *j) {
  /* Without a key the ranks refuse to connect the ring, and say why. */
  if (zt_random_hex(j->comm_key, 32) != 0) {
    ZT_ERROR("job %llu: no ring key for generation %llu: %s", (unsigned long long)j->row.id,
             (unsigned long long)j->row.generation, zt_err_msg());
    j->comm_key[0] = 0;
  }
  for (int r = 0; r < j->row.world; r++) {
    size_t n;
    uint8_t *buf = pack_rendezvous(c, j, r, &n);
    zt_rpc_reply(j->rdv[r], ZT_RPC_OK, NULL, buf, n);
    free(buf);
    j->rdv[r] = NULL;
  }
  j->arrived = 0;
  j->row.state = ZT_JOB_RUNNING;
  snprintf(j->row.message, sizeof j->row.message, "running generation %llu on %d workers%s%.200s",
           (unsigned long long)j->row.generation, j->row.world,
           j->ckpt_paused ? "; checkpointing paused: " : "", j->ckpt_paused ? j->ckpt_error : "");
  save_job(c, j);
  zt_coord_event(c, j->row.id, "rendezvous_complete", 0,
                 "generation %llu: %d ranks connected %lld ms after forming",
                 (unsigned long long)j->row.generation, j->row.world,
                 (long long)(zt_now_ms() - j->formed_ms));
}

void zt_jobs_rendezvous(zt_coord_t *c, zt_rpc_call_t *call, const Ztrain__RendezvousRequest *req) {
  zt_job_t *j;
  zt_member_t *m;
  char host[128];
  int port;
  if (fence(c, req->worker_id, req->job_id, req->generation, &j, &m) != 0) goto err;
  if (strlen(req->comm_addr) >= sizeof j->comm_addr[0] ||
      zt_parse_hostport(req->comm_addr, host, sizeof host, &port) != 0) {
    zt_errk(ZT_E_INVALID, "comm_addr \"%.64s\" is not HOST:PORT", req->comm_addr);
    goto err;
  }
  int r = m->rank;
  if (req->nccl_id[0] && (r != 0 || !j->nccl)) {
    zt_errk(ZT_E_INVALID, "nccl_id from rank %d: only rank 0 of a generation whose ranks all "
            "have GPUs of their own makes one", r);
    goto err;
  }
  if (req->nccl_id[0] && (strlen(req->nccl_id) != 256 ||
                          strspn(req->nccl_id, "0123456789abcdef") != 256)) {
    zt_errk(ZT_E_INVALID, "nccl_id is not 256 lowercase hex characters");
    goto err;
  }
  if (r == 0 && j->nccl) snprintf(j->nccl_id, sizeof j->nccl_id, "%s", req->nccl_id);
  if (j->rdv[r]) { /* a retry replaces the earlier call */
    zt_rpc_reply(j->rdv[r], ZT_RPC_ABORTED, "replaced by a newer rendezvous call", NULL, 0);
    j->arrived--;
  }
  j->rdv[r] = call;
  snprintf(j->comm_addr[r], sizeof j->comm_addr[r], "%s", req->comm_addr);
  if (++j->arrived == j->row.world) reply_rendezvous(c, j);
  return;
err:
  zt_rpc_reply(call, zt_errkind_grpc(zt_err_kind()), zt_err_msg(), NULL, 0);
}

/* ---- rollback --------------------------------------------------------------- */

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

/* Rolls the job back to the newest committed epoch at or before
 * max_ckpt_step (or to initialization), skipping the data of steps
 * first_step..last_step + skip_steps and lowering the LR for the cooldown.
 * A budgeted rollback (the detector's) beyond rollback.max_rollbacks per
 * rollback.per_steps pauses the job instead. */
static int rollback(zt_coord_t *c, zt_job_t *j, int64_t first_step, int64_t last_step,
                    int64_t max_ckpt_step, int64_t skip_steps, int budgeted, const char *why) {
  zt_db_ckpt_t ck;
  int have = 0, any = 0;
  if (j->p.ckpt_dir[0] && zt_ckpt_newest(c, j, max_ckpt_step, 1, &ck, &have) != 0) return -1;
  /* The epoch to go back to exists but cannot be loaded now (its copies
   * are on machines without a live worker): nothing is deleted; an
   * operator is told, a spike pauses the job without the epochs after it. */
  if (j->p.ckpt_dir[0] && !have && zt_ckpt_newest(c, j, max_ckpt_step, 0, &ck, &any) != 0)
    return -1;
  if (any && !budgeted)
    return zt_errk(ZT_E_STATE, "cannot roll back now: the checkpoint at step %lld lacks a copy "
                   "on a machine with a live worker; nothing changed", (long long)ck.step);
  if (any) {
    zt_ckpt_drop_after(c, j, ck.step);
    finish(c, j, ZT_JOB_PAUSED, "job_paused",
           "paused: %s; the checkpoint to roll back to (step %lld) lacks a copy on a machine "
           "with a live worker; zctl resume continues from it once one is back", why,
           (long long)ck.step);
    return 0;
  }
  int64_t to = have ? ck.step : 0;
  int recent = recent_rollbacks(j, last_step);
  if (budgeted && recent >= j->p.rb_max) {
    force_start(j, to, have ? ck.dir : ""); /* where zctl resume continues */
    zt_ckpt_drop_after(c, j, to); /* ... and not from the epochs of the spike */
    finish(c, j, ZT_JOB_PAUSED, "job_paused",
           "paused: %d rollbacks within %lld steps (max_rollbacks %lld) and another spike: %s; "
           "zctl resume continues from the last good checkpoint",
           recent, (long long)j->p.rb_per_steps, (long long)j->p.rb_max, why);
    return 0;
  }
  /* The row the rollback leaves; an operator's is stored before anything
   * changes, so that a refused write refuses it. */
  zt_db_job_t next = j->row;
  uint64_t lo, hi;
  if (skip_data(c, j, &next.skips, first_step, last_step, skip_steps, &lo, &hi) != 0) {
    force_start(j, to, have ? ck.dir : "");
    zt_ckpt_drop_after(c, j, to);
    finish(c, j, ZT_JOB_PAUSED, "job_paused",
           "paused: the data of the spike cannot be skipped (%d skip ranges, the limit): %s; "
           "zctl rollback or resume continue",
           j->row.skips.n, why);
    return 0;
  }
  next.rollbacks++;
  remember_rollback(&next, last_step);
  next.lr_factor = j->p.rb_lr_factor;
  next.lr_until = last_step + j->p.rb_cooldown;
  if (!budgeted && store_first(c, j, &next, "rollback") != 0) return -1;
  double old_factor = j->row.lr_factor > 0 ? j->row.lr_factor : 1.0;
  j->row = next;
  force_start(j, to, have ? ck.dir : "");
  if (budgeted) save_job(c, j);
  zt_coord_event(c, j->row.id, "rollback", 0, "rollback %d: %s; restarting from %s (step %lld)",
                 j->row.rollbacks, why, have ? "checkpoint" : "initialization", (long long)to);
  if (hi > lo)
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

/* ---- reports from the ranks ----------------------------------------------------------- */

/* Feeds the detector; 1 when the step triggered a rollback. */
static int check_spike(zt_coord_t *c, zt_job_t *j, const Ztrain__ReportStepRequest *req) {
  if (!isfinite(req->loss) && (!j->poisoned_from || req->step < j->poisoned_from))
    j->poisoned_from = req->step;
  if (!j->p.rb_enabled) return 0;
  zt_spike_verdict_t v;
  int spiked = zt_spike_feed(&j->det, req->step, req->loss, req->grad_norm, &v);
  ZT_DEBUG("job %llu step %lld: loss %.5g norm %.4g z(loss) %.2f z(norm) %.2f",
           (unsigned long long)j->row.id, (long long)req->step, req->loss, req->grad_norm,
           v.z_loss, v.z_gnorm);
  if (!spiked) return 0;
  zt_coord_event(c, j->row.id, "spike", 0, "%s", v.reason);
  /* The loss of step s is computed before update s, so a loss first out
   * at s may come from update s - 1 (a bad step whose gradient looked
   * normal): epoch s - 1 holds it, and the target is s - 2 or earlier. */
  rollback(c, j, v.first_step, req->step, v.first_step - 2 - j->p.rb_margin, j->p.rb_skip, 1,
           v.reason);
  return 1;
}

/* Checkpointing is paused and the steps a failure would lose exceed
 * checkpoint.max_uncommitted_steps: the job pauses (1). */
static int over_risk_budget(zt_coord_t *c, zt_job_t *j) {
  int64_t at_risk = j->row.step - j->safe_step;
  if (!j->ckpt_paused || !j->p.max_uncommitted || at_risk <= j->p.max_uncommitted ||
      j->row.step >= j->row.total_steps)
    return 0;
  finish(c, j, ZT_JOB_PAUSED, "job_paused",
         "paused: no checkpoint committed for %lld steps (checkpoint.max_uncommitted_steps "
         "%lld); checkpoint writes fail: %.200s; fix the storage, then zctl resume continues "
         "from step %lld",
         (long long)at_risk, (long long)j->p.max_uncommitted, j->ckpt_error,
         (long long)j->safe_step);
  zt_jobs_schedule(c);
  return 1;
}

int zt_jobs_report_step(zt_coord_t *c, const Ztrain__ReportStepRequest *req, int *command) {
  zt_job_t *j;
  zt_member_t *m;
  if (fence(c, req->worker_id, req->job_id, req->generation, &j, &m) != 0) return -1;
  if (m->rank != 0)
    return zt_errk(ZT_E_STATE, "only rank 0 reports steps (worker %s is rank %d)", m->row.name,
                   m->rank);
  if (req->step < 1 || req->step > j->row.total_steps)
    return zt_errk(ZT_E_INVALID, "step %lld out of range 1..%lld", (long long)req->step,
                   (long long)j->row.total_steps);
  zt_db_step_t s = {req->step, req->generation, req->loss, req->grad_norm, req->lr,
                    req->tokens_per_s, req->val_loss, zt_wall_ms()};
  /* The job moves to the step only once it is stored: a refused write
   * leaves memory as the database is, and the rank's retry stores it. */
  zt_db_job_t next = j->row;
  next.step = req->step;
  next.updated_ms = zt_wall_ms();
  if (zt_db_begin(c->db) != 0 || zt_db_step_put(c->db, j->row.id, &s) != 0 ||
      zt_db_job_update(c->db, &next) != 0 || zt_db_commit(c->db) != 0) {
    zt_err_wrapk(ZT_E_UNAVAILABLE, "cannot store step %lld", (long long)req->step);
    zt_db_rollback(c->db);
    return -1;
  }
  j->row = next;
  j->last = s;
  *command = j->ckpt_request ? ZTRAIN__COMMAND__COMMAND_CHECKPOINT_NOW
                             : ZTRAIN__COMMAND__COMMAND_CONTINUE;
  if (req->step > j->start_step) zt_restarts_progress(&j->rs);
  if (over_risk_budget(c, j)) {
    *command = ZTRAIN__COMMAND__COMMAND_STOP;
    return 0;
  }
  if (check_spike(c, j, req)) {
    *command = ZTRAIN__COMMAND__COMMAND_ROLLBACK;
    return 0;
  }
  if (req->step == j->row.total_steps) {
    *command = ZTRAIN__COMMAND__COMMAND_STOP;
    if (j->p.ckpt_dir[0]) { /* complete when the final epoch commits */
      await_final(c, j);
      return 0;
    }
    finish(c, j, ZT_JOB_COMPLETED, "job_completed", "completed %lld steps; final loss %.6g",
           (long long)req->step, req->loss);
    zt_jobs_schedule(c);
  }
  return 0;
}

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

/* The verdict on the current generation's reachability reports: the ranks
 * out are kept out (until they reach the others again), then the
 * generation fails as the restart policy says. */
static void judge_reach(zt_coord_t *c, zt_job_t *j) {
  zt_reach_t *rc = &j->reach;
  uint8_t out[ZT_REACH_MAX / 8];
  zt_reach_decide(rc, out);
  for (int k = 0; k < rc->world; k++) {
    if (!((out[k / 8] >> (k % 8)) & 1)) continue;
    zt_member_t *w = zt_members_get(c, j->workers[k]);
    if (!w) continue;
    char list[256];
    zt_reach_list(rc, k, list, sizeof list);
    zt_members_quarantine(c, w);
    zt_coord_event(c, j->row.id, "worker_cut_off", w->row.id,
                   "rank %d (%s on %s) and ranks [%s] cannot reach each other (%d of %d ranks "
                   "reported): kept out until it reaches the others", k, w->row.name,
                   w->row.host, list, rc->nreported, rc->world);
  }
  /* A new generation resets j->reach: the reason must outlive it. */
  char why[sizeof rc->why];
  memcpy(why, rc->why, sizeof why);
  rc->decide_at_ms = 0;
  fail_generation(c, j, ZT_FAIL_PEER, rc->step, why, NULL);
}

/* A peer failure with probe results: decided now, or once the other ranks
 * reported (or reach_wait_ms passed: zt_jobs_schedule). */
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
    judge_reach(c, j);
    return;
  }
  if (!rc->decide_at_ms) {
    rc->decide_at_ms = zt_now_ms() + reach_wait_ms(j);
    char list[256], what[300] = "reaches every other rank";
    zt_reach_list(rc, m->rank, list, sizeof list);
    if (list[0]) snprintf(what, sizeof what, "reaches only a minority (not ranks [%s])", list);
    zt_coord_event(c, j->row.id, "reach_undecided", m->row.id,
                   "rank %d (%s) %s; waiting up to %lld ms for the other ranks' reports",
                   m->rank, m->row.name, what, (long long)reach_wait_ms(j));
  }
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

int zt_jobs_report_failure(zt_coord_t *c, const Ztrain__ReportFailureRequest *req) {
  zt_job_t *j;
  zt_member_t *m = zt_members_get(c, req->worker_id);
  /* Already moved on: the worker belongs to a newer generation of the same
   * job (another rank reported first). Nothing to do; the reply carries the
   * new assignment. */
  if (m && m->job_id == req->job_id && m->gen > req->generation) return 0;
  if (fence(c, req->worker_id, req->job_id, req->generation, &j, &m) != 0) return -1;
  char reason[400];
  snprintf(reason, sizeof reason, "%.300s", req->reason);
  if (req->fatal) {
    finish(c, j, ZT_JOB_FAILED, "job_failed", "rank %d (%s): %s", m->rank, m->row.name, reason);
    zt_jobs_schedule(c);
    return 0;
  }
  zt_coord_event(c, j->row.id, "rank_failed", m->row.id, "generation %llu rank %d: %s",
                 (unsigned long long)req->generation, m->rank, reason);
  char bad[sizeof j->start_ckpt] = "";
  if (req->bad_checkpoint[0] &&
      zt_path_confine(c->cfg.ckpt_root, req->bad_checkpoint, "bad_checkpoint", bad, sizeof bad) != 0)
    snprintf(bad, sizeof bad, "%s", req->bad_checkpoint); /* matches no epoch: fails the job */
  if (bad[0] && zt_ckpt_mark_bad(c, j, bad, reason) != 0) {
    finish(c, j, ZT_JOB_FAILED, "job_failed", "cannot load checkpoint %s: %s",
           req->bad_checkpoint, reason);
    zt_jobs_schedule(c);
    return 0;
  }
  char why[512];
  snprintf(why, sizeof why, "rank %d reported: %.300s", m->rank, reason);
  zt_fail_kind_t kind = req->kind == ZTRAIN__FAILURE_KIND__FAILURE_LOCAL ? ZT_FAIL_LOCAL
                        : req->kind == ZTRAIN__FAILURE_KIND__FAILURE_OUT_OF_MEMORY
                            ? ZT_FAIL_MEMORY
                            : ZT_FAIL_PEER;
  if (kind == ZT_FAIL_PEER && req->probed) {
    peer_failure(c, j, m, req, why);
    return 0;
  }
  /* 1 + the rank, or 0; any int32 may arrive, so the range check comes
   * before the subtraction (INT32_MIN - 1 overflows). */
  quarantine_peer(c, j, m, req->suspect_rank > 0 ? req->suspect_rank - 1 : -1);
  if (kind == ZT_FAIL_MEMORY) learn_memory(c, j, m);
  fail_generation(c, j, kind, req->step, why, m);
  return 0;
}

/* An epoch's write failed: checkpointing is paused (the job trains on); a
 * checkpoint-now epoch (drain, scale-up) that was to end the generation
 * ends it without the epoch, and the job re-forms from the last one. */
static void checkpoint_failed(zt_coord_t *c, zt_job_t *j) {
  if (j->final_by_ms && j->ck->step >= j->row.total_steps) {
    char why[400];
    snprintf(why, sizeof why, "the final epoch's write failed: %.300s", j->ck->error);
    final_failed(c, j, why);
    return;
  }
  if (!j->ckpt_paused)
    zt_coord_event(c, j->row.id, "checkpointing_paused", 0,
                   "checkpoint writes fail; training goes on for at most %lld steps past step "
                   "%lld: %s",
                   (long long)j->p.max_uncommitted, (long long)j->safe_step, j->ck->error);
  j->ckpt_paused = 1;
  snprintf(j->ckpt_error, sizeof j->ckpt_error, "%s", j->ck->error);
  snprintf(j->row.message, sizeof j->row.message,
           "running generation %llu on %d workers; checkpointing paused: %.200s",
           (unsigned long long)j->row.generation, j->row.world, j->ckpt_error);
  save_job(c, j);
  if (!j->ckpt_request) return;
  j->ckpt_request = 0;
  char reason[sizeof j->reform_reason + 256];
  snprintf(reason, sizeof reason, "%s: its checkpoint failed (%.200s)", j->reform_reason,
           j->ckpt_error);
  try_form(c, j, reason);
}

static void epoch_committed(zt_coord_t *c, zt_job_t *j);

int zt_jobs_report_checkpoint(zt_coord_t *c, const Ztrain__ReportCheckpointRequest *req,
                              int *committed) {
  zt_job_t *j;
  zt_member_t *m;
  zt_ckpt_outcome_t out;
  *committed = 0;
  if (fence(c, req->worker_id, req->job_id, req->generation, &j, &m) != 0) return -1;
  if (zt_ckpt_report(c, j, m, req, &out) != 0) return -1;
  if (out == ZT_CKPT_REPORT_FAILED) checkpoint_failed(c, j);
  if (out != ZT_CKPT_REPORT_COMMITTED) return 0;
  *committed = 1;
  epoch_committed(c, j);
  return 0;
}

int zt_jobs_report_replica(zt_coord_t *c, const Ztrain__ReportReplicaRequest *req,
                           int *committed) {
  *committed = 0;
  zt_job_t *j = zt_jobs_get(c, req->job_id);
  zt_member_t *m = zt_members_get(c, req->worker_id);
  if (!j) return zt_errk(ZT_E_NOT_FOUND, "unknown job %llu", (unsigned long long)req->job_id);
  if (!m) return zt_errk(ZT_E_NOT_FOUND, "unknown worker %llu", (unsigned long long)req->worker_id);
  const Ztrain__CheckpointFile *cf = req->file;
  zt_db_ckpt_file_t f;
  char dir[sizeof j->start_ckpt];
  if (!cf || strlen(cf->name) >= sizeof f.name || strlen(cf->checksum) >= sizeof f.checksum ||
      req->dir[0] == '/' ||
      zt_path_confine(c->cfg.ckpt_root, req->dir, "checkpoint dir", dir, sizeof dir) != 0)
    return zt_errk(ZT_E_INVALID, "a copy report names a relative epoch directory and a file");
  snprintf(f.name, sizeof f.name, "%s", cf->name);
  snprintf(f.checksum, sizeof f.checksum, "%s", cf->checksum);
  f.bytes = cf->bytes;
  zt_ckpt_outcome_t out;
  if (zt_ckpt_report_copy(c, j, m, dir, &f, &out) != 0) return -1;
  if (out != ZT_CKPT_REPORT_COMMITTED) return 0;
  *committed = 1;
  epoch_committed(c, j);
  return 0;
}

/* An epoch committed: counters, the end of a checkpointing pause,
 * retention, and a re-form that waited for it. */
static void epoch_committed(zt_coord_t *c, zt_job_t *j) {
  j->ckpt_commits++;
  j->safe_step = ZT_MAX(j->safe_step, j->ck->step);
  j->committed_step = ZT_MAX(j->committed_step, j->ck->step);
  if (j->ckpt_paused) {
    j->ckpt_paused = 0;
    zt_coord_event(c, j->row.id, "checkpointing_resumed", 0, "step %lld committed",
                   (long long)j->ck->step);
  }
  zt_ckpt_gc(c, j);
  if (final_committed(c, j, j->ck->step)) return;
  checkpoint_committed(c, j);
}

int zt_jobs_heartbeat_command(zt_coord_t *c, zt_member_t *m, uint64_t job_id, uint64_t gen,
                              uint64_t *out_job, uint64_t *out_gen) {
  (void)c;
  *out_job = m->job_id;
  *out_gen = m->gen;
  if (m->job_id && (job_id != m->job_id || gen != m->gen)) return ZTRAIN__COMMAND__COMMAND_RECONFIGURE;
  if (!m->job_id && job_id) return ZTRAIN__COMMAND__COMMAND_STOP;
  return ZTRAIN__COMMAND__COMMAND_CONTINUE;
}
