/*
 * test_net.c: common/net.c: the host:port parser, numeric addresses,
 * connecting with a deadline (refused, timed out, aborted by the caller's
 * wait), waiting for a socket, and exact transfers with a deadline.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "zt_common.h"
#include "zt_net.h"
#include "zt_test.h"

/* ---- addresses ---- */

ZT_TEST(test_hostport) {
  char host[64];
  int port;
  ZT_CHECK(zt_net_parse_hostport("127.0.0.1:7070", host, sizeof host, &port) == 0);
  ZT_CHECK_STR(host, "127.0.0.1");
  ZT_CHECK(port == 7070);
  ZT_CHECK(zt_net_parse_hostport("[::1]:80", host, sizeof host, &port) == 0 && port == 80);
  ZT_CHECK_STR(host, "[::1]");
  const char *bad[] = {"", "nohost", ":80", "h:", "h:0", "h:65536", "h:12x", "h:-1"};
  for (size_t i = 0; i < ZT_ARRAY_LEN(bad); i++) {
    ZT_CHECK(zt_net_parse_hostport(bad[i], host, sizeof host, &port) != 0);
  }
  char tiny[4];
  ZT_CHECK(zt_net_parse_hostport("longhost:1", tiny, sizeof tiny, &port) != 0);
  /* An address to listen on may ask for any port. */
  ZT_CHECK(zt_net_parse_listen("0.0.0.0:0", host, sizeof host, &port) == 0 && port == 0);
  ZT_CHECK(zt_net_parse_listen("h:65536", host, sizeof host, &port) != 0);
  ZT_CHECK(strstr(zt_err_msg(), "0..65535") != NULL);
  ZT_CHECK(zt_net_parse_listen(":0", host, sizeof host, &port) != 0);
  /* The host alone, with or without a port. */
  zt_net_host("10.1.2.3:7070", host, sizeof host);
  ZT_CHECK_STR(host, "10.1.2.3");
  zt_net_host("localhost", host, sizeof host);
  ZT_CHECK_STR(host, "localhost");
  zt_net_host("longhost:1", tiny, sizeof tiny);
  ZT_CHECK_STR(tiny, "lon");
}

ZT_TEST(test_addr) {
  zt_net_addr_t a;
  ZT_CHECK(zt_net_addr("127.0.0.1:7070", &a) == 0);
  ZT_CHECK(a.sa.ss_family == AF_INET && a.len == sizeof(struct sockaddr_in));
  ZT_CHECK(ntohs(((struct sockaddr_in *)&a.sa)->sin_port) == 7070);
  ZT_CHECK_STR(a.text, "127.0.0.1:7070");
  ZT_CHECK(zt_net_addr("[::1]:80", &a) == 0);
  ZT_CHECK(a.sa.ss_family == AF_INET6 && a.len == sizeof(struct sockaddr_in6));
  ZT_CHECK(ntohs(((struct sockaddr_in6 *)&a.sa)->sin6_port) == 80);
  ZT_CHECK(zt_net_addr("::1:80", &a) == 0 && a.sa.ss_family == AF_INET6);
  /* No name lookup: a name is an error naming the address. */
  ZT_CHECK(zt_net_addr("localhost:80", &a) != 0);
  ZT_CHECK(strstr(zt_err_msg(), "localhost:80") != NULL);
  ZT_CHECK(zt_net_addr("10.0.0.1", &a) != 0);
  ZT_CHECK(zt_net_addr("[::1:80", &a) != 0);
  ZT_CHECK(zt_net_addr("999.0.0.1:80", &a) != 0);
}

/* ---- connecting ---- */

/* A listening socket on 127.0.0.1 (backlog `backlog`), its address in a. */
static int listener(int backlog, zt_net_addr_t *a) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t sl = sizeof sa;
  if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, backlog) != 0 ||
      getsockname(fd, (struct sockaddr *)&sa, &sl) != 0)
    return -1;
  char text[64];
  snprintf(text, sizeof text, "127.0.0.1:%d", ntohs(sa.sin_port));
  return zt_net_addr(text, a) == 0 ? fd : -1;
}

ZT_TEST(test_connect) {
  zt_net_addr_t a;
  int lfd = listener(8, &a), refused = -1;
  ZT_REQUIRE(lfd >= 0);
  int fd = zt_net_connect(&a, zt_deadline_in(5000), NULL, NULL, &refused);
  ZT_CHECK(fd >= 0 && refused == 0);
  int peer = accept(lfd, NULL, NULL);
  ZT_CHECK(peer >= 0);
  ZT_CHECK(zt_net_exact(fd, "hi", 2, 1, zt_deadline_in(5000), NULL, NULL) == 0);
  char got[2];
  ZT_CHECK(zt_net_exact(peer, got, 2, 0, zt_deadline_in(5000), NULL, NULL) == 0);
  ZT_CHECK(memcmp(got, "hi", 2) == 0);
  close(peer);
  close(fd);
  /* Nothing listens there any more: refused, and the message says where. */
  close(lfd);
  ZT_CHECK(zt_net_connect(&a, zt_deadline_in(5000), NULL, NULL, &refused) == -1);
  ZT_CHECK(refused == 1);
  ZT_CHECK(strstr(zt_err_msg(), a.text) != NULL && strstr(zt_err_msg(), "refused") != NULL);
}

/* IPv6 where the machine has ::1. */
ZT_TEST(test_connect_ipv6) {
  int lfd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in6 sa = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
  socklen_t sl = sizeof sa;
  if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(lfd, 4) != 0) {
    fprintf(stderr, "  (no IPv6 loopback here: skipped)\n");
    if (lfd >= 0) close(lfd);
    return;
  }
  ZT_REQUIRE(getsockname(lfd, (struct sockaddr *)&sa, &sl) == 0);
  char text[64];
  snprintf(text, sizeof text, "[::1]:%d", ntohs(sa.sin6_port));
  zt_net_addr_t a;
  ZT_REQUIRE(zt_net_addr(text, &a) == 0);
  int fd = zt_net_connect(&a, zt_deadline_in(5000), NULL, NULL, NULL);
  ZT_CHECK(fd >= 0);
  if (fd >= 0) close(fd);
  close(lfd);
}

/* A listener whose accept queue is full: the next connection stays
 * pending (the kernel drops its SYNs), so the connect waits. -1 when the
 * queue could not be filled here. */
static int full_listener(zt_net_addr_t *a, int fillers[4], int *nf) {
  int lfd = listener(0, a);
  *nf = 0;
  for (int i = 0; lfd >= 0 && i < 4; i++) {
    int done, fd = zt_net_connect_start(a, &done, NULL);
    if (fd < 0) break;
    fillers[(*nf)++] = fd;
    if (!done && zt_net_wait(fd, POLLOUT, zt_deadline_in(200)) != 0) return lfd;
  }
  for (int i = 0; i < *nf; i++) close(fillers[i]);
  if (lfd >= 0) close(lfd);
  return -1;
}

/* A silent peer: "timed out" at the deadline, not refused; and a caller's
 * wait that gives up (an abort) ends the connect with its own message. */
typedef struct {
  int calls;
} abort_ctx;

static int abort_wait(void *user, int fd, short events, zt_deadline_t dl) {
  abort_ctx *c = user;
  (void)dl;
  if (++c->calls == 3) return zt_err("aborted");
  struct pollfd p = {.fd = fd, .events = events};
  if (poll(&p, 1, 20) < 0 && errno != EINTR) return zt_err_errno("poll");
  return 0; /* ready or not: returning early is harmless */
}

ZT_TEST(test_connect_silent) {
  zt_net_addr_t a;
  int fillers[4], nf, refused = -1;
  int lfd = full_listener(&a, fillers, &nf);
  if (lfd < 0) {
    fprintf(stderr, "  (the accept queue did not fill here: skipped)\n");
    return;
  }
  int64_t t0 = zt_now_ms();
  ZT_CHECK(zt_net_connect(&a, zt_deadline_in(200), NULL, NULL, &refused) == -1);
  int64_t took = zt_now_ms() - t0;
  ZT_CHECK(took >= 190 && took < 3000);
  ZT_CHECK(refused == 0);
  char want[128];
  snprintf(want, sizeof want, "connect %s: timed out", a.text);
  ZT_CHECK_STR(zt_err_msg(), want);
  abort_ctx c = {0};
  ZT_CHECK(zt_net_connect(&a, zt_deadline_in(5000), abort_wait, &c, NULL) == -1);
  ZT_CHECK(c.calls == 3);
  snprintf(want, sizeof want, "connect %s: aborted", a.text);
  ZT_CHECK_STR(zt_err_msg(), want);
  for (int i = 0; i < nf; i++) close(fillers[i]);
  close(lfd);
}

/* ---- waiting ---- */

ZT_TEST(test_wait_ready) {
  int sv[2];
  ZT_REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) == 0);
  int64_t t0 = zt_now_ms();
  ZT_CHECK(zt_net_wait(sv[1], POLLIN, zt_deadline_in(100)) == -1);
  ZT_CHECK(zt_now_ms() - t0 >= 90);
  ZT_CHECK_STR(zt_err_msg(), "timed out");
  ZT_CHECK(zt_net_wait(sv[1], POLLOUT, zt_deadline_in(100)) == 0);
  ZT_REQUIRE(send(sv[0], "x", 1, 0) == 1);
  ZT_CHECK(zt_net_wait(sv[1], POLLIN, 0) == 0);
  /* A passed deadline is timed out, even on a ready socket. */
  ZT_CHECK(zt_net_wait(sv[1], POLLIN, zt_now_ms() - 1) == -1);
  close(sv[0]);
  close(sv[1]);
}

/* ---- exact transfers on a socketpair ---- */

static int nb_pair(int sv[2]) {
  return socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv);
}

typedef struct {
  int fd, writing, rc;
  unsigned char *buf;
  size_t len;
  int delay_ms; /* before the transfer starts */
} io_job;

static void *io_thread(void *arg) {
  io_job *j = arg;
  zt_sleep_ms(j->delay_ms);
  j->rc = zt_net_exact(j->fd, j->buf, j->len, j->writing, zt_deadline_in(20000), NULL, NULL);
  return NULL;
}

static volatile sig_atomic_t g_alarms;
static void on_alarm(int sig) { (void)sig, g_alarms++; }

/* More than the socket buffers hold, so both ends wait for each other
 * many times; every byte arrives, in order. */
ZT_TEST(test_exact_transfer) {
  int sv[2];
  ZT_REQUIRE(nb_pair(sv) == 0);
  size_t n = 8u << 20;
  unsigned char *out = zt_xmalloc(n), *in = zt_xcalloc(1, n);
  for (size_t i = 0; i < n; i++) out[i] = (unsigned char)(i * 2654435761u >> 13);
  io_job w = {.fd = sv[0], .writing = 1, .buf = out, .len = n};
  pthread_t t;
  ZT_REQUIRE(pthread_create(&t, NULL, io_thread, &w) == 0);
  ZT_CHECK(zt_net_exact(sv[1], in, n, 0, zt_deadline_in(20000), NULL, NULL) == 0);
  pthread_join(t, NULL);
  ZT_CHECK(w.rc == 0);
  ZT_CHECK(memcmp(in, out, n) == 0);
  /* len 0 is done at once, whatever the deadline. */
  ZT_CHECK(zt_net_exact(sv[1], in, 0, 0, zt_now_ms() - 1, NULL, NULL) == 0);
  free(out);
  free(in);
  close(sv[0]);
  close(sv[1]);
}

/* Signals while a read waits (a handler without SA_RESTART, so poll and
 * recv see EINTR) neither end the transfer nor lose bytes. */
ZT_TEST(test_exact_eintr) {
  int sv[2];
  ZT_REQUIRE(nb_pair(sv) == 0);
  unsigned char msg[64], got[64] = {0};
  for (size_t i = 0; i < sizeof msg; i++) msg[i] = (unsigned char)(i + 1);
  io_job w = {.fd = sv[0], .writing = 1, .buf = msg, .len = sizeof msg, .delay_ms = 300};
  /* The writer blocks SIGALRM (it inherits the mask), so the signals go to
   * the reader, this thread. */
  sigset_t alrm;
  sigemptyset(&alrm);
  sigaddset(&alrm, SIGALRM);
  pthread_sigmask(SIG_BLOCK, &alrm, NULL);
  pthread_t t;
  int started = pthread_create(&t, NULL, io_thread, &w) == 0;
  pthread_sigmask(SIG_UNBLOCK, &alrm, NULL);
  ZT_REQUIRE(started);
  struct sigaction sa = {.sa_handler = on_alarm}, old;
  sigemptyset(&sa.sa_mask);
  ZT_REQUIRE(sigaction(SIGALRM, &sa, &old) == 0);
  struct itimerval every = {{0, 20000}, {0, 20000}}, off = {{0, 0}, {0, 0}};
  ZT_REQUIRE(setitimer(ITIMER_REAL, &every, NULL) == 0);
  int rc = zt_net_exact(sv[1], got, sizeof got, 0, zt_deadline_in(20000), NULL, NULL);
  setitimer(ITIMER_REAL, &off, NULL);
  sigaction(SIGALRM, &old, NULL);
  pthread_join(t, NULL);
  ZT_CHECK(rc == 0 && w.rc == 0);
  ZT_CHECK(memcmp(got, msg, sizeof msg) == 0);
  ZT_CHECK(g_alarms >= 3); /* the wait was interrupted, more than once */
  close(sv[0]);
  close(sv[1]);
}

/* Fewer bytes than asked for and a deadline: "timed out" once it passes,
 * not before. */
ZT_TEST(test_exact_deadline) {
  int sv[2];
  ZT_REQUIRE(nb_pair(sv) == 0);
  ZT_REQUIRE(send(sv[0], "abc", 3, 0) == 3);
  char buf[8];
  int64_t t0 = zt_now_ms();
  ZT_CHECK(zt_net_exact(sv[1], buf, sizeof buf, 0, zt_deadline_in(150), NULL, NULL) == -1);
  int64_t took = zt_now_ms() - t0;
  ZT_CHECK(strstr(zt_err_msg(), "timed out") != NULL);
  ZT_CHECK(took >= 140 && took < 5000);
  /* A writer whose peer reads nothing times out too. */
  static char big[1 << 20];
  while (send(sv[0], big, sizeof big, MSG_DONTWAIT) > 0) {
  }
  ZT_CHECK(zt_net_exact(sv[0], big, sizeof big, 1, zt_deadline_in(100), NULL, NULL) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "timed out") != NULL);
  close(sv[0]);
  close(sv[1]);
}

/* The peer goes away: a read short of its length says the connection was
 * closed; a write gets EPIPE as an error (no SIGPIPE ends the test). */
ZT_TEST(test_exact_peer_closed) {
  int sv[2];
  ZT_REQUIRE(nb_pair(sv) == 0);
  ZT_REQUIRE(send(sv[0], "abc", 3, 0) == 3);
  close(sv[0]);
  char buf[8];
  ZT_CHECK(zt_net_exact(sv[1], buf, sizeof buf, 0, zt_deadline_in(5000), NULL, NULL) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "connection closed by peer") != NULL);
  ZT_CHECK(zt_net_exact(sv[1], buf, sizeof buf, 1, zt_deadline_in(5000), NULL, NULL) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "send") != NULL);
  close(sv[1]);
}

/* A caller's wait: called whenever the socket is not ready; 0 goes on,
 * -1 (an abort) ends the transfer with the wait's own message. */
typedef struct {
  int peer, calls, abort_at;
} wait_ctx;

static int test_wait(void *user, int fd, short events, zt_deadline_t dl) {
  wait_ctx *w = user;
  (void)fd, (void)dl;
  if (++w->calls == w->abort_at) return zt_err("aborted");
  if (events & POLLIN) { /* feed the reader two more bytes */
    if (send(w->peer, "xy", 2, 0) != 2) return zt_err_errno("feed");
  }
  return 0;
}

ZT_TEST(test_exact_wait_fn) {
  int sv[2];
  ZT_REQUIRE(nb_pair(sv) == 0);
  char buf[6];
  wait_ctx w = {.peer = sv[0], .abort_at = 0};
  ZT_CHECK(zt_net_exact(sv[1], buf, sizeof buf, 0, 0, test_wait, &w) == 0);
  ZT_CHECK(w.calls == 3 && memcmp(buf, "xyxyxy", 6) == 0);
  w = (wait_ctx){.peer = sv[0], .abort_at = 2};
  ZT_CHECK(zt_net_exact(sv[1], buf, sizeof buf, 0, 0, test_wait, &w) == -1);
  ZT_CHECK(w.calls == 2);
  ZT_CHECK_STR(zt_err_msg(), "aborted");
  close(sv[0]);
  close(sv[1]);
}

/* A socket in blocking mode: every call is non-blocking all the same, so
 * the deadline holds. */
ZT_TEST(test_exact_blocking_socket) {
  int sv[2];
  ZT_REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  char buf[4];
  int64_t t0 = zt_now_ms();
  ZT_CHECK(zt_net_exact(sv[1], buf, sizeof buf, 0, zt_deadline_in(100), NULL, NULL) == -1);
  ZT_CHECK(zt_now_ms() - t0 < 5000);
  ZT_CHECK_STR(zt_err_msg(), "timed out");
  close(sv[0]);
  close(sv[1]);
}

ZT_TEST_MAIN(test_hostport, test_addr, test_connect, test_connect_ipv6, test_connect_silent,
             test_wait_ready, test_exact_transfer, test_exact_eintr, test_exact_deadline,
             test_exact_peer_closed, test_exact_wait_fn, test_exact_blocking_socket)
