/*
 * zt_kernels.h: the kernel table, the one interface between the model code
 * and the hardware that does the arithmetic.
 *
 * The GPT-2 model in engine/model.c never does arithmetic on tensors itself:
 * every operation (embedding lookup, LayerNorm, matmul, attention, GELU,
 * residual add, softmax + cross-entropy, AdamW, norms) goes through one
 * zt_kernels_t, a struct of function pointers. The CPU implementation lives in
 * kernels/cpu/ (CBLAS for the matmuls, OpenMP loops for the rest); a CUDA
 * implementation fills the same table with device pointers. Two CPU tables
 * exist:
 *
 *   zt_kernels_cpu()  the fast path: OpenMP with static schedules, CBLAS.
 *   zt_kernels_ref()  the reference: plain serial loops written to be read,
 *                     used by the unit tests to check every fast kernel.
 *
 * Conventions shared by every implementation:
 *
 *   - Tensors are dense row-major. A linear layer's weight is [OC, IC]
 *     (out = inp @ W^T + b), as in llm.c; token ids are int32.
 *   - Storage type. Activations, their gradients and the parameters that
 *     forward and backward read are stored as the table's "X" type, xbytes
 *     bytes per element: fp32 (4) in every table but the CUDA bf16 table
 *     (zt_kernels_cuda_bf16, 2), whose kernels take bf16 there. Everything
 *     else is fp32 in every table: parameter gradients (dw, db, dwte, dwpe),
 *     LayerNorm's mean and rstd, attention's lse, the losses, AdamW's
 *     parameters (the fp32 master copy) and state, and the fp64 helpers'
 *     fp32 side. The signatures say float * for X tensors too; for a bf16
 *     table those pointers hold bf16 elements (as llm.c's floatX), and a
 *     caller addresses them in units of xbytes. Arithmetic is fp32 in
 *     every table: a bf16 kernel widens its inputs, computes in fp32 and
 *     rounds its output once.
 *   - Forward kernels overwrite their outputs.
 *   - Backward kernels ACCUMULATE (+=) into parameter gradients (dw, db, dwte,
 *     dwpe), so micro-batches accumulate without extra copies. Gradients of
 *     activations are overwritten (dinp =), except layernorm_backward, which
 *     accumulates into dinp because the LayerNorm input is the residual
 *     stream whose gradient is a sum of two paths.
 *   - Every kernel is deterministic for a fixed thread count: no atomics, no
 *     reductions whose order depends on scheduling.
 *   - Element counts are size_t, model dimensions are int.
 */
#ifndef ZT_KERNELS_H
#define ZT_KERNELS_H

#include <math.h>
#include <stddef.h>

#ifdef __CUDACC__
#define ZT_HOSTDEV __host__ __device__
#else
#define ZT_HOSTDEV
#endif

/* The settings of one adamw_fused call: the segments of the range (up to
 * ZT_ADAMW_SEGS, each a tensor's part with its weight decay, or padding
 * that no update touches) and AdamW's hyper-parameters, with the bias
 * corrections bc1 = 1-b1^t, bc2 = 1-b2^t. */
#define ZT_ADAMW_SEGS 32
typedef struct zt_adamw_args {
  int n;
  unsigned skip; /* bit i: segment i is no tensor's (padding): left as it is */
  size_t end[ZT_ADAMW_SEGS];
  float wd[ZT_ADAMW_SEGS];
  float lr, b1, b2, eps, bc1, bc2;
} zt_adamw_args_t;

/* RoPE's frequencies: rope_theta, and Llama 3's rope_scaling when factor
 * is not 0 (Hugging Face's "llama3" rope_type: long wavelengths divided by
 * factor, short ones kept, the band between blended). */
typedef struct zt_rope {
  float theta;
  float factor, low_freq_factor, high_freq_factor, original_max_pos;
} zt_rope_t;

/* inv_freq of pair (i, i + HD/2), in fp32 as Hugging Face forms it. */
static inline ZT_HOSTDEV float zt_rope_inv_freq(zt_rope_t r, int i, int HD) {
  float inv = 1.0f / powf(r.theta, (float)(2 * i) / (float)HD);
  if (r.factor == 0.0f) return inv;
  float wavelen = 2.0f * 3.14159265358979323846f / inv;
  if (wavelen < r.original_max_pos / r.high_freq_factor) return inv;
  if (wavelen > r.original_max_pos / r.low_freq_factor) return inv / r.factor;
  float smooth = (r.original_max_pos / wavelen - r.low_freq_factor) /
                 (r.high_freq_factor - r.low_freq_factor);
  return (1.0f - smooth) * inv / r.factor + smooth * inv;
}

typedef struct zt_kernels {
  const char *name;
  int xbytes; /* bytes of one element of the storage type X (above): 4 or 2 */

  /* out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]. */
  void (*encoder_forward)(float *out, const int *inp, const float *wte, const float *wpe, int B,
                          int T, int C);
  /* dwte[inp[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:]. */
  void (*encoder_backward)(float *dwte, float *dwpe, const float *dout, const int *inp, int B,
                           int T, int C);

  /* Per row of N rows of C: out = (x - mean) * rstd * w + b (eps 1e-5). */
  void (*layernorm_forward)(float *out, float *mean, float *rstd, const float *inp, const float *w,
                            const float *b, int N, int C);
  /* dinp += ..., dw += ..., db += ... */
  void (*layernorm_backward)(float *dinp, float *dw, float *db, const float *dout,
                             const float *inp, const float *w, const float *mean,
                             const float *rstd, int N, int C);
  /* Optional (NULL where a table has none; the CUDA tables have it): the
   * residual sum and the LayerNorm of it in one pass, with the two calls'
   * results bit for bit: residual_forward(res, a, b, N*C), then
   * layernorm_forward(out, mean, rstd, res, w, bias, N, C). res may alias
   * a or b. */
  void (*residual_layernorm_forward)(float *res, float *out, float *mean, float *rstd,
                                     const float *a, const float *b, const float *w,
                                     const float *bias, int N, int C);

  /* out[N,OC] = inp[N,IC] @ w[OC,IC]^T + bias[OC] (bias may be NULL). */
  void (*matmul_forward)(float *out, const float *inp, const float *w, const float *bias, int N,
                         int IC, int OC);
  /* dinp = dout @ w (skipped when dinp is NULL); dw += dout^T @ inp;
   * dbias += column sums of dout (skipped when dbias is NULL). */
  void (*matmul_backward)(float *dinp, float *dw, float *dbias, const float *dout,
                          const float *inp, const float *w, int N, int IC, int OC);

  /* Causal multi-head attention. qkv is [B,T,3C] (q, k, v, each split into
   * NH heads of C/NH); out is [B,T,C]; lse [B,NH,T] receives each query
   * row's log-sum-exp of its scaled scores, the softmax's normaliser: with
   * it backward recomputes the probabilities (as flash attention does), so
   * no T x T matrix outlives a call. */
  void (*attention_forward)(float *out, float *lse, const float *qkv, int B, int T, int C,
                            int NH);
  /* dqkv = gradient of qkv (overwritten) from dout, qkv, and the forward's
   * out and lse. */
  void (*attention_backward)(float *dqkv, const float *dout, const float *qkv, const float *out,
                             const float *lse, int B, int T, int C, int NH);

  /* GELU, tanh approximation. gelu_backward may run in place (dinp == dout). */
  void (*gelu_forward)(float *out, const float *inp, size_t n);
  void (*gelu_backward)(float *dinp, const float *inp, const float *dout, size_t n);
  /* Optional (NULL where a table has none; the CUDA tables have them): a
   * linear layer and the GELU after it in one product where the hardware
   * library can (GELU in the product's epilogue): pre = inp w^T + bias (the
   * GELU's input, kept for the backward) and out = gelu(pre); and the
   * backward of a linear layer whose input was gelu(pre): matmul_backward
   * with dinp = (dout w) * gelu'(pre), GELU's backward included. The GELU
   * may be taken of the unrounded sum (one rounding fewer than the two
   * calls with bf16 storage). bias must not be NULL. */
  void (*matmul_gelu_forward)(float *out, float *pre, const float *inp, const float *w,
                              const float *bias, int N, int IC, int OC);
  void (*matmul_backward_dgelu)(float *dinp, float *dweight, float *dbias, const float *dout,
                                const float *inp, const float *weight, const float *pre, int N,
                                int IC, int OC);

  /* out = a + b (out may alias a or b). */
  void (*residual_forward)(float *out, const float *a, const float *b, size_t n);

  /* Row-wise softmax over the first V of Vp columns of logits into probs
   * (probs may alias logits; padded columns V..Vp-1 get probability 0) and
   * losses[i] = -log probs[i, targets[i]]. */
  void (*crossentropy_forward)(float *losses, float *probs, const float *logits,
                               const int *targets, int N, int V, int Vp);
  /* dlogits = (probs - onehot(target)) * dloss, padded columns 0. dlogits
   * may alias probs. dloss is the same for every row. */
  void (*crossentropy_backward)(float *dlogits, const float *probs, const int *targets,
                                float dloss, int N, int V, int Vp);
  /* Optional (NULL where a table has none; the CUDA tables have them): the
   * classifier without a probability tensor. crossentropy_lse_forward
   * reads the logits (left as they are) and writes losses[i] and lse[i],
   * the row's log-sum-exp over its first V columns; crossentropy_lse_backward
   * writes dlogits = (softmax - onehot(target)) * dloss from the logits and
   * lse in one pass (dlogits may alias logits; padded columns 0). No
   * probability is stored: one pass over the N x Vp logits fewer than
   * the pair above, and with bf16 storage one rounding fewer. */
  void (*crossentropy_lse_forward)(float *losses, float *lse, const float *logits,
                                   const int *targets, int N, int V, int Vp);
  void (*crossentropy_lse_backward)(float *dlogits, const float *logits, const float *lse,
                                    const int *targets, float dloss, int N, int V, int Vp);

  /* One AdamW update of n elements (decoupled weight decay, PyTorch
   * semantics): p -= lr*wd*p; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
   * p -= lr * (m/bc1) / (sqrt(v/bc2) + eps), with bc1 = 1-b1^t, bc2 = 1-b2^t. */
  void (*adamw)(float *p, const float *g, float *m, float *v, size_t n, float lr, float b1,
                float b2, float eps, float wd, float bc1, float bc2);
  /* Optional (NULL where a table has none; the CUDA tables have it): one
   * launch that does what narrow_f64, adamw on each segment and narrow_x
   * do in turn, bit for bit, on a->end[a->n - 1] consecutive elements. The
   * gradient is g (fp32), or when g is NULL the fp64 sum g64, taken as
   * (float)(g64 * s) * t; segment i (elements [end[i-1], end[i])) has
   * weight decay wd[i], or is left as it is (bit i of skip); w, when not
   * NULL, receives the updated p in the
   * storage type. engine/zero.c uses it for every unit's update, so a GPU
   * step makes one optimizer launch per unit instead of one per tensor
   * plus two. */
  void (*adamw_fused)(float *p, const float *g, const double *g64, double s, float t, float *m,
                      float *v, void *w, const struct zt_adamw_args *a);
  /* Sum of squares in double. The sum is formed in fixed chunks of
   * ZT_KERNELS_SUMSQ_CHUNK elements combined in order, so the result does not
   * depend on the thread count. */
  double (*sumsq)(const float *x, size_t n);
  /* x *= s. */
  void (*scale)(float *x, size_t n, float s);
  /* x = 0. */
  void (*zero)(float *x, size_t n);
  /* Between fp32 and the storage type: dst (X) = src rounded to nearest
   * even; dst = src (X) widened, exactly. Plain copies when X is fp32. The
   * trainer narrows its fp32 master parameters into the copy the model
   * reads. */
  void (*narrow_x)(void *dst, const float *src, size_t n);
  void (*widen_x)(float *dst, const void *src, size_t n);

  /* Optimizer-state helpers for the ZeRO trainer, engine/zero.c (docs/zero.md): gradient
   * sums are kept in fp64 so that they are exact and independent of how
   * micro-batches are spread over ranks.
   *   acc_f64:    acc[i] += x[i]
   *   add_f64:    acc[i] += y[i]
   *   widen_f64:  dst[i] = x[i]
   *   narrow_f64: dst[i] = (float)(x[i] * s) * t     (scale, then clip)
   *   sumsq_f64:  sum over i of ((float)(x[i] * s))^2, in double; the CPU
   *               tables add in element order, CUDA in fixed chunks. */
  void (*acc_f64)(double *acc, const float *x, size_t n);
  void (*add_f64)(double *acc, const double *y, size_t n);
  void (*widen_f64)(double *dst, const float *x, size_t n);
  void (*narrow_f64)(float *dst, const double *x, size_t n, double s, float t);
  double (*sumsq_f64)(const double *x, size_t n, double s);

  /* The Llama architecture's own operations (engine/model.c, model.arch
   * "llama"); every table here has them (on a table without them, NULL,
   * such a model is refused at create time).
   *   rmsnorm_forward:  per row of N rows of C, rstd = 1/sqrt(mean(x^2) +
   *                     eps), out = x * rstd * w.
   *   rmsnorm_backward: dinp += ..., dw += ... (dinp accumulates, as
   *                     layernorm_backward's: it is the residual stream).
   *   rope:             rotary position embedding, Hugging Face's
   *                     rotate_half convention, in place on the q and k
   *                     heads of qkv [B,T,(NH+2*NKV)*HD] (row t at position
   *                     pos0 + t, angle (pos0 + t) * zt_rope_inv_freq(i)
   *                     for pair (i, i + HD/2)); inverse rotates back (the
   *                     backward of the forward).
   *   swiglu_forward:   out[N,F] = silu(inp[:, :F]) * inp[:, F:2F].
   *   swiglu_backward:  dinp[N,2F] (overwritten) from dout[N,F] and inp.
   *   attention_forward_gqa, attention_backward_gqa: attention on
   *                     qkv[B,T,(NH+2*NKV)*HD] as it is, each K/V head read
   *                     in place by its NH/NKV query heads (never copied),
   *                     out[B,T,NH*HD], lse[B,NH,T]; the backward sums a K/V
   *                     head's gradient over them and overwrites dqkv. */
  void (*rmsnorm_forward)(float *out, float *rstd, const float *inp, const float *w, int N, int C,
                          float eps);
  void (*rmsnorm_backward)(float *dinp, float *dw, const float *dout, const float *inp,
                           const float *w, const float *rstd, int N, int C);
  void (*rope)(float *qkv, int B, int T, int pos0, int NH, int NKV, int HD, zt_rope_t rope,
               int inverse);
  void (*swiglu_forward)(float *out, const float *inp, int N, int F);
  void (*swiglu_backward)(float *dinp, const float *dout, const float *inp, int N, int F);
  void (*attention_forward_gqa)(float *out, float *lse, const float *qkv, int B, int T, int NH,
                                int NKV, int HD);
  void (*attention_backward_gqa)(float *dqkv, const float *dout, const float *qkv,
                                 const float *out, const float *lse, int B, int T, int NH,
                                 int NKV, int HD);

  /* LoRA (engine/lora.c), for a projection of O x I with adapters a
   * [R, I] and b [O, R] (X) and scale s:
   *   lora_merge: w[O,I] (X) = base[O,I] (X) + s * b @ a, summed in fp32
   *               and rounded to X once;
   *   lora_grad:  from dw[O,I] (fp32), the gradient of the merged weight:
   *               da[R,I] += s * b^T @ dw and db[O,R] += s * dw @ a^T (fp32),
   *               which is the chain rule through w = base + s * b @ a.
   * matmul_backward and rmsnorm_backward skip dw when it is NULL (a frozen
   * weight). */
  void (*lora_merge)(float *w, const float *base, const float *a, const float *b, int O, int IN,
                     int R, float s);
  void (*lora_grad)(float *da, float *db, const float *dw, const float *a, const float *b, int O,
                    int IN, int R, float s);

  /* The memory the kernels work on: host memory for the CPU tables, device
   * memory for CUDA. alloc returns zeroed memory, or NULL when there is not
   * enough; upload and download copy between host memory and the table's
   * memory and return when the copy is complete. */
  void *(*alloc)(size_t bytes);
  void (*release)(void *p);
  void (*upload)(void *dst, const void *src, size_t bytes);
  void (*download)(void *dst, const void *src, size_t bytes);
  /* Within the table's memory: copy (no overlap) and set to zero bytes. */
  void (*copy)(void *dst, const void *src, size_t bytes);
  void (*memzero)(void *p, size_t bytes);
  /* Returns when the work queued on the table's memory is complete; NULL
   * where calls return complete (the CPU tables). The CUDA tables queue
   * on a stream of their own, so a caller that hands their memory to
   * another engine with a stream of its own (NCCL) calls it first:
   * otherwise the collective could read a gradient, or overwrite
   * parameters, while kernels still write or read them. */
  void (*sync)(void);
  /* Stream order with a communicator (comm.h, zt_comm_set_stream; NULL in
   * the CPU tables): the stream the calls are queued on, a cudaStream_t.
   * While fn is set (set_waiter), every call that waits for that stream
   * (sync, upload, download, release, sumsq's read-back) polls it and
   * calls fn(ctx) between polls: the stream may wait for collectives
   * (zt_comm_join), and fn looks at them (zt_comm_progress), so one that
   * fails or times out ends its communicator, which releases the stream,
   * and the wait returns. */
  void *(*stream)(void);
  void (*set_waiter)(void (*fn)(void *ctx), void *ctx);

  /* CUDA graphs (optional: NULL in the CPU tables). graph_begin starts
   * recording the table's calls, in place of running them: 0, or -1 with
   * the reason in why. graph_end stops and returns an executable graph of
   * the calls since graph_begin, or NULL with the reason: a call that
   * waits for the device or moves host memory (alloc, release, upload,
   * download, sync, sumsq's read-back, a scratch buffer that would have to
   * grow) cannot be in a graph and makes the recording fail; nothing
   * recorded has run either way. graph_launch enqueues the recorded calls
   * again with the arguments they were recorded with (pointers, sizes,
   * scalars: the same buffers, read and written afresh each time) and
   * returns 0, or enqueues nothing and returns -1 when the graph is stale
   * (a scratch buffer moved or a setting of the table changed since it
   * was recorded: the caller records again); graph_free frees a graph.
   * engine/model.c records a training step's forward and backward this
   * way (zt_model_step). */
  int (*graph_begin)(char *why, size_t whylen);
  void *(*graph_end)(char *why, size_t whylen);
  int (*graph_launch)(void *graph);
  void (*graph_free)(void *graph);
} zt_kernels_t;

#define ZT_KERNELS_SUMSQ_CHUNK 65536

/* GPT-2's constants, shared by every implementation (kernels/cpu/ref.c,
 * kernels/cpu/fast.c, kernels/cuda/): LayerNorm's epsilon and the
 * tanh approximation of GELU, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
#define ZT_LN_EPS 1e-5f
#define ZT_GELU_SCALE 0.7978845608028654f /* sqrt(2 / pi) */
#define ZT_GELU_CUBE 0.044715f

const zt_kernels_t *zt_kernels_cpu(void);

/* Host memory functions shared by the CPU tables (calloc, free, memcpy). */
void *zt_kernels_host_alloc(size_t bytes);
void zt_kernels_host_release(void *p);
void zt_kernels_host_copy(void *dst, const void *src, size_t bytes);
void zt_kernels_host_memzero(void *p, size_t bytes);
void zt_kernels_host_narrow_x(void *dst, const float *src, size_t n);
void zt_kernels_host_widen_x(float *dst, const void *src, size_t n);
/* The memory entries of a CPU table (designated initializers): fp32
 * storage, host memory. */
/* The Llama entries of both CPU tables (kernels/cpu/llama.c). */
void zt_kernels_host_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *w,
                                     int N, int C, float eps);
void zt_kernels_host_rmsnorm_backward(float *dinp, float *dw, const float *dout,
                                      const float *inp, const float *w, const float *rstd, int N,
                                      int C);
void zt_kernels_host_rope(float *qkv, int B, int T, int pos0, int NH, int NKV, int HD,
                          zt_rope_t rope, int inverse);
void zt_kernels_host_swiglu_forward(float *out, const float *inp, int N, int F);
void zt_kernels_host_swiglu_backward(float *dinp, const float *dout, const float *inp, int N,
                                     int F);
/* Grouped heads as multi-head ones, for the tests' independent check of the
 * grouped attention kernels: gqa_expand writes full[N, 3*NH*HD] = q, and
 * each k and v head repeated for its NH/NKV query heads, from
 * qkv[N,(NH+2*NKV)*HD]; gqa_reduce is its backward: dqkv (overwritten) = dq,
 * and each k and v head's gradient summed over its query heads. */
void zt_kernels_host_gqa_expand(float *full, const float *qkv, int N, int NH, int NKV, int HD);
void zt_kernels_host_gqa_reduce(float *dqkv, const float *dfull, int N, int NH, int NKV, int HD);
#define ZT_KERNELS_HOST_LLAMA                                                             \
  .rmsnorm_forward = zt_kernels_host_rmsnorm_forward,                                     \
  .rmsnorm_backward = zt_kernels_host_rmsnorm_backward, .rope = zt_kernels_host_rope,     \
  .swiglu_forward = zt_kernels_host_swiglu_forward,                                       \
  .swiglu_backward = zt_kernels_host_swiglu_backward

#define ZT_KERNELS_HOST_MEMORY                                                           \
  .xbytes = 4, .narrow_x = zt_kernels_host_narrow_x, .widen_x = zt_kernels_host_widen_x, \
  .alloc = zt_kernels_host_alloc, .release = zt_kernels_host_release,                    \
  .upload = zt_kernels_host_copy, .download = zt_kernels_host_copy,                      \
  .copy = zt_kernels_host_copy, .memzero = zt_kernels_host_memzero

/* The compute entries of a table whose functions are named <p>_<entry>
 * (designated initializers: both CPU tables are filled with it, so the list
 * of entries is written once). */
#define ZT_KERNELS_ENTRIES(p)                                                               \
  .encoder_forward = p##_encoder_forward, .encoder_backward = p##_encoder_backward,         \
  .layernorm_forward = p##_layernorm_forward, .layernorm_backward = p##_layernorm_backward, \
  .matmul_forward = p##_matmul_forward, .matmul_backward = p##_matmul_backward,             \
  .attention_forward = p##_attention_forward,                                               \
  .attention_backward = p##_attention_backward, .gelu_forward = p##_gelu_forward,           \
  .gelu_backward = p##_gelu_backward, .residual_forward = p##_residual_forward,             \
  .crossentropy_forward = p##_crossentropy_forward,                                         \
  .crossentropy_backward = p##_crossentropy_backward, .adamw = p##_adamw,                   \
  .sumsq = p##_sumsq, .scale = p##_scale, .zero = p##_zero, .acc_f64 = p##_acc_f64,         \
  .add_f64 = p##_add_f64, .widen_f64 = p##_widen_f64, .narrow_f64 = p##_narrow_f64

/* sumsq_f64 of both CPU tables (serial, in element order). */
double zt_kernels_host_sumsq_f64(const double *x, size_t n, double s);
const zt_kernels_t *zt_kernels_ref(void);

/* Sets the number of CPU threads used by the OpenMP kernels and by OpenBLAS
 * (n <= 0 leaves the defaults). Returns the number now in use. */
int zt_kernels_cpu_set_threads(int n);

/* The matrix product under zt_kernels_cpu(): "avx512" (our own, on CPUs
 * with AVX-512F; its results do not depend on the thread count) or "blas"
 * (OpenBLAS's sgemm; ZT_SGEMM=blas forces it). kernels/cpu/gemm.c. */
const char *zt_kernels_cpu_sgemm(void);

#endif
