/*
 * test_engine_quant.c: the compressed encodings of DiLoCo's
 * pseudo-gradient (engine/quant.c): their error bounds, the non-finite
 * mark, and every corruption of an int8 block refused by name with
 * nothing added.
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "quant.h"
#include "zt_common.h"
#include "zt_test.h"

#define N 1000 /* three whole blocks and a partial one */

static void fill(float *x, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    x[i] = (float)((double)(seed >> 11) / 9007199254740992.0 - 0.5) * (i % 7 == 0 ? 40.0f : 1.0f);
  }
}

/* Each value within half a step of its block's scale (int8), or within
 * bf16's rounding (2^-9 relative); added, not stored. */
ZT_TEST(round_trip_error_bounds) {
  float x[N], acc[N];
  uint8_t buf[4 * N + 64];
  fill(x, N, 7);
  ZT_CHECK(zt_quant_bytes(ZT_QUANT_INT8, N) == 4 * 4 + N);
  ZT_CHECK(zt_quant_bytes(ZT_QUANT_BF16, N) == 2 * N);
  ZT_CHECK(zt_quant_bytes(ZT_QUANT_INT8, 3) == 8); /* 4 + 3, padded to even */
  zt_quant_encode(ZT_QUANT_INT8, x, N, buf);
  for (size_t i = 0; i < N; i++) acc[i] = 1.0f;
  ZT_REQUIRE(zt_quant_decode_add(ZT_QUANT_INT8, buf, zt_quant_bytes(ZT_QUANT_INT8, N), N, acc,
                                 "group 0") == 0);
  for (size_t b = 0; b < N; b += ZT_Q8_BLOCK) {
    float amax = 0;
    for (size_t i = b; i < N && i < b + ZT_Q8_BLOCK; i++) amax = fmaxf(amax, fabsf(x[i]));
    for (size_t i = b; i < N && i < b + ZT_Q8_BLOCK; i++)
      ZT_CHECK(fabsf(acc[i] - 1.0f - x[i]) <= amax / 127.0f * 0.5f + 1e-6f);
  }
  zt_quant_encode(ZT_QUANT_BF16, x, N, buf);
  memset(acc, 0, sizeof acc);
  ZT_REQUIRE(zt_quant_decode_add(ZT_QUANT_BF16, buf, 2 * N, N, acc, "group 1") == 0);
  for (size_t i = 0; i < N; i++) ZT_CHECK(fabsf(acc[i] - x[i]) <= fabsf(x[i]) / 256.0f);
  /* A zero block stays exactly zero. */
  float z[10] = {0};
  zt_quant_encode(ZT_QUANT_INT8, z, 10, buf);
  memset(acc, 0, sizeof acc);
  ZT_REQUIRE(zt_quant_decode_add(ZT_QUANT_INT8, buf, 14, 10, acc, "g") == 0);
  for (int i = 0; i < 10; i++) ZT_CHECK(acc[i] == 0.0f);
}

/* A block with a value that is not finite arrives as NaNs (the caller
 * refuses the sum); the other blocks arrive as they were. */
ZT_TEST(non_finite_block_is_marked) {
  float x[N], acc[N] = {0};
  uint8_t buf[2 * N];
  fill(x, N, 9);
  x[300] = INFINITY;
  zt_quant_encode(ZT_QUANT_INT8, x, N, buf);
  ZT_REQUIRE(zt_quant_decode_add(ZT_QUANT_INT8, buf, zt_quant_bytes(ZT_QUANT_INT8, N), N, acc,
                                 "g") == 0);
  for (size_t i = 256; i < 512; i++) ZT_CHECK(isnan(acc[i]));
  ZT_CHECK(isfinite(acc[0]) && isfinite(acc[600]));
}

/* Corrupt blocks: refused with the block and sender named, acc untouched. */
static void expect_bad(uint8_t *buf, size_t bytes, const char *want) {
  float acc[N];
  for (size_t i = 0; i < N; i++) acc[i] = 3.0f;
  ZT_CHECK(zt_quant_decode_add(ZT_QUANT_INT8, buf, bytes, N, acc, "group 2") == -1);
  if (!strstr(zt_err_msg(), want)) fprintf(stderr, "  got \"%s\", want \"%s\"\n", zt_err_msg(), want);
  ZT_CHECK(strstr(zt_err_msg(), want) != NULL);
  ZT_CHECK(strstr(zt_err_msg(), "group 2") != NULL);
  for (size_t i = 0; i < N; i++) ZT_CHECK(acc[i] == 3.0f);
}

ZT_TEST(corrupt_blocks_are_refused) {
  float x[N];
  uint8_t good[2 * N], bad[2 * N];
  size_t bytes = zt_quant_bytes(ZT_QUANT_INT8, N), blk = 4 + ZT_Q8_BLOCK;
  fill(x, N, 11);
  zt_quant_encode(ZT_QUANT_INT8, x, N, good);
  float s;
  memcpy(bad, good, bytes);
  s = NAN;
  memcpy(bad + 2 * blk, &s, 4);
  expect_bad(bad, bytes, "int8 block 2 from group 2: scale nan is out of range");
  memcpy(bad, good, bytes);
  s = -1.0f;
  memcpy(bad + blk, &s, 4);
  expect_bad(bad, bytes, "int8 block 1 from group 2: scale -1 is out of range");
  memcpy(bad, good, bytes);
  s = FLT_MAX;
  memcpy(bad + 3 * blk, &s, 4);
  expect_bad(bad, bytes, "int8 block 3 from group 2: scale");
  memcpy(bad, good, bytes);
  bad[3 * blk + 4 + 17] = 0x80; /* -128 */
  expect_bad(bad, bytes, "int8 block 3 from group 2: value -128 at 17 is out of range");
  memcpy(bad, good, bytes);
  s = INFINITY;
  memcpy(bad, &s, 4);
  memset(bad + 4, 0, ZT_Q8_BLOCK);
  bad[4 + 1] = 5;
  expect_bad(bad, bytes, "marked not finite, but value 1 is 5");
  expect_bad(good, bytes - 2, "bytes from group 2, expected");
}

/* int4: blocks of 64, two values a byte, within half a step of
 * max |x| / 7; a -8 is refused by name. */
ZT_TEST(int4_round_trip_and_checks) {
  float x[N], acc[N];
  uint8_t buf[2 * N];
  size_t bytes = zt_quant_bytes(ZT_QUANT_INT4, N);
  ZT_CHECK(bytes == 15 * (4 + 32) + 4 + 20); /* 15 whole blocks and one of 40 */
  ZT_CHECK(zt_quant_bytes(ZT_QUANT_INT4, 3) == 6);
  fill(x, N, 5);
  zt_quant_encode(ZT_QUANT_INT4, x, N, buf);
  memset(acc, 0, sizeof acc);
  ZT_REQUIRE(zt_quant_decode_add(ZT_QUANT_INT4, buf, bytes, N, acc, "group 1") == 0);
  size_t off = 0;
  for (size_t b = 0; b < N; b += ZT_Q4_BLOCK) {
    float amax = 0;
    size_t len = N - b < ZT_Q4_BLOCK ? N - b : ZT_Q4_BLOCK;
    for (size_t i = b; i < b + len; i++) amax = fmaxf(amax, fabsf(x[i]));
    for (size_t i = b; i < b + len; i++)
      ZT_CHECK(fabsf(acc[i] - x[i]) <= amax / 7.0f * 0.5f + 1e-6f);
    off += 4 + (len + 1) / 2;
  }
  ZT_CHECK(off == bytes);
  /* Value 5 of block 2 (high nibble of its third byte) set to -8. */
  buf[2 * 36 + 4 + 2] = (uint8_t)((buf[2 * 36 + 4 + 2] & 0x0f) | 0x80);
  for (size_t i = 0; i < N; i++) acc[i] = 2.0f;
  ZT_CHECK(zt_quant_decode_add(ZT_QUANT_INT4, buf, bytes, N, acc, "group 1") == -1);
  ZT_CHECK(strstr(zt_err_msg(), "int4 block 2 from group 1: value -8 at 5 is out of range "
                                "[-7, 7]") != NULL);
  for (size_t i = 0; i < N; i++) ZT_CHECK(acc[i] == 2.0f);
}

ZT_TEST_MAIN(round_trip_error_bounds, non_finite_block_is_marked, corrupt_blocks_are_refused,
             int4_round_trip_and_checks)
