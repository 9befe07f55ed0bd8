/* test_examples.c -- the examples run as a user runs them, against a real precondd.
 *
 * Arguments: the path of precondd, then the example programs. Each example is started with
 * the daemon's address as its only argument and must exit 0 (for the C trainer: its loss
 * fell by half through roots from the daemon). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "precondd_proc.h"

static const char *precondd_path;
static char **examples;
static int nexamples;

static void test_examples_run(void **state) {
  (void)state;
  pdproc precondd = {0};
  assert_int_equal(pdproc_start_in(&precondd, precondd_path, NULL), 0);
  for (int i = 0; i < nexamples; i++) {
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
      execl(examples[i], examples[i], precondd.addr, (char *)NULL);
      _exit(127);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      pdproc_destroy(&precondd);
      fail_msg("%s exited with status %d", examples[i], WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    }
  }
  pdproc_destroy(&precondd);
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s PRECONDD EXAMPLE...\n", argv[0]);
    return 2;
  }
  precondd_path = argv[1];
  examples = argv + 2;
  nexamples = argc - 2;
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_examples_run)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
