/*
 * zero.c: a rank's model states under ZeRO stages 0-3 (see zero.h and
 * docs/zero.md), the interface of the zero files: creating and freeing
 * the state, its layout in the kernel table's memory, the hooks that the
 * model calls around each unit's forward and backward, the steps of one
 * training step (micro-steps, the gradient reduction, the optimizer step
 * on the owned shard, the parameter gathers, settling what is still in
 * flight) and the accessors its users read it by.
 *
 * How collectives run. Every hook and step below picks one of three ways
 * and calls into the file that runs it:
 *
 *   serial   on this thread, now (zero_serial.c): no overlap, one rank,
 *            or device memory staged through the host;
 *   thread   queued for the communication thread (zero_thread.c): CPU
 *            workers with overlap (z->overlap);
 *   stream   enqueued in NCCL's stream order (zero_stream.c): GPU workers
 *            over NCCL with overlap (z->sv).
 *
 * The choice is made once, in zt_zero_create, the same on every rank
 * (zt_zero_agree_overlap), so every rank issues the same collectives in
 * the same order. The ways order the collectives differently (overlap
 * reduces units as backward finishes them, prefetches, defers gathers),
 * but every element's fp64 sum is exact and its shards are added in the
 * same order, so the three give the same bits. zero_io.c (loads,
 * snapshots, new parameters) sits above this file and waits through
 * zt_zero_settle; this file calls nothing of it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "zero_impl.h"

/* The largest host all-reduce: the step's control values and, at a load
 * balance plan, two per rank (trainer.c). */
#define ZT_ZERO_CTL_BYTES 8192

/* ---- layout ------------------------------------------------------------------------------ */

/* Zeroed table memory; NULL (and z->oom set) when there is not enough. */
static void *alloc_b(zt_zero_t *z, size_t n, size_t esz, int kind) {
  void *p = z->k->alloc((n ? n : 1) * esz);
  if (!p) z->oom = 1;
  z->state_bytes[kind] += n * esz;
  return p;
}

static float *alloc_f(zt_zero_t *z, size_t n, int kind) { return alloc_b(z, n, sizeof(float), kind); }
/* n elements of the kernel table's storage type (zt_kernels.h, xbytes). */
static float *alloc_x(zt_zero_t *z, size_t n, int kind) { return alloc_b(z, n, z->xb, kind); }
static double *alloc_d(zt_zero_t *z, size_t n, int kind) { return alloc_b(z, n, sizeof(double), kind); }

/* Units, shard sizes and offsets (zero.h, "Layout"). */
static void place_units(zt_zero_t *z) {
  z->U = z->m->lay.num_units;
  z->usz = zt_xcalloc((size_t)z->U, sizeof(size_t));
  z->S = zt_xcalloc((size_t)z->U, sizeof(size_t));
  z->off_full = zt_xcalloc((size_t)z->U, sizeof(size_t));
  z->off_shard = zt_xcalloc((size_t)z->U, sizeof(size_t));
  for (int u = 0; u < z->U; u++) {
    z->usz[u] = z->m->lay.unit_size[u];
    z->S[u] = zt_zero_shard_size(z->usz[u], (size_t)z->N);
    z->off_full[u] = z->full_total;
    z->off_shard[u] = z->shard_total;
    z->full_total += z->S[u] * (size_t)z->N;
    z->shard_total += z->S[u];
    if (z->S[u] * (size_t)z->N > z->max_unit) z->max_unit = z->S[u] * (size_t)z->N;
    if (u > 0 && z->S[u] * (size_t)z->N > z->slot_unit) z->slot_unit = z->S[u] * (size_t)z->N;
  }
  if (!z->slot_unit) z->slot_unit = z->max_unit; /* unit 0 alone */
}

/* The buffers each stage keeps (zero.h's table), counted by kind. */
static void alloc_states(zt_zero_t *z) {
  enum { PARAMS, GRADS, OPT, FLIGHT };
  /* The fp32 master (zero_impl.h): whole where the stage keeps the
   * parameters whole and they are the working copy too, else the owned
   * shard. */
  if (z->stage == 0 || (z->stage < 3 && !z->split)) z->P = alloc_f(z, z->full_total, PARAMS);
  else z->Ps = alloc_f(z, z->shard_total, PARAMS);
  if (!z->split) z->W = z->P, z->Ws = z->Ps;
  else if (z->stage < 3) z->W = alloc_x(z, z->full_total, PARAMS);
  else z->Ws = alloc_x(z, z->shard_total, PARAMS);
  if (z->stage < 2) {
    z->G = alloc_f(z, z->full_total, GRADS);
    z->G64 = alloc_d(z, z->full_total, GRADS);
  } else {
    z->G64 = alloc_d(z, z->shard_total, GRADS);
  }
  size_t opt_n = z->stage == 0 ? z->full_total : z->shard_total;
  z->M = alloc_f(z, opt_n, OPT);
  z->V = alloc_f(z, opt_n, OPT);
  if (z->stage >= 2) {
    z->tg0 = alloc_f(z, z->S[0] * (size_t)z->N, FLIGHT);
    z->tg = alloc_f(z, z->slot_unit, FLIGHT);
    z->rs64 = alloc_d(z, z->slot_unit / (size_t)z->N + 1, FLIGHT);
    if (z->dcomm) z->tg64 = alloc_d(z, z->slot_unit, FLIGHT); /* widened for NCCL */
  }
  if (z->stage >= 2 && z->want_overlap && z->N > 1) /* the second slot (zero.h) */
    z->tgb = alloc_f(z, z->slot_unit, FLIGHT);
  if (z->stage >= 2 && z->sv) { /* stream overlap's second fp64 slot */
    z->tg64b = alloc_d(z, z->slot_unit, FLIGHT);
    z->rs64b = alloc_d(z, z->slot_unit / (size_t)z->N + 1, FLIGHT);
  }
  if (z->stage == 3) {
    z->gat0 = alloc_x(z, z->S[0] * (size_t)z->N, FLIGHT);
    z->gat = alloc_x(z, z->slot_unit, FLIGHT);
    if ((z->want_overlap || z->sv) && z->N > 1) z->gatb = alloc_x(z, z->slot_unit, FLIGHT); /* prefetch */
  }
}

/* The whole layout, the model's units pointed at it; -1 when out of
 * memory (what was allocated stays for zt_zero_free). */
static int layout(zt_zero_t *z) {
  place_units(z);
  alloc_states(z);
  z->gbuf = z->k->alloc((z->max_unit ? z->max_unit : 1) * sizeof(float)); /* not a model state */
  z->scratch_bytes = z->max_unit * sizeof(float);
  if (!z->gbuf || z->oom)
    return zt_errk(ZT_E_NO_MEMORY, "out of %s memory for the model states (%llu bytes)",
                   z->dev ? "device" : "host",
                  (unsigned long long)(z->state_bytes[0] + z->state_bytes[1] +
                                       z->state_bytes[2] + z->state_bytes[3]));
  for (int u = 0; u < z->U; u++) {
    z->m->unit_params[u] = z->W ? xadv(z, z->W, z->off_full[u]) : NULL;
    z->m->unit_grads[u] = z->G ? z->G + z->off_full[u] : NULL;
  }
  return 0;
}

/* sync.compression's buffers (zero_impl.h); -1 when out of memory. */
static int alloc_compression(zt_zero_t *z) {
  size_t S = z->max_unit / (size_t)z->N, qb = zt_quant_bytes((zt_quant_t)z->q, S);
  z->qsend = calloc((size_t)z->N, qb);
  z->qrecv = calloc((size_t)z->N, qb);
  z->qtmp = calloc(S ? S : 1, sizeof(float));
  if (!z->qsend || !z->qrecv || !z->qtmp)
    return zt_errk(ZT_E_NO_MEMORY, "out of memory for the compressed reduction's buffers");
  z->scratch_bytes += 2 * (size_t)z->N * qb + S * sizeof(float);
  return 0;
}

/* With a separate working copy (split), the working copy of unit u from
 * `full`, the whole unit in fp32 table memory (S[u] * N elements), or from
 * the fp32 master. */
void zt__zero_refresh_unit(zt_zero_t *z, int u, const float *full) {
  if (!z->split) return;
  size_t SN = z->S[u] * (size_t)z->N;
  if (z->stage == 3)
    z->k->narrow_x(xadv(z, z->Ws, z->off_shard[u]), z->Ps + z->off_shard[u], z->S[u]);
  else if (full)
    z->k->narrow_x(xadv(z, z->W, z->off_full[u]), full, SN);
  else
    z->k->narrow_x(xadv(z, z->W, z->off_full[u]), z->P + z->off_full[u], SN);
}

/* ---- ZeRO hooks (the model calls them around each unit) ------------------------------- */

static void apply_due(zt_zero_t *z, int u);

static int h_pre_forward(void *ctx, int u) {
  zt_zero_t *z = ctx;
  double w0 = wall_ms();
  if (z->stage == 3 && z->sv) zt__zero_stream_fetch(z, u, u + 1 < z->U ? u + 1 : u - 1);
  else if (z->stage == 3 && z->overlap) zt__zero_thread_fetch(z, u, u + 1 < z->U ? u + 1 : u - 1);
  else if (z->stage == 3) zt__zero_gather_unit(z, u);
  else if (z->overlap && z->ag_ticket) /* stage 0: every gather of the step (below) */
    zt__zero_thread_wait_gather(z, z->stage == 0 && z->due_n ? z->U - 1 : u);
  else if (z->sv) zt__zero_stream_join_gather(z, u);
  z->tm.wait_gather_ms += wall_ms() - w0;
  if (z->stage == 0 && z->due_n && z->due[u] && !z->fail) apply_due(z, u);
  return z->fail ? -1 : 0;
}

static int h_pre_backward(void *ctx, int u) {
  zt_zero_t *z = ctx;
  double w0 = wall_ms();
  /* Backward runs units 0 (the head; unit 0 is still gathered), U-1, ...,
   * 1; the next one to fetch is u - 1, and U - 1 after 0. */
  if (z->stage == 3 && z->sv) zt__zero_stream_fetch(z, u, u != 0 ? u - 1 : z->U - 1);
  else if (z->stage == 3 && z->overlap && u != 0) zt__zero_thread_fetch(z, u, u - 1);
  else if (z->stage == 3 && z->overlap) zt__zero_thread_fetch(z, 0, z->U - 1);
  else if (z->stage == 3 && u != 0) zt__zero_gather_unit(z, u);
  z->tm.wait_gather_ms += wall_ms() - w0;
  if (z->stage < 2 && z->each && z->overlap && z->micro_n > 1) {
    /* G's unit u as the micro-step before left it may still be on the
     * thread (zt_zero_micro_begin did not zero it). */
    if (zt__zero_thread_reduced(z, &z->rd_busy[u]) != 0) return -1;
    z->k->zero(z->G + z->off_full[u], z->S[u] * (size_t)z->N);
  }
  if (z->stage >= 2) {
    float *g = u == 0 ? z->tg0 : z->tg;
    if (z->overlap && zt__zero_thread_grad_slot(z, u, &g) != 0) return -1;
    z->k->zero(g, z->S[u] * (size_t)z->N);
    z->m->unit_grads[u] = g;
  }
  return z->fail ? -1 : 0;
}

/* Unit u's gradient of this micro-step is complete. Stages 0-1: in the
 * last micro-step (with overlap) it is final: enqueued in stream order,
 * or into the sum and onto the thread (where each micro-step is reduced
 * by itself, onto the thread in every micro-step). Stages 2-3, every
 * micro-step: its pieces queued, enqueued or reduced now. */
static int h_post_backward(void *ctx, int u) {
  zt_zero_t *z = ctx;
  if (z->stage < 2 && z->sv) {
    if (z->last_micro && !z->fail && zt__zero_stream_reduce_unit(z, u) != 0)
      zt__zero_hook_fail(z, "reduce-scatter of gradients");
    return z->fail ? -1 : 0;
  }
  if (z->stage < 2 && z->overlap && (z->each || z->last_micro)) {
    zt__zero_thread_queue_unit(z, u);
    return 0;
  }
  if (z->stage < 2 || z->fail) return z->fail ? -1 : 0;
  if (z->overlap) {
    zt__zero_thread_queue_pieces(z, u);
    return 0;
  }
  const float *g = u == 0 ? z->tg0 : z->tg;
  if (z->sv) return zt__zero_stream_reduce_pieces(z, u, g);
  return zt__zero_reduce_pieces(z, u, g);
}

/* ---- create and free ----------------------------------------------------------------- */

/* The choices of the generation, the same on every rank: stage, accum, N
 * and the communicator's kind are the generation's. */
static void choose(zt_zero_t *z, const zt_kernels_t *k, zt_comm_t *comm, const zt_zero_opts_t *o) {
  z->dev = o->dev;
  z->dcomm = o->dev && comm && zt_comm_device_memory(comm);
  z->N = o->world;
  z->r = o->rank;
  z->stage = o->stage;
  z->tmo = o->timeout_ms;
  z->inv_k = o->inv_k;
  z->q = o->compress && z->N > 1 && comm && !zt_comm_device_memory(comm) ? o->compress : 0;
  z->each = z->stage < 2 && !z->dcomm && !z->q &&
            (o->accum == 1 || (o->accum == 2 && z->N > 1 && comm && zt_comm_f32_direct(comm)));
  z->want_overlap = o->overlap && !o->dev; /* the thread runs on host memory only */
  z->sv = o->stream_overlap && z->dcomm && z->N > 1 && k->stream && k->set_waiter;
  z->xb = (size_t)k->xbytes;
  z->xdt = z->xb == 2 ? ZT_DT_BF16 : ZT_DT_F32;
  z->split = z->xb != sizeof(float);
}

static void fill_view(zt_zero_t *z) {
  z->view = (zt_zero_view_t){.k = z->k, .N = z->N, .r = z->r, .stage = z->stage, .U = z->U,
                             .usz = z->usz, .S = z->S, .off_full = z->off_full,
                             .off_shard = z->off_shard, .full_total = z->full_total,
                             .shard_total = z->shard_total, .max_unit = z->max_unit,
                             .inv_k = z->inv_k, .each = z->each, .thread = z->overlap,
                             .stream = z->sv, .dcomm = z->dcomm};
}

/* The hooks on the model. Without the communication thread, each hook
 * points a unit at the same buffer every step (stages 0-1: where layout()
 * put it; stage 2: tg0 or tg for the gradient; stage 3: gat0 or gat for
 * the gathered parameters), and only the hooks touch the table's memory
 * during a step: the model may record the steps into CUDA graphs. With
 * the thread, buffers take turns and the thread copies. Stages 0-1
 * without overlap: every hook would only report z->fail, which nothing
 * sets during the passes. No hooks then, and a CUDA graph holds a
 * micro-step whole. */
static void set_hooks(zt_zero_t *z) {
  zt_model_hooks_t hooks = {.ctx = z,
                            .pre_forward = h_pre_forward,
                            .pre_backward = h_pre_backward,
                            .post_backward = h_post_backward,
                            .fixed_units = !z->overlap};
  zt_model_set_hooks(z->m, z->stage < 2 && !z->overlap && !z->sv ? NULL : &hooks);
}

int zt_zero_create(zt_zero_t **out, zt_model_t *m, const zt_kernels_t *k, zt_comm_t *comm,
                   const zt_zero_opts_t *o) {
  zt_zero_t *z = zt_xcalloc(1, sizeof *z);
  *out = NULL;
  z->m = m;
  z->k = k;
  z->comm = comm;
  choose(z, k, comm, o);
  if (layout(z) != 0) goto err;
  if (z->q && alloc_compression(z) != 0) goto err;
  if (z->dcomm && !(z->ctl_dev = k->alloc(ZT_ZERO_CTL_BYTES))) {
    zt_errk(ZT_E_NO_MEMORY, "out of device memory for %d bytes", ZT_ZERO_CTL_BYTES);
    goto err;
  }
  z->pver = 1;
  z->pf_unit[0] = z->pf_unit[1] = z->pf_unit[2] = -1;
  if (z->sv && zt__zero_stream_start(z) != 0) goto err;
  if (o->overlap && z->N > 1 && !z->dev && zt__zero_thread_start(z) != 0) goto err;
  set_hooks(z);
  fill_view(z);
  *out = z;
  return 0;
err:
  /* The caller gets nothing to free (the worker outlives the generation,
   * so every failed attempt would leak its buffers): free what was
   * allocated here. zt_err keeps the reason and its kind. */
  zt_zero_free(z);
  return -1;
}

/* Safe on a state that zt_zero_create built only in part: every buffer
 * not allocated is NULL, and the thread is stopped only if it started. */
void zt_zero_free(zt_zero_t *z) {
  if (!z) return;
  zt__zero_thread_stop(z);
  if (z->m) zt_model_set_hooks(z->m, NULL);
  if (z->sv) zt__zero_stream_stop(z);
  void *bufs[] = {z->gbuf, z->P,  z->G,  z->Ps,   z->G64, z->M,     z->V,      z->gat0, z->gat,
                  z->gatb, z->tg0, z->tg, z->tgb, z->tg64, z->rs64, z->tg64b, z->rs64b, z->ctl_dev,
                  z->split ? z->W : NULL, z->split ? z->Ws : NULL};
  for (size_t i = 0; i < ZT_ARRAY_LEN(bufs); i++)
    if (bufs[i]) z->k->release(bufs[i]);
  free(z->usz), free(z->S), free(z->off_full), free(z->off_shard);
  free(z->stage_buf);
  free(z->qsend), free(z->qrecv), free(z->qtmp);
  free(z);
}

/* ---- accessors ------------------------------------------------------------------------ */

const zt_zero_view_t *zt_zero_view(const zt_zero_t *z) { return &z->view; }

int zt_zero_failed(const zt_zero_t *z) { return z->fail; }

double zt_zero_waited_ms(const zt_zero_t *z) { return z->tm.wait_reduce_ms + z->tm.wait_gather_ms; }

void zt_zero_count_params(zt_zero_t *z, uint64_t bytes) { z->state_bytes[0] += bytes; }

int zt_zero_write_memory_report(const zt_zero_t *z, const char *workdir,
                                uint64_t activation_bytes, const zt_memplan_need_t *estimate) {
  char path[ZT_PATH_MAX];
  if (zt_path_join(path, sizeof path, workdir, "zero_memory.json") != 0) return -1;
  FILE *f = fopen(path, "w");
  if (!f) return zt_err_errno("%s", path);
  size_t psi = 0, pad = 0;
  for (int u = 0; u < z->U; u++) psi += z->usz[u], pad += z->S[u] * (size_t)z->N - z->usz[u];
  fprintf(f,
          "{\"stage\": %d, \"world\": %d, \"rank\": %d, \"psi\": %zu, \"padding\": %zu, "
          "\"params_bytes\": %llu, \"grads_bytes\": %llu, \"optimizer_bytes\": %llu, "
          "\"inflight_bytes\": %llu, \"scratch_bytes\": %llu, \"activation_bytes\": %llu, "
          "\"estimated_states_bytes\": %llu, \"estimated_activation_bytes\": %llu}\n",
          z->stage, z->N, z->r, psi, pad, (unsigned long long)z->state_bytes[0],
          (unsigned long long)z->state_bytes[1], (unsigned long long)z->state_bytes[2],
          (unsigned long long)z->state_bytes[3], (unsigned long long)z->scratch_bytes,
          (unsigned long long)activation_bytes, (unsigned long long)estimate->states,
          (unsigned long long)estimate->activations);
  if (fclose(f) != 0) return zt_err_errno("%s", path);
  return 0;
}

/* ---- collectives for the trainer and LoRA ------------------------------------------- */

int zt_zero_host_all_reduce(zt_zero_t *z, void *buf, size_t count, zt_dtype_t dt) {
  size_t bytes = count * zt_dtype_size(dt);
  /* the communicator is the thread's until then */
  if (z->overlap && zt__zero_thread_wait(z) != 0) return -1;
  if (!z->dcomm) return zt_comm_all_reduce(z->comm, buf, count, dt, ZT_RED_SUM, z->tmo);
  if (bytes > ZT_ZERO_CTL_BYTES) return zt_err("host all-reduce of %zu bytes: too large", bytes);
  z->k->upload(z->ctl_dev, buf, bytes);
  if (zt_comm_all_reduce(z->comm, z->ctl_dev, count, dt, ZT_RED_SUM, z->tmo) != 0) return -1;
  z->k->download(buf, z->ctl_dev, bytes);
  return 0;
}

int zt_zero_gather_frozen(zt_zero_t *z, const float *shard, float *full, size_t count) {
  /* the communicator is the thread's until then */
  if (z->overlap && zt__zero_thread_wait(z) != 0) return -1;
  return zt__zero_all_gather(z, shard, full, count, z->xdt);
}

/* ---- one step ------------------------------------------------------------------------------ */

void zt_zero_start_step(zt_zero_t *z) { z->micro_n = 0; }

void zt_zero_micro_begin(zt_zero_t *z, int last) {
  z->last_micro = last;
  /* The fp64 sum starts at zero, except where the first micro-step's
   * reduction writes this rank's range (z->each). */
  z->micro_n++;
  /* Stream overlap: a reduction of the step before still in a slot lands
   * first (then the sum starts anew). */
  if (z->sv && z->micro_n == 1 && z->stage >= 2 && zt__zero_stream_land_all(z) != 0)
    zt__zero_hook_fail(z, "reduce-scatter of gradients");
  if (z->micro_n == 1 && !z->each)
    z->k->memzero(z->G64, (z->stage < 2 ? z->full_total : z->shard_total) * sizeof(double));
  if (!z->G) return;
  /* Each micro-step reduced with overlap: the thread may still read G;
   * the hook before each unit's backward zeroes it once it is done. */
  if (z->each && z->overlap && z->micro_n > 1) return;
  if (!z->due_n) {
    z->k->zero(z->G, z->full_total);
    return;
  }
  /* Stage 0 with updates still due: their gradients stay in G until the
   * hook before the unit's forward has applied them (apply_due zeroes it
   * then, before any backward writes it). */
  for (int u = 0; u < z->U; u++)
    if (!z->due[u]) z->k->zero(z->G + z->off_full[u], z->S[u] * (size_t)z->N);
}

int zt_zero_micro_end(zt_zero_t *z) {
  /* With overlap the hooks have summed the last micro-step unit by unit
   * (z->each: every micro-step, on the thread). */
  if (z->G && !((z->overlap || z->sv) && z->last_micro) && !z->each)
    z->k->acc_f64(z->G64, z->G, z->full_total);
  if (z->fail) return zt_err("%s", z->fail_msg);
  if (!z->each || z->overlap) return 0;
  double w0 = wall_ms();
  int rc = 0;
  for (int u = 0; rc == 0 && u < z->U; u++) rc = zt__zero_reduce_unit(z, u, z->micro_n > 1, 0);
  z->tm.wait_reduce_ms += wall_ms() - w0;
  return rc == 0 ? 0 : zt_err_wrap("reduce-scatter of gradients");
}

/* Sums the gradient over ranks: stages 0-1 reduce-scatter it in fp64
 * (stage 0 gathers the scaled result in zt_zero_adamw); stages 2-3 did it
 * unit by unit during backward. */
int zt_zero_reduce(zt_zero_t *z) {
  double w0 = wall_ms();
  int rc = 0;
  if (z->overlap)
    rc = zt__zero_thread_wait(z);
  else if (z->sv)
    rc = zt__zero_stream_settle(z) == 0 ? 0 : zt_err_wrap("reduce-scatter of gradients");
  else if (z->stage < 2 && !z->each) /* else done in zt_zero_micro_end */
    for (int u = 0; rc == 0 && u < z->U; u++) rc = zt__zero_reduce_unit(z, u, 0, 0);
  z->tm.wait_reduce_ms += wall_ms() - w0;
  return rc;
}

/* Sum of squares of the owned gradient elements (the global sum is the
 * all-reduce of these). */
double zt_zero_sumsq(zt_zero_t *z) {
  double s = 0;
  for (int u = 0; u < z->U; u++) {
    size_t lo, n;
    owned(z, u, &lo, &n);
    const double *g = z->stage < 2 ? z->G64 + z->off_full[u] + lo : z->G64 + z->off_shard[u];
    s += z->k->sumsq_f64(g, n, z->inv_k);
  }
  return s;
}

/* ---- the update ---------------------------------------------------------------------- */

/* AdamW on unit u through the kernel table, with the step's settings
 * (z->opt ... z->t, from zt_zero_adamw). Stages 1-3: the owned shard, its
 * fp64 gradient sum scaled (1/K, clip factor) into fp32 first. Stage 0
 * (replicated): every rank updates the whole unit from the gathered fp32
 * gradient in G. Weight decay applies to the tensors the model marks
 * (matmul weights, embeddings). */
static void adamw_unit(zt_zero_t *z, int u) {
  size_t lo, n;
  owned(z, u, &lo, &n);
  float *m = opt_ptr(z, z->M, u), *v = opt_ptr(z, z->V, u);
  const float *g = z->gbuf;
  if (z->stage == 0) {
    lo = 0, n = z->usz[u];
    m = z->M + z->off_full[u], v = z->V + z->off_full[u];
    g = z->G + z->off_full[u];
  }
  if (!n) return;
  float *p = z->P ? z->P + z->off_full[u] + lo : z->Ps + z->off_shard[u];
  const double *g64 = z->stage == 0   ? NULL
                      : z->stage < 2 ? z->G64 + z->off_full[u] + lo
                                     : z->G64 + z->off_shard[u];
  zt_adamw_args_t a;
  if (z->k->adamw_fused &&
      zt_opt_adamw_args(&z->m->lay, z->opt, u, lo, n, z->lr, z->t, &a) == 0) {
    /* One launch: the gradient's scaling, the update and the working copy
     * of what changed (as below). */
    void *w = !z->split         ? NULL
              : z->stage == 3   ? xadv(z, z->Ws, z->off_shard[u])
                                : xadv(z, z->W, z->off_full[u] + lo);
    z->k->adamw_fused(p, g64 ? NULL : g, g64, z->inv_k, z->gscale, m, v, w, &a);
    return;
  }
  if (g64) z->k->narrow_f64(z->gbuf, g64, n, z->inv_k, z->gscale);
  zt_opt_adamw_unit(z->k, &z->m->lay, z->opt, u, lo, n, p, g, m, v, z->lr, z->t);
  /* The working copy of what changed: stage 0 the whole unit, stage 3 the
   * shard, stages 1-2 the owned range (zt_zero_gather shares it). */
  if (z->split && z->stage > 0 && z->stage < 3)
    z->k->narrow_x(xadv(z, z->W, z->off_full[u] + lo), p, n);
  else
    zt__zero_refresh_unit(z, u, NULL);
}

/* Stage 0 with overlap: unit u's gathered gradient has arrived (the
 * caller waited); its update is applied and its G range zeroed for the
 * micro-step's backward. */
static void apply_due(zt_zero_t *z, int u) {
  adamw_unit(z, u);
  z->k->zero(z->G + z->off_full[u], z->S[u] * (size_t)z->N);
  z->due[u] = 0;
  z->due_n--;
}

/* Stage 0 with overlap: every update still due, applied (its gradient
 * has arrived). */
static void apply_all_due(zt_zero_t *z) {
  for (int u = 0; z->due_n && u < z->U; u++)
    if (z->due[u]) apply_due(z, u);
}

/* Stage 0 in stream order: every gather enqueued and joined, then every
 * unit's update (all or none: below). */
static int adamw_replicated_stream(zt_zero_t *z) {
  for (int u = 0; u < z->U; u++)
    if (zt__zero_stream_gather_in_place(z, u, &z->sv_ag[u]) != 0)
      return zt_err_wrap("all-gather of gradients");
  for (int u = 0; u < z->U; u++)
    if (zt__zero_stream_join(z, &z->sv_ag[u]) != 0) return zt_err_wrap("all-gather of gradients");
  for (int u = 0; u < z->U; u++) adamw_unit(z, u);
  return 0;
}

/* Stage 0 serial: every unit's gather, then every unit's update. */
static int adamw_replicated_serial(zt_zero_t *z) {
  double w0 = wall_ms();
  int rc = 0;
  for (int u = 0; rc == 0 && u < z->U; u++) rc = zt__zero_gather_in_place(z, u);
  z->tm.wait_gather_ms += wall_ms() - w0;
  if (rc != 0) return zt_err_wrap("all-gather of gradients");
  for (int u = 0; u < z->U; u++) adamw_unit(z, u);
  return 0;
}

/* Stage 0: the owned range of each unit's reduced sum is scaled into G
 * (fp32) and G is all-gathered unit by unit, so every rank updates the
 * whole unit from the same fp32 gradient that it would have scaled from
 * an all-reduced fp64 sum, with half the bytes on the all-gather. With
 * overlap the gathers are queued and each unit's update is due: the hook
 * before its forward (or zt_zero_settle) applies it once every gather of
 * the step is in.
 *
 * The update is all or none, on every path: no unit is updated before
 * every unit's gradient has arrived. A rank that loses a peer in these
 * gathers therefore holds the state of the step before, whole, and one
 * whose gathers completed holds this step's (zt__zero_finish_update):
 * never a state that is part one step's and part the next's, which no
 * generation could resume from (docs/zero.md, "Recovery from memory"). */
static int adamw_replicated(zt_zero_t *z) {
  for (int u = 0; u < z->U; u++) {
    size_t lo, n;
    owned(z, u, &lo, &n);
    if (n)
      z->k->narrow_f64(z->G + z->off_full[u] + lo, z->G64 + z->off_full[u] + lo, n, z->inv_k,
                       z->gscale);
  }
  if (z->sv) return adamw_replicated_stream(z);
  if (!z->overlap) return adamw_replicated_serial(z);
  if (zt__zero_thread_queue_gathers(z) != 0) return -1;
  for (int u = 0; u < z->U; u++) z->due[u] = 1;
  z->due_n = z->U;
  return 0;
}

int zt_zero_adamw(zt_zero_t *z, const zt_opt_config_t *o, float lr, float gscale, int64_t t) {
  z->pver++; /* gathered copies are stale from here on */
  z->opt = o, z->lr = lr, z->gscale = gscale, z->t = t;
  if (z->stage == 0) return adamw_replicated(z);
  for (int u = 0; u < z->U; u++) adamw_unit(z, u);
  return 0;
}

int zt_zero_gather(zt_zero_t *z) {
  if (z->stage != 1 && z->stage != 2) return 0;
  /* deferred: the next forward waits unit by unit */
  if (z->overlap) return zt__zero_thread_queue_gathers(z);
  if (z->sv) { /* deferred: the next forward joins unit by unit */
    for (int u = 0; u < z->U; u++)
      if (zt__zero_stream_gather_in_place(z, u, &z->sv_ag[u]) != 0)
        return zt_err_wrap("all-gather of parameters");
    return 0;
  }
  double w0 = wall_ms();
  int rc = 0;
  for (int u = 0; rc == 0 && u < z->U; u++) rc = zt__zero_gather_in_place(z, u);
  z->tm.wait_gather_ms += wall_ms() - w0;
  return rc;
}

/* Stage 0 with overlap, after a failure: the comm thread stops; when
 * every gather of the last step arrived intact, the updates still due are
 * applied (0); when one did not, none was applied (the hooks wait for all
 * of them: adamw_replicated) and the state is the step before's (1). Any
 * other layout has no update pending (0). */
int zt__zero_finish_update(zt_zero_t *z) {
  if (z->stage != 0 || !z->overlap || !z->due_n) return 0;
  /* The thread's failure is the generation's, reported already; what
   * matters here is whether the gathers arrived before it. */
  pthread_mutex_lock(&z->ov_mu);
  while (z->ov_len) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
  int arrived = z->ag_ticket[z->U - 1] <= z->ag_ok;
  pthread_mutex_unlock(&z->ov_mu);
  if (!arrived) {
    if (z->due_n != z->U) /* cannot happen: the hooks apply all or none */
      return zt_err("the update of the last step was applied to only %d of %d units",
                    z->U - z->due_n, z->U);
    return 1;
  }
  apply_all_due(z);
  return 0;
}

int zt_zero_settle(zt_zero_t *z) {
  if (z->sv) return zt__zero_stream_settle(z);
  if (!z->overlap) return 0;
  if (zt__zero_thread_wait(z) != 0) return -1;
  apply_all_due(z);
  return 0;
}

void zt_zero_take_times(zt_zero_t *z, zt_zero_times_t *out) {
  if (z->overlap) pthread_mutex_lock(&z->ov_mu);
  *out = z->tm;
  memset(&z->tm, 0, sizeof z->tm);
  if (z->overlap) pthread_mutex_unlock(&z->ov_mu);
}
