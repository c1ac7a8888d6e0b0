/*
 * dist.c: one generation of data-parallel training with ZeRO stages 0-3.
 *
 * zt_gen_train() is called by the runner (runner.c) with a connected
 * communicator, this rank's place in the generation and the job spec. It
 * builds the model, lays out the model states for the ZeRO stage (see
 * docs/zero.md), initialises them (or loads the committed checkpoint the
 * coordinator named, resharding it to this world size), and runs steps
 * until the job's last step, a stop request or a failure.
 *
 * Layout. Every unit u (see gpt.h) of U_u elements is padded to N*S_u,
 * S_u = ceil(U_u / N); rank r owns [r*S_u, (r+1)*S_u). Storage per stage:
 *
 *   stage  params          grads                    Adam m, v
 *   0      full            full                     full
 *   1      full            full                     shard
 *   2      full            shard (+ unit in flight) shard
 *   3      shard (+ units  shard (+ unit in flight) shard
 *          gathered in flight)
 *
 * One step: accum micro-steps of forward + backward (gradients accumulated
 * in fp32, scaled 1/accum); then stage 0 all-reduces the gradients, stage 1
 * reduce-scatters them, stages 2 and 3 have already reduce-scattered each
 * unit's gradient in the backward hook of every micro-step. One small
 * all-reduce then carries [loss, grad sum of squares, non-finite flag,
 * checkpoint flag], so every rank takes the same decisions: clip by the
 * global norm, skip a non-finite update, checkpoint at the same step.
 * AdamW updates the owned shard; stages 1 and 2 all-gather the parameters.
 * Stage 3 all-gathers a unit right before the model uses it (forward and
 * backward) and drops it after.
 *
 * Devices. Every buffer above lives in the memory of the kernel table d->k
 * and every operation on it is a kernel-table call (zero, acc_f64,
 * narrow_f64, adamw, ...): host memory and the CPU kernels, or device
 * memory and the CUDA kernels for `zworker --device cuda:N` (worker/gpu.c).
 * The same code, and the same tests, therefore cover both. Collectives go
 * through c_*(): over the TCP ring a device buffer is staged through host
 * memory; with one rank they are local copies. Checkpoint files are read
 * and written through host buffers (upload after loading, download into the
 * snapshot).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "ckpt_io.h"
#include "comm.h"
#include "data.h"
#include "gpu.h"
#include "model.h"
#include "optim.h"
#include "runner.h"
#include "spec.h"
#include "zt_kernels.h"
#include "zt_common.h"
#include "ztrain.pb-c.h"

typedef struct {
  const zt_gen_ctx *g;
  zt_spec_t spec;
  zt_model_config_t cfg;
  zt_model_t *m;
  const zt_kernels_t *k;  /* kernels and memory of the model and its state */
  int dev;                /* that memory is a device's (not host memory) */
  void *stage_buf;        /* host staging for collectives on device memory */
  size_t stage_cap;
  double fi_lr_scale; /* fault_injection (tests only) */
  int64_t fi_from, fi_to;
  int fi_repeat; /* also after rollbacks (default: the first run only) */
  float *gbuf;        /* one unit's owned gradient in fp32, for the AdamW kernel */
  zt_comm_t *comm;
  int N, r, stage, U, accum;
  int64_t tmo;
  size_t *usz, *S;       /* unit size, shard size */
  size_t *off_full;      /* offset of unit u in full (padded) buffers */
  size_t *off_shard;     /* offset of unit u in shard buffers */
  size_t full_total, shard_total, max_unit;
  float *P, *G;          /* full params; one micro-step's full grads (stages 0-1) */
  float *Ps;             /* stage 3 parameter shard */
  double *G64;           /* gradient sum: full (stages 0-1) or shard (2-3) */
  float *M, *V;          /* Adam state: full (stage 0) or shard */
  float *gat0, *gat;     /* stage 3: gathered unit 0 and the current unit */
  float *tg0, *tg;       /* stage 2-3: full grads of unit 0 and of the current unit */
  double *tg64, *rs64;   /* stage 2-3: a unit's grads in fp64, and its reduced shard */
  double inv_k;          /* 1 / micro-batches per step (all ranks) */
  int fail;              /* a collective in a hook failed */
  int oom;               /* layout: an allocation failed */
  char fail_msg[512];
  uint64_t state_bytes[4]; /* params, grads, optimizer, in-flight */
} dist;

/* ---- allocation and accounting ------------------------------------------------- */

/* Zeroed table memory; NULL (and d->oom set) when there is not enough. */
static void *alloc_b(dist *d, size_t n, size_t esz, int kind) {
  void *p = d->k->alloc((n ? n : 1) * esz);
  if (!p) d->oom = 1;
  d->state_bytes[kind] += n * esz;
  return p;
}

static float *alloc_f(dist *d, size_t n, int kind) { return alloc_b(d, n, sizeof(float), kind); }
static double *alloc_d(dist *d, size_t n, int kind) { return alloc_b(d, n, sizeof(double), kind); }

/* ---- collectives on table memory ---------------------------------------------------
 *
 * With one rank a collective is a local copy. Otherwise host memory goes
 * straight to the communicator; device memory is staged: the region the
 * call reads (send, or recv when send lies inside it, as in the in-place
 * calls of stages 1-2) is downloaded, the collective runs on host memory,
 * and what it wrote is uploaded. */

static char *stage(dist *d, size_t bytes) {
  if (bytes > d->stage_cap) {
    free(d->stage_buf);
    d->stage_buf = malloc(bytes);
    d->stage_cap = d->stage_buf ? bytes : 0;
    if (!d->stage_buf) zt_err("out of host memory for a %zu-byte collective", bytes);
  }
  return d->stage_buf;
}

static int c_all_reduce(dist *d, void *buf, size_t count, zt_dtype_t dt) {
  size_t bytes = count * zt_dtype_size(dt);
  if (d->N == 1) return 0;
  if (!d->dev) return zt_comm_all_reduce(d->comm, buf, count, dt, ZT_RED_SUM, d->tmo);
  char *h = stage(d, bytes);
  if (!h) return -1;
  d->k->download(h, buf, bytes);
  if (zt_comm_all_reduce(d->comm, h, count, dt, ZT_RED_SUM, d->tmo) != 0) return -1;
  d->k->upload(buf, h, bytes);
  return 0;
}

/* Covers both in-place forms: recv inside send (reduce-scatter) and send
 * inside recv (all-gather). `big` is the world*count side. */
static int c_staged(dist *d, char *big, char *small, size_t count, zt_dtype_t dt, int gather) {
  size_t es = zt_dtype_size(dt), bb = count * es * (size_t)d->N, sb = count * es;
  int inside = small >= big && small < big + bb;
  char *h = stage(d, bb + (inside ? 0 : sb));
  if (!h) return -1;
  char *hs = inside ? h + (small - big) : h + bb;
  if (gather) {
    d->k->download(hs, small, sb);
    if (zt_comm_all_gather(d->comm, hs, h, count, dt, d->tmo) != 0) return -1;
    d->k->upload(big, h, bb);
  } else {
    d->k->download(h, big, bb);
    if (zt_comm_reduce_scatter(d->comm, h, hs, count, dt, ZT_RED_SUM, d->tmo) != 0) return -1;
    d->k->upload(small, hs, sb);
  }
  return 0;
}

static int c_reduce_scatter(dist *d, void *send, void *recv, size_t count, zt_dtype_t dt) {
  if (d->N == 1) {
    if (send != recv) d->k->copy(recv, send, count * zt_dtype_size(dt));
    return 0;
  }
  if (!d->dev)
    return zt_comm_reduce_scatter(d->comm, send, recv, count, dt, ZT_RED_SUM, d->tmo);
  return c_staged(d, send, recv, count, dt, 0);
}

static int c_all_gather(dist *d, const void *send, void *recv, size_t count, zt_dtype_t dt) {
  if (d->N == 1) {
    if (send != recv) d->k->copy(recv, send, count * zt_dtype_size(dt));
    return 0;
  }
  if (!d->dev) return zt_comm_all_gather(d->comm, send, recv, count, dt, d->tmo);
  return c_staged(d, recv, (char *)send, count, dt, 1);
}

static int layout(dist *d) {
  d->U = zt_model_num_units(d->m);
  d->usz = calloc((size_t)d->U, sizeof(size_t));
  d->S = calloc((size_t)d->U, sizeof(size_t));
  d->off_full = calloc((size_t)d->U, sizeof(size_t));
  d->off_shard = calloc((size_t)d->U, sizeof(size_t));
  for (int u = 0; u < d->U; u++) {
    d->usz[u] = zt_model_unit_size(d->m, u);
    d->S[u] = (d->usz[u] + (size_t)d->N - 1) / (size_t)d->N;
    d->off_full[u] = d->full_total;
    d->off_shard[u] = d->shard_total;
    d->full_total += d->S[u] * (size_t)d->N;
    d->shard_total += d->S[u];
    if (d->S[u] * (size_t)d->N > d->max_unit) d->max_unit = d->S[u] * (size_t)d->N;
  }
  enum { PARAMS, GRADS, OPT, FLIGHT };
  if (d->stage < 3) d->P = alloc_f(d, d->full_total, PARAMS);
  else d->Ps = alloc_f(d, d->shard_total, PARAMS);
  if (d->stage < 2) {
    d->G = alloc_f(d, d->full_total, GRADS);
    d->G64 = alloc_d(d, d->full_total, GRADS);
  } else {
    d->G64 = alloc_d(d, d->shard_total, GRADS);
  }
  size_t opt_n = d->stage == 0 ? d->full_total : d->shard_total;
  d->M = alloc_f(d, opt_n, OPT);
  d->V = alloc_f(d, opt_n, OPT);
  if (d->stage >= 2) {
    d->tg0 = alloc_f(d, d->S[0] * (size_t)d->N, FLIGHT);
    d->tg = alloc_f(d, d->max_unit, FLIGHT);
    d->tg64 = alloc_d(d, d->max_unit, FLIGHT);
    d->rs64 = alloc_d(d, d->max_unit / (size_t)d->N + 1, FLIGHT);
  }
  if (d->stage == 3) {
    d->gat0 = alloc_f(d, d->S[0] * (size_t)d->N, FLIGHT);
    d->gat = alloc_f(d, d->max_unit, FLIGHT);
  }
  d->gbuf = d->k->alloc((d->max_unit ? d->max_unit : 1) * sizeof(float)); /* not a model state */
  if (!d->gbuf || d->oom)
    return zt_err("out of %s memory for the model states (%llu bytes)", d->dev ? "device" : "host",
                  (unsigned long long)(d->state_bytes[0] + d->state_bytes[1] +
                                       d->state_bytes[2] + d->state_bytes[3]));
  for (int u = 0; u < d->U; u++) {
    d->m->unit_params[u] = d->P ? d->P + d->off_full[u] : NULL;
    d->m->unit_grads[u] = d->G ? d->G + d->off_full[u] : NULL;
  }
  return 0;
}

static void free_dist(dist *d) {
  zt_model_free(d->m);
  void *bufs[] = {d->gbuf, d->P,   d->G,   d->Ps, d->G64, d->M,    d->V,
                  d->gat0, d->gat, d->tg0, d->tg, d->tg64, d->rs64};
  for (size_t i = 0; i < ZT_ARRAY_LEN(bufs); i++)
    if (bufs[i]) d->k->release(bufs[i]);
  free(d->usz), free(d->S), free(d->off_full), free(d->off_shard);
  free(d->stage_buf);
}

/* The owned range of unit u, clipped to its real size: [lo, lo + n). */
static void owned(const dist *d, int u, size_t *lo, size_t *n) {
  size_t a = (size_t)d->r * d->S[u], b = a + d->S[u];
  if (b > d->usz[u]) b = d->usz[u];
  *lo = a < b ? a : b;
  *n = b > a ? b - a : 0;
}

/* Writes the bytes of model states this rank holds (docs/zero.md). */
static void write_memory_report(const dist *d) {
  if (!d->g->workdir) return;
  char path[1100];
  snprintf(path, sizeof path, "%s/zero_memory.json", d->g->workdir);
  FILE *f = fopen(path, "w");
  if (!f) return;
  size_t psi = 0, pad = 0;
  for (int u = 0; u < d->U; u++) psi += d->usz[u], pad += d->S[u] * (size_t)d->N - d->usz[u];
  fprintf(f,
          "{\"stage\": %d, \"world\": %d, \"rank\": %d, \"psi\": %zu, \"padding\": %zu, "
          "\"params_bytes\": %llu, \"grads_bytes\": %llu, \"optimizer_bytes\": %llu, "
          "\"inflight_bytes\": %llu}\n",
          d->stage, d->N, d->r, psi, pad, (unsigned long long)d->state_bytes[0],
          (unsigned long long)d->state_bytes[1], (unsigned long long)d->state_bytes[2],
          (unsigned long long)d->state_bytes[3]);
  fclose(f);
}

/* ---- ZeRO hooks --------------------------------------------------------------------- */

static void hook_fail(dist *d, const char *what) {
  if (!d->fail) {
    d->fail = 1;
    snprintf(d->fail_msg, sizeof d->fail_msg, "%s: %s", what, zt_err_msg());
  }
}

/* Stage 3: gather unit u's parameters into a full buffer. */
static void gather_unit(dist *d, int u) {
  float *buf = u == 0 ? d->gat0 : d->gat;
  if (d->fail) return;
  if (c_all_gather(d, d->Ps + d->off_shard[u], buf, d->S[u], ZT_DT_F32) != 0)
    hook_fail(d, "all-gather of parameters");
  d->m->unit_params[u] = buf;
}

static int h_pre_forward(void *ctx, int u) {
  dist *d = ctx;
  if (d->stage == 3) gather_unit(d, u);
  return d->fail ? -1 : 0;
}

static int h_pre_backward(void *ctx, int u) {
  dist *d = ctx;
  if (d->stage == 3 && u != 0) gather_unit(d, u); /* unit 0 is still gathered */
  if (d->stage >= 2) {
    float *g = u == 0 ? d->tg0 : d->tg;
    d->k->zero(g, d->S[u] * (size_t)d->N);
    d->m->unit_grads[u] = g;
  }
  return d->fail ? -1 : 0;
}

/* Stages 2-3: reduce-scatter the unit's gradient (in fp64, so the sum is
 * exact) and add this rank's shard to the running sum. */
static int h_post_backward(void *ctx, int u) {
  dist *d = ctx;
  if (d->stage < 2 || d->fail) return d->fail ? -1 : 0;
  const float *g = u == 0 ? d->tg0 : d->tg;
  d->k->widen_f64(d->tg64, g, d->S[u] * (size_t)d->N);
  if (c_reduce_scatter(d, d->tg64, d->rs64, d->S[u], ZT_DT_F64) != 0) {
    hook_fail(d, "reduce-scatter of gradients");
    return -1;
  }
  d->k->add_f64(d->G64 + d->off_shard[u], d->rs64, d->S[u]);
  return 0;
}

/* ---- state init / load / save -------------------------------------------------------- */

/* Each unit is initialised on the host (zt_model_init_unit) and uploaded:
 * whole (stages 0-2) or this rank's shard (stage 3). */
static int init_params(dist *d) {
  float *tmp = malloc((d->max_unit ? d->max_unit : 1) * sizeof(float));
  if (!tmp) return zt_err("out of memory initialising the parameters");
  for (int u = 0; u < d->U; u++) {
    memset(tmp, 0, d->S[u] * (size_t)d->N * sizeof(float));
    zt_model_init_unit(d->m, d->spec.seed, u, tmp);
    if (d->stage < 3)
      d->k->upload(d->P + d->off_full[u], tmp, d->S[u] * (size_t)d->N * sizeof(float));
    else
      d->k->upload(d->Ps + d->off_shard[u], tmp + (size_t)d->r * d->S[u], d->S[u] * sizeof(float));
  }
  free(tmp);
  return 0;
}

/* Where this rank's owned Adam state of unit u lives. */
static float *opt_ptr(dist *d, float *base, int u) {
  return d->stage == 0 ? base + d->off_full[u] + (size_t)d->r * d->S[u] : base + d->off_shard[u];
}

/* A host view of n floats of table memory: the memory itself on the host,
 * else a host buffer (freed by host_done, after copying it up). */
static float *host_view(dist *d, float *buf, size_t n) {
  return d->dev ? malloc((n ? n : 1) * sizeof(float)) : buf;
}

static void host_done(dist *d, float *buf, float *view, size_t n) {
  if (view == buf || !view) return;
  d->k->upload(buf, view, n * sizeof(float));
  free(view);
}

static int load_state(dist *d, const char *dir, int64_t *step) {
  /* Stages 0-2 need every unit's full parameters; all stages need the
   * owned Adam state (stage 0 then re-shares it below). Files are read into
   * host views of P (or Ps), M and V. */
  size_t np = d->stage < 3 ? d->full_total : d->shard_total;
  size_t no = d->stage == 0 ? d->full_total : d->shard_total;
  float *pbuf = d->stage < 3 ? d->P : d->Ps;
  float *hp = host_view(d, pbuf, np), *hm = host_view(d, d->M, no), *hv = host_view(d, d->V, no);
  zt_ckpt_dest *dest = calloc((size_t)d->U * 2, sizeof *dest);
  int nd = 0, rc = -1;
  if (!hp || !hm || !hv || !dest) {
    zt_err("out of memory loading a checkpoint");
    goto out;
  }
  for (int u = 0; u < d->U; u++) {
    size_t lo, n;
    owned(d, u, &lo, &n);
    float *m = hm + (opt_ptr(d, d->M, u) - d->M), *v = hv + (opt_ptr(d, d->V, u) - d->V);
    if (d->stage < 3) {
      dest[nd++] = (zt_ckpt_dest){u, 0, d->usz[u], hp + d->off_full[u], NULL, NULL};
      dest[nd++] = (zt_ckpt_dest){u, lo, n, NULL, m, v};
    } else {
      dest[nd++] = (zt_ckpt_dest){u, lo, n, hp + d->off_shard[u], m, v};
    }
  }
  rc = zt_ckpt_load(dir, &d->cfg, dest, nd, step);
out:
  free(dest);
  host_done(d, pbuf, hp, np);
  host_done(d, d->M, hm, no);
  host_done(d, d->V, hv, no);
  if (rc != 0) return -1;
  if (d->stage == 0) {
    /* Full Adam state on every rank: share the owned slices. */
    for (int u = 0; u < d->U; u++) {
      float *b[2] = {d->M + d->off_full[u], d->V + d->off_full[u]};
      for (int k = 0; k < 2; k++)
        if (c_all_gather(d, b[k] + (size_t)d->r * d->S[u], b[k], d->S[u], ZT_DT_F32) != 0)
          return zt_err_wrap("share optimizer state");
    }
  }
  return 0;
}

/* Asynchronous checkpoints. The training thread snapshots its owned
 * ranges into one host buffer (a memcpy) and hands it to the writer thread,
 * which writes, fsyncs, renames and reports while training goes on. One
 * epoch is in flight at a time: a new snapshot first waits for the
 * previous write to finish. */
typedef struct {
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int busy, quit, started, failed;
  char dir[1024];
  zt_ckpt_meta meta;
  zt_range_t skips[64];
  zt_ckpt_range *rg;
  int nr;
  float *buf;
  size_t buf_cap;
  const zt_gen_ctx *g;
  char err[512];
} ckpt_writer;

static void *writer_main(void *p) {
  ckpt_writer *w = p;
  pthread_mutex_lock(&w->mu);
  for (;;) {
    while (!w->busy && !w->quit) pthread_cond_wait(&w->cv, &w->mu);
    if (!w->busy) break;
    pthread_mutex_unlock(&w->mu);
    zt_ckpt_file files[4];
    int nf = 0, rc;
    int64_t t0 = zt_now_ms();
    rc = zt_ckpt_write(w->dir, &w->meta, w->rg, w->nr, files, &nf);
    if (rc == 0) {
      ZT_INFO("checkpoint step %lld written in %lld ms: %s", (long long)w->meta.step,
              (long long)(zt_now_ms() - t0), w->dir);
      if (w->g->report_checkpoint &&
          w->g->report_checkpoint(w->g->user, w->meta.step, w->dir, files, nf) != 0)
        ZT_WARN("checkpoint step %lld was not recorded by the coordinator",
                (long long)w->meta.step);
    } else {
      ZT_ERROR("checkpoint step %lld: %s", (long long)w->meta.step, zt_err_msg());
    }
    pthread_mutex_lock(&w->mu);
    if (rc != 0) {
      w->failed = 1;
      snprintf(w->err, sizeof w->err, "%s", zt_err_msg());
    }
    w->busy = 0;
    pthread_cond_broadcast(&w->cv);
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

static void writer_wait(ckpt_writer *w) {
  if (!w->started) return;
  pthread_mutex_lock(&w->mu);
  while (w->busy) pthread_cond_wait(&w->cv, &w->mu);
  pthread_mutex_unlock(&w->mu);
}

static void writer_stop(ckpt_writer *w) {
  if (!w->started) return;
  pthread_mutex_lock(&w->mu);
  w->quit = 1;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->th, NULL);
  pthread_cond_destroy(&w->cv);
  pthread_mutex_destroy(&w->mu);
  free(w->rg);
  free(w->buf);
  w->started = 0;
}

static int save_state(dist *d, ckpt_writer *w, int64_t step) {
  if (!w->started) {
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->g = d->g;
    w->rg = calloc((size_t)d->U, sizeof *w->rg);
    if (pthread_create(&w->th, NULL, writer_main, w) != 0) return zt_err("checkpoint writer");
    w->started = 1;
  }
  writer_wait(w);
  if (w->failed) return zt_err("previous checkpoint failed: %s", w->err);
  size_t total = 0;
  for (int u = 0; u < d->U; u++) {
    size_t lo, n;
    owned(d, u, &lo, &n);
    total += 3 * n;
  }
  if (total > w->buf_cap) {
    free(w->buf);
    w->buf = malloc((total ? total : 1) * sizeof(float));
    if (!w->buf) return zt_err("out of memory for a checkpoint snapshot");
    w->buf_cap = total;
  }
  float *at = w->buf;
  for (int u = 0; u < d->U; u++) {
    size_t lo, n;
    owned(d, u, &lo, &n);
    const float *src[3] = {d->stage < 3 ? d->P + d->off_full[u] + lo : d->Ps + d->off_shard[u],
                           opt_ptr(d, d->M, u), opt_ptr(d, d->V, u)};
    float *dst[3];
    for (int k = 0; k < 3; k++) {
      dst[k] = at;
      d->k->download(at, src[k], n * sizeof(float));
      at += n;
    }
    w->rg[u] = (zt_ckpt_range){u, lo, n, dst[0], dst[1], dst[2]};
  }
  w->nr = d->U;
  zt_ckpt_dirname(w->dir, sizeof w->dir, d->spec.ckpt.dir, d->g->job_id, step, d->g->generation);
  int ns = ZT_MIN(d->g->nskips, 64);
  memcpy(w->skips, d->g->skips, (size_t)ns * sizeof *w->skips);
  w->meta = (zt_ckpt_meta){d->g->job_id, d->g->generation, step, d->r, d->N, d->stage, d->cfg,
                           d->spec.seed, d->spec.global_batch, w->skips, ns};
  pthread_mutex_lock(&w->mu);
  w->busy = 1;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  return 0;
}

/* ---- the optimizer ---------------------------------------------------------------------- */

/* AdamW on the owned shard of unit u through the kernel table; the fp64
 * gradient sum is scaled (1/K, clip factor) into fp32 first. Weight decay
 * applies to the tensors the model marks (matmul weights, embeddings). */
static void adamw_unit(dist *d, int u, float lr, float gscale, int64_t t) {
  size_t lo, n;
  owned(d, u, &lo, &n);
  float *m = opt_ptr(d, d->M, u), *v = opt_ptr(d, d->V, u);
  if (d->stage == 0) { /* replicated: every rank updates the whole unit */
    lo = 0, n = d->usz[u];
    m = d->M + d->off_full[u], v = d->V + d->off_full[u];
  }
  if (!n) return;
  float *p = d->stage < 3 ? d->P + d->off_full[u] + lo : d->Ps + d->off_shard[u];
  const double *g = d->stage < 2 ? d->G64 + d->off_full[u] + lo : d->G64 + d->off_shard[u];
  d->k->narrow_f64(d->gbuf, g, n, d->inv_k, gscale);
  const zt_opt_config_t *o = &d->spec.opt;
  float bc1 = 1.0f - powf(o->beta1, (float)t), bc2 = 1.0f - powf(o->beta2, (float)t);
  for (int k = 0; k < d->m->num_tensors; k++) {
    const zt_tensor_t *tn = &d->m->tensors[k];
    if (tn->unit != u) continue;
    size_t a = ZT_MAX(tn->unit_off, lo), b = ZT_MIN(tn->unit_off + tn->n, lo + n);
    if (a >= b) continue;
    d->k->adamw(p + (a - lo), d->gbuf + (a - lo), m + (a - lo), v + (a - lo), b - a, lr, o->beta1,
                o->beta2, o->eps, tn->decay ? o->weight_decay : 0.0f, bc1, bc2);
  }
}

/* Sum of squares of the owned gradient elements (the global sum is the
 * all-reduce of these). */
static double owned_sumsq(dist *d) {
  double s = 0;
  for (int u = 0; u < d->U; u++) {
    size_t lo, n;
    owned(d, u, &lo, &n);
    const double *g = d->stage < 2 ? d->G64 + d->off_full[u] + lo : d->G64 + d->off_shard[u];
    s += d->k->sumsq_f64(g, n, d->inv_k);
  }
  return s;
}

static double step_lr(dist *d, int64_t step) {
  float mult = 1.0f;
  if (step <= d->g->lr_until && d->g->lr_factor > 0) mult *= (float)d->g->lr_factor;
  /* Test-only fault injection: a huge LR for a step range, first run only. */
  if (d->fi_lr_scale > 0 && (d->g->rollbacks == 0 || d->fi_repeat) && step >= d->fi_from &&
      step <= d->fi_to)
    mult *= (float)d->fi_lr_scale;
  return zt_lr_at(&d->spec.sched, d->spec.opt.lr, (long)(step - 1), mult);
}

/* ---- one step ------------------------------------------------------------------------------ */

static void zero_grads(dist *d) {
  d->k->memzero(d->G64, (d->stage < 2 ? d->full_total : d->shard_total) * sizeof(double));
}

/* Sums the gradient over ranks: all-reduce (stage 0) or reduce-scatter
 * (stage 1) in fp64; stages 2-3 did it unit by unit during backward. */
static int reduce_grads(dist *d) {
  if (d->stage == 0) return c_all_reduce(d, d->G64, d->full_total, ZT_DT_F64);
  if (d->stage == 1)
    for (int u = 0; u < d->U; u++) {
      double *g = d->G64 + d->off_full[u];
      if (c_reduce_scatter(d, g, g + (size_t)d->r * d->S[u], d->S[u], ZT_DT_F64) != 0) return -1;
    }
  return 0;
}

static int gather_params(dist *d) {
  if (d->stage != 1 && d->stage != 2) return 0;
  for (int u = 0; u < d->U; u++) {
    float *p = d->P + d->off_full[u];
    if (c_all_gather(d, p + (size_t)d->r * d->S[u], p, d->S[u], ZT_DT_F32) != 0) return -1;
  }
  return 0;
}

static float eval_loss(dist *d, zt_data_t *val, int *inp, int *tgt) {
  int mb = d->spec.micro_batch, T = d->cfg.seq_len;
  float acc[2] = {0, 0};
  uint64_t ns = zt_data_num_samples(val);
  for (int b = d->r; b < d->spec.eval_batches; b += d->N) {
    float l = NAN;
    if (zt_data_fill_seq(val, ((uint64_t)b * (uint64_t)mb) % (ns - (uint64_t)mb + 1), mb, inp,
                         tgt) != 0 ||
        zt_model_forward(d->m, inp, tgt, mb, T, &l) != 0)
      return NAN;
    acc[0] += l;
    acc[1] += 1;
  }
  if (zt_comm_all_reduce(d->comm, acc, 2, ZT_DT_F32, ZT_RED_SUM, d->tmo) != 0) return NAN;
  return acc[1] > 0 ? acc[0] / acc[1] : NAN;
}

/* fault_injection{lr_scale, from_step, to_step, repeat}: tests only. The
 * LR of steps [from, to] is multiplied by lr_scale, in the first run of
 * those steps only (before any rollback) unless repeat is true. */
static int parse_fault_injection(dist *d) {
  if (!d->spec.fault_injection) return 0;
  cJSON *o = cJSON_Parse(d->spec.fault_injection);
  int ret = 0;
  for (cJSON *it = o ? o->child : NULL; it; it = it->next) {
    if (cJSON_IsBool(it) && !strcmp(it->string, "repeat")) d->fi_repeat = cJSON_IsTrue(it);
    else if (!cJSON_IsNumber(it)) ret = zt_err("fault_injection.%s: expected a number", it->string);
    else if (!strcmp(it->string, "lr_scale")) d->fi_lr_scale = it->valuedouble;
    else if (!strcmp(it->string, "from_step")) d->fi_from = (int64_t)it->valuedouble;
    else if (!strcmp(it->string, "to_step")) d->fi_to = (int64_t)it->valuedouble;
    else if (!strcmp(it->string, "repeat")) d->fi_repeat = it->valuedouble != 0;
    else ret = zt_err("fault_injection.%s: unknown key", it->string);
  }
  if (d->fi_to < d->fi_from) d->fi_to = d->fi_from;
  cJSON_Delete(o);
  return ret;
}

int zt_gen_train(const zt_gen_ctx *g, int *fatal) {
  dist d;
  memset(&d, 0, sizeof d);
  d.g = g;
  d.comm = g->comm;
  d.N = g->world, d.r = g->rank;
  d.tmo = g->comm_timeout_ms > 0 ? g->comm_timeout_ms : 30000;
  *fatal = 1;
  zt_data_t *train = NULL, *val = NULL;
  int *inp = NULL, *tgt = NULL, ret = -1;
  static _Thread_local ckpt_writer writer; /* large: keep it off the stack */
  memset(&writer, 0, sizeof writer);
  if (zt_spec_parse(&d.spec, g->spec_json, strlen(g->spec_json)) != 0)
    return zt_err_wrap("job spec");
  d.stage = d.spec.zero_stage;
  d.cfg = d.spec.model;
  d.k = zt_kernels_cpu();
  int T = d.cfg.seq_len, mb = d.spec.micro_batch;
  if (parse_fault_injection(&d) != 0 || zt_spec_accum_for_world(&d.spec, d.N, &d.accum) != 0) {
    zt_spec_free(&d.spec);
    return -1;
  }
  int gpu = zt_gpu_parse_device(g->device);
  if (gpu >= 0) d.k = zt_gpu_kernels(gpu, d.spec.bf16);
  if (gpu == -2 || !d.k) { /* this worker's fault, not the job's */
    *fatal = 0;
    zt_spec_free(&d.spec);
    return zt_err_wrap("device");
  }
  /* ZT_TEST_STAGE_COLLECTIVES=1 (tests only) runs the device path's staged
   * collectives on host memory, so CPU tests cover them. */
  const char *st = getenv("ZT_TEST_STAGE_COLLECTIVES");
  d.dev = d.k != zt_kernels_cpu() || (st && !strcmp(st, "1"));
  if (g->threads > 0) zt_kern_cpu_set_threads(g->threads);
  if (zt_model_create(&d.m, &d.cfg, mb, T, d.k, ZT_MODEL_NO_PARAMS | ZT_MODEL_NO_GRADS) != 0) {
    zt_spec_free(&d.spec);
    return zt_err_wrap("model");
  }
  if (zt_data_open_glob(&train, d.spec.train_glob, T, d.cfg.vocab_size, d.spec.seed) != 0)
    goto out;
  if (g->nskips) {
    zt_range_t rs[64];
    int ns = ZT_MIN(g->nskips, 64);
    for (int i = 0; i < ns; i++) rs[i].start = g->skips[i].start, rs[i].end = g->skips[i].end;
    if (zt_data_set_skips(train, rs, ns) != 0) goto out;
  }
  if (d.spec.val_glob[0] && d.spec.eval_every &&
      zt_data_open_glob(&val, d.spec.val_glob, T, d.cfg.vocab_size, d.spec.seed) != 0)
    goto out;
  if (layout(&d) != 0) goto out;
  d.inv_k = (double)mb / (double)d.spec.global_batch;
  zt_model_hooks_t hooks = {&d, h_pre_forward, NULL, h_pre_backward, h_post_backward};
  zt_model_set_hooks(d.m, &hooks);
  write_memory_report(&d);
  inp = malloc(sizeof(int) * (size_t)mb * T);
  tgt = malloc(sizeof(int) * (size_t)mb * T);
  *fatal = 0;

  int64_t step = g->start_step;
  if (g->checkpoint_dir && g->checkpoint_dir[0]) {
    int64_t t0 = zt_now_ms(), loaded = 0;
    if (load_state(&d, g->checkpoint_dir, &loaded) != 0) {
      *fatal = zt_comm_broken(d.comm) ? 0 : 2; /* 2: fall back to an earlier epoch */
      goto out;
    }
    if (step && loaded != step) {
      zt_err("checkpoint %s holds step %lld, expected %lld", g->checkpoint_dir, (long long)loaded,
             (long long)step);
      goto out;
    }
    step = loaded;
    ZT_INFO("loaded checkpoint step %lld into %d ranks, stage %d, in %lld ms: %s", (long long)step,
            d.N, d.stage, (long long)(zt_now_ms() - t0), g->checkpoint_dir);
  } else {
    step = 0;
    if (init_params(&d) != 0) goto out;
  }

  int ckpt_flag = 0;
  while (step < d.spec.steps) {
    int64_t t0 = zt_now_us();
    int64_t s = step + 1; /* 1-based number of the step being computed */
    zero_grads(&d);
    double loss_sum = 0;
    for (int j = 0; j < d.accum; j++) {
      if (g->should_stop(g->user)) {
        ret = 0;
        goto out;
      }
      uint64_t first = (uint64_t)step * (uint64_t)d.spec.global_batch +
                       (uint64_t)j * (uint64_t)d.N * (uint64_t)mb + (uint64_t)d.r * (uint64_t)mb;
      float l = 0;
      if (zt_data_fill(train, first, mb, inp, tgt) != 0) goto out;
      if (zt_model_forward(d.m, inp, tgt, mb, T, &l) != 0 && !d.fail) goto out;
      loss_sum += l;
      if (d.G) d.k->zero(d.G, d.full_total);
      if (zt_model_backward(d.m, 1.0f) != 0 && !d.fail) goto out;
      if (d.G) d.k->acc_f64(d.G64, d.G, d.full_total);
      if (d.fail) {
        zt_err("%s", d.fail_msg);
        goto out;
      }
    }
    if (reduce_grads(&d) != 0) goto out;
    double ctl[4] = {loss_sum, owned_sumsq(&d), 0, (double)ckpt_flag};
    ctl[2] = isfinite(ctl[0]) && isfinite(ctl[1]) ? 0.0 : 1.0;
    if (zt_comm_all_reduce(d.comm, ctl, 4, ZT_DT_F64, ZT_RED_SUM, d.tmo) != 0) goto out;
    double loss = ctl[0] * d.inv_k, norm = sqrt(ctl[1]);
    int nonfinite = ctl[2] > 0 || !isfinite(loss) || !isfinite(norm);
    double lr = step_lr(&d, s);
    if (!nonfinite) {
      float gscale = zt_opt_clip_coef(ctl[1], d.spec.grad_clip, NULL);
      for (int u = 0; u < d.U; u++) adamw_unit(&d, u, (float)lr, gscale, s);
      if (gather_params(&d) != 0) goto out;
    } else {
      ZT_WARN("step %lld: non-finite loss or gradient (loss %g, norm %g): update refused",
              (long long)s, loss, norm);
    }
    step = s;
    double val_loss = NAN;
    if (val && d.spec.eval_every && step % d.spec.eval_every == 0) {
      val_loss = eval_loss(&d, val, inp, tgt);
      if (isnan(val_loss) && zt_comm_broken(d.comm)) goto out;
    }
    double ms = (double)(zt_now_us() - t0) / 1000.0;
    int cmd = ZTRAIN__COMMAND__COMMAND_CONTINUE;
    if (d.r == 0 && g->report_step) {
      zt_step_report rep = {step, loss, norm, lr,
                            (double)d.spec.global_batch * T / (ms / 1000.0), ms, val_loss};
      cmd = g->report_step(g->user, &rep);
    }
    /* Checkpoint: on schedule, or when asked (the flag went around in ctl). */
    int want_ckpt = d.spec.ckpt.dir[0] && !nonfinite &&
                    ((d.spec.ckpt.every_steps && step % d.spec.ckpt.every_steps == 0) || ctl[3] > 0);
    if (want_ckpt && step < d.spec.steps && save_state(&d, &writer, step) != 0) goto out;
    /* A checkpoint-now epoch (drain, scale-up) ends this generation: the
     * coordinator re-forms from exactly this step once it commits, so no
     * step is computed twice. */
    if (ctl[3] > 0 && want_ckpt && step < d.spec.steps) {
      ZT_INFO("step %lld: checkpoint-now epoch written; waiting for the next generation",
              (long long)step);
      ret = 0;
      goto out;
    }
    ckpt_flag = cmd == ZTRAIN__COMMAND__COMMAND_CHECKPOINT_NOW;
    if (cmd == ZTRAIN__COMMAND__COMMAND_STOP || cmd == ZTRAIN__COMMAND__COMMAND_ROLLBACK) {
      ret = 0;
      goto out;
    }
  }
  ret = 0;
out:
  /* A write in flight finishes (its epoch may still commit); then stop. */
  writer_stop(&writer);
  if (ret != 0 && *fatal != 2 && zt_comm_broken(d.comm)) *fatal = 0;
  free(inp);
  free(tgt);
  zt_data_close(train);
  zt_data_close(val);
  free_dist(&d);
  zt_spec_free(&d.spec);
  return ret;
}
