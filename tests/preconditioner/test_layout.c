/* test_layout.c -- pc_layout: blocks tile the 2-D view exactly, diagonal rules, bad input. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "preconditioner.h"

/* Lays out the tensor and checks that the blocks cover each element of the 2-D view
 * exactly once, that none exceeds block_size, and that they are in row-major tile order. */
static void check_tiling(int rank, const size_t *dims, size_t block_size, size_t skip_limit) {
  pc_layout_opts o = {.block_size = block_size, .skip_limit = skip_limit};
  pc_layout l;
  assert_int_equal(pc_layout_init(&l, rank, dims, &o), PC_OK);

  size_t cols = 1;
  for (int i = 1; i < rank; i++) cols *= dims[i];
  assert_int_equal(l.rows, dims[0]);
  assert_int_equal(l.cols, cols);
  assert_int_equal(l.diagonal, 0);
  assert_non_null(l.blocks);

  unsigned char *hits = calloc(l.rows * l.cols, 1);
  assert_non_null(hits);
  for (size_t k = 0; k < l.nblocks; k++) {
    const pc_block *b = &l.blocks[k];
    assert_true(b->rows >= 1 && b->rows <= block_size);
    assert_true(b->cols >= 1 && b->cols <= block_size);
    assert_true(b->row0 + b->rows <= l.rows);
    assert_true(b->col0 + b->cols <= l.cols);
    if (k > 0) {
      const pc_block *a = &l.blocks[k - 1];
      assert_true(b->row0 > a->row0 || (b->row0 == a->row0 && b->col0 > a->col0));
    }
    for (size_t i = b->row0; i < b->row0 + b->rows; i++)
      for (size_t j = b->col0; j < b->col0 + b->cols; j++) hits[i * l.cols + j]++;
  }
  for (size_t e = 0; e < l.rows * l.cols; e++) assert_int_equal(hits[e], 1);
  size_t tr = (l.rows + block_size - 1) / block_size, tc = (l.cols + block_size - 1) / block_size;
  assert_int_equal(l.nblocks, tr * tc);
  size_t n = 0;
  assert_int_equal(pc_layout_count(rank, dims, &o, &n), PC_OK);
  assert_int_equal(n, l.nblocks);
  free(hits);
  pc_layout_destroy(&l);
  assert_null(l.blocks);
  assert_int_equal(l.nblocks, 0);
}

static void test_defaults(void **state) {
  (void)state;
  pc_layout_opts o;
  pc_layout_opts_default(&o);
  assert_int_equal(o.block_size, 128);
  assert_int_equal(o.skip_limit, 4096);
  pc_layout_opts_default(NULL);

  /* NULL opts means the defaults: 300 x 200 -> 3 x 2 tiles of at most 128. */
  size_t dims[2] = {300, 200};
  pc_layout l;
  assert_int_equal(pc_layout_init(&l, 2, dims, NULL), PC_OK);
  assert_int_equal(l.nblocks, 6);
  assert_int_equal(l.blocks[5].row0, 256);
  assert_int_equal(l.blocks[5].rows, 44);
  assert_int_equal(l.blocks[5].col0, 128);
  assert_int_equal(l.blocks[5].cols, 72);
  pc_layout_destroy(&l);
}

static void test_awkward_shapes(void **state) {
  (void)state;
  const size_t s1[2] = {1, 97};       /* 1 x n */
  const size_t s2[2] = {97, 1};       /* n x 1 */
  const size_t s3[2] = {131, 257};    /* primes above the block size */
  const size_t s4[2] = {7, 11};       /* below the block size */
  const size_t s5[2] = {64, 64};      /* exact multiple */
  const size_t s6[3] = {13, 5, 7};    /* rank 3 */
  const size_t s7[4] = {17, 3, 3, 5}; /* rank 4, a conv weight */
  const size_t s8[4] = {2, 3, 1, 1};  /* unit trailing dims */
  check_tiling(2, s1, 32, 4096);
  check_tiling(2, s2, 32, 4096);
  check_tiling(2, s3, 32, 4096);
  check_tiling(2, s3, 1, 4096);
  check_tiling(2, s3, 1000, 4096);
  check_tiling(2, s4, 32, 4096);
  check_tiling(2, s5, 32, 4096);
  check_tiling(2, s5, 64, 4096);
  check_tiling(3, s6, 8, 4096);
  check_tiling(4, s7, 16, 4096);
  check_tiling(4, s7, 7, 4096);
  check_tiling(4, s8, 2, 4096);
}

static void test_diagonal(void **state) {
  (void)state;
  pc_layout l;
  pc_layout_opts o = {.block_size = 8, .skip_limit = 100};

  const size_t v[1] = {50};
  assert_int_equal(pc_layout_init(&l, 1, v, &o), PC_OK);
  assert_int_equal(l.diagonal, 1);
  assert_int_equal(l.nblocks, 0);
  assert_null(l.blocks);
  assert_int_equal(l.rows, 50);
  assert_int_equal(l.cols, 1);
  pc_layout_destroy(&l);

  const size_t tall[2] = {101, 3}, wide[3] = {3, 10, 11}, edge[2] = {100, 100};
  assert_int_equal(pc_layout_init(&l, 2, tall, &o), PC_OK);
  assert_int_equal(l.diagonal, 1);
  pc_layout_destroy(&l);
  assert_int_equal(pc_layout_init(&l, 3, wide, &o), PC_OK); /* cols 110 > 100 */
  assert_int_equal(l.diagonal, 1);
  assert_int_equal(l.cols, 110);
  pc_layout_destroy(&l);
  assert_int_equal(pc_layout_init(&l, 2, edge, &o), PC_OK); /* at the limit: blocked */
  assert_int_equal(l.diagonal, 0);
  assert_int_equal(l.nblocks, 13 * 13);
  pc_layout_destroy(&l);
  pc_layout_destroy(&l); /* twice is harmless */
  pc_layout_destroy(NULL);
}

/* pc_layout_count must agree with pc_layout_init block for block: the daemon bounds a job
 * with the count and then lays it out, and the worker lays it out with init. */
static void check_count(int rank, const size_t *dims, size_t block_size, size_t skip_limit,
                        size_t expect) {
  pc_layout_opts o = {.block_size = block_size, .skip_limit = skip_limit};
  pc_layout l;
  size_t n = 12345;
  assert_int_equal(pc_layout_init(&l, rank, dims, &o), PC_OK);
  assert_int_equal(pc_layout_count(rank, dims, &o, &n), PC_OK);
  assert_int_equal(n, l.nblocks);
  assert_int_equal(n, expect);
  pc_layout_destroy(&l);
}

static void test_count(void **state) {
  (void)state;
  const size_t v[1] = {50}, big_v[1] = {100000};
  const size_t sq[2] = {300, 200}, edge[2] = {100, 100}, over[2] = {101, 3};
  const size_t wide[3] = {3, 10, 11}, conv[4] = {17, 3, 3, 5}, unit[4] = {2, 3, 1, 1};
  const size_t tiny[2] = {1, 1};
  check_count(1, v, 8, 100, 0);     /* rank 1: diagonal */
  check_count(1, big_v, 8, 100, 0); /* rank 1 above the skip limit */
  check_count(2, sq, 128, 4096, 6); /* the defaults' 3 x 2 */
  check_count(2, sq, 1, 4096, 300 * 200);
  check_count(2, sq, 1000, 4096, 1);
  check_count(2, edge, 8, 100, 13 * 13); /* at the skip limit: blocked */
  check_count(2, over, 8, 100, 0);       /* rows above the skip limit */
  check_count(3, wide, 8, 100, 0);       /* cols 110 above the skip limit */
  check_count(3, wide, 8, 110, 1 * 14);
  check_count(4, conv, 16, 4096, 2 * 3);
  check_count(4, conv, 7, 4096, 3 * 7);
  check_count(4, unit, 2, 4096, 1 * 2);
  check_count(2, tiny, 1, 1, 1);

  /* NULL opts means the defaults, as for init. */
  size_t n = 99;
  assert_int_equal(pc_layout_count(2, sq, NULL, &n), PC_OK);
  assert_int_equal(n, 6);

  /* Same errors as init; the count is 0 on failure. */
  const size_t zero[3] = {4, 0, 4}, huge[3] = {SIZE_MAX / 2, 4, 4};
  pc_layout_opts bad = {.block_size = 0, .skip_limit = 10};
  assert_int_equal(pc_layout_count(2, sq, NULL, NULL), PC_EINVAL);
  n = 99;
  assert_int_equal(pc_layout_count(2, NULL, NULL, &n), PC_EINVAL);
  assert_int_equal(n, 0);
  assert_int_equal(pc_layout_count(0, sq, NULL, &n), PC_EINVAL);
  assert_int_equal(pc_layout_count(3, zero, NULL, &n), PC_EINVAL);
  assert_int_equal(pc_layout_count(3, huge, NULL, &n), PC_EINVAL);
  assert_int_equal(pc_layout_count(2, sq, &bad, &n), PC_EINVAL);
  bad.block_size = 4;
  bad.skip_limit = 0;
  assert_int_equal(pc_layout_count(2, sq, &bad, &n), PC_EINVAL);
}

/* Shampoo's root windows: worked values, then for many steps, ids and rates that a step's
 * window starts at pc_root_window_start (the start is in the same window, the step before
 * it in an earlier one) and that each window but the first is `every` steps long. */
static void test_root_window(void **state) {
  (void)state;
  /* every 1 (and 0, taken as 1): a window per step */
  assert_int_equal(pc_root_window(7, 3, 1), 7);
  assert_int_equal(pc_root_window_start(7, 3, 1), 7);
  assert_int_equal(pc_root_window_start(7, 3, 0), 7);
  /* every 10, id 3: windows start at 7, 17, 27, ...; the first holds steps 0-6 */
  assert_int_equal(pc_root_window(6, 3, 10), 0);
  assert_int_equal(pc_root_window_start(6, 3, 10), 0);
  assert_int_equal(pc_root_window(7, 3, 10), 1);
  assert_int_equal(pc_root_window_start(7, 3, 10), 7);
  assert_int_equal(pc_root_window_start(16, 3, 10), 7);
  assert_int_equal(pc_root_window(17, 3, 10), 2);
  assert_int_equal(pc_root_window_start(17, 13, 10), 17); /* the id counts modulo every */
  for (uint64_t every = 1; every <= 12; every++)
    for (uint64_t id = 0; id < 30; id++)
      for (uint64_t step = 0; step < 60; step++) {
        uint64_t w = pc_root_window(step, id, every), s0 = pc_root_window_start(step, id, every);
        assert_true(s0 <= step && step - s0 < every);
        assert_int_equal(pc_root_window(s0, id, every), w);
        if (s0 > 0) { /* the window before: every steps long, or the first and shorter */
          uint64_t p0 = pc_root_window_start(s0 - 1, id, every);
          assert_int_equal(pc_root_window(s0 - 1, id, every), w - 1);
          if (p0 > 0)
            assert_int_equal(s0 - p0, every);
          else
            assert_true(s0 <= every);
        }
      }
}

static void test_bad_arguments(void **state) {
  (void)state;
  pc_layout l;
  const size_t dims[2] = {4, 4}, zero[3] = {4, 0, 4};
  const size_t huge[3] = {SIZE_MAX / 2, 4, 4};
  pc_layout_opts o = {.block_size = 0, .skip_limit = 10};

  assert_int_equal(pc_layout_init(NULL, 2, dims, NULL), PC_EINVAL);
  assert_int_equal(pc_layout_init(&l, 2, NULL, NULL), PC_EINVAL);
  assert_int_equal(pc_layout_init(&l, 0, dims, NULL), PC_EINVAL);
  assert_int_equal(pc_layout_init(&l, -3, dims, NULL), PC_EINVAL);
  assert_int_equal(pc_layout_init(&l, 3, zero, NULL), PC_EINVAL);
  assert_null(l.blocks);
  assert_int_equal(pc_layout_init(&l, 3, huge, NULL), PC_EINVAL);
  assert_int_equal(pc_layout_init(&l, 2, dims, &o), PC_EINVAL);
  o.block_size = 4;
  o.skip_limit = 0;
  assert_int_equal(pc_layout_init(&l, 2, dims, &o), PC_EINVAL);
  pc_layout_destroy(&l); /* left empty on failure */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults),      cmocka_unit_test(test_awkward_shapes),
      cmocka_unit_test(test_diagonal),      cmocka_unit_test(test_count),
      cmocka_unit_test(test_bad_arguments), cmocka_unit_test(test_root_window),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
