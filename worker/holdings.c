/*
 * holdings.c: the checkpoint files a worker holds (see holdings.h).
 */
#define _XOPEN_SOURCE 700
#include "holdings.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "zt_common.h"

/* "job_<digits>" / "step_<digits>-g<digits>": a whole component. */
static int digits(const char *s, size_t n, size_t *i);

static int is_job(const char *s, size_t n) {
  size_t i = 4;
  return n > 4 && strncmp(s, "job_", 4) == 0 && digits(s, n, &i) && i == n;
}

/* Digits from s[*i] on; 1 when there was at least one. */
static int digits(const char *s, size_t n, size_t *i) {
  size_t start = *i;
  while (*i < n && s[*i] >= '0' && s[*i] <= '9') (*i)++;
  return *i > start;
}

static int is_step(const char *s, size_t n) {
  size_t i = 5;
  if (n <= 5 || strncmp(s, "step_", 5) != 0 || !digits(s, n, &i)) return 0;
  if (i + 1 >= n || s[i] != '-' || s[i + 1] != 'g') return 0;
  i += 2;
  return digits(s, n, &i) && i == n;
}

int zt_hold_is_epoch_dir(const char *rel) {
  if (!rel[0] || rel[0] == '/' || strstr(rel, "..")) return 0;
  const char *step = strrchr(rel, '/');
  if (!step || !is_step(step + 1, strlen(step + 1))) return 0;
  const char *job = step;
  while (job > rel && job[-1] != '/') job--;
  return is_job(job, (size_t)(step - job));
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
  char path[2048];
  snprintf(path, sizeof path, "%s%s%s", root, rel[0] ? "/" : "", rel);
  DIR *d = opendir(path);
  if (!d) return;
  int epoch = rel[0] && zt_hold_is_epoch_dir(rel);
  struct dirent *e;
  while ((e = readdir(d)) && v->n < ZT_HOLD_MAX_FILES) {
    if (e->d_name[0] == '.') continue;
    char sub[2048];
    snprintf(sub, sizeof sub, "%s%s%s", rel, rel[0] ? "/" : "", e->d_name);
    char full[4096];
    snprintf(full, sizeof full, "%s/%s", root, sub);
    struct stat st;
    if (lstat(full, &st) != 0) continue;
    if (epoch && S_ISREG(st.st_mode) && !strstr(e->d_name, ".tmp") && !strstr(e->d_name, ".part"))
      add(v, sub);
    else if (!epoch && S_ISDIR(st.st_mode) && depth > 0)
      walk(v, root, sub, depth - 1);
  }
  closedir(d);
}

int zt_hold_inventory(const char *root, char ***files, int *n) {
  inv v = {NULL, 0};
  walk(&v, root, "", 8);
  *files = v.files;
  *n = v.n;
  return 0;
}

void zt_hold_free(char **files, int n) {
  for (int i = 0; i < n; i++) free(files[i]);
  free(files);
}

int zt_hold_delete(const char *root, const char *rel) {
  char abs[2048];
  if (!zt_hold_is_epoch_dir(rel) || zt_path_confine(root, rel, "epoch", abs, sizeof abs) != 0)
    return zt_errk(ZT_E_INVALID, "%.200s is not an epoch directory", rel);
  struct stat st;
  if (lstat(abs, &st) != 0) return 0;
  zt_remove_tree(abs);
  return 0;
}
