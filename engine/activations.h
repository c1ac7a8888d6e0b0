/*
 * activations.h: the list of the model's activation tensors and their sizes,
 * shared by the model (model.c declares, allocates, frees and counts them
 * with it) and by the memory estimate (memplan.c), so the two can never
 * disagree.
 */
#ifndef ZT_ACTIVATIONS_H
#define ZT_ACTIVATIONS_H

/* The activation tensors, in elements for a capacity of B x T (BT = B * T),
 * and their type: X (the kernel table's storage type, xbytes bytes: fp32,
 * or bf16 on the CUDA bf16 table; zt_kernels.h) or F (always fp32: the
 * LayerNorm statistics, attention's lse, the losses and their lse). One entry per tensor,
 * in allocation order. Per-layer tensors are held for LA layers: L, or 1
 * with activation checkpointing (each layer's input, res3 of the layer
 * before, stays for all L; the rest is recomputed in backward, one layer at
 * a time). This list declares the fields of struct zt_acts, allocates,
 * frees and counts them (as llm.c's table of activation sizes does). */
#define ZT_ACTIVATIONS(X)                  \
  X(encoded, BT * C, ZT_ACT_X)            \
  X(ln1, LA * BT * C, ZT_ACT_X)           \
  X(ln1_mean, LA * BT, ZT_ACT_F)          \
  X(ln1_rstd, LA * BT, ZT_ACT_F)          \
  X(qkv, LA * BT * QKV, ZT_ACT_X)         \
  X(atty, LA * BT * ATT, ZT_ACT_X)        \
  X(lse, LA * BT * NH, ZT_ACT_F)          \
  X(res2, LA * BT * C, ZT_ACT_X)          \
  X(ln2, LA * BT * C, ZT_ACT_X)           \
  X(ln2_mean, LA * BT, ZT_ACT_F)          \
  X(ln2_rstd, LA * BT, ZT_ACT_F)          \
  X(fch, LA * BT * FF, ZT_ACT_X)          \
  X(fch_gelu, LA * BT * FFA, ZT_ACT_X)    \
  X(res3, L * BT * C, ZT_ACT_X)           \
  X(lnf, BT * C, ZT_ACT_X)                \
  X(lnf_mean, BT, ZT_ACT_F)               \
  X(lnf_rstd, BT, ZT_ACT_F)               \
  X(logits, BT * Vp, ZT_ACT_X)            \
  X(losses, BT, ZT_ACT_F)                 \
  X(ce_lse, BT, ZT_ACT_F)                 \
  X(dres, BT * C, ZT_ACT_X)               \
  X(dbtc, BT * C, ZT_ACT_X)               \
  X(dqkv, BT * QKV, ZT_ACT_X)             \
  X(dfch, BT * FF, ZT_ACT_X)              \
  X(proj, BT * C, ZT_ACT_X)               \
  X(datt, BT * ATTX, ZT_ACT_X)            \
  X(dffa, BT * FFAX, ZT_ACT_X)            \
  X(nowpe, T * PE, ZT_ACT_X)              \
  X(dnowpe, T * PE, ZT_ACT_F)

/* The widths the list uses, from the configuration: GPT-2's block works
 * on 3C (q, k, v), C (attention out) and 4C (the MLP); a llama block on
 * QKV = (NH + 2 NKV) HD, ATT = NH HD, FF = 2 n_ff (gate and up) and FFA =
 * n_ff, and needs scratch GPT-2 does not: ATTX (the attention output's
 * gradient), FFAX (SwiGLU's) and PE (a zero position table for the
 * embedding kernel, with a gradient nobody reads). Grouped-query attention
 * reads each K/V head in place (zt_kernels.h attention_forward_gqa), so
 * NKV < NH needs no scratch of its own. */
typedef struct {
  size_t C, L, NH, Vp, QKV, ATT, FF, FFA, ATTX, FFAX, PE;
} zt_act_dims_t;

static inline zt_act_dims_t zt_act_dims(size_t C, size_t L, size_t NH, size_t Vp, int llama,
                                        size_t NKV, size_t HD, size_t F) {
  zt_act_dims_t d = {C, L, NH, Vp, 3 * C, C, 4 * C, 4 * C, 0, 0, 0};
  if (llama) {
    d.QKV = (NH + 2 * NKV) * HD, d.ATT = NH * HD, d.FF = 2 * F, d.FFA = F;
    d.ATTX = d.ATT, d.FFAX = F, d.PE = C;
  }
  return d;
}

/* Bytes of one element of either type, for storage type of xb bytes. */
#define ZT_ACT_X(xb) ((size_t)(xb))
#define ZT_ACT_F(xb) ((size_t)4)

#include <stddef.h>

/* Bytes of all activations for a capacity of B x T (the sum of the list)
 * with a storage type of xb bytes; LA layers of per-layer tensors. */
static inline size_t zt_activation_bytes(size_t B, size_t T, const zt_act_dims_t *d, size_t LA,
                                         size_t xb) {
  size_t BT = B * T, total = 0, C = d->C, L = d->L, NH = d->NH, Vp = d->Vp, QKV = d->QKV;
  size_t ATT = d->ATT, FF = d->FF, FFA = d->FFA, ATTX = d->ATTX, FFAX = d->FFAX, PE = d->PE;
#define ZT_ACT_SUM(name, size, type) total += (size) * type(xb);
  ZT_ACTIVATIONS(ZT_ACT_SUM)
#undef ZT_ACT_SUM
  return total;
}

#endif
