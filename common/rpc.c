/*
 * rpc.c: the gRPC core wrapper behind zt_rpc.h (server and client).
 *
 * Server. grpc_server_request_call() is armed `accept_slots` times on one
 * completion queue. A dedicated thread runs grpc_completion_queue_next() and
 * moves each call through three steps, each a tag embedded in the call
 * context:
 *
 *   NEW   a call arrived: arm a replacement slot, start RECV_MESSAGE.
 *   RECV  the request bytes are here: copy them out and queue the call for
 *         the loop (uv_async). The handler runs on the loop thread and calls
 *         zt_rpc_reply(), which starts SEND_* and RECV_CLOSE_ON_SERVER.
 *   SENT  the reply went out (or the call died): release everything.
 *
 * Only one batch is ever outstanding per call, so no locking is needed on a
 * call context; the queue between the two threads has a mutex. Stopping sets
 * a flag under that mutex, after which the thread answers UNAVAILABLE itself
 * instead of queueing, so no call is stranded between threads.
 *
 * Client. Every call sets a deadline, so every batch completes. Channels are
 * given short reconnect backoff (100 ms .. 1 s): a worker that lost its
 * coordinator must see it again within a second of its return, not after
 * gRPC's default two minutes.
 */
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zt_common.h"
#include "zt_rpc.h"

/* The longest the loop runs queued calls in one go (poll_calls). */
#define ZT_RPC_POLL_BUDGET_MS 10

const char *zt_rpc_status_name(int status) {
  static const char *names[] = {"OK",
                                "CANCELLED",
                                "UNKNOWN",
                                "INVALID_ARGUMENT",
                                "DEADLINE_EXCEEDED",
                                "NOT_FOUND",
                                "ALREADY_EXISTS",
                                "PERMISSION_DENIED",
                                "RESOURCE_EXHAUSTED",
                                "FAILED_PRECONDITION",
                                "ABORTED",
                                "OUT_OF_RANGE",
                                "UNIMPLEMENTED",
                                "INTERNAL",
                                "UNAVAILABLE",
                                "DATA_LOSS",
                                "UNAUTHENTICATED"};
  if (status < 0 || status >= (int)ZT_ARRAY_LEN(names)) return "UNKNOWN";
  return names[status];
}

static char *slice_to_cstr(grpc_slice s) {
  size_t n = GRPC_SLICE_LENGTH(s);
  char *p = zt_xmalloc(n + 1);
  memcpy(p, GRPC_SLICE_START_PTR(s), n);
  p[n] = 0;
  return p;
}

/* Copies a byte buffer into one malloc'd block and destroys the buffer. */
static uint8_t *take_buffer(grpc_byte_buffer *bb, size_t *len) {
  grpc_byte_buffer_reader r;
  if (!grpc_byte_buffer_reader_init(&r, bb)) {
    grpc_byte_buffer_destroy(bb);
    *len = 0;
    return NULL;
  }
  grpc_slice s = grpc_byte_buffer_reader_readall(&r);
  grpc_byte_buffer_reader_destroy(&r);
  *len = GRPC_SLICE_LENGTH(s);
  uint8_t *p = zt_xmalloc(*len ? *len : 1);
  memcpy(p, GRPC_SLICE_START_PTR(s), *len);
  grpc_slice_unref(s);
  grpc_byte_buffer_destroy(bb);
  return p;
}

static grpc_byte_buffer *make_buffer(const uint8_t *p, size_t len) {
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)p, len);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

/* ======================================================================
 * Server
 * ====================================================================== */

enum { TAG_NEW, TAG_RECV, TAG_SENT, TAG_SHUTDOWN };

typedef struct {
  int kind;
  void *owner;
} rpc_tag;

struct zt_rpc_call {
  zt_rpc_server_t *server;
  grpc_call *call;
  grpc_call_details details;
  grpc_metadata_array md;
  grpc_byte_buffer *recv_buf;
  grpc_byte_buffer *send_buf;
  grpc_slice status_details;
  int has_status_details;
  int cancelled;
  char method[128];
  uint8_t *req;
  size_t req_len;
  char *peer;
  char mdval[512];
  rpc_tag tag_new, tag_recv, tag_sent;
  struct zt_rpc_call *next; /* loop queue link */
  int64_t queued_ms;        /* when it was queued for the loop (zt_now_ms) */
  /* An in-process call (zt_rpc_call_local): no gRPC call behind it. */
  zt_rpc_local_done_fn local_done;
  void *local_user;
  char *local_auth;
};

struct zt_rpc_server {
  uv_loop_t *loop;
  uv_async_t async;
  grpc_server *server;
  grpc_completion_queue *cq;
  pthread_t thread;
  int port;
  zt_rpc_handler_fn handler;
  void *user;
  pthread_mutex_t mu;
  zt_rpc_call_t *head, *tail; /* calls waiting for the loop */
  int stopping;               /* under mu */
  rpc_tag tag_shutdown;
};

static void call_free(zt_rpc_call_t *c) {
  if (c->call) grpc_call_unref(c->call);
  grpc_call_details_destroy(&c->details);
  grpc_metadata_array_destroy(&c->md);
  if (c->recv_buf) grpc_byte_buffer_destroy(c->recv_buf);
  if (c->send_buf) grpc_byte_buffer_destroy(c->send_buf);
  if (c->has_status_details) grpc_slice_unref(c->status_details);
  if (c->peer) gpr_free(c->peer);
  free(c->req);
  free(c);
}

static void arm_slot(zt_rpc_server_t *s) {
  zt_rpc_call_t *c = zt_xcalloc(1, sizeof *c);
  c->server = s;
  grpc_call_details_init(&c->details);
  grpc_metadata_array_init(&c->md);
  c->tag_new = (rpc_tag){TAG_NEW, c};
  c->tag_recv = (rpc_tag){TAG_RECV, c};
  c->tag_sent = (rpc_tag){TAG_SENT, c};
  if (grpc_server_request_call(s->server, &c->call, &c->details, &c->md, s->cq, s->cq, &c->tag_new) !=
      GRPC_CALL_OK)
    call_free(c);
}

zt_rpc_call_t *zt_rpc_call_local(const char *authorization, zt_rpc_local_done_fn done,
                                 void *user) {
  zt_rpc_call_t *c = zt_xcalloc(1, sizeof *c);
  grpc_call_details_init(&c->details);
  grpc_metadata_array_init(&c->md);
  c->local_done = done;
  c->local_user = user;
  c->local_auth = authorization ? zt_xstrdup(authorization) : NULL;
  return c;
}

static void local_reply(zt_rpc_call_t *c, int status, const char *message, const uint8_t *resp,
                        size_t resp_len) {
  c->local_done(c->local_user, status, message ? message : "", status == ZT_RPC_OK ? resp : NULL,
                status == ZT_RPC_OK ? resp_len : 0);
  free(c->local_auth);
  grpc_call_details_destroy(&c->details);
  grpc_metadata_array_destroy(&c->md);
  free(c);
}

void zt_rpc_reply(zt_rpc_call_t *c, int status, const char *message, const uint8_t *resp,
                  size_t resp_len) {
  if (c->local_done) {
    local_reply(c, status, message, resp, resp_len);
    return;
  }
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (status == ZT_RPC_OK) {
    c->send_buf = make_buffer(resp, resp_len);
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = c->send_buf;
  }
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = (grpc_status_code)status;
  if (message && *message) {
    c->status_details = grpc_slice_from_copied_string(message);
    c->has_status_details = 1;
    ops[n].data.send_status_from_server.status_details = &c->status_details;
  }
  n++;
  ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  ops[n++].data.recv_close_on_server.cancelled = &c->cancelled;
  if (grpc_call_start_batch(c->call, ops, n, &c->tag_sent, NULL) != GRPC_CALL_OK) call_free(c);
}

const char *zt_rpc_call_metadata(zt_rpc_call_t *c, const char *key) {
  if (c->local_done) return !strcmp(key, "authorization") ? c->local_auth : NULL;
  size_t klen = strlen(key);
  for (size_t i = 0; i < c->md.count; i++) {
    grpc_slice k = c->md.metadata[i].key, v = c->md.metadata[i].value;
    if (GRPC_SLICE_LENGTH(k) != klen || memcmp(GRPC_SLICE_START_PTR(k), key, klen) != 0) continue;
    size_t vl = ZT_MIN(GRPC_SLICE_LENGTH(v), sizeof c->mdval - 1);
    memcpy(c->mdval, GRPC_SLICE_START_PTR(v), vl);
    c->mdval[vl] = 0;
    return c->mdval;
  }
  return NULL;
}

const char *zt_rpc_call_peer(zt_rpc_call_t *c) {
  if (c->local_done) return "local";
  if (!c->peer) c->peer = grpc_call_get_peer(c->call);
  return c->peer ? c->peer : "unknown";
}

/* Loop side: run the handler for the queued calls, for at most budget_ms;
 * the rest go back to the head of the queue and the
 * loop is woken again for them, so that a burst (thousands of workers
 * registering at once) does not hold the loop's timers for its whole
 * length. */
static void poll_calls(zt_rpc_server_t *s, int64_t budget_ms) {
  pthread_mutex_lock(&s->mu);
  zt_rpc_call_t *c = s->head;
  s->head = s->tail = NULL;
  pthread_mutex_unlock(&s->mu);
  int64_t until = zt_now_ms() + budget_ms;
  for (int n = 0; c; n++) {
    if ((n & 15) == 15 && zt_now_ms() >= until) break;
    zt_rpc_call_t *next = c->next;
    c->next = NULL;
    s->handler(c, c->method, c->req, c->req_len, s->user);
    c = next;
  }
  if (!c) return;
  zt_rpc_call_t *last = c;
  while (last->next) last = last->next;
  pthread_mutex_lock(&s->mu);
  last->next = s->head;
  if (!s->head) s->tail = last;
  s->head = c;
  pthread_mutex_unlock(&s->mu);
  uv_async_send(&s->async);
}

int64_t zt_rpc_call_waited_ms(const zt_rpc_call_t *c) {
  return c->local_done || !c->queued_ms ? 0 : ZT_MAX(0, zt_now_ms() - c->queued_ms);
}

int64_t zt_rpc_server_lag_ms(zt_rpc_server_t *s) {
  pthread_mutex_lock(&s->mu);
  int64_t lag = s->head ? ZT_MAX(0, zt_now_ms() - s->head->queued_ms) : 0;
  pthread_mutex_unlock(&s->mu);
  return lag;
}

static void on_async(uv_async_t *a) { poll_calls(a->data, ZT_RPC_POLL_BUDGET_MS); }

/* Thread side: a request is complete; give it to the loop. */
static void hand_to_loop(zt_rpc_server_t *s, zt_rpc_call_t *c) {
  c->queued_ms = zt_now_ms();
  pthread_mutex_lock(&s->mu);
  int stopping = s->stopping;
  if (!stopping) {
    if (s->tail) s->tail->next = c;
    else s->head = c;
    s->tail = c;
  }
  pthread_mutex_unlock(&s->mu);
  if (stopping) zt_rpc_reply(c, ZT_RPC_UNAVAILABLE, "server is shutting down", NULL, 0);
  else uv_async_send(&s->async);
}

static void on_new_call(zt_rpc_server_t *s, zt_rpc_call_t *c, int ok) {
  if (!ok) { /* the server is shutting down */
    c->call = NULL;
    call_free(c);
    return;
  }
  arm_slot(s);
  size_t ml = ZT_MIN(GRPC_SLICE_LENGTH(c->details.method), sizeof c->method - 1);
  memcpy(c->method, GRPC_SLICE_START_PTR(c->details.method), ml);
  c->method[ml] = 0;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &c->recv_buf;
  if (grpc_call_start_batch(c->call, &op, 1, &c->tag_recv, NULL) != GRPC_CALL_OK) call_free(c);
}

static void on_recv(zt_rpc_server_t *s, zt_rpc_call_t *c, int ok) {
  if (!ok || !c->recv_buf) {
    /* Too large, cancelled, or a client that half-closed without a message. */
    zt_rpc_reply(c, ZT_RPC_INVALID_ARGUMENT, "request carries no complete message", NULL, 0);
    return;
  }
  c->req = take_buffer(c->recv_buf, &c->req_len);
  c->recv_buf = NULL;
  if (!c->req) {
    zt_rpc_reply(c, ZT_RPC_INVALID_ARGUMENT, "request message could not be read", NULL, 0);
    return;
  }
  hand_to_loop(s, c);
}

static void *server_thread(void *arg) {
  zt_rpc_server_t *s = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type != GRPC_OP_COMPLETE) continue;
    rpc_tag *t = ev.tag;
    switch (t->kind) {
    case TAG_NEW: on_new_call(s, t->owner, ev.success); break;
    case TAG_RECV: on_recv(s, t->owner, ev.success); break;
    case TAG_SENT: call_free(t->owner); break;
    case TAG_SHUTDOWN: grpc_completion_queue_shutdown(s->cq); break;
    }
  }
  return NULL;
}

int zt_rpc_server_start(uv_loop_t *loop, const char *addr, const zt_rpc_server_opts_t *opts,
                        zt_rpc_handler_fn handler, void *user, zt_rpc_server_t **out) {
  size_t maxmsg = opts && opts->max_message_bytes ? opts->max_message_bytes : 4u << 20;
  int slots = opts && opts->accept_slots ? opts->accept_slots : 256;
  grpc_init();
  zt_rpc_server_t *s = zt_xcalloc(1, sizeof *s);
  s->loop = loop;
  s->handler = handler;
  s->user = user;
  s->tag_shutdown = (rpc_tag){TAG_SHUTDOWN, s};
  pthread_mutex_init(&s->mu, NULL);

  grpc_arg args[2];
  args[0].type = GRPC_ARG_INTEGER;
  args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
  args[0].value.integer = (int)maxmsg;
  args[1].type = GRPC_ARG_INTEGER;
  args[1].key = GRPC_ARG_MAX_CONCURRENT_STREAMS;
  args[1].value.integer = 100000;
  grpc_channel_args ca = {2, args};
  s->server = grpc_server_create(&ca, NULL);
  s->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_server_register_completion_queue(s->server, s->cq, NULL);
  grpc_server_credentials *cr = grpc_insecure_server_credentials_create();
  s->port = grpc_server_add_http2_port(s->server, addr, cr);
  grpc_server_credentials_release(cr);
  if (s->port == 0) {
    zt_err("cannot listen for gRPC on %s (address in use or invalid)", addr);
    grpc_server_destroy(s->server);
    grpc_completion_queue_shutdown(s->cq);
    while (grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(s->cq);
    pthread_mutex_destroy(&s->mu);
    free(s);
    grpc_shutdown();
    return -1;
  }
  grpc_server_start(s->server);
  uv_async_init(loop, &s->async, on_async);
  s->async.data = s;
  for (int i = 0; i < slots; i++) arm_slot(s);
  pthread_create(&s->thread, NULL, server_thread, s);
  *out = s;
  return 0;
}

int zt_rpc_server_port(const zt_rpc_server_t *s) { return s->port; }

static void on_async_closed(uv_handle_t *h) {
  zt_rpc_server_t *s = h->data;
  pthread_mutex_destroy(&s->mu);
  free(s);
  grpc_shutdown();
}

void zt_rpc_server_stop(zt_rpc_server_t *s) {
  pthread_mutex_lock(&s->mu);
  s->stopping = 1;
  zt_rpc_call_t *c = s->head;
  s->head = s->tail = NULL;
  pthread_mutex_unlock(&s->mu);
  while (c) {
    zt_rpc_call_t *next = c->next;
    zt_rpc_reply(c, ZT_RPC_UNAVAILABLE, "server is shutting down", NULL, 0);
    c = next;
  }
  grpc_server_shutdown_and_notify(s->server, s->cq, &s->tag_shutdown);
  grpc_server_cancel_all_calls(s->server);
  pthread_join(s->thread, NULL);
  grpc_server_destroy(s->server);
  grpc_completion_queue_destroy(s->cq);
  uv_close((uv_handle_t *)&s->async, on_async_closed);
}

/* ======================================================================
 * Client
 * ====================================================================== */

struct zt_rpc_client {
  /* The channel, replaced after a call timed out on a connection gRPC
   * still believed alive (client_suspect); under mu, because any thread
   * may start calls. A call keeps the channel it started on alive by
   * itself (gRPC counts it), so the old one is destroyed at once. */
  pthread_mutex_t mu;
  grpc_channel *channel;
  char *target;
  int maxmsg, reconnect_max, connect_min;
  int64_t replaced_ms; /* the last replacement (monotonic), 0: none */
  unsigned replaced;
  grpc_completion_queue *acq; /* for zt_rpc_start/zt_rpc_next */
  grpc_metadata auth;
  int has_auth;
  uint32_t md_flags; /* GRPC_INITIAL_METADATA_WAIT_FOR_READY or 0 */
};

/* Everything one unary call needs until its batch completes. */
typedef struct {
  grpc_call *call;
  grpc_channel *channel; /* the one it started on (only compared) */
  grpc_byte_buffer *send_buf, *recv_buf;
  grpc_metadata_array init_md, trail_md;
  grpc_status_code status;
  grpc_slice details;
  const char *error_string;
  void *user;
  char method[128];
} rpc_pending;

/* A new channel to c->target. Each client has connections of its own
 * (a local subchannel pool): gRPC would otherwise share one connection
 * among all channels to the same target, and a replaced channel would get
 * the dead connection back. */
static grpc_channel *channel_new(const zt_rpc_client_t *c) {
  grpc_arg args[5];
  args[0].type = GRPC_ARG_INTEGER;
  args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
  args[0].value.integer = c->maxmsg;
  args[1].type = GRPC_ARG_INTEGER;
  args[1].key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS;
  args[1].value.integer = ZT_MIN(100, c->reconnect_max);
  /* gRPC also takes this as the least time one connection attempt (TCP
   * and HTTP/2 handshakes) may take before it is given up: 100 ms gave up
   * on loaded machines ("tcp handshaker shutdown"), failing calls that do
   * not wait for the connection. */
  args[2].type = GRPC_ARG_INTEGER;
  args[2].key = GRPC_ARG_MIN_RECONNECT_BACKOFF_MS;
  args[2].value.integer = c->connect_min;
  args[3].type = GRPC_ARG_INTEGER;
  args[3].key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS;
  args[3].value.integer = c->reconnect_max;
  args[4].type = GRPC_ARG_INTEGER;
  args[4].key = GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL;
  args[4].value.integer = 1;
  grpc_channel_args ca = {5, args};
  grpc_channel_credentials *cr = grpc_insecure_credentials_create();
  grpc_channel *ch = grpc_channel_create(c->target, cr, &ca);
  grpc_channel_credentials_release(cr);
  return ch;
}

int zt_rpc_client_open(const char *target, const zt_rpc_client_opts_t *opts, zt_rpc_client_t **out) {
  grpc_init();
  zt_rpc_client_t *c = zt_xcalloc(1, sizeof *c);
  size_t maxmsg = opts && opts->max_message_bytes ? opts->max_message_bytes : 64u << 20;
  c->maxmsg = (int)ZT_MIN(maxmsg, (size_t)INT32_MAX);
  c->reconnect_max = opts && opts->reconnect_max_ms > 0 ? opts->reconnect_max_ms
                                                       : ZT_RPC_RECONNECT_MAX_MS;
  c->connect_min = opts && opts->connect_min_ms > 0 ? opts->connect_min_ms : ZT_RPC_CONNECT_MIN_MS;
  c->target = zt_xstrdup(target);
  pthread_mutex_init(&c->mu, NULL);
  c->channel = channel_new(c);
  c->acq = grpc_completion_queue_create_for_next(NULL);
  if (opts && opts->wait_for_ready) c->md_flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY;
  if (opts && opts->authorization) {
    c->auth.key = grpc_slice_from_static_string("authorization");
    c->auth.value = grpc_slice_from_copied_string(opts->authorization);
    c->has_auth = 1;
  }
  *out = c;
  return 0;
}

unsigned zt_rpc_client_replaced(zt_rpc_client_t *c) {
  pthread_mutex_lock(&c->mu);
  unsigned n = c->replaced;
  pthread_mutex_unlock(&c->mu);
  return n;
}

/* After a call on `used` ended in DEADLINE_EXCEEDED: when that channel is
 * still the client's and holds a connection it believes alive (READY),
 * the connection died without a word (zt_rpc.h) and the channel is
 * replaced; at most once per ZT_RPC_REPLACE_MIN_MS, so that a server that
 * is only slow does not get a new connection from every client on every
 * late answer. */
static void client_suspect(zt_rpc_client_t *c, grpc_channel *used) {
  int64_t now = zt_now_ms();
  pthread_mutex_lock(&c->mu);
  if (used == c->channel && (!c->replaced_ms || now - c->replaced_ms >= ZT_RPC_REPLACE_MIN_MS) &&
      grpc_channel_check_connectivity_state(c->channel, 0) == GRPC_CHANNEL_READY) {
    grpc_channel_destroy(c->channel);
    c->channel = channel_new(c);
    c->replaced_ms = now;
    c->replaced++;
  }
  pthread_mutex_unlock(&c->mu);
}

static void drain_and_destroy(grpc_completion_queue *cq) {
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
}

void zt_rpc_client_close(zt_rpc_client_t *c) {
  if (!c) return;
  grpc_channel_destroy(c->channel);
  drain_and_destroy(c->acq);
  if (c->has_auth) grpc_slice_unref(c->auth.value);
  pthread_mutex_destroy(&c->mu);
  free(c->target);
  free(c);
  grpc_shutdown();
}

static rpc_pending *pending_start(zt_rpc_client_t *c, grpc_completion_queue *cq, const char *method,
                                  const uint8_t *req, size_t req_len, int64_t timeout_ms,
                                  void *user) {
  rpc_pending *p = zt_xcalloc(1, sizeof *p);
  p->user = user;
  snprintf(p->method, sizeof p->method, "%s", method);
  grpc_metadata_array_init(&p->init_md);
  grpc_metadata_array_init(&p->trail_md);
  gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                       gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
  grpc_slice m = grpc_slice_from_copied_string(method);
  pthread_mutex_lock(&c->mu);
  p->channel = c->channel;
  p->call = grpc_channel_create_call(c->channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq, m, NULL,
                                     deadline, NULL);
  pthread_mutex_unlock(&c->mu);
  grpc_slice_unref(m);
  p->send_buf = make_buffer(req, req_len);
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[0].flags = c->md_flags;
  if (c->has_auth) {
    ops[0].data.send_initial_metadata.count = 1;
    ops[0].data.send_initial_metadata.metadata = &c->auth;
  }
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = p->send_buf;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &p->init_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &p->recv_buf;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &p->trail_md;
  ops[5].data.recv_status_on_client.status = &p->status;
  ops[5].data.recv_status_on_client.status_details = &p->details;
  ops[5].data.recv_status_on_client.error_string = &p->error_string;
  if (grpc_call_start_batch(p->call, ops, 6, p, NULL) != GRPC_CALL_OK) {
    /* Cannot happen with a well-formed batch; treat as an internal error. */
    abort();
  }
  return p;
}

/* Moves a completed call's outcome into `res` and frees it. */
static void pending_finish(rpc_pending *p, zt_rpc_result_t *res) {
  memset(res, 0, sizeof *res);
  res->user = p->user;
  res->status = (int)p->status;
  char *det = slice_to_cstr(p->details);
  snprintf(res->details, sizeof res->details, "%s", det);
  free(det);
  if (p->recv_buf && p->status == GRPC_STATUS_OK) {
    res->resp = take_buffer(p->recv_buf, &res->resp_len);
    p->recv_buf = NULL;
  }
  if (p->recv_buf) grpc_byte_buffer_destroy(p->recv_buf);
  grpc_byte_buffer_destroy(p->send_buf);
  grpc_metadata_array_destroy(&p->init_md);
  grpc_metadata_array_destroy(&p->trail_md);
  grpc_slice_unref(p->details);
  if (p->error_string) gpr_free((void *)p->error_string);
  grpc_call_unref(p->call);
  free(p);
}

int zt_rpc_call(zt_rpc_client_t *c, const char *method, const uint8_t *req, size_t req_len,
                int64_t timeout_ms, uint8_t **resp, size_t *resp_len, int *status) {
  grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
  rpc_pending *p = pending_start(c, cq, method, req, req_len, timeout_ms, NULL);
  grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  (void)ev; /* the call's deadline guarantees completion */
  zt_rpc_result_t res;
  grpc_channel *used = p->channel;
  pending_finish(p, &res);
  if (res.status == ZT_RPC_DEADLINE_EXCEEDED) client_suspect(c, used);
  drain_and_destroy(cq);
  if (status) *status = res.status;
  if (res.status != ZT_RPC_OK) {
    free(res.resp);
    return zt_err("%s: %s: %s", method, zt_rpc_status_name(res.status), res.details);
  }
  if (resp) *resp = res.resp;
  else free(res.resp);
  if (resp_len) *resp_len = res.resp_len;
  return 0;
}

void zt_rpc_start(zt_rpc_client_t *c, const char *method, const uint8_t *req, size_t req_len,
                  int64_t timeout_ms, void *user) {
  pending_start(c, c->acq, method, req, req_len, timeout_ms, user);
}

int zt_rpc_next(zt_rpc_client_t *c, int64_t timeout_ms, zt_rpc_result_t *res) {
  gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                       gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
  grpc_event ev = grpc_completion_queue_next(c->acq, deadline, NULL);
  if (ev.type != GRPC_OP_COMPLETE) return 0;
  grpc_channel *used = ((rpc_pending *)ev.tag)->channel;
  pending_finish(ev.tag, res);
  if (res->status == ZT_RPC_DEADLINE_EXCEEDED) client_suspect(c, used);
  return 1;
}
