/*
 * layout.h: the GPT-2 model's configuration and parameter layout, without
 * any arithmetic.
 *
 * All parameters live in ONE logical flat fp32 buffer, grouped into units,
 * each unit contiguous:
 *
 *   unit 0        embeddings: wte [Vp, C], wpe [T, C]
 *   unit 1 + l    block l:    ln_1 w,b [C]; attn.c_attn w [3C, C], b [3C];
 *                             attn.c_proj w [C, C], b [C]; ln_2 w,b [C];
 *                             mlp.c_fc w [4C, C], b [4C];
 *                             mlp.c_proj w [C, 4C], b [C]
 *   unit L + 1    final LayerNorm: ln_f w,b [C]
 *
 * Linear weights are [out, in] (out = in @ W^T + b). The vocabulary is
 * padded to Vp, the next multiple of 64, for aligned matmuls; pad rows of
 * wte are zero at init, get zero gradient and never affect the loss. Every
 * tensor has a name (Hugging Face GPT-2 names: "wte", "h.3.attn.c_attn.weight",
 * "ln_f.bias", ...) and a view entry (zt_tensor_t) with its offsets in the
 * flat buffer and in its unit.
 *
 * Who uses this without the model: the job spec parser (configuration
 * checks, zcoord), checkpoint export (tensor names and shapes, zctl), and
 * every rank initialising only the units it holds (zt_layout_init_unit is
 * a pure function of the seed, the unit and the configuration). None of
 * them links the kernels.
 */
#ifndef ZT_LAYOUT_H
#define ZT_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "zt_common.h"

/* model.arch. */
#define ZT_ARCH_GPT2 0
#define ZT_ARCH_LLAMA 1

typedef struct zt_model_config {
  int n_layer;
  int n_head;
  int n_embd;
  int seq_len;    /* maximum T (size of wpe) */
  int vocab_size; /* unpadded */
  /* The Llama architecture (arch ZT_ARCH_LLAMA; all 0 for GPT-2, the
   * default): Hugging Face LlamaConfig's num_key_value_heads, head_dim,
   * intermediate_size, rope_theta, rms_norm_eps, tie_word_embeddings and
   * attention_bias (Qwen2's q/k/v biases). */
  int arch;
  int n_kv_head;
  int head_dim;
  int n_ff;
  float rope_theta;
  float norm_eps;
  int tie_embed;
  int qkv_bias;
  /* Llama 3's rope_scaling (rope_type "llama3"); rope_factor 0: none. */
  float rope_factor, rope_low_freq_factor, rope_high_freq_factor;
  int rope_original_max_pos;
  /* Hugging Face's max_position_embeddings (llama; 0: not given, seq_len
   * stands for it): kept so that an export says what its source said. */
  int max_pos;
  /* LoRA (lora.h; llama only): rank r (0: none), alpha, and which of a
   * block's projections get adapters (ZT_LORA_* bits). With lora_r > 0 the
   * trainable parameters, and so this configuration's layout, are the
   * adapters; the base model is zt_model_config_base's. */
  int lora_r;
  float lora_alpha;
  unsigned lora_targets;
} zt_model_config_t;

/* The projections LoRA can adapt, by PEFT's target_modules names, in a
 * block's order. */
#define ZT_LORA_NTARGETS 7
#define ZT_LORA_DEFAULT_TARGETS 0x5u /* q_proj, v_proj (PEFT's default for llama) */
extern const char *const zt_lora_target_names[ZT_LORA_NTARGETS];
/* The index in zt_lora_target_names of a target's name; -1 for none. */
int zt_lora_target_index(const char *name);

/* The configuration without LoRA: the model the adapters adapt. */
static inline zt_model_config_t zt_model_config_base(const zt_model_config_t *c) {
  zt_model_config_t b = *c;
  b.lora_r = 0, b.lora_alpha = 0, b.lora_targets = 0;
  return b;
}

/* The kind of a named tensor; one per parameter group. */
typedef enum {
  ZT_T_WTE,
  ZT_T_WPE,
  ZT_T_LN1W,
  ZT_T_LN1B,
  ZT_T_QKVW,
  ZT_T_QKVB,
  ZT_T_ATTPROJW,
  ZT_T_ATTPROJB,
  ZT_T_LN2W,
  ZT_T_LN2B,
  ZT_T_FCW,
  ZT_T_FCB,
  ZT_T_FCPROJW,
  ZT_T_FCPROJB,
  ZT_T_LNFW,
  ZT_T_LNFB,
  /* llama */
  ZT_T_RMS1W,
  ZT_T_QW,
  ZT_T_KW,
  ZT_T_VW,
  ZT_T_QB,
  ZT_T_KB,
  ZT_T_VB,
  ZT_T_OW,
  ZT_T_RMS2W,
  ZT_T_GATEW,
  ZT_T_UPW,
  ZT_T_DOWNW,
  ZT_T_NORMW,
  ZT_T_HEADW,
  /* LoRA adapters: A [r, in], B [out, r]; a unit with no adapter holds
   * one small placeholder that nothing reads (zero, never updated). */
  ZT_T_LORA_A,
  ZT_T_LORA_B,
  ZT_T_LORA_PAD,
  ZT_T_NKINDS
} zt_tensor_kind_t;

/* A named view into the flat parameter buffer. */
typedef struct zt_tensor {
  char name[96];
  zt_tensor_kind_t kind;
  int unit;        /* which unit holds it */
  int layer;       /* block index, -1 outside blocks */
  size_t off;      /* element offset in the flat buffer */
  size_t unit_off; /* element offset within its unit */
  size_t n;        /* element count (padded for wte) */
  int rows, cols;  /* shape; rows == 1 for vectors */
  int decay;       /* 1 when AdamW weight decay applies (2-D weights) */
} zt_tensor_t;

/* Number of tensors in a block unit. */
#define ZT_BLOCK_TENSORS 12

typedef struct zt_layout {
  zt_model_config_t cfg;
  int Vp;               /* padded vocabulary */
  int num_units;        /* n_layer + 2 */
  size_t *unit_off;     /* [num_units] offset of each unit in the flat buffer */
  size_t *unit_size;    /* [num_units] elements per unit */
  size_t num_params;    /* total elements of the flat buffer (padded vocab) */
  zt_tensor_t *tensors; /* all named views, in layout order */
  int num_tensors;
} zt_layout_t;

/* The largest value of each field of a configuration, one definition for
 * every place that accepts one (a job spec, a checkpoint's manifest). */
#define ZT_MODEL_MAX_LAYER 1024
#define ZT_MODEL_MAX_HEAD 1024
#define ZT_MODEL_MAX_EMBD 65536
#define ZT_MODEL_MAX_SEQ (1 << 20)
#define ZT_MODEL_MAX_VOCAB (1 << 20) /* ids past 65,535 need shards of version 2 (data.h) */

/* Checks a configuration: each field in [1, its ZT_MODEL_MAX_*] (vocab_size
 * from 2), n_embd divisible by n_head; for llama also n_head divisible by
 * n_kv_head, an even head_dim, n_ff >= 1, rope_theta > 0, norm_eps > 0. */
int zt_model_config_check(const zt_model_config_t *cfg);

/* Parameter count. padded == 0: as GPT-2 reports it (vocab_size rows of wte);
 * padded == 1: the flat buffer size (Vp rows). */
size_t zt_model_param_count(const zt_model_config_t *cfg, int padded);

/* Builds the layout of a (checked) configuration; free with
 * zt_layout_free. With LoRA (lora_r > 0) it is the adapters' layout: units
 * as the base model's (0, the blocks, L + 1), a block's unit holding, for
 * each target in ZT_LORA order, lora_A [r, in] then lora_B [out, r] under
 * PEFT's names ("base_model.model.model.layers.<l>.self_attn.q_proj.
 * lora_A.weight"), and units 0 and L + 1 one placeholder each,
 * "lora.pad.<u>" of ZT_LORA_PAD elements. */
#define ZT_LORA_PAD 8
ZT_MUST_CHECK int zt_layout_build(zt_layout_t *l, const zt_model_config_t *cfg);
void zt_layout_free(zt_layout_t *l);

/* The named view, or NULL when no tensor has the name. */
const zt_tensor_t *zt_layout_find(const zt_layout_t *l, const char *name);

/* Deterministic initialisation of unit u into dst (unit_size[u] elements):
 * LoRA's as PEFT's: lora_A uniform in +-1/sqrt(in) (kaiming_uniform with
 * a = sqrt(5)), lora_B and placeholders 0; else weights N(0, 0.02), the residual projections (attn.c_proj, mlp.c_proj)
 * N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm weight 1 and bias 0, pad
 * rows of wte 0. The values depend only on (seed, u) and the configuration,
 * so any process can initialise just the units it holds. */
void zt_layout_init_unit(const zt_layout_t *l, uint64_t seed, int u, float *dst);

/* The views of one block's tensors from the unit's base pointer (any of
 * its buffers: parameters, gradients), for elements of esz bytes (4, or 2
 * for parameters in bf16 storage, zt_kernels.h). */
typedef struct zt_block {
  float *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb;
  float *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
} zt_block_t;

void zt_layout_block_views(float *base, int C, size_t esz, zt_block_t *b);

/* A llama block's views (arch ZT_ARCH_LLAMA): qkvw is q_proj's weight,
 * with k_proj's and v_proj's right after it, so it is the fused
 * [(NH + 2 NKV) HD, C] matrix; qkvb likewise (NULL without
 * attention_bias); gateupw is gate_proj's weight with up_proj's after it,
 * the fused [2 n_ff, C] matrix. */
typedef struct zt_lblock {
  float *rms1w, *qkvw, *qkvb, *ow, *rms2w, *gateupw, *downw;
} zt_lblock_t;

void zt_layout_lblock_views(float *base, const zt_model_config_t *c, size_t esz, zt_lblock_t *b);

/* The widths a llama block works with: q, k and v together; the attention
 * output (NH x HD). */
static inline int zt_model_qkv_width(const zt_model_config_t *c) {
  return c->arch == ZT_ARCH_LLAMA ? (c->n_head + 2 * c->n_kv_head) * c->head_dim
                                  : 3 * c->n_embd;
}
static inline int zt_model_att_width(const zt_model_config_t *c) {
  return c->arch == ZT_ARCH_LLAMA ? c->n_head * c->head_dim : c->n_embd;
}

#endif
