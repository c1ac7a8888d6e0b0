/*
 * test_engine_ckpt.c: engine/ckpt_io.c and engine/safetensors.c on a small
 * model: epochs of one and two ranks loaded whole (as zctl export and
 * sampling do), manifests and indexes edited by hand into ones that must
 * be refused, safetensors files with tensors the model does not have, and
 * both read through short reads as Linux gives them past 2 GiB.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ckpt_io.h"
#include "layout.h"
#include "safetensors.h"
#include "zt_common.h"
#include "zt_test.h"

static const zt_model_config_t k_cfg = {
    .n_layer = 2, .n_head = 2, .n_embd = 8, .seq_len = 4, .vocab_size = 16};
/* This binary's scratch directory, made at the first use. */
static const char *scratch(void) {
  static char dir[600];
  if (!dir[0]) {
    zt_log_set_level((zt_log_level_t)(ZT_LOG_ERROR + 1));
    snprintf(dir, sizeof dir, "%s", zt_test_tmpdir("engine_ckpt"));
  }
  return dir;
}

static int has(const char *want) {
  if (strstr(zt_err_msg(), want)) return 1;
  fprintf(stderr, "  message \"%s\" lacks \"%s\"\n", zt_err_msg(), want);
  return 0;
}

/* ---- checkpoints ------------------------------------------------------------- */

/* Element i of the parameters, Adam m and v (k = 0, 1, 2) of an epoch. */
static float value(int k, size_t i) { return (float)i + 0.25f * (float)k; }

/* Writes rank r of a `world`-rank epoch of k_cfg into dir: the rank's
 * share of every unit, as ZeRO shards them; with whole, the whole unit
 * (overlapping the other ranks' shares). */
static void write_rank(const char *dir, int r, int world, int whole) {
  zt_layout_t l;
  if (zt_layout_build(&l, &k_cfg) != 0) abort();
  size_t total = l.num_params;
  float *buf = zt_xcalloc(3 * total, sizeof(float));
  for (int k = 0; k < 3; k++)
    for (size_t i = 0; i < total; i++) buf[(size_t)k * total + i] = value(k, i);
  zt_ckpt_range_t *rg = zt_xcalloc((size_t)l.num_units, sizeof *rg);
  for (int u = 0; u < l.num_units; u++) {
    size_t usz = l.unit_size[u], s = (usz + (size_t)world - 1) / (size_t)world;
    size_t lo = ZT_MIN((size_t)r * s, usz), n = ZT_MIN(s, usz - lo);
    if (whole) lo = 0, n = usz;
    size_t at = l.unit_off[u] + lo;
    rg[u] = (zt_ckpt_range_t){u, lo, n, buf + at, buf + total + at, buf + 2 * total + at};
  }
  zt_ckpt_meta_t meta = {1, 1, 5, r, world, 1, k_cfg, 7, 2, NULL, 0, "", "", 0, 0, 0, 0, 0};
  zt_ckpt_file_t files[ZT_CKPT_FILES_PER_RANK];
  int nf;
  if (zt_ckpt_write(dir, &meta, rg, l.num_units, files, &nf) != 0) abort();
  free(rg);
  free(buf);
  zt_layout_free(&l);
}

/* A fresh epoch directory of `world` ranks. */
static const char *epoch(const char *name, int world) {
  static char dir[800];
  snprintf(dir, sizeof dir, "%s/%s", scratch(), name);
  for (int r = 0; r < world; r++) write_rank(dir, r, world, 0);
  return dir;
}

/* Sets member `key` of dir/name (or of its object `sub`) to v. */
static void edit(const char *dir, const char *name, const char *sub, const char *key, double v) {
  char path[1000], *text;
  size_t n;
  snprintf(path, sizeof path, "%s/%s", dir, name);
  if (zt_read_file(path, &text, &n, 1 << 20) != 0) abort();
  cJSON *doc = cJSON_Parse(text);
  free(text);
  cJSON *o = sub ? cJSON_GetObjectItemCaseSensitive(doc, sub) : doc;
  if (!o || !cJSON_ReplaceItemInObjectCaseSensitive(o, key, cJSON_CreateNumber(v))) abort();
  text = cJSON_Print(doc);
  FILE *f = fopen(path, "w");
  if (!f || fputs(text, f) < 0 || fclose(f) != 0) abort();
  free(text);
  cJSON_Delete(doc);
}

/* Loads the epoch in dir whole; 0 when it loaded (and then every
 * parameter must be the one written). */
static int load_whole(const char *dir) {
  zt_model_config_t cfg;
  zt_layout_t l = {0};
  float *flat = NULL;
  int64_t step = -1;
  if (zt_ckpt_read_model(dir, &cfg, NULL, 0) != 0) return -1;
  if (zt_ckpt_load_flat(dir, &cfg, &l, &flat, &step) != 0) {
    zt_layout_free(&l);
    return -1;
  }
  size_t bad = 0;
  for (size_t i = 0; i < l.num_params; i++) bad += flat[i] != value(0, i);
  ZT_CHECK(bad == 0 && step == 5);
  free(flat);
  zt_layout_free(&l);
  return 0;
}

/* Loads the parameters of every unit of the epoch in dir as a worker does
 * (zt_ckpt_load, no record). */
static int load_units(const char *dir) {
  zt_layout_t l;
  if (zt_layout_build(&l, &k_cfg) != 0) abort();
  float *flat = zt_xcalloc(l.num_params, sizeof(float));
  zt_ckpt_dest_t *dest = zt_xcalloc((size_t)l.num_units, sizeof *dest);
  for (int u = 0; u < l.num_units; u++)
    dest[u] = (zt_ckpt_dest_t){u, 0, l.unit_size[u], flat + l.unit_off[u], NULL, NULL};
  int64_t step;
  int rc = zt_ckpt_load(dir, &k_cfg, dest, l.num_units, &(zt_ckpt_record_t){NULL, 0}, &step);
  free(dest);
  free(flat);
  zt_layout_free(&l);
  return rc;
}

ZT_TEST(loads_one_and_two_ranks) {
  ZT_CHECK(load_whole(epoch("one", 1)) == 0);
  ZT_CHECK(load_whole(epoch("two", 2)) == 0);
  ZT_CHECK(load_whole(epoch("three", 3)) == 0);
}

/* A manifest that names a model past the spec's limits, or more
 * parameters than the rank files hold, is an error naming it (not an
 * allocation that ends the process). */
ZT_TEST(refuses_a_model_too_large) {
  const char *dir = epoch("huge_embd", 1);
  edit(dir, "manifest.json", "model", "n_embd", 1048576);
  zt_model_config_t cfg;
  ZT_CHECK(zt_ckpt_read_model(dir, &cfg, NULL, 0) == -1 && has("manifest.json"));

  /* Each field within its limit, 5e13 parameters in all. */
  dir = epoch("huge_total", 1);
  edit(dir, "manifest.json", "model", "n_layer", 1024);
  edit(dir, "manifest.json", "model", "n_embd", 65536);
  ZT_CHECK(load_whole(dir) == -1 && has("manifest.json") && has("corrupt checkpoint"));
}

/* world 2 -> 1 in the manifest of a 2-rank epoch: rank 1's share of every
 * unit would stay zero. */
ZT_TEST(refuses_ranges_that_miss_elements) {
  const char *dir = epoch("world", 2);
  ZT_CHECK(load_units(dir) == 0);
  edit(dir, "manifest.json", NULL, "world", 1);
  ZT_CHECK(load_units(dir) == -1 && has("rank_0.json") && has("corrupt checkpoint"));
  ZT_CHECK(load_whole(dir) == -1 && has("manifest.json") && has("corrupt checkpoint"));
  /* And with rank 0's index edited to match: its ranges are half of each unit. */
  edit(dir, "rank_0.json", NULL, "world", 1);
  ZT_CHECK(load_units(dir) == -1 && has("unit 0: ") && has(" elements (corrupt checkpoint)"));
  /* The index of each rank must be of the manifest's world, rank and step. */
  dir = epoch("index_step", 2);
  edit(dir, "rank_1.json", NULL, "step", 6);
  ZT_CHECK(load_whole(dir) == -1 && has("rank_1.json") && has("corrupt checkpoint"));
  dir = epoch("index_world", 2);
  edit(dir, "rank_0.json", NULL, "world", 3);
  ZT_CHECK(load_whole(dir) == -1 && has("rank_0.json") && has("corrupt checkpoint"));
}

/* Rank 1 holding whole units: its ranges overlap rank 0's. */
ZT_TEST(refuses_overlapping_ranges) {
  char dir[800];
  snprintf(dir, sizeof dir, "%s/overlap", scratch());
  write_rank(dir, 0, 2, 0);
  write_rank(dir, 1, 2, 1);
  ZT_CHECK(load_units(dir) == -1 && has("unit 0: ") && has("overlap"));
}

static void write_st(const char *path, const zt_model_config_t *cfg);
static int read_st(const char *path);

/* ---- short reads ------------------------------------------------------------ */

/* Linux reads at most 0x7ffff000 bytes per call, and a signal cuts a read
 * short: this binary's pread (it replaces the C library's for the code
 * linked in) returns at most g_cap bytes when g_cap is set, and fails
 * every other call with EINTR first, so small files take the paths of
 * huge ones. */
static size_t g_cap;
static int g_calls;

static int g_fail; /* an errno every pread fails with, when set */

ssize_t pread(int fd, void *buf, size_t len, off_t off) {
  if (g_fail) {
    errno = g_fail;
    return -1;
  }
  if (g_cap && g_calls++ % 2 == 0) {
    errno = EINTR;
    return -1;
  }
  return syscall(SYS_pread64, fd, buf, g_cap ? ZT_MIN(len, g_cap) : len, off);
}

ZT_TEST(loads_through_short_reads) {
  const char *dir = epoch("short", 2);
  char path[800];
  snprintf(path, sizeof path, "%s/short.safetensors", scratch());
  write_st(path, &k_cfg);
  g_cap = 7;
  ZT_CHECK(load_whole(dir) == 0);
  ZT_CHECK(read_st(path) == 0);
  ZT_CHECK(g_calls > 1000); /* the reads did go through the pread above */
  /* The end of the file before len bytes: an error naming file and offset. */
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  ZT_REQUIRE(fd >= 0);
  off_t end = lseek(fd, 0, SEEK_END);
  char buf[64];
  ZT_CHECK(zt_pread_all(fd, buf, sizeof buf, (uint64_t)end - 20, path) == -1 && has(path));
  char at[64];
  snprintf(at, sizeof at, "offset %lld", (long long)end);
  ZT_CHECK(has(at));
  g_cap = 0;
  close(fd);
}

/* What a failed load says about the epoch: its content at fault
 * (ZT_E_INVALID, ZT_E_NOT_FOUND: the worker has the epoch retired) or not
 * (ZT_E_FAILED: an I/O error, out of descriptors, which must not cost a
 * good epoch). */
ZT_TEST(load_errors_tell_content_from_io) {
  char path[900];
  const char *dir = epoch("kinds", 2);
  ZT_CHECK(load_units(dir) == 0);
  /* An I/O error reading a rank file. */
  g_fail = EIO;
  ZT_CHECK(load_units(dir) == -1 && zt_err_kind() == ZT_E_FAILED && has("rank_"));
  g_fail = 0;
  ZT_CHECK(load_units(dir) == 0);
  /* Out of descriptors: the manifest cannot even be opened. */
  static zt_test_fds_t fds;
  ZT_REQUIRE(zt_test_fds_use(&fds, 64) == 0);
  int rc = load_units(dir);
  zt_errkind_t kind = zt_err_kind();
  ZT_REQUIRE(zt_test_fds_back(&fds) == 0);
  ZT_CHECK(rc == -1 && kind == ZT_E_FAILED && has("manifest.json") && has("open files"));
  ZT_CHECK(load_units(dir) == 0);
  /* A rank file one byte short, and one with a byte changed. */
  snprintf(path, sizeof path, "%s/rank_1.bin", dir);
  ZT_REQUIRE(truncate(path, 4) == 0);
  ZT_CHECK(load_units(dir) == -1 && zt_err_kind() == ZT_E_INVALID && has("rank_1.bin"));
  dir = epoch("kinds", 2);
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  ZT_REQUIRE(fd >= 0 && pwrite(fd, "\x7f", 1, 9) == 1);
  close(fd);
  ZT_CHECK(load_units(dir) == -1 && zt_err_kind() == ZT_E_INVALID && has("checksum mismatch"));
  /* A missing rank file, and a missing index. */
  ZT_REQUIRE(unlink(path) == 0);
  ZT_CHECK(load_units(dir) == -1 && zt_err_kind() == ZT_E_NOT_FOUND && has("rank_1.bin"));
  dir = epoch("kinds", 2);
  snprintf(path, sizeof path, "%s/rank_0.json", dir);
  ZT_REQUIRE(unlink(path) == 0);
  ZT_CHECK(load_units(dir) == -1 && zt_err_kind() == ZT_E_NOT_FOUND && has("rank_0.json"));
  /* An index that is not JSON. */
  dir = epoch("kinds", 2);
  FILE *f = fopen(path, "w");
  ZT_REQUIRE(f && fputs("{\"rank\": ", f) >= 0 && fclose(f) == 0);
  ZT_CHECK(load_units(dir) == -1 && zt_err_kind() == ZT_E_INVALID && has("rank_0.json"));
}

/* ---- safetensors ------------------------------------------------------------- */

/* Writes the parameters of cfg (initialised) as a safetensors file. */
static void write_st(const char *path, const zt_model_config_t *cfg) {
  zt_layout_t l;
  if (zt_layout_build(&l, cfg) != 0) abort();
  float *flat = zt_xcalloc(l.num_params, sizeof(float));
  for (int u = 0; u < l.num_units; u++) zt_layout_init_unit(&l, 1, u, flat + l.unit_off[u]);
  if (zt_st_write(path, &l, flat, 0, 1, NULL) != 0) abort();
  free(flat);
  zt_layout_free(&l);
}

/* Adds a 1-element F32 entry `name` to the header of the file at path. */
static void add_tensor(const char *path, const char *name) {
  char *text;
  size_t n;
  if (zt_read_file(path, &text, &n, 1 << 20) != 0) abort();
  uint64_t hlen;
  memcpy(&hlen, text, 8);
  cJSON *hdr = cJSON_ParseWithLength(text + 8, hlen);
  cJSON *e = cJSON_AddObjectToObject(hdr, name);
  cJSON_AddStringToObject(e, "dtype", "F32");
  cJSON_AddItemToObject(e, "shape", cJSON_CreateIntArray((const int[]){1}, 1));
  cJSON_AddItemToObject(e, "data_offsets", cJSON_CreateIntArray((const int[]){0, 4}, 2));
  char *h = cJSON_PrintUnformatted(hdr);
  size_t nh = strlen(h), padded = (nh + 7) / 8 * 8;
  uint64_t le = padded;
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(&le, 8, 1, f) != 1 || fwrite(h, 1, nh, f) != nh) abort();
  for (size_t i = nh; i < padded; i++) fputc(' ', f);
  if (fwrite(text + 8 + hlen, 1, n - 8 - hlen, f) != n - 8 - hlen || fclose(f) != 0) abort();
  free(h);
  cJSON_Delete(hdr);
  free(text);
}

static int read_st(const char *path) {
  zt_layout_t l;
  if (zt_layout_build(&l, &k_cfg) != 0) abort();
  float *flat = zt_xcalloc(l.num_params, sizeof(float));
  int rc = zt_st_read(path, &l, flat);
  free(flat);
  zt_layout_free(&l);
  return rc;
}

/* A 3-layer file does not load into the 2-layer model; a name the reader
 * does not know is refused too, the documented ignored ones are not. */
ZT_TEST(safetensors_refuses_extra_tensors) {
  char path[800];
  snprintf(path, sizeof path, "%s/m.safetensors", scratch());
  write_st(path, &k_cfg);
  ZT_CHECK(read_st(path) == 0);
  add_tensor(path, "lm_head.weight");
  add_tensor(path, "transformer.h.1.attn.bias");
  add_tensor(path, "h.0.attn.masked_bias");
  ZT_CHECK(read_st(path) == 0);

  zt_model_config_t deeper = k_cfg;
  deeper.n_layer = 3;
  write_st(path, &deeper);
  ZT_CHECK(read_st(path) == -1 && has(path) && has("transformer.h.2."));

  write_st(path, &k_cfg);
  add_tensor(path, "transformer.h.0.mlp.c_gate.weight");
  ZT_CHECK(read_st(path) == -1 && has("transformer.h.0.mlp.c_gate.weight"));
  write_st(path, &k_cfg);
  add_tensor(path, "h.01.ln_1.weight");
  ZT_CHECK(read_st(path) == -1 && has("h.01.ln_1.weight"));
  write_st(path, &k_cfg);
  add_tensor(path, "score.weight");
  ZT_CHECK(read_st(path) == -1 && has("score.weight"));
}

/* A rename that fails (the name is a directory that is not empty) takes
 * the temporary file back. */
ZT_TEST(safetensors_write_failure_leaves_no_tmp) {
  char path[800], inner[900], tmpf[900];
  snprintf(path, sizeof path, "%s/taken.safetensors", scratch());
  snprintf(inner, sizeof inner, "%s/x", path);
  snprintf(tmpf, sizeof tmpf, "%s.tmp", path);
  ZT_REQUIRE(zt_mkdirs(inner) == 0);
  zt_layout_t l;
  ZT_REQUIRE(zt_layout_build(&l, &k_cfg) == 0);
  float *flat = zt_xcalloc(l.num_params, sizeof(float));
  ZT_CHECK(zt_st_write(path, &l, flat, 0, 1, NULL) == -1 && has(path));
  ZT_CHECK(access(tmpf, F_OK) != 0);
  free(flat);
  zt_layout_free(&l);
}

/* ---- the writer thread ------------------------------------------------------- */

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_in_done, g_release;

/* A report that takes until the test releases it (a coordinator out of
 * reach), at most 20 s. */
static int slow_done(void *user, int64_t step, const char *dir, const zt_ckpt_file_t *files,
                     int nfiles, const char *error) {
  (void)user, (void)step, (void)dir, (void)files, (void)nfiles, (void)error;
  zt_deadline_t dl = zt_deadline_in(20000);
  pthread_mutex_lock(&g_mu);
  g_in_done = 1;
  while (!g_release && !zt_deadline_passed(dl)) {
    pthread_mutex_unlock(&g_mu);
    zt_sleep_ms(5);
    pthread_mutex_lock(&g_mu);
  }
  pthread_mutex_unlock(&g_mu);
  return 0;
}

/* zt_ckpt_writer_reporting, asked right after an epoch is handed over,
 * waits for its write and answers its step while the report is still
 * running: the trainer skips the next periodic epoch then instead of
 * waiting for the report (it answered 0 while the write ran, and the
 * trainer then waited in zt_ckpt_writer_buffer for the whole report). */
ZT_TEST(writer_reports_the_epoch_being_reported) {
  zt_layout_t l;
  ZT_REQUIRE(zt_layout_build(&l, &k_cfg) == 0);
  zt_ckpt_writer_t *w;
  ZT_REQUIRE(zt_ckpt_writer_start(slow_done, NULL, &w) == 0);
  float *buf = zt_ckpt_writer_buffer(w, 3 * l.num_params);
  for (size_t i = 0; i < 3 * l.num_params; i++) buf[i] = (float)i;
  zt_ckpt_range_t *rg = zt_xcalloc((size_t)l.num_units, sizeof *rg);
  for (int u = 0; u < l.num_units; u++) {
    size_t at = l.unit_off[u];
    rg[u] = (zt_ckpt_range_t){u, 0, l.unit_size[u], buf + at, buf + l.num_params + at,
                              buf + 2 * l.num_params + at};
  }
  zt_ckpt_meta_t meta = {1, 1, 5, 0, 1, 1, k_cfg, 7, 2, NULL, 0, "", "", 0, 0, 0, 0, 0};
  char dir[800];
  snprintf(dir, sizeof dir, "%s/writer", scratch());
  ZT_REQUIRE(zt_ckpt_writer_submit(w, dir, &meta, rg, l.num_units) == 0);
  ZT_CHECK(zt_ckpt_writer_reporting(w) == 5); /* the write ended, the report runs */
  zt_deadline_t dl = zt_deadline_in(10000);
  pthread_mutex_lock(&g_mu);
  while (!g_in_done && !zt_deadline_passed(dl)) {
    pthread_mutex_unlock(&g_mu);
    zt_sleep_ms(1);
    pthread_mutex_lock(&g_mu);
  }
  pthread_mutex_unlock(&g_mu);
  ZT_CHECK(g_in_done);
  ZT_CHECK(zt_ckpt_writer_reporting(w) == 5); /* during the report, without waiting */
  pthread_mutex_lock(&g_mu);
  g_release = 1;
  pthread_mutex_unlock(&g_mu);
  zt_ckpt_writer_stop(w);
  free(rg);
  zt_layout_free(&l);
}

ZT_TEST_MAIN(loads_one_and_two_ranks, refuses_a_model_too_large, refuses_ranges_that_miss_elements,
             refuses_overlapping_ranges, loads_through_short_reads,
             load_errors_tell_content_from_io, safetensors_refuses_extra_tensors,
             safetensors_write_failure_leaves_no_tmp, writer_reports_the_epoch_being_reported)
