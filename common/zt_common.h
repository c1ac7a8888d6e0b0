/*
 * zt_common.h: the small shared vocabulary of every ztrain binary.
 *
 * Logging, error reporting, allocation, time and deadlines, ranges, the
 * names of states, and the test-only knobs (sockets with deadlines and
 * host:port addresses are zt_net.h's). common/ is the bottom layer: it
 * includes nothing of ours, and every other folder may include it.
 *
 * The error convention, followed everywhere:
 *
 *   - A function that can fail returns an int, 0 on success and -1 on
 *     failure (or a pointer, NULL on failure), and leaves a human-readable
 *     reason in a thread-local buffer, read with zt_err_msg(). A caller that
 *     adds context wraps the message with zt_err_wrap(), so the final text
 *     names the whole path: "load checkpoint: ckpt/step_30/r0.bin: checksum
 *     mismatch". Nothing here allocates on the error path.
 *   - Next to the message the thread keeps an error *kind* (zt_errkind_t):
 *     bad input, not found, wrong state, unavailable, ... set with zt_errk()
 *     (zt_err() sets ZT_E_FAILED). The RPC and HTTP front ends turn a kind
 *     into a gRPC status and an HTTP status through one table
 *     (zt_errkind_grpc, zt_errkind_http), so no handler picks codes itself.
 *   - Out of memory is not an error a caller handles: zt_xmalloc() and
 *     friends end the process with a message. Allocations whose size comes
 *     from the network or from a file are checked against a limit first.
 */
#ifndef ZT_COMMON_H
#define ZT_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* Marks a function whose result must be looked at: ignoring it is a build
 * error (-Werror), so no failure can pass unnoticed. */
#define ZT_MUST_CHECK __attribute__((warn_unused_result))

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

/* What kind of failure the current message describes. */
typedef enum {
  ZT_E_FAILED = 0,       /* an operation failed (I/O, a bug): gRPC INTERNAL, HTTP 500 */
  ZT_E_INVALID,          /* the input is wrong: INVALID_ARGUMENT, 400 */
  ZT_E_NOT_FOUND,        /* no such worker, job, file: NOT_FOUND, 404 */
  ZT_E_STATE,            /* not allowed in the current state: FAILED_PRECONDITION, 409 */
  ZT_E_UNAUTHENTICATED,  /* missing or wrong credentials: UNAUTHENTICATED, 401 */
  ZT_E_UNAVAILABLE,      /* storage or a peer is unavailable, retry later: UNAVAILABLE, 503 */
  ZT_E_TOO_LARGE,        /* over a size limit: RESOURCE_EXHAUSTED, 413 */
  ZT_E_ABORTED,          /* superseded by something newer: ABORTED, 409 */
  ZT_E_EXISTS,           /* the name is taken: ALREADY_EXISTS, 409 */
  ZT_E_NO_MEMORY,        /* not enough memory for the work: RESOURCE_EXHAUSTED, 507 */
  ZT_E_COUNT
} zt_errkind_t;

/* Sets the thread's message (kind ZT_E_FAILED); always returns -1 so that
 * `return zt_err(...)` works. */
int zt_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The same with an explicit kind. */
int zt_errk(zt_errkind_t kind, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prefixes the current message with context: "<ctx>: <old message>"; the
 * kind stays. */
int zt_err_wrap(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* zt_err_wrap, then sets the kind. */
int zt_err_wrapk(zt_errkind_t kind, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Sets the message from errno: "<ctx>: strerror(errno)" (kind ZT_E_FAILED). */
int zt_err_errno(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
const char *zt_err_msg(void);
zt_errkind_t zt_err_kind(void);
void zt_err_clear(void);

/* Several faults as one error, so that a user fixing an input sees them
 * all at once: zt_faults_add appends a message ("; " between them) while
 * it fits the error, and counts the rest; zt_faults_raise sets them as one
 * error of `kind`, "<prefix>: <faults>; and N more" (prefix may be NULL),
 * and returns -1, or 0 when there were none. */
typedef struct {
  char msg[ZT_ERR_MAX];
  size_t n;
  int count, shown;
} zt_faults_t;
#define ZT_FAULTS_INIT {{0}, 0, 0, 0}
void zt_faults_add(zt_faults_t *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int zt_faults_raise(const zt_faults_t *f, zt_errkind_t kind, const char *prefix);

/* The one mapping from error kinds to protocol status codes. */
int zt_errkind_grpc(zt_errkind_t kind);
int zt_errkind_http(zt_errkind_t kind);

/* ---- allocation ------------------------------------------------------- */

/* malloc, calloc, realloc and strdup that never return NULL: on out of
 * memory they log what was asked for and end the process (exit status 70,
 * EX_SOFTWARE). n == 0 allocates one byte, so the result is never NULL. */
void *zt_xmalloc(size_t n);
void *zt_xcalloc(size_t count, size_t size);
void *zt_xrealloc(void *p, size_t n);
char *zt_xstrdup(const char *s);

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

/* The longest path a buffer holds, with its terminating zero (Linux's
 * PATH_MAX): every path buffer has this size. */
#define ZT_PATH_MAX 4096
/* A path made from a format into out (n bytes): 0, or -1 (ZT_E_INVALID)
 * naming the path when it does not fit; never a path cut short. */
ZT_MUST_CHECK int zt_path_fmt(char *out, size_t n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* dir "/" name, as zt_path_fmt. */
ZT_MUST_CHECK int zt_path_join(char *out, size_t n, const char *dir, const char *name);
/* The cores this process may use: its affinity mask, capped by its
 * cgroup's CPU quota (v2 cpu.max, v1 cfs quota) on the way to the root;
 * at least 1 (cpus.c). */
int zt_cpus_usable(void);

/* 1 when a host name (no port) names this machine's loopback: localhost,
 * ::1 or [::1], or an IPv4 literal in 127.0.0.0/8. */
int zt_loopback_host(const char *host);
/* Writes a whole buffer / reads a whole file; -1 with a message on failure
 * (a file over maxlen: ZT_E_TOO_LARGE). */
ZT_MUST_CHECK int zt_write_all(int fd, const void *buf, size_t len);
ZT_MUST_CHECK int zt_read_file(const char *path, char **out, size_t *outlen, size_t maxlen);
/* Reads exactly len bytes at offset off (pread, resumed after a short count
 * or EINTR); the end of the file first is an error naming path and the
 * offset reached (ZT_E_INVALID: the file is shorter than its description
 * says; an I/O error stays ZT_E_FAILED). */
ZT_MUST_CHECK int zt_pread_all(int fd, void *buf, size_t len, uint64_t off, const char *path);
/* Creates a directory and its parents (mkdir -p). */
ZT_MUST_CHECK int zt_mkdirs(const char *path);
/* Removes a directory and everything under it (rm -r, without following
 * symbolic links); an entry that cannot be removed is logged and skipped.
 * Returns the number of entries left behind (0: all gone, or nothing was
 * there), the first one's reason as the thread's message; -1 with the
 * reason when the walk itself failed (out of descriptors, an unreadable
 * top directory), in which case nothing may have been removed. */
int zt_remove_tree(const char *path);
/* Confines a path from untrusted input (a job spec) to a root directory
 * (absolute): a relative path is taken under root, an absolute one must lie
 * under it already, and a ".." component is refused anywhere. out receives
 * the joined path with "." and repeated slashes removed. Lexical only: a
 * caller that opens the result checks it again with zt_path_real_under
 * (symbolic links). -1 (ZT_E_INVALID) with "<what>: ..." otherwise. */
ZT_MUST_CHECK int zt_path_confine(const char *root, const char *path, const char *what, char *out,
                                  size_t outlen);
/* The part of `path` under `root` (both normalized, as zt_path_confine
 * leaves them): "a/b" for root/a/b, "" for root itself, NULL when path is
 * not under root. Paths cross the wire in this form, so that every host
 * resolves them under its own root. */
const char *zt_path_under(const char *root, const char *path);
/* 1 when the existing file or directory `path`, with every symbolic link
 * resolved, lies under root (which is itself resolved). */
int zt_path_real_under(const char *root, const char *path);

/* ---- checkpoint epoch names ----------------------------------------------- */

/* An epoch directory, relative to a checkpoint root, is
 * <dir>/job_<job>/step_<step>-g<gen>: zt_epoch_name writes the last two
 * components (step zero-padded to 8 digits, no other leading zeros). Names
 * that cross the wire are taken only in exactly that form, so that what a
 * store creates is what the holdings scan lists and a deletion names. */
#define ZT_EPOCH_NAME_MAX 96
/* At most this many components in all, <dir> included: as deep as the
 * holdings scan looks. */
#define ZT_EPOCH_MAX_DEPTH 8
void zt_epoch_name(char *buf, size_t n, uint64_t job, int64_t step, uint64_t gen);
typedef struct {
  uint64_t job, gen;
  int64_t step;
  size_t dir_len; /* of <dir>, without its trailing slash (0: none) */
} zt_epoch_t;
/* 0 with *e when rel is an epoch directory in the canonical form: no
 * leading slash, every component non-empty and not starting with '.',
 * at most ZT_EPOCH_MAX_DEPTH of them, and job_/step_ exactly as
 * zt_epoch_name writes them (digits only: no sign, space or extra zero);
 * -1 (ZT_E_INVALID) with a message naming the fault otherwise. */
ZT_MUST_CHECK int zt_epoch_parse(const char *rel, zt_epoch_t *e);
/* 1 when name is a file of an epoch: manifest.json, rank_<r>.bin or
 * rank_<r>.json (r in decimal without a sign or leading zeros); *rank gets
 * r, or -1 for the manifest. */
int zt_epoch_file(const char *name, int *rank);
/* The most epoch deletions one heartbeat reports (HeartbeatRequest's
 * deleted_epochs): what a worker keeps, and what the coordinator takes. */
#define ZT_DELETED_EPOCHS_MAX 64
/* The most heartbeats one HeartbeatBatch call carries (a machine's heartbeat
 * agent, worker/agent.c): what an agent sends, and what the coordinator
 * takes. */
#define ZT_HB_BATCH_MAX 256
/* Compares two strings in time that depends only on their lengths, for
 * secrets and tokens. Returns 1 when they are equal. */
int zt_secret_equal(const char *a, const char *b);
/* A fresh random credential: 2 * bytes hex digits from the kernel's CSPRNG
 * (getrandom), NUL-terminated; out holds at least 2 * bytes + 1. */
int zt_random_hex(char *out, size_t bytes);
/* n bytes from the kernel's CSPRNG (getrandom). */
int zt_random_bytes(void *out, size_t n);

/* s with every control character (and DEL, and every byte of an invalid
 * UTF-8 sequence) written as \xNN, so that text from the network cannot
 * drive a terminal. Returns buf (n > 4). */
const char *zt_printable(const char *s, char *buf, size_t n);
/* 1 when s is valid UTF-8 without control characters (or DEL): text that
 * may be stored and served as it is (JSON, Prometheus labels). */
int zt_text_valid(const char *s);
/* Tickets for transfers between workers (ticket.c): the coordinator makes
 * them with the holder's session as the key; the holder checks them. */
typedef struct {
  char op[8];          /* "put" or "get" */
  uint64_t job, gen;   /* the job and the generation the requester is in */
  uint64_t requester;  /* its worker id */
  int64_t expiry_ms;   /* wall clock; 0: none (put tickets, see ticket.c) */
  char scope[512];     /* put: "r<rank>"; get: an epoch directory (relative) */
} zt_ticket_t;
#define ZT_TICKET_MAX 800
/* out (ZT_TICKET_MAX bytes) receives the ticket text. */
ZT_MUST_CHECK int zt_ticket_make(const char *key, const zt_ticket_t *t, char *out, size_t n);
/* Checks text against key (the holder's session) and the clock; fills *t.
 * -1 (ZT_E_UNAUTHENTICATED) with the reason otherwise. */
ZT_MUST_CHECK int zt_ticket_check(const char *key, const char *text, int64_t now_ms,
                                  zt_ticket_t *t);
/* Frees the calling thread's crypto state now (ticket.c says why); for
 * detached threads that checked or made tickets, as their last call. */
void zt_ticket_thread_done(void);

/* The shape of a message: s with every run of digits (dots between digits
 * included) written as '#', so that "generation 7 failed at step 40 on w1"
 * and "generation 8 failed at step 41 on w2" compare equal. Returns out
 * (n > 0). */
const char *zt_text_shape(const char *s, char *out, size_t n);
/* Parses a decimal integer in [lo, hi]; -1 (ZT_E_INVALID) naming `what`. */
ZT_MUST_CHECK int zt_parse_i64(const char *what, const char *s, int64_t lo, int64_t hi,
                               int64_t *out);

/* Names of the states of workers (zt_db.h zt_worker_state_t, proto
 * WorkerState), jobs (zt_job_state_t, JobState) and checkpoint epochs
 * (zt_ckpt_state_t): "alive", "running", "committed", ...; "unknown" for a
 * number outside the enum. One table each, shared by the database, the
 * HTTP/JSON API and zctl. */
const char *zt_name_worker_state(int state);
const char *zt_name_job_state(int state);
const char *zt_name_ckpt_state(int state);

/* ---- version ------------------------------------------------------------ */

/* "0.1.0 (git 1a2b3c4)": the project's version and, for a build from a git
 * checkout, the revision it was built from ("-dirty" with local changes).
 * Generated at build time by common/version.cmake. */
const char *zt_version_string(void);
/* When argv[1] is "--version": prints "<prog> <version>" to stdout and
 * returns 1 (main returns 0); otherwise 0. Every main() calls it first. */
int zt_version_arg(int argc, char **argv, const char *prog);

/* ---- numbers ------------------------------------------------------------ */

/* bf16 <-> fp32: round to nearest even; a NaN stays a (quiet) NaN. */
uint16_t zt_f32_to_bf16(float f);
float zt_bf16_to_f32(uint16_t h);
/* The double with the shortest decimal form that rounds to f: what a
 * float read from "1e-05" is written back as (1e-05, not the double
 * 9.99999974737875e-06 that f is). */
double zt_float_decimal(float f);

/* ---- ranges ------------------------------------------------------------ */

/* A half-open range [start, end) of positions in the training sample
 * stream. A rollback skips the data of a loss spike with one. */
typedef struct zt_range {
  uint64_t start, end;
} zt_range_t;

/* The most skip ranges a job can hold; one more is an error (the job's
 * logbook says so), never a silent drop. */
#define ZT_MAX_SKIP_RANGES 64

/* A sorted list of disjoint, non-empty ranges. */
typedef struct zt_range_list {
  int n;
  zt_range_t r[ZT_MAX_SKIP_RANGES];
} zt_range_list_t;

/* Adds [start, end), merging with neighbours it touches or overlaps; an
 * empty range is ignored. -1 (ZT_E_TOO_LARGE) when the list is full. */
int zt_range_list_add(zt_range_list_t *l, uint64_t start, uint64_t end);
/* The q-th position (counting from 0) that lies in no range of the sorted
 * array skips[0..n). */
uint64_t zt_range_map(const zt_range_t *skips, int n, uint64_t q);

/* ---- test-only knobs ---------------------------------------------------- */

/* Every switch that exists only for tests, read from the environment in
 * one place (knobs.c, whose table documents each one). A knob changes
 * nothing unless its variable is set. */
typedef enum {
  ZT_KNOB_KILL_IN_CKPT_STEP,   /* ZT_FAULT_KILL_IN_CKPT_STEP=S: SIGKILL half-way
                                  through writing the first checkpoint at step >= S */
  ZT_KNOB_STAGE_COLLECTIVES,   /* ZT_TEST_STAGE_COLLECTIVES=1: CPU workers stage
                                  collectives as the device path does */
  ZT_KNOB_NO_STEP_REPORTER,    /* ZT_FAULT_NO_STEP_REPORTER=1: rank 0's step reporter
                                  thread cannot be started */
  ZT_KNOB_HEARTBEAT_REPLY_DELAY, /* ZT_FAULT_HEARTBEAT_REPLY_DELAY_MS=D: a worker acts on
                                    each heartbeat reply D ms after it arrived */
  ZT_KNOB_COUNT
} zt_knob_t;

/* The knob's integer value, or `def` when its variable is unset. */
int64_t zt_knob(zt_knob_t k, int64_t def);
/* The variable's name (for messages and docs). */
const char *zt_knob_name(zt_knob_t k);

/* ---- the environment ----------------------------------------------------- */

/* Every setting ztrain's processes read from the environment, read in one
 * place (knobs.c, whose table documents each one; tools/check-layers
 * refuses getenv anywhere else in the product). */
typedef enum {
  ZT_ENV_SGEMM,         /* ZT_SGEMM: "blas" or "avx512", the CPU's sgemm */
  ZT_ENV_CUDA_KERNELS,  /* ZT_CUDA_KERNELS: the CUDA kernels' library to load */
  ZT_ENV_CUDART_LIB,    /* ZT_CUDART_LIB: the CUDA runtime the NCCL backend loads */
  ZT_ENV_NCCL_LIB,      /* ZT_NCCL_LIB: the NCCL library the NCCL backend loads */
  ZT_ENV_WORKER_SECRET, /* ZTRAIN_WORKER_SECRET: zworker's shared secret */
  ZT_ENV_COORDINATOR,   /* ZTRAIN_COORDINATOR: zctl's coordinator */
  ZT_ENV_TOKEN,         /* ZTRAIN_TOKEN: zctl's operator token */
  ZT_ENV_COUNT
} zt_env_t;

/* The variable's value, or NULL when it is unset or empty. */
const char *zt_env(zt_env_t v);
/* The variable's name. */
const char *zt_env_name(zt_env_t v);

#define ZT_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define ZT_MIN(a, b) ((a) < (b) ? (a) : (b))
#define ZT_MAX(a, b) ((a) > (b) ? (a) : (b))

#endif
