/*
 * hfdir.h: a Hugging Face model directory as a job's starting point
 * (init.from_pretrained).
 *
 * The directory holds config.json and the weights: model.safetensors, or
 * model.safetensors.index.json and its shards (F32, BF16 or F16, read into
 * the fp32 master; engine/safetensors.h). config.json must describe the
 * spec's model (engine/hfconfig.h, which also fills the spec's model in
 * from it).
 */
#ifndef ZT_HFDIR_H
#define ZT_HFDIR_H

#include "layout.h"
#include "zt_common.h"

/* Reads the weights of dir into flat (l->num_params floats). */
ZT_MUST_CHECK int zt_hf_read_weights(const char *dir, const zt_layout_t *l, float *flat);

/* A model's weights from path into flat: with dir set, a Hugging Face
 * directory (config.json checked against cfg, then its weights), else one
 * safetensors file (engine/safetensors.h): init.from_pretrained and
 * init.from_safetensors, and a LoRA epoch's base. */
ZT_MUST_CHECK int zt_hf_read_model(const char *path, int dir, const zt_model_config_t *cfg,
                                   const zt_layout_t *l, float *flat);

#endif
