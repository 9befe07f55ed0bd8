/*
 * test_optim.c -- SGD (momentum, Nesterov, weight decay), AdamW and global-norm clipping
 * against direct fp64 host references over several steps, and a tiny model (two linear
 * layers and a ReLU, written here with the primitives) trained for 200 steps with SGD,
 * AdamW and Shampoo (roots computed locally, no daemon): the loss must fall, and a second
 * run from the same seed must give bit-identical losses. Every test runs on the CPU backend
 * and, where a CUDA device exists, on CUDA against the same references; without a device
 * the CUDA group is skipped with a message.
 */
#include <math.h>
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

/* ------------------------------------------------------------------------------------ */
/* Helpers                                                                                 */

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;

static float frand(void) {
  return xorshift_frand(&rng_state);
}

static void fill_rand(size_t n, float *x, float scale) {
  for (size_t i = 0; i < n; i++) x[i] = scale * frand();
}

static void param_init(ac_param *p, ac_backend *be, const char *name, int ndim,
                       const size_t *shape) {
  assert_int_equal(ac_param_init(p, be, name, ndim, shape), AC_OK);
}

/* max |got - want| <= tol * (1 + max |want|) over n values. */
static void assert_close_vec(size_t n, const float *got, const double *want, double tol) {
  double scale = 1.0, err = 0.0;
  size_t at = 0;
  for (size_t i = 0; i < n; i++)
    if (fabs(want[i]) > scale) scale = fabs(want[i]);
  for (size_t i = 0; i < n; i++)
    if (fabs(got[i] - want[i]) > err) {
      err = fabs(got[i] - want[i]);
      at = i;
    }
  if (!(err <= tol * scale))
    fail_msg("element %zu: got %.9g, want %.9g (max error %.3g > %.3g)", at, got[at], want[at], err,
             tol * scale);
}

/* ------------------------------------------------------------------------------------ */
/* SGD and AdamW against host references                                                   */

enum { NP = 2 };
static const size_t shapes[NP][2] = {{7, 5}, {13, 1}};

typedef struct {
  ac_param params[NP];
  ac_param *ptrs[NP];
  size_t n[NP];
  float *p[NP], *g[NP]; /* host */
  double *ref[NP];      /* reference parameter values */
} problem;

static void problem_init(problem *pb, ac_backend *be) {
  memset(pb, 0, sizeof *pb);
  for (int i = 0; i < NP; i++) {
    param_init(&pb->params[i], be, i == 0 ? "w" : "b", i == 0 ? 2 : 1, shapes[i]);
    pb->ptrs[i] = &pb->params[i];
    pb->n[i] = pb->params[i].value.numel;
    pb->p[i] = xcalloc(pb->n[i], sizeof(float));
    pb->g[i] = xcalloc(pb->n[i], sizeof(float));
    pb->ref[i] = xcalloc(pb->n[i], sizeof(double));
    fill_rand(pb->n[i], pb->p[i], 1.0f);
    for (size_t k = 0; k < pb->n[i]; k++) pb->ref[i][k] = pb->p[i][k];
    assert_int_equal(ac_tensor_upload(&pb->params[i].value, pb->p[i]), AC_OK);
  }
}

/* New random gradients, on the host and on the device. */
static void problem_grads(problem *pb) {
  for (int i = 0; i < NP; i++) {
    fill_rand(pb->n[i], pb->g[i], 0.5f);
    assert_int_equal(ac_tensor_upload(&pb->params[i].grad, pb->g[i]), AC_OK);
  }
}

static void problem_check(problem *pb, double tol) {
  for (int i = 0; i < NP; i++) {
    assert_int_equal(ac_tensor_download(&pb->params[i].value, pb->p[i]), AC_OK);
    assert_close_vec(pb->n[i], pb->p[i], pb->ref[i], tol);
  }
}

static void problem_destroy(problem *pb) {
  for (int i = 0; i < NP; i++) {
    ac_param_destroy(&pb->params[i]);
    free(pb->p[i]);
    free(pb->g[i]);
    free(pb->ref[i]);
  }
}

static void run_sgd(ac_backend *be, float mu, int nesterov, float wd) {
  problem pb;
  ac_sgd *opt = NULL;
  ac_sgd_opts o = {.momentum = mu, .nesterov = nesterov, .weight_decay = wd};
  double *buf[NP];

  problem_init(&pb, be);
  assert_int_equal(ac_sgd_create(&opt, pb.ptrs, NP, &o), AC_OK);
  for (int i = 0; i < NP; i++) buf[i] = xcalloc(pb.n[i], sizeof(double));
  for (int t = 1; t <= 5; t++) {
    const float lr = 0.1f / (float)t;
    problem_grads(&pb);
    assert_int_equal(ac_sgd_step(opt, lr), AC_OK);
    for (int i = 0; i < NP; i++)
      for (size_t k = 0; k < pb.n[i]; k++) {
        double d = pb.g[i][k] + (double)wd * pb.ref[i][k];
        if (mu > 0.0f) {
          buf[i][k] = mu * buf[i][k] + d;
          d = nesterov ? d + mu * buf[i][k] : buf[i][k];
        }
        pb.ref[i][k] -= lr * d;
      }
    problem_check(&pb, 1e-5);
  }
  assert_int_equal(ac_sgd_steps(opt), 5);
  for (int i = 0; i < NP; i++) free(buf[i]);
  ac_sgd_destroy(opt);
  problem_destroy(&pb);
}

static void test_sgd(void **state) {
  ac_backend *be = backend(state);
  run_sgd(be, 0.0f, 0, 0.0f);
  run_sgd(be, 0.0f, 0, 0.01f);
  run_sgd(be, 0.9f, 0, 0.0f);
  run_sgd(be, 0.9f, 1, 0.0f);
  run_sgd(be, 0.8f, 1, 0.05f);
}

static void test_adamw(void **state) {
  ac_backend *be = backend(state);
  problem pb;
  ac_adamw *opt = NULL;
  ac_adamw_opts o = {.beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f};
  double *m[NP], *v[NP];

  problem_init(&pb, be);
  assert_int_equal(ac_adamw_create(&opt, pb.ptrs, NP, &o), AC_OK);
  for (int i = 0; i < NP; i++) {
    m[i] = xcalloc(pb.n[i], sizeof(double));
    v[i] = xcalloc(pb.n[i], sizeof(double));
  }
  for (int t = 1; t <= 6; t++) {
    const float lr = 0.01f;
    problem_grads(&pb);
    assert_int_equal(ac_adamw_step(opt, lr), AC_OK);
    const double c1 = 1.0 - pow(0.8f, t), c2 = 1.0 - pow(0.95f, t);
    for (int i = 0; i < NP; i++)
      for (size_t k = 0; k < pb.n[i]; k++) {
        const double g = pb.g[i][k];
        m[i][k] = 0.8f * m[i][k] + (1.0 - 0.8f) * g;
        v[i][k] = 0.95f * v[i][k] + (1.0 - 0.95f) * g * g;
        pb.ref[i][k] -= lr * (m[i][k] / c1 / (sqrt(v[i][k] / c2) + 1e-6f) + 0.1f * pb.ref[i][k]);
      }
    problem_check(&pb, 1e-5);
  }
  assert_int_equal(ac_adamw_steps(opt), 6);
  for (int i = 0; i < NP; i++) {
    free(m[i]);
    free(v[i]);
  }
  ac_adamw_destroy(opt);
  problem_destroy(&pb);
}

static void test_clip(void **state) {
  ac_backend *be = backend(state);
  problem pb;
  double norm = 0.0, sq = 0.0;

  problem_init(&pb, be);
  problem_grads(&pb);
  for (int i = 0; i < NP; i++)
    for (size_t k = 0; k < pb.n[i]; k++) sq += (double)pb.g[i][k] * pb.g[i][k];
  const double want = sqrt(sq);

  /* Above the norm: measured, untouched. */
  assert_int_equal(ac_clip_grad_norm(pb.ptrs, NP, want * 2.0, &norm), AC_OK);
  assert_true(fabs(norm - want) <= 1e-9 * want);
  assert_int_equal(ac_clip_grad_norm(pb.ptrs, NP, INFINITY, NULL), AC_OK);
  for (int i = 0; i < NP; i++) {
    float *got = xcalloc(pb.n[i], sizeof(float));
    assert_int_equal(ac_tensor_download(&pb.params[i].grad, got), AC_OK);
    assert_memory_equal(got, pb.g[i], pb.n[i] * sizeof(float));
    free(got);
  }

  /* Below: scaled to max_norm exactly (to rounding). */
  assert_int_equal(ac_clip_grad_norm(pb.ptrs, NP, 0.25 * want, &norm), AC_OK);
  assert_true(fabs(norm - want) <= 1e-9 * want);
  for (int i = 0; i < NP; i++) {
    float *got = xcalloc(pb.n[i], sizeof(float));
    double *exp = xcalloc(pb.n[i], sizeof(double));
    for (size_t k = 0; k < pb.n[i]; k++) exp[k] = pb.g[i][k] * 0.25;
    assert_int_equal(ac_tensor_download(&pb.params[i].grad, got), AC_OK);
    assert_close_vec(pb.n[i], got, exp, 1e-6);
    free(got);
    free(exp);
  }
  assert_int_equal(ac_clip_grad_norm(pb.ptrs, NP, INFINITY, &norm), AC_OK);
  assert_true(fabs(norm - 0.25 * want) <= 1e-6 * want);

  /* A NaN gradient: reported, grads left alone. */
  pb.g[1][3] = NAN;
  assert_int_equal(ac_tensor_upload(&pb.params[1].grad, pb.g[1]), AC_OK);
  assert_int_equal(ac_clip_grad_norm(pb.ptrs, NP, 1e-3, &norm), AC_OK);
  assert_true(isnan(norm));
  {
    float *got = xcalloc(pb.n[1], sizeof(float));
    assert_int_equal(ac_tensor_download(&pb.params[1].grad, got), AC_OK);
    assert_true(isnan(got[3]));
    assert_true(got[0] == pb.g[1][0]);
    free(got);
  }

  /* Bad arguments. */
  assert_int_equal(ac_clip_grad_norm(NULL, 1, 1.0, &norm), AC_EINVAL);
  assert_int_equal(ac_clip_grad_norm(pb.ptrs, 0, 1.0, &norm), AC_EINVAL);
  assert_int_equal(ac_clip_grad_norm(pb.ptrs, NP, 0.0, &norm), AC_EINVAL);
  assert_int_equal(ac_clip_grad_norm(pb.ptrs, NP, -1.0, &norm), AC_EINVAL);
  assert_int_equal(ac_clip_grad_norm(pb.ptrs, NP, NAN, &norm), AC_EINVAL);
  problem_destroy(&pb);
}

static void test_bad_args(void **state) {
  ac_backend *be = backend(state);
  problem pb;
  ac_sgd *sgd = (ac_sgd *)&pb; /* must be reset to NULL on failure */
  ac_adamw *adam = NULL;
  ac_sgd_opts so;
  ac_adamw_opts ao;
  ac_param *with_null[2];

  problem_init(&pb, be);
  ac_sgd_opts_default(&so);
  ac_adamw_opts_default(&ao);
  assert_int_equal(ac_sgd_create(NULL, pb.ptrs, NP, &so), AC_EINVAL);
  assert_int_equal(ac_sgd_create(&sgd, pb.ptrs, 0, &so), AC_EINVAL);
  assert_null(sgd);
  with_null[0] = pb.ptrs[0];
  with_null[1] = NULL;
  assert_int_equal(ac_sgd_create(&sgd, with_null, 2, &so), AC_EINVAL);
  so.momentum = 1.0f;
  assert_int_equal(ac_sgd_create(&sgd, pb.ptrs, NP, &so), AC_EINVAL);
  so.momentum = 0.0f;
  so.nesterov = 1; /* Nesterov needs momentum */
  assert_int_equal(ac_sgd_create(&sgd, pb.ptrs, NP, &so), AC_EINVAL);
  so.nesterov = 0;
  so.weight_decay = -1.0f;
  assert_int_equal(ac_sgd_create(&sgd, pb.ptrs, NP, &so), AC_EINVAL);
  ao.beta2 = 1.0f;
  assert_int_equal(ac_adamw_create(&adam, pb.ptrs, NP, &ao), AC_EINVAL);
  ao.beta2 = 0.999f;
  ao.eps = 0.0f;
  assert_int_equal(ac_adamw_create(&adam, pb.ptrs, NP, &ao), AC_EINVAL);
  assert_null(adam);

  /* A parameter listed twice would be stepped twice. */
  ac_param *twice[3] = {pb.ptrs[0], pb.ptrs[1], pb.ptrs[0]};
  assert_int_equal(ac_sgd_create(&sgd, twice, 3, NULL), AC_EINVAL);
  assert_int_equal(ac_adamw_create(&adam, twice, 3, NULL), AC_EINVAL);
  ac_shampoo *sh = NULL;
  assert_int_equal(ac_shampoo_create(&sh, twice, 3, NULL), AC_EINVAL);
  assert_null(sh);

  /* Parameters on two backends. */
  ac_backend *other = NULL;
  ac_param q;
  assert_int_equal(ac_backend_create(&other, NULL), AC_OK);
  param_init(&q, other, "q", 2, shapes[0]);
  ac_param *mixed[2] = {pb.ptrs[0], &q};
  assert_int_equal(ac_sgd_create(&sgd, mixed, 2, NULL), AC_EMISMATCH);
  assert_int_equal(ac_adamw_create(&adam, mixed, 2, NULL), AC_EMISMATCH);
  ac_param_destroy(&q);
  ac_backend_destroy(other);

  /* Bad learning rates; NULL optimizers. */
  assert_int_equal(ac_sgd_create(&sgd, pb.ptrs, NP, NULL), AC_OK);
  assert_int_equal(ac_adamw_create(&adam, pb.ptrs, NP, NULL), AC_OK);
  assert_int_equal(ac_sgd_step(sgd, -0.1f), AC_EINVAL);
  assert_int_equal(ac_sgd_step(sgd, NAN), AC_EINVAL);
  assert_int_equal(ac_adamw_step(adam, INFINITY), AC_EINVAL);
  assert_int_equal(ac_sgd_step(NULL, 0.1f), AC_EINVAL);
  assert_int_equal(ac_adamw_step(NULL, 0.1f), AC_EINVAL);
  assert_int_equal(ac_sgd_steps(sgd), 0);
  ac_sgd_destroy(sgd);
  ac_adamw_destroy(adam);
  ac_sgd_destroy(NULL);
  ac_adamw_destroy(NULL);
  problem_destroy(&pb);
}

/* ------------------------------------------------------------------------------------ */
/* A tiny model: logits = W2 relu(W1 x + b1) + b2, softmax cross-entropy                   */

enum { TN = 64, TI = 16, TH = 32, TO = 4, TSTEPS = 200, ROOT_EVERY = 10 };

typedef struct {
  ac_backend *be;
  ac_param w1, b1, w2, b2;
  ac_param *params[4];
  float *x, *hpre, *hact, *logits, *probs, *loss, *dh; /* device */
  int32_t *labels;                                     /* device */
} tiny;

static float *dev(ac_backend *be, size_t n) {
  void *p = NULL;
  assert_int_equal(ac_malloc(be, n * sizeof(float), &p), AC_OK);
  return p;
}

/* Weights from the backend's counter RNG (the same numbers on every backend); inputs and
 * labels (from a fixed random teacher) from a host generator with a fixed seed. */
static void tiny_init(tiny *m, ac_backend *be) {
  const size_t s_w1[2] = {TH, TI}, s_b1[1] = {TH}, s_w2[2] = {TO, TH}, s_b2[1] = {TO};
  memset(m, 0, sizeof *m);
  m->be = be;
  param_init(&m->w1, be, "fc1.weight", 2, s_w1);
  param_init(&m->b1, be, "fc1.bias", 1, s_b1);
  param_init(&m->w2, be, "fc2.weight", 2, s_w2);
  param_init(&m->b2, be, "fc2.bias", 1, s_b2);
  m->params[0] = &m->w1;
  m->params[1] = &m->b1;
  m->params[2] = &m->w2;
  m->params[3] = &m->b2;
  assert_int_equal(
      ac_rand_normal(be, 7, 0, TH * TI, 0.0f, 1.0f / sqrtf(TI), ac_tensor_f32(&m->w1.value)),
      AC_OK);
  assert_int_equal(
      ac_rand_normal(be, 7, TH * TI, TO * TH, 0.0f, 1.0f / sqrtf(TH), ac_tensor_f32(&m->w2.value)),
      AC_OK);

  m->x = dev(be, TN * TI);
  m->hpre = dev(be, TN * TH);
  m->hact = dev(be, TN * TH);
  m->dh = dev(be, TN * TH);
  m->logits = dev(be, TN * TO);
  m->probs = dev(be, TN * TO);
  m->loss = dev(be, TN);
  assert_int_equal(ac_malloc(be, TN * sizeof(int32_t), (void **)&m->labels), AC_OK);

  uint64_t saved = rng_state;
  float x[TN * TI], teacher[TO * TI];
  int32_t labels[TN];
  rng_state = 0x9E3779B97F4A7C15ull;
  fill_rand(TN * TI, x, 1.0f);
  fill_rand(TO * TI, teacher, 1.0f);
  for (int n = 0; n < TN; n++) {
    double best = -INFINITY;
    for (int o = 0; o < TO; o++) {
      double z = 0.0;
      for (int i = 0; i < TI; i++) z += (double)x[n * TI + i] * teacher[o * TI + i];
      if (z > best) {
        best = z;
        labels[n] = o;
      }
    }
  }
  rng_state = saved;
  assert_int_equal(ac_memcpy_h2d(be, m->x, x, sizeof x), AC_OK);
  assert_int_equal(ac_memcpy_h2d(be, m->labels, labels, sizeof labels), AC_OK);
}

static void tiny_destroy(tiny *m) {
  for (int i = 0; i < 4; i++) ac_param_destroy(m->params[i]);
  float *bufs[] = {m->x, m->hpre, m->hact, m->dh, m->logits, m->probs, m->loss};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) ac_free(m->be, bufs[i]);
  ac_free(m->be, m->labels);
}

/* Forward and backward on the whole batch; returns the mean loss, grads filled. */
static double tiny_step(tiny *m) {
  ac_backend *be = m->be;
  float *w1 = ac_tensor_f32(&m->w1.value), *b1 = ac_tensor_f32(&m->b1.value);
  float *w2 = ac_tensor_f32(&m->w2.value), *b2 = ac_tensor_f32(&m->b2.value);
  double sum = 0.0;

  OK(ac_sgemm(be, AC_NO_TRANS, AC_TRANS, TN, TH, TI, 1.0f, m->x, TI, w1, TI, 0.0f, m->hpre, TH));
  OK(ac_bcast(be, AC_BIN_ADD, TN, TH, 1, m->hpre, b1, m->hpre));
  OK(ac_unary(be, AC_UNARY_RELU, TN * TH, m->hpre, m->hact));
  OK(ac_sgemm(be, AC_NO_TRANS, AC_TRANS, TN, TO, TH, 1.0f, m->hact, TH, w2, TH, 0.0f, m->logits,
              TO));
  OK(ac_bcast(be, AC_BIN_ADD, TN, TO, 1, m->logits, b2, m->logits));
  OK(ac_xent_forward(be, TN, TO, m->logits, m->labels, m->probs, m->loss));
  OK(ac_sum_to_host(be, TN, m->loss, &sum));

  float *dlogits = m->probs; /* in place */
  OK(ac_xent_backward(be, TN, TO, m->probs, m->labels, 1.0f / TN, dlogits));
  OK(ac_sgemm(be, AC_TRANS, AC_NO_TRANS, TO, TH, TN, 1.0f, dlogits, TO, m->hact, TH, 0.0f,
              ac_tensor_f32(&m->w2.grad), TH));
  OK(ac_reduce(be, AC_REDUCE_SUM, TN, TO, 1, 1.0f, dlogits, 0.0f, ac_tensor_f32(&m->b2.grad)));
  OK(ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, TN, TH, TO, 1.0f, dlogits, TO, w2, TH, 0.0f, m->dh,
              TH));
  OK(ac_unary_backward(be, AC_UNARY_RELU, TN * TH, m->hpre, m->dh, m->dh));
  OK(ac_sgemm(be, AC_TRANS, AC_NO_TRANS, TH, TI, TN, 1.0f, m->dh, TH, m->x, TI, 0.0f,
              ac_tensor_f32(&m->w1.grad), TI));
  OK(ac_reduce(be, AC_REDUCE_SUM, TN, TH, 1, 1.0f, m->dh, 0.0f, ac_tensor_f32(&m->b1.grad)));
  return sum / TN;
}

/* Inverse 4th root of the symmetric PSD matrix a (n x n, dense) by the numerics core, as
 * precondd computes it (its defaults: relative ridge 1e-6, coupled Newton). */
static void root_f32(size_t n, const float *a, float *x) {
  pc_root_opts ro;
  pc_root_info info;
  pc_root_opts_default(&ro, 4);
  int rc = pc_inverse_root_f32(n, a, x, &ro, &info);
  if (rc != PC_OK && rc != PC_NOT_CONVERGED) fail_msg("pc_inverse_root_f32: %s", pc_strerror(rc));
}

/* The daemon's part, done here: accumulate the pushed statistics (sum, beta2 = 1) and
 * every ROOT_EVERY steps compute fresh roots of every block and hand them back. */
typedef struct {
  size_t nblocks;
  float **left, **right; /* accumulated packed statistics per block */
  uint64_t version;
  uint64_t step; /* the newest statistics pushed */
} local_daemon;

static void daemon_init(local_daemon *d, const ac_shampoo *s) {
  d->nblocks = ac_shampoo_nblocks(s);
  d->left = xcalloc(d->nblocks, sizeof *d->left);
  d->right = xcalloc(d->nblocks, sizeof *d->right);
  d->version = 0;
  d->step = 0;
  for (size_t b = 0; b < d->nblocks; b++) {
    ac_shampoo_block info;
    OK(ac_shampoo_block_info(s, b, &info));
    d->left[b] = xcalloc(ac_packed_len(info.block.rows), sizeof(float));
    d->right[b] = xcalloc(ac_packed_len(info.block.cols), sizeof(float));
  }
}

static void daemon_destroy(local_daemon *d) {
  for (size_t b = 0; b < d->nblocks; b++) {
    free(d->left[b]);
    free(d->right[b]);
  }
  free(d->left);
  free(d->right);
}

static void daemon_push(local_daemon *d, const ac_shampoo *s, long step) {
  d->step = (uint64_t)step;
  for (size_t b = 0; b < d->nblocks; b++) {
    ac_shampoo_block info;
    const float *l = NULL, *r = NULL;
    OK(ac_shampoo_block_info(s, b, &info));
    OK(ac_shampoo_block_stats(s, b, &l, &r));
    pc_stat_update_f32(ac_packed_len(info.block.rows), d->left[b], l, 1.0f);
    pc_stat_update_f32(ac_packed_len(info.block.cols), d->right[b], r, 1.0f);
  }
}

static void daemon_publish(local_daemon *d, ac_shampoo *s) {
  d->version++;
  for (size_t b = 0; b < d->nblocks; b++) {
    ac_shampoo_block info;
    OK(ac_shampoo_block_info(s, b, &info));
    const size_t r = info.block.rows, c = info.block.cols;
    float *dense = xcalloc(r > c ? r * r : c * c, sizeof(float));
    float *lroot = xcalloc(r * r, sizeof(float)), *rroot = xcalloc(c * c, sizeof(float));
    pc_unpack_f32(r, d->left[b], dense);
    root_f32(r, dense, lroot);
    pc_unpack_f32(c, d->right[b], dense);
    root_f32(c, dense, rroot);
    const ac_shampoo_roots roots = {.version = d->version,
                                    .source_step = d->step,
                                    .format = AC_ROOT_DENSE,
                                    .n_left = r,
                                    .left = lroot,
                                    .n_right = c,
                                    .right = rroot};
    OK(ac_shampoo_set_roots(s, b, &roots));
    free(dense);
    free(lroot);
    free(rroot);
  }
}

typedef enum { OPT_SGD, OPT_ADAMW, OPT_SHAMPOO } opt_kind;

/* Trains a fresh tiny model for TSTEPS steps; losses[TSTEPS]. */
static void train(ac_backend *be, opt_kind kind, double *losses, uint64_t *fallbacks) {
  tiny m;
  ac_sgd *sgd = NULL;
  ac_adamw *adam = NULL;
  ac_shampoo *sh = NULL;
  local_daemon d;

  tiny_init(&m, be);
  if (kind == OPT_SGD) {
    ac_sgd_opts o = {.momentum = 0.9f, .nesterov = 1, .weight_decay = 1e-4f};
    OK(ac_sgd_create(&sgd, m.params, 4, &o));
  } else if (kind == OPT_ADAMW) {
    OK(ac_adamw_create(&adam, m.params, 4, NULL));
  } else {
    ac_shampoo_opts o;
    ac_shampoo_opts_default(&o);
    o.layout.block_size = 16; /* fc1.weight: 2 blocks 16 x 16; fc2.weight: 2 blocks 4 x 16 */
    o.start_step = 5;
    OK(ac_shampoo_create(&sh, m.params, 4, &o));
    assert_int_equal(ac_shampoo_nblocks(sh), 4);
    daemon_init(&d, sh);
  }

  ac_lr_schedule sched;
  ac_lr_schedule_default(&sched, kind == OPT_SGD ? 0.1 : kind == OPT_ADAMW ? 0.01 : 0.01);
  sched.warmup_steps = 10;
  sched.decay = AC_LR_COSINE;
  sched.decay_steps = TSTEPS;
  sched.min_lr = 0.1 * sched.base_lr;
  OK(ac_lr_schedule_check(&sched));

  for (long t = 1; t <= TSTEPS; t++) {
    losses[t - 1] = tiny_step(&m);
    const float lr = (float)ac_lr_schedule_at(&sched, t);
    if (kind == OPT_SGD) {
      OK(ac_clip_grad_norm(m.params, 4, 5.0, NULL));
      OK(ac_sgd_step(sgd, lr));
    } else if (kind == OPT_ADAMW) {
      OK(ac_adamw_step(adam, lr));
    } else {
      int due = 0;
      long step = 0;
      OK(ac_shampoo_compute_stats(sh, &due, &step));
      assert_true(due);
      assert_int_equal(step, t);
      daemon_push(&d, sh, step);
      if (t % ROOT_EVERY == 0)
        daemon_publish(&d, sh); /* used until the next publication: stale by design */
      OK(ac_shampoo_step(sh, lr));
      ac_shampoo_step_info si;
      OK(ac_shampoo_last_step(sh, &si));
      assert_int_equal(si.preconditioned, t < ROOT_EVERY ? 0 : 4);
      assert_int_equal(si.staleness_max, t < ROOT_EVERY ? -1 : t % ROOT_EVERY);
    }
  }
  if (fallbacks != NULL) *fallbacks = sh != NULL ? ac_shampoo_fallback_total(sh) : 0;
  if (sh != NULL) daemon_destroy(&d);
  ac_sgd_destroy(sgd);
  ac_adamw_destroy(adam);
  ac_shampoo_destroy(sh);
  tiny_destroy(&m);
}

static double mean(const double *x, size_t n) {
  double s = 0.0;
  for (size_t i = 0; i < n; i++) s += x[i];
  return s / (double)n;
}

static void check_training(ac_backend *be, opt_kind kind, const char *name) {
  double a[TSTEPS], b[TSTEPS];
  uint64_t fb = 0;
  train(be, kind, a, &fb);
  train(be, kind, b, NULL);
  const double first = a[0], last = mean(a + TSTEPS - 10, 10);
  print_message("[ INFO     ] %s: loss %.4f -> %.4f over %d steps\n", name, first, last, TSTEPS);
  assert_true(isfinite(last));
  assert_true(last < 0.5 * first);
  /* Same seed, same backend: the same losses bit for bit. */
  assert_memory_equal(a, b, sizeof a);
  if (kind == OPT_SHAMPOO) {
    /* The first roots arrive before step ROOT_EVERY's update: 4 blocks fall back for the
     * ROOT_EVERY - 1 steps before it, and never after. */
    assert_int_equal(fb, 4 * (ROOT_EVERY - 1));
  }
}

static void test_train_sgd(void **state) {
  check_training(backend(state), OPT_SGD, "sgd");
}

static void test_train_adamw(void **state) {
  check_training(backend(state), OPT_ADAMW, "adamw");
}

static void test_train_shampoo(void **state) {
  check_training(backend(state), OPT_SHAMPOO, "shampoo");
}

/* The same training on this backend and on the CPU: the loss curves agree to rounding over
 * the first steps (later, rounding differences may grow: training is not contracting). On
 * the CPU group this compares the CPU with itself, bit for bit. */
static void test_train_vs_cpu(void **state) {
  ac_backend *be = backend(state), *cpu = NULL;
  const int cuda = ac_backend_kind_of(be) == AC_BACKEND_CUDA;
  OK(ac_backend_create(&cpu, NULL));
  for (int k = OPT_SGD; k <= OPT_SHAMPOO; k++) {
    double a[TSTEPS], b[TSTEPS];
    train(be, (opt_kind)k, a, NULL);
    train(cpu, (opt_kind)k, b, NULL);
    for (int t = 0; t < 30; t++)
      if (!(fabs(a[t] - b[t]) <= (cuda ? 1e-3 : 0.0) * (1.0 + fabs(b[t]))))
        fail_msg("optimizer %d, step %d: loss %.9g here, %.9g on the CPU", k, t + 1, a[t], b[t]);
  }
  ac_backend_destroy(cpu);
}

/* ------------------------------------------------------------------------------------ */
/* Groups                                                                                  */

#define OPTIM_TESTS                                                                      \
  cmocka_unit_test(test_sgd), cmocka_unit_test(test_adamw), cmocka_unit_test(test_clip), \
      cmocka_unit_test(test_bad_args), cmocka_unit_test(test_train_sgd),                 \
      cmocka_unit_test(test_train_adamw), cmocka_unit_test(test_train_shampoo),          \
      cmocka_unit_test(test_train_vs_cpu)

int main(void) {
  const struct CMUnitTest cpu[] = {OPTIM_TESTS};
  const struct CMUnitTest cuda[] = {OPTIM_TESTS};
  int failed = cmocka_run_group_tests_name("cpu", cpu, setup_cpu, teardown);
  failed += cmocka_run_group_tests_name("cuda", cuda, setup_cuda, teardown);
  return failed;
}
