/*
 * spot.c: the preemption-notice watcher (see spot.h).
 *
 * One thread per worker. It speaks just enough HTTP/1.1 to read a metadata
 * service: one request per connection ("Connection: close"), a numeric
 * address (metadata services are addresses, and a name lookup has no
 * deadline), the whole exchange under one deadline, the answer read to the
 * end or to 64 KiB, Content-Length or chunked bodies. Nothing it reads is
 * trusted: a status line that does not parse, a body that is not what the
 * protocol says, a token with odd bytes all count as a failure of the
 * service, which is backed off like a refused connection.
 */
#include "spot.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "zt_net.h"

#define ZT_SPOT_DEADLINE_MS 1000
#define ZT_SPOT_MAX_REPLY (64 * 1024)
#define ZT_SPOT_BACKOFF_MAX_MS 60000
#define ZT_SPOT_AUTO_ROUNDS 3
#define ZT_SPOT_AZURE_PATH "/metadata/scheduledevents?api-version=2020-07-01"

struct zt_spot {
  zt_spot_opts_t o;
  zt_net_addr_t addr;      /* the metadata service (addr.text: its HOST:PORT) */
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int stopping;            /* under mu */
  zt_spot_kind_t kind;     /* the protocol spoken (auto: once detected) */
  char token[257];         /* aws: the session token ("" : none yet) */
  int rebalance_logged;    /* aws */
  char event_id[128];      /* azure: the Preempt event to acknowledge */
  int noticed;             /* under mu */
};

typedef struct {
  int status;
  char body[ZT_SPOT_MAX_REPLY + 1];
  size_t len;
} reply_t;

static const char *kind_name(zt_spot_kind_t k) {
  switch (k) {
    case ZT_SPOT_AWS: return "aws";
    case ZT_SPOT_GCP: return "gcp";
    case ZT_SPOT_AZURE: return "azure";
    case ZT_SPOT_AUTO: return "auto";
    default: return "off";
  }
}

int zt_spot_parse(const char *s, zt_spot_kind_t *kind) {
  static const zt_spot_kind_t all[] = {ZT_SPOT_OFF, ZT_SPOT_AUTO, ZT_SPOT_AWS, ZT_SPOT_GCP,
                                       ZT_SPOT_AZURE};
  for (size_t i = 0; i < ZT_ARRAY_LEN(all); i++)
    if (!strcmp(s, kind_name(all[i]))) {
      *kind = all[i];
      return 0;
    }
  return zt_errk(ZT_E_INVALID, "--spot-notice \"%.32s\": expected auto, aws, gcp, azure or off",
                 s);
}

/* ---- one HTTP exchange ------------------------------------------------------ */

/* The watcher's wait (zt_net_wait_fn): zt_net_wait, whose timeout says
 * how long the service had. */
static int wait_fd(void *user, int fd, short ev, zt_deadline_t end) {
  (void)user;
  if (zt_net_wait(fd, ev, end) == 0) return 0;
  return zt_deadline_passed(end) ? zt_err("no answer within %d ms", ZT_SPOT_DEADLINE_MS) : -1;
}

/* The answer, read to the end of the stream into buf (at most
 * ZT_SPOT_MAX_REPLY bytes): its length, or -1. */
static ssize_t read_reply(int fd, char *buf, zt_deadline_t end) {
  size_t got = 0;
  for (;;) {
    ssize_t m = recv(fd, buf + got, ZT_SPOT_MAX_REPLY - got, MSG_DONTWAIT);
    if (m < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (wait_fd(NULL, fd, POLLIN, end) != 0) return -1;
      continue;
    }
    if (m < 0) return zt_err_errno("recv");
    if (m == 0) return (ssize_t)got;
    got += (size_t)m;
    if (got == ZT_SPOT_MAX_REPLY) return zt_err("an answer longer than %d bytes", ZT_SPOT_MAX_REPLY);
  }
}

/* A chunked body decoded in place; -1 when it is not one. */
static int dechunk(char *b, size_t *len) {
  size_t in = 0, out = 0;
  for (;;) {
    char *end;
    unsigned long n = strtoul(b + in, &end, 16);
    char *crlf = strstr(b + in, "\r\n");
    if (end == b + in || !crlf || (size_t)(crlf - b) + 2 > *len) return -1;
    in = (size_t)(crlf - b) + 2;
    if (n == 0) break;
    if (n > *len - in) return -1;
    memmove(b + out, b + in, n);
    out += n, in += n + 2;
    if (in > *len) return -1;
  }
  *len = out;
  b[out] = 0;
  return 0;
}

/* Parses what was read into r: status and body. */
static int parse_reply(char *buf, size_t n, reply_t *r) {
  buf[n] = 0;
  int major, minor;
  if (sscanf(buf, "HTTP/%d.%d %3d", &major, &minor, &r->status) != 3 || r->status < 100 ||
      r->status > 599)
    return zt_err("not an HTTP answer");
  char *head_end = strstr(buf, "\r\n\r\n");
  if (!head_end) return zt_err("an HTTP answer without the end of its header");
  *head_end = 0;
  char *body = head_end + 4;
  size_t blen = n - (size_t)(body - buf);
  const char *cl = strcasestr(buf, "\r\ncontent-length:");
  if (strcasestr(buf, "\r\ntransfer-encoding: chunked")) {
    if (dechunk(body, &blen) != 0) return zt_err("a malformed chunked body");
  } else if (cl) {
    long long want = strtoll(cl + 17, NULL, 10);
    if (want < 0 || (unsigned long long)want > blen) return zt_err("a body cut short");
    blen = (size_t)want;
  }
  memcpy(r->body, body, blen);
  r->body[blen] = 0;
  r->len = blen;
  return 0;
}

/* One request (headers: extra header lines, each ending in \r\n). */
static int http(const zt_spot_t *s, const char *method, const char *path, const char *headers,
                const char *body, reply_t *r) {
  zt_deadline_t end = zt_deadline_in(ZT_SPOT_DEADLINE_MS);
  char req[2048];
  size_t blen = body ? strlen(body) : 0;
  int n = snprintf(req, sizeof req,
                   "%s %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n%sContent-Length: "
                   "%zu\r\n\r\n%s",
                   method, path, s->addr.text, headers ? headers : "", blen, body ? body : "");
  if (n < 0 || (size_t)n >= sizeof req) return zt_err("request too long");
  int fd = zt_net_connect(&s->addr, end, wait_fd, NULL, NULL);
  if (fd < 0) return -1;
  char *buf = zt_xmalloc(ZT_SPOT_MAX_REPLY + 1);
  ssize_t got = -1;
  int rc = -1;
  if (zt_net_exact(fd, req, (size_t)n, 1, end, wait_fd, NULL) == 0 &&
      (got = read_reply(fd, buf, end)) >= 0)
    rc = parse_reply(buf, (size_t)got, r);
  close(fd);
  free(buf);
  return rc ? zt_err_wrap("%s %s", method, path) : 0;
}

/* ---- the protocols --------------------------------------------------------- */

/* What a notice said, printable and short. */
static void describe(char *what, size_t n, zt_spot_kind_t k, const char *said) {
  char clean[201];
  size_t i = 0;
  for (; said[i] && i < sizeof clean - 1; i++)
    clean[i] = said[i] >= 0x20 && said[i] < 0x7f ? said[i] : ' ';
  clean[i] = 0;
  snprintf(what, n, "spot notice (%s): %s", kind_name(k), clean);
}

static int printable(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (s[i] <= 0x20 || s[i] >= 0x7f) return 0;
  return n > 0;
}

static int aws_token(zt_spot_t *s) {
  reply_t *r = zt_xmalloc(sizeof *r);
  int rc = http(s, "PUT", "/latest/api/token",
                "X-aws-ec2-metadata-token-ttl-seconds: 21600\r\n", NULL, r);
  if (rc == 0 && r->status != 200) rc = zt_err("token: HTTP %d", r->status);
  while (rc == 0 && r->len && (r->body[r->len - 1] == '\n' || r->body[r->len - 1] == '\r'))
    r->body[--r->len] = 0;
  if (rc == 0 && (r->len >= sizeof s->token || !printable(r->body, r->len)))
    rc = zt_err("token: not a token (%zu bytes)", r->len);
  if (rc == 0) memcpy(s->token, r->body, r->len + 1);
  free(r);
  return rc;
}

/* 1: a notice (what), 0: none, -1: the service failed. */
static int aws_check(zt_spot_t *s, char *what, size_t n) {
  if (!s->token[0] && aws_token(s) != 0) return -1;
  char hdr[320];
  snprintf(hdr, sizeof hdr, "X-aws-ec2-metadata-token: %s\r\n", s->token);
  reply_t *r = zt_xmalloc(sizeof *r);
  int rc = http(s, "GET", "/latest/meta-data/spot/instance-action", hdr, NULL, r);
  if (rc == 0 && r->status == 200) {
    describe(what, n, ZT_SPOT_AWS, r->body);
    rc = 1;
  } else if (rc == 0 && r->status == 401) {
    s->token[0] = 0; /* expired: a new one next time */
    rc = zt_err("instance-action: HTTP 401 (token expired)");
  } else if (rc == 0 && r->status != 404) {
    rc = zt_err("instance-action: HTTP %d", r->status);
  }
  if (rc == 0 && !s->rebalance_logged &&
      http(s, "GET", "/latest/meta-data/events/recommendations/rebalance", hdr, NULL, r) == 0 &&
      r->status == 200) {
    s->rebalance_logged = 1;
    ZT_WARN("spot: the cloud recommends rebalancing this instance (an early sign of "
            "preemption); training goes on until a notice");
  }
  free(r);
  return rc;
}

static int gcp_check(zt_spot_t *s, char *what, size_t n) {
  reply_t *r = zt_xmalloc(sizeof *r);
  int rc = http(s, "GET", "/computeMetadata/v1/instance/preempted", "Metadata-Flavor: Google\r\n",
                NULL, r);
  if (rc == 0 && r->status != 200) rc = zt_err("preempted: HTTP %d", r->status);
  if (rc == 0 && !strncmp(r->body, "TRUE", 4)) {
    describe(what, n, ZT_SPOT_GCP, "instance/preempted is TRUE");
    rc = 1;
  } else if (rc == 0 && strncmp(r->body, "FALSE", 5)) {
    rc = zt_err("preempted: neither TRUE nor FALSE");
  }
  free(r);
  return rc;
}

/* The first Preempt event of a scheduled-events document; -1 when the
 * document is not one. */
static int azure_preempt(const char *body, char *id, size_t idn, char *desc, size_t dn) {
  cJSON *doc = cJSON_Parse(body);
  cJSON *events = cJSON_GetObjectItemCaseSensitive(doc, "Events");
  int rc = cJSON_IsArray(events) ? 0 : zt_err("scheduledevents: no Events array");
  cJSON *e, *list = rc == 0 ? events : NULL;
  cJSON_ArrayForEach(e, list) {
    cJSON *type = cJSON_GetObjectItemCaseSensitive(e, "EventType");
    cJSON *eid = cJSON_GetObjectItemCaseSensitive(e, "EventId");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "Preempt")) continue;
    if (!cJSON_IsString(eid) || strlen(eid->valuestring) >= idn ||
        !printable(eid->valuestring, strlen(eid->valuestring)) ||
        strpbrk(eid->valuestring, "\"\\")) {
      rc = zt_err("scheduledevents: a Preempt event without a usable EventId");
      break;
    }
    cJSON *nb = cJSON_GetObjectItemCaseSensitive(e, "NotBefore");
    snprintf(id, idn, "%s", eid->valuestring);
    snprintf(desc, dn, "Preempt event %s, not before %s", eid->valuestring,
             cJSON_IsString(nb) ? nb->valuestring : "(unknown)");
    rc = 1;
    break;
  }
  cJSON_Delete(doc);
  return rc;
}

static int azure_check(zt_spot_t *s, char *what, size_t n) {
  reply_t *r = zt_xmalloc(sizeof *r);
  int rc = http(s, "GET", ZT_SPOT_AZURE_PATH, "Metadata: true\r\n", NULL, r);
  if (rc == 0 && r->status != 200) rc = zt_err("scheduledevents: HTTP %d", r->status);
  char desc[320];
  if (rc == 0) rc = azure_preempt(r->body, s->event_id, sizeof s->event_id, desc, sizeof desc);
  if (rc == 1) describe(what, n, ZT_SPOT_AZURE, desc);
  free(r);
  return rc;
}

static int check(zt_spot_t *s, zt_spot_kind_t k, char *what, size_t n) {
  switch (k) {
    case ZT_SPOT_AWS: return aws_check(s, what, n);
    case ZT_SPOT_GCP: return gcp_check(s, what, n);
    case ZT_SPOT_AZURE: return azure_check(s, what, n);
    default: return zt_err("no protocol");
  }
}

/* auto: the first protocol that answers in its own terms (a notice already
 * counts: it is reported by the caller's next check). */
static zt_spot_kind_t detect(zt_spot_t *s) {
  static const zt_spot_kind_t order[] = {ZT_SPOT_AWS, ZT_SPOT_GCP, ZT_SPOT_AZURE};
  char what[512];
  for (size_t i = 0; i < ZT_ARRAY_LEN(order); i++)
    if (check(s, order[i], what, sizeof what) >= 0) return order[i];
  return ZT_SPOT_AUTO;
}

/* ---- the thread ------------------------------------------------------------ */

/* Waits ms unless stopped; 1 when stopping. */
static int nap(zt_spot_t *s, int64_t ms) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  ts.tv_sec += ms / 1000;
  ts.tv_nsec += (ms % 1000) * 1000000;
  if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
  pthread_mutex_lock(&s->mu);
  while (!s->stopping && pthread_cond_timedwait(&s->cv, &s->mu, &ts) != ETIMEDOUT) {
  }
  int stop = s->stopping;
  pthread_mutex_unlock(&s->mu);
  return stop;
}

static void *watch(void *p) {
  zt_spot_t *s = p;
  int64_t backoff = 0;
  unsigned failures = 0, rounds = 0;
  char what[512];
  for (;;) {
    int rc;
    if (s->kind == ZT_SPOT_AUTO) {
      s->kind = detect(s);
      if (s->kind != ZT_SPOT_AUTO) ZT_INFO("spot: the metadata service speaks %s", kind_name(s->kind));
      else if (++rounds >= ZT_SPOT_AUTO_ROUNDS) {
        ZT_INFO("spot: no metadata service answered at %s (%u tries): not a spot instance, "
                "notices off",
                s->addr.text, rounds);
        return NULL;
      }
      rc = s->kind == ZT_SPOT_AUTO ? -1 : 0;
    } else {
      rc = check(s, s->kind, what, sizeof what);
    }
    if (rc == 1) {
      ZT_WARN("%s: draining", what);
      pthread_mutex_lock(&s->mu);
      s->noticed = 1;
      pthread_mutex_unlock(&s->mu);
      if (s->o.on_notice) s->o.on_notice(s->o.user, what);
      return NULL;
    }
    if (rc < 0) {
      if (failures++ % 10 == 0)
        ZT_WARN("spot: the metadata service at %s failed (%u time%s): %s; training goes on",
                s->addr.text, failures, failures == 1 ? "" : "s", zt_err_msg());
      backoff = ZT_MIN(ZT_MAX(1000, backoff * 2), ZT_SPOT_BACKOFF_MAX_MS);
    } else {
      if (failures) ZT_INFO("spot: the metadata service answers again after %u failures", failures);
      failures = 0;
      backoff = 0;
    }
    if (nap(s, backoff ? backoff : s->o.poll_ms)) return NULL;
  }
}

int zt_spot_start(const zt_spot_opts_t *o, zt_spot_t **out) {
  *out = NULL;
  if (o->kind == ZT_SPOT_OFF) return 0;
  zt_spot_t *s = zt_xcalloc(1, sizeof *s);
  s->o = *o;
  if (s->o.poll_ms <= 0) s->o.poll_ms = 1000;
  s->kind = o->kind;
  const char *ep = o->endpoint ? o->endpoint : "169.254.169.254:80";
  if (zt_net_addr(ep, &s->addr) != 0) {
    free(s);
    return zt_err_wrapk(ZT_E_INVALID, "--spot-endpoint");
  }
  pthread_mutex_init(&s->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cv, &ca);
  pthread_condattr_destroy(&ca);
  if (pthread_create(&s->th, NULL, watch, s) != 0) {
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
    return zt_err("cannot start the spot-notice thread");
  }
  ZT_INFO("spot: watching for preemption notices (%s) at %s every %d ms", kind_name(o->kind),
          s->addr.text, s->o.poll_ms);
  *out = s;
  return 0;
}

void zt_spot_ack(zt_spot_t *s) {
  if (!s) return;
  pthread_mutex_lock(&s->mu);
  int noticed = s->noticed;
  pthread_mutex_unlock(&s->mu);
  if (!noticed || s->kind != ZT_SPOT_AZURE || !s->event_id[0]) return;
  char body[256];
  snprintf(body, sizeof body, "{\"StartRequests\":[{\"EventId\":\"%s\"}]}", s->event_id);
  reply_t *r = zt_xmalloc(sizeof *r);
  if (http(s, "POST", ZT_SPOT_AZURE_PATH, "Metadata: true\r\nContent-Type: application/json\r\n",
           body, r) != 0)
    ZT_WARN("spot: the Preempt event %s was not acknowledged: %s", s->event_id, zt_err_msg());
  else if (r->status != 200)
    ZT_WARN("spot: the Preempt event %s was not acknowledged: HTTP %d", s->event_id, r->status);
  else
    ZT_INFO("spot: acknowledged the Preempt event %s", s->event_id);
  free(r);
}

void zt_spot_stop(zt_spot_t *s) {
  if (!s) return;
  pthread_mutex_lock(&s->mu);
  s->stopping = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->th, NULL);
  pthread_cond_destroy(&s->cv);
  pthread_mutex_destroy(&s->mu);
  free(s);
}
