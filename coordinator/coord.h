/*
 * coord.h: the coordinator's in-memory state, owned by one libuv loop, and
 * the interfaces of its modules.
 *
 * zcoord is a single-threaded program in the sense that matters: all state
 * below is read and written only on the loop thread. The gRPC completion
 * thread (common/rpc.c) and the HTTP threads (http.c) hand their work to the
 * loop, the first with uv_async, the second through zt_loopcall_run().
 *
 * Durable state lives in SQLite (state/); these structs are the cache the
 * loop works from, rebuilt from the database at start.
 *
 * The files form a stack; each calls only the ones below it, never back
 * up (tools/check-layers verifies it on the object files). The drawing of
 * that stack, with a line for each file, is docs/architecture.md's ("The
 * coordinator, a stack of files"): one drawing, kept true by check-layers,
 * which fails on a file that page does not name. Members report what
 * happened to them (a worker lost, a worker that re-registered) to their
 * caller, and the entry points then tell the scheduler (sched.c); the
 * registry says an epoch committed, and reports.c acts on it.
 *
 * Errors: functions return 0 or -1 with the thread's error message and
 * kind (common/zt_common.h); service.c and http.c turn the kind into a
 * status code through one table.
 */
#ifndef ZT_COORD_H
#define ZT_COORD_H

#include <pthread.h>
#include <stdint.h>
#include <uv.h>

#include "memplan.h"
#include "reach.h"
#include "restarts.h"
#include "spike.h"
#include "zt_common.h"
#include "zt_db.h"
#include "zt_rpc.h"

typedef struct {
  char grpc_addr[256];
  char http_addr[256];
  char db_path[ZT_PATH_MAX];
  char web_dir[ZT_PATH_MAX];
  char worker_secret[256];
  char api_token[256];
  char ready_file[ZT_PATH_MAX]; /* written with the bound ports once serving */
  char data_root[ZT_PATH_MAX];  /* job data must lie under it (absolute) */
  char ckpt_root[ZT_PATH_MAX];  /* checkpoints must lie under it (absolute) */
  int heartbeat_ms;
  int heartbeat_timeout_ms;
  int heartbeat_capacity; /* members.c: heartbeats/s before the interval stretches; 0: never */
  int blind_max_ms;     /* members.c: blind, nobody is lost for this long */
  int new_db;           /* an existing empty database file is a new one */
  int insecure;         /* serve non-loopback addresses without credentials */
  int allow_test_knobs; /* accept specs with fault_injection */
  /* provision.c: the command run for workers ("" none), its deadline,
   * the least time between runs, and how long asked-for workers count as
   * coming. */
  char provisioner[ZT_PATH_MAX];
  int provisioner_timeout_ms, provisioner_interval_ms, provisioner_grace_ms;
  size_t max_message_bytes;
} zt_coord_config_t;

#define ZT_MEMBER_UNREACH 16 /* unreachable peers a member's report is remembered with */

/* One worker as the loop sees it: its row plus liveness bookkeeping. */
typedef struct {
  zt_db_worker_t row;
  int64_t last_hb_mono_ms; /* monotonic time of the last heartbeat or register */
  int64_t back_ms; /* monotonic time it registered again after it was lost (0: never) */
  uint64_t hb_seq;
  int dirty; /* last_seen not yet flushed to SQLite */
  int draining; /* leaving after the next committed checkpoint */
  /* The heartbeats in the call its last one came in: 1 (or 0, none yet)
   * its own call, k a machine agent's batch of k (its share of the
   * coordinator's calls is 1/k: zt_members_pace). */
  int hb_batch;
  /* It said at registration that it heartbeats through its machine's
   * agent: until its first batch arrives (hb_batch 0) the pace counts it
   * as one of a batch of the average size seen (zt_members_pace). */
  int hb_agent;
  /* It may have epochs to delete (copies.c): set when one is queued for
   * it, or at start when the database holds one; cleared when its list is
   * found empty. A heartbeat asks the database only when it is set, so
   * neither a mass registration nor a deletion queued for one worker
   * costs a query per member. */
  int deletions_pending;
  /* Heard from again while suspect, after this many ms of silence (0:
   * not): alive in memory at once, written with the next liveness
   * check's changes (members.c). */
  int64_t recovered_ms;
  /* Kept out of generations since (0: not): it may be cut off from the
   * others (reach.h). Let back in once a probe it was asked for after
   * that (probe_asked) reaches every other worker's store. */
  int64_t quarantine_ms;
  int probe_asked;
  /* The workers whose stores it could not reach when it last probed them
   * after a failed collective (ReportFailure.unreachable_ranks, by id; at
   * most ZT_MEMBER_UNREACH), and when (monotonic; 0: never). The stores of
   * those workers are the last it is told to fetch copies from (copies.c). */
  uint64_t unreach[ZT_MEMBER_UNREACH];
  int n_unreach;
  int64_t unreach_ms;
  /* Its per-step timings as its heartbeats last reported them (when it
   * trained; timing_ms: monotonic time of that report, 0: never). */
  double step_ms, comm_ms, send_wait_ms, link_rtt_ms;
  int64_t timing_ms;
  /* Assignment: the job generation this worker belongs to (0: idle). */
  uint64_t job_id, gen;
  int rank;
  /* It said at registration that its NCCL libraries load (not stored:
   * after a coordinator restart it counts as without, until it registers
   * again, and its generations use the ring). */
  int nccl;
  /* The credential this registration replaced, until the worker is heard
   * with the new one: if the reply that carried the new one was lost
   * (deadline, a connection cut), the worker asks again with the old one
   * and is let in, instead of waiting to be declared lost. Not stored. */
  char prev_session[sizeof(((zt_db_worker_t *)0)->session)];
} zt_member_t;

#define ZT_MAX_WORLD 256
#define ZT_MAX_EXCLUDED 16 /* workers kept out of one job (zt_job_t.excluded) */

/* What the scheduler needs from a job spec (params.c). */
typedef struct {
  char name[128];
  int64_t steps, micro, global_batch; /* batches in samples */
  int min_workers, max_workers;
  int64_t comm_timeout_ms;
  int64_t seq_len; /* tokens per sample */
  char ckpt_dir[ZT_PATH_MAX]; /* empty: no checkpoints; else resolved under checkpoint_root */
  char ckpt_load[ZT_PATH_MAX]; /* epoch to start from when the job has none of its own (resolved) */
  int64_t ckpt_every, keep_last, keep_every;
  /* rollback{...} */
  int rb_enabled;
  int64_t rb_window, rb_patience, rb_margin, rb_skip, rb_cooldown, rb_max, rb_per_steps;
  double rb_threshold, rb_lr_factor;
  zt_spec_restart_t restart;    /* elastic{...}: the restart policy */
  int zero_stage;
  /* DiLoCo's sync.group_size (1 otherwise): ranks g S .. g S + S - 1
   * train one model, so the ranks of one host are listed together
   * (sched.c). */
  int group_size;
  zt_memplan_need_t need[ZT_MAX_WORLD + 1]; /* per-rank memory by world size (valid sizes) */
  /* The world sizes in [min_workers, max_workers] the spec can train
   * (zt_spec_accum_for_world: dividing the step's micro-batches, or any up
   * to their number with load_balance mode "speed"). */
  unsigned char world_ok[ZT_MAX_WORLD + 1];
  int64_t max_uncommitted;      /* checkpoint.max_uncommitted_steps (0: no limit) */
  int replicas;                 /* checkpoint.replicas */
  int ckpt_shared;              /* checkpoint.shared: no copies tracked */
} zt_job_params_t;

/* 1 when n workers can form a generation of the job (world_ok). */
static inline int zt_params_world_ok(const zt_job_params_t *p, int n) {
  return n >= 1 && n <= ZT_MAX_WORLD && p->world_ok[n];
}

/* One file of the epoch being reported: as its rank wrote it, and the
 * machines (by index in the generation, zt_job_t.host_of) with a copy. */
typedef struct {
  zt_db_ckpt_file_t f;
  int written; /* its rank reported it (f is then authoritative) */
  uint8_t hosts[ZT_MAX_WORLD / 8];
} zt_registry_entry_t;

/* Epochs tallied at once per job: more than this in flight at the same
 * time and the oldest is given up (it does not commit; a newer one does). */
#define ZT_REGISTRY_TALLIES 4

/* The tally of one checkpoint epoch being reported (ckpt.c). */
typedef struct {
  int64_t step;
  uint64_t gen;
  int count;  /* ranks that reported their files */
  int failed; /* ranks that reported a failed write: the epoch cannot commit */
  int done;   /* committed, or dropped after a failure */
  char error[256]; /* the first failed write's error */
  uint64_t bytes;
  uint8_t seen[ZT_MAX_WORLD];
  char dir[ZT_PATH_MAX];
  zt_registry_entry_t files[3 * ZT_MAX_WORLD]; /* every rank's files, and their copies */
  int nfiles;
} zt_registry_tally_t;

/* A job as the loop sees it: its row, parsed parameters, and the state of
 * the current generation's rendezvous. */
typedef struct zt_job {
  zt_db_job_t row;
  char *spec;
  zt_job_params_t p;
  /* Why the stored spec fails this coordinator's checks ("" when it
   * passes): p is then unset, so the job is failed at load, never
   * scheduled and never resumed (jobs.c). */
  char spec_error[300];
  uint64_t workers[ZT_MAX_WORLD]; /* worker id by rank, current generation */
  uint8_t host_of[ZT_MAX_WORLD];  /* each rank's machine, as an index ... */
  int n_hosts;                    /* ... into the generation's distinct machines */
  int64_t start_step;
  int64_t formed_ms;
  /* sched.c: the end of the rejoin grace (0: none running), and when an
   * unloadable pause was last checked for a way out. */
  int64_t rejoin_until_ms, resume_check_ms;
  int reform_scale_up; /* the requested re-form is a scale-up (reform_reason) */
  int arrived;
  struct zt_rpc_call *rdv[ZT_MAX_WORLD]; /* held Rendezvous calls by rank */
  char comm_addr[ZT_MAX_WORLD][64];
  /* Recovery from memory (rendezvous.c): the state each arrived rank keeps
   * (RendezvousRequest.live_*), the last step stored when the generation
   * formed, and the step the generation starts from in memory (0: from
   * its epoch). */
  int64_t live_step[ZT_MAX_WORLD], live_from[ZT_MAX_WORLD];
  uint32_t live_rb[ZT_MAX_WORLD];
  int64_t reported_step, live_start;
  int live_source; /* 1 + the rank that sends it to the others; 0: all hold it */
  int forced_start; /* a rollback or a pause set the start epoch: never from memory */
  /* NCCL: every rank of the generation has a GPU of its own (choose_comm),
   * and the unique id rank 0 sent with its Rendezvous call ("" until then,
   * or when it sent none: the ring is used). */
  int nccl;
  char nccl_id[257];
  /* The TCP ring's key of the generation (RendezvousReply.comm_key): made
   * when its rendezvous completes, never stored (a new rendezvous makes a
   * new one). */
  char comm_key[65];
  zt_db_step_t last; /* last reported step */
  uint64_t ckpt_commits; /* epochs committed (since this zcoord started) */
  uint64_t outer_refused; /* DiLoCo outer steps refused (since this zcoord started) */
  char start_ckpt[ZT_PATH_MAX]; /* committed epoch the current generation loads */
  zt_db_ckpt_file_t *start_files; /* its recorded files (malloc'd) */
  int n_start_files;
  /* The epochs being reported (ckpt.c): ranks run ahead of each other, and
   * a pushed copy can come before its rank's report, so a few epochs are
   * tallied at once; allocated on first use, freed when the job ends. */
  zt_registry_tally_t *tallies[ZT_REGISTRY_TALLIES];
  zt_registry_tally_t *ck; /* the tally last reported to (its step, its error) */
  /* Checkpoint-now requested (drain, scale-up); re-form after its commit. */
  int ckpt_request;
  char reform_reason[256];
  /* Failures (restarts.h): the policy's state, and a re-form it put off. */
  zt_restarts_t rs;
  /* Workers kept out of this job after the same local error twice at one
   * step (ZT_RESTART_EXCLUDE), by id and the session they had then: one
   * that registers again (a new session) is let back, and an operator's
   * resume lets every one back. Not stored. */
  struct {
    uint64_t id;
    char session[sizeof(((zt_db_worker_t *)0)->session)];
  } excluded[ZT_MAX_EXCLUDED];
  int n_excluded;
  int64_t retry_at_ms; /* monotonic; 0: none */
  char retry_reason[400];
  /* Who is cut off: the current generation's reachability reports. */
  zt_reach_t reach;
  /* Checkpoint writes failing (disk full): training goes on, within the
   * risk budget of steps past safe_step (the newest step the job can resume
   * from: its last committed epoch, or where its generation started). */
  int ckpt_paused;
  char ckpt_error[300];
  int64_t safe_step;
  /* A job paused for failing checkpoint writes retries by itself, backed
   * off (sched.c): the retries so far (0 again after a commit) and when
   * the next is due (monotonic; 0: not scheduled yet). */
  int storage_retries;
  int64_t storage_retry_ms;
  /* The end: the newest committed epoch (for views), and while the last
   * step's epoch is awaited, until when (monotonic; 0: not awaiting). */
  int64_t committed_step;
  int64_t committed_wall_ms; /* when it committed (wall clock; 0: none) */
  int64_t final_by_ms;
  /* Rollback. */
  zt_spike_t det;
  int64_t poisoned_from; /* first step with a non-finite loss; 0: none */
  char rb_ckpt_dir[ZT_PATH_MAX]; /* forced start of the next generation */
  int64_t rb_ckpt_step;  /* -1: none forced */
  /* Failed writes of the row since its last stored one: while not 0,
   * memory is ahead of SQLite, until zt_jobs_flush (every few seconds)
   * stores it. */
  int64_t save_failures;
  struct zt_job *next;
} zt_job_t;

/* The repeat cache of the logbook (events.c): the last event of one
 * (job, kind, worker) of a kind that failing loops repeat. */
typedef struct {
  uint64_t job_id, worker_id;
  char kind[32];
  uint64_t shape;    /* hash of zt_text_shape(detail) */
  int64_t id, count; /* its row, and how many it stands for */
  int64_t last_mono_ms;
} zt_event_slot_t;

/* Runs a function on the loop thread on behalf of another thread. */
typedef struct zt_loopcall_item zt_loopcall_item_t;
typedef struct {
  uv_async_t async;
  pthread_mutex_t mu;
  zt_loopcall_item_t *head;
  int closing;
} zt_loopcall_t;

typedef struct zt_http zt_http_t;

typedef struct zt_prov zt_prov_t; /* provision.c */

typedef struct zt_coord {
  zt_coord_config_t cfg;
  uv_loop_t *loop;
  zt_db_t *db;
  zt_rpc_server_t *rpc;
  zt_http_t *http;
  zt_loopcall_t loopcall;
  uv_timer_t check_timer, flush_timer, watchdog_timer;
  uv_signal_t sigint, sigterm;
  int64_t started_ms;
  int64_t epoch;
  int64_t last_check_ms, max_stall_ms; /* the loop's liveness timer and its longest delay */
  /* The longest a received call had waited for the loop, seen by the
   * liveness check (zt_rpc_server_lag_ms); registrations refused because
   * theirs had waited more than ZT_REGISTER_BEHIND_MS (service.c). */
  int64_t max_lag_ms;
  uint64_t register_shed;
  /* members.c: monotonic time of the last heartbeat from any worker, and
   * the periods in which the coordinator heard from no worker at all
   * while two or more were alive (its own network, most likely). */
  int64_t last_any_hb_ms;
  uint64_t blind_periods;
  int64_t blind_max_ms; /* the longest such period */
  /* members.c, "Pace": the heartbeat interval advertised now, the one
   * silences are judged by (the longest advertised within a timeout), and
   * until when that one holds. */
  int64_t hb_interval_ms, hb_judge_ms, hb_judge_until_ms;
  uint64_t hb_pace_changes;
  /* Registrations ever, and their recent rate per second (members.c,
   * Pace: a registering fleet takes part of the capacity). */
  uint64_t registrations, reg_rate_n;
  int64_t reg_rate_ms;
  double reg_rate;
  /* Heartbeat calls by kind (Heartbeat; HeartbeatBatch) and the entries the
   * batches carried (service.c). */
  uint64_t hb_calls[2], hb_batch_entries;
  zt_prov_t *prov; /* provision.c; NULL without a provisioner */
  /* Workers that registered new or came back (lost or left before), ever:
   * the provisioner counts the workers it asked for by them. */
  uint64_t arrivals;
  size_t flush_cursor; /* members.c: where the next slice of last_seen writes starts */
  uint64_t flush_ticks; /* main.c's flush timer */
  zt_event_slot_t ev_slots[64];        /* events.c */

  /* Members indexed by worker id (ids are dense rowids), plus a name index. */
  zt_member_t **by_id;
  size_t by_id_cap;
  uint64_t *name_slots; /* open addressing: worker id or 0 */
  size_t name_cap;
  size_t n_members;

  zt_job_t *jobs; /* in submission order */
} zt_coord_t;

/* ---- jobs.c: submit, load at start, operator actions ------------------------- */

/* Operator actions on a job. */
typedef enum { ZT_ACT_PAUSE, ZT_ACT_RESUME, ZT_ACT_CANCEL, ZT_ACT_ROLLBACK } zt_job_action_t;
/* "pause", "resume", "cancel", "rollback"; -1 (ZT_E_INVALID) otherwise. */
int zt_jobs_action_parse(const char *name, zt_job_action_t *out);
int zt_jobs_load(zt_coord_t *c);
void zt_jobs_free(zt_coord_t *c);
int zt_jobs_submit(zt_coord_t *c, const char *spec, uint64_t *id);
/* An operator action; on success msg says what happens. */
int zt_jobs_action(zt_coord_t *c, uint64_t job_id, zt_job_action_t action, int64_t to_step,
                   int64_t skip_steps, char *msg, size_t msglen);
/* Drains a worker: checkpoint, then leave its job; msg says what happens. */
int zt_jobs_drain(zt_coord_t *c, zt_member_t *m, char *msg, size_t msglen);
/* Leave from a worker in a checkpointed job turns into a drain: returns 1
 * when the worker must keep going until told to stop. */
int zt_jobs_leave_drains(zt_coord_t *c, zt_member_t *m);

/* ---- reports.c: what the ranks report ---------------------------------------- */

struct Ztrain__ReportStepRequest;
struct Ztrain__ReportFailureRequest;
struct Ztrain__ReportCheckpointRequest;
struct Ztrain__ReportReplicaRequest;

/* Rank 0's step; *command is the reply's (continue, checkpoint now,
 * rollback, stop). */
int zt_reports_step(zt_coord_t *c, const struct Ztrain__ReportStepRequest *req, int *command);
int zt_reports_failure(zt_coord_t *c, const struct Ztrain__ReportFailureRequest *req);
int zt_reports_checkpoint(zt_coord_t *c, const struct Ztrain__ReportCheckpointRequest *req,
                          int *committed);
/* A worker holds a copy of a checkpoint file (pushed to it, or fetched). */
int zt_reports_replica(zt_coord_t *c, const struct Ztrain__ReportReplicaRequest *req,
                       int *committed);

/* ---- rollback.c: back to a committed epoch ----------------------------------- */

/* Feeds rank 0's step to the spike detector (when rollback is on); 1 when
 * it spiked and the job rolled back (or paused, past the budget). */
int zt_rollback_spike(zt_coord_t *c, zt_job_t *j, int64_t step, double loss, double grad_norm);
/* An operator's rollback to the newest epoch at or before to_step,
 * skipping skip_steps batches after it; not budgeted. msg says what
 * happens. */
int zt_rollback_operator(zt_coord_t *c, zt_job_t *j, int64_t to_step, int64_t skip_steps,
                         char *msg, size_t msglen);

/* ---- sched.c: the scheduler -------------------------------------------------- */

/* One pass over every job (the liveness timer, and after anything that
 * frees or adds workers): forms generations for pending jobs and due
 * retries, decides pending reachability verdicts, ends a job whose final
 * epoch committed or did not in time, and asks for a checkpoint to scale
 * up. */
void zt_sched_run(zt_coord_t *c);
/* A member left its generation: lost or restarted (failure 1, which the
 * restart policy counts), left or drained (failure 0). */
void zt_sched_member_gone(zt_coord_t *c, zt_member_t *m, const char *why, int failure);
/* The job's restored state after a coordinator restart: its current
 * generation's members get their ranks back, the epoch it started from,
 * the wait for a final epoch (jobs.c, at load). */
void zt_sched_reload(zt_coord_t *c, zt_job_t *j);
/* Forms the job's next generation now, or sends it back to PENDING
 * (comment at its definition). */
void zt_sched_try_form(zt_coord_t *c, zt_job_t *j, const char *reason);
/* The current generation failed (who: the worker whose report it was, or
 * NULL): re-form, now or later, or pause, as the restart policy says. */
void zt_sched_fail_generation(zt_coord_t *c, zt_job_t *j, zt_fail_kind_t kind, int64_t step,
                              const char *reason, zt_member_t *who);
/* The verdict on the current generation's reachability reports: the ranks
 * out are kept out (until they reach the others again), then the
 * generation fails as the restart policy says. */
void zt_sched_judge_reach(zt_coord_t *c, zt_job_t *j);
/* Ends the current generation (its calls answered, its members idle) and
 * moves the job to state, with the message fmt, in the row and the
 * logbook (event kind). A final state forgets the epoch tallies. */
void zt_sched_finish(zt_coord_t *c, zt_job_t *j, int state, const char *kind, const char *fmt,
                     ...) __attribute__((format(printf, 5, 6)));
/* The last step is done: the workers write the final epoch (trainer.c) and
 * the job completes when it commits (zt_sched_epoch_committed), when its
 * write fails (zt_sched_final_failed), or after a while without either. */
void zt_sched_await_final(zt_coord_t *c, zt_job_t *j);
/* The final epoch failed to write, or did not commit in time: the job
 * completes without it. */
void zt_sched_final_failed(zt_coord_t *c, zt_job_t *j, const char *why);
/* The epoch j->ck committed: the job completes when it was the final one,
 * else a re-form that waited for it (drain, scale-up) happens now. */
void zt_sched_epoch_committed(zt_coord_t *c, zt_job_t *j);
/* The job pauses for failing checkpoint writes: schedules its next
 * automatic retry and says in how many seconds (0: the retries are spent,
 * it waits for zctl resume). */
int zt_sched_storage_backoff(zt_job_t *j, int64_t now);
/* Such a pause's message starts with this (the mark that survives a
 * restart); the retries wait 10 s, 20 s, ... up to 300 s, six in all
 * (about ten minutes). */
#define ZT_STORAGE_PAUSE "paused: no checkpoint committed for"
#define ZT_STORAGE_RETRIES 6
/* A job paused because no committed epoch could be loaded (their copies
 * were on machines that were gone) resumes by itself once one can be
 * loaded again: the holders are back (sched.c checks at most once a
 * second). The pause's message is what marks it, so this holds across a
 * restart. */
#define ZT_UNLOADABLE_PAUSE "paused: no committed checkpoint can be loaded"

/* ---- rendezvous.c: the ranks of a new generation meet ------------------------ */

struct Ztrain__RendezvousRequest;

/* Holds the call until every rank arrived (a long poll); answers it. */
void zt_rdv_arrive(zt_coord_t *c, zt_rpc_call_t *call,
                   const struct Ztrain__RendezvousRequest *req);
/* Answers every held call of the job with status and why. */
void zt_rdv_release(zt_job_t *j, int status, const char *why);
void zt_rdv_release_all(zt_coord_t *c); /* answers held calls before the server stops */
/* 1 when m is rank 0 of an NCCL generation (it makes the unique id). */
int zt_rdv_nccl_root(zt_coord_t *c, const zt_member_t *m);

/* ---- jobtable.c: jobs by id, the writes of their rows, fencing --------------- */

zt_job_t *zt_jobtable_get(zt_coord_t *c, uint64_t id);
/* PENDING, RUNNING or RECONFIGURING. */
int zt_jobtable_active(const zt_job_t *j);
/* Writes the job's row. A failure is logged and returned; the in-memory
 * state stays ahead of the database until the next successful write, made
 * at the latest by zt_jobtable_flush a few seconds later. */
int zt_jobtable_save(zt_coord_t *c, zt_job_t *j);
/* The message of a running job: its generation and world, and whether
 * checkpointing is paused, with the reason (not saved). */
void zt_jobtable_running_message(zt_job_t *j);
/* Stores row, the job's row as an action would leave it, before the action
 * changes anything; -1 (ZT_E_UNAVAILABLE) when the write fails. */
int zt_jobtable_store_first(zt_coord_t *c, zt_job_t *j, zt_db_job_t *row, const char *action);
/* Writes again every job row whose last write failed. */
void zt_jobtable_flush(zt_coord_t *c);
/* Checks that a worker-facing call names the current generation: its job
 * and member, or -1 (ZT_E_NOT_FOUND, ZT_E_STATE: the worker rejoins). */
int zt_jobtable_fence(zt_coord_t *c, uint64_t wid, uint64_t job_id, uint64_t gen,
                      zt_job_t **jout, zt_member_t **mout);
/* The command of a heartbeat that names (job_id, gen): RECONFIGURE to the
 * member's assignment (*out_job, *out_gen), STOP, or CONTINUE. */
int zt_jobtable_heartbeat_command(zt_coord_t *c, zt_member_t *m, uint64_t job_id, uint64_t gen,
                                  uint64_t *out_job, uint64_t *out_gen);

/* ---- params.c: a spec's scheduling parameters -------------------------------- */

/* The scheduler's view of a spec, checked against the coordinator's
 * settings (paths under the roots, test knobs, a valid world size). */
int zt_params_parse(const char *json, const zt_coord_config_t *cfg, zt_job_params_t *p);

/* ---- ckpt.c: the checkpoint registry ----------------------------------------- */

/* What one rank's report of an epoch did. */
typedef enum {
  ZT_REGISTRY_REPORT_COUNTED,   /* counted; the epoch waits for more ranks */
  ZT_REGISTRY_REPORT_COMMITTED, /* the last one: the epoch is committed in SQLite */
  ZT_REGISTRY_REPORT_FAILED,    /* the first failed write of the epoch: it cannot commit */
} zt_registry_outcome_t;
/* A worker stored a copy of file f of the epoch in dir (absolute under our
 * root): counted toward the epoch being written (*out may say COMMITTED),
 * or checked against a committed epoch's record, and recorded. */
int zt_registry_report_copy(zt_coord_t *c, zt_job_t *j, zt_member_t *m, const char *dir,
                        const zt_db_ckpt_file_t *f, zt_registry_outcome_t *out);
/* Frees the job's epoch tallies (a job that ended reports no more). */
void zt_registry_forget(zt_job_t *j);
/* Counts one rank's report of the epoch being written (its files, or the
 * error of its failed write). On REPORT_COMMITTED the caller applies retention
 * and acts on the commit; on REPORT_FAILED it decides what the job does without
 * that epoch. An epoch with a failed write is deleted once every rank has
 * reported. */
int zt_registry_report(zt_coord_t *c, zt_job_t *j, zt_member_t *m,
                   const struct Ztrain__ReportCheckpointRequest *req, zt_registry_outcome_t *out);
/* The newest committed epoch of a job at or before max_step (INT64_MAX:
 * any), with need_loadable the newest whose every file a live worker can
 * serve (copies.c; an epoch skipped for that is logged); *found = 0 when
 * there is none. */
int zt_registry_newest(zt_coord_t *c, zt_job_t *j, int64_t max_step, int need_loadable,
                   zt_db_ckpt_t *out, int *found);
/* Deletes again the failed epochs of the current generation whose
 * deletion the database refused (called every few seconds). */
void zt_registry_retry_drops(zt_coord_t *c, zt_job_t *j);
/* Applies retention and removes pending epochs that can never commit. */
void zt_registry_gc(zt_coord_t *c, zt_job_t *j);
/* Deletes every epoch after `step` (a rollback abandons them). */
void zt_registry_drop_after(zt_coord_t *c, zt_job_t *j, int64_t step);
/* Retires a committed epoch that failed to load; -1 when `dir` is not one
 * of the job's own epochs. */
int zt_registry_mark_bad(zt_coord_t *c, zt_job_t *j, const char *dir, const char *why);
/* The recorded files of the committed epoch in `dir` (of any job) into
 * *files (malloc'd) and *n; -1 (ZT_E_NOT_FOUND) when no committed epoch is
 * there. */
int zt_registry_record(zt_coord_t *c, const char *dir, zt_db_ckpt_file_t **files, int *n);

/* ---- copies.c: where checkpoint files have copies ------------------------------ */

struct Ztrain__FileCopies;
struct Ztrain__ReplicaTarget;
/* The holders of every file of one epoch for one rank's rendezvous reply
 * (everything malloc'd; zt_copies_pool_free). */
typedef struct {
  struct Ztrain__FileCopies *fc, **fcp;
  struct Ztrain__ReplicaTarget *t, **tp;
  char *tickets;
  int n;
} zt_copies_pool_t;

/* Worker worker_id holds a copy of file `name` of epoch k of job_id. */
int zt_copies_add(zt_coord_t *c, uint64_t job_id, const zt_db_ckpt_t *k, const char *name,
                  uint64_t worker_id);
/* Epoch k is gone: every worker that held a copy is asked to delete it. */
void zt_copies_forget_epoch(zt_coord_t *c, uint64_t job_id, const zt_db_ckpt_t *k);
/* A copy on worker m of the epoch in `dir` (absolute) that arrives after
 * the epoch was deleted (a push or fetch slower than the deletions): 1,
 * with its deletion queued on m (the copy is not to be recorded), 0 when
 * the epoch is not deleted, -1 on a database error. */
int zt_copies_of_deleted(zt_coord_t *c, uint64_t job_id, const char *dir, zt_member_t *m);
/* 1 when every file of epoch k (its record: files, n) has a copy on a
 * machine with a live worker; else 0 with the first missing file in why. */
int zt_copies_available(zt_coord_t *c, uint64_t job_id, const zt_db_ckpt_t *k,
                        const zt_db_ckpt_file_t *files, int n, char *why, size_t whylen);
/* The stores that can serve each file of epoch k (of job epoch_job) to
 * worker `requester` of job j, with tickets, into pool; those it may not
 * reach now (kept out, silent, or named unreachable in its last probe)
 * last, marked doubtful. */
int zt_copies_holders(zt_coord_t *c, zt_job_t *j, uint64_t epoch_job, const zt_db_ckpt_t *k,
                      const zt_db_ckpt_file_t *files, int n, uint64_t requester,
                      zt_copies_pool_t *pool);
/* Get tickets (common/ticket.c) outlive a generation's set-up by far; a
 * fenced worker's copies of an epoch that cannot commit are deleted later
 * anyway. Put tickets have no expiry: the holder takes them only while it
 * works on their generation. */
#define ZT_TICKET_TTL_MS (24ll * 3600 * 1000)
void zt_copies_pool_free(zt_copies_pool_t *pool);
/* Epoch directories (relative) worker m is to delete (at most max), and
 * those it reports deleted. */
int zt_copies_deletions(zt_coord_t *c, zt_member_t *m, char (*dirs)[ZT_DB_DIR_MAX], int max);
void zt_copies_deleted(zt_coord_t *c, zt_member_t *m, char *const *dirs, size_t n);
/* What a registering worker holds (files relative to its checkpoint root):
 * copies of committed epochs are counted, the rest is to be deleted. */
void zt_copies_reconcile(zt_coord_t *c, zt_member_t *m, char *const *held, size_t n);

/* ---- members.c: membership and liveness -------------------------------------- */

int zt_members_load(zt_coord_t *c);
zt_member_t *zt_members_get(zt_coord_t *c, uint64_t id);
zt_member_t *zt_members_find_name(zt_coord_t *c, const char *name);
/* By decimal id or by name. */
zt_member_t *zt_members_lookup(zt_coord_t *c, const char *id_or_name);
/* Suspect / lost transitions (and recoveries heard since the last check),
 * in one transaction; silences are judged at now - lag_ms (the time up to
 * which every call received has been handled: zt_rpc_server_lag_ms).
 * Returns the number of members that were declared lost, with their ids
 * in *lost (malloc'd; the caller frees). */
size_t zt_members_check(zt_coord_t *c, int64_t lag_ms, uint64_t **lost);
/* Writes last_seen of the dirty members among the next `slice` slots
 * (ZT_FLUSH_ALL: every one). */
#define ZT_FLUSH_ALL ((size_t)-1)
void zt_members_flush(zt_coord_t *c, size_t slice);
/* The coordinator did not listen for ms: no member's silence counts it. */
void zt_members_credit(zt_coord_t *c, int64_t ms);
/* Pace (members.c): the interval to advertise for the live members and
 * heartbeat_capacity; the interval and timeout heartbeat and register
 * replies carry. */
void zt_members_pace(zt_coord_t *c);
int64_t zt_members_interval_ms(const zt_coord_t *c);
int64_t zt_members_timeout_ms(const zt_coord_t *c);
/* 1 while the coordinator hears from no worker although two or more are
 * alive (members.c, "The coordinator's own blips"); nobody is declared
 * lost then, for at most blind_max_ms (default ZT_BLIND_MAX_TIMEOUTS
 * heartbeat timeouts). */
#define ZT_BLIND_MAX_TIMEOUTS 5
int zt_members_blind(const zt_coord_t *c, int64_t now);
void zt_members_free(zt_coord_t *c);
void zt_members_count(zt_coord_t *c, uint32_t counts[5]);
/* What a worker says when it registers. */
typedef struct {
  const char *name, *host, *device;
  const char *session; /* its previous credential, or "" */
  const char *store_addr; /* HOST:PORT of its replica store, or "" */
  int pid;
  uint64_t host_memory, device_memory;
  int nccl; /* a GPU worker whose NCCL libraries load */
  int hb_agent; /* it heartbeats through its machine's agent */
} zt_register_t;
/* Register / heartbeat / leave. Register gives the member a new session
 * credential; it sets *known when the name was registered before (the
 * worker restarted: its old assignment is void) and refuses (ZT_E_EXISTS) a
 * name whose holder is alive unless the caller presents the holder's
 * session. Leave sets *left when the member moved to LEFT now. */
int zt_members_register(zt_coord_t *c, const zt_register_t *r, zt_member_t **out, int *known);
/* Every Control call after registration: the worker's session must match
 * (ZT_E_UNAUTHENTICATED otherwise; ZT_E_NOT_FOUND for an unknown id). */
int zt_members_authenticate(zt_coord_t *c, uint64_t id, const char *session);
int zt_members_heartbeat(zt_coord_t *c, uint64_t id, zt_member_t **out);
/* A heartbeat's per-step timings (kept while it trains; values that are
 * not finite and non-negative are ignored). */
void zt_members_timing(zt_coord_t *c, zt_member_t *m, double step_ms, double comm_ms,
                       double send_wait_ms, double link_rtt_ms);
/* Keeps m out of generations until it shows it reaches the others. */
void zt_members_quarantine(zt_coord_t *c, zt_member_t *m);
/* m probed its peers' stores after a failed collective and could not
 * reach the workers ids[0..n): remembered (replacing what it said before)
 * until its next such report, a new registration, or ZT_UNREACH_MEMORY_MS. */
void zt_members_unreach(zt_coord_t *c, zt_member_t *m, const uint64_t *ids, int n);
/* Whether m said lately that it cannot reach worker id's store. */
int zt_members_unreached(const zt_member_t *m, uint64_t id);
#define ZT_UNREACH_MEMORY_MS (10 * 60 * 1000)
/* A quarantined worker's heartbeat: `probed` with n_unreach stores it could
 * not reach (first: the first) answers the last probe asked; none lets it
 * back in. Fills addrs (at most max) with the stores to probe next; 0 when
 * it is not (or no longer) quarantined. */
int zt_members_probe(zt_coord_t *c, zt_member_t *m, int probed, size_t n_unreach,
                     const char *first, const char **addrs, int max);
int zt_members_leave(zt_coord_t *c, uint64_t id, const char *reason, int *left);

/* ---- views.c: the Status messages, filled from state and rows ------------------ */

struct Ztrain__JobInfo;
struct Ztrain__WorkerInfo;
struct Ztrain__StepRecord;
struct Ztrain__Event;
struct Ztrain__CheckpointInfo;
struct Ztrain__GetStatusReply;
/* Strings point into the source, which must outlive the message. */
void zt_view_job(const zt_job_t *j, struct Ztrain__JobInfo *out);
/* The job is paused with a message that starts with `mark`. */
int zt_view_paused_for(const zt_job_t *j, const char *mark);
/* The job is paused for a cause that may go away by itself, and the
 * scheduler will resume it then (JobInfo.resumes_by_itself). */
int zt_view_resumes_by_itself(const zt_job_t *j);
void zt_view_worker(const zt_member_t *m, struct Ztrain__WorkerInfo *out);
void zt_view_step(const zt_db_step_t *s, struct Ztrain__StepRecord *out);
void zt_view_event(const zt_db_event_t *e, struct Ztrain__Event *out);
void zt_view_ckpt(const zt_db_ckpt_t *k, struct Ztrain__CheckpointInfo *out);
void zt_view_status(zt_coord_t *c, struct Ztrain__GetStatusReply *out);

/* ---- auth.c: credentials ------------------------------------------------------ */

/* An operator's "Bearer <token>" (the gRPC authorization metadata or the
 * HTTP Authorization header); always true when no token is configured. */
int zt_auth_operator(const zt_coord_t *c, const char *authorization);
/* A worker's shared secret at registration. */
int zt_auth_worker_secret(const zt_coord_t *c, const char *secret);

/* ---- events.c: the logbook ----------------------------------------------------- */

/* Records a logbook event; logs (and survives) a database failure. */
void zt_coord_event(zt_coord_t *c, uint64_t job_id, const char *kind, uint64_t worker_id,
                    const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* The event of a change the caller writes in a transaction it holds open
 * (a worker's state, a registration, a commit): written with it, so that
 * both are stored or neither. Not logged here: the caller logs the change
 * once the transaction committed. -1 with the database's reason. */
ZT_MUST_CHECK int zt_coord_event_tx(zt_coord_t *c, uint64_t job_id, const char *kind,
                                    uint64_t worker_id, const char *detail);

/* ---- provision.c: the provisioner hook (called by main.c, http.c) ----------------- */

int zt_prov_start(zt_coord_t *c);
void zt_prov_tick(zt_coord_t *c);
void zt_prov_stop(zt_coord_t *c);
void zt_prov_free(zt_coord_t *c);
/* Runs so far: ok, failed, timed out. */
void zt_prov_counts(const zt_coord_t *c, uint64_t out[3]);

/* ---- config.c: settings (called by main.c) ---------------------------------------- */

void zt_config_defaults(zt_coord_config_t *cfg);
/* The config file named by --config, then the flags; validates the result. */
int zt_config_parse(zt_coord_config_t *cfg, int argc, char **argv);

/* ---- service.c, http.c: the front ends ------------------------------------------ */

/* The most step records one metrics read returns (GET /v1/jobs/{id}/metrics,
 * GetMetrics), and what it returns when it names no limit: reads run on the
 * loop, so a long history is read in pages (from = the last step + 1). */
#define ZT_METRICS_MAX_ROWS 10000

void zt_coord_rpc_dispatch(zt_rpc_call_t *call, const char *method, const uint8_t *req,
                           size_t len, void *user);
int zt_http_start(zt_coord_t *c, const char *addr, zt_http_t **out);
int zt_http_port(zt_http_t *h);
void zt_http_stop(zt_http_t *h);

/* ---- loopcall.c ----------------------------------------------------------------- */

int zt_loopcall_init(uv_loop_t *loop, zt_loopcall_t *lc);
int zt_loopcall_run(zt_loopcall_t *lc, void (*fn)(void *), void *arg);
void zt_loopcall_close(zt_loopcall_t *lc);

/* ---- notify.c ------------------------------------------------------------------- */

void zt_notify_ready(zt_coord_t *c);
void zt_notify_stopping(void);

#endif
