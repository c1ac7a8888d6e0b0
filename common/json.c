/*
 * json.c: JSON from outside, parsed and read with checks (see zt_json.h).
 *
 * The job spec (engine/spec.c), zcoord's config file and HTTP bodies
 * (coordinator/) and Hugging Face's config.json all come through here, so
 * an error reads the same wherever a value came from: the key's full path,
 * then what is wrong with it.
 */
#include "zt_json.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

cJSON *zt_json_parse(const char *text, size_t len, const char *what) {
  const char *end = NULL;
  cJSON *doc = len ? cJSON_ParseWithLengthOpts(text, len, &end, 0) : NULL;
  if (!doc) {
    const char *at = cJSON_GetErrorPtr();
    zt_errk(ZT_E_INVALID, "%s: not valid JSON (at byte %zu)", what,
            at && at >= text && at <= text + len ? (size_t)(at - text) : (size_t)0);
    return NULL;
  }
  size_t used = (size_t)(end - text);
  while (used < len && (text[used] == ' ' || text[used] == '\n' || text[used] == '\r' ||
                        text[used] == '\t'))
    used++;
  if (used < len) {
    cJSON_Delete(doc);
    zt_errk(ZT_E_INVALID, "%s: unexpected text after the JSON value (at byte %zu)", what, used);
    return NULL;
  }
  return doc;
}

const char *zt_json_path(char *buf, const char *parent, const char *key) {
  if (parent[0]) snprintf(buf, ZT_JSON_PATH_MAX, "%s.%s", parent, key);
  else snprintf(buf, ZT_JSON_PATH_MAX, "%s", key);
  return buf;
}

int zt_json_check_keys(const cJSON *o, const char *path, const char *const *keys, size_t nkeys) {
  char p[ZT_JSON_PATH_MAX];
  for (const cJSON *it = o->child; it; it = it->next) {
    size_t i = 0;
    while (i < nkeys && strcmp(it->string, keys[i]) != 0) i++;
    if (i == nkeys) return zt_err("%s: unknown key", zt_json_path(p, path, it->string));
    for (const cJSON *prev = o->child; prev != it; prev = prev->next)
      if (strcmp(prev->string, it->string) == 0)
        return zt_err("%s: duplicate key", zt_json_path(p, path, it->string));
  }
  return 0;
}

int zt_json_long(const cJSON *o, const char *path, const char *key, int required, long min,
                 long max, long *out) {
  char p[ZT_JSON_PATH_MAX];
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
  zt_json_path(p, path, key);
  if (!it) return required ? zt_err("%s: required key is missing", p) : 0;
  if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) ||
      fabs(it->valuedouble) > 9007199254740992.0)
    return zt_err("%s: expected an integer", p);
  if (it->valuedouble < (double)min || it->valuedouble > (double)max)
    return zt_err("%s: %.0f is out of range [%ld, %ld]", p, it->valuedouble, min, max);
  *out = (long)it->valuedouble;
  return 0;
}

int zt_json_int(const cJSON *o, const char *path, const char *key, int required, long min,
                long max, int *out) {
  long v = *out;
  if (zt_json_long(o, path, key, required, min, max, &v) != 0) return -1;
  *out = (int)v;
  return 0;
}

int zt_json_double(const cJSON *o, const char *path, const char *key, double min, int lo_open,
                   double max, double *out) {
  char p[ZT_JSON_PATH_MAX];
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!it) return 0;
  zt_json_path(p, path, key);
  if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble)) return zt_err("%s: expected a number", p);
  double v = it->valuedouble;
  if (v < min || (lo_open && v == min) || v > max)
    return zt_err("%s: %g is out of range %c%g, %g]", p, v, lo_open ? '(' : '[', min, max);
  *out = v;
  return 0;
}

int zt_json_float(const cJSON *o, const char *path, const char *key, double min, int lo_open,
                  double max, float *out) {
  double v = *out;
  if (zt_json_double(o, path, key, min, lo_open, max, &v) != 0) return -1;
  *out = (float)v;
  return 0;
}

int zt_json_bool(const cJSON *o, const char *path, const char *key, int *out) {
  char p[ZT_JSON_PATH_MAX];
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!it) return 0;
  if (!cJSON_IsBool(it)) return zt_err("%s: expected true or false", zt_json_path(p, path, key));
  *out = cJSON_IsTrue(it);
  return 0;
}

int zt_json_string(const cJSON *o, const char *path, const char *key, int required, char *out,
                   size_t outlen) {
  char p[ZT_JSON_PATH_MAX];
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
  zt_json_path(p, path, key);
  if (!it) return required ? zt_err("%s: required key is missing", p) : 0;
  if (!cJSON_IsString(it)) return zt_err("%s: expected a string", p);
  if (strlen(it->valuestring) >= outlen)
    return zt_err("%s: longer than %zu characters", p, outlen - 1);
  snprintf(out, outlen, "%s", it->valuestring);
  return 0;
}

int zt_json_object(const cJSON *o, const char *path, const char *key, int required,
                   const cJSON **out) {
  char p[ZT_JSON_PATH_MAX];
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
  *out = NULL;
  zt_json_path(p, path, key);
  if (!it) return required ? zt_err("%s: required key is missing", p) : 0;
  if (!cJSON_IsObject(it)) return zt_err("%s: expected an object", p);
  *out = it;
  return 0;
}
