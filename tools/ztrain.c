/*
 * ztrain.c: the local launcher, the default single-machine experience.
 *
 *   ztrain JOB.json [--workers N] [--dir DIR] [--threads T] [--quiet]
 *
 * Starts a zcoord (its database and logs under DIR, default ztrain-run/)
 * and N local CPU zworkers, submits the job, prints progress (step, loss,
 * tokens/s) until the job ends, then stops the workers (SIGTERM: they say
 * Leave) and the coordinator. Exit status: 0 when the job completed, 1 when
 * it failed, 2 on a usage error. The daemons' logs stay in DIR.
 *
 * Everything here goes through the same interfaces an operator would use:
 * processes, gRPC (SubmitJob, GetJob), the ready file zcoord writes.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "pbcall.h"
#include "zt_common.h"
#include "zt_rpc.h"
#include "ztrain.pb-c.h"

#define MAX_WORKERS 64

static volatile sig_atomic_t g_interrupted;
static void on_sigint(int sig) { (void)sig, g_interrupted = 1; }

/* Starts `argv` with stdout+stderr appended to `log`. */
static pid_t spawn(char *const argv[], const char *log) {
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) dup2(fd, 1), dup2(fd, 2);
    signal(SIGINT, SIG_IGN); /* the launcher decides when children stop */
    execv(argv[0], argv);
    _exit(127);
  }
  return pid;
}

/* Waits up to ms for a child; SIGKILL after that. */
static void reap(pid_t pid, int64_t ms) {
  zt_deadline_t dl = zt_deadline_in(ms);
  for (;;) {
    int st;
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid || (r < 0 && errno == ECHILD)) return;
    if (zt_deadline_passed(dl)) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      return;
    }
    zt_sleep_ms(20); /* polling a child's exit with a deadline */
  }
}

static int read_ready(const char *path, int *grpc_port) {
  char *t;
  size_t n;
  if (zt_read_file(path, &t, &n, 4096) != 0) return -1;
  const char *p = strstr(t, "\"grpc_port\": ");
  int ok = p && sscanf(p + 13, "%d", grpc_port) == 1;
  free(t);
  return ok ? 0 : -1;
}

/* One launch: its settings and what it started. */
typedef struct {
  int workers, threads, quiet;
  const char *dir, *spec_path;
  char bindir[PATH_MAX];
  char target[64]; /* zcoord's gRPC address */
  pid_t coord, wk[MAX_WORKERS];
  int started; /* workers started */
  zt_rpc_client_t *rpc;
} launch;

static int parse_args(launch *l, int argc, char **argv) {
  static const struct option opts[] = {{"workers", required_argument, 0, 'n'},
                                       {"dir", required_argument, 0, 'd'},
                                       {"threads", required_argument, 0, 't'},
                                       {"quiet", no_argument, 0, 'q'},
                                       {0, 0, 0, 0}};
  l->workers = 2;
  l->dir = "ztrain-run";
  int ch;
  while ((ch = getopt_long(argc, argv, "n:", opts, NULL)) != -1) {
    switch (ch) {
    case 'n': l->workers = atoi(optarg); break;
    case 'd': l->dir = optarg; break;
    case 't': l->threads = atoi(optarg); break;
    case 'q': l->quiet = 1; break;
    default: return -1;
    }
  }
  if (optind != argc - 1 || l->workers < 1 || l->workers > MAX_WORKERS) return -1;
  l->spec_path = argv[optind];
  /* The daemons are our siblings in the bin directory. */
  char self[PATH_MAX];
  ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
  if (sl <= 0) return -1;
  self[sl] = 0;
  snprintf(l->bindir, sizeof l->bindir, "%.*s", (int)(strrchr(self, '/') - self), self);
  return 0;
}

/* Starts zcoord on free ports and waits for its ready file. */
static int start_coord(launch *l) {
  char zcoord[PATH_MAX + 16], db[PATH_MAX], ready[PATH_MAX], log[PATH_MAX + 32];
  snprintf(zcoord, sizeof zcoord, "%s/zcoord", l->bindir);
  snprintf(db, sizeof db, "%s/zcoord.db", l->dir);
  snprintf(ready, sizeof ready, "%s/zcoord.ready", l->dir);
  snprintf(log, sizeof log, "%s/zcoord.log", l->dir);
  unlink(ready);
  char *argv[] = {zcoord, "--grpc", "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", db,
                  "--ready-file", ready, "--heartbeat-ms", "500", NULL};
  l->coord = spawn(argv, log);
  int port = 0;
  zt_deadline_t dl = zt_deadline_in(15000);
  while (read_ready(ready, &port) != 0) {
    if (zt_deadline_passed(dl) || waitpid(l->coord, NULL, WNOHANG) == l->coord)
      return zt_err("zcoord did not start; see %s", log);
    zt_sleep_ms(20); /* polling for the ready file with a deadline */
  }
  snprintf(l->target, sizeof l->target, "127.0.0.1:%d", port);
  return 0;
}

static void start_workers(launch *l) {
  char zworker[PATH_MAX + 16], thr[16];
  snprintf(zworker, sizeof zworker, "%s/zworker", l->bindir);
  snprintf(thr, sizeof thr, "%d", l->threads);
  for (int i = 0; i < l->workers; i++) {
    char name[32], wd[PATH_MAX], log[PATH_MAX + 32];
    snprintf(name, sizeof name, "local-%d", i);
    snprintf(wd, sizeof wd, "%s/%s", l->dir, name);
    snprintf(log, sizeof log, "%s/%s.log", l->dir, name);
    char *argv[] = {zworker, "--coordinator", l->target, "--name", name, "--workdir", wd,
                    "--device", "cpu", "--threads", thr, NULL};
    l->wk[l->started++] = spawn(argv, log);
  }
}

static int submit(launch *l, const char *spec, uint64_t *job) {
  Ztrain__SubmitJobRequest req = ZTRAIN__SUBMIT_JOB_REQUEST__INIT;
  req.spec_json = (char *)spec;
  ProtobufCMessage *m;
  if (zt_pb_call(l->rpc, "/ztrain.Status/SubmitJob", &req.base,
                 &ztrain__submit_job_reply__descriptor, 10000, &m, NULL) != 0)
    return zt_err_wrap("submit %s", l->spec_path);
  *job = ((Ztrain__SubmitJobReply *)m)->job_id;
  protobuf_c_message_free_unpacked(m, NULL);
  return 0;
}

/* Prints progress until the job ends (or ztrain is interrupted); returns
 * the exit status: 0 when the job completed. */
static int follow(launch *l, uint64_t job) {
  int64_t last_step = -1;
  while (!g_interrupted) {
    Ztrain__GetJobRequest req = ZTRAIN__GET_JOB_REQUEST__INIT;
    req.job_id = job;
    ProtobufCMessage *m;
    if (zt_pb_call(l->rpc, "/ztrain.Status/GetJob", &req.base, &ztrain__get_job_reply__descriptor,
                   5000, &m, NULL) == 0) {
      Ztrain__JobInfo *ji = ((Ztrain__GetJobReply *)m)->job;
      if (ji && ji->step != last_step && ji->step > 0 && !l->quiet) {
        printf("step %6lld/%lld  loss %.4f  lr %.3g  %8.0f tok/s  gen %llu  world %u\n",
               (long long)ji->step, (long long)ji->total_steps, ji->loss, ji->lr, ji->tokens_per_s,
               (unsigned long long)ji->generation, ji->world);
        fflush(stdout);
        last_step = ji->step;
      }
      int state = ji ? ji->state : 0, done = state == ZTRAIN__JOB_STATE__JOB_COMPLETED ||
                                              state == ZTRAIN__JOB_STATE__JOB_FAILED ||
                                              state == ZTRAIN__JOB_STATE__JOB_CANCELED;
      if (done)
        printf("ztrain: job %llu %s: %s\n", (unsigned long long)job, zt_job_state_name(state),
               ji->message);
      protobuf_c_message_free_unpacked(m, NULL);
      if (done) return state == ZTRAIN__JOB_STATE__JOB_COMPLETED ? 0 : 1;
    }
    zt_sleep_ms(200); /* progress display cadence */
  }
  return 1;
}

/* Workers first (SIGTERM: they say Leave), then the coordinator. */
static void stop_all(launch *l) {
  for (int i = 0; i < l->started; i++) kill(l->wk[i], SIGTERM);
  for (int i = 0; i < l->started; i++) reap(l->wk[i], 10000);
  if (l->coord > 0) {
    kill(l->coord, SIGTERM);
    reap(l->coord, 10000);
  }
  zt_rpc_client_close(l->rpc);
}

int main(int argc, char **argv) {
  zt_log_set_prefix("ztrain");
  launch l = {0};
  char *spec = NULL;
  size_t spec_len;
  uint64_t job = 0;
  int rc = 1;
  if (parse_args(&l, argc, argv) != 0) {
    fprintf(stderr, "usage: ztrain JOB.json [--workers N] [--dir DIR] [--threads T] [--quiet]\n");
    return 2;
  }
  if (zt_read_file(l.spec_path, &spec, &spec_len, 4 << 20) != 0 || zt_mkdirs(l.dir) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    free(spec);
    return 2;
  }
  signal(SIGINT, on_sigint);
  signal(SIGTERM, on_sigint);
  if (start_coord(&l) != 0) goto out;
  start_workers(&l);
  if (zt_rpc_client_open(l.target, NULL, &l.rpc) != 0 || submit(&l, spec, &job) != 0) goto out;
  printf("ztrain: job %llu submitted to %s with %d workers (logs in %s/)\n",
         (unsigned long long)job, l.target, l.workers, l.dir);
  fflush(stdout);
  rc = follow(&l, job);
out:
  if (rc != 0 && !job) ZT_ERROR("%s", zt_err_msg());
  stop_all(&l);
  free(spec);
  return rc;
}
