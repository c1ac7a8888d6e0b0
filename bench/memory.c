/*
 * memory.c: zt_bench_memory, one configuration of bench/memory.
 *
 *   zt_bench_memory B T [--recompute] [--layers L] [--embd C] [--heads NH]
 *                   [--steps S] [--threads N]
 *
 * Creates the model (fp32, CPU kernels, vocabulary 257) with activations
 * for B x T, with or without activation checkpointing (ZT_MODEL_RECOMPUTE),
 * runs S forward + backward passes on random tokens and prints one JSON
 * line: the activation bytes the model allocated, the attention's share of
 * them (lse, [L, B, NH, T]) next to what the untiled kernel kept
 * ([L, B, NH, T, T] probabilities), the median ms of a forward + backward,
 * and the process's peak RSS (getrusage), so each configuration runs in
 * its own process.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "model.h"
#include "zt_common.h"
#include "zt_kernels.h"

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: zt_bench_memory B T [--recompute] [--layers L] [--embd C] "
                    "[--heads NH] [--steps S] [--threads N]\n");
    return 2;
  }
  int B = atoi(argv[1]), T = atoi(argv[2]), L = 6, C = 384, NH = 6, steps = 3, threads = 2;
  unsigned flags = 0;
  for (int i = 3; i < argc; i++) {
    int more = i + 1 < argc;
    if (!strcmp(argv[i], "--recompute")) flags |= ZT_MODEL_RECOMPUTE;
    else if (!strcmp(argv[i], "--layers") && more) L = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--embd") && more) C = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--heads") && more) NH = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--steps") && more) steps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--threads") && more) threads = atoi(argv[++i]);
    else return fprintf(stderr, "zt_bench_memory: bad argument %s\n", argv[i]), 2;
  }
  if (B < 1 || T < 1 || steps < 1 || steps > 100) return fprintf(stderr, "bad sizes\n"), 2;
  zt_kernels_cpu_set_threads(threads);
  zt_model_config_t cfg = {.n_layer = L, .n_head = NH, .n_embd = C, .seq_len = T,
                           .vocab_size = 257};
  zt_model_t *m;
  if (zt_model_create(&m, &cfg, B, T, zt_kernels_cpu(), flags) != 0) {
    fprintf(stderr, "zt_bench_memory: %s\n", zt_err_msg());
    return 1;
  }
  zt_model_init(m, 1);
  int *inp = zt_xmalloc(sizeof(int) * (size_t)B * T), *tgt = zt_xmalloc(sizeof(int) * (size_t)B * T);
  for (int i = 0; i < B * T; i++) inp[i] = (i * 7919) % 257, tgt[i] = (i * 104729 + 3) % 257;
  double *ms = zt_xmalloc(sizeof(double) * (size_t)steps);
  for (int s = 0; s < steps; s++) {
    float loss;
    int64_t t0 = zt_now_us();
    zt_model_zero_grads(m);
    if (zt_model_forward(m, inp, tgt, B, T, &loss) != 0 || zt_model_backward(m, 1.0f) != 0) {
      fprintf(stderr, "zt_bench_memory: %s\n", zt_err_msg());
      return 1;
    }
    ms[s] = (double)(zt_now_us() - t0) / 1000.0;
  }
  qsort(ms, (size_t)steps, sizeof *ms, cmp_d);
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  double lse = 4.0 * L * B * NH * T, probs = 4.0 * L * B * NH * (double)T * T;
  printf("{\"B\": %d, \"T\": %d, \"recompute\": %d, \"activation_bytes\": %zu, "
         "\"attention_bytes\": %.0f, \"untiled_attention_bytes\": %.0f, \"ms\": %.1f, "
         "\"peak_rss_bytes\": %ld}\n",
         B, T, (flags & ZT_MODEL_RECOMPUTE) != 0, zt_model_activation_bytes(m), lse, probs,
         ms[steps / 2], ru.ru_maxrss * 1024L);
  free(ms), free(inp), free(tgt);
  zt_model_free(m);
  return 0;
}
