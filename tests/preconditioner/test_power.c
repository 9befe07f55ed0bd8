/* test_power.c -- largest eigenvalue by power iteration. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <cmocka.h>

#include "preconditioner.h"

/* a = Q diag(w) Q^T with Q a product of three Householder reflectors (dense, orthogonal,
 * and cheap to apply): the spectrum is known exactly without LAPACK. */
static void spd_with_spectrum(size_t n, const double *w, uint64_t seed, double *a) {
  memset(a, 0, n * n * sizeof *a);
  for (size_t i = 0; i < n; i++) a[i * n + i] = w[i];
  double *v = malloc(n * sizeof *v), *av = malloc(n * sizeof *av);
  assert_non_null(v);
  assert_non_null(av);
  for (int r = 0; r < 3; r++) {
    double nv = 0;
    for (size_t i = 0; i < n; i++) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      v[i] = (double)(seed >> 11) * 0x1.0p-53 - 0.5;
      nv += v[i] * v[i];
    }
    for (size_t i = 0; i < n; i++) v[i] /= sqrt(nv);
    /* H a H with H = I - 2 v v^T: a - 2 v (a v)^T - 2 (a v) v^T + 4 (v^T a v) v v^T */
    cblas_dgemv(CblasRowMajor, CblasNoTrans, (int)n, (int)n, 1, a, (int)n, v, 1, 0, av, 1);
    double vav = cblas_ddot((int)n, v, 1, av, 1);
    for (size_t i = 0; i < n; i++)
      for (size_t j = 0; j < n; j++)
        a[i * n + j] += -2 * v[i] * av[j] - 2 * av[i] * v[j] + 4 * vav * v[i] * v[j];
  }
  free(v);
  free(av);
}

static void test_known_spectrum(void **state) {
  (void)state;
  const size_t sizes[] = {1, 2, 16, 200};
  for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
    size_t n = sizes[s];
    double *w = malloc(n * sizeof *w), *a = malloc(n * n * sizeof *a);
    float *af = malloc(n * n * sizeof *af);
    assert_non_null(w);
    assert_non_null(a);
    assert_non_null(af);
    for (size_t i = 0; i < n; i++) w[i] = 3.0 * pow(0.5, (double)i); /* gap ratio 1/2 */
    spd_with_spectrum(n, w, 7 + n, a);
    for (size_t i = 0; i < n * n; i++) af[i] = (float)a[i];
    double lam = 0;
    int it = 0;
    assert_int_equal(pc_power_iteration_f64(n, a, NULL, &lam, &it), PC_OK);
    assert_true(fabs(lam - 3.0) <= 1e-6 * 3.0);
    assert_true(it >= 1 && it <= 100);
    assert_int_equal(pc_power_iteration_f32(n, af, NULL, &lam, NULL), PC_OK);
    assert_true(fabs(lam - 3.0) <= 1e-5 * 3.0);
    free(w);
    free(a);
    free(af);
  }
}

/* Same seed, same answer to the bit; the estimate never exceeds lambda_max by more than
 * rounding (the Rayleigh quotient approaches from below). */
static void test_reproducible(void **state) {
  (void)state;
  size_t n = 100;
  double *w = malloc(n * sizeof *w), *a = malloc(n * n * sizeof *a);
  assert_non_null(w);
  assert_non_null(a);
  for (size_t i = 0; i < n; i++) w[i] = 1.0 + (double)(n - i) / (double)n; /* close gaps */
  spd_with_spectrum(n, w, 3, a);
  pc_power_opts o;
  pc_power_opts_default(&o);
  assert_int_equal(o.max_iters, 100);
  assert_true(o.tol == 1e-6);
  double l1, l2;
  int i1, i2;
  int s1 = pc_power_iteration_f64(n, a, &o, &l1, &i1);
  int s2 = pc_power_iteration_f64(n, a, &o, &l2, &i2);
  assert_int_equal(s1, s2);
  assert_true(l1 == l2);
  assert_int_equal(i1, i2);
  assert_true(l1 <= 2.0 * (1 + 1e-12));
  assert_true(l1 >= 2.0 * 0.99);
  free(w);
  free(a);
}

static void test_not_converged(void **state) {
  (void)state;
  size_t n = 50;
  double *w = malloc(n * sizeof *w), *a = malloc(n * n * sizeof *a);
  assert_non_null(w);
  assert_non_null(a);
  for (size_t i = 0; i < n; i++) w[i] = 1.0 - 1e-3 * (double)i; /* tiny gaps: slow */
  spd_with_spectrum(n, w, 11, a);
  pc_power_opts o;
  pc_power_opts_default(&o);
  o.max_iters = 2;
  o.tol = 1e-12;
  double lam = -1;
  int it = 0;
  assert_int_equal(pc_power_iteration_f64(n, a, &o, &lam, &it), PC_NOT_CONVERGED);
  assert_int_equal(it, 2);
  assert_true(lam > 0.9 && lam <= 1.0 + 1e-12);
  free(w);
  free(a);
}

/* Against the eigendecomposition route's lambda_max (LAPACK syevd) on a Shampoo-like
 * statistic G G^T, rank n/4. */
static void test_against_eigh(void **state) {
  (void)state;
  size_t n = 96, k = 24;
  double *g = malloc(n * k * sizeof *g), *a = malloc(n * n * sizeof *a);
  double *x = malloc(n * n * sizeof *x);
  float *af = malloc(n * n * sizeof *af);
  assert_non_null(g);
  assert_non_null(a);
  assert_non_null(x);
  assert_non_null(af);
  uint64_t seed = 17;
  for (size_t i = 0; i < n * k; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    g[i] = (double)(seed >> 11) * 0x1.0p-53 - 0.5;
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)k, 1, g, (int)k, g,
              (int)k, 0, a, (int)n);
  for (size_t i = 0; i < n * n; i++) af[i] = (float)a[i];
  pc_root_opts o;
  pc_root_opts_default(&o, 2);
  o.method = PC_METHOD_EIGH;
  pc_root_info info;
  assert_int_equal(pc_inverse_root_f64(n, a, x, &o, &info), PC_OK);
  double l64 = 0, l32 = 0;
  assert_int_equal(pc_power_iteration_f64(n, a, NULL, &l64, NULL), PC_OK);
  assert_int_equal(pc_power_iteration_f32(n, af, NULL, &l32, NULL), PC_OK);
  assert_true(fabs(l64 - info.lambda_max) <= 1e-5 * info.lambda_max);
  assert_true(fabs(l32 - info.lambda_max) <= 1e-5 * info.lambda_max);
  free(g);
  free(a);
  free(x);
  free(af);
}

static void test_zero_matrix(void **state) {
  (void)state;
  float z[9] = {0};
  double lam = -1;
  assert_int_equal(pc_power_iteration_f32(3, z, NULL, &lam, NULL), PC_OK);
  assert_true(lam == 0.0);
}

static void test_bad_input(void **state) {
  (void)state;
  float a[4] = {2, 1, 1, 2};
  double lam = 0;
  assert_int_equal(pc_power_iteration_f32(0, a, NULL, &lam, NULL), PC_EINVAL);
  assert_int_equal(pc_power_iteration_f32(2, NULL, NULL, &lam, NULL), PC_EINVAL);
  assert_int_equal(pc_power_iteration_f32(2, a, NULL, NULL, NULL), PC_EINVAL);
  pc_power_opts o;
  pc_power_opts_default(&o);
  o.max_iters = 0;
  assert_int_equal(pc_power_iteration_f32(2, a, &o, &lam, NULL), PC_EINVAL);
  pc_power_opts_default(&o);
  o.tol = NAN;
  assert_int_equal(pc_power_iteration_f32(2, a, &o, &lam, NULL), PC_EINVAL);
  a[3] = NAN;
  assert_int_equal(pc_power_iteration_f32(2, a, NULL, &lam, NULL), PC_ENONFINITE_INPUT);
  double d[4] = {2, 1, INFINITY, 2};
  assert_int_equal(pc_power_iteration_f64(2, d, NULL, &lam, NULL), PC_ENONFINITE_INPUT);
}

int main(void) {
  openblas_set_num_threads(1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_known_spectrum), cmocka_unit_test(test_reproducible),
      cmocka_unit_test(test_not_converged),  cmocka_unit_test(test_against_eigh),
      cmocka_unit_test(test_zero_matrix),    cmocka_unit_test(test_bad_input),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
