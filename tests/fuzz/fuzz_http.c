/*
 * fuzz_http.c: zcoord's HTTP routes (http.c), with a real coordinator
 * behind them, as in-process requests.
 *
 * Input: "METHOD URL[?QUERY]\n" then the body; a URL ending in "!" is sent
 * with the operator token. Property: no crash, no sanitizer report, no
 * leak, and every request is answered with a status from 200 to 599 and a
 * body (JSON for everything but the dashboard's files).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_fail.h"
#include "fuzz_coord.h"
#include "http.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const uint8_t *nl = memchr(data, '\n', size);
  if (!nl) return 0;
  char line[512];
  size_t ll = (size_t)(nl - data);
  if (ll >= sizeof line || memchr(data, 0, ll)) return 0;
  memcpy(line, data, ll);
  line[ll] = 0;
  char *url = strchr(line, ' ');
  if (!url) return 0;
  *url++ = 0;
  size_t ul = strlen(url);
  int token = ul && url[ul - 1] == '!';
  if (token) url[--ul] = 0;
  char *query = strchr(url, '?');
  if (query) *query++ = 0;
  size_t blen = size - ll - 1;
  char *body = zt_xmalloc(blen + 1); /* the server's bodies are NUL-terminated */
  memcpy(body, nl + 1, blen);
  body[blen] = 0;
  zt_http_req_t r = {.c = zt_fuzz_coord(), .query = query,
                     .authorization = token ? "Bearer " ZT_FUZZ_TOKEN : NULL, .method = line,
                     .url = url, .body = blen ? body : NULL, .body_len = blen};
  zt__http_route(&r);
  if (r.status < 200 || r.status > 599 || (r.resp_len && !r.resp)) ZT_FUZZ_FAIL();
  free(r.resp);
  free(body);
  zt_fuzz_coord_done();
  return 0;
}
