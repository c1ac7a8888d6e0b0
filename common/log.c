/*
 * log.c: leveled logging to stderr.
 *
 * Each line carries a wall-clock timestamp, the level, the process prefix and
 * the message. Lines are written with one write(2) so that concurrent
 * threads (and, under systemd, the journal) never see interleaved halves.
 *
 * A message is one line whatever it holds: names, reasons and paths often
 * come from the network (a job's name, a worker's report), so every
 * control character of the message (a newline, an escape sequence), and
 * every byte of an invalid UTF-8 sequence, is written as \xNN
 * (zt_printable). Text from outside can neither split a line nor forge
 * one, nor drive an operator's terminal.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "zt_common.h"

static zt_log_level_t g_level = ZT_LOG_INFO;
static char g_prefix[64] = "ztrain";

void zt_log_set_level(zt_log_level_t level) { g_level = level; }

int zt_log_set_level_name(const char *name) {
  static const char *names[] = {"debug", "info", "warn", "error"};
  for (int i = 0; i < 4; i++) {
    if (strcmp(name, names[i]) == 0) {
      g_level = (zt_log_level_t)i;
      return 0;
    }
  }
  return zt_err("unknown log level '%s' (want debug, info, warn or error)", name);
}

void zt_log_set_prefix(const char *prefix) { snprintf(g_prefix, sizeof g_prefix, "%s", prefix); }

void zt_log(zt_log_level_t level, const char *fmt, ...) {
  static const char *tags[] = {"DEBUG", "INFO", "WARN", "ERROR"};
  if (level < g_level) return;
  char line[2048];
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  int n = snprintf(line, sizeof line, "%02d:%02d:%02d.%03ld %-5s %s: ", tm.tm_hour, tm.tm_min,
                   tm.tm_sec, ts.tv_nsec / 1000000, tags[level], g_prefix);
  char msg[1536];
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (m < 0) msg[0] = 0;
  zt_printable(msg, line + n, sizeof line - (size_t)n - 1);
  size_t len = (size_t)n + strlen(line + n);
  line[len++] = '\n';
  ssize_t w = write(STDERR_FILENO, line, len);
  (void)w;
}
