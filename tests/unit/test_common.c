/*
 * test_common.c: common/ helpers: errors, deadlines, whole-file reads and
 * mkdir -p (sockets and host:port: test_net.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "zt_common.h"
#include "zt_test.h"

ZT_TEST(test_errors_wrap) {
  ZT_CHECK(zt_err("inner %d", 5) == -1);
  ZT_CHECK(zt_err_wrap("outer %s", "x") == -1);
  ZT_CHECK_STR(zt_err_msg(), "outer x: inner 5");
  /* Very long messages are cut, never overflow. */
  char big[3000];
  memset(big, 'a', sizeof big - 1);
  big[sizeof big - 1] = 0;
  zt_err("%s", big);
  zt_err_wrap("%s", big);
  ZT_CHECK(strlen(zt_err_msg()) < ZT_ERR_MAX);
}

ZT_TEST(test_deadlines) {
  ZT_CHECK(zt_deadline_in(0) == 0);
  ZT_CHECK(!zt_deadline_passed(0));
  ZT_CHECK(zt_deadline_left_ms(0) == INT64_MAX);
  zt_deadline_t d = zt_deadline_in(50);
  ZT_CHECK(zt_deadline_left_ms(d) > 0 && zt_deadline_left_ms(d) <= 50);
  zt_deadline_t past = zt_now_ms() - 1;
  ZT_CHECK(zt_deadline_passed(past) && zt_deadline_left_ms(past) == 0);
}

ZT_TEST(test_files) {
  const char *dir = zt_test_tmpdir("files");
  char deep[600], file[700];
  snprintf(deep, sizeof deep, "%s/a/b/c", dir);
  ZT_CHECK(zt_mkdirs(deep) == 0);
  ZT_CHECK(zt_mkdirs(deep) == 0); /* idempotent */
  struct stat st;
  ZT_CHECK(stat(deep, &st) == 0 && S_ISDIR(st.st_mode));
  snprintf(file, sizeof file, "%s/f.txt", deep);
  FILE *f = fopen(file, "w");
  ZT_REQUIRE(f);
  fputs("hello", f);
  fclose(f);
  char *buf;
  size_t len;
  ZT_CHECK(zt_read_file(file, &buf, &len, 100) == 0 && len == 5 && !strcmp(buf, "hello"));
  free(buf);
  ZT_CHECK(zt_read_file(file, &buf, &len, 3) != 0); /* over the limit */
  ZT_CHECK(strstr(zt_err_msg(), file) != NULL);
  ZT_CHECK(zt_read_file("/nonexistent/zt", &buf, &len, 100) != 0);
}

ZT_TEST(test_path_confine) {
  char out[256];
  ZT_CHECK(zt_path_confine("/srv/data", "corpus/train_*.bin", "data.train", out, sizeof out) == 0);
  ZT_CHECK_STR(out, "/srv/data/corpus/train_*.bin");
  ZT_CHECK(zt_path_confine("/srv/data/", "./a//b/./c", "x", out, sizeof out) == 0);
  ZT_CHECK_STR(out, "/srv/data/a/b/c");
  ZT_CHECK_STR(zt_path_under("/srv/data", "/srv/data/a/b"), "a/b");
  ZT_CHECK_STR(zt_path_under("/srv/data/", "/srv/data"), "");
  ZT_CHECK(zt_path_under("/srv/data", "/srv/database/x") == NULL);
  ZT_CHECK_STR(zt_path_under("/", "/etc"), "etc");
  ZT_CHECK(zt_path_confine("/srv/data", "/srv/data/x.bin", "x", out, sizeof out) == 0);
  ZT_CHECK_STR(out, "/srv/data/x.bin");
  ZT_CHECK(zt_path_confine("/srv/data", "/srv/data", "x", out, sizeof out) == 0);
  ZT_CHECK(zt_path_confine("/", "/etc/ztrain", "x", out, sizeof out) == 0);
  /* Outside the root, by name or by "..", or a prefix that is not a directory. */
  const char *bad[] = {"/", "/etc/passwd", "/srv/database", "../x", "a/../../x", "a/..", ""};
  for (size_t i = 0; i < ZT_ARRAY_LEN(bad); i++) {
    ZT_CHECK(zt_path_confine("/srv/data", bad[i], "checkpoint.dir", out, sizeof out) == -1);
    ZT_CHECK(strncmp(zt_err_msg(), "checkpoint.dir: ", 16) == 0);
    ZT_CHECK(zt_err_kind() == ZT_E_INVALID);
  }
  ZT_CHECK(zt_path_confine("relative", "x", "x", out, sizeof out) == -1);
  char tiny[8];
  ZT_CHECK(zt_path_confine("/srv", "long/name", "x", tiny, sizeof tiny) == -1);
  /* Symbolic links: the lexical check passes, the real one does not. */
  const char *dir = zt_test_tmpdir("paths");
  char inside[600], link[600];
  snprintf(inside, sizeof inside, "%s/inside", dir);
  snprintf(link, sizeof link, "%s/escape", dir);
  ZT_REQUIRE(zt_mkdirs(inside) == 0);
  unlink(link);
  ZT_REQUIRE(symlink("/etc", link) == 0);
  ZT_CHECK(zt_path_real_under(dir, inside) == 1);
  ZT_CHECK(zt_path_confine(dir, "escape/passwd", "x", out, sizeof out) == 0);
  ZT_CHECK(zt_path_real_under(dir, out) == 0);
}

ZT_TEST(test_printable_and_numbers) {
  char buf[64];
  ZT_CHECK_STR(zt_printable("plain name", buf, sizeof buf), "plain name");
  ZT_CHECK_STR(zt_printable("a\x1b[31mred\x07\n", buf, sizeof buf), "a\\x1b[31mred\\x07\\x0a");
  ZT_CHECK_STR(zt_printable("caf\xc3\xa9 \xff", buf, sizeof buf), "caf\xc3\xa9 \\xff");
  /* Overlong forms, surrogates and code points past U+10FFFF are escaped. */
  ZT_CHECK_STR(zt_printable("\xc0\xaf\xe0\x80\xaf\xed\xa0\x80\xf4\x90\x80\x80", buf, sizeof buf),
               "\\xc0\\xaf\\xe0\\x80\\xaf\\xed\\xa0\\x80\\xf4\\x90\\x80\\x80");
  ZT_CHECK_STR(zt_printable("\xe2\x82\xac\xf0\x9f\x98\x80\xf4\x8f\xbf\xbf", buf, sizeof buf),
               "\xe2\x82\xac\xf0\x9f\x98\x80\xf4\x8f\xbf\xbf");
  ZT_CHECK(zt_text_valid("gpu-host-7 caf\xc3\xa9 \xe2\x82\xac"));
  ZT_CHECK(zt_text_valid(""));
  ZT_CHECK(!zt_text_valid("h\xff"));
  ZT_CHECK(!zt_text_valid("h\xed\xa0\x80"));
  ZT_CHECK(!zt_text_valid("h\xc3"));
  ZT_CHECK(!zt_text_valid("tab\there"));
  ZT_CHECK(!zt_text_valid("del\x7f"));
  char tiny[8];
  zt_printable("\x01\x02\x03\x04", tiny, sizeof tiny); /* cut, never overflowed */
  ZT_CHECK(strlen(tiny) < sizeof tiny);
  int64_t v;
  ZT_CHECK(zt_parse_i64("--to-step", "42", 0, 100, &v) == 0 && v == 42);
  ZT_CHECK(zt_parse_i64("--to-step", "101", 0, 100, &v) == -1);
  ZT_CHECK(strstr(zt_err_msg(), "--to-step") != NULL);
  ZT_CHECK(zt_parse_i64("x", "99999999999999999999", 0, INT64_MAX, &v) == -1);
  ZT_CHECK(zt_parse_i64("x", "12abc", 0, 100, &v) == -1 && zt_parse_i64("x", "", 0, 1, &v) == -1);
}

ZT_TEST(test_text_shape) {
  char a[128], b[128];
  ZT_CHECK_STR(zt_text_shape("generation 7 rank 1: connect 127.0.0.1:4567 at step 40", a, sizeof a),
               "generation # rank #: connect #:# at step #");
  ZT_CHECK_STR(zt_text_shape("step_10-g2 on w12, x1.5", a, sizeof a), "step_#-g# on w#, x#");
  ZT_CHECK_STR(zt_text_shape("no numbers", a, sizeof a), "no numbers");
  zt_text_shape("token 300 at 12 >= vocab_size 257", a, sizeof a);
  zt_text_shape("token 301 at 99 >= vocab_size 257", b, sizeof b);
  ZT_CHECK_STR(a, b);
  char tiny[4];
  ZT_CHECK(strlen(zt_text_shape("abcdefgh", tiny, sizeof tiny)) == 3);
}

/* Epoch names cross the wire: only the form zt_epoch_name writes, digits
 * only, as deep as the holdings scan looks, is taken. */
ZT_TEST(test_epoch_names) {
  char name[ZT_EPOCH_NAME_MAX];
  zt_epoch_t e;
  zt_epoch_name(name, sizeof name, 5, 10, 2);
  ZT_CHECK_STR(name, "job_5/step_00000010-g2");
  ZT_REQUIRE(zt_epoch_parse("st/job_5/step_00000010-g2", &e) == 0);
  ZT_CHECK(e.job == 5 && e.step == 10 && e.gen == 2 && e.dir_len == 2);
  ZT_REQUIRE(zt_epoch_parse("job_0/step_123456789-g0", &e) == 0);
  ZT_CHECK(e.step == 123456789 && e.dir_len == 0);
  ZT_CHECK(zt_epoch_parse("a/b/c/d/e/f/job_1/step_00000001-g1", &e) == 0);
  static const char *const bad[] = {
      "st/job_+5/step_00000010-g2", "st/job_ 5/step_00000010-g2", "st/job_05/step_00000010-g2",
      "st/job_5/step_-0000010-g2",  "st/job_5/step_10-g2",         "st/job_5/step_00000010-g+2",
      "st/job_5/step_00000010-g2x", "st/job_5/step_00000010-g2/",  "st//job_5/step_00000010-g2",
      "./job_5/step_00000010-g2",   ".h/job_5/step_00000010-g2",   "/job_5/step_00000010-g2",
      "step_00000010-g2",           "",                            "job_5/x/step_00000010-g2",
      "a/b/c/d/e/f/g/job_1/step_00000001-g1",
      "job_99999999999999999999/step_00000001-g1"};
  for (size_t i = 0; i < ZT_ARRAY_LEN(bad); i++) {
    ZT_CHECK(zt_epoch_parse(bad[i], &e) == -1);
    ZT_CHECK(zt_err_kind() == ZT_E_INVALID);
  }
  int r;
  ZT_CHECK(zt_epoch_file("rank_12.bin", &r) == 1 && r == 12);
  ZT_CHECK(zt_epoch_file("rank_0.json", &r) == 1 && r == 0);
  ZT_CHECK(zt_epoch_file("manifest.json", &r) == 1 && r == -1);
  static const char *const bad_files[] = {"rank_+1.bin", "rank_ 1.bin", "rank_01.bin",
                                          "rank_-1.bin", "rank_1.binx", "rank_.bin",
                                          "rank_1.sh",   "x/rank_1.bin"};
  for (size_t i = 0; i < ZT_ARRAY_LEN(bad_files); i++)
    ZT_CHECK(zt_epoch_file(bad_files[i], &r) == 0);
}

ZT_TEST(test_tickets) {
  zt_ticket_t t = {.op = "get", .job = 3, .gen = 7, .requester = 12, .expiry_ms = 5000,
                   .scope = "ckpt/job_3/step_00000010-g7"};
  char text[ZT_TICKET_MAX], bad[ZT_TICKET_MAX];
  ZT_REQUIRE(zt_ticket_make("holder-session", &t, text, sizeof text) == 0);
  zt_ticket_t got;
  ZT_REQUIRE(zt_ticket_check("holder-session", text, 4000, &got) == 0);
  ZT_CHECK_STR(got.op, "get");
  ZT_CHECK(got.job == 3 && got.gen == 7 && got.requester == 12 && got.expiry_ms == 5000);
  ZT_CHECK_STR(got.scope, "ckpt/job_3/step_00000010-g7");
  ZT_CHECK(zt_ticket_check("other-session", text, 4000, &got) == -1);       /* not ours */
  ZT_CHECK(strstr(zt_err_msg(), "not made for this worker") != NULL);
  ZT_CHECK(zt_ticket_check("holder-session", text, 6000, &got) == -1);      /* expired */
  snprintf(bad, sizeof bad, "%s", text);
  bad[strlen("zt1|get|")] = '4'; /* another job, same MAC */
  ZT_CHECK(zt_ticket_check("holder-session", bad, 4000, &got) == -1);
  ZT_CHECK(zt_ticket_check("holder-session", "zt1|get|x", 0, &got) == -1);
  ZT_CHECK(zt_ticket_check("", text, 0, &got) == -1);
  /* A push ticket has no expiry (0): the clock never voids it (the holder
   * checks its generation instead), and its MAC still does. */
  zt_ticket_t p = {.op = "put", .job = 3, .gen = 7, .requester = 12, .expiry_ms = 0,
                   .scope = "r1"};
  ZT_REQUIRE(zt_ticket_make("holder-session", &p, text, sizeof text) == 0);
  ZT_CHECK(zt_ticket_check("holder-session", text, INT64_MAX / 2, &got) == 0);
  ZT_CHECK(got.expiry_ms == 0 && !strcmp(got.op, "put"));
  ZT_CHECK(zt_ticket_check("other-session", text, 0, &got) == -1);
}

ZT_TEST_MAIN(test_errors_wrap, test_epoch_names, test_deadlines, test_files, test_path_confine,
             test_printable_and_numbers, test_text_shape, test_tickets)
