/*
 * test_engine_zero.c: the ZeRO states of one rank (engine/zero.c), where no
 * other rank is needed.
 *
 * A generation whose states do not fit fails in zt_zero_create after part
 * of them is allocated. The zworker process lives on into the next
 * generation, so that part must be freed by zt_zero_create itself (the
 * trainer frees only what was created). The test lowers the process's
 * address-space limit (RLIMIT_AS) so that the stage 0 layout fails half
 * way: a real allocation failure of the real allocator, with the first
 * buffers already allocated. It then checks that the room they took is
 * free again, and that the same model, with the limit lifted, takes a
 * whole set of states. Buffers this large are mapped by themselves
 * (mmap), so freeing one gives its address space back at once.
 *
 * Under the sanitizers (which reserve terabytes of address space, and stop
 * the process when an allocation fails) the limit cannot be used: the test
 * says so and passes; the release build runs it.
 *
 * And whom a failed load of an epoch blames (zt_train_load_fault): the
 * epoch only when its content is at fault.
 *
 * And DiLoCo's outer step on one group (engine/diloco.c), waited for and
 * overlapped, against the rule computed here; a pseudo-gradient that is
 * not finite; the checkpoint ranges of the inner and outer state.
 *
 * And the owned ranges of the master (zt_zero_owned_get, _put) on two
 * ranks, threads of this process over a real TCP communicator, at every
 * stage: each rank reads its range of the initial parameters and puts
 * values of its own, which then stand in both ranks' working copies; and
 * the owned Adam state (zt_zero_adam_get, _put), which stage 0 of two
 * ranks refuses; and stage 0's whole state (zt_zero_full_get, _put,
 * _broadcast: recovery from memory), which stages 1-3 refuse.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "diloco.h"
#include "model.h"
#include "trainer.h"
#include "zero.h"
#include "zt_common.h"
#include "zt_test.h"

#ifndef ZT_SANITIZE
/* One block of C = 1024 and a vocabulary of 4096: about 16.8 million
 * parameters, so 4 bytes each (one fp32 buffer) are 67 MB. */
static const zt_model_config_t wide = {.n_layer = 1, .n_head = 8, .n_embd = 1024, .seq_len = 8,
                                       .vocab_size = 4096};

/* The process's mapped address space in bytes (/proc/self/statm), or 0. */
static uint64_t mapped_bytes(void) {
  unsigned long long pages = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f) return 0;
  if (fscanf(f, "%llu", &pages) != 1) pages = 0;
  fclose(f);
  return pages * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* Whether `bytes` more of address space can be allocated now (through a
 * volatile pointer, so that the compiler keeps the allocation). */
static int room_for(uint64_t bytes) {
  void *volatile p = malloc(bytes);
  int ok = p != NULL;
  free(p);
  return ok;
}

/* Stage 0 on one rank allocates, in order, the parameters (4 bytes per
 * parameter), the gradient (4), its fp64 sum (8), Adam's m and v (4 + 4)
 * and one unit of scratch. With room for 10 bytes per parameter above
 * what is mapped, the first two fit and the rest does not: the layout
 * fails with 8 bytes per parameter allocated. Afterwards 6 bytes per
 * parameter must fit again, which they cannot if those 8 were leaked. */
ZT_TEST(failed_create_frees_what_it_allocated) {
  zt_model_t *m = NULL;
  ZT_REQUIRE(zt_model_create(&m, &wide, 1, wide.seq_len, zt_kernels_cpu(),
                             ZT_MODEL_NO_PARAMS | ZT_MODEL_NO_GRADS) == 0);
  uint64_t psi = m->lay.num_params, base = mapped_bytes();
  struct rlimit old;
  ZT_REQUIRE(base > 0 && getrlimit(RLIMIT_AS, &old) == 0);
  struct rlimit low = {base + 10 * psi, old.rlim_max};
  ZT_REQUIRE(old.rlim_cur == RLIM_INFINITY || old.rlim_cur > low.rlim_cur);
  ZT_REQUIRE(setrlimit(RLIMIT_AS, &low) == 0);
  zt_zero_t *z = NULL;
  zt_zero_opts_t o = {.rank = 0, .world = 1, .stage = 0, .timeout_ms = 1000, .inv_k = 1.0,
                      .accum = 1};
  int rc = zt_zero_create(&z, m, zt_kernels_cpu(), NULL, &o);
  zt_errkind_t kind = zt_err_kind();
  int freed = room_for(6 * psi);
  ZT_CHECK(setrlimit(RLIMIT_AS, &old) == 0);
  ZT_CHECK(rc == -1 && kind == ZT_E_NO_MEMORY);
  ZT_CHECK(strstr(zt_err_msg(), "out of host memory for the model states") != NULL);
  if (!freed)
    fprintf(stderr, "  the failed zt_zero_create kept its buffers: %s\n", zt_err_msg());
  ZT_CHECK(freed);
  /* The model is whole again (no hooks, no states): it takes new ones. */
  ZT_CHECK(zt_zero_create(&z, m, zt_kernels_cpu(), NULL, &o) == 0);
  zt_zero_free(z);
  zt_model_free(m);
}
#else
ZT_TEST(failed_create_frees_what_it_allocated) {
  fprintf(stderr, "  skipped under the sanitizers: RLIMIT_AS cannot limit their allocator\n");
}
#endif

/* An epoch that is not there (a missing manifest) is the epoch's fault,
 * as are a short or changed file (test_engine_ckpt checks those kinds);
 * an I/O error or too few descriptors are this worker's, and must not
 * retire a good epoch; out of memory is the worker's memory. */
/* A small model and its stage 0 states on one rank, alone. */
static int small_zero(zt_model_t **m, zt_zero_t **z) {
  static const zt_model_config_t small = {
      .n_layer = 1, .n_head = 2, .n_embd = 8, .seq_len = 4, .vocab_size = 16};
  zt_zero_opts_t o = {
      .rank = 0, .world = 1, .stage = 0, .timeout_ms = 1000, .inv_k = 1.0, .accum = 1};
  *m = NULL;
  if (zt_model_create(m, &small, 1, small.seq_len, zt_kernels_cpu(),
                      ZT_MODEL_NO_PARAMS | ZT_MODEL_NO_GRADS) != 0)
    return -1;
  return zt_zero_create(z, *m, zt_kernels_cpu(), NULL, &o);
}

ZT_TEST(load_fault_blames_the_epoch_only_for_its_content) {
  zt_model_t *m;
  zt_zero_t *z = NULL;
  ZT_REQUIRE(small_zero(&m, &z) == 0);
  char dir[700];
  snprintf(dir, sizeof dir, "%s/no-such-epoch", zt_test_tmpdir("engine_zero"));
  int64_t step = -1;
  ZT_CHECK(zt_zero_load(z, dir, NULL, &step) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "manifest.json") != NULL);
  ZT_CHECK(zt_train_load_fault(zt_err_kind()) == ZT_FAULT_CHECKPOINT);
  ZT_CHECK(zt_train_load_fault(ZT_E_INVALID) == ZT_FAULT_CHECKPOINT);
  ZT_CHECK(zt_train_load_fault(ZT_E_TOO_LARGE) == ZT_FAULT_CHECKPOINT);
  ZT_CHECK(zt_train_load_fault(ZT_E_FAILED) == ZT_FAULT_LOCAL);
  ZT_CHECK(zt_train_load_fault(ZT_E_UNAVAILABLE) == ZT_FAULT_LOCAL);
  ZT_CHECK(zt_train_load_fault(ZT_E_NO_MEMORY) == ZT_FAULT_MEMORY);
  zt_zero_free(z);
  zt_model_free(m);
}

/* The rule (diloco.h), one element: the new outer value and momentum. */
static float rule(float outer, float *mom, float theta) {
  float delta = outer - theta, m = 0.9f * *mom + delta;
  *mom = m;
  return outer - 0.7f * (delta + 0.9f * m);
}

/* The outer optimizer of the rule above, H = 4. */
static void rule_spec(zt_spec_t *sp) {
  memset(sp, 0, sizeof *sp);
  sp->inner_steps = 4, sp->outer_lr = 0.7, sp->outer_momentum = 0.9, sp->outer_nesterov = 1;
  sp->fragments = 1, sp->group_size = 1;
}

ZT_TEST(diloco_outer_step_waited_and_overlapped) {
  zt_model_t *m;
  zt_zero_t *z = NULL;
  ZT_REQUIRE(small_zero(&m, &z) == 0);
  zt_spec_t sp;
  rule_spec(&sp);
  zt_diloco_t d;
  ZT_REQUIRE(zt_diloco_create(&d, z, NULL, 1, 0, &sp, 1000) == 0);
  const zt_zero_view_t *zv = zt_zero_view(z);
  size_t n = zv->full_total;
  float *p0 = malloc(n * 4), *p = malloc(n * 4), *want = malloc(n * 4), *mom = calloc(n, 4);
  for (size_t i = 0; i < n; i++) p0[i] = (float)(i % 17) * 0.25f - 2.0f;
  ZT_REQUIRE(zt_zero_master_put(z, p0) == 0 && zt_diloco_begin(&d) == 0);
  /* Waited for: the inner steps moved every value by 0.5. */
  for (size_t i = 0; i < n; i++) p[i] = p0[i] + 0.5f;
  ZT_REQUIRE(zt_zero_master_put(z, p) == 0);
  int applied = 0;
  ZT_REQUIRE(zt_diloco_sync(&d, -1, &applied) == 0 && applied);
  ZT_REQUIRE(zt_zero_master_get(z, p) == 0);
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    want[i] = rule(p0[i], &mom[i], p0[i] + 0.5f);
    bad += p[i] != want[i] || d.outer[i] != want[i] || d.mom[i] != mom[i];
    bad += d.d[i] != p0[i] + 0.5f; /* the inner parameters, for a checkpoint */
  }
  ZT_CHECK(bad == 0);
  /* Overlapped: launched from theta, landed after the group moved on by
   * 0.25: the new outer value plus that progress. */
  float *theta = malloc(n * 4);
  for (size_t i = 0; i < n; i++) theta[i] = want[i] - 0.125f * (float)(i % 3);
  ZT_REQUIRE(zt_zero_master_put(z, theta) == 0);
  ZT_REQUIRE(zt_diloco_launch(&d, -1) == 0 && d.pending);
  for (size_t i = 0; i < n; i++) p[i] = theta[i] + 0.25f;
  ZT_REQUIRE(zt_zero_master_put(z, p) == 0);
  ZT_REQUIRE(zt_diloco_land(&d, &applied) == 0 && applied && !d.pending);
  ZT_REQUIRE(zt_zero_master_get(z, p) == 0);
  bad = 0;
  for (size_t i = 0; i < n; i++) {
    float o2 = rule(want[i], &mom[i], theta[i]);
    bad += d.outer[i] != o2 || p[i] != o2 + ((theta[i] + 0.25f) - theta[i]);
  }
  ZT_CHECK(bad == 0);
  /* Not finite: refused, the outer state kept, the group back at it. */
  memcpy(want, d.outer, n * 4);
  memcpy(p, want, n * 4);
  p[3] = NAN;
  ZT_REQUIRE(zt_zero_master_put(z, p) == 0);
  ZT_REQUIRE(zt_diloco_sync(&d, -1, &applied) == 0);
  ZT_CHECK(!applied && d.refused == 1);
  ZT_REQUIRE(zt_zero_master_get(z, p) == 0);
  ZT_CHECK(memcmp(p, want, n * 4) == 0 && memcmp(d.outer, want, n * 4) == 0);
  /* The checkpoint: each unit twice, as U + u (inner, whole) and as u
   * (outer parameters, momentum in m, zeros in v). */
  float *buf = malloc(zt_diloco_snapshot_floats(&d) * 4);
  zt_ckpt_range_t *rg = calloc(3 * (size_t)zv->U, sizeof *rg);
  int nr = 0;
  ZT_REQUIRE(zt_diloco_snapshot(&d, buf, rg, &nr) == 0);
  ZT_CHECK(nr == 2 * zv->U);
  for (int u = 0; u < zv->U; u++) {
    ZT_CHECK(rg[u].unit == zv->U + u && rg[u].lo == 0 && rg[u].n == zv->usz[u]);
    ZT_CHECK(rg[zv->U + u].unit == u && rg[zv->U + u].n == zv->usz[u]);
    ZT_CHECK(memcmp(rg[zv->U + u].p, d.outer + zv->off_full[u], zv->usz[u] * 4) == 0);
    ZT_CHECK(memcmp(rg[zv->U + u].m, d.mom + zv->off_full[u], zv->usz[u] * 4) == 0);
    ZT_CHECK(rg[zv->U + u].v[0] == 0.0f);
  }
  free(buf), free(rg), free(theta), free(p0), free(p), free(want), free(mom);
  zt_diloco_free(&d);
  zt_zero_free(z);
  zt_model_free(m);
}

/* sync.fragments: the units shared among the fragments, each syncing on
 * its own step; a fragment's sync (waited or overlapped) moves its own
 * elements only, by the rule, and leaves the others as the group has
 * them. */
ZT_TEST(diloco_fragments_sync_their_own_units) {
  zt_model_t *m;
  zt_zero_t *z = NULL;
  ZT_REQUIRE(small_zero(&m, &z) == 0);
  zt_spec_t sp;
  rule_spec(&sp);
  sp.fragments = 2;
  zt_diloco_t d;
  ZT_REQUIRE(zt_diloco_create(&d, z, NULL, 1, 0, &sp, 1000) == 0);
  const zt_zero_view_t *zv = zt_zero_view(z);
  ZT_REQUIRE(d.F == 2 && zv->U >= 2);
  size_t load[2] = {0, 0}, biggest = 0;
  for (int u = 0; u < zv->U; u++) {
    ZT_REQUIRE(d.frag_of[u] == 0 || d.frag_of[u] == 1);
    load[d.frag_of[u]] += zv->usz[u];
    if (zv->usz[u] > biggest) biggest = zv->usz[u];
  }
  /* Greedy: the fragments differ by no more than the largest unit. */
  size_t gap = load[0] > load[1] ? load[0] - load[1] : load[1] - load[0];
  ZT_CHECK(load[0] && load[1] && gap <= biggest);
  static const int due[9] = {-1, -1, 0, -1, 1, -1, 0, -1, 1};
  for (int s = 1; s <= 8; s++) ZT_CHECK(zt_diloco_fragment_due(&d, s) == due[s]);
  size_t n = zv->full_total;
  float *p0 = malloc(n * 4), *p = malloc(n * 4), *q = malloc(n * 4), *mom = calloc(n, 4);
  for (size_t i = 0; i < n; i++) p0[i] = (float)(i % 13) * 0.25f - 1.0f;
  ZT_REQUIRE(zt_zero_master_put(z, p0) == 0 && zt_diloco_begin(&d) == 0);
  for (int f = 0; f < 2; f++) {
    /* The group moved every value by 0.5; fragment f syncs (f 1
     * overlapped, with a further 0.25 of progress before it lands). */
    float *now = malloc(n * 4);
    ZT_REQUIRE(zt_zero_master_get(z, now) == 0);
    for (size_t i = 0; i < n; i++) p[i] = now[i] + 0.5f;
    ZT_REQUIRE(zt_zero_master_put(z, p) == 0);
    int applied = 0;
    if (f == 0) {
      ZT_REQUIRE(zt_diloco_sync(&d, 0, &applied) == 0 && applied);
    } else {
      ZT_REQUIRE(zt_diloco_launch(&d, 1) == 0 && d.pending);
      for (size_t i = 0; i < n; i++) q[i] = p[i] + 0.25f;
      ZT_REQUIRE(zt_zero_master_put(z, q) == 0);
      ZT_REQUIRE(zt_diloco_land(&d, &applied) == 0 && applied);
    }
    ZT_REQUIRE(zt_zero_master_get(z, now) == 0);
    size_t bad = 0, moved = 0;
    for (int u = 0; u < zv->U; u++) {
      for (size_t i = zv->off_full[u], e = i + zv->usz[u]; i < e; i++) {
        float after = f == 1 ? q[i] : p[i];
        if (d.frag_of[u] == f) {
          float o = rule(p0[i], &mom[i], p[i]);
          bad += d.outer[i] != o || now[i] != o + (after - p[i]);
          p0[i] = o;
          moved++;
        } else {
          bad += d.outer[i] != p0[i] || now[i] != after;
        }
      }
    }
    ZT_CHECK(bad == 0 && moved == load[f]);
    free(now);
  }
  ZT_CHECK(d.syncs == 2);
  free(p0), free(p), free(q), free(mom);
  zt_diloco_free(&d);
  zt_zero_free(z);
  zt_model_free(m);
}

/* One rank of owned_ranges_at_every_stage. */
typedef struct {
  int rank, stage, lfd, bad, rc;
  const char *peers[2];
  char err[512];
} owned_ctx;

static float owned_val(int rank, int u, size_t i) {
  return (float)(rank * 1000 + u * 10) + (float)(i % 97) * 0.125f;
}

static void *owned_rank(void *p) {
  owned_ctx *x = p;
  static const zt_model_config_t small = {
      .n_layer = 1, .n_head = 2, .n_embd = 8, .seq_len = 4, .vocab_size = 16};
  zt_comm_tcp_opts_t co = {.rank = x->rank, .world = 2, .peers = x->peers, .listen_fd = x->lfd,
                           .session = 9, .key = "0123456789abcdef0123456789abcdef",
                           .connect_timeout_ms = 20000};
  zt_zero_opts_t o = {.rank = x->rank, .world = 2, .stage = x->stage, .timeout_ms = 20000,
                      .inv_k = 1.0, .accum = 1};
  zt_comm_t *c = NULL;
  zt_model_t *m = NULL;
  zt_zero_t *z = NULL;
  x->rc = -1;
  if (zt_comm_tcp_create(&co, &c) != 0 ||
      zt_model_create(&m, &small, 1, small.seq_len, zt_kernels_cpu(),
                      ZT_MODEL_NO_PARAMS | ZT_MODEL_NO_GRADS) != 0 ||
      zt_zero_create(&z, m, zt_kernels_cpu(), c, &o) != 0) {
    snprintf(x->err, sizeof x->err, "%s", zt_err_msg());
    zt_model_free(m);
    zt_comm_destroy(c);
    return NULL;
  }
  const zt_zero_view_t *zv = zt_zero_view(z);
  zt_zero_init_params(z, 5);
  float *h = calloc(zv->shard_total, sizeof(float)), *init = malloc(zv->max_unit * sizeof(float));
  x->rc = zt_zero_owned_get(z, h);
  for (int u = 0; x->rc == 0 && u < zv->U; u++) { /* the initial parameters' owned range */
    zt_layout_init_unit(&m->lay, 5, u, init);
    size_t lo = ZT_MIN((size_t)x->rank * zv->S[u], zv->usz[u]);
    size_t n = ZT_MIN(zv->S[u], zv->usz[u] - lo);
    for (size_t i = 0; i < zv->S[u]; i++)
      x->bad += h[zv->off_shard[u] + i] != (i < n ? init[lo + i] : 0.0f);
  }
  for (int u = 0; u < zv->U; u++)
    for (size_t i = 0; i < zv->S[u]; i++) h[zv->off_shard[u] + i] = owned_val(x->rank, u, i);
  if (x->rc == 0) x->rc = zt_zero_owned_put(z, h);
  memset(h, 0, zv->shard_total * sizeof(float));
  if (x->rc == 0) x->rc = zt_zero_owned_get(z, h);
  for (int u = 0; x->rc == 0 && u < zv->U; u++) {
    size_t n = ZT_MIN(zv->S[u], zv->usz[u] - ZT_MIN((size_t)x->rank * zv->S[u], zv->usz[u]));
    for (size_t i = 0; i < n; i++) x->bad += h[zv->off_shard[u] + i] != owned_val(x->rank, u, i);
    /* Stages 0-2 hold whole units: both ranks' values, each in its range. */
    const float *w = m->unit_params[u];
    for (size_t i = 0; x->stage < 3 && i < zv->usz[u]; i++)
      x->bad += w[i] != owned_val((int)(i / zv->S[u]), u, i % zv->S[u]);
  }
  if (x->rc != 0) snprintf(x->err, sizeof x->err, "%s", zt_err_msg());
  /* The owned Adam state: stages 1-3 hold it in the owned layout, and a
   * put reads back as it was; stage 0 of two ranks keeps it whole and
   * refuses. */
  size_t ns = zv->shard_total;
  float *in = calloc(2 * ns, sizeof(float)), *out = calloc(2 * ns, sizeof(float));
  for (size_t i = 0; i < 2 * ns; i++) in[i] = (float)i * 0.5f + (float)x->rank;
  int arc = zt_zero_adam_put(z, in, in + ns);
  x->bad += (x->stage == 0) != (arc != 0);
  if (arc == 0)
    x->bad += zt_zero_adam_get(z, out, out + ns) != 0 || memcmp(in, out, 2 * ns * 4) != 0;
  /* The whole state, stage 0 only (recovery from memory): each rank puts
   * its own, rank 1 broadcasts, and both then hold rank 1's, as the get
   * (0: the last update is whole) and the working copy say. */
  size_t nf = zt_zero_full_floats(z);
  float *fp = calloc(3 * nf, sizeof(float)), *fg = calloc(3 * nf, sizeof(float));
  for (size_t i = 0; i < 3 * nf; i++) fp[i] = (float)i * 0.25f + (float)x->rank;
  int frc = zt_zero_full_put(z, fp, fp + nf, fp + 2 * nf);
  x->bad += (x->stage == 0) != (frc == 0);
  if (frc == 0) {
    x->bad += zt_zero_full_broadcast(z, 1) != 0;
    x->bad += zt_zero_full_get(z, fg, fg + nf, fg + 2 * nf) != 0;
    for (size_t i = 0; i < 3 * nf; i++) x->bad += fg[i] != (float)i * 0.25f + 1.0f;
    x->bad += m->unit_params[0][0] != 1.0f;
  } else {
    x->bad += zt_zero_full_broadcast(z, 1) == 0 || zt_zero_full_get(z, fg, fg, fg) == 0;
  }
  free(fp), free(fg);
  free(in), free(out), free(h), free(init);
  zt_zero_free(z);
  zt_model_free(m);
  zt_comm_destroy(c);
  return NULL;
}

ZT_TEST(owned_ranges_at_every_stage) {
  for (int stage = 0; stage <= 3; stage++) {
    owned_ctx x[2];
    char addr[2][32];
    memset(x, 0, sizeof x);
    for (int r = 0; r < 2; r++) {
      int port = 0;
      ZT_REQUIRE(zt_comm_tcp_listen("127.0.0.1", &port, &x[r].lfd) == 0);
      snprintf(addr[r], sizeof addr[r], "127.0.0.1:%d", port);
    }
    pthread_t th[2];
    for (int r = 0; r < 2; r++) {
      x[r].rank = r, x[r].stage = stage, x[r].peers[0] = addr[0], x[r].peers[1] = addr[1];
      pthread_create(&th[r], NULL, owned_rank, &x[r]);
    }
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < 2; r++) {
      if (x[r].rc != 0) fprintf(stderr, "stage %d rank %d: %s\n", stage, r, x[r].err);
      ZT_CHECK(x[r].rc == 0 && x[r].bad == 0);
    }
  }
}

ZT_TEST_MAIN(failed_create_frees_what_it_allocated,
             load_fault_blames_the_epoch_only_for_its_content,
             diloco_outer_step_waited_and_overlapped, diloco_fragments_sync_their_own_units,
             owned_ranges_at_every_stage)
