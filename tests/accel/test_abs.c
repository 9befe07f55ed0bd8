/* test_abs.c -- ABS's worker half: Hessian-vector products by central differences of
 * gradients, against the exact Hessian of a softmax regression, and on a small MLP against
 * its finite-difference Hessian (columns H e_j) and for symmetry; the weights come back bit
 * for bit. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "accel.h"
#include "test_util.h"

enum { B = 6, D = 4, H1 = 5, C = 3 };

/* A model of one or two linear layers (tanh between) under softmax cross-entropy on a
 * fixed batch; grad() is the callback ac_hvp_compute takes. */
typedef struct {
  ac_backend *be;
  int two;
  ac_linear l1, l2;
  ac_activation act;
  ac_celoss xent;
  ac_param_list params;
  float *x;
  int32_t *y;
  int fail; /* the callback's error, for the failure test: 0 none */
} model;

static int grad(void *ctx) {
  model *m = ctx;
  if (m->fail) return m->fail;
  const float *h, *z, *a, *dl, *dz, *da;
  double loss;
  int rc = ac_linear_forward(&m->l1, m->x, B, &h);
  if (rc == AC_OK && m->two) {
    rc = ac_activation_forward(&m->act, h, (size_t)B * H1, &a);
    if (rc == AC_OK) rc = ac_linear_forward(&m->l2, a, B, &z);
  } else {
    z = h;
  }
  if (rc == AC_OK) rc = ac_celoss_forward(&m->xent, z, m->y, B, &loss);
  if (rc == AC_OK) rc = ac_celoss_backward(&m->xent, &dl);
  if (rc == AC_OK && m->two) {
    rc = ac_linear_backward(&m->l2, dl, &da);
    if (rc == AC_OK) rc = ac_activation_backward(&m->act, da, &dz);
    if (rc == AC_OK) rc = ac_linear_backward(&m->l1, dz, NULL);
  } else if (rc == AC_OK) {
    rc = ac_linear_backward(&m->l1, dl, NULL);
  }
  return rc;
}

static const int32_t labels[B] = {0, 2, 1, 1, 0, 2};

static void model_init(model *m, ac_backend *be, int two, uint64_t *rng, float *xh) {
  memset(m, 0, sizeof *m);
  m->be = be;
  m->two = two;
  OK(ac_linear_init(&m->l1, be, "l1", D, two ? H1 : C, 1, B, 3));
  if (two) {
    OK(ac_activation_init(&m->act, be, AC_UNARY_TANH, (size_t)B * H1));
    OK(ac_linear_init(&m->l2, be, "l2", H1, C, 1, B, 4));
  }
  OK(ac_celoss_init(&m->xent, be, C, B));
  ac_param_list_init(&m->params);
  OK(ac_linear_params(&m->l1, &m->params));
  if (two) OK(ac_linear_params(&m->l2, &m->params));
  /* Non-zero biases, so that their blocks of the Hessian are exercised too. */
  for (size_t i = 0; i < m->params.n; i++) {
    ac_param *p = m->params.items[i];
    float *vals = xcalloc(p->value.numel, sizeof *vals);
    for (size_t k = 0; k < p->value.numel; k++) vals[k] = 0.8f * xorshift_frand(rng);
    OK(ac_tensor_upload(&p->value, vals));
    free(vals);
  }
  for (size_t k = 0; k < (size_t)B * D; k++) xh[k] = xorshift_frand(rng);
  OK(ac_malloc(be, sizeof(float) * B * D, (void **)&m->x));
  OK(ac_malloc(be, sizeof labels, (void **)&m->y));
  OK(ac_memcpy_h2d(be, m->x, xh, sizeof(float) * B * D));
  OK(ac_memcpy_h2d(be, m->y, labels, sizeof labels));
}

static void model_destroy(model *m) {
  ac_free(m->be, m->x);
  ac_free(m->be, m->y);
  ac_param_list_destroy(&m->params);
  ac_celoss_destroy(&m->xent);
  ac_linear_destroy(&m->l1);
  if (m->two) {
    ac_linear_destroy(&m->l2);
    ac_activation_destroy(&m->act);
  }
}

/* All parameter values (or grads), concatenated, to the host. */
static void download_all(model *m, int grads, float *out) {
  size_t off = 0;
  for (size_t i = 0; i < m->params.n; i++) {
    ac_param *p = m->params.items[i];
    OK(ac_tensor_download(grads ? &p->grad : &p->value, out + off));
    off += p->value.numel;
  }
}

/* hv = H v through the device. */
static void hvp(ac_hvp *h, model *m, const float *v, float *hv, double *step) {
  float *dv, *dhv;
  OK(ac_malloc(m->be, h->numel * sizeof(float), (void **)&dv));
  OK(ac_malloc(m->be, h->numel * sizeof(float), (void **)&dhv));
  OK(ac_memcpy_h2d(m->be, dv, v, h->numel * sizeof(float)));
  OK(ac_hvp_compute(h, dv, 1e-3, grad, m, dhv, step));
  OK(ac_memcpy_d2h(m->be, hv, dhv, h->numel * sizeof(float)));
  ac_free(m->be, dv);
  ac_free(m->be, dhv);
}

static double rel_err(size_t n, const float *got, const double *want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return sqrt(num / den);
}

/* Softmax regression: logits z = W x + b, loss (1/B) sum_n xent(z_n). With p_n the softmax
 * and S_n = diag(p_n) - p_n p_n^T, the Hessian over (W row-major, b) is
 * (1/B) sum_n S_n (x) [x_n; 1][x_n; 1]^T: exact, in fp64, from the model's own weights. */
static void test_softmax_regression_exact(void **state) {
  ac_backend *be = backend(state);
  uint64_t rng = 0x1234567u;
  float xh[B * D];
  model m;
  model_init(&m, be, 0, &rng, xh);
  ac_hvp h;
  OK(ac_hvp_init(&h, (ac_param *const *)m.params.items, m.params.n));
  const size_t n = (size_t)C * (D + 1);
  assert_int_equal(h.numel, n);
  float w[C * D + C];
  download_all(&m, 0, w); /* W (C x D), then b (C) */
  double hess[15][15] = {{0}};
  for (int s = 0; s < B; s++) {
    double z[C], p[C], zmax = -INFINITY, sum = 0, xt[D + 1];
    for (int d = 0; d < D; d++) xt[d] = xh[s * D + d];
    xt[D] = 1.0;
    for (int c = 0; c < C; c++) {
      z[c] = w[C * D + c];
      for (int d = 0; d < D; d++) z[c] += (double)w[c * D + d] * xt[d];
      zmax = fmax(zmax, z[c]);
    }
    for (int c = 0; c < C; c++) sum += (p[c] = exp(z[c] - zmax));
    for (int c = 0; c < C; c++) p[c] /= sum;
    /* index of (c, d): W's c * D + d for d < D, b's C * D + c for d == D */
    for (int c = 0; c < C; c++)
      for (int d = 0; d <= D; d++)
        for (int c2 = 0; c2 < C; c2++)
          for (int d2 = 0; d2 <= D; d2++) {
            int i = d < D ? c * D + d : C * D + c, j = d2 < D ? c2 * D + d2 : C * D + c2;
            double sc = (c == c2 ? p[c] : 0.0) - p[c] * p[c2];
            hess[i][j] += sc * xt[d] * xt[d2] / B;
          }
  }
  for (int t = 0; t < 3; t++) {
    float v[15], hv[15], before[15], after[15];
    double want[15], step = 0;
    for (size_t i = 0; i < n; i++) v[i] = xorshift_frand(&rng);
    for (size_t i = 0; i < n; i++) {
      want[i] = 0;
      for (size_t j = 0; j < n; j++) want[i] += hess[i][j] * v[j];
    }
    download_all(&m, 0, before);
    hvp(&h, &m, v, hv, &step);
    download_all(&m, 0, after);
    assert_memory_equal(before, after, sizeof before); /* weights back bit for bit */
    download_all(&m, 1, after);
    for (size_t i = 0; i < n; i++) assert_true(after[i] == 0.0f); /* no gradient left */
    assert_true(step > 0);
    double e = rel_err(n, hv, want);
    print_message("softmax regression: |Hv - H v| / |H v| = %.2e (h = %.2e)\n", e, step);
    assert_true(e < 2e-3);
  }
  ac_hvp_destroy(&h);
  model_destroy(&m);
}

/* A two-layer tanh MLP: H v against the finite-difference Hessian built from the columns
 * H e_j (each a central difference of its own), and the symmetry <u, H v> = <v, H u>. */
static void test_mlp_fd_hessian(void **state) {
  ac_backend *be = backend(state);
  uint64_t rng = 0xfeedu;
  float xh[B * D];
  model m;
  model_init(&m, be, 1, &rng, xh);
  ac_hvp h;
  OK(ac_hvp_init(&h, (ac_param *const *)m.params.items, m.params.n));
  const size_t n = h.numel;
  assert_int_equal(n, (size_t)H1 * (D + 1) + C * (H1 + 1));
  float *ej = xcalloc(n, sizeof *ej), *col = xcalloc(n, sizeof *col);
  double *hess = xcalloc(n * n, sizeof *hess);
  for (size_t j = 0; j < n; j++) {
    memset(ej, 0, n * sizeof *ej);
    ej[j] = 1.0f;
    hvp(&h, &m, ej, col, NULL);
    for (size_t i = 0; i < n; i++) hess[i * n + j] = col[i];
  }
  /* The finite-difference Hessian is symmetric to the central difference's accuracy. */
  double asym = 0, norm = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++) {
      double d = hess[i * n + j] - hess[j * n + i];
      asym += d * d;
      norm += hess[i * n + j] * hess[i * n + j];
    }
  print_message("mlp: |H - H^T| / |H| = %.2e\n", sqrt(asym / norm));
  assert_true(sqrt(asym / norm) < 2e-3);
  float *u = xcalloc(n, sizeof *u), *v = xcalloc(n, sizeof *v), *hu = xcalloc(n, sizeof *hu),
        *hv = xcalloc(n, sizeof *hv);
  double *want = xcalloc(n, sizeof *want);
  for (size_t i = 0; i < n; i++) {
    u[i] = xorshift_frand(&rng);
    v[i] = xorshift_frand(&rng);
  }
  hvp(&h, &m, v, hv, NULL);
  hvp(&h, &m, u, hu, NULL);
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++) want[i] += hess[i * n + j] * v[j];
  double e = rel_err(n, hv, want);
  double uhv = 0, vhu = 0, scale = 0;
  for (size_t i = 0; i < n; i++) {
    uhv += (double)u[i] * hv[i];
    vhu += (double)v[i] * hu[i];
    scale += fabs((double)u[i] * hv[i]);
  }
  print_message("mlp: |Hv - H_fd v| / |H_fd v| = %.2e, <u,Hv> %.5f <v,Hu> %.5f\n", e, uhv, vhu);
  assert_true(e < 2e-3);
  assert_true(fabs(uhv - vhu) <= 1e-2 * scale);
  free(ej);
  free(col);
  free(hess);
  free(u);
  free(v);
  free(hu);
  free(hv);
  free(want);
  ac_hvp_destroy(&h);
  model_destroy(&m);
}

/* Refusals, and a failing callback: the weights still come back and no gradient stays. */
static void test_errors(void **state) {
  ac_backend *be = backend(state);
  uint64_t rng = 99;
  float xh[B * D];
  model m;
  model_init(&m, be, 0, &rng, xh);
  ac_hvp h;
  assert_int_equal(ac_hvp_init(&h, NULL, 0), AC_EINVAL);
  ac_hvp_destroy(&h);
  assert_int_equal(ac_hvp_init(NULL, NULL, 0), AC_EINVAL);
  OK(ac_hvp_init(&h, (ac_param *const *)m.params.items, m.params.n));
  const size_t n = h.numel;
  float *dv, *dhv, v[15], before[15], after[15];
  OK(ac_malloc(be, n * sizeof(float), (void **)&dv));
  OK(ac_malloc(be, n * sizeof(float), (void **)&dhv));
  OK(ac_fill_f32(be, n, dv, 0.0f));
  assert_int_equal(ac_hvp_compute(&h, dv, 1e-3, grad, &m, dhv, NULL), AC_EINVAL);
  for (size_t i = 0; i < n; i++) v[i] = xorshift_frand(&rng);
  OK(ac_memcpy_h2d(be, dv, v, sizeof v));
  assert_int_equal(ac_hvp_compute(&h, dv, 0.0, grad, &m, dhv, NULL), AC_EINVAL);
  assert_int_equal(ac_hvp_compute(&h, dv, NAN, grad, &m, dhv, NULL), AC_EINVAL);
  assert_int_equal(ac_hvp_compute(&h, dv, 1e-3, NULL, &m, dhv, NULL), AC_EINVAL);
  download_all(&m, 0, before);
  m.fail = AC_EDEVICE;
  assert_int_equal(ac_hvp_compute(&h, dv, 1e-3, grad, &m, dhv, NULL), AC_EDEVICE);
  download_all(&m, 0, after);
  assert_memory_equal(before, after, sizeof before);
  download_all(&m, 1, after);
  for (size_t i = 0; i < n; i++) assert_true(after[i] == 0.0f);
  ac_free(be, dv);
  ac_free(be, dhv);
  ac_hvp_destroy(&h);
  model_destroy(&m);
}

#define ABS_TESTS                                                                         \
  cmocka_unit_test(test_softmax_regression_exact), cmocka_unit_test(test_mlp_fd_hessian), \
      cmocka_unit_test(test_errors)

int main(void) {
  const struct CMUnitTest cpu[] = {ABS_TESTS};
  const struct CMUnitTest cuda[] = {ABS_TESTS};
  int failed = cmocka_run_group_tests_name("cpu", cpu, setup_cpu, teardown);
  failed += cmocka_run_group_tests_name("cuda", cuda, setup_cuda, teardown);
  return failed;
}
