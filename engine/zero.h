/*
 * zero.h: the model states of one rank under ZeRO stages 0-3, and the
 * operations on them that involve the other ranks.
 *
 * Layout. Every unit u (layout.h) of U_u elements is padded to N*S_u,
 * S_u = ceil(U_u / N) rounded up to a multiple of 8 (zt_zero_shard_size,
 * memplan.h: units and shards 16-byte aligned); rank r owns
 * [r*S_u, (r+1)*S_u). Storage per stage
 * (docs/zero.md has the byte formulas):
 *
 *   stage  params          grads                    Adam m, v
 *   0      full            full                     full
 *   1      full            full                     shard
 *   2      full            shard (+ unit in flight) shard
 *   3      shard (+ units  shard (+ unit in flight) shard
 *          gathered in flight)
 *
 * One step, as the trainer (trainer.c) drives it: zt_zero_start_step, then
 * for each micro-step zt_zero_micro_begin, forward + backward of the model,
 * zt_zero_micro_end; then zt_zero_reduce (stages 0 and 1 reduce-scatter
 * the gradients; stages 2 and 3 have already reduce-scattered each unit's
 * gradient in the backward hook of every micro-step), zt_zero_sumsq for
 * the global norm, zt_zero_adamw on the owned shard (stage 0: each rank
 * scales its shard of the gradient to fp32, all-gathers the scaled
 * gradient and updates every unit; an fp32 all-gather is half the bytes
 * of the fp64 one an all-reduce would end with) and zt_zero_gather
 * (stages 1 and 2 all-gather the parameters). Stage
 * 3 all-gathers a unit right before the model uses it (forward and
 * backward) and drops it after. Gradient sums are kept in fp64, so the
 * reduced gradient is exact and the same for any world size.
 *
 * Overlap (host memory, N > 1; zero_optimization.overlap_comm,
 * on by default). Stages 0-1: in the last micro-step a unit's gradient is
 * final as soon as the model's post_backward hook runs for it: the hook
 * adds it to the fp64 sum and queues the unit's reduce-scatter for a
 * communication thread, and
 * backward goes on with the next unit while the network carries this one.
 * Where each micro-step is reduced by itself (`each` below: one or two
 * micro-steps per rank), the hook queues the unit's fp32 gradient in
 * every micro-step, and the next micro-step's hook before the unit's
 * backward waits for that reduction before zeroing the unit's gradient.
 * Stages 2-3, every micro-step: the hook widens the unit's gradient into one
 * of two fp64 slots (waiting while both are in flight) and queues its
 * reduce-scatter; the thread adds the reduced shard into the sum. In both,
 * zt_zero_reduce waits for the queue. The queue has room for everything
 * queued at once (unit 0's hook queues all of its pieces, dozens with a
 * large vocabulary), and a push that finds it full waits for the thread.
 * The thread is the only user of the
 * communicator until then, takes units one at a time in the order backward
 * finishes them, and adds shards into the sum in that same order; the fp64
 * sums do not depend on how the elements are grouped, so the results are
 * the same as without overlap (test_zero.py compares the loss series bit
 * for bit). Stage 3 also prefetches: the hook before a unit's forward or
 * backward takes its parameters from the gather slot that holds them (or
 * waits for the gather arriving there) and queues the gather of the unit
 * the model uses next into the other slot, so the network carries unit
 * l + 1 (l - 1 in backward) while unit l computes; gathers and reductions
 * share the thread's one queue, so every rank issues them in the same
 * order. An all-gather copies bits, so prefetching changes no value.
 * Stages 1-2 defer the all-gather of the updated parameters: zt_zero_gather
 * queues one gather per unit, in forward order, on the same thread and
 * returns; the hook before unit u's forward (the next step's, or an
 * evaluation's) waits for unit u's gather only, so the network carries the
 * later units while the earlier ones compute. Stage 0 defers the
 * all-gather of the scaled gradient the same way, and with it each unit's
 * update: the hook before unit u's forward waits for unit u's gradient and
 * applies AdamW to the unit. zt_zero_settle waits for everything queued and
 * applies the updates still due (the trainer calls it when a generation
 * ends well; a snapshot, a load and new parameters wait first too).
 *
 * Stream overlap (over NCCL, N > 1; the same overlap_comm). There is no
 * thread: the communicator runs the collectives on its own CUDA stream,
 * each after the kernels queued before it (zt_comm_set_stream), and the
 * table's stream waits for one only where its result is read or its
 * buffers are written again (zt_comm_join); the host waits for neither.
 * Stages 0-1, last micro-step: the hook after a unit's backward adds its
 * gradient into the fp64 sum and enqueues the unit's in-place
 * reduce-scatter; zt_zero_reduce joins them all. Stages 2-3, every
 * micro-step: the hook widens the unit's gradient (piece by piece) into
 * one of two fp64 slots and enqueues the piece's reduce-scatter into the
 * slot's reduced half; the piece's shard is added into the sum when the
 * slot comes round again (after a join) or in zt_zero_reduce. Stages 1-2
 * enqueue the parameter gathers after AdamW and the hook before unit u's
 * forward joins unit u's; stage 0 enqueues the gradient gathers and joins
 * each before its unit's update; stage 3 prefetches as above, slot by
 * slot, each gather joined by the hook that uses it. The table polls the
 * communicator while it waits for its stream (zt_kernels.h, set_waiter),
 * so a collective that fails or times out ends the communicator and the
 * step fails instead of hanging. Same collectives, same order on every
 * rank, same fp64 sums in the same order: the same bits as without.
 *
 * Devices. Every buffer lives in the memory of the kernel table z->k and
 * every operation on it is a kernel-table call (zero, acc_f64, narrow_f64,
 * adamw, ...): host memory and the CPU kernels, or device memory and the
 * CUDA kernels. With `dev` set, collectives stage device buffers through
 * host memory (the TCP ring works on host memory); with one rank they are
 * local copies. Checkpoint files are read and written through host buffers.
 */
#ifndef ZT_ZERO_H
#define ZT_ZERO_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt_io.h"
#include "comm.h"
#include "memplan.h"
#include "model.h"
#include "optim.h"
#include "zt_kernels.h"

/* Where a step's time went around communication, since the last
 * zt_zero_take_times: what the training thread waited for, and what the
 * communication thread (overlap) spent. Without overlap the collectives
 * run on the training thread and all of their time is waiting. */
typedef struct zt_zero_times {
  double wait_reduce_ms; /* gradient reductions (and stage 2-3 slots) */
  double wait_gather_ms; /* gathers: parameters (stages 1-3), stage 0's gradient */
  double comm_busy_ms;   /* the communication thread ran collectives */
  double comm_cpu_ms;    /* ... and the CPU time it used in them */
} zt_zero_times_t;

typedef struct zt_zero {
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
   * largest unit but unit 0, which is reduced in pieces (zero.c). */
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
  /* Overlap (zt_zero_opts_t.overlap): the communication thread and its
   * queue of units whose reduction is due, in the order backward finishes
   * them; everything under ov_mu. */
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
   * zero.c): the send and receive buffers (N encoded segments of the
   * largest shard) and one decoded segment. */
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
  /* Stage 3 prefetch (fetch_unit): gather slots 0 and 1 (gat, gatb) and 2
   * (gat0, unit 0); the unit each holds or receives, at which parameter
   * version (pver, bumped by every change of the parameters), whether its
   * gather is still queued (under ov_mu), and the slot in use. */
  float *gatb;
  int pf_unit[3], pf_busy[3], pf_cur;
  uint64_t pf_ver[3], pver;
  /* Stages 1-2 deferred gathers: unit u's is done once ag_done reaches
   * ag_ticket[u] (tickets count gathers queued; under ov_mu). */
  int64_t *ag_ticket, ag_queued, ag_done;
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
  /* Stream overlap (above; sv: on). Stages 2-3: fp64 slots 0 (tg64,
   * rs64) and 1 (tg64b, rs64b) take turns, sv_next the next one; sv_tk[s]
   * is the ticket of the reduce-scatter in slot s not yet added (0: none),
   * whose sv_n[s] sums go to G64 + sv_dst[s]. Stage 3: sv_gtk[s] the
   * ticket of the gather into gather slot s (pf_unit, pf_ver, pf_cur as
   * above) not yet joined. Stages 0-2: sv_ag[u], unit u's deferred
   * gather not yet joined. */
  int sv, sv_next;
  double *tg64b, *rs64b;
  uint64_t sv_tk[2], sv_gtk[3], *sv_ag;
  size_t sv_dst[2], sv_n[2];
} zt_zero_t;

typedef struct zt_zero_opts {
  int rank, world, stage;
  int dev;              /* stage collectives through host memory */
  int64_t timeout_ms;   /* per collective */
  double inv_k;         /* micro_batch / global_batch */
  int accum;            /* micro-steps per rank and step; 0: they vary (load balance) */
  int overlap;          /* reduce on a communication thread (see above) */
  int stream_overlap;   /* over NCCL: stream overlap (see above) */
  int compress;         /* sync.compression (zt_quant_t): on the TCP ring only */
} zt_zero_opts_t;

/* Lays out this rank's model states in the kernel table's memory, points
 * the model's units at them and installs the ZeRO hooks on the model. The
 * model must have been created with ZT_MODEL_NO_PARAMS | ZT_MODEL_NO_GRADS;
 * it stays the caller's. -1 when out of (device or host) memory, with
 * whatever was allocated freed again (nothing to free for the caller). */
ZT_MUST_CHECK int zt_zero_create(zt_zero_t *z, zt_model_t *m, const zt_kernels_t *k, zt_comm_t *comm,
                   const zt_zero_opts_t *o);
void zt_zero_free(zt_zero_t *z);

/* Writes <workdir>/zero_memory.json: the bytes of model states this rank
 * holds, by kind, and the activations' bytes, next to the estimate the
 * scheduler admits jobs by (memplan.h); tests compare them with
 * docs/zero.md and with each other. */
ZT_MUST_CHECK int zt_zero_write_memory_report(const zt_zero_t *z, const char *workdir,
                                              uint64_t activation_bytes,
                                              const zt_memplan_need_t *estimate);

/* Fresh parameters (zt_layout_init_unit), whole units or this rank's shard. */
void zt_zero_init_params(zt_zero_t *z, uint64_t seed);
/* The same from given parameters: `flat` holds the model's whole flat
 * parameter buffer (layout order); each rank keeps what its stage holds. */
void zt_zero_set_params(zt_zero_t *z, const float *flat);
/* Loads the committed epoch in `dir` (any world size or stage wrote it),
 * verified against the coordinator's record of its files; *step receives
 * its step. */
ZT_MUST_CHECK int zt_zero_load(zt_zero_t *z, const char *dir, const zt_ckpt_record_t *rec,
                               int64_t *step);
/* The same with unit u read as unit unit_base + u of the files (a DiLoCo
 * group's inner state, diloco.h), and the destinations `extra` (host
 * memory) filled from the same verified files in the same pass. */
ZT_MUST_CHECK int zt_zero_load_ex(zt_zero_t *z, const char *dir, const zt_ckpt_record_t *rec,
                                  int unit_base, const zt_ckpt_dest_t *extra, int nextra,
                                  int64_t *step);
/* One rank alone at stage 0 (or 1-2 without a split) holds the whole fp32 master
 * P: its full_total floats (the padded layout) to or from host memory,
 * after the queued operations; a put rounds the working copy again. -1
 * for any other layout. */
ZT_MUST_CHECK int zt_zero_master_get(zt_zero_t *z, float *host);
ZT_MUST_CHECK int zt_zero_master_put(zt_zero_t *z, const float *host);
/* This rank's owned ranges of the fp32 master, at any stage and world
 * size: shard_total floats of host memory, unit u's range at
 * off_shard[u] (S[u] floats, zeros past the unit's real size), after the
 * queued operations. A put is collective: every rank puts its ranges, and
 * the ranks then hold the new parameters wherever their stage keeps them
 * (stage 0 and a whole master all-gather it in fp32, stages 1-2 round the
 * owned range into the working copy and all-gather that, stage 3 rounds
 * its shard). With one rank the ranges are the whole padded layout. For
 * what works on a part of the model on each rank (DiLoCo's groups). */
ZT_MUST_CHECK int zt_zero_owned_get(zt_zero_t *z, float *host);
/* This rank's owned range of unit u, clipped to the unit's size:
 * [lo, lo + n) of the unit. */
void zt_zero_owned_range(const zt_zero_t *z, int u, size_t *lo, size_t *n);
ZT_MUST_CHECK int zt_zero_owned_put(zt_zero_t *z, const float *host);
/* The owned ranges of every unit, for a checkpoint: zt_zero_snapshot_floats
 * host floats are needed; zt_zero_snapshot copies params, m and v of each
 * unit into buf and describes them in ranges[0..U), after zt_zero_settle.
 * -1 (the reason in zt_err) when that failed with stage 0's updates still
 * due: the parameters are not all the step's, and no epoch may hold them.
 * A failed gather of stages 1-3 leaves the owned ranges right (logged;
 * the next step fails). */
size_t zt_zero_snapshot_floats(const zt_zero_t *z);
ZT_MUST_CHECK int zt_zero_snapshot(zt_zero_t *z, float *buf, zt_ckpt_range_t *ranges);

/* The steps of one training step, in order (see above). */
void zt_zero_start_step(zt_zero_t *z);
/* last: this is the step's last micro-step (its gradients are final). */
void zt_zero_micro_begin(zt_zero_t *z, int last);
/* -1 with the hook's error when a collective inside forward or backward
 * failed. */
ZT_MUST_CHECK int zt_zero_micro_end(zt_zero_t *z);
ZT_MUST_CHECK int zt_zero_reduce(zt_zero_t *z);
/* Sum of squares of the owned gradient elements (the global sum is the
 * all-reduce of these). */
double zt_zero_sumsq(zt_zero_t *z);
/* AdamW on the owned shard of every unit (stage 0: every rank on every
 * unit, after an all-gather of the scaled gradient): gradients scaled by
 * 1/K and the clip factor gscale, step t (1-based). -1 when stage 0's
 * all-gather fails. */
ZT_MUST_CHECK int zt_zero_adamw(zt_zero_t *z, const zt_opt_config_t *o, float lr, float gscale,
                                int64_t t);
/* Stages 1-2: all-gathers the updated parameters (with overlap: queues
 * the gathers; see "Overlap" above). */
ZT_MUST_CHECK int zt_zero_gather(zt_zero_t *z);
/* Waits for every operation queued on the communication thread and
 * applies stage 0's due updates; -1 (the reason in zt_err) when one
 * failed. 0 at once without overlap. */
ZT_MUST_CHECK int zt_zero_settle(zt_zero_t *z);
/* The times since the last call (wall_clock_breakdown); resets them. */
void zt_zero_take_times(zt_zero_t *z, zt_zero_times_t *out);
/* Sums `count` values of host memory (the trainer's control values and
 * the load balance's measures, at most 8 KiB) over the ranks: directly, or
 * through device memory when the communicator takes only that (NCCL). */
ZT_MUST_CHECK int zt_zero_host_all_reduce(zt_zero_t *z, void *buf, size_t count, zt_dtype_t dt);
/* All-gathers `count` elements of the storage type from every rank's
 * shard into full (count x world), in the kernel table's memory, after the
 * communication thread's queue: frozen parameters that ZeRO does not own
 * (LoRA's base at stage 3, lora.c), in the order the hooks call it. */
ZT_MUST_CHECK int zt_zero_gather_frozen(zt_zero_t *z, const float *shard, float *full,
                                        size_t count);

#endif
