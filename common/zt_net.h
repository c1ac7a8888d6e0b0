/*
 * zt_net.h: TCP sockets with deadlines, and HOST:PORT addresses (net.c).
 *
 * Every ztrain process talks to others over plain sockets besides gRPC:
 * the collectives' ring (comm/comm_handshake.c), the replica stores
 * (worker/store.c), the machine's heartbeat agent (worker/agent.c, a Unix
 * socket), the cloud metadata service (worker/spot.c). They all need the
 * same few things, and this is the one place that does them:
 *
 *   - one HOST:PORT parser (the last ':' splits, so "[::1]:80" parses),
 *     and numeric IPv4 / IPv6 addresses from it. There is no name lookup
 *     here: getaddrinfo() has no deadline, and every address ztrain
 *     connects to is one a peer reported (its own interface's address) or
 *     a metadata service's fixed address.
 *   - connecting with a deadline: a non-blocking connect(), then a wait
 *     until the socket is writable and its SO_ERROR. A blocking connect()
 *     to an address that drops packets waits for the kernel's SYN retries,
 *     about two minutes, whatever the caller's deadline. A failure says
 *     whether the peer refused (nothing listens there: it is up but not
 *     serving) or was silent, which callers judge differently.
 *   - waiting for a socket to be readable or writable, with a deadline.
 *   - sending or receiving exactly N bytes, with a deadline.
 *
 * Waits. Where a caller must also watch something else while it waits (an
 * abort eventfd, a "no longer needed" flag), it passes its own wait
 * function (zt_net_wait_fn) to zt_net_connect and zt_net_exact; NULL
 * waits with zt_net_wait, on the socket and the deadline alone.
 *
 * Deadlines are absolute monotonic milliseconds (zt_deadline_t, 0: none),
 * errors the thread's message (zt_err), as everywhere in ztrain; each names
 * the address and the cause ("connect 10.0.0.7:7100: Connection refused",
 * "connect 10.0.0.7:7100: timed out"). Part of common/, the bottom layer:
 * it includes only zt_common.h.
 */
#ifndef ZT_NET_H
#define ZT_NET_H

#include <stddef.h>
#include <sys/socket.h>

#include "zt_common.h"

/* ---- addresses ---------------------------------------------------------- */

/* Parses "host:port" into its parts: host is everything before the last
 * ':' (non-empty, shorter than hostlen), port a decimal number in
 * 1..65535. -1 with a message naming s otherwise. */
ZT_MUST_CHECK int zt_net_parse_hostport(const char *s, char *host, size_t hostlen, int *port);
/* The same for an address to listen on, where port 0 asks for any free
 * port: port in 0..65535. */
ZT_MUST_CHECK int zt_net_parse_listen(const char *s, char *host, size_t hostlen, int *port);
/* The host part of "host:port" (everything before the last ':'), or all of
 * addr when it has no ':'; cut to hostlen - 1 characters. */
void zt_net_host(const char *addr, char *host, size_t hostlen);

/* A numeric address to connect to, and its text for messages. */
typedef struct {
  struct sockaddr_storage sa;
  socklen_t len;
  char text[64]; /* as given: "10.0.0.7:7100", "[::1]:7100" */
} zt_net_addr_t;

/* Parses "IPV4:PORT", "[IPV6]:PORT" or "IPV6:PORT" (port 1..65535) into
 * *a. No name lookup: a host name is an error ("<s>: not a numeric IPv4
 * or IPv6 address"), as is anything zt_net_parse_hostport refuses. */
ZT_MUST_CHECK int zt_net_addr(const char *s, zt_net_addr_t *a);

/* ---- waiting ------------------------------------------------------------ */

/* How zt_net_connect and zt_net_exact wait while a non-blocking socket is
 * not ready: until fd has `events` (POLLIN or POLLOUT), the deadline dl
 * (0: none) passes, or something else the caller watches (an abort) ends
 * the wait. Returns 0 to look at the socket again (returning early is
 * harmless), -1 with the thread's error set to give up. */
typedef int (*zt_net_wait_fn)(void *user, int fd, short events, zt_deadline_t dl);

/* Waits until fd has one of `events` (or an error or hang-up, which the
 * next call on it reports) or dl passes: 0 ready, -1 "timed out" (or
 * "poll: ..."). A wait cut short by a signal is resumed. */
ZT_MUST_CHECK int zt_net_wait(int fd, short events, zt_deadline_t dl);

/* ---- connecting --------------------------------------------------------- */

/* Starts a non-blocking TCP connection to a: the socket (non-blocking,
 * close-on-exec), connecting or, with *done set, already connected; or -1
 * with "connect <a>: <cause>", and *refused (when not NULL) set when
 * nothing listens there. For callers that wait on many connections at
 * once (a probe); zt_net_connect waits for one. */
ZT_MUST_CHECK int zt_net_connect_start(const zt_net_addr_t *a, int *done, int *refused);
/* The outcome of a connection zt_net_connect_start began, once its socket
 * is writable: 0 connected, or the errno value it failed with. */
int zt_net_connect_result(int fd);
/* Connects to a by dl, waiting with wait(user, ...) (NULL: zt_net_wait).
 * The connected socket (non-blocking, close-on-exec), or -1 with
 * "connect <a>: <cause>" ("timed out", the wait's own error, or the
 * kernel's: "Connection refused", ...), and *refused (when not NULL) set
 * when the peer refused. */
ZT_MUST_CHECK int zt_net_connect(const zt_net_addr_t *a, zt_deadline_t dl, zt_net_wait_fn wait,
                                 void *user, int *refused);

/* ---- exact transfers ---------------------------------------------------- */

/* Sends (writing != 0) or receives exactly len bytes on the stream socket
 * fd. Every send and recv is non-blocking (MSG_DONTWAIT, whatever the
 * socket's own mode); one that would block or that a signal cut short
 * (EAGAIN, EINTR) waits with wait(user, fd, events, dl) (NULL:
 * zt_net_wait), then goes on. The deadline is looked at only when the
 * socket is not ready, so len 0, or bytes already there, succeed whatever
 * dl. -1 with a message: "connection closed by peer" (end of stream
 * before len bytes), "send: ..." / "recv: ..." (errno), or the wait's
 * error. Sends with MSG_NOSIGNAL: a closed peer is an error (EPIPE), not
 * SIGPIPE. */
ZT_MUST_CHECK int zt_net_exact(int fd, void *buf, size_t len, int writing, zt_deadline_t dl,
                               zt_net_wait_fn wait, void *user);

#endif
