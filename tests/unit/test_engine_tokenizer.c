/*
 * test_engine_tokenizer.c: engine/tokenizer.c, both tokenizers both ways,
 * the tokenizer record and the shard -> record name mapping.
 *
 * The GPT-2 case uses a hand-made vocabulary in GPT-2's formats: the 256
 * byte characters of bytes_to_unicode as ids 0..255 (computed here
 * independently), five merges ("h e", "l l", "he ll", "hell o", "Ġ w")
 * giving ids 256..260, and <|endoftext|> = 261. The expected ids follow
 * encoder.py's algorithm by hand; decoding any bytes' ids must give the
 * bytes back (accents, invalid UTF-8, NUL, whitespace runs).
 *
 * The tokenizer.json case (hf) is as small, written here; the real Llama 3
 * and Qwen3 files are checked against Hugging Face's own encoder in
 * tests/integration/test_hftok.py.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"
#include "zt_common.h"
#include "zt_test.h"

static char tmp[600];

static void write_text(const char *name, const char *text) {
  char path[800];
  snprintf(path, sizeof path, "%s/%s", tmp, name);
  FILE *f = fopen(path, "w");
  if (!f) abort();
  fputs(text, f);
  fclose(f);
}

static const char *path_of(const char *name) {
  static char path[800];
  snprintf(path, sizeof path, "%s/%s", tmp, name);
  return path;
}

/* GPT-2's bytes_to_unicode, UTF-8 encoded. */
static void byte_char(int b, char out[3]) {
  int n = 0, cp = b;
  for (int x = 0; x <= b; x++) {
    int pr = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
    if (!pr && x == b) cp = 256 + n;
    n += !pr;
  }
  if (cp < 0x80) out[0] = (char)cp, out[1] = 0;
  else out[0] = (char)(0xC0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 0x3F)), out[2] = 0;
}

static void write_gpt2_files(void) {
  cJSON *enc = cJSON_CreateObject();
  char ch[3];
  for (int b = 0; b < 256; b++) {
    byte_char(b, ch);
    cJSON_AddNumberToObject(enc, ch, b);
  }
  const char *merged[] = {"he", "ll", "hell", "hello", "\xc4\xa0w"};
  for (int i = 0; i < 5; i++) cJSON_AddNumberToObject(enc, merged[i], 256 + i);
  cJSON_AddNumberToObject(enc, "<|endoftext|>", 261);
  char *text = cJSON_Print(enc);
  write_text("t_encoder.json", text);
  free(text);
  cJSON_Delete(enc);
  write_text("t_vocab.bpe", "#version: 0.2\nh e\nl l\nhe ll\nhell o\n\xc4\xa0 w\n");
}

static void ids_are(zt_tok_t *t, const char *text, const int *want, size_t nwant) {
  int *ids = NULL;
  size_t n = 0;
  ZT_REQUIRE(zt_tok_encode_ids(t, text, strlen(text), &ids, &n) == 0);
  ZT_CHECK(n == nwant);
  for (size_t i = 0; i < n && i < nwant; i++) ZT_CHECK(ids[i] == want[i]);
  free(ids);
}

/* encode, then decode every id: the same bytes. */
static void round_trip(zt_tok_t *t, const char *text, size_t len) {
  int *ids = NULL;
  size_t n = 0;
  ZT_REQUIRE(zt_tok_encode_ids(t, text, len, &ids, &n) == 0);
  char *back = malloc(len * 4 + 16);
  size_t at = 0;
  for (size_t i = 0; i < n; i++) {
    const char *b;
    size_t l;
    ZT_REQUIRE(zt_tok_decode(t, ids[i], &b, &l) == 0);
    memcpy(back + at, b, l);
    at += l;
  }
  ZT_CHECK(at == len && memcmp(back, text, len) == 0);
  free(back);
  free(ids);
}

static const char k_text[] = "h\xc3\xa9llo wörld\xff\x00 \t\n\n  x'll 123 hello hello";

ZT_TEST(byte_tokenizer) {
  zt_tok_t *t;
  ZT_REQUIRE(zt_tok_open_byte(&t) == 0);
  ZT_CHECK(zt_tok_type(t) == ZT_TOK_BYTE && !strcmp(zt_tok_type_name(t), "byte"));
  ZT_CHECK(zt_tok_vocab_size(t) == 257 && zt_tok_eot(t) == 256 && zt_tok_bos(t) == 256);
  int want[] = {'h', 0xc3, 0xa9, 0};
  ids_are(t, "h\xc3\xa9", want, 3);
  round_trip(t, k_text, sizeof k_text - 1);
  char all[256];
  for (int b = 0; b < 256; b++) all[b] = (char)b;
  round_trip(t, all, 256);
  const char *b;
  size_t l;
  ZT_CHECK(zt_tok_decode(t, 256, &b, &l) == 0 && l == 13 && !memcmp(b, "<|endoftext|>", 13));
  ZT_CHECK(zt_tok_decode(t, 257, &b, &l) == -1);
  ZT_CHECK(zt_tok_decode(t, -1, &b, &l) == -1);
  zt_tok_free(t);
}

static void check_gpt2(zt_tok_t *t) {
  ZT_CHECK(zt_tok_type(t) == ZT_TOK_GPT2 && !strcmp(zt_tok_type_name(t), "gpt2"));
  ZT_CHECK(zt_tok_vocab_size(t) == 262 && zt_tok_eot(t) == 261);
  int hello[] = {259};
  ids_are(t, "hello", hello, 1);
  int two[] = {259, ' ', 259}; /* " hello" is Ġ + hello: no "Ġ hello" merge */
  ids_are(t, "hello hello", two, 3);
  int world[] = {260, 'o', 'r', 'l', 'd'};
  ids_are(t, " world", world, 5);
  int help[] = {256, 'l', 'p'}; /* "l l" needs two l's */
  ids_are(t, "help", help, 3);
  round_trip(t, k_text, sizeof k_text - 1);
  char all[256];
  for (int b = 0; b < 256; b++) all[b] = (char)b;
  round_trip(t, all, 256);
  const char *b;
  size_t l;
  ZT_CHECK(zt_tok_decode(t, 258, &b, &l) == 0 && l == 4 && !memcmp(b, "hell", 4));
  ZT_CHECK(zt_tok_decode(t, 260, &b, &l) == 0 && l == 2 && !memcmp(b, " w", 2));
  ZT_CHECK(zt_tok_decode(t, 261, &b, &l) == 0 && l == 13 && !memcmp(b, "<|endoftext|>", 13));
  ZT_CHECK(zt_tok_decode(t, 262, &b, &l) == -1);
}

ZT_TEST(gpt2_files) {
  write_gpt2_files();
  zt_tok_t *t;
  char enc[800], bpe[800];
  snprintf(enc, sizeof enc, "%s", path_of("t_encoder.json"));
  snprintf(bpe, sizeof bpe, "%s", path_of("t_vocab.bpe"));
  ZT_REQUIRE(zt_tok_open_gpt2(enc, bpe, &t) == 0);
  check_gpt2(t);
  zt_tok_free(t);
}

ZT_TEST(gpt2_record) {
  write_gpt2_files();
  write_text("t_tokenizer.json", "{\"type\":\"gpt2\",\"vocab_size\":262,\"eot\":261,"
                                 "\"encoder\":\"t_encoder.json\",\"bpe\":\"t_vocab.bpe\"}\n");
  zt_tok_t *t;
  ZT_REQUIRE(zt_tok_open(path_of("t_tokenizer.json"), &t) == 0);
  check_gpt2(t);
  zt_tok_free(t);
}

/* A record that must be refused, with a message containing `want`. */
static void refused(const char *record, const char *want) {
  zt_tok_t *t = (zt_tok_t *)1;
  if (record) write_text("bad.json", record);
  int rc = zt_tok_open(path_of(record ? "bad.json" : "missing.json"), &t);
  ZT_CHECK(rc == -1 && t == NULL);
  if (!strstr(zt_err_msg(), want) || strchr(zt_err_msg(), '\n'))
    fprintf(stderr, "  record %s: message \"%s\" lacks \"%s\"\n", record ? record : "(missing)",
            zt_err_msg(), want);
  ZT_CHECK(strstr(zt_err_msg(), want) != NULL);
}

ZT_TEST(bad_records) {
  write_gpt2_files();
  refused(NULL, "missing.json");
  refused("{\"type\":\"byte\"", "not valid JSON");
  refused("[1,2]", "needs \"type\"");
  refused("{\"type\":\"byte\",\"vocab_size\":257}", "needs \"type\"");
  refused("{\"type\":\"bpe\",\"vocab_size\":257,\"eot\":256}", "needs \"type\"");
  refused("{\"type\":\"byte\",\"vocab_size\":257,\"eot\":257}", "needs \"type\"");
  refused("{\"type\":\"byte\",\"vocab_size\":257.5,\"eot\":256}", "needs \"type\"");
  refused("{\"type\":\"byte\",\"vocab_size\":1e10,\"eot\":256}", "needs \"type\"");
  refused("{\"type\":\"byte\",\"vocab_size\":300,\"eot\":256}", "vocab_size 257 and eot 256");
  refused("{\"type\":\"gpt2\",\"vocab_size\":262,\"eot\":261}", "\"encoder\" and \"bpe\"");
  refused("{\"type\":\"gpt2\",\"vocab_size\":262,\"eot\":261,\"encoder\":\"../t_encoder.json\","
          "\"bpe\":\"t_vocab.bpe\"}",
          "file names beside the record");
  refused("{\"type\":\"gpt2\",\"vocab_size\":262,\"eot\":261,\"encoder\":\"nope.json\","
          "\"bpe\":\"t_vocab.bpe\"}",
          "nope.json");
  refused("{\"type\":\"gpt2\",\"vocab_size\":300,\"eot\":261,\"encoder\":\"t_encoder.json\","
          "\"bpe\":\"t_vocab.bpe\"}",
          "its encoder has 262 and 261");
  write_text("e2.json", "{\"a\": 1, \"b\": \"x\"}");
  refused("{\"type\":\"gpt2\",\"vocab_size\":2,\"eot\":1,\"encoder\":\"e2.json\","
          "\"bpe\":\"t_vocab.bpe\"}",
          "has no id");
  write_text("e3.json", "{\"a\": 1}");
  refused("{\"type\":\"gpt2\",\"vocab_size\":2,\"eot\":1,\"encoder\":\"e3.json\","
          "\"bpe\":\"t_vocab.bpe\"}",
          "no \"<|endoftext|>\"");
  write_text("b2.bpe", "h e\nnospace\n");
  refused("{\"type\":\"gpt2\",\"vocab_size\":262,\"eot\":261,\"encoder\":\"t_encoder.json\","
          "\"bpe\":\"b2.bpe\"}",
          "bad merge line");
}

static void maps(const char *shard, const char *want) {
  char out[256];
  int rc = zt_tok_record_for_shard(shard, out, sizeof out);
  if (!want) {
    ZT_CHECK(rc == -1);
    return;
  }
  ZT_CHECK(rc == 0);
  if (rc == 0) ZT_CHECK_STR(out, want);
}

ZT_TEST(record_for_shard) {
  maps("/d/x/fortunes_train_000000.bin", "/d/x/fortunes_tokenizer.json");
  maps("/d/x/fortunes_train_*.bin", "/d/x/fortunes_tokenizer.json");
  maps("data/f_val_000003.bin", "data/f_tokenizer.json");
  maps("/d/train_000000.bin", "/d/tokenizer.json");
  maps("val_*.bin", "tokenizer.json");
  maps("/d/my_val_set_train_000001.bin", "/d/my_val_set_tokenizer.json");
  maps("/d/x/fortunes_000000.bin", NULL);
  maps("/d/x/retrain_000000.bin", NULL);
  maps("/d/x/f_train_000000.txt", NULL);
  maps("/d/train_x/f.bin", NULL);
  char small[8];
  ZT_CHECK(zt_tok_record_for_shard("/data/f_train_0.bin", small, sizeof small) == -1);
}

/* ---- Hugging Face tokenizer.json ---------------------------------------------- */

/* A small byte-level BPE tokenizer.json: the 256 byte characters as ids
 * 0..255 (but 'z', which only byte_fallback's <0x7A> = 263 covers), merges
 * he ll hell hello (256..259), "Ġworld" (260) whole but with no merges
 * (ignore_merges finds it), <|endoftext|> (261, special) and <x> (262,
 * lstrip and rstrip); NFC, a Split of " ?\p{L}+|\s+|\p{N}", ByteLevel. */
static void write_hf_json(const char *name, const char *pre_tokenizer_type) {
  cJSON *d = cJSON_CreateObject(), *m = cJSON_CreateObject(), *v = cJSON_CreateObject();
  char ch[3];
  for (int b = 0; b < 256; b++) {
    byte_char(b, ch);
    if (b != 'z') cJSON_AddNumberToObject(v, ch, b);
  }
  const char *merged[] = {"he", "ll", "hell", "hello", "\xc4\xa0world", "<|endoftext|>", "<x>",
                          "<0x7A>"};
  for (int i = 0; i < 8; i++) cJSON_AddNumberToObject(v, merged[i], 256 + i);
  cJSON_AddStringToObject(m, "type", "BPE");
  cJSON_AddItemToObject(m, "vocab", v);
  const char *merges[] = {"h e", "l l", "he ll", "hell o"};
  cJSON_AddItemToObject(m, "merges", cJSON_CreateStringArray(merges, 4));
  cJSON_AddTrueToObject(m, "ignore_merges");
  cJSON_AddTrueToObject(m, "byte_fallback");
  cJSON_AddItemToObject(d, "model", m);
  cJSON *n = cJSON_AddObjectToObject(d, "normalizer");
  cJSON_AddStringToObject(n, "type", "NFC");
  cJSON *seq = cJSON_AddObjectToObject(d, "pre_tokenizer");
  cJSON_AddStringToObject(seq, "type", "Sequence");
  cJSON *list = cJSON_AddArrayToObject(seq, "pretokenizers"), *sp = cJSON_CreateObject();
  cJSON_AddStringToObject(sp, "type", pre_tokenizer_type);
  cJSON_AddStringToObject(cJSON_AddObjectToObject(sp, "pattern"), "Regex",
                          " ?\\p{L}+|\\s+|\\p{N}");
  cJSON_AddStringToObject(sp, "behavior", "Isolated");
  cJSON_AddItemToArray(list, sp);
  cJSON *bl = cJSON_CreateObject();
  cJSON_AddStringToObject(bl, "type", "ByteLevel");
  cJSON_AddFalseToObject(bl, "use_regex");
  cJSON_AddItemToArray(list, bl);
  cJSON *added = cJSON_AddArrayToObject(d, "added_tokens");
  for (int i = 0; i < 2; i++) {
    cJSON *a = cJSON_CreateObject();
    cJSON_AddNumberToObject(a, "id", 261 + i);
    cJSON_AddStringToObject(a, "content", i ? "<x>" : "<|endoftext|>");
    cJSON_AddBoolToObject(a, "special", !i);
    cJSON_AddBoolToObject(a, "lstrip", i);
    cJSON_AddBoolToObject(a, "rstrip", i);
    cJSON_AddItemToArray(added, a);
  }
  /* Llama 3's post-processor: a sequence starts with a special token (<x>
   * here), inside a Sequence beside ByteLevel. */
  cJSON *pp = cJSON_AddObjectToObject(d, "post_processor"), *procs;
  cJSON_AddStringToObject(pp, "type", "Sequence");
  procs = cJSON_AddArrayToObject(pp, "processors");
  cJSON *blp = cJSON_CreateObject(), *tp = cJSON_CreateObject();
  cJSON_AddStringToObject(blp, "type", "ByteLevel");
  cJSON_AddItemToArray(procs, blp);
  cJSON_AddStringToObject(tp, "type", "TemplateProcessing");
  cJSON *single = cJSON_AddArrayToObject(tp, "single"), *first = cJSON_CreateObject();
  cJSON_AddStringToObject(cJSON_AddObjectToObject(first, "SpecialToken"), "id", "<x>");
  cJSON_AddItemToArray(single, first);
  cJSON *ids = cJSON_AddArrayToObject(
      cJSON_AddObjectToObject(cJSON_AddObjectToObject(tp, "special_tokens"), "<x>"), "ids");
  cJSON_AddItemToArray(ids, cJSON_CreateNumber(262));
  cJSON_AddItemToArray(procs, tp);
  char *text = cJSON_Print(d);
  write_text(name, text);
  free(text);
  cJSON_Delete(d);
}

ZT_TEST(hf_tokenizer_json) {
  write_hf_json("hf.json", "Split");
  zt_tok_t *t;
  ZT_REQUIRE(zt_tok_open_hf(path_of("hf.json"), NULL, &t) == 0);
  ZT_CHECK(zt_tok_type(t) == ZT_TOK_HF && !strcmp(zt_tok_type_name(t), "hf"));
  ZT_CHECK(zt_tok_vocab_size(t) == 264 && zt_tok_eot(t) == 261);
  ZT_CHECK(zt_tok_bos(t) == 262); /* the template's first special token */
  int hello[] = {259, 260}; /* " world" whole by ignore_merges */
  ids_are(t, "hello world", hello, 2);
  int z[] = {263, 263}; /* no 'z' but its byte's token */
  ids_are(t, "zz", z, 2);
  int x[] = {259, 262, 259, 261, 'a'}; /* <x> takes the spaces around it */
  ids_are(t, "hello  <x>\thello<|endoftext|>a", x, 5);
  int nfc[] = {'c', 0xc3, 0xa9}; /* e + U+0301 composes to U+00E9 (bytes C3 A9) */
  ids_are(t, "ce\xcc\x81", nfc, 3);
  int digits[] = {'1', '2'}; /* \p{N}: one digit a piece */
  ids_are(t, "12", digits, 2);
  const char *b;
  size_t l;
  ZT_CHECK(zt_tok_decode(t, 260, &b, &l) == 0 && l == 6 && !memcmp(b, " world", 6));
  ZT_CHECK(zt_tok_decode(t, 262, &b, &l) == 0 && l == 3 && !memcmp(b, "<x>", 3));
  int *ids = NULL;
  size_t n = 0;
  ZT_CHECK(zt_tok_encode_ids(t, "\xff", 1, &ids, &n) == 0 && n == 3); /* U+FFFD's 3 bytes */
  free(ids);
  zt_tok_free(t);
  ZT_REQUIRE(zt_tok_open_hf(path_of("hf.json"), "<x>", &t) == 0);
  ZT_CHECK(zt_tok_eot(t) == 262);
  zt_tok_free(t);
  t = NULL;
  ZT_CHECK(zt_tok_open_hf(path_of("hf.json"), "<y>", &t) == -1 && !t);
  ZT_CHECK(strstr(zt_err_msg(), "<y>") != NULL);
  write_text("hf_tokenizer.json", "{\"type\":\"hf\",\"vocab_size\":264,\"eot\":262,"
                                  "\"file\":\"hf.json\"}\n");
  ZT_REQUIRE(zt_tok_open(path_of("hf_tokenizer.json"), &t) == 0);
  ZT_CHECK(zt_tok_eot(t) == 262 && zt_tok_vocab_size(t) == 264);
  zt_tok_free(t);
  write_hf_json("hf_bad.json", "Digits");
  t = NULL;
  ZT_CHECK(zt_tok_open_hf(path_of("hf_bad.json"), NULL, &t) == -1 && !t);
  ZT_CHECK(strstr(zt_err_msg(), "pre_tokenizer \"Digits\" is not supported") != NULL);
}

/* hf.json with its Split pattern replaced: {key: pattern}, behavior. */
static void write_hf_split(const char *name, const char *key, const char *pattern,
                           const char *behavior) {
  char *text;
  size_t len;
  ZT_REQUIRE(zt_read_file(path_of("hf.json"), &text, &len, 1 << 24) == 0);
  cJSON *d = cJSON_ParseWithLength(text, len);
  free(text);
  ZT_REQUIRE(d != NULL);
  cJSON *sp = cJSON_GetArrayItem(
      cJSON_GetObjectItem(cJSON_GetObjectItem(d, "pre_tokenizer"), "pretokenizers"), 0);
  cJSON *pat = cJSON_CreateObject();
  cJSON_AddStringToObject(pat, key, pattern);
  cJSON_ReplaceItemInObject(sp, "pattern", pat);
  cJSON_ReplaceItemInObject(sp, "behavior", cJSON_CreateString(behavior));
  char *out = cJSON_Print(d);
  write_text(name, out);
  free(out);
  cJSON_Delete(d);
}

/* What a file or a text can hold that a careless reader would get wrong: a
 * NUL byte in the text (normalized by length, not cut there), a literal
 * Split pattern (taken as it is, not as a regex), a pattern that is not
 * UTF-8 (refused, naming the pattern). */
ZT_TEST(hf_tokenizer_json_edges) {
  write_hf_json("hf.json", "Split");
  zt_tok_t *t;
  ZT_REQUIRE(zt_tok_open_hf(path_of("hf.json"), NULL, &t) == 0);
  int *ids = NULL;
  size_t n = 0;
  ZT_REQUIRE(zt_tok_encode_ids(t, "a\0b", 3, &ids, &n) == 0);
  ZT_CHECK(n == 3 && ids[0] == 'a' && ids[1] == 0 && ids[2] == 'b');
  free(ids);
  zt_tok_free(t);
  write_hf_split("hf_lit.json", "String", "\\s", "Removed");
  ZT_REQUIRE(zt_tok_open_hf(path_of("hf_lit.json"), NULL, &t) == 0);
  int ab[] = {'a', ' ', 'b'}; /* the two bytes "\\s" go, the space stays */
  ids_are(t, "a\\s b", ab, 3);
  zt_tok_free(t);
  write_hf_split("hf_utf.json", "Regex", "\xff+", "Isolated");
  t = NULL;
  ZT_CHECK(zt_tok_open_hf(path_of("hf_utf.json"), NULL, &t) == -1 && !t);
  ZT_CHECK(strstr(zt_err_msg(), "pre_tokenizer Split pattern") != NULL);
}

ZT_TEST_MAIN_NAMED(run_tests, byte_tokenizer, gpt2_files, gpt2_record, bad_records,
                   record_for_shard, hf_tokenizer_json, hf_tokenizer_json_edges)

int main(int argc, char **argv) {
  snprintf(tmp, sizeof tmp, "%s", zt_test_tmpdir("engine_tokenizer"));
  return run_tests(argc, argv);
}
