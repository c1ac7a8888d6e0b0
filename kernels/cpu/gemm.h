/*
 * gemm.h: zt_sgemm, the single-threaded matrix product of the fast CPU
 * kernels (fast.c). See gemm.c for how it is built and when it falls back to
 * OpenBLAS.
 */
#ifndef ZT_KERNELS_GEMM_H
#define ZT_KERNELS_GEMM_H

/* C[M, N] = alpha * op(A) op(B) + beta * C, all row-major. op(A) is A[M, K]
 * (lda >= K) or, with ta, the transpose of A[K, M] (lda >= M); likewise
 * op(B) is B[K, N] or, with tb, the transpose of B[N, K]. With beta == 0, C
 * is not read. Runs on the calling thread only. Each element of C is summed
 * over k in the same order whatever M, N and the position of the element,
 * so a product split into row blocks gives the same bits as the whole. */
void zt_sgemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
              const float *B, int ldb, float beta, float *C, int ldc);

/* Which implementation zt_sgemm uses: "avx512" (our own, on CPUs with
 * AVX-512F) or "blas" (OpenBLAS's cblas_sgemm). ZT_SGEMM=blas in the
 * environment forces OpenBLAS (another value than blas or avx512 is
 * logged once and ignored); the choice is made once per process. */
const char *zt_sgemm_impl(void);

/* For tests and benchmarks: 1 selects our AVX-512 product (ignored when
 * the CPU has no AVX-512F), 0 OpenBLAS, -1 decides again as the first call
 * does (CPU and ZT_SGEMM). Returns the implementation now in use. Not for
 * use while another thread multiplies. */
const char *zt_sgemm_force(int own);

#endif
