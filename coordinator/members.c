/*
 * members.c: worker membership and liveness, the coordinator's first duty.
 *
 * Every worker is known by a stable name (its identity across restarts) and
 * a numeric id, the SQLite rowid of its row in `workers`. A worker moves
 * between four states:
 *
 *           Register                 no heartbeat for 2 intervals
 *   (new) ----------> ALIVE <------------------------------> SUSPECT
 *                       |  ^          heartbeat arrives         |
 *                 Leave |  | Register                           | no heartbeat for
 *                       v  |                                    | the timeout
 *                      LEFT  <--- Register --- LOST <-----------+
 *
 * A LOST or LEFT worker's heartbeats are refused with FAILED_PRECONDITION:
 * it must register again, which makes it a new member. Every transition is
 * written to SQLite together with its logbook event in one transaction, so
 * the database never shows a state without the event that explains it.
 *
 * This file knows nothing of jobs: it tells its caller what happened (the
 * ids of members declared lost, a member that left, a name that registered
 * again), and the caller (service.c, main.c) tells the scheduler.
 *
 * Heartbeats themselves touch only memory: the wall-clock last_seen of each
 * member is flushed to SQLite in batched transactions, a twentieth of the
 * members every 250 ms, so each one every 5 s (zt_members_flush). After a
 * coordinator restart, workers that the database says were alive get a fresh grace period of one timeout plus the longest
 * a live worker takes to reconnect (restart_grace_ms) to show up again, so
 * a restart declares no live worker lost and costs no generation.
 *
 * The coordinator's own blips. When two or more workers are alive and not
 * one of them has been heard from for two heartbeat intervals, the likely
 * story is not that they all died together but that the coordinator's
 * own link (or its host) is cut off. While that lasts the coordinator is
 * "blind": nobody is declared lost (they may turn suspect), for at most
 * blind_max_ms (default ZT_BLIND_MAX_TIMEOUTS heartbeat timeouts), past
 * which the silence counts as usual (the whole fleet may really be gone).
 * The first heartbeat after a blind period ends it, and every live
 * member's silence then counts from
 * one heartbeat interval before that moment: a member that reconnects
 * within the timeout keeps its generation, however long the cut was; a
 * member that really died in it is lost one timeout later. Each period is
 * logged, counted in /metrics and recorded in the logbook
 * ("coordinator_blind"). One worker alone cannot be told from a cut, so
 * the rule needs two.
 *
 * Lookup by id is an array index (ids are dense rowids); lookup by name is an
 * open-addressing hash table of ids. Both are only touched on the loop
 * thread.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "zt_net.h"

/* ---- indexes ----------------------------------------------------------- */

static uint64_t name_hash(const char *s) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

static void name_index_put(zt_coord_t *c, zt_member_t *m);

static void name_index_grow(zt_coord_t *c) {
  uint64_t *old = c->name_slots;
  size_t oldcap = c->name_cap;
  c->name_cap = oldcap ? oldcap * 2 : 64;
  c->name_slots = zt_xcalloc(c->name_cap, sizeof *c->name_slots);
  for (size_t i = 0; i < oldcap; i++)
    if (old[i]) name_index_put(c, c->by_id[old[i]]);
  free(old);
}

static void name_index_put(zt_coord_t *c, zt_member_t *m) {
  if ((c->n_members + 1) * 2 > c->name_cap) name_index_grow(c);
  size_t mask = c->name_cap - 1;
  for (size_t i = name_hash(m->row.name) & mask;; i = (i + 1) & mask) {
    if (c->name_slots[i] == 0 || c->name_slots[i] == m->row.id) {
      c->name_slots[i] = m->row.id;
      return;
    }
  }
}

zt_member_t *zt_members_find_name(zt_coord_t *c, const char *name) {
  if (!c->name_cap) return NULL;
  size_t mask = c->name_cap - 1;
  for (size_t i = name_hash(name) & mask; c->name_slots[i]; i = (i + 1) & mask) {
    zt_member_t *m = c->by_id[c->name_slots[i]];
    if (strcmp(m->row.name, name) == 0) return m;
  }
  return NULL;
}

zt_member_t *zt_members_get(zt_coord_t *c, uint64_t id) {
  return id < c->by_id_cap ? c->by_id[id] : NULL;
}

zt_member_t *zt_members_lookup(zt_coord_t *c, const char *id_or_name) {
  char *end;
  unsigned long long id = strtoull(id_or_name, &end, 10);
  if (*id_or_name && !*end) return zt_members_get(c, id);
  return zt_members_find_name(c, id_or_name);
}

/* Adds a member whose row (with its id) is already in the database. */
static zt_member_t *members_add(zt_coord_t *c, const zt_db_worker_t *row) {
  if (row->id >= c->by_id_cap) {
    size_t cap = c->by_id_cap ? c->by_id_cap : 64;
    while (cap <= row->id) cap *= 2;
    zt_member_t **n = zt_xrealloc(c->by_id, cap * sizeof *n);
    memset(n + c->by_id_cap, 0, (cap - c->by_id_cap) * sizeof *n);
    c->by_id = n;
    c->by_id_cap = cap;
  }
  zt_member_t *m = zt_xcalloc(1, sizeof *m);
  m->row = *row;
  m->rank = -1;
  m->last_hb_mono_ms = zt_now_ms();
  c->by_id[row->id] = m;
  name_index_put(c, m);
  c->n_members++;
  return m;
}

/* After a restart, a member the database says is alive counts as heard
 * from a little in the future: besides the timeout itself, it gets the
 * longest a live worker can take to reach us again, its retry pause (capped
 * at one heartbeat interval while we are away, worker/control.c) plus
 * gRPC's reconnect wait (ZT_RPC_RECONNECT_MAX_MS, with 20% jitter) and a
 * margin. A member that reconnects within it keeps its generation. */
static int64_t restart_grace_ms(const zt_coord_t *c) {
  return c->cfg.heartbeat_ms + ZT_RPC_RECONNECT_MAX_MS * 6 / 5 + 300;
}

static int load_one(const zt_db_worker_t *w, void *user) {
  zt_coord_t *c = user;
  members_add(c, w)->last_hb_mono_ms += restart_grace_ms(c);
  return 0;
}

static int mark_deletions(uint64_t id, void *user) {
  zt_member_t *m = zt_members_get(user, id);
  if (m) m->deletions_pending = 1;
  return 0;
}

/* The fleet was paced by the last coordinator as it will be by this one
 * (Pace): a worker on a longer interval gets the difference as well. The
 * members with epochs to delete are marked (copies.c) by one query. */
int zt_members_load(zt_coord_t *c) {
  if (zt_db_workers_each(c->db, load_one, c) != 0) return -1;
  if (zt_db_deletion_workers(c->db, mark_deletions, c) != 0) return -1;
  zt_members_pace(c);
  int64_t more = zt_members_interval_ms(c) - c->cfg.heartbeat_ms;
  for (size_t i = 0; more > 0 && i < c->by_id_cap; i++)
    if (c->by_id[i]) c->by_id[i]->last_hb_mono_ms += more;
  return 0;
}

void zt_members_free(zt_coord_t *c) {
  for (size_t i = 0; i < c->by_id_cap; i++) free(c->by_id[i]);
  free(c->by_id);
  free(c->name_slots);
  c->by_id = NULL;
  c->name_slots = NULL;
  c->by_id_cap = c->name_cap = c->n_members = 0;
}

void zt_members_count(zt_coord_t *c, uint32_t counts[5]) {
  memset(counts, 0, 5 * sizeof *counts);
  for (size_t i = 0; i < c->by_id_cap; i++)
    if (c->by_id[i] && c->by_id[i]->row.state >= 0 && c->by_id[i]->row.state < 5)
      counts[c->by_id[i]->row.state]++;
}

/* ---- transitions ------------------------------------------------------- */

/* Writes a member's new state and its event in one transaction. On a
 * database failure the in-memory state is left as it was. */
static int transition(zt_coord_t *c, zt_member_t *m, int state, const char *kind, const char *detail) {
  int64_t now = zt_wall_ms();
  if (zt_db_begin(c->db) != 0) return -1;
  if (zt_db_worker_set_state(c->db, m->row.id, state, now) != 0 ||
      zt_coord_event_tx(c, 0, kind, m->row.id, detail) != 0) {
    zt_db_rollback(c->db);
    return -1;
  }
  if (zt_db_commit(c->db) != 0) {
    zt_db_rollback(c->db);
    return -1;
  }
  ZT_INFO("worker %s (id %llu): %s -> %s: %s", m->row.name, (unsigned long long)m->row.id,
          zt_name_worker_state(m->row.state), zt_name_worker_state(state), detail);
  m->row.state = state;
  m->row.last_seen_ms = now;
  m->dirty = 0;
  m->recovered_ms = 0; /* written over */
  return 0;
}

/* Names are identities and show up in logs, URLs and file names. */
static int valid_name(const char *s) {
  size_t n = strlen(s);
  if (n == 0 || n >= sizeof(((zt_db_worker_t *)0)->name)) return 0;
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
          ch == '-' || ch == '_' || ch == '.' || ch == ':' || ch == '@'))
      return 0;
  }
  return 1;
}

/* A name may be registered when nobody holds it, when its holder is lost
 * or left, or by its holder itself (it presents its current session, or
 * the one before it while the new one has not been used: a lost reply). */
static int name_free(zt_coord_t *c, const zt_member_t *m, const zt_register_t *r) {
  if (!m || m->row.state == ZT_WORKER_LOST || m->row.state == ZT_WORKER_LEFT) return 1;
  if (r->session && r->session[0] &&
      (zt_secret_equal(r->session, m->row.session) ||
       (m->prev_session[0] && zt_secret_equal(r->session, m->prev_session))))
    return 1;
  zt_errk(ZT_E_EXISTS,
          "worker name \"%s\" is in use by a live worker (pid %d on %s, heard from %lld ms ago); "
          "another worker needs another --name, a restarted one is let in once the old one is "
          "lost",
          m->row.name, m->row.pid, m->row.host, (long long)(zt_now_ms() - m->last_hb_mono_ms));
  (void)c;
  return 0;
}

/* A worker that registers afresh (a new name, or one lost or left) may
 * present a credential of its own making, at least 32 characters: if the
 * reply is lost, its retry presents it again and name_free lets it take
 * its name back at once. */
static void remember_presented(zt_member_t *m, const zt_register_t *r) {
  size_t n = r->session ? strlen(r->session) : 0;
  if (n >= 32 && n < sizeof m->prev_session) memcpy(m->prev_session, r->session, n + 1);
  else m->prev_session[0] = 0;
}

int zt_members_register(zt_coord_t *c, const zt_register_t *r, zt_member_t **out, int *known) {
  if (!valid_name(r->name))
    return zt_errk(ZT_E_INVALID,
                   "invalid worker name \"%.64s\": 1-127 characters of [A-Za-z0-9._:@-]",
                   r->name);
  if (strlen(r->host) >= sizeof(((zt_db_worker_t *)0)->host) ||
      strlen(r->device) >= sizeof(((zt_db_worker_t *)0)->device))
    return zt_errk(ZT_E_INVALID, "host or device name too long");
  if (!zt_text_valid(r->host))
    return zt_errk(ZT_E_INVALID, "host name is not UTF-8 text (control characters or "
                                 "invalid bytes)");
  if (!zt_text_valid(r->device))
    return zt_errk(ZT_E_INVALID, "device name is not UTF-8 text (control characters or "
                                 "invalid bytes)");
  zt_member_t *m = zt_members_find_name(c, r->name);
  if (!name_free(c, m, r)) return -1;
  zt_db_worker_t row;
  memset(&row, 0, sizeof row);
  snprintf(row.name, sizeof row.name, "%s", r->name);
  snprintf(row.host, sizeof row.host, "%s", r->host);
  snprintf(row.device, sizeof row.device, "%s", r->device);
  row.state = ZT_WORKER_ALIVE;
  row.last_seen_ms = row.registered_ms = zt_wall_ms();
  row.pid = r->pid;
  row.host_memory = r->host_memory;
  row.device_memory = r->device_memory;
  char host[128];
  int port;
  if (r->store_addr && r->store_addr[0] &&
      (strlen(r->store_addr) >= sizeof row.store_addr ||
       zt_net_parse_hostport(r->store_addr, host, sizeof host, &port) != 0))
    return zt_errk(ZT_E_INVALID, "store_addr \"%.64s\" is not HOST:PORT", r->store_addr);
  snprintf(row.store_addr, sizeof row.store_addr, "%s", r->store_addr ? r->store_addr : "");
  if (zt_random_hex(row.session, 32) != 0) return zt_err_wrap("new session");
  const char *kind = !m ? "registered"
                     : (m->row.state == ZT_WORKER_LOST || m->row.state == ZT_WORKER_LEFT)
                         ? "rejoined"
                         : "reregistered";
  char detail[512];
  snprintf(detail, sizeof detail, "name=%s host=%s device=%s pid=%d%s%s", r->name, r->host,
           r->device, r->pid, m ? " previous_state=" : "",
           m ? zt_name_worker_state(m->row.state) : "");
  if (zt_db_begin(c->db) != 0) return zt_err_wrapk(ZT_E_UNAVAILABLE, "cannot store registration");
  if (zt_db_worker_upsert(c->db, &row) != 0 ||
      zt_coord_event_tx(c, 0, kind, row.id, detail) != 0 || zt_db_commit(c->db) != 0) {
    zt_err_wrapk(ZT_E_UNAVAILABLE, "cannot store registration");
    zt_db_rollback(c->db);
    return -1;
  }
  *known = m != NULL;
  if (m) {
    /* A new process (restarted, or back after it was lost) starts with a
     * clean slate: a connection that died with its old process says
     * nothing about its links. If it still cannot reach the others, the
     * probes of the next failure keep it out again. A drain was the old
     * process's way out (a preemption, a shutdown): the new one is
     * scheduled again, as a requeued Slurm job or a restarted service
     * expects. */
    if (m->row.pid != r->pid || m->row.state == ZT_WORKER_LOST ||
        m->row.state == ZT_WORKER_LEFT)
      m->quarantine_ms = 0, m->probe_asked = 0, m->n_unreach = 0, m->unreach_ms = 0,
      m->draining = 0;
    /* The credential the worker may still hold if this reply is lost:
     * the one it presented (the replaced one, or the one before that when
     * it asks again after a lost reply). */
    int live = m->row.state != ZT_WORKER_LOST && m->row.state != ZT_WORKER_LEFT;
    if (!live)
      remember_presented(m, r);
    else if (!(r->session && zt_secret_equal(r->session, m->prev_session)))
      memcpy(m->prev_session, m->row.session, sizeof m->prev_session);
    if (m->row.state == ZT_WORKER_LOST) m->back_ms = zt_now_ms(); /* sched.c's rejoin grace */
    m->row = row; /* restarted: the caller voids its old assignment */
  } else {
    m = members_add(c, &row);
    remember_presented(m, r);
  }
  if (strcmp(kind, "reregistered")) c->arrivals++;
  c->registrations++;
  m->last_hb_mono_ms = zt_now_ms();
  m->dirty = 0;
  m->recovered_ms = 0;
  m->nccl = r->nccl;
  m->hb_agent = r->hb_agent;
  m->hb_batch = 0; /* none heard yet in this registration */
  ZT_INFO("worker %s (id %llu) %s from %s", r->name, (unsigned long long)row.id, kind, r->host);
  *out = m;
  return 0;
}

int zt_members_authenticate(zt_coord_t *c, uint64_t id, const char *session) {
  zt_member_t *m = zt_members_get(c, id);
  if (!m)
    return zt_errk(ZT_E_NOT_FOUND, "unknown worker id %llu: register first",
                   (unsigned long long)id);
  if (!session || !session[0] || !zt_secret_equal(session, m->row.session))
    return zt_errk(ZT_E_UNAUTHENTICATED,
                   "worker %llu: session credential missing or wrong (register again)",
                   (unsigned long long)id);
  m->prev_session[0] = 0; /* the new credential arrived */
  return 0;
}

/* A member whose silence counts: alive or suspect. */
static int member_live(const zt_member_t *m) {
  return m && (m->row.state == ZT_WORKER_ALIVE || m->row.state == ZT_WORKER_SUSPECT);
}

static size_t live_members(const zt_coord_t *c) {
  size_t n = 0;
  for (size_t i = 0; i < c->by_id_cap; i++) n += member_live(c->by_id[i]);
  return n;
}

/* What one more heartbeat in a batch costs the coordinator, in single
 * calls: a batch of k costs 1 + (k - 1) x this (bench/heartbeats, zcoord
 * on one core: 25,000 single calls a second take 81% of it, 18,800
 * batches of 8 take 88%, so a batch of 8 costs about 1.4 calls). */
#define ZT_HB_ENTRY_COST 0.06

/* The batch size a worker that said it uses an agent is counted in before
 * its first batch: the average of the batches seen, or this before any (a
 * machine of 8 GPUs). */
#define ZT_HB_AGENT_GUESS 8

/* The calls the live members make per interval, in single calls: one
 * each, or their share of their machine agent's batch; *live gets how
 * many they are. */
static size_t live_calls(const zt_coord_t *c, size_t *live) {
  double n = 0;
  int guess = c->hb_calls[1] ? (int)(c->hb_batch_entries / c->hb_calls[1]) : ZT_HB_AGENT_GUESS;
  *live = 0;
  for (size_t i = 0; i < c->by_id_cap; i++) {
    if (!member_live(c->by_id[i])) continue;
    const zt_member_t *m = c->by_id[i];
    int k = ZT_MAX(1, m->hb_batch ? m->hb_batch : m->hb_agent ? guess : 1);
    n += (1.0 + (k - 1) * ZT_HB_ENTRY_COST) / k;
    ++*live;
  }
  return (size_t)(n + 0.5);
}

/* ---- Pace ---------------------------------------------------------------------
 *
 * One coordinator core takes about heartbeat_capacity heartbeat calls a
 * second (20,000 by default: bench/heartbeats kept p99 under 20 ms up to
 * 25,000 single calls a second, or 100,000 workers in batches of 8, on
 * one core); a machine agent's batch (HeartbeatBatch) of k costs about
 * 1 + 0.06 (k - 1) calls, each of its workers a share of it.
 * With more calls per interval than capacity x interval, the interval it
 * advertises in every heartbeat and register reply stretches to calls /
 * capacity, so the fleet sends no more than the coordinator can take
 * instead of queueing until calls time out and healthy workers are
 * declared lost (each of which registers again: a storm). Workers take
 * the interval from the reply (worker/control.c). Silences are judged by
 * the longest interval advertised within the last timeout: after the
 * interval shrinks, a worker that has not heard of it yet is still on the
 * longer one. The timeout scales with the interval. */

/* The timeout that goes with an interval: the configured one, scaled. */
static int64_t timeout_for(const zt_coord_t *c, int64_t interval_ms) {
  return (int64_t)c->cfg.heartbeat_timeout_ms * interval_ms / c->cfg.heartbeat_ms;
}

/* The interval silences are judged by. */
static int64_t judge_ms(const zt_coord_t *c) {
  return ZT_MAX((int64_t)c->cfg.heartbeat_ms, c->hb_judge_ms);
}

int64_t zt_members_interval_ms(const zt_coord_t *c) {
  return ZT_MAX((int64_t)c->cfg.heartbeat_ms, c->hb_interval_ms);
}

int64_t zt_members_timeout_ms(const zt_coord_t *c) {
  return timeout_for(c, zt_members_interval_ms(c));
}

/* What a registration costs, in heartbeat calls (a database write and the
 * scheduler's pass; bench/heartbeats: a fleet registering at once takes
 * about 5,000 a second of one core). */
#define ZT_REGISTER_COST 4

/* The registrations a second lately, smoothed over quarter seconds. */
static double registration_rate(zt_coord_t *c, int64_t now) {
  int64_t dt = now - c->reg_rate_ms;
  if (dt >= 250) {
    double inst = (double)(c->registrations - c->reg_rate_n) * 1000.0 / (double)dt;
    c->reg_rate = c->reg_rate_ms ? 0.5 * c->reg_rate + 0.5 * inst : inst;
    c->reg_rate_ms = now;
    c->reg_rate_n = c->registrations;
  }
  return c->reg_rate;
}

void zt_members_pace(zt_coord_t *c) {
  int64_t base = c->cfg.heartbeat_ms, now = zt_now_ms(), want = base;
  size_t live, calls = live_calls(c, &live), cap = (size_t)c->cfg.heartbeat_capacity;
  /* A fleet registering at once takes its share first (at most three
   * quarters): the heartbeats of those already in slow down meanwhile,
   * rather than every call waiting behind the burst. */
  double reg = registration_rate(c, now) * ZT_REGISTER_COST;
  size_t hb_cap = cap ? (size_t)ZT_MAX((double)cap / 4, (double)cap - reg) : 0;
  if (hb_cap > 0) want = ZT_MAX(base, (int64_t)((calls * 1000 + hb_cap - 1) / hb_cap));
  int64_t was = zt_members_interval_ms(c);
  /* Small changes are not worth a word to every worker: 10% either way. */
  if (want * 10 < was * 11 && want * 11 > was * 10 && want != base) want = was;
  if (want != was) {
    c->hb_pace_changes++;
    char detail[200];
    snprintf(detail, sizeof detail,
             "heartbeat interval %lld -> %lld ms for %zu live workers, %zu calls an interval "
             "(capacity %d a second, %.0f registrations a second)",
             (long long)was, (long long)want, live, calls, c->cfg.heartbeat_capacity,
             c->reg_rate);
    if (want > was) ZT_WARN("%s", detail);
    else ZT_INFO("%s", detail);
    zt_coord_event(c, 0, "heartbeat_pace", 0, "%s", detail);
  }
  if (want >= judge_ms(c)) {
    c->hb_judge_ms = want;
    c->hb_judge_until_ms = 0;
  } else if (want < was) {
    c->hb_judge_until_ms = now + timeout_for(c, judge_ms(c)); /* the longer one holds a timeout */
  } else if (c->hb_judge_until_ms && now > c->hb_judge_until_ms) {
    c->hb_judge_ms = want;
    c->hb_judge_until_ms = 0;
  }
  c->hb_interval_ms = want;
}

/* Quiet for longer than this, with two or more live members: blind. */
static int64_t blind_after_ms(const zt_coord_t *c) { return 2 * judge_ms(c); }

int zt_members_blind(const zt_coord_t *c, int64_t now) {
  return c->last_any_hb_ms && now - c->last_any_hb_ms > blind_after_ms(c) &&
         live_members(c) >= 2;
}

/* A heartbeat ends a blind period: every live member's silence counts
 * from one interval before now (see the top of the file). */
static void blind_end(zt_coord_t *c, int64_t now) {
  int64_t quiet = now - c->last_any_hb_ms;
  c->blind_periods++;
  if (quiet > c->blind_max_ms) c->blind_max_ms = quiet;
  char detail[200];
  snprintf(detail, sizeof detail,
           "heard from no worker for %lld ms while %zu were alive: the coordinator's own "
           "network, most likely; their silence in it does not count",
           (long long)quiet, live_members(c));
  ZT_WARN("%s", detail);
  zt_coord_event(c, 0, "coordinator_blind", 0, "%s", detail);
  for (size_t i = 0; i < c->by_id_cap; i++) {
    zt_member_t *m = c->by_id[i];
    if (member_live(m))
      m->last_hb_mono_ms = ZT_MAX(m->last_hb_mono_ms, now - judge_ms(c));
  }
}

int zt_members_heartbeat(zt_coord_t *c, uint64_t id, zt_member_t **out) {
  zt_member_t *m = zt_members_get(c, id);
  if (!m) return zt_errk(ZT_E_NOT_FOUND, "unknown worker id %llu: register first", (unsigned long long)id);
  if (m->row.state == ZT_WORKER_LOST || m->row.state == ZT_WORKER_LEFT)
    return zt_errk(ZT_E_STATE, "worker %s (id %llu) is %s: register again", m->row.name,
                   (unsigned long long)id, zt_name_worker_state(m->row.state));
  int64_t now = zt_now_ms();
  if (zt_members_blind(c, now)) blind_end(c, now);
  c->last_any_hb_ms = now;
  /* Alive again at once; the database hears of it with the next liveness
   * check's changes (a fleet that recovers together is one transaction). */
  if (m->row.state == ZT_WORKER_SUSPECT) {
    m->row.state = ZT_WORKER_ALIVE;
    m->recovered_ms = ZT_MAX(1, now - m->last_hb_mono_ms);
  }
  m->last_hb_mono_ms = now;
  m->row.last_seen_ms = zt_wall_ms();
  m->dirty = 1;
  m->hb_seq++;
  *out = m;
  return 0;
}

static int sane_ms(double v) { return isfinite(v) && v >= 0 && v < 1e9; }

void zt_members_timing(zt_coord_t *c, zt_member_t *m, double step_ms, double comm_ms,
                       double send_wait_ms, double link_rtt_ms) {
  int64_t now = zt_now_ms();
  if (step_ms > 0 && sane_ms(step_ms) && sane_ms(comm_ms) && sane_ms(send_wait_ms) &&
      sane_ms(link_rtt_ms)) {
    m->step_ms = step_ms, m->comm_ms = comm_ms, m->send_wait_ms = send_wait_ms;
    m->link_rtt_ms = link_rtt_ms;
    m->timing_ms = now;
  } else if (m->timing_ms && now - m->timing_ms > 10 * (int64_t)c->cfg.heartbeat_ms + 10000) {
    m->step_ms = m->comm_ms = m->send_wait_ms = m->link_rtt_ms = 0; /* it no longer trains */
    m->timing_ms = 0;
  }
}

void zt_members_quarantine(zt_coord_t *c, zt_member_t *m) {
  (void)c;
  m->quarantine_ms = zt_now_ms();
  m->probe_asked = 0;
}

void zt_members_unreach(zt_coord_t *c, zt_member_t *m, const uint64_t *ids, int n) {
  (void)c;
  m->n_unreach = 0;
  for (int i = 0; i < n && m->n_unreach < ZT_MEMBER_UNREACH; i++)
    if (ids[i] && ids[i] != m->row.id) m->unreach[m->n_unreach++] = ids[i];
  m->unreach_ms = zt_now_ms();
}

int zt_members_unreached(const zt_member_t *m, uint64_t id) {
  if (!m->unreach_ms || zt_now_ms() - m->unreach_ms > ZT_UNREACH_MEMORY_MS) return 0;
  for (int i = 0; i < m->n_unreach; i++)
    if (m->unreach[i] == id) return 1;
  return 0;
}

static void let_back(zt_coord_t *c, zt_member_t *m, const char *how) {
  zt_coord_event(c, m->job_id, "worker_reachable", m->row.id,
                 "worker %s %s after %lld ms kept out; it may be scheduled again", m->row.name,
                 how, (long long)(zt_now_ms() - m->quarantine_ms));
  m->quarantine_ms = 0;
  m->probe_asked = 0;
}

int zt_members_probe(zt_coord_t *c, zt_member_t *m, int probed, size_t n_unreach,
                     const char *first, const char **addrs, int max) {
  if (!m->quarantine_ms) return 0;
  if (probed && m->probe_asked) {
    if (!n_unreach) {
      let_back(c, m, "reaches every other worker's store");
      return 0;
    }
    ZT_DEBUG("worker %s still cannot reach %zu stores (first %.96s)", m->row.name, n_unreach,
             first ? first : "");
  }
  int n = 0;
  for (size_t i = 0; i < c->by_id_cap && n < max; i++) {
    zt_member_t *o = c->by_id[i];
    if (o && o != m && o->row.state == ZT_WORKER_ALIVE && !o->quarantine_ms && o->row.store_addr[0])
      addrs[n++] = o->row.store_addr;
  }
  if (!n) {
    let_back(c, m, "has no other worker to reach");
    return 0;
  }
  m->probe_asked = 1;
  return n;
}

int zt_members_leave(zt_coord_t *c, uint64_t id, const char *reason, int *left) {
  zt_member_t *m = zt_members_get(c, id);
  *left = 0;
  if (!m) return zt_errk(ZT_E_NOT_FOUND, "unknown worker id %llu", (unsigned long long)id);
  if (m->row.state == ZT_WORKER_LEFT) return 0;
  char detail[512];
  snprintf(detail, sizeof detail, "reason: %.400s", reason && *reason ? reason : "unspecified");
  if (transition(c, m, ZT_WORKER_LEFT, "left", detail) != 0)
    return zt_err_wrapk(ZT_E_UNAVAILABLE, "cannot store leave");
  *left = 1;
  return 0;
}

/* ---- the liveness check -------------------------------------------------------
 *
 * Its changes (recovered, suspect, lost) are written in one transaction:
 * one commit a check however many workers changed, where a commit each
 * held the loop for seconds when a large fleet went suspect together,
 * which delayed heartbeats further (a feedback loop). Past
 * ZT_CHECK_EVENTS of one kind in a check, the logbook gets one event
 * that counts the rest rather than an event each. If the transaction
 * fails, nothing changes in memory either, and the next check tries
 * again. */

#define ZT_CHECK_EVENTS 64

typedef struct {
  zt_member_t *m;
  int state;
  int kind; /* index into k_check_kinds */
  char detail[160];
} check_change_t;

static const char *const k_check_kinds[] = {"recovered", "suspect", "lost"};

static check_change_t *add_change(check_change_t **v, size_t *n, size_t *cap, zt_member_t *m,
                                  int state, int kind) {
  if (*n == *cap) *v = zt_xrealloc(*v, (*cap = *cap ? *cap * 2 : 64) * sizeof **v);
  check_change_t *x = &(*v)[(*n)++];
  x->m = m, x->state = state, x->kind = kind;
  return x;
}

static int write_changes(zt_coord_t *c, const check_change_t *v, size_t n, int64_t wall) {
  size_t count[3] = {0};
  if (zt_db_begin(c->db) != 0) return -1;
  for (size_t i = 0; i < n; i++) {
    if (zt_db_worker_set_state(c->db, v[i].m->row.id, v[i].state, wall) != 0) goto err;
    if (count[v[i].kind]++ < ZT_CHECK_EVENTS &&
        zt_coord_event_tx(c, 0, k_check_kinds[v[i].kind], v[i].m->row.id, v[i].detail) != 0)
      goto err;
  }
  for (int k = 0; k < 3; k++) {
    if (count[k] <= ZT_CHECK_EVENTS) continue;
    char detail[160];
    snprintf(detail, sizeof detail, "and %zu more workers %s in the same check (%zu in all)",
             count[k] - ZT_CHECK_EVENTS, k_check_kinds[k], count[k]);
    if (zt_coord_event_tx(c, 0, k_check_kinds[k], 0, detail) != 0) goto err;
  }
  if (zt_db_commit(c->db) != 0) goto err;
  return 0;
err:
  zt_db_rollback(c->db);
  return -1;
}

size_t zt_members_check(zt_coord_t *c, int64_t lag_ms, uint64_t **lost) {
  /* Everything that came in before now - lag has been handled. */
  int64_t now = zt_now_ms() - ZT_MAX(0, lag_ms);
  int64_t suspect_after = 2 * judge_ms(c);
  int64_t lost_after = timeout_for(c, judge_ms(c));
  check_change_t *v = NULL;
  size_t n = 0, cap = 0, n_lost = 0;
  *lost = NULL;
  /* Blind (see the top of the file): nobody is lost, for a while. */
  int blind = zt_members_blind(c, now) && now - c->last_any_hb_ms <= c->cfg.blind_max_ms;
  for (size_t i = 0; i < c->by_id_cap; i++) {
    zt_member_t *m = c->by_id[i];
    if (!member_live(m)) continue;
    if (m->recovered_ms)
      snprintf(add_change(&v, &n, &cap, m, ZT_WORKER_ALIVE, 0)->detail, sizeof v->detail,
               "heartbeat after %lld ms of silence", (long long)m->recovered_ms);
    int64_t silent = now - m->last_hb_mono_ms;
    if (silent > lost_after && !blind) {
      snprintf(add_change(&v, &n, &cap, m, ZT_WORKER_LOST, 2)->detail, sizeof v->detail,
               "no heartbeat for %lld ms (timeout %lld ms)", (long long)silent,
               (long long)lost_after);
      n_lost++;
    } else if (silent > suspect_after && m->row.state == ZT_WORKER_ALIVE) {
      snprintf(add_change(&v, &n, &cap, m, ZT_WORKER_SUSPECT, 1)->detail, sizeof v->detail,
               "no heartbeat for %lld ms (interval %lld ms)", (long long)silent,
               (long long)judge_ms(c));
    }
  }
  int64_t wall = zt_wall_ms();
  if (n && write_changes(c, v, n, wall) != 0) {
    ZT_ERROR("cannot store the liveness of %zu workers (tried again in the next check): %s", n,
             zt_err_msg());
    n = n_lost = 0;
  }
  if (n_lost) *lost = zt_xmalloc(n_lost * sizeof **lost);
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    zt_member_t *m = v[i].m;
    if (i < ZT_CHECK_EVENTS)
      ZT_INFO("worker %s (id %llu): %s -> %s: %s", m->row.name, (unsigned long long)m->row.id,
              zt_name_worker_state(v[i].kind ? m->row.state : ZT_WORKER_SUSPECT),
              zt_name_worker_state(v[i].state), v[i].detail);
    m->row.state = v[i].state;
    m->row.last_seen_ms = wall;
    m->dirty = 0;
    m->recovered_ms = 0;
    if (v[i].state == ZT_WORKER_LOST) (*lost)[k++] = m->row.id;
  }
  if (n > ZT_CHECK_EVENTS)
    ZT_INFO("and %zu more changes of worker state in this check", n - ZT_CHECK_EVENTS);
  free(v);
  return k;
}

void zt_members_credit(zt_coord_t *c, int64_t ms) {
  ZT_WARN("the coordinator's loop was held up for %lld ms: no worker's silence counts it",
          (long long)ms);
  for (size_t i = 0; i < c->by_id_cap; i++)
    if (c->by_id[i]) c->by_id[i]->last_hb_mono_ms += ms;
  if (c->last_any_hb_ms) c->last_any_hb_ms += ms; /* nor does it make the coordinator blind */
}

/* A slice of the members (all with ZT_FLUSH_ALL) from the rolling cursor:
 * one transaction for 100,000 rows holds the loop for a quarter second,
 * a twentieth of them a dozen milliseconds. */
void zt_members_flush(zt_coord_t *c, size_t slice) {
  size_t n = 0, cap = 0, todo = ZT_MIN(slice, c->by_id_cap);
  uint64_t *ids = NULL;
  int64_t *seen = NULL;
  for (size_t k = 0; k < todo; k++) {
    size_t i = (c->flush_cursor + k) % c->by_id_cap;
    zt_member_t *m = c->by_id[i];
    if (!m || !m->dirty) continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 256;
      ids = zt_xrealloc(ids, cap * sizeof *ids);
      seen = zt_xrealloc(seen, cap * sizeof *seen);
    }
    ids[n] = m->row.id;
    seen[n++] = m->row.last_seen_ms;
  }
  if (c->by_id_cap) c->flush_cursor = (c->flush_cursor + todo) % c->by_id_cap;
  if (n && zt_db_workers_touch(c->db, ids, seen, (int)n) == 0) {
    for (size_t i = 0; i < n; i++) c->by_id[ids[i]]->dirty = 0;
  } else if (n) {
    ZT_WARN("cannot flush last_seen of %zu workers: %s", n, zt_err_msg());
  }
  free(ids);
  free(seen);
}
