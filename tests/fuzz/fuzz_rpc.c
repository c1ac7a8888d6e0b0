/*
 * fuzz_rpc.c: every gRPC request handler of zcoord, through the real
 * dispatcher (service.c), with a real coordinator behind it.
 *
 * Input: byte 0 picks the method, byte 1 holds flags, the rest is the
 * request body. Flag 1 sends the operator token; flag 2 (Control methods)
 * first decodes the body and, when it decodes, writes the registered
 * worker's id and session into it, so the fuzzer gets past authentication
 * into the handlers themselves; without it the dispatcher's checks are
 * what is fuzzed. Bodies that do not decode go in as they are.
 *
 * Property: no crash, no sanitizer report, no leak, and every call is
 * answered (or held, for a rendezvous) with a status.
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_fail.h"
#include "fuzz_coord.h"
#include "ztrain.pb-c.h"

typedef struct {
  const char *path;
  const ProtobufCMessageDescriptor *desc;
} method;

static const method k_methods[] = {
    {"/ztrain.Control/RegisterWorker", &ztrain__register_request__descriptor},
    {"/ztrain.Control/Heartbeat", &ztrain__heartbeat_request__descriptor},
    {"/ztrain.Control/Leave", &ztrain__leave_request__descriptor},
    {"/ztrain.Control/Rendezvous", &ztrain__rendezvous_request__descriptor},
    {"/ztrain.Control/ReportStep", &ztrain__report_step_request__descriptor},
    {"/ztrain.Control/ReportFailure", &ztrain__report_failure_request__descriptor},
    {"/ztrain.Control/ReportCheckpoint", &ztrain__report_checkpoint_request__descriptor},
    {"/ztrain.Status/ListCheckpoints", &ztrain__list_checkpoints_request__descriptor},
    {"/ztrain.Status/JobAction", &ztrain__job_action_request__descriptor},
    {"/ztrain.Status/Drain", &ztrain__drain_request__descriptor},
    {"/ztrain.Status/SubmitJob", &ztrain__submit_job_request__descriptor},
    {"/ztrain.Status/ListJobs", &ztrain__list_jobs_request__descriptor},
    {"/ztrain.Status/GetJob", &ztrain__get_job_request__descriptor},
    {"/ztrain.Status/GetMetrics", &ztrain__get_metrics_request__descriptor},
    {"/ztrain.Status/GetStatus", &ztrain__get_status_request__descriptor},
    {"/ztrain.Status/ListWorkers", &ztrain__list_workers_request__descriptor},
    {"/ztrain.Status/ListEvents", &ztrain__list_events_request__descriptor},
    {"/ztrain.Control/ReportReplica", &ztrain__report_replica_request__descriptor},
    {"/ztrain.Control/HeartbeatBatch", &ztrain__heartbeat_batch_request__descriptor},
    {"/ztrain.Status/NoSuchMethod", NULL},
};

/* The body with the registered worker's credential written in; NULL when
 * it does not decode or has no credential fields. */
static uint8_t *with_credential(const method *m, const uint8_t *body, size_t len, size_t *out) {
  if (!m->desc) return NULL;
  const ProtobufCFieldDescriptor *fid =
      protobuf_c_message_descriptor_get_field_by_name(m->desc, "worker_id");
  const ProtobufCFieldDescriptor *fs =
      protobuf_c_message_descriptor_get_field_by_name(m->desc, "session");
  if (!fid || !fs || fid->type != PROTOBUF_C_TYPE_UINT64) return NULL;
  ProtobufCMessage *msg = protobuf_c_message_unpack(m->desc, NULL, len, body);
  if (!msg) return NULL;
  char **session = (char **)((char *)msg + fs->offset);
  char *old = *session;
  *(uint64_t *)((char *)msg + fid->offset) = zt_fuzz_worker_id();
  *session = (char *)zt_fuzz_session();
  *out = protobuf_c_message_get_packed_size(msg);
  uint8_t *buf = zt_xmalloc(*out + 1);
  protobuf_c_message_pack(msg, buf);
  *session = old; /* freed with the message */
  protobuf_c_message_free_unpacked(msg, NULL);
  return buf;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2) return 0;
  const method *m = &k_methods[data[0] % ZT_ARRAY_LEN(k_methods)];
  int flags = data[1];
  const uint8_t *body = data + 2;
  size_t len = size - 2, plen = 0;
  uint8_t *patched = flags & 2 ? with_credential(m, body, len, &plen) : NULL;
  uint8_t *resp = NULL;
  size_t rl = 0;
  int status = zt_fuzz_rpc(m->path, patched ? patched : body, patched ? plen : len, flags & 1,
                           &resp, &rl);
  if (status < -1 || status > 16) ZT_FUZZ_FAIL(); /* every call ends with a gRPC status */
  free(resp);
  free(patched);
  zt_fuzz_coord_done();
  return 0;
}
