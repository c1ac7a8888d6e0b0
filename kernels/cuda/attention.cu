/*
 * attention.cu: the table's attention calls (attention_forward, _backward
 * and their grouped-query forms) and the choice of path, with the
 * cuBLASLt path itself. Two paths, one interface (the CPU kernels', in
 * zt_kernels.h: the forward keeps only lse per row, the backward
 * recomputes the probabilities):
 *
 *   - flash attention 2 (fa2.cu), where it applies: bf16 storage, head
 *     sizes 16, 32, 48, 64 and 128, 16-byte aligned rows. No T x T matrix
 *     is formed. It is the default there (zt_kernels_cuda_set_attention_fa2
 *     turns it off);
 *   - cuBLASLt products with the T x T scores in the call's scratch, for
 *     every shape and both storage types: the fallback, below.
 */
#include "common.cuh"

/* ---------------------------------------------------------------------------
 * Attention, multi-head and grouped-query alike. A row of qkv holds NH
 * query heads, then KV key heads, then KV value heads, hs wide each
 * ((NH + 2 KV) hs; GPT-2: KV = NH; att_rs and att_koff in common.cuh);
 * query head h reads K/V head h / (NH / KV), on either path: no K/V head
 * is copied per query head. out and dout rows are NH hs wide, lse is
 * [B,NH,T].
 *
 * Attention through cuBLASLt: qkv is permuted into q [B,NH,T,hs] and k, v
 * [B,KV,T,hs]. The G = NH / KV query heads of a group lie one after the
 * other in q, so for each (b, K/V head) (a batch of B*KV) one product
 * takes the group's G*T query rows against the head's T keys: the K/V
 * head is read once, and the backward's products over the G*T rows sum dk
 * and dv over the group by themselves. The products run through cuBLASLt
 * on the full T x T per query head, the causal mask is applied by the
 * softmax kernels (entries above the diagonal become 0). Row-major q
 * [T,hs] is column-major Q' [hs,T] (ld hs); a row-major [T,T] matrix A is
 * column-major A' with A'(t2,t) = A[t][t2]. The backward recomputes the
 * probabilities from the scores and lse. The T x T matrices live in the
 * call's scratch, not in the activations. */

/* The offset in [B,T,width] rows (at column coff) of element idx of a
 * [B,NH,T,hs] head-major tensor. */
__device__ __forceinline__ size_t head_to_row(size_t idx, int T, int NH, int hs, int width,
                                              int coff) {
  int i = (int)(idx % hs);
  size_t r = idx / hs;
  int t = (int)(r % T);
  r /= T;
  int h = (int)(r % NH), b = (int)(r / NH);
  return ((size_t)b * T + t) * width + coff + (size_t)h * hs + i;
}

/* [B,NH,T,hs] <-> [B,T,C] at column offset `coff` of rows of width `width`.
 * dir 0: dst (rows) = src (heads); dir 1: dst (heads) = src (rows). The
 * heads are fp32 scratch, the rows of either storage type. */
template <typename D, typename S>
__global__ void k_heads_rows(D *dst, const S *src, int B, int T, int NH, int hs, int width,
                             int coff, int dir) {
  size_t n = (size_t)B * NH * T * hs;
  ZT_GRID_STRIDE(idx, n) {
    size_t row = head_to_row(idx, T, NH, hs, width, coff);
    if (dir == 0)
      put(dst[row], ldx(src[idx]));
    else
      put(dst[idx], ldx(src[row]));
  }
}

/* Causal softmax in place, one warp per row of T: entries t2 <= t are
 * already scaled scores; entries above the diagonal become 0. */
__global__ void k_causal_softmax(float *att, float *lse, int rows, int T) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  int t = row % T;
  float *a = att + (size_t)row * T;
  float mx = -INFINITY;
  for (int j = lane; j <= t; j += 32) mx = fmaxf(mx, a[j]);
  mx = warp_max(mx);
  float s = 0.0f;
  for (int j = lane; j <= t; j += 32) {
    float e = expf(a[j] - mx);
    a[j] = e;
    s += e;
  }
  s = warp_sum(s);
  for (int j = lane; j < T; j += 32) a[j] = j <= t ? a[j] / s : 0.0f;
  if (lane == 0) lse[row] = mx + logf(s);
}

/* Scaled scores (in place) -> probabilities exp(s - lse) below the
 * diagonal, 0 above: the forward's softmax, recomputed. */
__global__ void k_causal_probs(float *att, const float *lse, int rows, int T) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  int t = row % T;
  float *a = att + (size_t)row * T, l = lse[row];
  for (int j = lane; j < T; j += 32) a[j] = j <= t ? expf(a[j] - l) : 0.0f;
}

/* datt (in place) -> dpreatt = att * (datt - sum(att * datt)) * scale below
 * the diagonal, 0 above. */
__global__ void k_causal_softmax_bwd(float *datt, const float *att, int rows, int T,
                                     float scale) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  int t = row % T;
  float *d = datt + (size_t)row * T;
  const float *a = att + (size_t)row * T;
  float s = 0.0f;
  for (int j = lane; j <= t; j += 32) s += a[j] * d[j];
  s = warp_sum(s);
  for (int j = lane; j < T; j += 32) d[j] = j <= t ? a[j] * (d[j] - s) * scale : 0.0f;
}

/* Bytes of scratch the cuBLASLt backward takes (the forward, less): q,
 * dvacc, dq [B,NH,T,hs], k, v, dk, dv [B,KV,T,hs] and two [B,NH,T,T]
 * matrices. */
static size_t att_cublas_scratch(int B, int T, int NH, int KV, int hs) {
  size_t nq = (size_t)B * T * NH * hs, nkv = (size_t)B * T * KV * hs;
  size_t tt = (size_t)B * NH * T * T;
  return (3 * nq + 4 * nkv + 2 * tt) * sizeof(float);
}

/* ---------------------------------------------------------------------------
 * The path. 1 (the default): flash attention 2 wherever it applies; 0:
 * cuBLASLt for every call (zt_kernels_cuda_set_attention_fa2). */
static int att_fa2_on = 1;

/* Flash attention 2 takes bf16 storage (the callers check sizeof(X)), head
 * sizes 16, 32, 48, 64 and 128 (Llama's), 16-byte aligned q, k, v, dout
 * and gradient rows (C a multiple of 8, as head sizes of 16 make it), and
 * at most 65535 (b, head) pairs (gridDim.y). */
static int att_fa2(int B, int NH, int hs, const void *a, const void *b, const void *c) {
  return att_fa2_on && (hs == 16 || hs == 32 || hs == 48 || hs == 64 || hs == 128) &&
         B * NH <= 65535 && ((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) % 16 == 0;
}

/* The three parts of qkv's rows (q, k, v: NH, KV and KV heads) as fp32
 * heads [B,heads,T,hs] (dir 1: h[i] = the rows' part i), or heads back into
 * the rows (dir 0: the rows' part i = h[i]). */
template <typename D, typename S>
static void att_heads(D *const dst[3], const S *const src[3], int B, int T, int NH, int KV,
                      int hs, int dir) {
  int rs = (int)att_rs(NH, KV, hs), heads[3] = {NH, KV, KV}, coff[3] = {0, NH * hs, (NH + KV) * hs};
  for (int i = 0; i < 3; i++) {
    size_t n = (size_t)B * T * heads[i] * hs;
    k_heads_rows<D, S><<<grid_for(n, 256), 256, 0, g.stream>>>(dst[i], src[i], B, T, heads[i],
                                                               hs, rs, coff[i], dir);
    ZT_CUDA_LAUNCHED();
  }
}

template <typename X>
static void cu_attention_forward_gqa(float *out_, float *lse, const float *qkv_, int B, int T,
                                     int NH, int KV, int hs) {
  if (B <= 0 || T <= 0) return;
  X *out = (X *)out_;
  const X *qkv = (const X *)qkv_;
  if (sizeof(X) == 2 && att_fa2(B, NH, hs, qkv, out, out))
    return fa2_forward((bf16 *)out, lse, (const bf16 *)qkv, B, T, NH, KV, hs);
  int grp = NH / KV, batch = B * KV;
  size_t nq = (size_t)B * T * NH * hs, nkv = (size_t)B * T * KV * hs, tt = (size_t)B * NH * T * T;
  float *q = (float *)scratch(SCR_ATT, (2 * nq + 2 * nkv + tt) * sizeof(float)), *k = q + nq,
        *v = k + nkv, *vacc = v + nkv, *att = vacc + nq;
  float *const heads[3] = {q, k, v};
  const X *const rows[3] = {qkv, qkv, qkv};
  att_heads<float, X>(heads, rows, B, T, NH, KV, hs, 1);
  long long sk = (long long)T * hs, sq = sk * grp, st = (long long)grp * T * T;
  /* att'(t2, (g,t)) = K'^T Q' * scale, the group's G*T query rows at once. */
  lt_gemm(1, 0, T, grp * T, hs, k, hs, sk, q, hs, sq, att, T, st, batch,
          1.0f / sqrtf((float)hs), 0.0f, NULL);
  int nrows = B * NH * T;
  k_causal_softmax<<<(nrows + 7) / 8, 256, 0, g.stream>>>(att, lse, nrows, T);
  ZT_CUDA_LAUNCHED();
  /* vacc' [hs,G*T] = V' [hs,T] att' [T,G*T]. */
  lt_gemm(0, 0, hs, grp * T, T, v, hs, sk, att, T, st, vacc, hs, sq, batch, 1.0f, 0.0f, NULL);
  k_heads_rows<X, float><<<grid_for(nq, 256), 256, 0, g.stream>>>(out, vacc, B, T, NH, hs,
                                                                  NH * hs, 0, 0);
  ZT_CUDA_LAUNCHED();
}

template <typename X>
static void cu_attention_backward_gqa(float *dqkv_, const float *dout_, const float *qkv_,
                                      const float *out_, const float *lse, int B, int T, int NH,
                                      int KV, int hs) {
  if (B <= 0 || T <= 0) return;
  X *dqkv = (X *)dqkv_;
  const X *dout = (const X *)dout_, *qkv = (const X *)qkv_, *out = (const X *)out_;
  if (sizeof(X) == 2 && att_fa2(B, NH, hs, qkv, dout, dqkv))
    return fa2_backward((bf16 *)dqkv, (const bf16 *)dout, (const bf16 *)qkv, (const bf16 *)out,
                        lse, B, T, NH, KV, hs);
  int grp = NH / KV, batch = B * KV;
  size_t nq = (size_t)B * T * NH * hs, nkv = (size_t)B * T * KV * hs, tt = (size_t)B * NH * T * T;
  float *q = (float *)scratch(SCR_ATT, att_cublas_scratch(B, T, NH, KV, hs)), *k = q + nq,
        *v = k + nkv, *dvacc = v + nkv, *dq = dvacc + nq, *dk = dq + nq, *dv = dk + nkv,
        *datt = dv + nkv, *att = datt + tt;
  float *const heads[3] = {q, k, v};
  const X *const rows[3] = {qkv, qkv, qkv};
  att_heads<float, X>(heads, rows, B, T, NH, KV, hs, 1);
  long long sk = (long long)T * hs, sq = sk * grp, st = (long long)grp * T * T;
  float scale = 1.0f / sqrtf((float)hs);
  lt_gemm(1, 0, T, grp * T, hs, k, hs, sk, q, hs, sq, att, T, st, batch, scale, 0.0f, NULL);
  int nrows = B * NH * T;
  k_causal_probs<<<(nrows + 7) / 8, 256, 0, g.stream>>>(att, lse, nrows, T);
  ZT_CUDA_LAUNCHED();
  k_heads_rows<float, X><<<grid_for(nq, 256), 256, 0, g.stream>>>(dvacc, dout, B, T, NH, hs,
                                                                  NH * hs, 0, 1);
  ZT_CUDA_LAUNCHED();
  /* datt'(t2, (g,t)) = V'^T dVacc'. */
  lt_gemm(1, 0, T, grp * T, hs, v, hs, sk, dvacc, hs, sq, datt, T, st, batch, 1.0f, 0.0f, NULL);
  /* dv' [hs,T] = dVacc' [hs,G*T] att'^T: summed over the group's heads. */
  lt_gemm(0, 1, hs, T, grp * T, dvacc, hs, sq, att, T, st, dv, hs, sk, batch, 1.0f, 0.0f, NULL);
  k_causal_softmax_bwd<<<(nrows + 7) / 8, 256, 0, g.stream>>>(datt, att, nrows, T, scale);
  ZT_CUDA_LAUNCHED();
  /* dq' = K' dpre'; dk' = Q' dpre'^T (summed over the group's heads). */
  lt_gemm(0, 0, hs, grp * T, T, k, hs, sk, datt, T, st, dq, hs, sq, batch, 1.0f, 0.0f, NULL);
  lt_gemm(0, 1, hs, T, grp * T, q, hs, sq, datt, T, st, dk, hs, sk, batch, 1.0f, 0.0f, NULL);
  X *const drows[3] = {dqkv, dqkv, dqkv};
  const float *const dheads[3] = {dq, dk, dv};
  att_heads<X, float>(drows, dheads, B, T, NH, KV, hs, 0);
}

/* Multi-head attention is the grouped kind with one query head per group. */
template <typename X>
static void cu_attention_forward(float *out, float *lse, const float *qkv, int B, int T, int C,
                                 int NH) {
  cu_attention_forward_gqa<X>(out, lse, qkv, B, T, NH, NH, C / NH);
}

template <typename X>
static void cu_attention_backward(float *dqkv, const float *dout, const float *qkv,
                                  const float *out, const float *lse, int B, int T, int C,
                                  int NH) {
  cu_attention_backward_gqa<X>(dqkv, dout, qkv, out, lse, B, T, NH, NH, C / NH);
}

extern "C" ZT_API void zt_kernels_cuda_set_attention_fa2(int on) {
  att_fa2_on = on;
  cap.epoch++; /* recorded graphs are stale */
}

template <typename X>
void fill_attention(zt_kernels_t *t) {
  ZT_PROF_ENTRY(t, attention_forward, cu_attention_forward<X>);
  ZT_PROF_ENTRY(t, attention_backward, cu_attention_backward<X>);
  ZT_PROF_ENTRY(t, attention_forward_gqa, cu_attention_forward_gqa<X>);
  ZT_PROF_ENTRY(t, attention_backward_gqa, cu_attention_backward_gqa<X>);
}
template void fill_attention<float>(zt_kernels_t *);
template void fill_attention<bf16>(zt_kernels_t *);
