/*
 * test_gpu_train.c: the GPT-2 model on the CUDA kernel table against the CPU.
 *
 * The model code (worker/model.c) is the same for both: only the kernel
 * table differs, and with it where parameters, gradients and activations
 * live (device memory for CUDA).
 *
 *   gradients   one forward + backward of a 2-layer model on the serial CPU
 *               reference and on the GPU (fp32 math) from the same init and
 *               batch: the loss within 1e-5 relative, every tensor's
 *               gradient within 1e-4 of that tensor's largest |gradient|;
 *               GPT-2, and a Llama with 2 query heads per K/V head and
 *               q/k/v biases.
 *   training    20 AdamW steps on a fixed token stream (a noisy affine
 *               recurrence, learnable within a few steps) with the fast CPU
 *               table and with the GPU: with fp32 math every step's loss
 *               within 1e-4 relative of the CPU's (summation order is the
 *               only difference; Adam normalises the updates, so the gap
 *               stays at rounding level over 20 steps), with bf16 tensor-core
 *               products within 2e-2 relative, and so with bf16 storage (the
 *               bf16 table: bf16 activations and parameter copy, fp32 master
 *               updated by AdamW and rounded into the copy after each step;
 *               2.9e-4 measured on the CPU stand-in); all must learn (loss of
 *               step 20 at least 1.0 below step 1).
 *   graphs      the 20 steps with bf16 storage through zt_model_step, with
 *               CUDA graphs and without, steps 13-16 on half a batch: every
 *               loss and every final parameter bit-identical; a recording
 *               launched for the steps after it, another after each change
 *               of the batch shape. And with a table whose encoder_forward
 *               waits for the device: the recording fails, graphs turn off
 *               with the reason, and the steps still give the same bits.
 *               On the stand-in, a child process whose other thread calls
 *               the table while a graph is recorded stops, saying so.
 *
 * Exits 77 (skipped) without a CUDA device.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "model.h"
#include "zt_kernels.h"
#include "zt_kernels_cuda.h"
#include "zt_test.h"

#define B 4
#define T 64
#define STEPS 20

static const zt_model_config_t cfg = {
    .n_layer = 2, .n_head = 4, .n_embd = 64, .seq_len = T, .vocab_size = 257};
static const zt_model_config_t cfg_llama = {.arch = ZT_ARCH_LLAMA,
                                            .n_layer = 2,
                                            .n_head = 4,
                                            .n_kv_head = 2,
                                            .head_dim = 16,
                                            .n_embd = 64,
                                            .n_ff = 96,
                                            .rope_theta = 10000.0f,
                                            .norm_eps = 1e-5f,
                                            .qkv_bias = 1,
                                            .seq_len = T,
                                            .vocab_size = 257};

/* Token stream: x' = (5x + 3) mod 257, replaced by a random token with
 * probability 1/8. */
static void make_stream(int *tok, size_t n) {
  uint64_t s = 12345;
  int x = 1;
  for (size_t i = 0; i < n; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = ((s >> 33) % 8 == 0) ? (int)((s >> 40) % 257) : (5 * x + 3) % 257;
    tok[i] = x;
  }
}

/* One step's batch: inputs and next-token targets from the stream. */
static void batch(const int *stream, int step, int *inp, int *tgt) {
  for (int b = 0; b < B; b++) {
    const int *p = stream + ((size_t)step * B + b) * (T + 1);
    memcpy(inp + b * T, p, T * sizeof(int));
    memcpy(tgt + b * T, p + 1, T * sizeof(int));
  }
}

static float *host_copy(const zt_kernels_t *k, const float *p, size_t n) {
  float *h = malloc(n * sizeof(float) + 1);
  k->download(h, p, n * sizeof(float));
  return h;
}

static void check_gradients(const zt_model_config_t *c) {
  zt_kernels_cuda_set_math(ZT_CUDA_MATH_FP32);
  const zt_kernels_t *tabs[2] = {zt_kernels_ref(), zt_kernels_cuda()};
  zt_model_t *m[2];
  float loss[2];
  int *stream = malloc(sizeof(int) * B * (T + 1)), inp[B * T], tgt[B * T];
  make_stream(stream, (size_t)B * (T + 1));
  batch(stream, 0, inp, tgt);
  for (int i = 0; i < 2; i++) {
    ZT_REQUIRE(zt_model_create(&m[i], c, B, T, tabs[i], 0) == 0);
    zt_model_init(m[i], 7);
    zt_model_zero_grads(m[i]);
    ZT_REQUIRE(zt_model_forward(m[i], inp, tgt, B, T, &loss[i]) == 0);
    ZT_REQUIRE(zt_model_backward(m[i], 1.0f) == 0);
  }
  fprintf(stderr, "  loss cpu-ref %.7f gpu %.7f\n", loss[0], loss[1]);
  ZT_CHECK_NEAR(loss[1], loss[0], 1e-5 * loss[0]);
  float *gref = m[0]->grads, *ggpu = host_copy(tabs[1], m[1]->grads, m[1]->lay.num_params);
  for (int t = 0; t < m[0]->lay.num_tensors; t++) {
    const zt_tensor_t *ts = &m[0]->lay.tensors[t];
    double maxr = 0, maxd = 0;
    for (size_t j = 0; j < ts->n; j++) {
      maxr = fmax(maxr, fabs(gref[ts->off + j]));
      maxd = fmax(maxd, fabs((double)ggpu[ts->off + j] - gref[ts->off + j]));
    }
    if (!(maxd <= 1e-4 * maxr + 1e-9)) {
      fprintf(stderr, "  %s: max |gpu - ref| %.3g, max |ref| %.3g\n", ts->name, maxd, maxr);
      zt__test_failed = 1;
    }
  }
  free(ggpu), free(stream);
  zt_model_free(m[0]), zt_model_free(m[1]);
}

ZT_TEST(gradients_match_reference) {
  check_gradients(&cfg);
  check_gradients(&cfg_llama);
}

/* How train() runs its steps: graphs -1 calls zt_model_forward and
 * zt_model_backward; 0 or 1 zt_model_step with graphs off or on, with half
 * a batch in steps 13-16 when `shapes`. The final fp32 parameters (the
 * master with bf16 storage) and the model's graph record come back when
 * asked for. */
typedef struct hook_log hook_log;
typedef struct {
  int graphs, shapes;
  float **params_out; /* malloc'd here */
  zt_model_graph_t *graph_out;
  hook_log *hooks; /* hooks with fixed_units (below), or NULL */
} run_opts;

/* Hooks with fixed_units that work on the device between the segments:
 * post_backward halves the unit's gradient; every call is logged. With
 * move_at > 0, the hook call of that number moves unit 1's gradient to
 * another buffer, which fixed_units rules out. */
struct hook_log {
  zt_model_t *m;
  int log[1024], n, move_at;
  float *spare;
};
static int logged(hook_log *c, int code) {
  if (c->n < 1024) c->log[c->n] = code;
  if (++c->n == c->move_at) c->m->unit_grads[1] = c->spare;
  return 0;
}
static int h_pf(void *x, int u) { return logged(x, 1000 + u); }
static int h_pb(void *x, int u) { return logged(x, 2000 + u); }
static int h_qb(void *x, int u) {
  hook_log *c = x;
  c->m->k->scale(c->m->unit_grads[u], c->m->lay.unit_size[u], 0.5f);
  return logged(x, 3000 + u);
}
static void set_logging_hooks(zt_model_t *m, hook_log *c) {
  c->m = m;
  zt_model_hooks_t h = {.ctx = c, .pre_forward = h_pf, .pre_backward = h_pb,
                        .post_backward = h_qb, .fixed_units = 1};
  zt_model_set_hooks(m, &h);
}

/* 20 AdamW steps (lr 3e-3, no weight decay) with table k; losses out.
 * With bf16 storage (xbytes 2) the model's parameters are a bf16 copy of
 * an fp32 master that AdamW updates, rounded again after each step, as the
 * trainer (engine/zero.c) keeps them. */
static int train_with(const zt_kernels_t *k, const int *stream, float *losses, run_opts o) {
  zt_model_t *m;
  if (zt_model_create(&m, &cfg, B, T, k, 0) != 0) return -1;
  zt_model_init(m, 1);
  if (o.graphs >= 0) zt_model_set_graphs(m, o.graphs);
  if (o.hooks) set_logging_hooks(m, o.hooks);
  size_t P = m->lay.num_params;
  float *mom = k->alloc(P * sizeof(float)), *var = k->alloc(P * sizeof(float));
  float *master = m->params;
  if (k->xbytes != 4) {
    master = k->alloc(P * sizeof(float));
    for (int u = 0; u < m->lay.num_units; u++) {
      float *h = malloc(m->lay.unit_size[u] * sizeof(float) + 1);
      zt_layout_init_unit(&m->lay, 1, u, h);
      k->upload(master + m->lay.unit_off[u], h, m->lay.unit_size[u] * sizeof(float));
      free(h);
    }
  }
  int inp[B * T], tgt[B * T];
  for (int s = 0; s < STEPS; s++) {
    batch(stream, s, inp, tgt);
    zt_model_zero_grads(m);
    int bs = o.shapes && s >= 12 && s < 16 ? B / 2 : B;
    if (o.graphs >= 0 ? zt_model_step(m, inp, tgt, bs, T, 1.0f, &losses[s]) != 0
                      : (zt_model_forward(m, inp, tgt, B, T, &losses[s]) != 0 ||
                         zt_model_backward(m, 1.0f) != 0))
      return -1;
    float t = (float)(s + 1);
    k->adamw(master, m->grads, mom, var, P, 3e-3f, 0.9f, 0.95f, 1e-8f, 0.0f,
             1.0f - powf(0.9f, t), 1.0f - powf(0.95f, t));
    if (master != m->params) k->narrow_x(m->params, master, P);
  }
  if (o.params_out) {
    *o.params_out = malloc(P * sizeof(float));
    k->download(*o.params_out, master, P * sizeof(float));
  }
  if (o.graph_out) *o.graph_out = m->graph;
  k->release(mom), k->release(var);
  if (master != m->params) k->release(master);
  zt_model_free(m);
  return 0;
}

static int train(const zt_kernels_t *k, const int *stream, float *losses) {
  return train_with(k, stream, losses, (run_opts){.graphs = -1});
}

ZT_TEST(training_tracks_cpu) {
  int *stream = malloc(sizeof(int) * STEPS * B * (T + 1));
  make_stream(stream, (size_t)STEPS * B * (T + 1));
  float cpu[STEPS], gpu[STEPS], gbf[STEPS], gx[STEPS];
  ZT_REQUIRE(train(zt_kernels_cpu(), stream, cpu) == 0);
  zt_kernels_cuda_set_math(ZT_CUDA_MATH_FP32);
  ZT_REQUIRE(train(zt_kernels_cuda(), stream, gpu) == 0);
  zt_kernels_cuda_set_math(ZT_CUDA_MATH_BF16);
  ZT_REQUIRE(train(zt_kernels_cuda(), stream, gbf) == 0);
  zt_kernels_cuda_set_math(ZT_CUDA_MATH_FP32);
  ZT_REQUIRE(train(zt_kernels_cuda_bf16(), stream, gx) == 0);
  double worst32 = 0, worst16 = 0, worstx = 0;
  for (int s = 0; s < STEPS; s++) {
    worst32 = fmax(worst32, fabs((double)gpu[s] - cpu[s]) / cpu[s]);
    worst16 = fmax(worst16, fabs((double)gbf[s] - cpu[s]) / cpu[s]);
    worstx = fmax(worstx, fabs((double)gx[s] - cpu[s]) / cpu[s]);
    if (s % 5 == 0 || s == STEPS - 1)
      fprintf(stderr, "  step %2d  cpu %.6f  gpu-fp32 %.6f  gpu-bf16 %.6f  bf16 storage %.6f\n",
              s + 1, cpu[s], gpu[s], gbf[s], gx[s]);
  }
  fprintf(stderr, "  worst relative difference: fp32 %.2e, bf16 products %.2e, bf16 storage %.2e\n",
          worst32, worst16, worstx);
  ZT_CHECK(worst32 <= 1e-4);
  ZT_CHECK(worst16 <= 2e-2);
  ZT_CHECK(worstx <= 2e-2);
  ZT_CHECK(gx[STEPS - 1] < gx[0] - 1.0f);
  ZT_CHECK(cpu[STEPS - 1] < cpu[0] - 1.0f);
  ZT_CHECK(gpu[STEPS - 1] < gpu[0] - 1.0f);
  ZT_CHECK(gbf[STEPS - 1] < gbf[0] - 1.0f);
  free(stream);
}

/* A copy of a table whose encoder_forward also waits for the device: a
 * call no graph can hold. */
static zt_kernels_t syncing;
static void (*encoder_forward_orig)(float *, const int *, const float *, const float *, int, int,
                                    int);
static void encoder_forward_then_sync(float *out, const int *inp, const float *wte,
                                      const float *wpe, int Bn, int Tn, int C) {
  encoder_forward_orig(out, inp, wte, wpe, Bn, Tn, C);
  syncing.sync();
}

/* 1 when two runs' losses and final parameters have the same bits. */
static int same_bits(const float *la, const float *pa, const float *lb, const float *pb) {
  return !memcmp(la, lb, STEPS * sizeof(float)) &&
         !memcmp(pa, pb, zt_model_param_count(&cfg, 1) * sizeof(float));
}

ZT_TEST(graphs_replay_the_same_bits) {
  int *stream = malloc(sizeof(int) * STEPS * B * (T + 1));
  make_stream(stream, (size_t)STEPS * B * (T + 1));
  zt_kernels_cuda_set_math(ZT_CUDA_MATH_FP32);
  const zt_kernels_t *k = zt_kernels_cuda_bf16();
  float off[STEPS], on[STEPS], sy[STEPS], *poff = NULL, *pon = NULL, *psy = NULL;
  zt_model_graph_t g, gs;
  ZT_REQUIRE(train_with(k, stream, off, (run_opts){0, 1, &poff, NULL, NULL}) == 0);
  ZT_REQUIRE(train_with(k, stream, on, (run_opts){1, 1, &pon, &g, NULL}) == 0);
  /* A call that cannot be recorded. */
  syncing = *k;
  encoder_forward_orig = syncing.encoder_forward;
  syncing.encoder_forward = encoder_forward_then_sync;
  ZT_REQUIRE(train_with(&syncing, stream, sy, (run_opts){1, 1, &psy, &gs, NULL}) == 0);
  fprintf(stderr, "  step 20 loss %.7f without graphs, %.7f with (%ld recordings, %ld launches), "
          "%.7f with a sync inside (graphs off: %s)\n", off[STEPS - 1], on[STEPS - 1],
          g.captures, g.replays, sy[STEPS - 1], gs.why);
  ZT_CHECK(same_bits(off, poff, on, pon));
  /* Step 1 warms up, step 2 records and launches, 3-12 launch; step 13
   * (half a batch) warms up, 14 records, 15-16 launch; 17 (a full batch
   * again) warms up, 18 records, 19-20 launch. */
  ZT_CHECK(g.captures == 3 && g.replays == STEPS - 3 && g.on && !g.why[0]);
  ZT_CHECK(same_bits(off, poff, sy, psy));
  ZT_CHECK(gs.captures == 0 && gs.replays == 0 && !gs.on);
  ZT_CHECK(strstr(gs.why, "sync inside the captured calls") != NULL);
  free(poff), free(pon), free(psy), free(stream);
}

ZT_TEST(graphs_run_hooks_between_segments) {
  int *stream = malloc(sizeof(int) * STEPS * B * (T + 1));
  make_stream(stream, (size_t)STEPS * B * (T + 1));
  zt_kernels_cuda_set_math(ZT_CUDA_MATH_FP32);
  const zt_kernels_t *k = zt_kernels_cuda_bf16();
  static hook_log hoff, hon;
  float off[STEPS], on[STEPS], *poff = NULL, *pon = NULL;
  zt_model_graph_t g;
  ZT_REQUIRE(train_with(k, stream, off, (run_opts){0, 0, &poff, NULL, &hoff}) == 0);
  ZT_REQUIRE(train_with(k, stream, on, (run_opts){1, 0, &pon, &g, &hon}) == 0);
  /* 4 units: 4 pre_forward, 4 pre_backward, 4 post_backward a step; the
   * recording calls none. */
  fprintf(stderr, "  step 20 loss %.7f without graphs, %.7f with; %ld recording(s) of %d "
          "segments, %ld launches; %d hook calls each\n", off[STEPS - 1], on[STEPS - 1],
          g.captures, g.nsegs, g.replays, hon.n);
  ZT_CHECK(same_bits(off, poff, on, pon));
  ZT_CHECK(g.captures == 1 && g.replays == STEPS - 1 && g.nsegs == 13);
  ZT_CHECK(hon.n == 12 * STEPS && hoff.n == hon.n &&
           !memcmp(hon.log, hoff.log, (size_t)hon.n * sizeof(int)));
  free(poff), free(pon);

  /* A hook that breaks fixed_units in a step from the recording: the step
   * fails, saying so, and graphs are off. */
  zt_model_t *m;
  ZT_REQUIRE(zt_model_create(&m, &cfg, B, T, k, 0) == 0);
  zt_model_init(m, 1);
  static hook_log hmove;
  hmove.spare = k->alloc(m->lay.unit_size[1] * sizeof(float));
  hmove.move_at = 2 * 12 + 6; /* step 3's second pre_backward */
  set_logging_hooks(m, &hmove);
  int inp[B * T], tgt[B * T], rc = 0;
  float l;
  for (int s = 0; s < 3 && rc == 0; s++) {
    batch(stream, s, inp, tgt);
    rc = zt_model_step(m, inp, tgt, B, T, 1.0f, &l);
  }
  fprintf(stderr, "  a hook that moves a buffer: %s\n", rc ? zt_err_msg() : "no error");
  ZT_CHECK(rc == -1 && strstr(zt_err_msg(), "moved a unit's buffers") && !m->graph.on);
  k->release(hmove.spare);
  zt_model_free(m);
  free(stream);
}

/* The table called from another thread during a recording (the stand-in
 * only: a child process, which a CUDA context does not survive). */
static const zt_kernels_t *thr_k;
static float *thr_buf;
static void *other_thread(void *x) {
  (void)x;
  thr_k->zero(thr_buf, 16);
  return NULL;
}

ZT_TEST(graphs_refuse_other_threads) {
  if (!strstr(zt_cuda_device_name(), "stand-in")) return;
  int fd[2];
  ZT_REQUIRE(pipe(fd) == 0);
  fflush(stdout), fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fd[1], 2), close(fd[0]), close(fd[1]);
    alarm(120); /* never a hang */
    thr_k = zt_kernels_cuda_bf16();
    thr_buf = thr_k->alloc(64);
    char why[200];
    pthread_t th;
    if (thr_k->graph_begin(why, sizeof why) != 0 || pthread_create(&th, NULL, other_thread, NULL))
      _exit(3);
    pthread_join(th, NULL);
    _exit(0); /* the guard did not stop it */
  }
  close(fd[1]);
  char out[4096];
  size_t n = 0;
  ssize_t r;
  while (n < sizeof out - 1 && (r = read(fd[0], out + n, sizeof out - 1 - n)) > 0) n += (size_t)r;
  out[n] = 0;
  close(fd[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  fprintf(stderr, "  child: exit %d, \"%s\"\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1, out);
  ZT_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1);
  ZT_CHECK(strstr(out, "zero called from another thread while a CUDA graph is being recorded"));
}

int run_all(int argc, char **argv);

int main(int argc, char **argv) {
  char err[256];
  int n = zt_cuda_device_count();
  if (n == 0 || zt_kernels_cuda_init(0, err, sizeof err) != 0) {
    printf("test_gpu_train: skipped: %s\n", n == 0 ? "no CUDA device" : err);
    return 77;
  }
  return run_all(argc, argv);
}

ZT_TEST_MAIN_NAMED(run_all, gradients_match_reference, training_tracks_cpu,
                   graphs_replay_the_same_bits, graphs_run_hooks_between_segments,
                   graphs_refuse_other_threads)
