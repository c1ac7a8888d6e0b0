/*
 * knobs.c: the test-only knobs, read from the environment in this one
 * place.
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
