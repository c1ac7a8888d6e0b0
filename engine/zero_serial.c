/*
 * zero_serial.c: ZeRO's collectives on the kernel table's memory, run on
 * the calling thread (zero.h, zero_impl.h). The bottom of the zero files:
 * it calls none of them.
 *
 * Who calls it. Without overlap the training thread runs these from the
 * hooks and the step (zero.c); with overlap on a CPU worker the
 * communication thread runs the same functions for the entries of its
 * queue (zero_thread.c); NCCL's stream order (zero_stream.c) takes only
 * the small helpers (the widening of a piece, the in-place buffers of a
 * gather). Loads and puts of the owned ranges (zero_io.c) spread what
 * each rank holds with zt__zero_all_gather.
 *
 * What is here:
 *
 *   - the plain collectives on table memory (zt__zero_reduce_scatter,
 *     zt__zero_all_gather): with one rank a local copy; otherwise host
 *     memory goes straight to the communicator, and so does device memory
 *     when the communicator takes it (NCCL, z->dcomm); otherwise device
 *     memory is staged: the region the call reads (send, or recv when send
 *     lies inside it, as in the in-place calls of stages 1-2) is
 *     downloaded, the collective runs on host memory, and what it wrote is
 *     uploaded;
 *   - the fp32-to-fp64 reductions of stages 2-3 and of stages 0-1 where
 *     each micro-step is reduced by itself (rs_f32);
 *   - sync.compression on the TCP ring: the encoded all-to-all whose
 *     decoded pieces each owner adds to its own exact sums in ring order,
 *     and stage 0's encoded gradient gather;
 *   - one unit's reduction (zt__zero_reduce_unit) and in-place gather
 *     (zt__zero_gather_in_place), the units of work the thread queues;
 *   - the serial paths of the hooks: stage 3's gather of a unit, stages
 *     2-3's pieces reduced and added at once.
 *
 * Every fp64 sum is added in the same order whichever thread runs it and
 * whatever way the elements are grouped, so the three ways of running
 * collectives give the same bits.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "zero_impl.h"

void zt__zero_hook_fail(zt_zero_t *z, const char *what) {
  if (!z->fail) {
    z->fail = 1;
    snprintf(z->fail_msg, sizeof z->fail_msg, "%s: %s", what, zt_err_msg());
  }
}

/* ---- plain collectives on table memory ---------------------------------------------- */

/* The host staging buffer, at least `bytes` long. */
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

int zt__zero_reduce_scatter(zt_zero_t *z, void *send, void *recv, size_t count, zt_dtype_t dt) {
  if (z->N == 1) {
    if (send != recv) z->k->copy(recv, send, count * zt_dtype_size(dt));
    return 0;
  }
  dev_settle(z);
  if (!z->dev || z->dcomm)
    return zt_comm_reduce_scatter(z->comm, send, recv, count, dt, ZT_RED_SUM, z->tmo);
  return c_staged(z, send, recv, count, dt, 0);
}

int zt__zero_all_gather(zt_zero_t *z, const void *send, void *recv, size_t count, zt_dtype_t dt) {
  if (z->N == 1) {
    if (send != recv) z->k->copy(recv, send, count * zt_dtype_size(dt));
    return 0;
  }
  dev_settle(z);
  if (!z->dev || z->dcomm) return zt_comm_all_gather(z->comm, send, recv, count, dt, z->tmo);
  return c_staged(z, recv, (char *)send, count, dt, 1);
}

/* ---- fp32 gradients into fp64 sums ------------------------------------------------- */

/* The NCCL path (it has no fp32-to-fp64 reduction): widens piece lo of
 * unit u's fp32 gradient g into dst, shard after shard (contiguous when
 * the piece is the whole unit). */
void zt__zero_widen_piece(zt_zero_t *z, double *dst, const float *g, int u, size_t lo) {
  size_t n = piece_len(z, u, lo);
  if (n == z->S[u]) {
    z->k->widen_f64(dst, g, n * (size_t)z->N);
    return;
  }
  for (int r = 0; r < z->N; r++) z->k->widen_f64(dst + (size_t)r * n, g + (size_t)r * z->S[u] + lo, n);
}

static int rs_f32_compressed(zt_zero_t *z, const float *src, size_t stride, double *out,
                             size_t n);

/* fp32 segments of n elements, `stride` apart, one per rank,
 * reduce-scattered into this rank's fp64 sums in out
 * (zt_comm_reduce_scatter_f32to64): straight from host memory; from a
 * device without NCCL the segments are downloaded (half the bytes of
 * widened ones), summed on the host and the sums uploaded. Over NCCL the
 * callers widen first (it has no fp32-to-fp64 reduction). */
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

/* ---- sync.compression (zero_impl.h) ----------------------------------------------- */

/* The compressed exchange: with every other rank's segment of n values
 * encoded in qsend, the all-to-all, then the decoded pieces from the
 * other ranks added to this rank's own sums in mine, in ring order from
 * the next rank on, in fp64. */
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

/* Unit u's fp64 sums reduced with sync.compression: every other rank's
 * segment for this rank arrives encoded, straight from it, and is added
 * to this rank's own exact sums in rank order, in fp64. The sums are the
 * same on every run of the same world size; they differ from the exact
 * ones by the encoding's rounding of the other ranks' values. */
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

/* ---- one unit ------------------------------------------------------------------------ */

/* One reduction, queued or not. Stages 0-1: unit u's padded range of the
 * fp64 sum, reduce-scattered in place; or, where each micro-step is
 * reduced by itself (z->each), its fp32 gradient in G into this rank's
 * range of the sum: written there in the first micro-step (s = 0), else
 * (s = 1) into the range after it, which this path leaves unused, and
 * added (not over NCCL). Stages 2-3: piece lo of the fp32 gradient in
 * slot s, reduce-scattered, then its shard added into the sum. A piece's
 * elements are summed over the ranks in the ring's order whatever its
 * size, so the pieces change no bit. */
int zt__zero_reduce_unit(zt_zero_t *z, int u, int s, size_t lo) {
  if (z->stage >= 2) {
    if (rs_piece(z, slot_tg(z, s), u, lo) != 0) return -1;
    add_sums(z, z->G64 + z->off_shard[u] + lo, z->rs64, piece_len(z, u, lo));
    return 0;
  }
  double *g = z->G64 + z->off_full[u], *mine = g + (size_t)z->r * z->S[u];
  if (z->q) return reduce_compressed(z, u);
  if (!z->each) return zt__zero_reduce_scatter(z, g, mine, z->S[u], ZT_DT_F64);
  double *out = s ? g + (size_t)((z->r + 1) % z->N) * z->S[u] : mine;
  if (rs_f32(z, z->G + z->off_full[u], z->S[u], out, z->S[u]) != 0) return -1;
  if (s) add_sums(z, mine, out, z->S[u]);
  return 0;
}

/* Stages 2-3 without overlap: reduce-scatter each piece of the unit's
 * gradient (fp64 sums, so they are exact) and add this rank's shard to
 * the running sum, from the fp32 gradient (rs_f32), or over NCCL widened
 * first. */
int zt__zero_reduce_pieces(zt_zero_t *z, int u, const float *g) {
  for (size_t lo = 0; lo < z->S[u]; lo += piece_len(z, u, lo)) {
    size_t n = piece_len(z, u, lo);
    double w0 = wall_ms();
    int rc;
    if (z->dcomm) {
      zt__zero_widen_piece(z, z->tg64, g, u, lo);
      rc = zt__zero_reduce_scatter(z, z->tg64, z->rs64, n, ZT_DT_F64);
    } else {
      rc = rs_piece(z, g, u, lo);
    }
    z->tm.wait_reduce_ms += wall_ms() - w0;
    if (rc != 0) {
      zt__zero_hook_fail(z, "reduce-scatter of gradients");
      return -1;
    }
    z->k->add_f64(z->G64 + z->off_shard[u] + lo, z->rs64, n);
  }
  return 0;
}

/* Unit u from every rank's owned range: stages 1-2 the working copy of
 * the parameters, stage 0 the scaled fp32 gradient in G (zt_zero_adamw).
 * The buffers of its in-place gather: this rank's range (mine) of the
 * whole unit, and their type. */
zt_dtype_t zt__zero_in_place_unit(zt_zero_t *z, int u, void **mine, void **whole) {
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

int zt__zero_gather_in_place(zt_zero_t *z, int u) {
  if (z->stage == 0 && z->q) return gather_compressed(z, u);
  void *mine, *whole;
  zt_dtype_t dt = zt__zero_in_place_unit(z, u, &mine, &whole);
  return zt__zero_all_gather(z, mine, whole, z->S[u], dt);
}

/* Stage 3: gather unit u's parameters into a full buffer. */
void zt__zero_gather_unit(zt_zero_t *z, int u) {
  float *buf = u == 0 ? z->gat0 : z->gat;
  if (z->fail) return;
  if (zt__zero_all_gather(z, xadv(z, z->Ws, z->off_shard[u]), buf, z->S[u], z->xdt) != 0)
    zt__zero_hook_fail(z, "all-gather of parameters");
  z->m->unit_params[u] = buf;
}
