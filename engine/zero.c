/*
 * zero.c: a rank's model states under ZeRO stages 0-3 (see zero.h and
 * docs/zero.md): their layout in the kernel table's memory, the hooks that
 * gather parameters and reduce gradients unit by unit, the optimizer step
 * on the owned shard, and loading and snapshotting them for checkpoints.
 */
#include "zero.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "quant.h"
#include "zt_common.h"

/* The largest host all-reduce: the step's control values and, at a load
 * balance plan, two per rank (trainer.c). */
#define ZT_ZERO_CTL_BYTES 8192

static int ov_wait(zt_zero_t *z);

/* Milliseconds of wall clock, and of this thread's CPU time. */
static double wall_ms(void) { return (double)zt_now_us() / 1000.0; }
static double thread_cpu_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* ---- allocation and accounting ------------------------------------------------- */

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

/* p advanced by n elements of the storage type. */
static float *xadv(const zt_zero_t *z, const float *p, size_t n) {
  return (float *)((char *)p + n * z->xb);
}
static double *alloc_d(zt_zero_t *z, size_t n, int kind) { return alloc_b(z, n, sizeof(double), kind); }

/* ---- collectives on table memory ---------------------------------------------------
 *
 * With one rank a collective is a local copy. Otherwise host memory goes
 * straight to the communicator, and so does device memory when the
 * communicator takes it (NCCL, z->dcomm). Otherwise device memory is
 * staged: the region the call reads (send, or recv when send lies inside
 * it, as in the in-place calls of stages 1-2) is downloaded, the
 * collective runs on host memory, and what it wrote is uploaded. */

static char *stage(zt_zero_t *z, size_t bytes) {
  if (bytes > z->stage_cap) {
    free(z->stage_buf);
    z->stage_buf = zt_xmalloc(bytes);
    z->stage_cap = bytes;
  }
  return z->stage_buf;
}

/* Covers both in-place forms: recv inside send (reduce-scatter) and send
 * inside recv (all-gather). `big` is the world*count side. */
static int c_staged(zt_zero_t *z, char *big, char *small, size_t count, zt_dtype_t dt, int gather) {
  size_t es = zt_dtype_size(dt), bb = count * es * (size_t)z->N, sb = count * es;
  int inside = small >= big && small < big + bb;
  char *h = stage(z, bb + (inside ? 0 : sb));
  char *hs = inside ? h + (small - big) : h + bb;
  if (gather) {
    z->k->download(hs, small, sb);
    if (zt_comm_all_gather(z->comm, hs, h, count, dt, z->tmo) != 0) return -1;
    z->k->upload(big, h, bb);
  } else {
    z->k->download(h, big, bb);
    if (zt_comm_reduce_scatter(z->comm, h, hs, count, dt, ZT_RED_SUM, z->tmo) != 0) return -1;
    z->k->upload(small, hs, sb);
  }
  return 0;
}

/* Before a collective reads or writes table memory itself (NCCL, on its
 * own stream): the kernels queued on it are complete (zt_kernels.h,
 * sync). The staged path's download and upload wait by themselves. */
static void dev_settle(zt_zero_t *z) {
  if (z->dcomm && !z->sv && z->k->sync) z->k->sync(); /* stream order needs no host wait */
}

static int c_reduce_scatter(zt_zero_t *z, void *send, void *recv, size_t count, zt_dtype_t dt) {
  if (z->N == 1) {
    if (send != recv) z->k->copy(recv, send, count * zt_dtype_size(dt));
    return 0;
  }
  dev_settle(z);
  if (!z->dev || z->dcomm)
    return zt_comm_reduce_scatter(z->comm, send, recv, count, dt, ZT_RED_SUM, z->tmo);
  return c_staged(z, send, recv, count, dt, 0);
}

static int c_all_gather(zt_zero_t *z, const void *send, void *recv, size_t count, zt_dtype_t dt) {
  if (z->N == 1) {
    if (send != recv) z->k->copy(recv, send, count * zt_dtype_size(dt));
    return 0;
  }
  dev_settle(z);
  if (!z->dev || z->dcomm) return zt_comm_all_gather(z->comm, send, recv, count, dt, z->tmo);
  return c_staged(z, recv, (char *)send, count, dt, 1);
}

int zt_zero_host_all_reduce(zt_zero_t *z, void *buf, size_t count, zt_dtype_t dt) {
  size_t bytes = count * zt_dtype_size(dt);
  if (z->overlap && ov_wait(z) != 0) return -1; /* the communicator is the thread's until then */
  if (!z->dcomm) return zt_comm_all_reduce(z->comm, buf, count, dt, ZT_RED_SUM, z->tmo);
  if (bytes > ZT_ZERO_CTL_BYTES) return zt_err("host all-reduce of %zu bytes: too large", bytes);
  z->k->upload(z->ctl_dev, buf, bytes);
  if (zt_comm_all_reduce(z->comm, z->ctl_dev, count, dt, ZT_RED_SUM, z->tmo) != 0) return -1;
  z->k->download(buf, z->ctl_dev, bytes);
  return 0;
}

int zt_zero_gather_frozen(zt_zero_t *z, const float *shard, float *full, size_t count) {
  if (z->overlap && ov_wait(z) != 0) return -1; /* the communicator is the thread's until then */
  return c_all_gather(z, shard, full, count, z->xdt);
}

static int layout(zt_zero_t *z) {
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
  enum { PARAMS, GRADS, OPT, FLIGHT };
  /* The fp32 master (zero.h): whole where the stage keeps the parameters
   * whole and they are the working copy too, else the owned shard. */
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

/* The owned range of unit u, clipped to its real size: [lo, lo + n). */
static void owned(const zt_zero_t *z, int u, size_t *lo, size_t *n) {
  size_t a = (size_t)z->r * z->S[u], b = a + z->S[u];
  if (b > z->usz[u]) b = z->usz[u];
  *lo = a < b ? a : b;
  *n = b > a ? b - a : 0;
}

/* ---- ZeRO hooks --------------------------------------------------------------------- */

static void hook_fail(zt_zero_t *z, const char *what) {
  if (!z->fail) {
    z->fail = 1;
    snprintf(z->fail_msg, sizeof z->fail_msg, "%s: %s", what, zt_err_msg());
  }
}

/* Stage 3: gather unit u's parameters into a full buffer. */
static void gather_unit(zt_zero_t *z, int u) {
  float *buf = u == 0 ? z->gat0 : z->gat;
  if (z->fail) return;
  if (c_all_gather(z, xadv(z, z->Ws, z->off_shard[u]), buf, z->S[u], z->xdt) != 0)
    hook_fail(z, "all-gather of parameters");
  z->m->unit_params[u] = buf;
}

static void fetch_unit(zt_zero_t *z, int u, int next);
static void sv_fetch(zt_zero_t *z, int u, int next);
static void sv_join_gather(zt_zero_t *z, int u);

static void ag_wait(zt_zero_t *z, int u);
static void apply_due(zt_zero_t *z, int u);

static int h_pre_forward(void *ctx, int u) {
  zt_zero_t *z = ctx;
  double w0 = wall_ms();
  if (z->stage == 3 && z->sv) sv_fetch(z, u, u + 1 < z->U ? u + 1 : u - 1);
  else if (z->stage == 3 && z->overlap) fetch_unit(z, u, u + 1 < z->U ? u + 1 : u - 1);
  else if (z->stage == 3) gather_unit(z, u);
  else if (z->overlap && z->ag_ticket) ag_wait(z, u);
  else if (z->sv) sv_join_gather(z, u);
  z->tm.wait_gather_ms += wall_ms() - w0;
  if (z->stage == 0 && z->due_n && z->due[u] && !z->fail) apply_due(z, u);
  return z->fail ? -1 : 0;
}

static int grad_slot(zt_zero_t *z, int u, float **g);
static int reduced(zt_zero_t *z, const int *busy);

static int h_pre_backward(void *ctx, int u) {
  zt_zero_t *z = ctx;
  double w0 = wall_ms();
  /* Backward runs units 0 (the head; unit 0 is still gathered), U-1, ...,
   * 1; the next one to fetch is u - 1, and U - 1 after 0. */
  if (z->stage == 3 && z->sv) sv_fetch(z, u, u != 0 ? u - 1 : z->U - 1);
  else if (z->stage == 3 && z->overlap && u != 0) fetch_unit(z, u, u - 1);
  else if (z->stage == 3 && z->overlap) fetch_unit(z, 0, z->U - 1);
  else if (z->stage == 3 && u != 0) gather_unit(z, u);
  z->tm.wait_gather_ms += wall_ms() - w0;
  if (z->stage < 2 && z->each && z->overlap && z->micro_n > 1) {
    /* G's unit u as the micro-step before left it may still be on the
     * thread (zt_zero_micro_begin did not zero it). */
    if (reduced(z, &z->rd_busy[u]) != 0) return -1;
    z->k->zero(z->G + z->off_full[u], z->S[u] * (size_t)z->N);
  }
  if (z->stage >= 2) {
    float *g = u == 0 ? z->tg0 : z->tg;
    if (z->overlap && grad_slot(z, u, &g) != 0) return -1;
    z->k->zero(g, z->S[u] * (size_t)z->N);
    z->m->unit_grads[u] = g;
  }
  return z->fail ? -1 : 0;
}

/* ---- overlap: the communication thread (zero.h) ---------------------------------- */

/* Stages 2-3 with overlap: the fp32 gradient buffer that reduction slot
 * s reads (zero.h: slots 0 and 1 take turns for units 1..U-1, slot 2 is
 * unit 0's, whose pieces it counts). */
static float *slot_tg(zt_zero_t *z, int s) { return s == 2 ? z->tg0 : s ? z->tgb : z->tg; }

static float *gat_slot(zt_zero_t *z, int s) { return s == 2 ? z->gat0 : s ? z->gatb : z->gat; }

/* Stages 2-3 reduce a unit's gradient in pieces of at most slot_unit / N
 * elements of each rank's shard: one piece for every unit but unit 0
 * (the embeddings, often the largest by far: GPT-2's is five times a
 * layer), so the in-flight buffers are sized by the largest other unit.
 * The piece at shard offset lo: n elements of each of the N shards. */
static size_t piece_len(const zt_zero_t *z, int u, size_t lo) {
  return ZT_MIN(z->slot_unit / (size_t)z->N, z->S[u] - lo);
}

/* The NCCL path (it has no fp32-to-fp64 reduction): widens piece lo of unit u's fp32 gradient g into dst, shard after shard
 * (contiguous when the piece is the whole unit). */
static void widen_piece(zt_zero_t *z, double *dst, const float *g, int u, size_t lo) {
  size_t n = piece_len(z, u, lo);
  if (n == z->S[u]) {
    z->k->widen_f64(dst, g, n * (size_t)z->N);
    return;
  }
  for (int r = 0; r < z->N; r++) z->k->widen_f64(dst + (size_t)r * n, g + (size_t)r * z->S[u] + lo, n);
}

/* fp32 segments of n elements, `stride` apart, one per rank,
 * reduce-scattered into this rank's fp64 sums in out
 * (zt_comm_reduce_scatter_f32to64): straight from host memory; from a
 * device without NCCL the segments are downloaded (half the bytes of
 * widened ones), summed on the host and the sums uploaded. Over NCCL the
 * callers widen first (it has no fp32-to-fp64 reduction). */
static int rs_f32_compressed(zt_zero_t *z, const float *src, size_t stride, double *out,
                             size_t n);

static int rs_f32(zt_zero_t *z, const float *src, size_t stride, double *out, size_t n) {
  if (z->N == 1) {
    z->k->widen_f64(out, src, n);
    return 0;
  }
  if (z->q) return rs_f32_compressed(z, src, stride, out, n);
  if (!z->dev) return zt_comm_reduce_scatter_f32to64(z->comm, src, stride, out, n, z->tmo);
  size_t seg = n * sizeof(float), at = ((size_t)z->N * seg + 7) & ~(size_t)7;
  char *h = stage(z, at + n * sizeof(double));
  for (int r = 0; r < z->N; r++) z->k->download(h + (size_t)r * seg, src + (size_t)r * stride, seg);
  if (zt_comm_reduce_scatter_f32to64(z->comm, (const float *)h, n, (double *)(h + at), n, z->tmo) != 0)
    return -1;
  z->k->upload(out, h + at, n * sizeof(double));
  return 0;
}

/* The compressed exchange (sync.compression, zero.h): with every other
 * rank's segment of n values encoded in qsend, the all-to-all, then the
 * decoded pieces from the other ranks added to this rank's own sums in
 * mine, in ring order from the next rank on, in fp64. */
static int exchange_encoded(zt_zero_t *z, size_t n, double *mine) {
  size_t N = (size_t)z->N, qb = zt_quant_bytes((zt_quant_t)z->q, n);
  if (zt_comm_all_to_all(z->comm, z->qsend, z->qrecv, qb, z->tmo) != 0) return -1;
  for (size_t k = 1; k < N; k++) {
    size_t j = ((size_t)z->r + k) % N;
    char who[32];
    snprintf(who, sizeof who, "rank %zu", j);
    memset(z->qtmp, 0, n * sizeof(float));
    if (zt_quant_decode_add((zt_quant_t)z->q, z->qrecv + j * qb, qb, n, z->qtmp, who) != 0)
      return zt_err_wrap("the compressed values");
    for (size_t i = 0; i < n; i++) mine[i] += (double)z->qtmp[i];
  }
  return 0;
}

/* rs_f32 with sync.compression: segment j of src (n values, stride
 * apart) encoded for rank j, this rank's own added exactly. */
static int rs_f32_compressed(zt_zero_t *z, const float *src, size_t stride, double *out,
                             size_t n) {
  size_t N = (size_t)z->N, qb = zt_quant_bytes((zt_quant_t)z->q, n);
  size_t at = (N * n * sizeof(float) + 7) & ~(size_t)7;
  const float *h = src;
  double *mine = out;
  if (z->dev) { /* the segments and the sums through host memory */
    char *st = stage(z, at + n * sizeof(double));
    for (size_t j = 0; j < N; j++)
      z->k->download(st + j * n * sizeof(float), src + j * stride, n * sizeof(float));
    h = (const float *)st, stride = n, mine = (double *)(st + at);
  }
  for (size_t j = 0; j < N; j++)
    if ((int)j != z->r) zt_quant_encode((zt_quant_t)z->q, h + j * stride, n, z->qsend + j * qb);
  for (size_t i = 0; i < n; i++) mine[i] = (double)h[(size_t)z->r * stride + i];
  if (exchange_encoded(z, n, mine) != 0) return zt_err_wrap("the gradient");
  if (z->dev) z->k->upload(out, mine, n * sizeof(double));
  return 0;
}

/* Stages 2-3 on host memory: piece lo of unit u's fp32 gradient g (n
 * elements of each rank's shard, S[u] apart) into fp64 sums in rs64. */
static int rs_piece(zt_zero_t *z, const float *g, int u, size_t lo) {
  return rs_f32(z, g + lo, z->S[u], z->rs64, piece_len(z, u, lo));
}

/* acc += x, n fp64 values of table memory: on the communication thread
 * (host memory) a plain loop, since the kernel table is the training
 * thread's. */
static void add_sums(zt_zero_t *z, double *acc, const double *x, size_t n) {
  if (!z->overlap) {
    z->k->add_f64(acc, x, n);
    return;
  }
  for (size_t i = 0; i < n; i++) acc[i] += x[i];
}

/* Unit u's fp64 sums reduced with sync.compression (zero.h): every other
 * rank's segment for this rank arrives encoded, straight from it, and is
 * added to this rank's own exact sums in rank order, in fp64. The sums
 * are the same on every run of the same world size; they differ from the
 * exact ones by the encoding's rounding of the other ranks' values. */
static int reduce_compressed(zt_zero_t *z, int u) {
  size_t S = z->S[u], N = (size_t)z->N, qb = zt_quant_bytes((zt_quant_t)z->q, S);
  double *g = z->G64 + z->off_full[u];
  double *h = z->dev ? (double *)stage(z, N * S * sizeof(double)) : g;
  if (z->dev) z->k->download(h, g, N * S * sizeof(double));
  for (size_t j = 0; j < N; j++) {
    if ((int)j == z->r) continue;
    for (size_t i = 0; i < S; i++) z->qtmp[i] = (float)h[j * S + i];
    zt_quant_encode((zt_quant_t)z->q, z->qtmp, S, z->qsend + j * qb);
  }
  double *mine = h + (size_t)z->r * S;
  if (exchange_encoded(z, S, mine) != 0) return zt_err_wrap("the gradient of unit %d", u);
  if (z->dev) z->k->upload(g + (size_t)z->r * S, mine, S * sizeof(double));
  return 0;
}

/* Stage 0's gather of unit u's scaled gradient with sync.compression:
 * each rank's owned segment encoded and all-gathered, and every segment
 * decoded on every rank, the owner's own too, so that every replica
 * applies the same gradient. */
static int gather_compressed(zt_zero_t *z, int u) {
  size_t S = z->S[u], N = (size_t)z->N, qb = zt_quant_bytes((zt_quant_t)z->q, S);
  float *g = z->G + z->off_full[u];
  float *h = z->dev ? (float *)stage(z, N * S * sizeof(float)) : g;
  if (z->dev) z->k->download(h + (size_t)z->r * S, g + (size_t)z->r * S, S * sizeof(float));
  zt_quant_encode((zt_quant_t)z->q, h + (size_t)z->r * S, S, z->qsend);
  if (zt_comm_all_gather(z->comm, z->qsend, z->qrecv, qb / 2, ZT_DT_BF16, z->tmo) != 0) return -1;
  for (size_t j = 0; j < N; j++) {
    char who[32];
    snprintf(who, sizeof who, "rank %zu", j);
    memset(h + j * S, 0, S * sizeof(float));
    if (zt_quant_decode_add((zt_quant_t)z->q, z->qrecv + j * qb, qb, S, h + j * S, who) != 0)
      return zt_err_wrap("the compressed gradient of unit %d", u);
  }
  if (z->dev) z->k->upload(g, h, N * S * sizeof(float));
  return 0;
}

/* One reduction, queued or not. Stages 0-1: unit u's padded range of the
 * fp64 sum, reduce-scattered in place; or, where each micro-step is
 * reduced by itself (z->each), its fp32 gradient in G into this rank's
 * range of the sum: written there in the first micro-step (s = 0), else
 * (s = 1) into the range after it, which this path leaves unused, and
 * added (not over NCCL). Stages 2-3: piece lo of the fp32 gradient in
 * slot s, reduce-scattered, then its shard added into the sum. A piece's
 * elements are summed over the ranks in the ring's order whatever its
 * size, so the pieces change no bit. */
static int reduce_unit(zt_zero_t *z, int u, int s, size_t lo) {
  if (z->stage >= 2) {
    if (rs_piece(z, slot_tg(z, s), u, lo) != 0) return -1;
    add_sums(z, z->G64 + z->off_shard[u] + lo, z->rs64, piece_len(z, u, lo));
    return 0;
  }
  double *g = z->G64 + z->off_full[u], *mine = g + (size_t)z->r * z->S[u];
  if (z->q) return reduce_compressed(z, u);
  if (!z->each) return c_reduce_scatter(z, g, mine, z->S[u], ZT_DT_F64);
  double *out = s ? g + (size_t)((z->r + 1) % z->N) * z->S[u] : mine;
  if (rs_f32(z, z->G + z->off_full[u], z->S[u], out, z->S[u]) != 0) return -1;
  if (s) add_sums(z, mine, out, z->S[u]);
  return 0;
}

/* A queue entry: unit, what to do (gather its parameters or reduce its
 * gradient) and the slot (gat_slot, OV_IN_PLACE for the deferred gathers
 * of stages 1-2, or the fp64 gradient slot). */
enum { OV_REDUCE = 0, OV_GATHER = 1 };
#define OV_IN_PLACE 3
#define OV_ENTRY(u, kind, s, lo) ((int64_t)(lo) << 32 | (u) << 3 | (kind) << 2 | (s))

/* Unit u from every rank's owned range: stages 1-2 the working copy of
 * the parameters, stage 0 the scaled fp32 gradient in G (zt_zero_adamw). */
static int gather_compressed(zt_zero_t *z, int u);

/* The buffers of unit u's in-place gather: this rank's range (mine) of
 * the whole unit, and their type. */
static zt_dtype_t in_place_unit(zt_zero_t *z, int u, void **mine, void **whole) {
  size_t at = (size_t)z->r * z->S[u];
  if (z->stage == 0) {
    float *g = z->G + z->off_full[u];
    *mine = g + at, *whole = g;
    return ZT_DT_F32;
  }
  float *p = xadv(z, z->W, z->off_full[u]);
  *mine = xadv(z, p, at), *whole = p;
  return z->xdt;
}

static int gather_in_place(zt_zero_t *z, int u) {
  if (z->stage == 0 && z->q) return gather_compressed(z, u);
  void *mine, *whole;
  zt_dtype_t dt = in_place_unit(z, u, &mine, &whole);
  return c_all_gather(z, mine, whole, z->S[u], dt);
}

/* Takes queued entries in order; after a failure the rest are only
 * dequeued (the step fails in zt_zero_reduce or the next fetch). */
static void *ov_main(void *arg) {
  zt_zero_t *z = arg;
  pthread_mutex_lock(&z->ov_mu);
  for (;;) {
    while (!z->ov_quit && !z->ov_len) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
    if (z->ov_quit) break;
    int64_t e = z->ov_queue[z->ov_head];
    int failed = z->ov_fail, u = (int)(e & 0xffffffff) >> 3, kind = (int)(e >> 2) & 1, s = (int)(e & 3);
    size_t lo = (size_t)(e >> 32);
    pthread_mutex_unlock(&z->ov_mu);
    int rc = 0;
    double w0 = wall_ms(), c0 = thread_cpu_ms();
    if (!failed && kind == OV_GATHER && s == OV_IN_PLACE)
      rc = gather_in_place(z, u);
    else if (!failed && kind == OV_GATHER)
      rc = c_all_gather(z, xadv(z, z->Ws, z->off_shard[u]), gat_slot(z, s), z->S[u], z->xdt);
    else if (!failed)
      rc = reduce_unit(z, u, s, lo);
    double w1 = wall_ms(), c1 = thread_cpu_ms();
    pthread_mutex_lock(&z->ov_mu);
    z->tm.comm_busy_ms += w1 - w0;
    z->tm.comm_cpu_ms += c1 - c0;
    if (rc != 0 && !z->ov_fail) {
      z->ov_fail = 1;
      snprintf(z->ov_msg, sizeof z->ov_msg, "%s of unit %d: %s",
               kind == OV_REDUCE  ? "gradient reduction"
               : z->stage == 0    ? "all-gather of the scaled gradient"
                                  : "all-gather of parameters",
               u, zt_err_msg());
    }
    if (kind == OV_GATHER && s == OV_IN_PLACE) z->ag_done++;
    else if (kind == OV_GATHER) z->pf_busy[s] = 0;
    else if (z->stage >= 2 && s == 2) z->ov_busy[2]--;
    else if (z->stage >= 2) z->ov_busy[s] = 0;
    else z->rd_busy[u] = 0;
    z->ov_head = (z->ov_head + 1) % z->ov_cap;
    z->ov_len--;
    pthread_cond_broadcast(&z->ov_cv);
  }
  pthread_mutex_unlock(&z->ov_mu);
  return NULL;
}

/* Queues an entry; lo: the piece (shard offset) of a stage 2-3 reduction.
 * A full queue is waited on until the thread has taken an entry (it
 * broadcasts after each one), so no entry is ever written over one the
 * thread has not read; ov_start sizes the queue so that this wait is
 * rare. Once a queued operation has failed, the wait stops and the entry
 * is dropped: the thread would only dequeue it, and every wait for it
 * (reduced, pf_wait, ag_wait, ov_wait) stops at that failure too and
 * reports it. */
static void ov_push_piece(zt_zero_t *z, int u, int kind, int s, size_t lo) {
  pthread_mutex_lock(&z->ov_mu);
  while (z->ov_len == z->ov_cap && !z->ov_fail) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
  if (!z->ov_fail) {
    z->ov_queue[(z->ov_head + z->ov_len) % z->ov_cap] = OV_ENTRY(u, kind, s, lo);
    z->ov_len++;
    if (kind == OV_GATHER && s != OV_IN_PLACE) z->pf_busy[s] = 1;
    else if (kind == OV_REDUCE && z->stage >= 2 && s == 2) z->ov_busy[2]++;
    else if (kind == OV_REDUCE && z->stage >= 2) z->ov_busy[s] = 1;
    else if (kind == OV_REDUCE) z->rd_busy[u] = 1;
    pthread_cond_broadcast(&z->ov_cv);
  }
  pthread_mutex_unlock(&z->ov_mu);
}

static void ov_push(zt_zero_t *z, int u, int kind, int s) { ov_push_piece(z, u, kind, s, 0); }

/* With ov_mu held: when a queued operation has failed, its reason becomes
 * the hooks' failure (the step stops, as it would without overlap) and -1
 * is returned; else 0. */
static int ov_take_failure(zt_zero_t *z) {
  if (!z->ov_fail) return 0;
  if (!z->fail) snprintf(z->fail_msg, sizeof z->fail_msg, "%s", z->ov_msg);
  z->fail = 1;
  return -1;
}

/* Waits, as time waited for reductions, until the reductions that *busy
 * counts (under ov_mu) are done; -1 when a queued one failed (the step
 * stops here, as it would without overlap). */
static int reduced(zt_zero_t *z, const int *busy) {
  double w0 = wall_ms();
  pthread_mutex_lock(&z->ov_mu);
  while (*busy && !z->ov_fail) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
  int rc = ov_take_failure(z);
  pthread_mutex_unlock(&z->ov_mu);
  z->tm.wait_reduce_ms += wall_ms() - w0;
  return rc;
}

/* Stages 2-3, before unit u's backward: the gradient buffer it writes
 * into, once the reductions that still read it are done: unit 0's own
 * (its pieces from the micro-step before), else the next of slots 0 and 1,
 * whose number post-backward queues. -1 when a queued reduction failed
 * (the step stops here, as without overlap). */
static int grad_slot(zt_zero_t *z, int u, float **g) {
  int s = u == 0 ? 2 : z->ov_next;
  if (u != 0) z->ov_next ^= 1, z->ov_cur = s;
  *g = slot_tg(z, s);
  return reduced(z, &z->ov_busy[s]);
}

/* ---- stage 3 prefetch ------------------------------------------------------------ */

/* Waits until gather slot s (gat_slot) is filled; -1 when a queued
 * operation failed (the hook fails the step, as a gather would). */
static int pf_wait(zt_zero_t *z, int s) {
  pthread_mutex_lock(&z->ov_mu);
  while (z->pf_busy[s] && !z->ov_fail) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
  int rc = ov_take_failure(z);
  pthread_mutex_unlock(&z->ov_mu);
  return rc;
}

/* Stages 1-2: waits until unit u's deferred gather is done (it was
 * queued by zt_zero_gather); a failure fails the hook. */
static void ag_wait(zt_zero_t *z, int u) {
  if (z->fail) return;
  pthread_mutex_lock(&z->ov_mu);
  while (z->ag_done < z->ag_ticket[u] && !z->ov_fail) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
  (void)ov_take_failure(z); /* sets z->fail, which the hook returns */
  pthread_mutex_unlock(&z->ov_mu);
}

/* The gather slot (0 or 1) that holds, or is receiving, unit u's current
 * parameters (pver: they change only in the optimizer step and loads);
 * -1 if none. */
static int pf_find(const zt_zero_t *z, int u) {
  for (int s = 0; s < 2; s++)
    if (z->pf_unit[s] == u && z->pf_ver[s] == z->pver) return s;
  return -1;
}

/* Queues the gather of unit u into slot s (waiting first for a gather
 * still arriving there). */
static void pf_queue(zt_zero_t *z, int u, int s) {
  if (pf_wait(z, s) != 0) return;
  z->pf_unit[s] = u;
  z->pf_ver[s] = z->pver;
  ov_push(z, u, OV_GATHER, s);
}

/* Stage 3 with overlap, the hooks before a unit's forward or backward:
 * unit u's parameters from the slot that has them (or is receiving
 * them), else gathered now (queued behind what is in flight, so the
 * communicator keeps one order on every rank); then `next`, the unit the
 * model uses after u, is queued into the other slot so that the network
 * carries it while u computes. Unit 0 (the embeddings, used at both ends
 * of forward and first in backward) has a slot of its own. Every rank
 * runs the same hooks in the same order, so the queues match. */
static void fetch_unit(zt_zero_t *z, int u, int next) {
  if (z->fail) return;
  int s;
  if (u == 0) {
    s = 2;
    if (z->pf_unit[2] != 0 || z->pf_ver[2] != z->pver) {
      z->pf_unit[2] = 0;
      z->pf_ver[2] = z->pver;
      ov_push(z, 0, OV_GATHER, 2);
    }
  } else if ((s = pf_find(z, u)) < 0) {
    s = z->pf_cur ^ 1; /* the slot of the unit before is free */
    pf_queue(z, u, s);
  }
  if (u != 0) z->pf_cur = s;
  if (next > 0 && next < z->U && pf_find(z, next) < 0) pf_queue(z, next, z->pf_cur ^ 1);
  if (pf_wait(z, s) != 0) return;
  z->m->unit_params[u] = gat_slot(z, s);
}

/* Waits until every queued operation is done; -1 when one failed. */
static int ov_wait(zt_zero_t *z) {
  pthread_mutex_lock(&z->ov_mu);
  while (z->ov_len) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
  int failed = z->ov_fail;
  pthread_mutex_unlock(&z->ov_mu);
  return failed ? zt_err("%s", z->ov_msg) : 0;
}

/* How many pieces unit u's gradient is reduced in at stages 2-3
 * (piece_len): one, but for unit 0 as many as its shard holds shards of
 * the largest other unit. */
static int num_pieces(const zt_zero_t *z, int u) {
  int n = 0;
  for (size_t lo = 0; lo < z->S[u]; lo += piece_len(z, u, lo)) n++;
  return n;
}

static int ov_start(zt_zero_t *z) {
  /* The most entries ever queued at once, so that pushes (which wait for
   * room) do not wait in practice: stages 0-1, U units a step; stages
   * 1-2, U deferred gathers after it; stages 2-3, two reductions, three
   * gathers and all the pieces of unit 0, which its post-backward hook
   * queues at once (one per block's worth of embeddings: dozens with a
   * large vocabulary). */
  z->ov_cap = 2 * z->U + 5 + (z->stage >= 2 ? num_pieces(z, 0) : 0);
  z->ov_queue = zt_xcalloc((size_t)z->ov_cap, sizeof *z->ov_queue);
  pthread_mutex_init(&z->ov_mu, NULL);
  pthread_cond_init(&z->ov_cv, NULL);
  if (pthread_create(&z->ov_thread, NULL, ov_main, z) != 0) {
    pthread_cond_destroy(&z->ov_cv);
    pthread_mutex_destroy(&z->ov_mu);
    free(z->ov_queue);
    z->ov_queue = NULL;
    return zt_err("cannot start the gradient communication thread");
  }
  pthread_setname_np(z->ov_thread, "zt-comm");
  z->overlap = 1;
  if (z->stage < 3) z->ag_ticket = zt_xcalloc((size_t)z->U, sizeof *z->ag_ticket);
  if (z->stage < 2) z->rd_busy = zt_xcalloc((size_t)z->U, sizeof *z->rd_busy);
  if (z->stage == 0) z->due = zt_xcalloc((size_t)z->U, sizeof *z->due);
  return 0;
}

/* A reduction still running when the state is freed (the generation
 * failed elsewhere) is aborted with the communicator, which is over. */
static void ov_stop(zt_zero_t *z) {
  if (!z->overlap) return;
  pthread_mutex_lock(&z->ov_mu);
  if (z->ov_len) zt_comm_abort(z->comm);
  z->ov_quit = 1;
  pthread_cond_broadcast(&z->ov_cv);
  pthread_mutex_unlock(&z->ov_mu);
  pthread_join(z->ov_thread, NULL);
  pthread_cond_destroy(&z->ov_cv);
  pthread_mutex_destroy(&z->ov_mu);
  free(z->ov_queue);
  free(z->ag_ticket);
  free(z->rd_busy);
  free(z->due);
}

/* ---- stream overlap (over NCCL; zero.h) ---------------------------------------- */

/* The table's waiter: while it waits for its stream, which may wait for
 * our collectives, the communicator looks at them (and ends itself when
 * one failed or timed out, which releases the stream). */
static void sv_waiter(void *ctx) {
  zt_zero_t *z = ctx;
  if (zt_comm_progress(z->comm) != 0 && !z->fail) /* the step fails with it */
    hook_fail(z, "collective in flight");
}

/* Stages 0-1, last micro-step: unit u's gradient into the fp64 sum and
 * its in-place reduce-scatter enqueued (zt_zero_reduce joins it). */
static int sv_reduce_unit(zt_zero_t *z, int u) {
  size_t off = z->off_full[u], n = z->S[u] * (size_t)z->N;
  uint64_t tk;
  z->k->acc_f64(z->G64 + off, z->G + off, n);
  double *g = z->G64 + off;
  return zt_comm_reduce_scatter_async(z->comm, g, g + (size_t)z->r * z->S[u], z->S[u],
                                      ZT_DT_F64, ZT_RED_SUM, z->tmo, &tk);
}

/* The table's stream waits for the collective of ticket *tk, which is
 * then spent (0: none to wait for; zt_comm_join would take 0 for all). */
static int sv_join(zt_zero_t *z, uint64_t *tk) {
  uint64_t t = *tk;
  *tk = 0;
  return t ? zt_comm_join(z->comm, t) : 0;
}

/* Stages 2-3: slot s's reduce-scatter joined and its shard added into the
 * sum (nothing when the slot is free). */
static int sv_land(zt_zero_t *z, int s) {
  if (!z->sv_tk[s]) return 0;
  if (sv_join(z, &z->sv_tk[s]) != 0) return -1;
  z->k->add_f64(z->G64 + z->sv_dst[s], s ? z->rs64b : z->rs64, z->sv_n[s]);
  return 0;
}

/* Both slots, the older one first. */
static int sv_land_all(zt_zero_t *z) {
  if (sv_land(z, z->sv_next) != 0) return -1;
  return sv_land(z, z->sv_next ^ 1);
}

/* Stages 2-3: piece lo of unit u's fp32 gradient g widened into the next
 * slot (once its last reduction is added) and its reduce-scatter
 * enqueued. */
static int sv_reduce_piece(zt_zero_t *z, const float *g, int u, size_t lo) {
  int s = z->sv_next;
  if (sv_land(z, s) != 0) return -1;
  z->sv_next ^= 1;
  double *w = s ? z->tg64b : z->tg64, *out = s ? z->rs64b : z->rs64;
  size_t n = piece_len(z, u, lo);
  widen_piece(z, w, g, u, lo);
  if (zt_comm_reduce_scatter_async(z->comm, w, out, n, ZT_DT_F64, ZT_RED_SUM, z->tmo,
                                   &z->sv_tk[s]) != 0)
    return -1;
  z->sv_dst[s] = z->off_shard[u] + lo;
  z->sv_n[s] = n;
  return 0;
}

/* Stages 0-2: unit u's in-place gather (as gather_in_place) enqueued. */
static int sv_gather_in_place(zt_zero_t *z, int u, uint64_t *tk) {
  void *mine, *whole;
  zt_dtype_t dt = in_place_unit(z, u, &mine, &whole);
  return zt_comm_all_gather_async(z->comm, mine, whole, z->S[u], dt, z->tmo, tk);
}

/* Stages 1-2, the hook before unit u's forward: its deferred gather. */
static void sv_join_gather(zt_zero_t *z, int u) {
  if (sv_join(z, &z->sv_ag[u]) != 0) hook_fail(z, "all-gather of parameters");
}

/* Stage 3: the gather slot of unit u: unit 0 its own, the others slots 0
 * and 1 by turns (u - 1 even or odd), so the units the model uses one
 * after the other (forward 1, 2, ...; backward U-1, U-2, ...) take
 * different slots and each unit always the same one (the model may
 * record the step into CUDA graphs: zt_model_hooks_t.fixed_units). */
static int sv_home(int u) { return u == 0 ? 2 : (u - 1) & 1; }

/* Stage 3: unit u's current parameters are (or are being) gathered into
 * its slot; else that gather is enqueued now. */
static int sv_gather(zt_zero_t *z, int u) {
  int s = sv_home(u);
  if (z->pf_unit[s] == u && z->pf_ver[s] == z->pver) return 0;
  z->pf_unit[s] = u, z->pf_ver[s] = z->pver;
  if (zt_comm_all_gather_async(z->comm, xadv(z, z->Ws, z->off_shard[u]), gat_slot(z, s),
                               z->S[u], z->xdt, z->tmo, &z->sv_gtk[s]) == 0)
    return 0;
  z->pf_unit[s] = -1;
  return -1;
}

/* Stage 3, the hooks before a unit's forward or backward: unit u's
 * gather (enqueued now if it was not prefetched), joined; then the
 * prefetch of `next` into its slot. That slot was last read by kernels
 * enqueued before now (two units back), which the gather waits for. */
static void sv_fetch(zt_zero_t *z, int u, int next) {
  if (z->fail) return;
  int s = sv_home(u);
  if (sv_gather(z, u) != 0 || sv_join(z, &z->sv_gtk[s]) != 0) goto err;
  z->m->unit_params[u] = gat_slot(z, s);
  if (next >= 0 && next != u && sv_gather(z, next) != 0) goto err;
  return;
err:
  hook_fail(z, "all-gather of parameters");
}

/* Joins every collective enqueued and waits on the host until they are
 * done: the sums added, the gathers in place (a failure says why). */
static int sv_settle(zt_zero_t *z) {
  int rc = z->stage >= 2 ? sv_land_all(z) : 0;
  if (rc == 0) rc = zt_comm_join(z->comm, 0);
  if (rc == 0) rc = zt_comm_settle(z->comm);
  for (int u = 0; z->sv_ag && u < z->U; u++) z->sv_ag[u] = 0;
  z->sv_gtk[0] = z->sv_gtk[1] = z->sv_gtk[2] = 0;
  return rc;
}

/* Stages 0-1 with overlap, last micro-step: unit u's gradient is final;
 * into the fp64 sum and onto the communication thread; where each
 * micro-step is reduced by itself (z->each), onto the thread in every
 * micro-step, straight from G. Stages 2-3 with
 * overlap: its slot (grad_slot) onto the thread, which reduces it from
 * there. Otherwise, stages 2-3: reduce-scatter the unit's gradient (fp64
 * sums, so they are exact) and add this rank's shard to the running sum,
 * from the fp32 gradient (rs_f32), or over NCCL widened first. */
static int h_post_backward(void *ctx, int u) {
  zt_zero_t *z = ctx;
  if (z->stage < 2 && z->sv) {
    if (z->last_micro && !z->fail && sv_reduce_unit(z, u) != 0)
      hook_fail(z, "reduce-scatter of gradients");
    return z->fail ? -1 : 0;
  }
  if (z->stage < 2 && z->overlap && (z->each || z->last_micro)) {
    size_t off = z->off_full[u];
    if (!z->each) z->k->acc_f64(z->G64 + off, z->G + off, z->S[u] * (size_t)z->N);
    ov_push(z, u, OV_REDUCE, z->each && z->micro_n > 1);
    return 0;
  }
  if (z->stage < 2 || z->fail) return z->fail ? -1 : 0;
  const float *g = u == 0 ? z->tg0 : z->tg;
  for (size_t lo = 0; lo < z->S[u]; lo += piece_len(z, u, lo)) {
    if (z->overlap) {
      ov_push_piece(z, u, OV_REDUCE, u == 0 ? 2 : z->ov_cur, lo);
      continue;
    }
    if (z->sv) {
      if (sv_reduce_piece(z, g, u, lo) == 0) continue;
      hook_fail(z, "reduce-scatter of gradients");
      return -1;
    }
    size_t n = piece_len(z, u, lo);
    double w0 = wall_ms();
    int rc;
    if (z->dcomm) {
      widen_piece(z, z->tg64, g, u, lo);
      rc = c_reduce_scatter(z, z->tg64, z->rs64, n, ZT_DT_F64);
    } else {
      rc = rs_piece(z, g, u, lo);
    }
    z->tm.wait_reduce_ms += wall_ms() - w0;
    if (rc != 0) {
      hook_fail(z, "reduce-scatter of gradients");
      return -1;
    }
    z->k->add_f64(z->G64 + z->off_shard[u] + lo, z->rs64, n);
  }
  return 0;
}


int zt_zero_create(zt_zero_t *z, zt_model_t *m, const zt_kernels_t *k, zt_comm_t *comm,
                   const zt_zero_opts_t *o) {
  memset(z, 0, sizeof *z);
  z->m = m;
  z->k = k;
  z->comm = comm;
  z->dev = o->dev;
  z->dcomm = o->dev && comm && zt_comm_device_memory(comm);
  z->N = o->world;
  z->r = o->rank;
  z->stage = o->stage;
  z->tmo = o->timeout_ms;
  z->inv_k = o->inv_k;
  /* The same choice on every rank: stage, accum, N and the communicator's
   * kind are the generation's. */
  z->q = o->compress && z->N > 1 && comm && !zt_comm_device_memory(comm) ? o->compress : 0;
  z->each = z->stage < 2 && !z->dcomm && !z->q &&
            (o->accum == 1 || (o->accum == 2 && z->N > 1 && comm && zt_comm_f32_direct(comm)));
  z->want_overlap = o->overlap && !o->dev; /* the thread runs on host memory only */
  z->sv = o->stream_overlap && z->dcomm && z->N > 1 && k->stream && k->set_waiter;
  z->xb = (size_t)k->xbytes;
  z->xdt = z->xb == 2 ? ZT_DT_BF16 : ZT_DT_F32;
  z->split = z->xb != sizeof(float);
  if (layout(z) != 0) goto err;
  if (z->q) {
    size_t S = z->max_unit / (size_t)z->N, qb = zt_quant_bytes((zt_quant_t)z->q, S);
    z->qsend = calloc((size_t)z->N, qb);
    z->qrecv = calloc((size_t)z->N, qb);
    z->qtmp = calloc(S ? S : 1, sizeof(float));
    if (!z->qsend || !z->qrecv || !z->qtmp) {
      zt_errk(ZT_E_NO_MEMORY, "out of memory for the compressed reduction's buffers");
      goto err;
    }
    z->scratch_bytes += 2 * (size_t)z->N * qb + S * sizeof(float);
  }
  if (z->dcomm && !(z->ctl_dev = k->alloc(ZT_ZERO_CTL_BYTES))) {
    zt_errk(ZT_E_NO_MEMORY, "out of device memory for %d bytes", ZT_ZERO_CTL_BYTES);
    goto err;
  }
  z->pver = 1;
  z->pf_unit[0] = z->pf_unit[1] = z->pf_unit[2] = -1;
  if (z->sv) {
    if (zt_comm_set_stream(comm, k->stream()) != 0) goto err;
    z->sv_ag = zt_xcalloc((size_t)z->U, sizeof *z->sv_ag);
    k->set_waiter(sv_waiter, z);
    ZT_INFO("stage %d: collectives in stream order, overlapped with the kernels "
            "(overlap_comm over NCCL)", z->stage);
  }
  if (o->overlap && z->N > 1 && !z->dev && ov_start(z) != 0) goto err;
  /* Without the communication thread, each hook points a unit at the
   * same buffer every step (stages 0-1: where layout() put it; stage 2:
   * tg0 or tg for the gradient; stage 3: gat0 or gat for the gathered
   * parameters), and only the hooks touch the table's memory during a
   * step: the model may record the steps into CUDA graphs. With the
   * thread, buffers take turns and the thread copies. */
  zt_model_hooks_t hooks = {.ctx = z,
                            .pre_forward = h_pre_forward,
                            .pre_backward = h_pre_backward,
                            .post_backward = h_post_backward,
                            .fixed_units = !z->overlap};
  /* Stages 0-1 without overlap: every hook would only report z->fail,
   * which nothing sets during the passes. No hooks then, and a CUDA graph
   * holds a micro-step whole. */
  zt_model_set_hooks(m, z->stage < 2 && !z->overlap && !z->sv ? NULL : &hooks);
  return 0;
err:
  /* The caller frees only what was created (the worker outlives the
   * generation, so every failed attempt would leak its buffers): free what
   * was allocated here. zt_err keeps the reason and its kind. */
  zt_zero_free(z);
  return -1;
}

/* Safe on a state that zt_zero_create built only in part: every buffer
 * not allocated is NULL, and the thread is stopped only if it started. */
void zt_zero_free(zt_zero_t *z) {
  ov_stop(z);
  if (z->m) zt_model_set_hooks(z->m, NULL);
  if (z->sv) { /* nothing of ours in flight (or the communicator ended), no waiter */
    if (zt_comm_settle(z->comm) != 0) ZT_DEBUG("zero: %s", zt_err_msg());
    z->k->set_waiter(NULL, NULL);
    free(z->sv_ag);
  }
  void *bufs[] = {z->gbuf, z->P,  z->G,  z->Ps,   z->G64, z->M,     z->V,      z->gat0, z->gat,
                  z->gatb, z->tg0, z->tg, z->tgb, z->tg64, z->rs64, z->tg64b, z->rs64b, z->ctl_dev,
                  z->split ? z->W : NULL, z->split ? z->Ws : NULL};
  for (size_t i = 0; i < ZT_ARRAY_LEN(bufs); i++)
    if (bufs[i]) z->k->release(bufs[i]);
  free(z->usz), free(z->S), free(z->off_full), free(z->off_shard);
  free(z->stage_buf);
  free(z->qsend), free(z->qrecv), free(z->qtmp);
  memset(z, 0, sizeof *z);
}

int zt_zero_write_memory_report(const zt_zero_t *z, const char *workdir,
                                uint64_t activation_bytes, const zt_memplan_need_t *estimate) {
  char path[1100];
  snprintf(path, sizeof path, "%s/zero_memory.json", workdir);
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

/* With a separate working copy (split), the working copy of unit u from
 * `full`, the whole unit in fp32 table memory (S[u] * N elements), or from
 * the fp32 master. */
static void refresh_unit(zt_zero_t *z, int u, const float *full) {
  if (!z->split) return;
  size_t SN = z->S[u] * (size_t)z->N;
  if (z->stage == 3)
    z->k->narrow_x(xadv(z, z->Ws, z->off_shard[u]), z->Ps + z->off_shard[u], z->S[u]);
  else if (full)
    z->k->narrow_x(xadv(z, z->W, z->off_full[u]), full, SN);
  else
    z->k->narrow_x(xadv(z, z->W, z->off_full[u]), z->P + z->off_full[u], SN);
}

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
      refresh_unit(z, u, z->gbuf);
    } else {
      refresh_unit(z, u, NULL);
    }
  }
  free(tmp);
}

void zt_zero_init_params(zt_zero_t *z, uint64_t seed) { put_params(z, seed, NULL); }

void zt_zero_set_params(zt_zero_t *z, const float *flat) { put_params(z, 0, flat); }

/* Where this rank's owned Adam state of unit u lives. */
static float *opt_ptr(zt_zero_t *z, float *base, int u) {
  return z->stage == 0 ? base + z->off_full[u] + (size_t)z->r * z->S[u] : base + z->off_shard[u];
}

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
  for (int u = 0; u < z->U; u++) {
    size_t lo, n;
    owned(z, u, &lo, &n);
    float *m = hm + (opt_ptr(z, z->M, u) - z->M), *v = hv + (opt_ptr(z, z->V, u) - z->V);
    int fu = unit_base + u; /* the unit's number in the files */
    if (z->P) {
      dest[nd++] = (zt_ckpt_dest_t){fu, 0, z->usz[u], hp + z->off_full[u], NULL, NULL};
      dest[nd++] = (zt_ckpt_dest_t){fu, lo, n, NULL, m, v};
    } else {
      dest[nd++] = (zt_ckpt_dest_t){fu, lo, n, hp + z->off_shard[u], m, v};
      if (whole_w) dest[nd++] = (zt_ckpt_dest_t){fu, 0, z->usz[u], hw + z->off_full[u], NULL, NULL};
    }
  }
  for (int i = 0; i < nextra; i++) dest[nd++] = extra[i];
  rc = zt_ckpt_load(dir, &z->m->cfg, dest, nd, rec, step);
out:
  free(dest);
  host_done(z, pbuf, hp, np);
  host_done(z, z->M, hm, no);
  host_done(z, z->V, hv, no);
  for (int u = 0; rc == 0 && z->split && u < z->U; u++) {
    if (whole_w) z->k->upload(z->gbuf, hw + z->off_full[u], z->S[u] * (size_t)z->N * sizeof(float));
    refresh_unit(z, u, whole_w ? z->gbuf : NULL);
  }
  free(hw);
  if (rc != 0) return -1;
  if (z->stage == 0) {
    /* Full Adam state on every rank: share the owned slices. */
    for (int u = 0; u < z->U; u++) {
      float *b[2] = {z->M + z->off_full[u], z->V + z->off_full[u]};
      for (int k = 0; k < 2; k++)
        if (c_all_gather(z, b[k] + (size_t)z->r * z->S[u], b[k], z->S[u], ZT_DT_F32) != 0)
          return zt_err_wrap("share optimizer state");
    }
  }
  return 0;
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
  for (int u = 0; u < z->U; u++) refresh_unit(z, u, NULL);
  return 0;
}

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

int zt_zero_owned_put(zt_zero_t *z, const float *host) {
  if (zt_zero_settle(z) != 0) return -1; /* no update may land on the new values */
  z->pver++;
  for (int u = 0; u < z->U; u++) {
    size_t lo, n, S = z->S[u];
    owned(z, u, &lo, &n);
    if (n) z->k->upload(owned_master(z, u, lo), host + z->off_shard[u], n * sizeof(float));
    int rc = 0;
    if (z->P && z->N > 1) { /* a whole master: the others' ranges, then the working copy */
      float *p = z->P + z->off_full[u];
      rc = c_all_gather(z, p + (size_t)z->r * S, p, S, ZT_DT_F32);
      refresh_unit(z, u, NULL);
    } else if (z->split && z->stage < 3) { /* the owned range rounded, then shared */
      void *w = xadv(z, z->W, z->off_full[u]);
      if (n) z->k->narrow_x(xadv(z, w, lo), z->Ps + z->off_shard[u], n);
      rc = c_all_gather(z, xadv(z, w, (size_t)z->r * S), w, S, z->xdt);
    } else {
      refresh_unit(z, u, NULL);
    }
    if (rc != 0) return zt_err_wrap("all-gather of the new parameters");
  }
  return 0;
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
    const float *src[3] = {z->P ? z->P + z->off_full[u] + lo : z->Ps + z->off_shard[u],
                           opt_ptr(z, z->M, u), opt_ptr(z, z->V, u)};
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

/* ---- one step ------------------------------------------------------------------------------ */

void zt_zero_start_step(zt_zero_t *z) { z->micro_n = 0; }

void zt_zero_micro_begin(zt_zero_t *z, int last) {
  z->last_micro = last;
  /* The fp64 sum starts at zero, except where the first micro-step's
   * reduction writes this rank's range (z->each). */
  z->micro_n++;
  /* Stream overlap: a reduction of the step before still in a slot lands
   * first (then the sum starts anew). */
  if (z->sv && z->micro_n == 1 && z->stage >= 2 && sv_land_all(z) != 0)
    hook_fail(z, "reduce-scatter of gradients");
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
  for (int u = 0; rc == 0 && u < z->U; u++) rc = reduce_unit(z, u, z->micro_n > 1, 0);
  z->tm.wait_reduce_ms += wall_ms() - w0;
  return rc == 0 ? 0 : zt_err_wrap("reduce-scatter of gradients");
}

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
    refresh_unit(z, u, NULL);
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

/* Overlap, stages 0-2: once the queue is empty (it holds the step's
 * reductions), one in-place gather per unit in forward order, each with
 * the ticket the hook before the unit's forward waits for (ag_wait). */
static int queue_gathers(zt_zero_t *z) {
  if (ov_wait(z) != 0) return -1;
  pthread_mutex_lock(&z->ov_mu);
  for (int u = 0; u < z->U; u++) z->ag_ticket[u] = ++z->ag_queued;
  pthread_mutex_unlock(&z->ov_mu);
  for (int u = 0; u < z->U; u++) ov_push(z, u, OV_GATHER, OV_IN_PLACE);
  return 0;
}

/* Stage 0: the owned range of each unit's reduced sum is scaled into G
 * (fp32) and G is all-gathered unit by unit, so every rank updates the
 * whole unit from the same fp32 gradient that it would have scaled from
 * an all-reduced fp64 sum, with half the bytes on the all-gather. With
 * overlap the gathers are queued and each unit's update is due: the hook
 * before its forward (or zt_zero_settle) applies it once its gather is
 * in. */
static int adamw_replicated(zt_zero_t *z) {
  for (int u = 0; u < z->U; u++) {
    size_t lo, n;
    owned(z, u, &lo, &n);
    if (n)
      z->k->narrow_f64(z->G + z->off_full[u] + lo, z->G64 + z->off_full[u] + lo, n, z->inv_k,
                       z->gscale);
  }
  if (z->sv) { /* all enqueued, each joined before its unit's update */
    for (int u = 0; u < z->U; u++)
      if (sv_gather_in_place(z, u, &z->sv_ag[u]) != 0) return zt_err_wrap("all-gather of gradients");
    for (int u = 0; u < z->U; u++) {
      if (sv_join(z, &z->sv_ag[u]) != 0) return zt_err_wrap("all-gather of gradients");
      adamw_unit(z, u);
    }
    return 0;
  }
  if (!z->overlap) {
    for (int u = 0; u < z->U; u++) {
      double w0 = wall_ms();
      int rc = gather_in_place(z, u);
      z->tm.wait_gather_ms += wall_ms() - w0;
      if (rc != 0) return zt_err_wrap("all-gather of gradients");
      adamw_unit(z, u);
    }
    return 0;
  }
  if (queue_gathers(z) != 0) return -1;
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

/* Sums the gradient over ranks: stages 0-1 reduce-scatter it in fp64
 * (stage 0 gathers the scaled result in zt_zero_adamw); stages 2-3 did it
 * unit by unit during backward. */
int zt_zero_reduce(zt_zero_t *z) {
  double w0 = wall_ms();
  int rc = 0;
  if (z->overlap)
    rc = ov_wait(z);
  else if (z->sv)
    rc = sv_settle(z) == 0 ? 0 : zt_err_wrap("reduce-scatter of gradients");
  else if (z->stage < 2 && !z->each) /* else done in zt_zero_micro_end */
    for (int u = 0; rc == 0 && u < z->U; u++) rc = reduce_unit(z, u, 0, 0);
  z->tm.wait_reduce_ms += wall_ms() - w0;
  return rc;
}

int zt_zero_gather(zt_zero_t *z) {
  if (z->stage != 1 && z->stage != 2) return 0;
  if (z->overlap) return queue_gathers(z); /* deferred: the next forward waits unit by unit */
  if (z->sv) { /* deferred: the next forward joins unit by unit */
    for (int u = 0; u < z->U; u++)
      if (sv_gather_in_place(z, u, &z->sv_ag[u]) != 0)
        return zt_err_wrap("all-gather of parameters");
    return 0;
  }
  double w0 = wall_ms();
  int rc = 0;
  for (int u = 0; rc == 0 && u < z->U; u++) rc = gather_in_place(z, u);
  z->tm.wait_gather_ms += wall_ms() - w0;
  return rc;
}

int zt_zero_settle(zt_zero_t *z) {
  if (z->sv) return sv_settle(z);
  if (!z->overlap) return 0;
  if (ov_wait(z) != 0) return -1;
  for (int u = 0; z->due_n && u < z->U; u++)
    if (z->due[u]) apply_due(z, u);
  return 0;
}


void zt_zero_take_times(zt_zero_t *z, zt_zero_times_t *out) {
  if (z->overlap) pthread_mutex_lock(&z->ov_mu);
  *out = z->tm;
  memset(&z->tm, 0, sizeof z->tm);
  if (z->overlap) pthread_mutex_unlock(&z->ov_mu);
}
