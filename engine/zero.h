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
 *
 * Code. The state is opaque: its users (trainer.c, lora.c, diloco.c, the
 * tests) call the functions below and read the layout through
 * zt_zero_view. zero.c holds the interface (create/free, the hooks, the
 * step); the collectives run one of three ways, each in a file of its own:
 * serial on the calling thread (zero_serial.c, which also stages device
 * memory and compresses), on the communication thread (zero_thread.c) or
 * in NCCL's stream order (zero_stream.c); zero_io.c loads, snapshots and
 * replaces the state. zero_impl.h has the struct and says how the files
 * call each other.
 */
#ifndef ZT_ZERO_H
#define ZT_ZERO_H

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

/* A rank's ZeRO state: opaque (its inside is zero_impl.h's, for the zero
 * files only). */
typedef struct zt_zero zt_zero_t;

/* What the state's users read of it (zt_zero_view): the layout above and
 * the way its collectives run, fixed by zt_zero_create. The arrays have U
 * entries and belong to the state. */
typedef struct zt_zero_view {
  const zt_kernels_t *k;   /* the kernel table whose memory holds the states */
  int N, r, stage, U;      /* world, rank, ZeRO stage, units (layout.h) */
  const size_t *usz;       /* unit u's size in elements */
  const size_t *S;         /* its shard size: the unit is padded to N * S[u] */
  const size_t *off_full;  /* unit u's offset in whole (padded) buffers */
  const size_t *off_shard; /* ... and in shard buffers: the owned ranges (zt_zero_owned_get) */
  size_t full_total;       /* elements of a whole padded buffer */
  size_t shard_total;      /* ... of a shard buffer (sum of S[u]) */
  size_t max_unit;         /* the largest padded unit, N * S[u] */
  double inv_k;            /* 1 / micro-batches per step over all ranks */
  int each;                /* stages 0-1: each micro-step's fp32 gradient reduce-scattered
                            * by itself (one or two micro-steps per rank), not their fp64 sum */
  int thread;              /* collectives on the communication thread (overlap) */
  int stream;              /* collectives in NCCL stream order (stream overlap) */
  int dcomm;               /* the communicator takes device memory as it is (NCCL) */
} zt_zero_view_t;

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

/* Whether the communication thread runs (zt_zero_opts_t.overlap), the
 * same on every rank of a generation (want: the spec's overlap_comm; dev:
 * this rank's memory is a device's). Overlap changes the order of the
 * collectives (stages 0-1 reduce units in backward's order and defer
 * gathers into the next forward, stage 3 prefetches and keeps gathered
 * units), so every rank must make the same choice (the ring's operation
 * headers would stop a generation at its first call in another order). A
 * rank on a device cannot run the thread (it works on host memory), so a
 * generation that mixes CPU and GPU workers (the TCP ring) runs without;
 * one all-reduce of a count over comm (world ranks) decides. Over NCCL
 * every rank is on a device and overlaps in stream order instead
 * (zt_zero_opts_t.stream_overlap, from the spec alone: the same on every
 * rank). *overlap receives the choice; -1 when the all-reduce failed. */
ZT_MUST_CHECK int zt_zero_agree_overlap(zt_comm_t *comm, int world, int want, int dev,
                                        int64_t timeout_ms, int *overlap);

/* Lays out this rank's model states in the kernel table's memory, points
 * the model's units at them and installs the ZeRO hooks on the model; the
 * new state in *out. The model must have been created with
 * ZT_MODEL_NO_PARAMS | ZT_MODEL_NO_GRADS; it stays the caller's. -1 when
 * out of (device or host) memory, with whatever was allocated freed again
 * (*out NULL: nothing to free for the caller). */
ZT_MUST_CHECK int zt_zero_create(zt_zero_t **out, zt_model_t *m, const zt_kernels_t *k,
                                 zt_comm_t *comm, const zt_zero_opts_t *o);
/* Stops the communication thread, takes the hooks off the model and frees
 * the state; nothing for NULL. */
void zt_zero_free(zt_zero_t *z);

/* The layout and the way collectives run (zt_zero_view_t); valid until
 * zt_zero_free. */
const zt_zero_view_t *zt_zero_view(const zt_zero_t *z);
/* A collective inside forward or backward failed (zt_zero_micro_end
 * reports it): a model step that failed with this set failed for it. */
int zt_zero_failed(const zt_zero_t *z);
/* What the training thread has waited for collectives (reductions and
 * gathers, ms) since the last zt_zero_take_times; resets nothing. */
double zt_zero_waited_ms(const zt_zero_t *z);
/* Counts `bytes` of parameters that ZeRO does not hold (LoRA's frozen
 * base) with the model states of the memory report. */
void zt_zero_count_params(zt_zero_t *z, uint64_t bytes);

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
/* The Adam state m and v over the owned layout (shard_total floats each,
 * unit u's at off_shard[u]) to or from host memory: stages 1-3 keep
 * exactly that, stage 0 only for a rank alone (it keeps the whole state on
 * every rank; -1 otherwise). For DiLoCo's kept rounds (diloco.h). */
ZT_MUST_CHECK int zt_zero_adam_get(zt_zero_t *z, float *m, float *v);
ZT_MUST_CHECK int zt_zero_adam_put(zt_zero_t *z, const float *m, const float *v);
/* Stage 0, where every rank holds the whole state: its fp32 master and
 * Adam m and v in the logical layout (unit after unit, each of its real
 * size, no padding: zt_zero_full_floats() floats each), whatever the world
 * size, so that a rank of another generation can take them (the state a
 * failed generation's survivors keep in memory: trainer.h, zt_live_t).
 * The get, on a rank whose generation failed, first settles the last
 * step's update, which is all or none (zero.c, adamw_replicated): with
 * overlap each unit's is deferred to the hook before its next forward, so
 * it applies those still due when every gathered gradient arrived (0),
 * and says the state is the step before's when one did not (1). It runs
 * no collective. The put, on a rank of the new generation, sets its
 * whole state (no collective: each rank that holds the state puts its
 * own). -1 at stages 1-3. */
size_t zt_zero_full_floats(const zt_zero_t *z);
ZT_MUST_CHECK int zt_zero_full_get(zt_zero_t *z, float *p, float *m, float *v); /* 0, 1, -1 */
ZT_MUST_CHECK int zt_zero_full_put(zt_zero_t *z, const float *p, const float *m, const float *v);
/* Stage 0: every rank takes rank root's whole state (a collective; the
 * ranks of a new generation that do not hold the state root put). */
ZT_MUST_CHECK int zt_zero_full_broadcast(zt_zero_t *z, int root);
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
