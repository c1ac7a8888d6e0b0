/*
 * memplan.h: what one rank of a job needs of a worker's memory.
 *
 * The coordinator admits a job only to workers that can hold it, and a
 * worker checks the same figure against its own budget before allocating,
 * so a job that does not fit fails with "out of memory" instead of a worker
 * killed by the kernel. The figure is computed from the same tables the
 * trainer allocates from: the ZeRO layout of zero.c (docs/zero.md: every
 * buffer of the stage, padding and the in-flight buffers included) and the
 * model's activation list (activations.h), for one micro-batch.
 *
 *   states       parameters, gradients (fp32 and the fp64 sum), Adam m and
 *                v, in-flight buffers: as zero.c lays them out for the stage
 *                and the world size
 *   activations  one micro-batch of seq_len tokens, inputs and targets
 *   snapshot     the checkpoint writer's host copy of the owned shard
 *                (p, m, v), when the job writes checkpoints
 *   base         the process itself (libraries, threads, gRPC, data maps):
 *                ZT_MEMPLAN_BASE_BYTES
 *
 * A CPU worker holds everything in host memory. A GPU worker holds states
 * and activations in device memory, plus ZT_MEMPLAN_DEVICE_BASE_BYTES for the
 * CUDA context and cuBLASLt workspace; in host memory the base, the
 * snapshot and, while a checkpoint loads, host copies of the states. With
 * bf16.enabled a GPU worker stores activations and its working copy of
 * the parameters in bf16 next to an fp32 master (zero.h, docs/zero.md):
 * dev_states and dev_activations are its figures, states and activations
 * the fp32 ones of a CPU worker.
 */
#ifndef ZT_MEMPLAN_H
#define ZT_MEMPLAN_H

#include <stddef.h>
#include <stdint.h>

#include "spec.h"

/* ZeRO's shard of a unit of n elements over `world` ranks: ceil(n / world)
 * rounded up to ZT_ZERO_SHARD_ALIGN elements, so that every unit and shard
 * starts 16-byte aligned in fp32 and in bf16 buffers alike, whatever the
 * world size (matmuls then see the same alignments, and cuBLASLt the same
 * algorithms, on every world size). engine/zero.c lays out by it and this
 * file's estimate counts by it. */
#define ZT_ZERO_SHARD_ALIGN 8
static inline size_t zt_zero_shard_size(size_t n, size_t world) {
  size_t s = (n + world - 1) / world;
  return (s + ZT_ZERO_SHARD_ALIGN - 1) / ZT_ZERO_SHARD_ALIGN * ZT_ZERO_SHARD_ALIGN;
}

#define ZT_MEMPLAN_BASE_BYTES (128ull << 20)
#define ZT_MEMPLAN_DEVICE_BASE_BYTES (512ull << 20)

typedef struct {
  uint64_t states, activations, snapshot;
  uint64_t dev_states, dev_activations; /* a GPU worker's (bf16 storage if the spec says) */
  uint64_t host;   /* what a CPU worker needs: everything */
  uint64_t device; /* what a GPU worker needs of its device memory */
  uint64_t host_with_device; /* ... and of its host memory */
} zt_memplan_need_t;

/* The per-rank need of spec s on `world` ranks; -1 when the model is
 * invalid (the spec parser already refuses such specs). */
ZT_MUST_CHECK int zt_memplan_need(const zt_spec_t *s, int world, zt_memplan_need_t *out);

/* The states and activations of one rank as it really runs: overlap
 * thread or not, a working copy of xbytes (4, or 2 for bf16 storage),
 * NCCL collectives or not (on a device). */
ZT_MUST_CHECK int zt_memplan_rank(const zt_spec_t *s, int world, int overlap, int xbytes,
                                  int nccl, uint64_t *states, uint64_t *acts);

/* Whether a worker with host_bytes of RAM and device_bytes of GPU memory
 * (0: a CPU worker) can hold one rank; 0 bytes of RAM means "not said" and
 * fits. */
int zt_memplan_fits(const zt_memplan_need_t *n, uint64_t host_bytes, uint64_t device_bytes);

/* "1.50 GiB": bytes for messages. */
const char *zt_memplan_text(uint64_t bytes, char *buf, size_t n);

#endif
