/*
 * main.c: zcoord, the ztrain coordinator daemon.
 *
 * Start-up order: read the settings (config.c: the optional JSON config
 * file, then the flags, which win),
 * open SQLite (migrating the schema), bump the coordinator epoch, load the
 * members, bind gRPC and HTTP, start the liveness timers, tell systemd we are
 * ready, run the loop. SIGINT/SIGTERM stop it in the reverse order: the HTTP
 * side first (its callers are released), then gRPC (calls in flight are
 * answered UNAVAILABLE), then last_seen is flushed and the database closed.
 *
 * Everything after start-up happens on the one libuv loop: RPC handlers
 * (service.c), HTTP routes (http.c), the liveness check (members.c, whose
 * verdicts this file hands to the scheduler, sched.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coord.h"

/* ---- lifecycle --------------------------------------------------------- */

/* Writes {"pid":..,"grpc_port":..,"http_port":..} atomically (tmp + rename),
 * so launchers and tests can bind port 0 and learn the real ports. */
static int write_ready_file(zt_coord_t *c) {
  char tmp[ZT_PATH_MAX], text[160];
  if (zt_path_fmt(tmp, sizeof tmp, "%s.tmp", c->cfg.ready_file) != 0) return -1;
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
 * re-form without them. Heartbeats already received are handled first, and
 * a loop that was held up (a slow transaction, the whole process paused)
 * credits its own absence to every member, so a coordinator stall never
 * makes healthy workers suspect or lost. */
static void on_check(uv_timer_t *t) {
  zt_coord_t *c = t->data;
  int64_t now = zt_now_ms(), every = (int64_t)uv_timer_get_repeat(t);
  int64_t stall = now - c->last_check_ms - every;
  c->last_check_ms = now;
  if (stall > c->max_stall_ms) c->max_stall_ms = stall;
  if (stall > every) zt_members_credit(c, stall);
  zt_members_pace(c);
  int64_t lag = zt_rpc_server_lag_ms(c->rpc);
  if (lag > c->max_lag_ms) c->max_lag_ms = lag;
  uint64_t *lost;
  size_t n = zt_members_check(c, lag, &lost);
  for (size_t i = 0; i < n; i++)
    zt_sched_member_gone(c, zt_members_get(c, lost[i]), "was lost", 1);
  free(lost);
  zt_sched_run(c);
  zt_prov_tick(c);
}
/* Every 250 ms a twentieth of the members' last_seen (each one every 5 s),
 * the jobs' progress every 5 s. */
static void on_flush(uv_timer_t *t) {
  zt_coord_t *c = t->data;
  zt_members_flush(c, ZT_MAX((size_t)1024, c->by_id_cap / 20 + 1));
  if (++c->flush_ticks % 20 == 0) zt_jobtable_flush(c);
}

static void stop(zt_coord_t *c, const char *why) {
  ZT_INFO("stopping (%s)", why);
  zt_notify_stopping();
  zt_loopcall_close(&c->loopcall);
  zt_http_stop(c->http);
  c->http = NULL;
  zt_rdv_release_all(c);
  zt_rpc_server_stop(c->rpc);
  c->rpc = NULL;
  uv_timer_stop(&c->check_timer);
  uv_timer_stop(&c->flush_timer);
  uv_timer_stop(&c->watchdog_timer);
  zt_prov_stop(c);
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
  if (zt_db_open(c->cfg.db_path, c->cfg.new_db ? ZT_DB_NEW_IF_EMPTY : 0, &c->db) != 0) return -1;
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
  /* The first check measures its stall from here: a pause before it (the
   * process stopped right after start) is credited like any other. */
  c->last_check_ms = zt_now_ms();
  uv_timer_start(&c->check_timer, on_check, check_every, check_every);
  uv_timer_start(&c->flush_timer, on_flush, 250, 250);
  uv_signal_init(c->loop, &c->sigint);
  uv_signal_init(c->loop, &c->sigterm);
  c->sigint.data = c->sigterm.data = c;
  uv_signal_start(&c->sigint, on_signal, SIGINT);
  uv_signal_start(&c->sigterm, on_signal, SIGTERM);
  if (zt_prov_start(c) != 0) return -1;
  if (c->cfg.ready_file[0] && write_ready_file(c) != 0) return -1;
  zt_notify_ready(c);
  return 0;
}

int main(int argc, char **argv) {
  if (zt_version_arg(argc, argv, "zcoord")) return 0;
  zt_log_set_prefix("zcoord");
  signal(SIGPIPE, SIG_IGN);
  static zt_coord_t c;
  zt_config_defaults(&c.cfg);
  if (zt_config_parse(&c.cfg, argc, argv) != 0) {
    ZT_ERROR("%s", zt_err_msg());
    return 2;
  }
  c.loop = uv_default_loop();
  if (start(&c) != 0) {
    ZT_ERROR("cannot start: %s", zt_err_msg());
    return 1;
  }
  uv_run(c.loop, UV_RUN_DEFAULT);
  zt_members_flush(&c, ZT_FLUSH_ALL);
  zt_jobtable_flush(&c);
  zt_prov_free(&c);
  zt_jobs_free(&c);
  zt_members_free(&c);
  zt_db_close(c.db);
  uv_loop_close(c.loop);
  ZT_INFO("stopped");
  return 0;
}
