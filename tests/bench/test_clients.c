/* test_clients.c -- smoke tests of the benchmark clients against a real precondd
 * (suite integration).
 *
 * Arguments: PRECONDD TRANSFORMER RESNET COMPARE BUILD_DIR. Starts precondd on a free TCP
 * port with a temporary state directory, then:
 * - trains each client (shrunk to a tiny size) a few steps with SGD, AdamW and Shampoo
 *   (Shampoo with --sync-roots, so every step uses roots the daemon computed from that
 *   step's statistics): the run exits 0, the train loss falls, train.csv has one row per
 *   step and summary.json the figures;
 * - runs bench/compare for both models on a tiny budget and checks its table and plots;
 * - checks that a bad option is refused with a message and exit status 2. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "precondd_proc.h"

static const char *precondd_path, *transformer_path, *resnet_path, *compare_path, *build_dir;
static char kjv_path[192];
static const char *tmpdir; /* the daemon's directory, also the runs' (pdproc_destroy removes it) */
static pdproc precondd;

static char *read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  rewind(f);
  char *b = malloc((size_t)n + 1);
  assert_non_null(b);
  assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
  b[n] = '\0';
  fclose(f);
  return b;
}

/* Runs argv (NULL-terminated) with stdout and stderr into log; returns its exit status. */
static int run(char *const argv[], const char *log) {
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    if (freopen(log, "w", stdout) == NULL) _exit(126);
    dup2(fileno(stdout), STDERR_FILENO);
    execv(argv[0], argv);
    _exit(127);
  }
  int st = 0;
  assert_int_equal(waitpid(pid, &st, 0), pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void show_log(const char *log) {
  char *s = read_file(log);
  if (s != NULL) print_message("--- %s ---\n%s\n", log, s);
  free(s);
}

/* One daemon for the group, in a directory of its own that the runs share. */
static int setup(void **state) {
  (void)state;
  int rc = pdproc_start_in(&precondd, precondd_path, NULL);
  tmpdir = precondd.dir;
  snprintf(kjv_path, sizeof kjv_path, "%s/kjv.txt", tmpdir);
  return rc;
}

static int teardown(void **state) {
  (void)state;
  pdproc_destroy(&precondd);
  return 0;
}

/* Mean of the train_loss column (4th) over data rows [from, to) of a train.csv. */
static double mean_loss(const char *csv, int from, int to) {
  const char *line = strchr(csv, '\n');
  double sum = 0;
  int row = 0, n = 0;
  while (line != NULL && line[1] != '\0') {
    line++;
    if (row >= from && row < to) {
      const char *p = line;
      for (int c = 0; c < 3; c++) p = strchr(p, ',') + 1;
      sum += strtod(p, NULL);
      n++;
    }
    row++;
    line = strchr(line, '\n');
  }
  assert_true(n > 0);
  return sum / n;
}

static int count_lines(const char *s) {
  int n = 0;
  for (; *s; s++) n += *s == '\n';
  return n;
}

/* One tiny run of a client with an optimizer; checks exit, CSV, JSON, falling loss. */
static void smoke(const char *client, const char *opt, const char *lr) {
  int is_lm = strcmp(client, "transformer") == 0;
  char out[160], log[200], steps[] = "16";
  snprintf(out, sizeof out, "%s/%s-%s", tmpdir, client, opt);
  snprintf(log, sizeof log, "%s.log", out);
  char *lm[] = {(char *)transformer_path,
                "--optimizer",
                (char *)opt,
                "--lr",
                (char *)lr,
                "--steps",
                steps,
                "--eval-every",
                "8",
                "--eval-batches",
                "2",
                "--context",
                "16",
                "--d-model",
                "32",
                "--heads",
                "2",
                "--layers",
                "1",
                "--batch",
                "8",
                "--data",
                kjv_path,
                "--daemon",
                precondd.addr,
                "--sync-roots",
                "--out",
                out,
                NULL};
  char *rn[] = {(char *)resnet_path,
                "--optimizer",
                (char *)opt,
                "--lr",
                (char *)lr,
                "--steps",
                steps,
                "--eval-every",
                "8",
                "--eval-batches",
                "2",
                "--batch",
                "16",
                "--width",
                "4",
                "--blocks",
                "1",
                "--daemon",
                precondd.addr,
                "--sync-roots",
                "--out",
                out,
                NULL};
  int rc = run(is_lm ? lm : rn, log);
  if (rc != 0) {
    show_log(log);
    fail_msg("%s --optimizer %s exited %d", client, opt, rc);
  }
  char path[256];
  snprintf(path, sizeof path, "%s/train.csv", out);
  char *csv = read_file(path);
  assert_non_null(csv);
  assert_int_equal(count_lines(csv), 17);
  double first = mean_loss(csv, 0, 4), last = mean_loss(csv, 12, 16);
  print_message("%s %s: train loss %.4f -> %.4f\n", client, opt, first, last);
  if (!(last < first)) {
    show_log(log);
    fail_msg("%s %s: train loss did not fall (%.4f -> %.4f)", client, opt, first, last);
  }
  snprintf(path, sizeof path, "%s/summary.json", out);
  char *js = read_file(path);
  assert_non_null(js);
  assert_non_null(strstr(js, "\"status\": \"ok\""));
  assert_non_null(strstr(js, "\"steps\": 16,"));
  assert_null(strstr(js, "\"final_eval_loss\": null"));
  if (!is_lm) assert_null(strstr(js, "\"final_eval_accuracy\": null"));
  if (strcmp(opt, "shampoo") == 0) {
    /* --sync-roots: every step waited for the roots of its own statistics, on the ResNet
     * (the table's --root-every 10) for those of its window of 10 steps. */
    assert_non_null(strstr(js, "\"fallback_steps\": 0,"));
    const char *smax = strstr(js, "\"staleness_max\": ");
    assert_non_null(smax);
    long stale = strtol(smax + strlen("\"staleness_max\": "), NULL, 10);
    if (is_lm)
      assert_int_equal(stale, 0);
    else
      assert_true(stale >= 1 && stale <= 9);
    assert_null(strstr(js, "\"roots_received\": 0\n"));
  }
  free(js);
  free(csv);
}

/* Column 4 (train_loss) of every row, as text. */
static char *loss_column(const char *csv) {
  size_t cap = strlen(csv) + 1, used = 0;
  char *out = malloc(cap);
  assert_non_null(out);
  const char *line = strchr(csv, '\n');
  while (line != NULL && line[1] != '\0') {
    line++;
    const char *p = line;
    for (int c = 0; c < 3; c++) p = strchr(p, ',') + 1;
    size_t n = (size_t)(strchr(p, ',') - p);
    memcpy(out + used, p, n);
    used += n;
    out[used++] = ';';
    line = strchr(line, '\n');
  }
  out[used] = '\0';
  return out;
}

static void test_transformer(void **state) {
  (void)state;
  smoke("transformer", "sgd", "0.5");
  /* Same seed and backend, same numbers: a second SGD run repeats every loss. */
  char path[256];
  snprintf(path, sizeof path, "%s/transformer-sgd/train.csv", tmpdir);
  char *csv1 = read_file(path);
  assert_non_null(csv1);
  smoke("transformer", "sgd", "0.5");
  char *csv2 = read_file(path);
  assert_non_null(csv2);
  char *l1 = loss_column(csv1), *l2 = loss_column(csv2);
  assert_string_equal(l1, l2);
  free(l1);
  free(l2);
  free(csv1);
  free(csv2);
  smoke("transformer", "adamw", "3e-3");
  smoke("transformer", "shampoo", "3e-3");
}

static void test_resnet(void **state) {
  (void)state;
  smoke("resnet", "sgd", "0.05");
  smoke("resnet", "adamw", "3e-3");
  smoke("resnet", "shampoo", "3e-3");
}

/* Runs bench/compare for model with a one-value sweep per optimizer on a tiny budget and
 * checks the table, the CSV and the PNG plots. */
static void compare_tiny(const char *model, const char *client_args, int nopt) {
  char out[160], log[200];
  snprintf(out, sizeof out, "%s/compare-%s", tmpdir, model);
  snprintf(log, sizeof log, "%s.log", out);
  char *argv[] = {"/bin/sh", "-c", NULL, NULL};
  char cmd[1024];
  snprintf(cmd, sizeof cmd,
           "exec '%s' --model %s --out '%s' --build '%s' --daemon '%s' --steps 6 "
           "--eval-every 3 --lrs-sgd 0.05 --lrs-adamw 3e-3 --lrs-shampoo 3e-3 --lrs-kfac 0.1 "
           "-- %s",
           compare_path, model, out, build_dir, precondd.addr, client_args);
  argv[2] = cmd;
  int rc = run(argv, log);
  if (rc != 0) {
    show_log(log);
    fail_msg("compare --model %s exited %d", model, rc);
  }
  char path[256];
  snprintf(path, sizeof path, "%s/results.md", out);
  char *md = read_file(path);
  assert_non_null(md);
  assert_non_null(strstr(md, "| adamw | 3e-3 |"));
  assert_non_null(strstr(md, "| shampoo | 3e-3 |"));
  assert_non_null(strstr(md, "| kfac | 0.1 |"));
  assert_non_null(strstr(md, "Best baseline: `runs/"));
  if (nopt == 4) {
    assert_non_null(strstr(md, "| sgd | 0.05 |"));
    assert_non_null(strstr(md, "test accuracy"));
  }
  free(md);
  snprintf(path, sizeof path, "%s/results.csv", out);
  char *csv = read_file(path);
  assert_non_null(csv);
  assert_int_equal(count_lines(csv), 1 + nopt);
  free(csv);
  const char *pngs[] = {"loss-vs-step.png", "loss-vs-time.png"};
  for (int i = 0; i < 2; i++) {
    snprintf(path, sizeof path, "%s/%s", out, pngs[i]);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    unsigned char magic[8] = {0};
    assert_int_equal(fread(magic, 1, 8, f), 8);
    fclose(f);
    assert_memory_equal(magic, "\x89PNG\r\n\x1a\n", 8);
  }
}

static void test_compare(void **state) {
  (void)state;
  char args[300];
  snprintf(args, sizeof args,
           "--context 16 --d-model 32 --heads 2 --layers 1 --batch 8 "
           "--eval-batches 2 --data '%s'",
           kjv_path);
  compare_tiny("transformer", args, 3);
  compare_tiny("resnet", "--batch 16 --width 4 --blocks 1 --eval-batches 2", 4);
}

/* compare's reach rule on a hand-written train.csv: evaluations at step 3 (loss 2.0, wall
 * 1.0 s) and 6 (loss 1.0, wall 2.0 s), step 4 without one. Target 1.6 is crossed 40% of the
 * way from 3 to 6 on the straight line: step 4.2 (printed 4), wall 1.4 s; the grid says 6. */
static void test_compare_reach(void **state) {
  (void)state;
  char csv[200], log[200];
  snprintf(csv, sizeof csv, "%s/reach.csv", tmpdir);
  snprintf(log, sizeof log, "%s/reach.log", tmpdir);
  FILE *f = fopen(csv, "w");
  assert_non_null(f);
  fputs(
      "step,wall_s,step_ms,train_loss,eval_loss\n3,1.0,1,2.1,2.0\n4,1.5,1,1.9,\n"
      "6,2.0,1,1.1,1.0\n",
      f);
  fclose(f);
  const struct {
    const char *target, *want;
  } cases[] = {{"1.6", "6,2.0,4,1.400\n"}, /* crossed between two evaluations */
               {"2.5", "3,1.0,3,1.000\n"}, /* the first evaluation is already below */
               {"1.0", "6,2.0,6,2.000\n"}, /* "at or below": equal counts */
               {"0.5", "-,,,\n"}};         /* never */
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *argv[] = {(char *)compare_path, "--reach", csv, (char *)cases[i].target, NULL};
    assert_int_equal(run(argv, log), 0);
    char *out = read_file(log);
    assert_non_null(out);
    assert_string_equal(out, cases[i].want);
    free(out);
  }
}

static void test_bad_options(void **state) {
  (void)state;
  char log[200];
  snprintf(log, sizeof log, "%s/bad.log", tmpdir);
  char *a[] = {(char *)transformer_path, "--frobnicate", "1", NULL};
  assert_int_equal(run(a, log), 2);
  char *s = read_file(log);
  assert_non_null(strstr(s, "unknown option '--frobnicate'"));
  free(s);
  char *b[] = {(char *)resnet_path, "--optimizer", "lbfgs", NULL};
  assert_int_equal(run(b, log), 2);
  s = read_file(log);
  assert_non_null(strstr(s, "'lbfgs' is not one of sgd, adamw, shampoo"));
  free(s);
  char *c[] = {(char *)transformer_path, "--d-model", "30", "--heads", "4", NULL};
  assert_int_equal(run(c, log), 2);
  s = read_file(log);
  assert_non_null(strstr(s, "not a multiple of --heads"));
  free(s);
  char *d[] = {(char *)transformer_path, "--help", NULL};
  assert_int_equal(run(d, log), 0);
  s = read_file(log);
  assert_non_null(strstr(s, "--d-model N"));
  assert_non_null(strstr(s, "--init NAME"));
  assert_non_null(strstr(s, "[uniform]"));
  assert_non_null(strstr(s, "adamw     0.001   0.9      0.9/0.99"));
  free(s);
  /* the protocol's options: a bad choice of each is refused with the list of good ones */
  char *e[] = {(char *)transformer_path, "--schedule", "linear", NULL};
  assert_int_equal(run(e, log), 2);
  s = read_file(log);
  assert_non_null(strstr(s, "'linear' is not one of constant, cosine, step"));
  free(s);
  char *f[] = {(char *)transformer_path, "--init", "xavier", NULL};
  assert_int_equal(run(f, log), 2);
  s = read_file(log);
  assert_non_null(strstr(s, "'xavier' is not one of uniform, normal002"));
  free(s);
  char *g[] = {(char *)resnet_path, "--conv-init", "orthogonal", NULL};
  assert_int_equal(run(g, log), 2);
  s = read_file(log);
  assert_non_null(strstr(s, "'orthogonal' is not one of fan-in, fan-out"));
  free(s);
  char *h[] = {(char *)resnet_path, "--optimizer", "sgd", "--no-nesterov=1", NULL};
  assert_int_equal(run(h, log), 2);
  s = read_file(log);
  assert_non_null(strstr(s, "--no-nesterov takes no value"));
  free(s);
}

int main(int argc, char **argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: %s PRECONDD TRANSFORMER RESNET COMPARE BUILD_DIR\n", argv[0]);
    return 2;
  }
  precondd_path = argv[1];
  transformer_path = argv[2];
  resnet_path = argv[3];
  compare_path = argv[4];
  build_dir = argv[5];
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bad_options),   cmocka_unit_test(test_transformer),
      cmocka_unit_test(test_resnet),        cmocka_unit_test(test_compare),
      cmocka_unit_test(test_compare_reach),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
