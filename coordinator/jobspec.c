/*
 * jobspec.c: job spec validation at submit time.
 *
 * A job spec is refused at the door when it could never run: the same
 * parser the trainer uses (worker/spec.c) checks every key, type and
 * range, and its message, naming the key, goes back to the submitter.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

#include "coord.h"
#include "spec.h"

int zt_job_spec_validate(const char *json, char *err, size_t errlen) {
  zt_spec_t spec;
  int rc = zt_spec_parse(&spec, json, strlen(json));
  if (rc != 0) snprintf(err, errlen, "%s", zt_err_msg());
  zt_spec_free(&spec);
  return rc;
}
