/*
 * jspec.c: job spec parsing and validation (see jspec.h).
 *
 * Each JSON object is read through a small cursor that remembers its key
 * path and which keys were consumed; after reading an object, any key left
 * over is reported as unknown. Getters check type and range and name the
 * full path in their errors.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jspec.h"
#include "zt_common.h"

typedef struct {
  cJSON *obj;
  char path[128];
  const char *used[32];
  int nused;
} cur;

static void cur_init(cur *c, cJSON *obj, const char *parent, const char *key) {
  c->obj = obj;
  c->nused = 0;
  if (parent && parent[0]) snprintf(c->path, sizeof c->path, "%.60s.%.60s", parent, key);
  else snprintf(c->path, sizeof c->path, "%.100s", key ? key : "");
}

static cJSON *take(cur *c, const char *key) {
  if (c->nused < 32) c->used[c->nused++] = key;
  return c->obj ? cJSON_GetObjectItemCaseSensitive(c->obj, key) : NULL;
}

static int key_err(cur *c, const char *key, const char *what) {
  return zt_err("%s%s%s: %s", c->path, c->path[0] ? "." : "", key, what);
}

static int done(cur *c) {
  if (!c->obj) return 0;
  for (cJSON *it = c->obj->child; it; it = it->next) {
    int ok = 0;
    for (int i = 0; i < c->nused; i++) ok |= !strcmp(c->used[i], it->string);
    if (!ok) return key_err(c, it->string, "unknown key");
  }
  return 0;
}

static int get_obj(cur *c, const char *key, int required, cur *sub) {
  cJSON *v = take(c, key);
  if (!v) {
    cur_init(sub, NULL, c->path, key);
    return required ? key_err(c, key, "required") : 0;
  }
  if (!cJSON_IsObject(v)) return key_err(c, key, "expected an object");
  cur_init(sub, v, c->path, key);
  return 0;
}

static int get_num(cur *c, const char *key, double def, double lo, double hi, double *out) {
  cJSON *v = take(c, key);
  if (!v) {
    if (isnan(def)) return key_err(c, key, "required");
    *out = def;
    return 0;
  }
  if (!cJSON_IsNumber(v)) return key_err(c, key, "expected a number");
  if (!(v->valuedouble >= lo && v->valuedouble <= hi)) {
    char msg[96];
    snprintf(msg, sizeof msg, "%g is out of range [%g, %g]", v->valuedouble, lo, hi);
    return key_err(c, key, msg);
  }
  *out = v->valuedouble;
  return 0;
}

static int get_int(cur *c, const char *key, double def, double lo, double hi, int64_t *out) {
  double d = 0;
  if (get_num(c, key, def, lo, hi, &d) != 0) return -1;
  if (d != floor(d)) return key_err(c, key, "expected an integer");
  *out = (int64_t)d;
  return 0;
}

static int get_i(cur *c, const char *key, double def, double lo, double hi, int *out) {
  int64_t v;
  if (get_int(c, key, def, lo, hi, &v) != 0) return -1;
  *out = (int)v;
  return 0;
}

static int get_str(cur *c, const char *key, const char *def, char *out, size_t n) {
  cJSON *v = take(c, key);
  if (!v) {
    if (!def) return key_err(c, key, "required");
    snprintf(out, n, "%s", def);
    return 0;
  }
  if (!cJSON_IsString(v)) return key_err(c, key, "expected a string");
  if (strlen(v->valuestring) >= n) return key_err(c, key, "too long");
  snprintf(out, n, "%s", v->valuestring);
  return 0;
}

static int get_bool(cur *c, const char *key, int def, int *out) {
  cJSON *v = take(c, key);
  if (!v) {
    *out = def;
    return 0;
  }
  if (!cJSON_IsBool(v)) return key_err(c, key, "expected true or false");
  *out = cJSON_IsTrue(v);
  return 0;
}

#define NONE NAN
#define BIG 1e15

static int parse_model(cur *root, zt_jspec *s) {
  cur m;
  if (get_obj(root, "model", 1, &m) || get_i(&m, "n_layer", NONE, 1, 1024, &s->model.n_layer) ||
      get_i(&m, "n_head", NONE, 1, 1024, &s->model.n_head) ||
      get_i(&m, "n_embd", NONE, 1, 65536, &s->model.n_embd) ||
      get_i(&m, "seq_len", NONE, 1, 65536, &s->model.seq_len) ||
      get_i(&m, "vocab_size", NONE, 2, 1 << 24, &s->model.vocab_size) || done(&m))
    return -1;
  if (s->model.n_embd % s->model.n_head)
    return zt_err("model.n_head: %d does not divide model.n_embd %d", s->model.n_head,
                  s->model.n_embd);
  return 0;
}

static int parse_optimizer(cur *root, zt_jspec *s) {
  cur o, p;
  char type[32];
  if (get_obj(root, "optimizer", 0, &o) || get_str(&o, "type", "AdamW", type, sizeof type))
    return -1;
  if (strcmp(type, "AdamW") && strcmp(type, "Adam"))
    return zt_err("optimizer.type: \"%s\" is not supported (AdamW)", type);
  if (get_obj(&o, "params", 0, &p) || get_num(&p, "lr", 1e-3, 0, 10, &s->lr) ||
      get_num(&p, "eps", 1e-8, 0, 1, &s->eps) ||
      get_num(&p, "weight_decay", 0.0, 0, 10, &s->weight_decay))
    return -1;
  s->beta1 = 0.9, s->beta2 = 0.999;
  cJSON *b = take(&p, "betas");
  if (b) {
    if (!cJSON_IsArray(b) || cJSON_GetArraySize(b) != 2 ||
        !cJSON_IsNumber(cJSON_GetArrayItem(b, 0)) || !cJSON_IsNumber(cJSON_GetArrayItem(b, 1)))
      return zt_err("optimizer.params.betas: expected [beta1, beta2]");
    s->beta1 = cJSON_GetArrayItem(b, 0)->valuedouble;
    s->beta2 = cJSON_GetArrayItem(b, 1)->valuedouble;
    if (!(s->beta1 >= 0 && s->beta1 < 1 && s->beta2 >= 0 && s->beta2 < 1))
      return zt_err("optimizer.params.betas: each must be in [0, 1)");
  }
  return done(&p) || done(&o) ? -1 : 0;
}

static int parse_scheduler(cur *root, zt_jspec *s) {
  cur o, p;
  char type[32];
  if (get_obj(root, "scheduler", 0, &o) || get_str(&o, "type", "WarmupDecayLR", type, sizeof type))
    return -1;
  if (strcmp(type, "WarmupDecayLR") && strcmp(type, "WarmupLR"))
    return zt_err("scheduler.type: \"%s\" is not supported (WarmupDecayLR, WarmupLR)", type);
  char wt[16];
  if (get_obj(&o, "params", 0, &p) || get_num(&p, "warmup_min_lr", 0, 0, 10, &s->warmup_min_lr) ||
      get_num(&p, "warmup_max_lr", s->lr, 0, 10, &s->warmup_max_lr) ||
      get_int(&p, "warmup_num_steps", 0, 0, BIG, &s->warmup_steps) ||
      get_int(&p, "total_num_steps", (double)s->steps, 1, BIG, &s->decay_steps) ||
      get_str(&p, "warmup_type", "linear", wt, sizeof wt))
    return -1;
  if (strcmp(wt, "linear")) return zt_err("scheduler.params.warmup_type: only \"linear\"");
  if (!strcmp(type, "WarmupLR")) s->decay_steps = 0; /* constant after warmup */
  return done(&p) || done(&o) ? -1 : 0;
}

int zt_jspec_parse(const char *json, zt_jspec *s) {
  memset(s, 0, sizeof *s);
  cJSON *doc = cJSON_Parse(json);
  if (!doc || !cJSON_IsObject(doc)) {
    const char *at = cJSON_GetErrorPtr();
    cJSON_Delete(doc);
    return zt_err("job spec is not a JSON object%s%.24s", at ? "; error near: " : "", at ? at : "");
  }
  cur r, d, ev, z, el, ck, rb, bf, cm, fi;
  cur_init(&r, doc, NULL, NULL);
  int64_t seed, accum = 0, gbs;
  double tmp;
  int rb_en;
  int ret = -1;
  if (get_str(&r, "name", "job", s->name, sizeof s->name) ||
      get_int(&r, "seed", 1, 0, 9007199254740991.0, &seed) ||
      get_int(&r, "steps", NONE, 1, BIG, &s->steps) || parse_model(&r, s) ||
      get_obj(&r, "data", 1, &d) || get_str(&d, "train", NULL, s->train, sizeof s->train) ||
      get_str(&d, "val", "", s->val, sizeof s->val) || done(&d) ||
      get_i(&r, "train_micro_batch_size_per_gpu", NONE, 1, 1 << 20, &s->micro) ||
      get_int(&r, "gradient_accumulation_steps", 0, 0, 1 << 20, &accum) ||
      get_num(&r, "gradient_clipping", 0, 0, 1e9, &s->clip) || parse_optimizer(&r, s) ||
      parse_scheduler(&r, s) || get_obj(&r, "eval", 0, &ev) ||
      get_int(&ev, "every_steps", 0, 0, BIG, &s->eval_every) ||
      get_i(&ev, "batches", 4, 1, 1 << 20, &s->eval_batches) || done(&ev) ||
      get_obj(&r, "zero_optimization", 0, &z) || get_i(&z, "stage", 0, 0, 3, &s->zero_stage) ||
      done(&z) || get_obj(&r, "elastic", 0, &el) ||
      get_i(&el, "min_workers", 1, 1, 256, &s->min_workers) ||
      get_i(&el, "max_workers", s->min_workers, s->min_workers, 256, &s->max_workers) ||
      done(&el) || get_obj(&r, "checkpoint", 0, &ck) ||
      get_str(&ck, "dir", "", s->ckpt_dir, sizeof s->ckpt_dir) ||
      get_int(&ck, "every_steps", 0, 0, BIG, &s->ckpt_every) ||
      get_int(&ck, "keep_last", 2, 1, 1 << 20, &s->keep_last) ||
      get_int(&ck, "keep_every", 0, 0, BIG, &s->keep_every) ||
      get_str(&ck, "load", "", s->ckpt_load, sizeof s->ckpt_load) || done(&ck) ||
      get_obj(&r, "rollback", 0, &rb) || get_bool(&rb, "enabled", 1, &rb_en) ||
      get_num(&rb, "window", 100, 5, 1024, &tmp) || get_num(&rb, "threshold", 6, 0.1, 1e6, &tmp) ||
      get_num(&rb, "patience", 3, 1, 1000, &tmp) || get_num(&rb, "margin_steps", 0, 0, BIG, &tmp) ||
      get_num(&rb, "skip_steps", 10, 0, BIG, &tmp) || get_num(&rb, "lr_factor", 0.5, 1e-6, 1, &tmp) ||
      get_num(&rb, "cooldown_steps", 50, 0, BIG, &tmp) ||
      get_num(&rb, "max_rollbacks", 3, 0, 1000, &tmp) || get_num(&rb, "per_steps", 1000, 1, BIG, &tmp) ||
      done(&rb) || get_obj(&r, "bf16", 0, &bf) || get_bool(&bf, "enabled", 0, &s->bf16) ||
      done(&bf) || get_obj(&r, "comm", 0, &cm) ||
      get_int(&cm, "timeout_ms", 30000, 100, 3600000, &s->comm_timeout_ms) || done(&cm) ||
      get_obj(&r, "fault_injection", 0, &fi) || get_num(&fi, "lr_scale", 0, 0, 1e9, &s->fi_lr_scale) ||
      get_int(&fi, "from_step", 0, 0, BIG, &s->fi_from) ||
      get_int(&fi, "to_step", (double)s->fi_from, 0, BIG, &s->fi_to) || done(&fi))
    goto out;
  s->seed = (uint64_t)seed;
  gbs = (int64_t)s->micro * (accum ? accum : 1) * s->min_workers;
  if (get_int(&r, "train_batch_size", (double)gbs, 1, BIG, &s->global_batch) || done(&r)) goto out;
  if (accum && s->global_batch != (int64_t)s->micro * accum * s->min_workers) {
    zt_err("train_batch_size %lld != micro %d x gradient_accumulation_steps %lld x "
           "min_workers %d",
           (long long)s->global_batch, s->micro, (long long)accum, s->min_workers);
    goto out;
  }
  if (s->global_batch % s->micro) {
    zt_err("train_batch_size %lld is not a multiple of train_micro_batch_size_per_gpu %d",
           (long long)s->global_batch, s->micro);
    goto out;
  }
  if (s->ckpt_every && !s->ckpt_dir[0]) {
    zt_err("checkpoint.every_steps needs checkpoint.dir");
    goto out;
  }
  ret = 0;
out:
  cJSON_Delete(doc);
  return ret;
}

int zt_jspec_accum(const zt_jspec *s, int world) {
  int64_t per = (int64_t)s->micro * world;
  if (world < 1 || s->global_batch % per)
    return zt_err("train_batch_size %lld cannot be split over %d workers with micro batch %d",
                  (long long)s->global_batch, world, s->micro);
  return (int)(s->global_batch / per);
}

double zt_jspec_lr(const zt_jspec *s, int64_t step) {
  double lo = s->warmup_min_lr, hi = s->warmup_max_lr;
  if (s->warmup_steps > 0 && step <= s->warmup_steps)
    return lo + (hi - lo) * (double)step / (double)s->warmup_steps;
  if (s->decay_steps <= s->warmup_steps) return hi;
  double t = (double)(step - s->warmup_steps) / (double)(s->decay_steps - s->warmup_steps);
  if (t > 1) t = 1;
  return lo + 0.5 * (hi - lo) * (1 + cos(3.141592653589793 * t));
}
