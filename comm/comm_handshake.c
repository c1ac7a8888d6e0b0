/*
 * comm_handshake.c: the TCP backend's connection set-up: the listening
 * socket, the connections between ranks, and the authenticated handshake
 * that admits a connection to the ring.
 *
 * Where it fits. The worker opens its listening socket before the
 * rendezvous (zt_comm_tcp_listen), so that the coordinator can hand every
 * rank the others' addresses; zt_comm_tcp_new (comm_ring.c) then makes an
 * unconnected communicator, and zt_comm_tcp_connect, here, makes and
 * checks its connections: rank r connects to rank r+1 and accepts rank
 * r-1 (on a mesh, every rank connects to and accepts every other one).
 * Once it returns, the ring's collectives (comm_ring.c) run over the
 * sockets it left in out_fd / in_fd, and nothing here runs again. The
 * set-up has one deadline (zt_comm_tcp_opts_t.connect_timeout_ms) and is
 * interrupted by zt_comm_abort() from another thread (the abort eventfd
 * is in every poll set); a failed set-up breaks the communicator.
 *
 * Every socket is tuned here too (tune(): no Nagle, keepalive, a fixed
 * send buffer; the reasons are at the function).
 *
 * The handshake. Every connection proves, both ways, that its two ends
 * hold the generation's key (RendezvousReply.comm_key, which the
 * coordinator gives only to the generation's ranks): without it, anything
 * that reaches a rank's port could take its predecessor's place and feed
 * it bytes.
 *
 *   connector -> acceptor  hello:  session, rank, world, mesh, nonce_c
 *   acceptor -> connector  accept: its rank, nonce_a,
 *                                  HMAC(key, 'A' hello rank_a nonce_a)
 *   connector -> acceptor  proof:  HMAC(key, 'C' hello rank_a nonce_a)
 *
 * Each side's MAC covers the other's fresh nonce, so a recorded handshake
 * proves nothing a second time, and the key itself never crosses the
 * ring. The acceptor checks the hello's fields first (a rank of another
 * generation is turned away with a message naming both sessions: the
 * session id, job and generation, is the fence between generations) and
 * answers at once; the proofs are read only after every rank has accepted
 * its connections, so no rank waits for another's accept loop, which
 * waits for its own predecessor's in turn (a ring of such waits would
 * never end).
 *
 * The hello's fields are no secret, so a connection that merely says it
 * is rank j proves nothing: up to ZT_RING_CANDIDATES connections per rank
 * are answered and wait for their proofs side by side, and the first that
 * proves the key is rank j's. An impostor that comes first, then stalls or
 * sends a wrong proof, is refused and costs the ring nothing; only a flood
 * of such connections could still hold a rank's own out until the
 * deadline.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "comm.h"
#include "comm_impl.h"
#include "comm_ring.h"
#include "zt_common.h"
#include "zt_net.h"

#define ZT_RING_MAGIC 0x5a545247u /* "ZTRG" */
/* 2: every collective starts with an operation header; 3: the mesh; 4:
 * the key's proofs in the handshake */
#define ZT_RING_VERSION 4u
#define ZT_RING_NONCE 16
#define ZT_RING_MAC 32
#define ZT_RING_ACCEPT_MAGIC 0x5a545241u /* "ZTRA" */

static int mod(int a, int n) { return zt__ring_mod(a, n); }

/* The connector's first message. */
typedef struct {
  uint32_t magic, version;
  uint64_t session;
  uint32_t rank, world;
  uint32_t mesh, pad;             /* the sender connects a mesh (comm.h: ring_only) */
  uint8_t nonce[ZT_RING_NONCE];   /* the connector's challenge */
} ring_hello;

/* The acceptor's answer. */
typedef struct {
  uint32_t magic; /* ZT_RING_ACCEPT_MAGIC */
  uint32_t rank;  /* the acceptor's */
  uint8_t nonce[ZT_RING_NONCE];
  uint8_t mac[ZT_RING_MAC];
} ring_accept;
_Static_assert(sizeof(ring_hello) == 48 && sizeof(ring_accept) == 56, "ring handshake layout");

/* An accepted connection whose hello named a rank, until it proves the
 * key: the proof it must send. More than one connection may say it is
 * the same rank (an impostor may come first); the first that proves the
 * key becomes in_fd[rank], and the others are closed. */
#define ZT_RING_CANDIDATES 4
typedef struct {
  int fd; /* -1: a free slot */
  uint8_t want[ZT_RING_MAC];
} candidate;

/* Set-up state: what this rank sent to each rank it connected to, and the
 * connections that said they were each rank. */
typedef struct {
  ring_hello *sent;                      /* [world] */
  candidate (*cand)[ZT_RING_CANDIDATES]; /* [world] */
  char refused[256]; /* why the last candidate was refused, for the error */
} handshake;

/* How long an accepted connection may take to send its hello. A rank
 * sends it as soon as it is connected, so this only bounds what a stray
 * connection (a port scan, a process of an old generation) can hold up
 * the accept loop, which reads one hello at a time. */
#define ZT_RING_HELLO_MS 2000

/* ---- sockets ------------------------------------------------------------- */

int zt_comm_tcp_listen(const char *host, int *port, int *fd_out) {
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)*port);
  if (inet_pton(AF_INET, host, &sa.sin_addr) != 1)
    return zt_err("comm listen: %s is not an IPv4 address", host);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return zt_err_errno("comm listen: socket");
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 64) != 0) {
    zt_err_errno("comm listen on %s:%d", host, *port);
    close(fd);
    return -1;
  }
  socklen_t sl = sizeof sa;
  getsockname(fd, (struct sockaddr *)&sa, &sl);
  *port = ntohs(sa.sin_port);
  *fd_out = fd;
  return 0;
}

/* Ring sockets: no Nagle delay; and, besides the deadline every ring call
 * has, the kernel gives up on a peer that vanished without FIN or RST
 * (a host gone, a link down): keepalive probes after 5 s of silence, and
 * unacknowledged data abandoned after 60 s (TCP_USER_TIMEOUT).
 *
 * A fixed send buffer of ZT_RING_SNDBUF (the kernel doubles it for its
 * bookkeeping: about one 1 MiB chunk queued per connection) instead of
 * autotuning's up to 4 MiB (net.ipv4.tcp_wmem): a sender may run only that
 * far ahead of its receiver, so the bytes a receiver copies out of its
 * socket were written moments before and are still in cache. With 4 MiB
 * per connection the queued bytes of a ring outgrow the caches and the
 * receive copy runs from DRAM: on loopback (2 cores, 4 ranks, 64 MiB) it
 * was half of all CPU time, and capping the buffer raised bus bandwidth
 * 1.5-2.3x at 16 and 64 MiB, 2 and 4 ranks, and halved the CPU time
 * (bench/allreduce; more when other jobs share the cores). The receive
 * buffer keeps autotuning (capping it too cost wake-ups and gained
 * nothing). 1 MiB in flight still covers the bandwidth-delay product of a
 * 10 Gb/s link at up to ~0.5 ms round trip. Only the pacing changes: the
 * bytes and the order they are summed in are the same (test_comm.c checks
 * the order bit for bit). */
#define ZT_RING_SNDBUF (512 << 10)
static void tune(int fd) {
  int one = 1, idle = 5, intvl = 2, cnt = 3, sndbuf = ZT_RING_SNDBUF;
  unsigned user_timeout_ms = 60000;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

/* The ring's wait (zt_net_wait_fn): until the socket is ready, the
 * deadline passes or zt_comm_abort() writes to the abort eventfd. */
static int ring_wait(void *user, int fd, short events, zt_deadline_t dl) {
  zt__ring_t *r = user;
  int64_t left = zt_deadline_left_ms(dl);
  if (left == 0) return zt_err("timed out");
  struct pollfd p[2] = {{.fd = fd, .events = events}, {.fd = r->abort_fd, .events = POLLIN}};
  if (poll(p, 2, (int)ZT_MIN(left, 1000000)) > 0 && p[1].revents) return zt_err("aborted");
  return 0;
}

/* Blocking-with-deadline exact read/write on a non-blocking socket, which
 * zt_comm_abort() interrupts. */
static int io_exact(zt__ring_t *r, int fd, void *buf, size_t len, int writing, zt_deadline_t dl) {
  return zt_net_exact(fd, buf, len, writing, dl, ring_wait, r);
}

/* ---- proofs -------------------------------------------------------------- */

/* HMAC-SHA256 under the generation's key of: tag, the hello, and the
 * acceptor's rank and nonce. */
static int ring_mac(const zt__ring_t *r, char tag, const ring_hello *h, uint32_t rank_a,
                    const uint8_t nonce_a[ZT_RING_NONCE], uint8_t out[ZT_RING_MAC]) {
  uint8_t msg[1 + sizeof *h + 4 + ZT_RING_NONCE];
  msg[0] = (uint8_t)tag;
  memcpy(msg + 1, h, sizeof *h);
  memcpy(msg + 1 + sizeof *h, &rank_a, 4);
  memcpy(msg + 5 + sizeof *h, nonce_a, ZT_RING_NONCE);
  unsigned n = 0;
  if (!HMAC(EVP_sha256(), r->key, (int)strlen(r->key), msg, sizeof msg, out, &n) ||
      n != ZT_RING_MAC)
    return zt_err("comm: HMAC-SHA256 failed");
  return 0;
}

static int mac_equal(const uint8_t *a, const uint8_t *b) {
  return CRYPTO_memcmp(a, b, ZT_RING_MAC) == 0;
}

static int nonce(uint8_t out[ZT_RING_NONCE]) { return zt_random_bytes(out, ZT_RING_NONCE); }

/* ---- the connector's side ------------------------------------------------ */

/* Paces the retries of a connection to rank `to` on the abort eventfd: an
 * attempt that fails at once (no route, refused) never waits in
 * ring_wait's poll, and would otherwise retry until the deadline after
 * zt_comm_abort(). 0: try again; -1: aborted (the error names the last
 * attempt's failure) or failed. */
static int connect_pause(zt__ring_t *r, const char *peer, int to) {
  struct pollfd p = {.fd = r->abort_fd, .events = POLLIN};
  int pr = poll(&p, 1, 20);
  if (pr < 0 && errno != EINTR)
    return zt_err_errno("comm: poll while connecting to rank %d at %s", to, peer);
  if (pr > 0 && p.revents)
    return zt_err_wrap("aborted while connecting to rank %d at %s (last attempt)", to, peer);
  return 0;
}

/* Connects to rank `to` and sends our hello; retries refused connections
 * (the peer may not listen yet) until the deadline or an abort. Each
 * attempt is a non-blocking connect waited on until the deadline or an
 * abort: a blocking connect() to an address that drops packets would wait
 * for the kernel's SYN retries, about two minutes, whatever the deadline. */
static int peer_connect(zt__ring_t *r, const char *peer, int to, handshake *hs, zt_deadline_t dl) {
  zt_net_addr_t a;
  if (zt_net_addr(peer, &a) != 0) return zt_err_wrap("address of rank %d", to);
  ring_hello *h = &hs->sent[to];
  *h = (ring_hello){ZT_RING_MAGIC, ZT_RING_VERSION, r->session, (uint32_t)r->c.rank,
                    (uint32_t)r->c.world, (uint32_t)r->mesh, 0, {0}};
  if (nonce(h->nonce) != 0) return -1;
  for (;;) {
    int fd = zt_net_connect(&a, dl, ring_wait, r, NULL);
    if (fd >= 0) {
      tune(fd);
      if (io_exact(r, fd, h, sizeof *h, 1, dl) != 0) {
        close(fd);
        return zt_err_wrap("hello to rank %d at %s", to, peer);
      }
      r->out_fd[to] = fd;
      return 0;
    }
    if (zt_deadline_passed(dl)) return zt_err_wrap("cannot connect to rank %d", to);
    if (connect_pause(r, peer, to) != 0) return -1;
  }
}

/* The connector's half of the proofs: checks rank `to`'s accept message
 * (its MAC proves the key) and sends our proof. */
static int prove_to(zt__ring_t *r, const char *peer, int to, handshake *hs, zt_deadline_t dl) {
  ring_accept a;
  uint8_t mac[ZT_RING_MAC];
  if (io_exact(r, r->out_fd[to], &a, sizeof a, 0, dl) != 0)
    return zt_err_wrap("rank %d at %s refused the handshake (another generation, ring version "
                       "or key?)", to, peer);
  if (a.magic != ZT_RING_ACCEPT_MAGIC || a.rank != (uint32_t)to)
    return zt_err("rank %d at %s answered the handshake as something else (rank %u)", to, peer,
                  a.rank);
  if (ring_mac(r, 'A', &hs->sent[to], a.rank, a.nonce, mac) != 0) return -1;
  if (!mac_equal(mac, a.mac))
    return zt_err("the listener at %s, rank %d's address, does not hold this generation's ring "
                  "key", peer, to);
  if (ring_mac(r, 'C', &hs->sent[to], a.rank, a.nonce, mac) != 0 ||
      io_exact(r, r->out_fd[to], mac, sizeof mac, 1, dl) != 0)
    return zt_err_wrap("proof to rank %d at %s", to, peer);
  return 0;
}

/* ---- the acceptor's side ------------------------------------------------- */

/* 1 when rank j connects to this one: its ring predecessor, or on a mesh
 * any other rank. */
static int expects(const zt__ring_t *r, int j) {
  return j != r->c.rank && (r->mesh || j == r->prev);
}

/* A free candidate slot of rank `from`; NULL when all are taken. */
static candidate *free_candidate(handshake *hs, int from) {
  for (int i = 0; i < ZT_RING_CANDIDATES; i++)
    if (hs->cand[from][i].fd < 0) return &hs->cand[from][i];
  return NULL;
}

/* The hello of a connection just accepted: 1 when it is one this rank
 * waits for (its ring predecessor's, or on a mesh any rank's not yet
 * proven) of this generation and ring version, and there is room for
 * another connection that says it is that rank. */
static int hello_ok(const zt__ring_t *r, const ring_hello *h, handshake *hs) {
  int from = (int)h->rank, world = r->c.world;
  int ok = h->magic == ZT_RING_MAGIC && h->version == ZT_RING_VERSION &&
           h->session == r->session && (int)h->world == world &&
           h->mesh == (uint32_t)r->mesh && h->rank < (uint32_t)world && expects(r, from) &&
           r->in_fd[from] < 0;
  if (ok && !free_candidate(hs, from)) {
    ZT_WARN("comm: refused a connection that said it was rank %d: %d others that said so "
            "are still to prove the ring key", from, ZT_RING_CANDIDATES);
    return 0;
  }
  if (!ok)
    ZT_WARN("comm: refused a peer (ring version %u, rank %u of %u, session %llx, %s; "
            "expected version %u, %s of %d, session %llx, %s)",
            h->magic == ZT_RING_MAGIC ? h->version : 0, h->rank, h->world,
            (unsigned long long)h->session, h->mesh ? "mesh" : "ring", ZT_RING_VERSION,
            r->mesh ? "a rank not yet connected" : "the ring predecessor", world,
            (unsigned long long)r->session, r->mesh ? "mesh" : "ring");
  return ok;
}

/* Answers a valid hello with our accept message, and keeps the
 * connection as a candidate for its rank with the proof it must send. */
static int answer_hello(zt__ring_t *r, int fd, const ring_hello *h, handshake *hs,
                        zt_deadline_t dl) {
  candidate *k = free_candidate(hs, (int)h->rank);
  ring_accept a = {.magic = ZT_RING_ACCEPT_MAGIC, .rank = (uint32_t)r->c.rank};
  if (nonce(a.nonce) != 0 || ring_mac(r, 'A', h, a.rank, a.nonce, a.mac) != 0 ||
      ring_mac(r, 'C', h, a.rank, a.nonce, k->want) != 0 ||
      io_exact(r, fd, &a, sizeof a, 1, dl) != 0)
    return -1;
  k->fd = fd;
  return 0;
}

/* Accepts one connection: reads its hello (for at most
 * ZT_RING_HELLO_MS) and, when it is one this rank waits for, answers it
 * and keeps it as a candidate (1); 0 when there was nothing to accept or
 * the connection was dropped. */
static int accept_one(zt__ring_t *r, int lfd, handshake *hs, zt_deadline_t dl) {
  int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
  if (fd < 0) {
    /* Out of descriptors or buffers: the connection stays queued, so
     * pace the retries instead of spinning on it until the deadline. */
    if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
      ZT_WARN("comm: accept: %s", strerror(errno));
      zt_sleep_ms(20);
    }
    return 0;
  }
  tune(fd);
  ring_hello h;
  int64_t left = zt_deadline_left_ms(dl);
  if (io_exact(r, fd, &h, sizeof h, 0, zt_deadline_in(ZT_MIN(left, ZT_RING_HELLO_MS))) != 0) {
    ZT_WARN("comm: dropped a connection without a hello: %s", zt_err_msg());
    close(fd);
    return 0;
  }
  if (!hello_ok(r, &h, hs) || answer_hello(r, fd, &h, hs, dl) != 0) {
    close(fd);
    return 0;
  }
  return 1;
}

/* Polls the listening socket and the abort eventfd; 1 when a connection
 * waits, 0 on a timeout, -1 on an abort or error. */
static int wait_listen(zt__ring_t *r, int lfd, int64_t ms) {
  struct pollfd p[2] = {{.fd = lfd, .events = POLLIN}, {.fd = r->abort_fd, .events = POLLIN}};
  int pr = poll(p, 2, (int)ZT_MIN(ms, 1000000));
  if (pr < 0 && errno != EINTR) return zt_err_errno("comm: poll while accepting peers");
  if (pr <= 0) return 0;
  if (p[1].revents) return zt_err("aborted while waiting for peers to connect");
  return 1;
}

/* The first rank (the predecessor first) that connects to this one and
 * has no candidate connection yet; -1 when there is none. */
static int first_missing(const zt__ring_t *r, const handshake *hs) {
  for (int k = 1; k < r->c.world; k++) {
    int j = mod(r->c.rank - k, r->c.world), have = 0;
    for (int i = 0; i < ZT_RING_CANDIDATES; i++) have |= hs->cand[j][i].fd >= 0;
    if (expects(r, j) && !have) return j;
  }
  return -1;
}

/* Accepts connections until every rank that connects to this one (the
 * predecessor on a ring, every other rank on a mesh) has at least one
 * candidate connection with a valid hello, and answers each; a
 * connection of another session, world or ring version, or from this
 * rank itself, is dropped. */
static int accept_peers(zt__ring_t *r, int lfd, handshake *hs, zt_deadline_t dl) {
  for (;;) {
    int missing = first_missing(r, hs);
    if (missing < 0) return 0;
    int64_t left = zt_deadline_left_ms(dl);
    if (left == 0) return zt_err("rank %d did not connect in time", missing);
    int w = wait_listen(r, lfd, left);
    if (w < 0) return -1;
    if (w > 0) (void)accept_one(r, lfd, hs, dl);
  }
}

/* Reads the proof of candidate k of rank `from` (it is readable: at most
 * ZT_RING_HELLO_MS for all of it). A proof of the key makes it in_fd[from]
 * and closes the rank's other candidates; any other answer closes it. */
static void take_proof(zt__ring_t *r, int from, candidate *k, handshake *hs) {
  uint8_t mac[ZT_RING_MAC];
  if (io_exact(r, k->fd, mac, sizeof mac, 0, zt_deadline_in(ZT_RING_HELLO_MS)) != 0 ||
      !mac_equal(mac, k->want)) {
    snprintf(hs->refused, sizeof hs->refused,
             "the connection that said it was rank %d does not hold this generation's ring key",
             from);
    ZT_WARN("comm: %s (refused)", hs->refused);
    close(k->fd);
    k->fd = -1;
    return;
  }
  r->in_fd[from] = k->fd;
  k->fd = -1;
  for (int i = 0; i < ZT_RING_CANDIDATES; i++)
    if (hs->cand[from][i].fd >= 0) {
      close(hs->cand[from][i].fd);
      hs->cand[from][i].fd = -1;
    }
}

/* The poll set of await_proofs: the listening socket, the abort event,
 * then every candidate connection of a rank not yet proven (who[k]: its
 * rank * ZT_RING_CANDIDATES + its slot). *unproven: the first such rank,
 * the predecessor first, or -1. Returns the number of entries. */
static int proof_poll_set(const zt__ring_t *r, int lfd, const handshake *hs, struct pollfd *p,
                          int *who, int *unproven) {
  int n = 2;
  *unproven = -1;
  p[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
  p[1] = (struct pollfd){.fd = r->abort_fd, .events = POLLIN};
  for (int k = 1; k < r->c.world; k++) {
    int j = mod(r->c.rank - k, r->c.world);
    if (!expects(r, j) || r->in_fd[j] >= 0) continue;
    if (*unproven < 0) *unproven = j;
    for (int i = 0; i < ZT_RING_CANDIDATES; i++)
      if (hs->cand[j][i].fd >= 0)
        who[n] = j * ZT_RING_CANDIDATES + i,
        p[n++] = (struct pollfd){.fd = hs->cand[j][i].fd, .events = POLLIN};
  }
  return n;
}

/* One round of await_proofs, after its poll(): reads the proofs that
 * arrived, then accepts a waiting connection. */
static void proof_round(zt__ring_t *r, int lfd, handshake *hs, const struct pollfd *p,
                        const int *who, int n, zt_deadline_t dl) {
  for (int i = 2; i < n; i++)
    if (p[i].revents) {
      int j = who[i] / ZT_RING_CANDIDATES;
      candidate *k = &hs->cand[j][who[i] % ZT_RING_CANDIDATES];
      if (k->fd == p[i].fd && r->in_fd[j] < 0) take_proof(r, j, k, hs);
    }
  if (p[0].revents) (void)accept_one(r, lfd, hs, dl);
}

/* The acceptor's half of the proofs: waits until every rank that connects
 * to this one has proven the key on one of its candidate connections.
 * Connections are still accepted meanwhile: where an impostor that said it
 * was rank j came first, rank j's own connection may be the next one, or
 * still queued. */
static int await_proofs(zt__ring_t *r, int lfd, handshake *hs, zt_deadline_t dl) {
  size_t cap = 2 + (size_t)r->c.world * ZT_RING_CANDIDATES;
  struct pollfd *p = zt_xmalloc(cap * sizeof *p);
  int *who = zt_xmalloc(cap * sizeof *who), rc = -1;
  for (;;) {
    int unproven, n = proof_poll_set(r, lfd, hs, p, who, &unproven);
    if (unproven < 0) {
      rc = 0;
      break;
    }
    int64_t left = zt_deadline_left_ms(dl);
    if (left == 0) {
      zt_err("rank %d did not prove this generation's ring key in time%s%s", unproven,
             hs->refused[0] ? ": " : "", hs->refused);
      break;
    }
    int pr = poll(p, (nfds_t)n, (int)ZT_MIN(left, 1000000));
    if (pr < 0 && errno != EINTR) {
      zt_err_errno("comm: poll while waiting for the peers' proofs");
      break;
    }
    if (pr <= 0) continue;
    if (p[1].revents) {
      zt_err("aborted while waiting for the peers' proofs of the ring key");
      break;
    }
    proof_round(r, lfd, hs, p, who, n, dl);
  }
  free(p);
  free(who);
  return rc;
}

/* ---- the whole set-up ---------------------------------------------------- */

/* Connects, accepts, then proves the key on every connection. Connect and
 * say hello first (it sits in the peer's socket buffer), then accept, then
 * exchange proofs: no rank waits for another to accept before it accepts
 * itself. A mesh connects to every rank in ring order from its successor
 * on. */
static int handshake_all(zt__ring_t *r, handshake *hs, zt_deadline_t dl) {
  int world = r->c.world;
  for (int k = 1; k < world && (k == 1 || r->mesh); k++) {
    int j = (r->c.rank + k) % world;
    if (peer_connect(r, r->peers[j], j, hs, dl) != 0) return -1;
  }
  if (accept_peers(r, r->listen_fd, hs, dl) != 0) return -1;
  for (int k = 1; k < world && (k == 1 || r->mesh); k++) {
    int j = (r->c.rank + k) % world;
    if (prove_to(r, r->peers[j], j, hs, dl) != 0) return -1;
  }
  return await_proofs(r, r->listen_fd, hs, dl);
}

/* The handshake's tables: nothing sent, no candidates. */
static void handshake_init(handshake *hs, int world) {
  hs->sent = zt_xcalloc((size_t)world, sizeof *hs->sent);
  hs->cand = zt_xcalloc((size_t)world, sizeof *hs->cand);
  for (int j = 0; j < world; j++)
    for (int i = 0; i < ZT_RING_CANDIDATES; i++) hs->cand[j][i].fd = -1;
}

/* Closes the connections that proved nothing and frees the tables. */
static void handshake_free(handshake *hs, int world) {
  free(hs->sent);
  for (int j = 0; hs->cand && j < world; j++)
    for (int i = 0; i < ZT_RING_CANDIDATES; i++)
      if (hs->cand[j][i].fd >= 0) close(hs->cand[j][i].fd);
  free(hs->cand);
}

/* Makes and checks every connection of c; the thread's error on failure. */
static int connect_all(zt__ring_t *r, handshake *hs) {
  if (zt__comm_usable(&r->c, "comm set-up") != 0) return -1;
  if (r->c.world == 1) return 0;
  if (strlen(r->key) < 32)
    return zt_err("no ring key, or one shorter than 32 characters (RendezvousReply.comm_key)");
  handshake_init(hs, r->c.world);
  if (handshake_all(r, hs, zt_deadline_in(r->setup_ms)) != 0) return -1;
  r->next_fd = r->out_fd[r->next];
  r->prev_fd = r->in_fd[r->prev];
  return 0;
}

int zt_comm_tcp_connect(zt_comm_t *c) {
  zt__ring_t *r = zt__ring(c);
  handshake hs = {0};
  int rc = connect_all(r, &hs);
  if (rc == 0) atomic_store_explicit(&r->connected, 1, memory_order_release);
  /* The set-up's state goes, whatever the outcome. */
  if (r->listen_fd >= 0) close(r->listen_fd);
  r->listen_fd = -1;
  r->peers = NULL;
  explicit_bzero(r->key, sizeof r->key);
  handshake_free(&hs, c->world);
  if (rc != 0) { /* broken from now on, with this message unless aborted first */
    zt_err_wrap("comm rank %d/%d", c->rank, c->world);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", zt_err_msg());
    zt__comm_fail(c, "%s", msg);
    zt_err("%s", msg);
  }
  return rc;
}
