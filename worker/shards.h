/*
 * shards.h: token shards and the global sample order.
 *
 * Shards use llm.c's format: a header of 256 int32 (magic 20240520,
 * version 1, token count), then the tokens as uint16. A dataset is a list
 * of shards (a glob pattern, expanded and sorted); its tokens are
 * concatenated and cut into non-overlapping windows of T+1 tokens with
 * stride T: sample k is tokens [k*T, k*T + T], inputs the first T, targets
 * the last T. n_samples = (total_tokens - 1) / T.
 *
 * The global sample stream is a pure function of (seed, skip ranges):
 * stream position p is sample perm_{seed, e}(p mod n_samples) of epoch
 * e = p / n_samples, where perm is a seeded Fisher-Yates shuffle. A
 * logical position q is mapped to a stream position by stepping over the
 * skip ranges (sorted half-open [start, end) stream intervals added by
 * rollbacks): p = q; for each range with start <= p: p += end - start.
 *
 * Step s (0-based) of a job with global batch GB uses logical positions
 * [s*GB, (s+1)*GB). With N ranks, micro batch mb and accumulation a
 * (GB = N*a*mb), micro-step j of rank r takes positions
 * s*GB + j*N*mb + r*mb ... + mb - 1. The union over ranks and micro-steps is
 * the whole global batch, so a step sees the same samples whatever N is.
 */
#ifndef ZT_SHARDS_H
#define ZT_SHARDS_H

#include <stddef.h>
#include <stdint.h>

#define ZT_SHARD_MAGIC 20240520
#define ZT_SHARD_VERSION 1
#define ZT_SHARD_HEADER_INTS 256

typedef struct {
  uint64_t start, end;
} zt_skip;

typedef struct zt_shards zt_shards_t;

/* Opens every shard matching `pattern` (a glob), validating headers and
 * sizes; a bad shard is an error naming the file. T is the sequence length. */
int zt_shards_open(const char *pattern, int T, uint64_t seed, zt_shards_t **out);
void zt_shards_close(zt_shards_t *d);
uint64_t zt_shards_num_samples(const zt_shards_t *d);
uint64_t zt_shards_num_tokens(const zt_shards_t *d);
int zt_shards_max_token(const zt_shards_t *d); /* largest token id present */

/* Stream position of logical position q (skips sorted by start). */
uint64_t zt_shards_stream_pos(const zt_skip *skips, int nskips, uint64_t q);
/* Sample index at stream position p. */
uint64_t zt_shards_sample_at(zt_shards_t *d, uint64_t p);
/* Fills inputs/targets [count, T] with the samples at logical positions
 * first .. first + count - 1. */
void zt_shards_fill(zt_shards_t *d, const zt_skip *skips, int nskips, uint64_t first, int count,
                    int *inputs, int *targets);
/* The first `count` samples in file order (validation), wrapping. */
void zt_shards_fill_sequential(zt_shards_t *d, uint64_t first, int count, int *inputs,
                               int *targets);

#endif
