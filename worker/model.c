/*
 * model.c: the GPT-2 model: layout, initialisation, forward and backward.
 *
 * See model.h for the parameter layout, the unit pointers that make ZeRO
 * sharding possible, and the hook order. This file holds three things:
 *
 *   - the layout: the table of named tensors (zt_tensor_t), built once at
 *     create time from the configuration; a block's tensors sit at the same
 *     offsets within every block unit (block_views);
 *   - the activations (struct zt_acts), sized at create time for the largest
 *     batch, with one set per layer of what the backward needs and a few
 *     scratch buffers for gradients that are reused layer after layer;
 *   - forward and backward, which are straight sequences of kernel calls.
 *
 * Backward keeps one running gradient of the residual stream (dres). For
 * block l, with x its input, the forward was
 *     res2 = x + attn(ln1(x)),   res3 = res2 + mlp(ln2(res2))
 * so going backward dres first holds d res3, gains the ln2 path and becomes
 * d res2, then gains the ln1 path and becomes d x. layernorm_backward
 * accumulates into its input gradient, which is exactly this sum.
 */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rng.h"
#include "zt_common.h"

/* Number of tensors in a block unit. */
#define ZT_BLOCK_TENSORS 12

struct zt_acts {
  int B, T;            /* shape of the last forward */
  int have_targets;    /* the last forward computed the loss */
  int *inputs;         /* [B, T] copies of the last batch */
  int *targets;
  float *host_losses;  /* [B, T] host copy of the per-token losses */
  float *encoded;      /* [B, T, C] */
  /* Per layer, each [L, ...] with a stride of the capacity. */
  float *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *att, *res2;
  float *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu, *res3;
  float *lnf, *lnf_mean, *lnf_rstd;
  float *logits;       /* [B, T, Vp]; probabilities after a forward with targets */
  float *losses;       /* [B, T] */
  /* Backward scratch, reused by every layer. */
  float *dres, *dbtc, *dqkv, *dfch;
  float *proj;         /* forward scratch for the attention / MLP projections */
  size_t bytes;        /* total activation memory */
};

/* Pointers to one block's tensors, from the unit's base pointer. */
typedef struct zt_block {
  float *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb;
  float *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
} zt_block_t;

static const struct {
  const char *name; /* after "h.<l>." */
  zt_tensor_kind_t kind;
  int rows, cols; /* in units of C */
  int decay;
} zt_block_spec[ZT_BLOCK_TENSORS] = {
    {"ln_1.weight", ZT_T_LN1W, 0, 1, 0},        {"ln_1.bias", ZT_T_LN1B, 0, 1, 0},
    {"attn.c_attn.weight", ZT_T_QKVW, 3, 1, 1}, {"attn.c_attn.bias", ZT_T_QKVB, 0, 3, 0},
    {"attn.c_proj.weight", ZT_T_ATTPROJW, 1, 1, 1}, {"attn.c_proj.bias", ZT_T_ATTPROJB, 0, 1, 0},
    {"ln_2.weight", ZT_T_LN2W, 0, 1, 0},        {"ln_2.bias", ZT_T_LN2B, 0, 1, 0},
    {"mlp.c_fc.weight", ZT_T_FCW, 4, 1, 1},     {"mlp.c_fc.bias", ZT_T_FCB, 0, 4, 0},
    {"mlp.c_proj.weight", ZT_T_FCPROJW, 1, 4, 1}, {"mlp.c_proj.bias", ZT_T_FCPROJB, 0, 1, 0},
};

static void block_views(float *base, int C, zt_block_t *b) {
  float **dst[ZT_BLOCK_TENSORS] = {&b->ln1w, &b->ln1b, &b->qkvw, &b->qkvb, &b->attprojw,
                                   &b->attprojb, &b->ln2w, &b->ln2b, &b->fcw, &b->fcb,
                                   &b->fcprojw, &b->fcprojb};
  size_t off = 0;
  for (int i = 0; i < ZT_BLOCK_TENSORS; i++) {
    int rows = zt_block_spec[i].rows ? zt_block_spec[i].rows * C : 1;
    size_t n = (size_t)rows * zt_block_spec[i].cols * C;
    *dst[i] = base ? base + off : NULL;
    off += n;
  }
}

/* ---- configuration and layout -------------------------------------------- */

int zt_model_config_check(const zt_model_config_t *c) {
  if (c->n_layer < 1) return zt_err("n_layer must be >= 1 (got %d)", c->n_layer);
  if (c->n_head < 1) return zt_err("n_head must be >= 1 (got %d)", c->n_head);
  if (c->n_embd < 1) return zt_err("n_embd must be >= 1 (got %d)", c->n_embd);
  if (c->n_embd % c->n_head != 0)
    return zt_err("n_embd (%d) must be divisible by n_head (%d)", c->n_embd, c->n_head);
  if (c->seq_len < 1) return zt_err("seq_len must be >= 1 (got %d)", c->seq_len);
  if (c->vocab_size < 2 || c->vocab_size > 65536)
    return zt_err("vocab_size must be in [2, 65536] (got %d)", c->vocab_size);
  return 0;
}

static int zt_pad_vocab(int V) { return (V + 63) / 64 * 64; }

size_t zt_model_param_count(const zt_model_config_t *c, int padded) {
  size_t C = (size_t)c->n_embd, L = (size_t)c->n_layer;
  size_t V = (size_t)(padded ? zt_pad_vocab(c->vocab_size) : c->vocab_size);
  return V * C + (size_t)c->seq_len * C + L * (12 * C * C + 13 * C) + 2 * C;
}

static void add_tensor(zt_model_t *m, const char *name, zt_tensor_kind_t kind, int unit,
                       int layer, size_t *unit_off, int rows, int cols, size_t n, int decay) {
  zt_tensor_t *t = &m->tensors[m->num_tensors++];
  snprintf(t->name, sizeof t->name, "%s", name);
  t->kind = kind;
  t->unit = unit;
  t->layer = layer;
  t->unit_off = *unit_off;
  t->off = m->unit_off[unit] + *unit_off;
  t->n = n;
  t->rows = rows;
  t->cols = cols;
  t->decay = decay;
  *unit_off += n;
}

/* Fills unit_off, unit_size and the tensor table. */
static int build_layout(zt_model_t *m) {
  int C = m->cfg.n_embd, L = m->cfg.n_layer;
  m->num_units = L + 2;
  m->unit_off = calloc((size_t)m->num_units, sizeof(size_t));
  m->unit_size = calloc((size_t)m->num_units, sizeof(size_t));
  m->tensors = calloc((size_t)(2 + L * ZT_BLOCK_TENSORS + 2), sizeof(zt_tensor_t));
  if (!m->unit_off || !m->unit_size || !m->tensors) return zt_err("out of memory");

  size_t off = 0, uo = 0;
  char name[48];
  /* Unit 0: embeddings. */
  add_tensor(m, "wte", ZT_T_WTE, 0, -1, &uo, m->Vp, C, (size_t)m->Vp * C, 1);
  add_tensor(m, "wpe", ZT_T_WPE, 0, -1, &uo, m->cfg.seq_len, C, (size_t)m->cfg.seq_len * C, 1);
  m->unit_size[0] = uo;
  off += uo;
  /* Units 1..L: blocks. */
  for (int l = 0; l < L; l++) {
    int u = 1 + l;
    m->unit_off[u] = off;
    uo = 0;
    for (int i = 0; i < ZT_BLOCK_TENSORS; i++) {
      int rows = zt_block_spec[i].rows ? zt_block_spec[i].rows * C : 1;
      int cols = zt_block_spec[i].cols * C;
      snprintf(name, sizeof name, "h.%d.%s", l, zt_block_spec[i].name);
      add_tensor(m, name, zt_block_spec[i].kind, u, l, &uo, rows, cols, (size_t)rows * cols,
                 zt_block_spec[i].decay);
    }
    m->unit_size[u] = uo;
    off += uo;
  }
  /* Unit L+1: final LayerNorm. */
  int u = L + 1;
  m->unit_off[u] = off;
  uo = 0;
  add_tensor(m, "ln_f.weight", ZT_T_LNFW, u, -1, &uo, 1, C, (size_t)C, 0);
  add_tensor(m, "ln_f.bias", ZT_T_LNFB, u, -1, &uo, 1, C, (size_t)C, 0);
  m->unit_size[u] = uo;
  m->num_params = off + uo;
  return 0;
}

/* ---- activations ---------------------------------------------------------- */

/* Activations live in the kernel table's memory (device memory for CUDA). */
static float *acts_alloc(const zt_kernels_t *k, struct zt_acts *a, size_t n) {
  a->bytes += n * sizeof(float);
  return k->alloc(n * sizeof(float));
}

static int acts_create(zt_model_t *m) {
  struct zt_acts *a = calloc(1, sizeof *a);
  if (!a) return zt_err("out of memory");
  m->acts = a;
  const zt_kernels_t *k = m->k;
  size_t B = (size_t)m->max_B, T = (size_t)m->max_T, C = (size_t)m->cfg.n_embd;
  size_t L = (size_t)m->cfg.n_layer, NH = (size_t)m->cfg.n_head, BT = B * T;
  a->inputs = k->alloc(BT * sizeof(int));
  a->targets = k->alloc(BT * sizeof(int));
  a->host_losses = malloc(BT * sizeof(float));
  a->encoded = acts_alloc(k, a, BT * C);
  a->ln1 = acts_alloc(k, a, L * BT * C);
  a->ln1_mean = acts_alloc(k, a, L * BT);
  a->ln1_rstd = acts_alloc(k, a, L * BT);
  a->qkv = acts_alloc(k, a, L * BT * 3 * C);
  a->atty = acts_alloc(k, a, L * BT * C);
  a->att = acts_alloc(k, a, L * B * NH * T * T);
  a->res2 = acts_alloc(k, a, L * BT * C);
  a->ln2 = acts_alloc(k, a, L * BT * C);
  a->ln2_mean = acts_alloc(k, a, L * BT);
  a->ln2_rstd = acts_alloc(k, a, L * BT);
  a->fch = acts_alloc(k, a, L * BT * 4 * C);
  a->fch_gelu = acts_alloc(k, a, L * BT * 4 * C);
  a->res3 = acts_alloc(k, a, L * BT * C);
  a->lnf = acts_alloc(k, a, BT * C);
  a->lnf_mean = acts_alloc(k, a, BT);
  a->lnf_rstd = acts_alloc(k, a, BT);
  a->logits = acts_alloc(k, a, BT * (size_t)m->Vp);
  a->losses = acts_alloc(k, a, BT);
  a->dres = acts_alloc(k, a, BT * C);
  a->dbtc = acts_alloc(k, a, BT * C);
  a->dqkv = acts_alloc(k, a, BT * 3 * C);
  a->dfch = acts_alloc(k, a, BT * 4 * C);
  a->proj = acts_alloc(k, a, BT * C);
  float *all[] = {a->encoded, a->ln1,     a->ln1_mean, a->ln1_rstd, a->qkv,  a->atty,
                  a->att,     a->res2,    a->ln2,      a->ln2_mean, a->ln2_rstd, a->fch,
                  a->fch_gelu, a->res3,   a->lnf,      a->lnf_mean, a->lnf_rstd, a->logits,
                  a->losses,  a->dres,    a->dbtc,     a->dqkv,     a->dfch,  a->proj};
  for (size_t i = 0; i < ZT_ARRAY_LEN(all); i++)
    if (!all[i]) return zt_err("out of memory for activations (%zu bytes)", a->bytes);
  if (!a->inputs || !a->targets || !a->host_losses) return zt_err("out of memory");
  return 0;
}

static void acts_free(const zt_kernels_t *k, struct zt_acts *a) {
  if (!a) return;
  float *all[] = {a->encoded, a->ln1,     a->ln1_mean, a->ln1_rstd, a->qkv,  a->atty,
                  a->att,     a->res2,    a->ln2,      a->ln2_mean, a->ln2_rstd, a->fch,
                  a->fch_gelu, a->res3,   a->lnf,      a->lnf_mean, a->lnf_rstd, a->logits,
                  a->losses,  a->dres,    a->dbtc,     a->dqkv,     a->dfch,  a->proj};
  for (size_t i = 0; i < ZT_ARRAY_LEN(all); i++) k->release(all[i]);
  k->release(a->inputs);
  k->release(a->targets);
  free(a->host_losses);
  free(a);
}

size_t zt_model_activation_bytes(const zt_model_t *m) { return m->acts ? m->acts->bytes : 0; }

/* ---- create / free -------------------------------------------------------- */

/* A flat buffer of every unit in table memory, with the unit pointers
 * pointing into it. */
static int alloc_flat(zt_model_t *m, float **flat, float **units, const char *what) {
  *flat = m->k->alloc(m->num_params * sizeof(float));
  if (!*flat) return zt_err("out of memory for %zu %s", m->num_params, what);
  for (int u = 0; u < m->num_units; u++) units[u] = *flat + m->unit_off[u];
  return 0;
}

int zt_model_create(zt_model_t **out, const zt_model_config_t *cfg, int B, int T,
                    const zt_kernels_t *k, unsigned flags) {
  *out = NULL;
  if (zt_model_config_check(cfg) != 0) return zt_err_wrap("model config");
  if (B < 1) return zt_err("model: batch size must be >= 1 (got %d)", B);
  if (T < 1 || T > cfg->seq_len)
    return zt_err("model: T must be in [1, seq_len=%d] (got %d)", cfg->seq_len, T);
  zt_model_t *m = calloc(1, sizeof *m);
  if (!m) return zt_err("out of memory");
  m->cfg = *cfg;
  m->Vp = zt_pad_vocab(cfg->vocab_size);
  m->max_B = B;
  m->max_T = T;
  m->k = k ? k : zt_kernels_ref(); /* NULL: layout-only users (export) */
  if (build_layout(m) != 0) goto err;
  m->unit_params = calloc((size_t)m->num_units, sizeof(float *));
  m->unit_grads = calloc((size_t)m->num_units, sizeof(float *));
  if (!m->unit_params || !m->unit_grads) {
    zt_err("out of memory");
    goto err;
  }
  if ((!(flags & ZT_MODEL_NO_PARAMS) &&
       alloc_flat(m, &m->params, m->unit_params, "parameters") != 0) ||
      (!(flags & ZT_MODEL_NO_GRADS) && alloc_flat(m, &m->grads, m->unit_grads, "gradients") != 0))
    goto err;
  if (acts_create(m) != 0) goto err;
  *out = m;
  return 0;
err:
  zt_model_free(m);
  return -1;
}

void zt_model_free(zt_model_t *m) {
  if (!m) return;
  acts_free(m->k, m->acts);
  if (m->params) m->k->release(m->params);
  if (m->grads) m->k->release(m->grads);
  free(m->unit_params);
  free(m->unit_grads);
  free(m->unit_off);
  free(m->unit_size);
  free(m->tensors);
  free(m);
}

const zt_tensor_t *zt_model_find(const zt_model_t *m, const char *name) {
  for (int i = 0; i < m->num_tensors; i++)
    if (strcmp(m->tensors[i].name, name) == 0) return &m->tensors[i];
  return NULL;
}

void zt_model_set_hooks(zt_model_t *m, const zt_model_hooks_t *hooks) {
  if (hooks) m->hooks = *hooks;
  else memset(&m->hooks, 0, sizeof m->hooks);
}

const float *zt_model_logits(const zt_model_t *m) { return m->acts->logits; }

/* ---- initialisation ------------------------------------------------------- */

static void fill_normal(zt_rng_t *r, float *p, size_t n, double std) {
  for (size_t i = 0; i < n; i++) p[i] = (float)(zt_rng_normal(r) * std);
}

static void fill_const(float *p, size_t n, float v) {
  for (size_t i = 0; i < n; i++) p[i] = v;
}

void zt_model_init_unit(const zt_model_t *m, uint64_t seed, int u, float *dst) {
  zt_rng_t r;
  zt_rng_seed(&r, seed, (uint64_t)u);
  double std = 0.02, proj_std = 0.02 / sqrt(2.0 * m->cfg.n_layer);
  size_t C = (size_t)m->cfg.n_embd, V = (size_t)m->cfg.vocab_size;
  for (int i = 0; i < m->num_tensors; i++) {
    const zt_tensor_t *t = &m->tensors[i];
    if (t->unit != u) continue;
    float *p = dst + t->unit_off;
    switch (t->kind) {
      case ZT_T_WTE:
        fill_normal(&r, p, V * C, std);
        fill_const(p + V * C, t->n - V * C, 0.0f);
        break;
      case ZT_T_WPE:
      case ZT_T_QKVW:
      case ZT_T_FCW:
        fill_normal(&r, p, t->n, std);
        break;
      case ZT_T_ATTPROJW:
      case ZT_T_FCPROJW:
        fill_normal(&r, p, t->n, proj_std);
        break;
      case ZT_T_LN1W:
      case ZT_T_LN2W:
      case ZT_T_LNFW:
        fill_const(p, t->n, 1.0f);
        break;
      default: /* biases and LayerNorm biases */
        fill_const(p, t->n, 0.0f);
        break;
    }
  }
}

int zt_model_init(zt_model_t *m, uint64_t seed) {
  for (int u = 0; u < m->num_units; u++) {
    /* Initialised on the host, then copied into the table's memory. */
    float *tmp = malloc(m->unit_size[u] * sizeof(float) + 1);
    if (!tmp) return zt_err("out of memory initialising unit %d", u);
    zt_model_init_unit(m, seed, u, tmp);
    m->k->upload(m->unit_params[u], tmp, m->unit_size[u] * sizeof(float));
    free(tmp);
  }
  return 0;
}

void zt_model_zero_grads(zt_model_t *m) {
  for (int u = 0; u < m->num_units; u++) m->k->zero(m->unit_grads[u], m->unit_size[u]);
}

/* ---- hooks ---------------------------------------------------------------- */

typedef int (*zt_hook_fn)(void *ctx, int unit);

static int call_hook(zt_model_t *m, zt_hook_fn fn, const char *what, int unit) {
  if (!fn) return 0;
  if (fn(m->hooks.ctx, unit) != 0) return zt_err_wrap("%s(unit %d)", what, unit);
  return 0;
}

#define ZT_HOOK(m, which, unit)                                             \
  do {                                                                      \
    if (call_hook((m), (m)->hooks.which, #which, (unit)) != 0) return -1;   \
  } while (0)

/* ---- forward -------------------------------------------------------------- */

/* Per-layer activation pointers at the capacity stride. */
#define ZT_LAYER(m, buf, l, per) ((buf) + (size_t)(l) * (size_t)(m)->max_B * (m)->max_T * (per))

static void block_forward(zt_model_t *m, int l, const float *x, int B, int T) {
  const zt_kernels_t *k = m->k;
  struct zt_acts *a = m->acts;
  int C = m->cfg.n_embd, NH = m->cfg.n_head, BT = B * T;
  size_t attper = (size_t)NH * m->max_T; /* att per (b, t) row at capacity */
  zt_block_t p;
  block_views(m->unit_params[1 + l], C, &p);
  float *ln1 = ZT_LAYER(m, a->ln1, l, C), *ln1m = ZT_LAYER(m, a->ln1_mean, l, 1);
  float *ln1r = ZT_LAYER(m, a->ln1_rstd, l, 1), *qkv = ZT_LAYER(m, a->qkv, l, 3 * C);
  float *atty = ZT_LAYER(m, a->atty, l, C), *att = ZT_LAYER(m, a->att, l, attper);
  float *res2 = ZT_LAYER(m, a->res2, l, C), *ln2 = ZT_LAYER(m, a->ln2, l, C);
  float *ln2m = ZT_LAYER(m, a->ln2_mean, l, 1), *ln2r = ZT_LAYER(m, a->ln2_rstd, l, 1);
  float *fch = ZT_LAYER(m, a->fch, l, 4 * C), *fchg = ZT_LAYER(m, a->fch_gelu, l, 4 * C);
  float *res3 = ZT_LAYER(m, a->res3, l, C);

  k->layernorm_forward(ln1, ln1m, ln1r, x, p.ln1w, p.ln1b, BT, C);
  k->matmul_forward(qkv, ln1, p.qkvw, p.qkvb, BT, C, 3 * C);
  k->attention_forward(atty, att, qkv, B, T, C, NH);
  k->matmul_forward(a->proj, atty, p.attprojw, p.attprojb, BT, C, C);
  k->residual_forward(res2, x, a->proj, (size_t)BT * C);
  k->layernorm_forward(ln2, ln2m, ln2r, res2, p.ln2w, p.ln2b, BT, C);
  k->matmul_forward(fch, ln2, p.fcw, p.fcb, BT, C, 4 * C);
  k->gelu_forward(fchg, fch, (size_t)BT * 4 * C);
  k->matmul_forward(a->proj, fchg, p.fcprojw, p.fcprojb, BT, 4 * C, C);
  k->residual_forward(res3, res2, a->proj, (size_t)BT * C);
}

static float mean_loss(const float *losses, int n) {
  double s = 0.0;
  for (int i = 0; i < n; i++) s += losses[i];
  return (float)(s / n);
}

int zt_model_forward(zt_model_t *m, const int *inputs, const int *targets, int B, int T,
                     float *loss) {
  const zt_kernels_t *k = m->k;
  struct zt_acts *a = m->acts;
  int C = m->cfg.n_embd, L = m->cfg.n_layer, V = m->cfg.vocab_size, BT = B * T;
  if (B < 1 || B > m->max_B || T < 1 || T > m->max_T)
    return zt_err("forward: batch %dx%d exceeds the model's capacity %dx%d", B, T, m->max_B,
                  m->max_T);
  for (int i = 0; i < BT; i++) {
    if (inputs[i] < 0 || inputs[i] >= V || (targets && (targets[i] < 0 || targets[i] >= V)))
      return zt_err("forward: token id out of range [0, %d) at position %d", V, i);
  }
  a->B = B;
  a->T = T;
  a->have_targets = 0;
  m->k->upload(a->inputs, inputs, sizeof(int) * (size_t)BT);

  ZT_HOOK(m, pre_forward, 0);
  const float *wte = m->unit_params[0], *wpe = wte + (size_t)m->Vp * C;
  k->encoder_forward(a->encoded, a->inputs, wte, wpe, B, T, C);
  for (int l = 0; l < L; l++) {
    ZT_HOOK(m, pre_forward, 1 + l);
    block_forward(m, l, l == 0 ? a->encoded : ZT_LAYER(m, a->res3, l - 1, C), B, T);
    ZT_HOOK(m, post_forward, 1 + l);
  }
  ZT_HOOK(m, pre_forward, L + 1);
  const float *lnf_w = m->unit_params[L + 1], *lnf_b = lnf_w + C;
  k->layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, ZT_LAYER(m, a->res3, L - 1, C), lnf_w,
                       lnf_b, BT, C);
  ZT_HOOK(m, post_forward, L + 1);
  wte = m->unit_params[0]; /* a hook may have moved unit 0 */
  k->matmul_forward(a->logits, a->lnf, wte, NULL, BT, C, m->Vp);
  ZT_HOOK(m, post_forward, 0);

  if (targets) {
    k->upload(a->targets, targets, sizeof(int) * (size_t)BT);
    k->crossentropy_forward(a->losses, a->logits, a->logits, a->targets, BT, V, m->Vp);
    a->have_targets = 1;
    if (loss) {
      k->download(a->host_losses, a->losses, sizeof(float) * (size_t)BT);
      *loss = mean_loss(a->host_losses, BT);
    }
  }
  return 0;
}

/* ---- backward ------------------------------------------------------------- */

static void block_backward(zt_model_t *m, int l, const float *x) {
  const zt_kernels_t *k = m->k;
  struct zt_acts *a = m->acts;
  int B = a->B, T = a->T, C = m->cfg.n_embd, NH = m->cfg.n_head, BT = B * T;
  size_t attper = (size_t)NH * m->max_T;
  zt_block_t p, g;
  block_views(m->unit_params[1 + l], C, &p);
  block_views(m->unit_grads[1 + l], C, &g);
  const float *ln1 = ZT_LAYER(m, a->ln1, l, C), *ln1m = ZT_LAYER(m, a->ln1_mean, l, 1);
  const float *ln1r = ZT_LAYER(m, a->ln1_rstd, l, 1), *qkv = ZT_LAYER(m, a->qkv, l, 3 * C);
  const float *atty = ZT_LAYER(m, a->atty, l, C), *att = ZT_LAYER(m, a->att, l, attper);
  const float *res2 = ZT_LAYER(m, a->res2, l, C), *ln2 = ZT_LAYER(m, a->ln2, l, C);
  const float *ln2m = ZT_LAYER(m, a->ln2_mean, l, 1), *ln2r = ZT_LAYER(m, a->ln2_rstd, l, 1);
  const float *fch = ZT_LAYER(m, a->fch, l, 4 * C), *fchg = ZT_LAYER(m, a->fch_gelu, l, 4 * C);

  /* MLP: dres is d res3 = d(mlp output). */
  k->matmul_backward(a->dfch, g.fcprojw, g.fcprojb, a->dres, fchg, p.fcprojw, BT, 4 * C, C);
  k->gelu_backward(a->dfch, fch, a->dfch, (size_t)BT * 4 * C);
  k->matmul_backward(a->dbtc, g.fcw, g.fcb, a->dfch, ln2, p.fcw, BT, C, 4 * C);
  k->layernorm_backward(a->dres, g.ln2w, g.ln2b, a->dbtc, res2, p.ln2w, ln2m, ln2r, BT, C);
  /* Attention: dres is now d res2 = d(attention output). */
  k->matmul_backward(a->dbtc, g.attprojw, g.attprojb, a->dres, atty, p.attprojw, BT, C, C);
  k->attention_backward(a->dqkv, a->dbtc, qkv, att, B, T, C, NH);
  k->matmul_backward(a->dbtc, g.qkvw, g.qkvb, a->dqkv, ln1, p.qkvw, BT, C, 3 * C);
  k->layernorm_backward(a->dres, g.ln1w, g.ln1b, a->dbtc, x, p.ln1w, ln1m, ln1r, BT, C);
}

int zt_model_backward(zt_model_t *m, float grad_scale) {
  const zt_kernels_t *k = m->k;
  struct zt_acts *a = m->acts;
  int B = a->B, T = a->T, C = m->cfg.n_embd, L = m->cfg.n_layer, BT = B * T;
  if (!a->have_targets) return zt_err("backward: the last forward had no targets");

  ZT_HOOK(m, pre_backward, 0);
  /* Loss -> logits (in place over the probabilities) -> LM head. */
  float dloss = grad_scale / (float)BT;
  k->crossentropy_backward(a->logits, a->logits, a->targets, dloss, BT, m->cfg.vocab_size, m->Vp);
  k->matmul_backward(a->dbtc, m->unit_grads[0], NULL, a->logits, a->lnf, m->unit_params[0], BT,
                     C, m->Vp);
  a->have_targets = 0; /* the probabilities are gone */

  ZT_HOOK(m, pre_backward, L + 1);
  float *lnf_w = m->unit_params[L + 1], *dlnf_w = m->unit_grads[L + 1];
  k->zero(a->dres, (size_t)BT * C);
  k->layernorm_backward(a->dres, dlnf_w, dlnf_w + C, a->dbtc, ZT_LAYER(m, a->res3, L - 1, C),
                        lnf_w, a->lnf_mean, a->lnf_rstd, BT, C);
  ZT_HOOK(m, post_backward, L + 1);

  for (int l = L - 1; l >= 0; l--) {
    ZT_HOOK(m, pre_backward, 1 + l);
    block_backward(m, l, l == 0 ? a->encoded : ZT_LAYER(m, a->res3, l - 1, C));
    ZT_HOOK(m, post_backward, 1 + l);
  }

  float *dwte = m->unit_grads[0], *dwpe = dwte + (size_t)m->Vp * C;
  k->encoder_backward(dwte, dwpe, a->dres, a->inputs, B, T, C);
  ZT_HOOK(m, post_backward, 0);
  return 0;
}
