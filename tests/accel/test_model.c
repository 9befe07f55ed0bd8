/*
 * test_model.c -- the model blocks of accel/model.c: the Transformer block, the Transformer
 * LM and the ResNet (basic blocks). The layers themselves are checked against fp64
 * references in test_layers.c; here the question is whether the blocks wire them correctly,
 * so every parameter tensor's gradient is checked against a central difference of the
 * model's own fp32 loss along a random direction d of that tensor:
 *   |g.d - (L(p + h d) - L(p - h d)) / 2h| <= TOL_DIR |g.d| + FLOOR,
 * TOL_DIR = 2e-2, FLOOR = 2e-4, h one of 1e-3, 3e-4, 1e-4 (see check_directional). A missing or misrouted gradient is
 * off by O(1). Also: parameter names, the loss at initialisation (about ln(classes)), a few
 * SGD steps lowering the loss on a fixed batch, reproducible dropout, and CUDA against CPU
 * (same seeds, same inputs) when a device exists.
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

#define TOL_DIR 2e-2
#define FLOOR   2e-4
#define TOL_XBE 1e-3

static uint64_t rng_state;

static void rng_seed(uint64_t s) {
  rng_state = s * 2685821657736338717ull + 88172645463325252ull;
}

static float frand(void) {
  return xorshift_frand(&rng_state);
}

static void *dev_upload(ac_backend *be, const void *h, size_t bytes) {
  void *d = NULL;
  OK(ac_malloc(be, bytes, &d));
  OK(ac_memcpy_h2d(be, d, h, bytes));
  return d;
}

static float *host_of(const ac_tensor *t) {
  float *h = malloc(t->numel * sizeof *h);
  assert_non_null(h);
  OK(ac_tensor_download(t, h));
  return h;
}

/* A model behind two callbacks, so one gradient check serves both. */
typedef struct {
  int (*forward)(void *model, double *loss);
  int (*backward)(void *model);
  void *model;
} model_ops;

static double loss_now(const model_ops *m) {
  double loss = 0.0;
  OK(m->forward(m->model, &loss));
  return loss;
}

/* Central difference of the loss along direction d (n values) of parameter p, step h. */
static double central_difference(const model_ops *m, ac_param *p, const float *v, const double *d,
                                 float *w, double h) {
  size_t n = p->value.numel;
  for (size_t i = 0; i < n; i++) w[i] = (float)(v[i] + h * d[i]);
  OK(ac_tensor_upload(&p->value, w));
  double lp = loss_now(m);
  for (size_t i = 0; i < n; i++) w[i] = (float)(v[i] - h * d[i]);
  OK(ac_tensor_upload(&p->value, w));
  double lm = loss_now(m);
  OK(ac_tensor_upload(&p->value, v));
  return (lp - lm) / (2.0 * h);
}

/* The directional check of every parameter tensor in list (see the file comment). The
 * fp32 loss limits the step from both sides: rounding noise grows as h shrinks, curvature
 * and ReLU kinks crossed grow with h. A tensor passes when the difference at one of the
 * steps 1e-3, 3e-4, 1e-4 agrees; a wrong gradient disagrees at all of them. */
static void check_directional(const model_ops *m, ac_param_list *list) {
  static const double steps[] = {1e-3, 3e-4, 1e-4};
  OK(ac_param_list_zero_grad(list));
  (void)loss_now(m);
  OK(m->backward(m->model));
  for (size_t k = 0; k < list->n; k++) {
    ac_param *p = list->items[k];
    size_t n = p->value.numel;
    float *v = host_of(&p->value), *g = host_of(&p->grad), *w = malloc(n * sizeof *w);
    double *d = malloc(n * sizeof *d);
    assert_non_null(w);
    assert_non_null(d);
    double an = 0.0, fd = 0.0;
    for (size_t i = 0; i < n; i++) {
      d[i] = frand();
      an += d[i] * g[i];
    }
    int ok = 0;
    for (size_t s = 0; s < sizeof steps / sizeof steps[0] && !ok; s++) {
      fd = central_difference(m, p, v, d, w, steps[s]);
      ok = fabs(fd - an) <= TOL_DIR * fabs(an) + FLOOR;
    }
    if (!ok) fail_msg("%s: directional derivative %.6g, central difference %.6g", p->name, an, fd);
    free(v);
    free(g);
    free(w);
    free(d);
  }
}

/* A few plain SGD steps on one batch must lower its loss. */
static void check_sgd_lowers_loss(const model_ops *m, ac_param_list *list, float lr, int steps) {
  double first = 0.0, last = 0.0;
  for (int s = 0; s <= steps; s++) {
    OK(ac_param_list_zero_grad(list));
    last = loss_now(m);
    if (s == 0) first = last;
    if (s == steps) break;
    OK(m->backward(m->model));
    for (size_t k = 0; k < list->n; k++) {
      ac_param *p = list->items[k];
      OK(ac_axpby(p->value.be, p->value.numel, -lr, ac_tensor_f32(&p->grad), 1.0f,
                  ac_tensor_f32(&p->value), ac_tensor_f32(&p->value)));
    }
  }
  if (!(last < 0.8 * first)) fail_msg("SGD: loss %.4f -> %.4f after %d steps", first, last, steps);
}

/* ------------------------------------------------------------------------------------ */
/* Transformer LM                                                                          */

typedef struct {
  ac_lm lm;
  int32_t *tokens, *targets;
  size_t batch, t;
  ac_mode mode;
  int fixed_masks; /* rewind the dropout streams before each forward: the same masks */
} lm_run;

static int lm_fwd(void *p, double *loss) {
  lm_run *r = p;
  for (size_t i = 0; r->fixed_masks && i < r->lm.cfg.layers; i++) {
    r->lm.blocks[i].drop1.offset = 0;
    r->lm.blocks[i].drop2.offset = 0;
  }
  return ac_lm_forward(&r->lm, r->tokens, r->targets, r->batch, r->t, r->mode, loss);
}

static int lm_bwd(void *p) {
  return ac_lm_backward(&((lm_run *)p)->lm);
}

static void lm_small_config(ac_lm_config *c) {
  ac_lm_config_default(c);
  c->vocab = 11;
  c->ctx = 6;
  c->dim = 8;
  c->heads = 2;
  c->layers = 2;
  c->mlp = 16;
  c->batch = 3;
  c->seed = 7;
  c->tie_head = 0; /* the layers' own init and an untied head; the tied one below */
  c->init = AC_INIT_LAYER;
}

static void lm_setup(lm_run *r, ac_backend *be, const ac_lm_config *c, size_t batch, size_t t) {
  int32_t tok[64], tgt[64];
  assert_true(batch * t <= 64);
  rng_seed(3);
  for (size_t i = 0; i < batch * t; i++) {
    tok[i] = (int32_t)((frand() + 1.0f) * 0.5f * (float)c->vocab) % (int32_t)c->vocab;
    tgt[i] = (int32_t)((frand() + 1.0f) * 0.5f * (float)c->vocab) % (int32_t)c->vocab;
  }
  tgt[1] = -1; /* an ignored position */
  memset(r, 0, sizeof *r);
  OK(ac_lm_init(&r->lm, be, c));
  r->tokens = dev_upload(be, tok, batch * t * sizeof(int32_t));
  r->targets = dev_upload(be, tgt, batch * t * sizeof(int32_t));
  r->batch = batch;
  r->t = t;
  r->mode = AC_MODE_TRAIN;
}

static void lm_teardown(lm_run *r, ac_backend *be) {
  ac_free(be, r->tokens);
  ac_free(be, r->targets);
  ac_lm_destroy(&r->lm);
}

static void test_lm_params(void **state) {
  ac_backend *be = backend(state);
  ac_lm_config c;
  ac_lm lm;
  ac_param_list list;
  lm_small_config(&c);
  ac_param_list_init(&list);
  OK(ac_lm_init(&lm, be, &c));
  OK(ac_lm_params(&lm, &list));
  /* tok, pos, 2 x (ln1 2, attn 4, ln2 2, fc1 2, fc2 2), lnf 2, head 2 */
  assert_int_equal(list.n, 2 + 2 * 12 + 4);
  assert_string_equal(list.items[0]->name, "tok.weight");
  assert_string_equal(list.items[1]->name, "pos.weight");
  assert_string_equal(list.items[2]->name, "layer0.ln1.weight");
  assert_non_null(ac_param_list_find(&list, "layer1.attn.qkv.weight"));
  assert_non_null(ac_param_list_find(&list, "layer1.mlp.fc2.bias"));
  assert_string_equal(list.items[list.n - 1]->name, "head.bias");
  size_t d = c.dim, per_block = 4 * d + 3 * d * d + 3 * d + d * d + d + 2 * d * c.mlp + c.mlp + d;
  assert_int_equal(ac_param_list_numel(&list),
                   c.vocab * d + c.ctx * d + 2 * per_block + 2 * d + d * c.vocab + c.vocab);
  ac_param_list_destroy(&list);
  ac_lm_destroy(&lm);

  c.heads = 3; /* dim 8 is not a multiple */
  assert_int_equal(ac_lm_init(&lm, be, &c), AC_EINVAL);
  ac_lm_destroy(&lm);
}

static void test_lm_gradients(void **state) {
  ac_backend *be = backend(state);
  ac_lm_config c;
  lm_run r;
  ac_param_list list;
  lm_small_config(&c);
  lm_setup(&r, be, &c, 2, 5); /* fewer than the maximum batch and context */
  ac_param_list_init(&list);
  OK(ac_lm_params(&r.lm, &list));
  model_ops m = {lm_fwd, lm_bwd, &r};
  double loss = loss_now(&m);
  assert_true(fabs(loss - log((double)c.vocab)) < 0.5);
  rng_seed(11);
  check_directional(&m, &list);
  check_sgd_lowers_loss(&m, &list, 0.5f, 30);
  r.mode = AC_MODE_EVAL;
  assert_true(isfinite(loss_now(&m)));
  ac_param_list_destroy(&list);
  lm_teardown(&r, be);
}

/* Sum of squares of a parameter's values (host copy). */
static double sumsq(const ac_param *p) {
  float *v = host_of(&p->value);
  double s = 0.0;
  for (size_t i = 0; i < p->value.numel; i++) s += (double)v[i] * v[i];
  free(v);
  return s;
}

/* The tied head: no "head.weight" parameter, the gradient of "tok.weight" passes the
 * directional check (finite differences of the loss moving the one shared matrix), and it
 * equals the sum of the gradients of the embedding and of the head of an untied model whose
 * head holds the same matrix. N(0, 0.02^2) init: every linear has std ~0.02. */
static void test_lm_tied_head(void **state) {
  ac_backend *be = backend(state);
  ac_lm_config c;
  lm_run r, u;
  ac_param_list list, ulist;
  lm_small_config(&c);
  c.dim = 16;
  c.mlp = 32;
  c.tie_head = 1;
  c.init = AC_INIT_NORMAL002;
  lm_setup(&r, be, &c, 2, 5);
  ac_param_list_init(&list);
  OK(ac_lm_params(&r.lm, &list));
  assert_int_equal(list.n, 2 + 2 * 12 + 2 + 1);
  assert_null(ac_param_list_find(&list, "head.weight"));
  assert_string_equal(list.items[list.n - 1]->name, "head.bias");
  ac_param *tok = ac_param_list_find(&list, "tok.weight");
  ac_param *fc1 = ac_param_list_find(&list, "layer1.mlp.fc1.weight");
  double sd = sqrt(sumsq(fc1) / (double)fc1->value.numel);
  assert_true(fabs(sd - 0.02) < 0.003); /* 512 draws: ~3% standard error */
  model_ops m = {lm_fwd, lm_bwd, &r};
  assert_true(fabs(loss_now(&m) - log((double)c.vocab)) < 0.1);
  rng_seed(17);
  check_directional(&m, &list);
  check_sgd_lowers_loss(&m, &list, 0.5f, 30);

  /* The sum of both uses, against an untied model holding the same numbers. */
  c.tie_head = 0;
  lm_setup(&u, be, &c, 2, 5);
  ac_param_list_init(&ulist);
  OK(ac_lm_params(&u.lm, &ulist));
  assert_int_equal(ulist.n, list.n + 1);
  for (size_t k = 0; k < list.n; k++) {
    ac_param *dst = ac_param_list_find(&ulist, list.items[k]->name);
    assert_non_null(dst);
    float *v = host_of(&list.items[k]->value);
    OK(ac_tensor_upload(&dst->value, v));
    if (list.items[k] == tok)
      OK(ac_tensor_upload(&ac_param_list_find(&ulist, "head.weight")->value, v));
    free(v);
  }
  model_ops mu = {lm_fwd, lm_bwd, &u};
  OK(ac_param_list_zero_grad(&list));
  OK(ac_param_list_zero_grad(&ulist));
  double lt = loss_now(&m), lu = loss_now(&mu);
  assert_true(fabs(lt - lu) <= 1e-6 * fabs(lu));
  OK(lm_bwd(&r));
  OK(lm_bwd(&u));
  float *gt = host_of(&tok->grad);
  float *ge = host_of(&ac_param_list_find(&ulist, "tok.weight")->grad);
  float *gh = host_of(&ac_param_list_find(&ulist, "head.weight")->grad);
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < tok->grad.numel; i++) {
    double want = (double)ge[i] + gh[i];
    err = fmax(err, fabs(gt[i] - want));
    norm = fmax(norm, fabs(want));
  }
  assert_true(norm > 0.0);
  assert_true(err <= 1e-5 * norm);
  free(gt);
  free(ge);
  free(gh);
  ac_param_list_destroy(&ulist);
  lm_teardown(&u, be);
  ac_param_list_destroy(&list);
  lm_teardown(&r, be);
}

/* ResNet convs He fan-out: std sqrt(2 / (out_c k k)) (fan-in: sqrt(2 / (in_c k k))), so a
 * conv whose widths differ tells the two apart; any other init is refused. */
static void test_resnet_conv_init(void **state) {
  ac_backend *be = backend(state);
  ac_resnet_config c;
  ac_resnet net;
  ac_resnet_config_default(&c);
  c.batch = 2;
  for (int fan_out = 0; fan_out <= 1; fan_out++) {
    c.conv_init = fan_out ? AC_INIT_HE_FAN_OUT : AC_INIT_LAYER;
    OK(ac_resnet_init(&net, be, &c));
    ac_param *w = &net.blocks[3].conv1.weight; /* 16 -> 32 channels, 3x3 */
    double sd = sqrt(sumsq(w) / (double)w->value.numel);
    double want = sqrt(2.0 / ((fan_out ? 32.0 : 16.0) * 9.0));
    if (fabs(sd - want) > 0.03 * want)
      fail_msg("fan_out %d: std %.5f, want %.5f", fan_out, sd, want);
    ac_resnet_destroy(&net);
  }
  c.conv_init = AC_INIT_NORMAL002;
  assert_int_equal(ac_resnet_init(&net, be, &c), AC_EINVAL);
}

/* With dropout active and the masks held fixed, the gradients still match: the masks are
 * applied on the way back too. */
static void test_lm_gradients_dropout(void **state) {
  ac_backend *be = backend(state);
  ac_lm_config c;
  lm_run r;
  ac_param_list list;
  lm_small_config(&c);
  c.dropout = 0.2f;
  lm_setup(&r, be, &c, 3, 6);
  r.fixed_masks = 1;
  ac_param_list_init(&list);
  OK(ac_lm_params(&r.lm, &list));
  model_ops m = {lm_fwd, lm_bwd, &r};
  assert_true(loss_now(&m) == loss_now(&m));
  rng_seed(13);
  check_directional(&m, &list);
  ac_param_list_destroy(&list);
  lm_teardown(&r, be);
}

/* Dropout: two models with the same seed give the same training losses; the dropped run
 * differs from the run without dropout; eval mode ignores dropout. */
static void test_lm_dropout(void **state) {
  ac_backend *be = backend(state);
  ac_lm_config c;
  lm_run a, b, z;
  lm_small_config(&c);
  lm_setup(&z, be, &c, 3, 6);
  c.dropout = 0.3f;
  lm_setup(&a, be, &c, 3, 6);
  lm_setup(&b, be, &c, 3, 6);
  model_ops ma = {lm_fwd, lm_bwd, &a}, mb = {lm_fwd, lm_bwd, &b}, mz = {lm_fwd, lm_bwd, &z};
  double la1 = loss_now(&ma), la2 = loss_now(&ma), lb1 = loss_now(&mb), lb2 = loss_now(&mb);
  double lz = loss_now(&mz);
  assert_true(la1 == lb1 && la2 == lb2);
  assert_true(la1 != la2 && la1 != lz); /* fresh masks each step */
  a.mode = AC_MODE_EVAL;
  z.mode = AC_MODE_EVAL;
  assert_true(loss_now(&ma) == loss_now(&mz));
  lm_teardown(&a, be);
  lm_teardown(&b, be);
  lm_teardown(&z, be);
}

/* ------------------------------------------------------------------------------------ */
/* ResNet                                                                                  */

typedef struct {
  ac_resnet net;
  float *images;
  int32_t *labels;
  size_t batch;
  ac_mode mode;
} rn_run;

static int rn_fwd(void *p, double *loss) {
  rn_run *r = p;
  return ac_resnet_forward(&r->net, r->images, r->labels, r->batch, r->mode, loss);
}

static int rn_bwd(void *p) {
  return ac_resnet_backward(&((rn_run *)p)->net);
}

static void rn_small_config(ac_resnet_config *c) {
  ac_resnet_config_default(c);
  c->h = 9;
  c->w = 8;
  c->classes = 3;
  c->stages = 2;
  c->blocks = 2;
  c->width[0] = 4;
  c->width[1] = 6;
  c->batch = 5;
  c->chunk = 2;
  c->seed = 5;
  c->conv_init = AC_INIT_LAYER; /* the weights these checks were tuned on (ReLU kinks) */
}

static void rn_setup(rn_run *r, ac_backend *be, const ac_resnet_config *c, size_t batch) {
  size_t n = batch * c->in_c * c->h * c->w;
  float *img = malloc(n * sizeof *img);
  int32_t lab[16];
  assert_non_null(img);
  assert_true(batch <= 16);
  rng_seed(4);
  for (size_t i = 0; i < n; i++) img[i] = frand();
  for (size_t i = 0; i < batch; i++) lab[i] = (int32_t)(i % c->classes);
  memset(r, 0, sizeof *r);
  OK(ac_resnet_init(&r->net, be, c));
  r->images = dev_upload(be, img, n * sizeof *img);
  r->labels = dev_upload(be, lab, batch * sizeof(int32_t));
  r->batch = batch;
  r->mode = AC_MODE_TRAIN;
  free(img);
}

static void rn_teardown(rn_run *r, ac_backend *be) {
  ac_free(be, r->images);
  ac_free(be, r->labels);
  ac_resnet_destroy(&r->net);
}

static void test_resnet_params(void **state) {
  ac_backend *be = backend(state);
  ac_resnet_config c;
  ac_resnet net;
  ac_param_list list;
  ac_resnet_config_default(&c);
  c.batch = 2;
  ac_param_list_init(&list);
  OK(ac_resnet_init(&net, be, &c));
  OK(ac_resnet_params(&net, &list));
  /* ResNet-20 for 28x28x1: stem conv+bn (3), 9 blocks x (conv, bn, conv, bn: 6) plus two
   * projection shortcuts (3 each), fc (2). */
  assert_int_equal(list.n, 3 + 9 * 6 + 2 * 3 + 2);
  assert_string_equal(list.items[0]->name, "stem.conv.weight");
  assert_non_null(ac_param_list_find(&list, "stage1.block0.short.conv.weight"));
  assert_null(ac_param_list_find(&list, "stage1.block1.short.conv.weight"));
  assert_non_null(ac_param_list_find(&list, "stage2.block2.bn2.bias"));
  assert_string_equal(list.items[list.n - 1]->name, "fc.bias");
  assert_int_equal(net.blocks[8].oh, 7);
  assert_int_equal(net.blocks[8].ow, 7);
  ac_param_list_destroy(&list);
  ac_resnet_destroy(&net);
  c.stages = AC_RESNET_MAX_STAGES + 1;
  assert_int_equal(ac_resnet_init(&net, be, &c), AC_EINVAL);
}

static void test_resnet_gradients(void **state) {
  ac_backend *be = backend(state);
  ac_resnet_config c;
  rn_run r;
  ac_param_list list;
  rn_small_config(&c);
  rn_setup(&r, be, &c, 5);
  ac_param_list_init(&list);
  OK(ac_resnet_params(&r.net, &list));
  model_ops m = {rn_fwd, rn_bwd, &r};
  double loss = loss_now(&m);
  assert_true(isfinite(loss) && loss > 0.0);
  rng_seed(12);
  check_directional(&m, &list);
  check_sgd_lowers_loss(&m, &list, 0.1f, 20);
  r.mode = AC_MODE_EVAL;
  assert_true(isfinite(loss_now(&m)));
  ac_param_list_destroy(&list);
  rn_teardown(&r, be);
}

/* Bad calls get AC_EINVAL and change nothing; a batch whose targets are all ignored has
 * loss 0 and zero gradients. */
static void test_bad_input(void **state) {
  ac_backend *be = backend(state);
  ac_lm_config c;
  lm_run r;
  ac_param_list list;
  double loss = -1.0;
  lm_small_config(&c);
  lm_setup(&r, be, &c, 3, 6);
  assert_int_equal(ac_lm_backward(&r.lm), AC_EINVAL); /* before any forward */
  assert_int_equal(ac_lm_forward(&r.lm, r.tokens, r.targets, 4, 6, AC_MODE_TRAIN, &loss),
                   AC_EINVAL);
  assert_int_equal(ac_lm_forward(&r.lm, r.tokens, r.targets, 3, 7, AC_MODE_TRAIN, &loss),
                   AC_EINVAL);
  assert_int_equal(ac_lm_forward(&r.lm, NULL, r.targets, 3, 6, AC_MODE_TRAIN, &loss), AC_EINVAL);
  assert_int_equal(ac_lm_forward(&r.lm, r.tokens, r.targets, 3, 6, (ac_mode)7, &loss), AC_EINVAL);
  assert_true(loss == -1.0);

  int32_t ignored[18];
  for (int i = 0; i < 18; i++)
    ignored[i] = i % 2 ? -1 : (int32_t)c.vocab; /* both sides of the range */
  OK(ac_memcpy_h2d(be, r.targets, ignored, sizeof ignored));
  ac_param_list_init(&list);
  OK(ac_lm_params(&r.lm, &list));
  OK(ac_param_list_zero_grad(&list));
  OK(ac_lm_forward(&r.lm, r.tokens, r.targets, 3, 6, AC_MODE_TRAIN, &loss));
  assert_true(loss == 0.0);
  OK(ac_lm_backward(&r.lm));
  for (size_t k = 0; k < list.n; k++) {
    double sq = -1.0;
    OK(ac_sumsq_to_host(be, list.items[k]->grad.numel, ac_tensor_f32(&list.items[k]->grad), &sq));
    assert_true(sq == 0.0);
  }
  ac_param_list_destroy(&list);
  lm_teardown(&r, be);

  ac_resnet_config rc;
  ac_resnet net;
  rn_small_config(&rc);
  rc.width[1] = 0;
  assert_int_equal(ac_resnet_init(&net, be, &rc), AC_EINVAL);
  ac_resnet_destroy(&net);
  rn_small_config(&rc);
  rc.h = 1; /* one row: every 3x3, pad 1 conv (stride 1 or 2) keeps one row */
  OK(ac_resnet_init(&net, be, &rc));
  ac_resnet_destroy(&net);
  rn_run rr;
  rn_small_config(&rc);
  rn_setup(&rr, be, &rc, 5);
  assert_int_equal(ac_resnet_backward(&rr.net), AC_EINVAL);
  assert_int_equal(ac_resnet_forward(&rr.net, rr.images, rr.labels, 6, AC_MODE_TRAIN, &loss),
                   AC_EINVAL);
  assert_int_equal(ac_resnet_forward(&rr.net, rr.images, NULL, 5, AC_MODE_TRAIN, &loss), AC_EINVAL);
  rn_teardown(&rr, be);
}

/* ------------------------------------------------------------------------------------ */
/* CUDA against CPU: same seeds, same inputs, one training step                            */

static void compare_lists(ac_param_list *a, ac_param_list *b) {
  assert_int_equal(a->n, b->n);
  for (size_t k = 0; k < a->n; k++) {
    size_t n = a->items[k]->grad.numel;
    float *ga = host_of(&a->items[k]->grad), *gb = host_of(&b->items[k]->grad);
    double num = 0.0, den = 1e-3;
    for (size_t i = 0; i < n; i++) {
      num = fmax(num, fabs((double)ga[i] - gb[i]));
      den = fmax(den, fabs((double)gb[i]));
    }
    if (!(num / den <= TOL_XBE))
      fail_msg("%s: gradient differs from CPU (rel %.3g)", a->items[k]->name, num / den);
    free(ga);
    free(gb);
  }
}

static void test_cross_backend(void **state) {
  fixture *f = *state;
  if (f->be == NULL || f->cpu == NULL) skip(); /* only in the CUDA group, with a device */
  ac_lm_config lc;
  lm_run la, lb;
  ac_param_list pa, pb;
  lm_small_config(&lc);
  lm_setup(&la, f->be, &lc, 3, 6);
  lm_setup(&lb, f->cpu, &lc, 3, 6);
  ac_param_list_init(&pa);
  ac_param_list_init(&pb);
  OK(ac_lm_params(&la.lm, &pa));
  OK(ac_lm_params(&lb.lm, &pb));
  model_ops ma = {lm_fwd, lm_bwd, &la}, mb = {lm_fwd, lm_bwd, &lb};
  assert_true(fabs(loss_now(&ma) - loss_now(&mb)) < 1e-4);
  OK(lm_bwd(&la));
  OK(lm_bwd(&lb));
  compare_lists(&pa, &pb);
  ac_param_list_destroy(&pa);
  ac_param_list_destroy(&pb);
  lm_teardown(&la, f->be);
  lm_teardown(&lb, f->cpu);

  ac_resnet_config rc;
  rn_run ra, rb;
  rn_small_config(&rc);
  rn_setup(&ra, f->be, &rc, 5);
  rn_setup(&rb, f->cpu, &rc, 5);
  ac_param_list_init(&pa);
  ac_param_list_init(&pb);
  OK(ac_resnet_params(&ra.net, &pa));
  OK(ac_resnet_params(&rb.net, &pb));
  model_ops na = {rn_fwd, rn_bwd, &ra}, nb = {rn_fwd, rn_bwd, &rb};
  assert_true(fabs(loss_now(&na) - loss_now(&nb)) < 1e-4);
  OK(rn_bwd(&ra));
  OK(rn_bwd(&rb));
  compare_lists(&pa, &pb);
  ac_param_list_destroy(&pa);
  ac_param_list_destroy(&pb);
  rn_teardown(&ra, f->be);
  rn_teardown(&rb, f->cpu);
}

/* ------------------------------------------------------------------------------------ */
/* Groups                                                                                  */

#define MODEL_TESTS                                                                     \
  cmocka_unit_test(test_lm_params), cmocka_unit_test(test_lm_gradients),                \
      cmocka_unit_test(test_lm_gradients_dropout), cmocka_unit_test(test_lm_tied_head), \
      cmocka_unit_test(test_resnet_conv_init), cmocka_unit_test(test_lm_dropout),       \
      cmocka_unit_test(test_resnet_params), cmocka_unit_test(test_resnet_gradients),    \
      cmocka_unit_test(test_bad_input), cmocka_unit_test(test_cross_backend)

int main(void) {
  const struct CMUnitTest cpu[] = {MODEL_TESTS};
  const struct CMUnitTest cuda[] = {MODEL_TESTS};
  int failed = cmocka_run_group_tests_name("model-cpu", cpu, setup_cpu, teardown);
  failed += cmocka_run_group_tests_name("model-cuda", cuda, setup_cuda, teardown);
  return failed;
}
