/*
 * model.h: the GPT-2 model (forward, backward, initialisation, layout).
 *
 * The model is the GPT-2 architecture as in llm.c: token and position
 * embeddings, n_layer pre-LN transformer blocks (LayerNorm, causal multi-head
 * attention, residual, LayerNorm, GELU MLP of width 4C, residual), a final
 * LayerNorm and a language-model head tied to the token embedding. All
 * arithmetic goes through a kernel table (kernels/zt_kernels.h), so the same
 * code runs on the fast CPU kernels, the reference kernels and, later, CUDA.
 *
 * Parameter layout. All parameters live in ONE logical flat fp32 buffer,
 * grouped into units, each unit contiguous:
 *
 *   unit 0        embeddings: wte [Vp, C], wpe [T, C]
 *   unit 1 + l    block l:    ln_1 w,b [C]; attn.c_attn w [3C, C], b [3C];
 *                             attn.c_proj w [C, C], b [C]; ln_2 w,b [C];
 *                             mlp.c_fc w [4C, C], b [4C];
 *                             mlp.c_proj w [C, 4C], b [C]
 *   unit L + 1    final LayerNorm: ln_f w,b [C]
 *
 * Linear weights are [out, in] (out = in @ W^T + b). The vocabulary is padded
 * to Vp, the next multiple of 64, for aligned matmuls; pad rows of wte are
 * zero at init, get zero gradient and never affect the loss (their logits
 * are excluded from the softmax). Every tensor has a name (Hugging Face GPT-2
 * names: "wte", "h.3.attn.c_attn.weight", "ln_f.bias", ...) and a view entry
 * (zt_tensor_t) with its offsets in the flat buffer and in its unit.
 *
 * Sharding. The model never computes addresses from the flat buffer during
 * forward and backward: it reads unit u's parameters from m->unit_params[u]
 * and accumulates its gradients into m->unit_grads[u]. By default these
 * point into the flat buffers m->params and m->grads, but a caller may
 * repoint them at any time between calls, or from a hook (ZeRO stage 3
 * gathers a unit into a temporary buffer in pre_forward / pre_backward).
 * With ZT_MODEL_NO_PARAMS / ZT_MODEL_NO_GRADS the flat buffers are not
 * allocated at all and the caller must supply every unit pointer.
 *
 * Hooks, in call order for one forward + backward:
 *
 *   forward:  pre_forward(0), pre_forward(1) .. pre_forward(L+1); post_forward
 *             is called for each block and the final LayerNorm when the
 *             forward has finished with it, and for unit 0 after the LM head
 *             (unit 0 is used twice: embedding, then tied head).
 *   backward: pre_backward(0) (the LM head needs wte first), then
 *             pre_backward(L+1), pre_backward(L) .. pre_backward(1);
 *             post_backward(L+1), post_backward(L) .. post_backward(1) as soon
 *             as each unit's gradient is complete, and post_backward(0) last,
 *             after the embedding backward (wte receives gradient from both
 *             the head and the embedding).
 *
 * A hook returning -1 aborts the forward or backward, which returns -1 with
 * the hook's error message.
 *
 * Memory. Parameters, gradients and activations live in the kernel table's
 * memory (k->alloc): host memory for the CPU tables, device memory for the
 * CUDA table. Inputs and targets are passed as host arrays and uploaded by
 * zt_model_forward, the loss comes back as a host float; every pointer the
 * model exposes (params, grads, unit pointers, logits) is table memory, and
 * pointers a caller installs must be too.
 */
#ifndef ZT_MODEL_H
#define ZT_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "zt_kernels.h"

typedef struct zt_model_config {
  int n_layer;
  int n_head;
  int n_embd;
  int seq_len;    /* maximum T (size of wpe) */
  int vocab_size; /* unpadded */
} zt_model_config_t;

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
  ZT_T_NKINDS
} zt_tensor_kind_t;

/* A named view into the flat parameter buffer. */
typedef struct zt_tensor {
  char name[48];
  zt_tensor_kind_t kind;
  int unit;        /* which unit holds it */
  int layer;       /* block index, -1 outside blocks */
  size_t off;      /* element offset in the flat buffer */
  size_t unit_off; /* element offset within its unit */
  size_t n;        /* element count (padded for wte) */
  int rows, cols;  /* shape; rows == 1 for vectors */
  int decay;       /* 1 when AdamW weight decay applies (2-D weights) */
} zt_tensor_t;

typedef struct zt_model_hooks {
  void *ctx;
  int (*pre_forward)(void *ctx, int unit);
  int (*post_forward)(void *ctx, int unit);
  int (*pre_backward)(void *ctx, int unit);
  int (*post_backward)(void *ctx, int unit);
} zt_model_hooks_t;

#define ZT_MODEL_NO_PARAMS 1u /* do not allocate the flat parameter buffer */
#define ZT_MODEL_NO_GRADS 2u  /* do not allocate the flat gradient buffer */

struct zt_acts; /* activations, private to model.c */

typedef struct zt_model {
  zt_model_config_t cfg;
  int Vp;                     /* padded vocabulary */
  int max_B, max_T;           /* activation capacity */
  const zt_kernels_t *k;

  int num_units;              /* n_layer + 2 */
  size_t *unit_off;           /* [num_units] offset of each unit in the flat buffer */
  size_t *unit_size;          /* [num_units] elements per unit */
  size_t num_params;          /* total elements of the flat buffer (padded vocab) */

  float *params;              /* flat buffers (NULL with the NO_* flags) */
  float *grads;
  float **unit_params;        /* [num_units] where forward/backward read unit u */
  float **unit_grads;         /* [num_units] where backward accumulates unit u */

  zt_tensor_t *tensors;       /* all named views, in layout order */
  int num_tensors;

  zt_model_hooks_t hooks;
  struct zt_acts *acts;
} zt_model_t;

/* Checks a configuration: positive sizes, n_embd divisible by n_head,
 * vocab_size <= 65536 (tokens are stored as uint16). */
int zt_model_config_check(const zt_model_config_t *cfg);

/* Creates a model with activations for batches of up to B x T (T <= seq_len).
 * The parameters are not initialised; call zt_model_init. k NULL means the
 * reference CPU table (for callers that only need the layout). */
int zt_model_create(zt_model_t **out, const zt_model_config_t *cfg, int B, int T,
                    const zt_kernels_t *k, unsigned flags);
void zt_model_free(zt_model_t *m);

static inline int zt_model_num_units(const zt_model_t *m) { return m->num_units; }
static inline size_t zt_model_unit_size(const zt_model_t *m, int u) { return m->unit_size[u]; }
static inline size_t zt_model_unit_offset(const zt_model_t *m, int u) { return m->unit_off[u]; }

/* Parameter count. padded == 0: as GPT-2 reports it (vocab_size rows of wte);
 * padded == 1: the flat buffer size (Vp rows). */
size_t zt_model_param_count(const zt_model_config_t *cfg, int padded);
/* Bytes of activation memory the model allocated. */
size_t zt_model_activation_bytes(const zt_model_t *m);

/* The named views. zt_model_find returns NULL when no tensor has the name. */
const zt_tensor_t *zt_model_find(const zt_model_t *m, const char *name);

/* Deterministic initialisation of unit u into dst (unit_size(u) elements):
 * weights N(0, 0.02), the residual projections (attn.c_proj, mlp.c_proj)
 * N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm weight 1 and bias 0, pad
 * rows of wte 0. The values depend only on (seed, u) and the configuration,
 * so any process can initialise just the units it holds. */
void zt_model_init_unit(const zt_model_t *m, uint64_t seed, int u, float *dst);
/* Initialises every unit through m->unit_params (on the host, copied into
 * the kernel table's memory). Returns 0, or -1 when out of host memory. */
int zt_model_init(zt_model_t *m, uint64_t seed);

/* Sets the hooks (NULL clears them). */
void zt_model_set_hooks(zt_model_t *m, const zt_model_hooks_t *hooks);

/* Forward pass on inputs [B, T] (int32 token ids). With targets [B, T] it
 * also computes the mean cross-entropy loss into *loss and keeps what the
 * backward needs; with targets NULL only the logits are produced. */
int zt_model_forward(zt_model_t *m, const int *inputs, const int *targets, int B, int T,
                     float *loss);
/* Backward pass of the last forward (which must have had targets).
 * Gradients of the mean loss, multiplied by grad_scale, are ACCUMULATED into
 * the unit gradient buffers (grad_scale = 1 / accum_steps makes
 * micro-batches accumulate to the mean over the whole batch). */
int zt_model_backward(zt_model_t *m, float grad_scale);
/* Sets every unit's gradient to zero. */
void zt_model_zero_grads(zt_model_t *m);

/* The logits [B, T, Vp] of the last forward without targets (with targets
 * the buffer holds probabilities), in the kernel table's memory. */
const float *zt_model_logits(const zt_model_t *m);

#endif
