/*
 * llama.c: the Llama architecture's own kernels for both CPU tables
 * (zt_kernels.h: RMSNorm, rotary position embedding, SwiGLU, and the
 * expansion of grouped-query attention's K/V heads for the multi-head
 * kernels).
 *
 * These are element-wise or row-wise and small next to the matmuls, so one
 * implementation serves the reference and the fast table: rows in
 * parallel where rows are independent, and the one reduction across rows
 * (RMSNorm's weight gradient) serial in row order, so the result never
 * depends on the thread count. Sums of squares are formed in double.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "zt_kernels.h"

void zt_kernels_host_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *w,
                                     int N, int C, float eps) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const float *x = inp + (size_t)n * C;
    float *o = out + (size_t)n * C;
    double ss = 0.0;
    for (int i = 0; i < C; i++) ss += (double)x[i] * x[i];
    float s = 1.0f / sqrtf((float)(ss / C) + eps);
    for (int i = 0; i < C; i++) o[i] = x[i] * s * w[i];
    rstd[n] = s;
  }
}

/* With g = w * dout: dx = s * g - x * s^3 * mean(g * x); dw += dout * x * s. */
void zt_kernels_host_rmsnorm_backward(float *dinp, float *dw, const float *dout,
                                      const float *inp, const float *w, const float *rstd, int N,
                                      int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const float *x = inp + (size_t)n * C, *d = dout + (size_t)n * C;
    float *dx = dinp + (size_t)n * C, s = rstd[n];
    double gx = 0.0;
    for (int i = 0; i < C; i++) gx += (double)w[i] * d[i] * x[i];
    float k = (float)(gx / C) * s * s * s;
    for (int i = 0; i < C; i++) dx[i] += s * w[i] * d[i] - x[i] * k;
  }
  for (int n = 0; dw && n < N; n++) {
    const float *x = inp + (size_t)n * C, *d = dout + (size_t)n * C;
    float s = rstd[n];
    for (int i = 0; i < C; i++) dw[i] += d[i] * x[i] * s;
  }
}

/* Rotates pairs (i, i + HD/2) of each q and k head at position t by
 * t * inv_freq[i] (zt_rope_inv_freq: 1 / theta^(2i/HD) as Hugging Face
 * forms it in fp32, then Llama 3's scaling); backwards (inverse) by the
 * opposite angle. */
void zt_kernels_host_rope(float *qkv, int B, int T, int pos0, int NH, int NKV, int HD,
                          zt_rope_t rope, int inverse) {
  int half = HD / 2, heads = NH + NKV, W = (NH + 2 * NKV) * HD;
#pragma omp parallel for schedule(static)
  for (int bt = 0; bt < B * T; bt++) {
    float t = (float)(pos0 + bt % T);
    float *row = qkv + (size_t)bt * W;
    for (int i = 0; i < half; i++) {
      float inv = zt_rope_inv_freq(rope, i, HD);
      float ang = t * inv, c = cosf(ang), sn = inverse ? -sinf(ang) : sinf(ang);
      for (int h = 0; h < heads; h++) {
        float *x = row + (size_t)h * HD; /* q heads, then k heads */
        float a = x[i], b = x[i + half];
        x[i] = a * c - b * sn;
        x[i + half] = b * c + a * sn;
      }
    }
  }
}

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

void zt_kernels_host_swiglu_forward(float *out, const float *inp, int N, int F) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const float *g = inp + (size_t)n * 2 * F, *u = g + F;
    float *o = out + (size_t)n * F;
    for (int i = 0; i < F; i++) o[i] = g[i] * sigmoidf(g[i]) * u[i];
  }
}

void zt_kernels_host_swiglu_backward(float *dinp, const float *dout, const float *inp, int N,
                                     int F) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const float *g = inp + (size_t)n * 2 * F, *u = g + F, *d = dout + (size_t)n * F;
    float *dg = dinp + (size_t)n * 2 * F, *du = dg + F;
    for (int i = 0; i < F; i++) {
      float s = sigmoidf(g[i]), silu = g[i] * s;
      du[i] = d[i] * silu;
      dg[i] = d[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
    }
  }
}

void zt_kernels_host_gqa_expand(float *full, const float *qkv, int N, int NH, int NKV, int HD) {
  int rep = NH / NKV, W = (NH + 2 * NKV) * HD, A = NH * HD;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const float *q = qkv + (size_t)n * W, *k = q + A, *v = k + (size_t)NKV * HD;
    float *f = full + (size_t)n * 3 * A;
    memcpy(f, q, sizeof(float) * (size_t)A);
    for (int h = 0; h < NH; h++) {
      memcpy(f + A + (size_t)h * HD, k + (size_t)(h / rep) * HD, sizeof(float) * (size_t)HD);
      memcpy(f + 2 * A + (size_t)h * HD, v + (size_t)(h / rep) * HD, sizeof(float) * (size_t)HD);
    }
  }
}

void zt_kernels_host_gqa_reduce(float *dqkv, const float *dfull, int N, int NH, int NKV, int HD) {
  int rep = NH / NKV, W = (NH + 2 * NKV) * HD, A = NH * HD;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const float *f = dfull + (size_t)n * 3 * A;
    float *q = dqkv + (size_t)n * W, *k = q + A, *v = k + (size_t)NKV * HD;
    memcpy(q, f, sizeof(float) * (size_t)A);
    memset(k, 0, sizeof(float) * 2 * (size_t)NKV * HD);
    for (int h = 0; h < NH; h++) /* in head order: a fixed order of the sums */
      for (int i = 0; i < HD; i++) {
        k[(size_t)(h / rep) * HD + i] += f[A + (size_t)h * HD + i];
        v[(size_t)(h / rep) * HD + i] += f[2 * A + (size_t)h * HD + i];
      }
  }
}
