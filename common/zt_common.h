/*
 * zt_common.h: the small shared vocabulary of every ztrain binary.
 *
 * Logging, error reporting, time and deadlines. Everything in ztrain that can
 * fail returns an int (0 on success, -1 on failure) and leaves a human
 * readable reason in a thread-local buffer, read with zt_err_msg(). A caller
 * that adds context wraps the message with zt_err_wrap(), so the final text
 * names the whole path: "load checkpoint: ckpt/step_30/r0.bin: checksum
 * mismatch". Nothing here allocates on the error path.
 */
#ifndef ZT_COMMON_H
#define ZT_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* ---- logging ---------------------------------------------------------- */

typedef enum { ZT_LOG_DEBUG = 0, ZT_LOG_INFO, ZT_LOG_WARN, ZT_LOG_ERROR } zt_log_level_t;

void zt_log_set_level(zt_log_level_t level);
/* Accepts "debug", "info", "warn", "error"; returns -1 on an unknown name. */
int zt_log_set_level_name(const char *name);
void zt_log_set_prefix(const char *prefix); /* e.g. "zcoord" or "zworker[w1]" */
void zt_log(zt_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define ZT_DEBUG(...) zt_log(ZT_LOG_DEBUG, __VA_ARGS__)
#define ZT_INFO(...) zt_log(ZT_LOG_INFO, __VA_ARGS__)
#define ZT_WARN(...) zt_log(ZT_LOG_WARN, __VA_ARGS__)
#define ZT_ERROR(...) zt_log(ZT_LOG_ERROR, __VA_ARGS__)

/* ---- errors ----------------------------------------------------------- */

#define ZT_ERR_MAX 1024

/* Sets the thread's error message; always returns -1 so `return zt_err(...)`. */
int zt_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Prefixes the current message with context: "<ctx>: <old message>". */
int zt_err_wrap(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Sets the message from errno: "<ctx>: strerror(errno)". */
int zt_err_errno(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
const char *zt_err_msg(void);
void zt_err_clear(void);

/* ---- time ------------------------------------------------------------- */

int64_t zt_now_ms(void);      /* monotonic milliseconds */
int64_t zt_now_us(void);      /* monotonic microseconds */
int64_t zt_wall_ms(void);     /* wall clock, milliseconds since the epoch */
void zt_sleep_ms(int64_t ms); /* for pacing loops only, never for synchronisation */

/* A deadline is an absolute monotonic time in ms; 0 means "none". */
typedef int64_t zt_deadline_t;
static inline zt_deadline_t zt_deadline_in(int64_t ms) { return ms <= 0 ? 0 : zt_now_ms() + ms; }
int64_t zt_deadline_left_ms(zt_deadline_t d); /* INT64_MAX when none, >= 0 otherwise */
static inline int zt_deadline_passed(zt_deadline_t d) { return d != 0 && zt_deadline_left_ms(d) == 0; }

/* ---- misc ------------------------------------------------------------- */

/* Parses "host:port" into its parts; port must be 1..65535. */
int zt_parse_hostport(const char *s, char *host, size_t hostlen, int *port);
/* Writes a whole buffer / reads a whole file; -1 with a message on failure. */
int zt_write_all(int fd, const void *buf, size_t len);
int zt_read_file(const char *path, char **out, size_t *outlen, size_t maxlen);
/* Creates a directory and its parents (mkdir -p). */
int zt_mkdirs(const char *path);

/* Names of the states of workers (zt_db.h zt_worker_state_t, proto
 * WorkerState), jobs (zt_job_state_t, JobState) and checkpoint epochs
 * (zt_ckpt_state_t): "alive", "running", "committed", ...; "unknown" for a
 * number outside the enum. One table each, shared by the database, the
 * HTTP/JSON API and zctl. */
const char *zt_worker_state_name(int state);
const char *zt_job_state_name(int state);
const char *zt_ckpt_state_name(int state);

#define ZT_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define ZT_MIN(a, b) ((a) < (b) ? (a) : (b))
#define ZT_MAX(a, b) ((a) > (b) ? (a) : (b))

#endif
