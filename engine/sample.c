/*
 * sample.c: autoregressive generation with a KV cache (see sample.h).
 *
 * The cache. For each layer l, the keys and values of every position fed so
 * far, as the c_attn matmul produced them:
 *
 *   k_cache [L, seq_len, C]   row t = the key of position t (head h is
 *   v_cache [L, seq_len, C]   columns h*hs .. h*hs+hs-1, as in qkv)
 *
 * Feeding n tokens at positions p..p+n-1 runs every layer on those n rows
 * only: LayerNorm, c_attn (the rows' q, k, v; k and v are appended to the
 * cache), attention of each row's query against cache rows 0..its own
 * position (causal), c_proj, residual, LayerNorm, MLP, residual. Only the
 * last row goes through ln_f and the LM head. A decode step (n = 1) reads
 * every weight once: it is memory-bound, so its matmuls are a
 * matrix-vector loop over the weight rows, split between OpenMP threads
 * with a static schedule; each output's dot product has a fixed order, so
 * a step's result does not depend on the thread count. The prefill (n > 1)
 * uses the kernel table's matmul (sgemm).
 *
 * Sampling. Greedy takes the first largest logit. Otherwise the candidates
 * are every id below the vocabulary limit (in id order) or, with top_k, the
 * k largest logits (ties to the lower id, in that order); p_i is
 * proportional to exp((l_i - max) / temperature) in double, and one uniform
 * draw u of xoshiro256** (engine/rng.h, seeded with (seed, "sample")) picks
 * the first candidate whose running sum exceeds u * sum. The same seed, model,
 * prompt and thread count give the same tokens.
 */
#include "sample.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_io.h"
#include "lora.h"
#include "model.h" /* zt_model_rope */
#include "rng.h"
#include "tokenizer.h"
#include "zt_kernels.h"

#define ZT_SAMPLE_STREAM 0x73616d706c65ull /* "sample" */

struct zt_sample {
  zt_model_config_t cfg;
  zt_layout_t lay;
  const zt_kernels_t *k;
  const float *params;
  int pos;
  float *kc, *vc; /* [L, seq_len, C] */
  /* activations of up to seq_len rows */
  float *x, *ln, *qkv, *atty, *proj, *fch, *fchg, *mean, *rstd, *logits;
  /* sampling scratch */
  struct cand { float l; int id; } *cand;
};

int zt_sample_pos(const zt_sample_t *s) { return s->pos; }
void zt_sample_reset(zt_sample_t *s) { s->pos = 0; }

void zt_sample_free(zt_sample_t *s) {
  if (!s) return;
  float *bufs[] = {s->kc,  s->vc,  s->x,    s->ln,   s->qkv,  s->atty,
                   s->proj, s->fch, s->fchg, s->mean, s->rstd, s->logits};
  for (size_t i = 0; i < ZT_ARRAY_LEN(bufs); i++) free(bufs[i]);
  free(s->cand);
  zt_layout_free(&s->lay);
  free(s);
}

/* A cache row: one position's keys (or values), every K/V head. */
static int kv_width(const zt_model_config_t *c) {
  return c->arch == ZT_ARCH_LLAMA ? c->n_kv_head * c->head_dim : c->n_embd;
}

int zt_sample_create(const zt_model_config_t *cfg, const float *params, zt_sample_t **out) {
  *out = NULL;
  if (zt_model_config_check(cfg) != 0) return zt_err_wrap("sampler");
  zt_sample_t *s = zt_xcalloc(1, sizeof *s);
  s->cfg = *cfg;
  if (zt_layout_build(&s->lay, cfg) != 0) {
    free(s);
    return -1;
  }
  s->k = zt_kernels_cpu();
  s->params = params;
  size_t T = (size_t)cfg->seq_len, C = (size_t)cfg->n_embd, L = (size_t)cfg->n_layer;
  int llama = cfg->arch == ZT_ARCH_LLAMA;
  size_t KW = (size_t)kv_width(cfg), QKV = (size_t)zt_model_qkv_width(cfg);
  size_t ATT = (size_t)zt_model_att_width(cfg), FF = llama ? 2 * (size_t)cfg->n_ff : 4 * C;
  size_t FFA = llama ? (size_t)cfg->n_ff : 4 * C;
  s->kc = zt_xcalloc(L * T * KW, sizeof(float));
  s->vc = zt_xcalloc(L * T * KW, sizeof(float));
  s->x = zt_xcalloc(T * C, sizeof(float));
  s->ln = zt_xcalloc(T * C, sizeof(float));
  s->qkv = zt_xcalloc(T * QKV, sizeof(float));
  s->atty = zt_xcalloc(T * ATT, sizeof(float));
  s->proj = zt_xcalloc(T * C, sizeof(float));
  s->fch = zt_xcalloc(T * FF, sizeof(float));
  s->fchg = zt_xcalloc(T * FFA, sizeof(float));
  s->mean = zt_xcalloc(T, sizeof(float));
  s->rstd = zt_xcalloc(T, sizeof(float));
  s->logits = zt_xcalloc((size_t)s->lay.Vp, sizeof(float));
  s->cand = zt_xcalloc((size_t)s->lay.Vp, sizeof *s->cand);
  *out = s;
  return 0;
}

/* ---- the forward of new positions ---------------------------------------------- */

/* out[o] = b[o] + w[o, :] . x for one row. */
static void matvec(float *out, const float *x, const float *w, const float *b, int IC, int OC) {
#pragma omp parallel for schedule(static)
  for (int o = 0; o < OC; o++) {
    const float *wr = w + (size_t)o * IC;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < IC; i++) acc += wr[i] * x[i];
    out[o] = (b ? b[o] : 0.0f) + acc;
  }
}

static void linear(const zt_sample_t *s, float *out, const float *in, const float *w,
                   const float *b, int n, int IC, int OC) {
  if (n == 1) matvec(out, in, w, b, IC, OC);
  else s->k->matmul_forward(out, in, w, b, n, IC, OC);
}

/* Causal attention of rows p0..p0+n-1 (their q in qkv) over cache rows
 * 0..own position of layer l; the same formula as the kernels' reference.
 * Query head h reads K/V head h / (NH / NKV) (one per head for GPT-2). */
static void attend(zt_sample_t *s, int l, int p0, int n) {
  const zt_model_config_t *c = &s->cfg;
  int NH = c->n_head, T = c->seq_len, KW = kv_width(c), QKV = zt_model_qkv_width(c);
  int ATT = zt_model_att_width(c), hs = ATT / NH, rep = NH / (KW / hs);
  const float *kc = s->kc + (size_t)l * T * KW, *vc = s->vc + (size_t)l * T * KW;
  float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel
  {
    float *a = zt_xmalloc(sizeof(float) * (size_t)T);
#pragma omp for schedule(static)
    for (int ih = 0; ih < n * NH; ih++) {
      int i = ih / NH, h = ih % NH, t = p0 + i, kh = h / rep;
      const float *q = s->qkv + (size_t)i * QKV + (size_t)h * hs;
      float maxv = -INFINITY;
      for (int t2 = 0; t2 <= t; t2++) {
        const float *kr = kc + (size_t)t2 * KW + (size_t)kh * hs;
        float dot = 0.0f;
        for (int d = 0; d < hs; d++) dot += q[d] * kr[d];
        a[t2] = dot * scale;
        if (a[t2] > maxv) maxv = a[t2];
      }
      float sum = 0.0f;
      for (int t2 = 0; t2 <= t; t2++) {
        a[t2] = expf(a[t2] - maxv);
        sum += a[t2];
      }
      float *o = s->atty + (size_t)i * ATT + (size_t)h * hs;
      for (int d = 0; d < hs; d++) o[d] = 0.0f;
      for (int t2 = 0; t2 <= t; t2++) {
        const float *vr = vc + (size_t)t2 * KW + (size_t)kh * hs;
        float p = a[t2] / sum;
        for (int d = 0; d < hs; d++) o[d] += p * vr[d];
      }
    }
    free(a);
  }
}

/* Appends rows p0.. of the new q/k/v's keys and values to layer l's cache. */
static void cache_kv(zt_sample_t *s, int l, int p0, int n) {
  const zt_model_config_t *c = &s->cfg;
  int T = c->seq_len, KW = kv_width(c), QKV = zt_model_qkv_width(c);
  int A = zt_model_att_width(c);
  for (int i = 0; i < n; i++) {
    size_t row = ((size_t)l * T + (size_t)(p0 + i)) * KW;
    memcpy(s->kc + row, s->qkv + (size_t)i * QKV + A, sizeof(float) * (size_t)KW);
    memcpy(s->vc + row, s->qkv + (size_t)i * QKV + A + KW, sizeof(float) * (size_t)KW);
  }
}

static void block(zt_sample_t *s, int l, int p0, int n) {
  const zt_kernels_t *k = s->k;
  int C = s->cfg.n_embd;
  zt_block_t b;
  zt_layout_block_views((float *)s->params + s->lay.unit_off[1 + l], C, sizeof(float), &b);
  k->layernorm_forward(s->ln, s->mean, s->rstd, s->x, b.ln1w, b.ln1b, n, C);
  linear(s, s->qkv, s->ln, b.qkvw, b.qkvb, n, C, 3 * C);
  cache_kv(s, l, p0, n);
  attend(s, l, p0, n);
  linear(s, s->proj, s->atty, b.attprojw, b.attprojb, n, C, C);
  k->residual_forward(s->x, s->x, s->proj, (size_t)n * C);
  k->layernorm_forward(s->ln, s->mean, s->rstd, s->x, b.ln2w, b.ln2b, n, C);
  linear(s, s->fch, s->ln, b.fcw, b.fcb, n, C, 4 * C);
  k->gelu_forward(s->fchg, s->fch, (size_t)n * 4 * C);
  linear(s, s->proj, s->fchg, b.fcprojw, b.fcprojb, n, 4 * C, C);
  k->residual_forward(s->x, s->x, s->proj, (size_t)n * C);
}

static void llama_block(zt_sample_t *s, int l, int p0, int n) {
  const zt_kernels_t *k = s->k;
  const zt_model_config_t *c = &s->cfg;
  int C = c->n_embd, F = c->n_ff, QKV = zt_model_qkv_width(c), A = zt_model_att_width(c);
  zt_lblock_t b;
  zt_layout_lblock_views((float *)s->params + s->lay.unit_off[1 + l], c, sizeof(float), &b);
  k->rmsnorm_forward(s->ln, s->rstd, s->x, b.rms1w, n, C, c->norm_eps);
  linear(s, s->qkv, s->ln, b.qkvw, b.qkvb, n, C, QKV);
  k->rope(s->qkv, 1, n, p0, c->n_head, c->n_kv_head, c->head_dim, zt_model_rope(c), 0);
  cache_kv(s, l, p0, n);
  attend(s, l, p0, n);
  linear(s, s->proj, s->atty, b.ow, NULL, n, A, C);
  k->residual_forward(s->x, s->x, s->proj, (size_t)n * C);
  k->rmsnorm_forward(s->ln, s->rstd, s->x, b.rms2w, n, C, c->norm_eps);
  linear(s, s->fch, s->ln, b.gateupw, NULL, n, C, 2 * F);
  k->swiglu_forward(s->fchg, s->fch, n, F);
  linear(s, s->proj, s->fchg, b.downw, NULL, n, F, C);
  k->residual_forward(s->x, s->x, s->proj, (size_t)n * C);
}

int zt_sample_feed(zt_sample_t *s, const int *ids, int n, const float **logits) {
  int C = s->cfg.n_embd, L = s->cfg.n_layer, V = s->cfg.vocab_size, p0 = s->pos;
  if (n < 1 || n > s->cfg.seq_len - p0)
    return zt_err("sampler: %d more tokens do not fit the context (%d of %d used)", n, p0,
                  s->cfg.seq_len);
  for (int i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= V)
      return zt_err("sampler: token %d is outside the model's vocabulary of %d", ids[i], V);
  int llama = s->cfg.arch == ZT_ARCH_LLAMA;
  const float *wte = s->params + s->lay.unit_off[0], *wpe = wte + (size_t)s->lay.Vp * C;
  for (int i = 0; i < n; i++) {
    const float *we = wte + (size_t)ids[i] * C, *pe = wpe + (size_t)(p0 + i) * C;
    float *o = s->x + (size_t)i * C;
    for (int c = 0; c < C; c++) o[c] = we[c] + (llama ? 0.0f : pe[c]);
  }
  for (int l = 0; l < L; l++) {
    if (llama) llama_block(s, l, p0, n);
    else block(s, l, p0, n);
  }
  const float *lnf = s->params + s->lay.unit_off[L + 1], *last = s->x + (size_t)(n - 1) * C;
  if (llama)
    s->k->rmsnorm_forward(s->ln, s->rstd, last, lnf, 1, C, s->cfg.norm_eps);
  else
    s->k->layernorm_forward(s->ln, s->mean, s->rstd, last, lnf, lnf + C, 1, C);
  const float *head = llama && !s->cfg.tie_embed ? lnf + C : wte;
  matvec(s->logits, s->ln, head, NULL, C, s->lay.Vp);
  s->pos = p0 + n;
  *logits = s->logits;
  return 0;
}

/* ---- choosing tokens ------------------------------------------------------------- */

static int by_logit(const void *a, const void *b) {
  const struct cand *x = a, *y = b;
  if (x->l != y->l) return x->l > y->l ? -1 : 1;
  return x->id - y->id;
}

/* The next token from logits[0, V). */
static int pick(zt_sample_t *s, const float *logits, int V, const zt_sample_opts_t *o,
                zt_rng_t *rng, int *id) {
  for (int i = 0; i < V; i++)
    if (!isfinite(logits[i]))
      return zt_err("the model's logits are not finite (a diverged checkpoint?)");
  int best = 0;
  for (int i = 1; i < V; i++)
    if (logits[i] > logits[best]) best = i;
  if (o->temperature == 0.0) {
    *id = best;
    return 0;
  }
  int n = V;
  for (int i = 0; i < V; i++) s->cand[i] = (struct cand){logits[i], i};
  if (o->top_k > 0 && o->top_k < V) {
    qsort(s->cand, (size_t)V, sizeof *s->cand, by_logit);
    n = o->top_k;
  }
  double max = logits[best], sum = 0.0;
  for (int i = 0; i < n; i++) sum += exp((s->cand[i].l - max) / o->temperature);
  double u = zt_rng_uniform(rng) * sum, run = 0.0;
  *id = s->cand[n - 1].id; /* rounding: u never reaches the last candidate's end */
  for (int i = 0; i < n; i++) {
    run += exp((s->cand[i].l - max) / o->temperature);
    if (u < run) {
      *id = s->cand[i].id;
      break;
    }
  }
  return 0;
}

int zt_sample_generate(zt_sample_t *s, const int *prompt, int n, const zt_sample_opts_t *o,
                       zt_sample_emit_fn emit, void *user, zt_sample_stats_t *st) {
  int T = s->cfg.seq_len, V = o->vocab > 0 && o->vocab < s->cfg.vocab_size ? o->vocab
                                                                            : s->cfg.vocab_size;
  memset(st, 0, sizeof *st);
  if (o->max_tokens < 1 || !(o->temperature >= 0.0) || !isfinite(o->temperature) || o->top_k < 0)
    return zt_err("sample: tokens must be >= 1, temperature >= 0 and top-k >= 0");
  if (n < 1 || n >= T)
    return zt_err("sample: the prompt is %d tokens, the model's context %d (at most %d)", n, T,
                  T - 1);
  zt_rng_t rng;
  zt_rng_seed(&rng, o->seed, ZT_SAMPLE_STREAM);
  zt_sample_reset(s);
  int64_t t0 = zt_now_us();
  const float *logits;
  if (zt_sample_feed(s, prompt, n, &logits) != 0) return -1;
  st->prompt_tokens = n;
  st->prefill_s = (double)(zt_now_us() - t0) / 1e6;
  int rc = 0;
  for (;;) {
    int id = 0;
    if ((rc = pick(s, logits, V, o, &rng, &id)) != 0) break;
    st->generated++;
    int e = emit(user, id);
    if (e < 0) rc = -1;
    if (e != 0 || st->generated == o->max_tokens) break;
    if (s->pos + 1 >= T) { /* the sequence is seq_len tokens */
      st->context_full = 1;
      break;
    }
    if ((rc = zt_sample_feed(s, &id, 1, &logits)) != 0) break;
  }
  st->total_s = (double)(zt_now_us() - t0) / 1e6;
  return rc;
}

/* ---- the command ------------------------------------------------------------------- */

typedef struct {
  const zt_sample_cmd_t *c;
  const zt_tok_t *tok;
} run_ctx;

static int write_token(void *user, int id) {
  run_ctx *r = user;
  const char *bytes;
  size_t len;
  if (zt_tok_decode(r->tok, id, &bytes, &len) != 0) return -1;
  if (fwrite(bytes, 1, len, r->c->out) != len || fflush(r->c->out) != 0)
    return zt_err_errno("writing the output");
  return 0;
}

/* The tokenizer: the caller's record, the manifest's, or the byte
 * tokenizer for a model of 257 tokens. */
static int open_tokenizer(const zt_sample_cmd_t *c, const char *manifest_tok,
                          const zt_model_config_t *cfg, zt_tok_t **tok) {
  if (c->tokenizer) return zt_tok_open(c->tokenizer, tok);
  if (manifest_tok[0]) {
    if (zt_tok_open(manifest_tok, tok) == 0) return 0;
    return zt_err_wrap("the checkpoint's tokenizer (pass --tokenizer RECORD.json to use another)");
  }
  if (cfg->vocab_size == 257) return zt_tok_open_byte(tok);
  return zt_err("the checkpoint names no tokenizer and its vocabulary is %d tokens, not the byte "
                "tokenizer's 257: pass --tokenizer RECORD.json (zprep writes "
                "PREFIX_tokenizer.json beside the shards)",
                cfg->vocab_size);
}

/* An error for the first prompt token the model does not have. */
static int check_prompt(const zt_tok_t *tok, const int *ids, size_t n, int V) {
  for (size_t i = 0; i < n; i++) {
    if (ids[i] < V) continue;
    if (zt_tok_type(tok) == ZT_TOK_BYTE)
      return zt_err("prompt byte 0x%02x is token %d, outside the model's vocabulary of %d",
                    ids[i], ids[i], V);
    const char *b;
    size_t len;
    char text[64] = "?", shown[256];
    if (zt_tok_decode(tok, ids[i], &b, &len) == 0)
      snprintf(text, sizeof text, "%.*s", (int)(len < 60 ? len : 60), b);
    return zt_err("prompt token %d (\"%s\") is outside the model's vocabulary of %d", ids[i],
                  zt_printable(text, shown, sizeof shown), V);
  }
  return 0;
}

/* The context to feed: end-of-text (when the model has it), then the
 * prompt's tokens. */
static int build_context(const zt_sample_cmd_t *c, zt_tok_t *tok, const zt_model_config_t *cfg,
                         int **ctx, int *n) {
  int *ids;
  size_t np;
  size_t plen = strlen(c->prompt);
  if (zt_tok_encode_ids(tok, c->prompt, plen, &ids, &np) != 0) return zt_err_wrap("prompt");
  int rc = check_prompt(tok, ids, np, cfg->vocab_size);
  int eot = zt_tok_eot(tok) < cfg->vocab_size, T = cfg->seq_len;
  if (rc == 0 && np + (size_t)eot == 0)
    rc = zt_err("the prompt is empty and the model has no end-of-text token to start from");
  if (rc == 0 && np + (size_t)eot >= (size_t)T)
    rc = zt_err("the prompt is %zu tokens%s, the model's context is %d: at most %d fit, with "
                "room for one new token",
                np + (size_t)eot, eot ? " with the leading end-of-text" : "", T, T - 1);
  if (rc != 0) {
    free(ids);
    return -1;
  }
  *ctx = zt_xmalloc(sizeof(int) * (np + 1));
  if (eot) (*ctx)[0] = zt_tok_eot(tok);
  memcpy(*ctx + eot, ids, sizeof(int) * np);
  *n = (int)np + eot;
  free(ids);
  return 0;
}

void zt_sample_cmd_init(zt_sample_cmd_t *c, const char *prog) {
  memset(c, 0, sizeof *c);
  c->prompt = "";
  c->tokens = 100;
  c->temperature = 1.0;
  c->seed = 1337;
  c->out = stdout;
  c->log = stderr;
  c->prog = prog;
}

int zt_sample_cmd_opt(zt_sample_cmd_t *c, const char *opt, const char *val) {
  static const char *const known[] = {"--prompt", "--tokens",    "--temperature", "--top-k",
                                      "--seed",   "--tokenizer", "--threads"};
  size_t i = 0;
  while (i < ZT_ARRAY_LEN(known) && strcmp(opt, known[i])) i++;
  if (i == ZT_ARRAY_LEN(known)) return 0;
  if (!val) return zt_err("%s needs a value", opt);
  int64_t v;
  switch (i) {
  case 0: c->prompt = val; return 1;
  case 1: return zt_parse_i64(opt, val, 1, 1 << 20, &v) ? -1 : (c->tokens = (int)v, 1);
  case 2: {
    char *end;
    double t = strtod(val, &end);
    if (!*val || *end || !(t >= 0.0) || !isfinite(t))
      return zt_err("--temperature must be a number >= 0 (0: greedy), not \"%s\"", val);
    c->temperature = t;
    return 1;
  }
  case 3: return zt_parse_i64(opt, val, 0, 65536, &v) ? -1 : (c->top_k = (int)v, 1);
  case 4: return zt_parse_i64(opt, val, 0, INT64_MAX, &v) ? -1 : (c->seed = (uint64_t)v, 1);
  case 5: c->tokenizer = val; return 1;
  default: return zt_parse_i64(opt, val, 1, 1024, &v) ? -1 : (c->threads = (int)v, 1);
  }
}

int zt_sample_run(const zt_sample_cmd_t *c, zt_sample_stats_t *st) {
  zt_model_config_t cfg;
  zt_layout_t lay = {0};
  zt_tok_t *tok = NULL;
  zt_sample_t *s = NULL;
  float *flat = NULL;
  int *ctx = NULL, n = 0, rc = -1;
  int64_t step;
  char man_tok[ZT_PATH_MAX];
  memset(st, 0, sizeof *st);
  if (c->tokens < 1) return zt_err("--tokens must be at least 1 (got %d)", c->tokens);
  if (!(c->temperature >= 0.0) || !isfinite(c->temperature))
    return zt_err("--temperature must be a number >= 0 (0: greedy)");
  if (c->top_k < 0) return zt_err("--top-k must be >= 0 (0: all tokens)");
  if (zt_ckpt_read_model(c->epoch_dir, &cfg, man_tok, sizeof man_tok) != 0) goto out;
  if (open_tokenizer(c, man_tok, &cfg, &tok) != 0) goto out;
  if (build_context(c, tok, &cfg, &ctx, &n) != 0) goto out;
  if (c->threads > 0) zt_kernels_cpu_set_threads(c->threads);
  if (zt_ckpt_load_flat(c->epoch_dir, &cfg, &lay, &flat, &step) != 0) goto out;
  /* A LoRA epoch samples from its base with the adapters merged in. */
  if (cfg.lora_r && zt_lora_merge_epoch(c->epoch_dir, NULL, &cfg, &lay, &flat) != 0) goto out;
  if (zt_sample_create(&cfg, flat, &s) != 0) goto out;
  zt_sample_opts_t o = {c->tokens, c->temperature, c->top_k, c->seed, zt_tok_vocab_size(tok)};
  run_ctx r = {c, tok};
  fputs(c->prompt, c->out);
  fflush(c->out);
  if (zt_sample_generate(s, ctx, n, &o, write_token, &r, st) != 0) goto out;
  fputc('\n', c->out);
  if (fflush(c->out) != 0) {
    zt_err_errno("writing the output");
    goto out;
  }
  if (st->context_full)
    fprintf(c->log, "%s: stopped after %d tokens: the context is full (seq_len %d)\n", c->prog,
            st->generated, cfg.seq_len);
  fprintf(c->log, "%s: %d tokens in %.3f s, %.1f tokens/s (step %lld, prompt %d tokens, "
          "prefill %.1f ms, %s tokenizer)\n", c->prog, st->generated, st->total_s,
          st->total_s > 0 ? st->generated / st->total_s : 0.0, (long long)step, n,
          st->prefill_s * 1e3, zt_tok_type_name(tok));
  rc = 0;
out:
  zt_sample_free(s);
  free(flat);
  free(ctx);
  zt_tok_free(tok);
  zt_layout_free(&lay);
  return rc;
}
