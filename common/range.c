/*
 * range.c: sorted lists of half-open ranges of sample-stream positions.
 *
 * The data a rollback skips is a list of such ranges (zt_range_list_t),
 * stored with the job by the coordinator and handed to every rank, which
 * maps a logical position to a stream position with zt_range_map(). The
 * list has a fixed capacity, ZT_MAX_SKIP_RANGES; adding to a full list is
 * an error the caller reports.
 */
#include <string.h>

#include "zt_common.h"

int zt_range_list_add(zt_range_list_t *l, uint64_t start, uint64_t end) {
  if (end <= start) return 0;
  /* Ranges that touch or overlap [start, end) are merged into it. */
  int lo = 0;
  while (lo < l->n && l->r[lo].end < start) lo++;
  int hi = lo;
  while (hi < l->n && l->r[hi].start <= end) {
    start = ZT_MIN(start, l->r[hi].start);
    end = ZT_MAX(end, l->r[hi].end);
    hi++;
  }
  int n = l->n - (hi - lo) + 1;
  if (n > ZT_MAX_SKIP_RANGES)
    return zt_errk(ZT_E_TOO_LARGE, "too many skip ranges (the limit is %d)", ZT_MAX_SKIP_RANGES);
  memmove(&l->r[lo + 1], &l->r[hi], (size_t)(l->n - hi) * sizeof l->r[0]);
  l->r[lo] = (zt_range_t){start, end};
  l->n = n;
  return 0;
}

uint64_t zt_range_map(const zt_range_t *skips, int n, uint64_t q) {
  uint64_t p = q;
  for (int i = 0; i < n && skips[i].start <= p; i++) p += skips[i].end - skips[i].start;
  return p;
}
