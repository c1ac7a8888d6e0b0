/*
 * hfconfig.h: a Hugging Face config.json as a job's model (hfconfig.c).
 *
 * A job that starts from a Hugging Face directory (init.from_pretrained)
 * takes its model from the directory's config.json, as Hugging Face's
 * from_pretrained does: the spec's model section may be left out, or may
 * set only what the model leaves open (seq_len, up to
 * max_position_embeddings) and repeat what config.json says; a field that
 * contradicts config.json is an error naming both values. The architecture
 * is one of LlamaForCausalLM, Qwen2ForCausalLM (q/k/v biases) and
 * MistralForCausalLM, with hidden_act silu; rope_scaling null, "default"
 * or "llama3"; no sliding window in use, no mixture of experts, no MLP
 * bias. Every disagreement is named in one error.
 *
 * The coordinator resolves a spec once, at submit, and stores the result,
 * so every worker trains the same model section; each worker still checks
 * the config.json it reads against it (zt_hfconfig_check), since a
 * directory may differ from one machine to the next.
 */
#ifndef ZT_HFCONFIG_H
#define ZT_HFCONFIG_H

#include <stddef.h>

#include "layout.h"
#include "zt_common.h"

/* seq_len when neither the spec nor a smaller max_position_embeddings
 * sets it. */
#define ZT_HF_DEFAULT_SEQ_LEN 2048

/* The spec text json[0, len) with init.from_pretrained's model section
 * filled in from its config.json (the path confined under data_root, or
 * taken as it is with data_root NULL): 0 with *out the new text (free()
 * it), or NULL when there is nothing to fill in (no from_pretrained, text
 * that is not a JSON object: the spec parser says what is wrong); -1 with
 * the reason. When config.json cannot be read here (a coordinator on
 * another machine than the model), a spec that gives the whole model
 * section is left as it is; one that does not is an error. */
ZT_MUST_CHECK int zt_hfconfig_resolve(const char *json, size_t len, const char *data_root,
                                      char **out);

/* Checks dir/config.json against the model the job trains. */
ZT_MUST_CHECK int zt_hfconfig_check(const char *dir, const zt_model_config_t *want);

#endif
