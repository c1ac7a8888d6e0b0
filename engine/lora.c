/*
 * lora.c: the frozen base, the merge before a block computes and the
 * adapters' gradients after (see lora.h).
 */
#include "lora.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <xxhash.h>

#include "ckpt_io.h"
#include "hfdir.h"
#include "zero.h"
#include "zt_common.h"

/* One adapted projection: where A and B lie in an adapters' block unit and
 * W in a base block unit (the same in every block), and W's shape. */
typedef struct {
  size_t a, b, w;
  int O, I;
} lora_target;

struct zt_lora {
  zt_model_t *m, *ad;
  const zt_kernels_t *k;
  zt_model_hooks_t next; /* the adapters' hooks (ZeRO's) */
  /* The base in the storage type: unit u at uoff[u], whole, or at ZeRO
   * stage 3 with several ranks (z set) this rank's shard of each block
   * unit (ushard[u] elements), which merge() gathers into w. */
  float *base;
  size_t *uoff, *ushard, base_size;
  zt_zero_t *z;
  float *w;              /* a block unit merged, storage type (w_size elements) */
  float *g;              /* a block unit's gradient, fp32 */
  size_t block_size, w_size; /* elements of a base block unit, and of w */
  lora_target t[ZT_LORA_NTARGETS];
  int nt, R, merged;     /* merged: the unit w holds, -1 none */
  float s;
};

/* p advanced by n elements of the storage type. */
static float *xadv(const zt_lora_t *l, const float *p, size_t n) {
  return (float *)((const char *)p + n * (size_t)l->k->xbytes);
}

/* The base tensor an adapter tensor adapts: PEFT's name without its
 * "base_model.model." prefix and ".lora_A.weight" suffix, + ".weight". */
static const zt_tensor_t *adapted(const zt_layout_t *base, const zt_tensor_t *ad) {
  static const char pre[] = "base_model.model.";
  const char *n = ad->name;
  size_t len = strlen(n), suf = strlen(".lora_A.weight");
  if (strncmp(n, pre, sizeof pre - 1) || len < sizeof pre - 1 + suf) return NULL;
  char name[sizeof ad->name];
  snprintf(name, sizeof name, "%.*s.weight", (int)(len - (sizeof pre - 1) - suf),
           n + sizeof pre - 1);
  return zt_layout_find(base, name);
}

/* The targets of block unit 1, from the two layouts. */
static int find_targets(const zt_layout_t *base, const zt_layout_t *ad, lora_target *t,
                        int *nt) {
  *nt = 0;
  for (int i = 0; i < ad->num_tensors; i++) {
    const zt_tensor_t *a = &ad->tensors[i];
    if (a->unit != 1 || a->kind != ZT_T_LORA_A) continue;
    const zt_tensor_t *b = i + 1 < ad->num_tensors ? &ad->tensors[i + 1] : NULL;
    const zt_tensor_t *w = adapted(base, a);
    if (!b || b->kind != ZT_T_LORA_B || !w || w->rows != b->rows || w->cols != a->cols)
      return zt_err("lora: %s does not match the base model", a->name);
    t[(*nt)++] = (lora_target){a->unit_off, b->unit_off, w->unit_off, w->rows, w->cols};
  }
  return *nt ? 0 : zt_err("lora: no adapters in the layout");
}

/* Folds unit u's adapters into a copy of its base weights in l->w (with a
 * sharded base, the ranks' shards gathered there first). */
static int merge(zt_lora_t *l, int u) {
  if (l->merged == u) return 0;
  const float *src = xadv(l, l->base, l->uoff[u]);
  const float *ad = l->ad->unit_params[u];
  if (l->z) {
    if (zt_zero_gather_frozen(l->z, src, l->w, l->ushard[u]) != 0)
      return zt_err_wrap("lora: gathering the base of unit %d", u);
  } else {
    l->k->copy(l->w, src, l->block_size * (size_t)l->k->xbytes);
  }
  for (int i = 0; i < l->nt; i++) {
    const lora_target *t = &l->t[i];
    float *w = xadv(l, l->w, t->w);
    l->k->lora_merge(w, w, xadv(l, ad, t->a), xadv(l, ad, t->b), t->O, t->I, l->R, l->s);
  }
  l->merged = u;
  return 0;
}

static int is_block(const zt_lora_t *l, int u) { return u >= 1 && u <= l->m->cfg.n_layer; }

static int call_next(int (*fn)(void *, int), void *ctx, int u) { return fn ? fn(ctx, u) : 0; }

static int pre_forward(void *ctx, int u) {
  zt_lora_t *l = ctx;
  if (call_next(l->next.pre_forward, l->next.ctx, u) != 0) return -1;
  if (!is_block(l, u)) return 0;
  l->merged = -1; /* the adapters may have changed since the last step */
  return merge(l, u);
}

static int post_forward(void *ctx, int u) {
  zt_lora_t *l = ctx;
  return call_next(l->next.post_forward, l->next.ctx, u);
}

static int pre_backward(void *ctx, int u) {
  zt_lora_t *l = ctx;
  if (call_next(l->next.pre_backward, l->next.ctx, u) != 0) return -1;
  if (!is_block(l, u)) return 0;
  if (merge(l, u) != 0) return -1;
  l->k->zero(l->g, l->block_size);
  l->m->unit_grads[u] = l->g;
  return 0;
}

static int post_backward(void *ctx, int u) {
  zt_lora_t *l = ctx;
  if (is_block(l, u)) {
    const float *ad = l->ad->unit_params[u];
    float *dad = l->ad->unit_grads[u];
    if (!dad) return zt_err("lora: no gradient buffer for the adapters of unit %d", u);
    for (int i = 0; i < l->nt; i++) {
      const lora_target *t = &l->t[i];
      l->k->lora_grad(dad + t->a, dad + t->b, l->g + t->w, xadv(l, ad, t->a), xadv(l, ad, t->b),
                      t->O, t->I, l->R, l->s);
    }
    l->m->unit_grads[u] = NULL;
  }
  return call_next(l->next.post_backward, l->next.ctx, u);
}

/* Where each unit of the base lies in l->base: whole, or (sharded) the
 * block units as this rank's ZeRO shard of them; memplan.c's lora_base
 * counts the same. */
static void place_base(zt_lora_t *l, int world) {
  const zt_layout_t *lay = &l->m->lay;
  l->uoff = zt_xcalloc((size_t)lay->num_units, sizeof(size_t));
  l->ushard = zt_xcalloc((size_t)lay->num_units, sizeof(size_t));
  l->w_size = l->block_size;
  for (int u = 0; u < lay->num_units; u++) {
    l->uoff[u] = l->base_size;
    l->ushard[u] = l->z && is_block(l, u) ? zt_zero_shard_size(lay->unit_size[u], (size_t)world)
                                          : lay->unit_size[u];
    l->base_size += (l->ushard[u] + 7) & ~(size_t)7; /* units start 32-byte aligned */
    if (l->z && is_block(l, u)) l->w_size = ZT_MAX(l->w_size, l->ushard[u] * (size_t)world);
  }
}

int zt_lora_create(zt_lora_t **out, zt_model_t *m, zt_model_t *ad, zt_zero_t *z) {
  *out = NULL;
  const zt_model_config_t *c = &ad->cfg;
  if (c->lora_r < 1 || m->cfg.lora_r || m->cfg.arch != ZT_ARCH_LLAMA)
    return zt_err("lora: needs a llama compute model and a LoRA adapters' model");
  if (!m->k->lora_merge) return zt_errk(ZT_E_INVALID, "lora: the %s kernels do not have it", m->k->name);
  zt_lora_t *l = zt_xcalloc(1, sizeof *l);
  l->m = m, l->ad = ad, l->k = m->k, l->next = ad->hooks, l->merged = -1;
  l->R = c->lora_r;
  l->s = c->lora_alpha / (float)c->lora_r;
  l->block_size = m->lay.unit_size[1];
  if (find_targets(&m->lay, &ad->lay, l->t, &l->nt) != 0) goto err;
  const zt_zero_view_t *zv = z ? zt_zero_view(z) : NULL;
  l->z = zv && zv->stage == 3 && zv->N > 1 ? z : NULL;
  place_base(l, zv ? zv->N : 1);
  l->base = l->k->alloc(l->base_size * (size_t)l->k->xbytes);
  l->w = l->k->alloc(l->w_size * (size_t)l->k->xbytes);
  l->g = l->k->alloc(l->block_size * sizeof(float));
  if (!l->base || !l->w || !l->g) {
    zt_errk(ZT_E_NO_MEMORY, "lora: out of memory for the base model (%zu parameters)",
            m->lay.num_params);
    goto err;
  }
  l->k->memzero(l->base, l->base_size * (size_t)l->k->xbytes); /* a shard's padding */
  for (int u = 0; u < m->lay.num_units; u++) {
    m->unit_params[u] = is_block(l, u) ? l->w : xadv(l, l->base, l->uoff[u]);
    m->unit_grads[u] = NULL;
  }
  /* The hooks move unit pointers (fixed_units 0: no CUDA graphs). */
  zt_model_hooks_t h = {.ctx = l,
                        .pre_forward = pre_forward,
                        .post_forward = post_forward,
                        .pre_backward = pre_backward,
                        .post_backward = post_backward};
  zt_model_set_hooks(m, &h);
  *out = l;
  return 0;
err:
  zt_lora_free(l);
  return -1;
}

void zt_lora_free(zt_lora_t *l) {
  if (!l) return;
  if (l->base) l->k->release(l->base);
  if (l->w) l->k->release(l->w);
  if (l->g) l->k->release(l->g);
  free(l->uoff);
  free(l->ushard);
  free(l);
}

/* The elements of unit u this rank keeps: [*lo, *lo + *n) of the unit. */
static void kept(const zt_lora_t *l, int u, size_t *lo, size_t *n) {
  size_t size = l->m->lay.unit_size[u];
  *lo = 0, *n = size;
  if (l->z && is_block(l, u)) {
    *lo = ZT_MIN(size, (size_t)zt_zero_view(l->z)->r * l->ushard[u]);
    *n = ZT_MIN(size - *lo, l->ushard[u]);
  }
}

int zt_lora_set_base(zt_lora_t *l, const float *flat, uint64_t *hash) {
  const zt_layout_t *lay = &l->m->lay;
  float *tmp = NULL;
  if (l->k->xbytes != 4) { /* through an fp32 unit in the table's memory, rounded there */
    size_t max = 0;
    for (int u = 0; u < lay->num_units; u++) max = ZT_MAX(max, lay->unit_size[u]);
    if (!(tmp = l->k->alloc(max * sizeof(float))))
      return zt_errk(ZT_E_NO_MEMORY, "lora: out of memory staging the base model");
  }
  for (int u = 0; u < lay->num_units; u++) {
    size_t lo, n;
    kept(l, u, &lo, &n);
    const float *src = flat + lay->unit_off[u] + lo;
    float *dst = xadv(l, l->base, l->uoff[u]);
    if (!tmp) {
      l->k->upload(dst, src, n * sizeof(float));
      continue;
    }
    l->k->upload(tmp, src, n * sizeof(float));
    l->k->narrow_x(dst, tmp, n);
  }
  if (tmp) l->k->release(tmp);
  l->merged = -1;
  *hash = XXH64(flat, lay->num_params * sizeof(float), 0);
  return 0;
}

uint64_t zt_lora_bytes(const zt_lora_t *l) {
  return ((uint64_t)l->base_size + l->w_size) * (uint64_t)l->k->xbytes +
         (uint64_t)l->block_size * sizeof(float);
}

int zt_lora_merge_host(const zt_model_config_t *lora_cfg, float *w, const float *adapters) {
  zt_model_config_t bc = zt_model_config_base(lora_cfg);
  zt_layout_t base, ad;
  if (zt_layout_build(&base, &bc) != 0) return -1;
  if (zt_layout_build(&ad, lora_cfg) != 0) {
    zt_layout_free(&base);
    return -1;
  }
  lora_target t[ZT_LORA_NTARGETS];
  int nt, R = lora_cfg->lora_r, rc = find_targets(&base, &ad, t, &nt);
  float s = lora_cfg->lora_alpha / (float)R;
  /* The CPU table's merge, the one training runs on CPU workers. */
  const zt_kernels_t *k = zt_kernels_cpu();
  for (int u = 1; rc == 0 && u <= lora_cfg->n_layer; u++)
    for (int i = 0; i < nt; i++) {
      float *wt = w + base.unit_off[u] + t[i].w;
      const float *A = adapters + ad.unit_off[u] + t[i].a, *B = adapters + ad.unit_off[u] + t[i].b;
      k->lora_merge(wt, wt, A, B, t[i].O, t[i].I, R, s);
    }
  zt_layout_free(&base);
  zt_layout_free(&ad);
  return rc;
}

int zt_lora_merge_epoch(const char *epoch_dir, const char *base_path, zt_model_config_t *cfg,
                        zt_layout_t *lay, float **flat) {
  char rec[ZT_PATH_MAX], sum[32], now[32];
  if (zt_ckpt_read_lora_base(epoch_dir, rec, sizeof rec, sum) != 0) return -1;
  const char *path = base_path ? base_path : rec;
  zt_model_config_t bc = zt_model_config_base(cfg);
  zt_layout_t bl;
  if (zt_layout_build(&bl, &bc) != 0) return -1;
  float *w = zt_xmalloc(bl.num_params * sizeof(float));
  struct stat st;
  int dir = stat(path, &st) == 0 && S_ISDIR(st.st_mode);
  int rc = zt_hf_read_model(path, dir, &bc, &bl, w);
  zt_ckpt_checksum_text(now, XXH64(w, bl.num_params * sizeof(float), 0));
  if (rc == 0 && strcmp(now, sum))
    rc = zt_errk(ZT_E_INVALID, "its parameters hash to %s, but the adapters were trained on a "
                 "base that hashes to %s (%s)", now, sum, rec);
  if (rc == 0) rc = zt_lora_merge_host(cfg, w, *flat);
  if (rc != 0) {
    free(w);
    zt_layout_free(&bl);
    return zt_err_wrap("the base model %s", path);
  }
  free(*flat);
  zt_layout_free(lay);
  *flat = w, *lay = bl, *cfg = bc;
  return 0;
}
