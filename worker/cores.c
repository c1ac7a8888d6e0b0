/*
 * cores.c: the machine's CPU workers count their compute threads together.
 *
 * Two CPU workers that each start a compute thread per core on one machine
 * fight for its cores: every step waits for the slowest thread, and a
 * two-worker job on a 2-core machine ran 8x slower than with a thread
 * each (32 s against 4.1 s for examples/demo.json). The local launcher shares the cores among its workers
 * (tools/ztrain.c); workers started by hand, by systemd or by Slurm are
 * warned here instead.
 *
 * How a worker sees the others: each one that trains on the CPU binds an
 * abstract Unix socket named "ztrain-cores/<uid>/<pid>/<threads>" and
 * keeps it for its lifetime. Abstract names belong to the network
 * namespace (a machine, or a test's host) and vanish with their process,
 * so there is nothing to clean up after a crash; the kernel lists them in
 * /proc/net/unix, which is where zt_cores_check() reads the others' thread
 * counts (its own user's only). The sum is compared with the cores this
 * process may use, affinity and cgroup quota included (common/cpus.c).
 */
#include "cores.h"

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "zt_common.h"

#define CORES_PREFIX "ztrain-cores/"

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_fd = -1;
static int g_warned_sum; /* the sum last warned about (0: none) */

int zt_cores_announce(int threads) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  int n = snprintf(sa.sun_path + 1, sizeof sa.sun_path - 1, CORES_PREFIX "%u/%d/%d",
                   (unsigned)getuid(), (int)getpid(), threads);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return zt_err_errno("cores: socket");
  if (bind(fd, (struct sockaddr *)&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 +
                                                   (size_t)n)) != 0) {
    int rc = zt_err_errno("cores: bind @%s", sa.sun_path + 1);
    close(fd);
    return rc;
  }
  pthread_mutex_lock(&g_mu);
  if (g_fd >= 0) close(g_fd);
  g_fd = fd;
  pthread_mutex_unlock(&g_mu);
  return 0;
}

/* The thread count of one /proc/net/unix line when it is a worker's of
 * this user (each announces one socket): 0 otherwise. */
static int line_threads(const char *line, unsigned uid) {
  const char *at = strstr(line, " @" CORES_PREFIX);
  unsigned u;
  int p, t;
  if (!at || sscanf(at + 2 + strlen(CORES_PREFIX), "%u/%d/%d", &u, &p, &t) != 3) return 0;
  return u == uid && t >= 1 && t <= 65536 ? t : 0;
}

int zt_cores_check(void) {
  FILE *f = fopen("/proc/net/unix", "r");
  if (!f) return 0;
  char line[512];
  int sum = 0, workers = 0;
  unsigned uid = (unsigned)getuid();
  while (fgets(line, sizeof line, f)) {
    int t = line_threads(line, uid);
    sum += t;
    workers += t > 0;
  }
  fclose(f);
  int cores = zt_cpus_usable();
  pthread_mutex_lock(&g_mu);
  int warn = sum > cores && sum != g_warned_sum;
  if (warn) g_warned_sum = sum;
  if (sum <= cores) g_warned_sum = 0;
  pthread_mutex_unlock(&g_mu);
  if (warn)
    ZT_WARN("the %d CPU workers on this machine run %d compute threads on %d usable cores "
            "(affinity and cgroup quota included): they slow each other down; give each "
            "worker --threads N with N x workers <= %d",
            workers, sum, cores, cores);
  return sum;
}
