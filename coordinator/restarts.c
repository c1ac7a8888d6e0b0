/*
 * restarts.c: the restart policy (see restarts.h).
 *
 * Kept apart from the scheduler so that it is pure: sched.c feeds it every
 * failure and acts on the verdict (re-form now, re-form later from its
 * timer, or pause), and the unit test drives it with made-up clocks.
 */
#include "restarts.h"

#include <stdio.h>
#include <string.h>

#include "zt_common.h"

static const char *const k_kind_names[] = {
    [ZT_FAIL_PEER] = "transient", [ZT_FAIL_LOCAL] = "local",
    [ZT_FAIL_MEMORY] = "out of memory", [ZT_FAIL_LOST] = "member lost"};

/* The same local error at the same step as the previous one: 0 no, 1 from
 * another worker, 2 from the same one. */
static int repeats(zt_restarts_t *r, zt_fail_kind_t kind, int64_t step, const char *reason,
                   uint64_t worker) {
  if (kind != ZT_FAIL_LOCAL && kind != ZT_FAIL_MEMORY) return 0;
  char shape[256];
  zt_text_shape(reason, shape, sizeof shape);
  int same = r->have_local && r->local_step == step && !strcmp(shape, r->local_shape);
  if (same && worker && worker == r->local_worker) same = 2;
  r->have_local = 1;
  r->local_step = step;
  r->local_worker = worker;
  snprintf(r->local_shape, sizeof r->local_shape, "%s", shape);
  return same;
}

/* Counts the failure in the budget window; 1 when the budget is spent. */
static int over_budget(zt_restarts_t *r, const zt_spec_restart_t *pol, int64_t now_ms) {
  if (!r->window_start_ms || now_ms - r->window_start_ms >= pol->restart_window_s * 1000) {
    r->window_start_ms = now_ms;
    r->in_window = 0;
  }
  return ++r->in_window > pol->max_restarts;
}

zt_restart_verdict_t zt_restarts_decide(zt_restarts_t *r, const zt_spec_restart_t *pol,
                                        zt_fail_kind_t kind, int64_t step, const char *reason,
                                        uint64_t worker, int64_t now_ms, int64_t *delay_ms,
                                        char *why, size_t whylen) {
  *delay_ms = 0;
  int same = repeats(r, kind, step, reason, worker);
  if (same) {
    snprintf(why, whylen,
             "paused: the same %s error twice at step %lld, so retrying cannot help: %.300s; "
             "fix the cause, then zctl resume",
             k_kind_names[kind], (long long)step, reason);
    return same == 2 ? ZT_RESTART_EXCLUDE : ZT_RESTART_PAUSE;
  }
  if (over_budget(r, pol, now_ms)) {
    snprintf(why, whylen,
             "paused: %d failures within %lld s (elastic.max_restarts %d); last: %.300s; "
             "zctl resume continues",
             r->in_window, (long long)pol->restart_window_s, pol->max_restarts, reason);
    return ZT_RESTART_PAUSE;
  }
  r->streak++;
  if (r->streak >= pol->max_failed_generations) {
    snprintf(why, whylen,
             "paused: %d generations in a row failed before completing a step "
             "(elastic.max_failed_generations %d); last: %.300s; zctl resume continues",
             r->streak, pol->max_failed_generations, reason);
    return ZT_RESTART_PAUSE;
  }
  if (r->streak == 1) return ZT_RESTART_NOW;
  int64_t d = pol->backoff_ms;
  for (int i = 2; i < r->streak && d < pol->max_backoff_ms; i++) d *= 2;
  *delay_ms = ZT_MIN(d, pol->max_backoff_ms);
  snprintf(why, whylen, "%d generations in a row failed before completing a step: "
           "re-forming in %lld ms; last: %.300s",
           r->streak, (long long)*delay_ms, reason);
  return *delay_ms > 0 ? ZT_RESTART_LATER : ZT_RESTART_NOW;
}

void zt_restarts_progress(zt_restarts_t *r) { r->streak = 0; }

void zt_restarts_reset(zt_restarts_t *r) { memset(r, 0, sizeof *r); }
