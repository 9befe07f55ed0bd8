/* test_abs.c -- ABS's worker half (trainer/abs.c) on a model whose Hessian is known: a
 * softmax regression without bias, logits z = W x, whose Hessian over W is
 * (1/B) sum_n (diag(p_n) - p_n p_n^T) (x) x_n x_n^T. The epoch's eigenvalue against the exact
 * top eigenvalue, and the rule's directives as the curvature flattens. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "preconditioner.h"
#include "trainer.h"

enum { NB = 8, ND = 5, NC = 4, NW = NC * ND };

typedef struct {
  ac_backend *be;
  ac_linear lin;
  ac_celoss xent;
  ac_param_list params;
  float *x;
  int32_t *y;
  float scale; /* the loss is multiplied by it: scale * H is the Hessian */
  int calls;
} tiny;

static int tiny_grad(void *ctx) {
  tiny *m = ctx;
  const float *z, *dz;
  double loss;
  m->calls++;
  int rc = ac_linear_forward(&m->lin, m->x, NB, &z);
  if (rc == AC_OK) rc = ac_celoss_forward(&m->xent, z, m->y, NB, &loss);
  if (rc == AC_OK) rc = ac_celoss_backward(&m->xent, &dz);
  if (rc == AC_OK) rc = ac_linear_backward(&m->lin, dz, NULL);
  ac_param *w = m->params.items[0];
  if (rc == AC_OK && m->scale != 1.0f)
    rc =
        ac_axpby(m->be, NW, m->scale, ac_tensor_f32(&w->grad), 0.0f, NULL, ac_tensor_f32(&w->grad));
  return rc;
}

/* The exact top eigenvalue of the model's Hessian at its weights, in fp64. */
static double exact_top(tiny *m, const float *xh) {
  float w[NW];
  assert_int_equal(ac_tensor_download(&m->params.items[0]->value, w), AC_OK);
  double *h = calloc(NW * NW, sizeof *h);
  assert_non_null(h);
  for (int s = 0; s < NB; s++) {
    double z[NC], p[NC], zmax = -INFINITY, sum = 0;
    for (int c = 0; c < NC; c++) {
      z[c] = 0;
      for (int d = 0; d < ND; d++) z[c] += (double)w[c * ND + d] * xh[s * ND + d];
      zmax = fmax(zmax, z[c]);
    }
    for (int c = 0; c < NC; c++) sum += (p[c] = exp(z[c] - zmax));
    for (int c = 0; c < NC; c++) p[c] /= sum;
    for (int c = 0; c < NC; c++)
      for (int d = 0; d < ND; d++)
        for (int c2 = 0; c2 < NC; c2++)
          for (int d2 = 0; d2 < ND; d2++)
            h[(c * ND + d) * NW + c2 * ND + d2] +=
                ((c == c2 ? p[c] : 0.0) - p[c] * p[c2]) * xh[s * ND + d] * xh[s * ND + d2] / NB;
  }
  double top = 0;
  pc_power_opts po;
  pc_power_opts_default(&po);
  po.tol = 1e-12;
  po.max_iters = 10000;
  assert_true(pc_power_iteration_f64(NW, h, &po, &top, NULL) >= 0);
  free(h);
  return top;
}

static void tiny_init(tiny *m, float *xh) {
  memset(m, 0, sizeof *m);
  m->scale = 1.0f;
  assert_int_equal(ac_backend_create(&m->be, NULL), AC_OK);
  assert_int_equal(ac_linear_init(&m->lin, m->be, "fc", ND, NC, 0, NB, 5), AC_OK);
  assert_int_equal(ac_celoss_init(&m->xent, m->be, NC, NB), AC_OK);
  ac_param_list_init(&m->params);
  assert_int_equal(ac_linear_params(&m->lin, &m->params), AC_OK);
  uint64_t s = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < NB * ND; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    xh[i] = (float)((double)(s >> 11) * 0x1.0p-53 * 4.0 - 2.0);
  }
  static const int32_t labels[NB] = {0, 1, 2, 3, 3, 2, 1, 0};
  assert_int_equal(ac_malloc(m->be, sizeof(float) * NB * ND, (void **)&m->x), AC_OK);
  assert_int_equal(ac_malloc(m->be, sizeof labels, (void **)&m->y), AC_OK);
  assert_int_equal(ac_memcpy_h2d(m->be, m->x, xh, sizeof(float) * NB * ND), AC_OK);
  assert_int_equal(ac_memcpy_h2d(m->be, m->y, labels, sizeof labels), AC_OK);
}

static void tiny_destroy(tiny *m) {
  ac_free(m->be, m->x);
  ac_free(m->be, m->y);
  ac_param_list_destroy(&m->params);
  ac_celoss_destroy(&m->xent);
  ac_linear_destroy(&m->lin);
  ac_backend_destroy(m->be);
}

/* The first epoch measures the top eigenvalue (tight tolerance: to 1e-3 of the exact one)
 * and takes it as the reference; a flatter loss (the same Hessian times 0.4) grows the batch
 * and the learning rate; at the largest batch no product is taken. */
static void test_epochs(void **state) {
  (void)state;
  tiny m;
  float xh[NB * ND], w0[NW], w1[NW];
  tiny_init(&m, xh);
  double top = exact_top(&m, xh);
  pc_abs_opts o;
  pc_abs_opts_default(&o);
  o.power_tol = 1e-6;
  o.power_max_iters = 200;
  o.max_batch_factor = 2;
  pt_abs *a = NULL;
  pt_error err = {""};
  assert_int_equal(pt_abs_create(&a, m.params.items, m.params.n, &o, &err), PT_OK);
  pt_abs_directive d;
  pt_abs_initial(a, &d);
  assert_int_equal(d.batch, 128);
  assert_true(d.lr_scale == 1.0);
  assert_true(isnan(d.lambda));
  assert_int_equal(ac_tensor_download(&m.params.items[0]->value, w0), AC_OK);
  assert_int_equal(pt_abs_epoch(a, tiny_grad, &m, &d, &err), PT_OK);
  print_message("epoch 1: lambda %.6f (exact %.6f), %d products\n", d.lambda, top, d.power_iters);
  assert_true(fabs(d.lambda - top) <= 1e-3 * top);
  assert_true(d.converged);
  assert_int_equal(d.decision, PC_ABS_REFERENCE);
  assert_int_equal(d.batch, 128);
  assert_int_equal(m.calls, 2 * d.power_iters);
  assert_int_equal(ac_tensor_download(&m.params.items[0]->value, w1), AC_OK);
  assert_memory_equal(w0, w1, sizeof w0);
  m.scale = 0.4f;
  assert_int_equal(pt_abs_epoch(a, tiny_grad, &m, &d, &err), PT_OK);
  print_message("epoch 2: lambda %.6f, %s\n", d.lambda, pc_abs_decision_name(d.decision));
  assert_true(fabs(d.lambda - 0.4 * top) <= 1e-3 * top);
  assert_int_equal(d.decision, PC_ABS_GREW_FLAT);
  assert_int_equal(d.batch, 256);
  assert_true(d.lr_scale == 2.0);
  assert_true(fabs(d.adv_fraction - 0.1) < 1e-15);
  int calls = m.calls;
  assert_int_equal(pt_abs_epoch(a, tiny_grad, &m, &d, &err), PT_OK);
  assert_int_equal(d.decision, PC_ABS_AT_MAX);
  assert_int_equal(d.power_iters, 0);
  assert_int_equal(m.calls, calls);
  assert_int_equal(d.batch, 256);
  pt_abs_destroy(a);
  tiny_destroy(&m);
}

/* A failing gradient is reported with the product that failed; bad arguments are refused. */
static void test_errors(void **state) {
  (void)state;
  tiny m;
  float xh[NB * ND];
  tiny_init(&m, xh);
  pc_abs_opts o;
  pc_abs_opts_default(&o);
  pt_abs *a = NULL;
  pt_error err = {""};
  o.ref_ratio = 2;
  assert_int_equal(pt_abs_create(&a, m.params.items, m.params.n, &o, &err), PT_EINVAL);
  assert_null(a);
  pc_abs_opts_default(&o);
  assert_int_equal(pt_abs_create(&a, m.params.items, 0, &o, &err), PT_EINVAL);
  assert_int_equal(pt_abs_create(&a, m.params.items, m.params.n, &o, &err), PT_OK);
  pt_abs_directive d;
  assert_int_equal(pt_abs_epoch(a, NULL, &m, &d, &err), PT_EINVAL);
  ac_free(m.be, m.x); /* make the forward fail: a NULL input */
  m.x = NULL;
  assert_int_equal(pt_abs_epoch(a, tiny_grad, &m, &d, &err), PT_EACCEL);
  assert_non_null(strstr(err.msg, "Hessian-vector product"));
  pt_abs_destroy(a);
  tiny_destroy(&m);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_epochs), cmocka_unit_test(test_errors)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
