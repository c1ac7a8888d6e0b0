/*
 * elementwise.cu: the kernels that take each element (or each row's
 * columns) on its own, a grid-stride loop with 16-byte vectors where the
 * length and the pointers allow: GELU (tanh) forward and backward, the
 * residual sum, Llama's SwiGLU, the conversions between fp32 and the
 * storage type (narrow_x, widen_x), scale and zero. GELU's two passes are
 * also the fallback of the products with GELU in their epilogue
 * (matmul.cu), hence gelu_forward_x and gelu_backward_x in common.cuh.
 */
#include "common.cuh"

/* GELU's forward and backward of one element. */
__device__ __forceinline__ float gelu_of(float x) {
  float cube = ZT_GELU_CUBE * x * x * x;
  return 0.5f * x * (1.0f + tanhf(ZT_GELU_SCALE * (x + cube)));
}

__device__ __forceinline__ float gelu_grad(float x) {
  float cube = ZT_GELU_CUBE * x * x * x;
  float arg = ZT_GELU_SCALE * (x + cube);
  float th = tanhf(arg), ch = coshf(arg);
  float sech2 = 1.0f / (ch * ch);
  return 0.5f * (1.0f + th) +
         x * 0.5f * sech2 * ZT_GELU_SCALE * (1.0f + 3.0f * ZT_GELU_CUBE * x * x);
}

template <typename X, int VEC>
__global__ void k_gelu_fwd(X *out, const X *inp, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    float f[VEC];
    ldv<VEC>(f, inp + j * VEC);
    for (int k = 0; k < VEC; k++) f[k] = gelu_of(f[k]);
    stv<VEC>(out + j * VEC, f);
  }
}

template <typename X, int VEC>
__global__ void k_gelu_bwd(X *dinp, const X *inp, const X *dout, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    float f[VEC], d[VEC];
    ldv<VEC>(f, inp + j * VEC), ldv<VEC>(d, dout + j * VEC);
    for (int k = 0; k < VEC; k++) f[k] = gelu_grad(f[k]) * d[k];
    stv<VEC>(dinp + j * VEC, f);
  }
}

/* out = a + b over n / VEC vectors. */
template <typename X, int VEC>
__global__ void k_residual(X *out, const X *a, const X *b, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    float f[VEC], g[VEC];
    ldv<VEC>(f, a + j * VEC), ldv<VEC>(g, b + j * VEC);
    for (int k = 0; k < VEC; k++) f[k] += g[k];
    stv<VEC>(out + j * VEC, f);
  }
}

/* Between fp32 and the storage type: dst = src rounded (narrow), or
 * widened (widen, exact). */
template <typename X, int VEC>
__global__ void k_narrow_x(X *dst, const float *src, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    float f[VEC];
    ldv<VEC>(f, src + j * VEC);
    stv<VEC>(dst + j * VEC, f);
  }
}

template <typename X, int VEC>
__global__ void k_widen_x(float *dst, const X *src, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    float f[VEC];
    ldv<VEC>(f, src + j * VEC);
    stv<VEC>(dst + j * VEC, f);
  }
}

__global__ void k_scale(float *x, size_t n, float s) {
  ZT_GRID_STRIDE(i, n) x[i] *= s;
}

template <typename X>
void gelu_forward_x(float *out, const float *inp, size_t n) {
  ZT_LAUNCH_X8(k_gelu_fwd, X, n, vec_fits(8, sizeof(X), n, {out, inp}), (X *)out,
               (const X *)inp, n);
}
template void gelu_forward_x<float>(float *, const float *, size_t);
template void gelu_forward_x<bf16>(float *, const float *, size_t);

template <typename X>
void gelu_backward_x(float *dinp, const float *inp, const float *dout, size_t n) {
  ZT_LAUNCH_X8(k_gelu_bwd, X, n, vec_fits(8, sizeof(X), n, {dinp, inp, dout}), (X *)dinp,
               (const X *)inp, (const X *)dout, n);
}
template void gelu_backward_x<float>(float *, const float *, const float *, size_t);
template void gelu_backward_x<bf16>(float *, const float *, const float *, size_t);

template <typename X>
static void cu_residual_forward(float *out, const float *a, const float *b, size_t n) {
  ZT_LAUNCH_X8(k_residual, X, n, vec_fits(8, sizeof(X), n, {out, a, b}), (X *)out, (const X *)a,
               (const X *)b, n);
}

/* SwiGLU over rows of F: VEC consecutive columns of a row at a time (F a
 * multiple of VEC). */
template <typename X, int VEC>
__global__ void k_swiglu_fwd(X *out, const X *inp, int F, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t e = j * VEC, r = e / F;
    const X *in = inp + r * 2 * F + e % F;
    float g[VEC], u[VEC];
    ldv<VEC>(g, in), ldv<VEC>(u, in + F);
    for (int k = 0; k < VEC; k++) g[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    stv<VEC>(out + e, g);
  }
}

template <typename X, int VEC>
__global__ void k_swiglu_bwd(X *dinp, const X *dout, const X *inp, int F, size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t e = j * VEC, r = e / F, o = r * 2 * F + e % F;
    float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC];
    ldv<VEC>(g, inp + o), ldv<VEC>(u, inp + o + F), ldv<VEC>(d, dout + e);
    for (int k = 0; k < VEC; k++) {
      float s = 1.0f / (1.0f + expf(-g[k]));
      du[k] = d[k] * g[k] * s;
      dg[k] = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
    }
    stv<VEC>(dinp + o, dg), stv<VEC>(dinp + o + F, du);
  }
}

template <typename X>
static void cu_swiglu_forward(float *out, const float *inp, int N, int F) {
  size_t n = (size_t)N * F;
  ZT_LAUNCH_X8(k_swiglu_fwd, X, n, vec_fits(8, sizeof(X), (size_t)F, {out, inp}), (X *)out,
               (const X *)inp, F, n);
}

template <typename X>
static void cu_swiglu_backward(float *dinp, const float *dout, const float *inp, int N, int F) {
  size_t n = (size_t)N * F;
  ZT_LAUNCH_X8(k_swiglu_bwd, X, n, vec_fits(8, sizeof(X), (size_t)F, {dinp, dout, inp}),
               (X *)dinp, (const X *)dout, (const X *)inp, F, n);
}

template <typename X>
static void cu_narrow_x(void *dst, const float *src, size_t n) {
  ZT_LAUNCH_X8(k_narrow_x, X, n, vec_fits(8, sizeof(X), n, {dst}) && vec_fits(8, 4, n, {src}),
               (X *)dst, src, n);
}

template <typename X>
static void cu_widen_x(float *dst, const void *src, size_t n) {
  ZT_LAUNCH_X8(k_widen_x, X, n, vec_fits(8, sizeof(X), n, {src}) && vec_fits(8, 4, n, {dst}),
               dst, (const X *)src, n);
}

static void cu_scale(float *x, size_t n, float s) {
  ZT_LAUNCH_1D(k_scale, n, x, n, s);
}

static void cu_zero(float *x, size_t n) {
  if (!n) return;
  ZT_CUDA_CHECK(cudaMemsetAsync(x, 0, n * sizeof(float), g.stream));
}

template <typename X>
void fill_elementwise(zt_kernels_t *t) {
  ZT_PROF_ENTRY(t, gelu_forward, gelu_forward_x<X>);
  ZT_PROF_ENTRY(t, gelu_backward, gelu_backward_x<X>);
  ZT_PROF_ENTRY(t, residual_forward, cu_residual_forward<X>);
  ZT_PROF_ENTRY(t, swiglu_forward, cu_swiglu_forward<X>);
  ZT_PROF_ENTRY(t, swiglu_backward, cu_swiglu_backward<X>);
  ZT_PROF_ENTRY(t, narrow_x, cu_narrow_x<X>);
  ZT_PROF_ENTRY(t, widen_x, cu_widen_x<X>);
  ZT_PROF_ENTRY(t, scale, cu_scale);
  ZT_PROF_ENTRY(t, zero, cu_zero);
}
template void fill_elementwise<float>(zt_kernels_t *);
template void fill_elementwise<bf16>(zt_kernels_t *);
