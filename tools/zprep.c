/*
 * zprep.c: text -> token shards for training (llm.c's shard format), and the
 * tokenizer record that says how they were made.
 *
 *   zprep INPUT... -o DIR [--tokenizer byte|gpt2|hf] [--encoder encoder.json]
 *         [--bpe vocab.bpe] [--tokenizer-json tokenizer.json] [--eot TEXT]
 *         [--doc-sep LINE] [--shard-tokens N]
 *         [--val-fraction F] [--prefix NAME] [--token-bytes 2|4]
 *
 * Documents. Each input file is one document, unless --doc-sep LINE is
 * given: then every line equal to LINE (e.g. "%" for fortune files) ends a
 * document and is dropped. Every document is preceded by the end-of-text
 * token (GPT-2 and llm.c's convention), so the model always sees where a
 * document starts.
 *
 * Split. With --val-fraction F (default 0.1), document i (counting from 0
 * over all inputs) goes to the validation set when floor((i+1)F) >
 * floor(iF): every (1/F)-th document, spread evenly through the corpus.
 *
 * Output: DIR/PREFIX_train_000000.bin, ..., DIR/PREFIX_val_000000.bin, each
 * at most --shard-tokens tokens (default 100M), header of 256 int32
 * (magic 20240520, version, token count), tokens as little-endian uint16
 * (version 1, llm.c's) or, with --token-bytes 4, uint32 (version 2: the
 * default when the vocabulary has more than 65,536 tokens; engine/data.h).
 * Files are written to a temporary name, fsync'ed and renamed when complete
 * (then the directory is fsync'ed); a file that cannot be written leaves no
 * temporary behind. The summary line on stdout gives the vocab_size to put
 * in the job spec.
 *
 * One data set per DIR and PREFIX. Numbering starts at 0 on every run, so
 * a second run into the same place would leave the first run's higher
 * shards beside its own (and a failed run would already have replaced the
 * first shards): zprep refuses to start when DIR holds a PREFIX_train_N.bin,
 * PREFIX_val_N.bin or PREFIX_tokenizer.json. PREFIX is a file name prefix,
 * so it may not contain '/'.
 *
 * Exit status: 0 on success, 1 when the inputs cannot be read or the output
 * cannot be written, 2 on a usage error (a bad option or value, or a data
 * set already in DIR under PREFIX).
 *
 * Tokenizer record. Last, zprep writes DIR/PREFIX_tokenizer.json (through
 * a temporary file and a rename), one JSON object:
 *
 *   {"type":"byte","vocab_size":257,"eot":256}
 *   {"type":"gpt2","vocab_size":V,"eot":E,"encoder":"PREFIX_encoder.json",
 *    "bpe":"PREFIX_vocab.bpe"}
 *   {"type":"hf","vocab_size":V,"eot":E,"file":"PREFIX_hf_tokenizer.json"}
 *
 * and for gpt2 copies the encoder.json and vocab.bpe it was given into DIR
 * under those names, for hf the tokenizer.json (before the record, so a
 * record never names a missing file). File names in a record are relative to the record's directory.
 * This is a contract: the trainer names the record in every checkpoint
 * manifest, and `zctl export`, `zctl sample` and `zsolo sample` read it
 * (engine/tokenizer.h; docs/engine.md, "Tokenizer record").
 *
 * Tokenizers (engine/tokenizer.c has the details):
 *
 *   byte  Each byte is its own token (0..255) and 256 is end-of-text:
 *         vocab_size 257. Needs no files and works on any input.
 *   gpt2  GPT-2's byte-level BPE, from OpenAI's encoder.json and vocab.bpe:
 *         GPT-2's pre-tokenization pattern (implemented by hand), each
 *         piece's bytes mapped to printable characters (bytes_to_unicode)
 *         and merged by rank; the end-of-text token is
 *         encoder["<|endoftext|>"] (50256 for GPT-2).
 *   hf    A Hugging Face tokenizer.json of byte-level BPE (Llama 3, Qwen2/3,
 *         SmolLM, GPT-2's): --tokenizer-json FILE. Its added tokens, NFC
 *         normalizer, Split pattern (through PCRE2), ByteLevel, merges,
 *         ignore_merges and byte_fallback as Hugging Face's tokenizers
 *         apply them; no special tokens are added but the end-of-text that
 *         starts each document: --eot TEXT, by default the first of
 *         <|endoftext|>, <|end_of_text|>, </s>, <|im_end|>, <eos> it has.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "ckpt_io.h" /* zt_ckpt_fsync_dir */
#include "tokenizer.h"
#include "zt_common.h"

#define ZT_MAGIC 20240520
#define ZT_VERSION 1     /* uint16 tokens */
#define ZT_VERSION_U32 2 /* uint32 tokens */

/* ---- token output ----------------------------------------------------------- */

typedef struct {
  const char *dir, *prefix, *split;
  uint8_t *buf; /* ZT header bytes + width bytes per token */
  size_t n, cap; /* tokens */
  int width;     /* bytes per token: 2 or 4 */
  int index;     /* next shard number */
  uint64_t total;
} zt_writer_t;

static void put_le32(uint8_t *p, int32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)((uint32_t)v >> (8 * i));
}

/* Writes len bytes to dir/name durably: name.tmp, fsync, rename, fsync of
 * the directory. On failure the temporary file is removed. */
static int write_atomic(const char *dir, const char *name, const void *buf, size_t len) {
  char path[ZT_PATH_MAX], tmp[ZT_PATH_MAX];
  if (zt_path_join(path, sizeof path, dir, name) != 0 ||
      zt_path_fmt(tmp, sizeof tmp, "%s.tmp", path) != 0)
    return -1;
  FILE *f = fopen(tmp, "wb");
  if (!f) return zt_err_errno("%s", tmp);
  if (fwrite(buf, 1, len, f) != len || fflush(f) != 0) {
    zt_err_errno("%s: write", tmp);
    fclose(f);
    goto err;
  }
  if (fsync(fileno(f)) != 0) {
    zt_err_errno("%s: fsync", tmp);
    fclose(f);
    goto err;
  }
  if (fclose(f) != 0) {
    zt_err_errno("%s: close", tmp);
    goto err;
  }
  if (rename(tmp, path) != 0) {
    zt_err_errno("rename %s", tmp);
    goto err;
  }
  return zt_ckpt_fsync_dir(dir); /* the rename is durable */
err:
  unlink(tmp);
  return -1;
}

static int writer_flush(zt_writer_t *w) {
  char name[1100];
  if (w->n == 0) return 0;
  snprintf(name, sizeof name, "%s_%s_%06d.bin", w->prefix, w->split, w->index);
  memset(w->buf, 0, 1024);
  put_le32(w->buf, ZT_MAGIC);
  put_le32(w->buf + 4, w->width == 4 ? ZT_VERSION_U32 : ZT_VERSION);
  put_le32(w->buf + 8, (int32_t)w->n);
  if (write_atomic(w->dir, name, w->buf, 1024 + (size_t)w->width * w->n) != 0) return -1;
  w->index++;
  w->total += w->n;
  w->n = 0;
  return 0;
}

static int writer_put(zt_writer_t *w, int tok) {
  if (tok < 0 || (w->width == 2 && tok > 0xffff))
    return zt_err("token id %d does not fit in %d bytes (--token-bytes 4)", tok, w->width);
  if (w->n == w->cap && writer_flush(w) != 0) return -1;
  uint8_t *p = w->buf + 1024 + (size_t)w->width * w->n++;
  for (int i = 0; i < w->width; i++) p[i] = (uint8_t)((uint32_t)tok >> (8 * i));
  return 0;
}

static int emit_token(void *user, int id) { return writer_put(user, id); }

/* ---- documents --------------------------------------------------------------- */

typedef struct {
  zt_tok_t *tok;
  zt_writer_t train, val;
  long val_ppm; /* validation fraction in parts per million */
  uint64_t ndocs;
} zt_prep_t;

static int encode_doc(zt_prep_t *p, const uint8_t *s, size_t n) {
  uint64_t i = p->ndocs++;
  int to_val = ((i + 1) * (uint64_t)p->val_ppm) / 1000000 > (i * (uint64_t)p->val_ppm) / 1000000;
  zt_writer_t *w = to_val ? &p->val : &p->train;
  if (writer_put(w, zt_tok_eot(p->tok)) != 0) return -1;
  return zt_tok_encode(p->tok, s, n, emit_token, w);
}

/* Splits a file's text into documents at lines equal to sep (NULL: the
 * whole file is one document); empty documents are skipped. */
static int encode_file(zt_prep_t *p, const char *path, const char *sep) {
  char *buf;
  size_t len;
  if (zt_read_file(path, &buf, &len, (size_t)1 << 32) != 0) return -1;
  const uint8_t *s = (const uint8_t *)buf;
  int rc = 0;
  if (!sep) {
    if (len) rc = encode_doc(p, s, len);
    free(buf);
    return rc;
  }
  size_t seplen = strlen(sep), doc = 0;
  for (size_t i = 0; i < len && rc == 0;) {
    const uint8_t *nl = memchr(s + i, '\n', len - i);
    size_t end = nl ? (size_t)(nl - s) : len, l = end - i;
    if (l && s[end - 1] == '\r') l--;
    size_t next = nl ? end + 1 : len;
    if (l == seplen && !memcmp(s + i, sep, seplen)) {
      if (i > doc) rc = encode_doc(p, s + doc, i - doc);
      doc = next;
    }
    i = next;
  }
  if (rc == 0 && len > doc) rc = encode_doc(p, s + doc, len - doc);
  free(buf);
  return rc ? zt_err_wrap("%s", path) : 0;
}

/* ---- the tokenizer record ------------------------------------------------------ */

/* Copies the file at src to DIR/PREFIX_suffix (through a temporary file). */
static int copy_into(const char *src, const char *dir, const char *prefix, const char *suffix) {
  char name[1100], *buf;
  size_t len;
  if (zt_read_file(src, &buf, &len, ZT_TOK_FILE_MAX) != 0) return -1;
  snprintf(name, sizeof name, "%s_%s", prefix, suffix);
  int rc = write_atomic(dir, name, buf, len);
  free(buf);
  return rc;
}

/* DIR/PREFIX_tokenizer.json (and, for gpt2 and hf, the files it names). */
static int write_record(const zt_tok_t *tok, const char *dir, const char *prefix,
                        const char *enc, const char *bpe) {
  char name[1100];
  int gpt2 = zt_tok_type(tok) == ZT_TOK_GPT2, hf = zt_tok_type(tok) == ZT_TOK_HF;
  if (gpt2 && (copy_into(enc, dir, prefix, "encoder.json") != 0 ||
               copy_into(bpe, dir, prefix, "vocab.bpe") != 0))
    return -1;
  if (hf && copy_into(enc, dir, prefix, "hf_tokenizer.json") != 0) return -1;
  cJSON *r = cJSON_CreateObject();
  cJSON_AddStringToObject(r, "type", zt_tok_type_name(tok));
  cJSON_AddNumberToObject(r, "vocab_size", zt_tok_vocab_size(tok));
  cJSON_AddNumberToObject(r, "eot", zt_tok_eot(tok));
  if (gpt2) {
    snprintf(name, sizeof name, "%s_encoder.json", prefix);
    cJSON_AddStringToObject(r, "encoder", name);
    snprintf(name, sizeof name, "%s_vocab.bpe", prefix);
    cJSON_AddStringToObject(r, "bpe", name);
  }
  if (hf) {
    snprintf(name, sizeof name, "%s_hf_tokenizer.json", prefix);
    cJSON_AddStringToObject(r, "file", name);
  }
  char *text = cJSON_PrintUnformatted(r);
  cJSON_Delete(r);
  if (!text) return zt_err("tokenizer record: out of memory");
  size_t n = strlen(text);
  text[n] = '\n'; /* replaces the terminator; the length is known */
  snprintf(name, sizeof name, "%s_tokenizer.json", prefix);
  int rc = write_atomic(dir, name, text, n + 1);
  free(text);
  return rc;
}

/* ---- an earlier data set ------------------------------------------------------ */

/* 1 when name is PREFIX_SPLIT_N.bin: N one or more digits. */
static int is_shard_of(const char *name, const char *prefix, const char *split) {
  size_t pl = strlen(prefix), sl = strlen(split);
  if (strncmp(name, prefix, pl) || name[pl] != '_' || strncmp(name + pl + 1, split, sl) ||
      name[pl + 1 + sl] != '_')
    return 0;
  const char *d = name + pl + 1 + sl + 1, *e = d;
  while (*e >= '0' && *e <= '9') e++;
  return e > d && !strcmp(e, ".bin");
}

/* 0 when dir holds no file of a data set named prefix; otherwise -1 naming
 * the first one found. A dir that cannot be listed (missing, not a
 * directory) holds none: making it or writing into it reports its own
 * error. */
static int check_no_dataset(const char *dir, const char *prefix) {
  char record[1100];
  snprintf(record, sizeof record, "%s_tokenizer.json", prefix);
  DIR *d = opendir(dir);
  if (!d) return 0;
  struct dirent *e;
  int rc = 0;
  while (rc == 0 && (e = readdir(d)) != NULL)
    if (!strcmp(e->d_name, record) || is_shard_of(e->d_name, prefix, "train") ||
        is_shard_of(e->d_name, prefix, "val"))
      rc = zt_err("%s already holds a data set (%s): remove it or use another --prefix", dir,
                  e->d_name);
  closedir(d);
  return rc;
}

/* ---- main -------------------------------------------------------------------- */

static void usage(void) {
  fprintf(stderr,
          "usage: zprep INPUT... -o DIR [--tokenizer byte|gpt2|hf] [--encoder encoder.json]\n"
          "             [--bpe vocab.bpe] [--tokenizer-json tokenizer.json] [--eot TEXT]\n"
          "             [--doc-sep LINE] [--shard-tokens N]\n"
          "             [--val-fraction F] [--prefix NAME] [--token-bytes 2|4]\n");
}

static void writer_init(zt_writer_t *w, const char *dir, const char *prefix, const char *split,
                        size_t cap, int width) {
  memset(w, 0, sizeof *w);
  w->dir = dir;
  w->prefix = prefix;
  w->split = split;
  w->cap = cap;
  w->width = width;
  w->buf = zt_xmalloc(1024 + (size_t)width * cap);
}

/* Bytes per token on disk: --token-bytes (2 or 4), by default the fewest
 * that hold every id of the vocabulary. -1 with a message naming the
 * option when it cannot. */
static int token_width(const char *s, int vocab, int *width) {
  int64_t v = vocab > 65536 ? 4 : 2;
  if (s && (zt_parse_i64("--token-bytes", s, 2, 4, &v) != 0 || v == 3))
    return zt_errk(ZT_E_INVALID, "--token-bytes: expected 2 or 4, got \"%.32s\"", s);
  if (v == 2 && vocab > 65536)
    return zt_errk(ZT_E_INVALID, "--token-bytes 2: the vocabulary has %d tokens, more than "
                   "16-bit ids hold (use 4)", vocab);
  *width = (int)v;
  return 0;
}

/* --val-fraction: a decimal number in [0, 1). */
static int parse_fraction(const char *s, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || *end || !(v >= 0.0 && v < 1.0))
    return zt_errk(ZT_E_INVALID, "--val-fraction: expected a number in [0, 1), got \"%.32s\"",
                   s);
  *out = v;
  return 0;
}

/* Parses the options' values (NULL: not given, the default stays) and
 * checks them: --shard-tokens in 1..INT32_MAX, --val-fraction in [0, 1),
 * --prefix a file name prefix (no '/', at most 1000 bytes). -1 with an
 * error naming the option otherwise. */
static int check_values(const char *shard_s, const char *frac_s, const char *prefix,
                        int64_t *shard_tokens, double *val_frac) {
  if (shard_s && zt_parse_i64("--shard-tokens", shard_s, 1, INT32_MAX, shard_tokens) != 0)
    return -1;
  if (frac_s && parse_fraction(frac_s, val_frac) != 0) return -1;
  if (strchr(prefix, '/'))
    return zt_errk(ZT_E_INVALID, "--prefix \"%.100s\": a file name prefix may not contain '/'",
                   prefix);
  if (strlen(prefix) > 1000) return zt_errk(ZT_E_INVALID, "--prefix: longer than 1000 bytes");
  return 0;
}

int main(int argc, char **argv) {
  if (zt_version_arg(argc, argv, "zprep")) return 0;
  const char *out = NULL, *tok = "byte", *enc = NULL, *bpe = NULL, *sep = NULL,
             *prefix = "data", *shard_s = NULL, *frac_s = NULL, *width_s = NULL, *eot = NULL;
  int width = 2;
  double val_frac = 0.1;
  int64_t shard_tokens = 100000000;
  const char **inputs = zt_xcalloc((size_t)argc, sizeof(char *));
  int ninputs = 0, rc = 1;
  zt_prep_t p;
  memset(&p, 0, sizeof p);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    int has = i + 1 < argc;
    if (!strcmp(a, "-o") && has) out = argv[++i];
    else if (!strcmp(a, "--tokenizer") && has) tok = argv[++i];
    else if (!strcmp(a, "--encoder") && has) enc = argv[++i];
    else if (!strcmp(a, "--bpe") && has) bpe = argv[++i];
    else if (!strcmp(a, "--tokenizer-json") && has) enc = argv[++i];
    else if (!strcmp(a, "--eot") && has) eot = argv[++i];
    else if (!strcmp(a, "--doc-sep") && has) sep = argv[++i];
    else if (!strcmp(a, "--prefix") && has) prefix = argv[++i];
    else if (!strcmp(a, "--shard-tokens") && has) shard_s = argv[++i];
    else if (!strcmp(a, "--val-fraction") && has) frac_s = argv[++i];
    else if (!strcmp(a, "--token-bytes") && has) width_s = argv[++i];
    else if (a[0] == '-') {
      usage();
      free(inputs);
      return 2;
    } else inputs[ninputs++] = a;
  }
  if (!out || ninputs == 0) {
    usage();
    free(inputs);
    return 2;
  }
  if (check_values(shard_s, frac_s, prefix, &shard_tokens, &val_frac) != 0 ||
      check_no_dataset(out, prefix) != 0) {
    fprintf(stderr, "zprep: %s\n", zt_err_msg());
    free(inputs);
    return 2;
  }
  p.val_ppm = lround(val_frac * 1e6);
  if (!strcmp(tok, "gpt2")) {
    if (!enc || !bpe) {
      fprintf(stderr, "zprep: --tokenizer gpt2 needs --encoder and --bpe\n");
      free(inputs);
      return 2;
    }
    if (zt_tok_open_gpt2(enc, bpe, &p.tok) != 0) goto out;
  } else if (!strcmp(tok, "hf")) {
    if (!enc) {
      fprintf(stderr, "zprep: --tokenizer hf needs --tokenizer-json\n");
      free(inputs);
      return 2;
    }
    if (zt_tok_open_hf(enc, eot, &p.tok) != 0) goto out;
  } else if (!strcmp(tok, "byte")) {
    if (zt_tok_open_byte(&p.tok) != 0) goto out;
  } else {
    fprintf(stderr, "zprep: unknown tokenizer \"%s\" (byte, gpt2 or hf)\n", tok);
    free(inputs);
    return 2;
  }
  if (token_width(width_s, zt_tok_vocab_size(p.tok), &width) != 0) {
    fprintf(stderr, "zprep: %s\n", zt_err_msg());
    zt_tok_free(p.tok);
    free(inputs);
    return 2;
  }
  if (zt_mkdirs(out) != 0) goto out;
  writer_init(&p.train, out, prefix, "train", (size_t)shard_tokens, width);
  writer_init(&p.val, out, prefix, "val", (size_t)shard_tokens, width);
  for (int i = 0; i < ninputs; i++)
    if (encode_file(&p, inputs[i], sep) != 0) goto out;
  if (writer_flush(&p.train) != 0 || writer_flush(&p.val) != 0) goto out;
  if (p.train.index == 0) {
    zt_err("no training tokens (empty inputs?)");
    goto out;
  }
  if (write_record(p.tok, out, prefix, enc, bpe) != 0) goto out;
  printf("zprep: %llu documents; train %llu tokens in %d shard(s), val %llu tokens in %d "
         "shard(s); vocab_size %d\n",
         (unsigned long long)p.ndocs, (unsigned long long)p.train.total, p.train.index,
         (unsigned long long)p.val.total, p.val.index, zt_tok_vocab_size(p.tok));
  rc = 0;
out:
  if (rc != 0) fprintf(stderr, "zprep: %s\n", zt_err_msg());
  free(p.train.buf);
  free(p.val.buf);
  zt_tok_free(p.tok);
  free(inputs);
  return rc;
}
