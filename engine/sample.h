/*
 * sample.h: text generation from a trained GPT-2 model on the CPU, with a
 * KV cache (zsolo sample, zctl sample).
 *
 * Three levels, each built on the one before:
 *
 *   zt_sample_t         the model over a flat fp32 parameter buffer (the
 *                       layout of layout.h) plus a KV cache, with
 *                       zt_sample_create/feed/pos/reset/free: feed tokens,
 *                       get the logits of the last one. The prompt is fed
 *                       once (prefill: every layer on all its rows at
 *                       once), then each new token costs one position.
 *   zt_sample_generate  the autoregressive loop: greedy or temperature /
 *                       top-k sampling, deterministic for a seed, each
 *                       token handed to a callback as soon as it is made.
 *   zt_sample_run       the command: a committed epoch directory and a
 *                       tokenizer (tokenizer.h) to streamed text on a FILE.
 *
 * The arithmetic is the model's (model.c): pre-LN blocks, LayerNorm and
 * GELU (tanh form) from the fast CPU kernel table, causal softmax attention
 * scaled by 1/sqrt(head size), the LM head tied to wte. Matmuls of several
 * rows (the prefill) go through the kernel table; one row (a decode step)
 * through a matrix-vector loop over the weight rows with OpenMP. So the
 * logits equal a full zt_model_forward of the same sequence up to
 * summation order (tests/unit/test_engine_sample.c checks 1e-4 relative).
 * docs/engine.md, "Sampling", has the cache layout and what stops a run.
 */
#ifndef ZT_SAMPLE_H
#define ZT_SAMPLE_H

#include <stdint.h>
#include <stdio.h>

#include "layout.h"
#include "zt_common.h"

typedef struct zt_sample zt_sample_t;

/* A sampler over params (a flat buffer of lay->num_params floats for cfg,
 * host memory; kept by pointer, not copied) with an empty cache. Uses the
 * fast CPU kernels (zt_kernels_cpu_set_threads sets their threads). */
ZT_MUST_CHECK int zt_sample_create(const zt_model_config_t *cfg, const float *params,
                                   zt_sample_t **out);
void zt_sample_free(zt_sample_t *s);

/* Runs n tokens at the next n positions, adding their keys and values to
 * the cache, and points *logits at the logits of the last of them (Vp
 * floats, the first vocab_size meaningful; valid until the next call).
 * -1 when an id is outside the vocabulary or the context would exceed
 * seq_len (nothing is changed then). */
ZT_MUST_CHECK int zt_sample_feed(zt_sample_t *s, const int *ids, int n, const float **logits);
/* Tokens in the cache. */
int zt_sample_pos(const zt_sample_t *s);
/* Empties the cache. */
void zt_sample_reset(zt_sample_t *s);

typedef struct {
  int max_tokens;     /* tokens to make, >= 1 */
  double temperature; /* >= 0; 0: greedy (the first largest logit) */
  int top_k;          /* >= 0; 0: every token is a candidate */
  uint64_t seed;      /* the draws: xoshiro256** of (seed, "sample") */
  int vocab;          /* candidates are the ids below this (0: the model's vocab_size) */
} zt_sample_opts_t;

/* Called with each token as it is made: 0 goes on, 1 stops the run (not
 * an error), -1 fails it (the callback sets the error). */
typedef int (*zt_sample_emit_fn)(void *user, int id);

typedef struct {
  int prompt_tokens;    /* fed before the first new token */
  int generated;        /* tokens handed to emit */
  int context_full;     /* stopped because the sequence reached seq_len */
  double prefill_s;     /* the prompt's forward */
  double total_s;       /* prefill and generation */
} zt_sample_stats_t;

/* Empties the cache, feeds prompt[0, n) (1 <= n < seq_len), then makes up
 * to o->max_tokens tokens, stopping early when the sequence (prompt and
 * generated tokens) reaches seq_len. */
ZT_MUST_CHECK int zt_sample_generate(zt_sample_t *s, const int *prompt, int n,
                                     const zt_sample_opts_t *o, zt_sample_emit_fn emit,
                                     void *user, zt_sample_stats_t *st);

/* zsolo sample / zctl sample. */
typedef struct {
  const char *epoch_dir;  /* a committed checkpoint epoch */
  const char *prompt;     /* text (may be empty) */
  const char *tokenizer;  /* a tokenizer record, or NULL: the manifest's, else byte for V 257 */
  int tokens;             /* >= 1 */
  double temperature;     /* >= 0 */
  int top_k;              /* >= 0 */
  uint64_t seed;
  int threads;            /* CPU threads, 0: the default */
  FILE *out;              /* the prompt, then each token's text, flushed per token */
  FILE *log;              /* notes and the summary line, prefixed with `prog: ` */
  const char *prog;
} zt_sample_cmd_t;

/* The defaults: 100 tokens, temperature 1, top-k 0 (all), seed 1337,
 * stdout and stderr. */
void zt_sample_cmd_init(zt_sample_cmd_t *c, const char *prog);
/* Applies one option of the sample commands to c: --prompt TEXT,
 * --tokens N (1..1048576), --temperature T (>= 0), --top-k K (0..65536),
 * --seed N, --tokenizer RECORD, --threads N. Returns 1 when opt is one of
 * them, 0 when it is not, -1 with an error naming the option when its value
 * is bad or missing (val NULL). */
int zt_sample_cmd_opt(zt_sample_cmd_t *c, const char *opt, const char *val);

/* Loads the epoch and the tokenizer, encodes the prompt (after the
 * end-of-text token when the model's vocabulary has it: documents start
 * with it in training), writes the prompt and the generated text to out and
 * a summary line to log. Every bad input is a one-line error. */
ZT_MUST_CHECK int zt_sample_run(const zt_sample_cmd_t *c, zt_sample_stats_t *st);

#endif
