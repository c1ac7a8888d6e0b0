/*
 * fuzz_shard.c: token shards (engine/data.c): the header, the token count
 * against the file size, tokens against the vocabulary, sampling.
 *
 * Input: the bytes of one shard file. Property: no crash, no sanitizer
 * report, no leak; a shard that opens yields inputs and targets inside
 * the vocabulary for every sample asked for.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fuzz_fail.h"
#include "data.h"
#include "zt_common.h"

#define T 8
#define VOCAB 300

static char path[64];

/* The input file goes when the fuzzer exits normally. */
static void remove_input(void) { unlink(path); }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!path[0]) {
    snprintf(path, sizeof path, "/tmp/zt-fuzz-shard-%d.bin", (int)getpid());
    zt_log_set_level((zt_log_level_t)(ZT_LOG_ERROR + 1));
    atexit(remove_input);
  }
  FILE *f = fopen(path, "wb");
  if (!f) ZT_FUZZ_FAIL();
  if (size && fwrite(data, 1, size, f) != size) ZT_FUZZ_FAIL();
  fclose(f);
  char *paths[1] = {path};
  zt_data_t *d;
  if (zt_data_open(&d, paths, 1, T, VOCAB, 1234) != 0) return 0;
  uint64_t n = zt_data_num_samples(d);
  int in[4 * T], tg[4 * T];
  for (uint64_t q = 0; q < 3 && n; q++) {
    if (zt_data_fill(d, q * 7, 4, in, tg) != 0) continue; /* a token beyond the vocabulary */
    for (int i = 0; i < 4 * T; i++)
      if (in[i] < 0 || in[i] >= VOCAB || tg[i] < 0 || tg[i] >= VOCAB) ZT_FUZZ_FAIL();
  }
  zt_data_close(d);
  return 0;
}
