/*
 * comm_transfer.c: the TCP backend's transfer engine: the two poll()
 * loops that move the bytes of every ring and mesh collective. Which bytes
 * go where is comm_ring.c's (the algorithms); this file only moves them,
 * reduces received bytes into place as they arrive, and watches the
 * deadline and the abort event while it does.
 *
 * A ring step (zt__ring_step) sends one buffer to `next` while it receives
 * another from `prev`, both from one poll() loop, and adds what arrives
 * into an accumulator chunk by chunk, so the reduction overlaps the
 * transfer. A mesh call (zt__ring_mesh) sends to and receives from every
 * other rank at once over the direct connections, and for the direct
 * reduce-scatter sums the pieces in the ring's order as soon as a chunk
 * has arrived from every rank, so its sums are the ring's to the bit.
 *
 * Pacing. Sends and receives move at most one chunk (zt_comm_tcp_opts_t.
 * chunk_bytes) per call; a receive socket wakes its poll only once a
 * quarter chunk has arrived (set_lowat); a mesh receive acknowledges at
 * once (TCP_QUICKACK). None of it changes the bytes or the order in which
 * they are summed.
 *
 * Failure. Every poll() waits at most until the operation's deadline; the
 * poll set also holds the eventfd that zt_comm_abort() writes. A closed or
 * reset socket, the deadline or an abort ends the loop with a message
 * naming the operation and the peer (c.failed_peer set to it); the front
 * (comm.c) breaks the communicator with it. Counters: bytes sent and
 * received, the time inside the loops, and the part of it spent with only
 * sends pending (send_wait_us).
 */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "comm.h"
#include "comm_impl.h"
#include "comm_ring.h"
#include "zt_common.h"

static int mod(int a, int n) { return zt__ring_mod(a, n); }

/* ---- reductions of received bytes ---------------------------------------- */

/* acc[i] += (double)src[i]: a received fp32 element, exactly. */
static void add_widened(double *acc, const float *src, size_t n) {
  for (size_t i = 0; i < n; i++) acc[i] += (double)src[i];
}

/* acc[i] = (double)own[i] + src[i], src fp32 (widened) or fp64: the one
 * rounding add_widened or an fp64 reduce_add makes once own has been
 * widened into acc (IEEE addition is commutative), without that copy. */
static void add_own(double *acc, const float *own, const uint8_t *src, size_t n, int src32) {
  if (src32) {
    const float *f = (const float *)src;
    for (size_t i = 0; i < n; i++) acc[i] = (double)own[i] + (double)f[i];
  } else {
    const double *d = (const double *)src;
    for (size_t i = 0; i < n; i++) acc[i] = (double)own[i] + d[i];
  }
}

/* ---- failures ------------------------------------------------------------ */

/* A failure on the connection with rank `peer`: it becomes the failed
 * peer (comm.h, zt_comm_failed_peer; `ended` when the peer closed or
 * reset the connection, zt_comm_failed_peer_closed), and the message the
 * thread's error, with which the front breaks the communicator. */
static int peer_fail(zt__ring_t *r, int peer, int ended, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int peer_fail(zt__ring_t *r, int peer, int ended, const char *fmt, ...) {
  char msg[sizeof r->c.err];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  r->c.failed_peer = peer;
  r->c.failed_closed = ended;
  return zt_err("%s", msg);
}

/* 1 when errno says the peer ended the connection. */
static int io_ended(void) { return errno == ECONNRESET || errno == EPIPE; }

/* 1 when errno says a non-blocking send() or recv() merely found nothing
 * to do. */
static int io_again(void) { return errno == EAGAIN || errno == EINTR; }

/* ---- a ring step --------------------------------------------------------- */

/* A step's progress: bytes sent, received, and reduced into acc. */
typedef struct {
  size_t sent, got, reduced;
} step_pos;

/* The receive socket reports readable only once a quarter chunk (or what
 * is still to come, if less: the wait always ends) has arrived. On a link
 * slower than the CPU a receiver otherwise wakes for every few packets,
 * and each wake-up takes a core from the compute that the transfer
 * overlaps. On 2 Gbit/s links (network namespaces, tbf) this cut the CPU
 * time of 20 all-reduces of 16 MiB from 0.37 to 0.26-0.30 s per rank at 2
 * ranks and from 0.45 to 0.38 s at 4, at the same bandwidth; on loopback
 * the bus bandwidths stayed within their run-to-run spread (a whole chunk
 * saved a little more CPU on the link but cost loopback bandwidth at 4
 * ranks). */
static void set_lowat(zt__ring_t *r, int from, size_t want) {
  int v = (int)ZT_MIN(want, ZT_MIN(r->chunk / 4, (size_t)INT32_MAX));
  if (v < 1) v = 1;
  /* A view's sockets are its root's: one record of each socket's value. */
  zt_comm_t *root = r->c.root;
  int *now = root ? &zt__ring(root)->in_lowat[r->c.rmap[from]] : &r->in_lowat[from];
  if (v == *now) return;
  if (setsockopt(r->in_fd[from], SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v) == 0) *now = v;
}

/* Reduces the received bytes of whole chunks as they complete, and the
 * tail at the end. */
static void step_reduce(const zt__ring_t *r, const zt__ring_step_t *s, step_pos *p) {
  size_t esz = zt_dtype_size(s->dt);
  size_t ready = p->got == s->rlen ? p->got : (p->got / r->chunk) * r->chunk;
  if (ready <= p->reduced) return;
  size_t at = p->reduced, n = (ready - p->reduced) / esz;
  if (s->own)
    add_own((double *)s->acc + at / esz, s->own + at / esz, s->rbuf + at, n, s->widen);
  else if (s->widen)
    add_widened((double *)s->acc + at / esz, (const float *)(s->rbuf + at), n);
  else
    zt_comm_reduce_add(s->acc + at, s->rbuf + at, n, s->dt);
  p->reduced = ready;
}

/* Sends the next chunk of the step to `next` (its socket is writable). */
static int step_send(zt__ring_t *r, const zt__ring_step_t *s, step_pos *p, const char *op) {
  size_t want = ZT_MIN(s->slen - p->sent, r->chunk);
  ssize_t w = send(r->next_fd, s->sbuf + p->sent, want, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (w < 0 && io_ended())
    return peer_fail(r, r->next, 1, "%s: send to rank %d: %s", op, r->next, strerror(errno));
  if (w < 0 && !io_again())
    return peer_fail(r, r->next, 0, "%s: send to rank %d: %s", op, r->next, strerror(errno));
  if (w > 0) p->sent += (size_t)w, zt__comm_count(&r->c.st->bytes_sent, (uint64_t)w);
  return 0;
}

/* Receives the next chunk of the step from `prev` (its socket is
 * readable), and reduces what is complete. */
static int step_recv(zt__ring_t *r, const zt__ring_step_t *s, step_pos *p, const char *op) {
  size_t want = ZT_MIN(s->rlen - p->got, r->chunk);
  ssize_t rd = recv(r->prev_fd, s->rbuf + p->got, want, MSG_DONTWAIT);
  if (rd == 0) return peer_fail(r, r->prev, 1, "%s: rank %d closed the connection", op, r->prev);
  if (rd < 0 && io_ended())
    return peer_fail(r, r->prev, 1, "%s: receive from rank %d: %s", op, r->prev, strerror(errno));
  if (rd < 0 && !io_again())
    return peer_fail(r, r->prev, 0, "%s: receive from rank %d: %s", op, r->prev, strerror(errno));
  if (rd > 0) p->got += (size_t)rd, zt__comm_count(&r->c.st->bytes_recv, (uint64_t)rd);
  if (s->acc) step_reduce(r, s, p);
  return 0;
}

/* Runs one step from one poll() loop until every byte is sent and
 * received, or until the deadline or an abort. */
static int step_loop(zt__ring_t *r, const zt__ring_step_t *s, zt_deadline_t dl, const char *op) {
  step_pos p = {0, 0, 0};
  while (p.sent < s->slen || p.got < s->rlen) {
    struct pollfd pf[3];
    int n = 0, ip = -1, is = -1;
    pf[n++] = (struct pollfd){.fd = r->abort_fd, .events = POLLIN};
    if (p.sent < s->slen) is = n, pf[n++] = (struct pollfd){.fd = r->next_fd, .events = POLLOUT};
    if (p.got < s->rlen) {
      ip = n, pf[n++] = (struct pollfd){.fd = r->prev_fd, .events = POLLIN};
      set_lowat(r, r->prev, s->rlen - p.got);
    }
    int64_t left = zt_deadline_left_ms(dl);
    if (left == 0)
      return peer_fail(r, p.got < s->rlen ? r->prev : r->next, 0,
                       "%s: timed out (rank %d: %zu/%zu bytes from rank %d, %zu/%zu to rank %d)",
                       op, r->c.rank, p.got, s->rlen, r->prev, p.sent, s->slen, r->next);
    int64_t w0 = ip < 0 ? zt_now_us() : 0; /* only the send is left: its wait */
    int pr = poll(pf, (nfds_t)n, left == INT64_MAX ? -1 : (int)ZT_MIN(left, 1000000));
    if (ip < 0) zt__comm_count(&r->c.st->send_wait_us, (uint64_t)(zt_now_us() - w0));
    if (pr < 0) {
      if (errno == EINTR) continue;
      return zt_err("%s: poll: %s", op, strerror(errno));
    }
    if (pf[0].revents) return zt_err("%s: aborted", op);
    if (is >= 0 && pf[is].revents && step_send(r, s, &p, op) != 0) return -1;
    if (ip >= 0 && pf[ip].revents && step_recv(r, s, &p, op) != 0) return -1;
  }
  return 0;
}

/* One step, its time counted as time inside collectives. */
int zt__ring_step(zt__ring_t *r, const zt__ring_step_t *s, zt_deadline_t dl, const char *op) {
  int64_t t0 = zt_now_us();
  int rc = step_loop(r, s, dl, op);
  zt__comm_count(&r->c.st->comm_us, (uint64_t)(zt_now_us() - t0));
  return rc;
}

/* ---- the direct calls (mesh) --------------------------------------------- */

/* out[lo, hi) = the sums of segment `rank` in the ring's order: rank+1's
 * value, plus rank+2's, ..., plus this rank's own last (in + j * count
 * holds rank j's values). ring_reduce_scatter32 adds the same values in
 * the same order, each addition rounded once in fp64, so the two give the
 * same bits (test_comm checks it). */
static void mesh_sum(const zt__ring_t *r, double *out, const float *in, const float *own,
                     size_t count, size_t lo, size_t hi) {
  int w = r->c.world, me = r->c.rank;
  const float *a = in + (size_t)((me + 1) % w) * count;
  for (size_t i = lo; i < hi; i++) out[i] = (double)a[i];
  for (int k = 2; k < w; k++) {
    const float *p = in + (size_t)((me + k) % w) * count;
    for (size_t i = lo; i < hi; i++) out[i] += (double)p[i];
  }
  for (size_t i = lo; i < hi; i++) out[i] += (double)own[i];
}

/* Fails a mesh call at its deadline, naming every rank it still waited
 * for (up to 8); the first of them, in ring order from the predecessor
 * back, is reported as the failed peer. */
static int mesh_timeout(zt__ring_t *r, size_t bytes, const char *op) {
  int w = r->c.world, me = r->c.rank;
  const size_t *sent = r->mpos, *got = r->mpos + w;
  char list[320] = "";
  size_t len = 0;
  int named = 0;
  for (int k = 1; k < w && named < 8; k++) {
    int j = mod(me - k, w);
    if (got[j] >= bytes && sent[j] >= bytes) continue;
    if (!named++) r->c.failed_peer = j;
    int n = snprintf(list + len, sizeof list - len, "%s%zu/%zu bytes from rank %d, %zu/%zu to it",
                     len ? "; " : "", got[j], bytes, j, sent[j], bytes);
    len = n > 0 ? ZT_MIN(len + (size_t)n, sizeof list - 1) : len;
  }
  return zt_err("%s: timed out (rank %d: %s)", op, me, list);
}

/* Sends the next chunk to rank j (its socket is writable). */
static int mesh_send(zt__ring_t *r, int fd, int j, const zt__mesh_call_t *m, const char *op) {
  size_t *sent = r->mpos;
  const uint8_t *b = m->send + (size_t)j * m->sstride;
  size_t want = ZT_MIN(m->bytes - sent[j], r->chunk);
  ssize_t w = send(fd, b + sent[j], want, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (w < 0 && io_ended())
    return peer_fail(r, j, 1, "%s: send to rank %d: %s", op, j, strerror(errno));
  if (w < 0 && !io_again())
    return peer_fail(r, j, 0, "%s: send to rank %d: %s", op, j, strerror(errno));
  if (w > 0) sent[j] += (size_t)w, zt__comm_count(&r->c.st->bytes_sent, (uint64_t)w);
  return 0;
}

/* Receives the next chunk from rank j (its socket is readable). */
static int mesh_recv(zt__ring_t *r, int fd, int j, const zt__mesh_call_t *m, const char *op) {
  size_t *got = r->mpos + r->c.world;
  uint8_t *b = m->recv + (size_t)j * m->rstride;
  ssize_t rd = recv(fd, b + got[j], ZT_MIN(m->bytes - got[j], r->chunk), MSG_DONTWAIT);
  if (rd == 0) return peer_fail(r, j, 1, "%s: rank %d closed the connection", op, j);
  if (rd < 0 && io_ended())
    return peer_fail(r, j, 1, "%s: receive from rank %d: %s", op, j, strerror(errno));
  if (rd < 0 && !io_again())
    return peer_fail(r, j, 0, "%s: receive from rank %d: %s", op, j, strerror(errno));
  if (rd <= 0) return 0; /* EAGAIN, EINTR */
  got[j] += (size_t)rd;
  zt__comm_count(&r->c.st->bytes_recv, (uint64_t)rd);
  /* Acknowledge at once, not after the delayed-ACK timer: a sender's
   * smoothed RTT is what link_rtt_ms reports (docs/deploy.md), and with
   * delayed ACKs on the mesh's receives a healthy link between
   * namespaces read 1-4 ms instead of 0.1-0.2 ms, too close to the
   * 8-30 ms of a link slowed to 10 Mbit/s (tests/multihost,
   * test_partitions). Quick-ack mode ends by itself, hence every time. */
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof one);
  return 0;
}

/* One poll() round of the exchange: sends to and receives from every rank
 * whose socket is ready. `pf[k]`/`who[k]` are the poll set mesh_poll_set
 * built. */
static int mesh_io(zt__ring_t *r, const struct pollfd *pf, const int *who, int n,
                   const zt__mesh_call_t *m, const char *op) {
  for (int k = 1; k < n; k++) {
    if (!pf[k].revents) continue;
    int rc = pf[k].events & POLLOUT ? mesh_send(r, pf[k].fd, who[k], m, op)
                                    : mesh_recv(r, pf[k].fd, who[k], m, op);
    if (rc != 0) return -1;
  }
  return 0;
}

/* The poll set of a mesh call now: the abort event, then every socket
 * with bytes still to send or receive (who[k]: its rank). *have: the
 * bytes received from every rank. Returns the number of entries. */
static int mesh_poll_set(zt__ring_t *r, const zt__mesh_call_t *m, struct pollfd *pf, int *who,
                         size_t *have) {
  const size_t *sent = r->mpos, *got = r->mpos + r->c.world;
  int n = 0;
  *have = m->bytes;
  pf[n++] = (struct pollfd){.fd = r->abort_fd, .events = POLLIN};
  for (int j = 0; j < r->c.world; j++) {
    *have = ZT_MIN(*have, got[j]);
    if (sent[j] < m->bytes)
      who[n] = j, pf[n++] = (struct pollfd){.fd = r->out_fd[j], .events = POLLOUT};
    if (got[j] < m->bytes) {
      set_lowat(r, j, m->bytes - got[j]);
      who[n] = j, pf[n++] = (struct pollfd){.fd = r->in_fd[j], .events = POLLIN};
    }
  }
  return n;
}

/* Waits for the mesh call's sockets (or the abort event) within the
 * deadline and moves what is ready. The wait while only sends are left
 * counts as send_wait_us, as on the ring. */
static int mesh_round(zt__ring_t *r, const zt__mesh_call_t *m, struct pollfd *pf,
                      const int *who, int n, int64_t left, const char *op) {
  int only_sends = 1;
  for (int k = 1; k < n; k++) only_sends &= (pf[k].events & POLLOUT) != 0;
  int64_t w0 = only_sends ? zt_now_us() : 0;
  int pr = poll(pf, (nfds_t)n, left == INT64_MAX ? -1 : (int)ZT_MIN(left, 1000000));
  if (only_sends) zt__comm_count(&r->c.st->send_wait_us, (uint64_t)(zt_now_us() - w0));
  if (pr < 0 && errno != EINTR) return zt_err("%s: poll: %s", op, strerror(errno));
  if (pr > 0 && pf[0].revents) return zt_err("%s: aborted", op);
  return pr > 0 ? mesh_io(r, pf, who, n, m, op) : 0;
}

/* Runs a mesh call from one poll() loop until every byte is sent, received
 * and summed, or until the deadline or an abort. */
int zt__ring_mesh(zt__ring_t *r, const zt__mesh_call_t *m, zt_deadline_t dl, const char *op) {
  int w = r->c.world, rc = 0;
  size_t summed = 0, have;
  size_t step = ZT_MAX(r->chunk / sizeof(float), 1), count = m->sum ? m->sum->count : 0;
  struct pollfd *pf = zt_xmalloc((size_t)(2 * w + 1) * sizeof *pf);
  int *who = zt_xmalloc((size_t)(2 * w + 1) * sizeof *who);
  memset(r->mpos, 0, 2 * (size_t)w * sizeof *r->mpos);
  r->mpos[r->c.rank] = r->mpos[w + r->c.rank] = m->bytes; /* nothing to itself */
  int64_t t0 = zt_now_us();
  for (;;) {
    int n = mesh_poll_set(r, m, pf, who, &have);
    size_t ready = !m->sum ? 0 : have == m->bytes ? count : (have / sizeof(float)) / step * step;
    if (ready > summed) {
      mesh_sum(r, m->sum->out, (const float *)m->recv, m->sum->own, count, summed, ready);
      summed = ready;
      continue;
    }
    if (n == 1) break; /* everything sent, received and summed */
    int64_t left = zt_deadline_left_ms(dl);
    if (left == 0) {
      rc = mesh_timeout(r, m->bytes, op);
      break;
    }
    if ((rc = mesh_round(r, m, pf, who, n, left, op)) != 0) break;
  }
  zt__comm_count(&r->c.st->comm_us, (uint64_t)(zt_now_us() - t0));
  free(pf);
  free(who);
  return rc;
}
