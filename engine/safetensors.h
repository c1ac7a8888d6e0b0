/*
 * safetensors.h: the model's parameters as a Hugging Face GPT-2
 * safetensors file, both ways (zctl export writes one; a job spec's
 * init.from_safetensors starts from one).
 *
 * Names are GPT2LMHeadModel's: transformer.wte.weight [V, C] (our padded
 * rows dropped), transformer.wpe.weight [T, C], transformer.h.{i}.ln_1.*,
 * .attn.c_attn.*, .attn.c_proj.*, .ln_2.*, .mlp.c_fc.*, .mlp.c_proj.*,
 * transformer.ln_f.*. GPT-2's Conv1D weights are [in, out], the transpose
 * of ours ([out, in], as in llm.c), so they are transposed both ways. The
 * LM head is tied to wte and not stored; on reading, lm_head.weight and the
 * attention masks (h.{i}.attn.bias, .masked_bias) are ignored, and names
 * without the "transformer." prefix (GPT2Model's files) are accepted.
 *
 * Reading trusts nothing in the file: the header length is bounded by the
 * file, every tensor of the model must be there with a known dtype (F32,
 * BF16, F16), the expected shape and data offsets inside the data section
 * that hold exactly its elements, and no other tensor may be there (a
 * layer the model does not have, a name it does not know, the ignored
 * ones above aside); one error names every such tensor (as many as fit
 * in a message, then how many more).
 * A file whose wpe has more positions than the model's seq_len gives its
 * first seq_len rows (fine-tuning with a shorter context).
 *
 * Format: 8-byte little-endian header length, a JSON header mapping each
 * name to {dtype, shape, data_offsets [begin, end)} relative to the data
 * that follows (padded with spaces to a multiple of 8), then the data.
 */
#ifndef ZT_SAFETENSORS_H
#define ZT_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "layout.h"
#include "zt_common.h"

/* Writes the parameters in `flat` (l->num_params floats, layout order) to
 * `path` (through path.tmp, fsynced, a rename and an fsync of the
 * directory; a failure removes path.tmp), fp32 or bf16; `step` goes into
 * the metadata. *bytes receives the file's size (may be NULL). */
ZT_MUST_CHECK int zt_st_write(const char *path, const zt_layout_t *l, const float *flat, int bf16,
                              int64_t step, size_t *bytes);

/* Reads the model of layout l from `path` into `flat` (l->num_params
 * floats; padded vocabulary rows are zeroed). */
ZT_MUST_CHECK int zt_st_read(const char *path, const zt_layout_t *l, float *flat);

/* Reads the model from a Hugging Face directory's sharded weights:
 * dir/model.safetensors.index.json maps each tensor name to a file of dir
 * (weight_map); every tensor of the model must be mapped, and each file
 * may hold only tensors the index maps to it. */
ZT_MUST_CHECK int zt_st_read_sharded(const char *dir, const zt_layout_t *l, float *flat);

/* The largest header accepted on reading. */
#define ZT_ST_MAX_HEADER (64u << 20)

#endif
