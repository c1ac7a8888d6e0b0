/*
 * export.c: a committed checkpoint epoch as a Hugging Face model directory
 * (zctl export), the form GPT2LMHeadModel.from_pretrained(DIR) (or, for a
 * llama model, LlamaForCausalLM's) and AutoTokenizer.from_pretrained(DIR)
 * load:
 *
 *   model.safetensors   the parameters, Hugging Face's names, fp32 or bf16
 *   config.json         GPT2Config: sizes, gelu_new, layer_norm_epsilon 1e-5,
 *                       tied embeddings, bos/eos = the end-of-text id,
 *                       dropout 0 (the model was trained without); or
 *                       LlamaConfig (Qwen2Config for a model with q/k/v
 *                       biases) with the model's fields, which
 *                       init.from_pretrained accepts; bos_token_id from
 *                       the tokenizer (an hf template's first special
 *                       token, else the end of text)
 *   tokenizer files     gpt2 BPE: vocab.json + merges.txt (the encoder.json
 *                       and vocab.bpe the shards were made with), byte:
 *                       tokenizer.json (byte-level BPE with no merges, so
 *                       token b is byte b and 256 is <|endoftext|>), hf:
 *                       the tokenizer.json the shards were made with;
 *                       tokenizer_config.json and special_tokens_map.json
 *
 * The epoch's shards are read back into full unit buffers with the same
 * range reads a resharding load uses (engine/ckpt_io.c, checksums checked),
 * then written by the engine's safetensors writer (engine/safetensors.h:
 * names, Conv1D transposes), the same module a job's init.from_safetensors
 * reads with, so an exported model can be trained on again.
 *
 * The tokenizer is the one named by the epoch's manifest ("tokenizer": the
 * record zprep wrote next to the training shards, docs/engine.md), or the
 * caller's record; without either a model of vocab_size 257 is taken to use
 * the byte tokenizer, and any other model is exported without tokenizer
 * files (said on stderr).
 *
 * Nothing is half-written: every file goes into DIR.tmp-PID, fsynced, and
 * the directory is renamed to DIR at the end. DIR may not exist yet (its
 * parents are created) or be an empty directory; anything else is refused.
 */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_io.h"
#include "export.h"
#include "layout.h"
#include "lora.h"
#include "safetensors.h"
#include "spec.h"
#include "tokenizer.h"
#include "zt_common.h"

#define MAX_TOKENIZER_FILE (64u << 20)

/* The tokenizer to export: a record's fields (type "" when none is known). */
typedef zt_tok_record_t tok_info;

/* ---- reading the epoch ------------------------------------------------------------ */

/* The epoch's model config and parameters are read by engine/ckpt_io.c
 * (zt_ckpt_read_model, zt_ckpt_load_flat), as `zctl sample` reads them. */

/* man_tok: the record the manifest names, or "". */
static int find_tokenizer(const zt_export_opts_t *o, const char *man_tok,
                          const zt_model_config_t *cfg, tok_info *t) {
  memset(t, 0, sizeof *t);
  const char *path = o->tokenizer ? o->tokenizer : man_tok[0] ? man_tok : NULL;
  if (path && zt_tok_read_record(path, t) != 0) return -1;
  if (!path && cfg->vocab_size == 257) { /* zprep's byte tokenizer */
    snprintf(t->type, sizeof t->type, "byte");
    t->vocab_size = 257, t->eot = 256;
  }
  if (t->type[0] && t->vocab_size > cfg->vocab_size)
    return zt_err("the tokenizer has %d tokens, the model's vocabulary only %d", t->vocab_size,
                  cfg->vocab_size);
  return 0;
}

/* ---- writing files ------------------------------------------------------------------ */

static int write_bytes(const char *dir, const char *name, const void *buf, size_t len) {
  char path[ZT_PATH_MAX];
  if (zt_path_join(path, sizeof path, dir, name) != 0) return -1;
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return zt_err_errno("cannot create %s", path);
  int rc = zt_write_all(fd, buf, len);
  if (rc == 0 && fsync(fd) != 0) rc = zt_err_errno("fsync %s", path);
  if (close(fd) != 0 && rc == 0) rc = zt_err_errno("close %s", path);
  return rc;
}

/* Writes a JSON document (consumed). */
static int write_json(const char *dir, const char *name, cJSON *doc) {
  char *text = cJSON_Print(doc);
  cJSON_Delete(doc);
  if (!text) return zt_err("%s: out of memory", name);
  size_t n = strlen(text);
  text[n] = '\n'; /* replaces the terminator; the length is known */
  int rc = write_bytes(dir, name, text, n + 1);
  free(text);
  return rc;
}

static int copy_file(const char *from, const char *dir, const char *name) {
  char *buf;
  size_t len;
  if (zt_read_file(from, &buf, &len, MAX_TOKENIZER_FILE) != 0) return zt_err_wrap("tokenizer");
  int rc = write_bytes(dir, name, buf, len);
  free(buf);
  return rc;
}

/* config.json's first fields: the architecture and model type. */
static cJSON *config_head(const char *arch, const char *type) {
  cJSON *c = cJSON_CreateObject();
  cJSON *a = cJSON_AddArrayToObject(c, "architectures");
  cJSON_AddItemToArray(a, cJSON_CreateString(arch));
  cJSON_AddStringToObject(c, "model_type", type);
  return c;
}

/* GPT2Config. */
static cJSON *gpt2_config_json(const zt_model_config_t *cfg) {
  cJSON *c = config_head("GPT2LMHeadModel", "gpt2");
  cJSON_AddNumberToObject(c, "vocab_size", cfg->vocab_size);
  cJSON_AddNumberToObject(c, "n_positions", cfg->seq_len);
  cJSON_AddNumberToObject(c, "n_ctx", cfg->seq_len);
  cJSON_AddNumberToObject(c, "n_embd", cfg->n_embd);
  cJSON_AddNumberToObject(c, "n_layer", cfg->n_layer);
  cJSON_AddNumberToObject(c, "n_head", cfg->n_head);
  cJSON_AddNullToObject(c, "n_inner"); /* 4 n_embd */
  cJSON_AddStringToObject(c, "activation_function", "gelu_new");
  cJSON_AddNumberToObject(c, "layer_norm_epsilon", 1e-5);
  cJSON_AddNumberToObject(c, "initializer_range", 0.02);
  cJSON_AddNumberToObject(c, "resid_pdrop", 0.0);
  cJSON_AddNumberToObject(c, "embd_pdrop", 0.0);
  cJSON_AddNumberToObject(c, "attn_pdrop", 0.0);
  cJSON_AddTrueToObject(c, "scale_attn_weights");
  cJSON_AddTrueToObject(c, "tie_word_embeddings");
  return c;
}

/* LlamaConfig of a llama model, or Qwen2Config of one with q/k/v biases
 * (Qwen2's attention: LlamaConfig's attention_bias would give o_proj a
 * bias too, which the file does not have): what init.from_pretrained
 * reads, so an export is a starting point again. Floats are written as
 * the shortest decimals that give the model's values (1e-05, as the source
 * said it); max_position_embeddings is the source's, or seq_len. */
static cJSON *llama_config_json(const zt_model_config_t *cfg) {
  int qwen2 = cfg->qkv_bias;
  cJSON *c = qwen2 ? config_head("Qwen2ForCausalLM", "qwen2")
                   : config_head("LlamaForCausalLM", "llama");
  cJSON_AddNumberToObject(c, "vocab_size", cfg->vocab_size);
  cJSON_AddNumberToObject(c, "hidden_size", cfg->n_embd);
  cJSON_AddNumberToObject(c, "intermediate_size", cfg->n_ff);
  cJSON_AddNumberToObject(c, "num_hidden_layers", cfg->n_layer);
  cJSON_AddNumberToObject(c, "num_attention_heads", cfg->n_head);
  cJSON_AddNumberToObject(c, "num_key_value_heads", cfg->n_kv_head);
  cJSON_AddNumberToObject(c, "head_dim", cfg->head_dim);
  cJSON_AddNumberToObject(c, "max_position_embeddings", cfg->max_pos ? cfg->max_pos : cfg->seq_len);
  cJSON_AddNumberToObject(c, "rms_norm_eps", zt_float_decimal(cfg->norm_eps));
  cJSON_AddNumberToObject(c, "rope_theta", zt_float_decimal(cfg->rope_theta));
  cJSON_AddItemToObject(c, "rope_scaling", zt_spec_rope_json(cfg));
  cJSON_AddStringToObject(c, "hidden_act", "silu");
  if (qwen2) {
    cJSON_AddFalseToObject(c, "use_sliding_window");
    cJSON_AddNullToObject(c, "sliding_window");
    cJSON_AddNumberToObject(c, "max_window_layers", cfg->n_layer);
  } else {
    cJSON_AddFalseToObject(c, "attention_bias");
    cJSON_AddFalseToObject(c, "mlp_bias");
  }
  cJSON_AddNumberToObject(c, "attention_dropout", 0.0);
  cJSON_AddNumberToObject(c, "initializer_range", 0.02);
  cJSON_AddBoolToObject(c, "tie_word_embeddings", cfg->tie_embed);
  return c;
}

/* The tokenizer's special tokens: the end of text (the record's), and the
 * beginning of a sequence (an hf tokenizer's template's, else the end of
 * text), with their texts. */
typedef struct {
  int bos, eot;
  char bos_text[256], eot_text[256];
} specials_t;

static cJSON *config_json(const zt_model_config_t *cfg, const tok_info *t, const specials_t *sp,
                          int bf16, int64_t step) {
  cJSON *c = cfg->arch == ZT_ARCH_LLAMA ? llama_config_json(cfg) : gpt2_config_json(cfg);
  cJSON_AddTrueToObject(c, "use_cache");
  if (t->type[0] && sp->eot < cfg->vocab_size && sp->bos < cfg->vocab_size) {
    cJSON_AddNumberToObject(c, "bos_token_id", sp->bos);
    cJSON_AddNumberToObject(c, "eos_token_id", sp->eot);
  }
  cJSON_AddStringToObject(c, "torch_dtype", bf16 ? "bfloat16" : "float32");
  cJSON *z = cJSON_AddObjectToObject(c, "ztrain");
  cJSON_AddNumberToObject(z, "step", (double)step);
  return c;
}

static cJSON *byte_level(void) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "type", "ByteLevel");
  cJSON_AddFalseToObject(o, "add_prefix_space");
  cJSON_AddTrueToObject(o, "trim_offsets");
  cJSON_AddFalseToObject(o, "use_regex");
  return o;
}

/* tokenizer.json (Hugging Face tokenizers) of the byte tokenizer: a
 * byte-level BPE whose vocabulary is the 256 byte characters with no
 * merges, and the end-of-text token as a special added token. */
static cJSON *byte_tokenizer_json(int eot) {
  cJSON *t = cJSON_CreateObject();
  cJSON_AddStringToObject(t, "version", "1.0");
  cJSON_AddNullToObject(t, "truncation");
  cJSON_AddNullToObject(t, "padding");
  cJSON *added = cJSON_AddArrayToObject(t, "added_tokens"), *a = cJSON_CreateObject();
  cJSON_AddNumberToObject(a, "id", eot);
  cJSON_AddStringToObject(a, "content", ZT_TOK_EOT_TEXT);
  cJSON_AddFalseToObject(a, "single_word");
  cJSON_AddFalseToObject(a, "lstrip");
  cJSON_AddFalseToObject(a, "rstrip");
  cJSON_AddTrueToObject(a, "normalized");
  cJSON_AddTrueToObject(a, "special");
  cJSON_AddItemToArray(added, a);
  cJSON_AddNullToObject(t, "normalizer");
  cJSON_AddItemToObject(t, "pre_tokenizer", byte_level());
  cJSON_AddNullToObject(t, "post_processor");
  cJSON_AddItemToObject(t, "decoder", byte_level());
  cJSON *m = cJSON_AddObjectToObject(t, "model");
  cJSON_AddStringToObject(m, "type", "BPE");
  cJSON_AddNullToObject(m, "dropout");
  cJSON_AddNullToObject(m, "unk_token");
  cJSON_AddNullToObject(m, "continuing_subword_prefix");
  cJSON_AddNullToObject(m, "end_of_word_suffix");
  cJSON_AddFalseToObject(m, "fuse_unk");
  cJSON_AddFalseToObject(m, "byte_fallback");
  cJSON *vocab = cJSON_AddObjectToObject(m, "vocab");
  for (int b = 0; b < 256; b++) {
    char ch[3];
    zt_tok_byte_char(b, ch);
    cJSON_AddNumberToObject(vocab, ch, b);
  }
  cJSON_AddArrayToObject(m, "merges");
  return t;
}

/* Token id's text into out. */
static int token_text(const zt_tok_t *tok, int id, char *out, size_t cap) {
  const char *b;
  size_t l;
  if (zt_tok_decode(tok, id, &b, &l) != 0) return -1;
  snprintf(out, cap, "%.*s", (int)ZT_MIN(l, cap - 1), b);
  return 0;
}

/* The special tokens of t: GPT-2's end of text for byte and gpt2, the hf
 * tokenizer's own otherwise. */
static int specials(const tok_info *t, specials_t *sp) {
  sp->bos = sp->eot = t->eot;
  snprintf(sp->eot_text, sizeof sp->eot_text, "%s", ZT_TOK_EOT_TEXT);
  snprintf(sp->bos_text, sizeof sp->bos_text, "%s", ZT_TOK_EOT_TEXT);
  if (strcmp(t->type, "hf")) return 0;
  zt_tok_t *tok;
  if (zt_tok_open_hf(t->hf, NULL, &tok) != 0) return zt_err_wrap("tokenizer");
  if (zt_tok_bos(tok) != zt_tok_eot(tok)) sp->bos = zt_tok_bos(tok);
  int rc = token_text(tok, sp->eot, sp->eot_text, sizeof sp->eot_text) != 0 ||
                   token_text(tok, sp->bos, sp->bos_text, sizeof sp->bos_text) != 0
               ? -1
               : 0;
  zt_tok_free(tok);
  return rc;
}

/* hf: the tokenizer.json the shards were made with, as it was. */
static int write_tokenizer(const char *dir, const tok_info *t, const specials_t *sp,
                           int seq_len) {
  if (!t->type[0]) return 0;
  int gpt2 = !strcmp(t->type, "gpt2"), hf = !strcmp(t->type, "hf");
  if (gpt2 && (copy_file(t->encoder, dir, "vocab.json") != 0 ||
               copy_file(t->bpe, dir, "merges.txt") != 0))
    return -1;
  if (hf && copy_file(t->hf, dir, "tokenizer.json") != 0) return -1;
  if (!gpt2 && !hf && write_json(dir, "tokenizer.json", byte_tokenizer_json(t->eot)) != 0)
    return -1;
  cJSON *tc = cJSON_CreateObject();
  cJSON_AddStringToObject(tc, "tokenizer_class", gpt2 ? "GPT2Tokenizer" : "PreTrainedTokenizerFast");
  cJSON_AddNumberToObject(tc, "model_max_length", seq_len);
  cJSON_AddFalseToObject(tc, "add_prefix_space");
  cJSON *sm = cJSON_CreateObject();
  const char *keys[] = {"bos_token", "eos_token", "unk_token"};
  const char *text[] = {sp->bos_text, sp->eot_text, sp->eot_text};
  for (int i = 0; i < (hf ? 2 : 3); i++) { /* an hf tokenizer has no unk of ours */
    cJSON_AddStringToObject(tc, keys[i], text[i]);
    cJSON_AddStringToObject(sm, keys[i], text[i]);
  }
  if (write_json(dir, "tokenizer_config.json", tc) != 0) {
    cJSON_Delete(sm);
    return -1;
  }
  return write_json(dir, "special_tokens_map.json", sm);
}

/* ---- LoRA ------------------------------------------------------------------------- */

/* PEFT's adapter_config.json for the adapters of cfg on `base`. */
static cJSON *adapter_config_json(const zt_model_config_t *cfg, const char *base) {
  cJSON *c = cJSON_CreateObject();
  cJSON_AddStringToObject(c, "peft_type", "LORA");
  cJSON_AddStringToObject(c, "task_type", "CAUSAL_LM");
  cJSON_AddStringToObject(c, "base_model_name_or_path", base);
  cJSON_AddNumberToObject(c, "r", cfg->lora_r);
  cJSON_AddNumberToObject(c, "lora_alpha", cfg->lora_alpha);
  cJSON_AddNumberToObject(c, "lora_dropout", 0.0);
  cJSON_AddItemToObject(c, "target_modules", zt_lora_targets_json(cfg->lora_targets));
  cJSON_AddStringToObject(c, "bias", "none");
  cJSON_AddBoolToObject(c, "fan_in_fan_out", 0);
  cJSON_AddBoolToObject(c, "use_rslora", 0);
  cJSON_AddBoolToObject(c, "inference_mode", 1);
  cJSON_AddNullToObject(c, "modules_to_save");
  return c;
}

/* A LoRA epoch: the adapter files into tmp (1: written, nothing else to
 * do), or the merged model in place of the adapters (0: go on). */
static int lora_export(const zt_export_opts_t *o, const char *tmp, zt_model_config_t *cfg,
                       zt_layout_t *lay, float **flat, zt_export_info_t *info) {
  char base[ZT_PATH_MAX], sum[32], path[ZT_PATH_MAX];
  if (!o->lora)
    return zt_err("%s holds LoRA adapters (r %d): say --adapter (PEFT's adapter directory) or "
                  "--merge (the base model with the adapters merged in)", o->epoch_dir, cfg->lora_r);
  if (o->lora == ZT_EXPORT_MERGE)
    return zt_lora_merge_epoch(o->epoch_dir, o->base, cfg, lay, flat) != 0
               ? zt_err_wrap("export --merge")
               : 0;
  if (zt_ckpt_read_lora_base(o->epoch_dir, base, sizeof base, sum) != 0) return -1;
  info->model_file = "adapter_model.safetensors";
  if (zt_path_join(path, sizeof path, tmp, info->model_file) != 0 ||
      zt_st_write(path, lay, *flat, o->bf16, info->step, &info->model_bytes) != 0 ||
      write_json(tmp, "adapter_config.json", adapter_config_json(cfg, base)) != 0)
    return -1;
  return 1;
}

/* ---- the directory ------------------------------------------------------------------ */

/* 1 when dir exists and holds nothing, 0 when it does not exist, -1 when
 * it cannot be the output (a file, or a non-empty directory). */
static int out_state(const char *dir) {
  struct stat st;
  if (stat(dir, &st) != 0) return errno == ENOENT ? 0 : zt_err_errno("%s", dir);
  if (!S_ISDIR(st.st_mode)) return zt_err("%s exists and is not a directory", dir);
  DIR *d = opendir(dir);
  if (!d) return zt_err_errno("%s", dir);
  struct dirent *e;
  int n = 0;
  while ((e = readdir(d)))
    n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
  closedir(d);
  return n ? zt_err("%s exists and is not empty (export into a new directory)", dir) : 1;
}

static void remove_tree_flat(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  char path[ZT_PATH_MAX];
  while ((e = readdir(d)))
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
      if (zt_path_join(path, sizeof path, dir, e->d_name) == 0) unlink(path);
    }
  closedir(d);
  rmdir(dir);
}

int zt_export_dir(const zt_export_opts_t *o, zt_export_info_t *info) {
  zt_model_config_t cfg;
  zt_layout_t lay = {0};
  tok_info tok;
  float *flat = NULL;
  char tmp[ZT_PATH_MAX] = "", parent[ZT_PATH_MAX], out_dir[ZT_PATH_MAX], man_tok[ZT_PATH_MAX];
  int ret = -1;
  memset(info, 0, sizeof *info);
  size_t ol = strlen(o->out_dir);
  while (ol > 1 && o->out_dir[ol - 1] == '/') ol--; /* "out/" is "out" */
  if (ol == 0 || ol >= sizeof out_dir) return zt_err("export: bad output directory name");
  memcpy(out_dir, o->out_dir, ol);
  out_dir[ol] = 0;
  if (zt_ckpt_read_model(o->epoch_dir, &cfg, man_tok, sizeof man_tok) != 0 ||
      find_tokenizer(o, man_tok, &cfg, &tok) != 0)
    goto out;
  int st = out_state(out_dir);
  if (st < 0) goto out;
  snprintf(parent, sizeof parent, "%s", out_dir);
  char *slash = strrchr(parent, '/');
  if (slash && slash != parent) *slash = 0;
  if (slash && slash != parent && zt_mkdirs(parent) != 0) goto out;
  if (zt_ckpt_load_flat(o->epoch_dir, &cfg, &lay, &flat, &info->step) != 0) goto out;
  if (zt_path_fmt(tmp, sizeof tmp, "%s.tmp-%d", out_dir, (int)getpid()) != 0) goto out;
  if (mkdir(tmp, 0755) != 0) {
    zt_err_errno("cannot create %s", tmp);
    tmp[0] = 0;
    goto out;
  }
  char path[ZT_PATH_MAX];
  int adapter = 0;
  if (cfg.lora_r || o->lora) {
    if (!cfg.lora_r) {
      zt_err("%s holds a full model, not LoRA adapters (--adapter and --merge are for those)",
             o->epoch_dir);
      goto out;
    }
    if ((adapter = lora_export(o, tmp, &cfg, &lay, &flat, info)) < 0) goto out;
  }
  if (!adapter) info->model_file = "model.safetensors";
  specials_t sp;
  if (!adapter &&
      (zt_path_join(path, sizeof path, tmp, "model.safetensors") != 0 ||
       specials(&tok, &sp) != 0 ||
       zt_st_write(path, &lay, flat, o->bf16, info->step, &info->model_bytes) != 0 ||
       write_json(tmp, "config.json", config_json(&cfg, &tok, &sp, o->bf16, info->step)) != 0 ||
       write_tokenizer(tmp, &tok, &sp, cfg.seq_len) != 0))
    goto out;
  if (zt_ckpt_fsync_dir(tmp) != 0) goto out;
  if (st == 1 && rmdir(out_dir) != 0) {
    zt_err_errno("cannot replace the empty directory %s", out_dir);
    goto out;
  }
  if (rename(tmp, out_dir) != 0) {
    zt_err_errno("cannot rename %s to %s", tmp, out_dir);
    goto out;
  }
  tmp[0] = 0;
  snprintf(info->tokenizer, sizeof info->tokenizer, "%s", tok.type[0] ? tok.type : "none");
  ret = 0;
out:
  if (tmp[0]) remove_tree_flat(tmp);
  free(flat);
  zt_layout_free(&lay);
  return ret;
}
