/*
 * events.c: the logbook.
 *
 * Every decision the coordinator takes (a worker lost, a generation
 * formed, a checkpoint committed, a rollback) is recorded as an event row
 * in SQLite with the job, the worker and a sentence of detail, and logged.
 * Transitions that must be atomic with their event (a worker's state and
 * its "lost" event) write both in one transaction themselves (members.c);
 * this is the plain append for everything else.
 */
#include <stdarg.h>
#include <stdio.h>

#include "coord.h"

void zt_coord_event(zt_coord_t *c, uint64_t job_id, const char *kind, uint64_t worker_id,
                    const char *fmt, ...) {
  char detail[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  ZT_INFO("event %s worker=%llu job=%llu: %s", kind, (unsigned long long)worker_id,
          (unsigned long long)job_id, detail);
  if (zt_db_event_add(c->db, job_id, kind, worker_id, detail, NULL) != 0)
    ZT_ERROR("cannot record event %s: %s", kind, zt_err_msg());
}
