/*
 * ref.c: the reference CPU kernels, zt_kernels_ref().
 *
 * Plain serial loops, written to be read rather than to be fast. They define
 * what every other kernel table must compute: the unit tests run each fast
 * kernel (kernels/cpu/fast.c, and later the CUDA kernels) on random inputs and
 * compare it with the function of the same name here, and the model's
 * gradient check runs on this table. The formulas follow GPT-2 (and llm.c's
 * train_gpt2.c): pre-LN blocks, LayerNorm eps 1e-5, GELU with the tanh
 * approximation, causal softmax attention scaled by 1/sqrt(head size).
 *
 * See zt_kernels.h for the contract of each function (which outputs are
 * overwritten and which gradients are accumulated).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "zt_common.h"
#include "zt_kernels.h"

static void ref_encoder_forward(float *out, const int *inp, const float *wte, const float *wpe,
                                int B, int T, int C) {
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      float *o = out + ((size_t)b * T + t) * C;
      const float *we = wte + (size_t)inp[b * T + t] * C;
      const float *pe = wpe + (size_t)t * C;
      for (int i = 0; i < C; i++) o[i] = we[i] + pe[i];
    }
  }
}

static void ref_encoder_backward(float *dwte, float *dwpe, const float *dout, const int *inp,
                                 int B, int T, int C) {
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const float *d = dout + ((size_t)b * T + t) * C;
      float *dwe = dwte + (size_t)inp[b * T + t] * C;
      float *dpe = dwpe + (size_t)t * C;
      for (int i = 0; i < C; i++) dwe[i] += d[i];
      for (int i = 0; i < C; i++) dpe[i] += d[i];
    }
  }
}

static void ref_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                  const float *w, const float *b, int N, int C) {
  for (int n = 0; n < N; n++) {
    const float *x = inp + (size_t)n * C;
    float m = 0.0f;
    for (int i = 0; i < C; i++) m += x[i];
    m /= C;
    float v = 0.0f;
    for (int i = 0; i < C; i++) {
      float d = x[i] - m;
      v += d * d;
    }
    v /= C;
    float s = 1.0f / sqrtf(v + ZT_LN_EPS);
    float *o = out + (size_t)n * C;
    for (int i = 0; i < C; i++) o[i] = (x[i] - m) * s * w[i] + b[i];
    mean[n] = m;
    rstd[n] = s;
  }
}

static void ref_layernorm_backward(float *dinp, float *dw, float *db, const float *dout,
                                   const float *inp, const float *w, const float *mean,
                                   const float *rstd, int N, int C) {
  for (int n = 0; n < N; n++) {
    const float *d = dout + (size_t)n * C;
    const float *x = inp + (size_t)n * C;
    float *dx = dinp + (size_t)n * C;
    double m = mean[n], s = rstd[n];
    /* With xhat = (x - m) s and g = w dout: dx = s (g - mean(g) - xhat
     * mean(g xhat)). The two means are formed in double: the reference is
     * the more accurate side of every comparison. */
    double g_mean = 0.0, gx_mean = 0.0;
    for (int i = 0; i < C; i++) {
      double xhat = (x[i] - m) * s, g = (double)w[i] * d[i];
      g_mean += g;
      gx_mean += g * xhat;
    }
    g_mean /= C;
    gx_mean /= C;
    for (int i = 0; i < C; i++) {
      double xhat = (x[i] - m) * s, g = (double)w[i] * d[i];
      db[i] += d[i];
      dw[i] += (float)(xhat * d[i]);
      dx[i] += (float)((g - g_mean - xhat * gx_mean) * s);
    }
  }
}

static void ref_matmul_forward(float *out, const float *inp, const float *w, const float *bias,
                               int N, int IC, int OC) {
  for (int n = 0; n < N; n++) {
    const float *x = inp + (size_t)n * IC;
    for (int o = 0; o < OC; o++) {
      const float *wr = w + (size_t)o * IC;
      float acc = bias ? bias[o] : 0.0f;
      for (int i = 0; i < IC; i++) acc += x[i] * wr[i];
      out[(size_t)n * OC + o] = acc;
    }
  }
}

static void ref_matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                                const float *inp, const float *w, int N, int IC, int OC) {
  if (dinp) {
    for (int n = 0; n < N; n++) {
      float *dx = dinp + (size_t)n * IC;
      for (int i = 0; i < IC; i++) dx[i] = 0.0f;
      for (int o = 0; o < OC; o++) {
        float d = dout[(size_t)n * OC + o];
        const float *wr = w + (size_t)o * IC;
        for (int i = 0; i < IC; i++) dx[i] += d * wr[i];
      }
    }
  }
  for (int o = 0; o < OC; o++) {
    float *dwr = dw ? dw + (size_t)o * IC : NULL;
    float bsum = 0.0f;
    for (int n = 0; n < N; n++) {
      float d = dout[(size_t)n * OC + o];
      const float *x = inp + (size_t)n * IC;
      for (int i = 0; dwr && i < IC; i++) dwr[i] += d * x[i];
      bsum += d;
    }
    if (dbias) dbias[o] += bsum;
  }
}

/* Where the heads lie in qkv (zt_kernels.h, attention_forward_gqa): rows
 * of W = (NH + 2 NKV) HD; query head h at column h HD, its K/V head
 * g = h / (NH / NKV) at NH HD + g HD and (NH + NKV) HD + g HD. */
typedef struct {
  int NH, NKV, HD;
  size_t W, A; /* qkv's and out's row widths */
} ref_geom;

static size_t ref_q(const ref_geom *g, int h) { return (size_t)h * g->HD; }
static size_t ref_k(const ref_geom *g, int h) {
  return (size_t)g->NH * g->HD + (size_t)(h / (g->NH / g->NKV)) * g->HD;
}
static size_t ref_v(const ref_geom *g, int h) { return ref_k(g, h) + (size_t)g->NKV * g->HD; }

/* Row t of one head: its scaled scores against keys 0..t into a[0..t];
 * returns their maximum. */
static float ref_scores(float *a, const float *qkv, const ref_geom *g, int b, int h, int t, int T,
                        float scale) {
  const float *q = qkv + ((size_t)b * T + t) * g->W + ref_q(g, h);
  float maxv = -INFINITY;
  for (int t2 = 0; t2 <= t; t2++) {
    const float *k = qkv + ((size_t)b * T + t2) * g->W + ref_k(g, h);
    float dot = 0.0f;
    for (int i = 0; i < g->HD; i++) dot += q[i] * k[i];
    a[t2] = dot * scale;
    if (a[t2] > maxv) maxv = a[t2];
  }
  return maxv;
}

static void ref_attention_forward_gqa(float *out, float *lse, const float *qkv, int B, int T,
                                      int NH, int NKV, int HD) {
  ref_geom g = {NH, NKV, HD, (size_t)(NH + 2 * NKV) * HD, (size_t)NH * HD};
  float scale = 1.0f / sqrtf((float)HD);
  float *a = zt_xmalloc(sizeof(float) * (size_t)T);
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      for (int t = 0; t < T; t++) {
        float maxv = ref_scores(a, qkv, &g, b, h, t, T, scale);
        float sum = 0.0f;
        for (int t2 = 0; t2 <= t; t2++) {
          a[t2] = expf(a[t2] - maxv);
          sum += a[t2];
        }
        for (int t2 = 0; t2 <= t; t2++) a[t2] /= sum;
        lse[((size_t)b * NH + h) * T + t] = maxv + logf(sum);
        float *o = out + ((size_t)b * T + t) * g.A + (size_t)h * HD;
        for (int i = 0; i < HD; i++) o[i] = 0.0f;
        for (int t2 = 0; t2 <= t; t2++) {
          const float *v = qkv + ((size_t)b * T + t2) * g.W + ref_v(&g, h);
          for (int i = 0; i < HD; i++) o[i] += a[t2] * v[i];
        }
      }
    }
  }
  free(a);
}

static void ref_attention_forward(float *out, float *lse, const float *qkv, int B, int T, int C,
                                  int NH) {
  ref_attention_forward_gqa(out, lse, qkv, B, T, NH, NH, C / NH);
}

/* The probabilities are recomputed from the scores and lse; the softmax
 * backward is written as its definition, sum(att * datt), not through out.
 * A K/V head's gradient sums over the query heads that share it. */
static void ref_attention_backward_gqa(float *dqkv, const float *dout, const float *qkv,
                                       const float *out, const float *lse, int B, int T, int NH,
                                       int NKV, int HD) {
  (void)out;
  ref_geom g = {NH, NKV, HD, (size_t)(NH + 2 * NKV) * HD, (size_t)NH * HD};
  float scale = 1.0f / sqrtf((float)HD);
  float *a = zt_xmalloc(sizeof(float) * (size_t)T), *datt = zt_xmalloc(sizeof(float) * (size_t)T);
  memset(dqkv, 0, sizeof(float) * (size_t)B * T * g.W);
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      for (int t = 0; t < T; t++) {
        ref_scores(a, qkv, &g, b, h, t, T, scale);
        float l = lse[((size_t)b * NH + h) * T + t];
        for (int t2 = 0; t2 <= t; t2++) a[t2] = expf(a[t2] - l);
        const float *d = dout + ((size_t)b * T + t) * g.A + (size_t)h * HD;
        const float *q = qkv + ((size_t)b * T + t) * g.W + ref_q(&g, h);
        float *dq = dqkv + ((size_t)b * T + t) * g.W + ref_q(&g, h);
        /* datt[t2] = dout . v[t2]; dv[t2] += att[t2] * dout. */
        for (int t2 = 0; t2 <= t; t2++) {
          const float *v = qkv + ((size_t)b * T + t2) * g.W + ref_v(&g, h);
          float *dv = dqkv + ((size_t)b * T + t2) * g.W + ref_v(&g, h);
          float dot = 0.0f;
          for (int i = 0; i < HD; i++) {
            dot += d[i] * v[i];
            dv[i] += a[t2] * d[i];
          }
          datt[t2] = dot;
        }
        /* Softmax backward: dpre = att * (datt - sum(att * datt)). */
        float s = 0.0f;
        for (int t2 = 0; t2 <= t; t2++) s += a[t2] * datt[t2];
        for (int t2 = 0; t2 <= t; t2++) {
          float dpre = a[t2] * (datt[t2] - s) * scale;
          const float *k = qkv + ((size_t)b * T + t2) * g.W + ref_k(&g, h);
          float *dk = dqkv + ((size_t)b * T + t2) * g.W + ref_k(&g, h);
          for (int i = 0; i < HD; i++) {
            dq[i] += dpre * k[i];
            dk[i] += dpre * q[i];
          }
        }
      }
    }
  }
  free(a);
  free(datt);
}

static void ref_attention_backward(float *dqkv, const float *dout, const float *qkv,
                                   const float *out, const float *lse, int B, int T, int C,
                                   int NH) {
  ref_attention_backward_gqa(dqkv, dout, qkv, out, lse, B, T, NH, NH, C / NH);
}

static void ref_gelu_forward(float *out, const float *inp, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float x = inp[i];
    float cube = ZT_GELU_CUBE * x * x * x;
    out[i] = 0.5f * x * (1.0f + tanhf(ZT_GELU_SCALE * (x + cube)));
  }
}

static void ref_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float x = inp[i];
    float cube = ZT_GELU_CUBE * x * x * x;
    float arg = ZT_GELU_SCALE * (x + cube);
    float th = tanhf(arg);
    float ch = coshf(arg);
    float sech2 = 1.0f / (ch * ch);
    float grad = 0.5f * (1.0f + th) +
                 x * 0.5f * sech2 * ZT_GELU_SCALE * (1.0f + 3.0f * ZT_GELU_CUBE * x * x);
    dinp[i] = grad * dout[i];
  }
}

static void ref_residual_forward(float *out, const float *a, const float *b, size_t n) {
  for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

static void ref_crossentropy_forward(float *losses, float *probs, const float *logits,
                                     const int *targets, int N, int V, int Vp) {
  for (int n = 0; n < N; n++) {
    const float *l = logits + (size_t)n * Vp;
    float *p = probs + (size_t)n * Vp;
    float maxv = -INFINITY;
    for (int i = 0; i < V; i++)
      if (l[i] > maxv) maxv = l[i];
    float sum = 0.0f;
    for (int i = 0; i < V; i++) {
      p[i] = expf(l[i] - maxv);
      sum += p[i];
    }
    for (int i = 0; i < V; i++) p[i] /= sum;
    for (int i = V; i < Vp; i++) p[i] = 0.0f;
    losses[n] = -logf(p[targets[n]]);
  }
}

static void ref_crossentropy_backward(float *dlogits, const float *probs, const int *targets,
                                      float dloss, int N, int V, int Vp) {
  for (int n = 0; n < N; n++) {
    const float *p = probs + (size_t)n * Vp;
    float *d = dlogits + (size_t)n * Vp;
    for (int i = 0; i < V; i++) d[i] = (p[i] - (i == targets[n] ? 1.0f : 0.0f)) * dloss;
    for (int i = V; i < Vp; i++) d[i] = 0.0f;
  }
}

static void ref_adamw(float *p, const float *g, float *m, float *v, size_t n, float lr, float b1,
                      float b2, float eps, float wd, float bc1, float bc2) {
  for (size_t i = 0; i < n; i++) {
    float mi = b1 * m[i] + (1.0f - b1) * g[i];
    float vi = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    m[i] = mi;
    v[i] = vi;
    float mhat = mi / bc1, vhat = vi / bc2;
    p[i] -= lr * wd * p[i];
    p[i] -= lr * mhat / (sqrtf(vhat) + eps);
  }
}

static double ref_sumsq(const float *x, size_t n) {
  double total = 0.0;
  for (size_t c = 0; c < n; c += ZT_KERNELS_SUMSQ_CHUNK) {
    size_t end = c + ZT_KERNELS_SUMSQ_CHUNK < n ? c + ZT_KERNELS_SUMSQ_CHUNK : n;
    double s = 0.0;
    for (size_t i = c; i < end; i++) s += (double)x[i] * x[i];
    total += s;
  }
  return total;
}

static void ref_scale(float *x, size_t n, float s) {
  for (size_t i = 0; i < n; i++) x[i] *= s;
}

static void ref_zero(float *x, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = 0.0f;
}

static void ref_acc_f64(double *acc, const float *x, size_t n) {
  for (size_t i = 0; i < n; i++) acc[i] += x[i];
}

static void ref_add_f64(double *acc, const double *y, size_t n) {
  for (size_t i = 0; i < n; i++) acc[i] += y[i];
}

static void ref_widen_f64(double *dst, const float *x, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = x[i];
}

static void ref_narrow_f64(float *dst, const double *x, size_t n, double s, float t) {
  for (size_t i = 0; i < n; i++) dst[i] = (float)(x[i] * s) * t;
}

double zt_kernels_host_sumsq_f64(const double *x, size_t n, double s) {
  double sum = 0.0;
  for (size_t i = 0; i < n; i++) {
    double v = (float)(x[i] * s);
    sum += v * v;
  }
  return sum;
}

void *zt_kernels_host_alloc(size_t bytes) { return calloc(1, bytes ? bytes : 1); }
void zt_kernels_host_release(void *p) { free(p); }
void zt_kernels_host_copy(void *dst, const void *src, size_t bytes) {
  if (bytes) memcpy(dst, src, bytes);
}
void zt_kernels_host_memzero(void *p, size_t bytes) {
  if (bytes) memset(p, 0, bytes);
}
void zt_kernels_host_narrow_x(void *dst, const float *src, size_t n) {
  zt_kernels_host_copy(dst, src, n * sizeof(float));
}
void zt_kernels_host_widen_x(float *dst, const void *src, size_t n) {
  zt_kernels_host_copy(dst, src, n * sizeof(float));
}

/* ---- LoRA ------------------------------------------------------------------ */

static void ref_lora_merge(float *w, const float *base, const float *a, const float *b, int O,
                           int IN, int R, float s) {
  for (int o = 0; o < O; o++)
    for (int i = 0; i < IN; i++) {
      float acc = 0.0f;
      for (int r = 0; r < R; r++) acc += b[(size_t)o * R + r] * a[(size_t)r * IN + i];
      w[(size_t)o * IN + i] = base[(size_t)o * IN + i] + s * acc;
    }
}

static void ref_lora_grad(float *da, float *db, const float *dw, const float *a, const float *b,
                          int O, int IN, int R, float s) {
  for (int r = 0; r < R; r++)
    for (int i = 0; i < IN; i++) {
      float acc = 0.0f;
      for (int o = 0; o < O; o++) acc += b[(size_t)o * R + r] * dw[(size_t)o * IN + i];
      da[(size_t)r * IN + i] += s * acc;
    }
  for (int o = 0; o < O; o++)
    for (int r = 0; r < R; r++) {
      float acc = 0.0f;
      for (int i = 0; i < IN; i++) acc += dw[(size_t)o * IN + i] * a[(size_t)r * IN + i];
      db[(size_t)o * R + r] += s * acc;
    }
}

static const zt_kernels_t zt_ref_table = {
    .name = "cpu-ref",
    ZT_KERNELS_ENTRIES(ref),
    .sumsq_f64 = zt_kernels_host_sumsq_f64,
    ZT_KERNELS_HOST_MEMORY,
    ZT_KERNELS_HOST_LLAMA,
    .attention_forward_gqa = ref_attention_forward_gqa,
    .attention_backward_gqa = ref_attention_backward_gqa,
    .lora_merge = ref_lora_merge,
    .lora_grad = ref_lora_grad,
};

const zt_kernels_t *zt_kernels_ref(void) { return &zt_ref_table; }
