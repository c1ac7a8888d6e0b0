/*
 * memplan.c: the per-rank memory a job needs (see memplan.h).
 *
 * The ZeRO part walks the units of the model's layout exactly as zero.c's
 * layout() does (shards of zt_zero_shard_size elements, the buffers each stage
 * keeps whole or sharded, the in-flight buffers of stages 2 and 3); the
 * test in tests/unit/test_engine_spec.c compares it with the bytes zero.c
 * really allocates.
 */
#include "memplan.h"

#include <stdio.h>

#include "activations.h"
#include "layout.h"

/* The model states of one rank, as zero.c allocates them, for a working
 * copy of xb bytes per parameter (4: it is the fp32 master itself), with
 * NCCL collectives (nccl: stages 2-3 widen a unit's gradient for them). */
/* Bytes of n values encoded by sync.compression q: zt_quant_bytes (quant.c,
 * outside this library): bf16, or blocks of 256 bytes (int8) or 64 nibbles
 * (int4) after an fp32 scale each, rounded up to whole 16-bit words. */
static uint64_t quant_bytes(int q, uint64_t n) {
  uint64_t b = q == 1   ? 2 * n
               : q == 2 ? n + 4 * ((n + 255) / 256)
               : q == 3 ? (n + 1) / 2 + 4 * ((n + 63) / 64)
                        : 0;
  return (b + 1) & ~(uint64_t)1;
}

/* q: sync.compression of the gradient reduction (0 over NCCL, zero.c). */
static uint64_t zero_states(const zt_layout_t *l, int stage, int world, int overlap, uint64_t xb,
                            int nccl, int q, uint64_t *owned) {
  uint64_t N = (uint64_t)world, full = 0, shard = 0, max_unit = 0, s0 = 0, slot = 0;
  for (int u = 0; u < l->num_units; u++) {
    uint64_t S = zt_zero_shard_size(l->unit_size[u], N);
    full += S * N;
    shard += S;
    if (S * N > max_unit) max_unit = S * N;
    if (u > 0 && S * N > slot) slot = S * N; /* zero_impl.h: slot_unit */
    if (u == 0) s0 = S * N;
  }
  if (!slot) slot = max_unit;
  int split = xb != 4;
  uint64_t b = 4 * (stage == 0 || (stage < 3 && !split) ? full : shard); /* fp32 master */
  if (split) b += xb * (stage < 3 ? full : shard);          /* working copy */
  b += stage < 2 ? 4 * full + 8 * full : 8 * shard;          /* gradients */
  b += 2 * 4 * (stage == 0 ? full : shard);                  /* Adam m, v */
  if (stage >= 2) b += 4 * s0 + 4 * slot + 8 * (slot / N + 1);
  if (stage >= 2 && nccl) b += 8 * slot;              /* the widened piece */
  if (stage >= 2 && overlap && N > 1 && nccl) /* stream overlap's 2nd fp64 slot */
    b += 8 * slot + 8 * (slot / N + 1);
  else if (stage >= 2 && overlap && N > 1) /* the thread's 2nd gradient slot */
    b += 4 * slot;
  if (stage == 3) b += xb * s0 + xb * slot;
  if (stage == 3 && overlap && N > 1) b += xb * slot; /* the prefetch slot */
  b += 4 * max_unit; /* the gather scratch (not a model state, still memory) */
  if (q && N > 1 && !nccl) /* the compressed reduction's send, receive and decode buffers */
    b += 2 * N * quant_bytes(q, max_unit / N) + 4 * (max_unit / N);
  *owned = stage == 0 ? (full + N - 1) / N : shard;
  return b;
}

static uint64_t activations(const zt_spec_t *s, const zt_layout_t *l, uint64_t xb) {
  const zt_model_config_t *m = &s->model;
  uint64_t B = (uint64_t)s->micro_batch, T = (uint64_t)m->seq_len;
  zt_act_dims_t d = zt_act_dims((size_t)m->n_embd, (size_t)m->n_layer, (size_t)m->n_head,
                                 (size_t)l->Vp, m->arch == ZT_ARCH_LLAMA, (size_t)m->n_kv_head,
                                 (size_t)m->head_dim, (size_t)m->n_ff);
  return zt_activation_bytes(B, T, &d, s->act_ckpt ? 1 : (size_t)m->n_layer, xb) +
         3 * 4 * B * T; /* inputs, targets, host losses */
}

/* LoRA's frozen base in the storage type, whole on every rank or (stage 3
 * on several ranks) the blocks as this rank's shard of them, and its two
 * block slots: merged weights (a whole gathered block when sharded) and
 * their gradient in fp32 (lora.c). */
static uint64_t lora_base(const zt_model_config_t *m, int stage, int world, uint64_t xb) {
  zt_model_config_t b = zt_model_config_base(m);
  zt_layout_t l;
  if (!m->lora_r || zt_layout_build(&l, &b) != 0) return 0;
  int shard = stage == 3 && world > 1;
  uint64_t base = 0, w = l.unit_size[1];
  for (int u = 0; u < l.num_units; u++) {
    int block = u >= 1 && u <= m->n_layer;
    uint64_t s = shard && block ? zt_zero_shard_size(l.unit_size[u], (size_t)world) : l.unit_size[u];
    base += (s + 7) & ~(uint64_t)7; /* lora.c place_base */
    if (shard && block) w = ZT_MAX(w, s * (uint64_t)world);
  }
  uint64_t n = (base + w) * xb + (uint64_t)l.unit_size[1] * 4;
  zt_layout_free(&l);
  return n;
}

/* DiLoCo (diloco.h): each rank holds, of its owned ranges (the whole
 * padded model in a group of one rank), in fp32 host memory: the outer parameters,
 * the outer momentum, the pseudo-gradient, a round kept for the next
 * generation (parameters, m, v), the overlap's snapshot, int4's
 * residual and decoded copy, and with fragments the group's parameters
 * (and int4's packed residual); and the encodings of G groups and its
 * own. */
static uint64_t diloco_outer(const zt_spec_t *s, const zt_layout_t *l, int world) {
  uint64_t full = 0, S = (uint64_t)s->group_size, G = (uint64_t)world / S;
  if (!s->diloco) return 0;
  /* With groups of S ranks, each holds its owned range of each unit. */
  for (int u = 0; u < l->num_units; u++) full += zt_zero_shard_size(l->unit_size[u], S);
  uint64_t copies = 3 + 3 + (s->overlap_steps ? 1 : 0) + (s->compression == 3 ? 2 : 0) +
                    (s->fragments > 1 ? 1 + (s->compression == 3) : 0);
  uint64_t enc = quant_bytes(s->compression, full);
  return copies * 4 * full + (G > 1 ? (G + 1) * enc : 0);
}

int zt_memplan_rank(const zt_spec_t *s, int world, int overlap, int xbytes, int nccl,
                    uint64_t *states, uint64_t *acts) {
  zt_layout_t l;
  uint64_t owned;
  if (world < 1 || zt_layout_build(&l, &s->model) != 0) return -1;
  int all = world;
  if (s->diloco) world = (int)s->group_size;
  int q = s->diloco ? 0 : s->compression;
  *states = zero_states(&l, s->zero_stage, world, overlap, (uint64_t)xbytes, nccl, q, &owned) +
            lora_base(&s->model, s->zero_stage, world, (uint64_t)xbytes) +
            diloco_outer(s, &l, all);
  *acts = activations(s, &l, (uint64_t)xbytes);
  zt_layout_free(&l);
  return 0;
}

int zt_memplan_need(const zt_spec_t *s, int world, zt_memplan_need_t *out) {
  zt_layout_t l;
  if (world < 1 || zt_layout_build(&l, &s->model) != 0) return -1;
  uint64_t owned, dev_xb = s->bf16 ? 2 : 4;
  int all = world, groups = s->diloco ? world / (int)s->group_size : world;
  if (s->diloco) world = (int)s->group_size;
  int q = s->diloco ? 0 : s->compression;
  out->states = zero_states(&l, s->zero_stage, world, s->overlap_comm, 4, 0, q, &owned) +
                lora_base(&s->model, s->zero_stage, world, 4) + diloco_outer(s, &l, all);
  out->activations = activations(s, &l, 4);
  /* GPU workers are counted over NCCL, with its widened copy and the
   * stream overlap's slots (on the TCP ring they run without the thread
   * and need less). */
  out->dev_states = zero_states(&l, s->zero_stage, world, s->overlap_comm, dev_xb, 1, q, &owned) +
                    lora_base(&s->model, s->zero_stage, world, dev_xb);
  out->dev_activations = activations(s, &l, dev_xb);
  /* DiLoCo's snapshot adds the group's share of the outer state. */
  if (s->diloco) owned += owned / (uint64_t)groups + 1;
  out->snapshot = s->ckpt.dir[0] ? 3 * 4 * owned : 0;
  out->host = ZT_MEMPLAN_BASE_BYTES + out->states + out->activations + out->snapshot;
  out->device = ZT_MEMPLAN_DEVICE_BASE_BYTES + out->dev_states + out->dev_activations;
  /* Loading a checkpoint stages the states through host buffers (no more
   * than the fp32 states of a CPU worker). */
  out->host_with_device = ZT_MEMPLAN_BASE_BYTES + out->states + out->snapshot;
  zt_layout_free(&l);
  return 0;
}

int zt_memplan_fits(const zt_memplan_need_t *n, uint64_t host_bytes, uint64_t device_bytes) {
  if (!host_bytes) return 1;
  if (!device_bytes) return host_bytes >= n->host;
  return device_bytes >= n->device && host_bytes >= n->host_with_device;
}

const char *zt_memplan_text(uint64_t bytes, char *buf, size_t n) {
  if (bytes >= (1ull << 30)) snprintf(buf, n, "%.2f GiB", (double)bytes / (double)(1ull << 30));
  else snprintf(buf, n, "%.1f MiB", (double)bytes / (double)(1ull << 20));
  return buf;
}
