/*
 * zt_sim_ptx.h of the CPU stand-in (kernels/cuda/sim/; docs/gpu.md, "The
 * CPU stand-in"). Tests only: the two warp-wide PTX instructions that
 * kernels/cuda/fa2.cu reaches through inline assembly when nvcc builds it,
 * as functions of the same names and arguments as its wrappers:
 *
 *   zt_ptx_mma(d, a, b)      mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
 *                            d (16 x 8 fp32) += a (16 x 16 bf16) b (16 x 8 bf16)
 *   zt_ptx_ldsm4(r, p)       ldmatrix.sync.aligned.m8n8.x4.shared.b16
 *   zt_ptx_ldsm4t(r, p)      the same with .trans
 *
 * These instructions define how a tile's elements are spread over the
 * lanes (unlike CUDA's warp matrix functions, nvcuda::wmma, whose fragment
 * layout is unspecified), and kernels depend on it: each
 * lane holds only its share, in registers of two bf16 (the lower column in
 * the lower 16 bits). With g = lane / 4 and c = lane % 4 (PTX ISA, "Matrix
 * fragments for mma.m16n8k16"):
 *
 *   a[0] = A[g][2c, 2c+1]     a[1] = A[g+8][2c, 2c+1]
 *   a[2] = A[g][2c+8, 2c+9]   a[3] = A[g+8][2c+8, 2c+9]
 *   b[0] = B[2c, 2c+1][g]     b[1] = B[2c+8, 2c+9][g]
 *   d[0], d[1] = D[g][2c, 2c+1]   d[2], d[3] = D[g+8][2c, 2c+1]
 *
 * and ldmatrix: lanes 8i .. 8i+7 give the addresses of rows 0-7 of matrix
 * i (8 x 8 b16, a row 16 contiguous bytes); each lane receives r[i] =
 * M_i[g][2c, 2c+1], or with .trans M_i[2c][g] and M_i[2c+1][g].
 *
 * Each call is one warp exchange that every lane of the warp must make (a
 * lane that has left the kernel is named), as the hardware's .aligned
 * instructions require. The products are fp32 sums in k order after the
 * accumulator (the tensor cores' order and internal precision differ, so
 * tests compare with tolerances). A row address that is not 16-byte
 * aligned ends the process, as it faults on the hardware.
 */
#ifndef ZT_SIM_PTX_H
#define ZT_SIM_PTX_H

#include <stdint.h>
#include <string.h>

#include "cuda_bf16.h"
#include "cuda_runtime.h"

namespace zt_sim {
namespace ptx {

/* The bf16 in half `half` of register `reg` of a lane's exchanged slot. */
static inline float bf16_at(const unsigned char *slot, int reg, int half) {
  __nv_bfloat16 h;
  memcpy(&h, slot + 4 * reg + 2 * half, 2); /* x86-64: the lower half first */
  return __bfloat162float(h);
}

}  // namespace ptx
}  // namespace zt_sim

/* d += a b on one m16n8k16 tile (see above). */
static inline void zt_ptx_mma(float d[4], const unsigned a[4], const unsigned b[2]) {
  zt_sim::require_full_warp("", "mma.sync.m16n8k16");
  int lane = 0;
  unsigned char as[32][16], bs[32][16];
  memcpy(as, zt_sim::warp_exchange(0xffffffffu, a, 16, &lane), sizeof as);
  memcpy(bs, zt_sim::warp_exchange(0xffffffffu, b, 8, &lane), sizeof bs);
  int g = lane / 4, c = lane % 4;
  float out[4];
  for (int i = 0; i < 4; i++) {
    int row = g + (i >= 2 ? 8 : 0), col = 2 * c + (i & 1);
    float s = d[i];
    for (int k = 0; k < 16; k++) {
      /* A[row][k]: lane (row % 8) * 4 + (k % 8) / 2, register (row >= 8) + 2 (k >= 8);
       * B[k][col]: lane col * 4 + (k % 8) / 2, register (k >= 8). */
      float x = zt_sim::ptx::bf16_at(as[(row % 8) * 4 + (k % 8) / 2], (row >= 8) + 2 * (k >= 8),
                                     k & 1);
      float y = zt_sim::ptx::bf16_at(bs[col * 4 + (k % 8) / 2], k >= 8, k & 1);
      s += x * y;
    }
    out[i] = s;
  }
  for (int i = 0; i < 4; i++) d[i] = out[i];
}

static inline void zt_sim_ldsm4(unsigned r[4], const void *p, int trans, const char *what) {
  zt_sim::require_full_warp("", what);
  if ((uintptr_t)p % 16 != 0) zt_sim::fatal("%s: row address %p is not 16-byte aligned", what, p);
  int lane = 0;
  const unsigned char *slots = zt_sim::warp_exchange(0xffffffffu, &p, sizeof p, &lane);
  int g = lane / 4, c = lane % 4;
  for (int i = 0; i < 4; i++) {
    const uint16_t *row[8];
    for (int j = 0; j < 8; j++) memcpy(&row[j], slots + 16 * (8 * i + j), sizeof row[j]);
    uint16_t lo = trans ? row[2 * c][g] : row[g][2 * c];
    uint16_t hi = trans ? row[2 * c + 1][g] : row[g][2 * c + 1];
    r[i] = (unsigned)lo | (unsigned)hi << 16;
  }
}
static inline void zt_ptx_ldsm4(unsigned r[4], const void *p) {
  zt_sim_ldsm4(r, p, 0, "ldmatrix.x4");
}
static inline void zt_ptx_ldsm4t(unsigned r[4], const void *p) {
  zt_sim_ldsm4(r, p, 1, "ldmatrix.x4.trans");
}

#endif
