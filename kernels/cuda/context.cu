/*
 * context.cu: the CUDA kernel table's shared state and the services every
 * family uses (common.cuh declares them): the module (device, stream,
 * cuBLASLt handle, scratch buffers; table.cu initialises it), checked-call
 * failures, the CUDA-graph capture's bookkeeping, waiting for the stream,
 * and the profile's event pairs. No kernels here.
 */
#include <unistd.h>

#include "common.cuh"

module_state g;
capture_state cap;
profile_state prof;

/* The capture's checks and checked-call failures (common.cuh says what
 * each does). */

int capturing_here(void) {
  return __atomic_load_n(&cap.on, __ATOMIC_ACQUIRE) && pthread_equal(cap.owner, pthread_self());
}

void cap_same_thread(const char *what) {
  if (__atomic_load_n(&cap.on, __ATOMIC_ACQUIRE) && !pthread_equal(cap.owner, pthread_self())) {
    fprintf(stderr, "zt cuda: %s called from another thread while a CUDA graph is being "
            "recorded\n", what);
    fflush(stderr);
    exit(EXIT_FAILURE);
  }
}

void cuda_fail(const char *what, const char *msg, const char *file, int line) {
  if (capturing_here()) {
    if (!cap.fail[0]) snprintf(cap.fail, sizeof cap.fail, "%s: %s", what, msg);
    return;
  }
  fprintf(stderr, "zt cuda: %s failed at %s:%d: %s\n", what, file, line, msg);
  fflush(stderr);
  exit(EXIT_FAILURE);
}

int cap_refuse(const char *what) {
  cap_same_thread(what);
  if (!cap.on) return 0;
  if (!cap.fail[0]) snprintf(cap.fail, sizeof cap.fail, "%s inside the captured calls", what);
  return 1;
}

/* The waiter (zt_kernels.h, set_waiter) and the wait that calls it. */
static struct {
  void (*fn)(void *ctx);
  void *ctx;
} waiter;

void set_stream_waiter(void (*fn)(void *ctx), void *ctx) {
  waiter.fn = fn;
  waiter.ctx = ctx;
}

void stream_wait(void) {
  if (!waiter.fn) {
    ZT_CUDA_CHECK(cudaStreamSynchronize(g.stream));
    return;
  }
  for (int polls = 0;; polls++) {
    cudaError_t e = cudaStreamQuery(g.stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) ZT_CUDA_CHECK(e);
    (void)cudaGetLastError(); /* not ready is no failure of the next launch */
    waiter.fn(waiter.ctx);
    if (polls > 200) usleep(50);
  }
}

void *scratch(int which, size_t bytes) {
  if (bytes <= g.scr_size[which]) {
    if (capturing_here()) g.scr_in_graph[which] = 1;
    return g.scr[which];
  }
  /* The buffer a graph's calls would use is the one they were recorded
   * with: it cannot grow inside a capture (a step run without a graph
   * first sizes it). */
  if (cap_refuse("a scratch buffer to grow")) return g.scr[which];
  if (g.scr_in_graph[which]) { /* a recorded graph holds the old address */
    cap.epoch++;
    g.scr_in_graph[which] = 0;
  }
  /* Earlier work queued on the stream may still use the old buffer. */
  stream_wait();
  if (g.scr[which]) ZT_CUDA_CHECK(cudaFree(g.scr[which]));
  size_t sz = bytes + bytes / 4;
  ZT_CUDA_CHECK(cudaMalloc(&g.scr[which], sz));
  g.scr_size[which] = sz;
  return g.scr[which];
}

/* The profile's labels: one per table function ('f') and product shape
 * ('g'), the last one taking the rest once they are spent. */
static int prof_label(char kind, const char *s) {
  for (int i = 0; i < prof.nlabels; i++)
    if (prof.kind[i] == kind && !strcmp(prof.labels[i], s)) return i;
  if (prof.nlabels == PROF_LABELS) return PROF_LABELS - 1; /* the last one takes the rest */
  int i = prof.nlabels++;
  prof.kind[i] = kind;
  snprintf(prof.labels[i], sizeof prof.labels[i], "%s", s);
  return i;
}

/* The pair's index, or -1 when the profile is off or the pool is spent. */
int prof_begin(char kind, const char *label) {
  if (!prof.on || cap.on) return -1;
  if (prof.n == PROF_PAIRS) {
    prof.dropped++;
    return -1;
  }
  int i = prof.n++;
  prof.label[i] = (short)prof_label(kind, label);
  ZT_CUDA_CHECK(cudaEventRecord(prof.ev[2 * i], g.stream));
  return i;
}

void prof_end(int i) {
  if (i >= 0) ZT_CUDA_CHECK(cudaEventRecord(prof.ev[2 * i + 1], g.stream));
}
