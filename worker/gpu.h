/*
 * gpu.h: the CUDA kernel table for zworker and zsolo, loaded at run time.
 *
 * The CPU binaries do not link the CUDA kernels: libzt_kernels_cuda.so
 * (kernels/cuda/, which brings cuBLASLt) is opened with dlopen when a
 * generation is to run on a GPU (`zworker --device cuda:N`), so the same
 * zworker runs on machines without CUDA. The library is looked up in
 * $ZT_CUDA_KERNELS (a path), then next to the binary (<bin>/../lib/, the
 * build tree's and the install's layout), then on the loader's path.
 */
#ifndef ZT_GPU_H
#define ZT_GPU_H

#include "zt_kernels.h"

/* Parses "cpu", "cuda" or "cuda:N": returns -1 for the CPU, N for a GPU,
 * -2 (with an error) for anything else. */
int zt_gpu_parse_device(const char *device);

/* The CUDA kernel table on device `index` with bf16 (bf16 != 0) or fp32
 * tensor products; NULL with an error naming the cause (library not found,
 * no such device, no driver). Loads and initialises once per process; later
 * calls must name the same device. */
const zt_kernels_t *zt_gpu_kernels(int index, int bf16);

#endif
