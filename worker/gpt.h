/*
 * gpt.h: the GPT-2 model on the CPU: parameters, forward, backward.
 *
 * Architecture: token + position embeddings, n_layer pre-LN transformer
 * blocks (LayerNorm, causal multi-head attention, residual, LayerNorm, GELU
 * MLP with 4x width, residual), a final LayerNorm and a language-model head
 * tied to the token embedding. The vocabulary is padded to a multiple of 64
 * (Vp) for the matmuls; padded rows of the embedding stay zero and padded
 * logits are never part of the softmax.
 *
 * Parameters are grouped into units, each one contiguous fp32 buffer:
 *
 *   unit 0        wte [Vp, C], wpe [T, C]
 *   unit 1 + l    block l: ln1w, ln1b [C], qkvw [3C, C], qkvb [3C],
 *                 attprojw [C, C], attprojb [C], ln2w, ln2b [C],
 *                 fcw [4C, C], fcb [4C], fcprojw [C, 4C], fcprojb [C]
 *   unit L + 1    lnfw, lnfb [C]
 *
 * The model reads unit u's parameters through unit_params[u] and adds its
 * gradients into unit_grads[u]; both pointers belong to the caller, who may
 * point them anywhere before each use (ZeRO stage 3 gathers a unit into a
 * temporary buffer just before it is needed). The hooks tell the caller when
 * a unit is about to be used and when its gradient is complete.
 *
 * Linear weights are [out, in] (y = x W^T + b), as in llm.c; matmuls go
 * through CBLAS (OpenBLAS), everything else is OpenMP loops with static
 * schedules and no atomics, so results are bit-identical for a fixed thread
 * count.
 */
#ifndef ZT_GPT_H
#define ZT_GPT_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
  int n_layer, n_head, n_embd, seq_len, vocab_size;
  int padded_vocab; /* derived: vocab_size rounded up to a multiple of 64 */
} zt_gpt_config;

/* Named tensors of one unit, in layout order. */
enum {
  ZT_GPT_WTE, ZT_GPT_WPE,                                          /* unit 0 */
  ZT_GPT_LN1W, ZT_GPT_LN1B, ZT_GPT_QKVW, ZT_GPT_QKVB, ZT_GPT_ATTPROJW, ZT_GPT_ATTPROJB,
  ZT_GPT_LN2W, ZT_GPT_LN2B, ZT_GPT_FCW, ZT_GPT_FCB, ZT_GPT_FCPROJW, ZT_GPT_FCPROJB, /* blocks */
  ZT_GPT_LNFW, ZT_GPT_LNFB,                                        /* final unit */
  ZT_GPT_NTENSORS
};

typedef struct {
  int tensor;   /* ZT_GPT_* */
  size_t off;   /* within the unit */
  size_t n;
  int decay;    /* weight decay applies (matmul weights and embeddings) */
} zt_gpt_view;

typedef struct {
  void (*pre_forward)(void *ctx, int unit);   /* unit's params must be readable */
  void (*post_forward)(void *ctx, int unit);  /* forward is done with them */
  void (*pre_backward)(void *ctx, int unit);  /* params readable, grads writable */
  void (*post_backward)(void *ctx, int unit); /* unit's gradient is complete */
  void *ctx;
} zt_gpt_hooks;

typedef struct zt_gpt zt_gpt_t;

struct zt_gpt {
  zt_gpt_config cfg;
  int n_units;
  size_t *unit_size;  /* elements per unit */
  float **unit_params;
  float **unit_grads;
  zt_gpt_hooks hooks;
  int B, T;           /* activation capacity */
  float *acts;        /* forward activations */
  float *grad_acts;   /* their gradients */
  size_t acts_n;
  int cur_B, cur_T;   /* shape of the last forward */
  const int *cur_targets, *cur_inputs;
};

/* Checks the config and fills padded_vocab; -1 with a message naming the
 * offending field. */
int zt_gpt_config_check(zt_gpt_config *cfg);
/* Creates a model with activation memory for micro-batches of B x T. No
 * parameter memory is allocated: the caller points unit_params/grads. */
int zt_gpt_create(const zt_gpt_config *cfg, int B, int T, zt_gpt_t **out);
void zt_gpt_free(zt_gpt_t *m);

size_t zt_gpt_unit_size(const zt_gpt_config *cfg, int unit);
int zt_gpt_num_units(const zt_gpt_config *cfg);
/* Views of a unit's named tensors; returns their number. */
int zt_gpt_unit_views(const zt_gpt_config *cfg, int unit, zt_gpt_view *views);
/* Parameters as GPT-2 counts them (unpadded vocabulary), and the padded
 * total actually stored. */
size_t zt_gpt_num_params(const zt_gpt_config *cfg);
size_t zt_gpt_num_params_padded(const zt_gpt_config *cfg);

/* Writes unit u's initial values (GPT-2 init: N(0, 0.02), residual
 * projections N(0, 0.02/sqrt(2 L)), biases 0, LayerNorm 1/0, padded
 * embedding rows 0) into dst. Depends only on (seed, unit). */
void zt_gpt_init_unit(const zt_gpt_config *cfg, int unit, uint64_t seed, float *dst);

/* Forward over B x T tokens (B <= capacity, T <= capacity); returns the mean
 * cross-entropy over all B*T targets (targets may be NULL: no loss, 0). */
float zt_gpt_forward(zt_gpt_t *m, const int *inputs, const int *targets, int B, int T);
/* Backward of the last forward; adds scale * d(mean loss)/d(params) into
 * unit_grads. */
void zt_gpt_backward(zt_gpt_t *m, float scale);

/* Threads for the OpenMP loops and OpenBLAS (<= 0 leaves the default). */
void zt_gpt_set_threads(int n);

#endif
