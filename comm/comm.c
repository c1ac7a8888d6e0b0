/*
 * comm.c: the front end of comm.h. Every public operation on a
 * communicator starts here, whichever backend carries it.
 *
 * What the front does, for every backend alike:
 *
 *   - Checks. A communicator that has failed or was aborted refuses every
 *     later call with its first error (zt__comm_usable); arguments that
 *     every backend shares are checked before any byte moves (a
 *     broadcast's root, an all-to-all's even size, a reduce-scatter's
 *     stride, a view's rank list).
 *   - Dispatch. The operation goes through the communicator's table of
 *     function pointers (zt__comm_ops_t, comm_impl.h): the TCP ring's
 *     (comm_ring.c) or NCCL's (comm_nccl.c). An operation a backend does
 *     not have (the fp32-into-fp64 reduce-scatter, the all-to-all and
 *     views over NCCL; stream order over TCP) is refused here with the
 *     message comm.h documents.
 *   - The broken / abort state. A backend that fails returns -1 with its
 *     reason; the front breaks the communicator with it (zt__comm_fail):
 *     the first failure's message is kept, later ones are dropped, and a
 *     view's failure breaks its root too, naming the root's rank of the
 *     failed peer, and wakes whatever runs on the root's connections.
 *     zt_comm_abort() claims the state the same way ("aborted") from any
 *     thread, then has the backend wake its waits.
 *   - Counters (zt_comm_stats_t): operations are counted here, bytes and
 *     time by the backend, into the front's stats (a view's into its
 *     root's).
 *
 * Construction is the backends' (zt_comm_tcp_new in comm_ring.c,
 * zt_comm_nccl_create in comm_nccl.c): each allocates its communicator,
 * whose first member is the front's struct zt_comm, and sets that part up
 * with zt__comm_init. zt_comm_destroy hands it back to the backend.
 *
 * Also here: the reduction helpers of comm.h (zt_comm_reduce_add,
 * zt_comm_scale), plain arithmetic on host buffers that the ring and the
 * tests use.
 */
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "comm_impl.h"
#include "zt_common.h"

/* ---- the broken / abort state -------------------------------------------- */

void zt__comm_init(zt_comm_t *c, const zt__comm_ops_t *ops, int rank, int world) {
  c->ops = ops;
  c->rank = rank, c->world = world;
  c->failed_peer = -1;
  c->st = &c->stats;
}

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

/* A view's failure breaks its root too (the generation is over), naming
 * the root's rank, and stops whatever else runs on the root's
 * connections. */
static void view_failed(zt_comm_t *v) {
  if (v->failed_closed && !atomic_load(&v->root->err_claimed)) v->root->failed_closed = 1;
  claim_error(v->root, v->err, v->failed_peer >= 0 ? v->rmap[v->failed_peer] : -1);
  v->root->ops->abort(v->root);
}

int zt__comm_fail(zt_comm_t *c, const char *fmt, ...) {
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

int zt__comm_usable(zt_comm_t *c, const char *op) {
  if (!atomic_load(&c->broken) && !(c->root && atomic_load(&c->root->broken))) return 0;
  zt_comm_t *b = atomic_load(&c->broken) ? c : c->root;
  return zt_err("%s: communicator unusable after an earlier failure: %s", op,
                b->err[0] ? b->err : "aborted");
}

/* A backend operation's outcome: its failure breaks the communicator. */
static int outcome(zt_comm_t *c, int rc) {
  return rc == 0 ? 0 : zt__comm_fail(c, "%s", zt_err_msg());
}

static void count_op(zt_comm_t *c) { zt__comm_count(&c->st->ops, 1); }

/* An operation c's backend does not have. */
static int unavailable(const zt_comm_t *c, const char *what) {
  return zt_err("%s: not available over %s", what, c->ops->title);
}

void zt_comm_abort(zt_comm_t *c) {
  claim_error(c, "aborted", -1);
  c->ops->abort(c);
}

int zt_comm_broken(const zt_comm_t *c) {
  return atomic_load(&c->broken) || (c->root && atomic_load(&c->root->broken));
}

int zt_comm_failed_peer(const zt_comm_t *c) { return c->failed_peer; }
int zt_comm_failed_peer_closed(const zt_comm_t *c) {
  return c->failed_peer >= 0 && c->failed_closed;
}

/* ---- what a communicator is ---------------------------------------------- */

int zt_comm_rank(const zt_comm_t *c) { return c->rank; }
int zt_comm_world(const zt_comm_t *c) { return c->world; }
const char *zt_comm_backend(const zt_comm_t *c) { return c->ops->name; }
int zt_comm_device_memory(const zt_comm_t *c) { return c->ops->device_memory; }

int zt_comm_f32_direct(const zt_comm_t *c) {
  return c->ops->f32_direct ? c->ops->f32_direct(c) : 0;
}

void zt_comm_stats_get(const zt_comm_t *c, zt_comm_stats_t *s) {
  s->bytes_sent = __atomic_load_n(&c->st->bytes_sent, __ATOMIC_RELAXED);
  s->bytes_recv = __atomic_load_n(&c->st->bytes_recv, __ATOMIC_RELAXED);
  s->ops = __atomic_load_n(&c->st->ops, __ATOMIC_RELAXED);
  s->comm_us = __atomic_load_n(&c->st->comm_us, __ATOMIC_RELAXED);
  s->send_wait_us = __atomic_load_n(&c->st->send_wait_us, __ATOMIC_RELAXED);
  s->next_rtt_us = c->ops->next_rtt_us ? c->ops->next_rtt_us(c) : 0;
}

void zt_comm_destroy(zt_comm_t *c) {
  if (!c) return;
  int *rmap = c->rmap; /* the front's; c itself is the backend's to free */
  c->ops->destroy(c);
  free(rmap);
}

/* ---- the collectives ----------------------------------------------------- */

int zt_comm_all_reduce(zt_comm_t *c, void *buf, size_t count, zt_dtype_t dt, zt_redop_t op,
                       int64_t timeout_ms) {
  if (zt__comm_usable(c, "all-reduce") != 0) return -1;
  count_op(c);
  return outcome(c, c->ops->all_reduce(c, buf, count, dt, op, timeout_ms));
}

int zt_comm_reduce_scatter(zt_comm_t *c, void *send, void *recv, size_t count, zt_dtype_t dt,
                           zt_redop_t op, int64_t timeout_ms) {
  if (zt__comm_usable(c, "reduce-scatter") != 0) return -1;
  count_op(c);
  return outcome(c, c->ops->reduce_scatter(c, send, recv, count, dt, op, timeout_ms));
}

int zt_comm_reduce_scatter_f32to64(zt_comm_t *c, const float *send, size_t stride, double *recv,
                                   size_t count, int64_t timeout_ms) {
  if (zt__comm_usable(c, "reduce-scatter") != 0) return -1;
  if (!c->ops->reduce_scatter_f32to64)
    return unavailable(c, "reduce-scatter from fp32 into fp64");
  if (stride < count) return zt_err("reduce-scatter: stride %zu below count %zu", stride, count);
  count_op(c);
  return outcome(c, c->ops->reduce_scatter_f32to64(c, send, stride, recv, count, timeout_ms));
}

int zt_comm_all_gather(zt_comm_t *c, const void *send, void *recv, size_t count, zt_dtype_t dt,
                       int64_t timeout_ms) {
  if (zt__comm_usable(c, "all-gather") != 0) return -1;
  count_op(c);
  return outcome(c, c->ops->all_gather(c, send, recv, count, dt, timeout_ms));
}

int zt_comm_broadcast(zt_comm_t *c, void *buf, size_t count, zt_dtype_t dt, int root,
                      int64_t timeout_ms) {
  if (zt__comm_usable(c, "broadcast") != 0) return -1;
  if (root < 0 || root >= c->world) return zt_err("broadcast: root %d out of range", root);
  count_op(c);
  return outcome(c, c->ops->broadcast(c, buf, count, dt, root, timeout_ms));
}

int zt_comm_all_to_all(zt_comm_t *c, const void *send, void *recv, size_t bytes,
                       int64_t timeout_ms) {
  if (zt__comm_usable(c, "all-to-all") != 0) return -1;
  if (!c->ops->all_to_all) return unavailable(c, "all-to-all");
  if (bytes % 2) return zt_err("all-to-all: %zu bytes a rank, not a whole number of words", bytes);
  count_op(c);
  return outcome(c, c->ops->all_to_all(c, send, recv, bytes, timeout_ms));
}

int zt_comm_barrier(zt_comm_t *c, int64_t timeout_ms) {
  float one = 1.0f;
  if (zt_comm_all_reduce(c, &one, 1, ZT_DT_F32, ZT_RED_SUM, timeout_ms) != 0)
    return zt_err_wrap("barrier");
  return 0;
}

/* ---- stream order (comm.h) ----------------------------------------------- */

int zt_comm_set_stream(zt_comm_t *c, void *stream) {
  if (!c->ops->set_stream)
    return zt_err("stream order: a %s communicator works on host memory", c->ops->title);
  return outcome(c, c->ops->set_stream(c, stream));
}

int zt_comm_reduce_scatter_async(zt_comm_t *c, void *send, void *recv, size_t count,
                                 zt_dtype_t dt, zt_redop_t op, int64_t timeout_ms,
                                 uint64_t *ticket) {
  if (zt__comm_usable(c, "reduce-scatter") != 0) return -1;
  if (!c->ops->reduce_scatter_async) return zt_err("reduce-scatter: asynchronous over NCCL only");
  count_op(c);
  return outcome(c, c->ops->reduce_scatter_async(c, send, recv, count, dt, op, timeout_ms,
                                                 ticket));
}

int zt_comm_all_gather_async(zt_comm_t *c, const void *send, void *recv, size_t count,
                             zt_dtype_t dt, int64_t timeout_ms, uint64_t *ticket) {
  if (zt__comm_usable(c, "all-gather") != 0) return -1;
  if (!c->ops->all_gather_async) return zt_err("all-gather: asynchronous over NCCL only");
  count_op(c);
  return outcome(c, c->ops->all_gather_async(c, send, recv, count, dt, timeout_ms, ticket));
}

int zt_comm_join(zt_comm_t *c, uint64_t ticket) {
  if (zt__comm_usable(c, "join") != 0) return -1;
  return c->ops->join ? outcome(c, c->ops->join(c, ticket)) : 0;
}

/* Not refused on a broken communicator: the backend may still have to end
 * what is in flight (an abort raised by zt_comm_abort takes effect here). */
int zt_comm_progress(zt_comm_t *c) {
  if (c->ops->progress && c->ops->progress(c) != 0) return outcome(c, -1);
  return zt__comm_usable(c, "collective in flight");
}

int zt_comm_settle(zt_comm_t *c) {
  if (c->ops->settle && c->ops->settle(c) != 0) return outcome(c, -1);
  return zt__comm_usable(c, "collective in flight");
}

/* ---- views --------------------------------------------------------------- */

/* Each view rank's rank in c's root, checked: in range, none twice, this
 * rank among them (*me: its place). NULL with the error otherwise. */
static int *view_map(const zt_comm_t *c, const int *ranks, int n, int *me) {
  int *rmap = zt_xcalloc((size_t)n, sizeof *rmap);
  *me = -1;
  for (int i = 0; i < n; i++) {
    if (ranks[i] < 0 || ranks[i] >= c->world) {
      zt_err("a view's rank %d out of range (world %d)", ranks[i], c->world);
      goto bad;
    }
    for (int k = 0; k < i; k++)
      if (ranks[k] == ranks[i]) {
        zt_err("a view names rank %d twice", ranks[i]);
        goto bad;
      }
    rmap[i] = c->root ? c->rmap[ranks[i]] : ranks[i];
    if (ranks[i] == c->rank) *me = i;
  }
  if (*me >= 0) return rmap;
  zt_err("a view without this rank (%d)", c->rank);
bad:
  free(rmap);
  return NULL;
}

int zt_comm_view(zt_comm_t *c, const int *ranks, int n, zt_comm_t **out) {
  zt_comm_t *root = c->root ? c->root : c, *v = NULL;
  int me;
  *out = NULL;
  if (!c->ops->view) return unavailable(c, "a view of the ranks");
  if (n < 1 || n > c->world) return zt_err("a view of %d ranks out of %d", n, c->world);
  int *rmap = view_map(c, ranks, n, &me);
  if (!rmap) return -1;
  if (c->ops->view(root, rmap, n, me, &v) != 0) {
    free(rmap);
    return -1;
  }
  v->root = root, v->rmap = rmap;
  v->st = root->st;
  *out = v;
  return 0;
}

/* ---- reductions (comm.h: helpers shared by backends and tests) ----------- */

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
