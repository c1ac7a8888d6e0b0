/*
 * pbjson.c: see pbjson.h.
 */
#include "pbjson.h"

#include "zt_common.h"

cJSON *zt_pbjson_job(const Ztrain__JobInfo *j) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "id", (double)j->id);
  cJSON_AddStringToObject(o, "name", j->name);
  cJSON_AddStringToObject(o, "state", zt_name_job_state(j->state));
  cJSON_AddNumberToObject(o, "generation", (double)j->generation);
  cJSON_AddNumberToObject(o, "world", j->world);
  cJSON_AddNumberToObject(o, "step", (double)j->step);
  cJSON_AddNumberToObject(o, "total_steps", (double)j->total_steps);
  cJSON_AddNumberToObject(o, "checkpoint_step", (double)j->checkpoint_step);
  cJSON_AddNumberToObject(o, "loss", j->loss);
  cJSON_AddNumberToObject(o, "lr", j->lr);
  cJSON_AddNumberToObject(o, "grad_norm", j->grad_norm);
  cJSON_AddNumberToObject(o, "tokens_per_s", j->tokens_per_s);
  cJSON_AddNumberToObject(o, "restarts", j->restarts);
  cJSON_AddNumberToObject(o, "min_workers", j->min_workers);
  cJSON_AddNumberToObject(o, "max_workers", j->max_workers);
  cJSON_AddStringToObject(o, "message", j->message);
  cJSON_AddBoolToObject(o, "resumes_by_itself", j->resumes_by_itself);
  cJSON_AddNumberToObject(o, "created_ms", (double)j->created_ms);
  cJSON_AddNumberToObject(o, "updated_ms", (double)j->updated_ms);
  return o;
}

cJSON *zt_pbjson_step(const Ztrain__StepRecord *s) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "step", (double)s->step);
  cJSON_AddNumberToObject(o, "generation", (double)s->generation);
  cJSON_AddNumberToObject(o, "loss", s->loss);
  cJSON_AddNumberToObject(o, "grad_norm", s->grad_norm);
  cJSON_AddNumberToObject(o, "lr", s->lr);
  cJSON_AddNumberToObject(o, "tokens_per_s", s->tokens_per_s);
  if (s->val_loss == s->val_loss) cJSON_AddNumberToObject(o, "val_loss", s->val_loss);
  else cJSON_AddNullToObject(o, "val_loss");
  cJSON_AddNumberToObject(o, "t_ms", (double)s->t_ms);
  return o;
}

cJSON *zt_pbjson_checkpoint(const Ztrain__CheckpointInfo *k) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "step", (double)k->step);
  cJSON_AddNumberToObject(o, "generation", (double)k->generation);
  cJSON_AddStringToObject(o, "state", k->state);
  cJSON_AddNumberToObject(o, "world", k->world);
  cJSON_AddNumberToObject(o, "bytes", (double)k->bytes);
  cJSON_AddStringToObject(o, "dir", k->dir);
  cJSON_AddNumberToObject(o, "t_ms", (double)k->t_ms);
  return o;
}

cJSON *zt_pbjson_worker(const Ztrain__WorkerInfo *w) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "id", (double)w->id);
  cJSON_AddStringToObject(o, "name", w->name);
  cJSON_AddStringToObject(o, "host", w->host);
  cJSON_AddStringToObject(o, "device", w->device);
  cJSON_AddStringToObject(o, "state", zt_name_worker_state(w->state));
  cJSON_AddNumberToObject(o, "last_seen_ms", (double)w->last_seen_ms);
  cJSON_AddNumberToObject(o, "registered_ms", (double)w->registered_ms);
  cJSON_AddNumberToObject(o, "pid", w->pid);
  cJSON_AddNumberToObject(o, "host_memory_bytes", (double)w->host_memory_bytes);
  cJSON_AddNumberToObject(o, "device_memory_bytes", (double)w->device_memory_bytes);
  cJSON_AddNumberToObject(o, "step_ms", w->step_ms);
  cJSON_AddNumberToObject(o, "comm_ms", w->comm_ms);
  cJSON_AddNumberToObject(o, "send_wait_ms", w->send_wait_ms);
  cJSON_AddNumberToObject(o, "link_rtt_ms", w->link_rtt_ms);
  cJSON_AddBoolToObject(o, "quarantined", w->quarantined);
  return o;
}

cJSON *zt_pbjson_event(const Ztrain__Event *e) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "id", (double)e->id);
  cJSON_AddNumberToObject(o, "t_ms", (double)e->t_ms);
  cJSON_AddNumberToObject(o, "job_id", (double)e->job_id);
  cJSON_AddStringToObject(o, "kind", e->kind);
  cJSON_AddNumberToObject(o, "worker_id", (double)e->worker_id);
  cJSON_AddStringToObject(o, "detail", e->detail);
  cJSON_AddNumberToObject(o, "count", (double)(e->count > 0 ? e->count : 1));
  if (e->count > 1) {
    cJSON_AddNumberToObject(o, "last_ms", (double)e->last_ms);
    cJSON_AddStringToObject(o, "last_detail", e->last_detail);
  }
  return o;
}

cJSON *zt_pbjson_status(const Ztrain__GetStatusReply *r) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "version", r->version);
  cJSON_AddNumberToObject(o, "started_ms", (double)r->started_ms);
  cJSON_AddNumberToObject(o, "coordinator_epoch", (double)r->coordinator_epoch);
  cJSON_AddNumberToObject(o, "heartbeat_ms", r->heartbeat_ms);
  cJSON_AddNumberToObject(o, "heartbeat_timeout_ms", r->heartbeat_timeout_ms);
  cJSON *w = cJSON_AddObjectToObject(o, "workers");
  cJSON_AddNumberToObject(w, "alive", r->workers_alive);
  cJSON_AddNumberToObject(w, "suspect", r->workers_suspect);
  cJSON_AddNumberToObject(w, "lost", r->workers_lost);
  cJSON_AddNumberToObject(w, "left", r->workers_left);
  cJSON_AddStringToObject(o, "db", r->db_path);
  return o;
}
