/*
 * test_engine_spec.c: job spec parsing, validation messages, batch math.
 */
#include <string.h>

#include "comm.h"
#include "spec.h"
#include "zt_common.h"
#include "zt_test.h"

#define BASE                                                                               \
  "\"steps\": 100, \"train_micro_batch_size_per_gpu\": 4, "                                \
  "\"model\": {\"n_layer\": 2, \"n_head\": 4, \"n_embd\": 64, \"seq_len\": 64, "           \
  "\"vocab_size\": 257}, \"data\": {\"train\": \"d/train_*.bin\", \"val\": \"d/val_*.bin\"}"

static int parse(zt_spec_t *s, const char *json) { return zt_spec_parse(s, json, strlen(json)); }

/* Parses, expects failure with a message containing `want`. */
static void expect_error(const char *json, const char *want) {
  zt_spec_t s;
  ZT_CHECK(parse(&s, json) == -1);
  if (!strstr(zt_err_msg(), want)) fprintf(stderr, "  got \"%s\", want \"%s\"\n", zt_err_msg(), want);
  ZT_CHECK(strstr(zt_err_msg(), want) != NULL);
}

ZT_TEST(full_spec) {
  const char *json =
      "{\"name\": \"small\", \"seed\": 7, " BASE ", "
      "\"gradient_accumulation_steps\": 2, \"train_batch_size\": 16, \"gradient_clipping\": 1.0,"
      "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.001, \"betas\": [0.8, 0.9],"
      " \"eps\": 1e-6, \"weight_decay\": 0.1}},"
      "\"scheduler\": {\"type\": \"WarmupDecayLR\", \"params\": {\"warmup_min_lr\": 1e-5, "
      "\"warmup_max_lr\": 0.001, \"warmup_num_steps\": 10, \"total_num_steps\": 100, "
      "\"warmup_type\": \"linear\"}},"
      "\"eval\": {\"every_steps\": 25, \"batches\": 3},"
      "\"zero_optimization\": {\"stage\": 2}, \"elastic\": {\"min_workers\": 1, \"max_workers\": 4},"
      "\"checkpoint\": {\"dir\": \"ck\", \"every_steps\": 50, \"keep_last\": 3, \"keep_every\": 100},"
      "\"rollback\": {\"enabled\": true, \"window\": 20, \"threshold\": 5.5, \"patience\": 2, "
      "\"margin_steps\": 5, \"skip_steps\": 8, \"lr_factor\": 0.25, \"cooldown_steps\": 30, "
      "\"max_rollbacks\": 2, \"per_steps\": 500},"
      "\"bf16\": {\"enabled\": false}, \"comm\": {\"timeout_ms\": 5000},"
      "\"activation_checkpointing\": true,"
      "\"fault_injection\": {\"lr_scale\": 100, \"from_step\": 30, \"to_step\": 20, "
      "\"repeat\": true}}";
  zt_spec_t s;
  ZT_REQUIRE(parse(&s, json) == 0);
  ZT_CHECK_STR(s.name, "small");
  ZT_CHECK(s.seed == 7 && s.steps == 100 && s.micro_batch == 4 && s.accum == 2);
  ZT_CHECK(s.global_batch == 16 && s.have_train_batch);
  ZT_CHECK_NEAR(s.grad_clip, 1.0, 0);
  ZT_CHECK(s.model.n_layer == 2 && s.model.n_head == 4 && s.model.n_embd == 64);
  ZT_CHECK(s.model.seq_len == 64 && s.model.vocab_size == 257);
  ZT_CHECK_NEAR(s.opt.lr, 0.001, 1e-9);
  ZT_CHECK_NEAR(s.opt.beta1, 0.8, 1e-7);
  ZT_CHECK_NEAR(s.opt.beta2, 0.9, 1e-7);
  ZT_CHECK_NEAR(s.opt.eps, 1e-6, 1e-12);
  ZT_CHECK_NEAR(s.opt.weight_decay, 0.1, 1e-7);
  ZT_CHECK(s.sched.enabled && s.sched.warmup_steps == 10 && s.sched.total_steps == 100);
  ZT_CHECK_NEAR(s.sched.min_lr, 1e-5, 1e-10);
  ZT_CHECK_STR(s.train_glob, "d/train_*.bin");
  ZT_CHECK_STR(s.val_glob, "d/val_*.bin");
  ZT_CHECK(s.eval_every == 25 && s.eval_batches == 3);
  ZT_CHECK(s.zero_stage == 2 && s.min_workers == 1 && s.max_workers == 4);
  ZT_CHECK_STR(s.ckpt.dir, "ck");
  ZT_CHECK(s.ckpt.every_steps == 50 && s.ckpt.keep_last == 3 && s.ckpt.keep_every == 100);
  ZT_CHECK(s.rollback.enabled && s.rollback.window == 20 && s.rollback.patience == 2);
  ZT_CHECK(s.rollback.margin_steps == 5 && s.rollback.skip_steps == 8);
  ZT_CHECK(s.rollback.cooldown_steps == 30 && s.rollback.max_rollbacks == 2);
  ZT_CHECK(s.rollback.per_steps == 500);
  ZT_CHECK_NEAR(s.rollback.threshold, 5.5, 0);
  ZT_CHECK_NEAR(s.rollback.lr_factor, 0.25, 0);
  ZT_CHECK(s.bf16 == 0 && s.comm_timeout_ms == 5000 && s.act_ckpt == 1);
  /* to_step below from_step means the one step from_step. */
  ZT_CHECK(s.fault.lr_scale == 100 && s.fault.from_step == 30 && s.fault.to_step == 30);
  ZT_CHECK(s.fault.repeat == 1);
  int accum;
  ZT_CHECK(zt_spec_accum_for_world(&s, 1, &accum) == 0 && accum == 4);
  ZT_CHECK(zt_spec_accum_for_world(&s, 2, &accum) == 0 && accum == 2);
  ZT_CHECK(zt_spec_accum_for_world(&s, 4, &accum) == 0 && accum == 1);
  ZT_CHECK(zt_spec_accum_for_world(&s, 3, &accum) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "not divisible") != NULL);
}

ZT_TEST(defaults) {
  zt_spec_t s;
  ZT_REQUIRE(parse(&s, "{" BASE "}") == 0);
  ZT_CHECK_STR(s.name, "job");
  ZT_CHECK(s.accum == 1 && s.global_batch == 4 && !s.have_train_batch);
  ZT_CHECK(s.sched.enabled == 0 && s.zero_stage == 0 && s.min_workers == 1);
  ZT_CHECK(s.max_workers == 1 && s.comm_timeout_ms == ZT_COMM_TIMEOUT_MS_DEFAULT && s.ckpt.dir[0] == 0);
  ZT_CHECK(s.rollback.enabled == 1 && s.rollback.window == 100 && s.fault.lr_scale == 0);
  ZT_CHECK_NEAR(s.opt.beta2, 0.95, 1e-7);
  int accum;
  ZT_CHECK(zt_spec_accum_for_world(&s, 1, &accum) == 0 && accum == 1);
  ZT_CHECK(zt_spec_accum_for_world(&s, 2, &accum) == -1);
  /* The scheduler's defaults: max lr = optimizer lr, total = steps. */
  ZT_REQUIRE(parse(&s, "{" BASE ", \"optimizer\": {\"params\": {\"lr\": 0.01}}, "
                       "\"scheduler\": {\"type\": \"WarmupDecayLR\"}}") == 0);
  ZT_CHECK(s.sched.enabled && s.sched.total_steps == 100 && s.sched.warmup_steps == 0);
  ZT_CHECK_NEAR(s.sched.max_lr, 0.01, 1e-9);
}

ZT_TEST(unknown_keys) {
  expect_error("{" BASE ", \"stepz\": 1}", "stepz: unknown key");
  expect_error("{" BASE ", \"optimizer\": {\"params\": {\"betaz\": [0.9, 0.9]}}}",
               "optimizer.params.betaz: unknown key");
  expect_error("{" BASE ", \"model2\": {}}", "model2: unknown key");
  expect_error("{" BASE ", \"rollback\": {\"windows\": 3}}", "rollback.windows: unknown key");
  expect_error("{" BASE ", \"fault_injection\": {\"kill_rank\": 1}}",
               "fault_injection.kill_rank: unknown key");
  expect_error("{" BASE ", \"fault_injection\": {\"repeat\": 1}}",
               "fault_injection.repeat: expected true or false");
  expect_error("{" BASE ", \"scheduler\": {\"type\": \"WarmupDecayLR\", \"params\": "
               "{\"warmup_typ\": \"linear\"}}}",
               "scheduler.params.warmup_typ: unknown key");
  expect_error("{" BASE ", \"data\": {\"train\": \"x\"}}", "data: duplicate key");
  expect_error("{\"steps\": 1, \"train_micro_batch_size_per_gpu\": 1, \"data\": {\"train\": "
               "\"x\", \"vall\": \"y\"}, \"model\": {\"n_layer\": 1, \"n_head\": 1, "
               "\"n_embd\": 8, \"seq_len\": 8, \"vocab_size\": 10}}",
               "data.vall: unknown key");
}

ZT_TEST(types_and_ranges) {
  expect_error("{\"steps\": \"100\", \"train_micro_batch_size_per_gpu\": 4}", "steps: expected an integer");
  expect_error("{" BASE ", \"seed\": 1.5}", "seed: expected an integer");
  expect_error("{" BASE ", \"gradient_clipping\": -1}", "gradient_clipping: -1 is out of range");
  expect_error("{" BASE ", \"optimizer\": {\"params\": {\"betas\": [0.9]}}}",
               "optimizer.params.betas: expected an array of two numbers");
  expect_error("{" BASE ", \"optimizer\": {\"params\": {\"betas\": [0.9, 1.0]}}}",
               "optimizer.params.betas[1]");
  expect_error("{" BASE ", \"optimizer\": {\"type\": \"SGD\"}}", "optimizer.type");
  expect_error("{" BASE ", \"zero_optimization\": {\"stage\": 4}}", "zero_optimization.stage");
  expect_error("{" BASE ", \"bf16\": {\"enabled\": 1}}", "bf16.enabled: expected true or false");
  expect_error("{" BASE ", \"activation_checkpointing\": {}}",
               "activation_checkpointing: expected true or false");
  expect_error("{" BASE ", \"elastic\": {\"min_workers\": 3, \"max_workers\": 2}}",
               "elastic.max_workers");
  expect_error("{" BASE ", \"rollback\": {\"lr_factor\": 0}}", "rollback.lr_factor");
  expect_error("{" BASE ", \"checkpoint\": {\"every_steps\": 5}}", "checkpoint.dir: required");
  expect_error("{" BASE ", \"scheduler\": {\"type\": \"WarmupDecayLR\", \"params\": "
               "{\"warmup_type\": \"log\"}}}",
               "scheduler.params.warmup_type");
  expect_error("{" BASE ", \"scheduler\": {\"type\": \"WarmupDecayLR\", \"params\": "
               "{\"warmup_num_steps\": 100, \"total_num_steps\": 100}}}",
               "scheduler.params.total_num_steps");
  expect_error("{" BASE ", \"eval\": {\"every_steps\": \"often\"}}", "eval.every_steps");
  expect_error("{\"steps\": 1, \"train_micro_batch_size_per_gpu\": 4, \"data\": {\"train\": \"x\"},"
               " \"model\": {\"n_layer\": 2, \"n_head\": 3, \"n_embd\": 64, \"seq_len\": 8, "
               "\"vocab_size\": 10}}",
               "model: n_embd (64) must be divisible by n_head (3)");
  expect_error("{\"steps\": 1, \"train_micro_batch_size_per_gpu\": 4, \"data\": {\"train\": \"x\"}}",
               "model: required key is missing");
  expect_error("{" BASE ", \"train_batch_size\": 10}", "train_batch_size");
  expect_error("{" BASE ", \"gradient_accumulation_steps\": 3, \"train_batch_size\": 16}",
               "train_batch_size");
  expect_error("[1, 2]", "JSON object");
  expect_error("{\"steps\": ", "not valid JSON");
  expect_error("{\"data\": {\"val\": \"v\"}, \"steps\": 1, \"train_micro_batch_size_per_gpu\": 1,"
               " \"model\": {\"n_layer\": 1, \"n_head\": 1, \"n_embd\": 8, \"seq_len\": 8, "
               "\"vocab_size\": 10}}",
               "data.train: required key is missing");
}

ZT_TEST(load_file) {
  const char *dir = zt_test_tmpdir("engine_spec");
  char path[600];
  snprintf(path, sizeof path, "%s/spec.json", dir);
  FILE *f = fopen(path, "w");
  fputs("{" BASE ", \"bogus\": 1}", f);
  fclose(f);
  zt_spec_t s;
  ZT_CHECK(zt_spec_load(&s, path) == -1);
  ZT_CHECK(strstr(zt_err_msg(), path) != NULL && strstr(zt_err_msg(), "bogus: unknown key"));
  f = fopen(path, "w");
  fputs("{" BASE "}", f);
  fclose(f);
  ZT_CHECK(zt_spec_load(&s, path) == 0);
  snprintf(path, sizeof path, "%s/missing.json", dir);
  ZT_CHECK(zt_spec_load(&s, path) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "missing.json") != NULL);
}

/* Found by fuzz_spec: text after the object was ignored, and a huge global
 * batch made the accumulation count overflow an int. */
ZT_TEST(trailing_text_and_huge_accumulation) {
  expect_error("{" BASE "} {\"steps\": 5}", "unexpected text after the JSON value");
  zt_spec_t s;
  ZT_REQUIRE(parse(&s, "{" BASE "}\n  ") == 0);
  ZT_REQUIRE(parse(&s, "{" BASE ", \"train_batch_size\": 88888888856}") == 0);
  int accum;
  ZT_CHECK(zt_spec_accum_for_world(&s, 1, &accum) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "the limit is") != NULL);
  ZT_CHECK(zt_spec_accum_for_world(&s, 2, &accum) == -1);
  /* A micro-step's tokens are counted in int: 2^20 x 2^20 is refused. */
  expect_error("{\"steps\": 1, \"train_micro_batch_size_per_gpu\": 1048576, \"model\": "
               "{\"n_layer\": 1, \"n_head\": 1, \"n_embd\": 8, \"seq_len\": 1048576, "
               "\"vocab_size\": 257}, \"data\": {\"train\": \"d/t_*.bin\"}}",
               "tokens a micro-step, at most 1048576");
  ZT_CHECK(parse(&s, "{\"steps\": 1, \"train_micro_batch_size_per_gpu\": 256, \"model\": "
                     "{\"n_layer\": 1, \"n_head\": 1, \"n_embd\": 8, \"seq_len\": 4096, "
                     "\"vocab_size\": 257}, \"data\": {\"train\": \"d/t_*.bin\"}}") == 0);
}

/* sync: DiLoCo's settings, defaults (OpenDiLoCo's outer optimizer) and
 * what it cannot go with, each refused by name. */
ZT_TEST(sync_modes) {
  zt_spec_t s;
  ZT_REQUIRE(parse(&s, "{" BASE "}") == 0);
  ZT_CHECK(s.diloco == 0);
  ZT_REQUIRE(parse(&s, "{" BASE ", \"sync\": {\"mode\": \"diloco\"}}") == 0);
  ZT_CHECK(s.diloco == 1 && s.inner_steps == 50 && s.outer_nesterov == 1);
  ZT_CHECK(s.outer_lr == 0.7 && s.outer_momentum == 0.9);
  ZT_REQUIRE(parse(&s, "{" BASE ", \"sync\": {\"mode\": \"diloco\", \"inner_steps\": 5, "
                       "\"outer_optimizer\": {\"lr\": 1, \"momentum\": 0, \"nesterov\": false}},"
                       "\"checkpoint\": {\"dir\": \"c\", \"every_steps\": 10}}") == 0);
  ZT_CHECK(s.inner_steps == 5 && s.outer_lr == 1 && s.outer_momentum == 0 && !s.outer_nesterov);
  ZT_REQUIRE(parse(&s, "{" BASE ", \"sync\": {\"mode\": \"sync\"}}") == 0);
  ZT_CHECK(s.diloco == 0);
  ZT_REQUIRE(parse(&s, "{" BASE ", \"sync\": {\"compression\": \"int8\"}, "
                       "\"zero_optimization\": {\"stage\": 1}}") == 0);
  ZT_CHECK(s.compression == 2 && !s.diloco);
  ZT_REQUIRE(parse(&s, "{" BASE ", \"sync\": {\"compression\": \"bf16\"}, "
                       "\"zero_optimization\": {\"stage\": 3}}") == 0);
  ZT_CHECK(s.compression == 1);
  expect_error("{" BASE ", \"sync\": {\"compression\": \"int5\"}}",
               "sync.compression: \"int5\" is none of");
  expect_error("{" BASE ", \"sync\": {\"compression\": \"int4\"}}",
               "\"int4\" needs error feedback, which only sync.mode \"diloco\" keeps");
  ZT_REQUIRE(parse(&s, "{" BASE ", \"sync\": {\"mode\": \"diloco\", \"compression\": "
                       "\"int4\"}}") == 0);
  ZT_CHECK(s.compression == 3);
  expect_error("{" BASE ", \"sync\": {\"overlap_steps\": 2}}",
               "sync.overlap_steps: only sync.mode \"diloco\"");
  expect_error("{" BASE ", \"sync\": {\"mode\": \"diloco\", \"inner_steps\": 4, "
               "\"overlap_steps\": 4}}",
               "sync.overlap_steps (4) must be below sync.inner_steps / sync.fragments (4)");
  ZT_REQUIRE(parse(&s, "{" BASE ", \"sync\": {\"mode\": \"diloco\", \"inner_steps\": 8, "
                       "\"fragments\": 4, \"overlap_steps\": 1}}") == 0);
  ZT_CHECK(s.fragments == 4 && s.overlap_steps == 1);
  expect_error("{" BASE ", \"sync\": {\"mode\": \"diloco\", \"inner_steps\": 8, "
               "\"fragments\": 4, \"overlap_steps\": 2}}",
               "sync.overlap_steps (2) must be below sync.inner_steps / sync.fragments (2)");
  expect_error("{" BASE ", \"sync\": {\"mode\": \"diloco\", \"inner_steps\": 8, "
               "\"fragments\": 3}}", "sync.fragments (3) must divide sync.inner_steps (8)");
  expect_error("{" BASE ", \"sync\": {\"fragments\": 2}}",
               "sync.fragments: only sync.mode \"diloco\" syncs in fragments");
  expect_error("{" BASE ", \"sync\": {\"mode\": \"diloco\", \"inner_steps\": 64, "
               "\"fragments\": 64}}", "sync.fragments (64): the model has");
  expect_error("{" BASE ", \"sync\": {\"mode\": \"diloco\", \"fragments\": 0}}",
               "sync.fragments: 0 is out of range");
  expect_error("{" BASE ", \"sync\": {\"mode\": \"async\"}}",
               "sync.mode: \"async\" is neither \"sync\" nor \"diloco\"");
  expect_error("{" BASE ", \"sync\": {\"inner\": 5}}", "sync.inner: unknown key");
  expect_error("{" BASE ", \"sync\": {\"mode\": \"diloco\", \"inner_steps\": 0}}",
               "sync.inner_steps: 0 is out of range");
  expect_error("{" BASE ", \"sync\": {\"outer_optimizer\": {\"lr\": 0}}}",
               "sync.outer_optimizer.lr: 0 is out of range");
  expect_error("{" BASE ", \"sync\": {\"outer_optimizer\": {\"momentum\": 1}}}",
               "sync.outer_optimizer.momentum: 1 is out of range");
  expect_error("{" BASE ", \"sync\": {\"mode\": \"diloco\"}, \"zero_optimization\": "
               "{\"stage\": 2}}", "zero_optimization.stage must be 0 (got 2;");
  ZT_REQUIRE(parse(&s, "{" BASE ", \"sync\": {\"mode\": \"diloco\", \"group_size\": 2}, "
                       "\"train_batch_size\": 16, \"zero_optimization\": {\"stage\": 2}, "
                       "\"elastic\": {\"min_workers\": 2, \"max_workers\": 4}}") == 0);
  ZT_CHECK(s.group_size == 2 && s.zero_stage == 2);
  int accum = 0;
  ZT_CHECK(zt_spec_accum_for_world(&s, 2, &accum) == 0);
  ZT_CHECK(zt_spec_accum_for_world(&s, 1, &accum) != 0);
  ZT_CHECK(strstr(zt_err_msg(), "world size 1 is not a multiple of sync.group_size 2") != NULL);
  expect_error("{" BASE ", \"sync\": {\"mode\": \"diloco\", \"group_size\": 2}, "
               "\"elastic\": {\"min_workers\": 3, \"max_workers\": 3}}",
               "sync.group_size 2: no world size in elastic's 3..3 workers is a multiple of it");
  expect_error("{" BASE ", \"sync\": {\"group_size\": 2}}",
               "sync.group_size: only sync.mode \"diloco\" has groups");
  expect_error("{" BASE ", \"sync\": {\"mode\": \"diloco\", \"group_size\": 65}}",
               "sync.group_size: 65 is out of range");
  expect_error("{" BASE ", \"sync\": {\"mode\": \"diloco\"}, \"load_balance\": "
               "{\"mode\": \"speed\"}}", "do not go together");
  expect_error("{" BASE ", \"sync\": {\"mode\": \"diloco\", \"inner_steps\": 4}, "
               "\"checkpoint\": {\"dir\": \"c\", \"every_steps\": 6}}",
               "checkpoint.every_steps (6) must be a multiple of sync.inner_steps (4)");
  expect_error("{" BASE ", \"sync\": {\"mode\": \"diloco\", \"inner_steps\": 4}, "
               "\"eval\": {\"every_steps\": 10}}",
               "eval.every_steps (10) must be a multiple of sync.inner_steps (4)");
}

ZT_TEST_MAIN(full_spec, defaults, unknown_keys, types_and_ranges, load_file,
             trailing_text_and_huge_accumulation, sync_modes)
