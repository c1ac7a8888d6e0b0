/*
 * util.c: time, deadlines, allocation that cannot fail, whole-file I/O,
 * constant-time comparison, the names of states, the names of checkpoint
 * epochs and their files, and the --version flag. Sockets and host:port
 * addresses are net.c's.
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "zt_common.h"

static int64_t clock_us(clockid_t c) {
  struct timespec ts;
  clock_gettime(c, &ts);
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int64_t zt_now_us(void) { return clock_us(CLOCK_MONOTONIC); }
int64_t zt_now_ms(void) { return clock_us(CLOCK_MONOTONIC) / 1000; }
int64_t zt_wall_ms(void) { return clock_us(CLOCK_REALTIME) / 1000; }

void zt_sleep_ms(int64_t ms) {
  if (ms <= 0) return;
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* ---- allocation ------------------------------------------------------------ */

static void *oom(size_t n) {
  ZT_ERROR("out of memory (allocating %zu bytes): exiting", n);
  _exit(70); /* EX_SOFTWARE */
}

void *zt_xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  return p ? p : oom(n);
}

void *zt_xcalloc(size_t count, size_t size) {
  if (count == 0 || size == 0) count = size = 1;
  void *p = calloc(count, size);
  return p ? p : oom(count * size);
}

void *zt_xrealloc(void *p, size_t n) {
  void *q = realloc(p, n ? n : 1);
  return q ? q : oom(n);
}

char *zt_xstrdup(const char *s) {
  size_t n = strlen(s) + 1;
  return memcpy(zt_xmalloc(n), s, n);
}

int zt_secret_equal(const char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b);
  unsigned char diff = (unsigned char)(la != lb);
  /* Always walks the longer string, so the time says nothing about where
   * the first difference is. */
  for (size_t i = 0, n = la > lb ? la : lb; i < n; i++)
    diff |= (unsigned char)((i < la ? a[i] : 0) ^ (i < lb ? b[i] : 0));
  return diff == 0;
}

int zt_random_bytes(void *out, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom((unsigned char *)out + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return zt_err_errno("getrandom");
    got += (size_t)r;
  }
  return 0;
}

int zt_random_hex(char *out, size_t bytes) {
  unsigned char raw[64];
  if (bytes > sizeof raw) return zt_err("zt_random_hex: %zu bytes is too many", bytes);
  if (zt_random_bytes(raw, bytes) != 0) return -1;
  for (size_t i = 0; i < bytes; i++) snprintf(out + 2 * i, 3, "%02x", raw[i]);
  return 0;
}

/* ---- numbers --------------------------------------------------------------- */

uint16_t zt_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
  return (uint16_t)(u >> 16);
}

float zt_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

double zt_float_decimal(float f) {
  char buf[32];
  if (!isfinite(f)) return f;
  for (int digits = 1; digits < 9; digits++) {
    snprintf(buf, sizeof buf, "%.*g", digits, (double)f);
    double d = strtod(buf, NULL);
    if ((float)d == f) return d;
  }
  return f; /* 9 significant digits always round-trip a float */
}

/* ---- time and deadlines ------------------------------------------------------ */

int64_t zt_deadline_left_ms(zt_deadline_t d) {
  if (d == 0) return INT64_MAX;
  int64_t left = d - zt_now_ms();
  return left > 0 ? left : 0;
}

int zt_loopback_host(const char *host) {
  struct in_addr a4;
  if (!strcmp(host, "localhost") || !strcmp(host, "::1") || !strcmp(host, "[::1]")) return 1;
  return inet_pton(AF_INET, host, &a4) == 1 && (ntohl(a4.s_addr) >> 24) == 127;
}

int zt_write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t w = write(fd, p, len);
    if (w < 0) {
      if (errno == EINTR) continue;
      return zt_err_errno("write");
    }
    p += w;
    len -= (size_t)w;
  }
  return 0;
}

/* Linux reads at most 0x7ffff000 bytes per call, and a signal may cut a
 * read short, so a short count is not the end of the file: only 0 is. */
int zt_pread_all(int fd, void *buf, size_t len, uint64_t off, const char *path) {
  char *p = buf;
  size_t got = 0;
  while (got < len) {
    ssize_t r = pread(fd, p + got, len - got, (off_t)(off + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      return zt_err_errno("read %s at offset %llu", path, (unsigned long long)(off + got));
    if (r == 0)
      return zt_errk(ZT_E_INVALID, "%s: end of file at offset %llu, %zu of %zu bytes read", path,
                     (unsigned long long)(off + got), got, len);
    got += (size_t)r;
  }
  return 0;
}

int zt_read_file(const char *path, char **out, size_t *outlen, size_t maxlen) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return zt_err_errno("%s", path);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    zt_err_errno("%s", path);
    goto err;
  }
  if ((size_t)st.st_size > maxlen) {
    zt_errk(ZT_E_TOO_LARGE, "%s: %lld bytes is over the limit of %zu", path, (long long)st.st_size,
            maxlen);
    goto err;
  }
  char *buf = zt_xmalloc((size_t)st.st_size + 1);
  size_t got = 0;
  while (got < (size_t)st.st_size) {
    ssize_t r = read(fd, buf + got, (size_t)st.st_size - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      free(buf);
      if (r == 0) zt_err("%s: file shrank while reading", path);
      else zt_err_errno("%s", path);
      goto err;
    }
    got += (size_t)r;
  }
  buf[got] = 0;
  close(fd);
  *out = buf;
  if (outlen) *outlen = got;
  return 0;
err:
  close(fd);
  return -1;
}

int zt_mkdirs(const char *path) {
  char tmp[ZT_PATH_MAX];
  if (snprintf(tmp, sizeof tmp, "%s", path) >= (int)sizeof tmp) return zt_err("path too long: %s", path);
  for (char *p = tmp + 1; *p; p++) {
    if (*p != '/') continue;
    *p = 0;
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return zt_err_errno("mkdir %s", tmp);
    *p = '/';
  }
  if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return zt_err_errno("mkdir %s", tmp);
  return 0;
}

/* Entries zt_remove_tree could not remove, on this thread (nftw passes
 * no user pointer). */
static _Thread_local int remove_failed;

static int remove_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  /* Gone already: another process removed it (workers that share one
   * checkpoint root on shared storage delete the same epochs). */
  if (remove(path) == 0 || errno == ENOENT) return 0;
  ZT_WARN("cannot remove %s: %s", path, strerror(errno));
  if (!remove_failed++) zt_err_errno("remove %s", path); /* the first names the reason */
  return 0;
}

int zt_remove_tree(const char *path) {
  struct stat st;
  if (lstat(path, &st) != 0 && errno == ENOENT) return 0;
  remove_failed = 0;
  if (nftw(path, remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    if (errno == ENOENT && lstat(path, &st) != 0 && errno == ENOENT) return 0;
    ZT_WARN("cannot walk %s to remove it: %s", path, strerror(errno));
    return zt_err_errno("remove %s: walking the tree", path);
  }
  return remove_failed;
}

/* ---- text from the network ----------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s (2..4), or 0: RFC 3629's
 * table, so that overlong forms, UTF-16 surrogates (ED A0..BF) and code
 * points above U+10FFFF are not valid, as JSON decoders and Prometheus
 * hold them. */
static size_t utf8_len(const unsigned char *s) {
  size_t n = s[0] >= 0xf0 && s[0] <= 0xf4 ? 4 : s[0] >= 0xe0 && s[0] < 0xf0 ? 3
             : s[0] >= 0xc2 && s[0] < 0xe0 ? 2 : 0;
  unsigned lo = 0x80, hi = 0xbf; /* the second byte's range */
  if (s[0] == 0xe0) lo = 0xa0;
  if (s[0] == 0xed) hi = 0x9f;
  if (s[0] == 0xf0) lo = 0x90;
  if (s[0] == 0xf4) hi = 0x8f;
  if (n && (s[1] < lo || s[1] > hi)) return 0;
  for (size_t i = 2; i < n; i++)
    if ((s[i] & 0xc0) != 0x80) return 0;
  return n;
}

int zt_text_valid(const char *s) {
  for (const unsigned char *p = (const unsigned char *)s; *p;) {
    size_t u = *p >= 0x80 ? utf8_len(p) : 1;
    if (!u || *p < 0x20 || *p == 0x7f) return 0;
    p += u;
  }
  return 1;
}

const char *zt_text_shape(const char *s, char *out, size_t n) {
  size_t o = 0;
  for (size_t i = 0; s[i] && o + 1 < n;) {
    if (!isdigit((unsigned char)s[i])) {
      out[o++] = s[i++];
      continue;
    }
    while (isdigit((unsigned char)s[i]) || (s[i] == '.' && isdigit((unsigned char)s[i + 1])))
      i++; /* the run: digits, with '.' between digits */
    out[o++] = '#';
  }
  out[o] = 0;
  return out;
}

const char *zt_printable(const char *s, char *buf, size_t n) {
  size_t o = 0;
  for (const unsigned char *p = (const unsigned char *)s; *p && o + 5 < n;) {
    size_t u = *p >= 0x80 ? utf8_len(p) : 0;
    if (u && o + u < n - 1) {
      memcpy(buf + o, p, u);
      o += u, p += u;
    } else if (*p < 0x20 || *p == 0x7f || *p >= 0x80) {
      o += (size_t)snprintf(buf + o, n - o, "\\x%02x", *p++);
    } else {
      buf[o++] = (char)*p++;
    }
  }
  buf[o] = 0;
  return buf;
}

int zt_parse_i64(const char *what, const char *s, int64_t lo, int64_t hi, int64_t *out) {
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno || !*s || *end || v < lo || v > hi)
    return zt_errk(ZT_E_INVALID, "%s: expected an integer in %lld..%lld, got \"%.32s\"", what,
                   (long long)lo, (long long)hi, s);
  *out = v;
  return 0;
}

/* ---- confined paths ---------------------------------------------------------- */

/* Appends the components of p to out (at *len), dropping empty and "."
 * ones; -1 on a ".." component or when out is full. */
static int append_components(char *out, size_t cap, size_t *len, const char *p) {
  while (*p) {
    while (*p == '/') p++;
    size_t n = strcspn(p, "/");
    if (n == 0) break;
    if (n == 2 && p[0] == '.' && p[1] == '.') return -1;
    if (!(n == 1 && p[0] == '.')) {
      if (*len + 1 + n + 1 > cap) return -1;
      out[(*len)++] = '/';
      memcpy(out + *len, p, n);
      *len += n;
      out[*len] = 0;
    }
    p += n;
  }
  return 0;
}

int zt_path_fmt(char *out, size_t n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int w = vsnprintf(out, n, fmt, ap);
  va_end(ap);
  if (w >= 0 && (size_t)w < n) return 0;
  char head[201];
  snprintf(head, sizeof head, "%s", n ? out : "");
  if (n) out[0] = 0;
  return zt_errk(ZT_E_INVALID, "path too long (over %zu bytes): %s...", n ? n - 1 : 0, head);
}

int zt_path_join(char *out, size_t n, const char *dir, const char *name) {
  return zt_path_fmt(out, n, "%s/%s", dir, name);
}

int zt_path_confine(const char *root, const char *path, const char *what, char *out,
                    size_t outlen) {
  char r[ZT_PATH_MAX];
  size_t rl = 0, ol = 0;
  r[0] = 0;
  if (root[0] != '/' || append_components(r, sizeof r, &rl, root) != 0)
    return zt_errk(ZT_E_INVALID, "%s: the root %.200s is not an absolute path", what, root);
  if (!path[0]) return zt_errk(ZT_E_INVALID, "%s: empty path", what);
  out[0] = 0;
  if ((path[0] != '/' && append_components(out, outlen, &ol, r) != 0) ||
      append_components(out, outlen, &ol, path) != 0)
    return zt_errk(ZT_E_INVALID, "%s: \"%.200s\" may not contain \"..\" (or is too long)", what,
                   path);
  if (ol == 0) snprintf(out, outlen, "/");
  if (strncmp(out, r, rl) != 0 || (out[rl] != '/' && out[rl] != 0))
    return zt_errk(ZT_E_INVALID, "%s: %.200s is outside the allowed root %.200s", what, path,
                   rl ? r : "/");
  return 0;
}

const char *zt_path_under(const char *root, const char *path) {
  size_t n = strlen(root);
  while (n > 1 && root[n - 1] == '/') n--;
  if (n == 1 && root[0] == '/') return path[0] == '/' ? path + 1 : NULL;
  if (strncmp(path, root, n) != 0 || (path[n] != '/' && path[n] != 0)) return NULL;
  return path[n] ? path + n + 1 : path + n;
}

int zt_path_real_under(const char *root, const char *path) {
  char rr[ZT_PATH_MAX], rp[ZT_PATH_MAX];
  if (!realpath(root, rr) || !realpath(path, rp)) return 0;
  size_t n = strlen(rr);
  if (n == 1) return 1; /* the root is "/" */
  return strncmp(rp, rr, n) == 0 && (rp[n] == '/' || rp[n] == 0);
}

/* ---- checkpoint epoch names ------------------------------------------------ */

void zt_epoch_name(char *buf, size_t n, uint64_t job, int64_t step, uint64_t gen) {
  snprintf(buf, n, "job_%llu/step_%08lld-g%llu", (unsigned long long)job, (long long)step,
           (unsigned long long)gen);
}

/* The decimal number of the digits s[*i..] (at least one, at most 19);
 * -1 when there are none or too many. */
static int take_digits(const char *s, size_t *i, uint64_t *out) {
  size_t start = *i;
  uint64_t v = 0;
  while (s[*i] >= '0' && s[*i] <= '9' && *i - start < 20) v = v * 10 + (uint64_t)(s[(*i)++] - '0');
  if (*i == start || *i - start > 19) return -1;
  *out = v;
  return 0;
}

/* The numbers of "job_<j>/step_<s>-g<g>" (digits only); -1 otherwise. */
static int take_epoch(const char *s, zt_epoch_t *e) {
  size_t i = 4;
  uint64_t step;
  if (strncmp(s, "job_", 4) != 0 || take_digits(s, &i, &e->job) != 0 ||
      strncmp(s + i, "/step_", 6) != 0)
    return -1;
  i += 6;
  if (take_digits(s, &i, &step) != 0 || strncmp(s + i, "-g", 2) != 0) return -1;
  i += 2;
  if (take_digits(s, &i, &e->gen) != 0 || s[i] || step > INT64_MAX) return -1;
  e->step = (int64_t)step;
  return 0;
}

int zt_epoch_parse(const char *rel, zt_epoch_t *e) {
  int depth = 0;
  const char *tail[2] = {NULL, NULL}; /* the last two components */
  for (const char *p = rel;; p++) {
    size_t n = strcspn(p, "/");
    if (n == 0 || p[0] == '.')
      return zt_errk(ZT_E_INVALID, "epoch directory \"%.200s\" has an empty or hidden component",
                     rel);
    tail[0] = tail[1], tail[1] = p;
    depth++;
    p += n;
    if (!*p) break;
  }
  if (depth > ZT_EPOCH_MAX_DEPTH)
    return zt_errk(ZT_E_INVALID, "epoch directory \"%.200s\" is %d directories deep (at most %d)",
                   rel, depth, ZT_EPOCH_MAX_DEPTH);
  char canon[ZT_EPOCH_NAME_MAX];
  if (!tail[0] || take_epoch(tail[0], e) != 0 ||
      (zt_epoch_name(canon, sizeof canon, e->job, e->step, e->gen), strcmp(canon, tail[0]) != 0))
    return zt_errk(ZT_E_INVALID,
                   "\"%.200s\" does not end in job_<n>/step_<8 digits>-g<n> (digits only)", rel);
  e->dir_len = tail[0] == rel ? 0 : (size_t)(tail[0] - rel - 1);
  return 0;
}

int zt_epoch_file(const char *name, int *rank) {
  *rank = -1;
  if (!strcmp(name, "manifest.json")) return 1;
  size_t i = 5;
  uint64_t r;
  char canon[64];
  if (strncmp(name, "rank_", 5) != 0 || take_digits(name, &i, &r) != 0 || r > INT32_MAX ||
      (strcmp(name + i, ".bin") != 0 && strcmp(name + i, ".json") != 0))
    return 0;
  snprintf(canon, sizeof canon, "rank_%llu%s", (unsigned long long)r, name + i);
  if (strcmp(canon, name) != 0) return 0;
  *rank = (int)r;
  return 1;
}

/* ---- state names --------------------------------------------------------- */

static const char *state_name(const char *const *names, size_t n, int state) {
  return state >= 0 && (size_t)state < n ? names[state] : "unknown";
}

const char *zt_name_worker_state(int state) {
  static const char *const names[] = {"unknown", "alive", "suspect", "lost", "left"};
  return state_name(names, ZT_ARRAY_LEN(names), state);
}

const char *zt_name_job_state(int state) {
  static const char *const names[] = {"unknown",   "pending", "running", "reconfiguring",
                                      "completed", "failed",  "paused",  "canceled"};
  return state_name(names, ZT_ARRAY_LEN(names), state);
}

const char *zt_name_ckpt_state(int state) {
  static const char *const names[] = {"pending", "committed", "deleted"};
  return state_name(names, ZT_ARRAY_LEN(names), state);
}

int zt_version_arg(int argc, char **argv, const char *prog) {
  if (argc < 2 || strcmp(argv[1], "--version") != 0) return 0;
  printf("%s %s\n", prog, zt_version_string());
  fflush(stdout);
  return 1;
}
