/*
 * export.c: a committed checkpoint epoch as a safetensors file with
 * Hugging Face GPT-2 names (zctl export).
 *
 * The epoch's shards are read back into full unit buffers with the same
 * range reads a resharding load uses (engine/ckpt_io.c, checksums checked),
 * then written by the engine's safetensors writer (engine/safetensors.h:
 * names, Conv1D transposes, fp32 or bf16), the same module a job's
 * init.from_safetensors reads with.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>

#include "ckpt_io.h"
#include "export.h"
#include "layout.h"
#include "safetensors.h"
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

int zt_export_safetensors(const char *dir, const char *out, int bf16, size_t *bytes_out) {
  zt_model_config_t cfg;
  zt_layout_t lay = {0};
  float *flat = NULL;
  zt_ckpt_dest_t *dest = NULL;
  int ret = -1;
  if (read_model(dir, &cfg) != 0 || zt_layout_build(&lay, &cfg) != 0) goto out;
  flat = zt_xcalloc(lay.num_params, sizeof(float));
  dest = zt_xcalloc((size_t)lay.num_units, sizeof *dest);
  for (int u = 0; u < lay.num_units; u++)
    dest[u] = (zt_ckpt_dest_t){u, 0, lay.unit_size[u], flat + lay.unit_off[u], NULL, NULL};
  int64_t step;
  if (zt_ckpt_load(dir, &cfg, dest, lay.num_units, NULL, &step) != 0) goto out;
  ret = zt_st_write(out, &lay, flat, bf16, step, bytes_out);
out:
  free(dest);
  free(flat);
  zt_layout_free(&lay);
  return ret;
}
