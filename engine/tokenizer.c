/*
 * tokenizer.c: the byte tokenizer and GPT-2's byte-level BPE, both ways,
 * and the tokenizer record (tokenizer.h says what each is and who uses it).
 *
 * GPT-2 encoding (moved here from zprep, unchanged):
 *
 *   1. Pre-tokenization: the text is split by GPT-2's pattern
 *        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *      implemented by hand (pretok_end). Character classes: ASCII exactly as
 *      the pattern says; whitespace is Unicode's White_Space list; other
 *      code points are letters when iswalpha() says so in the C.UTF-8 locale
 *      (if that locale is missing, all of them count as letters), numbers
 *      when iswalnum() but not iswalpha(), else "other". This matches the
 *      `regex` module on all ASCII text and on common accented letters and
 *      punctuation; it can differ on rare scripts and on non-ASCII digits,
 *      which glibc counts as letters. Invalid UTF-8 bytes are "other", one
 *      byte each. The locale is opened with newlocale() and used through
 *      the *_l functions, so the process's own locale is left alone.
 *   2. Each piece's bytes are mapped to printable characters
 *      (bytes_to_unicode) and merged with OpenAI's encoder.py algorithm:
 *      repeatedly take the adjacent pair of lowest rank in vocab.bpe and
 *      merge every left-to-right occurrence of that pair of strings.
 *   3. Each resulting symbol is looked up in encoder.json.
 *
 * Decoding: every encoder string is turned back into bytes once, at load
 * (code points of the bytes_to_unicode table become their byte; any other
 * code point is kept as its UTF-8 bytes), so decode is a table lookup.
 */
#include "tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <pcre2.h>
#include <utf8proc.h>
#include <locale.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <wctype.h>

#include "zt_json.h"

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

static void htab_grow(zt_htab_t *t) {
  size_t cap = t->cap ? t->cap * 2 : 1024;
  zt_htab_t n = {zt_xcalloc(cap, sizeof(zt_hent_t)), cap, t->n};
  for (size_t i = 0; i < t->cap; i++)
    if (t->e[i].key) *htab_slot(&n, t->e[i].key, t->e[i].len) = t->e[i];
  free(t->e);
  *t = n;
}

/* Inserts a copy of key; an existing key keeps its first value. */
static void htab_put(zt_htab_t *t, const char *key, size_t len, int val) {
  if ((t->n + 1) * 2 > t->cap) htab_grow(t);
  zt_hent_t *e = htab_slot(t, key, len);
  if (e->key) return;
  e->key = zt_xmalloc(len + 1);
  memcpy(e->key, key, len);
  e->key[len] = 0;
  e->len = len;
  e->val = val;
  t->n++;
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

/* ---- the tokenizer ---------------------------------------------------------- */

/* An added token of a tokenizer.json: matched in the text before anything
 * else, and its id emitted whole. */
typedef struct {
  char *text;
  size_t len;
  int id;
  int normalized; /* matched in the normalized text, not the raw one */
  int lstrip, rstrip; /* the whitespace before (after) it goes with it */
} zt_added_t;

struct zt_tok {
  zt_tok_type_t type;
  int vocab, eot;
  int bos; /* hf: the template's first special token; else eot */
  /* decode: id -> bytes (gpt2: NULL for ids no encoder string has) */
  char **dec;
  size_t *dec_len;
  char bytes[256]; /* byte tokenizer: token b is bytes[b] */
  /* gpt2 encode */
  zt_htab_t encoder;     /* mapped token string -> id */
  zt_htab_t ranks;       /* "first second" -> merge rank */
  char byte_str[256][3]; /* bytes_to_unicode as UTF-8, NUL-terminated */
  locale_t loc;          /* C.UTF-8 for the character classes, or 0 */
  /* hf (tokenizer.json); gpt2 and byte leave these zero */
  int ignore_merges;     /* a pre-token found whole in the vocabulary is one token */
  int byte_fallback;     /* an unknown symbol becomes its bytes' <0xXX> tokens */
  int unk;               /* unk_token's id, or -1: an unknown symbol is an error */
  int nfc;               /* the normalizer: NFC */
  pcre2_code *split;     /* the Split pre-tokenizer's pattern, or NULL */
  int split_removed;     /* its behavior is Removed (else Isolated) */
  pcre2_code *bl_regex;  /* ByteLevel's use_regex: GPT-2's pattern, or NULL */
  int bl_prefix;         /* ByteLevel's add_prefix_space */
  pcre2_match_data *md;
  zt_added_t *added;     /* added_tokens, longest first */
  int n_added;
  /* scratch */
  char *mapped;
  size_t *sym_off, *sym_len;
  size_t scratch_cap;
  char *key;
};

zt_tok_type_t zt_tok_type(const zt_tok_t *t) { return t->type; }
const char *zt_tok_type_name(const zt_tok_t *t) {
  return t->type == ZT_TOK_GPT2 ? "gpt2" : t->type == ZT_TOK_HF ? "hf" : "byte";
}
int zt_tok_vocab_size(const zt_tok_t *t) { return t->vocab; }
int zt_tok_eot(const zt_tok_t *t) { return t->eot; }
int zt_tok_bos(const zt_tok_t *t) { return t->bos; }

void zt_tok_free(zt_tok_t *t) {
  if (!t) return;
  if (t->dec)
    for (int i = 0; i < t->vocab; i++) free(t->dec[i]);
  free(t->dec);
  free(t->dec_len);
  htab_free(&t->encoder);
  htab_free(&t->ranks);
  if (t->loc) freelocale(t->loc);
  for (int i = 0; i < t->n_added; i++) free(t->added[i].text);
  free(t->added);
  pcre2_code_free(t->split);
  pcre2_code_free(t->bl_regex);
  pcre2_match_data_free(t->md);
  free(t->mapped);
  free(t->sym_off);
  free(t->sym_len);
  free(t->key);
  free(t);
}

int zt_tok_open_byte(zt_tok_t **out) {
  zt_tok_t *t = zt_xcalloc(1, sizeof *t);
  t->type = ZT_TOK_BYTE;
  t->vocab = 257;
  t->eot = t->bos = 256;
  for (int b = 0; b < 256; b++) t->bytes[b] = (char)b;
  *out = t;
  return 0;
}

int zt_tok_decode(const zt_tok_t *t, int id, const char **bytes, size_t *len) {
  if (id == t->eot && t->type == ZT_TOK_BYTE) {
    *bytes = ZT_TOK_EOT_TEXT;
    *len = strlen(ZT_TOK_EOT_TEXT);
    return 0;
  }
  if (id < 0 || id >= t->vocab) return zt_err("token %d is outside the vocabulary of %d", id, t->vocab);
  if (t->type == ZT_TOK_BYTE) {
    *bytes = &t->bytes[id];
    *len = 1;
    return 0;
  }
  if (!t->dec[id]) return zt_err("token %d is not in the encoder", id);
  *bytes = t->dec[id];
  *len = t->dec_len[id];
  return 0;
}

/* ---- GPT-2 pre-tokenization ------------------------------------------------- */

enum { CL_LETTER, CL_NUMBER, CL_SPACE, CL_OTHER };

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

static int char_class(const zt_tok_t *t, uint32_t cp) {
  if (cp == UINT32_MAX) return CL_OTHER;
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return CL_LETTER;
    if (cp >= '0' && cp <= '9') return CL_NUMBER;
    if (cp == ' ' || (cp >= '\t' && cp <= '\r')) return CL_SPACE;
    return CL_OTHER;
  }
  if (is_unicode_space(cp)) return CL_SPACE;
  if (!t->loc) return CL_LETTER;
  if (iswalpha_l((wint_t)cp, t->loc)) return CL_LETTER;
  if (iswalnum_l((wint_t)cp, t->loc)) return CL_NUMBER;
  return CL_OTHER;
}

/* Class of the code point at i; *len is its length in bytes. */
static int class_at(const zt_tok_t *t, const uint8_t *s, size_t n, size_t i, size_t *len) {
  uint32_t cp;
  *len = utf8_decode(s, n, i, &cp);
  return char_class(t, cp);
}

/* End of the run of code points of class cl starting at i. */
static size_t run_end(const zt_tok_t *t, const uint8_t *s, size_t n, size_t i, int cl) {
  size_t len;
  while (i < n && class_at(t, s, n, i, &len) == cl) i += len;
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
static size_t pretok_end(const zt_tok_t *t, const uint8_t *s, size_t n, size_t i) {
  size_t len, c = contraction(s, n, i);
  if (c) return i + c;
  int cl = class_at(t, s, n, i, &len);
  /* " ?X+" for X = letter, number, other: an optional ASCII space first. */
  if (s[i] == ' ' && i + 1 < n) {
    size_t l2;
    int next = class_at(t, s, n, i + 1, &l2);
    if (next != CL_SPACE) return run_end(t, s, n, i + 1, next);
  }
  if (cl != CL_SPACE) return run_end(t, s, n, i, cl);
  /* "\s+(?!\S)|\s+": a whitespace run, minus its last code point when a
   * non-space follows and the run has more than one. */
  size_t e = run_end(t, s, n, i, CL_SPACE);
  if (e == n) return e;
  size_t last = i, k = i;
  while (k < e) {
    last = k;
    k += utf8_decode(s, n, k, &(uint32_t){0});
  }
  return last > i ? last : e;
}

/* ---- GPT-2 files -------------------------------------------------------------- */

static int printable_byte(int c) {
  return (c >= '!' && c <= '~') || (c >= 0xa1 && c <= 0xac) || (c >= 0xae && c <= 0xff);
}

/* The code point GPT-2's bytes_to_unicode shows byte c as: itself when
 * printable, else 256 + the count of unprintable bytes below it. */
static uint32_t byte_cp(int c) {
  if (printable_byte(c)) return (uint32_t)c;
  int n = 0;
  for (int x = 0; x < c; x++) n += !printable_byte(x);
  return (uint32_t)(256 + n);
}

void zt_tok_byte_char(int c, char out[3]) {
  uint32_t cp = byte_cp(c);
  if (cp < 0x80) {
    out[0] = (char)cp;
    out[1] = 0;
  } else {
    out[0] = (char)(0xc0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3f));
    out[2] = 0;
  }
}

/* bytes_to_unicode as UTF-8 strings; inv[cp] = the byte shown as code
 * point cp (cp < 512), -1 for code points not in the table. */
static void bytes_to_unicode(zt_tok_t *t, int inv[512]) {
  for (int i = 0; i < 512; i++) inv[i] = -1;
  for (int c = 0; c < 256; c++) {
    inv[byte_cp(c)] = c;
    zt_tok_byte_char(c, t->byte_str[c]);
  }
}

/* The bytes an encoder string stands for (the inverse of bytes_to_unicode;
 * code points outside the table are kept as UTF-8). */
static void decode_entry(zt_tok_t *t, const int inv[512], const char *s, int id) {
  size_t n = strlen(s), o = 0;
  char *out = zt_xmalloc(n + 1);
  for (size_t i = 0; i < n;) {
    uint32_t cp;
    size_t l = utf8_decode((const uint8_t *)s, n, i, &cp);
    if (cp < 512 && inv[cp] >= 0) out[o++] = (char)inv[cp];
    else memcpy(out + o, s + i, l), o += l;
    i += l;
  }
  free(t->dec[id]); /* an id given twice: the last string decodes */
  t->dec[id] = out;
  t->dec_len[id] = o;
}

static int load_encoder(zt_tok_t *t, const char *path) {
  char *buf;
  size_t len;
  int inv[512];
  bytes_to_unicode(t, inv);
  if (zt_read_file(path, &buf, &len, ZT_TOK_FILE_MAX) != 0) return -1;
  cJSON *root = zt_json_parse(buf, len, path);
  free(buf);
  if (!root) return -1;
  int rc = -1;
  if (!cJSON_IsObject(root)) {
    zt_err("%s: not a JSON object", path);
    goto out;
  }
  for (cJSON *it = root->child; it; it = it->next) {
    if (!cJSON_IsNumber(it) || it->valueint < 0 || it->valueint >= ZT_TOK_VOCAB_MAX) {
      zt_err("%s: token \"%.60s\" has no id in [0, %d]", path, it->string, ZT_TOK_VOCAB_MAX - 1);
      goto out;
    }
    htab_put(&t->encoder, it->string, strlen(it->string), it->valueint);
    if (it->valueint + 1 > t->vocab) t->vocab = it->valueint + 1;
  }
  t->dec = zt_xcalloc((size_t)t->vocab + 1, sizeof(char *));
  t->dec_len = zt_xcalloc((size_t)t->vocab + 1, sizeof(size_t));
  for (cJSON *it = root->child; it; it = it->next) decode_entry(t, inv, it->string, it->valueint);
  t->eot = t->bos = htab_get(&t->encoder, ZT_TOK_EOT_TEXT, strlen(ZT_TOK_EOT_TEXT));
  rc = t->eot < 0 ? zt_err("%s: no \"<|endoftext|>\" token", path) : 0;
out:
  cJSON_Delete(root);
  return rc;
}

static int load_merges(zt_tok_t *t, const char *path) {
  char *buf;
  size_t len;
  if (zt_read_file(path, &buf, &len, ZT_TOK_FILE_MAX) != 0) return -1;
  int rank = 0, rc = 0;
  for (char *line = buf, *next; line && *line; line = next) {
    next = strchr(line, '\n');
    if (next) *next++ = 0;
    size_t l = strlen(line);
    if (l && line[l - 1] == '\r') line[--l] = 0;
    if (l == 0 || !strncmp(line, "#version", 8)) continue;
    char *sp = strchr(line, ' ');
    if (!sp || sp == line || !sp[1] || strchr(sp + 1, ' ')) {
      rc = zt_err("%s: bad merge line \"%.60s\"", path, line);
      break;
    }
    htab_put(&t->ranks, line, l, rank++);
  }
  free(buf);
  return rc;
}

int zt_tok_open_gpt2(const char *encoder_path, const char *bpe_path, zt_tok_t **out) {
  zt_tok_t *t = zt_xcalloc(1, sizeof *t);
  t->type = ZT_TOK_GPT2;
  t->loc = newlocale(LC_CTYPE_MASK, "C.UTF-8", (locale_t)0);
  if (load_encoder(t, encoder_path) != 0 || load_merges(t, bpe_path) != 0) {
    zt_tok_free(t);
    return -1;
  }
  *out = t;
  return 0;
}

/* ---- GPT-2 BPE ---------------------------------------------------------------- */

static void bpe_reserve(zt_tok_t *t, size_t n) {
  if (n <= t->scratch_cap) return;
  size_t cap = n * 2;
  t->mapped = zt_xrealloc(t->mapped, 2 * cap + 1);
  t->key = zt_xrealloc(t->key, 4 * cap + 2);
  t->sym_off = zt_xrealloc(t->sym_off, cap * sizeof(size_t));
  t->sym_len = zt_xrealloc(t->sym_len, cap * sizeof(size_t));
  t->scratch_cap = cap;
}

/* Rank of merging symbols i and i + 1, or -1. */
static int pair_rank(zt_tok_t *t, size_t i) {
  size_t la = t->sym_len[i], lb = t->sym_len[i + 1];
  memcpy(t->key, t->mapped + t->sym_off[i], la);
  t->key[la] = ' ';
  memcpy(t->key + la + 1, t->mapped + t->sym_off[i + 1], lb);
  return htab_get(&t->ranks, t->key, la + 1 + lb);
}

/* Merges every left-to-right occurrence of the pair (sym[at], sym[at+1]);
 * returns the new symbol count. */
static size_t merge_pair(zt_tok_t *t, size_t nsym, size_t at) {
  size_t out = 0;
  size_t fo = t->sym_off[at], fl = t->sym_len[at], so = t->sym_off[at + 1], sl = t->sym_len[at + 1];
  for (size_t i = 0; i < nsym;) {
    int match = i + 1 < nsym && t->sym_len[i] == fl && t->sym_len[i + 1] == sl &&
                !memcmp(t->mapped + t->sym_off[i], t->mapped + fo, fl) &&
                !memcmp(t->mapped + t->sym_off[i + 1], t->mapped + so, sl);
    t->sym_off[out] = t->sym_off[i];
    t->sym_len[out] = match ? fl + sl : t->sym_len[i];
    out++;
    i += match ? 2 : 1;
  }
  return out;
}

/* The id of a symbol after the merges. One the vocabulary lacks becomes
 * the <0xXX> tokens of its bytes (byte_fallback), or unk_token, or an
 * error naming it. */
static int emit_symbol(zt_tok_t *t, const char *sym, size_t len, zt_tok_emit_fn emit,
                       void *user) {
  int id = htab_get(&t->encoder, sym, len);
  if (id >= 0) return emit(user, id);
  if (t->byte_fallback) {
    int ok = 1;
    for (size_t k = 0; k < len && ok; k++) {
      char b[8];
      snprintf(b, sizeof b, "<0x%02X>", (uint8_t)sym[k]);
      ok = htab_get(&t->encoder, b, 6) >= 0;
    }
    for (size_t k = 0; k < len && ok; k++) {
      char b[8];
      snprintf(b, sizeof b, "<0x%02X>", (uint8_t)sym[k]);
      if (emit(user, htab_get(&t->encoder, b, 6)) != 0) return -1;
    }
    if (ok) return 0;
  }
  if (t->unk >= 0) return emit(user, t->unk);
  return zt_err("symbol \"%.*s\" is not in the vocabulary", (int)ZT_MIN(len, 200), sym);
}

/* Encodes one pre-token (n bytes): repeatedly take the adjacent pair of
 * lowest rank and merge every occurrence of it (encoder.py's bpe(); the
 * same result as Hugging Face's merge of the lowest-ranked leftmost pair
 * one at a time). With ignore_merges, a pre-token the vocabulary has
 * whole is that token. */
static int bpe_encode(zt_tok_t *t, const uint8_t *s, size_t n, zt_tok_emit_fn emit, void *user) {
  bpe_reserve(t, n);
  size_t nsym = 0, off = 0;
  for (size_t i = 0; i < n; i++) {
    size_t l = strlen(t->byte_str[s[i]]);
    memcpy(t->mapped + off, t->byte_str[s[i]], l);
    t->sym_off[nsym] = off;
    t->sym_len[nsym++] = l;
    off += l;
  }
  if (t->ignore_merges && nsym > 1) {
    int id = htab_get(&t->encoder, t->mapped, off);
    if (id >= 0) return emit(user, id);
  }
  while (nsym > 1) {
    int best = -1;
    size_t at = 0;
    for (size_t i = 0; i + 1 < nsym; i++) {
      int r = pair_rank(t, i);
      if (r >= 0 && (best < 0 || r < best)) best = r, at = i;
    }
    if (best < 0) break;
    nsym = merge_pair(t, nsym, at);
  }
  for (size_t i = 0; i < nsym; i++)
    if (emit_symbol(t, t->mapped + t->sym_off[i], t->sym_len[i], emit, user) != 0) return -1;
  return 0;
}

static int hf_encode(zt_tok_t *t, const uint8_t *s, size_t n, zt_tok_emit_fn emit, void *user);

int zt_tok_encode(zt_tok_t *t, const void *text, size_t len, zt_tok_emit_fn emit, void *user) {
  const uint8_t *s = text;
  if (t->type == ZT_TOK_BYTE) {
    for (size_t k = 0; k < len; k++)
      if (emit(user, s[k]) != 0) return -1;
    return 0;
  }
  if (t->type == ZT_TOK_HF) return hf_encode(t, s, len, emit, user);
  for (size_t k = 0; k < len;) {
    size_t e = pretok_end(t, s, len, k);
    if (bpe_encode(t, s + k, e - k, emit, user) != 0) return -1;
    k = e;
  }
  return 0;
}

typedef struct {
  int *ids;
  size_t n, cap;
} id_list;

static int push_id(void *user, int id) {
  id_list *l = user;
  if (l->n == l->cap) {
    l->cap = l->cap ? 2 * l->cap : 64;
    l->ids = zt_xrealloc(l->ids, l->cap * sizeof(int));
  }
  l->ids[l->n++] = id;
  return 0;
}

int zt_tok_encode_ids(zt_tok_t *t, const void *text, size_t len, int **ids, size_t *n) {
  id_list l = {zt_xmalloc(sizeof(int)), 0, 1};
  if (zt_tok_encode(t, text, len, push_id, &l) != 0) {
    free(l.ids);
    return -1;
  }
  *ids = l.ids;
  *n = l.n;
  return 0;
}

/* ---- Hugging Face tokenizer.json: encoding ---------------------------------- */

/* Whitespace as JavaScript's trim() and Hugging Face's lstrip/rstrip see
 * it: White_Space and U+FEFF. */
static int strip_space(uint32_t cp) {
  return cp == ' ' || (cp >= '\t' && cp <= '\r') || cp == 0xfeff || is_unicode_space(cp);
}

static size_t trim_start(const uint8_t *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint32_t cp;
    size_t l = utf8_decode(s, n, i, &cp);
    if (!strip_space(cp)) break;
    i += l;
  }
  return i;
}

static size_t trim_end(const uint8_t *s, size_t n) {
  while (n > 0) {
    size_t b = n - 1;
    while (b > 0 && (s[b] & 0xc0) == 0x80 && n - b < 4) b--;
    uint32_t cp;
    if (utf8_decode(s, n, b, &cp) != n - b || !strip_space(cp)) break;
    n = b;
  }
  return n;
}

/* The added token (normalized or not) that starts at s[i], the longest
 * (the list is sorted longest first), or -1. */
static int added_at(const zt_tok_t *t, const uint8_t *s, size_t n, size_t i, int normalized) {
  for (int k = 0; k < t->n_added; k++) {
    const zt_added_t *a = &t->added[k];
    if (a->normalized == normalized && a->len <= n - i && s[i] == (uint8_t)a->text[0] &&
        !memcmp(s + i, a->text, a->len))
      return k;
  }
  return -1;
}

/* ByteLevel on a piece that has its prefix space: split by GPT-2's
 * pattern when use_regex is set, each part merged. */
static int byte_level_split(zt_tok_t *t, const uint8_t *s, size_t n, zt_tok_emit_fn emit,
                            void *user) {
  if (!t->bl_regex) return n ? bpe_encode(t, s, n, emit, user) : 0;
  for (size_t at = 0; at < n;) {
    int rc = pcre2_match(t->bl_regex, s, n, at, PCRE2_NO_UTF_CHECK, t->md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) return zt_err("tokenizer: ByteLevel pattern: PCRE2 error %d", rc);
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(t->md);
    if (ov[1] > ov[0] && bpe_encode(t, s + ov[0], ov[1] - ov[0], emit, user) != 0) return -1;
    at = ov[1] > at ? ov[1] : at + utf8_decode(s, n, at, &(uint32_t){0});
  }
  return 0;
}

/* ByteLevel: with add_prefix_space a piece that does not start with a
 * space gets one. */
static int byte_level(zt_tok_t *t, const uint8_t *s, size_t n, zt_tok_emit_fn emit, void *user) {
  if (!t->bl_prefix || (n && s[0] == ' ')) return byte_level_split(t, s, n, emit, user);
  uint8_t *p = zt_xmalloc(n + 1);
  p[0] = ' ';
  memcpy(p + 1, s, n);
  int rc = byte_level_split(t, p, n + 1, emit, user);
  free(p);
  return rc;
}

/* The pre-tokenizer on a section: the Split pattern's matches and the text
 * between them are the pieces (Isolated), or only the text between
 * (Removed); then ByteLevel on each. */
static int pre_tokenize(zt_tok_t *t, const uint8_t *s, size_t n, zt_tok_emit_fn emit,
                        void *user) {
  if (!t->split) return byte_level(t, s, n, emit, user);
  size_t prev = 0;
  for (size_t at = 0; at < n;) {
    /* The text is valid UTF-8 (hf_encode): no check of the whole
     * subject at every call, which would make a long text quadratic. */
    int rc = pcre2_match(t->split, s, n, at, PCRE2_NO_UTF_CHECK, t->md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) return zt_err("tokenizer: Split pattern: PCRE2 error %d", rc);
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(t->md);
    size_t ms = ov[0], me = ov[1];
    if (me == ms) { /* an empty match splits nothing */
      at = ms + utf8_decode(s, n, ms, &(uint32_t){0});
      continue;
    }
    if (ms > prev && byte_level(t, s + prev, ms - prev, emit, user) != 0) return -1;
    if (!t->split_removed && byte_level(t, s + ms, me - ms, emit, user) != 0) return -1;
    prev = at = me;
  }
  return prev < n ? byte_level(t, s + prev, n - prev, emit, user) : 0;
}

static int hf_sections(zt_tok_t *t, const uint8_t *s, size_t n, int normalized,
                       zt_tok_emit_fn emit, void *user);

/* A section between added tokens: normalized (NFC) and split again on the
 * normalized added tokens, or pre-tokenized. */
static int hf_text(zt_tok_t *t, const uint8_t *s, size_t n, int normalized, zt_tok_emit_fn emit,
                   void *user) {
  if (n == 0) return 0;
  if (normalized || !t->nfc) return pre_tokenize(t, s, n, emit, user);
  /* By length: a NUL byte in the text is a character like any other. */
  utf8proc_uint8_t *nfc = NULL;
  utf8proc_ssize_t m = utf8proc_map(s, (utf8proc_ssize_t)n, &nfc,
                                    UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  if (m < 0) return zt_err("tokenizer: NFC normalization: %s", utf8proc_errmsg(m));
  int rc = hf_sections(t, nfc, (size_t)m, 1, emit, user);
  free(nfc);
  return rc;
}

/* Splits s at the added tokens of the phase (raw text first, then the
 * normalized text), leftmost and longest first, as Hugging Face does; a
 * token with lstrip (rstrip) takes the whitespace before (after) it. */
static int hf_sections(zt_tok_t *t, const uint8_t *s, size_t n, int normalized,
                       zt_tok_emit_fn emit, void *user) {
  size_t start = 0, i = 0;
  while (i < n) {
    int k = added_at(t, s, n, i, normalized);
    if (k < 0) {
      i++;
      continue;
    }
    const zt_added_t *a = &t->added[k];
    size_t end = a->lstrip ? start + trim_end(s + start, i - start) : i;
    if (hf_text(t, s + start, end - start, normalized, emit, user) != 0) return -1;
    if (emit(user, a->id) != 0) return -1;
    i += a->len;
    if (a->rstrip) i += trim_start(s + i, n - i);
    start = i;
  }
  return hf_text(t, s + start, n - start, normalized, emit, user);
}

/* Text that is not valid UTF-8 gets U+FFFD for each bad byte (as a
 * JavaScript or Python reader of the file would); valid text is encoded
 * as it is. */
static int hf_encode(zt_tok_t *t, const uint8_t *s, size_t n, zt_tok_emit_fn emit, void *user) {
  size_t bad = 0;
  uint32_t cp;
  for (size_t i = 0; i < n;) {
    i += utf8_decode(s, n, i, &cp);
    bad += cp == UINT32_MAX;
  }
  if (!bad) return hf_sections(t, s, n, 0, emit, user);
  uint8_t *fixed = zt_xmalloc(n + 2 * bad + 1);
  size_t o = 0;
  for (size_t i = 0; i < n;) {
    size_t l = utf8_decode(s, n, i, &cp);
    if (cp == UINT32_MAX) memcpy(fixed + o, "\xef\xbf\xbd", 3), o += 3;
    else memcpy(fixed + o, s + i, l), o += l;
    i += l;
  }
  int rc = hf_sections(t, fixed, o, 0, emit, user);
  free(fixed);
  return rc;
}

/* ---- Hugging Face tokenizer.json: loading ------------------------------------ */

static const char *type_of(const cJSON *o) {
  const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
  return cJSON_IsString(ty) ? ty->valuestring : "";
}

static int flag(const cJSON *o, const char *key) {
  return cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, key));
}

/* An Oniguruma pattern (Hugging Face's Rust library) for PCRE2: \s and \S
 * become White_Space and its complement, which is what Oniguruma means by
 * them (PCRE2's \s leaves out U+0085). A literal (PCRE2_LITERAL) is taken
 * as it is. The pattern comes from the file: PCRE2 checks it is UTF-8. */
static pcre2_code *compile_pattern(const char *path, const char *what, const char *pat,
                                   uint32_t opts) {
  size_t n = strlen(pat), o = 0;
  char *re = zt_xmalloc(8 * n + 1);
  for (size_t i = 0; i < n; i++) {
    if (opts & PCRE2_LITERAL) {
      re[o++] = pat[i];
      continue;
    }
    if (pat[i] == '\\' && i + 1 < n && (pat[i + 1] == 's' || pat[i + 1] == 'S')) {
      o += (size_t)sprintf(re + o, "\\%c{White_Space}", pat[i + 1] == 's' ? 'p' : 'P');
      i++;
    } else if (pat[i] == '\\' && i + 1 < n) {
      re[o++] = pat[i++];
      re[o++] = pat[i];
    } else {
      re[o++] = pat[i];
    }
  }
  re[o] = 0;
  int err;
  PCRE2_SIZE at;
  /* A literal has no classes for UCP to widen (PCRE2 refuses the pair). */
  uint32_t ucp = (opts & PCRE2_LITERAL) ? 0 : PCRE2_UCP;
  pcre2_code *c = pcre2_compile((PCRE2_SPTR)re, o, PCRE2_UTF | ucp | opts, &err, &at, NULL);
  if (!c) {
    PCRE2_UCHAR msg[160];
    pcre2_get_error_message(err, msg, sizeof msg);
    zt_err("%s: %s pattern \"%.200s\": %s at offset %zu", path, what, pat, (char *)msg,
           (size_t)at);
  } else {
    (void)pcre2_jit_compile(c, PCRE2_JIT_COMPLETE); /* without the JIT it interprets */
  }
  free(re);
  return c;
}

#define GPT2_PATTERN "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

static int load_split(zt_tok_t *t, const char *path, const cJSON *p) {
  const cJSON *pat = cJSON_GetObjectItemCaseSensitive(p, "pattern");
  const cJSON *re = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
  const cJSON *lit = cJSON_GetObjectItemCaseSensitive(pat, "String");
  const cJSON *beh = cJSON_GetObjectItemCaseSensitive(p, "behavior");
  const char *b = cJSON_IsString(beh) ? beh->valuestring : "";
  if (t->split) return zt_err("%s: pre_tokenizer: more than one Split is not supported", path);
  if (flag(p, "invert")) return zt_err("%s: pre_tokenizer Split: invert is not supported", path);
  if (strcmp(b, "Isolated") && strcmp(b, "Removed"))
    return zt_err("%s: pre_tokenizer Split: behavior \"%.40s\" is not supported (Isolated or "
                  "Removed)", path, b);
  t->split_removed = !strcmp(b, "Removed");
  if (cJSON_IsString(re))
    t->split = compile_pattern(path, "pre_tokenizer Split", re->valuestring, 0);
  else if (cJSON_IsString(lit))
    t->split = compile_pattern(path, "pre_tokenizer Split", lit->valuestring, PCRE2_LITERAL);
  else
    return zt_err("%s: pre_tokenizer Split: needs pattern.Regex or pattern.String", path);
  return t->split ? 0 : -1;
}

static int load_byte_level(zt_tok_t *t, const char *path, const cJSON *p, int *seen) {
  *seen = 1;
  t->bl_prefix = flag(p, "add_prefix_space");
  const cJSON *ur = cJSON_GetObjectItemCaseSensitive(p, "use_regex");
  if (!ur || cJSON_IsTrue(ur)) {
    t->bl_regex = compile_pattern(path, "ByteLevel", GPT2_PATTERN, 0);
    if (!t->bl_regex) return -1;
  }
  return 0;
}

/* pre_tokenizer: ByteLevel, or a Sequence of a Split and a ByteLevel (what
 * Llama 3, Qwen2/3, SmolLM and GPT-2's tokenizer.json use). */
static int load_pre_tokenizer(zt_tok_t *t, const char *path, const cJSON *doc) {
  const cJSON *p = cJSON_GetObjectItemCaseSensitive(doc, "pre_tokenizer");
  const cJSON *seq = !strcmp(type_of(p), "Sequence")
                         ? cJSON_GetObjectItemCaseSensitive(p, "pretokenizers")
                         : NULL;
  int bl = 0;
  const cJSON *it = seq ? seq->child : p;
  for (; it; it = seq ? it->next : NULL) {
    const char *ty = type_of(it);
    if (bl) return zt_err("%s: pre_tokenizer: %s after ByteLevel is not supported", path, ty);
    if (!strcmp(ty, "Split")) {
      if (load_split(t, path, it) != 0) return -1;
    } else if (!strcmp(ty, "ByteLevel")) {
      if (load_byte_level(t, path, it, &bl) != 0) return -1;
    } else {
      return zt_err("%s: pre_tokenizer \"%.60s\" is not supported (byte-level BPE only: "
                    "ByteLevel, optionally after a Split)", path, ty);
    }
  }
  if (!bl) return zt_err("%s: pre_tokenizer: no ByteLevel (byte-level BPE only)", path);
  if (t->bl_prefix && t->split)
    return zt_err("%s: pre_tokenizer: ByteLevel's add_prefix_space after a Split is not "
                  "supported", path);
  return 0;
}

static int load_normalizer(zt_tok_t *t, const char *path, const cJSON *doc) {
  const cJSON *n = cJSON_GetObjectItemCaseSensitive(doc, "normalizer");
  if (!n || cJSON_IsNull(n)) return 0;
  const cJSON *seq = !strcmp(type_of(n), "Sequence")
                         ? cJSON_GetObjectItemCaseSensitive(n, "normalizers")
                         : NULL;
  for (const cJSON *it = seq ? seq->child : n; it; it = seq ? it->next : NULL) {
    if (strcmp(type_of(it), "NFC"))
      return zt_err("%s: normalizer \"%.60s\" is not supported (NFC or none)", path,
                    type_of(it));
    t->nfc = 1;
  }
  return 0;
}

/* An id of the vocabulary: 0 .. ZT_TOK_VOCAB_MAX - 1. */
static int vocab_id(const char *path, const cJSON *v, const char *name) {
  double d = cJSON_IsNumber(v) ? v->valuedouble : -1;
  if (!(d >= 0 && d < ZT_TOK_VOCAB_MAX) || d != floor(d))
    return zt_err("%s: token \"%.60s\" has no id in [0, %d]", path, name,
                  ZT_TOK_VOCAB_MAX - 1);
  return (int)d;
}

static int load_merges_json(zt_tok_t *t, const char *path, const cJSON *merges) {
  int rank = 0;
  char *key = NULL;
  for (const cJSON *it = merges ? merges->child : NULL; it; it = it->next, rank++) {
    const char *a = NULL, *b = NULL;
    if (cJSON_IsString(it)) {
      const char *sp = strchr(it->valuestring, ' ');
      if (sp && sp != it->valuestring && sp[1] && !strchr(sp + 1, ' ')) {
        htab_put(&t->ranks, it->valuestring, strlen(it->valuestring), rank);
        continue;
      }
    } else if (cJSON_GetArraySize(it) == 2 && cJSON_IsString(it->child) &&
               cJSON_IsString(it->child->next)) {
      a = it->child->valuestring, b = it->child->next->valuestring;
    }
    if (!a || !a[0] || !b[0] || strchr(a, ' ') || strchr(b, ' ')) {
      free(key);
      return zt_err("%s: merge %d is not two symbols without spaces", path, rank);
    }
    size_t la = strlen(a), lb = strlen(b);
    key = zt_xrealloc(key, la + lb + 2);
    memcpy(key, a, la);
    key[la] = ' ';
    memcpy(key + la + 1, b, lb);
    htab_put(&t->ranks, key, la + 1 + lb, rank);
  }
  free(key);
  return 0;
}

static int added_longest_first(const void *x, const void *y) {
  const zt_added_t *a = x, *b = y;
  return a->len < b->len ? 1 : a->len > b->len ? -1 : 0;
}

static int load_added(zt_tok_t *t, const char *path, const cJSON *doc) {
  const cJSON *list = cJSON_GetObjectItemCaseSensitive(doc, "added_tokens");
  int n = cJSON_GetArraySize(list);
  t->added = zt_xcalloc((size_t)n + 1, sizeof *t->added);
  for (const cJSON *it = list ? list->child : NULL; it; it = it->next) {
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(it, "content");
    if (!cJSON_IsString(c) || !c->valuestring[0])
      return zt_err("%s: added token %d has no content", path, t->n_added);
    int id = vocab_id(path, cJSON_GetObjectItemCaseSensitive(it, "id"), c->valuestring);
    if (id < 0) return -1;
    if (flag(it, "single_word"))
      return zt_err("%s: added token \"%.60s\": single_word is not supported", path,
                    c->valuestring);
    zt_added_t *a = &t->added[t->n_added++];
    a->text = zt_xstrdup(c->valuestring);
    a->len = strlen(a->text);
    a->id = id;
    const cJSON *norm = cJSON_GetObjectItemCaseSensitive(it, "normalized");
    a->normalized = t->nfc && (norm ? cJSON_IsTrue(norm) : !flag(it, "special"));
    a->lstrip = flag(it, "lstrip");
    a->rstrip = flag(it, "rstrip");
    htab_put(&t->encoder, a->text, a->len, id);
    if (id + 1 > t->vocab) t->vocab = id + 1;
  }
  qsort(t->added, (size_t)t->n_added, sizeof *t->added, added_longest_first);
  return 0;
}

static int load_model(zt_tok_t *t, const char *path, const cJSON *doc) {
  const cJSON *m = cJSON_GetObjectItemCaseSensitive(doc, "model");
  const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(m, "vocab");
  const char *ty = type_of(m);
  if (strcmp(ty, "BPE") && !(ty[0] == 0 && cJSON_GetObjectItemCaseSensitive(m, "merges")))
    return zt_err("%s: model \"%.40s\" is not supported (BPE only)", path, ty);
  if (!cJSON_IsObject(vocab)) return zt_err("%s: model.vocab is not an object", path);
  const char *fields[] = {"continuing_subword_prefix", "end_of_word_suffix"};
  for (int i = 0; i < 2; i++) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(m, fields[i]);
    if (f && !cJSON_IsNull(f) && !(cJSON_IsString(f) && !f->valuestring[0]))
      return zt_err("%s: model.%s is not supported", path, fields[i]);
  }
  const cJSON *drop = cJSON_GetObjectItemCaseSensitive(m, "dropout");
  if (cJSON_IsNumber(drop) && drop->valuedouble != 0)
    return zt_err("%s: model.dropout is not supported", path);
  for (const cJSON *it = vocab->child; it; it = it->next) {
    int id = vocab_id(path, it, it->string);
    if (id < 0) return -1;
    htab_put(&t->encoder, it->string, strlen(it->string), id);
    if (id + 1 > t->vocab) t->vocab = id + 1;
  }
  t->ignore_merges = flag(m, "ignore_merges");
  t->byte_fallback = flag(m, "byte_fallback");
  const cJSON *unk = cJSON_GetObjectItemCaseSensitive(m, "unk_token");
  t->unk = -1;
  if (cJSON_IsString(unk) &&
      (t->unk = htab_get(&t->encoder, unk->valuestring, strlen(unk->valuestring))) < 0)
    return zt_err("%s: model.unk_token \"%.60s\" is not in the vocabulary", path,
                  unk->valuestring);
  return load_merges_json(t, path, cJSON_GetObjectItemCaseSensitive(m, "merges"));
}

/* Decoding: vocabulary strings through the inverse of bytes_to_unicode,
 * added tokens as their text. */
static void hf_decoder(zt_tok_t *t, const cJSON *doc, const int inv[512]) {
  t->dec = zt_xcalloc((size_t)t->vocab + 1, sizeof(char *));
  t->dec_len = zt_xcalloc((size_t)t->vocab + 1, sizeof(size_t));
  const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(doc, "model"), "vocab");
  for (const cJSON *it = vocab->child; it; it = it->next)
    decode_entry(t, inv, it->string, it->valueint);
  for (int i = 0; i < t->n_added; i++) {
    zt_added_t *a = &t->added[i];
    free(t->dec[a->id]);
    t->dec[a->id] = zt_xstrdup(a->text);
    t->dec_len[a->id] = a->len;
  }
}

/* The end-of-text token: eot_text, or the first of the usual names the
 * tokenizer has. */
static int hf_eot(zt_tok_t *t, const char *path, const char *eot_text) {
  static const char *names[] = {"<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>",
                                "<eos>"};
  if (eot_text) {
    t->eot = htab_get(&t->encoder, eot_text, strlen(eot_text));
    return t->eot < 0 ? zt_err("%s: no token \"%.60s\" for the end of text", path, eot_text) : 0;
  }
  for (size_t i = 0; i < ZT_ARRAY_LEN(names); i++)
    if ((t->eot = htab_get(&t->encoder, names[i], strlen(names[i]))) >= 0) return 0;
  return zt_err("%s: none of <|endoftext|>, <|end_of_text|>, </s>, <|im_end|>, <eos> is a token: "
                "name the end-of-text token (zprep --eot)", path);
}

/* The TemplateProcessing among a post_processor (itself, or one of a
 * Sequence's processors), or NULL. */
static const cJSON *hf_template(const cJSON *pp, int depth) {
  const cJSON *type = cJSON_GetObjectItemCaseSensitive(pp, "type"), *it;
  if (!cJSON_IsString(type) || depth > 4) return NULL;
  if (!strcmp(type->valuestring, "TemplateProcessing")) return pp;
  if (strcmp(type->valuestring, "Sequence")) return NULL;
  cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(pp, "processors")) {
    const cJSON *t = hf_template(it, depth + 1);
    if (t) return t;
  }
  return NULL;
}

/* The beginning-of-sequence token: the special token a single sequence's
 * template starts with (Llama 3's <|begin_of_text|>), when there is one
 * and it is in the vocabulary; else the end-of-text token, which separates
 * documents in our shards (GPT-2's and Qwen2's convention). */
static void hf_bos(zt_tok_t *t, const cJSON *doc) {
  t->bos = t->eot;
  const cJSON *tp = hf_template(cJSON_GetObjectItemCaseSensitive(doc, "post_processor"), 0);
  const cJSON *first = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(tp, "single"), 0);
  const cJSON *st = cJSON_GetObjectItemCaseSensitive(first, "SpecialToken");
  const cJSON *name = cJSON_GetObjectItemCaseSensitive(st, "id");
  if (!cJSON_IsString(name)) return;
  const cJSON *sp = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(tp,
                                                                                      "special_tokens"),
                                                     name->valuestring);
  const cJSON *id = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(sp, "ids"), 0);
  if (cJSON_IsNumber(id) && id->valuedouble >= 0 && id->valuedouble < t->vocab)
    t->bos = (int)id->valuedouble;
}

int zt_tok_open_hf(const char *path, const char *eot_text, zt_tok_t **out) {
  char *buf;
  size_t len;
  *out = NULL;
  if (zt_read_file(path, &buf, &len, ZT_TOK_FILE_MAX) != 0) return -1;
  cJSON *doc = zt_json_parse(buf, len, path);
  free(buf);
  if (!doc) return -1;
  zt_tok_t *t = zt_xcalloc(1, sizeof *t);
  t->type = ZT_TOK_HF;
  int inv[512];
  bytes_to_unicode(t, inv);
  int rc = load_normalizer(t, path, doc);
  if (rc == 0) rc = load_pre_tokenizer(t, path, doc);
  if (rc == 0) rc = load_model(t, path, doc);
  if (rc == 0) rc = load_added(t, path, doc);
  if (rc == 0) rc = hf_eot(t, path, eot_text);
  if (rc == 0) {
    hf_bos(t, doc);
    hf_decoder(t, doc, inv);
    t->md = pcre2_match_data_create(4, NULL);
  }
  cJSON_Delete(doc);
  if (rc != 0) {
    zt_tok_free(t);
    return -1;
  }
  *out = t;
  return 0;
}

/* ---- the record ---------------------------------------------------------------- */

/* An integer member in [lo, hi], or -1 (*ok cleared). The double is
 * checked before it is converted: converting one outside int's range
 * (1e10) is undefined. */
static int int_member(const cJSON *o, const char *key, int lo, int hi, int *ok) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
  if (!(d >= lo && d <= hi) || d != floor(d)) {
    *ok = 0;
    return -1;
  }
  return (int)d;
}

/* A file name member: a plain name beside the record. */
static const char *name_member(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!cJSON_IsString(v)) return NULL;
  const char *s = v->valuestring;
  if (!s[0] || strchr(s, '/') || !strcmp(s, ".") || !strcmp(s, "..") || strlen(s) > 255)
    return NULL;
  return s;
}

/* The path of a file the record names beside itself. */
static int beside(const char *path, const char *name, char *out, size_t cap) {
  if (strlen(path) > 4000) return zt_err("%s: path too long", path);
  const char *slash = strrchr(path, '/');
  int dl = slash ? (int)(slash - path) : 1;
  snprintf(out, cap, "%.*s/%s", dl, slash ? path : ".", name);
  return 0;
}

static int gpt2_paths(const char *path, const cJSON *doc, zt_tok_record_t *r) {
  const char *enc = name_member(doc, "encoder"), *bpe = name_member(doc, "bpe");
  if (!enc || !bpe)
    return zt_err("%s: \"encoder\" and \"bpe\" must be file names beside the record", path);
  if (beside(path, enc, r->encoder, sizeof r->encoder) != 0) return -1;
  return beside(path, bpe, r->bpe, sizeof r->bpe);
}

static int check_record(const char *path, const cJSON *doc, zt_tok_record_t *r) {
  const cJSON *type = cJSON_GetObjectItemCaseSensitive(doc, "type");
  int ok = 1;
  r->vocab_size = int_member(doc, "vocab_size", 1, ZT_TOK_VOCAB_MAX, &ok);
  r->eot = int_member(doc, "eot", 0, ZT_TOK_VOCAB_MAX - 1, &ok);
  const char *ty = cJSON_IsString(type) ? type->valuestring : "";
  if (!ok || r->eot >= r->vocab_size ||
      (strcmp(ty, "byte") && strcmp(ty, "gpt2") && strcmp(ty, "hf")))
    return zt_err("tokenizer record %s: needs \"type\" (byte, gpt2 or hf), \"vocab_size\" "
                  "(1..%d) and \"eot\" (an id below vocab_size)", path, ZT_TOK_VOCAB_MAX);
  snprintf(r->type, sizeof r->type, "%s", ty);
  if (!strcmp(ty, "byte") && (r->vocab_size != 257 || r->eot != 256))
    return zt_err("tokenizer record %s: a byte tokenizer has vocab_size 257 and eot 256 (the "
                  "record says %d and %d)", path, r->vocab_size, r->eot);
  if (!strcmp(ty, "gpt2") && gpt2_paths(path, doc, r) != 0)
    return zt_err_wrap("tokenizer record");
  if (!strcmp(ty, "hf")) {
    const char *f = name_member(doc, "file");
    if (!f) return zt_err("tokenizer record %s: \"file\" must be a file name beside it", path);
    if (beside(path, f, r->hf, sizeof r->hf) != 0) return zt_err_wrap("tokenizer record");
  }
  return 0;
}

int zt_tok_read_record(const char *path, zt_tok_record_t *r) {
  char *text;
  size_t len;
  memset(r, 0, sizeof *r);
  if (zt_read_file(path, &text, &len, ZT_TOK_RECORD_MAX) != 0)
    return zt_err_wrap("tokenizer record");
  cJSON *doc = zt_json_parse(text, len, path);
  free(text);
  if (!doc) return zt_err_wrap("tokenizer record");
  int rc = check_record(path, doc, r);
  cJSON_Delete(doc);
  return rc;
}

int zt_tok_open(const char *path, zt_tok_t **out) {
  zt_tok_record_t r;
  *out = NULL;
  if (zt_tok_read_record(path, &r) != 0) return -1;
  if (!strcmp(r.type, "byte")) return zt_tok_open_byte(out);
  if (!strcmp(r.type, "hf")) {
    if (zt_tok_open_hf(r.hf, NULL, out) != 0) return zt_err_wrap("tokenizer record: %s", path);
    const char *b;
    size_t l;
    if (r.eot < (*out)->vocab && zt_tok_decode(*out, r.eot, &b, &l) == 0) {
      if ((*out)->bos == (*out)->eot) (*out)->bos = r.eot; /* no template of its own */
      (*out)->eot = r.eot;
    }
  } else if (zt_tok_open_gpt2(r.encoder, r.bpe, out) != 0) {
    return zt_err_wrap("tokenizer record: %s", path);
  }
  if ((*out)->vocab != r.vocab_size || (*out)->eot != r.eot) {
    zt_err("tokenizer record %s says vocab_size %d and eot %d, its encoder has %d and %d", path,
           r.vocab_size, r.eot, (*out)->vocab, (*out)->eot);
    zt_tok_free(*out);
    *out = NULL;
    return -1;
  }
  return 0;
}

int zt_tok_record_for_shard(const char *shard, char *out, size_t cap) {
  const char *base = strrchr(shard, '/');
  base = base ? base + 1 : shard;
  size_t bl = strlen(base);
  const char *mark = NULL;
  for (const char *p = base; *p; p++)
    if ((p == base || p[-1] == '_') && (!strncmp(p, "train_", 6) || !strncmp(p, "val_", 4)))
      mark = p;
  if (!mark || bl < 4 || strcmp(base + bl - 4, ".bin") != 0)
    return zt_err("%s: not a shard name of the form PREFIX_train_*.bin or PREFIX_val_*.bin",
                  shard);
  int n = snprintf(out, cap, "%.*stokenizer.json", (int)(mark - shard), shard);
  if (n < 0 || (size_t)n >= cap) return zt_err("%s: path too long", shard);
  return 0;
}
