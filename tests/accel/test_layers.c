/*
 * test_layers.c -- every layer of accel against a naive fp64 reference written here.
 *
 * For each layer a "case" draws small random fp32 inputs and parameters (a seeded generator,
 * so a case gives the same numbers on every backend), runs the layer's forward and backward
 * on a backend with upstream gradient r, and describes the layer's fp64 reference forward
 * y = f(x, params). The checks:
 *   forward:  the layer's fp32 y against the reference y,
 *             rel = max|y32 - y64| / max(max|y64|, 1)          <= TOL_FWD (1e-4)
 *   backward: every input and parameter gradient against central differences of the
 *             reference's L = sum_i r_i y_i (step 1e-5 on fp64 inputs),
 *             rel = max|g32 - fd| / max(max|fd|, 1e-3)           <= TOL_GRAD (5e-4)
 * fp32 rounding of these small sums is ~1e-6 relative, so the bounds leave room for it and
 * still catch any wrong term (a wrong term is an O(1) relative error).
 * On CUDA (when a device exists) the same cases run against the same references and also
 * against the CPU backend's results on identical inputs (rel <= TOL_XBE, 1e-4).
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "accel.h"
#include "test_util.h"

#define TOL_FWD   1e-4
#define TOL_GRAD  5e-4
#define TOL_XBE   1e-4
#define FD_STEP   1e-5
#define MAX_IN    6
#define MAX_EXTRA 2

/* ------------------------------------------------------------------------------------ */
/* Cases: host inputs, a reference, and what the backend produced                          */

typedef void (*ref_fn)(const void *cfg, double *const *in, double *y);

typedef struct {
  int nin;
  double *in[MAX_IN]; /* fp32-representable values, as doubles */
  size_t len[MAX_IN];
  size_t ny;
  double *r; /* upstream gradient (ny) */
  ref_fn f;
  const void *cfg;
  int nextra; /* extra outputs (running statistics) and their expected values */
  double *extra_ref[MAX_EXTRA];
  size_t extra_len[MAX_EXTRA];
} refcase;

typedef struct {
  float *y;            /* ny */
  float *grad[MAX_IN]; /* len[k], NULL where not differentiable */
  float *extra[MAX_EXTRA];
} result;

typedef void (*case_fn)(ac_backend *be, refcase *rc, result *res);

static uint64_t rng_state;

static void rng_seed(uint64_t s) {
  rng_state = s * 2685821657736338717ull + 88172645463325252ull;
}

static double frand(void) {
  return (double)xorshift_frand(&rng_state);
}

static double *dalloc(size_t n) {
  double *p = calloc(n ? n : 1, sizeof *p);
  assert_non_null(p);
  return p;
}

static float *falloc(size_t n) {
  float *p = calloc(n ? n : 1, sizeof *p);
  assert_non_null(p);
  return p;
}

/* Adds input k of n random values in [lo, hi). */
static double *add_input(refcase *rc, size_t n, double lo, double hi) {
  int k = rc->nin++;
  assert_true(k < MAX_IN);
  rc->in[k] = dalloc(n);
  rc->len[k] = n;
  for (size_t i = 0; i < n; i++)
    rc->in[k][i] = (double)(float)(lo + (hi - lo) * (frand() + 1.0) / 2.0);
  return rc->in[k];
}

static void set_output(refcase *rc, size_t ny) {
  rc->ny = ny;
  rc->r = dalloc(ny);
  for (size_t i = 0; i < ny; i++) rc->r[i] = frand();
}

static float *to_f32(const double *x, size_t n) {
  float *f = falloc(n);
  for (size_t i = 0; i < n; i++) f[i] = (float)x[i];
  return f;
}

static float *dev_upload(ac_backend *be, const double *x, size_t n) {
  void *d = NULL;
  float *h = to_f32(x, n);
  OK(ac_malloc(be, n * sizeof(float), &d));
  OK(ac_memcpy_h2d(be, d, h, n * sizeof(float)));
  free(h);
  return d;
}

static int32_t *dev_upload_i32(ac_backend *be, const int32_t *x, size_t n) {
  void *d = NULL;
  OK(ac_malloc(be, n * sizeof(int32_t), &d));
  OK(ac_memcpy_h2d(be, d, x, n * sizeof(int32_t)));
  return d;
}

static float *dev_download(ac_backend *be, const float *d, size_t n) {
  float *h = falloc(n);
  OK(ac_memcpy_d2h(be, h, d, n * sizeof(float)));
  return h;
}

static void param_set(ac_param *p, const double *x) {
  assert_int_equal(p->value.numel > 0, 1);
  float *h = to_f32(x, p->value.numel);
  OK(ac_tensor_upload(&p->value, h));
  free(h);
}

static float *param_grad(const ac_param *p) {
  float *h = falloc(p->grad.numel);
  OK(ac_tensor_download(&p->grad, h));
  return h;
}

static void free_case(refcase *rc, result *res) {
  for (int k = 0; k < MAX_IN; k++) {
    free(rc->in[k]);
    free(res->grad[k]);
  }
  for (int k = 0; k < MAX_EXTRA; k++) {
    free(rc->extra_ref[k]);
    free(res->extra[k]);
  }
  free(rc->r);
  free(res->y);
}

/* ------------------------------------------------------------------------------------ */
/* Checks                                                                                  */

static double rel_err(const float *a, const double *b, size_t n, double floor) {
  double num = 0.0, den = floor;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - b[i]);
    num = d > num || isnan(d) ? d : num;
    den = fabs(b[i]) > den ? fabs(b[i]) : den;
  }
  return num / den;
}

static double loss_of(const refcase *rc, double *y) {
  rc->f(rc->cfg, rc->in, y);
  double l = 0.0;
  for (size_t i = 0; i < rc->ny; i++) l += rc->r[i] * y[i];
  return l;
}

static void check_case(const char *name, const refcase *rc, const result *res) {
  double *y = dalloc(rc->ny);
  rc->f(rc->cfg, rc->in, y);
  double e = rel_err(res->y, y, rc->ny, 1.0);
  if (!(e <= TOL_FWD)) fail_msg("%s: forward rel err %.3g > %.1g", name, e, TOL_FWD);
  for (int k = 0; k < rc->nin; k++) {
    if (res->grad[k] == NULL) continue;
    double *fd = dalloc(rc->len[k]);
    for (size_t i = 0; i < rc->len[k]; i++) {
      double keep = rc->in[k][i];
      rc->in[k][i] = keep + FD_STEP;
      double lp = loss_of(rc, y);
      rc->in[k][i] = keep - FD_STEP;
      double lm = loss_of(rc, y);
      rc->in[k][i] = keep;
      fd[i] = (lp - lm) / (2.0 * FD_STEP);
    }
    e = rel_err(res->grad[k], fd, rc->len[k], 1e-3);
    free(fd);
    if (!(e <= TOL_GRAD))
      fail_msg("%s: gradient of input %d rel err %.3g > %.1g", name, k, e, TOL_GRAD);
  }
  for (int k = 0; k < rc->nextra; k++) {
    e = rel_err(res->extra[k], rc->extra_ref[k], rc->extra_len[k], 1.0);
    if (!(e <= TOL_FWD)) fail_msg("%s: extra output %d rel err %.3g > %.1g", name, k, e, TOL_FWD);
  }
  free(y);
}

static void check_close_f(const char *name, const char *what, const float *a, const float *b,
                          size_t n) {
  double *bd = dalloc(n);
  for (size_t i = 0; i < n; i++) bd[i] = b[i];
  double e = rel_err(a, bd, n, 1.0);
  free(bd);
  if (!(e <= TOL_XBE))
    fail_msg("%s: %s differs from the CPU backend: rel %.3g > %.1g", name, what, e, TOL_XBE);
}

static void run_case(void **state, const char *name, case_fn c) {
  fixture *f = *state;
  ac_backend *be = backend(state);
  refcase rc;
  result res;
  memset(&rc, 0, sizeof rc);
  memset(&res, 0, sizeof res);
  c(be, &rc, &res);
  check_case(name, &rc, &res);
  if (f->cpu != NULL) {
    refcase rc2;
    result res2;
    memset(&rc2, 0, sizeof rc2);
    memset(&res2, 0, sizeof res2);
    c(f->cpu, &rc2, &res2);
    check_close_f(name, "y", res.y, res2.y, rc.ny);
    for (int k = 0; k < rc.nin; k++)
      if (res.grad[k] != NULL)
        check_close_f(name, "gradient", res.grad[k], res2.grad[k], rc.len[k]);
    free_case(&rc2, &res2);
  }
  free_case(&rc, &res);
}

/* Downloads the layer output into res->y after syncing. */
static void take_y(ac_backend *be, result *res, const float *y, size_t ny) {
  OK(ac_sync(be));
  res->y = dev_download(be, y, ny);
}

/* ------------------------------------------------------------------------------------ */
/* Linear                                                                                  */

typedef struct {
  size_t rows, in, out;
} lin_cfg;

static void ref_linear(const void *cfg, double *const *in, double *y) {
  const lin_cfg *c = cfg;
  for (size_t r = 0; r < c->rows; r++)
    for (size_t o = 0; o < c->out; o++) {
      double s = in[2][o];
      for (size_t i = 0; i < c->in; i++) s += in[0][r * c->in + i] * in[1][o * c->in + i];
      y[r * c->out + o] = s;
    }
}

static void case_linear(ac_backend *be, refcase *rc, result *res) {
  static const lin_cfg cfg = {5, 7, 4};
  rng_seed(1);
  double *x = add_input(rc, cfg.rows * cfg.in, -1, 1);
  double *w = add_input(rc, cfg.out * cfg.in, -1, 1);
  double *b = add_input(rc, cfg.out, -1, 1);
  set_output(rc, cfg.rows * cfg.out);
  rc->f = ref_linear;
  rc->cfg = &cfg;

  ac_linear l;
  OK(ac_linear_init(&l, be, "fc", cfg.in, cfg.out, 1, 8, 3));
  param_set(&l.weight, w);
  param_set(&l.bias, b);
  float *xd = dev_upload(be, x, rc->len[0]), *dr = dev_upload(be, rc->r, rc->ny);
  const float *y, *dx;
  OK(ac_linear_forward(&l, xd, cfg.rows, &y));
  take_y(be, res, y, rc->ny);
  /* Twice: parameter gradients must accumulate (then halved), dx must not. */
  OK(ac_linear_backward(&l, dr, &dx));
  OK(ac_linear_backward(&l, dr, &dx));
  res->grad[0] = dev_download(be, dx, rc->len[0]);
  res->grad[1] = param_grad(&l.weight);
  res->grad[2] = param_grad(&l.bias);
  for (int k = 1; k <= 2; k++)
    for (size_t i = 0; i < rc->len[k]; i++) res->grad[k][i] *= 0.5f;
  ac_free(be, xd);
  ac_free(be, dr);
  ac_linear_destroy(&l);
}

static void test_linear(void **state) {
  run_case(state, "linear", case_linear);
}

/* ------------------------------------------------------------------------------------ */
/* Embedding (with a repeated and an out-of-range index)                                   */

typedef struct {
  size_t rows, vocab, dim;
  int32_t idx[6];
} emb_cfg;

static void ref_embedding(const void *cfg, double *const *in, double *y) {
  const emb_cfg *c = cfg;
  for (size_t r = 0; r < c->rows; r++)
    for (size_t j = 0; j < c->dim; j++) {
      int32_t t = c->idx[r];
      y[r * c->dim + j] = t >= 0 && (size_t)t < c->vocab ? in[0][(size_t)t * c->dim + j] : 0.0;
    }
}

static void case_embedding(ac_backend *be, refcase *rc, result *res) {
  static const emb_cfg cfg = {6, 5, 3, {2, 0, 2, 4, -1, 5}};
  rng_seed(2);
  double *w = add_input(rc, cfg.vocab * cfg.dim, -1, 1);
  set_output(rc, cfg.rows * cfg.dim);
  rc->f = ref_embedding;
  rc->cfg = &cfg;

  ac_embedding l;
  OK(ac_embedding_init(&l, be, "tok", cfg.vocab, cfg.dim, cfg.rows, 3));
  param_set(&l.weight, w);
  int32_t *idx = dev_upload_i32(be, cfg.idx, cfg.rows);
  float *dr = dev_upload(be, rc->r, rc->ny);
  const float *y;
  OK(ac_embedding_forward(&l, idx, cfg.rows, &y));
  take_y(be, res, y, rc->ny);
  OK(ac_embedding_backward(&l, dr));
  res->grad[0] = param_grad(&l.weight);
  ac_free(be, idx);
  ac_free(be, dr);
  ac_embedding_destroy(&l);
}

static void test_embedding(void **state) {
  run_case(state, "embedding", case_embedding);
}

/* ------------------------------------------------------------------------------------ */
/* Positional embedding (t < max_t: the unused rows get no gradient)                       */

typedef struct {
  size_t batch, t, max_t, dim;
} pos_cfg;

static void ref_posembed(const void *cfg, double *const *in, double *y) {
  const pos_cfg *c = cfg;
  for (size_t b = 0; b < c->batch; b++)
    for (size_t i = 0; i < c->t * c->dim; i++)
      y[b * c->t * c->dim + i] = in[0][b * c->t * c->dim + i] + in[1][i];
}

static void case_posembed(ac_backend *be, refcase *rc, result *res) {
  static const pos_cfg cfg = {3, 4, 6, 5};
  rng_seed(3);
  double *x = add_input(rc, cfg.batch * cfg.t * cfg.dim, -1, 1);
  double *p = add_input(rc, cfg.max_t * cfg.dim, -1, 1);
  set_output(rc, rc->len[0]);
  rc->f = ref_posembed;
  rc->cfg = &cfg;

  ac_posembed l;
  OK(ac_posembed_init(&l, be, "pos", cfg.max_t, cfg.dim, 4, 3));
  param_set(&l.weight, p);
  float *xd = dev_upload(be, x, rc->len[0]), *dr = dev_upload(be, rc->r, rc->ny);
  const float *y, *dx;
  OK(ac_posembed_forward(&l, xd, cfg.batch, cfg.t, &y));
  take_y(be, res, y, rc->ny);
  OK(ac_posembed_backward(&l, dr, &dx));
  res->grad[0] = dev_download(be, dx, rc->len[0]);
  res->grad[1] = param_grad(&l.weight);
  ac_free(be, xd);
  ac_free(be, dr);
  ac_posembed_destroy(&l);
}

static void test_posembed(void **state) {
  run_case(state, "posembed", case_posembed);
}

/* ------------------------------------------------------------------------------------ */
/* Layer normalisation                                                                     */

typedef struct {
  size_t rows, dim;
  double eps;
} ln_cfg;

static void ref_layernorm(const void *cfg, double *const *in, double *y) {
  const ln_cfg *c = cfg;
  for (size_t r = 0; r < c->rows; r++) {
    const double *x = in[0] + r * c->dim;
    double mean = 0.0, var = 0.0;
    for (size_t j = 0; j < c->dim; j++) mean += x[j];
    mean /= (double)c->dim;
    for (size_t j = 0; j < c->dim; j++) var += (x[j] - mean) * (x[j] - mean);
    var /= (double)c->dim;
    for (size_t j = 0; j < c->dim; j++)
      y[r * c->dim + j] = (x[j] - mean) / sqrt(var + c->eps) * in[1][j] + in[2][j];
  }
}

static void case_layernorm(ac_backend *be, refcase *rc, result *res) {
  static const ln_cfg cfg = {4, 9, 1e-5};
  rng_seed(4);
  double *x = add_input(rc, cfg.rows * cfg.dim, -2, 2);
  double *g = add_input(rc, cfg.dim, 0.5, 1.5);
  double *b = add_input(rc, cfg.dim, -1, 1);
  set_output(rc, rc->len[0]);
  rc->f = ref_layernorm;
  rc->cfg = &cfg;

  ac_layernorm l;
  OK(ac_layernorm_init(&l, be, "ln", cfg.dim, (float)cfg.eps, 6));
  param_set(&l.weight, g);
  param_set(&l.bias, b);
  float *xd = dev_upload(be, x, rc->len[0]), *dr = dev_upload(be, rc->r, rc->ny);
  const float *y, *dx;
  OK(ac_layernorm_forward(&l, xd, cfg.rows, &y));
  take_y(be, res, y, rc->ny);
  OK(ac_layernorm_backward(&l, dr, &dx));
  res->grad[0] = dev_download(be, dx, rc->len[0]);
  res->grad[1] = param_grad(&l.weight);
  res->grad[2] = param_grad(&l.bias);
  ac_free(be, xd);
  ac_free(be, dr);
  ac_layernorm_destroy(&l);
}

static void test_layernorm(void **state) {
  run_case(state, "layernorm", case_layernorm);
}

/* ------------------------------------------------------------------------------------ */
/* Activations: ReLU (inputs kept away from the kink) and GELU (tanh form)                 */

typedef struct {
  size_t n;
  int gelu;
} act_cfg;

static void ref_activation(const void *cfg, double *const *in, double *y) {
  const act_cfg *c = cfg;
  const double s = sqrt(2.0 / M_PI);
  for (size_t i = 0; i < c->n; i++) {
    double x = in[0][i];
    y[i] = c->gelu ? 0.5 * x * (1.0 + tanh(s * (x + 0.044715 * x * x * x))) : (x > 0 ? x : 0);
  }
}

static void case_activation(ac_backend *be, refcase *rc, result *res, const act_cfg *cfg) {
  rng_seed(5);
  double *x = add_input(rc, cfg->n, -3, 3);
  for (size_t i = 0; i < cfg->n; i++)
    if (fabs(x[i]) < 0.01) x[i] = 0.5;
  set_output(rc, cfg->n);
  rc->f = ref_activation;
  rc->cfg = cfg;

  ac_activation l;
  OK(ac_activation_init(&l, be, cfg->gelu ? AC_UNARY_GELU : AC_UNARY_RELU, cfg->n + 3));
  float *xd = dev_upload(be, x, cfg->n), *dr = dev_upload(be, rc->r, rc->ny);
  const float *y, *dx;
  OK(ac_activation_forward(&l, xd, cfg->n, &y));
  take_y(be, res, y, rc->ny);
  OK(ac_activation_backward(&l, dr, &dx));
  res->grad[0] = dev_download(be, dx, cfg->n);
  ac_free(be, xd);
  ac_free(be, dr);
  ac_activation_destroy(&l);
}

static void case_relu(ac_backend *be, refcase *rc, result *res) {
  static const act_cfg cfg = {40, 0};
  case_activation(be, rc, res, &cfg);
}

static void case_gelu(ac_backend *be, refcase *rc, result *res) {
  static const act_cfg cfg = {40, 1};
  case_activation(be, rc, res, &cfg);
}

static void test_relu(void **state) {
  run_case(state, "relu", case_relu);
}

static void test_gelu(void **state) {
  run_case(state, "gelu", case_gelu);
}

/* ------------------------------------------------------------------------------------ */
/* Residual add                                                                            */

static void ref_residual(const void *cfg, double *const *in, double *y) {
  size_t n = *(const size_t *)cfg;
  for (size_t i = 0; i < n; i++) y[i] = in[0][i] + in[1][i];
}

static void case_residual(ac_backend *be, refcase *rc, result *res) {
  static const size_t n = 17;
  rng_seed(6);
  double *a = add_input(rc, n, -1, 1);
  double *b = add_input(rc, n, -1, 1);
  set_output(rc, n);
  rc->f = ref_residual;
  rc->cfg = &n;

  ac_residual l;
  OK(ac_residual_init(&l, be, n));
  float *ad = dev_upload(be, a, n), *bd = dev_upload(be, b, n);
  float *dr = dev_upload(be, rc->r, n);
  const float *y, *da, *db;
  OK(ac_residual_forward(&l, ad, bd, n, &y));
  take_y(be, res, y, n);
  OK(ac_residual_backward(&l, dr, &da, &db));
  res->grad[0] = dev_download(be, da, n);
  res->grad[1] = dev_download(be, db, n);
  ac_free(be, ad);
  ac_free(be, bd);
  ac_free(be, dr);
  ac_residual_destroy(&l);
}

static void test_residual(void **state) {
  run_case(state, "residual", case_residual);
}

/* ------------------------------------------------------------------------------------ */
/* Dropout: the mask is recomputed here from accel.h's documented counter RNG             */

typedef struct {
  size_t n;
  double p;
  uint64_t seed, offset;
} drop_cfg;

static uint64_t splitmix_final(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static double ref_mask(const drop_cfg *c, size_t i) {
  uint64_t z = splitmix_final(c->seed + (c->offset + i + 1) * 0x9E3779B97F4A7C15ull);
  double u = (double)(z >> 40) * (1.0 / 16777216.0);
  return u >= c->p ? 1.0 / (1.0 - c->p) : 0.0;
}

static void ref_dropout(const void *cfg, double *const *in, double *y) {
  const drop_cfg *c = cfg;
  for (size_t i = 0; i < c->n; i++) y[i] = in[0][i] * (double)(float)ref_mask(c, i);
}

static void case_dropout(ac_backend *be, refcase *rc, result *res) {
  /* The second training forward of the layer: offset advanced by n. */
  static const drop_cfg cfg = {64, 0.25, 42, 64};
  rng_seed(7);
  double *x = add_input(rc, cfg.n, -1, 1);
  set_output(rc, cfg.n);
  rc->f = ref_dropout;
  rc->cfg = &cfg;

  ac_dropout l;
  OK(ac_dropout_init(&l, be, (float)cfg.p, cfg.seed, cfg.n));
  float *xd = dev_upload(be, x, cfg.n), *dr = dev_upload(be, rc->r, cfg.n);
  const float *y, *dx;
  OK(ac_dropout_forward(&l, xd, cfg.n, AC_MODE_EVAL, &y));
  assert_ptr_equal(y, xd); /* eval: identity, and the offset does not move */
  OK(ac_dropout_forward(&l, xd, cfg.n, AC_MODE_TRAIN, &y));
  OK(ac_dropout_forward(&l, xd, cfg.n, AC_MODE_TRAIN, &y));
  take_y(be, res, y, cfg.n);
  size_t zeros = 0;
  for (size_t i = 0; i < cfg.n; i++) zeros += res->y[i] == 0.0f;
  assert_true(zeros > 4 && zeros < 32); /* about p n = 16 dropped */
  OK(ac_dropout_backward(&l, dr, &dx));
  res->grad[0] = dev_download(be, dx, cfg.n);
  ac_free(be, xd);
  ac_free(be, dr);
  ac_dropout_destroy(&l);
}

static void test_dropout(void **state) {
  run_case(state, "dropout", case_dropout);
}

/* ------------------------------------------------------------------------------------ */
/* Causal multi-head self-attention with projections                                       */

typedef struct {
  size_t batch, t, dim, heads;
} attn_cfg;

static void ref_attention(const void *cfg, double *const *in, double *y) {
  const attn_cfg *c = cfg;
  size_t d = c->dim, h = c->heads, dh = d / h, t = c->t;
  const double *x = in[0], *wq = in[1], *bq = in[2], *wp = in[3], *bp = in[4];
  double *qkv = dalloc(t * 3 * d), *ctx = dalloc(t * d), *p = dalloc(t);
  for (size_t b = 0; b < c->batch; b++) {
    const double *xb = x + b * t * d;
    for (size_t i = 0; i < t; i++)
      for (size_t o = 0; o < 3 * d; o++) {
        double s = bq[o];
        for (size_t j = 0; j < d; j++) s += xb[i * d + j] * wq[o * d + j];
        qkv[i * 3 * d + o] = s;
      }
    for (size_t hh = 0; hh < h; hh++)
      for (size_t i = 0; i < t; i++) {
        /* token i attends to tokens 0..i; q, k, v of head hh at offsets (0|1|2) d + hh dh */
        double mx = -INFINITY, sum = 0.0;
        for (size_t j = 0; j <= i; j++) {
          double s = 0.0;
          for (size_t e = 0; e < dh; e++)
            s += qkv[i * 3 * d + hh * dh + e] * qkv[j * 3 * d + d + hh * dh + e];
          p[j] = s / sqrt((double)dh);
          mx = p[j] > mx ? p[j] : mx;
        }
        for (size_t j = 0; j <= i; j++) sum += (p[j] = exp(p[j] - mx));
        for (size_t e = 0; e < dh; e++) {
          double s = 0.0;
          for (size_t j = 0; j <= i; j++) s += p[j] / sum * qkv[j * 3 * d + 2 * d + hh * dh + e];
          ctx[i * d + hh * dh + e] = s;
        }
      }
    for (size_t i = 0; i < t; i++)
      for (size_t o = 0; o < d; o++) {
        double s = bp[o];
        for (size_t j = 0; j < d; j++) s += ctx[i * d + j] * wp[o * d + j];
        y[(b * t + i) * d + o] = s;
      }
  }
  free(qkv);
  free(ctx);
  free(p);
}

static void case_attention(ac_backend *be, refcase *rc, result *res) {
  static const attn_cfg cfg = {2, 5, 8, 2};
  size_t d = cfg.dim;
  rng_seed(8);
  double *x = add_input(rc, cfg.batch * cfg.t * d, -1, 1);
  double *wq = add_input(rc, 3 * d * d, -0.5, 0.5);
  double *bq = add_input(rc, 3 * d, -0.5, 0.5);
  double *wp = add_input(rc, d * d, -0.5, 0.5);
  double *bp = add_input(rc, d, -0.5, 0.5);
  set_output(rc, rc->len[0]);
  rc->f = ref_attention;
  rc->cfg = &cfg;

  ac_attention l;
  OK(ac_attention_init(&l, be, "attn", d, cfg.heads, 7, 3, 9));
  param_set(&l.qkv.weight, wq);
  param_set(&l.qkv.bias, bq);
  param_set(&l.proj.weight, wp);
  param_set(&l.proj.bias, bp);
  float *xd = dev_upload(be, x, rc->len[0]), *dr = dev_upload(be, rc->r, rc->ny);
  const float *y, *dx;
  OK(ac_attention_forward(&l, xd, cfg.batch, cfg.t, &y));
  take_y(be, res, y, rc->ny);
  OK(ac_attention_backward(&l, dr, &dx));
  res->grad[0] = dev_download(be, dx, rc->len[0]);
  res->grad[1] = param_grad(&l.qkv.weight);
  res->grad[2] = param_grad(&l.qkv.bias);
  res->grad[3] = param_grad(&l.proj.weight);
  res->grad[4] = param_grad(&l.proj.bias);
  ac_free(be, xd);
  ac_free(be, dr);
  ac_attention_destroy(&l);
}

static void test_attention(void **state) {
  run_case(state, "attention", case_attention);
}

/* Causality on its own: changing the last token must not change earlier outputs. */
static void test_attention_causal(void **state) {
  ac_backend *be = backend(state);
  size_t t = 6, d = 8, n = t * d;
  double *x = dalloc(n);
  rng_seed(81);
  for (size_t i = 0; i < n; i++) x[i] = frand();
  ac_attention l;
  OK(ac_attention_init(&l, be, "attn", d, 4, t, 1, 5));
  float *xd = dev_upload(be, x, n);
  const float *y;
  OK(ac_attention_forward(&l, xd, 1, t, &y));
  float *y1 = dev_download(be, y, n);
  for (size_t j = 0; j < d; j++) x[(t - 1) * d + j] += 1.0;
  ac_free(be, xd);
  xd = dev_upload(be, x, n);
  OK(ac_attention_forward(&l, xd, 1, t, &y));
  float *y2 = dev_download(be, y, n);
  assert_memory_equal(y1, y2, (n - d) * sizeof(float));
  assert_true(memcmp(y1 + n - d, y2 + n - d, d * sizeof(float)) != 0);
  free(y1);
  free(y2);
  free(x);
  ac_free(be, xd);
  ac_attention_destroy(&l);
}

/* ------------------------------------------------------------------------------------ */
/* Softmax cross-entropy (one ignored row)                                                 */

typedef struct {
  size_t rows, classes;
  int32_t labels[5];
} ce_cfg;

static void ref_celoss(const void *cfg, double *const *in, double *y) {
  const ce_cfg *c = cfg;
  double total = 0.0;
  size_t counted = 0;
  for (size_t r = 0; r < c->rows; r++) {
    int32_t lab = c->labels[r];
    if (lab < 0 || (size_t)lab >= c->classes) continue;
    const double *z = in[0] + r * c->classes;
    double mx = -INFINITY, sum = 0.0;
    for (size_t j = 0; j < c->classes; j++) mx = z[j] > mx ? z[j] : mx;
    for (size_t j = 0; j < c->classes; j++) sum += exp(z[j] - mx);
    total += -(z[lab] - mx - log(sum));
    counted++;
  }
  y[0] = total / (double)counted;
}

static void case_celoss(ac_backend *be, refcase *rc, result *res) {
  static const ce_cfg cfg = {5, 7, {3, 0, -1, 6, 3}};
  rng_seed(9);
  double *z = add_input(rc, cfg.rows * cfg.classes, -3, 3);
  set_output(rc, 1);
  rc->r[0] = 1.0;
  rc->f = ref_celoss;
  rc->cfg = &cfg;

  ac_celoss l;
  OK(ac_celoss_init(&l, be, cfg.classes, 8));
  float *zd = dev_upload(be, z, rc->len[0]);
  int32_t *lab = dev_upload_i32(be, cfg.labels, cfg.rows);
  double loss = 0.0;
  const float *dz;
  OK(ac_celoss_forward(&l, zd, lab, cfg.rows, &loss));
  assert_int_equal(l.counted, 4);
  res->y = falloc(1);
  res->y[0] = (float)loss;
  OK(ac_celoss_backward(&l, &dz));
  res->grad[0] = dev_download(be, dz, rc->len[0]);
  ac_free(be, zd);
  ac_free(be, lab);
  ac_celoss_destroy(&l);
}

static void test_celoss(void **state) {
  run_case(state, "celoss", case_celoss);
}

/* ------------------------------------------------------------------------------------ */
/* 2-D convolution with stride 2 and padding 1, in chunks of 2 images (3 images: a        */
/* partial last chunk)                                                                     */

typedef struct {
  size_t n, c, h, w, oc, k, stride, pad, oh, ow;
  int dx_conv; /* whether the layer computes dx as a conv (wflip) */
} conv_cfg;

static void ref_conv(const void *cfg, double *const *in, double *y) {
  const conv_cfg *c = cfg;
  for (size_t b = 0; b < c->n; b++)
    for (size_t o = 0; o < c->oc; o++)
      for (size_t oy = 0; oy < c->oh; oy++)
        for (size_t ox = 0; ox < c->ow; ox++) {
          double s = in[2][o];
          for (size_t ch = 0; ch < c->c; ch++)
            for (size_t p = 0; p < c->k; p++)
              for (size_t q = 0; q < c->k; q++) {
                long iy = (long)(oy * c->stride + p) - (long)c->pad;
                long ix = (long)(ox * c->stride + q) - (long)c->pad;
                if (iy < 0 || ix < 0 || iy >= (long)c->h || ix >= (long)c->w) continue;
                s += in[0][((b * c->c + ch) * c->h + (size_t)iy) * c->w + (size_t)ix] *
                     in[1][((o * c->c + ch) * c->k + p) * c->k + q];
              }
          y[((b * c->oc + o) * c->oh + oy) * c->ow + ox] = s;
        }
}

static void conv_case(ac_backend *be, refcase *rc, result *res, const conv_cfg *cp) {
  const conv_cfg cfg = *cp;
  rng_seed(10);
  double *x = add_input(rc, cfg.n * cfg.c * cfg.h * cfg.w, -1, 1);
  double *w = add_input(rc, cfg.oc * cfg.c * cfg.k * cfg.k, -1, 1);
  double *b = add_input(rc, cfg.oc, -1, 1);
  set_output(rc, cfg.n * cfg.oc * cfg.oh * cfg.ow);
  rc->f = ref_conv;
  rc->cfg = cp;

  ac_conv2d l;
  OK(ac_conv2d_init(&l, be, "conv", cfg.c, cfg.oc, cfg.h, cfg.w, cfg.k, cfg.stride, cfg.pad, 1, 4,
                    2, NULL, 11));
  assert_int_equal(l.oh, cfg.oh);
  assert_int_equal(l.ow, cfg.ow);
  assert_int_equal(l.wflip != NULL, cfg.dx_conv);
  param_set(&l.weight, w);
  param_set(&l.bias, b);
  float *xd = dev_upload(be, x, rc->len[0]), *dr = dev_upload(be, rc->r, rc->ny);
  const float *y, *dx;
  OK(ac_conv2d_forward(&l, xd, cfg.n, &y));
  take_y(be, res, y, rc->ny);
  OK(ac_conv2d_backward(&l, dr, &dx));
  res->grad[0] = dev_download(be, dx, rc->len[0]);
  res->grad[1] = param_grad(&l.weight);
  res->grad[2] = param_grad(&l.bias);
  ac_free(be, xd);
  ac_free(be, dr);
  ac_conv2d_destroy(&l);
}

static void case_conv(ac_backend *be, refcase *rc, result *res) {
  /* oh = (7 + 2 - 3) / 2 + 1 = 4, ow = (6 + 2 - 3) / 2 + 1 = 3 */
  static const conv_cfg cfg = {3, 2, 7, 6, 3, 3, 2, 1, 4, 3, 0};
  conv_case(be, rc, res, &cfg);
}

static void test_conv(void **state) {
  run_case(state, "conv2d", case_conv);
}

/* Stride 1: dx is the conv of dy with the flipped weights (ac_conv2d's wflip path). "Same"
 * padding with fewer output than input channels, and padding 2 of a 3x3 kernel (oh > h,
 * dy's conv unpadded). */
static void case_conv_s1(ac_backend *be, refcase *rc, result *res) {
  static const conv_cfg cfg = {3, 3, 5, 6, 2, 3, 1, 1, 5, 6, 1};
  conv_case(be, rc, res, &cfg);
}

static void case_conv_s1_pad2(ac_backend *be, refcase *rc, result *res) {
  static const conv_cfg cfg = {3, 2, 4, 5, 2, 3, 1, 2, 6, 7, 1};
  conv_case(be, rc, res, &cfg);
}

/* Stride 1 with more output than input channels: dy's columns do not fit the workspace,
 * so dx goes through W^T dy and col2im. */
static void case_conv_s1_wide(ac_backend *be, refcase *rc, result *res) {
  static const conv_cfg cfg = {3, 2, 5, 4, 4, 3, 1, 1, 5, 4, 0};
  conv_case(be, rc, res, &cfg);
}

/* 3x3, stride 1, padding 1 with output channels in blocks of 4: the CPU backend's direct
 * kernels (ac_conv3x3) for y, dW and (8 input channels) dx, where it has them; with 4 output
 * and 2 input channels ("wide" above) y and dW direct, dx by col2im. */
static void case_conv_direct(ac_backend *be, refcase *rc, result *res) {
  static const conv_cfg cfg = {3, 8, 7, 9, 4, 3, 1, 1, 7, 9, 1};
  conv_case(be, rc, res, &cfg);
}

static void case_conv_direct_tiny(ac_backend *be, refcase *rc, result *res) {
  static const conv_cfg cfg = {3, 4, 2, 1, 4, 3, 1, 1, 2, 1, 1};
  conv_case(be, rc, res, &cfg);
}

/* The downsampling convs on the CPU backend's direct stride-2 kernels (ac_conv_s2) for y,
 * dW and dx where it has them: 3x3 padding 1 and the 1x1 projection, even inputs, channels
 * in blocks of 4. */
static void case_conv_direct_s2(ac_backend *be, refcase *rc, result *res) {
  static const conv_cfg cfg = {3, 4, 6, 10, 8, 3, 2, 1, 3, 5, 0};
  conv_case(be, rc, res, &cfg);
}

static void case_conv_direct_s2_1x1(ac_backend *be, refcase *rc, result *res) {
  static const conv_cfg cfg = {3, 8, 6, 4, 4, 1, 2, 0, 3, 2, 0};
  conv_case(be, rc, res, &cfg);
}

static void test_conv_stride1(void **state) {
  run_case(state, "conv2d direct stride 2", case_conv_direct_s2);
  run_case(state, "conv2d direct stride 2 1x1", case_conv_direct_s2_1x1);
  run_case(state, "conv2d direct", case_conv_direct);
  run_case(state, "conv2d direct tiny", case_conv_direct_tiny);
  run_case(state, "conv2d stride 1", case_conv_s1);
  run_case(state, "conv2d stride 1 pad 2", case_conv_s1_pad2);
  run_case(state, "conv2d stride 1 wide", case_conv_s1_wide);
}

/* ------------------------------------------------------------------------------------ */
/* Batch normalisation: training mode (batch statistics, running averages) and eval mode  */

typedef struct {
  size_t n, c, hw;
  double eps, momentum;
  int eval;
  const double *rmean, *rvar; /* eval mode: the running statistics used */
  int fused;                  /* relu(bn(x) + res): ac_batchnorm_fuse_relu, _res calls */
} bn_cfg;

static void bn_stats(const bn_cfg *c, const double *x, size_t ch, double *mean, double *var) {
  double m = 0.0, v = 0.0, cnt = (double)(c->n * c->hw);
  for (size_t b = 0; b < c->n; b++)
    for (size_t i = 0; i < c->hw; i++) m += x[(b * c->c + ch) * c->hw + i];
  m /= cnt;
  for (size_t b = 0; b < c->n; b++)
    for (size_t i = 0; i < c->hw; i++) {
      double e = x[(b * c->c + ch) * c->hw + i] - m;
      v += e * e;
    }
  *mean = m;
  *var = v / cnt;
}

static void ref_batchnorm(const void *cfg, double *const *in, double *y) {
  const bn_cfg *c = cfg;
  for (size_t ch = 0; ch < c->c; ch++) {
    double mean, var;
    if (c->eval) {
      mean = c->rmean[ch];
      var = c->rvar[ch];
    } else {
      bn_stats(c, in[0], ch, &mean, &var);
    }
    for (size_t b = 0; b < c->n; b++)
      for (size_t i = 0; i < c->hw; i++) {
        size_t at = (b * c->c + ch) * c->hw + i;
        y[at] = (in[0][at] - mean) / sqrt(var + c->eps) * in[1][ch] + in[2][ch];
        if (c->fused) y[at] = y[at] + in[3][at] > 0.0 ? y[at] + in[3][at] : 0.0;
      }
  }
}

static void case_batchnorm(ac_backend *be, refcase *rc, result *res, bn_cfg *cfg) {
  double *x = add_input(rc, cfg->n * cfg->c * cfg->hw, -2, 2);
  double *g = add_input(rc, cfg->c, 0.5, 1.5);
  double *b = add_input(rc, cfg->c, -1, 1);
  double *r = cfg->fused ? add_input(rc, rc->len[0], -1, 1) : NULL;
  set_output(rc, rc->len[0]);
  rc->f = ref_batchnorm;
  rc->cfg = cfg;

  ac_batchnorm l;
  OK(ac_batchnorm_init(&l, be, "bn", cfg->c, cfg->hw, (float)cfg->eps, (float)cfg->momentum, 5));
  param_set(&l.weight, g);
  param_set(&l.bias, b);
  if (cfg->eval) {
    float *rm = to_f32(cfg->rmean, cfg->c), *rv = to_f32(cfg->rvar, cfg->c);
    OK(ac_tensor_upload(&l.running_mean, rm));
    OK(ac_tensor_upload(&l.running_var, rv));
    free(rm);
    free(rv);
  } else {
    /* Running averages after one step from (0, 1): momentum times the batch statistics
     * (variance unbiased). */
    double cnt = (double)(cfg->n * cfg->hw);
    rc->nextra = 2;
    for (int k = 0; k < 2; k++) {
      rc->extra_ref[k] = dalloc(cfg->c);
      rc->extra_len[k] = cfg->c;
    }
    for (size_t ch = 0; ch < cfg->c; ch++) {
      double mean, var;
      bn_stats(cfg, x, ch, &mean, &var);
      rc->extra_ref[0][ch] = cfg->momentum * mean;
      rc->extra_ref[1][ch] = (1.0 - cfg->momentum) + cfg->momentum * var * cnt / (cnt - 1.0);
    }
  }
  float *xd = dev_upload(be, x, rc->len[0]), *dr = dev_upload(be, rc->r, rc->ny);
  float *rd = r != NULL ? dev_upload(be, r, rc->len[0]) : NULL;
  const float *y, *dx, *dres;
  ac_mode mode = cfg->eval ? AC_MODE_EVAL : AC_MODE_TRAIN;
  if (cfg->fused) {
    OK(ac_batchnorm_fuse_relu(&l));
    OK(ac_batchnorm_forward_res(&l, xd, rd, cfg->n, mode, &y));
    take_y(be, res, y, rc->ny);
    OK(ac_batchnorm_backward_res(&l, dr, &dx, &dres));
    res->grad[3] = dev_download(be, dres, rc->len[0]);
  } else {
    OK(ac_batchnorm_forward(&l, xd, cfg->n, mode, &y));
    take_y(be, res, y, rc->ny);
    OK(ac_batchnorm_backward(&l, dr, &dx));
  }
  res->grad[0] = dev_download(be, dx, rc->len[0]);
  res->grad[1] = param_grad(&l.weight);
  res->grad[2] = param_grad(&l.bias);
  if (!cfg->eval) {
    res->extra[0] = dev_download(be, ac_tensor_f32(&l.running_mean), cfg->c);
    res->extra[1] = dev_download(be, ac_tensor_f32(&l.running_var), cfg->c);
  }
  ac_free(be, xd);
  ac_free(be, dr);
  if (rd != NULL) ac_free(be, rd);
  ac_batchnorm_destroy(&l);
}

/* One batch-norm case: training (batch statistics) or eval mode (the running statistics
 * below), plain or fused (relu(bn(x) + res), with the gradient reaching res). The cfg
 * must outlive the case: static, one case at a time. */
static void case_bn(ac_backend *be, refcase *rc, result *res, int eval, int fused, uint64_t seed) {
  static const double rmean[3] = {0.25, -0.5, 0.125}, rvar[3] = {0.5, 2.0, 1.25};
  static bn_cfg cfg;
  cfg = (bn_cfg){4, 3, 5, 1e-5, 0.1, eval, eval ? rmean : NULL, eval ? rvar : NULL, fused};
  rng_seed(seed);
  case_batchnorm(be, rc, res, &cfg);
}

static void case_bn_train(ac_backend *be, refcase *rc, result *res) {
  case_bn(be, rc, res, 0, 0, 11);
}

static void case_bn_eval(ac_backend *be, refcase *rc, result *res) {
  case_bn(be, rc, res, 1, 0, 12);
}

static void case_bn_fused_train(ac_backend *be, refcase *rc, result *res) {
  case_bn(be, rc, res, 0, 1, 13);
}

static void case_bn_fused_eval(ac_backend *be, refcase *rc, result *res) {
  case_bn(be, rc, res, 1, 1, 14);
}

static void test_batchnorm_fused(void **state) {
  run_case(state, "batchnorm+res+relu(train)", case_bn_fused_train);
  run_case(state, "batchnorm+res+relu(eval)", case_bn_fused_eval);
}

static void test_batchnorm_train(void **state) {
  run_case(state, "batchnorm(train)", case_bn_train);
}

/* ------------------------------------------------------------------------------------ */
/* Batch norm across data-parallel workers (sync BN: ac_bn_sync)                           */

enum { SBN_N = 4, SBN_C = 3, SBN_HW = 5, SBN_LEN = SBN_N * SBN_C * SBN_HW };

/* What one layer (fused ReLU and residual, training mode) gives on n images: outputs,
 * input and residual gradients, weight and bias gradients, running statistics. */
typedef struct {
  float y[SBN_LEN], dx[SBN_LEN], dres[SBN_LEN], dg[SBN_C], db[SBN_C], rmean[SBN_C], rvar[SBN_C];
} sbn_out;

/* One training step of a fresh layer on be over n images of x, r (residual), dy (output
 * gradient), with weight g and bias b and the reduction red (NULL: none); into *o. An AC_E*
 * code. No cmocka here: workers call it on threads of their own. */
static int sbn_layer(ac_backend *be, size_t n, const float *x, const float *r, const float *dy,
                     const float *g, const float *b, const ac_bn_sync *red, sbn_out *o) {
  ac_batchnorm l;
  float *d[3] = {NULL, NULL, NULL};
  const float *host[3] = {x, r, dy}, *y, *dx, *dres;
  size_t len = n * SBN_C * SBN_HW, bytes = len * sizeof(float);
  int rc = ac_batchnorm_init(&l, be, "bn", SBN_C, SBN_HW, 1e-5f, 0.1f, n);
  if (rc != AC_OK) return rc;
  if (red != NULL) l.sync = *red;
  for (int k = 0; k < 3 && rc == AC_OK; k++) {
    rc = ac_malloc(be, bytes, (void **)&d[k]);
    if (rc == AC_OK) rc = ac_memcpy_h2d(be, d[k], host[k], bytes);
  }
  if (rc == AC_OK) rc = ac_batchnorm_fuse_relu(&l);
  if (rc == AC_OK) rc = ac_tensor_upload(&l.weight.value, g);
  if (rc == AC_OK) rc = ac_tensor_upload(&l.bias.value, b);
  if (rc == AC_OK) rc = ac_batchnorm_forward_res(&l, d[0], d[1], n, AC_MODE_TRAIN, &y);
  if (rc == AC_OK) rc = ac_memcpy_d2h(be, o->y, y, bytes);
  if (rc == AC_OK) rc = ac_batchnorm_backward_res(&l, d[2], &dx, &dres);
  if (rc == AC_OK) rc = ac_memcpy_d2h(be, o->dx, dx, bytes);
  if (rc == AC_OK) rc = ac_memcpy_d2h(be, o->dres, dres, bytes);
  if (rc == AC_OK) rc = ac_tensor_download(&l.weight.grad, o->dg);
  if (rc == AC_OK) rc = ac_tensor_download(&l.bias.grad, o->db);
  if (rc == AC_OK) rc = ac_tensor_download(&l.running_mean, o->rmean);
  if (rc == AC_OK) rc = ac_tensor_download(&l.running_var, o->rvar);
  for (int k = 0; k < 3; k++) ac_free(be, d[k]);
  ac_batchnorm_destroy(&l);
  return rc;
}

/* Two workers on threads of their own, each with its own backend; their reduction is
 * MPI_Allreduce's mean done through host slots and a barrier. */
typedef struct {
  pthread_barrier_t *bar;
  float (*slot)[2 * SBN_C]; /* [2]: each worker's values of the current call */
  int rank, rc;
  ac_backend_kind kind;
  ac_backend *be;
  const float *x, *r, *dy, *g, *b; /* the worker's share, the weights */
  sbn_out out;
} sbn_worker;

static int sbn_mean(void *ctx, float *v, size_t n) {
  sbn_worker *w = ctx;
  float mean[2 * SBN_C];
  if (n > 2 * SBN_C) return AC_EINVAL; /* before the barrier: the test fails, never hangs */
  int rc = ac_memcpy_d2h(w->be, w->slot[w->rank], v, n * sizeof(float));
  pthread_barrier_wait(w->bar);
  for (size_t i = 0; i < n; i++) mean[i] = (w->slot[0][i] + w->slot[1][i]) / 2.0f;
  pthread_barrier_wait(w->bar);
  return rc == AC_OK ? ac_memcpy_h2d(w->be, v, mean, n * sizeof(float)) : rc;
}

static void *sbn_run(void *arg) {
  sbn_worker *w = arg;
  ac_backend_opts o;
  ac_backend_opts_default(&o);
  o.kind = w->kind;
  w->rc = ac_backend_create(&w->be, &o);
  ac_bn_sync red = {sbn_mean, w, 2};
  if (w->rc == AC_OK)
    w->rc = sbn_layer(w->be, SBN_N / 2, w->x, w->r, w->dy, w->g, w->b, &red, &w->out);
  ac_backend_destroy(w->be);
  return NULL;
}

static double sbn_rel(const float *a, const float *b, size_t n) {
  double md = 0, mb = 0;
  for (size_t i = 0; i < n; i++) {
    md = fmax(md, fabs((double)a[i] - b[i]));
    mb = fmax(mb, fabs((double)b[i]));
  }
  return md / fmax(mb, 1e-3);
}

/* Two workers, each on half the images with the reduction, give what one layer gives on
 * the whole batch: the outputs, input and residual gradients of their images and the
 * running statistics, and weight and bias gradients that add up to its. The halves have
 * different means (an offset), so statistics of a half alone would fail every check. */
static void test_batchnorm_sync(void **state) {
  ac_backend *be = backend(state);
  float x[SBN_LEN], r[SBN_LEN], dy[SBN_LEN], g[SBN_C], b[SBN_C];
  rng_seed(41);
  for (size_t i = 0; i < SBN_LEN; i++) {
    x[i] = (float)(2.0 * frand() + (i < SBN_LEN / 2 ? 1.5 : -0.5));
    r[i] = (float)frand();
    dy[i] = (float)frand();
  }
  for (size_t i = 0; i < SBN_C; i++) {
    g[i] = (float)(1.0 + 0.5 * frand());
    b[i] = (float)(0.5 * frand());
  }
  sbn_out *ref = xcalloc(1, sizeof *ref);
  OK(sbn_layer(be, SBN_N, x, r, dy, g, b, NULL, ref));

  pthread_barrier_t bar;
  float slot[2][2 * SBN_C];
  sbn_worker *w = xcalloc(2, sizeof *w);
  pthread_t th[2];
  assert_int_equal(pthread_barrier_init(&bar, NULL, 2), 0);
  size_t half = SBN_LEN / 2;
  for (int k = 0; k < 2; k++) {
    w[k].bar = &bar;
    w[k].slot = slot;
    w[k].rank = k;
    w[k].kind = ac_backend_kind_of(be);
    w[k].x = x + k * half;
    w[k].r = r + k * half;
    w[k].dy = dy + k * half;
    w[k].g = g;
    w[k].b = b;
    assert_int_equal(pthread_create(&th[k], NULL, sbn_run, &w[k]), 0);
  }
  for (int k = 0; k < 2; k++) assert_int_equal(pthread_join(th[k], NULL), 0);
  pthread_barrier_destroy(&bar);
  float dg[SBN_C], db[SBN_C];
  for (int k = 0; k < 2; k++) {
    OK(w[k].rc);
    assert_true(sbn_rel(w[k].out.y, ref->y + k * half, half) <= 1e-5);
    assert_true(sbn_rel(w[k].out.dx, ref->dx + k * half, half) <= 1e-5);
    assert_true(sbn_rel(w[k].out.dres, ref->dres + k * half, half) <= 1e-5);
    assert_true(sbn_rel(w[k].out.rmean, ref->rmean, SBN_C) <= 1e-5);
    assert_true(sbn_rel(w[k].out.rvar, ref->rvar, SBN_C) <= 1e-5);
  }
  for (size_t i = 0; i < SBN_C; i++) {
    dg[i] = w[0].out.dg[i] + w[1].out.dg[i];
    db[i] = w[0].out.db[i] + w[1].out.db[i];
  }
  assert_true(sbn_rel(dg, ref->dg, SBN_C) <= 1e-5);
  assert_true(sbn_rel(db, ref->db, SBN_C) <= 1e-5);
  free(w);
  free(ref);
}

static void test_batchnorm_eval(void **state) {
  run_case(state, "batchnorm(eval)", case_bn_eval);
}

/* ------------------------------------------------------------------------------------ */
/* Pooling: max (window 3, stride 2, pad 1) and average (window 2, stride 2); global avg   */

typedef struct {
  size_t n, c, h, w, k, stride, pad, oh, ow;
  int max;
} pool_cfg;

static void ref_pool(const void *cfg, double *const *in, double *y) {
  const pool_cfg *c = cfg;
  for (size_t p = 0; p < c->n * c->c; p++)
    for (size_t oy = 0; oy < c->oh; oy++)
      for (size_t ox = 0; ox < c->ow; ox++) {
        double acc = c->max ? -INFINITY : 0.0;
        for (size_t i = 0; i < c->k; i++)
          for (size_t j = 0; j < c->k; j++) {
            long iy = (long)(oy * c->stride + i) - (long)c->pad;
            long ix = (long)(ox * c->stride + j) - (long)c->pad;
            if (iy < 0 || ix < 0 || iy >= (long)c->h || ix >= (long)c->w) continue;
            double v = in[0][(p * c->h + (size_t)iy) * c->w + (size_t)ix];
            acc = c->max ? (v > acc ? v : acc) : acc + v;
          }
        y[(p * c->oh + oy) * c->ow + ox] = c->max ? acc : acc / (double)(c->k * c->k);
      }
}

static void case_pool(ac_backend *be, refcase *rc, result *res, const pool_cfg *cfg) {
  double *x = add_input(rc, cfg->n * cfg->c * cfg->h * cfg->w, -1, 1);
  set_output(rc, cfg->n * cfg->c * cfg->oh * cfg->ow);
  rc->f = ref_pool;
  rc->cfg = cfg;

  ac_pool l;
  OK(ac_pool_init(&l, be, cfg->max ? AC_POOL_MAX : AC_POOL_AVG, cfg->c, cfg->h, cfg->w, cfg->k,
                  cfg->stride, cfg->pad, 3));
  assert_int_equal(l.oh, cfg->oh);
  assert_int_equal(l.ow, cfg->ow);
  float *xd = dev_upload(be, x, rc->len[0]), *dr = dev_upload(be, rc->r, rc->ny);
  const float *y, *dx;
  OK(ac_pool_forward(&l, xd, cfg->n, &y));
  take_y(be, res, y, rc->ny);
  OK(ac_pool_backward(&l, dr, &dx));
  res->grad[0] = dev_download(be, dx, rc->len[0]);
  ac_free(be, xd);
  ac_free(be, dr);
  ac_pool_destroy(&l);
}

static void case_maxpool(ac_backend *be, refcase *rc, result *res) {
  static const pool_cfg cfg = {2, 2, 6, 5, 3, 2, 1, 3, 3, 1};
  rng_seed(13);
  case_pool(be, rc, res, &cfg);
}

static void case_avgpool(ac_backend *be, refcase *rc, result *res) {
  static const pool_cfg cfg = {2, 3, 6, 4, 2, 2, 0, 3, 2, 0};
  rng_seed(14);
  case_pool(be, rc, res, &cfg);
}

static void test_maxpool(void **state) {
  run_case(state, "maxpool", case_maxpool);
}

static void test_avgpool(void **state) {
  run_case(state, "avgpool", case_avgpool);
}

typedef struct {
  size_t n, c, hw;
} gap_cfg;

static void ref_gap(const void *cfg, double *const *in, double *y) {
  const gap_cfg *c = cfg;
  for (size_t p = 0; p < c->n * c->c; p++) {
    double s = 0.0;
    for (size_t i = 0; i < c->hw; i++) s += in[0][p * c->hw + i];
    y[p] = s / (double)c->hw;
  }
}

static void case_gap(ac_backend *be, refcase *rc, result *res) {
  static const gap_cfg cfg = {3, 4, 6};
  rng_seed(15);
  double *x = add_input(rc, cfg.n * cfg.c * cfg.hw, -1, 1);
  set_output(rc, cfg.n * cfg.c);
  rc->f = ref_gap;
  rc->cfg = &cfg;
  ac_gap l;
  OK(ac_gap_init(&l, be, cfg.c, cfg.hw, 4));
  float *xd = dev_upload(be, x, rc->len[0]), *dr = dev_upload(be, rc->r, rc->ny);
  const float *y, *dx;
  OK(ac_gap_forward(&l, xd, cfg.n, &y));
  take_y(be, res, y, rc->ny);
  OK(ac_gap_backward(&l, dr, &dx));
  res->grad[0] = dev_download(be, dx, rc->len[0]);
  ac_free(be, xd);
  ac_free(be, dr);
  ac_gap_destroy(&l);
}

static void test_gap(void **state) {
  run_case(state, "global avg pool", case_gap);
}

/* ------------------------------------------------------------------------------------ */
/* Bad input, names, parameter lists                                                       */

/* A conv asked for its output's moments (ac_conv2d_want_moments) hands them out where the
 * backend's direct kernels ran (3x3 stride 1 and 2, 1x1 stride 2), and batch norm fed with
 * them (ac_batchnorm_forward_moments, with a residual and ReLU) gives the bits of batch norm
 * computing its own: output and running statistics. Eval mode ignores them. And
 * ac_conv2d_backward_add (fused on the direct stride-1 kernel, a pass after otherwise). */
static void test_conv_bn_moments(void **state) {
  ac_backend *be = backend(state);
  const size_t cfgs[][4] = {{3, 1, 1, 0}, {3, 2, 1, 1}, {1, 2, 0, 1}}; /* k, stride, pad, s2 */
  for (size_t ci = 0; ci < sizeof cfgs / sizeof cfgs[0]; ci++) {
    size_t k = cfgs[ci][0], st = cfgs[ci][1], pad = cfgs[ci][2], n = 3, c = 8, h = 6;
    ac_conv2d cv;
    ac_batchnorm bn[2];
    OK(ac_conv2d_init(&cv, be, "c", c, c, h, h, k, st, pad, 0, n, 0, NULL, 7));
    OK(ac_conv2d_want_moments(&cv));
    size_t ohw = cv.oh * cv.ow, ny = n * c * ohw;
    for (int i = 0; i < 2; i++) {
      OK(ac_batchnorm_init(&bn[i], be, "bn", c, ohw, 1e-5f, 0.1f, n));
      OK(ac_batchnorm_fuse_relu(&bn[i]));
    }
    double *hx = dalloc(n * c * h * h), *hr = dalloc(ny);
    for (size_t i = 0; i < n * c * h * h; i++) hx[i] = 2.0 * frand() - 0.5;
    for (size_t i = 0; i < ny; i++) hr[i] = frand() - 0.5;
    float *x = dev_upload(be, hx, n * c * h * h), *r = dev_upload(be, hr, ny);
    const float *cy, *y[2];
    for (int mode = 0; mode < 2; mode++) {
      ac_mode m = mode == 0 ? AC_MODE_TRAIN : AC_MODE_EVAL;
      OK(ac_conv2d_forward(&cv, x, n, &cy));
      const float *mom = ac_conv2d_moments(&cv);
      int direct =
          st == 1 ? ac_conv3x3_supported(be, c, c) : ac_conv_s2_supported(be, c, c, h, h, k);
      assert_int_equal(mom != NULL, direct);
      OK(ac_batchnorm_forward_moments(&bn[0], cy, r, mom, n, m, &y[0]));
      OK(ac_batchnorm_forward_res(&bn[1], cy, r, n, m, &y[1]));
      float *a = dev_download(be, y[0], ny), *b = dev_download(be, y[1], ny);
      assert_memory_equal(a, b, ny * sizeof(float));
      free(a);
      free(b);
      const ac_tensor *rs[2][2] = {{&bn[0].running_mean, &bn[0].running_var},
                                   {&bn[1].running_mean, &bn[1].running_var}};
      for (int j = 0; j < 2; j++) {
        a = dev_download(be, ac_tensor_f32(rs[0][j]), c);
        b = dev_download(be, ac_tensor_f32(rs[1][j]), c);
        assert_memory_equal(a, b, c * sizeof(float));
        free(a);
        free(b);
      }
    }
    /* ac_conv2d_backward_add: the input gradient plus an addend, to the bit, into out */
    size_t nx = n * c * h * h;
    double *ha = dalloc(nx);
    for (size_t i = 0; i < nx; i++) ha[i] = frand() - 0.5;
    float *addend = dev_upload(be, ha, nx), *out = NULL;
    OK(ac_malloc(be, nx * sizeof(float), (void **)&out));
    const float *dx;
    OK(ac_conv2d_backward(&cv, r, &dx));
    float *plain = dev_download(be, dx, nx), *ad = dev_download(be, addend, nx);
    OK(ac_conv2d_backward_add(&cv, r, addend, out));
    float *got = dev_download(be, out, nx);
    for (size_t i = 0; i < nx; i++) {
      float want = plain[i] + ad[i];
      assert_memory_equal(&got[i], &want, sizeof want);
    }
    assert_int_equal(ac_conv2d_backward_add(&cv, r, NULL, out), AC_EINVAL);
    free(plain);
    free(ad);
    free(got);
    free(ha);
    ac_free(be, addend);
    ac_free(be, out);
    ac_free(be, x);
    ac_free(be, r);
    free(hx);
    free(hr);
    ac_batchnorm_destroy(&bn[0]);
    ac_batchnorm_destroy(&bn[1]);
    ac_conv2d_destroy(&cv);
  }
}

/* Bits of n floats at device a and b equal. */
static void expect_same_dev(ac_backend *be, const float *a, const float *b, size_t n) {
  float *ha = dev_download(be, a, n), *hb = dev_download(be, b, n);
  assert_memory_equal(ha, hb, n * sizeof(float));
  free(ha);
  free(hb);
}

/* ac_conv2d_backward_bn: a conv whose input was a batch norm's output (with its fused ReLU
 * and a residual, as a ResNet block's bn2) hands its input gradient to that batch norm with
 * the backward sums made (the direct stride-1 kernel: ac_conv3x3_bn_grad) or, elsewhere,
 * plainly. Either way batch norm's backward then gives the bits of the unfused pair
 * (ac_conv2d_backward or _add, then ac_batchnorm_backward_res): dx, the residual's
 * gradient, dgamma and dbeta; in train and eval mode, with and without an addend. The sums
 * are used only for the gradient they were made for: a copy of it at another address gets
 * batch norm's own pass (and the same bits). */
static void test_conv_bn_grad(void **state) {
  ac_backend *be = backend(state);
  const size_t cfgs[][3] = {{3, 1, 1}, {3, 2, 1}, {1, 2, 0}}; /* k, stride, pad */
  for (size_t ci = 0; ci < sizeof cfgs / sizeof cfgs[0]; ci++) {
    size_t k = cfgs[ci][0], st = cfgs[ci][1], pad = cfgs[ci][2], n = 3, c = 8, h = ci == 0 ? 7 : 8;
    size_t nx = n * c * h * h;
    ac_conv2d cv;
    ac_batchnorm bn[2];
    OK(ac_conv2d_init(&cv, be, "c", c, c, h, h, k, st, pad, 0, n, 0, NULL, 7));
    size_t ny = n * c * cv.oh * cv.ow;
    for (int i = 0; i < 2; i++) {
      OK(ac_batchnorm_init(&bn[i], be, "bn", c, h * h, 1e-5f, 0.1f, n));
      OK(ac_batchnorm_fuse_relu(&bn[i]));
    }
    double *hz = dalloc(nx), *hr = dalloc(nx), *ha = dalloc(nx), *hdy = dalloc(ny);
    for (size_t i = 0; i < nx; i++) {
      hz[i] = 2.0 * frand() - 0.3;
      hr[i] = frand() - 0.5;
      ha[i] = frand() - 0.5;
    }
    for (size_t i = 0; i < ny; i++) hdy[i] = frand() - 0.5;
    float *z = dev_upload(be, hz, nx), *r = dev_upload(be, hr, nx), *add = dev_upload(be, ha, nx);
    float *dy = dev_upload(be, hdy, ny), *out[2] = {NULL, NULL}, *cp = NULL;
    OK(ac_malloc(be, nx * sizeof(float), (void **)&out[0]));
    OK(ac_malloc(be, nx * sizeof(float), (void **)&out[1]));
    OK(ac_malloc(be, nx * sizeof(float), (void **)&cp));
    for (int mode = 0; mode < 2; mode++)
      for (int with_add = 0; with_add < 2; with_add++) {
        ac_mode m = mode == 0 ? AC_MODE_TRAIN : AC_MODE_EVAL;
        const float *y[2], *cy, *g[2], *dx[2], *dres[2];
        for (int i = 0; i < 2; i++) {
          OK(ac_batchnorm_forward_res(&bn[i], z, r, n, m, &y[i]));
          for (int p = 0; p < 2; p++) {
            ac_param *pp = p == 0 ? &bn[i].weight : &bn[i].bias;
            OK(ac_fill_f32(be, c, ac_tensor_f32(&pp->grad), 0.0f));
          }
        }
        OK(ac_conv2d_forward(&cv, y[0], n, &cy));
        const float *addend = with_add ? add : NULL;
        if (with_add) { /* unfused first: without an addend both write the layer's dx */
          OK(ac_conv2d_backward_add(&cv, dy, addend, out[1]));
        } else {
          OK(ac_conv2d_backward(&cv, dy, &g[1]));
          OK(ac_memcpy_d2d(be, out[1], g[1], nx * sizeof(float)));
        }
        g[1] = out[1];
        OK(ac_conv2d_backward_bn(&cv, dy, addend, out[0], &bn[0], &g[0]));
        int fused = bn[0].gsums_for == g[0];
        assert_int_equal(fused, st == 1 ? ac_conv3x3_supported(be, c, c)
                                        : ac_conv_s2_supported(be, c, c, h, h, k));
        for (int i = 0; i < 2; i++) OK(ac_batchnorm_backward_res(&bn[i], g[i], &dx[i], &dres[i]));
        assert_null(bn[0].gsums_for); /* used once */
        expect_same_dev(be, dx[0], dx[1], nx);
        expect_same_dev(be, dres[0], dres[1], nx);
        for (int p = 0; p < 2; p++) {
          const ac_param *p0 = p == 0 ? &bn[0].weight : &bn[0].bias;
          const ac_param *p1 = p == 0 ? &bn[1].weight : &bn[1].bias;
          expect_same_dev(be, ac_tensor_f32(&p0->grad), ac_tensor_f32(&p1->grad), c);
        }
        /* the sums belong to the gradient they were made for, not to a copy of it */
        OK(ac_conv2d_backward_bn(&cv, dy, addend, out[0], &bn[0], &g[0]));
        OK(ac_memcpy_d2d(be, cp, g[1], nx * sizeof(float)));
        OK(ac_batchnorm_backward_res(&bn[0], cp, &dx[0], &dres[0]));
        expect_same_dev(be, dx[0], dx[1], nx);
        assert_null(bn[0].gsums_for);
      }
    assert_int_equal(ac_conv2d_backward_bn(&cv, dy, add, NULL, &bn[0], NULL), AC_EINVAL);
    assert_int_equal(ac_conv2d_backward_bn(&cv, dy, add, NULL, &bn[0], &(const float *){NULL}),
                     AC_EINVAL);
    free(hz);
    free(hr);
    free(ha);
    free(hdy);
    ac_free(be, z);
    ac_free(be, r);
    ac_free(be, add);
    ac_free(be, dy);
    ac_free(be, out[0]);
    ac_free(be, out[1]);
    ac_free(be, cp);
    ac_batchnorm_destroy(&bn[0]);
    ac_batchnorm_destroy(&bn[1]);
    ac_conv2d_destroy(&cv);
  }
}

static void test_invalid(void **state) {
  ac_backend *be = backend(state);
  ac_linear lin;
  ac_attention at;
  ac_conv2d cv;
  ac_dropout dr;
  ac_layernorm ln;
  const float *y;
  char longname[300];
  memset(longname, 'a', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';

  assert_int_equal(ac_linear_init(&lin, be, "fc", 0, 3, 1, 4, 1), AC_EINVAL);
  ac_linear_destroy(&lin); /* safe after a failed init */
  assert_int_equal(ac_linear_init(&lin, be, longname, 2, 3, 1, 4, 1), AC_EINVAL);
  assert_int_equal(ac_linear_init(&lin, be, NULL, 2, 3, 1, 4, 1), AC_EINVAL);
  OK(ac_linear_init(&lin, be, "fc", 2, 3, 1, 4, 1));
  assert_int_equal(ac_linear_backward(&lin, lin.y, &y), AC_EINVAL);    /* before forward */
  assert_int_equal(ac_linear_forward(&lin, lin.dx, 5, &y), AC_EINVAL); /* rows > max */
  assert_int_equal(ac_linear_forward(&lin, NULL, 1, &y), AC_EINVAL);
  ac_linear_destroy(&lin);
  ac_linear_destroy(&lin); /* twice is safe */
  assert_int_equal(ac_attention_init(&at, be, "attn", 10, 3, 4, 1, 1), AC_EINVAL);
  assert_int_equal(ac_conv2d_init(&cv, be, "c", 1, 1, 4, 4, 3, 1, 3, 0, 1, 0, NULL, 1),
                   AC_EINVAL); /* pad >= kernel */
  assert_int_equal(ac_conv2d_init(&cv, be, "c", 1, 1, 2, 2, 5, 1, 1, 0, 1, 0, NULL, 1),
                   AC_EINVAL); /* kernel larger than the padded input */
  assert_int_equal(ac_dropout_init(&dr, be, 1.0f, 1, 4), AC_EINVAL);
  assert_int_equal(ac_dropout_init(&dr, be, NAN, 1, 4), AC_EINVAL);
  assert_int_equal(ac_layernorm_init(&ln, be, "ln", 4, 0.0f, 4), AC_EINVAL);
  ac_layernorm_destroy(&ln);
}

static void test_param_names(void **state) {
  ac_backend *be = backend(state);
  ac_attention at;
  ac_param_list list;
  ac_param_list_init(&list);
  OK(ac_attention_init(&at, be, "layer0.attn", 8, 2, 4, 2, 1));
  OK(ac_attention_params(&at, &list));
  assert_int_equal(list.n, 4);
  assert_string_equal(list.items[0]->name, "layer0.attn.qkv.weight");
  assert_string_equal(list.items[1]->name, "layer0.attn.qkv.bias");
  assert_string_equal(list.items[2]->name, "layer0.attn.proj.weight");
  assert_string_equal(list.items[3]->name, "layer0.attn.proj.bias");
  assert_int_equal(ac_param_list_numel(&list), 3 * 64 + 24 + 64 + 8);
  assert_ptr_equal(ac_param_list_find(&list, "layer0.attn.proj.weight"), &at.proj.weight);
  assert_null(ac_param_list_find(&list, "nope"));
  /* zero_grad clears accumulated gradients */
  OK(ac_fill_f32(be, 8, ac_tensor_f32(&at.proj.bias.grad), 3.0f));
  OK(ac_param_list_zero_grad(&list));
  float g[8];
  OK(ac_tensor_download(&at.proj.bias.grad, g));
  for (int i = 0; i < 8; i++) assert_true(g[i] == 0.0f);
  ac_param_list_destroy(&list);
  ac_attention_destroy(&at);
}

/* ------------------------------------------------------------------------------------ */
/* Groups                                                                                  */

#define LAYER_TESTS                                                                               \
  cmocka_unit_test(test_linear), cmocka_unit_test(test_embedding),                                \
      cmocka_unit_test(test_posembed), cmocka_unit_test(test_layernorm),                          \
      cmocka_unit_test(test_relu), cmocka_unit_test(test_gelu), cmocka_unit_test(test_residual),  \
      cmocka_unit_test(test_dropout), cmocka_unit_test(test_attention),                           \
      cmocka_unit_test(test_attention_causal), cmocka_unit_test(test_celoss),                     \
      cmocka_unit_test(test_conv), cmocka_unit_test(test_conv_stride1),                           \
      cmocka_unit_test(test_batchnorm_train), cmocka_unit_test(test_batchnorm_eval),              \
      cmocka_unit_test(test_batchnorm_fused), cmocka_unit_test(test_batchnorm_sync),              \
      cmocka_unit_test(test_maxpool), cmocka_unit_test(test_avgpool), cmocka_unit_test(test_gap), \
      cmocka_unit_test(test_conv_bn_moments), cmocka_unit_test(test_conv_bn_grad),                \
      cmocka_unit_test(test_invalid), cmocka_unit_test(test_param_names)

int main(void) {
  const struct CMUnitTest cpu[] = {LAYER_TESTS};
  const struct CMUnitTest cuda[] = {LAYER_TESTS};
  int failed = cmocka_run_group_tests_name("layers-cpu", cpu, setup_cpu, teardown);
  failed += cmocka_run_group_tests_name("layers-cuda", cuda, setup_cuda, teardown);
  return failed;
}
