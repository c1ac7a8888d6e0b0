/*
 * net.c: TCP sockets with deadlines, and HOST:PORT addresses (zt_net.h).
 *
 * What it is for. Before this file, each part of ztrain that speaks over a
 * plain socket carried its own copy of the same loops: a non-blocking
 * connect() waited on with poll() (the ring's handshake, the replica
 * store, the spot watcher), a poll() until readable or writable against a
 * deadline (the same three and the heartbeat agent), an exact send / recv
 * of N bytes (all four), and a host:port split with strrchr (the spot
 * watcher, the coordinator's config, HTTP and provisioning). Each copy had
 * its own small differences in what a timeout or a refusal meant. Here is
 * one of each, and the callers keep only what is theirs: the ring and the
 * store pass a wait function that also watches their abort condition, the
 * spot watcher a wait whose timeout says what its log has always said.
 *
 * How it fits. common/ is the bottom layer: this file includes nothing
 * above it, and comm/, worker/, coordinator/ and the tools call it. It
 * owns no state and no thread; every call is bounded by its caller's
 * deadline, and nothing here blocks without one (sockets are non-blocking,
 * or each call says MSG_DONTWAIT). Name lookup is left out on purpose:
 * getaddrinfo() cannot be given a deadline, so addresses are numeric.
 *
 * Errors follow zt_common.h: -1 with the thread's message, which names the
 * address and the cause.
 */
#include "zt_net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- addresses ---------------------------------------------------------- */

/* The one HOST:PORT parser: host before the last ':', port in
 * min_port..65535. */
static int parse_hostport(const char *s, char *host, size_t hostlen, int *port, int min_port) {
  const char *colon = strrchr(s, ':');
  if (!colon || colon == s) return zt_err("'%s' is not HOST:PORT", s);
  size_t hl = (size_t)(colon - s);
  if (hl >= hostlen) return zt_err("host in '%s' is too long", s);
  char *end;
  errno = 0;
  long p = strtol(colon + 1, &end, 10);
  if (errno || *end || end == colon + 1 || p < min_port || p > 65535)
    return zt_err("port in '%s' is not a number in %d..65535", s, min_port);
  memcpy(host, s, hl);
  host[hl] = 0;
  *port = (int)p;
  return 0;
}

int zt_net_parse_hostport(const char *s, char *host, size_t hostlen, int *port) {
  return parse_hostport(s, host, hostlen, port, 1);
}

int zt_net_parse_listen(const char *s, char *host, size_t hostlen, int *port) {
  return parse_hostport(s, host, hostlen, port, 0);
}

void zt_net_host(const char *addr, char *host, size_t hostlen) {
  const char *colon = strrchr(addr, ':');
  int n = colon ? (int)(colon - addr) : (int)strlen(addr);
  snprintf(host, hostlen, "%.*s", n, addr);
}

/* host without the brackets of "[::1]" (into buf), or host itself. */
static const char *unbracket(const char *host, char *buf, size_t n) {
  size_t hl = strlen(host);
  if (hl < 2 || host[0] != '[' || host[hl - 1] != ']' || hl - 2 >= n) return host;
  memcpy(buf, host + 1, hl - 2);
  buf[hl - 2] = 0;
  return buf;
}

int zt_net_addr(const char *s, zt_net_addr_t *a) {
  char host[INET6_ADDRSTRLEN + 2], bare[INET6_ADDRSTRLEN];
  int port;
  memset(a, 0, sizeof *a);
  if (zt_net_parse_hostport(s, host, sizeof host, &port) != 0) return -1;
  snprintf(a->text, sizeof a->text, "%s", s); /* for messages; cut to fit */
  struct sockaddr_in *v4 = (struct sockaddr_in *)&a->sa;
  struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&a->sa;
  if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons((uint16_t)port);
    a->len = sizeof *v4;
    return 0;
  }
  if (inet_pton(AF_INET6, unbracket(host, bare, sizeof bare), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons((uint16_t)port);
    a->len = sizeof *v6;
    return 0;
  }
  return zt_err("%s: not a numeric IPv4 or IPv6 address", s);
}

/* ---- waiting ------------------------------------------------------------ */

int zt_net_wait(int fd, short events, zt_deadline_t dl) {
  for (;;) {
    int64_t left = zt_deadline_left_ms(dl);
    if (left == 0) return zt_err("timed out");
    struct pollfd p = {.fd = fd, .events = events};
    int r = poll(&p, 1, (int)ZT_MIN(left, 1000000));
    if (r > 0) return 0;
    if (r < 0 && errno != EINTR) return zt_err_errno("poll");
  }
}

/* zt_net_wait as a zt_net_wait_fn: the wait of callers that pass none. */
static int wait_plain(void *user, int fd, short events, zt_deadline_t dl) {
  (void)user;
  return zt_net_wait(fd, events, dl);
}

/* 1 when fd has one of `events` now (or an error), without waiting. */
static int ready_now(int fd, short events) {
  struct pollfd p = {.fd = fd, .events = events};
  return poll(&p, 1, 0) > 0;
}

/* ---- connecting --------------------------------------------------------- */

int zt_net_connect_start(const zt_net_addr_t *a, int *done, int *refused) {
  if (refused) *refused = 0;
  int fd = socket(a->sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return zt_err_errno("connect %s: socket", a->text);
  *done = connect(fd, (const struct sockaddr *)&a->sa, a->len) == 0;
  if (!*done && errno != EINPROGRESS) {
    if (refused) *refused = errno == ECONNREFUSED;
    zt_err_errno("connect %s", a->text);
    close(fd);
    return -1;
  }
  return fd;
}

int zt_net_connect_result(int fd) {
  int err = 0;
  socklen_t el = sizeof err;
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0) return errno;
  return err;
}

/* Waits until the connection on fd has an outcome: 0, or -1 with the
 * wait's error (the deadline passed, the caller's abort). */
static int await_connect(int fd, zt_deadline_t dl, zt_net_wait_fn wait, void *user) {
  for (;;) {
    if (wait(user, fd, POLLOUT, dl) != 0) return -1;
    if (ready_now(fd, POLLOUT)) return 0; /* the wait may return early */
  }
}

int zt_net_connect(const zt_net_addr_t *a, zt_deadline_t dl, zt_net_wait_fn wait, void *user,
                   int *refused) {
  int done, fd = zt_net_connect_start(a, &done, refused);
  if (fd < 0 || done) return fd;
  if (await_connect(fd, dl, wait ? wait : wait_plain, user) != 0) {
    zt_err_wrap("connect %s", a->text);
    close(fd);
    return -1;
  }
  int err = zt_net_connect_result(fd);
  if (!err) return fd;
  if (refused) *refused = err == ECONNREFUSED;
  zt_err("connect %s: %s", a->text, strerror(err));
  close(fd);
  return -1;
}

/* ---- exact transfers ---------------------------------------------------- */

int zt_net_exact(int fd, void *buf, size_t len, int writing, zt_deadline_t dl,
                 zt_net_wait_fn wait, void *user) {
  if (!wait) wait = wait_plain;
  size_t done = 0;
  while (done < len) {
    ssize_t r = writing ? send(fd, (char *)buf + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                        : recv(fd, (char *)buf + done, len - done, MSG_DONTWAIT);
    if (r > 0) {
      done += (size_t)r;
      continue;
    }
    if (r == 0) return zt_err("connection closed by peer");
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return zt_err_errno(writing ? "send" : "recv");
    if (wait(user, fd, writing ? POLLOUT : POLLIN, dl) != 0) return -1;
  }
  return 0;
}
