/*
 * ckpt_io.c: writing and loading sharded checkpoint epochs (see ckpt_io.h).
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "ckpt_io.h"
#include "spec.h"
#include "zt_common.h"
#include "zt_json.h"

void zt_ckpt_dirname(char *buf, size_t n, const char *root, uint64_t job, int64_t step,
                     uint64_t gen) {
  char name[ZT_EPOCH_NAME_MAX];
  zt_epoch_name(name, sizeof name, job, step, gen);
  snprintf(buf, n, "%s/%s", root, name);
}

int zt_ckpt_fsync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return zt_err_errno("open %s", dir);
  int rc = fsync(fd);
  close(fd);
  return rc == 0 ? 0 : zt_err_errno("fsync %s", dir);
}

/* Test knob ZT_FAULT_KILL_IN_CKPT_STEP=S: this process kills itself
 * (SIGKILL) half-way through writing its rank file of the first epoch it
 * writes at step S or later, as a machine dying mid-write would (at or
 * later: the ranks skip a periodic epoch together while one of them is
 * still busy with the previous one). */
static void maybe_die(int64_t step, int part, int nparts) {
  int64_t at = zt_knob(ZT_KNOB_KILL_IN_CKPT_STEP, -1);
  if (at >= 0 && step >= at && part == nparts / 2) raise(SIGKILL);
}

/* Writes data as dir/name atomically: name.tmp, fsync, rename. */
static int write_atomic(const char *dir, const char *name, const void *const *parts,
                        const size_t *lens, int nparts, uint64_t *hash_out, uint64_t *bytes_out,
                        int64_t fault_step) {
  char tmp[ZT_PATH_MAX], final[ZT_PATH_MAX];
  if (zt_path_fmt(tmp, sizeof tmp, "%s/%s.tmp", dir, name) != 0 ||
      zt_path_join(final, sizeof final, dir, name) != 0)
    return -1;
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return zt_err_errno("create %s", tmp);
  XXH64_state_t *h = XXH64_createState();
  XXH64_reset(h, 0);
  uint64_t total = 0;
  for (int i = 0; i < nparts; i++) {
    if (fault_step >= 0) maybe_die(fault_step, i, nparts);
    if (zt_write_all(fd, parts[i], lens[i]) != 0) {
      zt_err_wrap("write %s", tmp);
      goto err;
    }
    XXH64_update(h, parts[i], lens[i]);
    total += lens[i];
  }
  if (fsync(fd) != 0) {
    zt_err_errno("fsync %s", tmp);
    goto err;
  }
  close(fd);
  fd = -1;
  if (rename(tmp, final) != 0) {
    zt_err_errno("rename %s", tmp);
    goto err;
  }
  if (hash_out) *hash_out = XXH64_digest(h);
  if (bytes_out) *bytes_out = total;
  XXH64_freeState(h);
  return 0;
err:
  if (fd >= 0) close(fd);
  unlink(tmp);
  XXH64_freeState(h);
  return -1;
}

static cJSON *model_json(const zt_model_config_t *m) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "n_layer", m->n_layer);
  cJSON_AddNumberToObject(o, "n_head", m->n_head);
  cJSON_AddNumberToObject(o, "n_embd", m->n_embd);
  cJSON_AddNumberToObject(o, "seq_len", m->seq_len);
  cJSON_AddNumberToObject(o, "vocab_size", m->vocab_size);
  if (m->arch == ZT_ARCH_LLAMA) {
    cJSON_AddStringToObject(o, "arch", "llama");
    cJSON_AddNumberToObject(o, "n_kv_head", m->n_kv_head);
    cJSON_AddNumberToObject(o, "head_dim", m->head_dim);
    cJSON_AddNumberToObject(o, "intermediate_size", m->n_ff);
    cJSON_AddNumberToObject(o, "rope_theta", zt_float_decimal(m->rope_theta));
    cJSON_AddNumberToObject(o, "rms_norm_eps", zt_float_decimal(m->norm_eps));
    if (m->max_pos) cJSON_AddNumberToObject(o, "max_position_embeddings", m->max_pos);
    if (m->rope_factor != 0) cJSON_AddItemToObject(o, "rope_scaling", zt_spec_rope_json(m));
    cJSON_AddBoolToObject(o, "tie_word_embeddings", m->tie_embed);
    cJSON_AddBoolToObject(o, "attention_bias", m->qkv_bias);
  }
  if (m->lora_r) {
    cJSON *l = cJSON_AddObjectToObject(o, "lora");
    cJSON_AddNumberToObject(l, "r", m->lora_r);
    cJSON_AddNumberToObject(l, "alpha", m->lora_alpha);
    cJSON_AddItemToObject(l, "target_modules", zt_lora_targets_json(m->lora_targets));
  }
  return o;
}

void zt_ckpt_checksum_text(char out[32], uint64_t hash) {
  snprintf(out, 32, "xxh64:%016llx", (unsigned long long)hash);
}

int zt_ckpt_checksum_valid(const char *s) {
  if (strncmp(s, "xxh64:", 6) != 0 || strlen(s) != 22) return 0;
  for (const char *p = s + 6; *p; p++)
    if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'))) return 0;
  return 1;
}

/* Writes doc as dir/name and describes the file in f. */
static int write_json(const char *dir, const char *name, cJSON *doc, zt_ckpt_file_t *f) {
  char *text = cJSON_Print(doc);
  if (!text) return zt_err("%s/%s: out of memory formatting JSON", dir, name);
  size_t len = strlen(text);
  const void *parts[1] = {text};
  uint64_t hash = 0, bytes = 0;
  int rc = write_atomic(dir, name, parts, &len, 1, &hash, &bytes, -1);
  free(text);
  if (rc != 0) return -1;
  snprintf(f->name, sizeof f->name, "%s", name);
  f->bytes = bytes;
  zt_ckpt_checksum_text(f->checksum, hash);
  return 0;
}

static int write_epoch_files(const char *dir, const zt_ckpt_meta_t *meta, const zt_ckpt_range_t *r,
                             int nr, zt_ckpt_file_t *files, int *nfiles) {
  /* rank_<r>.bin: per range, p then m then v. */
  int nparts = 3 * nr;
  const void **parts = zt_xcalloc((size_t)nparts + 1, sizeof *parts);
  size_t *lens = zt_xcalloc((size_t)nparts + 1, sizeof *lens);
  cJSON *idx = cJSON_CreateObject();
  cJSON_AddNumberToObject(idx, "rank", meta->rank);
  cJSON_AddNumberToObject(idx, "world", meta->world);
  cJSON_AddNumberToObject(idx, "step", (double)meta->step);
  cJSON *units = cJSON_AddArrayToObject(idx, "ranges");
  uint64_t off = 0;
  for (int i = 0; i < nr; i++) {
    size_t b = (size_t)r[i].n * sizeof(float);
    parts[3 * i] = r[i].p, parts[3 * i + 1] = r[i].m, parts[3 * i + 2] = r[i].v;
    lens[3 * i] = lens[3 * i + 1] = lens[3 * i + 2] = b;
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "unit", r[i].unit);
    cJSON_AddNumberToObject(u, "lo", (double)r[i].lo);
    cJSON_AddNumberToObject(u, "n", (double)r[i].n);
    cJSON_AddNumberToObject(u, "offset", (double)off);
    cJSON_AddItemToArray(units, u);
    off += 3 * b;
  }
  char bin[64], js[64];
  snprintf(bin, sizeof bin, "rank_%d.bin", meta->rank);
  snprintf(js, sizeof js, "rank_%d.json", meta->rank);
  uint64_t hash = 0, bytes = 0;
  int rc = write_atomic(dir, bin, parts, lens, nparts, &hash, &bytes, meta->step);
  free(parts);
  free(lens);
  if (rc != 0) {
    cJSON_Delete(idx);
    return -1;
  }
  zt_ckpt_file_t *f = &files[(*nfiles)++];
  snprintf(f->name, sizeof f->name, "%s", bin);
  f->bytes = bytes;
  zt_ckpt_checksum_text(f->checksum, hash);
  cJSON_AddStringToObject(idx, "file", bin);
  cJSON_AddNumberToObject(idx, "bytes", (double)bytes);
  cJSON_AddStringToObject(idx, "checksum", f->checksum);
  rc = write_json(dir, js, idx, &files[(*nfiles)++]);
  cJSON_Delete(idx);
  if (rc != 0) return -1;
  if (meta->rank == 0) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddNumberToObject(m, "format", 1);
    cJSON_AddNumberToObject(m, "job_id", (double)meta->job_id);
    cJSON_AddNumberToObject(m, "generation", (double)meta->generation);
    cJSON_AddNumberToObject(m, "step", (double)meta->step);
    cJSON_AddNumberToObject(m, "world", meta->world);
    cJSON_AddNumberToObject(m, "zero_stage", meta->stage);
    cJSON_AddItemToObject(m, "model", model_json(&meta->model));
    cJSON_AddNumberToObject(m, "seed", (double)meta->seed);
    cJSON_AddNumberToObject(m, "global_batch", (double)meta->global_batch);
    cJSON_AddNumberToObject(m, "data_cursor", (double)meta->step * (double)meta->global_batch);
    if (meta->tokenizer[0]) cJSON_AddStringToObject(m, "tokenizer", meta->tokenizer);
    if (meta->model.lora_r) {
      cJSON *b = cJSON_AddObjectToObject(m, "lora_base");
      char sum[32];
      zt_ckpt_checksum_text(sum, meta->lora_base_hash);
      cJSON_AddStringToObject(b, "path", meta->lora_base);
      cJSON_AddStringToObject(b, "params_xxh64", sum);
    }
    if (meta->diloco_groups) {
      cJSON *d = cJSON_AddObjectToObject(m, "diloco");
      cJSON_AddNumberToObject(d, "groups", meta->diloco_groups);
      cJSON_AddNumberToObject(d, "units", meta->diloco_units);
      cJSON_AddNumberToObject(d, "inner_steps", (double)meta->diloco_inner_steps);
      if (meta->diloco_ef) cJSON_AddNumberToObject(d, "error_feedback", 1);
    }
    cJSON *sk = cJSON_AddArrayToObject(m, "skip_ranges");
    for (int i = 0; i < meta->nskips; i++) {
      cJSON *p = cJSON_CreateArray();
      cJSON_AddItemToArray(p, cJSON_CreateNumber((double)meta->skips[i].start));
      cJSON_AddItemToArray(p, cJSON_CreateNumber((double)meta->skips[i].end));
      cJSON_AddItemToArray(sk, p);
    }
    rc = write_json(dir, "manifest.json", m, &files[(*nfiles)++]);
    cJSON_Delete(m);
    if (rc != 0) return -1;
  }
  return zt_ckpt_fsync_dir(dir);
}

/* A failed write takes back what it wrote (a full disk gets its space
 * back), and the directory too when no other rank's files are in it. So a
 * rank's directory can vanish under it when another rank's write failed
 * first (its files not yet created, the directory empty): it then makes
 * the directory again and retries, at most twice, so that it reports its
 * own failure (a full disk) rather than the missing directory. */
int zt_ckpt_write(const char *dir, const zt_ckpt_meta_t *meta, const zt_ckpt_range_t *r, int nr,
                  zt_ckpt_file_t *files, int *nfiles) {
  *nfiles = 0;
  for (int attempt = 0;; attempt++) {
    if (zt_mkdirs(dir) != 0) return zt_err_wrap("checkpoint");
    if (write_epoch_files(dir, meta, r, nr, files, nfiles) == 0) return 0;
    struct stat st;
    if (attempt == 2 || stat(dir, &st) == 0) break; /* still there: a failure of its own */
    *nfiles = 0;
  }
  char path[ZT_PATH_MAX];
  if (zt_path_fmt(path, sizeof path, "%s/rank_%d.bin", dir, meta->rank) == 0) unlink(path);
  if (zt_path_fmt(path, sizeof path, "%s/rank_%d.json", dir, meta->rank) == 0) unlink(path);
  if (meta->rank == 0 && zt_path_join(path, sizeof path, dir, "manifest.json") == 0) unlink(path);
  rmdir(dir);
  *nfiles = 0;
  return -1;
}

/* ---- loading ------------------------------------------------------------------ */

static const zt_ckpt_file_t *recorded(const zt_ckpt_record_t *rec, const char *name) {
  for (int i = 0; rec && i < rec->n; i++)
    if (!strcmp(rec->files[i].name, name)) return &rec->files[i];
  return NULL;
}

static int hash_matches(const char *path, const void *data, size_t len,
                        const zt_ckpt_file_t *want) {
  char got[32];
  zt_ckpt_checksum_text(got, XXH64(data, len, 0));
  if (len != want->bytes)
    return zt_errk(ZT_E_INVALID, "%s: size %zu, expected %llu (truncated or corrupt checkpoint)",
                   path, len, (unsigned long long)want->bytes);
  if (strcmp(got, want->checksum) != 0)
    return zt_errk(ZT_E_INVALID, "%s: checksum mismatch (%s, expected %s): corrupt checkpoint",
                   path, got, want->checksum);
  return 0;
}

/* Reads dir/name as JSON; with a record, the file must be in it and match
 * before it is parsed. */
static cJSON *read_json(const char *dir, const char *name, const zt_ckpt_record_t *rec) {
  char path[ZT_PATH_MAX];
  if (zt_path_join(path, sizeof path, dir, name) != 0) return NULL;
  const zt_ckpt_file_t *want = recorded(rec, name);
  if (rec && rec->n && !want) {
    zt_errk(ZT_E_INVALID, "%s: not in the epoch's record (corrupt checkpoint)", path);
    return NULL;
  }
  char *text;
  size_t len;
  if (zt_read_file(path, &text, &len, 64 << 20) != 0) {
    if (access(path, F_OK) != 0 && errno == ENOENT)
      zt_errk(ZT_E_NOT_FOUND, "%s: %s", path, strerror(ENOENT));
    return NULL;
  }
  if (want && hash_matches(path, text, len, want) != 0) {
    free(text);
    return NULL;
  }
  cJSON *doc = zt_json_parse(text, len, path);
  free(text);
  if (!doc) zt_err_wrap("corrupt checkpoint");
  return doc;
}

/* Whole-number field k of o in [0, max]; -1 when it is missing, not a
 * whole number or out of range (a value from a file is never converted
 * to an integer type it does not fit). */
static int64_t int_field(cJSON *o, const char *k, int64_t max) {
  cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  if (!cJSON_IsNumber(v)) return -1;
  double d = v->valuedouble;
  if (!(d >= 0 && d <= (double)max) || d != floor(d)) return -1;
  return (int64_t)d;
}

#define ZT_CKPT_MAX_ELEMS (1ll << 40) /* elements of one unit */
#define ZT_CKPT_MAX_BYTES (1ll << 50) /* bytes of one file */

/* Streams a file through xxh64 and compares with the expected checksum. */
int zt_ckpt_verify_file(const char *path, uint64_t bytes, const char *want) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0 && (errno == ENOENT || errno == ENOTDIR))
    return zt_errk(ZT_E_NOT_FOUND, "%s: %s", path, strerror(errno));
  if (fd < 0) return zt_err_errno("%s", path);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    zt_err_errno("%s", path);
    close(fd);
    return -1;
  }
  if ((uint64_t)st.st_size != bytes) {
    close(fd);
    return zt_errk(ZT_E_INVALID, "%s: size %lld, expected %llu (truncated or corrupt checkpoint)",
                   path, (long long)st.st_size, (unsigned long long)bytes);
  }
  XXH64_state_t *h = XXH64_createState();
  XXH64_reset(h, 0);
  static _Thread_local char buf[1 << 20];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) XXH64_update(h, buf, (size_t)n);
  close(fd);
  char got[32];
  zt_ckpt_checksum_text(got, XXH64_digest(h));
  XXH64_freeState(h);
  if (n < 0) return zt_err_errno("read %s", path);
  if (strcmp(got, want) != 0)
    return zt_errk(ZT_E_INVALID, "%s: checksum mismatch (%s, expected %s): corrupt checkpoint",
                   path, got, want);
  return 0;
}

/* A manifest model's lora object (absent: none) into cfg; -1 when it is
 * malformed. */
static int lora_fields(const cJSON *mm, zt_model_config_t *cfg) {
  const cJSON *l = cJSON_GetObjectItemCaseSensitive(mm, "lora");
  cfg->lora_r = 0, cfg->lora_alpha = 0, cfg->lora_targets = 0;
  if (!l) return 0;
  const cJSON *alpha = cJSON_GetObjectItemCaseSensitive(l, "alpha");
  const cJSON *t = cJSON_GetObjectItemCaseSensitive(l, "target_modules"), *it;
  cfg->lora_r = (int)int_field((cJSON *)l, "r", 4096);
  if (cfg->lora_r < 1 || !cJSON_IsNumber(alpha) || !cJSON_IsArray(t)) return -1;
  cfg->lora_alpha = (float)alpha->valuedouble;
  cJSON_ArrayForEach(it, t) {
    int found = zt_lora_target_index(cJSON_IsString(it) ? it->valuestring : NULL);
    if (found < 0) return -1;
    cfg->lora_targets |= 1u << found;
  }
  return 0;
}

/* The llama fields of a manifest's model (absent: gpt2) into cfg; 0 when
 * they are absent or well-formed. */
static int llama_fields(const cJSON *mm, zt_model_config_t *cfg) {
  const cJSON *arch = cJSON_GetObjectItemCaseSensitive(mm, "arch");
  cfg->arch = ZT_ARCH_GPT2;
  if (lora_fields(mm, cfg) != 0) return -1;
  if (!arch) return 0;
  if (!cJSON_IsString(arch) || strcmp(arch->valuestring, "llama")) return -1;
  cfg->arch = ZT_ARCH_LLAMA;
  const cJSON *theta = cJSON_GetObjectItemCaseSensitive(mm, "rope_theta");
  const cJSON *eps = cJSON_GetObjectItemCaseSensitive(mm, "rms_norm_eps");
  const cJSON *tie = cJSON_GetObjectItemCaseSensitive(mm, "tie_word_embeddings");
  const cJSON *bias = cJSON_GetObjectItemCaseSensitive(mm, "attention_bias");
  cfg->n_kv_head = (int)int_field((cJSON *)mm, "n_kv_head", ZT_MODEL_MAX_HEAD);
  cfg->head_dim = (int)int_field((cJSON *)mm, "head_dim", ZT_MODEL_MAX_EMBD);
  cfg->n_ff = (int)int_field((cJSON *)mm, "intermediate_size", 4 * ZT_MODEL_MAX_EMBD);
  const cJSON *mp = cJSON_GetObjectItemCaseSensitive(mm, "max_position_embeddings");
  cfg->max_pos = mp ? (int)int_field((cJSON *)mm, "max_position_embeddings", 1 << 24) : 0;
  if (cfg->max_pos < 0) return -1;
  if (!cJSON_IsNumber(theta) || !cJSON_IsNumber(eps) || !cJSON_IsBool(tie) || !cJSON_IsBool(bias))
    return -1;
  cfg->rope_theta = (float)theta->valuedouble;
  cfg->norm_eps = (float)eps->valuedouble;
  cfg->tie_embed = cJSON_IsTrue(tie);
  cfg->qkv_bias = cJSON_IsTrue(bias);
  if (zt_spec_rope_parse(cJSON_GetObjectItemCaseSensitive(mm, "rope_scaling"),
                            "manifest model.rope_scaling", cfg) != 0)
    return -1;
  return cfg->n_kv_head < 1 || cfg->head_dim < 1 || cfg->n_ff < 1 ? -1 : 0;
}

/* The manifest's architecture equals the job's. */
static int same_arch(const cJSON *mm, const zt_model_config_t *model) {
  zt_model_config_t got = *model;
  if (llama_fields(mm, &got) != 0 || got.arch != model->arch) return 0;
  return got.arch == ZT_ARCH_GPT2 ||
         (got.n_kv_head == model->n_kv_head && got.head_dim == model->head_dim &&
          got.n_ff == model->n_ff && got.rope_theta == model->rope_theta &&
          got.norm_eps == model->norm_eps && got.tie_embed == model->tie_embed &&
          got.qkv_bias == model->qkv_bias && zt_spec_rope_same(&got, model) &&
          got.lora_r == model->lora_r && got.lora_alpha == model->lora_alpha &&
          got.lora_targets == model->lora_targets);
}

/* The manifest: checked against the record and the model; its world. */
static int read_manifest(const char *dir, const zt_model_config_t *model,
                         const zt_ckpt_record_t *rec, int *world, int64_t *step) {
  cJSON *man = read_json(dir, "manifest.json", rec);
  if (!man) return -1;
  *world = (int)int_field(man, "world", 65536);
  *step = int_field(man, "step", 1ll << 53);
  cJSON *mm = cJSON_GetObjectItemCaseSensitive(man, "model");
  int ok = *world >= 1 && *step >= 0 && mm &&
           int_field(mm, "n_layer", INT32_MAX) == model->n_layer &&
           int_field(mm, "n_head", INT32_MAX) == model->n_head &&
           int_field(mm, "n_embd", INT32_MAX) == model->n_embd &&
           int_field(mm, "seq_len", INT32_MAX) == model->seq_len &&
           int_field(mm, "vocab_size", INT32_MAX) == model->vocab_size && same_arch(mm, model);
  cJSON_Delete(man);
  if (!ok)
    return zt_errk(ZT_E_INVALID,
                   "%s/manifest.json: model or layout does not match the job (mismatched "
                   "checkpoint)",
                   dir);
  /* The record holds exactly the files of `world` ranks. */
  if (rec && rec->n && rec->n != 2 * *world + 1)
    return zt_errk(ZT_E_INVALID,
                   "%s/manifest.json: %d ranks, but the epoch's record holds %d files (corrupt "
                   "checkpoint)",
                   dir, *world, rec->n);
  return 0;
}

/* What the ranges of an epoch filled of destination d: elements [a, b). */
typedef struct {
  int d;
  uint64_t a, b;
} piece_t;

typedef struct {
  piece_t *v;
  size_t n, cap;
} pieces_t;

static void add_piece(pieces_t *got, int d, uint64_t a, uint64_t b) {
  if (got->n == got->cap) {
    got->cap = got->cap ? 2 * got->cap : 64;
    got->v = zt_xrealloc(got->v, got->cap * sizeof *got->v);
  }
  got->v[got->n++] = (piece_t){d, a, b};
}

static int cmp_piece(const void *x, const void *y) {
  const piece_t *p = x, *q = y;
  if (p->d != q->d) return p->d < q->d ? -1 : 1;
  return p->a < q->a ? -1 : p->a > q->a;
}

/* Every element of every destination was read, and once: the ranks'
 * ranges neither miss one (a manifest whose world leaves a rank out, an
 * index that drops a range) nor overlap. */
static int check_coverage(const char *dir, int world, const zt_ckpt_dest_t *dest, int nd,
                          pieces_t *got) {
  qsort(got->v, got->n, sizeof *got->v, cmp_piece);
  size_t i = 0;
  for (int d = 0; d < nd; d++) {
    uint64_t end = dest[d].lo, covered = 0;
    for (; i < got->n && got->v[i].d == d; i++) {
      if (got->v[i].a < end)
        return zt_errk(ZT_E_INVALID,
                       "%s: %d ranks: unit %d: ranges overlap at element %llu (corrupt "
                       "checkpoint)",
                       dir, world, dest[d].unit, (unsigned long long)got->v[i].a);
      covered += got->v[i].b - got->v[i].a;
      end = got->v[i].b;
    }
    if (covered != dest[d].n)
      return zt_errk(
          ZT_E_INVALID, "%s: %d ranks: unit %d: %llu of %llu elements (corrupt checkpoint)", dir,
          world, dest[d].unit, (unsigned long long)covered, (unsigned long long)dest[d].n);
  }
  return 0;
}

/* Copies the parts of one index's ranges that the destinations want,
 * adding what each filled to got. */
static int copy_ranges(const char *path, int fd, const char *idxname, cJSON *ranges,
                       const zt_ckpt_dest_t *dest, int nd, pieces_t *got) {
  cJSON *rg;
  cJSON_ArrayForEach(rg, ranges) {
    int u = (int)int_field(rg, "unit", 1 << 20);
    int64_t lo = int_field(rg, "lo", ZT_CKPT_MAX_ELEMS), n = int_field(rg, "n", ZT_CKPT_MAX_ELEMS),
            off = int_field(rg, "offset", ZT_CKPT_MAX_BYTES);
    if (u < 0 || lo < 0 || n < 0 || off < 0)
      return zt_errk(ZT_E_INVALID, "%s: malformed range (corrupt checkpoint)", idxname);
    for (int d = 0; d < nd; d++) {
      if (dest[d].unit != u) continue;
      uint64_t a = ZT_MAX((uint64_t)lo, dest[d].lo);
      uint64_t b = ZT_MIN((uint64_t)lo + (uint64_t)n, dest[d].lo + dest[d].n);
      if (a >= b) continue;
      add_piece(got, d, a, b);
      size_t cnt = (size_t)(b - a) * sizeof(float);
      float *dst[3] = {dest[d].p, dest[d].m, dest[d].v};
      for (int k = 0; k < 3; k++) {
        if (!dst[k]) continue;
        uint64_t at = (uint64_t)off + ((uint64_t)k * (uint64_t)n + (a - (uint64_t)lo)) * 4;
        if (zt_pread_all(fd, dst[k] + (a - dest[d].lo), cnt, at, path) != 0)
          return zt_err_kind() == ZT_E_INVALID ? zt_err_wrap("corrupt checkpoint") : -1;
      }
    }
  }
  return 0;
}

/* Rank r's index and data: verified, then the wanted ranges copied. The
 * index must be rank r's of the manifest's world and step. */
static int load_rank(const char *dir, int r, int world, int64_t step, const zt_ckpt_record_t *rec,
                     const zt_ckpt_dest_t *dest, int nd, pieces_t *got) {
  char js[64], path[ZT_PATH_MAX];
  snprintf(js, sizeof js, "rank_%d.json", r);
  cJSON *idx = read_json(dir, js, rec);
  if (!idx) return -1;
  cJSON *file = cJSON_GetObjectItemCaseSensitive(idx, "file");
  cJSON *sum = cJSON_GetObjectItemCaseSensitive(idx, "checksum");
  cJSON *ranges = cJSON_GetObjectItemCaseSensitive(idx, "ranges");
  int rc = -1, fd = -1;
  if (!cJSON_IsString(file) || !cJSON_IsString(sum) || !cJSON_IsArray(ranges) ||
      strchr(file->valuestring, '/')) {
    zt_errk(ZT_E_INVALID, "%s/%s: malformed index (corrupt checkpoint)", dir, js);
    goto out;
  }
  if (int_field(idx, "rank", 65536) != r || int_field(idx, "world", 65536) != world ||
      int_field(idx, "step", 1ll << 53) != step) {
    zt_errk(ZT_E_INVALID,
            "%s/%s: not the index of rank %d of %d at step %lld that manifest.json names (corrupt "
            "checkpoint)",
            dir, js, r, world, (long long)step);
    goto out;
  }
  if (zt_path_join(path, sizeof path, dir, file->valuestring) != 0) goto out;
  const zt_ckpt_file_t *want = recorded(rec, file->valuestring);
  if (rec && rec->n && (!want || strcmp(want->checksum, sum->valuestring) != 0)) {
    zt_errk(ZT_E_INVALID,
            "%s/%s: names %s, which the epoch's record does not hold with that checksum (corrupt "
            "checkpoint)",
            dir, js, file->valuestring);
    goto out;
  }
  int64_t bytes = want ? (int64_t)want->bytes : int_field(idx, "bytes", ZT_CKPT_MAX_BYTES);
  if (bytes < 0) {
    zt_errk(ZT_E_INVALID, "%s/%s: malformed size (corrupt checkpoint)", dir, js);
    goto out;
  }
  if (zt_ckpt_verify_file(path, (uint64_t)bytes, sum->valuestring) != 0) goto out;
  fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    zt_err_errno("%s", path);
    goto out;
  }
  rc = copy_ranges(path, fd, js, ranges, dest, nd, got);
out:
  if (fd >= 0) close(fd);
  cJSON_Delete(idx);
  return rc;
}

int zt_ckpt_load(const char *dir, const zt_model_config_t *model, const zt_ckpt_dest_t *dest,
                 int nd, const zt_ckpt_record_t *rec, int64_t *step) {
  int world;
  if (read_manifest(dir, model, rec, &world, step) != 0) return zt_err_wrap("load checkpoint");
  pieces_t got = {NULL, 0, 0};
  int rc = 0;
  for (int r = 0; rc == 0 && r < world; r++)
    rc = load_rank(dir, r, world, *step, rec, dest, nd, &got);
  if (rc == 0) rc = check_coverage(dir, world, dest, nd, &got);
  free(got.v);
  return rc;
}

/* ---- a whole epoch, for export and sampling ---------------------------------- */

int zt_ckpt_read_model(const char *dir, zt_model_config_t *cfg, char *tokenizer, size_t cap) {
  memset(cfg, 0, sizeof *cfg);
  if (tokenizer && cap) tokenizer[0] = 0;
  cJSON *man = read_json(dir, "manifest.json", NULL);
  if (!man) return -1;
  const cJSON *m = cJSON_GetObjectItemCaseSensitive(man, "model");
  const char *keys[] = {"n_layer", "n_head", "n_embd", "seq_len", "vocab_size"};
  const int max[] = {ZT_MODEL_MAX_LAYER, ZT_MODEL_MAX_HEAD, ZT_MODEL_MAX_EMBD, ZT_MODEL_MAX_SEQ,
                     ZT_MODEL_MAX_VOCAB};
  int *dst[] = {&cfg->n_layer, &cfg->n_head, &cfg->n_embd, &cfg->seq_len, &cfg->vocab_size};
  int ok = cJSON_IsObject(m);
  for (int i = 0; ok && i < 5; i++) {
    int64_t v = int_field((cJSON *)m, keys[i], max[i]);
    ok = v >= 1;
    *dst[i] = (int)v;
  }
  ok = ok && llama_fields(m, cfg) == 0;
  const cJSON *tok = cJSON_GetObjectItemCaseSensitive(man, "tokenizer");
  if (ok && tokenizer && cJSON_IsString(tok)) {
    ok = strlen(tok->valuestring) < cap;
    if (ok) snprintf(tokenizer, cap, "%s", tok->valuestring);
  }
  cJSON_Delete(man);
  if (!ok)
    return zt_errk(ZT_E_INVALID,
                   "%s/manifest.json: no model config, a field of it out of range or a bad "
                   "tokenizer path (corrupt checkpoint)",
                   dir);
  if (zt_model_config_check(cfg) != 0)
    return zt_err_wrap("%s/manifest.json (corrupt checkpoint)", dir);
  return 0;
}

int zt_ckpt_read_lora_base(const char *dir, char *path, size_t cap, char sum[32]) {
  cJSON *man = read_json(dir, "manifest.json", NULL);
  if (!man) return -1;
  const cJSON *b = cJSON_GetObjectItemCaseSensitive(man, "lora_base");
  const cJSON *p = cJSON_GetObjectItemCaseSensitive(b, "path");
  const cJSON *h = cJSON_GetObjectItemCaseSensitive(b, "params_xxh64");
  int ok = cJSON_IsString(p) && cJSON_IsString(h) && strlen(p->valuestring) < cap &&
           zt_ckpt_checksum_valid(h->valuestring);
  if (ok) {
    snprintf(path, cap, "%s", p->valuestring);
    snprintf(sum, 32, "%s", h->valuestring);
  }
  cJSON_Delete(man);
  if (!ok)
    return zt_errk(ZT_E_INVALID, "%s/manifest.json: no lora_base {path, params_xxh64} (a LoRA "
                   "checkpoint names the model its adapters adapt)", dir);
  return 0;
}

int zt_ckpt_read_diloco(const char *dir, const zt_ckpt_record_t *rec, int *groups, int *units,
                        int *ef) {
  *groups = 0, *units = 0, *ef = 0;
  cJSON *man = read_json(dir, "manifest.json", rec);
  if (!man) return zt_err_wrap("load checkpoint");
  cJSON *d = cJSON_GetObjectItemCaseSensitive(man, "diloco");
  int rc = 0;
  if (d) {
    int64_t g = int_field(d, "groups", 65536), u = int_field(d, "units", 1 << 16);
    int64_t e = cJSON_GetObjectItemCaseSensitive(d, "error_feedback") ? int_field(d, "error_feedback", 1) : 0;
    if (g < 1 || u < 1 || e < 0 || (2 * g + 1) * u >= (1 << 20))
      rc = zt_errk(ZT_E_INVALID, "%s/manifest.json: diloco: no valid groups and units (corrupt "
                   "checkpoint)", dir);
    else
      *groups = (int)g, *units = (int)u, *ef = (int)e;
  }
  cJSON_Delete(man);
  return rc;
}

/* The rank files of the epoch in dir hold 3 floats (the parameter, Adam m
 * and v) per parameter: a manifest that names a larger model is refused
 * before a buffer of its size is allocated. */
static int check_size(const char *dir, const zt_model_config_t *cfg) {
  int world;
  int64_t step;
  if (read_manifest(dir, cfg, NULL, &world, &step) != 0) return -1;
  uint64_t held = 0;
  for (int r = 0; r < world; r++) {
    char js[64], path[ZT_PATH_MAX];
    snprintf(js, sizeof js, "rank_%d.json", r);
    cJSON *idx = read_json(dir, js, NULL);
    if (!idx) return -1;
    cJSON *file = cJSON_GetObjectItemCaseSensitive(idx, "file");
    int ok = cJSON_IsString(file) && !strchr(file->valuestring, '/') &&
             zt_path_join(path, sizeof path, dir, file->valuestring) == 0;
    cJSON_Delete(idx);
    if (!ok) return zt_errk(ZT_E_INVALID, "%s/%s: malformed index (corrupt checkpoint)", dir, js);
    struct stat st;
    if (stat(path, &st) != 0) return zt_err_errno("%s", path);
    held += (uint64_t)st.st_size;
  }
  uint64_t params = zt_model_param_count(cfg, 1), need = params * 3 * sizeof(float);
  if (held < need)
    return zt_errk(ZT_E_INVALID,
                   "%s/manifest.json: a model of %llu parameters needs %llu bytes of rank files, "
                   "its %d ranks hold %llu (corrupt checkpoint)",
                   dir, (unsigned long long)params, (unsigned long long)need, world,
                   (unsigned long long)held);
  return 0;
}

int zt_ckpt_load_flat(const char *dir, const zt_model_config_t *cfg, zt_layout_t *lay,
                      float **flat_out, int64_t *step) {
  if (zt_layout_build(lay, cfg) != 0 || check_size(dir, cfg) != 0) return -1;
  float *flat = zt_xcalloc(lay->num_params, sizeof(float));
  zt_ckpt_dest_t *dest = zt_xcalloc((size_t)lay->num_units, sizeof *dest);
  for (int u = 0; u < lay->num_units; u++)
    dest[u] = (zt_ckpt_dest_t){u, 0, lay->unit_size[u], flat + lay->unit_off[u], NULL, NULL};
  int rc = zt_ckpt_load(dir, cfg, dest, lay->num_units, NULL, step);
  free(dest);
  if (rc != 0) free(flat);
  else *flat_out = flat;
  return rc;
}
