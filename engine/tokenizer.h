/*
 * tokenizer.h: text <-> token ids, the two tokenizers of ztrain's data.
 *
 *   byte  each byte is its own token (0..255), 256 is end-of-text:
 *         vocab_size 257, no files.
 *   gpt2  GPT-2's byte-level BPE from OpenAI's encoder.json and vocab.bpe
 *         (pre-tokenization pattern, bytes_to_unicode, merges by rank; see
 *         tokenizer.c for the details and the limits of the hand-written
 *         pattern); end-of-text is encoder["<|endoftext|>"].
 *
 * zprep encodes its shards with this module and writes, next to them, the
 * **tokenizer record** `DIR/PREFIX_tokenizer.json` that says which
 * tokenizer made them (docs/engine.md, "Tokenizer record"):
 *
 *   {"type":"byte","vocab_size":257,"eot":256}
 *   {"type":"gpt2","vocab_size":V,"eot":E,"encoder":"PREFIX_encoder.json",
 *    "bpe":"PREFIX_vocab.bpe"}
 *
 * File names in a record are plain names relative to the record's
 * directory. The trainer puts the record's path into each checkpoint's
 * manifest ("tokenizer"), and sampling (sample.h) and export read it back
 * through zt_tok_open.
 *
 * Decoding maps an id to the bytes it stands for: for gpt2 the inverse of
 * bytes_to_unicode over the encoder's string (so decoding the ids of a text
 * gives back the text's bytes exactly); end-of-text decodes to the text
 * "<|endoftext|>" in both tokenizers.
 *
 * A zt_tok_t is read-only after opening except for encode's scratch space:
 * one tokenizer per thread for encoding, decode may be shared.
 */
#ifndef ZT_TOKENIZER_H
#define ZT_TOKENIZER_H

#include <stddef.h>

#include "zt_common.h"

typedef struct zt_tok zt_tok_t;

typedef enum { ZT_TOK_BYTE, ZT_TOK_GPT2, ZT_TOK_HF } zt_tok_type_t;

/* Limits on what a record may make us read. */
#define ZT_TOK_RECORD_MAX (64u << 10)  /* the record itself */
#define ZT_TOK_FILE_MAX (256u << 20)   /* encoder.json, vocab.bpe, tokenizer.json */
#define ZT_TOK_VOCAB_MAX (1 << 20)     /* as the model's (layout.h ZT_MODEL_MAX_VOCAB) */

/* The end-of-text token's text (GPT-2's). */
#define ZT_TOK_EOT_TEXT "<|endoftext|>"

/* GPT-2's bytes_to_unicode: byte c as the character byte-level BPE shows
 * it with, UTF-8 encoded and terminated (at most 3 bytes). */
void zt_tok_byte_char(int c, char out[3]);

/* A tokenizer record as read (zt_tok_read_record): its fields checked, and
 * for gpt2 the paths of the encoder and merges files beside it. */
typedef struct {
  char type[8]; /* "byte", "gpt2" or "hf" */
  int vocab_size, eot;
  char encoder[ZT_PATH_MAX], bpe[ZT_PATH_MAX]; /* gpt2 only */
  char hf[ZT_PATH_MAX];                 /* hf only: the tokenizer.json */
} zt_tok_record_t;

/* Reads and checks a record without loading the files it names (zctl
 * export copies them). Errors name the record and what is wrong. */
ZT_MUST_CHECK int zt_tok_read_record(const char *record_path, zt_tok_record_t *rec);
/* Opens the tokenizer a record names (reads the record, loads the gpt2
 * files beside it, checks that the record's vocab_size and eot are the
 * files'). Errors name the record and what is wrong. */
ZT_MUST_CHECK int zt_tok_open(const char *record_path, zt_tok_t **out);
/* The byte tokenizer. */
ZT_MUST_CHECK int zt_tok_open_byte(zt_tok_t **out);
/* GPT-2 BPE from an encoder.json and a vocab.bpe (zprep --tokenizer gpt2). */
ZT_MUST_CHECK int zt_tok_open_gpt2(const char *encoder_path, const char *bpe_path,
                                   zt_tok_t **out);
/* A Hugging Face tokenizer.json (zprep --tokenizer hf): byte-level BPE
 * (tokenizer.c says what of the format is taken and what is refused, by
 * name). The end-of-text token is eot_text, or when NULL the first of
 * <|endoftext|>, <|end_of_text|>, </s>, <|im_end|>, <eos> it has. */
ZT_MUST_CHECK int zt_tok_open_hf(const char *path, const char *eot_text, zt_tok_t **out);
void zt_tok_free(zt_tok_t *t);

zt_tok_type_t zt_tok_type(const zt_tok_t *t);
const char *zt_tok_type_name(const zt_tok_t *t); /* "byte", "gpt2" or "hf" */
int zt_tok_vocab_size(const zt_tok_t *t);        /* largest id + 1 */
int zt_tok_eot(const zt_tok_t *t);
/* The beginning-of-sequence id (config.json's bos_token_id): an hf
 * tokenizer's template's first special token, else the end-of-text id. */
int zt_tok_bos(const zt_tok_t *t);

/* Encodes text[0, len): each id is handed to emit in order; an emit that
 * returns non-zero stops the encoding, which returns -1 (emit sets the
 * error). Text is not split into documents and no end-of-text is added. */
typedef int (*zt_tok_emit_fn)(void *user, int id);
ZT_MUST_CHECK int zt_tok_encode(zt_tok_t *t, const void *text, size_t len, zt_tok_emit_fn emit,
                                void *user);
/* The same into a new array (*ids, *n; free it). */
ZT_MUST_CHECK int zt_tok_encode_ids(zt_tok_t *t, const void *text, size_t len, int **ids,
                                    size_t *n);

/* The bytes of token id (not NUL-terminated): *bytes points into the
 * tokenizer. -1 when no token has that id. */
ZT_MUST_CHECK int zt_tok_decode(const zt_tok_t *t, int id, const char **bytes, size_t *len);

/* The record's path for a shard path or glob: ".../X_train_000000.bin",
 * ".../X_val_*.bin" -> ".../X_tokenizer.json" (".../train_000000.bin" ->
 * ".../tokenizer.json"). -1 when the name has no "train_" or "val_" part
 * ending in ".bin", or out (cap bytes) is too small. */
ZT_MUST_CHECK int zt_tok_record_for_shard(const char *shard_path_or_glob, char *out, size_t cap);

#endif
