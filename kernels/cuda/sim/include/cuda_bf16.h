/*
 * cuda_bf16.h of the CPU stand-in (kernels/cuda/sim/; docs/gpu.md, "The CPU
 * stand-in"). Tests only: the part of the toolkit's header that
 * kernels/cuda/ uses, the bf16 storage type and its two
 * conversions, with the toolkit's rounding: float to bf16 to nearest, ties
 * to even, NaN kept a NaN; bf16 to float exact.
 */
#ifndef ZT_SIM_CUDA_BF16_H
#define ZT_SIM_CUDA_BF16_H

#include <stdint.h>
#include <string.h>

#include "cuda_runtime.h"

struct __nv_bfloat16 {
  uint16_t zt_bits; /* the upper half of an IEEE fp32 */
};

static inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu))
    u |= 0x00400000u; /* a NaN stays a (quiet) NaN */
  else
    u += 0x7fffu + ((u >> 16) & 1u);
  __nv_bfloat16 h;
  h.zt_bits = (uint16_t)(u >> 16);
  return h;
}

static inline float __bfloat162float(__nv_bfloat16 h) {
  uint32_t u = (uint32_t)h.zt_bits << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

#endif
