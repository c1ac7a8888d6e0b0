/*
 * fuzz_coord.c: the coordinator the fuzz targets drive (see fuzz_coord.h).
 */
#include "fuzz_coord.h"
#include "fuzz_fail.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ztrain.pb-c.h"

static zt_coord_t *g_c;
static char g_dir[256];
static int g_inputs;
static uint64_t g_worker;
static char g_session[80];

typedef struct {
  int done, status;
  uint8_t *resp;
  size_t len;
} reply_box;

static void on_reply(void *user, int status, const char *message, const uint8_t *resp,
                     size_t len) {
  (void)message;
  reply_box *b = user;
  if (!b) return; /* a held call answered after its input */
  b->done = 1;
  b->status = status;
  if (resp && len) {
    b->resp = zt_xmalloc(len);
    memcpy(b->resp, resp, len);
    b->len = len;
  }
}

int zt_fuzz_rpc(const char *method, const uint8_t *req, size_t len, int with_token,
                uint8_t **resp, size_t *resp_len) {
  reply_box *b = zt_xcalloc(1, sizeof *b);
  zt_rpc_call_t *call =
      zt_rpc_call_local(with_token ? "Bearer " ZT_FUZZ_TOKEN : NULL, on_reply, b);
  zt_coord_rpc_dispatch(call, method, req, len, zt_fuzz_coord());
  int status = b->done ? b->status : -1; /* -1: held (a rendezvous) */
  if (!b->done) {
    /* The call is held; its later answer must not touch this box. */
    zt_rdv_release_all(g_c);
  }
  if (resp) *resp = b->resp, *resp_len = b->len;
  else free(b->resp);
  free(b);
  return status;
}

static void must(int ok, const char *what) {
  if (ok) return;
  fprintf(stderr, "fuzz_coord: %s: %s\n", what, zt_err_msg());
  ZT_FUZZ_FAIL();
}

static void register_worker(void) {
  Ztrain__RegisterRequest r = ZTRAIN__REGISTER_REQUEST__INIT;
  r.name = "fz";
  r.host = "fuzz";
  r.device = "cpu";
  r.host_memory_bytes = 8ull << 30;
  uint8_t buf[256], *resp;
  size_t n = ztrain__register_request__pack(&r, buf), rl;
  must(zt_fuzz_rpc("/ztrain.Control/RegisterWorker", buf, n, 0, &resp, &rl) == 0, "register");
  Ztrain__RegisterReply *rep = ztrain__register_reply__unpack(NULL, rl, resp);
  must(rep != NULL, "register reply");
  g_worker = rep->worker_id;
  snprintf(g_session, sizeof g_session, "%s", rep->session);
  ztrain__register_reply__free_unpacked(rep, NULL);
  free(resp);
}

static void submit_job(void) {
  char spec[1024];
  snprintf(spec, sizeof spec,
           "{\"name\": \"fz\", \"steps\": 10, \"model\": {\"n_layer\": 1, \"n_head\": 2, "
           "\"n_embd\": 8, \"seq_len\": 8, \"vocab_size\": 64}, \"data\": {\"train\": "
           "\"%s/train_*.bin\"}, \"train_micro_batch_size_per_gpu\": 1, \"train_batch_size\": 2, "
           "\"checkpoint\": {\"dir\": \"%s/ck\", \"every_steps\": 2}}",
           g_dir, g_dir);
  Ztrain__SubmitJobRequest r = ZTRAIN__SUBMIT_JOB_REQUEST__INIT;
  r.spec_json = spec;
  size_t n = ztrain__submit_job_request__get_packed_size(&r);
  uint8_t *buf = zt_xmalloc(n);
  ztrain__submit_job_request__pack(&r, buf);
  must(zt_fuzz_rpc("/ztrain.Status/SubmitJob", buf, n, 1, NULL, NULL) == 0, "submit");
  free(buf);
}

/* The coordinator's directory (database, checkpoints) goes when the fuzzer
 * exits normally; a crash leaves it for the report. */
static void remove_dir(void) { zt_remove_tree(g_dir); }

static void build(void) {
  if (!g_dir[0]) {
    snprintf(g_dir, sizeof g_dir, "/tmp/zt-fuzz-XXXXXX");
    must(mkdtemp(g_dir) != NULL, "mkdtemp");
    atexit(remove_dir);
  }
  zt_log_set_level((zt_log_level_t)(ZT_LOG_ERROR + 1)); /* quiet */
  g_c = zt_xcalloc(1, sizeof *g_c);
  zt_config_defaults(&g_c->cfg);
  zt_coord_config_t *cfg = &g_c->cfg;
  snprintf(cfg->db_path, sizeof cfg->db_path, "%s/coord.db", g_dir);
  snprintf(cfg->data_root, sizeof cfg->data_root, "%s", g_dir);
  snprintf(cfg->ckpt_root, sizeof cfg->ckpt_root, "%s", g_dir);
  snprintf(cfg->api_token, sizeof cfg->api_token, "%s", ZT_FUZZ_TOKEN);
  cfg->allow_test_knobs = 1;
  unlink(cfg->db_path);
  g_c->loop = uv_default_loop();
  must(zt_db_open(cfg->db_path, ZT_DB_NEW_IF_EMPTY, &g_c->db) == 0, "open database");
  must(zt_members_load(g_c) == 0 && zt_jobs_load(g_c) == 0, "load");
  register_worker();
  submit_job();
}

static void tear_down(void) {
  zt_rdv_release_all(g_c);
  uv_run(g_c->loop, UV_RUN_DEFAULT); /* queued deletions finish */
  zt_jobs_free(g_c);
  zt_members_free(g_c);
  zt_db_close(g_c->db);
  free(g_c);
  g_c = NULL;
}

zt_coord_t *zt_fuzz_coord(void) {
  if (!g_c) build();
  return g_c;
}

void zt_fuzz_coord_done(void) {
  uv_run(g_c->loop, UV_RUN_NOWAIT);
  if (++g_inputs % ZT_FUZZ_RESET == 0) tear_down();
}

uint64_t zt_fuzz_worker_id(void) {
  zt_fuzz_coord();
  return g_worker;
}

const char *zt_fuzz_session(void) {
  zt_fuzz_coord();
  return g_session;
}
