/*
 * zt_rpc.h: ztrain's only window onto gRPC.
 *
 * ztrain speaks gRPC (HTTP/2, protobuf payloads) through the gRPC core C API,
 * and this module is the one place that includes grpc headers. Everything
 * else sees opaque byte payloads (protobuf-c encoded by the caller), method
 * paths such as "/ztrain.Control/Heartbeat" and gRPC status codes.
 *
 * Server side. A completion-queue thread owned by the server accepts calls
 * and reads their request message; each complete request is queued and
 * handed to the libuv loop with uv_async, where the handler runs. So all
 * handlers run on the loop thread, and the coordinator needs no locks around
 * its state. A handler must eventually answer each call exactly once with
 * zt_rpc_reply(), either before it returns or later (a long poll).
 *
 * Client side. zt_rpc_call() is a blocking unary call with a deadline, safe
 * to use from any thread (each call plucks its own completion queue).
 * zt_rpc_start()/zt_rpc_next() issue many concurrent calls from one thread,
 * as the heartbeat benchmark does.
 */
#ifndef ZT_RPC_H
#define ZT_RPC_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "zt_common.h"

/* gRPC status codes (same numbers as grpc_status_code). */
enum {
  ZT_RPC_OK = 0,
  ZT_RPC_CANCELLED = 1,
  ZT_RPC_UNKNOWN = 2,
  ZT_RPC_INVALID_ARGUMENT = 3,
  ZT_RPC_DEADLINE_EXCEEDED = 4,
  ZT_RPC_NOT_FOUND = 5,
  ZT_RPC_ALREADY_EXISTS = 6,
  ZT_RPC_PERMISSION_DENIED = 7,
  ZT_RPC_RESOURCE_EXHAUSTED = 8,
  ZT_RPC_FAILED_PRECONDITION = 9,
  ZT_RPC_ABORTED = 10,
  ZT_RPC_OUT_OF_RANGE = 11,
  ZT_RPC_UNIMPLEMENTED = 12,
  ZT_RPC_INTERNAL = 13,
  ZT_RPC_UNAVAILABLE = 14,
  ZT_RPC_UNAUTHENTICATED = 16,
};

const char *zt_rpc_status_name(int status);

/* Whether a failed call may succeed if made again to the same server:
 * the server was unreachable, too slow, or went away with the call in
 * flight (a coordinator that stops cancels the calls it holds). Every other
 * status is the server's answer and retrying it would repeat it. */
static inline int zt_rpc_transient(int status) {
  return status == ZT_RPC_UNAVAILABLE || status == ZT_RPC_DEADLINE_EXCEEDED ||
         status == ZT_RPC_CANCELLED;
}

/* ---- server ------------------------------------------------------------ */

typedef struct zt_rpc_server zt_rpc_server_t;
typedef struct zt_rpc_call zt_rpc_call_t;

/* Called on the loop thread for each received request. `req` stays valid
 * until the call is answered. */
typedef void (*zt_rpc_handler_fn)(zt_rpc_call_t *call, const char *method, const uint8_t *req,
                                  size_t req_len, void *user);

typedef struct {
  size_t max_message_bytes; /* requests above this get RESOURCE_EXHAUSTED; 0: 4 MiB */
  int accept_slots;         /* calls requested from gRPC ahead of time; 0: 256 */
} zt_rpc_server_opts_t;

/* Binds `addr` ("127.0.0.1:0" picks a free port) and starts serving. */
ZT_MUST_CHECK int zt_rpc_server_start(uv_loop_t *loop, const char *addr, const zt_rpc_server_opts_t *opts,
                        zt_rpc_handler_fn handler, void *user, zt_rpc_server_t **out);
int zt_rpc_server_port(const zt_rpc_server_t *s);
/* How long the oldest request waiting for the loop has waited (0: none
 * waits). Everything received before now minus this has been handled, so
 * the liveness check judges silences at that time: a heartbeat that
 * waits in the queue of a busy coordinator is not its worker's silence. */
int64_t zt_rpc_server_lag_ms(zt_rpc_server_t *s);
/* Stops accepting, cancels calls in flight and joins the thread. Calls the
 * handler still holds must be answered before this is called. */
void zt_rpc_server_stop(zt_rpc_server_t *s);

/* Answers a call: status ZT_RPC_OK with a response payload, or an error
 * status with a message (the payload is then ignored). Frees the call. */
void zt_rpc_reply(zt_rpc_call_t *call, int status, const char *message, const uint8_t *resp,
                  size_t resp_len);
/* Value of request metadata `key` (lower case), or NULL. Valid until reply. */
const char *zt_rpc_call_metadata(zt_rpc_call_t *call, const char *key);
/* The peer's address as gRPC reports it ("ipv4:127.0.0.1:5555"). */
const char *zt_rpc_call_peer(zt_rpc_call_t *call);
/* How long the call has waited for the loop since it was received (0 for
 * an in-process call). */
int64_t zt_rpc_call_waited_ms(const zt_rpc_call_t *call);

/* An in-process call with no network behind it, for harnesses that drive a
 * server's handler directly (the fuzz targets of tests/fuzz): the handler
 * sees an ordinary call whose "authorization" metadata is `authorization`
 * (may be NULL) and whose peer is "local"; zt_rpc_reply hands the outcome
 * to `done` (resp only with ZT_RPC_OK) and frees the call. */
typedef void (*zt_rpc_local_done_fn)(void *user, int status, const char *message,
                                     const uint8_t *resp, size_t resp_len);
zt_rpc_call_t *zt_rpc_call_local(const char *authorization, zt_rpc_local_done_fn done,
                                 void *user);

/* ---- client ------------------------------------------------------------ */

typedef struct zt_rpc_client zt_rpc_client_t;

typedef struct {
  const char *authorization; /* sent as "authorization" metadata when set */
  size_t max_message_bytes;  /* largest accepted reply; 0: 64 MiB */
  /* A call made while the channel is not connected waits (until its
   * deadline) for the connection instead of failing at once: a daemon that
   * retries anyway then reaches a restarted server as soon as gRPC
   * reconnects (within ZT_RPC_RECONNECT_MAX_MS), not at its next retry. */
  int wait_for_ready;
  /* The longest wait between connection attempts; 0: ZT_RPC_RECONNECT_MAX_MS. */
  int reconnect_max_ms;
  /* The least time one connection attempt may take before it is given up
   * and the next one starts; 0: ZT_RPC_CONNECT_MIN_MS. Shorter finds a
   * link that is back sooner (an attempt whose SYN went into a cut hangs
   * until then) but may give up a handshake on a loaded machine, which a
   * wait_for_ready channel then simply tries again. */
  int connect_min_ms;
} zt_rpc_client_opts_t;

/* The longest wait of a channel between connection attempts, and the
 * least time one attempt may take. */
#define ZT_RPC_RECONNECT_MAX_MS 1000
#define ZT_RPC_CONNECT_MIN_MS 1000

ZT_MUST_CHECK int zt_rpc_client_open(const char *target, const zt_rpc_client_opts_t *opts, zt_rpc_client_t **out);
void zt_rpc_client_close(zt_rpc_client_t *c);

/* Silent deaths. A connection can die without a word (a link down, a cut
 * host: no FIN, no RST); TCP then retransmits into it with a doubling
 * backoff, and gRPC, which still believes it alive (READY), sends every
 * call into it, so calls may go on failing for seconds after the link is
 * back. A client therefore replaces its channel (and with it the
 * connection, which is the client's own: gRPC's sharing of connections
 * between channels is off) when a call times out on a channel that
 * believes itself connected, at most once per ZT_RPC_REPLACE_MIN_MS. The
 * new one connects as soon as the network lets it. Returns how many times
 * this client did so. */
#define ZT_RPC_REPLACE_MIN_MS 1000
unsigned zt_rpc_client_replaced(zt_rpc_client_t *c);

/* Blocking unary call. Returns 0 when the server answered OK; *resp (malloc'd,
 * may be NULL for an empty message) is then the caller's to free. Otherwise
 * returns -1 with zt_err_msg() = "<method>: <STATUS>: <details>" and, when
 * `status` is not NULL, the gRPC status in *status. */
ZT_MUST_CHECK int zt_rpc_call(zt_rpc_client_t *c, const char *method, const uint8_t *req, size_t req_len,
                int64_t timeout_ms, uint8_t **resp, size_t *resp_len, int *status);

/* Asynchronous calls: start any number, then collect completions. */
typedef struct {
  void *user;
  int status;
  char details[256];
  uint8_t *resp; /* malloc'd; the caller frees */
  size_t resp_len;
} zt_rpc_result_t;

void zt_rpc_start(zt_rpc_client_t *c, const char *method, const uint8_t *req, size_t req_len,
                  int64_t timeout_ms, void *user);
/* Waits up to timeout_ms for one started call to finish: 1 and fills `res`
 * when one did, 0 on timeout. */
int zt_rpc_next(zt_rpc_client_t *c, int64_t timeout_ms, zt_rpc_result_t *res);

#endif
