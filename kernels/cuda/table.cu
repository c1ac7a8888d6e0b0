/*
 * table.cu: the two tables and the library's interface (zt_kernels_cuda.h).
 * Initialisation (device, stream, cuBLASLt handle), then each family's
 * fill_<family> puts its entries into both tables (fp32 storage "cuda",
 * bf16 storage "cuda-bf16"); the calls that belong to no family live
 * here: device memory and copies, CUDA graphs (graph_begin .. graph_free),
 * the profile's switch and report, the device's name and memory. The
 * families' own settings are next to them (matmul.cu: the GELU epilogue;
 * attention.cu: the attention path).
 */
#include "common.cuh"

/* ---------------------------------------------------------------------------
 * Device memory and copies. */

/* Table memory: device memory. Allocation failure returns NULL (the
 * caller reports it); the copies are complete when they return. */
static void *cu_alloc(size_t bytes) {
  void *p = NULL;
  if (cap_refuse("alloc")) return NULL;
  if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
    (void)cudaGetLastError();
    return NULL;
  }
  ZT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes ? bytes : 1, g.stream));
  return p;
}

static void cu_sync(void) {
  if (cap_refuse("sync")) return;
  stream_wait();
}

static void *cu_stream(void) { return (void *)g.stream; }

static void cu_set_waiter(void (*fn)(void *ctx), void *ctx) { set_stream_waiter(fn, ctx); }

static void cu_release(void *p) {
  if (!p || cap_refuse("release")) return;
  stream_wait();
  ZT_CUDA_CHECK(cudaFree(p));
}

static void cu_upload(void *dst, const void *src, size_t bytes) {
  if (!bytes || cap_refuse("upload")) return;
  ZT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g.stream));
  /* The source is pageable host memory the caller may reuse at once. */
  stream_wait();
}

static void cu_download(void *dst, const void *src, size_t bytes) {
  if (!bytes || cap_refuse("download")) return;
  ZT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, g.stream));
  stream_wait();
}

static void cu_copy(void *dst, const void *src, size_t bytes) {
  if (!bytes) return;
  ZT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g.stream));
}

static void cu_memzero(void *p, size_t bytes) {
  if (!bytes) return;
  ZT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, g.stream));
}

/* ---------------------------------------------------------------------------
 * CUDA graphs (zt_kernels.h: graph_begin .. graph_free; docs/gpu.md, "CUDA
 * graphs"). The table's calls between graph_begin and graph_end are
 * captured from the module's stream (thread-local mode: other threads are
 * not restricted) into one executable graph; graph_launch enqueues it on
 * the same stream, one launch for the whole sequence. A call that cannot be
 * in a graph (cap_refuse) or a capture the driver invalidates makes
 * graph_end return NULL with the reason, and nothing recorded ever runs. */

static int cu_graph_begin(char *why, size_t n) {
  if (cap.on) {
    snprintf(why, n, "a capture is open already");
    return -1;
  }
  if (prof.on) {
    snprintf(why, n, "the profile is on (it times each call with events of its own)");
    return -1;
  }
  cudaError_t e = cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(why, n, "cudaStreamBeginCapture: %s", cudaGetErrorString(e));
    return -1;
  }
  cap.owner = pthread_self();
  cap.fail[0] = 0;
  __atomic_store_n(&cap.on, 1, __ATOMIC_RELEASE);
  return 0;
}

/* What graph_end returns: the executable graph (NULL for a capture with
 * no work, as between two hooks in a row: nothing to launch) and the
 * epoch it was recorded in. */
typedef struct {
  cudaGraphExec_t x;
  unsigned long epoch;
} cu_graph;

static void *cu_graph_end(char *why, size_t n) {
  cap_same_thread("graph_end");
  if (!cap.on) {
    snprintf(why, n, "no capture is open");
    return NULL;
  }
  cudaGraph_t gr = NULL;
  cudaGraphExec_t x = NULL;
  size_t nodes = 0;
  cudaError_t e = cudaStreamEndCapture(g.stream, &gr);
  __atomic_store_n(&cap.on, 0, __ATOMIC_RELEASE);
  const char *call = "cudaStreamEndCapture";
  if (e == cudaSuccess && !cap.fail[0]) {
    call = "cudaGraphGetNodes";
    e = cudaGraphGetNodes(gr, NULL, &nodes);
  }
  if (e == cudaSuccess && !cap.fail[0] && nodes) {
    call = "cudaGraphInstantiate";
    e = cudaGraphInstantiate(&x, gr, 0);
  }
  if (gr) ZT_CUDA_CHECK(cudaGraphDestroy(gr));
  if (!cap.fail[0] && e == cudaSuccess) {
    cu_graph *r = (cu_graph *)malloc(sizeof *r);
    if (!r) cuda_fail("malloc", "out of host memory", __FILE__, __LINE__);
    r->x = x;
    r->epoch = cap.epoch;
    return r;
  }
  if (cap.fail[0]) snprintf(why, n, "%s", cap.fail);
  else snprintf(why, n, "%s: %s", call, cudaGetErrorString(e));
  (void)cudaGetLastError();
  if (x) ZT_CUDA_CHECK(cudaGraphExecDestroy(x));
  return NULL;
}

static int cu_graph_launch(void *p) {
  cap_same_thread("graph_launch");
  const cu_graph *r = (const cu_graph *)p;
  if (r->epoch != cap.epoch) return -1; /* stale: nothing enqueued */
  if (r->x) ZT_CUDA_CHECK(cudaGraphLaunch(r->x, g.stream));
  return 0;
}

static void cu_graph_free(void *p) {
  cap_same_thread("graph_free");
  cu_graph *r = (cu_graph *)p;
  if (!r) return;
  if (r->x) {
    stream_wait(); /* a launch may still run */
    ZT_CUDA_CHECK(cudaGraphExecDestroy(r->x));
  }
  free(r);
}

/* ---------------------------------------------------------------------------
 * The tables and the interface. */

/* The two tables, filled at init: fp32 storage ("cuda") and bf16 storage
 * ("cuda-bf16"); everything but the storage-typed kernels is shared. */
static zt_kernels_t zt_cuda_table, zt_cuda_table_bf16;

template <typename X>
static void fill_table(zt_kernels_t *t, const char *name) {
  t->name = name;
  t->xbytes = (int)sizeof(X);
  fill_encoder<X>(t);
  fill_norm<X>(t);
  fill_matmul<X>(t);
  fill_attention<X>(t);
  fill_elementwise<X>(t);
  fill_xent<X>(t);
  fill_rope<X>(t);
  fill_lora<X>(t);
  fill_adamw<X>(t);
  fill_reduce<X>(t);
  ZT_PROF_ENTRY(t, copy, cu_copy);
  ZT_PROF_ENTRY(t, memzero, cu_memzero);
  t->alloc = cu_alloc;
  t->release = cu_release;
  t->sync = cu_sync;
  t->stream = cu_stream;
  t->set_waiter = cu_set_waiter;
  ZT_PROF_ENTRY(t, upload, cu_upload);
  ZT_PROF_ENTRY(t, download, cu_download);
  t->graph_begin = cu_graph_begin;
  t->graph_end = cu_graph_end;
  t->graph_launch = cu_graph_launch;
  t->graph_free = cu_graph_free;
}

extern "C" ZT_API int zt_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

extern "C" ZT_API int zt_kernels_cuda_init(int device, char *err, size_t errlen) {
  if (g.init) {
    /* The current device is per thread: a later call from another thread
     * (zworker's trainer thread) makes it current there too. */
    if (device == g.device) {
      ZT_CUDA_CHECK(cudaSetDevice(device));
      return 0;
    }
    snprintf(err, errlen, "CUDA kernels already initialised on device %d, not %d", g.device,
             device);
    return -1;
  }
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    snprintf(err, errlen, "no CUDA device: %s",
             e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount returned 0");
    (void)cudaGetLastError();
    return -1;
  }
  if (device < 0 || device >= n) {
    snprintf(err, errlen, "CUDA device %d does not exist (this machine has %d)", device, n);
    return -1;
  }
  ZT_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop;
  ZT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  snprintf(g.name, sizeof g.name, "%s", prop.name);
  g.mem = prop.totalGlobalMem;
  ZT_CUDA_CHECK(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
  ZT_CUBLAS_CHECK(cublasLtCreate(&g.lt));
  g.lt_ws_size = 32u << 20;
  ZT_CUDA_CHECK(cudaMalloc(&g.lt_ws, g.lt_ws_size));
  g.device = device;
  g.math = ZT_CUDA_MATH_FP32;
  fill_table<float>(&zt_cuda_table, "cuda");
  fill_table<bf16>(&zt_cuda_table_bf16, "cuda-bf16");
  g.init = 1;
  return 0;
}

extern "C" ZT_API const zt_kernels_t *zt_kernels_cuda(void) {
  return g.init ? &zt_cuda_table : NULL;
}
extern "C" ZT_API const zt_kernels_t *zt_kernels_cuda_bf16(void) {
  return g.init ? &zt_cuda_table_bf16 : NULL;
}
/* The settings change what the calls do: recorded graphs are stale. */
extern "C" ZT_API void zt_kernels_cuda_set_math(zt_cuda_math_t math) {
  g.math = math;
  cap.epoch++;
}
extern "C" ZT_API zt_cuda_math_t zt_kernels_cuda_math(void) { return g.math; }

extern "C" ZT_API void zt_kernels_cuda_profile(int on) {
  if (on && !prof.ev[0])
    for (int i = 0; i < 2 * PROF_PAIRS; i++) ZT_CUDA_CHECK(cudaEventCreate(&prof.ev[i]));
  if (on) prof.n = prof.dropped = 0;
  prof.on = on;
}

typedef struct {
  int label, calls;
  double ms;
} prof_row;

static int prof_row_cmp(const void *a, const void *b) {
  double x = ((const prof_row *)a)->ms, y = ((const prof_row *)b)->ms;
  return x < y ? 1 : x > y ? -1 : 0;
}

extern "C" ZT_API void zt_kernels_cuda_profile_report(FILE *f) {
  stream_wait();
  prof_row rows[PROF_LABELS];
  for (int i = 0; i < PROF_LABELS; i++) rows[i].label = i, rows[i].calls = 0, rows[i].ms = 0.0;
  double total[2] = {0, 0};
  for (int i = 0; i < prof.n; i++) {
    float ms = 0;
    ZT_CUDA_CHECK(cudaEventElapsedTime(&ms, prof.ev[2 * i], prof.ev[2 * i + 1]));
    rows[prof.label[i]].calls++;
    rows[prof.label[i]].ms += ms;
    total[prof.kind[prof.label[i]] == 'g'] += ms;
  }
  qsort(rows, PROF_LABELS, sizeof rows[0], prof_row_cmp);
  for (int k = 0; k < 2; k++) {
    char kind = k ? 'g' : 'f';
    fprintf(f, "%s: %.2f ms in all%s\n",
            k ? "cuBLASLt products inside them, by shape (column-major m x n x k)"
              : "kernel table calls, by function",
            total[k], k || !prof.dropped ? "" : " (some calls not timed: the pool was spent)");
    for (int i = 0; i < PROF_LABELS; i++)
      if (rows[i].calls && prof.kind[rows[i].label] == kind)
        fprintf(f, "  %8.3f ms %5.1f%% %6d x  %s\n", rows[i].ms,
                total[k] > 0 ? 100.0 * rows[i].ms / total[k] : 0.0, rows[i].calls,
                prof.labels[rows[i].label]);
  }
}

extern "C" ZT_API size_t zt_cuda_device_memory_used(void) {
  size_t free_b = 0, total_b = 0;
  ZT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return total_b - free_b;
}
extern "C" ZT_API const char *zt_cuda_device_name(void) { return g.name; }
extern "C" ZT_API size_t zt_cuda_device_memory(void) { return g.mem; }

extern "C" ZT_API void zt_cuda_sync(void) {
  if (cap_refuse("zt_cuda_sync")) return;
  stream_wait();
}
