/*
 * auth.c: the coordinator's credential checks.
 *
 * Operators present the API token as "Bearer <token>" (gRPC metadata
 * "authorization" or the HTTP Authorization header) on every call that
 * changes state; workers present the shared worker secret when they
 * register. Both comparisons take time that depends only on the lengths,
 * so timing says nothing about how much of a guess was right. With nothing
 * configured every caller is accepted (the default bind is 127.0.0.1).
 */
#include <string.h>

#include "coord.h"

int zt_auth_operator(const zt_coord_t *c, const char *authorization) {
  if (!c->cfg.api_token[0]) return 1;
  if (!authorization || strncmp(authorization, "Bearer ", 7) != 0) return 0;
  return zt_secret_equal(authorization + 7, c->cfg.api_token);
}

int zt_auth_worker_secret(const zt_coord_t *c, const char *secret) {
  if (!c->cfg.worker_secret[0]) return 1;
  return secret && zt_secret_equal(secret, c->cfg.worker_secret);
}
