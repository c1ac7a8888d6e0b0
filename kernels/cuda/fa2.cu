/*
 * fa2.cu: flash attention 2 (Dao, 2023), the attention path of bf16
 * storage wherever it applies (attention.cu chooses: head sizes 16, 32,
 * 48, 64 and 128, Llama's; 16-byte aligned rows). Causal, grouped K/V
 * heads read in place; no T x T matrix is formed, not even in scratch.
 * q, k, v are read where they lie in qkv [B,T,(NH+2KV)hs] and out is
 * written in [B,T,NH hs], so no permutation kernels run either.
 *
 * The products run on the tensor cores' own instructions, mma.sync.m16n8k16
 * and ldmatrix, whose register layouts PTX defines
 * (kernels/cuda/sim/include/zt_sim_ptx.h spells them out), and so
 * everything of a warp's 16 rows stays in registers:
 *
 *   - forward: a block of FA2_WARPS warps takes FA2_BM query rows, q held
 *     as A fragments; K and V tiles of FA2_BN keys stream through shared
 *     memory; the scores' accumulators are scaled, masked and
 *     exponentiated where they are (one pass of online softmax, row maxima
 *     and sums over the 4 lanes that share a row), rescale the output
 *     accumulators, and become the A fragments of p v without leaving the
 *     registers (the accumulators of two 8-key tiles are an A fragment's
 *     layout). Tiles past the diagonal are never loaded.
 *   - backward: two kernels so that no two blocks add into one gradient
 *     (no atomics: the same bits on every run): dk and dv of a block of
 *     keys (their K and V held as A fragments, query tiles and dout
 *     streaming by, s^T and dp^T recomputed), and dq of a block of queries
 *     (q and dout held, K and V streaming by), each recomputing
 *     p = exp(s - lse) and ds = p (dp - D) with D = rowsum(dout * out)
 *     formed first per row.
 *
 * Probabilities and ds are rounded to bf16 once, as operands of the second
 * product, as flash attention does; exponentials are exp2f of scores
 * prescaled by log2(e). lse is written in natural units, as the cuBLASLt
 * path does, so either backward takes either forward's lse.
 */
#include "common.cuh"

#ifdef __CUDACC__
/* d += a b: one 16 x 8 x 16 tile, bf16 operands, fp32 accumulators. */
__device__ __forceinline__ void zt_ptx_mma(float d[4], const unsigned a[4], const unsigned b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
/* Four 8 x 8 b16 matrices from shared memory, this lane's row address p. */
__device__ __forceinline__ void zt_ptx_ldsm4(unsigned r[4], const void *p) {
  unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void zt_ptx_ldsm4t(unsigned r[4], const void *p) {
  unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
#else
#include "zt_sim_ptx.h" /* the stand-in's versions, same names */
#endif

/* Loops over the register arrays are unrolled so that the arrays stay in
 * registers (nvcc; the CPU stand-in compiles this file with g++). */
#ifdef __CUDACC__
#define ZT_UNROLL _Pragma("unroll")
#else
#define ZT_UNROLL
#endif

#define FA2_WARPS 4
#define FA2_BM (16 * FA2_WARPS) /* query rows of a block, keys of a backward block */
#define FA2_BN 64               /* rows of a streamed tile */
#define FA2_NT (FA2_BN / 8)     /* 8-column accumulator tiles across a streamed tile */
#define FA2_LOG2E 1.4426950408889634f
#define FA2_LN2 0.6931471805599453f
#define FA2_FULL 0xffffffffu

/* Two floats as one register of two bf16, the first in the lower half. */
__device__ __forceinline__ unsigned fa2_pack(float lo, float hi) {
  bf16 a = __float2bfloat16(lo), b = __float2bfloat16(hi);
  unsigned short ua, ub;
  memcpy(&ua, &a, 2);
  memcpy(&ub, &b, 2);
  return (unsigned)ua | (unsigned)ub << 16;
}

/* 16 bytes: one vector access, and the element of the shared tiles (which
 * ldmatrix wants 16-byte aligned). */
struct alignas(16) fa2_v16 {
  unsigned x[4];
};

/* Rows [t0, t0 + n) of a [T, hs] bf16 slice (row stride rs) into dst (row
 * stride ld), 16 bytes at a time; rows at or past T read as 0. */
__device__ __forceinline__ void rows_load(bf16 *dst, int ld, const bf16 *src, size_t rs, int t0,
                                          int n, int T, int hs) {
  int per = hs / 8;
  for (int e = threadIdx.x; e < n * per; e += blockDim.x) {
    int r = e / per, c = (e % per) * 8;
    fa2_v16 v = {{0, 0, 0, 0}};
    if (t0 + r < T) v = *(const fa2_v16 *)(src + (size_t)(t0 + r) * rs + c);
    *(fa2_v16 *)(dst + r * ld + c) = v;
  }
}

/* rows_load into a tile of row stride HS + 8, so that ldmatrix's 8 rows
 * fall in different banks. */
template <int HS>
__device__ __forceinline__ void fa2_load(bf16 *dst, const bf16 *src, size_t rs, int t0, int n,
                                         int T) {
  rows_load(dst, HS + 8, src, rs, t0, n, T, HS);
}

/* The A fragments (16 rows x HS) of rows [0, 16) of a shared tile. Lanes
 * 8i .. 8i+7 address rows 0-7 (i even) or 8-15 (i odd) at column 0 (i < 2)
 * or 8: the registers a[0..3] of mma's A layout. */
template <int HS>
__device__ __forceinline__ void fa2_rows(unsigned (&a)[HS / 16][4], const bf16 *tile, int lane) {
  constexpr int LD = HS + 8;
  ZT_UNROLL
  for (int kk = 0; kk < HS / 16; kk++)
    zt_ptx_ldsm4(a[kk], tile + ((lane & 8) + (lane & 7)) * LD + (lane & 16) / 2 + 16 * kk);
}

/* s (16 x FA2_BN fp32 accumulators) = a (16 x HS) times the transpose of
 * tile (FA2_BN x HS, shared). The B operand of an 8-column tile is 8 of the
 * tile's rows, k along them: ldmatrix without .trans, two 8-row tiles a
 * call (b[0..1] for rows n, b[2..3] for rows n + 8). */
template <int HS>
__device__ __forceinline__ void fa2_scores(float (&s)[FA2_NT][4], const unsigned (&a)[HS / 16][4],
                                           const bf16 *tile, int lane) {
  constexpr int LD = HS + 8;
  ZT_UNROLL
  for (int j = 0; j < FA2_NT; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
  const bf16 *t = tile + ((lane & 16) / 2 + (lane & 7)) * LD + (lane & 8);
  ZT_UNROLL
  for (int kk = 0; kk < HS / 16; kk++) {
    ZT_UNROLL
    for (int jp = 0; jp < FA2_NT / 2; jp++) {
      unsigned b[4];
      zt_ptx_ldsm4(b, t + 16 * jp * LD + 16 * kk);
      zt_ptx_mma(s[2 * jp], a[kk], b);
      zt_ptx_mma(s[2 * jp + 1], a[kk], b + 2);
    }
  }
}

/* acc (16 x HS) += p (16 x FA2_BN, accumulators rounded to bf16) times tile
 * (FA2_BN x HS, shared). p's accumulators for columns 16kk .. 16kk+15 are
 * the A fragment of step kk as they lie; the B operand, k down the tile's
 * rows, comes through ldmatrix.trans. */
template <int HS>
__device__ __forceinline__ void fa2_accum(float (&acc)[HS / 8][4], const float (&p)[FA2_NT][4],
                                          const bf16 *tile, int lane) {
  constexpr int LD = HS + 8;
  const bf16 *t = tile + ((lane & 8) + (lane & 7)) * LD + (lane & 16) / 2;
  ZT_UNROLL
  for (int kk = 0; kk < FA2_NT / 2; kk++) {
    unsigned a[4] = {fa2_pack(p[2 * kk][0], p[2 * kk][1]), fa2_pack(p[2 * kk][2], p[2 * kk][3]),
                     fa2_pack(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                     fa2_pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
    ZT_UNROLL
    for (int dp = 0; dp < HS / 16; dp++) {
      unsigned b[4];
      zt_ptx_ldsm4t(b, t + 16 * kk * LD + 16 * dp);
      zt_ptx_mma(acc[2 * dp], a, b);
      zt_ptx_mma(acc[2 * dp + 1], a, b + 2);
    }
  }
}

/* Rows r and r + 8 (this lane's, g = lane / 4) of acc * scale into the rows
 * of a bf16 array (row stride rs) that lie below T, two columns a store. */
template <int HS>
__device__ __forceinline__ void fa2_store(bf16 *base, size_t rs, int r, int T,
                                          const float (&acc)[HS / 8][4], float s0, float s1,
                                          int lane) {
  int c = 2 * (lane % 4);
  ZT_UNROLL
  for (int hh = 0; hh < 2; hh++) {
    if (r + 8 * hh >= T) continue;
    unsigned *o = (unsigned *)(base + (size_t)(r + 8 * hh) * rs + c);
    float sc = hh ? s1 : s0;
    ZT_UNROLL
    for (int d = 0; d < HS / 8; d++)
      o[4 * d] = fa2_pack(acc[d][2 * hh] * sc, acc[d][2 * hh + 1] * sc);
  }
}

template <int HS>
__device__ __forceinline__ void fa2_zero(float (&acc)[HS / 8][4]) {
  ZT_UNROLL
  for (int d = 0; d < HS / 8; d++) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.0f;
}

template <int HS>
__global__ void __launch_bounds__(FA2_WARPS * 32)
    k_fa2_fwd(bf16 *out, float *lse, const bf16 *qkv, int T, int NH, int KV, float sl2) {
  constexpr int LD = HS + 8;
  __shared__ fa2_v16 ks_[FA2_BN * LD / 8];
  __shared__ fa2_v16 vs_[FA2_BN * LD / 8];
  bf16 *ks = (bf16 *)ks_, *vs = (bf16 *)vs_;
  int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  int q0 = (gridDim.x - 1 - blockIdx.x) * FA2_BM; /* the longest blocks first */
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  int r0 = q0 + warp * 16;
  size_t rs = att_rs(NH, KV, HS);
  const bf16 *base = qkv + (size_t)b * T * rs, *kb = base + att_koff(h, NH, KV, HS);
  const bf16 *vb = kb + (size_t)KV * HS;
  fa2_load<HS>(ks, base + (size_t)h * HS, rs, q0, FA2_BM, T); /* q passes through ks */
  __syncthreads();
  unsigned qf[HS / 16][4];
  fa2_rows<HS>(qf, ks + warp * 16 * LD, lane);
  float o[HS / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  fa2_zero<HS>(o);
  int kend = min(T, q0 + FA2_BM);
  for (int k0 = 0; k0 < kend; k0 += FA2_BN) {
    __syncthreads(); /* q, or the previous tile, is no longer read */
    fa2_load<HS>(ks, kb, rs, k0, FA2_BN, T);
    fa2_load<HS>(vs, vb, rs, k0, FA2_BN, T);
    __syncthreads();
    float s[FA2_NT][4];
    fa2_scores<HS>(s, qf, ks, lane);
    /* Key k0 lies at or before every row of the block, so each row's
     * maximum is finite from the first tile on. */
    bool edge = k0 + FA2_BN - 1 > r0 || k0 + FA2_BN > T;
    float mx[2] = {-INFINITY, -INFINITY};
    ZT_UNROLL
    for (int j = 0; j < FA2_NT; j++)
      ZT_UNROLL
      for (int e = 0; e < 4; e++) {
        int key = k0 + 8 * j + 2 * c + (e & 1), row = r0 + g + 8 * (e >> 1);
        float x = s[j][e] * sl2;
        if (edge && (key > row || key >= T)) x = -INFINITY;
        s[j][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float corr[2];
    ZT_UNROLL
    for (int hh = 0; hh < 2; hh++) {
      mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(FA2_FULL, mx[hh], 1));
      mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(FA2_FULL, mx[hh], 2));
      float mn = fmaxf(m[hh], mx[hh]);
      corr[hh] = exp2f(m[hh] - mn);
      m[hh] = mn;
      l[hh] *= corr[hh];
    }
    ZT_UNROLL
    for (int j = 0; j < FA2_NT; j++)
      ZT_UNROLL
      for (int e = 0; e < 4; e++) {
        s[j][e] = exp2f(s[j][e] - m[e >> 1]);
        l[e >> 1] += s[j][e];
      }
    ZT_UNROLL
    for (int d = 0; d < HS / 8; d++) {
      o[d][0] *= corr[0], o[d][1] *= corr[0];
      o[d][2] *= corr[1], o[d][3] *= corr[1];
    }
    fa2_accum<HS>(o, s, vs, lane);
  }
  ZT_UNROLL
  for (int hh = 0; hh < 2; hh++) {
    l[hh] += __shfl_xor_sync(FA2_FULL, l[hh], 1);
    l[hh] += __shfl_xor_sync(FA2_FULL, l[hh], 2);
  }
  fa2_store<HS>(out + (size_t)b * T * NH * HS + (size_t)h * HS, (size_t)NH * HS, r0 + g, T, o,
                1.0f / l[0], 1.0f / l[1], lane);
  ZT_UNROLL
  for (int hh = 0; hh < 2; hh++) {
    int row = r0 + g + 8 * hh;
    if (c == 0 && row < T) lse[(size_t)bh * T + row] = (m[hh] + log2f(l[hh])) * FA2_LN2;
  }
}

/* D [B,NH,T] = rowsum(dout * out) per head, one warp per row. */
__global__ void k_fa2_row_d(float *D, const bf16 *dout, const bf16 *out, int B, int T, int C,
                            int NH) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= B * NH * T) return;
  int hs = C / NH, bh = row / T, i = row % T, b = bh / NH, h = bh % NH;
  size_t off = ((size_t)b * T + i) * C + (size_t)h * hs;
  float s = 0.0f;
  for (int d = lane; d < hs; d += 32) s += ldx(dout[off + d]) * ldx(out[off + d]);
  s = warp_sum(s);
  if (lane == 0) D[row] = s;
}

/* lse (times lscale) and D of rows [t0, t0 + n) of head bh into ls and
 * dsh (0 past T), by the block's first n threads. */
__device__ __forceinline__ void fa2_row_stats(float *ls, float *dsh, const float *lse,
                                              const float *D, int bh, int T, int t0, int n,
                                              float lscale) {
  if ((int)threadIdx.x < n) {
    int i = t0 + threadIdx.x;
    ls[threadIdx.x] = i < T ? lse[(size_t)bh * T + i] * lscale : 0.0f;
    dsh[threadIdx.x] = i < T ? D[(size_t)bh * T + i] : 0.0f;
  }
}

/* dq of FA2_BM query rows: q and dout held as A fragments, the K and V
 * tiles at and before them streaming by. */
template <int HS>
__global__ void __launch_bounds__(FA2_WARPS * 32)
    k_fa2_bwd_q(bf16 *dqkv, const bf16 *qkv, const bf16 *dout, const float *lse, const float *D,
                int T, int NH, int KV, float scale, float sl2) {
  constexpr int LD = HS + 8;
  __shared__ fa2_v16 ks_[FA2_BN * LD / 8];
  __shared__ fa2_v16 vs_[FA2_BN * LD / 8];
  bf16 *ks = (bf16 *)ks_, *vs = (bf16 *)vs_;
  int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  int q0 = (gridDim.x - 1 - blockIdx.x) * FA2_BM;
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  int r0 = q0 + warp * 16;
  size_t rs = att_rs(NH, KV, HS);
  const bf16 *base = qkv + (size_t)b * T * rs, *kb = base + att_koff(h, NH, KV, HS);
  const bf16 *vb = kb + (size_t)KV * HS;
  fa2_load<HS>(ks, base + (size_t)h * HS, rs, q0, FA2_BM, T);
  fa2_load<HS>(vs, dout + (size_t)b * T * NH * HS + (size_t)h * HS, (size_t)NH * HS, q0, FA2_BM,
               T);
  __syncthreads();
  unsigned qf[HS / 16][4], gf[HS / 16][4];
  fa2_rows<HS>(qf, ks + warp * 16 * LD, lane);
  fa2_rows<HS>(gf, vs + warp * 16 * LD, lane);
  float lr[2], dr[2];
  ZT_UNROLL
  for (int hh = 0; hh < 2; hh++) {
    int row = r0 + g + 8 * hh;
    lr[hh] = row < T ? lse[(size_t)bh * T + row] * FA2_LOG2E : 0.0f;
    dr[hh] = row < T ? D[(size_t)bh * T + row] : 0.0f;
  }
  float dq[HS / 8][4];
  fa2_zero<HS>(dq);
  int kend = min(T, q0 + FA2_BM);
  for (int k0 = 0; k0 < kend; k0 += FA2_BN) {
    __syncthreads();
    fa2_load<HS>(ks, kb, rs, k0, FA2_BN, T);
    fa2_load<HS>(vs, vb, rs, k0, FA2_BN, T);
    __syncthreads();
    float p[FA2_NT][4], dp[FA2_NT][4];
    fa2_scores<HS>(p, qf, ks, lane);
    fa2_scores<HS>(dp, gf, vs, lane);
    bool edge = k0 + FA2_BN - 1 > r0 || k0 + FA2_BN > T;
    ZT_UNROLL
    for (int j = 0; j < FA2_NT; j++)
      ZT_UNROLL
      for (int e = 0; e < 4; e++) {
        int key = k0 + 8 * j + 2 * c + (e & 1), row = r0 + g + 8 * (e >> 1);
        float pe = edge && (key > row || key >= T) ? 0.0f : exp2f(p[j][e] * sl2 - lr[e >> 1]);
        p[j][e] = pe * (dp[j][e] - dr[e >> 1]); /* ds */
      }
    fa2_accum<HS>(dq, p, ks, lane);
  }
  fa2_store<HS>(dqkv + (size_t)b * T * rs + (size_t)h * HS, rs, r0 + g, T, dq, scale, scale,
                lane);
}

/* dk and dv of FA2_BM keys of one K/V head: their K and V held as A
 * fragments, the query tiles at and after them (q, dout, lse and D)
 * streaming by, for each query head of the group in turn. PART 0 computes
 * both; at head size 128 both do not fit a thread's 255 registers, so two
 * launches split them, PART 1 dv (no V fragments, no dp) and PART 2 dk,
 * each recomputing the scores (a quarter more of the backward's products,
 * no spills). */
template <int HS, int PART>
__global__ void __launch_bounds__(FA2_WARPS * 32)
    k_fa2_bwd_kv(bf16 *dqkv, const bf16 *qkv, const bf16 *dout, const float *lse,
                 const float *D, int T, int NH, int KV, float scale, float sl2) {
  constexpr int LD = HS + 8;
  constexpr bool want_dk = PART != 1, want_dv = PART != 2;
  __shared__ fa2_v16 qs_[FA2_BN * LD / 8];
  __shared__ fa2_v16 gs_[FA2_BN * LD / 8];
  __shared__ float ls[FA2_BN];
  __shared__ float dsh[FA2_BN];
  bf16 *qs = (bf16 *)qs_, *gs = (bf16 *)gs_;
  int bk = blockIdx.y, b = bk / KV, kvh = bk % KV, grp = NH / KV;
  int k0 = blockIdx.x * FA2_BM, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int g = lane / 4, c = lane % 4, j0 = k0 + warp * 16;
  size_t rs = att_rs(NH, KV, HS), koff = att_koff(kvh * grp, NH, KV, HS);
  const bf16 *base = qkv + (size_t)b * T * rs;
  fa2_load<HS>(qs, base + koff, rs, k0, FA2_BM, T); /* K and V pass through qs and gs */
  if (want_dk) fa2_load<HS>(gs, base + koff + (size_t)KV * HS, rs, k0, FA2_BM, T);
  __syncthreads();
  unsigned kf[HS / 16][4], vf[HS / 16][4];
  fa2_rows<HS>(kf, qs + warp * 16 * LD, lane);
  if (want_dk) fa2_rows<HS>(vf, gs + warp * 16 * LD, lane);
  float dk[HS / 8][4], dv[HS / 8][4];
  if (want_dk) fa2_zero<HS>(dk);
  if (want_dv) fa2_zero<HS>(dv);
  for (int it = 0, nt = (T - k0 + FA2_BN - 1) / FA2_BN; it < grp * nt; it++) {
    int h = kvh * grp + it / nt, t0 = k0 + (it % nt) * FA2_BN, bh = b * NH + h;
    __syncthreads();
    fa2_load<HS>(qs, base + (size_t)h * HS, rs, t0, FA2_BN, T);
    fa2_load<HS>(gs, dout + (size_t)b * T * NH * HS + (size_t)h * HS, (size_t)NH * HS, t0,
                 FA2_BN, T);
    fa2_row_stats(ls, dsh, lse, D, bh, T, t0, FA2_BN, FA2_LOG2E);
    __syncthreads();
    /* s^T and dp^T: this warp's keys down, the tile's queries across. */
    float p[FA2_NT][4], dp[FA2_NT][4];
    fa2_scores<HS>(p, kf, qs, lane);
    if (want_dk) fa2_scores<HS>(dp, vf, gs, lane);
    bool edge = t0 < j0 + 15 || t0 + FA2_BN > T;
    ZT_UNROLL
    for (int j = 0; j < FA2_NT; j++)
      ZT_UNROLL
      for (int e = 0; e < 4; e++) {
        int qi = 8 * j + 2 * c + (e & 1), key = j0 + g + 8 * (e >> 1);
        p[j][e] = edge && (t0 + qi < key || t0 + qi >= T) ? 0.0f
                                                           : exp2f(p[j][e] * sl2 - ls[qi]);
        if (want_dk) dp[j][e] = p[j][e] * (dp[j][e] - dsh[qi]); /* ds^T */
      }
    if (want_dv) fa2_accum<HS>(dv, p, gs, lane);
    if (want_dk) fa2_accum<HS>(dk, dp, qs, lane);
  }
  bf16 *o = dqkv + (size_t)b * T * rs + koff;
  if (want_dk) fa2_store<HS>(o, rs, j0 + g, T, dk, scale, scale, lane);
  if (want_dv) fa2_store<HS>(o + (size_t)KV * HS, rs, j0 + g, T, dv, 1.0f, 1.0f, lane);
}

/* D = rowsum(dout * out) per head and row, in the attention scratch: the
 * backward's first launch. */
static float *fa2_row_d(const bf16 *dout, const bf16 *out, int B, int T, int C, int NH) {
  int rows = B * NH * T;
  float *D = (float *)scratch(SCR_ATT, (size_t)rows * sizeof(float));
  k_fa2_row_d<<<(rows + 7) / 8, 256, 0, g.stream>>>(D, dout, out, B, T, C, NH);
  ZT_CUDA_LAUNCHED();
  return D;
}

template <int HS>
static void fa2_forward_hs(bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH, int KV) {
  dim3 grid((unsigned)((T + FA2_BM - 1) / FA2_BM), (unsigned)(B * NH));
  k_fa2_fwd<HS><<<grid, FA2_WARPS * 32, 0, g.stream>>>(out, lse, qkv, T, NH, KV,
                                                       FA2_LOG2E / sqrtf((float)HS));
  ZT_CUDA_LAUNCHED();
}

/* One launch of k_fa2_bwd_kv: part PART of dk and dv. */
template <int HS, int PART>
static void fa2_bwd_kv(bf16 *dqkv, const bf16 *dout, const bf16 *qkv, const float *lse,
                       const float *D, int B, int T, int NH, int KV, float scale) {
  dim3 grid((unsigned)((T + FA2_BM - 1) / FA2_BM), (unsigned)(B * KV));
  k_fa2_bwd_kv<HS, PART><<<grid, FA2_WARPS * 32, 0, g.stream>>>(dqkv, qkv, dout, lse, D, T, NH,
                                                                KV, scale, scale * FA2_LOG2E);
  ZT_CUDA_LAUNCHED();
}

template <int HS>
static void fa2_backward_hs(bf16 *dqkv, const bf16 *dout, const bf16 *qkv, const float *lse,
                            const float *D, int B, int T, int NH, int KV) {
  float scale = 1.0f / sqrtf((float)HS);
  unsigned tiles = (unsigned)((T + FA2_BM - 1) / FA2_BM);
  if constexpr (HS <= 64) {
    fa2_bwd_kv<HS, 0>(dqkv, dout, qkv, lse, D, B, T, NH, KV, scale);
  } else { /* dv, then dk (see k_fa2_bwd_kv) */
    fa2_bwd_kv<HS, 1>(dqkv, dout, qkv, lse, D, B, T, NH, KV, scale);
    fa2_bwd_kv<HS, 2>(dqkv, dout, qkv, lse, D, B, T, NH, KV, scale);
  }
  k_fa2_bwd_q<HS><<<dim3(tiles, (unsigned)(B * NH)), FA2_WARPS * 32, 0, g.stream>>>(
      dqkv, qkv, dout, lse, D, T, NH, KV, scale, scale * FA2_LOG2E);
  ZT_CUDA_LAUNCHED();
}

void fa2_forward(bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH, int KV, int hs) {
  switch (hs) {
    case 16: return fa2_forward_hs<16>(out, lse, qkv, B, T, NH, KV);
    case 32: return fa2_forward_hs<32>(out, lse, qkv, B, T, NH, KV);
    case 48: return fa2_forward_hs<48>(out, lse, qkv, B, T, NH, KV);
    case 64: return fa2_forward_hs<64>(out, lse, qkv, B, T, NH, KV);
    default: return fa2_forward_hs<128>(out, lse, qkv, B, T, NH, KV);
  }
}

void fa2_backward(bf16 *dqkv, const bf16 *dout, const bf16 *qkv, const bf16 *out,
                  const float *lse, int B, int T, int NH, int KV, int hs) {
  const float *D = fa2_row_d(dout, out, B, T, NH * hs, NH);
  switch (hs) {
    case 16: return fa2_backward_hs<16>(dqkv, dout, qkv, lse, D, B, T, NH, KV);
    case 32: return fa2_backward_hs<32>(dqkv, dout, qkv, lse, D, B, T, NH, KV);
    case 48: return fa2_backward_hs<48>(dqkv, dout, qkv, lse, D, B, T, NH, KV);
    case 64: return fa2_backward_hs<64>(dqkv, dout, qkv, lse, D, B, T, NH, KV);
    default: return fa2_backward_hs<128>(dqkv, dout, qkv, lse, D, B, T, NH, KV);
  }
}
