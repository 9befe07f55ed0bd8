/* test_replica_plan.c -- host/replica_plan.c: the ownership of units among daemon replicas
 * (deterministic, a partition, within the greedy bound), the link's ownership rule, and the
 * %r substitution, the plan of a resume from the ranks' state directories. No MPI. */
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

#define V(state, rank, nranks, run) \
  { PD_VIEW_##state, rank, nranks, run, 77 }

/* The resume plan every rank derives from the views of all: as before when nothing or an
 * older daemon's snapshot is there or everything matches; resharded from rank 0's count and
 * run otherwise (a new rank count, a directory of another rank, a stale one), with a new run. */
static void test_resume_plan(void **state) {
  (void)state;
  static const struct {
    const char *what;
    int nranks;
    pd_replica_view v[3];
    pd_resume_plan want; /* reshard, old_nranks, old_run, run */
  } cases[] = {
      {"nothing to resume: rank 0's fresh run",
       2,
       {V(NONE, 0, 0, 0), V(EMPTY, 1, 2, 5)},
       {0, 2, 0, 77}},
      {"the same count and run: the run goes on",
       2,
       {V(JOBS, 0, 2, 5), V(JOBS, 1, 2, 5)},
       {0, 2, 5, 5}},
      {"a rank lost its directory: as before",
       2,
       {V(JOBS, 0, 2, 5), V(NONE, 0, 0, 0)},
       {0, 2, 5, 5}},
      {"older daemons' snapshots: as before",
       2,
       {V(JOBS, -1, 0, 0), V(JOBS, -1, 0, 0)},
       {0, 2, 0, 77}},
      {"2 -> 3", 3, {V(JOBS, 0, 2, 5), V(JOBS, 1, 2, 5), V(NONE, 0, 0, 0)}, {1, 2, 5, 6}},
      {"2 -> 1", 1, {V(JOBS, 0, 2, 5)}, {1, 2, 5, 6}},
      {"1 -> 2", 2, {V(JOBS, 0, 1, 9), V(NONE, 0, 0, 0)}, {1, 1, 9, 10}},
      {"3 -> 2 -> 3: rank 2 holds the older run",
       3,
       {V(JOBS, 0, 2, 6), V(JOBS, 1, 2, 6), V(JOBS, 2, 3, 5)},
       {1, 2, 6, 7}},
      {"directories swapped (the load names them)",
       2,
       {V(JOBS, 1, 2, 5), V(JOBS, 0, 2, 5)},
       {1, 2, 5, 6}},
      {"rank 0 without jobs names the run",
       3,
       {V(EMPTY, 0, 3, 8), V(JOBS, 1, 2, 5), V(EMPTY, 2, 3, 8)},
       {1, 3, 8, 9}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    pd_resume_plan p;
    pd_replica_resume_plan(cases[i].v, cases[i].nranks, &p);
    if (memcmp(&p, &cases[i].want, sizeof p) != 0)
      fail_msg("%s: reshard %d from %d ranks (run %llu), run %llu", cases[i].what, p.reshard,
               p.old_nranks, (unsigned long long)p.old_run, (unsigned long long)p.run);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_plan_partition_balanced),
      cmocka_unit_test(test_plan_order),
      cmocka_unit_test(test_owns),
      cmocka_unit_test(test_subst),
      cmocka_unit_test(test_resume_plan),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
