/*
 * holdings.h: the checkpoint files a worker holds under its checkpoint
 * root (its own and the copies peers pushed to its store).
 *
 * At registration the worker tells the coordinator what it holds (the
 * inventory: every file of an epoch directory, relative to the root), so a
 * machine that comes back with old copies has them counted again or
 * deleted; afterwards the coordinator names epoch directories to delete in
 * heartbeat replies (retention, rollbacks, epochs that never committed).
 */
#ifndef ZT_HOLDINGS_H
#define ZT_HOLDINGS_H

#include <stddef.h>

/* At most this many files are reported. */
#define ZT_HOLD_MAX_FILES 4096

/* The checkpoint files under root: paths relative to it of the form
 * <dir>/job_<n>/step_<n>-g<n>/<file> (at most ZT_HOLD_MAX_FILES, found at
 * most ZT_EPOCH_MAX_DEPTH directories deep), and "<dir>/job_<n>/
 * step_<n>-g<n>/" (the directory, with a slash) for an epoch directory
 * that holds no finished file (".tmp" and ".part" files are unfinished).
 * *files is malloc'd, each entry too; free with zt_hold_free. */
int zt_hold_inventory(const char *root, char ***files, int *n);
void zt_hold_free(char **files, int n);

/* Deletes the epoch directory rel (relative to root; it must have the form
 * <dir>/job_<n>/step_<n>-g<n>, no ".."), with everything in it. Deleting
 * what is not there succeeds. -1 with the reason when the directory is
 * still there afterwards, or when the directory holding it lies outside
 * root once symbolic links are resolved (then nothing is touched). */
int zt_hold_delete(const char *root, const char *rel);

/* 1 when rel (relative) is an epoch directory in the canonical form
 * zt_epoch_parse takes: <dir>/job_<n>/step_<8 digits>-g<n>, digits only,
 * no empty or hidden component, at most ZT_EPOCH_MAX_DEPTH deep. */
int zt_hold_is_epoch_dir(const char *rel);

#endif
