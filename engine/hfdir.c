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

#include "safetensors.h"
#include "spec.h"
#include "zt_json.h"

#define ZT_HF_CONFIG_MAX (1u << 20)

/* A number field (def when absent; NAN when it is not a number). */
static double num(const cJSON *c, const char *k, double def) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(c, k);
  if (!v || cJSON_IsNull(v)) return def;
  return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static int flag(const cJSON *c, const char *k, int def) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(c, k);
  return cJSON_IsBool(v) ? cJSON_IsTrue(v) : def;
}

static void same_int(zt_faults_t *p, const cJSON *c, const char *k, double def, int want,
                     const char *ours) {
  double v = num(c, k, def);
  if (v != (double)want)
    zt_faults_add(p, "%s is %g, the spec's model.%s %d", k, v, ours, want);
}

static void same_num(zt_faults_t *p, const cJSON *c, const char *k, double def, float want,
                     const char *ours) {
  double v = num(c, k, def);
  if (!((float)v == want))
    zt_faults_add(p, "%s is %g, the spec's model.%s %g", k, v, ours, want);
}

int zt_hf_check_config(const char *dir, const zt_model_config_t *w) {
  char path[4200], *text;
  size_t len;
  snprintf(path, sizeof path, "%s/config.json", dir);
  if (zt_read_file(path, &text, &len, ZT_HF_CONFIG_MAX) != 0) return -1;
  cJSON *c = zt_json_parse(text, len, path);
  free(text);
  if (!c) return -1;
  zt_faults_t p = ZT_FAULTS_INIT;
  const cJSON *archs = cJSON_GetObjectItemCaseSensitive(c, "architectures");
  const cJSON *a0 = cJSON_GetArrayItem(archs, 0);
  const char *arch = cJSON_IsString(a0) ? a0->valuestring : "";
  int qwen2 = !strcmp(arch, "Qwen2ForCausalLM");
  if (strcmp(arch, "LlamaForCausalLM") && strcmp(arch, "MistralForCausalLM") && !qwen2)
    zt_faults_add(&p, "architectures[0] is \"%.64s\", not LlamaForCausalLM, Qwen2ForCausalLM or "
            "MistralForCausalLM", arch);
  if (w->arch != ZT_ARCH_LLAMA) zt_faults_add(&p, "the spec's model.arch is not \"llama\"");
  double heads = num(c, "num_attention_heads", NAN), hidden = num(c, "hidden_size", NAN);
  same_int(&p, c, "hidden_size", NAN, w->n_embd, "n_embd");
  same_int(&p, c, "num_hidden_layers", NAN, w->n_layer, "n_layer");
  same_int(&p, c, "num_attention_heads", NAN, w->n_head, "n_head");
  same_int(&p, c, "num_key_value_heads", heads, w->n_kv_head, "n_kv_head");
  same_int(&p, c, "head_dim", heads > 0 ? floor(hidden / heads) : NAN, w->head_dim, "head_dim");
  same_int(&p, c, "intermediate_size", NAN, w->n_ff, "intermediate_size");
  same_int(&p, c, "vocab_size", NAN, w->vocab_size, "vocab_size");
  same_num(&p, c, "rope_theta", 10000.0, w->rope_theta, "rope_theta");
  same_num(&p, c, "rms_norm_eps", 1e-6, w->norm_eps, "rms_norm_eps");
  if (flag(c, "tie_word_embeddings", 0) != w->tie_embed)
    zt_faults_add(&p, "tie_word_embeddings is %s, the spec's %s",
            flag(c, "tie_word_embeddings", 0) ? "true" : "false", w->tie_embed ? "true" : "false");
  if ((qwen2 || flag(c, "attention_bias", 0)) != w->qkv_bias)
    zt_faults_add(&p, "attention_bias is %s%s, the spec's %s",
            qwen2 || flag(c, "attention_bias", 0) ? "true" : "false", qwen2 ? " (Qwen2)" : "",
            w->qkv_bias ? "true" : "false");
  double maxpos = num(c, "max_position_embeddings", NAN);
  if (!(maxpos >= w->seq_len))
    zt_faults_add(&p, "max_position_embeddings is %g, below the spec's seq_len %d", maxpos,
                  w->seq_len);
  zt_model_config_t rs = *w;
  if (zt_rope_scaling_parse(cJSON_GetObjectItemCaseSensitive(c, "rope_scaling"), "rope_scaling",
                            &rs) != 0)
    zt_faults_add(&p, "%s", zt_err_msg());
  else if (!zt_rope_scaling_same(&rs, w))
    zt_faults_add(&p, "rope_scaling differs from the spec's model.rope_scaling (%s)",
                  w->rope_factor ? "llama3" : "none");
  double sw = num(c, "sliding_window", 0);
  int use_sw = flag(c, "use_sliding_window", !qwen2);
  if (use_sw && sw > 0 && sw < w->seq_len)
    zt_faults_add(&p, "sliding_window %g is shorter than seq_len %d (not supported)", sw,
                  w->seq_len);
  if (num(c, "num_local_experts", 0) > 0 || num(c, "num_experts", 0) > 0)
    zt_faults_add(&p, "a mixture of experts (not supported)");
  if (flag(c, "mlp_bias", 0))
    zt_faults_add(&p, "mlp_bias is set (not supported)");
  cJSON_Delete(c);
  return zt_faults_raise(&p, ZT_E_INVALID, path);
}

int zt_hf_read_weights(const char *dir, const zt_layout_t *l, float *flat) {
  char path[4200];
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  if (access(path, F_OK) == 0) return zt_st_read(path, l, flat);
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
  if (access(path, F_OK) == 0) return zt_st_read_sharded(dir, l, flat);
  return zt_errk(ZT_E_INVALID, "%s: neither model.safetensors nor model.safetensors.index.json",
                 dir);
}

int zt_hf_read_model(const char *path, int dir, const zt_model_config_t *cfg,
                     const zt_layout_t *l, float *flat) {
  if (!dir) return zt_st_read(path, l, flat);
  return zt_hf_check_config(path, cfg) != 0 || zt_hf_read_weights(path, l, flat) != 0 ? -1 : 0;
}
