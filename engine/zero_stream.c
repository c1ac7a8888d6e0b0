/*
 * zero_stream.c: ZeRO's collectives in NCCL's stream order, for GPU
 * workers with overlap (zero.h, "Stream overlap"; docs/gpu.md). zero.c
 * starts it and its hooks and step call the functions here instead of
 * running a collective themselves. It calls only zero_serial.c's helpers
 * (the widening of a piece, the buffers of an in-place gather, the hooks'
 * failure), nothing of zero.c, zero_io.c or zero_thread.c.
 *
 * There is no thread: the communicator runs each collective on its own
 * CUDA stream after the kernels queued before it (zt_comm_set_stream), and
 * the kernel table's stream waits for one only where its result is read
 * or its buffers are written again (zt_comm_join: a ticket joined); the
 * host waits for neither. Collectives are enqueued in the order the hooks
 * run, which is the same on every rank.
 *
 *   - stages 0-1, last micro-step: each unit's gradient added into the
 *     fp64 sum and its in-place reduce-scatter enqueued; zt_zero_reduce
 *     joins them all (zt__zero_stream_settle);
 *   - stages 2-3, every micro-step: each piece widened into one of two
 *     fp64 slots and its reduce-scatter enqueued into the slot's reduced
 *     half; the shard is added into the sum when the slot comes round
 *     again, or when the step's reduction lands both;
 *   - stages 0-2: the in-place gathers after AdamW, each joined before its
 *     unit's update (stage 0) or by the hook before its forward (1-2);
 *   - stage 3: each unit gathered into a slot of its own parity
 *     (sv_home), the next unit prefetched, each gather joined by the hook
 *     that uses it.
 *
 * The table polls the communicator while it waits for its stream
 * (zt_kernels.h, set_waiter: sv_waiter), so a collective that fails or
 * times out ends the communicator and the step fails instead of hanging.
 */
#include <stdlib.h>

#include "zero_impl.h"

/* The table's waiter: while it waits for its stream, which may wait for
 * our collectives, the communicator looks at them (and ends itself when
 * one failed or timed out, which releases the stream). */
static void sv_waiter(void *ctx) {
  zt_zero_t *z = ctx;
  if (zt_comm_progress(z->comm) != 0 && !z->fail) /* the step fails with it */
    zt__zero_hook_fail(z, "collective in flight");
}

int zt__zero_stream_start(zt_zero_t *z) {
  if (zt_comm_set_stream(z->comm, z->k->stream()) != 0) return -1;
  z->sv_ag = zt_xcalloc((size_t)z->U, sizeof *z->sv_ag);
  z->k->set_waiter(sv_waiter, z);
  ZT_INFO("stage %d: collectives in stream order, overlapped with the kernels "
          "(overlap_comm over NCCL)", z->stage);
  return 0;
}

/* Safe after a start that failed: nothing of ours in flight (or the
 * communicator ended), no waiter. */
void zt__zero_stream_stop(zt_zero_t *z) {
  if (zt_comm_settle(z->comm) != 0) ZT_DEBUG("zero: %s", zt_err_msg());
  z->k->set_waiter(NULL, NULL);
  free(z->sv_ag);
  z->sv_ag = NULL;
}

int zt__zero_stream_join(zt_zero_t *z, uint64_t *tk) {
  uint64_t t = *tk;
  *tk = 0;
  return t ? zt_comm_join(z->comm, t) : 0; /* zt_comm_join would take 0 for all */
}

/* ---- gradient reductions --------------------------------------------------------------- */

/* Stages 0-1, last micro-step: unit u's gradient into the fp64 sum and
 * its in-place reduce-scatter enqueued (zt_zero_reduce joins it). */
int zt__zero_stream_reduce_unit(zt_zero_t *z, int u) {
  size_t off = z->off_full[u], n = z->S[u] * (size_t)z->N;
  uint64_t tk;
  z->k->acc_f64(z->G64 + off, z->G + off, n);
  double *g = z->G64 + off;
  return zt_comm_reduce_scatter_async(z->comm, g, g + (size_t)z->r * z->S[u], z->S[u],
                                      ZT_DT_F64, ZT_RED_SUM, z->tmo, &tk);
}

/* Stages 2-3: slot s's reduce-scatter joined and its shard added into the
 * sum (nothing when the slot is free). */
static int sv_land(zt_zero_t *z, int s) {
  if (!z->sv_tk[s]) return 0;
  if (zt__zero_stream_join(z, &z->sv_tk[s]) != 0) return -1;
  z->k->add_f64(z->G64 + z->sv_dst[s], s ? z->rs64b : z->rs64, z->sv_n[s]);
  return 0;
}

/* Both slots, the older one first. */
int zt__zero_stream_land_all(zt_zero_t *z) {
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
  zt__zero_widen_piece(z, w, g, u, lo);
  if (zt_comm_reduce_scatter_async(z->comm, w, out, n, ZT_DT_F64, ZT_RED_SUM, z->tmo,
                                   &z->sv_tk[s]) != 0)
    return -1;
  z->sv_dst[s] = z->off_shard[u] + lo;
  z->sv_n[s] = n;
  return 0;
}

int zt__zero_stream_reduce_pieces(zt_zero_t *z, int u, const float *g) {
  for (size_t lo = 0; lo < z->S[u]; lo += piece_len(z, u, lo)) {
    if (sv_reduce_piece(z, g, u, lo) == 0) continue;
    zt__zero_hook_fail(z, "reduce-scatter of gradients");
    return -1;
  }
  return 0;
}

/* ---- gathers --------------------------------------------------------------------------- */

/* Stages 0-2: unit u's in-place gather (as zt__zero_gather_in_place)
 * enqueued. */
int zt__zero_stream_gather_in_place(zt_zero_t *z, int u, uint64_t *tk) {
  void *mine, *whole;
  zt_dtype_t dt = zt__zero_in_place_unit(z, u, &mine, &whole);
  return zt_comm_all_gather_async(z->comm, mine, whole, z->S[u], dt, z->tmo, tk);
}

/* Stages 1-2, the hook before unit u's forward: its deferred gather. */
void zt__zero_stream_join_gather(zt_zero_t *z, int u) {
  if (zt__zero_stream_join(z, &z->sv_ag[u]) != 0)
    zt__zero_hook_fail(z, "all-gather of parameters");
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
void zt__zero_stream_fetch(zt_zero_t *z, int u, int next) {
  if (z->fail) return;
  int s = sv_home(u);
  if (sv_gather(z, u) != 0 || zt__zero_stream_join(z, &z->sv_gtk[s]) != 0) goto err;
  z->m->unit_params[u] = gat_slot(z, s);
  if (next >= 0 && next != u && sv_gather(z, next) != 0) goto err;
  return;
err:
  zt__zero_hook_fail(z, "all-gather of parameters");
}

/* Joins every collective enqueued and waits on the host until they are
 * done: the sums added, the gathers in place (a failure says why). */
int zt__zero_stream_settle(zt_zero_t *z) {
  int rc = z->stage >= 2 ? zt__zero_stream_land_all(z) : 0;
  if (rc == 0) rc = zt_comm_join(z->comm, 0);
  if (rc == 0) rc = zt_comm_settle(z->comm);
  for (int u = 0; z->sv_ag && u < z->U; u++) z->sv_ag[u] = 0;
  z->sv_gtk[0] = z->sv_gtk[1] = z->sv_gtk[2] = 0;
  return rc;
}
