/*
 * test_params.c: a job's parameters (coordinator/params.c) from specs, with
 * made-up roots (nothing on disk is looked at): the numbers and their
 * defaults; the world sizes that divide the micro-batches per step, each
 * with the memory one rank needs, and a spec with none refused; paths
 * confined to the roots and the checkpoint directories kept resolved;
 * checkpoint directories whose epochs the replica stores could not name
 * (hidden, too deep) refused; fault_injection only with the test knobs on;
 * a spec the engine's parser refuses is refused.
 */
#include <stdio.h>
#include <string.h>

#include "coord.h"
#include "zt_test.h"

static zt_coord_config_t config(int test_knobs) {
  zt_coord_config_t cfg;
  memset(&cfg, 0, sizeof cfg);
  snprintf(cfg.data_root, sizeof cfg.data_root, "/srv/data");
  snprintf(cfg.ckpt_root, sizeof cfg.ckpt_root, "/srv/ckpt");
  cfg.allow_test_knobs = test_knobs;
  return cfg;
}

/* A small valid spec with `extra` (",\"key\": ...") added to its object. */
static const char *spec(const char *batch, const char *extra) {
  static char buf[2048];
  snprintf(buf, sizeof buf,
           "{\"name\": \"tiny\", \"steps\": 40, \"model\": {\"n_layer\": 1, \"n_head\": 2, "
           "\"n_embd\": 8, \"seq_len\": 16, \"vocab_size\": 64}, \"data\": {\"train\": "
           "\"shards/train_*.bin\"}, %s%s}",
           batch, extra);
  return buf;
}

#define BATCH_4 "\"train_micro_batch_size_per_gpu\": 2, \"train_batch_size\": 8"
#define ELASTIC_1_4 ", \"elastic\": {\"min_workers\": 1, \"max_workers\": 4}"

static int parse(const char *json, int test_knobs, zt_job_params_t *p) {
  zt_coord_config_t cfg = config(test_knobs);
  return zt_params_parse(json, &cfg, p);
}

/* Parsing fails with kind ZT_E_INVALID and a message that contains want. */
static int refused(const char *json, int test_knobs, const char *want) {
  static zt_job_params_t p;
  if (parse(json, test_knobs, &p) == 0) return 0;
  if (zt_err_kind() != ZT_E_INVALID || !strstr(zt_err_msg(), want)) {
    fprintf(stderr, "  unexpected error: %s\n", zt_err_msg());
    return 0;
  }
  return 1;
}

ZT_TEST(test_numbers_and_defaults) {
  static zt_job_params_t p;
  ZT_REQUIRE(parse(spec(BATCH_4, ""), 0, &p) == 0);
  ZT_CHECK_STR(p.name, "tiny");
  ZT_CHECK(p.steps == 40 && p.micro == 2 && p.global_batch == 8 && p.seq_len == 16);
  ZT_CHECK(p.min_workers == 1 && p.max_workers == 1);
  ZT_CHECK(p.keep_last == 2 && p.keep_every == 0 && p.replicas == 2);
  ZT_CHECK(p.ckpt_dir[0] == 0 && p.ckpt_load[0] == 0); /* no checkpoints */
  ZT_CHECK(p.ckpt_every == 0 && p.max_uncommitted == 0);
  ZT_CHECK(p.zero_stage == 0 && p.comm_timeout_ms > 0);
}

ZT_TEST(test_sections_copied) {
  static zt_job_params_t p;
  ZT_REQUIRE(parse(spec(BATCH_4, ", \"checkpoint\": {\"dir\": \"run\", \"every_steps\": 5, "
                                 "\"keep_last\": 3, \"keep_every\": 20, \"replicas\": 1}, "
                                 "\"rollback\": {\"enabled\": true, \"max_rollbacks\": 4}, "
                                 "\"elastic\": {\"min_workers\": 2, \"max_workers\": 2, "
                                 "\"backoff_ms\": 250}, \"zero_optimization\": {\"stage\": 2}"),
                   0, &p) == 0);
  ZT_CHECK(p.ckpt_every == 5 && p.keep_last == 3 && p.keep_every == 20 && p.replicas == 1);
  ZT_CHECK(p.max_uncommitted == 50); /* default: 10 * every_steps */
  ZT_CHECK(p.rb_enabled && p.rb_max == 4 && p.rb_window > 0 && p.rb_lr_factor > 0);
  ZT_CHECK(p.min_workers == 2 && p.max_workers == 2 && p.restart.backoff_ms == 250);
  ZT_CHECK(p.zero_stage == 2);
  ZT_CHECK(!p.ckpt_shared);
  /* Shared storage: one copy, and a request for more is refused by name. */
  ZT_REQUIRE(parse(spec(BATCH_4, ", \"checkpoint\": {\"dir\": \"run\", \"shared\": true}"), 0,
                   &p) == 0);
  ZT_CHECK(p.ckpt_shared && p.replicas == 1);
  ZT_CHECK(refused(spec(BATCH_4, ", \"checkpoint\": {\"dir\": \"run\", \"shared\": true, "
                                 "\"replicas\": 2}"),
                   0, "checkpoint.replicas: 2 copies asked for, but checkpoint.shared"));
  ZT_CHECK(refused(spec(BATCH_4, ", \"checkpoint\": {\"dir\": \"run\", \"shared\": 1}"), 0,
                   "checkpoint.shared: expected true or false"));
}

ZT_TEST(test_world_sizes) {
  static zt_job_params_t p;
  /* 8 / 2 = 4 micro-batches per step: worlds 1, 2 and 4 of 1..4. */
  ZT_REQUIRE(parse(spec(BATCH_4, ELASTIC_1_4), 0, &p) == 0);
  ZT_CHECK(p.need[1].host > 0 && p.need[2].host > 0 && p.need[4].host > 0);
  ZT_CHECK(p.need[3].host == 0 && p.need[3].device == 0); /* 3 does not divide 4 */
  ZT_CHECK(p.need[5].host == 0); /* beyond max_workers */
  /* No world size in 3..3 divides 4. */
  ZT_CHECK(refused(spec(BATCH_4, ", \"elastic\": {\"min_workers\": 3, \"max_workers\": 3}"), 0,
                   "no world size in 3..3 divides train_batch_size / micro batch = 4"));
}

ZT_TEST(test_paths_confined) {
  static zt_job_params_t p;
  ZT_REQUIRE(parse(spec(BATCH_4, ", \"checkpoint\": {\"dir\": \"team/run\", \"load\": "
                                 "\"/srv/ckpt/old/job_3/step_00000010-g2\"}"),
                   0, &p) == 0);
  ZT_CHECK_STR(p.ckpt_dir, "/srv/ckpt/team/run"); /* kept resolved */
  ZT_CHECK_STR(p.ckpt_load, "/srv/ckpt/old/job_3/step_00000010-g2");
  ZT_CHECK(refused(spec("\"train_micro_batch_size_per_gpu\": 2, \"train_batch_size\": 8, "
                        "\"checkpoint\": {\"dir\": \"/elsewhere/run\"}",
                        ""),
                   0, "outside the allowed root"));
  ZT_CHECK(refused(spec(BATCH_4, ", \"checkpoint\": {\"dir\": \"../run\"}"), 0, "\"..\""));
  ZT_CHECK(refused(spec(BATCH_4, ", \"init\": {\"from_safetensors\": \"/tmp/gpt2.safetensors\"}"),
                   0, "init.from_safetensors"));
  ZT_CHECK(refused(spec(BATCH_4, ", \"checkpoint\": {\"dir\": \"run\", \"load\": \"/tmp/x\"}"),
                   0, "checkpoint.load"));
}

ZT_TEST(test_data_outside_root) {
  static const char *outside =
      "{\"name\": \"tiny\", \"steps\": 4, \"model\": {\"n_layer\": 1, \"n_head\": 2, "
      "\"n_embd\": 8, \"seq_len\": 16, \"vocab_size\": 64}, \"data\": {\"train\": "
      "\"/etc/train_*.bin\", \"val\": \"val_*.bin\"}, " BATCH_4 "}";
  ZT_CHECK(refused(outside, 0, "data.train"));
  static const char *val_outside =
      "{\"name\": \"tiny\", \"steps\": 4, \"model\": {\"n_layer\": 1, \"n_head\": 2, "
      "\"n_embd\": 8, \"seq_len\": 16, \"vocab_size\": 64}, \"data\": {\"train\": "
      "\"train_*.bin\", \"val\": \"../val_*.bin\"}, " BATCH_4 "}";
  ZT_CHECK(refused(val_outside, 0, "data.val"));
}

ZT_TEST(test_epoch_names) {
  static zt_job_params_t p;
  /* <dir>/job_N/step_S-gG: at most ZT_EPOCH_MAX_DEPTH components in all. */
  ZT_CHECK(parse(spec(BATCH_4, ", \"checkpoint\": {\"dir\": \"a/b/c/d/e/f\"}"), 0, &p) == 0);
  ZT_CHECK(refused(spec(BATCH_4, ", \"checkpoint\": {\"dir\": \"a/b/c/d/e/f/g\"}"), 0,
                   "cannot be named for the replica stores"));
  ZT_CHECK(refused(spec(BATCH_4, ", \"checkpoint\": {\"dir\": \"team/.run\"}"), 0,
                   "cannot be named for the replica stores"));
}

ZT_TEST(test_fault_injection_needs_test_knobs) {
  static zt_job_params_t p;
  const char *json = spec(BATCH_4, ", \"fault_injection\": {\"break_ring_at_step\": 3}");
  ZT_CHECK(refused(json, 0, "--allow-test-knobs"));
  json = spec(BATCH_4, ", \"fault_injection\": {\"break_ring_at_step\": 3}");
  ZT_CHECK(parse(json, 1, &p) == 0);
}

ZT_TEST(test_bad_spec_refused) {
  ZT_CHECK(refused("{\"name\": \"x\"", 0, "job spec"));
  ZT_CHECK(refused(spec(BATCH_4, ", \"no_such_key\": 1"), 0, "no_such_key"));
  /* 8 is not micro * accum * some world size: the parser's own check. */
  ZT_CHECK(refused(spec("\"train_micro_batch_size_per_gpu\": 3, \"train_batch_size\": 8", ""), 0,
                   "job spec"));
}

ZT_TEST_MAIN(test_numbers_and_defaults, test_sections_copied, test_world_sizes,
             test_paths_confined, test_data_outside_root, test_epoch_names,
             test_fault_injection_needs_test_knobs, test_bad_spec_refused)
