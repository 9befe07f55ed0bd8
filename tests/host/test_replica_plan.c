/* test_replica_plan.c -- host/replica_plan.c: the ownership of units among daemon replicas
 * (deterministic, a partition, within the greedy bound), the link's ownership rule, and the
 * %r substitution, the state directory's rank count. No MPI. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "precondd.h"

/* A Shampoo job of block size 32 over tensors of unequal shapes (units of unequal cost). */
static pd_job *make_job(void) {
  static uint64_t dims[][2] = {{64, 32}, {32, 20}, {48, 16}, {8, 12}, {40, 40}, {100, 3}};
  pd_tensor t[6];
  char names[6][16];
  for (int i = 0; i < 6; i++) {
    snprintf(names[i], sizeof names[i], "t%d", i);
    t[i] = (pd_tensor){names[i], 2, dims[i]};
  }
  pd_shampoo_opts o = {0};
  char err[256];
  o.block_size = 32;
  assert_int_equal(pd_mode_shampoo.resolve(&o, err, sizeof err), PD_OK);
  pd_job *job = NULL;
  assert_int_equal(pd_job_build("j", &pd_mode_shampoo, &o, 6, t, 1000, &job, err, sizeof err),
                   PD_OK);
  return job;
}

static void test_plan_partition_balanced(void **state) {
  (void)state;
  pd_job *job = make_job();
  for (int nranks = 1; nranks <= 5; nranks++) {
    assert_int_equal(pd_replica_plan(job, nranks), PD_OK);
    double load[5] = {0}, maxcost = 0;
    for (size_t i = 0; i < job->nblocks; i++) {
      const pd_block *b = &job->blocks[i];
      assert_true(b->owner < (uint32_t)nranks);
      double c = pd_replica_cost(b);
      assert_true(c == pow((double)b->rows, 3) + pow((double)b->cols, 3));
      load[b->owner] += c;
      maxcost = fmax(maxcost, c);
    }
    double lo = INFINITY, hi = 0;
    for (int r = 0; r < nranks; r++) {
      assert_true(load[r] == job->rank_load[r]);
      lo = fmin(lo, load[r]);
      hi = fmax(hi, load[r]);
    }
    assert_true(hi - lo <= maxcost);
    /* Deterministic: planning again gives the same owners. */
    uint32_t owners[64];
    for (size_t i = 0; i < job->nblocks; i++) owners[i] = job->blocks[i].owner;
    assert_int_equal(pd_replica_plan(job, nranks), PD_OK);
    for (size_t i = 0; i < job->nblocks; i++) assert_int_equal(job->blocks[i].owner, owners[i]);
  }
  assert_int_equal(pd_replica_plan(job, 0), PD_EINVAL);
  pd_job_free(job, NULL);
}

/* The largest unit goes to rank 0 first, the next to rank 1: equal costs break by id. */
static void test_plan_order(void **state) {
  (void)state;
  pd_job *job = make_job();
  assert_int_equal(pd_replica_plan(job, 2), PD_OK);
  size_t big = 0;
  for (size_t i = 1; i < job->nblocks; i++)
    if (pd_replica_cost(&job->blocks[i]) > pd_replica_cost(&job->blocks[big])) big = i;
  assert_int_equal(job->blocks[big].owner, 0);
  pd_job_free(job, NULL);
}

static void test_owns(void **state) {
  (void)state;
  pd_job *job = make_job();
  assert_int_equal(pd_replica_plan(job, 2), PD_OK);
  pd_replica_link link;
  memset(&link, 0, sizeof link);
  link.rank = 1;
  link.nranks = 2;
  for (size_t i = 0; i < job->nblocks; i++) {
    const pd_block *b = &job->blocks[i];
    assert_int_equal(pd_replica_owns(NULL, b), 1);
    assert_int_equal(pd_replica_owns(&link, b), b->owner == 1);
  }
  atomic_store(&link.alone, 1); /* MPI gone: this rank computes everything */
  for (size_t i = 0; i < job->nblocks; i++)
    assert_int_equal(pd_replica_owns(&link, &job->blocks[i]), 1);
  pd_job_free(job, NULL);
}

static void test_subst(void **state) {
  (void)state;
  char s[32] = "unix:/tmp/x-%r.sock";
  assert_int_equal(pd_replica_subst(s, sizeof s, 12), 0);
  assert_string_equal(s, "unix:/tmp/x-12.sock");
  char t[32] = "d-%r/%r%%";
  assert_int_equal(pd_replica_subst(t, sizeof t, 3), 0);
  assert_string_equal(t, "d-3/3%%");
  char u[12] = "abcdefgh%r";
  assert_int_equal(pd_replica_subst(u, sizeof u, 1234), -1); /* 12 chars + NUL do not fit */
  assert_string_equal(u, "abcdefgh%r");
}

/* A state directory remembers the rank count of its snapshot: a restart that restored jobs
 * under another count or rank is refused with both named; without jobs, or without the
 * file (an older daemon's directory), the start goes on and the file says the new count. */
static void test_state_check(void **state) {
  (void)state;
  char dir[] = "/tmp/pdplan-XXXXXX", why[1024] = "", path[64];
  assert_non_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/%s", dir, PD_REPLICA_STATE_FILE);
  assert_int_equal(pd_replica_state_check(dir, 0, 1, 3, why, sizeof why), PD_OK); /* no file */
  assert_int_equal(pd_replica_state_check(dir, 1, 2, 0, why, sizeof why), PD_OK); /* no jobs */
  assert_int_equal(pd_replica_state_check(dir, 1, 2, 2, why, sizeof why), PD_OK); /* same */
  assert_int_equal(pd_replica_state_check(dir, 1, 3, 2, why, sizeof why), PD_EINVAL);
  assert_non_null(strstr(why, "rank 1 of 2 daemon replicas, and this is rank 1 of 3"));
  assert_non_null(strstr(why, "mpirun -np 2"));
  assert_int_equal(pd_replica_state_check(dir, 0, 2, 2, why, sizeof why), PD_EINVAL); /* rank */
  FILE *f = fopen(path, "r");
  int r = -1, n = -1;
  assert_non_null(f);
  assert_int_equal(fscanf(f, "%d %d", &r, &n), 2); /* a refusal leaves the file */
  fclose(f);
  assert_int_equal(r, 1);
  assert_int_equal(n, 2);
  f = fopen(path, "w");
  assert_non_null(f);
  fputs("garbage\n", f); /* unreadable: as if absent */
  fclose(f);
  assert_int_equal(pd_replica_state_check(dir, 0, 4, 2, why, sizeof why), PD_OK);
  assert_int_equal(pd_replica_state_check(dir, 0, 1, 2, why, sizeof why), PD_EINVAL);
  assert_non_null(strstr(why, "rank 0 of 4"));
  unlink(path);
  assert_int_equal(rmdir(dir), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_plan_partition_balanced),
      cmocka_unit_test(test_plan_order),
      cmocka_unit_test(test_owns),
      cmocka_unit_test(test_subst),
      cmocka_unit_test(test_state_check),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
