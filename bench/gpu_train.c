/*
 * gpu_train.c: zt_gpubench, training throughput of the model on one GPU.
 *
 * Builds the GPT-2 model of engine/model.c on the CUDA kernel table (GPT-2
 * 124M by default: 12 layers, 768 wide, 12 heads, T=1024, vocab 50257
 * padded to 50304), then times full training steps: zero gradients,
 * forward with loss and backward (zt_model_step: one CUDA graph launch for
 * both passes after the first two steps), AdamW over all parameters. Tokens are drawn
 * from a fixed pseudo-random stream on the host and uploaded every step, as
 * a data loader would. The first WARMUP steps are not timed.
 *
 * Prints one line of JSON (for bench/gpu-train) with ms/step (median),
 * tokens/s, achieved TFLOP/s with the usual estimate of training flops per
 * token, 6 N + 6 L C T (N parameters without padding), MFU against the
 * device's dense bf16 peak (989 TFLOP/s for H100/H200 SXM, 312 for A100;
 * ZT_PEAK_TFLOPS overrides), the first and last loss, and device memory in
 * use.
 *
 * usage: zt_gpubench [--layers L] [--embd C] [--heads H] [--seq T] [--vocab V]
 *                    [--batch B] [--steps N] [--math fp32|tf32|bf16|bf16-storage]
 *                    [--attention auto|fa2|cublas] [--arch gpt2|llama]
 *                    [--profile] [--no-gelu-epilogue] [--no-graphs]
 * (--arch llama: the same sizes as a Llama, with 4 query heads per K/V head
 * where the head count allows, an MLP of 8C/3 rounded up to 64, untied.)
 * (auto: the kernels' own choice, flash attention 2 with bf16 storage where
 * the head size allows, else cuBLASLt; fa2: flash attention 2 on mma.sync
 * (the same as auto, named), bf16 storage only; cublas: the cuBLASLt
 * products with T x T matrices, whatever the storage.) --profile: one more
 * step after the timed ones, with the kernel table's profile on
 * (zt_kernels_cuda_profile), whose report goes to stderr.
 * --no-gelu-epilogue: the MLP's GELU as calls of its own, not in the
 * products' epilogues (zt_kernels_cuda_set_gelu_epilogue). --no-graphs:
 * every step call by call, without CUDA graphs (the profiled step always
 * is). The JSON says how many steps a graph launch ran ("graph_launches")
 * or why graphs were off ("graphs_off"). Exits 77 without a CUDA device.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model.h"
#include "zt_common.h"
#include "zt_kernels.h"
#include "zt_kernels_cuda.h"

#define WARMUP 3

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double peak_tflops(const char *name) {
  const char *env = getenv("ZT_PEAK_TFLOPS");
  if (env) return atof(env);
  if (strstr(name, "H100") || strstr(name, "H200")) return 989.0;
  if (strstr(name, "A100")) return 312.0;
  return 0.0;
}

static int usage(void) {
  fprintf(stderr,
          "usage: zt_gpubench [--layers L] [--embd C] [--heads H] [--seq T] [--vocab V]\n"
          "                   [--batch B] [--steps N] [--math fp32|tf32|bf16|bf16-storage]\n"
          "                   [--attention auto|fa2|cublas] [--arch gpt2|llama]\n"
          "                   [--profile] [--no-gelu-epilogue] [--no-graphs]\n");
  return 2;
}

int main(int argc, char **argv) {
  zt_model_config_t cfg = {.n_layer = 12, .n_head = 12, .n_embd = 768, .seq_len = 1024,
                           .vocab_size = 50257};
  int B = 8, steps = 20;
  zt_cuda_math_t math = ZT_CUDA_MATH_BF16;
  const char *math_name = "bf16", *att = "auto";
  int storage16 = 0; /* bf16-storage: the bf16 table and an fp32 master (zt_kernels.h) */
  int profile = 0, no_gelu_epi = 0, graphs = 1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--profile")) {
      profile = 1;
      continue;
    }
    if (!strcmp(a, "--no-gelu-epilogue")) {
      no_gelu_epi = 1;
      continue;
    }
    if (!strcmp(a, "--no-graphs")) {
      graphs = 0;
      continue;
    }
    if (!v) return usage();
    i++;
    if (!strcmp(a, "--layers")) cfg.n_layer = atoi(v);
    else if (!strcmp(a, "--embd")) cfg.n_embd = atoi(v);
    else if (!strcmp(a, "--heads")) cfg.n_head = atoi(v);
    else if (!strcmp(a, "--seq")) cfg.seq_len = atoi(v);
    else if (!strcmp(a, "--vocab")) cfg.vocab_size = atoi(v);
    else if (!strcmp(a, "--batch")) B = atoi(v);
    else if (!strcmp(a, "--arch")) {
      if (strcmp(v, "gpt2") && strcmp(v, "llama")) return usage();
      cfg.arch = strcmp(v, "llama") ? ZT_ARCH_GPT2 : ZT_ARCH_LLAMA;
    }
    else if (!strcmp(a, "--steps")) steps = atoi(v);
    else if (!strcmp(a, "--attention")) {
      att = v;
      if (strcmp(v, "auto") && strcmp(v, "fa2") && strcmp(v, "cublas")) return usage();
    }
    else if (!strcmp(a, "--math")) {
      math_name = v;
      if (!strcmp(v, "fp32")) math = ZT_CUDA_MATH_FP32;
      else if (!strcmp(v, "tf32")) math = ZT_CUDA_MATH_TF32;
      else if (!strcmp(v, "bf16")) math = ZT_CUDA_MATH_BF16;
      else if (!strcmp(v, "bf16-storage")) math = ZT_CUDA_MATH_BF16, storage16 = 1;
      else return usage();
    } else return usage();
  }
  if (steps <= WARMUP || B < 1) return usage();
  if (cfg.arch == ZT_ARCH_LLAMA) {
    cfg.n_kv_head = cfg.n_head % 4 ? cfg.n_head : cfg.n_head / 4;
    cfg.head_dim = cfg.n_embd / cfg.n_head;
    cfg.n_ff = (8 * cfg.n_embd / 3 + 63) / 64 * 64;
    cfg.rope_theta = 10000.0f;
    cfg.norm_eps = 1e-5f;
  }
  char err[256];
  if (zt_cuda_device_count() == 0 || zt_kernels_cuda_init(0, err, sizeof err) != 0) {
    printf("zt_gpubench: skipped: no CUDA device\n");
    return 77;
  }
  zt_kernels_cuda_set_math(math);
  if (no_gelu_epi) zt_kernels_cuda_set_gelu_epilogue(0);
  if (!strcmp(att, "fa2") && !storage16) {
    fprintf(stderr, "zt_gpubench: --attention %s takes --math bf16-storage\n", att);
    return 2;
  }
  zt_kernels_cuda_set_attention_fa2(strcmp(att, "cublas") != 0);
  const zt_kernels_t *k = storage16 ? zt_kernels_cuda_bf16() : zt_kernels_cuda();
  int T = cfg.seq_len;
  zt_model_t *m;
  if (zt_model_create(&m, &cfg, B, T, k, 0) != 0) {
    fprintf(stderr, "zt_gpubench: cannot create the model: %s\n", zt_err_msg());
    return 1;
  }
  zt_model_init(m, 1337);
  zt_model_set_graphs(m, graphs);
  size_t P = m->lay.num_params;
  float *mom = k->alloc(P * sizeof(float)), *var = k->alloc(P * sizeof(float));
  /* With bf16 storage AdamW updates an fp32 master, rounded into the
   * model's bf16 parameters after each step (as engine/zero.c does); the
   * master starts from the rounded initial values. */
  float *master = storage16 ? k->alloc(P * sizeof(float)) : m->params;
  if (storage16 && master) k->widen_x(master, m->params, P);
  if (!mom || !var || !master) {
    fprintf(stderr, "zt_gpubench: out of device memory for the optimizer state\n");
    return 1;
  }
  int *inp = malloc(sizeof(int) * B * T), *tgt = malloc(sizeof(int) * B * T);
  double *times = calloc((size_t)steps, sizeof(double));
  uint64_t s = 42;
  float first = 0, last = 0;
  for (int step = 0; step < steps + profile; step++) {
    if (step == steps) { /* the profile times each call: no graph */
      zt_model_set_graphs(m, 0);
      zt_kernels_cuda_profile(1);
    }
    for (int i = 0; i < B * T; i++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      inp[i] = (int)((s >> 33) % (uint64_t)cfg.vocab_size);
      tgt[i] = (int)((s >> 13) % (uint64_t)cfg.vocab_size);
    }
    double t0 = now_s();
    float loss;
    zt_model_zero_grads(m);
    if (zt_model_step(m, inp, tgt, B, T, 1.0f, &loss) != 0) {
      fprintf(stderr, "zt_gpubench: step failed: %s\n", zt_err_msg());
      return 1;
    }
    float t = (float)(step + 1);
    /* One launch where the table has the fused AdamW (with the bf16 round
     * of the working copy), as engine/zero.c makes; else the two calls. */
    zt_adamw_args_t a = {.n = 1, .end = {P}, .wd = {0.0f}, .lr = 6e-4f, .b1 = 0.9f,
                         .b2 = 0.95f, .eps = 1e-8f, .bc1 = 1.0f - powf(0.9f, t),
                         .bc2 = 1.0f - powf(0.95f, t)};
    if (k->adamw_fused) {
      k->adamw_fused(master, m->grads, NULL, 1.0, 1.0f, mom, var, storage16 ? m->params : NULL,
                     &a);
    } else {
      k->adamw(master, m->grads, mom, var, P, a.lr, a.b1, a.b2, a.eps, 0.0f, a.bc1, a.bc2);
      if (storage16) k->narrow_x(m->params, master, P);
    }
    zt_cuda_sync();
    if (step == steps) break;
    times[step] = now_s() - t0;
    if (step == 0) first = loss;
    last = loss;
  }
  if (profile) {
    zt_kernels_cuda_profile(0);
    fprintf(stderr, "profile of one step, batch %d x %d, %s, attention %s:\n", B, T, math_name,
            att);
    zt_kernels_cuda_profile_report(stderr);
  }
  int timed = steps - WARMUP;
  qsort(times + WARMUP, (size_t)timed, sizeof(double), cmp_d);
  double ms = times[WARMUP + timed / 2] * 1e3;
  double tokens = (double)B * T;
  size_t N = zt_model_param_count(&cfg, 0);
  double flops = (6.0 * N + 6.0 * cfg.n_layer * cfg.n_embd * (double)T) * tokens;
  double tflops = flops / (ms * 1e-3) / 1e12, peak = peak_tflops(zt_cuda_device_name());
  /* params (+ master), grads, m, v */
  size_t act = zt_model_activation_bytes(m),
         state = P * (3 * sizeof(float) + (size_t)k->xbytes) + (storage16 ? P * sizeof(float) : 0);
  printf("{\"engine\": \"ztrain\", \"math\": \"%s\", \"device\": \"%s\", \"params\": %zu, "
         "\"batch\": %d, \"seq\": %d, \"ms_per_step\": %.2f, \"tokens_per_s\": %.0f, "
         "\"tflops\": %.1f, \"mfu\": %.4f, \"loss_first\": %.4f, \"loss_last\": %.4f, "
         "\"gib_model_state\": %.2f, \"gib_activations\": %.2f, \"attention\": \"%s\", "
         "\"gib_device_used\": %.2f, \"graph_launches\": %ld, \"graphs_off\": \"%s\"}\n",
         math_name, zt_cuda_device_name(), N, B, T, ms, tokens / (ms * 1e-3), tflops,
         peak > 0 ? tflops / peak : 0.0, first, last, state / 1073741824.0, act / 1073741824.0,
         att, zt_cuda_device_memory_used() / 1073741824.0, m->graph.replays,
         graphs ? m->graph.why : "--no-graphs");
  k->release(mom), k->release(var);
  if (storage16) k->release(master);
  zt_model_free(m);
  free(inp), free(tgt), free(times);
  return 0;
}
