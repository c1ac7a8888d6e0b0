/*
 * export.c: a committed checkpoint epoch as a safetensors file with
 * Hugging Face GPT-2 names (zctl export).
 *
 * The epoch's shards are read back into full unit buffers with the same
 * range reads a resharding load uses (engine/ckpt_io.c, checksums checked),
 * then every named tensor is written under its GPT2LMHeadModel name:
 *
 *   transformer.wte.weight [V, C] (padded rows dropped), transformer.wpe.weight
 *   [T, C], transformer.h.{i}.ln_1.{weight,bias}, .attn.c_attn.{weight,bias},
 *   .attn.c_proj.*, .ln_2.*, .mlp.c_fc.*, .mlp.c_proj.*, transformer.ln_f.*
 *
 * GPT-2 uses Conv1D layers whose weights are [in, out], the transpose of
 * ours ([out, in], as in llm.c), so matmul weights are transposed on the
 * way out. The LM head is tied to wte and, as in the Hugging Face files, not
 * stored. Values are fp32 or bf16 (round to nearest even).
 *
 * safetensors: 8-byte little-endian header length, a JSON header mapping
 * each name to {dtype, shape, data_offsets [begin, end)} relative to the
 * data that follows (padded with spaces to a multiple of 8), then the data.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_io.h"
#include "export.h"
#include "layout.h"
#include "spec.h"
#include "zt_common.h"

static int read_model(const char *dir, zt_model_config_t *cfg) {
  char path[1200], *text;
  size_t len;
  snprintf(path, sizeof path, "%s/manifest.json", dir);
  if (zt_read_file(path, &text, &len, 1 << 20) != 0) return -1;
  cJSON *doc = zt_json_parse(text, len, path), *m;
  free(text);
  m = doc ? cJSON_GetObjectItemCaseSensitive(doc, "model") : NULL;
  int ok = m != NULL;
  const char *keys[] = {"n_layer", "n_head", "n_embd", "seq_len", "vocab_size"};
  int *dst[] = {&cfg->n_layer, &cfg->n_head, &cfg->n_embd, &cfg->seq_len, &cfg->vocab_size};
  for (int i = 0; ok && i < 5; i++) {
    cJSON *v = cJSON_GetObjectItemCaseSensitive(m, keys[i]);
    ok = cJSON_IsNumber(v) && v->valuedouble >= 1 && v->valuedouble <= 1 << 20;
    if (ok) *dst[i] = (int)v->valuedouble;
  }
  cJSON_Delete(doc);
  return ok ? 0 : zt_err("%s: no model config (corrupt checkpoint)", path);
}

static int is_conv1d(int kind) {
  return kind == ZT_T_QKVW || kind == ZT_T_ATTPROJW || kind == ZT_T_FCW || kind == ZT_T_FCPROJW;
}

int zt_export_safetensors(const char *dir, const char *out, int bf16, size_t *bytes_out) {
  zt_model_config_t cfg;
  zt_layout_t lay = {0};
  float *flat = NULL;
  zt_ckpt_dest_t *dest = NULL;
  uint8_t *data = NULL;
  cJSON *hdr = NULL;
  FILE *f = NULL;
  int ret = -1;
  if (read_model(dir, &cfg) != 0 || zt_layout_build(&lay, &cfg) != 0) goto out;
  flat = zt_xcalloc(lay.num_params, sizeof(float));
  dest = zt_xcalloc((size_t)lay.num_units, sizeof *dest);
  for (int u = 0; u < lay.num_units; u++)
    dest[u] = (zt_ckpt_dest_t){u, 0, lay.unit_size[u], flat + lay.unit_off[u], NULL, NULL};
  int64_t step;
  if (zt_ckpt_load(dir, &cfg, dest, lay.num_units, NULL, &step) != 0) goto out;

  /* Data: every tensor in layout order, in the exported shape. */
  size_t esz = bf16 ? 2 : 4, total = 0;
  for (int i = 0; i < lay.num_tensors; i++) {
    const zt_tensor_t *t = &lay.tensors[i];
    size_t rows = t->kind == ZT_T_WTE ? (size_t)cfg.vocab_size : (size_t)t->rows;
    total += rows * (size_t)t->cols * esz;
  }
  data = zt_xmalloc(total);
  hdr = cJSON_CreateObject();
  cJSON *meta = cJSON_AddObjectToObject(hdr, "__metadata__");
  cJSON_AddStringToObject(meta, "format", "pt");
  char stepbuf[32];
  snprintf(stepbuf, sizeof stepbuf, "%lld", (long long)step);
  cJSON_AddStringToObject(meta, "ztrain_step", stepbuf);
  size_t off = 0;
  for (int i = 0; i < lay.num_tensors; i++) {
    const zt_tensor_t *t = &lay.tensors[i];
    size_t rows = t->kind == ZT_T_WTE ? (size_t)cfg.vocab_size : (size_t)t->rows;
    size_t cols = (size_t)t->cols, n = rows * cols;
    const float *src = flat + t->off;
    int tr = is_conv1d(t->kind);
    for (size_t k = 0; k < n; k++) {
      /* Conv1D: element (i, j) of [in=cols, out=rows] is ours (j, i). */
      float v = tr ? src[(k % rows) * cols + k / rows] : src[k];
      if (bf16) {
        uint16_t h = zt_f32_to_bf16(v);
        memcpy(data + off + 2 * k, &h, 2);
      } else {
        memcpy(data + off + 4 * k, &v, 4);
      }
    }
    char name[96];
    snprintf(name, sizeof name, "transformer.%s%s", t->name,
             (t->kind == ZT_T_WTE || t->kind == ZT_T_WPE) ? ".weight" : "");
    cJSON *e = cJSON_AddObjectToObject(hdr, name);
    cJSON_AddStringToObject(e, "dtype", bf16 ? "BF16" : "F32");
    cJSON *shape = cJSON_AddArrayToObject(e, "shape");
    int is_vec = t->rows == 1;
    if (is_vec) {
      cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)cols));
    } else {
      cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)(tr ? cols : rows)));
      cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)(tr ? rows : cols)));
    }
    cJSON *offs = cJSON_AddArrayToObject(e, "data_offsets");
    cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off));
    cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(off + n * esz)));
    off += n * esz;
  }
  char *htext = cJSON_PrintUnformatted(hdr);
  if (!htext) {
    zt_err("out of memory formatting the safetensors header");
    goto out;
  }
  size_t hlen = strlen(htext), padded = (hlen + 7) / 8 * 8;
  uint64_t le = padded; /* little-endian on every platform we build for */
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%s.tmp", out);
  f = fopen(tmp, "wb");
  int ok = f && fwrite(&le, 8, 1, f) == 1 && fwrite(htext, 1, hlen, f) == hlen;
  for (size_t i = hlen; ok && i < padded; i++) ok = fputc(' ', f) != EOF;
  ok = ok && fwrite(data, 1, off, f) == off;
  free(htext);
  if (!f || fclose(f) != 0 || !ok) {
    f = NULL;
    zt_err_errno("write %s", tmp);
    goto out;
  }
  f = NULL;
  if (rename(tmp, out) != 0) {
    zt_err_errno("rename %s", tmp);
    goto out;
  }
  if (bytes_out) *bytes_out = 8 + padded + off;
  ret = 0;
out:
  if (f) fclose(f);
  cJSON_Delete(hdr);
  free(data);
  free(dest);
  free(flat);
  zt_layout_free(&lay);
  return ret;
}
