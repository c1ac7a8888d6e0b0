/*
 * live.h: the model state a failed generation leaves in memory, and the
 * next generation's start from it (docs/zero.md, "Recovery from memory").
 *
 * The trainer (trainer.c) keeps one record per generation: from its start
 * it notes every step's numbers (the report rank 0 sends, kept by every
 * rank, since any survivor may be the next rank 0), and when the
 * generation fails at ZeRO stage 0 with no update half done, the record
 * also takes the whole model state (zero.h, zt_zero_full_get) and passes
 * to the worker (zt_gen_ctx_t.live). The worker names its step in its next
 * rendezvous call; the coordinator picks the newest step some rank of
 * the new generation holds on the job's trajectory (RendezvousReply.
 * live_step) and the trainer starts there: the state is put back
 * (zt_zero_full_put), or, on the ranks that hold another step or none,
 * received from the lowest rank that holds it (zt_zero_full_broadcast,
 * with its kept reports); the steps the coordinator never received are
 * reported again from the record, and no epoch is read.
 */
#ifndef ZT_LIVE_H
#define ZT_LIVE_H

#include "trainer.h"
#include "zero.h"

/* Steps whose reports a record keeps (the newest). */
#define ZT_LIVE_REPORTS 4096

struct zt_live {
  uint64_t job_id;
  uint32_t rollbacks; /* the job's trajectory: a rollback starts another */
  int64_t step;       /* the state is the one after this step (0: no state) */
  size_t n;           /* floats of each of p, m and v (zt_zero_full_floats) */
  float *p, *m, *v;
  /* The newest steps' reports, oldest first from `head`, in a ring. */
  zt_step_report_t *rep;
  int head, nrep;
};

/* The generation's record, on every rank: the one the worker held, when
 * the rendezvous said to start from it (g->live_step > 0; its state is put
 * into z and *step set), else a new one. Either way the worker holds none
 * after. 1 when it started from memory, 0 when not; -1 (with *fault)
 * when the held state is not the one asked for. */
ZT_MUST_CHECK int zt_live_start(const zt_gen_ctx_t *g, zt_zero_t *z, zt_live_t **cur,
                                int64_t *step, zt_train_fault_t *fault);
/* Notes one step's report (every rank, after every step). */
void zt_live_note(zt_live_t *l, const zt_step_report_t *r);
/* Rank 0 of a generation that started from memory: the reports of steps
 * after g->live_reported, up to the start, sent again (the coordinator
 * may never have received them: the old rank 0 was lost). 1 when the
 * coordinator answered one with a stop or a rollback. */
int zt_live_replay(const zt_live_t *l, const zt_gen_ctx_t *g, int64_t start);
/* The generation ends: when `at` > 0 the state (after step `at`, or the
 * one before when that step's update was cut off) goes into the record,
 * which passes to the worker; otherwise the record is dropped. */
void zt_live_end(zt_live_t **cur, const zt_gen_ctx_t *g, zt_zero_t *z, int64_t at);

#endif
