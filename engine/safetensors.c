/*
 * safetensors.c: Hugging Face GPT-2 safetensors files, written and read
 * (see safetensors.h).
 */
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_io.h" /* zt_ckpt_fsync_dir */
#include "spec.h"
#include "zt_json.h"

#define PREFIX "transformer."

static int is_conv1d(int kind) {
  return kind == ZT_T_QKVW || kind == ZT_T_ATTPROJW || kind == ZT_T_FCW || kind == ZT_T_FCPROJW;
}

/* A tensor of one dimension (rows == 1 but LoRA's A of rank 1, a matrix). */
static int is_vector(const zt_tensor_t *t) { return t->rows == 1 && t->kind != ZT_T_LORA_A; }

/* LoRA's placeholders are in no file (layout.h). */
static int in_files(const zt_tensor_t *t) { return t->kind != ZT_T_LORA_PAD; }

/* A llama layout's names are already Hugging Face's (layout.c). */
static int is_llama_kind(int kind) { return kind >= ZT_T_RMS1W; }

/* The file's name of tensor t. */
static void hf_name(const zt_tensor_t *t, char *buf, size_t n) {
  if (is_llama_kind(t->kind) || !strncmp(t->name, "model.", 6)) {
    snprintf(buf, n, "%s", t->name);
    return;
  }
  snprintf(buf, n, PREFIX "%s%s", t->name,
           (t->kind == ZT_T_WTE || t->kind == ZT_T_WPE) ? ".weight" : "");
}

/* Rows of tensor t as the file holds them (wte without our padding). */
static size_t file_rows(const zt_layout_t *l, const zt_tensor_t *t) {
  return t->kind == ZT_T_WTE || t->kind == ZT_T_HEADW ? (size_t)l->cfg.vocab_size
                                                      : (size_t)t->rows;
}

/* ---- writing --------------------------------------------------------------- */

/* Element k of tensor t in the file's order (Conv1D weights transposed). */
static float file_elem(const zt_tensor_t *t, const float *src, size_t rows, size_t k) {
  size_t cols = (size_t)t->cols;
  return is_conv1d(t->kind) ? src[(k % rows) * cols + k / rows] : src[k];
}

static void add_entry(cJSON *hdr, const zt_tensor_t *t, size_t rows, int bf16, size_t off,
                      size_t bytes) {
  char name[128];
  hf_name(t, name, sizeof name);
  cJSON *e = cJSON_AddObjectToObject(hdr, name);
  cJSON_AddStringToObject(e, "dtype", bf16 ? "BF16" : "F32");
  cJSON *shape = cJSON_AddArrayToObject(e, "shape");
  size_t cols = (size_t)t->cols;
  int tr = is_conv1d(t->kind);
  if (!is_vector(t)) cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)(tr ? cols : rows)));
  cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)(is_vector(t) ? cols : tr ? rows : cols)));
  cJSON *offs = cJSON_AddArrayToObject(e, "data_offsets");
  cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off));
  cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(off + bytes)));
}

/* Writes the file as path.tmp, fsyncs it, renames it to path and fsyncs
 * the directory, so that a crash leaves the old file or the whole new one;
 * a failure takes path.tmp back. */
static int write_file(const char *path, const char *htext, const uint8_t *data, size_t len,
                      size_t *bytes) {
  size_t hlen = strlen(htext), padded = (hlen + 7) / 8 * 8;
  uint64_t le = padded; /* little-endian on every platform we build for */
  char tmp[ZT_PATH_MAX], dir[ZT_PATH_MAX];
  if (zt_path_fmt(tmp, sizeof tmp, "%s.tmp", path) != 0 ||
      zt_path_fmt(dir, sizeof dir, "%s", path) != 0)
    return -1;
  char *slash = strrchr(dir, '/');
  if (!slash) snprintf(dir, sizeof dir, ".");
  else slash[slash == dir] = 0; /* "/x" is in "/" */
  FILE *f = fopen(tmp, "wb");
  if (!f) return zt_err_errno("create %s", tmp);
  int ok = fwrite(&le, 8, 1, f) == 1 && fwrite(htext, 1, hlen, f) == hlen;
  for (size_t i = hlen; ok && i < padded; i++) ok = fputc(' ', f) != EOF;
  ok = ok && fwrite(data, 1, len, f) == len && fflush(f) == 0;
  if (!ok) {
    zt_err_errno("write %s", tmp);
    goto err;
  }
  if (fsync(fileno(f)) != 0) {
    zt_err_errno("fsync %s", tmp);
    goto err;
  }
  int rc = fclose(f);
  f = NULL;
  if (rc != 0) {
    zt_err_errno("close %s", tmp);
    goto err;
  }
  if (rename(tmp, path) != 0) {
    zt_err_errno("rename %s to %s", tmp, path);
    goto err;
  }
  if (zt_ckpt_fsync_dir(dir) != 0) return zt_err_wrap("%s", path);
  if (bytes) *bytes = 8 + padded + len;
  return 0;
err:
  if (f) fclose(f);
  unlink(tmp);
  return -1;
}

int zt_st_write(const char *path, const zt_layout_t *l, const float *flat, int bf16, int64_t step,
                size_t *bytes) {
  size_t esz = bf16 ? 2 : 4, total = 0;
  for (int i = 0; i < l->num_tensors; i++)
    if (in_files(&l->tensors[i]))
      total += file_rows(l, &l->tensors[i]) * (size_t)l->tensors[i].cols * esz;
  uint8_t *data = zt_xmalloc(total ? total : 1);
  cJSON *hdr = cJSON_CreateObject();
  cJSON *meta = cJSON_AddObjectToObject(hdr, "__metadata__");
  cJSON_AddStringToObject(meta, "format", "pt");
  char stepbuf[32];
  snprintf(stepbuf, sizeof stepbuf, "%lld", (long long)step);
  cJSON_AddStringToObject(meta, "ztrain_step", stepbuf);
  size_t off = 0;
  for (int i = 0; i < l->num_tensors; i++) {
    const zt_tensor_t *t = &l->tensors[i];
    if (!in_files(t)) continue;
    size_t rows = file_rows(l, t), n = rows * (size_t)t->cols;
    for (size_t k = 0; k < n; k++) {
      float v = file_elem(t, flat + t->off, rows, k);
      if (bf16) {
        uint16_t h = zt_f32_to_bf16(v);
        memcpy(data + off + 2 * k, &h, 2);
      } else {
        memcpy(data + off + 4 * k, &v, 4);
      }
    }
    add_entry(hdr, t, rows, bf16, off, n * esz);
    off += n * esz;
  }
  char *htext = cJSON_PrintUnformatted(hdr);
  int rc = htext ? write_file(path, htext, data, off, bytes)
                 : zt_err("out of memory formatting the safetensors header");
  free(htext);
  cJSON_Delete(hdr);
  free(data);
  return rc;
}

/* ---- reading --------------------------------------------------------------- */

typedef struct {
  const char *path;
  const zt_layout_t *l;
  int fd;
  cJSON *hdr;
  uint64_t data_off, data_len; /* the data section in the file */
} reader;

static float f16_to_f32(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY)
                                                      : ldexpf((float)(m | 1024), e - 25);
  return (h & 0x8000) ? -v : v;
}

/* Bytes per element of a dtype name; 0 for one we do not read. */
static int dtype_size(const char *d) {
  return !strcmp(d, "F32") ? 4 : (!strcmp(d, "BF16") || !strcmp(d, "F16")) ? 2 : 0;
}

static float to_f32(const char *dtype, const uint8_t *p) {
  if (dtype[0] == 'F' && dtype[1] == '3') {
    float f;
    memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  memcpy(&h, p, 2);
  return dtype[0] == 'B' ? zt_bf16_to_f32(h) : f16_to_f32(h);
}

/* A whole number in [0, max] from a JSON value; -1 otherwise. */
static int64_t whole(const cJSON *v, int64_t max) {
  if (!cJSON_IsNumber(v)) return -1;
  double d = v->valuedouble;
  return d >= 0 && d <= (double)max && d == floor(d) ? (int64_t)d : -1;
}

/* The entry of tensor t: with or without the "transformer." prefix. */
static const cJSON *entry(const reader *r, const zt_tensor_t *t, char *name, size_t n) {
  hf_name(t, name, n);
  const cJSON *e = cJSON_GetObjectItemCaseSensitive(r->hdr, name);
  if (!e && !strncmp(name, PREFIX, strlen(PREFIX)))
    e = cJSON_GetObjectItemCaseSensitive(r->hdr, name + strlen(PREFIX));
  return cJSON_IsObject(e) ? e : NULL;
}

/* The shape the file must give t: dims[0..nd); rows may be more for wpe. */
static int want_shape(const reader *r, const zt_tensor_t *t, int64_t dims[2]) {
  int64_t rows = (int64_t)file_rows(r->l, t), cols = t->cols;
  if (is_vector(t)) {
    dims[0] = cols;
    return 1;
  }
  dims[0] = is_conv1d(t->kind) ? cols : rows;
  dims[1] = is_conv1d(t->kind) ? rows : cols;
  return 2;
}

static void dims_text(char *buf, size_t len, const int64_t d[2], int n) {
  if (n == 1) snprintf(buf, len, "[%lld]", (long long)d[0]);
  else if (n == 2) snprintf(buf, len, "[%lld, %lld]", (long long)d[0], (long long)d[1]);
  else snprintf(buf, len, "of %d dimensions", n);
}

/* The file's shape of t must be the model's; *numel receives its element
 * count. */
static int check_shape(const reader *r, const zt_tensor_t *t, const char *name, const cJSON *e,
                       uint64_t *numel) {
  int64_t want[2] = {0, 0}, got[2] = {-1, -1};
  int nd = want_shape(r, t, want);
  const cJSON *shape = cJSON_GetObjectItemCaseSensitive(e, "shape");
  int n = cJSON_IsArray(shape) ? cJSON_GetArraySize(shape) : -1;
  for (int i = 0; i < n && i < 2; i++) got[i] = whole(cJSON_GetArrayItem(shape, i), 1ll << 31);
  int ok = n == nd && got[0] >= 0 && (nd == 1 || got[1] >= 0);
  /* wpe may hold more positions than we use. */
  int more_pos = t->kind == ZT_T_WPE && ok && got[0] >= want[0] && got[1] == want[1];
  if (!ok || (!more_pos && (got[0] != want[0] || (nd == 2 && got[1] != want[1])))) {
    char have[64], need[64];
    dims_text(have, sizeof have, got, n);
    dims_text(need, sizeof need, want, nd);
    return zt_errk(ZT_E_INVALID, "%s: tensor %s has shape %s, the model needs %s", r->path,
                   name, have, need);
  }
  *numel = (uint64_t)got[0] * (uint64_t)(nd == 2 ? got[1] : 1);
  return 0;
}

/* Reads tensor t into flat. */
static int read_tensor(const reader *r, const zt_tensor_t *t, float *flat) {
  char name[128];
  const cJSON *e = entry(r, t, name, sizeof name);
  if (!e) return zt_errk(ZT_E_INVALID, "%s: no tensor %s", r->path, name);
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
  int esz = cJSON_IsString(dt) ? dtype_size(dt->valuestring) : 0;
  if (!esz)
    return zt_errk(ZT_E_INVALID, "%s: tensor %s has a dtype other than F32, BF16 or F16",
                   r->path, name);
  uint64_t all = 0;
  if (check_shape(r, t, name, e, &all) != 0) return -1;
  const cJSON *offs = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
  int64_t b = whole(cJSON_GetArrayItem(offs, 0), (int64_t)r->data_len);
  int64_t en = whole(cJSON_GetArrayItem(offs, 1), (int64_t)r->data_len);
  uint64_t cols = (uint64_t)t->cols;
  if (cJSON_GetArraySize(offs) != 2 || b < 0 || en < b || (uint64_t)(en - b) != all * (uint64_t)esz)
    return zt_errk(ZT_E_INVALID, "%s: tensor %s: data_offsets do not hold its %llu elements",
                   r->path, name, (unsigned long long)all);
  size_t rows = file_rows(r->l, t), n = rows * (size_t)cols; /* what we take */
  uint8_t *buf = zt_xmalloc(n * (size_t)esz + 1);
  if (zt_pread_all(r->fd, buf, n * (size_t)esz, r->data_off + (uint64_t)b, r->path) != 0) {
    free(buf);
    return zt_err_wrap("tensor %s", name); /* a short file is ZT_E_INVALID, an I/O error not */
  }
  float *dst = flat + t->off;
  int tr = is_conv1d(t->kind);
  for (size_t k = 0; k < n; k++) {
    float v = to_f32(dt->valuestring, buf + k * (size_t)esz);
    if (tr) dst[(k % rows) * cols + k / rows] = v; /* file [in, out] -> ours [out, in] */
    else dst[k] = v;
  }
  free(buf);
  return 0;
}

static int open_reader(reader *r, const char *path, const zt_layout_t *l) {
  memset(r, 0, sizeof *r);
  r->path = path, r->l = l;
  r->fd = open(path, O_RDONLY | O_CLOEXEC);
  if (r->fd < 0) return zt_err_errno("%s", path);
  struct stat st;
  uint64_t hlen = 0;
  if (fstat(r->fd, &st) != 0) return zt_err_errno("%s", path);
  if (st.st_size >= 8 && zt_pread_all(r->fd, &hlen, 8, 0, path) != 0) return -1;
  if (st.st_size < 8 || hlen < 2 || hlen > ZT_ST_MAX_HEADER || hlen > (uint64_t)st.st_size - 8)
    return zt_errk(ZT_E_INVALID, "%s: not a safetensors file (header length)", path);
  char *text = zt_xmalloc(hlen + 1);
  if (zt_pread_all(r->fd, text, hlen, 8, path) != 0) {
    free(text);
    return -1;
  }
  r->hdr = zt_json_parse(text, hlen, path);
  free(text);
  if (!r->hdr || !cJSON_IsObject(r->hdr))
    return zt_errk(ZT_E_INVALID, "%s: not a safetensors file (header is not a JSON object)",
                   path);
  r->data_off = 8 + hlen;
  r->data_len = (uint64_t)st.st_size - r->data_off;
  return 0;
}

/* Entry `full` of the header is a tensor of the model or one the reader
 * ignores (lm_head.weight, the attention masks h.{i}.attn.bias and
 * .masked_bias); anything else (a layer the model does not have, a name
 * it does not know) is an error naming it, so that a file of another
 * model is not read in part. */
static int known_entry(const reader *r, const char *full) {
  const zt_layout_t *l = r->l;
  const char *s = full;
  if (!strcmp(full, "__metadata__")) return 0;
  if (l->cfg.arch == ZT_ARCH_LLAMA) {
    /* A tied model's file may still hold lm_head.weight (a copy of the
     * embedding); older ones hold each layer's rotary inv_freq buffer. */
    if ((l->cfg.tie_embed && !strcmp(full, "lm_head.weight")) ||
        (strstr(full, ".rotary_emb.inv_freq") && !strncmp(full, "model.layers.", 13)))
      return 0;
    if (zt_layout_find(l, full)) return 0;
    return zt_errk(ZT_E_INVALID, "%s: tensor %s is not one of the model's", r->path, full);
  }
  if (!strncmp(s, PREFIX, strlen(PREFIX))) s += strlen(PREFIX);
  if (!strcmp(s, "lm_head.weight")) return 0;
  if (!strncmp(s, "h.", 2) && s[2] >= '0' && s[2] <= '9' && (s[2] != '0' || s[3] == '.')) {
    /* h.<layer>.<name>, the layer written without leading zeros. */
    const char *p = s + 2;
    long layer = 0;
    for (; *p >= '0' && *p <= '9' && layer <= INT32_MAX; p++) layer = 10 * layer + (*p - '0');
    if (*p == '.' && layer >= l->cfg.n_layer)
      return zt_errk(ZT_E_INVALID, "%s: tensor %s is of layer %ld, but the model has %d layers",
                     r->path, full, layer, l->cfg.n_layer);
    if (*p == '.' && (!strcmp(p, ".attn.bias") || !strcmp(p, ".attn.masked_bias"))) return 0;
    /* The tensors of layer 0 come right after wte and wpe, named "h.0.<name>". */
    for (int i = 0; *p == '.' && i < l->num_tensors && l->tensors[i].layer <= 0; i++)
      if (l->tensors[i].layer == 0 && !strcmp(l->tensors[i].name + 3, p)) return 0;
  } else {
    char name[128];
    for (int i = 0; i < l->num_tensors; i++) {
      if (l->tensors[i].layer >= 0) continue;
      hf_name(&l->tensors[i], name, sizeof name);
      if (!strcmp(s, name + strlen(PREFIX))) return 0;
    }
  }
  return zt_errk(ZT_E_INVALID, "%s: tensor %s is not one of the model's", r->path, full);
}

/* The file a sharded model's index maps tensor name to (NULL: none). */
static const char *mapped(const cJSON *map, const char *name) {
  const cJSON *f = cJSON_GetObjectItemCaseSensitive(map, name);
  return cJSON_IsString(f) ? f->valuestring : NULL;
}

/* Reads from one file the model's tensors it holds: all of them, or with
 * an index (map, this file's name fname) those the index maps to it; every
 * entry of the file must be one of the model's, and mapped to it. */
/* Takes the error just set: a fault of the file's content is gathered
 * into faults, so that one error names every missing, extra or misshaped
 * tensor (0: go on); any other error (I/O) ends the read (-1). */
static int gather(zt_faults_t *f) {
  if (zt_err_kind() != ZT_E_INVALID) return -1;
  zt_faults_add(f, "%s", zt_err_msg());
  return 0;
}

static int read_from(const char *path, const zt_layout_t *l, float *flat, const cJSON *map,
                     const char *fname, zt_faults_t *faults) {
  reader r;
  int rc = open_reader(&r, path, l);
  for (const cJSON *e = rc == 0 ? r.hdr->child : NULL; rc == 0 && e; e = e->next) {
    const char *f = map && strcmp(e->string, "__metadata__") ? mapped(map, e->string) : fname;
    if (known_entry(&r, e->string) != 0) rc = gather(faults);
    else if (map && f && strcmp(f, fname) &&
             zt_errk(ZT_E_INVALID, "%s: holds tensor %s, which the index puts in %s", path,
                     e->string, f) != 0)
      rc = gather(faults);
  }
  for (int i = 0; rc == 0 && i < l->num_tensors; i++) {
    char name[128];
    if (!in_files(&l->tensors[i])) continue;
    hf_name(&l->tensors[i], name, sizeof name);
    const char *f = map ? mapped(map, name) : NULL;
    if ((!map || (f && !strcmp(f, fname))) && read_tensor(&r, &l->tensors[i], flat) != 0)
      rc = gather(faults);
  }
  if (r.fd >= 0) close(r.fd);
  cJSON_Delete(r.hdr);
  return rc;
}

int zt_st_read(const char *path, const zt_layout_t *l, float *flat) {
  zt_faults_t faults = ZT_FAULTS_INIT;
  memset(flat, 0, l->num_params * sizeof(float));
  if (read_from(path, l, flat, NULL, NULL, &faults) != 0) return -1;
  return zt_faults_raise(&faults, ZT_E_INVALID, NULL);
}

/* A shard's name from the index: a plain file name in the directory. */
static int shard_name_ok(const char *f) {
  size_t n = strlen(f);
  return n > 12 && n < 256 && !strchr(f, '/') && f[0] != '.' &&
         !strcmp(f + n - 12, ".safetensors");
}

int zt_st_read_sharded(const char *dir, const zt_layout_t *l, float *flat) {
  char path[ZT_PATH_MAX], *text = NULL;
  size_t len;
  memset(flat, 0, l->num_params * sizeof(float));
  if (zt_path_join(path, sizeof path, dir, "model.safetensors.index.json") != 0 ||
      zt_read_file(path, &text, &len, ZT_ST_MAX_HEADER) != 0)
    return -1;
  cJSON *idx = zt_json_parse(text, len, path);
  free(text);
  const cJSON *map = cJSON_GetObjectItemCaseSensitive(idx, "weight_map");
  zt_faults_t faults = ZT_FAULTS_INIT;
  int rc = cJSON_IsObject(map) ? 0 : zt_errk(ZT_E_INVALID, "%s: no weight_map object", path);
  /* Every tensor of the model is mapped, to a file of the directory. */
  for (int i = 0; rc == 0 && i < l->num_tensors; i++) {
    char name[128];
    hf_name(&l->tensors[i], name, sizeof name);
    const char *f = mapped(map, name);
    if (!f) zt_faults_add(&faults, "%s: no tensor %s in weight_map", path, name);
    else if (!shard_name_ok(f))
      rc = zt_errk(ZT_E_INVALID, "%s: %s is not a safetensors file of the directory", path, f);
  }
  /* Each file once, in the order the index first names it. */
  for (const cJSON *e = rc == 0 ? map->child : NULL; rc == 0 && e; e = e->next) {
    if (!cJSON_IsString(e) || !shard_name_ok(e->valuestring)) {
      rc = zt_errk(ZT_E_INVALID, "%s: %s maps to no safetensors file of the directory", path,
                   e->string);
      break;
    }
    int seen = 0;
    for (const cJSON *p = map->child; p != e && !seen; p = p->next)
      seen = !strcmp(p->valuestring, e->valuestring);
    if (seen) continue;
    char shard[ZT_PATH_MAX];
    rc = zt_path_join(shard, sizeof shard, dir, e->valuestring) != 0
             ? -1
             : read_from(shard, l, flat, map, e->valuestring, &faults);
  }
  cJSON_Delete(idx);
  return rc != 0 ? -1 : zt_faults_raise(&faults, ZT_E_INVALID, NULL);
}
