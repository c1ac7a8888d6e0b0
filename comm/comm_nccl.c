/*
 * comm_nccl.c: the NCCL backend of comm.h, for GPU workers.
 *
 * Compiled whenever the build finds CUDA and NCCL (/usr/local/cuda). The
 * libraries are opened with dlopen() at communicator creation, not linked,
 * so one zworker binary runs on machines with and without GPUs; a CPU-only
 * machine simply never creates an NCCL communicator.
 *
 * Every NCCL call is non-blocking (ncclConfig_t.blocking = 0): creation and
 * each collective are enqueued, then polled with ncclCommGetAsyncError()
 * and cudaStreamQuery() until done, until the deadline, or until
 * zt_comm_abort() raises the abort flag; the last two end in
 * ncclCommAbort(), so no call can hang on a dead or silent peer. Buffers
 * are device pointers. The unique id is produced by rank 0
 * (zt_comm_nccl_unique_id) and handed to every rank by the coordinator as
 * 256 hex characters.
 *
 * Stream order (comm.h, zt_comm_set_stream): once the caller names the
 * stream its kernels run on, every collective waits on the device for
 * what that stream holds (an event recorded there, waited for by ours),
 * not for a host synchronisation. The _async collectives return once
 * enqueued; each records an event on our stream when it is done, kept
 * with its enqueue time in a ring (ZT_NCCL_INFLIGHT): zt_comm_join makes
 * the caller's stream wait for one, and progress / settle reap the done
 * ones from the oldest, so a collective that outlives its timeout is
 * found, and aborted, at the next look.
 *
 * How it fits. This file fills the front's table of operations
 * (nccl_ops; comm_impl.h) and makes the communicators that use it
 * (zt_comm_nccl_create); comm.c checks every call, counts it and dispatches
 * it here. A failure here ends the NCCL communicator (die(), with the
 * reason every later call repeats) and returns -1; the front then breaks
 * the communicator as it does for the ring. What NCCL has no operation
 * for (the fp32-into-fp64 reduce-scatter, the all-to-all, views) is absent
 * from the table, and the front refuses it. Builds without CUDA compile
 * comm_nonccl.c instead.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm.h"
#include "comm_impl.h"
#include "zt_common.h"

/* The entry points we use, resolved by dlsym. */
static struct {
  int loaded;
  ncclResult_t (*GetUniqueId)(ncclUniqueId *);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                                ncclComm_t, cudaStream_t);
  ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
                            cudaStream_t);
  const char *(*GetErrorString)(ncclResult_t);
  cudaError_t (*SetDevice)(int);
  cudaError_t (*StreamCreateWithFlags)(cudaStream_t *, unsigned);
  cudaError_t (*StreamQuery)(cudaStream_t);
  cudaError_t (*StreamDestroy)(cudaStream_t);
  const char *(*CudaErrorString)(cudaError_t);
  cudaError_t (*EventCreateWithFlags)(cudaEvent_t *, unsigned);
  cudaError_t (*EventRecord)(cudaEvent_t, cudaStream_t);
  cudaError_t (*EventQuery)(cudaEvent_t);
  cudaError_t (*EventDestroy)(cudaEvent_t);
  cudaError_t (*StreamWaitEvent)(cudaStream_t, cudaEvent_t, unsigned);
  cudaError_t (*GetLastError)(void);
} nc;

static void *open_first(const char *const *names) {
  for (; *names; names++) {
    void *h = dlopen(*names, RTLD_NOW | RTLD_GLOBAL);
    if (h) return h;
  }
  return NULL;
}

#define SYM(h, field, name)                                       \
  do {                                                            \
    *(void **)&nc.field = dlsym(h, name);                         \
    if (!nc.field) return zt_err("NCCL backend: %s not found", name); \
  } while (0)

static int load(void) {
  if (nc.loaded) return 0;
  /* $ZT_CUDART_LIB and $ZT_NCCL_LIB, when set, are the only candidates: a
   * library elsewhere, or the CPU stand-ins of the gpu-sim tests. */
  const char *ec = zt_env(ZT_ENV_CUDART_LIB), *en = zt_env(ZT_ENV_NCCL_LIB);
  const char *cudart[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12",
                          "/usr/local/cuda/lib64/libcudart.so", NULL};
  const char *nccl[] = {"libnccl.so.2", "libnccl.so", "/usr/local/cuda/lib64/libnccl.so.2", NULL};
  if (ec && *ec) cudart[0] = ec, cudart[1] = NULL;
  if (en && *en) nccl[0] = en, nccl[1] = NULL;
  char why[512] = "";
  void *hc = open_first(cudart);
  if (!hc) snprintf(why, sizeof why, "%s", dlerror());
  void *hn = hc ? open_first(nccl) : NULL;
  if (hc && !hn) snprintf(why, sizeof why, "%s", dlerror());
  if (!hc || !hn) return zt_err("NCCL backend: cannot load %s: %s", !hc ? "libcudart" : "libnccl", why);
  SYM(hn, GetUniqueId, "ncclGetUniqueId");
  SYM(hn, CommInitRankConfig, "ncclCommInitRankConfig");
  SYM(hn, CommGetAsyncError, "ncclCommGetAsyncError");
  SYM(hn, CommAbort, "ncclCommAbort");
  SYM(hn, CommDestroy, "ncclCommDestroy");
  SYM(hn, AllReduce, "ncclAllReduce");
  SYM(hn, ReduceScatter, "ncclReduceScatter");
  SYM(hn, AllGather, "ncclAllGather");
  SYM(hn, Broadcast, "ncclBroadcast");
  SYM(hn, GetErrorString, "ncclGetErrorString");
  SYM(hc, SetDevice, "cudaSetDevice");
  SYM(hc, StreamCreateWithFlags, "cudaStreamCreateWithFlags");
  SYM(hc, StreamQuery, "cudaStreamQuery");
  SYM(hc, StreamDestroy, "cudaStreamDestroy");
  SYM(hc, CudaErrorString, "cudaGetErrorString");
  SYM(hc, EventCreateWithFlags, "cudaEventCreateWithFlags");
  SYM(hc, EventRecord, "cudaEventRecord");
  SYM(hc, EventQuery, "cudaEventQuery");
  SYM(hc, EventDestroy, "cudaEventDestroy");
  SYM(hc, StreamWaitEvent, "cudaStreamWaitEvent");
  SYM(hc, GetLastError, "cudaGetLastError");
  nc.loaded = 1;
  return 0;
}

/* Collectives in flight at once in stream order; one more waits (on the
 * host, within its timeout) for the oldest. A training step keeps a few
 * per unit in flight. */
#define ZT_NCCL_INFLIGHT 256

/* An asynchronous collective not yet seen done. */
typedef struct {
  cudaEvent_t done; /* recorded on our stream after it */
  int64_t t_us, timeout_ms;
  const char *op;
} inflight_t;

/* An NCCL communicator: the front's part first (comm_impl.h). */
typedef struct nccl_comm {
  zt_comm_t c;
  ncclComm_t comm;
  cudaStream_t stream;
  atomic_int abort;
  int dead; /* ncclCommAbort has run: the communicator is gone */
  /* Stream order: the caller's stream, an event to order ours after it,
   * and the ring of asynchronous collectives (tickets count them from 1;
   * ticket t is slot t % ZT_NCCL_INFLIGHT while t > reaped). */
  cudaStream_t user;
  cudaEvent_t order;
  inflight_t fl[ZT_NCCL_INFLIGHT];
  uint64_t issued, reaped;
  char err[256]; /* why the communicator died, for the calls after */
} nccl_comm;

static nccl_comm *as_nccl(zt_comm_t *c) { return (nccl_comm *)c; }

static ncclDataType_t nccl_type(zt_dtype_t dt) {
  return dt == ZT_DT_F64 ? ncclFloat64 : dt == ZT_DT_F32 ? ncclFloat32 : ncclBfloat16;
}

/* Ends the communicator with a reason that every later call repeats. */
static int die(nccl_comm *n, const char *op, const char *why) {
  if (!n->dead) nc.CommAbort(n->comm);
  n->dead = 1;
  if (!n->err[0]) snprintf(n->err, sizeof n->err, "%s: %s", op, why);
  return zt_err("%s", n->err);
}

/* A query's cudaErrorNotReady is also this thread's last error, which
 * the kernel table's next launch check would take for a failure: cleared
 * (as PyTorch's stream query does). */
static void not_ready(void) { (void)nc.GetLastError(); }

/* Polls an enqueued operation (or the initialisation) to completion:
 * busily for the first polls (a collective of a training step takes
 * microseconds to milliseconds), then every 50 us, so a long wait does not
 * take a core from the process's other threads. */
static int wait_done(nccl_comm *n, int check_stream, zt_deadline_t dl, const char *op) {
  for (int polls = 0;; polls++) {
    if (polls > 1000) nanosleep(&(struct timespec){.tv_nsec = 50000}, NULL);
    ncclResult_t st = ncclSuccess;
    nc.CommGetAsyncError(n->comm, &st);
    if (st != ncclSuccess && st != ncclInProgress) return die(n, op, nc.GetErrorString(st));
    if (st == ncclSuccess) {
      if (!check_stream) return 0;
      cudaError_t ce = nc.StreamQuery(n->stream);
      if (ce == cudaSuccess) return 0;
      if (ce != cudaErrorNotReady) return zt_err("%s: %s", op, nc.CudaErrorString(ce));
      not_ready();
    }
    if (atomic_load(&n->abort)) return die(n, op, "aborted");
    if (zt_deadline_passed(dl)) return die(n, op, "timed out");
  }
}

/* Stream order: our stream waits for what the caller's stream holds. */
static int order_after_user(nccl_comm *n, const char *op) {
  if (!n->user) return 0;
  cudaError_t ce = nc.EventRecord(n->order, n->user);
  if (ce == cudaSuccess) ce = nc.StreamWaitEvent(n->stream, n->order, 0);
  return ce == cudaSuccess ? 0 : zt_err("%s: ordering after the caller's stream: %s", op,
                                        nc.CudaErrorString(ce));
}

/* Reaps the asynchronous collectives that are done, from the oldest, and
 * ends the communicator when NCCL reports an error, the abort flag is up,
 * or the oldest one left has outlived its timeout. */
static int progress(nccl_comm *n) {
  if (n->dead) return zt_err("%s", n->err[0] ? n->err : "NCCL communicator aborted");
  while (n->reaped < n->issued) {
    inflight_t *f = &n->fl[(n->reaped + 1) % ZT_NCCL_INFLIGHT];
    cudaError_t ce = nc.EventQuery(f->done);
    if (ce == cudaErrorNotReady) {
      not_ready();
      break;
    }
    if (ce != cudaSuccess) return die(n, f->op, nc.CudaErrorString(ce));
    n->reaped++;
  }
  const char *op = n->reaped < n->issued ? n->fl[(n->reaped + 1) % ZT_NCCL_INFLIGHT].op : "NCCL";
  ncclResult_t st = ncclSuccess;
  nc.CommGetAsyncError(n->comm, &st);
  if (st != ncclSuccess && st != ncclInProgress) return die(n, op, nc.GetErrorString(st));
  if (atomic_load(&n->abort)) return die(n, op, "aborted");
  if (n->reaped < n->issued) {
    inflight_t *f = &n->fl[(n->reaped + 1) % ZT_NCCL_INFLIGHT];
    if (f->timeout_ms > 0 && zt_now_us() - f->t_us > f->timeout_ms * 1000)
      return die(n, f->op, "timed out");
  }
  return 0;
}

/* Waits until at most `left` asynchronous collectives are in flight. */
static int drain_to(nccl_comm *n, uint64_t left) {
  for (int polls = 0;; polls++) {
    if (progress(n) != 0) return -1;
    if (n->issued - n->reaped <= left) return 0;
    if (polls > 1000) nanosleep(&(struct timespec){.tv_nsec = 50000}, NULL);
  }
}

static int enqueued(nccl_comm *n, ncclResult_t r, int64_t timeout_ms, const char *op) {
  if (r != ncclSuccess && r != ncclInProgress) return zt_err("%s: %s", op, nc.GetErrorString(r));
  if (wait_done(n, 1, zt_deadline_in(timeout_ms), op) != 0) return -1;
  n->reaped = n->issued; /* our stream is idle: the asynchronous ones are done too */
  return 0;
}

/* An asynchronous collective just enqueued (r): its event and ticket. */
static int issued(nccl_comm *n, ncclResult_t r, int64_t timeout_ms, const char *op,
                  uint64_t *ticket) {
  if (r != ncclSuccess && r != ncclInProgress) return zt_err("%s: %s", op, nc.GetErrorString(r));
  /* A non-blocking communicator may return before the collective is on
   * our stream (ncclInProgress, in the call's result or its state): the
   * event goes behind it only once the state says ncclSuccess. */
  if (wait_done(n, 0, zt_deadline_in(timeout_ms), op) != 0) return -1;
  inflight_t *f = &n->fl[(n->issued + 1) % ZT_NCCL_INFLIGHT];
  cudaError_t ce = nc.EventRecord(f->done, n->stream);
  if (ce != cudaSuccess) return die(n, op, nc.CudaErrorString(ce));
  f->t_us = zt_now_us(), f->timeout_ms = timeout_ms, f->op = op;
  *ticket = ++n->issued;
  return 0;
}

/* Before an operation: the communicator is alive, a slot is free, and
 * our stream is ordered after the caller's. */
static int before(nccl_comm *n, const char *op) {
  if (progress(n) != 0) return -1;
  if (n->issued - n->reaped >= ZT_NCCL_INFLIGHT - 1 && drain_to(n, ZT_NCCL_INFLIGHT / 2) != 0)
    return -1;
  return order_after_user(n, op);
}

/* ---- the operations (the table's entries) -------------------------------- */

static int nccl_set_stream(zt_comm_t *c, void *stream) {
  nccl_comm *n = as_nccl(c);
  if (n->issued > n->reaped && drain_to(n, 0) != 0) return -1;
  if (!n->order) {
    cudaError_t ce = nc.EventCreateWithFlags(&n->order, cudaEventDisableTiming);
    for (int i = 0; ce == cudaSuccess && i < ZT_NCCL_INFLIGHT; i++)
      ce = nc.EventCreateWithFlags(&n->fl[i].done, cudaEventDisableTiming);
    if (ce != cudaSuccess) return zt_err("cudaEventCreate: %s", nc.CudaErrorString(ce));
  }
  n->user = stream;
  return 0;
}

static ncclRedOp_t nccl_op(zt_redop_t op) { return op == ZT_RED_AVG ? ncclAvg : ncclSum; }

static int nccl_reduce_scatter_async(zt_comm_t *c, void *send, void *recv, size_t count,
                                     zt_dtype_t dt, zt_redop_t op, int64_t timeout_ms,
                                     uint64_t *ticket) {
  nccl_comm *n = as_nccl(c);
  if (!n->user) return zt_err("ncclReduceScatter: no stream to order it after");
  if (before(n, "ncclReduceScatter") != 0) return -1;
  return issued(n, nc.ReduceScatter(send, recv, count, nccl_type(dt), nccl_op(op), n->comm,
                                    n->stream),
                timeout_ms, "ncclReduceScatter", ticket);
}

static int nccl_all_gather_async(zt_comm_t *c, const void *send, void *recv, size_t count,
                                 zt_dtype_t dt, int64_t timeout_ms, uint64_t *ticket) {
  nccl_comm *n = as_nccl(c);
  if (!n->user) return zt_err("ncclAllGather: no stream to order it after");
  if (before(n, "ncclAllGather") != 0) return -1;
  return issued(n, nc.AllGather(send, recv, count, nccl_type(dt), n->comm, n->stream),
                timeout_ms, "ncclAllGather", ticket);
}

/* The caller's stream waits for collective `ticket` (0: the last one). One
 * the host has seen done needs no wait. */
static int nccl_join(zt_comm_t *c, uint64_t ticket) {
  nccl_comm *n = as_nccl(c);
  if (progress(n) != 0) return -1;
  if (!ticket) ticket = n->issued;
  if (ticket > n->issued) return zt_err("NCCL join: ticket %llu was never issued",
                                        (unsigned long long)ticket);
  if (ticket <= n->reaped) return 0;
  cudaError_t ce = nc.StreamWaitEvent(n->user, n->fl[ticket % ZT_NCCL_INFLIGHT].done, 0);
  return ce == cudaSuccess ? 0 : zt_err("NCCL join: %s", nc.CudaErrorString(ce));
}

static int nccl_progress(zt_comm_t *c) { return progress(as_nccl(c)); }

static int nccl_settle(zt_comm_t *c) { return drain_to(as_nccl(c), 0); }

static int nccl_all_reduce(zt_comm_t *c, void *buf, size_t count, zt_dtype_t dt, zt_redop_t op,
                           int64_t timeout_ms) {
  nccl_comm *n = as_nccl(c);
  if (before(n, "ncclAllReduce") != 0) return -1;
  return enqueued(n, nc.AllReduce(buf, buf, count, nccl_type(dt), nccl_op(op), n->comm, n->stream),
                  timeout_ms, "ncclAllReduce");
}

static int nccl_reduce_scatter(zt_comm_t *c, void *send, void *recv, size_t count, zt_dtype_t dt,
                               zt_redop_t op, int64_t timeout_ms) {
  nccl_comm *n = as_nccl(c);
  if (before(n, "ncclReduceScatter") != 0) return -1;
  return enqueued(n, nc.ReduceScatter(send, recv, count, nccl_type(dt), nccl_op(op), n->comm,
                                      n->stream),
                  timeout_ms, "ncclReduceScatter");
}

static int nccl_all_gather(zt_comm_t *c, const void *send, void *recv, size_t count,
                           zt_dtype_t dt, int64_t timeout_ms) {
  nccl_comm *n = as_nccl(c);
  if (before(n, "ncclAllGather") != 0) return -1;
  return enqueued(n, nc.AllGather(send, recv, count, nccl_type(dt), n->comm, n->stream), timeout_ms,
                  "ncclAllGather");
}

static int nccl_broadcast(zt_comm_t *c, void *buf, size_t count, zt_dtype_t dt, int root,
                          int64_t timeout_ms) {
  nccl_comm *n = as_nccl(c);
  if (before(n, "ncclBroadcast") != 0) return -1;
  return enqueued(n, nc.Broadcast(buf, buf, count, nccl_type(dt), root, n->comm, n->stream),
                  timeout_ms, "ncclBroadcast");
}

/* Raises the flag that every wait of this communicator polls. */
static void nccl_abort(zt_comm_t *c) { atomic_store(&as_nccl(c)->abort, 1); }

static void nccl_destroy(zt_comm_t *c) {
  nccl_comm *n = as_nccl(c);
  /* Collectives still in flight may wait for a peer that is gone. */
  if (!n->dead && n->issued > n->reaped) (void)progress(n);
  if (!n->dead) {
    if (atomic_load(&n->abort) || n->issued > n->reaped) nc.CommAbort(n->comm);
    else nc.CommDestroy(n->comm);
  }
  if (n->order) {
    nc.EventDestroy(n->order);
    for (int i = 0; i < ZT_NCCL_INFLIGHT; i++) nc.EventDestroy(n->fl[i].done);
  }
  nc.StreamDestroy(n->stream);
  free(n);
}

/* Device memory and stream order; no fp32-into-fp64 reduce-scatter (NCCL
 * has no such reduction), no all-to-all and no views: the front refuses
 * those. */
static const zt__comm_ops_t nccl_ops = {
    .name = "nccl",
    .title = "NCCL",
    .device_memory = 1,
    .all_reduce = nccl_all_reduce,
    .reduce_scatter = nccl_reduce_scatter,
    .all_gather = nccl_all_gather,
    .broadcast = nccl_broadcast,
    .set_stream = nccl_set_stream,
    .reduce_scatter_async = nccl_reduce_scatter_async,
    .all_gather_async = nccl_all_gather_async,
    .join = nccl_join,
    .progress = nccl_progress,
    .settle = nccl_settle,
    .abort = nccl_abort,
    .destroy = nccl_destroy,
};

/* ---- construction -------------------------------------------------------- */

int zt_comm_nccl_available(void) { return load() == 0; }

int zt_comm_nccl_unique_id(char hex[2 * NCCL_UNIQUE_ID_BYTES + 1]) {
  if (load() != 0) return -1;
  ncclUniqueId id;
  ncclResult_t r = nc.GetUniqueId(&id);
  if (r != ncclSuccess) return zt_err("ncclGetUniqueId: %s", nc.GetErrorString(r));
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++)
    snprintf(hex + 2 * i, 3, "%02x", (unsigned char)id.internal[i]);
  return 0;
}

int zt_comm_nccl_create(int rank, int world, const char *id_hex, int device, int64_t timeout_ms,
                        zt_comm_t **out) {
  if (load() != 0) return -1;
  ncclUniqueId id;
  if (strlen(id_hex) != 2 * NCCL_UNIQUE_ID_BYTES) return zt_err("NCCL unique id: bad length");
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) {
    unsigned v;
    if (sscanf(id_hex + 2 * i, "%2x", &v) != 1) return zt_err("NCCL unique id: not hex");
    id.internal[i] = (char)v;
  }
  cudaError_t ce = nc.SetDevice(device);
  if (ce != cudaSuccess) return zt_err("cudaSetDevice(%d): %s", device, nc.CudaErrorString(ce));
  nccl_comm *n = zt_xcalloc(1, sizeof *n);
  ce = nc.StreamCreateWithFlags(&n->stream, cudaStreamNonBlocking);
  if (ce != cudaSuccess) {
    free(n);
    return zt_err("cudaStreamCreate: %s", nc.CudaErrorString(ce));
  }
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t r = nc.CommInitRankConfig(&n->comm, world, id, rank, &cfg);
  if ((r != ncclSuccess && r != ncclInProgress) ||
      wait_done(n, 0, zt_deadline_in(timeout_ms), "ncclCommInitRank") != 0) {
    if (r != ncclSuccess && r != ncclInProgress) zt_err("ncclCommInitRank: %s", nc.GetErrorString(r));
    else if (!n->dead) nc.CommAbort(n->comm);
    nc.StreamDestroy(n->stream);
    free(n);
    return -1;
  }
  zt__comm_init(&n->c, &nccl_ops, rank, world);
  *out = &n->c;
  return 0;
}
