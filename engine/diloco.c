/*
 * diloco.c: DiLoCo's outer step, its state and its checkpoints (see
 * diloco.h).
 *
 * The trainer (trainer.c) runs the inner steps on the group's own zero.h
 * state and calls zt_diloco_sync where the groups meet: every
 * sync.inner_steps steps and after the last. The outer state lives in host
 * memory whatever the device: a sync copies the group's fp32 master down,
 * computes there and copies the new parameters up, once every H steps.
 */
#include "diloco.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zt_common.h"

/* The units among the F fragments (diloco.h): the largest first (the
 * lowest index among equals), each to the fragment that holds the fewest
 * elements so far (the lowest index among equals). Group 0 logs them. */
static void assign_fragments(zt_diloco_t *d) {
  const zt_zero_view_t *z = zt_zero_view(d->z);
  size_t *load = zt_xcalloc((size_t)d->F, sizeof *load);
  for (int u = 0; u < d->U; u++) d->frag_of[u] = -1;
  for (int k = 0; k < d->U; k++) {
    int best = -1, f = 0;
    for (int u = 0; u < d->U; u++)
      if (d->frag_of[u] < 0 && (best < 0 || z->usz[u] > z->usz[best])) best = u;
    for (int i = 1; i < d->F; i++)
      if (load[i] < load[f]) f = i;
    d->frag_of[best] = f;
    load[f] += z->usz[best];
  }
  for (int f = 0; d->g == 0 && f < d->F; f++) {
    char list[256] = "";
    for (int u = 0, at = 0; u < d->U && at < (int)sizeof list - 8; u++)
      if (d->frag_of[u] == f)
        at += snprintf(list + at, sizeof list - (size_t)at, "%s%d", at ? "," : "", u);
    ZT_INFO("diloco: fragment %d of %d: units [%s], %zu parameters; it syncs after the steps s "
            "with s %% %lld == %lld", f, d->F, list, load[f], (long long)d->H,
            (long long)((f + 1) * (d->H / d->F) % d->H));
  }
  free(load);
}

int zt_diloco_fragment_due(const zt_diloco_t *d, int64_t s) {
  int64_t every = d->H / d->F;
  if (d->F < 2 || s % every != 0) return -1;
  return (int)((s % d->H ? s % d->H : d->H) / every) - 1;
}

/* Fragment f's ranges of the owned layout (f < 0: the whole model) in
 * d->roff, d->rlen; returns their number. */
static int frag_ranges(zt_diloco_t *d, int f) {
  const zt_zero_view_t *z = zt_zero_view(d->z);
  int k = 0;
  if (f < 0) {
    d->roff[0] = 0, d->rlen[0] = d->n;
    return 1;
  }
  for (int u = 0; u < d->U; u++)
    if (d->frag_of[u] == f) d->roff[k] = z->off_shard[u], d->rlen[k++] = z->S[u];
  return k;
}

/* Error feedback on fragment f (>= 0): its residual packed into efp
 * before its sum, and back after it. */
static void ef_pack(zt_diloco_t *d, int f, int back) {
  size_t k = 0;
  if (!d->ef || f < 0) return;
  for (int r = 0, nr = frag_ranges(d, f); r < nr; r++) {
    float *full = d->ef + d->roff[r], *packed = d->efp + k;
    memcpy(back ? full : packed, back ? packed : full, d->rlen[r] * sizeof(float));
    k += d->rlen[r];
  }
}

/* d->d = outer - p over fragment f's ranges, packed; returns its floats. */
static size_t pack_delta(zt_diloco_t *d, int f, const float *p) {
  size_t k = 0;
  for (int r = 0, nr = frag_ranges(d, f); r < nr; r++)
    for (size_t i = d->roff[r], e = i + d->rlen[r]; i < e; i++) d->d[k++] = d->outer[i] - p[i];
  return k;
}

int zt_diloco_create(zt_diloco_t *d, zt_zero_t *z, zt_comm_t *comm, int G, int g,
                     const zt_spec_t *s, int64_t tmo) {
  const zt_zero_view_t *zv = zt_zero_view(z);
  memset(d, 0, sizeof *d);
  d->z = z, d->comm = comm, d->G = G, d->g = g, d->U = zv->U;
  d->H = s->inner_steps, d->tmo = tmo;
  d->lr = (float)s->outer_lr, d->mu = (float)s->outer_momentum, d->nesterov = s->outer_nesterov;
  d->n = zv->shard_total;
  d->outer = calloc(d->n ? d->n : 1, sizeof(float));
  d->mom = calloc(d->n ? d->n : 1, sizeof(float));
  d->d = calloc(d->n ? d->n : 1, sizeof(float));
  int devcomm = G > 1 && comm && zt_comm_device_memory(comm);
  d->q = G > 1 ? (zt_quant_t)s->compression : ZT_QUANT_NONE;
  if (d->q && devcomm) { /* NCCL's links are fast: the pseudo-gradient goes as it is */
    if (g == 0) ZT_INFO("sync.compression: not over NCCL; the pseudo-gradient is sent in fp32");
    d->q = ZT_QUANT_NONE;
  }
  if (devcomm) d->dev = zv->k->alloc(d->n * sizeof(float));
  if (d->q == ZT_QUANT_INT4) {
    d->ef = calloc(d->n ? d->n : 1, sizeof(float));
    d->qtmp = calloc(d->n ? d->n : 1, sizeof(float));
  }
  if (d->q) {
    d->qbytes = zt_quant_bytes(d->q, d->n);
    d->qmine = malloc(d->qbytes);
    d->qall = malloc(d->qbytes * (size_t)G);
  }
  d->F = (int)ZT_MAX(1, ZT_MIN(s->fragments, (long)d->U));
  d->frag_of = zt_xcalloc((size_t)d->U, sizeof *d->frag_of);
  d->roff = zt_xcalloc((size_t)d->U, sizeof *d->roff);
  d->rlen = zt_xcalloc((size_t)d->U, sizeof *d->rlen);
  if (d->F > 1) {
    assign_fragments(d);
    d->w = malloc((d->n ? d->n : 1) * sizeof(float));
    if (d->ef) d->efp = malloc((d->n ? d->n : 1) * sizeof(float));
  }
  if (!d->outer || !d->mom || !d->d || (devcomm && !d->dev) ||
      (d->q && (!d->qall || !d->qmine)) || (d->q == ZT_QUANT_INT4 && (!d->ef || !d->qtmp)) ||
      (d->F > 1 && (!d->w || (d->ef && !d->efp)))) {
    zt_diloco_free(d);
    return zt_errk(ZT_E_NO_MEMORY, "out of memory for DiLoCo's outer state (3 x %zu floats)", d->n);
  }
  return 0;
}

void zt_diloco_free(zt_diloco_t *d) {
  if (d->pending) pthread_join(d->th, NULL);
  d->pending = 0;
  free(d->snap);
  d->snap = NULL;
  free(d->outer);
  free(d->mom);
  free(d->d);
  free(d->qmine);
  free(d->qall);
  free(d->ef);
  free(d->qtmp);
  free(d->w);
  free(d->efp);
  free(d->frag_of);
  free(d->roff);
  free(d->rlen);
  d->qmine = d->qall = NULL;
  d->ef = d->qtmp = d->w = d->efp = NULL;
  d->frag_of = NULL, d->roff = d->rlen = NULL;
  if (d->dev) zt_zero_view(d->z)->k->release(d->dev);
  d->outer = d->mom = d->d = NULL, d->dev = NULL;
}

int zt_diloco_begin(zt_diloco_t *d) {
  memset(d->mom, 0, d->n * sizeof(float));
  d->have_inner = 0;
  return zt_zero_owned_get(d->z, d->outer);
}

/* The compressed sum of d->d[0, count) (fragment f's, packed): every
 * group's encoding gathered, then decoded and added in rank order into
 * d->d. The bytes travel as 16-bit words (an all-gather moves bits,
 * whatever their type). With error feedback, the residual of the
 * fragment's elements goes in and comes out (packed in efp when f >= 0,
 * by ef_pack before and after; the overlap's thread runs this, so it
 * touches no scratch of the training thread's). */
static int sum_compressed(zt_diloco_t *d, int f, size_t count) {
  size_t qbytes = zt_quant_bytes(d->q, count);
  float *ef = d->ef && f >= 0 ? d->efp : d->ef;
  if (ef)
    for (size_t i = 0; i < count; i++) d->d[i] += ef[i];
  zt_quant_encode(d->q, d->d, count, d->qmine);
  if (d->corrupt) { /* test knob: the first value out of range (-128, or int4's -8) */
    d->qmine[4] = d->q == ZT_QUANT_INT4 ? 0x08 : 0x80;
    d->corrupt = 0;
  }
  if (ef) { /* the new residual: what this encoding leaves out */
    memset(d->qtmp, 0, count * sizeof(float));
    if (zt_quant_decode_add(d->q, d->qmine, qbytes, count, d->qtmp, "this group") != 0)
      return -1;
    for (size_t i = 0; i < count; i++) ef[i] = d->d[i] - d->qtmp[i];
  }
  if (zt_comm_all_gather(d->comm, d->qmine, d->qall, qbytes / 2, ZT_DT_BF16, d->tmo) != 0)
    return -1;
  memset(d->d, 0, count * sizeof(float));
  for (int g = 0; g < d->G; g++) {
    char who[32];
    snprintf(who, sizeof who, "group %d", g);
    if (zt_quant_decode_add(d->q, d->qall + qbytes * (size_t)g, qbytes, count, d->d, who) != 0)
      return zt_err_wrap("DiLoCo: the compressed pseudo-gradients");
  }
  return 0;
}

/* Sums d->d[0, count) (fragment f's, packed) over the groups: in place,
 * or through the device buffer when the communicator takes device memory
 * only (NCCL), or compressed. */
static int sum_groups(zt_diloco_t *d, int f, size_t count) {
  if (d->poison && count) { /* test knob: every group then refuses the outer step */
    d->d[0] = NAN;
    d->poison = 0;
  }
  if (d->G == 1) return 0;
  if (d->q) return sum_compressed(d, f, count);
  if (!d->dev) return zt_comm_all_reduce(d->comm, d->d, count, ZT_DT_F32, ZT_RED_SUM, d->tmo);
  const zt_kernels_t *k = zt_zero_view(d->z)->k;
  k->upload(d->dev, d->d, count * sizeof(float));
  if (zt_comm_all_reduce(d->comm, d->dev, count, ZT_DT_F32, ZT_RED_SUM, d->tmo) != 0) return -1;
  k->download(d->d, d->dev, count * sizeof(float));
  return 0;
}

/* The outer optimizer on fragment f's summed pseudo-gradient in d->d
 * (packed, count floats), when it is finite (the return); the sync is
 * counted either way. */
static int outer_step(zt_diloco_t *d, int f, size_t count) {
  const float inv = 1.0f / (float)d->G, mu = d->mu, lr = d->lr;
  int finite = 1;
  for (size_t i = 0; i < count && finite; i++) finite = isfinite(d->d[i]);
  d->syncs++;
  if (!finite) {
    d->refused++;
    return 0;
  }
  size_t k = 0;
  for (int r = 0, nr = frag_ranges(d, f); r < nr; r++) {
    for (size_t i = d->roff[r], e = i + d->rlen[r]; i < e; i++, k++) {
      float delta = d->d[k] * inv;
      float m = mu * d->mom[i] + delta;
      float step = d->nesterov ? delta + mu * m : m;
      d->mom[i] = m;
      d->outer[i] = d->outer[i] - lr * step;
    }
  }
  return 1;
}

int zt_diloco_sync(zt_diloco_t *d, int f, int *applied) {
  int64_t t0 = zt_now_us();
  /* w: the group's parameters (the whole model in d itself when it is
   * one fragment). */
  float *w = d->F > 1 ? d->w : d->d;
  *applied = 0;
  if (zt_zero_owned_get(d->z, w) != 0) return -1;
  size_t count = pack_delta(d, f, w);
  ef_pack(d, f, 0);
  if (sum_groups(d, f, count) != 0) return zt_err_wrap("DiLoCo: the pseudo-gradient's all-reduce");
  ef_pack(d, f, 1);
  *applied = outer_step(d, f, count);
  /* The group's inner parameters, for a checkpoint of this step: from
   * the master, which still holds them until the put below. With
   * fragments, the last step's sync of them all leaves the synced model
   * instead, which is what a load of its epoch gives each group
   * (zt_diloco_load). */
  d->have_inner = d->F == 1 || f >= 0;
  if (w == d->d) {
    if (zt_zero_owned_get(d->z, d->d) != 0 || zt_zero_owned_put(d->z, d->outer) != 0) return -1;
  } else {
    memcpy(d->d, w, d->n * sizeof(float));
    for (int r = 0, nr = frag_ranges(d, f); r < nr; r++)
      memcpy(w + d->roff[r], d->outer + d->roff[r], d->rlen[r] * sizeof(float));
    if (zt_zero_owned_put(d->z, w) != 0) return -1;
  }
  d->sync_ms = (double)(zt_now_us() - t0) / 1000.0;
  return 0;
}

/* The overlapped all-reduce's thread: the sum, and its error kept for
 * zt_diloco_land (an error is the thread's own). */
static void *sum_main(void *arg) {
  zt_diloco_t *d = arg;
  d->th_rc = sum_groups(d, d->pfrag, d->pn);
  if (d->th_rc != 0) {
    d->th_kind = zt_err_kind();
    snprintf(d->th_msg, sizeof d->th_msg, "%s", zt_err_msg());
  }
  return NULL;
}

int zt_diloco_launch(zt_diloco_t *d, int f) {
  int64_t t0 = zt_now_us();
  if (!d->snap && !(d->snap = malloc((d->n ? d->n : 1) * sizeof(float))))
    return zt_errk(ZT_E_NO_MEMORY, "out of memory for DiLoCo's overlap (%zu floats)", d->n);
  if (zt_zero_owned_get(d->z, d->snap) != 0) return -1;
  d->pfrag = f;
  d->pn = pack_delta(d, f, d->snap);
  ef_pack(d, f, 0);
  d->th_rc = 0;
  if (pthread_create(&d->th, NULL, sum_main, d) != 0)
    return zt_err("DiLoCo: cannot start the overlapped all-reduce's thread");
  d->pending = 1;
  d->have_inner = 0;
  d->sync_ms = (double)(zt_now_us() - t0) / 1000.0;
  return 0;
}

int zt_diloco_land(zt_diloco_t *d, int *applied) {
  int64_t t0 = zt_now_us();
  *applied = 0;
  if (!d->pending) return 0;
  pthread_join(d->th, NULL);
  d->pending = 0;
  if (d->th_rc != 0)
    return zt_errk(d->th_kind, "DiLoCo: the pseudo-gradient's all-reduce: %s", d->th_msg);
  ef_pack(d, d->pfrag, 1);
  *applied = outer_step(d, d->pfrag, d->pn);
  /* The new outer parameters plus the group's progress since the launch,
   * over the fragment's elements. */
  float *w = d->F > 1 ? d->w : d->d;
  if (zt_zero_owned_get(d->z, w) != 0) return -1;
  for (int r = 0, nr = frag_ranges(d, d->pfrag); r < nr; r++)
    for (size_t i = d->roff[r], e = i + d->rlen[r]; i < e; i++)
      w[i] = d->outer[i] + (w[i] - d->snap[i]);
  if (zt_zero_owned_put(d->z, w) != 0) return -1;
  d->sync_ms = (double)(zt_now_us() - t0) / 1000.0;
  return 0;
}

/* ---- a lost group dropped from its round (diloco.h) ------------------------------ */

struct zt_diloco_stash {
  uint64_t job;
  int64_t s0, s;
  int G, g;            /* the generation it was computed in */
  size_t n;            /* floats of the owned layout */
  float *p, *m, *v;
  double *rl, *rlr, *rms;
};

void zt_diloco_stash_free(zt_diloco_stash_t *st) {
  if (!st) return;
  free(st->p), free(st->m), free(st->v), free(st->rl), free(st->rlr), free(st->rms);
  free(st);
}

int zt_diloco_stash_keep(zt_diloco_t *d, zt_diloco_stash_t **out, uint64_t job, int64_t s0,
                         int64_t s, const double *rl, const double *rlr, const double *rms) {
  zt_zero_t *z = d->z;
  size_t n = d->n, k = (size_t)(s - s0), b = n * sizeof(float);
  zt_diloco_stash_free(*out);
  *out = NULL;
  zt_diloco_stash_t *st = calloc(1, sizeof *st);
  if (st) {
    *st = (zt_diloco_stash_t){job, s0, s, d->G, d->g, n, malloc(b ? b : 1), malloc(b ? b : 1),
                              malloc(b ? b : 1), malloc(2 * k * sizeof(double)),
                              malloc(k * sizeof(double)), malloc(k * sizeof(double))};
  }
  if (!st || !st->p || !st->m || !st->v || !st->rl || !st->rlr || !st->rms) {
    zt_diloco_stash_free(st);
    return zt_errk(ZT_E_NO_MEMORY, "out of memory keeping DiLoCo's round");
  }
  if (zt_zero_owned_get(z, st->p) != 0 || zt_zero_adam_get(z, st->m, st->v) != 0) {
    zt_diloco_stash_free(st);
    return -1;
  }
  memcpy(st->rl, rl, 2 * k * sizeof(double));
  memcpy(st->rlr, rlr, k * sizeof(double));
  memcpy(st->rms, rms, k * sizeof(double));
  *out = st;
  return 0;
}

int64_t zt_diloco_stash_end(const zt_diloco_stash_t *st, uint64_t job, int64_t s0) {
  return st && st->job == job && st->s0 == s0 ? st->s : 0;
}

void zt_diloco_stash_take(zt_diloco_t *d, const zt_diloco_stash_t *st, double *rl, double *rlr,
                          double *rms, int *n) {
  zt_zero_t *z = d->z;
  size_t k = (size_t)(st->s - st->s0);
  if (zt_zero_owned_put(z, st->p) != 0) ZT_WARN("%s", zt_err_msg());
  if (zt_zero_adam_put(z, st->m, st->v) != 0) ZT_WARN("%s", zt_err_msg());
  memcpy(rl, st->rl, 2 * k * sizeof(double));
  memcpy(rlr, st->rlr, k * sizeof(double));
  memcpy(rms, st->rms, k * sizeof(double));
  *n = (int)k;
  d->have_inner = 0;
  ZT_INFO("diloco: group %d of %d takes back its round %lld..%lld (computed as group %d of %d); "
          "a lost group's share of it is dropped", d->g, d->G, (long long)st->s0 + 1,
          (long long)st->s, st->g, st->G);
}

/* Group g's share of unit u's n elements: [lo, lo + len). */
static void outer_share(const zt_diloco_t *d, size_t n, size_t *lo, size_t *len) {
  size_t per = (n + (size_t)d->G - 1) / (size_t)d->G;
  *lo = ZT_MIN(per * (size_t)d->g, n);
  *len = ZT_MIN(per, n - *lo);
}

size_t zt_diloco_snapshot_floats(const zt_diloco_t *d) {
  size_t total = zt_zero_snapshot_floats(d->z);
  for (int u = 0; u < d->U; u++) {
    size_t olo, on, lo, len;
    zt_zero_owned_range(d->z, u, &olo, &on);
    outer_share(d, on, &lo, &len);
    total += 3 * len + (d->ef ? 3 * on : 0);
  }
  return total;
}

int zt_diloco_snapshot(zt_diloco_t *d, float *buf, zt_ckpt_range_t *ranges, int *nranges) {
  zt_zero_t *z = d->z;
  const zt_zero_view_t *zv = zt_zero_view(z);
  if (zt_zero_snapshot(z, buf, ranges) != 0) return -1;
  float *at = buf + zt_zero_snapshot_floats(z);
  int nr = zv->U;
  for (int u = 0; u < zv->U; u++) {
    ranges[u].unit = d->U * (1 + d->g) + u;
    /* After a sync, its owned ranges as the inner steps left them (each
     * starts its unit's shard in the owned layout). */
    if (d->have_inner)
      memcpy((float *)ranges[u].p, d->d + zv->off_shard[u], ranges[u].n * sizeof(float));
  }
  for (int u = 0; u < zv->U; u++) {
    size_t olo, on, lo, len, off = zv->off_shard[u];
    zt_zero_owned_range(z, u, &olo, &on);
    outer_share(d, on, &lo, &len);
    if (!len) continue;
    memcpy(at, d->outer + off + lo, len * sizeof(float));
    memcpy(at + len, d->mom + off + lo, len * sizeof(float));
    memset(at + 2 * len, 0, len * sizeof(float));
    ranges[nr++] = (zt_ckpt_range_t){u, olo + lo, len, at, at + len, at + 2 * len};
    at += 3 * len;
  }
  for (int u = 0; d->ef && u < zv->U; u++) { /* the residual, zeros for m and v */
    size_t olo, on;
    zt_zero_owned_range(z, u, &olo, &on);
    memcpy(at, d->ef + zv->off_shard[u], on * sizeof(float));
    memset(at + on, 0, 2 * on * sizeof(float));
    ranges[nr++] = (zt_ckpt_range_t){d->U * (1 + d->G + d->g) + u, olo, on, at, at + on,
                                     at + 2 * on};
    at += 3 * on;
  }
  *nranges = nr;
  return 0;
}

int zt_diloco_load(zt_diloco_t *d, const char *dir, const zt_ckpt_record_t *rec, int64_t *step) {
  zt_zero_t *z = d->z;
  const zt_zero_view_t *zv = zt_zero_view(z);
  int groups, units, ef;
  if (zt_ckpt_read_diloco(dir, rec, &groups, &units, &ef) != 0) return -1;
  if (!groups) { /* synchronous training's epoch: its parameters are the outer ones */
    if (zt_zero_load(z, dir, rec, step) != 0) return -1;
    return zt_diloco_begin(d);
  }
  if (units != zv->U)
    return zt_errk(ZT_E_INVALID, "%s/manifest.json: diloco: %d units, but the model has %d "
                   "(corrupt checkpoint)", dir, units, zv->U);
  zt_ckpt_dest_t *extra = zt_xcalloc(2 * (size_t)zv->U, sizeof *extra);
  int from = d->g % groups, ne = 0;
  for (int u = 0; u < zv->U; u++) {
    size_t olo, on;
    zt_zero_owned_range(z, u, &olo, &on);
    extra[ne++] = (zt_ckpt_dest_t){u, olo, on, d->outer + zv->off_shard[u],
                                   d->mom + zv->off_shard[u], NULL};
  }
  /* Error feedback: a group that wrote the epoch takes its residual back;
   * a new one starts at zero (a copy would count the residual twice). */
  if (d->ef) memset(d->ef, 0, d->n * sizeof(float));
  for (int u = 0; d->ef && ef && d->g < groups && u < zv->U; u++) {
    size_t olo, on;
    zt_zero_owned_range(z, u, &olo, &on);
    extra[ne++] = (zt_ckpt_dest_t){zv->U * (1 + groups + from) + u, olo, on,
                                   d->ef + zv->off_shard[u], NULL, NULL};
  }
  int rc = zt_zero_load_ex(z, dir, rec, zv->U * (1 + from), extra, ne, step);
  free(extra);
  if (rc != 0) return -1;
  d->have_inner = 0;
  if (groups != d->G)
    ZT_INFO("diloco: group %d of %d starts from the inner state of group %d of the epoch's %d",
            d->g, d->G, from, groups);
  /* Where the groups met, each starts from the outer parameters, and so
   * does a group that did not write the epoch (a new one, g >= groups).
   * In the middle of a round, a group that wrote it goes on from its
   * inner parameters. With fragments, only the one that synced at the
   * epoch's step (every one at the last step) met there. */
  if (d->g >= groups || (d->F == 1 && *step % d->H == 0)) return zt_zero_owned_put(z, d->outer);
  if (d->F == 1) return 0;
  if (zt_zero_owned_get(z, d->w) != 0) return -1;
  int f = *step % d->H ? -1 : d->F - 1;
  for (int r = 0, nr = frag_ranges(d, f); r < nr; r++)
    memcpy(d->w + d->roff[r], d->outer + d->roff[r], d->rlen[r] * sizeof(float));
  return zt_zero_owned_put(z, d->w);
}
