/*
 * fuzz_safetensors.c: reading a Hugging Face GPT-2 safetensors file into a
 * small model (engine/safetensors.c, a job's init.from_safetensors).
 *
 * Input: the file's bytes. Property: no crash, no sanitizer report, no
 * leak; a file that reads wrote only inside the parameter buffer (ASan),
 * and the padded vocabulary rows stay zero.
 *
 * With ZT_FUZZ_MAKE_SEED=DIR set, the target first writes that model's
 * parameters as DIR/valid-f32 and DIR/valid-bf16 (the committed seeds).
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fuzz_fail.h"
#include "safetensors.h"

static const zt_model_config_t k_cfg = {
    .n_layer = 1, .n_head = 2, .n_embd = 8, .seq_len = 4, .vocab_size = 10};
static zt_layout_t g_lay;
static char g_path[64];

static void make_seeds(const char *dir) {
  float *flat = zt_xcalloc(g_lay.num_params, sizeof(float));
  zt_layout_init_unit(&g_lay, 1, 0, flat);
  for (int u = 1; u < g_lay.num_units; u++)
    zt_layout_init_unit(&g_lay, 1, u, flat + g_lay.unit_off[u]);
  char out[512];
  snprintf(out, sizeof out, "%s/valid-f32", dir);
  if (zt_st_write(out, &g_lay, flat, 0, 1, NULL) != 0) ZT_FUZZ_FAIL();
  snprintf(out, sizeof out, "%s/valid-bf16", dir);
  if (zt_st_write(out, &g_lay, flat, 1, 1, NULL) != 0) ZT_FUZZ_FAIL();
  free(flat);
}

/* The input file goes when the fuzzer exits normally. */
static void remove_input(void) { unlink(g_path); }

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  zt_log_set_level((zt_log_level_t)(ZT_LOG_ERROR + 1));
  snprintf(g_path, sizeof g_path, "/tmp/zt-fuzz-st-%d.safetensors", (int)getpid());
  atexit(remove_input);
  if (zt_layout_build(&g_lay, &k_cfg) != 0) ZT_FUZZ_FAIL();
  const char *seed = getenv("ZT_FUZZ_MAKE_SEED");
  if (seed) make_seeds(seed);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  FILE *f = fopen(g_path, "wb");
  if (!f || (size && fwrite(data, 1, size, f) != size)) ZT_FUZZ_FAIL();
  fclose(f);
  float *flat = zt_xmalloc(g_lay.num_params * sizeof(float));
  if (zt_st_read(g_path, &g_lay, flat) == 0) {
    const zt_tensor_t *wte = &g_lay.tensors[0];
    for (size_t i = (size_t)k_cfg.vocab_size * (size_t)k_cfg.n_embd; i < wte->n; i++)
      if (flat[wte->off + i] != 0.0f) ZT_FUZZ_FAIL();
  }
  free(flat);
  return 0;
}
