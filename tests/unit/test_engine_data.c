/*
 * test_engine_data.c: token shards and the global sample order.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data.h"
#include "zt_common.h"
#include "zt_test.h"

static char dir[512];

/* Writes a shard of tokens base, base+1, ... (mod 50000) with a header that
 * can be corrupted: magic, version and count as given, `extra` bytes
 * appended after the tokens (negative: cut off). */
static const char *write_shard(const char *name, int ntok, int base, int32_t magic,
                               int32_t version, int32_t count, int extra) {
  static char path[1024];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  int32_t hdr[256] = {magic, version, count};
  fwrite(hdr, sizeof hdr, 1, f);
  for (int i = 0; i < ntok + (extra < 0 ? extra / 2 : 0); i++) {
    uint16_t t = (uint16_t)((base + i) % 50000);
    fwrite(&t, 2, 1, f);
  }
  for (int i = 0; i < extra; i++) fputc(0, f);
  fclose(f);
  return path;
}

static const char *good_shard(const char *name, int ntok, int base) {
  return write_shard(name, ntok, base, ZT_SHARD_MAGIC, 1, ntok, 0);
}

static void expect_open_error(const char *path, const char *what) {
  zt_data_t *d;
  char *p = (char *)path;
  ZT_CHECK(zt_data_open(&d, &p, 1, 4, 0, 1) == -1);
  const char *msg = zt_err_msg();
  if (!strstr(msg, path) || !strstr(msg, what)) fprintf(stderr, "  message: %s\n", msg);
  ZT_CHECK(strstr(msg, path) != NULL);
  ZT_CHECK(strstr(msg, what) != NULL);
}

ZT_TEST(header_validation) {
  snprintf(dir, sizeof dir, "%s", zt_test_tmpdir("engine_data"));
  expect_open_error(write_shard("magic.bin", 100, 0, 1234, 1, 100, 0), "not a token shard");
  expect_open_error(write_shard("version.bin", 100, 0, ZT_SHARD_MAGIC, 3, 100, 0),
                    "unsupported shard version 3");
  /* Version 2 holds 4-byte tokens: 100 2-byte tokens are half its size. */
  expect_open_error(write_shard("v2.bin", 100, 0, ZT_SHARD_MAGIC, 2, 100, 0), "size mismatch");
  expect_open_error(write_shard("long.bin", 100, 0, ZT_SHARD_MAGIC, 1, 100, 6), "size mismatch");
  expect_open_error(write_shard("short.bin", 100, 0, ZT_SHARD_MAGIC, 1, 100, -20), "size mismatch");
  expect_open_error(write_shard("count.bin", 100, 0, ZT_SHARD_MAGIC, 1, 90, 0), "size mismatch");
  /* A file shorter than the header. */
  char path[1024];
  snprintf(path, sizeof path, "%s/tiny.bin", dir);
  FILE *f = fopen(path, "wb");
  fputs("hello", f);
  fclose(f);
  expect_open_error(path, "truncated");
  snprintf(path, sizeof path, "%s/missing.bin", dir);
  expect_open_error(path, "No such file");
  /* Too few tokens for one window. */
  expect_open_error(good_shard("few.bin", 4, 0), "need at least");
  zt_data_t *d;
  char pat[1024];
  snprintf(pat, sizeof pat, "%s/nothing_*.bin", dir);
  ZT_CHECK(zt_data_open_glob(&d, pat, 4, 0, 1) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "no file matches") != NULL);
}

ZT_TEST(samples_cross_shards) {
  snprintf(dir, sizeof dir, "%s", zt_test_tmpdir("engine_data"));
  good_shard("s_000001.bin", 30, 1000); /* glob order: 000000 first */
  good_shard("s_000000.bin", 25, 0);
  char pat[1024];
  snprintf(pat, sizeof pat, "%s/s_*.bin", dir);
  zt_data_t *d;
  ZT_REQUIRE(zt_data_open_glob(&d, pat, 8, 0, 1) == 0);
  ZT_CHECK(zt_data_num_tokens(d) == 55);
  ZT_CHECK(zt_data_num_samples(d) == 6); /* (55 - 1) / 8 */
  int in[16], tg[16];
  ZT_REQUIRE(zt_data_fill_seq(d, 2, 2, in, tg) == 0);
  /* Sample 2 starts at token 16 (shard 0), sample 3 at 24: token 24 is the
   * last of shard 0, then 1000, 1001, ... */
  ZT_CHECK(in[0] == 16 && tg[0] == 17 && in[7] == 23 && tg[7] == 24);
  ZT_CHECK(in[8] == 24 && in[9] == 1000 && tg[7 + 8] == 1007);
  ZT_CHECK(zt_data_fill_seq(d, 5, 2, in, tg) == -1);
  zt_data_close(d);
  /* Tokens beyond the vocabulary are an error naming the shard. */
  ZT_REQUIRE(zt_data_open_glob(&d, pat, 8, 1000, 1) == 0);
  ZT_CHECK(zt_data_fill_seq(d, 0, 1, in, tg) == 0); /* tokens 0..8 are < 1000 */
  ZT_CHECK(zt_data_fill_seq(d, 3, 1, in, tg) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "s_000001.bin") != NULL);
  ZT_CHECK(strstr(zt_err_msg(), "vocab_size") != NULL);
  zt_data_close(d);
}

/* A version-2 shard (uint32 tokens, little-endian) of tokens base, base+1, ... */
static void write_shard32(const char *name, int ntok, int64_t base) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  int32_t hdr[256] = {ZT_SHARD_MAGIC, ZT_SHARD_VERSION_U32, ntok};
  fwrite(hdr, sizeof hdr, 1, f);
  for (int i = 0; i < ntok; i++) {
    uint32_t t = (uint32_t)(base + i);
    uint8_t b[4] = {(uint8_t)t, (uint8_t)(t >> 8), (uint8_t)(t >> 16), (uint8_t)(t >> 24)};
    fwrite(b, 4, 1, f);
  }
  fclose(f);
}

/* Version-2 shards hold ids past 65,535 (Llama 3's vocabulary), and one
 * data set may mix both versions. */
ZT_TEST(wide_tokens) {
  snprintf(dir, sizeof dir, "%s", zt_test_tmpdir("engine_data"));
  good_shard("w_000000.bin", 10, 100);
  write_shard32("w_000001.bin", 30, 128000);
  char pat[1024];
  snprintf(pat, sizeof pat, "%s/w_*.bin", dir);
  zt_data_t *d;
  ZT_REQUIRE(zt_data_open_glob(&d, pat, 8, 128020, 1) == 0);
  ZT_CHECK(zt_data_num_tokens(d) == 40);
  int in[16], tg[16];
  ZT_REQUIRE(zt_data_fill_seq(d, 1, 2, in, tg) == 0);
  /* Sample 1 starts at token 8: 108, 109, then the wide shard. */
  ZT_CHECK(in[0] == 108 && in[1] == 109 && in[2] == 128000 && tg[1] == 128000);
  ZT_CHECK(in[8] == 128006 && tg[15] == 128014);
  /* Ids past the vocabulary are an error naming the shard. */
  ZT_REQUIRE(zt_data_fill_seq(d, 3, 1, in, tg) == -1); /* tokens 24..32 */
  ZT_CHECK(strstr(zt_err_msg(), "w_000001.bin") != NULL);
  ZT_CHECK(strstr(zt_err_msg(), "token 128020") != NULL);
  zt_data_close(d);
  /* An id that is no int. */
  write_shard32("x_000000.bin", 10, 0x7ffffffcll);
  snprintf(pat, sizeof pat, "%s/x_*.bin", dir);
  ZT_REQUIRE(zt_data_open_glob(&d, pat, 8, 0, 1) == 0);
  ZT_CHECK(zt_data_fill_seq(d, 0, 1, in, tg) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "larger than any token id") != NULL);
  zt_data_close(d);
}

static zt_data_t *open_n(int ntok, int T, uint64_t seed) {
  snprintf(dir, sizeof dir, "%s", zt_test_tmpdir("engine_data"));
  const char *p = good_shard("p.bin", ntok, 0);
  char *pp = (char *)p;
  zt_data_t *d = NULL;
  if (zt_data_open(&d, &pp, 1, T, 0, seed) != 0) fprintf(stderr, "  %s\n", zt_err_msg());
  return d;
}

ZT_TEST(permutation) {
  zt_data_t *d = open_n(1001, 1, 42), *e = open_n(1001, 1, 42), *f = open_n(1001, 1, 43);
  ZT_REQUIRE(d && e && f);
  uint64_t n = zt_data_num_samples(d);
  ZT_REQUIRE(n == 1000);
  char *seen = calloc(n, 1);
  int same_as_identity = 0, differs_seed = 0, differs_epoch = 0;
  for (uint64_t p = 0; p < n; p++) {
    uint64_t k, k2, k3, k4;
    ZT_REQUIRE(zt_data_sample_at(d, p, &k) == 0);
    ZT_REQUIRE(k < n);
    seen[k]++;
    ZT_REQUIRE(zt_data_sample_at(e, p, &k2) == 0);
    ZT_CHECK(k == k2); /* deterministic */
    ZT_REQUIRE(zt_data_sample_at(f, p, &k3) == 0);
    differs_seed += k3 != k;
    ZT_REQUIRE(zt_data_sample_at(d, p + n, &k4) == 0); /* epoch 1 */
    differs_epoch += k4 != k;
    same_as_identity += k == p;
  }
  for (uint64_t i = 0; i < n; i++) ZT_CHECK(seen[i] == 1);
  ZT_CHECK(differs_seed > 900 && differs_epoch > 900 && same_as_identity < 20);
  /* Known values pin the generator across platforms and releases. */
  uint64_t k0;
  ZT_REQUIRE(zt_data_sample_at(e, 0, &k0) == 0);
  ZT_CHECK(k0 == 484);
  free(seen);
  zt_data_close(d);
  zt_data_close(e);
  zt_data_close(f);
}

ZT_TEST(skip_ranges) {
  zt_data_t *d = open_n(101, 1, 1);
  ZT_REQUIRE(d);
  ZT_CHECK(zt_data_stream_pos(d, 7) == 7);
  zt_range_t r[] = {{10, 20}, {5, 8}, {15, 25}, {30, 30}, {40, 41}};
  ZT_REQUIRE(zt_data_set_skips(d, r, 5) == 0);
  /* Merged: [5, 8), [10, 25), [40, 41). Usable stream positions:
   * 0..4, 8, 9, 25..39, 41, ... */
  uint64_t want[] = {0, 1, 2, 3, 4, 8, 9, 25, 26};
  for (uint64_t q = 0; q < 9; q++) ZT_CHECK(zt_data_stream_pos(d, q) == want[q]);
  ZT_CHECK(zt_data_stream_pos(d, 21) == 39);
  ZT_CHECK(zt_data_stream_pos(d, 22) == 41);
  ZT_CHECK(zt_data_stream_pos(d, 100) == 119);
  /* Filling skips the same way. */
  int a[4], at[4], b[4], bt[4];
  ZT_REQUIRE(zt_data_fill(d, 5, 2, a, at) == 0);
  ZT_REQUIRE(zt_data_set_skips(d, NULL, 0) == 0);
  ZT_REQUIRE(zt_data_fill(d, 8, 2, b, bt) == 0);
  ZT_CHECK(a[0] == b[0] && a[1] == b[1]);
  zt_data_close(d);
}

static int cmp_u64(const void *x, const void *y) {
  uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
  return a < b ? -1 : a > b;
}

/* Over ranks and micro steps, a step covers exactly its global batch, and
 * the samples (hence the mean loss) are the same for any world size. */
ZT_TEST(rank_slicing) {
  zt_data_t *d = open_n(2001, 4, 9);
  ZT_REQUIRE(d);
  zt_range_t r[] = {{30, 45}};
  ZT_REQUIRE(zt_data_set_skips(d, r, 1) == 0);
  const int mb = 2, GB = 24, T = 4;
  uint64_t ref_first[GB];
  for (int N = 1; N <= 4; N++) {
    int accum = GB / (mb * N);
    for (uint64_t s = 0; s < 3; s++) {
      uint64_t pos[GB], first[GB];
      int k = 0;
      for (int rank = 0; rank < N; rank++) {
        for (int j = 0; j < accum; j++) {
          uint64_t q0 = zt_data_pos(s, mb, accum, N, rank, j);
          int in[8], tg[8];
          ZT_REQUIRE(zt_data_fill(d, q0, mb, in, tg) == 0);
          for (int i = 0; i < mb; i++) {
            pos[k] = q0 + (uint64_t)i;
            first[k++] = (uint64_t)in[i * T]; /* identifies the sample */
          }
        }
      }
      ZT_REQUIRE(k == GB);
      qsort(pos, GB, sizeof pos[0], cmp_u64);
      for (int i = 0; i < GB; i++) ZT_CHECK(pos[i] == s * GB + (uint64_t)i);
      qsort(first, GB, sizeof first[0], cmp_u64);
      if (s == 2) {
        if (N == 1) memcpy(ref_first, first, sizeof first);
        else ZT_CHECK(memcmp(ref_first, first, sizeof first) == 0);
      }
    }
  }
  /* The formula itself. */
  ZT_CHECK(zt_data_pos(3, 2, 3, 4, 1, 2) == 3 * 24 + 2 * 8 + 1 * 2);
  zt_data_close(d);
}

ZT_TEST_MAIN(header_validation, samples_cross_shards, wide_tokens, permutation, skip_ranges,
             rank_slicing)
