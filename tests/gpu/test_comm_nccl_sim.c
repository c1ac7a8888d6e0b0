/*
 * test_comm_nccl_sim.c: comm/comm_nccl.c, the real NCCL backend, on the CPU
 * stand-ins for libcudart and libnccl (kernels/cuda/sim/: libzt_cudart_sim.so
 * and libzt_nccl_sim.so, which ctest names in $ZT_CUDART_LIB and
 * $ZT_NCCL_LIB; docs/gpu.md, "The CPU stand-in"). Label gpu-sim.
 *
 * Three ranks run as threads of this process on stand-in device memory:
 *   - every operation of comm.h gives the exact expected values (fp64 sums
 *     of small integers are exact whatever the order), in place too;
 *   - a rank that never joins a collective: the others fail at the
 *     deadline, with the communicator aborted, not later;
 *   - a rank that dies mid-collective (its communicator aborted, its
 *     sockets closed): the others see NCCL's asynchronous error well
 *     before the deadline;
 *   - a host buffer is refused (ncclInvalidArgument), as a GPU would;
 *   - a collective enqueued while another stream of the device still has
 *     work the host has not waited for stops the process (the stand-in's
 *     cross-stream check), and runs once the host has synchronised;
 *   - stream order (zt_comm_set_stream): collectives queued behind a
 *     stream's copies with no host wait, asynchronous ones joined by the
 *     stream and giving the same values, a write to a send buffer before
 *     the join stopped by the stand-in (naming the buffer), and an
 *     asynchronous collective that a rank never joins failing at its
 *     deadline (or with NCCL's error) when the host settles.
 */
#include <cuda_runtime.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm.h"
#include "zt_common.h"
#include "zt_test.h"

#define W 3
#define N 1000 /* elements per rank */

typedef struct {
  const char *id;
  int rank, world, rc;
  int device; /* the stand-in's device the rank runs on */
  int64_t timeout_ms;
  zt_comm_t *c;
  char err[512];
} rank_t;

static void *create(void *p) {
  rank_t *r = p;
  r->rc = zt_comm_nccl_create(r->rank, r->world, r->id, r->device, 20000, &r->c);
  if (r->rc) snprintf(r->err, sizeof r->err, "%s", zt_err_msg());
  return NULL;
}

/* Creates a world-rank communicator, one thread per rank, on device 0
 * or (own) each rank on its own (the stream-order checks are per device,
 * as a GPU's streams are). */
static int make_on(rank_t *rk, int world, char *id, int own) {
  if (zt_comm_nccl_unique_id(id) != 0) {
    fprintf(stderr, "unique id: %s\n", zt_err_msg());
    return -1;
  }
  pthread_t th[W];
  for (int i = 0; i < world; i++) {
    rk[i] = (rank_t){.id = id, .rank = i, .world = world, .device = own ? i : 0,
                     .timeout_ms = 20000};
    pthread_create(&th[i], NULL, create, &rk[i]);
  }
  int bad = 0;
  for (int i = 0; i < world; i++) {
    pthread_join(th[i], NULL);
    if (rk[i].rc) fprintf(stderr, "rank %d: %s\n", i, rk[i].err), bad = 1;
  }
  return bad ? -1 : 0;
}

static int make(rank_t *rk, int world, char *id) { return make_on(rk, world, id, 0); }

/* A 3-rank communicator, checked: 1 when every rank has one. */
static int world3(rank_t *rk, char *id) {
  ZT_CHECK(make(rk, W, id) == 0);
  return !rk[0].rc && !rk[1].rc && !rk[2].rc;
}

/* The same, each rank on its own device. */
static int world3_own(rank_t *rk, char *id) {
  ZT_CHECK(make_on(rk, W, id, 1) == 0);
  return !rk[0].rc && !rk[1].rc && !rk[2].rc;
}

static void *dev(size_t bytes) {
  void *p = NULL;
  return cudaMalloc(&p, bytes) == cudaSuccess ? p : NULL;
}

static void put(void *d, const void *h, size_t b) { cudaMemcpy(d, h, b, cudaMemcpyHostToDevice); }
static void get(void *h, const void *d, size_t b) { cudaMemcpy(h, d, b, cudaMemcpyDeviceToHost); }

/* Runs body on a thread per rank; each must end with rc 0. The
 * communicators are destroyed after. */
static void on_every_rank(rank_t *rk, void *(*body)(void *)) {
  pthread_t th[W];
  for (int i = 0; i < W; i++) pthread_create(&th[i], NULL, body, &rk[i]);
  for (int i = 0; i < W; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < W; i++) {
    ZT_CHECK(rk[i].rc == 0);
    zt_comm_destroy(rk[i].c);
  }
}

/* One rank's part of the "every operation" case. */
static void *ops(void *p) {
  rank_t *r = p;
  int k = r->rank, bad = 0;
  double *h = zt_xmalloc(W * N * sizeof(double));
  double *d = dev(W * N * sizeof(double));
  float *hf = zt_xmalloc(W * N * sizeof(float)), *df = dev(W * N * sizeof(float));
  /* all-reduce, in place, fp64 sum: element i of rank k is k * 1000 + i */
  for (int i = 0; i < N; i++) h[i] = k * 1000.0 + i;
  put(d, h, N * sizeof(double));
  bad |= zt_comm_all_reduce(r->c, d, N, ZT_DT_F64, ZT_RED_SUM, r->timeout_ms) != 0;
  get(h, d, N * sizeof(double));
  for (int i = 0; i < N; i++) bad |= h[i] != 3000.0 + 3.0 * i;
  /* reduce-scatter, fp32, in place (rank k's chunk inside its send) */
  for (int i = 0; i < W * N; i++) hf[i] = (float)(i + k);
  put(df, hf, W * N * sizeof(float));
  bad |= zt_comm_reduce_scatter(r->c, df, df + (size_t)k * N, N, ZT_DT_F32, ZT_RED_SUM,
                                r->timeout_ms) != 0;
  get(hf, df + (size_t)k * N, N * sizeof(float));
  for (int i = 0; i < N; i++) bad |= hf[i] != (float)(3 * (k * N + i) + 3);
  /* all-gather, in place (rank k's chunk inside the whole) */
  for (int i = 0; i < N; i++) h[i] = -(k * 10000.0 + i);
  put(d + (size_t)k * N, h, N * sizeof(double));
  bad |= zt_comm_all_gather(r->c, d + (size_t)k * N, d, N, ZT_DT_F64, r->timeout_ms) != 0;
  get(h, d, W * N * sizeof(double));
  for (int q = 0; q < W; q++)
    for (int i = 0; i < N; i++) bad |= h[q * N + i] != -(q * 10000.0 + i);
  /* broadcast from rank 1 */
  for (int i = 0; i < N; i++) h[i] = k == 1 ? 0.5 * i : 7.0;
  put(d, h, N * sizeof(double));
  bad |= zt_comm_broadcast(r->c, d, N, ZT_DT_F64, 1, r->timeout_ms) != 0;
  get(h, d, N * sizeof(double));
  for (int i = 0; i < N; i++) bad |= h[i] != 0.5 * i;
  /* average */
  for (int i = 0; i < N; i++) h[i] = 3.0 * k;
  put(d, h, N * sizeof(double));
  bad |= zt_comm_all_reduce(r->c, d, N, ZT_DT_F64, ZT_RED_AVG, r->timeout_ms) != 0;
  get(h, d, N * sizeof(double));
  for (int i = 0; i < N; i++) bad |= h[i] != 3.0;
  cudaFree(d);
  cudaFree(df);
  free(h);
  free(hf);
  r->rc = bad;
  return NULL;
}

ZT_TEST(every_operation) {
  rank_t rk[W];
  char id[257];
  if (!world3(rk, id)) return;
  ZT_CHECK(!strcmp(zt_comm_backend(rk[0].c), "nccl"));
  ZT_CHECK(zt_comm_device_memory(rk[0].c) == 1);
  on_every_rank(rk, ops);
}

typedef struct {
  rank_t *r;
  int64_t ms;
  char err[512];
} timed_t;

static void *one_all_reduce(void *p) {
  timed_t *t = p;
  double *d = dev(N * sizeof(double));
  int64_t t0 = zt_now_ms();
  t->r->rc = zt_comm_all_reduce(t->r->c, d, N, ZT_DT_F64, ZT_RED_SUM, t->r->timeout_ms);
  t->ms = zt_now_ms() - t0;
  snprintf(t->err, sizeof t->err, "%s", t->r->rc ? zt_err_msg() : "");
  cudaFree(d);
  return NULL;
}

/* Ranks 0 and 1 all-reduce (deadlines tmo0, tmo1) while rank 2 sits
 * out, or dies (`kill`: its communicator, aborted and destroyed); each
 * rank's outcome and time land in t. */
static void two_all_reduce(rank_t *rk, timed_t *t, int64_t tmo0, int64_t tmo1, zt_comm_t *kill) {
  pthread_t th[2];
  rk[0].timeout_ms = tmo0;
  rk[1].timeout_ms = tmo1;
  for (int i = 0; i < 2; i++) {
    t[i] = (timed_t){&rk[i], 0, ""};
    pthread_create(&th[i], NULL, one_all_reduce, &t[i]);
  }
  if (kill) { /* no collective in flight there: the abort takes effect at destroy */
    zt_comm_abort(kill);
    zt_comm_destroy(kill);
  }
  for (int i = 0; i < 2; i++) {
    pthread_join(th[i], NULL);
    fprintf(stderr, "  rank %d: %s after %lld ms\n", i, t[i].err, (long long)t[i].ms);
  }
}

/* Rank 2 never calls: rank 0 times out at its deadline (400 ms) and
 * aborts, and rank 1, whose deadline is a minute away, learns of it from
 * NCCL's asynchronous error at once. */
ZT_TEST(silent_rank_times_out) {
  rank_t rk[W];
  char id[257];
  if (!world3(rk, id)) return;
  timed_t t[2];
  two_all_reduce(rk, t, 400, 60000, NULL);
  for (int i = 0; i < 2; i++) {
    ZT_CHECK(rk[i].rc != 0);
    ZT_CHECK(t[i].ms >= 0 && t[i].ms < 5000);
    ZT_CHECK(zt_comm_broken(rk[i].c));
  }
  ZT_CHECK(t[0].ms >= 400);
  ZT_CHECK(strstr(t[0].err, "timed out") != NULL);
  ZT_CHECK(strstr(t[1].err, "remote process exited") != NULL);
  for (int i = 0; i < W; i++) zt_comm_destroy(rk[i].c);
}

/* Rank 2 dies while ranks 0 and 1 wait in an all-reduce with a long
 * deadline: NCCL's asynchronous error ends their wait within seconds. */
ZT_TEST(dead_rank_is_an_async_error) {
  rank_t rk[W];
  char id[257];
  if (!world3(rk, id)) return;
  timed_t t[2];
  two_all_reduce(rk, t, 60000, 60000, rk[2].c);
  for (int i = 0; i < 2; i++) {
    ZT_CHECK(rk[i].rc != 0);
    ZT_CHECK(t[i].ms < 30000);
    ZT_CHECK(strstr(t[i].err, "remote process exited") != NULL);
    zt_comm_destroy(rk[i].c);
  }
}

/* A host buffer is not device memory: refused at once (a GPU would fault). */
ZT_TEST(host_buffer_refused) {
  rank_t rk[1];
  char id[257];
  ZT_CHECK(make(rk, 1, id) == 0);
  if (rk[0].rc) return;
  double h[4] = {1, 2, 3, 4};
  int64_t t0 = zt_now_ms();
  ZT_CHECK(zt_comm_all_reduce(rk[0].c, h, 4, ZT_DT_F64, ZT_RED_SUM, 10000) != 0);
  ZT_CHECK(strstr(zt_err_msg(), "invalid argument") != NULL);
  ZT_CHECK(zt_now_ms() - t0 < 5000);
  zt_comm_destroy(rk[0].c);
}

/* Runs body(arg) in a child process (which must _exit) with its stderr
 * into err; returns the child's wait status, -1 when it could not run. */
static int in_child(void (*body)(int), int arg, char *err, size_t cap) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]), close(fds[1]);
    return -1;
  }
  if (pid == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    body(arg);
    _exit(2);
  }
  close(fds[1]);
  size_t n = 0;
  ssize_t got;
  while (n + 1 < cap && (got = read(fds[0], err + n, cap - 1 - n)) > 0) n += (size_t)got;
  err[n] = 0;
  close(fds[0]);
  int st = 0;
  return waitpid(pid, &st, 0) == pid ? st : -1;
}

/* A memset queued on a stream of our own, then an all-reduce of that
 * buffer on the communicator's stream, with or without
 * cudaStreamSynchronize between. */
static void unordered_body(int synced) {
  rank_t rk[1];
  char id[257];
  if (make(rk, 1, id) != 0) _exit(3);
  cudaStream_t s;
  double *d = dev(4 * sizeof(double));
  if (!d || cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) _exit(3);
  cudaMemsetAsync(d, 0, 4 * sizeof(double), s);
  if (synced) cudaStreamSynchronize(s);
  _exit(zt_comm_all_reduce(rk[0].c, d, 4, ZT_DT_F64, ZT_RED_SUM, 10000) == 0 ? 0 : 4);
}

ZT_TEST(unordered_stream_stops) {
  char err[4096];
  int st = in_child(unordered_body, 0, err, sizeof err);
  ZT_REQUIRE(st != -1);
  ZT_CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT);
  ZT_CHECK(strstr(err, "ncclAllReduce enqueued on stream") != NULL);
  ZT_CHECK(strstr(err, "1 operation(s)") != NULL);
  st = in_child(unordered_body, 1, err, sizeof err);
  ZT_CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* ---- stream order ---------------------------------------------------------- */

/* One rank's part of the "stream order" case: everything on its own
 * stream, the host waiting only at the end of each check. */
static void *ordered_ops(void *p) {
  rank_t *r = p;
  int k = r->rank, bad = 0;
  cudaStream_t s;
  double *h = zt_xmalloc(W * N * sizeof(double)), *d = dev(W * N * sizeof(double));
  double *e = dev(N * sizeof(double));
  bad |= cudaSetDevice(r->device) != cudaSuccess; /* the stream on the rank's device */
  bad |= cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess;
  bad |= zt_comm_set_stream(r->c, s) != 0;
  /* A blocking all-reduce right behind a copy on the stream: no host wait
   * between (the stand-in would stop the process if it were unordered). */
  for (int i = 0; i < N; i++) h[i] = k + i;
  cudaMemcpyAsync(d, h, N * sizeof(double), cudaMemcpyHostToDevice, s);
  bad |= zt_comm_all_reduce(r->c, d, N, ZT_DT_F64, ZT_RED_SUM, r->timeout_ms) != 0;
  cudaMemcpyAsync(h, d, N * sizeof(double), cudaMemcpyDeviceToHost, s);
  cudaStreamSynchronize(s);
  for (int i = 0; i < N; i++) bad |= h[i] != 3.0 + 3.0 * i;
  /* Asynchronous in-place reduce-scatter and all-gather, work on another
   * buffer beside them, then joins. */
  uint64_t t1 = 0, t2 = 0;
  for (int i = 0; i < W * N; i++) h[i] = i + 10.0 * k;
  cudaMemcpyAsync(d, h, W * N * sizeof(double), cudaMemcpyHostToDevice, s);
  bad |= zt_comm_reduce_scatter_async(r->c, d, d + (size_t)k * N, N, ZT_DT_F64, ZT_RED_SUM,
                                      r->timeout_ms, &t1) != 0;
  cudaMemsetAsync(e, 0, N * sizeof(double), s);
  bad |= zt_comm_all_gather_async(r->c, d + (size_t)k * N, d, N, ZT_DT_F64, r->timeout_ms,
                                  &t2) != 0;
  bad |= t1 == 0 || t2 != t1 + 1;
  bad |= zt_comm_join(r->c, t1) != 0 || zt_comm_join(r->c, 0) != 0;
  cudaMemcpyAsync(h, d, W * N * sizeof(double), cudaMemcpyDeviceToHost, s);
  cudaStreamSynchronize(s);
  for (int i = 0; i < W * N; i++) bad |= h[i] != 3.0 * i + 30.0;
  bad |= zt_comm_settle(r->c) != 0 || zt_comm_progress(r->c) != 0;
  bad |= zt_comm_join(r->c, t2 + 5) == 0; /* never issued */
  cudaFree(d), cudaFree(e), free(h);
  cudaStreamDestroy(s);
  r->rc = bad;
  return NULL;
}

ZT_TEST(stream_order) {
  rank_t rk[W];
  char id[257];
  if (!world3_own(rk, id)) return;
  on_every_rank(rk, ordered_ops);
}

/* One rank, lazy collectives: an asynchronous reduce-scatter, then a
 * write to its send buffer on the stream, joined first or not. */
static void write_body(int joined) {
  setenv("ZT_SIM_NCCL_LAZY_MS", "300", 1);
  rank_t rk[1];
  char id[257];
  cudaStream_t s;
  uint64_t t;
  if (make(rk, 1, id) != 0 || cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != 0 ||
      zt_comm_set_stream(rk[0].c, s) != 0)
    _exit(3);
  double *d = dev(8 * sizeof(double)), *o = dev(8 * sizeof(double));
  if (zt_comm_reduce_scatter_async(rk[0].c, d, o, 8, ZT_DT_F64, ZT_RED_SUM, 10000, &t) != 0)
    _exit(4);
  if (joined && zt_comm_join(rk[0].c, t) != 0) _exit(5);
  cudaMemsetAsync(d, 1, 8 * sizeof(double), s);
  _exit(zt_comm_settle(rk[0].c) == 0 ? 0 : 6);
}

ZT_TEST(write_before_join_stops) {
  char err[4096];
  int st = in_child(write_body, 0, err, sizeof err);
  ZT_REQUIRE(st != -1);
  ZT_CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT);
  ZT_CHECK(strstr(err, "ncclReduceScatter on rank 0: its send buffer") != NULL);
  st = in_child(write_body, 1, err, sizeof err);
  ZT_CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static void *settle_one(void *p) {
  timed_t *t = p;
  cudaStream_t s;
  uint64_t tk;
  double *d = dev(W * N * sizeof(double));
  int64_t t0 = zt_now_ms();
  t->r->rc = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
             zt_comm_set_stream(t->r->c, s) != 0 ||
             zt_comm_reduce_scatter_async(t->r->c, d, d, N, ZT_DT_F64, ZT_RED_SUM,
                                          t->r->timeout_ms, &tk) != 0 ||
             zt_comm_settle(t->r->c) != 0;
  t->ms = zt_now_ms() - t0;
  snprintf(t->err, sizeof t->err, "%s", t->r->rc ? zt_err_msg() : "");
  cudaFree(d);
  return NULL;
}

/* Ranks 0 and 1 enqueue a reduce-scatter that rank 2 never joins, and
 * settle: rank 0 at its deadline (400 ms), rank 1 (a minute) from NCCL's
 * error once rank 0 has aborted. */
ZT_TEST(async_collective_times_out) {
  rank_t rk[W];
  char id[257];
  if (!world3(rk, id)) return;
  timed_t t[2];
  pthread_t th[2];
  rk[0].timeout_ms = 400, rk[1].timeout_ms = 60000;
  for (int i = 0; i < 2; i++) {
    t[i] = (timed_t){&rk[i], 0, ""};
    pthread_create(&th[i], NULL, settle_one, &t[i]);
  }
  for (int i = 0; i < 2; i++) {
    pthread_join(th[i], NULL);
    fprintf(stderr, "  rank %d: %s after %lld ms\n", i, t[i].err, (long long)t[i].ms);
    ZT_CHECK(rk[i].rc != 0 && t[i].ms < 10000);
    ZT_CHECK(zt_comm_broken(rk[i].c));
  }
  ZT_CHECK(t[0].ms >= 400);
  ZT_CHECK(strstr(t[0].err, "ncclReduceScatter: timed out") != NULL);
  ZT_CHECK(strstr(t[1].err, "remote process exited") != NULL);
  ZT_CHECK(zt_comm_progress(rk[0].c) != 0); /* and stays so */
  for (int i = 0; i < W; i++) zt_comm_destroy(rk[i].c);
}

ZT_TEST_MAIN(unordered_stream_stops, write_before_join_stops, every_operation, stream_order,
             silent_rank_times_out, dead_rank_is_an_async_error, async_collective_times_out,
             host_buffer_refused)
