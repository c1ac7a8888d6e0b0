/*
 * jobtable.c: the jobs as the loop keeps them: lookup, the writes of their
 * rows, and the fence every worker-facing call passes.
 *
 * The coordinator's jobs are a list (zt_coord_t.jobs, in submission order)
 * of zt_job_t, each the cache of one row of SQLite's jobs table plus what
 * lives in memory only (the current generation's rendezvous, tallies,
 * detector, timers). Every file of the scheduler (jobs.c, reports.c,
 * rollback.c, sched.c, rendezvous.c) works on them through this one, which
 * calls none of them: it is the bottom of their stack.
 *
 * Writes. A job's row is written whenever its state changes. A failed
 * write (a busy or full disk) is logged and counted, and memory stays
 * ahead of the database until the next write succeeds, at the latest when
 * zt_jobtable_flush retries it a few seconds later (main.c's flush timer).
 * Operator actions and rollbacks instead store the row they would leave
 * before they change anything (zt_jobtable_store_first), so that a refused
 * write refuses the action and nothing changes.
 *
 * Fencing. Every worker-facing call names a job and a generation. A call
 * for any generation other than the job's current one is refused with
 * FAILED_PRECONDITION (zt_jobtable_fence); a heartbeat from a worker that
 * still believes in an old assignment is answered RECONFIGURE (new
 * assignment) or STOP (none). A paused or partitioned worker therefore can
 * never report into a newer generation.
 */
#include <stdio.h>

#include "coord.h"
#include "ztrain.pb-c.h"

zt_job_t *zt_jobtable_get(zt_coord_t *c, uint64_t id) {
  for (zt_job_t *j = c->jobs; j; j = j->next)
    if (j->row.id == id) return j;
  return NULL;
}

int zt_jobtable_active(const zt_job_t *j) {
  return j->row.state == ZT_JOB_PENDING || j->row.state == ZT_JOB_RUNNING ||
         j->row.state == ZT_JOB_RECONFIGURING;
}

/* ---- writes of the rows ------------------------------------------------------ */

void zt_jobtable_running_message(zt_job_t *j) {
  snprintf(j->row.message, sizeof j->row.message, "running generation %llu on %d workers%s%.200s",
           (unsigned long long)j->row.generation, j->row.world,
           j->ckpt_paused ? "; checkpointing paused: " : "", j->ckpt_paused ? j->ckpt_error : "");
}

int zt_jobtable_save(zt_coord_t *c, zt_job_t *j) {
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

int zt_jobtable_store_first(zt_coord_t *c, zt_job_t *j, zt_db_job_t *row, const char *action) {
  row->updated_ms = zt_wall_ms();
  if (zt_db_job_update(c->db, row) != 0)
    return zt_err_wrapk(ZT_E_UNAVAILABLE, "job %llu: cannot store the %s, nothing changed",
                        (unsigned long long)j->row.id, action);
  return 0;
}

void zt_jobtable_flush(zt_coord_t *c) {
  for (zt_job_t *j = c->jobs; j; j = j->next) {
    if (j->save_failures) (void)zt_jobtable_save(c, j);
    if (zt_jobtable_active(j)) zt_registry_retry_drops(c, j);
  }
}

/* ---- fencing ----------------------------------------------------------------- */

int zt_jobtable_fence(zt_coord_t *c, uint64_t wid, uint64_t job_id, uint64_t gen,
                      zt_job_t **jout, zt_member_t **mout) {
  zt_member_t *m = zt_members_get(c, wid);
  zt_job_t *j = zt_jobtable_get(c, job_id);
  if (!m)
    return zt_errk(ZT_E_NOT_FOUND, "unknown worker id %llu: register first",
                   (unsigned long long)wid);
  if (!j) return zt_errk(ZT_E_NOT_FOUND, "unknown job %llu", (unsigned long long)job_id);
  if (!zt_jobtable_active(j) || gen != j->row.generation || m->job_id != job_id || m->gen != gen)
    return zt_errk(ZT_E_STATE,
                   "stale generation: worker %s is not in generation %llu of job %llu (job is %s "
                   "at generation %llu); rejoin",
                   m->row.name, (unsigned long long)gen, (unsigned long long)job_id,
                   zt_name_job_state(j->row.state), (unsigned long long)j->row.generation);
  *jout = j;
  *mout = m;
  return 0;
}

int zt_jobtable_heartbeat_command(zt_coord_t *c, zt_member_t *m, uint64_t job_id, uint64_t gen,
                                  uint64_t *out_job, uint64_t *out_gen) {
  (void)c;
  *out_job = m->job_id;
  *out_gen = m->gen;
  if (m->job_id && (job_id != m->job_id || gen != m->gen))
    return ZTRAIN__COMMAND__COMMAND_RECONFIGURE;
  if (!m->job_id && job_id) return ZTRAIN__COMMAND__COMMAND_STOP;
  return ZTRAIN__COMMAND__COMMAND_CONTINUE;
}
