/*
 * err.c: the thread-local error message and kind behind zt_err() and
 * friends, and the one table that maps error kinds to gRPC and HTTP
 * status codes.
 *
 * The convention is that a failing function sets a message and returns -1;
 * callers up the stack may prefix context with zt_err_wrap(). See
 * zt_common.h for the rationale.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "zt_common.h"

static _Thread_local char t_msg[ZT_ERR_MAX];
static _Thread_local zt_errkind_t t_kind;

/* Formats into a copy first: an argument may be zt_err_msg() itself. */
static void set_msg(zt_errkind_t kind, const char *fmt, va_list ap) {
  char msg[ZT_ERR_MAX];
  vsnprintf(msg, sizeof msg, fmt, ap);
  memcpy(t_msg, msg, sizeof t_msg);
  t_kind = kind;
}

int zt_err(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_msg(ZT_E_FAILED, fmt, ap);
  va_end(ap);
  return -1;
}

int zt_errk(zt_errkind_t kind, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_msg(kind, fmt, ap);
  va_end(ap);
  return -1;
}

/* Room kept in the error for a prefix and the count of faults left out. */
#define ZT_FAULTS_ROOM 300

void zt_faults_add(zt_faults_t *f, const char *fmt, ...) {
  char m[ZT_ERR_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  f->count++;
  size_t len = strlen(m);
  if (f->n + len + 2 >= sizeof f->msg - ZT_FAULTS_ROOM) return;
  f->n += (size_t)snprintf(f->msg + f->n, sizeof f->msg - f->n, "%s%s", f->n ? "; " : "", m);
  f->shown++;
}

int zt_faults_raise(const zt_faults_t *f, zt_errkind_t kind, const char *prefix) {
  if (!f->count) return 0;
  char more[48] = "";
  if (f->count > f->shown) snprintf(more, sizeof more, "; and %d more", f->count - f->shown);
  return zt_errk(kind, "%.200s%s%s%s", prefix ? prefix : "", prefix ? ": " : "", f->msg, more);
}

static void wrap(const char *fmt, va_list ap) {
  char ctx[ZT_ERR_MAX], old[ZT_ERR_MAX];
  vsnprintf(ctx, sizeof ctx, fmt, ap);
  memcpy(old, t_msg, sizeof old);
  snprintf(t_msg, sizeof t_msg, "%.400s: %.600s", ctx, old);
}

int zt_err_wrap(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  wrap(fmt, ap);
  va_end(ap);
  return -1;
}

int zt_err_wrapk(zt_errkind_t kind, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  wrap(fmt, ap);
  va_end(ap);
  t_kind = kind;
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
  t_kind = ZT_E_FAILED;
  return -1;
}

const char *zt_err_msg(void) { return t_msg[0] ? t_msg : "unknown error"; }
zt_errkind_t zt_err_kind(void) { return t_kind; }

void zt_err_clear(void) {
  t_msg[0] = 0;
  t_kind = ZT_E_FAILED;
}

/* gRPC status numbers are those of grpc_status_code (common/zt_rpc.h
 * names them); HTTP statuses are the API's (docs/architecture.md). */
static const struct {
  int grpc, http;
} k_codes[ZT_E_COUNT] = {
    [ZT_E_FAILED] = {13 /* INTERNAL */, 500},
    [ZT_E_INVALID] = {3 /* INVALID_ARGUMENT */, 400},
    [ZT_E_NOT_FOUND] = {5 /* NOT_FOUND */, 404},
    [ZT_E_STATE] = {9 /* FAILED_PRECONDITION */, 409},
    [ZT_E_UNAUTHENTICATED] = {16 /* UNAUTHENTICATED */, 401},
    [ZT_E_UNAVAILABLE] = {14 /* UNAVAILABLE */, 503},
    [ZT_E_TOO_LARGE] = {8 /* RESOURCE_EXHAUSTED */, 413},
    [ZT_E_ABORTED] = {10 /* ABORTED */, 409},
    [ZT_E_EXISTS] = {6 /* ALREADY_EXISTS */, 409},
    [ZT_E_NO_MEMORY] = {8 /* RESOURCE_EXHAUSTED */, 507},
};

int zt_errkind_grpc(zt_errkind_t kind) {
  return kind >= 0 && kind < ZT_E_COUNT ? k_codes[kind].grpc : k_codes[ZT_E_FAILED].grpc;
}

int zt_errkind_http(zt_errkind_t kind) {
  return kind >= 0 && kind < ZT_E_COUNT ? k_codes[kind].http : k_codes[ZT_E_FAILED].http;
}
