/*
 * knobs.c: the environment, read in this one place: the settings
 * ztrain's processes take from it (k_env below) and the test-only knobs.
 *
 * Tests reach into a running process in two ways: a job spec's
 * fault_injection object (parsed and checked by the spec parser,
 * engine/spec.c) and the environment variables below. Each knob is read
 * once, at its first use; an unset variable leaves the behaviour of a
 * production process unchanged. The table is the documentation: every
 * name here, and nothing else, is a test knob (docs/architecture.md lists
 * them too).
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#include "zt_common.h"

static const struct {
  const char *name;
  const char *doc;
} k_knobs[ZT_KNOB_COUNT] = {
    [ZT_KNOB_KILL_IN_CKPT_STEP] = {"ZT_FAULT_KILL_IN_CKPT_STEP",
                                   "S: a worker kills itself (SIGKILL) half-way through writing "
                                   "its rank file of the first checkpoint it writes at step S "
                                   "or later, as a machine dying mid-write would"},
    [ZT_KNOB_STAGE_COLLECTIVES] = {"ZT_TEST_STAGE_COLLECTIVES",
                                   "1: CPU workers stage every collective through a host buffer "
                                   "as GPU workers do, so CPU tests cover that path"},
    [ZT_KNOB_NO_STEP_REPORTER] = {"ZT_FAULT_NO_STEP_REPORTER",
                                  "1: rank 0's step reporter thread cannot be started, as when "
                                  "pthread_create fails (EAGAIN)"},
    [ZT_KNOB_HEARTBEAT_REPLY_DELAY] = {"ZT_FAULT_HEARTBEAT_REPLY_DELAY_MS",
                                       "D: a worker acts on each heartbeat reply D ms after it "
                                       "arrived, so a reply can be overtaken by a newer "
                                       "assignment (a failure report's reply)"},
};

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_set[ZT_KNOB_COUNT];
static int64_t g_val[ZT_KNOB_COUNT];

static void read_all(void) {
  for (int k = 0; k < ZT_KNOB_COUNT; k++) {
    const char *v = getenv(k_knobs[k].name);
    if (!v || !*v) continue;
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || *end) {
      ZT_WARN("test knob %s=%s is not an integer: ignored", k_knobs[k].name, v);
      continue;
    }
    g_set[k] = 1;
    g_val[k] = x;
    ZT_WARN("test knob %s=%lld is set (%s)", k_knobs[k].name, x, k_knobs[k].doc);
  }
}

int64_t zt_knob(zt_knob_t k, int64_t def) {
  if (k < 0 || k >= ZT_KNOB_COUNT) return def;
  pthread_once(&g_once, read_all);
  return g_set[k] ? g_val[k] : def;
}

const char *zt_knob_name(zt_knob_t k) {
  return k >= 0 && k < ZT_KNOB_COUNT ? k_knobs[k].name : "unknown";
}

/* ---- settings -------------------------------------------------------------- */

/* The settings an operator (or a test harness) gives in the environment;
 * each is also an option or a file where one exists (docs/deploy.md). */
static const struct {
  const char *name;
  const char *doc;
} k_env[ZT_ENV_COUNT] = {
    [ZT_ENV_SGEMM] = {"ZT_SGEMM", "blas: OpenBLAS's sgemm even where our AVX-512 one would run "
                                  "(kernels/cpu/gemm.c)"},
    [ZT_ENV_CUDA_KERNELS] = {"ZT_CUDA_KERNELS", "the CUDA kernels' library (kernels/device.c)"},
    [ZT_ENV_CUDART_LIB] = {"ZT_CUDART_LIB", "the CUDA runtime the NCCL backend loads "
                                            "(comm/comm_nccl.c; the tests' stand-in)"},
    [ZT_ENV_NCCL_LIB] = {"ZT_NCCL_LIB", "the NCCL library the NCCL backend loads"},
    [ZT_ENV_WORKER_SECRET] = {"ZTRAIN_WORKER_SECRET", "zworker's shared secret "
                                                      "(deploy/zworker.env)"},
    [ZT_ENV_COORDINATOR] = {"ZTRAIN_COORDINATOR", "zctl's coordinator, HOST:PORT"},
    [ZT_ENV_TOKEN] = {"ZTRAIN_TOKEN", "zctl's operator token"},
};

const char *zt_env(zt_env_t v) {
  if (v < 0 || v >= ZT_ENV_COUNT) return NULL;
  const char *s = getenv(k_env[v].name);
  return s && s[0] ? s : NULL;
}

const char *zt_env_name(zt_env_t v) {
  return v >= 0 && v < ZT_ENV_COUNT ? k_env[v].name : "unknown";
}
