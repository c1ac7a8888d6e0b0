/*
 * commrun.c: one rank of a collective run, for bench/allreduce and the
 * comm fault-injection tests.
 *
 *   zt_commrun --rank R --world N --peers H:P,H:P,... [--op all_reduce|
 *              reduce_scatter|all_gather|rs_f32to64] [--sizes 1M,16M,64M]
 *              [--iters K] [--warmup W] [--timeout-ms T] [--ring-only]
 *
 * Rank R listens on the port given for it in --peers, joins the ring, and
 * runs each size K times after W warm-up runs. Rank 0 prints one JSON line
 * per size: {"op":..,"world":N,"bytes":..,"avg_ms":..,"algbw_GBps":..,
 * "busbw_GBps":..}; bus bandwidth follows the NCCL convention (all-reduce
 * moves 2(N-1)/N of the buffer per rank, the others (N-1)/N). rs_f32to64
 * is ZeRO's gradient reduction (zt_comm_reduce_scatter_f32to64: fp32 in,
 * fp64 sums out; sizes are of the fp32 input), made on the mesh from 3
 * ranks on unless --ring-only; its line also has "mb_sent", the MiB rank
 * 0 sent per call. After the
 * first completed operation every rank prints "running" on stderr. A failed
 * operation prints "comm error after X ms: ..." and exits with status 3.
 * The ranks prove the ring key $ZT_COMM_KEY to each other, or a fixed one
 * when it is unset (a benchmark's ranks are its own processes).
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "zt_common.h"
#include "zt_net.h"

static size_t parse_size(const char *s) {
  char *end;
  double v = strtod(s, &end);
  if (*end == 'K' || *end == 'k') v *= 1024;
  else if (*end == 'M' || *end == 'm') v *= 1024 * 1024;
  else if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024;
  return (size_t)v;
}

int main(int argc, char **argv) {
  int rank = -1, world = 0, iters = 10, warmup = 2, ring_only = 0;
  int64_t timeout_ms = ZT_COMM_TIMEOUT_MS_DEFAULT;
  const char *peers_s = NULL, *op = "all_reduce", *sizes_s = "1M,16M,64M";
  static const struct option opts[] = {
      {"rank", required_argument, 0, 'r'},  {"world", required_argument, 0, 'w'},
      {"peers", required_argument, 0, 'p'}, {"op", required_argument, 0, 'o'},
      {"sizes", required_argument, 0, 's'}, {"iters", required_argument, 0, 'i'},
      {"warmup", required_argument, 0, 'W'}, {"timeout-ms", required_argument, 0, 't'},
      {"ring-only", no_argument, 0, 'R'},   {0, 0, 0, 0}};
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (ch) {
    case 'r': rank = atoi(optarg); break;
    case 'w': world = atoi(optarg); break;
    case 'p': peers_s = optarg; break;
    case 'o': op = optarg; break;
    case 's': sizes_s = optarg; break;
    case 'i': iters = atoi(optarg); break;
    case 'W': warmup = atoi(optarg); break;
    case 't': timeout_ms = atoll(optarg); break;
    case 'R': ring_only = 1; break;
    default: return 2;
    }
  }
  char prefix[32];
  snprintf(prefix, sizeof prefix, "commrun[%d]", rank);
  zt_log_set_prefix(prefix);
  if (!peers_s || world < 1 || rank < 0 || rank >= world) {
    fprintf(stderr, "usage: zt_commrun --rank R --world N --peers H:P,...\n");
    return 2;
  }
  char *pc = strdup(peers_s), *save = NULL;
  const char **peers = calloc((size_t)world, sizeof *peers);
  int np = 0;
  for (char *t = strtok_r(pc, ",", &save); t && np < world; t = strtok_r(NULL, ",", &save))
    peers[np++] = t;
  if (np != world) {
    fprintf(stderr, "--peers needs %d addresses\n", world);
    return 2;
  }
  char host[64];
  int port;
  if (zt_net_parse_hostport(peers[rank], host, sizeof host, &port) != 0) return 2;
  int lfd;
  if (zt_comm_tcp_listen(host, &port, &lfd) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 1;
  }
  zt_comm_tcp_opts_t o = {.rank = rank, .world = world, .peers = peers, .listen_fd = lfd,
                        .session = 0xbe7c, .connect_timeout_ms = timeout_ms,
                        .key = getenv("ZT_COMM_KEY") ? getenv("ZT_COMM_KEY")
                                                     : "zt_commrun: the benchmark's own ring key",
                        .ring_only = ring_only};
  zt_comm_t *c;
  if (zt_comm_tcp_create(&o, &c) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 1;
  }
  int kind = !strcmp(op, "all_reduce")       ? 0
             : !strcmp(op, "reduce_scatter") ? 1
             : !strcmp(op, "all_gather")     ? 2
             : !strcmp(op, "rs_f32to64")     ? 3
                                             : -1;
  if (kind < 0) {
    fprintf(stderr, "unknown --op %s\n", op);
    zt_comm_destroy(c);
    return 2;
  }
  int announced = 0, ret = 0;
  char *sc = strdup(sizes_s);
  for (char *t = strtok_r(sc, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    size_t bytes = parse_size(t), n = bytes / 4, per = n / (size_t)world;
    float *buf = calloc(n ? n : 1, 4), *out = calloc(n ? n : 1, 8);
    zt_comm_stats_t s0, s1;
    zt_comm_stats_get(c, &s0);
    for (size_t i = 0; i < n; i++) buf[i] = (float)(i % 7);
    double total = 0;
    for (int it = 0; it < warmup + iters; it++) {
      int64_t t0 = zt_now_us();
      int rc = kind == 0   ? zt_comm_all_reduce(c, buf, n, ZT_DT_F32, ZT_RED_SUM, timeout_ms)
               : kind == 1 ? zt_comm_reduce_scatter(c, buf, out, per, ZT_DT_F32, ZT_RED_SUM,
                                                    timeout_ms)
               : kind == 2 ? zt_comm_all_gather(c, buf, out, per, ZT_DT_F32, timeout_ms)
                           : zt_comm_reduce_scatter_f32to64(c, buf, per, (double *)out, per,
                                                            timeout_ms);
      int64_t dt = zt_now_us() - t0;
      if (rc != 0) {
        fprintf(stderr, "comm error after %lld ms: %s\n", (long long)(dt / 1000), zt_err_msg());
        free(buf);
        free(out);
        ret = 3;
        goto done;
      }
      if (!announced++) fprintf(stderr, "running\n");
      if (it >= warmup) total += (double)dt / 1e6;
    }
    double avg = total / iters, algbw = (double)bytes / avg / 1e9;
    double factor = kind == 0 ? 2.0 * (world - 1) / world : (double)(world - 1) / world;
    zt_comm_stats_get(c, &s1);
    if (rank == 0)
      printf("{\"op\":\"%s\",\"world\":%d,\"bytes\":%zu,\"avg_ms\":%.3f,\"algbw_GBps\":%.3f,"
             "\"busbw_GBps\":%.3f,\"mb_sent\":%.3f}\n",
             op, world, bytes, avg * 1e3, algbw, algbw * factor,
             (double)(s1.bytes_sent - s0.bytes_sent) / (warmup + iters) / (1 << 20));
    fflush(stdout);
    free(buf);
    free(out);
  }
done:
  zt_comm_destroy(c);
  free(sc);
  free(pc);
  free(peers);
  return ret;
}
