/*
 * zworker.c: the worker daemon, one per GPU or per CPU process.
 *
 * `zworker --coordinator HOST:PORT --device cpu --name NAME --workdir DIR`
 * takes an exclusive lock on its work dir (two workers never share one),
 * then runs the control loop (control.c): register, heartbeat, retry with
 * backoff while the coordinator is away. SIGINT and SIGTERM run a handler
 * that only writes the signal number into a pipe (async-signal-safe, and
 * correct whichever thread the kernel picks: libraries such as OpenBLAS
 * start threads before main, so blocking the signals cannot cover every
 * thread). A dedicated thread reads the pipe and asks the control loop to
 * stop; the loop then says Leave, so the coordinator records the worker as
 * left, not lost. SIGTERM is how spot instances announce their end.
 *
 * Training runs on the runner thread (runner.c), which the control loop
 * steers with the assignment carried by each heartbeat reply.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "comm.h"
#include "control.h"
#include "cores.h"
#include "device.h"
#include "runner.h"
#include "spot.h"
#include "store.h"
#include "zt_common.h"
#include "zt_kernels.h"
#include "zt_net.h"

typedef struct {
  const char *coordinator, *name, *device, *workdir, *secret, *comm_host, *host;
  int threads;
  char data_root[PATH_MAX], ckpt_root[PATH_MAX]; /* resolved */
  uint64_t memory;                               /* bytes this worker may use */
  int64_t drain_timeout_ms;                      /* 0: the default (90 s) */
  zt_spot_kind_t spot;                           /* --spot-notice */
  const char *spot_endpoint;                     /* NULL: 169.254.169.254:80 */
  int64_t spot_poll_ms;                          /* 0: 1000 */
  int heartbeat_agent;                           /* --heartbeat-agent */
} worker_args;

static void usage(FILE *f) {
  fprintf(f, "usage: zworker --coordinator HOST:PORT --name NAME --workdir DIR\n"
             "               [--device cpu|cuda|cuda:N] [--secret S] [--log-level L]\n"
             "               [--threads N] [--comm-host ADDR] [--memory BYTES[K|M|G]]\n"
             "               [--data-root DIR] [--checkpoint-root DIR] [--host NAME]\n"
             "               [--drain-timeout-ms N] [--spot-notice auto|aws|gcp|azure|off]\n"
             "               [--spot-endpoint IP:PORT] [--spot-poll-ms N] [--heartbeat-agent]\n"
             "Job data and checkpoints must lie under the roots (default: the working\n"
             "directory); --memory (default: the machine's RAM) is what the scheduler\n"
             "assumes this worker may use. --comm-host is the address peers reach this\n"
             "worker's ring on (default 127.0.0.1: one machine only); --host names the\n"
             "machine (default: its hostname), so that workers of one machine are known\n"
             "to share its fate. On SIGTERM a worker of a running job waits for a\n"
             "checkpoint before it leaves, at most --drain-timeout-ms (default 90000:\n"
             "inside a two-minute spot notice; 25000 for a 30-second one).\n"
             "--spot-notice (default off) polls the cloud's instance metadata service and\n"
             "drains, as on SIGTERM, when it announces a preemption (auto: whichever of\n"
             "AWS, GCP and Azure answers). --heartbeat-agent: the workers of this machine\n"
             "that say so send their heartbeats through one of them, one call a machine\n"
             "(for fleets of many GPUs a machine: docs/deploy.md).\n");
}

/* "2G", "512M", "1000000": bytes. */
static int parse_bytes(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  uint64_t mult = *end == 'K' ? 1ull << 10 : *end == 'M' ? 1ull << 20 : *end == 'G' ? 1ull << 30 : 1;
  if (mult > 1) end++;
  if (errno || end == s || *end || v == 0 || v > UINT64_MAX / mult)
    return zt_err("--memory %s: expected a positive number of bytes (K, M or G suffix)", s);
  *out = v * mult;
  return 0;
}

static int resolve_root(const char *opt, const char *dir, char *out) {
  if (!realpath(dir ? dir : ".", out)) return zt_err_errno("%s %s", opt, dir ? dir : ".");
  return 0;
}

static int parse_args(worker_args *a, int argc, char **argv) {
  static const struct option opts[] = {
      {"coordinator", required_argument, 0, 'c'}, {"name", required_argument, 0, 'n'},
      {"device", required_argument, 0, 'd'},      {"workdir", required_argument, 0, 'w'},
      {"secret", required_argument, 0, 's'},      {"log-level", required_argument, 0, 'l'},
      {"threads", required_argument, 0, 't'},     {"comm-host", required_argument, 0, 'H'},
      {"data-root", required_argument, 0, 'D'},   {"checkpoint-root", required_argument, 0, 'C'},
      {"memory", required_argument, 0, 'm'},      {"host", required_argument, 0, 'o'},
      {"drain-timeout-ms", required_argument, 0, 'T'},
      {"spot-notice", required_argument, 0, 'S'},  {"spot-endpoint", required_argument, 0, 'E'},
      {"spot-poll-ms", required_argument, 0, 'P'},
      {"heartbeat-agent", no_argument, 0, 'A'},
      {"help", no_argument, 0, 'h'},
      {0, 0, 0, 0},
  };
  const char *data_root = NULL, *ckpt_root = NULL;
  memset(a, 0, sizeof *a);
  a->device = "cpu";
  a->comm_host = "127.0.0.1";
  a->secret = zt_env(ZT_ENV_WORKER_SECRET);
  int ch;
  int64_t v;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (ch) {
    case 'c': a->coordinator = optarg; break;
    case 'n': a->name = optarg; break;
    case 'd': a->device = optarg; break;
    case 'w': a->workdir = optarg; break;
    case 's': a->secret = optarg; break;
    case 't':
      if (zt_parse_i64("--threads", optarg, 0, 1024, &v) != 0) return -1;
      a->threads = (int)v;
      break;
    case 'T':
      if (zt_parse_i64("--drain-timeout-ms", optarg, 1, 3600000, &a->drain_timeout_ms) != 0)
        return -1;
      break;
    case 'S':
      if (zt_spot_parse(optarg, &a->spot) != 0) return -1;
      break;
    case 'E': a->spot_endpoint = optarg; break;
    case 'A': a->heartbeat_agent = 1; break;
    case 'P':
      if (zt_parse_i64("--spot-poll-ms", optarg, 100, 600000, &a->spot_poll_ms) != 0) return -1;
      break;
    case 'H': a->comm_host = optarg; break;
    case 'o': a->host = optarg; break;
    case 'D': data_root = optarg; break;
    case 'C': ckpt_root = optarg; break;
    case 'm':
      if (parse_bytes(optarg, &a->memory) != 0) return -1;
      break;
    case 'l':
      if (zt_log_set_level_name(optarg) != 0) return zt_err("unknown log level %s", optarg);
      break;
    case 'h': usage(stdout); exit(0);
    default: usage(stderr); return zt_err("bad command line");
    }
  }
  if (optind < argc) return zt_err("unexpected argument \"%s\"", argv[optind]);
  if (!a->coordinator || !a->name || !a->workdir) {
    usage(stderr);
    return zt_err("--coordinator, --name and --workdir are required");
  }
  char host[256];
  int port;
  if (zt_net_parse_hostport(a->coordinator, host, sizeof host, &port) != 0)
    return zt_err_wrap("--coordinator");
  if (a->secret && !strncmp(a->secret, "CHANGE-ME", 9))
    return zt_err("the worker secret is still the placeholder of the example zworker.env: put "
                  "the coordinator's worker_secret there");
  if (resolve_root("--data-root", data_root, a->data_root) != 0 ||
      resolve_root("--checkpoint-root", ckpt_root, a->ckpt_root) != 0)
    return -1;
  if (!a->memory) a->memory = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGE_SIZE);
  if (!strcmp(a->device, "cuda")) a->device = "cuda:0"; /* the one visible GPU */
  /* Fail at start, not at the first job, when the device cannot be used. */
  if (!zt_device_kernels(a->device, 0)) return zt_err_wrap("--device %s", a->device);
  return 0;
}

/* Holds an exclusive flock on DIR/zworker.lock for the process lifetime. */
static int lock_workdir(const char *dir) {
  if (zt_mkdirs(dir) != 0) return zt_err_wrap("--workdir");
  char path[ZT_PATH_MAX];
  if (zt_path_join(path, sizeof path, dir, "zworker.lock") != 0) return -1;
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return zt_err_errno("%s", path);
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    close(fd);
    if (e == EWOULDBLOCK) return zt_err("%s: work dir in use by another zworker", dir);
    errno = e;
    return zt_err_errno("lock %s", path);
  }
  char pid[32];
  int n = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
  if (ftruncate(fd, 0) != 0 || zt_write_all(fd, pid, (size_t)n) != 0)
    ZT_WARN("cannot write %s", path);
  return 0; /* fd stays open: the lock lives as long as the process */
}

typedef struct {
  int fd; /* read end of the signal pipe */
  zt_ctl_t *ctl;
} sig_thread_arg;

static int g_sig_pipe[2] = {-1, -1};

static void on_signal(int sig) {
  int saved = errno;
  unsigned char b = (unsigned char)sig;
  ssize_t w = write(g_sig_pipe[1], &b, 1);
  (void)w;
  errno = saved;
}

static void on_timing(void *user, zt_ctl_timing_t *t) {
  zt_runner_t **r = user;
  if (*r) zt_runner_timing(*r, t);
}

static void on_command(void *user, int command, uint64_t job, uint64_t gen, int nccl_root) {
  (void)command;
  zt_runner_t **r = user;
  if (*r) zt_runner_assign(*r, job, gen, nccl_root);
}

static void *signal_thread(void *p) {
  sig_thread_arg *a = p;
  for (;;) {
    unsigned char b;
    ssize_t n = read(a->fd, &b, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || b == 0) return NULL; /* 0: our own wake-up at exit */
    int sig = b;
    ZT_INFO("received %s; leaving", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    zt_ctl_stop(a->ctl, sig == SIGTERM ? "SIGTERM (preemption or shutdown)" : "SIGINT");
  }
}

/* A preemption notice drains the worker as SIGTERM does; the line names
 * the notice, and the coordinator's logbook keeps it as the reason. */
static void on_spot_notice(void *user, const char *what) { zt_ctl_stop(user, what); }

/* The replica store checks tickets with the current session and reports
 * the copies it stored. */
static void store_session(void *user, char *buf, size_t n) { zt_ctl_session(user, buf, n); }

static void store_assignment(void *user, uint64_t *job, uint64_t *gen) {
  zt_ctl_assignment(user, job, gen);
}

/* A copy the coordinator did not record is refused to its pusher. */
static int store_stored(void *user, uint64_t job, const char *dir, const zt_ckpt_file_t *f) {
  if (zt_ctl_report_replica(user, job, dir, f->name, f->bytes, f->checksum) != 0)
    return zt_err_wrap("copy of %s/%s not reported to the coordinator", dir, f->name);
  return 0;
}

/* A CPU worker says how many compute threads it runs, and warns when the
 * machine's CPU workers together run more than its cores (cores.c). */
static void announce_cores(int threads) {
  if (zt_cores_announce(zt_kernels_cpu_set_threads(threads)) != 0)
    ZT_WARN("%s: other workers on this machine cannot count this one's threads", zt_err_msg());
  zt_cores_check();
}

int main(int argc, char **argv) {
  if (zt_version_arg(argc, argv, "zworker")) return 0;
  worker_args a;
  signal(SIGPIPE, SIG_IGN);
  if (parse_args(&a, argc, argv) != 0) {
    zt_log_set_prefix("zworker");
    ZT_ERROR("%s", zt_err_msg());
    return 2;
  }
  char prefix[160];
  snprintf(prefix, sizeof prefix, "zworker[%s]", a.name);
  zt_log_set_prefix(prefix);
  if (lock_workdir(a.workdir) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 1;
  }
  sig_thread_arg sa;
  if (pipe2(g_sig_pipe, O_CLOEXEC) != 0) {
    ZT_ERROR("pipe: %s", strerror(errno));
    return 1;
  }
  sa.fd = g_sig_pipe[0];
  struct sigaction act;
  memset(&act, 0, sizeof act);
  act.sa_handler = on_signal;
  sigemptyset(&act.sa_mask);
  act.sa_flags = SA_RESTART;
  sigaction(SIGINT, &act, NULL);
  sigaction(SIGTERM, &act, NULL);

  static zt_runner_t *runner;
  if (zt_device_parse(a.device) < 0) announce_cores(a.threads);
  uint64_t device_memory = 0;
  int nccl = 0;
  if (zt_device_parse(a.device) >= 0 && !(device_memory = zt_device_memory(a.device)))
    ZT_WARN("%s: %s; jobs will fail on this worker until it is fixed", a.device, zt_err_msg());
  if (zt_device_parse(a.device) >= 0 && !(nccl = zt_comm_nccl_available()))
    ZT_WARN("no NCCL (%s): this worker's generations use the TCP ring", zt_err_msg());
  zt_ctl_opts_t o = {.coordinator = a.coordinator, .name = a.name, .device = a.device,
                     .host = a.host, .ckpt_root = a.ckpt_root,
                     .secret = a.secret, .host_memory = a.memory,
                     .device_memory = device_memory, .nccl = nccl, .on_command = on_command,
                     .drain_timeout_ms = a.drain_timeout_ms,
                     .heartbeat_agent = a.heartbeat_agent,
                     .timing = on_timing, .user = &runner};
  if (zt_ctl_open(&o, &sa.ctl) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 1;
  }
  zt_store_t *store;
  zt_store_opts_t so = {.host = a.comm_host, .ckpt_root = a.ckpt_root, .session = store_session,
                        .assignment = store_assignment, .stored = store_stored, .user = sa.ctl};
  if (zt_store_start(&so, &store) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 1;
  }
  zt_ctl_set_store_addr(sa.ctl, zt_store_addr(store));
  zt_runner_opts_t ro = {.comm_host = a.comm_host, .workdir = a.workdir, .threads = a.threads,
                         .device = a.device, .data_root = a.data_root, .ckpt_root = a.ckpt_root,
                         .host_memory = a.memory, .device_memory = device_memory};
  if (zt_runner_start(sa.ctl, &ro, &runner) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 1;
  }
  zt_spot_t *spot = NULL;
  zt_spot_opts_t spo = {.kind = a.spot, .endpoint = a.spot_endpoint,
                        .poll_ms = (int)a.spot_poll_ms, .on_notice = on_spot_notice,
                        .user = sa.ctl};
  if (zt_spot_start(&spo, &spot) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 1;
  }
  pthread_t st;
  pthread_create(&st, NULL, signal_thread, &sa);
  ZT_INFO("starting: coordinator %s, device %s, workdir %s", a.coordinator, a.device, a.workdir);
  int rc = zt_ctl_run(sa.ctl);
  zt_spot_ack(spot); /* we have left: the platform need not wait */
  zt_spot_stop(spot);
  zt_runner_t *rn = runner;
  runner = NULL;
  zt_runner_stop(rn);
  /* A store handler that outlived the store's stop may still call the
   * store callbacks, which use the control connection: then the control
   * connection is left open (and leaked) rather than freed under it. */
  int store_stopped = zt_store_stop(store) == 0;
  if (!store_stopped)
    ZT_WARN("%s; leaving the control connection open at exit", zt_err_msg());
  unsigned char zero = 0;
  if (write(g_sig_pipe[1], &zero, 1) != 1) ZT_WARN("cannot wake the signal thread");
  pthread_join(st, NULL);
  if (store_stopped) zt_ctl_close(sa.ctl);
  ZT_INFO("exiting");
  return rc == 0 ? 0 : 1;
}
