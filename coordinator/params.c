/*
 * params.c: a job's parameters, the numbers of its spec the coordinator
 * schedules by.
 *
 * A submitted spec is read with the trainer's own parser (engine/spec.c,
 * through the zt_engine_spec library), so the coordinator and the workers
 * can never read a spec differently; this file keeps of it what the
 * scheduler needs (zt_job_params_t: batch sizes, the elastic range and the
 * restart policy, checkpointing, rollback, the memory one rank needs at
 * each world size) and checks it against the coordinator's settings:
 *
 *   - Paths. data.train, data.val, init.from_safetensors, checkpoint.dir
 *     and checkpoint.load must lie under the coordinator's roots
 *     (--data-root, --checkpoint-root); the checkpoint directories are kept
 *     resolved, because the coordinator deletes what is under them. The
 *     epochs under checkpoint.dir must have names the workers' replica
 *     stores accept.
 *   - Test knobs. fault_injection is refused unless zcoord runs with
 *     --allow-test-knobs.
 *   - World size. The global batch (train_batch_size samples) is fixed for
 *     the life of the job; a generation of N ranks runs accum = global /
 *     (micro * N) micro-steps per step, so some N in [min_workers,
 *     max_workers] must divide global / micro. For each such N the memory
 *     one rank needs is worked out here (engine/memplan.h), once.
 *
 * Pure: no loop, no database, no coordinator state; jobs.c calls it at
 * submit and again for every stored job at start (a spec that no longer
 * passes fails its job), and tests/unit/test_params.c drives it directly.
 */
#include <stdio.h>
#include <string.h>

#include "coord.h"
#include "spec.h"

/* The epochs under checkpoint.dir (resolved: dir) must have names that the
 * replica stores take and the holdings scan lists (zt_epoch_parse: no
 * hidden component, at most ZT_EPOCH_MAX_DEPTH deep under the root), or
 * their copies would be refused at every checkpoint: refused at submit
 * instead. */
static int check_epoch_names(const zt_coord_config_t *cfg, const char *spec_dir,
                             const char *dir) {
  const char *rel = dir[0] ? zt_path_under(cfg->ckpt_root, dir) : NULL;
  if (!rel || !rel[0]) return 0;
  char name[ZT_EPOCH_NAME_MAX], probe[ZT_PATH_MAX];
  zt_epoch_t e;
  zt_epoch_name(name, sizeof name, 1, 1, 1);
  if (zt_path_join(probe, sizeof probe, rel, name) != 0 || zt_epoch_parse(probe, &e) != 0)
    return zt_err_wrapk(ZT_E_INVALID, "checkpoint.dir \"%.200s\": its epochs cannot be named "
                        "for the replica stores (at most %d directories under the checkpoint "
                        "root, none hidden)", spec_dir, ZT_EPOCH_MAX_DEPTH - 2);
  return 0;
}

/* The spec's paths must lie under the coordinator's roots; the checkpoint
 * directories are kept resolved (the coordinator deletes what is under
 * them). */
static int confine_paths(const zt_spec_t *s, const zt_coord_config_t *cfg, zt_job_params_t *p) {
  char tmp[ZT_PATH_MAX];
  if (zt_path_confine(cfg->data_root, s->train_glob, "data.train", tmp, sizeof tmp) != 0 ||
      (s->val_glob[0] &&
       zt_path_confine(cfg->data_root, s->val_glob, "data.val", tmp, sizeof tmp) != 0) ||
      (s->init_from[0] &&
       zt_path_confine(cfg->data_root, s->init_from,
                       s->init_dir ? "init.from_pretrained" : "init.from_safetensors", tmp,
                       sizeof tmp) != 0) ||
      (s->ckpt.dir[0] && zt_path_confine(cfg->ckpt_root, s->ckpt.dir, "checkpoint.dir",
                                         p->ckpt_dir, sizeof p->ckpt_dir) != 0) ||
      (s->ckpt.load[0] && zt_path_confine(cfg->ckpt_root, s->ckpt.load, "checkpoint.load",
                                          p->ckpt_load, sizeof p->ckpt_load) != 0))
    return -1;
  return check_epoch_names(cfg, s->ckpt.dir, p->ckpt_dir);
}

/* The numbers that shape scheduling, as the spec (with its defaults) has
 * them. */
static void copy_numbers(const zt_spec_t *s, zt_job_params_t *p) {
  snprintf(p->name, sizeof p->name, "%s", s->name);
  p->steps = s->steps;
  p->micro = s->micro_batch;
  p->global_batch = s->global_batch;
  p->seq_len = s->model.seq_len;
  p->min_workers = s->min_workers;
  p->max_workers = s->max_workers;
  p->comm_timeout_ms = s->comm_timeout_ms;
  p->ckpt_every = s->ckpt.every_steps;
  p->keep_last = s->ckpt.keep_last > 0 ? s->ckpt.keep_last : 2;
  p->keep_every = s->ckpt.keep_every;
  p->rb_enabled = s->rollback.enabled;
  p->rb_window = s->rollback.window;
  p->rb_threshold = s->rollback.threshold;
  p->rb_patience = s->rollback.patience;
  p->rb_margin = s->rollback.margin_steps;
  p->rb_skip = s->rollback.skip_steps;
  p->rb_lr_factor = s->rollback.lr_factor;
  p->rb_cooldown = s->rollback.cooldown_steps;
  p->rb_max = s->rollback.max_rollbacks;
  p->rb_per_steps = s->rollback.per_steps;
  p->restart = s->restart;
  p->max_uncommitted = s->ckpt.max_uncommitted_steps;
  p->replicas = s->ckpt.replicas;
  p->ckpt_shared = s->ckpt.shared;
  p->zero_stage = s->zero_stage;
  p->group_size = s->diloco ? (int)s->group_size : 1;
}

/* Some N in [min, max] must divide the number of micro-batches per step
 * (any N up to it with shares by speed); the memory one rank needs is
 * worked out for each such N. */
static int size_worlds(const zt_spec_t *s, zt_job_params_t *p) {
  if (p->max_workers > ZT_MAX_WORLD)
    return zt_errk(ZT_E_INVALID, "elastic.max_workers %d exceeds %d", p->max_workers,
                   ZT_MAX_WORLD);
  int any = 0;
  for (int n = p->min_workers; n <= p->max_workers; n++) {
    int accum;
    if (zt_spec_accum_for_world(s, n, &accum) != 0) continue;
    any = p->world_ok[n] = 1;
    if (zt_memplan_need(s, n, &p->need[n]) != 0) return zt_err_wrapk(ZT_E_INVALID, "model");
  }
  if (!any)
    return zt_errk(ZT_E_INVALID,
                   "no world size in %d..%d divides train_batch_size / micro batch = %lld; the "
                   "global batch must stay fixed when workers come and go (with load_balance "
                   "mode \"speed\" any world size up to it will do)",
                   p->min_workers, p->max_workers, (long long)(p->global_batch / p->micro));
  return 0;
}

int zt_params_parse(const char *json, const zt_coord_config_t *cfg, zt_job_params_t *p) {
  memset(p, 0, sizeof *p);
  zt_spec_t s;
  if (zt_spec_parse(&s, json, strlen(json)) != 0) return zt_err_wrapk(ZT_E_INVALID, "job spec");
  if (s.fault.present && !cfg->allow_test_knobs)
    return zt_errk(ZT_E_INVALID, "fault_injection: a test-only setting, refused (zcoord "
                                 "--allow-test-knobs accepts it)");
  if (confine_paths(&s, cfg, p) != 0) return -1;
  copy_numbers(&s, p);
  return size_worlds(&s, p);
}
