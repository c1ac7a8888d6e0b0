/*
 * reduce.cu: the deterministic reductions. Column sums (colsums, common.cuh)
 * give the bias gradients of the linear layers (matmul.cu) and the weight
 * and bias gradients of LayerNorm and RMSNorm (norm.cu); the sum of squares
 * (sumsq, sumsq_f64: gradient norms for clipping) is the table's one call
 * that returns a value to the host. Both sum in an order fixed by the
 * sizes alone, so every run gives the same bits; no atomics.
 */
#include "common.cuh"

/* ---------------------------------------------------------------------------
 * Column sums: dst[c] += sum over N rows of src[n, c] (optionally of
 * src * norm, for the LayerNorm weight gradient). Stage 1: a block takes 32
 * lanes' worth of columns (VEC each) and a chunk of ZT_COLSUM_ROWS rows;
 * warp w adds rows w, w + 8, ... of the chunk, and the 8 warps' sums are
 * added in warp order. Stage 2 adds the chunks' sums the same way (chunk
 * k to the k % 8'th partial, then the 8 partials in order). Every
 * column's order of addition depends on N alone: not on VEC, not on the
 * run. */
#define ZT_COLSUM_ROWS 64
#define ZT_COLSUM_WARPS 8

template <typename X, int VEC>
__global__ void k_colsum_chunks(float *part_a, float *part_b, const X *dout, const X *inp,
                                const float *mean, const float *rstd, int N, int C, int rows) {
  __shared__ float sh[2][ZT_COLSUM_WARPS][32 * VEC];
  int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  int c0 = blockIdx.x * 32 * VEC, c = c0 + lane * VEC, chunk = blockIdx.y;
  int r0 = chunk * rows, r1 = min(N, r0 + rows);
  float sa[VEC], sb[VEC], d[VEC], x[VEC];
  for (int k = 0; k < VEC; k++) sa[k] = sb[k] = 0.0f;
  if (c < C)
    for (int r = r0 + w; r < r1; r += ZT_COLSUM_WARPS) {
      ldv<VEC>(d, dout + (size_t)r * C + c);
      if (part_a)
        for (int k = 0; k < VEC; k++) sa[k] += d[k];
      if (part_b) {
        ldv<VEC>(x, inp + (size_t)r * C + c);
        float mr = mean ? mean[r] : 0.0f;
        for (int k = 0; k < VEC; k++) sb[k] += (x[k] - mr) * rstd[r] * d[k];
      }
    }
  for (int k = 0; k < VEC; k++) sh[0][w][lane * VEC + k] = sa[k], sh[1][w][lane * VEC + k] = sb[k];
  __syncthreads();
  for (int j = threadIdx.x; j < 32 * VEC && c0 + j < C; j += blockDim.x) {
    float a = 0.0f, b = 0.0f;
    for (int q = 0; q < ZT_COLSUM_WARPS; q++) a += sh[0][q][j], b += sh[1][q][j];
    if (part_a) part_a[(size_t)chunk * C + c0 + j] = a;
    if (part_b) part_b[(size_t)chunk * C + c0 + j] = b;
  }
}

__global__ void k_colsum_finish(float *dst_a, float *dst_b, const float *part_a,
                                const float *part_b, int nchunks, int C) {
  __shared__ float sh[2][ZT_COLSUM_WARPS][32];
  int lane = threadIdx.x % 32, w = threadIdx.x / 32, c = blockIdx.x * 32 + lane;
  float a = 0.0f, b = 0.0f;
  if (c < C)
    for (int k = w; k < nchunks; k += ZT_COLSUM_WARPS) {
      if (part_a) a += part_a[(size_t)k * C + c];
      if (part_b) b += part_b[(size_t)k * C + c];
    }
  sh[0][w][lane] = a, sh[1][w][lane] = b;
  __syncthreads();
  if (w || c >= C) return;
  a = b = 0.0f;
  for (int q = 0; q < ZT_COLSUM_WARPS; q++) a += sh[0][q][lane], b += sh[1][q][lane];
  if (dst_a) dst_a[c] += a;
  if (part_b) dst_b[c] += b;
}

/* dsum[c] += sum_n dout[n,c] (unless dsum is NULL); with inp/rstd also
 * dnorm[c] += sum_n norm[n,c] * dout[n,c], norm = (inp - mean) * rstd
 * (mean 0 where NULL: RMSNorm's). */
template <typename X>
void colsums(float *dsum, float *dnorm, const X *dout, const X *inp, const float *mean,
             const float *rstd, int N, int C) {
  if (N <= 0 || C <= 0) return;
  /* Chunks of ZT_COLSUM_ROWS rows, more for very tall inputs (grid y <= 65535). */
  int rows = ZT_COLSUM_ROWS;
  while ((N + rows - 1) / rows > 65535) rows *= 2;
  int nchunks = (N + rows - 1) / rows;
  size_t per = (size_t)nchunks * C, parts = (dsum ? 1 : 0) + (dnorm ? 1 : 0);
  if (!parts) return;
  /* Only the sums asked for are formed (RMSNorm's weight gradient has no
   * bias: dsum NULL). */
  float *part = (float *)scratch(SCR_COLSUM, per * parts * sizeof(float));
  float *part_a = dsum ? part : NULL, *part_b = dnorm ? part + (dsum ? per : 0) : NULL;
  unsigned threads = 32 * ZT_COLSUM_WARPS;
  if (vec_fits(8, sizeof(X), (size_t)C, {dout, inp}))
    k_colsum_chunks<X, 8><<<dim3((C + 255) / 256, nchunks), threads, 0, g.stream>>>(
        part_a, part_b, dout, inp, mean, rstd, N, C, rows);
  else
    k_colsum_chunks<X, 1><<<dim3((C + 31) / 32, nchunks), threads, 0, g.stream>>>(
        part_a, part_b, dout, inp, mean, rstd, N, C, rows);
  ZT_CUDA_LAUNCHED();
  k_colsum_finish<<<(C + 31) / 32, threads, 0, g.stream>>>(dsum, dnorm, part_a, part_b, nchunks,
                                                            C);
  ZT_CUDA_LAUNCHED();
}

template void colsums<float>(float *, float *, const float *, const float *, const float *,
                             const float *, int, int);
template void colsums<bf16>(float *, float *, const bf16 *, const bf16 *, const float *,
                            const float *, int, int);

/* ---------------------------------------------------------------------------
 * Sum of squares. */

/* One block per ZT_KERNELS_SUMSQ_CHUNK elements, summed in double with a fixed
 * tree; the host adds the chunk sums in order (sum_chunks). The value
 * squared is x for fp32 input (sumsq) and (float)(x * s) for fp64 input
 * (sumsq_f64). */
__device__ __forceinline__ double sq_value(float x, double) { return x; }
__device__ __forceinline__ double sq_value(double x, double s) { return (float)(x * s); }

template <typename T>
__global__ void k_sumsq_chunks(double *part, const T *x, size_t n, double s) {
  __shared__ double sh[ZT_RED_THREADS];
  size_t c0 = (size_t)blockIdx.x * ZT_KERNELS_SUMSQ_CHUNK;
  size_t c1 = c0 + ZT_KERNELS_SUMSQ_CHUNK < n ? c0 + ZT_KERNELS_SUMSQ_CHUNK : n;
  double acc = 0.0;
  for (size_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
    double v = sq_value(x[i], s);
    acc += v * v;
  }
  acc = block_reduce<double, false>(acc, sh);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

/* Adds the chunk sums of `part` on the host, in order. */
static double sum_chunks(const double *part, size_t chunks) {
  if (cap_refuse("a sum read back to the host")) return 0.0;
  if (g.sumsq_host_n < chunks) {
    free(g.sumsq_host);
    g.sumsq_host = (double *)malloc(chunks * sizeof(double));
    if (!g.sumsq_host) cuda_fail("malloc", "out of host memory", __FILE__, __LINE__);
    g.sumsq_host_n = chunks;
  }
  ZT_CUDA_CHECK(cudaMemcpyAsync(g.sumsq_host, part, chunks * sizeof(double),
                                cudaMemcpyDeviceToHost, g.stream));
  stream_wait();
  double total = 0.0;
  for (size_t i = 0; i < chunks; i++) total += g.sumsq_host[i];
  return total;
}

template <typename T>
static double sumsq_chunked(const T *x, size_t n, double s) {
  if (!n) return 0.0;
  size_t chunks = (n + ZT_KERNELS_SUMSQ_CHUNK - 1) / ZT_KERNELS_SUMSQ_CHUNK;
  double *part = (double *)scratch(SCR_SUMSQ, chunks * sizeof(double));
  k_sumsq_chunks<T><<<(unsigned)chunks, ZT_RED_THREADS, 0, g.stream>>>(part, x, n, s);
  ZT_CUDA_LAUNCHED();
  return sum_chunks(part, chunks);
}

static double cu_sumsq(const float *x, size_t n) { return sumsq_chunked(x, n, 1.0); }

static double cu_sumsq_f64(const double *x, size_t n, double s) {
  return sumsq_chunked(x, n, s);
}

template <typename X>
void fill_reduce(zt_kernels_t *t) {
  ZT_PROF_ENTRY(t, sumsq, cu_sumsq);
  ZT_PROF_ENTRY(t, sumsq_f64, cu_sumsq_f64);
}
template void fill_reduce<float>(zt_kernels_t *);
template void fill_reduce<bf16>(zt_kernels_t *);
