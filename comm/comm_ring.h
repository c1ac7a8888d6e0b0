/*
 * comm_ring.h: the TCP backend's communicator, shared by the three files
 * that make it up. Private to comm/.
 *
 *   comm_ring.c       the collectives over the connections (ring and mesh
 *                     algorithms, the operation headers, views), the
 *                     table of operations, and the constructor
 *                     zt_comm_tcp_new
 *   comm_transfer.c   the transfer engine those algorithms run on: the
 *                     poll() loops of a ring step and of a mesh call
 *   comm_handshake.c  the set-up that fills the connection tables:
 *                     zt_comm_tcp_listen, zt_comm_tcp_connect and the
 *                     authenticated handshake
 *
 * A ring communicator is created unconnected (zt_comm_tcp_new: every
 * socket -1, the set-up fields filled in from the options), so that
 * another thread may abort its set-up; zt_comm_tcp_connect then makes and
 * checks every connection, sets next_fd and prev_fd and raises
 * `connected`. A view (zt_comm_view) is a ring communicator too, whose
 * tables hold its root's sockets (it owns none of them) and whose abort
 * event is its root's.
 */
#ifndef ZT_COMM_RING_H
#define ZT_COMM_RING_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "comm_impl.h"
#include "zt_common.h"

typedef struct zt__ring {
  struct zt_comm c;      /* the front's part (comm_impl.h); first */
  int next, prev;        /* the ring neighbours' ranks */
  int next_fd, prev_fd;  /* out_fd[next] and in_fd[prev] (not owned separately) */
  int abort_fd;          /* an eventfd that zt_comm_abort() writes; in every poll set */
  int *out_fd, *in_fd;   /* [world]: the socket to / from each rank, -1 where none */
  int *in_lowat;         /* [world]: SO_RCVLOWAT of in_fd[j] now (comm_ring.c, set_lowat) */
  size_t *mpos;          /* [2 * world]: a mesh call's bytes sent to / received from each rank */
  int mesh;              /* every pair of ranks connected (the direct reduce-scatter) */
  size_t chunk;          /* bytes per send() / recv(), and per reduction of received bytes */
  uint64_t session;      /* job and generation: the handshake's fence */
  /* Set-up (zt_comm_tcp_new to zt_comm_tcp_connect): the listening socket,
   * the peers' addresses (the caller's), the deadline and the key, which
   * is wiped once connected. */
  int listen_fd;
  const char *const *peers;
  int64_t setup_ms;
  char key[129];
  /* Set (release) once zt_comm_tcp_connect has set next_fd and prev_fd:
   * the stats' RTT, read from any thread during the set-up too, reads
   * next_fd only after it reads this set (acquire). */
  atomic_int connected;
  uint8_t *scratch;
  size_t scratch_cap;
  uint64_t seq; /* collectives begun (the operation header's call number) */
} zt__ring_t;

static inline zt__ring_t *zt__ring(zt_comm_t *c) { return (zt__ring_t *)c; }

/* ---- the transfer engine (comm_transfer.c) --------------------------------
 *
 * The two loops that move bytes; comm_ring.c's algorithms say which bytes.
 * Both wait in poll() at most until the deadline, with the abort event in
 * the poll set, count bytes and time into the communicator's stats, and on
 * failure return -1 with the reason as the thread's error (c.failed_peer
 * set where a peer's connection failed), for the front to break the
 * communicator with. */

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
} zt__ring_step_t;

int zt__ring_step(zt__ring_t *r, const zt__ring_step_t *s, zt_deadline_t dl, const char *op);

/* A mesh call: every rank sends `bytes` to every other rank and receives
 * as many from each, all at once, over the direct connections. Rank j gets
 * send + j * sstride (0: the same bytes to every rank); rank j's bytes land
 * at recv + j * rstride. With `sum` (the reduce-scatter), the received fp32
 * values are summed into sum->out, in the ring's order, as soon as a chunk
 * has arrived from every rank. */
typedef struct {
  double *out;
  const float *own;
  size_t count;
} zt__mesh_sum_t;

typedef struct {
  const uint8_t *send;
  size_t sstride;
  uint8_t *recv;
  size_t rstride, bytes;
  const zt__mesh_sum_t *sum;
} zt__mesh_call_t;

int zt__ring_mesh(zt__ring_t *r, const zt__mesh_call_t *m, zt_deadline_t dl, const char *op);

/* ((a % n) + n) % n: rank arithmetic around the ring. */
static inline int zt__ring_mod(int a, int n) { return ((a % n) + n) % n; }

#endif
