/*
 * test_common.c: common/ helpers: errors, host:port parsing, deadlines,
 * whole-file reads and mkdir -p.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

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

ZT_TEST(test_hostport) {
  char host[64];
  int port;
  ZT_CHECK(zt_parse_hostport("127.0.0.1:7070", host, sizeof host, &port) == 0);
  ZT_CHECK_STR(host, "127.0.0.1");
  ZT_CHECK(port == 7070);
  ZT_CHECK(zt_parse_hostport("[::1]:80", host, sizeof host, &port) == 0 && port == 80);
  const char *bad[] = {"", "nohost", ":80", "h:", "h:0", "h:65536", "h:12x", "h:-1"};
  for (size_t i = 0; i < ZT_ARRAY_LEN(bad); i++) {
    ZT_CHECK(zt_parse_hostport(bad[i], host, sizeof host, &port) != 0);
  }
  char tiny[4];
  ZT_CHECK(zt_parse_hostport("longhost:1", tiny, sizeof tiny, &port) != 0);
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

ZT_TEST_MAIN(test_errors_wrap, test_hostport, test_deadlines, test_files)
