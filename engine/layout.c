/*
 * layout.c: the model's configuration checks, its named views and its
 * deterministic initialisation (see layout.h).
 *
 * A block's tensors sit at the same offsets within every block unit; the
 * table k_block_spec below is the one list of them (name, kind, shape in
 * units of C, weight decay), used to build the views, to point the block
 * pointers of forward and backward, and to name tensors on export.
 */
#include "layout.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rng.h"
#include "zt_common.h"

static const struct {
  const char *name; /* after "h.<l>." */
  zt_tensor_kind_t kind;
  int rows, cols; /* in units of C; rows 0: a vector */
  int decay;
} k_block_spec[ZT_BLOCK_TENSORS] = {
    {"ln_1.weight", ZT_T_LN1W, 0, 1, 0},        {"ln_1.bias", ZT_T_LN1B, 0, 1, 0},
    {"attn.c_attn.weight", ZT_T_QKVW, 3, 1, 1}, {"attn.c_attn.bias", ZT_T_QKVB, 0, 3, 0},
    {"attn.c_proj.weight", ZT_T_ATTPROJW, 1, 1, 1}, {"attn.c_proj.bias", ZT_T_ATTPROJB, 0, 1, 0},
    {"ln_2.weight", ZT_T_LN2W, 0, 1, 0},        {"ln_2.bias", ZT_T_LN2B, 0, 1, 0},
    {"mlp.c_fc.weight", ZT_T_FCW, 4, 1, 1},     {"mlp.c_fc.bias", ZT_T_FCB, 0, 4, 0},
    {"mlp.c_proj.weight", ZT_T_FCPROJW, 1, 4, 1}, {"mlp.c_proj.bias", ZT_T_FCPROJB, 0, 1, 0},
};

void zt_layout_block_views(float *base, int C, size_t esz, zt_block_t *b) {
  float **dst[ZT_BLOCK_TENSORS] = {&b->ln1w, &b->ln1b, &b->qkvw, &b->qkvb, &b->attprojw,
                                   &b->attprojb, &b->ln2w, &b->ln2b, &b->fcw, &b->fcb,
                                   &b->fcprojw, &b->fcprojb};
  size_t off = 0;
  for (int i = 0; i < ZT_BLOCK_TENSORS; i++) {
    int rows = k_block_spec[i].rows ? k_block_spec[i].rows * C : 1;
    size_t n = (size_t)rows * k_block_spec[i].cols * C;
    *dst[i] = base ? (float *)((char *)base + off * esz) : NULL;
    off += n;
  }
}

/* ---- configuration --------------------------------------------------------- */

const char *const zt_lora_target_names[ZT_LORA_NTARGETS] = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

int zt_lora_target_index(const char *name) {
  for (int i = 0; name && i < ZT_LORA_NTARGETS; i++)
    if (!strcmp(name, zt_lora_target_names[i])) return i;
  return -1;
}

static int lora_config_check(const zt_model_config_t *c) {
  if (c->lora_r == 0) return 0;
  if (c->arch != ZT_ARCH_LLAMA) return zt_err("lora: needs model.arch llama");
  if (c->lora_r < 1 || c->lora_r > 4096)
    return zt_err("lora.r must be in [1, 4096] (got %d)", c->lora_r);
  if (!(c->lora_alpha > 0) || c->lora_alpha > 1e6f) return zt_err("lora.alpha must be in (0, 1e6]");
  if (!c->lora_targets || c->lora_targets >> ZT_LORA_NTARGETS)
    return zt_err("lora.target_modules: needs at least one of q_proj, k_proj, v_proj, o_proj, "
                  "gate_proj, up_proj, down_proj");
  return 0;
}

int zt_model_config_check(const zt_model_config_t *c) {
  if (c->n_layer < 1) return zt_err("n_layer must be >= 1 (got %d)", c->n_layer);
  if (c->n_head < 1) return zt_err("n_head must be >= 1 (got %d)", c->n_head);
  if (c->n_embd < 1) return zt_err("n_embd must be >= 1 (got %d)", c->n_embd);
  if (c->n_layer > ZT_MODEL_MAX_LAYER)
    return zt_err("n_layer must be <= %d (got %d)", ZT_MODEL_MAX_LAYER, c->n_layer);
  if (c->n_head > ZT_MODEL_MAX_HEAD)
    return zt_err("n_head must be <= %d (got %d)", ZT_MODEL_MAX_HEAD, c->n_head);
  if (c->n_embd > ZT_MODEL_MAX_EMBD)
    return zt_err("n_embd must be <= %d (got %d)", ZT_MODEL_MAX_EMBD, c->n_embd);
  if (c->n_embd % c->n_head != 0)
    return zt_err("n_embd (%d) must be divisible by n_head (%d)", c->n_embd, c->n_head);
  if (c->seq_len < 1 || c->seq_len > ZT_MODEL_MAX_SEQ)
    return zt_err("seq_len must be in [1, %d] (got %d)", ZT_MODEL_MAX_SEQ, c->seq_len);
  if (c->vocab_size < 2 || c->vocab_size > ZT_MODEL_MAX_VOCAB)
    return zt_err("vocab_size must be in [2, %d] (got %d)", ZT_MODEL_MAX_VOCAB, c->vocab_size);
  if (c->arch == ZT_ARCH_GPT2) return lora_config_check(c);
  if (c->arch != ZT_ARCH_LLAMA) return zt_err("unknown architecture %d", c->arch);
  if (c->n_kv_head < 1 || c->n_head % c->n_kv_head != 0)
    return zt_err("n_head (%d) must be a multiple of n_kv_head (%d)", c->n_head, c->n_kv_head);
  if (c->head_dim < 2 || c->head_dim % 2 || c->head_dim > ZT_MODEL_MAX_EMBD)
    return zt_err("head_dim must be even and in [2, %d] (got %d)", ZT_MODEL_MAX_EMBD,
                  c->head_dim);
  if ((long)c->n_head * c->head_dim > ZT_MODEL_MAX_EMBD)
    return zt_err("n_head x head_dim must be <= %d (got %ld)", ZT_MODEL_MAX_EMBD,
                  (long)c->n_head * c->head_dim);
  if (c->n_ff < 1 || c->n_ff > 4 * ZT_MODEL_MAX_EMBD)
    return zt_err("intermediate_size must be in [1, %d] (got %d)", 4 * ZT_MODEL_MAX_EMBD,
                  c->n_ff);
  if (!(c->rope_theta > 0) || !(c->norm_eps > 0))
    return zt_err("rope_theta and rms_norm_eps must be > 0");
  if (lora_config_check(c) != 0) return -1;
  if (c->rope_factor != 0 &&
      (!(c->rope_factor > 0) || !(c->rope_low_freq_factor > 0) ||
       !(c->rope_high_freq_factor > c->rope_low_freq_factor) || c->rope_original_max_pos < 1))
    return zt_err("rope_scaling: needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                  "original_max_position_embeddings >= 1");
  return 0;
}

static int pad_vocab(int V) { return (V + 63) / 64 * 64; }

/* The shape [out, in] of LoRA target i's projection. */
static void lora_target_shape(const zt_model_config_t *c, int i, int *out, int *in) {
  int C = c->n_embd, A = c->n_head * c->head_dim, KV = c->n_kv_head * c->head_dim, F = c->n_ff;
  static const int k_out[ZT_LORA_NTARGETS] = {0, 1, 1, 2, 3, 3, 2}; /* A, KV, C, F */
  static const int k_in[ZT_LORA_NTARGETS] = {2, 2, 2, 0, 2, 2, 3};
  int dims[4] = {A, KV, C, F};
  *out = dims[k_out[i]], *in = dims[k_in[i]];
}

size_t zt_model_param_count(const zt_model_config_t *c, int padded) {
  size_t C = (size_t)c->n_embd, L = (size_t)c->n_layer;
  if (c->lora_r > 0) {
    size_t block = 0;
    for (int i = 0; i < ZT_LORA_NTARGETS; i++) {
      int o, in;
      lora_target_shape(c, i, &o, &in);
      if (c->lora_targets >> i & 1) block += (size_t)c->lora_r * (size_t)(o + in);
    }
    return L * block + (padded ? 2 * ZT_LORA_PAD : 0);
  }
  size_t V = (size_t)(padded ? pad_vocab(c->vocab_size) : c->vocab_size);
  if (c->arch == ZT_ARCH_LLAMA) {
    size_t QKV = (size_t)zt_model_qkv_width(c), A = (size_t)zt_model_att_width(c);
    size_t F = (size_t)c->n_ff;
    size_t block = C + QKV * C + (c->qkv_bias ? QKV : 0) + A * C + C + 3 * F * C;
    return V * C + L * block + C + (c->tie_embed ? 0 : V * C);
  }
  return V * C + (size_t)c->seq_len * C + L * (12 * C * C + 13 * C) + 2 * C;
}

/* ---- views ------------------------------------------------------------------- */

static void add_tensor(zt_layout_t *l, const char *name, zt_tensor_kind_t kind, int unit,
                       int layer, size_t *unit_off, int rows, int cols, size_t n, int decay) {
  zt_tensor_t *t = &l->tensors[l->num_tensors++];
  snprintf(t->name, sizeof t->name, "%s", name);
  t->kind = kind;
  t->unit = unit;
  t->layer = layer;
  t->unit_off = *unit_off;
  t->off = l->unit_off[unit] + *unit_off;
  t->n = n;
  t->rows = rows;
  t->cols = cols;
  t->decay = decay;
  *unit_off += n;
}

/* A llama block's tensors, in unit order: (name after "model.layers.<l>.",
 * kind, rows, cols; rows 1: a vector). */
typedef struct {
  const char *name;
  zt_tensor_kind_t kind;
  int rows, cols, decay;
} lspec_t;

static int llama_block_spec(const zt_model_config_t *c, lspec_t *s) {
  int C = c->n_embd, A = c->n_head * c->head_dim, KV = c->n_kv_head * c->head_dim, F = c->n_ff;
  int n = 0;
  s[n++] = (lspec_t){"input_layernorm.weight", ZT_T_RMS1W, 1, C, 0};
  s[n++] = (lspec_t){"self_attn.q_proj.weight", ZT_T_QW, A, C, 1};
  s[n++] = (lspec_t){"self_attn.k_proj.weight", ZT_T_KW, KV, C, 1};
  s[n++] = (lspec_t){"self_attn.v_proj.weight", ZT_T_VW, KV, C, 1};
  if (c->qkv_bias) {
    s[n++] = (lspec_t){"self_attn.q_proj.bias", ZT_T_QB, 1, A, 0};
    s[n++] = (lspec_t){"self_attn.k_proj.bias", ZT_T_KB, 1, KV, 0};
    s[n++] = (lspec_t){"self_attn.v_proj.bias", ZT_T_VB, 1, KV, 0};
  }
  s[n++] = (lspec_t){"self_attn.o_proj.weight", ZT_T_OW, C, A, 1};
  s[n++] = (lspec_t){"post_attention_layernorm.weight", ZT_T_RMS2W, 1, C, 0};
  s[n++] = (lspec_t){"mlp.gate_proj.weight", ZT_T_GATEW, F, C, 1};
  s[n++] = (lspec_t){"mlp.up_proj.weight", ZT_T_UPW, F, C, 1};
  s[n++] = (lspec_t){"mlp.down_proj.weight", ZT_T_DOWNW, C, F, 1};
  return n;
}

void zt_layout_lblock_views(float *base, const zt_model_config_t *c, size_t esz,
                            zt_lblock_t *b) {
  lspec_t sp[16];
  int n = llama_block_spec(c, sp);
  memset(b, 0, sizeof *b);
  size_t off = 0;
  for (int i = 0; i < n; i++) {
    float *p = base ? (float *)((char *)base + off * esz) : NULL;
    switch (sp[i].kind) {
      case ZT_T_RMS1W: b->rms1w = p; break;
      case ZT_T_QW: b->qkvw = p; break;
      case ZT_T_QB: b->qkvb = p; break;
      case ZT_T_OW: b->ow = p; break;
      case ZT_T_RMS2W: b->rms2w = p; break;
      case ZT_T_GATEW: b->gateupw = p; break;
      case ZT_T_DOWNW: b->downw = p; break;
      default: break;
    }
    off += (size_t)sp[i].rows * sp[i].cols;
  }
}

/* GPT-2's block table as absolute shapes. */
static int gpt2_block_spec(const zt_model_config_t *c, lspec_t *s) {
  int C = c->n_embd;
  for (int i = 0; i < ZT_BLOCK_TENSORS; i++)
    s[i] = (lspec_t){k_block_spec[i].name, k_block_spec[i].kind,
                     k_block_spec[i].rows ? k_block_spec[i].rows * C : 1, k_block_spec[i].cols * C,
                     k_block_spec[i].decay};
  return ZT_BLOCK_TENSORS;
}

/* The adapters' layout (layout.h). */
static void lora_build(zt_layout_t *l, const zt_model_config_t *c) {
  int L = c->n_layer;
  l->tensors = zt_xcalloc((size_t)(2 + L * 2 * ZT_LORA_NTARGETS), sizeof(zt_tensor_t));
  size_t off = 0, uo;
  char name[128];
  for (int u = 0; u < L + 2; u++) {
    l->unit_off[u] = off;
    uo = 0;
    if (u == 0 || u == L + 1) {
      snprintf(name, sizeof name, "lora.pad.%d", u);
      add_tensor(l, name, ZT_T_LORA_PAD, u, -1, &uo, 1, ZT_LORA_PAD, ZT_LORA_PAD, 0);
    }
    for (int i = 0; u > 0 && u <= L && i < ZT_LORA_NTARGETS; i++) {
      if (!(c->lora_targets >> i & 1)) continue;
      int o, in;
      lora_target_shape(c, i, &o, &in);
      const char *mod = i < 4 ? "self_attn" : "mlp";
      snprintf(name, sizeof name, "base_model.model.model.layers.%d.%s.%s.lora_A.weight", u - 1,
               mod, zt_lora_target_names[i]);
      add_tensor(l, name, ZT_T_LORA_A, u, u - 1, &uo, c->lora_r, in, (size_t)c->lora_r * in, 1);
      snprintf(name, sizeof name, "base_model.model.model.layers.%d.%s.%s.lora_B.weight", u - 1,
               mod, zt_lora_target_names[i]);
      add_tensor(l, name, ZT_T_LORA_B, u, u - 1, &uo, o, c->lora_r, (size_t)o * c->lora_r, 1);
    }
    l->unit_size[u] = uo;
    off += uo;
  }
  l->num_params = off;
}

/* Unit 0 holds the embeddings (GPT-2's position table too), units 1..L the
 * blocks, unit L+1 the final norm and, for an untied llama, the LM head.
 * Llama's tensors have Hugging Face's names, so checkpoints and files of
 * that layout need no table. */
int zt_layout_build(zt_layout_t *l, const zt_model_config_t *cfg) {
  memset(l, 0, sizeof *l);
  if (zt_model_config_check(cfg) != 0) return -1;
  int C = cfg->n_embd, L = cfg->n_layer, llama = cfg->arch == ZT_ARCH_LLAMA;
  l->cfg = *cfg;
  l->Vp = pad_vocab(cfg->vocab_size);
  l->num_units = L + 2;
  l->unit_off = zt_xcalloc((size_t)l->num_units, sizeof(size_t));
  l->unit_size = zt_xcalloc((size_t)l->num_units, sizeof(size_t));
  if (cfg->lora_r > 0) {
    lora_build(l, cfg);
    return 0;
  }
  lspec_t sp[16];
  int nb = llama ? llama_block_spec(cfg, sp) : gpt2_block_spec(cfg, sp);
  l->tensors = zt_xcalloc((size_t)(2 + L * nb + 2), sizeof(zt_tensor_t));

  size_t off = 0, uo = 0;
  char name[64];
  add_tensor(l, llama ? "model.embed_tokens.weight" : "wte", ZT_T_WTE, 0, -1, &uo, l->Vp, C,
             (size_t)l->Vp * C, 1);
  if (!llama)
    add_tensor(l, "wpe", ZT_T_WPE, 0, -1, &uo, cfg->seq_len, C, (size_t)cfg->seq_len * C, 1);
  l->unit_size[0] = uo;
  off += uo;
  for (int b = 0; b < L; b++) {
    int u = 1 + b;
    l->unit_off[u] = off;
    uo = 0;
    for (int i = 0; i < nb; i++) {
      snprintf(name, sizeof name, llama ? "model.layers.%d.%s" : "h.%d.%s", b, sp[i].name);
      add_tensor(l, name, sp[i].kind, u, b, &uo, sp[i].rows, sp[i].cols,
                 (size_t)sp[i].rows * sp[i].cols, sp[i].decay);
    }
    l->unit_size[u] = uo;
    off += uo;
  }
  int u = L + 1;
  l->unit_off[u] = off;
  uo = 0;
  if (llama) {
    add_tensor(l, "model.norm.weight", ZT_T_NORMW, u, -1, &uo, 1, C, (size_t)C, 0);
    if (!cfg->tie_embed)
      add_tensor(l, "lm_head.weight", ZT_T_HEADW, u, -1, &uo, l->Vp, C, (size_t)l->Vp * C, 1);
  } else {
    add_tensor(l, "ln_f.weight", ZT_T_LNFW, u, -1, &uo, 1, C, (size_t)C, 0);
    add_tensor(l, "ln_f.bias", ZT_T_LNFB, u, -1, &uo, 1, C, (size_t)C, 0);
  }
  l->unit_size[u] = uo;
  l->num_params = off + uo;
  return 0;
}

void zt_layout_free(zt_layout_t *l) {
  free(l->unit_off);
  free(l->unit_size);
  free(l->tensors);
  memset(l, 0, sizeof *l);
}

const zt_tensor_t *zt_layout_find(const zt_layout_t *l, const char *name) {
  for (int i = 0; i < l->num_tensors; i++)
    if (strcmp(l->tensors[i].name, name) == 0) return &l->tensors[i];
  return NULL;
}

/* ---- initialisation ------------------------------------------------------- */

static void fill_normal(zt_rng_t *r, float *p, size_t n, double std) {
  for (size_t i = 0; i < n; i++) p[i] = (float)(zt_rng_normal(r) * std);
}

static void fill_const(float *p, size_t n, float v) {
  for (size_t i = 0; i < n; i++) p[i] = v;
}

void zt_layout_init_unit(const zt_layout_t *l, uint64_t seed, int u, float *dst) {
  zt_rng_t r;
  zt_rng_seed(&r, seed, (uint64_t)u);
  double std = 0.02, proj_std = 0.02 / sqrt(2.0 * l->cfg.n_layer);
  size_t C = (size_t)l->cfg.n_embd, V = (size_t)l->cfg.vocab_size;
  for (int i = 0; i < l->num_tensors; i++) {
    const zt_tensor_t *t = &l->tensors[i];
    if (t->unit != u) continue;
    float *p = dst + t->unit_off;
    switch (t->kind) {
      case ZT_T_LORA_A: {
        double bound = 1.0 / sqrt((double)t->cols);
        for (size_t j = 0; j < t->n; j++) p[j] = (float)((2.0 * zt_rng_uniform(&r) - 1.0) * bound);
        break;
      }
      case ZT_T_WTE:
      case ZT_T_HEADW:
        fill_normal(&r, p, V * C, std);
        fill_const(p + V * C, t->n - V * C, 0.0f);
        break;
      case ZT_T_WPE:
      case ZT_T_QKVW:
      case ZT_T_FCW:
      case ZT_T_QW:
      case ZT_T_KW:
      case ZT_T_VW:
      case ZT_T_GATEW:
      case ZT_T_UPW:
        fill_normal(&r, p, t->n, std);
        break;
      case ZT_T_ATTPROJW:
      case ZT_T_FCPROJW:
      case ZT_T_OW:
      case ZT_T_DOWNW:
        fill_normal(&r, p, t->n, proj_std);
        break;
      case ZT_T_LN1W:
      case ZT_T_LN2W:
      case ZT_T_LNFW:
      case ZT_T_RMS1W:
      case ZT_T_RMS2W:
      case ZT_T_NORMW:
        fill_const(p, t->n, 1.0f);
        break;
      default: /* biases and LayerNorm biases */
        fill_const(p, t->n, 0.0f);
        break;
    }
  }
}
