/*
 * service.c: the coordinator's gRPC services, Control and Status.
 *
 * common/rpc.c delivers each request to zt_coord_rpc_dispatch() on the loop
 * thread as raw bytes plus a method path. This file looks the path up in one
 * table, decodes the bytes with the method's protobuf-c descriptor, runs the
 * handler and encodes the reply. Anything the network can send is handled
 * here without trusting it:
 *
 *   - an unknown path gets UNIMPLEMENTED naming the path;
 *   - bytes that do not decode as the request message get INVALID_ARGUMENT
 *     naming the message type (protobuf-c rejects truncated fields, bad wire
 *     types and lengths running past the end);
 *   - semantic errors (unknown worker, stale state) get the matching status
 *     with a sentence that says what to do;
 *   - oversized requests never reach this file: the server refuses them with
 *     RESOURCE_EXHAUSTED (max_message_bytes in zt_rpc_server_opts).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "ztrain.pb-c.h"

typedef struct {
  int status;
  char msg[512];
} rpc_outcome;

typedef ProtobufCMessage *(*handler_fn)(zt_coord *c, zt_rpc_call_t *call,
                                        const ProtobufCMessage *req, rpc_outcome *out);

typedef struct {
  const char *path;
  const ProtobufCMessageDescriptor *req_desc;
  handler_fn fn;
} method_entry;

/* ---- Control ----------------------------------------------------------- */

static ProtobufCMessage *h_register(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                    rpc_outcome *out) {
  const Ztrain__RegisterRequest *req = (const Ztrain__RegisterRequest *)m;
  if (c->cfg.worker_secret[0] && strcmp(req->secret, c->cfg.worker_secret) != 0) {
    out->status = ZT_RPC_UNAUTHENTICATED;
    snprintf(out->msg, sizeof out->msg, "worker secret missing or wrong");
    ZT_WARN("refused registration of \"%.64s\" from %s: bad secret", req->name,
            zt_rpc_call_peer(call));
    return NULL;
  }
  zt_member *mem;
  out->status = zt_members_register(c, req->name, req->host, req->device, req->pid, &mem, out->msg,
                                    sizeof out->msg);
  if (out->status != ZT_RPC_OK) return NULL;
  Ztrain__RegisterReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__register_reply__init(r);
  r->worker_id = mem->row.id;
  r->heartbeat_ms = (uint32_t)c->cfg.heartbeat_ms;
  r->heartbeat_timeout_ms = (uint32_t)c->cfg.heartbeat_timeout_ms;
  r->coordinator_epoch = (uint64_t)c->epoch;
  return &r->base;
}

static ProtobufCMessage *h_heartbeat(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                     rpc_outcome *out) {
  (void)call;
  const Ztrain__HeartbeatRequest *req = (const Ztrain__HeartbeatRequest *)m;
  zt_member *mem;
  out->status = zt_members_heartbeat(c, req->worker_id, &mem, out->msg, sizeof out->msg);
  if (out->status != ZT_RPC_OK) return NULL;
  Ztrain__HeartbeatReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__heartbeat_reply__init(r);
  r->command = (Ztrain__Command)zt_jobs_heartbeat_command(c, mem, req->job_id, req->generation,
                                                          &r->job_id, &r->generation);
  r->heartbeat_ms = (uint32_t)c->cfg.heartbeat_ms;
  r->coordinator_epoch = (uint64_t)c->epoch;
  return &r->base;
}

static ProtobufCMessage *h_leave(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                 rpc_outcome *out) {
  (void)call;
  const Ztrain__LeaveRequest *req = (const Ztrain__LeaveRequest *)m;
  zt_member *mem = zt_members_get(c, req->worker_id);
  Ztrain__LeaveReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__leave_reply__init(r);
  /* A worker that leaves a checkpointed running job drains first. */
  if (mem && mem->row.state == ZT_WORKER_ALIVE && (mem->draining || zt_jobs_leave_drains(c, mem)) &&
      mem->job_id) {
    r->drain_pending = 1;
    return &r->base;
  }
  out->status = zt_members_leave(c, req->worker_id, req->reason, out->msg, sizeof out->msg);
  if (out->status != ZT_RPC_OK) {
    free(r);
    return NULL;
  }
  return &r->base;
}

/* Rendezvous is a long poll: jobs.c holds the call and answers it when the
 * generation is complete, so this handler never replies itself. */
#define ZT_DEFERRED (-1)

static ProtobufCMessage *h_rendezvous(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                      rpc_outcome *out) {
  zt_jobs_rendezvous(c, call, (const Ztrain__RendezvousRequest *)m);
  out->status = ZT_DEFERRED;
  return NULL;
}

static ProtobufCMessage *h_report_step(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                       rpc_outcome *out) {
  (void)call;
  int cmd = 0;
  out->status = zt_jobs_report_step(c, (const Ztrain__ReportStepRequest *)m, &cmd, out->msg,
                                    sizeof out->msg);
  if (out->status != ZT_RPC_OK) return NULL;
  Ztrain__ReportStepReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__report_step_reply__init(r);
  r->command = (Ztrain__Command)cmd;
  return &r->base;
}

static ProtobufCMessage *h_report_failure(zt_coord *c, zt_rpc_call_t *call,
                                          const ProtobufCMessage *m, rpc_outcome *out) {
  (void)call;
  const Ztrain__ReportFailureRequest *req = (const Ztrain__ReportFailureRequest *)m;
  out->status = zt_jobs_report_failure(c, req, out->msg, sizeof out->msg);
  if (out->status != ZT_RPC_OK) return NULL;
  Ztrain__ReportFailureReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__report_failure_reply__init(r);
  zt_member *mem = zt_members_get(c, req->worker_id);
  if (mem) r->job_id = mem->job_id, r->generation = mem->gen;
  return &r->base;
}

static ProtobufCMessage *h_report_checkpoint(zt_coord *c, zt_rpc_call_t *call,
                                             const ProtobufCMessage *m, rpc_outcome *out) {
  (void)call;
  int committed = 0;
  out->status = zt_jobs_report_checkpoint(c, (const Ztrain__ReportCheckpointRequest *)m,
                                          &committed, out->msg, sizeof out->msg);
  if (out->status != ZT_RPC_OK) return NULL;
  Ztrain__ReportCheckpointReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__report_checkpoint_reply__init(r);
  r->committed = committed;
  return &r->base;
}

/* ---- Status ------------------------------------------------------------ */

typedef struct {
  Ztrain__ListCheckpointsReply *r;
  size_t cap;
} ckpt_acc;

static int collect_ckpt(const zt_db_ckpt *k, void *user) {
  ckpt_acc *a = user;
  if (a->r->n_checkpoints == a->cap) {
    a->cap = a->cap ? a->cap * 2 : 16;
    a->r->checkpoints = realloc(a->r->checkpoints, a->cap * sizeof *a->r->checkpoints);
    if (!a->r->checkpoints) abort();
  }
  size_t dl = strlen(k->dir) + 1;
  Ztrain__CheckpointInfo *x = malloc(sizeof *x + dl);
  if (!x) abort();
  ztrain__checkpoint_info__init(x);
  x->step = k->step;
  x->generation = k->generation;
  x->state = (char *)zt_ckpt_state_name(k->state);
  x->dir = (char *)(x + 1);
  memcpy(x->dir, k->dir, dl);
  x->bytes = k->bytes;
  x->t_ms = k->t_ms;
  x->world = (uint32_t)k->world;
  a->r->checkpoints[a->r->n_checkpoints++] = x;
  return 0;
}

static void free_list_ckpts(ProtobufCMessage *m) {
  Ztrain__ListCheckpointsReply *r = (Ztrain__ListCheckpointsReply *)m;
  for (size_t i = 0; i < r->n_checkpoints; i++) free(r->checkpoints[i]);
  free(r->checkpoints);
  free(r);
}

static ProtobufCMessage *h_list_checkpoints(zt_coord *c, zt_rpc_call_t *call,
                                            const ProtobufCMessage *m, rpc_outcome *out) {
  (void)call;
  uint64_t id = ((const Ztrain__ListCheckpointsRequest *)m)->job_id;
  if (!zt_jobs_get(c, id)) {
    out->status = ZT_RPC_NOT_FOUND;
    snprintf(out->msg, sizeof out->msg, "unknown job %llu", (unsigned long long)id);
    return NULL;
  }
  Ztrain__ListCheckpointsReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__list_checkpoints_reply__init(r);
  ckpt_acc a = {r, 0};
  if (zt_db_ckpts_each(c->db, id, collect_ckpt, &a) != 0) {
    free_list_ckpts(&r->base);
    out->status = ZT_RPC_UNAVAILABLE;
    snprintf(out->msg, sizeof out->msg, "%s", zt_err_msg());
    return NULL;
  }
  return &r->base;
}

/* Mutating Status calls need "authorization: Bearer <api_token>" when an
 * API token is configured. */
static int authorized(zt_coord *c, zt_rpc_call_t *call, rpc_outcome *out) {
  if (!c->cfg.api_token[0]) return 1;
  const char *a = zt_rpc_call_metadata(call, "authorization");
  if (a && !strncmp(a, "Bearer ", 7) && !strcmp(a + 7, c->cfg.api_token)) return 1;
  out->status = ZT_RPC_UNAUTHENTICATED;
  snprintf(out->msg, sizeof out->msg, "this call needs a bearer token (zctl --token)");
  return 0;
}

static ProtobufCMessage *h_job_action(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                      rpc_outcome *out) {
  if (!authorized(c, call, out)) return NULL;
  const Ztrain__JobActionRequest *req = (const Ztrain__JobActionRequest *)m;
  Ztrain__JobActionReply *r = malloc(sizeof *r + 512);
  if (!r) abort();
  ztrain__job_action_reply__init(r);
  r->message = (char *)(r + 1);
  out->status =
      zt_jobs_action(c, req->job_id, req->action, req->to_step, req->skip_steps, r->message, 512);
  if (out->status != ZT_RPC_OK) {
    snprintf(out->msg, sizeof out->msg, "%s", r->message);
    free(r);
    return NULL;
  }
  return &r->base;
}

static ProtobufCMessage *h_drain(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                 rpc_outcome *out) {
  if (!authorized(c, call, out)) return NULL;
  const char *w = ((const Ztrain__DrainRequest *)m)->worker;
  char *end;
  unsigned long long id = strtoull(w, &end, 10);
  zt_member *mem = (*w && !*end) ? zt_members_get(c, id) : zt_members_find_name(c, w);
  if (!mem) {
    out->status = ZT_RPC_NOT_FOUND;
    snprintf(out->msg, sizeof out->msg, "unknown worker \"%.64s\"", w);
    return NULL;
  }
  Ztrain__DrainReply *r = malloc(sizeof *r + 512);
  if (!r) abort();
  ztrain__drain_reply__init(r);
  r->message = (char *)(r + 1);
  out->status = zt_jobs_drain(c, mem, r->message, 512);
  return &r->base;
}

static ProtobufCMessage *h_submit_job(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                      rpc_outcome *out) {
  if (!authorized(c, call, out)) return NULL;
  uint64_t id = 0;
  out->status = zt_jobs_submit(c, ((const Ztrain__SubmitJobRequest *)m)->spec_json, &id, out->msg,
                               sizeof out->msg);
  if (out->status != ZT_RPC_OK) return NULL;
  Ztrain__SubmitJobReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__submit_job_reply__init(r);
  r->job_id = id;
  return &r->base;
}

/* Fills a WorkerInfo that points into the member (valid until the reply). */
void zt_coord_worker_info(const zt_member *mem, Ztrain__WorkerInfo *w) {
  ztrain__worker_info__init(w);
  w->id = mem->row.id;
  w->name = (char *)mem->row.name;
  w->host = (char *)mem->row.host;
  w->device = (char *)mem->row.device;
  w->state = (Ztrain__WorkerState)mem->row.state;
  w->last_seen_ms = mem->row.last_seen_ms;
  w->registered_ms = mem->row.registered_ms;
  w->pid = mem->row.pid;
}

/* Fills a JobInfo that points into the job (valid until the reply is sent). */
void zt_coord_job_info(const zt_job *j, Ztrain__JobInfo *ji) {
  ztrain__job_info__init(ji);
  ji->id = j->row.id;
  ji->name = (char *)j->row.name;
  ji->state = (Ztrain__JobState)j->row.state;
  ji->generation = j->row.generation;
  ji->world = (uint32_t)j->row.world;
  ji->step = j->row.step;
  ji->total_steps = j->row.total_steps;
  ji->loss = j->last.loss;
  ji->lr = j->last.lr;
  ji->grad_norm = j->last.grad_norm;
  ji->val_loss = j->last.val_loss;
  ji->tokens_per_s = j->last.tokens_per_s;
  ji->message = (char *)j->row.message;
  ji->created_ms = j->row.created_ms;
  ji->updated_ms = j->row.updated_ms;
  ji->restarts = (uint32_t)j->row.restarts;
  ji->min_workers = (uint32_t)j->row.min_workers;
  ji->max_workers = (uint32_t)j->row.max_workers;
}

static void free_list_jobs(ProtobufCMessage *m) {
  Ztrain__ListJobsReply *r = (Ztrain__ListJobsReply *)m;
  for (size_t i = 0; i < r->n_jobs; i++) free(r->jobs[i]);
  free(r->jobs);
  free(r);
}

static ProtobufCMessage *h_list_jobs(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                     rpc_outcome *out) {
  (void)call, (void)m, (void)out;
  Ztrain__ListJobsReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__list_jobs_reply__init(r);
  size_t n = 0;
  for (zt_job *j = c->jobs; j; j = j->next) n++;
  r->jobs = calloc(n ? n : 1, sizeof *r->jobs);
  if (!r->jobs) abort();
  for (zt_job *j = c->jobs; j; j = j->next) {
    Ztrain__JobInfo *ji = malloc(sizeof *ji);
    if (!ji) abort();
    zt_coord_job_info(j, ji);
    r->jobs[r->n_jobs++] = ji;
  }
  return &r->base;
}

static void free_get_job(ProtobufCMessage *m) {
  Ztrain__GetJobReply *r = (Ztrain__GetJobReply *)m;
  free(r->job);
  free(r);
}

static ProtobufCMessage *h_get_job(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                   rpc_outcome *out) {
  (void)call;
  uint64_t id = ((const Ztrain__GetJobRequest *)m)->job_id;
  zt_job *j = zt_jobs_get(c, id);
  if (!j) {
    out->status = ZT_RPC_NOT_FOUND;
    snprintf(out->msg, sizeof out->msg, "unknown job %llu", (unsigned long long)id);
    return NULL;
  }
  Ztrain__GetJobReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__get_job_reply__init(r);
  r->job = malloc(sizeof *r->job);
  if (!r->job) abort();
  zt_coord_job_info(j, r->job);
  return &r->base;
}

typedef struct {
  Ztrain__GetMetricsReply *r;
  size_t cap;
} steps_acc;

static int collect_step(const zt_db_step *s, void *user) {
  steps_acc *a = user;
  if (a->r->n_steps == a->cap) {
    a->cap = a->cap ? a->cap * 2 : 256;
    a->r->steps = realloc(a->r->steps, a->cap * sizeof *a->r->steps);
    if (!a->r->steps) abort();
  }
  Ztrain__StepRecord *x = malloc(sizeof *x);
  if (!x) abort();
  ztrain__step_record__init(x);
  x->step = s->step;
  x->generation = s->generation;
  x->loss = s->loss;
  x->grad_norm = s->grad_norm;
  x->lr = s->lr;
  x->tokens_per_s = s->tokens_per_s;
  x->val_loss = s->val_loss;
  x->t_ms = s->t_ms;
  a->r->steps[a->r->n_steps++] = x;
  return 0;
}

static void free_get_metrics(ProtobufCMessage *m) {
  Ztrain__GetMetricsReply *r = (Ztrain__GetMetricsReply *)m;
  for (size_t i = 0; i < r->n_steps; i++) free(r->steps[i]);
  free(r->steps);
  free(r);
}

static ProtobufCMessage *h_get_metrics(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                       rpc_outcome *out) {
  (void)call;
  const Ztrain__GetMetricsRequest *req = (const Ztrain__GetMetricsRequest *)m;
  if (!zt_jobs_get(c, req->job_id)) {
    out->status = ZT_RPC_NOT_FOUND;
    snprintf(out->msg, sizeof out->msg, "unknown job %llu", (unsigned long long)req->job_id);
    return NULL;
  }
  Ztrain__GetMetricsReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__get_metrics_reply__init(r);
  steps_acc a = {r, 0};
  int64_t to = req->to_step > 0 ? req->to_step : INT64_MAX;
  if (zt_db_steps_each(c->db, req->job_id, req->from_step, to, collect_step, &a) != 0) {
    free_get_metrics(&r->base);
    out->status = ZT_RPC_UNAVAILABLE;
    snprintf(out->msg, sizeof out->msg, "%s", zt_err_msg());
    return NULL;
  }
  return &r->base;
}

static ProtobufCMessage *h_get_status(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                      rpc_outcome *out) {
  (void)call, (void)m, (void)out;
  Ztrain__GetStatusReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__get_status_reply__init(r);
  uint32_t counts[5];
  zt_members_count(c, counts);
  r->version = ZT_VERSION;
  r->started_ms = c->started_ms;
  r->heartbeat_ms = (uint32_t)c->cfg.heartbeat_ms;
  r->heartbeat_timeout_ms = (uint32_t)c->cfg.heartbeat_timeout_ms;
  r->workers_alive = counts[ZT_WORKER_ALIVE];
  r->workers_suspect = counts[ZT_WORKER_SUSPECT];
  r->workers_lost = counts[ZT_WORKER_LOST];
  r->workers_left = counts[ZT_WORKER_LEFT];
  r->coordinator_epoch = (uint64_t)c->epoch;
  r->db_path = (char *)zt_db_path(c->db);
  return &r->base;
}

static void free_list_workers(ProtobufCMessage *m) {
  Ztrain__ListWorkersReply *r = (Ztrain__ListWorkersReply *)m;
  for (size_t i = 0; i < r->n_workers; i++) free(r->workers[i]);
  free(r->workers);
  free(r);
}

static ProtobufCMessage *h_list_workers(zt_coord *c, zt_rpc_call_t *call,
                                        const ProtobufCMessage *m, rpc_outcome *out) {
  (void)call, (void)m, (void)out;
  Ztrain__ListWorkersReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__list_workers_reply__init(r);
  r->workers = calloc(c->n_members ? c->n_members : 1, sizeof *r->workers);
  if (!r->workers) abort();
  for (size_t i = 0; i < c->by_id_cap; i++) {
    zt_member *mem = c->by_id[i];
    if (!mem) continue;
    Ztrain__WorkerInfo *w = malloc(sizeof *w);
    if (!w) abort();
    zt_coord_worker_info(mem, w);
    r->workers[r->n_workers++] = w;
  }
  return &r->base;
}

typedef struct {
  Ztrain__ListEventsReply *r;
  size_t cap;
} events_acc;

static int collect_event(const zt_db_event *e, void *user) {
  events_acc *a = user;
  if (a->r->n_events == a->cap) {
    a->cap = a->cap ? a->cap * 2 : 64;
    a->r->events = realloc(a->r->events, a->cap * sizeof *a->r->events);
    if (!a->r->events) abort();
  }
  /* One block per event: the message followed by its two strings. */
  size_t kl = strlen(e->kind) + 1, dl = strlen(e->detail) + 1;
  Ztrain__Event *ev = malloc(sizeof *ev + kl + dl);
  if (!ev) abort();
  ztrain__event__init(ev);
  ev->id = e->id;
  ev->t_ms = e->t_ms;
  ev->job_id = e->job_id;
  ev->worker_id = e->worker_id;
  ev->kind = (char *)(ev + 1);
  ev->detail = ev->kind + kl;
  memcpy(ev->kind, e->kind, kl);
  memcpy(ev->detail, e->detail, dl);
  a->r->events[a->r->n_events++] = ev;
  return 0;
}

static void free_list_events(ProtobufCMessage *m) {
  Ztrain__ListEventsReply *r = (Ztrain__ListEventsReply *)m;
  for (size_t i = 0; i < r->n_events; i++) free(r->events[i]);
  free(r->events);
  free(r);
}

static ProtobufCMessage *h_list_events(zt_coord *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                       rpc_outcome *out) {
  (void)call;
  const Ztrain__ListEventsRequest *req = (const Ztrain__ListEventsRequest *)m;
  int limit = req->limit == 0 ? 1000 : (int)ZT_MIN(req->limit, 100000u);
  Ztrain__ListEventsReply *r = malloc(sizeof *r);
  if (!r) abort();
  ztrain__list_events_reply__init(r);
  events_acc a = {r, 0};
  if (zt_db_events_each(c->db, req->job_id, req->after_id, limit, collect_event, &a) != 0) {
    free_list_events(&r->base);
    out->status = ZT_RPC_UNAVAILABLE;
    snprintf(out->msg, sizeof out->msg, "%s", zt_err_msg());
    return NULL;
  }
  return &r->base;
}

/* ---- dispatch ---------------------------------------------------------- */

static const method_entry k_methods[] = {
    {"/ztrain.Control/RegisterWorker", &ztrain__register_request__descriptor, h_register},
    {"/ztrain.Control/Heartbeat", &ztrain__heartbeat_request__descriptor, h_heartbeat},
    {"/ztrain.Control/Leave", &ztrain__leave_request__descriptor, h_leave},
    {"/ztrain.Control/Rendezvous", &ztrain__rendezvous_request__descriptor, h_rendezvous},
    {"/ztrain.Control/ReportStep", &ztrain__report_step_request__descriptor, h_report_step},
    {"/ztrain.Control/ReportFailure", &ztrain__report_failure_request__descriptor,
     h_report_failure},
    {"/ztrain.Control/ReportCheckpoint", &ztrain__report_checkpoint_request__descriptor,
     h_report_checkpoint},
    {"/ztrain.Status/ListCheckpoints", &ztrain__list_checkpoints_request__descriptor,
     h_list_checkpoints},
    {"/ztrain.Status/JobAction", &ztrain__job_action_request__descriptor, h_job_action},
    {"/ztrain.Status/Drain", &ztrain__drain_request__descriptor, h_drain},
    {"/ztrain.Status/SubmitJob", &ztrain__submit_job_request__descriptor, h_submit_job},
    {"/ztrain.Status/ListJobs", &ztrain__list_jobs_request__descriptor, h_list_jobs},
    {"/ztrain.Status/GetJob", &ztrain__get_job_request__descriptor, h_get_job},
    {"/ztrain.Status/GetMetrics", &ztrain__get_metrics_request__descriptor, h_get_metrics},
    {"/ztrain.Status/GetStatus", &ztrain__get_status_request__descriptor, h_get_status},
    {"/ztrain.Status/ListWorkers", &ztrain__list_workers_request__descriptor, h_list_workers},
    {"/ztrain.Status/ListEvents", &ztrain__list_events_request__descriptor, h_list_events},
};

/* How to free each reply type: replies point into coordinator memory where
 * they can (strings of members), so only the containers are freed. */
static void free_reply(ProtobufCMessage *m) {
  if (!m) return;
  if (m->descriptor == &ztrain__list_workers_reply__descriptor) free_list_workers(m);
  else if (m->descriptor == &ztrain__list_events_reply__descriptor) free_list_events(m);
  else if (m->descriptor == &ztrain__list_jobs_reply__descriptor) free_list_jobs(m);
  else if (m->descriptor == &ztrain__get_job_reply__descriptor) free_get_job(m);
  else if (m->descriptor == &ztrain__get_metrics_reply__descriptor) free_get_metrics(m);
  else if (m->descriptor == &ztrain__list_checkpoints_reply__descriptor) free_list_ckpts(m);
  else free(m);
}

void zt_coord_rpc_dispatch(zt_rpc_call_t *call, const char *method, const uint8_t *req, size_t len,
                           void *user) {
  zt_coord *c = user;
  const method_entry *e = NULL;
  for (size_t i = 0; i < ZT_ARRAY_LEN(k_methods); i++)
    if (strcmp(k_methods[i].path, method) == 0) e = &k_methods[i];
  if (!e) {
    char msg[256];
    snprintf(msg, sizeof msg, "unknown method %.200s", method);
    zt_rpc_reply(call, ZT_RPC_UNIMPLEMENTED, msg, NULL, 0);
    return;
  }
  ProtobufCMessage *in = protobuf_c_message_unpack(e->req_desc, NULL, len, req);
  if (!in) {
    char msg[256];
    snprintf(msg, sizeof msg, "%s: request is not a valid %s message (%zu bytes)", method,
             e->req_desc->name, len);
    ZT_WARN("%s from %s", msg, zt_rpc_call_peer(call));
    zt_rpc_reply(call, ZT_RPC_INVALID_ARGUMENT, msg, NULL, 0);
    return;
  }
  rpc_outcome out = {ZT_RPC_OK, ""};
  ProtobufCMessage *reply = e->fn(c, call, in, &out);
  protobuf_c_message_free_unpacked(in, NULL);
  if (out.status == ZT_DEFERRED) return;
  if (out.status != ZT_RPC_OK || !reply) {
    zt_rpc_reply(call, out.status != ZT_RPC_OK ? out.status : ZT_RPC_INTERNAL, out.msg, NULL, 0);
    free_reply(reply);
    return;
  }
  size_t n = protobuf_c_message_get_packed_size(reply);
  uint8_t stackbuf[512];
  uint8_t *buf = n <= sizeof stackbuf ? stackbuf : malloc(n);
  if (!buf) abort();
  protobuf_c_message_pack(reply, buf);
  zt_rpc_reply(call, ZT_RPC_OK, NULL, buf, n);
  if (buf != stackbuf) free(buf);
  free_reply(reply);
}
