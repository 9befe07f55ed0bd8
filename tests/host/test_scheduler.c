/* test_scheduler.c -- unit tests of host/scheduler.c: roots published by the pool match a
 * local computation, the failure rule keeps the previous root, and marks during a
 * computation are not lost. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>

#include "precondd.h"
#include "preconditioner.h"
#include "shampoo_fixture.h"

static uint64_t seed = 99;
static float rnd(void) {
  seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  return (float)((double)(seed >> 11) / 9007199254740992.0) - 0.5f;
}

/* A packed G G^T of a random n x (n + 2) G. */
static void spd(size_t n, float *packed) {
  size_t k = n + 2;
  float *g = malloc(n * k * sizeof *g);
  for (size_t i = 0; i < n * k; i++) g[i] = rnd();
  assert_int_equal(pc_gram_f32(n, k, g, k, packed, NULL), PC_OK);
  free(g);
}

static int setup(void **state) {
  fixture *f = shampoo_fixture(6, 12, 18); /* 2 x 3 blocks of 6 x 6 */
  for (size_t i = 0; i < f->job->nblocks; i++) {
    pd_block *b = &f->job->blocks[i];
    spd(b->rows, b->stat[0]);
    spd(b->cols, b->stat[1]);
    atomic_store(&b->stat_step, 10);
    b->pushes = 1;
  }
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  pd_store_destroy(&f->store);
  pd_stats_destroy(&f->stats);
  free(f);
  return 0;
}

static void expect_root(size_t n, const float *stat, const float *root) {
  float *a = malloc(n * n * 4), *x = malloc(n * n * 4), *p = malloc(pc_packed_len(n) * 4);
  pc_unpack_f32(n, stat, a);
  pc_root_opts o;
  pc_root_opts_default(&o, 4);
  assert_true(pc_inverse_root_f32(n, a, x, &o, NULL) >= 0);
  pc_pack_f32(n, x, p);
  double md = 0, mx = 0;
  for (size_t i = 0; i < pc_packed_len(n); i++) {
    md = fmax(md, fabs((double)p[i] - root[i]));
    mx = fmax(mx, fabs((double)p[i]));
  }
  assert_true(md <= 1e-5 * mx);
  free(a);
  free(x);
  free(p);
}

/* Always compute (drift test off), with the default failure threshold, or one nothing meets. */
static const pd_sched_rules compute_all = {0.1, 0, NULL, 0, 0}, refuse_all = {-1.0, 0, NULL, 0, 0};

static pd_root_outcome compute(pd_block *b, pd_stats *stats, const pd_sched_rules *rules) {
  pd_root_outcome out = (pd_root_outcome)-1;
  assert_int_equal(pd_sched_compute(b, stats, rules, &out), PD_OK);
  return out;
}

static void test_compute_and_failure_rule(void **state) {
  fixture *f = *state;
  pd_block *b = &f->job->blocks[0];
  assert_int_equal(compute(b, &f->stats, &compute_all), PD_ROOT_PUBLISHED);
  assert_non_null(b->root);
  assert_int_equal(b->root->version, 1);
  assert_int_equal(b->root->source_step, 10);
  assert_int_equal(atomic_load(&b->root_step), 10);
  expect_root(b->rows, b->stat[0], b->root->part[0]);
  expect_root(b->cols, b->stat[1], b->root->part[1]);

  /* A threshold nothing meets: not published, counted, the old root stays. */
  pd_root *before = b->root;
  atomic_store(&b->stat_step, 11);
  assert_int_equal(compute(b, &f->stats, &refuse_all), PD_ROOT_FAILED);
  assert_ptr_equal(b->root, before);
  assert_int_equal(b->roots_failed, 1);
  assert_int_equal(atomic_load(&f->stats.roots_failed), 1);

  /* Non-finite statistics (they cannot arrive through the service, which refuses them). */
  b->stat[0][1] = NAN;
  assert_int_equal(compute(b, &f->stats, &compute_all), PD_ROOT_FAILED);
  assert_ptr_equal(b->root, before);
  assert_int_equal(b->roots_failed, 2);
}

static void test_pool_computes_all(void **state) {
  fixture *f = *state;
  pd_sched s;
  assert_int_equal(pd_sched_start(&s, 2, &f->stats, &compute_all), PD_OK);
  for (size_t i = 0; i < f->job->nblocks; i++)
    assert_int_equal(pd_sched_mark(&s, &f->job->blocks[i]), PD_OK);
  /* Marking twice while queued is a no-op. */
  pd_sched_mark(&s, &f->job->blocks[0]);
  for (int tries = 0; tries < 1000 && atomic_load(&f->stats.roots_computed) < f->job->nblocks;
       tries++) {
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  /* The extra mark was either absorbed (still queued) or queued a recomputation. */
  for (int tries = 0; tries < 1000 && pd_sched_depth(&s) > 0; tries++) {
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  assert_int_equal(pd_sched_depth(&s), 0);
  pd_sched_stop(&s);
  for (size_t i = 0; i < f->job->nblocks; i++) {
    pd_block *b = &f->job->blocks[i];
    assert_non_null(b->root);
    expect_root(b->rows, b->stat[0], b->root->part[0]);
  }
  assert_int_equal(atomic_load(&f->stats.roots_failed), 0);
  double p50, p90, p99;
  pd_stats_percentiles(&f->stats, &p50, &p90, &p99);
  assert_true(p50 > 0 && p50 <= p99);
}

/* How many threads of this process named pd-pool run at nice value want (Linux: the
 * comm file and field 19 of each /proc/self/task/TID/stat). */
static int pool_threads_at(int want) {
  DIR *dir = opendir("/proc/self/task");
  assert_non_null(dir);
  int found = 0;
  for (struct dirent *e; (e = readdir(dir)) != NULL;) {
    if (e->d_name[0] == '.') continue;
    char path[300], buf[512];
    snprintf(path, sizeof path, "/proc/self/task/%s/stat", e->d_name);
    FILE *f = fopen(path, "r");
    if (f == NULL) continue; /* a thread that has just ended */
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *close = strrchr(buf, ')');
    if (strstr(buf, "(pd-pool)") == NULL || close == NULL) continue;
    /* after ") ": state (field 3), then fields 4 .. 19: nice is the 17th token */
    const char *p = close + 2;
    for (int k = 0; k < 16 && p != NULL; k++) {
      p = strchr(p, ' ');
      if (p != NULL) p++;
    }
    found += p != NULL && atoi(p) == want;
  }
  closedir(dir);
  return found;
}

/* --pool-nice: each pool thread lowers its own priority, the calling thread keeps its own,
 * and the pool still computes every root. */
static void test_pool_nice(void **state) {
  fixture *f = *state;
  const int mine = getpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid));
  const int want = mine + 5 < 19 ? mine + 5 : 19; /* raising a nice value needs no privilege */
  pd_sched_rules rules = compute_all;
  rules.pool_nice = want;
  pd_sched s;
  assert_int_equal(pd_sched_start(&s, 2, &f->stats, &rules), PD_OK);
  for (size_t i = 0; i < f->job->nblocks; i++)
    assert_int_equal(pd_sched_mark(&s, &f->job->blocks[i]), PD_OK);
  int at = 0;
  for (int tries = 0; tries < 1000 && (at = pool_threads_at(want)) < 2; tries++) {
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  assert_int_equal(at, 2);
  assert_int_equal(getpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid)), mine);
  for (int tries = 0; tries < 1000 && atomic_load(&f->stats.roots_computed) < f->job->nblocks;
       tries++) {
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  pd_sched_stop(&s);
  assert_int_equal(atomic_load(&f->stats.roots_computed), f->job->nblocks);
  for (size_t i = 0; i < f->job->nblocks; i++) assert_non_null(f->job->blocks[i].root);
}

/* A block whose statistic is negative definite can never get a root from later positive
 * pushes added to it: its failures carry a reason and a NaN error (not 0), and after
 * PD_FAILURES_BEFORE_RESET of them in a row its statistics are zeroed and the reset is
 * counted, so that the pushes that follow give it roots again. */
static void test_failing_block_recovers(void **state) {
  fixture *f = *state;
  pd_block *b = &f->job->blocks[0];
  size_t ll = pc_packed_len(b->rows), lr = pc_packed_len(b->cols);
  for (size_t i = 0; i < ll; i++) b->stat[0][i] = 0;
  for (size_t i = 0, k = 0; i < b->rows; k += b->rows - i, i++) b->stat[0][k] = -1.0f;
  for (unsigned i = 0; i < PD_FAILURES_BEFORE_RESET; i++) {
    assert_int_equal(b->resets, 0);
    assert_int_equal(compute(b, &f->stats, &compute_all), PD_ROOT_FAILED);
    assert_true(strlen(b->last_failure) > 0);
    assert_true(isnan(b->last_error) || b->last_error > 0.1);
  }
  assert_int_equal(b->resets, 1);
  assert_int_equal(b->roots_failed, PD_FAILURES_BEFORE_RESET);
  for (size_t i = 0; i < ll; i++) assert_true(b->stat[0][i] == 0.0f);
  for (size_t i = 0; i < lr; i++) assert_true(b->stat[1][i] == 0.0f);
  float *l = malloc(ll * sizeof *l), *r = malloc(lr * sizeof *r);
  spd(b->rows, l);
  spd(b->cols, r);
  pd_block_update(b, (const float *[]){l, r}, 11, &f->stats);
  assert_int_equal(compute(b, &f->stats, &compute_all), PD_ROOT_PUBLISHED);
  assert_int_equal(b->failures_in_row, 0);
  free(l);
  free(r);
}

static void scale(size_t n, float *packed, float by) {
  for (size_t i = 0; i < pc_packed_len(n); i++) packed[i] *= by;
}

/* The drift test: statistics that did not move (or moved less than the threshold) keep
 * their root, republished as of the new step and counted; a large move, or small moves
 * that add up past the threshold, computes a new one. */
static void test_drift_skip(void **state) {
  fixture *f = *state;
  pd_block *b = &f->job->blocks[0];
  const pd_sched_rules rules = {0.1, 0.01, NULL, 0, 0};
  assert_int_equal(compute(b, &f->stats, &rules), PD_ROOT_PUBLISHED); /* no reference yet */
  assert_true(isnan(b->last_drift));
  float *kept = malloc(pc_packed_len(b->rows) * sizeof *kept);
  memcpy(kept, b->root->part[0], pc_packed_len(b->rows) * sizeof *kept);

  atomic_store(&b->stat_step, 11); /* a push of nothing new */
  assert_int_equal(compute(b, &f->stats, &rules), PD_ROOT_SKIPPED);
  assert_int_equal(b->roots_skipped, 1);
  assert_int_equal(atomic_load(&f->stats.roots_skipped), 1);
  assert_int_equal(b->roots_computed, 1);
  assert_true(b->last_drift == 0);
  assert_int_equal(b->root->version, 2);
  assert_int_equal(b->root->source_step, 11);
  assert_int_equal(atomic_load(&b->root_step), 11);
  assert_memory_equal(b->root->part[0], kept, pc_packed_len(b->rows) * sizeof *kept);

  /* With the test off the same statistics are computed. */
  atomic_store(&b->stat_step, 12);
  assert_int_equal(compute(b, &f->stats, &compute_all), PD_ROOT_PUBLISHED);
  assert_int_equal(b->roots_computed, 2);

  /* A uniform scale is not drift (the root of c S is c^(-1/4) times the root of S): kept,
   * and republished rescaled, which is what a computation would give. */
  scale(b->rows, b->stat[0], 16.0f);
  atomic_store(&b->stat_step, 13);
  assert_int_equal(compute(b, &f->stats, &rules), PD_ROOT_SKIPPED);
  assert_true(b->last_drift < 1e-6);
  expect_root(b->rows, b->stat[0], b->root->part[0]);
  expect_root(b->cols, b->stat[1], b->root->part[1]);

  /* Small changes of shape add up: kept while under the threshold, then computed. */
  double tr = 0;
  for (size_t i = 0, k = 0; i < b->rows; k += b->rows - i, i++) tr += b->stat[0][k];
  pd_root_outcome out = PD_ROOT_SKIPPED;
  int pushes = 0;
  while (out == PD_ROOT_SKIPPED && pushes < 100) {
    b->stat[0][0] += (float)(0.002 * tr); /* entry (0, 0) */
    atomic_store(&b->stat_step, 14 + (uint64_t)pushes++);
    out = compute(b, &f->stats, &rules);
    if (out == PD_ROOT_SKIPPED) assert_true(b->last_drift < 0.01);
  }
  assert_int_equal(out, PD_ROOT_PUBLISHED);
  assert_true(pushes >= 2);
  assert_true(b->last_drift >= 0.01);
  expect_root(b->rows, b->stat[0], b->root->part[0]);

  /* A change at the same trace (an off-diagonal coupling) is seen by the random probes. */
  b->stat[1][1] += 0.2f * b->stat[1][0]; /* (0, 1): off-diagonal, trace unchanged */
  atomic_store(&b->stat_step, 200);
  assert_int_equal(compute(b, &f->stats, &rules), PD_ROOT_PUBLISHED);
  free(kept);
}

/* The pool's order: no root first, then the stalest, then the cheaper. */
static void test_order(void **state) {
  fixture *f = *state;
  pd_block *a = &f->job->blocks[0], *b = &f->job->blocks[1];
  atomic_store(&a->has_root, 1);
  atomic_store(&b->has_root, 0);
  assert_true(pd_sched_before(b, a) && !pd_sched_before(a, b));
  atomic_store(&b->has_root, 1);
  atomic_store(&a->stat_step, 20);
  atomic_store(&a->root_step, 15); /* 5 steps stale */
  atomic_store(&b->stat_step, 20);
  atomic_store(&b->root_step, 18); /* 2 */
  assert_true(pd_sched_before(a, b) && !pd_sched_before(b, a));
  atomic_store(&b->root_step, 15);
  b->cols = 3; /* equally stale, cheaper */
  assert_true(pd_sched_before(b, a) && !pd_sched_before(a, b));
  b->cols = 6;
}

/* OpenBLAS threads: one below PD_BLAS_WIDE_ORDER, the pool's cores / workers from it on;
 * and a pool of one worker on this host's cores leaves OpenBLAS on one thread after
 * computing small blocks, where it started it on every core. */
static void test_blas_threads(void **state) {
  fixture *f = *state;
  assert_int_equal(pd_sched_blas_threads(128, 2), 1);
  assert_int_equal(pd_sched_blas_threads(PD_BLAS_WIDE_ORDER - 1, 4), 1);
  assert_int_equal(pd_sched_blas_threads(PD_BLAS_WIDE_ORDER, 4), 4);
  assert_int_equal(pd_sched_blas_threads(4096, 1), 1);
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  pd_sched s;
  assert_int_equal(pd_sched_start(&s, 1, &f->stats, &compute_all), PD_OK);
  assert_int_equal(s.blas_wide, cores > 1 ? (int)cores : 1);
  assert_int_equal(pd_sched_mark(&s, &f->job->blocks[0]), PD_OK);
  for (int tries = 0; tries < 1000 && atomic_load(&f->stats.roots_computed) < 1; tries++) {
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  pd_sched_stop(&s);
  assert_int_equal(atomic_load(&f->stats.roots_computed), 1);
  assert_int_equal(openblas_get_num_threads(), 1);
}

int main(void) {
  pd_log_set_level(PD_LOG_ERROR);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_compute_and_failure_rule, setup, teardown),
      cmocka_unit_test_setup_teardown(test_pool_computes_all, setup, teardown),
      cmocka_unit_test_setup_teardown(test_pool_nice, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failing_block_recovers, setup, teardown),
      cmocka_unit_test_setup_teardown(test_drift_skip, setup, teardown),
      cmocka_unit_test_setup_teardown(test_order, setup, teardown),
      cmocka_unit_test_setup_teardown(test_blas_threads, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
