/*
 * test_restarts.c: the restart policy with made-up clocks: a local error
 * that repeats at the same step pauses (or, from the same worker, keeps
 * that worker out), one at another step does not;
 * transient failures re-form at once, then with doubling delays capped at
 * the maximum, and pause after max_failed_generations in a row; progress
 * ends the streak; the window budget counts failures across streaks and
 * starts afresh in the next window.
 */
#include <string.h>

#include "restarts.h"
#include "zt_test.h"

static const zt_spec_restart_t k_pol = {.max_failed_generations = 5, .backoff_ms = 100,
                                        .max_backoff_ms = 250, .max_restarts = 6,
                                        .restart_window_s = 60};

static zt_restart_verdict_t fail(zt_restarts_t *r, zt_fail_kind_t k, int64_t step,
                                 const char *why, int64_t now, int64_t *delay) {
  char msg[512];
  return zt_restarts_decide(r, &k_pol, k, step, why, 0, now, delay, msg, sizeof msg);
}

ZT_TEST(test_same_local_error_twice_pauses) {
  zt_restarts_t r;
  zt_restarts_reset(&r);
  int64_t d;
  char why[512];
  ZT_CHECK(fail(&r, ZT_FAIL_LOCAL, 7, "shard a: token 300 at 12 >= vocab_size 257", 1, &d) ==
           ZT_RESTART_NOW);
  zt_restarts_progress(&r); /* progress does not make a data error transient */
  ZT_CHECK(zt_restarts_decide(&r, &k_pol, ZT_FAIL_LOCAL, 7,
                              "shard a: token 301 at 40 >= vocab_size 257", 0, 2, &d, why,
                              sizeof why) == ZT_RESTART_PAUSE);
  ZT_CHECK(strstr(why, "twice at step 7") != NULL && strstr(why, "vocab_size") != NULL);
  /* The same error at another step, or another error at the same step: retried. */
  zt_restarts_reset(&r);
  ZT_CHECK(fail(&r, ZT_FAIL_LOCAL, 7, "disk read error", 1, &d) == ZT_RESTART_NOW);
  zt_restarts_progress(&r);
  ZT_CHECK(fail(&r, ZT_FAIL_LOCAL, 9, "disk read error", 2, &d) == ZT_RESTART_NOW);
  zt_restarts_progress(&r);
  ZT_CHECK(fail(&r, ZT_FAIL_LOCAL, 9, "device lost", 3, &d) == ZT_RESTART_NOW);
  /* Peer failures never count as deterministic. */
  zt_restarts_reset(&r);
  for (int i = 0; i < 3; i++) {
    ZT_CHECK(fail(&r, ZT_FAIL_PEER, 7, "peer closed", 1, &d) != ZT_RESTART_PAUSE);
    zt_restarts_progress(&r);
  }
}

/* The same local error twice at one step: from the same worker, that
 * worker is at fault (EXCLUDE: the scheduler goes on without it); from two
 * workers, the job is (PAUSE). */
ZT_TEST(test_same_local_error_from_one_worker_excludes_it) {
  zt_restarts_t r;
  zt_restarts_reset(&r);
  int64_t d;
  char why[512];
  const char *e = "train: no file matches /data/train_*.bin";
  ZT_CHECK(zt_restarts_decide(&r, &k_pol, ZT_FAIL_LOCAL, 0, e, 7, 1, &d, why, sizeof why) ==
           ZT_RESTART_NOW);
  ZT_CHECK(zt_restarts_decide(&r, &k_pol, ZT_FAIL_LOCAL, 0, e, 7, 2, &d, why, sizeof why) ==
           ZT_RESTART_EXCLUDE);
  ZT_CHECK(strstr(why, "twice at step 0") != NULL && strstr(why, "no file matches") != NULL);
  /* Without it, another worker fails the same way: the job is at fault. */
  ZT_CHECK(zt_restarts_decide(&r, &k_pol, ZT_FAIL_LOCAL, 0, e, 8, 3, &d, why, sizeof why) ==
           ZT_RESTART_PAUSE);
  /* Out of memory twice on one worker: the same. */
  zt_restarts_reset(&r);
  ZT_CHECK(zt_restarts_decide(&r, &k_pol, ZT_FAIL_MEMORY, 5, "out of memory", 9, 1, &d, why,
                              sizeof why) == ZT_RESTART_NOW);
  ZT_CHECK(zt_restarts_decide(&r, &k_pol, ZT_FAIL_MEMORY, 5, "out of memory", 9, 2, &d, why,
                              sizeof why) == ZT_RESTART_EXCLUDE);
  /* No worker named: never excluded. */
  zt_restarts_reset(&r);
  ZT_CHECK(fail(&r, ZT_FAIL_LOCAL, 3, e, 1, &d) == ZT_RESTART_NOW);
  ZT_CHECK(fail(&r, ZT_FAIL_LOCAL, 3, e, 2, &d) == ZT_RESTART_PAUSE);
}

ZT_TEST(test_backoff_doubles_caps_and_pauses) {
  zt_restarts_t r;
  zt_restarts_reset(&r);
  int64_t d, want[] = {0, 100, 200, 250};
  for (int i = 0; i < 4; i++) {
    zt_restart_verdict_t v = fail(&r, ZT_FAIL_PEER, 1, "ring broke", 10 + i, &d);
    ZT_CHECK(v == (i == 0 ? ZT_RESTART_NOW : ZT_RESTART_LATER));
    ZT_CHECK(d == want[i]);
  }
  char why[512];
  ZT_CHECK(zt_restarts_decide(&r, &k_pol, ZT_FAIL_LOST, 1, "worker w3 was lost", 0, 20, &d, why,
                              sizeof why) == ZT_RESTART_PAUSE);
  ZT_CHECK(strstr(why, "5 generations in a row") != NULL && strstr(why, "w3") != NULL);
}

ZT_TEST(test_progress_ends_the_streak) {
  zt_restarts_t r;
  zt_restarts_reset(&r);
  int64_t d;
  ZT_CHECK(fail(&r, ZT_FAIL_PEER, 1, "x", 1, &d) == ZT_RESTART_NOW);
  ZT_CHECK(fail(&r, ZT_FAIL_PEER, 1, "x", 2, &d) == ZT_RESTART_LATER);
  zt_restarts_progress(&r);
  ZT_CHECK(fail(&r, ZT_FAIL_PEER, 5, "x", 3, &d) == ZT_RESTART_NOW && d == 0);
}

ZT_TEST(test_window_budget) {
  zt_restarts_t r;
  zt_restarts_reset(&r);
  int64_t d;
  /* Six failures with progress between them fit the window of 60 s ... */
  for (int i = 0; i < 6; i++) {
    ZT_CHECK(fail(&r, ZT_FAIL_PEER, 1, "x", 1000 + i, &d) == ZT_RESTART_NOW);
    zt_restarts_progress(&r);
  }
  /* ... the seventh does not ... */
  char why[512];
  ZT_CHECK(zt_restarts_decide(&r, &k_pol, ZT_FAIL_PEER, 1, "x", 0, 2000, &d, why, sizeof why) ==
           ZT_RESTART_PAUSE);
  ZT_CHECK(strstr(why, "elastic.max_restarts 6") != NULL);
  /* ... and the next window starts afresh. */
  zt_restarts_reset(&r);
  for (int i = 0; i < 6; i++) {
    ZT_CHECK(fail(&r, ZT_FAIL_PEER, 1, "x", 1000 + i, &d) == ZT_RESTART_NOW);
    zt_restarts_progress(&r);
  }
  ZT_CHECK(fail(&r, ZT_FAIL_PEER, 1, "x", 1000 + 61000, &d) == ZT_RESTART_NOW);
}

ZT_TEST_MAIN(test_same_local_error_twice_pauses, test_same_local_error_from_one_worker_excludes_it,
             test_backoff_doubles_caps_and_pauses, test_progress_ends_the_streak,
             test_window_budget)
