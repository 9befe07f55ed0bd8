/* test_modes.c -- unit tests of host/modes.c, the mode table: lookup, and the toy identity
 * mode (host/mode_identity.c, one file and one table line) driven through the store, the
 * pool, and a snapshot round trip, to show the core runs a mode it knows nothing about. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "precondd.h"
#include "preconditioner.h"

static void test_lookup(void **state) {
  (void)state;
  assert_ptr_equal(pd_mode_find(PD_MODE_SHAMPOO), &pd_mode_shampoo);
  const pd_mode *id = pd_mode_find(PD_MODE_IDENTITY);
  assert_non_null(id);
  assert_string_equal(id->name, "identity");
  assert_ptr_equal(pd_mode_find(PD_MODE_KFAC), &pd_mode_kfac);
  assert_null(pd_mode_find(-1));
}

/* An identity job: t0 [3, 4] -> one unit of order 3; t1 [300, 2] -> none (above 256);
 * t2 [5] -> one unit of order 5. Options: scale 2. */
static pd_job *identity_job(pd_store *st) {
  const pd_mode *m = pd_mode_find(PD_MODE_IDENTITY);
  char err[256];
  _Alignas(max_align_t) unsigned char opts[PD_MODE_OPTS_MAX] = {0};
  float two = 2.0f;
  uint32_t bits;
  unsigned char section[4];
  memcpy(&bits, &two, 4);
  pd_le_put(section, bits, 4);
  m->snap_read(section, opts); /* options private to the mode: set through its section */
  assert_int_equal(m->resolve(opts, err, sizeof err), PD_OK);
  uint64_t d0[2] = {3, 4}, d1[2] = {300, 2}, d2[1] = {5};
  pd_tensor t[3] = {{(char *)"a", 2, d0}, {(char *)"b", 2, d1}, {(char *)"c", 1, d2}};
  pd_job *job = NULL, *existing = NULL;
  assert_int_equal(pd_job_build("id", m, opts, 3, t, 100, &job, err, sizeof err), PD_OK);
  assert_int_equal(pd_store_add(st, job, &existing), PD_OK);
  return job;
}

static void test_identity_through_the_core(void **state) {
  (void)state;
  pd_stats stats;
  pd_store st;
  assert_int_equal(pd_stats_init(&stats), PD_OK);
  assert_int_equal(pd_store_init(&st, &stats, (size_t)1 << 30, 100), PD_OK);
  pd_job *job = identity_job(&st);
  assert_int_equal(job->nblocks, 2);
  assert_int_equal(job->ndiag, 1);
  assert_int_equal(job->diag[0], 1);
  assert_int_equal(job->blocks[1].tensor, 2);
  assert_int_equal(job->blocks[1].nparts, 1);
  assert_int_equal(job->blocks[1].order[0], 5);

  /* Pushes add; the result is twice the sum. */
  float inc[15];
  for (int i = 0; i < 15; i++) inc[i] = (float)i;
  for (size_t u = 0; u < job->nblocks; u++) {
    const float *parts[1] = {inc};
    pd_block_update(&job->blocks[u], parts, 1, &stats);
    pd_block_update(&job->blocks[u], parts, 2, &stats);
  }
  pd_sched_rules rules = {0.1, 0.01, NULL, 0, 0};
  pd_root_outcome out;
  pd_block *b = &job->blocks[1];
  assert_int_equal(pd_sched_compute(b, &stats, &rules, &out), PD_OK);
  assert_int_equal(out, PD_ROOT_PUBLISHED);
  for (int i = 0; i < 15; i++) assert_true(b->root->part[0][i] == 4.0f * (float)i);
  assert_int_equal(b->root->source_step, 2);
  /* The mode opted out of the drift test: unchanged statistics are computed again. */
  atomic_store(&b->stat_step, 3);
  assert_int_equal(pd_sched_compute(b, &stats, &rules, &out), PD_OK);
  assert_int_equal(out, PD_ROOT_PUBLISHED);
  assert_int_equal(b->root->version, 2);

  /* The pool computes the other unit. */
  pd_sched s;
  assert_int_equal(pd_sched_start(&s, 1, &stats, &rules), PD_OK);
  assert_int_equal(pd_sched_mark(&s, &job->blocks[0]), PD_OK);
  for (int i = 0; i < 1000 && !atomic_load(&job->blocks[0].has_root); i++) {
    struct timespec ts = {0, 5000000};
    nanosleep(&ts, NULL);
  }
  pd_sched_stop(&s);
  assert_non_null(job->blocks[0].root);
  for (int i = 0; i < 6; i++) assert_true(job->blocks[0].root->part[0][i] == 4.0f * (float)i);

  /* A snapshot round trip restores the mode, its options, state and results. */
  char dir[] = "/tmp/test_modes_XXXXXX";
  assert_non_null(mkdtemp(dir));
  assert_int_equal(pd_snapshot_write(&st, dir), PD_OK);
  pd_stats stats2;
  pd_store st2;
  char err[256];
  assert_int_equal(pd_stats_init(&stats2), PD_OK);
  assert_int_equal(pd_store_init(&st2, &stats2, (size_t)1 << 30, 100), PD_OK);
  assert_int_equal(pd_snapshot_read(&st2, dir, err, sizeof err), PD_OK);
  pd_job *back = pd_store_get(&st2, "id", 0);
  assert_non_null(back);
  assert_ptr_equal(back->mode, pd_mode_find(PD_MODE_IDENTITY));
  assert_true(pd_job_same(job, back));
  for (size_t u = 0; u < job->nblocks; u++) {
    size_t n = pc_packed_len(job->blocks[u].order[0]);
    assert_memory_equal(back->blocks[u].stat[0], job->blocks[u].stat[0], n * sizeof(float));
    assert_memory_equal(back->blocks[u].root->part[0], job->blocks[u].root->part[0],
                        n * sizeof(float));
  }
  char path[256];
  snprintf(path, sizeof path, "%s/%s", dir, PD_SNAPSHOT_FILE);
  unlink(path);
  rmdir(dir);
  pd_job_unref(back, &stats2);
  pd_store_destroy(&st2);
  pd_stats_destroy(&stats2);
  pd_store_destroy(&st);
  assert_int_equal(atomic_load(&stats.memory_bytes), 0);
  pd_stats_destroy(&stats);
}

int main(void) {
  pd_log_set_level(PD_LOG_ERROR);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_lookup),
      cmocka_unit_test(test_identity_through_the_core),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
