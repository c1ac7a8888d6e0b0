/*
 * live.c: the model state a failed generation leaves in a survivor's
 * memory, and the next generation's start from it (live.h).
 *
 * At ZeRO stage 0 every rank holds the whole fp32 master and Adam's m and
 * v. A generation that fails outside a step's update-to-report window
 * leaves each survivor holding the state after a whole step: the last one
 * it completed, or the one before when that step's gradient gathers were
 * cut off on it (the update is all or none: zero.c). The record kept here
 * is that state, in zero.h's logical layout (which does not depend on the
 * world size), with the job's trajectory (its rollback count) and the
 * step; the coordinator starts the next generation from the newest such
 * state, which its holder sends to the ranks that lack it
 * (coordinator/rendezvous.c).
 * Since a job's steps are a function of its trajectory alone (the global
 * batch and every sum's order are fixed: docs/zero.md), any state of the
 * trajectory at step L resumes bit-identical to the run that never failed.
 */
#include "live.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "diloco.h"

/* The record without its state (its reports stay). */
static void drop_state(zt_live_t *l) {
  free(l->p);
  free(l->m);
  free(l->v);
  l->p = l->m = l->v = NULL;
  l->n = 0;
  l->step = 0;
}

void zt_live_free(zt_live_t *l) {
  if (!l) return;
  drop_state(l);
  free(l->rep);
  free(l);
}

static const zt_step_report_t *report_at(const zt_live_t *l, int i) {
  return &l->rep[(l->head + i) % ZT_LIVE_REPORTS];
}

int zt_live_holds(const zt_live_t *l, uint64_t job_id, int64_t *step, uint32_t *rollbacks,
                  int64_t *reports_from) {
  if (!l || !l->p || l->job_id != job_id) return 0;
  *step = l->step;
  *rollbacks = l->rollbacks;
  *reports_from = l->nrep ? report_at(l, 0)->step : l->step + 1;
  return 1;
}

static zt_live_t *new_record(const zt_gen_ctx_t *g) {
  zt_live_t *l = zt_xcalloc(1, sizeof *l);
  l->job_id = g->job_id;
  l->rollbacks = (uint32_t)g->rollbacks;
  return l;
}

/* Why the held record is not the state the rendezvous named; NULL: it is. */
static const char *mismatch(const zt_live_t *l, const zt_gen_ctx_t *g, size_t n) {
  if (!l || !l->p) return "this worker holds no state";
  if (l->job_id != g->job_id) return "it holds another job's state";
  if (l->rollbacks != (uint32_t)g->rollbacks) return "it holds a state from before a rollback";
  if (l->step != g->live_step) return "it holds another step's state";
  if (l->n != n) return "its state is not this model's size";
  return NULL;
}

/* The fault of a collective that failed: a peer's when the communicator
 * broke, else this rank's. */
static zt_train_fault_t fault_of(const zt_gen_ctx_t *g) {
  return zt_comm_broken(g->comm) ? ZT_FAULT_PEER : ZT_FAULT_LOCAL;
}

/* Rank root's kept reports (n of them) into every rank's l: summed over
 * the ranks with zeros from all but root, which is exact, in pieces the
 * control all-reduce takes. */
#define ZT_LIVE_PACK 8
#define ZT_LIVE_PIECE 128
static int share_reports(zt_zero_t *z, zt_live_t *l, int n, int root, int rank) {
  double buf[ZT_LIVE_PACK * ZT_LIVE_PIECE];
  zt_step_report_t *mine = rank == root ? NULL : zt_xcalloc(ZT_LIVE_REPORTS, sizeof *mine);
  for (int at = 0; at < n; at += ZT_LIVE_PIECE) {
    int k = ZT_MIN(ZT_LIVE_PIECE, n - at);
    memset(buf, 0, sizeof buf);
    for (int i = 0; !mine && i < k; i++) {
      const zt_step_report_t *r = report_at(l, at + i);
      double *d = buf + ZT_LIVE_PACK * i;
      d[0] = (double)r->step, d[1] = r->loss, d[2] = r->grad_norm, d[3] = r->lr;
      d[4] = r->tokens_per_s, d[5] = r->step_ms, d[6] = r->val_loss, d[7] = r->outer_refused;
    }
    if (zt_zero_host_all_reduce(z, buf, ZT_LIVE_PACK * (size_t)k, ZT_DT_F64) != 0) {
      free(mine);
      return zt_err_wrap("the kept step reports from rank %d", root);
    }
    for (int i = 0; mine && i < k; i++) {
      const double *d = buf + ZT_LIVE_PACK * i;
      mine[at + i] = (zt_step_report_t){.step = (int64_t)d[0], .loss = d[1], .grad_norm = d[2],
                                        .lr = d[3], .tokens_per_s = d[4], .step_ms = d[5],
                                        .val_loss = d[6], .outer_refused = (int)d[7]};
    }
  }
  if (mine) {
    free(l->rep);
    l->rep = mine, l->head = 0, l->nrep = n;
  }
  return 0;
}

/* From rank root's kept state: it says whether it holds it (a failure it
 * met is every rank's), puts it, and every rank takes it and its reports.
 * held is root's record (others': NULL); the generation's into *cur. */
static int from_peer(const zt_gen_ctx_t *g, zt_zero_t *z, int root, zt_live_t *held,
                     const char *why, zt_live_t **cur, zt_train_fault_t *fault) {
  double hdr[2] = {0, 0};
  if (g->rank == root) hdr[0] = why ? -1 : 1, hdr[1] = why ? 0 : held->nrep;
  if (zt_zero_host_all_reduce(z, hdr, 2, ZT_DT_F64) != 0) goto broken;
  if (hdr[0] < 0) {
    *fault = g->rank == root ? ZT_FAULT_LOCAL : ZT_FAULT_PEER;
    return zt_err("rank %d was to send the state after step %lld kept in memory, but %s", root,
                  (long long)g->live_step, g->rank == root ? why : "it holds none");
  }
  if (!(hdr[0] == 1 && hdr[1] >= 0 && hdr[1] <= ZT_LIVE_REPORTS)) { /* a peer's numbers */
    *fault = ZT_FAULT_PEER;
    return zt_err("rank %d says it sends %g kept step reports (at most %d)", root, hdr[1],
                  ZT_LIVE_REPORTS);
  }
  if (g->rank == root && zt_zero_full_put(z, held->p, held->m, held->v) != 0) {
    *fault = ZT_FAULT_LOCAL;
    return zt_err_wrap("the state kept in memory");
  }
  zt_live_t *l = g->rank == root ? held : new_record(g);
  int nrep = (int)hdr[1];
  if (zt_zero_full_broadcast(z, root) != 0 || share_reports(z, l, nrep, root, g->rank) != 0) {
    if (l != held) zt_live_free(l);
    goto broken;
  }
  *cur = l;
  return 0;
broken:
  *fault = fault_of(g);
  return -1;
}

int zt_live_start(const zt_gen_ctx_t *g, zt_zero_t *z, zt_live_t **cur, int64_t *step,
                  zt_train_fault_t *fault) {
  zt_live_t *held = g->live ? *g->live : NULL;
  if (g->live) *g->live = NULL;
  *cur = NULL;
  if (g->live_step <= 0) {
    zt_live_free(held);
    *cur = new_record(g);
    return 0;
  }
  int64_t t0 = zt_now_ms();
  int root = (int)g->live_source - 1; /* -1: every rank holds it */
  const char *why = mismatch(held, g, zt_zero_full_floats(z));
  *fault = ZT_FAULT_LOCAL;
  if (root >= 0) {
    int rc = from_peer(g, z, root, g->rank == root ? held : NULL, why, cur, fault);
    if (g->rank != root || rc != 0) zt_live_free(held);
    if (rc != 0) return -1;
  } else if (why) {
    zt_live_free(held);
    return zt_err("the rendezvous said to start from the state after step %lld kept in memory, "
                  "but %s", (long long)g->live_step, why);
  } else if (zt_zero_full_put(z, held->p, held->m, held->v) != 0) {
    zt_live_free(held);
    return zt_err_wrap("the state kept in memory");
  } else {
    *cur = held;
  }
  drop_state(*cur);
  *step = g->live_step;
  char from[64] = "this worker kept";
  if (root >= 0 && root != g->rank) snprintf(from, sizeof from, "rank %d sent", root);
  ZT_INFO("resumed from memory: the state after step %lld that %s when the last generation "
          "failed, in place in %lld ms; no epoch read", (long long)g->live_step, from,
          (long long)(zt_now_ms() - t0));
  return 1;
}

void zt_live_note(zt_live_t *l, const zt_step_report_t *r) {
  if (!l) return;
  if (!l->rep) l->rep = zt_xcalloc(ZT_LIVE_REPORTS, sizeof *l->rep);
  zt_step_report_t *at;
  if (l->nrep < ZT_LIVE_REPORTS) {
    at = &l->rep[(l->head + l->nrep) % ZT_LIVE_REPORTS];
    l->nrep++;
  } else { /* the oldest goes */
    at = &l->rep[l->head];
    l->head = (l->head + 1) % ZT_LIVE_REPORTS;
  }
  *at = *r;
  at->shares = NULL; /* the call's only */
  at->nshares = 0;
}

int zt_live_replay(const zt_live_t *l, const zt_gen_ctx_t *g, int64_t start) {
  int end = 0;
  if (!l || g->rank != 0 || !g->report_step) return 0;
  int64_t from = 0, to = 0;
  for (int i = 0; i < l->nrep; i++) {
    const zt_step_report_t *r = report_at(l, i);
    if (r->step <= g->live_reported || r->step > start) continue;
    zt_train_cmd_t cmd = g->report_step(g->user, r);
    end |= cmd == ZT_CMD_STOP || cmd == ZT_CMD_ROLLBACK;
    if (!from) from = r->step;
    to = r->step;
  }
  if (from)
    ZT_INFO("reported steps %lld..%lld again from memory (the coordinator had stored up to "
            "step %lld)", (long long)from, (long long)to, (long long)g->live_reported);
  return end;
}

/* The state after step `at`, into l (whose state it was not yet). */
static int take_state(zt_live_t *l, zt_zero_t *z, int64_t at) {
  size_t n = zt_zero_full_floats(z), b = n * sizeof(float);
  l->p = malloc(b);
  l->m = malloc(b);
  l->v = malloc(b);
  if (!l->p || !l->m || !l->v) {
    drop_state(l);
    return zt_errk(ZT_E_NO_MEMORY, "no memory for a copy of the model state (3 x %zu floats)", n);
  }
  int back = zt_zero_full_get(z, l->p, l->m, l->v);
  if (back < 0) {
    drop_state(l);
    return -1;
  }
  if (back && at > 1)
    ZT_INFO("the update of step %lld did not arrive whole here (its gradient gathers were cut "
            "off): the state kept is the one after step %lld", (long long)at, (long long)(at - 1));
  l->n = n;
  l->step = at - back;
  return l->step > 0 ? 0 : zt_err("no step completed");
}

void zt_live_end(zt_live_t **cur, const zt_gen_ctx_t *g, zt_zero_t *z, int64_t at) {
  zt_live_t *l = *cur;
  *cur = NULL;
  if (!l) return;
  if (at <= 0 || !g->live || !z) {
    zt_live_free(l);
    return;
  }
  /* The generation's failure is what the worker reports: kept as it is. */
  char failure[ZT_ERR_MAX];
  snprintf(failure, sizeof failure, "%s", zt_err_msg());
  zt_errkind_t kind = zt_err_kind();
  int64_t t0 = zt_now_ms();
  if (take_state(l, z, at) != 0) {
    ZT_WARN("the model state after step %lld is not kept in memory (the next generation starts "
            "from another rank's or the last epoch): %s", (long long)at, zt_err_msg());
    zt_live_free(l);
  } else {
    zt_live_free(*g->live);
    *g->live = l;
    ZT_INFO("kept the model state after step %lld in memory (%.1f MiB, %lld ms) for the next "
            "generation", (long long)l->step, 3.0 * (double)l->n * sizeof(float) / 1048576.0,
            (long long)(zt_now_ms() - t0));
  }
  (void)zt_errk(kind, "%s", failure);
}

/* ---- the other starts ---------------------------------------------------------- */

/* DiLoCo's kept round is its own kind of state kept in memory (diloco.h). */
void zt_gen_stash_free(struct zt_diloco_stash *st) { zt_diloco_stash_free(st); }

/* Whom a failed load of an epoch blames. */
zt_train_fault_t zt_train_load_fault(zt_errkind_t kind) {
  switch (kind) {
    case ZT_E_INVALID:
    case ZT_E_NOT_FOUND:
    case ZT_E_TOO_LARGE:
      return ZT_FAULT_CHECKPOINT;
    case ZT_E_NO_MEMORY:
      return ZT_FAULT_MEMORY;
    default:
      return ZT_FAULT_LOCAL;
  }
}
