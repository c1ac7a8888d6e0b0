/*
 * sim_nccl.cpp: the NCCL stand-in of the CPU stand-in for CUDA
 * (libzt_nccl_sim.so; docs/gpu.md, "The CPU stand-in"). A TEST DOUBLE: it
 * is built for the gpu-sim tests, never installed, and never linked into a
 * binary; comm/comm_nccl.c loads it in place of libnccl.so.2 when
 * $ZT_NCCL_LIB names it (and libzt_cudart_sim.so as its libcudart,
 * $ZT_CUDART_LIB), so the real NCCL backend code runs unmodified between
 * zworker processes whose "GPUs" are the stand-in's.
 *
 * What it implements: ncclGetUniqueId, the non-blocking
 * ncclCommInitRankConfig (config.blocking = 0; the connections are made by
 * a thread, and ncclCommGetAsyncError says ncclInProgress until they are),
 * ncclAllReduce / ncclReduceScatter / ncclAllGather / ncclBroadcast on
 * device memory, enqueued on a stream (the stream stays busy for
 * cudaStreamQuery until the collective is done), asynchronous errors, and
 * ncclCommAbort / ncclCommDestroy.
 *
 * How: the unique id carries a random token; the ranks of a communicator
 * meet at Unix sockets in the abstract namespace named after it (so only
 * processes of one machine and one network namespace, as in the tests).
 * Every rank connects to rank 0, which runs each collective for all:
 * it receives every rank's input, reduces in rank order (0, 1, ..., N-1,
 * in the element type: fp64 sums for fp64 data), and sends each rank its
 * output. So results are deterministic and the same on every rank, as
 * NCCL's are for a fixed communicator; they are not NCCL's bits (whose
 * ring or tree order differs), which the tests never assume.
 *
 * Failures behave as NCCL's do for the caller: a peer that dies (its
 * socket closes) or disagrees (another collective, another count) puts the
 * communicator in error (ncclRemoteError, ncclInvalidUsage) for
 * ncclCommGetAsyncError, and the collective in flight never completes (its
 * stream stays busy) until ncclCommAbort. Rank 0 closes every link when it
 * fails, so the others learn of it too. A buffer that is not device memory
 * is ncclInvalidArgument, with a message naming it on stderr.
 *
 * Stream order. A collective runs after the work its stream waited for
 * and the caller may queue more beside it (engine/zero.c overlaps them
 * with the backward), so a kernel that writes its send buffer, or reads
 * its receive buffer, before a cudaStreamWaitEvent on it is a race on a
 * GPU. Here kernels run when launched, so the stand-in makes such races
 * show: a collective hashes its send bytes when enqueued and again when
 * it starts, and ends the process naming the buffer when they differ
 * (unless a collective queued before it wrote them); it fills the part of
 * its receive buffer that is not its send buffer with 0xff bytes (NaN in
 * every float type) when it starts; and with $ZT_SIM_NCCL_LAZY_MS set, it
 * starts only when the host waits for its stream (a query,
 * synchronisation or a stream waiting on its event) or that many
 * milliseconds after it was enqueued, so a missing wait leaves it
 * unstarted long enough for the checks to see it.
 */
#include <cuda_runtime.h>
#include <errno.h>
#include <fcntl.h>
#include <nccl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "zt_sim.h"

namespace {

const char kMagic[8] = {'z', 't', 'n', 'c', 's', 'i', 'm', 0};
const uint32_t kHello = 0x7a6e6331; /* "znc1" */

enum kind_t { K_ALL_REDUCE, K_REDUCE_SCATTER, K_ALL_GATHER, K_BROADCAST };
const char *const kNames[] = {"ncclAllReduce", "ncclReduceScatter", "ncclAllGather",
                              "ncclBroadcast"};

struct op_t {
  int kind;
  const void *send;
  void *recv;
  size_t count; /* as passed: recvcount for reduce-scatter, sendcount for all-gather */
  int dt, red, root;
  cudaStream_t stream;
  /* The order checks (see "Stream order" above): a hash of the send
   * bytes when the collective was enqueued (or when one queued before it
   * last wrote them), and the stream's wanted count then. */
  uint64_t sum;
  unsigned long wanted;
  double t_ms;
};

/* What every rank sends rank 0 before its input, and rank 0 checks. */
struct wire_hdr {
  uint64_t seq, count;
  int32_t kind, dt, red, root;
};

__attribute__((format(printf, 1, 2))) void say(const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stderr, "zt-nccl-sim: %s\n", buf);
}

size_t dt_size(int dt) {
  switch (dt) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: return 0;
  }
}

float bf16_to_f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t f_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

template <typename T>
T apply(T a, T b, int red) {
  switch (red) {
    case ncclProd: return a * b;
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
    default: return a + b; /* sum, avg */
  }
}

/* acc[i] = acc[i] (red) x[i], n elements of type T. */
template <typename T>
void reduce_into(void *acc, const void *x, size_t n, int red) {
  T *a = (T *)acc;
  const T *b = (const T *)x;
  for (size_t i = 0; i < n; i++) a[i] = apply(a[i], b[i], red);
}

template <typename T>
void divide(void *acc, size_t n, int by) {
  T *a = (T *)acc;
  for (size_t i = 0; i < n; i++) a[i] = (T)(a[i] / (T)by);
}

void reduce_bytes(void *acc, const void *x, size_t n, int dt, int red) {
  switch (dt) {
    case ncclFloat32: reduce_into<float>(acc, x, n, red); break;
    case ncclFloat64: reduce_into<double>(acc, x, n, red); break;
    case ncclInt32: reduce_into<int32_t>(acc, x, n, red); break;
    case ncclUint32: reduce_into<uint32_t>(acc, x, n, red); break;
    case ncclInt64: reduce_into<int64_t>(acc, x, n, red); break;
    case ncclUint64: reduce_into<uint64_t>(acc, x, n, red); break;
    case ncclInt8: reduce_into<int8_t>(acc, x, n, red); break;
    case ncclUint8: reduce_into<uint8_t>(acc, x, n, red); break;
    case ncclBfloat16: {
      uint16_t *a = (uint16_t *)acc;
      const uint16_t *b = (const uint16_t *)x;
      for (size_t i = 0; i < n; i++) a[i] = f_to_bf16(apply(bf16_to_f(a[i]), bf16_to_f(b[i]), red));
      break;
    }
  }
}

void average(void *acc, size_t n, int dt, int N) {
  switch (dt) {
    case ncclFloat32: divide<float>(acc, n, N); break;
    case ncclFloat64: divide<double>(acc, n, N); break;
    case ncclInt32: divide<int32_t>(acc, n, N); break;
    case ncclUint32: divide<uint32_t>(acc, n, N); break;
    case ncclInt64: divide<int64_t>(acc, n, N); break;
    case ncclUint64: divide<uint64_t>(acc, n, N); break;
    case ncclInt8: divide<int8_t>(acc, n, N); break;
    case ncclUint8: divide<uint8_t>(acc, n, N); break;
    case ncclBfloat16: {
      uint16_t *a = (uint16_t *)acc;
      for (size_t i = 0; i < n; i++) a[i] = f_to_bf16(bf16_to_f(a[i]) / (float)N);
      break;
    }
  }
}

}  // namespace

struct ncclComm {
  int rank = 0, nranks = 0;
  char token[48] = "";
  std::atomic<int> state{ncclInProgress};
  std::atomic<int> aborting{0};
  std::vector<int> fds; /* rank 0: fds[r] is rank r's link; others: fds[0] */
  int lfd = -1;
  std::thread th;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<op_t> q;     /* enqueued, not started */
  std::vector<op_t> held; /* started and failed: their streams stay busy */
  bool closing = false;
  uint64_t seq = 0;

  ~ncclComm() {
    for (int fd : fds)
      if (fd >= 0) close(fd);
    if (lfd >= 0) close(lfd);
  }
};

namespace {

void fail(ncclComm *c, ncclResult_t r) {
  int expect = ncclSuccess;
  if (!c->state.compare_exchange_strong(expect, r)) {
    expect = ncclInProgress;
    c->state.compare_exchange_strong(expect, r);
  }
  if (c->rank == 0) /* the others learn of it when their link closes */
    for (int fd : c->fds)
      if (fd >= 0) shutdown(fd, SHUT_RDWR);
}

/* Waits until fd is ready for `ev`; false on abort or a dead link. */
bool wait_fd(ncclComm *c, int fd, short ev) {
  for (;;) {
    if (c->aborting.load()) return false;
    struct pollfd p = {fd, ev, 0};
    int n = poll(&p, 1, 50);
    if (n < 0 && errno != EINTR) return false;
    if (n > 0) return true;
  }
}

bool send_all(ncclComm *c, int fd, const void *buf, size_t n) {
  const char *p = (const char *)buf;
  while (n) {
    if (!wait_fd(c, fd, POLLOUT)) return false;
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (k <= 0) return false;
    p += k, n -= (size_t)k;
  }
  return true;
}

bool recv_all(ncclComm *c, int fd, void *buf, size_t n) {
  char *p = (char *)buf;
  while (n) {
    if (!wait_fd(c, fd, POLLIN)) return false;
    ssize_t k = recv(fd, p, n, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (k <= 0) return false;
    p += k, n -= (size_t)k;
  }
  return true;
}

socklen_t address(const ncclComm *c, struct sockaddr_un *a) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "zt-nccl-sim/%s", c->token);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* Rank 0: accepts every other rank's hello, then tells each all are in. */
bool init_root(ncclComm *c) {
  struct sockaddr_un a;
  socklen_t len = address(c, &a);
  c->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c->lfd < 0 || bind(c->lfd, (struct sockaddr *)&a, len) != 0 || listen(c->lfd, 64) != 0) {
    say("ncclCommInitRank: %s: cannot listen: %s", c->token, strerror(errno));
    return false;
  }
  for (int got = 1; got < c->nranks;) {
    if (!wait_fd(c, c->lfd, POLLIN)) return false;
    int fd = accept4(c->lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;
    uint32_t h[3];
    if (!recv_all(c, fd, h, sizeof h) || h[0] != kHello || h[2] != (uint32_t)c->nranks ||
        h[1] == 0 || h[1] >= (uint32_t)c->nranks || c->fds[h[1]] >= 0) {
      if (c->aborting.load()) return false;
      say("ncclCommInitRank: %s: a bad hello, ignored", c->token); /* not one of ours */
      close(fd);
      continue;
    }
    std::lock_guard<std::mutex> lk(c->mu); /* fds: finish() reads them */
    c->fds[h[1]] = fd;
    got++;
  }
  for (int r = 1; r < c->nranks; r++) {
    char ok = 1;
    if (!send_all(c, c->fds[r], &ok, 1)) return false;
  }
  return true;
}

/* Rank r > 0: connects to rank 0 (which may not listen yet) and waits
 * until every rank is in. */
bool init_peer(ncclComm *c) {
  struct sockaddr_un a;
  socklen_t len = address(c, &a);
  for (;;) {
    if (c->aborting.load()) return false;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    if (connect(fd, (struct sockaddr *)&a, len) == 0) {
      std::lock_guard<std::mutex> lk(c->mu); /* fds: finish() reads them */
      c->fds[0] = fd;
      break;
    }
    close(fd);
    usleep(10000);
  }
  uint32_t h[3] = {kHello, (uint32_t)c->rank, (uint32_t)c->nranks};
  char ok = 0;
  return send_all(c, c->fds[0], h, sizeof h) && recv_all(c, c->fds[0], &ok, 1) && ok == 1;
}

/* The bytes a rank sends (in) and receives (out) for op o. */
void sizes(const ncclComm *c, const op_t &o, int rank, size_t *in, size_t *out) {
  size_t b = o.count * dt_size(o.dt), N = (size_t)c->nranks;
  switch (o.kind) {
    case K_ALL_REDUCE: *in = b, *out = b; break;
    case K_REDUCE_SCATTER: *in = b * N, *out = b; break;
    case K_ALL_GATHER: *in = b, *out = b * N; break;
    default: *in = rank == o.root ? b : 0, *out = b; break;
  }
}

/* FNV-1a over device bytes (copied out first). */
uint64_t hash_device(const void *p, size_t n) {
  std::vector<unsigned char> h(n);
  if (n && cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost) != cudaSuccess) return 0;
  uint64_t x = 1469598103934665603ull;
  for (unsigned char b : h) x = (x ^ b) * 1099511628211ull;
  return x;
}

double lazy_ms() {
  static double v = -1;
  if (v < 0) {
    const char *e = getenv("ZT_SIM_NCCL_LAZY_MS");
    v = e && *e ? atof(e) : 0.0;
  }
  return v;
}

double mono_ms() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Rank 0's half: every input in, every output computed and sent. */
ncclResult_t run_root(ncclComm *c, const op_t &o, const wire_hdr &mine, std::vector<char> &in0,
                      std::vector<char> &out0) {
  int N = c->nranks;
  std::vector<std::vector<char>> in((size_t)N);
  in[0].swap(in0);
  for (int r = 1; r < N; r++) {
    wire_hdr h;
    if (!recv_all(c, c->fds[r], &h, sizeof h)) return ncclRemoteError;
    if (h.seq != mine.seq || h.kind != mine.kind || h.count != mine.count || h.dt != mine.dt ||
        h.red != mine.red || h.root != mine.root) {
      say("%s: rank %d called another collective (or count, type, op, root) than rank 0",
          kNames[o.kind], r);
      return ncclInvalidUsage;
    }
    size_t ib, ob;
    sizes(c, o, r, &ib, &ob);
    in[(size_t)r].resize(ib);
    if (ib && !recv_all(c, c->fds[r], in[(size_t)r].data(), ib)) return ncclRemoteError;
  }
  size_t n = o.count, es = dt_size(o.dt), b = n * es;
  std::vector<char> all;
  if (o.kind == K_ALL_REDUCE || o.kind == K_REDUCE_SCATTER) {
    all = in[0];
    size_t elems = all.size() / es;
    for (int r = 1; r < N; r++) reduce_bytes(all.data(), in[(size_t)r].data(), elems, o.dt, o.red);
    if (o.red == ncclAvg) average(all.data(), elems, o.dt, N);
  } else if (o.kind == K_ALL_GATHER) {
    for (int r = 0; r < N; r++) all.insert(all.end(), in[(size_t)r].begin(), in[(size_t)r].end());
  } else {
    all = in[(size_t)o.root];
  }
  for (int r = 0; r < N; r++) {
    const char *p = all.data() + (o.kind == K_REDUCE_SCATTER ? (size_t)r * b : 0);
    size_t len = o.kind == K_REDUCE_SCATTER ? b : all.size();
    if (r == 0) out0.assign(p, p + len);
    else if (!send_all(c, c->fds[r], p, len)) return ncclRemoteError;
  }
  return ncclSuccess;
}

/* The receive bytes outside the send buffer, set to 0xff (NaN) as the
 * collective starts. */
void poison(const op_t &o, size_t ib, size_t ob) {
  char *r = (char *)o.recv;
  const char *sd = (const char *)o.send;
  if (!ob) return;
  if (!ib || sd + ib <= r || r + ob <= sd) { /* apart */
    cudaMemset(r, 0xff, ob);
  } else if (sd >= r && sd + ib <= r + ob) { /* in place: send inside recv */
    size_t lo = (size_t)(sd - r), hi = lo + ib;
    if (lo) cudaMemset(r, 0xff, lo);
    if (ob > hi) cudaMemset(r + hi, 0xff, ob - hi);
  } /* recv inside send: every byte is still to be read */
}

/* A collective wrote [p, p + n): the queued ones that send from there
 * take their hash anew (the stream orders them after it). */
void rehash_after_write(ncclComm *c, const void *p, size_t n) {
  std::lock_guard<std::mutex> lk(c->mu);
  for (op_t &q : c->q) {
    size_t ib, ob;
    sizes(c, q, c->rank, &ib, &ob);
    const char *a = (const char *)q.send, *b = (const char *)p;
    if (ib && a < b + n && b < a + ib) q.sum = hash_device(q.send, ib);
  }
}

/* One collective on this rank; the stream's hold is released on success. */
ncclResult_t run(ncclComm *c, const op_t &o) {
  size_t ib, ob;
  sizes(c, o, c->rank, &ib, &ob);
  std::vector<char> in(ib), out(ob);
  if (ib && cudaMemcpy(in.data(), o.send, ib, cudaMemcpyDeviceToHost) != cudaSuccess) {
    say("%s: the send buffer %p is not device memory", kNames[o.kind], o.send);
    return ncclInvalidArgument;
  }
  if (ib && hash_device(o.send, ib) != o.sum)
    zt_sim::fatal("%s on rank %d: its send buffer %p (%zu bytes) changed between the call and the "
                  "start of the collective: something wrote it without waiting for the collective "
                  "(cudaStreamWaitEvent on an event recorded after it)",
                  kNames[o.kind], c->rank, o.send, ib);
  poison(o, ib, ob);
  wire_hdr h = {c->seq++, o.count, o.kind, o.dt, o.red, o.root};
  ncclResult_t r = ncclSuccess;
  if (c->nranks == 1) out = in;
  else if (c->rank == 0) r = run_root(c, o, h, in, out);
  else if (!send_all(c, c->fds[0], &h, sizeof h) || (ib && !send_all(c, c->fds[0], in.data(), ib)) ||
           !recv_all(c, c->fds[0], out.data(), ob))
    r = ncclRemoteError;
  if (r != ncclSuccess) return r;
  if (ob && cudaMemcpy(o.recv, out.data(), ob, cudaMemcpyHostToDevice) != cudaSuccess) {
    say("%s: the receive buffer %p is not device memory", kNames[o.kind], o.recv);
    return ncclInvalidArgument;
  }
  rehash_after_write(c, o.recv, ob);
  zt_sim::stream_hold(o.stream, -1);
  return ncclSuccess;
}

void main_loop(ncclComm *c) {
  bool ok = c->nranks == 1 || (c->rank == 0 ? init_root(c) : init_peer(c));
  if (!ok) {
    fail(c, c->aborting.load() ? ncclInvalidUsage : ncclRemoteError);
    return;
  }
  int expect = ncclInProgress;
  c->state.compare_exchange_strong(expect, ncclSuccess);
  for (;;) {
    op_t o;
    {
      std::unique_lock<std::mutex> lk(c->mu);
      c->cv.wait(lk, [c] { return c->closing || !c->q.empty(); });
      if (c->q.empty()) return;
      o = c->q.front();
    }
    /* Lazy mode: not before the host wants it (see the top). */
    while (lazy_ms() > 0 && !c->aborting.load() && mono_ms() - o.t_ms < lazy_ms() &&
           zt_sim::stream_wanted(o.stream) == o.wanted)
      usleep(200);
    {
      std::lock_guard<std::mutex> lk(c->mu);
      o = c->q.front(); /* its hash may have been taken anew */
      c->q.pop_front();
    }
    ncclResult_t r = c->state.load() == ncclSuccess ? run(c, o) : ncclInvalidUsage;
    if (r != ncclSuccess) { /* hangs like a failed kernel until the abort */
      std::lock_guard<std::mutex> lk(c->mu);
      c->held.push_back(o);
      zt_sim::stream_fail(o.stream);
      if (!c->aborting.load()) fail(c, r);
    }
  }
}

ncclResult_t enqueue(ncclComm *c, int kind, const void *send, void *recv, size_t count, int dt,
                     int red, int root, cudaStream_t stream) {
  if (!c) return ncclInvalidArgument;
  if (!dt_size(dt) || dt == ncclFloat16 || red < ncclSum || red > ncclAvg ||
      (kind == K_BROADCAST && (root < 0 || root >= c->nranks))) {
    say("%s: unsupported type %d, op %d or root %d", kNames[kind], dt, red, root);
    return ncclInvalidArgument;
  }
  size_t b = count * dt_size(dt), N = (size_t)c->nranks;
  size_t sb = kind == K_REDUCE_SCATTER ? b * N : b, rb = kind == K_ALL_GATHER ? b * N : b;
  bool need_send = kind != K_BROADCAST || c->rank == root;
  if (count && ((need_send && !zt_sim::in_device_memory(send, sb)) ||
                !zt_sim::in_device_memory(recv, rb))) {
    say("%s: rank %d: a buffer is not device memory (send %p, recv %p)", kNames[kind], c->rank,
        send, recv);
    return ncclInvalidArgument;
  }
  int st = c->state.load();
  if (st != ncclSuccess) return st == ncclInProgress ? ncclInvalidUsage : (ncclResult_t)st;
  if (zt_sim::capturing(stream)) { /* NCCL captures; the stand-in does not */
    say("%s: stream %p captures a graph: the stand-in does not record collectives", kNames[kind],
        (void *)stream);
    return ncclInvalidUsage;
  }
  zt_sim::require_ordered(stream, kNames[kind]);
  if (zt_sim::stream_hold(stream, 1) != 0) {
    say("%s: stream %p is not a stream cudaStreamCreate made", kNames[kind], (void *)stream);
    return ncclInvalidArgument;
  }
  size_t ib, ob;
  op_t o{kind, send, recv, count, dt, red, root, stream, 0, 0, mono_ms()};
  sizes(c, o, c->rank, &ib, &ob);
  o.sum = hash_device(send, ib);
  o.wanted = zt_sim::stream_wanted(stream);
  std::lock_guard<std::mutex> lk(c->mu);
  c->q.push_back(o);
  c->cv.notify_one();
  return ncclSuccess;
}

/* Ends the communicator: abort unblocks the thread at once; destroy lets
 * it finish what is enqueued. Every hold still on a stream is released. */
ncclResult_t finish(ncclComm *c, bool abort) {
  if (!c) return ncclInvalidArgument;
  if (abort) c->aborting.store(1); /* first: the threads poll it, never under mu */
  {
    std::lock_guard<std::mutex> lk(c->mu);
    if (abort) {
      for (int fd : c->fds)
        if (fd >= 0) shutdown(fd, SHUT_RDWR);
    }
    c->closing = true;
    c->cv.notify_one();
  }
  if (c->th.joinable()) c->th.join();
  for (const op_t &o : c->q) zt_sim::stream_hold(o.stream, -1);
  for (const op_t &o : c->held) zt_sim::stream_hold(o.stream, -1);
  delete c;
  return ncclSuccess;
}

}  // namespace

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  if (!id) return ncclInvalidArgument;
  memset(id, 0, sizeof *id);
  memcpy(id->internal, kMagic, sizeof kMagic);
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  unsigned char rnd[16];
  bool ok = fd >= 0 && read(fd, rnd, sizeof rnd) == (ssize_t)sizeof rnd;
  if (fd >= 0) close(fd);
  if (!ok) return ncclSystemError;
  memcpy(id->internal + sizeof kMagic, rnd, sizeof rnd);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config) {
  if (!comm || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  if (memcmp(id.internal, kMagic, sizeof kMagic) != 0) {
    say("ncclCommInitRank: rank %d: the unique id is not one ncclGetUniqueId made", rank);
    return ncclInvalidArgument;
  }
  ncclComm *c = new ncclComm;
  c->rank = rank, c->nranks = nranks;
  c->fds.assign((size_t)nranks, -1);
  for (int i = 0; i < 16; i++)
    snprintf(c->token + 2 * i, 3, "%02x", (unsigned char)id.internal[sizeof kMagic + (size_t)i]);
  c->th = std::thread(main_loop, c);
  *comm = c;
  if (config && !config->blocking) return ncclInProgress;
  while (c->state.load() == ncclInProgress) usleep(1000);
  return (ncclResult_t)c->state.load();
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *err) {
  if (!comm || !err) return ncclInvalidArgument;
  *err = (ncclResult_t)comm->state.load();
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) { return finish(comm, true); }

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  return finish(comm, comm && comm->state.load() != ncclSuccess);
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t dt,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, K_ALL_REDUCE, send, recv, count, dt, op, 0, stream);
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t recvcount, ncclDataType_t dt,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, K_REDUCE_SCATTER, send, recv, recvcount, dt, op, 0, stream);
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t sendcount, ncclDataType_t dt,
                           ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, K_ALL_GATHER, send, recv, sendcount, dt, ncclSum, 0, stream);
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t dt,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  return enqueue(comm, K_BROADCAST, send, recv, count, dt, ncclSum, root, stream);
}

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

}  // extern "C"
