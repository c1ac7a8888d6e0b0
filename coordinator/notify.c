/*
 * notify.c: systemd integration of zcoord (sd_notify).
 *
 * Under systemd with Type=notify, zcoord says READY=1 once its gRPC and HTTP
 * ports are bound and its state is loaded, and STOPPING=1 when it begins a
 * clean shutdown. With WatchdogSec= set, systemd exports WATCHDOG_USEC and
 * expects WATCHDOG=1 at least that often; zcoord sends it from a loop timer
 * at half the period, so a loop that stops turning (a deadlock, a runaway
 * handler) stops the pings and systemd restarts the service. Outside systemd
 * (NOTIFY_SOCKET unset) every call here is a no-op.
 */
#include <string.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "coord.h"

static void on_watchdog(uv_timer_t *t) {
  (void)t;
  sd_notify(0, "WATCHDOG=1");
}

void zt_notify_ready(zt_coord_t *c) {
  int r = sd_notifyf(0, "READY=1\nSTATUS=serving gRPC on %s, HTTP on %s, %zu workers known\n"
                        "MAINPID=%d",
                     c->cfg.grpc_addr, c->cfg.http_addr, c->n_members, (int)getpid());
  if (r < 0) ZT_WARN("sd_notify READY failed: %s", strerror(-r));
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) {
    uint64_t every_ms = usec / 2000;
    if (every_ms == 0) every_ms = 1;
    ZT_INFO("systemd watchdog every %llu ms", (unsigned long long)every_ms);
    uv_timer_start(&c->watchdog_timer, on_watchdog, 0, every_ms);
  }
}

void zt_notify_stopping(void) { sd_notify(0, "STOPPING=1"); }
