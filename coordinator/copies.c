/*
 * copies.c: where the files of checkpoint epochs have copies.
 *
 * Without shared storage every checkpoint file lives on the disks of the
 * workers that wrote it or stored a copy of it (their replica stores,
 * worker/store.c). This file keeps that knowledge: every copy a worker
 * reports (its own files in ReportCheckpoint, pushed or fetched copies in
 * ReportReplica, what it holds when it registers) is a row of
 * checkpoint_copies in SQLite.
 *
 * Copies count by machine (the workers' --host): the workers of one
 * machine share its checkpoint root, so a file is available when any live
 * worker runs on a machine that holds it, and that worker's store can hand
 * it out. An epoch is loadable when every file of its record is available;
 * the scheduler (sched.c) starts a generation from the newest loadable
 * epoch, and tells each rank which stores hold each file, with a ticket
 * (common/ticket.c) for each, the holders it may not reach now (kept out,
 * silent, or named unreachable by it) last and marked doubtful.
 *
 * Deleting an epoch (retention, a rollback, a failed write, an epoch that
 * never committed) deletes its copies: every worker that held one is asked
 * to delete the directory in its heartbeat replies until it reports it
 * deleted (epoch_deletions). A worker lists what it holds when it
 * registers, with its first heartbeat of each new job or generation, and
 * whenever an epoch directory of another job or generation appears on its
 * disk after its last list (a copy that arrived late, a write that ended
 * after the generation did): copies of epochs that are no longer wanted,
 * and epochs of our jobs that no report named and that can no longer
 * commit, are to be deleted, and so is such an epoch directory that holds
 * no finished file (listed as the directory itself); copies of committed
 * epochs are counted again.
 *
 * A job whose checkpoint root is shared storage (checkpoint.shared) keeps
 * no copies: every worker sees every file, so an epoch is loadable once it
 * commits, and a rank reads what it loads where it was written.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "ztrain.pb-c.h"

/* A worker that can serve files: with a replica store, and alive or only
 * suspect (a silence shorter than the timeout must not make an epoch look
 * lost: that is decided when the worker is declared lost). */
static int serves(const zt_member_t *m) {
  return m && (m->row.state == ZT_WORKER_ALIVE || m->row.state == ZT_WORKER_SUSPECT) &&
         m->row.store_addr[0];
}

/* ---- recording ------------------------------------------------------------ */

/* Queues the deletion of epoch directory rel on worker `worker_id`; its
 * next heartbeat looks for deletions (zt_copies_deletions). */
static int queue_deletion(zt_coord_t *c, uint64_t worker_id, const char *rel) {
  zt_member_t *m = zt_members_get(c, worker_id);
  if (m) m->deletions_pending = 1;
  return zt_db_deletion_add(c->db, worker_id, rel);
}

/* The job `id` (NULL: no such job). The job list is read here rather than
 * through jobtable.c, which calls this file by way of ckpt.c (no call
 * cycle between the coordinator's files: tools/check-layers). */
static const zt_job_t *find_job(const zt_coord_t *c, uint64_t id) {
  for (const zt_job_t *j = c->jobs; j; j = j->next)
    if (j->row.id == id) return j;
  return NULL;
}

int zt_copies_add(zt_coord_t *c, uint64_t job_id, const zt_db_ckpt_t *k, const char *name,
                  uint64_t worker_id) {
  /* On shared storage (checkpoint.shared) every worker sees every file:
   * an epoch without copies on record is loadable wherever it was written
   * (zt_copies_available), whichever machines are gone. */
  const zt_job_t *j = find_job(c, job_id);
  if (j && j->p.ckpt_shared) return 0;
  if (zt_db_copy_add(c->db, job_id, k->step, k->generation, name, worker_id) != 0)
    return zt_err_wrapk(ZT_E_UNAVAILABLE, "cannot record the copy");
  return 0;
}

typedef struct {
  uint64_t ids[ZT_MAX_WORLD * 4];
  int n;
} holders_t;

static int add_holder(const char *name, uint64_t worker_id, void *user) {
  (void)name;
  holders_t *h = user;
  for (int i = 0; i < h->n; i++)
    if (h->ids[i] == worker_id) return 0;
  if (h->n < (int)ZT_ARRAY_LEN(h->ids)) h->ids[h->n++] = worker_id;
  return 0;
}

void zt_copies_forget_epoch(zt_coord_t *c, uint64_t job_id, const zt_db_ckpt_t *k) {
  static holders_t h;
  h.n = 0;
  const char *rel = zt_path_under(c->cfg.ckpt_root, k->dir);
  if (zt_db_copies_each(c->db, job_id, k->step, k->generation, add_holder, &h) != 0) {
    ZT_WARN("copies of %s: %s", k->dir, zt_err_msg());
    return;
  }
  /* The members of its generation too: a member stopped while it wrote
   * its files, or received a copy, may hold a part of the epoch that was
   * never recorded (temporary files, which its holdings never list). */
  uint64_t members[ZT_MAX_WORLD];
  int nm = 0;
  if (zt_db_generation_members(c->db, job_id, k->generation, members, ZT_MAX_WORLD, &nm) != 0)
    ZT_WARN("members of generation %llu: %s", (unsigned long long)k->generation, zt_err_msg());
  for (int i = 0; i < nm; i++) add_holder(NULL, members[i], &h);
  for (int i = 0; i < h.n && rel; i++)
    if (queue_deletion(c, h.ids[i], rel) != 0)
      ZT_WARN("deletion of %s on worker %llu: %s", rel, (unsigned long long)h.ids[i],
              zt_err_msg());
  if (zt_db_copies_drop(c->db, job_id, k->step, k->generation) != 0)
    ZT_WARN("copies of %s: %s", k->dir, zt_err_msg());
}

/* ---- availability and holders ---------------------------------------------- */

/* The copies of one epoch, by file: the workers that reported one. */
typedef struct {
  const zt_db_ckpt_file_t *files;
  int n;
  uint64_t (*who)[8]; /* per file, up to 8 holders */
  int *nwho;
  int rows;
} epoch_copies;

static int add_copy(const char *name, uint64_t worker_id, void *user) {
  epoch_copies *e = user;
  e->rows++;
  for (int i = 0; i < e->n; i++)
    if (!strcmp(e->files[i].name, name) && e->nwho[i] < 8) e->who[i][e->nwho[i]++] = worker_id;
  return 0;
}

static int load_copies(zt_coord_t *c, uint64_t job_id, const zt_db_ckpt_t *k,
                       const zt_db_ckpt_file_t *files, int n, epoch_copies *e) {
  e->files = files, e->n = n, e->rows = 0;
  e->who = zt_xcalloc((size_t)n + 1, sizeof *e->who);
  e->nwho = zt_xcalloc((size_t)n + 1, sizeof *e->nwho);
  return zt_db_copies_each(c->db, job_id, k->step, k->generation, add_copy, e);
}

static void free_copies(epoch_copies *e) {
  free(e->who);
  free(e->nwho);
}

/* A live worker with a store on the machine of worker `holder`; the holder
 * itself first. NULL when the machine has none. */
static zt_member_t *server_on_host_of(zt_coord_t *c, uint64_t holder) {
  zt_member_t *h = zt_members_get(c, holder);
  if (!h) return NULL;
  if (serves(h)) return h;
  for (size_t i = 0; i < c->by_id_cap; i++) {
    zt_member_t *m = c->by_id[i];
    if (serves(m) && !strcmp(m->row.host, h->row.host)) return m;
  }
  return NULL;
}

int zt_copies_available(zt_coord_t *c, uint64_t job_id, const zt_db_ckpt_t *k,
                        const zt_db_ckpt_file_t *files, int n, char *why, size_t whylen) {
  epoch_copies e;
  int ok = load_copies(c, job_id, k, files, n, &e) == 0;
  /* An epoch committed before copies were recorded: its files are where
   * they were written (shared storage). */
  for (int i = 0; ok && e.rows && i < n; i++) {
    int any = 0;
    for (int w = 0; w < e.nwho[i] && !any; w++) any = server_on_host_of(c, e.who[i][w]) != NULL;
    if (!any) {
      snprintf(why, whylen, "%s has no copy on a machine with a live worker", files[i].name);
      ok = 0;
    }
  }
  free_copies(&e);
  return ok;
}

/* A holder that may well not serve the requester now: kept out of
 * generations (it may be cut off), silent for a while (suspect), or named
 * unreachable in the requester's last probe. Listed after the others and
 * marked, so that the worker tries it last with a short connection
 * deadline: a holder whose answers are lost (a one-way cut) would
 * otherwise hold the fetch, and with it the generation's set-up, for the
 * whole of a connection's deadline. */
static int doubtful(const zt_member_t *requester, const zt_member_t *s) {
  return s->quarantine_ms || s->row.state != ZT_WORKER_ALIVE ||
         (requester && zt_members_unreached(requester, s->row.id));
}

/* Fills fc (one per file, holders malloc'd into pool) with the stores that
 * can serve each file of epoch k to worker `requester`, and their tickets:
 * the sound holders first, the doubtful ones (doubtful()) last. */
int zt_copies_holders(zt_coord_t *c, zt_job_t *j, uint64_t epoch_job, const zt_db_ckpt_t *k,
                      const zt_db_ckpt_file_t *files, int n, uint64_t requester,
                      zt_copies_pool_t *pool) {
  epoch_copies e;
  if (load_copies(c, epoch_job, k, files, n, &e) != 0) {
    free_copies(&e);
    return -1;
  }
  const char *rel = zt_path_under(c->cfg.ckpt_root, k->dir);
  pool->fc = zt_xcalloc((size_t)n + 1, sizeof *pool->fc);
  pool->fcp = zt_xcalloc((size_t)n + 1, sizeof *pool->fcp);
  pool->t = zt_xcalloc((size_t)n * 8 + 1, sizeof *pool->t);
  pool->tp = zt_xcalloc((size_t)n * 8 + 1, sizeof *pool->tp);
  pool->tickets = zt_xcalloc((size_t)n * 8 + 1, ZT_TICKET_MAX);
  zt_member_t *req = zt_members_get(c, requester);
  int nt = 0;
  for (int i = 0; i < n; i++) {
    ztrain__file_copies__init(&pool->fc[i]);
    pool->fc[i].name = (char *)files[i].name;
    pool->fc[i].holders = &pool->tp[nt];
    /* Two passes over the holders: the sound ones, then the doubtful. */
    for (int w = 0; w < 2 * e.nwho[i]; w++) {
      zt_member_t *s = server_on_host_of(c, e.who[i][w % e.nwho[i]]);
      if (!s || doubtful(req, s) != (w >= e.nwho[i])) continue;
      zt_ticket_t t = {.op = "get", .job = j->row.id, .gen = j->row.generation,
                       .requester = requester, .expiry_ms = zt_wall_ms() + ZT_TICKET_TTL_MS};
      snprintf(t.scope, sizeof t.scope, "%s", rel ? rel : "");
      char *text = pool->tickets + (size_t)nt * ZT_TICKET_MAX;
      if (zt_ticket_make(s->row.session, &t, text, ZT_TICKET_MAX) != 0) continue;
      Ztrain__ReplicaTarget *rt = &pool->t[nt];
      ztrain__replica_target__init(rt);
      rt->worker_id = s->row.id;
      rt->addr = s->row.store_addr;
      rt->host = s->row.host;
      rt->ticket = text;
      rt->doubtful = w >= e.nwho[i];
      pool->tp[nt++] = rt;
      pool->fc[i].n_holders++;
    }
    pool->fcp[i] = &pool->fc[i];
  }
  pool->n = n;
  free_copies(&e);
  return 0;
}

void zt_copies_pool_free(zt_copies_pool_t *pool) {
  free(pool->fc);
  free(pool->fcp);
  free(pool->t);
  free(pool->tp);
  free(pool->tickets);
  memset(pool, 0, sizeof *pool);
}

/* ---- deletions ---------------------------------------------------------------- */

int zt_copies_deletions(zt_coord_t *c, zt_member_t *m, char (*dirs)[ZT_DB_DIR_MAX], int max) {
  int n = 0;
  /* Nothing queued for it since its list was last empty: no query (a
   * heartbeat of a large fleet is otherwise a database read each). */
  if (!m->deletions_pending) return 0;
  if (zt_db_deletions_of(c->db, m->row.id, dirs, max, &n) != 0) {
    ZT_WARN("epochs to delete on %s: %s", m->row.name, zt_err_msg());
    return 0;
  }
  if (n == 0) m->deletions_pending = 0;
  return n;
}

void zt_copies_deleted(zt_coord_t *c, zt_member_t *m, char *const *dirs, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (zt_db_deletion_done(c->db, m->row.id, dirs[i]) != 0)
      ZT_WARN("worker %s deleted %.200s: %s", m->row.name, dirs[i], zt_err_msg());
}

/* ---- what a registering worker holds ---------------------------------------- */

/* "<dir>/job_<id>/step_<s>-g<g>/<file>" split; 0 when it has exactly the
 * canonical form (zt_epoch_parse, zt_epoch_file), -1 with a message naming
 * the fault otherwise. "<dir>/job_<id>/step_<s>-g<g>/" is the directory
 * itself, which holds no finished file: *file is then "". */
static int parse_held(const char *held, char *dir, size_t n, zt_epoch_t *e, const char **file) {
  const char *slash = strrchr(held, '/');
  int rank;
  if (!slash || (size_t)(slash - held) >= n)
    return zt_errk(ZT_E_INVALID, "\"%.200s\" is not a file of an epoch directory", held);
  snprintf(dir, n, "%.*s", (int)(slash - held), held);
  *file = slash + 1;
  if (zt_epoch_parse(dir, e) != 0) return -1;
  if (**file && !zt_epoch_file(*file, &rank))
    return zt_errk(ZT_E_INVALID, "\"%.200s\" is not a checkpoint file", held);
  return 0;
}

typedef struct {
  const char *dir;
  zt_db_ckpt_t k;
  int found;
} known_ctx;

static int find_epoch(const zt_db_ckpt_t *k, void *user) {
  known_ctx *x = user;
  if (!strcmp(k->dir, x->dir)) x->k = *k, x->found = 1;
  return 0;
}

int zt_copies_of_deleted(zt_coord_t *c, uint64_t job_id, const char *dir, zt_member_t *m) {
  known_ctx x = {dir, {0}, 0};
  const char *rel = zt_path_under(c->cfg.ckpt_root, dir);
  if (zt_db_ckpts_each(c->db, job_id, find_epoch, &x) != 0)
    return zt_err_wrapk(ZT_E_UNAVAILABLE, "cannot read the job's epochs");
  if (!x.found || x.k.state != ZT_CKPT_DELETED || !rel) return 0;
  if (queue_deletion(c, m->row.id, rel) != 0)
    return zt_err_wrapk(ZT_E_UNAVAILABLE, "cannot queue the deletion of the late copy");
  ZT_INFO("job %llu: a copy on %s of the deleted epoch %s: queued for deletion",
          (unsigned long long)job_id, m->row.name, rel);
  return 1;
}

static uint64_t job_generation(const zt_coord_t *c, uint64_t id) {
  const zt_job_t *j = find_job(c, id);
  return j ? j->row.generation : 0;
}

/* An epoch directory no report ever named (abs, resolved like the job's
 * checkpoint.dir): its ranks wrote it while their reports could not reach
 * this coordinator (a cut, a restart), or a store took a copy it could not
 * record. It is this coordinator's to delete when it lies in the
 * checkpoint directory of one of its jobs and can no longer commit: its
 * generation is over, or the job has ended. */
static int unregistered_is_stale(const zt_coord_t *c, const zt_epoch_t *e, const char *abs) {
  const zt_job_t *j = find_job(c, e->job);
  if (!j || j->spec_error[0] || !j->p.ckpt_dir[0]) return 0;
  size_t n = strlen(j->p.ckpt_dir);
  while (n > 1 && j->p.ckpt_dir[n - 1] == '/') n--;
  if (strncmp(abs, j->p.ckpt_dir, n) != 0 || abs[n] != '/' || strchr(abs + n + 1, '/') !=
      strrchr(abs, '/'))
    return 0;
  return zt_db_job_ended(j->row.state) || e->gen < j->row.generation;
}

void zt_copies_reconcile(zt_coord_t *c, zt_member_t *m, char *const *held, size_t n) {
  char last_deleted[ZT_DB_DIR_MAX] = "";
  int kept = 0, deleted = 0, malformed = 0;
  for (size_t i = 0; i < n && i < 4096; i++) {
    char rel[ZT_DB_DIR_MAX], abs[ZT_DB_DIR_MAX + 600];
    zt_epoch_t e;
    const char *file = NULL;
    if (parse_held(held[i], rel, sizeof rel, &e, &file) != 0) {
      /* Not a name this coordinator could ever have asked for: ignored,
       * and the first one reported. */
      if (malformed++ == 0)
        ZT_WARN("worker %s reports holding a file of no epoch, ignored: %s", m->row.name,
                zt_err_msg());
      continue;
    }
    if (zt_path_join(abs, sizeof abs, c->cfg.ckpt_root, rel) != 0) continue;
    known_ctx x = {abs, {0}, 0};
    if (zt_db_ckpts_each(c->db, e.job, find_epoch, &x) != 0) continue;
    if (!x.found && !unregistered_is_stale(c, &e, abs))
      continue; /* not ours to judge, or it may still be reported */
    if (x.found && x.k.state == ZT_CKPT_COMMITTED) {
      /* A directory with no finished file of a committed epoch: a copy
       * being fetched into it now, or one that failed; not a copy. */
      if (*file) kept += zt_copies_add(c, e.job, &x.k, file, m->row.id) == 0;
      continue;
    }
    /* A pending epoch of the job's current generation may still commit:
     * workers of one machine share its checkpoint root, so a worker that
     * registers can list another's epoch while it is being written. */
    if (x.found && x.k.state == ZT_CKPT_PENDING && x.k.generation == job_generation(c, e.job))
      continue;
    if (!strcmp(rel, last_deleted)) continue;
    snprintf(last_deleted, sizeof last_deleted, "%s", rel);
    deleted += queue_deletion(c, m->row.id, rel) == 0;
  }
  if (malformed > 1)
    ZT_WARN("worker %s reports %d files of no epoch in all, ignored", m->row.name, malformed);
  if (deleted)
    ZT_INFO("worker %s holds %d files of committed epochs; %d stale epoch directories to "
            "delete",
            m->row.name, kept, deleted);
  else if (kept)
    ZT_DEBUG("worker %s holds %d files of committed epochs", m->row.name, kept);
}
