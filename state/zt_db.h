/*
 * zt_db.h: the coordinator's durable state in one SQLite file.
 *
 * Only zcoord links this module. The schema is versioned with SQLite's
 * user_version and upgraded by an ordered list of migrations at open, each
 * in its own transaction. The database runs in WAL mode with
 * synchronous=NORMAL; every state change that must survive a
 * crash (a worker transition and its logbook event) is written in one
 * transaction through zt_db_begin()/zt_db_commit().
 *
 * Worker liveness (last_seen) is kept in memory by the coordinator and
 * flushed here in batches (zt_db_workers_touch), so heartbeats cost no disk
 * write each.
 */
#ifndef ZT_DB_H
#define ZT_DB_H

#include <stdint.h>

#include "zt_common.h"

typedef struct zt_db zt_db_t;

/* Worker states; the numbers match ztrain.proto's WorkerState. */
typedef enum {
  ZT_WORKER_UNKNOWN = 0,
  ZT_WORKER_ALIVE = 1,
  ZT_WORKER_SUSPECT = 2,
  ZT_WORKER_LOST = 3,
  ZT_WORKER_LEFT = 4,
} zt_worker_state_t;


typedef struct {
  uint64_t id;
  char name[128];
  char host[128];
  char device[32];
  int state;
  int64_t last_seen_ms; /* wall clock */
  int64_t registered_ms;
  int pid;
  char session[72];        /* this registration's credential (hex) */
  uint64_t host_memory;    /* bytes of RAM the worker may use */
  uint64_t device_memory;  /* bytes of its GPU's memory (0: CPU worker) */
  char store_addr[96];     /* HOST:PORT of its replica store (schema 7) */
} zt_db_worker_t;

typedef struct {
  int64_t id;
  int64_t t_ms;
  uint64_t job_id;
  char kind[64];
  uint64_t worker_id;
  char detail[512]; /* the first occurrence's, at t_ms */
  int64_t count;    /* occurrences collapsed into this row (1: none) */
  int64_t last_ms;  /* wall clock of the latest (0: count 1) */
  char last_detail[512]; /* the latest occurrence's, at last_ms ("": count 1; schema 8) */
} zt_db_event_t;

/* Opens (or creates) the database at path. Refused, with a message that
 * says what to do, when:
 *   - another process holds the database (an exclusive flock on
 *     <path>.lock, which names the holder's pid): two coordinators on one
 *     database would fight;
 *   - the file exists but is empty (a truncated database would otherwise
 *     start over silently); ZT_DB_NEW_IF_EMPTY accepts it as a new one;
 *   - its header is not SQLite's (damaged, or another kind of file), or
 *     SQLite's integrity_check finds damage (the message names it and
 *     the restore procedure of docs/deploy.md);
 *   - its schema is newer than this binary's.
 * Nothing in a refused file is changed. The file is made private (0600):
 * it holds worker session credentials. */
#define ZT_DB_NEW_IF_EMPTY 1u
ZT_MUST_CHECK int zt_db_open(const char *path, unsigned flags, zt_db_t **out);
void zt_db_close(zt_db_t *db);
int zt_db_schema_version(zt_db_t *db);
int zt_db_schema_latest(void); /* the version this binary migrates to */
const char *zt_db_path(zt_db_t *db);

ZT_MUST_CHECK int zt_db_begin(zt_db_t *db);
ZT_MUST_CHECK int zt_db_commit(zt_db_t *db);
void zt_db_rollback(zt_db_t *db);

ZT_MUST_CHECK int zt_db_meta_get(zt_db_t *db, const char *key, int64_t *val, int64_t def);
ZT_MUST_CHECK int zt_db_meta_set(zt_db_t *db, const char *key, int64_t val);

/* Inserts or updates the worker named w->name; sets w->id. */
ZT_MUST_CHECK int zt_db_worker_upsert(zt_db_t *db, zt_db_worker_t *w);
ZT_MUST_CHECK int zt_db_worker_set_state(zt_db_t *db, uint64_t id, int state, int64_t last_seen_ms);
/* Writes many last_seen values in one transaction. */
ZT_MUST_CHECK int zt_db_workers_touch(zt_db_t *db, const uint64_t *ids, const int64_t *last_seen, int n);
typedef int (*zt_db_worker_fn)(const zt_db_worker_t *w, void *user);
ZT_MUST_CHECK int zt_db_workers_each(zt_db_t *db, zt_db_worker_fn fn, void *user);

ZT_MUST_CHECK int zt_db_event_add(zt_db_t *db, uint64_t job_id, const char *kind, uint64_t worker_id,
                    const char *detail, int64_t *id_out);
/* One more occurrence of event `id`: count + 1, the time and this detail. */
ZT_MUST_CHECK int zt_db_event_repeat(zt_db_t *db, int64_t id, const char *detail);
typedef int (*zt_db_event_fn)(const zt_db_event_t *e, void *user);
/* Events with id > after_id, oldest first, at most `limit` (0: 1000), or
 * with limit < 0 the newest -limit of them, still oldest first; job_id 0:
 * all. */
ZT_MUST_CHECK int zt_db_events_each(zt_db_t *db, uint64_t job_id, int64_t after_id, int limit, zt_db_event_fn fn,
                      void *user);

/* ---- jobs (schema version 2) ---------------------------------------------- */

/* The rollback history a job keeps: enough for any rollback budget the spec
 * allows (rollback.max_rollbacks <= 1000). */
#define ZT_MAX_ROLLBACK_STEPS 1024

/* Job states; the numbers match ztrain.proto's JobState. */
typedef enum {
  ZT_JOB_UNKNOWN = 0,
  ZT_JOB_PENDING = 1,
  ZT_JOB_RUNNING = 2,
  ZT_JOB_RECONFIGURING = 3,
  ZT_JOB_COMPLETED = 4,
  ZT_JOB_FAILED = 5,
  ZT_JOB_PAUSED = 6,
  ZT_JOB_CANCELED = 7,
} zt_job_state_t;

/* 1 for the final states (completed, failed, canceled); a paused job may
 * still be resumed. */
static inline int zt_db_job_ended(int state) {
  return state == ZT_JOB_COMPLETED || state == ZT_JOB_FAILED || state == ZT_JOB_CANCELED;
}


typedef struct {
  uint64_t id;
  char name[128];
  const char *spec; /* JSON text; owned by the caller (insert) or valid in the callback */
  int state;
  uint64_t generation;
  int world;
  int64_t step, total_steps;
  int min_workers, max_workers;
  int64_t created_ms, updated_ms;
  char message[512];
  int restarts;
  /* Rollback state (schema version 4). */
  zt_range_list_t skips;     /* sample-stream positions skipped, sorted */
  double lr_factor;          /* LR multiplier for steps <= lr_until */
  int64_t lr_until;
  int rollbacks;
  /* The steps at which the newest rollbacks happened, oldest first (the
   * rollback budget counts those within a window). */
  int n_rollback_steps;
  int64_t rollback_steps[ZT_MAX_ROLLBACK_STEPS];
} zt_db_job_t;

typedef struct {
  int64_t step;
  uint64_t generation;
  double loss, grad_norm, lr, tokens_per_s, val_loss; /* val_loss NaN: none */
  int64_t t_ms;
} zt_db_step_t;

ZT_MUST_CHECK int zt_db_job_insert(zt_db_t *db, zt_db_job_t *j); /* sets j->id */
ZT_MUST_CHECK int zt_db_job_update(zt_db_t *db, const zt_db_job_t *j);
typedef int (*zt_db_job_fn)(const zt_db_job_t *j, void *user);
ZT_MUST_CHECK int zt_db_jobs_each(zt_db_t *db, zt_db_job_fn fn, void *user);
/* Records generation `gen` of a job and its members (worker_ids by rank). */
ZT_MUST_CHECK int zt_db_generation_add(zt_db_t *db, uint64_t job_id, uint64_t gen, int world, int64_t start_step,
                         const char *reason, const uint64_t *worker_ids);
/* The step a generation starts from, when it is not the one recorded
 * (a start from memory: docs/zero.md). */
ZT_MUST_CHECK int zt_db_generation_start(zt_db_t *db, uint64_t job_id, uint64_t gen, int64_t start_step);
ZT_MUST_CHECK int zt_db_generation_members(zt_db_t *db, uint64_t job_id, uint64_t gen, uint64_t *worker_ids,
                             int max, int *n);
/* Stores a step's metrics; a replayed step (after a reload) replaces the row. */
ZT_MUST_CHECK int zt_db_step_put(zt_db_t *db, uint64_t job_id, const zt_db_step_t *s);
typedef int (*zt_db_step_fn)(const zt_db_step_t *s, void *user);
/* Steps from..to of a job, in step order, at most `limit` (a negative
 * limit: all). */
ZT_MUST_CHECK int zt_db_steps_each(zt_db_t *db, uint64_t job_id, int64_t from, int64_t to,
                                   int limit, zt_db_step_fn fn, void *user);

/* ---- checkpoint epochs (schema version 3) --------------------------------- */

typedef enum { ZT_CKPT_PENDING = 0, ZT_CKPT_COMMITTED = 1, ZT_CKPT_DELETED = 2 } zt_ckpt_state_t;


typedef struct {
  int64_t step;
  uint64_t generation;
  int world;
  char dir[ZT_PATH_MAX];
  int state;
  uint64_t bytes;
  int64_t t_ms;
} zt_db_ckpt_t;

ZT_MUST_CHECK int zt_db_ckpt_put(zt_db_t *db, uint64_t job_id, const zt_db_ckpt_t *k);

/* One file of an epoch as its rank reported it (schema version 5). */
typedef struct {
  char name[64];
  uint64_t bytes;
  char checksum[32]; /* "xxh64:<16 hex>" */
} zt_db_ckpt_file_t;

/* Records the files of epoch (job, step, gen), replacing any earlier record. */
ZT_MUST_CHECK int zt_db_ckpt_files_put(zt_db_t *db, uint64_t job_id, int64_t step, uint64_t gen,
                                       const zt_db_ckpt_file_t *files, int n);
/* The recorded files of an epoch (at most max; *n is how many there are). */
ZT_MUST_CHECK int zt_db_ckpt_files_get(zt_db_t *db, uint64_t job_id, int64_t step, uint64_t gen,
                                       zt_db_ckpt_file_t *files, int max, int *n);
/* The committed epoch whose directory is `dir`, of any job: *found = 0 when
 * there is none. */
ZT_MUST_CHECK int zt_db_ckpt_find_dir(zt_db_t *db, const char *dir, uint64_t *job_id,
                                      zt_db_ckpt_t *k, int *found);
typedef int (*zt_db_ckpt_fn)(const zt_db_ckpt_t *k, void *user);
/* Every epoch of a job, oldest step first. */
ZT_MUST_CHECK int zt_db_ckpts_each(zt_db_t *db, uint64_t job_id, zt_db_ckpt_fn fn, void *user);

/* ---- copies of checkpoint files, and epochs to delete (schema version 7) ---- */

#define ZT_DB_DIR_MAX 512
/* Worker worker_id holds a copy of file `name` of the epoch (idempotent). */
ZT_MUST_CHECK int zt_db_copy_add(zt_db_t *db, uint64_t job_id, int64_t step, uint64_t gen,
                                 const char *name, uint64_t worker_id);
typedef int (*zt_db_copy_fn)(const char *name, uint64_t worker_id, void *user);
ZT_MUST_CHECK int zt_db_copies_each(zt_db_t *db, uint64_t job_id, int64_t step, uint64_t gen,
                                    zt_db_copy_fn fn, void *user);
ZT_MUST_CHECK int zt_db_copies_drop(zt_db_t *db, uint64_t job_id, int64_t step, uint64_t gen);
/* Epoch directories (relative to the checkpoint root) a worker is to
 * delete, until it reports them deleted. */
ZT_MUST_CHECK int zt_db_deletion_add(zt_db_t *db, uint64_t worker_id, const char *dir);
ZT_MUST_CHECK int zt_db_deletions_of(zt_db_t *db, uint64_t worker_id,
                                     char (*dirs)[ZT_DB_DIR_MAX], int max, int *n);
ZT_MUST_CHECK int zt_db_deletion_done(zt_db_t *db, uint64_t worker_id, const char *dir);
/* Calls fn once for each worker with an epoch to delete, in id order. */
ZT_MUST_CHECK int zt_db_deletion_workers(zt_db_t *db, int (*fn)(uint64_t worker_id, void *user),
                                         void *user);

#endif
