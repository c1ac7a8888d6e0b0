/*
 * store.c: the worker's replica store (see store.h).
 *
 * One acceptor thread; each connection is served by a detached thread of
 * its own (at most ZT_STORE_MAX_CONN at once, and ZT_STORE_MAX_PER_PEER
 * from one address: more are refused with a message), which reads one
 * request, answers it and closes. Sockets are non-blocking and every read
 * and write waits in poll() against a deadline. The header, ticket
 * included, must arrive within ZT_STORE_HEADER_MS; only a request whose
 * ticket and names passed the checks takes one of the ZT_STORE_MAX_XFER
 * transfer slots, so connections that send nothing cannot keep good peers
 * out for longer than that. The data then has ZT_STORE_TIMEOUT_MS plus its
 * size at ZT_STORE_MIN_RATE, the pace the client allows too
 * (zt_store_transfer_ms), so a large file on a slow link is not cut off.
 */
#include "store.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "comm.h"
#include "zt_common.h"
#include "zt_net.h"

#define ZT_STORE_MAX_CONN 64     /* connections at once, header not yet read included */
#define ZT_STORE_MAX_PER_PEER 32 /* of those from one address */
#define ZT_STORE_MAX_XFER 16     /* transfers at once, after their checks */
#define ZT_STORE_HEADER_MS 5000  /* from accept to the end of the header */
#define ZT_STORE_TIMEOUT_MS 60000 /* a transfer, beyond the data's own pace */
#define ZT_STORE_MAX_FILE (1ull << 40)
#define CHUNK (1u << 20)

struct zt_store {
  zt_store_opts_t o;
  char root[ZT_PATH_MAX];
  char addr[96];
  int lfd;
  pthread_t acceptor;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int active, stopping; /* under mu: handler threads; shutting down */
  int xfers;            /* under mu: transfers past their checks */
  struct {
    uint32_t ip; /* network order; n == 0: a free entry */
    int n;
  } peers[ZT_STORE_MAX_CONN]; /* under mu: connections per address */
};

/* ---- sockets with deadlines ------------------------------------------------ */

/* The calling thread's abort condition (zt_store_abort_when). */
static _Thread_local int (*abort_fn)(void *);
static _Thread_local void *abort_user;

void zt_store_abort_when(int (*fn)(void *), void *user) {
  abort_fn = fn;
  abort_user = user;
}

void zt_store_abort_get(int (**fn)(void *), void **user) {
  *fn = abort_fn;
  *user = abort_user;
}

/* The store's wait (zt_net_wait_fn): the socket and the deadline, and the
 * thread's abort condition every 100 ms when it has one (returning to look
 * at the socket in between is harmless). */
static int io_wait(void *user, int fd, short events, zt_deadline_t dl) {
  (void)user;
  if (!abort_fn) return zt_net_wait(fd, events, dl);
  if (zt_deadline_passed(dl)) return zt_err("timed out");
  if (abort_fn(abort_user)) return zt_err("aborted: no longer needed");
  struct pollfd p = {fd, events, 0};
  if (poll(&p, 1, (int)ZT_MIN(zt_deadline_left_ms(dl), 100)) < 0 && errno != EINTR)
    return zt_err_errno("poll");
  return 0;
}

/* Exactly len bytes, within dl and the thread's abort condition. */
static int io_all(int fd, void *buf, size_t len, int writing, zt_deadline_t dl) {
  return zt_net_exact(fd, buf, len, writing, dl, io_wait, NULL);
}

/* A connection to addr by dl, within the thread's abort condition. */
static int connect_to(const char *addr, zt_deadline_t dl) {
  zt_net_addr_t a;
  if (zt_net_addr(addr, &a) != 0) return -1;
  return zt_net_connect(&a, dl, io_wait, NULL, NULL);
}

/* Starts a connection to addr: the socket, connecting or already
 * connected (*done); -1 when it failed at once, *refused saying whether
 * nothing listens there. */
static int probe_start(const char *addr, int *done, int *refused) {
  zt_net_addr_t a;
  *refused = 0;
  if (zt_net_addr(addr, &a) != 0) return -1;
  return zt_net_connect_start(&a, done, refused);
}

void zt_store_probe(const char *const *addrs, int n, int64_t timeout_ms, uint8_t *reached) {
  struct pollfd *p = zt_xcalloc((size_t)n + 1, sizeof *p);
  int pending = 0;
  for (int i = 0; i < n; i++) {
    int done, refused;
    reached[i] = ZT_PROBE_SILENT;
    p[i].fd = probe_start(addrs[i], &done, &refused);
    p[i].events = POLLOUT;
    if (p[i].fd < 0 && refused) reached[i] = ZT_PROBE_REFUSED;
    if (p[i].fd >= 0 && done) {
      reached[i] = ZT_PROBE_OK;
      close(p[i].fd);
      p[i].fd = -1;
    }
    pending += p[i].fd >= 0;
  }
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  while (pending > 0) {
    int64_t left = zt_deadline_left_ms(dl);
    if (left <= 0) break;
    int r = poll(p, (nfds_t)n, (int)ZT_MIN(left, 1000));
    if (r < 0 && errno != EINTR) break;
    for (int i = 0; i < n && r > 0; i++) {
      if (p[i].fd < 0 || !p[i].revents) continue;
      int err = zt_net_connect_result(p[i].fd);
      reached[i] = !err ? ZT_PROBE_OK : err == ECONNREFUSED ? ZT_PROBE_REFUSED : ZT_PROBE_SILENT;
      close(p[i].fd);
      p[i].fd = -1;
      pending--;
    }
  }
  for (int i = 0; i < n; i++)
    if (p[i].fd >= 0) close(p[i].fd);
  free(p);
}

/* ---- the request header -------------------------------------------------- */

typedef struct {
  char op;
  char ticket[ZT_TICKET_MAX], dir[512], name[64], checksum[32];
  uint64_t bytes;
} request;

static int put_str(uint8_t *b, size_t *o, const char *s) {
  size_t n = strlen(s);
  uint16_t l = (uint16_t)n;
  memcpy(b + *o, &l, 2);
  memcpy(b + *o + 2, s, n);
  *o += 2 + n;
  return 0;
}

static int send_request(int fd, const request *q, zt_deadline_t dl) {
  uint8_t b[4 + 1 + 6 + sizeof q->ticket + sizeof q->dir + sizeof q->name + 8 + 22];
  size_t o = 0;
  memcpy(b, "ZTS1", 4);
  b[4] = (uint8_t)q->op;
  o = 5;
  put_str(b, &o, q->ticket);
  put_str(b, &o, q->dir);
  put_str(b, &o, q->name);
  memcpy(b + o, &q->bytes, 8);
  memcpy(b + o + 8, q->checksum, 22);
  return io_all(fd, b, o + 30, 1, dl);
}

static int get_str(int fd, char *out, size_t cap, const char *what, zt_deadline_t dl) {
  uint16_t l;
  if (io_all(fd, &l, 2, 0, dl) != 0) return -1;
  if (l >= cap) return zt_errk(ZT_E_TOO_LARGE, "%s of %u bytes is too long", what, l);
  if (io_all(fd, out, l, 0, dl) != 0) return -1;
  out[l] = 0;
  if (strlen(out) != l) return zt_errk(ZT_E_INVALID, "%s holds a NUL byte", what);
  return 0;
}

static int recv_request(int fd, request *q, zt_deadline_t dl) {
  uint8_t head[5];
  if (io_all(fd, head, 5, 0, dl) != 0) return -1;
  if (memcmp(head, "ZTS1", 4) != 0 || (head[4] != 'P' && head[4] != 'G'))
    return zt_errk(ZT_E_INVALID, "not a replica store request");
  q->op = (char)head[4];
  if (get_str(fd, q->ticket, sizeof q->ticket, "ticket", dl) != 0 ||
      get_str(fd, q->dir, sizeof q->dir, "directory", dl) != 0 ||
      get_str(fd, q->name, sizeof q->name, "file name", dl) != 0 ||
      io_all(fd, &q->bytes, 8, 0, dl) != 0 || io_all(fd, q->checksum, 22, 0, dl) != 0)
    return -1;
  q->checksum[22] = 0;
  return 0;
}

/* Reply statuses: what the client may conclude about the file. */
enum {
  ST_OK = 0,      /* stored, or the file follows */
  ST_REFUSED = 1, /* busy, not authorised, a bad request: nothing said about the file */
  ST_NO_COPY = 2  /* GET: this store has no copy of that file at that size */
};

static int send_status(int fd, uint8_t st, const char *msg, zt_deadline_t dl) {
  uint8_t b[3 + 512];
  size_t n = ZT_MIN(strlen(msg), 512);
  uint16_t l = (uint16_t)n;
  b[0] = st;
  memcpy(b + 1, &l, 2);
  memcpy(b + 3, msg, n);
  return io_all(fd, b, 3 + n, 1, dl);
}

/* The store's answer; -1 with its message when it refused: ZT_E_NOT_FOUND
 * when it said it has no copy of the file, ZT_E_UNAVAILABLE for any other
 * refusal (busy, a ticket it does not take) and for a broken connection,
 * none of which says anything about the file itself. */
static int recv_status(int fd, const char *addr, zt_deadline_t dl) {
  uint8_t st;
  char msg[513];
  char shown[1100];
  if (io_all(fd, &st, 1, 0, dl) != 0 || get_str(fd, msg, sizeof msg, "message", dl) != 0)
    return zt_err_wrapk(ZT_E_UNAVAILABLE, "store %s", addr);
  if (st == ST_OK) return 0;
  zt_printable(msg, shown, sizeof shown); /* it ends up in our log */
  if (st == ST_NO_COPY) return zt_errk(ZT_E_NOT_FOUND, "store %s has no copy: %s", addr, shown);
  return zt_errk(ZT_E_UNAVAILABLE, "store %s refused: %s", addr, shown);
}

/* ---- checks on what a peer sends ------------------------------------------ */

/* A put ticket without an expiry is good while this worker works on the
 * ticket's job and generation: pushes end with the generation. */
static int check_current(const zt_store_t *s, const zt_ticket_t *t) {
  if (t->expiry_ms) return 0;
  if (strcmp(t->op, "put") != 0)
    return zt_errk(ZT_E_UNAUTHENTICATED, "a get ticket without an expiry");
  uint64_t job = 0, gen = 0;
  if (s->o.assignment) s->o.assignment(s->o.user, &job, &gen);
  if (job == t->job && gen == t->gen) return 0;
  return zt_errk(ZT_E_UNAUTHENTICATED,
                 "the ticket is for job %llu generation %llu; this worker is on job %llu "
                 "generation %llu",
                 (unsigned long long)t->job, (unsigned long long)t->gen,
                 (unsigned long long)job, (unsigned long long)gen);
}

/* The epoch directory: relative, under the root, in the canonical form
 * <dir>/job_<job>/step_<n>-g<gen> (zt_epoch_parse: what the holdings scan
 * lists, so nothing stored here escapes deletion), for the ticket's job
 * (and, for a PUT, its generation; for a GET, exactly the ticket's
 * directory). */
static int check_dir(const zt_store_t *s, const request *q, const zt_ticket_t *t, char *abs,
                     size_t n) {
  if (q->dir[0] == '/' || zt_path_confine(s->root, q->dir, "directory", abs, n) != 0)
    return zt_errk(ZT_E_INVALID, "directory %.200s is not a relative path", q->dir);
  zt_epoch_t e;
  if (zt_epoch_parse(q->dir, &e) != 0)
    return zt_err_wrapk(ZT_E_INVALID, "directory %.200s is not an epoch", q->dir);
  if (q->op == 'P' && (e.job != t->job || e.gen != t->gen))
    return zt_errk(ZT_E_INVALID,
                   "directory %.200s is not an epoch of the ticket's job and generation", q->dir);
  if (q->op == 'G' && strcmp(zt_path_under(s->root, abs), t->scope) != 0)
    return zt_errk(ZT_E_UNAUTHENTICATED, "the ticket is for %.200s, not %.200s", t->scope,
                   q->dir);
  return 0;
}

/* The file name: rank_<r>.bin, rank_<r>.json or manifest.json, exactly
 * (zt_epoch_file); a PUT only its own rank's files (and rank 0 the
 * manifest). */
static int check_name(const request *q, const zt_ticket_t *t) {
  int r = -1;
  if (!zt_epoch_file(q->name, &r))
    return zt_errk(ZT_E_INVALID, "file name %.64s is not a checkpoint file", q->name);
  if (q->op == 'P') {
    int rank = -1;
    if (sscanf(t->scope, "r%d", &rank) != 1 || (r >= 0 ? r != rank : rank != 0))
      return zt_errk(ZT_E_UNAUTHENTICATED, "the ticket does not cover %.64s", q->name);
  }
  return 0;
}

/* ---- serving -------------------------------------------------------------- */

/* Receives a PUT's data into dir/name, checked; reports the copy. Only a
 * copy that is durable and reported is answered OK: otherwise the pusher
 * tries its next target. */
static int serve_put(zt_store_t *s, int fd, const request *q, const char *abs,
                     const zt_ticket_t *t, zt_deadline_t dl) {
  char tmp[ZT_PATH_MAX], final[ZT_PATH_MAX];
  if (zt_path_join(final, sizeof final, abs, q->name) != 0 ||
      zt_path_fmt(tmp, sizeof tmp, "%s/%s.%d.part", abs, q->name, (int)gettid()) != 0 ||
      zt_mkdirs(abs) != 0)
    return -1;
  /* check_dir checked the text: a symbolic link in the middle of the path
   * (job_5 -> /elsewhere) would still lead the write out of the root. */
  if (!zt_path_real_under(s->root, abs))
    return zt_errk(ZT_E_INVALID,
                   "directory %.200s: with its links resolved it lies outside the checkpoint root",
                   q->dir);
  int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (out < 0) {
    zt_err_errno("create %s", tmp);
    rmdir(abs); /* as below: only when empty */
    return -1;
  }
  XXH64_state_t *h = XXH64_createState();
  XXH64_reset(h, 0);
  char *buf = zt_xmalloc(CHUNK);
  uint64_t left = q->bytes;
  int rc = 0;
  while (rc == 0 && left) {
    size_t n = (size_t)ZT_MIN(left, (uint64_t)CHUNK);
    rc = io_all(fd, buf, n, 0, dl);
    if (rc == 0) rc = zt_write_all(out, buf, n);
    if (rc == 0) XXH64_update(h, buf, n), left -= n;
  }
  char got[32];
  snprintf(got, sizeof got, "xxh64:%016llx", (unsigned long long)XXH64_digest(h));
  XXH64_freeState(h);
  free(buf);
  if (rc == 0 && strcmp(got, q->checksum) != 0)
    rc = zt_errk(ZT_E_INVALID, "%s: checksum %s, the sender declared %s", q->name, got,
                 q->checksum);
  if (rc == 0 && fsync(out) != 0) rc = zt_err_errno("fsync %s", tmp);
  close(out);
  if (rc == 0 && rename(tmp, final) != 0) rc = zt_err_errno("rename %s", tmp);
  if (rc != 0) {
    /* Nothing is left: neither the partial file nor, when no other file
     * is in it, the directory made for it (a full disk would otherwise
     * keep an empty epoch directory that no inventory lists). A PUT into
     * it that raced the removal fails, and its pusher tries the next
     * target. */
    unlink(tmp);
    rmdir(abs);
    return -1;
  }
  /* A name that may not survive a crash is no copy to count: nothing was
   * reported, so nothing is left. */
  if (zt_ckpt_fsync_dir(abs) != 0) {
    zt_err_wrap("%s: stored, but its name is not durable", q->name);
    unlink(final);
    return -1;
  }
  zt_ckpt_file_t f = {.bytes = q->bytes};
  snprintf(f.name, sizeof f.name, "%s", q->name);
  snprintf(f.checksum, sizeof f.checksum, "%s", q->checksum);
  /* A copy that could not be reported stays (the report may have arrived
   * though its answer did not, and a recorded copy must exist); the next
   * inventory (at registration, or with the first heartbeat of the next
   * job or generation) counts it or has it deleted. */
  if (s->o.stored && s->o.stored(s->o.user, t->job, zt_path_under(s->root, abs), &f) != 0)
    return zt_err_wrap("%s: stored, but not recorded", q->name);
  return 0;
}

/* Sends dir/name after the OK status. ZT_E_NOT_FOUND (no copy, which the
 * fetcher counts against the epoch) only when the file is not there, is
 * not a regular file or has another size; any other failure (out of
 * descriptors or memory, an I/O error, a symbolic link in its place or
 * above it leading out of the root) says nothing about the file. The file
 * is opened without blocking, so that a FIFO in its place cannot hold the
 * thread. */
static int serve_get(zt_store_t *s, int fd, const request *q, const char *abs,
                     zt_deadline_t dl) {
  char path[ZT_PATH_MAX];
  if (zt_path_join(path, sizeof path, abs, q->name) != 0) return -1;
  int in = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (in < 0 && (errno == ENOENT || errno == ENOTDIR))
    return zt_errk(ZT_E_NOT_FOUND, "%s: no such file here", q->name);
  if (in < 0)
    return zt_errk(ZT_E_UNAVAILABLE, "%s: cannot open it: %s", q->name,
                   errno == ELOOP ? "a symbolic link in its place" : strerror(errno));
  struct stat st;
  int rc = 0;
  if (fstat(in, &st) != 0)
    rc = zt_errk(ZT_E_UNAVAILABLE, "%s: fstat: %s", q->name, strerror(errno));
  else if (!S_ISREG(st.st_mode))
    rc = zt_errk(ZT_E_NOT_FOUND, "%s: not a regular file here", q->name);
  else if ((uint64_t)st.st_size != q->bytes)
    rc = zt_errk(ZT_E_NOT_FOUND, "%s: size %lld here, not %llu", q->name, (long long)st.st_size,
                 (unsigned long long)q->bytes);
  else if (!zt_path_real_under(s->root, path))
    rc = zt_errk(ZT_E_UNAVAILABLE,
                 "%s: with its links resolved it lies outside the checkpoint root", q->name);
  if (rc != 0) {
    close(in);
    return -1;
  }
  rc = send_status(fd, ST_OK, "", dl);
  char *buf = zt_xmalloc(CHUNK);
  uint64_t left = q->bytes;
  while (rc == 0 && left) {
    ssize_t n = read(in, buf, (size_t)ZT_MIN(left, (uint64_t)CHUNK));
    if (n <= 0) {
      rc = zt_err_errno("read %s", path);
      break;
    }
    rc = io_all(fd, buf, (size_t)n, 1, dl);
    left -= (uint64_t)n;
  }
  free(buf);
  close(in);
  return rc == 0 ? 0 : -2; /* -2: the status was already sent */
}

int64_t zt_store_transfer_ms(uint64_t bytes) {
  return 30000 + (int64_t)(bytes / (ZT_STORE_MIN_RATE / 1000));
}

/* Takes one of the transfer slots: 0, or -1 when all are in use. */
static int xfer_take(zt_store_t *s) {
  pthread_mutex_lock(&s->mu);
  int ok = s->xfers < ZT_STORE_MAX_XFER;
  if (ok) s->xfers++;
  pthread_mutex_unlock(&s->mu);
  return ok ? 0 : zt_errk(ZT_E_UNAVAILABLE, "replica store busy; try another copy");
}

static void xfer_give(zt_store_t *s) {
  pthread_mutex_lock(&s->mu);
  s->xfers--;
  pthread_mutex_unlock(&s->mu);
}

/* One request: the header within ZT_STORE_HEADER_MS, the checks, then the
 * transfer in a slot, with a deadline for its size. */
static int serve(zt_store_t *s, int fd, const char *peer) {
  zt_deadline_t dl = zt_deadline_in(ZT_STORE_HEADER_MS);
  request q;
  zt_ticket_t t;
  char session[80], abs[1100];
  memset(&q, 0, sizeof q);
  s->o.session(s->o.user, session, sizeof session);
  /* A probe (zt_store_probe) connects and closes without a byte. */
  uint8_t first;
  if (zt_net_wait(fd, POLLIN, dl) == 0 && recv(fd, &first, 1, MSG_PEEK) == 0) return 0;
  if (recv_request(fd, &q, dl) != 0) {
    ZT_WARN("replica store: no request from %s within %d ms: %s", peer, ZT_STORE_HEADER_MS,
            zt_err_msg());
    (void)send_status(fd, ST_REFUSED, zt_err_msg(), zt_deadline_in(1000));
    return -1;
  }
  int rc = zt_ticket_check(session, q.ticket, zt_wall_ms(), &t);
  if (rc == 0 && strcmp(t.op, q.op == 'P' ? "put" : "get") != 0)
    rc = zt_errk(ZT_E_UNAUTHENTICATED, "the ticket is for a %s", t.op);
  if (rc == 0) rc = check_current(s, &t);
  if (rc == 0) rc = check_dir(s, &q, &t, abs, sizeof abs);
  if (rc == 0) rc = check_name(&q, &t);
  if (rc == 0 && (q.bytes > ZT_STORE_MAX_FILE || !zt_ckpt_checksum_valid(q.checksum)))
    rc = zt_errk(ZT_E_TOO_LARGE, "%s: size %llu or checksum %.22s refused", q.name,
                 (unsigned long long)q.bytes, q.checksum);
  int slot = rc == 0 && (rc = xfer_take(s)) == 0;
  if (rc == 0) {
    dl = zt_deadline_in(ZT_STORE_TIMEOUT_MS + (int64_t)(q.bytes / (ZT_STORE_MIN_RATE / 1000)));
    rc = q.op == 'P' ? serve_put(s, fd, &q, abs, &t, dl) : serve_get(s, fd, &q, abs, dl);
  }
  if (slot) xfer_give(s);
  if (rc == -2) {
    ZT_WARN("replica store: %s from %s: %s", q.name, peer, zt_err_msg());
    return -1;
  }
  if (rc != 0) {
    /* The directory and the name come from the peer, and so may parts of
     * the reason: escaped, so they cannot forge log lines. */
    char why[600], raw[65], dir[300], name[300], shown[1200];
    uint8_t st = zt_err_kind() == ZT_E_NOT_FOUND ? ST_NO_COPY : ST_REFUSED;
    snprintf(why, sizeof why, "%s", zt_err_msg());
    snprintf(raw, sizeof raw, "%.64s", q.dir);
    zt_printable(raw, dir, sizeof dir);
    snprintf(raw, sizeof raw, "%.64s", q.name);
    zt_printable(raw, name, sizeof name);
    ZT_WARN("replica store: refused %s %s/%s from %s: %s", q.op == 'P' ? "PUT" : "GET", dir,
            name, peer, zt_printable(why, shown, sizeof shown));
    (void)send_status(fd, st, why, zt_deadline_in(1000)); /* dl may be spent */
    return -1;
  }
  return q.op == 'P' ? send_status(fd, ST_OK, "stored", dl) : 0;
}

typedef struct {
  zt_store_t *s;
  int fd;
  uint32_t ip;
  char peer[64];
} conn_arg;

/* Counts a connection from ip (d = +1 or -1; under mu): 0, or -1 when ip
 * already has ZT_STORE_MAX_PER_PEER. */
static int peer_count(zt_store_t *s, uint32_t ip, int d) {
  int freei = -1;
  for (int i = 0; i < ZT_STORE_MAX_CONN; i++) {
    if (s->peers[i].n && s->peers[i].ip == ip) {
      if (d > 0 && s->peers[i].n >= ZT_STORE_MAX_PER_PEER) return -1;
      s->peers[i].n += d;
      return 0;
    }
    if (!s->peers[i].n && freei < 0) freei = i;
  }
  if (d < 0 || freei < 0) return d < 0 ? 0 : -1;
  s->peers[freei].ip = ip, s->peers[freei].n = 1;
  return 0;
}

static void *conn_main(void *p) {
  conn_arg *a = p;
  (void)serve(a->s, a->fd, a->peer);
  close(a->fd);
  zt_ticket_thread_done();
  pthread_mutex_lock(&a->s->mu);
  (void)peer_count(a->s, a->ip, -1);
  a->s->active--;
  pthread_cond_broadcast(&a->s->cv);
  pthread_mutex_unlock(&a->s->mu);
  free(a);
  return NULL;
}

/* Out of descriptors, the pending connection stays and the listening
 * socket stays readable: the acceptor waits this long before it tries
 * again, rather than spin. */
#define ZT_STORE_EMFILE_PAUSE_MS 100

static void accept_one(zt_store_t *s, int *starved) {
  struct sockaddr_in sa;
  socklen_t sl = sizeof sa;
  int fd = accept4(s->lfd, (struct sockaddr *)&sa, &sl, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)) {
    if (!*starved) ZT_WARN("replica store: accept: %s; pausing new connections", strerror(errno));
    *starved = 1;
    zt_sleep_ms(ZT_STORE_EMFILE_PAUSE_MS); /* pacing: no event says descriptors are free */
    return;
  }
  if (fd < 0) return;
  if (*starved) ZT_INFO("replica store: accepting connections again");
  *starved = 0;
  conn_arg *a = zt_xcalloc(1, sizeof *a);
  a->s = s, a->fd = fd, a->ip = sa.sin_addr.s_addr;
  char ip[32] = "?";
  inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof ip);
  snprintf(a->peer, sizeof a->peer, "%s:%d", ip, ntohs(sa.sin_port));
  pthread_mutex_lock(&s->mu);
  int full = s->active >= ZT_STORE_MAX_CONN || peer_count(s, a->ip, +1) != 0;
  if (!full) s->active++;
  pthread_mutex_unlock(&s->mu);
  pthread_t th;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  if (full || pthread_create(&th, &at, conn_main, a) != 0) {
    if (!full) {
      pthread_mutex_lock(&s->mu);
      (void)peer_count(s, a->ip, -1);
      s->active--;
      pthread_mutex_unlock(&s->mu);
    }
    (void)send_status(fd, ST_REFUSED, "replica store busy; try another copy",
                      zt_deadline_in(1000));
    close(fd);
    free(a);
  }
  pthread_attr_destroy(&at);
}

static void *acceptor_main(void *p) {
  zt_store_t *s = p;
  int starved = 0; /* accept ran out of descriptors: logged once per burst */
  for (;;) {
    pthread_mutex_lock(&s->mu);
    int stop = s->stopping;
    pthread_mutex_unlock(&s->mu);
    if (stop) break;
    struct pollfd pf = {s->lfd, POLLIN, 0};
    if (poll(&pf, 1, 200) > 0) accept_one(s, &starved);
  }
  return NULL;
}

int zt_store_start(const zt_store_opts_t *o, zt_store_t **out) {
  zt_store_t *s = zt_xcalloc(1, sizeof *s);
  s->o = *o;
  snprintf(s->root, sizeof s->root, "%s", o->ckpt_root);
  int port = 0;
  if (zt_comm_tcp_listen(o->host, &port, &s->lfd) != 0) {
    free(s);
    return zt_err_wrap("replica store");
  }
  snprintf(s->addr, sizeof s->addr, "%s:%d", o->host, port);
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  if (pthread_create(&s->acceptor, NULL, acceptor_main, s) != 0) {
    close(s->lfd);
    free(s);
    return zt_err("replica store: cannot start its thread");
  }
  *out = s;
  return 0;
}

const char *zt_store_addr(const zt_store_t *s) { return s->addr; }

int zt_store_stop(zt_store_t *s) {
  if (!s) return 0;
  pthread_mutex_lock(&s->mu);
  s->stopping = 1;
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->acceptor, NULL);
  close(s->lfd);
  /* Transfers in flight end by their own deadline at the latest. */
  zt_deadline_t dl = zt_deadline_in(ZT_STORE_HEADER_MS + ZT_STORE_TIMEOUT_MS + 1000);
  pthread_mutex_lock(&s->mu);
  while (s->active > 0 && !zt_deadline_passed(dl)) {
    pthread_mutex_unlock(&s->mu);
    zt_sleep_ms(20); /* shutdown pacing: handler threads are detached */
    pthread_mutex_lock(&s->mu);
  }
  int left = s->active;
  pthread_mutex_unlock(&s->mu);
  /* A handler still runs: leak the store rather than free it under it. */
  if (left)
    return zt_errk(ZT_E_UNAVAILABLE, "%d replica store transfer%s still running after %d s",
                   left, left == 1 ? "" : "s",
                   (ZT_STORE_HEADER_MS + ZT_STORE_TIMEOUT_MS + 1000) / 1000);
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  free(s);
  return 0;
}

/* ---- the client side ------------------------------------------------------ */

/* A store that does not answer a connection within this is not there. */
#define ZT_STORE_CONNECT_MS 5000

/* The calling thread's last transfer failed before it had a connection
 * (zt_store_unreached). */
static _Thread_local int unreached;

int zt_store_unreached(void) { return unreached; }

/* connect_ms: the connection's deadline (0: ZT_STORE_CONNECT_MS), within dl. */
static int request_to(const char *addr, request *q, int64_t connect_ms, zt_deadline_t dl) {
  int64_t cms = connect_ms > 0 ? connect_ms : ZT_STORE_CONNECT_MS;
  zt_deadline_t cdl = zt_deadline_in(ZT_MIN(cms, zt_deadline_left_ms(dl)));
  int fd = connect_to(addr, cdl);
  if (fd < 0) {
    unreached = 1;
    return zt_err_wrapk(ZT_E_UNAVAILABLE, "store %s", addr);
  }
  if (send_request(fd, q, dl) != 0) {
    zt_err_wrapk(ZT_E_UNAVAILABLE, "store %s", addr);
    close(fd);
    return -1;
  }
  return fd;
}

static void fill(request *q, char op, const char *ticket, const char *dir,
                 const zt_ckpt_file_t *f) {
  memset(q, 0, sizeof *q);
  q->op = op;
  snprintf(q->ticket, sizeof q->ticket, "%s", ticket);
  snprintf(q->dir, sizeof q->dir, "%s", dir);
  snprintf(q->name, sizeof q->name, "%s", f->name);
  snprintf(q->checksum, sizeof q->checksum, "%s", f->checksum);
  q->bytes = f->bytes;
}

int zt_store_put(const char *addr, const char *ticket, const char *dir, const char *path,
                 const zt_ckpt_file_t *f, int64_t timeout_ms) {
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  unreached = 0;
  int in = open(path, O_RDONLY | O_CLOEXEC);
  if (in < 0) return zt_err_errno("%s", path);
  request q;
  fill(&q, 'P', ticket, dir, f);
  int fd = request_to(addr, &q, 0, dl), rc = fd < 0 ? -1 : 0;
  char *buf = zt_xmalloc(CHUNK);
  uint64_t left = f->bytes;
  while (rc == 0 && left) {
    ssize_t n = read(in, buf, (size_t)ZT_MIN(left, (uint64_t)CHUNK));
    if (n <= 0) rc = zt_err("%s: shorter than %llu bytes", path, (unsigned long long)f->bytes);
    else if ((rc = io_all(fd, buf, (size_t)n, 1, dl)) != 0) zt_err_wrap("store %s", addr);
    else left -= (uint64_t)n;
  }
  free(buf);
  close(in);
  if (rc == 0) rc = recv_status(fd, addr, dl);
  if (fd >= 0) close(fd);
  return rc;
}

int zt_store_get(const char *addr, const char *ticket, const char *dir, const char *path,
                 const zt_ckpt_file_t *f, int64_t connect_ms, int64_t timeout_ms) {
  zt_deadline_t dl = zt_deadline_in(timeout_ms);
  unreached = 0;
  /* The temporary name must never be cut to the final one (a copy that
   * fails its checksum would then take the file already there with it). */
  char tmp[ZT_PATH_MAX], pdir[ZT_PATH_MAX];
  int tl = snprintf(tmp, sizeof tmp, "%s.%d.part", path, (int)gettid());
  if (tl < 0 || (size_t)tl >= sizeof tmp)
    return zt_err("%.200s...: a path of %zu bytes is too long to fetch a copy into", path,
                  strlen(path));
  request q;
  fill(&q, 'G', ticket, dir, f);
  int fd = request_to(addr, &q, connect_ms, dl);
  if (fd < 0) return -1;
  int rc = recv_status(fd, addr, dl);
  int out = rc == 0 ? open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644) : -1;
  if (rc == 0 && out < 0) rc = zt_err_errno("create %s", tmp);
  XXH64_state_t *h = XXH64_createState();
  XXH64_reset(h, 0);
  char *buf = zt_xmalloc(CHUNK);
  uint64_t left = f->bytes;
  while (rc == 0 && left) {
    size_t n = (size_t)ZT_MIN(left, (uint64_t)CHUNK);
    if ((rc = io_all(fd, buf, n, 0, dl)) != 0)
      zt_err_wrapk(ZT_E_UNAVAILABLE, "store %s: %s", addr, f->name);
    else if ((rc = zt_write_all(out, buf, n)) == 0) XXH64_update(h, buf, n), left -= n;
  }
  free(buf);
  close(fd);
  char got[32];
  snprintf(got, sizeof got, "xxh64:%016llx", (unsigned long long)XXH64_digest(h));
  XXH64_freeState(h);
  if (rc == 0 && strcmp(got, f->checksum) != 0)
    rc = zt_errk(ZT_E_INVALID, "store %s: %s: checksum %s, expected %s (corrupt copy)", addr,
                 f->name, got, f->checksum);
  if (rc == 0 && fsync(out) != 0) rc = zt_err_errno("fsync %s", tmp);
  if (out >= 0) close(out);
  if (rc == 0 && rename(tmp, path) != 0) rc = zt_err_errno("rename %s", tmp);
  if (rc != 0 && out >= 0) unlink(tmp);
  /* The copy is reported next: its name must survive a crash too. */
  if (rc == 0) {
    const char *slash = strrchr(path, '/');
    snprintf(pdir, sizeof pdir, "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
    rc = zt_ckpt_fsync_dir(pdir);
  }
  return rc;
}
