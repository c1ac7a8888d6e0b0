/*
 * ticket.c: tickets for transfers between workers (checkpoint replicas).
 *
 * Workers do not trust each other; each trusts the coordinator, with which
 * it shares one secret: the session credential of its registration. When a
 * worker needs another worker's replica store (to push a copy there, to
 * fetch one), the coordinator gives it a ticket made for that holder:
 *
 *   zt1|<op>|<job>|<generation>|<requester id>|<expiry ms>|<scope>|<mac>
 *
 * where mac is HMAC-SHA256, keyed with the holder's session, of everything
 * before the last '|', in hex. The holder checks the MAC with its own
 * session (so only a ticket the coordinator made for it passes, and a
 * re-registration, which rotates the session, voids the old ones), the
 * expiry (wall clock), and then that the request stays inside the scope:
 * for "put" the requester's rank ("r3": that rank's files of that
 * generation), for "get" one epoch directory. The coordinator makes
 * tickets only for members of a job's current generation.
 *
 * A get ticket is used once, right after the rendezvous, and expires a
 * day later. A put ticket serves its rank for the whole generation, which
 * may run for weeks, so the coordinator gives it no expiry (0): instead
 * the holder takes it only while it works on the ticket's job and
 * generation itself (worker/store.c), which ends with the generation.
 */
#include <openssl/evp.h>
#include <openssl/crypto.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zt_common.h"

static void mac_hex(const char *key, const char *msg, size_t len, char out[65]) {
  unsigned char mac[32];
  unsigned int n = 0;
  HMAC(EVP_sha256(), key, (int)strlen(key), (const unsigned char *)msg, len, mac, &n);
  for (unsigned i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", mac[i]);
}

int zt_ticket_make(const char *key, const zt_ticket_t *t, char *out, size_t n) {
  if (!key[0]) return zt_err("ticket: the holder has no session");
  if (strchr(t->op, '|') || strchr(t->scope, '|'))
    return zt_errk(ZT_E_INVALID, "ticket: '|' in the operation or scope");
  int len = snprintf(out, n, "zt1|%s|%llu|%llu|%llu|%lld|%s", t->op,
                     (unsigned long long)t->job, (unsigned long long)t->gen,
                     (unsigned long long)t->requester, (long long)t->expiry_ms, t->scope);
  if (len < 0 || (size_t)len + 66 > n) return zt_err("ticket: buffer too small");
  char mac[65];
  mac_hex(key, out, (size_t)len, mac);
  snprintf(out + len, n - (size_t)len, "|%s", mac);
  return 0;
}

int zt_ticket_check(const char *key, const char *text, int64_t now_ms, zt_ticket_t *t) {
  const char *bar = strrchr(text, '|');
  if (!key[0] || !bar || strncmp(text, "zt1|", 4) != 0 || strlen(bar + 1) != 64)
    return zt_errk(ZT_E_UNAUTHENTICATED, "not a ticket");
  char mac[65];
  mac_hex(key, text, (size_t)(bar - text), mac);
  if (!zt_secret_equal(mac, bar + 1))
    return zt_errk(ZT_E_UNAUTHENTICATED, "ticket not made for this worker's session");
  memset(t, 0, sizeof *t);
  unsigned long long job, gen, req;
  long long exp;
  int used = 0;
  if (sscanf(text, "zt1|%7[a-z]|%llu|%llu|%llu|%lld|%n", t->op, &job, &gen, &req, &exp, &used) !=
          5 ||
      used <= 0 || text + used > bar || (size_t)(bar - text - used) >= sizeof t->scope)
    return zt_errk(ZT_E_UNAUTHENTICATED, "malformed ticket");
  t->job = job, t->gen = gen, t->requester = req, t->expiry_ms = exp;
  memcpy(t->scope, text + used, (size_t)(bar - text - used));
  if (t->expiry_ms && t->expiry_ms < now_ms)
    return zt_errk(ZT_E_UNAUTHENTICATED, "ticket expired");
  return 0;
}

/* OpenSSL keeps state per thread (its error queue, cached digests) that it
 * frees from a thread-exit handler. A detached thread may still be on its
 * way out when the process exits, and its state is then lost; a thread
 * that checked tickets calls this last, to free it while it still runs. */
void zt_ticket_thread_done(void) { OPENSSL_thread_stop(); }
