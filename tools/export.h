/*
 * export.h: a committed checkpoint epoch to a Hugging Face GPT-2 model
 * directory (tools/export.c).
 */
#ifndef ZT_EXPORT_H
#define ZT_EXPORT_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
  const char *epoch_dir; /* a committed epoch (its manifest.json and rank files) */
  const char *out_dir;   /* created; must not exist or be empty */
  int bf16;              /* model.safetensors in bf16 instead of fp32 */
  const char *tokenizer; /* a tokenizer record, or NULL: the manifest's */
  /* A LoRA epoch (the adapters of a base model) must say which: PEFT's
   * adapter directory (adapter_config.json, adapter_model.safetensors), or
   * the base with the adapters merged in, as a full model directory. */
  int lora;              /* ZT_EXPORT_ADAPTER or ZT_EXPORT_MERGE; 0 for others */
  const char *base;      /* --merge: the base (HF directory or file); NULL: the manifest's */
} zt_export_opts_t;

#define ZT_EXPORT_ADAPTER 1
#define ZT_EXPORT_MERGE 2

typedef struct {
  int64_t step;          /* the epoch's step */
  const char *model_file; /* the weights' file: "model.safetensors" or, for adapters,
                           "adapter_model.safetensors" */
  size_t model_bytes;    /* its size */
  char tokenizer[16];    /* "byte", "gpt2" or "none" (no tokenizer files) */
} zt_export_info_t;

/* Writes model.safetensors, config.json and the tokenizer files of the
 * epoch into o->out_dir, through a temporary directory and a rename. */
int zt_export_dir(const zt_export_opts_t *o, zt_export_info_t *info);

#endif
