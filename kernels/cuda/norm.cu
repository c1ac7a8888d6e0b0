/*
 * norm.cu: the normalisations, a warp per row (each lane 8 elements at a
 * time, 16-byte vectors where the row allows): LayerNorm forward and
 * backward, residual + LayerNorm in one pass (residual_layernorm_forward),
 * and Llama's RMSNorm (its CPU twin is kernels/cpu/llama.c). Weight and
 * bias gradients are the column sums of reduce.cu.
 */
#include "common.cuh"

/* ---------------------------------------------------------------------------
 * LayerNorm: one warp per row, each lane VEC elements at a time (lane l
 * takes elements [VEC l + 32 VEC k, VEC l + 32 VEC k + VEC)). With a second
 * input the row is first the residual sum x = inp + inp2, rounded to X and
 * stored in res (residual_forward's result, bit for bit), and the
 * LayerNorm is of that stored row: residual_layernorm_forward is the two
 * calls in one pass. */

template <typename X, bool V8>
__global__ void k_layernorm_fwd(X *out, float *mean, float *rstd, X *res, const X *inp,
                                const X *inp2, const X *w, const X *b, int N, int C) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const X *x = inp + (size_t)row * C;
  float s = 0.0f, f[8], g[8];
  if (inp2) {
    X *r = res + (size_t)row * C;
    for (int i = lane * 8; i < C; i += 256) {
      ld8<V8>(f, x, i, C), ld8<V8>(g, inp2 + (size_t)row * C, i, C);
      for (int k = 0; k < 8; k++) {
        X t;
        put(t, f[k] + g[k]);
        f[k] = ldx(t);
        s += f[k];
      }
      st8<V8>(r, f, i, C);
    }
    x = r;
  } else {
    for (int i = lane * 8; i < C; i += 256) {
      ld8<V8>(f, x, i, C);
      for (int k = 0; k < 8; k++) s += f[k];
    }
  }
  float m = warp_sum(s) / C;
  float v = 0.0f;
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(f, x, i, C);
    for (int k = 0; k < 8; k++)
      if (V8 || i + k < C) v += (f[k] - m) * (f[k] - m);
  }
  float r = 1.0f / sqrtf(warp_sum(v) / C + ZT_LN_EPS);
  X *o = out + (size_t)row * C;
  for (int i = lane * 8; i < C; i += 256) {
    float wv[8], bv[8];
    ld8<V8>(f, x, i, C), ld8<V8>(wv, w, i, C), ld8<V8>(bv, b, i, C);
    for (int k = 0; k < 8; k++) f[k] = (f[k] - m) * r * wv[k] + bv[k];
    st8<V8>(o, f, i, C);
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

template <typename X>
static void layernorm_fwd(X *out, float *mean, float *rstd, X *res, const X *inp, const X *inp2,
                          const X *w, const X *b, int N, int C) {
  if (N <= 0) return;
  unsigned grid = (unsigned)((N + 7) / 8);
  if (vec_fits(8, sizeof(X), (size_t)C, {out, res, inp, inp2, w, b}))
    k_layernorm_fwd<X, true><<<grid, 256, 0, g.stream>>>(out, mean, rstd, res, inp, inp2, w, b,
                                                         N, C);
  else
    k_layernorm_fwd<X, false><<<grid, 256, 0, g.stream>>>(out, mean, rstd, res, inp, inp2, w, b,
                                                          N, C);
  ZT_CUDA_LAUNCHED();
}

template <typename X>
static void cu_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                 const float *w, const float *b, int N, int C) {
  layernorm_fwd((X *)out, mean, rstd, (X *)NULL, (const X *)inp, (const X *)NULL, (const X *)w,
                (const X *)b, N, C);
}

template <typename X>
static void cu_residual_layernorm_forward(float *res, float *out, float *mean, float *rstd,
                                          const float *a, const float *b2, const float *w,
                                          const float *b, int N, int C) {
  layernorm_fwd((X *)out, mean, rstd, (X *)res, (const X *)a, (const X *)b2, (const X *)w,
                (const X *)b, N, C);
}

template <typename X, bool V8>
__global__ void k_layernorm_bwd_inp(X *dinp, const X *dout, const X *inp, const X *w,
                                    const float *mean, const float *rstd, int N, int C) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const X *d = dout + (size_t)row * C, *x = inp + (size_t)row * C;
  X *dx = dinp + (size_t)row * C;
  float m = mean[row], s = rstd[row];
  float a = 0.0f, bsum = 0.0f, xv[8], wv[8], dv[8], gv[8];
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(xv, x, i, C), ld8<V8>(wv, w, i, C), ld8<V8>(dv, d, i, C);
    for (int k = 0; k < 8; k++) {
      float norm = (xv[k] - m) * s, dnorm = wv[k] * dv[k];
      a += dnorm; /* 0 past C */
      bsum += dnorm * norm;
    }
  }
  float dnorm_mean = warp_sum(a) / C, dnorm_norm_mean = warp_sum(bsum) / C;
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(xv, x, i, C), ld8<V8>(wv, w, i, C), ld8<V8>(dv, d, i, C), ld8<V8>(gv, dx, i, C);
    for (int k = 0; k < 8; k++) {
      float norm = (xv[k] - m) * s, dnorm = wv[k] * dv[k];
      gv[k] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
    st8<V8>(dx, gv, i, C);
  }
}

template <typename X>
static void cu_layernorm_backward(float *dinp_, float *dw, float *db, const float *dout_,
                                  const float *inp_, const float *w_, const float *mean,
                                  const float *rstd, int N, int C) {
  if (N <= 0) return;
  X *dinp = (X *)dinp_;
  const X *dout = (const X *)dout_, *inp = (const X *)inp_, *w = (const X *)w_;
  unsigned grid = (unsigned)((N + 7) / 8);
  if (vec_fits(8, sizeof(X), (size_t)C, {dinp, dout, inp, w}))
    k_layernorm_bwd_inp<X, true><<<grid, 256, 0, g.stream>>>(dinp, dout, inp, w, mean, rstd, N,
                                                             C);
  else
    k_layernorm_bwd_inp<X, false><<<grid, 256, 0, g.stream>>>(dinp, dout, inp, w, mean, rstd, N,
                                                              C);
  ZT_CUDA_LAUNCHED();
  colsums(db, dw, dout, inp, mean, rstd, N, C);
}

/* ---------------------------------------------------------------------------
 * RMSNorm as LayerNorm above: a warp per row, groups of 8 per lane; the
 * weight gradient is the column sums' dnorm with a mean of 0. */
template <typename X, bool V8>
__global__ void k_rmsnorm_fwd(X *out, float *rstd, const X *inp, const X *w, int N, int C,
                              float eps) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const X *x = inp + (size_t)row * C;
  float ss = 0.0f, f[8], wv[8];
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(f, x, i, C);
    for (int k = 0; k < 8; k++) ss += f[k] * f[k];
  }
  float s = 1.0f / sqrtf(warp_sum(ss) / C + eps);
  X *o = out + (size_t)row * C;
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(f, x, i, C), ld8<V8>(wv, w, i, C);
    for (int k = 0; k < 8; k++) f[k] = f[k] * s * wv[k];
    st8<V8>(o, f, i, C);
  }
  if (lane == 0) rstd[row] = s;
}

template <typename X, bool V8>
__global__ void k_rmsnorm_bwd_dx(X *dinp, const X *dout, const X *inp, const X *w,
                                 const float *rstd, int N, int C) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const X *x = inp + (size_t)row * C, *d = dout + (size_t)row * C;
  X *dx = dinp + (size_t)row * C;
  float s = rstd[row], gx = 0.0f, xv[8], wv[8], dv[8], gv[8];
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(xv, x, i, C), ld8<V8>(wv, w, i, C), ld8<V8>(dv, d, i, C);
    for (int k = 0; k < 8; k++) gx += wv[k] * dv[k] * xv[k];
  }
  float kk = warp_sum(gx) / C * s * s * s;
  for (int i = lane * 8; i < C; i += 256) {
    ld8<V8>(xv, x, i, C), ld8<V8>(wv, w, i, C), ld8<V8>(dv, d, i, C), ld8<V8>(gv, dx, i, C);
    for (int k = 0; k < 8; k++) gv[k] += s * wv[k] * dv[k] - xv[k] * kk;
    st8<V8>(dx, gv, i, C);
  }
}

template <typename X>
static void cu_rmsnorm_forward(float *out_, float *rstd, const float *inp_, const float *w_, int N,
                               int C, float eps) {
  if (N <= 0) return;
  X *out = (X *)out_;
  const X *inp = (const X *)inp_, *w = (const X *)w_;
  unsigned grid = (unsigned)((N + 7) / 8);
  if (vec_fits(8, sizeof(X), (size_t)C, {out, inp, w}))
    k_rmsnorm_fwd<X, true><<<grid, 256, 0, g.stream>>>(out, rstd, inp, w, N, C, eps);
  else
    k_rmsnorm_fwd<X, false><<<grid, 256, 0, g.stream>>>(out, rstd, inp, w, N, C, eps);
  ZT_CUDA_LAUNCHED();
}

template <typename X>
static void cu_rmsnorm_backward(float *dinp_, float *dw, const float *dout_, const float *inp_,
                                const float *w_, const float *rstd, int N, int C) {
  if (N <= 0) return;
  X *dinp = (X *)dinp_;
  const X *dout = (const X *)dout_, *inp = (const X *)inp_, *w = (const X *)w_;
  unsigned grid = (unsigned)((N + 7) / 8);
  if (vec_fits(8, sizeof(X), (size_t)C, {dinp, dout, inp, w}))
    k_rmsnorm_bwd_dx<X, true><<<grid, 256, 0, g.stream>>>(dinp, dout, inp, w, rstd, N, C);
  else
    k_rmsnorm_bwd_dx<X, false><<<grid, 256, 0, g.stream>>>(dinp, dout, inp, w, rstd, N, C);
  ZT_CUDA_LAUNCHED();
  if (dw) colsums((float *)NULL, dw, dout, inp, (const float *)NULL, rstd, N, C);
}

template <typename X>
void fill_norm(zt_kernels_t *t) {
  ZT_PROF_ENTRY(t, layernorm_forward, cu_layernorm_forward<X>);
  ZT_PROF_ENTRY(t, layernorm_backward, cu_layernorm_backward<X>);
  ZT_PROF_ENTRY(t, residual_layernorm_forward, cu_residual_layernorm_forward<X>);
  ZT_PROF_ENTRY(t, rmsnorm_forward, cu_rmsnorm_forward<X>);
  ZT_PROF_ENTRY(t, rmsnorm_backward, cu_rmsnorm_backward<X>);
}
template void fill_norm<float>(zt_kernels_t *);
template void fill_norm<bf16>(zt_kernels_t *);
