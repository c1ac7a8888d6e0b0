/*
 * main.c: zcoord, the ztrain coordinator daemon.
 *
 * Start-up order: parse flags and the optional JSON config file (flags win),
 * open SQLite (migrating the schema), bump the coordinator epoch, load the
 * members, bind gRPC and HTTP, start the liveness timers, tell systemd we are
 * ready, run the loop. SIGINT/SIGTERM stop it in the reverse order: the HTTP
 * side first (its callers are released), then gRPC (calls in flight are
 * answered UNAVAILABLE), then last_seen is flushed and the database closed.
 *
 * Everything after start-up happens on the one libuv loop: RPC handlers
 * (service.c), HTTP routes (http.c), the liveness check (members.c, whose
 * verdicts this file hands to the scheduler, jobs.c).
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coord.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: zcoord [--grpc HOST:PORT] [--http HOST:PORT] [--db FILE]\n"
          "              [--heartbeat-ms N] [--heartbeat-timeout-ms N] [--config FILE]\n"
          "              [--worker-secret S] [--api-token T] [--web DIR] [--log-level L]\n"
          "              [--ready-file FILE]  (JSON with the bound ports, once serving)\n"
          "Defaults: --grpc 127.0.0.1:7070 --http 127.0.0.1:7080 --db zcoord.db\n"
          "          --heartbeat-ms 1000 --heartbeat-timeout-ms 3000 (3 intervals)\n");
}

static void config_defaults(zt_coord_config_t *cfg) {
  memset(cfg, 0, sizeof *cfg);
  snprintf(cfg->grpc_addr, sizeof cfg->grpc_addr, "127.0.0.1:7070");
  snprintf(cfg->http_addr, sizeof cfg->http_addr, "127.0.0.1:7080");
  snprintf(cfg->db_path, sizeof cfg->db_path, "zcoord.db");
  cfg->heartbeat_ms = 1000;
  cfg->heartbeat_timeout_ms = 0; /* derived: 3 x heartbeat_ms */
  cfg->max_message_bytes = 4u << 20;
  snprintf(cfg->web_dir, sizeof cfg->web_dir, "%s", ZT_WEB_DIR);
}

static int set_str(char *dst, size_t n, const char *key, const char *v) {
  if (strlen(v) >= n) return zt_err("%s: value too long (max %zu bytes)", key, n - 1);
  snprintf(dst, n, "%s", v);
  return 0;
}

static int set_int(int *dst, const char *key, const char *v, int lo, int hi) {
  char *end;
  long x = strtol(v, &end, 10);
  if (!*v || *end || x < lo || x > hi)
    return zt_err("%s: expected an integer in %d..%d, got \"%.32s\"", key, lo, hi, v);
  *dst = (int)x;
  return 0;
}

/* Applies one setting by name; shared by the config file and the flags. */
static int apply(zt_coord_config_t *cfg, const char *key, const char *v) {
  if (!strcmp(key, "grpc")) return set_str(cfg->grpc_addr, sizeof cfg->grpc_addr, key, v);
  if (!strcmp(key, "http")) return set_str(cfg->http_addr, sizeof cfg->http_addr, key, v);
  if (!strcmp(key, "db")) return set_str(cfg->db_path, sizeof cfg->db_path, key, v);
  if (!strcmp(key, "web")) return set_str(cfg->web_dir, sizeof cfg->web_dir, key, v);
  if (!strcmp(key, "worker_secret"))
    return set_str(cfg->worker_secret, sizeof cfg->worker_secret, key, v);
  if (!strcmp(key, "api_token")) return set_str(cfg->api_token, sizeof cfg->api_token, key, v);
  if (!strcmp(key, "ready_file")) return set_str(cfg->ready_file, sizeof cfg->ready_file, key, v);
  if (!strcmp(key, "heartbeat_ms")) return set_int(&cfg->heartbeat_ms, key, v, 10, 600000);
  if (!strcmp(key, "heartbeat_timeout_ms"))
    return set_int(&cfg->heartbeat_timeout_ms, key, v, 20, 3600000);
  if (!strcmp(key, "log_level")) {
    if (zt_log_set_level_name(v) != 0) return zt_err("log_level: unknown level \"%.32s\"", v);
    return 0;
  }
  return zt_err("unknown setting \"%.64s\"", key);
}

/* Reads a flat JSON object of settings; an unknown key is an error. */
static int load_config(zt_coord_config_t *cfg, const char *path) {
  char *text = NULL;
  size_t len;
  if (zt_read_file(path, &text, &len, 1 << 20) != 0) return zt_err_wrap("config %s", path);
  cJSON *doc = cJSON_ParseWithLength(text, len);
  int ret = -1;
  if (!doc || !cJSON_IsObject(doc)) {
    const char *at = cJSON_GetErrorPtr();
    zt_err("config %s: not a JSON object%s%.20s", path, at ? " near: " : "", at ? at : "");
    goto out;
  }
  for (cJSON *it = doc->child; it; it = it->next) {
    char buf[64];
    const char *v;
    if (cJSON_IsString(it)) {
      v = it->valuestring;
    } else if (cJSON_IsNumber(it)) {
      snprintf(buf, sizeof buf, "%.0f", it->valuedouble);
      v = buf;
    } else {
      zt_err("config %s: %s: expected a string or a number", path, it->string);
      goto out;
    }
    if (apply(cfg, it->string, v) != 0) {
      zt_err_wrap("config %s", path);
      goto out;
    }
  }
  ret = 0;
out:
  cJSON_Delete(doc);
  free(text);
  return ret;
}

static int parse_args(zt_coord_config_t *cfg, int argc, char **argv) {
  static const struct option opts[] = {
      {"grpc", required_argument, 0, 'g'},
      {"http", required_argument, 0, 'H'},
      {"db", required_argument, 0, 'd'},
      {"web", required_argument, 0, 'w'},
      {"heartbeat-ms", required_argument, 0, 'b'},
      {"heartbeat-timeout-ms", required_argument, 0, 't'},
      {"config", required_argument, 0, 'c'},
      {"worker-secret", required_argument, 0, 's'},
      {"api-token", required_argument, 0, 'a'},
      {"log-level", required_argument, 0, 'l'},
      {"ready-file", required_argument, 0, 'r'},
      {"help", no_argument, 0, 'h'},
      {0, 0, 0, 0},
  };
  /* The config file is applied first so that flags override it. */
  for (int i = 1; i < argc - 1; i++)
    if (!strcmp(argv[i], "--config") && load_config(cfg, argv[i + 1]) != 0) return -1;
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    const char *key = NULL;
    switch (ch) {
    case 'g': key = "grpc"; break;
    case 'H': key = "http"; break;
    case 'd': key = "db"; break;
    case 'w': key = "web"; break;
    case 'b': key = "heartbeat_ms"; break;
    case 't': key = "heartbeat_timeout_ms"; break;
    case 's': key = "worker_secret"; break;
    case 'a': key = "api_token"; break;
    case 'l': key = "log_level"; break;
    case 'r': key = "ready_file"; break;
    case 'c': continue;
    case 'h': usage(stdout); exit(0);
    default: usage(stderr); return zt_err("bad command line");
    }
    if (apply(cfg, key, optarg) != 0) return -1;
  }
  if (optind < argc) return zt_err("unexpected argument \"%s\"", argv[optind]);
  if (cfg->heartbeat_timeout_ms == 0) cfg->heartbeat_timeout_ms = 3 * cfg->heartbeat_ms;
  if (cfg->heartbeat_timeout_ms <= cfg->heartbeat_ms)
    return zt_err("heartbeat timeout (%d ms) must exceed the interval (%d ms)",
                  cfg->heartbeat_timeout_ms, cfg->heartbeat_ms);
  return 0;
}

/* ---- lifecycle --------------------------------------------------------- */

/* Writes {"pid":..,"grpc_port":..,"http_port":..} atomically (tmp + rename),
 * so launchers and tests can bind port 0 and learn the real ports. */
static int write_ready_file(zt_coord_t *c) {
  char tmp[600], text[160];
  snprintf(tmp, sizeof tmp, "%s.tmp", c->cfg.ready_file);
  int n = snprintf(text, sizeof text, "{\"pid\": %d, \"grpc_port\": %d, \"http_port\": %d}\n",
                   (int)getpid(), zt_rpc_server_port(c->rpc), zt_http_port(c->http));
  FILE *f = fopen(tmp, "w");
  if (!f) return zt_err_errno("ready file %s", tmp);
  int ok = fwrite(text, 1, (size_t)n, f) == (size_t)n;
  if (fclose(f) != 0 || !ok) return zt_err_errno("ready file %s", tmp);
  if (rename(tmp, c->cfg.ready_file) != 0) return zt_err_errno("ready file %s", c->cfg.ready_file);
  return 0;
}

/* Liveness: members silent for the timeout are lost, and their jobs
 * re-form without them. */
static void on_check(uv_timer_t *t) {
  zt_coord_t *c = t->data;
  uint64_t *lost;
  size_t n = zt_members_check(c, &lost);
  for (size_t i = 0; i < n; i++) zt_jobs_member_gone(c, zt_members_get(c, lost[i]), "was lost");
  free(lost);
  zt_jobs_schedule(c);
}
static void on_flush(uv_timer_t *t) { zt_members_flush(t->data); }

static void stop(zt_coord_t *c, const char *why) {
  ZT_INFO("stopping (%s)", why);
  zt_notify_stopping();
  zt_loopcall_close(&c->loopcall);
  zt_http_stop(c->http);
  c->http = NULL;
  zt_jobs_release_calls(c);
  zt_rpc_server_stop(c->rpc);
  c->rpc = NULL;
  uv_timer_stop(&c->check_timer);
  uv_timer_stop(&c->flush_timer);
  uv_timer_stop(&c->watchdog_timer);
  uv_close((uv_handle_t *)&c->check_timer, NULL);
  uv_close((uv_handle_t *)&c->flush_timer, NULL);
  uv_close((uv_handle_t *)&c->watchdog_timer, NULL);
  uv_close((uv_handle_t *)&c->sigint, NULL);
  uv_close((uv_handle_t *)&c->sigterm, NULL);
}

static void on_signal(uv_signal_t *s, int signum) {
  stop(s->data, signum == SIGINT ? "SIGINT" : "SIGTERM");
}

static int start(zt_coord_t *c) {
  if (zt_db_open(c->cfg.db_path, &c->db) != 0) return -1;
  if (zt_db_meta_get(c->db, "epoch", &c->epoch, 0) != 0) return -1;
  c->epoch++;
  if (zt_db_meta_set(c->db, "epoch", c->epoch) != 0) return -1;
  if (zt_members_load(c) != 0 || zt_jobs_load(c) != 0) return -1;
  c->started_ms = zt_wall_ms();
  zt_coord_event(c, 0, "coordinator_started", 0, "epoch %lld, %zu workers restored from %s",
                 (long long)c->epoch, c->n_members, c->cfg.db_path);

  if (zt_loopcall_init(c->loop, &c->loopcall) != 0) return zt_err("cannot init loop handle");
  zt_rpc_server_opts_t ro = {.max_message_bytes = c->cfg.max_message_bytes};
  if (zt_rpc_server_start(c->loop, c->cfg.grpc_addr, &ro, zt_coord_rpc_dispatch, c, &c->rpc) != 0)
    return -1;
  if (zt_http_start(c, c->cfg.http_addr, &c->http) != 0) return -1;
  ZT_INFO("gRPC on %s (port %d), HTTP on %s (port %d), db %s, heartbeat %d ms, timeout %d ms",
          c->cfg.grpc_addr, zt_rpc_server_port(c->rpc), c->cfg.http_addr, zt_http_port(c->http),
          c->cfg.db_path, c->cfg.heartbeat_ms, c->cfg.heartbeat_timeout_ms);

  uv_timer_init(c->loop, &c->check_timer);
  uv_timer_init(c->loop, &c->flush_timer);
  uv_timer_init(c->loop, &c->watchdog_timer);
  c->check_timer.data = c->flush_timer.data = c->watchdog_timer.data = c;
  uint64_t check_every = (uint64_t)ZT_MAX(10, c->cfg.heartbeat_ms / 4);
  uv_timer_start(&c->check_timer, on_check, check_every, check_every);
  uv_timer_start(&c->flush_timer, on_flush, 5000, 5000);
  uv_signal_init(c->loop, &c->sigint);
  uv_signal_init(c->loop, &c->sigterm);
  c->sigint.data = c->sigterm.data = c;
  uv_signal_start(&c->sigint, on_signal, SIGINT);
  uv_signal_start(&c->sigterm, on_signal, SIGTERM);
  if (c->cfg.ready_file[0] && write_ready_file(c) != 0) return -1;
  zt_notify_ready(c);
  return 0;
}

int main(int argc, char **argv) {
  zt_log_set_prefix("zcoord");
  signal(SIGPIPE, SIG_IGN);
  static zt_coord_t c;
  config_defaults(&c.cfg);
  if (parse_args(&c.cfg, argc, argv) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 2;
  }
  c.loop = uv_default_loop();
  if (start(&c) != 0) {
    ZT_ERROR("cannot start: %s", zt_err_msg());
    return 1;
  }
  uv_run(c.loop, UV_RUN_DEFAULT);
  zt_members_flush(&c);
  zt_jobs_free(&c);
  zt_members_free(&c);
  zt_db_close(c.db);
  uv_loop_close(c.loop);
  ZT_INFO("stopped");
  return 0;
}
