/*
 * jobspec.c: job spec validation at submit time.
 *
 * A job spec is refused at the door when it could never run: the same
 * parser the trainer uses (worker/jspec.c) checks every key, type and
 * range, and its message, naming the key, goes back to the submitter.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

#include "coord.h"
#include "jspec.h"

int zt_job_spec_validate(const char *json, char *err, size_t errlen) {
  zt_jspec spec;
  if (zt_jspec_parse(json, &spec) == 0) return 0;
  snprintf(err, errlen, "%s", zt_err_msg());
  return -1;
}
