/*
 * zero_thread.c: ZeRO's collectives on a communication thread, for CPU
 * workers with overlap (zero_optimization.overlap_comm; zero.h,
 * "Overlap"). zero.c starts it, and its hooks and step call the functions
 * here instead of running a collective themselves; the thread runs the
 * serial functions of zero_serial.c for each entry it takes. It calls
 * nothing of zero.c, zero_io.c or zero_stream.c.
 *
 * The queue. The training thread pushes entries (a unit, what to do with
 * it, a slot, a piece) in the order its hooks run, which is the same on
 * every rank; the thread takes them one at a time in that order, so every
 * rank issues the same collectives in the same order, and adds shards
 * into the fp64 sums in that order too: the same bits as without the
 * thread. The thread is the only user of the communicator until the
 * training thread has waited for the queue (zt__zero_thread_wait), and the
 * kernel table stays the training thread's (the thread works on host
 * memory with plain loops).
 *
 * What is queued:
 *
 *   - stages 0-1, the reduction of each unit whose gradient is final
 *     (rd_busy[u] while it is queued or running);
 *   - stages 2-3, each piece of a unit's gradient from one of two slots
 *     that take turns (ov_busy), unit 0's pieces from a slot of its own;
 *   - stages 0-2, after the step's reductions, one in-place gather per
 *     unit in forward order, each with a ticket that the hook before the
 *     unit's forward waits for (ag_ticket, ag_done);
 *   - stage 3, the gather of the unit the model uses next, into one of two
 *     gather slots (pf_*), while the current one computes.
 *
 * Failures. A failed entry records why (ov_fail, ov_msg); the rest are
 * only dequeued, and every wait stops at the failure and makes it the
 * hooks' (z->fail), so the step fails as it would without overlap.
 *
 * Before all that, the ranks of a generation agree whether the thread runs
 * at all (zt_zero_agree_overlap): the trainer asks before it creates the
 * state.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "zero_impl.h"

/* A queue entry: unit, what to do (gather its parameters or reduce its
 * gradient) and the slot (gat_slot, OV_IN_PLACE for the deferred gathers
 * of stages 0-2, or the fp32 gradient slot); lo: the piece's shard offset. */
enum { OV_REDUCE = 0, OV_GATHER = 1 };
#define OV_IN_PLACE 3
#define OV_ENTRY(u, kind, s, lo) ((int64_t)(lo) << 32 | (u) << 3 | (kind) << 2 | (s))

/* Milliseconds of this thread's CPU time. */
static double thread_cpu_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* ---- the generation's choice ----------------------------------------------------------- */

int zt_zero_agree_overlap(zt_comm_t *comm, int world, int want, int dev, int64_t timeout_ms,
                          int *overlap) {
  *overlap = want && !dev;
  if (!want || world == 1 || zt_comm_device_memory(comm)) return 0;
  float can = (float)*overlap;
  if (zt_comm_all_reduce(comm, &can, 1, ZT_DT_F32, ZT_RED_SUM, timeout_ms) != 0)
    return zt_err_wrap("agreeing on overlap_comm");
  if (*overlap && can != (float)world)
    ZT_INFO("overlap_comm: off for this generation (%d of %d ranks run on a device)",
            world - (int)can, world);
  *overlap = can == (float)world;
  return 0;
}

/* ---- the thread --------------------------------------------------------------------- */

/* Runs one entry: the serial collective it stands for. */
static int run_entry(zt_zero_t *z, int u, int kind, int s, size_t lo) {
  if (kind == OV_GATHER && s == OV_IN_PLACE) return zt__zero_gather_in_place(z, u);
  if (kind == OV_GATHER)
    return zt__zero_all_gather(z, xadv(z, z->Ws, z->off_shard[u]), gat_slot(z, s), z->S[u],
                               z->xdt);
  return zt__zero_reduce_unit(z, u, s, lo);
}

/* With ov_mu held: the entry of unit u is done (rc its outcome): the
 * failure recorded, whatever waits for it told. */
static void entry_done(zt_zero_t *z, int u, int kind, int s, int rc) {
  if (rc != 0 && !z->ov_fail) {
    z->ov_fail = 1;
    snprintf(z->ov_msg, sizeof z->ov_msg, "%s of unit %d: %s",
             kind == OV_REDUCE  ? "gradient reduction"
             : z->stage == 0    ? "all-gather of the scaled gradient"
                                : "all-gather of parameters",
             u, zt_err_msg());
  }
  if (kind == OV_GATHER && s == OV_IN_PLACE) {
    z->ag_done++;
    if (!z->ov_fail) z->ag_ok = z->ag_done;
  } else if (kind == OV_GATHER) z->pf_busy[s] = 0;
  else if (z->stage >= 2 && s == 2) z->ov_busy[2]--;
  else if (z->stage >= 2) z->ov_busy[s] = 0;
  else z->rd_busy[u] = 0;
  z->ov_head = (z->ov_head + 1) % z->ov_cap;
  z->ov_len--;
  pthread_cond_broadcast(&z->ov_cv);
}

/* Takes queued entries in order; after a failure the rest are only
 * dequeued (the step fails in zt_zero_reduce or the next fetch). */
static void *ov_main(void *arg) {
  zt_zero_t *z = arg;
  pthread_mutex_lock(&z->ov_mu);
  for (;;) {
    while (!z->ov_quit && !z->ov_len) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
    if (z->ov_quit) break;
    int64_t e = z->ov_queue[z->ov_head];
    int failed = z->ov_fail, u = (int)(e & 0xffffffff) >> 3, kind = (int)(e >> 2) & 1, s = (int)(e & 3);
    size_t lo = (size_t)(e >> 32);
    pthread_mutex_unlock(&z->ov_mu);
    double w0 = wall_ms(), c0 = thread_cpu_ms();
    int rc = failed ? 0 : run_entry(z, u, kind, s, lo);
    double w1 = wall_ms(), c1 = thread_cpu_ms();
    pthread_mutex_lock(&z->ov_mu);
    z->tm.comm_busy_ms += w1 - w0;
    z->tm.comm_cpu_ms += c1 - c0;
    entry_done(z, u, kind, s, rc);
  }
  pthread_mutex_unlock(&z->ov_mu);
  return NULL;
}

/* Queues an entry; lo: the piece (shard offset) of a stage 2-3 reduction.
 * A full queue is waited on until the thread has taken an entry (it
 * broadcasts after each one), so no entry is ever written over one the
 * thread has not read; zt__zero_thread_start sizes the queue so that this
 * wait is rare. Once a queued operation has failed, the wait stops and
 * the entry is dropped: the thread would only dequeue it, and every wait
 * for it (reduced, pf_wait, wait_gather, zt__zero_thread_wait) stops at
 * that failure too and reports it. */
static void ov_push_piece(zt_zero_t *z, int u, int kind, int s, size_t lo) {
  pthread_mutex_lock(&z->ov_mu);
  while (z->ov_len == z->ov_cap && !z->ov_fail) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
  if (!z->ov_fail) {
    z->ov_queue[(z->ov_head + z->ov_len) % z->ov_cap] = OV_ENTRY(u, kind, s, lo);
    z->ov_len++;
    if (kind == OV_GATHER && s != OV_IN_PLACE) z->pf_busy[s] = 1;
    else if (kind == OV_REDUCE && z->stage >= 2 && s == 2) z->ov_busy[2]++;
    else if (kind == OV_REDUCE && z->stage >= 2) z->ov_busy[s] = 1;
    else if (kind == OV_REDUCE) z->rd_busy[u] = 1;
    pthread_cond_broadcast(&z->ov_cv);
  }
  pthread_mutex_unlock(&z->ov_mu);
}

static void ov_push(zt_zero_t *z, int u, int kind, int s) { ov_push_piece(z, u, kind, s, 0); }

/* With ov_mu held: when a queued operation has failed, its reason becomes
 * the hooks' failure (the step stops, as it would without overlap) and -1
 * is returned; else 0. */
static int ov_take_failure(zt_zero_t *z) {
  if (!z->ov_fail) return 0;
  if (!z->fail) snprintf(z->fail_msg, sizeof z->fail_msg, "%s", z->ov_msg);
  z->fail = 1;
  return -1;
}

int zt__zero_thread_wait(zt_zero_t *z) {
  pthread_mutex_lock(&z->ov_mu);
  while (z->ov_len) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
  int failed = z->ov_fail;
  pthread_mutex_unlock(&z->ov_mu);
  return failed ? zt_err("%s", z->ov_msg) : 0;
}

/* How many pieces unit u's gradient is reduced in at stages 2-3
 * (piece_len): one, but for unit 0 as many as its shard holds shards of
 * the largest other unit. */
static int num_pieces(const zt_zero_t *z, int u) {
  int n = 0;
  for (size_t lo = 0; lo < z->S[u]; lo += piece_len(z, u, lo)) n++;
  return n;
}

int zt__zero_thread_start(zt_zero_t *z) {
  /* The most entries ever queued at once, so that pushes (which wait for
   * room) do not wait in practice: stages 0-1, U units a step; stages
   * 1-2, U deferred gathers after it; stages 2-3, two reductions, three
   * gathers and all the pieces of unit 0, which its post-backward hook
   * queues at once (one per block's worth of embeddings: dozens with a
   * large vocabulary). */
  z->ov_cap = 2 * z->U + 5 + (z->stage >= 2 ? num_pieces(z, 0) : 0);
  z->ov_queue = zt_xcalloc((size_t)z->ov_cap, sizeof *z->ov_queue);
  pthread_mutex_init(&z->ov_mu, NULL);
  pthread_cond_init(&z->ov_cv, NULL);
  if (pthread_create(&z->ov_thread, NULL, ov_main, z) != 0) {
    pthread_cond_destroy(&z->ov_cv);
    pthread_mutex_destroy(&z->ov_mu);
    free(z->ov_queue);
    z->ov_queue = NULL;
    return zt_err("cannot start the gradient communication thread");
  }
  pthread_setname_np(z->ov_thread, "zt-comm");
  z->overlap = 1;
  if (z->stage < 3) z->ag_ticket = zt_xcalloc((size_t)z->U, sizeof *z->ag_ticket);
  if (z->stage < 2) z->rd_busy = zt_xcalloc((size_t)z->U, sizeof *z->rd_busy);
  if (z->stage == 0) z->due = zt_xcalloc((size_t)z->U, sizeof *z->due);
  return 0;
}

/* A reduction still running when the state is freed (the generation
 * failed elsewhere) is aborted with the communicator, which is over. */
void zt__zero_thread_stop(zt_zero_t *z) {
  if (!z->overlap) return;
  pthread_mutex_lock(&z->ov_mu);
  if (z->ov_len) zt_comm_abort(z->comm);
  z->ov_quit = 1;
  pthread_cond_broadcast(&z->ov_cv);
  pthread_mutex_unlock(&z->ov_mu);
  pthread_join(z->ov_thread, NULL);
  pthread_cond_destroy(&z->ov_cv);
  pthread_mutex_destroy(&z->ov_mu);
  free(z->ov_queue);
  free(z->ag_ticket);
  free(z->rd_busy);
  free(z->due);
}

/* ---- gradient reductions --------------------------------------------------------------- */

int zt__zero_thread_reduced(zt_zero_t *z, const int *busy) {
  double w0 = wall_ms();
  pthread_mutex_lock(&z->ov_mu);
  while (*busy && !z->ov_fail) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
  int rc = ov_take_failure(z);
  pthread_mutex_unlock(&z->ov_mu);
  z->tm.wait_reduce_ms += wall_ms() - w0;
  return rc;
}

/* Unit 0's own slot (its pieces from the micro-step before), else the
 * next of slots 0 and 1, whose number post-backward queues. */
int zt__zero_thread_grad_slot(zt_zero_t *z, int u, float **g) {
  int s = u == 0 ? 2 : z->ov_next;
  if (u != 0) z->ov_next ^= 1, z->ov_cur = s;
  *g = slot_tg(z, s);
  return zt__zero_thread_reduced(z, &z->ov_busy[s]);
}

/* Stages 0-1, last micro-step: unit u's gradient is final; into the fp64
 * sum and onto the thread. Where each micro-step is reduced by itself
 * (z->each), onto the thread in every micro-step, straight from G (the
 * second and later ones into the range after this rank's, then added). */
void zt__zero_thread_queue_unit(zt_zero_t *z, int u) {
  size_t off = z->off_full[u];
  if (!z->each) z->k->acc_f64(z->G64 + off, z->G + off, z->S[u] * (size_t)z->N);
  ov_push(z, u, OV_REDUCE, z->each && z->micro_n > 1);
}

/* Stages 2-3: the unit's slot (zt__zero_thread_grad_slot) onto the
 * thread, piece by piece; the thread reduces it from there. */
void zt__zero_thread_queue_pieces(zt_zero_t *z, int u) {
  for (size_t lo = 0; lo < z->S[u]; lo += piece_len(z, u, lo))
    ov_push_piece(z, u, OV_REDUCE, u == 0 ? 2 : z->ov_cur, lo);
}

/* ---- deferred gathers (stages 0-2) ---------------------------------------------------- */

/* Once the queue is empty (it holds the step's reductions), one in-place
 * gather per unit in forward order, each with the ticket the hook before
 * the unit's forward waits for (zt__zero_thread_wait_gather). */
int zt__zero_thread_queue_gathers(zt_zero_t *z) {
  if (zt__zero_thread_wait(z) != 0) return -1;
  pthread_mutex_lock(&z->ov_mu);
  for (int u = 0; u < z->U; u++) z->ag_ticket[u] = ++z->ag_queued;
  pthread_mutex_unlock(&z->ov_mu);
  for (int u = 0; u < z->U; u++) ov_push(z, u, OV_GATHER, OV_IN_PLACE);
  return 0;
}

/* Waits until unit u's deferred gather is done (it was queued by
 * zt__zero_thread_queue_gathers); a failure fails the hook. */
void zt__zero_thread_wait_gather(zt_zero_t *z, int u) {
  if (z->fail) return;
  pthread_mutex_lock(&z->ov_mu);
  while (z->ag_done < z->ag_ticket[u] && !z->ov_fail) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
  (void)ov_take_failure(z); /* sets z->fail, which the hook returns */
  pthread_mutex_unlock(&z->ov_mu);
}

/* ---- stage 3 prefetch -------------------------------------------------------------------- */

/* Waits until gather slot s (gat_slot) is filled; -1 when a queued
 * operation failed (the hook fails the step, as a gather would). */
static int pf_wait(zt_zero_t *z, int s) {
  pthread_mutex_lock(&z->ov_mu);
  while (z->pf_busy[s] && !z->ov_fail) pthread_cond_wait(&z->ov_cv, &z->ov_mu);
  int rc = ov_take_failure(z);
  pthread_mutex_unlock(&z->ov_mu);
  return rc;
}

/* The gather slot (0 or 1) that holds, or is receiving, unit u's current
 * parameters (pver: they change only in the optimizer step and loads);
 * -1 if none. */
static int pf_find(const zt_zero_t *z, int u) {
  for (int s = 0; s < 2; s++)
    if (z->pf_unit[s] == u && z->pf_ver[s] == z->pver) return s;
  return -1;
}

/* Queues the gather of unit u into slot s (waiting first for a gather
 * still arriving there). */
static void pf_queue(zt_zero_t *z, int u, int s) {
  if (pf_wait(z, s) != 0) return;
  z->pf_unit[s] = u;
  z->pf_ver[s] = z->pver;
  ov_push(z, u, OV_GATHER, s);
}

/* Unit u's parameters from the slot that has them (or is receiving
 * them), else gathered now (queued behind what is in flight, so the
 * communicator keeps one order on every rank); then `next`, the unit the
 * model uses after u, is queued into the other slot so that the network
 * carries it while u computes. Unit 0 (the embeddings, used at both ends
 * of forward and first in backward) has a slot of its own. Every rank
 * runs the same hooks in the same order, so the queues match. */
void zt__zero_thread_fetch(zt_zero_t *z, int u, int next) {
  if (z->fail) return;
  int s;
  if (u == 0) {
    s = 2;
    if (z->pf_unit[2] != 0 || z->pf_ver[2] != z->pver) {
      z->pf_unit[2] = 0;
      z->pf_ver[2] = z->pver;
      ov_push(z, 0, OV_GATHER, 2);
    }
  } else if ((s = pf_find(z, u)) < 0) {
    s = z->pf_cur ^ 1; /* the slot of the unit before is free */
    pf_queue(z, u, s);
  }
  if (u != 0) z->pf_cur = s;
  if (next > 0 && next < z->U && pf_find(z, next) < 0) pf_queue(z, next, z->pf_cur ^ 1);
  if (pf_wait(z, s) != 0) return;
  z->m->unit_params[u] = gat_slot(z, s);
}
