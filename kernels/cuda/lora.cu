/*
 * lora.cu: LoRA's two table calls (zt_kernels.h; engine/lora.c uses them):
 * lora_merge folds the adapters into a block's weights before it computes,
 * w = base + s b a, and lora_grad takes the adapters' gradients from the
 * merged weight's, da += s b^T dw and db += s dw a^T. Each output element
 * is one thread's or one warp's sum in a fixed order: no atomics.
 */
#include "common.cuh"

/* Merge: one thread per weight, its R products summed in fp32 in order. */
template <typename X>
__global__ void k_lora_merge(X *w, const X *base, const X *a, const X *b, int O, int IN, int R,
                             float s) {
  ZT_GRID_STRIDE(j, (size_t)O * IN) {
    size_t o = j / IN, i = j % IN;
    float acc = 0.0f;
    for (int r = 0; r < R; r++) acc += ldx(b[o * R + r]) * ldx(a[(size_t)r * IN + i]);
    put(w[j], ldx(base[j]) + s * acc);
  }
}

/* da[r,i] += s * sum over o of b[o,r] dw[o,i]: one thread per element of da
 * (neighbours read neighbouring columns of dw). */
template <typename X>
__global__ void k_lora_grad_a(float *da, const float *dw, const X *b, int O, int IN, int R,
                              float s) {
  ZT_GRID_STRIDE(j, (size_t)R * IN) {
    size_t r = j / IN, i = j % IN;
    float acc = 0.0f;
    for (int o = 0; o < O; o++) acc += ldx(b[(size_t)o * R + r]) * dw[(size_t)o * IN + i];
    da[j] += s * acc;
  }
}

/* db[o,r] += s * sum over i of dw[o,i] a[r,i]: one warp per element, its
 * lanes striding over i, then warp_sum (a fixed order). */
template <typename X>
__global__ void k_lora_grad_b(float *db, const float *dw, const X *a, int O, int IN, int R,
                              float s) {
  size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  int lane = threadIdx.x % 32;
  if (warp >= (size_t)O * R) return;
  size_t o = warp / R, r = warp % R;
  float acc = 0.0f;
  for (int i = lane; i < IN; i += 32) acc += dw[o * IN + i] * ldx(a[r * IN + i]);
  acc = warp_sum(acc);
  if (lane == 0) db[warp] += s * acc;
}

template <typename X>
static void cu_lora_merge(float *w, const float *base, const float *a, const float *b, int O,
                          int IN, int R, float s) {
  ZT_LAUNCH_1D(k_lora_merge<X>, (size_t)O * IN, (X *)w, (const X *)base, (const X *)a,
               (const X *)b, O, IN, R, s);
}

template <typename X>
static void cu_lora_grad(float *da, float *db, const float *dw, const float *a, const float *b,
                         int O, int IN, int R, float s) {
  ZT_LAUNCH_1D(k_lora_grad_a<X>, (size_t)R * IN, da, dw, (const X *)b, O, IN, R, s);
  size_t threads = (size_t)O * R * 32;
  if (!threads) return;
  k_lora_grad_b<X><<<(unsigned)((threads + 255) / 256), 256, 0, g.stream>>>(db, dw, (const X *)a,
                                                                           O, IN, R, s);
  ZT_CUDA_LAUNCHED();
}

template <typename X>
void fill_lora(zt_kernels_t *t) {
  ZT_PROF_ENTRY(t, lora_merge, cu_lora_merge<X>);
  ZT_PROF_ENTRY(t, lora_grad, cu_lora_grad<X>);
}
template void fill_lora<float>(zt_kernels_t *);
template void fill_lora<bf16>(zt_kernels_t *);
