/*
 * views.c: what the Status service and the HTTP API show.
 *
 * Both front ends describe workers, jobs, steps, events and checkpoints with
 * the protobuf messages of ztrain.proto: the gRPC service packs them, the
 * HTTP API turns them into JSON with proto/pbjson.c (so zctl --json and the
 * HTTP API print the same fields). This file is the one place that fills
 * those messages from the coordinator's state and from database rows. The
 * messages point into their sources (no copies), so a source must outlive
 * the message built from it.
 */
#include "coord.h"

#include <string.h>

#include "ztrain.pb-c.h"

void zt_view_worker(const zt_member_t *m, Ztrain__WorkerInfo *w) {
  ztrain__worker_info__init(w);
  w->id = m->row.id;
  w->name = (char *)m->row.name;
  w->host = (char *)m->row.host;
  w->device = (char *)m->row.device;
  w->state = (Ztrain__WorkerState)m->row.state;
  w->last_seen_ms = m->row.last_seen_ms;
  w->registered_ms = m->row.registered_ms;
  w->pid = m->row.pid;
  w->host_memory_bytes = m->row.host_memory;
  w->device_memory_bytes = m->row.device_memory;
  w->step_ms = m->step_ms;
  w->comm_ms = m->comm_ms;
  w->send_wait_ms = m->send_wait_ms;
  w->link_rtt_ms = m->link_rtt_ms;
  w->quarantined = m->quarantine_ms != 0;
}

void zt_view_job(const zt_job_t *j, Ztrain__JobInfo *ji) {
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
  ji->checkpoint_step = j->committed_step;
  ji->tokens_per_s = j->last.tokens_per_s;
  ji->message = (char *)j->row.message;
  ji->created_ms = j->row.created_ms;
  ji->updated_ms = j->row.updated_ms;
  ji->restarts = (uint32_t)j->row.restarts;
  ji->min_workers = (uint32_t)j->row.min_workers;
  ji->max_workers = (uint32_t)j->row.max_workers;
  ji->resumes_by_itself = zt_view_resumes_by_itself(j);
}

int zt_view_paused_for(const zt_job_t *j, const char *mark) {
  return j->row.state == ZT_JOB_PAUSED && !j->spec_error[0] &&
         !strncmp(j->row.message, mark, strlen(mark));
}

int zt_view_resumes_by_itself(const zt_job_t *j) {
  return zt_view_paused_for(j, ZT_UNLOADABLE_PAUSE) ||
         (zt_view_paused_for(j, ZT_STORAGE_PAUSE) && j->storage_retries < ZT_STORAGE_RETRIES);
}

void zt_view_step(const zt_db_step_t *s, Ztrain__StepRecord *x) {
  ztrain__step_record__init(x);
  x->step = s->step;
  x->generation = s->generation;
  x->loss = s->loss;
  x->grad_norm = s->grad_norm;
  x->lr = s->lr;
  x->tokens_per_s = s->tokens_per_s;
  x->val_loss = s->val_loss;
  x->t_ms = s->t_ms;
}

void zt_view_event(const zt_db_event_t *e, Ztrain__Event *x) {
  ztrain__event__init(x);
  x->id = e->id;
  x->t_ms = e->t_ms;
  x->job_id = e->job_id;
  x->worker_id = e->worker_id;
  x->kind = (char *)e->kind;
  x->detail = (char *)e->detail;
  x->count = e->count;
  x->last_ms = e->last_ms;
  x->last_detail = (char *)e->last_detail;
}

void zt_view_ckpt(const zt_db_ckpt_t *k, Ztrain__CheckpointInfo *x) {
  ztrain__checkpoint_info__init(x);
  x->step = k->step;
  x->generation = k->generation;
  x->world = (uint32_t)k->world;
  x->state = (char *)zt_name_ckpt_state(k->state);
  x->dir = (char *)k->dir;
  x->bytes = k->bytes;
  x->t_ms = k->t_ms;
}

void zt_view_status(zt_coord_t *c, Ztrain__GetStatusReply *r) {
  ztrain__get_status_reply__init(r);
  uint32_t counts[5];
  zt_members_count(c, counts);
  r->version = (char *)zt_version_string();
  r->started_ms = c->started_ms;
  r->heartbeat_ms = (uint32_t)zt_members_interval_ms(c); /* as advertised now */
  r->heartbeat_timeout_ms = (uint32_t)zt_members_timeout_ms(c);
  r->workers_alive = counts[ZT_WORKER_ALIVE];
  r->workers_suspect = counts[ZT_WORKER_SUSPECT];
  r->workers_lost = counts[ZT_WORKER_LOST];
  r->workers_left = counts[ZT_WORKER_LEFT];
  r->coordinator_epoch = (uint64_t)c->epoch;
  r->db_path = (char *)zt_db_path(c->db);
}
