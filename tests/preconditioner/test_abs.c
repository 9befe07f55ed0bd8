/* test_abs.c -- ABS/ABSA numerics: the power iteration driven one product at a time, and
 * each branch of the adaptive-batch rule. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "preconditioner.h"
#include "test_util.h"

/* a = H diag(w) H with H = I - 2 u u^T (u a random unit vector): dense, symmetric, with the
 * spectrum w exactly (up to rounding). */
static void sym_with_spectrum(size_t n, const double *w, double *a) {
  double *u = malloc(n * sizeof *u);
  assert_non_null(u);
  double nu = 0;
  for (size_t i = 0; i < n; i++) {
    u[i] = uniform();
    nu += u[i] * u[i];
  }
  for (size_t i = 0; i < n; i++) u[i] /= sqrt(nu);
  /* (H D H)_ij = w_i d_ij - 2 u_i u_j (w_i + w_j) + 4 u_i u_j sum_k w_k u_k^2 */
  double s = 0;
  for (size_t k = 0; k < n; k++) s += w[k] * u[k] * u[k];
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++)
      a[i * n + j] = (i == j ? w[i] : 0.0) - 2 * u[i] * u[j] * (w[i] + w[j]) + 4 * u[i] * u[j] * s;
  free(u);
}

static void matvec(size_t n, const double *a, const float *v, float *out) {
  for (size_t i = 0; i < n; i++) {
    double acc = 0;
    for (size_t j = 0; j < n; j++) acc += a[i * n + j] * v[j];
    out[i] = (float)acc;
  }
}

/* Runs the estimate to its end; returns the number of products taken. */
static int run_power(size_t n, const double *a, const pc_abs_opts *o, pc_abs_power *p, float *v) {
  float *hv = malloc(n * sizeof *hv);
  assert_non_null(hv);
  assert_int_equal(pc_abs_power_start(p, n, v, o->seed), PC_OK);
  int products = 0;
  while (!p->done) {
    matvec(n, a, p->v, hv);
    assert_int_equal(pc_abs_power_step(p, o, hv), PC_OK);
    products++;
    assert_true(products <= o->power_max_iters);
  }
  free(hv);
  return products;
}

static void test_defaults(void **state) {
  (void)state;
  pc_abs_opts o;
  pc_abs_opts_default(&o);
  assert_int_equal(o.power_max_iters, 10);
  assert_true(o.power_tol == 1e-2);
  assert_int_equal(o.base_batch, 128);
  assert_int_equal(o.max_batch_factor, 128);
  assert_int_equal(o.growth_epochs, 10);
  assert_true(o.ref_ratio == 0.5);
  assert_true(o.adv_fraction == 0.2);
  assert_true(o.adv_eps == 0.005);
  assert_int_equal(o.hv_batch, 128);
  assert_int_equal(pc_abs_opts_check(&o), PC_OK);
  pc_abs_opts_default(NULL);
  assert_int_equal(pc_abs_opts_check(NULL), PC_EINVAL);
  pc_abs_opts b = o;
  b.ref_ratio = 0;
  assert_int_equal(pc_abs_opts_check(&b), PC_EINVAL);
  b = o;
  b.adv_fraction = 1.5;
  assert_int_equal(pc_abs_opts_check(&b), PC_EINVAL);
  b = o;
  b.power_max_iters = 0;
  assert_int_equal(pc_abs_opts_check(&b), PC_EINVAL);
  b = o;
  b.base_batch = 1u << 20;
  b.max_batch_factor = 1u << 12;
  assert_int_equal(pc_abs_opts_check(&b), PC_EINVAL);
  b = o;
  b.hv_rel_step = NAN;
  assert_int_equal(pc_abs_opts_check(&b), PC_EINVAL);
}

/* The top eigenvalue of a known spectrum, to the 1e-2 relative stop, within the 10-step cap;
 * also when the largest-magnitude eigenvalue is negative (a Hessian need not be PSD). */
static void test_power_known_spectrum(void **state) {
  (void)state;
  rng_state = 11;
  const size_t n = 40;
  const double tops[] = {4.0, -3.0};
  for (size_t t = 0; t < 2; t++) {
    double *w = malloc(n * sizeof *w), *a = malloc(n * n * sizeof *a);
    float *v = malloc(n * sizeof *v);
    assert_non_null(w);
    assert_non_null(a);
    assert_non_null(v);
    w[0] = tops[t];
    for (size_t i = 1; i < n; i++) w[i] = 1.0 - 2.0 * (double)i / (double)n; /* in (-1, 1) */
    sym_with_spectrum(n, w, a);
    pc_abs_opts o;
    pc_abs_opts_default(&o);
    pc_abs_power p;
    int products = run_power(n, a, &o, &p, v);
    assert_int_equal(p.status, PC_OK);
    assert_int_equal(p.iters, products);
    assert_true(products >= 2);
    assert_true(fabs(p.lambda - tops[t]) <= 1e-2 * fabs(tops[t]));
    /* The probe is (close to) the top eigenvector: its Rayleigh quotient is lambda. */
    float *hv = malloc(n * sizeof *hv);
    assert_non_null(hv);
    matvec(n, a, p.v, hv);
    double rq = 0;
    for (size_t i = 0; i < n; i++) rq += (double)hv[i] * p.v[i];
    assert_true(fabs(rq - tops[t]) <= 1e-2 * fabs(tops[t]));
    free(hv);
    free(w);
    free(a);
    free(v);
  }
}

/* A start vector depends on the seed alone: two starts agree bit for bit, another seed
 * differs; the vector has unit norm. */
static void test_power_start(void **state) {
  (void)state;
  const size_t n = 33;
  float a[33], b[33], c[33];
  pc_abs_power p, q, r;
  assert_int_equal(pc_abs_power_start(&p, n, a, 5), PC_OK);
  assert_int_equal(pc_abs_power_start(&q, n, b, 5), PC_OK);
  assert_int_equal(pc_abs_power_start(&r, n, c, 6), PC_OK);
  assert_memory_equal(a, b, sizeof a);
  assert_memory_not_equal(a, c, sizeof a);
  double norm = 0;
  for (size_t i = 0; i < n; i++) norm += (double)a[i] * a[i];
  assert_true(fabs(norm - 1.0) < 1e-6);
  assert_true(isnan(p.lambda));
  assert_int_equal(p.iters, 0);
  assert_int_equal(p.done, 0);
  assert_int_equal(pc_abs_power_start(NULL, n, a, 5), PC_EINVAL);
  assert_int_equal(pc_abs_power_start(&p, 0, a, 5), PC_EINVAL);
  assert_int_equal(pc_abs_power_start(&p, n, NULL, 5), PC_EINVAL);
}

/* The cap: with tol 0 the estimate never converges and stops at power_max_iters with
 * PC_NOT_CONVERGED; a further step is refused. */
static void test_power_cap(void **state) {
  (void)state;
  rng_state = 12;
  const size_t n = 20;
  double w[20], a[400];
  for (size_t i = 0; i < n; i++) w[i] = 2.0 - 0.01 * (double)i; /* tiny gaps */
  sym_with_spectrum(n, w, a);
  pc_abs_opts o;
  pc_abs_opts_default(&o);
  o.power_tol = 0;
  pc_abs_power p;
  float v[20], hv[20];
  assert_int_equal(run_power(n, a, &o, &p, v), 10);
  assert_int_equal(p.status, PC_NOT_CONVERGED);
  assert_true(p.done);
  assert_true(p.lambda > 1.8 && p.lambda <= 2.0 + 1e-5);
  matvec(n, a, p.v, hv);
  assert_int_equal(pc_abs_power_step(&p, &o, hv), PC_EINVAL);
}

/* Non-finite products leave the state as it was; a zero product is an exact 0. */
static void test_power_bad_and_zero(void **state) {
  (void)state;
  const size_t n = 8;
  float v[8], keep[8], hv[8] = {0};
  pc_abs_opts o;
  pc_abs_opts_default(&o);
  pc_abs_power p;
  assert_int_equal(pc_abs_power_start(&p, n, v, 3), PC_OK);
  memcpy(keep, v, sizeof v);
  hv[3] = NAN;
  assert_int_equal(pc_abs_power_step(&p, &o, hv), PC_ENONFINITE_INPUT);
  assert_int_equal(p.iters, 0);
  assert_true(isnan(p.lambda));
  assert_memory_equal(v, keep, sizeof v);
  hv[3] = INFINITY;
  assert_int_equal(pc_abs_power_step(&p, &o, hv), PC_ENONFINITE_INPUT);
  assert_int_equal(pc_abs_power_step(&p, NULL, hv), PC_EINVAL);
  assert_int_equal(pc_abs_power_step(&p, &o, NULL), PC_EINVAL);
  hv[3] = 0;
  assert_int_equal(pc_abs_power_step(&p, &o, hv), PC_OK);
  assert_true(p.done);
  assert_int_equal(p.status, PC_OK);
  assert_true(p.lambda == 0.0);
}

static void rule_epoch(pc_abs_rule *r, const pc_abs_opts *o, double lambda, pc_abs_decision want) {
  pc_abs_decision d;
  assert_int_equal(pc_abs_rule_epoch(r, o, lambda, &d), PC_OK);
  assert_string_equal(pc_abs_decision_name(d), pc_abs_decision_name(want));
}

/* The first eigenvalue is the reference; above half of it the batch stays; at half of it
 * (the halving test is <=) the batch, the learning rate and the reference follow. */
static void test_rule_reference_and_flat(void **state) {
  (void)state;
  pc_abs_opts o;
  pc_abs_opts_default(&o);
  pc_abs_rule r;
  pc_abs_rule_init(&r, &o);
  assert_int_equal(r.batch, 128);
  assert_true(r.lr_scale == 1.0);
  assert_true(r.adv_fraction == 0.2);
  assert_true(isnan(r.lambda_ref));
  assert_true(pc_abs_rule_active(&r, &o));
  rule_epoch(&r, &o, 10.0, PC_ABS_REFERENCE);
  assert_true(r.lambda_ref == 10.0);
  assert_int_equal(r.batch, 128);
  rule_epoch(&r, &o, 5.0001, PC_ABS_KEPT);
  rule_epoch(&r, &o, 12.0, PC_ABS_KEPT); /* sharper: the reference does not move up */
  assert_true(r.lambda_ref == 10.0);
  assert_int_equal(r.batch, 128);
  rule_epoch(&r, &o, 5.0, PC_ABS_GREW_FLAT);
  assert_int_equal(r.batch, 256);
  assert_true(r.lr_scale == 2.0);
  assert_true(r.adv_fraction == 0.1);
  assert_true(r.lambda_ref == 5.0);
  assert_int_equal(r.epochs_since_growth, 0);
  assert_int_equal(r.growths, 1);
  rule_epoch(&r, &o, -2.6, PC_ABS_KEPT); /* magnitudes: half of the new reference is 2.5 */
  rule_epoch(&r, &o, -1.0, PC_ABS_GREW_FLAT);
  assert_int_equal(r.batch, 512);
  assert_true(r.lambda_ref == 1.0);
  assert_true(r.lr_scale == 4.0);
  assert_true(r.adv_fraction == 0.05);
}

/* growth_epochs epochs in a row without growth (the reference epoch counts) force one. */
static void test_rule_forced(void **state) {
  (void)state;
  pc_abs_opts o;
  pc_abs_opts_default(&o);
  pc_abs_rule r;
  pc_abs_rule_init(&r, &o);
  rule_epoch(&r, &o, 1.0, PC_ABS_REFERENCE);
  for (int e = 2; e < 10; e++) rule_epoch(&r, &o, 1.0, PC_ABS_KEPT);
  assert_int_equal(r.epochs_since_growth, 9);
  rule_epoch(&r, &o, 1.0, PC_ABS_GREW_FORCED);
  assert_int_equal(r.batch, 256);
  assert_true(r.lambda_ref == 1.0); /* a forced growth keeps the reference */
  for (int e = 1; e < 10; e++) rule_epoch(&r, &o, 0.9, PC_ABS_KEPT);
  rule_epoch(&r, &o, 0.9, PC_ABS_GREW_FORCED);
  assert_int_equal(r.batch, 512);
  assert_true(r.lr_scale == 4.0);
}

/* The cap: the batch stops at base * max_batch_factor, the last step may be less than x2
 * with the learning rate scaled by the same ratio, and after it the rule no longer runs. */
static void test_rule_cap(void **state) {
  (void)state;
  pc_abs_opts o;
  pc_abs_opts_default(&o);
  o.base_batch = 100;
  o.max_batch_factor = 3;
  pc_abs_rule r;
  pc_abs_rule_init(&r, &o);
  rule_epoch(&r, &o, 8.0, PC_ABS_REFERENCE);
  rule_epoch(&r, &o, 4.0, PC_ABS_GREW_FLAT);
  assert_int_equal(r.batch, 200);
  rule_epoch(&r, &o, 1.0, PC_ABS_GREW_FLAT);
  assert_int_equal(r.batch, 300);
  assert_true(fabs(r.lr_scale - 3.0) < 1e-15);
  assert_true(r.adv_fraction == 0.05);
  assert_false(pc_abs_rule_active(&r, &o));
  rule_epoch(&r, &o, 0.1, PC_ABS_AT_MAX);
  assert_int_equal(r.batch, 300);
  assert_true(r.lambda_ref == 1.0);
}

static void test_rule_bad_input(void **state) {
  (void)state;
  pc_abs_opts o;
  pc_abs_opts_default(&o);
  pc_abs_rule r, keep;
  pc_abs_rule_init(&r, &o);
  rule_epoch(&r, &o, 2.0, PC_ABS_REFERENCE);
  keep = r;
  pc_abs_decision d;
  assert_int_equal(pc_abs_rule_epoch(&r, &o, NAN, &d), PC_ENONFINITE_INPUT);
  assert_int_equal(pc_abs_rule_epoch(&r, &o, INFINITY, &d), PC_ENONFINITE_INPUT);
  assert_memory_equal(&r, &keep, sizeof r);
  assert_int_equal(pc_abs_rule_epoch(NULL, &o, 1.0, &d), PC_EINVAL);
  assert_int_equal(pc_abs_rule_epoch(&r, &o, 1.0, NULL), PC_EINVAL);
  assert_string_equal(pc_abs_decision_name((pc_abs_decision)99), "unknown");
}

/* ABSA's share: the rule's in the first half of the run, 0 in the second. */
static void test_adv_fraction(void **state) {
  (void)state;
  pc_abs_opts o;
  pc_abs_opts_default(&o);
  pc_abs_rule r;
  pc_abs_rule_init(&r, &o);
  assert_true(pc_abs_adv_fraction(&r, 0.0) == 0.2);
  assert_true(pc_abs_adv_fraction(&r, 0.4999) == 0.2);
  assert_true(pc_abs_adv_fraction(&r, 0.5) == 0.0);
  assert_true(pc_abs_adv_fraction(&r, 1.0) == 0.0);
  assert_true(pc_abs_adv_fraction(&r, NAN) == 0.0);
  r.adv_fraction = 0.05; /* after two growths */
  assert_true(pc_abs_adv_fraction(&r, 0.1) == 0.05);
  assert_true(pc_abs_adv_fraction(NULL, 0.1) == 0.0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults),           cmocka_unit_test(test_power_known_spectrum),
      cmocka_unit_test(test_power_start),        cmocka_unit_test(test_power_cap),
      cmocka_unit_test(test_power_bad_and_zero), cmocka_unit_test(test_rule_reference_and_flat),
      cmocka_unit_test(test_rule_forced),        cmocka_unit_test(test_rule_cap),
      cmocka_unit_test(test_rule_bad_input),     cmocka_unit_test(test_adv_fraction),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
