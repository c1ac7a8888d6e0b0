/*
 * shards.c: token shard files, mapped read-only, and the sample order
 * (see shards.h).
 *
 * Shards are mmap'ed; a sample that straddles two shards is assembled token
 * by token. The permutation of an epoch is materialised once (n_samples
 * uint32 entries) and cached for the most recent epoch.
 */
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shards.h"
#include "zt_common.h"

typedef struct {
  char *path;
  const uint16_t *tok;
  uint64_t n;     /* tokens */
  uint64_t first; /* index of its first token in the concatenation */
  void *map;
  size_t map_len;
} shard;

struct zt_shards {
  shard *s;
  int ns;
  uint64_t total;
  int T;
  uint64_t n_samples;
  uint64_t seed;
  uint64_t perm_epoch; /* epoch of `perm`, or UINT64_MAX */
  uint64_t *perm;
  int max_token;
};

static int open_one(shard *s, const char *path) {
  memset(s, 0, sizeof *s);
  s->path = strdup(path);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return zt_err_errno("%s", path);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return zt_err_errno("%s", path);
  }
  size_t hdr = ZT_SHARD_HEADER_INTS * sizeof(int32_t);
  if ((size_t)st.st_size < hdr) {
    close(fd);
    return zt_err("%s: truncated: %lld bytes, smaller than the 1024-byte header", path,
                  (long long)st.st_size);
  }
  void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) return zt_err_errno("mmap %s", path);
  s->map = map;
  s->map_len = (size_t)st.st_size;
  const int32_t *h = map;
  if (h[0] != ZT_SHARD_MAGIC)
    return zt_err("%s: bad magic %d (expected %d): not a token shard", path, h[0], ZT_SHARD_MAGIC);
  if (h[1] != ZT_SHARD_VERSION)
    return zt_err("%s: unsupported version %d (expected %d)", path, h[1], ZT_SHARD_VERSION);
  if (h[2] < 0) return zt_err("%s: negative token count %d", path, h[2]);
  uint64_t want = hdr + 2 * (uint64_t)h[2];
  if ((uint64_t)st.st_size != want)
    return zt_err("%s: size %lld does not match the header's %d tokens (expected %llu bytes)",
                  path, (long long)st.st_size, h[2], (unsigned long long)want);
  s->n = (uint64_t)h[2];
  s->tok = (const uint16_t *)((const char *)map + hdr);
  return 0;
}

int zt_shards_open(const char *pattern, int T, uint64_t seed, zt_shards_t **out) {
  glob_t g;
  int gr = glob(pattern, 0, NULL, &g);
  if (gr != 0) {
    if (gr == GLOB_NOMATCH) return zt_err("no token shards match %s", pattern);
    return zt_err("cannot expand %s", pattern);
  }
  zt_shards_t *d = calloc(1, sizeof *d);
  if (!d) abort();
  d->s = calloc(g.gl_pathc, sizeof *d->s);
  d->T = T;
  d->seed = seed;
  d->perm_epoch = UINT64_MAX;
  for (size_t i = 0; i < g.gl_pathc; i++) { /* glob sorts the names */
    if (open_one(&d->s[d->ns], g.gl_pathv[i]) != 0) {
      d->ns++;
      globfree(&g);
      zt_shards_close(d);
      return -1;
    }
    d->s[d->ns].first = d->total;
    d->total += d->s[d->ns].n;
    for (uint64_t k = 0; k < d->s[d->ns].n; k++)
      if (d->s[d->ns].tok[k] > d->max_token) d->max_token = d->s[d->ns].tok[k];
    d->ns++;
  }
  globfree(&g);
  if (T < 1 || d->total < (uint64_t)T + 1) {
    uint64_t tot = d->total;
    zt_shards_close(d);
    return zt_err("%s: %llu tokens, fewer than one sample of %d+1", pattern,
                  (unsigned long long)tot, T);
  }
  d->n_samples = (d->total - 1) / (uint64_t)T;
  *out = d;
  return 0;
}

void zt_shards_close(zt_shards_t *d) {
  if (!d) return;
  for (int i = 0; i < d->ns; i++) {
    if (d->s[i].map) munmap(d->s[i].map, d->s[i].map_len);
    free(d->s[i].path);
  }
  free(d->s);
  free(d->perm);
  free(d);
}

uint64_t zt_shards_num_samples(const zt_shards_t *d) { return d->n_samples; }
uint64_t zt_shards_num_tokens(const zt_shards_t *d) { return d->total; }
int zt_shards_max_token(const zt_shards_t *d) { return d->max_token; }

static uint64_t splitmix(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static void build_perm(zt_shards_t *d, uint64_t epoch) {
  if (!d->perm) {
    d->perm = malloc(d->n_samples * sizeof *d->perm);
    if (!d->perm) abort();
  }
  for (uint64_t i = 0; i < d->n_samples; i++) d->perm[i] = i;
  uint64_t x = d->seed ^ (epoch * 0xd1b54a32d192ed03ull);
  for (uint64_t i = d->n_samples - 1; i > 0; i--) {
    uint64_t j = splitmix(&x) % (i + 1); /* modulo bias is irrelevant here */
    uint64_t t = d->perm[i];
    d->perm[i] = d->perm[j];
    d->perm[j] = t;
  }
  d->perm_epoch = epoch;
}

uint64_t zt_shards_stream_pos(const zt_skip *skips, int n, uint64_t q) {
  uint64_t p = q;
  for (int i = 0; i < n; i++)
    if (skips[i].start <= p) p += skips[i].end - skips[i].start;
  return p;
}

uint64_t zt_shards_sample_at(zt_shards_t *d, uint64_t p) {
  uint64_t epoch = p / d->n_samples;
  if (epoch != d->perm_epoch) build_perm(d, epoch);
  return d->perm[p % d->n_samples];
}

static int token_at(const zt_shards_t *d, uint64_t idx) {
  int lo = 0, hi = d->ns - 1;
  while (lo < hi) { /* last shard whose first <= idx */
    int mid = (lo + hi + 1) / 2;
    if (d->s[mid].first <= idx) lo = mid;
    else hi = mid - 1;
  }
  return d->s[lo].tok[idx - d->s[lo].first];
}

static void fill_sample(zt_shards_t *d, uint64_t sample, int *inp, int *tgt) {
  uint64_t base = sample * (uint64_t)d->T;
  for (int t = 0; t < d->T; t++) {
    inp[t] = token_at(d, base + (uint64_t)t);
    tgt[t] = token_at(d, base + (uint64_t)t + 1);
  }
}

void zt_shards_fill(zt_shards_t *d, const zt_skip *skips, int nskips, uint64_t first, int count,
                    int *inputs, int *targets) {
  for (int i = 0; i < count; i++) {
    uint64_t p = zt_shards_stream_pos(skips, nskips, first + (uint64_t)i);
    fill_sample(d, zt_shards_sample_at(d, p), inputs + (size_t)i * d->T,
                targets + (size_t)i * d->T);
  }
}

void zt_shards_fill_sequential(zt_shards_t *d, uint64_t first, int count, int *inputs,
                               int *targets) {
  for (int i = 0; i < count; i++)
    fill_sample(d, (first + (uint64_t)i) % d->n_samples, inputs + (size_t)i * d->T,
                targets + (size_t)i * d->T);
}
