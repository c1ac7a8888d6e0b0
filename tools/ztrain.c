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

static const char *k_states[] = {"unknown",   "pending", "running", "reconfiguring",
                                 "completed", "failed",  "paused",  "canceled"};

int main(int argc, char **argv) {
  zt_log_set_prefix("ztrain");
  int workers = 2, threads = 0, quiet = 0;
  const char *dir = "ztrain-run";
  static const struct option opts[] = {{"workers", required_argument, 0, 'n'},
                                       {"dir", required_argument, 0, 'd'},
                                       {"threads", required_argument, 0, 't'},
                                       {"quiet", no_argument, 0, 'q'},
                                       {0, 0, 0, 0}};
  int ch;
  while ((ch = getopt_long(argc, argv, "n:", opts, NULL)) != -1) {
    switch (ch) {
    case 'n': workers = atoi(optarg); break;
    case 'd': dir = optarg; break;
    case 't': threads = atoi(optarg); break;
    case 'q': quiet = 1; break;
    default: goto usage;
    }
  }
  if (optind != argc - 1 || workers < 1 || workers > MAX_WORKERS) goto usage;
  const char *spec_path = argv[optind];
  char *spec;
  size_t spec_len;
  if (zt_read_file(spec_path, &spec, &spec_len, 4 << 20) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 2;
  }
  if (zt_mkdirs(dir) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 2;
  }
  /* The daemons are our siblings in the bin directory. */
  char self[PATH_MAX], bindir[PATH_MAX];
  ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
  if (sl <= 0) return 2;
  self[sl] = 0;
  snprintf(bindir, sizeof bindir, "%.*s", (int)(strrchr(self, '/') - self), self);

  char zcoord[PATH_MAX + 16], zworker[PATH_MAX + 16], db[PATH_MAX], ready[PATH_MAX],
      log[PATH_MAX + 32];
  snprintf(zcoord, sizeof zcoord, "%s/zcoord", bindir);
  snprintf(zworker, sizeof zworker, "%s/zworker", bindir);
  snprintf(db, sizeof db, "%s/zcoord.db", dir);
  snprintf(ready, sizeof ready, "%s/zcoord.ready", dir);
  unlink(ready);
  snprintf(log, sizeof log, "%s/zcoord.log", dir);
  char *cargv[] = {zcoord, "--grpc", "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", db,
                   "--ready-file", ready, "--heartbeat-ms", "500", NULL};
  signal(SIGINT, on_sigint);
  signal(SIGTERM, on_sigint);
  pid_t coord = spawn(cargv, log);
  int port = 0;
  zt_deadline_t dl = zt_deadline_in(15000);
  while (read_ready(ready, &port) != 0) {
    if (zt_deadline_passed(dl) || waitpid(coord, NULL, WNOHANG) == coord) {
      ZT_ERROR("zcoord did not start; see %s", log);
      return 1;
    }
    zt_sleep_ms(20); /* polling for the ready file with a deadline */
  }
  char target[64];
  snprintf(target, sizeof target, "127.0.0.1:%d", port);
  pid_t wk[MAX_WORKERS];
  char thr[16];
  snprintf(thr, sizeof thr, "%d", threads);
  for (int i = 0; i < workers; i++) {
    char name[32], wd[PATH_MAX];
    snprintf(name, sizeof name, "local-%d", i);
    snprintf(wd, sizeof wd, "%s/%s", dir, name);
    snprintf(log, sizeof log, "%s/%s.log", dir, name);
    char *wargv[] = {zworker, "--coordinator", target, "--name", name, "--workdir", wd,
                     "--device", "cpu", "--threads", thr, NULL};
    wk[i] = spawn(wargv, log);
  }
  zt_rpc_client_t *rpc = NULL;
  int rc = 1;
  uint64_t job = 0;
  Ztrain__SubmitJobRequest sreq = ZTRAIN__SUBMIT_JOB_REQUEST__INIT;
  sreq.spec_json = spec;
  uint8_t *buf = zt_xmalloc(ztrain__submit_job_request__get_packed_size(&sreq));
  size_t blen = ztrain__submit_job_request__pack(&sreq, buf);
  if (zt_rpc_client_open(target, NULL, &rpc) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    goto stop;
  }
  uint8_t *resp = NULL;
  size_t rlen = 0;
  if (zt_rpc_call(rpc, "/ztrain.Status/SubmitJob", buf, blen, 10000, &resp, &rlen, NULL) != 0) {
    ZT_ERROR("submit %s: %s", spec_path, zt_err_msg());
    goto stop;
  }
  Ztrain__SubmitJobReply *sr = ztrain__submit_job_reply__unpack(NULL, rlen, resp);
  job = sr ? sr->job_id : 0;
  if (sr) ztrain__submit_job_reply__free_unpacked(sr, NULL);
  free(resp);
  printf("ztrain: job %llu submitted to %s with %d workers (logs in %s/)\n",
         (unsigned long long)job, target, workers, dir);
  fflush(stdout);
  int64_t last_step = -1;
  while (!g_interrupted) {
    Ztrain__GetJobRequest g = ZTRAIN__GET_JOB_REQUEST__INIT;
    g.job_id = job;
    uint8_t gb[32];
    size_t gl = ztrain__get_job_request__pack(&g, gb);
    resp = NULL;
    if (zt_rpc_call(rpc, "/ztrain.Status/GetJob", gb, gl, 5000, &resp, &rlen, NULL) == 0) {
      Ztrain__GetJobReply *gr = ztrain__get_job_reply__unpack(NULL, rlen, resp);
      free(resp);
      Ztrain__JobInfo *ji = gr ? gr->job : NULL;
      if (ji && ji->step != last_step && ji->step > 0 && !quiet) {
        printf("step %6lld/%lld  loss %.4f  lr %.3g  %8.0f tok/s  gen %llu  world %u\n",
               (long long)ji->step, (long long)ji->total_steps, ji->loss, ji->lr, ji->tokens_per_s,
               (unsigned long long)ji->generation, ji->world);
        fflush(stdout);
        last_step = ji->step;
      }
      int state = ji ? ji->state : 0;
      if (state == ZTRAIN__JOB_STATE__JOB_COMPLETED || state == ZTRAIN__JOB_STATE__JOB_FAILED ||
          state == ZTRAIN__JOB_STATE__JOB_CANCELED) {
        printf("ztrain: job %llu %s: %s\n", (unsigned long long)job, k_states[state], ji->message);
        rc = state == ZTRAIN__JOB_STATE__JOB_COMPLETED ? 0 : 1;
        ztrain__get_job_reply__free_unpacked(gr, NULL);
        break;
      }
      if (gr) ztrain__get_job_reply__free_unpacked(gr, NULL);
    }
    zt_sleep_ms(200); /* progress display cadence */
  }
stop:
  for (int i = 0; i < workers; i++) kill(wk[i], SIGTERM);
  for (int i = 0; i < workers; i++) reap(wk[i], 10000);
  kill(coord, SIGTERM);
  reap(coord, 10000);
  zt_rpc_client_close(rpc);
  free(buf);
  free(spec);
  return rc;
usage:
  fprintf(stderr, "usage: ztrain JOB.json [--workers N] [--dir DIR] [--threads T] [--quiet]\n");
  return 2;
}
