/* test_roots.c -- inverse p-th roots: every method, both precisions, against fp64
 * references; bad input; the status contract. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <cmocka.h>

#include "pc_internal.h"
#include "preconditioner.h"

static const pc_method methods[] = {PC_METHOD_NEWTON, PC_METHOD_NEWTON_TEXTBOOK, PC_METHOD_EIGH};
#define NMETHODS (sizeof methods / sizeof *methods)

static void *xmalloc(size_t size) {
  void *p = malloc(size);
  assert_non_null(p);
  return p;
}

static uint64_t rng_next(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s;
}

static double rng_normal(uint64_t *s) { /* Box-Muller */
  double u1 = ((double)(rng_next(s) >> 11) + 1.0) * 0x1.0p-53;
  double u2 = (double)(rng_next(s) >> 11) * 0x1.0p-53;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* An orthogonal Q = H1 H2 H3 (Householder reflectors), kept as its three vectors. */
typedef struct {
  size_t n;
  double *v; /* 3 x n */
} reflectors;

static reflectors reflectors_make(size_t n, uint64_t seed) {
  reflectors q = {n, xmalloc(3 * n * sizeof(double))};
  for (int r = 0; r < 3; r++) {
    double nv = 0;
    for (size_t i = 0; i < n; i++) {
      q.v[r * n + i] = rng_normal(&seed);
      nv += q.v[r * n + i] * q.v[r * n + i];
    }
    for (size_t i = 0; i < n; i++) q.v[r * n + i] /= sqrt(nv);
  }
  return q;
}

/* out = Q diag(d) Q^T, applying each reflector to both sides: O(n^2) per reflector, exact
 * up to fp64 rounding, independent of LAPACK. */
static void reflectors_apply(const reflectors *q, const double *d, double *out) {
  size_t n = q->n;
  double *av = xmalloc(n * sizeof *av);
  memset(out, 0, n * n * sizeof *out);
  for (size_t i = 0; i < n; i++) out[i * n + i] = d[i];
  for (int r = 2; r >= 0; r--) {
    const double *v = q->v + r * n;
    cblas_dgemv(CblasRowMajor, CblasNoTrans, (int)n, (int)n, 1, out, (int)n, v, 1, 0, av, 1);
    double vav = cblas_ddot((int)n, v, 1, av, 1);
    for (size_t i = 0; i < n; i++)
      for (size_t j = 0; j < n; j++)
        out[i * n + j] += -2 * v[i] * av[j] - 2 * av[i] * v[j] + 4 * vav * v[i] * v[j];
  }
  free(av);
}

/* Eigenvalues spread geometrically from 1 down to 1/cond (times scale). */
static void geometric_spectrum(size_t n, double cond, double scale, double *w) {
  for (size_t i = 0; i < n; i++)
    w[i] = scale * (n > 1 ? pow(cond, -(double)i / (double)(n - 1)) : 1.0);
}

/* The exact root of Q diag(w) Q^T + ridge I. */
static void exact_root(const reflectors *q, const double *w, double ridge, int p, double *x) {
  size_t n = q->n;
  double *d = xmalloc(n * sizeof *d);
  for (size_t i = 0; i < n; i++) d[i] = pow(w[i] + ridge, -1.0 / p);
  reflectors_apply(q, d, x);
  free(d);
}

static double rel_err_f32(size_t n, const float *x, const double *ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n * n; i++) {
    double e = (double)x[i] - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
  }
  return sqrt(num / den);
}

static double rel_err_f64(size_t n, const double *x, const double *ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n * n; i++) {
    double e = x[i] - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
  }
  return sqrt(num / den);
}

static void to_f32(size_t count, const double *in, float *out) {
  for (size_t i = 0; i < count; i++) out[i] = (float)in[i];
}

typedef struct {
  double err; /* relative Frobenius error against the exact root */
  int status;
  pc_root_info info;
} outcome;

/* Runs one method in fp32 on the rounded a and compares with the exact root of the fp64
 * matrix (same ridge as the method used). */
static outcome run_f32(const reflectors *q, const double *w, const double *a, int p, pc_method m) {
  size_t n = q->n;
  float *af = xmalloc(n * n * sizeof *af), *x = xmalloc(n * n * sizeof *x);
  double *ref = xmalloc(n * n * sizeof *ref);
  to_f32(n * n, a, af);
  pc_root_opts o;
  pc_root_opts_default(&o, p);
  o.method = m;
  outcome r;
  r.status = pc_inverse_root_f32(n, af, x, &o, &r.info);
  exact_root(q, w, r.info.ridge, p, ref);
  r.err = rel_err_f32(n, x, ref);
  free(af);
  free(x);
  free(ref);
  return r;
}

static outcome run_f64(const reflectors *q, const double *w, const double *a, int p, pc_method m,
                       double tol) {
  size_t n = q->n;
  double *x = xmalloc(n * n * sizeof *x), *ref = xmalloc(n * n * sizeof *ref);
  pc_root_opts o;
  pc_root_opts_default(&o, p);
  o.method = m;
  o.tol = tol;
  outcome r;
  r.status = pc_inverse_root_f64(n, a, x, &o, &r.info);
  exact_root(q, w, r.info.ridge, p, ref);
  r.err = rel_err_f64(n, x, ref);
  free(x);
  free(ref);
  return r;
}

/* fp32, condition up to 1e3: every method within 1e-4 of the exact root, p in {1,2,4,8}. */
static void test_well_conditioned_f32(void **state) {
  (void)state;
  const double conds[] = {1e2, 1e3};
  const int ps[] = {1, 2, 4, 8};
  size_t n = 128;
  double *w = xmalloc(n * sizeof *w), *a = xmalloc(n * n * sizeof *a);
  reflectors q = reflectors_make(n, 42);
  for (size_t c = 0; c < 2; c++) {
    geometric_spectrum(n, conds[c], 5.0, w);
    reflectors_apply(&q, w, a);
    for (size_t k = 0; k < 4; k++)
      for (size_t m = 0; m < NMETHODS; m++) {
        outcome r = run_f32(&q, w, a, ps[k], methods[m]);
        if (getenv("VERBOSE") || r.err > 1e-4 || r.status != PC_OK)
          print_message("cond %g p %d %s: status %d err %.3g iters %d\n", conds[c], ps[k],
                        pc_method_name(methods[m]), r.status, r.err, r.info.iters);
        assert_int_equal(r.status, PC_OK);
        assert_true(r.err <= 1e-4);
        if (methods[m] != PC_METHOD_EIGH) assert_true(r.info.error <= 1e-6);
      }
  }
  free(w);
  free(a);
  free(q.v);
}

/* p = 1 (a K-FAC inverse) and p = 2 of a dense Wishart matrix G G^T / k, G n x 1.5n
 * (condition ~1e2, eigenvalues crowded at the top so that power iteration stops short and
 * the Frobenius bound is used). The scaled iteration then meets the local regime with M's
 * spectrum still spread, where max|M - I| falls slowly; it must not mistake that for the
 * rounding floor (it did: p = 1 stopped at 13 steps with error 2e-2). */
static void test_wishart_low_p(void **state) {
  (void)state;
  size_t n = 512, k = 768;
  uint64_t seed = 7;
  double *g = xmalloc(n * k * sizeof *g), *a = xmalloc(n * n * sizeof *a);
  double *ref = xmalloc(n * n * sizeof *ref);
  float *af = xmalloc(n * n * sizeof *af), *x = xmalloc(n * n * sizeof *x);
  for (size_t i = 0; i < n * k; i++) g[i] = rng_normal(&seed);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)k, 1.0 / (double)k, g,
              (int)k, g, (int)k, 0, a, (int)n);
  to_f32(n * n, a, af);
  for (int p = 1; p <= 2; p++) {
    pc_root_opts o, r;
    pc_root_opts_default(&o, p);
    pc_root_info info, rinfo;
    int st = pc_inverse_root_f32(n, af, x, &o, &info);
    pc_root_opts_default(&r, p);
    r.method = PC_METHOD_EIGH;
    assert_int_equal(pc_inverse_root_f64(n, a, ref, &r, &rinfo), PC_OK);
    r.epsilon = info.ridge / rinfo.lambda_max;
    assert_int_equal(pc_inverse_root_f64(n, a, ref, &r, NULL), PC_OK);
    double e = rel_err_f32(n, x, ref);
    if (getenv("VERBOSE") || st != PC_OK || e > 1e-4)
      print_message("wishart p %d: status %d err %.3g iters %d\n", p, st, e, info.iters);
    assert_int_equal(st, PC_OK);
    assert_true(e <= 1e-4);
  }
  free(g);
  free(a);
  free(ref);
  free(af);
  free(x);
}

/* fp32 at condition 1e4 and 1e6: the Newton variants within 1.5 x the error of the fp32 eigh
 * route on the same matrix (all measured against the exact root of the fp64 matrix that was
 * rounded to make the fp32 input). */
static void test_ill_conditioned_f32(void **state) {
  (void)state;
  const double conds[] = {1e4, 1e6};
  size_t n = 128;
  double *w = xmalloc(n * sizeof *w), *a = xmalloc(n * n * sizeof *a);
  reflectors q = reflectors_make(n, 43);
  for (size_t c = 0; c < 2; c++) {
    geometric_spectrum(n, conds[c], 1.0, w);
    reflectors_apply(&q, w, a);
    outcome e = run_f32(&q, w, a, 4, PC_METHOD_EIGH);
    outcome nw = run_f32(&q, w, a, 4, PC_METHOD_NEWTON);
    outcome tb = run_f32(&q, w, a, 4, PC_METHOD_NEWTON_TEXTBOOK);
    print_message("cond %g: eigh %.3g newton %.3g (%d it) textbook %.3g (%d it)\n", conds[c], e.err,
                  nw.err, nw.info.iters, tb.err, tb.info.iters);
    assert_int_equal(e.status, PC_OK);
    assert_true(nw.status == PC_OK || nw.status == PC_NOT_CONVERGED);
    assert_true(nw.info.error <= 1e-5);
    assert_true(nw.err <= 1.5 * e.err + 1e-5);
    assert_true(nw.err <= 1.5 * tb.err + 1e-5);
    assert_true(tb.err <= 1.5 * e.err + 1e-5);
  }
  free(w);
  free(a);
  free(q.v);
}

/* fp64 with a tightened tolerance: within 1e-8 at condition 1e6 (newton and textbook), and
 * the eigh route within 1e-8 too. */
static void test_ill_conditioned_f64(void **state) {
  (void)state;
  size_t n = 128;
  double *w = xmalloc(n * sizeof *w), *a = xmalloc(n * n * sizeof *a);
  reflectors q = reflectors_make(n, 44);
  geometric_spectrum(n, 1e6, 2.0, w);
  reflectors_apply(&q, w, a);
  for (size_t m = 0; m < NMETHODS; m++) {
    outcome r = run_f64(&q, w, a, 4, methods[m], 1e-12);
    print_message("fp64 cond 1e6 %s: status %d err %.3g iters %d\n", pc_method_name(methods[m]),
                  r.status, r.err, r.info.iters);
    assert_int_equal(r.status, PC_OK);
    assert_true(r.err <= 1e-8);
  }
  free(w);
  free(a);
  free(q.v);
}

/* Shampoo-like: G G^T (rank n/4) plus the relative ridge; reference: fp64 eigh. */
static void test_rank_deficient(void **state) {
  (void)state;
  size_t n = 192, k = 48;
  uint64_t seed = 5;
  double *g = xmalloc(n * k * sizeof *g), *a = xmalloc(n * n * sizeof *a);
  double *ref = xmalloc(n * n * sizeof *ref), *x64 = xmalloc(n * n * sizeof *x64);
  float *af = xmalloc(n * n * sizeof *af), *x = xmalloc(n * n * sizeof *x);
  for (size_t i = 0; i < n * k; i++) g[i] = rng_normal(&seed);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)k, 1, g, (int)k, g,
              (int)k, 0, a, (int)n);
  to_f32(n * n, a, af);
  pc_root_opts o, r;
  pc_root_opts_default(&o, 4);
  pc_root_opts_default(&r, 4);
  r.method = PC_METHOD_EIGH;
  pc_root_info rinfo;
  assert_int_equal(pc_inverse_root_f64(n, a, ref, &r, &rinfo), PC_OK);
  const double lmax = rinfo.lambda_max;
  double errs[NMETHODS];
  for (size_t m = 0; m < NMETHODS; m++) {
    pc_root_info info;
    o.method = methods[m];
    int st = pc_inverse_root_f32(n, af, x, &o, &info);
    /* The reference gets the ridge this method used (power iteration's lambda_max differs
     * from the exact one in the 7th digit). */
    r.epsilon = info.ridge / lmax;
    assert_int_equal(pc_inverse_root_f64(n, a, ref, &r, NULL), PC_OK);
    errs[m] = rel_err_f32(n, x, ref);
    print_message("G G^T f32 %s: status %d err %.3g iters %d\n", pc_method_name(methods[m]), st,
                  errs[m], info.iters);
    assert_true(st == PC_OK || st == PC_NOT_CONVERGED);
    assert_true(errs[m] <= 0.05);
    /* fp64 Newton with a tight tolerance reproduces the fp64 eigh root. */
    o.tol = 1e-12;
    st = pc_inverse_root_f64(n, a, x64, &o, &info);
    r.epsilon = info.ridge / lmax;
    assert_int_equal(pc_inverse_root_f64(n, a, ref, &r, NULL), PC_OK);
    print_message("G G^T f64 %s: status %d err %.3g iters %d\n", pc_method_name(methods[m]), st,
                  rel_err_f64(n, x64, ref), info.iters);
    assert_int_equal(st, PC_OK);
    assert_true(rel_err_f64(n, x64, ref) <= 1e-8);
    o.tol = 1e-6;
  }
  assert_true(errs[0] <= 1.5 * errs[2]);
  assert_true(errs[1] <= 1.5 * errs[2]);
  free(g);
  free(a);
  free(ref);
  free(x64);
  free(af);
  free(x);
}

/* The internal Newton variants (measured by bench-roots) agree with the exact root too:
 * fp32 throughout, full gemm products, textbook start with one-triangle products. */
static void test_variants(void **state) {
  (void)state;
  const pc__newton_variant variants[] = {
      {.scaled = 1, .symmetric = 1, .floor = 1e-2, .lo_f32 = 0},
      {.scaled = 1, .symmetric = 0, .floor = 1e-2, .lo_f32 = 0},
      {.scaled = 0, .symmetric = 1, .floor = 0, .lo_f32 = 0},
      {.scaled = 1, .symmetric = 0, .floor = 1e-2, .lo_f32 = 1e-3},
  };
  size_t n = 260; /* above the panel threshold, not a multiple of the panel height */
  double *w = xmalloc(n * sizeof *w), *a = xmalloc(n * n * sizeof *a);
  double *ref = xmalloc(n * n * sizeof *ref);
  float *af = xmalloc(n * n * sizeof *af), *x = xmalloc(n * n * sizeof *x);
  reflectors q = reflectors_make(n, 47);
  geometric_spectrum(n, 1e3, 1.0, w);
  reflectors_apply(&q, w, a);
  to_f32(n * n, a, af);
  for (size_t k = 0; k < sizeof variants / sizeof *variants; k++) {
    pc_root_opts o;
    pc_root_opts_default(&o, 4);
    pc_root_info info;
    assert_int_equal(pc__newton_root_f32(n, af, x, &o, &variants[k], &info), PC_OK);
    exact_root(&q, w, info.ridge, 4, ref);
    double e = rel_err_f32(n, x, ref);
    if (getenv("VERBOSE")) print_message("variant %zu: err %.3g iters %d\n", k, e, info.iters);
    assert_true(e <= 1e-4);
  }
  pc__newton_variant bad = variants[0];
  bad.floor = 1.5;
  pc_root_opts o;
  pc_root_opts_default(&o, 4);
  assert_int_equal(pc__newton_root_f32(n, af, x, &o, &bad, NULL), PC_EINVAL);
  free(w);
  free(a);
  free(ref);
  free(af);
  free(x);
  free(q.v);
}

/* Scaling the input by c scales the root by c^(-1/p) and changes nothing else: the
 * accuracy of the default method must not depend on the units of the statistic. */
static void test_scale_invariance(void **state) {
  (void)state;
  size_t n = 128, k = 32;
  uint64_t seed = 9;
  double *g = xmalloc(n * k * sizeof *g), *a = xmalloc(n * n * sizeof *a);
  double *ref = xmalloc(n * n * sizeof *ref), *ca = xmalloc(n * n * sizeof *ca);
  float *af = xmalloc(n * n * sizeof *af), *x = xmalloc(n * n * sizeof *x);
  for (size_t i = 0; i < n * k; i++) g[i] = rng_normal(&seed);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)k, 1, g, (int)k, g,
              (int)k, 0, a, (int)n);
  const double scales[] = {1e-6, 1.0, 1e6};
  for (size_t c = 0; c < 3; c++) {
    for (size_t i = 0; i < n * n; i++) ca[i] = scales[c] * a[i];
    to_f32(n * n, ca, af);
    pc_root_opts o;
    pc_root_opts_default(&o, 4);
    pc_root_info info;
    int st = pc_inverse_root_f32(n, af, x, &o, &info);
    if (getenv("VERBOSE") || st != PC_OK)
      print_message("scale %g: status %d error %.3g iters %d\n", scales[c], st, info.error,
                    info.iters);
    assert_int_equal(st, PC_OK);
    pc_root_opts r;
    pc_root_opts_default(&r, 4);
    r.method = PC_METHOD_EIGH;
    pc_root_info rinfo;
    assert_int_equal(pc_inverse_root_f64(n, ca, ref, &r, &rinfo), PC_OK);
    r.epsilon = info.ridge / rinfo.lambda_max;
    assert_int_equal(pc_inverse_root_f64(n, ca, ref, &r, NULL), PC_OK);
    double e = rel_err_f32(n, x, ref);
    if (getenv("VERBOSE")) print_message("scale %g: err %.3g\n", scales[c], e);
    assert_true(e <= 3e-3);
  }
  free(g);
  free(a);
  free(ref);
  free(ca);
  free(af);
  free(x);
}

/* Diagonal and identity inputs have exact roots; sizes from 1 up. */
static void test_diagonal_and_identity(void **state) {
  (void)state;
  const size_t sizes[] = {1, 2, 3, 17, 64, 255, 256, 257};
  const int ps[] = {1, 2, 4, 8};
  for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
    size_t n = sizes[s];
    float *a = xmalloc(n * n * sizeof *a), *x = xmalloc(n * n * sizeof *x);
    double *ref = xmalloc(n * n * sizeof *ref);
    for (int kind = 0; kind < 2; kind++) { /* 0: identity, 1: diagonal spread 1e2 */
      memset(a, 0, n * n * sizeof *a);
      for (size_t i = 0; i < n; i++)
        a[i * n + i] = kind == 0 ? 1.0f : (float)(3.0 * pow(1e-2, (double)i / (double)n));
      for (size_t k = 0; k < 4; k++)
        for (size_t m = 0; m < NMETHODS; m++) {
          pc_root_opts o;
          pc_root_opts_default(&o, ps[k]);
          o.method = methods[m];
          pc_root_info info;
          assert_int_equal(pc_inverse_root_f32(n, a, x, &o, &info), PC_OK);
          memset(ref, 0, n * n * sizeof *ref);
          for (size_t i = 0; i < n; i++)
            ref[i * n + i] = pow((double)a[i * n + i] + info.ridge, -1.0 / ps[k]);
          double e = rel_err_f32(n, x, ref);
          if (e > 1e-5)
            print_message("n %zu kind %d p %d %s: err %.3g\n", n, kind, ps[k],
                          pc_method_name(methods[m]), e);
          assert_true(e <= 1e-5);
        }
    }
    free(a);
    free(x);
    free(ref);
  }
}

/* 1 x 1 in fp64: the root is a scalar power. */
static void test_scalar(void **state) {
  (void)state;
  for (size_t m = 0; m < NMETHODS; m++) {
    double a = 16.0, x = 0;
    pc_root_opts o;
    pc_root_opts_default(&o, 4);
    o.method = methods[m];
    o.tol = 1e-13;
    pc_root_info info;
    assert_int_equal(pc_inverse_root_f64(1, &a, &x, &o, &info), PC_OK);
    assert_true(fabs(info.ridge - 16e-6) <= 1e-12);
    assert_true(fabs(x - pow(16.0 + 16e-6, -0.25)) <= 1e-12);
  }
}

/* One large case: n = 1024, fp32, condition 1e2, p = 4, the default method. */
static void test_large(void **state) {
  (void)state;
  size_t n = 1024;
  double *w = xmalloc(n * sizeof *w), *a = xmalloc(n * n * sizeof *a);
  reflectors q = reflectors_make(n, 45);
  geometric_spectrum(n, 1e2, 1.0, w);
  reflectors_apply(&q, w, a);
  outcome r = run_f32(&q, w, a, 4, PC_METHOD_NEWTON);
  print_message("n 1024 cond 1e2 newton: status %d err %.3g iters %d\n", r.status, r.err,
                r.info.iters);
  assert_int_equal(r.status, PC_OK);
  assert_true(r.err <= 1e-4);
  free(w);
  free(a);
  free(q.v);
}

/* NaN or Inf anywhere: PC_ENONFINITE_INPUT, x untouched, for every method and precision. */
static void test_nonfinite_input(void **state) {
  (void)state;
  size_t n = 9;
  const size_t where[] = {0, 40, 80};
  const double bad[] = {NAN, INFINITY, -INFINITY};
  float a[81], x[81];
  double ad[81], xd[81];
  for (size_t w = 0; w < 3; w++)
    for (size_t b = 0; b < 3; b++)
      for (size_t m = 0; m < NMETHODS; m++) {
        for (size_t i = 0; i < n * n; i++) {
          a[i] = (i % (n + 1) == 0) ? 2.0f : 0.0f;
          ad[i] = a[i];
          x[i] = 7.0f;
          xd[i] = 7.0;
        }
        a[where[w]] = (float)bad[b];
        ad[where[w]] = bad[b];
        pc_root_opts o;
        pc_root_opts_default(&o, 4);
        o.method = methods[m];
        assert_int_equal(pc_inverse_root_f32(n, a, x, &o, NULL), PC_ENONFINITE_INPUT);
        assert_int_equal(pc_inverse_root_f64(n, ad, xd, &o, NULL), PC_ENONFINITE_INPUT);
        for (size_t i = 0; i < n * n; i++) {
          assert_true(x[i] == 7.0f);
          assert_true(xd[i] == 7.0);
        }
      }
}

/* A zero matrix with no ridge has no inverse root: a non-finite result, reported. */
static void test_nonfinite_result(void **state) {
  (void)state;
  float a[16] = {0}, x[16];
  for (size_t m = 0; m < NMETHODS; m++) {
    pc_root_opts o;
    pc_root_opts_default(&o, 2);
    o.method = methods[m];
    o.epsilon = 0.0;
    assert_int_equal(pc_inverse_root_f32(4, a, x, &o, NULL), PC_ENONFINITE_RESULT);
  }
}

/* Inputs near the ends of the fp32 range: either a correct root or a clear error, never a
 * silent non-finite result. */
static void test_extreme_scales(void **state) {
  (void)state;
  const double scales[] = {1e-30, 1e30, 1e38};
  size_t n = 8;
  float a[64], x[64];
  for (size_t c = 0; c < 3; c++)
    for (size_t m = 0; m < NMETHODS; m++) {
      memset(a, 0, sizeof a);
      for (size_t i = 0; i < n; i++) a[i * n + i] = (float)(scales[c] * (1.0 + (double)i) / n);
      pc_root_opts o;
      pc_root_opts_default(&o, 2);
      o.method = methods[m];
      pc_root_info info;
      int st = pc_inverse_root_f32(n, a, x, &o, &info);
      if (getenv("VERBOSE"))
        print_message("scale %g %s: status %d\n", scales[c], pc_method_name(methods[m]), st);
      assert_true(st == PC_OK || st == PC_NOT_CONVERGED || st == PC_ENONFINITE_RESULT);
      if (st == PC_ENONFINITE_RESULT) continue;
      assert_true(pc_all_finite_f32(n * n, x));
      for (size_t i = 0; i < n; i++) {
        double want = pow((double)a[i * n + i] + info.ridge, -0.5);
        assert_true(fabs(x[i * n + i] - want) <= 1e-4 * want);
      }
    }
}

/* An iteration cap too small to meet the tolerance: PC_NOT_CONVERGED, with the best iterate
 * (finite) and its error; and an indefinite input is never reported as a good root. */
static void test_not_converged(void **state) {
  (void)state;
  size_t n = 64;
  double *w = xmalloc(n * sizeof *w), *a = xmalloc(n * n * sizeof *a);
  float *af = xmalloc(n * n * sizeof *af), *x = xmalloc(n * n * sizeof *x);
  reflectors q = reflectors_make(n, 46);
  geometric_spectrum(n, 1e4, 1.0, w);
  reflectors_apply(&q, w, a);
  to_f32(n * n, a, af);
  for (size_t m = 0; m < 2; m++) {
    pc_root_opts o;
    pc_root_opts_default(&o, 4);
    o.method = methods[m];
    o.max_iters = 2;
    pc_root_info info;
    assert_int_equal(pc_inverse_root_f32(n, af, x, &o, &info), PC_NOT_CONVERGED);
    assert_int_equal(info.iters, 2);
    assert_true(info.error > o.tol && isfinite(info.error));
    assert_true(pc_all_finite_f32(n * n, x));
  }
  /* -A: no real inverse root exists. */
  for (size_t i = 0; i < n * n; i++) af[i] = -af[i];
  for (size_t m = 0; m < NMETHODS; m++) {
    pc_root_opts o;
    pc_root_opts_default(&o, 4);
    o.method = methods[m];
    pc_root_info info;
    int st = pc_inverse_root_f32(n, af, x, &o, &info);
    assert_true(st != PC_OK || info.error > 0.1);
  }
  free(w);
  free(a);
  free(af);
  free(x);
  free(q.v);
}

static void test_bad_arguments(void **state) {
  (void)state;
  float a[4] = {2, 0, 0, 2}, x[4];
  pc_root_opts o;
  pc_root_opts_default(&o, 4);
  assert_int_equal(o.p, 4);
  assert_true(o.epsilon == 1e-6 && o.tol == 1e-6 && o.max_iters == 100);
  assert_int_equal(o.method, PC_METHOD_NEWTON);
  assert_int_equal(pc_inverse_root_f32(0, a, x, &o, NULL), PC_EINVAL);
  assert_int_equal(pc_inverse_root_f32(2, NULL, x, &o, NULL), PC_EINVAL);
  assert_int_equal(pc_inverse_root_f32(2, a, NULL, &o, NULL), PC_EINVAL);
  assert_int_equal(pc_inverse_root_f32(2, a, a, &o, NULL), PC_EINVAL);
  assert_int_equal(pc_inverse_root_f32(2, a, x, NULL, NULL), PC_EINVAL);
  pc_root_opts bad = o;
  bad.p = 0;
  assert_int_equal(pc_inverse_root_f32(2, a, x, &bad, NULL), PC_EINVAL);
  bad = o;
  bad.epsilon = -1;
  assert_int_equal(pc_inverse_root_f32(2, a, x, &bad, NULL), PC_EINVAL);
  bad = o;
  bad.tol = NAN;
  assert_int_equal(pc_inverse_root_f32(2, a, x, &bad, NULL), PC_EINVAL);
  bad = o;
  bad.max_iters = 0;
  assert_int_equal(pc_inverse_root_f32(2, a, x, &bad, NULL), PC_EINVAL);
  bad = o;
  bad.method = (pc_method)17;
  assert_int_equal(pc_inverse_root_f32(2, a, x, &bad, NULL), PC_EINVAL);
  double ad[4] = {2, 0, 0, 2}, xd[4];
  assert_int_equal(pc_inverse_root_f64(0, ad, xd, &o, NULL), PC_EINVAL);
  assert_int_equal(pc_inverse_root_f64(2, ad, xd, &o, NULL), PC_OK);
}

static void test_names(void **state) {
  (void)state;
  assert_string_equal(pc_method_name(PC_METHOD_NEWTON), "newton");
  assert_string_equal(pc_method_name(PC_METHOD_NEWTON_TEXTBOOK), "newton-textbook");
  assert_string_equal(pc_method_name(PC_METHOD_EIGH), "eigh");
  const int codes[] = {
      PC_OK,     PC_NOT_CONVERGED, PC_EINVAL, PC_ENONFINITE_INPUT, PC_ENONFINITE_RESULT,
      PC_ENOMEM, PC_ELAPACK};
  for (size_t i = 0; i < sizeof codes / sizeof *codes; i++) {
    assert_non_null(pc_strerror(codes[i]));
    for (size_t j = 0; j < i; j++)
      assert_string_not_equal(pc_strerror(codes[i]), pc_strerror(codes[j]));
  }
  assert_non_null(pc_strerror(12345));
}

int main(void) {
  openblas_set_num_threads(1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_well_conditioned_f32),
      cmocka_unit_test(test_wishart_low_p),
      cmocka_unit_test(test_ill_conditioned_f32),
      cmocka_unit_test(test_ill_conditioned_f64),
      cmocka_unit_test(test_rank_deficient),
      cmocka_unit_test(test_variants),
      cmocka_unit_test(test_scale_invariance),
      cmocka_unit_test(test_diagonal_and_identity),
      cmocka_unit_test(test_scalar),
      cmocka_unit_test(test_large),
      cmocka_unit_test(test_nonfinite_input),
      cmocka_unit_test(test_nonfinite_result),
      cmocka_unit_test(test_extreme_scales),
      cmocka_unit_test(test_not_converged),
      cmocka_unit_test(test_bad_arguments),
      cmocka_unit_test(test_names),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
