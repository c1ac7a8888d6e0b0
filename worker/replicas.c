/*
 * replicas.c: pushing checkpoint copies and fetching them (see replicas.h).
 */
#include "replicas.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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
    char path[ZT_PATH_MAX];
    if (zt_path_join(path, sizeof path, dir, files[i].name) != 0) return -1;
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

/* Files fetched at once: helper threads, the caller's own included. */
#define ZT_FETCH_THREADS 4
/* The connection deadline for a doubtful holder: a connection within one
 * network takes well under this (the runner's probes allow as much). */
#define ZT_FETCH_DOUBTFUL_CONNECT_MS 1000
/* Holders remembered as unreachable in one fetch. */
#define ZT_FETCH_UNREACHED 32

/* One fetch of an epoch's files, shared by its threads. */
typedef struct {
  zt_ctl_t *ctl;
  const char *root, *dir;
  const zt_ckpt_record_t *rec;
  const Ztrain__RendezvousReply *rv;
  int (*abort_fn)(void *); /* the caller's abort condition, for the helpers */
  void *abort_user;
  pthread_mutex_t mu;
  int next;   /* under mu: the next file to take */
  int failed; /* under mu: the lowest file that failed so far (rec->n: none) */
  /* Under mu: stores no connection could be made to during this fetch. */
  char unreached[ZT_FETCH_UNREACHED][96];
  int nunreached;
  /* Per file, written by the thread that took it: its outcome. */
  zt_fetch_fail_t *why;
  char (*msg)[ZT_ERR_MAX];
} fetch_t;

static int was_unreached(fetch_t *x, const char *addr) {
  pthread_mutex_lock(&x->mu);
  int found = 0;
  for (int i = 0; i < x->nunreached && !found; i++) found = !strcmp(x->unreached[i], addr);
  pthread_mutex_unlock(&x->mu);
  return found;
}

static void mark_unreached(fetch_t *x, const char *addr) {
  if (was_unreached(x, addr)) return;
  pthread_mutex_lock(&x->mu);
  if (x->nunreached < ZT_FETCH_UNREACHED)
    snprintf(x->unreached[x->nunreached++], sizeof x->unreached[0], "%s", addr);
  pthread_mutex_unlock(&x->mu);
}

/* A holder to try last, with a short connection deadline: the coordinator
 * doubts it (ReplicaTarget.doubtful), or this fetch could not connect to
 * it already. */
static int doubtful(fetch_t *x, const Ztrain__ReplicaTarget *t) {
  return t->doubtful || was_unreached(x, t->addr);
}

/* The order file i's holders are tried in (indexes into fc->holders, all
 * of them): the sound ones first, starting at the i-th of them so that
 * files fetched at once come from different holders where several hold
 * them, then the doubtful ones in the coordinator's order. */
static void holder_order(fetch_t *x, const Ztrain__FileCopies *fc, int i, size_t *order) {
  size_t n = fc->n_holders, sound = 0, k = 0;
  uint8_t *d = zt_xcalloc(n + 1, 1);
  for (size_t h = 0; h < n; h++) sound += !(d[h] = (uint8_t)doubtful(x, fc->holders[h]));
  for (size_t h = 0; h < n; h++)
    if (!d[h]) order[(k++ + sound - (size_t)i % sound) % sound] = h;
  for (size_t h = 0; h < n; h++)
    if (d[h]) order[k++] = h;
  free(d);
}

/* One file of the epoch: verified locally, or fetched from a holder. On
 * failure *why_kind is ZT_FETCH_LOCAL when this worker could not store it,
 * ZT_FETCH_UNAVAILABLE when some holder could not serve it (busy, out of
 * reach, a ticket it no longer takes), and ZT_FETCH_CORRUPT only when every
 * holder answered about the file itself: no copy there, or bytes that fail
 * the record's checksum. */
static int ensure(fetch_t *x, int fi, zt_fetch_fail_t *why_kind) {
  const zt_ckpt_file_t *f = &x->rec->files[fi];
  char path[ZT_PATH_MAX], why[1200] = "";
  if (zt_path_join(path, sizeof path, x->dir, f->name) != 0) {
    *why_kind = ZT_FETCH_LOCAL;
    return -1;
  }
  if (access(path, F_OK) == 0 && zt_ckpt_verify_file(path, f->bytes, f->checksum) == 0) return 0;
  int local = access(path, F_OK) == 0; /* a copy here, which failed its check */
  if (local) snprintf(why, sizeof why, "local copy: %s; ", zt_err_msg());
  const Ztrain__FileCopies *fc = copies_of(x->rv, f->name);
  const char *rel = zt_path_under(x->root, x->dir);
  if (zt_mkdirs(x->dir) != 0) goto local;
  /* A symbolic link in our root must not lead the copy out of it. */
  if (!zt_path_real_under(x->root, x->dir)) {
    zt_err("%s: with its links resolved it lies outside the checkpoint root", x->dir);
    goto local;
  }
  int unavailable = 0;
  size_t n = fc && rel ? fc->n_holders : 0;
  size_t *order = zt_xcalloc(n + 1, sizeof *order);
  if (n) holder_order(x, fc, fi, order);
  for (size_t k = 0; k < n; k++) {
    const Ztrain__ReplicaTarget *t = fc->holders[order[k]];
    int64_t connect_ms = doubtful(x, t) ? ZT_FETCH_DOUBTFUL_CONNECT_MS : 0;
    if (zt_store_get(t->addr, t->ticket, rel, path, f, connect_ms,
                     zt_store_transfer_ms(f->bytes)) == 0) {
      ZT_INFO("fetched %s/%s from %s (%s)", rel, f->name, t->addr, t->host);
      if (zt_ctl_report_replica(x->ctl, x->rv->job_id, rel, f->name, f->bytes, f->checksum) != 0)
        ZT_WARN("copy of %s/%s not reported: %s", rel, f->name, zt_err_msg());
      free(order);
      return 0;
    }
    if (zt_store_unreached()) mark_unreached(x, t->addr);
    zt_errkind_t ek = zt_err_kind();
    if (ek != ZT_E_NOT_FOUND && ek != ZT_E_INVALID && ek != ZT_E_UNAVAILABLE) {
      free(order);
      goto local;
    }
    if (ek == ZT_E_UNAVAILABLE) unavailable = 1;
    size_t l = strlen(why);
    snprintf(why + l, sizeof why - l, "%s (%s): %s; ", t->addr, t->host, zt_err_msg());
  }
  free(order);
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

/* A thread of the fetch (the caller's too): takes the files in order until
 * none is left or one failed, so that the failure reported is the one a
 * fetch of one file after the other would have met first. */
static void *fetch_main(void *p) {
  fetch_t *x = p;
  zt_store_abort_when(x->abort_fn, x->abort_user);
  pthread_mutex_lock(&x->mu);
  while (x->next < x->rec->n && x->failed == x->rec->n) {
    int i = x->next++;
    pthread_mutex_unlock(&x->mu);
    zt_fetch_fail_t why = ZT_FETCH_UNAVAILABLE;
    int rc = ensure(x, i, &why);
    if (rc != 0) snprintf(x->msg[i], sizeof x->msg[i], "%s", zt_err_msg());
    pthread_mutex_lock(&x->mu);
    if (rc != 0) {
      x->why[i] = why;
      if (i < x->failed) x->failed = i;
    }
  }
  pthread_mutex_unlock(&x->mu);
  return NULL;
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
  struct stat st;
  int made = stat(dir, &st) != 0; /* the fetch makes the directory */
  fetch_t x = {.ctl = ctl, .root = root, .dir = dir, .rec = rec, .rv = rv, .failed = rec->n};
  zt_store_abort_get(&x.abort_fn, &x.abort_user);
  x.why = zt_xcalloc((size_t)rec->n + 1, sizeof *x.why);
  x.msg = zt_xcalloc((size_t)rec->n + 1, sizeof *x.msg);
  pthread_mutex_init(&x.mu, NULL);
  /* Helpers fetch beside this thread; without them (none could be
   * started) this thread fetches every file itself. */
  pthread_t th[ZT_FETCH_THREADS];
  int nth = 0;
  while (nth < ZT_FETCH_THREADS - 1 && nth < rec->n - 1 &&
         pthread_create(&th[nth], NULL, fetch_main, &x) == 0)
    nth++;
  fetch_main(&x);
  for (int i = 0; i < nth; i++) pthread_join(th[i], NULL);
  pthread_mutex_destroy(&x.mu);
  int rc = 0;
  if (x.failed < rec->n) {
    *why = x.why[x.failed];
    rc = zt_err("%s", x.msg[x.failed]);
    /* A directory made for the copies goes again when nothing is in it
     * (an empty epoch directory names no copy and waits for nothing). */
    if (made) rmdir(dir);
  }
  free(x.why);
  free(x.msg);
  return rc;
}
