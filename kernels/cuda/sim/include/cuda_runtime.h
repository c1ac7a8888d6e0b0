/*
 * cuda_runtime.h of the CPU stand-in (kernels/cuda/sim/; docs/gpu.md, "The
 * CPU stand-in"). Tests only: it replaces the toolkit's header when the
 * kernel table's sources (the .cu files of kernels/cuda/) are compiled a
 * second time as host C++ (the sim include directory comes first), and the
 * library built from them is linked into test programs only.
 *
 * Two halves:
 *   - the runtime API that the kernels call (memory, copies, streams,
 *     events, errors, devices), with the real error codes; implemented in
 *     sim_runtime.cpp;
 *   - the device side (C++ only): the qualifiers, threadIdx/blockIdx/
 *     blockDim/gridDim (set by the scheduler for the thread that runs),
 *     __syncthreads, warp shuffles and votes, atomics, CUDA's min/max.
 * Kernel launches and __shared__ need the rewrite of sim_rewrite.py and
 * zt_sim.h.
 */
#ifndef ZT_SIM_CUDA_RUNTIME_H
#define ZT_SIM_CUDA_RUNTIME_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define ZT_CUDA_SIM 1
#define CUDART_VERSION 13000

/* ---------------------------------------------------------------------------
 * Types shared with C. */

typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalState = 401,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
  cudaErrorNotSupported = 801,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureIsolation = 905,
  cudaErrorStreamCaptureWrongThread = 908,
  cudaErrorUnknown = 999
} cudaError_t;

typedef enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
} cudaMemcpyKind;

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef struct CUgraph_st *cudaGraph_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
typedef struct CUgraphNode_st *cudaGraphNode_t;

enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2
};
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2
};

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)
#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02
#define cudaEventInterprocess 0x04

#ifdef __cplusplus
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};
#else
typedef struct uint3 {
  unsigned int x, y, z;
} uint3;
typedef struct dim3 {
  unsigned int x, y, z;
} dim3;
#endif

/* The fields of cudaDeviceProp that the stand-in fills (a subset of the
 * real struct: code that reads another field does not compile here). */
typedef struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;
  int regsPerBlock;
  int warpSize;
  int maxThreadsPerBlock;
  int maxThreadsDim[3];
  int maxGridSize[3];
  int clockRate;
  size_t totalConstMem;
  int major;
  int minor;
  int multiProcessorCount;
  int maxThreadsPerMultiProcessor;
  size_t sharedMemPerMultiprocessor;
  size_t sharedMemPerBlockOptin;
  int l2CacheSize;
  int memoryBusWidth;
} cudaDeviceProp;

/* ---------------------------------------------------------------------------
 * The runtime API (sim_runtime.cpp). Kernels run to completion when they
 * are launched and every stream is in order, so the Async functions are
 * complete when they return. */

#ifdef __cplusplus
extern "C" {
#endif

cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t error);
const char *cudaGetErrorName(cudaError_t error);

cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaDeviceReset(void);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaDriverGetVersion(int *version);
cudaError_t cudaRuntimeGetVersion(int *version);

cudaError_t cudaMalloc(void **ptr, size_t size);
cudaError_t cudaFree(void *ptr);
cudaError_t cudaMallocHost(void **ptr, size_t size);
cudaError_t cudaFreeHost(void *ptr);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemset(void *ptr, int value, size_t count);
cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t stream);

cudaError_t cudaStreamCreate(cudaStream_t *stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);

cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

/* Graphs: stream capture of kernels, copies, memsets, cuBLASLt products and
 * sorts (sim_runtime.cpp, "Graphs"). */
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status);
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t *nodes, size_t *count);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                 unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);

#ifdef __cplusplus
}

template <typename T>
static inline cudaError_t cudaMalloc(T **ptr, size_t size) {
  return cudaMalloc((void **)ptr, size);
}
template <typename T>
static inline cudaError_t cudaMallocHost(T **ptr, size_t size) {
  return cudaMallocHost((void **)ptr, size);
}

/* ---------------------------------------------------------------------------
 * The device side. */

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
/* No __noinline__: libstdc++ 13 writes __attribute__((__noinline__)), which
 * such a macro would break (our kernels do not use it). */
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

/* Set by the scheduler before a thread runs (the thread of a fiber sees
 * its own values; blockDim and gridDim are uint3 here, dim3 in CUDA). */
extern __thread uint3 threadIdx;
extern __thread uint3 blockIdx;
extern __thread uint3 blockDim;
extern __thread uint3 gridDim;
constexpr int warpSize = 32;

void __syncthreads(void);
int __syncthreads_count(int predicate);
int __syncthreads_and(int predicate);
int __syncthreads_or(int predicate);
void __syncwarp(unsigned mask = 0xffffffffu);
unsigned __activemask(void);
static inline void __threadfence(void) {}
static inline void __threadfence_block(void) {}

namespace zt_sim {
/* Warp exchange: stores this lane's value (up to 16 bytes), waits until
 * every lane of `mask` of the warp that has not returned has stored its
 * own (lanes outside the mask may exchange at the same time with a mask of
 * their own), and returns the 32 slots of 16 bytes that the lanes of the
 * mask stored; the slot of a lane that stored nothing reads as 0xff bytes
 * (NaN). Sets *lane. */
const unsigned char *warp_exchange(unsigned mask, const void *value, size_t size, int *lane);
/* `width` when it is a power of two from 1 to 32 (CUDA defines no other
 * shuffle width); otherwise ends the process, naming the kernel. */
int shfl_width(int width);
/* Ends the process unless every lane of the warp is live, as the warp-wide
 * matrix instructions require (mma.sync and ldmatrix in zt_sim_ptx.h);
 * prefix and what name the call. */
void require_full_warp(const char *prefix, const char *what);

/* The source lanes of the shuffles, as the hardware computes them (PTX
 * shfl.sync): the lane argument is taken mod 32, the warp is cut into
 * segments of `width` lanes, and a lane whose source falls outside the
 * range a mode allows reads its own value. An xor may read from an earlier
 * segment but not from a later one. */
static inline int shfl_src_idx(int lane, int src, int width) {
  return (lane & ~(width - 1)) | (src & (width - 1));
}
static inline int shfl_src_xor(int lane, int m, int width) {
  int s = lane ^ (m & 31);
  return s > (lane | (width - 1)) ? lane : s;
}
static inline int shfl_src_down(int lane, int d, int width) {
  int s = lane + (d & 31);
  return s > (lane | (width - 1)) ? lane : s;
}
static inline int shfl_src_up(int lane, int d, int width) {
  int s = lane - (d & 31);
  return s < (lane & ~(width - 1)) ? lane : s;
}

template <typename T>
static inline T shfl_from(unsigned mask, T var, int (*src_of)(int lane, int arg, int width),
                          int arg, int width) {
  static_assert(sizeof(T) <= 16, "shuffle of a type wider than 16 bytes");
  width = shfl_width(width);
  int lane = 0;
  const unsigned char *slots = warp_exchange(mask, &var, sizeof var, &lane);
  T r;
  memcpy(&r, slots + 16 * src_of(lane, arg, width), sizeof r);
  return r;
}
}  // namespace zt_sim

template <typename T>
static inline T __shfl_sync(unsigned mask, T var, int src, int width = 32) {
  return zt_sim::shfl_from(mask, var, zt_sim::shfl_src_idx, src, width);
}
template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return zt_sim::shfl_from(mask, var, zt_sim::shfl_src_xor, lane_mask, width);
}
template <typename T>
static inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return zt_sim::shfl_from(mask, var, zt_sim::shfl_src_down, (int)(delta & 31u), width);
}
template <typename T>
static inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return zt_sim::shfl_from(mask, var, zt_sim::shfl_src_up, (int)(delta & 31u), width);
}

/* The votes count the lanes of the mask that have not returned: a lane
 * that returned stored nothing, so it is in no ballot, and __all_sync is
 * "no lane that votes says no". */
static inline unsigned __ballot_sync(unsigned mask, int pred) {
  int lane = 0, p = pred != 0;
  const unsigned char *slots = zt_sim::warp_exchange(mask, &p, sizeof p, &lane);
  unsigned r = 0;
  for (int l = 0; l < 32; l++) {
    int v;
    memcpy(&v, slots + 16 * l, sizeof v);
    if ((mask >> l & 1u) && v == 1) r |= 1u << l;
  }
  return r;
}
static inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
static inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, !pred) == 0; }

/* CUDA's min and max (global namespace, host and device). */
#define ZT_SIM_MINMAX(T)                                          \
  static inline T min(T a, T b) { return a < b ? a : b; }        \
  static inline T max(T a, T b) { return a > b ? a : b; }
ZT_SIM_MINMAX(int)
ZT_SIM_MINMAX(unsigned int)
ZT_SIM_MINMAX(long)
ZT_SIM_MINMAX(unsigned long)
ZT_SIM_MINMAX(long long)
ZT_SIM_MINMAX(unsigned long long)
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
#undef ZT_SIM_MINMAX

static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
/* __expf and __logf: glibc declares them (the same functions as expf, logf). */
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
template <typename T>
static inline T __ldg(const T *p) {
  return *p;
}

/* Atomics: a thread of the stand-in runs until it reaches a barrier, so a
 * read-modify-write is never interleaved with another thread's. The value
 * converts to *p's type, as with CUDA's overloads (atomicAdd(&u, 1) for an
 * unsigned u). */
namespace zt_sim {
template <typename T>
struct same_type {
  typedef T type;
};
/* Stores update(*p) at p and returns the old value. */
template <typename T, typename F>
static inline T atomic_update(T *p, F update) {
  T old = *p;
  *p = update(old);
  return old;
}
}  // namespace zt_sim

#define ZT_SIM_ATOMIC(name, expr)                                                       \
  template <typename T>                                                                 \
  static inline T name(T *p, typename zt_sim::same_type<T>::type v) {                   \
    return zt_sim::atomic_update(p, [v](T old) -> T { return (expr); });                \
  }
ZT_SIM_ATOMIC(atomicAdd, old + v)
ZT_SIM_ATOMIC(atomicSub, old - v)
ZT_SIM_ATOMIC(atomicMax, old > v ? old : v)
ZT_SIM_ATOMIC(atomicMin, old < v ? old : v)
ZT_SIM_ATOMIC(atomicExch, ((void)old, v))
#undef ZT_SIM_ATOMIC
template <typename T>
static inline T atomicCAS(T *p, typename zt_sim::same_type<T>::type cmp,
                          typename zt_sim::same_type<T>::type v) {
  return zt_sim::atomic_update(p, [cmp, v](T old) -> T { return old == cmp ? v : old; });
}

#endif /* __cplusplus */

#endif
