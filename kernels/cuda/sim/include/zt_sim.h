/*
 * zt_sim.h: the launch and shared-memory side of the CPU stand-in for CUDA
 * (kernels/cuda/sim/; docs/gpu.md, "The CPU stand-in"). Tests only.
 *
 * sim_rewrite.py puts `#include "zt_sim.h"` at the top of its copy of
 * each CUDA source (the .cu files of kernels/cuda/, common.cuh) and rewrites
 *   kern<<<grid, block, shmem, stream>>>(args)
 *       -> zt_sim_launch(ZT_SIM_NAME(kern), kern, grid, block, shmem, stream, args)
 *   __shared__ T name[N];      -> ZT_SIM_SHARED(T, name, [N]);
 *   extern __shared__ T name[]; -> T *name = ZT_SIM_DYNAMIC_SHARED(T);
 * and registers the kernels that need fibers (zt_sim::fiber_kernels).
 *
 * A launch converts the arguments to the kernel's parameter types (as a
 * call would), checks that every pointer argument is device memory (or
 * NULL), and runs the whole grid before it returns (sim_runtime.cpp; on a
 * stream that captures a graph it is recorded instead, see capture()):
 * blocks one after the other in an order drawn from ZT_SIM_SEED, the
 * threads of a block as fibers in a random order (or, for kernels that
 * never reach a barrier, one after the other).
 */
#ifndef ZT_SIM_H
#define ZT_SIM_H

#include <cuda_runtime.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

namespace zt_sim {

typedef void (*thread_body)(void *ctx);

/* Runs a grid (see above); returns the launch error (also kept for
 * cudaGetLastError). `ptrs` are the kernel's pointer arguments. */
cudaError_t launch(const char *name, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream,
                   thread_body body, void *ctx, const void *const *ptrs, int nptrs);

/* The running block's copy of the __shared__ variable whose key is `key`
 * (the address of a static of the declaring function): placed at the
 * first use in a launch, filled with 0xff bytes (NaN) at each block's
 * start. */
void *shared_var(const void *key, size_t size, size_t align, const char *name);
/* The launch's dynamic shared memory (the shmem launch parameter). */
void *dynamic_shared(void);

/* Registers kernels, by name, that run each thread on a fiber. */
struct fiber_kernels {
  fiber_kernels(std::initializer_list<const char *> names);
};

/* Device work done on the host (copies, cuBLASLt, CUB): device memory is
 * readable and writable while one of these is alive, and checked for
 * writes past the ends of allocations when the last one ends. `what`
 * names the work in error messages. */
struct device_access {
  explicit device_access(const char *what);
  ~device_access();
  device_access(const device_access &) = delete;
  device_access &operator=(const device_access &) = delete;
};

/* 1 when [p, p + bytes) lies inside one live device allocation. */
int in_device_memory(const void *p, size_t bytes);
/* Ends the process with a message naming `what` when [p, p + bytes) is not
 * inside one live device allocation. */
void require_device_memory(const void *p, size_t bytes, const char *what);
/* 1 for a stream handle that may be used (0, the legacy and per-thread
 * streams, or one created and not destroyed). */
int valid_stream(cudaStream_t stream);
/* Work enqueued on a stream by the host (the NCCL stand-in, sim_nccl.cpp):
 * while a stream holds some, cudaStreamQuery says cudaErrorNotReady and
 * cudaStreamSynchronize waits. delta is +1 (enqueued) or -1 (done or
 * abandoned by an abort); -1 when the stream is not one cudaStreamCreate
 * made. */
int stream_hold(cudaStream_t stream, int delta);
/* The held work of a stream has failed and completes only when an abort
 * releases it: a stream that waits for it (cudaStreamWaitEvent) stalls,
 * busy until then, instead of waiting on the host. Cleared when the
 * stream holds nothing. */
void stream_fail(cudaStream_t stream);
/* How often the host has waited for the stream's work so far (queries,
 * synchronisations, its events waited for): the NCCL stand-in's lazy
 * mode starts a collective when it is wanted. */
unsigned long stream_wanted(cudaStream_t stream);
/* The order between streams. Everything here runs when it is enqueued,
 * so a missing synchronisation between two streams cannot show as wrong
 * values; instead each created stream counts the device work enqueued on
 * it (stream_work: kernels, copies, memsets, cuBLASLt products, sorts) and
 * how much of it the host has seen complete or another stream waits for
 * (cudaStreamSynchronize, cudaStreamQuery when it says done,
 * cudaDeviceSynchronize, cudaEventSynchronize, cudaStreamWaitEvent). require_ordered(s, what) ends the process, naming
 * `what`, when another stream of the same device has work that s neither
 * waits for nor the host has seen complete: the NCCL stand-in calls it
 * for every collective, whose buffers a GPU would otherwise read while
 * the kernels that write them may still run. */
void stream_work(cudaStream_t stream);
void require_ordered(cudaStream_t stream, const char *what);
/* Graph capture (cudaStreamBeginCapture; sim_runtime.cpp, "Graphs").
 * capturing(s): 1 when work enqueued on s now is recorded rather than run
 * (an active capture, or one that was invalidated: then the work is
 * dropped and the call fails). capture(s, what, replay) records `replay`
 * as the next node of s's graph, or returns the error of an invalidated
 * capture; each cudaGraphLaunch of the graph calls the nodes in order
 * with the stream it was launched on, and a node does its work as the
 * call it was recorded from would have (the same checks, on that
 * stream). What a node needs it holds by value: the arguments of a
 * kernel, a product's descriptors, alpha and beta, as a GPU keeps them
 * in the graph. capture_launch is capture for a kernel: its configuration
 * is checked first, as a launch would be. */
int capturing(cudaStream_t stream);
cudaError_t capture(cudaStream_t stream, const char *what,
                    std::function<void(cudaStream_t)> replay);
cudaError_t capture_launch(cudaStream_t stream, const char *name, dim3 grid, dim3 block,
                           size_t shmem, std::function<void(cudaStream_t)> replay);
/* Prints "zt-sim: <message>" and aborts. */
[[noreturn]] void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

template <typename P, typename A>
static inline P convert_arg(A &&a) {
  return std::forward<A>(a); /* the conversions of a call, no casts */
}

template <typename T>
static inline void collect_ptr(const void **out, int &n, const T &x) {
  if constexpr (std::is_pointer<T>::value &&
                !std::is_function<typename std::remove_pointer<T>::type>::value)
    out[n++] = (const void *)x;
}

}  // namespace zt_sim

/* Runs a kernel with its converted arguments now. */
template <typename... P, typename T>
static inline void zt_sim_run(const char *name, void (*kernel)(P...), dim3 grid, dim3 block,
                              size_t shmem, cudaStream_t stream, T &params) {
  struct ctx_t {
    void (*kernel)(P...);
    T *params;
  } ctx = {kernel, &params};
  zt_sim::thread_body body = [](void *c) {
    ctx_t *x = static_cast<ctx_t *>(c);
    std::apply(x->kernel, *x->params);
  };
  const void *ptrs[sizeof...(P) + 1];
  int nptrs = 0;
  std::apply([&](const auto &...x) { (zt_sim::collect_ptr(ptrs, nptrs, x), ...); }, params);
  (void)zt_sim::launch(name, grid, block, shmem, stream, body, &ctx, ptrs, nptrs);
}

/* A launch: run now, or, on a stream that captures a graph, recorded with
 * a copy of its arguments and run at each launch of the graph. */
template <typename... P, typename... A>
static inline void zt_sim_launch(const char *name, void (*kernel)(P...), dim3 grid, dim3 block,
                                 size_t shmem, cudaStream_t stream, A &&...args) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with a wrong number of arguments");
  typedef std::tuple<typename std::decay<P>::type...> params_t;
  params_t params(zt_sim::convert_arg<P>(std::forward<A>(args))...);
  if (zt_sim::capturing(stream)) {
    auto held = std::make_shared<params_t>(std::move(params));
    (void)zt_sim::capture_launch(stream, name, grid, block, shmem, [=](cudaStream_t s) {
      zt_sim_run(name, kernel, grid, block, shmem, s, *held);
    });
    return;
  }
  zt_sim_run(name, kernel, grid, block, shmem, stream, params);
}

#define ZT_SIM_NAME(...) #__VA_ARGS__

#define ZT_SIM_SHARED(T, name, dims)                                                     \
  static char zt_sim_key_##name;                                                          \
  using zt_sim_type_##name = T dims;                                                      \
  zt_sim_type_##name &name = *reinterpret_cast<zt_sim_type_##name *>(zt_sim::shared_var(  \
      &zt_sim_key_##name, sizeof(zt_sim_type_##name), alignof(zt_sim_type_##name), #name))

#define ZT_SIM_DYNAMIC_SHARED(T) reinterpret_cast<T *>(zt_sim::dynamic_shared())

#endif
