/*
 * holdings.c: the checkpoint files a worker holds (see holdings.h).
 */
#define _XOPEN_SOURCE 700
#include "holdings.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "zt_common.h"

/* The canonical form only (zt_epoch_parse): what a store accepts is what
 * this scan lists and what a deletion may name. */
int zt_hold_is_epoch_dir(const char *rel) {
  zt_epoch_t e;
  return zt_epoch_parse(rel, &e) == 0;
}

typedef struct {
  char **files;
  int n;
} inv;

static void add(inv *v, const char *rel) {
  if (v->n >= ZT_HOLD_MAX_FILES) return;
  v->files = zt_xrealloc(v->files, (size_t)(v->n + 1) * sizeof *v->files);
  v->files[v->n++] = zt_xstrdup(rel);
}

/* Walks dir (root-relative rel) down to `depth` more levels. */
static void walk(inv *v, const char *root, const char *rel, int depth) {
  char path[ZT_PATH_MAX];
  if (zt_path_fmt(path, sizeof path, "%s%s%s", root, rel[0] ? "/" : "", rel) != 0) return;
  DIR *d = opendir(path);
  if (!d) return;
  int epoch = rel[0] && zt_hold_is_epoch_dir(rel), listed = v->n;
  struct dirent *e;
  while ((e = readdir(d)) && v->n < ZT_HOLD_MAX_FILES) {
    if (e->d_name[0] == '.') continue;
    char sub[ZT_PATH_MAX], full[ZT_PATH_MAX];
    struct stat st;
    if (zt_path_fmt(sub, sizeof sub, "%s%s%s", rel, rel[0] ? "/" : "", e->d_name) != 0 ||
        zt_path_join(full, sizeof full, root, sub) != 0 || lstat(full, &st) != 0)
      continue; /* a name too long to be one of ours */
    if (epoch && S_ISREG(st.st_mode) && !strstr(e->d_name, ".tmp") && !strstr(e->d_name, ".part"))
      add(v, sub);
    else if (!epoch && S_ISDIR(st.st_mode) && depth > 0)
      walk(v, root, sub, depth - 1);
  }
  closedir(d);
  /* An epoch directory with no finished file (empty, or only a write or
   * a copy that never finished) is listed as itself, so that it can be
   * judged too. */
  if (epoch && v->n == listed) {
    char self[ZT_PATH_MAX];
    if (zt_path_fmt(self, sizeof self, "%s/", rel) == 0) add(v, self);
  }
}

int zt_hold_inventory(const char *root, char ***files, int *n) {
  inv v = {NULL, 0};
  walk(&v, root, "", ZT_EPOCH_MAX_DEPTH);
  *files = v.files;
  *n = v.n;
  return 0;
}

void zt_hold_free(char **files, int n) {
  for (int i = 0; i < n; i++) free(files[i]);
  free(files);
}

/* rel was checked as text only: a symbolic link in the middle of the path
 * (job_5 -> /elsewhere) would lead the deletion out of the root, so the
 * directory that holds the epoch is checked again with its links resolved
 * (the epoch directory itself is not followed: zt_remove_tree removes a
 * link, not what it points to). Only a directory that is gone afterwards
 * counts as deleted. */
int zt_hold_delete(const char *root, const char *rel) {
  char abs[ZT_PATH_MAX], parent[ZT_PATH_MAX];
  if (!zt_hold_is_epoch_dir(rel) || zt_path_confine(root, rel, "epoch", abs, sizeof abs) != 0)
    return zt_errk(ZT_E_INVALID, "%.200s is not an epoch directory", rel);
  struct stat st;
  if (lstat(abs, &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return 0;
    return zt_err_errno("epoch %.200s: not deleted: lstat", rel);
  }
  snprintf(parent, sizeof parent, "%.*s", (int)(strrchr(abs, '/') - abs), abs);
  if (!zt_path_real_under(root, parent))
    return zt_errk(ZT_E_INVALID,
                   "epoch %.200s: not deleted: with its links resolved it lies outside the "
                   "checkpoint root %.200s",
                   rel, root);
  int left = zt_remove_tree(abs);
  if (lstat(abs, &st) == 0 || errno != ENOENT) {
    if (left > 0) return zt_err_wrap("epoch %.200s: not deleted: %d entries left", rel, left);
    if (left < 0) return zt_err_wrap("epoch %.200s: not deleted", rel);
    return zt_err("epoch %.200s: not deleted: it is still there", rel);
  }
  return 0;
}
