/*
 * control.h: a worker's link to the coordinator (the Control service).
 *
 * zt_ctl owns the registration and the heartbeat loop of one zworker. It
 * registers under the worker's stable name, heartbeats at the interval the
 * coordinator hands out, and survives a coordinator that goes away: calls
 * that fail with UNAVAILABLE or DEADLINE_EXCEEDED are retried with capped
 * exponential backoff (100 ms doubling to 5 s, with jitter), and a
 * coordinator that no longer knows the worker (NOT_FOUND) or has declared it
 * lost (FAILED_PRECONDITION) gets a fresh registration at once; when it
 * keeps refusing heartbeats, the registrations after the first are paced
 * by the same backoff. The first failure of a kind is logged, and then
 * every ZT_CTL_LOG_EVERY-th with the count, so a coordinator that stays
 * away fills no log.
 *
 * zt_ctl_run() runs the loop on the calling thread until zt_ctl_stop() is
 * called from any thread (a signal handler thread, typically); it then sends
 * Leave with the given reason, bounded by a deadline, and returns.
 */
#ifndef ZT_CONTROL_H
#define ZT_CONTROL_H

#include <stddef.h>
#include <stdint.h>

typedef struct zt_ctl zt_ctl_t;

/* Training counters since the worker started (runner.c), from which each
 * heartbeat reports per-step averages over its interval. */
typedef struct {
  int64_t steps;
  double step_ms;                 /* sum over the steps */
  uint64_t comm_us, send_wait_us; /* zt_comm_stats_t, summed over generations */
  uint32_t link_rtt_us;           /* the ring's outgoing connection now (0: none) */
} zt_ctl_timing_t;

typedef struct {
  const char *coordinator; /* HOST:PORT */
  const char *name;
  const char *device;
  const char *secret; /* may be NULL */
  const char *host;   /* the machine's name (NULL: its hostname) */
  int64_t rpc_timeout_ms;  /* per call; 0: 2000 */
  int64_t backoff_max_ms;  /* 0: 5000 */
  int64_t drain_timeout_ms; /* longest wait for a checkpoint before leaving; 0: 90000 */
  uint64_t host_memory, device_memory; /* reported at registration (bytes) */
  int nccl;                            /* ... and whether NCCL loads (GPU workers) */
  /* Heartbeats go through the machine's heartbeat agent (agent.h), which
   * this worker becomes when there is none. */
  int heartbeat_agent;
  /* The checkpoint root (absolute): its files are reported at
   * registration, and epochs the coordinator drops are deleted under it.
   * NULL: neither. */
  const char *ckpt_root;
  /* Called on the control thread with every heartbeat reply's command
   * (ztrain.proto's Command) and assignment; also with STOP when the
   * worker had to register again (its assignment is void). */
  /* nccl_root: this worker makes the NCCL unique id of that generation. */
  void (*on_command)(void *user, int command, uint64_t job_id, uint64_t generation,
                     int nccl_root);
  /* Reads the training counters (may be NULL). */
  void (*timing)(void *user, zt_ctl_timing_t *t);
  void *user;
} zt_ctl_opts_t;

int zt_ctl_open(const zt_ctl_opts_t *opts, zt_ctl_t **out);
void zt_ctl_close(zt_ctl_t *c);
/* Returns 0 after a clean stop, -1 on a fatal error (e.g. refused secret). */
int zt_ctl_run(zt_ctl_t *c);
void zt_ctl_stop(zt_ctl_t *c, const char *reason);
uint64_t zt_ctl_worker_id(zt_ctl_t *c);
/* The job generation this worker is working on, sent with each heartbeat. */
void zt_ctl_set_assignment(zt_ctl_t *c, uint64_t job_id, uint64_t generation);
/* The job generation last set with zt_ctl_set_assignment (thread-safe). */
void zt_ctl_assignment(zt_ctl_t *c, uint64_t *job_id, uint64_t *generation);

struct zt_rpc_client;
/* The coordinator connection, for the trainer's own calls (thread-safe). */
struct zt_rpc_client *zt_ctl_rpc(zt_ctl_t *c);
/* The current registration's session credential, which every worker call
 * carries (thread-safe copy). */
void zt_ctl_session(zt_ctl_t *c, char *buf, size_t n);
/* The replica store's HOST:PORT, reported at the next registration (call
 * before zt_ctl_run). */
void zt_ctl_set_store_addr(zt_ctl_t *c, const char *addr);
/* Tells the coordinator this worker now holds a copy of file f of the
 * epoch in dir (relative to the checkpoint root); retried briefly. */
int zt_ctl_report_replica(zt_ctl_t *c, uint64_t job_id, const char *dir, const char *name,
                          uint64_t bytes, const char *checksum);
/* The longest pause between retries of a call to the coordinator: the
 * heartbeat interval it asked for, so that a restarted coordinator hears
 * from every worker within about one interval of coming back. */
int64_t zt_ctl_retry_cap_ms(zt_ctl_t *c);

/* The backoff of zt_ctl's own retries, for other loops that call the
 * coordinator (the runner's Rendezvous): *cur_ms (start it at
 * ZT_CTL_BACKOFF_MIN_MS) with +-25% jitter from *rng (any nonzero seed) is
 * the wait returned; *cur_ms then doubles up to cap_ms. */
#define ZT_CTL_BACKOFF_MIN_MS 100
int64_t zt_ctl_backoff(int64_t *cur_ms, int64_t cap_ms, uint64_t *rng);
/* Failures logged: the first, then every ZT_CTL_LOG_EVERY-th (with the
 * count); the rest only at debug level. */
#define ZT_CTL_LOG_EVERY 20
static inline int zt_ctl_log_failure(int count) {
  return count == 1 || count % ZT_CTL_LOG_EVERY == 0;
}

#endif
