/*
 * balance.c: the load balance's plans (see balance.h).
 */
#include "balance.h"

#include <math.h>

#include "zt_common.h"

/* balance.h, independent. Handing out micro-batches one at a time, each to
 * the rank that would finish it first (ties: the lower rank), from one
 * each, gives the least maximum. It starts further on: with
 * T = (K - N) / (sum of speeds), rank i's max(1, floor(T speed_i)) is no
 * more than that greedy gives it (a rank short of it would have been
 * offered a micro-batch costing at most T, while all ranks together hold no
 * more than N + T sum = K), so at most about 2N are handed out one by one. */
static void plan_independent(int K, int N, const double *speed, int *share) {
  double tot = 0;
  int used = 0;
  for (int i = 0; i < N; i++) tot += speed[i];
  for (int i = 0; i < N; i++) {
    double x = (double)(K - N) * speed[i] / tot * (1.0 - 1e-12); /* never rounded up */
    share[i] = x >= 1.0 ? (int)floor(x) : 1;
    used += share[i];
  }
  while (used < K) {
    int best = 0;
    for (int i = 1; i < N; i++)
      if ((share[i] + 1) / speed[i] < (share[best] + 1) / speed[best]) best = i;
    share[best]++, used++;
  }
}

/* The ranks 0..N-1 in order of key[], ascending (insertion sort: N is at
 * most ZT_LB_MAX_RANKS, and a plan is rare); ties keep rank order. */
static void order_by(int N, const double *key, int *o) {
  for (int i = 0; i < N; i++) {
    int j = i;
    for (; j > 0 && key[o[j - 1]] > key[i]; j--) o[j] = o[j - 1];
    o[j] = i;
  }
}

/* balance.h, lockstep. Ranks ordered fastest first, a plan whose shares
 * fall with speed gives rank q s_q = d_q + d_{q+1} + ... micro-batches and
 * costs sum d_q t_q, for sum d_q (q + 1) = K: each micro-batch spent on the
 * q + 1 fastest costs t_q / (q + 1), so all of them beyond the one each
 * go to the group with the least. */
static void plan_lockstep(int K, int N, const double *speed, int *share) {
  int o[ZT_LB_MAX_RANKS], best = 0;
  double t[ZT_LB_MAX_RANKS] = {0};
  for (int i = 0; i < N; i++) t[i] = 1.0 / speed[i];
  order_by(N, t, o);
  for (int q = 1; q < N; q++)
    if (t[o[q]] / (q + 1) <= t[o[best]] / (best + 1)) best = q;
  int rest = K - N, each = rest / (best + 1), left = rest % (best + 1);
  for (int q = 0; q < N; q++) share[o[q]] = 1 + (q <= best ? each : 0) + (q < left ? 1 : 0);
}

double zt_balance_ms(int N, const int *share, const double *speed, int lockstep) {
  double w = 0;
  if (!lockstep) {
    for (int i = 0; i < N; i++) w = ZT_MAX(w, share[i] / speed[i]);
    return w;
  }
  int o[ZT_LB_MAX_RANKS];
  double neg[ZT_LB_MAX_RANKS] = {0}, slowest = 0;
  for (int i = 0; i < N; i++) neg[i] = -(double)share[i];
  order_by(N, neg, o); /* most micro-batches first */
  for (int k = 0; k < N; k++) {
    slowest = ZT_MAX(slowest, 1.0 / speed[o[k]]);
    w += (share[o[k]] - (k + 1 < N ? share[o[k + 1]] : 0)) * slowest;
  }
  return w;
}

void zt_balance_plan(int K, int N, const double *speed, int lockstep, int *share) {
  if (lockstep) plan_lockstep(K, N, speed, share);
  else plan_independent(K, N, speed, share);
}
