/*
 * zt_kernels_cuda.h: the CUDA kernel table, its initialisation and the few
 * device facts and controls that code outside kernels/cuda needs (device
 * name and memory, matmul precision, stream synchronisation). Device memory
 * and copies go through the table itself (alloc, upload, ...).
 *
 * zt_kernels_cuda() returns a zt_kernels_t (kernels/zt_kernels.h) whose
 * functions take DEVICE pointers and compute what the functions of the same
 * name in kernels/cpu/ref.c compute, under the same contract (which outputs
 * are overwritten, which gradients accumulate, which arguments may alias).
 * Everything runs in order on one CUDA stream owned by this module; a
 * function returns once its work is queued, except sumsq, which returns a
 * value and therefore waits.
 *
 * Determinism: no kernel uses floating-point atomics. Column sums (bias and
 * LayerNorm weight gradients) are formed in fixed row chunks combined in
 * order; the token-embedding gradient sorts the token positions with a
 * stable radix sort and sums each token's rows in position order, so the
 * result is bit-identical to the serial reference for that kernel. Two runs
 * on the same GPU give identical results.
 *
 * Matmuls go through cuBLASLt (bias fused as an epilogue in the forward).
 * zt_kernels_cuda_set_math selects the matmul precision: exact fp32, TF32 or
 * bf16 tensor cores (fp32 storage and accumulation; inputs rounded to
 * bf16 inside the product). Attention takes flash attention 2 (mma.sync
 * tensor-core kernels that never form the T x T scores) with bf16 storage
 * and head sizes 16, 32, 48, 64 and 128, and strided-batched cuBLASLt
 * products over the heads with a warp-per-row causal softmax, the T x T
 * matrices in scratch, everywhere else.
 *
 * Errors: every CUDA and cuBLAS call is checked; a failure prints the call,
 * the file:line and the library's message and ends the process (exit 1), as
 * a device error leaves the context unusable. zt_kernels_cuda_init is the one
 * call that fails softly (no GPU, no driver): it returns -1 with a message.
 *
 * This header is plain C so that C code and tests can use it without the
 * CUDA headers.
 */
#ifndef ZT_KERNELS_CUDA_H
#define ZT_KERNELS_CUDA_H

#include <stddef.h>
#include <stdio.h>

#include "zt_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  ZT_CUDA_MATH_FP32 = 0, /* IEEE fp32 products (matches the CPU kernels) */
  ZT_CUDA_MATH_TF32 = 1, /* TF32 tensor cores, fp32 accumulate */
  ZT_CUDA_MATH_BF16 = 2  /* bf16 tensor cores, fp32 accumulate */
} zt_cuda_math_t;

/* Number of usable CUDA devices; 0 when there is no GPU or no driver. */
int zt_cuda_device_count(void);

/* Selects device `device`, creates the stream and the cuBLASLt handle.
 * Returns 0, or -1 with a message in err (no device, bad index, driver too
 * old). Idempotent for the same device; every thread that launches work
 * calls it once (it makes the device current for the calling thread). */
int zt_kernels_cuda_init(int device, char *err, size_t errlen);

/* The kernel table (zt_kernels_cuda_init must have succeeded): fp32 storage.
 * zt_kernels_cuda_bf16: the same kernels with bf16 storage (zt_kernels.h,
 * xbytes 2), their products on cuBLASLt's bf16 kernels with fp32
 * accumulation whatever zt_kernels_cuda_set_math says. */
const zt_kernels_t *zt_kernels_cuda(void);
const zt_kernels_t *zt_kernels_cuda_bf16(void);

void zt_kernels_cuda_set_math(zt_cuda_math_t math);
zt_cuda_math_t zt_kernels_cuda_math(void);

/* The attention path. 1 (the default): with bf16 storage, attention runs
 * on the flash-attention-2 kernels (bf16 products on the tensor cores,
 * mma.sync and ldmatrix, one pass of online softmax in registers, the
 * probabilities and ds rounded to bf16 as flash attention does; no T x T
 * matrix) wherever the head size is 16, 32, 48, 64 or 128 and the rows
 * are 16-byte aligned; everything else takes the cuBLASLt path. 0: every
 * call takes the cuBLASLt path (for comparisons). */
void zt_kernels_cuda_set_attention_fa2(int on);

/* The profile: on (1), every kernel table call that queues device work,
 * and every cuBLASLt product inside one, is timed with events on the
 * stream (calls through both tables; on again starts afresh); off (0) stops
 * timing. The report waits for the stream and prints the times summed by
 * table function and by product shape, largest first. For benchmarks
 * (zt_gpubench --profile): a timed call waits for nothing, but its events
 * cost a little. */
void zt_kernels_cuda_profile(int on);
void zt_kernels_cuda_profile_report(FILE *f);

/* 1 (the default): matmul_gelu_forward and matmul_backward_dgelu run GELU
 * in cuBLASLt's epilogue where it has a kernel for the shape; 0: they make
 * the product and the GELU call one after the other (for comparisons). */
void zt_kernels_cuda_set_gelu_epilogue(int on);

/* Device memory in use on this process's device, all processes (bytes). */
size_t zt_cuda_device_memory_used(void);

/* Device name and memory, for logs ("NVIDIA H100 80GB HBM3", bytes). */
const char *zt_cuda_device_name(void);
size_t zt_cuda_device_memory(void);

/* Waits for all work queued on the module's stream (device memory and
 * copies go through the table: alloc, release, upload, download). */
void zt_cuda_sync(void);

#ifdef __cplusplus
}
#endif

#endif
