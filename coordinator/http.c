/*
 * http.c: zcoord's HTTP/JSON API, served by libmicrohttpd.
 *
 * libmicrohttpd runs its own polling thread and calls access_handler() for
 * each request, possibly several times while a body arrives. When a request
 * is complete it is routed: the route function runs on the loop thread
 * (through zt_loopcall_run, so it may read coordinator state freely) and
 * fills an http_req with a status, a content type and a body, which this
 * thread then sends. The HTTP thread never touches coordinator state itself.
 *
 * Routes are a table of (method, path pattern, function). A path that
 * matches no pattern gets 404; a path that matches with another method gets
 * 405 with an Allow header. Bodies above ZT_HTTP_MAX_BODY get 413 without
 * being buffered. Every error body is JSON: {"error": "..."}.
 *
 * Connections: the polling thread uses poll(), not epoll. With epoll
 * libmicrohttpd does not come back to read the end of stream that a
 * client's half-close (shutdown(SHUT_WR) after its request) delivers with
 * the request, so the answered connection stayed in CLOSE-WAIT until the
 * idle timeout; poll() reports it at once and the connection is closed as
 * soon as its response is sent. An idle connection is closed after
 * ZT_HTTP_IDLE_S, so that connections one address holds without using
 * them (its limit is ZT_HTTP_PER_CLIENT) lock that address out for no
 * longer than that.
 */
#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "coord.h"
#include "http.h"
#include "pbjson.h"
#include "zt_json.h"
#include "zt_net.h"

#define ZT_HTTP_MAX_BODY (1u << 20)
/* Connections in all, and those one client address may hold open, so
 * that no client can use up every slot. */
#define ZT_HTTP_MAX_CONNS 1000u
#define ZT_HTTP_PER_CLIENT 64u
/* Seconds a connection may stay idle (keep-alive between requests, a head
 * or body that stopped arriving) before it is closed. */
#define ZT_HTTP_IDLE_S 10u

struct zt_http {
  zt_coord_t *c;
  struct MHD_Daemon *d;
  int port;
  int loopback; /* bound to a 127.0.0.0/8 address */
};

/* Per-connection state while a request body arrives. */
typedef struct {
  char *body;
  size_t len;
  int too_large;
  int answered; /* refused before its body (refuse_early) */
} conn_ctx;

/* ---- JSON helpers used by the routes ------------------------------------ */

void zt_http_json(zt_http_req_t *r, int status, cJSON *doc) {
  r->status = status;
  r->ctype = "application/json";
  r->resp = cJSON_PrintUnformatted(doc);
  r->resp_len = r->resp ? strlen(r->resp) : 0;
  cJSON_Delete(doc);
}

void zt_http_error(zt_http_req_t *r, int status, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "error", msg);
  zt_http_json(r, status, o);
}

/* key's value in an in-process request's query string, copied to qbuf. */
static const char *query_value(zt_http_req_t *r, const char *key) {
  size_t kl = strlen(key);
  for (const char *p = r->query; p && *p;) {
    const char *end = strchr(p, '&');
    size_t n = end ? (size_t)(end - p) : strlen(p);
    if (n > kl && !strncmp(p, key, kl) && p[kl] == '=') {
      snprintf(r->qbuf, sizeof r->qbuf, "%.*s", (int)(n - kl - 1), p + kl + 1);
      return r->qbuf;
    }
    p = end ? end + 1 : NULL;
  }
  return NULL;
}

const char *zt_http_query(zt_http_req_t *r, const char *key) {
  if (!r->conn) return query_value(r, key);
  return MHD_lookup_connection_value(r->conn, MHD_GET_ARGUMENT_KIND, key);
}

int zt_http_query_i64(zt_http_req_t *r, const char *key, int64_t def, int64_t *out) {
  const char *v = zt_http_query(r, key);
  if (!v || !*v) {
    *out = def;
    return 0;
  }
  if (zt_parse_i64(key, v, INT64_MIN, INT64_MAX, out) != 0) {
    zt_http_error(r, 400, "query parameter %s", zt_err_msg());
    return -1;
  }
  return 0;
}

/* ---- routes ------------------------------------------------------------ */

static void r_healthz(zt_http_req_t *r) {
  zt_coord_t *c = r->c;
  cJSON *o = cJSON_CreateObject();
  cJSON_AddBoolToObject(o, "ok", 1);
  cJSON_AddStringToObject(o, "version", zt_version_string());
  cJSON_AddNumberToObject(o, "coordinator_epoch", (double)c->epoch);
  cJSON_AddNumberToObject(o, "uptime_ms", (double)(zt_wall_ms() - c->started_ms));
  zt_http_json(r, 200, o);
}

static void r_status(zt_http_req_t *r) {
  Ztrain__GetStatusReply st;
  zt_view_status(r->c, &st);
  zt_http_json(r, 200, zt_pbjson_status(&st));
}

static void r_workers(zt_http_req_t *r) {
  zt_coord_t *c = r->c;
  cJSON *o = cJSON_CreateObject();
  cJSON *arr = cJSON_AddArrayToObject(o, "workers");
  for (size_t i = 0; i < c->by_id_cap; i++) {
    if (!c->by_id[i]) continue;
    Ztrain__WorkerInfo w;
    zt_view_worker(c->by_id[i], &w);
    cJSON_AddItemToArray(arr, zt_pbjson_worker(&w));
  }
  zt_http_json(r, 200, o);
}

static int add_event(const zt_db_event_t *e, void *user) {
  Ztrain__Event x;
  zt_view_event(e, &x);
  cJSON_AddItemToArray(user, zt_pbjson_event(&x));
  return 0;
}

/* Logbook entries of one job (job > 0) or all, as the query asks: after=ID
 * (those after it), limit=N (the first N, default `limit`) or tail=N (the
 * newest N), oldest first either way. */
static void events_json(zt_http_req_t *r, int64_t job, int64_t limit) {
  int64_t after, tail;
  if (zt_http_query_i64(r, "after", 0, &after) || zt_http_query_i64(r, "limit", limit, &limit) ||
      zt_http_query_i64(r, "tail", 0, &tail))
    return;
  if (limit <= 0 || limit > 100000 || tail < 0 || tail > 100000) {
    zt_http_error(r, 400, "limit and tail must be 1..100000");
    return;
  }
  cJSON *o = cJSON_CreateObject();
  cJSON *arr = cJSON_AddArrayToObject(o, "events");
  if (zt_db_events_each(r->c->db, (uint64_t)job, after, tail ? (int)-tail : (int)limit, add_event,
                        arr) != 0) {
    cJSON_Delete(o);
    zt_http_error(r, 503, "%s", zt_err_msg());
    return;
  }
  zt_http_json(r, 200, o);
}

static void r_events(zt_http_req_t *r) {
  int64_t job;
  if (zt_http_query_i64(r, "job", 0, &job)) return;
  events_json(r, job, 1000);
}

static cJSON *job_json(const zt_job_t *j) {
  Ztrain__JobInfo ji;
  zt_view_job(j, &ji);
  return zt_pbjson_job(&ji);
}

static void r_jobs(zt_http_req_t *r) {
  cJSON *o = cJSON_CreateObject();
  cJSON *arr = cJSON_AddArrayToObject(o, "jobs");
  for (zt_job_t *j = r->c->jobs; j; j = j->next) cJSON_AddItemToArray(arr, job_json(j));
  zt_http_json(r, 200, o);
}

static int add_step(const zt_db_step_t *s, void *user) {
  Ztrain__StepRecord x;
  zt_view_step(s, &x);
  cJSON_AddItemToArray(user, zt_pbjson_step(&x));
  return 0;
}

static int add_ckpt(const zt_db_ckpt_t *k, void *user) {
  Ztrain__CheckpointInfo x;
  zt_view_ckpt(k, &x);
  cJSON_AddItemToArray(user, zt_pbjson_checkpoint(&x));
  return 0;
}

/* Answers an action: {"message": msg} when it succeeded (rc 0), else the
 * error the layers below left (its kind gives the status). */
static void action_reply(zt_http_req_t *r, int rc, const char *msg) {
  if (rc != 0) {
    zt_http_error(r, zt_errkind_http(zt_err_kind()), "%s", zt_err_msg());
    return;
  }
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "message", msg);
  zt_http_json(r, 200, o);
}

/* The name of a JSON value's type, for messages. */
static const char *json_type(const cJSON *v) {
  return cJSON_IsString(v) ? "a string"
         : cJSON_IsBool(v) ? "a boolean"
         : cJSON_IsNull(v) ? "null"
         : cJSON_IsArray(v) ? "an array"
         : cJSON_IsObject(v) ? "an object"
                             : "a number";
}

/* A rollback argument: an integer in 0..hi (the job's steps). JSON has one
 * number type, so an integral value (40, 40.0) is taken and anything else
 * (1e-300, 2.5, 1e300, "40") is refused with a 400 naming the field. */
static int rollback_arg(zt_http_req_t *r, const cJSON *v, const char *field, uint64_t job,
                        int64_t hi, int64_t *out) {
  double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
  if (d >= 0 && d <= (double)hi && d == floor(d)) {
    *out = (int64_t)d;
    return 0;
  }
  char got[64];
  if (cJSON_IsNumber(v)) snprintf(got, sizeof got, "%.15g", d);
  else snprintf(got, sizeof got, "%s", json_type(v));
  zt_http_error(r, 400, "%s must be an integer in 0..%lld (job %llu has %lld steps), got %s",
                field, (long long)hi, (unsigned long long)job, (long long)hi, got);
  return -1;
}

/* The body of POST /v1/jobs/{id}/rollback: {"to_step": S, "skip": N}, skip
 * optional (0), each an integer in 0..the job's steps; no other field.
 * -1 with the 400 answer in r otherwise. */
static int rollback_body(zt_http_req_t *r, const zt_job_t *j, int64_t *to, int64_t *skip) {
  static const char *const want = "{\"to_step\": S, \"skip\": N}";
  uint64_t id = j->row.id;
  int64_t hi = j->row.total_steps;
  if (!r->body || !r->body_len) {
    zt_http_error(r, 400, "rollback needs a JSON body %s (to_step and skip: integers in 0..%lld)",
                  want, (long long)hi);
    return -1;
  }
  cJSON *doc = zt_json_parse(r->body, r->body_len, "body");
  if (!doc) {
    zt_http_error(r, 400, "rollback: malformed JSON: %s", zt_err_msg());
    return -1;
  }
  int rc = -1;
  const cJSON *t = NULL, *k = NULL;
  if (!cJSON_IsObject(doc)) {
    zt_http_error(r, 400, "rollback needs a JSON object %s, got %s", want, json_type(doc));
    goto out;
  }
  for (const cJSON *f = doc->child; f; f = f->next) {
    const cJSON **slot = !strcmp(f->string, "to_step") ? &t : !strcmp(f->string, "skip") ? &k : NULL;
    if (!slot) {
      char name[80];
      zt_http_error(r, 400, "rollback: unknown field \"%s\" (expected %s)",
                    zt_printable(f->string, name, sizeof name), want);
      goto out;
    }
    if (*slot) {
      zt_http_error(r, 400, "rollback: field \"%s\" given twice", f->string);
      goto out;
    }
    *slot = f;
  }
  if (!t) {
    zt_http_error(r, 400, "rollback needs to_step, an integer in 0..%lld (job %llu has %lld "
                  "steps)", (long long)hi, (unsigned long long)id, (long long)hi);
    goto out;
  }
  *skip = 0;
  if (rollback_arg(r, t, "to_step", id, hi, to) == 0 &&
      (!k || rollback_arg(r, k, "skip", id, hi, skip) == 0))
    rc = 0;
out:
  cJSON_Delete(doc);
  return rc;
}

/* POST /v1/jobs/{id}/pause|resume|cancel|rollback; rollback takes
 * {"to_step": S, "skip": N} (rollback_body). */
static void r_job_action(zt_http_req_t *r) {
  const char *p = r->url + strlen("/v1/jobs/");
  char *end;
  unsigned long long id = strtoull(p, &end, 10);
  zt_job_action_t a;
  if (end == p || *end != '/') {
    zt_http_error(r, 404, "no such resource: %s", r->url);
    return;
  }
  if (zt_jobs_action_parse(end + 1, &a) != 0) {
    zt_http_error(r, 404, "no such action: %.32s (pause, resume, cancel, rollback)", end + 1);
    return;
  }
  int64_t to = -1, skip = 0;
  if (a == ZT_ACT_ROLLBACK) {
    const zt_job_t *j = zt_jobtable_get(r->c, id);
    if (!j) {
      zt_http_error(r, 404, "unknown job %llu", id);
      return;
    }
    if (rollback_body(r, j, &to, &skip) != 0) return;
  }
  char msg[512];
  action_reply(r, zt_jobs_action(r->c, id, a, to, skip, msg, sizeof msg), msg);
}

/* POST /v1/workers/{id or name}/drain */
static void r_drain(zt_http_req_t *r) {
  char name[160];
  const char *p = r->url + strlen("/v1/workers/");
  const char *slash = strchr(p, '/');
  if (!slash || strcmp(slash, "/drain") || slash == p || (size_t)(slash - p) >= sizeof name) {
    zt_http_error(r, 404, "no such resource: %s", r->url);
    return;
  }
  snprintf(name, sizeof name, "%.*s", (int)(slash - p), p);
  zt_member_t *m = zt_members_lookup(r->c, name);
  if (!m) {
    zt_http_error(r, 404, "unknown worker %s", name);
    return;
  }
  char msg[512];
  action_reply(r, zt_jobs_drain(r->c, m, msg, sizeof msg), msg);
}

/* /v1/jobs/{id} and /v1/jobs/{id}/metrics|events|checkpoints */
static void r_job(zt_http_req_t *r) {
  const char *p = r->url + strlen("/v1/jobs/");
  char *end;
  unsigned long long id = strtoull(p, &end, 10);
  zt_job_t *j = end != p ? zt_jobtable_get(r->c, id) : NULL;
  if (!j) {
    zt_http_error(r, 404, "no such job: %.64s", p);
    return;
  }
  if (!*end) {
    zt_http_json(r, 200, job_json(j));
    return;
  }
  if (!strcmp(end, "/metrics")) {
    int64_t from, to, limit;
    if (zt_http_query_i64(r, "from", 0, &from) || zt_http_query_i64(r, "to", INT64_MAX, &to) ||
        zt_http_query_i64(r, "limit", ZT_METRICS_MAX_ROWS, &limit))
      return;
    if (limit <= 0 || limit > ZT_METRICS_MAX_ROWS) {
      zt_http_error(r, 400, "limit must be 1..%d (read longer histories in pages with from=)",
                    ZT_METRICS_MAX_ROWS);
      return;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "job_id", (double)id);
    cJSON *arr = cJSON_AddArrayToObject(o, "steps");
    if (zt_db_steps_each(r->c->db, id, from, to, (int)limit, add_step, arr) != 0) {
      cJSON_Delete(o);
      zt_http_error(r, 503, "%s", zt_err_msg());
      return;
    }
    zt_http_json(r, 200, o);
    return;
  }
  if (!strcmp(end, "/checkpoints")) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "job_id", (double)id);
    cJSON *arr = cJSON_AddArrayToObject(o, "checkpoints");
    if (zt_db_ckpts_each(r->c->db, id, add_ckpt, arr) != 0) {
      cJSON_Delete(o);
      zt_http_error(r, 503, "%s", zt_err_msg());
      return;
    }
    zt_http_json(r, 200, o);
    return;
  }
  if (!strcmp(end, "/events")) {
    events_json(r, (int64_t)id, 100000);
    return;
  }
  zt_http_error(r, 404, "no such resource: %s", r->url);
}

/* POST /v1/jobs: the body is a job spec. */
static void r_submit(zt_http_req_t *r) {
  if (!r->body || !r->body_len) {
    zt_http_error(r, 400, "empty body: expected a JSON job spec");
    return;
  }
  cJSON *doc = zt_json_parse(r->body, r->body_len, "body");
  if (!doc) {
    zt_http_error(r, 400, "malformed JSON: %s", zt_err_msg());
    return;
  }
  cJSON_Delete(doc);
  uint64_t id = 0;
  if (zt_jobs_submit(r->c, r->body, &id) != 0) {
    action_reply(r, -1, NULL);
    return;
  }
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "job_id", (double)id);
  zt_http_json(r, 201, o);
}

/* ---- Prometheus exposition ----------------------------------------------- */

typedef struct {
  char *buf;
  size_t len, cap;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->buf + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < b->cap - b->len) {
      b->len += (size_t)n;
      return;
    }
    b->cap = b->cap * 2 + (size_t)n + 256;
    b->buf = zt_xrealloc(b->buf, b->cap);
  }
}

static void metric_head(sbuf *b, const char *name, const char *type, const char *help) {
  sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A job-labelled series for every job that has started. */
#define JOB_SERIES(b, name, type, help, expr)                                            \
  do {                                                                                  \
    metric_head(b, name, type, help);                                                   \
    for (zt_job_t *j = r->c->jobs; j; j = j->next)                                        \
      if (j->row.generation)                                                            \
        sb_printf(b, "%s{job_id=\"%llu\"} %.17g\n", name, (unsigned long long)j->row.id,    \
                  (double)(expr));                                                      \
  } while (0)

/* A Prometheus label value: backslash and quote escaped (host names come
 * from the workers; control characters were refused at registration). */
static const char *label(const char *s, char *out, size_t n) {
  size_t o = 0;
  for (; *s && o + 3 < n; s++) {
    if (*s == '\\' || *s == '"') out[o++] = '\\';
    out[o++] = *s;
  }
  out[o] = 0;
  return out;
}

/* A worker-labelled series for every worker that reported timings. */
static void worker_series(zt_coord_t *c, sbuf *b, const char *name, const char *help, int which) {
  metric_head(b, name, "gauge", help);
  for (size_t i = 0; i < c->by_id_cap; i++) {
    const zt_member_t *m = c->by_id[i];
    if (!m || !m->timing_ms) continue;
    double v = which == 0   ? m->step_ms
               : which == 1 ? m->comm_ms
               : which == 2 ? m->send_wait_ms
                            : m->link_rtt_ms;
    char host[2 * sizeof m->row.host + 1];
    sb_printf(b, "%s{worker=\"%s\",host=\"%s\"} %.6g\n", name, m->row.name,
              label(m->row.host, host, sizeof host), v);
  }
}

static void r_metrics(zt_http_req_t *r) {
  zt_coord_t *c = r->c;
  sbuf b = {zt_xmalloc(4096), 0, 4096};
  uint32_t n[5];
  zt_members_count(c, n);
  metric_head(&b, "ztrain_workers", "gauge", "Known workers by state.");
  for (int s = ZT_WORKER_ALIVE; s <= ZT_WORKER_LEFT; s++)
    sb_printf(&b, "ztrain_workers{state=\"%s\"} %u\n", zt_name_worker_state(s), n[s]);
  worker_series(c, &b, "ztrain_worker_step_ms", "Wall time per training step, as the worker measured it recently.", 0);
  worker_series(c, &b, "ztrain_worker_comm_ms", "Time per step inside collectives (TCP ring).", 1);
  worker_series(c, &b, "ztrain_worker_send_wait_ms",
                "Time per step waiting for the worker's outgoing link (a slow link shows here).", 2);
  worker_series(c, &b, "ztrain_worker_link_rtt_ms",
                "Smoothed round-trip time of the worker's outgoing ring connection (kernel "
                "TCP_INFO): queueing on a slow link shows here.", 3);
  int jobs[8] = {0};
  for (zt_job_t *j = c->jobs; j; j = j->next)
    if (j->row.state >= 0 && j->row.state < 8) jobs[j->row.state]++;
  metric_head(&b, "ztrain_jobs", "gauge", "Jobs by state.");
  for (int s = ZT_JOB_PENDING; s <= ZT_JOB_CANCELED; s++)
    sb_printf(&b, "ztrain_jobs{state=\"%s\"} %d\n", zt_name_job_state(s), jobs[s]);
  JOB_SERIES(&b, "ztrain_job_steps_total", "counter", "Training steps completed.", j->row.step);
  JOB_SERIES(&b, "ztrain_job_tokens_total", "counter", "Training tokens processed.",
             (double)j->row.step * (double)j->p.global_batch * (double)j->p.seq_len);
  JOB_SERIES(&b, "ztrain_job_restarts_total", "counter",
             "Generations started after the first (restarts).", j->row.restarts);
  JOB_SERIES(&b, "ztrain_job_rollbacks_total", "counter", "Loss-spike rollbacks.",
             j->row.rollbacks);
  JOB_SERIES(&b, "ztrain_job_checkpoints_total", "counter", "Checkpoint epochs committed.",
             j->ckpt_commits);
  JOB_SERIES(&b, "ztrain_job_outer_steps_refused_total", "counter",
             "DiLoCo outer steps refused: the groups' pseudo-gradient was not finite.",
             j->outer_refused);
  JOB_SERIES(&b, "ztrain_job_checkpointing_paused", "gauge",
             "1 while checkpoint writes fail (disk full, read-only): an alert.", j->ckpt_paused);
  JOB_SERIES(&b, "ztrain_job_steps_since_checkpoint", "gauge",
             "Steps a failure now would lose: past the last committed epoch.",
             ZT_MAX(j->row.step - j->safe_step, 0));
  JOB_SERIES(&b, "ztrain_job_loss", "gauge", "Training loss of the last step.", j->last.loss);
  JOB_SERIES(&b, "ztrain_job_learning_rate", "gauge", "Learning rate of the last step.",
             j->last.lr);
  JOB_SERIES(&b, "ztrain_job_grad_norm", "gauge", "Global gradient norm of the last step.",
             j->last.grad_norm);
  JOB_SERIES(&b, "ztrain_job_tokens_per_second", "gauge", "Training throughput, tokens per second.",
             j->last.tokens_per_s);
  JOB_SERIES(&b, "ztrain_job_world_size", "gauge", "Ranks in the current generation.",
             j->row.world);
  JOB_SERIES(&b, "ztrain_job_active", "gauge",
             "1 while the job is pending, running or re-forming (not paused, not ended).",
             zt_jobtable_active(j));
  JOB_SERIES(&b, "ztrain_job_paused", "gauge", "1 while the job is paused.",
             j->row.state == ZT_JOB_PAUSED);
  JOB_SERIES(&b, "ztrain_job_last_checkpoint_timestamp_seconds", "gauge",
             "Unix time its newest checkpoint epoch committed (0: none yet).",
             (double)j->committed_wall_ms / 1000.0);
  JOB_SERIES(&b, "ztrain_job_generation", "gauge", "Current generation number.",
             j->row.generation);
  metric_head(&b, "ztrain_coordinator_uptime_seconds", "gauge", "Seconds since zcoord started.");
  sb_printf(&b, "ztrain_coordinator_uptime_seconds %.3f\n",
            (double)(zt_wall_ms() - c->started_ms) / 1000.0);
  metric_head(&b, "ztrain_coordinator_loop_stall_max_seconds", "gauge",
              "Longest delay of the coordinator's liveness timer (a held-up loop).");
  sb_printf(&b, "ztrain_coordinator_loop_stall_max_seconds %.3f\n",
            (double)c->max_stall_ms / 1000.0);
  metric_head(&b, "ztrain_coordinator_call_lag_max_seconds", "gauge",
              "Longest a received call had waited for the coordinator's loop, seen by the "
              "liveness check (silences are judged that much earlier).");
  sb_printf(&b, "ztrain_coordinator_call_lag_max_seconds %.3f\n", (double)c->max_lag_ms / 1000.0);
  metric_head(&b, "ztrain_coordinator_registrations_shed_total", "counter",
              "Registrations refused (UNAVAILABLE, retried by workers) because they had waited "
              "over a second for a coordinator behind its heartbeats.");
  sb_printf(&b, "ztrain_coordinator_registrations_shed_total %llu\n",
            (unsigned long long)c->register_shed);
  metric_head(&b, "ztrain_coordinator_blind_periods_total", "counter",
              "Periods in which the coordinator heard from no worker while two or more were "
              "alive (its own network); nobody is declared lost in them.");
  sb_printf(&b, "ztrain_coordinator_blind_periods_total %llu\n",
            (unsigned long long)c->blind_periods);
  metric_head(&b, "ztrain_coordinator_blind_max_seconds", "gauge",
              "The longest such period.");
  sb_printf(&b, "ztrain_coordinator_blind_max_seconds %.3f\n", (double)c->blind_max_ms / 1000.0);
  metric_head(&b, "ztrain_coordinator_heartbeat_interval_seconds", "gauge",
              "The heartbeat interval the coordinator asks of workers now: --heartbeat-ms, "
              "stretched when the live workers would send more than --heartbeat-capacity a "
              "second.");
  sb_printf(&b, "ztrain_coordinator_heartbeat_interval_seconds %.3f\n",
            (double)zt_members_interval_ms(c) / 1000.0);
  metric_head(&b, "ztrain_coordinator_heartbeat_pace_changes_total", "counter",
              "Times the advertised heartbeat interval changed.");
  sb_printf(&b, "ztrain_coordinator_heartbeat_pace_changes_total %llu\n",
            (unsigned long long)c->hb_pace_changes);
  metric_head(&b, "ztrain_coordinator_heartbeat_calls_total", "counter",
              "Heartbeat calls by kind: a worker's own (single), or a machine's heartbeat "
              "agent's (batch, zworker --heartbeat-agent).");
  sb_printf(&b, "ztrain_coordinator_heartbeat_calls_total{kind=\"single\"} %llu\n",
            (unsigned long long)c->hb_calls[0]);
  sb_printf(&b, "ztrain_coordinator_heartbeat_calls_total{kind=\"batch\"} %llu\n",
            (unsigned long long)c->hb_calls[1]);
  metric_head(&b, "ztrain_coordinator_heartbeat_batch_entries_total", "counter",
              "Workers' heartbeats that came in batches.");
  sb_printf(&b, "ztrain_coordinator_heartbeat_batch_entries_total %llu\n",
            (unsigned long long)c->hb_batch_entries);
  uint64_t prov[3];
  zt_prov_counts(c, prov);
  metric_head(&b, "ztrain_provisioner_runs_total", "counter",
              "Provisioner runs (--provisioner) by result: ok, failed (exit status or signal), "
              "timeout (killed at --provisioner-timeout-ms).");
  sb_printf(&b, "ztrain_provisioner_runs_total{result=\"ok\"} %llu\n", (unsigned long long)prov[0]);
  sb_printf(&b, "ztrain_provisioner_runs_total{result=\"failed\"} %llu\n",
            (unsigned long long)prov[1]);
  sb_printf(&b, "ztrain_provisioner_runs_total{result=\"timeout\"} %llu\n",
            (unsigned long long)prov[2]);
  metric_head(&b, "ztrain_coordinator_epoch", "gauge", "Coordinator starts on this database.");
  sb_printf(&b, "ztrain_coordinator_epoch %lld\n", (long long)c->epoch);
  r->status = 200;
  r->ctype = "text/plain; version=0.0.4; charset=utf-8";
  r->resp = b.buf;
  r->resp_len = b.len;
}

/* ---- dashboard: static files ---------------------------------------------- */

#define ZT_CHARTJS "/usr/share/javascript/chart.js/chart.min.js"

static const char *ctype_of(const char *name) {
  const char *dot = strrchr(name, '.');
  if (!dot) return "application/octet-stream";
  if (!strcmp(dot, ".html")) return "text/html; charset=utf-8";
  if (!strcmp(dot, ".js")) return "text/javascript; charset=utf-8";
  if (!strcmp(dot, ".css")) return "text/css; charset=utf-8";
  if (!strcmp(dot, ".png")) return "image/png";
  if (!strcmp(dot, ".svg")) return "image/svg+xml";
  return "application/octet-stream";
}

/* Serves one file of the web directory. Names are plain [A-Za-z0-9._-]
 * without a leading dot, so no path can leave the directory. */
static void serve_file(zt_http_req_t *r, const char *name) {
  char path[ZT_PATH_MAX];
  int ok = name[0] && name[0] != '.';
  for (const char *p = name; *p; p++)
    ok &= (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
          *p == '.' || *p == '_' || *p == '-';
  if (!ok) {
    zt_http_error(r, 404, "no such file: %.64s", name);
    return;
  }
  if (!strcmp(name, "chart.js")) snprintf(path, sizeof path, "%s", ZT_CHARTJS);
  else if (zt_path_join(path, sizeof path, r->c->cfg.web_dir, name) != 0) path[0] = 0;
  char *data;
  size_t len;
  if (zt_read_file(path, &data, &len, 16 << 20) != 0) {
    zt_http_error(r, 404, "no such file: %.64s", name);
    return;
  }
  r->status = 200;
  r->ctype = ctype_of(name);
  r->resp = data;
  r->resp_len = len;
}

static void r_index(zt_http_req_t *r) { serve_file(r, "index.html"); }
static void r_static(zt_http_req_t *r) { serve_file(r, r->url + strlen("/static/")); }

typedef struct {
  const char *method;
  const char *path; /* a trailing '*' matches any rest */
  void (*fn)(zt_http_req_t *r);
  int mutating;     /* needs the bearer token when one is configured */
} route;

static int path_match(const char *pat, const char *url) {
  size_t n = strlen(pat);
  if (n && pat[n - 1] == '*') return !strncmp(pat, url, n - 1) && url[n - 1];
  return !strcmp(pat, url);
}

static const route k_routes[] = {
    {"GET", "/healthz", r_healthz, 0},
    {"GET", "/v1/status", r_status, 0},
    {"GET", "/v1/workers", r_workers, 0},
    {"GET", "/v1/events", r_events, 0},
    {"GET", "/v1/jobs", r_jobs, 0},
    {"POST", "/v1/jobs", r_submit, 1},
    {"GET", "/v1/jobs/*", r_job, 0},
    {"POST", "/v1/jobs/*", r_job_action, 1},
    {"POST", "/v1/workers/*", r_drain, 1},
    {"GET", "/metrics", r_metrics, 0},
    {"GET", "/", r_index, 0},
    {"GET", "/static/*", r_static, 0},
};

static int authorized(zt_http_req_t *r) {
  return zt_auth_operator(r->c, r->conn ? MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND,
                                                                      "Authorization")
                                        : r->authorization);
}

/* 1, with the 401 answer in r, when route rt needs the token and r lacks it. */
static int unauthorized(zt_http_req_t *r, const route *rt) {
  if (!rt->mutating || authorized(r)) return 0;
  zt_http_error(r, 401, "%s %s needs \"Authorization: Bearer <api_token>\"", r->method, r->url);
  return 1;
}

static void too_large(zt_http_req_t *r) {
  zt_http_error(r, 413, "request body larger than %u bytes", ZT_HTTP_MAX_BODY);
}

static const route *find_route(const char *method, const char *url) {
  for (size_t i = 0; i < ZT_ARRAY_LEN(k_routes); i++)
    if (path_match(k_routes[i].path, url) && !strcmp(k_routes[i].method, method))
      return &k_routes[i];
  return NULL;
}

/* 1 when the n bytes at h name this machine's loopback: localhost, a
 * 127.0.0.0/8 literal or [::1], with or without a port. */
static int loopback_name(const char *h, size_t n) {
  char host[64];
  /* The host: "[...]" for IPv6, else up to the port's colon. */
  const char *end = h[0] == '[' ? memchr(h, ']', n) : memchr(h, ':', n);
  size_t hn = !end ? (h[0] == '[' ? 0 : n) : (size_t)(end - h) + (h[0] == '[');
  if (hn == 0 || hn >= sizeof host || (hn < n && h[hn] != ':')) return 0;
  memcpy(host, h, hn);
  host[hn] = 0;
  return zt_loopback_host(host);
}

/* What a request needs refused before its body is read, or NULL. Without
 * an API token a web page the operator opens could change state (a form or
 * fetch() needs no permission to POST to 127.0.0.1) or, by re-pointing its
 * own name at 127.0.0.1 (DNS rebinding), read the API. So, with no token:
 * a request that names a foreign site in Origin may not change state, and
 * a server bound to loopback answers only requests addressed to loopback
 * (Host). With a token, a page cannot send the Authorization header
 * without a preflight that zcoord does not answer. A mutating request
 * without the token, or a body over the limit, is answered at once, so
 * that no unauthenticated body is buffered. */
static int refuse_early(zt_http_t *h, struct MHD_Connection *conn, const char *method,
                        const char *url, zt_http_req_t *r) {
  const route *rt = find_route(method, url);
  const char *origin = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Origin");
  const char *host = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Host");
  const char *clen = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
  int open = !h->c->cfg.api_token[0];
  if (open && h->loopback && host && !loopback_name(host, strlen(host))) {
    zt_http_error(r, 403, "request for host \"%.64s\" refused: this coordinator answers only "
                  "requests addressed to loopback when no api_token is set", host);
    return 1;
  }
  if (open && rt && rt->mutating && origin) {
    const char *sep = strstr(origin, "://");
    const char *o = sep ? sep + 3 : origin;
    size_t on = strcspn(o, "/");
    if (!sep || !loopback_name(o, on)) {
      zt_http_error(r, 403, "%s %s from the web page of \"%.64s\" refused: a cross-site "
                    "request may not change state", method, url, origin);
      return 1;
    }
  }
  if (rt && unauthorized(r, rt)) return 1;
  if (clen && strtoull(clen, NULL, 10) > ZT_HTTP_MAX_BODY) {
    too_large(r);
    return 1;
  }
  return 0;
}

static void route_on_loop(void *arg) { zt__http_route(arg); }

void zt__http_route(zt_http_req_t *r) {
  const route *rt = find_route(r->method, r->url);
  if (rt) {
    if (!unauthorized(r, rt)) rt->fn(r);
    return;
  }
  const char *allow = NULL; /* the path's routes: every one has another method */
  for (size_t i = 0; i < ZT_ARRAY_LEN(k_routes); i++)
    if (path_match(k_routes[i].path, r->url)) allow = allow ? "GET, POST" : k_routes[i].method;
  if (allow) {
    r->allow = allow;
    zt_http_error(r, 405, "method %s not allowed on %s (allowed: %s)", r->method, r->url, allow);
  } else {
    zt_http_error(r, 404, "no such resource: %s", r->url);
  }
}

/* ---- libmicrohttpd glue ------------------------------------------------- */

static enum MHD_Result send_req(struct MHD_Connection *conn, zt_http_req_t *r) {
  struct MHD_Response *resp =
      MHD_create_response_from_buffer(r->resp_len, r->resp ? r->resp : (char *)"",
                                      r->resp ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
  MHD_add_response_header(resp, "Content-Type", r->ctype ? r->ctype : "application/json");
  MHD_add_response_header(resp, "Cache-Control", "no-store");
  if (r->allow) MHD_add_response_header(resp, "Allow", r->allow);
  enum MHD_Result ret = MHD_queue_response(conn, (unsigned)r->status, resp);
  MHD_destroy_response(resp);
  return ret;
}

static enum MHD_Result access_handler(void *cls, struct MHD_Connection *conn, const char *url,
                                      const char *method, const char *version,
                                      const char *upload_data, size_t *upload_size,
                                      void **con_cls) {
  (void)version;
  zt_http_t *h = cls;
  conn_ctx *cc = *con_cls;
  if (!cc) {
    cc = zt_xcalloc(1, sizeof *cc);
    *con_cls = cc;
    zt_http_req_t r = {.c = h->c, .conn = conn, .method = method, .url = url};
    if (refuse_early(h, conn, method, url, &r)) {
      cc->answered = 1;
      return send_req(conn, &r);
    }
    return MHD_YES;
  }
  if (cc->answered) { /* the rest of a refused request's body */
    *upload_size = 0;
    return MHD_YES;
  }
  if (*upload_size) {
    if (!cc->too_large && cc->len + *upload_size <= ZT_HTTP_MAX_BODY) {
      cc->body = zt_xrealloc(cc->body, cc->len + *upload_size + 1);
      memcpy(cc->body + cc->len, upload_data, *upload_size);
      cc->len += *upload_size;
      cc->body[cc->len] = 0;
    } else {
      cc->too_large = 1;
    }
    *upload_size = 0;
    return MHD_YES;
  }
  zt_http_req_t r = {.c = h->c, .conn = conn, .method = method, .url = url,
                   .body = cc->body, .body_len = cc->len};
  if (cc->too_large) {
    too_large(&r);
  } else if (zt_loopcall_run(&h->c->loopcall, route_on_loop, &r) != 0) {
    zt_http_error(&r, 503, "coordinator is shutting down");
  }
  return send_req(conn, &r);
}

static void request_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                              enum MHD_RequestTerminationCode toe) {
  (void)cls, (void)conn, (void)toe;
  conn_ctx *cc = *con_cls;
  if (!cc) return;
  free(cc->body);
  free(cc);
  *con_cls = NULL;
}

/* Why libmicrohttpd could not listen on sa: binds a socket the way it
 * does (SO_REUSEADDR) to learn the reason, so that a port another process
 * holds is named as such. */
static int listen_error(const char *addr, const struct sockaddr_in *sa) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1, e = 0;
  if (fd >= 0) {
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        bind(fd, (const struct sockaddr *)sa, sizeof *sa) != 0)
      e = errno;
    close(fd);
  }
  if (e == EADDRINUSE)
    return zt_errk(ZT_E_UNAVAILABLE, "HTTP port %d is already in use (--http %s)",
                   (int)ntohs(sa->sin_port), addr);
  if (e) return zt_errk(ZT_E_UNAVAILABLE, "cannot listen for HTTP on %s: %s", addr, strerror(e));
  return zt_errk(ZT_E_UNAVAILABLE, "cannot listen for HTTP on %s", addr);
}

int zt_http_start(zt_coord_t *c, const char *addr, zt_http_t **out) {
  char host[64];
  int port; /* 0: any free port */
  if (zt_net_parse_listen(addr, host, sizeof host, &port) != 0)
    return zt_err("--http %s: expected HOST:PORT", addr);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  if (inet_pton(AF_INET, host, &sa.sin_addr) != 1)
    return zt_err("--http %s: host must be an IPv4 address", addr);
  sa.sin_port = htons((uint16_t)port);
  zt_http_t *h = zt_xcalloc(1, sizeof *h);
  h->c = c;
  /* poll(), not epoll: see the top of this file (half-closed connections). */
  h->d = MHD_start_daemon(MHD_USE_POLL_INTERNAL_THREAD | MHD_USE_ERROR_LOG, 0, NULL, NULL,
                          access_handler, h, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                          MHD_OPTION_NOTIFY_COMPLETED, request_completed, h,
                          MHD_OPTION_CONNECTION_TIMEOUT, ZT_HTTP_IDLE_S,
                          MHD_OPTION_CONNECTION_LIMIT, ZT_HTTP_MAX_CONNS,
                          MHD_OPTION_PER_IP_CONNECTION_LIMIT, ZT_HTTP_PER_CLIENT,
                          MHD_OPTION_END);
  if (!h->d) {
    free(h);
    return listen_error(addr, &sa);
  }
  const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
  h->port = di ? di->port : port;
  h->loopback = (ntohl(sa.sin_addr.s_addr) >> 24) == 127;
  *out = h;
  return 0;
}

int zt_http_port(zt_http_t *h) { return h->port; }

void zt_http_stop(zt_http_t *h) {
  if (!h) return;
  MHD_stop_daemon(h->d);
  free(h);
}
