/*
 * data.h: token shards and the global sample order.
 *
 * Shards are llm.c's format: a header of 256 int32 (little-endian) with
 * [0] = 20240520 (magic), [1] = version, [2] = number of tokens, then the
 * tokens: version 1 (llm.c's) as uint16, version 2 as uint32, for
 * vocabularies of more than 65,536 tokens (Llama 3's 128,256, Qwen's
 * 151,936). A shard's file size must be exactly 1024 + width * count.
 * Shards of both versions may make up one data set. Shards are
 * memory-mapped read-only.
 *
 * Samples. The shards of a data set, in the order given (glob results are
 * sorted), are one stream of tokens. Sample k is the window of T + 1 tokens
 * starting at token k * T (inputs are the first T, targets the last T), for
 * k in [0, n_samples), n_samples = (total_tokens - 1) / T. Windows may cross
 * shard boundaries.
 *
 * Order. Training reads an endless stream: stream position p belongs to
 * epoch e = p / n_samples and maps to sample perm_{seed,e}(p % n_samples),
 * where perm_{seed,e} is a Fisher-Yates shuffle driven by xoshiro256**
 * seeded from (seed, e) (rng.h). Skip ranges are half-open ranges of stream
 * positions that are never used (a rollback skips the data of a loss spike);
 * logical position q maps to the q-th stream position that is in no skip
 * range (counting from 0).
 *
 * Batches. With world size N, micro batch mb and accumulation a, the global
 * batch is GB = mb * a * N and step s consumes the logical positions
 * [s * GB, (s + 1) * GB). Rank r's micro step j (0 <= j < a) takes the mb
 * consecutive logical positions starting at
 *
 *     q0 = s * GB + j * (N * mb) + r * mb                 (zt_data_pos)
 *
 * Over all ranks and micro steps these are exactly [s * GB, (s + 1) * GB),
 * so the set of samples in a step depends only on (seed, skips, s, GB), not
 * on N; the step's mean loss and gradient are the same for any N up to
 * floating-point reassociation.
 *
 * Validation reads the first K samples of its shards in file order, no
 * shuffle (zt_data_fill_seq).
 */
#ifndef ZT_DATA_H
#define ZT_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "zt_common.h"

#define ZT_SHARD_MAGIC 20240520
#define ZT_SHARD_VERSION 1     /* uint16 tokens (llm.c) */
#define ZT_SHARD_VERSION_U32 2 /* uint32 tokens */
/* The largest token id a version-2 shard may hold (ids are ints). */
#define ZT_SHARD_MAX_TOKEN INT32_MAX
#define ZT_SHARD_HEADER_INTS 256
#define ZT_SHARD_HEADER_BYTES (ZT_SHARD_HEADER_INTS * 4)

typedef struct zt_data zt_data_t;

/* Expands a glob pattern into a sorted list of paths (no match is an error
 * naming the pattern). Free with zt_data_free_paths. */
ZT_MUST_CHECK int zt_data_glob(const char *pattern, char ***paths, int *npaths);
void zt_data_free_paths(char **paths, int npaths);

/* Opens and validates shards, for windows of T + 1 tokens. vocab_size > 0
 * makes every token >= vocab_size an error when it is read. The epoch
 * shuffles are seeded from `seed`. An error names the offending file. */
ZT_MUST_CHECK int zt_data_open(zt_data_t **out, char *const *paths, int npaths, int T, int vocab_size,
                 uint64_t seed);
/* zt_data_glob + zt_data_open. */
ZT_MUST_CHECK int zt_data_open_glob(zt_data_t **out, const char *pattern, int T, int vocab_size, uint64_t seed);
void zt_data_close(zt_data_t *d);

uint64_t zt_data_num_tokens(const zt_data_t *d);
uint64_t zt_data_num_samples(const zt_data_t *d);

/* Replaces the skip ranges (copied, sorted and merged; empty ranges are
 * dropped). */
ZT_MUST_CHECK int zt_data_set_skips(zt_data_t *d, const zt_range_t *ranges, int n);

/* Stream position of logical position q (skipping the skip ranges). */
uint64_t zt_data_stream_pos(const zt_data_t *d, uint64_t q);
/* Sample index of stream position p: perm_{seed, p / n}(p % n). */
ZT_MUST_CHECK int zt_data_sample_at(zt_data_t *d, uint64_t p, uint64_t *sample);

/* First logical position of rank r's micro step j of step s (see above). */
static inline uint64_t zt_data_pos(uint64_t step, int micro, int accum, int world, int rank,
                                   int j) {
  uint64_t gb = (uint64_t)micro * (uint64_t)accum * (uint64_t)world;
  return step * gb + (uint64_t)j * (uint64_t)world * (uint64_t)micro + (uint64_t)rank * micro;
}

/* Fills inputs/targets [n, T] with the samples of logical positions
 * q0 .. q0 + n - 1. */
ZT_MUST_CHECK int zt_data_fill(zt_data_t *d, uint64_t q0, int n, int *inputs, int *targets);
/* Fills inputs/targets [n, T] with samples k0 .. k0 + n - 1 in file order
 * (no shuffle, no skips; k0 + n <= n_samples). */
ZT_MUST_CHECK int zt_data_fill_seq(zt_data_t *d, uint64_t k0, int n, int *inputs, int *targets);

#endif
