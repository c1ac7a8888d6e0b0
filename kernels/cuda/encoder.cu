/*
 * encoder.cu: the embeddings, token (wte) plus position (wpe). The
 * forward is elementwise; the backward adds dwpe over the batch in order
 * and dwte by token: CUB's stable radix sort groups the positions of each
 * token, and one block per token adds its rows in position order, as the
 * serial reference does, so dwte is the reference's bit for bit.
 */
#include "common.cuh"

#include <cub/device/device_radix_sort.cuh>

template <typename X, int VEC>
__global__ void k_encoder_fwd(X *out, const int *inp, const X *wte, const X *wpe, int T, int C,
                              size_t n) {
  ZT_GRID_STRIDE(j, n / VEC) {
    size_t i = j * VEC, bt = i / C;
    int c = (int)(i % C), t = (int)(bt % T);
    float a[VEC], b[VEC];
    ldv<VEC>(a, wte + (size_t)inp[bt] * C + c), ldv<VEC>(b, wpe + (size_t)t * C + c);
    for (int k = 0; k < VEC; k++) a[k] += b[k];
    stv<VEC>(out + i, a);
  }
}

template <typename X>
static void cu_encoder_forward(float *out, const int *inp, const float *wte, const float *wpe,
                               int B, int T, int C) {
  size_t n = (size_t)B * T * C;
  ZT_LAUNCH_X8(k_encoder_fwd, X, n, vec_fits(8, sizeof(X), (size_t)C, {out, wte, wpe}), (X *)out,
               inp, (const X *)wte, (const X *)wpe, T, C, n);
}

/* dwpe[t,c] += sum over b in order. */
template <typename X>
__global__ void k_encoder_bwd_wpe(float *dwpe, const X *dout, int B, int T, int C) {
  size_t n = (size_t)T * C;
  ZT_GRID_STRIDE(i, n) {
    int t = (int)(i / C), c = (int)(i % C);
    float acc = dwpe[i];
    for (int b = 0; b < B; b++) acc += ldx(dout[((size_t)b * T + t) * C + c]);
    dwpe[i] = acc;
  }
}

__global__ void k_iota_keys(unsigned *keys, int *vals, const int *inp, int n) {
  ZT_GRID_STRIDE(i, (size_t)n) {
    keys[i] = (unsigned)inp[i];
    vals[i] = (int)i;
  }
}

/* One block per sorted position; the first position of each token's run
 * adds that token's rows, in position order, into its dwte row. */
template <typename X>
__global__ void k_encoder_bwd_wte(float *dwte, const X *dout, const unsigned *keys,
                                  const int *pos, int n, int C) {
  int j = blockIdx.x;
  unsigned key = keys[j];
  if (j > 0 && keys[j - 1] == key) return;
  int end = j + 1;
  while (end < n && keys[end] == key) end++;
  float *row = dwte + (size_t)key * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = row[c];
    for (int r = j; r < end; r++) acc += ldx(dout[(size_t)pos[r] * C + c]);
    row[c] = acc;
  }
}

template <typename X>
static void cu_encoder_backward(float *dwte, float *dwpe, const float *dout_, const int *inp,
                                int B, int T, int C) {
  const X *dout = (const X *)dout_;
  int n = B * T;
  if (n <= 0 || C <= 0) return;
  size_t tc = (size_t)T * C;
  ZT_LAUNCH_1D(k_encoder_bwd_wpe<X>, tc, dwpe, dout, B, T, C);
  size_t temp = 0;
  ZT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(NULL, temp, (const unsigned *)NULL,
                                                (unsigned *)NULL, (const int *)NULL, (int *)NULL,
                                                n, 0, 32, g.stream));
  size_t arr = ((size_t)n * sizeof(int) + 255) & ~(size_t)255;
  char *s = (char *)scratch(SCR_SORT, 4 * arr + temp);
  unsigned *keys_in = (unsigned *)s, *keys_out = (unsigned *)(s + arr);
  int *vals_in = (int *)(s + 2 * arr), *vals_out = (int *)(s + 3 * arr);
  ZT_LAUNCH_1D(k_iota_keys, (size_t)n, keys_in, vals_in, inp, n);
  ZT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(s + 4 * arr, temp, keys_in, keys_out, vals_in,
                                                vals_out, n, 0, 32, g.stream));
  k_encoder_bwd_wte<X><<<n, 128, 0, g.stream>>>(dwte, dout, keys_out, vals_out, n, C);
  ZT_CUDA_LAUNCHED();
}

template <typename X>
void fill_encoder(zt_kernels_t *t) {
  ZT_PROF_ENTRY(t, encoder_forward, cu_encoder_forward<X>);
  ZT_PROF_ENTRY(t, encoder_backward, cu_encoder_backward<X>);
}
template void fill_encoder<float>(zt_kernels_t *);
template void fill_encoder<bf16>(zt_kernels_t *);
