/*
 * control.c: registration, heartbeats and Leave (see control.h).
 *
 * The loop is a small state machine with two states, unregistered and
 * registered. Waiting between attempts is a timed wait on a condition
 * variable, so zt_ctl_stop() interrupts any wait at once; every RPC carries a
 * deadline, so no step of the loop can block forever.
 *
 * A short network blip must not cost the worker its membership. The
 * control thread's calls (Register, Heartbeat, Leave) go over a channel of
 * their own (c->hb, with a connection of its own), not the one the
 * runner's calls use (zt_ctl_rpc), so they never wait behind those. A
 * heartbeat's deadline is about one heartbeat interval; one that times out
 * on a connection that died without a word (a cut link sends no FIN or
 * RST) gets the channel replaced (common/rpc.c, "Silent deaths"), and the
 * new one tries to connect every half interval or so until the
 * coordinator answers. A blip of a second or two therefore costs a few
 * hundred milliseconds of heartbeats after it ends, well inside the
 * coordinator's timeout.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "agent.h"
#include "control.h"
#include "holdings.h"
#include "pbcall.h"
#include "store.h"
#include "zt_common.h"
#include "zt_rpc.h"
#include "ztrain.pb-c.h"


struct zt_ctl {
  zt_ctl_opts_t o;
  char coordinator[256], name[128], device[32], secret[256], host[128];
  zt_rpc_client_t *rpc;   /* the runner's calls (zt_ctl_rpc) */
  zt_rpc_client_t *hb;    /* the control thread's own: Register, Heartbeat, Leave */
  zt_agent_t *agent;      /* --heartbeat-agent: the machine's agent; NULL: direct */
  int via_agent;          /* the last heartbeat went through it (control thread) */
  int hb_reconnect_ms;    /* hb's longest wait between connection attempts */
  unsigned hb_replaced;   /* hb's replacements after a silent death, as last logged */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int stopping;           /* under mu */
  char stop_reason[256];  /* under mu */
  uint64_t worker_id;
  uint64_t epoch;
  int64_t heartbeat_ms;           /* read by other threads: atomic */
  int64_t backoff_ms;
  uint64_t seq;
  uint64_t rng;
  uint64_t job_id, generation; /* under mu */
  char session[72];            /* under mu: this registration's credential */
  uint64_t assigned_job;       /* job of the last heartbeat reply (control thread) */
  uint64_t assigned_gen;       /* its generation (control thread) */
  int send_held;               /* the next heartbeat carries the inventory (control thread) */
  /* The epoch directories of the last inventory that reached the
   * coordinator, as hashes (control thread): one of another job or
   * generation that is not among them sends the inventory again. */
  uint64_t *listed;
  int n_listed;
  char store_addr[96];
  char ckpt_root[ZT_PATH_MAX];
  /* Epoch directories deleted as a heartbeat reply asked, reported with
   * the next heartbeat (control thread). */
  char *deleted[ZT_DELETED_EPOCHS_MAX];
  int n_deleted;
  /* The answer to the coordinator's last probe request (probe_stores),
   * reported with the next heartbeat (control thread). */
  int probed;
  char *unreach[64];
  int n_unreach;
  zt_ctl_timing_t last_timing; /* as of the previous heartbeat */
  int64_t backoff_cap_ms;      /* backoff ceiling, from the coordinator's timeout */
};

/* The wait between connection attempts of the control channel, and the
 * time one attempt may take: half a heartbeat interval (100 ms to
 * ZT_RPC_RECONNECT_MAX_MS), so a worker reaches the coordinator soon after
 * a blip ends, and a fleet tries no more often than it heartbeats while
 * the coordinator is away. */
static int hb_reconnect_ms(const zt_ctl_t *c) {
  return (int)ZT_MAX(100, ZT_MIN(ZT_RPC_RECONNECT_MAX_MS, c->heartbeat_ms / 2));
}

/* (Re)opens the control channel; the old one, if any, is closed (its
 * connection with it). */
static int hb_open(zt_ctl_t *c) {
  zt_rpc_client_close(c->hb);
  c->hb = NULL;
  c->hb_reconnect_ms = hb_reconnect_ms(c);
  c->hb_replaced = 0;
  zt_rpc_client_opts_t ro = {.wait_for_ready = 1, .reconnect_max_ms = c->hb_reconnect_ms,
                             .connect_min_ms = c->hb_reconnect_ms};
  return zt_rpc_client_open(c->coordinator, &ro, &c->hb);
}

int zt_ctl_open(const zt_ctl_opts_t *o, zt_ctl_t **out) {
  zt_ctl_t *c = zt_xcalloc(1, sizeof *c);
  c->o = *o;
  snprintf(c->coordinator, sizeof c->coordinator, "%s", o->coordinator);
  snprintf(c->name, sizeof c->name, "%s", o->name);
  snprintf(c->device, sizeof c->device, "%s", o->device);
  snprintf(c->secret, sizeof c->secret, "%s", o->secret ? o->secret : "");
  snprintf(c->ckpt_root, sizeof c->ckpt_root, "%s", o->ckpt_root ? o->ckpt_root : "");
  if (o->host && o->host[0]) snprintf(c->host, sizeof c->host, "%s", o->host);
  else if (gethostname(c->host, sizeof c->host) != 0) snprintf(c->host, sizeof c->host, "unknown");
  c->o.rpc_timeout_ms = o->rpc_timeout_ms > 0 ? o->rpc_timeout_ms : 2000;
  c->o.backoff_max_ms = o->backoff_max_ms > 0 ? o->backoff_max_ms : 5000;
  c->heartbeat_ms = 1000;
  c->backoff_ms = ZT_CTL_BACKOFF_MIN_MS;
  c->backoff_cap_ms = c->o.backoff_max_ms;
  c->rng = (uint64_t)zt_now_us() ^ ((uint64_t)getpid() << 32);
  /* The first registration presents a credential of our own making: if
   * its reply is lost, the retry presents it again and takes our name
   * back at once (coordinator/members.c, name_free), instead of waiting
   * until the entry the lost reply made is declared lost. */
  if (zt_random_hex(c->session, 32) != 0) c->session[0] = 0;
  pthread_mutex_init(&c->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&c->cv, &ca);
  pthread_condattr_destroy(&ca);
  zt_rpc_client_opts_t ro = {.wait_for_ready = 1};
  if (zt_rpc_client_open(c->coordinator, &ro, &c->rpc) != 0 || hb_open(c) != 0) {
    zt_ctl_close(c);
    return -1;
  }
  if (o->heartbeat_agent) c->agent = zt_agent_open(c->coordinator);
  *out = c;
  return 0;
}

void zt_ctl_close(zt_ctl_t *c) {
  if (!c) return;
  for (int i = 0; i < c->n_deleted; i++) free(c->deleted[i]);
  for (int i = 0; i < c->n_unreach; i++) free(c->unreach[i]);
  free(c->listed);
  zt_agent_close(c->agent);
  zt_rpc_client_close(c->rpc);
  zt_rpc_client_close(c->hb);
  pthread_cond_destroy(&c->cv);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

uint64_t zt_ctl_worker_id(zt_ctl_t *c) { return __atomic_load_n(&c->worker_id, __ATOMIC_ACQUIRE); }

zt_rpc_client_t *zt_ctl_rpc(zt_ctl_t *c) { return c->rpc; }

void zt_ctl_set_store_addr(zt_ctl_t *c, const char *addr) {
  snprintf(c->store_addr, sizeof c->store_addr, "%s", addr);
}

int64_t zt_ctl_retry_cap_ms(zt_ctl_t *c) {
  return ZT_MAX(ZT_CTL_BACKOFF_MIN_MS, __atomic_load_n(&c->heartbeat_ms, __ATOMIC_RELAXED));
}

void zt_ctl_session(zt_ctl_t *c, char *buf, size_t n) {
  pthread_mutex_lock(&c->mu);
  snprintf(buf, n, "%s", c->session);
  pthread_mutex_unlock(&c->mu);
}

void zt_ctl_set_assignment(zt_ctl_t *c, uint64_t job_id, uint64_t generation) {
  pthread_mutex_lock(&c->mu);
  c->job_id = job_id;
  c->generation = generation;
  pthread_mutex_unlock(&c->mu);
}

void zt_ctl_assignment(zt_ctl_t *c, uint64_t *job_id, uint64_t *generation) {
  pthread_mutex_lock(&c->mu);
  *job_id = c->job_id;
  *generation = c->generation;
  pthread_mutex_unlock(&c->mu);
}

void zt_ctl_stop(zt_ctl_t *c, const char *reason) {
  pthread_mutex_lock(&c->mu);
  if (!c->stopping) snprintf(c->stop_reason, sizeof c->stop_reason, "%s", reason);
  c->stopping = 1;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

/* Waits up to ms unless a stop arrives first; returns 1 when stopping. */
static int wait_or_stop(zt_ctl_t *c, int64_t ms) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  ts.tv_sec += ms / 1000;
  ts.tv_nsec += (ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&c->mu);
  while (!c->stopping && pthread_cond_timedwait(&c->cv, &c->mu, &ts) == 0) {
  }
  int s = c->stopping;
  pthread_mutex_unlock(&c->mu);
  return s;
}

int64_t zt_ctl_backoff(int64_t *cur_ms, int64_t cap_ms, uint64_t *rng) {
  *rng ^= *rng << 13, *rng ^= *rng >> 7, *rng ^= *rng << 17;
  int64_t b = ZT_MAX(*cur_ms, 1);
  int64_t wait = b - b / 4 + (int64_t)(*rng % (uint64_t)(b / 2 + 1));
  *cur_ms = ZT_MIN(b * 2, ZT_MAX(cap_ms, ZT_CTL_BACKOFF_MIN_MS));
  return wait;
}

/* Next backoff wait: the current one with +-25% jitter; then doubles. */
static int64_t next_backoff(zt_ctl_t *c) {
  return zt_ctl_backoff(&c->backoff_ms, c->backoff_cap_ms, &c->rng);
}

/* A call on the control channel with the usual deadline: the control
 * thread's only (hb_open replaces that channel). */
static int call(zt_ctl_t *c, const char *method, const ProtobufCMessage *msg,
                const ProtobufCMessageDescriptor *desc, ProtobufCMessage **reply, int *status) {
  return zt_pb_call(c->hb, method, msg, desc, c->o.rpc_timeout_ms, reply, status);
}

/* A heartbeat's deadline: about one interval (at least 250 ms, at most the
 * usual deadline), so that a heartbeat lost in a blip is retried, on a new
 * connection if need be, while the coordinator's timeout still has room. */
static int64_t heartbeat_deadline_ms(const zt_ctl_t *c) {
  return ZT_MIN(c->o.rpc_timeout_ms, ZT_MAX(c->heartbeat_ms, 250));
}

/* What this worker holds under its checkpoint root (holdings.c): sent at
 * registration, with the first heartbeat of a new job or generation, and
 * when an epoch directory appeared that may be stale (news_in). Free with
 * zt_hold_free. */
static int inventory(const zt_ctl_t *c, char ***held) {
  int n = 0;
  *held = NULL;
  if (c->ckpt_root[0]) (void)zt_hold_inventory(c->ckpt_root, held, &n);
  return n;
}

/* The hash of an entry's epoch directory (the entry up to its last slash);
 * 0 with *e unset when it names none. */
static uint64_t entry_dir(const char *entry, zt_epoch_t *e) {
  const char *slash = strrchr(entry, '/');
  char dir[ZT_PATH_MAX];
  if (!slash || (size_t)(slash - entry) >= sizeof dir) return 0;
  snprintf(dir, sizeof dir, "%.*s", (int)(slash - entry), entry);
  if (zt_epoch_parse(dir, e) != 0) return 0;
  return XXH64(dir, strlen(dir), 0) | 1;
}

static int was_listed(const zt_ctl_t *c, uint64_t h) {
  for (int i = 0; i < c->n_listed; i++)
    if (c->listed[i] == h) return 1;
  return 0;
}

/* The inventory reached the coordinator: its directories are known. */
static void remember_listed(zt_ctl_t *c, char **held, int n) {
  c->n_listed = 0;
  c->listed = zt_xrealloc(c->listed, (size_t)(n + 1) * sizeof *c->listed);
  zt_epoch_t e;
  for (int i = 0; i < n; i++) {
    uint64_t h = entry_dir(held[i], &e);
    if (h && !was_listed(c, h)) c->listed[c->n_listed++] = h;
  }
}

/* 1 when held names an epoch directory of another job or generation than
 * this worker's that the last inventory did not: a copy pushed late, a
 * write that ended after its generation did, a fetch that failed. The
 * coordinator judges it only when it hears of it, and after a job ends no
 * new generation would send the inventory again. */
static int news_in(const zt_ctl_t *c, char **held, int n) {
  zt_epoch_t e;
  for (int i = 0; i < n; i++) {
    uint64_t h = entry_dir(held[i], &e);
    if (h && !(e.job == c->assigned_job && e.gen == c->assigned_gen) && !was_listed(c, h))
      return 1;
  }
  return 0;
}

/* Returns 0 when registered, -1 with *fatal set when retrying is pointless. */
static int do_register(zt_ctl_t *c, int *fatal) {
  char session[sizeof c->session];
  zt_ctl_session(c, session, sizeof session);
  Ztrain__RegisterRequest req = ZTRAIN__REGISTER_REQUEST__INIT;
  req.name = c->name;
  req.host = c->host;
  req.device = c->device;
  req.secret = c->secret;
  req.pid = (int32_t)getpid();
  req.version = (char *)zt_version_string();
  req.session = session; /* lets us take our own name back */
  req.host_memory_bytes = c->o.host_memory;
  req.device_memory_bytes = c->o.device_memory;
  req.nccl = c->o.nccl;
  req.heartbeat_agent = c->agent != NULL;
  req.store_addr = c->store_addr;
  char **held = NULL;
  int n_held = inventory(c, &held);
  req.held_files = held;
  req.n_held_files = (size_t)n_held;
  ProtobufCMessage *m;
  int status = 0;
  *fatal = 0;
  int rc = call(c, "/ztrain.Control/RegisterWorker", &req.base,
                &ztrain__register_reply__descriptor, &m, &status);
  if (rc == 0) remember_listed(c, held, n_held);
  zt_hold_free(held, n_held);
  if (rc != 0) {
    /* A wrong secret or name is final; a name still held by a live worker
     * (ALREADY_EXISTS) frees up once that one is lost: retry. */
    *fatal = status == ZT_RPC_UNAUTHENTICATED || status == ZT_RPC_INVALID_ARGUMENT;
    return -1;
  }
  Ztrain__RegisterReply *r = (Ztrain__RegisterReply *)m;
  pthread_mutex_lock(&c->mu);
  snprintf(c->session, sizeof c->session, "%s", r->session);
  pthread_mutex_unlock(&c->mu);
  __atomic_store_n(&c->worker_id, r->worker_id, __ATOMIC_RELEASE);
  __atomic_store_n(&c->heartbeat_ms, r->heartbeat_ms ? (int64_t)r->heartbeat_ms : 1000,
                   __ATOMIC_RELAXED);
  /* While the coordinator is away, never back off longer than one
   * heartbeat interval: a restarted coordinator waits that long (plus
   * gRPC's reconnect) for the members it believes alive, and each call
   * also waits for the connection (wait_for_ready) up to its deadline. */
  c->backoff_cap_ms = ZT_MAX(ZT_CTL_BACKOFF_MIN_MS, ZT_MIN(c->o.backoff_max_ms, c->heartbeat_ms));
  /* The control channel's reconnect wait follows the interval; a new one
   * (the next call connects it) when the interval asks for another wait. */
  if (hb_reconnect_ms(c) != c->hb_reconnect_ms && hb_open(c) != 0)
    ZT_WARN("cannot reopen the control channel: %s", zt_err_msg());
  if (c->epoch && c->epoch != r->coordinator_epoch)
    ZT_INFO("coordinator restarted (epoch %llu -> %llu)", (unsigned long long)c->epoch,
            (unsigned long long)r->coordinator_epoch);
  c->epoch = r->coordinator_epoch;
  ZT_INFO("registered as worker %llu with %s (heartbeat %lld ms)",
          (unsigned long long)c->worker_id, c->coordinator, (long long)c->heartbeat_ms);
  protobuf_c_message_free_unpacked(m, NULL);
  return 0;
}

/* The epochs a heartbeat reply asks us to delete: deleted, then reported
 * with the next heartbeat (the reply asks again until then). One that is
 * not gone is logged with the reason and not reported: it is tried again
 * at the next request. */
static void delete_epochs(zt_ctl_t *c, const Ztrain__HeartbeatReply *r) {
  for (int i = 0; i < c->n_deleted; i++) free(c->deleted[i]);
  c->n_deleted = 0;
  for (size_t i = 0; i < r->n_delete_epochs && c->n_deleted < (int)ZT_ARRAY_LEN(c->deleted); i++) {
    const char *rel = r->delete_epochs[i];
    if (!c->ckpt_root[0] || zt_hold_delete(c->ckpt_root, rel) != 0) {
      ZT_WARN("not deleting %.200s: %s", rel, zt_err_msg());
      continue;
    }
    ZT_INFO("deleted checkpoint epoch %s", rel);
    c->deleted[c->n_deleted++] = zt_xstrdup(rel);
  }
}

/* Returns 0 on success; -1 with *status on failure. */
static void forget_probe(zt_ctl_t *c) {
  for (int i = 0; i < c->n_unreach; i++) free(c->unreach[i]);
  c->n_unreach = 0;
  c->probed = 0;
}

/* The coordinator keeps this worker out of generations until it shows it
 * can reach the others: connect to their stores, answer next heartbeat. */
#define ZT_CTL_PROBE_MS 1000
static void probe_stores(zt_ctl_t *c, const Ztrain__HeartbeatReply *r) {
  int n = (int)ZT_MIN(r->n_probe_stores, 64);
  uint8_t ok[64];
  zt_store_probe((const char *const *)r->probe_stores, n, ZT_CTL_PROBE_MS, ok);
  for (int i = 0; i < n; i++)
    if (ok[i] != ZT_PROBE_OK) c->unreach[c->n_unreach++] = zt_xstrdup(r->probe_stores[i]);
  c->probed = 1;
  if (c->n_unreach)
    ZT_WARN("kept out of jobs: %d of %d peers' stores cannot be reached (first: %s)",
            c->n_unreach, n, c->unreach[0]);
}

static int do_heartbeat(zt_ctl_t *c, int *status) {
  char session[sizeof c->session];
  zt_ctl_session(c, session, sizeof session);
  Ztrain__HeartbeatRequest req = ZTRAIN__HEARTBEAT_REQUEST__INIT;
  req.worker_id = c->worker_id;
  req.session = session;
  req.seq = ++c->seq;
  pthread_mutex_lock(&c->mu);
  req.job_id = c->job_id;
  req.generation = c->generation;
  pthread_mutex_unlock(&c->mu);
  req.deleted_epochs = c->deleted;
  req.n_deleted_epochs = (size_t)c->n_deleted;
  req.probed = c->probed;
  req.unreachable_stores = c->unreach;
  req.n_unreachable_stores = (size_t)c->n_unreach;
  char **held = NULL;
  int n_held = inventory(c, &held), send_held = c->send_held || news_in(c, held, n_held);
  req.held_files = send_held ? held : NULL;
  req.n_held_files = send_held ? (size_t)n_held : 0;
  zt_ctl_timing_t now = c->last_timing;
  if (c->o.timing) c->o.timing(c->o.user, &now);
  int64_t steps = now.steps - c->last_timing.steps;
  if (steps > 0) {
    req.step_ms = (now.step_ms - c->last_timing.step_ms) / (double)steps;
    req.comm_ms = (double)(now.comm_us - c->last_timing.comm_us) / 1000.0 / (double)steps;
    req.send_wait_ms =
        (double)(now.send_wait_us - c->last_timing.send_wait_us) / 1000.0 / (double)steps;
    req.link_rtt_ms = now.link_rtt_us / 1000.0;
  }
  ProtobufCMessage *m;
  /* Through the machine's agent, which may hold it up to an interval to
   * send it with the others'; directly when no agent answers. */
  int rc = c->agent ? zt_agent_heartbeat(c->agent, &req, heartbeat_deadline_ms(c) + c->heartbeat_ms,
                                         &m, status)
                    : -2;
  c->via_agent = rc != -2;
  if (rc == -2)
    rc = zt_pb_call(c->hb, "/ztrain.Control/Heartbeat", &req.base,
                    &ztrain__heartbeat_reply__descriptor, heartbeat_deadline_ms(c), &m, status);
  if (rc == 0 && send_held) remember_listed(c, held, n_held);
  zt_hold_free(held, n_held);
  if (rc != 0) return -1;
  Ztrain__HeartbeatReply *r = (Ztrain__HeartbeatReply *)m;
  c->send_held = 0;
  /* A new generation or job (or none): the last one's epochs that this
   * worker wrote or took may never have been reported; the coordinator
   * judges them with the next heartbeat's inventory. */
  if (r->job_id != c->assigned_job || r->generation != c->assigned_gen) c->send_held = 1;
  c->assigned_gen = r->generation;
  c->last_timing = now;
  forget_probe(c);
  if (r->n_probe_stores) probe_stores(c, r);
  delete_epochs(c, r);
  if (r->heartbeat_ms) __atomic_store_n(&c->heartbeat_ms, (int64_t)r->heartbeat_ms, __ATOMIC_RELAXED);
  c->assigned_job = r->job_id;
  int64_t late = zt_knob(ZT_KNOB_HEARTBEAT_REPLY_DELAY, 0);
  if (late > 0) zt_sleep_ms(late); /* test knob: the reply is acted on late */
  if (c->o.on_command)
    c->o.on_command(c->o.user, r->command, r->job_id, r->generation, r->nccl_root);
  if (r->coordinator_epoch != c->epoch) {
    ZT_INFO("coordinator restarted (epoch %llu -> %llu); still worker %llu",
            (unsigned long long)c->epoch, (unsigned long long)r->coordinator_epoch,
            (unsigned long long)c->worker_id);
    c->epoch = r->coordinator_epoch;
  }
  protobuf_c_message_free_unpacked(m, NULL);
  return 0;
}

/* Leave. When the worker is part of a running job with checkpoints, the
 * coordinator answers drain_pending: it orders a checkpoint first, and the
 * worker keeps training and heartbeating until its generation is replaced
 * (the heartbeat reply no longer names a job), then leaves for good. The
 * wait is bounded (drain_timeout_ms, default 90 s: inside a spot
 * instance's two-minute notice); past it, a last Leave with `now` set
 * leaves at once, so that the job re-forms without this worker instead of
 * waiting for its heartbeats to stop. */
static void do_leave(zt_ctl_t *c) {
  if (!c->worker_id) return;
  int64_t limit = c->o.drain_timeout_ms > 0 ? c->o.drain_timeout_ms : 90000;
  zt_deadline_t dl = zt_deadline_in(limit);
  int now = 0;
  for (;;) {
    char session[sizeof c->session];
    zt_ctl_session(c, session, sizeof session);
    Ztrain__LeaveRequest req = ZTRAIN__LEAVE_REQUEST__INIT;
    req.worker_id = c->worker_id;
    req.session = session;
    req.reason = c->stop_reason;
    req.now = now;
    ProtobufCMessage *m;
    int status;
    if (call(c, "/ztrain.Control/Leave", &req.base, &ztrain__leave_reply__descriptor, &m,
             &status) != 0) {
      ZT_WARN("leave not acknowledged: %s", zt_err_msg());
      return;
    }
    int drain = ((Ztrain__LeaveReply *)m)->drain_pending;
    protobuf_c_message_free_unpacked(m, NULL);
    if (!drain || now) break;
    if (zt_deadline_passed(dl)) {
      ZT_WARN("draining: no checkpoint within %lld ms (--drain-timeout-ms); leaving without it",
              (long long)limit);
      now = 1;
      continue;
    }
    ZT_INFO("draining: the job checkpoints before this worker leaves");
    while (!zt_deadline_passed(dl)) {
      int st = 0;
      if (do_heartbeat(c, &st) != 0 && !zt_rpc_transient(st))
        break;
      if (!c->assigned_job) break;
      zt_sleep_ms(ZT_MIN(c->heartbeat_ms, 200)); /* heartbeat pacing while draining */
    }
  }
  ZT_INFO("left the coordinator (%s)", c->stop_reason);
}

/* After a heartbeat that got no answer: says when the control channel
 * was replaced for it (common/rpc.c, "Silent deaths"). */
static void heartbeat_failed(zt_ctl_t *c) {
  unsigned n = zt_rpc_client_replaced(c->hb);
  if (n == c->hb_replaced) return;
  c->hb_replaced = n;
  if (zt_ctl_log_failure((int)n))
    ZT_INFO("heartbeat timed out on a connection that looked alive: a new connection "
            "(%u so far)", n);
}

int zt_ctl_run(zt_ctl_t *c) {
  /* failing: calls in a row that got no answer; refused: heartbeats in a
   * row the coordinator refused, which a registration does not end. */
  int registered = 0, ret = 0, failing = 0, refused = 0;
  while (!wait_or_stop(c, 0)) {
    if (!registered) {
      int fatal;
      if (do_register(c, &fatal) == 0) {
        registered = 1;
        if (!refused) c->backoff_ms = ZT_CTL_BACKOFF_MIN_MS;
        failing = 0;
        continue;
      }
      if (fatal) {
        ZT_ERROR("registration refused: %s", zt_err_msg());
        ret = -1;
        break;
      }
      if (zt_ctl_log_failure(++failing))
        ZT_WARN("cannot register (attempt %d, retrying with backoff): %s", failing,
                zt_err_msg());
      wait_or_stop(c, next_backoff(c));
      continue;
    }
    int64_t t0 = zt_now_ms(), status = 0;
    int st = 0;
    if (do_heartbeat(c, &st) == 0) {
      if (failing) ZT_INFO("coordinator reachable again after %d failed heartbeats", failing);
      if (refused > 1) ZT_INFO("heartbeats accepted again after %d refusals", refused);
      failing = 0, refused = 0;
      c->backoff_ms = ZT_CTL_BACKOFF_MIN_MS;
      /* Through the agent: an interval from the answer, which the
       * machine's other workers got at the same moment: they heartbeat in
       * step (agent.c). */
      if (c->via_agent)
        wait_or_stop(c, c->heartbeat_ms);
      else
        wait_or_stop(c, ZT_MAX(0, c->heartbeat_ms - (zt_now_ms() - t0)));
      continue;
    }
    status = st;
    if (status == ZT_RPC_NOT_FOUND || status == ZT_RPC_FAILED_PRECONDITION ||
        status == ZT_RPC_UNAUTHENTICATED) {
      /* The first refusal registers again at once (a restarted
       * coordinator); one that keeps refusing is paced by the backoff. */
      if (zt_ctl_log_failure(++refused))
        ZT_WARN("%s; registering again (heartbeat refused %d time%s in a row)", zt_err_msg(),
                refused, refused == 1 ? "" : "s");
      registered = 0;
      if (c->o.on_command) c->o.on_command(c->o.user, ZTRAIN__COMMAND__COMMAND_STOP, 0, 0, 0);
      if (refused > 1) wait_or_stop(c, next_backoff(c));
      continue;
    }
    if (zt_ctl_log_failure(++failing))
      ZT_WARN("heartbeat failed (attempt %d, retrying with backoff): %s", failing, zt_err_msg());
    else
      ZT_DEBUG("heartbeat %d failed after %lld ms: %s", failing, (long long)(zt_now_ms() - t0),
               zt_err_msg());
    heartbeat_failed(c);
    wait_or_stop(c, next_backoff(c));
  }
  if (registered) do_leave(c);
  return ret;
}

int zt_ctl_report_replica(zt_ctl_t *c, uint64_t job_id, const char *dir, const char *name,
                          uint64_t bytes, const char *checksum) {
  char session[sizeof c->session];
  zt_ctl_session(c, session, sizeof session);
  Ztrain__CheckpointFile f = ZTRAIN__CHECKPOINT_FILE__INIT;
  f.name = (char *)name;
  f.bytes = bytes;
  f.checksum = (char *)checksum;
  Ztrain__ReportReplicaRequest req = ZTRAIN__REPORT_REPLICA_REQUEST__INIT;
  req.worker_id = zt_ctl_worker_id(c);
  req.session = session;
  req.job_id = job_id;
  req.dir = (char *)dir;
  req.file = &f;
  for (int attempt = 0;; attempt++) {
    ProtobufCMessage *m;
    int st = 0;
    /* The store's thread: the shared channel, never the control thread's. */
    if (zt_pb_call(c->rpc, "/ztrain.Control/ReportReplica", &req.base,
                   &ztrain__report_replica_reply__descriptor, c->o.rpc_timeout_ms, &m, &st) == 0) {
      protobuf_c_message_free_unpacked(m, NULL);
      return 0;
    }
    if (!zt_rpc_transient(st) || attempt == 4) return -1;
    zt_sleep_ms(zt_ctl_retry_cap_ms(c)); /* retry pacing */
  }
}
