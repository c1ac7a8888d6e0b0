/*
 * device.h: choosing the kernel table for a device ("cpu", "cuda:N").
 *
 * The CPU binaries do not link the CUDA kernels: libzt_kernels_cuda.so
 * (kernels/cuda/, which brings cuBLASLt) is opened with dlopen when a
 * generation is to run on a GPU (`zworker --device cuda:N`, `zsolo
 * --device cuda:N`), so the same binaries run on machines without CUDA. The
 * library is looked up in $ZT_CUDA_KERNELS (a path), then next to the
 * binary (<bin>/../lib/, the build tree's and the install's layout), then
 * on the loader's path.
 *
 * This loader belongs to the kernel layer because both the trainer
 * (engine/) and the worker daemon (worker/) select devices.
 */
#ifndef ZT_DEVICE_H
#define ZT_DEVICE_H

#include <stdint.h>

#include "zt_kernels.h"

/* Parses "cpu", "cuda" or "cuda:N": returns -1 for the CPU, N for a GPU,
 * -2 (with an error) for anything else. */
int zt_device_parse(const char *device);

/* The kernel table for `device`, bf16 != 0 for bf16.enabled: the fast CPU
 * table for "cpu" (fp32 whatever bf16 says), or NULL; for "cuda:N" the CUDA
 * table on GPU N, with bf16 its bf16-storage table (zt_kernels.h: bf16
 * activations and parameter copies, bf16 products with fp32 accumulation). NULL with an error naming the cause (bad name, library
 * not found, no such device, no driver). The CUDA library is loaded and
 * initialised once per process; later calls must name the same device. */
const zt_kernels_t *zt_device_kernels(const char *device, int bf16);

/* The memory of the GPU `device` names, in bytes (loading and initialising
 * the CUDA library as zt_device_kernels does); 0 for "cpu", and 0 with an
 * error when the GPU cannot be used. */
uint64_t zt_device_memory(const char *device);

#endif
