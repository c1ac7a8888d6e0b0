/*
 * data.c: shard validation and mapping, sample order, batch filling.
 *
 * See data.h for the format and the order formulas. Implementation notes:
 *
 *   - Each shard is mmap'ed; cum[i] is the stream offset of shard i's first
 *     token, so a token's shard is found by binary search.
 *   - The permutation of an epoch is computed on demand (O(n_samples)) and
 *     cached; two slots are kept because a batch can straddle two epochs.
 *   - Tokens are little-endian uint16 on disk, as llm.c writes them (or
 *     uint32 in version 2); the loader converts explicitly so it also
 *     works on big-endian hosts.
 */
#include "data.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rng.h"
#include "zt_common.h"

typedef struct zt_shard {
  char *path;
  const uint8_t *map; /* whole file */
  size_t map_len;
  uint64_t count; /* tokens */
  int width;      /* bytes per token: 2 (version 1) or 4 (version 2) */
} zt_shard_t;

typedef struct zt_perm {
  int64_t epoch; /* -1: empty slot */
  uint32_t *idx; /* [n_samples] */
} zt_perm_t;

struct zt_data {
  zt_shard_t *shards;
  int nshards;
  uint64_t *cum; /* [nshards + 1] */
  uint64_t total;
  uint64_t nsamples;
  int T, vocab;
  uint64_t seed;
  zt_range_t *skips;
  int nskips;
  zt_perm_t perm[2];
  int perm_next; /* slot to evict next */
};

/* ---- paths ---------------------------------------------------------------- */

int zt_data_glob(const char *pattern, char ***paths, int *npaths) {
  glob_t g;
  *paths = NULL;
  *npaths = 0;
  int rc = glob(pattern, 0, NULL, &g);
  if (rc == GLOB_NOMATCH) return zt_err("%s: no file matches", pattern);
  if (rc != 0) return zt_err("%s: glob failed", pattern);
  char **out = zt_xcalloc(g.gl_pathc, sizeof(char *));
  for (size_t i = 0; i < g.gl_pathc; i++) out[i] = zt_xstrdup(g.gl_pathv[i]);
  *paths = out;
  *npaths = (int)g.gl_pathc;
  globfree(&g);
  return 0;
}

void zt_data_free_paths(char **paths, int npaths) {
  if (!paths) return;
  for (int i = 0; i < npaths; i++) free(paths[i]);
  free(paths);
}

/* ---- shards --------------------------------------------------------------- */

static int32_t read_le32(const uint8_t *p) {
  return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                   (uint32_t)p[3] << 24);
}

/* Maps and validates one shard; errors name the file. */
static int shard_open(zt_shard_t *s, const char *path) {
  memset(s, 0, sizeof *s);
  s->path = zt_xstrdup(path);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return zt_err_errno("%s", path);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    zt_err_errno("%s", path);
    close(fd);
    return -1;
  }
  size_t len = (size_t)st.st_size;
  if (len < ZT_SHARD_HEADER_BYTES) {
    close(fd);
    return zt_err("%s: truncated header (%zu bytes, need %d)", path, len, ZT_SHARD_HEADER_BYTES);
  }
  void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) return zt_err_errno("%s: mmap", path);
  s->map = map;
  s->map_len = len;
  int32_t magic = read_le32(s->map), version = read_le32(s->map + 4);
  int32_t count = read_le32(s->map + 8);
  if (magic != ZT_SHARD_MAGIC)
    return zt_errk(ZT_E_INVALID, "%s: not a token shard (its header does not start with the "
                                 "shard magic number)", path);
  if (version != ZT_SHARD_VERSION && version != ZT_SHARD_VERSION_U32)
    return zt_errk(ZT_E_INVALID, "%s: unsupported shard version %d (expected %d: 16-bit "
                   "tokens, or %d: 32-bit tokens)", path, version, ZT_SHARD_VERSION,
                   ZT_SHARD_VERSION_U32);
  if (count < 0) return zt_errk(ZT_E_INVALID, "%s: negative token count in the header", path);
  s->width = version == ZT_SHARD_VERSION ? 2 : 4;
  size_t want = ZT_SHARD_HEADER_BYTES + (size_t)s->width * (size_t)count;
  if (len != want)
    return zt_err("%s: size mismatch: header says %d tokens of %d bytes (%zu bytes), file "
                  "has %zu bytes", path, count, s->width, want, len);
  s->count = (uint64_t)count;
  return 0;
}

static void shard_close(zt_shard_t *s) {
  if (s->map) munmap((void *)s->map, s->map_len);
  free(s->path);
}

/* ---- open / close --------------------------------------------------------- */

int zt_data_open(zt_data_t **out, char *const *paths, int npaths, int T, int vocab_size,
                 uint64_t seed) {
  *out = NULL;
  if (npaths < 1) return zt_err("no shard files");
  if (T < 1) return zt_err("sequence length must be >= 1");
  zt_data_t *d = zt_xcalloc(1, sizeof *d);
  d->T = T;
  d->vocab = vocab_size;
  d->seed = seed;
  d->perm[0].epoch = d->perm[1].epoch = -1;
  d->shards = zt_xcalloc((size_t)npaths, sizeof(zt_shard_t));
  d->cum = zt_xcalloc((size_t)npaths + 1, sizeof(uint64_t));
  for (int i = 0; i < npaths; i++) {
    d->nshards = i + 1;
    if (shard_open(&d->shards[i], paths[i]) != 0) goto err;
    d->cum[i + 1] = d->cum[i] + d->shards[i].count;
  }
  d->total = d->cum[npaths];
  if (d->total < (uint64_t)T + 1) {
    zt_err("%s%s: only %llu tokens, need at least T + 1 = %d", paths[0],
           npaths > 1 ? " (and others)" : "", (unsigned long long)d->total, T + 1);
    goto err;
  }
  d->nsamples = (d->total - 1) / (uint64_t)T;
  if (d->nsamples > UINT32_MAX) {
    zt_err("too many samples (%llu)", (unsigned long long)d->nsamples);
    goto err;
  }
  *out = d;
  return 0;
err:
  zt_data_close(d);
  return -1;
}

int zt_data_open_glob(zt_data_t **out, const char *pattern, int T, int vocab_size,
                      uint64_t seed) {
  char **paths;
  int n;
  if (zt_data_glob(pattern, &paths, &n) != 0) return -1;
  int rc = zt_data_open(out, paths, n, T, vocab_size, seed);
  zt_data_free_paths(paths, n);
  return rc;
}

void zt_data_close(zt_data_t *d) {
  if (!d) return;
  for (int i = 0; i < d->nshards; i++) shard_close(&d->shards[i]);
  free(d->shards);
  free(d->cum);
  free(d->skips);
  free(d->perm[0].idx);
  free(d->perm[1].idx);
  free(d);
}

uint64_t zt_data_num_tokens(const zt_data_t *d) { return d->total; }
uint64_t zt_data_num_samples(const zt_data_t *d) { return d->nsamples; }

/* ---- skip ranges ---------------------------------------------------------- */

static int range_cmp(const void *a, const void *b) {
  const zt_range_t *x = a, *y = b;
  if (x->start != y->start) return x->start < y->start ? -1 : 1;
  return x->end < y->end ? -1 : (x->end > y->end);
}

int zt_data_set_skips(zt_data_t *d, const zt_range_t *ranges, int n) {
  zt_range_t *r = NULL;
  int m = 0;
  if (n > 0) {
    r = zt_xmalloc(sizeof(zt_range_t) * (size_t)n);
    for (int i = 0; i < n; i++)
      if (ranges[i].end > ranges[i].start) r[m++] = ranges[i];
    qsort(r, (size_t)m, sizeof *r, range_cmp);
    /* Merge overlapping or touching ranges. */
    int k = 0;
    for (int i = 0; i < m; i++) {
      if (k > 0 && r[i].start <= r[k - 1].end) {
        if (r[i].end > r[k - 1].end) r[k - 1].end = r[i].end;
      } else {
        r[k++] = r[i];
      }
    }
    m = k;
  }
  free(d->skips);
  d->skips = r;
  d->nskips = m;
  return 0;
}

uint64_t zt_data_stream_pos(const zt_data_t *d, uint64_t q) {
  return zt_range_map(d->skips, d->nskips, q);
}

/* ---- permutation ---------------------------------------------------------- */

static uint32_t *perm_for_epoch(zt_data_t *d, uint64_t epoch) {
  for (int i = 0; i < 2; i++)
    if (d->perm[i].epoch == (int64_t)epoch) return d->perm[i].idx;
  zt_perm_t *slot = &d->perm[d->perm_next];
  d->perm_next ^= 1;
  if (!slot->idx) slot->idx = zt_xmalloc(sizeof(uint32_t) * d->nsamples);
  uint32_t *idx = slot->idx;
  uint64_t n = d->nsamples;
  for (uint64_t i = 0; i < n; i++) idx[i] = (uint32_t)i;
  zt_rng_t r;
  zt_rng_seed(&r, d->seed, epoch);
  for (uint64_t i = n - 1; i > 0; i--) {
    uint64_t j = zt_rng_below(&r, i + 1);
    uint32_t t = idx[i];
    idx[i] = idx[j];
    idx[j] = t;
  }
  slot->epoch = (int64_t)epoch;
  return idx;
}

int zt_data_sample_at(zt_data_t *d, uint64_t p, uint64_t *sample) {
  uint32_t *idx = perm_for_epoch(d, p / d->nsamples);
  *sample = idx[p % d->nsamples];
  return 0;
}

/* ---- reading samples ------------------------------------------------------ */

/* Index of the shard holding stream token `pos` (pos < total). */
static int shard_of(const zt_data_t *d, uint64_t pos) {
  int lo = 0, hi = d->nshards - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (d->cum[mid] <= pos) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/* Copies sample k (T + 1 tokens from k * T) into inputs/targets [T]. */
static int read_sample(zt_data_t *d, uint64_t k, int *inputs, int *targets) {
  uint64_t pos = k * (uint64_t)d->T;
  int si = shard_of(d, pos);
  for (int i = 0; i <= d->T; i++, pos++) {
    while (pos >= d->cum[si + 1]) si++;
    const zt_shard_t *s = &d->shards[si];
    const uint8_t *p = s->map + ZT_SHARD_HEADER_BYTES + (size_t)s->width * (pos - d->cum[si]);
    int64_t tok = p[0] | p[1] << 8;
    if (s->width == 4) tok = (uint32_t)read_le32(p);
    if (tok > ZT_SHARD_MAX_TOKEN)
      return zt_err("%s: token %lld at index %llu is larger than any token id (%d)", s->path,
                    (long long)tok, (unsigned long long)(pos - d->cum[si]), ZT_SHARD_MAX_TOKEN);
    if (d->vocab > 0 && tok >= d->vocab)
      return zt_err("%s: token %lld at index %llu is >= vocab_size %d", s->path, (long long)tok,
                    (unsigned long long)(pos - d->cum[si]), d->vocab);
    if (i < d->T) inputs[i] = (int)tok;
    if (i > 0) targets[i - 1] = (int)tok;
  }
  return 0;
}

int zt_data_fill(zt_data_t *d, uint64_t q0, int n, int *inputs, int *targets) {
  for (int i = 0; i < n; i++) {
    uint64_t k = 0;
    if (zt_data_sample_at(d, zt_data_stream_pos(d, q0 + (uint64_t)i), &k) != 0) return -1;
    size_t o = (size_t)i * d->T;
    if (read_sample(d, k, inputs + o, targets + o) != 0) return -1;
  }
  return 0;
}

int zt_data_fill_seq(zt_data_t *d, uint64_t k0, int n, int *inputs, int *targets) {
  if (k0 + (uint64_t)n > d->nsamples)
    return zt_err("samples [%llu, %llu) requested, the data has %llu",
                  (unsigned long long)k0, (unsigned long long)(k0 + (uint64_t)n),
                  (unsigned long long)d->nsamples);
  for (int i = 0; i < n; i++) {
    size_t o = (size_t)i * d->T;
    if (read_sample(d, k0 + (uint64_t)i, inputs + o, targets + o) != 0) return -1;
  }
  return 0;
}
