/*
 * test_reach.c: the verdict on who is cut off (coordinator/reach.c), on
 * the report patterns a ring produces: one host cut off from all others
 * (whoever reports first, the healthy ones are never out), a host that is
 * simply gone, two hosts gone at once (the survivors, who reach only a
 * minority, are not out), a two-rank world, reports naming nonsense ranks.
 */
#include <stdint.h>
#include <string.h>

#include "reach.h"
#include "zt_test.h"

static int out_bit(const uint8_t *out, int k) { return (out[k / 8] >> (k % 8)) & 1; }

/* Verdict as a bit string over world ranks: "001" = rank 2 out. */
static const char *verdict(const zt_reach_t *r) {
  static char s[ZT_REACH_MAX + 1];
  uint8_t out[ZT_REACH_MAX / 8];
  zt_reach_decide(r, out);
  for (int k = 0; k < r->world; k++) s[k] = out_bit(out, k) ? '1' : '0';
  s[r->world] = 0;
  return s;
}

ZT_TEST(test_cut_off_host_reporting_first_waits_then_goes) {
  /* Rank 2 cannot reach 0 or 1, and reports first: not decisive (it
   * reaches a minority), and it would be out already on its own report. */
  zt_reach_t r;
  zt_reach_reset(&r, 5, 3);
  uint32_t u2[] = {0, 1};
  ZT_CHECK(!zt_reach_add(&r, 2, u2, 2));
  ZT_CHECK(strcmp(verdict(&r), "001") == 0);
  /* A healthy rank's report is decisive, and agrees. */
  uint32_t u0[] = {2};
  ZT_CHECK(zt_reach_add(&r, 0, u0, 1));
  ZT_CHECK(strcmp(verdict(&r), "001") == 0);
}

ZT_TEST(test_healthy_host_reporting_first_is_decisive) {
  zt_reach_t r;
  zt_reach_reset(&r, 1, 3);
  uint32_t u1[] = {2};
  ZT_CHECK(zt_reach_add(&r, 1, u1, 1));
  ZT_CHECK(strcmp(verdict(&r), "001") == 0);
}

ZT_TEST(test_nothing_unreachable_keeps_everyone) {
  /* A rank that reaches everyone does not decide alone; when all reported
   * nothing, nobody is out. */
  zt_reach_t r;
  zt_reach_reset(&r, 1, 3);
  ZT_CHECK(!zt_reach_add(&r, 2, NULL, 0));
  ZT_CHECK(!zt_reach_add(&r, 0, NULL, 0));
  ZT_CHECK(zt_reach_add(&r, 1, NULL, 0));
  ZT_CHECK(strcmp(verdict(&r), "000") == 0);
}

ZT_TEST(test_one_link_cut_healthy_reporter_waits) {
  /* World 3, the link 0-2 cut. Rank 1 reaches both and reports first: no
   * verdict yet (it would keep everyone). Rank 0 then names 2: decisive,
   * one of the two ends is out, never rank 1. */
  zt_reach_t r;
  zt_reach_reset(&r, 1, 3);
  ZT_CHECK(!zt_reach_add(&r, 1, NULL, 0));
  uint32_t u0[] = {2};
  ZT_CHECK(zt_reach_add(&r, 0, u0, 1));
  const char *v = verdict(&r);
  ZT_CHECK(strcmp(v, "001") == 0 || strcmp(v, "100") == 0);
}

ZT_TEST(test_two_hosts_gone_survivors_stay) {
  /* World 4, ranks 2 and 3 gone: 0 and 1 each reach only half. Neither
   * report decides; the verdict (at the deadline) removes the silent ones. */
  zt_reach_t r;
  zt_reach_reset(&r, 1, 4);
  uint32_t u[] = {2, 3};
  ZT_CHECK(!zt_reach_add(&r, 0, u, 2));
  ZT_CHECK(!zt_reach_add(&r, 1, u, 2));
  ZT_CHECK(strcmp(verdict(&r), "0011") == 0);
}

ZT_TEST(test_two_ranks_partitioned) {
  zt_reach_t r;
  zt_reach_reset(&r, 1, 2);
  uint32_t u0[] = {1};
  /* Alone, rank 0 reaching only itself of two is no majority: wait. */
  ZT_CHECK(!zt_reach_add(&r, 0, u0, 1));
  ZT_CHECK(strcmp(verdict(&r), "01") == 0); /* the silent one goes */
  uint32_t u1[] = {0};
  ZT_CHECK(zt_reach_add(&r, 1, u1, 1)); /* everyone reported */
  const char *v = verdict(&r);
  ZT_CHECK(strcmp(v, "01") == 0 || strcmp(v, "10") == 0); /* exactly one */
}

ZT_TEST(test_two_ranks_peer_gone_decides_at_once) {
  /* Rank 1's zworker was killed: its machine refuses the connection. The
   * survivor alone decides, and only the gone rank is out. */
  zt_reach_t r;
  zt_reach_reset(&r, 1, 2);
  uint32_t u0[] = {1};
  zt_reach_gone(&r, 0, u0, 1);
  ZT_CHECK(zt_reach_add(&r, 0, u0, 1));
  ZT_CHECK(strcmp(verdict(&r), "01") == 0);
}

ZT_TEST(test_gone_claims_checked) {
  /* World 4, rank 3 killed, rank 2 cut off (silent): rank 0 reaches 2 of
   * the 3 ranks left (itself and 1), a majority: decisive; 2 and 3 out. */
  zt_reach_t r;
  zt_reach_reset(&r, 1, 4);
  uint32_t u0[] = {2, 3}, g0[] = {3};
  zt_reach_gone(&r, 0, g0, 1);
  ZT_CHECK(zt_reach_add(&r, 0, u0, 2));
  ZT_CHECK(strcmp(verdict(&r), "0011") == 0);
  /* Claims of itself, out of range, or of a rank that reported are ignored;
   * a rank called gone that then reports is not gone. */
  zt_reach_reset(&r, 1, 3);
  ZT_CHECK(!zt_reach_add(&r, 1, NULL, 0));
  uint32_t bad[] = {0, 1, 7, 0xffffffffu};
  zt_reach_gone(&r, 0, bad, 4);
  ZT_CHECK(r.ngone == 0);
  uint32_t g2[] = {2};
  zt_reach_gone(&r, 0, g2, 1);
  ZT_CHECK(r.ngone == 1);
  ZT_CHECK(!zt_reach_add(&r, 2, NULL, 0)); /* 2 of 3 reported */
  ZT_CHECK(r.ngone == 0 && strcmp(verdict(&r), "000") == 0);
}

ZT_TEST(test_larger_ring_one_host_cut_off) {
  /* World 8, rank 5 cut off; every healthy rank's report is decisive. */
  zt_reach_t r;
  zt_reach_reset(&r, 1, 8);
  uint32_t u5[] = {0, 1, 2, 3, 4, 6, 7};
  ZT_CHECK(!zt_reach_add(&r, 5, u5, 7));
  uint32_t u[] = {5};
  for (int k = 0; k < 8; k++)
    if (k != 5) zt_reach_add(&r, k, u, 1);
  ZT_CHECK(strcmp(verdict(&r), "00000100") == 0);
}

ZT_TEST(test_bad_ranks_ignored) {
  zt_reach_t r;
  zt_reach_reset(&r, 1, 3);
  uint32_t u[] = {1, 7, 300, 0xffffffffu};
  ZT_CHECK(!zt_reach_add(&r, 1, u, 4)); /* only itself named: nothing cut, no verdict */
  ZT_CHECK(strcmp(verdict(&r), "000") == 0);
  ZT_CHECK(!zt_reach_add(&r, -1, u, 1) && !zt_reach_add(&r, 3, u, 1));
  char list[64];
  uint32_t u2[] = {0};
  zt_reach_add(&r, 2, u2, 1);
  zt_reach_list(&r, 0, list, sizeof list);
  ZT_CHECK(strcmp(list, "2") == 0);
  /* A world beyond the limit is clamped, not overrun. */
  zt_reach_reset(&r, 1, 100000);
  ZT_CHECK(r.world == ZT_REACH_MAX);
}

ZT_TEST_MAIN(test_cut_off_host_reporting_first_waits_then_goes,
             test_healthy_host_reporting_first_is_decisive, test_nothing_unreachable_keeps_everyone,
             test_two_hosts_gone_survivors_stay, test_two_ranks_partitioned,
             test_two_ranks_peer_gone_decides_at_once, test_gone_claims_checked,
             test_one_link_cut_healthy_reporter_waits,
             test_larger_ring_one_host_cut_off, test_bad_ranks_ignored)
