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
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

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
  zt_zero_t z;
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
  zt_zero_free(&z);
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
ZT_TEST(load_fault_blames_the_epoch_only_for_its_content) {
  static const zt_model_config_t small = {
      .n_layer = 1, .n_head = 2, .n_embd = 8, .seq_len = 4, .vocab_size = 16};
  zt_model_t *m = NULL;
  ZT_REQUIRE(zt_model_create(&m, &small, 1, small.seq_len, zt_kernels_cpu(),
                             ZT_MODEL_NO_PARAMS | ZT_MODEL_NO_GRADS) == 0);
  zt_zero_t z;
  zt_zero_opts_t o = {
      .rank = 0, .world = 1, .stage = 0, .timeout_ms = 1000, .inv_k = 1.0, .accum = 1};
  ZT_REQUIRE(zt_zero_create(&z, m, zt_kernels_cpu(), NULL, &o) == 0);
  char dir[700];
  snprintf(dir, sizeof dir, "%s/no-such-epoch", zt_test_tmpdir("engine_zero"));
  int64_t step = -1;
  ZT_CHECK(zt_zero_load(&z, dir, NULL, &step) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "manifest.json") != NULL);
  ZT_CHECK(zt_train_load_fault(zt_err_kind()) == ZT_FAULT_CHECKPOINT);
  ZT_CHECK(zt_train_load_fault(ZT_E_INVALID) == ZT_FAULT_CHECKPOINT);
  ZT_CHECK(zt_train_load_fault(ZT_E_TOO_LARGE) == ZT_FAULT_CHECKPOINT);
  ZT_CHECK(zt_train_load_fault(ZT_E_FAILED) == ZT_FAULT_LOCAL);
  ZT_CHECK(zt_train_load_fault(ZT_E_UNAVAILABLE) == ZT_FAULT_LOCAL);
  ZT_CHECK(zt_train_load_fault(ZT_E_NO_MEMORY) == ZT_FAULT_MEMORY);
  zt_zero_free(&z);
  zt_model_free(m);
}

ZT_TEST_MAIN(failed_create_frees_what_it_allocated,
             load_fault_blames_the_epoch_only_for_its_content)
