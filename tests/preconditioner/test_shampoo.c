/* test_shampoo.c -- Gram matrices, statistic updates and the preconditioned direction,
 * against naive loops and roots computed here in fp64 with LAPACKE_dsyevd. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include <cmocka.h>
#include <cblas.h>
#include <lapacke.h>

#include "preconditioner.h"
#include "test_util.h"

/* ------------------------------------------------------------------------------------ */
/* Helpers                                                                                */

static void fill_f64(size_t count, double *x) {
  for (size_t i = 0; i < count; i++) x[i] = uniform();
}

/* n(n+1)/2, written here so the test stands on its own. */
static size_t packed_len(size_t n) {
  return n * (n + 1) / 2;
}

/* Index of (i, j), i <= j, in a packed row-major upper triangle of order n. */
static size_t packed_index(size_t n, size_t i, size_t j) {
  return i * n - i * (i - 1) / 2 + (j - i);
}

static double max_abs_f64(size_t count, const double *x) {
  double m = 0.0;
  for (size_t i = 0; i < count; i++) m = fmax(m, fabs(x[i]));
  return m;
}

/* Symmetric PSD n x n matrix with eigenvalues spread over about two decades:
 * B B^T / k + 0.01 I for a random n x k B. */
static void random_spd(size_t n, double *a) {
  size_t k = n + 3;
  double *b = malloc(n * k * sizeof *b);
  assert_non_null(b);
  fill_f64(n * k, b);
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++) {
      double s = 0.0;
      for (size_t t = 0; t < k; t++) s += b[i * k + t] * b[j * k + t];
      a[i * n + j] = s / (double)k + (i == j ? 0.01 : 0.0);
    }
  free(b);
}

/* a^(-1/4) in fp64 by eigendecomposition: V diag(w^(-1/4)) V^T. */
static void inverse_fourth_root(size_t n, const double *a, double *x) {
  double *v = malloc(n * n * sizeof *v), *w = malloc(n * sizeof *w);
  assert_non_null(v);
  assert_non_null(w);
  memcpy(v, a, n * n * sizeof *v);
  assert_int_equal(LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'V', 'U', (lapack_int)n, v, (lapack_int)n, w),
                   0);
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++) {
      double s = 0.0;
      for (size_t t = 0; t < n; t++) s += v[i * n + t] * pow(w[t], -0.25) * v[j * n + t];
      x[i * n + j] = s;
    }
  free(v);
  free(w);
}

/* c = a b, naive, a m x k (stride lda), b k x n (stride ldb), c m x n (stride n). */
static void matmul(size_t m, size_t k, size_t n, const double *a, size_t lda, const double *b,
                   size_t ldb, double *c) {
  for (size_t i = 0; i < m; i++)
    for (size_t j = 0; j < n; j++) {
      double s = 0.0;
      for (size_t t = 0; t < k; t++) s += a[i * lda + t] * b[t * ldb + j];
      c[i * n + j] = s;
    }
}

/* ------------------------------------------------------------------------------------ */
/* Gram                                                                                   */

static void check_gram(size_t rows, size_t cols, size_t ld) {
  double *g = malloc(rows * ld * sizeof *g);
  float *gf = malloc(rows * ld * sizeof *gf);
  double *l64 = malloc(packed_len(rows) * sizeof *l64);
  double *r64 = malloc(packed_len(cols) * sizeof *r64);
  float *l32 = malloc(packed_len(rows) * sizeof *l32);
  float *r32 = malloc(packed_len(cols) * sizeof *r32);
  assert_true(g && gf && l64 && r64 && l32 && r32);
  fill_f64(rows * ld, g);
  for (size_t i = 0; i < rows * ld; i++) gf[i] = (float)g[i];
  /* padding past cols must not be read: poison it */
  for (size_t i = 0; i < rows; i++)
    for (size_t j = cols; j < ld; j++) g[i * ld + j] = gf[i * ld + j] = NAN;

  assert_int_equal(pc_gram_f64(rows, cols, g, ld, l64, r64), PC_OK);
  assert_int_equal(pc_gram_f32(rows, cols, gf, ld, l32, r32), PC_OK);
  for (size_t i = 0; i < rows; i++)
    for (size_t j = i; j < rows; j++) {
      double s = 0.0, sf = 0.0;
      for (size_t t = 0; t < cols; t++) {
        s += g[i * ld + t] * g[j * ld + t];
        sf += (double)gf[i * ld + t] * gf[j * ld + t];
      }
      size_t k = packed_index(rows, i, j);
      assert_true(fabs(l64[k] - s) <= 1e-12 * (double)cols);
      assert_true(fabs(l32[k] - sf) <= 1e-5 * (double)cols);
    }
  for (size_t i = 0; i < cols; i++)
    for (size_t j = i; j < cols; j++) {
      double s = 0.0, sf = 0.0;
      for (size_t t = 0; t < rows; t++) {
        s += g[t * ld + i] * g[t * ld + j];
        sf += (double)gf[t * ld + i] * gf[t * ld + j];
      }
      size_t k = packed_index(cols, i, j);
      assert_true(fabs(r64[k] - s) <= 1e-12 * (double)rows);
      assert_true(fabs(r32[k] - sf) <= 1e-5 * (double)rows);
    }

  /* One side only: the other output is not touched. */
  float sentinel = 12345.0f;
  r32[0] = sentinel;
  assert_int_equal(pc_gram_f32(rows, cols, gf, ld, l32, NULL), PC_OK);
  assert_true(r32[0] == sentinel);
  assert_int_equal(pc_gram_f32(rows, cols, gf, ld, NULL, NULL), PC_OK);
  free(g);
  free(gf);
  free(l64);
  free(r64);
  free(l32);
  free(r32);
}

static void test_gram(void **state) {
  (void)state;
  rng_state = 0x9e3779b97f4a7c15ull;
  check_gram(1, 1, 1);
  check_gram(1, 17, 17);
  check_gram(17, 1, 3);
  check_gram(7, 13, 13);
  check_gram(13, 7, 20);
  check_gram(40, 3, 5);
  check_gram(64, 64, 70);
}

/* ------------------------------------------------------------------------------------ */
/* Statistics                                                                             */

static void test_stat_update(void **state) {
  (void)state;
  rng_state = 12345;
  enum { N = 37 };
  double s[N], inc[N], ref[N];
  float sf[N], incf[N], reff[N];
  fill_f64(N, s);
  memcpy(ref, s, sizeof s);
  for (size_t i = 0; i < N; i++) sf[i] = reff[i] = (float)s[i];

  const double betas[] = {0.999, 0.5, 0.0, 1.0, 0.95};
  for (size_t b = 0; b < sizeof betas / sizeof betas[0]; b++) {
    fill_f64(N, inc);
    for (size_t i = 0; i < N; i++) incf[i] = (float)inc[i];
    double beta = betas[b];
    for (size_t i = 0; i < N; i++) {
      ref[i] = beta == 1.0 ? ref[i] + inc[i] : beta * ref[i] + (1.0 - beta) * inc[i];
      reff[i] = beta == 1.0 ? reff[i] + incf[i] : (float)(beta * reff[i] + (1.0 - beta) * incf[i]);
    }
    pc_stat_update_f64(N, s, inc, beta);
    pc_stat_update_f32(N, sf, incf, (float)beta);
    for (size_t i = 0; i < N; i++) {
      assert_true(fabs(s[i] - ref[i]) <= 1e-15 * (1.0 + fabs(ref[i])));
      assert_true(fabs(sf[i] - reff[i]) <= 1e-6f * (1.0f + fabsf(reff[i])));
    }
  }
  /* beta2 = 1 sums exactly, beta2 = 0 replaces */
  double a[2] = {1.0, 2.0}, d[2] = {0.5, 0.25};
  pc_stat_update_f64(2, a, d, 1.0);
  assert_true(a[0] == 1.5 && a[1] == 2.25);
  pc_stat_update_f64(2, a, d, 0.0);
  assert_true(a[0] == 0.5 && a[1] == 0.25);
  pc_stat_update_f32(3, NULL, incf, 0.9f); /* no-op, no crash */
  pc_stat_update_f64(3, s, NULL, 0.9);
}

/* Gram then update over a few steps is the EMA of G G^T written as loops. */
static void test_stat_of_grams(void **state) {
  (void)state;
  rng_state = 777;
  enum { M = 6, N = 9, STEPS = 4 };
  double g[M * N], lref[M * M] = {0}, l[M * (M + 1) / 2] = {0}, inc[M * (M + 1) / 2];
  const double beta = 0.9;
  for (int s = 0; s < STEPS; s++) {
    fill_f64(M * N, g);
    assert_int_equal(pc_gram_f64(M, N, g, N, inc, NULL), PC_OK);
    pc_stat_update_f64(packed_len(M), l, inc, beta);
    for (size_t i = 0; i < M; i++)
      for (size_t j = 0; j < M; j++) {
        double x = 0.0;
        for (size_t t = 0; t < N; t++) x += g[i * N + t] * g[j * N + t];
        lref[i * M + j] = beta * lref[i * M + j] + (1.0 - beta) * x;
      }
  }
  for (size_t i = 0; i < M; i++)
    for (size_t j = i; j < M; j++)
      assert_true(fabs(l[packed_index(M, i, j)] - lref[i * M + j]) <= 1e-13);
}

/* ------------------------------------------------------------------------------------ */
/* Direction                                                                              */

/* The fp64 result p and the fp32 result pf (both rows x cols, stride ld) against want
 * (stride cols), relative to scale = max |want|. */
static void assert_direction(size_t rows, size_t cols, size_t ld, const double *p, const float *pf,
                             const double *want, double scale) {
  for (size_t i = 0; i < rows; i++)
    for (size_t j = 0; j < cols; j++) {
      assert_true(fabs(p[i * ld + j] - want[i * cols + j]) <= 1e-12 * scale);
      assert_true(fabs(pf[i * ld + j] - want[i * cols + j]) <= 1e-5 * scale);
    }
}

/* P = L^(-1/4) G R^(-1/4) with statistics and roots built here in fp64. */
static void check_direction(size_t rows, size_t cols, size_t ld) {
  double *lst = malloc(rows * rows * sizeof(double)), *rst = malloc(cols * cols * sizeof(double));
  double *lr = malloc(rows * rows * sizeof(double)), *rr = malloc(cols * cols * sizeof(double));
  double *g = malloc(rows * ld * sizeof(double)), *t = malloc(rows * cols * sizeof(double));
  double *want = malloc(rows * cols * sizeof(double)), *p = malloc(rows * ld * sizeof(double));
  float *lrf = malloc(rows * rows * sizeof(float)), *rrf = malloc(cols * cols * sizeof(float));
  float *gf = malloc(rows * ld * sizeof(float)), *pf = malloc(rows * ld * sizeof(float));
  assert_true(lst && rst && lr && rr && g && t && want && p && lrf && rrf && gf && pf);

  random_spd(rows, lst);
  random_spd(cols, rst);
  inverse_fourth_root(rows, lst, lr);
  inverse_fourth_root(cols, rst, rr);
  fill_f64(rows * ld, g);
  for (size_t i = 0; i < rows * rows; i++) lrf[i] = (float)lr[i];
  for (size_t i = 0; i < cols * cols; i++) rrf[i] = (float)rr[i];
  for (size_t i = 0; i < rows * ld; i++) gf[i] = (float)g[i];

  /* The test's own roots are right: (X^4) A = I. */
  {
    double *x2 = malloc(rows * rows * sizeof *x2), *x4 = malloc(rows * rows * sizeof *x4);
    double *e = malloc(rows * rows * sizeof *e);
    assert_true(x2 && x4 && e);
    matmul(rows, rows, rows, lr, rows, lr, rows, x2);
    matmul(rows, rows, rows, x2, rows, x2, rows, x4);
    matmul(rows, rows, rows, x4, rows, lst, rows, e);
    for (size_t i = 0; i < rows; i++) e[i * rows + i] -= 1.0;
    assert_true(max_abs_f64(rows * rows, e) < 1e-9);
    free(x2);
    free(x4);
    free(e);
  }

  /* both sides */
  matmul(rows, rows, cols, lr, rows, g, ld, t);
  matmul(rows, cols, cols, t, cols, rr, cols, want);
  double scale = max_abs_f64(rows * cols, want);
  for (size_t i = 0; i < rows * ld; i++) p[i] = pf[i] = -7.0f;
  assert_int_equal(pc_direction_f64(rows, cols, lr, g, ld, rr, p), PC_OK);
  assert_int_equal(pc_direction_f32(rows, cols, lrf, gf, ld, rrf, pf), PC_OK);
  assert_direction(rows, cols, ld, p, pf, want, scale);
  for (size_t i = 0; i < rows; i++) {
    for (size_t j = cols; j < ld; j++) { /* padding is not written */
      assert_true(p[i * ld + j] == -7.0);
      assert_true(pf[i * ld + j] == -7.0f);
    }
  }

  /* left only, right only, neither */
  matmul(rows, rows, cols, lr, rows, g, ld, want);
  scale = max_abs_f64(rows * cols, want);
  assert_int_equal(pc_direction_f64(rows, cols, lr, g, ld, NULL, p), PC_OK);
  assert_int_equal(pc_direction_f32(rows, cols, lrf, gf, ld, NULL, pf), PC_OK);
  assert_direction(rows, cols, ld, p, pf, want, scale);
  matmul(rows, cols, cols, g, ld, rr, cols, want);
  scale = max_abs_f64(rows * cols, want);
  assert_int_equal(pc_direction_f64(rows, cols, NULL, g, ld, rr, p), PC_OK);
  assert_int_equal(pc_direction_f32(rows, cols, NULL, gf, ld, rrf, pf), PC_OK);
  assert_direction(rows, cols, ld, p, pf, want, scale);
  assert_int_equal(pc_direction_f64(rows, cols, NULL, g, ld, NULL, p), PC_OK);
  assert_int_equal(pc_direction_f32(rows, cols, NULL, gf, ld, NULL, pf), PC_OK);
  for (size_t i = 0; i < rows; i++)
    for (size_t j = 0; j < cols; j++) {
      assert_true(p[i * ld + j] == g[i * ld + j]);
      assert_true(pf[i * ld + j] == gf[i * ld + j]);
    }

  /* in place: p == g, one-sided and two-sided */
  matmul(rows, rows, cols, lr, rows, g, ld, t);
  matmul(rows, cols, cols, t, cols, rr, cols, want);
  scale = max_abs_f64(rows * cols, want);
  memcpy(p, g, rows * ld * sizeof *p);
  assert_int_equal(pc_direction_f64(rows, cols, lr, p, ld, rr, p), PC_OK);
  for (size_t i = 0; i < rows; i++)
    for (size_t j = 0; j < cols; j++)
      assert_true(fabs(p[i * ld + j] - want[i * cols + j]) <= 1e-12 * scale);
  matmul(rows, rows, cols, lr, rows, g, ld, want);
  scale = max_abs_f64(rows * cols, want);
  memcpy(pf, gf, rows * ld * sizeof *pf);
  assert_int_equal(pc_direction_f32(rows, cols, lrf, pf, ld, NULL, pf), PC_OK);
  for (size_t i = 0; i < rows; i++)
    for (size_t j = 0; j < cols; j++)
      assert_true(fabs(pf[i * ld + j] - want[i * cols + j]) <= 1e-5 * scale);

  free(lst);
  free(rst);
  free(lr);
  free(rr);
  free(g);
  free(t);
  free(want);
  free(p);
  free(lrf);
  free(rrf);
  free(gf);
  free(pf);
}

static void test_direction(void **state) {
  (void)state;
  rng_state = 4242;
  check_direction(1, 1, 1);
  check_direction(1, 9, 9);
  check_direction(9, 1, 2);
  check_direction(5, 8, 8);
  check_direction(23, 17, 20);
  check_direction(64, 48, 48);
}

/* ------------------------------------------------------------------------------------ */
/* The pieces together, on the blocks of a rank-3 tensor's view, in place                 */

/* For each block B of the view (addressed in the tensor's own storage, ld = view cols):
 * L, R = packed Grams of B; roots of them (+ I, so they are well conditioned); then
 * P = L^(-1/4) B R^(-1/4) written over the tensor. Compared with the same steps done
 * block by block on gathered copies with naive loops in fp64. */
static void test_blocks_of_view(void **state) {
  (void)state;
  rng_state = 31337;
  const size_t dims[3] = {11, 3, 5}; /* view 11 x 15 */
  pc_layout_opts lo = {.block_size = 6, .skip_limit = 4096};
  pc_layout l;
  assert_int_equal(pc_layout_init(&l, 3, dims, &lo), PC_OK);
  const size_t R = l.rows, C = l.cols;
  double *t = malloc(R * C * sizeof *t), *t0 = malloc(R * C * sizeof *t0);
  assert_true(t && t0);
  fill_f64(R * C, t);
  memcpy(t0, t, R * C * sizeof *t);

  for (size_t k = 0; k < l.nblocks; k++) {
    const pc_block *b = &l.blocks[k];
    const size_t m = b->rows, n = b->cols, off = b->row0 * C + b->col0;
    double lp[21], rp[21], lfull[36], rfull[36], lr[36], rr[36], g[36], want[36], tmp[36];
    assert_int_equal(pc_gram_f64(m, n, t + off, C, lp, rp), PC_OK);
    for (size_t i = 0; i < m; i++)
      for (size_t j = 0; j < n; j++) g[i * n + j] = t0[(b->row0 + i) * C + b->col0 + j];
    /* unpack by hand and check against the gathered block */
    for (size_t i = 0; i < m; i++)
      for (size_t j = i; j < m; j++) {
        double x = 0.0;
        for (size_t c = 0; c < n; c++) x += g[i * n + c] * g[j * n + c];
        assert_true(fabs(lp[packed_index(m, i, j)] - x) <= 1e-12);
        lfull[i * m + j] = lfull[j * m + i] = x + (i == j ? 1.0 : 0.0);
      }
    for (size_t i = 0; i < n; i++)
      for (size_t j = i; j < n; j++) {
        double x = 0.0;
        for (size_t r = 0; r < m; r++) x += g[r * n + i] * g[r * n + j];
        assert_true(fabs(rp[packed_index(n, i, j)] - x) <= 1e-12);
        rfull[i * n + j] = rfull[j * n + i] = x + (i == j ? 1.0 : 0.0);
      }
    inverse_fourth_root(m, lfull, lr);
    inverse_fourth_root(n, rfull, rr);
    assert_int_equal(pc_direction_f64(m, n, lr, t + off, C, rr, t + off), PC_OK);
    matmul(m, m, n, lr, m, g, n, tmp);
    matmul(m, n, n, tmp, n, rr, n, want);
    for (size_t i = 0; i < m; i++)
      for (size_t j = 0; j < n; j++)
        assert_true(fabs(t[(b->row0 + i) * C + b->col0 + j] - want[i * n + j]) <= 1e-12);
  }
  free(t);
  free(t0);
  pc_layout_destroy(&l);
}

/* ------------------------------------------------------------------------------------ */
/* Bad arguments                                                                          */

static void test_bad_arguments(void **state) {
  (void)state;
  float g[64] = {0}, p[64], l[64], lp[64];
  double gd[64] = {0}, pd[64];
  assert_int_equal(pc_gram_f32(0, 4, g, 4, lp, NULL), PC_EINVAL);
  assert_int_equal(pc_gram_f32(4, 0, g, 4, lp, NULL), PC_EINVAL);
  assert_int_equal(pc_gram_f32(4, 4, NULL, 4, lp, NULL), PC_EINVAL);
  assert_int_equal(pc_gram_f32(4, 4, g, 3, lp, NULL), PC_EINVAL);
  assert_int_equal(pc_gram_f32((size_t)INT32_MAX + 1, 1, g, 1, lp, NULL), PC_EINVAL);
  assert_int_equal(pc_gram_f64(4, 4, gd, 2, NULL, NULL), PC_EINVAL);

  assert_int_equal(pc_direction_f32(0, 4, NULL, g, 4, NULL, p), PC_EINVAL);
  assert_int_equal(pc_direction_f32(4, 0, NULL, g, 4, NULL, p), PC_EINVAL);
  assert_int_equal(pc_direction_f32(4, 4, NULL, NULL, 4, NULL, p), PC_EINVAL);
  assert_int_equal(pc_direction_f32(4, 4, NULL, g, 4, NULL, NULL), PC_EINVAL);
  assert_int_equal(pc_direction_f32(4, 4, NULL, g, 3, NULL, p), PC_EINVAL);
  assert_int_equal(pc_direction_f64(4, 4, NULL, gd, 3, NULL, pd), PC_EINVAL);
  /* p shifted into g; a root that is p */
  assert_int_equal(pc_direction_f32(4, 4, l, g, 4, NULL, g + 1), PC_EINVAL);
  assert_int_equal(pc_direction_f64(4, 4, NULL, gd, 4, NULL, gd + 3), PC_EINVAL);
  assert_int_equal(pc_direction_f32(4, 4, p, g, 4, NULL, p), PC_EINVAL);
  assert_int_equal(pc_direction_f32(4, 4, NULL, g, 4, p + 8, p), PC_EINVAL);
  /* apart is fine */
  for (int i = 0; i < 16; i++) l[i] = (i % 5 == 0) ? 1.0f : 0.0f;
  assert_int_equal(pc_direction_f32(4, 4, l, g, 4, l, p), PC_OK);
}

int main(void) {
  openblas_set_num_threads(1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gram),           cmocka_unit_test(test_stat_update),
      cmocka_unit_test(test_stat_of_grams),  cmocka_unit_test(test_direction),
      cmocka_unit_test(test_blocks_of_view), cmocka_unit_test(test_bad_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
