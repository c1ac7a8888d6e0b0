/*
 * hbload.c: heartbeat load generator for bench/heartbeats.
 *
 *   zt_hbload --coordinator HOST:PORT -n WORKERS [--seconds S] [--rate-hz R]
 *             [--per-host K]
 *
 * Simulates WORKERS workers from one process: registers them all (many
 * calls in flight at once), then sends each one's heartbeat R times per
 * second, spread evenly over the period, for S seconds, with asynchronous
 * calls on one channel (zt_rpc_start / zt_rpc_next). Like a real worker it
 * follows the interval the coordinator's replies ask for (heartbeat_ms:
 * a coordinator past its capacity stretches it); --fixed keeps R. Reports
 * achieved heartbeats per second and the latency distribution of the
 * measured phase as one JSON line:
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

#include "zt_common.h"
#include "zt_rpc.h"
#include "ztrain.pb-c.h"

typedef struct {
  uint64_t id;
  char session[80]; /* the credential every call after registration carries */
  int64_t sent_us; /* 0 when no call is in flight */
} sim_worker;

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static size_t pack(const ProtobufCMessage *m, uint8_t *buf) {
  protobuf_c_message_pack(m, buf);
  return protobuf_c_message_get_packed_size(m);
}

/* Registers all workers, `window` calls in flight at a time; *interval_ms
 * is the heartbeat interval the last reply asked for. */
static int register_all(zt_rpc_client_t *c, sim_worker *w, int n, int window, int agent,
                        int64_t *interval_ms) {
  int next = 0, done = 0, inflight = 0;
  while (done < n) {
    while (inflight < window && next < n) {
      char name[64];
      snprintf(name, sizeof name, "sim-%06d", next);
      Ztrain__RegisterRequest req = ZTRAIN__REGISTER_REQUEST__INIT;
      req.name = name;
      req.host = "hbload";
      req.device = "cpu";
      req.heartbeat_agent = agent; /* as zworker --heartbeat-agent says */
      uint8_t buf[256];
      size_t len = pack(&req.base, buf);
      zt_rpc_start(c, "/ztrain.Control/RegisterWorker", buf, len, 10000, &w[next]);
      next++, inflight++;
    }
    zt_rpc_result_t r;
    if (!zt_rpc_next(c, 10000, &r)) return zt_err("registration stalled");
    inflight--, done++;
    if (r.status != ZT_RPC_OK) {
      free(r.resp);
      return zt_err("register: %s: %s", zt_rpc_status_name(r.status), r.details);
    }
    Ztrain__RegisterReply *rep = ztrain__register_reply__unpack(NULL, r.resp_len, r.resp);
    free(r.resp);
    if (!rep) return zt_err("register: bad reply");
    sim_worker *sw = r.user;
    sw->id = rep->worker_id;
    if (rep->heartbeat_ms) *interval_ms = rep->heartbeat_ms;
    snprintf(sw->session, sizeof sw->session, "%s", rep->session ? rep->session : "");
    ztrain__register_reply__free_unpacked(rep, NULL);
  }
  return 0;
}

int main(int argc, char **argv) {
  zt_log_set_prefix("hbload");
  const char *coord = "127.0.0.1:7070";
  int n = 100, fixed = 0, per_host = 1;
  double seconds = 10, rate = 1;
  static const struct option opts[] = {{"coordinator", required_argument, 0, 'c'},
                                       {"seconds", required_argument, 0, 's'},
                                       {"rate-hz", required_argument, 0, 'r'},
                                       {"fixed", no_argument, 0, 'f'},
                                       {"per-host", required_argument, 0, 'k'},
                                       {0, 0, 0, 0}};
  int ch;
  while ((ch = getopt_long(argc, argv, "n:", opts, NULL)) != -1) {
    switch (ch) {
    case 'c': coord = optarg; break;
    case 'n': n = atoi(optarg); break;
    case 's': seconds = atof(optarg); break;
    case 'r': rate = atof(optarg); break;
    case 'f': fixed = 1; break;
    case 'k': per_host = atoi(optarg); break;
    default:
      fprintf(stderr, "usage: zt_hbload --coordinator HOST:PORT -n N [--seconds S] [--rate-hz R] "
                      "[--fixed] [--per-host K]\n");
      return 2;
    }
  }
  if (n <= 0 || seconds <= 0 || rate <= 0 || per_host < 1 || per_host > ZT_HB_BATCH_MAX) return 2;
  zt_rpc_client_t *c;
  if (zt_rpc_client_open(coord, NULL, &c) != 0) return 1;
  sim_worker *w = calloc((size_t)n, sizeof *w);
  if (!w) return 1;
  int64_t t_reg = zt_now_us();
  int64_t reg_interval_ms = 0;
  if (register_all(c, w, n, 512, per_host > 1, &reg_interval_ms) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 1;
  }
  double reg_s = (double)(zt_now_us() - t_reg) / 1e6;

  /* The machines take turns, one every period / machines: each one's
   * heartbeats are a period apart, the period the replies ask for. */
  int hosts = (n + per_host - 1) / per_host;
  int64_t period_us = (int64_t)(1e6 / rate);
  if (reg_interval_ms && !fixed) period_us = reg_interval_ms * 1000;
  size_t cap = (size_t)(seconds * rate * hosts) + 16;
  int64_t *lat = malloc(cap * sizeof *lat);
  int64_t sent = 0, calls = 0, ok = 0, errors = 0, lost = 0, nlat = 0;
  int64_t t0 = zt_now_us(), t_end = t0 + (int64_t)(seconds * 1e6);
  double due = (double)t0;
  int64_t inflight = 0;
  Ztrain__HeartbeatRequest *reqs = calloc((size_t)per_host, sizeof *reqs);
  Ztrain__HeartbeatRequest **rp = calloc((size_t)per_host, sizeof *rp);
  uint8_t *buf = malloc(256 * (size_t)per_host + 64);
  while (due < (double)t_end || inflight > 0) {
    int64_t now = zt_now_us();
    while (due < (double)t_end && due <= (double)now) {
      int64_t k = calls / hosts, h = calls % hosts;
      int first = (int)h * per_host, cnt = ZT_MIN(per_host, n - first);
      due += (double)period_us / hosts;
      calls++;
      sim_worker *sw = &w[first];
      if (sw->sent_us) { /* previous heartbeat still in flight: count as late */
        errors += cnt;
        sent += cnt;
        continue;
      }
      for (int j = 0; j < cnt; j++) {
        ztrain__heartbeat_request__init(&reqs[j]);
        reqs[j].worker_id = w[first + j].id;
        reqs[j].seq = (uint64_t)k;
        reqs[j].session = w[first + j].session;
        rp[j] = &reqs[j];
      }
      size_t len;
      sw->sent_us = zt_now_us();
      if (per_host == 1) {
        len = pack(&reqs[0].base, buf);
        zt_rpc_start(c, "/ztrain.Control/Heartbeat", buf, len, 5000, sw);
      } else {
        Ztrain__HeartbeatBatchRequest b = ZTRAIN__HEARTBEAT_BATCH_REQUEST__INIT;
        b.beats = rp;
        b.n_beats = (size_t)cnt;
        len = pack(&b.base, buf);
        zt_rpc_start(c, "/ztrain.Control/HeartbeatBatch", buf, len, 5000, sw);
      }
      sent += cnt, inflight++;
    }
    /* Collect what completed; wait at most until the next due heartbeat. */
    int64_t wait_ms = 1;
    zt_rpc_result_t r;
    while (inflight > 0 && zt_rpc_next(c, wait_ms, &r)) {
      sim_worker *sw = r.user;
      int cnt = ZT_MIN(per_host, n - (int)(sw - w));
      inflight--;
      if (r.status == ZT_RPC_OK) {
        if ((size_t)nlat < cap) lat[nlat++] = zt_now_us() - sw->sent_us;
        int64_t ask = 0;
        if (per_host == 1) {
          Ztrain__HeartbeatReply *rep = ztrain__heartbeat_reply__unpack(NULL, r.resp_len, r.resp);
          ok += rep != NULL, errors += rep == NULL;
          if (rep) ask = rep->heartbeat_ms, ztrain__heartbeat_reply__free_unpacked(rep, NULL);
        } else {
          Ztrain__HeartbeatBatchReply *rep =
              ztrain__heartbeat_batch_reply__unpack(NULL, r.resp_len, r.resp);
          size_t got = rep ? rep->n_replies : 0;
          errors += cnt - (int64_t)ZT_MIN(got, (size_t)cnt);
          for (size_t j = 0; j < got && j < (size_t)cnt; j++) {
            const Ztrain__HeartbeatBatchEntry *e = rep->replies[j];
            if (!e->status && e->reply) {
              ok++;
              if (e->reply->heartbeat_ms) ask = e->reply->heartbeat_ms;
              continue;
            }
            errors++;
            lost += e->error && strstr(e->error, "is lost") != NULL;
            if (errors < 5) ZT_WARN("heartbeat: %s", e->error ? e->error : "no reply");
          }
          if (rep) ztrain__heartbeat_batch_reply__free_unpacked(rep, NULL);
        }
        if (ask && !fixed) period_us = ask * 1000;
      } else {
        errors += cnt;
        lost += strstr(r.details, "is lost") != NULL ? cnt : 0;
        if (errors < 5) ZT_WARN("heartbeat: %s: %s", zt_rpc_status_name(r.status), r.details);
      }
      sw->sent_us = 0;
      free(r.resp);
      wait_ms = 0;
    }
    if (zt_now_us() > t_end + 10 * 1000000LL) break; /* stragglers */
  }
  free(reqs), free(rp), free(buf);
  double el = (double)(zt_now_us() - t0) / 1e6;
  qsort(lat, (size_t)nlat, sizeof *lat, cmp_i64);
  double p50 = nlat ? lat[nlat / 2] / 1000.0 : 0, p99 = nlat ? lat[(nlat * 99) / 100] / 1000.0 : 0;
  double mx = nlat ? lat[nlat - 1] / 1000.0 : 0;
  printf("{\"workers\":%d,\"per_host\":%d,\"seconds\":%.2f,\"register_s\":%.3f,\"sent\":%lld,"
         "\"ok\":%lld,\"errors\":%lld,\"lost\":%lld,\"interval_ms\":%lld,\"hb_per_s\":%.1f,"
         "\"calls_per_s\":%.1f,\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"max_ms\":%.3f}\n",
         n, per_host, el, reg_s, (long long)sent, (long long)ok, (long long)errors,
         (long long)lost, (long long)(period_us / 1000), (double)ok / el,
         (double)(calls) / el, p50, p99, mx);
  free(lat);
  free(w);
  zt_rpc_client_close(c);
  return errors ? 1 : 0;
}
