/*
 * rendezvous.c: the ranks of a new generation meet.
 *
 * The scheduler (sched.c) forms a generation in the database and assigns
 * its workers their ranks; each member learns of it through its next
 * heartbeat reply (RECONFIGURE with the job and generation: jobtable.c's
 * fence). Each member then calls Rendezvous with the address of its
 * collective socket; those calls are held here (a long poll) until every
 * rank has called, then all are answered at once, so every rank starts its
 * ring with the same view. The job is RUNNING from then on.
 *
 * What each rank receives: the peers' collective addresses and replica
 * stores, the spec, the start step and epoch (relative to the checkpoint
 * root, with the recorded size and checksum of every file, and which
 * stores hold copies of each, with tickets, those the rank may not reach
 * now last: copies.c), the accumulation steps for
 * this world size, the data to skip and the lowered LR a rollback left,
 * where to push its own checkpoint copies (the ranks after it, one per
 * other machine, with tickets), and the ring's key, made afresh for every
 * generation. In a generation whose ranks all have GPUs of their own
 * (sched.c's choose_comm), rank 0 is told by its heartbeat to make an NCCL
 * unique id (zt_rdv_nccl_root) and sends it with its call; the others
 * receive it in their reply.
 *
 * Recovery from memory (docs/zero.md). Each rank's call says which model
 * state it kept in memory when the job's last generation failed (ZeRO
 * stage 0: the whole state after some step). decide_start takes the
 * newest step L some rank holds on the job's trajectory (the same
 * rollback count); when L is at or after the epoch's step and no rollback
 * or pause chose the epoch, the generation starts there with no epoch
 * read: the reply names L instead of the epoch, and the lowest rank that
 * holds it when not every rank does (it sends the state to the others);
 * rank 0 reports again the steps after the last one stored here, which
 * the old rank 0 may have taken with it. Otherwise the epoch is loaded,
 * and when some rank held a state the logbook says why it was not used.
 *
 * A held call is answered with an error when its generation is superseded
 * or ends (zt_rdv_release, from sched.c), and with UNAVAILABLE when the
 * coordinator stops (zt_rdv_release_all): the worker calls again.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "zt_net.h"
#include "ztrain.pb-c.h"

/* ---- the reply --------------------------------------------------------------- */

/* Where rank r pushes copies of its files: the ranks after it, one per
 * machine other than its own, each with a ticket for its store. */
static int replica_targets(zt_coord_t *c, zt_job_t *j, int r, Ztrain__ReplicaTarget *t,
                           Ztrain__ReplicaTarget **tp, char (*tickets)[ZT_TICKET_MAX]) {
  uint8_t used[ZT_MAX_WORLD / 8] = {0};
  used[j->host_of[r] / 8] |= (uint8_t)(1u << (j->host_of[r] % 8));
  int n = 0;
  for (int d = 1; d < j->row.world; d++) {
    int q = (r + d) % j->row.world, h = j->host_of[q];
    zt_member_t *m = zt_members_get(c, j->workers[q]);
    if ((used[h / 8] >> (h % 8)) & 1 || !m || !m->row.store_addr[0]) continue;
    zt_ticket_t tk = {.op = "put", .job = j->row.id, .gen = j->row.generation,
                      .requester = j->workers[r], .expiry_ms = 0 /* ends with the generation */};
    snprintf(tk.scope, sizeof tk.scope, "r%d", r);
    if (zt_ticket_make(m->row.session, &tk, tickets[n], ZT_TICKET_MAX) != 0) continue;
    ztrain__replica_target__init(&t[n]);
    t[n].worker_id = m->row.id;
    t[n].addr = m->row.store_addr;
    t[n].host = m->row.host;
    t[n].ticket = tickets[n];
    tp[n] = &t[n];
    used[h / 8] |= (uint8_t)(1u << (h % 8));
    n++;
  }
  return n;
}

/* The holders of every file of the start epoch, with tickets for rank r. */
static void start_copies(zt_coord_t *c, zt_job_t *j, int r, zt_copies_pool_t *pool) {
  zt_db_ckpt_t k;
  uint64_t kjob;
  int found = 0;
  if (!j->start_ckpt[0] || !j->n_start_files ||
      zt_db_ckpt_find_dir(c->db, j->start_ckpt, &kjob, &k, &found) != 0 || !found)
    return;
  if (zt_copies_holders(c, j, kjob, &k, j->start_files, j->n_start_files, j->workers[r], pool) !=
      0)
    ZT_WARN("job %llu: copies of %s: %s", (unsigned long long)j->row.id, j->start_ckpt,
            zt_err_msg());
}

/* The arrays a reply points into, besides the job's own strings. */
typedef struct {
  char *peers[ZT_MAX_WORLD], *stores[ZT_MAX_WORLD];
  Ztrain__SkipRange sr[ZT_MAX_SKIP_RANGES], *srp[ZT_MAX_SKIP_RANGES];
  Ztrain__CheckpointFile *cf, **cfp;        /* the start epoch's files */
  Ztrain__ReplicaTarget *t, **tp;           /* where to push copies */
  char (*tickets)[ZT_TICKET_MAX];
  zt_copies_pool_t pool;                    /* who holds the start epoch's files */
} reply_parts_t;

static void free_parts(reply_parts_t *p) {
  zt_copies_pool_free(&p->pool);
  free(p->tickets);
  free(p->tp);
  free(p->t);
  free(p->cfp);
  free(p->cf);
}

/* The generation's peers, the data to skip and the LR a rollback left. */
static void fill_generation(zt_coord_t *c, zt_job_t *j, int r, reply_parts_t *p,
                            Ztrain__RendezvousReply *rep) {
  for (int i = 0; i < j->row.world; i++) {
    zt_member_t *m = zt_members_get(c, j->workers[i]);
    p->peers[i] = j->comm_addr[i];
    p->stores[i] = m ? m->row.store_addr : "";
  }
  rep->job_id = j->row.id;
  rep->generation = j->row.generation;
  rep->rank = (uint32_t)r;
  rep->world = (uint32_t)j->row.world;
  rep->n_peers = (size_t)j->row.world;
  rep->peers = p->peers;
  rep->n_peer_stores = (size_t)j->row.world;
  rep->peer_stores = p->stores;
  rep->spec_json = j->spec;
  rep->start_step = j->start_step;
  rep->live_step = j->live_start;
  rep->reported_step = j->reported_step;
  rep->live_source = (uint32_t)j->live_source;
  rep->accum_steps = (uint32_t)((j->p.global_batch / j->p.micro + j->row.world - 1) /
                                j->row.world); /* the most of one rank under equal shares */
  rep->comm_timeout_ms = j->p.comm_timeout_ms;
  rep->nccl_id = j->nccl ? j->nccl_id : "";
  rep->comm_key = j->comm_key;
  const zt_range_list_t *sk = &j->row.skips;
  for (int i = 0; i < sk->n; i++) {
    ztrain__skip_range__init(&p->sr[i]);
    p->sr[i].start = sk->r[i].start, p->sr[i].end = sk->r[i].end;
    p->srp[i] = &p->sr[i];
  }
  rep->n_skips = (size_t)sk->n;
  rep->skips = p->srp;
  rep->lr_factor = j->row.lr_factor > 0 ? j->row.lr_factor : 1.0;
  rep->lr_factor_until = j->row.lr_until;
  rep->rollbacks = (uint32_t)j->row.rollbacks;
}

/* The start epoch (its files and who holds copies of them) and where rank
 * r pushes copies of its own. */
static void fill_checkpoints(zt_coord_t *c, zt_job_t *j, int r, reply_parts_t *p,
                             Ztrain__RendezvousReply *rep) {
  /* Paths cross the wire relative to the checkpoint root: each host
   * resolves them under its own. A start from memory reads no epoch. */
  int epoch = !j->live_start;
  const char *rel = zt_path_under(c->cfg.ckpt_root, j->start_ckpt);
  rep->checkpoint_dir = !epoch ? "" : (char *)(rel ? rel : j->start_ckpt);
  p->cf = zt_xcalloc((size_t)j->n_start_files + 1, sizeof *p->cf);
  p->cfp = zt_xcalloc((size_t)j->n_start_files + 1, sizeof *p->cfp);
  for (int i = 0; i < j->n_start_files; i++) {
    ztrain__checkpoint_file__init(&p->cf[i]);
    p->cf[i].name = j->start_files[i].name;
    p->cf[i].bytes = j->start_files[i].bytes;
    p->cf[i].checksum = j->start_files[i].checksum;
    p->cfp[i] = &p->cf[i];
  }
  rep->n_checkpoint_files = epoch ? (size_t)j->n_start_files : 0;
  rep->checkpoint_files = p->cfp;
  /* Copies: where to push ours, where to fetch the start epoch's. */
  rep->replicas = (uint32_t)ZT_MAX(1, ZT_MIN(j->p.replicas, j->n_hosts));
  p->t = zt_xcalloc((size_t)j->row.world, sizeof *p->t);
  p->tp = zt_xcalloc((size_t)j->row.world, sizeof *p->tp);
  p->tickets = zt_xcalloc((size_t)j->row.world, ZT_TICKET_MAX);
  rep->n_replica_targets = (size_t)replica_targets(c, j, r, p->t, p->tp, p->tickets);
  rep->replica_targets = p->tp;
  if (epoch) start_copies(c, j, r, &p->pool);
  rep->n_checkpoint_copies = (size_t)p->pool.n;
  rep->checkpoint_copies = p->pool.fcp;
}

/* The reply rank r receives, packed (malloc'd). */
static uint8_t *pack_rendezvous(zt_coord_t *c, zt_job_t *j, int r, size_t *len) {
  Ztrain__RendezvousReply rep = ZTRAIN__RENDEZVOUS_REPLY__INIT;
  reply_parts_t *p = zt_xcalloc(1, sizeof *p);
  fill_generation(c, j, r, p, &rep);
  fill_checkpoints(c, j, r, p, &rep);
  *len = ztrain__rendezvous_reply__get_packed_size(&rep);
  uint8_t *buf = zt_xmalloc(*len);
  ztrain__rendezvous_reply__pack(&rep, buf);
  free_parts(p);
  free(p);
  return buf;
}

/* The rank whose kept state the generation starts from: the newest step
 * of the job's trajectory any rank holds, the lowest such rank; -1 when
 * none holds one. */
static int newest_state(const zt_job_t *j) {
  int best = -1;
  for (int r = 0; r < j->row.world; r++)
    if (j->live_step[r] > 0 && j->live_rb[r] == (uint32_t)j->row.rollbacks &&
        (best < 0 || j->live_step[r] > j->live_step[best]))
      best = r;
  return best;
}

/* Why the state rank s holds cannot start the generation ("" when it
 * can). */
static void why_not_memory(const zt_job_t *j, int s, char *why, size_t len) {
  why[0] = 0;
  if (j->forced_start) {
    snprintf(why, len, "a rollback or a pause set the start at the epoch of step %lld",
             (long long)j->start_step);
    return;
  }
  if (s < 0) {
    snprintf(why, len, "the states kept are from before rollback %d", j->row.rollbacks);
    return;
  }
  int64_t L = j->live_step[s];
  if (L < j->start_step)
    snprintf(why, len, "the epoch at step %lld is newer than the state after step %lld",
             (long long)j->start_step, (long long)L);
  else if (L >= j->row.total_steps)
    snprintf(why, len, "step %lld is the job's last", (long long)L);
  else if (L > j->reported_step && j->live_from[s] > j->reported_step + 1)
    snprintf(why, len, "rank %d no longer keeps the reports of steps %lld..%lld, which were never "
             "stored", s, (long long)j->reported_step + 1, (long long)j->live_from[s] - 1);
}

/* Where the generation starts: from memory or from its epoch (above). */
static void decide_start(zt_coord_t *c, zt_job_t *j) {
  int held = 0, s = newest_state(j);
  for (int r = 0; r < j->row.world; r++) held += j->live_step[r] > 0;
  j->live_start = 0, j->live_source = 0;
  if (!held) return;
  char why[200];
  why_not_memory(j, s, why, sizeof why);
  unsigned long long gen = (unsigned long long)j->row.generation;
  if (why[0]) {
    zt_coord_event(c, j->row.id, "resumed_from_epoch", 0,
                   "generation %llu starts from the epoch at step %lld, not from memory: %s", gen,
                   (long long)j->start_step, why);
    return;
  }
  int64_t L = j->live_step[s];
  int have = 0;
  for (int r = 0; r < j->row.world; r++) have += j->live_step[r] == L;
  if (have < j->row.world) j->live_source = s + 1;
  char how[96] = "every rank holds it";
  if (have < j->row.world)
    snprintf(how, sizeof how, "%d of %d ranks hold it, rank %d sends it to the others", have,
             j->row.world, s);
  zt_coord_event(c, j->row.id, "resumed_from_memory", 0,
                 "generation %llu resumes from the state after step %lld kept in memory (%s), "
                 "with no epoch read; from the epoch at step %lld, %lld steps would have been "
                 "trained again",
                 gen, (long long)L, how, (long long)j->start_step, (long long)(L - j->start_step));
  j->live_start = j->start_step = j->row.step = L;
  if (zt_db_generation_start(c->db, j->row.id, j->row.generation, L) != 0)
    ZT_WARN("job %llu: the start step of generation %llu is not stored: %s",
            (unsigned long long)j->row.id, gen, zt_err_msg());
}

/* Every rank has called: each is answered with its reply, and the job runs. */
static void reply_rendezvous(zt_coord_t *c, zt_job_t *j) {
  /* Without a key the ranks refuse to connect the ring, and say why. */
  if (zt_random_hex(j->comm_key, 32) != 0) {
    ZT_ERROR("job %llu: no ring key for generation %llu: %s", (unsigned long long)j->row.id,
             (unsigned long long)j->row.generation, zt_err_msg());
    j->comm_key[0] = 0;
  }
  decide_start(c, j);
  for (int r = 0; r < j->row.world; r++) {
    size_t n;
    uint8_t *buf = pack_rendezvous(c, j, r, &n);
    zt_rpc_reply(j->rdv[r], ZT_RPC_OK, NULL, buf, n);
    free(buf);
    j->rdv[r] = NULL;
  }
  j->arrived = 0;
  j->row.state = ZT_JOB_RUNNING;
  zt_jobtable_running_message(j);
  zt_jobtable_save(c, j);
  zt_coord_event(c, j->row.id, "rendezvous_complete", 0,
                 "generation %llu: %d ranks connected %lld ms after forming",
                 (unsigned long long)j->row.generation, j->row.world,
                 (long long)(zt_now_ms() - j->formed_ms));
}

/* ---- the calls --------------------------------------------------------------- */

/* A rendezvous call is from a member of the current generation, with a
 * HOST:PORT to connect its ring to and, from rank 0 of an NCCL generation
 * only, a well-formed NCCL unique id. */
static int check_call(zt_coord_t *c, const Ztrain__RendezvousRequest *req, zt_job_t **jout,
                      zt_member_t **mout) {
  zt_job_t *j;
  zt_member_t *m;
  char host[128];
  int port;
  if (zt_jobtable_fence(c, req->worker_id, req->job_id, req->generation, &j, &m) != 0) return -1;
  if (strlen(req->comm_addr) >= sizeof j->comm_addr[0] ||
      zt_net_parse_hostport(req->comm_addr, host, sizeof host, &port) != 0)
    return zt_errk(ZT_E_INVALID, "comm_addr \"%.64s\" is not HOST:PORT", req->comm_addr);
  if (req->nccl_id[0] && (m->rank != 0 || !j->nccl))
    return zt_errk(ZT_E_INVALID, "nccl_id from rank %d: only rank 0 of a generation whose ranks "
                   "all have GPUs of their own makes one", m->rank);
  if (req->nccl_id[0] && (strlen(req->nccl_id) != 256 ||
                          strspn(req->nccl_id, "0123456789abcdef") != 256))
    return zt_errk(ZT_E_INVALID, "nccl_id is not 256 lowercase hex characters");
  *jout = j;
  *mout = m;
  return 0;
}

void zt_rdv_arrive(zt_coord_t *c, zt_rpc_call_t *call, const Ztrain__RendezvousRequest *req) {
  zt_job_t *j = NULL;
  zt_member_t *m = NULL;
  if (check_call(c, req, &j, &m) != 0) {
    zt_rpc_reply(call, zt_errkind_grpc(zt_err_kind()), zt_err_msg(), NULL, 0);
    return;
  }
  int r = m->rank;
  if (r == 0 && j->nccl) snprintf(j->nccl_id, sizeof j->nccl_id, "%s", req->nccl_id);
  if (j->rdv[r]) { /* a retry replaces the earlier call */
    zt_rpc_reply(j->rdv[r], ZT_RPC_ABORTED, "replaced by a newer rendezvous call", NULL, 0);
    j->arrived--;
  }
  j->rdv[r] = call;
  snprintf(j->comm_addr[r], sizeof j->comm_addr[r], "%s", req->comm_addr);
  j->live_step[r] = req->live_step > 0 ? req->live_step : 0;
  j->live_rb[r] = req->live_rollbacks;
  j->live_from[r] = req->live_reports_from;
  if (++j->arrived == j->row.world) reply_rendezvous(c, j);
}

void zt_rdv_release(zt_job_t *j, int status, const char *why) {
  for (int r = 0; r < ZT_MAX_WORLD; r++) {
    if (j->rdv[r]) zt_rpc_reply(j->rdv[r], status, why, NULL, 0);
    j->rdv[r] = NULL;
    j->comm_addr[r][0] = 0;
  }
  j->arrived = 0;
}

void zt_rdv_release_all(zt_coord_t *c) {
  for (zt_job_t *j = c->jobs; j; j = j->next)
    zt_rdv_release(j, ZT_RPC_UNAVAILABLE, "coordinator stopping; call again");
}

int zt_rdv_nccl_root(zt_coord_t *c, const zt_member_t *m) {
  zt_job_t *j = m && m->job_id ? zt_jobtable_get(c, m->job_id) : NULL;
  return j && j->nccl && m->rank == 0 && m->gen == j->row.generation;
}
