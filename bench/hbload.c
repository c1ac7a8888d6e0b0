/*
 * hbload.c: heartbeat load generator for bench/heartbeats.
 *
 *   zt_hbload --coordinator HOST:PORT -n WORKERS [--seconds S] [--rate-hz R]
 *             [--per-host K]
 *
 * Simulates WORKERS workers from one process: registers them all (512
 * calls in flight at once) and sends each one's heartbeat R times per
 * second from its registration on, spread evenly over the period, for S
 * seconds after the last registration (the measured phase), with
 * asynchronous calls on one channel (zt_rpc_start / zt_rpc_next). Errors
 * count in both phases; latency and rates are the measured phase's. A
 * registration the coordinator refuses as behind (UNAVAILABLE) or does
 * not answer in 60 s is sent again after zworker's backoff
 * (register_refused counts them).
 * Like a real worker it follows the interval the coordinator's replies
 * ask for (heartbeat_ms: a coordinator past its capacity stretches it);
 * --fixed keeps R. Reports achieved heartbeats per second and the latency
 * distribution of the measured phase as one JSON line:
 *   {"workers":N,"seconds":S,"sent":..,"ok":..,"errors":..,"lost":..,
 *    "interval_ms":..,"hb_per_s":..,"p50_ms":..,"p99_ms":..,"max_ms":..}
 * lost counts heartbeats refused because the coordinator had declared the
 * worker lost; interval_ms is the last interval the replies asked for.
 * Latency is from just before the call is started to its completion, so it
 * includes client queueing: the figure a real worker would see.
 *
 * --per-host K: the workers are machines of K (a GPU each) whose heartbeat
 * agents (worker/agent.c) send one HeartbeatBatch of the K heartbeats per
 * interval; hb_per_s still counts worker heartbeats, calls_per_s the
 * calls. The agent holds a heartbeat until its machine's others are there;
 * here all K are ready at once, so the latency is the call's.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "zt_common.h"
#include "zt_rpc.h"
#include "ztrain.pb-c.h"

typedef struct {
  uint64_t id;
  char session[80]; /* the credential every call after registration carries */
  int64_t sent_us;  /* its machine's heartbeat call in flight (first worker); 0: none */
  int registering;  /* its registration call is in flight */
  int reg_tries;    /* its registrations refused or unanswered so far */
} sim_worker;

/* The run: workers, machines, the schedule and what was measured. */
typedef struct {
  zt_rpc_client_t *c;
  sim_worker *w;
  int n, per_host, hosts, fixed;
  int next_reg, reg_inflight, reg_done, *host_reg; /* registered workers per machine */
  /* Registrations refused or unanswered, to be sent again after a
   * backoff: a FIFO of worker indexes with the time each is due. */
  int *retry, retry_head, retry_tail;
  int64_t *retry_at, reg_refused;
  int64_t period_us, t0, t_end, inflight;
  int64_t sent, calls, ok, errors, lost, nlat;
  int64_t *lat;
  size_t cap;
  Ztrain__HeartbeatRequest *reqs, **rp;
  uint8_t *buf;
} run_t;

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static size_t pack(const ProtobufCMessage *m, uint8_t *buf) {
  protobuf_c_message_pack(m, buf);
  return protobuf_c_message_get_packed_size(m);
}

static int host_size(const run_t *r, int h) { return ZT_MIN(r->per_host, r->n - h * r->per_host); }

/* Starts registrations until `window` are in flight. */
static void register_more(run_t *r, int window) {
  int64_t now = zt_now_us();
  for (;;) {
    int i;
    if (r->reg_inflight >= window) break;
    if (r->retry_head != r->retry_tail && r->retry_at[r->retry_head] <= now)
      i = r->retry[r->retry_head], r->retry_head = (r->retry_head + 1) % (r->n + 1);
    else if (r->next_reg < r->n)
      i = r->next_reg++;
    else
      break;
    char name[64];
    snprintf(name, sizeof name, "sim-%06d", i);
    Ztrain__RegisterRequest req = ZTRAIN__REGISTER_REQUEST__INIT;
    req.name = name;
    req.host = "hbload";
    req.device = "cpu";
    req.heartbeat_agent = r->per_host > 1; /* as zworker --heartbeat-agent says */
    uint8_t buf[256];
    size_t len = pack(&req.base, buf);
    r->w[i].registering = 1;
    zt_rpc_start(r->c, "/ztrain.Control/RegisterWorker", buf, len, 60000, &r->w[i]);
    r->reg_inflight++;
  }
}

static int registered(run_t *r, sim_worker *sw, zt_rpc_result_t *res) {
  sw->registering = 0;
  r->reg_inflight--;
  /* Refused as behind, or no answer in time: again later, with the
   * backoff zworker uses (from 100 ms, doubling to 6.4 s). */
  if (res->status == ZT_RPC_UNAVAILABLE || res->status == ZT_RPC_DEADLINE_EXCEEDED) {
    r->reg_refused++;
    int64_t backoff_us = 100000LL << ZT_MIN(sw->reg_tries++, 6);
    r->retry[r->retry_tail] = (int)(sw - r->w);
    r->retry_at[r->retry_tail] = zt_now_us() + backoff_us;
    r->retry_tail = (r->retry_tail + 1) % (r->n + 1);
    return 0;
  }
  r->reg_done++;
  if (res->status != ZT_RPC_OK)
    return zt_err("register: %s: %s", zt_rpc_status_name(res->status), res->details);
  Ztrain__RegisterReply *rep = ztrain__register_reply__unpack(NULL, res->resp_len, res->resp);
  if (!rep) return zt_err("register: bad reply");
  sw->id = rep->worker_id;
  if (rep->heartbeat_ms && !r->fixed) r->period_us = rep->heartbeat_ms * 1000LL;
  snprintf(sw->session, sizeof sw->session, "%s", rep->session ? rep->session : "");
  ztrain__register_reply__free_unpacked(rep, NULL);
  r->host_reg[(sw - r->w) / r->per_host]++;
  return 0;
}

/* Sends machine h's heartbeats (one call; a batch with K > 1). */
static void beat(run_t *r, int h, int64_t k) {
  int first = h * r->per_host, cnt = host_size(r, h);
  sim_worker *sw = &r->w[first];
  int measured = r->t0 != 0;
  r->calls += measured;
  if (sw->sent_us) { /* previous heartbeat still in flight: count as late */
    r->errors += cnt;
    r->sent += measured ? cnt : 0;
    return;
  }
  for (int j = 0; j < cnt; j++) {
    ztrain__heartbeat_request__init(&r->reqs[j]);
    r->reqs[j].worker_id = r->w[first + j].id;
    r->reqs[j].seq = (uint64_t)k;
    r->reqs[j].session = r->w[first + j].session;
    r->rp[j] = &r->reqs[j];
  }
  size_t len;
  sw->sent_us = zt_now_us();
  if (r->per_host == 1) {
    len = pack(&r->reqs[0].base, r->buf);
    zt_rpc_start(r->c, "/ztrain.Control/Heartbeat", r->buf, len, 5000, sw);
  } else {
    Ztrain__HeartbeatBatchRequest b = ZTRAIN__HEARTBEAT_BATCH_REQUEST__INIT;
    b.beats = r->rp;
    b.n_beats = (size_t)cnt;
    len = pack(&b.base, r->buf);
    zt_rpc_start(r->c, "/ztrain.Control/HeartbeatBatch", r->buf, len, 5000, sw);
  }
  r->sent += measured ? cnt : 0;
  r->inflight++;
}

/* A heartbeat call came back: its latency (if sent in the measured
 * phase), its errors, and the interval it asks for. */
static void answered(run_t *r, sim_worker *sw, zt_rpc_result_t *res) {
  int cnt = host_size(r, (int)(sw - r->w) / r->per_host);
  int measured = r->t0 && sw->sent_us >= r->t0;
  r->inflight--;
  if (res->status == ZT_RPC_OK) {
    if (measured && (size_t)r->nlat < r->cap) r->lat[r->nlat++] = zt_now_us() - sw->sent_us;
    int64_t ask = 0;
    if (r->per_host == 1) {
      Ztrain__HeartbeatReply *rep = ztrain__heartbeat_reply__unpack(NULL, res->resp_len, res->resp);
      r->ok += measured && rep, r->errors += rep == NULL;
      if (rep) ask = rep->heartbeat_ms, ztrain__heartbeat_reply__free_unpacked(rep, NULL);
    } else {
      Ztrain__HeartbeatBatchReply *rep =
          ztrain__heartbeat_batch_reply__unpack(NULL, res->resp_len, res->resp);
      size_t got = rep ? rep->n_replies : 0;
      r->errors += cnt - (int64_t)ZT_MIN(got, (size_t)cnt);
      for (size_t j = 0; j < got && j < (size_t)cnt; j++) {
        const Ztrain__HeartbeatBatchEntry *e = rep->replies[j];
        if (!e->status && e->reply) {
          r->ok += measured;
          if (e->reply->heartbeat_ms) ask = e->reply->heartbeat_ms;
          continue;
        }
        r->errors++;
        r->lost += e->error && strstr(e->error, "is lost") != NULL;
        if (r->errors < 5) ZT_WARN("heartbeat: %s", e->error ? e->error : "no reply");
      }
      if (rep) ztrain__heartbeat_batch_reply__free_unpacked(rep, NULL);
    }
    if (ask && !r->fixed) r->period_us = ask * 1000;
  } else {
    r->errors += cnt;
    r->lost += strstr(res->details, "is lost") != NULL ? cnt : 0;
    if (r->errors < 5) ZT_WARN("heartbeat: %s: %s", zt_rpc_status_name(res->status), res->details);
  }
  sw->sent_us = 0;
}

int main(int argc, char **argv) {
  zt_log_set_prefix("hbload");
  const char *coord = "127.0.0.1:7070";
  int n = 100, fixed = 0, per_host = 1;
  double seconds = 10, rate = 1;
  static const struct option opts[] = {
      {"coordinator", required_argument, 0, 'c'}, {"seconds", required_argument, 0, 's'},
      {"rate-hz", required_argument, 0, 'r'},     {"fixed", no_argument, 0, 'f'},
      {"per-host", required_argument, 0, 'k'},    {0, 0, 0, 0}};
  int ch;
  while ((ch = getopt_long(argc, argv, "n:", opts, NULL)) != -1) {
    switch (ch) {
    case 'c':
      coord = optarg;
      break;
    case 'n':
      n = atoi(optarg);
      break;
    case 's':
      seconds = atof(optarg);
      break;
    case 'r':
      rate = atof(optarg);
      break;
    case 'f':
      fixed = 1;
      break;
    case 'k':
      per_host = atoi(optarg);
      break;
    default:
      fprintf(stderr,
              "usage: zt_hbload --coordinator HOST:PORT -n N "
              "[--seconds S] [--rate-hz R] "
              "[--fixed] [--per-host K]\n");
      return 2;
    }
  }
  if (n <= 0 || seconds <= 0 || rate <= 0 || per_host < 1 || per_host > ZT_HB_BATCH_MAX) return 2;
  run_t r = {.n = n, .per_host = per_host, .fixed = fixed};
  if (zt_rpc_client_open(coord, NULL, &r.c) != 0) return 1;
  r.hosts = (n + per_host - 1) / per_host;
  r.w = calloc((size_t)n, sizeof *r.w);
  r.host_reg = calloc((size_t)r.hosts, sizeof *r.host_reg);
  r.period_us = (int64_t)(1e6 / rate);
  r.cap = (size_t)(seconds * rate * r.hosts) + 16;
  r.lat = malloc(r.cap * sizeof *r.lat);
  r.reqs = calloc((size_t)per_host, sizeof *r.reqs);
  r.rp = calloc((size_t)per_host, sizeof *r.rp);
  r.buf = malloc(256 * (size_t)per_host + 64);
  r.retry = malloc((size_t)(n + 1) * sizeof *r.retry);
  r.retry_at = malloc((size_t)(n + 1) * sizeof *r.retry_at);
  if (!r.w || !r.host_reg || !r.lat || !r.reqs || !r.rp || !r.buf || !r.retry || !r.retry_at)
    return 1;

  /* The machines take turns, one every period / machines: each one's
   * heartbeats are a period apart, the period the replies ask for. A
   * machine starts as soon as its workers are registered, as zworker's
   * heartbeats start with its registration; the measured phase starts when
   * the last one is. */
  int64_t t_reg = zt_now_us();
  double reg_s = 0;
  double due = (double)t_reg;
  int64_t calls = 0;
  int rc = 0;
  while (r.reg_done < n || due < (double)r.t_end || r.inflight > 0 || r.reg_inflight > 0) {
    register_more(&r, 512);
    int64_t now = zt_now_us();
    while ((!r.t_end || due < (double)r.t_end) && due <= (double)now) {
      int h = (int)(calls % r.hosts);
      due += (double)r.period_us / r.hosts;
      if (r.host_reg[h] == host_size(&r, h)) beat(&r, h, calls / r.hosts);
      calls++;
    }
    /* Collect what completed; wait at most until the next due heartbeat. */
    int64_t wait_ms = 1;
    zt_rpc_result_t res;
    while ((r.inflight > 0 || r.reg_inflight > 0) && zt_rpc_next(r.c, wait_ms, &res)) {
      sim_worker *sw = res.user;
      if (sw->registering) {
        if (registered(&r, sw, &res) != 0 && !rc) rc = 1, ZT_ERROR("%s", zt_err_msg());
      } else {
        answered(&r, sw, &res);
      }
      free(res.resp);
      wait_ms = 0;
    }
    if (rc) break;
    if (!r.inflight && !r.reg_inflight) usleep(1000); /* only refused registrations wait */
    if (!r.t0 && r.reg_done == n) {
      r.t0 = zt_now_us();
      r.t_end = r.t0 + (int64_t)(seconds * 1e6);
      reg_s = (double)(r.t0 - t_reg) / 1e6;
    }
    if (r.t_end && zt_now_us() > r.t_end + 10 * 1000000LL) break; /* stragglers */
  }
  if (rc) return 1;
  double el = (double)(zt_now_us() - r.t0) / 1e6;
  qsort(r.lat, (size_t)r.nlat, sizeof *r.lat, cmp_i64);
  int64_t nl = r.nlat;
  double p50 = nl ? r.lat[nl / 2] / 1000.0 : 0, p99 = nl ? r.lat[(nl * 99) / 100] / 1000.0 : 0;
  double mx = nl ? r.lat[nl - 1] / 1000.0 : 0;
  printf(
      "{\"workers\":%d,\"per_host\":%d,\"seconds\":%.2f,\"register_s\":%.3f,"
      "\"register_refused\":%lld,\"sent\":%lld,"
      "\"ok\":%lld,\"errors\":%lld,\"lost\":%lld,\"interval_ms\":%lld,\"hb_per_"
      "s\":%.1f,"
      "\"calls_per_s\":%.1f,\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"max_ms\":%.3f}\n",
      n, per_host, el, reg_s, (long long)r.reg_refused, (long long)r.sent, (long long)r.ok,
      (long long)r.errors, (long long)r.lost, (long long)(r.period_us / 1000), (double)r.ok / el,
      (double)r.calls / el, p50, p99, mx);
  free(r.reqs), free(r.rp), free(r.buf), free(r.lat), free(r.w), free(r.host_reg);
  free(r.retry), free(r.retry_at);
  zt_rpc_client_close(r.c);
  return r.errors ? 1 : 0;
}
