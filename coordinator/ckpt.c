/*
 * ckpt.c: the checkpoint registry: which epochs exist, which are committed.
 *
 * Workers write a checkpoint epoch as one directory per step and
 * generation, `<checkpoint.dir>/job_<id>/step_<step>-g<gen>/`, each rank its
 * own files, written to temporary names, fsynced and renamed (worker side).
 * Then each rank calls ReportCheckpoint with its file list. An epoch is
 * committed, here and in SQLite, only when every rank of the generation has
 * reported it; a generation that ends before that leaves a pending epoch
 * that is never loaded and is deleted.
 *
 * Retention (checkpoint.keep_last, checkpoint.keep_every) is applied after
 * each commit: committed epochs beyond the newest keep_last are deleted
 * unless their step is a multiple of keep_every. Deleting is done here
 * because the checkpoint directory is storage shared by the job's workers
 * (a local directory for local runs); a reported directory outside the
 * job's checkpoint root is refused, so no report can make the coordinator
 * delete anything else.
 */
#define _XOPEN_SOURCE 700
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coord.h"
#include "ztrain.pb-c.h"

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  if (remove(path) != 0) ZT_WARN("cannot remove %s", path);
  return 0;
}

static void rm_tree(const char *dir) { nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS); }

/* The directory every epoch of job j lives under. */
static void job_root(const zt_job *j, char *buf, size_t n) {
  snprintf(buf, n, "%s/job_%llu", j->p.ckpt_dir, (unsigned long long)j->row.id);
}

typedef struct {
  zt_db_ckpt k[64];
  int n;
} ckpt_batch;

typedef struct {
  zt_coord *c;
  zt_job *j;
  int n_committed;
  int64_t newest;
  zt_db_ckpt best;
  ckpt_batch *drop; /* epochs to delete */
} gc_ctx;

static int count_committed(const zt_db_ckpt *k, void *user) {
  gc_ctx *g = user;
  if (k->state == ZT_CKPT_COMMITTED) {
    g->n_committed++;
    if (k->step >= g->newest) g->newest = k->step, g->best = *k;
  }
  return 0;
}

static int collect_for_gc(const zt_db_ckpt *k, void *user) {
  gc_ctx *g = user;
  ckpt_batch *b = g->drop;
  if (k->state == ZT_CKPT_DELETED || b->n == (int)ZT_ARRAY_LEN(b->k)) return 0;
  int drop = 0;
  if (k->state == ZT_CKPT_COMMITTED) {
    g->n_committed--; /* counts down: the first n - keep_last are older */
    int keep_every = g->j->p.keep_every > 0 && k->step % g->j->p.keep_every == 0;
    drop = g->n_committed >= g->j->p.keep_last && !keep_every;
  } else {
    /* Pending epochs of earlier generations can never commit. */
    drop = k->generation < g->j->row.generation;
  }
  if (drop) b->k[b->n++] = *k;
  return 0;
}

/* Applies retention and removes dead pending epochs of job j. */
void zt_ckpt_gc(zt_coord *c, zt_job *j) {
  if (!j->p.ckpt_dir[0]) return;
  static ckpt_batch drop;
  gc_ctx g;
  memset(&g, 0, sizeof g);
  drop.n = 0;
  g.c = c, g.j = j, g.drop = &drop;
  if (zt_db_ckpts_each(c->db, j->row.id, count_committed, &g) != 0 ||
      zt_db_ckpts_each(c->db, j->row.id, collect_for_gc, &g) != 0) {
    ZT_WARN("checkpoint gc: %s", zt_err_msg());
    return;
  }
  for (int i = 0; i < drop.n; i++) {
    zt_db_ckpt *k = &drop.k[i];
    int was = k->state;
    k->state = ZT_CKPT_DELETED;
    if (zt_db_ckpt_put(c->db, j->row.id, k) != 0) continue;
    rm_tree(k->dir);
    zt_coord_event(c, j->row.id, "checkpoint_deleted", 0, "step %lld generation %llu (%s): %s",
                   (long long)k->step, (unsigned long long)k->generation,
                   was == ZT_CKPT_COMMITTED ? "retention" : "never committed", k->dir);
  }
}

/* The newest committed epoch of a job; 0 with *found = 0 when none. */
int zt_ckpt_latest(zt_coord *c, zt_job *j, zt_db_ckpt *out, int *found) {
  gc_ctx g;
  memset(&g, 0, sizeof g);
  g.newest = -1;
  if (zt_db_ckpts_each(c->db, j->row.id, count_committed, &g) != 0) return -1;
  *found = g.n_committed > 0;
  if (*found) *out = g.best;
  return 0;
}

int zt_ckpt_report(zt_coord *c, zt_job *j, zt_member *m, const Ztrain__ReportCheckpointRequest *req,
                   int *committed, char *msg, size_t msglen) {
  char root[600];
  job_root(j, root, sizeof root);
  size_t rl = strlen(root);
  *committed = 0;
  if (!j->p.ckpt_dir[0]) {
    snprintf(msg, msglen, "job %llu has no checkpoint.dir", (unsigned long long)j->row.id);
    return ZT_RPC_FAILED_PRECONDITION;
  }
  if (strncmp(req->dir, root, rl) != 0 || req->dir[rl] != '/' || strstr(req->dir, "..") ||
      strlen(req->dir) >= sizeof(((zt_db_ckpt *)0)->dir)) {
    snprintf(msg, msglen, "checkpoint dir %.200s is not under %.200s", req->dir, root);
    return ZT_RPC_INVALID_ARGUMENT;
  }
  if (j->poisoned_from && req->step >= j->poisoned_from) {
    snprintf(msg, msglen, "checkpoint at step %lld refused: the loss was not finite at step %lld",
             (long long)req->step, (long long)j->poisoned_from);
    return ZT_RPC_FAILED_PRECONDITION;
  }
  if (req->step < 1 || req->step > j->row.total_steps) {
    snprintf(msg, msglen, "checkpoint step %lld out of range", (long long)req->step);
    return ZT_RPC_INVALID_ARGUMENT;
  }
  /* One epoch at a time per generation: a report for a newer step starts
   * a new tally (the older one can no longer complete). */
  if (j->ck_step != req->step || j->ck_gen != j->row.generation) {
    j->ck_step = req->step;
    j->ck_gen = j->row.generation;
    j->ck_count = 0;
    j->ck_bytes = 0;
    memset(j->ck_seen, 0, sizeof j->ck_seen);
    snprintf(j->ck_dir, sizeof j->ck_dir, "%s", req->dir);
    zt_db_ckpt k = {req->step, j->row.generation, j->row.world, "", ZT_CKPT_PENDING, 0,
                    zt_wall_ms()};
    snprintf(k.dir, sizeof k.dir, "%s", req->dir);
    if (zt_db_ckpt_put(c->db, j->row.id, &k) != 0) {
      snprintf(msg, msglen, "cannot store checkpoint: %s", zt_err_msg());
      return ZT_RPC_UNAVAILABLE;
    }
  }
  if (strcmp(j->ck_dir, req->dir) != 0) {
    snprintf(msg, msglen, "rank %d reported dir %.200s, expected %.200s", m->rank, req->dir,
             j->ck_dir);
    return ZT_RPC_INVALID_ARGUMENT;
  }
  if (!j->ck_seen[m->rank]) {
    j->ck_seen[m->rank] = 1;
    j->ck_count++;
    for (size_t i = 0; i < req->n_files; i++) j->ck_bytes += req->files[i]->bytes;
  }
  if (j->ck_count < j->row.world) return ZT_RPC_OK;
  zt_db_ckpt k = {req->step, j->row.generation, j->row.world, "", ZT_CKPT_COMMITTED, j->ck_bytes,
                  zt_wall_ms()};
  snprintf(k.dir, sizeof k.dir, "%s", req->dir);
  if (zt_db_begin(c->db) != 0 || zt_db_ckpt_put(c->db, j->row.id, &k) != 0 ||
      zt_db_event_add(c->db, j->row.id, "checkpoint_committed", 0, k.dir, NULL) != 0 ||
      zt_db_commit(c->db) != 0) {
    zt_db_rollback(c->db);
    snprintf(msg, msglen, "cannot commit checkpoint: %s", zt_err_msg());
    return ZT_RPC_UNAVAILABLE;
  }
  ZT_INFO("job %llu: checkpoint step %lld committed (%d ranks, %llu bytes)",
          (unsigned long long)j->row.id, (long long)req->step, j->row.world,
          (unsigned long long)j->ck_bytes);
  j->ck_count = -1000000; /* done: later duplicates do not re-commit */
  *committed = 1;
  j->ckpt_commits++;
  zt_ckpt_gc(c, j);
  zt_jobs_checkpoint_committed(c, j);
  return ZT_RPC_OK;
}

typedef struct {
  int64_t after;
  ckpt_batch *b;
} after_ctx;

static int collect_after(const zt_db_ckpt *k, void *user) {
  after_ctx *a = user;
  if (k->state != ZT_CKPT_DELETED && k->step > a->after && a->b->n < (int)ZT_ARRAY_LEN(a->b->k))
    a->b->k[a->b->n++] = *k;
  return 0;
}

/* Deletes every epoch after `step`: after a rollback they hold the state
 * being abandoned and must never be loaded. */
void zt_ckpt_drop_after(zt_coord *c, zt_job *j, int64_t step) {
  static ckpt_batch b;
  b.n = 0;
  after_ctx a = {step, &b};
  if (zt_db_ckpts_each(c->db, j->row.id, collect_after, &a) != 0) return;
  for (int i = 0; i < b.n; i++) {
    b.k[i].state = ZT_CKPT_DELETED;
    if (zt_db_ckpt_put(c->db, j->row.id, &b.k[i]) != 0) continue;
    rm_tree(b.k[i].dir);
    zt_coord_event(c, j->row.id, "checkpoint_deleted", 0, "step %lld: after the rollback target: %s",
                   (long long)b.k[i].step, b.k[i].dir);
  }
}

typedef struct {
  const char *dir;
  zt_db_ckpt found;
  int n;
} find_ctx;

static int find_dir(const zt_db_ckpt *k, void *user) {
  find_ctx *f = user;
  if (!strcmp(k->dir, f->dir) && k->state == ZT_CKPT_COMMITTED) f->found = *k, f->n++;
  return 0;
}

/* A committed epoch that failed to load (checksum, truncation): never use it
 * again. The files stay for inspection; the next generation starts from the
 * previous committed epoch. Returns -1 when `dir` is not one of the job's
 * own epochs (e.g. its checkpoint.load): there is nothing to fall back to. */
int zt_ckpt_mark_bad(zt_coord *c, zt_job *j, const char *dir, const char *why) {
  find_ctx f = {dir, {0}, 0};
  zt_coord_event(c, j->row.id, "checkpoint_corrupt", 0, "%s: %s", dir, why);
  if (zt_db_ckpts_each(c->db, j->row.id, find_dir, &f) != 0 || !f.n) return -1;
  f.found.state = ZT_CKPT_DELETED;
  if (zt_db_ckpt_put(c->db, j->row.id, &f.found) != 0) return -1;
  if (j->rb_ckpt_step >= 0 && !strcmp(j->rb_ckpt_dir, dir)) j->rb_ckpt_step = -1;
  zt_coord_event(c, j->row.id, "checkpoint_retired", 0,
                 "step %lld will not be loaded again; falling back to an older epoch",
                 (long long)f.found.step);
  return 0;
}
