/*
 * replicas.h: copies of checkpoint files between workers (the runner's side
 * of the replica stores, store.h).
 *
 * Writing an epoch: after a rank's files are durable, they are pushed to
 * the replica stores the rendezvous named (replica_targets: other hosts,
 * best first) until each file has `replicas` copies in all; only then does
 * the rank report its files. Fewer copies is a failed write: the epoch
 * cannot commit, and the coordinator treats it like a full disk.
 *
 * Loading an epoch: every file of it must be under this worker's
 * checkpoint root, verified against the record: a local copy is checked,
 * a missing or corrupt one is fetched from the stores that hold it
 * (checkpoint_copies, in order), and a fetched copy is reported, so it is
 * counted and later deleted with the epoch. A file no holder can give
 * because every holder answered without a good copy is a corrupt epoch
 * (the coordinator falls back to an older one); when some holder could not
 * be reached the epoch is only unavailable for now (*unavailable set: the
 * generation fails, the epoch stays).
 */
#ifndef ZT_REPLICAS_H
#define ZT_REPLICAS_H

#include "ckpt_io.h"
#include "control.h"
#include "ztrain.pb-c.h"

/* dir: the epoch directory (absolute, under root). */
ZT_MUST_CHECK int zt_replicas_push(const char *root, const char *dir, const zt_ckpt_file_t *files,
                                   int nfiles, const Ztrain__RendezvousReply *rv);
/* dir: the epoch to load (absolute, under root); rec: its record. */
ZT_MUST_CHECK int zt_replicas_fetch(zt_ctl_t *ctl, const char *root, const char *dir,
                                    const zt_ckpt_record_t *rec,
                                    const Ztrain__RendezvousReply *rv, int *unavailable);

#endif
