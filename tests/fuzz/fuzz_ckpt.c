/*
 * fuzz_ckpt.c: loading a checkpoint epoch (engine/ckpt_io.c): the
 * manifest, a rank's index and its data file.
 *
 * Input: three parts, each a 2-byte little-endian length and its bytes:
 * manifest.json, rank_0.json, then rank_0.bin (the rest). They are
 * written into an epoch directory and loaded into a small model's units,
 * once trusting the indexes (an empty record, as zctl export does) and
 * once against a record made from the files as written (as the workers
 * load); then read whole as zctl export and sampling read it, the model
 * taken from the manifest (zt_ckpt_read_model, zt_ckpt_load_flat).
 * Property: no crash, no sanitizer report, no leak, no allocation larger
 * than the rank file can hold; a load that succeeds wrote only inside the
 * destination buffers (ASan).
 *
 * With ZT_FUZZ_MAKE_SEED=DIR set, the target first writes a valid epoch of
 * that model, in the input format, as DIR/valid (the committed seed).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "fuzz_fail.h"
#include "ckpt_io.h"
#include "layout.h"
#include "zt_common.h"

static const zt_model_config_t k_cfg = {
    .n_layer = 1, .n_head = 2, .n_embd = 8, .seq_len = 4, .vocab_size = 16};
static char g_dir[64];
static zt_layout_t g_lay;

static void write_part(const char *name, const uint8_t *p, size_t n) {
  char path[128];
  snprintf(path, sizeof path, "%s/%s", g_dir, name);
  FILE *f = fopen(path, "wb");
  if (!f || (n && fwrite(p, 1, n, f) != n)) ZT_FUZZ_FAIL();
  fclose(f);
}

/* The next part: a 2-byte length and its bytes (clipped to what is left). */
static const uint8_t *part(const uint8_t **d, size_t *left, size_t *n) {
  if (*left < 2) {
    *n = 0;
    return *d;
  }
  size_t len = (size_t)(*d)[0] | (size_t)(*d)[1] << 8;
  *d += 2, *left -= 2;
  *n = ZT_MIN(len, *left);
  const uint8_t *p = *d;
  *d += *n, *left -= *n;
  return p;
}

static void record_file(zt_ckpt_file_t *f, const char *name, const uint8_t *p, size_t n) {
  snprintf(f->name, sizeof f->name, "%s", name);
  f->bytes = n;
  snprintf(f->checksum, sizeof f->checksum, "xxh64:%016llx", (unsigned long long)XXH64(p, n, 0));
}

static void make_seed(const char *out) {
  char ep[128];
  snprintf(ep, sizeof ep, "%s/seed-epoch", g_dir);
  size_t total = g_lay.num_params;
  float *buf = zt_xcalloc(3 * total, sizeof(float));
  for (size_t i = 0; i < 3 * total; i++) buf[i] = (float)i * 0.001f;
  zt_ckpt_range_t *r = zt_xcalloc((size_t)g_lay.num_units, sizeof *r);
  for (int u = 0; u < g_lay.num_units; u++)
    r[u] = (zt_ckpt_range_t){u, 0, g_lay.unit_size[u], buf + g_lay.unit_off[u],
                             buf + total + g_lay.unit_off[u], buf + 2 * total + g_lay.unit_off[u]};
  zt_ckpt_meta_t meta = {1, 1, 5, 0, 1, 1, k_cfg, 7, 2, NULL, 0, "", "", 0, 0, 0, 0, 0};
  zt_ckpt_file_t files[3];
  int nf;
  if (zt_ckpt_write(ep, &meta, r, g_lay.num_units, files, &nf) != 0) ZT_FUZZ_FAIL();
  FILE *o = fopen(out, "wb");
  const char *names[3] = {"manifest.json", "rank_0.json", "rank_0.bin"};
  for (int i = 0; i < 3; i++) {
    char path[256], *text;
    size_t n;
    snprintf(path, sizeof path, "%s/%s", ep, names[i]);
    if (!o || zt_read_file(path, &text, &n, 1 << 20) != 0) ZT_FUZZ_FAIL();
    if (i < 2) fputc((int)(n & 0xff), o), fputc((int)(n >> 8), o);
    fwrite(text, 1, n, o);
    free(text);
  }
  fclose(o);
  free(r);
  free(buf);
}

/* The epoch directory goes when the fuzzer exits normally. */
static void remove_dir(void) { zt_remove_tree(g_dir); }

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  zt_log_set_level((zt_log_level_t)(ZT_LOG_ERROR + 1));
  snprintf(g_dir, sizeof g_dir, "/tmp/zt-fuzz-ckpt-XXXXXX");
  if (!mkdtemp(g_dir) || zt_layout_build(&g_lay, &k_cfg) != 0) ZT_FUZZ_FAIL();
  atexit(remove_dir);
  const char *seed = getenv("ZT_FUZZ_MAKE_SEED");
  if (seed) {
    char out[512];
    snprintf(out, sizeof out, "%s/valid", seed);
    make_seed(out);
  }
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  size_t left = size, nm, ni, nb;
  const uint8_t *m = part(&data, &left, &nm), *ix = part(&data, &left, &ni);
  const uint8_t *bin = data;
  nb = left;
  write_part("manifest.json", m, nm);
  write_part("rank_0.json", ix, ni);
  write_part("rank_0.bin", bin, nb);
  size_t total = g_lay.num_params;
  float *buf = zt_xcalloc(3 * total, sizeof(float));
  zt_ckpt_dest_t *dest = zt_xcalloc((size_t)g_lay.num_units, sizeof *dest);
  for (int u = 0; u < g_lay.num_units; u++)
    dest[u] = (zt_ckpt_dest_t){u, 0, g_lay.unit_size[u], buf + g_lay.unit_off[u],
                               buf + total + g_lay.unit_off[u], buf + 2 * total + g_lay.unit_off[u]};
  zt_ckpt_file_t files[3];
  record_file(&files[0], "manifest.json", m, nm);
  record_file(&files[1], "rank_0.json", ix, ni);
  record_file(&files[2], "rank_0.bin", bin, nb);
  zt_ckpt_record_t trusted = {NULL, 0}, recorded = {files, 3};
  int64_t step;
  (void)zt_ckpt_load(g_dir, &k_cfg, dest, g_lay.num_units, &trusted, &step);
  (void)zt_ckpt_load(g_dir, &k_cfg, dest, g_lay.num_units, &recorded, &step);
  free(dest);
  free(buf);
  zt_model_config_t cfg;
  zt_layout_t lay = {0};
  float *flat = NULL;
  if (zt_ckpt_read_model(g_dir, &cfg, NULL, 0) == 0 &&
      zt_ckpt_load_flat(g_dir, &cfg, &lay, &flat, &step) == 0)
    free(flat);
  zt_layout_free(&lay);
  return 0;
}
