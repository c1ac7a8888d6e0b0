/*
 * comm_tcp.c: the TCP ring backend of comm.h, for CPU workers.
 *
 * Topology. Rank r keeps two TCP connections: one it opened to rank r+1
 * (`next`, it only sends there) and one it accepted from rank r-1 (`prev`,
 * it only receives there). From 3 ranks on (up to ZT_COMM_MESH_MAX) it
 * also opens one to every other rank and accepts one from each (a mesh;
 * the ring's two are among them), for the direct reduce-scatter below.
 * Each connection starts with a handshake naming the session (job and
 * generation) and the sender's rank, in which both ends prove that they
 * hold the generation's key (HMAC-SHA256 over each other's fresh nonce):
 * a rank of another generation, or anything else that reaches the port,
 * is turned away before a single payload byte flows. A connection
 * carries one byte stream in one direction, so every call must send and
 * receive all of its bytes before it returns: the next call's bytes follow
 * them on the same socket.
 *
 * Algorithms. Ring reduce-scatter and ring all-gather, N-1 steps each; an
 * all-reduce is one followed by the other, so each rank sends and receives
 * 2(N-1)/N of the buffer, the bandwidth-optimal amount. Within a step a rank
 * sends one segment to `next` while it receives another from `prev`, both
 * from one poll() loop, and reduces the received bytes into place chunk by
 * chunk as they arrive, so the reduction overlaps the transfer. Segment s
 * of a reduce-scatter ends on rank s (see comm.h), which is the shard layout
 * ZeRO uses. Each collective begins with an operation header from every
 * rank to the next (agree()), so ranks whose calls differ fail at once.
 *
 * ZeRO's gradient reduction (fp32 in, fp64 sums out) runs on the mesh
 * where there is one: each rank sends segment j of its fp32 input straight
 * to rank j and sums the N-1 pieces it receives in the ring's order, so
 * the sums are the ring's to the bit. A ring would carry fp64 partial sums
 * in N-2 of its N-1 steps; the mesh sends (N-1)/N of the fp32 input
 * against the ring's (2N-3)/N (3 against 5 quarters at N = 4), and a
 * piece is summed after one transfer instead of N-1 in a row. Its
 * operation header goes to every rank, so a rank that has not made the
 * call is the one every other rank waits for and names. (An all-gather
 * moves the same bytes either way, and measured the same on the mesh: it
 * stays on the ring.)
 *
 * Failure. Every poll() waits at most until the operation's deadline; the
 * poll set also holds an eventfd that zt_comm_abort() writes. Connections
 * are made non-blocking, under the set-up deadline. A closed or
 * reset socket, a deadline or an abort breaks the communicator with a
 * message naming the peer and the operation; later calls fail at once.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "comm.h"
#include "comm_backend.h"
#include "zt_common.h"

#define ZT_RING_MAGIC 0x5a545247u /* "ZTRG" */
/* 2: every collective starts with an op_header; 3: the mesh; 4: the key's
 * proofs in the handshake */
#define ZT_RING_VERSION 4u
#define ZT_OP_MAGIC 0x5a544f50u   /* "ZTOP" */

struct zt_comm {
  int rank, world;
  int next, prev;           /* the ring neighbours' ranks */
  int next_fd, prev_fd;     /* out_fd[next] and in_fd[prev] (not owned separately) */
  int abort_fd;
  int *out_fd, *in_fd;      /* [world]: the socket to / from each rank, -1 where none */
  int *in_lowat;            /* [world]: SO_RCVLOWAT of in_fd[j] now (set_lowat) */
  size_t *mpos;             /* [2 * world]: a mesh call's bytes sent to / received from each rank */
  int mesh;                 /* every pair of ranks connected (the direct reduce-scatter) */
  size_t chunk;
  uint64_t session;
  /* Set-up (zt_comm_tcp_new to zt_comm_tcp_connect): the listening socket,
   * the peers' addresses (the caller's), the deadline and the key, which
   * is wiped once connected. */
  int listen_fd;
  const char *const *peers;
  int64_t setup_ms;
  char key[129];
  atomic_int err_claimed; /* the first failure or abort writes err, once */
  atomic_int broken;      /* set after err is written */
  /* Set (release) once zt_comm_tcp_connect has set next_fd and prev_fd:
   * zt_comm_stats_get, callable from any thread during the set-up too,
   * reads next_fd only after it reads this set (acquire). */
  atomic_int connected;
  int failed_peer; /* rank whose connection failed, -1 when unknown */
  struct zt_nccl *nccl; /* set: operations go to NCCL (comm_nccl.c) */
  char err[512];
  zt_comm_stats_t stats;
  zt_comm_stats_t *st; /* &stats, or a view's root's (views count into it) */
  /* A view (zt_comm_view): the communicator whose connections it uses
   * (never itself a view) and each view rank's rank there; NULL else. */
  struct zt_comm *root;
  int *rmap;
  uint8_t *scratch;
  size_t scratch_cap;
  uint64_t seq; /* collectives begun on the ring (op_header) */
};

typedef struct {
  uint32_t magic, version;
  uint64_t session;
  uint32_t rank, world;
  uint32_t mesh, pad; /* the sender connects a mesh (comm.h: ring_only) */
  uint8_t nonce[16];  /* the connector's challenge (the handshake, below) */
} ring_hello;

/* ---- bf16 and reductions --------------------------------------------------- */

void zt_comm_reduce_add(void *dst, const void *src, size_t n, zt_dtype_t dt) {
  if (dt == ZT_DT_F64) {
    double *d = dst;
    const double *s = src;
    for (size_t i = 0; i < n; i++) d[i] += s[i];
  } else if (dt == ZT_DT_F32) {
    float *d = dst;
    const float *s = src;
    for (size_t i = 0; i < n; i++) d[i] += s[i];
  } else {
    uint16_t *d = dst;
    const uint16_t *s = src;
    for (size_t i = 0; i < n; i++) d[i] = zt_f32_to_bf16(zt_bf16_to_f32(d[i]) + zt_bf16_to_f32(s[i]));
  }
}

void zt_comm_scale(void *buf, size_t n, zt_dtype_t dt, float s) {
  if (dt == ZT_DT_F64) {
    double *d = buf;
    for (size_t i = 0; i < n; i++) d[i] *= (double)s;
  } else if (dt == ZT_DT_F32) {
    float *d = buf;
    for (size_t i = 0; i < n; i++) d[i] *= s;
  } else {
    uint16_t *d = buf;
    for (size_t i = 0; i < n; i++) d[i] = zt_f32_to_bf16(zt_bf16_to_f32(d[i]) * s);
  }
}

/* AVG's last step: the sum divided by the world size (comm.h). fp64 sums
 * are divided in fp64: a scale by the fp32 reciprocal of the world size
 * would be off in the eighth digit (1.0000000298 for an average of 1.0 on
 * 3 ranks). fp32 and bf16 keep the scale by the fp32 reciprocal. */
static void avg_scale(void *buf, size_t n, zt_dtype_t dt, int world) {
  if (dt == ZT_DT_F64) {
    double *d = buf;
    for (size_t i = 0; i < n; i++) d[i] /= (double)world;
  } else {
    zt_comm_scale(buf, n, dt, 1.0f / (float)world);
  }
}

/* ---- errors ------------------------------------------------------------------ */

/* Claims c's first failure: its message (and the failed peer, when one is
 * known) is kept and c is broken from then on. A later failure, from any
 * thread, leaves the first one's message in place. */
static void claim_error(zt_comm_t *c, const char *msg, int peer) {
  int no = 0;
  if (!atomic_compare_exchange_strong(&c->err_claimed, &no, 1)) return;
  snprintf(c->err, sizeof c->err, "%s", msg);
  if (peer >= 0) c->failed_peer = peer;
  atomic_store(&c->broken, 1);
}

/* Wakes whatever waits on c's sockets (the abort event). */
static void wake_waiters(zt_comm_t *c) {
  uint64_t one = 1;
  ssize_t w = write(c->abort_fd, &one, sizeof one);
  (void)w;
}

/* A view's failure breaks its root too (the generation is over), naming
 * the root's rank, and stops whatever else runs on the root's sockets. */
static void view_failed(zt_comm_t *v) {
  claim_error(v->root, v->err, v->failed_peer >= 0 ? v->rmap[v->failed_peer] : -1);
  wake_waiters(v->root);
}

/* Records the first failure; the communicator is unusable from then on. */
static int fail(zt_comm_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(zt_comm_t *c, const char *fmt, ...) {
  char msg[sizeof c->err];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  claim_error(c, msg, -1);
  /* An abort from another thread may be writing err: it is done when
   * broken is set, a few instructions later. */
  while (!atomic_load(&c->broken)) sched_yield();
  if (c->root) view_failed(c);
  return zt_err("%s", c->err);
}

static int check_usable(zt_comm_t *c, const char *op) {
  if (!atomic_load(&c->broken) && !(c->root && atomic_load(&c->root->broken))) return 0;
  zt_comm_t *b = atomic_load(&c->broken) ? c : c->root;
  return zt_err("%s: communicator unusable after an earlier failure: %s", op,
                b->err[0] ? b->err : "aborted");
}

/* ---- the transfer engine ---------------------------------------------------- */

/* One step of a ring algorithm: send `slen` bytes to next while receiving
 * `rlen` bytes from prev into `rbuf`. When `acc` is set, received bytes are
 * added (as dt elements) into `acc` chunk by chunk as they arrive; with
 * `own` set, acc is written instead: own (fp32, widened) plus what arrived. */
typedef struct {
  const uint8_t *sbuf;
  size_t slen;
  uint8_t *rbuf;
  size_t rlen;
  uint8_t *acc;
  zt_dtype_t dt;
  int widen;        /* the received elements are fp32, acc is fp64 */
  const float *own; /* acc = (double)own + received (fp32-input reduce-scatter) */
} ring_step;

/* acc[i] += (double)src[i]: a received fp32 element, exactly. */
static void add_widened(double *acc, const float *src, size_t n) {
  for (size_t i = 0; i < n; i++) acc[i] += (double)src[i];
}

/* acc[i] = (double)own[i] + src[i], src fp32 (widened) or fp64: the one
 * rounding add_widened or an fp64 reduce_add makes once own has been
 * widened into acc (IEEE addition is commutative), without that copy. */
static void add_own(double *acc, const float *own, const uint8_t *src, size_t n, int src32) {
  if (src32) {
    const float *f = (const float *)src;
    for (size_t i = 0; i < n; i++) acc[i] = (double)own[i] + (double)f[i];
  } else {
    const double *d = (const double *)src;
    for (size_t i = 0; i < n; i++) acc[i] = (double)own[i] + d[i];
  }
}

static int step_run_timed(zt_comm_t *c, const ring_step *s, zt_deadline_t dl, const char *op);

static int step_run(zt_comm_t *c, const ring_step *s, zt_deadline_t dl, const char *op) {
  int64_t t0 = zt_now_us();
  int rc = step_run_timed(c, s, dl, op);
  __atomic_fetch_add(&c->st->comm_us, (uint64_t)(zt_now_us() - t0), __ATOMIC_RELAXED);
  return rc;
}

/* The receive socket reports readable only once a quarter chunk (or what
 * is still to come, if less: the wait always ends) has arrived. On a link
 * slower than the CPU a receiver otherwise wakes for every few packets,
 * and each wake-up takes a core from the compute that the transfer
 * overlaps. On 2 Gbit/s links (network namespaces, tbf) this cut the CPU
 * time of 20 all-reduces of 16 MiB from 0.37 to 0.26-0.30 s per rank at 2
 * ranks and from 0.45 to 0.38 s at 4, at the same bandwidth; on loopback
 * the bus bandwidths stayed within their run-to-run spread (a whole chunk
 * saved a little more CPU on the link but cost loopback bandwidth at 4
 * ranks). */
static void set_lowat(zt_comm_t *c, int from, size_t want) {
  int v = (int)ZT_MIN(want, ZT_MIN(c->chunk / 4, (size_t)INT32_MAX));
  if (v < 1) v = 1;
  /* A view's sockets are its root's: one record of each socket's value. */
  int *now = c->root ? &c->root->in_lowat[c->rmap[from]] : &c->in_lowat[from];
  if (v == *now) return;
  if (setsockopt(c->in_fd[from], SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v) == 0) *now = v;
}

static int step_run_timed(zt_comm_t *c, const ring_step *s, zt_deadline_t dl, const char *op) {
  size_t sent = 0, got = 0, reduced = 0, esz = zt_dtype_size(s->dt);
  while (sent < s->slen || got < s->rlen) {
    struct pollfd p[3];
    int n = 0, ip = -1, is = -1;
    p[n++] = (struct pollfd){.fd = c->abort_fd, .events = POLLIN};
    if (sent < s->slen) is = n, p[n++] = (struct pollfd){.fd = c->next_fd, .events = POLLOUT};
    if (got < s->rlen) {
      ip = n, p[n++] = (struct pollfd){.fd = c->prev_fd, .events = POLLIN};
      set_lowat(c, c->prev, s->rlen - got);
    }
    int64_t left = zt_deadline_left_ms(dl);
    if (left == 0) {
      c->failed_peer = got < s->rlen ? c->prev : c->next;
      return fail(c, "%s: timed out (rank %d: %zu/%zu bytes from rank %d, %zu/%zu to rank %d)",
                  op, c->rank, got, s->rlen, c->prev, sent, s->slen, c->next);
    }
    int64_t w0 = ip < 0 ? zt_now_us() : 0; /* only the send is left: its wait */
    int r = poll(p, (nfds_t)n, left == INT64_MAX ? -1 : (int)ZT_MIN(left, 1000000));
    if (ip < 0)
      __atomic_fetch_add(&c->st->send_wait_us, (uint64_t)(zt_now_us() - w0), __ATOMIC_RELAXED);
    if (r < 0) {
      if (errno == EINTR) continue;
      return fail(c, "%s: poll: %s", op, strerror(errno));
    }
    if (p[0].revents) return fail(c, "%s: aborted", op);
    if (is >= 0 && p[is].revents) {
      size_t want = ZT_MIN(s->slen - sent, c->chunk);
      ssize_t w = send(c->next_fd, s->sbuf + sent, want, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0 && errno != EAGAIN && errno != EINTR && (c->failed_peer = c->next, 1))
        return fail(c, "%s: send to rank %d: %s", op, c->next, strerror(errno));
      if (w > 0) sent += (size_t)w, __atomic_fetch_add(&c->st->bytes_sent, (uint64_t)w, __ATOMIC_RELAXED);
    }
    if (ip >= 0 && p[ip].revents) {
      size_t want = ZT_MIN(s->rlen - got, c->chunk);
      ssize_t rd = recv(c->prev_fd, s->rbuf + got, want, MSG_DONTWAIT);
      if (rd == 0) {
        c->failed_peer = c->prev;
        return fail(c, "%s: rank %d closed the connection", op, c->prev);
      }
      if (rd < 0 && errno != EAGAIN && errno != EINTR && (c->failed_peer = c->prev, 1))
        return fail(c, "%s: receive from rank %d: %s", op, c->prev, strerror(errno));
      if (rd > 0) got += (size_t)rd, __atomic_fetch_add(&c->st->bytes_recv, (uint64_t)rd, __ATOMIC_RELAXED);
      if (s->acc) {
        /* Reduce whole chunks as they complete, and the tail at the end. */
        size_t ready = got == s->rlen ? got : (got / c->chunk) * c->chunk;
        if (ready > reduced && s->own)
          add_own((double *)s->acc + reduced / esz, s->own + reduced / esz, s->rbuf + reduced,
                  (ready - reduced) / esz, s->widen);
        else if (ready > reduced && s->widen)
          add_widened((double *)s->acc + reduced / esz, (const float *)(s->rbuf + reduced),
                      (ready - reduced) / esz);
        else if (ready > reduced)
          zt_comm_reduce_add(s->acc + reduced, s->rbuf + reduced, (ready - reduced) / esz, s->dt);
        reduced = ready > reduced ? ready : reduced;
      }
    }
  }
  return 0;
}

static uint8_t *scratch(zt_comm_t *c, size_t n) {
  if (n > c->scratch_cap) {
    free(c->scratch);
    c->scratch = zt_xmalloc(n);
    c->scratch_cap = n;
  }
  return c->scratch;
}

/* Segment layout of an all-reduce over `count` elements: the first
 * count % world segments get one extra element. */
static void segment(size_t count, int world, int i, size_t *off, size_t *len) {
  size_t base = count / (size_t)world, extra = count % (size_t)world, ui = (size_t)i;
  *off = ui * base + ZT_MIN(ui, extra);
  *len = base + (ui < extra ? 1 : 0);
}

static int mod(int a, int n) { return ((a % n) + n) % n; }

/* Ring reduce-scatter in place: afterwards segment `rank` of buf holds the
 * full reduction. Segments given by (count, uniform) layout. */
static int ring_reduce_scatter(zt_comm_t *c, uint8_t *buf, size_t count, zt_dtype_t dt,
                               zt_deadline_t dl, const char *op) {
  size_t esz = zt_dtype_size(dt), maxseg = count / (size_t)c->world + 1;
  uint8_t *tmp = scratch(c, maxseg * esz);
  for (int st = 0; st < c->world - 1; st++) {
    size_t so, sl, ro, rl;
    segment(count, c->world, mod(c->rank - st - 1, c->world), &so, &sl);
    segment(count, c->world, mod(c->rank - st - 2, c->world), &ro, &rl);
    ring_step s = {buf + so * esz, sl * esz, tmp, rl * esz, buf + ro * esz, dt, 0, NULL};
    if (step_run(c, &s, dl, op) != 0) return -1;
  }
  return 0;
}

/* The reduce-scatter of fp32 input into fp64 sums, the input staying as it
 * is: segment i of the input at src + i * stride, count elements each.
 * The first step sends this rank's fp32 segment from src (its values are
 * exact in fp32, so they need no more bits); every step writes this rank's
 * own values (widened) plus what arrived into an fp64 buffer, which the
 * next step sends, since partial sums need fp64. The buffers alternate
 * between `out` and scratch so that the last step's sums land in `out`:
 * the same values and order as widening the input and calling
 * ring_reduce_scatter on fp64, in fewer bytes and without the widened
 * copy of world * count elements. */
static int ring_reduce_scatter32(zt_comm_t *c, const float *src, size_t stride, double *out,
                                 size_t count, zt_deadline_t dl, const char *op) {
  int w = c->world;
  uint8_t *tmp = scratch(c, 2 * count * sizeof(double));
  double *other = (double *)(tmp + count * sizeof(double));
  const double *sent = NULL; /* the sums the previous step made */
  for (int st = 0; st < w - 1; st++) {
    int si = mod(c->rank - st - 1, w), ri = mod(c->rank - st - 2, w);
    double *acc = (w - 2 - st) % 2 == 0 ? out : other;
    size_t esz = st == 0 ? sizeof(float) : sizeof(double);
    const uint8_t *sbuf = st == 0 ? (const uint8_t *)(src + (size_t)si * stride) : (const uint8_t *)sent;
    ring_step s = {sbuf, count * esz, tmp, count * esz, (uint8_t *)acc,
                   st == 0 ? ZT_DT_F32 : ZT_DT_F64, st == 0, src + (size_t)ri * stride};
    if (step_run(c, &s, dl, op) != 0) return -1;
    sent = acc;
  }
  return 0;
}

/* ---- the direct reduce-scatter (mesh) ------------------------------------------ */

/* out[lo, hi) = the sums of segment `rank` in the ring's order: rank+1's
 * value, plus rank+2's, ..., plus this rank's own last (in + j * count
 * holds rank j's values). ring_reduce_scatter32 adds the same values in
 * the same order, each addition rounded once in fp64, so the two give the
 * same bits (test_comm checks it). */
static void mesh_sum(const zt_comm_t *c, double *out, const float *in, const float *own,
                     size_t count, size_t lo, size_t hi) {
  int w = c->world;
  const float *a = in + (size_t)((c->rank + 1) % w) * count;
  for (size_t i = lo; i < hi; i++) out[i] = (double)a[i];
  for (int k = 2; k < w; k++) {
    const float *p = in + (size_t)((c->rank + k) % w) * count;
    for (size_t i = lo; i < hi; i++) out[i] += (double)p[i];
  }
  for (size_t i = lo; i < hi; i++) out[i] += (double)own[i];
}

/* Fails a mesh call at its deadline, naming every rank it still waited
 * for (up to 8); the first of them, in ring order from the predecessor
 * back, is reported as the failed peer. */
static int mesh_timeout(zt_comm_t *c, size_t bytes, const char *op) {
  const size_t *sent = c->mpos, *got = c->mpos + c->world;
  char list[320] = "";
  size_t len = 0;
  int named = 0;
  for (int k = 1; k < c->world && named < 8; k++) {
    int j = mod(c->rank - k, c->world);
    if (got[j] >= bytes && sent[j] >= bytes) continue;
    if (!named++) c->failed_peer = j;
    int w = snprintf(list + len, sizeof list - len, "%s%zu/%zu bytes from rank %d, %zu/%zu to it",
                     len ? "; " : "", got[j], bytes, j, sent[j], bytes);
    len = w > 0 ? ZT_MIN(len + (size_t)w, sizeof list - 1) : len;
  }
  return fail(c, "%s: timed out (rank %d: %s)", op, c->rank, list);
}

/* A mesh call: every rank sends `bytes` to every other rank and receives
 * as many from each, all at once. Rank j gets send + j * sstride (0: the
 * same bytes to every rank); rank j's bytes land at recv + j * rstride.
 * With `sum` (the reduce-scatter), the received fp32 values are summed
 * into sum->out as soon as a chunk has arrived from every rank. */
typedef struct {
  double *out;
  const float *own;
  size_t count;
} mesh_sum_t;

typedef struct {
  const uint8_t *send;
  size_t sstride;
  uint8_t *recv;
  size_t rstride, bytes;
  const mesh_sum_t *sum;
} mesh_call;

/* One poll() round of the exchange: sends to and receives from every rank
 * whose socket is ready. `pf[k]`/`who[k]` are the poll set mesh_run built. */
static int mesh_io(zt_comm_t *c, const struct pollfd *pf, const int *who, int n,
                   const mesh_call *m, const char *op) {
  size_t *sent = c->mpos, *got = c->mpos + c->world;
  for (int k = 1; k < n; k++) {
    if (!pf[k].revents) continue;
    int j = who[k];
    if (pf[k].events & POLLOUT) {
      const uint8_t *b = m->send + (size_t)j * m->sstride;
      ssize_t w = send(pf[k].fd, b + sent[j], ZT_MIN(m->bytes - sent[j], c->chunk),
                       MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0 && errno != EAGAIN && errno != EINTR && (c->failed_peer = j, 1))
        return fail(c, "%s: send to rank %d: %s", op, j, strerror(errno));
      if (w > 0) sent[j] += (size_t)w, __atomic_fetch_add(&c->st->bytes_sent, (uint64_t)w, __ATOMIC_RELAXED);
      continue;
    }
    uint8_t *b = m->recv + (size_t)j * m->rstride;
    ssize_t rd = recv(pf[k].fd, b + got[j], ZT_MIN(m->bytes - got[j], c->chunk), MSG_DONTWAIT);
    if (rd == 0 && (c->failed_peer = j, 1))
      return fail(c, "%s: rank %d closed the connection", op, j);
    if (rd < 0 && errno != EAGAIN && errno != EINTR && (c->failed_peer = j, 1))
      return fail(c, "%s: receive from rank %d: %s", op, j, strerror(errno));
    if (rd <= 0) continue; /* EAGAIN, EINTR */
    got[j] += (size_t)rd;
    __atomic_fetch_add(&c->st->bytes_recv, (uint64_t)rd, __ATOMIC_RELAXED);
    /* Acknowledge at once, not after the delayed-ACK timer: a sender's
     * smoothed RTT is what link_rtt_ms reports (docs/deploy.md), and with
     * delayed ACKs on the mesh's receives a healthy link between
     * namespaces read 1-4 ms instead of 0.1-0.2 ms, too close to the
     * 8-30 ms of a link slowed to 10 Mbit/s (tests/multihost,
     * test_partitions). Quick-ack mode ends by itself, hence every time. */
    int one = 1;
    setsockopt(pf[k].fd, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof one);
  }
  return 0;
}

/* Runs a mesh call from one poll() loop until every byte is sent, received
 * and summed, or until the deadline or an abort. The wait while only sends
 * are left counts as send_wait_us, as on the ring. */
static int mesh_run(zt_comm_t *c, const mesh_call *m, zt_deadline_t dl, const char *op) {
  int w = c->world, n, rc = 0;
  size_t *sent = c->mpos, *got = c->mpos + w, summed = 0;
  size_t step = ZT_MAX(c->chunk / sizeof(float), 1), count = m->sum ? m->sum->count : 0;
  struct pollfd *pf = zt_xmalloc((size_t)(2 * w + 1) * sizeof *pf);
  int *who = zt_xmalloc((size_t)(2 * w + 1) * sizeof *who);
  memset(c->mpos, 0, 2 * (size_t)w * sizeof *c->mpos);
  sent[c->rank] = got[c->rank] = m->bytes; /* nothing to itself */
  int64_t t0 = zt_now_us();
  for (;;) {
    size_t have = m->bytes; /* bytes received from every rank */
    n = 0;
    pf[n++] = (struct pollfd){.fd = c->abort_fd, .events = POLLIN};
    for (int j = 0; j < w; j++) {
      have = ZT_MIN(have, got[j]);
      if (sent[j] < m->bytes) who[n] = j, pf[n++] = (struct pollfd){.fd = c->out_fd[j], .events = POLLOUT};
      if (got[j] < m->bytes) {
        set_lowat(c, j, m->bytes - got[j]);
        who[n] = j, pf[n++] = (struct pollfd){.fd = c->in_fd[j], .events = POLLIN};
      }
    }
    size_t ready = !m->sum ? 0 : have == m->bytes ? count : (have / sizeof(float)) / step * step;
    if (ready > summed) {
      mesh_sum(c, m->sum->out, (const float *)m->recv, m->sum->own, count, summed, ready);
      summed = ready;
      continue;
    }
    if (n == 1) break; /* everything sent, received and summed */
    int64_t left = zt_deadline_left_ms(dl);
    if (left == 0) {
      rc = mesh_timeout(c, m->bytes, op);
      break;
    }
    int only_sends = 1;
    for (int k = 1; k < n; k++) only_sends &= (pf[k].events & POLLOUT) != 0;
    int64_t w0 = only_sends ? zt_now_us() : 0;
    int r = poll(pf, (nfds_t)n, left == INT64_MAX ? -1 : (int)ZT_MIN(left, 1000000));
    if (only_sends)
      __atomic_fetch_add(&c->st->send_wait_us, (uint64_t)(zt_now_us() - w0), __ATOMIC_RELAXED);
    if (r < 0 && errno != EINTR) {
      rc = fail(c, "%s: poll: %s", op, strerror(errno));
      break;
    }
    if (r > 0 && pf[0].revents) {
      rc = fail(c, "%s: aborted", op);
      break;
    }
    if (r > 0 && (rc = mesh_io(c, pf, who, n, m, op)) != 0) break;
  }
  __atomic_fetch_add(&c->st->comm_us, (uint64_t)(zt_now_us() - t0), __ATOMIC_RELAXED);
  free(pf);
  free(who);
  return rc;
}

/* The reduce-scatter of fp32 input into fp64 sums over the mesh: every
 * rank sends segment j of its input, as fp32, straight to rank j, and
 * receives every other rank's values of its own segment (rank j's at
 * scratch + j * count); the sums are made in the ring's order (mesh_sum)
 * as soon as a chunk has arrived from every rank. Each rank sends N-1
 * segments of fp32, where the ring sends one of fp32 and N-2 of fp64
 * partial sums: 3 segments' worth of bytes against 5 at N = 4, half the
 * fp64 ring's as N grows; and a piece of the gradient is summed after one
 * transfer instead of N-1 in a row. */
static int mesh_reduce_scatter32(zt_comm_t *c, const float *src, size_t stride, double *out,
                                 size_t count, zt_deadline_t dl, const char *op) {
  size_t bytes = count * sizeof(float);
  uint8_t *in = scratch(c, (size_t)c->world * bytes);
  mesh_sum_t sum = {out, src + (size_t)c->rank * stride, count};
  mesh_call m = {(const uint8_t *)src, stride * sizeof(float), in, bytes, bytes, &sum};
  return mesh_run(c, &m, dl, op);
}

/* ---- agreeing on the operation ------------------------------------------------ */

/* Every collective on the ring starts with this header from each rank to
 * the next. The ring carries bytes without any other framing, so ranks
 * whose calls differ (another operation, type, count or root, or a call
 * one of them skipped) would otherwise reduce one another's bytes into
 * wrong sums, or wait until the deadline; with it the collective fails at
 * once, naming both calls. 32 bytes and one message latency per call. */
typedef struct {
  uint32_t magic;
  uint8_t op, dt, pad[2];
  uint32_t arg, pad2; /* the reduction (all-reduce, reduce-scatter) or the root (broadcast) */
  uint64_t count;     /* elements per rank's segment, or of the whole buffer (all-reduce, broadcast) */
  uint64_t seq;       /* this call's number on the communicator, from 1 */
} op_header;

enum { OPH_ALL_REDUCE = 1, OPH_REDUCE_SCATTER, OPH_RS_FIRST32, OPH_ALL_GATHER, OPH_BROADCAST,
       OPH_ALL_TO_ALL };

static const char *op_name(unsigned op) {
  static const char *names[] = {"?", "all-reduce", "reduce-scatter", "fp32-into-fp64 reduce-scatter",
                                "all-gather", "broadcast", "all-to-all"};
  return op < ZT_ARRAY_LEN(names) ? names[op] : "?";
}

static const char *dt_name(unsigned dt) {
  return dt == ZT_DT_F32 ? "fp32" : dt == ZT_DT_BF16 ? "bf16" : dt == ZT_DT_F64 ? "fp64" : "?";
}

/* 0 when rank `from`'s header is this rank's call; else the failure,
 * naming both calls. */
static int check_header(zt_comm_t *c, const op_header *mine, const op_header *got, int from,
                        const char *name) {
  if (got->magic == mine->magic && got->op == mine->op && got->dt == mine->dt &&
      got->arg == mine->arg && got->count == mine->count && got->seq == mine->seq)
    return 0;
  if (got->magic != ZT_OP_MAGIC)
    return fail(c, "%s: rank %d sent no operation header (another version, or a stream out of step)",
                name, from);
  return fail(c, "%s: the ranks' calls differ: rank %d is at collective %llu, %s of %llu %s "
                 "elements (arg %u); rank %d at collective %llu, %s of %llu %s elements (arg %u)",
              name, from, (unsigned long long)got->seq, op_name(got->op),
              (unsigned long long)got->count, dt_name(got->dt), got->arg, c->rank,
              (unsigned long long)mine->seq, op_name(mine->op), (unsigned long long)mine->count,
              dt_name(mine->dt), mine->arg);
}

static int agree(zt_comm_t *c, int op, zt_dtype_t dt, uint32_t arg, size_t count,
                 zt_deadline_t dl, const char *name) {
  op_header mine = {ZT_OP_MAGIC, (uint8_t)op, (uint8_t)dt, {0}, arg, 0, count, ++c->seq}, got;
  ring_step s = {(const uint8_t *)&mine, sizeof mine, (uint8_t *)&got, sizeof got, NULL, dt, 0, NULL};
  if (step_run(c, &s, dl, name) != 0) return -1;
  return check_header(c, &mine, &got, c->prev, name);
}

/* A mesh call's header goes to every rank and comes from every rank. A
 * rank that has not made the call (or is gone) is then the one every other
 * rank waits for and names (on the ring only its successor would, and the
 * others would wait for that successor's data), and every rank sees a
 * call that differs from its own. (N-1) x 32 bytes, one message latency. */
static int mesh_agree(zt_comm_t *c, int op, zt_dtype_t dt, uint32_t arg, size_t count,
                      zt_deadline_t dl, const char *name) {
  op_header mine = {ZT_OP_MAGIC, (uint8_t)op, (uint8_t)dt, {0}, arg, 0, count, ++c->seq};
  op_header *got = zt_xcalloc((size_t)c->world, sizeof *got);
  mesh_call m = {(const uint8_t *)&mine, 0, (uint8_t *)got, sizeof *got, sizeof *got, NULL};
  int rc = mesh_run(c, &m, dl, name);
  for (int k = 1; rc == 0 && k < c->world; k++) {
    int j = mod(c->rank - k, c->world);
    rc = check_header(c, &mine, &got[j], j, name);
  }
  free(got);
  return rc;
}

static int ring_all_gather(zt_comm_t *c, uint8_t *buf, size_t count, zt_dtype_t dt,
                           zt_deadline_t dl, const char *op) {
  size_t esz = zt_dtype_size(dt);
  for (int st = 0; st < c->world - 1; st++) {
    size_t so, sl, ro, rl;
    segment(count, c->world, mod(c->rank - st, c->world), &so, &sl);
    segment(count, c->world, mod(c->rank - st - 1, c->world), &ro, &rl);
    ring_step s = {buf + so * esz, sl * esz, buf + ro * esz, rl * esz, NULL, dt, 0, NULL};
    if (step_run(c, &s, dl, op) != 0) return -1;
  }
  return 0;
}

/* ---- public operations --------------------------------------------------------- */

/* An NCCL operation's outcome: a failure breaks the communicator like a
 * TCP one does. */
static int nccl_result(zt_comm_t *c, int rc) {
  return rc == 0 ? 0 : fail(c, "%s", zt_err_msg());
}

zt_comm_t *zt__comm_wrap(struct zt_nccl *n, int rank, int world) {
  zt_comm_t *c = zt_xcalloc(1, sizeof *c);
  c->st = &c->stats;
  c->rank = rank, c->world = world, c->nccl = n;
  c->next = (rank + 1) % world, c->prev = mod(rank - 1, world);
  c->next_fd = c->prev_fd = c->listen_fd = -1;
  c->failed_peer = -1;
  c->abort_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  return c;
}

int zt_comm_all_reduce(zt_comm_t *c, void *buf, size_t count, zt_dtype_t dt, zt_redop_t op,
                       int64_t timeout_ms) {
  if (check_usable(c, "all-reduce") != 0) return -1;
  __atomic_fetch_add(&c->st->ops, 1, __ATOMIC_RELAXED);
  if (c->nccl) return nccl_result(c, zt__nccl_all_reduce(c->nccl, buf, count, dt, op, timeout_ms));
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  if (c->world > 1 && agree(c, OPH_ALL_REDUCE, dt, op, count, dl, "all-reduce") != 0) return -1;
  if (c->world > 1 && count > 0) {
    if (ring_reduce_scatter(c, buf, count, dt, dl, "all-reduce") != 0) return -1;
    if (op == ZT_RED_AVG) {
      size_t o, l;
      segment(count, c->world, c->rank, &o, &l);
      avg_scale((uint8_t *)buf + o * zt_dtype_size(dt), l, dt, c->world);
    }
    return ring_all_gather(c, buf, count, dt, dl, "all-reduce");
  }
  return 0;
}

int zt_comm_reduce_scatter(zt_comm_t *c, void *send, void *recv, size_t count, zt_dtype_t dt,
                           zt_redop_t op, int64_t timeout_ms) {
  if (check_usable(c, "reduce-scatter") != 0) return -1;
  __atomic_fetch_add(&c->st->ops, 1, __ATOMIC_RELAXED);
  if (c->nccl)
    return nccl_result(c, zt__nccl_reduce_scatter(c->nccl, send, recv, count, dt, op, timeout_ms));
  size_t esz = zt_dtype_size(dt), total = count * (size_t)c->world;
  uint8_t *mine = (uint8_t *)send + (size_t)c->rank * count * esz;
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  if (c->world > 1 && agree(c, OPH_REDUCE_SCATTER, dt, op, count, dl, "reduce-scatter") != 0)
    return -1;
  if (c->world > 1 && count > 0 &&
      ring_reduce_scatter(c, send, total, dt, dl, "reduce-scatter") != 0)
    return -1;
  if (op == ZT_RED_AVG && c->world > 1) avg_scale(mine, count, dt, c->world);
  if (count && (uint8_t *)recv != mine) memmove(recv, mine, count * esz);
  return 0;
}

int zt_comm_reduce_scatter_f32to64(zt_comm_t *c, const float *send, size_t stride, double *recv,
                                   size_t count, int64_t timeout_ms) {
  if (check_usable(c, "reduce-scatter") != 0) return -1;
  if (c->nccl) return zt_err("reduce-scatter from fp32 into fp64: not available over NCCL");
  if (stride < count) return zt_err("reduce-scatter: stride %zu below count %zu", stride, count);
  __atomic_fetch_add(&c->st->ops, 1, __ATOMIC_RELAXED);
  if (c->world == 1) {
    for (size_t i = 0; i < count; i++) recv[i] = (double)send[i];
    return 0;
  }
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  if (c->mesh) {
    if (mesh_agree(c, OPH_RS_FIRST32, ZT_DT_F64, ZT_RED_SUM, count, dl, "reduce-scatter") != 0)
      return -1;
    return count ? mesh_reduce_scatter32(c, send, stride, recv, count, dl, "reduce-scatter") : 0;
  }
  if (agree(c, OPH_RS_FIRST32, ZT_DT_F64, ZT_RED_SUM, count, dl, "reduce-scatter") != 0) return -1;
  if (count == 0) return 0;
  return ring_reduce_scatter32(c, send, stride, recv, count, dl, "reduce-scatter");
}

int zt_comm_all_gather(zt_comm_t *c, const void *send, void *recv, size_t count, zt_dtype_t dt,
                       int64_t timeout_ms) {
  if (check_usable(c, "all-gather") != 0) return -1;
  __atomic_fetch_add(&c->st->ops, 1, __ATOMIC_RELAXED);
  if (c->nccl) return nccl_result(c, zt__nccl_all_gather(c->nccl, send, recv, count, dt, timeout_ms));
  size_t esz = zt_dtype_size(dt);
  uint8_t *mine = (uint8_t *)recv + (size_t)c->rank * count * esz;
  if (count && (const uint8_t *)send != mine) memmove(mine, send, count * esz);
  if (c->world == 1) return 0;
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  if (agree(c, OPH_ALL_GATHER, dt, 0, count, dl, "all-gather") != 0) return -1;
  if (count == 0) return 0;
  return ring_all_gather(c, recv, count * (size_t)c->world, dt, dl, "all-gather");
}

/* Where no direct connection joins every pair (a ring of 3 or more), the
 * all-to-all is an all-gather of every rank's whole send buffer, of which
 * each rank keeps what is addressed to it: N times the bytes, but any
 * ring can do it. */
static int ring_all_to_all(zt_comm_t *c, const uint8_t *send, uint8_t *recv, size_t bytes,
                           zt_deadline_t dl) {
  size_t w = (size_t)c->world, row = w * bytes;
  uint8_t *all = scratch(c, w * row);
  memcpy(all + (size_t)c->rank * row, send, row);
  if (ring_all_gather(c, all, row * w / 2, ZT_DT_BF16, dl, "all-to-all") != 0) return -1;
  for (size_t j = 0; j < w; j++)
    memcpy(recv + j * bytes, all + j * row + (size_t)c->rank * bytes, bytes);
  return 0;
}

int zt_comm_all_to_all(zt_comm_t *c, const void *send, void *recv, size_t bytes,
                       int64_t timeout_ms) {
  if (check_usable(c, "all-to-all") != 0) return -1;
  if (c->nccl) return zt_err("all-to-all: not available over NCCL");
  if (bytes % 2) return zt_err("all-to-all: %zu bytes a rank, not a whole number of words", bytes);
  __atomic_fetch_add(&c->st->ops, 1, __ATOMIC_RELAXED);
  const uint8_t *s = send;
  uint8_t *r = recv;
  memcpy(r + (size_t)c->rank * bytes, s + (size_t)c->rank * bytes, bytes);
  if (c->world == 1) return 0;
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  int direct = c->mesh || c->world == 2;
  if ((direct ? mesh_agree : agree)(c, OPH_ALL_TO_ALL, ZT_DT_BF16, 0, bytes, dl, "all-to-all") != 0)
    return -1;
  if (bytes == 0) return 0;
  if (!direct) return ring_all_to_all(c, s, r, bytes, dl);
  mesh_call m = {s, bytes, r, bytes, bytes, NULL};
  return mesh_run(c, &m, dl, "all-to-all");
}

int zt_comm_broadcast(zt_comm_t *c, void *buf, size_t count, zt_dtype_t dt, int root,
                      int64_t timeout_ms) {
  if (check_usable(c, "broadcast") != 0) return -1;
  if (root < 0 || root >= c->world) return zt_err("broadcast: root %d out of range", root);
  __atomic_fetch_add(&c->st->ops, 1, __ATOMIC_RELAXED);
  if (c->nccl) return nccl_result(c, zt__nccl_broadcast(c->nccl, buf, count, dt, root, timeout_ms));
  if (c->world == 1) return 0;
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  if (agree(c, OPH_BROADCAST, dt, (uint32_t)root, count, dl, "broadcast") != 0) return -1;
  /* Pass the buffer around the ring from root, chunk-pipelined by the
   * socket buffers: each rank forwards what it received, except the last. */
  size_t len = count * zt_dtype_size(dt);
  int pos = mod(c->rank - root, c->world); /* 0 for root */
  for (size_t off = 0; off < len; off += c->chunk) {
    size_t n = ZT_MIN(c->chunk, len - off);
    uint8_t *p = (uint8_t *)buf + off;
    if (pos > 0) {
      ring_step r = {NULL, 0, p, n, NULL, dt, 0, NULL};
      if (step_run(c, &r, dl, "broadcast") != 0) return -1;
    }
    if (pos < c->world - 1) {
      ring_step s = {p, n, NULL, 0, NULL, dt, 0, NULL};
      if (step_run(c, &s, dl, "broadcast") != 0) return -1;
    }
  }
  return 0;
}

int zt_comm_barrier(zt_comm_t *c, int64_t timeout_ms) {
  float one = 1.0f;
  if (zt_comm_all_reduce(c, &one, 1, ZT_DT_F32, ZT_RED_SUM, timeout_ms) != 0)
    return zt_err_wrap("barrier");
  return 0;
}

/* ---- stream order (comm.h; NCCL only) --------------------------------------- */

int zt_comm_set_stream(zt_comm_t *c, void *stream) {
  if (!c->nccl) return zt_err("stream order: a TCP communicator works on host memory");
  return nccl_result(c, zt__nccl_set_stream(c->nccl, stream));
}

int zt_comm_reduce_scatter_async(zt_comm_t *c, void *send, void *recv, size_t count,
                                 zt_dtype_t dt, zt_redop_t op, int64_t timeout_ms,
                                 uint64_t *ticket) {
  if (check_usable(c, "reduce-scatter") != 0) return -1;
  if (!c->nccl) return zt_err("reduce-scatter: asynchronous over NCCL only");
  __atomic_fetch_add(&c->st->ops, 1, __ATOMIC_RELAXED);
  return nccl_result(c, zt__nccl_reduce_scatter_async(c->nccl, send, recv, count, dt, op,
                                                      timeout_ms, ticket));
}

int zt_comm_all_gather_async(zt_comm_t *c, const void *send, void *recv, size_t count,
                             zt_dtype_t dt, int64_t timeout_ms, uint64_t *ticket) {
  if (check_usable(c, "all-gather") != 0) return -1;
  if (!c->nccl) return zt_err("all-gather: asynchronous over NCCL only");
  __atomic_fetch_add(&c->st->ops, 1, __ATOMIC_RELAXED);
  return nccl_result(c, zt__nccl_all_gather_async(c->nccl, send, recv, count, dt, timeout_ms,
                                                  ticket));
}

int zt_comm_join(zt_comm_t *c, uint64_t ticket) {
  if (check_usable(c, "join") != 0) return -1;
  return c->nccl ? nccl_result(c, zt__nccl_join(c->nccl, ticket)) : 0;
}

/* Not refused on a broken communicator: the NCCL side still has to end
 * what is in flight (an abort raised by zt_comm_abort takes effect here). */
int zt_comm_progress(zt_comm_t *c) {
  if (c->nccl && zt__nccl_progress(c->nccl) != 0) return nccl_result(c, -1);
  return check_usable(c, "collective in flight");
}

int zt_comm_settle(zt_comm_t *c) {
  if (c->nccl && zt__nccl_settle(c->nccl) != 0) return nccl_result(c, -1);
  return check_usable(c, "collective in flight");
}

void zt_comm_abort(zt_comm_t *c) {
  claim_error(c, "aborted", -1);
  wake_waiters(c);
  if (c->nccl) zt__nccl_abort(c->nccl);
}

int zt_comm_broken(const zt_comm_t *c) {
  return atomic_load(&c->broken) || (c->root && atomic_load(&c->root->broken));
}
int zt_comm_failed_peer(const zt_comm_t *c) { return c->failed_peer; }
int zt_comm_rank(const zt_comm_t *c) { return c->rank; }
int zt_comm_world(const zt_comm_t *c) { return c->world; }
const char *zt_comm_backend(const zt_comm_t *c) { return c->nccl ? "nccl" : "tcp"; }
int zt_comm_device_memory(const zt_comm_t *c) { return c->nccl != NULL; }
int zt_comm_f32_direct(const zt_comm_t *c) { return !c->nccl && (c->mesh || c->world == 2); }
void zt_comm_stats_get(const zt_comm_t *c, zt_comm_stats_t *s) {
  s->bytes_sent = __atomic_load_n(&c->st->bytes_sent, __ATOMIC_RELAXED);
  s->bytes_recv = __atomic_load_n(&c->st->bytes_recv, __ATOMIC_RELAXED);
  s->ops = __atomic_load_n(&c->st->ops, __ATOMIC_RELAXED);
  s->comm_us = __atomic_load_n(&c->st->comm_us, __ATOMIC_RELAXED);
  s->send_wait_us = __atomic_load_n(&c->st->send_wait_us, __ATOMIC_RELAXED);
  s->next_rtt_us = 0;
  struct tcp_info ti;
  socklen_t len = sizeof ti;
  if (atomic_load_explicit(&c->connected, memory_order_acquire) && c->next_fd >= 0 &&
      getsockopt(c->next_fd, IPPROTO_TCP, TCP_INFO, &ti, &len) == 0)
    s->next_rtt_us = ti.tcpi_rtt;
}

void zt_comm_destroy(zt_comm_t *c) {
  if (!c) return;
  if (c->root) { /* the sockets and the abort event are the root's */
    free(c->out_fd), free(c->in_fd), free(c->mpos), free(c->rmap), free(c->scratch), free(c);
    return;
  }
  if (c->nccl) zt__nccl_destroy(c->nccl);
  for (int j = 0; c->out_fd && j < c->world; j++) {
    if (c->out_fd[j] >= 0) close(c->out_fd[j]);
    if (c->in_fd[j] >= 0) close(c->in_fd[j]);
  }
  free(c->out_fd);
  free(c->in_fd);
  free(c->in_lowat);
  free(c->mpos);
  if (c->abort_fd >= 0) close(c->abort_fd);
  if (c->listen_fd >= 0) close(c->listen_fd);
  free(c->scratch);
  free(c);
}

int zt_comm_view(zt_comm_t *c, const int *ranks, int n, zt_comm_t **out) {
  zt_comm_t *root = c->root ? c->root : c;
  *out = NULL;
  if (c->nccl) return zt_err("a view of the ranks: not available over NCCL");
  if (n < 1 || n > c->world) return zt_err("a view of %d ranks out of %d", n, c->world);
  int me = -1, *rmap = zt_xcalloc((size_t)n, sizeof *rmap);
  for (int i = 0; i < n; i++) {
    if (ranks[i] < 0 || ranks[i] >= c->world) {
      free(rmap);
      return zt_err("a view's rank %d out of range (world %d)", ranks[i], c->world);
    }
    for (int k = 0; k < i; k++)
      if (ranks[k] == ranks[i]) {
        free(rmap);
        return zt_err("a view names rank %d twice", ranks[i]);
      }
    rmap[i] = c->root ? c->rmap[ranks[i]] : ranks[i];
    if (ranks[i] == c->rank) me = i;
  }
  if (me < 0) {
    free(rmap);
    return zt_err("a view without this rank (%d)", c->rank);
  }
  /* Every pair of members needs its two connections: the mesh has them. */
  for (int i = 0; i < n; i++) {
    int j = rmap[i];
    if (i != me && (root->out_fd[j] < 0 || root->in_fd[j] < 0)) {
      free(rmap);
      return zt_err("a view of ranks %d and %d: no direct connection between them (the mesh "
                    "joins every pair from 3 to %d ranks)", root->rank, j, ZT_COMM_MESH_MAX);
    }
  }
  zt_comm_t *v = zt_xcalloc(1, sizeof *v);
  v->root = root, v->rmap = rmap;
  v->rank = me, v->world = n;
  v->next = (me + 1) % n, v->prev = mod(me - 1, n);
  v->out_fd = zt_xcalloc((size_t)n, sizeof *v->out_fd);
  v->in_fd = zt_xcalloc((size_t)n, sizeof *v->in_fd);
  for (int i = 0; i < n; i++)
    v->out_fd[i] = i == me ? -1 : root->out_fd[rmap[i]], v->in_fd[i] = i == me ? -1 : root->in_fd[rmap[i]];
  v->next_fd = n > 1 ? v->out_fd[v->next] : -1;
  v->prev_fd = n > 1 ? v->in_fd[v->prev] : -1;
  v->mpos = zt_xcalloc(2 * (size_t)n, sizeof *v->mpos);
  v->mesh = n >= 3;
  v->chunk = root->chunk, v->session = root->session;
  v->abort_fd = root->abort_fd, v->listen_fd = -1;
  v->failed_peer = -1;
  v->st = root->st;
  atomic_store(&v->connected, 1);
  *out = v;
  return 0;
}

/* ---- connection set-up ------------------------------------------------------- */

int zt_comm_tcp_listen(const char *host, int *port, int *fd_out) {
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)*port);
  if (inet_pton(AF_INET, host, &sa.sin_addr) != 1)
    return zt_err("comm listen: %s is not an IPv4 address", host);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return zt_err_errno("comm listen: socket");
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 64) != 0) {
    zt_err_errno("comm listen on %s:%d", host, *port);
    close(fd);
    return -1;
  }
  socklen_t sl = sizeof sa;
  getsockname(fd, (struct sockaddr *)&sa, &sl);
  *port = ntohs(sa.sin_port);
  *fd_out = fd;
  return 0;
}

/* Ring sockets: no Nagle delay; and, besides the deadline every ring call
 * has, the kernel gives up on a peer that vanished without FIN or RST
 * (a host gone, a link down): keepalive probes after 5 s of silence, and
 * unacknowledged data abandoned after 60 s (TCP_USER_TIMEOUT).
 *
 * A fixed send buffer of ZT_RING_SNDBUF (the kernel doubles it for its
 * bookkeeping: about one 1 MiB chunk queued per connection) instead of
 * autotuning's up to 4 MiB (net.ipv4.tcp_wmem): a sender may run only that
 * far ahead of its receiver, so the bytes a receiver copies out of its
 * socket were written moments before and are still in cache. With 4 MiB
 * per connection the queued bytes of a ring outgrow the caches and the
 * receive copy runs from DRAM: on loopback (2 cores, 4 ranks, 64 MiB) it
 * was half of all CPU time, and capping the buffer raised bus bandwidth
 * 1.5-2.3x at 16 and 64 MiB, 2 and 4 ranks, and halved the CPU time
 * (bench/allreduce; more when other jobs share the cores). The receive
 * buffer keeps autotuning (capping it too cost wake-ups and gained
 * nothing). 1 MiB in flight still covers the bandwidth-delay product of a
 * 10 Gb/s link at up to ~0.5 ms round trip. Only the pacing changes: the
 * bytes and the order they are summed in are the same (test_comm.c checks
 * the order bit for bit). */
#define ZT_RING_SNDBUF (512 << 10)
static void tune(int fd) {
  int one = 1, idle = 5, intvl = 2, cnt = 3, sndbuf = ZT_RING_SNDBUF;
  unsigned user_timeout_ms = 60000;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

/* zt_io_exact's wait on a ring socket: until the socket is ready, the
 * deadline passes or zt_comm_abort() writes to the abort pipe. */
static int ring_wait(void *user, int fd, short events, zt_deadline_t dl) {
  zt_comm_t *c = user;
  int64_t left = zt_deadline_left_ms(dl);
  if (left == 0) return zt_err("timed out");
  struct pollfd p[2] = {{.fd = fd, .events = events}, {.fd = c->abort_fd, .events = POLLIN}};
  if (poll(p, 2, (int)ZT_MIN(left, 1000000)) > 0 && p[1].revents) return zt_err("aborted");
  return 0;
}

/* Blocking-with-deadline exact read/write on a non-blocking socket, which
 * zt_comm_abort() interrupts. */
static int io_exact(zt_comm_t *c, int fd, void *buf, size_t len, int writing, zt_deadline_t dl) {
  return zt_io_exact(fd, buf, len, writing, dl, ring_wait, c);
}

/* Waits for a non-blocking connect() until the deadline or an abort:
 * the outcome as an errno value (0: connected; ETIMEDOUT; ECANCELED:
 * aborted). A blocking connect() to an address that drops packets would
 * wait for the kernel's SYN retries, about two minutes, whatever the
 * deadline. */
static int connect_wait(zt_comm_t *c, int fd, zt_deadline_t dl) {
  for (;;) {
    int64_t left = zt_deadline_left_ms(dl);
    if (left == 0) return ETIMEDOUT;
    struct pollfd p[2] = {{.fd = fd, .events = POLLOUT}, {.fd = c->abort_fd, .events = POLLIN}};
    int r = poll(p, 2, left == INT64_MAX ? -1 : (int)ZT_MIN(left, 1000000));
    if (r < 0 && errno != EINTR) return errno;
    if (r > 0 && p[1].revents) return ECANCELED;
    if (r > 0 && p[0].revents) {
      int e = 0;
      socklen_t len = sizeof e;
      if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0) return errno;
      return e;
    }
  }
}

/* ---- the handshake ------------------------------------------------------------
 *
 * Every connection proves, both ways, that its two ends hold the
 * generation's key (RendezvousReply.comm_key, which the coordinator gives
 * only to the generation's ranks): without it, anything that reaches a
 * rank's port could take its predecessor's place and feed it bytes.
 *
 *   connector -> acceptor  hello:  session, rank, world, mesh, nonce_c
 *   acceptor -> connector  accept: its rank, nonce_a,
 *                                  HMAC(key, 'A' hello rank_a nonce_a)
 *   connector -> acceptor  proof:  HMAC(key, 'C' hello rank_a nonce_a)
 *
 * Each side's MAC covers the other's fresh nonce, so a recorded handshake
 * proves nothing a second time, and the key itself never crosses the
 * ring. The acceptor checks the hello's fields first (a rank of another
 * generation is turned away with a message naming both sessions) and
 * answers at once; the proofs are read only after every rank has accepted
 * its connections, so no rank waits for another's accept loop, which
 * waits for its own predecessor's in turn (a ring of such waits would
 * never end).
 *
 * The hello's fields are no secret, so a connection that merely says it
 * is rank j proves nothing: up to ZT_RING_CANDIDATES connections per rank
 * are answered and wait for their proofs side by side, and the first that
 * proves the key is rank j's. An impostor that comes first, then stalls or
 * sends a wrong proof, is refused and costs the ring nothing; only a flood
 * of such connections could still hold a rank's own out until the
 * deadline. */

#define ZT_RING_NONCE 16
#define ZT_RING_MAC 32
#define ZT_RING_ACCEPT_MAGIC 0x5a545241u /* "ZTRA" */

typedef struct {
  uint32_t magic; /* ZT_RING_ACCEPT_MAGIC */
  uint32_t rank;  /* the acceptor's */
  uint8_t nonce[ZT_RING_NONCE];
  uint8_t mac[ZT_RING_MAC];
} ring_accept;
_Static_assert(sizeof(ring_hello) == 48 && sizeof(ring_accept) == 56, "ring handshake layout");

/* An accepted connection whose hello named a rank, until it proves the
 * key: the proof it must send. More than one connection may say it is
 * the same rank (an impostor may come first); the first that proves the
 * key becomes in_fd[rank], and the others are closed. */
#define ZT_RING_CANDIDATES 4
typedef struct {
  int fd; /* -1: a free slot */
  uint8_t want[ZT_RING_MAC];
} candidate;

/* Set-up state: what this rank sent to each rank it connected to, and the
 * connections that said they were each rank. */
typedef struct {
  ring_hello *sent;                       /* [world] */
  candidate (*cand)[ZT_RING_CANDIDATES];  /* [world] */
  char refused[256]; /* why the last candidate was refused, for the error */
} handshake;


/* HMAC-SHA256 under the generation's key of: tag, the hello, and the
 * acceptor's rank and nonce. */
static int ring_mac(const zt_comm_t *c, char tag, const ring_hello *h, uint32_t rank_a,
                    const uint8_t nonce_a[ZT_RING_NONCE], uint8_t out[ZT_RING_MAC]) {
  uint8_t msg[1 + sizeof *h + 4 + ZT_RING_NONCE];
  msg[0] = (uint8_t)tag;
  memcpy(msg + 1, h, sizeof *h);
  memcpy(msg + 1 + sizeof *h, &rank_a, 4);
  memcpy(msg + 5 + sizeof *h, nonce_a, ZT_RING_NONCE);
  unsigned n = 0;
  if (!HMAC(EVP_sha256(), c->key, (int)strlen(c->key), msg, sizeof msg, out, &n) ||
      n != ZT_RING_MAC)
    return zt_err("comm: HMAC-SHA256 failed");
  return 0;
}

static int mac_equal(const uint8_t *a, const uint8_t *b) {
  return CRYPTO_memcmp(a, b, ZT_RING_MAC) == 0;
}

static int nonce(uint8_t out[ZT_RING_NONCE]) { return zt_random_bytes(out, ZT_RING_NONCE); }

/* Connects to rank `to` and sends our hello; retries refused connections
 * (the peer may not listen yet) until the deadline or an abort. */
static int peer_connect(zt_comm_t *c, const char *peer, int to, handshake *hs, zt_deadline_t dl) {
  char host[256];
  int port;
  if (zt_parse_hostport(peer, host, sizeof host, &port) != 0)
    return zt_err_wrap("address of rank %d", to);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  if (inet_pton(AF_INET, host, &sa.sin_addr) != 1)
    return zt_err("address of rank %d: %s is not an IPv4 address", to, host);
  ring_hello *h = &hs->sent[to];
  *h = (ring_hello){ZT_RING_MAGIC, ZT_RING_VERSION, c->session, (uint32_t)c->rank,
                    (uint32_t)c->world, (uint32_t)c->mesh, 0, {0}};
  if (nonce(h->nonce) != 0) return -1;
  for (;;) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return zt_err_errno("socket");
    int e = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0 ? 0 : errno;
    if (e == EINPROGRESS) e = connect_wait(c, fd, dl);
    if (e == ECANCELED) {
      close(fd);
      return zt_err("aborted while connecting to rank %d at %s", to, peer);
    }
    if (e == 0) {
      tune(fd);
      if (io_exact(c, fd, h, sizeof *h, 1, dl) != 0) {
        close(fd);
        return zt_err_wrap("hello to rank %d at %s", to, peer);
      }
      c->out_fd[to] = fd;
      return 0;
    }
    close(fd);
    if (zt_deadline_passed(dl))
      return zt_err("cannot connect to rank %d at %s: %s", to, peer, strerror(e));
    /* Pace the retries on the abort eventfd: an attempt that fails at
     * once (no route, refused) never reaches connect_wait's poll, and
     * would otherwise retry until the deadline after zt_comm_abort(). */
    struct pollfd p = {.fd = c->abort_fd, .events = POLLIN};
    int pr = poll(&p, 1, 20);
    if (pr < 0 && errno != EINTR)
      return zt_err_errno("comm: poll while connecting to rank %d at %s", to, peer);
    if (pr > 0 && p.revents)
      return zt_err("aborted while connecting to rank %d at %s (last attempt: %s)", to, peer,
                    strerror(e));
  }
}

/* 1 when rank j connects to this one: its ring predecessor, or on a mesh
 * any other rank. */
static int expects(const zt_comm_t *c, int j) { return j != c->rank && (c->mesh || j == c->prev); }

/* A free candidate slot of rank `from`; NULL when all are taken. */
static candidate *free_candidate(handshake *hs, int from) {
  for (int i = 0; i < ZT_RING_CANDIDATES; i++)
    if (hs->cand[from][i].fd < 0) return &hs->cand[from][i];
  return NULL;
}

/* The hello of a connection just accepted: 1 when it is one this rank
 * waits for (its ring predecessor's, or on a mesh any rank's not yet
 * proven) of this generation and ring version, and there is room for
 * another connection that says it is that rank. */
static int hello_ok(const zt_comm_t *c, const ring_hello *h, handshake *hs) {
  int from = (int)h->rank;
  int ok = h->magic == ZT_RING_MAGIC && h->version == ZT_RING_VERSION &&
           h->session == c->session && (int)h->world == c->world &&
           h->mesh == (uint32_t)c->mesh && h->rank < (uint32_t)c->world && expects(c, from) &&
           c->in_fd[from] < 0;
  if (ok && !free_candidate(hs, from)) {
    ZT_WARN("comm: refused a connection that said it was rank %d: %d others that said so "
            "are still to prove the ring key", from, ZT_RING_CANDIDATES);
    return 0;
  }
  if (!ok)
    ZT_WARN("comm: refused a peer (ring version %u, rank %u of %u, session %llx, %s; "
            "expected version %u, %s of %d, session %llx, %s)",
            h->magic == ZT_RING_MAGIC ? h->version : 0, h->rank, h->world,
            (unsigned long long)h->session, h->mesh ? "mesh" : "ring", ZT_RING_VERSION,
            c->mesh ? "a rank not yet connected" : "the ring predecessor", c->world,
            (unsigned long long)c->session, c->mesh ? "mesh" : "ring");
  return ok;
}

/* Answers a valid hello with our accept message, and keeps the
 * connection as a candidate for its rank with the proof it must send. */
static int answer_hello(zt_comm_t *c, int fd, const ring_hello *h, handshake *hs,
                        zt_deadline_t dl) {
  candidate *k = free_candidate(hs, (int)h->rank);
  ring_accept a = {.magic = ZT_RING_ACCEPT_MAGIC, .rank = (uint32_t)c->rank};
  if (nonce(a.nonce) != 0 || ring_mac(c, 'A', h, a.rank, a.nonce, a.mac) != 0 ||
      ring_mac(c, 'C', h, a.rank, a.nonce, k->want) != 0 ||
      io_exact(c, fd, &a, sizeof a, 1, dl) != 0)
    return -1;
  k->fd = fd;
  return 0;
}

/* How long an accepted connection may take to send its hello. A rank
 * sends it as soon as it is connected, so this only bounds what a stray
 * connection (a port scan, a process of an old generation) can hold up
 * the accept loop, which reads one hello at a time. */
#define ZT_RING_HELLO_MS 2000

/* Accepts one connection: reads its hello (for at most
 * ZT_RING_HELLO_MS) and, when it is one this rank waits for, answers it
 * and keeps it as a candidate (1); 0 when there was nothing to accept or
 * the connection was dropped. */
static int accept_one(zt_comm_t *c, int lfd, handshake *hs, zt_deadline_t dl) {
  int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
  if (fd < 0) {
    /* Out of descriptors or buffers: the connection stays queued, so
     * pace the retries instead of spinning on it until the deadline. */
    if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
      ZT_WARN("comm: accept: %s", strerror(errno));
      zt_sleep_ms(20);
    }
    return 0;
  }
  tune(fd);
  ring_hello h;
  int64_t left = zt_deadline_left_ms(dl);
  if (io_exact(c, fd, &h, sizeof h, 0, zt_deadline_in(ZT_MIN(left, ZT_RING_HELLO_MS))) != 0) {
    ZT_WARN("comm: dropped a connection without a hello: %s", zt_err_msg());
    close(fd);
    return 0;
  }
  if (!hello_ok(c, &h, hs) || answer_hello(c, fd, &h, hs, dl) != 0) {
    close(fd);
    return 0;
  }
  return 1;
}

/* Polls the listening socket and the abort eventfd; 1 when a connection
 * waits, 0 on a timeout, -1 on an abort or error. */
static int wait_listen(zt_comm_t *c, int lfd, int64_t ms) {
  struct pollfd p[2] = {{.fd = lfd, .events = POLLIN}, {.fd = c->abort_fd, .events = POLLIN}};
  int pr = poll(p, 2, (int)ZT_MIN(ms, 1000000));
  if (pr < 0 && errno != EINTR) return zt_err_errno("comm: poll while accepting peers");
  if (pr <= 0) return 0;
  if (p[1].revents) return zt_err("aborted while waiting for peers to connect");
  return 1;
}

/* Accepts connections until every rank that connects to this one (the
 * predecessor on a ring, every other rank on a mesh) has at least one
 * candidate connection with a valid hello, and answers each; a
 * connection of another session, world or ring version, or from this
 * rank itself, is dropped. */
static int accept_peers(zt_comm_t *c, int lfd, handshake *hs, zt_deadline_t dl) {
  for (;;) {
    int missing = -1;
    for (int k = 1; k < c->world && missing < 0; k++) { /* the predecessor first */
      int j = mod(c->rank - k, c->world);
      int have = 0;
      for (int i = 0; i < ZT_RING_CANDIDATES; i++) have |= hs->cand[j][i].fd >= 0;
      if (expects(c, j) && !have) missing = j;
    }
    if (missing < 0) return 0;
    int64_t left = zt_deadline_left_ms(dl);
    if (left == 0) return zt_err("rank %d did not connect in time", missing);
    int w = wait_listen(c, lfd, left);
    if (w < 0) return -1;
    if (w > 0) (void)accept_one(c, lfd, hs, dl);
  }
}

/* The connector's half: checks rank `to`'s accept message (its MAC proves
 * the key) and sends our proof. */
static int prove_to(zt_comm_t *c, const char *peer, int to, handshake *hs, zt_deadline_t dl) {
  ring_accept a;
  uint8_t mac[ZT_RING_MAC];
  if (io_exact(c, c->out_fd[to], &a, sizeof a, 0, dl) != 0)
    return zt_err_wrap("rank %d at %s refused the handshake (another generation, ring version "
                       "or key?)", to, peer);
  if (a.magic != ZT_RING_ACCEPT_MAGIC || a.rank != (uint32_t)to)
    return zt_err("rank %d at %s answered the handshake as something else (rank %u)", to, peer,
                  a.rank);
  if (ring_mac(c, 'A', &hs->sent[to], a.rank, a.nonce, mac) != 0) return -1;
  if (!mac_equal(mac, a.mac))
    return zt_err("the listener at %s, rank %d's address, does not hold this generation's ring "
                  "key", peer, to);
  if (ring_mac(c, 'C', &hs->sent[to], a.rank, a.nonce, mac) != 0 ||
      io_exact(c, c->out_fd[to], mac, sizeof mac, 1, dl) != 0)
    return zt_err_wrap("proof to rank %d at %s", to, peer);
  return 0;
}

/* Reads the proof of candidate k of rank `from` (it is readable: at most
 * ZT_RING_HELLO_MS for all of it). A proof of the key makes it in_fd[from]
 * and closes the rank's other candidates; any other answer closes it. */
static void take_proof(zt_comm_t *c, int from, candidate *k, handshake *hs) {
  uint8_t mac[ZT_RING_MAC];
  if (io_exact(c, k->fd, mac, sizeof mac, 0, zt_deadline_in(ZT_RING_HELLO_MS)) != 0 ||
      !mac_equal(mac, k->want)) {
    snprintf(hs->refused, sizeof hs->refused,
             "the connection that said it was rank %d does not hold this generation's ring key",
             from);
    ZT_WARN("comm: %s (refused)", hs->refused);
    close(k->fd);
    k->fd = -1;
    return;
  }
  c->in_fd[from] = k->fd;
  k->fd = -1;
  for (int i = 0; i < ZT_RING_CANDIDATES; i++)
    if (hs->cand[from][i].fd >= 0) {
      close(hs->cand[from][i].fd);
      hs->cand[from][i].fd = -1;
    }
}

/* The acceptor's half: waits until every rank that connects to this one
 * has proven the key on one of its candidate connections. Connections are
 * still accepted meanwhile: where an impostor that said it was rank j came
 * first, rank j's own connection may be the next one, or still queued. */
static int await_proofs(zt_comm_t *c, int lfd, handshake *hs, zt_deadline_t dl) {
  size_t cap = 2 + (size_t)c->world * ZT_RING_CANDIDATES;
  struct pollfd *p = zt_xmalloc(cap * sizeof *p);
  int *who = zt_xmalloc(cap * sizeof *who), rc = -1;
  for (;;) {
    int n = 2, unproven = -1;
    p[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
    p[1] = (struct pollfd){.fd = c->abort_fd, .events = POLLIN};
    for (int k = 1; k < c->world; k++) {
      int j = mod(c->rank - k, c->world);
      if (!expects(c, j) || c->in_fd[j] >= 0) continue;
      if (unproven < 0) unproven = j;
      for (int i = 0; i < ZT_RING_CANDIDATES; i++)
        if (hs->cand[j][i].fd >= 0)
          who[n] = j * ZT_RING_CANDIDATES + i,
          p[n++] = (struct pollfd){.fd = hs->cand[j][i].fd, .events = POLLIN};
    }
    if (unproven < 0) {
      rc = 0;
      break;
    }
    int64_t left = zt_deadline_left_ms(dl);
    if (left == 0) {
      zt_err("rank %d did not prove this generation's ring key in time%s%s", unproven,
             hs->refused[0] ? ": " : "", hs->refused);
      break;
    }
    int pr = poll(p, (nfds_t)n, (int)ZT_MIN(left, 1000000));
    if (pr < 0 && errno != EINTR) {
      zt_err_errno("comm: poll while waiting for the peers' proofs");
      break;
    }
    if (pr <= 0) continue;
    if (p[1].revents) {
      zt_err("aborted while waiting for the peers' proofs of the ring key");
      break;
    }
    for (int i = 2; i < n; i++)
      if (p[i].revents) {
        int j = who[i] / ZT_RING_CANDIDATES;
        candidate *k = &hs->cand[j][who[i] % ZT_RING_CANDIDATES];
        if (k->fd == p[i].fd && c->in_fd[j] < 0) take_proof(c, j, k, hs);
      }
    if (p[0].revents) (void)accept_one(c, lfd, hs, dl);
  }
  free(p);
  free(who);
  return rc;
}

/* The sockets' tables, every entry -1 (no socket). */
static void alloc_peers(zt_comm_t *c) {
  size_t w = (size_t)c->world;
  c->out_fd = zt_xmalloc(w * sizeof *c->out_fd);
  c->in_fd = zt_xmalloc(w * sizeof *c->in_fd);
  c->in_lowat = zt_xcalloc(w, sizeof *c->in_lowat);
  c->mpos = zt_xcalloc(2 * w, sizeof *c->mpos);
  for (size_t j = 0; j < w; j++) c->out_fd[j] = c->in_fd[j] = -1;
}

int zt_comm_tcp_new(const zt_comm_tcp_opts_t *o, zt_comm_t **out) {
  if (o->world < 1 || o->rank < 0 || o->rank >= o->world) {
    if (o->listen_fd >= 0) close(o->listen_fd);
    return zt_err("comm: rank %d of world %d is invalid", o->rank, o->world);
  }
  zt_comm_t *c = zt_xcalloc(1, sizeof *c);
  c->st = &c->stats;
  c->rank = o->rank;
  c->world = o->world;
  c->next = (c->rank + 1) % c->world;
  c->prev = mod(c->rank - 1, c->world);
  c->session = o->session;
  /* Received bytes are reduced a whole chunk of elements at a time. */
  c->chunk = o->chunk_bytes ? ZT_MAX(8, o->chunk_bytes & ~(size_t)7) : (1u << 20);
  c->mesh = !o->ring_only && c->world >= 3 && c->world <= ZT_COMM_MESH_MAX;
  c->next_fd = c->prev_fd = -1;
  c->failed_peer = -1;
  c->listen_fd = o->listen_fd;
  c->peers = o->peers;
  c->setup_ms = o->connect_timeout_ms > 0 ? o->connect_timeout_ms : 30000;
  snprintf(c->key, sizeof c->key, "%s", o->key ? o->key : "");
  alloc_peers(c);
  c->abort_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (c->abort_fd < 0) {
    zt_err_errno("comm: eventfd");
    zt_comm_destroy(c);
    return -1;
  }
  *out = c;
  return 0;
}

/* Connects, accepts, then proves the key on every connection (see the
 * handshake above). */
static int handshake_all(zt_comm_t *c, handshake *hs, zt_deadline_t dl) {
  /* Connect and say hello first (it sits in the peer's socket buffer),
   * then accept, then exchange proofs: no rank waits for another to
   * accept before it accepts itself. A mesh connects to every rank in
   * ring order from its successor on. */
  for (int k = 1; k < c->world && (k == 1 || c->mesh); k++) {
    int j = (c->rank + k) % c->world;
    if (peer_connect(c, c->peers[j], j, hs, dl) != 0) return -1;
  }
  if (accept_peers(c, c->listen_fd, hs, dl) != 0) return -1;
  for (int k = 1; k < c->world && (k == 1 || c->mesh); k++) {
    int j = (c->rank + k) % c->world;
    if (prove_to(c, c->peers[j], j, hs, dl) != 0) return -1;
  }
  return await_proofs(c, c->listen_fd, hs, dl);
}

int zt_comm_tcp_connect(zt_comm_t *c) {
  handshake hs = {0};
  int rc = -1;
  if (check_usable(c, "comm set-up") != 0) goto out;
  if (c->world > 1) {
    if (strlen(c->key) < 32) {
      zt_err("no ring key, or one shorter than 32 characters (RendezvousReply.comm_key)");
      goto out;
    }
    hs.sent = zt_xcalloc((size_t)c->world, sizeof *hs.sent);
    hs.cand = zt_xcalloc((size_t)c->world, sizeof *hs.cand);
    for (int j = 0; j < c->world; j++)
      for (int i = 0; i < ZT_RING_CANDIDATES; i++) hs.cand[j][i].fd = -1;
    if (handshake_all(c, &hs, zt_deadline_in(c->setup_ms)) != 0) goto out;
    c->next_fd = c->out_fd[c->next];
    c->prev_fd = c->in_fd[c->prev];
  }
  atomic_store_explicit(&c->connected, 1, memory_order_release);
  rc = 0;
out:
  if (c->listen_fd >= 0) close(c->listen_fd);
  c->listen_fd = -1;
  c->peers = NULL;
  explicit_bzero(c->key, sizeof c->key);
  free(hs.sent);
  for (int j = 0; hs.cand && j < c->world; j++) /* connections that proved nothing */
    for (int i = 0; i < ZT_RING_CANDIDATES; i++)
      if (hs.cand[j][i].fd >= 0) close(hs.cand[j][i].fd);
  free(hs.cand);
  if (rc != 0) { /* broken from now on, with this message unless aborted first */
    zt_err_wrap("comm rank %d/%d", c->rank, c->world);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", zt_err_msg());
    fail(c, "%s", msg);
    zt_err("%s", msg);
  }
  return rc;
}

int zt_comm_tcp_create(const zt_comm_tcp_opts_t *o, zt_comm_t **out) {
  zt_comm_t *c;
  if (zt_comm_tcp_new(o, &c) != 0) return -1;
  if (zt_comm_tcp_connect(c) != 0) {
    zt_comm_destroy(c);
    return -1;
  }
  *out = c;
  return 0;
}
