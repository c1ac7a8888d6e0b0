/*
 * rope.cu: rotary position embeddings (rope, zt_kernels.h; Hugging Face's
 * rotate_half convention, its CPU twin in kernels/cpu/llama.c), in place
 * on the q and k heads of qkv; inverse rotates back, which is the
 * backward. The frequencies come from zt_rope_inv_freq, the one function
 * the CPU tables use too.
 */
#include "common.cuh"

/* One thread per (row, q or k head, pair). */
template <typename X>
__global__ void k_rope(X *qkv, int T, int pos0, int NH, int NKV, int HD, zt_rope_t rope,
                       int inverse, size_t n) {
  int half = HD / 2, heads = NH + NKV, W = (NH + 2 * NKV) * HD;
  ZT_GRID_STRIDE(j, n) {
    int i = (int)(j % half);
    size_t rh = j / half;
    int h = (int)(rh % heads);
    size_t bt = rh / heads;
    float t = (float)(pos0 + (int)(bt % T));
    float inv = zt_rope_inv_freq(rope, i, HD);
    float ang = t * inv, c = cosf(ang), sn = inverse ? -sinf(ang) : sinf(ang);
    X *x = qkv + bt * W + (size_t)h * HD;
    float a = ldx(x[i]), b = ldx(x[i + half]);
    put(x[i], a * c - b * sn);
    put(x[i + half], b * c + a * sn);
  }
}

template <typename X>
static void cu_rope(float *qkv, int B, int T, int pos0, int NH, int NKV, int HD, zt_rope_t rope,
                    int inverse) {
  size_t n = (size_t)B * T * (NH + NKV) * (HD / 2);
  ZT_LAUNCH_1D(k_rope<X>, n, (X *)qkv, T, pos0, NH, NKV, HD, rope, inverse, n);
}

template <typename X>
void fill_rope(zt_kernels_t *t) {
  ZT_PROF_ENTRY(t, rope, cu_rope<X>);
}
template void fill_rope<float>(zt_kernels_t *);
template void fill_rope<bf16>(zt_kernels_t *);
