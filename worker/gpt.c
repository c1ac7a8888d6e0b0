/*
 * gpt.c: GPT-2 forward and backward on the CPU (see gpt.h).
 *
 * The kernels follow llm.c's CPU reference (the same equations, the same
 * activation layout), with the matmuls moved to CBLAS and the remaining
 * loops parallelised over independent outputs only, so that no reduction
 * order depends on the thread schedule. Gradients of activations are
 * zeroed at the start of each backward and accumulated, like llm.c.
 */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpt.h"
#include "zt_common.h"

void openblas_set_num_threads(int);

/* ---- layout --------------------------------------------------------------------- */

int zt_gpt_config_check(zt_gpt_config *c) {
  if (c->n_layer < 1 || c->n_layer > 1024) return zt_err("model.n_layer must be 1..1024");
  if (c->n_embd < 1 || c->n_embd > 65536) return zt_err("model.n_embd must be 1..65536");
  if (c->n_head < 1 || c->n_embd % c->n_head)
    return zt_err("model.n_head (%d) must divide model.n_embd (%d)", c->n_head, c->n_embd);
  if (c->seq_len < 1 || c->seq_len > 1 << 16) return zt_err("model.seq_len must be 1..65536");
  if (c->vocab_size < 2 || c->vocab_size > 1 << 24) return zt_err("model.vocab_size must be 2..2^24");
  c->padded_vocab = (c->vocab_size + 63) / 64 * 64;
  return 0;
}

int zt_gpt_num_units(const zt_gpt_config *c) { return c->n_layer + 2; }

int zt_gpt_unit_views(const zt_gpt_config *c, int u, zt_gpt_view *v) {
  size_t C = (size_t)c->n_embd, n = 0, off = 0;
  int first, last;
  size_t sizes[ZT_GPT_NTENSORS] = {
      [ZT_GPT_WTE] = (size_t)c->padded_vocab * C, [ZT_GPT_WPE] = (size_t)c->seq_len * C,
      [ZT_GPT_LN1W] = C, [ZT_GPT_LN1B] = C, [ZT_GPT_QKVW] = 3 * C * C, [ZT_GPT_QKVB] = 3 * C,
      [ZT_GPT_ATTPROJW] = C * C, [ZT_GPT_ATTPROJB] = C, [ZT_GPT_LN2W] = C, [ZT_GPT_LN2B] = C,
      [ZT_GPT_FCW] = 4 * C * C, [ZT_GPT_FCB] = 4 * C, [ZT_GPT_FCPROJW] = 4 * C * C,
      [ZT_GPT_FCPROJB] = C, [ZT_GPT_LNFW] = C, [ZT_GPT_LNFB] = C};
  if (u == 0) first = ZT_GPT_WTE, last = ZT_GPT_WPE;
  else if (u <= c->n_layer) first = ZT_GPT_LN1W, last = ZT_GPT_FCPROJB;
  else first = ZT_GPT_LNFW, last = ZT_GPT_LNFB;
  for (int t = first; t <= last; t++) {
    int decay = t == ZT_GPT_WTE || t == ZT_GPT_WPE || t == ZT_GPT_QKVW || t == ZT_GPT_ATTPROJW ||
                t == ZT_GPT_FCW || t == ZT_GPT_FCPROJW;
    v[n++] = (zt_gpt_view){t, off, sizes[t], decay};
    off += sizes[t];
  }
  return (int)n;
}

size_t zt_gpt_unit_size(const zt_gpt_config *c, int u) {
  zt_gpt_view v[ZT_GPT_NTENSORS];
  int n = zt_gpt_unit_views(c, u, v);
  return v[n - 1].off + v[n - 1].n;
}

size_t zt_gpt_num_params_padded(const zt_gpt_config *c) {
  size_t n = 0;
  for (int u = 0; u < zt_gpt_num_units(c); u++) n += zt_gpt_unit_size(c, u);
  return n;
}

size_t zt_gpt_num_params(const zt_gpt_config *c) {
  return zt_gpt_num_params_padded(c) - (size_t)(c->padded_vocab - c->vocab_size) * c->n_embd;
}

/* ---- init ------------------------------------------------------------------------- */

typedef struct {
  uint64_t s;
} rng_t;

static uint64_t splitmix(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Standard normal by Box-Muller from two uniforms. */
static float normal(uint64_t *x) {
  double u1 = ((splitmix(x) >> 11) + 1.0) / 9007199254740993.0;
  double u2 = (splitmix(x) >> 11) / 9007199254740992.0;
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

void zt_gpt_init_unit(const zt_gpt_config *c, int u, uint64_t seed, float *dst) {
  zt_gpt_view v[ZT_GPT_NTENSORS];
  int n = zt_gpt_unit_views(c, u, v);
  float resid_std = 0.02f / sqrtf(2.0f * (float)c->n_layer);
  for (int i = 0; i < n; i++) {
    float *p = dst + v[i].off;
    int t = v[i].tensor;
    /* Each tensor has its own stream: (seed, unit, tensor). */
    uint64_t x = seed * 0x100000001b3ull ^ ((uint64_t)u << 20) ^ (uint64_t)t;
    splitmix(&x);
    if (t == ZT_GPT_LN1W || t == ZT_GPT_LN2W || t == ZT_GPT_LNFW) {
      for (size_t k = 0; k < v[i].n; k++) p[k] = 1.0f;
    } else if (!v[i].decay) {
      memset(p, 0, v[i].n * sizeof *p); /* biases, LayerNorm biases */
    } else {
      float std = (t == ZT_GPT_ATTPROJW || t == ZT_GPT_FCPROJW) ? resid_std : 0.02f;
      for (size_t k = 0; k < v[i].n; k++) p[k] = std * normal(&x);
      if (t == ZT_GPT_WTE) /* padded vocabulary rows stay zero */
        memset(p + (size_t)c->vocab_size * c->n_embd, 0,
               (size_t)(c->padded_vocab - c->vocab_size) * c->n_embd * sizeof *p);
    }
  }
}

/* ---- activations ------------------------------------------------------------------ */

/* Offsets of the activation tensors for (B, T); per-layer tensors are
 * [L][...]. Same set for activations and their gradients. */
enum {
  A_ENCODED, A_LN1, A_LN1_MEAN, A_LN1_RSTD, A_QKV, A_ATTY, A_ATT, A_ATTPROJ, A_RES2, A_LN2,
  A_LN2_MEAN, A_LN2_RSTD, A_FCH, A_FCH_GELU, A_FCPROJ, A_RES3, A_LNF, A_LNF_MEAN, A_LNF_RSTD,
  A_LOGITS, A_PROBS, A_LOSSES, A_COUNT
};

static void act_sizes(const zt_gpt_config *c, int B, int T, size_t *sz) {
  size_t L = (size_t)c->n_layer, C = (size_t)c->n_embd, NH = (size_t)c->n_head, BT = (size_t)B * T;
  size_t Vp = (size_t)c->padded_vocab;
  size_t s[A_COUNT] = {BT * C,      L * BT * C,     L * BT,     L * BT,     L * BT * 3 * C,
                       L * BT * C,  L * B * NH * T * T, L * BT * C, L * BT * C, L * BT * C,
                       L * BT,      L * BT,         L * BT * 4 * C, L * BT * 4 * C, L * BT * C,
                       L * BT * C,  BT * C,         BT,         BT,         BT * Vp,
                       BT * Vp,     BT};
  memcpy(sz, s, sizeof s);
}

typedef struct {
  float *t[A_COUNT];
} act_ptrs;

static act_ptrs act_layout(const zt_gpt_t *m, float *base) {
  size_t sz[A_COUNT];
  act_sizes(&m->cfg, m->cur_B, m->cur_T, sz);
  act_ptrs a;
  for (int i = 0; i < A_COUNT; i++) {
    a.t[i] = base;
    base += sz[i];
  }
  return a;
}

int zt_gpt_create(const zt_gpt_config *cfg, int B, int T, zt_gpt_t **out) {
  zt_gpt_config c = *cfg;
  if (zt_gpt_config_check(&c) != 0) return -1;
  if (B < 1 || T < 1 || T > c.seq_len)
    return zt_err("micro batch %d x %d does not fit the model (seq_len %d)", B, T, c.seq_len);
  zt_gpt_t *m = calloc(1, sizeof *m);
  if (!m) return zt_err("out of memory");
  m->cfg = c;
  m->n_units = zt_gpt_num_units(&c);
  m->unit_size = calloc((size_t)m->n_units, sizeof *m->unit_size);
  m->unit_params = calloc((size_t)m->n_units, sizeof *m->unit_params);
  m->unit_grads = calloc((size_t)m->n_units, sizeof *m->unit_grads);
  for (int u = 0; u < m->n_units; u++) m->unit_size[u] = zt_gpt_unit_size(&c, u);
  m->B = B, m->T = T;
  size_t sz[A_COUNT];
  act_sizes(&c, B, T, sz);
  for (int i = 0; i < A_COUNT; i++) m->acts_n += sz[i];
  m->acts = malloc(m->acts_n * sizeof(float));
  m->grad_acts = malloc(m->acts_n * sizeof(float));
  if (!m->unit_size || !m->unit_params || !m->unit_grads || !m->acts || !m->grad_acts) {
    size_t n = m->acts_n;
    zt_gpt_free(m);
    return zt_err("out of memory for activations (%zu floats)", n);
  }
  *out = m;
  return 0;
}

void zt_gpt_free(zt_gpt_t *m) {
  if (!m) return;
  free(m->unit_size);
  free(m->unit_params);
  free(m->unit_grads);
  free(m->acts);
  free(m->grad_acts);
  free(m);
}

void zt_gpt_set_threads(int n) {
  if (n <= 0) return;
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

/* ---- kernels ----------------------------------------------------------------------- */

static void encoder_forward(float *out, const int *inp, const float *wte, const float *wpe, int B,
                            int T, int C) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      float *o = out + ((size_t)b * T + t) * C;
      const float *we = wte + (size_t)inp[b * T + t] * C, *pe = wpe + (size_t)t * C;
      for (int i = 0; i < C; i++) o[i] = we[i] + pe[i];
    }
}

static void encoder_backward(float *dwte, float *dwpe, const float *dout, const int *inp, int B,
                             int T, int C) {
  /* Serial over tokens (rows of dwte may repeat), parallel over channels. */
#pragma omp parallel for schedule(static)
  for (int i = 0; i < C; i++)
    for (int b = 0; b < B; b++)
      for (int t = 0; t < T; t++) {
        float d = dout[((size_t)b * T + t) * C + i];
        dwte[(size_t)inp[b * T + t] * C + i] += d;
        dwpe[(size_t)t * C + i] += d;
      }
}

static void layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                              const float *w, const float *bias, int N, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const float *x = inp + (size_t)n * C;
    float m = 0, v = 0;
    for (int i = 0; i < C; i++) m += x[i];
    m /= C;
    for (int i = 0; i < C; i++) v += (x[i] - m) * (x[i] - m);
    v /= C;
    float s = 1.0f / sqrtf(v + 1e-5f);
    float *o = out + (size_t)n * C;
    for (int i = 0; i < C; i++) o[i] = (x[i] - m) * s * w[i] + bias[i];
    mean[n] = m, rstd[n] = s;
  }
}

static void layernorm_backward(float *dinp, float *dw, float *db, const float *dout,
                               const float *inp, const float *w, const float *mean,
                               const float *rstd, int N, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const float *d = dout + (size_t)n * C, *x = inp + (size_t)n * C;
    float m = mean[n], s = rstd[n], dnm = 0, dnn = 0;
    for (int i = 0; i < C; i++) {
      float norm = (x[i] - m) * s, dn = w[i] * d[i];
      dnm += dn, dnn += dn * norm;
    }
    dnm /= C, dnn /= C;
    float *di = dinp + (size_t)n * C;
    for (int i = 0; i < C; i++) {
      float norm = (x[i] - m) * s, dn = w[i] * d[i];
      di[i] += (dn - dnm - norm * dnn) * s;
    }
  }
#pragma omp parallel for schedule(static)
  for (int i = 0; i < C; i++) {
    float gw = 0, gb = 0;
    for (int n = 0; n < N; n++) {
      float d = dout[(size_t)n * C + i];
      gw += (inp[(size_t)n * C + i] - mean[n]) * rstd[n] * d;
      gb += d;
    }
    dw[i] += gw, db[i] += gb;
  }
}

/* out[N,OC] = inp[N,IC] W[OC,IC]^T + bias */
static void matmul_forward(float *out, const float *inp, const float *w, const float *bias, int N,
                           int IC, int OC) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, IC, 1.0f, inp, IC, w, IC, 0.0f, out,
              OC);
  if (!bias) return;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++)
    for (int o = 0; o < OC; o++) out[(size_t)n * OC + o] += bias[o];
}

static void matmul_backward(float *dinp, float *dw, float *db, const float *dout, const float *inp,
                            const float *w, int N, int IC, int OC) {
  if (dinp)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, IC, OC, 1.0f, dout, OC, w, IC, 1.0f,
                dinp, IC);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, IC, N, 1.0f, dout, OC, inp, IC, 1.0f, dw,
              IC);
  if (!db) return;
#pragma omp parallel for schedule(static)
  for (int o = 0; o < OC; o++) {
    float s = 0;
    for (int n = 0; n < N; n++) s += dout[(size_t)n * OC + o];
    db[o] += s;
  }
}

static void attention_forward(float *out, float *att, const float *qkv, int B, int T, int C,
                              int NH) {
  int hs = C / NH;
  float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for collapse(3) schedule(static)
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++)
      for (int h = 0; h < NH; h++) {
        const float *q = qkv + ((size_t)b * T + t) * 3 * C + h * hs;
        float *a = att + (((size_t)b * NH + h) * T + t) * T;
        float maxv = -1e30f;
        for (int t2 = 0; t2 <= t; t2++) {
          const float *k = qkv + ((size_t)b * T + t2) * 3 * C + C + h * hs;
          float v = 0;
          for (int i = 0; i < hs; i++) v += q[i] * k[i];
          v *= scale;
          a[t2] = v;
          if (v > maxv) maxv = v;
        }
        float sum = 0;
        for (int t2 = 0; t2 <= t; t2++) {
          float e = expf(a[t2] - maxv);
          a[t2] = e;
          sum += e;
        }
        float inv = 1.0f / sum;
        for (int t2 = 0; t2 < T; t2++) a[t2] = t2 <= t ? a[t2] * inv : 0.0f;
        float *o = out + ((size_t)b * T + t) * C + h * hs;
        for (int i = 0; i < hs; i++) o[i] = 0;
        for (int t2 = 0; t2 <= t; t2++) {
          const float *v = qkv + ((size_t)b * T + t2) * 3 * C + 2 * C + h * hs;
          for (int i = 0; i < hs; i++) o[i] += a[t2] * v[i];
        }
      }
}

/* Parallel over (b, h); each task owns its slice of dqkv, so no two
 * threads ever write the same element. */
static void attention_backward(float *dqkv, float *datt_scratch, const float *dout,
                               const float *qkv, const float *att, int B, int T, int C, int NH) {
  int hs = C / NH;
  float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      float *datt = datt_scratch + ((size_t)b * NH + h) * T; /* one row of T */
      for (int t = 0; t < T; t++) {
        const float *a = att + (((size_t)b * NH + h) * T + t) * T;
        const float *dy = dout + ((size_t)b * T + t) * C + h * hs;
        const float *q = qkv + ((size_t)b * T + t) * 3 * C + h * hs;
        float *dq = dqkv + ((size_t)b * T + t) * 3 * C + h * hs;
        /* out = sum a * v */
        for (int t2 = 0; t2 <= t; t2++) {
          const float *v = qkv + ((size_t)b * T + t2) * 3 * C + 2 * C + h * hs;
          float *dv = dqkv + ((size_t)b * T + t2) * 3 * C + 2 * C + h * hs;
          float s = 0;
          for (int i = 0; i < hs; i++) {
            s += v[i] * dy[i];
            dv[i] += a[t2] * dy[i];
          }
          datt[t2] = s;
        }
        /* softmax backward */
        float dot = 0;
        for (int t2 = 0; t2 <= t; t2++) dot += a[t2] * datt[t2];
        for (int t2 = 0; t2 <= t; t2++) {
          float dpre = a[t2] * (datt[t2] - dot) * scale;
          const float *k = qkv + ((size_t)b * T + t2) * 3 * C + C + h * hs;
          float *dk = dqkv + ((size_t)b * T + t2) * 3 * C + C + h * hs;
          for (int i = 0; i < hs; i++) {
            dq[i] += k[i] * dpre;
            dk[i] += q[i] * dpre;
          }
        }
      }
    }
}

#define GELU_S 0.7978845608028654f /* sqrt(2/pi) */

static void gelu_forward(float *out, const float *inp, size_t n) {
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) {
    float x = inp[i];
    out[i] = 0.5f * x * (1.0f + tanhf(GELU_S * (x + 0.044715f * x * x * x)));
  }
}

static void gelu_backward(float *dinp, const float *inp, const float *dout, size_t n) {
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) {
    float x = inp[i], cube = 0.044715f * x * x * x;
    float th = tanhf(GELU_S * (x + cube));
    float sech2 = 1.0f - th * th;
    float g = 0.5f * (1.0f + th) + x * 0.5f * sech2 * GELU_S * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] += g * dout[i];
  }
}

static void residual_forward(float *out, const float *a, const float *b, size_t n) {
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

static void residual_backward(float *da, float *db, const float *dout, size_t n) {
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) da[i] += dout[i], db[i] += dout[i];
}

static void softmax_xent_forward(float *losses, float *probs, const float *logits,
                                 const int *targets, int N, int V, int Vp) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const float *l = logits + (size_t)n * Vp;
    float *p = probs + (size_t)n * Vp, maxv = -1e30f;
    for (int i = 0; i < V; i++) maxv = l[i] > maxv ? l[i] : maxv;
    double sum = 0;
    for (int i = 0; i < V; i++) {
      p[i] = expf(l[i] - maxv);
      sum += p[i];
    }
    float inv = (float)(1.0 / sum);
    for (int i = 0; i < V; i++) p[i] *= inv;
    for (int i = V; i < Vp; i++) p[i] = 0;
    if (targets) losses[n] = -logf(p[targets[n]] > 1e-30f ? p[targets[n]] : 1e-30f);
  }
}

static void softmax_xent_backward(float *dlogits, const float *probs, const int *targets,
                                  float dloss, int N, int V, int Vp) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    float *d = dlogits + (size_t)n * Vp;
    const float *p = probs + (size_t)n * Vp;
    for (int i = 0; i < V; i++) d[i] += (p[i] - (i == targets[n] ? 1.0f : 0.0f)) * dloss;
  }
}

/* ---- forward / backward --------------------------------------------------------------- */

#define HOOK(m, name, u)                                          \
  do {                                                            \
    if ((m)->hooks.name) (m)->hooks.name((m)->hooks.ctx, (u));    \
  } while (0)

/* Pointers to block l's tensors in its unit buffer. */
typedef struct {
  float *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb, *ln2w, *ln2b, *fcw, *fcb, *fcprojw,
      *fcprojb;
} block_ptrs;

static block_ptrs block_of(const zt_gpt_config *c, float *base) {
  zt_gpt_view v[ZT_GPT_NTENSORS];
  zt_gpt_unit_views(c, 1, v);
  block_ptrs p;
  float **f = (float **)&p;
  for (int i = 0; i < 12; i++) f[i] = base + v[i].off;
  return p;
}

float zt_gpt_forward(zt_gpt_t *m, const int *inputs, const int *targets, int B, int T) {
  const zt_gpt_config *c = &m->cfg;
  int C = c->n_embd, NH = c->n_head, L = c->n_layer, V = c->vocab_size, Vp = c->padded_vocab;
  size_t BT = (size_t)B * T;
  m->cur_B = B, m->cur_T = T, m->cur_targets = targets, m->cur_inputs = inputs;
  act_ptrs a = act_layout(m, m->acts);
  HOOK(m, pre_forward, 0);
  float *wte = m->unit_params[0], *wpe = wte + (size_t)Vp * C;
  encoder_forward(a.t[A_ENCODED], inputs, wte, wpe, B, T, C);
  for (int l = 0; l < L; l++) {
    HOOK(m, pre_forward, 1 + l);
    block_ptrs p = block_of(c, m->unit_params[1 + l]);
    float *res = l == 0 ? a.t[A_ENCODED] : a.t[A_RES3] + (size_t)(l - 1) * BT * C;
    float *ln1 = a.t[A_LN1] + l * BT * C, *qkv = a.t[A_QKV] + l * BT * 3 * C;
    float *atty = a.t[A_ATTY] + l * BT * C, *att = a.t[A_ATT] + (size_t)l * B * NH * T * T;
    float *attproj = a.t[A_ATTPROJ] + l * BT * C, *res2 = a.t[A_RES2] + l * BT * C;
    float *ln2 = a.t[A_LN2] + l * BT * C, *fch = a.t[A_FCH] + l * BT * 4 * C;
    float *fchg = a.t[A_FCH_GELU] + l * BT * 4 * C, *fcproj = a.t[A_FCPROJ] + l * BT * C;
    float *res3 = a.t[A_RES3] + l * BT * C;
    layernorm_forward(ln1, a.t[A_LN1_MEAN] + l * BT, a.t[A_LN1_RSTD] + l * BT, res, p.ln1w, p.ln1b,
                      (int)BT, C);
    matmul_forward(qkv, ln1, p.qkvw, p.qkvb, (int)BT, C, 3 * C);
    attention_forward(atty, att, qkv, B, T, C, NH);
    matmul_forward(attproj, atty, p.attprojw, p.attprojb, (int)BT, C, C);
    residual_forward(res2, res, attproj, BT * C);
    layernorm_forward(ln2, a.t[A_LN2_MEAN] + l * BT, a.t[A_LN2_RSTD] + l * BT, res2, p.ln2w,
                      p.ln2b, (int)BT, C);
    matmul_forward(fch, ln2, p.fcw, p.fcb, (int)BT, C, 4 * C);
    gelu_forward(fchg, fch, BT * 4 * C);
    matmul_forward(fcproj, fchg, p.fcprojw, p.fcprojb, (int)BT, 4 * C, C);
    residual_forward(res3, res2, fcproj, BT * C);
    HOOK(m, post_forward, 1 + l);
  }
  HOOK(m, pre_forward, L + 1);
  float *lnfw = m->unit_params[L + 1], *lnfb = lnfw + C;
  float *last = a.t[A_RES3] + (size_t)(L - 1) * BT * C;
  layernorm_forward(a.t[A_LNF], a.t[A_LNF_MEAN], a.t[A_LNF_RSTD], last, lnfw, lnfb, (int)BT, C);
  HOOK(m, post_forward, L + 1);
  matmul_forward(a.t[A_LOGITS], a.t[A_LNF], wte, NULL, (int)BT, C, Vp);
  HOOK(m, post_forward, 0);
  softmax_xent_forward(a.t[A_LOSSES], a.t[A_PROBS], a.t[A_LOGITS], targets, (int)BT, V, Vp);
  if (!targets) return 0;
  double sum = 0;
  for (size_t i = 0; i < BT; i++) sum += a.t[A_LOSSES][i];
  return (float)(sum / (double)BT);
}

void zt_gpt_backward(zt_gpt_t *m, float scale) {
  const zt_gpt_config *c = &m->cfg;
  int B = m->cur_B, T = m->cur_T;
  int C = c->n_embd, NH = c->n_head, L = c->n_layer, V = c->vocab_size, Vp = c->padded_vocab;
  size_t BT = (size_t)B * T;
  act_ptrs a = act_layout(m, m->acts), g = act_layout(m, m->grad_acts);
  size_t sz[A_COUNT], total = 0;
  act_sizes(c, B, T, sz);
  for (int i = 0; i < A_COUNT; i++) total += sz[i];
  memset(m->grad_acts, 0, total * sizeof(float));

  HOOK(m, pre_backward, 0);
  float *wte = m->unit_params[0], *dwte = m->unit_grads[0];
  float *dwpe = dwte + (size_t)Vp * C;
  softmax_xent_backward(g.t[A_LOGITS], a.t[A_PROBS], m->cur_targets, scale / (float)BT, (int)BT, V,
                        Vp);
  matmul_backward(g.t[A_LNF], dwte, NULL, g.t[A_LOGITS], a.t[A_LNF], wte, (int)BT, C, Vp);

  HOOK(m, pre_backward, L + 1);
  float *lnfw = m->unit_params[L + 1], *dlnfw = m->unit_grads[L + 1];
  float *last = a.t[A_RES3] + (size_t)(L - 1) * BT * C;
  float *dlast = g.t[A_RES3] + (size_t)(L - 1) * BT * C;
  layernorm_backward(dlast, dlnfw, dlnfw + C, g.t[A_LNF], last, lnfw, a.t[A_LNF_MEAN],
                     a.t[A_LNF_RSTD], (int)BT, C);
  HOOK(m, post_backward, L + 1);

  for (int l = L - 1; l >= 0; l--) {
    HOOK(m, pre_backward, 1 + l);
    block_ptrs p = block_of(c, m->unit_params[1 + l]);
    block_ptrs d = block_of(c, m->unit_grads[1 + l]);
    float *res = l == 0 ? a.t[A_ENCODED] : a.t[A_RES3] + (size_t)(l - 1) * BT * C;
    float *dres = l == 0 ? g.t[A_ENCODED] : g.t[A_RES3] + (size_t)(l - 1) * BT * C;
#define AT(k, w) (a.t[k] + (size_t)l * BT * (w))
#define GT(k, w) (g.t[k] + (size_t)l * BT * (w))
    float *datt = g.t[A_ATT] + (size_t)l * B * NH * T * T; /* scratch rows */
    residual_backward(GT(A_RES2, C), GT(A_FCPROJ, C), GT(A_RES3, C), BT * C);
    matmul_backward(GT(A_FCH_GELU, 4 * C), d.fcprojw, d.fcprojb, GT(A_FCPROJ, C),
                    AT(A_FCH_GELU, 4 * C), p.fcprojw, (int)BT, 4 * C, C);
    gelu_backward(GT(A_FCH, 4 * C), AT(A_FCH, 4 * C), GT(A_FCH_GELU, 4 * C), BT * 4 * C);
    matmul_backward(GT(A_LN2, C), d.fcw, d.fcb, GT(A_FCH, 4 * C), AT(A_LN2, C), p.fcw, (int)BT, C,
                    4 * C);
    layernorm_backward(GT(A_RES2, C), d.ln2w, d.ln2b, GT(A_LN2, C), AT(A_RES2, C), p.ln2w,
                       a.t[A_LN2_MEAN] + l * BT, a.t[A_LN2_RSTD] + l * BT, (int)BT, C);
    residual_backward(dres, GT(A_ATTPROJ, C), GT(A_RES2, C), BT * C);
    matmul_backward(GT(A_ATTY, C), d.attprojw, d.attprojb, GT(A_ATTPROJ, C), AT(A_ATTY, C),
                    p.attprojw, (int)BT, C, C);
    attention_backward(GT(A_QKV, 3 * C), datt, GT(A_ATTY, C), AT(A_QKV, 3 * C),
                       a.t[A_ATT] + (size_t)l * B * NH * T * T, B, T, C, NH);
    matmul_backward(GT(A_LN1, C), d.qkvw, d.qkvb, GT(A_QKV, 3 * C), AT(A_LN1, C), p.qkvw, (int)BT,
                    C, 3 * C);
    layernorm_backward(dres, d.ln1w, d.ln1b, GT(A_LN1, C), res, p.ln1w, a.t[A_LN1_MEAN] + l * BT,
                       a.t[A_LN1_RSTD] + l * BT, (int)BT, C);
#undef AT
#undef GT
    HOOK(m, post_backward, 1 + l);
  }
  encoder_backward(dwte, dwpe, g.t[A_ENCODED], m->cur_inputs, B, T, C);
  HOOK(m, post_backward, 0);
}
