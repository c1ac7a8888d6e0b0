/*
 * zsolo.c: zsolo, single-process training from a job spec.
 *
 *   zsolo SPEC.json [--threads N] [--steps N] [--log-every N] [--json]
 *                   [--device cpu|cuda|cuda:N]
 *
 * Trains the spec's model on its data in this process, with no coordinator:
 * the same trainer as zworker (engine/trainer.c) on a communicator of one
 * rank, so a zsolo run and a distributed job of the same spec produce the
 * same losses. It prints one line per logged step:
 *
 *   step 12/300 | loss 2.31234455 | norm 0.8123 | lr 3.0000e-04 | 41.2 ms | 49673 tok/s
 *
 * or, with --json, one JSON object per line:
 *
 *   {"step":12,"loss":2.31234455,"grad_norm":0.8123,"lr":0.0003,"ms":41.2,
 *    "tokens_per_s":49673,"val_loss":null}
 *
 * Losses are printed with %.9g, which round-trips a float, so two runs can be
 * compared bit for bit. Steps where an evaluation ran are always printed.
 * The run is deterministic for a fixed thread count. Exit status: 0 on
 * success, 1 on any error (with the message on stderr), 2 on bad usage.
 *
 *   zsolo sample EPOCH_DIR [--prompt TEXT] [--tokens N] [--temperature T]
 *                [--top-k K] [--seed N] [--tokenizer RECORD.json] [--threads N]
 *
 * generates text from a committed checkpoint epoch (engine/sample.h, the
 * same function as `zctl sample`): the prompt, then each new token's text
 * as it is made, on stdout; a summary line on stderr.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "hfconfig.h"
#include "sample.h"
#include "spec.h"
#include "trainer.h"
#include "zt_common.h"
#include "zt_kernels.h"

static volatile sig_atomic_t g_stop;
static void on_signal(int sig) { (void)sig, g_stop = 1; }

typedef struct {
  long steps, log_every;
  int json;
} solo;

static void usage(void) {
  fprintf(stderr,
          "usage: zsolo SPEC.json [--threads N] [--steps N] [--log-every N] [--json]\n"
          "                       [--device cpu|cuda|cuda:N]\n"
          "       zsolo sample EPOCH_DIR [--prompt TEXT] [--tokens N] [--temperature T]\n"
          "                    [--top-k K] [--seed N] [--tokenizer RECORD.json] [--threads N]\n");
}

/* zsolo sample EPOCH_DIR [options] (argv after "sample"). */
static int sample_main(int argc, char **argv) {
  zt_sample_cmd_t c;
  zt_sample_cmd_init(&c, "zsolo");
  for (int i = 0; i < argc; i++) {
    int r = argv[i][0] == '-' ? zt_sample_cmd_opt(&c, argv[i], i + 1 < argc ? argv[i + 1] : NULL)
                              : 0;
    if (r < 0) {
      fprintf(stderr, "zsolo: %s\n", zt_err_msg());
      return 2;
    }
    if (r == 1) i++;
    else if (argv[i][0] != '-' && !c.epoch_dir) c.epoch_dir = argv[i];
    else {
      usage();
      return 2;
    }
  }
  if (!c.epoch_dir) {
    usage();
    return 2;
  }
  zt_sample_stats_t st;
  if (zt_sample_run(&c, &st) != 0) {
    fprintf(stderr, "zsolo: %s\n", zt_err_msg());
    return 1;
  }
  return 0;
}

static int parse_pos_int(const char *s, long *out) {
  char *end;
  long v = strtol(s, &end, 10);
  if (*s == 0 || *end != 0 || v < 1) return -1;
  *out = v;
  return 0;
}

static int should_stop(void *user) { return (void)user, g_stop; }

static zt_train_cmd_t print_step(void *user, const zt_step_report_t *in) {
  solo *so = user;
  if (!(in->step % so->log_every == 0 || in->step == so->steps || in->step == 1 ||
        !isnan(in->val_loss)))
    return ZT_CMD_CONTINUE;
  if (so->json) {
    char val[32] = "null";
    if (!isnan(in->val_loss)) snprintf(val, sizeof val, "%.9g", in->val_loss);
    printf("{\"step\":%lld,\"loss\":%.9g,\"grad_norm\":%.9g,\"lr\":%.9g,\"ms\":%.3f,"
           "\"tokens_per_s\":%.1f,\"val_loss\":%s}\n",
           (long long)in->step, in->loss, in->grad_norm, in->lr, in->step_ms, in->tokens_per_s,
           val);
  } else {
    printf("step %lld/%ld | loss %.9g | norm %.4f | lr %.4e | %.1f ms | %.0f tok/s",
           (long long)in->step, so->steps, in->loss, in->grad_norm, in->lr, in->step_ms,
           in->tokens_per_s);
    if (!isnan(in->val_loss)) printf(" | val %.9g", in->val_loss);
    printf("\n");
  }
  fflush(stdout);
  return ZT_CMD_CONTINUE;
}

/* The spec text with "steps" replaced, when --steps is given. */
static char *with_steps(const char *text, long steps) {
  cJSON *doc = cJSON_Parse(text);
  if (!doc) return zt_xstrdup(text); /* the parser will name the problem */
  cJSON_DeleteItemFromObjectCaseSensitive(doc, "steps");
  cJSON_AddNumberToObject(doc, "steps", (double)steps);
  char *out = cJSON_PrintUnformatted(doc);
  cJSON_Delete(doc);
  return out ? out : zt_xstrdup(text);
}

int main(int argc, char **argv) {
  if (zt_version_arg(argc, argv, "zsolo")) return 0;
  const char *spec_path = NULL, *device = "cpu";
  long threads = 0, steps = 0;
  solo so = {0, 1, 0};
  zt_log_set_prefix("zsolo");
  if (argc >= 2 && !strcmp(argv[1], "sample")) return sample_main(argc - 2, argv + 2);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    long *dst = !strcmp(a, "--threads")     ? &threads
                : !strcmp(a, "--steps")     ? &steps
                : !strcmp(a, "--log-every") ? &so.log_every
                                            : NULL;
    if (dst) {
      if (i + 1 >= argc || parse_pos_int(argv[++i], dst) != 0) {
        fprintf(stderr, "zsolo: %s needs a positive integer\n", a);
        return 2;
      }
    } else if (!strcmp(a, "--device") && i + 1 < argc) {
      device = argv[++i];
    } else if (!strcmp(a, "--json")) {
      so.json = 1;
    } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage();
      return 0;
    } else if (a[0] == '-' || spec_path) {
      usage();
      return 2;
    } else {
      spec_path = a;
    }
  }
  if (!spec_path) {
    usage();
    return 2;
  }
  char *text = NULL;
  size_t len;
  zt_spec_t spec;
  if (zt_read_file(spec_path, &text, &len, 4 << 20) != 0) goto err0;
  if (steps > 0) {
    char *t2 = with_steps(text, steps);
    free(text);
    text = t2;
  }
  char *resolved; /* a pretrained model's section, from its config.json */
  if (zt_hfconfig_resolve(text, strlen(text), NULL, &resolved) != 0) {
    zt_err_wrap("%s", spec_path);
    goto err0;
  }
  if (resolved) {
    free(text);
    text = resolved;
  }
  if (zt_spec_parse(&spec, text, strlen(text)) != 0) {
    zt_err_wrap("%s", spec_path);
    goto err0;
  }
  so.steps = spec.steps;
  char kern[96]; /* on the CPU, also the sgemm and the thread count */
  if (!strcmp(device, "cpu"))
    snprintf(kern, sizeof kern, "cpu (sgemm %s, %d threads)", zt_kernels_cpu_sgemm(),
             zt_kernels_cpu_set_threads((int)threads));
  else
    snprintf(kern, sizeof kern, "%s", device);
  fprintf(stderr,
          "zsolo: %s: %zu parameters, %d layers, %d heads, %d wide, T=%d, vocab %d; batch %ld "
          "of %d; ZeRO stage %d; %s\n",
          spec.name, zt_model_param_count(&spec.model, 0), spec.model.n_layer, spec.model.n_head,
          spec.model.n_embd, spec.model.seq_len, spec.model.vocab_size, spec.global_batch,
          spec.micro_batch, spec.zero_stage, kern);
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  zt_comm_t *comm;
  zt_comm_tcp_opts_t co = {.rank = 0, .world = 1, .listen_fd = -1, .session = 1};
  if (zt_comm_tcp_create(&co, &comm) != 0) goto err0;
  zt_gen_ctx_t g = {.job_id = 0, .generation = 1, .rank = 0, .world = 1, .spec_json = text,
                    .comm_timeout_ms = 1000, .comm = comm, .workdir = NULL,
                    .threads = (int)threads, .device = device, .lr_factor = 1.0,
                    .should_stop = should_stop, .report_step = print_step, .user = &so};
  zt_train_failure_t fail;
  int rc = zt_gen_train(&g, &fail);
  zt_comm_destroy(comm);
  free(text);
  if (rc != 0) {
    fprintf(stderr, "zsolo: %s\n", zt_err_msg());
    return 1;
  }
  return 0;
err0:
  fprintf(stderr, "zsolo: %s\n", zt_err_msg());
  free(text);
  return 1;
}
