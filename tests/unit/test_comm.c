/*
 * test_comm.c: the TCP ring collectives against a sequential reference.
 *
 * Each test runs N ranks as threads of this process over real loopback TCP
 * sockets (one communicator per thread, exactly as separate processes would
 * use them). Inputs are small integers, so every sum is exact in fp32 and in
 * bf16 and results can be compared for equality whatever the reduction
 * order. Sizes: 0, 1, odd, not divisible by N, and 64 MiB.
 */
#include <errno.h>
#include <poll.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm.h"
#include "zt_common.h"
#include "zt_test.h"

#define MAXR 5
/* The ring key every test rank holds (comm.h: at least 32 characters). */
#define TEST_KEY "0123456789abcdef0123456789abcdef"

typedef enum {
  OP_ALLREDUCE,
  OP_REDUCE_SCATTER,
  OP_ALLGATHER,
  OP_BROADCAST,
  OP_RS_F32TO64,
  OP_ALL_TO_ALL
} op_kind;

/* OP_RS_F32TO64's input: segment i at i * (count + PAD32), the PAD32
 * elements between segments NaN (a read of them would show in the sums). */
#define PAD32 3

typedef struct {
  int rank, world;
  char peers[MAXR][64];
  const char *peerp[MAXR];
  int lfd;
  op_kind op;
  zt_dtype_t dt;
  zt_redop_t red;
  size_t count;
  int root;
  void *buf, *out;
  int rc;
  char err[512];
  zt_comm_t *comm; /* kept open when keep is set */
  int keep;
  uint64_t sent; /* bytes this rank sent */
} rank_ctx;

/* Inputs: small integers (exact sums), or, with g_inexact, values of mixed
 * magnitude whose fp32 sums round, so a result depends on the order of
 * the additions. */
static int g_inexact;
/* Communicators connect the ring alone, no mesh (comm.h: ring_only). */
static int g_ring_only;

static float inexact_val(int rank, size_t i) {
  static const float scale[8] = {1e-3f, 0.37f, 1.0f, 3.1f, 17.0f, 1e3f, 0.011f, 250.0f};
  uint64_t h = ((uint64_t)i * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)(rank + 1) * 0xbf58476d1ce4e5b9ull);
  h ^= h >> 31;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 29;
  float v = (float)(h & 0xfffff) * scale[(h >> 20) & 7];
  return (h >> 23) & 1 ? -v : v;
}

static float val(int rank, size_t i) {
  if (g_inexact) return inexact_val(rank, i);
  return (float)((rank + 1) * (int)(i % 13) - 6);
}

/* fp64 inputs that fp32 cannot hold, with g_val64 set (the fp64 AVG
 * test): 1.0 at even indices, 0.1 * rank plus the index at odd ones. */
static int g_val64;

static double val64(int rank, size_t i) { return i % 2 == 0 ? 1.0 : 0.1 * rank + (double)i; }

static void fill(void *buf, size_t n, zt_dtype_t dt, int rank) {
  for (size_t i = 0; i < n; i++) {
    if (dt == ZT_DT_F64 && g_val64) ((double *)buf)[i] = val64(rank, i);
    else if (dt == ZT_DT_F32) ((float *)buf)[i] = val(rank, i);
    else if (dt == ZT_DT_F64) ((double *)buf)[i] = val(rank, i); /* widened fp32 */
    else ((uint16_t *)buf)[i] = zt_f32_to_bf16(val(rank, i));
  }
}

static float get(const void *buf, size_t i, zt_dtype_t dt) {
  return dt == ZT_DT_F32 ? ((const float *)buf)[i] : zt_bf16_to_f32(((const uint16_t *)buf)[i]);
}

static void *rank_main(void *p) {
  rank_ctx *r = p;
  zt_comm_tcp_opts_t o = {.rank = r->rank, .world = r->world, .peers = r->peerp,
                        .listen_fd = r->lfd, .session = 77, .key = TEST_KEY,
                        .connect_timeout_ms = 20000,
                        .chunk_bytes = 64 << 10, .ring_only = g_ring_only};
  zt_comm_t *c;
  r->rc = zt_comm_tcp_create(&o, &c);
  if (r->rc != 0) goto out;
  int64_t to = 60000;
  switch (r->op) {
  case OP_ALLREDUCE: r->rc = zt_comm_all_reduce(c, r->buf, r->count, r->dt, r->red, to); break;
  case OP_REDUCE_SCATTER:
    r->rc = zt_comm_reduce_scatter(c, r->buf, r->out, r->count, r->dt, r->red, to);
    break;
  case OP_ALLGATHER: r->rc = zt_comm_all_gather(c, r->buf, r->out, r->count, r->dt, to); break;
  case OP_BROADCAST: r->rc = zt_comm_broadcast(c, r->buf, r->count, r->dt, r->root, to); break;
  case OP_RS_F32TO64:
    r->rc = zt_comm_reduce_scatter_f32to64(c, r->buf, r->count + PAD32, r->out, r->count, to);
    break;
  case OP_ALL_TO_ALL: r->rc = zt_comm_all_to_all(c, r->buf, r->out, r->count, to); break;
  }
  zt_comm_stats_t st;
  zt_comm_stats_get(c, &st);
  r->sent = st.bytes_sent;
  /* A collective on the ring right after: a call that left bytes of its
   * own behind on the ring's sockets fails it (test_mesh_back_to_back
   * checks the mesh's other sockets). */
  if (r->rc == 0 && !r->keep) r->rc = zt_comm_barrier(c, to);
  if (r->keep) {
    r->comm = c;
    return NULL;
  }
  zt_comm_destroy(c);
out:
  if (r->rc != 0) snprintf(r->err, sizeof r->err, "%s", zt_err_msg());
  return NULL;
}

/* Runs one collective on `world` threads; returns the contexts (caller
 * frees buffers). */
static rank_ctx *run(int world, op_kind op, zt_dtype_t dt, zt_redop_t red, size_t count, int root) {
  static rank_ctx ctx[MAXR];
  memset(ctx, 0, sizeof ctx);
  char ports[MAXR][32];
  int lfds[MAXR];
  for (int r = 0; r < world; r++) {
    int port = 0;
    if (zt_comm_tcp_listen("127.0.0.1", &port, &lfds[r]) != 0) abort();
    snprintf(ports[r], sizeof ports[r], "127.0.0.1:%d", port);
  }
  size_t esz = zt_dtype_size(dt);
  pthread_t th[MAXR];
  for (int r = 0; r < world; r++) {
    rank_ctx *x = &ctx[r];
    x->rank = r, x->world = world, x->op = op, x->dt = dt, x->red = red, x->count = count;
    x->root = root, x->lfd = lfds[r];
    for (int k = 0; k < world; k++) {
      snprintf(x->peers[k], sizeof x->peers[k], "%.40s", ports[k]);
      x->peerp[k] = x->peers[k];
    }
    if (op == OP_RS_F32TO64) {
      size_t stride = count + PAD32;
      float *b = malloc(stride * (size_t)world * sizeof(float));
      for (int i = 0; i < world; i++)
        for (size_t j = 0; j < stride; j++)
          b[(size_t)i * stride + j] = j < count ? val(r, (size_t)i * count + j) : NAN;
      x->buf = b;
      x->out = malloc(count * sizeof(double) + 1);
      pthread_create(&th[r], NULL, rank_main, x);
      continue;
    }
    if (op == OP_ALL_TO_ALL) { /* count bytes from every rank to every rank */
      uint8_t *b = malloc((size_t)world * count + 1);
      for (size_t i = 0; i < (size_t)world * count; i++)
        b[i] = (uint8_t)(r * 31 + (int)(i / (count ? count : 1)) * 7 + (int)(i % 251));
      x->buf = b;
      x->out = malloc((size_t)world * count + 1);
      pthread_create(&th[r], NULL, rank_main, x);
      continue;
    }
    int rs = op == OP_REDUCE_SCATTER;
    size_t in = rs ? count * (size_t)world : count;
    size_t outn = rs ? count : op == OP_ALLGATHER ? count * (size_t)world : 0;
    x->buf = malloc(in * esz + 1);
    x->out = outn ? malloc(outn * esz) : NULL;
    fill(x->buf, in, dt, r);
    pthread_create(&th[r], NULL, rank_main, x);
  }
  for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
  return ctx;
}

static void free_ctx(rank_ctx *ctx, int world) {
  for (int r = 0; r < world; r++) {
    free(ctx[r].buf);
    free(ctx[r].out);
  }
}

static float ref_sum(int world, size_t i, zt_redop_t red) {
  float s = 0;
  for (int r = 0; r < world; r++) s += val(r, i);
  return red == ZT_RED_AVG ? s / (float)world : s;
}

static const size_t k_sizes[] = {0, 1, 7, 1001, 12345};

static int all_ok(rank_ctx *ctx, int world) {
  int ok = 1;
  for (int r = 0; r < world; r++)
    if (ctx[r].rc != 0) {
      fprintf(stderr, "rank %d: %s\n", r, ctx[r].err);
      ok = 0;
    }
  return ok;
}

ZT_TEST(test_all_reduce) {
  for (int world = 1; world <= MAXR; world++)
    for (size_t si = 0; si < ZT_ARRAY_LEN(k_sizes); si++)
      for (int dt = 0; dt < 2; dt++) {
        size_t n = k_sizes[si];
        rank_ctx *ctx = run(world, OP_ALLREDUCE, (zt_dtype_t)dt, ZT_RED_SUM, n, 0);
        ZT_CHECK(all_ok(ctx, world));
        size_t bad = 0;
        for (int r = 0; r < world; r++)
          for (size_t i = 0; i < n; i++)
            if (get(ctx[r].buf, i, (zt_dtype_t)dt) != ref_sum(world, i, ZT_RED_SUM)) bad++;
        if (bad) fprintf(stderr, "world %d n %zu dt %d: %zu wrong\n", world, n, dt, bad);
        ZT_CHECK(bad == 0);
        free_ctx(ctx, world);
      }
}

ZT_TEST(test_all_reduce_avg) {
  for (int world = 1; world <= MAXR; world++) {
    size_t n = 1001;
    rank_ctx *ctx = run(world, OP_ALLREDUCE, ZT_DT_F32, ZT_RED_AVG, n, 0);
    ZT_CHECK(all_ok(ctx, world));
    for (int r = 0; r < world; r++)
      for (size_t i = 0; i < n; i++)
        ZT_CHECK_NEAR(get(ctx[r].buf, i, ZT_DT_F32), ref_sum(world, i, ZT_RED_AVG), 1e-6);
    free_ctx(ctx, world);
  }
}

/* fp64 AVG is the fp64 sum divided by the world size (comm.h), to the
 * bit: the SUM of the same inputs (the same additions in the same order)
 * divided by 3.0, and 1.0 where every rank holds 1.0. A scale by the
 * fp32 reciprocal of 3 would give 1.0000000298 there. All-reduce and
 * reduce-scatter, on 3 ranks. */
ZT_TEST(test_avg_fp64_divides_by_world) {
  const int world = 3;
  const size_t n = 1001;
  g_val64 = 1;
  for (int rs = 0; rs < 2; rs++) {
    op_kind op = rs ? OP_REDUCE_SCATTER : OP_ALLREDUCE;
    double *sum[3], *avg[3];
    for (int red = 0; red < 2; red++) {
      rank_ctx *ctx = run(world, op, ZT_DT_F64, red ? ZT_RED_AVG : ZT_RED_SUM, n, 0);
      ZT_CHECK(all_ok(ctx, world));
      for (int r = 0; r < world; r++) {
        double **keep = red ? &avg[r] : &sum[r];
        *keep = rs ? ctx[r].out : ctx[r].buf;
        if (rs) ctx[r].out = NULL;
        else ctx[r].buf = NULL;
      }
      free_ctx(ctx, world);
    }
    size_t bad = 0, evens = 0, ones = 0;
    for (int r = 0; r < world; r++)
      for (size_t i = 0; i < n; i++) {
        double want = sum[r][i] / 3.0;
        if (memcmp(&avg[r][i], &want, sizeof want) != 0) {
          if (bad++ < 3)
            fprintf(stderr, "%s rank %d [%zu]: %.17g, want %.17g\n", rs ? "reduce-scatter" : "all-reduce",
                    r, i, avg[r][i], want);
        }
        /* Element i of rank r's reduce-scatter output is element r*n+i. */
        if ((rs ? (size_t)r * n + i : i) % 2 == 0) evens++, ones += avg[r][i] == 1.0;
      }
    ZT_CHECK(bad == 0);
    ZT_CHECK(evens > 0 && ones == evens);
    for (int r = 0; r < world; r++) free(sum[r]), free(avg[r]);
  }
  g_val64 = 0;
}

ZT_TEST(test_reduce_scatter_layout) {
  for (int world = 1; world <= MAXR; world++)
    for (size_t si = 0; si < ZT_ARRAY_LEN(k_sizes); si++) {
      size_t n = k_sizes[si];
      rank_ctx *ctx = run(world, OP_REDUCE_SCATTER, ZT_DT_F32, ZT_RED_SUM, n, 0);
      ZT_CHECK(all_ok(ctx, world));
      size_t bad = 0;
      for (int r = 0; r < world; r++)
        for (size_t i = 0; i < n; i++)
          if (get(ctx[r].out, i, ZT_DT_F32) != ref_sum(world, (size_t)r * n + i, ZT_RED_SUM)) bad++;
      ZT_CHECK(bad == 0);
      free_ctx(ctx, world);
    }
}

/* Runs a reduce-scatter of n elements per rank on `world` ranks and
 * collects each rank's sums and bytes sent; 0 if a rank failed. */
static int rs_collect(int world, op_kind op, zt_dtype_t dt, size_t n, double **out,
                      uint64_t *sent) {
  rank_ctx *ctx = run(world, op, dt, ZT_RED_SUM, n, 0);
  int ok = all_ok(ctx, world);
  for (int r = 0; r < world; r++) out[r] = ctx[r].out, ctx[r].out = NULL, sent[r] = ctx[r].sent;
  free_ctx(ctx, world);
  return ok;
}

/* The reduce-scatter of fp32 values into fp64 sums, against the fp64
 * reduce-scatter of the widened values (inputs of mixed magnitude, whose
 * sums need more than fp32's bits, so a value rounded on the way would
 * show, as would a change in the order of the additions):
 * zt_comm_reduce_scatter_f32to64, from strided fp32 segments that it
 * leaves as they were, gives the same sums to the bit, on the ring and on
 * the mesh. The ring sends its first step as fp32, so at 2 ranks half the
 * bytes go out, at N ranks (2N-3)/(2N-2) of them; the mesh sends only
 * fp32, half the bytes at every N. */
ZT_TEST(test_reduce_scatter_fp32_into_fp64) {
  static const size_t sizes[] = {0, 1, 7, 12345, 300001};
  g_inexact = 1;
  for (int ring = 0; ring < 2; ring++)
  for (int world = 1; world <= MAXR; world++)
    for (size_t si = 0; si < ZT_ARRAY_LEN(sizes); si++) {
      size_t n = sizes[si];
      double *ref[MAXR];
      uint64_t ref_sent[MAXR];
      ZT_CHECK(rs_collect(world, OP_REDUCE_SCATTER, ZT_DT_F64, n, ref, ref_sent));
      g_ring_only = ring;
      rank_ctx *ctx = run(world, OP_RS_F32TO64, ZT_DT_F32, ZT_RED_SUM, n, 0);
      g_ring_only = 0;
      ZT_CHECK(all_ok(ctx, world));
      size_t stride = n + PAD32, changed = 0;
      /* sent / ref_sent should be num / den */
      uint64_t num = ring ? (uint64_t)(2 * world - 3) : 1, den = ring ? (uint64_t)(2 * world - 2) : 2;
      for (int r = 0; r < world; r++) {
        ZT_CHECK(n == 0 || memcmp(ctx[r].out, ref[r], n * sizeof(double)) == 0);
        if (world > 1 && n > 1000) /* segment sizes differ by at most 1 element */
          ZT_CHECK(llabs((long long)(ctx[r].sent * den) - (long long)(ref_sent[r] * num)) <=
                   (long long)(16 * world * world));
        const float *b = ctx[r].buf;
        for (int i = 0; i < world; i++)
          for (size_t j = 0; j < n; j++)
            if (b[(size_t)i * stride + j] != val(r, (size_t)i * n + j)) changed++;
        free(ref[r]);
      }
      ZT_CHECK(changed == 0);
      free_ctx(ctx, world);
    }
  g_inexact = 0;
}

ZT_TEST(test_all_gather_layout) {
  for (g_ring_only = 0; g_ring_only < 2; g_ring_only++) /* the mesh from 3 ranks on, the ring */
  for (int world = 1; world <= MAXR; world++)
    for (size_t si = 0; si < ZT_ARRAY_LEN(k_sizes); si++)
      for (int dt = 0; dt < 2; dt++) {
        size_t n = k_sizes[si];
        rank_ctx *ctx = run(world, OP_ALLGATHER, (zt_dtype_t)dt, ZT_RED_SUM, n, 0);
        ZT_CHECK(all_ok(ctx, world));
        size_t bad = 0;
        for (int r = 0; r < world; r++)
          for (int src = 0; src < world; src++)
            for (size_t i = 0; i < n; i++)
              if (get(ctx[r].out, (size_t)src * n + i, (zt_dtype_t)dt) != val(src, i)) bad++;
        ZT_CHECK(bad == 0);
        free_ctx(ctx, world);
      }
  g_ring_only = 0;
}

/* Every pair's bytes arrive where they belong: on the mesh, between two
 * ranks, and on a ring of 3 or more (an all-gather underneath); an odd
 * size is refused. */
ZT_TEST(test_all_to_all) {
  static const size_t sizes[] = {0, 2, 5002};
  for (g_ring_only = 0; g_ring_only < 2; g_ring_only++)
    for (int world = 1; world <= MAXR; world++)
      for (size_t si = 0; si < ZT_ARRAY_LEN(sizes); si++) {
        size_t n = sizes[si];
        rank_ctx *ctx = run(world, OP_ALL_TO_ALL, ZT_DT_F32, ZT_RED_SUM, n, 0);
        ZT_CHECK(all_ok(ctx, world));
        size_t bad = 0;
        for (int r = 0; r < world; r++)
          for (int src = 0; src < world; src++)
            for (size_t i = 0; i < n; i++) {
              size_t at = (size_t)r * n + i; /* src's byte i for rank r */
              uint8_t want = (uint8_t)(src * 31 + (int)(at / n) * 7 + (int)(at % 251));
              if (((uint8_t *)ctx[r].out)[(size_t)src * n + i] != want) bad++;
            }
        ZT_CHECK(bad == 0);
        free_ctx(ctx, world);
      }
  g_ring_only = 0;
  rank_ctx *ctx = run(2, OP_ALL_TO_ALL, ZT_DT_F32, ZT_RED_SUM, 3, 0);
  for (int r = 0; r < 2; r++) ZT_CHECK(ctx[r].rc != 0 && strstr(ctx[r].err, "whole number"));
  free_ctx(ctx, 2);
}

ZT_TEST(test_broadcast) {
  for (int world = 1; world <= MAXR; world++)
    for (int root = 0; root < world; root++) {
      size_t n = 100003;
      rank_ctx *ctx = run(world, OP_BROADCAST, ZT_DT_F32, ZT_RED_SUM, n, root);
      ZT_CHECK(all_ok(ctx, world));
      size_t bad = 0;
      for (int r = 0; r < world; r++)
        for (size_t i = 0; i < n; i++)
          if (get(ctx[r].buf, i, ZT_DT_F32) != val(root, i)) bad++;
      ZT_CHECK(bad == 0);
      free_ctx(ctx, world);
    }
}

ZT_TEST(test_large_64mib) {
  size_t n = (64u << 20) / 4;
  for (int world = 2; world <= MAXR; world += 2) {
    rank_ctx *ctx = run(world, OP_ALLREDUCE, ZT_DT_F32, ZT_RED_SUM, n, 0);
    ZT_CHECK(all_ok(ctx, world));
    size_t bad = 0;
    for (int r = 0; r < world; r++)
      for (size_t i = 0; i < n; i++)
        if (((float *)ctx[r].buf)[i] != ref_sum(world, i, ZT_RED_SUM)) bad++;
    ZT_CHECK(bad == 0);
    free_ctx(ctx, world);
  }
}

/* The ring's order of summation, bit for bit: segment j (the layout of
 * comm.h: the first count % world segments one element longer) is summed
 * starting at rank j+1, each rank adding its own value to the partial sum
 * it received, and ending at rank j; every rank then holds the same bits.
 * Inputs that round make any other order show. 4 MiB buffers, 64 KiB
 * chunks: many partial sends and receives per step. */
ZT_TEST(test_all_reduce_sum_order) {
  g_inexact = 1;
  size_t n = (1u << 20) + 3;
  for (int world = 2; world <= MAXR; world++)
    for (int dt = 0; dt < 2; dt++) {
      rank_ctx *ctx = run(world, OP_ALLREDUCE, (zt_dtype_t)dt, ZT_RED_SUM, n, 0);
      ZT_CHECK(all_ok(ctx, world));
      size_t base = n / (size_t)world, extra = n % (size_t)world, bad = 0, rounded = 0;
      for (int j = 0; j < world; j++) {
        size_t off = (size_t)j * base + ZT_MIN((size_t)j, extra), len = base + ((size_t)j < extra);
        for (size_t i = off; i < off + len; i++) {
          float acc = val((j + 1) % world, i), exact = acc;
          if (dt == ZT_DT_BF16) acc = zt_bf16_to_f32(zt_f32_to_bf16(acc));
          for (int t = 2; t <= world; t++) {
            float x = val((j + t) % world, i);
            exact += x;
            if (dt == ZT_DT_F32) acc += x;
            else acc = zt_bf16_to_f32(zt_f32_to_bf16(acc + zt_bf16_to_f32(zt_f32_to_bf16(x))));
          }
          if (dt == ZT_DT_F32) {
            /* Summing in another order would give other bits somewhere. */
            float other = 0;
            for (int r = 0; r < world; r++) other += val(r, i);
            rounded += memcmp(&other, &exact, sizeof other) != 0;
          }
          for (int r = 0; r < world; r++) {
            float got = get(ctx[r].buf, i, (zt_dtype_t)dt);
            if (memcmp(&got, &acc, sizeof got) != 0) bad++;
          }
        }
      }
      if (bad) fprintf(stderr, "sum order: world %d dt %d: %zu elements differ\n", world, dt, bad);
      ZT_CHECK(bad == 0);
      if (dt == ZT_DT_F32 && world > 2) ZT_CHECK(rounded > 0);
      free_ctx(ctx, world);
    }
  g_inexact = 0;
}

/* Sets up rank 0 of 2 on loopback, with rank 1 at port1, and a 300 ms
 * deadline; the milliseconds set-up took, or -1 if it succeeded. */
static int64_t rank0_setup_ms(int port1) {
  int lfd, port = 0;
  if (zt_comm_tcp_listen("127.0.0.1", &port, &lfd) != 0) return -1;
  char p0[32], p1[32];
  snprintf(p0, sizeof p0, "127.0.0.1:%d", port);
  snprintf(p1, sizeof p1, "127.0.0.1:%d", port1);
  const char *peers[2] = {p0, p1};
  zt_comm_tcp_opts_t o = {.rank = 0, .world = 2, .peers = peers, .listen_fd = lfd, .session = 1,
                          .key = TEST_KEY, .connect_timeout_ms = 300};
  zt_comm_t *c;
  int64_t t0 = zt_now_ms();
  if (zt_comm_tcp_create(&o, &c) == 0) {
    zt_comm_destroy(c);
    return -1;
  }
  return zt_now_ms() - t0;
}

/* A rank that never shows up: set-up fails within its timeout. */
ZT_TEST(test_connect_timeout) {
  int lfd2, port2 = 0;
  ZT_REQUIRE(zt_comm_tcp_listen("127.0.0.1", &port2, &lfd2) == 0);
  int64_t el = rank0_setup_ms(port2);
  ZT_CHECK(el >= 250 && el < 5000);
  ZT_CHECK(strstr(zt_err_msg(), "rank 1") != NULL);
  close(lfd2);
}

/* A peer whose host drops the connection attempts (here: a listening
 * socket whose accept queue is full, so the kernel drops further SYNs, as
 * a firewall or a vanished host would): set-up ends at its 300 ms
 * deadline, naming the rank, instead of waiting out the kernel's SYN
 * retries (about two minutes for a blocking connect()). */
ZT_TEST(test_connect_to_silent_host_times_out) {
  int full = socket(AF_INET, SOCK_STREAM, 0), port2;
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  ZT_REQUIRE(full >= 0 && bind(full, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(full, 0) == 0);
  socklen_t sl = sizeof sa;
  getsockname(full, (struct sockaddr *)&sa, &sl);
  port2 = ntohs(sa.sin_port);
  /* Fill the accept queue: connections the kernel completes but nobody
   * accepts. Those past the queue stay pending; stop at the first. */
  int fillers[4], nf = 0;
  for (; nf < 4; nf++) {
    fillers[nf] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (connect(fillers[nf], (struct sockaddr *)&sa, sizeof sa) != 0 && errno == EINPROGRESS) {
      struct pollfd p = {.fd = fillers[nf], .events = POLLOUT};
      if (poll(&p, 1, 200) == 0) { /* not completed: the queue is full */
        nf++;
        break;
      }
    }
  }
  int64_t el = rank0_setup_ms(port2);
  fprintf(stderr, "set-up failed after %lld ms: %s\n", (long long)el, zt_err_msg());
  ZT_CHECK(el >= 250 && el < 3000);
  ZT_CHECK(strstr(zt_err_msg(), "cannot connect to rank 1") != NULL);
  for (int i = 0; i < nf; i++) close(fillers[i]);
  close(full);
}

/* A silent peer (connected, never sends) makes the op time out; abort from
 * another thread ends a wait at once; the comm stays broken afterwards. */
typedef struct {
  zt_comm_t *c;
  int64_t delay_ms;
} aborter;

static void *abort_later(void *p) {
  aborter *a = p;
  zt_sleep_ms(a->delay_ms); /* the test's stimulus timing, not synchronisation */
  zt_comm_abort(a->c);
  return NULL;
}

/* Sets up `world` ranks whose communicators stay open (keep[r].comm). */
static void open_ranks(rank_ctx *keep, int world) {
  memset(keep, 0, (size_t)world * sizeof *keep);
  char ports[MAXR][32];
  int lfds[MAXR];
  for (int r = 0; r < world; r++) {
    int port = 0;
    ZT_REQUIRE(zt_comm_tcp_listen("127.0.0.1", &port, &lfds[r]) == 0);
    snprintf(ports[r], sizeof ports[r], "127.0.0.1:%d", port);
  }
  pthread_t th[MAXR];
  for (int r = 0; r < world; r++) {
    keep[r].rank = r, keep[r].world = world, keep[r].op = OP_BROADCAST, keep[r].lfd = lfds[r];
    keep[r].keep = 1, keep[r].count = 0;
    for (int k = 0; k < world; k++) {
      snprintf(keep[r].peers[k], sizeof keep[r].peers[k], "%.40s", ports[k]);
      keep[r].peerp[k] = keep[r].peers[k];
    }
    keep[r].buf = malloc(4);
    pthread_create(&th[r], NULL, rank_main, &keep[r]);
  }
  for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
}

static void open_pair(rank_ctx keep[2]) { open_ranks(keep, 2); }

static void close_ranks(rank_ctx *keep, int world) {
  for (int r = 0; r < world; r++) {
    zt_comm_destroy(keep[r].comm);
    free(keep[r].buf);
  }
}

static void close_pair(rank_ctx keep[2]) { close_ranks(keep, 2); }

ZT_TEST(test_silent_peer_timeout_and_abort) {
  static rank_ctx keep[2];
  open_pair(keep);
  ZT_REQUIRE(keep[0].comm && keep[1].comm);
  /* Rank 1 stays silent: rank 0's all-reduce must time out near 200 ms. */
  float x[1000] = {0};
  int64_t t0 = zt_now_ms();
  ZT_CHECK(zt_comm_all_reduce(keep[0].comm, x, 1000, ZT_DT_F32, ZT_RED_SUM, 200) != 0);
  int64_t el = zt_now_ms() - t0;
  ZT_CHECK(el >= 190 && el < 2000);
  ZT_CHECK(strstr(zt_err_msg(), "timed out") != NULL);
  ZT_CHECK(zt_comm_broken(keep[0].comm));
  ZT_CHECK(zt_comm_all_reduce(keep[0].comm, x, 10, ZT_DT_F32, ZT_RED_SUM, 200) != 0);
  ZT_CHECK(strstr(zt_err_msg(), "unusable") != NULL);
  /* Rank 1, with no deadline, is ended by an abort from another thread. */
  aborter a = {keep[1].comm, 100};
  pthread_t th;
  pthread_create(&th, NULL, abort_later, &a);
  t0 = zt_now_ms();
  float y[1000] = {0};
  ZT_CHECK(zt_comm_all_reduce(keep[1].comm, y, 1000, ZT_DT_F32, ZT_RED_SUM, 0) != 0);
  el = zt_now_ms() - t0;
  pthread_join(th, NULL);
  ZT_CHECK(el < 3000);
  ZT_CHECK(strstr(zt_err_msg(), "abort") != NULL || strstr(zt_err_msg(), "closed") != NULL);
  close_pair(keep);
}

/* One rank's call in test_calls_must_agree. */
typedef struct {
  zt_comm_t *c;
  op_kind op;
  zt_dtype_t dt;
  size_t count;
  void *buf, *out;
  int64_t timeout_ms; /* 0: 5000 */
  int rc;
  char err[512];
} call_ctx;

static void *call_main(void *p) {
  call_ctx *x = p;
  int64_t to = x->timeout_ms ? x->timeout_ms : 5000;
  switch (x->op) {
  case OP_ALLREDUCE:
    x->rc = zt_comm_all_reduce(x->c, x->buf, x->count, x->dt, ZT_RED_SUM, to);
    break;
  case OP_ALLGATHER: x->rc = zt_comm_all_gather(x->c, x->buf, x->out, x->count, x->dt, to); break;
  case OP_REDUCE_SCATTER:
    x->rc = zt_comm_reduce_scatter(x->c, x->buf, x->out, x->count, x->dt, ZT_RED_SUM, to);
    break;
  case OP_RS_F32TO64:
    x->rc = zt_comm_reduce_scatter_f32to64(x->c, x->buf, x->count, x->out, x->count, to);
    break;
  default: x->rc = -1;
  }
  if (x->rc != 0) snprintf(x->err, sizeof x->err, "%s", zt_err_msg());
  return NULL;
}

/* Runs call a on rank 0 and call b on rank 1 of a fresh pair. */
static void call_pair(call_ctx *a, call_ctx *b) {
  static rank_ctx keep[2];
  open_pair(keep);
  ZT_REQUIRE(keep[0].comm && keep[1].comm);
  a->c = keep[0].comm, b->c = keep[1].comm;
  pthread_t t0, t1;
  pthread_create(&t0, NULL, call_main, a);
  pthread_create(&t1, NULL, call_main, b);
  pthread_join(t0, NULL);
  pthread_join(t1, NULL);
  close_pair(keep);
}

/* Ranks whose calls differ (the operation, the count) fail at once with a
 * message naming both calls, well before the 5 s deadline, instead of
 * reducing each other's bytes: also an fp64 reduce-scatter against the
 * fp32-into-fp64 one of the same count, whose first ring step carries
 * fp32 where the other's carries fp64. */
ZT_TEST(test_calls_must_agree) {
  static float fa[4000], fb[4000], oa[4000], ob[4000];
  call_ctx a = {.op = OP_ALLREDUCE, .dt = ZT_DT_F32, .count = 1000, .buf = fa};
  call_ctx b = {.op = OP_ALLGATHER, .dt = ZT_DT_F32, .count = 1000, .buf = fb, .out = ob};
  int64_t t0 = zt_now_ms();
  call_pair(&a, &b);
  ZT_CHECK(a.rc != 0 && b.rc != 0);
  ZT_CHECK(strstr(a.err, "calls differ") && strstr(a.err, "all-gather of 1000 fp32"));
  ZT_CHECK(strstr(b.err, "calls differ") && strstr(b.err, "all-reduce of 1000 fp32"));
  a = (call_ctx){.op = OP_REDUCE_SCATTER, .dt = ZT_DT_F32, .count = 1000, .buf = fa, .out = oa};
  b = (call_ctx){.op = OP_REDUCE_SCATTER, .dt = ZT_DT_F32, .count = 999, .buf = fb, .out = ob};
  call_pair(&a, &b);
  ZT_CHECK(a.rc != 0 && b.rc != 0);
  ZT_CHECK(strstr(a.err, "reduce-scatter of 999 fp32") != NULL);
  static double wa[2000], ra[1000], rb[1000];
  a = (call_ctx){.op = OP_REDUCE_SCATTER, .dt = ZT_DT_F64, .count = 1000, .buf = wa, .out = ra};
  b = (call_ctx){.op = OP_RS_F32TO64, .dt = ZT_DT_F32, .count = 1000, .buf = fb, .out = rb};
  call_pair(&a, &b);
  ZT_CHECK(a.rc != 0 && b.rc != 0);
  ZT_CHECK(strstr(a.err, "fp32-into-fp64 reduce-scatter of 1000 fp64") != NULL);
  ZT_CHECK(strstr(b.err, ", reduce-scatter of 1000 fp64 elements (arg 0); rank 1") != NULL);
  ZT_CHECK(zt_now_ms() - t0 < 4000);
}

/* Mesh reduce-scatters and all-gathers back to back, each followed by a
 * ring collective, with 8 MiB segments (more than the socket buffers hold,
 * so a rank can have received everything while its own sends are still
 * queued): every call must finish its sends before it returns, or the
 * bytes it left behind would reach the next call on the same socket. */
typedef struct {
  zt_comm_t *c;
  float *in;
  double *out, *all;
  size_t count;
  int rc, bad;
  char err[512];
} b2b_ctx;

static void *b2b_main(void *p) {
  b2b_ctx *x = p;
  int rank = zt_comm_rank(x->c), world = zt_comm_world(x->c);
  for (int it = 0; it < 3 && x->rc == 0; it++) {
    for (size_t i = 0; i < x->count * (size_t)world; i++) x->in[i] = val(rank, i + (size_t)it);
    x->rc = zt_comm_reduce_scatter_f32to64(x->c, x->in, x->count, x->out, x->count, 20000);
    if (x->rc == 0) x->rc = zt_comm_barrier(x->c, 20000);
    if (x->rc == 0) x->rc = zt_comm_all_gather(x->c, x->out, x->all, x->count, ZT_DT_F64, 20000);
    if (x->rc == 0) x->rc = zt_comm_barrier(x->c, 20000);
    for (size_t i = 0; x->rc == 0 && i < x->count * (size_t)world; i++) {
      double want = 0;
      for (int r = 0; r < world; r++) want += val(r, i + (size_t)it);
      x->bad += x->all[i] != want;
    }
  }
  if (x->rc != 0) snprintf(x->err, sizeof x->err, "%s", zt_err_msg());
  return NULL;
}

ZT_TEST(test_mesh_back_to_back) {
  static rank_ctx keep[4];
  static b2b_ctx x[4];
  size_t count = 2u << 20;
  open_ranks(keep, 4);
  pthread_t th[4];
  for (int r = 0; r < 4; r++) ZT_REQUIRE(keep[r].comm != NULL);
  for (int r = 0; r < 4; r++) {
    x[r] = (b2b_ctx){.c = keep[r].comm, .count = count};
    x[r].in = malloc(4 * count * sizeof(float));
    x[r].out = malloc(count * sizeof(double));
    x[r].all = malloc(4 * count * sizeof(double));
    pthread_create(&th[r], NULL, b2b_main, &x[r]);
  }
  for (int r = 0; r < 4; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < 4; r++) {
    if (x[r].rc != 0) fprintf(stderr, "rank %d: %s\n", r, x[r].err);
    ZT_CHECK(x[r].rc == 0 && x[r].bad == 0);
    free(x[r].in);
    free(x[r].out);
    free(x[r].all);
  }
  close_ranks(keep, 4);
}

/* Aborts keep[2]'s call (started by the thread in *p) after 20 ms, then
 * closes its communicator: a rank that vanishes mid-exchange. */
typedef struct {
  rank_ctx *keep;
  call_ctx *x;
} vanish_arg;

static void *call_then_vanish(void *p) {
  vanish_arg *v = p;
  pthread_t th;
  pthread_create(&th, NULL, call_main, v->x);
  zt_sleep_ms(20); /* the test's stimulus timing, not synchronisation */
  zt_comm_abort(v->keep[2].comm);
  pthread_join(th, NULL);
  zt_comm_destroy(v->keep[2].comm);
  v->keep[2].comm = NULL;
  return NULL;
}

/* A mesh reduce-scatter (3 ranks) whose third rank (a) never calls, (b)
 * has closed its communicator before the call, (c) vanishes in the middle
 * of the exchange (64 MiB segments). The two others fail, name rank 2 and
 * report it as the failed peer: (a) at the deadline, both at the
 * operation header, which goes to and comes from every rank on a mesh
 * (each waits for rank 2's, not rank 1 for rank 0's data); (b) and (c)
 * long before it. */
ZT_TEST(test_mesh_peer_silent_or_gone) {
  static rank_ctx keep[3];
  size_t big = 16u << 20;
  float *in[3];
  double *out[3];
  for (int r = 0; r < 3; r++) {
    in[r] = calloc(3 * big, sizeof(float));
    out[r] = malloc(big * sizeof(double));
  }
  for (int mode = 0; mode < 3; mode++) {
    open_ranks(keep, 3);
    ZT_REQUIRE(keep[0].comm && keep[1].comm && keep[2].comm);
    if (mode == 1) {
      zt_comm_destroy(keep[2].comm);
      keep[2].comm = NULL;
    }
    size_t count = mode == 2 ? big : 1000;
    call_ctx x[3];
    pthread_t th[3];
    vanish_arg v = {keep, &x[2]};
    int64_t t0 = zt_now_ms();
    for (int r = 0; r < 3; r++) {
      x[r] = (call_ctx){.c = keep[r].comm, .op = OP_RS_F32TO64, .count = count, .buf = in[r],
                        .out = out[r], .timeout_ms = mode == 0 ? 300 : 5000};
      if (r < 2) pthread_create(&th[r], NULL, call_main, &x[r]);
    }
    if (mode == 2) pthread_create(&th[2], NULL, call_then_vanish, &v);
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    if (mode == 2) pthread_join(th[2], NULL);
    int64_t el = zt_now_ms() - t0;
    for (int r = 0; r < 2; r++) {
      ZT_CHECK(x[r].rc != 0);
      if (!strstr(x[r].err, "rank 2")) fprintf(stderr, "mode %d rank %d: %s\n", mode, r, x[r].err);
      ZT_CHECK(strstr(x[r].err, "rank 2") != NULL);
      ZT_CHECK(zt_comm_failed_peer(keep[r].comm) == 2);
      if (mode == 0) {
        char want[64];
        snprintf(want, sizeof want, "timed out (rank %d: 0/32 bytes from rank 2, 32/32 to it)", r);
        ZT_CHECK(strstr(x[r].err, want) != NULL);
      }
    }
    if (mode == 0) ZT_CHECK(el >= 290 && el < 3000);
    else ZT_CHECK(el < 4000);
    if (mode == 2) ZT_CHECK(x[2].rc != 0 && strstr(x[2].err, "abort") != NULL);
    close_ranks(keep, 3);
  }
  for (int r = 0; r < 3; r++) {
    free(in[r]);
    free(out[r]);
  }
}

/* A peer of another session (stale generation) is refused at the handshake. */
typedef struct {
  zt_comm_tcp_opts_t o;
  zt_comm_t *c;
  int rc;
  char err[512];
} create_arg;

static void *create_thread(void *p) {
  create_arg *a = p;
  a->rc = zt_comm_tcp_create(&a->o, &a->c);
  if (a->rc != 0) snprintf(a->err, sizeof a->err, "%s", zt_err_msg());
  return NULL;
}

ZT_TEST(test_stale_session_refused) {
  /* The last rank of another generation: 2 ranks (the ring) and 3 (the
   * mesh); and one that connects only the ring where the others make a
   * mesh. Every rank fails, the others naming the odd one out. */
  static const struct {
    int world, session, ring_only;
  } cases[] = {{2, 2, 0}, {3, 2, 0}, {3, 1, 1}};
  for (size_t ci = 0; ci < ZT_ARRAY_LEN(cases); ci++) {
    int world = cases[ci].world, odd = world - 1;
    char ports[3][32];
    const char *peers[3];
    int lfds[3];
    for (int r = 0; r < world; r++) {
      int port = 0;
      ZT_REQUIRE(zt_comm_tcp_listen("127.0.0.1", &port, &lfds[r]) == 0);
      snprintf(ports[r], sizeof ports[r], "127.0.0.1:%d", port);
      peers[r] = ports[r];
    }
    create_arg a[3];
    pthread_t th[3];
    for (int r = 0; r < world; r++) {
      a[r] = (create_arg){.o = {.rank = r, .world = world, .peers = peers, .listen_fd = lfds[r],
                                .session = r == odd ? (uint64_t)cases[ci].session : 1,
                                .key = TEST_KEY, .connect_timeout_ms = 500,
                                .ring_only = r == odd && cases[ci].ring_only}};
      pthread_create(&th[r], NULL, create_thread, &a[r]);
    }
    for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
    char want[64];
    snprintf(want, sizeof want, "rank %d did not connect in time", odd);
    for (int r = 0; r < world; r++) {
      ZT_CHECK(a[r].rc != 0);
      if (r != odd && !strstr(a[r].err, want)) fprintf(stderr, "case %zu rank %d: %s\n", ci, r, a[r].err);
      ZT_CHECK(r == odd || strstr(a[r].err, want) != NULL);
      zt_comm_destroy(a[r].c);
    }
  }
}

/* Listening sockets for `world` ranks on loopback. */
static void listen_all(int world, char ports[][32], const char **peers, int *lfds) {
  for (int r = 0; r < world; r++) {
    int port = 0;
    ZT_REQUIRE(zt_comm_tcp_listen("127.0.0.1", &port, &lfds[r]) == 0);
    snprintf(ports[r], 32, "127.0.0.1:%d", port);
    peers[r] = ports[r];
  }
}

/* A rank with another key (a process of another generation that guessed
 * the session, or an old key): 2 ranks and 3 (the mesh). No connection is
 * made: every rank fails, each naming the key. */
ZT_TEST(test_wrong_ring_key_refused) {
  for (int world = 2; world <= 3; world++) {
    char ports[3][32];
    const char *peers[3];
    int lfds[3];
    listen_all(world, ports, peers, lfds);
    create_arg a[3];
    pthread_t th[3];
    for (int r = 0; r < world; r++) {
      a[r] = (create_arg){.o = {.rank = r, .world = world, .peers = peers, .listen_fd = lfds[r],
                                .session = 1,
                                .key = r == world - 1 ? TEST_KEY "x" : TEST_KEY,
                                .connect_timeout_ms = 5000}};
      pthread_create(&th[r], NULL, create_thread, &a[r]);
    }
    for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
    /* The odd rank always reads an honest rank's answer and finds its MAC
     * wrong. An honest rank finds the odd rank's MAC wrong, or, where the
     * odd rank has given up and closed first, its connection closed. */
    int named = 0;
    for (int r = 0; r < world; r++) {
      fprintf(stderr, "world %d rank %d: %s\n", world, r, a[r].err);
      ZT_CHECK(a[r].rc != 0);
      ZT_CHECK(strstr(a[r].err, "ring key") || strstr(a[r].err, "refused the handshake"));
      named += r < world - 1 && strstr(a[r].err, "does not hold this generation's ring key");
      if (a[r].rc == 0) zt_comm_destroy(a[r].c);
    }
    ZT_CHECK(strstr(a[world - 1].err, "does not hold this generation's ring key") != NULL);
    ZT_CHECK(named >= 1);
  }
}

/* The wire layout of a hello (comm_handshake.c), for the impostor below. */
typedef struct {
  uint32_t magic, version;
  uint64_t session;
  uint32_t rank, world, mesh, pad;
  uint8_t nonce[16];
} test_hello;

/* Impostors that reach rank 1's port first, each with a hello that is
 * right in every field (the session and ranks are not secret), posing as
 * rank 0: one then sends bytes where the proof of the key belongs, one
 * sends nothing more, one closes. Rank 1 refuses the first and the last,
 * naming the rank they posed as, and takes rank 0's own connection: the
 * ring forms, and an all-reduce over it is right. */
ZT_TEST(test_impostor_refused) {
  char ports[2][32];
  const char *peers[2];
  int lfds[2];
  listen_all(2, ports, peers, lfds);
  int port1 = atoi(strchr(ports[1], ':') + 1);
  int imp[3];
  for (int i = 0; i < 3; i++) {
    imp[i] = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port1),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    ZT_REQUIRE(imp[i] >= 0 && connect(imp[i], (struct sockaddr *)&sa, sizeof sa) == 0);
    test_hello h = {0x5a545247u, 4, 1, 0, 2, 0, 0, {1, 2, 3, (uint8_t)i}};
    uint8_t junk[32 + sizeof h];
    memcpy(junk, &h, sizeof h);
    memset(junk + sizeof h, 0x5a, 32);
    size_t len = i == 0 ? sizeof junk : sizeof h;
    ZT_REQUIRE(send(imp[i], junk, len, MSG_NOSIGNAL) == (ssize_t)len);
    if (i == 2) shutdown(imp[i], SHUT_WR);
  }
  create_arg a[2];
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    a[r] = (create_arg){.o = {.rank = r, .world = 2, .peers = peers, .listen_fd = lfds[r],
                              .session = 1, .key = TEST_KEY, .connect_timeout_ms = 5000}};
    pthread_create(&th[r], NULL, create_thread, &a[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  fprintf(stderr, "rank 0: %s\nrank 1: %s\n", a[0].err, a[1].err);
  ZT_REQUIRE(a[0].rc == 0 && a[1].rc == 0);
  float b0[3] = {1, 2, 3}, b1[3] = {10, 20, 30};
  call_ctx x = {.c = a[0].c, .op = OP_ALLREDUCE, .dt = ZT_DT_F32, .count = 3, .buf = b0};
  call_ctx y = {.c = a[1].c, .op = OP_ALLREDUCE, .dt = ZT_DT_F32, .count = 3, .buf = b1};
  pthread_t t0, t1;
  pthread_create(&t0, NULL, call_main, &x);
  pthread_create(&t1, NULL, call_main, &y);
  pthread_join(t0, NULL);
  pthread_join(t1, NULL);
  ZT_CHECK(x.rc == 0 && y.rc == 0);
  for (int i = 0; i < 3; i++) ZT_CHECK(b0[i] == 11.0f * (float)(i + 1) && b1[i] == b0[i]);
  for (int r = 0; r < 2; r++) zt_comm_destroy(a[r].c);
  for (int i = 0; i < 3; i++) close(imp[i]);
}

/* More impostors than a rank keeps candidates for, every one stalling
 * after its hello: rank 0's own connection finds no room, and the set-up
 * fails at its deadline naming the rank that did not prove the key (a
 * flood can still deny a generation; it can never join one). */
ZT_TEST(test_impostor_flood_fails_at_deadline) {
  char ports[2][32];
  const char *peers[2];
  int lfds[2];
  listen_all(2, ports, peers, lfds);
  int port1 = atoi(strchr(ports[1], ':') + 1);
  enum { N = 6 };
  int imp[N];
  for (int i = 0; i < N; i++) {
    imp[i] = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port1),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    ZT_REQUIRE(imp[i] >= 0 && connect(imp[i], (struct sockaddr *)&sa, sizeof sa) == 0);
    test_hello h = {0x5a545247u, 4, 1, 0, 2, 0, 0, {9, (uint8_t)i}};
    ZT_REQUIRE(send(imp[i], &h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h);
  }
  create_arg a[2];
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    a[r] = (create_arg){.o = {.rank = r, .world = 2, .peers = peers, .listen_fd = lfds[r],
                              .session = 1, .key = TEST_KEY, .connect_timeout_ms = 3000}};
    pthread_create(&th[r], NULL, create_thread, &a[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  fprintf(stderr, "rank 0: %s\nrank 1: %s\n", a[0].err, a[1].err);
  ZT_CHECK(a[1].rc != 0 && strstr(a[1].err, "rank 0 did not prove") != NULL);
  ZT_CHECK(a[0].rc != 0);
  for (int r = 0; r < 2; r++)
    if (a[r].rc == 0) zt_comm_destroy(a[r].c);
  for (int i = 0; i < N; i++) close(imp[i]);
}

/* Rank 0 of 2 set up with zt_comm_tcp_new, then zt_comm_tcp_connect,
 * aborted from another thread after 200 ms: the set-up ends then, not at
 * its 20 s deadline. */
static void check_setup_abort(const char **peers, int lfd0) {
  zt_comm_tcp_opts_t o = {.rank = 0, .world = 2, .peers = peers, .listen_fd = lfd0,
                          .session = 1, .key = TEST_KEY, .connect_timeout_ms = 20000};
  zt_comm_t *c;
  ZT_REQUIRE(zt_comm_tcp_new(&o, &c) == 0);
  aborter ab = {c, 200};
  pthread_t th;
  pthread_create(&th, NULL, abort_later, &ab);
  int64_t t0 = zt_now_ms();
  ZT_CHECK(zt_comm_tcp_connect(c) != 0);
  int64_t el = zt_now_ms() - t0;
  fprintf(stderr, "set-up aborted after %lld ms: %s\n", (long long)el, zt_err_msg());
  ZT_CHECK(el >= 150 && el < 5000);
  ZT_CHECK(strstr(zt_err_msg(), "aborted") != NULL);
  ZT_CHECK(zt_comm_broken(c));
  pthread_join(th, NULL);
  zt_comm_destroy(c);
}

/* Waiting for a rank that never comes. */
ZT_TEST(test_setup_abort) {
  char ports[2][32];
  const char *peers[2];
  int lfds[2];
  listen_all(2, ports, peers, lfds);
  check_setup_abort(peers, lfds[0]);
  close(lfds[1]);
}

/* Where every connection attempt fails at once instead of waiting for an
 * answer (here: a broadcast address, which connect() refuses with
 * ENETUNREACH; a host without a route or a local firewall rule fails the
 * same way): the retries between attempts also end at the abort. */
ZT_TEST(test_setup_abort_while_connect_fails) {
  char ports[2][32];
  const char *peers[2];
  int lfds[2];
  listen_all(1, ports, peers, lfds);
  peers[1] = "255.255.255.255:9";
  check_setup_abort(peers, lfds[0]);
}

/* zt_comm_stats_get from another thread while zt_comm_tcp_connect runs
 * (a worker's heartbeats read the counters of a communicator that is
 * still connecting): no data race on the ring's sockets (ThreadSanitizer
 * would name one), and the set-up succeeds. The set-up starts only once
 * the poller reads, so the two overlap however the threads are scheduled
 * (on a loaded machine the set-up could end before the poller ran). */
typedef struct {
  zt_comm_t *c;
  atomic_int stop;
  atomic_long polls;
} stats_poller;

static void *poll_stats(void *p) {
  stats_poller *sp = p;
  while (!atomic_load(&sp->stop)) {
    zt_comm_stats_t st;
    zt_comm_stats_get(sp->c, &st);
    atomic_fetch_add(&sp->polls, 1);
  }
  return NULL;
}

ZT_TEST(test_stats_during_setup) {
  char ports[2][32];
  const char *peers[2];
  int lfds[2];
  listen_all(2, ports, peers, lfds);
  create_arg other = {.o = {.rank = 1, .world = 2, .peers = peers, .listen_fd = lfds[1],
                            .session = 1, .key = TEST_KEY, .connect_timeout_ms = 5000}};
  zt_comm_tcp_opts_t o = {.rank = 0, .world = 2, .peers = peers, .listen_fd = lfds[0],
                          .session = 1, .key = TEST_KEY, .connect_timeout_ms = 5000};
  zt_comm_t *c;
  ZT_REQUIRE(zt_comm_tcp_new(&o, &c) == 0);
  stats_poller sp = {.c = c};
  pthread_t poller, th;
  ZT_REQUIRE(pthread_create(&poller, NULL, poll_stats, &sp) == 0);
  zt_deadline_t dl = zt_deadline_in(10000);
  while (atomic_load(&sp.polls) == 0 && zt_deadline_left_ms(dl) > 0) sched_yield();
  long before = atomic_load(&sp.polls);
  ZT_REQUIRE(pthread_create(&th, NULL, create_thread, &other) == 0);
  int rc = zt_comm_tcp_connect(c);
  if (rc != 0) fprintf(stderr, "rank 0: %s\n", zt_err_msg());
  pthread_join(th, NULL);
  atomic_store(&sp.stop, 1);
  pthread_join(poller, NULL);
  ZT_CHECK(rc == 0);
  ZT_CHECK(other.rc == 0);
  ZT_CHECK(before > 0); /* the poller was reading when the set-up began */
  if (other.rc == 0) zt_comm_destroy(other.c);
  zt_comm_destroy(c);
}

/* One thread's calls on a view in test_views: iters all-reduces of
 * count fp32 values, each checked against the members' sum. */
typedef struct {
  zt_comm_t *v;
  int rank;           /* this rank in the whole communicator */
  const int *members; /* the view's ranks there */
  int n, iters;
  size_t count;
  int64_t timeout_ms;
  int rc, bad;
  char err[512];
} view_ctx;

static void *view_main(void *p) {
  view_ctx *x = p;
  float *b = malloc(x->count * sizeof(float) + 1);
  for (int it = 0; it < x->iters && x->rc == 0; it++) {
    for (size_t i = 0; i < x->count; i++) b[i] = val(x->rank, i) + (float)it;
    x->rc = zt_comm_all_reduce(x->v, b, x->count, ZT_DT_F32, ZT_RED_SUM, x->timeout_ms);
    for (size_t i = 0; x->rc == 0 && i < x->count; i++) {
      float want = 0;
      for (int k = 0; k < x->n; k++) want += val(x->members[k], i) + (float)it;
      x->bad += b[i] != want;
    }
  }
  if (x->rc != 0) snprintf(x->err, sizeof x->err, "%s", zt_err_msg());
  free(b);
  return NULL;
}

/* Views (zt_comm_view) of a 4-rank mesh: the groups {0, 1} and {2, 3},
 * and the places {0, 2} and {1, 3}, the two at the same time from two
 * threads of every rank (their sockets are disjoint). Every sum is its
 * members' alone, back-to-back calls keep the streams in step, the bytes
 * count in the whole communicator's stats, and its own collective works
 * after them. Bad views are refused by name. Then rank 3 leaves its group
 * silent: rank 2's call times out naming rank 3, and the whole
 * communicator is broken too, with rank 3 (its rank there) as the failed
 * peer; a view of it then fails at once. */
ZT_TEST(test_views) {
  static rank_ctx keep[4];
  static view_ctx x[8];
  static int members[8][2];
  zt_comm_t *views[8];
  open_ranks(keep, 4);
  for (int r = 0; r < 4; r++) ZT_REQUIRE(keep[r].comm != NULL);
  zt_comm_t *bad;
  ZT_CHECK(zt_comm_view(keep[0].comm, (int[]){1, 2}, 2, &bad) != 0);
  ZT_CHECK(strstr(zt_err_msg(), "without this rank (0)") != NULL);
  ZT_CHECK(zt_comm_view(keep[0].comm, (int[]){0, 0}, 2, &bad) != 0);
  ZT_CHECK(strstr(zt_err_msg(), "names rank 0 twice") != NULL);
  ZT_CHECK(zt_comm_view(keep[0].comm, (int[]){0, 4}, 2, &bad) != 0);
  ZT_CHECK(strstr(zt_err_msg(), "rank 4 out of range") != NULL);
  zt_comm_stats_t before;
  zt_comm_stats_get(keep[0].comm, &before);
  for (int r = 0; r < 4; r++) {
    int *g = members[2 * r], *pl = members[2 * r + 1];
    g[0] = r / 2 * 2, g[1] = r / 2 * 2 + 1;
    pl[0] = r % 2, pl[1] = r % 2 + 2;
    ZT_REQUIRE(zt_comm_view(keep[r].comm, g, 2, &views[2 * r]) == 0);
    ZT_REQUIRE(zt_comm_view(keep[r].comm, pl, 2, &views[2 * r + 1]) == 0);
    ZT_CHECK(zt_comm_rank(views[2 * r]) == r % 2 && zt_comm_world(views[2 * r]) == 2);
    ZT_CHECK(zt_comm_rank(views[2 * r + 1]) == r / 2);
  }
  pthread_t th[8];
  for (int i = 0; i < 8; i++) {
    x[i] = (view_ctx){.v = views[i], .rank = i / 2, .members = members[i], .n = 2, .iters = 20,
                      .count = 100003 + (size_t)(i % 2), .timeout_ms = 20000};
    pthread_create(&th[i], NULL, view_main, &x[i]);
  }
  for (int i = 0; i < 8; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 8; i++) {
    if (x[i].rc != 0) fprintf(stderr, "view %d: %s\n", i, x[i].err);
    ZT_CHECK(x[i].rc == 0 && x[i].bad == 0);
  }
  zt_comm_stats_t after;
  zt_comm_stats_get(keep[0].comm, &after);
  ZT_CHECK(after.bytes_sent - before.bytes_sent >= 20 * 2 * 100003 * sizeof(float) / 2);
  /* The whole communicator after its views: an all-reduce of all four. */
  static call_ctx whole[4];
  static float wb[4][64];
  for (int r = 0; r < 4; r++) {
    for (int i = 0; i < 64; i++) wb[r][i] = val(r, (size_t)i);
    whole[r] = (call_ctx){.c = keep[r].comm, .op = OP_ALLREDUCE, .dt = ZT_DT_F32, .count = 64,
                          .buf = wb[r], .timeout_ms = 20000};
    pthread_create(&th[r], NULL, call_main, &whole[r]);
  }
  for (int r = 0; r < 4; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < 4; r++) ZT_CHECK(whole[r].rc == 0 && wb[r][5] == ref_sum(4, 5, ZT_RED_SUM));
  /* Rank 3 silent in its group: rank 2's view times out and breaks the
   * whole communicator, naming rank 3. */
  x[4] = (view_ctx){.v = views[4], .rank = 2, .members = members[4], .n = 2, .iters = 1,
                    .count = 1000, .timeout_ms = 300};
  view_main(&x[4]);
  ZT_CHECK(x[4].rc != 0 && strstr(x[4].err, "timed out") != NULL);
  ZT_CHECK(zt_comm_broken(views[4]) && zt_comm_broken(keep[2].comm));
  ZT_CHECK(zt_comm_failed_peer(keep[2].comm) == 3);
  x[5] = (view_ctx){.v = views[5], .rank = 2, .members = members[5], .n = 2, .iters = 1,
                    .count = 10, .timeout_ms = 300};
  view_main(&x[5]);
  ZT_CHECK(x[5].rc != 0 && strstr(x[5].err, "unusable") != NULL);
  for (int i = 0; i < 8; i++) zt_comm_destroy(views[i]);
  close_ranks(keep, 4);
}

/* The NCCL backend: without a GPU (or without CUDA in the build) creation
 * fails with a clear message instead of crashing or hanging; on a GPU
 * machine a one-rank communicator is created and torn down. */
ZT_TEST(test_nccl_backend_guarded) {
  char id[257];
  zt_comm_t *c = NULL;
  if (zt_comm_nccl_unique_id(id) != 0) {
    ZT_CHECK(strlen(zt_err_msg()) > 0);
    return;
  }
  ZT_CHECK(strlen(id) == 256);
  int64_t t0 = zt_now_ms();
  if (zt_comm_nccl_create(0, 1, id, 0, 5000, &c) != 0) {
    /* No usable GPU: an error within the deadline. */
    ZT_CHECK(zt_now_ms() - t0 < 20000);
    fprintf(stderr, "nccl: %s\n", zt_err_msg());
    return;
  }
  ZT_CHECK(!strcmp(zt_comm_backend(c), "nccl"));
  zt_comm_destroy(c);
}

ZT_TEST_MAIN(test_nccl_backend_guarded, test_all_reduce, test_all_reduce_avg,
             test_avg_fp64_divides_by_world, test_reduce_scatter_layout,
             test_reduce_scatter_fp32_into_fp64, test_calls_must_agree,
             test_all_gather_layout, test_all_to_all, test_broadcast, test_large_64mib, test_all_reduce_sum_order,
             test_connect_timeout, test_connect_to_silent_host_times_out,
             test_silent_peer_timeout_and_abort, test_mesh_back_to_back,
             test_mesh_peer_silent_or_gone,
             test_stale_session_refused, test_wrong_ring_key_refused, test_impostor_refused, test_impostor_flood_fails_at_deadline,
             test_setup_abort, test_setup_abort_while_connect_fails, test_stats_during_setup,
             test_views)
