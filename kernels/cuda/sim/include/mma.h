/*
 * mma.h of the CPU stand-in (kernels/cuda/sim/; docs/gpu.md, "The CPU
 * stand-in"). Tests only: the part of the toolkit's warp matrix functions
 * (nvcuda::wmma) that kernels/cuda/kernels.cu uses, 16 x 16 x 16 tiles of
 * bf16 operands with fp32 accumulators.
 *
 * How a fragment's elements are spread over the lanes of a warp is
 * unspecified in CUDA, and kernels.cu never depends on it: it only fills,
 * loads, multiplies and stores fragments. Here every lane holds the whole
 * tile and computes the whole product (num_elements is 256), so a kernel
 * that reads `x[i]` as if it held a lane's share would compute the wrong
 * thing and fail its test. What the hardware requires is checked, and a
 * breach ends the process naming the kernel's call: a pointer 256-bit
 * aligned, a leading dimension that is a multiple of 16 bytes, and every
 * lane of the warp in the call (each call is a warp exchange, so a lane
 * that skips it leaves the others waiting, which the stand-in reports as a
 * deadlock). Like the hardware's `_sync` calls, each is a point where the
 * warp converges, so a __syncwarp missing just before one cannot show
 * here (kernels.cu has them all the same). The products are fp32 sums in k order; the tensor cores'
 * order and internal precision differ, so tests compare with tolerances.
 */
#ifndef ZT_SIM_MMA_H
#define ZT_SIM_MMA_H

#include <stdint.h>

#include "cuda_bf16.h"
#include "cuda_runtime.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the stand-in has 16 x 16 x 16 tiles only");
  enum { num_elements = 256 };
  T x[256]; /* row-major, the whole tile */
};

namespace detail {
/* Every lane of the warp takes part: none has left the kernel (a lane
 * that has cannot make the call), and a warp exchange of nothing waits for
 * the lanes still on their way. */
static inline void converge(const char *what) {
  zt_sim::require_full_warp("wmma::", what);
  int lane;
  char none = 0;
  zt_sim::warp_exchange(0xffffffffu, &none, 1, &lane);
}
/* converge, and the pointer and leading dimension are what the hardware
 * takes. */
static inline void check(const void *p, unsigned ldm, size_t esize, const char *what) {
  converge(what);
  if ((uintptr_t)p % 32 != 0) zt_sim::fatal("wmma::%s: pointer %p is not 256-bit aligned", what, p);
  if ((ldm * esize) % 16 != 0)
    zt_sim::fatal("wmma::%s: leading dimension %u is not a multiple of 16 bytes", what, ldm);
}
static inline float f(float v) { return v; }
static inline float f(__nv_bfloat16 v) { return __bfloat162float(v); }
}  // namespace detail

template <typename Use, typename T, typename L>
static inline void fill_fragment(fragment<Use, 16, 16, 16, T, L> &a, T v) {
  detail::converge("fill_fragment");
  for (int i = 0; i < 256; i++) a.x[i] = v;
}

/* matrix_a / matrix_b: the layout is the fragment's; element (r, c) of the
 * tile is p[r * ldm + c] (row_major) or p[c * ldm + r] (col_major). */
template <typename Use, typename T>
static inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, row_major> &a, const T *p,
                                    unsigned ldm) {
  detail::check(p, ldm, sizeof(T), "load_matrix_sync");
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++) a.x[r * 16 + c] = p[(size_t)r * ldm + c];
}
template <typename Use, typename T>
static inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, col_major> &a, const T *p,
                                    unsigned ldm) {
  detail::check(p, ldm, sizeof(T), "load_matrix_sync");
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++) a.x[r * 16 + c] = p[(size_t)c * ldm + r];
}
/* accumulator: the layout is the call's. */
static inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &a, const float *p,
                                    unsigned ldm, layout_t l) {
  detail::check(p, ldm, sizeof(float), "load_matrix_sync");
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++)
      a.x[r * 16 + c] = l == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}
static inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &a,
                                     unsigned ldm, layout_t l) {
  detail::check(p, ldm, sizeof(float), "store_matrix_sync");
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++)
      (l == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r]) = a.x[r * 16 + c];
}

/* d = a b + c, fp32 sums in k order (d may be c). */
template <typename T, typename LA, typename LB>
static inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d,
                            const fragment<matrix_a, 16, 16, 16, T, LA> &a,
                            const fragment<matrix_b, 16, 16, 16, T, LB> &b,
                            const fragment<accumulator, 16, 16, 16, float> &c) {
  detail::converge("mma_sync");
  float out[256];
  for (int r = 0; r < 16; r++)
    for (int n = 0; n < 16; n++) {
      float s = c.x[r * 16 + n];
      for (int k = 0; k < 16; k++) s += detail::f(a.x[r * 16 + k]) * detail::f(b.x[k * 16 + n]);
      out[r * 16 + n] = s;
    }
  for (int i = 0; i < 256; i++) d.x[i] = out[i];
}

}  // namespace wmma
}  // namespace nvcuda

#endif
