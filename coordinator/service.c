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
 *   - semantic errors (unknown worker, stale state) come back from the
 *     layers below as an error kind and a sentence that says what to do;
 *     the kind becomes the status through common/err.c's one table;
 *   - oversized requests never reach this file: the server refuses them with
 *     RESOURCE_EXHAUSTED (max_message_bytes in zt_rpc_server_opts_t).
 *
 * Handlers return a reply message (or NULL with the error set). A reply may
 * point into memory the handler collected (database rows); such memory is
 * registered in the call's `owned` list and freed after the reply is packed.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "ztrain.pb-c.h"

/* Returned by a handler that answers later (Rendezvous, a long poll). */
#define ZT_DEFERRED ((ProtobufCMessage *)1)

/* What a handler produced besides its reply: blocks to free after packing,
 * and a HeartbeatBatch's per-entry contexts. */
typedef struct call_ctx {
  void *owned[8];
  int n_owned;
  struct call_ctx *sub;
  size_t n_sub;
  int batch; /* a HeartbeatBatch entry's context: the batch's entries (0: a call) */
} call_ctx;

static void ctx_free(call_ctx *x) {
  for (int i = 0; i < x->n_owned; i++) free(x->owned[i]);
  for (size_t i = 0; i < x->n_sub; i++) ctx_free(&x->sub[i]);
  free(x->sub);
}

static void *own(call_ctx *x, void *p) {
  if (x->n_owned == (int)ZT_ARRAY_LEN(x->owned)) abort(); /* a handler owns at most 8 */
  x->owned[x->n_owned++] = p;
  return p;
}

typedef ProtobufCMessage *(*handler_fn)(zt_coord_t *c, zt_rpc_call_t *call,
                                        const ProtobufCMessage *req, call_ctx *x);

/* A reply message of the given descriptor, zero-initialised, owned by x. */
static void *new_reply(call_ctx *x, const ProtobufCMessageDescriptor *d) {
  ProtobufCMessage *m = own(x, zt_xmalloc(d->sizeof_message));
  protobuf_c_message_init(d, m);
  return m;
}

/* ---- Control ----------------------------------------------------------- */

/* A registration that waited longer than this for the loop is refused
 * (UNAVAILABLE, which workers retry with backoff) before it costs a
 * database write: the coordinator is behind its heartbeats, which keep
 * the registered fleet alive and come first. */
#define ZT_REGISTER_BEHIND_MS 1000

static ProtobufCMessage *h_register(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                    call_ctx *x) {
  const Ztrain__RegisterRequest *req = (const Ztrain__RegisterRequest *)m;
  int64_t waited = zt_rpc_call_waited_ms(call);
  if (waited > ZT_REGISTER_BEHIND_MS) {
    c->register_shed++;
    zt_errk(ZT_E_UNAVAILABLE,
            "the coordinator is behind: this registration waited %lld ms for it; register "
            "again after a pause",
            (long long)waited);
    return NULL;
  }
  if (!zt_auth_worker_secret(c, req->secret)) {
    ZT_WARN("refused registration of \"%.64s\" from %s: bad secret", req->name,
            zt_rpc_call_peer(call));
    zt_errk(ZT_E_UNAUTHENTICATED, "worker secret missing or wrong");
    return NULL;
  }
  zt_register_t reg = {req->name,       req->host,
                       req->device,     req->session,
                       req->store_addr, req->pid,
                       req->host_memory_bytes, req->device_memory_bytes,
                       req->nccl,       req->heartbeat_agent};
  zt_member_t *mem;
  int known;
  if (zt_members_register(c, &reg, &mem, &known) != 0) return NULL;
  /* A worker that registers again was restarted: its place in a job's
   * generation is gone. */
  if (known) zt_sched_member_gone(c, mem, "re-registered (restarted)", 1);
  zt_copies_reconcile(c, mem, req->held_files, req->n_held_files);
  zt_sched_run(c);
  Ztrain__RegisterReply *r = new_reply(x, &ztrain__register_reply__descriptor);
  r->worker_id = mem->row.id;
  r->heartbeat_ms = (uint32_t)zt_members_interval_ms(c);
  r->heartbeat_timeout_ms = (uint32_t)zt_members_timeout_ms(c);
  r->coordinator_epoch = (uint64_t)c->epoch;
  r->session = mem->row.session;
  return &r->base;
}

static ProtobufCMessage *h_heartbeat(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                     call_ctx *x) {
  (void)call;
  const Ztrain__HeartbeatRequest *req = (const Ztrain__HeartbeatRequest *)m;
  zt_member_t *mem;
  /* Each deleted epoch is a database write on the loop: a worker reports
   * at most the 64 it was asked about (worker/control.c), and a longer
   * list is refused before any is written. */
  if (req->n_deleted_epochs > ZT_DELETED_EPOCHS_MAX) {
    zt_errk(ZT_E_INVALID, "deleted_epochs: %zu entries, at most %d", req->n_deleted_epochs,
            ZT_DELETED_EPOCHS_MAX);
    return NULL;
  }
  if (!x->batch) c->hb_calls[0]++;
  if (zt_members_heartbeat(c, req->worker_id, &mem) != 0) return NULL;
  mem->hb_batch = ZT_MAX(1, x->batch); /* its share of the calls (zt_members_pace) */
  zt_members_timing(c, mem, req->step_ms, req->comm_ms, req->send_wait_ms, req->link_rtt_ms);
  Ztrain__HeartbeatReply *r = new_reply(x, &ztrain__heartbeat_reply__descriptor);
  /* Kept out as possibly cut off: its probe's answer, and the next probe. */
  const char **probe = own(x, zt_xcalloc(64, sizeof *probe));
  r->n_probe_stores = (size_t)zt_members_probe(
      c, mem, req->probed, req->n_unreachable_stores,
      req->n_unreachable_stores ? req->unreachable_stores[0] : NULL, probe, 64);
  r->probe_stores = (char **)probe;
  r->command = (Ztrain__Command)zt_jobtable_heartbeat_command(
      c, mem, req->job_id, req->generation, &r->job_id, &r->generation);
  r->nccl_root = zt_rdv_nccl_root(c, mem);
  r->heartbeat_ms = (uint32_t)zt_members_interval_ms(c);
  r->coordinator_epoch = (uint64_t)c->epoch;
  /* Epochs to delete: those it deleted are forgotten, the rest asked again;
   * what it holds, when it says, is reconciled first (its stale epochs go
   * out with this reply). */
  if (req->n_held_files) zt_copies_reconcile(c, mem, req->held_files, req->n_held_files);
  zt_copies_deleted(c, mem, req->deleted_epochs, req->n_deleted_epochs);
  /* The list's 8 KB only when one may be queued (nearly never), not
   * zeroed for every heartbeat. */
  if (!mem->deletions_pending) return &r->base;
  char(*dirs)[ZT_DB_DIR_MAX] = own(x, zt_xcalloc(16, ZT_DB_DIR_MAX));
  char **dp = own(x, zt_xcalloc(16, sizeof *dp));
  int n = zt_copies_deletions(c, mem, dirs, 16);
  for (int i = 0; i < n; i++) dp[i] = dirs[i];
  r->n_delete_epochs = (size_t)n;
  r->delete_epochs = dp;
  return &r->base;
}

static int authenticate_worker(zt_coord_t *c, const ProtobufCMessage *m);

/* A machine's heartbeat agent: every entry is judged as its own Heartbeat
 * call (its credential, its errors), in order; one entry's failure is its
 * own answer, not the call's. */
static ProtobufCMessage *h_heartbeat_batch(zt_coord_t *c, zt_rpc_call_t *call,
                                           const ProtobufCMessage *m, call_ctx *x) {
  const Ztrain__HeartbeatBatchRequest *req = (const Ztrain__HeartbeatBatchRequest *)m;
  size_t n = req->n_beats;
  c->hb_calls[1]++;
  c->hb_batch_entries += n;
  if (n > ZT_HB_BATCH_MAX) {
    zt_errk(ZT_E_INVALID, "beats: %zu entries, at most %d", n, ZT_HB_BATCH_MAX);
    return NULL;
  }
  Ztrain__HeartbeatBatchEntry *e = own(x, zt_xcalloc(n + 1, sizeof *e));
  Ztrain__HeartbeatBatchEntry **ep = own(x, zt_xcalloc(n + 1, sizeof *ep));
  x->sub = zt_xcalloc(n + 1, sizeof *x->sub);
  x->n_sub = n;
  for (size_t i = 0; i < n; i++) {
    const ProtobufCMessage *beat = &req->beats[i]->base;
    ztrain__heartbeat_batch_entry__init(&e[i]);
    ep[i] = &e[i];
    zt_err_clear();
    x->sub[i].batch = (int)n;
    ProtobufCMessage *r =
        authenticate_worker(c, beat) != 0 ? NULL : h_heartbeat(c, call, beat, &x->sub[i]);
    if (r) {
      e[i].reply = (Ztrain__HeartbeatReply *)r;
    } else {
      e[i].status = (uint32_t)zt_errkind_grpc(zt_err_kind());
      e[i].error = own(&x->sub[i], zt_xstrdup(zt_err_msg()));
    }
  }
  zt_err_clear();
  Ztrain__HeartbeatBatchReply *r = new_reply(x, &ztrain__heartbeat_batch_reply__descriptor);
  r->n_replies = n;
  r->replies = ep;
  return &r->base;
}

static ProtobufCMessage *h_leave(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                 call_ctx *x) {
  (void)call;
  const Ztrain__LeaveRequest *req = (const Ztrain__LeaveRequest *)m;
  zt_member_t *mem = zt_members_get(c, req->worker_id);
  Ztrain__LeaveReply *r = new_reply(x, &ztrain__leave_reply__descriptor);
  /* A worker that leaves a checkpointed running job drains first, unless
   * its drain deadline has passed (now). */
  if (!req->now && mem && mem->row.state == ZT_WORKER_ALIVE &&
      (mem->draining || zt_jobs_leave_drains(c, mem)) && mem->job_id) {
    r->drain_pending = 1;
    return &r->base;
  }
  int left;
  if (zt_members_leave(c, req->worker_id, req->reason, &left) != 0) return NULL;
  if (left) zt_sched_member_gone(c, mem, "left", 0);
  return &r->base;
}

static ProtobufCMessage *h_rendezvous(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                      call_ctx *x) {
  (void)x;
  zt_rdv_arrive(c, call, (const Ztrain__RendezvousRequest *)m);
  return ZT_DEFERRED;
}

static ProtobufCMessage *h_report_step(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                       call_ctx *x) {
  (void)call;
  int cmd = 0;
  if (zt_reports_step(c, (const Ztrain__ReportStepRequest *)m, &cmd) != 0) return NULL;
  Ztrain__ReportStepReply *r = new_reply(x, &ztrain__report_step_reply__descriptor);
  r->command = (Ztrain__Command)cmd;
  return &r->base;
}

static ProtobufCMessage *h_report_failure(zt_coord_t *c, zt_rpc_call_t *call,
                                          const ProtobufCMessage *m, call_ctx *x) {
  (void)call;
  const Ztrain__ReportFailureRequest *req = (const Ztrain__ReportFailureRequest *)m;
  if (zt_reports_failure(c, req) != 0) return NULL;
  Ztrain__ReportFailureReply *r = new_reply(x, &ztrain__report_failure_reply__descriptor);
  zt_member_t *mem = zt_members_get(c, req->worker_id);
  if (mem)
    r->job_id = mem->job_id, r->generation = mem->gen, r->nccl_root = zt_rdv_nccl_root(c, mem);
  return &r->base;
}

static ProtobufCMessage *h_report_checkpoint(zt_coord_t *c, zt_rpc_call_t *call,
                                             const ProtobufCMessage *m, call_ctx *x) {
  (void)call;
  int committed = 0;
  if (zt_reports_checkpoint(c, (const Ztrain__ReportCheckpointRequest *)m, &committed) != 0)
    return NULL;
  Ztrain__ReportCheckpointReply *r = new_reply(x, &ztrain__report_checkpoint_reply__descriptor);
  r->committed = committed;
  return &r->base;
}

/* ---- Status: lists from the database --------------------------------------
 *
 * A list reply is built in two passes: the rows are collected (copied) into
 * one array, then one message per row is filled by the views (views.c),
 * pointing into the rows. Both blocks are owned by the call. */

typedef struct {
  char *rows;
  size_t n, cap, size;
} row_list;

static void *row_append(row_list *l) {
  if (l->n == l->cap) {
    l->cap = l->cap ? l->cap * 2 : 64;
    l->rows = zt_xrealloc(l->rows, l->cap * l->size);
  }
  return l->rows + l->size * l->n++;
}

#define ZT_COLLECTOR(name, type)                     \
  static int name(const type *row, void *user) {     \
    memcpy(row_append(user), row, sizeof *row);      \
    return 0;                                        \
  }
ZT_COLLECTOR(collect_event, zt_db_event_t)
ZT_COLLECTOR(collect_step, zt_db_step_t)
ZT_COLLECTOR(collect_ckpt, zt_db_ckpt_t)

/* The messages of a list reply: n messages of msg_size bytes and an array of
 * n pointers to them, in one block owned by x. */
static void **message_array(call_ctx *x, size_t n, size_t msg_size, char **msgs) {
  void **ptrs = own(x, zt_xmalloc(n * (sizeof(void *) + msg_size) + 1));
  *msgs = (char *)(ptrs + n);
  for (size_t i = 0; i < n; i++) ptrs[i] = *msgs + i * msg_size;
  return ptrs;
}

static int job_known(zt_coord_t *c, uint64_t id) {
  if (zt_jobtable_get(c, id)) return 1;
  zt_errk(ZT_E_NOT_FOUND, "unknown job %llu", (unsigned long long)id);
  return 0;
}

static ProtobufCMessage *h_list_checkpoints(zt_coord_t *c, zt_rpc_call_t *call,
                                            const ProtobufCMessage *m, call_ctx *x) {
  (void)call;
  uint64_t id = ((const Ztrain__ListCheckpointsRequest *)m)->job_id;
  row_list l = {.size = sizeof(zt_db_ckpt_t)};
  if (!job_known(c, id)) return NULL;
  int rc = zt_db_ckpts_each(c->db, id, collect_ckpt, &l);
  own(x, l.rows);
  if (rc != 0) return NULL;
  Ztrain__ListCheckpointsReply *r = new_reply(x, &ztrain__list_checkpoints_reply__descriptor);
  char *msgs;
  r->checkpoints = (Ztrain__CheckpointInfo **)message_array(x, l.n, sizeof **r->checkpoints, &msgs);
  for (r->n_checkpoints = 0; r->n_checkpoints < l.n; r->n_checkpoints++)
    zt_view_ckpt((zt_db_ckpt_t *)l.rows + r->n_checkpoints, r->checkpoints[r->n_checkpoints]);
  return &r->base;
}

static ProtobufCMessage *h_get_metrics(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                       call_ctx *x) {
  (void)call;
  const Ztrain__GetMetricsRequest *req = (const Ztrain__GetMetricsRequest *)m;
  row_list l = {.size = sizeof(zt_db_step_t)};
  if (!job_known(c, req->job_id)) return NULL;
  int64_t to = req->to_step > 0 ? req->to_step : INT64_MAX;
  int limit = req->limit == 0 ? ZT_METRICS_MAX_ROWS : (int)ZT_MIN(req->limit, (uint32_t)ZT_METRICS_MAX_ROWS);
  int rc = zt_db_steps_each(c->db, req->job_id, req->from_step, to, limit, collect_step, &l);
  own(x, l.rows);
  if (rc != 0) return NULL;
  Ztrain__GetMetricsReply *r = new_reply(x, &ztrain__get_metrics_reply__descriptor);
  char *msgs;
  r->steps = (Ztrain__StepRecord **)message_array(x, l.n, sizeof **r->steps, &msgs);
  for (r->n_steps = 0; r->n_steps < l.n; r->n_steps++)
    zt_view_step((zt_db_step_t *)l.rows + r->n_steps, r->steps[r->n_steps]);
  return &r->base;
}

static ProtobufCMessage *h_list_events(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                       call_ctx *x) {
  (void)call;
  const Ztrain__ListEventsRequest *req = (const Ztrain__ListEventsRequest *)m;
  int limit = req->limit == 0 ? 1000 : (int)ZT_MIN(req->limit, 100000u);
  row_list l = {.size = sizeof(zt_db_event_t)};
  int rc = zt_db_events_each(c->db, req->job_id, req->after_id, limit, collect_event, &l);
  own(x, l.rows);
  if (rc != 0) return NULL;
  Ztrain__ListEventsReply *r = new_reply(x, &ztrain__list_events_reply__descriptor);
  char *msgs;
  r->events = (Ztrain__Event **)message_array(x, l.n, sizeof **r->events, &msgs);
  for (r->n_events = 0; r->n_events < l.n; r->n_events++)
    zt_view_event((zt_db_event_t *)l.rows + r->n_events, r->events[r->n_events]);
  return &r->base;
}

/* ---- Status: state in memory ------------------------------------------------ */

static ProtobufCMessage *h_list_jobs(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                     call_ctx *x) {
  (void)call, (void)m;
  size_t n = 0;
  for (zt_job_t *j = c->jobs; j; j = j->next) n++;
  Ztrain__ListJobsReply *r = new_reply(x, &ztrain__list_jobs_reply__descriptor);
  char *msgs;
  r->jobs = (Ztrain__JobInfo **)message_array(x, n, sizeof **r->jobs, &msgs);
  for (zt_job_t *j = c->jobs; j; j = j->next) zt_view_job(j, r->jobs[r->n_jobs++]);
  return &r->base;
}

static ProtobufCMessage *h_get_job(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                   call_ctx *x) {
  (void)call;
  uint64_t id = ((const Ztrain__GetJobRequest *)m)->job_id;
  zt_job_t *j = zt_jobtable_get(c, id);
  if (!job_known(c, id)) return NULL;
  Ztrain__GetJobReply *r = new_reply(x, &ztrain__get_job_reply__descriptor);
  r->job = new_reply(x, &ztrain__job_info__descriptor);
  zt_view_job(j, r->job);
  return &r->base;
}

static ProtobufCMessage *h_get_status(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                      call_ctx *x) {
  (void)call, (void)m;
  Ztrain__GetStatusReply *r = new_reply(x, &ztrain__get_status_reply__descriptor);
  zt_view_status(c, r);
  return &r->base;
}

static ProtobufCMessage *h_list_workers(zt_coord_t *c, zt_rpc_call_t *call,
                                        const ProtobufCMessage *m, call_ctx *x) {
  (void)call, (void)m;
  Ztrain__ListWorkersReply *r = new_reply(x, &ztrain__list_workers_reply__descriptor);
  char *msgs;
  r->workers = (Ztrain__WorkerInfo **)message_array(x, c->n_members, sizeof **r->workers, &msgs);
  for (size_t i = 0; i < c->by_id_cap; i++)
    if (c->by_id[i]) zt_view_worker(c->by_id[i], r->workers[r->n_workers++]);
  return &r->base;
}

/* ---- Status: operator actions (need the API token) ---------------------------- */

/* The actions' replies carry a message; its buffer is owned by x. */
#define ZT_MSG_LEN 512

/* A rollback's argument (to_step, skip_steps): an integer in 0..the job's
 * steps; INVALID_ARGUMENT naming the field and the range otherwise. */
static int rollback_arg(const zt_job_t *j, const char *field, int64_t v) {
  if (v >= 0 && v <= j->row.total_steps) return 0;
  return zt_errk(ZT_E_INVALID, "%s must be an integer in 0..%lld (job %llu has %lld steps), got "
                 "%lld", field, (long long)j->row.total_steps, (unsigned long long)j->row.id,
                 (long long)j->row.total_steps, (long long)v);
}

static ProtobufCMessage *h_job_action(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                      call_ctx *x) {
  (void)call;
  const Ztrain__JobActionRequest *req = (const Ztrain__JobActionRequest *)m;
  zt_job_action_t a;
  char *msg = own(x, zt_xmalloc(ZT_MSG_LEN));
  if (zt_jobs_action_parse(req->action, &a) != 0) return NULL;
  const zt_job_t *j = zt_jobtable_get(c, req->job_id);
  if (a == ZT_ACT_ROLLBACK && j &&
      (rollback_arg(j, "to_step", req->to_step) != 0 ||
       rollback_arg(j, "skip_steps", req->skip_steps) != 0))
    return NULL;
  if (zt_jobs_action(c, req->job_id, a, req->to_step, req->skip_steps, msg, ZT_MSG_LEN) != 0)
    return NULL;
  Ztrain__JobActionReply *r = new_reply(x, &ztrain__job_action_reply__descriptor);
  r->message = msg;
  return &r->base;
}

static ProtobufCMessage *h_drain(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                 call_ctx *x) {
  (void)call;
  const char *w = ((const Ztrain__DrainRequest *)m)->worker;
  zt_member_t *mem = zt_members_lookup(c, w);
  if (!mem) {
    zt_errk(ZT_E_NOT_FOUND, "unknown worker \"%.64s\"", w);
    return NULL;
  }
  char *msg = own(x, zt_xmalloc(ZT_MSG_LEN));
  if (zt_jobs_drain(c, mem, msg, ZT_MSG_LEN) != 0) return NULL;
  Ztrain__DrainReply *r = new_reply(x, &ztrain__drain_reply__descriptor);
  r->message = msg;
  return &r->base;
}

static ProtobufCMessage *h_submit_job(zt_coord_t *c, zt_rpc_call_t *call, const ProtobufCMessage *m,
                                      call_ctx *x) {
  (void)call;
  uint64_t id = 0;
  if (zt_jobs_submit(c, ((const Ztrain__SubmitJobRequest *)m)->spec_json, &id) != 0) return NULL;
  Ztrain__SubmitJobReply *r = new_reply(x, &ztrain__submit_job_reply__descriptor);
  r->job_id = id;
  return &r->base;
}

static ProtobufCMessage *h_report_replica(zt_coord_t *c, zt_rpc_call_t *call,
                                          const ProtobufCMessage *m, call_ctx *x) {
  (void)call;
  int committed = 0;
  if (zt_reports_replica(c, (const Ztrain__ReportReplicaRequest *)m, &committed) != 0)
    return NULL;
  Ztrain__ReportReplicaReply *r = new_reply(x, &ztrain__report_replica_reply__descriptor);
  r->committed = committed;
  return &r->base;
}

/* ---- dispatch ---------------------------------------------------------- */

/* Who may call a method. */
enum {
  ANYONE,   /* reads; RegisterWorker (which checks the worker secret); HeartbeatBatch
               (which authenticates each entry) */
  WORKER,   /* a registered worker: its worker_id and session must match */
  OPERATOR, /* changes state: needs "authorization: Bearer <api_token>" */
};

typedef struct {
  const char *path;
  const ProtobufCMessageDescriptor *req_desc;
  handler_fn fn;
  int who;
} method_entry;

static const method_entry k_methods[] = {
    {"/ztrain.Control/RegisterWorker", &ztrain__register_request__descriptor, h_register, ANYONE},
    {"/ztrain.Control/Heartbeat", &ztrain__heartbeat_request__descriptor, h_heartbeat, WORKER},
    /* Each entry is authenticated by itself (h_heartbeat_batch). */
    {"/ztrain.Control/HeartbeatBatch", &ztrain__heartbeat_batch_request__descriptor,
     h_heartbeat_batch, ANYONE},
    {"/ztrain.Control/Leave", &ztrain__leave_request__descriptor, h_leave, WORKER},
    {"/ztrain.Control/Rendezvous", &ztrain__rendezvous_request__descriptor, h_rendezvous, WORKER},
    {"/ztrain.Control/ReportStep", &ztrain__report_step_request__descriptor, h_report_step, WORKER},
    {"/ztrain.Control/ReportFailure", &ztrain__report_failure_request__descriptor,
     h_report_failure, WORKER},
    {"/ztrain.Control/ReportCheckpoint", &ztrain__report_checkpoint_request__descriptor,
     h_report_checkpoint, WORKER},
    {"/ztrain.Control/ReportReplica", &ztrain__report_replica_request__descriptor,
     h_report_replica, WORKER},
    {"/ztrain.Status/ListCheckpoints", &ztrain__list_checkpoints_request__descriptor,
     h_list_checkpoints, ANYONE},
    {"/ztrain.Status/JobAction", &ztrain__job_action_request__descriptor, h_job_action, OPERATOR},
    {"/ztrain.Status/Drain", &ztrain__drain_request__descriptor, h_drain, OPERATOR},
    {"/ztrain.Status/SubmitJob", &ztrain__submit_job_request__descriptor, h_submit_job, OPERATOR},
    {"/ztrain.Status/ListJobs", &ztrain__list_jobs_request__descriptor, h_list_jobs, ANYONE},
    {"/ztrain.Status/GetJob", &ztrain__get_job_request__descriptor, h_get_job, ANYONE},
    {"/ztrain.Status/GetMetrics", &ztrain__get_metrics_request__descriptor, h_get_metrics, ANYONE},
    {"/ztrain.Status/GetStatus", &ztrain__get_status_request__descriptor, h_get_status, ANYONE},
    {"/ztrain.Status/ListWorkers", &ztrain__list_workers_request__descriptor, h_list_workers,
     ANYONE},
    {"/ztrain.Status/ListEvents", &ztrain__list_events_request__descriptor, h_list_events, ANYONE},
};

/* A worker call's credential: every Control request but RegisterWorker has
 * the fields worker_id and session. */
static int authenticate_worker(zt_coord_t *c, const ProtobufCMessage *m) {
  const ProtobufCFieldDescriptor *fid =
      protobuf_c_message_descriptor_get_field_by_name(m->descriptor, "worker_id");
  const ProtobufCFieldDescriptor *fs =
      protobuf_c_message_descriptor_get_field_by_name(m->descriptor, "session");
  if (!fid || !fs) return zt_err("%s has no worker credential fields", m->descriptor->name);
  uint64_t id = *(const uint64_t *)((const char *)m + fid->offset);
  const char *session = *(char *const *)((const char *)m + fs->offset);
  return zt_members_authenticate(c, id, session);
}

static const method_entry *find_method(const char *path) {
  for (size_t i = 0; i < ZT_ARRAY_LEN(k_methods); i++)
    if (strcmp(k_methods[i].path, path) == 0) return &k_methods[i];
  return NULL;
}

/* Packs and sends the reply, or the error the handler left. */
static void answer(zt_rpc_call_t *call, ProtobufCMessage *reply) {
  if (!reply) {
    zt_rpc_reply(call, zt_errkind_grpc(zt_err_kind()), zt_err_msg(), NULL, 0);
    return;
  }
  size_t n = protobuf_c_message_get_packed_size(reply);
  uint8_t stackbuf[512];
  uint8_t *buf = n <= sizeof stackbuf ? stackbuf : zt_xmalloc(n);
  protobuf_c_message_pack(reply, buf);
  zt_rpc_reply(call, ZT_RPC_OK, NULL, buf, n);
  if (buf != stackbuf) free(buf);
}

void zt_coord_rpc_dispatch(zt_rpc_call_t *call, const char *method, const uint8_t *req, size_t len,
                           void *user) {
  zt_coord_t *c = user;
  const method_entry *e = find_method(method);
  if (!e) {
    char msg[256];
    snprintf(msg, sizeof msg, "unknown method %.200s", method);
    zt_rpc_reply(call, ZT_RPC_UNIMPLEMENTED, msg, NULL, 0);
    return;
  }
  if (e->who == OPERATOR && !zt_auth_operator(c, zt_rpc_call_metadata(call, "authorization"))) {
    zt_rpc_reply(call, ZT_RPC_UNAUTHENTICATED, "this call needs a bearer token (zctl --token)",
                 NULL, 0);
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
  call_ctx x = {.n_owned = 0};
  zt_err_clear();
  ProtobufCMessage *reply =
      e->who == WORKER && authenticate_worker(c, in) != 0 ? NULL : e->fn(c, call, in, &x);
  protobuf_c_message_free_unpacked(in, NULL);
  if (reply != ZT_DEFERRED) answer(call, reply);
  ctx_free(&x);
}
