/*
 * provision.c: the provisioner hook: a command zcoord runs to get workers
 * when its jobs want more than it has, and to give back the ones nothing
 * needs.
 *
 * Clusters and clouds lend machines; a job that lost one (a node failed, a
 * spot instance was taken back) runs on fewer until somebody asks for
 * another. With `provisioner` set, zcoord asks by itself. Every check tick
 * it compares
 *
 *   want   the sum of max_workers over the jobs that are pending or
 *          running (paused and finished jobs want nothing), with
 *   have   the workers alive or suspect and not draining or quarantined,
 *          plus those asked for recently (below) and not arrived yet,
 *
 * and runs, one at a time, `COMMAND up N` when want > have (N the
 * difference) or `COMMAND down N NAME...` when no job wants the idle
 * workers NAME... (N of them, once such a surplus has lasted
 * provisioner_interval_ms; after a "down" the next waits provisioner_grace_ms,
 * the time its workers have to leave). The command's standard error goes with its
 * standard output (sh -c 'exec "$0" "$@" 2>&1').
 * The environment says the same: ZT_PROVISION_ACTION, ZT_PROVISION_COUNT,
 * ZT_PROVISION_WORKERS (the names, space-separated), and
 * ZT_COORDINATOR (the gRPC address, with the port bound, for the workers it
 * starts). What
 * the command does is the site's: deploy/slurm/ztrain-provision submits and
 * cancels worker jobs with sbatch and scancel.
 *
 * No storm, no hang:
 *   - runs are at least provisioner_interval_ms apart;
 *   - workers asked for count as had for provisioner_grace_ms (a node takes
 *     time to boot and register): the same deficit is not asked twice;
 *   - a run that outlives provisioner_timeout_ms is killed (SIGKILL to its
 *     process group) and counts as failed;
 *   - after a failure the next run waits interval x 2^(failures in a row),
 *     at most 16 intervals, and every failure is in the logbook with its
 *     reason (exit status, signal, timeout) and the head of its output;
 *   - the command's output is read into a bounded buffer, the rest dropped.
 *
 * Every run is a logbook event ("provision" or "provision_failed") and a
 * count in /metrics (ztrain_provisioner_runs_total by result).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "zt_net.h"

#define OUT_CAP 512    /* bytes of a run's output kept for the logbook */
#define MAX_NAMES 64   /* workers named in one "down" */
#define MAX_BACKOFF 16 /* intervals */

struct zt_prov {
  zt_coord_t *c;
  uv_process_t proc;
  uv_pipe_t out;
  uv_timer_t timer; /* the run's deadline */
  int running, out_open, proc_open, timed_out, closing;
  char action[8];
  int count;
  int64_t started_ms;
  char buf[OUT_CAP + 1];
  size_t len;
  int64_t next_ms;   /* no run before (monotonic) */
  int failures;      /* in a row */
  int asked;         /* workers asked for ... */
  int64_t asked_until_ms; /* ... expected until (monotonic) */
  uint64_t arrivals_at_ask; /* zt_coord_t.arrivals when they were asked for */
  int run_outstanding;      /* still coming when the running "up" started ... */
  uint64_t run_arrivals;    /* ... and zt_coord_t.arrivals then */
  int64_t surplus_since_ms; /* idle workers nobody wants, since (0: none) */
  int64_t down_until_ms;    /* no "down" before (monotonic): the last one's workers leave */
  uint64_t runs[3];  /* ok, failed, timed out */
};

/* Counted as had: sched.c's usable workers, and the suspect ones too (a
 * worker late with heartbeats is not replaced until it is lost). */
static int present(const zt_member_t *m) {
  return (m->row.state == ZT_WORKER_ALIVE || m->row.state == ZT_WORKER_SUSPECT) &&
         !m->draining && !m->quarantine_ms;
}

/* Workers wanted by the active jobs. */
static int wanted(const zt_coord_t *c) {
  int want = 0;
  for (const zt_job_t *j = c->jobs; j; j = j->next)
    if (zt_jobtable_active(j) && !j->spec_error[0]) want += j->p.max_workers;
  return want;
}

static void on_closed(uv_handle_t *h) {
  zt_prov_t *p = h->data;
  if (h == (uv_handle_t *)&p->out) p->out_open = 0;
  else p->proc_open = 0;
}

/* The run is over when the process has exited and its output is closed. */
static void finish(zt_prov_t *p, int64_t status, int sig) {
  zt_coord_t *c = p->c;
  uv_timer_stop(&p->timer);
  int64_t ms = zt_now_ms() - p->started_ms;
  p->buf[p->len] = 0;
  for (size_t i = 0; i < p->len; i++)
    if (p->buf[i] == '\n' || p->buf[i] == '\r') p->buf[i] = ' ';
  int ok = !p->timed_out && status == 0 && sig == 0;
  int64_t every = c->cfg.provisioner_interval_ms;
  if (ok) {
    p->failures = 0;
    p->runs[0]++;
    p->next_ms = zt_now_ms() + every;
    if (!strcmp(p->action, "down")) p->down_until_ms = zt_now_ms() + c->cfg.provisioner_grace_ms;
    if (!strcmp(p->action, "up")) {
      p->asked = p->run_outstanding + p->count;
      p->arrivals_at_ask = p->run_arrivals;
      p->asked_until_ms = zt_now_ms() + c->cfg.provisioner_grace_ms;
    }
    zt_coord_event(c, 0, "provision", 0, "%s %d: done in %lld ms%s%.300s", p->action, p->count,
                   (long long)ms, p->len ? "; output: " : "", p->buf);
  } else {
    p->failures++;
    p->runs[p->timed_out ? 2 : 1]++;
    int shift = p->failures > 4 ? 4 : p->failures;
    int64_t wait = every * ZT_MIN(1 << shift, MAX_BACKOFF); /* said as it is: no clock read between */
    p->next_ms = zt_now_ms() + wait;
    char why[96];
    if (p->timed_out)
      snprintf(why, sizeof why, "killed after %d ms (provisioner_timeout_ms)",
               c->cfg.provisioner_timeout_ms);
    else if (sig)
      snprintf(why, sizeof why, "killed by signal %d", sig);
    else
      snprintf(why, sizeof why, "exit status %lld", (long long)status);
    zt_coord_event(c, 0, "provision_failed", 0,
                   "%s %d: %s, failure %d in a row, next try in %lld ms%s%.300s", p->action,
                   p->count, why, p->failures, (long long)wait,
                   p->len ? "; output: " : "", p->buf);
  }
  p->running = 0;
}

static void on_exit_cb(uv_process_t *proc, int64_t status, int sig) {
  zt_prov_t *p = proc->data;
  uv_close((uv_handle_t *)proc, on_closed);
  /* Whatever is left unread in the pipe is dropped: a command's children
   * may hold it open long after the command itself has exited. The pipe
   * may be closing already (on_read saw its end first). */
  if (p->out_open && !uv_is_closing((uv_handle_t *)&p->out))
    uv_close((uv_handle_t *)&p->out, on_closed);
  finish(p, status, sig);
}

static void on_alloc(uv_handle_t *h, size_t want, uv_buf_t *b) {
  zt_prov_t *p = h->data;
  static char sink[4096];
  (void)want;
  if (p->len < OUT_CAP) *b = uv_buf_init(p->buf + p->len, (unsigned)(OUT_CAP - p->len));
  else *b = uv_buf_init(sink, sizeof sink); /* past the cap: read and dropped */
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b) {
  zt_prov_t *p = s->data;
  if (n > 0 && b->base == p->buf + p->len) p->len += (size_t)n;
  if (n < 0 && p->out_open && !uv_is_closing((uv_handle_t *)s))
    uv_close((uv_handle_t *)s, on_closed);
}

static void on_deadline(uv_timer_t *t) {
  zt_prov_t *p = t->data;
  if (!p->running || !p->proc_open) return;
  p->timed_out = 1;
  /* The command's whole process group: a script's children go too. */
  uv_kill(-p->proc.pid, SIGKILL);
  uv_process_kill(&p->proc, SIGKILL);
}

/* Starts `COMMAND action count names...`. */
static void run(zt_prov_t *p, const char *action, int count, char **names, int nnames) {
  zt_coord_t *c = p->c;
  char cnt[16], names_env[MAX_NAMES * 130 + 32], act_env[48], cnt_env[48], coord_env[300];
  char *args[8 + MAX_NAMES];
  int na = 0;
  snprintf(cnt, sizeof cnt, "%d", count);
  args[na++] = "/bin/sh";
  args[na++] = "-c";
  args[na++] = "exec \"$0\" \"$@\" 2>&1";
  args[na++] = c->cfg.provisioner;
  args[na++] = (char *)action;
  args[na++] = cnt;
  size_t off = (size_t)snprintf(names_env, sizeof names_env, "ZT_PROVISION_WORKERS=");
  for (int i = 0; i < nnames; i++) {
    args[na++] = names[i];
    if (off < sizeof names_env) /* snprintf truncates; off may pass the end */
      off += (size_t)snprintf(names_env + off, sizeof names_env - off, "%s%s", i ? " " : "",
                              names[i]);
  }
  args[na] = NULL;
  snprintf(act_env, sizeof act_env, "ZT_PROVISION_ACTION=%s", action);
  snprintf(cnt_env, sizeof cnt_env, "ZT_PROVISION_COUNT=%d", count);
  /* The address as configured, with the port bound (":0" takes any). */
  char host[sizeof c->cfg.grpc_addr];
  zt_net_host(c->cfg.grpc_addr, host, sizeof host);
  snprintf(coord_env, sizeof coord_env, "ZT_COORDINATOR=%s:%d", host,
           c->rpc ? zt_rpc_server_port(c->rpc) : 0);
  extern char **environ;
  size_t ne = 0;
  while (environ[ne]) ne++;
  char **env = zt_xcalloc(ne + 5, sizeof *env);
  size_t k = 0;
  for (size_t i = 0; i < ne; i++)
    if (strncmp(environ[i], "ZT_PROVISION_", 13) && strncmp(environ[i], "ZT_COORDINATOR=", 15))
      env[k++] = environ[i];
  env[k++] = act_env, env[k++] = cnt_env, env[k++] = names_env, env[k++] = coord_env;

  uv_pipe_init(c->loop, &p->out, 0);
  p->out.data = p;
  p->out_open = 1;
  uv_stdio_container_t io[3] = {{.flags = UV_IGNORE},
                                {.flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE,
                                 .data.stream = (uv_stream_t *)&p->out},
                                {.flags = UV_IGNORE}};
  /* Detached: the command leads a process group of its own, which the
   * deadline kills whole. */
  uv_process_options_t o = {.exit_cb = on_exit_cb, .file = "/bin/sh", .args = args,
                            .env = env, .stdio_count = 3, .stdio = io,
                            .flags = UV_PROCESS_DETACHED};
  p->proc.data = p;
  snprintf(p->action, sizeof p->action, "%s", action);
  p->count = count;
  p->len = 0, p->timed_out = 0;
  p->started_ms = zt_now_ms();
  int rc = uv_spawn(c->loop, &p->proc, &o);
  free(env);
  if (rc != 0) {
    uv_close((uv_handle_t *)&p->out, on_closed);
    uv_close((uv_handle_t *)&p->proc, NULL); /* libuv: a failed spawn's handle is closed too */
    p->running = 1; /* finish() counts it and backs off */
    snprintf(p->buf, sizeof p->buf, "cannot start /bin/sh: %s", uv_strerror(rc));
    p->len = strlen(p->buf);
    finish(p, 127, 0);
    return;
  }
  p->running = 1, p->proc_open = 1;
  uv_read_start((uv_stream_t *)&p->out, on_alloc, on_read);
  uv_timer_start(&p->timer, on_deadline, (uint64_t)c->cfg.provisioner_timeout_ms, 0);
  ZT_INFO("provisioner: %s %s %d", c->cfg.provisioner, action, count);
}

void zt_prov_tick(zt_coord_t *c) {
  zt_prov_t *p = c->prov;
  if (!p || p->running || p->closing || p->out_open || p->proc_open) return;
  int64_t now = zt_now_ms();
  if (now < p->next_ms) return;
  int have = 0, nidle = 0;
  char *idle[MAX_NAMES];
  for (size_t i = 0; i < c->by_id_cap; i++) {
    zt_member_t *m = c->by_id[i];
    if (!m || !present(m)) continue;
    have++;
    if (!m->job_id && nidle < MAX_NAMES) idle[nidle++] = m->row.name;
  }
  /* Asked-for workers count until as many have arrived (registered, or
   * came back) or the grace ends. Arrivals, not the workers present, say
   * so: one that came and went between two ticks (a preempted node) is
   * not still coming. */
  int arrived = (int)ZT_MIN(c->arrivals - p->arrivals_at_ask, (uint64_t)INT32_MAX);
  if (p->asked && (now >= p->asked_until_ms || arrived >= p->asked)) p->asked = 0;
  int outstanding = p->asked ? p->asked - arrived : 0;
  int want = wanted(c);
  if (want > have + outstanding) {
    p->run_arrivals = c->arrivals, p->run_outstanding = outstanding;
    run(p, "up", want - have - outstanding, NULL, 0);
    return;
  }
  /* A surplus must last an interval: a job about to be submitted, or a
   * generation about to form, is not a reason to give machines back. */
  if (have <= want || nidle == 0 || outstanding || now < p->down_until_ms) {
    p->surplus_since_ms = 0;
    return;
  }
  if (!p->surplus_since_ms) p->surplus_since_ms = now;
  if (now - p->surplus_since_ms >= c->cfg.provisioner_interval_ms) {
    int n = ZT_MIN(nidle, have - want);
    p->surplus_since_ms = 0;
    run(p, "down", n, idle, n);
  }
}

int zt_prov_start(zt_coord_t *c) {
  if (!c->cfg.provisioner[0]) return 0;
  zt_prov_t *p = zt_xcalloc(1, sizeof *p);
  p->c = c;
  uv_timer_init(c->loop, &p->timer);
  p->timer.data = p;
  /* A coordinator that starts gives its workers a grace to come back
   * before it asks for new ones. */
  p->next_ms = zt_now_ms() + c->cfg.heartbeat_timeout_ms;
  c->prov = p;
  ZT_INFO("provisioner: %s (timeout %d ms, interval %d ms, grace %d ms)", c->cfg.provisioner,
          c->cfg.provisioner_timeout_ms, c->cfg.provisioner_interval_ms,
          c->cfg.provisioner_grace_ms);
  return 0;
}

void zt_prov_stop(zt_coord_t *c) {
  zt_prov_t *p = c->prov;
  if (!p) return;
  p->closing = 1;
  uv_timer_stop(&p->timer);
  if (p->running && p->proc_open) {
    uv_kill(-p->proc.pid, SIGKILL);
    uv_close((uv_handle_t *)&p->proc, on_closed);
  }
  if (p->out_open && !uv_is_closing((uv_handle_t *)&p->out)) uv_close((uv_handle_t *)&p->out, on_closed);
  uv_close((uv_handle_t *)&p->timer, NULL);
}

void zt_prov_free(zt_coord_t *c) {
  free(c->prov);
  c->prov = NULL;
}

void zt_prov_counts(const zt_coord_t *c, uint64_t out[3]) {
  for (int i = 0; i < 3; i++) out[i] = c->prov ? c->prov->runs[i] : 0;
}
