/*
 * test_engine_balance.c: the load balance's plans (engine/balance.h)
 * against every possible plan.
 *
 * For 2 to 4 ranks of random speeds (a spread of up to 20x) and every K
 * from N to 14, each plan is checked to be a plan (every rank at least
 * one, K in all) and its cost compared with the least cost over all
 * compositions of K into N positive parts, by the same cost model:
 *   independent  the plan is optimal (the least maximum);
 *   lockstep     the plan is within one round of the slowest rank of the
 *                optimum (whole micro-batches: the equal parts of its
 *                group round), and on hand-made cases where the answer is
 *                known exactly (two equal ranks: equal shares; a rank far
 *                slower than the rest: one micro-batch).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "balance.h"
#include "zt_test.h"

/* The least cost over all compositions of K into N positive parts. */
static double best_cost(int K, int N, const double *speed, int lockstep, int *s, int i,
                        int left) {
  if (i == N - 1) {
    s[i] = left;
    return zt_balance_ms(N, s, speed, lockstep);
  }
  double best = INFINITY;
  for (int v = 1; v <= left - (N - 1 - i); v++) {
    s[i] = v;
    best = fmin(best, best_cost(K, N, speed, lockstep, s, i + 1, left - v));
  }
  return best;
}

static void check_valid(int K, int N, const int *share) {
  int sum = 0;
  for (int i = 0; i < N; i++) {
    ZT_CHECK(share[i] >= 1);
    sum += share[i];
  }
  ZT_CHECK(sum == K);
}

ZT_TEST(plans_against_every_plan) {
  int cases = 0;
  for (int trial = 0; trial < 40; trial++) {
    int N = 2 + trial % 3;
    double speed[4], tmax = 0;
    for (int i = 0; i < N; i++) {
      speed[i] = 0.05 + 0.95 * (double)(rand() % 1000) / 1000.0;
      tmax = fmax(tmax, 1.0 / speed[i]);
    }
    for (int K = N; K <= 14; K++) {
      for (int lockstep = 0; lockstep < 2; lockstep++) {
        int share[4], s[4];
        zt_balance_plan(K, N, speed, lockstep, share);
        check_valid(K, N, share);
        double got = zt_balance_ms(N, share, speed, lockstep);
        double opt = best_cost(K, N, speed, lockstep, s, 0, K);
        if (!lockstep) ZT_CHECK(got <= opt * (1 + 1e-12));
        else ZT_CHECK(got <= opt + tmax + 1e-9);
        cases++;
      }
    }
  }
  ZT_CHECK(cases > 500);
}

ZT_TEST(known_plans) {
  int share[4];
  /* Equal ranks: equal shares, both ways. */
  double eq[3] = {1, 1, 1};
  for (int lockstep = 0; lockstep < 2; lockstep++) {
    zt_balance_plan(12, 3, eq, lockstep, share);
    ZT_CHECK(share[0] == 4 && share[1] == 4 && share[2] == 4);
  }
  /* One rank at half speed: independent shares 2:1; in lockstep the group
   * of two ties with the fast rank alone, and the larger group wins. */
  double half[2] = {1, 0.5};
  zt_balance_plan(12, 2, half, 0, share);
  ZT_CHECK(share[0] == 8 && share[1] == 4);
  zt_balance_plan(12, 2, half, 1, share);
  ZT_CHECK(share[0] == 6 && share[1] == 6);
  /* Two fast ranks and a slow one in lockstep: the slow one keeps one. */
  double two_fast[3] = {1, 0.5, 1};
  zt_balance_plan(48, 3, two_fast, 1, share);
  ZT_CHECK(share[1] == 1 && share[0] + share[2] == 47 && abs(share[0] - share[2]) <= 1);
  ZT_CHECK(zt_balance_ms(3, share, two_fast, 1) < zt_balance_ms(3, (int[]){16, 16, 16},
                                                                two_fast, 1));
  /* A rank 40x slower than the other: one micro-batch, both ways. */
  double slow[2] = {1, 1.0 / 40};
  for (int lockstep = 0; lockstep < 2; lockstep++) {
    zt_balance_plan(12, 2, slow, lockstep, share);
    ZT_CHECK(share[0] == 11 && share[1] == 1);
  }
  /* Costs: independent is the slowest rank's time, lockstep the rounds'. */
  ZT_CHECK(fabs(zt_balance_ms(2, (int[]){8, 4}, half, 0) - 8.0) < 1e-12);
  ZT_CHECK(fabs(zt_balance_ms(2, (int[]){8, 4}, half, 1) - (4 * 2.0 + 4 * 1.0)) < 1e-12);
}

ZT_TEST_MAIN(plans_against_every_plan, known_plans)
