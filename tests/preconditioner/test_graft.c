/* test_graft.c -- grafting rules against direct references, rescaling, bad input. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include <cmocka.h>

#include "preconditioner.h"
#include "test_util.h"

enum { N = 41, STEPS = 6 };

/* Gradient of step s: a different scale each step, so normalisation matters. */
static void gradient(int s, float *g) {
  double scale = pow(10.0, (double)(s % 3) - 1.0);
  for (size_t i = 0; i < N; i++) g[i] = (float)(scale * uniform());
  if (s == 2) g[5] = 0.0f; /* an exact zero entry */
}

static double norm(size_t n, const float *x) {
  double s = 0.0;
  for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
  return sqrt(s);
}

/* The textbook rules with fp64 state, written out independently of graft.c. */
static void reference(pc_graft kind, double b1, double b2, double eps, int t, const float *g,
                      double *m, double *v, double *d) {
  double gn[N], nrm = norm(N, g);
  for (size_t i = 0; i < N; i++) gn[i] = nrm > 0.0 ? g[i] / nrm : 0.0;
  for (size_t i = 0; i < N; i++) {
    switch (kind) {
      case PC_GRAFT_SGD:
        d[i] = g[i];
        break;
      case PC_GRAFT_ADAGRAD:
        v[i] += (double)g[i] * g[i];
        d[i] = g[i] / (sqrt(v[i]) + eps);
        break;
      case PC_GRAFT_RMSPROP_NORMED:
        v[i] = b2 * v[i] + (1.0 - b2) * gn[i] * gn[i];
        d[i] = gn[i] / (sqrt(v[i]) + eps);
        break;
      case PC_GRAFT_ADAM_NORMED: {
        m[i] = b1 * m[i] + (1.0 - b1) * gn[i];
        v[i] = b2 * v[i] + (1.0 - b2) * gn[i] * gn[i];
        double mh = m[i] / (1.0 - pow(b1, t)), vh = v[i] / (1.0 - pow(b2, t));
        d[i] = mh / (sqrt(vh) + eps);
        break;
      }
      case PC_GRAFT_RMSPROP:
        v[i] = b2 * v[i] + (1.0 - b2) * (double)g[i] * g[i];
        d[i] = g[i] / (sqrt(v[i] / (1.0 - pow(b2, t))) + eps);
        break;
      case PC_GRAFT_ADAM: {
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * (double)g[i] * g[i];
        double mh = m[i] / (1.0 - pow(b1, t)), vh = v[i] / (1.0 - pow(b2, t));
        d[i] = mh / (sqrt(vh) + eps);
        break;
      }
    }
  }
}

static void check_rule(pc_graft kind, double b1, double b2, double eps) {
  pc_graft_opts o;
  pc_graft_opts_default(&o, kind);
  o.beta1 = b1;
  o.beta2 = b2;
  o.eps = eps;
  float g[N], m[N] = {0}, v[N] = {0}, d[N];
  double mr[N] = {0}, vr[N] = {0}, dr[N];
  rng_state = 99 + (uint64_t)kind;
  for (int t = 1; t <= STEPS; t++) {
    gradient(t, g);
    assert_int_equal(pc_graft_direction_f32(N, g, &o, t, m, v, d), PC_OK);
    reference(kind, b1, b2, eps, t, g, mr, vr, dr);
    /* Normwise: fp32 state rounds where the moments cancel, so elementwise relative
     * error is not meaningful for entries near zero. */
    double sd = 0.0, sm = 0.0, sv = 0.0;
    for (size_t i = 0; i < N; i++) {
      sd = fmax(sd, fabs(dr[i]));
      sm = fmax(sm, fabs(mr[i]));
      sv = fmax(sv, fabs(vr[i]));
    }
    for (size_t i = 0; i < N; i++) {
      assert_true(fabs(d[i] - dr[i]) <= 1e-6 * sd);
      assert_true(fabs(m[i] - mr[i]) <= 1e-6 * sm);
      assert_true(fabs(v[i] - vr[i]) <= 1e-6 * sv);
    }
  }
}

static void test_rules(void **state) {
  (void)state;
  check_rule(PC_GRAFT_SGD, 0.9, 0.999, 1e-8);
  check_rule(PC_GRAFT_ADAGRAD, 0.9, 0.999, 1e-8);
  check_rule(PC_GRAFT_ADAGRAD, 0.9, 0.999, 1e-1);
  check_rule(PC_GRAFT_RMSPROP_NORMED, 0.9, 0.999, 1e-8);
  check_rule(PC_GRAFT_RMSPROP_NORMED, 0.9, 0.5, 1e-3);
  check_rule(PC_GRAFT_ADAM_NORMED, 0.9, 0.999, 1e-8);
  check_rule(PC_GRAFT_ADAM_NORMED, 0.0, 0.9, 1e-2);
  check_rule(PC_GRAFT_RMSPROP, 0.9, 0.999, 1e-8);
  check_rule(PC_GRAFT_RMSPROP, 0.9, 0.5, 1e-3);
  check_rule(PC_GRAFT_ADAM, 0.9, 0.999, 1e-8);
  check_rule(PC_GRAFT_ADAM, 0.0, 0.9, 1e-2);
}

/* Properties that do not need a reference: normalised rules ignore the gradient's scale;
 * Adam's first step is sign(g) up to eps (bias correction undoes the moments' (1 - beta)). */
static void test_properties(void **state) {
  (void)state;
  float g[N], g2[N], m[N] = {0}, v[N] = {0}, m2[N] = {0}, v2[N] = {0}, d[N], d2[N];
  rng_state = 5;
  gradient(1, g);
  for (size_t i = 0; i < N; i++) g2[i] = 1000.0f * g[i];
  pc_graft_opts o;
  pc_graft_opts_default(&o, PC_GRAFT_ADAM_NORMED);
  assert_true(o.beta1 == 0.9 && o.beta2 == 0.999 && o.eps == 1e-8);
  assert_int_equal(pc_graft_direction_f32(N, g, &o, 1, m, v, d), PC_OK);
  assert_int_equal(pc_graft_direction_f32(N, g2, &o, 1, m2, v2, d2), PC_OK);
  for (size_t i = 0; i < N; i++) {
    assert_true(fabsf(d[i] - d2[i]) <= 1e-5f);
    assert_true(fabsf(fabsf(d[i]) - 1.0f) <= 1e-3f);
    assert_true((d[i] > 0) == (g[i] > 0));
  }
  /* Plain RMSprop's and Adam's first step is sign(g) up to eps whatever g's scale: the bias
   * correction undoes the (1 - beta2) of the first v (without it: 1/sqrt(1 - b2) too large). */
  const pc_graft plain[] = {PC_GRAFT_RMSPROP, PC_GRAFT_ADAM};
  for (size_t k = 0; k < 2; k++) {
    pc_graft_opts_default(&o, plain[k]);
    memset(m, 0, sizeof m);
    memset(v, 0, sizeof v);
    assert_int_equal(pc_graft_direction_f32(N, g2, &o, 1, m, v, d), PC_OK);
    for (size_t i = 0; i < N; i++) {
      assert_true(fabsf(fabsf(d[i]) - 1.0f) <= 1e-5f);
      assert_true((d[i] > 0) == (g2[i] > 0));
    }
  }
  pc_graft_opts_default(&o, PC_GRAFT_ADAM_NORMED);
  /* a zero gradient gives a zero direction, not NaN */
  float z[N] = {0};
  memset(v, 0, sizeof v);
  o.kind = PC_GRAFT_RMSPROP_NORMED;
  assert_int_equal(pc_graft_direction_f32(N, z, &o, 1, NULL, v, d), PC_OK);
  for (size_t i = 0; i < N; i++) assert_true(d[i] == 0.0f && v[i] == 0.0f);
  /* in place: d == g */
  o.kind = PC_GRAFT_ADAGRAD;
  memset(v, 0, sizeof v);
  memset(v2, 0, sizeof v2);
  memcpy(g2, g, sizeof g);
  assert_int_equal(pc_graft_direction_f32(N, g, &o, 1, NULL, v, d), PC_OK);
  assert_int_equal(pc_graft_direction_f32(N, g2, &o, 1, NULL, v2, g2), PC_OK);
  assert_memory_equal(d, g2, sizeof d);
}

static void test_rescale(void **state) {
  (void)state;
  float p[N], p0[N], d[N];
  rng_state = 17;
  gradient(0, p);
  gradient(1, d);
  memcpy(p0, p, sizeof p);
  pc_graft_rescale_f32(N, p, d);
  double np = norm(N, p), nd = norm(N, d), ratio = nd / norm(N, p0);
  assert_true(fabs(np - nd) <= 1e-6 * nd);
  for (size_t i = 0; i < N; i++) /* same direction, only the length changed */
    assert_true(fabs(p[i] - p0[i] * ratio) <= 1e-6 * fabs(p0[i] * ratio) + 1e-12);

  /* the whole path: a Shampoo-like direction grafted to AdaGrad's norm */
  pc_graft_opts o;
  pc_graft_opts_default(&o, PC_GRAFT_ADAGRAD);
  float v[N] = {0}, g[N], dir[N];
  gradient(2, g);
  assert_int_equal(pc_graft_direction_f32(N, g, &o, 1, NULL, v, dir), PC_OK);
  memcpy(p, p0, sizeof p);
  pc_graft_rescale_f32(N, p, dir);
  assert_true(fabs(norm(N, p) - norm(N, dir)) <= 1e-6 * norm(N, dir));

  /* zero or non-finite p: p becomes d */
  memset(p, 0, sizeof p);
  pc_graft_rescale_f32(N, p, d);
  assert_memory_equal(p, d, sizeof p);
  memcpy(p, p0, sizeof p);
  p[3] = NAN;
  pc_graft_rescale_f32(N, p, d);
  assert_memory_equal(p, d, sizeof p);
  p[0] = INFINITY;
  pc_graft_rescale_f32(N, p, d);
  assert_memory_equal(p, d, sizeof p);
  pc_graft_rescale_f32(N, NULL, d); /* no-op */
  pc_graft_rescale_f32(N, p, NULL);
}

/* Block-by-block grafting over a layout, without gathering: each block of P gets the norm
 * of the same block of D, exactly as gathering the block and rescaling it would give. */
static void test_rescale_blocks(void **state) {
  (void)state;
  enum { R = 7, C = 10 };
  const size_t dims[2] = {R, C};
  pc_layout_opts lo = {.block_size = 4, .skip_limit = 100};
  pc_layout l;
  assert_int_equal(pc_layout_init(&l, 2, dims, &lo), PC_OK);
  assert_int_equal(l.nblocks, 6);
  float p[R * C], p0[R * C], d[R * C];
  rng_state = 23;
  for (size_t i = 0; i < R * C; i++) {
    p0[i] = (float)uniform();
    d[i] = (float)(0.01 * uniform());
  }
  memcpy(p, p0, sizeof p);
  const pc_block *zb = &l.blocks[4]; /* one block of P is zero: it becomes D's block */
  for (size_t i = 0; i < zb->rows; i++)
    for (size_t j = 0; j < zb->cols; j++) {
      size_t at = (zb->row0 + i) * C + zb->col0 + j;
      p[at] = p0[at] = 0.0f;
    }
  for (size_t k = 0; k < l.nblocks; k++) {
    const pc_block *b = &l.blocks[k];
    size_t off = b->row0 * C + b->col0;
    assert_int_equal(pc_graft_rescale_block_f32(b->rows, b->cols, p + off, C, d + off, C), PC_OK);
  }
  for (size_t k = 0; k < l.nblocks; k++) {
    const pc_block *b = &l.blocks[k];
    float gp[16], gd[16];
    for (size_t i = 0; i < b->rows; i++)
      for (size_t j = 0; j < b->cols; j++) {
        gp[i * b->cols + j] = p0[(b->row0 + i) * C + b->col0 + j];
        gd[i * b->cols + j] = d[(b->row0 + i) * C + b->col0 + j];
      }
    size_t n = b->rows * b->cols;
    pc_graft_rescale_f32(n, gp, gd);
    for (size_t i = 0; i < b->rows; i++)
      for (size_t j = 0; j < b->cols; j++)
        assert_true(gp[i * b->cols + j] == p[(b->row0 + i) * C + b->col0 + j]);
    assert_true(fabs(norm(n, gp) - norm(n, gd)) <= 1e-6 * norm(n, gd));
  }
  pc_layout_destroy(&l);

  assert_int_equal(pc_graft_rescale_block_f32(0, 3, p, 3, d, 3), PC_EINVAL);
  assert_int_equal(pc_graft_rescale_block_f32(3, 0, p, 3, d, 3), PC_EINVAL);
  assert_int_equal(pc_graft_rescale_block_f32(3, 3, NULL, 3, d, 3), PC_EINVAL);
  assert_int_equal(pc_graft_rescale_block_f32(3, 3, p, 3, NULL, 3), PC_EINVAL);
  assert_int_equal(pc_graft_rescale_block_f32(3, 3, p, 2, d, 3), PC_EINVAL);
  assert_int_equal(pc_graft_rescale_block_f32(3, 3, p, 3, d, 2), PC_EINVAL);
}

static void test_names(void **state) {
  (void)state;
  assert_string_equal(pc_graft_name(PC_GRAFT_SGD), "sgd");
  assert_string_equal(pc_graft_name(PC_GRAFT_ADAGRAD), "adagrad");
  assert_string_equal(pc_graft_name(PC_GRAFT_RMSPROP_NORMED), "rmsprop-normed");
  assert_string_equal(pc_graft_name(PC_GRAFT_ADAM_NORMED), "adam-normed");
  assert_string_equal(pc_graft_name((pc_graft)42), "unknown");
}

static void test_bad_arguments(void **state) {
  (void)state;
  float g[4] = {1, 2, 3, 4}, m[4] = {0}, v[4] = {0}, d[4];
  pc_graft_opts o;
  pc_graft_opts_default(&o, PC_GRAFT_SGD);
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, NULL, NULL, d), PC_OK);
  assert_int_equal(pc_graft_direction_f32(0, g, &o, 1, m, v, d), PC_EINVAL);
  assert_int_equal(pc_graft_direction_f32(4, NULL, &o, 1, m, v, d), PC_EINVAL);
  assert_int_equal(pc_graft_direction_f32(4, g, NULL, 1, m, v, d), PC_EINVAL);
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, m, v, NULL), PC_EINVAL);
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 0, m, v, d), PC_EINVAL);
  o.kind = (pc_graft)9;
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, m, v, d), PC_EINVAL);

  pc_graft_opts_default(&o, PC_GRAFT_ADAGRAD);
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, m, NULL, d), PC_EINVAL);
  o.eps = 0.0;
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, m, v, d), PC_EINVAL);
  o.eps = NAN;
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, m, v, d), PC_EINVAL);

  pc_graft_opts_default(&o, PC_GRAFT_RMSPROP_NORMED);
  o.beta2 = 1.0;
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, NULL, v, d), PC_EINVAL);
  o.beta2 = -0.1;
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, NULL, v, d), PC_EINVAL);

  pc_graft_opts_default(&o, PC_GRAFT_ADAM_NORMED);
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, NULL, v, d), PC_EINVAL);
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, m, NULL, d), PC_EINVAL);
  o.beta1 = 1.0;
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, m, v, d), PC_EINVAL);
  o.beta1 = NAN;
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, m, v, d), PC_EINVAL);

  /* non-finite gradient: refused before any state changes */
  pc_graft_opts_default(&o, PC_GRAFT_ADAM_NORMED);
  g[2] = NAN;
  d[0] = 5.0f;
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, m, v, d), PC_ENONFINITE_INPUT);
  g[2] = INFINITY;
  assert_int_equal(pc_graft_direction_f32(4, g, &o, 1, m, v, d), PC_ENONFINITE_INPUT);
  for (int i = 0; i < 4; i++) assert_true(m[i] == 0.0f && v[i] == 0.0f);
  assert_true(d[0] == 5.0f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rules),   cmocka_unit_test(test_properties),
      cmocka_unit_test(test_rescale), cmocka_unit_test(test_rescale_blocks),
      cmocka_unit_test(test_names),   cmocka_unit_test(test_bad_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
