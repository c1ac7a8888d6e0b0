/*
 * activations.h: the list of the model's activation tensors and their sizes,
 * shared by the model (model.c declares, allocates, frees and counts them
 * with it) and by the memory estimate (memory.c), so the two can never
 * disagree.
 */
#ifndef ZT_ACTIVATIONS_H
#define ZT_ACTIVATIONS_H

/* The activation tensors, in floats, for a capacity of B x T (BT = B * T):
 * one entry per tensor, in allocation order. Per-layer tensors are held for
 * LA layers: L, or 1 with activation checkpointing (each layer's input,
 * res3 of the layer before, stays for all L; the rest is recomputed in
 * backward, one layer at a time). This list declares the fields of struct
 * zt_acts, allocates, frees and counts them (as llm.c's table of activation
 * sizes does). */
#define ZT_ACTIVATIONS(X)              \
  X(encoded, BT * C)                  \
  X(ln1, LA * BT * C)                 \
  X(ln1_mean, LA * BT)                \
  X(ln1_rstd, LA * BT)                \
  X(qkv, LA * BT * 3 * C)             \
  X(atty, LA * BT * C)                \
  X(lse, LA * BT * NH)                \
  X(res2, LA * BT * C)                \
  X(ln2, LA * BT * C)                 \
  X(ln2_mean, LA * BT)                \
  X(ln2_rstd, LA * BT)                \
  X(fch, LA * BT * 4 * C)             \
  X(fch_gelu, LA * BT * 4 * C)        \
  X(res3, L * BT * C)                 \
  X(lnf, BT * C)                      \
  X(lnf_mean, BT)                     \
  X(lnf_rstd, BT)                     \
  X(logits, BT * Vp)                  \
  X(losses, BT)                       \
  X(dres, BT * C)                     \
  X(dbtc, BT * C)                     \
  X(dqkv, BT * 3 * C)                 \
  X(dfch, BT * 4 * C)                 \
  X(proj, BT * C)

#include <stddef.h>

/* Floats of all activations for a capacity of B x T (the sum of the list). */
static inline size_t zt_activation_floats(size_t B, size_t T, size_t C, size_t L, size_t NH,
                                          size_t Vp, size_t LA) {
  size_t BT = B * T, total = 0;
#define ZT_ACT_SUM(name, size) total += (size);
  ZT_ACTIVATIONS(ZT_ACT_SUM)
#undef ZT_ACT_SUM
  return total;
}

#endif
