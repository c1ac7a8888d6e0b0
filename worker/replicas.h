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
 * (checkpoint_copies), and a fetched copy is reported, so it is counted
 * and later deleted with the epoch. Up to four files are checked and
 * fetched at once, each by a thread of its own, so that a holder that
 * answers slowly or not at all does not hold up the files others serve.
 * A file's holders are tried in the coordinator's order, with two
 * changes: holders it marked doubtful (kept out, silent, or named
 * unreachable by this worker's last probe), and holders this fetch could
 * not connect to for an earlier file, come last and get a short
 * connection deadline (a one-way cut loses a store's answers, so that a
 * connection to it waits out its whole deadline); and the sound holders
 * of a file take turns by its place in the record, so that files fetched
 * at once come from different stores. Every transfer keeps its deadlines
 * and the caller's abort condition (zt_store_abort_when). Why a file could not be had
 * decides what the coordinator is told (zt_fetch_fail_t): only when every
 * holder answered about the file itself (it has no copy, or the bytes it
 * sent fail the record's size or checksum) is the epoch corrupt; a holder
 * that could not be reached, was busy or did not take its ticket leaves
 * the epoch merely unavailable for now; and a failure on this machine
 * (its disk full or failing, a directory that cannot be made) is this
 * worker's own, which says nothing about the epoch either.
 */
#ifndef ZT_REPLICAS_H
#define ZT_REPLICAS_H

#include "ckpt_io.h"
#include "control.h"
#include "ztrain.pb-c.h"

/* dir: the epoch directory (absolute, under root). */
ZT_MUST_CHECK int zt_replicas_push(const char *root, const char *dir, const zt_ckpt_file_t *files,
                                   int nfiles, const Ztrain__RendezvousReply *rv);
/* Why zt_replicas_fetch failed. */
typedef enum {
  ZT_FETCH_CORRUPT = 1,     /* every holder answered without a good copy: a bad epoch */
  ZT_FETCH_UNAVAILABLE = 2, /* some holder could not serve it now: the epoch stays */
  ZT_FETCH_LOCAL = 3        /* this worker could not store it: a local failure */
} zt_fetch_fail_t;

/* dir: the epoch to load (absolute, under root); rec: its record. On
 * failure *why says which kind it was: that of the first file of the
 * record that could not be had, as if the files were fetched one after
 * the other (no file is started after one failed). A directory that is not an epoch
 * (zt_epoch_parse) or a file name that is not a checkpoint file
 * (zt_epoch_file) is refused before anything is read or written
 * (ZT_FETCH_UNAVAILABLE: it says nothing about the epoch). */
ZT_MUST_CHECK int zt_replicas_fetch(zt_ctl_t *ctl, const char *root, const char *dir,
                                    const zt_ckpt_record_t *rec,
                                    const Ztrain__RendezvousReply *rv, zt_fetch_fail_t *why);

#endif
