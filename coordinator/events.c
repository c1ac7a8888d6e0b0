/*
 * events.c: the logbook.
 *
 * Every decision the coordinator takes (a worker lost, a generation
 * formed, a checkpoint committed, a rollback) is recorded as an event row
 * in SQLite with the job, the worker and a sentence of detail, and logged.
 * Every event goes through this file (tools/check-layers checks it).
 * Transitions that must be atomic with their event (a worker's state and
 * its "lost" event, a commit) hold a transaction open and add the event
 * to it with zt_coord_event_tx; zt_coord_event is the plain append for
 * everything else.
 *
 * Repeats. A failure that keeps coming back (a generation that fails the
 * same way, a checkpoint that cannot be written) would fill the logbook
 * with the same few sentences. The kinds such a loop produces are
 * collapsed: an event of one of them whose shape (zt_text_shape: the
 * sentence with its numbers blanked) equals the shape of the previous event
 * of the same kind, job and worker, within ZT_EVENT_REPEAT_MS of it, adds
 * one to that row's count and records the newest's time and detail beside
 * the first's (a row never pairs one time with another occurrence's text);
 * the log line is written for counts that are powers of two. Every other kind is
 * one row per occurrence, so milestones (commits, rollbacks, job states)
 * stay individually visible.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "coord.h"

#define ZT_EVENT_REPEAT_MS (10 * 60 * 1000)

/* The kinds a failing loop produces. */
static const char *const k_repeating[] = {
    "rank_failed",        "generation_started", "rendezvous_complete", "restart_backoff",
    "checkpoint_failed",  "worker_suspected",   "job_pending",         "checkpoint_requested",
    "out_of_memory",      "checkpoint_unavailable", "coordinator_blind", "resumed_from_memory",
    "resumed_from_epoch"};

static int repeating(const char *kind) {
  for (size_t i = 0; i < ZT_ARRAY_LEN(k_repeating); i++)
    if (!strcmp(kind, k_repeating[i])) return 1;
  return 0;
}

static uint64_t fnv1a(uint64_t h, const char *s) {
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

/* The slot of (job, kind, worker) in the repeat cache, or the least
 * recently used one to take its place. */
static zt_event_slot_t *slot_of(zt_coord_t *c, uint64_t job_id, const char *kind,
                                uint64_t worker_id) {
  zt_event_slot_t *lru = &c->ev_slots[0];
  for (size_t i = 0; i < ZT_ARRAY_LEN(c->ev_slots); i++) {
    zt_event_slot_t *s = &c->ev_slots[i];
    if (s->job_id == job_id && s->worker_id == worker_id && !strcmp(s->kind, kind)) return s;
    if (s->last_mono_ms < lru->last_mono_ms) lru = s;
  }
  return lru;
}

/* Adds one to the count of the previous equal-shaped event, when there is
 * one; 1 when it did. */
static int collapse(zt_coord_t *c, uint64_t job_id, const char *kind, uint64_t worker_id,
                    const char *detail) {
  char shape[512];
  uint64_t sh = fnv1a(14695981039346656037ull, zt_text_shape(detail, shape, sizeof shape));
  zt_event_slot_t *s = slot_of(c, job_id, kind, worker_id);
  int64_t now = zt_now_ms();
  int same = s->id && s->job_id == job_id && s->worker_id == worker_id &&
             !strcmp(s->kind, kind) && s->shape == sh &&
             now - s->last_mono_ms < ZT_EVENT_REPEAT_MS;
  if (same && zt_db_event_repeat(c->db, s->id, detail) == 0) {
    s->count++;
    s->last_mono_ms = now;
    if ((s->count & (s->count - 1)) == 0)
      ZT_INFO("event %s worker=%llu job=%llu (%lld times): %s", kind,
              (unsigned long long)worker_id, (unsigned long long)job_id, (long long)s->count,
              detail);
    return 1;
  }
  memset(s, 0, sizeof *s);
  s->job_id = job_id, s->worker_id = worker_id, s->shape = sh;
  snprintf(s->kind, sizeof s->kind, "%s", kind);
  s->count = 1;
  s->last_mono_ms = now;
  return 0;
}

void zt_coord_event(zt_coord_t *c, uint64_t job_id, const char *kind, uint64_t worker_id,
                    const char *fmt, ...) {
  char detail[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  int rep = repeating(kind);
  if (rep && collapse(c, job_id, kind, worker_id, detail)) return;
  ZT_INFO("event %s worker=%llu job=%llu: %s", kind, (unsigned long long)worker_id,
          (unsigned long long)job_id, detail);
  int64_t id = 0;
  if (zt_db_event_add(c->db, job_id, kind, worker_id, detail, &id) != 0) {
    ZT_ERROR("cannot record event %s: %s", kind, zt_err_msg());
    return;
  }
  if (rep) slot_of(c, job_id, kind, worker_id)->id = id;
}

int zt_coord_event_tx(zt_coord_t *c, uint64_t job_id, const char *kind, uint64_t worker_id,
                      const char *detail) {
  return zt_db_event_add(c->db, job_id, kind, worker_id, detail, NULL);
}
