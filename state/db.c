/*
 * db.c: SQLite schema, migrations and typed queries for zcoord.
 *
 * See zt_db.h for the contract. Prepared statements are compiled once at
 * open and reset after each use. Every function returns 0 or -1 with a
 * message naming the database file and SQLite's reason (error kind
 * ZT_E_UNAVAILABLE: storage trouble is worth a retry for a caller). Queries
 * that return rows run through one loop (each_row) with a decoder per row
 * type. Two job columns hold lists (skip ranges, rollback steps) as text;
 * this file is the only one that writes or reads that text.
 */
#include <math.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zt_common.h"
#include "zt_db.h"

/* Migration i brings the schema from version i to i+1. Append only. */
static const char *const k_migrations[] = {
    /* 1: workers and the logbook */
    "CREATE TABLE meta(key TEXT PRIMARY KEY, value INTEGER NOT NULL);"
    "CREATE TABLE workers("
    "  id INTEGER PRIMARY KEY AUTOINCREMENT,"
    "  name TEXT NOT NULL UNIQUE,"
    "  host TEXT NOT NULL DEFAULT '',"
    "  device TEXT NOT NULL DEFAULT '',"
    "  state INTEGER NOT NULL,"
    "  last_seen_ms INTEGER NOT NULL,"
    "  registered_ms INTEGER NOT NULL,"
    "  pid INTEGER NOT NULL DEFAULT 0);"
    "CREATE TABLE events("
    "  id INTEGER PRIMARY KEY AUTOINCREMENT,"
    "  t_ms INTEGER NOT NULL,"
    "  job_id INTEGER NOT NULL DEFAULT 0,"
    "  kind TEXT NOT NULL,"
    "  worker_id INTEGER NOT NULL DEFAULT 0,"
    "  detail TEXT NOT NULL DEFAULT '');"
    "CREATE INDEX events_job ON events(job_id, id);",
    /* 2: jobs, generations and their members, per-step metrics */
    "CREATE TABLE jobs("
    "  id INTEGER PRIMARY KEY AUTOINCREMENT,"
    "  name TEXT NOT NULL DEFAULT '',"
    "  spec TEXT NOT NULL,"
    "  state INTEGER NOT NULL,"
    "  generation INTEGER NOT NULL DEFAULT 0,"
    "  world INTEGER NOT NULL DEFAULT 0,"
    "  step INTEGER NOT NULL DEFAULT 0,"
    "  total_steps INTEGER NOT NULL,"
    "  min_workers INTEGER NOT NULL,"
    "  max_workers INTEGER NOT NULL,"
    "  created_ms INTEGER NOT NULL,"
    "  updated_ms INTEGER NOT NULL,"
    "  message TEXT NOT NULL DEFAULT '',"
    "  restarts INTEGER NOT NULL DEFAULT 0);"
    "CREATE TABLE generations("
    "  job_id INTEGER NOT NULL REFERENCES jobs(id),"
    "  gen INTEGER NOT NULL,"
    "  world INTEGER NOT NULL,"
    "  start_step INTEGER NOT NULL,"
    "  started_ms INTEGER NOT NULL,"
    "  reason TEXT NOT NULL DEFAULT '',"
    "  PRIMARY KEY(job_id, gen));"
    "CREATE TABLE members("
    "  job_id INTEGER NOT NULL,"
    "  gen INTEGER NOT NULL,"
    "  rank INTEGER NOT NULL,"
    "  worker_id INTEGER NOT NULL,"
    "  PRIMARY KEY(job_id, gen, rank));"
    "CREATE TABLE steps("
    "  job_id INTEGER NOT NULL,"
    "  step INTEGER NOT NULL,"
    "  gen INTEGER NOT NULL,"
    "  loss REAL, grad_norm REAL, lr REAL, tokens_per_s REAL, val_loss REAL,"
    "  t_ms INTEGER NOT NULL,"
    "  PRIMARY KEY(job_id, step));",
    /* 3: checkpoint epochs */
    "CREATE TABLE checkpoints("
    "  job_id INTEGER NOT NULL,"
    "  step INTEGER NOT NULL,"
    "  gen INTEGER NOT NULL,"
    "  world INTEGER NOT NULL,"
    "  dir TEXT NOT NULL,"
    "  state INTEGER NOT NULL,"
    "  bytes INTEGER NOT NULL DEFAULT 0,"
    "  t_ms INTEGER NOT NULL,"
    "  PRIMARY KEY(job_id, step, gen));",
    /* 4: rollback state of a job */
    "ALTER TABLE jobs ADD COLUMN skips TEXT NOT NULL DEFAULT '';"
    "ALTER TABLE jobs ADD COLUMN lr_factor REAL NOT NULL DEFAULT 1;"
    "ALTER TABLE jobs ADD COLUMN lr_until INTEGER NOT NULL DEFAULT 0;"
    "ALTER TABLE jobs ADD COLUMN rollbacks INTEGER NOT NULL DEFAULT 0;"
    "ALTER TABLE jobs ADD COLUMN rollback_steps TEXT NOT NULL DEFAULT '';",
};

enum {
  ST_BEGIN,
  ST_COMMIT,
  ST_ROLLBACK,
  ST_META_GET,
  ST_META_SET,
  ST_WORKER_FIND,
  ST_WORKER_INSERT,
  ST_WORKER_UPDATE,
  ST_WORKER_STATE,
  ST_WORKER_TOUCH,
  ST_WORKERS_ALL,
  ST_EVENT_ADD,
  ST_EVENTS_ALL,
  ST_EVENTS_JOB,
  ST_JOB_INSERT,
  ST_JOB_UPDATE,
  ST_JOBS_ALL,
  ST_GEN_INSERT,
  ST_MEMBER_INSERT,
  ST_MEMBERS_GEN,
  ST_STEP_PUT,
  ST_STEPS_RANGE,
  ST_CKPT_PUT,
  ST_CKPTS_JOB,
  ST_COUNT
};

static const char *const k_sql[ST_COUNT] = {
    [ST_BEGIN] = "BEGIN IMMEDIATE",
    [ST_COMMIT] = "COMMIT",
    [ST_ROLLBACK] = "ROLLBACK",
    [ST_META_GET] = "SELECT value FROM meta WHERE key = ?1",
    [ST_META_SET] = "INSERT INTO meta(key, value) VALUES(?1, ?2) "
                    "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
    [ST_WORKER_FIND] = "SELECT id FROM workers WHERE name = ?1",
    [ST_WORKER_INSERT] = "INSERT INTO workers(name, host, device, state, last_seen_ms, "
                         "registered_ms, pid) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    [ST_WORKER_UPDATE] = "UPDATE workers SET host = ?2, device = ?3, state = ?4, "
                         "last_seen_ms = ?5, registered_ms = ?6, pid = ?7 WHERE id = ?1",
    [ST_WORKER_STATE] = "UPDATE workers SET state = ?2, last_seen_ms = ?3 WHERE id = ?1",
    [ST_WORKER_TOUCH] = "UPDATE workers SET last_seen_ms = ?2 WHERE id = ?1",
    [ST_WORKERS_ALL] = "SELECT id, name, host, device, state, last_seen_ms, registered_ms, pid "
                       "FROM workers ORDER BY id",
    [ST_EVENT_ADD] = "INSERT INTO events(t_ms, job_id, kind, worker_id, detail) "
                     "VALUES(?1, ?2, ?3, ?4, ?5)",
    [ST_EVENTS_ALL] = "SELECT id, t_ms, job_id, kind, worker_id, detail FROM events "
                      "WHERE id > ?1 ORDER BY id LIMIT ?2",
    [ST_EVENTS_JOB] = "SELECT id, t_ms, job_id, kind, worker_id, detail FROM events "
                      "WHERE job_id = ?3 AND id > ?1 ORDER BY id LIMIT ?2",
    [ST_JOB_INSERT] = "INSERT INTO jobs(name, spec, state, total_steps, min_workers, max_workers, "
                      "created_ms, updated_ms) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7)",
    [ST_JOB_UPDATE] = "UPDATE jobs SET state = ?2, generation = ?3, world = ?4, step = ?5, "
                      "updated_ms = ?6, message = ?7, restarts = ?8, skips = ?9, "
                      "lr_factor = ?10, lr_until = ?11, rollbacks = ?12, rollback_steps = ?13 "
                      "WHERE id = ?1",
    [ST_JOBS_ALL] = "SELECT id, name, spec, state, generation, world, step, total_steps, "
                    "min_workers, max_workers, created_ms, updated_ms, message, restarts, "
                    "skips, lr_factor, lr_until, rollbacks, rollback_steps FROM jobs ORDER BY id",
    [ST_GEN_INSERT] = "INSERT INTO generations(job_id, gen, world, start_step, started_ms, reason) "
                      "VALUES(?1, ?2, ?3, ?4, ?5, ?6)",
    [ST_MEMBER_INSERT] = "INSERT INTO members(job_id, gen, rank, worker_id) VALUES(?1, ?2, ?3, ?4)",
    [ST_MEMBERS_GEN] = "SELECT rank, worker_id FROM members WHERE job_id = ?1 AND gen = ?2 "
                       "ORDER BY rank",
    [ST_STEP_PUT] = "INSERT OR REPLACE INTO steps(job_id, step, gen, loss, grad_norm, lr, "
                    "tokens_per_s, val_loss, t_ms) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    [ST_STEPS_RANGE] = "SELECT step, gen, loss, grad_norm, lr, tokens_per_s, val_loss, t_ms "
                       "FROM steps WHERE job_id = ?1 AND step >= ?2 AND step <= ?3 ORDER BY step",
    [ST_CKPT_PUT] = "INSERT OR REPLACE INTO checkpoints(job_id, step, gen, world, dir, state, bytes, "
                    "t_ms) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    [ST_CKPTS_JOB] = "SELECT step, gen, world, dir, state, bytes, t_ms FROM checkpoints "
                     "WHERE job_id = ?1 ORDER BY step, gen",
};

struct zt_db {
  sqlite3 *h;
  char path[512];
  sqlite3_stmt *st[ST_COUNT];
};

static int db_err(zt_db_t *db, const char *what) {
  return zt_errk(ZT_E_UNAVAILABLE, "database %s: %s: %s", db->path, what, sqlite3_errmsg(db->h));
}

static int exec(zt_db_t *db, const char *sql) {
  char *msg = NULL;
  if (sqlite3_exec(db->h, sql, NULL, NULL, &msg) != SQLITE_OK) {
    zt_err("database %s: %s", db->path, msg ? msg : sqlite3_errmsg(db->h));
    sqlite3_free(msg);
    return -1;
  }
  return 0;
}

static int migrate(zt_db_t *db) {
  int have = zt_db_schema_version(db);
  int want = (int)ZT_ARRAY_LEN(k_migrations);
  if (have > want)
    return zt_err("database %s has schema version %d, newer than this zcoord (%d)", db->path, have,
                  want);
  for (int v = have; v < want; v++) {
    char bump[64];
    snprintf(bump, sizeof bump, "PRAGMA user_version = %d", v + 1);
    if (exec(db, "BEGIN IMMEDIATE") != 0) return -1;
    if (exec(db, k_migrations[v]) != 0 || exec(db, bump) != 0) {
      zt_err_wrap("migration to schema version %d", v + 1);
      exec(db, "ROLLBACK");
      return -1;
    }
    if (exec(db, "COMMIT") != 0) return -1;
    ZT_INFO("database %s: migrated to schema version %d", db->path, v + 1);
  }
  return 0;
}

int zt_db_open(const char *path, zt_db_t **out) {
  zt_db_t *db = zt_xcalloc(1, sizeof *db);
  snprintf(db->path, sizeof db->path, "%s", path);
  if (sqlite3_open_v2(path, &db->h, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                      NULL) != SQLITE_OK) {
    db_err(db, "open");
    goto err;
  }
  sqlite3_busy_timeout(db->h, 5000);
  if (exec(db, "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; "
               "PRAGMA foreign_keys = ON") != 0)
    goto err;
  if (migrate(db) != 0) goto err;
  for (int i = 0; i < ST_COUNT; i++) {
    if (sqlite3_prepare_v3(db->h, k_sql[i], -1, SQLITE_PREPARE_PERSISTENT, &db->st[i], NULL) !=
        SQLITE_OK) {
      db_err(db, k_sql[i]);
      goto err;
    }
  }
  *out = db;
  return 0;
err:
  zt_db_close(db);
  return -1;
}

void zt_db_close(zt_db_t *db) {
  if (!db) return;
  for (int i = 0; i < ST_COUNT; i++) sqlite3_finalize(db->st[i]);
  sqlite3_close(db->h);
  free(db);
}

const char *zt_db_path(zt_db_t *db) { return db->path; }

int zt_db_schema_latest(void) { return (int)ZT_ARRAY_LEN(k_migrations); }

int zt_db_schema_version(zt_db_t *db) {
  sqlite3_stmt *st;
  int v = -1;
  if (sqlite3_prepare_v2(db->h, "PRAGMA user_version", -1, &st, NULL) != SQLITE_OK) return -1;
  if (sqlite3_step(st) == SQLITE_ROW) v = sqlite3_column_int(st, 0);
  sqlite3_finalize(st);
  return v;
}

/* Runs a prepared statement that returns rows: decode() is called on each
 * row until it returns nonzero (which is returned). The statement is reset
 * after. */
static int each_row(zt_db_t *db, sqlite3_stmt *st, const char *what,
                    int (*decode)(sqlite3_stmt *st, void *ctx), void *ctx) {
  int rc, ret = 0;
  while ((rc = sqlite3_step(st)) == SQLITE_ROW)
    if ((ret = decode(st, ctx)) != 0) break;
  sqlite3_reset(st);
  sqlite3_clear_bindings(st);
  if (ret == 0 && rc != SQLITE_DONE && rc != SQLITE_ROW) return db_err(db, what);
  return ret;
}

/* The public API's row callbacks, each with its user pointer. */
#define ZT_ROW_CB(type, fntype) \
  typedef struct {              \
    fntype fn;                  \
    void *user;                 \
  } type

/* Runs a prepared statement that returns no rows, then resets it. */
static int run(zt_db_t *db, sqlite3_stmt *st, const char *what) {
  int rc = sqlite3_step(st);
  sqlite3_reset(st);
  sqlite3_clear_bindings(st);
  if (rc != SQLITE_DONE) return db_err(db, what);
  return 0;
}

int zt_db_begin(zt_db_t *db) { return run(db, db->st[ST_BEGIN], "begin"); }
int zt_db_commit(zt_db_t *db) { return run(db, db->st[ST_COMMIT], "commit"); }
void zt_db_rollback(zt_db_t *db) {
  if (sqlite3_get_autocommit(db->h)) return;
  run(db, db->st[ST_ROLLBACK], "rollback");
}

int zt_db_meta_get(zt_db_t *db, const char *key, int64_t *val, int64_t def) {
  sqlite3_stmt *st = db->st[ST_META_GET];
  sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
  int rc = sqlite3_step(st);
  *val = rc == SQLITE_ROW ? sqlite3_column_int64(st, 0) : def;
  sqlite3_reset(st);
  sqlite3_clear_bindings(st);
  if (rc != SQLITE_ROW && rc != SQLITE_DONE) return db_err(db, "read meta");
  return 0;
}

int zt_db_meta_set(zt_db_t *db, const char *key, int64_t val) {
  sqlite3_stmt *st = db->st[ST_META_SET];
  sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
  sqlite3_bind_int64(st, 2, val);
  return run(db, st, "write meta");
}

int zt_db_worker_upsert(zt_db_t *db, zt_db_worker_t *w) {
  sqlite3_stmt *f = db->st[ST_WORKER_FIND];
  sqlite3_bind_text(f, 1, w->name, -1, SQLITE_STATIC);
  int rc = sqlite3_step(f);
  int64_t id = rc == SQLITE_ROW ? sqlite3_column_int64(f, 0) : 0;
  sqlite3_reset(f);
  sqlite3_clear_bindings(f);
  if (rc != SQLITE_ROW && rc != SQLITE_DONE) return db_err(db, "find worker");
  sqlite3_stmt *st = db->st[id ? ST_WORKER_UPDATE : ST_WORKER_INSERT];
  if (id) sqlite3_bind_int64(st, 1, id);
  else sqlite3_bind_text(st, 1, w->name, -1, SQLITE_STATIC);
  sqlite3_bind_text(st, 2, w->host, -1, SQLITE_STATIC);
  sqlite3_bind_text(st, 3, w->device, -1, SQLITE_STATIC);
  sqlite3_bind_int(st, 4, w->state);
  sqlite3_bind_int64(st, 5, w->last_seen_ms);
  sqlite3_bind_int64(st, 6, w->registered_ms);
  sqlite3_bind_int(st, 7, w->pid);
  if (run(db, st, "write worker") != 0) return -1;
  w->id = id ? (uint64_t)id : (uint64_t)sqlite3_last_insert_rowid(db->h);
  return 0;
}

int zt_db_worker_set_state(zt_db_t *db, uint64_t id, int state, int64_t last_seen_ms) {
  sqlite3_stmt *st = db->st[ST_WORKER_STATE];
  sqlite3_bind_int64(st, 1, (int64_t)id);
  sqlite3_bind_int(st, 2, state);
  sqlite3_bind_int64(st, 3, last_seen_ms);
  return run(db, st, "update worker state");
}

int zt_db_workers_touch(zt_db_t *db, const uint64_t *ids, const int64_t *last_seen, int n) {
  if (n == 0) return 0;
  if (zt_db_begin(db) != 0) return -1;
  sqlite3_stmt *st = db->st[ST_WORKER_TOUCH];
  for (int i = 0; i < n; i++) {
    sqlite3_bind_int64(st, 1, (int64_t)ids[i]);
    sqlite3_bind_int64(st, 2, last_seen[i]);
    if (run(db, st, "touch worker") != 0) {
      zt_db_rollback(db);
      return -1;
    }
  }
  return zt_db_commit(db);
}

static void copy_text(char *dst, size_t n, sqlite3_stmt *st, int col) {
  const unsigned char *t = sqlite3_column_text(st, col);
  snprintf(dst, n, "%s", t ? (const char *)t : "");
}

ZT_ROW_CB(worker_cb, zt_db_worker_fn);

static int worker_row(sqlite3_stmt *st, void *p) {
  worker_cb *cb = p;
  zt_db_worker_t w;
  memset(&w, 0, sizeof w);
  w.id = (uint64_t)sqlite3_column_int64(st, 0);
  copy_text(w.name, sizeof w.name, st, 1);
  copy_text(w.host, sizeof w.host, st, 2);
  copy_text(w.device, sizeof w.device, st, 3);
  w.state = sqlite3_column_int(st, 4);
  w.last_seen_ms = sqlite3_column_int64(st, 5);
  w.registered_ms = sqlite3_column_int64(st, 6);
  w.pid = sqlite3_column_int(st, 7);
  return cb->fn(&w, cb->user);
}

int zt_db_workers_each(zt_db_t *db, zt_db_worker_fn fn, void *user) {
  worker_cb cb = {fn, user};
  return each_row(db, db->st[ST_WORKERS_ALL], "list workers", worker_row, &cb);
}

int zt_db_event_add(zt_db_t *db, uint64_t job_id, const char *kind, uint64_t worker_id,
                    const char *detail, int64_t *id_out) {
  sqlite3_stmt *st = db->st[ST_EVENT_ADD];
  sqlite3_bind_int64(st, 1, zt_wall_ms());
  sqlite3_bind_int64(st, 2, (int64_t)job_id);
  sqlite3_bind_text(st, 3, kind, -1, SQLITE_STATIC);
  sqlite3_bind_int64(st, 4, (int64_t)worker_id);
  sqlite3_bind_text(st, 5, detail ? detail : "", -1, SQLITE_STATIC);
  if (run(db, st, "add event") != 0) return -1;
  if (id_out) *id_out = sqlite3_last_insert_rowid(db->h);
  return 0;
}

ZT_ROW_CB(event_cb, zt_db_event_fn);

static int event_row(sqlite3_stmt *st, void *p) {
  event_cb *cb = p;
  zt_db_event_t e;
  memset(&e, 0, sizeof e);
  e.id = sqlite3_column_int64(st, 0);
  e.t_ms = sqlite3_column_int64(st, 1);
  e.job_id = (uint64_t)sqlite3_column_int64(st, 2);
  copy_text(e.kind, sizeof e.kind, st, 3);
  e.worker_id = (uint64_t)sqlite3_column_int64(st, 4);
  copy_text(e.detail, sizeof e.detail, st, 5);
  return cb->fn(&e, cb->user);
}

int zt_db_events_each(zt_db_t *db, uint64_t job_id, int64_t after_id, int limit, zt_db_event_fn fn,
                      void *user) {
  sqlite3_stmt *st = db->st[job_id ? ST_EVENTS_JOB : ST_EVENTS_ALL];
  sqlite3_bind_int64(st, 1, after_id);
  sqlite3_bind_int(st, 2, limit > 0 ? limit : 1000);
  if (job_id) sqlite3_bind_int64(st, 3, (int64_t)job_id);
  event_cb cb = {fn, user};
  return each_row(db, st, "list events", event_row, &cb);
}

/* ---- jobs ---------------------------------------------------------------- */

int zt_db_job_insert(zt_db_t *db, zt_db_job_t *j) {
  sqlite3_stmt *st = db->st[ST_JOB_INSERT];
  sqlite3_bind_text(st, 1, j->name, -1, SQLITE_STATIC);
  sqlite3_bind_text(st, 2, j->spec, -1, SQLITE_STATIC);
  sqlite3_bind_int(st, 3, j->state);
  sqlite3_bind_int64(st, 4, j->total_steps);
  sqlite3_bind_int(st, 5, j->min_workers);
  sqlite3_bind_int(st, 6, j->max_workers);
  sqlite3_bind_int64(st, 7, j->created_ms);
  if (run(db, st, "insert job") != 0) return -1;
  j->id = (uint64_t)sqlite3_last_insert_rowid(db->h);
  return 0;
}

/* ---- list columns ------------------------------------------------------------ */

/* Skip ranges as "start-end,start-end" (sorted, disjoint). */
static char *ranges_text(const zt_range_list_t *l) {
  size_t cap = (size_t)l->n * 44 + 1, len = 0;
  char *buf = zt_xmalloc(cap);
  buf[0] = 0;
  for (int i = 0; i < l->n; i++)
    len += (size_t)snprintf(buf + len, cap - len, "%s%llu-%llu", i ? "," : "",
                            (unsigned long long)l->r[i].start, (unsigned long long)l->r[i].end);
  return buf;
}

static int ranges_parse(const char *s, zt_range_list_t *l) {
  l->n = 0;
  while (s && *s) {
    unsigned long long a, b;
    int used = 0;
    if (sscanf(s, "%llu-%llu%n", &a, &b, &used) != 2 || b <= a ||
        (l->n && a < l->r[l->n - 1].end))
      return zt_err("malformed skip ranges near \"%.32s\"", s);
    if (l->n == ZT_MAX_SKIP_RANGES)
      return zt_err("more than %d skip ranges", ZT_MAX_SKIP_RANGES);
    l->r[l->n++] = (zt_range_t){a, b};
    s += used;
    if (*s == ',') s++;
    else if (*s) return zt_err("malformed skip ranges near \"%.32s\"", s);
  }
  return 0;
}

/* Rollback steps as "s1,s2,...". */
static char *steps_text(const int64_t *v, int n) {
  size_t cap = (size_t)n * 22 + 1, len = 0;
  char *buf = zt_xmalloc(cap);
  buf[0] = 0;
  for (int i = 0; i < n; i++)
    len += (size_t)snprintf(buf + len, cap - len, "%s%lld", i ? "," : "", (long long)v[i]);
  return buf;
}

static int steps_parse(const char *s, int64_t *v, int max, int *n) {
  *n = 0;
  while (s && *s) {
    long long x;
    int used = 0;
    if (sscanf(s, "%lld%n", &x, &used) != 1) return zt_err("malformed rollback steps");
    if (*n == max) { /* keep the newest */
      memmove(v, v + 1, (size_t)(max - 1) * sizeof *v);
      (*n)--;
    }
    v[(*n)++] = x;
    s += used;
    if (*s == ',') s++;
    else if (*s) return zt_err("malformed rollback steps near \"%.32s\"", s);
  }
  return 0;
}

int zt_db_job_update(zt_db_t *db, const zt_db_job_t *j) {
  sqlite3_stmt *st = db->st[ST_JOB_UPDATE];
  char *skips = ranges_text(&j->skips), *steps = steps_text(j->rollback_steps, j->n_rollback_steps);
  sqlite3_bind_int64(st, 1, (int64_t)j->id);
  sqlite3_bind_int(st, 2, j->state);
  sqlite3_bind_int64(st, 3, (int64_t)j->generation);
  sqlite3_bind_int(st, 4, j->world);
  sqlite3_bind_int64(st, 5, j->step);
  sqlite3_bind_int64(st, 6, j->updated_ms);
  sqlite3_bind_text(st, 7, j->message, -1, SQLITE_STATIC);
  sqlite3_bind_int(st, 8, j->restarts);
  sqlite3_bind_text(st, 9, skips, -1, SQLITE_STATIC);
  sqlite3_bind_double(st, 10, j->lr_factor);
  sqlite3_bind_int64(st, 11, j->lr_until);
  sqlite3_bind_int(st, 12, j->rollbacks);
  sqlite3_bind_text(st, 13, steps, -1, SQLITE_STATIC);
  int rc = run(db, st, "update job");
  free(skips);
  free(steps);
  return rc;
}

typedef struct {
  zt_db_t *db;
  zt_db_job_fn fn;
  void *user;
} job_ctx;

static int job_row(sqlite3_stmt *st, void *p) {
  job_ctx *x = p;
  zt_db_job_t *j = zt_xcalloc(1, sizeof *j); /* large: off the stack */
  j->id = (uint64_t)sqlite3_column_int64(st, 0);
  copy_text(j->name, sizeof j->name, st, 1);
  j->spec = (const char *)sqlite3_column_text(st, 2);
  j->state = sqlite3_column_int(st, 3);
  j->generation = (uint64_t)sqlite3_column_int64(st, 4);
  j->world = sqlite3_column_int(st, 5);
  j->step = sqlite3_column_int64(st, 6);
  j->total_steps = sqlite3_column_int64(st, 7);
  j->min_workers = sqlite3_column_int(st, 8);
  j->max_workers = sqlite3_column_int(st, 9);
  j->created_ms = sqlite3_column_int64(st, 10);
  j->updated_ms = sqlite3_column_int64(st, 11);
  copy_text(j->message, sizeof j->message, st, 12);
  j->restarts = sqlite3_column_int(st, 13);
  j->lr_factor = sqlite3_column_double(st, 15);
  j->lr_until = sqlite3_column_int64(st, 16);
  j->rollbacks = sqlite3_column_int(st, 17);
  int ret;
  if (ranges_parse((const char *)sqlite3_column_text(st, 14), &j->skips) != 0 ||
      steps_parse((const char *)sqlite3_column_text(st, 18), j->rollback_steps,
                  ZT_MAX_ROLLBACK_STEPS, &j->n_rollback_steps) != 0)
    ret = zt_err_wrap("database %s: job %llu", x->db->path, (unsigned long long)j->id);
  else
    ret = x->fn(j, x->user);
  free(j);
  return ret;
}

int zt_db_jobs_each(zt_db_t *db, zt_db_job_fn fn, void *user) {
  job_ctx x = {db, fn, user};
  return each_row(db, db->st[ST_JOBS_ALL], "list jobs", job_row, &x);
}

int zt_db_generation_add(zt_db_t *db, uint64_t job_id, uint64_t gen, int world, int64_t start_step,
                         const char *reason, const uint64_t *worker_ids) {
  sqlite3_stmt *st = db->st[ST_GEN_INSERT];
  sqlite3_bind_int64(st, 1, (int64_t)job_id);
  sqlite3_bind_int64(st, 2, (int64_t)gen);
  sqlite3_bind_int(st, 3, world);
  sqlite3_bind_int64(st, 4, start_step);
  sqlite3_bind_int64(st, 5, zt_wall_ms());
  sqlite3_bind_text(st, 6, reason, -1, SQLITE_STATIC);
  if (run(db, st, "insert generation") != 0) return -1;
  for (int r = 0; r < world; r++) {
    sqlite3_stmt *m = db->st[ST_MEMBER_INSERT];
    sqlite3_bind_int64(m, 1, (int64_t)job_id);
    sqlite3_bind_int64(m, 2, (int64_t)gen);
    sqlite3_bind_int(m, 3, r);
    sqlite3_bind_int64(m, 4, (int64_t)worker_ids[r]);
    if (run(db, m, "insert member") != 0) return -1;
  }
  return 0;
}

int zt_db_generation_members(zt_db_t *db, uint64_t job_id, uint64_t gen, uint64_t *worker_ids,
                             int max, int *n) {
  sqlite3_stmt *st = db->st[ST_MEMBERS_GEN];
  sqlite3_bind_int64(st, 1, (int64_t)job_id);
  sqlite3_bind_int64(st, 2, (int64_t)gen);
  int rc;
  *n = 0;
  while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
    int r = sqlite3_column_int(st, 0);
    if (r >= 0 && r < max) worker_ids[r] = (uint64_t)sqlite3_column_int64(st, 1);
    if (r + 1 > *n) *n = r + 1;
  }
  sqlite3_reset(st);
  if (rc != SQLITE_DONE) return db_err(db, "list members");
  return 0;
}

int zt_db_step_put(zt_db_t *db, uint64_t job_id, const zt_db_step_t *s) {
  sqlite3_stmt *st = db->st[ST_STEP_PUT];
  sqlite3_bind_int64(st, 1, (int64_t)job_id);
  sqlite3_bind_int64(st, 2, s->step);
  sqlite3_bind_int64(st, 3, (int64_t)s->generation);
  sqlite3_bind_double(st, 4, s->loss);
  sqlite3_bind_double(st, 5, s->grad_norm);
  sqlite3_bind_double(st, 6, s->lr);
  sqlite3_bind_double(st, 7, s->tokens_per_s);
  if (s->val_loss == s->val_loss) sqlite3_bind_double(st, 8, s->val_loss);
  else sqlite3_bind_null(st, 8);
  sqlite3_bind_int64(st, 9, s->t_ms);
  return run(db, st, "store step");
}

ZT_ROW_CB(step_cb, zt_db_step_fn);

static int step_row(sqlite3_stmt *st, void *p) {
  step_cb *cb = p;
  zt_db_step_t s;
  s.step = sqlite3_column_int64(st, 0);
  s.generation = (uint64_t)sqlite3_column_int64(st, 1);
  s.loss = sqlite3_column_double(st, 2);
  s.grad_norm = sqlite3_column_double(st, 3);
  s.lr = sqlite3_column_double(st, 4);
  s.tokens_per_s = sqlite3_column_double(st, 5);
  s.val_loss = sqlite3_column_type(st, 6) == SQLITE_NULL ? NAN : sqlite3_column_double(st, 6);
  s.t_ms = sqlite3_column_int64(st, 7);
  return cb->fn(&s, cb->user);
}

int zt_db_steps_each(zt_db_t *db, uint64_t job_id, int64_t from, int64_t to, zt_db_step_fn fn,
                     void *user) {
  sqlite3_stmt *st = db->st[ST_STEPS_RANGE];
  sqlite3_bind_int64(st, 1, (int64_t)job_id);
  sqlite3_bind_int64(st, 2, from);
  sqlite3_bind_int64(st, 3, to);
  step_cb cb = {fn, user};
  return each_row(db, st, "list steps", step_row, &cb);
}

/* ---- checkpoint epochs ------------------------------------------------------ */

int zt_db_ckpt_put(zt_db_t *db, uint64_t job_id, const zt_db_ckpt_t *k) {
  sqlite3_stmt *st = db->st[ST_CKPT_PUT];
  sqlite3_bind_int64(st, 1, (int64_t)job_id);
  sqlite3_bind_int64(st, 2, k->step);
  sqlite3_bind_int64(st, 3, (int64_t)k->generation);
  sqlite3_bind_int(st, 4, k->world);
  sqlite3_bind_text(st, 5, k->dir, -1, SQLITE_STATIC);
  sqlite3_bind_int(st, 6, k->state);
  sqlite3_bind_int64(st, 7, (int64_t)k->bytes);
  sqlite3_bind_int64(st, 8, k->t_ms);
  return run(db, st, "store checkpoint");
}

ZT_ROW_CB(ckpt_cb, zt_db_ckpt_fn);

static int ckpt_row(sqlite3_stmt *st, void *p) {
  ckpt_cb *cb = p;
  zt_db_ckpt_t k;
  memset(&k, 0, sizeof k);
  k.step = sqlite3_column_int64(st, 0);
  k.generation = (uint64_t)sqlite3_column_int64(st, 1);
  k.world = sqlite3_column_int(st, 2);
  copy_text(k.dir, sizeof k.dir, st, 3);
  k.state = sqlite3_column_int(st, 4);
  k.bytes = (uint64_t)sqlite3_column_int64(st, 5);
  k.t_ms = sqlite3_column_int64(st, 6);
  return cb->fn(&k, cb->user);
}

int zt_db_ckpts_each(zt_db_t *db, uint64_t job_id, zt_db_ckpt_fn fn, void *user) {
  sqlite3_stmt *st = db->st[ST_CKPTS_JOB];
  sqlite3_bind_int64(st, 1, (int64_t)job_id);
  ckpt_cb cb = {fn, user};
  return each_row(db, st, "list checkpoints", ckpt_row, &cb);
}
