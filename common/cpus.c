/*
 * cpus.c: how many cores this process may use.
 *
 * A process may be held to fewer cores than the machine has in two ways:
 * its affinity mask (taskset, Slurm's cpu binding, a container's cpuset)
 * and a CPU quota of its cgroup (cgroup v2's cpu.max, or v1's
 * cpu.cfs_quota_us over cpu.cfs_period_us: a container with "2 CPUs" on a
 * 64-core host). zt_cpus_usable() is the smaller of the two, at least 1.
 * The local launcher shares it among its workers, and a worker compares
 * it with the compute threads of the workers it sees on its machine
 * (worker/cores.c).
 */
#include <sched.h>
#include <stdio.h>
#include <string.h>

#include "zt_common.h"

/* The cores a quota of quota_us per period_us grants, rounded up (0: no
 * quota). */
static int quota_cores(long long quota_us, long long period_us) {
  if (quota_us <= 0 || period_us <= 0) return 0;
  return (int)((quota_us + period_us - 1) / period_us);
}

/* The quota of the cgroup at dir, v2 ("max 100000" or "200000 100000"). */
static int cgroup_v2_cores(const char *dir) {
  char path[ZT_PATH_MAX], line[128];
  snprintf(path, sizeof path, "/sys/fs/cgroup%s/cpu.max", dir);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  long long q = 0, p = 0;
  int ok = fgets(line, sizeof line, f) && sscanf(line, "%lld %lld", &q, &p) == 2;
  fclose(f);
  return ok ? quota_cores(q, p) : 0; /* "max ..." does not scan: no quota */
}

/* The quota of a v1 cpu controller's cgroup at dir, where the controller
 * is mounted (alone, or with cpuacct). */
static int cgroup_v1_cores(const char *dir) {
  static const char *const mounts[] = {"/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpu"};
  static const char *const name[2] = {"cpu.cfs_quota_us", "cpu.cfs_period_us"};
  char path[ZT_PATH_MAX];
  for (size_t m = 0; m < ZT_ARRAY_LEN(mounts); m++) {
    long long v[2] = {0, 0};
    int k = 0;
    for (; k < 2; k++) {
      snprintf(path, sizeof path, "%s%s/%s", mounts[m], dir, name[k]);
      FILE *f = fopen(path, "r");
      if (!f) break;
      if (fscanf(f, "%lld", &v[k]) != 1) v[k] = 0;
      fclose(f);
    }
    if (k == 2) return quota_cores(v[0], v[1]);
  }
  return 0;
}

/* The smallest quota on the way from this process's cgroup to the root
 * (a parent's quota holds its children too); 0 when none. */
static int cgroup_cores(void) {
  FILE *f = fopen("/proc/self/cgroup", "r");
  if (!f) return 0;
  char line[ZT_PATH_MAX];
  int best = 0;
  while (fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = 0;
    char *dir = strchr(line, ':');
    dir = dir ? strchr(dir + 1, ':') : NULL;
    if (!dir) continue;
    int v2 = !strncmp(line, "0::", 3), v1 = strstr(line, ":cpu,") || strstr(line, ":cpu:");
    if (!v2 && !v1) continue;
    for (char *d = dir + 1; *d;) {
      int n = v2 ? cgroup_v2_cores(d) : cgroup_v1_cores(d);
      if (n > 0 && (!best || n < best)) best = n;
      char *slash = strrchr(d, '/');
      if (!slash) break;
      *slash = 0; /* the parent ("" is the root) */
      if (slash == d && !v2) break;
    }
  }
  fclose(f);
  return best;
}

int zt_cpus_usable(void) {
  cpu_set_t set;
  int n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
  if (n < 1) n = 1;
  int q = cgroup_cores();
  return q > 0 && q < n ? q : n;
}
