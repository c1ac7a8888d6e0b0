/*
 * test_state.c: the SQLite layer (state/db.c) on real files.
 *
 * Covers the migration path, worker upsert by name, batched touches, the
 * logbook, persistence across reopen, transactions rolled back on failure,
 * and refusal of files that are not ours (garbage, a newer schema), of a
 * database another process holds, of an empty (truncated) file and of a
 * damaged one (a b-tree page, an index that quick_check passes, the
 * header), each leaving the file as it was.
 */
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "zt_common.h"
#include "zt_db.h"
#include "zt_test.h"

static char g_path[600];

static const char *fresh_db(const char *name) {
  snprintf(g_path, sizeof g_path, "%s/%s.db", zt_test_tmpdir(name), name);
  return g_path;
}

static zt_db_worker_t make_worker(const char *name, int state) {
  zt_db_worker_t w;
  memset(&w, 0, sizeof w);
  snprintf(w.name, sizeof w.name, "%s", name);
  snprintf(w.host, sizeof w.host, "host-%s", name);
  snprintf(w.device, sizeof w.device, "cpu");
  w.state = state;
  w.last_seen_ms = w.registered_ms = 1000;
  w.pid = 42;
  snprintf(w.session, sizeof w.session, "session-of-%s", name);
  w.host_memory = 8ull << 30;
  w.device_memory = state == ZT_WORKER_ALIVE ? 80ull << 30 : 0;
  return w;
}

static int count_worker(const zt_db_worker_t *w, void *user) {
  zt_db_worker_t *last = user;
  *last = *w;
  last->pid++; /* pid field reused as a counter below */
  return 0;
}

ZT_TEST(test_migrate_and_reopen) {
  const char *path = fresh_db("migrate");
  zt_db_t *db;
  ZT_REQUIRE(zt_db_open(path, 0, &db) == 0);
  ZT_CHECK(zt_db_schema_version(db) == zt_db_schema_latest());
  ZT_CHECK(zt_db_meta_set(db, "epoch", 7) == 0);
  zt_db_worker_t a = make_worker("a", ZT_WORKER_ALIVE), b = make_worker("b", ZT_WORKER_ALIVE);
  ZT_CHECK(zt_db_worker_upsert(db, &a) == 0 && a.id == 1);
  ZT_CHECK(zt_db_worker_upsert(db, &b) == 0 && b.id == 2);
  /* Same name: same row, updated in place. */
  zt_db_worker_t a2 = make_worker("a", ZT_WORKER_LEFT);
  snprintf(a2.host, sizeof a2.host, "elsewhere");
  ZT_CHECK(zt_db_worker_upsert(db, &a2) == 0 && a2.id == 1);
  int64_t eid = 0;
  ZT_CHECK(zt_db_event_add(db, 0, "registered", 1, "detail one", &eid) == 0 && eid == 1);
  ZT_CHECK(zt_db_event_add(db, 5, "step", 0, "job event", NULL) == 0);
  uint64_t ids[2] = {1, 2};
  int64_t seen[2] = {5000, 6000};
  ZT_CHECK(zt_db_workers_touch(db, ids, seen, 2) == 0);
  zt_db_close(db);

  ZT_REQUIRE(zt_db_open(path, 0, &db) == 0);
  ZT_CHECK(zt_db_schema_version(db) == zt_db_schema_latest());
  int64_t v = 0;
  ZT_CHECK(zt_db_meta_get(db, "epoch", &v, 0) == 0 && v == 7);
  ZT_CHECK(zt_db_meta_get(db, "missing", &v, 99) == 0 && v == 99);
  zt_db_worker_t last;
  memset(&last, 0, sizeof last);
  last.pid = 0;
  ZT_CHECK(zt_db_workers_each(db, count_worker, &last) == 0);
  ZT_CHECK(last.id == 2 && last.last_seen_ms == 6000);
  /* Credentials and memory survive a reopen (a coordinator restart). */
  ZT_CHECK_STR(last.session, "session-of-b");
  ZT_CHECK(last.host_memory == 8ull << 30 && last.device_memory == 80ull << 30);
  zt_db_close(db);
}

static int collect_kind(const zt_db_event_t *e, void *user) {
  char *acc = user;
  strcat(acc, e->kind);
  strcat(acc, ";");
  return 0;
}

ZT_TEST(test_events_filter_and_order) {
  zt_db_t *db;
  ZT_REQUIRE(zt_db_open(fresh_db("events"), 0, &db) == 0);
  ZT_CHECK(zt_db_event_add(db, 0, "a", 0, "", NULL) == 0);
  ZT_CHECK(zt_db_event_add(db, 3, "b", 0, "", NULL) == 0);
  ZT_CHECK(zt_db_event_add(db, 3, "c", 0, "", NULL) == 0);
  ZT_CHECK(zt_db_event_add(db, 4, "d", 0, "", NULL) == 0);
  char acc[256] = "";
  ZT_CHECK(zt_db_events_each(db, 0, 0, 0, collect_kind, acc) == 0);
  ZT_CHECK_STR(acc, "a;b;c;d;");
  acc[0] = 0;
  ZT_CHECK(zt_db_events_each(db, 3, 0, 0, collect_kind, acc) == 0);
  ZT_CHECK_STR(acc, "b;c;");
  acc[0] = 0;
  ZT_CHECK(zt_db_events_each(db, 0, 2, 1, collect_kind, acc) == 0);
  ZT_CHECK_STR(acc, "c;");
  /* The newest ones, oldest first. */
  acc[0] = 0;
  ZT_CHECK(zt_db_events_each(db, 0, 0, -2, collect_kind, acc) == 0);
  ZT_CHECK_STR(acc, "c;d;");
  acc[0] = 0;
  ZT_CHECK(zt_db_events_each(db, 3, 0, -1, collect_kind, acc) == 0);
  ZT_CHECK_STR(acc, "c;");
  acc[0] = 0;
  ZT_CHECK(zt_db_events_each(db, 0, 3, -10, collect_kind, acc) == 0);
  ZT_CHECK_STR(acc, "d;");
  zt_db_close(db);
}

ZT_TEST(test_rollback_leaves_nothing) {
  const char *path = fresh_db("rollback");
  zt_db_t *db;
  ZT_REQUIRE(zt_db_open(path, 0, &db) == 0);
  ZT_CHECK(zt_db_begin(db) == 0);
  ZT_CHECK(zt_db_event_add(db, 0, "never", 0, "", NULL) == 0);
  zt_db_rollback(db);
  char acc[64] = "";
  ZT_CHECK(zt_db_events_each(db, 0, 0, 0, collect_kind, acc) == 0);
  ZT_CHECK_STR(acc, "");
  zt_db_close(db);
}

ZT_TEST(test_garbage_file_refused) {
  const char *path = fresh_db("garbage");
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ZT_REQUIRE(fd >= 0);
  char junk[4096];
  for (size_t i = 0; i < sizeof junk; i++) junk[i] = (char)(i * 7 + 3);
  ZT_CHECK(zt_write_all(fd, junk, sizeof junk) == 0);
  close(fd);
  zt_db_t *db = NULL;
  ZT_CHECK(zt_db_open(path, 0, &db) != 0);
  ZT_CHECK(strstr(zt_err_msg(), path) != NULL);
  /* Nothing was written over it. */
  char *back;
  size_t len;
  ZT_REQUIRE(zt_read_file(path, &back, &len, 1 << 20) == 0);
  ZT_CHECK(len == sizeof junk && memcmp(back, junk, len) == 0);
  free(back);
}

ZT_TEST(test_newer_schema_refused) {
  const char *path = fresh_db("newer");
  zt_db_t *db;
  ZT_REQUIRE(zt_db_open(path, 0, &db) == 0);
  zt_db_close(db);
  /* Pretend a future zcoord migrated it further. */
  char cmd[800];
  snprintf(cmd, sizeof cmd, "sqlite3 '%s' 'PRAGMA user_version = 99'", path);
  ZT_REQUIRE(system(cmd) == 0);
  ZT_CHECK(zt_db_open(path, 0, &db) != 0);
  ZT_CHECK(strstr(zt_err_msg(), "newer than this zcoord") != NULL);
}

ZT_TEST(test_readonly_file_fails_cleanly) {
  if (geteuid() == 0) {
    /* root ignores file modes; use a read-only bind of the data instead:
     * open a db, then make the directory unwritable is not enough either, so
     * check the error path with an unopenable path. */
    zt_db_t *db;
    ZT_CHECK(zt_db_open("/proc/ztrain-no-such-dir/x.db", 0, &db) != 0);
    ZT_CHECK(strstr(zt_err_msg(), "/proc/ztrain-no-such-dir/x.db") != NULL);
    return;
  }
  const char *path = fresh_db("ro");
  zt_db_t *db;
  ZT_REQUIRE(zt_db_open(path, 0, &db) == 0);
  zt_db_close(db);
  chmod(path, 0444);
  ZT_CHECK(zt_db_open(path, 0, &db) != 0);
}

static int collect_step(const zt_db_step_t *st, void *user) {
  double *acc = user;
  acc[0] += 1;
  acc[1] += st->loss;
  acc[2] = (double)st->generation;
  return 0;
}

ZT_TEST(test_jobs_generations_steps) {
  const char *path = fresh_db("jobs");
  zt_db_t *db;
  ZT_REQUIRE(zt_db_open(path, 0, &db) == 0);
  zt_db_job_t j;
  memset(&j, 0, sizeof j);
  snprintf(j.name, sizeof j.name, "tiny");
  j.spec = "{\"steps\": 10}";
  j.state = ZT_JOB_PENDING;
  j.total_steps = 10;
  j.min_workers = 2, j.max_workers = 4;
  j.created_ms = 123;
  ZT_CHECK(zt_db_job_insert(db, &j) == 0 && j.id == 1);
  j.state = ZT_JOB_RUNNING, j.generation = 1, j.world = 2, j.step = 3;
  snprintf(j.message, sizeof j.message, "running");
  ZT_CHECK(zt_db_job_update(db, &j) == 0);
  uint64_t ids[2] = {7, 9};
  ZT_CHECK(zt_db_generation_add(db, 1, 1, 2, 0, "formed", ids) == 0);
  /* The same generation twice is a constraint error, not a silent overwrite. */
  ZT_CHECK(zt_db_generation_add(db, 1, 1, 2, 0, "again", ids) != 0);
  for (int s = 1; s <= 3; s++) {
    zt_db_step_t st = {s, 1, 1.0 * s, 0.5, 1e-3, 100, NAN, 1000 + s};
    ZT_CHECK(zt_db_step_put(db, 1, &st) == 0);
  }
  /* A replayed step replaces its row. */
  zt_db_step_t again = {3, 2, 10.0, 0.5, 1e-3, 100, 2.5, 2000};
  ZT_CHECK(zt_db_step_put(db, 1, &again) == 0);
  zt_db_close(db);

  ZT_REQUIRE(zt_db_open(path, 0, &db) == 0);
  double acc[3] = {0, 0, 0};
  ZT_CHECK(zt_db_steps_each(db, 1, 1, 100, -1, collect_step, acc) == 0);
  ZT_CHECK(acc[0] == 3 && acc[1] == 1 + 2 + 10 && acc[2] == 2);
  /* At most `limit` rows, the first ones in step order. */
  double two[3] = {0, 0, 0};
  ZT_CHECK(zt_db_steps_each(db, 1, 1, 100, 2, collect_step, two) == 0);
  ZT_CHECK(two[0] == 2 && two[1] == 1 + 2 && two[2] == 1);
  uint64_t got[4] = {0};
  int n = 0;
  ZT_CHECK(zt_db_generation_members(db, 1, 1, got, 4, &n) == 0 && n == 2);
  ZT_CHECK(got[0] == 7 && got[1] == 9);
  zt_db_close(db);
}

ZT_TEST(test_second_open_refused) {
  const char *path = fresh_db("lock");
  zt_db_t *a, *b = NULL;
  ZT_REQUIRE(zt_db_open(path, 0, &a) == 0);
  ZT_CHECK(zt_db_open(path, 0, &b) != 0 && b == NULL);
  char pid[32];
  snprintf(pid, sizeof pid, "pid %d", (int)getpid());
  ZT_CHECK(strstr(zt_err_msg(), "in use by another zcoord") && strstr(zt_err_msg(), pid));
  ZT_CHECK(zt_err_kind() == ZT_E_STATE);
  zt_db_close(a);
  ZT_REQUIRE(zt_db_open(path, 0, &b) == 0); /* released with the first */
  zt_db_close(b);
}

ZT_TEST(test_empty_file_refused) {
  const char *path = fresh_db("empty");
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ZT_REQUIRE(fd >= 0);
  close(fd);
  zt_db_t *db;
  ZT_CHECK(zt_db_open(path, 0, &db) != 0);
  ZT_CHECK(strstr(zt_err_msg(), "is empty") && strstr(zt_err_msg(), "--new-db"));
  struct stat st;
  ZT_CHECK(stat(path, &st) == 0 && st.st_size == 0); /* untouched */
  ZT_REQUIRE(zt_db_open(path, ZT_DB_NEW_IF_EMPTY, &db) == 0);
  ZT_CHECK(zt_db_schema_version(db) == zt_db_schema_latest());
  zt_db_close(db);
}

/* A btree page of a valid database overwritten: the start-up check finds
 * it and the file is refused, byte for byte unchanged. */
ZT_TEST(test_damaged_file_refused) {
  const char *path = fresh_db("damaged");
  zt_db_t *db;
  ZT_REQUIRE(zt_db_open(path, 0, &db) == 0);
  ZT_REQUIRE(zt_db_begin(db) == 0);
  for (int i = 0; i < 2000; i++) {
    char detail[64];
    snprintf(detail, sizeof detail, "event number %d with some text", i);
    ZT_REQUIRE(zt_db_event_add(db, 1, "filler", 0, detail, NULL) == 0);
  }
  ZT_REQUIRE(zt_db_commit(db) == 0);
  zt_db_close(db);
  char cmd[800];
  snprintf(cmd, sizeof cmd, "sqlite3 '%s' 'PRAGMA wal_checkpoint(TRUNCATE)' >/dev/null", path);
  ZT_REQUIRE(system(cmd) == 0);
  int fd = open(path, O_RDWR);
  ZT_REQUIRE(fd >= 0);
  struct stat st;
  ZT_REQUIRE(fstat(fd, &st) == 0 && st.st_size > 5 * 4096);
  char junk[64];
  memset(junk, 0x5a, sizeof junk);
  ZT_REQUIRE(pwrite(fd, junk, sizeof junk, 3 * 4096) == (ssize_t)sizeof junk);
  close(fd);
  char *before, *after;
  size_t n1, n2;
  ZT_REQUIRE(zt_read_file(path, &before, &n1, 64 << 20) == 0);
  ZT_CHECK(zt_db_open(path, 0, &db) != 0);
  ZT_CHECK(strstr(zt_err_msg(), "damaged") && strstr(zt_err_msg(), "backup"));
  ZT_REQUIRE(zt_read_file(path, &after, &n2, 64 << 20) == 0);
  ZT_CHECK(n1 == n2 && memcmp(before, after, n1) == 0);
  free(before);
  free(after);
}

/* A database of a few workers, its write-ahead log folded in, so that the
 * file itself holds every page; *page gets its page size. */
static void small_db(const char *path, unsigned *page) {
  zt_db_t *db;
  ZT_REQUIRE(zt_db_open(path, 0, &db) == 0);
  for (int i = 0; i < 5; i++) {
    char name[16];
    snprintf(name, sizeof name, "w%d", i);
    zt_db_worker_t w = make_worker(name, ZT_WORKER_ALIVE);
    ZT_REQUIRE(zt_db_worker_upsert(db, &w) == 0);
  }
  zt_db_close(db);
  char cmd[800];
  snprintf(cmd, sizeof cmd, "sqlite3 '%s' 'PRAGMA wal_checkpoint(TRUNCATE)' >/dev/null", path);
  ZT_REQUIRE(system(cmd) == 0);
  unsigned char h[18];
  int fd = open(path, O_RDONLY);
  ZT_REQUIRE(fd >= 0 && pread(fd, h, sizeof h, 0) == (ssize_t)sizeof h);
  close(fd);
  *page = (unsigned)h[16] << 8 | h[17];
  if (*page == 1) *page = 65536;
}

/* What the sqlite3 tool prints for one statement on path (first line). */
static void sqlite3_says(const char *path, const char *sql, char *out, size_t n) {
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "sqlite3 '%s' \"%s\" 2>&1", path, sql);
  FILE *p = popen(cmd, "r");
  ZT_REQUIRE(p != NULL);
  if (!fgets(out, (int)n, p)) out[0] = 0;
  out[strcspn(out, "\n")] = 0;
  pclose(p);
}

/* A SQLite varint at p; *len gets its size. */
static uint64_t varint(const unsigned char *p, int *len) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) {
    v = v << 7 | (p[i] & 0x7f);
    if (!(p[i] & 0x80)) {
      *len = i + 1;
      return v;
    }
  }
  *len = 9;
  return v << 8 | p[8];
}

/* One character of a worker's name changed in the index of names only
 * (sqlite_autoindex_workers_1), the table left as it was: the index page
 * stays well-formed and sorted, so quick_check passes, while the index no
 * longer matches its table, which integrity_check finds. The file is
 * refused with a message naming the damage and the restore procedure, and
 * left byte for byte as it was. */
ZT_TEST(test_damaged_index_refused) {
  const char *path = fresh_db("index");
  unsigned page = 0;
  small_db(path, &page);
  char out[512];
  sqlite3_says(path, "SELECT rootpage FROM sqlite_master WHERE name = "
                     "'sqlite_autoindex_workers_1'", out, sizeof out);
  long root = atol(out);
  ZT_REQUIRE(root > 1);
  char *buf;
  size_t n;
  ZT_REQUIRE(zt_read_file(path, &buf, &n, 64 << 20) == 0);
  ZT_REQUIRE(n >= (size_t)root * page);
  unsigned char *pg = (unsigned char *)buf + (size_t)(root - 1) * page;
  ZT_REQUIRE(pg[0] == 0x0a); /* a leaf page of an index */
  unsigned cells = (unsigned)pg[3] << 8 | pg[4];
  ZT_REQUIRE(cells == 5);
  /* The last cell holds the largest key, "w4": its last character raised
   * to '~' keeps it the largest. */
  unsigned at = (unsigned)pg[8 + 2 * (cells - 1)] << 8 | pg[9 + 2 * (cells - 1)];
  int l1, l2, l3;
  varint(pg + at, &l1);                                    /* payload size */
  uint64_t hdr = varint(pg + at + l1, &l2);                /* record header size */
  uint64_t type = varint(pg + at + l1 + l2, &l3);          /* the name's serial type */
  ZT_REQUIRE(type == 13 + 2 * 2);                          /* text of 2 bytes */
  unsigned char *name = pg + at + l1 + hdr;
  ZT_REQUIRE(name[0] == 'w' && name[1] == '4');
  name[1] = '~';
  int fd = open(path, O_WRONLY);
  ZT_REQUIRE(fd >= 0 && zt_write_all(fd, buf, n) == 0);
  close(fd);
  sqlite3_says(path, "PRAGMA quick_check", out, sizeof out);
  ZT_CHECK_STR(out, "ok"); /* what start-up used to check */
  zt_db_t *db;
  ZT_CHECK(zt_db_open(path, 0, &db) != 0);
  const char *m = zt_err_msg();
  ZT_CHECK(strstr(m, path) && strstr(m, "is damaged (integrity_check: "));
  ZT_CHECK(strstr(m, "missing from index sqlite_autoindex_workers_1") != NULL);
  ZT_CHECK(strstr(m, "left as it was") && strstr(m, "docs/deploy.md"));
  ZT_CHECK(zt_err_kind() == ZT_E_STATE);
  char *after;
  size_t n2;
  ZT_REQUIRE(zt_read_file(path, &after, &n2, 64 << 20) == 0);
  ZT_CHECK(n == n2 && memcmp(buf, after, n) == 0);
  free(buf);
  free(after);
}

/* A damaged header is named as such, whatever SQLite would make of it
 * (a file format write version of 3, for one, made it a database SQLite
 * only reads: "attempt to write a readonly database"); the file is left
 * as it was. */
ZT_TEST(test_damaged_header_named) {
  static const struct {
    unsigned off;
    unsigned char val;
    const char *why;
  } flips[] = {{18, 3, "file format versions 3/2"},
               {19, 0, "file format versions 2/0"},
               {3, 'x', "bytes 0-15 are not \"SQLite format 3\""},
               {16, 0x30, "page size 12288 is not a power of two"},
               {21, 65, "payload fractions 65/32/32"}};
  for (size_t i = 0; i < ZT_ARRAY_LEN(flips); i++) {
    char name[32];
    snprintf(name, sizeof name, "header%zu", i);
    const char *path = fresh_db(name);
    unsigned page = 0;
    small_db(path, &page);
    ZT_REQUIRE(page == 4096);
    int fd = open(path, O_WRONLY);
    ZT_REQUIRE(fd >= 0 && pwrite(fd, &flips[i].val, 1, flips[i].off) == 1);
    close(fd);
    char *before, *after;
    size_t n1, n2;
    ZT_REQUIRE(zt_read_file(path, &before, &n1, 64 << 20) == 0);
    zt_db_t *db;
    ZT_CHECK(zt_db_open(path, 0, &db) != 0);
    const char *m = zt_err_msg();
    if (!strstr(m, "is not a usable SQLite database: its header is damaged") ||
        !strstr(m, flips[i].why) || !strstr(m, "docs/deploy.md"))
      fprintf(stderr, "byte %u = %u: %s\n", flips[i].off, flips[i].val, m);
    ZT_CHECK(strstr(m, "is not a usable SQLite database: its header is damaged") != NULL);
    ZT_CHECK(strstr(m, flips[i].why) && strstr(m, "docs/deploy.md") && !strstr(m, "readonly"));
    ZT_REQUIRE(zt_read_file(path, &after, &n2, 64 << 20) == 0);
    ZT_CHECK(n1 == n2 && memcmp(before, after, n1) == 0);
    free(before);
    free(after);
  }
}

ZT_TEST_MAIN(test_second_open_refused, test_empty_file_refused, test_damaged_file_refused,
             test_damaged_index_refused, test_damaged_header_named,
             test_migrate_and_reopen, test_jobs_generations_steps, test_events_filter_and_order, test_rollback_leaves_nothing,
             test_garbage_file_refused, test_newer_schema_refused, test_readonly_file_fails_cleanly)
