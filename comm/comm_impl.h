/*
 * comm_impl.h: between the front end of comm.h (comm.c) and the backends
 * that carry its collectives. Private to comm/: nothing outside includes
 * it.
 *
 * The shape is the kernel table's (kernels/zt_kernels.h): one struct of
 * function pointers per backend, and a front that every caller goes
 * through.
 *
 *   comm.c           the front: every public zt_comm_* operation, the
 *                    checks of its arguments, the broken / abort state
 *                    that every backend shares (first error, failed peer,
 *                    the counters), views, and the dispatch through the
 *                    table below
 *   comm_ring.c      the TCP backend: ring and mesh collectives over
 *                    sockets (CPU workers); comm_ring.h is its state
 *   comm_transfer.c  the TCP backend's poll() loops that move the bytes
 *                    of a ring step or a mesh call
 *   comm_handshake.c the TCP backend's connection set-up: listen, connect,
 *                    the authenticated handshake
 *   comm_nccl.c      the NCCL backend (GPU workers), built with CUDA
 *   comm_nonccl.c    the NCCL entry points of builds without CUDA
 *
 * A backend's communicator is a struct whose first member is the front's
 * `struct zt_comm` (below), so the front and the backend see one object:
 * the backend allocates it, calls zt__comm_init on its front part, and
 * frees it in its destroy operation. The backend casts the zt_comm_t *
 * the front passes it back to its own type.
 *
 * The contract of an operation in the table:
 *
 *   - The front has already checked that the communicator is usable (not
 *     broken, not aborted), checked the arguments that every backend
 *     shares (a broadcast's root, an all-to-all's even size, ...) and
 *     counted the operation in the stats.
 *   - 0 on success. On failure the backend returns -1 with the reason as
 *     the thread's error (zt_err), having set c->failed_peer when it knows
 *     which rank's connection failed; the front then breaks the
 *     communicator with that reason (zt__comm_fail). A backend never
 *     marks a communicator broken itself, except where a public entry
 *     point of its own (the ring's zt_comm_tcp_connect) fails.
 *   - A NULL entry means "this backend has no such operation": the front
 *     answers with the error comm.h documents (not available over NCCL,
 *     asynchronous over NCCL only, ...), or with nothing to do where that
 *     is the documented answer (join, progress and settle on the ring).
 */
#ifndef ZT_COMM_IMPL_H
#define ZT_COMM_IMPL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "comm.h"

typedef struct zt__comm_ops {
  const char *name;  /* zt_comm_backend(): "tcp", "nccl" */
  const char *title; /* in messages: "TCP", "NCCL" */
  int device_memory; /* the operations take device pointers (comm.h) */

  /* comm.h, zt_comm_f32_direct; NULL: 0. */
  int (*f32_direct)(const zt_comm_t *c);

  /* The collectives (comm.h). */
  int (*all_reduce)(zt_comm_t *c, void *buf, size_t count, zt_dtype_t dt, zt_redop_t op,
                    int64_t timeout_ms);
  int (*reduce_scatter)(zt_comm_t *c, void *send, void *recv, size_t count, zt_dtype_t dt,
                        zt_redop_t op, int64_t timeout_ms);
  int (*reduce_scatter_f32to64)(zt_comm_t *c, const float *send, size_t stride, double *recv,
                                size_t count, int64_t timeout_ms); /* NULL: none */
  int (*all_gather)(zt_comm_t *c, const void *send, void *recv, size_t count, zt_dtype_t dt,
                    int64_t timeout_ms);
  int (*broadcast)(zt_comm_t *c, void *buf, size_t count, zt_dtype_t dt, int root,
                   int64_t timeout_ms);
  int (*all_to_all)(zt_comm_t *c, const void *send, void *recv, size_t bytes,
                    int64_t timeout_ms); /* NULL: none */

  /* Stream order (comm.h, zt_comm_set_stream); all NULL on a backend that
   * works on host memory. */
  int (*set_stream)(zt_comm_t *c, void *stream);
  int (*reduce_scatter_async)(zt_comm_t *c, void *send, void *recv, size_t count, zt_dtype_t dt,
                              zt_redop_t op, int64_t timeout_ms, uint64_t *ticket);
  int (*all_gather_async)(zt_comm_t *c, const void *send, void *recv, size_t count,
                          zt_dtype_t dt, int64_t timeout_ms, uint64_t *ticket);
  int (*join)(zt_comm_t *c, uint64_t ticket);
  int (*progress)(zt_comm_t *c); /* called on a broken communicator too */
  int (*settle)(zt_comm_t *c);   /* likewise */

  /* A view (comm.h, zt_comm_view) of root's ranks rmap[0 .. n), this rank
   * being rmap[me]: the front has checked the list; the backend checks
   * that it can carry the view, and makes it (zt__comm_init done; the
   * front sets root, rmap and the stats after). NULL: no views. */
  int (*view)(zt_comm_t *root, const int *rmap, int n, int me, zt_comm_t **out);

  /* Wakes every wait on c's connections, so the operation in progress
   * fails at once; the front has marked c broken. From any thread. */
  void (*abort)(zt_comm_t *c);
  /* zt_comm_stats_t.next_rtt_us; NULL: 0. From any thread. */
  uint32_t (*next_rtt_us)(const zt_comm_t *c);
  /* Frees c and everything of the backend's it holds (for a view: not
   * what it shares with its root). */
  void (*destroy)(zt_comm_t *c);
} zt__comm_ops_t;

/* The part of every communicator that the front owns. */
struct zt_comm {
  const zt__comm_ops_t *ops;
  int rank, world;
  atomic_int err_claimed; /* the first failure or abort writes err, once */
  atomic_int broken;      /* set after err is written */
  int failed_peer;        /* rank whose connection failed, -1 when unknown */
  int failed_closed;      /* ... and that connection ended: closed or reset by the peer */
  char err[512];
  zt_comm_stats_t stats;
  zt_comm_stats_t *st; /* &stats, or a view's root's (views count into it) */
  /* A view (zt_comm_view): the communicator whose connections it uses
   * (never itself a view) and each view rank's rank there; NULL else. */
  struct zt_comm *root;
  int *rmap;
};

/* Sets up the front's part of a communicator the backend has allocated
 * (zeroed): not broken, no failed peer, its own counters. */
void zt__comm_init(zt_comm_t *c, const zt__comm_ops_t *ops, int rank, int world);

/* Breaks c with this message unless it is broken already (the first
 * failure's message stays), and a view's root with it; returns -1 with
 * c's first message as the thread's error. */
int zt__comm_fail(zt_comm_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* 0 when c (and a view's root) is not broken; else -1, the error naming
 * op and the first failure. */
int zt__comm_usable(zt_comm_t *c, const char *op);

/* The counters are updated and read from any thread. */
static inline void zt__comm_count(uint64_t *counter, uint64_t v) {
  __atomic_fetch_add(counter, v, __ATOMIC_RELAXED);
}

#endif
