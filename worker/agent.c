/*
 * agent.c: a machine's heartbeat agent (see agent.h).
 *
 * Who is the agent. The machine's zworkers meet at one abstract Unix
 * socket, named after the coordinator's address: abstract names belong to
 * the network namespace (a machine, or a test's host) and vanish with the
 * process that bound them, so there is no file to clean up after a crash.
 * A worker's first heartbeat connects to it; when nothing listens, the
 * worker binds it and becomes the agent (a thread of its own), then
 * connects like the others. Two that try at once: one bind wins, the other
 * connects. When the agent's process dies, its workers' connections end;
 * each sends that heartbeat itself (zt_agent_heartbeat returns -2) and the
 * next heartbeat finds or becomes the new agent. The coordinator's timeout
 * is several intervals, so the change costs nobody their membership.
 *
 * Frames on the socket (little-endian u32 fields):
 *   worker -> agent   len, timeout_ms, HeartbeatRequest bytes[len]
 *   agent -> worker   status, error_len, reply_len, error, HeartbeatReply
 * A worker has at most one heartbeat in flight; a frame that breaks this,
 * or is larger than ZT_AGENT_FRAME_MAX, closes that worker's connection.
 * The agent never trusts a frame further: the coordinator judges every
 * entry with its own credential.
 *
 * When the agent calls. It sends one HeartbeatBatch (the entries' bytes
 * are copied into it as they came, not decoded: a HeartbeatBatchEncoded,
 * which is a HeartbeatBatchRequest on the wire) when every connected
 * worker has a heartbeat waiting, when ZT_HB_BATCH_MAX wait, or an
 * interval and a little (a quarter, 20-250 ms) after the last batch.
 * Workers that use the agent wait an interval from the answer rather than
 * from the start of their call (control.c), so the workers one batch
 * answered send their next heartbeats together and the next batch goes as
 * soon as the last is in; a worker out of step waits for the next batch,
 * whose workers are back by then, and is in step from there on: the
 * machine's workers heartbeat together, one call per interval.
 * The call's deadline is the earliest of the entries' deadlines; when it
 * fails, every entry gets the failure's status, as its own call would
 * have.
 */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <xxhash.h>

#include "zt_common.h"
#include "zt_net.h"
#include "zt_rpc.h"

#define ZT_AGENT_FRAME_MAX (4u << 20) /* a heartbeat with a long inventory */
#define ZT_AGENT_BATCH_BYTES (8u << 20) /* one call's entries, at most */
#define ZT_AGENT_ERR_MAX 4096

/* A worker connected to this process's agent. */
typedef struct {
  int fd;
  uint8_t hdr[8];
  size_t got;        /* bytes of hdr, then of body, read so far */
  uint8_t *body;     /* NULL until the header is complete */
  uint32_t len;
  int64_t deadline;  /* the heartbeat's (monotonic ms) */
  int ready;         /* a complete heartbeat waits for the batch */
} peer;

struct zt_agent {
  char coordinator[256];
  struct sockaddr_un addr;
  socklen_t addrlen;
  int fd; /* this worker's connection to the agent; -1: none */
  /* Serving: this process is the machine's agent. */
  pthread_t thread;
  int serving, lfd, wake[2];
  atomic_int stop;
  zt_rpc_client_t *rpc;
  int64_t interval_ms; /* as the last batch's replies asked (thread only) */
  int64_t last_flush_ms; /* when the last batch went (thread only) */
  peer peers[ZT_HB_BATCH_MAX];
  int npeers;
};

/* ---- byte helpers ------------------------------------------------------------ */

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Sends all n bytes of p on fd by the deadline (monotonic ms): 0, or -1
 * when the connection closed, failed or the deadline passed. */
static int write_all(int fd, const void *p, size_t n, int64_t deadline) {
  return zt_net_exact(fd, (void *)p, n, 1, deadline, NULL, NULL);
}

/* Receives all n bytes into p, as write_all. */
static int read_all(int fd, void *p, size_t n, int64_t deadline) {
  return zt_net_exact(fd, p, n, 0, deadline, NULL, NULL);
}

/* ---- the agent (serving side) --------------------------------------------------- */

static void peer_drop(zt_agent_t *a, int i) {
  close(a->peers[i].fd);
  free(a->peers[i].body);
  a->peers[i] = a->peers[--a->npeers];
}

/* Reads what peer i has sent: 0 fine (maybe not complete yet), -1 drop it. */
static int peer_read(zt_agent_t *a, int i) {
  peer *p = &a->peers[i];
  for (;;) {
    uint8_t *dst = p->body ? p->body + p->got : p->hdr + p->got;
    size_t want = p->body ? p->len - p->got : sizeof p->hdr - p->got;
    if (p->ready || !want) return p->ready ? -1 : 0; /* a second heartbeat in flight */
    ssize_t r = recv(p->fd, dst, want, MSG_DONTWAIT);
    if (r == 0) return -1;
    if (r < 0) return errno == EINTR ? 0 : (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
    p->got += (size_t)r;
    if (!p->body && p->got == sizeof p->hdr) {
      p->len = get32(p->hdr);
      if (p->len == 0 || p->len > ZT_AGENT_FRAME_MAX) return -1;
      p->deadline = zt_now_ms() + ZT_MIN(get32(p->hdr + 4), 600000u);
      p->body = malloc(p->len);
      if (!p->body) return -1;
      p->got = 0;
    } else if (p->body && p->got == p->len) {
      p->ready = 1;
      return 0;
    }
  }
}

/* The answer to peer i's heartbeat; the peer waits for the next one. */
static void peer_answer(zt_agent_t *a, int i, uint32_t status, const char *err,
                        const uint8_t *reply, size_t len) {
  peer *p = &a->peers[i];
  size_t el = err ? ZT_MIN(strlen(err), ZT_AGENT_ERR_MAX) : 0;
  uint8_t hdr[12];
  put32(hdr, status), put32(hdr + 4, (uint32_t)el), put32(hdr + 8, (uint32_t)len);
  int64_t dl = zt_now_ms() + 1000; /* a local socket: a peer that reads nothing is dropped */
  if (write_all(p->fd, hdr, sizeof hdr, dl) != 0 || write_all(p->fd, err, el, dl) != 0 ||
      write_all(p->fd, reply, len, dl) != 0) {
    p->ready = -1; /* dropped after the batch */
    return;
  }
  free(p->body);
  p->body = NULL, p->got = 0, p->ready = 0;
}

/* The waiting heartbeats the next batch takes, in idx (at most
 * ZT_HB_BATCH_MAX, their bytes within ZT_AGENT_BATCH_BYTES): their count,
 * and the earliest of their deadlines in *deadline. */
static int batch_pick(const zt_agent_t *a, int *idx, int64_t *deadline) {
  int n = 0;
  size_t bytes = 0;
  *deadline = INT64_MAX;
  for (int i = 0; i < a->npeers && n < ZT_HB_BATCH_MAX; i++) {
    const peer *p = &a->peers[i];
    /* An entry is its bytes and at most 11 of framing (a tag, a length). */
    if (p->ready != 1 || bytes + p->len + 11 > ZT_AGENT_BATCH_BYTES) continue;
    idx[n++] = i;
    bytes += p->len + 11;
    *deadline = ZT_MIN(*deadline, p->deadline);
  }
  return n;
}

/* The HeartbeatBatch request of peers idx[0..n) (*len bytes; free it):
 * their HeartbeatRequest bytes as they came, in a HeartbeatBatchEncoded,
 * which is a HeartbeatBatchRequest on the wire. */
static uint8_t *batch_pack(const zt_agent_t *a, const int *idx, int n, size_t *len) {
  ProtobufCBinaryData beats[ZT_HB_BATCH_MAX];
  for (int k = 0; k < n; k++)
    beats[k] = (ProtobufCBinaryData){a->peers[idx[k]].len, a->peers[idx[k]].body};
  Ztrain__HeartbeatBatchEncoded b = ZTRAIN__HEARTBEAT_BATCH_ENCODED__INIT;
  b.n_beats = (size_t)n;
  b.beats = beats;
  *len = ztrain__heartbeat_batch_encoded__get_packed_size(&b);
  uint8_t *req = zt_xmalloc(*len);
  ztrain__heartbeat_batch_encoded__pack(&b, req);
  return req;
}

/* Answers peer i with its batch entry e, or, without one (the call
 * failed), with the call's status and why. */
static void batch_answer(zt_agent_t *a, int i, const Ztrain__HeartbeatBatchEntry *e, int status,
                         const char *why) {
  if (!e) {
    peer_answer(a, i, (uint32_t)(status ? status : ZT_RPC_INTERNAL), why, NULL, 0);
    return;
  }
  if (e->status || !e->reply) {
    peer_answer(a, i, e->status ? e->status : ZT_RPC_INTERNAL, e->error, NULL, 0);
    return;
  }
  if (e->reply->heartbeat_ms) a->interval_ms = e->reply->heartbeat_ms;
  size_t m = ztrain__heartbeat_reply__get_packed_size(e->reply);
  uint8_t stackbuf[512], *buf = m <= sizeof stackbuf ? stackbuf : zt_xmalloc(m);
  ztrain__heartbeat_reply__pack(e->reply, buf);
  peer_answer(a, i, 0, NULL, buf, m);
  if (buf != stackbuf) free(buf);
}

/* One HeartbeatBatch with every waiting heartbeat, and the answers. */
static void flush(zt_agent_t *a) {
  int idx[ZT_HB_BATCH_MAX];
  int64_t deadline;
  int n = batch_pick(a, idx, &deadline);
  if (!n) return;
  a->last_flush_ms = zt_now_ms();
  size_t len;
  uint8_t *req = batch_pack(a, idx, n, &len);
  /* Answer a little before the earliest deadline, so that the worker
   * hears the failure rather than giving up on the agent. */
  int64_t left = ZT_MAX(50, deadline - zt_now_ms() - 50);
  uint8_t *resp = NULL;
  size_t rlen = 0;
  int status = 0;
  zt_err_clear();
  int rc = zt_rpc_call(a->rpc, "/ztrain.Control/HeartbeatBatch", req, len, left, &resp, &rlen,
                       &status);
  free(req);
  Ztrain__HeartbeatBatchReply *r =
      rc == 0 ? ztrain__heartbeat_batch_reply__unpack(NULL, rlen, resp) : NULL;
  if (rc == 0 && (!r || r->n_replies != (size_t)n)) {
    status = ZT_RPC_INTERNAL;
    zt_err("HeartbeatBatch: the coordinator answered %zu of %d heartbeats",
           r ? r->n_replies : 0, n);
  }
  char why[ZT_ERR_MAX]; /* the call's failure, before an answer's own */
  snprintf(why, sizeof why, "%s", zt_err_msg());
  int whole = r && r->n_replies == (size_t)n;
  for (int k = 0; k < n; k++) batch_answer(a, idx[k], whole ? r->replies[k] : NULL, status, why);
  if (r) ztrain__heartbeat_batch_reply__free_unpacked(r, NULL);
  free(resp);
  for (int i = a->npeers - 1; i >= 0; i--)
    if (a->peers[i].ready < 0) peer_drop(a, i);
}

/* When the waiting heartbeats go (monotonic ms; INT64_MAX: none waits):
 * now when every worker's is here or the batch is full; else an interval
 * and a little after the last batch (by then the workers that batch
 * answered, who wait an interval from their answers, are here too: a
 * worker out of step joins them), and in time for the earliest deadline. */
static int64_t flush_at(const zt_agent_t *a) {
  int ready = 0;
  int64_t first_deadline = INT64_MAX;
  for (int i = 0; i < a->npeers; i++) {
    if (a->peers[i].ready != 1) continue;
    ready++;
    first_deadline = ZT_MIN(first_deadline, a->peers[i].deadline);
  }
  if (!ready) return INT64_MAX;
  if (ready == a->npeers || ready >= ZT_HB_BATCH_MAX) return 0;
  int64_t slack = ZT_MAX(20, ZT_MIN(a->interval_ms / 4, 250));
  return ZT_MIN(a->last_flush_ms + a->interval_ms + slack, first_deadline - 150);
}

static void accept_peers(zt_agent_t *a) {
  for (;;) {
    int fd = accept4(a->lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    if (a->npeers == ZT_HB_BATCH_MAX) { /* it sends its own heartbeats */
      close(fd);
      continue;
    }
    a->peers[a->npeers++] = (peer){.fd = fd};
  }
}

static void *serve(void *arg) {
  zt_agent_t *a = arg;
  while (!atomic_load(&a->stop)) {
    struct pollfd pf[ZT_HB_BATCH_MAX + 2];
    pf[0] = (struct pollfd){a->lfd, POLLIN, 0};
    pf[1] = (struct pollfd){a->wake[0], POLLIN, 0};
    for (int i = 0; i < a->npeers; i++) pf[i + 2] = (struct pollfd){a->peers[i].fd, POLLIN, 0};
    int64_t at = flush_at(a), now = zt_now_ms();
    int tmo = at == INT64_MAX ? 1000 : (int)ZT_MAX(0, ZT_MIN(at - now, 1000));
    int np = a->npeers;
    if (poll(pf, (nfds_t)np + 2, tmo) < 0 && errno != EINTR) break;
    for (int i = np - 1; i >= 0; i--)
      if (pf[i + 2].revents && peer_read(a, i) != 0) peer_drop(a, i);
    if (pf[0].revents) accept_peers(a);
    if (flush_at(a) <= zt_now_ms()) flush(a);
  }
  return NULL;
}

/* Becomes the machine's agent: 0 serving, -1 someone else is (or cannot). */
static int start_serving(zt_agent_t *a) {
  zt_rpc_client_opts_t ro = {.wait_for_ready = 1};
  a->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (a->lfd < 0) return -1;
  if (bind(a->lfd, (struct sockaddr *)&a->addr, a->addrlen) != 0 || listen(a->lfd, 64) != 0)
    goto err;
  if (pipe2(a->wake, O_CLOEXEC) != 0) goto err;
  if (zt_rpc_client_open(a->coordinator, &ro, &a->rpc) != 0) goto err_pipe;
  a->interval_ms = 1000;
  atomic_store(&a->stop, 0);
  if (pthread_create(&a->thread, NULL, serve, a) != 0) goto err_rpc;
  a->serving = 1;
  ZT_INFO("heartbeat agent of this machine: the workers here send their heartbeats through "
          "this one");
  return 0;
err_rpc:
  zt_rpc_client_close(a->rpc);
  a->rpc = NULL;
err_pipe:
  close(a->wake[0]), close(a->wake[1]);
err:
  close(a->lfd);
  a->lfd = -1;
  return -1;
}

static void stop_serving(zt_agent_t *a) {
  if (!a->serving) return;
  atomic_store(&a->stop, 1);
  ssize_t w = write(a->wake[1], "", 1);
  (void)w;
  pthread_join(a->thread, NULL);
  while (a->npeers) peer_drop(a, a->npeers - 1);
  close(a->lfd), close(a->wake[0]), close(a->wake[1]);
  zt_rpc_client_close(a->rpc);
  a->rpc = NULL, a->lfd = -1, a->serving = 0;
}

/* ---- a worker's side -------------------------------------------------------------- */

zt_agent_t *zt_agent_open(const char *coordinator) {
  zt_agent_t *a = zt_xcalloc(1, sizeof *a);
  snprintf(a->coordinator, sizeof a->coordinator, "%s", coordinator);
  a->fd = a->lfd = -1;
  a->addr.sun_family = AF_UNIX;
  /* Abstract (a leading NUL): "ztrain-hb-" and a hash of the address. */
  int n = snprintf(a->addr.sun_path + 1, sizeof a->addr.sun_path - 1, "ztrain-hb-%016llx",
                   (unsigned long long)XXH64(coordinator, strlen(coordinator), 0));
  a->addrlen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
  return a;
}

static int dial(zt_agent_t *a) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (connect(fd, (struct sockaddr *)&a->addr, a->addrlen) == 0) return fd;
  close(fd);
  return -1;
}

/* Connected to the machine's agent (becoming it when there is none). */
static int attach(zt_agent_t *a) {
  if (a->fd >= 0) return 0;
  a->fd = dial(a);
  if (a->fd < 0 && !a->serving && start_serving(a) == 0) a->fd = dial(a);
  if (a->fd < 0) a->fd = dial(a); /* another worker won the bind */
  return a->fd >= 0 ? 0 : -1;
}

static void detach(zt_agent_t *a) {
  if (a->fd >= 0) close(a->fd);
  a->fd = -1;
}

int zt_agent_heartbeat(zt_agent_t *a, const Ztrain__HeartbeatRequest *req, int64_t timeout_ms,
                       ProtobufCMessage **reply, int *status) {
  int64_t deadline = zt_now_ms() + timeout_ms;
  if (attach(a) != 0) return -2;
  size_t n = ztrain__heartbeat_request__get_packed_size(req);
  if (n > ZT_AGENT_FRAME_MAX) return -2; /* too long for the agent: sent directly */
  uint8_t *buf = zt_xmalloc(n + 8);
  put32(buf, (uint32_t)n);
  put32(buf + 4, (uint32_t)ZT_MAX(0, timeout_ms));
  ztrain__heartbeat_request__pack(req, buf + 8);
  int rc = write_all(a->fd, buf, n + 8, deadline);
  free(buf);
  uint8_t hdr[12];
  if (rc != 0 || read_all(a->fd, hdr, sizeof hdr, deadline) != 0) goto gone;
  uint32_t st = get32(hdr), el = get32(hdr + 4), rl = get32(hdr + 8);
  if (el > ZT_AGENT_ERR_MAX || rl > ZT_AGENT_FRAME_MAX) goto gone;
  char err[ZT_AGENT_ERR_MAX + 1];
  uint8_t *body = zt_xmalloc(rl + 1);
  if (read_all(a->fd, err, el, deadline) != 0 ||
      read_all(a->fd, body, rl, deadline) != 0) {
    free(body);
    goto gone;
  }
  err[el] = 0;
  if (st) {
    free(body);
    if (status) *status = (int)st;
    return zt_err("/ztrain.Control/Heartbeat (through this machine's agent): %s: %s",
                  zt_rpc_status_name((int)st), err);
  }
  *reply = (ProtobufCMessage *)ztrain__heartbeat_reply__unpack(NULL, rl, body);
  free(body);
  if (!*reply) {
    if (status) *status = ZT_RPC_INTERNAL;
    return zt_err("/ztrain.Control/Heartbeat (through this machine's agent): the reply does "
                  "not decode");
  }
  return 0;
gone:
  detach(a);
  return -2;
}

int zt_agent_serving(const zt_agent_t *a) { return a && a->serving; }

void zt_agent_close(zt_agent_t *a) {
  if (!a) return;
  detach(a);
  stop_serving(a);
  free(a);
}
