/*
 * comm.h: collectives between the ranks of one generation.
 *
 * One interface, several backends: the TCP ring (comm_ring.c, its set-up
 * in comm_handshake.c) for CPU workers, NCCL (comm_nccl.c) for GPU
 * workers. comm.c is the front every call goes through: it checks the
 * call, keeps the broken state and dispatches to the communicator's
 * backend (comm_impl.h, private to comm/). A communicator is created for one
 * generation of one job with a fixed rank and world size, and is thrown away
 * when the generation ends; nothing is ever re-used across generations, so a
 * rank of an older generation can never feed data into a newer one (the TCP
 * handshake also checks a session id derived from job and generation).
 *
 * Every operation takes a timeout in milliseconds (ZT_COMM_TIMEOUT_MS_DEFAULT
 * where the caller has none of its own). A peer that dies makes
 * the operation fail as soon as its socket reports it; a peer that goes
 * silent makes it fail when the timeout expires; zt_comm_abort(), callable
 * from any thread, makes the operation in progress (and every later one)
 * fail at once. After any failure the communicator is broken: every further
 * call fails with the first error, and the owner must destroy it and join a
 * new generation. No call ever blocks without a bound.
 *
 * Buffers: fp32, fp64 or bf16 (uint16 storage; reductions are computed in
 * fp32 and rounded to nearest-even once per addition). fp64 is what the
 * trainer uses for gradient sums: exact in practice, so independent of the
 * order in which ranks add them. Reductions: SUM or AVG
 * (sum, then divided by the world size).
 *
 * Shard layout (what ZeRO relies on): reduce_scatter of `world * n`
 * elements leaves rank r with elements [r*n, (r+1)*n) of the reduction, and
 * all_gather places rank r's n elements at [r*n, (r+1)*n) of the output.
 */
#ifndef ZT_COMM_H
#define ZT_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "zt_common.h"

/* The timeout of one collective, and of the TCP ring's set-up, where no
 * other is given: the job spec's comm.timeout_ms default (engine/spec.c),
 * the trainer's when a generation names none, the ring's
 * connect_timeout_ms when 0, and the benchmarks' (bench/commrun). Named
 * once here, so that every default is the same 30 s. */
#define ZT_COMM_TIMEOUT_MS_DEFAULT 30000

typedef enum { ZT_DT_F32 = 0, ZT_DT_BF16 = 1, ZT_DT_F64 = 2 } zt_dtype_t;
typedef enum { ZT_RED_SUM = 0, ZT_RED_AVG = 1 } zt_redop_t;

static inline size_t zt_dtype_size(zt_dtype_t t) {
  return t == ZT_DT_F64 ? 8 : t == ZT_DT_F32 ? 4 : 2;
}

typedef struct zt_comm zt_comm_t;

/* Counters, for benchmarks and the per-worker timings (TCP ring: time
 * inside collectives, and the part of it spent with only sends pending,
 * i.e. waiting for this rank's outgoing link). Readable from any thread. */
typedef struct {
  uint64_t bytes_sent, bytes_recv;
  uint64_t ops;
  uint64_t comm_us, send_wait_us;
  uint32_t next_rtt_us; /* TCP ring: the kernel's smoothed RTT to the next rank now */
} zt_comm_stats_t;

/* ---- TCP ring backend ---------------------------------------------------- */

/* Opens a listening socket on host (port 0: any free port) before the
 * rendezvous, so the port can be reported to the coordinator. */
ZT_MUST_CHECK int zt_comm_tcp_listen(const char *host, int *port, int *fd);

typedef struct {
  int rank, world;
  const char *const *peers; /* "host:port" of every rank's listening socket */
  int listen_fd;            /* from zt_comm_tcp_listen; the communicator owns it */
  uint64_t session;         /* same on every rank of one generation, e.g. job<<32|gen */
  /* The generation's secret (RendezvousReply.comm_key; at least 32
   * characters; needed from 2 ranks on). Every connection proves it both
   * ways with HMAC-SHA256 over fresh nonces (comm_handshake.c),
   * so a process without it cannot join the ring or pose as a rank; it
   * never crosses the ring itself. */
  const char *key;
  int64_t connect_timeout_ms; /* 0: ZT_COMM_TIMEOUT_MS_DEFAULT */
  size_t chunk_bytes; /* pipelining granularity; 0: 1 MiB */
  int ring_only;      /* connect the ring alone, even where a mesh would be made */
} zt_comm_tcp_opts_t;

/* The largest world whose ranks are all connected pairwise (a mesh). */
#define ZT_COMM_MESH_MAX 64

/* Connects the ring: rank r connects to rank r+1 and accepts rank r-1.
 * From 3 to ZT_COMM_MESH_MAX ranks (unless ring_only), every rank also
 * connects to every other one (a mesh), and zt_comm_reduce_scatter_f32to64
 * sends each segment straight to its owner; the other collectives stay on
 * the ring. Fails after connect_timeout_ms if a peer does not show up, or
 * at once if a peer does not prove the key. zt_comm_tcp_create is
 * zt_comm_tcp_new then zt_comm_tcp_connect; apart, the communicator exists
 * before it connects, so another thread can zt_comm_abort() the set-up
 * (o->peers must then stay valid until zt_comm_tcp_connect returns). A
 * communicator whose set-up failed is broken; destroy it. */
ZT_MUST_CHECK int zt_comm_tcp_create(const zt_comm_tcp_opts_t *o, zt_comm_t **out);
ZT_MUST_CHECK int zt_comm_tcp_new(const zt_comm_tcp_opts_t *o, zt_comm_t **out);
ZT_MUST_CHECK int zt_comm_tcp_connect(zt_comm_t *c);

/* ---- NCCL backend (built when CUDA and NCCL are found; ZT_HAVE_NCCL) ----- */

/* Rank 0 makes the id (256 hex characters) that the coordinator hands to
 * every rank; each rank then creates its communicator on GPU `device`.
 * Buffers passed to the operations are then device pointers. */
ZT_MUST_CHECK int zt_comm_nccl_unique_id(char hex[257]);
/* 1 when the NCCL and CUDA runtime libraries load (a GPU worker says so
 * when it registers); 0 with the reason as the error otherwise. */
int zt_comm_nccl_available(void);
ZT_MUST_CHECK int zt_comm_nccl_create(int rank, int world, const char *id_hex, int device, int64_t timeout_ms,
                        zt_comm_t **out);

/* ---- operations ---------------------------------------------------------- */

int zt_comm_rank(const zt_comm_t *c);
int zt_comm_world(const zt_comm_t *c);
const char *zt_comm_backend(const zt_comm_t *c);
/* 1 when the operations take device pointers only (NCCL), 0 when they take
 * host memory (the TCP ring). */
int zt_comm_device_memory(const zt_comm_t *c);
/* 1 when zt_comm_reduce_scatter_f32to64 sends each rank (N-1)/N of its
 * fp32 input and nothing more: a mesh, or two ranks (whose one ring step
 * is the same exchange); then an fp32 reduce-scatter moves half the bytes
 * of an fp64 one. 0 on a ring of 3 or more ranks and over NCCL. */
int zt_comm_f32_direct(const zt_comm_t *c);

ZT_MUST_CHECK int zt_comm_all_reduce(zt_comm_t *c, void *buf, size_t count, zt_dtype_t dt, zt_redop_t op,
                       int64_t timeout_ms);
/* send holds world*count elements; recv receives this rank's count. send and
 * recv may not overlap except recv == send + rank*count. send is clobbered. */
ZT_MUST_CHECK int zt_comm_reduce_scatter(zt_comm_t *c, void *send, void *recv, size_t count, zt_dtype_t dt,
                           zt_redop_t op, int64_t timeout_ms);
/* A sum reduce-scatter of fp32 input into fp64 sums (exact sums of fp32
 * gradients), the input staying unchanged: segment i (count elements, for
 * rank i) starts at send + i * stride (stride >= count, so the segments
 * can be pieces of larger shards), and this rank's fp64 sums land in recv,
 * which may not overlap send. The same sums, to the bit and in the same
 * order, as zt_comm_reduce_scatter of the widened input in fp64, without
 * a widened copy of the input. On a mesh every rank sends each segment as
 * fp32 straight to its owner, half the fp64 ring's bytes, and the owner
 * sums in the ring's order (world fp32 segments of scratch). On a
 * ring (2 ranks, or ring_only) the first step carries each rank's own
 * values as fp32 and the partial sums travel as fp64: (2N-3)/(2N-2) of
 * the fp64 ring's bytes. TCP only (an NCCL communicator reports an error;
 * NCCL has no fp32-to-fp64 reduction). */
ZT_MUST_CHECK int zt_comm_reduce_scatter_f32to64(zt_comm_t *c, const float *send, size_t stride,
                                                 double *recv, size_t count, int64_t timeout_ms);
/* send holds count elements; recv receives world*count. send may be
 * recv + rank*count (in place). */
ZT_MUST_CHECK int zt_comm_all_gather(zt_comm_t *c, const void *send, void *recv, size_t count, zt_dtype_t dt,
                       int64_t timeout_ms);
ZT_MUST_CHECK int zt_comm_broadcast(zt_comm_t *c, void *buf, size_t count, zt_dtype_t dt, int root,
                      int64_t timeout_ms);
/* Opaque bytes, `bytes` (even) from every rank to every rank: segment j
 * of send (send + j * bytes) goes to rank j, and rank j's segment for this
 * rank lands at recv + j * bytes (this rank's own is copied). send and
 * recv hold world * bytes and may not overlap. Straight to each owner on a
 * mesh or between two ranks, (N-1)/N of the send buffer each way; on a
 * longer ring an all-gather of every send buffer. TCP only. The encoded
 * gradients of sync.compression travel this way (engine/zero.c). */
ZT_MUST_CHECK int zt_comm_all_to_all(zt_comm_t *c, const void *send, void *recv, size_t bytes,
                                     int64_t timeout_ms);
ZT_MUST_CHECK int zt_comm_barrier(zt_comm_t *c, int64_t timeout_ms);

/* ---- stream order (device communicators) -----------------------------------
 *
 * Over NCCL the collectives can run beside the caller's kernels instead of
 * after a host synchronisation. zt_comm_set_stream names the stream (a
 * cudaStream_t) the caller's kernels run on; from then on every operation,
 * blocking or not, runs on the communicator's own stream behind what that
 * stream held when it was called (an event: no host wait). The _async
 * operations return once enqueued, with a ticket: the caller may queue more
 * kernels, which run beside the collective, but must neither write its
 * send buffer nor read or write its receive buffer until zt_comm_join(c,
 * ticket) has made its stream wait for it (ticket 0: the last one issued);
 * the host does not wait there either. zt_comm_settle waits on the host
 * until every operation is done, each within its own timeout_ms of being
 * enqueued; zt_comm_progress only looks. Either one reports a collective
 * that failed, timed out or was aborted, and ends the NCCL communicator
 * then, which releases every stream a join made wait for it (the caller's
 * next host wait on its stream returns, on data that the failed step
 * discards). A TCP communicator refuses set_stream and the _async calls;
 * progress, join and settle have nothing to do there and return 0. */
ZT_MUST_CHECK int zt_comm_set_stream(zt_comm_t *c, void *stream);
ZT_MUST_CHECK int zt_comm_reduce_scatter_async(zt_comm_t *c, void *send, void *recv, size_t count,
                                               zt_dtype_t dt, zt_redop_t op, int64_t timeout_ms,
                                               uint64_t *ticket);
ZT_MUST_CHECK int zt_comm_all_gather_async(zt_comm_t *c, const void *send, void *recv,
                                           size_t count, zt_dtype_t dt, int64_t timeout_ms,
                                           uint64_t *ticket);
ZT_MUST_CHECK int zt_comm_join(zt_comm_t *c, uint64_t ticket);
ZT_MUST_CHECK int zt_comm_progress(zt_comm_t *c);
ZT_MUST_CHECK int zt_comm_settle(zt_comm_t *c);

/* A view: a communicator of some of c's ranks, ranks[0 .. n) (c's ranks,
 * this one among them), that runs its collectives over c's own
 * connections, so it costs no set-up and no socket. Rank i of the view is
 * c's rank ranks[i]; every member must make the same call with the same
 * list. Every pair of members needs a direct connection, which the mesh
 * gives (3 to ZT_COMM_MESH_MAX ranks), or n <= 2 ranks that the ring
 * joins both ways. TCP only (NCCL: an error).
 *
 * A view breaks with c (c's abort, or its failure) and breaks c when it
 * fails (naming c's rank of the failed peer), so zt_comm_broken(c) tells
 * either. Its byte counts add to c's. Views whose members share no pair
 * of ranks (a group's ranks, and the ranks of the same place in every
 * group) use disjoint sockets and may run at the same time from different
 * threads; otherwise one at a time, as c's own calls. Destroy views before
 * c. A view of a view is a view of the same c. */
ZT_MUST_CHECK int zt_comm_view(zt_comm_t *c, const int *ranks, int n, zt_comm_t **out);

/* Makes the current and all later operations fail; safe from any thread. */
void zt_comm_abort(zt_comm_t *c);
/* 1 once an operation has failed or the communicator was aborted. */
int zt_comm_broken(const zt_comm_t *c);
/* The rank whose connection failed first (dead, silent), or -1. */
int zt_comm_failed_peer(const zt_comm_t *c);
/* 1 when that connection ended (the peer closed or reset it: its process
 * died, or it left the generation), rather than fell silent. */
int zt_comm_failed_peer_closed(const zt_comm_t *c);
void zt_comm_stats_get(const zt_comm_t *c, zt_comm_stats_t *s);
void zt_comm_destroy(zt_comm_t *c);

/* ---- helpers shared by backends and tests -------------------------------- */

/* dst[i] = dst[i] + src[i] in the given type (fp32 arithmetic). */
void zt_comm_reduce_add(void *dst, const void *src, size_t n, zt_dtype_t dt);
void zt_comm_scale(void *buf, size_t n, zt_dtype_t dt, float s);

#endif
