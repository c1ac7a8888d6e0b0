/*
 * hfconfig.c: a Hugging Face config.json as a job's model (see hfconfig.h).
 *
 * One table names each field twice, as config.json does and as the spec's
 * model section does, with the default Hugging Face's LlamaConfig gives a
 * field that is absent (or null). zt_hfconfig_resolve() writes the spec's
 * model section from it, and zt_hfconfig_check() compares a model with it,
 * so the model a coordinator fills in at submit is the model a worker
 * checks at load.
 */
#include "hfconfig.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spec.h"
#include "zt_json.h"

#define ZT_HF_CONFIG_MAX (1u << 20)

enum { F_INT, F_FLOAT, F_BOOL };

/* The fields, in the order the spec's model section is written. */
enum {
  H_HIDDEN, H_LAYERS, H_HEADS, H_KV_HEADS, H_HEAD_DIM, H_FF, H_VOCAB, H_THETA, H_EPS, H_TIE,
  H_BIAS, H_MAXPOS, H_COUNT
};
static const struct {
  const char *hf, *ours;
  int kind;
} k_fields[H_COUNT] = {
    [H_HIDDEN] = {"hidden_size", "n_embd", F_INT},
    [H_LAYERS] = {"num_hidden_layers", "n_layer", F_INT},
    [H_HEADS] = {"num_attention_heads", "n_head", F_INT},
    [H_KV_HEADS] = {"num_key_value_heads", "n_kv_head", F_INT},
    [H_HEAD_DIM] = {"head_dim", "head_dim", F_INT},
    [H_FF] = {"intermediate_size", "intermediate_size", F_INT},
    [H_VOCAB] = {"vocab_size", "vocab_size", F_INT},
    [H_THETA] = {"rope_theta", "rope_theta", F_FLOAT},
    [H_EPS] = {"rms_norm_eps", "rms_norm_eps", F_FLOAT},
    [H_TIE] = {"tie_word_embeddings", "tie_word_embeddings", F_BOOL},
    [H_BIAS] = {"attention_bias", "attention_bias", F_BOOL},
    [H_MAXPOS] = {"max_position_embeddings", "max_position_embeddings", F_INT},
};

/* A number field (def when absent or null; NAN when it is not a number). */
static double num(const cJSON *c, const char *k, double def) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(c, k);
  if (!v || cJSON_IsNull(v)) return def;
  return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static int flag(const cJSON *c, const char *k, int def) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(c, k);
  return cJSON_IsBool(v) ? cJSON_IsTrue(v) : def;
}

/* Field i of config c, with LlamaConfig's defaults (a bool as 0 or 1):
 * Qwen2 has q/k/v biases whatever attention_bias says. */
static double hf_value(const cJSON *c, int i, int qwen2) {
  double heads = num(c, "num_attention_heads", NAN), hidden = num(c, "hidden_size", NAN);
  switch (i) {
    case H_KV_HEADS: return num(c, k_fields[i].hf, heads);
    case H_HEAD_DIM: return num(c, k_fields[i].hf, heads > 0 ? floor(hidden / heads) : NAN);
    case H_THETA: return num(c, k_fields[i].hf, 10000.0);
    case H_EPS: return num(c, k_fields[i].hf, 1e-6);
    case H_TIE: return flag(c, k_fields[i].hf, 0);
    case H_BIAS: return qwen2 || flag(c, k_fields[i].hf, 0);
    case H_MAXPOS: return num(c, k_fields[i].hf, 2048);
    default: return num(c, k_fields[i].hf, NAN);
  }
}

/* The same field of a model configuration (max_position_embeddings: 0
 * when the spec left it to seq_len). */
static double our_value(const zt_model_config_t *w, int i) {
  const double v[H_COUNT] = {w->n_embd, w->n_layer, w->n_head, w->n_kv_head, w->head_dim,
                             w->n_ff, w->vocab_size, w->rope_theta, w->norm_eps, w->tie_embed,
                             w->qkv_bias, w->max_pos};
  return v[i];
}

/* Equal as the model stores them: floats in single precision. */
static int same_value(int kind, double a, double b) {
  return kind == F_FLOAT ? (float)a == (float)b : a == b;
}

/* config.json of dir, parsed (path gets its name); NULL with the reason. */
static cJSON *read_config(const char *dir, char *path, size_t n) {
  char *text;
  size_t len;
  snprintf(path, n, "%s/config.json", dir);
  if (zt_read_file(path, &text, &len, ZT_HF_CONFIG_MAX) != 0) return NULL;
  cJSON *c = zt_json_parse(text, len, path);
  free(text);
  if (c && !cJSON_IsObject(c)) {
    cJSON_Delete(c);
    zt_errk(ZT_E_INVALID, "%s: not a JSON object", path);
    return NULL;
  }
  return c;
}

/* 1 for Qwen2ForCausalLM; a fault unless the architecture is one we train. */
static int arch_of(const cJSON *c, zt_faults_t *p) {
  const cJSON *a0 = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(c, "architectures"), 0);
  const char *arch = cJSON_IsString(a0) ? a0->valuestring : "";
  int qwen2 = !strcmp(arch, "Qwen2ForCausalLM");
  if (strcmp(arch, "LlamaForCausalLM") && strcmp(arch, "MistralForCausalLM") && !qwen2)
    zt_faults_add(p, "architectures[0] is \"%.64s\", not LlamaForCausalLM, Qwen2ForCausalLM or "
                     "MistralForCausalLM", arch);
  return qwen2;
}

/* What config c asks for that this engine does not implement, with a
 * sequence of seq_len tokens. */
static void unsupported(const cJSON *c, int qwen2, int seq_len, zt_faults_t *p) {
  const cJSON *act = cJSON_GetObjectItemCaseSensitive(c, "hidden_act");
  if (act && !cJSON_IsNull(act) && !cJSON_IsString(act))
    zt_faults_add(p, "hidden_act is not a string");
  else if (cJSON_IsString(act) && strcmp(act->valuestring, "silu"))
    zt_faults_add(p, "hidden_act is \"%.40s\", not \"silu\" (not supported)", act->valuestring);
  double sw = num(c, "sliding_window", 0);
  if (flag(c, "use_sliding_window", !qwen2) && sw > 0 && sw < seq_len)
    zt_faults_add(p, "sliding_window %g is shorter than seq_len %d (not supported)", sw, seq_len);
  if (num(c, "num_local_experts", 0) > 0 || num(c, "num_experts", 0) > 0)
    zt_faults_add(p, "a mixture of experts (not supported)");
  if (flag(c, "mlp_bias", 0)) zt_faults_add(p, "mlp_bias is set (not supported)");
}

/* config c's rope_scaling into rs; 0, or -1 with a fault when it is not
 * one we implement. */
static int rope_of(const cJSON *c, zt_model_config_t *rs, zt_faults_t *p) {
  if (zt_spec_rope_parse(cJSON_GetObjectItemCaseSensitive(c, "rope_scaling"), "rope_scaling",
                            rs) == 0)
    return 0;
  zt_faults_add(p, "%s", zt_err_msg());
  return -1;
}

int zt_hfconfig_check(const char *dir, const zt_model_config_t *w) {
  char path[ZT_PATH_MAX];
  cJSON *c = read_config(dir, path, sizeof path);
  if (!c) return -1;
  zt_faults_t p = ZT_FAULTS_INIT;
  int qwen2 = arch_of(c, &p);
  if (w->arch != ZT_ARCH_LLAMA) zt_faults_add(&p, "the spec's model.arch is not \"llama\"");
  for (int i = 0; i < H_COUNT; i++) {
    double v = hf_value(c, i, qwen2), want = our_value(w, i);
    if (i == H_MAXPOS) {
      if (!(v >= w->seq_len))
        zt_faults_add(&p, "max_position_embeddings is %g, below the spec's seq_len %d", v,
                      w->seq_len);
      else if (w->max_pos && v != w->max_pos)
        zt_faults_add(&p, "max_position_embeddings is %g, the spec's model.%s %d", v,
                      k_fields[i].ours, w->max_pos);
    } else if (k_fields[i].kind == F_BOOL && v != want) {
      zt_faults_add(&p, "%s is %s%s, the spec's %s", k_fields[i].hf, v ? "true" : "false",
                    i == H_BIAS && qwen2 ? " (Qwen2)" : "", want ? "true" : "false");
    } else if (!same_value(k_fields[i].kind, v, want)) {
      zt_faults_add(&p, "%s is %g, the spec's model.%s %g", k_fields[i].hf, v, k_fields[i].ours,
                    want);
    }
  }
  zt_model_config_t rs = *w;
  if (rope_of(c, &rs, &p) == 0 && !zt_spec_rope_same(&rs, w))
    zt_faults_add(&p, "rope_scaling differs from the spec's model.rope_scaling (%s)",
                  w->rope_factor ? "llama3" : "none");
  unsupported(c, qwen2, w->seq_len, &p);
  cJSON_Delete(c);
  return zt_faults_raise(&p, ZT_E_INVALID, path);
}

/* ---- the spec's model from config.json -------------------------------------- */

/* The model section config c describes (seq_len not yet set). */
static cJSON *model_of(const cJSON *c, int qwen2) {
  cJSON *m = cJSON_CreateObject();
  cJSON_AddStringToObject(m, "arch", "llama");
  for (int i = 0; i < H_COUNT; i++) {
    double v = hf_value(c, i, qwen2);
    if (k_fields[i].kind == F_BOOL) cJSON_AddBoolToObject(m, k_fields[i].ours, v != 0);
    else if (k_fields[i].kind == F_FLOAT) cJSON_AddNumberToObject(m, k_fields[i].ours, zt_float_decimal((float)v));
    else cJSON_AddNumberToObject(m, k_fields[i].ours, v);
  }
  const cJSON *rs = cJSON_GetObjectItemCaseSensitive(c, "rope_scaling");
  if (rs && !cJSON_IsNull(rs)) cJSON_AddItemToObject(m, "rope_scaling", cJSON_Duplicate(rs, 1));
  return m;
}

/* The text of a spec value, for an error. */
static void shown(const cJSON *v, char *out, size_t n) {
  char *t = cJSON_PrintUnformatted(v);
  snprintf(out, n, "%.200s", t ? t : "?");
  free(t);
}

/* The spec's model key `it` against m (config.json's model): seq_len
 * within max_position_embeddings is taken, a key config.json sets must
 * agree with it, any other key is carried over for the spec parser to
 * judge. */
static void merge_key(cJSON *m, const cJSON *it, zt_faults_t *p) {
  const cJSON *have = cJSON_GetObjectItemCaseSensitive(m, it->string);
  char a[256], b[256];
  if (!strcmp(it->string, "rope_scaling") && have) {
    zt_model_config_t x = {0}, y = {0};
    if (zt_spec_rope_parse(have, "rope_scaling", &y) != 0) return; /* said already */
    if (zt_spec_rope_parse(it, "model.rope_scaling", &x) != 0 || !zt_spec_rope_same(&x, &y))
      zt_faults_add(p, "model.rope_scaling differs from config.json's (leave it out: it comes "
                       "from there)");
    return;
  }
  if (!strcmp(it->string, "seq_len")) {
    double maxpos = cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(m, "max_position_embeddings"));
    if (cJSON_IsNumber(it) && it->valuedouble > maxpos)
      zt_faults_add(p, "model.seq_len %g is above config.json's max_position_embeddings %g",
                    it->valuedouble, maxpos);
  } else if (have) {
    int same = cJSON_IsNumber(it) && cJSON_IsNumber(have)
                   ? (float)it->valuedouble == (float)have->valuedouble
                   : cJSON_Compare(it, have, 1);
    if (!same) {
      shown(it, a, sizeof a), shown(have, b, sizeof b);
      zt_faults_add(p, "model.%s is %s in the spec, %s in config.json (leave it out: it comes "
                       "from there)", it->string, a, b);
    }
    return;
  } else if (!strcmp(it->string, "rope_scaling") && !cJSON_IsNull(it)) {
    zt_model_config_t x = {0};
    if (zt_spec_rope_parse(it, "model.rope_scaling", &x) != 0 || x.rope_factor != 0)
      zt_faults_add(p, "model.rope_scaling is set in the spec, config.json has none");
    return;
  }
  cJSON_DeleteItemFromObjectCaseSensitive(m, it->string);
  cJSON_AddItemToObject(m, it->string, cJSON_Duplicate(it, 1));
}

/* The spec's model (may be NULL) merged into m; the faults of both. */
static void merge(cJSON *m, const cJSON *c, int qwen2, const cJSON *spec_model, zt_faults_t *p) {
  const cJSON *it;
  if (cJSON_IsObject(spec_model)) cJSON_ArrayForEach(it, spec_model) merge_key(m, it, p);
  if (!cJSON_GetObjectItemCaseSensitive(m, "seq_len")) {
    double maxpos = cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(m, "max_position_embeddings"));
    cJSON_AddNumberToObject(m, "seq_len", fmin(maxpos, ZT_HF_DEFAULT_SEQ_LEN));
  }
  const cJSON *sl = cJSON_GetObjectItemCaseSensitive(m, "seq_len");
  unsupported(c, qwen2, cJSON_IsNumber(sl) ? (int)sl->valuedouble : 0, p);
}

/* The directory init.from_pretrained names, confined under data_root. */
static int pretrained_dir(const cJSON *root, const char *data_root, char *dir, size_t n) {
  const cJSON *init = cJSON_GetObjectItemCaseSensitive(root, "init");
  const cJSON *fp = cJSON_IsObject(init) ? cJSON_GetObjectItemCaseSensitive(init, "from_pretrained")
                                         : NULL;
  if (!cJSON_IsString(fp) || !fp->valuestring[0]) return 0;
  if (!data_root) {
    snprintf(dir, n, "%s", fp->valuestring);
    return 1;
  }
  return zt_path_confine(data_root, fp->valuestring, "init.from_pretrained", dir, n) != 0 ? -1 : 1;
}

int zt_hfconfig_resolve(const char *json, size_t len, const char *data_root, char **out) {
  char dir[ZT_PATH_MAX], path[ZT_PATH_MAX];
  *out = NULL;
  cJSON *root = zt_json_parse(json, len, "the spec");
  if (!root) return 0; /* the spec parser says what is wrong */
  int rc = cJSON_IsObject(root) ? pretrained_dir(root, data_root, dir, sizeof dir) : 0;
  cJSON *c = rc > 0 ? read_config(dir, path, sizeof path) : NULL;
  const cJSON *spec_model = cJSON_GetObjectItemCaseSensitive(root, "model");
  if (rc > 0 && !c) {
    /* Not readable here: a whole model section is checked by each worker. */
    char why[ZT_ERR_MAX];
    snprintf(why, sizeof why, "%s", zt_err_msg());
    rc = cJSON_IsObject(spec_model) && cJSON_GetObjectItemCaseSensitive(spec_model, "n_layer")
             ? 0
             : zt_errk(ZT_E_INVALID, "init.from_pretrained: %s (the model section comes from "
                       "it; where it cannot be read here, give the whole section in the spec)",
                       why);
  }
  if (c) {
    zt_faults_t p = ZT_FAULTS_INIT;
    int qwen2 = arch_of(c, &p);
    zt_model_config_t rs = {0};
    (void)rope_of(c, &rs, &p);
    cJSON *m = model_of(c, qwen2);
    merge(m, c, qwen2, spec_model, &p);
    if (zt_faults_raise(&p, ZT_E_INVALID, path) != 0) {
      cJSON_Delete(m);
      rc = zt_err_wrap("init.from_pretrained");
    } else {
      cJSON_DeleteItemFromObjectCaseSensitive(root, "model");
      cJSON_AddItemToObject(root, "model", m);
      *out = cJSON_PrintUnformatted(root);
      rc = *out ? 0 : zt_errk(ZT_E_NO_MEMORY, "the spec: out of memory");
    }
  }
  cJSON_Delete(c);
  cJSON_Delete(root);
  return rc < 0 ? -1 : 0;
}
