/*
 * export.h: a committed checkpoint epoch to a Hugging Face GPT-2
 * safetensors file (tools/export.c).
 */
#ifndef ZT_EXPORT_H
#define ZT_EXPORT_H

#include <stddef.h>

/* Writes the model of the epoch in `dir` to `out` (fp32, or bf16 when
 * bf16 is set); *bytes_out receives the file size. */
int zt_export_safetensors(const char *dir, const char *out, int bf16, size_t *bytes_out);

#endif
