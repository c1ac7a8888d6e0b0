/*
 * runner.c: the job runner thread (see runner.h).
 *
 * State shared with the control thread is one "target" (job, generation)
 * under a mutex, plus the communicator of the generation in progress, so
 * that a new target can abort it from the control thread. The runner thread
 * loop is:
 *
 *   wait for a target != what we did last
 *   listen, Rendezvous (long poll, retried until the target changes)
 *   create the ring, train (zt_gen_train), report the outcome
 *
 * Every wait is bounded or interruptible: Rendezvous calls carry a deadline
 * and are retried; the ring set-up has the job's comm timeout; training
 * polls should_stop() and its collectives are aborted on a new target.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm.h"
#include "cores.h"
#include "device.h"
#include "pbcall.h"
#include "replicas.h"
#include "runner.h"
#include "store.h"
#include "trainer.h"
#include "zt_common.h"
#include "zt_rpc.h"
#include "ztrain.pb-c.h"

struct zt_runner {
  zt_ctl_t *ctl;
  zt_runner_opts_t o;
  char comm_host[64], workdir[512];
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t target_job, target_gen; /* under mu */
  int target_nccl_root;            /* under mu: we make its NCCL unique id */
  int quit;                        /* under mu */
  zt_comm_t *active;               /* under mu: the comm to abort on change */
  uint64_t cur_job, cur_gen;       /* runner thread only */
  /* The compute time per micro-batch that job micro_job last measured
   * here (zt_gen_ctx_t.micro_ms); runner thread only. */
  uint64_t micro_job;
  double micro_ms;
  /* DiLoCo: the round this worker's group kept when a group was lost
   * (zt_gen_ctx_t.diloco_stash), for job micro_job; runner thread only. */
  struct zt_diloco_stash *stash;
  /* The model state the last failed generation of job micro_job left in
   * memory (zt_gen_ctx_t.live), named in our rendezvous calls; runner
   * thread only. */
  zt_live_t *live;
  /* The load balance's newest plan, to go with the report of step
   * plan_step (plan_n 0: none pending); under mu. */
  uint32_t plan[ZT_GEN_MAX_SHARES];
  int plan_n;
  int64_t plan_step;
  /* The rendezvous of the generation being trained (its replica targets
   * are read by the checkpoint writer's thread while it runs). */
  const Ztrain__RendezvousReply *rv;
  /* Training counters (zt_runner_timing): steps of this process, and the
   * collective counters of finished generations (under mu). */
  int64_t steps;
  double step_ms;
  uint64_t comm_us_done, send_wait_us_done;
  /* Rank 0's step reports, sent in order by the reporter thread so that
   * training does not wait for the coordinator (a short outage of it must
   * not stall the ring past its timeout). All under mu. The queue is
   * bounded: when it is full, training waits. A command in a reply
   * (checkpoint now, stop, roll back) applies from the next step. */
  pthread_cond_t rep_cv;
  zt_step_report_t *q;
  int q_head, q_len, rep_stop;
  zt_train_cmd_t rep_cmd;
  int64_t rep_acked; /* newest step whose report was answered */
};

/* Rank 0's step reports that may wait for an unreachable coordinator
 * before training waits too: a minute of its outage at a thousand steps a
 * second (4.5 MiB, touched only as far as it fills). Once it answers, the
 * reporter drains them ZT_REPORT_BATCH to a call. */
#define ZT_REPORT_QUEUE 65536

void zt_runner_timing(zt_runner_t *r, zt_ctl_timing_t *t) {
  pthread_mutex_lock(&r->mu);
  zt_comm_stats_t s = {0};
  if (r->active) zt_comm_stats_get(r->active, &s);
  t->steps = r->steps;
  t->step_ms = r->step_ms;
  t->comm_us = r->comm_us_done + s.comm_us;
  t->send_wait_us = r->send_wait_us_done + s.send_wait_us;
  t->link_rtt_us = s.next_rtt_us;
  pthread_mutex_unlock(&r->mu);
}

static void step_done_cb(void *user, int64_t step, double ms) {
  zt_runner_t *r = user;
  (void)step;
  pthread_mutex_lock(&r->mu);
  r->steps++;
  r->step_ms += ms;
  pthread_mutex_unlock(&r->mu);
}

void zt_runner_assign(zt_runner_t *r, uint64_t job, uint64_t gen, int nccl_root) {
  pthread_mutex_lock(&r->mu);
  /* Assignments come on two channels (heartbeat replies, and the reply to
   * a failure report), so one may overtake another: a heartbeat answered
   * before the job re-formed can arrive after the failure report's reply
   * named the new generation. Generations of a job only grow, so an older
   * one is stale and dropped; taken, it aborted the new generation's ring
   * set-up, and its peers waited out their set-up timeout. */
  if (job && job == r->target_job && gen < r->target_gen) {
    pthread_mutex_unlock(&r->mu);
    ZT_DEBUG("assignment of generation %llu dropped: generation %llu is newer",
             (unsigned long long)gen, (unsigned long long)r->target_gen);
    return;
  }
  r->target_nccl_root = nccl_root;
  if (job != r->target_job || gen != r->target_gen) {
    r->target_job = job;
    r->target_gen = gen;
    if (r->active) zt_comm_abort(r->active);
    pthread_cond_broadcast(&r->cv);
    pthread_cond_broadcast(&r->rep_cv);
  }
  pthread_mutex_unlock(&r->mu);
}

/* The generation being run is no longer the one to run, or the runner is
 * stopping (under mu). */
static int changed_locked(const zt_runner_t *r) {
  return r->quit || r->target_job != r->cur_job || r->target_gen != r->cur_gen;
}

static int changed(zt_runner_t *r) {
  pthread_mutex_lock(&r->mu);
  int ch = changed_locked(r);
  pthread_mutex_unlock(&r->mu);
  return ch;
}

static int should_stop_cb(void *user) { return changed(user); }

/* Waits up to ms for the assignment to change (or a stop); 1 when it did.
 * Retry pacing that a new assignment ends at once. */
static int wait_changed(zt_runner_t *r, int64_t ms) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += ms / 1000;
  ts.tv_nsec += (ms % 1000) * 1000000;
  if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
  pthread_mutex_lock(&r->mu);
  int rc = 0;
  while (!changed_locked(r) && rc == 0)
    rc = pthread_cond_timedwait(&r->cv, &r->mu, &ts);
  int ch = changed_locked(r);
  pthread_mutex_unlock(&r->mu);
  return ch;
}

/* The pacing of a call to the coordinator retried while it is away:
 * backoff with jitter (zt_ctl_backoff), failures counted and logged
 * (zt_ctl_log_failure). */
typedef struct {
  int64_t backoff;
  uint64_t rng;
  int failed;
} retry_t;

static retry_t retry_start(const zt_runner_t *r, uint64_t salt) {
  uint64_t id = zt_ctl_worker_id(r->ctl);
  return (retry_t){ZT_CTL_BACKOFF_MIN_MS, (uint64_t)zt_now_ms() ^ (id << 20) ^ salt, 0};
}

/* After a failed call of `what`: logged (counted), then its backoff waited
 * out; 1 when the assignment changed meanwhile (give up). */
static int retry_wait(zt_runner_t *r, retry_t *rt, const char *what) {
  if (zt_ctl_log_failure(++rt->failed))
    ZT_WARN("%s for job %llu generation %llu failed (attempt %d, retrying with backoff): %s", what,
            (unsigned long long)r->cur_job, (unsigned long long)r->cur_gen, rt->failed,
            zt_err_msg());
  return wait_changed(r, zt_ctl_backoff(&rt->backoff, zt_ctl_retry_cap_ms(r->ctl), &rt->rng));
}

static int call(zt_runner_t *r, const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *rd, int64_t timeout_ms, ProtobufCMessage **rep,
                int *status) {
  return zt_pb_call(zt_ctl_rpc(r->ctl), method, req, rd, timeout_ms, rep, status);
}

/* The engine's view of the coordinator's command. */
static zt_train_cmd_t train_cmd(int command) {
  switch (command) {
    case ZTRAIN__COMMAND__COMMAND_CONTINUE: return ZT_CMD_CONTINUE;
    case ZTRAIN__COMMAND__COMMAND_CHECKPOINT_NOW: return ZT_CMD_CHECKPOINT_NOW;
    case ZTRAIN__COMMAND__COMMAND_ROLLBACK: return ZT_CMD_ROLLBACK;
    default: return ZT_CMD_STOP; /* STOP, RECONFIGURE: this generation is over */
  }
}

/* Sends the n queued reports s (in order; shares with the first) in one
 * call: more than one only when they queued up behind an unreachable
 * coordinator. */
static zt_train_cmd_t send_steps(zt_runner_t *r, const zt_step_report_t *s, int n,
                                 uint32_t *shares, int nshares) {
  Ztrain__ReportStepRequest req = ZTRAIN__REPORT_STEP_REQUEST__INIT;
  req.n_shares = (size_t)nshares;
  req.shares = shares;
  req.worker_id = zt_ctl_worker_id(r->ctl);
  char session[80];
  zt_ctl_session(r->ctl, session, sizeof session);
  req.session = session;
  req.job_id = r->cur_job;
  req.generation = r->cur_gen;
  req.step = s[0].step;
  req.loss = s[0].loss;
  req.grad_norm = s[0].grad_norm;
  req.lr = s[0].lr;
  req.tokens_per_s = s[0].tokens_per_s;
  req.step_ms = s[0].step_ms;
  req.val_loss = s[0].val_loss;
  req.outer_refused = (uint32_t)s[0].outer_refused;
  Ztrain__StepMetrics *later = zt_xcalloc((size_t)n, sizeof *later);
  Ztrain__StepMetrics **lp = zt_xcalloc((size_t)n, sizeof *lp);
  for (int i = 1; i < n; i++) {
    Ztrain__StepMetrics *m = &later[i - 1];
    ztrain__step_metrics__init(m);
    m->step = s[i].step, m->loss = s[i].loss, m->grad_norm = s[i].grad_norm, m->lr = s[i].lr;
    m->tokens_per_s = s[i].tokens_per_s, m->step_ms = s[i].step_ms, m->val_loss = s[i].val_loss;
    m->outer_refused = (uint32_t)s[i].outer_refused;
    lp[i - 1] = m;
  }
  req.n_later = (size_t)(n - 1);
  req.later = lp;
  zt_train_cmd_t cmd = ZT_CMD_STOP;
  /* Retried while the coordinator is unreachable, so no report is lost;
   * bounded by a change of target, which also drops the reports still
   * queued (a stop must not wait for each one's call to time out). */
  for (int64_t backoff = 100;; backoff = ZT_MIN(backoff * 2, zt_ctl_retry_cap_ms(r->ctl))) {
    ProtobufCMessage *m;
    int st = 0;
    if (changed(r)) break;
    if (call(r, "/ztrain.Control/ReportStep", &req.base, &ztrain__report_step_reply__descriptor,
             5000, &m, &st) == 0) {
      cmd = train_cmd(((Ztrain__ReportStepReply *)m)->command);
      protobuf_c_message_free_unpacked(m, NULL);
      break;
    }
    if (!zt_rpc_transient(st)) {
      ZT_WARN("step %lld report refused: %s", (long long)s[0].step, zt_err_msg());
      break; /* fenced: this generation is over for us */
    }
    if (wait_changed(r, backoff)) break; /* retry pacing */
  }
  free(lp);
  free(later);
  return cmd;
}

/* The most queued reports one call carries. */
#define ZT_REPORT_BATCH 1024

static void *reporter_main(void *p) {
  zt_runner_t *r = p;
  zt_step_report_t *batch = zt_xcalloc(ZT_REPORT_BATCH, sizeof *batch);
  pthread_mutex_lock(&r->mu);
  for (;;) {
    while (!r->q_len && !r->rep_stop) pthread_cond_wait(&r->rep_cv, &r->mu);
    if (!r->q_len) break;
    /* The queue's head, up to the step a pending plan goes with (it heads
     * the next call). */
    int n = 0;
    while (n < r->q_len && n < ZT_REPORT_BATCH) {
      const zt_step_report_t *s = &r->q[(r->q_head + n) % ZT_REPORT_QUEUE];
      if (n && r->plan_n && r->plan_step == s->step) break;
      batch[n++] = *s;
    }
    uint32_t shares[ZT_GEN_MAX_SHARES];
    int nshares = r->plan_n && r->plan_step == batch[0].step ? r->plan_n : 0;
    memcpy(shares, r->plan, sizeof(uint32_t) * (size_t)nshares);
    if (nshares) r->plan_n = 0;
    pthread_mutex_unlock(&r->mu);
    zt_train_cmd_t cmd = send_steps(r, batch, n, shares, nshares);
    pthread_mutex_lock(&r->mu);
    r->q_head = (r->q_head + n) % ZT_REPORT_QUEUE;
    r->q_len -= n;
    r->rep_acked = batch[n - 1].step;
    if (cmd != ZT_CMD_CONTINUE && r->rep_cmd != ZT_CMD_STOP) r->rep_cmd = cmd;
    pthread_cond_broadcast(&r->rep_cv);
  }
  pthread_mutex_unlock(&r->mu);
  free(batch);
  return NULL;
}

static zt_train_cmd_t report_step_cb(void *user, const zt_step_report_t *s) {
  zt_runner_t *r = user;
  pthread_mutex_lock(&r->mu);
  if (r->q_len == ZT_REPORT_QUEUE)
    ZT_WARN("step %lld: %d step reports wait for the coordinator; training waits for it too",
            (long long)s->step, r->q_len);
  while (r->q_len == ZT_REPORT_QUEUE && !r->quit && r->target_gen == r->cur_gen &&
         r->target_job == r->cur_job)
    pthread_cond_wait(&r->rep_cv, &r->mu);
  zt_train_cmd_t cmd = r->rep_cmd;
  if (r->q_len < ZT_REPORT_QUEUE) {
    if (s->nshares > 0 && s->nshares <= ZT_GEN_MAX_SHARES) {
      for (int i = 0; i < s->nshares; i++) r->plan[i] = (uint32_t)s->shares[i];
      r->plan_n = s->nshares, r->plan_step = s->step;
    }
    r->q[(r->q_head + r->q_len) % ZT_REPORT_QUEUE] = *s;
    r->q[(r->q_head + r->q_len) % ZT_REPORT_QUEUE].shares = NULL; /* the call's only */
    r->q_len++;
    pthread_cond_broadcast(&r->rep_cv);
  } else
    cmd = ZT_CMD_STOP; /* the generation changed while the queue was full */
  if (cmd != ZT_CMD_STOP) r->rep_cmd = ZT_CMD_CONTINUE;
  pthread_mutex_unlock(&r->mu);
  return cmd;
}

/* Rank 0 reports an epoch only after the coordinator has its steps up to
 * it: an epoch must never commit ahead of the loss series it resumes. */
static void wait_steps_acked(zt_runner_t *r, int64_t step) {
  pthread_mutex_lock(&r->mu);
  while (r->q && r->rep_acked < step && r->q_len && !r->quit && r->target_gen == r->cur_gen &&
         r->target_job == r->cur_job)
    pthread_cond_wait(&r->rep_cv, &r->mu);
  pthread_mutex_unlock(&r->mu);
}

static int report_ckpt_cb(void *user, int64_t step, const char *dir, const zt_ckpt_file_t *files,
                          int nfiles, const char *error) {
  zt_runner_t *r = user;
  wait_steps_acked(r, step);
  Ztrain__ReportCheckpointRequest req = ZTRAIN__REPORT_CHECKPOINT_REQUEST__INIT;
  req.worker_id = zt_ctl_worker_id(r->ctl);
  char session[80];
  zt_ctl_session(r->ctl, session, sizeof session);
  req.session = session;
  req.job_id = r->cur_job;
  req.generation = r->cur_gen;
  req.step = step;
  char failed[700];
  /* A push for a generation that is over cannot help any more: a peer
   * that vanished must not hold this worker back from the next one. */
  zt_store_abort_when(should_stop_cb, r);
  int pushed = error || !r->rv ? 0 : zt_replicas_push(r->o.ckpt_root, dir, files, nfiles, r->rv);
  zt_store_abort_when(NULL, NULL);
  if (pushed != 0) {
    snprintf(failed, sizeof failed, "%s", zt_err_msg());
    ZT_WARN("checkpoint step %lld: %s", (long long)step, failed);
    error = failed, nfiles = 0; /* an epoch without its copies cannot commit */
  }
  /* Relative to our checkpoint root: the coordinator keeps it under its own. */
  const char *rel = zt_path_under(r->o.ckpt_root, dir);
  req.dir = (char *)(rel ? rel : dir);
  req.error = (char *)(error ? error : "");
  Ztrain__CheckpointFile cf[8], *cfp[8];
  for (int i = 0; i < nfiles && i < 8; i++) {
    ztrain__checkpoint_file__init(&cf[i]);
    cf[i].name = (char *)files[i].name;
    cf[i].bytes = files[i].bytes;
    cf[i].checksum = (char *)files[i].checksum;
    cfp[i] = &cf[i];
  }
  req.n_files = (size_t)ZT_MIN(nfiles, 8);
  req.files = cfp;
  for (int64_t backoff = 100;; backoff = ZT_MIN(backoff * 2, zt_ctl_retry_cap_ms(r->ctl))) {
    ProtobufCMessage *m;
    int st = 0;
    if (call(r, "/ztrain.Control/ReportCheckpoint", &req.base,
             &ztrain__report_checkpoint_reply__descriptor, 5000, &m, &st) == 0) {
      protobuf_c_message_free_unpacked(m, NULL);
      return 0;
    }
    if (!zt_rpc_transient(st) || changed(r)) {
      ZT_WARN("checkpoint step %lld not recorded: %s", (long long)step, zt_err_msg());
      return -1;
    }
    zt_sleep_ms(backoff); /* retry pacing */
  }
}

/* What the coordinator needs to know of a failure. */
typedef struct {
  int fatal;              /* the job itself is broken */
  const char *bad_ckpt;   /* the epoch that failed to load */
  int suspect;            /* the peer rank whose connection failed; -1: unknown */
  int suspect_closed;     /* ... and it ended that connection (closed, reset) */
  Ztrain__FailureKind kind;
  int64_t step;
  int probed;             /* the peers' stores were probed: */
  uint32_t *unreach;      /* ... these ranks did not answer */
  int nunreach;
  uint32_t *gone;         /* ... of them, these refused: their zworker is gone */
  int ngone;
} failure_t;

/* How long a rank tries to reach its peers' stores after a collective
 * failed: a connection within one network takes well under this. */
#define ZT_PROBE_MS 1000

/* The peer whose ring connection ended (f->suspect_closed) and whose
 * store still accepted: a killed process's sockets close one by one, so
 * its store's listening socket may take a connection just after the ring
 * socket's end was seen. Asked again, a few times ZT_REPROBE_MS apart,
 * until it refuses (gone) or the tries are spent (alive: it left its ring
 * itself). Without this, the report said "reaches every other rank" and
 * the coordinator waited out its heartbeat timeout. */
#define ZT_REPROBE_MS 50
#define ZT_REPROBE_TRIES 4

static int dead_after_all(const char *addr) {
  for (int i = 0; i < ZT_REPROBE_TRIES; i++) {
    uint8_t ok = ZT_PROBE_OK;
    zt_sleep_ms(ZT_REPROBE_MS); /* a bounded wait for the kernel to finish closing a dead process */
    zt_store_probe(&addr, 1, 200, &ok);
    if (ok == ZT_PROBE_REFUSED) return 1;
  }
  return 0;
}

/* After a peer failure: which ranks this one cannot reach now (their
 * replica stores do not accept a connection), for the coordinator to judge
 * who is cut off (coordinator/reach.c). f->unreach is freed by the caller. */
static void probe_peers(const Ztrain__RendezvousReply *rv, failure_t *f) {
  int n = (int)rv->world, k = 0;
  if ((int)rv->n_peer_stores != n || n < 2) return;
  const char **addrs = zt_xcalloc((size_t)n, sizeof *addrs);
  uint32_t *rank_of = zt_xcalloc((size_t)n, sizeof *rank_of);
  uint8_t *ok = zt_xcalloc((size_t)n, 1);
  for (int i = 0; i < n; i++)
    if (i != (int)rv->rank && rv->peer_stores[i][0]) addrs[k] = rv->peer_stores[i], rank_of[k++] = (uint32_t)i;
  int64_t t0 = zt_now_ms();
  zt_store_probe(addrs, k, ZT_MIN(ZT_PROBE_MS, ZT_MAX(rv->comm_timeout_ms / 2, 100)), ok);
  f->probed = 1;
  f->unreach = rank_of; /* compacted in place */
  f->gone = zt_xcalloc((size_t)n, sizeof *f->gone);
  char list[256] = "";
  for (int i = 0; i < k; i++) {
    if (ok[i] == ZT_PROBE_OK && f->suspect_closed && (int)rank_of[i] == f->suspect &&
        dead_after_all(addrs[i]))
      ok[i] = ZT_PROBE_REFUSED;
    if (ok[i] == ZT_PROBE_OK) continue;
    size_t l = strlen(list);
    snprintf(list + l, sizeof list - l, "%s%u%s", f->nunreach ? "," : "", rank_of[i],
             ok[i] == ZT_PROBE_REFUSED ? " (gone)" : "");
    if (ok[i] == ZT_PROBE_REFUSED) f->gone[f->ngone++] = rank_of[i];
    f->unreach[f->nunreach++] = rank_of[i];
  }

  if (f->nunreach)
    ZT_WARN("cannot reach the stores of ranks [%s] (%d of %d peers, probed in %lld ms)", list,
            f->nunreach, k, (long long)(zt_now_ms() - t0));
  free(addrs);
  free(ok);
}

static void report_failure(zt_runner_t *r, const char *why, const failure_t *f) {
  Ztrain__ReportFailureRequest req = ZTRAIN__REPORT_FAILURE_REQUEST__INIT;
  req.suspect_rank = f->suspect + 1;
  req.kind = f->kind;
  req.step = f->step;
  req.probed = f->probed;
  req.unreachable_ranks = f->unreach;
  req.n_unreachable_ranks = (size_t)f->nunreach;
  req.gone_ranks = f->gone;
  req.n_gone_ranks = (size_t)f->ngone;
  req.bad_checkpoint = (char *)(f->bad_ckpt ? f->bad_ckpt : "");
  req.worker_id = zt_ctl_worker_id(r->ctl);
  char session[80];
  zt_ctl_session(r->ctl, session, sizeof session);
  req.session = session;
  req.job_id = r->cur_job;
  req.generation = r->cur_gen;
  req.reason = (char *)why;
  req.fatal = f->fatal;
  /* Until the coordinator takes the report, nothing else re-forms the job
   * (heartbeats still name this generation): retried with backoff while
   * the coordinator is unreachable, until it answers or the assignment
   * changes (or the worker stops). */
  for (retry_t rt = retry_start(r, 0x2545f4914f6cdd1dull);;) {
    ProtobufCMessage *m;
    int st = 0;
    if (call(r, "/ztrain.Control/ReportFailure", &req.base,
             &ztrain__report_failure_reply__descriptor, 5000, &m, &st) == 0) {
      /* The new assignment comes back at once: no need to wait for the
       * next heartbeat to join the next generation. */
      Ztrain__ReportFailureReply *rep = (Ztrain__ReportFailureReply *)m;
      if (rep->job_id) zt_runner_assign(r, rep->job_id, rep->generation, rep->nccl_root);
      protobuf_c_message_free_unpacked(m, NULL);
      return;
    }
    if (!zt_rpc_transient(st)) { /* fenced: the generation is already over */
      ZT_INFO("failure report not taken: %s", zt_err_msg());
      return;
    }
    if (retry_wait(r, &rt, "failure report")) return;
  }
}

/* Rendezvous for (cur_job, cur_gen), advertising our ring socket addr:
 * the reply, or NULL when the generation ended (or we moved on) first. */
static Ztrain__RendezvousReply *rendezvous(zt_runner_t *r, char *addr, char *nccl_id) {
  Ztrain__RendezvousRequest req = ZTRAIN__RENDEZVOUS_REQUEST__INIT;
  req.worker_id = zt_ctl_worker_id(r->ctl);
  char session[80];
  zt_ctl_session(r->ctl, session, sizeof session);
  req.session = session;
  req.job_id = r->cur_job;
  req.generation = r->cur_gen;
  req.comm_addr = addr;
  req.nccl_id = nccl_id;
  /* The state we kept, if any (all three stay 0 otherwise). */
  (void)zt_live_holds(r->live, r->cur_job, &req.live_step, &req.live_rollbacks,
                      &req.live_reports_from);
  int64_t t0 = zt_now_ms();
  retry_t rt = retry_start(r, 0x9e3779b97f4a7c15ull);
  while (!changed(r)) {
    ProtobufCMessage *m;
    int st = 0;
    if (call(r, "/ztrain.Control/Rendezvous", &req.base, &ztrain__rendezvous_reply__descriptor,
             10000, &m, &st) == 0) {
      Ztrain__RendezvousReply *rv = (Ztrain__RendezvousReply *)m;
      ZT_INFO("job %llu generation %llu: rank %u of %u, start step %lld, accum %u, %s "
              "(rendezvous %lld ms)",
              (unsigned long long)rv->job_id, (unsigned long long)rv->generation, rv->rank,
              rv->world, (long long)rv->start_step, rv->accum_steps,
              rv->nccl_id[0] ? "NCCL" : "TCP ring", (long long)(zt_now_ms() - t0));
      return rv;
    }
    if (st == ZT_RPC_INVALID_ARGUMENT && req.nccl_id[0]) {
      /* The coordinator does not take our NCCL id (it restarted and no
       * longer counts this generation as an NCCL one): use the ring. */
      ZT_WARN("rendezvous: %s; calling again without an NCCL id", zt_err_msg());
      req.nccl_id = "";
      continue;
    }
    if (st == ZT_RPC_FAILED_PRECONDITION || st == ZT_RPC_NOT_FOUND || st == ZT_RPC_ABORTED) {
      ZT_INFO("rendezvous for job %llu generation %llu ended: %s", (unsigned long long)r->cur_job,
              (unsigned long long)r->cur_gen, zt_err_msg());
      return NULL;
    }
    /* A held call that ran out of time is called again at once; any other
     * status (UNAVAILABLE, INTERNAL, ...) means the coordinator is away or
     * failing: retried with backoff until it answers or the assignment
     * changes. */
    if (st == ZT_RPC_DEADLINE_EXCEEDED) continue;
    if (retry_wait(r, &rt, "rendezvous")) break;
  }
  return NULL;
}

/* Trains the generation the reply describes on a connected ring, and
 * reports a failure that is not simply our moving on. */
/* The epoch a generation loads: under our checkpoint root (the coordinator
 * names it relative to the root; "" for none), with its record. */
typedef struct {
  char path[ZT_PATH_MAX];
  zt_ckpt_file_t *files;
  int n;
} epoch_t;

/* Finds the epoch to load and makes all of it present here (fetching
 * copies from their holders). On failure the reason was reported. */
static int prepare_epoch(zt_runner_t *r, const Ztrain__RendezvousReply *rv, epoch_t *e) {
  e->path[0] = 0;
  e->n = (int)rv->n_checkpoint_files;
  e->files = zt_xcalloc((size_t)e->n + 1, sizeof *e->files);
  for (int i = 0; i < e->n; i++) {
    const Ztrain__CheckpointFile *f = rv->checkpoint_files[i];
    snprintf(e->files[i].name, sizeof e->files[i].name, "%s", f->name);
    snprintf(e->files[i].checksum, sizeof e->files[i].checksum, "%s", f->checksum);
    e->files[i].bytes = f->bytes;
  }
  if (!rv->checkpoint_dir[0]) return 0;
  failure_t f = {.suspect = -1, .step = rv->start_step};
  if (zt_path_confine(r->o.ckpt_root, rv->checkpoint_dir, "checkpoint to load", e->path,
                      sizeof e->path) != 0) {
    f.fatal = 1;
    report_failure(r, zt_err_msg(), &f);
    return -1;
  }
  zt_ckpt_record_t rec = {e->files, e->n};
  zt_fetch_fail_t fail = ZT_FETCH_UNAVAILABLE;
  zt_store_abort_when(should_stop_cb, r);
  int fetched = zt_replicas_fetch(r->ctl, r->o.ckpt_root, e->path, &rec, rv, &fail);
  zt_store_abort_when(NULL, NULL);
  if (fetched != 0) {
    char why[1400];
    snprintf(why, sizeof why, "%s", zt_err_msg());
    ZT_WARN("%s", why);
    /* A holder out of reach: the epoch may well be fine; this generation
     * fails and the coordinator decides again. Our own disk failed: that
     * is this worker's failure, not the epoch's. Only when every holder
     * answered without a good copy is the epoch corrupt. */
    f.kind = fail == ZT_FETCH_LOCAL ? ZTRAIN__FAILURE_KIND__FAILURE_LOCAL
                                    : ZTRAIN__FAILURE_KIND__FAILURE_PEER;
    f.bad_ckpt = fail == ZT_FETCH_CORRUPT ? rv->checkpoint_dir : NULL;
    if (!changed(r)) report_failure(r, why, &f);
    return -1;
  }
  return 0;
}

static void train(zt_runner_t *r, const Ztrain__RendezvousReply *rv, const epoch_t *e,
                  zt_comm_t *comm) {
  const char *epoch = e->path;
  zt_gen_ctx_t g = {.job_id = rv->job_id, .generation = rv->generation, .rank = (int)rv->rank,
                    .world = (int)rv->world, .spec_json = rv->spec_json,
                    .start_step = rv->start_step, .comm_timeout_ms = rv->comm_timeout_ms,
                    .comm = comm, .workdir = r->workdir, .threads = r->o.threads,
                    .data_root = r->o.data_root, .ckpt_root = r->o.ckpt_root,
                    .device = r->o.device, .checkpoint_dir = epoch,
                    .host_memory = r->o.host_memory, .device_memory = r->o.device_memory,
                    .lr_factor = rv->lr_factor > 0 ? rv->lr_factor : 1.0,
                    .lr_until = rv->lr_factor_until, .rollbacks = (int)rv->rollbacks,
                    .should_stop = should_stop_cb, .report_step = report_step_cb,
                    .step_done = step_done_cb,
                    .report_checkpoint = report_ckpt_cb, .user = r};
  g.checkpoint = (zt_ckpt_record_t){e->files, e->n};
  if (zt_device_parse(r->o.device) < 0) zt_cores_check(); /* workers started since */
  if (r->micro_job != rv->job_id) {
    r->micro_job = rv->job_id, r->micro_ms = 0;
    zt_gen_stash_free(r->stash);
    r->stash = NULL;
    zt_live_free(r->live);
    r->live = NULL;
  }
  g.micro_ms = &r->micro_ms;
  g.diloco_stash = &r->stash;
  g.live = &r->live;
  g.live_step = rv->live_step;
  g.live_reported = rv->reported_step;
  g.live_source = rv->live_source;
  zt_range_t skips[ZT_MAX_SKIP_RANGES];
  g.nskips = (int)rv->n_skips;
  for (int i = 0; i < g.nskips; i++) skips[i] = (zt_range_t){rv->skips[i]->start, rv->skips[i]->end};
  g.skips = skips;
  zt_train_failure_t tf = {ZT_FAULT_PEER, rv->start_step};
  r->rv = rv;
  pthread_t rep;
  int reporting = rv->rank == 0;
  if (reporting) {
    pthread_mutex_lock(&r->mu);
    r->q = zt_xcalloc(ZT_REPORT_QUEUE, sizeof *r->q);
    r->q_head = r->q_len = r->rep_stop = 0;
    r->rep_cmd = ZT_CMD_CONTINUE;
    r->rep_acked = rv->start_step;
    pthread_mutex_unlock(&r->mu);
    /* Without its reporter, rank 0 would fill the queue and wait for a
     * change that nothing brings: this worker's failure, reported. */
    int err = zt_knob(ZT_KNOB_NO_STEP_REPORTER, 0) == 1
                  ? EAGAIN
                  : pthread_create(&rep, NULL, reporter_main, r);
    if (err != 0) {
      char why[200];
      snprintf(why, sizeof why, "cannot start the step reporter thread: %s", strerror(err));
      ZT_ERROR("%s", why);
      pthread_mutex_lock(&r->mu);
      free(r->q);
      r->q = NULL;
      pthread_mutex_unlock(&r->mu);
      r->rv = NULL;
      failure_t f = {
          .suspect = -1, .kind = ZTRAIN__FAILURE_KIND__FAILURE_LOCAL, .step = rv->start_step};
      if (!changed(r)) report_failure(r, why, &f);
      return;
    }
  }
  int rc = zt_gen_train(&g, &tf);
  if (r->q) {
    /* The last reports go out (training is over, or failed) before the
     * failure report and the next generation; bounded by a change. */
    pthread_mutex_lock(&r->mu);
    r->rep_stop = 1;
    pthread_cond_broadcast(&r->rep_cv);
    pthread_mutex_unlock(&r->mu);
    if (reporting) pthread_join(rep, NULL);
    pthread_mutex_lock(&r->mu);
    free(r->q);
    r->q = NULL;
    r->q_len = 0;
    pthread_mutex_unlock(&r->mu);
  }
  r->rv = NULL;
  if (rc == 0) return;
  char why[800];
  snprintf(why, sizeof why, "%s", zt_err_msg());
  if (changed(r)) {
    ZT_INFO("generation %llu left: %s", (unsigned long long)r->cur_gen, why);
    return;
  }
  ZT_WARN("training failed at step %lld%s: %s", (long long)tf.step,
          tf.fault == ZT_FAULT_JOB ? " (job error)" : "", why);
  failure_t f = {.fatal = tf.fault == ZT_FAULT_JOB,
                 .bad_ckpt = tf.fault == ZT_FAULT_CHECKPOINT ? rv->checkpoint_dir : NULL,
                 .suspect = zt_comm_failed_peer(comm),
                 .suspect_closed = zt_comm_failed_peer_closed(comm),
                 .kind = tf.fault == ZT_FAULT_LOCAL    ? ZTRAIN__FAILURE_KIND__FAILURE_LOCAL
                         : tf.fault == ZT_FAULT_MEMORY ? ZTRAIN__FAILURE_KIND__FAILURE_OUT_OF_MEMORY
                                                       : ZTRAIN__FAILURE_KIND__FAILURE_PEER,
                 .step = tf.step};
  if (f.kind == ZTRAIN__FAILURE_KIND__FAILURE_PEER && !f.fatal && !f.bad_ckpt) probe_peers(rv, &f);
  report_failure(r, why, &f);
  free(f.unreach);
  free(f.gone);
}

/* The generation's communicator: NCCL when the reply carries a unique id
 * (our listening socket is closed then), else the TCP ring, which takes
 * over *lfd. */
static int make_comm(zt_runner_t *r, const Ztrain__RendezvousReply *rv, int *lfd,
                     zt_comm_t **comm) {
  if (rv->nccl_id[0]) {
    close(*lfd);
    *lfd = -1;
    int dev = zt_device_parse(r->o.device);
    if (dev < 0) return zt_err("an NCCL generation on device %s", r->o.device);
    return zt_comm_nccl_create((int)rv->rank, (int)rv->world, rv->nccl_id, dev,
                               rv->comm_timeout_ms, comm);
  }
  if (rv->n_peers != rv->world || rv->rank >= rv->world)
    return zt_err("the rendezvous reply names %zu peers for rank %u of %u", rv->n_peers, rv->rank,
                  rv->world);
  zt_comm_tcp_opts_t co = {.rank = (int)rv->rank, .world = (int)rv->world,
                           .peers = (const char *const *)rv->peers, .listen_fd = *lfd,
                           .session = (rv->job_id << 32) ^ rv->generation,
                           .key = rv->comm_key, .connect_timeout_ms = rv->comm_timeout_ms};
  *lfd = -1; /* owned by the communicator from here on */
  zt_comm_t *c;
  if (zt_comm_tcp_new(&co, &c) != 0) return -1;
  /* Published before it connects, so that a new assignment or a stop
   * aborts the set-up instead of waiting out its timeout. */
  pthread_mutex_lock(&r->mu);
  r->active = c;
  if (changed_locked(r)) zt_comm_abort(c);
  pthread_mutex_unlock(&r->mu);
  if (zt_comm_tcp_connect(c) != 0) {
    pthread_mutex_lock(&r->mu);
    r->active = NULL;
    pthread_mutex_unlock(&r->mu);
    zt_comm_destroy(c);
    return -1;
  }
  *comm = c;
  return 0;
}

/* Joins (cur_job, cur_gen): listening socket, rendezvous, communicator;
 * trains it. */
static void run_generation(zt_runner_t *r) {
  int port = 0, lfd = -1;
  epoch_t ep = {.files = NULL};
  if (zt_comm_tcp_listen(r->comm_host, &port, &lfd) != 0) {
    /* Said, or the other ranks would wait in their rendezvous for us. */
    char why[600];
    snprintf(why, sizeof why, "no ring socket: %s", zt_err_msg());
    ZT_ERROR("%s", why);
    failure_t f = {.suspect = -1, .kind = ZTRAIN__FAILURE_KIND__FAILURE_LOCAL};
    report_failure(r, why, &f);
    return;
  }
  char addr[96];
  snprintf(addr, sizeof addr, "%s:%d", r->comm_host, port);
  zt_ctl_set_assignment(r->ctl, r->cur_job, r->cur_gen);
  /* Rank 0 of an all-GPU generation makes its NCCL unique id; without one
   * the generation uses the ring. */
  char nccl_id[257] = "";
  pthread_mutex_lock(&r->mu);
  int nccl_root = r->target_nccl_root && !(r->target_job != r->cur_job || r->target_gen != r->cur_gen);
  pthread_mutex_unlock(&r->mu);
  if (nccl_root && zt_comm_nccl_unique_id(nccl_id) != 0) {
    ZT_WARN("no NCCL unique id (%s): generation %llu uses the TCP ring", zt_err_msg(),
            (unsigned long long)r->cur_gen);
    nccl_id[0] = 0;
  }
  Ztrain__RendezvousReply *rv = rendezvous(r, addr, nccl_id);
  if (!rv) goto out;
  if (rv->n_skips > ZT_MAX_SKIP_RANGES) { /* the coordinator never sends more */
    char why[200];
    snprintf(why, sizeof why, "rendezvous reply holds %zu skip ranges (the limit is %d)",
             rv->n_skips, ZT_MAX_SKIP_RANGES);
    ZT_ERROR("%s", why);
    failure_t f = {.fatal = 1, .suspect = -1, .step = rv->start_step};
    report_failure(r, why, &f);
    goto out;
  }
  if (prepare_epoch(r, rv, &ep) != 0) goto out;
  zt_comm_t *comm;
  if (make_comm(r, rv, &lfd, &comm) != 0) {
    char why[600];
    snprintf(why, sizeof why, "%s set-up: %s", rv->nccl_id[0] ? "NCCL" : "ring", zt_err_msg());
    ZT_WARN("%s", why);
    failure_t f = {.suspect = -1, .kind = ZTRAIN__FAILURE_KIND__FAILURE_PEER,
                   .step = rv->start_step};
    if (!changed(r)) {
      probe_peers(rv, &f);
      report_failure(r, why, &f);
    }
    free(f.unreach);
    free(f.gone);
    goto out;
  }
  pthread_mutex_lock(&r->mu);
  r->active = comm;
  if (r->target_job != r->cur_job || r->target_gen != r->cur_gen) zt_comm_abort(comm);
  pthread_mutex_unlock(&r->mu);
  train(r, rv, &ep, comm);
  pthread_mutex_lock(&r->mu);
  r->active = NULL;
  zt_comm_stats_t cs;
  zt_comm_stats_get(comm, &cs);
  r->comm_us_done += cs.comm_us;
  r->send_wait_us_done += cs.send_wait_us;
  pthread_mutex_unlock(&r->mu);
  zt_comm_destroy(comm);
out:
  free(ep.files);
  if (lfd >= 0) close(lfd);
  if (rv) protobuf_c_message_free_unpacked(&rv->base, NULL);
}

static void *runner_main(void *p) {
  zt_runner_t *r = p;
  pthread_mutex_lock(&r->mu);
  for (;;) {
    while (!r->quit && r->target_job == r->cur_job && r->target_gen == r->cur_gen)
      pthread_cond_wait(&r->cv, &r->mu);
    if (r->quit) break;
    r->cur_job = r->target_job;
    r->cur_gen = r->target_gen;
    pthread_mutex_unlock(&r->mu);
    if (r->cur_job) run_generation(r);
    else zt_ctl_set_assignment(r->ctl, 0, 0);
    pthread_mutex_lock(&r->mu);
  }
  pthread_mutex_unlock(&r->mu);
  return NULL;
}

int zt_runner_start(zt_ctl_t *ctl, const zt_runner_opts_t *o, zt_runner_t **out) {
  zt_runner_t *r = zt_xcalloc(1, sizeof *r);
  r->ctl = ctl;
  r->o = *o;
  snprintf(r->comm_host, sizeof r->comm_host, "%s", o->comm_host ? o->comm_host : "127.0.0.1");
  snprintf(r->workdir, sizeof r->workdir, "%s", o->workdir ? o->workdir : ".");
  r->o.comm_host = r->comm_host;
  r->o.workdir = r->workdir;
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  pthread_cond_init(&r->rep_cv, NULL);
  if (pthread_create(&r->thread, NULL, runner_main, r) != 0) {
    free(r);
    return zt_err("cannot start the runner thread");
  }
  *out = r;
  return 0;
}

void zt_runner_stop(zt_runner_t *r) {
  if (!r) return;
  pthread_mutex_lock(&r->mu);
  r->quit = 1;
  if (r->active) zt_comm_abort(r->active);
  pthread_cond_broadcast(&r->cv);
  pthread_cond_broadcast(&r->rep_cv);
  pthread_mutex_unlock(&r->mu);
  pthread_join(r->thread, NULL);
  pthread_cond_destroy(&r->cv);
  pthread_cond_destroy(&r->rep_cv);
  pthread_mutex_destroy(&r->mu);
  zt_gen_stash_free(r->stash);
  zt_live_free(r->live);
  free(r);
}
