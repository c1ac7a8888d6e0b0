/*
 * model.c: the GPT-2 model: activations, forward and backward.
 *
 * See model.h for the unit pointers that make ZeRO sharding possible and
 * the hook order, layout.h for the parameter layout. This file holds two
 * things:
 *
 *   - the activations (struct zt_acts), sized at create time for the largest
 *     batch, with one set per layer of what the backward needs and a few
 *     scratch buffers for gradients that are reused layer after layer; one
 *     list, ZT_ACTIVATIONS, declares, sizes, allocates and frees them;
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

#include "activations.h"
#include "zt_common.h"

struct zt_acts {
  int B, T;            /* shape of the last forward */
  int have_targets;    /* the last forward computed the loss */
  int *inputs;         /* [B, T] copies of the last batch */
  int *targets;
  float *host_losses;  /* [B, T] host copy of the per-token losses */
#define ZT_ACT_FIELD(name, size, type) float *name;
  ZT_ACTIVATIONS(ZT_ACT_FIELD)
#undef ZT_ACT_FIELD
  /* Per layer ones ([L, ...]) are strided by the capacity; logits hold the
   * probabilities after a forward with targets; dres, dbtc, dqkv, dfch are
   * backward scratch and proj forward scratch, reused by every layer. */
  size_t bytes;        /* total activation memory */
};

/* ---- activations ---------------------------------------------------------- */

/* Activations live in the kernel table's memory (device memory for CUDA),
 * one allocation per tensor, X tensors in the table's storage type
 * (activations.h, zt_kernels.h). */
static int acts_create(zt_model_t *m) {
  struct zt_acts *a = zt_xcalloc(1, sizeof *a);
  m->acts = a;
  const zt_kernels_t *k = m->k;
  const zt_model_config_t *c = &m->cfg;
  zt_act_dims_t d = zt_act_dims((size_t)c->n_embd, (size_t)c->n_layer, (size_t)c->n_head,
                                 (size_t)m->lay.Vp, c->arch == ZT_ARCH_LLAMA,
                                 (size_t)c->n_kv_head, (size_t)c->head_dim, (size_t)c->n_ff);
  size_t B = (size_t)m->max_B, T = (size_t)m->max_T, C = d.C, L = d.L, NH = d.NH, BT = B * T;
  size_t Vp = d.Vp, QKV = d.QKV, ATT = d.ATT, FF = d.FF, FFA = d.FFA, ATTX = d.ATTX;
  size_t FFAX = d.FFAX, PE = d.PE;
  size_t LA = m->recompute ? 1 : L, xb = (size_t)k->xbytes;
  a->inputs = k->alloc(BT * sizeof(int));
  a->targets = k->alloc(BT * sizeof(int));
  a->host_losses = zt_xmalloc(BT * sizeof(float));
  int ok = a->inputs && a->targets;
  /* A tensor of size 0 (one the architecture does not use) stays NULL. */
#define ZT_ACT_ALLOC(name, size, type)                         \
  a->bytes += (size) * type(xb);                               \
  a->name = (size) != 0 ? k->alloc((size) * type(xb)) : NULL;  \
  ok &= (size) == 0 || a->name != NULL;
  ZT_ACTIVATIONS(ZT_ACT_ALLOC)
#undef ZT_ACT_ALLOC
  (void)NH, (void)Vp, (void)LA;
  if (!ok) return zt_errk(ZT_E_NO_MEMORY, "out of memory for activations (%zu bytes)", a->bytes);
  return 0;
}

static void acts_free(const zt_kernels_t *k, struct zt_acts *a) {
  if (!a) return;
#define ZT_ACT_FREE(name, size, type) \
  if (a->name) k->release(a->name);
  ZT_ACTIVATIONS(ZT_ACT_FREE)
#undef ZT_ACT_FREE
  k->release(a->inputs);
  k->release(a->targets);
  free(a->host_losses);
  free(a);
}

size_t zt_model_activation_bytes(const zt_model_t *m) { return m->acts ? m->acts->bytes : 0; }

/* ---- create / free -------------------------------------------------------- */

/* A flat buffer of every unit in table memory, elements of esz bytes, with
 * the unit pointers pointing into it. */
static int alloc_flat(zt_model_t *m, float **flat, float **units, size_t esz, const char *what) {
  *flat = m->k->alloc(m->lay.num_params * esz);
  if (!*flat) return zt_errk(ZT_E_NO_MEMORY, "out of memory for %zu %s", m->lay.num_params, what);
  for (int u = 0; u < m->lay.num_units; u++)
    units[u] = (float *)((char *)*flat + m->lay.unit_off[u] * esz);
  return 0;
}

int zt_model_create(zt_model_t **out, const zt_model_config_t *cfg, int B, int T,
                    const zt_kernels_t *k, unsigned flags) {
  *out = NULL;
  if (zt_model_config_check(cfg) != 0) return zt_err_wrap("model config");
  if (cfg->arch == ZT_ARCH_LLAMA && !k->rmsnorm_forward)
    return zt_errk(ZT_E_INVALID, "model.arch llama: the %s kernels do not have it yet (train "
                   "it on CPU workers)", k->name);
  if (cfg->lora_r && !(flags & ZT_MODEL_SHELL))
    return zt_err("model: a LoRA configuration's parameters are its adapters; compute with the "
                  "base configuration (engine/lora.h)");
  if (B < 1) return zt_err("model: batch size must be >= 1 (got %d)", B);
  if (T < 1 || T > cfg->seq_len)
    return zt_err("model: T must be in [1, seq_len=%d] (got %d)", cfg->seq_len, T);
  zt_model_t *m = zt_xcalloc(1, sizeof *m);
  m->cfg = *cfg;
  m->max_B = B;
  m->max_T = T;
  m->k = k;
  m->recompute = (flags & ZT_MODEL_RECOMPUTE) != 0;
  m->graph.on = 1;
  if (zt_layout_build(&m->lay, cfg) != 0) goto err;
  m->unit_params = zt_xcalloc((size_t)m->lay.num_units, sizeof(float *));
  m->unit_grads = zt_xcalloc((size_t)m->lay.num_units, sizeof(float *));
  if ((!(flags & ZT_MODEL_NO_PARAMS) &&
       alloc_flat(m, &m->params, m->unit_params, (size_t)k->xbytes, "parameters") != 0) ||
      (!(flags & ZT_MODEL_NO_GRADS) &&
       alloc_flat(m, &m->grads, m->unit_grads, sizeof(float), "gradients") != 0))
    goto err;
  if (!(flags & ZT_MODEL_SHELL) && acts_create(m) != 0) goto err;
  *out = m;
  return 0;
err:
  zt_model_free(m);
  return -1;
}

void zt_model_free(zt_model_t *m) {
  if (!m) return;
  zt_model_set_graphs(m, 0);
  free(m->graph.ptrs);
  free(m->graph.segs);
  free(m->graph.marks);
  acts_free(m->k, m->acts);
  if (m->params) m->k->release(m->params);
  if (m->grads) m->k->release(m->grads);
  free(m->unit_params);
  free(m->unit_grads);
  zt_layout_free(&m->lay);
  free(m);
}

void zt_model_set_hooks(zt_model_t *m, const zt_model_hooks_t *hooks) {
  /* Recorded segments end in the old hooks' marks. */
  if (m->graph.on) {
    zt_model_set_graphs(m, 0);
    zt_model_set_graphs(m, 1);
  }
  if (hooks) m->hooks = *hooks;
  else memset(&m->hooks, 0, sizeof m->hooks);
}

const float *zt_model_logits(const zt_model_t *m) { return m->acts->logits; }

/* ---- initialisation ------------------------------------------------------- */

void zt_model_init(zt_model_t *m, uint64_t seed) {
  for (int u = 0; u < m->lay.num_units; u++) {
    /* Initialised on the host, rounded to the storage type, then copied
     * into the table's memory. */
    size_t n = m->lay.unit_size[u];
    float *tmp = zt_xmalloc(n * sizeof(float) + 1);
    zt_layout_init_unit(&m->lay, seed, u, tmp);
    if (m->k->xbytes == 2) { /* bf16 storage: rounded on the host, as narrow_x would */
      uint16_t *h = zt_xmalloc(n * sizeof(uint16_t) + 1);
      for (size_t i = 0; i < n; i++) h[i] = zt_f32_to_bf16(tmp[i]);
      m->k->upload(m->unit_params[u], h, n * sizeof(uint16_t));
      free(h);
    } else {
      m->k->upload(m->unit_params[u], tmp, n * sizeof(float));
    }
    free(tmp);
  }
}

void zt_model_zero_grads(zt_model_t *m) {
  for (int u = 0; u < m->lay.num_units; u++) m->k->zero(m->unit_grads[u], m->lay.unit_size[u]);
}

/* ---- hooks ---------------------------------------------------------------- */

typedef int (*zt_hook_fn)(void *ctx, int unit);

static int graph_cut(zt_model_t *m, zt_hook_fn fn, const char *what, int unit);

/* While a step is recorded (zt_model_step), a hook ends a segment
 * instead of running. */
static int call_hook(zt_model_t *m, zt_hook_fn fn, const char *what, int unit) {
  if (!fn) return 0;
  if (m->graph.recording) return graph_cut(m, fn, what, unit);
  if (fn(m->hooks.ctx, unit) != 0) return zt_err_wrap("%s(unit %d)", what, unit);
  return 0;
}

#define ZT_HOOK(m, which, unit)                                             \
  do {                                                                      \
    if (call_hook((m), (m)->hooks.which, #which, (unit)) != 0) return -1;   \
  } while (0)

/* ---- forward -------------------------------------------------------------- */

/* p advanced by n elements of the storage type: X tensors and parameters
 * (zt_kernels.h) are addressed in units of the table's xbytes. */
#define ZT_XADV(m, p, n) ((float *)((char *)(p) + (size_t)(n) * (size_t)(m)->k->xbytes))

/* Per-layer activation pointers at the capacity stride. ZT_SLOT is where
 * layer l's recomputable activations live: its own slot, or the one slot
 * every layer shares with activation checkpointing (res3, the next layer's
 * input, always has its own). ZT_LAYER and ZT_SLOT address X tensors,
 * ZT_SLOT_F the fp32 ones. */
#define ZT_LAYER_OFF(m, l, per) ((size_t)(l) * (size_t)(m)->max_B * (m)->max_T * (per))
#define ZT_LAYER(m, buf, l, per) ZT_XADV(m, buf, ZT_LAYER_OFF(m, l, per))
#define ZT_SLOT(m, buf, l, per) ZT_LAYER(m, buf, (m)->recompute ? 0 : (l), per)
#define ZT_SLOT_F(m, buf, l, per) ((buf) + ZT_LAYER_OFF(m, (m)->recompute ? 0 : (l), per))

static void block_forward(zt_model_t *m, int l, const float *x, int B, int T) {
  const zt_kernels_t *k = m->k;
  struct zt_acts *a = m->acts;
  int C = m->cfg.n_embd, NH = m->cfg.n_head, BT = B * T;
  zt_block_t p;
  zt_layout_block_views(m->unit_params[1 + l], C, (size_t)k->xbytes, &p);
  float *ln1 = ZT_SLOT(m, a->ln1, l, C), *ln1m = ZT_SLOT_F(m, a->ln1_mean, l, 1);
  float *ln1r = ZT_SLOT_F(m, a->ln1_rstd, l, 1), *qkv = ZT_SLOT(m, a->qkv, l, 3 * C);
  float *atty = ZT_SLOT(m, a->atty, l, C), *lse = ZT_SLOT_F(m, a->lse, l, NH);
  float *res2 = ZT_SLOT(m, a->res2, l, C), *ln2 = ZT_SLOT(m, a->ln2, l, C);
  float *ln2m = ZT_SLOT_F(m, a->ln2_mean, l, 1), *ln2r = ZT_SLOT_F(m, a->ln2_rstd, l, 1);
  float *fch = ZT_SLOT(m, a->fch, l, 4 * C), *fchg = ZT_SLOT(m, a->fch_gelu, l, 4 * C);
  float *res3 = ZT_LAYER(m, a->res3, l, C);

  k->layernorm_forward(ln1, ln1m, ln1r, x, p.ln1w, p.ln1b, BT, C);
  k->matmul_forward(qkv, ln1, p.qkvw, p.qkvb, BT, C, 3 * C);
  k->attention_forward(atty, lse, qkv, B, T, C, NH);
  k->matmul_forward(a->proj, atty, p.attprojw, p.attprojb, BT, C, C);
  if (k->residual_layernorm_forward) {
    k->residual_layernorm_forward(res2, ln2, ln2m, ln2r, x, a->proj, p.ln2w, p.ln2b, BT, C);
  } else {
    k->residual_forward(res2, x, a->proj, (size_t)BT * C);
    k->layernorm_forward(ln2, ln2m, ln2r, res2, p.ln2w, p.ln2b, BT, C);
  }
  if (k->matmul_gelu_forward) {
    k->matmul_gelu_forward(fchg, fch, ln2, p.fcw, p.fcb, BT, C, 4 * C);
  } else {
    k->matmul_forward(fch, ln2, p.fcw, p.fcb, BT, C, 4 * C);
    k->gelu_forward(fchg, fch, (size_t)BT * 4 * C);
  }
  k->matmul_forward(a->proj, fchg, p.fcprojw, p.fcprojb, BT, 4 * C, C);
  k->residual_forward(res3, res2, a->proj, (size_t)BT * C);
}

/* A llama block: the same residual structure with RMSNorm, q/k/v (and
 * grouped K/V heads) with rotary positions, and a SwiGLU MLP:
 *     res2 = x + o_proj(attn(rope(qkv(rms1(x))))),
 *     res3 = res2 + down(silu(gate(rms2(res2))) * up(rms2(res2))). */
static void llama_block_forward(zt_model_t *m, int l, const float *x, int B, int T) {
  const zt_kernels_t *k = m->k;
  const zt_model_config_t *c = &m->cfg;
  struct zt_acts *a = m->acts;
  int C = c->n_embd, NH = c->n_head, KV = c->n_kv_head, HD = c->head_dim, F = c->n_ff;
  int QKV = zt_model_qkv_width(c), ATT = zt_model_att_width(c), BT = B * T;
  zt_lblock_t p;
  zt_layout_lblock_views(m->unit_params[1 + l], c, (size_t)k->xbytes, &p);
  float *ln1 = ZT_SLOT(m, a->ln1, l, C), *ln1r = ZT_SLOT_F(m, a->ln1_rstd, l, 1);
  float *qkv = ZT_SLOT(m, a->qkv, l, QKV), *atty = ZT_SLOT(m, a->atty, l, ATT);
  float *lse = ZT_SLOT_F(m, a->lse, l, NH), *res2 = ZT_SLOT(m, a->res2, l, C);
  float *ln2 = ZT_SLOT(m, a->ln2, l, C), *ln2r = ZT_SLOT_F(m, a->ln2_rstd, l, 1);
  float *fch = ZT_SLOT(m, a->fch, l, 2 * F), *fchg = ZT_SLOT(m, a->fch_gelu, l, F);
  float *res3 = ZT_LAYER(m, a->res3, l, C);

  k->rmsnorm_forward(ln1, ln1r, x, p.rms1w, BT, C, c->norm_eps);
  k->matmul_forward(qkv, ln1, p.qkvw, p.qkvb, BT, C, QKV);
  k->rope(qkv, B, T, 0, NH, KV, HD, zt_model_rope(c), 0);
  k->attention_forward_gqa(atty, lse, qkv, B, T, NH, KV, HD);
  k->matmul_forward(a->proj, atty, p.ow, NULL, BT, ATT, C);
  k->residual_forward(res2, x, a->proj, (size_t)BT * C);
  k->rmsnorm_forward(ln2, ln2r, res2, p.rms2w, BT, C, c->norm_eps);
  k->matmul_forward(fch, ln2, p.gateupw, NULL, BT, C, 2 * F);
  k->swiglu_forward(fchg, fch, BT, F);
  k->matmul_forward(a->proj, fchg, p.downw, NULL, BT, F, C);
  k->residual_forward(res3, res2, a->proj, (size_t)BT * C);
}

static void any_block_forward(zt_model_t *m, int l, const float *x, int B, int T) {
  if (m->cfg.arch == ZT_ARCH_LLAMA) llama_block_forward(m, l, x, B, T);
  else block_forward(m, l, x, B, T);
}

/* The LM head's weight: the token embedding, or llama's own lm_head (after
 * the final norm's weight in unit L + 1). */
static float *head_of(const zt_model_t *m, float *const *units, size_t esz) {
  const zt_model_config_t *c = &m->cfg;
  if (c->arch == ZT_ARCH_LLAMA && !c->tie_embed)
    return units[c->n_layer + 1] ? (float *)((char *)units[c->n_layer + 1] + (size_t)c->n_embd * esz)
                                 : NULL;
  return units[0];
}

static float mean_loss(const float *losses, int n) {
  double s = 0.0;
  for (int i = 0; i < n; i++) s += losses[i];
  return (float)(s / n);
}

/* Checks a batch and uploads it (the targets too, when not NULL). */
static int put_batch(zt_model_t *m, const int *inputs, const int *targets, int B, int T) {
  struct zt_acts *a = m->acts;
  int V = m->cfg.vocab_size, BT = B * T;
  if (!a) return zt_err("forward: a shell model (ZT_MODEL_SHELL) has no activations");
  if (B < 1 || B > m->max_B || T < 1 || T > m->max_T)
    return zt_err("forward: batch %dx%d exceeds the model's capacity %dx%d", B, T, m->max_B,
                  m->max_T);
  for (int i = 0; i < BT; i++) {
    if (inputs[i] < 0 || inputs[i] >= V || (targets && (targets[i] < 0 || targets[i] >= V)))
      return zt_err("forward: token id out of range [0, %d) at position %d", V, i);
  }
  m->k->upload(a->inputs, inputs, sizeof(int) * (size_t)BT);
  if (targets) m->k->upload(a->targets, targets, sizeof(int) * (size_t)BT);
  return 0;
}

/* The forward's device work on the uploaded batch: no transfer to or from
 * the host, so that a graph can hold it. */
static int forward_enqueue(zt_model_t *m, int B, int T, int with_targets) {
  const zt_kernels_t *k = m->k;
  struct zt_acts *a = m->acts;
  int C = m->cfg.n_embd, L = m->cfg.n_layer, V = m->cfg.vocab_size, BT = B * T;
  a->B = B;
  a->T = T;
  a->have_targets = 0;

  int llama = m->cfg.arch == ZT_ARCH_LLAMA;
  ZT_HOOK(m, pre_forward, 0);
  const float *wte = m->unit_params[0];
  const float *wpe = llama ? a->nowpe : ZT_XADV(m, wte, (size_t)m->lay.Vp * C);
  k->encoder_forward(a->encoded, a->inputs, wte, wpe, B, T, C);
  for (int l = 0; l < L; l++) {
    ZT_HOOK(m, pre_forward, 1 + l);
    any_block_forward(m, l, l == 0 ? a->encoded : ZT_LAYER(m, a->res3, l - 1, C), B, T);
    ZT_HOOK(m, post_forward, 1 + l);
  }
  ZT_HOOK(m, pre_forward, L + 1);
  const float *lnf_w = m->unit_params[L + 1], *lnf_b = ZT_XADV(m, lnf_w, C);
  if (llama)
    k->rmsnorm_forward(a->lnf, a->lnf_rstd, ZT_LAYER(m, a->res3, L - 1, C), lnf_w, BT, C,
                       m->cfg.norm_eps);
  else
    k->layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, ZT_LAYER(m, a->res3, L - 1, C),
                         lnf_w, lnf_b, BT, C);
  if (llama && !m->cfg.tie_embed) { /* the head is in unit L + 1 */
    k->matmul_forward(a->logits, a->lnf, head_of(m, m->unit_params, (size_t)k->xbytes), NULL,
                      BT, C, m->lay.Vp);
    ZT_HOOK(m, post_forward, L + 1);
    ZT_HOOK(m, post_forward, 0);
  } else {
    ZT_HOOK(m, post_forward, L + 1);
    wte = m->unit_params[0]; /* a hook may have moved unit 0 */
    k->matmul_forward(a->logits, a->lnf, wte, NULL, BT, C, m->lay.Vp);
    ZT_HOOK(m, post_forward, 0);
  }

  if (with_targets) {
    if (k->crossentropy_lse_forward) /* the logits stay; backward reads them */
      k->crossentropy_lse_forward(a->losses, a->ce_lse, a->logits, a->targets, BT, V, m->lay.Vp);
    else /* the probabilities replace the logits */
      k->crossentropy_forward(a->losses, a->logits, a->logits, a->targets, BT, V, m->lay.Vp);
    a->have_targets = 1;
  }
  return 0;
}

/* The mean of the last forward's losses, read from the device. */
static float read_loss(zt_model_t *m) {
  struct zt_acts *a = m->acts;
  int BT = a->B * a->T;
  m->k->download(a->host_losses, a->losses, sizeof(float) * (size_t)BT);
  return mean_loss(a->host_losses, BT);
}

int zt_model_forward(zt_model_t *m, const int *inputs, const int *targets, int B, int T,
                     float *loss) {
  if (put_batch(m, inputs, targets, B, T) != 0) return -1;
  if (forward_enqueue(m, B, T, targets != NULL) != 0) return -1;
  if (targets && loss) *loss = read_loss(m);
  return 0;
}

/* ---- backward ------------------------------------------------------------- */

static void block_backward(zt_model_t *m, int l, const float *x) {
  const zt_kernels_t *k = m->k;
  struct zt_acts *a = m->acts;
  int B = a->B, T = a->T, C = m->cfg.n_embd, NH = m->cfg.n_head, BT = B * T;
  zt_block_t p, g;
  zt_layout_block_views(m->unit_params[1 + l], C, (size_t)k->xbytes, &p);
  zt_layout_block_views(m->unit_grads[1 + l], C, sizeof(float), &g);
  const float *ln1 = ZT_SLOT(m, a->ln1, l, C), *ln1m = ZT_SLOT_F(m, a->ln1_mean, l, 1);
  const float *ln1r = ZT_SLOT_F(m, a->ln1_rstd, l, 1), *qkv = ZT_SLOT(m, a->qkv, l, 3 * C);
  const float *atty = ZT_SLOT(m, a->atty, l, C), *lse = ZT_SLOT_F(m, a->lse, l, NH);
  const float *res2 = ZT_SLOT(m, a->res2, l, C), *ln2 = ZT_SLOT(m, a->ln2, l, C);
  const float *ln2m = ZT_SLOT_F(m, a->ln2_mean, l, 1), *ln2r = ZT_SLOT_F(m, a->ln2_rstd, l, 1);
  const float *fch = ZT_SLOT(m, a->fch, l, 4 * C), *fchg = ZT_SLOT(m, a->fch_gelu, l, 4 * C);

  /* MLP: dres is d res3 = d(mlp output). */
  if (k->matmul_backward_dgelu) {
    k->matmul_backward_dgelu(a->dfch, g.fcprojw, g.fcprojb, a->dres, fchg, p.fcprojw, fch, BT,
                             4 * C, C);
  } else {
    k->matmul_backward(a->dfch, g.fcprojw, g.fcprojb, a->dres, fchg, p.fcprojw, BT, 4 * C, C);
    k->gelu_backward(a->dfch, fch, a->dfch, (size_t)BT * 4 * C);
  }
  k->matmul_backward(a->dbtc, g.fcw, g.fcb, a->dfch, ln2, p.fcw, BT, C, 4 * C);
  k->layernorm_backward(a->dres, g.ln2w, g.ln2b, a->dbtc, res2, p.ln2w, ln2m, ln2r, BT, C);
  /* Attention: dres is now d res2 = d(attention output). */
  k->matmul_backward(a->dbtc, g.attprojw, g.attprojb, a->dres, atty, p.attprojw, BT, C, C);
  k->attention_backward(a->dqkv, a->dbtc, qkv, atty, lse, B, T, C, NH);
  k->matmul_backward(a->dbtc, g.qkvw, g.qkvb, a->dqkv, ln1, p.qkvw, BT, C, 3 * C);
  k->layernorm_backward(a->dres, g.ln1w, g.ln1b, a->dbtc, x, p.ln1w, ln1m, ln1r, BT, C);
}

static void llama_block_backward(zt_model_t *m, int l, const float *x) {
  const zt_kernels_t *k = m->k;
  const zt_model_config_t *c = &m->cfg;
  struct zt_acts *a = m->acts;
  int B = a->B, T = a->T, BT = B * T, C = c->n_embd, NH = c->n_head, KV = c->n_kv_head;
  int HD = c->head_dim, F = c->n_ff, QKV = zt_model_qkv_width(c), ATT = zt_model_att_width(c);
  zt_lblock_t p, g;
  zt_layout_lblock_views(m->unit_params[1 + l], c, (size_t)k->xbytes, &p);
  zt_layout_lblock_views(m->unit_grads[1 + l], c, sizeof(float), &g);
  const float *ln1 = ZT_SLOT(m, a->ln1, l, C), *ln1r = ZT_SLOT_F(m, a->ln1_rstd, l, 1);
  const float *qkv = ZT_SLOT(m, a->qkv, l, QKV), *atty = ZT_SLOT(m, a->atty, l, ATT);
  const float *lse = ZT_SLOT_F(m, a->lse, l, NH), *res2 = ZT_SLOT(m, a->res2, l, C);
  const float *ln2 = ZT_SLOT(m, a->ln2, l, C), *ln2r = ZT_SLOT_F(m, a->ln2_rstd, l, 1);
  const float *fch = ZT_SLOT(m, a->fch, l, 2 * F), *fchg = ZT_SLOT(m, a->fch_gelu, l, F);

  /* MLP: dres is d res3. */
  k->matmul_backward(a->dffa, g.downw, NULL, a->dres, fchg, p.downw, BT, F, C);
  k->swiglu_backward(a->dfch, a->dffa, fch, BT, F);
  k->matmul_backward(a->dbtc, g.gateupw, NULL, a->dfch, ln2, p.gateupw, BT, C, 2 * F);
  k->rmsnorm_backward(a->dres, g.rms2w, a->dbtc, res2, p.rms2w, ln2r, BT, C);
  /* Attention: dres is now d res2. The stored qkv holds q and k after
   * their rotation, so the rotation's backward comes after attention's. */
  k->matmul_backward(a->datt, g.ow, NULL, a->dres, atty, p.ow, BT, ATT, C);
  k->attention_backward_gqa(a->dqkv, a->datt, qkv, atty, lse, B, T, NH, KV, HD);
  k->rope(a->dqkv, B, T, 0, NH, KV, HD, zt_model_rope(c), 1);
  k->matmul_backward(a->dbtc, g.qkvw, g.qkvb, a->dqkv, ln1, p.qkvw, BT, C, QKV);
  k->rmsnorm_backward(a->dres, g.rms1w, a->dbtc, x, p.rms1w, ln1r, BT, C);
}

/* Unit u's gradient, where it has one, set to zero. */
static void zero_unit_grad(zt_model_t *m, int u) {
  if (m->unit_grads[u]) m->k->zero(m->unit_grads[u], m->lay.unit_size[u]);
}

/* The order of zt_model_forward's and zt_model_backward's hooks. */
int zt_model_hook_pass(zt_model_t *m) {
  int L = m->cfg.n_layer;
  ZT_HOOK(m, pre_forward, 0);
  for (int l = 0; l < L; l++) {
    ZT_HOOK(m, pre_forward, 1 + l);
    ZT_HOOK(m, post_forward, 1 + l);
  }
  ZT_HOOK(m, pre_forward, L + 1);
  ZT_HOOK(m, post_forward, L + 1);
  ZT_HOOK(m, post_forward, 0);
  /* Both kinds of head (tied or own) take these two before any other. */
  ZT_HOOK(m, pre_backward, 0);
  ZT_HOOK(m, pre_backward, L + 1);
  zero_unit_grad(m, L + 1);
  ZT_HOOK(m, post_backward, L + 1);
  for (int l = L - 1; l >= 0; l--) {
    ZT_HOOK(m, pre_backward, 1 + l);
    zero_unit_grad(m, 1 + l);
    ZT_HOOK(m, post_backward, 1 + l);
  }
  zero_unit_grad(m, 0);
  ZT_HOOK(m, post_backward, 0);
  return 0;
}

int zt_model_backward(zt_model_t *m, float grad_scale) {
  const zt_kernels_t *k = m->k;
  struct zt_acts *a = m->acts;
  if (!a) return zt_err("backward: a shell model (ZT_MODEL_SHELL) has no activations");
  int B = a->B, T = a->T, C = m->cfg.n_embd, L = m->cfg.n_layer, BT = B * T;
  if (!a->have_targets) return zt_err("backward: the last forward had no targets");

  int llama = m->cfg.arch == ZT_ARCH_LLAMA, own_head = llama && !m->cfg.tie_embed;
  ZT_HOOK(m, pre_backward, 0);
  if (own_head) ZT_HOOK(m, pre_backward, L + 1);
  /* Loss -> logits (in place over the logits or probabilities) -> LM head. */
  float dloss = grad_scale / (float)BT;
  if (k->crossentropy_lse_backward)
    k->crossentropy_lse_backward(a->logits, a->logits, a->ce_lse, a->targets, dloss, BT,
                                 m->cfg.vocab_size, m->lay.Vp);
  else
    k->crossentropy_backward(a->logits, a->logits, a->targets, dloss, BT, m->cfg.vocab_size,
                             m->lay.Vp);
  k->matmul_backward(a->dbtc, head_of(m, m->unit_grads, sizeof(float)), NULL, a->logits, a->lnf,
                     head_of(m, m->unit_params, (size_t)k->xbytes), BT, C, m->lay.Vp);
  a->have_targets = 0; /* the logits (or probabilities) are gone */

  if (!own_head) ZT_HOOK(m, pre_backward, L + 1);
  float *lnf_w = m->unit_params[L + 1], *dlnf_w = m->unit_grads[L + 1];
  k->memzero(a->dres, (size_t)BT * C * (size_t)k->xbytes);
  if (llama)
    k->rmsnorm_backward(a->dres, dlnf_w, a->dbtc, ZT_LAYER(m, a->res3, L - 1, C), lnf_w,
                        a->lnf_rstd, BT, C);
  else
    k->layernorm_backward(a->dres, dlnf_w, dlnf_w + C, a->dbtc, ZT_LAYER(m, a->res3, L - 1, C),
                          lnf_w, a->lnf_mean, a->lnf_rstd, BT, C);
  ZT_HOOK(m, post_backward, L + 1);

  for (int l = L - 1; l >= 0; l--) {
    ZT_HOOK(m, pre_backward, 1 + l);
    const float *x = l == 0 ? a->encoded : ZT_LAYER(m, a->res3, l - 1, C);
    /* Activation checkpointing: the shared slot holds the last layer's
     * activations from the forward; every other layer is computed again
     * from its input, with the same kernels and so the same values. */
    if (m->recompute && l < L - 1) any_block_forward(m, l, x, B, T);
    if (llama) llama_block_backward(m, l, x);
    else block_backward(m, l, x);
    ZT_HOOK(m, post_backward, 1 + l);
  }

  float *dwte = m->unit_grads[0];
  float *dwpe = llama ? a->dnowpe : dwte + (size_t)m->lay.Vp * C;
  if (dwte) k->encoder_backward(dwte, dwpe, a->dres, a->inputs, B, T, C);
  ZT_HOOK(m, post_backward, 0);
  return 0;
}

/* ---- CUDA graphs (zt_model_step) ------------------------------------------ */

/* A graph holds the pointers and scalars its calls were recorded with, so
 * it is replayed only for a step with the same key: batch shape, gradient
 * scale and every unit pointer (the activations and the table's scratch
 * stay where they are). MAX_CAPTURES bounds the recordings of a model
 * whose key keeps changing (each costs one step without a graph and one
 * recording): past it, graphs are turned off for good.
 *
 * Recording is a pass of forward and backward that runs nothing: the
 * table records every call, and each hook, instead of running, ends the
 * segment so far (one graph) and starts the next (graph_cut), noting
 * itself as the mark between the two. That pass and a real one enqueue
 * the same calls, because the model's own control flow does not depend on
 * what a hook does, and hooks with fixed_units point each unit where they
 * did the step before: once a step has started and ended with the same
 * pointers (the warm-up), they are the key's throughout a step, and the
 * recording, whose hooks do not run, sees them too. A step from the
 * recording launches segment 0, runs mark 0, and so on: the same calls
 * and the same hooks in the same order, with the pointers checked after
 * each hook. */
#define MAX_CAPTURES 16

static int graph_usable(const zt_model_t *m) {
  const zt_model_hooks_t *h = &m->hooks;
  int hooks = h->pre_forward || h->post_forward || h->pre_backward || h->post_backward;
  return m->graph.on && m->k->graph_begin && (!hooks || h->fixed_units);
}

static void graph_drop(zt_model_t *m) {
  zt_model_graph_t *g = &m->graph;
  for (int i = 0; i < g->nsegs; i++) m->k->graph_free(g->segs[i]);
  g->nsegs = 0;
}

static void graph_off(zt_model_t *m, const char *why) {
  snprintf(m->graph.why, sizeof m->graph.why, "%s", why);
  zt_log(ZT_LOG_WARN, "CUDA graphs off for this model (steps run call by call): %s", why);
  zt_model_set_graphs(m, 0);
}

/* 1 when the unit pointers are the key's. */
static int graph_same_units(const zt_model_t *m) {
  size_t U = (size_t)m->lay.num_units;
  return !memcmp(m->graph.ptrs, m->unit_params, U * sizeof(void *)) &&
         !memcmp(m->graph.ptrs + U, m->unit_grads, U * sizeof(void *));
}

/* 1 when the key of the step (B, T, scale, unit pointers) is the graph's;
 * otherwise it becomes the key, for the step that warms it up. */
static int graph_key(zt_model_t *m, int B, int T, float scale) {
  zt_model_graph_t *g = &m->graph;
  size_t U = (size_t)m->lay.num_units;
  if (!g->ptrs) g->ptrs = zt_xcalloc(2 * U, sizeof(void *));
  if (g->warm && g->B == B && g->T == T && memcmp(&g->scale, &scale, sizeof scale) == 0 &&
      graph_same_units(m))
    return 1;
  g->B = B, g->T = T, g->scale = scale;
  memcpy(g->ptrs, m->unit_params, U * sizeof(void *));
  memcpy(g->ptrs + U, m->unit_grads, U * sizeof(void *));
  return 0;
}

/* Appends a recorded segment and, unless it is the last, the mark after
 * it. */
static void graph_push(zt_model_graph_t *g, void *seg, const struct zt_model_mark *mark) {
  if (g->nsegs == g->cap) {
    g->cap = g->cap ? 2 * g->cap : 16;
    g->segs = zt_xrealloc(g->segs, (size_t)g->cap * sizeof *g->segs);
    g->marks = zt_xrealloc(g->marks, (size_t)g->cap * sizeof *g->marks);
  }
  if (mark) g->marks[g->nsegs] = *mark;
  g->segs[g->nsegs++] = seg;
}

/* A hook during the recording: the segment so far becomes a graph, a new
 * one begins. -1 (the pass stops) when the table cannot record it. */
static int graph_cut(zt_model_t *m, zt_hook_fn fn, const char *what, int unit) {
  zt_model_graph_t *g = &m->graph;
  void *x = m->k->graph_end(g->rec_fail, sizeof g->rec_fail);
  if (!x) return -1;
  struct zt_model_mark mk = {fn, what, unit};
  graph_push(g, x, &mk);
  return m->k->graph_begin(g->rec_fail, sizeof g->rec_fail) == 0 ? 0 : -1;
}

/* Records forward and backward into m->graph's segments. -1 with the
 * model's error for an error of the passes themselves; 1 when the table
 * could not record them (graphs are off then, the step still to run). */
static int graph_record(zt_model_t *m, int B, int T, float scale) {
  const zt_kernels_t *k = m->k;
  zt_model_graph_t *g = &m->graph;
  char why[200];
  if (g->captures >= MAX_CAPTURES) {
    snprintf(why, sizeof why, "the step's shape or buffers changed %d times", MAX_CAPTURES);
    graph_off(m, why);
    return 1;
  }
  if (k->graph_begin(why, sizeof why) != 0) {
    graph_off(m, why);
    return 1;
  }
  g->rec_fail[0] = 0;
  g->recording = 1;
  int rc = forward_enqueue(m, B, T, 1);
  if (rc == 0) rc = zt_model_backward(m, scale);
  g->recording = 0;
  void *x = k->graph_end(why, sizeof why);
  if (x) graph_push(g, x, NULL);
  if (g->rec_fail[0] || !x) {
    graph_off(m, g->rec_fail[0] ? g->rec_fail : why);
    return 1;
  }
  if (rc != 0) {
    graph_drop(m);
    return -1;
  }
  g->captures++;
  zt_log(ZT_LOG_INFO, "CUDA graphs: a step recorded as %d graph(s), batch %d x %d", g->nsegs, B,
         T);
  return 0;
}

/* A step from the recording: the segments, and between them the hooks.
 * 1, with nothing run, when the table says the recording is stale (its
 * settings or scratch buffers changed between steps). */
static int graph_run(zt_model_t *m, int B, int T) {
  zt_model_graph_t *g = &m->graph;
  for (int i = 0; i < g->nsegs; i++) {
    if (m->k->graph_launch(g->segs[i]) != 0) {
      if (i == 0) return 1;
      graph_off(m, "the kernel table changed during a step");
      return zt_err("step: the kernel table's settings changed during a step; the step is lost");
    }
    if (i == g->nsegs - 1) break;
    const struct zt_model_mark *mk = &g->marks[i];
    if (mk->fn(m->hooks.ctx, mk->unit) != 0) return zt_err_wrap("%s(unit %d)", mk->name, mk->unit);
    if (!graph_same_units(m)) { /* the hooks broke fixed_units: no graph can follow them */
      graph_off(m, "a hook moved a unit's buffers during a step");
      return zt_err("step: %s(unit %d) moved a unit's buffers, which its hooks' fixed_units "
                    "rules out; the step is lost", mk->name, mk->unit);
    }
  }
  g->replays++;
  m->acts->B = B, m->acts->T = T;
  m->acts->have_targets = 0; /* as the backward leaves it */
  return 0;
}

int zt_model_step(zt_model_t *m, const int *inputs, const int *targets, int B, int T,
                  float grad_scale, float *loss) {
  if (!targets) return zt_err("step: a training step needs targets");
  if (!graph_usable(m)) {
    if (zt_model_forward(m, inputs, targets, B, T, loss) != 0) return -1;
    return zt_model_backward(m, grad_scale);
  }
  if (put_batch(m, inputs, targets, B, T) != 0) return -1;
  zt_model_graph_t *g = &m->graph;
  int same = graph_key(m, B, T, grad_scale);
  if (g->nsegs && !same) graph_drop(m);
  if (!g->nsegs && same && graph_record(m, B, T, grad_scale) < 0) return -1;
  int rc = g->nsegs ? graph_run(m, B, T) : 1;
  if (rc < 0) return -1;
  if (rc == 1) { /* call by call: a new key, or a stale recording; the next step records */
    graph_drop(m);
    g->warm = 1;
    if (forward_enqueue(m, B, T, 1) != 0 || zt_model_backward(m, grad_scale) != 0) return -1;
  }
  if (loss) *loss = read_loss(m);
  return 0;
}

void zt_model_set_graphs(zt_model_t *m, int on) {
  zt_model_graph_t *g = &m->graph;
  if (!on) graph_drop(m);
  g->on = on != 0;
  g->warm = 0;
  if (on) g->why[0] = 0, g->captures = 0;
}
