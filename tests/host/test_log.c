/* test_log.c -- unit tests of host/log.c: level names, the threshold, and the line format
 * (UTC timestamp, level, message) on stderr. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "precondd.h"

static void test_levels(void **state) {
  (void)state;
  pd_log_level l;
  assert_int_equal(pd_log_parse_level("debug", &l), 0);
  assert_int_equal(l, PD_LOG_DEBUG);
  assert_int_equal(pd_log_parse_level("error", &l), 0);
  assert_int_equal(l, PD_LOG_ERROR);
  assert_int_equal(pd_log_parse_level("verbose", &l), -1);
  assert_int_equal(pd_log_parse_level(NULL, &l), -1);
}

static void test_format_and_threshold(void **state) {
  (void)state;
  char path[] = "/tmp/pd-log-XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  fflush(stderr);
  int saved = dup(2);
  dup2(fd, 2);
  pd_log_set_level(PD_LOG_WARN);
  pd_log(PD_LOG_INFO, "hidden %d", 1);
  pd_log(PD_LOG_WARN, "shown %d", 2);
  pd_log(PD_LOG_ERROR, "%s", "also shown");
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  FILE *f = fdopen(fd, "r");
  rewind(f);
  char line[256];
  assert_non_null(fgets(line, sizeof line, f));
  /* 2026-11-29T21:00:00.123Z WARN  precondd: shown 2 */
  assert_int_equal(strlen(line) > 25, 1);
  assert_int_equal(line[4], '-');
  assert_int_equal(line[10], 'T');
  assert_int_equal(line[23], 'Z');
  assert_non_null(strstr(line, " WARN "));
  assert_non_null(strstr(line, "precondd: shown 2\n"));
  assert_non_null(fgets(line, sizeof line, f));
  assert_non_null(strstr(line, " ERROR precondd: also shown"));
  assert_null(fgets(line, sizeof line, f));
  fclose(f);
  unlink(path);
  pd_log_set_level(PD_LOG_INFO);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_levels),
      cmocka_unit_test(test_format_and_threshold),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
