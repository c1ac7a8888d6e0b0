/*
 * ckpt.c: the checkpoint registry: which epochs exist, which are committed.
 *
 * Workers write a checkpoint epoch as one directory per step and
 * generation, `<checkpoint.dir>/job_<id>/step_<step>-g<gen>/`, each rank its
 * own files, written to temporary names, fsynced and renamed (worker side).
 * Then each rank calls ReportCheckpoint with its file list. An epoch is
 * committed, here and in SQLite, only when every rank of the generation has
 * reported it; a generation that ends before that leaves a pending epoch
 * that is never loaded and is deleted (when the next generation starts, or
 * when the job ends). A rank's report counts only once
 * its files and their copies are recorded, so a report refused half-way (a
 * busy database) counts in full when the rank retries. Copies (ReportReplica)
 * are taken only from workers of the generation that wrote the epoch or of
 * the current one, and only of the files such an epoch has.
 *
 * Retention (checkpoint.keep_last, checkpoint.keep_every) is applied after
 * each commit (reports.c calls zt_registry_gc when zt_registry_report says the
 * epoch committed): committed epochs beyond the newest keep_last
 * are deleted unless their step is a multiple of keep_every. Deleting is done here
 * because the checkpoint directory is storage shared by the job's workers
 * (a local directory for local runs); a reported directory outside the
 * job's checkpoint root is refused, so no report can make the coordinator
 * delete anything else.
 */
#define _XOPEN_SOURCE 700
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coord.h"
#include "ztrain.pb-c.h"

/* Deleting an epoch's files can take long (many files, a slow disk), so it
 * runs on libuv's thread pool, never on the loop. */
typedef struct {
  uv_work_t req;
  char dir[ZT_PATH_MAX], root[ZT_PATH_MAX];
} rm_work;

/* The directory is checked again with every symbolic link resolved: a
 * link on the shared storage (job_N pointing elsewhere) must not lead a
 * deletion out of the checkpoint root. */
static void rm_work_run(uv_work_t *req) {
  rm_work *w = req->data;
  if (access(w->dir, F_OK) != 0) return;
  if (!zt_path_real_under(w->root, w->dir)) {
    ZT_WARN("not deleting %s: with its links resolved it lies outside the checkpoint root %s",
            w->dir, w->root);
    return;
  }
  zt_remove_tree(w->dir);
}

static void rm_work_done(uv_work_t *w, int status) {
  (void)status;
  free(w->data);
}

static void rm_tree(zt_coord_t *c, const char *dir) {
  rm_work *w = zt_xcalloc(1, sizeof *w);
  snprintf(w->dir, sizeof w->dir, "%s", dir);
  snprintf(w->root, sizeof w->root, "%s", c->cfg.ckpt_root);
  w->req.data = w;
  if (uv_queue_work(c->loop, &w->req, rm_work_run, rm_work_done) != 0) {
    ZT_WARN("cannot queue the deletion of %s", dir);
    free(w);
  }
}

/* The directory every epoch of job j lives under ("" when its name would
 * not fit: it then matches no epoch). */
static void job_root(const zt_job_t *j, char *buf, size_t n) {
  if (zt_path_fmt(buf, n, "%s/job_%llu", j->p.ckpt_dir, (unsigned long long)j->row.id) != 0)
    ZT_WARN("job %llu: %s", (unsigned long long)j->row.id, zt_err_msg());
}

typedef struct {
  zt_db_ckpt_t k[64];
  int n;
} ckpt_batch;

typedef struct {
  zt_job_t *j;
  int n_committed;
  int64_t max_step; /* newest: only epochs at or before this step */
  int found;
  zt_db_ckpt_t best;
  ckpt_batch *drop; /* epochs to delete */
} gc_ctx;

/* Counts committed epochs and keeps the newest at or before max_step. */
static int count_committed(const zt_db_ckpt_t *k, void *user) {
  gc_ctx *g = user;
  if (k->state != ZT_CKPT_COMMITTED) return 0;
  g->n_committed++;
  if (k->step <= g->max_step && (!g->found || k->step >= g->best.step))
    g->best = *k, g->found = 1;
  return 0;
}

static int collect_for_gc(const zt_db_ckpt_t *k, void *user) {
  gc_ctx *g = user;
  ckpt_batch *b = g->drop;
  if (k->state == ZT_CKPT_DELETED || b->n == (int)ZT_ARRAY_LEN(b->k)) return 0;
  int drop = 0;
  if (k->state == ZT_CKPT_COMMITTED) {
    g->n_committed--; /* counts down: the first n - keep_last are older */
    int keep_every = g->j->p.keep_every > 0 && k->step % g->j->p.keep_every == 0;
    /* A spike's rollback may need it (zt_registry_gc): the newest epoch at or
     * before max_step and every later one. */
    int needed = g->j->p.rb_enabled && (!g->found || k->step >= g->best.step);
    drop = g->n_committed >= g->j->p.keep_last && !keep_every && !needed;
  } else {
    /* Pending epochs of earlier generations can never commit, nor can any
     * of a job that has ended. */
    drop = k->generation < g->j->row.generation || zt_db_job_ended(g->j->row.state);
  }
  if (drop) b->k[b->n++] = *k;
  return 0;
}

/* Applies retention and removes dead pending epochs of job j (those of
 * earlier generations, and every one once the job has ended). */
void zt_registry_gc(zt_coord_t *c, zt_job_t *j) {
  if (!j->p.ckpt_dir[0]) return;
  static ckpt_batch drop;
  gc_ctx g;
  memset(&g, 0, sizeof g);
  drop.n = 0;
  g.j = j, g.drop = &drop, g.max_step = INT64_MAX;
  /* With rollback on, a spike whose run of `patience` steps starts at s
   * rolls back to the newest epoch at or before s - 2 - margin_steps
   * (rollback.c, zt_rollback_spike); a run that ends after the job's step
   * starts at step - patience + 2 or later. The newest epoch at or before step -
   * patience - margin and every later one are kept whatever keep_last
   * says (about (margin + patience) / every_steps + 1 epochs more), or a
   * rollback would find none and start over from initialization. */
  if (j->p.rb_enabled) g.max_step = j->row.step - j->p.rb_patience - j->p.rb_margin;
  if (zt_db_ckpts_each(c->db, j->row.id, count_committed, &g) != 0 ||
      zt_db_ckpts_each(c->db, j->row.id, collect_for_gc, &g) != 0) {
    ZT_WARN("checkpoint gc: %s", zt_err_msg());
    return;
  }
  for (int i = 0; i < drop.n; i++) {
    zt_db_ckpt_t *k = &drop.k[i];
    int was = k->state;
    k->state = ZT_CKPT_DELETED;
    if (zt_db_ckpt_put(c->db, j->row.id, k) != 0) {
      ZT_ERROR("checkpoint gc: %s", zt_err_msg());
      continue;
    }
    rm_tree(c, k->dir);
    zt_copies_forget_epoch(c, j->row.id, k);
    zt_coord_event(c, j->row.id, "checkpoint_deleted", 0, "step %lld generation %llu (%s): %s",
                   (long long)k->step, (unsigned long long)k->generation,
                   was == ZT_CKPT_COMMITTED ? "retention" : "never committed", k->dir);
  }
}

/* Keeps the newest committed epochs at or before max_step (as many as a
 * batch holds). */
static int collect_committed(const zt_db_ckpt_t *k, void *user) {
  gc_ctx *g = user;
  ckpt_batch *b = g->drop;
  if (k->state != ZT_CKPT_COMMITTED || k->step > g->max_step) return 0;
  if (b->n < (int)ZT_ARRAY_LEN(b->k)) {
    b->k[b->n++] = *k;
    return 0;
  }
  int oldest = 0;
  for (int i = 1; i < b->n; i++)
    if (b->k[i].step < b->k[oldest].step) oldest = i;
  if (k->step > b->k[oldest].step) b->k[oldest] = *k;
  return 0;
}

static int by_step_desc(const void *a, const void *b) {
  int64_t x = ((const zt_db_ckpt_t *)a)->step, y = ((const zt_db_ckpt_t *)b)->step;
  return (x < y) - (x > y);
}

/* Whether every file of epoch k has a copy a live worker can serve. */
static int loadable(zt_coord_t *c, zt_job_t *j, const zt_db_ckpt_t *k) {
  zt_db_ckpt_file_t *rec;
  int n;
  char why[200] = "";
  if (zt_registry_record(c, k->dir, &rec, &n) != 0) return 1; /* no record: the loader judges */
  int ok = zt_copies_available(c, j->row.id, k, rec, n, why, sizeof why);
  free(rec);
  if (!ok)
    zt_coord_event(c, j->row.id, "checkpoint_unavailable", 0, "step %lld: %s", (long long)k->step,
                   why);
  return ok;
}

int zt_registry_newest(zt_coord_t *c, zt_job_t *j, int64_t max_step, int need_loadable,
                   zt_db_ckpt_t *out, int *found) {
  static ckpt_batch b;
  gc_ctx g;
  memset(&g, 0, sizeof g);
  b.n = 0;
  g.max_step = max_step, g.drop = &b;
  *found = 0;
  if (zt_db_ckpts_each(c->db, j->row.id, collect_committed, &g) != 0) return -1;
  qsort(b.k, (size_t)b.n, sizeof b.k[0], by_step_desc);
  for (int i = 0; i < b.n; i++)
    if (!need_loadable || loadable(c, j, &b.k[i])) {
      *out = b.k[i];
      *found = 1;
      return 0;
    }
  return 0;
}

/* A report names an epoch directory of the job, or nothing is done (the
 * coordinator deletes what it registers): dir (absolute: confined under
 * our checkpoint root) must be an epoch of
 * job j exactly as the ranks name them, <checkpoint.dir>/job_<id>/
 * step_<8 digits>-g<gen>; *e gets its step and generation. One spelling
 * per epoch: the registry finds records by their directory, so another
 * spelling of a committed epoch would pass for a new one. */
static int check_epoch(zt_coord_t *c, const zt_job_t *j, const char *dir, zt_epoch_t *e) {
  char root[ZT_PATH_MAX];
  job_root(j, root, sizeof root);
  size_t rl = strlen(root);
  const char *rel = zt_path_under(c->cfg.ckpt_root, dir);
  const char *rel_root = zt_path_under(c->cfg.ckpt_root, root);
  if (strncmp(dir, root, rl) != 0 || dir[rl] != '/' || strchr(dir + rl + 1, '/') || !rel ||
      strlen(dir) >= sizeof(((zt_db_ckpt_t *)0)->dir) || zt_epoch_parse(rel, e) != 0)
    return zt_errk(ZT_E_INVALID,
                   "checkpoint dir %.200s is not an epoch directory of job %llu "
                   "(%.200s/step_<8 digits>-g<generation>)",
                   rel ? rel : dir, (unsigned long long)j->row.id, rel_root ? rel_root : root);
  return 0;
}

/* "xxh64:" and 16 lower-case hex digits. */
static int checksum_valid(const char *s) {
  if (strncmp(s, "xxh64:", 6) != 0 || strlen(s) != 22) return 0;
  return strspn(s + 6, "0123456789abcdef") == 16;
}

/* A rank reports exactly its files: rank_<r>.bin and rank_<r>.json, and
 * rank 0 also manifest.json, each with a size and a checksum. */
static int check_files(int rank, const Ztrain__ReportCheckpointRequest *req) {
  char bin[32], js[32];
  snprintf(bin, sizeof bin, "rank_%d.bin", rank);
  snprintf(js, sizeof js, "rank_%d.json", rank);
  size_t want = rank == 0 ? 3 : 2;
  if (req->n_files != want)
    return zt_errk(ZT_E_INVALID, "rank %d reported %zu files, expected %zu", rank, req->n_files,
                   want);
  int seen = 0;
  for (size_t i = 0; i < req->n_files; i++) {
    const Ztrain__CheckpointFile *f = req->files[i];
    int which = !strcmp(f->name, bin) ? 1 : !strcmp(f->name, js) ? 2
                : rank == 0 && !strcmp(f->name, "manifest.json") ? 4 : 0;
    if (!which || (seen & which))
      return zt_errk(ZT_E_INVALID, "rank %d reported an unexpected file \"%.64s\"", rank,
                     f->name);
    if (!checksum_valid(f->checksum) || f->bytes == 0 || f->bytes > (1ull << 44))
      return zt_errk(ZT_E_INVALID, "%s: no valid size and xxh64 checksum", f->name);
    seen |= which;
  }
  return 0;
}

/* The tally of epoch (step, generation of now); NULL when none is kept. */
static zt_registry_tally_t *find_tally(zt_job_t *j, int64_t step) {
  for (int i = 0; i < ZT_REGISTRY_TALLIES; i++) {
    zt_registry_tally_t *t = j->tallies[i];
    if (t && t->step == step && t->gen == j->row.generation) return t;
  }
  return NULL;
}

/* A slot for a new tally: an unused one, else one of an older generation,
 * else a finished one, else the oldest epoch (which then cannot commit;
 * its row stays pending and retention removes it). */
static zt_registry_tally_t *free_slot(zt_job_t *j) {
  int best = 0;
  for (int i = 0; i < ZT_REGISTRY_TALLIES; i++) {
    zt_registry_tally_t *t = j->tallies[i], *b = j->tallies[best];
    if (!t) {
      j->tallies[i] = zt_xcalloc(1, sizeof *t);
      return j->tallies[i];
    }
    int rank_t = t->gen != j->row.generation ? 0 : t->done ? 1 : 2;
    int rank_b = b->gen != j->row.generation ? 0 : b->done ? 1 : 2;
    if (rank_t < rank_b || (rank_t == rank_b && t->step < b->step)) best = i;
  }
  return j->tallies[best];
}

/* The tally of epoch `step` of the current generation, started (and its
 * row stored as pending) when there is none. */
static int tally_for(zt_coord_t *c, zt_job_t *j, int64_t step, const char *dir,
                     zt_registry_tally_t **out) {
  zt_registry_tally_t *t = find_tally(j, step);
  if (!t) {
    t = free_slot(j);
    memset(t, 0, sizeof *t);
    t->step = step;
    t->gen = j->row.generation;
    snprintf(t->dir, sizeof t->dir, "%s", dir);
    zt_db_ckpt_t k = {step, j->row.generation, j->row.world, "", ZT_CKPT_PENDING, 0,
                      zt_wall_ms()};
    snprintf(k.dir, sizeof k.dir, "%s", dir);
    if (zt_db_ckpt_put(c->db, j->row.id, &k) != 0) {
      t->step = 0; /* nothing kept */
      return zt_err_wrapk(ZT_E_UNAVAILABLE, "cannot store checkpoint");
    }
  }
  j->ck = t;
  *out = t;
  return 0;
}

void zt_registry_forget(zt_job_t *j) {
  for (int i = 0; i < ZT_REGISTRY_TALLIES; i++) {
    free(j->tallies[i]);
    j->tallies[i] = NULL;
  }
  j->ck = NULL;
}

/* The copies every file needs: checkpoint.replicas, at most one per
 * machine of the generation. */
static int copies_needed(const zt_job_t *j) {
  return ZT_MAX(1, ZT_MIN(j->p.replicas, j->n_hosts));
}

static int popcount(const uint8_t *b, size_t n) {
  int k = 0;
  for (size_t i = 0; i < n; i++) k += __builtin_popcount(b[i]);
  return k;
}

/* Every rank reported, and every file has its copies. */
static int complete(const zt_job_t *j, const zt_registry_tally_t *t) {
  if (t->done || t->failed || t->count < j->row.world) return 0;
  for (int i = 0; i < t->nfiles; i++)
    if (t->files[i].written &&
        popcount(t->files[i].hosts, sizeof t->files[i].hosts) < copies_needed(j))
      return 0;
  return 1;
}

/* The tally's entry for a file name (a new one when there is none). */
static zt_registry_entry_t *entry(zt_registry_tally_t *t, const char *name) {
  for (int i = 0; i < t->nfiles; i++)
    if (!strcmp(t->files[i].f.name, name)) return &t->files[i];
  if (t->nfiles == (int)ZT_ARRAY_LEN(t->files)) return NULL;
  zt_registry_entry_t *e = &t->files[t->nfiles++];
  memset(e, 0, sizeof *e);
  snprintf(e->f.name, sizeof e->f.name, "%s", name);
  return e;
}

/* The machine index of worker m in the current generation; -1 when it is
 * not a member. */
static int host_index(const zt_job_t *j, const zt_member_t *m) {
  if (m->job_id != j->row.id || m->gen != j->row.generation || m->rank < 0 ||
      m->rank >= j->row.world)
    return -1;
  return j->host_of[m->rank];
}

/* Every rank reported and every file has its copies: the epoch is
 * committed, in SQLite with its record and its event. */
static int commit(zt_coord_t *c, zt_job_t *j, zt_registry_tally_t *t) {
  zt_db_ckpt_t k = {t->step, t->gen, j->row.world, "", ZT_CKPT_COMMITTED, t->bytes, zt_wall_ms()};
  snprintf(k.dir, sizeof k.dir, "%s", t->dir);
  zt_db_ckpt_file_t *rec = zt_xcalloc((size_t)t->nfiles + 1, sizeof *rec);
  int nrec = 0;
  for (int i = 0; i < t->nfiles; i++)
    if (t->files[i].written) rec[nrec++] = t->files[i].f;
  int rc = zt_db_begin(c->db) != 0 || zt_db_ckpt_put(c->db, j->row.id, &k) != 0 ||
           zt_db_ckpt_files_put(c->db, j->row.id, t->step, t->gen, rec, nrec) != 0;
  free(rec);
  if (rc ||
      zt_coord_event_tx(c, j->row.id, "checkpoint_committed", 0, k.dir) != 0 ||
      zt_db_commit(c->db) != 0) {
    zt_err_wrapk(ZT_E_UNAVAILABLE, "cannot commit checkpoint");
    zt_db_rollback(c->db);
    return -1;
  }
  ZT_INFO("job %llu: checkpoint step %lld committed (%d ranks, %llu bytes)",
          (unsigned long long)j->row.id, (long long)t->step, j->row.world,
          (unsigned long long)t->bytes);
  t->done = 1; /* later duplicates do not re-commit */
  return 0;
}

/* An epoch with a failed write, once every rank has reported: its row and
 * whatever files the other ranks wrote go (a full disk gets the space).
 * Done only once the row says so: a refused write is tried again at the
 * epoch's next report (the reporter retries on the error), and at every
 * flush (zt_registry_retry_drops: the last report may have been answered OK,
 * when it was the epoch's first failure). */
static int drop_failed(zt_coord_t *c, zt_job_t *j, zt_registry_tally_t *t) {
  if (t->done || t->count + t->failed < j->row.world) return 0;
  zt_db_ckpt_t k = {t->step, t->gen, j->row.world, "", ZT_CKPT_DELETED, 0, zt_wall_ms()};
  snprintf(k.dir, sizeof k.dir, "%s", t->dir);
  if (zt_db_ckpt_put(c->db, j->row.id, &k) != 0) {
    zt_err_wrapk(ZT_E_UNAVAILABLE, "checkpoint step %lld: cannot delete the failed epoch",
                 (long long)t->step);
    ZT_ERROR("%s", zt_err_msg());
    return -1;
  }
  t->done = 1;
  rm_tree(c, t->dir);
  zt_copies_forget_epoch(c, j->row.id, &k);
  return 0;
}

void zt_registry_retry_drops(zt_coord_t *c, zt_job_t *j) {
  for (int i = 0; i < ZT_REGISTRY_TALLIES; i++) {
    zt_registry_tally_t *t = j->tallies[i];
    if (t && t->failed && !t->done && t->gen == j->row.generation) (void)drop_failed(c, j, t);
  }
}

/* A rank's write failed: the epoch cannot commit. */
static int report_failed(zt_coord_t *c, zt_job_t *j, zt_registry_tally_t *t, zt_member_t *m,
                         const Ztrain__ReportCheckpointRequest *req, zt_registry_outcome_t *out) {
  if (t->seen[m->rank] || t->done) return drop_failed(c, j, t); /* a retry: it may be due */
  t->seen[m->rank] = 1;
  if (t->failed++ == 0) {
    char err[256];
    snprintf(t->error, sizeof t->error, "%s", zt_printable(req->error, err, sizeof err));
    *out = ZT_REGISTRY_REPORT_FAILED;
    zt_coord_event(c, j->row.id, "checkpoint_failed", 0, "step %lld: rank %d (%s): %s",
                   (long long)t->step, m->rank, m->row.name, t->error);
  }
  /* A refused deletion makes the rank retry, unless this report is the
   * epoch's first failure: the scheduler must learn of that (*out) now. */
  if (drop_failed(c, j, t) != 0 && *out != ZT_REGISTRY_REPORT_FAILED) return -1;
  return 0;
}

/* Counts rank m's files toward the epoch. Everything that can fail comes
 * first (the files' entries, the copies in SQLite), so that a refused
 * report changes nothing here: the rank's retry is counted in full, and
 * an epoch never commits without a file its rank reported. */
static int count_files(zt_coord_t *c, zt_job_t *j, zt_registry_tally_t *t, zt_member_t *m,
                       const Ztrain__ReportCheckpointRequest *req) {
  zt_registry_entry_t *e[3]; /* check_files: at most 3 */
  zt_db_ckpt_t k = {t->step, t->gen, 0, "", 0, 0, 0};
  if (req->n_files > ZT_ARRAY_LEN(e))
    return zt_errk(ZT_E_INVALID, "rank %d reported %zu files", m->rank, req->n_files);
  for (size_t i = 0; i < req->n_files; i++)
    if (!(e[i] = entry(t, req->files[i]->name)))
      return zt_errk(ZT_E_TOO_LARGE, "step %lld: more than %zu files in one epoch",
                     (long long)t->step, ZT_ARRAY_LEN(t->files));
  for (size_t i = 0; i < req->n_files; i++)
    if (zt_copies_add(c, j->row.id, &k, req->files[i]->name, m->row.id) != 0) return -1;
  int h = j->host_of[m->rank];
  for (size_t i = 0; i < req->n_files; i++) {
    const Ztrain__CheckpointFile *f = req->files[i];
    if (strcmp(e[i]->f.checksum, f->checksum) != 0 || e[i]->f.bytes != f->bytes)
      memset(e[i]->hosts, 0, sizeof e[i]->hosts); /* copies of something else: not copies */
    snprintf(e[i]->f.checksum, sizeof e[i]->f.checksum, "%s", f->checksum);
    e[i]->f.bytes = f->bytes;
    e[i]->written = 1;
    e[i]->hosts[h / 8] |= (uint8_t)(1u << (h % 8));
    t->bytes += f->bytes;
  }
  t->seen[m->rank] = 1;
  t->count++;
  return 0;
}

/* After a report: a failed epoch is dropped once everyone reported; a
 * complete one commits. */
static int settle(zt_coord_t *c, zt_job_t *j, zt_registry_tally_t *t, zt_registry_outcome_t *out) {
  if (t->failed) return drop_failed(c, j, t);
  if (!complete(j, t)) return 0;
  if (commit(c, j, t) != 0) return -1;
  *out = ZT_REGISTRY_REPORT_COMMITTED;
  return 0;
}

int zt_registry_report(zt_coord_t *c, zt_job_t *j, zt_member_t *m,
                   const Ztrain__ReportCheckpointRequest *req, zt_registry_outcome_t *out) {
  *out = ZT_REGISTRY_REPORT_COUNTED;
  if (!j->p.ckpt_dir[0])
    return zt_errk(ZT_E_STATE, "job %llu has no checkpoint.dir", (unsigned long long)j->row.id);
  /* The worker names the epoch relative to its checkpoint root; the
   * registry keeps it under ours. */
  char dir[sizeof ((zt_registry_tally_t *)0)->dir];
  zt_epoch_t e;
  if (req->dir[0] == '/' ||
      zt_path_confine(c->cfg.ckpt_root, req->dir, "checkpoint dir", dir, sizeof dir) != 0)
    return zt_errk(ZT_E_INVALID, "checkpoint dir %.200s is not a relative path under job %llu's "
                   "checkpoint directory",
                   req->dir, (unsigned long long)j->row.id);
  if (check_epoch(c, j, dir, &e) != 0) return -1;
  if (e.step != req->step || e.gen != req->generation)
    return zt_errk(ZT_E_INVALID,
                   "checkpoint dir %.200s is the epoch of step %lld, generation %llu; the report "
                   "is for step %lld, generation %llu",
                   req->dir, (long long)e.step, (unsigned long long)e.gen, (long long)req->step,
                   (unsigned long long)req->generation);
  if (j->poisoned_from && req->step >= j->poisoned_from)
    return zt_errk(ZT_E_STATE,
                   "checkpoint at step %lld refused: the loss was not finite at step %lld",
                   (long long)req->step, (long long)j->poisoned_from);
  if (req->step < 1 || req->step > j->row.total_steps)
    return zt_errk(ZT_E_INVALID, "checkpoint step %lld out of range", (long long)req->step);
  if (!req->error[0] && check_files(m->rank, req) != 0) return -1;
  /* A repeated report of an epoch committed before (its tally gone) is
   * already counted: it must not turn the record back into a pending one. */
  zt_db_ckpt_t k0;
  uint64_t kjob;
  int found = 0;
  if (!find_tally(j, req->step)) {
    if (zt_db_ckpt_find_dir(c->db, dir, &kjob, &k0, &found) != 0) return -1;
    if (found && kjob == j->row.id) return 0;
  }
  zt_registry_tally_t *t;
  if (tally_for(c, j, req->step, dir, &t) != 0) return -1;
  if (strcmp(t->dir, dir) != 0)
    return zt_errk(ZT_E_INVALID, "rank %d reported dir %.200s, expected %.200s", m->rank,
                   req->dir, zt_path_under(c->cfg.ckpt_root, t->dir));
  if (req->error[0]) return report_failed(c, j, t, m, req, out);
  if (!t->seen[m->rank] && !t->done && count_files(c, j, t, m, req) != 0) return -1;
  return settle(c, j, t, out);
}

/* A copy of a file of a committed epoch (fetched to load it): it must be
 * the file the record holds. */
static int copy_of_committed(zt_coord_t *c, zt_job_t *j, zt_member_t *m, const zt_db_ckpt_t *k,
                             const zt_db_ckpt_file_t *f) {
  zt_db_ckpt_file_t *rec;
  int n;
  if (zt_registry_record(c, k->dir, &rec, &n) != 0) return -1;
  int ok = 0;
  for (int i = 0; i < n; i++)
    ok |= !strcmp(rec[i].name, f->name) && !strcmp(rec[i].checksum, f->checksum) &&
          rec[i].bytes == f->bytes;
  free(rec);
  if (!ok)
    return zt_errk(ZT_E_INVALID, "%s/%s: not a file of the committed epoch (size or checksum "
                   "differs)", k->dir, f->name);
  return zt_copies_add(c, j->row.id, k, f->name, m->row.id);
}

/* Who may hold a copy of a file of an epoch generation `gen` wrote: a
 * worker of that generation (its ranks push to each other), or a rank of
 * the current one (it fetches the epoch it starts from). *world receives
 * the size of generation gen (0 when there is no such generation). */
static int check_holder(zt_coord_t *c, zt_job_t *j, zt_member_t *m, uint64_t gen, int *world) {
  uint64_t ids[ZT_MAX_WORLD];
  int n = 0, member = host_index(j, m) >= 0;
  if (zt_db_generation_members(c->db, j->row.id, gen, ids, ZT_MAX_WORLD, &n) != 0) return -1;
  for (int i = 0; i < n && !member; i++) member = ids[i] == m->row.id;
  *world = n;
  if (!member)
    return zt_errk(ZT_E_STATE,
                   "worker %s is not a member of generation %llu of job %llu (which wrote the "
                   "epoch) nor of its current generation %llu: it holds no copies of the epoch",
                   m->row.name, (unsigned long long)gen, (unsigned long long)j->row.id,
                   (unsigned long long)j->row.generation);
  return 0;
}

/* A file of an epoch of `world` ranks: rank_<r>.bin or rank_<r>.json for
 * a rank r of it, or manifest.json. */
static int epoch_file(const char *name, int world) {
  int r;
  return world > 0 && zt_epoch_file(name, &r) && r < world;
}

int zt_registry_report_copy(zt_coord_t *c, zt_job_t *j, zt_member_t *m, const char *dir,
                        const zt_db_ckpt_file_t *f, zt_registry_outcome_t *out) {
  *out = ZT_REGISTRY_REPORT_COUNTED;
  zt_epoch_t ep;
  int world;
  if (!j->p.ckpt_dir[0])
    return zt_errk(ZT_E_STATE, "job %llu has no checkpoint.dir", (unsigned long long)j->row.id);
  if (check_epoch(c, j, dir, &ep) != 0) return -1;
  if (!checksum_valid(f->checksum))
    return zt_errk(ZT_E_INVALID, "%.200s/%.64s: the checksum is not xxh64:<16 hex digits>",
                   zt_path_under(c->cfg.ckpt_root, dir), f->name);
  int64_t step = ep.step;
  uint64_t gen = ep.gen;
  if (check_holder(c, j, m, gen, &world) != 0) return -1;
  zt_db_ckpt_t k;
  uint64_t kjob;
  int found = 0;
  if (zt_db_ckpt_find_dir(c->db, dir, &kjob, &k, &found) != 0) return -1;
  if (found && kjob == j->row.id) return copy_of_committed(c, j, m, &k, f);
  /* Only the files such an epoch has: no report can make up names (and
   * use up the tally's room for the ranks' own files). */
  const char *rel = zt_path_under(c->cfg.ckpt_root, dir);
  if (!epoch_file(f->name, world))
    return zt_errk(ZT_E_INVALID, "\"%.64s\" is not a file of the %d-rank epoch %.200s", f->name,
                   world, rel ? rel : dir);
  int late = zt_copies_of_deleted(c, j->row.id, dir, m);
  if (late != 0) return late < 0 ? -1 : 0;
  /* A pushed copy may come before its rank's own report: it starts the
   * epoch's tally. */
  zt_registry_tally_t *t = NULL;
  int active = j->row.state == ZT_JOB_RUNNING || j->row.state == ZT_JOB_RECONFIGURING;
  if (active && gen == j->row.generation && step > 0 && step <= j->row.total_steps &&
      tally_for(c, j, step, dir, &t) != 0)
    return -1;
  zt_registry_entry_t *e = NULL;
  if (t && !t->done && !strcmp(t->dir, dir)) {
    if (!(e = entry(t, f->name)))
      return zt_errk(ZT_E_TOO_LARGE, "step %lld: more than %zu files in one epoch",
                     (long long)t->step, ZT_ARRAY_LEN(t->files));
    if (e->written && (strcmp(e->f.checksum, f->checksum) || e->f.bytes != f->bytes))
      return zt_errk(ZT_E_INVALID, "%s: the copy differs from what its rank wrote", f->name);
  }
  zt_db_ckpt_t here = {step, gen, 0, "", 0, 0, 0};
  if (zt_copies_add(c, j->row.id, &here, f->name, m->row.id) != 0) return -1;
  if (!e) return 0; /* an epoch that can no longer commit: the copy is deleted with it */
  if (!e->written) e->f = *f;
  int h = host_index(j, m);
  if (h >= 0) e->hosts[h / 8] |= (uint8_t)(1u << (h % 8));
  return settle(c, j, t, out);
}

typedef struct {
  int64_t after;
  ckpt_batch *b;
} after_ctx;

static int collect_after(const zt_db_ckpt_t *k, void *user) {
  after_ctx *a = user;
  if (k->state != ZT_CKPT_DELETED && k->step > a->after && a->b->n < (int)ZT_ARRAY_LEN(a->b->k))
    a->b->k[a->b->n++] = *k;
  return 0;
}

/* Deletes every epoch after `step`: after a rollback they hold the state
 * being abandoned and must never be loaded. */
void zt_registry_drop_after(zt_coord_t *c, zt_job_t *j, int64_t step) {
  static ckpt_batch b;
  b.n = 0;
  after_ctx a = {step, &b};
  if (zt_db_ckpts_each(c->db, j->row.id, collect_after, &a) != 0) return;
  for (int i = 0; i < b.n; i++) {
    b.k[i].state = ZT_CKPT_DELETED;
    if (zt_db_ckpt_put(c->db, j->row.id, &b.k[i]) != 0) {
      ZT_ERROR("checkpoint drop: %s", zt_err_msg());
      continue;
    }
    rm_tree(c, b.k[i].dir);
    zt_copies_forget_epoch(c, j->row.id, &b.k[i]);
    zt_coord_event(c, j->row.id, "checkpoint_deleted", 0, "step %lld: after the rollback target: %s",
                   (long long)b.k[i].step, b.k[i].dir);
  }
  zt_db_ckpt_t k;
  int found = 0;
  if (zt_registry_newest(c, j, INT64_MAX, 0, &k, &found) == 0)
    j->committed_step = found ? k.step : 0;
}

typedef struct {
  const char *dir;
  zt_db_ckpt_t found;
  int n;
} find_ctx;

static int find_dir(const zt_db_ckpt_t *k, void *user) {
  find_ctx *f = user;
  if (!strcmp(k->dir, f->dir) && k->state == ZT_CKPT_COMMITTED) f->found = *k, f->n++;
  return 0;
}

/* A committed epoch that failed to load (checksum, truncation): never use it
 * again. The files stay for inspection; the next generation starts from the
 * previous committed epoch. Returns -1 when `dir` is not one of the job's
 * own epochs (e.g. its checkpoint.load): there is nothing to fall back to. */
int zt_registry_mark_bad(zt_coord_t *c, zt_job_t *j, const char *dir, const char *why) {
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

int zt_registry_record(zt_coord_t *c, const char *dir, zt_db_ckpt_file_t **files, int *n) {
  uint64_t job;
  zt_db_ckpt_t k;
  int found = 0, total = 0;
  *files = NULL;
  *n = 0;
  if (zt_db_ckpt_find_dir(c->db, dir, &job, &k, &found) != 0) return -1;
  if (!found) return zt_errk(ZT_E_NOT_FOUND, "%s is not a committed checkpoint epoch", dir);
  zt_db_ckpt_file_t *f = zt_xcalloc(3 * ZT_MAX_WORLD, sizeof *f);
  if (zt_db_ckpt_files_get(c->db, job, k.step, k.generation, f, 3 * ZT_MAX_WORLD, &total) != 0 ||
      total > 3 * ZT_MAX_WORLD) {
    free(f);
    return total > 3 * ZT_MAX_WORLD ? zt_err("%s: too many files recorded", dir) : -1;
  }
  *files = f;
  *n = total;
  return 0;
}
