/*
 * sched.c: the scheduler: forming generations, failures, and the end of a
 * job.
 *
 * A job is a submitted spec plus a state machine:
 *
 *   PENDING --(>= min_workers idle)--> RECONFIGURING(gen g) --(all ranks
 *   rendezvoused)--> RUNNING(g) --(member lost/left/failed)--> RECONFIGURING
 *   (g+1) ... --> COMPLETED | FAILED | CANCELED
 *
 * (and PAUSED, by an operator or the restart policy, until zctl resume).
 * A generation is a fixed set of workers with ranks 0..N-1. Forming one
 * (zt_sched_try_form) writes the generation, its members and the job row in
 * one transaction, then assigns each member its rank; the members learn of
 * it through their next heartbeat and meet in rendezvous.c, which makes the
 * job RUNNING.
 *
 * World size. The global batch is fixed for the life of the job (params.c),
 * so a generation's N must divide the micro-batches per step. The
 * scheduler picks the largest such N between min_workers and max_workers
 * for which there are N usable workers (alive, not draining, not kept out
 * as cut off or for a repeated error) that can each hold one rank at that
 * size (engine/memplan.h). Survivors of the current generation come first,
 * in rank order, so a re-formed generation keeps what it can; for DiLoCo
 * groups (sync.group_size) the chosen workers are then listed host by
 * host, so that a group is one machine's workers where it can be.
 *
 * Where a generation starts: the epoch a rollback chose, else the newest
 * committed epoch whose every file a live worker can serve (copies.c),
 * else the spec's checkpoint.load. A job whose committed epochs are all
 * out of reach pauses rather than quietly start over.
 *
 * Failures. A generation that fails (a rank's report, a member lost or
 * restarted, a verdict on who is cut off) is re-formed as the restart
 * policy (restarts.h) says: at once, after a backoff (zt_sched_run, on the
 * liveness timer, forms it when due), or not at all: a deterministic error
 * or a spent budget pauses the job with the reason. A worker with the same
 * error twice at one step is kept out of the job if it can go on without
 * it.
 *
 * Checkpoint boundaries. A drain, or idle workers enough for a larger
 * world, ask for a checkpoint now; the generation is re-formed once that
 * epoch commits (zt_sched_epoch_committed), from it, or once its write
 * fails (reports.c), from the last epoch.
 *
 * The end. With checkpoints, a job whose last step is done completes when
 * its final epoch commits, when that write fails, or after
 * ZT_FINAL_CKPT_WAIT_MS; without, at once (reports.c). COMPLETED, FAILED
 * and CANCELED are final; PAUSED keeps the job for zctl resume.
 *
 * try_form, fail_generation and zt_sched_run call each other (a failure
 * re-forms; a job that cannot form pauses, and the pass lets the other
 * jobs take its workers), so they are one file. jobs.c, reports.c and
 * rollback.c call in; of the scheduler's files it calls only rendezvous.c
 * (to answer held calls) and jobtable.c, besides the modules below them
 * (ckpt.c, members.c, restarts.c, reach.c, events.c).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"

/* How long a job whose last step is done waits for its final epoch to
 * commit before it completes without it (writes and copies of the final
 * epoch take what any epoch takes; a worker lost meanwhile re-forms the
 * job, which computes the last steps again). */
#define ZT_FINAL_CKPT_WAIT_MS 120000

/* ---- members and the end of a generation ------------------------------------- */

static void assign(zt_member_t *m, const zt_job_t *j, int rank) {
  m->job_id = j->row.id, m->gen = j->row.generation, m->rank = rank;
}

static void unassign(zt_member_t *m) { m->job_id = m->gen = 0, m->rank = -1; }

/* Detaches every member of the job's current generation. */
static void release_members(zt_coord_t *c, zt_job_t *j) {
  for (int r = 0; r < j->row.world; r++) {
    zt_member_t *m = zt_members_get(c, j->workers[r]);
    if (m && m->job_id == j->row.id) unassign(m);
  }
}

/* The current generation is over: its held rendezvous calls are answered
 * (why) and its members are idle. */
static void release_generation(zt_coord_t *c, zt_job_t *j, const char *why) {
  zt_rdv_release(j, ZT_RPC_ABORTED, why);
  release_members(c, j);
}

void zt_sched_finish(zt_coord_t *c, zt_job_t *j, int state, const char *kind, const char *fmt,
                     ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(j->row.message, sizeof j->row.message, fmt, ap);
  va_end(ap);
  release_generation(c, j, "job ended");
  j->retry_at_ms = 0;
  j->row.state = state;
  zt_jobtable_save(c, j);
  zt_coord_event(c, j->row.id, kind, 0, "%s", j->row.message);
  if (zt_db_job_ended(state)) {
    zt_registry_forget(j);
    zt_registry_gc(c, j); /* its pending epochs can never commit now */
  }
}

/* ---- choosing the members ---------------------------------------------------- */

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
 * size that can share the micro-batches of a step (zt_params_world_ok) and
 * has that many candidates. Returns it, or 0 with what is missing in why. */
static int pick_members(zt_coord_t *c, zt_job_t *j, uint64_t pick[ZT_MAX_WORLD], char *why,
                        size_t whylen) {
  int best = -1, have = 0;
  for (int n = j->p.max_workers; n >= j->p.min_workers; n--) {
    if (!zt_params_world_ok(&j->p, n)) continue;
    int k = candidates(c, j, n, pick);
    if (k == n) return n;
    if (best < 0) best = n, have = k; /* the largest size: the smallest need */
  }
  const zt_memplan_need_t *need = &j->p.need[best];
  char h[32], d[32];
  snprintf(why, whylen,
           "waiting for %d workers that can each hold one rank (%s of RAM on CPU workers, %s "
           "of GPU memory on GPU workers, at world size %d, ZeRO stage %d); %d available",
           best, zt_memplan_text(need->host, h, sizeof h), zt_memplan_text(need->device, d, sizeof d),
           best, j->p.zero_stage, have);
  return 0;
}

/* DiLoCo groups (sync.group_size): the picked workers of one host next to
 * each other (hosts in the order of their first pick, each one's workers in
 * pick order), so that a group's ZeRO traffic stays on one machine's fast
 * links as far as the hosts' numbers of workers allow. */
static void by_host(zt_coord_t *c, uint64_t pick[ZT_MAX_WORLD], int n) {
  uint64_t out[ZT_MAX_WORLD];
  uint8_t taken[ZT_MAX_WORLD] = {0};
  int k = 0;
  for (int i = 0; i < n; i++) {
    if (taken[i]) continue;
    const zt_member_t *a = zt_members_get(c, pick[i]);
    for (int q = i; q < n; q++) {
      const zt_member_t *b = zt_members_get(c, pick[q]);
      if (!taken[q] && (q == i || (a && b && !strcmp(a->row.host, b->row.host))))
        taken[q] = 1, out[k++] = pick[q];
    }
  }
  memcpy(pick, out, (size_t)n * sizeof *pick);
}

/* Number of idle usable workers. */
static int idle_workers(zt_coord_t *c) {
  int n = 0;
  for (size_t i = 0; i < c->by_id_cap; i++) n += member_usable(c->by_id[i]) && !c->by_id[i]->job_id;
  return n;
}

/* ---- where a generation starts ----------------------------------------------- */

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
  } else if (j->p.ckpt_dir[0] && zt_registry_newest(c, j, INT64_MAX, 1, &ck, &have) == 0 && have) {
    *step = ck.step;
    snprintf(dir, dirlen, "%s", ck.dir);
  } else if (j->p.ckpt_dir[0] && zt_registry_newest(c, j, INT64_MAX, 0, &ck, &any) == 0 && any) {
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
  if (dir[0] && zt_registry_record(c, dir, &j->start_files, &j->n_start_files) != 0)
    ZT_WARN("job %llu: %s", (unsigned long long)j->row.id, zt_err_msg());
}

/* ---- the generation's machines and collectives ------------------------------- */

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
 * generations, ranks sharing a GPU, a worker without NCCL, DiLoCo groups
 * of several workers, whose views of the ranks need the ring's mesh). */
static void choose_comm(zt_coord_t *c, zt_job_t *j) {
  j->nccl = j->row.world >= 2 && j->p.group_size == 1;
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

/* ---- the end of a job -------------------------------------------------------- */

void zt_sched_await_final(zt_coord_t *c, zt_job_t *j) {
  if (j->final_by_ms) return;
  j->final_by_ms = zt_now_ms() + ZT_FINAL_CKPT_WAIT_MS;
  snprintf(j->row.message, sizeof j->row.message,
           "step %lld of %lld done; committing the final checkpoint",
           (long long)j->row.step, (long long)j->row.total_steps);
  zt_jobtable_save(c, j);
}

static void complete(zt_coord_t *c, zt_job_t *j, const char *ckpt_note) {
  zt_sched_finish(c, j, ZT_JOB_COMPLETED, "job_completed",
                  "completed %lld steps; final loss %.6g; %s", (long long)j->row.total_steps,
                  j->last.loss, ckpt_note);
  zt_sched_run(c);
}

/* Called on every commit: 1 when it was the final epoch and the job is now
 * complete. */
static int final_committed(zt_coord_t *c, zt_job_t *j, int64_t step) {
  if (step < j->row.total_steps || !zt_jobtable_active(j)) return 0;
  char note[96];
  snprintf(note, sizeof note, "final checkpoint step %lld committed", (long long)step);
  complete(c, j, note);
  return 1;
}

void zt_sched_final_failed(zt_coord_t *c, zt_job_t *j, const char *why) {
  zt_coord_event(c, j->row.id, "final_checkpoint_failed", 0, "%s", why);
  char note[400];
  snprintf(note, sizeof note, "no final checkpoint (%.300s)", why);
  complete(c, j, note);
}

/* ---- forming generations ----------------------------------------------------- */

/* No generation can be formed: back to PENDING, saying what is missing
 * (the message changes as workers come and go). */
static void to_pending(zt_coord_t *c, zt_job_t *j, const char *missing, const char *reason) {
  char msg[sizeof j->row.message];
  snprintf(msg, sizeof msg, "%s (%s)", missing, reason);
  if (j->row.state == ZT_JOB_PENDING) {
    if (strncmp(j->row.message, missing, strlen(missing)) != 0) {
      snprintf(j->row.message, sizeof j->row.message, "%s", missing);
      zt_jobtable_save(c, j);
    }
    return;
  }
  release_generation(c, j, "not enough workers; job pending");
  j->row.state = ZT_JOB_PENDING;
  snprintf(j->row.message, sizeof j->row.message, "%s", msg);
  zt_jobtable_save(c, j);
  zt_coord_event(c, j->row.id, "job_pending", 0, "%s", j->row.message);
}

/* A backed-off re-form: the generation's members are let go (they idle
 * until it is due) and the job says when it retries and why. */
static void hold(zt_coord_t *c, zt_job_t *j, int64_t delay_ms, const char *reason,
                 const char *why) {
  release_generation(c, j, "generation failed; re-forming later");
  j->row.state = ZT_JOB_RECONFIGURING;
  snprintf(j->row.message, sizeof j->row.message, "%s", why);
  zt_jobtable_save(c, j);
  j->retry_at_ms = zt_now_ms() + delay_ms;
  snprintf(j->retry_reason, sizeof j->retry_reason, "%s", reason);
  zt_coord_event(c, j->row.id, "restart_backoff", 0, "%s", why);
}

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
  j->reported_step = j->row.step; /* what a start from memory need not report again */
  j->row = next;
  return 0;
}

/* What the previous generation left in memory, cleared for a new one that
 * starts at start_step: a rollback's forced start, the wait for a final
 * epoch, reachability reports, a checkpoint-now request, a poisoned step,
 * a put-off retry. */
static void reset_generation(zt_job_t *j, int64_t start_step) {
  j->rb_ckpt_step = -1;
  j->rb_ckpt_dir[0] = 0;
  j->final_by_ms = 0;
  zt_reach_reset(&j->reach, 0, 0);
  j->ckpt_request = 0;
  j->poisoned_from = 0;
  j->retry_at_ms = 0;
  j->rejoin_until_ms = 0;
  j->safe_step = start_step;
  /* The baseline survives a new generation (replayed steps rejoin it); only
   * a run of suspicious steps in progress is forgotten. */
  j->det.run = 0;
}

/* Gives the members of the current generation their ranks; their names,
 * comma-separated, into names. */
static void assign_members(zt_coord_t *c, zt_job_t *j, char *names, size_t len) {
  names[0] = 0;
  for (int r = 0; r < j->row.world; r++) {
    zt_member_t *m = zt_members_get(c, j->workers[r]);
    assign(m, j, r);
    size_t l = strlen(names);
    snprintf(names + l, len - l, "%s%s", r ? "," : "", m->row.name);
  }
}

/* The generation just stored (members pick[0..n), from the epoch in dir
 * at start_step) becomes the one in memory: its members are assigned, and
 * learn of it through their next heartbeat. */
static void start_generation(zt_coord_t *c, zt_job_t *j, const uint64_t *pick, int n,
                             int64_t start_step, const char *dir, const char *reason) {
  j->forced_start = j->rb_ckpt_step >= 0; /* before the reset clears it */
  reset_generation(j, start_step);
  memcpy(j->workers, pick, (size_t)n * sizeof *pick);
  index_hosts(c, j);
  choose_comm(c, j);
  j->formed_ms = zt_now_ms();
  j->start_step = start_step;
  set_start(c, j, dir);
  char names[512];
  assign_members(c, j, names, sizeof names);
  zt_coord_event(c, j->row.id, "generation_started", 0,
                 "generation %llu: world %d, accum %lld, start step %lld, workers [%s]; reason: %s",
                 (unsigned long long)j->row.generation, n,
                 (long long)((j->p.global_batch / j->p.micro + n - 1) / n), (long long)start_step,
                 names,
                 reason);
  zt_registry_gc(c, j); /* pending epochs of the old generation can never commit */
}

/* The rejoin grace. Workers of the last generation that were lost
 * together (a cut of the coordinator's link that outlasted its blind
 * period, members.c; a rebooted switch) come back within moments of each
 * other. Once the first of them has registered again while others are
 * still lost, the job waits up to one heartbeat timeout for the rest
 * before it forms a generation, so it goes on in one generation of all
 * of them rather than a small one at once and a scale-up (or a pause:
 * the epoch's holders may be among the late ones) soon after. Survivors
 * that were never lost start no wait: a lost worker that does not come
 * back costs nothing. Returns 1 (with what it waits for in why) while it
 * waits. */
static int rejoin_wait(zt_coord_t *c, zt_job_t *j, char *why, size_t len) {
  int back = 0, lost = 0;
  for (int r = 0; j->row.generation && r < j->row.world && r < ZT_MAX_WORLD; r++) {
    const zt_member_t *m = zt_members_get(c, j->workers[r]);
    if (!m) continue;
    if (m->row.state == ZT_WORKER_LOST)
      lost++;
    else if (m->back_ms && m->back_ms >= j->formed_ms && member_usable(m) && !m->job_id)
      back++;
  }
  int64_t now = zt_now_ms();
  if (!lost || !back) {
    j->rejoin_until_ms = 0;
    return 0;
  }
  if (!j->rejoin_until_ms) j->rejoin_until_ms = now + c->cfg.heartbeat_timeout_ms;
  if (now >= j->rejoin_until_ms) return 0;
  snprintf(why, len,
           "waiting up to %lld ms for %d more workers of generation %llu, lost with the %d "
           "back already", (long long)(j->rejoin_until_ms - now), lost,
           (unsigned long long)j->row.generation, back);
  return 1;
}

/* Forms the job's next generation, or says why it cannot. It is called
 * whenever the current generation cannot go on, or a better one may be
 * possible: on every pass of zt_sched_run for a PENDING job and for one
 * whose backed-off retry is due; at once after a failure the restart
 * policy retries now (zt_sched_fail_generation); when a member leaves or
 * is drained without a checkpoint (zt_sched_member_gone); when the epoch
 * a drain or scale-up asked for commits or fails; after a rollback.
 * reason says why, in the logbook and the generation's row.
 *
 * In order: a job whose final epoch is committed already completes; while
 * the rejoin grace runs (rejoin_wait), or with too few usable workers, the
 * job goes (back) to PENDING, saying what it waits for; else the current generation is let go, the start epoch is
 * chosen (none loadable: the job pauses), the new generation is stored in
 * one transaction (a refused write: form_failed retries later) and becomes
 * the current one. */
void zt_sched_try_form(zt_coord_t *c, zt_job_t *j, const char *reason) {
  uint64_t pick[ZT_MAX_WORLD];
  char missing[300], dir[sizeof j->start_ckpt];
  int64_t start_step;
  /* The final epoch committed before this coordinator restarted, or before
   * a worker was lost: nothing is left to train. */
  if (j->rb_ckpt_step < 0 && j->committed_step >= j->row.total_steps &&
      final_committed(c, j, j->committed_step))
    return;
  int n = rejoin_wait(c, j, missing, sizeof missing)
              ? 0 : pick_members(c, j, pick, missing, sizeof missing);
  if (!n) {
    to_pending(c, j, missing, reason);
    return;
  }
  if (j->p.group_size > 1) by_host(c, pick, n);
  release_generation(c, j, "generation superseded");
  if (start_point(c, j, &start_step, dir, sizeof dir) != 0) {
    zt_sched_finish(c, j, ZT_JOB_PAUSED, "job_paused",
                    "paused: %s; bring back a machine that holds copies (the logbook's "
                    "checkpoint_unavailable events name the files): the job resumes by itself "
                    "once one can be loaded (or zctl resume)",
                    zt_err_msg());
    zt_sched_run(c);
    return;
  }
  if (commit_generation(c, j, pick, n, start_step, reason) != 0) {
    form_failed(c, j, reason);
    return;
  }
  start_generation(c, j, pick, n, start_step, dir, reason);
}

/* ---- failures ---------------------------------------------------------------- */

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

void zt_sched_fail_generation(zt_coord_t *c, zt_job_t *j, zt_fail_kind_t kind, int64_t step,
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
      zt_sched_finish(c, j, ZT_JOB_PAUSED, "job_paused", "%s", why);
      zt_sched_run(c);
      return;
    case ZT_RESTART_LATER: hold(c, j, delay, reason, why); return;
    case ZT_RESTART_NOW: zt_sched_try_form(c, j, reason); return;
  }
}

void zt_sched_judge_reach(zt_coord_t *c, zt_job_t *j) {
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
  zt_sched_fail_generation(c, j, ZT_FAIL_PEER, rc->step, why, NULL);
}

void zt_sched_member_gone(zt_coord_t *c, zt_member_t *m, const char *why, int failure) {
  zt_job_t *j = m->job_id ? zt_jobtable_get(c, m->job_id) : NULL;
  if (!j || !zt_jobtable_active(j)) return;
  char reason[256];
  snprintf(reason, sizeof reason, "worker %s (rank %d) %s", m->row.name, m->rank, why);
  unassign(m);
  if (failure)
    zt_sched_fail_generation(c, j, ZT_FAIL_LOST, j->row.step, reason, NULL);
  else
    zt_sched_try_form(c, j, reason);
}

/* ---- checkpoint boundaries --------------------------------------------------- */

/* An epoch was committed: a requested re-form (drain, scale-up) happens now. */
static void checkpoint_committed(zt_coord_t *c, zt_job_t *j) {
  if (!j->ckpt_request) return;
  j->ckpt_request = 0;
  char reason[300];
  /* A scale-up takes the workers there are now, which may be more than
   * when it was asked for: the reason names where it started from only
   * (the generation's event says the world it formed with). */
  if (j->reform_scale_up)
    snprintf(reason, sizeof reason, "scale-up from %d workers after checkpoint step %lld",
             j->row.world, (long long)j->ck->step);
  else
    snprintf(reason, sizeof reason, "%s after checkpoint step %lld", j->reform_reason,
             (long long)j->ck->step);
  /* The job's draining members are out after the re-form; they are told
   * STOP and stay idle. Each is logged once, by the job it left. */
  uint64_t out[ZT_MAX_WORLD];
  int n = 0;
  for (size_t i = 0; i < c->by_id_cap && n < ZT_MAX_WORLD; i++) {
    zt_member_t *m = c->by_id[i];
    if (m && m->draining && m->job_id == j->row.id) out[n++] = m->row.id;
  }
  zt_sched_try_form(c, j, reason);
  for (int i = 0; i < n; i++) {
    zt_member_t *m = zt_members_get(c, out[i]);
    if (m && m->job_id != j->row.id)
      zt_coord_event(c, j->row.id, "drained", m->row.id, "worker %s left the job at step %lld",
                     m->row.name, (long long)j->ck->step);
  }
}

void zt_sched_epoch_committed(zt_coord_t *c, zt_job_t *j) {
  if (final_committed(c, j, j->ck->step)) return;
  checkpoint_committed(c, j);
}

/* Scale up at a checkpoint boundary: asks for a checkpoint now when a
 * larger valid world has enough workers that can hold a rank. */
static void maybe_scale_up(zt_coord_t *c, zt_job_t *j) {
  uint64_t pick[ZT_MAX_WORLD];
  int n = ZT_MIN(j->p.max_workers, j->row.world + idle_workers(c));
  for (; n > j->row.world; n--)
    if (zt_params_world_ok(&j->p, n) && candidates(c, j, n, pick) == n) break;
  if (n <= j->row.world) return;
  j->ckpt_request = 1;
  j->reform_scale_up = 1;
  snprintf(j->reform_reason, sizeof j->reform_reason, "scale-up from %d to %d workers",
           j->row.world, n);
  zt_coord_event(c, j->row.id, "checkpoint_requested", 0, "%s", j->reform_reason);
}

/* ---- the scheduler's pass ---------------------------------------------------- */

/* A pause whose cause may have gone ends by itself: the job is pending
 * again, its message says "resumed by itself: <what>", and the logbook
 * "<why>: resumed at step S". */
static void resume_by_itself(zt_coord_t *c, zt_job_t *j, const char *what, const char *why) {
  j->row.state = ZT_JOB_PENDING;
  snprintf(j->row.message, sizeof j->row.message, "resumed by itself: %s", what);
  zt_jobtable_save(c, j);
  zt_coord_event(c, j->row.id, "job_resumed", 0, "%s: resumed at step %lld", why,
                 (long long)j->row.step);
}

static void resume_if_loadable(zt_coord_t *c, zt_job_t *j, int64_t now) {
  if (now < j->resume_check_ms) return;
  j->resume_check_ms = now + 1000;
  zt_db_ckpt_t ck;
  int have = 0;
  if (zt_registry_newest(c, j, INT64_MAX, 1, &ck, &have) != 0 || !have) return;
  char what[96], why[160];
  snprintf(what, sizeof what, "step %lld can be loaded again", (long long)ck.step);
  snprintf(why, sizeof why, "%s (a machine holding its copies is back)", what);
  resume_by_itself(c, j, what, why);
}

/* Backoff of the automatic retries of a storage pause. */
static int64_t storage_delay_ms(int retries) {
  return ZT_MIN(10000ll << ZT_MIN(retries, 5), 300000ll);
}

int zt_sched_storage_backoff(zt_job_t *j, int64_t now) {
  if (j->storage_retries >= ZT_STORAGE_RETRIES) return 0;
  int64_t delay = storage_delay_ms(j->storage_retries);
  j->storage_retry_ms = now + delay;
  return (int)(delay / 1000);
}

/* A job paused because its checkpoint writes failed (a full disk) may
 * find them working again: a machine's disk was freed, a mount came back.
 * Nothing here can see that, so the job is retried, backed off: a new
 * generation trains and writes again, and pauses again (the retry
 * counted) if its writes still fail, until the retries are spent. After a
 * restart of the coordinator the backoff starts again from now. */
static void resume_after_storage(zt_coord_t *c, zt_job_t *j, int64_t now) {
  if (j->storage_retries >= ZT_STORAGE_RETRIES) return;
  if (!j->storage_retry_ms) j->storage_retry_ms = now + storage_delay_ms(j->storage_retries);
  if (now < j->storage_retry_ms) return;
  j->storage_retry_ms = 0;
  j->storage_retries++;
  j->ckpt_paused = 0;
  char what[96];
  snprintf(what, sizeof what, "checkpoint writes retried (retry %d of %d)", j->storage_retries,
           ZT_STORAGE_RETRIES);
  resume_by_itself(c, j, what, what);
}

/* What one job is due, if anything: at most one step per pass. */
static void run_job(zt_coord_t *c, zt_job_t *j, int64_t now) {
  if (zt_jobtable_active(j) && j->rb_ckpt_step < 0 && j->committed_step >= j->row.total_steps &&
      j->row.total_steps > 0)
    final_committed(c, j, j->committed_step);
  else if (j->reach.decide_at_ms && now >= j->reach.decide_at_ms &&
           j->reach.gen == j->row.generation &&
           (j->row.state == ZT_JOB_RUNNING || j->row.state == ZT_JOB_RECONFIGURING))
    zt_sched_judge_reach(c, j);
  else if (zt_view_paused_for(j, ZT_UNLOADABLE_PAUSE))
    resume_if_loadable(c, j, now);
  else if (zt_view_paused_for(j, ZT_STORAGE_PAUSE))
    resume_after_storage(c, j, now);
  else if (j->row.state == ZT_JOB_PENDING)
    zt_sched_try_form(c, j, "enough workers");
  else if (j->retry_at_ms && now >= j->retry_at_ms)
    zt_sched_try_form(c, j, j->retry_reason);
  else if (j->final_by_ms && now >= j->final_by_ms && zt_jobtable_active(j))
    zt_sched_final_failed(c, j, "the final epoch did not commit in time");
  else if (j->final_by_ms)
    return; /* no scale-up: nothing is left to train */
  else if (j->row.state == ZT_JOB_RUNNING && j->p.ckpt_dir[0] && !j->ckpt_request &&
           !j->ckpt_paused && j->row.world < j->p.max_workers)
    maybe_scale_up(c, j);
}

void zt_sched_run(zt_coord_t *c) {
  int64_t now = zt_now_ms();
  for (zt_job_t *j = c->jobs; j; j = j->next) run_job(c, j, now);
}

/* ---- a coordinator restart --------------------------------------------------- */

/* The members of the stored current generation of an active job get their
 * ranks back, as try_form gave them. */
static void reload_generation(zt_coord_t *c, zt_job_t *j) {
  int n = 0;
  if (!j->row.generation || j->spec_error[0] ||
      zt_db_generation_members(c->db, j->row.id, j->row.generation, j->workers, ZT_MAX_WORLD,
                               &n) != 0 ||
      !zt_jobtable_active(j) || j->row.state == ZT_JOB_PENDING)
    return;
  for (int r = 0; r < n; r++) {
    zt_member_t *m = zt_members_get(c, j->workers[r]);
    if (m) assign(m, j, r);
  }
  index_hosts(c, j);
  choose_comm(c, j);
}

void zt_sched_reload(zt_coord_t *c, zt_job_t *j) {
  reload_generation(c, j);
  j->formed_ms = zt_now_ms();
  /* The current generation resumed from the newest committed epoch that
   * precedes it; after a restart that is still the newest one at or
   * below the generation's start step. */
  zt_db_ckpt_t ck;
  int have = 0;
  if (j->p.ckpt_dir[0] && zt_registry_newest(c, j, INT64_MAX, 0, &ck, &have) == 0 && have) {
    set_start(c, j, ck.dir);
    j->start_step = j->safe_step = j->committed_step = ck.step;
    j->committed_wall_ms = ck.t_ms;
  }
  /* Stopped while its final epoch was awaited: the wait starts again. */
  if (zt_jobtable_active(j) && j->p.ckpt_dir[0] && j->row.step >= j->row.total_steps)
    j->final_by_ms = zt_now_ms() + ZT_FINAL_CKPT_WAIT_MS;
}
