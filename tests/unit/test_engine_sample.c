/*
 * test_engine_sample.c: engine/sample.c, the KV-cache sampler, against the
 * model's own full forward.
 *
 * A small model (L=2, NH=4, C=32, T=24, V=70 padded to 128) on the fast CPU
 * kernels, initialised and then perturbed so the logits are far from
 * uniform. For every position, the logits the sampler gives (prefill of a
 * prefix, prefill in two chunks, then one token at a time) must equal the
 * row of zt_model_forward over the whole sequence within 1e-4 relative to
 * the row's largest logit (the two differ only in summation order: sgemm
 * vs a dot product per output). Greedy generation with the cache must
 * produce exactly the tokens of greedy generation by full forwards of the
 * growing sequence; sampling is reproducible for a seed, top-k 1 is greedy,
 * the callback sees each token as it is made and can stop the run, and
 * the sequence never exceeds seq_len.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "sample.h"
#include "zt_common.h"
#include "zt_test.h"

static const zt_model_config_t cfg = {.n_layer = 2, .n_head = 4, .n_embd = 32, .seq_len = 24,
                                      .vocab_size = 70};
#define T 24
#define V 70
#define REL_TOL 1e-4

static uint64_t rs = 0x2545F4914F6CDD1Dull;
static uint32_t next_u32(void) {
  rs ^= rs << 13;
  rs ^= rs >> 7;
  rs ^= rs << 17;
  return (uint32_t)(rs >> 32);
}

/* Llama: grouped K/V heads, head_dim apart from n_embd / n_head, q/k/v
 * biases and its own LM head. */
static const zt_model_config_t llama_cfg = {
    .n_layer = 2, .n_head = 4, .n_embd = 32, .seq_len = 24, .vocab_size = 70,
    .arch = ZT_ARCH_LLAMA, .n_kv_head = 2, .head_dim = 10, .n_ff = 48, .rope_theta = 10000.0f,
    .norm_eps = 1e-5f, .tie_embed = 0, .qkv_bias = 1};

static zt_model_t *make_model_of(const zt_model_config_t *c) {
  zt_model_t *m;
  if (zt_model_create(&m, c, 1, T, zt_kernels_cpu(), ZT_MODEL_NO_GRADS) != 0) return NULL;
  zt_model_init(m, 42);
  for (int i = 0; i < m->lay.num_tensors; i++) {
    const zt_tensor_t *t = &m->lay.tensors[i];
    size_t n = t->kind == ZT_T_WTE || t->kind == ZT_T_HEADW ? (size_t)V * c->n_embd : t->n;
    for (size_t k = 0; k < n; k++)
      m->params[t->off + k] += 0.3f * ((float)(next_u32() >> 8) / 16777216.0f - 0.5f);
  }
  return m;
}

static zt_model_t *make_model(void) { return make_model_of(&cfg); }

/* The full forward's logits row `row` (of a sequence of len tokens). */
static const float *full_row(zt_model_t *m, const int *seq, int len, int row) {
  if (zt_model_forward(m, seq, NULL, 1, len, NULL) != 0) return NULL;
  return zt_model_logits(m) + (size_t)row * m->lay.Vp;
}

static double worst = 0.0; /* largest relative difference seen */

static void same_logits(const float *a, const float *b) {
  double scale = 1.0, diff = 0.0;
  for (int i = 0; i < V; i++) scale = fmax(scale, fabs(b[i]));
  for (int i = 0; i < V; i++) diff = fmax(diff, fabs((double)a[i] - b[i]));
  worst = fmax(worst, diff / scale);
  ZT_CHECK(diff <= REL_TOL * scale);
}

static void random_seq(int *seq, int n) {
  for (int i = 0; i < n; i++) seq[i] = (int)(next_u32() % V);
}

static void cache_matches(const zt_model_config_t *c) {
  zt_model_t *m = make_model_of(c);
  ZT_REQUIRE(m != NULL);
  zt_sample_t *s;
  ZT_REQUIRE(zt_sample_create(c, m->params, &s) == 0);
  int seq[T];
  random_seq(seq, T);
  const float *lg;
  /* prefill of 5, then one at a time to the end */
  ZT_REQUIRE(zt_sample_feed(s, seq, 5, &lg) == 0);
  same_logits(lg, full_row(m, seq, T, 4));
  for (int p = 5; p < T; p++) {
    ZT_REQUIRE(zt_sample_feed(s, seq + p, 1, &lg) == 0);
    ZT_CHECK(zt_sample_pos(s) == p + 1);
    same_logits(lg, full_row(m, seq, T, p));
  }
  /* the whole sequence at once; two prefills; a shorter full forward */
  zt_sample_reset(s);
  ZT_REQUIRE(zt_sample_feed(s, seq, T, &lg) == 0);
  same_logits(lg, full_row(m, seq, T, T - 1));
  zt_sample_reset(s);
  ZT_REQUIRE(zt_sample_feed(s, seq, 3, &lg) == 0);
  ZT_REQUIRE(zt_sample_feed(s, seq + 3, 7, &lg) == 0);
  same_logits(lg, full_row(m, seq, 10, 9));
  /* nothing fits past seq_len; ids outside the vocabulary; nothing changes */
  zt_sample_reset(s);
  ZT_REQUIRE(zt_sample_feed(s, seq, T - 1, &lg) == 0);
  ZT_CHECK(zt_sample_feed(s, seq, 2, &lg) == -1);
  int bad = V;
  ZT_CHECK(zt_sample_feed(s, &bad, 1, &lg) == -1);
  ZT_CHECK(zt_sample_pos(s) == T - 1);
  ZT_CHECK(zt_sample_feed(s, seq, 1, &lg) == 0);
  fprintf(stderr, "  largest relative difference, cache vs full forward: %.3g\n", worst);
  zt_sample_free(s);
  zt_model_free(m);
}

ZT_TEST(cache_matches_full_forward) { cache_matches(&cfg); }

/* The same for llama: rotary positions continued across feeds, grouped K/V
 * heads in the cache. */
ZT_TEST(llama_cache_matches_full_forward) { cache_matches(&llama_cfg); }

typedef struct {
  int ids[2 * T], n, stop_after;
} collected;

static int collect(void *user, int id) {
  collected *c = user;
  c->ids[c->n++] = id;
  return c->stop_after && c->n >= c->stop_after ? 1 : 0;
}

static int argmax(const float *l) {
  int b = 0;
  for (int i = 1; i < V; i++)
    if (l[i] > l[b]) b = i;
  return b;
}

static void generate(zt_sample_t *s, const int *prompt, int n, zt_sample_opts_t o,
                     collected *out, zt_sample_stats_t *st) {
  memset(out, 0, sizeof *out);
  ZT_CHECK(zt_sample_generate(s, prompt, n, &o, collect, out, st) == 0);
}

ZT_TEST(greedy_equals_recompute) {
  zt_model_t *m = make_model();
  ZT_REQUIRE(m != NULL);
  zt_sample_t *s;
  ZT_REQUIRE(zt_sample_create(&cfg, m->params, &s) == 0);
  int prompt[3] = {5, 17, 60};
  zt_sample_opts_t o = {.max_tokens = 100, .temperature = 0.0};
  collected got;
  zt_sample_stats_t st;
  generate(s, prompt, 3, o, &got, &st);
  /* the sequence is full at seq_len: 3 + 21 tokens */
  ZT_CHECK(got.n == T - 3 && st.generated == T - 3 && st.context_full == 1);
  ZT_CHECK(st.prompt_tokens == 3);
  int seq[T + 1] = {5, 17, 60}, len = 3;
  while (len < T) {
    const float *row = full_row(m, seq, len, len - 1);
    ZT_REQUIRE(row != NULL);
    seq[len] = argmax(row);
    len++;
  }
  int distinct = 0;
  for (int i = 0; i < got.n; i++) {
    ZT_CHECK(got.ids[i] == seq[3 + i]);
    distinct += i > 0 && got.ids[i] != got.ids[i - 1];
  }
  ZT_CHECK(distinct > 0); /* not a degenerate model */
  /* top-k 1 at any temperature is greedy */
  zt_sample_opts_t k1 = {.max_tokens = 10, .temperature = 1.5, .top_k = 1, .seed = 9};
  collected g1;
  generate(s, prompt, 3, k1, &g1, &st);
  ZT_CHECK(g1.n == 10 && st.context_full == 0);
  for (int i = 0; i < g1.n; i++) ZT_CHECK(g1.ids[i] == got.ids[i]);
  zt_sample_free(s);
  zt_model_free(m);
}

ZT_TEST(seeded_sampling) {
  zt_model_t *m = make_model();
  ZT_REQUIRE(m != NULL);
  zt_sample_t *s;
  ZT_REQUIRE(zt_sample_create(&cfg, m->params, &s) == 0);
  int prompt[2] = {1, 2};
  zt_sample_stats_t st;
  collected a, b, c, d;
  zt_sample_opts_t o = {.max_tokens = 20, .temperature = 1.0, .seed = 7};
  generate(s, prompt, 2, o, &a, &st);
  generate(s, prompt, 2, o, &b, &st);
  o.seed = 8;
  generate(s, prompt, 2, o, &c, &st);
  ZT_CHECK(a.n == 20 && b.n == 20 && c.n == 20);
  ZT_CHECK(memcmp(a.ids, b.ids, sizeof a.ids) == 0);
  ZT_CHECK(memcmp(a.ids, c.ids, sizeof a.ids) != 0);
  /* top-k 3: every token is among the 3 largest logits of its position */
  o.top_k = 3;
  generate(s, prompt, 2, o, &d, &st);
  int seq[T] = {1, 2};
  for (int i = 0; i < d.n; i++) {
    const float *row = full_row(m, seq, 2 + i, 1 + i);
    ZT_REQUIRE(row != NULL);
    int above = 0;
    for (int j = 0; j < V; j++) above += row[j] > row[d.ids[i]];
    ZT_CHECK(above < 3);
    seq[2 + i] = d.ids[i];
  }
  /* a vocabulary limit: only ids below it */
  o.top_k = 0, o.vocab = 4;
  generate(s, prompt, 2, o, &d, &st);
  for (int i = 0; i < d.n; i++) ZT_CHECK(d.ids[i] >= 0 && d.ids[i] < 4);
  zt_sample_free(s);
  zt_model_free(m);
}

ZT_TEST(streaming_and_errors) {
  zt_model_t *m = make_model();
  ZT_REQUIRE(m != NULL);
  zt_sample_t *s;
  ZT_REQUIRE(zt_sample_create(&cfg, m->params, &s) == 0);
  int prompt[T] = {3};
  zt_sample_stats_t st;
  /* the callback stops the run after 3 tokens: each is seen as it is made */
  collected c = {.stop_after = 3};
  zt_sample_opts_t o = {.max_tokens = 10, .temperature = 0.7, .seed = 1};
  ZT_CHECK(zt_sample_generate(s, prompt, 1, &o, collect, &c, &st) == 0);
  ZT_CHECK(c.n == 3 && st.generated == 3 && zt_sample_pos(s) == 3);
  /* a prompt that fills the context leaves no room */
  collected d = {0};
  ZT_CHECK(zt_sample_generate(s, prompt, T, &o, collect, &d, &st) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "the prompt is 24 tokens") != NULL);
  /* T - 1 tokens of prompt: exactly one new token */
  ZT_CHECK(zt_sample_generate(s, prompt, T - 1, &o, collect, &d, &st) == 0);
  ZT_CHECK(d.n == 1 && st.context_full == 1);
  o.temperature = -1;
  ZT_CHECK(zt_sample_generate(s, prompt, 1, &o, collect, &d, &st) == -1);
  o.temperature = 1, o.max_tokens = 0;
  ZT_CHECK(zt_sample_generate(s, prompt, 1, &o, collect, &d, &st) == -1);
  /* non-finite logits are an error, not a token (a NaN in ln_f's weight:
   * it reaches only LayerNorm and the LM head, no exp kernel) */
  m->params[m->lay.unit_off[cfg.n_layer + 1]] = NAN;
  int id0 = 0;
  o.max_tokens = 2;
  ZT_CHECK(zt_sample_generate(s, &id0, 1, &o, collect, &d, &st) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "not finite") != NULL);
  zt_sample_free(s);
  zt_model_free(m);
}

ZT_TEST_MAIN(cache_matches_full_forward, llama_cache_matches_full_forward,
             greedy_equals_recompute, seeded_sampling,
             streaming_and_errors)
