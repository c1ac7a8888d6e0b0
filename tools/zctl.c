/*
 * zctl.c: the operator's command line, a client of zcoord's Status service.
 *
 *   zctl [--coordinator HOST:PORT] [--json] [--token T] VERB [ARGS]
 *
 * The verbs are one table (k_verbs, below), which also makes the usage
 * text: status, workers, events, submit, jobs, job, metrics, checkpoints,
 * pause, resume, cancel, rollback, drain, export, sample, logbook. Every verb prints a readable table, or with --json one JSON document with
 * the same field names as the HTTP API (/v1/status, /v1/workers,
 * /v1/events), so scripts can use either. The coordinator address defaults
 * to $ZTRAIN_COORDINATOR, then 127.0.0.1:7070. Exit status: 0 on success,
 * 1 when the coordinator answered with an error or could not be reached,
 * 2 on a usage error.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "zt_common.h"
#include "export.h"
#include "sample.h"
#include "pbcall.h"
#include "pbjson.h"
#include "zt_rpc.h"
#include "ztrain.pb-c.h"

typedef struct {
  zt_rpc_client_t *rpc;
  const char *target; /* the coordinator's HOST:PORT */
  int json;
  int64_t timeout_ms;
} zctl;

/* Text from the coordinator (names, messages, logbook details) printed
 * with control characters escaped: a job named with terminal escapes must
 * not drive the operator's terminal. Several may appear in one printf. */
static const char *esc(const char *s) {
  static char bufs[8][2048];
  static int next;
  char *b = bufs[next++ % 8];
  return zt_printable(s ? s : "", b, sizeof bufs[0]);
}

/* An option's value: a decimal integer in [lo, hi]. */
static int opt_i64(const char *opt, const char *v, int64_t lo, int64_t hi, int64_t *out) {
  return zt_parse_i64(opt, v, lo, hi, out);
}

static void fmt_time(char *buf, size_t n, int64_t ms) {
  if (ms <= 0) {
    snprintf(buf, n, "-");
    return;
  }
  time_t t = (time_t)(ms / 1000);
  struct tm tm;
  localtime_r(&t, &tm);
  size_t k = strftime(buf, n, "%Y-%m-%d %H:%M:%S", &tm);
  snprintf(buf + k, n - k, ".%03d", (int)(ms % 1000));
}

static void print_json(cJSON *doc) {
  char *s = cJSON_Print(doc);
  printf("%s\n", s ? s : "null");
  free(s);
  cJSON_Delete(doc);
}

/* One unary Status call: pack, call, unpack. The channel waits for its
 * connection (gRPC's wait-for-ready), so a coordinator that is still
 * starting (a script or systemd started it a moment ago) is reached once
 * it listens; one that never answers is, after --timeout-ms, an error
 * that says where zctl looked. */
static ProtobufCMessage *status_call(zctl *z, const char *method, const ProtobufCMessage *req,
                                     const ProtobufCMessageDescriptor *reply_desc) {
  char path[128];
  snprintf(path, sizeof path, "/ztrain.Status/%s", method);
  ProtobufCMessage *m = NULL;
  int st = 0;
  if (zt_pb_call(z->rpc, path, req, reply_desc, z->timeout_ms, &m, &st) == 0) return m;
  if (st == ZT_RPC_DEADLINE_EXCEEDED)
    zt_errk(ZT_E_UNAVAILABLE, "%s: no answer from a coordinator at %s within %lld ms (is zcoord "
            "running there? --coordinator HOST:PORT or $ZTRAIN_COORDINATOR say where)",
            method, z->target, (long long)z->timeout_ms);
  return NULL;
}

/* Prints an action's message, as JSON with --json. */
static void print_message(zctl *z, const char *msg) {
  if (z->json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "message", msg);
    print_json(o);
  } else {
    printf("%s\n", esc(msg));
  }
}

static int cmd_status(zctl *z, int argc, char **argv) {
  (void)argc, (void)argv;
  Ztrain__GetStatusRequest req = ZTRAIN__GET_STATUS_REQUEST__INIT;
  Ztrain__GetStatusReply *r = (Ztrain__GetStatusReply *)status_call(
      z, "GetStatus", &req.base, &ztrain__get_status_reply__descriptor);
  if (!r) return -1;
  if (z->json) {
    print_json(zt_pbjson_status(r));
  } else {
    char t[64];
    fmt_time(t, sizeof t, r->started_ms);
    printf("coordinator  ztrain %s, epoch %llu, up since %s\n", r->version,
           (unsigned long long)r->coordinator_epoch, t);
    printf("heartbeat    every %u ms, lost after %u ms\n", r->heartbeat_ms,
           r->heartbeat_timeout_ms);
    printf("workers      %u alive, %u suspect, %u lost, %u left\n", r->workers_alive,
           r->workers_suspect, r->workers_lost, r->workers_left);
    printf("database     %s\n", r->db_path);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return 0;
}

static int cmd_workers(zctl *z, int argc, char **argv) {
  (void)argc, (void)argv;
  Ztrain__ListWorkersRequest req = ZTRAIN__LIST_WORKERS_REQUEST__INIT;
  Ztrain__ListWorkersReply *r = (Ztrain__ListWorkersReply *)status_call(
      z, "ListWorkers", &req.base, &ztrain__list_workers_reply__descriptor);
  if (!r) return -1;
  if (z->json) {
    cJSON *o = cJSON_CreateObject();
    cJSON *arr = cJSON_AddArrayToObject(o, "workers");
    for (size_t i = 0; i < r->n_workers; i++)
      cJSON_AddItemToArray(arr, zt_pbjson_worker(r->workers[i]));
    print_json(o);
  } else {
    printf("%-6s %-20s %-8s %-8s %-16s %-8s %s\n", "ID", "NAME", "STATE", "DEVICE", "HOST", "PID",
           "LAST SEEN");
    for (size_t i = 0; i < r->n_workers; i++) {
      Ztrain__WorkerInfo *w = r->workers[i];
      char t[64];
      fmt_time(t, sizeof t, w->last_seen_ms);
      printf("%-6llu %-20s %-8s %-8s %-16s %-8d %s\n", (unsigned long long)w->id, esc(w->name),
             zt_name_worker_state(w->state), esc(w->device), esc(w->host), w->pid, t);
    }
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return 0;
}

static int cmd_events(zctl *z, int argc, char **argv) {
  Ztrain__ListEventsRequest req = ZTRAIN__LIST_EVENTS_REQUEST__INIT;
  if (argc > 0 && argv[0][0] != '-') { /* zctl events JOB */
    int64_t id;
    if (opt_i64("events JOB", argv[0], 1, INT64_MAX, &id) != 0) return -1;
    req.job_id = (uint64_t)id;
    argc--, argv++;
  }
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    if (i + 1 >= argc) return zt_err("events: %s needs a value", a);
    int64_t v;
    int is_limit = !strcmp(a, "--limit");
    if (strcmp(a, "--job") && strcmp(a, "--after") && !is_limit)
      return zt_err("events: unknown option %s", a);
    if (opt_i64(a, argv[++i], is_limit ? 1 : 0, is_limit ? 100000 : INT64_MAX, &v) != 0) return -1;
    if (!strcmp(a, "--job")) req.job_id = (uint64_t)v;
    else if (!strcmp(a, "--after")) req.after_id = v;
    else req.limit = (uint32_t)v;
  }
  Ztrain__ListEventsReply *r = (Ztrain__ListEventsReply *)status_call(
      z, "ListEvents", &req.base, &ztrain__list_events_reply__descriptor);
  if (!r) return -1;
  if (z->json) {
    cJSON *o = cJSON_CreateObject();
    cJSON *arr = cJSON_AddArrayToObject(o, "events");
    for (size_t i = 0; i < r->n_events; i++) {
      cJSON_AddItemToArray(arr, zt_pbjson_event(r->events[i]));
    }
    print_json(o);
  } else {
    for (size_t i = 0; i < r->n_events; i++) {
      Ztrain__Event *e = r->events[i];
      char t[64], who[32] = "";
      fmt_time(t, sizeof t, e->t_ms);
      if (e->worker_id) snprintf(who, sizeof who, "worker %llu", (unsigned long long)e->worker_id);
      printf("%s  %-20s %-12s %s", t, esc(e->kind), who, esc(e->detail));
      if (e->count > 1) {
        char last[64];
        fmt_time(last, sizeof last, e->last_ms);
        printf(" (x%lld; the last at %s: %s)", (long long)e->count, last, esc(e->last_detail));
      }
      putchar('\n');
    }
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return 0;
}

static void print_job_row(const Ztrain__JobInfo *j) {
  char ck[24] = "-";
  if (j->checkpoint_step > 0) snprintf(ck, sizeof ck, "%lld", (long long)j->checkpoint_step);
  printf("%-5llu %-16s %-13s %4llu %5u %7lld/%-7lld %8s %9.4f %10.0f  %s\n",
         (unsigned long long)j->id, esc(j->name), zt_name_job_state(j->state),
         (unsigned long long)j->generation, j->world, (long long)j->step, (long long)j->total_steps,
         ck, j->loss, j->tokens_per_s, esc(j->message));
}

static int cmd_jobs(zctl *z, int argc, char **argv) {
  (void)argc, (void)argv;
  Ztrain__ListJobsRequest req = ZTRAIN__LIST_JOBS_REQUEST__INIT;
  Ztrain__ListJobsReply *r = (Ztrain__ListJobsReply *)status_call(
      z, "ListJobs", &req.base, &ztrain__list_jobs_reply__descriptor);
  if (!r) return -1;
  if (z->json) {
    cJSON *o = cJSON_CreateObject();
    cJSON *arr = cJSON_AddArrayToObject(o, "jobs");
    for (size_t i = 0; i < r->n_jobs; i++) cJSON_AddItemToArray(arr, zt_pbjson_job(r->jobs[i]));
    print_json(o);
  } else {
    printf("%-5s %-16s %-13s %4s %5s %15s %8s %9s %10s  %s\n", "ID", "NAME", "STATE", "GEN",
           "WORLD", "STEP", "CKPT", "LOSS", "TOK/S", "MESSAGE");
    for (size_t i = 0; i < r->n_jobs; i++) print_job_row(r->jobs[i]);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return 0;
}

/* A job id: a decimal integer from 1 (strtoull would take "-1" for 2^64-1). */
static int parse_job_id(const char *s, uint64_t *id) {
  int64_t v;
  if (opt_i64("job id", s, 1, INT64_MAX, &v) != 0) return -1;
  *id = (uint64_t)v;
  return 0;
}

/* The option at argv[i] of a verb that takes only "--name value" pairs
 * after its job id: an error naming an argument that is no option, or an
 * option without its value. */
static int check_pair(const char *verb, int argc, char **argv, int i) {
  if (strncmp(argv[i], "--", 2))
    return zt_err("%s: unexpected argument \"%s\"", verb, esc(argv[i]));
  if (i + 1 >= argc) return zt_err("%s: %s needs a value", verb, esc(argv[i]));
  return 0;
}

static int cmd_job(zctl *z, int argc, char **argv) {
  (void)argc;
  const char *ids = argv[0];
  Ztrain__GetJobRequest req = ZTRAIN__GET_JOB_REQUEST__INIT;
  if (parse_job_id(ids, &req.job_id) != 0) return -1;
  Ztrain__GetJobReply *r = (Ztrain__GetJobReply *)status_call(z, "GetJob", &req.base,
                                                               &ztrain__get_job_reply__descriptor);
  if (!r) return -1;
  if (!r->job) {
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return zt_err("GetJob: empty reply");
  }
  if (z->json) print_json(zt_pbjson_job(r->job));
  else print_job_row(r->job);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return 0;
}

/* wait JOB [--timeout S]: until the job ends (kubectl wait, for scripts):
 * 0 when it completed; an error naming its state and message when it
 * failed or was canceled, when it paused for a cause only an operator can
 * end (a pause the coordinator resumes by itself is waited out), or when
 * S seconds (default 3600) pass. A coordinator that does not answer for a
 * moment is asked again until then. */
static int cmd_wait(zctl *z, int argc, char **argv) {
  Ztrain__GetJobRequest req = ZTRAIN__GET_JOB_REQUEST__INIT;
  int64_t secs = 3600;
  if (argc < 1 || parse_job_id(argv[0], &req.job_id) != 0)
    return zt_err("wait: usage: zctl wait JOB [--timeout S]");
  for (int i = 1; i < argc; i += 2) {
    if (check_pair("wait", argc, argv, i) != 0) return -1;
    if (strcmp(argv[i], "--timeout")) return zt_err("wait: unknown option %s", esc(argv[i]));
    if (opt_i64("--timeout", argv[i + 1], 1, 30 * 86400, &secs) != 0) return -1;
  }
  zt_deadline_t dl = zt_deadline_in(secs * 1000);
  for (;;) {
    Ztrain__GetJobReply *r = (Ztrain__GetJobReply *)status_call(
        z, "GetJob", &req.base, &ztrain__get_job_reply__descriptor);
    const Ztrain__JobInfo *j = r ? r->job : NULL;
    int st = j ? (int)j->state : -1, rc = 1; /* 1: not yet */
    if (st == ZTRAIN__JOB_STATE__JOB_COMPLETED) rc = 0;
    else if (st == ZTRAIN__JOB_STATE__JOB_FAILED || st == ZTRAIN__JOB_STATE__JOB_CANCELED ||
             (st == ZTRAIN__JOB_STATE__JOB_PAUSED && !j->resumes_by_itself))
      rc = zt_err("wait: job %llu %s: %s", (unsigned long long)req.job_id,
                  zt_name_job_state(st), esc(j->message));
    if (rc != 1 && z->json) print_json(zt_pbjson_job(j));
    else if (rc != 1) print_job_row(j);
    if (r) protobuf_c_message_free_unpacked(&r->base, NULL);
    if (rc != 1) return rc;
    if (!j && zt_err_kind() == ZT_E_NOT_FOUND) return zt_err_wrap("wait");
    if (zt_deadline_passed(dl))
      return zt_err("wait: job %llu has not ended after %lld s", (unsigned long long)req.job_id,
                    (long long)secs);
    zt_sleep_ms(200); /* polling the job with a deadline */
  }
}

/* A job's step records, read in pages: the coordinator answers a
 * GetMetrics call with at most 10000, so each next call starts after the
 * last step of the previous one, until a call returns none. */
typedef struct {
  Ztrain__GetMetricsReply **pages;
  size_t n_pages;
  Ztrain__StepRecord **steps;
  size_t n;
} step_list;

static void step_list_free(step_list *l) {
  for (size_t i = 0; i < l->n_pages; i++) protobuf_c_message_free_unpacked(&l->pages[i]->base, NULL);
  free(l->pages);
  free(l->steps);
  memset(l, 0, sizeof *l);
}

/* Steps from..to (to 0: to the last) of job into l. */
static int fetch_steps(zctl *z, uint64_t job, int64_t from, int64_t to, step_list *l) {
  memset(l, 0, sizeof *l);
  for (;;) { /* ends: every page moves `from` past its last step, or is the last */
    Ztrain__GetMetricsRequest req = ZTRAIN__GET_METRICS_REQUEST__INIT;
    req.job_id = job;
    req.from_step = from;
    req.to_step = to;
    Ztrain__GetMetricsReply *r = (Ztrain__GetMetricsReply *)status_call(
        z, "GetMetrics", &req.base, &ztrain__get_metrics_reply__descriptor);
    if (!r) goto err;
    l->pages = zt_xrealloc(l->pages, (l->n_pages + 1) * sizeof *l->pages);
    l->pages[l->n_pages++] = r;
    if (!r->n_steps) return 0;
    l->steps = zt_xrealloc(l->steps, (l->n + r->n_steps) * sizeof *l->steps);
    memcpy(l->steps + l->n, r->steps, r->n_steps * sizeof *r->steps);
    l->n += r->n_steps;
    int64_t last = r->steps[r->n_steps - 1]->step;
    if (last < from || last == INT64_MAX || (to > 0 && last >= to)) return 0;
    from = last + 1;
  }
err:
  step_list_free(l);
  return -1;
}

static int cmd_metrics(zctl *z, int argc, char **argv) {
  uint64_t job = 0;
  int64_t from = 0, to = 0;
  if (argc < 1 || parse_job_id(argv[0], &job) != 0)
    return zt_err("metrics: usage: zctl metrics JOB [--from S] [--to S]");
  for (int i = 1; i < argc; i += 2) {
    if (check_pair("metrics", argc, argv, i) != 0) return -1;
    if (!strcmp(argv[i], "--from")) {
      if (opt_i64("--from", argv[i + 1], 0, INT64_MAX, &from) != 0) return -1;
    } else if (!strcmp(argv[i], "--to")) {
      if (opt_i64("--to", argv[i + 1], 0, INT64_MAX, &to) != 0) return -1;
    }
    else return zt_err("metrics: unknown option %s", argv[i]);
  }
  step_list l;
  if (fetch_steps(z, job, from, to, &l) != 0) return -1;
  if (z->json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "job_id", (double)job);
    cJSON *arr = cJSON_AddArrayToObject(o, "steps");
    for (size_t i = 0; i < l.n; i++) {
      cJSON_AddItemToArray(arr, zt_pbjson_step(l.steps[i]));
    }
    print_json(o);
  } else {
    printf("%7s %4s %12s %10s %10s %10s %10s\n", "STEP", "GEN", "LOSS", "GRAD_NORM", "LR",
           "TOK/S", "VAL_LOSS");
    for (size_t i = 0; i < l.n; i++) {
      Ztrain__StepRecord *s = l.steps[i];
      printf("%7lld %4llu %12.6f %10.4f %10.3g %10.0f %10.4f\n", (long long)s->step,
             (unsigned long long)s->generation, s->loss, s->grad_norm, s->lr, s->tokens_per_s,
             s->val_loss);
    }
  }
  step_list_free(&l);
  return 0;
}

static int cmd_submit(zctl *z, int argc, char **argv) {
  (void)argc;
  const char *path = argv[0];
  char *text;
  size_t len;
  if (zt_read_file(path, &text, &len, 4 << 20) != 0) return -1;
  Ztrain__SubmitJobRequest req = ZTRAIN__SUBMIT_JOB_REQUEST__INIT;
  req.spec_json = text;
  Ztrain__SubmitJobReply *r = (Ztrain__SubmitJobReply *)status_call(
      z, "SubmitJob", &req.base, &ztrain__submit_job_reply__descriptor);
  free(text);
  if (!r) return -1;
  if (z->json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "job_id", (double)r->job_id);
    print_json(o);
  } else {
    printf("submitted job %llu\n", (unsigned long long)r->job_id);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return 0;
}

/* The steps of a job (GetJob's total_steps). */
static int job_steps(zctl *z, uint64_t job, int64_t *steps) {
  Ztrain__GetJobRequest req = ZTRAIN__GET_JOB_REQUEST__INIT;
  req.job_id = job;
  Ztrain__GetJobReply *r = (Ztrain__GetJobReply *)status_call(z, "GetJob", &req.base,
                                                               &ztrain__get_job_reply__descriptor);
  if (!r) return -1;
  int ok = r->job != NULL;
  if (ok) *steps = r->job->total_steps;
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return ok ? 0 : zt_err("GetJob: empty reply");
}

/* A rollback flag's value (v, NULL: absent, def): an integer in 0..the
 * job's steps, or an error naming the flag and that range. */
static int rollback_flag(const char *flag, const char *v, int64_t def, uint64_t job, int64_t steps,
                         int64_t *out) {
  if (!v) {
    *out = def;
    return 0;
  }
  if (zt_parse_i64(flag, v, 0, steps, out) == 0) return 0;
  return zt_errk(ZT_E_INVALID, "rollback: %s: expected an integer in 0..%lld (job %llu has %lld "
                 "steps), got \"%s\"", flag, (long long)steps, (unsigned long long)job,
                 (long long)steps, esc(v));
}

/* pause|resume|cancel|rollback: the verb itself is argv[-1]. Only rollback
 * takes options; its flags are checked against the job's steps, which are
 * asked for first. */
static int cmd_action(zctl *z, int argc, char **argv) {
  const char *action = argv[-1];
  int is_rollback = !strcmp(action, "rollback");
  Ztrain__JobActionRequest req = ZTRAIN__JOB_ACTION_REQUEST__INIT;
  if (argc < 1 || parse_job_id(argv[0], &req.job_id) != 0)
    return zt_err("%s: usage: zctl %s JOB%s", action, action,
                  is_rollback ? " --to-step S [--skip N]" : "");
  req.action = (char *)action;
  const char *to = NULL, *skip = NULL;
  for (int i = 1; i < argc; i += 2) {
    if (check_pair(action, argc, argv, i) != 0) return -1;
    if (is_rollback && !strcmp(argv[i], "--to-step")) to = argv[i + 1];
    else if (is_rollback && !strcmp(argv[i], "--skip")) skip = argv[i + 1];
    else return zt_err("%s: unknown option %s", action, esc(argv[i]));
  }
  if (is_rollback && !to) return zt_err("rollback: --to-step S needed");
  int64_t steps = 0;
  req.to_step = -1;
  if (is_rollback && (job_steps(z, req.job_id, &steps) != 0 ||
                      rollback_flag("--to-step", to, -1, req.job_id, steps, &req.to_step) != 0 ||
                      rollback_flag("--skip", skip, 0, req.job_id, steps, &req.skip_steps) != 0))
    return -1;
  Ztrain__JobActionReply *r = (Ztrain__JobActionReply *)status_call(
      z, "JobAction", &req.base, &ztrain__job_action_reply__descriptor);
  if (!r) return -1;
  print_message(z, r->message);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return 0;
}

static int cmd_drain(zctl *z, int argc, char **argv) {
  (void)argc;
  const char *worker = argv[0];
  Ztrain__DrainRequest req = ZTRAIN__DRAIN_REQUEST__INIT;
  req.worker = (char *)worker;
  Ztrain__DrainReply *r = (Ztrain__DrainReply *)status_call(z, "Drain", &req.base,
                                                           &ztrain__drain_reply__descriptor);
  if (!r) return -1;
  print_message(z, r->message);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return 0;
}

static int cmd_checkpoints(zctl *z, int argc, char **argv) {
  (void)argc;
  const char *ids = argv[0];
  Ztrain__ListCheckpointsRequest req = ZTRAIN__LIST_CHECKPOINTS_REQUEST__INIT;
  if (parse_job_id(ids, &req.job_id) != 0) return -1;
  Ztrain__ListCheckpointsReply *r = (Ztrain__ListCheckpointsReply *)status_call(
      z, "ListCheckpoints", &req.base, &ztrain__list_checkpoints_reply__descriptor);
  if (!r) return -1;
  if (z->json) {
    cJSON *o = cJSON_CreateObject();
    cJSON *arr = cJSON_AddArrayToObject(o, "checkpoints");
    for (size_t i = 0; i < r->n_checkpoints; i++) {
      cJSON_AddItemToArray(arr, zt_pbjson_checkpoint(r->checkpoints[i]));
    }
    print_json(o);
  } else {
    printf("%8s %4s %-10s %5s %12s  %s\n", "STEP", "GEN", "STATE", "WORLD", "BYTES", "DIR");
    for (size_t i = 0; i < r->n_checkpoints; i++) {
      Ztrain__CheckpointInfo *k = r->checkpoints[i];
      printf("%8lld %4llu %-10s %5u %12llu  %s\n", (long long)k->step,
             (unsigned long long)k->generation, k->state, k->world, (unsigned long long)k->bytes,
             esc(k->dir));
    }
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  return 0;
}

/* logbook JOB --markdown: a run report from the job, its logbook, its
 * checkpoints and its metrics. */
static int cmd_logbook(zctl *z, int argc, char **argv) {
  uint64_t id = 0;
  if (argc < 1 || argc > 2 || parse_job_id(argv[0], &id) != 0 ||
      (argc > 1 && strcmp(argv[1], "--markdown")))
    return zt_err("logbook: usage: zctl logbook JOB --markdown");
  Ztrain__GetJobRequest gj = ZTRAIN__GET_JOB_REQUEST__INIT;
  gj.job_id = id;
  Ztrain__GetJobReply *jr = (Ztrain__GetJobReply *)status_call(z, "GetJob", &gj.base,
                                                              &ztrain__get_job_reply__descriptor);
  if (!jr || !jr->job) return -1;
  Ztrain__ListEventsRequest le = ZTRAIN__LIST_EVENTS_REQUEST__INIT;
  le.job_id = id;
  le.limit = 100000;
  Ztrain__ListEventsReply *er = (Ztrain__ListEventsReply *)status_call(
      z, "ListEvents", &le.base, &ztrain__list_events_reply__descriptor);
  step_list mr;
  if (!er || fetch_steps(z, id, 0, 0, &mr) != 0) return -1;
  Ztrain__JobInfo *j = jr->job;
  printf("# Run report: job %llu (%s)\n\n", (unsigned long long)j->id, esc(j->name));
  printf("- state: **%s** (%s)\n", zt_name_job_state(j->state), esc(j->message));
  printf("- steps: %lld of %lld; generation %llu on %u workers; %u restarts\n",
         (long long)j->step, (long long)j->total_steps, (unsigned long long)j->generation, j->world,
         j->restarts);
  int rollbacks = 0, commits = 0, spikes = 0, gens = 0;
  for (size_t i = 0; i < er->n_events; i++) {
    const char *k = er->events[i]->kind;
    rollbacks += !strcmp(k, "rollback");
    commits += !strcmp(k, "checkpoint_committed");
    spikes += !strcmp(k, "spike");
    if (!strcmp(k, "generation_started")) gens += (int)ZT_MAX(er->events[i]->count, 1);
  }
  printf("- generations: %d; loss spikes: %d; rollbacks: %d; checkpoints committed: %d\n\n",
         gens, spikes, rollbacks, commits);
  if (mr.n) {
    double lo = mr.steps[0]->loss, sum = 0;
    size_t n = mr.n, tail = n < 50 ? n : 50;
    for (size_t i = 0; i < n; i++) lo = mr.steps[i]->loss < lo ? mr.steps[i]->loss : lo;
    for (size_t i = n - tail; i < n; i++) sum += mr.steps[i]->loss;
    printf("## Loss\n\n| first | lowest | mean of last %zu | last |\n|---|---|---|---|\n", tail);
    printf("| %.4f | %.4f | %.4f | %.4f |\n\n", mr.steps[0]->loss, lo, sum / (double)tail,
           mr.steps[n - 1]->loss);
  }
  printf("## Timeline\n\n| time | event | detail |\n|---|---|---|\n");
  for (size_t i = 0; i < er->n_events; i++) {
    Ztrain__Event *e = er->events[i];
    const char *k = e->kind;
    /* Routine commits are summarised above, not listed one by one. */
    if (!strcmp(k, "checkpoint_committed") || !strcmp(k, "checkpoint_deleted")) continue;
    char t[64];
    fmt_time(t, sizeof t, e->t_ms);
    if (e->count > 1) printf("| %s | %s (x%lld) | ", t, k, (long long)e->count);
    else printf("| %s | %s | ", t, k);
    for (const char *c = esc(e->detail); *c; c++) putchar(*c == '|' ? '/' : *c);
    printf(" |\n");
  }
  protobuf_c_message_free_unpacked(&jr->base, NULL);
  protobuf_c_message_free_unpacked(&er->base, NULL);
  step_list_free(&mr);
  return 0;
}

/* The directory of job's committed epoch at `step`, or of its newest
 * committed epoch when step < 0 (ListCheckpoints). */
static int find_epoch(zctl *z, uint64_t job, int64_t step, char *out, size_t cap) {
  Ztrain__ListCheckpointsRequest req = ZTRAIN__LIST_CHECKPOINTS_REQUEST__INIT;
  req.job_id = job;
  Ztrain__ListCheckpointsReply *r = (Ztrain__ListCheckpointsReply *)status_call(
      z, "ListCheckpoints", &req.base, &ztrain__list_checkpoints_reply__descriptor);
  if (!r) return -1;
  int64_t best = -1;
  for (size_t k = 0; k < r->n_checkpoints; k++) {
    const Ztrain__CheckpointInfo *c = r->checkpoints[k];
    if (strcmp(c->state, "committed") || (step >= 0 ? c->step != step : c->step <= best)) continue;
    best = c->step;
    snprintf(out, cap, "%s", c->dir);
  }
  protobuf_c_message_free_unpacked(&r->base, NULL);
  if (best >= 0) return 0;
  if (step >= 0)
    return zt_err("job %llu has no committed checkpoint at step %lld (zctl checkpoints %llu lists "
                  "them)", (unsigned long long)job, (long long)step, (unsigned long long)job);
  return zt_err("job %llu has no committed checkpoint", (unsigned long long)job);
}

/* export JOB [--step S] --out DIR [--dtype f32|bf16] [--tokenizer RECORD], or
 * export --dir EPOCH --out DIR (no coordinator). */
static int cmd_export(zctl *z, int argc, char **argv) {
  zt_export_opts_t o = {0};
  const char *dtype = "f32";
  int64_t step = -1;
  uint64_t job = 0;
  int i = 0;
  if (argc > 0 && argv[0][0] != '-') {
    if (parse_job_id(argv[0], &job) != 0) return -1;
    i = 1;
  }
  while (i < argc) {
    if (!strcmp(argv[i], "--merge") || !strcmp(argv[i], "--adapter")) {
      o.lora = argv[i][2] == 'm' ? ZT_EXPORT_MERGE : ZT_EXPORT_ADAPTER;
      i++;
      continue;
    }
    if (i + 1 >= argc) break;
    if (!strcmp(argv[i], "--step")) {
      if (opt_i64("--step", argv[i + 1], 0, INT64_MAX, &step) != 0) return -1;
    } else if (!strcmp(argv[i], "--out")) o.out_dir = argv[i + 1];
    else if (!strcmp(argv[i], "--dtype")) dtype = argv[i + 1];
    else if (!strcmp(argv[i], "--dir")) o.epoch_dir = argv[i + 1];
    else if (!strcmp(argv[i], "--tokenizer")) o.tokenizer = argv[i + 1];
    else if (!strcmp(argv[i], "--base")) o.base = argv[i + 1];
    else return zt_err("export: unknown option %s", argv[i]);
    i += 2;
  }
  if (i != argc || !o.out_dir || !!o.epoch_dir == !!job)
    return zt_err("export: usage: zctl export JOB [--step S] --out DIR [--dtype f32|bf16] "
                  "[--tokenizer RECORD] [--adapter | --merge [--base PATH]], or zctl export "
                  "--dir CHECKPOINT_DIR --out DIR [...]");
  if (strcmp(dtype, "f32") && strcmp(dtype, "bf16"))
    return zt_err("export: --dtype must be f32 or bf16");
  o.bf16 = !strcmp(dtype, "bf16");
  char found[ZT_PATH_MAX];
  if (!o.epoch_dir) {
    if (find_epoch(z, job, step, found, sizeof found) != 0) return zt_err_wrap("export");
    o.epoch_dir = found;
  }
  zt_export_info_t info;
  if (zt_export_dir(&o, &info) != 0) return zt_err_wrap("export");
  if (z->json) {
    cJSON *out = cJSON_CreateObject();
    cJSON_AddStringToObject(out, "dir", o.out_dir);
    cJSON_AddStringToObject(out, "checkpoint", o.epoch_dir);
    cJSON_AddNumberToObject(out, "step", (double)info.step);
    cJSON_AddStringToObject(out, "model_file", info.model_file);
    cJSON_AddNumberToObject(out, "model_bytes", (double)info.model_bytes);
    cJSON_AddStringToObject(out, "tokenizer", info.tokenizer);
    print_json(out);
  } else {
    printf("wrote %s (step %lld, %s %zu bytes, tokenizer %s) from %s\n", o.out_dir,
           (long long)info.step, info.model_file, info.model_bytes, info.tokenizer, o.epoch_dir);
  }
  return 0;
}

/* sample JOB [--step S] [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K]
 * [--seed N] [--tokenizer RECORD] [--threads N], or sample --dir EPOCH ... (no
 * coordinator): text from the newest committed epoch (or step S), generated
 * here on the CPU by the engine's sampler (engine/sample.h), as zsolo sample. */
static int cmd_sample(zctl *z, int argc, char **argv) {
  zt_sample_cmd_t c;
  zt_sample_cmd_init(&c, "zctl");
  int64_t step = -1;
  uint64_t job = 0;
  int i = 0;
  if (argc > 0 && argv[0][0] != '-') {
    if (parse_job_id(argv[0], &job) != 0) return -1;
    i = 1;
  }
  for (; i < argc; i += 2) {
    const char *val = i + 1 < argc ? argv[i + 1] : NULL;
    int r = zt_sample_cmd_opt(&c, argv[i], val);
    if (r < 0) return zt_err_wrap("sample");
    if (r == 1) continue;
    if (!val) return zt_err("sample: %s needs a value", argv[i]);
    if (!strcmp(argv[i], "--step")) {
      if (opt_i64("--step", val, 0, INT64_MAX, &step) != 0) return -1;
    } else if (!strcmp(argv[i], "--dir")) c.epoch_dir = val;
    else return zt_err("sample: unknown option %s", argv[i]);
  }
  if (!!c.epoch_dir == !!job)
    return zt_err("sample: usage: zctl sample JOB [--step S] --prompt TEXT [--tokens N] "
                  "[--temperature T] [--top-k K] [--seed N] [--tokenizer RECORD], or zctl sample "
                  "--dir CHECKPOINT_DIR ...");
  char found[ZT_PATH_MAX];
  if (!c.epoch_dir) {
    if (find_epoch(z, job, step, found, sizeof found) != 0) return zt_err_wrap("sample");
    c.epoch_dir = found;
  }
  zt_sample_stats_t st;
  return zt_sample_run(&c, &st) == 0 ? 0 : zt_err_wrap("sample");
}

/* The verbs: name, the exact number of arguments (-1: any, the verb checks
 * them), the function, and the usage line. */
typedef struct {
  const char *name;
  int nargs;
  int (*fn)(zctl *z, int argc, char **argv);
  const char *args, *help;
} verb;

static const verb k_verbs[] = {
    {"status", 0, cmd_status, "", "coordinator summary"},
    {"workers", 0, cmd_workers, "", "every known worker and its state"},
    {"events", -1, cmd_events, "[JOB] [--after ID] [--limit N]", "the logbook"},
    {"submit", 1, cmd_submit, "JOB.json", "submit a job spec"},
    {"jobs", 0, cmd_jobs, "", "every job with its progress"},
    {"job", 1, cmd_job, "ID", "one job"},
    {"wait", -1, cmd_wait, "JOB [--timeout S]", "until the job ends: 0 when it completed"},
    {"metrics", -1, cmd_metrics, "JOB [--from S] [--to S]", "per-step loss, grad norm, lr, tokens/s"},
    {"checkpoints", 1, cmd_checkpoints, "JOB", "checkpoint epochs with state and size"},
    {"pause", -1, cmd_action, "JOB", "stop a job; resume continues it"},
    {"resume", -1, cmd_action, "JOB", "continue a paused job"},
    {"cancel", -1, cmd_action, "JOB", "end a job for good"},
    {"rollback", -1, cmd_action, "JOB --to-step S [--skip N]",
     "restart from a checkpoint, skipping data"},
    {"drain", 1, cmd_drain, "WORKER", "checkpoint, then take a worker out"},
    {"export", -1, cmd_export, "JOB [--step S] --out DIR [--dtype f32|bf16] [--tokenizer REC] [--adapter | --merge [--base PATH]]",
     "Hugging Face model directory; --dir CHECKPOINT_DIR --out DIR needs no coordinator"},
    {"sample", -1, cmd_sample,
     "JOB [--step S] --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed N]",
     "text from a checkpoint, on this CPU [--tokenizer REC]; --dir CHECKPOINT_DIR needs no "
     "coordinator"},
    {"logbook", -1, cmd_logbook, "JOB --markdown", "run report: timeline, rollbacks, loss"},
};

/* Each verb with its arguments, whole, then what it does: beside them in
 * a column, or on the next line when they are longer than the column. */
static void usage(FILE *f) {
  enum { COLUMN = 46 };
  fprintf(f, "usage: zctl [--coordinator HOST:PORT] [--json] [--token T] [--timeout-ms N] VERB\n"
             "verbs:\n");
  for (size_t i = 0; i < ZT_ARRAY_LEN(k_verbs); i++) {
    const verb *v = &k_verbs[i];
    int n = fprintf(f, "  %s%s%s", v->name, v->args[0] ? " " : "", v->args);
    if (n >= COLUMN) fprintf(f, "\n%*s%s\n", COLUMN + 1, "", v->help);
    else fprintf(f, "%*s%s\n", COLUMN + 1 - n, "", v->help);
  }
}

static const verb *find_verb(const char *name, int nargs) {
  for (size_t i = 0; i < ZT_ARRAY_LEN(k_verbs); i++)
    if (!strcmp(k_verbs[i].name, name) && (k_verbs[i].nargs < 0 || k_verbs[i].nargs == nargs))
      return &k_verbs[i];
  return NULL;
}

int main(int argc, char **argv) {
  if (zt_version_arg(argc, argv, "zctl")) return 0;
  zt_log_set_prefix("zctl");
  static const struct option opts[] = {
      {"coordinator", required_argument, 0, 'c'}, {"json", no_argument, 0, 'j'},
      {"token", required_argument, 0, 't'},       {"timeout-ms", required_argument, 0, 'T'},
      {"help", no_argument, 0, 'h'},              {0, 0, 0, 0},
  };
  const char *coord = zt_env(ZT_ENV_COORDINATOR);
  const char *token = zt_env(ZT_ENV_TOKEN);
  zctl z = {.timeout_ms = 5000};
  int ch;
  /* "+": stop at the verb, whose own options follow it. */
  while ((ch = getopt_long(argc, argv, "+", opts, NULL)) != -1) {
    switch (ch) {
    case 'c': coord = optarg; break;
    case 'j': z.json = 1; break;
    case 't': token = optarg; break;
    case 'T':
      if (opt_i64("--timeout-ms", optarg, 1, 3600000, &z.timeout_ms) != 0) {
        fprintf(stderr, "zctl: %s\n", zt_err_msg());
        return 2;
      }
      break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (optind >= argc) {
    usage(stderr);
    return 2;
  }
  const char *name = argv[optind];
  char **vargv = argv + optind + 1;
  int vargc = argc - optind - 1;
  /* Allow --json after the verb too, as in `zctl workers --json`. */
  for (int i = 0; i < vargc; i++) {
    if (!strcmp(vargv[i], "--json")) {
      z.json = 1;
      memmove(&vargv[i], &vargv[i + 1], (size_t)(vargc - i - 1) * sizeof *vargv);
      vargc--, i--;
    }
  }
  char auth[512];
  snprintf(auth, sizeof auth, "Bearer %s", token ? token : "");
  zt_rpc_client_opts_t ro = {.authorization = token ? auth : NULL, .wait_for_ready = 1};
  z.target = coord ? coord : "127.0.0.1:7070";
  if (zt_rpc_client_open(z.target, &ro, &z.rpc) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 1;
  }
  const verb *v = find_verb(name, vargc);
  if (!v) {
    usage(stderr);
    zt_rpc_client_close(z.rpc);
    return 2;
  }
  int rc = v->fn(&z, vargc, vargv);
  if (rc != 0) fprintf(stderr, "zctl: %s\n", zt_err_msg());
  zt_rpc_client_close(z.rpc);
  return rc == 0 ? 0 : 1;
}
