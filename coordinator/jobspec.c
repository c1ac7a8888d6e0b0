/*
 * jobspec.c: job spec validation at submit time.
 *
 * A job spec is refused at the door when it could never run: it must be a
 * JSON object whose top-level keys are all known. (The trainer validates
 * every nested key, type and range when a worker loads the spec; a spec
 * the trainer refuses fails the job with the trainer's message.)
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

#include "coord.h"

static const char *const k_top_keys[] = {
    "name", "seed", "steps", "model", "data", "optimizer", "scheduler",
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
    "gradient_clipping", "eval", "zero_optimization", "elastic", "checkpoint", "rollback", "bf16",
    "comm", "fault_injection",
};

int zt_job_spec_validate(const char *json, char *err, size_t errlen) {
  cJSON *doc = cJSON_Parse(json);
  if (!doc || !cJSON_IsObject(doc)) {
    cJSON_Delete(doc);
    snprintf(err, errlen, "job spec is not a JSON object");
    return -1;
  }
  int ret = 0;
  for (cJSON *it = doc->child; it && !ret; it = it->next) {
    int known = 0;
    for (size_t i = 0; i < ZT_ARRAY_LEN(k_top_keys); i++) known |= !strcmp(it->string, k_top_keys[i]);
    if (!known) {
      snprintf(err, errlen, "%.100s: unknown key", it->string);
      ret = -1;
    }
  }
  cJSON_Delete(doc);
  return ret;
}
