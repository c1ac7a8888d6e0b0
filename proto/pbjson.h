/*
 * pbjson.h: the JSON form of the Status service's messages.
 *
 * zctl --json and zcoord's HTTP API print the same objects with the same
 * field names; both build them here from the protobuf messages.
 */
#ifndef ZT_PBJSON_H
#define ZT_PBJSON_H

#include <cjson/cJSON.h>

#include "ztrain.pb-c.h"

cJSON *zt_pbjson_job(const Ztrain__JobInfo *j);
cJSON *zt_pbjson_step(const Ztrain__StepRecord *s);
cJSON *zt_pbjson_checkpoint(const Ztrain__CheckpointInfo *k);
cJSON *zt_pbjson_worker(const Ztrain__WorkerInfo *w);
cJSON *zt_pbjson_event(const Ztrain__Event *e);
cJSON *zt_pbjson_status(const Ztrain__GetStatusReply *s);

#endif
