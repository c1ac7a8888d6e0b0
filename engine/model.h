/*
 * model.h: the GPT-2 model: forward, backward and activations.
 *
 * The model is the GPT-2 architecture as in llm.c: token and position
 * embeddings, n_layer pre-LN transformer blocks (LayerNorm, causal multi-head
 * attention, residual, LayerNorm, GELU MLP of width 4C, residual), a final
 * LayerNorm and a language-model head tied to the token embedding. All
 * arithmetic goes through a kernel table (kernels/zt_kernels.h), so the same
 * code runs on the fast CPU kernels, the reference kernels and CUDA.
 *
 * The parameter layout (units, named views, initialisation) is layout.h's;
 * the model holds one (m->lay).
 *
 * Sharding. The model never computes addresses from the flat buffer during
 * forward and backward: it reads unit u's parameters from m->unit_params[u]
 * and accumulates its gradients into m->unit_grads[u]. By default these
 * point into the flat buffers m->params and m->grads, but a caller may
 * repoint them at any time between calls, or from a hook (ZeRO stage 3
 * gathers a unit into a temporary buffer in pre_forward / pre_backward).
 * With ZT_MODEL_NO_PARAMS / ZT_MODEL_NO_GRADS the flat buffers are not
 * allocated at all and the caller must supply every unit pointer. A llama
 * model's unit 0 or L + 1 whose gradient pointer is NULL is frozen: the
 * backward skips its weight gradients (LoRA, engine/lora.h). A model made
 * with ZT_MODEL_SHELL has units, pointers and hooks but no activations: it
 * stands for a set of trainable parameters that another model computes
 * with (LoRA's adapters, under ZeRO), and cannot run forward itself.
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
 * Activation checkpointing (ZT_MODEL_RECOMPUTE). Only each layer's input
 * is kept per layer; the layer's other activations share one slot, and
 * backward recomputes layer l's forward (after pre_backward(1 + l), from
 * the unit pointers then installed) before its backward. The kernels are
 * deterministic, so the recomputed values, and the gradients, are
 * bit-identical to a run without it, for about one more forward per step.
 *
 * Memory. Parameters, gradients and activations live in the kernel table's
 * memory (k->alloc): host memory for the CPU tables, device memory for the
 * CUDA table. Parameters and activations are of the table's storage type
 * (zt_kernels.h: fp32, or bf16 for the CUDA bf16 table, xbytes per
 * element; activations.h says which activations), gradients are fp32; a
 * bf16 model's parameters are a copy that its owner rounds from an fp32
 * master (engine/zero.c) with narrow_x. Inputs and targets are passed as host arrays and uploaded by
 * zt_model_forward, the loss comes back as a host float; every pointer the
 * model exposes (params, grads, unit pointers, logits) is table memory, and
 * pointers a caller installs must be too.
 */
#ifndef ZT_MODEL_H
#define ZT_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "layout.h"
#include "zt_kernels.h"

typedef struct zt_model_hooks {
  void *ctx;
  int (*pre_forward)(void *ctx, int unit);
  int (*post_forward)(void *ctx, int unit);
  int (*pre_backward)(void *ctx, int unit);
  int (*post_backward)(void *ctx, int unit);
  /* Each unit pointer (unit_params, unit_grads) a hook sets is the one
   * that hook set the step before (a function of the unit alone), and
   * nothing but the hooks uses the table during a step: the model may
   * record the work between them into CUDA graphs (zt_model_step). */
  int fixed_units;
} zt_model_hooks_t;

#define ZT_MODEL_NO_PARAMS 1u /* do not allocate the flat parameter buffer */
#define ZT_MODEL_NO_GRADS 2u  /* do not allocate the flat gradient buffer */
#define ZT_MODEL_RECOMPUTE 4u /* activation checkpointing: keep each layer's input only */
#define ZT_MODEL_SHELL 8u     /* no activations (see above) */

struct zt_acts; /* activations, private to model.c */

/* CUDA graphs for zt_model_step (docs/gpu.md, "CUDA graphs"): the work
 * of forward and backward between two hooks is one segment, recorded as
 * one graph; marks[i] is the hook that runs after segment i. */
struct zt_model_mark {
  int (*fn)(void *ctx, int unit);
  const char *name;
  int unit;
};
typedef struct zt_model_graph {
  int on;            /* graphs allowed (zt_model_set_graphs; default on) */
  void **segs;       /* the recorded segments (nsegs; 0: none recorded) */
  struct zt_model_mark *marks; /* nsegs - 1 of them */
  int nsegs, cap;
  int recording;     /* hooks end segments instead of running */
  char rec_fail[200];
  int warm;          /* a step with the key below has run without a graph */
  int B, T;          /* the key: the shape, the gradient scale, ... */
  float scale;
  void **ptrs;       /* ... and every unit pointer, params then grads */
  long captures, replays; /* recordings of a step; steps run from them */
  char why[200];     /* why graphs were turned off, or "" */
} zt_model_graph_t;

typedef struct zt_model {
  zt_model_config_t cfg;
  zt_layout_t lay;            /* units, named views, flat-buffer size */
  int max_B, max_T;           /* activation capacity */
  int recompute;              /* ZT_MODEL_RECOMPUTE: layers recomputed in backward */
  const zt_kernels_t *k;

  float *params;              /* flat buffers (NULL with the NO_* flags) */
  float *grads;
  float **unit_params;        /* [num_units] where forward/backward read unit u */
  float **unit_grads;         /* [num_units] where backward accumulates unit u */

  zt_model_hooks_t hooks;
  struct zt_acts *acts;
  zt_model_graph_t graph;
} zt_model_t;

/* The configuration's RoPE frequencies (llama). */
static inline zt_rope_t zt_model_rope(const zt_model_config_t *c) {
  zt_rope_t r = {c->rope_theta, c->rope_factor, c->rope_low_freq_factor,
                 c->rope_high_freq_factor, (float)c->rope_original_max_pos};
  return r;
}

/* Creates a model with activations for batches of up to B x T (T <= seq_len)
 * on the kernel table k. The parameters are not initialised; call
 * zt_model_init. */
ZT_MUST_CHECK int zt_model_create(zt_model_t **out, const zt_model_config_t *cfg, int B, int T,
                    const zt_kernels_t *k, unsigned flags);
void zt_model_free(zt_model_t *m);

/* Bytes of activation memory the model allocated. */
size_t zt_model_activation_bytes(const zt_model_t *m);

/* Initialises every unit through m->unit_params (zt_layout_init_unit on
 * the host, copied into the kernel table's memory). */
void zt_model_init(zt_model_t *m, uint64_t seed);

/* Sets the hooks (NULL clears them). */
void zt_model_set_hooks(zt_model_t *m, const zt_model_hooks_t *hooks);

/* Forward pass on inputs [B, T] (int32 token ids). With targets [B, T] it
 * also computes the mean cross-entropy loss into *loss and keeps what the
 * backward needs; with targets NULL only the logits are produced. */
ZT_MUST_CHECK int zt_model_forward(zt_model_t *m, const int *inputs, const int *targets, int B, int T,
                     float *loss);
/* Backward pass of the last forward (which must have had targets).
 * Gradients of the mean loss, multiplied by grad_scale, are ACCUMULATED into
 * the unit gradient buffers (grad_scale = 1 / accum_steps makes
 * micro-batches accumulate to the mean over the whole batch). */
ZT_MUST_CHECK int zt_model_backward(zt_model_t *m, float grad_scale);
/* A training micro-step: zt_model_forward with targets, then
 * zt_model_backward(grad_scale), with the same results. On a kernel table
 * with CUDA graphs (zt_kernels.h graph_*) and with no hooks set, the
 * device work of both passes is recorded once into one graph and replayed
 * by each later step with the same batch shape, gradient scale and unit
 * pointers: one launch in place of hundreds. With hooks that declare
 * fixed_units, each stretch between two hooks is a graph of its own and
 * the hooks run between the launches, as they would between the calls.
 * The first step with a new key runs without a graph (it sizes the
 * table's scratch buffers); the next one records (a pass that runs
 * nothing and calls no hook), then launches; the rest launch. Inputs and
 * targets are uploaded before the launches and the loss is read after
 * them. If a step cannot be
 * recorded (zt_kernels.h says what cannot be), graphs are turned off for
 * the model with the reason in m->graph.why (logged once) and every step
 * runs without one. */
ZT_MUST_CHECK int zt_model_step(zt_model_t *m, const int *inputs, const int *targets, int B,
                                int T, float grad_scale, float *loss);
/* Allows (1, the default) or forbids (0) graphs for zt_model_step; 0 also
 * frees a recorded one. */
void zt_model_set_graphs(zt_model_t *m, int on);
/* The hooks of one forward and backward, in the same order, with no
 * computation and each unit's gradient zero when its post_backward hook
 * runs: a rank with fewer micro-batches than another in a step (the
 * trainer's load balance) joins the collectives that ZeRO's hooks issue
 * in every micro-step (stages 2-3) without work of its own. */
ZT_MUST_CHECK int zt_model_hook_pass(zt_model_t *m);
/* Sets every unit's gradient to zero. */
void zt_model_zero_grads(zt_model_t *m);

/* The logits [B, T, Vp] of the last forward without targets (with targets
 * the buffer holds probabilities, or on a table with crossentropy_lse_*
 * still the logits; after backward their gradient), in the kernel table's
 * memory. */
const float *zt_model_logits(const zt_model_t *m);

#endif
