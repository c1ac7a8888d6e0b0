/*
 * config.c: zcoord's settings: defaults, the JSON config file, the flags.
 *
 * One table (k_settings) lists every setting once: its JSON key, its type,
 * where it lives in zt_coord_config_t and its help. The flag of a setting
 * is its key with '-' for '_' (--heartbeat-ms for heartbeat_ms); the usage
 * text is made from the table. The config file (a flat JSON object; an
 * unknown key is an error naming it) is applied first, then the flags, so
 * flags win.
 *
 * Secure by default: zcoord refuses to serve gRPC or HTTP on an address
 * other than loopback unless both an API token (operators) and a worker
 * secret (workers) are configured; --insecure overrides, with a warning.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coord.h"
#include "zt_json.h"
#include "zt_net.h"

typedef enum { SET_STR, SET_INT, SET_BOOL, SET_LOG } set_kind;

typedef struct {
  const char *key;
  set_kind kind;
  size_t off, size; /* field in zt_coord_config_t */
  int lo, hi;       /* SET_INT range */
  const char *arg, *help;
} setting;

#define FIELD(f) offsetof(zt_coord_config_t, f), sizeof(((zt_coord_config_t *)0)->f)

static const setting k_settings[] = {
    {"grpc", SET_STR, FIELD(grpc_addr), 0, 0, "HOST:PORT", "gRPC (workers, zctl); :0 = any port"},
    {"http", SET_STR, FIELD(http_addr), 0, 0, "HOST:PORT", "HTTP/JSON API and dashboard"},
    {"db", SET_STR, FIELD(db_path), 0, 0, "FILE", "the SQLite state file"},
    {"new_db", SET_BOOL, FIELD(new_db), 0, 0, NULL,
     "accept an existing empty database file as a new one"},
    {"data_root", SET_STR, FIELD(data_root), 0, 0, "DIR",
     "job data (data.train, data.val) must lie under DIR"},
    {"checkpoint_root", SET_STR, FIELD(ckpt_root), 0, 0, "DIR",
     "checkpoints (checkpoint.dir, checkpoint.load) must lie under DIR"},
    {"heartbeat_ms", SET_INT, FIELD(heartbeat_ms), 10, 600000, "N", "heartbeat interval"},
    {"heartbeat_timeout_ms", SET_INT, FIELD(heartbeat_timeout_ms), 20, 3600000, "N",
     "a worker silent this long is lost (default 3 intervals)"},
    {"heartbeat_capacity", SET_INT, FIELD(heartbeat_capacity), 0, 100000000, "N",
     "heartbeats per second this coordinator takes before it asks workers to slow down "
     "(default 20000; 0: never)"},
    {"blind_max_ms", SET_INT, FIELD(blind_max_ms), 0, 86400000, "N",
     "hearing from no worker at all, lose nobody for up to N ms (default 5 timeouts; 0: that)"},
    {"worker_secret", SET_STR, FIELD(worker_secret), 0, 0, "S", "workers register with S"},
    {"api_token", SET_STR, FIELD(api_token), 0, 0, "T", "calls that change state need T"},
    {"provisioner", SET_STR, FIELD(provisioner), 0, 0, "COMMAND",
     "run `COMMAND up N` when the jobs want N more workers than are alive, `COMMAND down N "
     "NAME...` for idle ones nobody wants (docs/deploy.md)"},
    {"provisioner_timeout_ms", SET_INT, FIELD(provisioner_timeout_ms), 100, 86400000, "N",
     "a provisioner run is killed after N ms (default 120000)"},
    {"provisioner_interval_ms", SET_INT, FIELD(provisioner_interval_ms), 10, 86400000, "N",
     "at least N ms between provisioner runs; failures back off from it (default 30000)"},
    {"provisioner_grace_ms", SET_INT, FIELD(provisioner_grace_ms), 10, 86400000, "N",
     "workers asked for count as coming for N ms (default 300000)"},
    {"insecure", SET_BOOL, FIELD(insecure), 0, 0, NULL,
     "serve a non-loopback address without api_token and worker_secret"},
    {"allow_test_knobs", SET_BOOL, FIELD(allow_test_knobs), 0, 0, NULL,
     "accept job specs with fault_injection (tests only)"},
    {"web", SET_STR, FIELD(web_dir), 0, 0, "DIR", "the dashboard's files"},
    {"ready_file", SET_STR, FIELD(ready_file), 0, 0, "FILE",
     "written (JSON with the bound ports) once serving"},
    {"log_level", SET_LOG, 0, 0, 0, 0, "L", "debug, info, warn or error"},
};

static void usage(FILE *f) {
  fprintf(f, "usage: zcoord [--config FILE] [OPTIONS]; every option is also a config key\n");
  for (size_t i = 0; i < ZT_ARRAY_LEN(k_settings); i++) {
    const setting *s = &k_settings[i];
    char flag[64];
    snprintf(flag, sizeof flag, "--%s%s%s", s->key, s->arg ? " " : "", s->arg ? s->arg : "");
    for (char *p = flag + 2; *p && *p != ' '; p++)
      if (*p == '_') *p = '-';
    fprintf(f, "  %-30s %s\n", flag, s->help);
  }
  fprintf(f, "Defaults: --grpc 127.0.0.1:7070 --http 127.0.0.1:7080 --db zcoord.db\n"
             "          --heartbeat-ms 1000; data and checkpoint roots: the working directory\n");
}

/* The dashboard's directory: the installed copy relative to the binary
 * (ZT_WEB_REL, bin/../share/ztrain/web) when it holds index.html, else the
 * source tree's web/ (a binary run from the build tree). */
static void default_web_dir(char *out, size_t n) {
  char self[ZT_PATH_MAX], cand[ZT_PATH_MAX], real[ZT_PATH_MAX], index[ZT_PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  char *slash = len > 0 ? memrchr(self, '/', (size_t)len) : NULL;
  if (slash) {
    *slash = 0;
    if (zt_path_join(cand, sizeof cand, self, ZT_WEB_REL) == 0 && realpath(cand, real) &&
        strlen(real) < n && zt_path_join(index, sizeof index, real, "index.html") == 0) {
      if (access(index, R_OK) == 0) {
        snprintf(out, n, "%s", real);
        return;
      }
    }
  }
  snprintf(out, n, "%s", ZT_WEB_DIR);
}

void zt_config_defaults(zt_coord_config_t *cfg) {
  memset(cfg, 0, sizeof *cfg);
  snprintf(cfg->grpc_addr, sizeof cfg->grpc_addr, "127.0.0.1:7070");
  snprintf(cfg->http_addr, sizeof cfg->http_addr, "127.0.0.1:7080");
  snprintf(cfg->db_path, sizeof cfg->db_path, "zcoord.db");
  cfg->heartbeat_ms = 1000;
  cfg->heartbeat_timeout_ms = 0; /* derived: 3 x heartbeat_ms */
  cfg->heartbeat_capacity = 20000;
  cfg->provisioner_timeout_ms = 120000;
  cfg->provisioner_interval_ms = 30000;
  cfg->provisioner_grace_ms = 300000;
  cfg->max_message_bytes = 4u << 20;
  default_web_dir(cfg->web_dir, sizeof cfg->web_dir);
}

static const setting *find_setting(const char *key) {
  for (size_t i = 0; i < ZT_ARRAY_LEN(k_settings); i++)
    if (!strcmp(k_settings[i].key, key)) return &k_settings[i];
  return NULL;
}

/* Applies one setting by name; shared by the config file and the flags.
 * v is NULL for a flag without a value (a boolean set to true). */
static int apply(zt_coord_config_t *cfg, const char *key, const char *v) {
  const setting *s = find_setting(key);
  if (!s) return zt_err("unknown setting \"%.64s\"", key);
  char *field = (char *)cfg + s->off;
  char *end;
  switch (s->kind) {
    case SET_STR:
      if (!v || strlen(v) >= s->size)
        return zt_err("%s: %s", key, v ? "value too long" : "needs a value");
      snprintf(field, s->size, "%s", v);
      return 0;
    case SET_INT: {
      long x = v ? strtol(v, &end, 10) : 0;
      if (!v || !*v || *end || x < s->lo || x > s->hi)
        return zt_err("%s: expected an integer in %d..%d, got \"%.32s\"", key, s->lo, s->hi,
                      v ? v : "");
      *(int *)field = (int)x;
      return 0;
    }
    case SET_BOOL:
      if (v && strcmp(v, "true") && strcmp(v, "false") && strcmp(v, "1") && strcmp(v, "0"))
        return zt_err("%s: expected true or false, got \"%.32s\"", key, v);
      *(int *)field = !v || !strcmp(v, "true") || !strcmp(v, "1");
      return 0;
    case SET_LOG:
      if (!v || zt_log_set_level_name(v) != 0)
        return zt_err("log_level: unknown level \"%.32s\"", v ? v : "");
      return 0;
  }
  return zt_err("%s: bad setting", key);
}

/* The text form of one config value, in *v, for apply(), once its JSON
 * type is the setting's: a string for strings (a token of `true` or 12345
 * would be a guessable secret), a whole number for integers (9.6 is not
 * rounded to 10), true or false for booleans (0.6 does not turn one on). */
static int json_value(const cJSON *it, char *buf, size_t n, const char **v) {
  const setting *s = find_setting(it->string);
  if (!s) return zt_err("unknown setting \"%.64s\"", it->string);
  switch (s->kind) {
    case SET_STR:
    case SET_LOG:
      if (!cJSON_IsString(it)) return zt_err("%s: expected a string", it->string);
      *v = it->valuestring;
      return 0;
    case SET_INT: {
      double d = cJSON_IsNumber(it) ? it->valuedouble : 0.5;
      if (d != floor(d) || d < s->lo || d > s->hi)
        return zt_err("%s: expected an integer in %d..%d", it->string, s->lo, s->hi);
      snprintf(buf, n, "%.0f", d);
      return 0;
    }
    case SET_BOOL:
      if (!cJSON_IsBool(it)) return zt_err("%s: expected true or false", it->string);
      snprintf(buf, n, "%s", cJSON_IsTrue(it) ? "true" : "false");
      return 0;
  }
  return zt_err("%s: bad setting", it->string);
}

/* Reads a flat JSON object of settings; an unknown key is an error. */
static int load_config(zt_coord_config_t *cfg, const char *path) {
  char *text = NULL;
  size_t len;
  if (zt_read_file(path, &text, &len, 1 << 20) != 0) return zt_err_wrap("config %s", path);
  char what[600];
  snprintf(what, sizeof what, "config %s", path);
  cJSON *doc = zt_json_parse(text, len, what);
  int ret = -1;
  if (!doc) goto out;
  if (!cJSON_IsObject(doc)) {
    zt_err("config %s: not a JSON object", path);
    goto out;
  }
  for (cJSON *it = doc->child; it; it = it->next) {
    char buf[64];
    const char *v = buf;
    if (json_value(it, buf, sizeof buf, &v) != 0 || apply(cfg, it->string, v) != 0) {
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

/* 1 when the host of HOST:PORT is a loopback address. */
static int loopback(const char *addr) {
  char host[256];
  zt_net_host(addr, host, sizeof host);
  return zt_loopback_host(host);
}

/* The shipped config (deploy/zcoord.json) holds placeholders: they must be
 * replaced, never used as credentials. */
static int placeholder(const char *v) { return !strncmp(v, "CHANGE-ME", 9); }

static int check(zt_coord_config_t *cfg) {
  if (placeholder(cfg->api_token) || placeholder(cfg->worker_secret))
    return zt_err("%s is still the placeholder of the example config: generate one with "
                  "`openssl rand -hex 32`",
                  placeholder(cfg->api_token) ? "api_token" : "worker_secret");
  if (cfg->heartbeat_timeout_ms == 0) cfg->heartbeat_timeout_ms = 3 * cfg->heartbeat_ms;
  if (cfg->heartbeat_timeout_ms <= cfg->heartbeat_ms)
    return zt_err("heartbeat timeout (%d ms) must exceed the interval (%d ms)",
                  cfg->heartbeat_timeout_ms, cfg->heartbeat_ms);
  if (cfg->blind_max_ms == 0) cfg->blind_max_ms = ZT_BLIND_MAX_TIMEOUTS * cfg->heartbeat_timeout_ms;
  int exposed = !loopback(cfg->grpc_addr) || !loopback(cfg->http_addr);
  if (exposed && (!cfg->api_token[0] || !cfg->worker_secret[0])) {
    if (!cfg->insecure)
      return zt_err("refusing to serve %s / %s without both an api_token and a worker_secret: "
                    "anyone who reaches these ports could control jobs and pose as workers "
                    "(generate them with `openssl rand -hex 32`; --insecure overrides)",
                    cfg->grpc_addr, cfg->http_addr);
    ZT_WARN("serving %s / %s without %s: --insecure", cfg->grpc_addr, cfg->http_addr,
            !cfg->api_token[0] ? "an api_token" : "a worker_secret");
  }
  /* The roots default to the working directory; they are kept absolute. */
  char *roots[2] = {cfg->data_root, cfg->ckpt_root};
  for (int i = 0; i < 2; i++) {
    char resolved[ZT_PATH_MAX];
    if (!roots[i][0] && !getcwd(roots[i], sizeof cfg->data_root))
      return zt_err_errno("working directory");
    if (!realpath(roots[i], resolved))
      return zt_err_errno("%s %s", i ? "checkpoint_root" : "data_root", roots[i]);
    size_t n = strlen(resolved);
    if (n >= sizeof cfg->data_root)
      return zt_err("%s: path too long", i ? "checkpoint_root" : "data_root");
    memcpy(roots[i], resolved, n + 1);
  }
  return 0;
}

int zt_config_parse(zt_coord_config_t *cfg, int argc, char **argv) {
  struct option opts[ZT_ARRAY_LEN(k_settings) + 3];
  char names[ZT_ARRAY_LEN(k_settings)][64];
  size_t n = 0;
  for (size_t i = 0; i < ZT_ARRAY_LEN(k_settings); i++, n++) {
    snprintf(names[i], sizeof names[i], "%s", k_settings[i].key);
    for (char *p = names[i]; *p; p++)
      if (*p == '_') *p = '-';
    opts[n] = (struct option){names[i], k_settings[i].kind == SET_BOOL ? no_argument
                                                                         : required_argument,
                              0, 1000 + (int)i};
  }
  opts[n++] = (struct option){"config", required_argument, 0, 'c'};
  opts[n++] = (struct option){"help", no_argument, 0, 'h'};
  opts[n] = (struct option){0, 0, 0, 0};
  /* The config file is applied first so that flags override it: a first
   * pass takes only --config, in every spelling getopt accepts (--config
   * FILE, --config=FILE, --conf FILE), and a second, from the start
   * (optind 0 re-initialises GNU getopt), the rest. */
  int ch;
  opterr = 0;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1)
    if (ch == 'c' && load_config(cfg, optarg) != 0) return -1;
  opterr = 1;
  optind = 0;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    if (ch == 'c') continue;
    if (ch == 'h') {
      usage(stdout);
      exit(0);
    }
    if (ch < 1000) {
      usage(stderr);
      return zt_err("bad command line");
    }
    if (apply(cfg, k_settings[ch - 1000].key, optarg) != 0) return -1;
  }
  if (optind < argc) return zt_err("unexpected argument \"%s\"", argv[optind]);
  return check(cfg);
}
