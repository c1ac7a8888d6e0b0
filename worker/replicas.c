/*
 * replicas.c: pushing checkpoint copies and fetching them (see replicas.h).
 */
#include "replicas.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "store.h"
#include "zt_common.h"

int zt_replicas_push(const char *root, const char *dir, const zt_ckpt_file_t *files,
                     int nfiles, const Ztrain__RendezvousReply *rv) {
  int need = (int)rv->replicas - 1;
  const char *rel = zt_path_under(root, dir);
  if (need <= 0 || !rel) return 0;
  char why[600] = "no replica store to push to";
  for (int i = 0; i < nfiles; i++) {
    char path[1300];
    snprintf(path, sizeof path, "%s/%s", dir, files[i].name);
    int copies = 0;
    for (size_t t = 0; t < rv->n_replica_targets && copies < need; t++) {
      const Ztrain__ReplicaTarget *tg = rv->replica_targets[t];
      if (zt_store_put(tg->addr, tg->ticket, rel, path, &files[i],
                       zt_store_transfer_ms(files[i].bytes)) == 0)
        copies++;
      else
        snprintf(why, sizeof why, "%s (%s): %s", tg->addr, tg->host, zt_err_msg());
    }
    if (copies < need)
      return zt_err("replication: %s has %d of the %d copies it needs on other hosts; last: %s",
                    files[i].name, copies + 1, need + 1, why);
  }
  return 0;
}

static const Ztrain__FileCopies *copies_of(const Ztrain__RendezvousReply *rv, const char *name) {
  for (size_t i = 0; i < rv->n_checkpoint_copies; i++)
    if (!strcmp(rv->checkpoint_copies[i]->name, name)) return rv->checkpoint_copies[i];
  return NULL;
}

/* One file of the epoch: verified locally, or fetched from a holder. On
 * failure *why is ZT_FETCH_LOCAL when this worker could not store it,
 * ZT_FETCH_UNAVAILABLE when some holder could not serve it (busy, out of
 * reach, a ticket it no longer takes), and ZT_FETCH_CORRUPT only when every
 * holder answered about the file itself: no copy there, or bytes that fail
 * the record's checksum. */
static int ensure(zt_ctl_t *ctl, const char *root, const char *dir, const zt_ckpt_file_t *f,
                  const Ztrain__RendezvousReply *rv, zt_fetch_fail_t *why_kind) {
  char path[1300], why[1200] = "";
  snprintf(path, sizeof path, "%s/%s", dir, f->name);
  if (access(path, F_OK) == 0 && zt_ckpt_verify_file(path, f->bytes, f->checksum) == 0) return 0;
  int local = access(path, F_OK) == 0; /* a copy here, which failed its check */
  if (local) snprintf(why, sizeof why, "local copy: %s; ", zt_err_msg());
  const Ztrain__FileCopies *fc = copies_of(rv, f->name);
  const char *rel = zt_path_under(root, dir);
  if (zt_mkdirs(dir) != 0) goto local;
  /* A symbolic link in our root must not lead the copy out of it. */
  if (!zt_path_real_under(root, dir)) {
    zt_err("%s: with its links resolved it lies outside the checkpoint root", dir);
    goto local;
  }
  int unavailable = 0;
  for (size_t h = 0; fc && rel && h < fc->n_holders; h++) {
    const Ztrain__ReplicaTarget *t = fc->holders[h];
    if (zt_store_get(t->addr, t->ticket, rel, path, f, zt_store_transfer_ms(f->bytes)) == 0) {
      ZT_INFO("fetched %s/%s from %s (%s)", rel, f->name, t->addr, t->host);
      if (zt_ctl_report_replica(ctl, rv->job_id, rel, f->name, f->bytes, f->checksum) != 0)
        ZT_WARN("copy of %s/%s not reported: %s", rel, f->name, zt_err_msg());
      return 0;
    }
    zt_errkind_t k = zt_err_kind();
    if (k != ZT_E_NOT_FOUND && k != ZT_E_INVALID && k != ZT_E_UNAVAILABLE) goto local;
    if (k == ZT_E_UNAVAILABLE) unavailable = 1;
    size_t l = strlen(why);
    snprintf(why + l, sizeof why - l, "%s (%s): %s; ", t->addr, t->host, zt_err_msg());
  }
  /* Corrupt only when a copy was seen to be bad and none could be
   * reached: a file with no copy here and no holder named (the
   * coordinator could not list them) says nothing about the epoch. */
  int holders = fc && fc->n_holders;
  *why_kind = unavailable || (!local && !holders) ? ZT_FETCH_UNAVAILABLE : ZT_FETCH_CORRUPT;
  return zt_err("%s: %s: %s%s", f->name,
                *why_kind == ZT_FETCH_UNAVAILABLE ? "no copy can be reached now"
                                                  : "no good copy (corrupt checkpoint)",
                why, holders ? "" : "no other holder");
local:
  /* Our own disk or directory failed: another holder would not help. */
  *why_kind = ZT_FETCH_LOCAL;
  return zt_err_wrap("%s: cannot store a copy on this worker", f->name);
}

/* The directory and the file names come from the coordinator's reply: only
 * an epoch directory (zt_epoch_parse) and checkpoint file names
 * (zt_epoch_file) are taken, so that no name leads a read or a write out
 * of the epoch. A refusal says nothing about the epoch itself. */
static int check_names(const char *root, const char *dir, const zt_ckpt_record_t *rec) {
  const char *rel = zt_path_under(root, dir);
  zt_epoch_t e;
  char shown[300];
  if (!rel)
    return zt_errk(ZT_E_INVALID,
                   "checkpoint to load %.200s is not under the checkpoint root %.200s",
                   zt_printable(dir, shown, sizeof shown), root);
  if (zt_epoch_parse(rel, &e) != 0)
    return zt_err_wrapk(ZT_E_INVALID, "checkpoint to load %.200s is not an epoch directory",
                        zt_printable(rel, shown, sizeof shown));
  for (int i = 0; i < rec->n; i++) {
    int rank;
    char name[300];
    if (!zt_epoch_file(rec->files[i].name, &rank))
      return zt_errk(ZT_E_INVALID, "checkpoint to load %.200s: %.200s is not a checkpoint file",
                     zt_printable(rel, shown, sizeof shown),
                     zt_printable(rec->files[i].name, name, sizeof name));
  }
  return 0;
}

int zt_replicas_fetch(zt_ctl_t *ctl, const char *root, const char *dir,
                      const zt_ckpt_record_t *rec, const Ztrain__RendezvousReply *rv,
                      zt_fetch_fail_t *why) {
  if (check_names(root, dir, rec) != 0) {
    *why = ZT_FETCH_UNAVAILABLE;
    return -1;
  }
  for (int i = 0; i < rec->n; i++)
    if (ensure(ctl, root, dir, &rec->files[i], rv, why) != 0) return -1;
  return 0;
}
