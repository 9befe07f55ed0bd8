/* test_train.c -- the training harness (bench/train.c).
 *
 * Without arguments (suite unit): option parsing, ETA and progress formatting, median, the
 * CSV and JSON writers, and the loop with SGD and AdamW on a small softmax-regression model
 * built from accel primitives (loss must fall; the same seed must give the same losses; a
 * diverging loss must stop the run cleanly).
 * With the path of precondd as argument (suite integration): starts that daemon on a free
 * port and trains the same model with Shampoo through it: statistics pushed, roots
 * received and applied, staleness and fallback counted; --sync-roots runs are reproducible. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "precondd_proc.h"

#include "train.h"

static char tmpdir[64];

static int setup(void **state) {
  (void)state;
  snprintf(tmpdir, sizeof tmpdir, "/tmp/test_train.XXXXXX");
  return mkdtemp(tmpdir) != NULL ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
  return system(cmd) == 0 ? 0 : -1;
}

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

/* ------------------------------------------------------------------------------------ */
/* Options                                                                                */

static int parse(tr_options *o, long *width, char *name, tr_error *err, int argc, ...) {
  char *argv[32];
  argv[0] = "prog";
  va_list ap;
  va_start(ap, argc);
  for (int i = 1; i < argc; i++) argv[i] = va_arg(ap, char *);
  va_end(ap);
  tr_options_default(o);
  tr_arg extra[] = {
      {"width", TR_ARG_LONG, width, 1, 4096, "model width", NULL},
      {"name", TR_ARG_STRING, name, 0, 8, "a name", NULL},
  };
  return tr_parse_args(o, extra, 2, argc, argv, "prog", "test", err);
}

/* Parses argv (NULL-terminated, after the program name) for model with a client's kinds of
 * extra options (a flag and a choice). */
static int parse_model(tr_options *o, const char *model, int *flag, int *choice, tr_error *err,
                       const char **args) {
  static const char *const choices[] = {"red", "green", NULL};
  char *argv[32] = {"prog"};
  int argc = 1;
  while (args[argc - 1] != NULL) {
    argv[argc] = (char *)args[argc - 1];
    argc++;
  }
  tr_options_default(o);
  o->model = model;
  *flag = 1;
  *choice = 0;
  tr_arg extra[] = {
      {"tie", TR_ARG_FLAG, flag, 0, 0, "a flag", NULL},
      {"colour", TR_ARG_CHOICE, choice, 0, 0, "a choice", choices},
  };
  return tr_parse_args(o, extra, 2, argc, argv, "prog", "test", err);
}

/* The defaults table per (model, optimizer), a user's value over the table's, --no-FLAG,
 * choices, the schedule options. */
static void test_defaults_table(void **state) {
  (void)state;
  tr_options o;
  tr_error err = {{0}};
  int flag, choice;

  const char *rn_sgd[] = {"--optimizer", "sgd", "--steps", "468", NULL};
  assert_int_equal(parse_model(&o, "resnet", &flag, &choice, &err, rn_sgd), TR_OK);
  assert_true(o.lr == 0.1 && o.momentum == 0.9 && o.weight_decay == 5e-4);
  assert_int_equal(o.nesterov, 1);
  assert_int_equal(o.warmup, 0);
  assert_int_equal(o.schedule, AC_LR_COSINE);
  assert_true(o.lr_floor == 0);

  const char *lm_adamw[] = {"--steps", "1000", NULL};
  assert_int_equal(parse_model(&o, "transformer", &flag, &choice, &err, lm_adamw), TR_OK);
  assert_int_equal(o.optimizer, TR_ADAMW);
  assert_true(o.lr == 1e-3 && o.beta1 == 0.9 && o.beta2 == 0.99 && o.weight_decay == 0);
  assert_int_equal(o.warmup, 100);
  /* a short run warms up for a tenth of it; a given --warmup is kept whatever the length */
  const char *lm_short[] = {"--steps", "200", NULL};
  assert_int_equal(parse_model(&o, "transformer", &flag, &choice, &err, lm_short), TR_OK);
  assert_int_equal(o.warmup, 20);
  const char *lm_given[] = {"--steps", "200", "--warmup", "150", "--beta2", "0.95", NULL};
  assert_int_equal(parse_model(&o, "transformer", &flag, &choice, &err, lm_given), TR_OK);
  assert_int_equal(o.warmup, 150);
  assert_true(o.beta2 == 0.95);
  /* Shampoo's row has its own warm-up on the Transformer (50, measured), AdamW's stays 100 */
  const char *lm_shampoo[] = {"--optimizer", "shampoo", "--steps", "1000", NULL};
  assert_int_equal(parse_model(&o, "transformer", &flag, &choice, &err, lm_shampoo), TR_OK);
  assert_int_equal(o.warmup, 50);
  /* and its own first moment (0.8, measured); the ResNet's row takes accel's default */
  assert_true(o.shampoo_beta1 == 0.8);
  ac_shampoo_opts so;
  ac_shampoo_opts_default(&so);
  const char *rn_shampoo[] = {"--optimizer", "shampoo", "--steps", "468", NULL};
  assert_int_equal(parse_model(&o, "resnet", &flag, &choice, &err, rn_shampoo), TR_OK);
  assert_true(o.shampoo_beta1 == so.beta1);
  const char *lm_beta1[] = {"--optimizer", "shampoo", "--shampoo-beta1", "0.5", NULL};
  assert_int_equal(parse_model(&o, "transformer", &flag, &choice, &err, lm_beta1), TR_OK);
  assert_true(o.shampoo_beta1 == 0.5);
  const char *lm_beta0[] = {"--optimizer", "shampoo", "--shampoo-beta1", "0", NULL};
  assert_int_equal(parse_model(&o, "transformer", &flag, &choice, &err, lm_beta0), TR_OK);
  assert_true(o.shampoo_beta1 == 0);
  /* Shampoo's first steps wait for their own roots on the Transformer (25, measured), a
   * short run's a fortieth of its steps; never for data-parallel workers, nor elsewhere */
  assert_int_equal(parse_model(&o, "transformer", &flag, &choice, &err, lm_shampoo), TR_OK);
  assert_int_equal(tr_sync_first(&o), 25);
  o.dp_size = 2;
  assert_int_equal(tr_sync_first(&o), 0);
  const char *lm_short_sf[] = {"--optimizer", "shampoo", "--steps", "200", NULL};
  assert_int_equal(parse_model(&o, "transformer", &flag, &choice, &err, lm_short_sf), TR_OK);
  assert_int_equal(tr_sync_first(&o), 5);
  const char *lm_sf[] = {"--optimizer", "shampoo", "--sync-first", "0", NULL};
  assert_int_equal(parse_model(&o, "transformer", &flag, &choice, &err, lm_sf), TR_OK);
  assert_int_equal(tr_sync_first(&o), 0);
  assert_int_equal(parse_model(&o, "resnet", &flag, &choice, &err, rn_shampoo), TR_OK);
  assert_int_equal(tr_sync_first(&o), 0);
  /* precondd's root rate: the ResNet's row every 10 steps, the Transformer's every push; a
   * given --root-every is kept */
  assert_int_equal(parse_model(&o, "resnet", &flag, &choice, &err, rn_shampoo), TR_OK);
  assert_int_equal(o.root_every, 10);
  assert_int_equal(parse_model(&o, "transformer", &flag, &choice, &err, lm_shampoo), TR_OK);
  assert_int_equal(o.root_every, 1);
  const char *rn_every[] = {"--optimizer", "shampoo", "--root-every", "3", NULL};
  assert_int_equal(parse_model(&o, "resnet", &flag, &choice, &err, rn_every), TR_OK);
  assert_int_equal(o.root_every, 3);
  /* K-FAC's schedule: the Transformer's row factors every 2 steps with inverses every 4
   * pushes (measured on two seeds, docs/kfac.md "Session 15"); the ResNet's takes the
   * numerics core's (every step, every 10 pushes); given values are kept */
  pc_kfac_opts ko;
  pc_kfac_opts_default(&ko);
  const char *lm_kfac[] = {"--optimizer", "kfac", "--steps", "1000", NULL};
  assert_int_equal(parse_model(&o, "transformer", &flag, &choice, &err, lm_kfac), TR_OK);
  assert_int_equal(o.factor_every_first, 2);
  assert_int_equal(o.inv_every, 4);
  const char *rn_kfac[] = {"--optimizer", "kfac", "--steps", "468", NULL};
  assert_int_equal(parse_model(&o, "resnet", &flag, &choice, &err, rn_kfac), TR_OK);
  assert_int_equal(o.factor_every_first, ko.factor_every_first);
  assert_int_equal(o.inv_every, ko.inv_every);
  const char *lm_kfac_given[] = {"--optimizer", "kfac", "--factor-every-first", "1", "--inv-every",
                                 "10",          NULL};
  assert_int_equal(parse_model(&o, "transformer", &flag, &choice, &err, lm_kfac_given), TR_OK);
  assert_int_equal(o.factor_every_first, 1);
  assert_int_equal(o.inv_every, 10);

  /* no row for the model: the optimizer's generic row */
  const char *other[] = {"--optimizer", "sgd", NULL};
  assert_int_equal(parse_model(&o, "mlp", &flag, &choice, &err, other), TR_OK);
  assert_true(o.lr == 0.1 && o.weight_decay == 0);
  assert_int_equal(o.nesterov, 0);

  /* --no-nesterov, --momentum 0 drops the table's Nesterov, flags and choices */
  const char *no_nest[] = {"--optimizer", "sgd", "--no-nesterov", "--no-tie", "--colour",
                           "green",       NULL};
  assert_int_equal(parse_model(&o, "resnet", &flag, &choice, &err, no_nest), TR_OK);
  assert_int_equal(o.nesterov, 0);
  assert_int_equal(flag, 0);
  assert_int_equal(choice, 1);
  const char *mom0[] = {"--optimizer", "sgd", "--momentum", "0", "--tie", NULL};
  assert_int_equal(parse_model(&o, "resnet", &flag, &choice, &err, mom0), TR_OK);
  assert_int_equal(o.nesterov, 0);
  assert_int_equal(flag, 1);

  const char *sched[] = {"--schedule", "step",       "--step-size", "30", "--step-gamma",
                         "0.5",        "--lr-floor", "0.1",         NULL};
  assert_int_equal(parse_model(&o, "resnet", &flag, &choice, &err, sched), TR_OK);
  assert_int_equal(o.schedule, AC_LR_STEP);
  assert_int_equal(o.step_size, 30);
  assert_true(o.step_gamma == 0.5 && o.lr_floor == 0.1);

  struct {
    const char *a[4];
    const char *msg;
  } bad[] = {
      {{"--schedule", "linear"}, "--schedule: 'linear' is not one of constant, cosine, step"},
      {{"--colour", "blue"}, "--colour: 'blue' is not one of red, green"},
      {{"--lr-floor", "1.5"}, "--lr-floor: '1.5'"},
      {{"--step-gamma", "0"}, "--step-gamma: '0'"},
      {{"--no-lr"}, "unknown option '--no-lr'"},
      {{"--no-tie=1"}, "--no-tie takes no value"},
      {{"--optimizer", "sgd", "--momentum"}, "--momentum needs a value"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    memset(&err, 0, sizeof err);
    assert_int_equal(parse_model(&o, "resnet", &flag, &choice, &err, bad[i].a), TR_EINVAL);
    if (strstr(err.msg, bad[i].msg) == NULL) fail_msg("case %zu: got '%s'", i, err.msg);
  }
  const char *nest0[] = {"--optimizer", "sgd", "--momentum", "0", "--nesterov", NULL};
  assert_int_equal(parse_model(&o, "resnet", &flag, &choice, &err, nest0), TR_EINVAL);
  assert_non_null(strstr(err.msg, "--nesterov needs --momentum"));

  /* The usage text shows the table of the client's model. */
  char path[128];
  snprintf(path, sizeof path, "%s/usage-table.txt", tmpdir);
  FILE *f = fopen(path, "w");
  tr_options d;
  tr_options_default(&d);
  d.model = "resnet";
  tr_usage(f, &d, NULL, 0, "resnet", "summary");
  fclose(f);
  char *u = read_file(path);
  assert_non_null(strstr(u, "--lr X"));
  assert_non_null(strstr(u, "[table]"));
  assert_non_null(strstr(u, "(resnet)"));
  assert_non_null(strstr(u, "sgd       0.1     0.9      0.9/0.999  0.0005       yes"));
  assert_non_null(strstr(u, "--schedule NAME"));
  assert_non_null(strstr(u, "[cosine]"));
  char line[64];
  snprintf(line, sizeof line, "shampoo's first moment (--shampoo-beta1): %g", so.beta1);
  assert_non_null(strstr(u, line));
  free(u);
}

/* The schedule a run gets: warm-up, then cosine to the floor at the last step (or step
 * decay, or constant), over the run's total steps. */
static void test_run_schedule(void **state) {
  (void)state;
  tr_options o;
  ac_lr_schedule sc;
  tr_options_default(&o);
  o.lr = 0.5;
  o.warmup = 10;
  tr_options_resolve(&o);
  assert_int_equal(tr_schedule(&o, 110, &sc), TR_OK);
  assert_true(fabs(ac_lr_schedule_at(&sc, 5) - 0.25) < 1e-12);
  assert_true(ac_lr_schedule_at(&sc, 10) == 0.5);
  assert_true(fabs(ac_lr_schedule_at(&sc, 60) - 0.25) < 1e-12); /* midpoint of the decay */
  assert_true(fabs(ac_lr_schedule_at(&sc, 110)) < 1e-12);       /* the last step */
  o.lr_floor = 0.1;
  assert_int_equal(tr_schedule(&o, 110, &sc), TR_OK);
  assert_true(fabs(ac_lr_schedule_at(&sc, 110) - 0.05) < 1e-12);
  assert_true(fabs(ac_lr_schedule_at(&sc, 60) - 0.275) < 1e-12);
  o.schedule = AC_LR_CONSTANT;
  assert_int_equal(tr_schedule(&o, 110, &sc), TR_OK);
  assert_true(ac_lr_schedule_at(&sc, 110) == 0.5);
  o.schedule = AC_LR_STEP; /* step_size 0: thirds of the 100 decay steps, gamma 0.1 */
  assert_int_equal(tr_schedule(&o, 110, &sc), TR_OK);
  assert_true(ac_lr_schedule_at(&sc, 42) == 0.5);
  assert_true(fabs(ac_lr_schedule_at(&sc, 43) - 0.05) < 1e-12);
  assert_true(fabs(ac_lr_schedule_at(&sc, 110) - 0.0005) < 1e-12);
  o.step_gamma = 2; /* out of range */
  assert_int_equal(tr_schedule(&o, 110, &sc), TR_EINVAL);
}

static void test_options(void **state) {
  (void)state;
  tr_options o;
  tr_error err = {{0}};
  long width = 128;
  char name[8] = "x";

  assert_int_equal(parse(&o, &width, name, &err, 1), TR_OK);
  assert_int_equal(o.optimizer, TR_ADAMW);
  assert_int_equal(o.seed, 1);
  assert_int_equal(o.backend, AC_BACKEND_CPU);
  assert_true(tr_effective_lr(&o) == 1e-3);

  assert_int_equal(
      parse(&o, &width, name, &err, 12, "--optimizer", "sgd", "--steps=7", "--lr", "0.25",
            "--width", "64", "--name=abc", "--backend", "cuda", "--sync-roots"),
      TR_OK);
  assert_int_equal(o.optimizer, TR_SGD);
  assert_int_equal(o.steps, 7);
  assert_true(o.lr == 0.25);
  assert_true(tr_effective_lr(&o) == 0.25);
  assert_int_equal(width, 64);
  assert_string_equal(name, "abc");
  assert_int_equal(o.backend, AC_BACKEND_CUDA);
  assert_int_equal(o.sync_roots, 1);

  assert_int_equal(parse(&o, &width, name, &err, 5, "--root-delay", "2", "--stop-at", "50"), TR_OK);
  assert_int_equal(o.root_delay, 2);
  assert_int_equal(o.stop_at, 50);
  assert_int_equal(o.sync_roots, 0); /* the trainer's options make a delay synchronous */

  assert_int_equal(parse(&o, &width, name, &err, 5, "--graft", "adagrad", "--warmup", "10"), TR_OK);
  assert_int_equal(o.graft, PC_GRAFT_ADAGRAD);
  assert_int_equal(o.warmup, 10);

  assert_int_equal(parse(&o, &width, name, &err, 3, "--epochs", "1.5"), TR_OK);
  assert_int_equal(o.steps, 0);
  assert_true(o.epochs == 1.5);
  tr_model m = {.steps_per_epoch = 10};
  assert_int_equal(tr_total_steps(&o, &m), 15);

  struct {
    int argc;
    const char *a[4];
    const char *msg;
  } bad[] = {
      {2, {"--frobnicate"}, "unknown option '--frobnicate'"},
      {2, {"--steps"}, "--steps needs a value"},
      {3, {"--steps", "0"}, "--steps: '0' is not an integer"},
      {3, {"--steps", "12x"}, "--steps: '12x'"},
      {3, {"--lr", "nan"}, "--lr: 'nan'"},
      {3, {"--lr", "-1"}, "--lr: '-1'"},
      {3, {"--optimizer", "lbfgs"}, "'lbfgs' is not one of sgd, adamw, shampoo"},
      {3, {"--backend", "tpu"}, "'tpu' is not one of cpu, cuda"},
      {3, {"--width", "5000"}, "--width: '5000'"},
      {3, {"--name", "too-long-name"}, "--name: value longer"},
      {2, {"stray"}, "unexpected argument 'stray'"},
      {5, {"--steps", "3", "--epochs", "1"}, "not both"},
      {2, {"--quiet=1"}, "--quiet takes no value"},
      {3, {"--seed", "-4"}, "--seed: '-4'"},
      {3, {"--graft", "lion"}, "--graft: 'lion' is not one of"},
      {5, {"--optimizer=sgd", "--nesterov", "--momentum", "0"}, "--nesterov needs --momentum"},
      {4, {"--optimizer=shampoo", "--daemon", ""}, "needs --daemon"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    memset(&err, 0, sizeof err);
    int rc = parse(&o, &width, name, &err, bad[i].argc, bad[i].a[0], bad[i].a[1], bad[i].a[2],
                   bad[i].a[3]);
    assert_int_equal(rc, TR_EINVAL);
    if (strstr(err.msg, bad[i].msg) == NULL) fail_msg("case %zu: got '%s'", i, err.msg);
  }

  /* --help prints usage (to stdout, silenced here) and says so. */
  FILE *saved = stdout;
  stdout = fopen("/dev/null", "w");
  assert_non_null(stdout);
  int rc = parse(&o, &width, name, &err, 2, "--help");
  fclose(stdout);
  stdout = saved;
  assert_int_equal(rc, TR_EHELP);

  /* The usage text lists the extra and the common options with defaults. */
  char path[128];
  snprintf(path, sizeof path, "%s/usage.txt", tmpdir);
  FILE *f = fopen(path, "w");
  tr_options d;
  tr_options_default(&d);
  long w = 33;
  tr_arg extra[] = {{"width", TR_ARG_LONG, &w, 1, 10, "model width", NULL}};
  tr_usage(f, &d, extra, 1, "prog", "summary");
  fclose(f);
  char *u = read_file(path);
  assert_non_null(strstr(u, "--width N"));
  assert_non_null(strstr(u, "[33]"));
  assert_non_null(strstr(u, "--optimizer NAME"));
  assert_non_null(strstr(u, "[adamw]"));
  assert_non_null(strstr(u, "--daemon S"));
  free(u);
}

/* ------------------------------------------------------------------------------------ */
/* ETA, durations, progress, median                                                       */

static void test_progress(void **state) {
  (void)state;
  assert_true(tr_eta(10.0, 0, 100) == -1);
  assert_true(fabs(tr_eta(10.0, 10, 100) - 90.0) < 1e-12);
  assert_true(fabs(tr_eta(3.0, 30, 40) - 1.0) < 1e-12);
  assert_true(tr_eta(5.0, 100, 100) == 0);

  char b[64];
  tr_format_duration(b, sizeof b, 7.4);
  assert_string_equal(b, "7s");
  tr_format_duration(b, sizeof b, 185);
  assert_string_equal(b, "3m05s");
  tr_format_duration(b, sizeof b, 7260);
  assert_string_equal(b, "2h01m");
  tr_format_duration(b, sizeof b, -1);
  assert_string_equal(b, "?");
  tr_format_duration(b, sizeof b, NAN);
  assert_string_equal(b, "?");

  char line[200];
  tr_format_progress(line, sizeof line, 120, 1000, 2.34561, 18234.0, "tok", 14.2, 104.0);
  assert_string_equal(line, "step 120/1000  loss 2.3456  18.2k tok/s  elapsed 14s  eta 1m44s");
  tr_format_progress(line, sizeof line, 1, 5, 0.5, NAN, "img", 0.1, -1);
  assert_string_equal(line, "step 1/5  loss 0.5000  ? img/s  elapsed 0s  eta ?");

  double v[] = {5, 1, 4, 2, 3}, med;
  assert_int_equal(tr_median(v, 5, &med), TR_OK);
  assert_true(med == 3);
  assert_true(v[0] == 5); /* input untouched */
  assert_int_equal(tr_median(v, 4, &med), TR_OK);
  assert_true(med == 3); /* (2 + 4) / 2 */
  assert_int_equal(tr_median(v, 0, &med), TR_OK);
  assert_true(isnan(med));
}

/* ------------------------------------------------------------------------------------ */
/* CSV and JSON                                                                           */

static void test_csv_json(void **state) {
  (void)state;
  char path[128];
  snprintf(path, sizeof path, "%s/rows.csv", tmpdir);
  FILE *f = fopen(path, "w");
  assert_int_equal(tr_csv_header(f), TR_OK);
  tr_row r1 = {1, 0.5, 12.25, 2.5, NAN, NAN, 0.001, NAN, 1, 11.5, NAN, 0.75, 10.5};
  tr_row r2 = {2, 1.0, 10.0, 2.25, 2.125, 0.75, 0.001, 1.5, 0, NAN, 0.25, NAN, NAN};
  assert_int_equal(tr_csv_row(f, &r1), TR_OK);
  assert_int_equal(tr_csv_row(f, &r2), TR_OK);
  fclose(f);
  char *csv = read_file(path);
  assert_string_equal(csv, TR_CSV_HEADER
                      "\n"
                      "1,0.5,12.25,2.5,,,0.001,,1,11.5,,0.75,10.5\n"
                      "2,1,10,2.25,2.125,0.75,0.001,1.5,0,,0.25,,\n");
  free(csv);

  snprintf(path, sizeof path, "%s/s.json", tmpdir);
  f = fopen(path, "w");
  tr_summary s;
  memset(&s, 0, sizeof s);
  s.model = "toy \"m\"\n";
  s.optimizer = "adamw";
  s.backend = "cpu";
  s.seed = 42;
  s.lr = 0.001;
  s.steps = 100;
  s.final_eval_loss = 1.25;
  s.final_eval_accuracy = NAN;
  s.median_step_ms = 3.5;
  s.staleness_max = -1;
  s.fallback_steps = 7;
  s.roots_received = 9;
  s.schedule = "cosine";
  s.warmup = 10;
  s.staleness_p50 = 1;
  s.staleness_p90 = 3;
  s.staleness_p99 = NAN;
  s.staleness_hist[0] = 5;
  s.staleness_hist[3] = 2;
  s.staleness_uses = 7;
  assert_int_equal(tr_json_summary(f, &s), TR_OK);
  fclose(f);
  char *js = read_file(path);
  assert_non_null(strstr(js, "\"model\": \"toy \\\"m\\\"\\n\","));
  assert_non_null(strstr(js, "\"status\": \"ok\","));
  assert_non_null(strstr(js, "\"seed\": 42,"));
  assert_non_null(strstr(js, "\"steps\": 100,"));
  assert_non_null(strstr(js, "\"final_eval_loss\": 1.25,"));
  assert_non_null(strstr(js, "\"final_eval_accuracy\": null,"));
  assert_non_null(strstr(js, "\"median_step_ms\": 3.5,"));
  assert_non_null(strstr(js, "\"fallback_steps\": 7,"));
  assert_non_null(strstr(js, "\"roots_received\": 9\n}\n"));
  assert_non_null(strstr(js, "\"schedule\": \"cosine\",\n  \"warmup\": 10,"));
  assert_non_null(strstr(js,
                         "\"staleness_p50\": 1,\n  \"staleness_p90\": 3,\n"
                         "  \"staleness_p99\": null,\n  \"staleness_uses\": 7,\n"
                         "  \"staleness_hist\": [5, 0, 0, 2],\n"));
  assert_true(js[0] == '{');
  free(js);

  snprintf(path, sizeof path, "%s/a/b/c", tmpdir);
  assert_int_equal(tr_mkdirs(path), TR_OK);
  assert_int_equal(tr_mkdirs(path), TR_OK);
  snprintf(path, sizeof path, "%s/rows.csv/x", tmpdir);
  assert_int_equal(tr_mkdirs(path), TR_EIO);
}

/* ------------------------------------------------------------------------------------ */
/* The loop on a toy model: softmax regression of 4 Gaussian blobs in 16 dimensions         */

#define TOY_F 16
#define TOY_C 4
#define TOY_N 512
#define TOY_B 32

typedef struct {
  ac_backend *be;
  ac_param w, b;
  ac_param *params[2];
  float *x_train, *x_eval;   /* device, TOY_N x TOY_F */
  int32_t *y_train, *y_eval; /* device */
  float *logits, *probs, *loss;
  int32_t *pred;
  size_t pos;
  int nan_at;   /* step at which train_step reports NaN (0: never) */
  int stop_at;  /* step at which train_step raises SIGTERM (0: never) */
  int delay_us; /* per step, to stand in for a real model's compute time */
  int steps;
  long factor; /* ABS: batches per update (toy_set_batch_factor); 0 or 1: one */
} toy;

static uint64_t toy_rand(uint64_t *s) {
  *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
  return *s >> 33;
}

static float toy_normal(uint64_t *s) {
  double u = ((double)toy_rand(s) + 0.5) / 2147483648.0, v = (double)toy_rand(s) / 2147483648.0;
  return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

static void toy_data(uint64_t seed, float *x, int32_t *y) {
  uint64_t s = seed;
  for (int i = 0; i < TOY_N; i++) {
    int c = i % TOY_C;
    y[i] = c;
    for (int j = 0; j < TOY_F; j++)
      x[i * TOY_F + j] = toy_normal(&s) + (j % TOY_C == c ? 2.f : 0.f);
  }
}

static int toy_forward(toy *t, const float *x, const int32_t *y, size_t n, double *loss) {
  float *w = ac_tensor_f32(&t->w.value), *b = ac_tensor_f32(&t->b.value);
  int rc = ac_sgemm(t->be, AC_NO_TRANS, AC_TRANS, n, TOY_C, TOY_F, 1.f, x, TOY_F, w, TOY_F, 0.f,
                    t->logits, TOY_C);
  if (rc == AC_OK) rc = ac_bcast(t->be, AC_BIN_ADD, n, TOY_C, 1, t->logits, b, t->logits);
  if (rc == AC_OK) rc = ac_xent_forward(t->be, n, TOY_C, t->logits, y, t->probs, t->loss);
  double sum = 0;
  if (rc == AC_OK) rc = ac_sum_to_host(t->be, n, t->loss, &sum);
  *loss = sum / (double)n;
  return rc;
}

/* The gradient of the mean loss over the TOY_B rows at x, y, scaled by scale and added to
 * the grads (beta 1) or written over them (beta 0). */
static int toy_grad(toy *t, const float *x, const int32_t *y, float scale, float beta,
                    double *loss) {
  int rc = toy_forward(t, x, y, TOY_B, loss);
  if (rc == AC_OK) rc = ac_xent_backward(t->be, TOY_B, TOY_C, t->probs, y, scale / TOY_B, t->probs);
  if (rc == AC_OK)
    rc = ac_sgemm(t->be, AC_TRANS, AC_NO_TRANS, TOY_C, TOY_F, TOY_B, 1.f, t->probs, TOY_C, x, TOY_F,
                  beta, ac_tensor_f32(&t->w.grad), TOY_F);
  if (rc == AC_OK)
    rc = ac_reduce(t->be, AC_REDUCE_SUM, TOY_B, TOY_C, 1, 1.f, t->probs, beta,
                   ac_tensor_f32(&t->b.grad));
  return rc;
}

static int toy_train_step(void *ctx, double *loss) {
  toy *t = ctx;
  t->steps++;
  if (t->stop_at > 0 && t->steps == t->stop_at) raise(SIGTERM);
  if (t->delay_us > 0) usleep((useconds_t)t->delay_us);
  long k = t->factor > 1 ? t->factor : 1;
  int rc = AC_OK;
  double sum = 0;
  for (long i = 0; i < k && rc == AC_OK; i++) {
    if (t->pos + TOY_B > TOY_N) t->pos = 0;
    double l = 0;
    rc = toy_grad(t, t->x_train + t->pos * TOY_F, t->y_train + t->pos, 1.f / (float)k,
                  i == 0 ? 0.f : 1.f, &l);
    t->pos += TOY_B;
    sum += l;
  }
  *loss = sum / (double)k;
  if (t->nan_at > 0 && t->steps >= t->nan_at) *loss = NAN;
  return rc;
}

static int toy_set_batch_factor(void *ctx, long k) {
  ((toy *)ctx)->factor = k;
  return k >= 1 ? 0 : -1;
}

/* ABS's gradient: the first batch of the training data. */
static int toy_hv_grad(void *ctx) {
  toy *t = ctx;
  double l;
  return toy_grad(t, t->x_train, t->y_train, 1.f, 0.f, &l);
}

static int toy_evaluate(void *ctx, long batches, double *loss, double *accuracy) {
  toy *t = ctx;
  (void)batches;
  int rc = toy_forward(t, t->x_eval, t->y_eval, TOY_N, loss);
  int32_t pred[TOY_N], lab[TOY_N];
  if (rc == AC_OK) rc = ac_argmax_rows(t->be, TOY_N, TOY_C, t->logits, t->pred);
  if (rc == AC_OK) rc = ac_memcpy_d2h(t->be, pred, t->pred, sizeof pred);
  if (rc == AC_OK) rc = ac_memcpy_d2h(t->be, lab, t->y_eval, sizeof lab);
  int ok = 0;
  for (int i = 0; i < TOY_N; i++) ok += pred[i] == lab[i];
  *accuracy = (double)ok / TOY_N;
  return rc;
}

static void toy_init(toy *t, ac_backend *be, uint64_t seed) {
  memset(t, 0, sizeof *t);
  t->be = be;
  size_t ws[2] = {TOY_C, TOY_F}, bs[1] = {TOY_C};
  assert_int_equal(ac_param_init(&t->w, be, "toy.weight", 2, ws), AC_OK);
  assert_int_equal(ac_param_init(&t->b, be, "toy.bias", 1, bs), AC_OK);
  assert_int_equal(
      ac_rand_normal(be, seed, 0, TOY_C * TOY_F, 0.f, 0.1f, ac_tensor_f32(&t->w.value)), AC_OK);
  t->params[0] = &t->w;
  t->params[1] = &t->b;
  float *hx = malloc(sizeof(float) * TOY_N * TOY_F);
  int32_t *hy = malloc(sizeof(int32_t) * TOY_N);
  assert_int_equal(ac_malloc(be, sizeof(float) * TOY_N * TOY_F, (void **)&t->x_train), AC_OK);
  assert_int_equal(ac_malloc(be, sizeof(float) * TOY_N * TOY_F, (void **)&t->x_eval), AC_OK);
  assert_int_equal(ac_malloc(be, sizeof(int32_t) * TOY_N, (void **)&t->y_train), AC_OK);
  assert_int_equal(ac_malloc(be, sizeof(int32_t) * TOY_N, (void **)&t->y_eval), AC_OK);
  toy_data(11, hx, hy);
  assert_int_equal(ac_memcpy_h2d(be, t->x_train, hx, sizeof(float) * TOY_N * TOY_F), AC_OK);
  assert_int_equal(ac_memcpy_h2d(be, t->y_train, hy, sizeof(int32_t) * TOY_N), AC_OK);
  toy_data(12, hx, hy);
  assert_int_equal(ac_memcpy_h2d(be, t->x_eval, hx, sizeof(float) * TOY_N * TOY_F), AC_OK);
  assert_int_equal(ac_memcpy_h2d(be, t->y_eval, hy, sizeof(int32_t) * TOY_N), AC_OK);
  free(hx);
  free(hy);
  assert_int_equal(ac_malloc(be, sizeof(float) * TOY_N * TOY_C, (void **)&t->logits), AC_OK);
  assert_int_equal(ac_malloc(be, sizeof(float) * TOY_N * TOY_C, (void **)&t->probs), AC_OK);
  assert_int_equal(ac_malloc(be, sizeof(float) * TOY_N, (void **)&t->loss), AC_OK);
  assert_int_equal(ac_malloc(be, sizeof(int32_t) * TOY_N, (void **)&t->pred), AC_OK);
}

static void toy_destroy(toy *t) {
  ac_param_destroy(&t->w);
  ac_param_destroy(&t->b);
  ac_free(t->be, t->x_train);
  ac_free(t->be, t->x_eval);
  ac_free(t->be, t->y_train);
  ac_free(t->be, t->y_eval);
  ac_free(t->be, t->logits);
  ac_free(t->be, t->probs);
  ac_free(t->be, t->loss);
  ac_free(t->be, t->pred);
}

static tr_model toy_model(toy *t) {
  return (tr_model){
      "toy",         t,    2,    t->params, toy_train_step,       toy_evaluate, TOY_B, "ex",
      TOY_N / TOY_B, NULL, NULL, NULL,      toy_set_batch_factor, toy_hv_grad};
}

/* Column col (0-based) of every data line of a CSV, as text. */
static void csv_column(const char *csv, int col, char *out, size_t len) {
  out[0] = '\0';
  const char *line = strchr(csv, '\n');
  size_t used = 0;
  while (line != NULL && line[1] != '\0') {
    line++;
    const char *p = line;
    for (int c = 0; c < col; c++) p = strchr(p, ',') + 1;
    const char *e = strpbrk(p, ",\n");
    size_t n = (size_t)(e - p);
    assert_true(used + n + 2 < len);
    memcpy(out + used, p, n);
    used += n;
    out[used++] = ';';
    out[used] = '\0';
    line = strchr(line, '\n');
  }
}

/* Trains the toy model t with options o into tmpdir/sub, reads back its train.csv into *csv
 * (caller frees), then releases t and be. */
static void train_toy(tr_options *o, const char *sub, ac_backend *be, toy *t, tr_summary *sm,
                      char **csv) {
  tr_model m = toy_model(t);
  snprintf(o->out, sizeof o->out, "%s/%s", tmpdir, sub);
  tr_error err = {{0}};
  int rc = tr_train(o, be, &m, sm, &err);
  if (rc != TR_OK) fail_msg("tr_train: %s", err.msg);
  char path[600];
  snprintf(path, sizeof path, "%s/train.csv", o->out);
  *csv = read_file(path);
  assert_non_null(*csv);
  toy_destroy(t);
  ac_backend_destroy(be);
}

static void run_toy(tr_optimizer_kind kind, const char *sub, tr_summary *sm, char **csv) {
  ac_backend *be = NULL;
  assert_int_equal(ac_backend_create(&be, NULL), AC_OK);
  toy t;
  toy_init(&t, be, 5);
  tr_options o;
  tr_options_default(&o);
  o.optimizer = kind;
  o.steps = 60;
  o.eval_every = 20;
  o.quiet = 1;
  o.lr = kind == TR_SGD ? 0.1 : 0.02;
  train_toy(&o, sub, be, &t, sm, csv);
}

static void test_train_loop(void **state) {
  (void)state;
  const tr_optimizer_kind kinds[] = {TR_SGD, TR_ADAMW};
  for (size_t k = 0; k < 2; k++) {
    tr_summary a, b;
    char *csv_a = NULL, *csv_b = NULL;
    char sub_a[32], sub_b[32];
    snprintf(sub_a, sizeof sub_a, "%s-a", tr_optimizer_name(kinds[k]));
    snprintf(sub_b, sizeof sub_b, "%s-b", tr_optimizer_name(kinds[k]));
    run_toy(kinds[k], sub_a, &a, &csv_a);
    run_toy(kinds[k], sub_b, &b, &csv_b);

    assert_int_equal(a.steps, 60);
    assert_int_equal(a.params, TOY_C * TOY_F + TOY_C);
    /* Loss falls: ln 4 = 1.386 at the start; the blobs are well separated. */
    assert_true(a.final_train_loss < 0.6);
    assert_true(a.final_eval_loss < 0.6);
    assert_true(a.final_eval_accuracy > 0.85);
    assert_true(a.median_step_ms > 0);
    assert_true(a.median_step_cpu_ms >= 0);
    assert_int_equal(a.fallback_steps, 0);
    assert_true(isnan(a.staleness_mean));

    /* One row per step plus the header; evaluations at 20, 40, 60. */
    int lines = 0;
    for (const char *p = csv_a; *p; p++) lines += *p == '\n';
    assert_int_equal(lines, 61);
    char col[8192], col2[8192];
    csv_column(csv_a, 4, col, sizeof col);
    int evals = 0;
    for (const char *p = col; *p; p++) evals += p[0] != ';' && (p == col || p[-1] == ';');
    assert_int_equal(evals, 3);

    /* Same seed, same numbers: train and eval losses agree digit for digit. */
    csv_column(csv_a, 3, col, sizeof col);
    csv_column(csv_b, 3, col2, sizeof col2);
    assert_string_equal(col, col2);
    csv_column(csv_a, 4, col, sizeof col);
    csv_column(csv_b, 4, col2, sizeof col2);
    assert_string_equal(col, col2);
    assert_true(a.final_eval_loss == b.final_eval_loss);

    /* The training thread's CPU is in every row and within the process's (its interval
     * lies inside cpu_ms's; the 5 printed digits allow a rounding of 1e-4 relative). */
    csv_column(csv_a, 9, col, sizeof col);
    csv_column(csv_a, 12, col2, sizeof col2);
    const char *pc = col, *pt = col2;
    for (int r = 0; r < 60; r++) {
      char *ec, *et;
      double cpu = strtod(pc, &ec), thr = strtod(pt, &et);
      assert_true(ec != pc && et != pt && *ec == ';' && *et == ';');
      assert_true(thr >= 0.0 && thr <= cpu * (1.0 + 1e-4));
      pc = ec + 1;
      pt = et + 1;
    }

    char path[256];
    snprintf(path, sizeof path, "%s/%s/summary.json", tmpdir, sub_a);
    char *js = read_file(path);
    assert_non_null(js);
    assert_non_null(strstr(js, "\"steps\": 60,"));
    assert_non_null(strstr(js, "\"model\": \"toy\","));
    free(js);
    free(csv_a);
    free(csv_b);
  }
}

/* ABS on the toy, a rule evaluation every 8 batches: the eigenvalue halves early (0.31 to
 * 0.13: grown, flat), then stays (a forced growth 10 evaluations later), so the run takes
 * fewer updates than the batches of data it sees; a run is reproducible. */
static void test_train_abs(void **state) {
  (void)state;
  tr_summary sm[2];
  char *csv[2] = {NULL, NULL};
  for (int r = 0; r < 2; r++) {
    ac_backend *be = NULL;
    assert_int_equal(ac_backend_create(&be, NULL), AC_OK);
    toy t;
    toy_init(&t, be, 5);
    tr_options o;
    tr_options_default(&o);
    o.optimizer = TR_ABS;
    o.steps = 120; /* batches of data: 14 evaluations */
    o.abs_interval = 8;
    o.eval_every = 0;
    o.quiet = 1;
    o.lr = 0.1;
    char sub[16];
    snprintf(sub, sizeof sub, "abs-%d", r);
    train_toy(&o, sub, be, &t, &sm[r], &csv[r]);
  }
  print_message("abs: %ld updates for 120 batches, accuracy %.3f\n", sm[0].steps,
                sm[0].final_eval_accuracy);
  /* 120 updates without growth; the flat growth after 16 batches makes 16 + 104 / 2 = 68, the
   * forced one after 96 then 16 + 80 / 2 + 24 / 4 = 62. */
  assert_int_equal(sm[0].steps, 62);
  assert_true(sm[0].final_eval_accuracy > 0.85);
  assert_int_equal(sm[1].steps, 62);
  char col[8192], col2[8192];
  csv_column(csv[0], 3, col, sizeof col);
  csv_column(csv[1], 3, col2, sizeof col2);
  assert_string_equal(col, col2);
  free(csv[0]);
  free(csv[1]);
}

static void test_train_errors(void **state) {
  (void)state;
  ac_backend *be = NULL;
  assert_int_equal(ac_backend_create(&be, NULL), AC_OK);
  toy t;
  toy_init(&t, be, 5);
  tr_model m = toy_model(&t);
  tr_options o;
  tr_options_default(&o);
  o.steps = 50;
  o.quiet = 1;
  tr_error err = {{0}};
  tr_summary sm;

  /* A loss that turns NaN stops the run, keeps what was done, and says why. */
  t.nan_at = 7;
  snprintf(o.out, sizeof o.out, "%s/nan", tmpdir);
  assert_int_equal(tr_train(&o, be, &m, &sm, &err), TR_ENONFINITE);
  assert_non_null(strstr(err.msg, "step 7"));
  assert_int_equal(sm.steps, 7);
  char path[256];
  snprintf(path, sizeof path, "%s/nan/summary.json", tmpdir);
  char *js = read_file(path);
  assert_non_null(js);
  assert_non_null(strstr(js, "\"status\": \"diverged\""));
  free(js);
  t.nan_at = 0;

  /* SIGTERM during a step: that step ends, is evaluated and written, status "stopped",
   * TR_OK; the handler is the caller's again afterwards. */
  t.stop_at = t.steps + 5;
  snprintf(o.out, sizeof o.out, "%s/stop", tmpdir);
  assert_int_equal(tr_train(&o, be, &m, &sm, &err), TR_OK);
  assert_int_equal(sm.steps, 5);
  assert_true(isfinite(sm.final_eval_loss));
  assert_string_equal(sm.status, "stopped");
  struct sigaction now;
  assert_int_equal(sigaction(SIGTERM, NULL, &now), 0);
  assert_true(now.sa_handler == SIG_DFL);
  t.stop_at = 0;

  /* An output directory that cannot be created. */
  snprintf(o.out, sizeof o.out, "%s/nan/summary.json/sub", tmpdir);
  assert_int_equal(tr_train(&o, be, &m, &sm, &err), TR_EIO);
  assert_non_null(strstr(err.msg, "--out"));
  o.out[0] = '\0';

  /* Bad arguments. */
  assert_int_equal(tr_train(NULL, be, &m, &sm, &err), TR_EINVAL);
  tr_model empty = m;
  empty.nparams = 0;
  assert_int_equal(tr_train(&o, be, &empty, &sm, &err), TR_EINVAL);
  tr_optimizer opt;
  assert_int_equal(tr_optimizer_init(&opt, &o, be, NULL, 2, "toy", &err), TR_EINVAL);
  assert_int_equal(tr_optimizer_init(&opt, &o, be, t.params, 2, "toy", &err), TR_OK);
  assert_int_equal(tr_optimizer_step(&opt, 0, 0.1, NULL, &err), TR_EINVAL);
  assert_int_equal(tr_optimizer_step(&opt, 1, NAN, NULL, &err), TR_EINVAL);
  assert_int_equal(tr_optimizer_step(&opt, 1, 0.1, NULL, &err), TR_OK);
  tr_optimizer_destroy(&opt);
  tr_optimizer_destroy(&opt); /* twice is harmless */

  /* ABS with a model that has no adaptive batch. */
  o.optimizer = TR_ABS;
  empty = m;
  empty.hv_grad = NULL;
  assert_int_equal(tr_train(&o, be, &empty, &sm, &err), TR_EINVAL);
  assert_non_null(strstr(err.msg, "adaptive batch"));

  /* Shampoo with no daemon at the address: a clear error, nothing leaked. */
  o.optimizer = TR_SHAMPOO;
  snprintf(o.daemon, sizeof o.daemon, "unix:%s/no-such-socket", tmpdir);
  assert_int_equal(tr_optimizer_init(&opt, &o, be, t.params, 2, "toy", &err), TR_EDAEMON);
  assert_non_null(strstr(err.msg, "cannot reach precondd"));

  toy_destroy(&t);
  ac_backend_destroy(be);
}

/* ------------------------------------------------------------------------------------ */
/* Shampoo through a real precondd                                                        */

static const char *precondd_path;
static pdproc precondd;

static int daemon_setup(void **state) {
  if (setup(state) != 0) return -1;
  return pdproc_start_in(&precondd, precondd_path, tmpdir);
}

static int daemon_teardown(void **state) {
  pdproc_stop(&precondd, SIGTERM);
  return teardown(state);
}

static void run_shampoo(int sync, const char *sub, long steps, tr_summary *sm, char **csv) {
  ac_backend *be = NULL;
  assert_int_equal(ac_backend_create(&be, NULL), AC_OK);
  toy t;
  toy_init(&t, be, 5);
  /* Roots take a poll interval (20 ms) and a computation to come back: give the async run
   * the pace of a small real model so that they arrive within it. */
  t.delay_us = sync ? 0 : 5000;
  tr_options o;
  tr_options_default(&o);
  o.optimizer = TR_SHAMPOO;
  o.steps = steps;
  o.eval_every = 20;
  o.quiet = 1;
  o.lr = 0.02;
  o.sync_roots = sync;
  snprintf(o.daemon, sizeof o.daemon, "%s", precondd.addr);
  snprintf(o.job, sizeof o.job, "toy-%s", sub);
  train_toy(&o, sub, be, &t, sm, csv);
}

static void test_shampoo_async(void **state) {
  (void)state;
  tr_summary sm;
  char *csv = NULL;
  run_shampoo(0, "async", 60, &sm, &csv);
  print_message(
      "async: loss %.4f, staleness mean %.2f max %ld, %ld fallback steps, "
      "%llu roots\n",
      sm.final_train_loss, sm.staleness_mean, sm.staleness_max, sm.fallback_steps,
      (unsigned long long)sm.roots_received);
  assert_int_equal(sm.steps, 60);
  assert_true(sm.final_train_loss < 0.6);
  assert_true(sm.final_eval_accuracy > 0.85);
  /* toy.weight (4 x 16) is one block; the bias (rank 1) takes the grafted step only. */
  assert_int_equal(sm.blocks, 1);
  assert_int_equal(sm.stats_pushed, 60);
  assert_true(sm.roots_received >= 1);
  assert_true(sm.staleness_mean >= 0);
  assert_true(sm.staleness_max >= 0);
  /* the distribution over block-steps: ordered percentiles within the max, and the
   * histogram holds every use */
  assert_true(sm.staleness_uses > 0);
  assert_true(sm.staleness_p50 <= sm.staleness_p90 && sm.staleness_p90 <= sm.staleness_p99);
  assert_true(sm.staleness_p99 <= (double)sm.staleness_max);
  uint64_t in_hist = 0;
  for (size_t k = 0; k < TR_STALENESS_BUCKETS; k++) in_hist += sm.staleness_hist[k];
  assert_true(in_hist == sm.staleness_uses);
  /* Step 1 cannot have roots yet: its statistics are still on their way. */
  assert_true(sm.fallback_steps >= 1);
  assert_true(sm.fallback_steps < 60);
  assert_non_null(strstr(csv, "\n1,"));
  free(csv);
}

static void test_shampoo_sync(void **state) {
  (void)state;
  tr_summary a, b;
  char *csv_a = NULL, *csv_b = NULL;
  run_shampoo(1, "sync-a", 25, &a, &csv_a);
  run_shampoo(1, "sync-b", 25, &b, &csv_b);
  /* Every step waits for the roots of its own statistics. */
  assert_int_equal(a.fallback_steps, 0);
  assert_int_equal(a.staleness_max, 0);
  assert_true(a.staleness_p99 == 0 && a.staleness_uses > 0);
  assert_true(a.staleness_hist[0] == a.staleness_uses);
  assert_true(a.roots_received >= 25);
  assert_true(a.final_train_loss < 1.0);
  char col[8192], col2[8192];
  csv_column(csv_a, 3, col, sizeof col);
  csv_column(csv_b, 3, col2, sizeof col2);
  assert_string_equal(col, col2);
  free(csv_a);
  free(csv_b);
}

int main(int argc, char **argv) {
  if (argc > 1) {
    precondd_path = argv[1];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shampoo_async),
        cmocka_unit_test(test_shampoo_sync),
    };
    return cmocka_run_group_tests(tests, daemon_setup, daemon_teardown);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_options),      cmocka_unit_test(test_defaults_table),
      cmocka_unit_test(test_run_schedule), cmocka_unit_test(test_progress),
      cmocka_unit_test(test_csv_json),     cmocka_unit_test(test_train_loop),
      cmocka_unit_test(test_train_errors), cmocka_unit_test(test_train_abs),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
