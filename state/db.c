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
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <sqlite3.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "zt_common.h"
#include "zt_db.h"

/* Migration i brings the schema from version i to i+1. Append only. */
static const char *const k_migrations[] = {
    /* 1: workers and the logbook */
    ("CREATE TABLE meta(key TEXT PRIMARY KEY, value INTEGER NOT NULL);"
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
     "CREATE INDEX events_job ON events(job_id, id);"),
    /* 2: jobs, generations and their members, per-step metrics */
    ("CREATE TABLE jobs("
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
     "  PRIMARY KEY(job_id, step));"),
    /* 3: checkpoint epochs */
    ("CREATE TABLE checkpoints("
     "  job_id INTEGER NOT NULL,"
     "  step INTEGER NOT NULL,"
     "  gen INTEGER NOT NULL,"
     "  world INTEGER NOT NULL,"
     "  dir TEXT NOT NULL,"
     "  state INTEGER NOT NULL,"
     "  bytes INTEGER NOT NULL DEFAULT 0,"
     "  t_ms INTEGER NOT NULL,"
     "  PRIMARY KEY(job_id, step, gen));"),
    /* 4: rollback state of a job */
    ("ALTER TABLE jobs ADD COLUMN skips TEXT NOT NULL DEFAULT '';"
     "ALTER TABLE jobs ADD COLUMN lr_factor REAL NOT NULL DEFAULT 1;"
     "ALTER TABLE jobs ADD COLUMN lr_until INTEGER NOT NULL DEFAULT 0;"
     "ALTER TABLE jobs ADD COLUMN rollbacks INTEGER NOT NULL DEFAULT 0;"
     "ALTER TABLE jobs ADD COLUMN rollback_steps TEXT NOT NULL DEFAULT '';"),
    /* 5: worker credentials and memory; the checksummed files of every epoch */
    ("ALTER TABLE workers ADD COLUMN session TEXT NOT NULL DEFAULT '';"
     "ALTER TABLE workers ADD COLUMN host_memory INTEGER NOT NULL DEFAULT 0;"
     "ALTER TABLE workers ADD COLUMN device_memory INTEGER NOT NULL DEFAULT 0;"
     "CREATE TABLE checkpoint_files("
     "  job_id INTEGER NOT NULL,"
     "  step INTEGER NOT NULL,"
     "  gen INTEGER NOT NULL,"
     "  name TEXT NOT NULL,"
     "  bytes INTEGER NOT NULL,"
     "  checksum TEXT NOT NULL,"
     "  PRIMARY KEY(job_id, step, gen, name));"),
    /* 6: an event that repeats is one row with a count */
    ("ALTER TABLE events ADD COLUMN count INTEGER NOT NULL DEFAULT 1;"
     "ALTER TABLE events ADD COLUMN last_ms INTEGER NOT NULL DEFAULT 0;"),
    /* 7: replica stores; where each checkpoint file has copies; epochs
     * workers are to delete */
    ("ALTER TABLE workers ADD COLUMN store_addr TEXT NOT NULL DEFAULT '';"
     "CREATE TABLE checkpoint_copies("
     "  job_id INTEGER NOT NULL,"
     "  step INTEGER NOT NULL,"
     "  gen INTEGER NOT NULL,"
     "  name TEXT NOT NULL,"
     "  worker_id INTEGER NOT NULL,"
     "  PRIMARY KEY(job_id, step, gen, name, worker_id));"
     "CREATE TABLE epoch_deletions("
     "  worker_id INTEGER NOT NULL,"
     "  dir TEXT NOT NULL,"
     "  PRIMARY KEY(worker_id, dir));"),
    /* 8: a collapsed event keeps its first detail beside its latest */
    ("ALTER TABLE events ADD COLUMN last_detail TEXT NOT NULL DEFAULT '';"),
};

enum {
  ST_BEGIN,
  ST_COMMIT,
  ST_ROLLBACK,
  ST_META_GET,
  ST_META_SET,
  ST_WORKER_UPSERT,
  ST_WORKER_STATE,
  ST_WORKER_TOUCH,
  ST_WORKERS_ALL,
  ST_EVENT_ADD,
  ST_EVENT_REPEAT,
  ST_EVENTS_ALL,
  ST_EVENTS_JOB,
  ST_EVENTS_ALL_TAIL,
  ST_EVENTS_JOB_TAIL,
  ST_JOB_INSERT,
  ST_JOB_UPDATE,
  ST_JOBS_ALL,
  ST_GEN_INSERT,
  ST_GEN_START,
  ST_MEMBER_INSERT,
  ST_MEMBERS_GEN,
  ST_STEP_PUT,
  ST_STEPS_RANGE,
  ST_CKPT_PUT,
  ST_CKPTS_JOB,
  ST_COPY_ADD,
  ST_COPIES_EPOCH,
  ST_COPIES_DEL,
  ST_DELETION_ADD,
  ST_DELETIONS_OF,
  ST_DELETION_DONE,
  ST_DELETION_WORKERS,
  ST_CKPT_FILES_DEL,
  ST_CKPT_FILE_PUT,
  ST_CKPT_FILES_GET,
  ST_CKPT_FIND_DIR,
  ST_COUNT
};

/* The columns of each row type appear in the order of its column table
 * (below), so that one decoder and one binder serve every statement. */
static const char *const k_sql[ST_COUNT] = {
    [ST_BEGIN] = "BEGIN IMMEDIATE",
    [ST_COMMIT] = "COMMIT",
    [ST_ROLLBACK] = "ROLLBACK",
    [ST_META_GET] = "SELECT value FROM meta WHERE key = ?1",
    [ST_META_SET] = "INSERT INTO meta(key, value) VALUES(?1, ?2) "
                    "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
    [ST_WORKER_UPSERT] = "INSERT INTO workers(name, host, device, state, last_seen_ms, "
                         "registered_ms, pid, session, host_memory, device_memory, store_addr) "
                         "VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11) "
                         "ON CONFLICT(name) DO UPDATE SET host = excluded.host, "
                         "device = excluded.device, state = excluded.state, "
                         "last_seen_ms = excluded.last_seen_ms, "
                         "registered_ms = excluded.registered_ms, pid = excluded.pid, "
                         "session = excluded.session, host_memory = excluded.host_memory, "
                         "device_memory = excluded.device_memory, "
                         "store_addr = excluded.store_addr RETURNING id",
    [ST_WORKER_STATE] = "UPDATE workers SET state = ?2, last_seen_ms = ?3 WHERE id = ?1",
    [ST_WORKER_TOUCH] = "UPDATE workers SET last_seen_ms = ?2 WHERE id = ?1",
    [ST_WORKERS_ALL] = "SELECT id, name, host, device, state, last_seen_ms, registered_ms, pid, "
                       "session, host_memory, device_memory, store_addr FROM workers ORDER BY id",
    [ST_EVENT_ADD] = "INSERT INTO events(t_ms, job_id, kind, worker_id, detail) "
                     "VALUES(?1, ?2, ?3, ?4, ?5)",
    [ST_EVENT_REPEAT] = "UPDATE events SET count = count + 1, last_ms = ?2, last_detail = ?3 "
                        "WHERE id = ?1",
    [ST_EVENTS_ALL] = "SELECT id, t_ms, job_id, kind, worker_id, detail, count, last_ms, "
                      "last_detail FROM events WHERE id > ?1 ORDER BY id LIMIT ?2",
    [ST_EVENTS_JOB] = "SELECT id, t_ms, job_id, kind, worker_id, detail, count, last_ms, "
                      "last_detail FROM events WHERE job_id = ?3 AND id > ?1 ORDER BY id LIMIT ?2",
    [ST_EVENTS_ALL_TAIL] = "SELECT * FROM (SELECT id, t_ms, job_id, kind, worker_id, detail, "
                           "count, last_ms, last_detail FROM events WHERE id > ?1 "
                           "ORDER BY id DESC LIMIT ?2) ORDER BY id",
    [ST_EVENTS_JOB_TAIL] = "SELECT * FROM (SELECT id, t_ms, job_id, kind, worker_id, detail, "
                           "count, last_ms, last_detail FROM events WHERE job_id = ?3 AND id > ?1 "
                           "ORDER BY id DESC LIMIT ?2) ORDER BY id",
    [ST_JOB_INSERT] = "INSERT INTO jobs(name, spec, state, total_steps, min_workers, max_workers, "
                      "created_ms, updated_ms) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7)",
    [ST_JOB_UPDATE] = "UPDATE jobs SET state = ?2, generation = ?3, world = ?4, step = ?5, "
                      "updated_ms = ?6, message = ?7, restarts = ?8, lr_factor = ?9, "
                      "lr_until = ?10, rollbacks = ?11, skips = ?12, rollback_steps = ?13 "
                      "WHERE id = ?1",
    [ST_JOBS_ALL] = "SELECT id, state, generation, world, step, updated_ms, message, restarts, "
                    "lr_factor, lr_until, rollbacks, name, total_steps, min_workers, max_workers, "
                    "created_ms, spec, skips, rollback_steps FROM jobs ORDER BY id",
    [ST_GEN_INSERT] = "INSERT INTO generations(job_id, gen, world, start_step, started_ms, reason) "
                      "VALUES(?1, ?2, ?3, ?4, ?5, ?6)",
    [ST_GEN_START] = "UPDATE generations SET start_step = ? WHERE job_id = ? AND gen = ?",
    [ST_MEMBER_INSERT] = "INSERT INTO members(job_id, gen, rank, worker_id) VALUES(?1, ?2, ?3, ?4)",
    [ST_MEMBERS_GEN] = "SELECT rank, worker_id FROM members WHERE job_id = ?1 AND gen = ?2 "
                       "ORDER BY rank",
    [ST_STEP_PUT] = "INSERT OR REPLACE INTO steps(job_id, step, gen, loss, grad_norm, lr, "
                    "tokens_per_s, val_loss, t_ms) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    [ST_STEPS_RANGE] = "SELECT step, gen, loss, grad_norm, lr, tokens_per_s, val_loss, t_ms "
                       "FROM steps WHERE job_id = ?1 AND step >= ?2 AND step <= ?3 ORDER BY step "
                       "LIMIT ?4",
    [ST_CKPT_PUT] = "INSERT OR REPLACE INTO checkpoints(job_id, step, gen, world, dir, state, "
                    "bytes, t_ms) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    [ST_CKPTS_JOB] = "SELECT step, gen, world, dir, state, bytes, t_ms FROM checkpoints "
                     "WHERE job_id = ?1 ORDER BY step, gen",
    [ST_COPY_ADD] = "INSERT OR IGNORE INTO checkpoint_copies(job_id, step, gen, name, worker_id) "
                    "VALUES(?1, ?2, ?3, ?4, ?5)",
    [ST_COPIES_EPOCH] = "SELECT name, worker_id FROM checkpoint_copies WHERE job_id = ?1 AND "
                        "step = ?2 AND gen = ?3 ORDER BY name, worker_id",
    [ST_COPIES_DEL] = "DELETE FROM checkpoint_copies WHERE job_id = ?1 AND step = ?2 AND gen = ?3",
    [ST_DELETION_ADD] = "INSERT OR IGNORE INTO epoch_deletions(worker_id, dir) VALUES(?1, ?2)",
    [ST_DELETIONS_OF] = "SELECT dir FROM epoch_deletions WHERE worker_id = ?1 ORDER BY dir LIMIT ?2",
    [ST_DELETION_DONE] = "DELETE FROM epoch_deletions WHERE worker_id = ?1 AND dir = ?2",
    [ST_DELETION_WORKERS] = "SELECT DISTINCT worker_id FROM epoch_deletions ORDER BY worker_id",
    [ST_CKPT_FILES_DEL] = "DELETE FROM checkpoint_files WHERE job_id = ?1 AND step = ?2 AND gen = ?3",
    [ST_CKPT_FILE_PUT] = "INSERT INTO checkpoint_files(job_id, step, gen, name, bytes, checksum) "
                         "VALUES(?1, ?2, ?3, ?4, ?5, ?6)",
    [ST_CKPT_FILES_GET] = "SELECT name, bytes, checksum FROM checkpoint_files WHERE job_id = ?1 "
                          "AND step = ?2 AND gen = ?3 ORDER BY name",
    [ST_CKPT_FIND_DIR] = "SELECT step, gen, world, dir, state, bytes, t_ms, job_id FROM checkpoints "
                         "WHERE dir = ?1 AND state = 1 ORDER BY job_id DESC LIMIT 1",
};

/* ---- rows and columns ----------------------------------------------------------
 *
 * Each row type has one table of its fields in column order: kind, offset
 * and size. decode() reads a result row into a struct, bind() binds a
 * struct's fields to consecutive parameters; every query and every write of
 * that type goes through them. */

typedef enum {
  COL_INT,  /* int */
  COL_I64,  /* int64_t or uint64_t */
  COL_F64,  /* double */
  COL_F64N, /* double; NULL in the database is NaN in memory */
  COL_TEXT, /* char[size] */
} col_kind;

typedef struct {
  col_kind kind;
  size_t off, size;
} col;

#define COL(kind, type, field) {kind, offsetof(type, field), sizeof(((type *)0)->field)}

/* workers: ST_WORKERS_ALL; ST_WORKER_UPSERT binds all but the id. */
static const col k_worker_cols[] = {
    COL(COL_I64, zt_db_worker_t, id), COL(COL_TEXT, zt_db_worker_t, name),
    COL(COL_TEXT, zt_db_worker_t, host), COL(COL_TEXT, zt_db_worker_t, device),
    COL(COL_INT, zt_db_worker_t, state), COL(COL_I64, zt_db_worker_t, last_seen_ms),
    COL(COL_I64, zt_db_worker_t, registered_ms), COL(COL_INT, zt_db_worker_t, pid),
    COL(COL_TEXT, zt_db_worker_t, session), COL(COL_I64, zt_db_worker_t, host_memory),
    COL(COL_I64, zt_db_worker_t, device_memory), COL(COL_TEXT, zt_db_worker_t, store_addr)};

/* events: ST_EVENTS_ALL and ST_EVENTS_JOB (the logbook is written by
 * zt_db_event_add, with the time it is written). */
static const col k_event_cols[] = {
    COL(COL_I64, zt_db_event_t, id), COL(COL_I64, zt_db_event_t, t_ms),
    COL(COL_I64, zt_db_event_t, job_id), COL(COL_TEXT, zt_db_event_t, kind),
    COL(COL_I64, zt_db_event_t, worker_id), COL(COL_TEXT, zt_db_event_t, detail),
    COL(COL_I64, zt_db_event_t, count), COL(COL_I64, zt_db_event_t, last_ms),
    COL(COL_TEXT, zt_db_event_t, last_detail)};

/* jobs: the columns of ST_JOBS_ALL before the three that need more than a
 * copy (spec, skips, rollback_steps). The first JOB_UPDATED of them are
 * the id and what ST_JOB_UPDATE writes, in its parameter order. */
static const col k_job_cols[] = {
    COL(COL_I64, zt_db_job_t, id), COL(COL_INT, zt_db_job_t, state),
    COL(COL_I64, zt_db_job_t, generation), COL(COL_INT, zt_db_job_t, world),
    COL(COL_I64, zt_db_job_t, step), COL(COL_I64, zt_db_job_t, updated_ms),
    COL(COL_TEXT, zt_db_job_t, message), COL(COL_INT, zt_db_job_t, restarts),
    COL(COL_F64, zt_db_job_t, lr_factor), COL(COL_I64, zt_db_job_t, lr_until),
    COL(COL_INT, zt_db_job_t, rollbacks), COL(COL_TEXT, zt_db_job_t, name),
    COL(COL_I64, zt_db_job_t, total_steps), COL(COL_INT, zt_db_job_t, min_workers),
    COL(COL_INT, zt_db_job_t, max_workers), COL(COL_I64, zt_db_job_t, created_ms)};
#define JOB_UPDATED 11

/* steps: ST_STEPS_RANGE, and ST_STEP_PUT from its second parameter. */
static const col k_step_cols[] = {
    COL(COL_I64, zt_db_step_t, step), COL(COL_I64, zt_db_step_t, generation),
    COL(COL_F64, zt_db_step_t, loss), COL(COL_F64, zt_db_step_t, grad_norm),
    COL(COL_F64, zt_db_step_t, lr), COL(COL_F64, zt_db_step_t, tokens_per_s),
    COL(COL_F64N, zt_db_step_t, val_loss), COL(COL_I64, zt_db_step_t, t_ms)};

/* checkpoints: ST_CKPTS_JOB, and ST_CKPT_PUT from its second parameter. */
static const col k_ckpt_cols[] = {
    COL(COL_I64, zt_db_ckpt_t, step), COL(COL_I64, zt_db_ckpt_t, generation),
    COL(COL_INT, zt_db_ckpt_t, world), COL(COL_TEXT, zt_db_ckpt_t, dir),
    COL(COL_INT, zt_db_ckpt_t, state), COL(COL_I64, zt_db_ckpt_t, bytes),
    COL(COL_I64, zt_db_ckpt_t, t_ms)};

/* checkpoint_files: ST_CKPT_FILES_GET, and ST_CKPT_FILE_PUT from its fourth
 * parameter. */
static const col k_file_cols[] = {
    COL(COL_TEXT, zt_db_ckpt_file_t, name), COL(COL_I64, zt_db_ckpt_file_t, bytes),
    COL(COL_TEXT, zt_db_ckpt_file_t, checksum)};

/* Reads result columns first.. into the fields of `row`. */
static void decode(sqlite3_stmt *st, int first, const col *cols, size_t n, void *row) {
  for (size_t i = 0; i < n; i++) {
    char *f = (char *)row + cols[i].off;
    int c = first + (int)i;
    switch (cols[i].kind) {
      case COL_INT: *(int *)f = sqlite3_column_int(st, c); break;
      case COL_I64: *(int64_t *)f = sqlite3_column_int64(st, c); break;
      case COL_F64: *(double *)f = sqlite3_column_double(st, c); break;
      case COL_F64N:
        *(double *)f = sqlite3_column_type(st, c) == SQLITE_NULL ? NAN : sqlite3_column_double(st, c);
        break;
      case COL_TEXT: {
        const unsigned char *t = sqlite3_column_text(st, c);
        snprintf(f, cols[i].size, "%s", t ? (const char *)t : "");
        break;
      }
    }
  }
}

/* Binds the fields of `row` to the parameters first.. (1-based). */
static void bind(sqlite3_stmt *st, int first, const col *cols, size_t n, const void *row) {
  for (size_t i = 0; i < n; i++) {
    const char *f = (const char *)row + cols[i].off;
    int p = first + (int)i;
    switch (cols[i].kind) {
      case COL_INT: sqlite3_bind_int(st, p, *(const int *)f); break;
      case COL_I64: sqlite3_bind_int64(st, p, *(const int64_t *)f); break;
      case COL_F64: sqlite3_bind_double(st, p, *(const double *)f); break;
      case COL_F64N:
        if (isnan(*(const double *)f)) sqlite3_bind_null(st, p);
        else sqlite3_bind_double(st, p, *(const double *)f);
        break;
      case COL_TEXT: sqlite3_bind_text(st, p, f, -1, SQLITE_STATIC); break;
    }
  }
}

struct zt_db {
  sqlite3 *h;
  int lock_fd; /* holds the exclusive flock on <path>.lock */
  char path[ZT_PATH_MAX];
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

/* Takes the exclusive lock <path>.lock (flock), writing our pid into it. */
static int take_lock(zt_db_t *db) {
  char lp[ZT_PATH_MAX];
  if (zt_path_fmt(lp, sizeof lp, "%s.lock", db->path) != 0) return -1;
  db->lock_fd = open(lp, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (db->lock_fd < 0) return zt_err_errno("database %s: lock file %s", db->path, lp);
  if (flock(db->lock_fd, LOCK_EX | LOCK_NB) != 0) {
    char pid[32] = "";
    ssize_t n = pread(db->lock_fd, pid, sizeof pid - 1, 0);
    pid[n > 0 ? n : 0] = 0;
    pid[strcspn(pid, "\n")] = 0;
    close(db->lock_fd);
    db->lock_fd = -1;
    return zt_errk(ZT_E_STATE, "database %s is in use by another zcoord (pid %s, lock %s)",
                   db->path, pid[0] ? pid : "unknown", lp);
  }
  char pid[32];
  int n = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
  if (ftruncate(db->lock_fd, 0) != 0 || pwrite(db->lock_fd, pid, (size_t)n, 0) != n)
    ZT_WARN("database %s: cannot write the pid into %s", db->path, lp);
  return 0;
}

/* An existing empty file is a database that lost its contents, unless the
 * caller says it is new. */
static int check_not_empty(zt_db_t *db, unsigned flags) {
  struct stat st;
  if (stat(db->path, &st) != 0 || st.st_size > 0 || (flags & ZT_DB_NEW_IF_EMPTY)) return 0;
  return zt_errk(ZT_E_STATE,
                 "database %s exists but is empty (0 bytes): it may have been truncated. Restore "
                 "it from a backup, or start with --new-db to begin a new coordinator state",
                 db->path);
}

/* What to do about a damaged database, after the message naming the
 * damage. */
#define ZT_DB_RESTORE                                                                          \
  "; the file was left as it was. Restore it from a backup (docs/deploy.md, \"The database: " \
  "backups, damage, restore\")"

/* Checks the 100-byte header of an existing, non-empty database file
 * against SQLite's file format (https://sqlite.org/fileformat.html, 1.3)
 * before SQLite opens it: a damaged header does not always stop SQLite,
 * which takes, e.g., a file format write version above 2 for a database it
 * may only read, and would fail later on its first write ("attempt to
 * write a readonly database"). */
static int header_check(zt_db_t *db) {
  int fd = open(db->path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? 0 : zt_err_errno("database %s", db->path);
  unsigned char h[100] = {0};
  ssize_t n = pread(fd, h, sizeof h, 0);
  close(fd);
  if (n < 0) return zt_err_errno("database %s: read its header", db->path);
  if (n == 0) return 0; /* empty: check_not_empty's case */
  char why[160] = "";
  unsigned page = (unsigned)h[16] << 8 | h[17];
  if (page == 1) page = 65536;
  if (n < (ssize_t)sizeof h)
    snprintf(why, sizeof why, "%zd bytes, shorter than SQLite's 100-byte header", n);
  else if (memcmp(h, "SQLite format 3", 16) != 0)
    snprintf(why, sizeof why, "bytes 0-15 are not \"SQLite format 3\"");
  else if (page < 512 || (page & (page - 1)))
    snprintf(why, sizeof why, "page size %u is not a power of two in 512..65536", page);
  else if (h[18] < 1 || h[18] > 2 || h[19] < 1 || h[19] > 2)
    snprintf(why, sizeof why, "file format versions %u/%u, expected 1 or 2", h[18], h[19]);
  else if (h[20] > page - 480)
    snprintf(why, sizeof why, "%u reserved bytes per page of %u", h[20], page);
  else if (h[21] != 64 || h[22] != 32 || h[23] != 32)
    snprintf(why, sizeof why, "payload fractions %u/%u/%u, expected 64/32/32", h[21], h[22],
             h[23]);
  if (!why[0]) return 0;
  return zt_errk(ZT_E_STATE,
                 "database %s is not a usable SQLite database: its header is damaged (%s)"
                 ZT_DB_RESTORE, db->path, why);
}

/* PRAGMA integrity_check, the full check: quick_check, which it extends,
 * misses an index that no longer matches its table (a flipped byte in an
 * index page: "row 66 missing from index sqlite_autoindex_checkpoint_files_1"),
 * and zcoord would serve from the damaged file. It reads the whole file:
 * on a 1 GB database (2.2 million step records, 8.8 million logbook
 * entries; bench/db-check, 2 shared vCPUs) it took 4.9 s with the file in
 * the page cache and 21.7 s from disk, where quick_check took 1.8 s and
 * 17.0 s (docs/deploy.md). */
static int integrity_check(zt_db_t *db) {
  sqlite3_stmt *st;
  if (sqlite3_prepare_v2(db->h, "PRAGMA integrity_check(3)", -1, &st, NULL) != SQLITE_OK)
    return zt_errk(ZT_E_STATE, "database %s is damaged: it cannot be read (%s)" ZT_DB_RESTORE,
                   db->path, sqlite3_errmsg(db->h));
  char verdict[400] = "";
  int rc;
  while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
    size_t l = strlen(verdict);
    const unsigned char *t = sqlite3_column_text(st, 0);
    snprintf(verdict + l, sizeof verdict - l, "%s%s", l ? "; " : "", t ? (const char *)t : "");
  }
  sqlite3_finalize(st);
  for (char *p = verdict; (p = strchr(p, '\n'));) *p = ' '; /* one line */
  if (rc != SQLITE_DONE)
    return zt_errk(ZT_E_STATE, "database %s is damaged: the check stopped (%s)" ZT_DB_RESTORE,
                   db->path, sqlite3_errmsg(db->h));
  if (strcmp(verdict, "ok") != 0)
    return zt_errk(ZT_E_STATE, "database %s is damaged (integrity_check: %.300s)" ZT_DB_RESTORE,
                   db->path, verdict);
  return 0;
}

int zt_db_open(const char *path, unsigned flags, zt_db_t **out) {
  zt_db_t *db = zt_xcalloc(1, sizeof *db);
  db->lock_fd = -1;
  snprintf(db->path, sizeof db->path, "%s", path);
  if (take_lock(db) != 0 || check_not_empty(db, flags) != 0 || header_check(db) != 0) goto err;
  if (sqlite3_open_v2(path, &db->h, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                      NULL) != SQLITE_OK) {
    db_err(db, "open");
    goto err;
  }
  sqlite3_busy_timeout(db->h, 5000);
  /* Until the file has passed, closing it must not copy a write-ahead log
   * into it (a checkpoint): a refused file is left as it was. */
  sqlite3_db_config(db->h, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, NULL);
  if (integrity_check(db) != 0) goto err;
  sqlite3_db_config(db->h, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 0, NULL);
  if (exec(db, "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; "
               "PRAGMA foreign_keys = ON") != 0)
    goto err;
  if (chmod(path, 0600) != 0) ZT_WARN("database %s: chmod 0600: %s", path, strerror(errno));
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
  if (db->lock_fd >= 0) close(db->lock_fd); /* releases the flock */
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
  sqlite3_stmt *st = db->st[ST_WORKER_UPSERT];
  bind(st, 1, k_worker_cols + 1, ZT_ARRAY_LEN(k_worker_cols) - 1, w); /* all but the id */
  int rc = sqlite3_step(st);
  if (rc == SQLITE_ROW) {
    w->id = (uint64_t)sqlite3_column_int64(st, 0);
    rc = sqlite3_step(st);
  }
  sqlite3_reset(st);
  sqlite3_clear_bindings(st);
  if (rc != SQLITE_DONE) return db_err(db, "write worker");
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

/* A query whose rows are all the columns of one table, in order: each row
 * is decoded into its struct and handed to the caller's callback. */
typedef enum { ROW_WORKER, ROW_EVENT, ROW_STEP, ROW_CKPT } row_type;

typedef struct {
  row_type type;
  union {
    zt_db_worker_fn worker;
    zt_db_event_fn event;
    zt_db_step_fn step;
    zt_db_ckpt_fn ckpt;
  } fn;
  void *user;
} rows_ctx;

static int typed_row(sqlite3_stmt *st, void *p) {
  rows_ctx *x = p;
  union {
    zt_db_worker_t worker;
    zt_db_event_t event;
    zt_db_step_t step;
    zt_db_ckpt_t ckpt;
  } row;
  memset(&row, 0, sizeof row);
  switch (x->type) {
    case ROW_WORKER:
      decode(st, 0, k_worker_cols, ZT_ARRAY_LEN(k_worker_cols), &row.worker);
      return x->fn.worker(&row.worker, x->user);
    case ROW_EVENT:
      decode(st, 0, k_event_cols, ZT_ARRAY_LEN(k_event_cols), &row.event);
      return x->fn.event(&row.event, x->user);
    case ROW_STEP:
      decode(st, 0, k_step_cols, ZT_ARRAY_LEN(k_step_cols), &row.step);
      return x->fn.step(&row.step, x->user);
    case ROW_CKPT:
      decode(st, 0, k_ckpt_cols, ZT_ARRAY_LEN(k_ckpt_cols), &row.ckpt);
      return x->fn.ckpt(&row.ckpt, x->user);
  }
  return 0;
}

int zt_db_workers_each(zt_db_t *db, zt_db_worker_fn fn, void *user) {
  rows_ctx x = {ROW_WORKER, {.worker = fn}, user};
  return each_row(db, db->st[ST_WORKERS_ALL], "list workers", typed_row, &x);
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

int zt_db_event_repeat(zt_db_t *db, int64_t id, const char *detail) {
  sqlite3_stmt *st = db->st[ST_EVENT_REPEAT];
  sqlite3_bind_int64(st, 1, id);
  sqlite3_bind_int64(st, 2, zt_wall_ms());
  sqlite3_bind_text(st, 3, detail ? detail : "", -1, SQLITE_STATIC);
  return run(db, st, "repeat event");
}

int zt_db_events_each(zt_db_t *db, uint64_t job_id, int64_t after_id, int limit, zt_db_event_fn fn,
                      void *user) {
  int tail = limit < 0 && limit != INT_MIN;
  sqlite3_stmt *st = db->st[tail ? (job_id ? ST_EVENTS_JOB_TAIL : ST_EVENTS_ALL_TAIL)
                                 : (job_id ? ST_EVENTS_JOB : ST_EVENTS_ALL)];
  sqlite3_bind_int64(st, 1, after_id);
  sqlite3_bind_int(st, 2, tail ? -limit : limit > 0 ? limit : 1000);
  if (job_id) sqlite3_bind_int64(st, 3, (int64_t)job_id);
  rows_ctx x = {ROW_EVENT, {.event = fn}, user};
  return each_row(db, st, "list events", typed_row, &x);
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
    if (l->n == ZT_MAX_SKIP_RANGES) return zt_err("more than %d skip ranges", ZT_MAX_SKIP_RANGES);
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
  bind(st, 1, k_job_cols, JOB_UPDATED, j);
  sqlite3_bind_text(st, JOB_UPDATED + 1, skips, -1, SQLITE_STATIC);
  sqlite3_bind_text(st, JOB_UPDATED + 2, steps, -1, SQLITE_STATIC);
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
  int n = (int)ZT_ARRAY_LEN(k_job_cols);
  zt_db_job_t *j = zt_xcalloc(1, sizeof *j); /* large: off the stack */
  decode(st, 0, k_job_cols, (size_t)n, j);
  j->spec = (const char *)sqlite3_column_text(st, n);
  int ret;
  if (ranges_parse((const char *)sqlite3_column_text(st, n + 1), &j->skips) != 0 ||
      steps_parse((const char *)sqlite3_column_text(st, n + 2), j->rollback_steps,
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

int zt_db_generation_start(zt_db_t *db, uint64_t job_id, uint64_t gen, int64_t start_step) {
  sqlite3_stmt *st = db->st[ST_GEN_START];
  sqlite3_bind_int64(st, 1, start_step);
  sqlite3_bind_int64(st, 2, (int64_t)job_id);
  sqlite3_bind_int64(st, 3, (int64_t)gen);
  return run(db, st, "set a generation's start step");
}

typedef struct {
  uint64_t *ids;
  int max, n;
} members_ctx;

static int member_row(sqlite3_stmt *st, void *p) {
  members_ctx *x = p;
  int r = sqlite3_column_int(st, 0);
  if (r >= 0 && r < x->max) x->ids[r] = (uint64_t)sqlite3_column_int64(st, 1);
  if (r + 1 > x->n) x->n = r + 1;
  return 0;
}

int zt_db_generation_members(zt_db_t *db, uint64_t job_id, uint64_t gen, uint64_t *worker_ids,
                             int max, int *n) {
  sqlite3_stmt *st = db->st[ST_MEMBERS_GEN];
  sqlite3_bind_int64(st, 1, (int64_t)job_id);
  sqlite3_bind_int64(st, 2, (int64_t)gen);
  members_ctx x = {worker_ids, max, 0};
  int rc = each_row(db, st, "list members", member_row, &x);
  *n = x.n;
  return rc;
}

/* ---- steps and checkpoint epochs ------------------------------------------------ */

int zt_db_step_put(zt_db_t *db, uint64_t job_id, const zt_db_step_t *s) {
  sqlite3_stmt *st = db->st[ST_STEP_PUT];
  sqlite3_bind_int64(st, 1, (int64_t)job_id);
  bind(st, 2, k_step_cols, ZT_ARRAY_LEN(k_step_cols), s);
  return run(db, st, "store step");
}

int zt_db_steps_each(zt_db_t *db, uint64_t job_id, int64_t from, int64_t to, int limit,
                     zt_db_step_fn fn, void *user) {
  sqlite3_stmt *st = db->st[ST_STEPS_RANGE];
  sqlite3_bind_int64(st, 1, (int64_t)job_id);
  sqlite3_bind_int64(st, 2, from);
  sqlite3_bind_int64(st, 3, to);
  sqlite3_bind_int(st, 4, limit);
  rows_ctx x = {ROW_STEP, {.step = fn}, user};
  return each_row(db, st, "list steps", typed_row, &x);
}

int zt_db_ckpt_put(zt_db_t *db, uint64_t job_id, const zt_db_ckpt_t *k) {
  sqlite3_stmt *st = db->st[ST_CKPT_PUT];
  sqlite3_bind_int64(st, 1, (int64_t)job_id);
  bind(st, 2, k_ckpt_cols, ZT_ARRAY_LEN(k_ckpt_cols), k);
  return run(db, st, "store checkpoint");
}

int zt_db_ckpts_each(zt_db_t *db, uint64_t job_id, zt_db_ckpt_fn fn, void *user) {
  sqlite3_stmt *st = db->st[ST_CKPTS_JOB];
  sqlite3_bind_int64(st, 1, (int64_t)job_id);
  rows_ctx x = {ROW_CKPT, {.ckpt = fn}, user};
  return each_row(db, st, "list checkpoints", typed_row, &x);
}

/* Binds (job, step, gen) to parameters 1..3. */
static void bind_epoch(sqlite3_stmt *st, uint64_t job_id, int64_t step, uint64_t gen) {
  sqlite3_bind_int64(st, 1, (int64_t)job_id);
  sqlite3_bind_int64(st, 2, step);
  sqlite3_bind_int64(st, 3, (int64_t)gen);
}

int zt_db_ckpt_files_put(zt_db_t *db, uint64_t job_id, int64_t step, uint64_t gen,
                         const zt_db_ckpt_file_t *files, int n) {
  bind_epoch(db->st[ST_CKPT_FILES_DEL], job_id, step, gen);
  if (run(db, db->st[ST_CKPT_FILES_DEL], "clear checkpoint files") != 0) return -1;
  for (int i = 0; i < n; i++) {
    sqlite3_stmt *st = db->st[ST_CKPT_FILE_PUT];
    bind_epoch(st, job_id, step, gen);
    bind(st, 4, k_file_cols, ZT_ARRAY_LEN(k_file_cols), &files[i]);
    if (run(db, st, "store checkpoint file") != 0) return -1;
  }
  return 0;
}

typedef struct {
  zt_db_ckpt_file_t *files;
  int max, n;
} files_ctx;

static int file_row(sqlite3_stmt *st, void *p) {
  files_ctx *x = p;
  if (x->n < x->max) decode(st, 0, k_file_cols, ZT_ARRAY_LEN(k_file_cols), &x->files[x->n]);
  x->n++;
  return 0;
}

int zt_db_ckpt_files_get(zt_db_t *db, uint64_t job_id, int64_t step, uint64_t gen,
                         zt_db_ckpt_file_t *files, int max, int *n) {
  sqlite3_stmt *st = db->st[ST_CKPT_FILES_GET];
  bind_epoch(st, job_id, step, gen);
  files_ctx x = {files, max, 0};
  int rc = each_row(db, st, "list checkpoint files", file_row, &x);
  *n = x.n;
  return rc;
}

typedef struct {
  uint64_t *job_id;
  zt_db_ckpt_t *k;
  int *found;
} find_ctx;

static int found_row(sqlite3_stmt *st, void *p) {
  find_ctx *x = p;
  decode(st, 0, k_ckpt_cols, ZT_ARRAY_LEN(k_ckpt_cols), x->k);
  *x->job_id = (uint64_t)sqlite3_column_int64(st, (int)ZT_ARRAY_LEN(k_ckpt_cols));
  *x->found = 1;
  return 0;
}

int zt_db_ckpt_find_dir(zt_db_t *db, const char *dir, uint64_t *job_id, zt_db_ckpt_t *k,
                        int *found) {
  sqlite3_stmt *st = db->st[ST_CKPT_FIND_DIR];
  sqlite3_bind_text(st, 1, dir, -1, SQLITE_STATIC);
  *found = 0;
  find_ctx x = {job_id, k, found};
  return each_row(db, st, "find checkpoint", found_row, &x);
}

/* ---- copies of checkpoint files, and epochs to delete (schema version 7) ---- */

int zt_db_copy_add(zt_db_t *db, uint64_t job_id, int64_t step, uint64_t gen, const char *name,
                   uint64_t worker_id) {
  sqlite3_stmt *st = db->st[ST_COPY_ADD];
  bind_epoch(st, job_id, step, gen);
  sqlite3_bind_text(st, 4, name, -1, SQLITE_STATIC);
  sqlite3_bind_int64(st, 5, (int64_t)worker_id);
  return run(db, st, "record a checkpoint copy");
}

typedef struct {
  zt_db_copy_fn fn;
  void *user;
} copies_ctx;

static int copy_row(sqlite3_stmt *st, void *p) {
  copies_ctx *x = p;
  const unsigned char *name = sqlite3_column_text(st, 0);
  return x->fn((const char *)(name ? name : (const unsigned char *)""),
               (uint64_t)sqlite3_column_int64(st, 1), x->user);
}

int zt_db_copies_each(zt_db_t *db, uint64_t job_id, int64_t step, uint64_t gen, zt_db_copy_fn fn,
                      void *user) {
  sqlite3_stmt *st = db->st[ST_COPIES_EPOCH];
  bind_epoch(st, job_id, step, gen);
  copies_ctx x = {fn, user};
  return each_row(db, st, "list checkpoint copies", copy_row, &x);
}

int zt_db_copies_drop(zt_db_t *db, uint64_t job_id, int64_t step, uint64_t gen) {
  bind_epoch(db->st[ST_COPIES_DEL], job_id, step, gen);
  return run(db, db->st[ST_COPIES_DEL], "drop checkpoint copies");
}

int zt_db_deletion_add(zt_db_t *db, uint64_t worker_id, const char *dir) {
  sqlite3_stmt *st = db->st[ST_DELETION_ADD];
  sqlite3_bind_int64(st, 1, (int64_t)worker_id);
  sqlite3_bind_text(st, 2, dir, -1, SQLITE_STATIC);
  return run(db, st, "record an epoch to delete");
}

typedef struct {
  char (*dirs)[ZT_DB_DIR_MAX];
  int max, n;
} dirs_ctx;

static int dir_row(sqlite3_stmt *st, void *p) {
  dirs_ctx *x = p;
  const unsigned char *d = sqlite3_column_text(st, 0);
  if (x->n < x->max) snprintf(x->dirs[x->n++], ZT_DB_DIR_MAX, "%s", d ? (const char *)d : "");
  return 0;
}

int zt_db_deletions_of(zt_db_t *db, uint64_t worker_id, char (*dirs)[ZT_DB_DIR_MAX], int max,
                       int *n) {
  sqlite3_stmt *st = db->st[ST_DELETIONS_OF];
  sqlite3_bind_int64(st, 1, (int64_t)worker_id);
  sqlite3_bind_int(st, 2, max);
  dirs_ctx x = {dirs, max, 0};
  int rc = each_row(db, st, "list epochs to delete", dir_row, &x);
  *n = x.n;
  return rc;
}

typedef struct {
  int (*fn)(uint64_t, void *);
  void *user;
} ids_ctx;

static int id_row(sqlite3_stmt *st, void *p) {
  ids_ctx *x = p;
  return x->fn((uint64_t)sqlite3_column_int64(st, 0), x->user);
}

int zt_db_deletion_workers(zt_db_t *db, int (*fn)(uint64_t worker_id, void *user), void *user) {
  ids_ctx x = {fn, user};
  return each_row(db, db->st[ST_DELETION_WORKERS], "list workers with epochs to delete", id_row,
                  &x);
}

int zt_db_deletion_done(zt_db_t *db, uint64_t worker_id, const char *dir) {
  sqlite3_stmt *st = db->st[ST_DELETION_DONE];
  sqlite3_bind_int64(st, 1, (int64_t)worker_id);
  sqlite3_bind_text(st, 2, dir, -1, SQLITE_STATIC);
  return run(db, st, "forget a deleted epoch");
}
