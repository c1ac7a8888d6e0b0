/*
 * hfdir.c: Hugging Face model directories (see hfdir.h).
 */
#include "hfdir.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hfconfig.h"
#include "safetensors.h"
#include "spec.h"
#include "zt_json.h"

int zt_hf_read_weights(const char *dir, const zt_layout_t *l, float *flat) {
  char path[ZT_PATH_MAX];
  if (zt_path_join(path, sizeof path, dir, "model.safetensors") != 0) return -1;
  if (access(path, F_OK) == 0) return zt_st_read(path, l, flat);
  if (zt_path_join(path, sizeof path, dir, "model.safetensors.index.json") != 0) return -1;
  if (access(path, F_OK) == 0) return zt_st_read_sharded(dir, l, flat);
  return zt_errk(ZT_E_INVALID, "%s: neither model.safetensors nor model.safetensors.index.json",
                 dir);
}

int zt_hf_read_model(const char *path, int dir, const zt_model_config_t *cfg,
                     const zt_layout_t *l, float *flat) {
  if (!dir) return zt_st_read(path, l, flat);
  return zt_hfconfig_check(path, cfg) != 0 || zt_hf_read_weights(path, l, flat) != 0 ? -1 : 0;
}
