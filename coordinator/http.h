/*
 * http.h: what an HTTP route function sees (coordinator/http.c).
 *
 * A route runs on the loop thread with a zt_http_req_t describing the request
 * and fills in the response with zt_http_json() or zt_http_error().
 */
#ifndef ZT_COORD_HTTP_H
#define ZT_COORD_HTTP_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

struct MHD_Connection;
struct zt_coord;

typedef struct {
  struct zt_coord *c;
  /* The connection (query arguments and headers come from it), or NULL for
   * a request made in-process (the fuzz target), which gives them here. */
  struct MHD_Connection *conn;
  const char *query;         /* without conn: "a=1&b=2" (no %-decoding) */
  const char *authorization; /* without conn: the Authorization header */
  char qbuf[256];            /* without conn: the value zt_http_query returned */
  const char *method, *url;
  const char *body; /* NUL-terminated request body, or NULL */
  size_t body_len;
  /* response */
  int status;
  const char *ctype;
  const char *allow; /* Allow header of a 405 */
  char *resp;        /* malloc'd */
  size_t resp_len;
} zt_http_req_t;

/* Sets a JSON response and frees `doc`. */
void zt_http_json(zt_http_req_t *r, int status, cJSON *doc);
/* Sets {"error": "..."} with the given status. */
void zt_http_error(zt_http_req_t *r, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
const char *zt_http_query(zt_http_req_t *r, const char *key);
/* Parses an integer query parameter; on a bad value sets a 400 and returns -1. */
int zt_http_query_i64(zt_http_req_t *r, const char *key, int64_t def, int64_t *out);

/* Routes a complete request and fills in the response; on the loop thread
 * (http.c calls it through zt_loopcall_run; the fuzz target directly). */
void zt__http_route(zt_http_req_t *r);

#endif
