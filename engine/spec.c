/*
 * spec.c: parsing and validation of the JSON job spec (cJSON).
 *
 * Each JSON object of the spec is read by one function that first checks
 * that all its keys are known (check_keys) and then reads each key with a
 * typed getter that enforces the range (common/zt_json.h). Duplicate keys
 * are an error too (JSON allows them, but cJSON would silently use the
 * first). Every error names the full key path. Defaults are set before parsing, so a missing
 * optional key simply keeps its default. The coordinator reads specs with
 * this same parser (coordinator/params.c), so the two can never disagree.
 */
#include "spec.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "zt_common.h"
#include "zt_json.h"

/* ---- sections ------------------------------------------------------------- */

int zt_spec_rope_parse(const cJSON *o, const char *where, zt_model_config_t *c) {
  static const char *const keys[] = {"rope_type", "type", "factor", "low_freq_factor",
                                     "high_freq_factor", "original_max_position_embeddings"};
  c->rope_factor = c->rope_low_freq_factor = c->rope_high_freq_factor = 0;
  c->rope_original_max_pos = 0;
  if (!o || cJSON_IsNull(o)) return 0;
  if (!cJSON_IsObject(o)) return zt_err("%s: expected an object or null", where);
  const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "rope_type");
  if (!ty) ty = cJSON_GetObjectItemCaseSensitive(o, "type");
  const char *t = cJSON_IsString(ty) ? ty->valuestring : "";
  if (!strcmp(t, "default")) return 0; /* Hugging Face's name for no scaling */
  if (strcmp(t, "llama3"))
    return zt_err("%s: rope_type \"%.40s\" is not supported (llama3, default, or no "
                  "rope_scaling)", where, t);
  if (zt_json_check_keys(o, where, keys, ZT_ARRAY_LEN(keys)) != 0) return -1;
  float f = 0, lo = 0, hi = 0;
  int orig = 0;
  if (zt_json_float(o, where, "factor", 0, 1, 1e6, &f) ||
      zt_json_float(o, where, "low_freq_factor", 0, 1, 1e6, &lo) ||
      zt_json_float(o, where, "high_freq_factor", 0, 1, 1e6, &hi) ||
      zt_json_int(o, where, "original_max_position_embeddings", 1, 1, ZT_MODEL_MAX_SEQ, &orig))
    return -1;
  if (f == 0 || !(hi > lo))
    return zt_err("%s: needs factor > 0 and high_freq_factor > low_freq_factor", where);
  c->rope_factor = f, c->rope_low_freq_factor = lo, c->rope_high_freq_factor = hi;
  c->rope_original_max_pos = orig;
  return 0;
}

int zt_spec_rope_same(const zt_model_config_t *a, const zt_model_config_t *b) {
  return a->rope_factor == b->rope_factor && a->rope_low_freq_factor == b->rope_low_freq_factor &&
         a->rope_high_freq_factor == b->rope_high_freq_factor &&
         a->rope_original_max_pos == b->rope_original_max_pos;
}

cJSON *zt_lora_targets_json(unsigned targets) {
  cJSON *t = cJSON_CreateArray();
  for (int i = 0; i < ZT_LORA_NTARGETS; i++)
    if (targets >> i & 1) cJSON_AddItemToArray(t, cJSON_CreateString(zt_lora_target_names[i]));
  return t;
}

cJSON *zt_spec_rope_json(const zt_model_config_t *c) {
  if (c->rope_factor == 0) return cJSON_CreateNull();
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "rope_type", "llama3");
  cJSON_AddNumberToObject(o, "factor", zt_float_decimal(c->rope_factor));
  cJSON_AddNumberToObject(o, "low_freq_factor", zt_float_decimal(c->rope_low_freq_factor));
  cJSON_AddNumberToObject(o, "high_freq_factor", zt_float_decimal(c->rope_high_freq_factor));
  cJSON_AddNumberToObject(o, "original_max_position_embeddings", c->rope_original_max_pos);
  return o;
}

/* model.arch "llama": Hugging Face LlamaConfig's fields under our names
 * (layout.h); the keys only llama has are refused for gpt2. */
static const char *const k_llama_keys[] = {"n_kv_head", "head_dim", "intermediate_size",
                                           "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                                           "attention_bias", "rope_scaling",
                                           "max_position_embeddings"};

static int parse_llama(zt_model_config_t *c, const cJSON *o) {
  c->n_kv_head = c->n_head;
  c->head_dim = c->n_embd / c->n_head;
  c->rope_theta = 10000.0f;
  c->norm_eps = 1e-6f;
  if (zt_json_int(o, "model", "n_kv_head", 0, 1, ZT_MODEL_MAX_HEAD, &c->n_kv_head) ||
      zt_json_int(o, "model", "head_dim", 0, 2, ZT_MODEL_MAX_EMBD, &c->head_dim) ||
      zt_json_int(o, "model", "intermediate_size", 1, 1, 4 * ZT_MODEL_MAX_EMBD, &c->n_ff) ||
      zt_json_float(o, "model", "rope_theta", 0, 1, 1e12, &c->rope_theta) ||
      zt_json_float(o, "model", "rms_norm_eps", 0, 1, 1, &c->norm_eps) ||
      zt_json_bool(o, "model", "tie_word_embeddings", &c->tie_embed) ||
      zt_json_bool(o, "model", "attention_bias", &c->qkv_bias) ||
      zt_json_int(o, "model", "max_position_embeddings", 0, 1, 1 << 24, &c->max_pos) ||
      zt_spec_rope_parse(cJSON_GetObjectItemCaseSensitive(o, "rope_scaling"),
                            "model.rope_scaling", c))
    return -1;
  if (c->max_pos && c->seq_len > c->max_pos)
    return zt_err("model.seq_len %d is above model.max_position_embeddings %d", c->seq_len,
                  c->max_pos);
  return 0;
}

static int parse_model(zt_spec_t *s, const cJSON *root) {
  static const char *const keys[] = {"n_layer",  "n_head",     "n_embd", "seq_len",
                                     "vocab_size", "arch",     "n_kv_head", "head_dim",
                                     "intermediate_size", "rope_theta", "rms_norm_eps",
                                     "tie_word_embeddings", "attention_bias", "rope_scaling",
                                     "max_position_embeddings"};
  const cJSON *o;
  if (zt_json_object(root, "", "model", 1, &o) || ZT_JSON_CHECK_KEYS(o, "model", keys)) return -1;
  zt_model_config_t *c = &s->model;
  char arch[16] = "gpt2";
  if (zt_json_int(o, "model", "n_layer", 1, 1, ZT_MODEL_MAX_LAYER, &c->n_layer) ||
      zt_json_int(o, "model", "n_head", 1, 1, ZT_MODEL_MAX_HEAD, &c->n_head) ||
      zt_json_int(o, "model", "n_embd", 1, 1, ZT_MODEL_MAX_EMBD, &c->n_embd) ||
      zt_json_int(o, "model", "seq_len", 1, 1, ZT_MODEL_MAX_SEQ, &c->seq_len) ||
      zt_json_int(o, "model", "vocab_size", 1, 2, ZT_MODEL_MAX_VOCAB, &c->vocab_size) ||
      zt_json_string(o, "model", "arch", 0, arch, sizeof arch))
    return -1;
  if (!strcmp(arch, "llama")) {
    c->arch = ZT_ARCH_LLAMA;
    if (parse_llama(c, o) != 0) return -1;
  } else if (strcmp(arch, "gpt2")) {
    return zt_err("model.arch: \"%s\" is not an architecture (gpt2 or llama)", arch);
  } else {
    for (size_t i = 0; i < ZT_ARRAY_LEN(k_llama_keys); i++)
      if (cJSON_GetObjectItemCaseSensitive(o, k_llama_keys[i]))
        return zt_err("model.%s: a llama field; set model.arch to \"llama\" or remove it",
                      k_llama_keys[i]);
  }
  if (zt_model_config_check(c) != 0) return zt_err_wrap("model");
  return 0;
}

static int parse_optimizer(zt_spec_t *s, const cJSON *root) {
  static const char *const keys[] = {"type", "params"};
  static const char *const pkeys[] = {"lr", "betas", "eps", "weight_decay"};
  char type[32] = "AdamW";
  const cJSON *o, *p;
  if (zt_json_object(root, "", "optimizer", 0, &o)) return -1;
  if (!o) return 0;
  if (ZT_JSON_CHECK_KEYS(o, "optimizer", keys) ||
      zt_json_string(o, "optimizer", "type", 0, type, sizeof type))
    return -1;
  if (strcmp(type, "AdamW") != 0)
    return zt_err("optimizer.type: \"%s\" is not supported (only \"AdamW\")", type);
  if (zt_json_object(o, "optimizer", "params", 0, &p)) return -1;
  if (!p) return 0;
  if (ZT_JSON_CHECK_KEYS(p, "optimizer.params", pkeys) ||
      zt_json_float(p, "optimizer.params", "lr", 0.0, 0, 10.0, &s->opt.lr) ||
      zt_json_float(p, "optimizer.params", "eps", 0.0, 1, 1.0, &s->opt.eps) ||
      zt_json_float(p, "optimizer.params", "weight_decay", 0.0, 0, 10.0, &s->opt.weight_decay))
    return -1;
  const cJSON *b = cJSON_GetObjectItemCaseSensitive(p, "betas");
  if (b) {
    if (!cJSON_IsArray(b) || cJSON_GetArraySize(b) != 2)
      return zt_err("optimizer.params.betas: expected an array of two numbers");
    float *dst[2] = {&s->opt.beta1, &s->opt.beta2};
    for (int i = 0; i < 2; i++) {
      const cJSON *x = cJSON_GetArrayItem(b, i);
      if (!cJSON_IsNumber(x) || x->valuedouble < 0.0 || x->valuedouble >= 1.0)
        return zt_err("optimizer.params.betas[%d]: expected a number in [0, 1)", i);
      *dst[i] = (float)x->valuedouble;
    }
  }
  return 0;
}

static int parse_scheduler(zt_spec_t *s, const cJSON *root) {
  static const char *const keys[] = {"type", "params"};
  static const char *const pkeys[] = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                      "total_num_steps", "warmup_type"};
  const char *path = "scheduler.params";
  char type[32] = "", wtype[32] = "linear";
  const cJSON *o, *p;
  if (zt_json_object(root, "", "scheduler", 0, &o)) return -1;
  if (!o) return 0;
  if (ZT_JSON_CHECK_KEYS(o, "scheduler", keys) ||
      zt_json_string(o, "scheduler", "type", 1, type, sizeof type))
    return -1;
  if (strcmp(type, "WarmupDecayLR") != 0)
    return zt_err("scheduler.type: \"%s\" is not supported (only \"WarmupDecayLR\")", type);
  zt_lr_sched_t *c = &s->sched;
  c->enabled = 1;
  c->min_lr = 0.0f;
  c->max_lr = s->opt.lr;
  c->warmup_steps = 0;
  c->total_steps = s->steps;
  if (zt_json_object(o, "scheduler", "params", 0, &p)) return -1;
  if (p && (ZT_JSON_CHECK_KEYS(p, path, pkeys) ||
            zt_json_float(p, path, "warmup_min_lr", 0.0, 0, 10.0, &c->min_lr) ||
            zt_json_float(p, path, "warmup_max_lr", 0.0, 0, 10.0, &c->max_lr) ||
            zt_json_long(p, path, "warmup_num_steps", 0, 0, 1L << 40, &c->warmup_steps) ||
            zt_json_long(p, path, "total_num_steps", 0, 1, 1L << 40, &c->total_steps) ||
            zt_json_string(p, path, "warmup_type", 0, wtype, sizeof wtype)))
    return -1;
  if (strcmp(wtype, "linear") != 0)
    return zt_err("%s.warmup_type: \"%s\" is not supported (only \"linear\")", path, wtype);
  if (c->max_lr < c->min_lr)
    return zt_err("%s.warmup_max_lr: %g is below warmup_min_lr %g", path, c->max_lr, c->min_lr);
  if (c->total_steps <= c->warmup_steps)
    return zt_err("%s.total_num_steps: %ld must exceed warmup_num_steps %ld", path,
                  c->total_steps, c->warmup_steps);
  return 0;
}

static int parse_data_eval(zt_spec_t *s, const cJSON *root) {
  static const char *const dkeys[] = {"train", "val"};
  static const char *const ekeys[] = {"every_steps", "batches"};
  const cJSON *d, *e;
  if (zt_json_object(root, "", "data", 1, &d) || ZT_JSON_CHECK_KEYS(d, "data", dkeys) ||
      zt_json_string(d, "data", "train", 1, s->train_glob, sizeof s->train_glob) ||
      zt_json_string(d, "data", "val", 0, s->val_glob, sizeof s->val_glob))
    return -1;
  if (!s->train_glob[0]) return zt_err("data.train: empty pattern");
  if (zt_json_object(root, "", "eval", 0, &e)) return -1;
  if (e && (ZT_JSON_CHECK_KEYS(e, "eval", ekeys) ||
            zt_json_int(e, "eval", "every_steps", 0, 0, 1L << 30, &s->eval_every) ||
            zt_json_int(e, "eval", "batches", 0, 1, 1L << 20, &s->eval_batches)))
    return -1;
  if (s->eval_every > 0 && !s->val_glob[0])
    return zt_err("eval.every_steps: evaluation needs data.val");
  return 0;
}

#define ZT_SPEC_MAX_MICRO_TOKENS (1L << 20)

static int parse_batch(zt_spec_t *s, const cJSON *root) {
  long gb = 0;
  if (zt_json_int(root, "", "train_micro_batch_size_per_gpu", 1, 1, 1 << 20, &s->micro_batch) ||
      zt_json_int(root, "", "gradient_accumulation_steps", 0, 1, 1 << 20, &s->accum) ||
      zt_json_long(root, "", "train_batch_size", 0, 1, 1L << 40, &gb) ||
      zt_json_float(root, "", "gradient_clipping", 0.0, 0, 1e9, &s->grad_clip))
    return -1;
  int have_accum = cJSON_GetObjectItemCaseSensitive(root, "gradient_accumulation_steps") != NULL;
  s->have_train_batch = gb > 0;
  s->global_batch = gb > 0 ? gb : (long)s->micro_batch * s->accum;
  if (s->global_batch % s->micro_batch != 0)
    return zt_err("train_batch_size: %ld is not a multiple of train_micro_batch_size_per_gpu %d",
                  s->global_batch, s->micro_batch);
  if (have_accum && s->have_train_batch &&
      s->global_batch % ((long)s->micro_batch * s->accum) != 0)
    return zt_err("train_batch_size: %ld != train_micro_batch_size_per_gpu (%d) * "
                  "gradient_accumulation_steps (%d) * world size, for any integer world size",
                  s->global_batch, s->micro_batch, s->accum);
  /* The model and the kernels count a micro-step's tokens (B x T) and
   * attention's rows (B x n_head x T) in int (parse_model runs first). */
  if ((long)s->micro_batch * s->model.seq_len > ZT_SPEC_MAX_MICRO_TOKENS)
    return zt_err("train_micro_batch_size_per_gpu x model.seq_len: %ld tokens a micro-step, "
                  "at most %ld", (long)s->micro_batch * s->model.seq_len,
                  (long)ZT_SPEC_MAX_MICRO_TOKENS);
  return 0;
}

static int parse_zero_elastic(zt_spec_t *s, const cJSON *root) {
  static const char *const zkeys[] = {"stage", "overlap_comm"};
  static const char *const ekeys[] = {"min_workers",      "max_workers",
                                      "max_failed_generations", "backoff_ms",
                                      "max_backoff_ms",   "max_restarts",
                                      "restart_window_s"};
  static const char *const ckeys[] = {"timeout_ms"};
  static const char *const bkeys[] = {"enabled"};
  const cJSON *z, *e, *c, *b;
  if (zt_json_object(root, "", "zero_optimization", 0, &z) ||
      (z && (ZT_JSON_CHECK_KEYS(z, "zero_optimization", zkeys) ||
             zt_json_int(z, "zero_optimization", "stage", 0, 0, 3, &s->zero_stage) ||
             zt_json_bool(z, "zero_optimization", "overlap_comm", &s->overlap_comm))))
    return -1;
  if (zt_json_object(root, "", "elastic", 0, &e) ||
      (e && (ZT_JSON_CHECK_KEYS(e, "elastic", ekeys) ||
             zt_json_int(e, "elastic", "min_workers", 0, 1, 256, &s->min_workers))))
    return -1;
  s->max_workers = s->min_workers;
  zt_spec_restart_t *r = &s->restart;
  if (e && (zt_json_int(e, "elastic", "max_workers", 0, 1, 256, &s->max_workers) ||
            zt_json_int(e, "elastic", "max_failed_generations", 0, 1, 1000,
                    &r->max_failed_generations) ||
            zt_json_long(e, "elastic", "backoff_ms", 0, 0, 600000, &r->backoff_ms) ||
            zt_json_long(e, "elastic", "max_backoff_ms", 0, 0, 3600000, &r->max_backoff_ms) ||
            zt_json_int(e, "elastic", "max_restarts", 0, 1, 1000000, &r->max_restarts) ||
            zt_json_long(e, "elastic", "restart_window_s", 0, 1, 1L << 30, &r->restart_window_s)))
    return -1;
  if (r->max_backoff_ms < r->backoff_ms) r->max_backoff_ms = r->backoff_ms;
  if (s->max_workers < s->min_workers)
    return zt_err("elastic.max_workers: %d is below min_workers %d", s->max_workers,
                  s->min_workers);
  if (zt_json_object(root, "", "comm", 0, &c) ||
      (c && (ZT_JSON_CHECK_KEYS(c, "comm", ckeys) ||
             zt_json_long(c, "comm", "timeout_ms", 0, 100, 3600000, &s->comm_timeout_ms))))
    return -1;
  if (zt_json_object(root, "", "bf16", 0, &b) ||
      (b && (ZT_JSON_CHECK_KEYS(b, "bf16", bkeys) || zt_json_bool(b, "bf16", "enabled", &s->bf16))))
    return -1;
  if (zt_json_bool(root, "", "activation_checkpointing", &s->act_ckpt) ||
      zt_json_bool(root, "", "wall_clock_breakdown", &s->wall_clock_breakdown))
    return -1;
  return 0;
}

/* load_balance {mode: "equal" | "speed", every_steps}: how a step's
 * micro-batches are shared among the ranks (trainer.c, docs/engine.md). */
static int parse_balance(zt_spec_t *s, const cJSON *root) {
  static const char *const keys[] = {"mode", "every_steps"};
  const cJSON *o;
  char mode[16] = "equal";
  if (zt_json_object(root, "", "load_balance", 0, &o)) return -1;
  if (!o) return 0;
  if (ZT_JSON_CHECK_KEYS(o, "load_balance", keys) ||
      zt_json_string(o, "load_balance", "mode", 0, mode, sizeof mode) ||
      zt_json_long(o, "load_balance", "every_steps", 0, 1, 1L << 30, &s->lb_every))
    return -1;
  if (strcmp(mode, "equal") && strcmp(mode, "speed"))
    return zt_err("load_balance.mode: \"%s\" is neither \"equal\" nor \"speed\"", mode);
  s->lb_speed = !strcmp(mode, "speed");
  return 0;
}

/* sync {mode: "sync" | "diloco", inner_steps, outer_optimizer {lr,
 * momentum, nesterov}} (spec.h). DiLoCo syncs only every inner_steps
 * steps, so what must see every group's model lands on a sync: periodic
 * checkpoints and evaluations are multiples of inner_steps. Each worker is
 * its own group, which holds the whole model: ZeRO stages above 0 and
 * shares by speed have nothing to work on, and LoRA is not wired to the
 * outer step; all three are refused by name. Called after the sections it
 * checks against. */
static int parse_sync(zt_spec_t *s, const cJSON *root) {
  static const char *const keys[] = {"mode", "inner_steps", "outer_optimizer", "compression",
                                     "overlap_steps", "fragments", "group_size"};
  static const char *const okeys[] = {"lr", "momentum", "nesterov"};
  const char *P = "sync.outer_optimizer";
  const cJSON *o, *oo = NULL;
  char mode[16] = "sync", comp[16] = "none";
  if (zt_json_object(root, "", "sync", 0, &o)) return -1;
  if (!o) return 0;
  if (ZT_JSON_CHECK_KEYS(o, "sync", keys) ||
      zt_json_string(o, "sync", "mode", 0, mode, sizeof mode) ||
      zt_json_long(o, "sync", "inner_steps", 0, 1, 1L << 20, &s->inner_steps) ||
      zt_json_object(o, "sync", "outer_optimizer", 0, &oo) ||
      zt_json_string(o, "sync", "compression", 0, comp, sizeof comp) ||
      zt_json_long(o, "sync", "overlap_steps", 0, 0, 1L << 20, &s->overlap_steps) ||
      zt_json_long(o, "sync", "fragments", 0, 1, 1L << 20, &s->fragments) ||
      zt_json_long(o, "sync", "group_size", 0, 1, 64, &s->group_size))
    return -1;
  if (oo && (ZT_JSON_CHECK_KEYS(oo, P, okeys) ||
             zt_json_double(oo, P, "lr", 0.0, 1, 100.0, &s->outer_lr) ||
             zt_json_double(oo, P, "momentum", 0.0, 0, 0.9999, &s->outer_momentum) ||
             zt_json_bool(oo, P, "nesterov", &s->outer_nesterov)))
    return -1;
  if (strcmp(mode, "sync") && strcmp(mode, "diloco"))
    return zt_err("sync.mode: \"%s\" is neither \"sync\" nor \"diloco\"", mode);
  s->diloco = !strcmp(mode, "diloco");
  if (strcmp(comp, "none") && strcmp(comp, "bf16") && strcmp(comp, "int8") && strcmp(comp, "int4"))
    return zt_err("sync.compression: \"%s\" is none of \"none\", \"bf16\", \"int8\", "
                  "\"int4\"", comp);
  s->compression = !strcmp(comp, "bf16")   ? 1
                   : !strcmp(comp, "int8") ? 2
                   : !strcmp(comp, "int4") ? 3
                                           : 0;
  if (!s->diloco && s->compression == 3)
    return zt_err("sync.compression \"int4\" needs error feedback, which only sync.mode "
                  "\"diloco\" keeps");
  if (!s->diloco && s->overlap_steps)
    return zt_err("sync.overlap_steps: only sync.mode \"diloco\" overlaps its all-reduce");
  if (!s->diloco && s->fragments > 1)
    return zt_err("sync.fragments: only sync.mode \"diloco\" syncs in fragments");
  if (!s->diloco && s->group_size > 1)
    return zt_err("sync.group_size: only sync.mode \"diloco\" has groups");
  if (!s->diloco) return 0;
  long H = s->inner_steps, F = s->fragments, units = s->model.n_layer + 2;
  if (H % F != 0)
    return zt_err("sync.fragments (%ld) must divide sync.inner_steps (%ld): the fragments sync "
                  "inner_steps / fragments steps apart", F, H);
  if (F > units)
    return zt_err("sync.fragments (%ld): the model has %ld units (its layers, the embeddings "
                  "and the final norm) to share among them", F, units);
  if (s->overlap_steps >= H / F)
    return zt_err("sync.overlap_steps (%ld) must be below sync.inner_steps / sync.fragments "
                  "(%ld): a fragment's all-reduce lands before the next one starts",
                  s->overlap_steps, H / F);
  if (s->zero_stage != 0 && s->group_size == 1)
    return zt_err("sync.mode \"diloco\": each worker is a group of its own and holds the whole "
                  "model, so zero_optimization.stage must be 0 (got %d; sync.group_size shares "
                  "a group's model among its workers)", s->zero_stage);
  if (s->group_size > s->max_workers || s->max_workers / s->group_size * s->group_size <
                                            s->min_workers)
    return zt_err("sync.group_size %ld: no world size in elastic's %d..%d workers is a multiple "
                  "of it", s->group_size, s->min_workers, s->max_workers);
  if (s->lb_speed)
    return zt_err("sync.mode \"diloco\" and load_balance.mode \"speed\" do not go together: "
                  "each group computes its own share of every step");
  if (s->model.lora_r) return zt_err("sync.mode \"diloco\" does not train LoRA adapters yet");
  if (s->ckpt.every_steps % H != 0)
    return zt_err("sync.mode \"diloco\": checkpoint.every_steps (%ld) must be a multiple of "
                  "sync.inner_steps (%ld): an epoch is written where the groups meet",
                  s->ckpt.every_steps, H);
  if (s->eval_every % H != 0)
    return zt_err("sync.mode \"diloco\": eval.every_steps (%d) must be a multiple of "
                  "sync.inner_steps (%ld): the groups' models are one only where they meet",
                  s->eval_every, H);
  return 0;
}

static int parse_checkpoint(zt_spec_t *s, const cJSON *root) {
  static const char *const keys[] = {"dir",  "every_steps",           "keep_last", "keep_every",
                                     "load", "max_uncommitted_steps", "replicas",
                                     "shared"};
  const cJSON *o;
  zt_spec_ckpt_t *c = &s->ckpt;
  if (zt_json_object(root, "", "checkpoint", 0, &o)) return -1;
  if (!o) return 0;
  if (ZT_JSON_CHECK_KEYS(o, "checkpoint", keys) ||
      zt_json_string(o, "checkpoint", "dir", 1, c->dir, sizeof c->dir) ||
      zt_json_long(o, "checkpoint", "every_steps", 0, 0, 1L << 40, &c->every_steps) ||
      zt_json_int(o, "checkpoint", "keep_last", 0, 1, 1 << 20, &c->keep_last) ||
      zt_json_long(o, "checkpoint", "keep_every", 0, 0, 1L << 40, &c->keep_every) ||
      zt_json_string(o, "checkpoint", "load", 0, c->load, sizeof c->load) ||
      zt_json_long(o, "checkpoint", "max_uncommitted_steps", 0, 1, 1L << 40,
               &c->max_uncommitted_steps) ||
      zt_json_int(o, "checkpoint", "replicas", 0, 1, 8, &c->replicas) ||
      zt_json_bool(o, "checkpoint", "shared", &c->shared))
    return -1;
  if (c->shared && cJSON_GetObjectItemCaseSensitive(o, "replicas") && c->replicas != 1)
    return zt_err("checkpoint.replicas: %d copies asked for, but checkpoint.shared says every "
                  "worker sees the same files: leave replicas out (or 1)",
                  c->replicas);
  if (c->shared) c->replicas = 1;
  if (!c->max_uncommitted_steps) c->max_uncommitted_steps = 10 * c->every_steps;
  if (!c->dir[0] || strstr(c->dir, ".."))
    return zt_err("checkpoint.dir: expected a path (no \"..\")");
  return 0;
}

static int parse_rollback(zt_spec_t *s, const cJSON *root) {
  static const char *const keys[] = {"enabled",    "window",     "threshold",      "patience",
                                     "margin_steps", "skip_steps", "lr_factor",    "cooldown_steps",
                                     "max_rollbacks", "per_steps"};
  const char *P = "rollback";
  const cJSON *o;
  zt_spec_rollback_t *r = &s->rollback;
  if (zt_json_object(root, "", "rollback", 0, &o)) return -1;
  if (!o) return 0;
  if (ZT_JSON_CHECK_KEYS(o, P, keys) || zt_json_bool(o, P, "enabled", &r->enabled) ||
      zt_json_int(o, P, "window", 0, 5, 100000, &r->window) ||
      zt_json_double(o, P, "threshold", 0.0, 1, 1e9, &r->threshold) ||
      zt_json_int(o, P, "patience", 0, 1, 1000, &r->patience) ||
      zt_json_long(o, P, "margin_steps", 0, 0, 1L << 40, &r->margin_steps) ||
      zt_json_long(o, P, "skip_steps", 0, 0, 1L << 40, &r->skip_steps) ||
      zt_json_double(o, P, "lr_factor", 0.0, 1, 1.0, &r->lr_factor) ||
      zt_json_long(o, P, "cooldown_steps", 0, 0, 1L << 40, &r->cooldown_steps) ||
      zt_json_int(o, P, "max_rollbacks", 0, 0, 1000, &r->max_rollbacks) ||
      zt_json_long(o, P, "per_steps", 0, 1, 1L << 40, &r->per_steps))
    return -1;
  return 0;
}

static int parse_init(zt_spec_t *s, const cJSON *root) {
  static const char *const keys[] = {"from_safetensors", "from_pretrained", "lora_from"};
  const cJSON *o;
  if (zt_json_object(root, "", "init", 0, &o) || (o && ZT_JSON_CHECK_KEYS(o, "init", keys)))
    return -1;
  if (!o) {
    if (s->model.lora_r)
      return zt_err("lora: needs the model it adapts: init.from_pretrained (a Hugging Face "
                    "model directory) or init.from_safetensors");
    return 0;
  }
  int file = cJSON_GetObjectItemCaseSensitive(o, "from_safetensors") != NULL;
  int dir = cJSON_GetObjectItemCaseSensitive(o, "from_pretrained") != NULL;
  if (file == dir)
    return zt_err("init: give one of from_safetensors (a file) and from_pretrained (a Hugging "
                  "Face model directory)");
  s->init_dir = dir;
  if (zt_json_string(o, "init", "lora_from", 0, s->lora_from, sizeof s->lora_from)) return -1;
  if (s->lora_from[0] && !s->model.lora_r)
    return zt_err("init.lora_from: adapters for a job without a lora section");
  return zt_json_string(o, "init", dir ? "from_pretrained" : "from_safetensors", 1, s->init_from,
                    sizeof s->init_from);
}

/* lora{r, alpha, dropout, target_modules}, PEFT's LoraConfig under
 * shorter names (lora_alpha, lora_dropout are taken too). */
static int parse_lora(zt_spec_t *s, const cJSON *root) {
  static const char *const keys[] = {"r", "alpha", "lora_alpha", "dropout", "lora_dropout",
                                     "target_modules"};
  const cJSON *o;
  if (zt_json_object(root, "", "lora", 0, &o) || (o && ZT_JSON_CHECK_KEYS(o, "lora", keys)))
    return -1;
  if (!o) return 0;
  zt_model_config_t *c = &s->model;
  if (c->arch != ZT_ARCH_LLAMA) return zt_err("lora: needs model.arch \"llama\"");
  int r = 8;
  float alpha = 8, drop = 0;
  if (zt_json_int(o, "lora", "r", 0, 1, 4096, &r) ||
      zt_json_float(o, "lora", "alpha", 0, 1, 1e6, &alpha) ||
      zt_json_float(o, "lora", "lora_alpha", 0, 1, 1e6, &alpha) ||
      zt_json_float(o, "lora", "dropout", 0, 0, 1, &drop) ||
      zt_json_float(o, "lora", "lora_dropout", 0, 0, 1, &drop))
    return -1;
  if (drop != 0)
    return zt_err("lora.dropout: only 0 is supported (the adapters are folded into the weights "
                  "they adapt, which needs the same input for both)");
  unsigned targets = ZT_LORA_DEFAULT_TARGETS;
  const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "target_modules");
  if (t) {
    if (!cJSON_IsArray(t) || !cJSON_GetArraySize(t))
      return zt_err("lora.target_modules: expected a non-empty list of names");
    targets = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, t) {
      int found = zt_lora_target_index(cJSON_IsString(it) ? it->valuestring : NULL);
      if (found < 0)
        return zt_err(
            "lora.target_modules: %s%s%s is not one of q_proj, k_proj, v_proj, "
            "o_proj, gate_proj, up_proj, down_proj",
            cJSON_IsString(it) ? "\"" : "", cJSON_IsString(it) ? it->valuestring : "an entry",
            cJSON_IsString(it) ? "\"" : "");
      targets |= 1u << found;
    }
  }
  c->lora_r = r, c->lora_alpha = alpha, c->lora_targets = targets;
  return 0;
}

static int parse_misc(zt_spec_t *s, const cJSON *root) {
  long seed = (long)s->seed;
  if (zt_json_string(root, "", "name", 0, s->name, sizeof s->name) ||
      zt_json_long(root, "", "seed", 0, 0, 1L << 53, &seed) ||
      zt_json_long(root, "", "steps", 1, 1, 1L << 40, &s->steps))
    return -1;
  s->seed = (uint64_t)seed;
  return 0;
}

/* fault_injection{...} (keys below, each documented in spec.h's
 * zt_spec_fault_t): tests only. */
static int parse_fault(zt_spec_t *s, const cJSON *root) {
  static const char *const keys[] = {"lr_scale", "from_step", "to_step", "repeat",
                                     "break_ring_at_step", "break_ring_before_update_at_step",
                                     "delay_checkpoint_report_ms", "slow_rank", "slow_micro_ms",
                                     "corrupt_compressed_at_step", "nan_pseudo_gradient_at_step"};
  const char *P = "fault_injection";
  const cJSON *o;
  zt_spec_fault_t *f = &s->fault;
  if (zt_json_object(root, "", P, 0, &o)) return -1;
  if (!o) return 0;
  f->present = 1;
  if (ZT_JSON_CHECK_KEYS(o, P, keys) ||
      zt_json_double(o, P, "lr_scale", 0.0, 0, 1e12, &f->lr_scale) ||
      zt_json_long(o, P, "from_step", 0, 0, 1L << 40, &f->from_step) ||
      zt_json_long(o, P, "to_step", 0, 0, 1L << 40, &f->to_step) ||
      zt_json_bool(o, P, "repeat", &f->repeat) ||
      zt_json_long(o, P, "break_ring_at_step", 0, 0, 1L << 40, &f->break_ring_at_step) ||
      zt_json_long(o, P, "break_ring_before_update_at_step", 0, 0, 1L << 40,
                   &f->break_ring_before_update_at_step) ||
      zt_json_long(o, P, "delay_checkpoint_report_ms", 0, 0, 60000,
                   &f->delay_checkpoint_report_ms) ||
      zt_json_int(o, P, "slow_rank", 0, 0, 255, &f->slow_rank) ||
      zt_json_long(o, P, "slow_micro_ms", 0, 0, 60000, &f->slow_micro_ms) ||
      zt_json_long(o, P, "corrupt_compressed_at_step", 0, 0, 1L << 40,
                   &f->corrupt_compressed_at_step) ||
      zt_json_long(o, P, "nan_pseudo_gradient_at_step", 0, 0, 1L << 40,
                   &f->nan_pseudo_gradient_at_step))
    return -1;
  if (f->to_step < f->from_step) f->to_step = f->from_step;
  return 0;
}

/* ---- entry points --------------------------------------------------------- */

static void set_defaults(zt_spec_t *s) {
  memset(s, 0, sizeof *s);
  snprintf(s->name, sizeof s->name, "job");
  s->overlap_comm = 1;
  s->seed = 1337;
  s->accum = 1;
  s->opt = (zt_opt_config_t){.lr = 3e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                             .weight_decay = 0.0f};
  s->eval_batches = 4;
  s->min_workers = s->max_workers = 1;
  s->restart = (zt_spec_restart_t){.max_failed_generations = 8, .backoff_ms = 1000,
                                   .max_backoff_ms = 60000, .max_restarts = 100,
                                   .restart_window_s = 3600};
  s->ckpt.keep_last = 2;
  s->ckpt.replicas = 2;
  s->rollback = (zt_spec_rollback_t){.enabled = 1, .window = 100, .threshold = 6.0,
                                     .patience = 3, .margin_steps = 0, .skip_steps = 10,
                                     .lr_factor = 0.5, .cooldown_steps = 50,
                                     .max_rollbacks = 3, .per_steps = 1000};
  s->comm_timeout_ms = ZT_COMM_TIMEOUT_MS_DEFAULT;
  s->lb_every = 20;
  s->inner_steps = 50;
  s->fragments = 1;
  s->group_size = 1;
  s->outer_lr = 0.7, s->outer_momentum = 0.9, s->outer_nesterov = 1;
}

int zt_spec_parse(zt_spec_t *s, const char *json, size_t len) {
  static const char *const top[] = {
      "name", "seed", "steps", "model", "data", "optimizer", "scheduler",
      "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
      "gradient_clipping", "eval", "zero_optimization", "elastic", "checkpoint", "rollback",
      "bf16", "comm", "fault_injection", "init", "activation_checkpointing",
      "wall_clock_breakdown", "lora", "load_balance", "sync"};
  set_defaults(s);
  cJSON *root = zt_json_parse(json, len, "the spec");
  if (!root) return -1;
  int rc = -1;
  if (!cJSON_IsObject(root)) {
    zt_err("the spec must be a JSON object");
    goto out;
  }
  /* misc first (steps is the scheduler's default), optimizer before the
   * scheduler (lr is warmup_max_lr's default). */
  if (ZT_JSON_CHECK_KEYS(root, "", top) || parse_misc(s, root) || parse_model(s, root) ||
      parse_batch(s, root) || parse_optimizer(s, root) || parse_scheduler(s, root) ||
      parse_data_eval(s, root) || parse_zero_elastic(s, root) || parse_balance(s, root) ||
      parse_checkpoint(s, root) || parse_rollback(s, root) || parse_fault(s, root) ||
      parse_lora(s, root) || parse_init(s, root) || parse_sync(s, root))
    goto out;
  rc = 0;
out:
  cJSON_Delete(root);
  return rc;
}

int zt_spec_load(zt_spec_t *s, const char *path) {
  char *buf;
  size_t len;
  memset(s, 0, sizeof *s);
  if (zt_read_file(path, &buf, &len, 16 << 20) != 0) return -1;
  int rc = zt_spec_parse(s, buf, len);
  free(buf);
  if (rc != 0) return zt_err_wrap("%s", path);
  return 0;
}

int zt_spec_accum_for_world(const zt_spec_t *s, int world, int *accum) {
  if (world < 1) return zt_err("world size must be >= 1 (got %d)", world);
  long K = s->global_batch / s->micro_batch;
  if (s->lb_speed && world <= K && K % world != 0) { /* uneven shares (load_balance) */
    if ((K + world - 1) / world > ZT_SPEC_MAX_ACCUM)
      return zt_err("global batch %ld needs up to %ld micro-batches per step on each of %d "
                    "workers (the limit is %d)", s->global_batch, (K + world - 1) / world, world,
                    ZT_SPEC_MAX_ACCUM);
    *accum = (int)((K + world - 1) / world);
    return 0;
  }
  if (s->lb_speed && world > K)
    return zt_err("global batch %ld is %ld micro-batches of %d: too few for %d workers",
                  s->global_batch, K, s->micro_batch, world);
  if (s->diloco && world % s->group_size != 0)
    return zt_err("world size %d is not a multiple of sync.group_size %ld", world, s->group_size);
  long per = (long)s->micro_batch * world;
  if (s->global_batch % per != 0)
    return zt_err("global batch %ld is not divisible by micro batch %d x %d workers",
                  s->global_batch, s->micro_batch, world);
  if (s->global_batch / per > ZT_SPEC_MAX_ACCUM)
    return zt_err("global batch %ld needs %ld micro-batches per step on each of %d workers "
                  "(the limit is %d)",
                  s->global_batch, s->global_batch / per, world, ZT_SPEC_MAX_ACCUM);
  *accum = (int)(s->global_batch / per);
  return 0;
}
