/*
 * reach.h: who is cut off (pure logic, no I/O).
 *
 * When a collective fails, every rank of the ring fails with it: the one
 * whose link broke, and the healthy ones waiting on it. Who a rank blames
 * (the peer its failed socket led to) says little: a healthy rank stalled
 * behind a broken one blames its healthy neighbour. So after a peer
 * failure each rank tries to connect to every other rank's replica store
 * and reports the ranks it could not reach (ReportFailure.unreachable_ranks);
 * this module turns those reports into the set of ranks to keep out of the
 * next generation.
 *
 * The reports are edges of a graph ("a cannot reach b" cuts a-b both
 * ways). The verdict removes, one at a time, the rank with the most cut
 * edges among those left (ties: a rank that did not report, i.e. is
 * probably gone, before one that did; then the higher rank) until no cut
 * edge is left. A host that cannot reach the others thus goes, not the
 * ones it accused.
 *
 * A report is decisive on its own when its rank still reaches a majority
 * of the generation (counting itself) and cannot reach some: then the
 * ranks it cannot reach are the ones out. A report that reaches everyone
 * decides nothing alone (the cut may be between two other ranks). A rank
 * whose machine refused the connection (nothing listens) is gone, not cut
 * off: it is out, and the majority is counted among the others, so a
 * survivor of a killed process decides at once even in a two-rank world.
 * A rank that reaches only a minority may be the one cut off, or the
 * survivor of several losses: the verdict waits for the other ranks'
 * reports (all of them, or until a short deadline reports.c sets).
 */
#ifndef ZT_REACH_H
#define ZT_REACH_H

#include <stddef.h>
#include <stdint.h>

#define ZT_REACH_MAX 256 /* ranks (ZT_MAX_WORLD) */

typedef struct {
  uint64_t gen; /* the generation the reports are about (0: none) */
  int world;
  int nreported;
  uint8_t reported[ZT_REACH_MAX / 8];
  uint8_t cut[ZT_REACH_MAX][ZT_REACH_MAX / 8]; /* symmetric */
  uint8_t gone[ZT_REACH_MAX / 8]; /* refused connections: their zworker is gone */
  int ngone;
  /* Set by reports.c while a verdict waits for more reports. */
  int64_t decide_at_ms; /* monotonic; 0: no verdict pending */
  int64_t step;         /* the failed step, and the first report's reason */
  char why[512];
} zt_reach_t;

/* Forgets every report: the next ones are about generation gen. */
void zt_reach_reset(zt_reach_t *r, uint64_t gen, int world);
/* Rank `rank` could not reach the ranks unreach[0..n) (entries out of range
 * or naming itself are ignored). Returns 1 when a verdict can be made now:
 * the report is decisive or every rank has reported. */
int zt_reach_add(zt_reach_t *r, int rank, const uint32_t *unreach, size_t n);
/* Rank `rank` found the ranks gone[0..n) gone (their machine refused the
 * connection: nothing listens), so they will not report; a gone rank is
 * out, and the majority that decides is counted among the others. A rank
 * that reports is not gone. Call before zt_reach_add of the same report. */
void zt_reach_gone(zt_reach_t *r, int rank, const uint32_t *gone, size_t n);
/* The verdict: sets bit k of out (ZT_REACH_MAX / 8 bytes) for each rank k to
 * keep out; returns how many. */
int zt_reach_decide(const zt_reach_t *r, uint8_t *out);
/* The ranks rank `k` has a cut edge with, as "0,2,5" (for the logbook). */
void zt_reach_list(const zt_reach_t *r, int k, char *buf, size_t len);

#endif
