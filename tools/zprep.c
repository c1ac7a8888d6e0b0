/*
 * zprep.c: text -> token shards for training (llm.c's shard format).
 *
 *   zprep INPUT... -o DIR [--tokenizer byte|gpt2] [--encoder encoder.json]
 *         [--bpe vocab.bpe] [--doc-sep LINE] [--shard-tokens N]
 *         [--val-fraction F] [--prefix NAME]
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
 * (magic 20240520, version 1, token count), tokens as little-endian uint16.
 * Files are written to a temporary name and renamed when complete. The
 * summary line on stdout gives the vocab_size to put in the job spec.
 *
 * Tokenizers:
 *
 *   byte  Each byte is its own token (0..255) and 256 is end-of-text:
 *         vocab_size 257. Needs no files and works on any input.
 *   gpt2  GPT-2's byte-level BPE, from OpenAI's encoder.json and vocab.bpe:
 *         the text is split by GPT-2's pre-tokenization pattern
 *           's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *         (implemented by hand below), each piece's bytes are mapped to
 *         printable characters (bytes_to_unicode) and merged by rank; the
 *         end-of-text token is encoder["<|endoftext|>"] (50256 for GPT-2).
 *         Character classes: ASCII exactly as the pattern says; whitespace is
 *         Unicode's White_Space list; other code points are letters when
 *         iswalpha() says so in the C.UTF-8 locale (if that locale is missing,
 *         all of them count as letters), numbers when iswalnum() but not
 *         iswalpha(), else "other". This matches the `regex` module on all
 *         ASCII text and on common accented letters and punctuation; it can
 *         differ on rare scripts and on non-ASCII digits, which glibc counts
 *         as letters. Invalid UTF-8 bytes are "other", one byte each.
 */
#include <errno.h>
#include <locale.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <wctype.h>

#include <cjson/cJSON.h>

#include "zt_common.h"

#define ZT_MAGIC 20240520
#define ZT_VERSION 1

/* ---- string -> int hash table --------------------------------------------- */

typedef struct {
  char *key; /* NULL: empty slot */
  size_t len;
  int val;
} zt_hent_t;

typedef struct {
  zt_hent_t *e;
  size_t cap, n;
} zt_htab_t;

static uint64_t fnv1a(const char *s, size_t len) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
  return h;
}

static zt_hent_t *htab_slot(const zt_htab_t *t, const char *key, size_t len) {
  size_t i = fnv1a(key, len) & (t->cap - 1);
  while (t->e[i].key && (t->e[i].len != len || memcmp(t->e[i].key, key, len) != 0))
    i = (i + 1) & (t->cap - 1);
  return &t->e[i];
}

static int htab_grow(zt_htab_t *t) {
  size_t cap = t->cap ? t->cap * 2 : 1024;
  zt_htab_t n = {zt_xcalloc(cap, sizeof(zt_hent_t)), cap, t->n};
  for (size_t i = 0; i < t->cap; i++)
    if (t->e[i].key) *htab_slot(&n, t->e[i].key, t->e[i].len) = t->e[i];
  free(t->e);
  *t = n;
  return 0;
}

/* Inserts a copy of key; an existing key keeps its first value. */
static int htab_put(zt_htab_t *t, const char *key, size_t len, int val) {
  if ((t->n + 1) * 2 > t->cap && htab_grow(t) != 0) return -1;
  zt_hent_t *e = htab_slot(t, key, len);
  if (e->key) return 0;
  e->key = zt_xmalloc(len + 1);
  memcpy(e->key, key, len);
  e->key[len] = 0;
  e->len = len;
  e->val = val;
  t->n++;
  return 0;
}

static int htab_get(const zt_htab_t *t, const char *key, size_t len) {
  if (!t->cap) return -1;
  const zt_hent_t *e = htab_slot(t, key, len);
  return e->key ? e->val : -1;
}

static void htab_free(zt_htab_t *t) {
  for (size_t i = 0; i < t->cap; i++) free(t->e[i].key);
  free(t->e);
  memset(t, 0, sizeof *t);
}

/* ---- token output ----------------------------------------------------------- */

typedef struct {
  const char *dir, *prefix, *split;
  uint8_t *buf; /* ZT header bytes + 2 bytes per token */
  size_t n, cap; /* tokens */
  int index;     /* next shard number */
  uint64_t total;
} zt_writer_t;

static void put_le32(uint8_t *p, int32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)((uint32_t)v >> (8 * i));
}

static int writer_flush(zt_writer_t *w) {
  char path[4096], tmp[4200];
  if (w->n == 0) return 0;
  snprintf(path, sizeof path, "%s/%s_%s_%06d.bin", w->dir, w->prefix, w->split, w->index);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  memset(w->buf, 0, 1024);
  put_le32(w->buf, ZT_MAGIC);
  put_le32(w->buf + 4, ZT_VERSION);
  put_le32(w->buf + 8, (int32_t)w->n);
  FILE *f = fopen(tmp, "wb");
  if (!f) return zt_err_errno("%s", tmp);
  size_t len = 1024 + 2 * w->n;
  if (fwrite(w->buf, 1, len, f) != len || fflush(f) != 0) {
    zt_err_errno("%s: write", tmp);
    fclose(f);
    return -1;
  }
  if (fclose(f) != 0) return zt_err_errno("%s: close", tmp);
  if (rename(tmp, path) != 0) return zt_err_errno("rename %s", tmp);
  w->index++;
  w->total += w->n;
  w->n = 0;
  return 0;
}

static int writer_put(zt_writer_t *w, int tok) {
  if (w->n == w->cap && writer_flush(w) != 0) return -1;
  uint8_t *p = w->buf + 1024 + 2 * w->n++;
  p[0] = (uint8_t)(tok & 0xff);
  p[1] = (uint8_t)(tok >> 8);
  return 0;
}

/* ---- GPT-2 pre-tokenization ------------------------------------------------- */

enum { CL_LETTER, CL_NUMBER, CL_SPACE, CL_OTHER };

static int zt_have_locale;

/* Decodes the UTF-8 code point at s[i]; returns its length in bytes.
 * Invalid sequences decode as one byte with *cp = UINT32_MAX. */
static size_t utf8_decode(const uint8_t *s, size_t n, size_t i, uint32_t *cp) {
  uint8_t c = s[i];
  size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (len == 1) {
    *cp = c;
    return 1;
  }
  if (len == 0 || i + len > n) goto bad;
  uint32_t v = c & (0x7f >> len);
  for (size_t k = 1; k < len; k++) {
    if ((s[i + k] & 0xc0) != 0x80) goto bad;
    v = v << 6 | (s[i + k] & 0x3f);
  }
  static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (v < min_cp[len] || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) goto bad;
  *cp = v;
  return len;
bad:
  *cp = UINT32_MAX;
  return 1;
}

static int is_unicode_space(uint32_t cp) {
  return cp == 0x85 || cp == 0xa0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

static int char_class(uint32_t cp) {
  if (cp == UINT32_MAX) return CL_OTHER;
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return CL_LETTER;
    if (cp >= '0' && cp <= '9') return CL_NUMBER;
    if (cp == ' ' || (cp >= '\t' && cp <= '\r')) return CL_SPACE;
    return CL_OTHER;
  }
  if (is_unicode_space(cp)) return CL_SPACE;
  if (!zt_have_locale) return CL_LETTER;
  if (iswalpha((wint_t)cp)) return CL_LETTER;
  if (iswalnum((wint_t)cp)) return CL_NUMBER;
  return CL_OTHER;
}

/* Class of the code point at i; *len is its length in bytes. */
static int class_at(const uint8_t *s, size_t n, size_t i, size_t *len) {
  uint32_t cp;
  *len = utf8_decode(s, n, i, &cp);
  return char_class(cp);
}

/* End of the run of code points of class cl starting at i. */
static size_t run_end(const uint8_t *s, size_t n, size_t i, int cl) {
  size_t len;
  while (i < n && class_at(s, n, i, &len) == cl) i += len;
  return i;
}

static size_t contraction(const uint8_t *s, size_t n, size_t i) {
  if (s[i] != '\'' || i + 1 >= n) return 0;
  uint8_t a = s[i + 1], b = i + 2 < n ? s[i + 2] : 0;
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

/* End of the pre-token that starts at i (i < n), following the pattern's
 * alternatives in order. */
static size_t pretok_end(const uint8_t *s, size_t n, size_t i) {
  size_t len, c = contraction(s, n, i);
  if (c) return i + c;
  int cl = class_at(s, n, i, &len);
  /* " ?X+" for X = letter, number, other: an optional ASCII space first. */
  if (s[i] == ' ' && i + 1 < n) {
    size_t l2;
    int next = class_at(s, n, i + 1, &l2);
    if (next != CL_SPACE) return run_end(s, n, i + 1, next);
  }
  if (cl != CL_SPACE) return run_end(s, n, i, cl);
  /* "\s+(?!\S)|\s+": a whitespace run, minus its last code point when a
   * non-space follows and the run has more than one. */
  size_t e = run_end(s, n, i, CL_SPACE);
  if (e == n) return e;
  size_t last = i, k = i;
  while (k < e) {
    last = k;
    k += utf8_decode(s, n, k, &(uint32_t){0});
  }
  return last > i ? last : e;
}

/* ---- GPT-2 BPE ---------------------------------------------------------------- */

typedef struct {
  zt_htab_t encoder; /* mapped token string -> id */
  zt_htab_t ranks;   /* "first second" -> merge rank */
  char byte_str[256][3]; /* bytes_to_unicode as UTF-8, NUL-terminated */
  int eot, vocab;
  /* scratch */
  char *mapped;
  size_t *sym_off, *sym_len;
  size_t scratch_cap;
  char *key;
} zt_bpe_t;

static void bytes_to_unicode(zt_bpe_t *b) {
  int n = 0;
  for (int c = 0; c < 256; c++) {
    int printable = (c >= '!' && c <= '~') || (c >= 0xa1 && c <= 0xac) || (c >= 0xae && c <= 0xff);
    uint32_t cp = printable ? (uint32_t)c : (uint32_t)(256 + n++);
    char *o = b->byte_str[c];
    if (cp < 0x80) {
      o[0] = (char)cp;
      o[1] = 0;
    } else {
      o[0] = (char)(0xc0 | (cp >> 6));
      o[1] = (char)(0x80 | (cp & 0x3f));
      o[2] = 0;
    }
  }
}

static int bpe_load(zt_bpe_t *b, const char *enc_path, const char *bpe_path) {
  char *buf = NULL;
  size_t len;
  memset(b, 0, sizeof *b);
  bytes_to_unicode(b);
  if (zt_read_file(enc_path, &buf, &len, 256u << 20) != 0) return -1;
  cJSON *root = cJSON_ParseWithLength(buf, len);
  free(buf);
  if (!cJSON_IsObject(root)) {
    cJSON_Delete(root);
    return zt_err("%s: not a JSON object", enc_path);
  }
  for (cJSON *it = root->child; it; it = it->next) {
    if (!cJSON_IsNumber(it) || it->valueint < 0 || it->valueint > 65535) {
      cJSON_Delete(root);
      return zt_err("%s: token \"%s\" has no id in [0, 65535]", enc_path, it->string);
    }
    if (htab_put(&b->encoder, it->string, strlen(it->string), it->valueint) != 0) break;
    if (it->valueint + 1 > b->vocab) b->vocab = it->valueint + 1;
  }
  cJSON_Delete(root);
  b->eot = htab_get(&b->encoder, "<|endoftext|>", 13);
  if (b->eot < 0) return zt_err("%s: no \"<|endoftext|>\" token", enc_path);

  if (zt_read_file(bpe_path, &buf, &len, 256u << 20) != 0) return -1;
  int rank = 0;
  for (char *line = buf, *next; line && *line; line = next) {
    next = strchr(line, '\n');
    if (next) *next++ = 0;
    size_t l = strlen(line);
    if (l && line[l - 1] == '\r') line[--l] = 0;
    if (l == 0 || !strncmp(line, "#version", 8)) continue;
    char *sp = strchr(line, ' ');
    if (!sp || sp == line || !sp[1] || strchr(sp + 1, ' ')) {
      free(buf);
      return zt_err("%s: bad merge line \"%.60s\"", bpe_path, line);
    }
    if (htab_put(&b->ranks, line, l, rank++) != 0) {
      free(buf);
      return -1;
    }
  }
  free(buf);
  return 0;
}

static void bpe_free(zt_bpe_t *b) {
  htab_free(&b->encoder);
  htab_free(&b->ranks);
  free(b->mapped);
  free(b->sym_off);
  free(b->sym_len);
  free(b->key);
}

static int bpe_reserve(zt_bpe_t *b, size_t n) {
  if (n <= b->scratch_cap) return 0;
  size_t cap = n * 2;
  b->mapped = zt_xrealloc(b->mapped, 2 * cap + 1);
  b->key = zt_xrealloc(b->key, 4 * cap + 2);
  b->sym_off = zt_xrealloc(b->sym_off, cap * sizeof(size_t));
  b->sym_len = zt_xrealloc(b->sym_len, cap * sizeof(size_t));
  b->scratch_cap = cap;
  return 0;
}

/* Rank of merging symbols i and i + 1, or -1. */
static int pair_rank(zt_bpe_t *b, size_t i) {
  size_t la = b->sym_len[i], lb = b->sym_len[i + 1];
  memcpy(b->key, b->mapped + b->sym_off[i], la);
  b->key[la] = ' ';
  memcpy(b->key + la + 1, b->mapped + b->sym_off[i + 1], lb);
  return htab_get(&b->ranks, b->key, la + 1 + lb);
}

/* Encodes one pre-token (n bytes) with OpenAI's encoder.py algorithm:
 * repeatedly take the adjacent pair of lowest rank and merge every
 * left-to-right occurrence of that pair of strings. */
static int bpe_encode(zt_bpe_t *b, const uint8_t *s, size_t n, zt_writer_t *w) {
  if (bpe_reserve(b, n) != 0) return -1;
  size_t nsym = 0, off = 0;
  for (size_t i = 0; i < n; i++) {
    size_t l = strlen(b->byte_str[s[i]]);
    memcpy(b->mapped + off, b->byte_str[s[i]], l);
    b->sym_off[nsym] = off;
    b->sym_len[nsym++] = l;
    off += l;
  }
  while (nsym > 1) {
    int best = -1;
    size_t at = 0;
    for (size_t i = 0; i + 1 < nsym; i++) {
      int r = pair_rank(b, i);
      if (r >= 0 && (best < 0 || r < best)) {
        best = r;
        at = i;
      }
    }
    if (best < 0) break;
    /* Merge every occurrence of (sym[at], sym[at+1]), left to right. */
    size_t first = at, out = 0;
    size_t fo = b->sym_off[first], fl = b->sym_len[first], so = b->sym_off[first + 1],
           sl = b->sym_len[first + 1];
    for (size_t i = 0; i < nsym;) {
      int match = i + 1 < nsym && b->sym_len[i] == fl && b->sym_len[i + 1] == sl &&
                  !memcmp(b->mapped + b->sym_off[i], b->mapped + fo, fl) &&
                  !memcmp(b->mapped + b->sym_off[i + 1], b->mapped + so, sl);
      b->sym_off[out] = b->sym_off[i];
      b->sym_len[out] = match ? fl + sl : b->sym_len[i];
      out++;
      i += match ? 2 : 1;
    }
    nsym = out;
  }
  for (size_t i = 0; i < nsym; i++) {
    int id = htab_get(&b->encoder, b->mapped + b->sym_off[i], b->sym_len[i]);
    if (id < 0)
      return zt_err("symbol \"%.*s\" is not in the encoder", (int)b->sym_len[i],
                    b->mapped + b->sym_off[i]);
    if (writer_put(w, id) != 0) return -1;
  }
  return 0;
}

/* ---- documents --------------------------------------------------------------- */

typedef struct {
  int gpt2;
  zt_bpe_t bpe;
  zt_writer_t train, val;
  long val_ppm; /* validation fraction in parts per million */
  uint64_t ndocs;
} zt_prep_t;

static int encode_doc(zt_prep_t *p, const uint8_t *s, size_t n) {
  uint64_t i = p->ndocs++;
  int to_val = ((i + 1) * (uint64_t)p->val_ppm) / 1000000 > (i * (uint64_t)p->val_ppm) / 1000000;
  zt_writer_t *w = to_val ? &p->val : &p->train;
  if (!p->gpt2) {
    if (writer_put(w, 256) != 0) return -1;
    for (size_t k = 0; k < n; k++)
      if (writer_put(w, s[k]) != 0) return -1;
    return 0;
  }
  if (writer_put(w, p->bpe.eot) != 0) return -1;
  for (size_t k = 0; k < n;) {
    size_t e = pretok_end(s, n, k);
    if (bpe_encode(&p->bpe, s + k, e - k, w) != 0) return -1;
    k = e;
  }
  return 0;
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

/* ---- main -------------------------------------------------------------------- */

static void usage(void) {
  fprintf(stderr,
          "usage: zprep INPUT... -o DIR [--tokenizer byte|gpt2] [--encoder encoder.json]\n"
          "             [--bpe vocab.bpe] [--doc-sep LINE] [--shard-tokens N]\n"
          "             [--val-fraction F] [--prefix NAME]\n");
}

static int writer_init(zt_writer_t *w, const char *dir, const char *prefix, const char *split,
                       size_t cap) {
  memset(w, 0, sizeof *w);
  w->dir = dir;
  w->prefix = prefix;
  w->split = split;
  w->cap = cap;
  w->buf = zt_xmalloc(1024 + 2 * cap);
  return 0;
}

int main(int argc, char **argv) {
  const char *out = NULL, *tok = "byte", *enc = NULL, *bpe = NULL, *sep = NULL,
             *prefix = "data";
  double val_frac = 0.1;
  long shard_tokens = 100000000;
  const char **inputs = zt_xcalloc((size_t)argc, sizeof(char *));
  int ninputs = 0;
  zt_prep_t p;
  memset(&p, 0, sizeof p);
  if (!inputs) return 1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    int has = i + 1 < argc;
    if (!strcmp(a, "-o") && has) out = argv[++i];
    else if (!strcmp(a, "--tokenizer") && has) tok = argv[++i];
    else if (!strcmp(a, "--encoder") && has) enc = argv[++i];
    else if (!strcmp(a, "--bpe") && has) bpe = argv[++i];
    else if (!strcmp(a, "--doc-sep") && has) sep = argv[++i];
    else if (!strcmp(a, "--prefix") && has) prefix = argv[++i];
    else if (!strcmp(a, "--shard-tokens") && has) shard_tokens = strtol(argv[++i], NULL, 10);
    else if (!strcmp(a, "--val-fraction") && has) val_frac = strtod(argv[++i], NULL);
    else if (a[0] == '-') {
      usage();
      free(inputs);
      return 2;
    } else inputs[ninputs++] = a;
  }
  if (!out || ninputs == 0 || shard_tokens < 1 || shard_tokens > INT32_MAX ||
      !(val_frac >= 0.0 && val_frac < 1.0)) {
    usage();
    free(inputs);
    return 2;
  }
  p.val_ppm = lround(val_frac * 1e6);
  if (!strcmp(tok, "gpt2")) {
    p.gpt2 = 1;
    if (!enc || !bpe) {
      fprintf(stderr, "zprep: --tokenizer gpt2 needs --encoder and --bpe\n");
      free(inputs);
      return 2;
    }
    zt_have_locale = setlocale(LC_CTYPE, "C.UTF-8") != NULL;
    if (bpe_load(&p.bpe, enc, bpe) != 0) goto err;
  } else if (strcmp(tok, "byte") != 0) {
    fprintf(stderr, "zprep: unknown tokenizer \"%s\" (byte or gpt2)\n", tok);
    free(inputs);
    return 2;
  }
  if (zt_mkdirs(out) != 0 || writer_init(&p.train, out, prefix, "train", (size_t)shard_tokens) ||
      writer_init(&p.val, out, prefix, "val", (size_t)shard_tokens))
    goto err;
  for (int i = 0; i < ninputs; i++)
    if (encode_file(&p, inputs[i], sep) != 0) goto err;
  if (writer_flush(&p.train) != 0 || writer_flush(&p.val) != 0) goto err;
  if (p.train.index == 0) {
    zt_err("no training tokens (empty inputs?)");
    goto err;
  }
  printf("zprep: %llu documents; train %llu tokens in %d shard(s), val %llu tokens in %d "
         "shard(s); vocab_size %d\n",
         (unsigned long long)p.ndocs, (unsigned long long)p.train.total, p.train.index,
         (unsigned long long)p.val.total, p.val.index, p.gpt2 ? p.bpe.vocab : 257);
  free(p.train.buf);
  free(p.val.buf);
  if (p.gpt2) bpe_free(&p.bpe);
  free(inputs);
  return 0;
err:
  fprintf(stderr, "zprep: %s\n", zt_err_msg());
  free(p.train.buf);
  free(p.val.buf);
  if (p.gpt2) bpe_free(&p.bpe);
  free(inputs);
  return 1;
}
