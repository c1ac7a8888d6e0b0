/*
 * diloco.h: DiLoCo, data-parallel training whose workers meet only every
 * H steps (sync.mode "diloco", spec.h; docs/engine.md "Sync modes").
 *
 * A group is one worker, which holds the whole model at ZeRO stage 0 on
 * one rank (zero.h, world 1), or S workers in a row (sync.group_size) that
 * hold it under ZeRO among themselves (the trainer's view of their
 * ranks). It runs H inner AdamW steps on its share of each step's batch
 * (the micro-batches an equal share gives its ranks, so the groups
 * together still see the step's global batch), with no communication
 * outside the group. All of the state below is of this rank's owned
 * ranges (zt_zero_owned_get: the whole model in a group of one), and comm
 * joins the ranks at the same place in every group, so each rank's outer
 * all-reduce carries its owned ranges only. At a sync every group g holds theta_g;
 * the outer step, the same on every group, is the paper's (Douillard et
 * al. 2023) with PyTorch's SGD semantics:
 *
 *   delta = (1/G) sum_g (outer - theta_g)      the pseudo-gradient
 *   mom   = mu * mom + delta
 *   outer = outer - lr * (nesterov ? delta + mu * mom : mom)
 *
 * and every group continues from the new outer parameters. Only the
 * pseudo-gradient crosses the network: one fp32 all-reduce of the model
 * every H steps instead of a gradient reduction every step. The sums are
 * fp32 in the communicator's order, which depends on the world size only,
 * so a run resumed at the same world size is bit-identical.
 *
 * Compression (sync.compression "bf16", "int8" or "int4", quant.h): each group
 * encodes its pseudo-gradient, the groups all-gather the encodings (the
 * int8 one is a little over a quarter of the fp32 bytes) and each decodes
 * and sums all G in rank order, so every group still applies the same
 * outer step. A block that fails its checks fails the sync, naming its
 * group. int4 is coarse (15 levels a block of 64), so each group keeps
 * error feedback: what its encoding left out is added to its next
 * pseudo-gradient (checkpointed with it, below).
 *
 * State. outer and mom (fp32, host memory, the owned layout of the
 * rank's zero.h buffers: unit u's owned range at off_shard[u]) are the
 * same at a place in every group; the inner AdamW moments are each
 * group's own. After a sync, d holds the rank's inner parameters from
 * before the sync until the next inner step (a checkpoint of the sync
 * step records them).
 *
 * Checkpoints (ckpt_io.h's files, any world size): a rank of group g
 * holds its inner state as units U (1 + g) + u (parameters, Adam m, v,
 * its owned range) and its 1/G share of that range of each real unit u:
 * the outer parameters, the outer momentum (in the place of Adam's m) and
 * zeros (in v's); with error feedback, its residual as units
 * U (1 + G + g) + u (in the parameters' place). The manifest's diloco object names G and U
 * (and error_feedback). Export and sampling
 * read the real units, the synced model. A load into G' groups gives
 * group g the inner moments of group g mod G; at a sync step every group
 * starts from the outer parameters.
 */
#ifndef ZT_DILOCO_H
#define ZT_DILOCO_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt_io.h"
#include "comm.h"
#include "quant.h"
#include "spec.h"
#include "zero.h"

typedef struct zt_diloco {
  zt_zero_t *z;        /* the group's model states (one rank, stage 0) */
  zt_comm_t *comm;     /* the ranks at this place in every group */
  int G, g, U;
  int64_t H, tmo;
  float lr, mu;
  int nesterov;
  size_t n;            /* floats of the owned layout (z->shard_total) */
  float *outer, *mom;  /* the parameters at the last sync; the outer momentum */
  float *d;            /* the pseudo-gradient, then the inner parameters */
  void *dev;           /* a device buffer for the all-reduce when the communicator needs one */
  /* sync.compression: each group's encoded pseudo-gradient (qbytes) is
   * all-gathered into qall, and every group decodes and sums the G of
   * them in rank order (the same sum everywhere). */
  zt_quant_t q;
  size_t qbytes;
  uint8_t *qmine, *qall;
  /* int4: error feedback. ef is what the encoding of this group's
   * pseudo-gradients has left out so far, added to the next one before it
   * is encoded; qtmp holds this group's own encoding decoded. */
  float *ef, *qtmp;
  int corrupt;         /* test knob: corrupt this group's next encoding */
  int poison;          /* test knob: a NaN in this group's next pseudo-gradient */
  /* sync.fragments F (below): each unit's fragment; F > 1 only: the
   * group's parameters (w), a fragment's residual packed (efp, int4), and
   * the ranges of a fragment (scratch, U each). */
  int F;
  int *frag_of;
  float *w, *efp;
  size_t *roff, *rlen;
  int have_inner;      /* d holds the inner parameters from before the last sync */
  int64_t syncs, refused;
  double sync_ms;      /* the last sync's wall time */
  /* Overlap (sync.overlap_steps, below): the all-reduce on its thread,
   * the parameters it was launched from, and its outcome. */
  int pending, pfrag;   /* pfrag: the launched fragment (-1: the whole model) */
  size_t pn;            /* its floats, packed in d */
  pthread_t th;
  float *snap;
  int th_rc;
  zt_errkind_t th_kind;
  char th_msg[512];
} zt_diloco_t;

/* Sets up DiLoCo for group g of G over comm (the ranks at this rank's
 * place in every group), with the spec's outer optimizer, on z (the
 * group's ZeRO state). -1 when out of memory. */
ZT_MUST_CHECK int zt_diloco_create(zt_diloco_t *d, zt_zero_t *z, zt_comm_t *comm, int G, int g,
                                   const zt_spec_t *s, int64_t tmo);
void zt_diloco_free(zt_diloco_t *d);

/* Fresh state: the outer parameters are the group's current ones (its
 * initialisation, the same on every group), the momentum zero. */
ZT_MUST_CHECK int zt_diloco_begin(zt_diloco_t *d);

/* Fragments (sync.fragments F, after Streaming DiLoCo, Douillard et al.
 * 2025): the units are shared among F fragments of about equal size (the
 * largest unit first, each to the lightest fragment: the embeddings alone,
 * the blocks strided over depth). Fragment p syncs after the steps s with
 * s % H == (p + 1) H / F, so the network carries 1/F of the model every
 * H / F steps instead of all of it every H; fragment F - 1 syncs where the
 * round ends (the reports, evaluations and epochs), and the last step
 * syncs every fragment. Each fragment's outer step is the rule above on
 * its own elements: its pseudo-gradient is measured from its own last
 * sync. An epoch (where the round ends) holds each group's parameters as
 * they are, the fragments mid-round included, so a resume goes on from
 * them; with error feedback, the residual as above.
 *
 * The fragment that syncs after step s: F - 1 where a round ends, -1 for
 * none. */
int zt_diloco_fragment_due(const zt_diloco_t *d, int64_t s);

/* The outer step (above) of fragment f, -1 for the whole model.
 * *applied is 0 when the summed pseudo-gradient was not finite: the
 * outer state stays and every group returns to the last sync's
 * parameters. -1 when the all-reduce failed. */
ZT_MUST_CHECK int zt_diloco_sync(zt_diloco_t *d, int f, int *applied);

/* Overlap (sync.overlap_steps tau, after Streaming DiLoCo's overlapping
 * of communication): zt_diloco_launch computes the pseudo-gradient,
 * starts its all-reduce on a thread of its own and returns, and the group
 * trains on from its own parameters; tau steps later zt_diloco_land waits
 * for the sum, applies the outer step and puts the new outer parameters
 * plus what the group learned since the launch. The communicator is the
 * thread's in between (inner steps do not communicate). The next round's
 * pseudo-gradient is measured from the new outer parameters, so those tau
 * steps count in it. zt_diloco_free waits for a launched all-reduce. */
ZT_MUST_CHECK int zt_diloco_launch(zt_diloco_t *d, int f);
ZT_MUST_CHECK int zt_diloco_land(zt_diloco_t *d, int *applied);

/* A checkpoint of this group: the floats its snapshot needs, then the
 * snapshot itself into buf, described by ranges[0 .. *nranges) (room for
 * 3 U). */
size_t zt_diloco_snapshot_floats(const zt_diloco_t *d);
ZT_MUST_CHECK int zt_diloco_snapshot(zt_diloco_t *d, float *buf, zt_ckpt_range_t *ranges,
                                     int *nranges);

/* A lost group dropped from its round (docs/engine.md, "Elastic"). A
 * round's collectives come only at its end, so a lost group is found
 * there, when every other group has finished the round. Each survivor
 * keeps its round in a stash that outlives the generation (the worker
 * holds it): the inner parameters and moments as the round left them,
 * and the round's losses. When the next generation starts from the epoch
 * of the round's start and every one of its groups holds such a round,
 * they take their rounds back and meet at once: the outer step averages
 * the survivors' pseudo-gradients, and the lost group's share of the
 * round is not trained. Otherwise the stashes are dropped and the job
 * resumes from the epoch as usual. Not with error feedback (its residual
 * has moved on by the failed sync). */
typedef struct zt_diloco_stash zt_diloco_stash_t;
/* Keeps group d's round (s0, s] (n = s - s0 steps; rl: 2n, rlr and rms: n,
 * the trainer's round figures) in *st, replacing what it held. -1 when
 * out of memory (nothing kept). */
ZT_MUST_CHECK int zt_diloco_stash_keep(zt_diloco_t *d, zt_diloco_stash_t **st, uint64_t job,
                                       int64_t s0, int64_t s, const double *rl,
                                       const double *rlr, const double *rms);
/* The end of the round of job that *st holds from s0, or 0. */
int64_t zt_diloco_stash_end(const zt_diloco_stash_t *st, uint64_t job, int64_t s0);
/* Puts the stash's parameters and moments into the group's state and its
 * round figures into rl, rlr, rms (room for the round); *n receives the
 * round's steps. */
void zt_diloco_stash_take(zt_diloco_t *d, const zt_diloco_stash_t *st, double *rl, double *rlr,
                          double *rms, int *n);
void zt_diloco_stash_free(zt_diloco_stash_t *st);

/* Loads the committed epoch in dir (verified against rec): a DiLoCo
 * epoch of any number of groups as above, or an epoch of synchronous
 * training (its parameters become the outer ones, the momentum zero). */
ZT_MUST_CHECK int zt_diloco_load(zt_diloco_t *d, const char *dir, const zt_ckpt_record_t *rec,
                                 int64_t *step);

#endif
