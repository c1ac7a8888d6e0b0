/*
 * comm_ring.c: the TCP backend of comm.h, for CPU workers: the ring and
 * mesh collectives over the connections that comm_handshake.c makes.
 *
 * Topology. Rank r keeps two TCP connections: one it opened to rank r+1
 * (`next`, it only sends there) and one it accepted from rank r-1 (`prev`,
 * it only receives there). From 3 ranks on (up to ZT_COMM_MESH_MAX) it
 * also opens one to every other rank and accepts one from each (a mesh;
 * the ring's two are among them), for the direct reduce-scatter below.
 * How they are made, and how each end proves the generation's key before
 * a payload byte flows, is comm_handshake.c's. A connection carries one
 * byte stream in one direction, so every call must send and receive all
 * of its bytes before it returns: the next call's bytes follow them on the
 * same socket.
 *
 * Algorithms. Ring reduce-scatter and ring all-gather, N-1 steps each; an
 * all-reduce is one followed by the other, so each rank sends and receives
 * 2(N-1)/N of the buffer, the bandwidth-optimal amount. Within a step a rank
 * sends one segment to `next` while it receives another from `prev`, and
 * the received bytes are reduced into place chunk by chunk as they arrive
 * (the step itself, and the mesh's exchange, run in comm_transfer.c).
 * Segment s of a reduce-scatter ends on rank s (see comm.h), which is the
 * shard layout ZeRO uses. Each collective begins with an operation header
 * from every rank to the next (agree()), so ranks whose calls differ fail
 * at once.
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
 * Failure. A closed or reset socket, a deadline or an abort ends the
 * operation with a message naming the peer and the operation (and
 * c->failed_peer set to it); the front (comm.c) then breaks the
 * communicator, so later calls fail at once.
 *
 * Views (zt_comm_view) are ring communicators over some of the ranks whose
 * connection tables hold their root's sockets: the same code runs on them
 * unchanged. The table of operations (ring_ops, at the end) is what the
 * front dispatches to; zt_comm_tcp_new makes a communicator with it.
 */
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "comm.h"
#include "comm_impl.h"
#include "comm_ring.h"
#include "zt_common.h"

#define ZT_OP_MAGIC 0x5a544f50u /* "ZTOP" */

static int mod(int a, int n) { return zt__ring_mod(a, n); }

/* ---- reductions and scratch --------------------------------------------- */

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

/* The communicator's scratch buffer, at least n bytes (what a received
 * segment, or the mesh's pieces, land in before they are reduced). */
static uint8_t *scratch(zt__ring_t *r, size_t n) {
  if (n > r->scratch_cap) {
    free(r->scratch);
    r->scratch = zt_xmalloc(n);
    r->scratch_cap = n;
  }
  return r->scratch;
}

/* ---- ring algorithms ----------------------------------------------------- */

/* Segment layout of an all-reduce over `count` elements: the first
 * count % world segments get one extra element. */
static void segment(size_t count, int world, int i, size_t *off, size_t *len) {
  size_t base = count / (size_t)world, extra = count % (size_t)world, ui = (size_t)i;
  *off = ui * base + ZT_MIN(ui, extra);
  *len = base + (ui < extra ? 1 : 0);
}

/* Ring reduce-scatter in place: afterwards segment `rank` of buf holds the
 * full reduction. Segments given by (count, uniform) layout. */
static int ring_reduce_scatter(zt__ring_t *r, uint8_t *buf, size_t count, zt_dtype_t dt,
                               zt_deadline_t dl, const char *op) {
  int w = r->c.world, me = r->c.rank;
  size_t esz = zt_dtype_size(dt), maxseg = count / (size_t)w + 1;
  uint8_t *tmp = scratch(r, maxseg * esz);
  for (int st = 0; st < w - 1; st++) {
    size_t so, sl, ro, rl;
    segment(count, w, mod(me - st - 1, w), &so, &sl);
    segment(count, w, mod(me - st - 2, w), &ro, &rl);
    zt__ring_step_t s = {buf + so * esz, sl * esz, tmp, rl * esz, buf + ro * esz, dt, 0, NULL};
    if (zt__ring_step(r, &s, dl, op) != 0) return -1;
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
static int ring_reduce_scatter32(zt__ring_t *r, const float *src, size_t stride, double *out,
                                 size_t count, zt_deadline_t dl, const char *op) {
  int w = r->c.world, me = r->c.rank;
  uint8_t *tmp = scratch(r, 2 * count * sizeof(double));
  double *other = (double *)(tmp + count * sizeof(double));
  const double *sent = NULL; /* the sums the previous step made */
  for (int st = 0; st < w - 1; st++) {
    int si = mod(me - st - 1, w), ri = mod(me - st - 2, w);
    double *acc = (w - 2 - st) % 2 == 0 ? out : other;
    size_t esz = st == 0 ? sizeof(float) : sizeof(double);
    const uint8_t *sbuf = st == 0 ? (const uint8_t *)(src + (size_t)si * stride) : (const uint8_t *)sent;
    zt__ring_step_t s = {sbuf, count * esz, tmp, count * esz, (uint8_t *)acc,
                   st == 0 ? ZT_DT_F32 : ZT_DT_F64, st == 0, src + (size_t)ri * stride};
    if (zt__ring_step(r, &s, dl, op) != 0) return -1;
    sent = acc;
  }
  return 0;
}

static int ring_all_gather(zt__ring_t *r, uint8_t *buf, size_t count, zt_dtype_t dt,
                           zt_deadline_t dl, const char *op) {
  int w = r->c.world, me = r->c.rank;
  size_t esz = zt_dtype_size(dt);
  for (int st = 0; st < w - 1; st++) {
    size_t so, sl, ro, rl;
    segment(count, w, mod(me - st, w), &so, &sl);
    segment(count, w, mod(me - st - 1, w), &ro, &rl);
    zt__ring_step_t s = {buf + so * esz, sl * esz, buf + ro * esz, rl * esz, NULL, dt, 0, NULL};
    if (zt__ring_step(r, &s, dl, op) != 0) return -1;
  }
  return 0;
}

/* Where no direct connection joins every pair (a ring of 3 or more), the
 * all-to-all is an all-gather of every rank's whole send buffer, of which
 * each rank keeps what is addressed to it: N times the bytes, but any
 * ring can do it. */
static int ring_all_to_all(zt__ring_t *r, const uint8_t *send, uint8_t *recv, size_t bytes,
                           zt_deadline_t dl) {
  size_t w = (size_t)r->c.world, row = w * bytes, me = (size_t)r->c.rank;
  uint8_t *all = scratch(r, w * row);
  memcpy(all + me * row, send, row);
  if (ring_all_gather(r, all, row * w / 2, ZT_DT_BF16, dl, "all-to-all") != 0) return -1;
  for (size_t j = 0; j < w; j++) memcpy(recv + j * bytes, all + j * row + me * bytes, bytes);
  return 0;
}

/* Passes the buffer around the ring from root, chunk-pipelined by the
 * socket buffers: each rank forwards what it received, except the last. */
static int ring_broadcast(zt__ring_t *r, uint8_t *buf, size_t len, zt_dtype_t dt, int root,
                          zt_deadline_t dl) {
  int pos = mod(r->c.rank - root, r->c.world); /* 0 for root */
  for (size_t off = 0; off < len; off += r->chunk) {
    size_t n = ZT_MIN(r->chunk, len - off);
    uint8_t *p = buf + off;
    if (pos > 0) {
      zt__ring_step_t rs = {NULL, 0, p, n, NULL, dt, 0, NULL};
      if (zt__ring_step(r, &rs, dl, "broadcast") != 0) return -1;
    }
    if (pos < r->c.world - 1) {
      zt__ring_step_t ss = {p, n, NULL, 0, NULL, dt, 0, NULL};
      if (zt__ring_step(r, &ss, dl, "broadcast") != 0) return -1;
    }
  }
  return 0;
}

/* ---- the direct reduce-scatter (mesh) ------------------------------------ */

/* The reduce-scatter of fp32 input into fp64 sums over the mesh: every
 * rank sends segment j of its input, as fp32, straight to rank j, and
 * receives every other rank's values of its own segment (rank j's at
 * scratch + j * count); the sums are made in the ring's order (mesh_sum)
 * as soon as a chunk has arrived from every rank. Each rank sends N-1
 * segments of fp32, where the ring sends one of fp32 and N-2 of fp64
 * partial sums: 3 segments' worth of bytes against 5 at N = 4, half the
 * fp64 ring's as N grows; and a piece of the gradient is summed after one
 * transfer instead of N-1 in a row. */
static int mesh_reduce_scatter32(zt__ring_t *r, const float *src, size_t stride, double *out,
                                 size_t count, zt_deadline_t dl, const char *op) {
  size_t bytes = count * sizeof(float);
  uint8_t *in = scratch(r, (size_t)r->c.world * bytes);
  zt__mesh_sum_t sum = {out, src + (size_t)r->c.rank * stride, count};
  zt__mesh_call_t m = {(const uint8_t *)src, stride * sizeof(float), in, bytes, bytes, &sum};
  return zt__ring_mesh(r, &m, dl, op);
}

/* ---- agreeing on the operation ------------------------------------------- */

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
static int check_header(const zt__ring_t *r, const op_header *mine, const op_header *got,
                        int from, const char *name) {
  if (got->magic == mine->magic && got->op == mine->op && got->dt == mine->dt &&
      got->arg == mine->arg && got->count == mine->count && got->seq == mine->seq)
    return 0;
  if (got->magic != ZT_OP_MAGIC)
    return zt_err("%s: rank %d sent no operation header (another version, or a stream out of step)",
                  name, from);
  return zt_err("%s: the ranks' calls differ: rank %d is at collective %llu, %s of %llu %s "
                "elements (arg %u); rank %d at collective %llu, %s of %llu %s elements (arg %u)",
                name, from, (unsigned long long)got->seq, op_name(got->op),
                (unsigned long long)got->count, dt_name(got->dt), got->arg, r->c.rank,
                (unsigned long long)mine->seq, op_name(mine->op), (unsigned long long)mine->count,
                dt_name(mine->dt), mine->arg);
}

static int agree(zt__ring_t *r, int op, zt_dtype_t dt, uint32_t arg, size_t count,
                 zt_deadline_t dl, const char *name) {
  op_header mine = {ZT_OP_MAGIC, (uint8_t)op, (uint8_t)dt, {0}, arg, 0, count, ++r->seq}, got;
  zt__ring_step_t s = {(const uint8_t *)&mine, sizeof mine, (uint8_t *)&got, sizeof got,
                       NULL, dt, 0, NULL};
  if (zt__ring_step(r, &s, dl, name) != 0) return -1;
  return check_header(r, &mine, &got, r->prev, name);
}

/* A mesh call's header goes to every rank and comes from every rank. A
 * rank that has not made the call (or is gone) is then the one every other
 * rank waits for and names (on the ring only its successor would, and the
 * others would wait for that successor's data), and every rank sees a
 * call that differs from its own. (N-1) x 32 bytes, one message latency. */
static int mesh_agree(zt__ring_t *r, int op, zt_dtype_t dt, uint32_t arg, size_t count,
                      zt_deadline_t dl, const char *name) {
  int w = r->c.world;
  op_header mine = {ZT_OP_MAGIC, (uint8_t)op, (uint8_t)dt, {0}, arg, 0, count, ++r->seq};
  op_header *got = zt_xcalloc((size_t)w, sizeof *got);
  zt__mesh_call_t m = {(const uint8_t *)&mine, 0, (uint8_t *)got, sizeof *got, sizeof *got, NULL};
  int rc = zt__ring_mesh(r, &m, dl, name);
  for (int k = 1; rc == 0 && k < w; k++) {
    int j = mod(r->c.rank - k, w);
    rc = check_header(r, &mine, &got[j], j, name);
  }
  free(got);
  return rc;
}

/* ---- the operations (the table's entries) -------------------------------- */

static int ring_op_all_reduce(zt_comm_t *c, void *buf, size_t count, zt_dtype_t dt,
                              zt_redop_t op, int64_t timeout_ms) {
  zt__ring_t *r = zt__ring(c);
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  if (c->world == 1) return 0;
  if (agree(r, OPH_ALL_REDUCE, dt, op, count, dl, "all-reduce") != 0) return -1;
  if (count == 0) return 0;
  if (ring_reduce_scatter(r, buf, count, dt, dl, "all-reduce") != 0) return -1;
  if (op == ZT_RED_AVG) {
    size_t o, l;
    segment(count, c->world, c->rank, &o, &l);
    avg_scale((uint8_t *)buf + o * zt_dtype_size(dt), l, dt, c->world);
  }
  return ring_all_gather(r, buf, count, dt, dl, "all-reduce");
}

static int ring_op_reduce_scatter(zt_comm_t *c, void *send, void *recv, size_t count,
                                  zt_dtype_t dt, zt_redop_t op, int64_t timeout_ms) {
  zt__ring_t *r = zt__ring(c);
  size_t esz = zt_dtype_size(dt), total = count * (size_t)c->world;
  uint8_t *mine = (uint8_t *)send + (size_t)c->rank * count * esz;
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  if (c->world > 1) {
    if (agree(r, OPH_REDUCE_SCATTER, dt, op, count, dl, "reduce-scatter") != 0) return -1;
    if (count > 0 && ring_reduce_scatter(r, send, total, dt, dl, "reduce-scatter") != 0)
      return -1;
    if (op == ZT_RED_AVG) avg_scale(mine, count, dt, c->world);
  }
  if (count && (uint8_t *)recv != mine) memmove(recv, mine, count * esz);
  return 0;
}

static int ring_op_reduce_scatter_f32to64(zt_comm_t *c, const float *send, size_t stride,
                                          double *recv, size_t count, int64_t timeout_ms) {
  zt__ring_t *r = zt__ring(c);
  if (c->world == 1) {
    for (size_t i = 0; i < count; i++) recv[i] = (double)send[i];
    return 0;
  }
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  if (r->mesh) {
    if (mesh_agree(r, OPH_RS_FIRST32, ZT_DT_F64, ZT_RED_SUM, count, dl, "reduce-scatter") != 0)
      return -1;
    return count ? mesh_reduce_scatter32(r, send, stride, recv, count, dl, "reduce-scatter") : 0;
  }
  if (agree(r, OPH_RS_FIRST32, ZT_DT_F64, ZT_RED_SUM, count, dl, "reduce-scatter") != 0) return -1;
  if (count == 0) return 0;
  return ring_reduce_scatter32(r, send, stride, recv, count, dl, "reduce-scatter");
}

static int ring_op_all_gather(zt_comm_t *c, const void *send, void *recv, size_t count,
                              zt_dtype_t dt, int64_t timeout_ms) {
  zt__ring_t *r = zt__ring(c);
  size_t esz = zt_dtype_size(dt);
  uint8_t *mine = (uint8_t *)recv + (size_t)c->rank * count * esz;
  if (count && (const uint8_t *)send != mine) memmove(mine, send, count * esz);
  if (c->world == 1) return 0;
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  if (agree(r, OPH_ALL_GATHER, dt, 0, count, dl, "all-gather") != 0) return -1;
  if (count == 0) return 0;
  return ring_all_gather(r, recv, count * (size_t)c->world, dt, dl, "all-gather");
}

static int ring_op_broadcast(zt_comm_t *c, void *buf, size_t count, zt_dtype_t dt, int root,
                             int64_t timeout_ms) {
  zt__ring_t *r = zt__ring(c);
  if (c->world == 1) return 0;
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  if (agree(r, OPH_BROADCAST, dt, (uint32_t)root, count, dl, "broadcast") != 0) return -1;
  return ring_broadcast(r, buf, count * zt_dtype_size(dt), dt, root, dl);
}

/* Straight to each owner on a mesh or between two ranks (a mesh call);
 * around a longer ring, an all-gather of every send buffer. */
static int ring_op_all_to_all(zt_comm_t *c, const void *send, void *recv, size_t bytes,
                              int64_t timeout_ms) {
  zt__ring_t *r = zt__ring(c);
  const uint8_t *s = send;
  uint8_t *d = recv;
  memcpy(d + (size_t)c->rank * bytes, s + (size_t)c->rank * bytes, bytes);
  if (c->world == 1) return 0;
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  int direct = r->mesh || c->world == 2;
  if ((direct ? mesh_agree : agree)(r, OPH_ALL_TO_ALL, ZT_DT_BF16, 0, bytes, dl, "all-to-all") != 0)
    return -1;
  if (bytes == 0) return 0;
  if (!direct) return ring_all_to_all(r, s, d, bytes, dl);
  zt__mesh_call_t m = {s, bytes, d, bytes, bytes, NULL};
  return zt__ring_mesh(r, &m, dl, "all-to-all");
}

static int ring_f32_direct(const zt_comm_t *c) {
  return ((const zt__ring_t *)c)->mesh || c->world == 2;
}

/* Writes the abort event, which every poll set of c (and of its views, or
 * its root's, whose event it is) holds. */
static void ring_abort(zt_comm_t *c) {
  uint64_t one = 1;
  ssize_t w = write(zt__ring(c)->abort_fd, &one, sizeof one);
  (void)w;
}

/* The kernel's smoothed RTT on the connection to the next rank, once
 * connected. */
static uint32_t ring_next_rtt_us(const zt_comm_t *c) {
  const zt__ring_t *r = (const zt__ring_t *)c;
  struct tcp_info ti;
  socklen_t len = sizeof ti;
  if (atomic_load_explicit(&r->connected, memory_order_acquire) && r->next_fd >= 0 &&
      getsockopt(r->next_fd, IPPROTO_TCP, TCP_INFO, &ti, &len) == 0)
    return ti.tcpi_rtt;
  return 0;
}

/* ---- views, destruction, the table --------------------------------------- */

/* A view of root's ranks rmap[0 .. n) over root's own sockets: every pair
 * of members needs its two connections, which the mesh has (or a ring of
 * two). */
static int ring_view(zt_comm_t *rootc, const int *rmap, int n, int me, zt_comm_t **out) {
  zt__ring_t *root = zt__ring(rootc);
  for (int i = 0; i < n; i++) {
    int j = rmap[i];
    if (i != me && (root->out_fd[j] < 0 || root->in_fd[j] < 0))
      return zt_err("a view of ranks %d and %d: no direct connection between them (the mesh "
                    "joins every pair from 3 to %d ranks)", rootc->rank, j, ZT_COMM_MESH_MAX);
  }
  zt__ring_t *v = zt_xcalloc(1, sizeof *v);
  zt__comm_init(&v->c, rootc->ops, me, n);
  v->next = (me + 1) % n, v->prev = mod(me - 1, n);
  v->out_fd = zt_xcalloc((size_t)n, sizeof *v->out_fd);
  v->in_fd = zt_xcalloc((size_t)n, sizeof *v->in_fd);
  for (int i = 0; i < n; i++) {
    v->out_fd[i] = i == me ? -1 : root->out_fd[rmap[i]];
    v->in_fd[i] = i == me ? -1 : root->in_fd[rmap[i]];
  }
  v->next_fd = n > 1 ? v->out_fd[v->next] : -1;
  v->prev_fd = n > 1 ? v->in_fd[v->prev] : -1;
  v->mpos = zt_xcalloc(2 * (size_t)n, sizeof *v->mpos);
  v->mesh = n >= 3;
  v->chunk = root->chunk, v->session = root->session;
  v->abort_fd = root->abort_fd, v->listen_fd = -1;
  atomic_store(&v->connected, 1);
  *out = &v->c;
  return 0;
}

static void ring_destroy(zt_comm_t *c) {
  zt__ring_t *r = zt__ring(c);
  if (!c->root) { /* a view's sockets and abort event are its root's */
    for (int j = 0; r->out_fd && j < c->world; j++) {
      if (r->out_fd[j] >= 0) close(r->out_fd[j]);
      if (r->in_fd[j] >= 0) close(r->in_fd[j]);
    }
    if (r->abort_fd >= 0) close(r->abort_fd);
    if (r->listen_fd >= 0) close(r->listen_fd);
  }
  free(r->out_fd);
  free(r->in_fd);
  free(r->in_lowat);
  free(r->mpos);
  free(r->scratch);
  free(r);
}

static const zt__comm_ops_t ring_ops = {
    .name = "tcp",
    .title = "TCP",
    .device_memory = 0,
    .f32_direct = ring_f32_direct,
    .all_reduce = ring_op_all_reduce,
    .reduce_scatter = ring_op_reduce_scatter,
    .reduce_scatter_f32to64 = ring_op_reduce_scatter_f32to64,
    .all_gather = ring_op_all_gather,
    .broadcast = ring_op_broadcast,
    .all_to_all = ring_op_all_to_all,
    /* host memory: no stream order; nothing in flight between calls */
    .view = ring_view,
    .abort = ring_abort,
    .next_rtt_us = ring_next_rtt_us,
    .destroy = ring_destroy,
};

/* ---- construction -------------------------------------------------------- */

/* The sockets' tables, every entry -1 (no socket). */
static void alloc_peers(zt__ring_t *r) {
  size_t w = (size_t)r->c.world;
  r->out_fd = zt_xmalloc(w * sizeof *r->out_fd);
  r->in_fd = zt_xmalloc(w * sizeof *r->in_fd);
  r->in_lowat = zt_xcalloc(w, sizeof *r->in_lowat);
  r->mpos = zt_xcalloc(2 * w, sizeof *r->mpos);
  for (size_t j = 0; j < w; j++) r->out_fd[j] = r->in_fd[j] = -1;
}

int zt_comm_tcp_new(const zt_comm_tcp_opts_t *o, zt_comm_t **out) {
  if (o->world < 1 || o->rank < 0 || o->rank >= o->world) {
    if (o->listen_fd >= 0) close(o->listen_fd);
    return zt_err("comm: rank %d of world %d is invalid", o->rank, o->world);
  }
  zt__ring_t *r = zt_xcalloc(1, sizeof *r);
  zt__comm_init(&r->c, &ring_ops, o->rank, o->world);
  r->next = (o->rank + 1) % o->world;
  r->prev = mod(o->rank - 1, o->world);
  r->session = o->session;
  /* Received bytes are reduced a whole chunk of elements at a time. */
  r->chunk = o->chunk_bytes ? ZT_MAX(8, o->chunk_bytes & ~(size_t)7) : (1u << 20);
  r->mesh = !o->ring_only && o->world >= 3 && o->world <= ZT_COMM_MESH_MAX;
  r->next_fd = r->prev_fd = -1;
  r->listen_fd = o->listen_fd;
  r->peers = o->peers;
  r->setup_ms = o->connect_timeout_ms > 0 ? o->connect_timeout_ms : ZT_COMM_TIMEOUT_MS_DEFAULT;
  snprintf(r->key, sizeof r->key, "%s", o->key ? o->key : "");
  alloc_peers(r);
  r->abort_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (r->abort_fd < 0) {
    zt_err_errno("comm: eventfd");
    zt_comm_destroy(&r->c);
    return -1;
  }
  *out = &r->c;
  return 0;
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
