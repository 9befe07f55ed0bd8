/* test_kfac.c -- K-FAC numerics: options and factor schedule, running averages, traces,
 * pi-damping and KL clipping on hand-computed cases, damped inverses of all three methods
 * against an LU inverse (LAPACK getrf/getri) in double, the eigen form, and the eigen-form
 * update against the inverse-form update where the two are mathematically equal. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <limits.h>
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

/* A K-FAC-like factor of order n: (1/k) B B^T for an n x k B with k = n / 4 (rank n / 4, as a
 * factor from few samples), plus 1e-3 I; dense, both triangles. */
static void random_factor(size_t n, double *a) {
  size_t k = n / 4 > 0 ? n / 4 : 1;
  double *b = malloc(n * k * sizeof *b);
  assert_non_null(b);
  for (size_t i = 0; i < n * k; i++) b[i] = uniform();
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++) {
      double s = 0.0;
      for (size_t t = 0; t < k; t++) s += b[i * k + t] * b[j * k + t];
      a[i * n + j] = s / (double)k + (i == j ? 1e-3 : 0.0);
    }
  free(b);
}

/* (a + d I)^-1 by LU (getrf + getri): a route independent of the ones under test. */
static void lu_inverse(size_t n, const double *a, double d, double *x) {
  lapack_int *piv = malloc(n * sizeof *piv);
  assert_non_null(piv);
  memcpy(x, a, n * n * sizeof *x);
  for (size_t i = 0; i < n; i++) x[i * n + i] += d;
  assert_int_equal(
      LAPACKE_dgetrf(LAPACK_ROW_MAJOR, (lapack_int)n, (lapack_int)n, x, (lapack_int)n, piv), 0);
  assert_int_equal(LAPACKE_dgetri(LAPACK_ROW_MAJOR, (lapack_int)n, x, (lapack_int)n, piv), 0);
  free(piv);
}

static double rel_diff_f64(size_t count, const double *x, const double *ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < count; i++) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return sqrt(num / den);
}

static double rel_diff_f32(size_t count, const float *x, const double *ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < count; i++) {
    num += ((double)x[i] - ref[i]) * ((double)x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return sqrt(num / den);
}

/* c = a b, dense row-major, a m x k, b k x n. */
static void matmul(size_t m, size_t k, size_t n, const double *a, const double *b, double *c) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)k, 1.0, a, (int)k, b,
              (int)n, 0.0, c, (int)n);
}

/* ------------------------------------------------------------------------------------ */
/* Options and schedule                                                                   */

static void test_opts(void **state) {
  (void)state;
  pc_kfac_opts o;
  pc_kfac_opts_default(&o);
  assert_true(o.factor_decay == 0.95 && o.damping == 1e-3 && o.kl_clip == 3e-4);
  assert_true(o.inv_every == 10 && o.factor_every_first == 1 && o.factor_every == 10);
  assert_int_equal(o.first_epochs, 1);
  assert_int_equal(o.kl_base_lr, 1);
  assert_int_equal(pc_kfac_opts_check(&o), PC_OK);
  pc_kfac_opts_default(NULL);
  assert_int_equal(pc_kfac_opts_check(NULL), PC_EINVAL);
  pc_kfac_opts bad = o;
  bad.factor_decay = 1.0;
  assert_int_equal(pc_kfac_opts_check(&bad), PC_EINVAL);
  bad = o;
  bad.damping = 0.0;
  assert_int_equal(pc_kfac_opts_check(&bad), PC_EINVAL);
  bad = o;
  bad.kl_clip = NAN;
  assert_int_equal(pc_kfac_opts_check(&bad), PC_EINVAL);
  bad = o;
  bad.factor_every = 0;
  assert_int_equal(pc_kfac_opts_check(&bad), PC_EINVAL);
  bad = o;
  bad.pi_damping = 2;
  assert_int_equal(pc_kfac_opts_check(&bad), PC_EINVAL);
  bad = o;
  bad.kl_base_lr = 2;
  assert_int_equal(pc_kfac_opts_check(&bad), PC_EINVAL);
  assert_string_equal(pc_kfac_inv_name(PC_KFAC_INV_CHOLESKY), "cholesky");
  assert_string_equal(pc_kfac_inv_name(PC_KFAC_INV_NEWTON), "newton");
  assert_string_equal(pc_kfac_inv_name((pc_kfac_inv)99), "unknown");
  o.eigh_min_n = 512;
  assert_int_equal(pc_kfac_inv_for_size(&o, 511), PC_KFAC_INV_CHOLESKY);
  assert_int_equal(pc_kfac_inv_for_size(&o, 512), PC_KFAC_INV_EIGH);
}

/* Every step of the first epoch, then steps epoch + 1, epoch + 11, ... */
static void test_factor_schedule(void **state) {
  (void)state;
  pc_kfac_opts o;
  pc_kfac_opts_default(&o);
  const long spe = 25;
  int due[80];
  for (long t = 1; t <= 80; t++) due[t - 1] = pc_kfac_factor_due(&o, t, spe);
  for (long t = 1; t <= 25; t++) assert_int_equal(due[t - 1], 1);
  for (long t = 26; t <= 80; t++)
    assert_int_equal(due[t - 1], t == 26 || t == 36 || t == 46 || t == 56 || t == 66 || t == 76);
  o.first_epochs = 0;
  o.factor_every = 3;
  assert_int_equal(pc_kfac_factor_due(&o, 1, spe), 1);
  assert_int_equal(pc_kfac_factor_due(&o, 3, spe), 0);
  assert_int_equal(pc_kfac_factor_due(&o, 4, spe), 1);
  assert_int_equal(pc_kfac_factor_due(&o, 0, spe), 0);
  assert_int_equal(pc_kfac_factor_due(&o, 4, 0), 0);
  o.first_epochs = LONG_MAX / 2; /* no overflow: every step is in the first phase */
  assert_int_equal(pc_kfac_factor_due(&o, LONG_MAX - 1, 4), 1);
}

/* ------------------------------------------------------------------------------------ */
/* Running average and traces                                                             */

static void test_fold_and_trace(void **state) {
  (void)state;
  float f[3] = {9, 9, 9};
  const float b1[3] = {1, 2, 3}, b2[3] = {3, 2, 1};
  pc_kfac_fold_f32(3, f, b1, 0.95, 1);
  assert_true(f[0] == 1 && f[1] == 2 && f[2] == 3);
  pc_kfac_fold_f32(3, f, b2, 0.95, 0); /* 0.95 * 1 + 0.05 * 3 = 1.1, 2, 0.95 * 3 + 0.05 = 2.9 */
  assert_float_equal(f[0], 1.1f, 1e-6);
  assert_float_equal(f[1], 2.0f, 1e-6);
  assert_float_equal(f[2], 2.9f, 1e-6);
  double d[3] = {0, 0, 0};
  const double bd[3] = {4, 8, 12};
  pc_kfac_fold_f64(3, d, bd, 0.5, 0); /* from zero: halves */
  assert_true(d[0] == 2 && d[1] == 4 && d[2] == 6);
  pc_kfac_fold_f64(3, NULL, bd, 0.5, 0); /* no-op */
  /* [[1 2 3] [. 4 5] [. . 6]] packed: trace 11. */
  const float p32[6] = {1, 2, 3, 4, 5, 6};
  const double p64[6] = {1, 2, 3, 4, 5, 6};
  assert_true(pc_kfac_trace_f32(3, p32) == 11.0);
  assert_true(pc_kfac_trace_f64(3, p64) == 11.0);
  assert_true(pc_kfac_trace_f64(3, NULL) == 0.0);
}

/* ------------------------------------------------------------------------------------ */
/* pi-damping and KL clipping                                                             */

static void test_pi_damping(void **state) {
  (void)state;
  pc_kfac_damping d;
  /* tr A / dim A = 8 / 2 = 4, tr G / dim G = 4 / 4 = 1: pi = 2; sqrt(0.01) = 0.1. */
  assert_int_equal(pc_kfac_damping_split(2, 8.0, 4, 4.0, 0.01, 1, &d), PC_OK);
  assert_float_equal(d.pi, 2.0, 1e-15);
  assert_float_equal(d.damp_a, 0.2, 1e-15);
  assert_float_equal(d.damp_g, 0.05, 1e-15);
  assert_int_equal(d.pi_fallback, 0);
  /* The product of the two dampings is lambda whatever pi is. */
  assert_float_equal(d.damp_a * d.damp_g, 0.01, 1e-15);
  /* pi off. */
  assert_int_equal(pc_kfac_damping_split(2, 8.0, 4, 4.0, 0.01, 0, &d), PC_OK);
  assert_true(d.pi == 1.0 && d.pi_fallback == 0);
  assert_float_equal(d.damp_a, 0.1, 1e-15);
  /* Zero traces: pi = 1, flagged. */
  assert_int_equal(pc_kfac_damping_split(2, 0.0, 4, 4.0, 0.01, 1, &d), PC_OK);
  assert_true(d.pi == 1.0 && d.pi_fallback == 1);
  assert_int_equal(pc_kfac_damping_split(2, 8.0, 4, 0.0, 0.01, 1, &d), PC_OK);
  assert_true(d.pi == 1.0 && d.pi_fallback == 1);
  /* Extreme but positive traces: no overflow in the ratio. */
  assert_int_equal(pc_kfac_damping_split(1, 1e300, 1, 1e-300, 1e-4, 1, &d), PC_OK);
  assert_float_equal(d.pi / 1e300, 1.0, 1e-12);
  /* Errors. */
  d.pi = 7.0;
  assert_int_equal(pc_kfac_damping_split(2, NAN, 4, 4.0, 0.01, 1, &d), PC_ENONFINITE_INPUT);
  assert_int_equal(pc_kfac_damping_split(2, 1.0, 4, INFINITY, 0.01, 1, &d), PC_ENONFINITE_INPUT);
  assert_true(d.pi == 7.0);
  assert_int_equal(pc_kfac_damping_split(0, 1.0, 4, 1.0, 0.01, 1, &d), PC_EINVAL);
  assert_int_equal(pc_kfac_damping_split(2, 1.0, 4, 1.0, 0.0, 1, &d), PC_EINVAL);
  assert_int_equal(pc_kfac_damping_split(2, 1.0, 4, 1.0, 0.01, 1, NULL), PC_EINVAL);
}

static void test_kl_clip(void **state) {
  (void)state;
  double nu = -1;
  /* lr^2 vg = 0.01 * 10 = 0.1: nu = sqrt(1e-3 / 0.1) = 0.1. */
  assert_int_equal(pc_kfac_kl_scale(1e-3, 0.1, 10.0, &nu), PC_OK);
  assert_float_equal(nu, 0.1, 1e-15);
  assert_int_equal(pc_kfac_kl_scale(1e-3, 0.1, -10.0, &nu), PC_OK); /* |.| */
  assert_float_equal(nu, 0.1, 1e-15);
  /* lr^2 vg = 1e-5 < kl_clip: no clipping. */
  assert_int_equal(pc_kfac_kl_scale(1e-3, 0.1, 1e-3, &nu), PC_OK);
  assert_true(nu == 1.0);
  assert_int_equal(pc_kfac_kl_scale(1e-3, 0.1, 0.0, &nu), PC_OK);
  assert_true(nu == 1.0);
  assert_int_equal(pc_kfac_kl_scale(1e-3, 0.0, 5.0, &nu), PC_OK);
  assert_true(nu == 1.0);
  assert_int_equal(pc_kfac_kl_scale(1e-3, 0.1, NAN, &nu), PC_ENONFINITE_INPUT);
  assert_true(nu == 0.0);
  assert_int_equal(pc_kfac_kl_scale(0.0, 0.1, 1.0, &nu), PC_EINVAL);
  assert_int_equal(pc_kfac_kl_scale(1e-3, -0.1, 1.0, &nu), PC_EINVAL);
  assert_int_equal(pc_kfac_kl_scale(1e-3, 0.1, 1.0, NULL), PC_EINVAL);
  /* The per-layer inner product feeding it. */
  const float p[3] = {1, 2, 3}, g[3] = {4, -5, 6};
  assert_true(pc_kfac_dot_f32(3, p, g) == 12.0);
}

/* ------------------------------------------------------------------------------------ */
/* Damped inverses                                                                        */

static void test_inverse_against_lapack(void **state) {
  (void)state;
  rng_state = 0x9e3779b97f4a7c15ull;
  const size_t sizes[] = {1, 7, 40, 130};
  const pc_kfac_inv methods[] = {PC_KFAC_INV_CHOLESKY, PC_KFAC_INV_EIGH, PC_KFAC_INV_NEWTON};
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
    size_t n = sizes[si], nn = n * n;
    double *a = malloc(nn * sizeof *a), *ref = malloc(nn * sizeof *ref);
    double *x64 = malloc(nn * sizeof *x64), *p64 = malloc(pc_packed_len(n) * sizeof *p64);
    float *x32 = malloc(nn * sizeof *x32), *p32 = malloc(pc_packed_len(n) * sizeof *p32);
    double *a32 = malloc(nn * sizeof *a32);
    assert_true(a && ref && x64 && p64 && x32 && p32 && a32);
    random_factor(n, a);
    pc_pack_f64(n, a, p64);
    for (size_t i = 0; i < pc_packed_len(n); i++) p32[i] = (float)p64[i];
    const double damp = 0.03;
    lu_inverse(n, a, damp, ref);
    for (size_t mi = 0; mi < 3; mi++) {
      pc_kfac_inv_info info;
      int st = pc_kfac_inverse_f64(n, p64, damp, methods[mi], x64, &info);
      if (st != PC_OK)
        print_error("n=%zu %s f64 status %d error %g iters %d\n", n, pc_kfac_inv_name(methods[mi]),
                    st, info.error, info.iters);
      assert_int_equal(st, PC_OK);
      assert_int_equal(info.method, methods[mi]);
      double e = rel_diff_f64(nn, x64, ref);
      if (e > 1e-10) print_error("n=%zu %s f64 rel %g\n", n, pc_kfac_inv_name(methods[mi]), e);
      assert_true(e <= 1e-10);
      assert_true(info.error <= 1e-9);
      /* Symmetric, both triangles. */
      for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < i; j++) assert_true(x64[i * n + j] == x64[j * n + i]);
      st = pc_kfac_inverse_f32(n, p32, damp, methods[mi], x32, &info);
      assert_true(st == PC_OK || (st == PC_NOT_CONVERGED && methods[mi] == PC_KFAC_INV_NEWTON));
      /* fp32: condition ~ 1e2 here, so a few 1e-6 relative. */
      e = rel_diff_f32(nn, x32, ref);
      if (e > 1e-4) print_error("n=%zu %s f32 rel %g\n", n, pc_kfac_inv_name(methods[mi]), e);
      assert_true(e <= 1e-4);
    }
    free(a);
    free(ref);
    free(x64);
    free(p64);
    free(x32);
    free(p32);
    free(a32);
  }
}

static void test_inverse_errors(void **state) {
  (void)state;
  /* diag(1, -1): not PSD; Cholesky must refuse, eigh floors the negative eigenvalue. */
  const double ind[3] = {1, 0, -1};
  double x[4] = {7, 7, 7, 7};
  assert_int_equal(pc_kfac_inverse_f64(2, ind, 0.0, PC_KFAC_INV_CHOLESKY, x, NULL), PC_ELAPACK);
  assert_int_equal(pc_kfac_inverse_f64(2, ind, 0.5, PC_KFAC_INV_EIGH, x, NULL), PC_OK);
  assert_float_equal(x[0], 1.0 / 1.5, 1e-15);
  assert_float_equal(x[3], 1.0 / 0.5, 1e-15); /* max(-1, 0) + 0.5 */
  /* NaN input: untouched output. */
  const double bad[3] = {1, NAN, 1};
  x[0] = 7;
  assert_int_equal(pc_kfac_inverse_f64(2, bad, 0.1, PC_KFAC_INV_EIGH, x, NULL),
                   PC_ENONFINITE_INPUT);
  assert_true(x[0] == 7);
  const float ok[3] = {1, 0, 1};
  float y[4];
  assert_int_equal(pc_kfac_inverse_f32(0, ok, 0.1, PC_KFAC_INV_EIGH, y, NULL), PC_EINVAL);
  assert_int_equal(pc_kfac_inverse_f32(2, NULL, 0.1, PC_KFAC_INV_EIGH, y, NULL), PC_EINVAL);
  assert_int_equal(pc_kfac_inverse_f32(2, ok, -0.1, PC_KFAC_INV_EIGH, y, NULL), PC_EINVAL);
  assert_int_equal(pc_kfac_inverse_f32(2, ok, 0.1, (pc_kfac_inv)9, y, NULL), PC_EINVAL);
  assert_int_equal(pc_kfac_inverse_f32(2, ok, INFINITY, PC_KFAC_INV_EIGH, y, NULL), PC_EINVAL);
  /* The zero factor with damping d: d^-1 I by every method. */
  const float zero[3] = {0, 0, 0};
  for (int m = 0; m < 3; m++) {
    assert_true(pc_kfac_inverse_f32(2, zero, 0.25, (pc_kfac_inv)m, y, NULL) >= 0);
    assert_float_equal(y[0], 4.0f, 1e-5);
    assert_float_equal(y[1], 0.0f, 1e-5);
    assert_float_equal(y[3], 4.0f, 1e-5);
  }
}

/* ------------------------------------------------------------------------------------ */
/* Eigen form and updates                                                                 */

static void test_eigen_form(void **state) {
  (void)state;
  rng_state = 12345;
  const size_t n = 33, nn = n * n;
  double *a = malloc(nn * sizeof *a), *p = malloc(pc_packed_len(n) * sizeof *p);
  double *q = malloc(nn * sizeof *q), *v = malloc(n * sizeof *v), *r = malloc(nn * sizeof *r);
  double *t = malloc(nn * sizeof *t);
  assert_true(a && p && q && v && r && t);
  random_factor(n, a);
  pc_pack_f64(n, a, p);
  assert_int_equal(pc_kfac_eigen_f64(n, p, q, v), PC_OK);
  for (size_t j = 0; j + 1 < n; j++) assert_true(v[j] <= v[j + 1] && v[j] >= 0.0);
  /* Q diag(v) Q^T == A and Q^T Q == I. */
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++) t[i * n + j] = q[i * n + j] * v[j];
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)n, 1.0, t, (int)n, q,
              (int)n, 0.0, r, (int)n);
  assert_true(rel_diff_f64(nn, r, a) < 1e-12);
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)n, (int)n, 1.0, q, (int)n, q,
              (int)n, 0.0, r, (int)n);
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++) assert_float_equal(r[i * n + j], i == j, 1e-12);
  assert_int_equal(pc_kfac_eigen_f64(0, p, q, v), PC_EINVAL);
  p[1] = NAN;
  assert_int_equal(pc_kfac_eigen_f64(n, p, q, v), PC_ENONFINITE_INPUT);
  free(a);
  free(p);
  free(q);
  free(v);
  free(r);
  free(t);
}

/* Diagonal factors (Q = I): the eigen form is grad_ij / (g_i a_j + lambda), by hand. */
static void test_eigen_update_by_hand(void **state) {
  (void)state;
  const double qg[4] = {1, 0, 0, 1}, vg[2] = {1, 3};
  const double qa[9] = {1, 0, 0, 0, 1, 0, 0, 0, 1}, va[3] = {0, 1, 2};
  const double grad[6] = {1, 2, 3, 4, 5, 6};
  double p[6];
  assert_int_equal(pc_kfac_eigen_update_f64(2, 3, qg, vg, grad, 3, qa, va, 0.5, p), PC_OK);
  const double want[6] = {1 / 0.5, 2 / 1.5, 3 / 2.5, 4 / 0.5, 5 / 3.5, 6 / 6.5};
  for (int i = 0; i < 6; i++) assert_float_equal(p[i], want[i], 1e-15);
  assert_int_equal(pc_kfac_eigen_update_f64(2, 3, qg, vg, grad, 2, qa, va, 0.5, p), PC_EINVAL);
  assert_int_equal(pc_kfac_eigen_update_f64(2, 3, qg, vg, grad, 3, qa, va, -1, p), PC_EINVAL);
  /* The inverse-form update on a hand case: G^-1 = diag(2, 1), A^-1 = 3 I. */
  const double gi[4] = {2, 0, 0, 1}, ai[9] = {3, 0, 0, 0, 3, 0, 0, 0, 3};
  assert_int_equal(pc_kfac_update_f64(2, 3, gi, grad, 3, ai, p), PC_OK);
  const double want2[6] = {6, 12, 18, 12, 15, 18};
  for (int i = 0; i < 6; i++) assert_float_equal(p[i], want2[i], 1e-15);
}

/* The eigen form with the damped eigenvalues (v_G + d_G, v_A + d_A) and lambda = 0 is
 * (G + d_G I)^-1 grad (A + d_A I)^-1 exactly: both sides equal Q_G diag(1/(v_G + d_G)) Q_G^T
 * grad Q_A diag(1/(v_A + d_A)) Q_A^T. With lambda > 0 and undamped eigenvalues they differ by
 * design (1/(v_G v_A + lambda) against 1/((v_G + d_G)(v_A + d_A))), so that is what is
 * compared: the one identity that holds. */
static void test_eigen_equals_inverse_form(void **state) {
  (void)state;
  rng_state = 777;
  const size_t out = 12, in = 20;
  double *ga = malloc(out * out * sizeof *ga), *aa = malloc(in * in * sizeof *aa);
  double *gp = malloc(pc_packed_len(out) * sizeof *gp),
         *ap = malloc(pc_packed_len(in) * sizeof *ap);
  double *qg = malloc(out * out * sizeof *qg), *qa = malloc(in * in * sizeof *qa);
  double *vg = malloc(out * sizeof *vg), *va = malloc(in * sizeof *va);
  double *gi = malloc(out * out * sizeof *gi), *ai = malloc(in * in * sizeof *ai);
  double *grad = malloc(out * in * sizeof *grad), *p1 = malloc(out * in * sizeof *p1);
  double *p2 = malloc(out * in * sizeof *p2), *tmp = malloc(out * in * sizeof *tmp);
  assert_true(ga && aa && gp && ap && qg && qa && vg && va && gi && ai && grad && p1 && p2 && tmp);
  random_factor(out, ga);
  random_factor(in, aa);
  pc_pack_f64(out, ga, gp);
  pc_pack_f64(in, aa, ap);
  for (size_t i = 0; i < out * in; i++) grad[i] = uniform();
  pc_kfac_damping d;
  assert_int_equal(pc_kfac_damping_split(in, pc_kfac_trace_f64(in, ap), out,
                                         pc_kfac_trace_f64(out, gp), 1e-2, 1, &d),
                   PC_OK);
  assert_int_equal(pc_kfac_inverse_f64(out, gp, d.damp_g, PC_KFAC_INV_CHOLESKY, gi, NULL), PC_OK);
  assert_int_equal(pc_kfac_inverse_f64(in, ap, d.damp_a, PC_KFAC_INV_CHOLESKY, ai, NULL), PC_OK);
  assert_int_equal(pc_kfac_update_f64(out, in, gi, grad, in, ai, p1), PC_OK);
  /* The same product through an independent route: (G + dI)^-1 by LU. */
  double *lg = malloc(out * out * sizeof *lg), *la = malloc(in * in * sizeof *la);
  assert_true(lg && la);
  lu_inverse(out, ga, d.damp_g, lg);
  lu_inverse(in, aa, d.damp_a, la);
  matmul(out, out, in, lg, grad, tmp);
  matmul(out, in, in, tmp, la, p2);
  assert_true(rel_diff_f64(out * in, p1, p2) < 1e-11);
  /* Eigen form with shifted eigenvalues. */
  assert_int_equal(pc_kfac_eigen_f64(out, gp, qg, vg), PC_OK);
  assert_int_equal(pc_kfac_eigen_f64(in, ap, qa, va), PC_OK);
  for (size_t i = 0; i < out; i++) vg[i] += d.damp_g;
  for (size_t j = 0; j < in; j++) va[j] += d.damp_a;
  assert_int_equal(pc_kfac_eigen_update_f64(out, in, qg, vg, grad, in, qa, va, 0.0, p2), PC_OK);
  double e = rel_diff_f64(out * in, p2, p1);
  if (e > 1e-11) print_error("eigen vs inverse form: %g\n", e);
  assert_true(e < 1e-11);
  /* In place (p == grad) gives the same. */
  memcpy(tmp, grad, out * in * sizeof *tmp);
  assert_int_equal(pc_kfac_eigen_update_f64(out, in, qg, vg, tmp, in, qa, va, 0.0, tmp), PC_OK);
  assert_true(rel_diff_f64(out * in, tmp, p2) < 1e-14);
  /* fp32 instance of the same identity. */
  float *g32 = malloc(pc_packed_len(out) * sizeof *g32),
        *a32 = malloc(pc_packed_len(in) * sizeof *a32);
  float *q32g = malloc(out * out * sizeof *q32g), *q32a = malloc(in * in * sizeof *q32a);
  float *v32g = malloc(out * sizeof *v32g), *v32a = malloc(in * sizeof *v32a);
  float *gr32 = malloc(out * in * sizeof *gr32), *p32 = malloc(out * in * sizeof *p32);
  assert_true(g32 && a32 && q32g && q32a && v32g && v32a && gr32 && p32);
  for (size_t i = 0; i < pc_packed_len(out); i++) g32[i] = (float)gp[i];
  for (size_t i = 0; i < pc_packed_len(in); i++) a32[i] = (float)ap[i];
  for (size_t i = 0; i < out * in; i++) gr32[i] = (float)grad[i];
  assert_int_equal(pc_kfac_eigen_f32(out, g32, q32g, v32g), PC_OK);
  assert_int_equal(pc_kfac_eigen_f32(in, a32, q32a, v32a), PC_OK);
  for (size_t i = 0; i < out; i++) v32g[i] += (float)d.damp_g;
  for (size_t j = 0; j < in; j++) v32a[j] += (float)d.damp_a;
  assert_int_equal(pc_kfac_eigen_update_f32(out, in, q32g, v32g, gr32, in, q32a, v32a, 0.0, p32),
                   PC_OK);
  assert_true(rel_diff_f32(out * in, p32, p1) < 1e-4);
  free(g32);
  free(a32);
  free(q32g);
  free(q32a);
  free(v32g);
  free(v32a);
  free(gr32);
  free(p32);
  free(ga);
  free(aa);
  free(gp);
  free(ap);
  free(qg);
  free(qa);
  free(vg);
  free(va);
  free(gi);
  free(ai);
  free(grad);
  free(p1);
  free(p2);
  free(tmp);
  free(lg);
  free(la);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_opts),
      cmocka_unit_test(test_factor_schedule),
      cmocka_unit_test(test_fold_and_trace),
      cmocka_unit_test(test_pi_damping),
      cmocka_unit_test(test_kl_clip),
      cmocka_unit_test(test_inverse_against_lapack),
      cmocka_unit_test(test_inverse_errors),
      cmocka_unit_test(test_eigen_form),
      cmocka_unit_test(test_eigen_update_by_hand),
      cmocka_unit_test(test_eigen_equals_inverse_form),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
