/*
 * test_worker_store.c: the worker's replica store (worker/store.c), its
 * holdings (worker/holdings.c) and the fetch side (worker/replicas.c), in
 * one process: a real store on a loopback port, files and symbolic links
 * laid out here. What a store may answer about a file it cannot open,
 * that a symbolic link never leads a write or a deletion out of the root,
 * that a deletion that left files says so, that names from the
 * coordinator are checked, that a long destination path never makes
 * the temporary name the final one, and that a fetch tries a holder the
 * coordinator doubts last, with a short connection deadline.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "comm.h"
#include "holdings.h"
#include "replicas.h"
#include "store.h"
#include "zt_common.h"
#include "zt_test.h"

#define SESSION "test-session"

static char g_dir[600];   /* this run's scratch directory */
static char g_root[700];  /* the store's checkpoint root */
static char g_other[700]; /* outside the root */
static zt_store_t *g_store;

/* What the store's callbacks saw and answer. */
static int g_stored_calls, g_stored_fail;

/* replicas.c reports fetched copies through the control link: not here. */
int zt_ctl_report_replica(zt_ctl_t *c, uint64_t job_id, const char *dir, const char *name,
                          uint64_t bytes, const char *checksum) {
  (void)c, (void)job_id, (void)dir, (void)name, (void)bytes, (void)checksum;
  return 0;
}

static void session_cb(void *user, char *buf, size_t n) {
  (void)user;
  snprintf(buf, n, "%s", SESSION);
}

static int stored_cb(void *user, uint64_t job, const char *dir, const zt_ckpt_file_t *f) {
  (void)user, (void)job, (void)dir, (void)f;
  g_stored_calls++;
  return g_stored_fail ? zt_errk(ZT_E_UNAVAILABLE, "coordinator unreachable (test)") : 0;
}

static void path_of(char *out, size_t n, const char *a, const char *b) {
  snprintf(out, n, "%s/%s", a, b);
}

static int write_file(const char *path, const void *data, size_t len) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return -1;
  int rc = zt_write_all(fd, data, len);
  close(fd);
  return rc;
}

static zt_ckpt_file_t file_of(const char *name, const void *data, size_t len) {
  zt_ckpt_file_t f;
  memset(&f, 0, sizeof f);
  snprintf(f.name, sizeof f.name, "%s", name);
  f.bytes = len;
  snprintf(f.checksum, sizeof f.checksum, "xxh64:%016llx",
           (unsigned long long)XXH64(data, len, 0));
  return f;
}

static void make_ticket(const char *op, uint64_t job, uint64_t gen, const char *scope,
                        char *out) {
  zt_ticket_t t;
  memset(&t, 0, sizeof t);
  snprintf(t.op, sizeof t.op, "%s", op);
  t.job = job, t.gen = gen, t.requester = 99;
  t.expiry_ms = zt_wall_ms() + 60000;
  snprintf(t.scope, sizeof t.scope, "%s", scope);
  if (zt_ticket_make(SESSION, &t, out, ZT_TICKET_MAX) != 0) abort();
}

static int exists(const char *path) {
  struct stat st;
  return lstat(path, &st) == 0;
}

static void setup(void) {
  if (g_store) return;
  snprintf(g_dir, sizeof g_dir, "%s", zt_test_tmpdir("worker_store"));
  path_of(g_root, sizeof g_root, g_dir, "root");
  path_of(g_other, sizeof g_other, g_dir, "other");
  if (zt_mkdirs(g_root) != 0 || zt_mkdirs(g_other) != 0) abort();
  zt_store_opts_t o = {.host = "127.0.0.1", .ckpt_root = g_root, .session = session_cb,
                       .stored = stored_cb};
  if (zt_store_start(&o, &g_store) != 0) {
    fprintf(stderr, "store: %s\n", zt_err_msg());
    abort();
  }
}

/* A GET answers "no copy" only for a file that is not there (or not a
 * regular file, or of another size); it never blocks on a FIFO and never
 * serves through a symbolic link. */
ZT_TEST(test_get_answers_about_the_file) {
  setup();
  const char *ep = "g/job_1/step_00000001-g1";
  char dir[900], path[1000], out[1000], tk[ZT_TICKET_MAX], outside[1000];
  path_of(dir, sizeof dir, g_root, ep);
  ZT_REQUIRE(zt_mkdirs(dir) == 0);
  make_ticket("get", 1, 1, ep, tk);

  /* A FIFO in the file's place: no copy, at once. */
  path_of(path, sizeof path, dir, "rank_0.bin");
  ZT_REQUIRE(mkfifo(path, 0644) == 0);
  zt_ckpt_file_t f = file_of("rank_0.bin", "", 0);
  path_of(out, sizeof out, g_dir, "got0.bin");
  int64_t t0 = zt_now_ms();
  int rc = zt_store_get(zt_store_addr(g_store), tk, ep, out, &f, 0, 3000);
  zt_errkind_t k = zt_err_kind();
  fprintf(stderr, "  fifo: %s\n", zt_err_msg());
  ZT_CHECK(rc == -1 && k == ZT_E_NOT_FOUND);
  ZT_CHECK(zt_now_ms() - t0 < 2000);
  /* Before the fix the handler blocked in open(): let it go. */
  int w = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (w >= 0) close(w);

  /* A symbolic link in the file's place, to a good file outside the root:
   * refused (it says nothing about the file), never served. */
  char data[100];
  memset(data, 'd', sizeof data);
  path_of(outside, sizeof outside, g_other, "outside.bin");
  ZT_REQUIRE(write_file(outside, data, sizeof data) == 0);
  path_of(path, sizeof path, dir, "rank_1.bin");
  ZT_REQUIRE(symlink(outside, path) == 0);
  f = file_of("rank_1.bin", data, sizeof data);
  path_of(out, sizeof out, g_dir, "got1.bin");
  rc = zt_store_get(zt_store_addr(g_store), tk, ep, out, &f, 0, 3000);
  k = zt_err_kind();
  fprintf(stderr, "  link: %s\n", zt_err_msg());
  ZT_CHECK(rc == -1 && k == ZT_E_UNAVAILABLE);
  ZT_CHECK(!exists(out));

  /* A directory in its place, asked for at the directory's size: no copy,
   * before any byte is sent. */
  path_of(path, sizeof path, dir, "rank_2.bin");
  ZT_REQUIRE(mkdir(path, 0755) == 0);
  struct stat st;
  ZT_REQUIRE(stat(path, &st) == 0);
  f = file_of("rank_2.bin", "", 0);
  f.bytes = (uint64_t)st.st_size;
  path_of(out, sizeof out, g_dir, "got2.bin");
  rc = zt_store_get(zt_store_addr(g_store), tk, ep, out, &f, 0, 3000);
  k = zt_err_kind();
  fprintf(stderr, "  directory: %s\n", zt_err_msg());
  ZT_CHECK(rc == -1 && k == ZT_E_NOT_FOUND);

  /* Not there at all: no copy. */
  f = file_of("rank_3.bin", data, sizeof data);
  rc = zt_store_get(zt_store_addr(g_store), tk, ep, out, &f, 0, 3000);
  ZT_CHECK(rc == -1 && zt_err_kind() == ZT_E_NOT_FOUND);
}

/* A symbolic link in the middle of the epoch path: the PUT is refused,
 * naming the problem, and nothing is written where the link points. */
ZT_TEST(test_put_never_follows_a_link_out_of_the_root) {
  setup();
  char link[900], elsewhere[900], path[1200], src[1000], tk[ZT_TICKET_MAX];
  path_of(elsewhere, sizeof elsewhere, g_other, "elsewhere");
  path_of(link, sizeof link, g_root, "lnk");
  ZT_REQUIRE(zt_mkdirs(elsewhere) == 0);
  ZT_REQUIRE(symlink(elsewhere, link) == 0);
  char data[300];
  memset(data, 'p', sizeof data);
  path_of(src, sizeof src, g_dir, "src.bin");
  ZT_REQUIRE(write_file(src, data, sizeof data) == 0);
  zt_ckpt_file_t f = file_of("rank_0.bin", data, sizeof data);
  make_ticket("put", 5, 2, "r0", tk);
  int rc = zt_store_put(zt_store_addr(g_store), tk, "lnk/job_5/step_00000010-g2", src, &f, 3000);
  fprintf(stderr, "  put: %s\n", zt_err_msg());
  ZT_CHECK(rc == -1 && zt_err_kind() == ZT_E_UNAVAILABLE);
  ZT_CHECK(strstr(zt_err_msg(), "outside the checkpoint root") != NULL);
  snprintf(path, sizeof path, "%s/job_5/step_00000010-g2/rank_0.bin", elsewhere);
  ZT_CHECK(!exists(path));
}

/* A deletion never follows a link in the middle of the path out of the
 * root; an epoch directory that is itself a link loses only the link. */
ZT_TEST(test_delete_never_follows_a_link_out_of_the_root) {
  setup();
  char victim[900], link[900], file[1200];
  path_of(victim, sizeof victim, g_other, "victim/step_00000001-g1");
  ZT_REQUIRE(zt_mkdirs(victim) == 0);
  path_of(file, sizeof file, victim, "rank_0.bin");
  ZT_REQUIRE(write_file(file, "x", 1) == 0);
  path_of(link, sizeof link, g_root, "d");
  ZT_REQUIRE(zt_mkdirs(link) == 0);
  path_of(link, sizeof link, g_root, "d/job_7");
  char target[900];
  path_of(target, sizeof target, g_other, "victim");
  ZT_REQUIRE(symlink(target, link) == 0);
  int rc = zt_hold_delete(g_root, "d/job_7/step_00000001-g1");
  fprintf(stderr, "  delete: %s\n", rc ? zt_err_msg() : "(none)");
  ZT_CHECK(rc == -1 && strstr(zt_err_msg(), "outside the checkpoint root") != NULL);
  ZT_CHECK(exists(file));

  /* The epoch directory itself a link: the link goes, its target stays. */
  path_of(link, sizeof link, g_root, "e/job_8");
  ZT_REQUIRE(zt_mkdirs(link) == 0);
  path_of(link, sizeof link, g_root, "e/job_8/step_00000001-g1");
  ZT_REQUIRE(symlink(victim, link) == 0);
  ZT_CHECK(zt_hold_delete(g_root, "e/job_8/step_00000001-g1") == 0);
  ZT_CHECK(!exists(link));
  ZT_CHECK(exists(file));
  /* Deleting what is not there succeeds. */
  ZT_CHECK(zt_hold_delete(g_root, "e/job_8/step_00000002-g1") == 0);
}

/* A deletion that leaves the directory in place fails with the reason:
 * here the walk runs out of file descriptors (root ignores permissions). */
ZT_TEST(test_delete_that_leaves_files_fails) {
  setup();
  char dir[900], file[1000];
  path_of(dir, sizeof dir, g_root, "f/job_9/step_00000001-g1");
  ZT_REQUIRE(zt_mkdirs(dir) == 0);
  path_of(file, sizeof file, dir, "rank_0.bin");
  ZT_REQUIRE(write_file(file, "x", 1) == 0);
  static zt_test_fds_t fds;
  ZT_REQUIRE(zt_test_fds_use(&fds, 256) == 0);
  int rc = zt_hold_delete(g_root, "f/job_9/step_00000001-g1");
  char why[1024];
  snprintf(why, sizeof why, "%s", rc ? zt_err_msg() : "(none)");
  ZT_REQUIRE(zt_test_fds_back(&fds) == 0);
  fprintf(stderr, "  delete: %s\n", why);
  ZT_CHECK(rc == -1 && strstr(why, "not deleted") != NULL);
  ZT_CHECK(exists(file));
  /* With descriptors again it goes. */
  ZT_CHECK(zt_hold_delete(g_root, "f/job_9/step_00000001-g1") == 0);
  ZT_CHECK(!exists(dir));
}

/* A record or a directory from the coordinator that is not a checkpoint
 * name is refused before any file is touched, even where a file of that
 * name happens to verify. */
ZT_TEST(test_fetch_checks_the_coordinators_names) {
  setup();
  char dir[900], path[1000];
  char data[64];
  memset(data, 'f', sizeof data);
  path_of(path, sizeof path, g_root, "x.bin");
  ZT_REQUIRE(write_file(path, data, sizeof data) == 0);
  path_of(dir, sizeof dir, g_root, "ck/job_1/step_00000001-g1");
  ZT_REQUIRE(zt_mkdirs(dir) == 0);
  Ztrain__RendezvousReply rv = ZTRAIN__RENDEZVOUS_REPLY__INIT;
  rv.job_id = 1;
  zt_ckpt_file_t f = file_of("../../../x.bin", data, sizeof data);
  zt_ckpt_record_t rec = {&f, 1};
  zt_fetch_fail_t why = 0;
  int rc = zt_replicas_fetch(NULL, g_root, dir, &rec, &rv, &why);
  fprintf(stderr, "  name: %s\n", rc ? zt_err_msg() : "(none)");
  ZT_CHECK(rc == -1 && strstr(zt_err_msg(), "not a checkpoint file") != NULL);
  ZT_CHECK(why != ZT_FETCH_CORRUPT);

  /* A directory that is not an epoch. */
  path_of(dir, sizeof dir, g_root, "plain");
  ZT_REQUIRE(zt_mkdirs(dir) == 0);
  path_of(path, sizeof path, dir, "rank_0.bin");
  ZT_REQUIRE(write_file(path, data, sizeof data) == 0);
  f = file_of("rank_0.bin", data, sizeof data);
  why = 0;
  rc = zt_replicas_fetch(NULL, g_root, dir, &rec, &rv, &why);
  fprintf(stderr, "  dir: %s\n", rc ? zt_err_msg() : "(none)");
  ZT_CHECK(rc == -1 && strstr(zt_err_msg(), "not an epoch") != NULL);
  ZT_CHECK(why != ZT_FETCH_CORRUPT);
}

/* A file missing here whose holders the coordinator did not name (its
 * reply lists no copies): nothing was seen to be bad, so the epoch is
 * unavailable, not corrupt (which would retire it for good). A copy here
 * that fails its check, with nobody else to ask, is corrupt. */
ZT_TEST(test_fetch_without_holders_keeps_the_epoch) {
  setup();
  char dir[900], path[1000], data[64];
  memset(data, 'h', sizeof data);
  path_of(dir, sizeof dir, g_root, "ck/job_3/step_00000004-g1");
  ZT_REQUIRE(zt_mkdirs(dir) == 0);
  Ztrain__RendezvousReply rv = ZTRAIN__RENDEZVOUS_REPLY__INIT;
  rv.job_id = 3;
  zt_ckpt_file_t f = file_of("rank_0.bin", data, sizeof data);
  zt_ckpt_record_t rec = {&f, 1};
  zt_fetch_fail_t why = 0;
  ZT_CHECK(zt_replicas_fetch(NULL, g_root, dir, &rec, &rv, &why) == -1);
  fprintf(stderr, "  missing: %s\n", zt_err_msg());
  ZT_CHECK(why == ZT_FETCH_UNAVAILABLE);
  path_of(path, sizeof path, dir, "rank_0.bin");
  data[0] = 'X'; /* a copy here with other bytes than recorded */
  ZT_REQUIRE(write_file(path, data, sizeof data) == 0);
  why = 0;
  ZT_CHECK(zt_replicas_fetch(NULL, g_root, dir, &rec, &rv, &why) == -1);
  fprintf(stderr, "  bad copy: %s\n", zt_err_msg());
  ZT_CHECK(why == ZT_FETCH_CORRUPT);
}

/* A destination path as long as the temporary name's buffer used to be:
 * the temporary name is never the final one, so a copy that fails its
 * checksum leaves the file already there alone. */
ZT_TEST(test_get_to_a_long_path_keeps_the_temporary_apart) {
  setup();
  const char *ep = "l/job_2/step_00000001-g1";
  char sdir[900], spath[1000], tk[ZT_TICKET_MAX];
  path_of(sdir, sizeof sdir, g_root, ep);
  ZT_REQUIRE(zt_mkdirs(sdir) == 0);
  char served[100], old[100];
  memset(served, 's', sizeof served);
  memset(old, 'o', sizeof old);
  path_of(spath, sizeof spath, sdir, "rank_0.bin");
  ZT_REQUIRE(write_file(spath, served, sizeof served) == 0);
  /* dir + "/rank_0.bin" is 1199 bytes. */
  char dir[1300], path[1300];
  snprintf(dir, sizeof dir, "%s/long", g_dir);
  while (strlen(dir) < 1188) {
    size_t l = strlen(dir), c = ZT_MIN(1188 - l - 1, 200);
    dir[l] = '/';
    memset(dir + l + 1, 'a', c);
    dir[l + 1 + c] = 0;
  }
  ZT_REQUIRE(strlen(dir) == 1188 && dir[1187] != '/');
  ZT_REQUIRE(zt_mkdirs(dir) == 0);
  path_of(path, sizeof path, dir, "rank_0.bin");
  ZT_REQUIRE(strlen(path) == 1199);
  ZT_REQUIRE(write_file(path, old, sizeof old) == 0);
  make_ticket("get", 2, 1, ep, tk);
  /* The record's checksum is not that of the bytes the store sends. */
  zt_ckpt_file_t f = file_of("rank_0.bin", old, sizeof old);
  int rc = zt_store_get(zt_store_addr(g_store), tk, ep, path, &f, 0, 3000);
  fprintf(stderr, "  get: %s\n", rc ? zt_err_msg() : "(none)");
  ZT_CHECK(rc == -1);
  char buf[200];
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  ZT_CHECK(fd >= 0);
  if (fd >= 0) {
    ssize_t n = read(fd, buf, sizeof buf);
    ZT_CHECK(n == (ssize_t)sizeof old && memcmp(buf, old, sizeof old) == 0);
    close(fd);
  }
  /* The right checksum: fetched into place. */
  f = file_of("rank_0.bin", served, sizeof served);
  ZT_CHECK(zt_store_get(zt_store_addr(g_store), tk, ep, path, &f, 0, 3000) == 0);
  ZT_CHECK(zt_ckpt_verify_file(path, f.bytes, f.checksum) == 0);
}

/* A copy the store cannot report is refused to the pusher, who then tries
 * its next target; one it reported is stored. */
ZT_TEST(test_put_that_cannot_be_reported_is_refused) {
  setup();
  const char *ep = "r/job_3/step_00000001-g4";
  char src[1000], tk[ZT_TICKET_MAX], path[1200];
  char data[200];
  memset(data, 'r', sizeof data);
  path_of(src, sizeof src, g_dir, "src3.bin");
  ZT_REQUIRE(write_file(src, data, sizeof data) == 0);
  zt_ckpt_file_t f = file_of("rank_0.bin", data, sizeof data);
  make_ticket("put", 3, 4, "r0", tk);
  g_stored_calls = 0, g_stored_fail = 1;
  int rc = zt_store_put(zt_store_addr(g_store), tk, ep, src, &f, 3000);
  fprintf(stderr, "  put: %s\n", rc ? zt_err_msg() : "(none)");
  ZT_CHECK(rc == -1 && zt_err_kind() == ZT_E_UNAVAILABLE);
  ZT_CHECK(strstr(zt_err_msg(), "coordinator unreachable (test)") != NULL);
  ZT_CHECK(g_stored_calls == 1);
  g_stored_fail = 0;
  ZT_CHECK(zt_store_put(zt_store_addr(g_store), tk, ep, src, &f, 3000) == 0);
  ZT_CHECK(g_stored_calls == 2);
  snprintf(path, sizeof path, "%s/%s/rank_0.bin", g_root, ep);
  ZT_CHECK(zt_ckpt_verify_file(path, f.bytes, f.checksum) == 0);
}

/* A holder that never answers a connection, like a store across a one-way
 * cut (its answers are lost): a listening socket with a backlog of zero
 * whose queue one connection fills, so that the kernel drops every further
 * connection request. Its address goes to addr; *lfd and *filler are to be
 * closed after the test. */
static void silent_store(char *addr, size_t n, int *lfd, int *filler) {
  int port = 0;
  ZT_REQUIRE(zt_comm_tcp_listen("127.0.0.1", &port, lfd) == 0);
  ZT_REQUIRE(listen(*lfd, 0) == 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  *filler = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ZT_REQUIRE(*filler >= 0 && connect(*filler, (struct sockaddr *)&sa, sizeof sa) == 0);
  snprintf(addr, n, "127.0.0.1:%d", port);
}

/* An epoch of nfiles files laid out in the store's root at ep; their
 * records go to f. */
static void served_epoch(const char *ep, zt_ckpt_file_t *f, int nfiles) {
  static const char *names[] = {"rank_0.bin", "rank_0.json", "rank_1.bin", "rank_1.json",
                                "manifest.json"};
  char dir[900], path[1000], data[300];
  path_of(dir, sizeof dir, g_root, ep);
  ZT_REQUIRE(zt_mkdirs(dir) == 0);
  for (int i = 0; i < nfiles; i++) {
    memset(data, 'a' + i, sizeof data);
    path_of(path, sizeof path, dir, names[i]);
    ZT_REQUIRE(write_file(path, data, sizeof data) == 0);
    f[i] = file_of(names[i], data, sizeof data);
  }
}

/* The holders of a file as a rendezvous reply lists them. */
typedef struct {
  Ztrain__ReplicaTarget t[2], *tp[2];
  Ztrain__FileCopies fc;
} holders_t;

static void holders_of(holders_t *h, const char *name, const char *const *addrs,
                       const int *doubtful, int n, const char *ticket) {
  ztrain__file_copies__init(&h->fc);
  h->fc.name = (char *)name;
  for (int i = 0; i < n; i++) {
    ztrain__replica_target__init(&h->t[i]);
    h->t[i].addr = (char *)addrs[i];
    h->t[i].host = "h";
    h->t[i].ticket = (char *)ticket;
    h->t[i].doubtful = doubtful[i];
    h->tp[i] = &h->t[i];
  }
  h->fc.n_holders = (size_t)n;
  h->fc.holders = h->tp;
}

/* A holder the coordinator marks doubtful is tried after the sound ones,
 * although it comes first: no file waits for a store whose answers are
 * lost. With no other holder it is tried, with a short connection
 * deadline, and the epoch is only unavailable. */
ZT_TEST(test_fetch_tries_doubtful_holders_last) {
  setup();
  const char *ep = "d/job_4/step_00000001-g1";
  char silent[64], tk[ZT_TICKET_MAX], froot[1000], fdir[1100], path[1700];
  int lfd = -1, filler = -1;
  silent_store(silent, sizeof silent, &lfd, &filler);
  make_ticket("get", 4, 1, ep, tk);
  zt_ckpt_file_t f[5];
  served_epoch(ep, f, 5);
  path_of(froot, sizeof froot, g_dir, "fetcher");
  path_of(fdir, sizeof fdir, froot, ep);
  const char *addrs[2] = {silent, zt_store_addr(g_store)};
  const int doubtful[2] = {1, 0};
  holders_t h[5];
  Ztrain__FileCopies *fcp[5];
  for (int i = 0; i < 5; i++) {
    holders_of(&h[i], f[i].name, addrs, doubtful, 2, tk);
    fcp[i] = &h[i].fc;
  }
  Ztrain__RendezvousReply rv = ZTRAIN__RENDEZVOUS_REPLY__INIT;
  rv.job_id = 4;
  rv.n_checkpoint_copies = 5;
  rv.checkpoint_copies = fcp;
  zt_ckpt_record_t rec = {f, 5};
  zt_fetch_fail_t why = 0;
  int64_t t0 = zt_now_ms();
  int rc = zt_replicas_fetch(NULL, froot, fdir, &rec, &rv, &why);
  int64_t ms = zt_now_ms() - t0;
  fprintf(stderr, "  five files, the silent holder first: %s in %lld ms\n",
          rc ? zt_err_msg() : "fetched", (long long)ms);
  ZT_CHECK(rc == 0);
  ZT_CHECK(ms < 900); /* a connection to the silent store waits at least 1 s */
  for (int i = 0; i < 5; i++) {
    path_of(path, sizeof path, fdir, f[i].name);
    ZT_CHECK(zt_ckpt_verify_file(path, f[i].bytes, f[i].checksum) == 0);
  }

  /* The doubtful holder alone: tried, within the short deadline. */
  path_of(path, sizeof path, fdir, f[0].name);
  ZT_REQUIRE(unlink(path) == 0);
  holders_of(&h[0], f[0].name, addrs, doubtful, 1, tk);
  why = 0;
  t0 = zt_now_ms();
  rc = zt_replicas_fetch(NULL, froot, fdir, &rec, &rv, &why);
  ms = zt_now_ms() - t0;
  fprintf(stderr, "  the silent holder alone: %s in %lld ms\n", rc ? zt_err_msg() : "fetched",
          (long long)ms);
  ZT_CHECK(rc == -1 && why == ZT_FETCH_UNAVAILABLE);
  ZT_CHECK(ms >= 900 && ms < 3000); /* not the 5 s a sound holder gets */
  close(filler);
  close(lfd);
}

ZT_TEST(test_stop) {
  if (g_store) ZT_CHECK(zt_store_stop(g_store) == 0);
  g_store = NULL;
}

ZT_TEST_MAIN(test_get_answers_about_the_file, test_put_never_follows_a_link_out_of_the_root,
             test_delete_never_follows_a_link_out_of_the_root, test_delete_that_leaves_files_fails,
             test_fetch_checks_the_coordinators_names, test_fetch_without_holders_keeps_the_epoch,
             test_get_to_a_long_path_keeps_the_temporary_apart,
             test_put_that_cannot_be_reported_is_refused, test_fetch_tries_doubtful_holders_last,
             test_stop)
