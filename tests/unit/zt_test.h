/*
 * zt_test.h: a minimal unit-test harness (header only).
 *
 * A test file defines functions with ZT_TEST(name) and lists them in
 * ZT_TEST_MAIN(t1, t2, ...). Each check that fails prints its file, line and
 * expression and marks the current test failed; the run ends with the line
 * "N passed, N failed" and exits non-zero when anything failed.
 *
 *   ZT_TEST(adds) { ZT_CHECK(1 + 1 == 2); ZT_CHECK_NEAR(0.1 + 0.2, 0.3, 1e-12); }
 *   ZT_TEST_MAIN(adds)
 */
#ifndef ZT_TEST_H
#define ZT_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static int zt__test_failed;

#define ZT_TEST(name) static void name(void)

#define ZT_CHECK(cond)                                                      \
  do {                                                                      \
    if (!(cond)) {                                                          \
      fprintf(stderr, "  %s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      zt__test_failed = 1;                                                  \
    }                                                                       \
  } while (0)

/* Like ZT_CHECK but returns from the test on failure (for preconditions). */
#define ZT_REQUIRE(cond)                                                    \
  do {                                                                      \
    if (!(cond)) {                                                          \
      fprintf(stderr, "  %s:%d: requirement failed: %s\n", __FILE__, __LINE__, #cond); \
      zt__test_failed = 1;                                                  \
      return;                                                               \
    }                                                                       \
  } while (0)

#define ZT_CHECK_NEAR(a, b, tol)                                            \
  do {                                                                      \
    double zt__a = (double)(a), zt__b = (double)(b);                        \
    if (!(fabs(zt__a - zt__b) <= (tol))) {                                  \
      fprintf(stderr, "  %s:%d: %s = %.9g vs %s = %.9g (tol %g)\n", __FILE__, __LINE__, #a, \
              zt__a, #b, zt__b, (double)(tol));                             \
      zt__test_failed = 1;                                                  \
    }                                                                       \
  } while (0)

#define ZT_CHECK_STR(a, b)                                                  \
  do {                                                                      \
    const char *zt__x = (a), *zt__y = (b);                                  \
    if (!zt__x || !zt__y || strcmp(zt__x, zt__y) != 0) {                    \
      fprintf(stderr, "  %s:%d: \"%s\" != \"%s\"\n", __FILE__, __LINE__,    \
              zt__x ? zt__x : "(null)", zt__y ? zt__y : "(null)");          \
      zt__test_failed = 1;                                                  \
    }                                                                       \
  } while (0)

/* A fresh scratch directory for this test binary: $ZT_TEST_TMP/<name>.XXXXXX */
static inline const char *zt_test_tmpdir(const char *name) {
  static char path[512];
  const char *base = getenv("ZT_TEST_TMP");
  if (!base) base = "/tmp";
  mkdir(base, 0755);
  snprintf(path, sizeof path, "%s/%s.XXXXXX", base, name);
  if (!mkdtemp(path)) {
    perror("mkdtemp");
    exit(2);
  }
  return path;
}

/* Out of descriptors, as a busy process runs out: zt_test_fds_use lowers
 * the soft RLIMIT_NOFILE to `limit` (at most ZT_TEST_FDS) and opens
 * /dev/null until open fails; zt_test_fds_back closes them and restores
 * the limit. 0, or -1 when the limit cannot be changed. */
#define ZT_TEST_FDS 1024
typedef struct {
  struct rlimit was;
  int fds[ZT_TEST_FDS], n;
} zt_test_fds_t;

static inline int zt_test_fds_use(zt_test_fds_t *f, int limit) {
  struct rlimit low;
  f->n = 0;
  if (limit > ZT_TEST_FDS || getrlimit(RLIMIT_NOFILE, &f->was) != 0) return -1;
  low = f->was;
  low.rlim_cur = (rlim_t)limit;
  if (setrlimit(RLIMIT_NOFILE, &low) != 0) return -1;
  while (f->n < limit && (f->fds[f->n] = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0) f->n++;
  return 0;
}

static inline int zt_test_fds_back(zt_test_fds_t *f) {
  while (f->n > 0) close(f->fds[--f->n]);
  return setrlimit(RLIMIT_NOFILE, &f->was);
}

typedef struct {
  const char *name;
  void (*fn)(void);
} zt__test_case_t;

static inline int zt__test_run(const zt__test_case_t *cases, int n, int argc, char **argv) {
  int passed = 0, failed = 0;
  for (int i = 0; i < n; i++) {
    if (argc > 1 && strstr(cases[i].name, argv[1]) == NULL) continue;
    zt__test_failed = 0;
    fprintf(stderr, "[ RUN  ] %s\n", cases[i].name);
    cases[i].fn();
    fprintf(stderr, "[ %s ] %s\n", zt__test_failed ? "FAIL" : " OK ", cases[i].name);
    if (zt__test_failed) failed++;
    else passed++;
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

#define ZT_TEST_MAIN(...) ZT_TEST_MAIN_NAMED(main, __VA_ARGS__)

/* The same runner under another name, for a main() that decides first
 * whether to run at all (tests/gpu skips without a device). */
#define ZT_TEST_MAIN_NAMED(fname, ...)                                      \
  int fname(int argc, char **argv) {                                        \
    void (*fns[])(void) = {__VA_ARGS__};                                    \
    const char *names = #__VA_ARGS__;                                       \
    int n = (int)(sizeof fns / sizeof fns[0]);                              \
    zt__test_case_t cases[sizeof fns / sizeof fns[0]];                        \
    char buf[4096];                                                         \
    snprintf(buf, sizeof buf, "%s", names);                                 \
    char *save = NULL, *tok = strtok_r(buf, ", \n\t", &save);               \
    static char namestore[sizeof fns / sizeof fns[0]][128];                 \
    for (int i = 0; i < n; i++) {                                           \
      snprintf(namestore[i], sizeof namestore[i], "%s", tok ? tok : "?");   \
      cases[i].name = namestore[i];                                         \
      cases[i].fn = fns[i];                                                 \
      tok = strtok_r(NULL, ", \n\t", &save);                                \
    }                                                                       \
    return zt__test_run(cases, n, argc, argv);                              \
  }

#endif
