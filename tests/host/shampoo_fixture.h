/*
 * shampoo_fixture.h -- a store holding one Shampoo job of one rows x cols tensor, built
 * through the mode table as precondd builds it; shared by the tests of the scheduler and of
 * the Shampoo mode. Include after cmocka.h and precondd.h.
 */
#ifndef SHAMPOO_FIXTURE_H
#define SHAMPOO_FIXTURE_H

#include <stdlib.h>

typedef struct {
  pd_stats stats;
  pd_store store;
  pd_job *job;
} fixture;

/* A 1 GiB store with job "j" of tensor "w" (rows x cols) in blocks of block_size. The caller
 * owns the result: pd_store_destroy, pd_stats_destroy, free. */
static fixture *shampoo_fixture(size_t block_size, uint64_t rows, uint64_t cols) {
  fixture *f = calloc(1, sizeof *f);
  char err[256];
  assert_non_null(f);
  pd_stats_init(&f->stats);
  pd_store_init(&f->store, &f->stats, (size_t)1 << 30, 1000);
  pd_shampoo_opts o = {0};
  assert_int_equal(pd_mode_shampoo.resolve(&o, err, sizeof err), PD_OK);
  o.block_size = block_size;
  uint64_t dims[2] = {rows, cols};
  pd_tensor t = {(char *)"w", 2, dims};
  pd_job *existing;
  assert_int_equal(pd_job_build("j", &pd_mode_shampoo, &o, 1, &t, 100, &f->job, err, sizeof err),
                   PD_OK);
  assert_int_equal(pd_store_add(&f->store, f->job, &existing), PD_OK);
  return f;
}

#endif
