/*
 * zero_impl.h: the inside of a rank's ZeRO state (zero.h), for the zero
 * files only. Nothing outside engine/zero*.c includes it: the trainer,
 * LoRA, DiLoCo and the tests see zt_zero_t as an opaque type and read what
 * they need through zero.h's accessors and its view (zt_zero_view_t).
 *
 * The files, top to bottom (each calls only the ones below it, so that the
 * engine's call graph has no cycle: tools/check-layers):
 *
 *   zero_io.c      state I/O: new parameters, checkpoint loads and
 *                  snapshots, the owned ranges and the whole master
 *                  (DiLoCo); waits through zt_zero_settle
 *   zero.c         the interface: create/free, the layout, the hooks, the
 *                  step (reduce, update, gathers, settle), the accessors;
 *                  it picks one of the three ways collectives run:
 *   zero_thread.c  CPU workers with overlap: the communication thread and
 *                  its queue (reductions, deferred gathers, stage 3
 *                  prefetch)
 *   zero_stream.c  GPU workers over NCCL with overlap: collectives in the
 *                  communicator's stream order, joined where read
 *   zero_serial.c  the collectives on table memory, run on the calling
 *                  thread (the training thread without overlap, or the
 *                  communication thread): staging through host memory,
 *                  sync.compression, one unit's reduction or gather
 *
 * Internals shared between these files are named zt__zero_*: the ones of
 * zero_thread.c zt__zero_thread_*, of zero_stream.c zt__zero_stream_*.
 * Small helpers over the layout are static inline below.
 */
#ifndef ZT_ZERO_IMPL_H
#define ZT_ZERO_IMPL_H

#include <pthread.h>

#include "zero.h"
#include "zt_common.h"

struct zt_zero {
  zt_model_t *m;         /* the model whose unit pointers this rank's state feeds */
  const zt_kernels_t *k; /* kernels and memory of the model and its state */
  int dev;               /* that memory is a device's (collectives are staged) */
  int dcomm;             /* ... and the communicator takes it as is (NCCL) */
  void *ctl_dev;         /* dcomm: device room for the trainer's control values */
  zt_comm_t *comm;
  int N, r, stage, U;
  int64_t tmo;           /* deadline of each collective, ms */
  void *stage_buf;       /* host staging for collectives on device memory */
  size_t stage_cap;
  float *gbuf;           /* one unit's owned gradient in fp32, for the AdamW kernel */
  size_t *usz, *S;       /* unit size, shard size */
  size_t *off_full;      /* offset of unit u in full (padded) buffers */
  size_t *off_shard;     /* offset of unit u in shard buffers */
  size_t full_total, shard_total, max_unit;
  /* Stages 2-3: the in-flight buffers' size in elements, N * S of the
   * largest unit but unit 0, which is reduced in pieces (piece_len). */
  size_t slot_unit;
  /* Parameters. P and Ps are the fp32 master: P whole (stage 0, and
   * stages 1-2 without a split), else Ps, the owned shard. The model reads
   * the working copy in the table's storage type (xb bytes, zt_kernels.h):
   * W whole (stages 0-2) or Ws, the shard that stage 3 gathers. With fp32
   * storage W is P and Ws is Ps; with bf16 storage (split) they are their
   * own buffers, rounded from the master after each change (AdamW, load,
   * init) and all-gathered in bf16. */
  float *P, *Ps;
  float *W, *Ws;
  size_t xb;             /* bytes of a working-copy element */
  zt_dtype_t xdt;        /* ... as a collective's type */
  int split;             /* the working copy is not the master */
  float *G;              /* one micro-step's full grads (stages 0-1) */
  double *G64;           /* gradient sum: full (stages 0-1) or shard (2-3) */
  float *M, *V;          /* Adam state: full (stage 0) or shard */
  float *gat0, *gat;     /* stage 3: gathered unit 0 and the current unit (working copy) */
  float *tg0, *tg;       /* stage 2-3: full grads of unit 0 and of the current unit */
  double *rs64;          /* stage 2-3: a piece's reduced shard (fp64 sums) */
  double *tg64;          /* stage 2-3 over NCCL: a piece widened to fp64 */
  double inv_k;          /* 1 / micro-batches per step (all ranks) */
  int fail;              /* a collective in a hook failed */
  int oom;               /* an allocation of the layout failed */
  char fail_msg[512];
  uint64_t state_bytes[4]; /* params, grads, optimizer, in flight */
  uint64_t scratch_bytes;  /* the gather scratch (not a model state) */
  /* Overlap (zt_zero_opts_t.overlap, zero_thread.c): the communication
   * thread and its queue of units whose reduction is due, in the order
   * backward finishes them; everything under ov_mu. */
  int want_overlap, overlap, last_micro;
  /* Stages 0-1: micro-steps begun this step, and whether each micro-step's
   * fp32 gradient in G is reduce-scattered by itself into this rank's
   * range of G64 (the first one's sums written there, the later ones'
   * added), instead of the fp64 sum over the micro-steps once: with one
   * micro-step per rank (the sum is G itself), and with two where the
   * communicator sends fp32 straight to each owner (zt_comm_f32_direct),
   * so that two fp32 reductions move the bytes of one fp64 one and the
   * first hides behind the rest of the step. Not over NCCL (zero.c). */
  int micro_n, each;
  /* sync.compression (the TCP ring): every reduction (stages 0-1: each
   * unit's fp64 sums, narrowed; stages 2-3: each micro-step's fp32
   * pieces) sends the encoding q (quant.h) of every other rank's segment
   * straight to its owner (zt_comm_all_to_all), which adds the decoded
   * pieces to its own exact values in ring order (exchange_encoded in
   * zero_serial.c): the send and receive buffers (N encoded segments of
   * the largest shard) and one decoded segment. */
  int q;
  uint8_t *qsend, *qrecv;
  float *qtmp;
  int *rd_busy;          /* stages 0-1 with overlap: unit u's reduction is queued or running */
  pthread_t ov_thread;
  pthread_mutex_t ov_mu;
  pthread_cond_t ov_cv;
  int64_t *ov_queue;     /* ring of OV_ENTRY(unit, kind, slot, piece), ov_cap entries */
  int ov_cap, ov_head, ov_len, ov_quit;
  /* Stages 2-3: gradient slots whose reduction is queued or running: 0
   * and 1 (tg, tgb) take turns for units 1..U-1, the slot of the next
   * unit is ov_next and of the current one ov_cur; ov_busy[2] counts the
   * queued pieces of unit 0 (tg0). */
  int ov_busy[3], ov_next, ov_cur;
  float *tgb;
  /* Stage 3 prefetch (zt__zero_thread_fetch): gather slots 0 and 1 (gat,
   * gatb) and 2 (gat0, unit 0); the unit each holds or receives, at which
   * parameter version (pver, bumped by every change of the parameters),
   * whether its gather is still queued (under ov_mu), and the slot in use. */
  float *gatb;
  int pf_unit[3], pf_busy[3], pf_cur;
  uint64_t pf_ver[3], pver;
  /* Stages 0-2 deferred gathers: unit u's is done once ag_done reaches
   * ag_ticket[u] (tickets count gathers queued; under ov_mu), and it
   * succeeded once ag_ok does (the gathers done before any failure). */
  int64_t *ag_ticket, ag_queued, ag_done, ag_ok;
  /* Stage 0 with overlap: units whose update waits for their gathered
   * gradient (applied by the hook before their forward, or by
   * zt_zero_settle), and how many. */
  char *due;
  int due_n;
  /* The optimizer step's settings (zt_zero_adamw), kept for the updates
   * that are due. */
  const zt_opt_config_t *opt;
  float lr, gscale;
  int64_t t;
  zt_zero_times_t tm;    /* waits: training thread; busy, cpu: the thread, under ov_mu */
  int ov_fail;           /* a queued reduction failed: ov_msg says why */
  char ov_msg[512];
  /* Stream overlap (zero_stream.c; sv: on). Stages 2-3: fp64 slots 0
   * (tg64, rs64) and 1 (tg64b, rs64b) take turns, sv_next the next one;
   * sv_tk[s] is the ticket of the reduce-scatter in slot s not yet added
   * (0: none), whose sv_n[s] sums go to G64 + sv_dst[s]. Stage 3:
   * sv_gtk[s] the ticket of the gather into gather slot s (pf_unit,
   * pf_ver, pf_cur as above) not yet joined. Stages 0-2: sv_ag[u], unit
   * u's deferred gather not yet joined. */
  int sv, sv_next;
  double *tg64b, *rs64b;
  uint64_t sv_tk[2], sv_gtk[3], *sv_ag;
  size_t sv_dst[2], sv_n[2];
  /* What zt_zero_view hands out: the layout and the way collectives run,
   * filled once by zt_zero_create (none of it changes after). */
  zt_zero_view_t view;
};

/* ---- helpers over the layout -------------------------------------------------------- */

/* Milliseconds of wall clock. */
static inline double wall_ms(void) { return (double)zt_now_us() / 1000.0; }

/* p advanced by n elements of the storage type. */
static inline float *xadv(const zt_zero_t *z, const float *p, size_t n) {
  return (float *)((char *)p + n * z->xb);
}

/* The owned range of unit u, clipped to its real size: [lo, lo + n). */
static inline void owned(const zt_zero_t *z, int u, size_t *lo, size_t *n) {
  size_t a = (size_t)z->r * z->S[u], b = a + z->S[u];
  if (b > z->usz[u]) b = z->usz[u];
  *lo = a < b ? a : b;
  *n = b > a ? b - a : 0;
}

/* Where this rank's owned Adam state of unit u lives. */
static inline float *opt_ptr(const zt_zero_t *z, float *base, int u) {
  return z->stage == 0 ? base + z->off_full[u] + (size_t)z->r * z->S[u] : base + z->off_shard[u];
}

/* Stages 2-3 reduce a unit's gradient in pieces of at most slot_unit / N
 * elements of each rank's shard: one piece for every unit but unit 0
 * (the embeddings, often the largest by far: GPT-2's is five times a
 * layer), so the in-flight buffers are sized by the largest other unit.
 * The piece at shard offset lo: n elements of each of the N shards. */
static inline size_t piece_len(const zt_zero_t *z, int u, size_t lo) {
  return ZT_MIN(z->slot_unit / (size_t)z->N, z->S[u] - lo);
}

/* Stages 2-3 with overlap: the fp32 gradient buffer that reduction slot
 * s reads (slots 0 and 1 take turns for units 1..U-1, slot 2 is unit
 * 0's, whose pieces it counts). */
static inline float *slot_tg(const zt_zero_t *z, int s) {
  return s == 2 ? z->tg0 : s ? z->tgb : z->tg;
}

/* Stage 3: gather slot s (0 and 1 take turns, 2 is unit 0's). */
static inline float *gat_slot(const zt_zero_t *z, int s) {
  return s == 2 ? z->gat0 : s ? z->gatb : z->gat;
}

/* ---- zero.c ------------------------------------------------------------------------ */

/* With a separate working copy (split), the working copy of unit u from
 * `full`, the whole unit in fp32 table memory (S[u] * N elements), or from
 * the fp32 master. */
void zt__zero_refresh_unit(zt_zero_t *z, int u, const float *full);

/* ---- zero_thread.c: the communication thread --------------------------------------- */

/* Starts the thread and its queue (sets z->overlap); -1 when it cannot. */
ZT_MUST_CHECK int zt__zero_thread_start(zt_zero_t *z);
/* Stops it (a collective still running is aborted with the communicator);
 * nothing without a thread. */
void zt__zero_thread_stop(zt_zero_t *z);
/* Waits until every queued operation is done; -1 when one failed. */
ZT_MUST_CHECK int zt__zero_thread_wait(zt_zero_t *z);
/* zero.c: stage 0's updates still due after a failure, applied when
 * every gradient arrived (0), else dropped whole (1); zt_zero_full_get. */
ZT_MUST_CHECK int zt__zero_finish_update(zt_zero_t *z);
/* Waits, as time waited for reductions, until the reductions that *busy
 * counts (under ov_mu) are done; -1 when a queued one failed (z->fail). */
ZT_MUST_CHECK int zt__zero_thread_reduced(zt_zero_t *z, const int *busy);
/* Stages 2-3, before unit u's backward: the gradient slot it writes into
 * (*g), once the reductions that still read it are done; -1 as above. */
ZT_MUST_CHECK int zt__zero_thread_grad_slot(zt_zero_t *z, int u, float **g);
/* Stages 0-1, after unit u's backward: into the fp64 sum (unless each
 * micro-step is reduced by itself) and its reduction queued. */
void zt__zero_thread_queue_unit(zt_zero_t *z, int u);
/* Stages 2-3, after unit u's backward: every piece of its slot queued. */
void zt__zero_thread_queue_pieces(zt_zero_t *z, int u);
/* Stages 0-2: one in-place gather per unit queued, in forward order, once
 * the step's reductions are done; -1 when one of them failed. */
ZT_MUST_CHECK int zt__zero_thread_queue_gathers(zt_zero_t *z);
/* Stages 0-2, the hook before unit u's forward: its deferred gather has
 * arrived (a failure sets z->fail). */
void zt__zero_thread_wait_gather(zt_zero_t *z, int u);
/* Stage 3, the hooks before a unit's forward or backward: unit u's
 * parameters in place, `next` prefetched (a failure sets z->fail). */
void zt__zero_thread_fetch(zt_zero_t *z, int u, int next);

/* ---- zero_stream.c: NCCL stream order ---------------------------------------------- */

/* The communicator on the table's stream, the deferred gathers' tickets
 * and the table's waiter; -1 when the communicator refuses the stream. */
ZT_MUST_CHECK int zt__zero_stream_start(zt_zero_t *z);
/* Waits for what is in flight and takes the waiter back. */
void zt__zero_stream_stop(zt_zero_t *z);
/* The table's stream waits for the collective of ticket *tk, which is
 * then spent (0: none). */
ZT_MUST_CHECK int zt__zero_stream_join(zt_zero_t *z, uint64_t *tk);
/* Stages 2-3: both gradient slots' reductions joined and added. */
ZT_MUST_CHECK int zt__zero_stream_land_all(zt_zero_t *z);
/* Stages 0-1, last micro-step: unit u into the fp64 sum and its
 * reduce-scatter enqueued. */
ZT_MUST_CHECK int zt__zero_stream_reduce_unit(zt_zero_t *z, int u);
/* Stages 2-3: every piece of unit u's gradient g enqueued; -1 with
 * z->fail set when one could not be. */
ZT_MUST_CHECK int zt__zero_stream_reduce_pieces(zt_zero_t *z, int u, const float *g);
/* Stages 0-2: unit u's in-place gather enqueued, its ticket in *tk. */
ZT_MUST_CHECK int zt__zero_stream_gather_in_place(zt_zero_t *z, int u, uint64_t *tk);
/* Stages 1-2, the hook before unit u's forward: its deferred gather. */
void zt__zero_stream_join_gather(zt_zero_t *z, int u);
/* Stage 3, the hooks before a unit's forward or backward. */
void zt__zero_stream_fetch(zt_zero_t *z, int u, int next);
/* Joins everything enqueued and waits on the host until it is done. */
ZT_MUST_CHECK int zt__zero_stream_settle(zt_zero_t *z);

/* ---- zero_serial.c: collectives on table memory ------------------------------------ */

/* The first failure of a hook's collective: z->fail, and why. */
void zt__zero_hook_fail(zt_zero_t *z, const char *what);
/* Reduce-scatter (sum) and all-gather on table memory, in place or not:
 * a local copy with one rank, else straight or staged through host memory. */
ZT_MUST_CHECK int zt__zero_reduce_scatter(zt_zero_t *z, void *send, void *recv, size_t count,
                                          zt_dtype_t dt);
ZT_MUST_CHECK int zt__zero_all_gather(zt_zero_t *z, const void *send, void *recv, size_t count,
                                      zt_dtype_t dt);
/* The NCCL path: piece lo of unit u's fp32 gradient g widened into dst. */
void zt__zero_widen_piece(zt_zero_t *z, double *dst, const float *g, int u, size_t lo);
/* One reduction: stages 0-1 unit u (s: which micro-step's, where each is
 * reduced by itself), stages 2-3 piece lo of gradient slot s. */
ZT_MUST_CHECK int zt__zero_reduce_unit(zt_zero_t *z, int u, int s, size_t lo);
/* Stages 2-3 without overlap: every piece of unit u's gradient g reduced
 * and added into the sum; -1 with z->fail set when one failed. */
ZT_MUST_CHECK int zt__zero_reduce_pieces(zt_zero_t *z, int u, const float *g);
/* The buffers of unit u's in-place gather (stage 0: the scaled gradient,
 * stages 1-2: the working copy): this rank's range and the whole unit. */
zt_dtype_t zt__zero_in_place_unit(zt_zero_t *z, int u, void **mine, void **whole);
/* That gather, run now (stage 0 with sync.compression: encoded). */
ZT_MUST_CHECK int zt__zero_gather_in_place(zt_zero_t *z, int u);
/* Stage 3 without overlap: unit u's parameters gathered into the gather
 * buffer and the model pointed at them (a failure sets z->fail). */
void zt__zero_gather_unit(zt_zero_t *z, int u);

#endif
