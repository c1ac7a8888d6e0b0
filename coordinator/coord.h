/*
 * coord.h: the coordinator's in-memory state, owned by one libuv loop.
 *
 * zcoord is a single-threaded program in the sense that matters: all state
 * below is read and written only on the loop thread. The gRPC completion
 * thread (common/rpc.c) and the HTTP threads (http.c) hand their work to the
 * loop, the first with uv_async, the second through zt_loopcall_run().
 *
 * Durable state lives in SQLite (state/); this struct is the cache the loop
 * works from, rebuilt from the database at start.
 */
#ifndef ZT_COORD_H
#define ZT_COORD_H

#include <pthread.h>
#include <stdint.h>
#include <uv.h>

#include "zt_common.h"
#include "spike.h"
#include "zt_db.h"
#include "zt_rpc.h"

#define ZT_VERSION "0.1.0"

typedef struct {
  char grpc_addr[256];
  char http_addr[256];
  char db_path[512];
  char web_dir[512];
  char worker_secret[256];
  char api_token[256];
  char ready_file[512]; /* written with the bound ports once serving */
  int heartbeat_ms;
  int heartbeat_timeout_ms;
  size_t max_message_bytes;
} zt_coord_config;

/* One worker as the loop sees it: its row plus liveness bookkeeping. */
typedef struct {
  zt_db_worker row;
  int64_t last_hb_mono_ms; /* monotonic time of the last heartbeat or register */
  uint64_t hb_seq;
  int dirty; /* last_seen not yet flushed to SQLite */
  int draining; /* leaving after the next committed checkpoint */
  int64_t quarantine_ms; /* a peer reported its connection dead at this time (0: none) */
  /* Assignment: the job generation this worker belongs to (0: idle). */
  uint64_t job_id, gen;
  int rank;
} zt_member;

#define ZT_MAX_WORLD 256

/* What the scheduler needs from a job spec (jobs.c). */
typedef struct {
  char name[128];
  int64_t steps, micro, global_batch; /* batches in samples */
  int min_workers, max_workers;
  int64_t comm_timeout_ms;
  int64_t seq_len; /* tokens per sample */
  char ckpt_dir[400]; /* empty: no checkpoints */
  char ckpt_load[512]; /* epoch to start from when the job has none of its own */
  int64_t ckpt_every, keep_last, keep_every;
  /* rollback{...} */
  int rb_enabled;
  int64_t rb_window, rb_patience, rb_margin, rb_skip, rb_cooldown, rb_max, rb_per_steps;
  double rb_threshold, rb_lr_factor;
} zt_job_params;

/* A job as the loop sees it: its row, parsed parameters, and the state of
 * the current generation's rendezvous. */
typedef struct zt_job {
  zt_db_job row;
  char *spec;
  zt_job_params p;
  uint64_t workers[ZT_MAX_WORLD]; /* worker id by rank, current generation */
  int64_t start_step;
  int64_t formed_ms;
  int arrived;
  struct zt_rpc_call *rdv[ZT_MAX_WORLD]; /* held Rendezvous calls by rank */
  char comm_addr[ZT_MAX_WORLD][64];
  zt_db_step last; /* last reported step */
  uint64_t ckpt_commits; /* epochs committed (since this zcoord started) */
  char start_ckpt[512]; /* committed epoch the current generation loads */
  /* Tally of the checkpoint epoch being reported (ckpt.c). */
  int64_t ck_step;
  uint64_t ck_gen;
  int ck_count;
  uint64_t ck_bytes;
  uint8_t ck_seen[ZT_MAX_WORLD];
  char ck_dir[512];
  /* Checkpoint-now requested (drain, scale-up); re-form after its commit. */
  int ckpt_request;
  char reform_reason[256];
  /* Rollback. */
  zt_spike det;
  int64_t poisoned_from; /* first step with a non-finite loss; 0: none */
  char rb_ckpt_dir[512]; /* forced start of the next generation */
  int64_t rb_ckpt_step;  /* -1: none forced */
  struct zt_job *next;
} zt_job;

/* Runs a function on the loop thread on behalf of another thread. */
typedef struct zt_loopcall_item zt_loopcall_item;
typedef struct {
  uv_async_t async;
  pthread_mutex_t mu;
  zt_loopcall_item *head;
  int closing;
} zt_loopcall_t;

typedef struct zt_http zt_http_t;

typedef struct zt_coord {
  zt_coord_config cfg;
  uv_loop_t *loop;
  zt_db_t *db;
  zt_rpc_server_t *rpc;
  zt_http_t *http;
  zt_loopcall_t loopcall;
  uv_timer_t check_timer, flush_timer, watchdog_timer;
  uv_signal_t sigint, sigterm;
  int64_t started_ms;
  int64_t epoch;

  /* Members indexed by worker id (ids are dense rowids), plus a name index. */
  zt_member **by_id;
  size_t by_id_cap;
  uint64_t *name_slots; /* open addressing: worker id or 0 */
  size_t name_cap;
  size_t n_members;

  zt_job *jobs; /* in submission order */
} zt_coord;

/* members.c */
int zt_members_load(zt_coord *c);
zt_member *zt_members_get(zt_coord *c, uint64_t id);
zt_member *zt_members_find_name(zt_coord *c, const char *name);
void zt_members_check(zt_coord *c);  /* suspect / lost transitions */
void zt_members_flush(zt_coord *c);  /* write last_seen of dirty members */
void zt_members_free(zt_coord *c);
void zt_members_count(zt_coord *c, uint32_t counts[5]);
/* Records a logbook event; logs (and survives) a database failure. */
void zt_coord_event(zt_coord *c, uint64_t job_id, const char *kind, uint64_t worker_id,
                    const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* Register / heartbeat / leave; return a gRPC status and a message. */
int zt_members_register(zt_coord *c, const char *name, const char *host, const char *device,
                        int pid, zt_member **out, char *msg, size_t msglen);
int zt_members_heartbeat(zt_coord *c, uint64_t id, zt_member **out, char *msg, size_t msglen);
int zt_members_leave(zt_coord *c, uint64_t id, const char *reason, char *msg, size_t msglen);

/* jobs.c */
struct Ztrain__RendezvousRequest;
struct Ztrain__ReportStepRequest;
struct Ztrain__ReportFailureRequest;
int zt_job_params_parse(const char *json, zt_job_params *p, char *err, size_t errlen);
int zt_jobs_load(zt_coord *c);
void zt_jobs_free(zt_coord *c);
void zt_jobs_release_calls(zt_coord *c); /* answers held calls before the server stops */
zt_job *zt_jobs_get(zt_coord *c, uint64_t id);
void zt_jobs_schedule(zt_coord *c);
void zt_jobs_member_gone(zt_coord *c, zt_member *m, const char *why);
int zt_jobs_submit(zt_coord *c, const char *spec, uint64_t *id, char *msg, size_t msglen);
void zt_jobs_rendezvous(zt_coord *c, zt_rpc_call_t *call,
                        const struct Ztrain__RendezvousRequest *req);
int zt_jobs_report_step(zt_coord *c, const struct Ztrain__ReportStepRequest *req, int *command,
                        char *msg, size_t msglen);
int zt_jobs_report_failure(zt_coord *c, const struct Ztrain__ReportFailureRequest *req, char *msg,
                           size_t msglen);
/* Operator actions: "pause", "resume", "cancel", "rollback". */
int zt_jobs_action(zt_coord *c, uint64_t job_id, const char *action, int64_t to_step,
                   int64_t skip_steps, char *msg, size_t msglen);
/* Drains a worker (by name or id): checkpoint, then leave its job. */
int zt_jobs_drain(zt_coord *c, zt_member *m, char *msg, size_t msglen);
/* Leave from a worker in a checkpointed job turns into a drain: returns 1
 * when the worker must keep going until told to stop. */
int zt_jobs_leave_drains(zt_coord *c, zt_member *m);
void zt_jobs_checkpoint_committed(zt_coord *c, zt_job *j);
int zt_jobs_heartbeat_command(zt_coord *c, zt_member *m, uint64_t job_id, uint64_t gen,
                              uint64_t *out_job, uint64_t *out_gen);

/* ckpt.c */
struct Ztrain__ReportCheckpointRequest;
int zt_ckpt_report(zt_coord *c, zt_job *j, zt_member *m,
                   const struct Ztrain__ReportCheckpointRequest *req, int *committed, char *msg,
                   size_t msglen);
int zt_ckpt_latest(zt_coord *c, zt_job *j, zt_db_ckpt *out, int *found);
void zt_ckpt_gc(zt_coord *c, zt_job *j);
void zt_ckpt_drop_after(zt_coord *c, zt_job *j, int64_t step);
int zt_ckpt_mark_bad(zt_coord *c, zt_job *j, const char *dir, const char *why);
int zt_jobs_rollback(zt_coord *c, zt_job *j, int64_t first_step, int64_t last_step,
                     int64_t max_ckpt_step, int64_t skip_steps, const char *why);
int zt_jobs_report_checkpoint(zt_coord *c, const struct Ztrain__ReportCheckpointRequest *req,
                              int *committed, char *msg, size_t msglen);

/* service.c */
struct Ztrain__JobInfo;
struct Ztrain__WorkerInfo;
void zt_coord_job_info(const zt_job *j, struct Ztrain__JobInfo *ji);
void zt_coord_worker_info(const zt_member *m, struct Ztrain__WorkerInfo *w);
void zt_coord_rpc_dispatch(zt_rpc_call_t *call, const char *method, const uint8_t *req,
                           size_t len, void *user);

/* http.c */
int zt_http_start(zt_coord *c, const char *addr, zt_http_t **out);
int zt_http_port(zt_http_t *h);
void zt_http_stop(zt_http_t *h);

/* loopcall.c */
int zt_loopcall_init(uv_loop_t *loop, zt_loopcall_t *lc);
int zt_loopcall_run(zt_loopcall_t *lc, void (*fn)(void *), void *arg);
void zt_loopcall_close(zt_loopcall_t *lc);

/* notify.c */
void zt_notify_ready(zt_coord *c);
void zt_notify_stopping(void);

#endif
