/* test_kfac.c -- the trainer library's K-FAC mode (trainer/kfac.c) against a real precondd.
 *
 * Argument: the path of precondd; the test starts it on a free loopback port. A small conv
 * net (conv with bias -> batch norm with a fused ReLU -> global average pooling -> linear ->
 * softmax cross-entropy) on a fixed batch of synthetic images, trained through the layers'
 * curvature hooks: layers found by the first backward and registered, plain SGD counted as
 * fallback until the first inverses, then inverses that arrive and are applied to both
 * layers, the loss falling, and two sync_roots runs identical to the bit. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "precond.h"
#include "precondd_proc.h"
#include "trainer.h"

static const char *precondd_path;
static pdproc precondd;

enum { N = 24, C = 4, HW = 6, CLASSES = 3, STEPS = 14 };

typedef struct {
  ac_backend *be;
  ac_conv2d conv;
  ac_batchnorm bn;
  ac_gap gap;
  ac_linear fc;
  ac_celoss xent;
  ac_param_list params;
  float *x;
  int32_t *y;
} convnet;

/* The batch's images (net_init's dup): all different, or each image twice, as two equal
 * halves (image b + N/2 = image b) or interleaved (image 2i + 1 = image 2i). */
enum { DUP_NONE = 0, DUP_HALVES = 1, DUP_INTERLEAVED = 2 };

static int dup_source(int dup, int b) {
  return dup == DUP_HALVES ? b % (N / 2) : dup == DUP_INTERLEAVED ? b / 2 * 2 : b;
}

/* Images of class k: a bright row k (of 6) plus deterministic noise. */
static void net_init_dup(convnet *m, int dup) {
  memset(m, 0, sizeof *m);
  assert_int_equal(ac_backend_create(&m->be, NULL), AC_OK);
  assert_int_equal(
      ac_conv2d_init(&m->conv, m->be, "conv", 1, C, HW, HW, 3, 1, 1, 1, N, 8, NULL, 11), AC_OK);
  assert_int_equal(ac_batchnorm_init(&m->bn, m->be, "bn", C, HW * HW, 1e-5f, 0.1f, N), AC_OK);
  assert_int_equal(ac_batchnorm_fuse_relu(&m->bn), AC_OK);
  assert_int_equal(ac_gap_init(&m->gap, m->be, C, HW * HW, N), AC_OK);
  assert_int_equal(ac_linear_init(&m->fc, m->be, "fc", C, CLASSES, 1, N, 12), AC_OK);
  assert_int_equal(ac_celoss_init(&m->xent, m->be, CLASSES, N), AC_OK);
  ac_param_list_init(&m->params);
  assert_int_equal(ac_conv2d_params(&m->conv, &m->params), AC_OK);
  assert_int_equal(ac_batchnorm_params(&m->bn, &m->params), AC_OK);
  assert_int_equal(ac_linear_params(&m->fc, &m->params), AC_OK);
  float x[N * HW * HW];
  int32_t y[N];
  uint32_t seed = 7;
  for (int b = 0; b < N; b++) {
    y[b] = b % CLASSES;
    for (int i = 0; i < HW * HW; i++) {
      seed = seed * 1664525u + 1013904223u;
      x[b * HW * HW + i] =
          (float)((seed >> 8) % 1000) / 1000.0f - 0.5f + (i / HW == 2 * y[b] ? 2.0f : 0.0f);
    }
  }
  for (int b = 0; b < N; b++) { /* sources come first in both orders: copies only */
    int src = dup_source(dup, b);
    y[b] = y[src];
    memmove(x + b * HW * HW, x + src * HW * HW, HW * HW * sizeof *x);
  }
  void *p = NULL;
  assert_int_equal(ac_malloc(m->be, sizeof x, &p), AC_OK);
  m->x = p;
  assert_int_equal(ac_malloc(m->be, sizeof y, &p), AC_OK);
  m->y = p;
  assert_int_equal(ac_memcpy_h2d(m->be, m->x, x, sizeof x), AC_OK);
  assert_int_equal(ac_memcpy_h2d(m->be, m->y, y, sizeof y), AC_OK);
}

static void net_init(convnet *m) {
  net_init_dup(m, DUP_NONE);
}

static void net_set_hook(convnet *m, const ac_hook *h) {
  m->conv.hook = m->bn.hook = m->fc.hook = *h;
}

/* Forward of the batch: the grads zeroed first, the loss returned. */
static double net_forward(convnet *m) {
  const float *h = NULL;
  double loss = 0.0;
  assert_int_equal(ac_param_list_zero_grad(&m->params), AC_OK);
  assert_int_equal(ac_conv2d_forward(&m->conv, m->x, N, &h), AC_OK);
  assert_int_equal(ac_batchnorm_forward(&m->bn, h, N, AC_MODE_TRAIN, &h), AC_OK);
  assert_int_equal(ac_gap_forward(&m->gap, h, N, &h), AC_OK);
  assert_int_equal(ac_linear_forward(&m->fc, h, N, &h), AC_OK);
  assert_int_equal(ac_celoss_forward(&m->xent, h, m->y, N, &loss), AC_OK);
  return loss;
}

static int net_backward(convnet *m) {
  const float *g = NULL;
  int rc = ac_celoss_backward(&m->xent, &g);
  if (rc == AC_OK) rc = ac_linear_backward(&m->fc, g, &g);
  if (rc == AC_OK) rc = ac_gap_backward(&m->gap, g, &g);
  if (rc == AC_OK) rc = ac_batchnorm_backward(&m->bn, g, &g);
  if (rc == AC_OK) rc = ac_conv2d_backward(&m->conv, g, NULL);
  return rc;
}

static double net_fwd_bwd(convnet *m) {
  double loss = net_forward(m);
  assert_int_equal(net_backward(m), AC_OK);
  return loss;
}

/* The model Fisher's pass as a client runs it (bench/train.c's tr_kfac_model_fisher): the
 * loss reads the drawn labels, which the test keeps (or, force, overwrites with the
 * batch's own first: then the run must be the empirical one's, to the bit). */
typedef struct {
  convnet *m;
  int32_t *drawn;
  int force, passes;
  int32_t first[N]; /* the draws of the first pass */
} fisher_pass;

static int fisher_backward(void *ctx) {
  fisher_pass *f = ctx;
  if (f->force) assert_int_equal(ac_memcpy_d2d(f->m->be, f->drawn, f->m->y, N * 4), AC_OK);
  if (f->passes++ == 0)
    assert_int_equal(ac_memcpy_d2h(f->m->be, f->first, f->drawn, sizeof f->first), AC_OK);
  f->m->xent.labels = f->drawn;
  int rc = net_backward(f->m);
  f->m->xent.labels = f->m->y;
  return rc;
}

static void net_destroy(convnet *m) {
  ac_free(m->be, m->x);
  ac_free(m->be, m->y);
  ac_param_list_destroy(&m->params);
  ac_conv2d_destroy(&m->conv);
  ac_batchnorm_destroy(&m->bn);
  ac_gap_destroy(&m->gap);
  ac_linear_destroy(&m->fc);
  ac_celoss_destroy(&m->xent);
  ac_backend_destroy(m->be);
}

static void opts_for(pt_options *o, const char *job, int sync) {
  pt_options_default(o, PT_MODE_KFAC);
  o->daemon = precondd.addr;
  o->job = job;
  o->sync_roots = sync;
  o->kfac.steps_per_epoch = 4; /* factors every step in the first epoch, then every 3 */
  o->kfac.k.factor_every = 3;
  o->kfac.k.inv_every = 2;
  o->kfac.quiet = 1;
}

typedef struct {
  double loss[STEPS];
  pt_step_info info[STEPS];
  pt_counters c;
  float fc_w[CLASSES * C];
  int fisher_ran[STEPS];    /* the model Fisher's pass ran at this step */
  int32_t first_draw[N];    /* its draws at the first pass */
  float fc_g1[CLASSES * C]; /* fc's weight grad at step 1 as pt_step gets it */
} run_out;

/* The KL clip's settings of a run; NULL: the defaults at lr 0.2. fisher: 0 empirical, 1 the
 * model's, 2 the model's with the draws forced to the batch's labels. form and inverse:
 * pt_kfac_opts'; bf16: push_bf16; rows and row_sample: dense_rows and row_sample; dup:
 * net_init_dup's. */
typedef struct {
  double lr, kl_clip, base_lr;
  int kl_base_lr, fisher, form, inverse, bf16;
  size_t rows;
  int row_sample, dup;
} clip_cfg;

static void train_clip(const char *job, int sync, size_t a_images, const clip_cfg *cc,
                       run_out *out) {
  convnet m;
  net_init_dup(&m, cc ? cc->dup : DUP_NONE);
  pt_options o;
  opts_for(&o, job, sync);
  o.kfac.a_images = a_images;
  if (cc) { /* else the defaults (every row of this batch of 24) */
    o.kfac.dense_rows = cc->rows;
    o.kfac.row_sample = (pt_kfac_rows)cc->row_sample;
  }
  double lr = cc ? cc->lr : 0.2;
  if (cc && cc->kl_clip > 0.0) {
    o.kfac.k.kl_clip = cc->kl_clip;
    o.kfac.k.kl_base_lr = cc->kl_base_lr;
    o.kfac.base_lr = cc->base_lr;
  }
  o.kfac.model_fisher = cc && cc->fisher > 0;
  o.kfac.form = cc ? (pt_kfac_form)cc->form : PT_KFAC_FORM_DAEMON;
  o.kfac.inverse = cc ? cc->inverse : 0;
  o.kfac.push_bf16 = cc && cc->bf16;
  fisher_pass fp = {&m, NULL, cc && cc->fisher == 2, 0, {0}};
  void *p = NULL;
  assert_int_equal(ac_malloc(m.be, N * sizeof(int32_t), &p), AC_OK);
  fp.drawn = p;
  pt_trainer *t = NULL;
  pt_error err = {""};
  assert_int_equal(pt_create(&t, &o, m.params.items, m.params.n, &err), PT_OK);
  ac_hook h;
  assert_int_equal(pt_kfac_hook(t, &h), PT_OK);
  net_set_hook(&m, &h);
  for (long s = 1; s <= STEPS; s++) {
    out->loss[s - 1] = net_forward(&m);
    int ran = 0;
    assert_int_equal(ac_memcpy_d2d(m.be, fp.drawn, m.y, N * sizeof(int32_t)), AC_OK);
    assert_int_equal(pt_kfac_model_fisher(t, N, CLASSES, m.xent.probs, fp.drawn, fisher_backward,
                                          &fp, &ran, &err),
                     PT_OK);
    out->fisher_ran[s - 1] = ran;
    if (ran) assert_int_equal(ac_param_list_zero_grad(&m.params), AC_OK);
    assert_int_equal(net_backward(&m), AC_OK);
    if (s == 1) assert_int_equal(ac_tensor_download(&m.fc.weight.grad, out->fc_g1), AC_OK);
    int rc = pt_step(t, s, lr, &out->info[s - 1], &err);
    if (rc != PT_OK) fprintf(stderr, "pt_step %ld: %s\n", s, err.msg);
    assert_int_equal(rc, PT_OK);
    if (!sync) { /* async: steps far slower than the daemon, as in a real run */
      struct timespec ts = {0, 30 * 1000000L};
      nanosleep(&ts, NULL);
    }
  }
  memcpy(out->first_draw, fp.first, sizeof fp.first);
  ac_free(m.be, fp.drawn);
  pt_get_counters(t, &out->c);
  assert_int_equal(ac_tensor_download(&m.fc.weight.value, out->fc_w), AC_OK);
  pt_destroy(t);
  net_destroy(&m);
}

static void train(const char *job, int sync, size_t a_images, run_out *out) {
  train_clip(job, sync, a_images, NULL, out);
}

static void test_kfac_trains(void **state) {
  (void)state;
  run_out a, b, c, d;
  train("kfac-a", 1, 0, &a);
  /* sync_roots: every push that makes the daemon compute waits for those inverses, so even
   * step 1 is preconditioned (conv and fc; batch norm is the worker's diagonal). */
  assert_int_equal(a.c.units, 2);
  assert_true(a.c.results_applied >= 2);
  assert_int_equal(a.c.results_rejected, 0);
  assert_int_equal(a.c.push_errors, 0);
  for (int s = 0; s < STEPS; s++) {
    assert_int_equal(a.info[s].preconditioned, 2);
    assert_int_equal(a.info[s].fallback, 0);
    assert_true(a.info[s].staleness_max >= 0 && a.info[s].staleness_max <= 6);
    assert_true(a.info[s].kl_scale > 0.0 && a.info[s].kl_scale <= 1.0);
  }
  /* Factors every step in the first epoch (4 steps), then every 3: 5, 8, 11, 14. */
  assert_int_equal(a.info[3].pushed, 1);
  assert_int_equal(a.info[4].pushed, 1);
  assert_int_equal(a.info[5].pushed, 0);
  assert_int_equal(a.info[6].pushed, 0);
  assert_int_equal(a.info[7].pushed, 1);
  /* The loss falls. */
  assert_true(a.loss[STEPS - 1] < 0.5 * a.loss[0]);
  /* A second sync_roots run: the same losses and weights, to the bit. */
  train("kfac-b", 1, 0, &b);
  assert_memory_equal(a.loss, b.loss, sizeof a.loss);
  assert_memory_equal(a.fc_w, b.fc_w, sizeof a.fc_w);
  /* Asynchronous: step 1 cannot have inverses (its factors are only queued): plain SGD for
   * both layers, counted as fallback; they arrive and are applied later in the run. */
  train("kfac-c", 0, 0, &c);
  assert_int_equal(c.info[0].pushed, 1);
  assert_int_equal(c.info[0].preconditioned, 0);
  assert_int_equal(c.info[0].fallback, 2);
  assert_true(c.info[0].kl_scale > 0.0 && c.info[0].kl_scale <= 1.0); /* batch norm's */
  assert_int_equal(c.info[STEPS - 1].preconditioned, 2);
  assert_true(c.c.results_applied >= 2);
  assert_true(c.loss[STEPS - 1] < c.loss[0]);
  /* A from the first 4 images of 24 (half a chunk): other factors, still a falling loss. */
  train("kfac-d", 1, 4, &d);
  assert_int_equal(d.info[STEPS - 1].preconditioned, 2);
  assert_true(d.loss[STEPS - 1] < 0.5 * d.loss[0]);
  assert_memory_not_equal(d.fc_w, a.fc_w, sizeof a.fc_w);
}

/* kl_base_lr: the clip's nu comes from the base rate, not the step's. A tiny kl_clip makes
 * every step clip, where nu is proportional to 1 / lr: at step 1 (the same weights and
 * factors in every run) nu at base 0.4 is half nu at the step's 0.2. Without a base_lr the
 * base is the largest rate seen, which at a constant rate is the step's: the same run. */
static void test_kfac_kl_base_lr(void **state) {
  (void)state;
  run_out e, f, g;
  clip_cfg ce = {0.2, 1e-6, 0.0, 0, 0, 0, 0, 0, 0, 0, 0},
           cf = {0.2, 1e-6, 0.4, 1, 0, 0, 0, 0, 0, 0, 0},
           cg = {0.2, 1e-6, 0.0, 1, 0, 0, 0, 0, 0, 0, 0};
  train_clip("kfac-kl-e", 1, 0, &ce, &e);
  train_clip("kfac-kl-f", 1, 0, &cf, &f);
  train_clip("kfac-kl-g", 1, 0, &cg, &g);
  assert_true(e.info[0].kl_scale > 0.0 && e.info[0].kl_scale < 0.5); /* clipped */
  assert_float_equal(f.info[0].kl_scale, 0.5 * e.info[0].kl_scale, 1e-6 * e.info[0].kl_scale);
  assert_memory_not_equal(e.fc_w, f.fc_w, sizeof e.fc_w);
  assert_memory_equal(e.loss, g.loss, sizeof e.loss);
  assert_memory_equal(e.fc_w, g.fc_w, sizeof e.fc_w);
}

/* The model's Fisher: a backward on labels drawn from the predictive distribution makes
 * the factors, on the steps they are due only, and the batch's own backward the gradient.
 * Draws forced to the batch's labels give the empirical run to the bit (factors from the
 * drawn pass only, batch norm's Fisher folded once, the pass's grads discarded); real draws
 * give other factors, differ from the batch's labels, are reproducible, and still train. */
static void test_kfac_model_fisher(void **state) {
  (void)state;
  clip_cfg emp = {0.2, 0.0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0},
           model = {0.2, 0.0, 0.0, 0, 1, 0, 0, 0, 0, 0, 0},
           forced = {0.2, 0.0, 0.0, 0, 2, 0, 0, 0, 0, 0, 0};
  run_out e, f, g, h;
  train_clip("kfac-fisher-e", 1, 0, &emp, &e);
  train_clip("kfac-fisher-f", 1, 0, &forced, &f);
  train_clip("kfac-fisher-g", 1, 0, &model, &g);
  train_clip("kfac-fisher-h", 1, 0, &model, &h);
  for (int s = 0; s < STEPS; s++) {
    assert_int_equal(e.fisher_ran[s], 0); /* the empirical Fisher: never */
    /* factors every step in the first epoch (4 steps), then every 3: 5, 8, 11, 14 */
    assert_int_equal(g.fisher_ran[s], s < 4 || s % 3 == 1);
    assert_int_equal(g.info[s].preconditioned, 2);
  }
  assert_memory_equal(e.loss, f.loss, sizeof e.loss);
  assert_memory_equal(e.fc_w, f.fc_w, sizeof e.fc_w);
  /* The gradient pt_step gets is the batch's, whatever the drawn pass did before it. */
  assert_memory_equal(e.fc_g1, g.fc_g1, sizeof e.fc_g1);
  assert_memory_not_equal(e.fc_w, g.fc_w, sizeof e.fc_w);
  int differ = 0;
  for (int i = 0; i < N; i++) {
    assert_true(g.first_draw[i] >= 0 && g.first_draw[i] < CLASSES);
    differ += g.first_draw[i] != i % CLASSES;
  }
  assert_true(differ > 0);
  assert_memory_equal(g.first_draw, h.first_draw, sizeof g.first_draw);
  assert_memory_equal(g.loss, h.loss, sizeof g.loss);
  assert_true(g.loss[STEPS - 1] < 0.5 * g.loss[0]);
}

/* The worker forms. The worker's damped inverses are precondd's to the bit (the same fold,
 * damping split, method rule and packing, at the same pushes; the daemon form's dense
 * factors go from the hook straight into the push slots, the worker's through the host
 * buffer): with sync_roots the same run, for the method by size and for eigh asked by name (which the daemon then uses too:
 * the option travels). The eigen form preconditions both layers from step 1 without
 * waiting for the daemon, so an asynchronous run repeats exactly; it trains, and is not the
 * inverse form. */
static void test_kfac_worker_forms(void **state) {
  (void)state;
  clip_cfg daemon = {0.2, 0.0, 0.0, 0, 0, PT_KFAC_FORM_DAEMON, 0, 0, 0, 0, 0},
           winv = {0.2, 0.0, 0.0, 0, 0, PT_KFAC_FORM_WORKER_INVERSE, 0, 0, 0, 0, 0},
           deigh = {0.2, 0.0, 0.0, 0, 0, PT_KFAC_FORM_DAEMON, 1 + PC_KFAC_INV_EIGH, 0, 0, 0, 0},
           weigh = {0.2, 0.0, 0.0, 0, 0, PT_KFAC_FORM_WORKER_INVERSE, 1 + PC_KFAC_INV_EIGH,
                    0,   0,   0,   0},
           eigen = {0.2, 0.0, 0.0, 0, 0, PT_KFAC_FORM_WORKER_EIGEN, 0, 0, 0, 0, 0};
  run_out a, b, c, d, e, f;
  /* The daemon form takes libprecond's whole inverses in place (precond_options.kfac_dense),
   * the worker form unpacks its own packed ones: the same floats, the same run. */
  train_clip("kfac-form-a", 1, 0, &daemon, &a);
  train_clip("kfac-form-b", 1, 0, &winv, &b);
  assert_memory_equal(a.loss, b.loss, sizeof a.loss);
  assert_memory_equal(a.fc_w, b.fc_w, sizeof a.fc_w);
  for (int s = 0; s < STEPS; s++) {
    assert_int_equal(b.info[s].preconditioned, 2);
    assert_int_equal(b.info[s].staleness_max, a.info[s].staleness_max);
  }
  train_clip("kfac-form-c", 1, 0, &deigh, &c);
  train_clip("kfac-form-d", 1, 0, &weigh, &d);
  assert_memory_equal(c.fc_w, d.fc_w, sizeof c.fc_w);
  assert_memory_not_equal(a.fc_w, c.fc_w, sizeof a.fc_w); /* eigh is not Cholesky's rounding */
  train_clip("kfac-form-e", 0, 0, &eigen, &e);
  train_clip("kfac-form-f", 0, 0, &eigen, &f);
  for (int s = 0; s < STEPS; s++) {
    assert_int_equal(e.info[s].preconditioned, 2);
    assert_int_equal(e.info[s].fallback, 0);
  }
  assert_true(e.c.results_applied >= 2);
  assert_int_equal(e.c.results_rejected, 0);
  assert_memory_equal(e.loss, f.loss, sizeof e.loss);
  assert_memory_equal(e.fc_w, f.fc_w, sizeof e.fc_w);
  assert_true(e.loss[STEPS - 1] < 0.5 * e.loss[0]);
  assert_memory_not_equal(e.fc_w, a.fc_w, sizeof e.fc_w);
  /* Factors pushed as bf16: the daemon's inverses of the rounded factors, applied from
   * step 1 with sync_roots; the run trains and is not the fp32 one. */
  clip_cfg bf16 = daemon;
  bf16.bf16 = 1;
  run_out g;
  train_clip("kfac-form-g", 1, 0, &bf16, &g);
  for (int s = 0; s < STEPS; s++) assert_int_equal(g.info[s].preconditioned, 2);
  assert_true(g.loss[STEPS - 1] < 0.5 * g.loss[0]);
  assert_memory_not_equal(g.fc_w, a.fc_w, sizeof g.fc_w);
}

/* Largest |x - y| over n values, relative to the largest |x|. */
static double rel_diff(const float *x, const float *y, size_t n) {
  double d = 0.0, m = 0.0;
  for (size_t i = 0; i < n; i++) {
    d = fmax(d, fabs((double)x[i] - (double)y[i]));
    m = fmax(m, fabs((double)x[i]));
  }
  return d / m;
}

/* A dense layer's factors from some of the batch's rows (dense_rows, row_sample): fc's A and
 * G from 12 of its 24 rows. On a batch made of each image twice, the rows taken are every
 * image once when the copies lie the way the sample skips them (the two halves for a
 * prefix, neighbours for a stride of 2), so the factors, and the run, are the all-rows
 * run's up to rounding; the other way round the sample is half the images twice (other
 * factors), and so is a prefix on all-different images. */
static void test_kfac_dense_rows(void **state) {
  (void)state;
  enum { R = N / 2 };
  clip_cfg all_h = {0.2, 0.0, 0.0, 0, 0, 0, 0, 0, 0, PT_KFAC_ROWS_PREFIX, DUP_HALVES};
  clip_cfg all_i = all_h, pre_h = all_h, pre_i = all_h, str_h = all_h, str_i = all_h;
  all_i.dup = pre_i.dup = str_i.dup = DUP_INTERLEAVED;
  pre_h.rows = pre_i.rows = str_h.rows = str_i.rows = R;
  str_h.row_sample = str_i.row_sample = PT_KFAC_ROWS_STRIDED;
  clip_cfg all_n = all_h, pre_n = pre_h;
  all_n.dup = pre_n.dup = DUP_NONE;
  run_out a, b, c, d, e, f, g, h;
  size_t nw = sizeof a.fc_w / sizeof a.fc_w[0];
  train_clip("kfac-rows-a", 1, 0, &all_h, &a);
  train_clip("kfac-rows-b", 1, 0, &pre_h, &b);
  train_clip("kfac-rows-c", 1, 0, &str_h, &c);
  train_clip("kfac-rows-d", 1, 0, &all_i, &d);
  train_clip("kfac-rows-e", 1, 0, &str_i, &e);
  train_clip("kfac-rows-f", 1, 0, &pre_i, &f);
  train_clip("kfac-rows-g", 1, 0, &all_n, &g);
  train_clip("kfac-rows-h", 1, 0, &pre_n, &h);
  double same_pre = rel_diff(a.fc_w, b.fc_w, nw), other_str = rel_diff(a.fc_w, c.fc_w, nw);
  double same_str = rel_diff(d.fc_w, e.fc_w, nw), other_pre = rel_diff(d.fc_w, f.fc_w, nw);
  double other_n = rel_diff(g.fc_w, h.fc_w, nw);
  fprintf(stderr, "dense rows: same %.2e %.2e, other %.2e %.2e %.2e\n", same_pre, same_str,
          other_str, other_pre, other_n);
  assert_true(same_pre < 1e-4 && same_str < 1e-4);
  assert_true(other_str > 1e-3 && other_pre > 1e-3 && other_n > 1e-3);
  for (int s = 0; s < STEPS; s++) {
    assert_int_equal(h.info[s].preconditioned, 2);
    assert_int_equal(c.info[s].preconditioned, 2);
  }
  assert_true(h.loss[STEPS - 1] < 0.5 * h.loss[0]);
  assert_true(c.loss[STEPS - 1] < 0.5 * c.loss[0]);
}

/* The hook is only for a K-FAC trainer; a K-FAC trainer needs an epoch length. */
static void test_kfac_bad_use(void **state) {
  (void)state;
  convnet m;
  net_init(&m);
  pt_options o;
  opts_for(&o, "kfac-bad", 0);
  o.kfac.steps_per_epoch = 0;
  pt_trainer *t = NULL;
  pt_error err = {""};
  assert_int_equal(pt_create(&t, &o, m.params.items, m.params.n, &err), PT_EINVAL);
  assert_non_null(strstr(err.msg, "steps_per_epoch"));
  opts_for(&o, "kfac-bad-form", 0);
  o.kfac.form = (pt_kfac_form)3;
  assert_int_equal(pt_create(&t, &o, m.params.items, m.params.n, &err), PT_EINVAL);
  assert_non_null(strstr(err.msg, "form"));
  opts_for(&o, "kfac-bad-inverse", 0);
  o.kfac.inverse = 1 + PC_KFAC_INV_NEWTON + 1;
  assert_int_equal(pt_create(&t, &o, m.params.items, m.params.n, &err), PT_EINVAL);
  assert_non_null(strstr(err.msg, "inverse"));
  opts_for(&o, "kfac-bad-rows", 0);
  o.kfac.row_sample = (pt_kfac_rows)2;
  assert_int_equal(pt_create(&t, &o, m.params.items, m.params.n, &err), PT_EINVAL);
  assert_non_null(strstr(err.msg, "row_sample"));
  /* No hook installed: the first step says so. */
  opts_for(&o, "kfac-nohook", 0);
  assert_int_equal(pt_create(&t, &o, m.params.items, m.params.n, &err), PT_OK);
  net_fwd_bwd(&m);
  assert_int_equal(pt_step(t, 1, 0.1, NULL, &err), PT_EINVAL);
  assert_non_null(strstr(err.msg, "hook"));
  ac_hook h;
  pt_destroy(t);
  pt_options_default(&o, PT_MODE_SHAMPOO);
  o.daemon = precondd.addr;
  o.job = "kfac-shampoo";
  assert_int_equal(pt_create(&t, &o, m.params.items, m.params.n, &err), PT_OK);
  assert_int_equal(pt_kfac_hook(t, &h), PT_EINVAL);
  assert_string_equal(pt_mode_name(PT_MODE_KFAC), "kfac");
  pt_destroy(t);
  net_destroy(&m);
}

/* One daemon for the group, in a directory of the helper's own (removed by destroy). */
/* One daemon for the group, in a directory of its own that pdproc_destroy removes. */
static int setup(void **state) {
  (void)state;
  return pdproc_start_in(&precondd, precondd_path, NULL);
}

static int teardown(void **state) {
  (void)state;
  pdproc_destroy(&precondd);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s PRECONDD\n", argv[0]);
    return 2;
  }
  precondd_path = argv[1];
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_kfac_trains),       cmocka_unit_test(test_kfac_kl_base_lr),
      cmocka_unit_test(test_kfac_model_fisher), cmocka_unit_test(test_kfac_worker_forms),
      cmocka_unit_test(test_kfac_dense_rows),   cmocka_unit_test(test_kfac_bad_use),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
