/*
 * zero_io.c: a rank's ZeRO state in and out (zero.h): fresh or given
 * parameters, checkpoint loads (any world size or stage wrote them) and
 * snapshots, the owned ranges of the fp32 master and the whole master
 * (DiLoCo's outer step), and the owned Adam state (DiLoCo's kept rounds).
 *
 * How it fits. The top of the zero files: every operation here first
 * waits for what the step left queued or in flight (zt_zero_settle, in
 * zero.c), so no gather or due update lands on the values it reads or
 * writes; then it copies between host memory and the state's buffers
 * (the kernel table's memory) and rounds the working copy again where it
 * is not the master (zt__zero_refresh_unit). Where every rank must end
 * with the same values (a loaded stage 0's Adam state, a put of the
 * owned ranges) the ranks share their ranges with zt__zero_all_gather
 * (zero_serial.c). Nothing below calls back into this file.
 *
 * Owned ranges. Unit u's owned range is [r S_u, (r + 1) S_u) clipped to
 * the unit's size (owned(), zero_impl.h); in host buffers over the owned
 * layout it starts at off_shard[u]. Checkpoint files hold every unit's
 * real elements, so a load reads this rank's ranges from whichever ranks
 * wrote them (zt_ckpt_load), and stages 0-2 read the whole unit where
 * they keep it whole.
 */
#include <stdlib.h>
#include <string.h>

#include "zero_impl.h"

/* ---- new parameters ------------------------------------------------------------------ */

/* Each unit is built on the host, from `flat` or by the seeded
 * initialisation (zt_layout_init_unit), and uploaded: whole (P) or this
 * rank's shard (Ps); a separate working copy is rounded from the whole
 * unit (through gbuf) or from the master. */
static void put_params(zt_zero_t *z, uint64_t seed, const float *flat) {
  if (zt_zero_settle(z) != 0) /* no gather may land on the new values */
    ZT_WARN("new parameters: %s (the next step fails)", zt_err_msg());
  z->pver++;
  float *tmp = zt_xmalloc((z->max_unit ? z->max_unit : 1) * sizeof(float));
  for (int u = 0; u < z->U; u++) {
    size_t SN = z->S[u] * (size_t)z->N;
    memset(tmp, 0, SN * sizeof(float));
    if (flat) memcpy(tmp, flat + z->m->lay.unit_off[u], z->usz[u] * sizeof(float));
    else zt_layout_init_unit(&z->m->lay, seed, u, tmp);
    if (z->P)
      z->k->upload(z->P + z->off_full[u], tmp, SN * sizeof(float));
    else
      z->k->upload(z->Ps + z->off_shard[u], tmp + (size_t)z->r * z->S[u], z->S[u] * sizeof(float));
    if (z->split && z->stage > 0 && z->stage < 3) {
      z->k->upload(z->gbuf, tmp, SN * sizeof(float));
      zt__zero_refresh_unit(z, u, z->gbuf);
    } else {
      zt__zero_refresh_unit(z, u, NULL);
    }
  }
  free(tmp);
}

void zt_zero_init_params(zt_zero_t *z, uint64_t seed) { put_params(z, seed, NULL); }

void zt_zero_set_params(zt_zero_t *z, const float *flat) { put_params(z, 0, flat); }

/* ---- checkpoint loads ------------------------------------------------------------------ */

/* A host view of n floats of table memory: the memory itself on the host,
 * else a host buffer (freed by host_done, after copying it up). */
static float *host_view(zt_zero_t *z, float *buf, size_t n) {
  return z->dev ? zt_xcalloc(n ? n : 1, sizeof(float)) : buf; /* padding stays 0 */
}

static void host_done(zt_zero_t *z, float *buf, float *view, size_t n) {
  if (view == buf || !view) return;
  z->k->upload(buf, view, n * sizeof(float));
  free(view);
}

int zt_zero_load(zt_zero_t *z, const char *dir, const zt_ckpt_record_t *rec, int64_t *step) {
  return zt_zero_load_ex(z, dir, rec, 0, NULL, 0, step);
}

/* The destinations of unit u (file unit fu) in the host views: the
 * master's whole unit or owned range, the owned Adam state, and with a
 * split at stages 1-2 the whole unit for the working copy (hw). */
static int unit_dests(zt_zero_t *z, int u, int fu, float *hp, float *hm, float *hv, float *hw,
                      zt_ckpt_dest_t *dest) {
  size_t lo, n;
  int nd = 0;
  owned(z, u, &lo, &n);
  float *m = hm + (opt_ptr(z, z->M, u) - z->M), *v = hv + (opt_ptr(z, z->V, u) - z->V);
  if (z->P) {
    dest[nd++] = (zt_ckpt_dest_t){fu, 0, z->usz[u], hp + z->off_full[u], NULL, NULL};
    dest[nd++] = (zt_ckpt_dest_t){fu, lo, n, NULL, m, v};
  } else {
    dest[nd++] = (zt_ckpt_dest_t){fu, lo, n, hp + z->off_shard[u], m, v};
    if (hw) dest[nd++] = (zt_ckpt_dest_t){fu, 0, z->usz[u], hw + z->off_full[u], NULL, NULL};
  }
  return nd;
}

/* Stage 0 keeps the whole Adam state on every rank: each rank loaded its
 * owned slices, which the ranks now share. */
static int share_adam(zt_zero_t *z) {
  for (int u = 0; u < z->U; u++) {
    float *b[2] = {z->M + z->off_full[u], z->V + z->off_full[u]};
    for (int k = 0; k < 2; k++)
      if (zt__zero_all_gather(z, b[k] + (size_t)z->r * z->S[u], b[k], z->S[u], ZT_DT_F32) != 0)
        return zt_err_wrap("share optimizer state");
  }
  return 0;
}

int zt_zero_load_ex(zt_zero_t *z, const char *dir, const zt_ckpt_record_t *rec, int unit_base,
                    const zt_ckpt_dest_t *extra, int nextra, int64_t *step) {
  /* The master gets every unit's full parameters (P) or the owned shard
   * (Ps), the working copy of stages 1-2 with a split the full units
   * (through hw); all stages need the owned Adam state (stage 0 then
   * re-shares it below). Files are read into host views of P (or Ps), M
   * and V. */
  size_t np = z->P ? z->full_total : z->shard_total;
  size_t no = z->stage == 0 ? z->full_total : z->shard_total;
  int whole_w = z->split && z->stage > 0 && z->stage < 3;
  if (zt_zero_settle(z) != 0) return -1; /* no gather may land on the loaded values */
  z->pver++;
  float *pbuf = z->P ? z->P : z->Ps;
  float *hp = host_view(z, pbuf, np), *hm = host_view(z, z->M, no), *hv = host_view(z, z->V, no);
  float *hw = whole_w ? zt_xcalloc(z->full_total, sizeof(float)) : NULL;
  zt_ckpt_dest_t *dest = zt_xcalloc((size_t)z->U * 2 + (size_t)nextra, sizeof *dest);
  int nd = 0, rc = -1;
  if (!hp || !hm || !hv || !dest) {
    zt_errk(ZT_E_NO_MEMORY, "out of memory loading a checkpoint");
    goto out;
  }
  for (int u = 0; u < z->U; u++) nd += unit_dests(z, u, unit_base + u, hp, hm, hv, hw, dest + nd);
  for (int i = 0; i < nextra; i++) dest[nd++] = extra[i];
  rc = zt_ckpt_load(dir, &z->m->cfg, dest, nd, rec, step);
out:
  free(dest);
  host_done(z, pbuf, hp, np);
  host_done(z, z->M, hm, no);
  host_done(z, z->V, hv, no);
  for (int u = 0; rc == 0 && z->split && u < z->U; u++) {
    if (whole_w) z->k->upload(z->gbuf, hw + z->off_full[u], z->S[u] * (size_t)z->N * sizeof(float));
    zt__zero_refresh_unit(z, u, whole_w ? z->gbuf : NULL);
  }
  free(hw);
  if (rc != 0) return -1;
  return z->stage == 0 ? share_adam(z) : 0;
}

/* ---- the whole master (DiLoCo) ------------------------------------------------------ */

int zt_zero_master_get(zt_zero_t *z, float *host) {
  if (!z->P || z->N != 1) return zt_err("the whole fp32 master is held only by one rank alone");
  if (zt_zero_settle(z) != 0) return -1;
  z->k->download(host, z->P, z->full_total * sizeof(float));
  return 0;
}

int zt_zero_master_put(zt_zero_t *z, const float *host) {
  if (!z->P || z->N != 1) return zt_err("the whole fp32 master is held only by one rank alone");
  if (zt_zero_settle(z) != 0) return -1; /* no update may land on the new values */
  z->pver++;
  z->k->upload(z->P, host, z->full_total * sizeof(float));
  for (int u = 0; u < z->U; u++) zt__zero_refresh_unit(z, u, NULL);
  return 0;
}

/* ---- the owned ranges ------------------------------------------------------------------ */

/* The owned range of unit u in the fp32 master (lo from owned()). */
static float *owned_master(zt_zero_t *z, int u, size_t lo) {
  return z->P ? z->P + z->off_full[u] + lo : z->Ps + z->off_shard[u];
}

void zt_zero_owned_range(const zt_zero_t *z, int u, size_t *lo, size_t *n) { owned(z, u, lo, n); }

int zt_zero_owned_get(zt_zero_t *z, float *host) {
  if (zt_zero_settle(z) != 0) return -1;
  memset(host, 0, z->shard_total * sizeof(float));
  for (int u = 0; u < z->U; u++) {
    size_t lo, n;
    owned(z, u, &lo, &n);
    if (n) z->k->download(host + z->off_shard[u], owned_master(z, u, lo), n * sizeof(float));
  }
  return 0;
}

/* Unit u's new owned range is in the master: where the stage keeps more
 * than the range, the others' ranges follow (a whole master all-gathers
 * it, then rounds the working copy; stages 1-2 with a split round the
 * range into the working copy and all-gather that), else the working
 * copy is rounded from the master. */
static int spread_unit(zt_zero_t *z, int u, size_t lo, size_t n) {
  size_t S = z->S[u];
  int rc = 0;
  if (z->P && z->N > 1) {
    float *p = z->P + z->off_full[u];
    rc = zt__zero_all_gather(z, p + (size_t)z->r * S, p, S, ZT_DT_F32);
    zt__zero_refresh_unit(z, u, NULL);
  } else if (z->split && z->stage < 3) {
    void *w = xadv(z, z->W, z->off_full[u]);
    if (n) z->k->narrow_x(xadv(z, w, lo), z->Ps + z->off_shard[u], n);
    rc = zt__zero_all_gather(z, xadv(z, w, (size_t)z->r * S), w, S, z->xdt);
  } else {
    zt__zero_refresh_unit(z, u, NULL);
  }
  return rc;
}

int zt_zero_owned_put(zt_zero_t *z, const float *host) {
  if (zt_zero_settle(z) != 0) return -1; /* no update may land on the new values */
  z->pver++;
  for (int u = 0; u < z->U; u++) {
    size_t lo, n;
    owned(z, u, &lo, &n);
    if (n) z->k->upload(owned_master(z, u, lo), host + z->off_shard[u], n * sizeof(float));
    if (spread_unit(z, u, lo, n) != 0) return zt_err_wrap("all-gather of the new parameters");
  }
  return 0;
}

/* ---- the owned Adam state (DiLoCo's kept rounds) ------------------------------------- */

/* Stage 0 keeps the state whole: the owned layout only for a rank alone. */
static int adam_owned_layout(const zt_zero_t *z) {
  if (z->stage != 0 || z->N == 1) return 0;
  return zt_err("the Adam state over the owned layout: stage 0 keeps it whole on each of %d ranks",
                z->N);
}

int zt_zero_adam_get(zt_zero_t *z, float *m, float *v) {
  size_t b = z->shard_total * sizeof(float);
  if (adam_owned_layout(z) != 0) return -1;
  z->k->download(m, z->M, b);
  z->k->download(v, z->V, b);
  return 0;
}

int zt_zero_adam_put(zt_zero_t *z, const float *m, const float *v) {
  size_t b = z->shard_total * sizeof(float);
  if (adam_owned_layout(z) != 0) return -1;
  z->k->upload(z->M, m, b);
  z->k->upload(z->V, v, b);
  return 0;
}

/* ---- the whole state at stage 0 --------------------------------------------------- */

size_t zt_zero_full_floats(const zt_zero_t *z) {
  size_t n = 0;
  for (int u = 0; u < z->U; u++) n += z->usz[u];
  return n;
}

/* Stage 0 keeps the whole state in P, M and V at off_full. */
static int whole_state(const zt_zero_t *z) {
  if (z->stage == 0 && z->P) return 0;
  return zt_err("the whole model state is held by every rank only at ZeRO stage 0 (stage %d)",
                z->stage);
}

int zt_zero_full_get(zt_zero_t *z, float *p, float *m, float *v) {
  int back = whole_state(z) != 0 ? -1 : zt__zero_finish_update(z);
  if (back < 0) return -1;
  size_t at = 0;
  for (int u = 0; u < z->U; u++) {
    size_t o = z->off_full[u], b = z->usz[u] * sizeof(float);
    z->k->download(p + at, z->P + o, b);
    z->k->download(m + at, z->M + o, b);
    z->k->download(v + at, z->V + o, b);
    at += z->usz[u];
  }
  return back;
}

int zt_zero_full_put(zt_zero_t *z, const float *p, const float *m, const float *v) {
  if (whole_state(z) != 0 || zt_zero_settle(z) != 0) return -1;
  z->pver++;
  size_t at = 0;
  for (int u = 0; u < z->U; u++) {
    size_t o = z->off_full[u], b = z->usz[u] * sizeof(float);
    z->k->upload(z->P + o, p + at, b);
    z->k->upload(z->M + o, m + at, b);
    z->k->upload(z->V + o, v + at, b);
    zt__zero_refresh_unit(z, u, NULL);
    at += z->usz[u];
  }
  return 0;
}

/* The units' P, M and V ranges, rank root's, on every rank: over the
 * communicator as they are (host memory, or NCCL on the device's), else
 * through host memory. */
int zt_zero_full_broadcast(zt_zero_t *z, int root) {
  if (whole_state(z) != 0 || zt_zero_settle(z) != 0) return -1;
  if (root < 0 || root >= z->N) return zt_err("broadcast from rank %d of %d", root, z->N);
  int direct = !z->dev || z->dcomm;
  float *host = direct ? NULL : zt_xmalloc(z->max_unit * sizeof(float));
  int rc = 0;
  z->pver++;
  if (z->dcomm && z->k->sync) z->k->sync();
  for (int u = 0; rc == 0 && u < z->U; u++) {
    size_t o = z->off_full[u], n = z->usz[u], b = n * sizeof(float);
    float *bufs[3] = {z->P + o, z->M + o, z->V + o};
    for (int i = 0; rc == 0 && i < 3; i++) {
      if (direct) {
        rc = zt_comm_broadcast(z->comm, bufs[i], n, ZT_DT_F32, root, z->tmo);
        continue;
      }
      if (z->r == root) z->k->download(host, bufs[i], b);
      rc = zt_comm_broadcast(z->comm, host, n, ZT_DT_F32, root, z->tmo);
      if (rc == 0 && z->r != root) z->k->upload(bufs[i], host, b);
    }
    if (z->dcomm && z->k->sync) z->k->sync();
    if (rc == 0) zt__zero_refresh_unit(z, u, NULL);
  }
  free(host);
  return rc == 0 ? 0 : zt_err_wrap("the model state from rank %d", root);
}

/* ---- checkpoint snapshots ---------------------------------------------------------- */

size_t zt_zero_snapshot_floats(const zt_zero_t *z) {
  size_t total = 0;
  for (int u = 0; u < z->U; u++) {
    size_t lo, n;
    owned(z, u, &lo, &n);
    total += 3 * n;
  }
  return total;
}

/* Waits for the queued operations before a snapshot. The owned ranges
 * do not change in a gather, but a gather writes the whole unit: read
 * after it. A failed gather of stages 1-3 stays recorded (ov_fail) and
 * fails the next step; the owned ranges are still the step's. Stage 0's
 * updates still due are not applied after a failure, so the parameters
 * would be partly the step before's: that is an error. */
static int snapshot_settle(zt_zero_t *z) {
  if (zt_zero_settle(z) == 0) return 0;
  if (z->due_n)
    return zt_err_wrap("the updates of %d of %d units were not applied, so the snapshot "
                       "would mix this step's parameters with the step before's",
                       z->due_n, z->U);
  ZT_WARN("checkpoint snapshot: %s", zt_err_msg());
  return 0;
}

int zt_zero_snapshot(zt_zero_t *z, float *buf, zt_ckpt_range_t *ranges) {
  float *at = buf;
  if (snapshot_settle(z) != 0) return -1;
  for (int u = 0; u < z->U; u++) {
    size_t lo, n;
    owned(z, u, &lo, &n);
    const float *src[3] = {owned_master(z, u, lo), opt_ptr(z, z->M, u), opt_ptr(z, z->V, u)};
    float *dst[3];
    for (int k = 0; k < 3; k++) {
      dst[k] = at;
      z->k->download(at, src[k], n * sizeof(float));
      at += n;
    }
    ranges[u] = (zt_ckpt_range_t){u, lo, n, dst[0], dst[1], dst[2]};
  }
  return 0;
}
