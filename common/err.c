/*
 * err.c: the thread-local error message behind zt_err() and friends.
 *
 * The convention is that a failing function sets a message and returns -1;
 * callers up the stack may prefix context with zt_err_wrap(). See
 * zt_common.h for the rationale.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "zt_common.h"

static _Thread_local char t_msg[ZT_ERR_MAX];

int zt_err(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t_msg, sizeof t_msg, fmt, ap);
  va_end(ap);
  return -1;
}

int zt_err_wrap(const char *fmt, ...) {
  char ctx[ZT_ERR_MAX], old[ZT_ERR_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ctx, sizeof ctx, fmt, ap);
  va_end(ap);
  memcpy(old, t_msg, sizeof old);
  snprintf(t_msg, sizeof t_msg, "%.400s: %.600s", ctx, old);
  return -1;
}

int zt_err_errno(const char *fmt, ...) {
  int e = errno;
  char ctx[ZT_ERR_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ctx, sizeof ctx, fmt, ap);
  va_end(ap);
  snprintf(t_msg, sizeof t_msg, "%.800s: %.200s", ctx, strerror(e));
  return -1;
}

const char *zt_err_msg(void) { return t_msg[0] ? t_msg : "unknown error"; }
void zt_err_clear(void) { t_msg[0] = 0; }
