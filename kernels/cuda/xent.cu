/*
 * xent.cu: the classifier, softmax + cross-entropy over the padded
 * vocabulary, one block per row. Two pairs: crossentropy_forward and
 * _backward write and read the probabilities (in place over the logits);
 * crossentropy_lse_forward and _backward (the CUDA tables only; engine/
 * model.c prefers them) keep only each row's log-sum-exp and form each
 * probability in the one pass that writes dlogits. A row's maximum and
 * sum come from one read (row_max_sum) and block_reduce's fixed tree.
 */
#include "common.cuh"

/* ---------------------------------------------------------------------------
 * Softmax + cross-entropy: one block per row. probs may alias logits: every
 * read of the row (maximum, sum, the target's logit) happens before the
 * barrier that precedes the first write. */

/* A row's maximum and sum of exponentials over its first V columns, in
 * one read: each thread keeps a running maximum and rescales its sum when
 * the maximum grows, then the threads' pairs are combined. Every thread
 * gets both. */
template <bool V8, typename X>
__device__ void row_max_sum(const X *l, int V, int Vp, float *sh, float *mx_out, float *s_out) {
  float mx = -INFINITY, s = 0.0f, f[8];
  for (int i = threadIdx.x * 8; i < V; i += blockDim.x * 8) {
    ld8<V8>(f, l, i, Vp);
    for (int k = 0; k < 8 && i + k < V; k++) {
      if (f[k] == -INFINITY) continue; /* exp 0; and -inf - -inf would be NaN */
      if (f[k] > mx) s *= expf(mx - f[k]), mx = f[k];
      s += expf(f[k] - mx);
    }
  }
  float gmx = block_reduce<float, true>(mx, sh);
  *s_out = block_reduce<float, false>(mx == -INFINITY ? 0.0f : s * expf(mx - gmx), sh);
  *mx_out = gmx;
}

/* The forward reads the row once for its maximum and sum (row_max_sum)
 * and once more to write the probabilities. */
template <typename X, bool V8>
__global__ void k_crossentropy_fwd(float *losses, X *probs, const X *logits, const int *targets,
                                   int V, int Vp) {
  __shared__ float sh[ZT_RED_THREADS];
  size_t n = blockIdx.x;
  const X *l = logits + n * Vp;
  X *p = probs + n * Vp;
  float mx, s, f[8];
  row_max_sum<V8>(l, V, Vp, sh, &mx, &s);
  float lt = ldx(l[targets[n]]);
  __syncthreads();
  for (int i = threadIdx.x * 8; i < Vp; i += blockDim.x * 8) {
    ld8<V8>(f, l, i, Vp);
    for (int k = 0; k < 8; k++) f[k] = i + k < V ? expf(f[k] - mx) / s : 0.0f;
    st8<V8>(p, f, i, Vp);
  }
  if (threadIdx.x == 0) losses[n] = -logf(expf(lt - mx) / s);
}

/* The classifier without probabilities (crossentropy_lse_forward and
 * _backward): the forward reads each row once and writes only its loss
 * and lse; the backward forms each probability, exp(l - lse), in the one
 * pass that writes dlogits. */
template <typename X, bool V8>
__global__ void k_xent_lse_fwd(float *losses, float *lse, const X *logits, const int *targets,
                               int V, int Vp) {
  __shared__ float sh[ZT_RED_THREADS];
  size_t n = blockIdx.x;
  const X *l = logits + n * Vp;
  float mx, s;
  row_max_sum<V8>(l, V, Vp, sh, &mx, &s);
  if (threadIdx.x == 0) {
    float z = mx + logf(s);
    lse[n] = z;
    losses[n] = z - ldx(l[targets[n]]);
  }
}

template <typename X, int VEC>
__global__ void k_xent_lse_bwd(X *dlogits, const X *logits, const float *lse, const int *targets,
                               float dloss, int V, int Vp, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t i = j * VEC, row = i / Vp;
    int c = (int)(i % Vp), t = targets[row];
    float z = lse[row], f[VEC];
    ldv<VEC>(f, logits + i);
    for (int k = 0; k < VEC; k++)
      f[k] = c + k < V ? (expf(f[k] - z) - (c + k == t ? 1.0f : 0.0f)) * dloss : 0.0f;
    stv<VEC>(dlogits + i, f);
  }
}

template <typename X>
static void cu_crossentropy_lse_forward(float *losses, float *lse, const float *logits,
                                        const int *targets, int N, int V, int Vp) {
  if (N <= 0) return;
  if (vec_fits(8, sizeof(X), (size_t)Vp, {logits}))
    k_xent_lse_fwd<X, true><<<N, ZT_RED_THREADS, 0, g.stream>>>(losses, lse, (const X *)logits,
                                                                targets, V, Vp);
  else
    k_xent_lse_fwd<X, false><<<N, ZT_RED_THREADS, 0, g.stream>>>(losses, lse, (const X *)logits,
                                                                 targets, V, Vp);
  ZT_CUDA_LAUNCHED();
}

template <typename X>
static void cu_crossentropy_lse_backward(float *dlogits, const float *logits, const float *lse,
                                         const int *targets, float dloss, int N, int V, int Vp) {
  size_t n = (size_t)N * Vp;
  ZT_LAUNCH_X8(k_xent_lse_bwd, X, n, vec_fits(8, sizeof(X), (size_t)Vp, {dlogits, logits}),
               (X *)dlogits, (const X *)logits, lse, targets, dloss, V, Vp, n);
}

template <typename X, int VEC>
__global__ void k_crossentropy_bwd(X *dlogits, const X *probs, const int *targets, float dloss,
                                   int V, int Vp, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t i = j * VEC, row = i / Vp;
    int c = (int)(i % Vp), t = targets[row];
    float f[VEC];
    ldv<VEC>(f, probs + i);
    for (int k = 0; k < VEC; k++)
      f[k] = c + k < V ? (f[k] - (c + k == t ? 1.0f : 0.0f)) * dloss : 0.0f;
    stv<VEC>(dlogits + i, f);
  }
}

template <typename X>
static void cu_crossentropy_forward(float *losses, float *probs, const float *logits,
                                    const int *targets, int N, int V, int Vp) {
  if (N <= 0) return;
  if (vec_fits(8, sizeof(X), (size_t)Vp, {probs, logits}))
    k_crossentropy_fwd<X, true><<<N, ZT_RED_THREADS, 0, g.stream>>>(
        losses, (X *)probs, (const X *)logits, targets, V, Vp);
  else
    k_crossentropy_fwd<X, false><<<N, ZT_RED_THREADS, 0, g.stream>>>(
        losses, (X *)probs, (const X *)logits, targets, V, Vp);
  ZT_CUDA_LAUNCHED();
}

template <typename X>
static void cu_crossentropy_backward(float *dlogits, const float *probs, const int *targets,
                                     float dloss, int N, int V, int Vp) {
  size_t n = (size_t)N * Vp;
  ZT_LAUNCH_X8(k_crossentropy_bwd, X, n, vec_fits(8, sizeof(X), (size_t)Vp, {dlogits, probs}),
               (X *)dlogits, (const X *)probs, targets, dloss, V, Vp, n);
}

template <typename X>
void fill_xent(zt_kernels_t *t) {
  ZT_PROF_ENTRY(t, crossentropy_forward, cu_crossentropy_forward<X>);
  ZT_PROF_ENTRY(t, crossentropy_backward, cu_crossentropy_backward<X>);
  ZT_PROF_ENTRY(t, crossentropy_lse_forward, cu_crossentropy_lse_forward<X>);
  ZT_PROF_ENTRY(t, crossentropy_lse_backward, cu_crossentropy_lse_backward<X>);
}
template void fill_xent<float>(zt_kernels_t *);
template void fill_xent<bf16>(zt_kernels_t *);
