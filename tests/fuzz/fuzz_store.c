/*
 * fuzz_store.c: the worker's replica store (worker/store.c), over real
 * TCP: the request header, the ticket checks, the epoch directory and file
 * name checks, PUT and GET.
 *
 * One store runs for the whole process, on 127.0.0.1, with a checkpoint
 * root under /tmp, session "fuzz-session", working on job 3 generation 7.
 * Each input is one connection:
 *
 *   byte 0, bit 0 set: raw: the rest of the input is sent as it is (the
 *     header parser against arbitrary bytes).
 *   otherwise a request is built around a ticket signed with the store's
 *     session (so the fuzzer gets past the MAC to the checks behind it):
 *     byte 0 bit 1: GET (else PUT); bits 2-3: the ticket's expiry (none,
 *     past, future, future); bit 4: another job; bit 5: another
 *     generation; bit 6: the checksum of the data (else the input's
 *     bytes); bit 7: the data is one byte short of the declared size.
 *     byte 1: the rank of a PUT ticket's scope ("r<k>", k = byte % 4).
 *     Then the directory and the file name, each ended by a NUL byte (a
 *     GET ticket's scope is the directory), then the data.
 *
 * The client sends everything, then shuts its side down, so the store never
 * waits out a deadline for bytes that will not come.
 *
 * Properties: no crash, no sanitizer report, no leak; the store answers
 * every request; and a PUT it answers "stored" left exactly the bytes
 * sent at <root>/<dir>/<name>, in a directory in the canonical epoch form
 * (zt_epoch_parse) of the ticket's job and generation, under the root.
 */
#define _XOPEN_SOURCE 700
#include <arpa/inet.h>
#include <errno.h>
#include <ftw.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "fuzz_fail.h"
#include "store.h"
#include "zt_common.h"

#define SESSION "fuzz-session"
#define JOB 3
#define GEN 7

static zt_store_t *store;
static char root[64];
static int port;
static unsigned runs;

static void session_of(void *user, char *buf, size_t n) {
  (void)user;
  snprintf(buf, n, "%s", SESSION);
}

static void assignment_of(void *user, uint64_t *job, uint64_t *gen) {
  (void)user;
  *job = JOB, *gen = GEN;
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *f) {
  (void)st, (void)flag, (void)f;
  return remove(p) != 0 && errno != ENOENT;
}

/* Empties the root (the store's files of earlier runs). */
static void clear_root(void) { nftw(root, rm_one, 16, FTW_DEPTH | FTW_PHYS); }

static void stop(void) {
  if (store && zt_store_stop(store) != 0) fprintf(stderr, "fuzz_store: %s\n", zt_err_msg());
  clear_root();
}

static void start(void) {
  zt_log_set_level((zt_log_level_t)(ZT_LOG_ERROR + 1));
  snprintf(root, sizeof root, "/tmp/zt-fuzz-store-%d", (int)getpid());
  if (mkdir(root, 0700) != 0 && errno != EEXIST) ZT_FUZZ_FAIL();
  zt_store_opts_t o = {.host = "127.0.0.1", .ckpt_root = root, .session = session_of,
                       .assignment = assignment_of};
  if (zt_store_start(&o, &store) != 0) {
    fprintf(stderr, "fuzz_store: %s\n", zt_err_msg());
    ZT_FUZZ_FAIL();
  }
  port = atoi(strrchr(zt_store_addr(store), ':') + 1);
  /* OpenSSL frees its state from an exit handler of its own, registered
   * when it first runs. Making a ticket here runs it first, so that stop()
   * (registered after, run before) waits for the store's connections
   * while OpenSSL still works: a connection still checking a ticket after
   * OpenSSL's cleanup would leave state nothing frees. */
  zt_ticket_t t = {.op = "get", .job = JOB, .gen = GEN, .scope = "x"};
  char ticket[ZT_TICKET_MAX];
  if (zt_ticket_make(SESSION, &t, ticket, sizeof ticket) != 0) ZT_FUZZ_FAIL();
  atexit(stop);
}

static void put_u16_str(uint8_t *b, size_t *o, const char *s) {
  uint16_t l = (uint16_t)strlen(s);
  memcpy(b + *o, &l, 2);
  memcpy(b + *o + 2, s, l);
  *o += 2 + l;
}

/* connect(), finished when a signal cuts it short: libFuzzer's timer
 * (SIGALRM, every few seconds) interrupts whatever call the input is in,
 * and an interrupted connection goes on in the kernel, to be waited for.
 * 0, or -1 with errno. */
static int connect_done(int fd, const struct sockaddr_in *sa) {
  if (connect(fd, (const struct sockaddr *)sa, sizeof *sa) == 0) return 0;
  if (errno != EINTR) return -1;
  for (int i = 0; i < 1000; i++) { /* bounded: 10 s at most */
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int n = poll(&p, 1, 10);
    if (n < 0 && errno != EINTR) return -1;
    if (n <= 0) continue;
    int err = 0;
    socklen_t l = sizeof err;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l) != 0) return -1;
    errno = err;
    return err ? -1 : 0;
  }
  errno = ETIMEDOUT;
  return -1;
}

/* Sends msg on a new connection, shuts the sending side, and reads the
 * whole reply (at most cap bytes kept) until the store closes. Every call
 * goes on after EINTR (see connect_done). */
static size_t exchange(const uint8_t *msg, size_t len, uint8_t *reply, size_t cap) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  /* Closed with a reset, so that no TIME_WAIT is left on this side: at
   * hundreds of connections a second the local ports would run out. */
  struct linger lg = {.l_onoff = 1, .l_linger = 0};
  if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg) != 0 ||
      connect_done(fd, &sa) != 0) {
    fprintf(stderr, "fuzz_store: cannot connect to the store: %s\n", strerror(errno));
    ZT_FUZZ_FAIL();
  }
  size_t off = 0;
  while (off < len) { /* the store may refuse and close early: stop there */
    ssize_t w = send(fd, msg + off, len - off, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) break;
    off += (size_t)w;
  }
  shutdown(fd, SHUT_WR);
  size_t got = 0;
  for (int i = 0; i < 1000; i++) { /* bounded: 10 s at most */
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 10) <= 0) continue;
    uint8_t tmp[4096];
    ssize_t r = recv(fd, tmp, sizeof tmp, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    size_t keep = ZT_MIN((size_t)r, cap - got);
    memcpy(reply + got, tmp, keep);
    got += keep;
  }
  close(fd);
  return got;
}

/* After a PUT the store answered "stored": the directory is an epoch of
 * the ticket's job and generation (not necessarily the store's current
 * ones: a put ticket with an expiry is good for any), and the file holds
 * exactly data. */
static void check_stored(const zt_ticket_t *t, const char *dir, const char *name,
                         const uint8_t *data, size_t n) {
  zt_epoch_t e;
  if (zt_epoch_parse(dir, &e) != 0 || e.job != t->job || e.gen != t->gen) ZT_FUZZ_FAIL();
  char path[2048];
  snprintf(path, sizeof path, "%s/%s/%s", root, dir, name);
  FILE *f = fopen(path, "rb");
  if (!f) ZT_FUZZ_FAIL();
  uint8_t *buf = malloc(n + 1);
  size_t r = fread(buf, 1, n + 1, f);
  fclose(f);
  if (r != n || (n && memcmp(buf, data, n) != 0)) ZT_FUZZ_FAIL();
  free(buf);
}

static int64_t expiry(int mode) {
  int64_t now = zt_wall_ms();
  return mode == 0 ? 0 : mode == 1 ? now - 1000 : now + 3600 * 1000;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!store) start();
  if (++runs % 512 == 0) clear_root();
  if (size < 2 || size > 8192) return 0;
  uint8_t flags = data[0], reply[1024];
  if (flags & 1) {
    exchange(data + 1, size - 1, reply, sizeof reply);
    return 0;
  }
  /* dir NUL name NUL data */
  const uint8_t *p = data + 2, *end = data + size;
  const uint8_t *z1 = memchr(p, 0, (size_t)(end - p));
  if (!z1 || z1 - p > 400) return 0;
  const uint8_t *z2 = memchr(z1 + 1, 0, (size_t)(end - z1 - 1));
  if (!z2 || z2 - z1 - 1 > 60) return 0;
  const char *dir = (const char *)p, *name = (const char *)z1 + 1;
  const uint8_t *body = z2 + 1;
  size_t n = (size_t)(end - body);
  int get = flags & 2;
  zt_ticket_t t = {.job = (flags & 16) ? JOB + 1 : JOB, .gen = (flags & 32) ? GEN + 1 : GEN,
                   .requester = 5, .expiry_ms = expiry((flags >> 2) & 3)};
  snprintf(t.op, sizeof t.op, "%s", get ? "get" : "put");
  if (get) snprintf(t.scope, sizeof t.scope, "%s", dir);
  else snprintf(t.scope, sizeof t.scope, "r%d", data[1] % 4);
  char ticket[ZT_TICKET_MAX], sum[32];
  if (zt_ticket_make(SESSION, &t, ticket, sizeof ticket) != 0) return 0;
  if (flags & 64) snprintf(sum, sizeof sum, "xxh64:%016llx", (unsigned long long)XXH64(body, n, 0));
  else {
    memset(sum, 0, sizeof sum);
    memcpy(sum, body, ZT_MIN(n, (size_t)22));
  }
  uint64_t declared = n + ((flags & 128) ? 1 : 0);
  uint8_t *msg = malloc(16 + ZT_TICKET_MAX + size + 64);
  size_t o = 0;
  memcpy(msg, get ? "ZTS1G" : "ZTS1P", 5);
  o = 5;
  put_u16_str(msg, &o, ticket);
  put_u16_str(msg, &o, dir);
  put_u16_str(msg, &o, name);
  memcpy(msg + o, &declared, 8);
  memset(msg + o + 8, 0, 22);
  memcpy(msg + o + 8, sum, ZT_MIN(strlen(sum), 22));
  o += 30;
  if (!get) memcpy(msg + o, body, n), o += n;
  size_t got = exchange(msg, o, reply, sizeof reply);
  free(msg);
  if (got < 3) ZT_FUZZ_FAIL(); /* the store answers every request */
  if (!get && reply[0] == 0) check_stored(&t, dir, name, body, n);
  return 0;
}
