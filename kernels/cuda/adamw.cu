/*
 * adamw.cu: the optimizer's kernels. adamw updates one tensor; adamw_fused
 * (the CUDA tables only; engine/zero.c uses it for every unit) does what
 * narrow_f64, adamw on each tensor of a range and narrow_x do, in one
 * launch and bit for bit, since both compile the one update function
 * (adamw_elem). Then the helpers of ZeRO's fp64 gradient sums: acc_f64,
 * add_f64, widen_f64, narrow_f64 (their sum of squares is reduce.cu's).
 */
#include "common.cuh"

/* ---------------------------------------------------------------------------
 * AdamW. */

/* One element's update: the one expression both kernels below compile, so
 * that the fused one gives adamw's bits. */
__device__ __forceinline__ float adamw_elem(float pi, float gi, float *m, float *v, float lr,
                                            float b1, float b2, float eps, float wd, float bc1,
                                            float bc2) {
  float mi = b1 * *m + (1.0f - b1) * gi;
  float vi = b2 * *v + (1.0f - b2) * gi * gi;
  *m = mi;
  *v = vi;
  float mhat = mi / bc1, vhat = vi / bc2;
  pi -= lr * wd * pi;
  pi -= lr * mhat / (sqrtf(vhat) + eps);
  return pi;
}

/* Both AdamW kernels take VEC consecutive elements per thread (4: 16-byte
 * words of p, g, m and v), or 1 where the range's length or a pointer does
 * not allow it; each element's update is adamw_elem either way. */
template <int VEC>
__global__ void k_adamw(float *p, const float *gr, float *m, float *v, size_t n, float lr,
                        float b1, float b2, float eps, float wd, float bc1, float bc2) {
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t i = j * VEC;
    xvec<float, VEC> P = ldr<VEC>(p + i), G = ldr<VEC>(gr + i), M = ldr<VEC>(m + i),
                     S = ldr<VEC>(v + i);
    for (int k = 0; k < VEC; k++)
      P.v[k] = adamw_elem(P.v[k], G.v[k], &M.v[k], &S.v[k], lr, b1, b2, eps, wd, bc1, bc2);
    str<VEC>(p + i, P), str<VEC>(m + i, M), str<VEC>(v + i, S);
  }
}

/* adamw_fused (zt_kernels.h): the gradient narrowed as k_narrow_f64 does,
 * the update of adamw_elem with the element's segment's weight decay, the
 * result rounded into w as k_narrow_x does. The segments come by value
 * (the launch's parameters); a thread finds its element's by a scan that
 * starts from the segment of its previous element. Elements of a skipped
 * segment are written back as they were read. */
template <typename X, int VEC>
__global__ void k_adamw_fused(float *p, const float *g, const double *g64, double s, float t,
                              float *m, float *v, X *w, zt_adamw_args_t a) {
  size_t n = a.end[a.n - 1];
  int seg = 0;
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t i = j * VEC;
    xvec<float, VEC> P = ldr<VEC>(p + i), M = ldr<VEC>(m + i), S = ldr<VEC>(v + i);
    float gv[VEC];
    if (g) {
      xvec<float, VEC> G = ldr<VEC>(g + i);
      for (int k = 0; k < VEC; k++) gv[k] = G.v[k];
    } else {
      xvec<double, VEC> G = ldr<VEC>(g64 + i);
      for (int k = 0; k < VEC; k++) gv[k] = (float)(G.v[k] * s) * t;
    }
    for (int k = 0; k < VEC; k++) {
      while (i + k >= a.end[seg]) seg++;
      if (!(a.skip >> seg & 1u))
        P.v[k] = adamw_elem(P.v[k], gv[k], &M.v[k], &S.v[k], a.lr, a.b1, a.b2, a.eps, a.wd[seg],
                            a.bc1, a.bc2);
    }
    str<VEC>(p + i, P), str<VEC>(m + i, M), str<VEC>(v + i, S);
    if (w) stv<VEC>(w + i, P.v);
  }
}

template <typename X>
static void cu_adamw_fused(float *p, const float *gr, const double *g64, double s, float t,
                           float *m, float *v, void *w, const zt_adamw_args_t *a) {
  if (a->n < 1 || a->n > ZT_ADAMW_SEGS)
    cuda_fail("adamw_fused", "segment count out of range", __FILE__, __LINE__);
  size_t n = a->end[a->n - 1];
  if (!n) return;
  if (vec_fits(4, 4, n, {p, gr, m, v}) && vec_fits(4, 8, n, {g64}) &&
      vec_fits(4, sizeof(X), n, {w}))
    k_adamw_fused<X, 4><<<grid_for(n / 4, 256), 256, 0, g.stream>>>(p, gr, g64, s, t, m, v,
                                                                    (X *)w, *a);
  else
    k_adamw_fused<X, 1><<<grid_for(n, 256), 256, 0, g.stream>>>(p, gr, g64, s, t, m, v, (X *)w,
                                                                *a);
  ZT_CUDA_LAUNCHED();
}

static void cu_adamw(float *p, const float *gr, float *m, float *v, size_t n, float lr, float b1,
                     float b2, float eps, float wd, float bc1, float bc2) {
  if (!n) return;
  if (vec_fits(4, 4, n, {p, gr, m, v}))
    k_adamw<4><<<grid_for(n / 4, 256), 256, 0, g.stream>>>(p, gr, m, v, n, lr, b1, b2, eps, wd,
                                                           bc1, bc2);
  else
    k_adamw<1><<<grid_for(n, 256), 256, 0, g.stream>>>(p, gr, m, v, n, lr, b1, b2, eps, wd, bc1,
                                                       bc2);
  ZT_CUDA_LAUNCHED();
}

/* ---------------------------------------------------------------------------
 * Optimizer-state helpers (fp64 gradient sums). */

__global__ void k_acc_f64(double *acc, const float *x, size_t n) {
  ZT_GRID_STRIDE(i, n) acc[i] += x[i];
}

__global__ void k_add_f64(double *acc, const double *y, size_t n) {
  ZT_GRID_STRIDE(i, n) acc[i] += y[i];
}

__global__ void k_widen_f64(double *dst, const float *x, size_t n) {
  ZT_GRID_STRIDE(i, n) dst[i] = x[i];
}

__global__ void k_narrow_f64(float *dst, const double *x, size_t n, double s, float t) {
  ZT_GRID_STRIDE(i, n) dst[i] = (float)(x[i] * s) * t;
}

static void cu_acc_f64(double *acc, const float *x, size_t n) {
  ZT_LAUNCH_1D(k_acc_f64, n, acc, x, n);
}

static void cu_add_f64(double *acc, const double *y, size_t n) {
  ZT_LAUNCH_1D(k_add_f64, n, acc, y, n);
}

static void cu_widen_f64(double *dst, const float *x, size_t n) {
  ZT_LAUNCH_1D(k_widen_f64, n, dst, x, n);
}

static void cu_narrow_f64(float *dst, const double *x, size_t n, double s, float t) {
  ZT_LAUNCH_1D(k_narrow_f64, n, dst, x, n, s, t);
}

template <typename X>
void fill_adamw(zt_kernels_t *t) {
  ZT_PROF_ENTRY(t, adamw, cu_adamw);
  ZT_PROF_ENTRY(t, adamw_fused, cu_adamw_fused<X>);
  ZT_PROF_ENTRY(t, acc_f64, cu_acc_f64);
  ZT_PROF_ENTRY(t, add_f64, cu_add_f64);
  ZT_PROF_ENTRY(t, widen_f64, cu_widen_f64);
  ZT_PROF_ENTRY(t, narrow_f64, cu_narrow_f64);
}
template void fill_adamw<float>(zt_kernels_t *);
template void fill_adamw<bf16>(zt_kernels_t *);
