/*
 * lora.h: LoRA fine-tuning: a frozen base model and trainable low-rank
 * adapters, trained under ZeRO like any parameters.
 *
 * For each adapted projection W [out, in] of a llama block (the spec's
 * lora.target_modules), LoRA trains A [r, in] and B [out, r] and computes
 * with W + s B A, s = alpha / r (PEFT's LoraConfig, dropout 0). Two models
 * work together:
 *
 *   - the adapters' model (`ad`, a ZT_MODEL_SHELL of the LoRA
 *     configuration, whose layout is the adapters': layout.h) is what ZeRO
 *     shards, reduces, updates and checkpoints, exactly as it does a full
 *     model: its hooks are ZeRO's, its units the same numbers as the base
 *     model's;
 *   - the compute model (`m`, of zt_model_config_base) runs forward and
 *     backward. Its hooks are this module's: before unit u computes, they
 *     call the adapters' hook for u (ZeRO gathers or waits for the
 *     adapters of u), then fold the adapters into a copy of the block's
 *     base weights (lora_merge: W' = W + s B A, one slot for the unit in
 *     use); after a block's backward, the gradient of W' (in one slot for
 *     the unit) becomes the adapters' gradients (lora_grad:
 *     dA += s B^T dW', dB += s dW' A^T, the chain rule through
 *     W' = W + s B A), added into the adapters' unit gradient before the
 *     adapters' post_backward hook (ZeRO's reduction) runs.
 *
 * The embedding, the final norm and the head (units 0 and L + 1) are used
 * from the base as they are and get no gradient (the model skips them); the
 * norms and biases inside blocks are frozen too (their gradients are
 * computed into the slot and dropped). Every rank holds the base in the
 * storage type, next to its ZeRO share of the adapters' states: whole, or
 * at ZeRO stage 3 with several ranks its shard of every block unit (the
 * embedding, final norm and head stay whole), which the hook before a
 * block computes all-gathers into the slot before the merge, in the same
 * order on every rank (docs/zero.md, "LoRA").
 *
 * The cost over inference-style LoRA is the full gradient of each block's
 * weights (as full fine-tuning computes it) and two products of r per
 * adapted weight per merge; in exchange the attention and MLP kernels are
 * the model's own, and the adapters' gradients are exact whatever r.
 */
#ifndef ZT_LORA_H
#define ZT_LORA_H

#include <stdint.h>

#include "model.h"
#include "zero.h"

typedef struct zt_lora zt_lora_t;

/* Binds the compute model m (base configuration, created with
 * ZT_MODEL_NO_PARAMS | ZT_MODEL_NO_GRADS) to the adapters' shell model ad
 * (the LoRA configuration; ZeRO's hooks already installed on it, since
 * they are read here) and installs this module's hooks on m. Allocates
 * the base (zeroed until zt_lora_set_base) and the two unit slots in the
 * kernel table's memory; -1 (ZT_E_NO_MEMORY) when they do not fit. z: the
 * adapters' ZeRO state, whose stage 3 on several ranks shards the base's
 * blocks too (NULL: the base whole). */
ZT_MUST_CHECK int zt_lora_create(zt_lora_t **out, zt_model_t *m, zt_model_t *ad, zt_zero_t *z);
void zt_lora_free(zt_lora_t *l);

/* The base parameters, the compute model's whole flat buffer in fp32 on
 * the host (layout order); what this rank keeps of it, rounded to the
 * storage type. *hash receives
 * the XXH64 of those fp32 bytes: the base's identity, which checkpoints
 * record. -1 when out of memory. */
ZT_MUST_CHECK int zt_lora_set_base(zt_lora_t *l, const float *flat, uint64_t *hash);

/* Bytes of the base and the slots (for the memory report). */
uint64_t zt_lora_bytes(const zt_lora_t *l);

/* Merges host copies: w (the base model's flat fp32 parameters) +=
 * s B A for every adapter in `adapters` (the LoRA layout's flat fp32
 * buffer), with the CPU kernel table's lora_merge, as `zctl export --merge`
 * writes them. */
ZT_MUST_CHECK int zt_lora_merge_host(const zt_model_config_t *lora_cfg, float *w,
                                     const float *adapters);

/* A LoRA epoch's adapters, loaded (zt_ckpt_load_flat: *cfg, *lay,
 * *flat), merged into its base: the base at base_path (a Hugging Face
 * directory or a safetensors file) or, when NULL, the one the manifest
 * names, refused unless its parameters hash as the manifest records. On
 * success *cfg, *lay and *flat are the merged model's (the adapters'
 * freed); for zctl export --merge and zctl sample. */
ZT_MUST_CHECK int zt_lora_merge_epoch(const char *epoch_dir, const char *base_path,
                                      zt_model_config_t *cfg, zt_layout_t *lay, float **flat);

#endif
