/*
 * zt_json.h: JSON documents from outside (job specs, zcoord's config file,
 * HTTP bodies, Hugging Face's config.json), parsed with cJSON and read
 * with typed getters that check every value (json.c).
 *
 * A reader of one JSON object first checks that every key of it is known
 * (zt_json_check_keys: an unknown key and a duplicate key are errors, since
 * cJSON would silently use the first of two), then reads each key with a
 * getter that enforces its type and range. Every error names the key's
 * full path ("checkpoint.every_steps: -3 is out of range [0, ...]"), built
 * from the parent's path and the key. A getter leaves *out untouched when
 * the key is absent and not required, so defaults set before reading stay.
 */
#ifndef ZT_JSON_H
#define ZT_JSON_H

#include <cjson/cJSON.h>
#include <stddef.h>

#include "zt_common.h"

/* The longest key path an error names. */
#define ZT_JSON_PATH_MAX 256

/* The one JSON value of text[0, len) (surrounding whitespace allowed), or
 * NULL with "<what>: not valid JSON (at byte N)" / "unexpected text after
 * the JSON value" (ZT_E_INVALID). Free with cJSON_Delete. */
cJSON *zt_json_parse(const char *text, size_t len, const char *what);

/* "parent.key", or "key" at the top level, into buf (ZT_JSON_PATH_MAX). */
const char *zt_json_path(char *buf, const char *parent, const char *key);

/* Every key of object o is one of keys[0, nkeys), and none repeats. */
ZT_MUST_CHECK int zt_json_check_keys(const cJSON *o, const char *path, const char *const *keys,
                                     size_t nkeys);
#define ZT_JSON_CHECK_KEYS(o, path, keys) \
  zt_json_check_keys((o), (path), (keys), ZT_ARRAY_LEN(keys))

/* An integer in [min, max]. */
ZT_MUST_CHECK int zt_json_long(const cJSON *o, const char *path, const char *key, int required,
                               long min, long max, long *out);
ZT_MUST_CHECK int zt_json_int(const cJSON *o, const char *path, const char *key, int required,
                              long min, long max, int *out);
/* A finite number in [min, max]; lo_open makes the lower bound exclusive. */
ZT_MUST_CHECK int zt_json_double(const cJSON *o, const char *path, const char *key, double min,
                                 int lo_open, double max, double *out);
ZT_MUST_CHECK int zt_json_float(const cJSON *o, const char *path, const char *key, double min,
                                int lo_open, double max, float *out);
/* true or false, as 1 or 0. */
ZT_MUST_CHECK int zt_json_bool(const cJSON *o, const char *path, const char *key, int *out);
/* A string shorter than outlen. */
ZT_MUST_CHECK int zt_json_string(const cJSON *o, const char *path, const char *key, int required,
                                 char *out, size_t outlen);
/* The object at key (*out NULL when absent); anything else is an error. */
ZT_MUST_CHECK int zt_json_object(const cJSON *o, const char *path, const char *key, int required,
                                 const cJSON **out);

#endif
