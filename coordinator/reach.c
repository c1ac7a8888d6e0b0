/*
 * reach.c: who is cut off; the verdict over the ranks' reachability
 * reports after a peer failure. See reach.h for the rule and why.
 */
#include "reach.h"

#include <stdio.h>
#include <string.h>

static int bit(const uint8_t *m, int k) { return (m[k / 8] >> (k % 8)) & 1; }
static void set_bit(uint8_t *m, int k) { m[k / 8] |= (uint8_t)(1u << (k % 8)); }

void zt_reach_reset(zt_reach_t *r, uint64_t gen, int world) {
  memset(r, 0, sizeof *r);
  r->gen = gen;
  r->world = world < 0 ? 0 : world > ZT_REACH_MAX ? ZT_REACH_MAX : world;
}

void zt_reach_gone(zt_reach_t *r, int rank, const uint32_t *gone, size_t n) {
  if (rank < 0 || rank >= r->world) return;
  for (size_t i = 0; i < n; i++) {
    int k = (int)gone[i];
    if (gone[i] >= (uint32_t)r->world || k == rank || bit(r->reported, k) || bit(r->gone, k))
      continue; /* out of range, itself, or a rank that reported: not gone */
    set_bit(r->gone, k);
    r->ngone++;
  }
}

int zt_reach_add(zt_reach_t *r, int rank, const uint32_t *unreach, size_t n) {
  if (rank < 0 || rank >= r->world) return 0;
  if (bit(r->gone, rank)) { /* said to be gone, yet it reports: it is not */
    r->gone[rank / 8] &= (uint8_t)~(1u << (rank % 8));
    r->ngone--;
  }
  for (size_t i = 0; i < n; i++) {
    int k = (int)unreach[i];
    if (unreach[i] >= (uint32_t)r->world || k == rank || bit(r->cut[rank], k)) continue;
    set_bit(r->cut[rank], k);
    set_bit(r->cut[k], rank);
  }
  if (!bit(r->reported, rank)) {
    set_bit(r->reported, rank);
    r->nreported++;
  }
  /* Ranks this one still reaches, itself included, among those not gone:
   * a majority of them decides, when it names someone. A rank that reaches
   * every other says nothing of the others' links (one link between two
   * other ranks may be cut): the verdict waits for their reports. */
  int living = r->world - r->ngone, reach = living, named = 0;
  for (int k = 0; k < r->world; k++) {
    reach -= !bit(r->gone, k) && bit(r->cut[rank], k);
    named |= bit(r->cut[rank], k);
  }
  return (named && 2 * reach > living) || r->nreported >= living;
}

int zt_reach_decide(const zt_reach_t *r, uint8_t *out) {
  memset(out, 0, ZT_REACH_MAX / 8);
  int removed = 0;
  for (int k = 0; k < r->world; k++)
    if (bit(r->gone, k)) set_bit(out, k), removed++;
  for (;;) {
    int best = -1, best_deg = 0, best_reported = 1;
    for (int a = 0; a < r->world; a++) {
      if (bit(out, a)) continue;
      int deg = 0;
      for (int b = 0; b < r->world; b++) deg += !bit(out, b) && bit(r->cut[a], b);
      int rep = bit(r->reported, a);
      if (deg > best_deg || (deg == best_deg && deg > 0 && rep <= best_reported))
        best = a, best_deg = deg, best_reported = rep;
    }
    if (best < 0 || best_deg == 0) return removed;
    set_bit(out, best);
    removed++;
  }
}

void zt_reach_list(const zt_reach_t *r, int k, char *buf, size_t len) {
  size_t o = 0;
  buf[0] = 0;
  for (int b = 0; b < r->world && o + 8 < len; b++)
    if (bit(r->cut[k], b)) o += (size_t)snprintf(buf + o, len - o, "%s%d", o ? "," : "", b);
}
