/*
 * ztrain.c: the local launcher, the default single-machine experience.
 *
 *   ztrain JOB.json [--workers N] [--dir DIR] [--threads T] [--quiet]
 *                   [--http-port PORT] [--serve]
 *                   [--data-root DIR] [--checkpoint-root DIR]
 *
 * Starts a zcoord (its database and logs under DIR, default ztrain-run/)
 * and N local CPU zworkers, submits the job, prints the dashboard's URL
 * (zcoord's HTTP port: --http-port, default 7080; 0 takes any free port)
 * and progress (step, loss, tokens/s) until the job ends, then stops the
 * workers (SIGTERM: they say Leave) and the coordinator. On a terminal the
 * progress is one line rewritten in place, with an ETA; otherwise one line
 * per step seen. With --serve the coordinator and its dashboard stay up
 * after the job ends (the workers stop as usual) until SIGINT or SIGTERM.
 * An HTTP port already in use is an error before anything starts. A
 * process that cannot be started (fork fails) stops whatever was started.
 * While the job runs ztrain watches its children: when zcoord exits, or
 * every worker has, it says so in one line and stops the rest. Exit
 * status: 0 when the job completed, 1 when it failed, could not start or
 * lost its coordinator or workers, 2 on a usage error. The daemons' logs
 * stay in DIR.
 *
 * The job is the user's own, on the user's own machine, so its paths are
 * not confined to the working directory: the daemons' data and checkpoint
 * roots are taken from the spec (prepare_spec(): the deepest directory that
 * holds every data path, and every checkpoint path, symbolic links
 * resolved), unless --data-root or --checkpoint-root names one. Relative
 * paths in the spec are taken from the working directory, as always; the
 * spec is submitted with its paths made absolute, so that they keep that
 * meaning under roots elsewhere. zcoord and zworker confine paths as they
 * always do, under these roots.
 *
 * The machine's cores are shared among the workers: each gets
 * --threads T compute threads, by default the usable cores (affinity and
 * cgroup quota included) divided by N, at least one. A spec without an
 * elastic section runs on exactly the N workers started. While the job
 * runs, a pause is printed at once with its reason; one that needs an
 * operator (zctl resume) ends ztrain with status 1 and that reason, while
 * one the coordinator resumes by itself is waited out. A generation that
 * runs on fewer workers than were started says so.
 *
 * Everything here goes through the same interfaces an operator would use:
 * processes, gRPC (SubmitJob, GetJob), the ready file zcoord writes.
 */
#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <glob.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "pbcall.h"
#include "zt_common.h"
#include "zt_rpc.h"
#include "ztrain.pb-c.h"

#define MAX_WORKERS 64
/* zcoord's own default HTTP port: the dashboard's usual address. */
#define DEFAULT_HTTP_PORT 7080

static volatile sig_atomic_t g_interrupted;
static void on_sigint(int sig) { (void)sig, g_interrupted = 1; }
/* Only there so that a child's exit ends sigsuspend() in serve(). */
static void on_sigchld(int sig) { (void)sig; }

/* Starts `argv` with stdout+stderr appended to `log`; -1 with errno set
 * when fork() fails. */
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

/* Waits up to ms for a child; SIGKILL after that. A pid <= 0 is no child:
 * waitpid() and kill() would take it for a process group, or for every
 * process we may signal. */
static void reap(pid_t pid, int64_t ms) {
  if (pid <= 0) return;
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

static int read_ready(const char *path, int *grpc_port, int *http_port) {
  char *t;
  size_t n;
  if (zt_read_file(path, &t, &n, 4096) != 0) return -1;
  const char *p = strstr(t, "\"grpc_port\": "), *h = strstr(t, "\"http_port\": ");
  int ok = p && h && sscanf(p + 13, "%d", grpc_port) == 1 && sscanf(h + 13, "%d", http_port) == 1;
  free(t);
  return ok ? 0 : -1;
}

/* 0 when 127.0.0.1:port can be bound (as zcoord binds it: SO_REUSEADDR),
 * else an error naming the port. */
static int check_http_port(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
  if (fd < 0) return zt_err_errno("socket");
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int rc = setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0
               ? bind(fd, (struct sockaddr *)&sa, sizeof sa)
               : -1;
  int e = errno;
  close(fd);
  if (rc == 0) return 0;
  if (e == EADDRINUSE)
    return zt_err("HTTP port %d is already in use (another ztrain or zcoord?); choose another "
                  "with --http-port PORT, or --http-port 0 for any free port",
                  port);
  errno = e;
  return zt_err_errno("HTTP port %d", port);
}

/* The reason zcoord gave for not starting: its last ERROR line at or after
 * offset `from` of its log, without the line's time and tag. */
static void coord_failure(const char *log, long from, char *out, size_t n) {
  char line[1024];
  snprintf(out, n, "see %.1000s", log);
  FILE *f = fopen(log, "r");
  if (!f) return;
  if (fseek(f, from, SEEK_SET) == 0)
    while (fgets(line, sizeof line, f)) {
      const char *e = strstr(line, " ERROR ");
      const char *msg = e ? strstr(e, "zcoord: ") : NULL;
      if (!msg) continue;
      line[strcspn(line, "\n")] = 0;
      snprintf(out, n, "%.700s (log: %.300s)", msg, log);
    }
  fclose(f);
}

/* How a child ended, from its wait status: "exit status N" or "killed by
 * signal N". */
static void exit_text(int st, char *out, size_t n) {
  if (WIFSIGNALED(st)) snprintf(out, n, "killed by signal %d", WTERMSIG(st));
  else snprintf(out, n, "exit status %d", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}

/* One launch: its settings and what it started. */
typedef struct {
  int workers, threads, quiet, serve;
  int http_port;   /* asked for (0: any free port), then the one zcoord bound */
  int tty;         /* stdout is a terminal: progress is one line, rewritten */
  int line_open;   /* a progress line without its newline is on the terminal */
  const char *dir, *spec_path;
  const char *data_root_opt, *ckpt_root_opt; /* --data-root, --checkpoint-root */
  char data_root[ZT_PATH_MAX], ckpt_root[ZT_PATH_MAX]; /* the daemons' roots (absolute, real) */
  char bindir[ZT_PATH_MAX];
  char target[64]; /* zcoord's gRPC address */
  char url[64];    /* the dashboard */
  char coord_log[ZT_PATH_MAX];
  long coord_log_from; /* the size of zcoord's log before this start */
  pid_t coord;         /* 0: none (not started, or reaped) */
  pid_t wk[MAX_WORKERS]; /* 0: reaped */
  int started;         /* workers started */
  zt_rpc_client_t *rpc;
  char sizing[512];    /* how the spec's elastic range meets --workers, said at submit */
} launch;

/* An option's value: a decimal integer in [lo, hi], or -1 with a message
 * naming the option on stderr. */
static int opt_int(const char *opt, const char *v, int64_t lo, int64_t hi, int *out) {
  int64_t x;
  if (zt_parse_i64(opt, v, lo, hi, &x) != 0) {
    fprintf(stderr, "ztrain: %s\n", zt_err_msg());
    return -1;
  }
  *out = (int)x;
  return 0;
}

static int parse_args(launch *l, int argc, char **argv) {
  static const struct option opts[] = {{"workers", required_argument, 0, 'n'},
                                       {"dir", required_argument, 0, 'd'},
                                       {"threads", required_argument, 0, 't'},
                                       {"quiet", no_argument, 0, 'q'},
                                       {"http-port", required_argument, 0, 'p'},
                                       {"serve", no_argument, 0, 's'},
                                       {"data-root", required_argument, 0, 'D'},
                                       {"checkpoint-root", required_argument, 0, 'C'},
                                       {0, 0, 0, 0}};
  l->workers = 2;
  l->threads = -1; /* the usable cores shared among the workers */
  l->dir = "ztrain-run";
  l->http_port = DEFAULT_HTTP_PORT;
  int ch;
  while ((ch = getopt_long(argc, argv, "n:", opts, NULL)) != -1) {
    switch (ch) {
    case 'n':
      if (opt_int("--workers", optarg, 1, MAX_WORKERS, &l->workers) != 0) return -1;
      break;
    case 'd': l->dir = optarg; break;
    case 't':
      if (opt_int("--threads", optarg, 0, 1024, &l->threads) != 0) return -1;
      break;
    case 'q': l->quiet = 1; break;
    case 's': l->serve = 1; break;
    case 'p':
      if (opt_int("--http-port", optarg, 0, 65535, &l->http_port) != 0) return -1;
      break;
    case 'D': l->data_root_opt = optarg; break;
    case 'C': l->ckpt_root_opt = optarg; break;
    default: return -1;
    }
  }
  if (optind != argc - 1) return -1;
  l->spec_path = argv[optind];
  if (l->threads < 0) l->threads = ZT_MAX(1, zt_cpus_usable() / l->workers);
  /* The daemons are our siblings in the bin directory. */
  char self[ZT_PATH_MAX];
  ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
  if (sl <= 0) return -1;
  self[sl] = 0;
  snprintf(l->bindir, sizeof l->bindir, "%.*s", (int)(strrchr(self, '/') - self), self);
  return 0;
}

/* ---- the spec's paths and the daemons' roots ----------------------------- */

/* The spec's paths, each under one of the daemons' two roots: data
 * (patterns, files and the Hugging Face model directory a job starts
 * from: zcoord and zworker confine every init path under the data root)
 * and checkpoints (directories). A directory's root is the directory
 * above it. */
static const struct {
  const char *obj, *key;
  int ckpt; /* under the checkpoint root (else the data root) */
  int dir;  /* names a directory (else a file or a pattern) */
} k_spec_paths[] = {{"data", "train", 0, 0},
                    {"data", "val", 0, 0},
                    {"init", "from_safetensors", 0, 0},
                    {"init", "from_pretrained", 0, 1},
                    {"init", "lora_from", 0, 0},
                    {"checkpoint", "dir", 1, 1},
                    {"checkpoint", "load", 1, 1}};

static int has_glob(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (s[i] == '*' || s[i] == '?' || s[i] == '[') return 1;
  return 0;
}

/* Narrows root (absolute; "" for none yet) to the deepest directory that
 * holds both it and dir (absolute). */
static void widen(char *root, const char *dir) {
  if (!root[0]) {
    snprintf(root, PATH_MAX, "%s", dir);
    return;
  }
  size_t last = 0; /* the end of the common part, at a component boundary */
  for (size_t i = 0;; i++) {
    int end_r = root[i] == 0 || root[i] == '/', end_d = dir[i] == 0 || dir[i] == '/';
    if (end_r && end_d) last = i;
    if (root[i] != dir[i] || !root[i]) break;
  }
  if (last == 0) last = 1; /* "/" */
  root[last] = 0;
}

/* Resolves a path of the spec (p: relative to cwd, or absolute): its
 * longest existing leading part with symbolic links and ".." resolved
 * (realpath), the rest as written (a pattern's components from the first
 * with a wildcard, what does not exist yet). With keep_last the last
 * component stays as written (a data file's name, or pattern). out gets
 * the whole path, dir the resolved leading part. */
static int resolve_spec_path(const char *cwd, const char *what, const char *p, int keep_last,
                             char *out, char *dir) {
  char abs[ZT_PATH_MAX], cur[ZT_PATH_MAX], next[ZT_PATH_MAX], real[ZT_PATH_MAX];
  if (snprintf(abs, sizeof abs, "%s%s%s", p[0] == '/' ? "" : cwd, p[0] == '/' ? "" : "/", p) >=
      (int)sizeof abs)
    return zt_err("%s: path too long: %.200s", what, p);
  snprintf(cur, sizeof cur, "/");
  const char *rest = abs;
  for (;;) {
    while (*rest == '/') rest++;
    size_t n = strcspn(rest, "/");
    const char *after = rest + n;
    while (*after == '/') after++;
    if (!n || has_glob(rest, n) || (keep_last && !*after)) break;
    if (snprintf(next, sizeof next, "%s%s%.*s", cur, strcmp(cur, "/") ? "/" : "", (int)n,
                 rest) >= (int)sizeof next)
      return zt_err("%s: path too long: %.200s", what, p);
    if (!realpath(next, real)) {
      if (errno != ENOENT && errno != ENOTDIR) return zt_err_errno("%s: %s", what, next);
      break; /* cur: the part that exists */
    }
    memcpy(cur, real, sizeof cur);
    rest += n;
  }
  snprintf(dir, PATH_MAX, "%s", cur);
  while (*rest == '/') rest++;
  size_t rl = strlen(rest);
  while (rl && rest[rl - 1] == '/') rl--;
  if (snprintf(out, PATH_MAX, "%s%s%.*s", cur, rl && strcmp(cur, "/") ? "/" : "", (int)rl,
               rest) >= PATH_MAX)
    return zt_err("%s: path too long: %.200s", what, p);
  return 0;
}

/* Adds the real directories of what a data path names (the files a
 * pattern matches: one may be a symbolic link to another directory) to
 * root. */
static void widen_matches(char *root, const char *pattern) {
  glob_t g;
  if (glob(pattern, 0, NULL, &g) != 0) return;
  for (size_t i = 0; i < g.gl_pathc; i++) {
    char real[ZT_PATH_MAX];
    if (!realpath(g.gl_pathv[i], real)) continue;
    char *slash = strrchr(real, '/');
    if (slash == real) slash[1] = 0;
    else *slash = 0;
    widen(root, real);
  }
  globfree(&g);
}

/* A root given on the command line: an existing directory, made absolute
 * and real. */
static int root_opt(const char *opt, const char *dir, char *out) {
  struct stat st;
  if (!realpath(dir, out) || stat(out, &st) != 0) return zt_err_errno("%s %s", opt, dir);
  if (!S_ISDIR(st.st_mode)) return zt_err("%s %s: not a directory", opt, dir);
  return 0;
}

/* A spec without an elastic section runs on exactly the --workers started
 * (elastic.min_workers = max_workers = N), and says so; a spec whose
 * elastic range leaves some of them idle says that; one that needs more
 * than are started is an error. Sets *changed when the spec changed. */
static int size_job(launch *l, cJSON *doc, int *changed) {
  cJSON *e = cJSON_GetObjectItemCaseSensitive(doc, "elastic");
  if (!e) {
    if (!(e = cJSON_AddObjectToObject(doc, "elastic")) ||
        !cJSON_AddNumberToObject(e, "min_workers", l->workers) ||
        !cJSON_AddNumberToObject(e, "max_workers", l->workers))
      return zt_err("%s: out of memory", l->spec_path);
    *changed = 1;
    snprintf(l->sizing, sizeof l->sizing,
             "%s has no elastic section: the job runs on the %d workers "
             "(elastic.min_workers = max_workers = %d)",
             l->spec_path, l->workers, l->workers);
    return 0;
  }
  if (!cJSON_IsObject(e)) return 0; /* zcoord's check names what is wrong */
  cJSON *mn = cJSON_GetObjectItemCaseSensitive(e, "min_workers");
  cJSON *mx = cJSON_GetObjectItemCaseSensitive(e, "max_workers");
  int lo = cJSON_IsNumber(mn) ? (int)mn->valuedouble : 1;
  int hi = cJSON_IsNumber(mx) ? (int)mx->valuedouble : lo;
  if (lo > l->workers)
    return zt_err("%s: elastic.min_workers is %d, more than the %d workers started "
                  "(--workers %d or more)",
                  l->spec_path, lo, l->workers, lo);
  if (hi < l->workers)
    snprintf(l->sizing, sizeof l->sizing,
             "%s allows at most %d workers (elastic.max_workers): %d of the %d started stay idle",
             l->spec_path, hi, l->workers - hi, l->workers);
  return 0;
}

/* Sets l->data_root and l->ckpt_root: --data-root and --checkpoint-root
 * when given, else the deepest directory holding every path of the kind
 * in the spec (the working directory when the spec names none). The
 * spec's paths are made absolute (relative ones are taken from the working
 * directory); the job is sized from --workers (size_job). *spec is
 * replaced by the rewritten text when it changed.
 * A spec that is not a JSON object is left for zcoord to refuse, with its
 * reason. */
static int prepare_spec(launch *l, char **spec, size_t len) {
  char cwd[ZT_PATH_MAX];
  if (!getcwd(cwd, sizeof cwd)) return zt_err_errno("getcwd");
  char *root[2] = {l->data_root, l->ckpt_root};
  const char *opt[2] = {l->data_root_opt, l->ckpt_root_opt};
  const char *opt_name[2] = {"--data-root", "--checkpoint-root"};
  for (int k = 0; k < 2; k++) {
    root[k][0] = 0;
    if (opt[k] && root_opt(opt_name[k], opt[k], root[k]) != 0) return -1;
  }
  const char *end = NULL;
  cJSON *doc = cJSON_ParseWithLengthOpts(*spec, len, &end, 0);
  size_t used = doc ? (size_t)(end - *spec) : 0;
  while (doc && used < len && strchr(" \t\r\n", (*spec)[used])) used++;
  int changed = 0, rc = 0;
  if (cJSON_IsObject(doc) && used == len) {
    for (size_t i = 0; i < ZT_ARRAY_LEN(k_spec_paths) && rc == 0; i++) {
      cJSON *o = cJSON_GetObjectItemCaseSensitive(doc, k_spec_paths[i].obj);
      cJSON *v = cJSON_IsObject(o) ? cJSON_GetObjectItemCaseSensitive(o, k_spec_paths[i].key) : NULL;
      if (!cJSON_IsString(v) || !v->valuestring[0]) continue;
      int ck = k_spec_paths[i].ckpt, isdir = k_spec_paths[i].dir;
      char what[64], path[ZT_PATH_MAX], dir[ZT_PATH_MAX];
      snprintf(what, sizeof what, "%s.%s", k_spec_paths[i].obj, k_spec_paths[i].key);
      if ((rc = resolve_spec_path(cwd, what, v->valuestring, !isdir, path, dir)) != 0) break;
      if (!opt[ck]) {
        /* A directory's root is the directory above it. */
        if (isdir && !strcmp(dir, path) && strcmp(dir, "/")) {
          char *slash = strrchr(dir, '/');
          if (slash == dir) slash[1] = 0;
          else *slash = 0;
        }
        widen(root[ck], dir);
        if (!isdir) widen_matches(root[ck], path);
      }
      if (strcmp(path, v->valuestring)) {
        if (!cJSON_SetValuestring(v, path)) rc = zt_err("%s: out of memory", what);
        changed = 1;
      }
    }
    if (rc == 0) rc = size_job(l, doc, &changed);
  }
  if (rc == 0 && changed) {
    char *text = cJSON_PrintUnformatted(doc);
    if (text) {
      free(*spec);
      *spec = text;
    } else {
      rc = zt_err("%s: out of memory", l->spec_path);
    }
  }
  cJSON_Delete(doc);
  for (int k = 0; k < 2 && rc == 0; k++)
    if (!root[k][0]) snprintf(root[k], PATH_MAX, "%s", cwd);
  return rc;
}

/* Starts zcoord (gRPC on a free port, HTTP on l->http_port) and waits for
 * its ready file; when zcoord exits first, its reason is the error. */
static int start_coord(launch *l) {
  char zcoord[ZT_PATH_MAX], db[ZT_PATH_MAX], ready[ZT_PATH_MAX], http[32];
  const char *log = l->coord_log;
  if (zt_path_join(zcoord, sizeof zcoord, l->bindir, "zcoord") != 0 ||
      zt_path_join(db, sizeof db, l->dir, "zcoord.db") != 0 ||
      zt_path_join(ready, sizeof ready, l->dir, "zcoord.ready") != 0 ||
      zt_path_join(l->coord_log, sizeof l->coord_log, l->dir, "zcoord.log") != 0)
    return -1;
  snprintf(http, sizeof http, "127.0.0.1:%d", l->http_port);
  unlink(ready);
  struct stat st;
  l->coord_log_from = stat(log, &st) == 0 ? (long)st.st_size : 0;
  char *argv[] = {zcoord, "--grpc", "127.0.0.1:0", "--http", http, "--db", db,
                  "--ready-file", ready, "--heartbeat-ms", "500",
                  "--data-root", l->data_root, "--checkpoint-root", l->ckpt_root, NULL};
  pid_t pid = spawn(argv, log);
  if (pid < 0) return zt_err_errno("cannot start zcoord");
  l->coord = pid;
  int port = 0;
  zt_deadline_t dl = zt_deadline_in(15000);
  while (read_ready(ready, &port, &l->http_port) != 0) {
    char why[1200];
    if (waitpid(l->coord, NULL, WNOHANG) == l->coord) {
      l->coord = 0; /* reaped */
      coord_failure(log, l->coord_log_from, why, sizeof why);
      return zt_err("zcoord did not start: %s", why);
    }
    if (zt_deadline_passed(dl))
      return zt_err("zcoord did not start within 15 s; see %s", log);
    zt_sleep_ms(20); /* polling for the ready file with a deadline */
  }
  snprintf(l->target, sizeof l->target, "127.0.0.1:%d", port);
  snprintf(l->url, sizeof l->url, "http://127.0.0.1:%d/", l->http_port);
  return 0;
}

/* Starts the workers; l->wk holds only processes that were started, so a
 * failure leaves stop_all() exactly those to stop. */
static int start_workers(launch *l) {
  char zworker[ZT_PATH_MAX], thr[16];
  if (zt_path_join(zworker, sizeof zworker, l->bindir, "zworker") != 0) return -1;
  snprintf(thr, sizeof thr, "%d", l->threads);
  for (int i = 0; i < l->workers; i++) {
    char name[32], logname[40], wd[ZT_PATH_MAX], log[ZT_PATH_MAX];
    snprintf(name, sizeof name, "local-%d", i);
    snprintf(logname, sizeof logname, "%s.log", name);
    if (zt_path_join(wd, sizeof wd, l->dir, name) != 0 ||
        zt_path_join(log, sizeof log, l->dir, logname) != 0)
      return -1;
    char *argv[] = {zworker, "--coordinator", l->target, "--name", name, "--workdir", wd,
                    "--device", "cpu", "--threads", thr, "--data-root", l->data_root,
                    "--checkpoint-root", l->ckpt_root, NULL};
    pid_t pid = spawn(argv, log);
    if (pid < 0) return zt_err_errno("cannot start worker %d", i);
    l->wk[l->started++] = pid;
  }
  return 0;
}

static int check_children(launch *l);

/* The workers alive at the coordinator (-1 when it does not answer). */
static int alive_workers(launch *l) {
  Ztrain__ListWorkersRequest req = ZTRAIN__LIST_WORKERS_REQUEST__INIT;
  ProtobufCMessage *m;
  if (zt_pb_call(l->rpc, "/ztrain.Status/ListWorkers", &req.base,
                 &ztrain__list_workers_reply__descriptor, 5000, &m, NULL) != 0)
    return -1;
  Ztrain__ListWorkersReply *r = (Ztrain__ListWorkersReply *)m;
  int n = 0;
  for (size_t i = 0; i < r->n_workers; i++)
    n += r->workers[i]->state == ZTRAIN__WORKER_STATE__WORKER_ALIVE;
  protobuf_c_message_free_unpacked(m, NULL);
  return n;
}

/* Waits (up to 30 s) until every worker started is alive, so that the
 * job's first generation has them all rather than the first to register;
 * a worker that exits first, or the deadline, ends the wait with a line
 * that says how many there are. */
static int await_workers(launch *l) {
  zt_deadline_t dl = zt_deadline_in(30000);
  int n = 0;
  while (!g_interrupted && (n = alive_workers(l)) < l->workers) {
    if (check_children(l) != 0) return -1;
    if (zt_deadline_passed(dl)) {
      printf("ztrain: %d of %d workers registered within 30 s; submitting anyway (see %s/)\n",
             ZT_MAX(n, 0), l->workers, l->dir);
      return 0;
    }
    zt_sleep_ms(50); /* polling the coordinator's worker list with a deadline */
  }
  return 0;
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

/* ---- progress ------------------------------------------------------------ */

/* The step rate since an anchor: the first step seen, re-anchored when a
 * generation starts (a restart or rollback; the gap is not training). */
typedef struct {
  int64_t t0_ms, s0;
  uint64_t gen;
} eta_t;

static void fmt_duration(double s, char *out, size_t n) {
  long long t = (long long)(s + 0.5);
  if (t < 60) snprintf(out, n, "%llds", t);
  else if (t < 3600) snprintf(out, n, "%lldm%02llds", t / 60, t % 60);
  else snprintf(out, n, "%lldh%02lldm", t / 3600, t / 60 % 60);
}

/* The time left at the rate seen since the anchor ("--" until known). */
static void eta_text(eta_t *e, const Ztrain__JobInfo *ji, char *out, size_t n) {
  int64_t now = zt_now_ms();
  if (!e->t0_ms || ji->step < e->s0 || ji->generation != e->gen)
    e->t0_ms = now, e->s0 = ji->step, e->gen = ji->generation;
  int64_t ds = ji->step - e->s0, dt = now - e->t0_ms;
  if (ds <= 0 || dt <= 0) {
    snprintf(out, n, "--");
    return;
  }
  fmt_duration((double)(ji->total_steps - ji->step) * (double)dt / 1000.0 / (double)ds, out, n);
}

/* The terminal's width (80 when it does not say). */
static int term_cols(void) {
  struct winsize ws;
  return ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 ? ws.ws_col : 80;
}

/* On a terminal: one line rewritten in place (carriage return, the text
 * cut to the width, clear to the end of the line). */
static void progress_tty(launch *l, const Ztrain__JobInfo *ji, eta_t *e) {
  char eta[32], line[256];
  eta_text(e, ji, eta, sizeof eta);
  snprintf(line, sizeof line, "step %lld/%lld  loss %.4f  %.0f tok/s  ETA %s  gen %llu  world %u",
           (long long)ji->step, (long long)ji->total_steps, ji->loss, ji->tokens_per_s, eta,
           (unsigned long long)ji->generation, ji->world);
  int cols = term_cols();
  if (cols - 1 < (int)sizeof line) line[cols - 1] = 0;
  printf("\r%s\033[K", line);
  fflush(stdout);
  l->line_open = 1;
}

/* Elsewhere (a pipe, a file): one line per step seen; scripts parse it. */
static void progress_plain(const Ztrain__JobInfo *ji) {
  printf("step %6lld/%lld  loss %.4f  lr %.3g  %8.0f tok/s  gen %llu  world %u\n",
         (long long)ji->step, (long long)ji->total_steps, ji->loss, ji->lr, ji->tokens_per_s,
         (unsigned long long)ji->generation, ji->world);
  fflush(stdout);
}

/* Ends a progress line left open, so that the next output starts a line. */
static void end_line(launch *l) {
  if (l->line_open) putchar('\n');
  l->line_open = 0;
}

/* 0 while zcoord and at least one worker still run. Otherwise -1 with the
 * reason: zcoord exited (with its last ERROR line, if any), or the last
 * worker did. Exited children are reaped (their pid set to 0); a worker
 * that exits while others still run is only a warning, since the job may
 * go on without it. */
static int check_children(launch *l) {
  char how[64], why[1200];
  int st, alive = 0, gone = -1;
  if (l->coord > 0 && waitpid(l->coord, &st, WNOHANG) == l->coord) {
    l->coord = 0; /* reaped */
    exit_text(st, how, sizeof how);
    coord_failure(l->coord_log, l->coord_log_from, why, sizeof why);
    return zt_err("zcoord exited (%s) while the job ran: %s", how, why);
  }
  for (int i = 0; i < l->started; i++) {
    if (l->wk[i] > 0 && waitpid(l->wk[i], &st, WNOHANG) == l->wk[i]) {
      l->wk[i] = 0; /* reaped */
      gone = i;
      exit_text(st, how, sizeof how);
    }
    alive += l->wk[i] > 0;
  }
  if (gone < 0) return 0;
  if (!alive)
    return zt_err("all %d workers exited while the job ran (the last, local-%d: %s); see "
                  "%s/local-*.log",
                  l->started, gone, how, l->dir);
  end_line(l);
  ZT_WARN("worker local-%d exited (%s); %d of %d still run; see %s/local-%d.log", gone, how,
          alive, l->started, l->dir, gone);
  return 0;
}

/* Prints what the progress line does not show, once each: a pause and its
 * reason, and a generation on fewer workers than were started. The
 * coordinator's text is escaped before it reaches the terminal. */
static void say_changes(launch *l, const Ztrain__JobInfo *ji, uint64_t *said_gen, char *said_pause,
                        size_t n) {
  char msg[1024];
  zt_printable(ji->message, msg, sizeof msg);
  if (ji->state != ZTRAIN__JOB_STATE__JOB_PAUSED) {
    said_pause[0] = 0;
  } else if (strncmp(said_pause, msg, n - 1)) {
    end_line(l);
    printf("ztrain: job %llu paused: %s%s\n", (unsigned long long)ji->id, msg,
           ji->resumes_by_itself ? " (the coordinator resumes it by itself)" : "");
    fflush(stdout);
    snprintf(said_pause, n, "%s", msg);
  }
  if (ji->state == ZTRAIN__JOB_STATE__JOB_RUNNING && ji->generation != *said_gen && ji->world) {
    *said_gen = ji->generation;
    if ((int)ji->world < l->workers) {
      end_line(l);
      printf("ztrain: generation %llu runs on %u of the %d workers started (%s)\n",
             (unsigned long long)ji->generation, ji->world, l->workers, msg);
      fflush(stdout);
    }
  }
}

/* Prints progress until the job ends (or ztrain is interrupted, or its
 * coordinator or every worker exits); returns the exit status: 0 when the
 * job completed. */
static int follow(launch *l, uint64_t job) {
  int64_t last_step = -1;
  uint64_t said_gen = 0;
  char said_pause[1024] = ""; /* the pause last printed */
  eta_t eta = {0};
  while (!g_interrupted) {
    if (check_children(l) != 0) {
      end_line(l);
      ZT_ERROR("job %llu: %s", (unsigned long long)job, zt_err_msg());
      return 1;
    }
    Ztrain__GetJobRequest req = ZTRAIN__GET_JOB_REQUEST__INIT;
    req.job_id = job;
    ProtobufCMessage *m;
    if (zt_pb_call(l->rpc, "/ztrain.Status/GetJob", &req.base, &ztrain__get_job_reply__descriptor,
                   5000, &m, NULL) == 0) {
      Ztrain__JobInfo *ji = ((Ztrain__GetJobReply *)m)->job;
      if (ji && ji->step != last_step && ji->step > 0 && !l->quiet) {
        if (l->tty) progress_tty(l, ji, &eta);
        else progress_plain(ji);
        last_step = ji->step;
      }
      if (ji) say_changes(l, ji, &said_gen, said_pause, sizeof said_pause);
      int state = ji ? ji->state : 0, done = state == ZTRAIN__JOB_STATE__JOB_COMPLETED ||
                                              state == ZTRAIN__JOB_STATE__JOB_FAILED ||
                                              state == ZTRAIN__JOB_STATE__JOB_CANCELED;
      if (state == ZTRAIN__JOB_STATE__JOB_PAUSED && !ji->resumes_by_itself) {
        printf("ztrain: job %llu cannot go on without an operator (zctl resume %llu once the "
               "cause is fixed); stopping\n",
               (unsigned long long)job, (unsigned long long)job);
        protobuf_c_message_free_unpacked(m, NULL);
        return 1;
      }
      if (done) {
        end_line(l);
        printf("ztrain: job %llu %s: %s\n", (unsigned long long)job, zt_name_job_state(state),
               ji->message);
      }
      protobuf_c_message_free_unpacked(m, NULL);
      if (done) return state == ZTRAIN__JOB_STATE__JOB_COMPLETED ? 0 : 1;
    }
    zt_sleep_ms(200); /* progress display cadence */
  }
  end_line(l);
  return 1;
}

/* SIGTERM: they say Leave. Only pids > 0 are signalled: kill(-1, ...)
 * would reach every process we may signal. */
static void stop_workers(launch *l) {
  for (int i = 0; i < l->started; i++)
    if (l->wk[i] > 0) kill(l->wk[i], SIGTERM);
  for (int i = 0; i < l->started; i++) reap(l->wk[i], 10000);
  l->started = 0;
}

/* Workers first, then the coordinator. */
static void stop_all(launch *l) {
  stop_workers(l);
  if (l->coord > 0) {
    kill(l->coord, SIGTERM);
    reap(l->coord, 10000);
  }
  zt_rpc_client_close(l->rpc);
}

/* --serve: the job has ended and the workers are stopped; the coordinator
 * and its dashboard stay up until SIGINT or SIGTERM, or until zcoord
 * exits. The signals stay blocked between the checks and sigsuspend(),
 * so none is missed. */
static void serve(launch *l) {
  printf("ztrain: workers stopped; serving the dashboard at %s until Ctrl-C\n", l->url);
  fflush(stdout);
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGTERM);
  sigaddset(&block, SIGCHLD);
  sigprocmask(SIG_BLOCK, &block, &old);
  signal(SIGCHLD, on_sigchld);
  while (!g_interrupted && l->coord > 0) {
    if (waitpid(l->coord, NULL, WNOHANG) == l->coord) {
      l->coord = 0; /* reaped */
      ZT_ERROR("zcoord exited while serving; see %s/zcoord.log", l->dir);
      break;
    }
    sigsuspend(&old);
  }
  sigprocmask(SIG_SETMASK, &old, NULL);
}

int main(int argc, char **argv) {
  if (zt_version_arg(argc, argv, "ztrain")) return 0;
  zt_log_set_prefix("ztrain");
  launch l = {0};
  char *spec = NULL;
  size_t spec_len;
  uint64_t job = 0;
  int rc = 1;
  if (parse_args(&l, argc, argv) != 0) {
    fprintf(stderr, "usage: ztrain JOB.json [--workers N] [--dir DIR] [--threads T] [--quiet]\n"
                    "                       [--http-port PORT (default %d; 0: any free)] "
                    "[--serve]\n"
                    "                       [--data-root DIR] [--checkpoint-root DIR] "
                    "(default: from the spec's paths)\n",
            DEFAULT_HTTP_PORT);
    return 2;
  }
  if (zt_read_file(l.spec_path, &spec, &spec_len, 4 << 20) != 0 ||
      prepare_spec(&l, &spec, spec_len) != 0 || zt_mkdirs(l.dir) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    free(spec);
    return 2;
  }
  signal(SIGINT, on_sigint);
  signal(SIGTERM, on_sigint);
  l.tty = isatty(STDOUT_FILENO);
  if ((l.http_port && check_http_port(l.http_port) != 0) || start_coord(&l) != 0) goto out;
  printf("ztrain: dashboard at %s\n", l.url);
  fflush(stdout);
  if (start_workers(&l) != 0 || zt_rpc_client_open(l.target, NULL, &l.rpc) != 0 ||
      await_workers(&l) != 0 || submit(&l, spec, &job) != 0)
    goto out;
  char thr[48] = "";
  if (l.threads) snprintf(thr, sizeof thr, ", %d compute thread%s each", l.threads,
                          l.threads == 1 ? "" : "s");
  printf("ztrain: job %llu submitted to %s with %d workers%s (%d usable cores; logs in %s/)\n",
         (unsigned long long)job, l.target, l.workers, thr, zt_cpus_usable(), l.dir);
  if (l.sizing[0]) printf("ztrain: %s\n", l.sizing);
  fflush(stdout);
  rc = follow(&l, job);
  if (l.serve && !g_interrupted && l.coord > 0) {
    stop_workers(&l);
    serve(&l);
  }
out:
  if (rc != 0 && !job) ZT_ERROR("%s", zt_err_msg());
  stop_all(&l);
  free(spec);
  return rc;
}
